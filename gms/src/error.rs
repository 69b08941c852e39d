//! The crate's one error type, and its mapping onto wire error codes so that
//! a peer always learns *which* rule it broke.

use crate::types::ErrorCode;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{context}: {source}")]
    Sys {
        context: String,
        #[source]
        source: nix::errno::Errno,
    },
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("message of {size} bytes exceeds the limit of {limit} bytes")]
    TooLarge { size: usize, limit: usize },
    #[error("connection closed after {got} of {want} bytes of a message")]
    Truncated { got: usize, want: usize },
    #[error("peer closed the connection")]
    Closed,
    #[error("control data truncated (MSG_CTRUNC): peer sent more than {max} file descriptors")]
    ControlTruncated { max: usize },
    #[error("message is not JSON: {0}")]
    NotJson(String),
    #[error("malformed message: {0}")]
    Malformed(String),
    #[error("protocol version {got} is not supported (this side speaks version {supported})")]
    UnsupportedVersion { got: String, supported: u32 },
    #[error("'{op}' carries {got} file descriptor(s), expected {want}")]
    WrongFdCount { op: String, got: usize, want: usize },
    #[error("peer pid {pid} uid {uid} gid {gid} is not allowed by --allow-uid/--allow-gid")]
    PeerNotAllowed { pid: i32, uid: u32, gid: u32 },
    #[error("lease busy: {0}")]
    LeaseBusy(String),
    #[error("no committed layout: {0}")]
    NoLayout(String),
    #[error("'{op}' not allowed: {why}")]
    NotPermitted { op: String, why: String },
    #[error("unknown allocation id {0}")]
    UnknownAllocation(u64),
    #[error("limit exceeded: {0}")]
    LimitExceeded(String),
    #[error("address conflict: {0}")]
    AddressConflict(String),
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error("backend: {0}")]
    Backend(String),
    #[error("daemon answered {code}: {message}")]
    Remote { code: ErrorCode, message: String },
    #[error("unexpected answer '{got}' to '{request}'")]
    UnexpectedResponse { request: String, got: String },
    #[error("configuration: {0}")]
    Config(String),
    #[error("timed out: {0}")]
    Timeout(String),
    #[error("out of memory: {0}")]
    OutOfMemory(String),
}

impl Error {
    pub fn sys(context: impl Into<String>, source: nix::errno::Errno) -> Self {
        Error::Sys {
            context: context.into(),
            source,
        }
    }

    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }

    /// The code sent to a peer when this error ends its connection.
    pub fn code(&self) -> ErrorCode {
        match self {
            Error::Sys { .. } | Error::Io { .. } | Error::Backend(_) => ErrorCode::Internal,
            Error::TooLarge { .. } => ErrorCode::TooLarge,
            Error::Truncated { .. } | Error::Closed => ErrorCode::Truncated,
            Error::ControlTruncated { .. } | Error::WrongFdCount { .. } => ErrorCode::WrongFdCount,
            Error::NotJson(_) | Error::Malformed(_) => ErrorCode::BadMessage,
            Error::UnsupportedVersion { .. } => ErrorCode::UnsupportedVersion,
            Error::PeerNotAllowed { .. } => ErrorCode::PermissionDenied,
            Error::LeaseBusy(_) => ErrorCode::LeaseBusy,
            Error::NoLayout(_) => ErrorCode::NoLayout,
            Error::NotPermitted { .. } => ErrorCode::NotPermitted,
            Error::UnknownAllocation(_) => ErrorCode::UnknownAllocation,
            Error::LimitExceeded(_) | Error::OutOfMemory(_) => ErrorCode::LimitExceeded,
            Error::AddressConflict(_) => ErrorCode::AddressConflict,
            Error::Invalid(_) | Error::Config(_) => ErrorCode::Invalid,
            Error::Remote { code, .. } => *code,
            Error::UnexpectedResponse { .. } => ErrorCode::BadMessage,
            Error::Timeout(_) => ErrorCode::Timeout,
        }
    }
}
