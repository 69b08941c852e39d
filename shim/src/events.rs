//! Task events, in order.
//!
//! Everything that publishes an event sends it into one unbounded channel;
//! one forwarder task drains it into containerd's event service. A sender
//! emits an event while it holds the lock of the state change the event
//! reports, so channel order is state-change order: create → start → exit
//! → delete, exec-added → exec-started → exit. The forwarder keeps that
//! order across a containerd restart: the head of the queue is retried
//! until containerd answers again, and nothing overtakes it.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use async_trait::async_trait;
use containerd_shim_protos::events::task::{
    TaskCreate, TaskDelete, TaskExecAdded, TaskExecStarted, TaskExit, TaskOOM, TaskPaused,
    TaskResumed, TaskStart,
};
use containerd_shim_protos::protobuf::well_known_types::any::Any;
use containerd_shim_protos::protobuf::MessageDyn;
use containerd_shim_protos::shim::event::Envelope;
use containerd_shim_protos::shim::events::ForwardRequest;
use containerd_shim_protos::shim_async::{Client, EventsClient};
use containerd_shim_protos::topics;
use containerd_shim_protos::ttrpc::{self, context::Context};
use tokio::sync::{mpsc, watch};

use crate::time::timestamp;

/// One task event and its topic.
#[derive(Debug, Clone)]
pub enum Event {
    Create(TaskCreate),
    Start(TaskStart),
    Exit(TaskExit),
    Delete(TaskDelete),
    ExecAdded(TaskExecAdded),
    ExecStarted(TaskExecStarted),
    Oom(TaskOOM),
    Paused(TaskPaused),
    Resumed(TaskResumed),
}

impl Event {
    pub fn topic(&self) -> &'static str {
        match self {
            Event::Create(_) => topics::TASK_CREATE_EVENT_TOPIC,
            Event::Start(_) => topics::TASK_START_EVENT_TOPIC,
            Event::Exit(_) => topics::TASK_EXIT_EVENT_TOPIC,
            Event::Delete(_) => topics::TASK_DELETE_EVENT_TOPIC,
            Event::ExecAdded(_) => topics::TASK_EXEC_ADDED_EVENT_TOPIC,
            Event::ExecStarted(_) => topics::TASK_EXEC_STARTED_EVENT_TOPIC,
            Event::Oom(_) => topics::TASK_OOM_EVENT_TOPIC,
            Event::Paused(_) => topics::TASK_PAUSED_EVENT_TOPIC,
            Event::Resumed(_) => topics::TASK_RESUMED_EVENT_TOPIC,
        }
    }

    fn into_message(self) -> Box<dyn MessageDyn> {
        match self {
            Event::Create(e) => Box::new(e),
            Event::Start(e) => Box::new(e),
            Event::Exit(e) => Box::new(e),
            Event::Delete(e) => Box::new(e),
            Event::ExecAdded(e) => Box::new(e),
            Event::ExecStarted(e) => Box::new(e),
            Event::Oom(e) => Box::new(e),
            Event::Paused(e) => Box::new(e),
            Event::Resumed(e) => Box::new(e),
        }
    }
}

/// One event as it waits for containerd: stamped when it happened, so a
/// retry carries the time of the change, not of the delivery.
struct Queued {
    event: Event,
    at: SystemTime,
}

/// The sending half; cheap to clone, never blocks.
#[derive(Clone, Debug)]
pub struct EventSink {
    tx: mpsc::UnboundedSender<Queued>,
    /// Events sent and not yet delivered or given up on.
    pending: Arc<watch::Sender<usize>>,
}

/// The forwarder's half.
pub struct EventQueue {
    rx: mpsc::UnboundedReceiver<Queued>,
    pending: Arc<watch::Sender<usize>>,
}

impl EventQueue {
    /// The next event without waiting (tests read what a call published).
    #[cfg(test)]
    pub fn try_recv(&mut self) -> Result<Event, mpsc::error::TryRecvError> {
        self.rx.try_recv().map(|q| q.event)
    }
}

impl EventSink {
    pub fn channel() -> (EventSink, EventQueue) {
        let (tx, rx) = mpsc::unbounded_channel();
        let pending = Arc::new(watch::Sender::new(0));
        (
            EventSink {
                tx,
                pending: pending.clone(),
            },
            EventQueue { rx, pending },
        )
    }

    pub fn send(&self, event: Event) {
        self.pending.send_modify(|n| *n += 1);
        let queued = Queued {
            event,
            at: SystemTime::now(),
        };
        if self.tx.send(queued).is_err() {
            self.pending.send_modify(|n| *n = n.saturating_sub(1));
            log::warn!("event forwarder is gone; event dropped");
        }
    }

    /// Wait until every event sent so far has been delivered (or given up
    /// on), for at most `limit`: the shim's last events (the delete, after
    /// which containerd shuts the shim down) must reach containerd before
    /// the process ends. False when the limit came first.
    pub async fn flushed(&self, limit: Duration) -> bool {
        let mut rx = self.pending.subscribe();
        tokio::time::timeout(limit, rx.wait_for(|n| *n == 0))
            .await
            .is_ok_and(|r| r.is_ok())
    }
}

/// How long one attempt to hand an event to containerd may take, as
/// runc-shim bounds it.
pub const PUBLISH_TIMEOUT: Duration = Duration::from_secs(5);

/// The first pause between two attempts at one event, and the longest:
/// a containerd that restarts answers again within a few of them.
pub const RETRY_FIRST: Duration = Duration::from_millis(10);
pub const RETRY_MAX: Duration = Duration::from_millis(200);

/// Attempts at one event that containerd answered with an error, or did
/// not answer within [`PUBLISH_TIMEOUT`], before it is dropped: retrying a
/// refusal cannot help, and a containerd that takes no events must not
/// hold back every later one forever.
pub const MAX_ANSWERED_FAILURES: u32 = 3;

/// Why one attempt failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PublishError {
    /// No connection: containerd is down or restarting. The event waits,
    /// and every later one behind it, until containerd answers again.
    Unreachable(String),
    /// containerd answered with an error.
    Refused(String),
}

impl std::fmt::Display for PublishError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PublishError::Unreachable(e) => write!(f, "containerd unreachable: {e}"),
            PublishError::Refused(e) => write!(f, "containerd refused it: {e}"),
        }
    }
}

/// Where the forwarder delivers events: containerd, or a test's.
#[async_trait]
pub trait Publish: Send + 'static {
    async fn publish(&mut self, envelope: &Envelope) -> Result<(), PublishError>;

    /// Forget the connection (after an attempt that timed out): the next
    /// attempt dials again.
    fn reset(&mut self) {}
}

/// containerd's event service (`containerd.services.events.ttrpc.v1.Events`
/// at `TTRPC_ADDRESS`), dialled on demand. The containerd-shim crate's own
/// publisher puts a failed event back at the end of its queue after a
/// second, so an exit that fails across a containerd restart arrives after
/// the delete that followed it, or never; this one retries the head of
/// the queue until it goes.
pub struct ContainerdEvents {
    address: String,
    client: Option<EventsClient>,
}

impl ContainerdEvents {
    pub fn new(address: &str) -> Self {
        let address = if address.contains("://") {
            address.to_string()
        } else {
            format!("unix://{address}")
        };
        ContainerdEvents {
            address,
            client: None,
        }
    }
}

#[async_trait]
impl Publish for ContainerdEvents {
    async fn publish(&mut self, envelope: &Envelope) -> Result<(), PublishError> {
        let client = match &self.client {
            Some(c) => c,
            None => {
                let c = Client::connect(&self.address)
                    .await
                    .map_err(|e| PublishError::Unreachable(e.to_string()))?;
                self.client.insert(EventsClient::new(c))
            }
        };
        let mut req = ForwardRequest::new();
        req.set_envelope(envelope.clone());
        match client.forward(Context::default(), &req).await {
            Ok(_) => Ok(()),
            Err(ttrpc::Error::RpcStatus(status)) => Err(PublishError::Refused(format!(
                "{:?}: {}",
                status.code(),
                status.message()
            ))),
            // Closed, EOF, a socket error: the connection is gone.
            Err(e) => {
                self.client = None;
                Err(PublishError::Unreachable(e.to_string()))
            }
        }
    }

    fn reset(&mut self) {
        self.client = None;
    }
}

/// Forward events to containerd, one at a time, in channel order.
pub fn spawn_forwarder(publisher: impl Publish, namespace: String, queue: EventQueue) {
    tokio::spawn(forward(publisher, namespace, queue, PUBLISH_TIMEOUT));
}

/// The envelope containerd's `Forward` takes.
fn envelope(namespace: &str, queued: Queued) -> Result<Envelope, String> {
    let topic = queued.event.topic();
    let message = queued.event.into_message();
    let mut value = Vec::new();
    message
        .write_to_vec_dyn(&mut value)
        .map_err(|e| e.to_string())?;
    let mut envelope = Envelope::new();
    envelope.set_timestamp(timestamp(queued.at));
    envelope.set_namespace(namespace.to_string());
    envelope.set_topic(topic.to_string());
    envelope.set_event(Any {
        type_url: message.descriptor_dyn().full_name().to_string(),
        value,
        ..Default::default()
    });
    Ok(envelope)
}

/// The forwarder's loop. The event at the head of the queue is retried,
/// every later one waiting behind it, until it is delivered: order is
/// kept across a containerd restart. Only an event that containerd itself
/// refuses, or leaves unanswered past `limit`, [`MAX_ANSWERED_FAILURES`]
/// times is dropped, with a log line.
async fn forward(
    mut publisher: impl Publish,
    namespace: String,
    queue: EventQueue,
    limit: Duration,
) {
    let EventQueue { mut rx, pending } = queue;
    while let Some(queued) = rx.recv().await {
        let topic = queued.event.topic();
        match envelope(&namespace, queued) {
            Ok(envelope) => deliver(&mut publisher, topic, &envelope, limit).await,
            Err(e) => log::error!("encoding {topic}: {e}; event dropped"),
        }
        pending.send_modify(|n| *n = n.saturating_sub(1));
    }
}

async fn deliver(publisher: &mut impl Publish, topic: &str, envelope: &Envelope, limit: Duration) {
    let mut pause = RETRY_FIRST;
    let mut answered_failures = 0;
    let mut unreachable_since: Option<Instant> = None;
    loop {
        let failure = match tokio::time::timeout(limit, publisher.publish(envelope)).await {
            Ok(Ok(())) => {
                if let Some(since) = unreachable_since {
                    log::info!(
                        "publishing {topic}: containerd answers again after {} ms; delivered",
                        since.elapsed().as_millis()
                    );
                }
                return;
            }
            Ok(Err(e @ PublishError::Unreachable(_))) => {
                if unreachable_since.is_none() {
                    unreachable_since = Some(Instant::now());
                    log::warn!("publishing {topic}: {e}; holding it and the events behind it until containerd answers");
                }
                None
            }
            Ok(Err(e @ PublishError::Refused(_))) => Some(e.to_string()),
            Err(_) => {
                publisher.reset();
                Some(format!("no answer within {} ms", limit.as_millis()))
            }
        };
        if let Some(why) = failure {
            answered_failures += 1;
            if answered_failures >= MAX_ANSWERED_FAILURES {
                log::error!("publishing {topic}: {why}, {answered_failures} times; event dropped");
                return;
            }
            log::warn!("publishing {topic}: {why}; retrying");
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(RETRY_MAX);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use containerd_shim_protos::protobuf::Message;

    #[tokio::test]
    async fn events_keep_send_order_and_topics() {
        let (sink, mut q) = EventSink::channel();
        let s2 = sink.clone();
        sink.send(Event::Create(TaskCreate::default()));
        s2.send(Event::Start(TaskStart::default()));
        sink.send(Event::Exit(TaskExit::default()));
        s2.send(Event::Delete(TaskDelete::default()));
        let mut got = Vec::new();
        for _ in 0..4 {
            got.push(q.rx.recv().await.unwrap().event.topic());
        }
        assert_eq!(
            got,
            [
                "/tasks/create",
                "/tasks/start",
                "/tasks/exit",
                "/tasks/delete"
            ]
        );
    }

    /// What a test's containerd does with each attempt, by topic.
    #[derive(Clone, Copy)]
    enum Answer {
        Take,
        Refuse,
        Hang,
    }

    /// A containerd that answers by a script: `down` attempts fail as
    /// unreachable first (a restart), then each topic gets its answer.
    struct Scripted {
        down: usize,
        answer: fn(&str) -> Answer,
        delivered: mpsc::UnboundedSender<(String, i64, u32)>,
        attempts: usize,
        resets: Arc<std::sync::atomic::AtomicUsize>,
    }

    #[async_trait]
    impl Publish for Scripted {
        async fn publish(&mut self, envelope: &Envelope) -> Result<(), PublishError> {
            self.attempts += 1;
            if self.attempts <= self.down {
                return Err(PublishError::Unreachable("connection refused".into()));
            }
            match (self.answer)(envelope.topic()) {
                Answer::Take => {
                    let exit = TaskExit::parse_from_bytes(&envelope.event().value).ok();
                    let _ = self.delivered.send((
                        envelope.topic().to_string(),
                        envelope.timestamp().seconds,
                        exit.map_or(0, |e| e.exit_status),
                    ));
                    Ok(())
                }
                Answer::Refuse => Err(PublishError::Refused("InvalidArgument".into())),
                Answer::Hang => std::future::pending().await,
            }
        }

        fn reset(&mut self) {
            self.resets
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    fn scripted(
        down: usize,
        answer: fn(&str) -> Answer,
    ) -> (
        Scripted,
        mpsc::UnboundedReceiver<(String, i64, u32)>,
        Arc<std::sync::atomic::AtomicUsize>,
    ) {
        let (tx, rx) = mpsc::unbounded_channel();
        let resets = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let p = Scripted {
            down,
            answer,
            delivered: tx,
            attempts: 0,
            resets: resets.clone(),
        };
        (p, rx, resets)
    }

    #[tokio::test]
    async fn an_exit_that_meets_a_restarting_containerd_still_comes_before_the_delete() {
        // containerd is down for the first 6 attempts (10+20+40+80+160 ms
        // of pauses): the exit waits, the delete waits behind it.
        let (publisher, mut delivered, _) = scripted(6, |_| Answer::Take);
        let (sink, queue) = EventSink::channel();
        tokio::spawn(forward(
            publisher,
            "ns".into(),
            queue,
            Duration::from_secs(1),
        ));
        let exit = TaskExit {
            exit_status: 137,
            ..Default::default()
        };
        sink.send(Event::Exit(exit));
        let sent = SystemTime::now();
        sink.send(Event::Delete(TaskDelete::default()));
        assert!(
            !sink.flushed(Duration::from_millis(50)).await,
            "not while containerd is down"
        );
        assert!(sink.flushed(Duration::from_secs(5)).await);
        let (topic, at, status) = delivered.recv().await.unwrap();
        assert_eq!((topic.as_str(), status), ("/tasks/exit", 137));
        // Stamped when it happened, not when it was finally delivered.
        let sent = sent
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs() as i64;
        assert!((at - sent).abs() <= 1, "{at} vs {sent}");
        assert_eq!(delivered.recv().await.unwrap().0, "/tasks/delete");
    }

    #[tokio::test]
    async fn a_refused_event_is_dropped_after_its_attempts_and_the_next_goes() {
        let (publisher, mut delivered, _) = scripted(0, |t| match t {
            topics::TASK_CREATE_EVENT_TOPIC => Answer::Refuse,
            _ => Answer::Take,
        });
        let (sink, queue) = EventSink::channel();
        tokio::spawn(forward(
            publisher,
            "ns".into(),
            queue,
            Duration::from_secs(1),
        ));
        sink.send(Event::Create(TaskCreate::default()));
        sink.send(Event::Start(TaskStart::default()));
        assert!(sink.flushed(Duration::from_secs(5)).await);
        assert_eq!(delivered.recv().await.unwrap().0, "/tasks/start");
        assert!(delivered.try_recv().is_err());
    }

    #[tokio::test]
    async fn a_publish_that_hangs_redials_and_is_dropped_after_its_attempts() {
        let (publisher, mut delivered, resets) = scripted(0, |t| match t {
            topics::TASK_CREATE_EVENT_TOPIC => Answer::Hang,
            _ => Answer::Take,
        });
        let (sink, queue) = EventSink::channel();
        let limit = Duration::from_millis(50);
        let began = Instant::now();
        tokio::spawn(forward(publisher, "ns".into(), queue, limit));
        sink.send(Event::Create(TaskCreate::default()));
        sink.send(Event::Start(TaskStart::default()));
        assert_eq!(delivered.recv().await.unwrap().0, "/tasks/start");
        assert!(began.elapsed() >= limit * MAX_ANSWERED_FAILURES);
        assert_eq!(
            resets.load(std::sync::atomic::Ordering::Relaxed),
            MAX_ANSWERED_FAILURES as usize,
            "every timed-out attempt forgets the connection"
        );
        assert_eq!(PUBLISH_TIMEOUT, Duration::from_secs(5));
    }

    #[tokio::test]
    async fn an_unreachable_containerd_never_costs_an_event() {
        // Down for far longer than the answered-failure budget.
        let (publisher, mut delivered, _) = scripted(12, |_| Answer::Take);
        let (sink, queue) = EventSink::channel();
        tokio::spawn(forward(
            publisher,
            "ns".into(),
            queue,
            Duration::from_secs(1),
        ));
        sink.send(Event::Exit(TaskExit::default()));
        assert!(sink.flushed(Duration::from_secs(10)).await);
        assert_eq!(delivered.recv().await.unwrap().0, "/tasks/exit");
    }

    #[tokio::test]
    async fn the_real_publisher_reports_a_missing_containerd_as_unreachable() {
        let d = tempfile::tempdir().unwrap();
        let mut p = ContainerdEvents::new(&d.path().join("none.sock").display().to_string());
        let e = p.publish(&Envelope::new()).await.unwrap_err();
        assert!(matches!(e, PublishError::Unreachable(_)), "{e}");
    }
}
