//! Task events, in order.
//!
//! Everything that publishes an event sends it into one unbounded channel;
//! one forwarder task drains it into containerd's publisher. A sender emits
//! an event while it holds the lock of the state change the event reports,
//! so channel order is state-change order: create → start → exit → delete,
//! exec-added → exec-started → exit.

use std::time::Duration;

use async_trait::async_trait;
use containerd_shim::publisher::RemotePublisher;
use containerd_shim::Context;
use containerd_shim_protos::events::task::{
    TaskCreate, TaskDelete, TaskExecAdded, TaskExecStarted, TaskExit, TaskOOM, TaskPaused,
    TaskResumed, TaskStart,
};
use containerd_shim_protos::protobuf::MessageDyn;
use containerd_shim_protos::topics;
use tokio::sync::mpsc;

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

/// The sending half; cheap to clone, never blocks.
#[derive(Clone, Debug)]
pub struct EventSink(mpsc::UnboundedSender<Event>);

impl EventSink {
    pub fn channel() -> (EventSink, mpsc::UnboundedReceiver<Event>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (EventSink(tx), rx)
    }

    pub fn send(&self, event: Event) {
        if self.0.send(event).is_err() {
            log::warn!("event forwarder is gone; event dropped");
        }
    }
}

/// How long one event may take to reach containerd's publisher, as
/// runc-shim bounds it: a containerd that does not take events must not
/// hold back every later one forever.
pub const PUBLISH_TIMEOUT: Duration = Duration::from_secs(5);

/// Where the forwarder delivers events: containerd's publisher, or a test's.
#[async_trait]
pub trait Publish: Send + Sync + 'static {
    async fn publish(
        &self,
        topic: &'static str,
        namespace: &str,
        event: Box<dyn MessageDyn>,
    ) -> Result<(), String>;
}

#[async_trait]
impl Publish for RemotePublisher {
    async fn publish(
        &self,
        topic: &'static str,
        namespace: &str,
        event: Box<dyn MessageDyn>,
    ) -> Result<(), String> {
        RemotePublisher::publish(self, Context::default(), topic, namespace, event)
            .await
            .map_err(|e| e.to_string())
    }
}

/// Forward events to containerd, one at a time, in channel order.
pub fn spawn_forwarder(
    publisher: impl Publish,
    namespace: String,
    rx: mpsc::UnboundedReceiver<Event>,
) {
    tokio::spawn(forward(publisher, namespace, rx, PUBLISH_TIMEOUT));
}

/// The forwarder's loop: each event gets at most `limit`; one that fails or
/// takes longer is dropped with a log line, and the next one goes.
async fn forward(
    publisher: impl Publish,
    namespace: String,
    mut rx: mpsc::UnboundedReceiver<Event>,
    limit: Duration,
) {
    while let Some(event) = rx.recv().await {
        let topic = event.topic();
        match tokio::time::timeout(
            limit,
            publisher.publish(topic, &namespace, event.into_message()),
        )
        .await
        {
            Ok(Ok(())) => {}
            Ok(Err(e)) => log::error!("publishing {topic}: {e}; event dropped"),
            Err(_) => log::error!(
                "publishing {topic}: containerd did not take it within {} ms; event dropped",
                limit.as_millis()
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn events_keep_send_order_and_topics() {
        let (sink, mut rx) = EventSink::channel();
        let s2 = sink.clone();
        sink.send(Event::Create(TaskCreate::default()));
        s2.send(Event::Start(TaskStart::default()));
        sink.send(Event::Exit(TaskExit::default()));
        s2.send(Event::Delete(TaskDelete::default()));
        let mut got = Vec::new();
        for _ in 0..4 {
            got.push(rx.recv().await.unwrap().topic());
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

    /// Never answers for `/tasks/create`, fails `/tasks/exit`, records the rest.
    struct Stuck(mpsc::UnboundedSender<&'static str>);

    #[async_trait]
    impl Publish for Stuck {
        async fn publish(
            &self,
            topic: &'static str,
            _namespace: &str,
            _event: Box<dyn MessageDyn>,
        ) -> Result<(), String> {
            match topic {
                topics::TASK_CREATE_EVENT_TOPIC => std::future::pending().await,
                topics::TASK_EXIT_EVENT_TOPIC => Err("refused".into()),
                _ => {
                    let _ = self.0.send(topic);
                    Ok(())
                }
            }
        }
    }

    #[tokio::test]
    async fn a_publish_that_hangs_is_dropped_after_the_limit() {
        let (sink, rx) = EventSink::channel();
        let (seen_tx, mut seen) = mpsc::unbounded_channel();
        let limit = Duration::from_millis(50);
        let forwarder = tokio::spawn(forward(Stuck(seen_tx), "ns".into(), rx, limit));
        let began = std::time::Instant::now();
        sink.send(Event::Create(TaskCreate::default()));
        sink.send(Event::Start(TaskStart::default()));
        sink.send(Event::Exit(TaskExit::default()));
        sink.send(Event::Delete(TaskDelete::default()));
        // The hung create and the refused exit are dropped; the others
        // still go, in order, once the create's time is up.
        assert_eq!(seen.recv().await, Some("/tasks/start"));
        assert!(began.elapsed() >= limit);
        assert_eq!(seen.recv().await, Some("/tasks/delete"));
        drop(sink);
        tokio::time::timeout(Duration::from_secs(5), forwarder)
            .await
            .expect("the forwarder ends with its channel")
            .unwrap();
        assert_eq!(PUBLISH_TIMEOUT, Duration::from_secs(5));
    }
}
