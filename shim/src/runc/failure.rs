//! What a failed runc command means. runc answers in words, so its last
//! logged error (or its stderr) is read back and classified into a
//! [`RuncFailure`] against the messages runc itself produces; a command on
//! a container runc keeps no state for failed because the container is
//! gone. Only the reading of runc's failures belongs here, not the running
//! of runc (the client's) nor the error codes (`crate::error`'s).

use std::path::Path;

use crate::error::{Error, RuncFailure};

/// Turn a runc crate error from `op` on `id` into ours, with runc's last
/// error logged in `log`. A command on an existing container that failed
/// while runc keeps no state for it (`knows` says whether it does, asked
/// only then) failed because the container is gone: that fact beats any
/// reading of the message.
pub fn error(
    op: &'static str,
    id: &str,
    e: runc::error::Error,
    log: &Path,
    knows: impl FnOnce() -> bool,
) -> Error {
    let failed = matches!(e, runc::error::Error::CommandFailed { .. });
    let message = match &e {
        runc::error::Error::CommandFailed { stderr, .. } => last_log_error(log)
            .or_else(|| Some(stderr.trim().to_string()).filter(|s| !s.is_empty()))
            .unwrap_or_else(|| e.to_string()),
        _ => e.to_string(),
    };
    let kind = if failed && !makes_container(op) && !knows() {
        RuncFailure::NotFound
    } else {
        classify(op, &message)
    };
    Error::Runc {
        op,
        id: id.to_string(),
        kind,
        message,
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

/// A kill that finds the container's init dead but not yet reaped: runc
/// says "container not running". runc-v2 answers NotFound there ("process
/// already finished", `checkKillError`), and ctr takes NotFound for a task
/// that is already gone; a paused or otherwise wrong state stays what it is.
pub fn finished_is_not_found(e: Error) -> Error {
    match e {
        Error::Runc {
            op,
            id,
            message,
            kind: RuncFailure::WrongState,
        } if message
            .to_ascii_lowercase()
            .contains("container not running") =>
        {
            Error::Runc {
                op,
                id,
                message: format!("process already finished: {message}"),
                kind: RuncFailure::NotFound,
            }
        }
        e => e,
    }
}

/// Commands that make the container they name: runc keeps no state for it
/// until they succeed, so its absence means nothing.
fn makes_container(op: &str) -> bool {
    matches!(op, "create" | "run")
}

/// libcontainer's words for "no such container" (`ErrNotExist`).
const NOT_EXIST: &[&str] = &["container does not exist"];
/// … for "that id is taken" (`ErrExist`).
const EXIST: &[&str] = &["container with given id already exists"];
/// … for a container in the wrong state: `ErrNotRunning`, `ErrPaused`,
/// `ErrNotPaused`, `ErrRunning`, and the state checks of runc's start,
/// exec, delete and kill.
const WRONG_STATE: &[&str] = &[
    "container not running",
    "container paused",
    "container not paused",
    "container still running",
    "cannot start an already running container",
    "cannot start a container that has stopped",
    "cannot start a container in the ",
    "cannot exec in a stopped container",
    "cannot exec in a paused container",
    "that is not stopped",
    "container process is already dead",
];
/// How runc reports that the process the spec names could not be started
/// (runc ≥ 1.1, and the wording before it).
const PROCESS_START: &[&str] = &[
    "unable to start container process",
    "starting container process caused",
];
/// … and the reasons that are the spec's fault: no such binary or path,
/// not executable, a cwd that is not there.
const SPEC_FAULT: &[&str] = &[
    "executable file not found",
    "no such file or directory",
    "permission denied",
    "chdir to cwd",
];

/// What runc's message means for the caller of `op`, read against the
/// messages runc itself produces (libcontainer's error values and its
/// commands' checks), not against loose words.
pub fn classify(op: &str, message: &str) -> RuncFailure {
    let m = message.to_ascii_lowercase();
    let says = |phrases: &[&str]| phrases.iter().any(|p| m.contains(p));
    if says(NOT_EXIST) {
        RuncFailure::NotFound
    } else if says(EXIST) {
        RuncFailure::AlreadyExists
    } else if says(WRONG_STATE) {
        RuncFailure::WrongState
    } else if matches!(op, "create" | "run" | "exec") && says(PROCESS_START) && says(SPEC_FAULT) {
        RuncFailure::BadSpec
    } else {
        RuncFailure::Other
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifies_runc_messages() {
        // What runc 1.1 says, verbatim.
        let missing_binary = "runc create failed: unable to start container process: exec: \"nope\": executable file not found in $PATH";
        assert_eq!(classify("create", missing_binary), RuncFailure::BadSpec);
        assert_eq!(
            classify(
                "exec",
                "exec failed: unable to start container process: exec: \"/etc\": permission denied"
            ),
            RuncFailure::BadSpec
        );
        assert_eq!(
            classify("kill", "container does not exist"),
            RuncFailure::NotFound
        );
        assert_eq!(
            classify("create", "container with given ID already exists"),
            RuncFailure::AlreadyExists
        );
        for wrong_state in [
            "container not running",
            "container paused",
            "container not paused",
            "container still running",
            "cannot exec in a stopped container",
            "cannot start an already running container",
            "cannot delete container c1 that is not stopped: running",
        ] {
            assert_eq!(
                classify("kill", wrong_state),
                RuncFailure::WrongState,
                "{wrong_state}"
            );
        }
        assert_eq!(classify("create", "something else"), RuncFailure::Other);
    }

    #[test]
    fn loose_words_are_not_a_classification() {
        // Before: any "permission denied", "stopped" or "already" decided.
        // A cgroup that cannot be written is not the caller's bad spec, and
        // a message that merely mentions stopping is not a state error.
        assert_eq!(
            classify("create", "runc create failed: unable to apply cgroup configuration: mkdir /sys/fs/cgroup/x: permission denied"),
            RuncFailure::Other
        );
        assert_eq!(
            classify("kill", "the shim stopped waiting"),
            RuncFailure::Other
        );
        assert_eq!(classify("pause", "already handled"), RuncFailure::Other);
        // A process that cannot start only blames the spec for commands
        // that start one.
        assert_eq!(
            classify(
                "update",
                "unable to start container process: no such file or directory"
            ),
            RuncFailure::Other
        );
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

    #[test]
    fn runc_state_is_asked_only_where_it_decides() {
        use std::os::unix::process::ExitStatusExt;
        let d = tempfile::tempdir().unwrap();
        let log = d.path().join("log.json");
        let failed = || runc::error::Error::CommandFailed {
            status: std::process::ExitStatus::from_raw(1 << 8),
            stdout: String::new(),
            stderr: " container not running \n".into(),
        };
        // No log: runc's stderr is the message, trimmed.
        let e = error("kill", "c1", failed(), &log, || true);
        assert!(
            matches!(&e, Error::Runc { kind: RuncFailure::WrongState, message, .. } if message == "container not running"),
            "{e:?}"
        );
        // Gone from runc's state: NotFound whatever the words.
        let e = error("kill", "c1", failed(), &log, || false);
        assert!(
            matches!(
                e,
                Error::Runc {
                    kind: RuncFailure::NotFound,
                    ..
                }
            ),
            "{e:?}"
        );
        // A create has no state to look at yet; a runc that never ran
        // says nothing about the container either.
        let e = error("create", "c1", failed(), &log, || panic!("asked"));
        assert!(
            matches!(
                e,
                Error::Runc {
                    kind: RuncFailure::WrongState,
                    ..
                }
            ),
            "{e:?}"
        );
        let spawn = runc::error::Error::ProcessSpawnFailed(std::io::Error::other("no runc"));
        let e = error("kill", "c1", spawn, &log, || panic!("asked"));
        assert!(
            matches!(
                e,
                Error::Runc {
                    kind: RuncFailure::Other,
                    ..
                }
            ),
            "{e:?}"
        );
        // runc's own log beats its stderr.
        std::fs::write(&log, "{\"level\":\"error\",\"msg\":\"container paused\"}\n").unwrap();
        let e = error("kill", "c1", failed(), &log, || true);
        assert!(
            matches!(&e, Error::Runc { message, .. } if message == "container paused"),
            "{e:?}"
        );
    }
}
