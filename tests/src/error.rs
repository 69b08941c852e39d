//! The harness's one error type: every variant names the file, process or
//! limit involved, so a failing test says what to look at.

use std::path::PathBuf;
use std::time::Duration;

/// Result of harness operations.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Something the harness could not do.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file-system or process operation failed.
    #[error("{what} ({path}): {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A program could not be started at all.
    #[error("cannot start `{program}`: {source}")]
    Spawn {
        program: String,
        #[source]
        source: std::io::Error,
    },
    /// A bounded wait ran out; the process involved was killed.
    #[error("timed out after {after:?} waiting for {what}")]
    Timeout { what: String, after: Duration },
    /// A process ended its output without printing what we waited for.
    #[error("{what}: output ended before the line we waited for")]
    OutputEnded { what: String },
    /// containerd did not come up, or went away.
    #[error("containerd at {address}: {reason}; log: {log}")]
    Containerd {
        address: PathBuf,
        reason: String,
        log: PathBuf,
    },
    /// The shim binary under test is not where we looked.
    #[error("shim binary {path} not found: {hint}")]
    ShimNotFound { path: PathBuf, hint: &'static str },
    /// A CRI call to containerd failed or did not answer in time.
    #[error("CRI {call} at {address}: {reason}")]
    Cri {
        call: &'static str,
        address: PathBuf,
        reason: String,
    },
    /// A host tool the tests need is missing.
    #[error("`{tool}` not found on PATH; run `make deps` (installs {package})")]
    MissingTool {
        tool: &'static str,
        package: &'static str,
    },
}

impl Error {
    pub(crate) fn io(what: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            what,
            path: path.into(),
            source,
        }
    }
}
