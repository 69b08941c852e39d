//! Connections the runtime accepts (`shadow.dev/accept: runtime`, config
//! `pair.accept`). With the default (`engine`) each engine accepts on the
//! pair's listening sockets and stores what it accepted: a SIGKILL that
//! lands between the `accept` and the `FDSTORE=1` loses that one
//! connection (`make soak` counted 5 of 57,117 requests over 1,347 kills).
//! With `runtime` the shim accepts, keeps each connection in the pair's fd
//! store from the moment it exists, and hands it to the serving engine:
//! no instant is left at which a connection lives in an engine alone.
//!
//! What an engine sees:
//!
//! - `SHADOW_ACCEPT=runtime` in its environment ([`ENV`]);
//! - under each listening socket's name in `LISTEN_FDS`/`LISTEN_FDNAMES`,
//!   a connected `SOCK_SEQPACKET` Unix socket instead of the listener: its
//!   hand-off socket (`shadow-engine-kit`'s `handoff::receive` reads it);
//! - each packet is the text `FDNAME=<name>\n` and one descriptor
//!   (`SCM_RIGHTS`), an accepted, blocking, close-on-exec connection. It is
//!   already in the store under `<name>` ([`is_accepted_name`]); the
//!   engine stores its resume state under the same name, and sends
//!   `FDSTOREREMOVE=1` with `FDNAME=<name>` once it is done with the
//!   connection: until then the store's copy keeps the connection open
//!   (the client sees the end when both copies are closed, or at once
//!   after the engine's `shutdown(SHUT_WR)`);
//! - connections are handed to the engine that serves (the lock holder,
//!   once it fetched the store or said `READY=1`) and to no other; what
//!   was accepted while no engine served waits in the store, bounded by
//!   `shadow.dev/fdstore-max` (a full store accepts no more: the rest wait
//!   in the kernel's backlog). A fetch never returns a connection that was
//!   handed to the fetching engine itself; it returns every other one,
//!   handed to a dead engine or to nobody yet, and those are the fetching
//!   engine's from then on.
//! - once the store is full, a handed connection whose client has closed
//!   its side is let go by the store (engines that forget their removes
//!   cannot keep it full).

use crate::error::AnnotationError;
use crate::fdstore::NAME_MAX;

/// The annotation: who accepts the pair's connections.
pub const KEY: &str = "shadow.dev/accept";
/// Set to `runtime` in the environment of engines that are handed
/// connections ([`crate::env::ACCEPT`]).
pub const ENV: &str = crate::env::ACCEPT;
/// What every name of a connection the runtime accepted begins with:
/// `accepted.<listener index>.<n>`.
pub const NAME_PREFIX: &str = "accepted.";
/// The longest packet: the key, a name and its newline.
pub const PACKET_MAX: usize = "FDNAME=".len() + NAME_MAX + 1;

/// Who accepts the connections of the pair's listening sockets.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Accept {
    /// Each engine, on the listening sockets it inherits (the default).
    #[default]
    Engine,
    /// The runtime, which hands them to the serving engine.
    Runtime,
}

impl Accept {
    pub fn as_str(self) -> &'static str {
        match self {
            Accept::Engine => "engine",
            Accept::Runtime => "runtime",
        }
    }
}

/// `shadow.dev/accept` (and config `pair.accept`): `engine` or `runtime`.
pub fn parse(value: &str) -> Result<Accept, AnnotationError> {
    match value.trim() {
        "engine" => Ok(Accept::Engine),
        "runtime" => Ok(Accept::Runtime),
        _ => Err(AnnotationError {
            key: KEY.to_string(),
            value: value.to_string(),
            allowed: "engine|runtime".to_string(),
        }),
    }
}

/// Whether `name` is that of a connection the runtime accepted.
pub fn is_accepted_name(name: &str) -> bool {
    name.starts_with(NAME_PREFIX)
}

/// The name the runtime gives the `n`th connection of listener `index`.
pub fn accepted_name(index: usize, n: u64) -> String {
    format!("{NAME_PREFIX}{index}.{n}")
}

/// The text of a hand-off packet.
pub fn packet(name: &str) -> String {
    format!("FDNAME={name}\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fdstore::name_is_valid;

    #[test]
    fn the_accept_annotation_takes_engine_or_runtime() {
        assert_eq!(parse("engine").unwrap(), Accept::Engine);
        assert_eq!(parse(" runtime ").unwrap(), Accept::Runtime);
        let e = parse("kernel").unwrap_err().to_string();
        assert!(e.contains(KEY) && e.contains("engine|runtime"), "{e}");
        assert!(is_accepted_name(&accepted_name(0, 7)));
        assert!(name_is_valid(&accepted_name(15, u64::MAX)));
        assert!(!is_accepted_name("conn-0-1-2"));
    }
}
