//! The plain data every layer of the crate shares: lease modes and kinds,
//! the wire's error codes, an allocation and a layout's metadata.
//!
//! It exists so that the modules above it use each other in one direction
//! only: `error`, `layout` and `status` need these words and nothing of the
//! protocol, and `protocol` (on top) carries all of them in its messages.
//! Nothing here depends on another module of the crate. The old paths
//! (`protocol::{Mode, LeaseKind, ErrorCode, Metadata}`,
//! `layout::Allocation`) re-export them.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

/// What a client asks for in `hello`.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    Rw,
    Ro,
    RwOrRo,
}

/// What a client holds once `hello` succeeded.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum LeaseKind {
    Rw,
    Ro,
}

impl fmt::Display for LeaseKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LeaseKind::Rw => "rw",
            LeaseKind::Ro => "ro",
        })
    }
}

/// Which rule a peer broke, as the `error` message names it.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    BadMessage,
    UnsupportedVersion,
    TooLarge,
    Truncated,
    WrongFdCount,
    PermissionDenied,
    LeaseBusy,
    NoLayout,
    NotPermitted,
    UnknownAllocation,
    LimitExceeded,
    AddressConflict,
    Invalid,
    Internal,
    ShuttingDown,
    /// The peer stalled: no first message, a frame left half-sent, or an
    /// uncommitted `rw` lease idle past the daemon's deadline.
    Timeout,
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = serde_json::to_value(self)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_else(|| format!("{self:?}"));
        f.write_str(&text)
    }
}

/// One allocation of a layout: the memory behind it lives in the daemon,
/// readers map it at `va`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Allocation {
    pub id: u64,
    /// What the memory is for: `weights`, `kv`, ...
    pub tag: String,
    /// Bytes, a multiple of the backend's granularity.
    pub size: u64,
    /// Where the writer mapped it; readers map it at the same address.
    pub va: u64,
}

impl Allocation {
    pub fn end(&self) -> u64 {
        self.va.saturating_add(self.size)
    }
}

/// Metadata as carried in a layout: tensor name → free-form JSON text.
pub type Metadata = BTreeMap<String, String>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_and_kinds_display_as_on_the_wire() {
        assert_eq!(ErrorCode::WrongFdCount.to_string(), "wrong_fd_count");
        assert_eq!(ErrorCode::Timeout.to_string(), "timeout");
        assert_eq!(LeaseKind::Rw.to_string(), "rw");
        assert_eq!(LeaseKind::Ro.to_string(), "ro");
        assert_eq!(
            serde_json::to_value(Mode::RwOrRo).ok(),
            Some(serde_json::json!("rw_or_ro"))
        );
    }
}
