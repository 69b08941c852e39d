//! How the runc crate's commands are spawned and waited for. The shim's
//! reaper takes every child, so a `waitpid` on runc's own pid would race
//! it: [`ReapedSpawner`] spawns runc and takes its exit from the exit
//! router instead. Only the spawning and the wait belong here; what runc
//! is asked and what its failures mean are the client's and `failure`'s.

use std::os::fd::OwnedFd;
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::sync::Arc;

use async_trait::async_trait;
use runc::{Command, Spawner};
use tokio::io::AsyncReadExt;

use crate::exits::ExitRouter;

/// Runs runc commands and takes their exit from the router.
#[derive(Debug)]
pub struct ReapedSpawner {
    router: Arc<ExitRouter>,
}

impl ReapedSpawner {
    /// A spawner whose commands' exits `router` reports.
    pub fn new(router: Arc<ExitRouter>) -> Self {
        ReapedSpawner { router }
    }
}

impl std::fmt::Debug for ExitRouter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ExitRouter")
    }
}

#[async_trait]
impl Spawner for ReapedSpawner {
    async fn execute(&self, mut cmd: Command) -> runc::Result<(ExitStatus, u32, String, String)> {
        // Spawned through std so that tokio's own child reaping stays out of
        // it: the shim's reaper is the only one. On a blocking thread: the
        // fork and runc's exec take milliseconds, during which the shim's
        // one runtime thread must stay free (a failover's READY=1 arrives
        // exactly while the dead engine's respawn starts).
        let std_cmd = std::mem::replace(cmd.as_std_mut(), std::process::Command::new("runc"));
        let mut child = tokio::task::spawn_blocking(move || {
            let mut std_cmd = std_cmd;
            std_cmd.spawn()
        })
        .await
        .map_err(|e| runc::error::Error::ProcessSpawnFailed(std::io::Error::other(e.to_string())))?
        .map_err(runc::error::Error::ProcessSpawnFailed)?;
        let pid = child.id();
        let exit = self.router.watch(pid as i32);
        let stdout = child.stdout.take().map(OwnedFd::from);
        let stderr = child.stderr.take().map(OwnedFd::from);
        drop(child);
        let (out, err) = tokio::join!(read_all(stdout), read_all(stderr));
        let exit = exit.await.map_err(|_| {
            runc::error::Error::InvalidCommand(std::io::Error::other(format!(
                "exit of runc pid {pid} was never reported"
            )))
        })?;
        let status = ExitStatus::from_raw((exit.status & 0xff) << 8);
        Ok((status, pid, out, err))
    }
}

async fn read_all(fd: Option<OwnedFd>) -> String {
    let Some(fd) = fd else {
        return String::new();
    };
    let mut buf = Vec::new();
    if let Ok(mut rx) = tokio::net::unix::pipe::Receiver::from_owned_fd(fd) {
        let _ = rx.read_to_end(&mut buf).await;
    }
    String::from_utf8_lossy(&buf).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn spawner_reports_exit_code_through_router() {
        let router = Arc::new(ExitRouter::default());
        let spawner = ReapedSpawner {
            router: router.clone(),
        };
        let mut cmd = Command::new("/bin/sh");
        cmd.args(["-c", "echo out; echo err >&2; exit 3"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        // In the test there is no shim reaper: reap it ourselves and route.
        // Only our `sh`: other tests of this binary run children of their
        // own at the same time (a look without reaping first, WNOWAIT).
        let reaper = {
            let router = router.clone();
            tokio::spawn(async move {
                use nix::sys::wait::{waitid, waitpid, Id, WaitPidFlag, WaitStatus};
                loop {
                    let seen = waitid(
                        Id::All,
                        WaitPidFlag::WEXITED | WaitPidFlag::WNOHANG | WaitPidFlag::WNOWAIT,
                    );
                    let ours = match seen {
                        Ok(WaitStatus::Exited(pid, _)) => {
                            std::fs::read_to_string(format!("/proc/{pid}/comm"))
                                .is_ok_and(|c| c.trim() == "sh")
                                .then_some(pid)
                        }
                        _ => None,
                    };
                    let reaped = ours.map(|pid| waitpid(pid, None));
                    match reaped {
                        Some(Ok(WaitStatus::Exited(pid, code))) => {
                            router.deliver(crate::exits::Exit {
                                pid: pid.as_raw(),
                                status: code,
                                at: std::time::SystemTime::now(),
                            });
                            return;
                        }
                        _ => tokio::time::sleep(std::time::Duration::from_millis(5)).await,
                    }
                }
            })
        };
        let (status, pid, out, err) = spawner.execute(cmd).await.unwrap();
        reaper.await.unwrap();
        assert!(pid > 0);
        assert_eq!(status.code(), Some(3));
        assert_eq!(out, "out\n");
        assert_eq!(err, "err\n");
    }
}
