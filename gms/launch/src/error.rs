//! Why a gmsd did not become ready: [`LaunchError`] and its wording.
//!
//! It exists apart so that the launcher's other modules build their errors
//! from one place and the wording is read in one file. Free to change: the
//! wording, except "ended before it was ready", which
//! `tests/tests/pairs.rs` looks for in the shim's answer to a gmsd that
//! exits at once. A new variant is a change of the public API (the shim and
//! the OCI hook match on none today, but may).

use std::path::PathBuf;
use std::time::Duration;

use shadow_contract::state::Exit;

/// Why gmsd did not become ready.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error("starting gmsd {binary}: {source}")]
    Spawn {
        binary: PathBuf,
        source: std::io::Error,
    },
    #[error("gmsd {binary} (pid {pid}) ended before it was ready ({}){}", describe(.exit), said(.stdout))]
    Exited {
        binary: PathBuf,
        pid: u32,
        /// None when the status is not ours to read (the reaper took it
        /// first) or the kernel has no pidfd.
        exit: Option<Exit>,
        /// What it wrote on stdout, if anything but `ready`.
        stdout: String,
    },
    #[error("gmsd {binary} (pid {pid}) was not ready within {} ms; killed it", .timeout.as_millis())]
    NotReady {
        binary: PathBuf,
        pid: u32,
        timeout: Duration,
    },
    #[error("gmsd {binary} (pid {pid}) announced {socket:?}, which is not a GMS socket in {dir}; killed it")]
    Announcement {
        binary: PathBuf,
        pid: u32,
        socket: String,
        dir: PathBuf,
    },
    #[error("gmsd {binary} (pid {pid}): reading its readiness pipe: {source}")]
    Pipe {
        binary: PathBuf,
        pid: u32,
        source: std::io::Error,
    },
}

fn describe(exit: &Option<Exit>) -> String {
    exit.map(|e| e.to_string())
        .unwrap_or_else(|| "status collected elsewhere".into())
}

fn said(stdout: &str) -> String {
    if stdout.trim().is_empty() {
        "; its stderr has the reason".into()
    } else {
        format!("; it said: {}", stdout.trim())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exited(exit: Option<Exit>, stdout: &str) -> String {
        LaunchError::Exited {
            binary: PathBuf::from("/usr/bin/gmsd"),
            pid: 42,
            exit,
            stdout: stdout.into(),
        }
        .to_string()
    }

    /// The phrase the end-to-end tests look for, the status or why there
    /// is none, and where the reason is.
    #[test]
    fn an_early_end_names_its_status_and_where_the_reason_is() {
        let msg = exited(Some(Exit::Code(3)), "  bad flag\n");
        assert!(msg.contains("(pid 42) ended before it was ready"), "{msg}");
        assert!(msg.contains("exit code 3"), "{msg}");
        assert!(msg.ends_with("; it said: bad flag"), "{msg}");
        let msg = exited(None, "\n");
        assert!(msg.contains("(status collected elsewhere)"), "{msg}");
        assert!(msg.ends_with("; its stderr has the reason"), "{msg}");
    }

    #[test]
    fn a_timeout_is_said_in_milliseconds() {
        let msg = LaunchError::NotReady {
            binary: PathBuf::from("gmsd"),
            pid: 7,
            timeout: Duration::from_millis(300),
        }
        .to_string();
        assert_eq!(
            msg,
            "gmsd gmsd (pid 7) was not ready within 300 ms; killed it"
        );
    }
}
