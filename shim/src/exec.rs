//! Starting an exec process in a runc container. Plain containers and the
//! active engine of a pair start theirs the same way and differ only in
//! which runc container and bundle they name, so the one path lives here,
//! below both.

use std::path::Path;
use std::sync::Arc;

use containerd_shim_protos::events::task::TaskExecStarted;
use oci_spec::runtime::Process as ProcessSpec;

use crate::error::{Error, Result};
use crate::events::{Event, EventSink};
use crate::exits::ExitRouter;
use crate::io::{ChildStdio, ConsoleSocket, ProcessIo};
use crate::process::Process;
use crate::runc::{RuncClient, RuncStdio};
use crate::status::Status;

/// One exec start: where it runs and whom it tells.
pub struct Exec<'a> {
    pub client: &'a RuncClient,
    pub runc_id: &'a str,
    /// Where runc writes the exec's pid file.
    pub bundle: &'a Path,
    /// The task id containerd knows (events carry it).
    pub container_id: &'a str,
    pub router: &'a Arc<ExitRouter>,
    pub events: &'a EventSink,
}

impl Exec<'_> {
    /// Runs `spec` as `exec_id`, wires its stdio (pipes or a console), marks
    /// `proc` running, watches its exit and publishes TaskExecStarted.
    pub async fn start(
        &self,
        proc: &Arc<Process>,
        exec_id: &str,
        spec: &ProcessSpec,
    ) -> Result<u32> {
        let mut st = proc.state.lock().await;
        if st.status != Status::Created {
            return Err(Error::FailedPrecondition(format!(
                "exec {exec_id} in {} was already started",
                self.container_id
            )));
        }
        let console = match proc.stdio.terminal {
            true => Some(ConsoleSocket::new()?),
            false => None,
        };
        let console_path = console.as_ref().map(ConsoleSocket::path);
        let mut io = None;
        let stdio = match &console_path {
            Some(path) => RuncStdio::Console(path),
            None => {
                let (child, pio): (ChildStdio, ProcessIo) =
                    ProcessIo::pipes(&proc.stdio, self.client.io_owner())?;
                io = Some(pio);
                RuncStdio::Fds(Arc::new(child))
            }
        };
        let pid = self
            .client
            .exec(self.runc_id, self.bundle, exec_id, spec, stdio)
            .await?;
        if let Some(sock) = console {
            io = Some(ProcessIo::console(sock.receive().await?, &proc.stdio)?);
        }
        st.pid = pid;
        st.io = io;
        st.status = Status::Running;
        proc.watch_exit(self.router.watch(pid as i32), self.events.clone());
        self.events.send(Event::ExecStarted(TaskExecStarted {
            container_id: self.container_id.to_string(),
            exec_id: exec_id.to_string(),
            pid,
            ..Default::default()
        }));
        Ok(pid)
    }
}
