//! Where the contract's files are inside an engine container. The host side
//! differs by path (the shim's per-pair state directory, the hook's
//! `/run/shadow/hooks/<pair>`), but every runtime binds its host
//! directories at these places.

/// The pair directory: the election lock and the notify socket.
pub const PAIR_DIR: &str = "/run/shadow/pair";
/// The lock file's name in [`PAIR_DIR`].
pub const LOCK_FILE: &str = "engine.lock";
/// The notify socket's name in [`PAIR_DIR`].
pub const NOTIFY_FILE: &str = "notify.sock";
/// The host-side name of slot `slot`'s own notify socket in a pair the
/// shim makes (`notify0.sock`, `notify1.sock`), bound in its engine at
/// [`NOTIFY_SOCKET`]: each engine has a kernel queue of its own, so one
/// that floods its socket fills only its own queue and never costs the
/// other engine a ping (a Unix datagram socket queues only
/// `net.unix.max_dgram_qlen` datagrams, 10 by default). No longer than
/// `gms-host.sock`, so a pair's longest socket path is unchanged.
pub fn slot_notify_file(slot: impl std::fmt::Display) -> String {
    format!("notify{slot}.sock")
}
/// The host-side name of slot `slot`'s fd-store fetch socket, bound in its
/// engine at [`FDSTORE_SOCKET`] (one per slot, as the notify sockets: the
/// socket a connection comes in on says whose it is): `store0.sock`, no
/// longer than `gms-host.sock` either, so that every pair directory the
/// shim shortens to fit `sun_path` fits this socket too.
pub fn slot_fdstore_file(slot: impl std::fmt::Display) -> String {
    format!("store{slot}.sock")
}
/// `SHADOW_FDSTORE_SOCKET`'s value.
pub const FDSTORE_SOCKET: &str = "/run/shadow/pair/fdstore.sock";
/// `SHADOW_LOCK_PATH`'s value.
pub const LOCK_PATH: &str = "/run/shadow/pair/engine.lock";
/// `NOTIFY_SOCKET`'s value.
pub const NOTIFY_SOCKET: &str = "/run/shadow/pair/notify.sock";
/// The GMS socket directory (`GMS_SOCKET_DIR`'s value).
pub const GMS_DIR: &str = "/run/shadow/gms";
/// The host backend's socket name in [`GMS_DIR`].
pub const GMS_HOST_SOCKET: &str = "gms-host.sock";

/// The socket name of the GMS daemon of one device: `gms-<GPU-UUID>.sock`
/// for a CUDA device, [`GMS_HOST_SOCKET`] for `host`.
pub fn gms_socket_name(device: &str) -> String {
    format!("gms-{device}.sock")
}

/// Whether a file name in a GMS socket directory is a daemon's socket.
pub fn is_gms_socket_name(name: &str) -> bool {
    name.len() > "gms-.sock".len() && name.starts_with("gms-") && name.ends_with(".sock")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_joined_from_their_parts() {
        assert_eq!(LOCK_PATH, format!("{PAIR_DIR}/{LOCK_FILE}"));
        assert_eq!(NOTIFY_SOCKET, format!("{PAIR_DIR}/{NOTIFY_FILE}"));
        assert_eq!(gms_socket_name("host"), GMS_HOST_SOCKET);
        assert_eq!(
            gms_socket_name("GPU-5e1b0c3a-0000-1111-2222-333344445555"),
            "gms-GPU-5e1b0c3a-0000-1111-2222-333344445555.sock"
        );
        assert!(is_gms_socket_name(GMS_HOST_SOCKET));
        assert!(!is_gms_socket_name("gms-.sock"));
        assert!(!is_gms_socket_name("gms-host.sock.tmp"));
        assert_eq!(slot_notify_file(1), "notify1.sock");
        // No pair socket path grows: a slot's is as long as the host gmsd's.
        assert!(format!("/pair/{}", slot_notify_file(1)).len() <= crate::host::HOST_SOCKETS);
    }
}
