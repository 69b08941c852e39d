//! The crate's one error type: every variant names the file, the pair or
//! the process it is about, because a hook's stderr is all a user of
//! podman or CRI-O gets to see when a container refuses to start.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A `shadow.dev/` annotation (or a pair name given on the command
    /// line) that the contract does not allow.
    #[error(transparent)]
    Annotation(#[from] shadow_contract::annotations::AnnotationError),
    #[error("{what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("reading {what} from stdin: {source}")]
    Stdin {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("{what} is not valid JSON: {source}")]
    Json {
        what: &'static str,
        #[source]
        source: serde_json::Error,
    },
    #[error("{what} has an unexpected shape: {why}")]
    Shape { what: &'static str, why: String },
    #[error("{what} in the mount namespace of pid {pid}: {source}")]
    Namespace {
        what: String,
        pid: i32,
        #[source]
        source: nix::Error,
    },
    #[error("gmsd for pair {pair}: {why}")]
    Gmsd { pair: String, why: String },
    /// A container that names a pair it was not admitted to.
    #[error("may not join pair {pair}: {why}")]
    NotAdmitted { pair: String, why: String },
}

impl Error {
    pub fn io(what: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            what,
            path: path.into(),
            source,
        }
    }
}

pub type Result<T> = std::result::Result<T, Error>;
