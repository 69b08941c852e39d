//! The execs of one container, whatever kind of container it is. A plain
//! container and a pair differ only in where an exec runs (the container's
//! runc container, or the engine that serves) and when one may be added;
//! everything else an exec goes through (lookup, kill, wait, delete, its
//! terminal and stdin) is the same, and answers with runc-v2's codes, so it
//! is written once, here, and the Task service holds one table per
//! container.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::SystemTime;

use nix::sys::signal::Signal;
use nix::unistd::Pid;
use oci_spec::runtime::Process as ProcessSpec;
use tokio::sync::Mutex;

use crate::error::{Error, Result};
use crate::process::Process;
use crate::status::{ExitInfo, ProcessState, Status, Stdio};

/// One container's execs, by exec id.
#[derive(Debug)]
pub struct Execs {
    container_id: String,
    table: Mutex<HashMap<String, Arc<Process>>>,
}

impl Execs {
    pub fn new(container_id: &str) -> Self {
        Execs {
            container_id: container_id.to_string(),
            table: Mutex::new(HashMap::new()),
        }
    }

    /// Record a new exec, refusing an id already in use.
    pub async fn add(&self, exec_id: &str, stdio: Stdio, spec: ProcessSpec) -> Result<()> {
        let mut table = self.table.lock().await;
        if table.contains_key(exec_id) {
            return Err(Error::AlreadyExists(format!(
                "exec {exec_id} in {}",
                self.container_id
            )));
        }
        table.insert(
            exec_id.to_string(),
            Process::new(&self.container_id, Some(exec_id), stdio, Some(spec)),
        );
        Ok(())
    }

    pub async fn get(&self, exec_id: &str) -> Result<Arc<Process>> {
        self.table
            .lock()
            .await
            .get(exec_id)
            .cloned()
            .ok_or_else(|| Error::ExecNotFound {
                id: self.container_id.clone(),
                exec_id: exec_id.to_string(),
            })
    }

    /// The process spec an exec was added with, for its Start.
    pub async fn spec(&self, exec_id: &str) -> Result<(Arc<Process>, ProcessSpec)> {
        let proc = self.get(exec_id).await?;
        let spec = proc.spec.clone().ok_or_else(|| Error::ExecNotFound {
            id: self.container_id.clone(),
            exec_id: exec_id.to_string(),
        })?;
        Ok((proc, spec))
    }

    pub async fn state(&self, exec_id: &str) -> Result<ProcessState> {
        Ok(self.get(exec_id).await?.snapshot().await)
    }

    /// Signal an exec, as runc-v2 answers: one never started is
    /// FailedPrecondition ("process not created"), one that has exited, or
    /// dies between its death and its reap (ESRCH), NotFound.
    pub async fn kill(&self, exec_id: &str, signal: u32) -> Result<()> {
        let proc = self.get(exec_id).await?;
        let st = proc.state.lock().await;
        let finished = || Error::Finished {
            id: self.container_id.clone(),
            process: format!("exec {exec_id}"),
        };
        if st.status == Status::Stopped {
            return Err(finished());
        }
        if st.pid == 0 {
            return Err(Error::FailedPrecondition(format!(
                "exec {exec_id} in {} is not started",
                self.container_id
            )));
        }
        let sig = Signal::try_from(signal as i32)
            .map_err(|_| Error::InvalidArgument(format!("unknown signal {signal}")))?;
        match nix::sys::signal::kill(Pid::from_raw(st.pid as i32), sig) {
            Err(nix::errno::Errno::ESRCH) => Err(finished()),
            r => r.map_err(|e| Error::sys(format!("signalling exec {exec_id} pid {}", st.pid), e)),
        }
    }

    pub async fn wait(&self, exec_id: &str) -> Result<ExitInfo> {
        self.get(exec_id).await?.wait().await
    }

    /// Remove an exec that is not running; its exit (or, never started, a
    /// zero status now).
    pub async fn delete(&self, exec_id: &str) -> Result<ExitInfo> {
        let proc = self.get(exec_id).await?;
        let mut st = proc.state.lock().await;
        if matches!(st.status, Status::Running | Status::Paused) {
            return Err(Error::FailedPrecondition(format!(
                "cannot delete exec {exec_id} of {}: it is still running",
                self.container_id
            )));
        }
        let exit = st.exit.unwrap_or(ExitInfo {
            pid: st.pid,
            status: 0,
            at: SystemTime::now(),
        });
        st.io = None;
        drop(st);
        self.table.lock().await.remove(exec_id);
        Ok(exit)
    }

    pub async fn resize_pty(&self, exec_id: &str, width: u32, height: u32) -> Result<()> {
        let proc = self.get(exec_id).await?;
        let st = proc.state.lock().await;
        match &st.io {
            Some(io) => io.resize(width, height),
            // No stdio at all: nothing to resize (runc-v2 answers OK).
            None => Ok(()),
        }
    }

    pub async fn close_io(&self, exec_id: &str) -> Result<()> {
        if let Some(io) = self.get(exec_id).await?.state.lock().await.io.as_mut() {
            io.close_stdin();
        }
        Ok(())
    }

    /// The container is gone: every exec's stdio is closed and the table
    /// emptied.
    pub async fn clear(&self) {
        let drained: Vec<_> = self.table.lock().await.drain().collect();
        for (_, proc) in drained {
            proc.state.lock().await.io = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use containerd_shim_protos::ttrpc::Code;

    fn spec() -> ProcessSpec {
        ProcessSpec::default()
    }

    #[tokio::test]
    async fn one_set_of_answers_for_every_container() {
        let execs = Execs::new("c1");
        execs.add("e1", Stdio::default(), spec()).await.unwrap();
        let dup = execs.add("e1", Stdio::default(), spec()).await.unwrap_err();
        assert_eq!(dup.code(), Code::ALREADY_EXISTS);
        assert_eq!(execs.get("nope").await.unwrap_err().code(), Code::NOT_FOUND);
        // Never started: FailedPrecondition, as runc-v2's "process not created".
        let e = execs.kill("e1", libc::SIGTERM as u32).await.unwrap_err();
        assert_eq!(e.code(), Code::FAILED_PRECONDITION, "{e}");
        // Running: Delete is refused, a signal goes to its pid (ours here,
        // SIGCONT: harmless, and no child that another test's reaper could
        // take).
        {
            let proc = execs.get("e1").await.unwrap();
            let mut st = proc.state.lock().await;
            st.status = Status::Running;
            st.pid = std::process::id();
        }
        let running = execs.delete("e1").await.unwrap_err();
        assert_eq!(running.code(), Code::FAILED_PRECONDITION);
        execs.kill("e1", libc::SIGCONT as u32).await.unwrap();
        // Gone before its reap (no such pid: ESRCH): NotFound.
        execs.get("e1").await.unwrap().state.lock().await.pid = i32::MAX as u32;
        let e = execs.kill("e1", libc::SIGKILL as u32).await.unwrap_err();
        assert_eq!(e.code(), Code::NOT_FOUND, "{e}");
        // Stopped: NotFound too; then Delete removes it.
        execs.get("e1").await.unwrap().state.lock().await.status = Status::Stopped;
        let e = execs.kill("e1", libc::SIGKILL as u32).await.unwrap_err();
        assert_eq!(e.code(), Code::NOT_FOUND, "{e}");
        execs.delete("e1").await.unwrap();
        assert_eq!(execs.state("e1").await.unwrap_err().code(), Code::NOT_FOUND);
        execs.add("e2", Stdio::default(), spec()).await.unwrap();
        execs.clear().await;
        assert!(execs.get("e2").await.is_err());
    }
}
