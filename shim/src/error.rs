//! The shim's one error type. Every failure a caller can see is a variant
//! here, and `From<Error> for ttrpc::Error` is the single place that decides
//! which gRPC code containerd receives, so `ctr` users get a precise code
//! (InvalidArgument, NotFound, ...) instead of a stringly "unknown".

use containerd_shim_protos::ttrpc::{self, Code};
use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The request itself is wrong (bad spec, bad annotation, bad flag).
    #[error("{0}")]
    InvalidArgument(String),
    /// An annotation under `shadow.dev/` has a key or value we do not accept.
    #[error("annotation {key}={value:?} is not valid: allowed {allowed}")]
    Annotation {
        key: String,
        value: String,
        allowed: String,
    },
    #[error("container {0} not found in this shim")]
    ContainerNotFound(String),
    #[error("exec process {exec_id} not found in container {id}")]
    ExecNotFound { id: String, exec_id: String },
    #[error("{process} of container {id} has already finished")]
    Finished { id: String, process: String },
    #[error("{0} already exists in this shim")]
    AlreadyExists(String),
    /// The object exists but is in the wrong state for the request.
    #[error("{0}")]
    FailedPrecondition(String),
    #[error("{0}")]
    Unimplemented(String),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{context}: {source}")]
    Sys {
        context: String,
        #[source]
        source: nix::Error,
    },
    #[error("config file {path}: {reason}")]
    Config { path: PathBuf, reason: String },
    /// runc ran and said no; `message` is runc's own last error line.
    #[error("runc {op} {id}: {message}")]
    Runc {
        op: &'static str,
        id: String,
        message: String,
        kind: RuncFailure,
    },
    /// Something the caller sent (runtime options, a bootstrap message)
    /// does not decode.
    #[error("decoding {what}: {reason}")]
    Decode { what: &'static str, reason: String },
    /// A file the shim or runc wrote for itself (an engine spec, a pid
    /// file, state) is unreadable: the shim's fault, never the caller's.
    /// `what` names the file (or the value, when it is not in a file).
    #[error("{what}: {reason}")]
    Internal { what: String, reason: String },
    #[error("containerd-shim: {0}")]
    Shim(#[from] containerd_shim::Error),
}

/// What a runc failure means for the caller: from the facts (runc's state
/// directory) where there are some, else from runc's own error message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RuncFailure {
    /// The spec asks for something that cannot exist (binary, path).
    BadSpec,
    /// runc does not know the container.
    NotFound,
    /// runc already has a container of that id.
    AlreadyExists,
    /// The container is in the wrong state (not running, already paused...).
    WrongState,
    Other,
}

impl Error {
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }

    pub fn sys(context: impl Into<String>, source: nix::Error) -> Self {
        Error::Sys {
            context: context.into(),
            source,
        }
    }

    /// The gRPC code containerd sees for this error.
    pub fn code(&self) -> Code {
        match self {
            Error::InvalidArgument(_) | Error::Annotation { .. } | Error::Config { .. } => {
                Code::INVALID_ARGUMENT
            }
            Error::Decode { .. } => Code::INVALID_ARGUMENT,
            Error::ContainerNotFound(_) | Error::ExecNotFound { .. } | Error::Finished { .. } => {
                Code::NOT_FOUND
            }
            Error::AlreadyExists(_) => Code::ALREADY_EXISTS,
            Error::FailedPrecondition(_) => Code::FAILED_PRECONDITION,
            Error::Unimplemented(_) => Code::UNIMPLEMENTED,
            Error::Runc { kind, .. } => match kind {
                RuncFailure::BadSpec => Code::INVALID_ARGUMENT,
                RuncFailure::NotFound => Code::NOT_FOUND,
                RuncFailure::AlreadyExists => Code::ALREADY_EXISTS,
                RuncFailure::WrongState => Code::FAILED_PRECONDITION,
                RuncFailure::Other => Code::UNKNOWN,
            },
            // An I/O error is the shim's own failure whatever its kind: a
            // missing file here (gmsd, a FIFO, a cgroup) is not a missing
            // container or process, which is all NOT_FOUND tells containerd.
            Error::Io { .. } | Error::Sys { .. } | Error::Shim(_) | Error::Internal { .. } => {
                Code::INTERNAL
            }
        }
    }
}

impl From<shadow_contract::annotations::AnnotationError> for Error {
    fn from(e: shadow_contract::annotations::AnnotationError) -> Self {
        Error::Annotation {
            key: e.key,
            value: e.value,
            allowed: e.allowed,
        }
    }
}

impl From<Error> for ttrpc::Error {
    fn from(e: Error) -> Self {
        ttrpc::Error::RpcStatus(ttrpc::get_status(e.code(), e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn code_of(e: Error) -> Code {
        match ttrpc::Error::from(e) {
            ttrpc::Error::RpcStatus(s) => s.code(),
            other => panic!("not a status: {other:?}"),
        }
    }

    #[test]
    fn errors_map_to_precise_codes() {
        assert_eq!(
            code_of(Error::ContainerNotFound("a".into())),
            Code::NOT_FOUND
        );
        assert_eq!(
            code_of(Error::Annotation {
                key: "shadow.dev/gms".into(),
                value: "gpu".into(),
                allowed: "cuda|host|off".into()
            }),
            Code::INVALID_ARGUMENT
        );
        assert_eq!(
            code_of(Error::Unimplemented("pairing".into())),
            Code::UNIMPLEMENTED
        );
        assert_eq!(
            code_of(Error::AlreadyExists("c".into())),
            Code::ALREADY_EXISTS
        );
        assert_eq!(
            code_of(Error::FailedPrecondition("x".into())),
            Code::FAILED_PRECONDITION
        );
        assert_eq!(
            code_of(Error::Runc {
                op: "create",
                id: "c".into(),
                message: "exec: \"nope\": executable file not found in $PATH".into(),
                kind: RuncFailure::BadSpec
            }),
            Code::INVALID_ARGUMENT
        );
    }

    #[test]
    fn a_missing_file_of_the_shim_is_internal_not_not_found() {
        // ENOENT from the shim's own I/O (a FIFO, a cgroup file, a binary it
        // runs): NOT_FOUND would tell containerd the container is missing.
        // (A missing gmsd is FAILED_PRECONDITION: pair/gms.rs tests it.)
        let e = Error::io(
            "opening /sys/fs/cgroup/x/memory.events",
            std::io::Error::from(std::io::ErrorKind::NotFound),
        );
        assert_eq!(code_of(e), Code::INTERNAL);
    }

    #[test]
    fn decode_is_the_callers_and_internal_is_ours() {
        let caller = Error::Decode {
            what: "runtime options",
            reason: "truncated".into(),
        };
        assert_eq!(code_of(caller), Code::INVALID_ARGUMENT);
        let ours = Error::Internal {
            what: "engine spec /run/shadow/default/p/slot-0/config.json".into(),
            reason: "EOF while parsing".into(),
        };
        assert!(ours.to_string().contains("slot-0/config.json"), "{ours}");
        assert_eq!(code_of(ours), Code::INTERNAL);
    }

    #[test]
    fn runc_failures_map_by_kind() {
        let runc = |kind| Error::Runc {
            op: "create",
            id: "c".into(),
            message: "m".into(),
            kind,
        };
        assert_eq!(code_of(runc(RuncFailure::NotFound)), Code::NOT_FOUND);
        assert_eq!(
            code_of(runc(RuncFailure::AlreadyExists)),
            Code::ALREADY_EXISTS
        );
        assert_eq!(
            code_of(runc(RuncFailure::WrongState)),
            Code::FAILED_PRECONDITION
        );
        assert_eq!(code_of(runc(RuncFailure::Other)), Code::UNKNOWN);
    }

    #[test]
    fn annotation_error_names_key_value_and_allowed() {
        let msg = Error::Annotation {
            key: "shadow.dev/gms".into(),
            value: "gpu".into(),
            allowed: "cuda|host|off".into(),
        }
        .to_string();
        assert!(
            msg.contains("shadow.dev/gms") && msg.contains("gpu") && msg.contains("cuda|host|off")
        );
    }
}
