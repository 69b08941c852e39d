//! The one place that knows how runc is driven: the `runc` crate's client,
//! with a spawner that waits through the exit router (the shim's reaper
//! takes every child, so `waitpid` on runc's own pid would race it), and
//! runc's JSON log read back to give errors runc's own words.

use std::os::fd::OwnedFd;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::sync::Arc;

use async_trait::async_trait;
use runc::options::GlobalOpts;
use runc::{Command, Runc, Spawner};
use tokio::io::AsyncReadExt;

use crate::config::Config;
use crate::error::{Error, Result, RuncFailure};
use crate::exits::ExitRouter;

/// Runs runc commands and takes their exit from the router.
#[derive(Debug)]
pub struct ReapedSpawner {
    router: Arc<ExitRouter>,
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
        // it: the shim's reaper is the only one.
        let mut child = cmd
            .as_std_mut()
            .spawn()
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

/// A runc client for one container, logging into its bundle.
#[derive(Clone, Debug)]
pub struct RuncClient {
    pub runc: Runc,
    log: PathBuf,
}

impl RuncClient {
    pub fn new(
        config: &Config,
        namespace: &str,
        bundle: &Path,
        router: Arc<ExitRouter>,
    ) -> Result<Self> {
        let log = bundle.join("log.json");
        let mut opts = GlobalOpts::new()
            .command(&config.runc.binary)
            .root(config.runc_root(namespace))
            .log(&log)
            .log_json();
        opts.custom_spawner(Arc::new(ReapedSpawner { router }));
        let runc = opts.build().map_err(|e| Error::Config {
            path: PathBuf::from(crate::config::DEFAULT_CONFIG_PATH),
            reason: format!("runc binary {:?}: {e}", config.runc.binary),
        })?;
        Ok(RuncClient { runc, log })
    }

    /// Turn a runc crate error into ours, with runc's last logged error.
    pub fn error(&self, op: &'static str, id: &str, e: runc::error::Error) -> Error {
        let message = match &e {
            runc::error::Error::CommandFailed { stderr, .. } => last_log_error(&self.log)
                .or_else(|| Some(stderr.trim().to_string()).filter(|s| !s.is_empty()))
                .unwrap_or_else(|| e.to_string()),
            _ => e.to_string(),
        };
        Error::Runc {
            op,
            id: id.to_string(),
            kind: classify(&message),
            message,
        }
    }
}

/// The message of the last `"level":"error"` line in runc's JSON log.
fn last_log_error(log: &Path) -> Option<String> {
    let text = std::fs::read_to_string(log).ok()?;
    text.lines().rev().find_map(|line| {
        let v: serde_json::Value = serde_json::from_str(line).ok()?;
        (v.get("level")?.as_str()? == "error").then(|| v.get("msg")?.as_str().map(String::from))?
    })
}

pub fn classify(message: &str) -> RuncFailure {
    let m = message.to_ascii_lowercase();
    if m.contains("executable file not found")
        || m.contains("no such file or directory")
        || m.contains("permission denied")
    {
        RuncFailure::BadSpec
    } else if m.contains("does not exist") || m.contains("container not found") {
        RuncFailure::NotFound
    } else if m.contains("not running")
        || m.contains("not paused")
        || m.contains("is paused")
        || m.contains("already")
        || m.contains("stopped")
    {
        RuncFailure::WrongState
    } else {
        RuncFailure::Other
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifies_runc_messages() {
        assert_eq!(
            classify("runc create failed: unable to start container process: exec: \"nope\": executable file not found in $PATH"),
            RuncFailure::BadSpec
        );
        assert_eq!(
            classify("container \"x\" does not exist"),
            RuncFailure::NotFound
        );
        assert_eq!(classify("container not running"), RuncFailure::WrongState);
        assert_eq!(classify("something else"), RuncFailure::Other);
    }

    #[test]
    fn reads_last_error_from_json_log() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("log.json");
        std::fs::write(
            &p,
            "{\"level\":\"error\",\"msg\":\"first\"}\n{\"level\":\"info\",\"msg\":\"x\"}\n{\"level\":\"error\",\"msg\":\"second\"}\n{\"level\":\"warning\",\"msg\":\"y\"}\n",
        )
        .unwrap();
        assert_eq!(last_log_error(&p).as_deref(), Some("second"));
        assert_eq!(last_log_error(&dir.path().join("none")), None);
    }

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
        let reaper = {
            let router = router.clone();
            tokio::spawn(async move {
                loop {
                    match nix::sys::wait::waitpid(None, Some(nix::sys::wait::WaitPidFlag::WNOHANG))
                    {
                        Ok(nix::sys::wait::WaitStatus::Exited(pid, code)) => {
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
