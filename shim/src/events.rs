//! Task events, in order.
//!
//! Everything that publishes an event sends it into one unbounded channel;
//! one forwarder task drains it into containerd's publisher. A sender emits
//! an event while it holds the lock of the state change the event reports,
//! so channel order is state-change order: create → start → exit → delete,
//! exec-added → exec-started → exit.

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

/// Forward events to containerd, one at a time, in channel order.
pub fn spawn_forwarder(
    publisher: RemotePublisher,
    namespace: String,
    mut rx: mpsc::UnboundedReceiver<Event>,
) {
    tokio::spawn(async move {
        while let Some(event) = rx.recv().await {
            let topic = event.topic();
            if let Err(e) = publisher
                .publish(Context::default(), topic, &namespace, event.into_message())
                .await
            {
                log::error!("publishing {topic}: {e}");
            }
        }
    });
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
}
