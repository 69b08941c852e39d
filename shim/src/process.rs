//! One process of a plain container (its init or an exec) and the one task
//! that turns its exit into state: the exit watcher. The watcher takes the
//! process lock before it records the exit and emits `/tasks/exit`, and Start
//! holds that same lock until `/tasks/start` is queued, so the order of
//! events follows the order of state changes even when a process dies the
//! instant it starts.

use std::sync::Arc;
use std::time::Duration;

use containerd_shim_protos::events::task::TaskExit;
use oci_spec::runtime::Process as ProcessSpec;
use tokio::sync::{oneshot, watch, Mutex};

use crate::error::{Error, Result};
use crate::events::{Event, EventSink};
use crate::exits::Exit;
use crate::io::ProcessIo;
use crate::status::{ExitInfo, ProcessState, Status, Stdio};
use crate::time::timestamp;

/// How long an exit waits for the process's output to reach the FIFOs.
/// Bounded because a daemonised grandchild may hold the pipe open forever.
const OUTPUT_DRAIN: Duration = Duration::from_secs(1);

#[derive(Debug)]
pub struct ProcState {
    pub status: Status,
    pub pid: u32,
    pub io: Option<ProcessIo>,
    pub exit: Option<ExitInfo>,
}

#[derive(Debug)]
pub struct Process {
    pub container_id: String,
    /// `None` for the init process.
    pub exec_id: Option<String>,
    pub stdio: Stdio,
    /// The process an exec runs, kept until its Start.
    pub spec: Option<ProcessSpec>,
    pub state: Mutex<ProcState>,
    exited: watch::Sender<Option<ExitInfo>>,
}

impl Process {
    pub fn new(
        container_id: &str,
        exec_id: Option<&str>,
        stdio: Stdio,
        spec: Option<ProcessSpec>,
    ) -> Arc<Self> {
        Arc::new(Process {
            container_id: container_id.to_string(),
            exec_id: exec_id.map(String::from),
            stdio,
            spec,
            state: Mutex::new(ProcState {
                status: Status::Created,
                pid: 0,
                io: None,
                exit: None,
            }),
            exited: watch::channel(None).0,
        })
    }

    pub async fn snapshot(&self) -> ProcessState {
        let st = self.state.lock().await;
        ProcessState {
            pid: st.pid,
            status: st.status,
            stdio: self.stdio.clone(),
            exit: st.exit,
        }
    }

    /// Wait until the process has exited.
    pub async fn wait(&self) -> Result<ExitInfo> {
        let mut rx = self.exited.subscribe();
        let seen = rx
            .wait_for(Option::is_some)
            .await
            .map_err(|_| Error::FailedPrecondition("process was dropped before exiting".into()))?;
        seen.ok_or_else(|| Error::FailedPrecondition("no exit recorded".into()))
    }

    /// Wait for the exit, but no longer than `limit`.
    pub async fn wait_for(&self, limit: Duration) -> Option<ExitInfo> {
        tokio::time::timeout(limit, self.wait()).await.ok()?.ok()
    }

    /// Record the exit delivered on `rx` when it comes, then publish it.
    pub fn watch_exit(self: &Arc<Self>, rx: oneshot::Receiver<Exit>, events: EventSink) {
        let proc = self.clone();
        tokio::spawn(async move {
            let Ok(exit) = rx.await else {
                return;
            };
            let drained = proc
                .state
                .lock()
                .await
                .io
                .as_mut()
                .and_then(ProcessIo::take_drained);
            if let Some(mut drained) = drained {
                let _ = tokio::time::timeout(OUTPUT_DRAIN, drained.recv()).await;
            }
            let mut st = proc.state.lock().await;
            let info = ExitInfo {
                pid: exit.pid as u32,
                status: exit.status as u32,
                at: exit.at,
            };
            st.status = Status::Stopped;
            st.exit = Some(info);
            events.send(Event::Exit(TaskExit {
                container_id: proc.container_id.clone(),
                id: proc
                    .exec_id
                    .clone()
                    .unwrap_or_else(|| proc.container_id.clone()),
                pid: info.pid,
                exit_status: info.status,
                exited_at: Some(timestamp(info.at)).into(),
                ..Default::default()
            }));
            proc.exited.send_replace(Some(info));
        });
    }
}
