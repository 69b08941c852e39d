//! The environment variables of the engine contract. The shim sets them in
//! both engine specs, the precreate hook adds them to a podman/CRI-O spec,
//! and an exec in the active engine gets the engine's values.

/// The engine's slot, `0` or `1`.
pub const ENGINE_ID: &str = "SHADOW_ENGINE_ID";
/// The election lock an engine `flock`s to become active.
pub const LOCK_PATH: &str = "SHADOW_LOCK_PATH";
/// The sd_notify datagram socket (`STATUS=parked`, `READY=1`).
pub const NOTIFY_SOCKET: &str = "NOTIFY_SOCKET";
/// The directory of the pair's GMS sockets.
pub const GMS_SOCKET_DIR: &str = "GMS_SOCKET_DIR";

/// systemd socket activation: the number of inherited listening sockets,
/// descriptors 3.. (a pair with `shadow.dev/listen`; see [`crate::listen`]).
pub const LISTEN_FDS: &str = "LISTEN_FDS";
/// systemd socket activation: the pid the sockets are meant for; `1`, the
/// engine as its container's init.
pub const LISTEN_PID: &str = "LISTEN_PID";
/// systemd socket activation: the sockets' names, `:`-separated.
pub const LISTEN_FDNAMES: &str = "LISTEN_FDNAMES";

/// The pair's fd-store fetch socket (`crate::fdstore`): a promoted
/// engine fetches the store there. Set when the pair has a store
/// (`shadow.dev/fdstore-max` not 0).
pub const FDSTORE_SOCKET: &str = "SHADOW_FDSTORE_SOCKET";

/// `runtime` when the runtime accepts the pair's connections
/// (`shadow.dev/accept: runtime`): the descriptors under the listening
/// sockets' names are hand-off sockets (`crate::handoff`). Set with
/// `shadow.dev/listen` only; an exec never gets it.
pub const ACCEPT: &str = "SHADOW_ACCEPT";

/// systemd's watchdog (`sd_watchdog_enabled(3)`, set with
/// `shadow.dev/watchdog`): the interval, in microseconds, within which an
/// engine whose watchdog is armed (by its first `WATCHDOG=1`) must ping
/// again; see [`crate::watchdog`].
pub const WATCHDOG_USEC: &str = "WATCHDOG_USEC";
/// systemd's watchdog: the pid the interval is meant for; `1`, the
/// engine's main process (its other processes inherit the variables and
/// must not ping).
pub const WATCHDOG_PID: &str = "WATCHDOG_PID";

/// The variables an engine gets today, in the order they are added.
pub const ENGINE: [&str; 4] = [ENGINE_ID, LOCK_PATH, NOTIFY_SOCKET, GMS_SOCKET_DIR];

/// The socket-activation variables, set only with `shadow.dev/listen`; an
/// exec never gets them (it inherits no socket and is not pid 1).
pub const LISTEN: [&str; 3] = [LISTEN_FDS, LISTEN_PID, LISTEN_FDNAMES];

/// The watchdog's variables, set only with `shadow.dev/watchdog`; an exec
/// never gets them (it is not the engine's main process and must not ping).
pub const WATCHDOG: [&str; 2] = [WATCHDOG_USEC, WATCHDOG_PID];

/// Whether a `KEY=value` entry sets one of [`ENGINE`]'s variables (the
/// entries a runtime replaces with its own).
pub fn is_engine_entry(entry: &str) -> bool {
    name_of(entry).is_some_and(|k| ENGINE.contains(&k))
}

/// The name of a `KEY=value` entry; `None` without `=`.
pub fn name_of(entry: &str) -> Option<&str> {
    entry.split_once('=').map(|(k, _)| k)
}

/// `KEY=value`.
pub fn entry(name: &str, value: impl std::fmt::Display) -> String {
    format!("{name}={value}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_match_by_whole_name() {
        assert!(is_engine_entry("SHADOW_ENGINE_ID=1"));
        assert!(is_engine_entry("GMS_SOCKET_DIR="));
        assert!(!is_engine_entry("SHADOW_ENGINE_IDX=1"));
        assert!(!is_engine_entry("SHADOW_ENGINE_ID"));
        assert!(!is_engine_entry("LISTEN_FDS=3"), "never copied to an exec");
        assert!(
            !is_engine_entry("WATCHDOG_USEC=1000000"),
            "never copied to an exec"
        );
        assert!(
            !is_engine_entry("WATCHDOG_PID=1"),
            "never copied to an exec"
        );
        assert_eq!(entry(LOCK_PATH, "/x"), "SHADOW_LOCK_PATH=/x");
    }
}
