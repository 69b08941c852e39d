//! Where the shim keeps a pair's files on the host. Several containerds may
//! run on one host (a node's CRI containerd beside a private one, a test
//! suite's), each with its own namespaces, and a namespace and id are
//! unique only within one containerd. So every host-side file of a pair is
//! keyed by the containerd that owns it:
//!
//! - the pair directory: `<state_dir>/<key>/<namespace>/<id>/`;
//! - the metrics file: `<metrics_dir>/shadow-<key>-<namespace>-<id>.prom`;
//!
//! where `<key>` is [`containerd_key`] of the containerd address the shim
//! was started with (`-address`). It is short on purpose: every Unix socket
//! below the pair directory must fit `sun_path` (107 bytes).

use std::path::{Path, PathBuf};

/// The 8-hex-digit key of a containerd, from the address it gives its
/// shims (`/run/containerd/containerd.sock`, with or without `unix://`):
/// a 32-bit FNV-1a digest, stable across shim versions and hosts, so a
/// tool computes the same key as the shim.
pub fn containerd_key(address: &str) -> String {
    let address = address.strip_prefix("unix://").unwrap_or(address);
    let digest = address.bytes().fold(0x811c_9dc5u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    });
    format!("{digest:08x}")
}

/// Whether a directory name under the state directory is a containerd key
/// (the state directory may also hold `metrics/` and the hooks' `hooks/`).
pub fn is_containerd_key(name: &str) -> bool {
    name.len() == 8
        && name
            .bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
}

/// Longest Unix socket path (`sun_path` is 108 bytes with its NUL).
pub const SUN_PATH_MAX: usize = 107;

/// Longest socket below a pair directory without GPUs:
/// `/gms/gms-host.sock`; `/pair/notify0.sock` and `/pair/store0.sock`
/// (each slot's notify and fd-store sockets, [`crate::paths`]) are no
/// longer (a test checks it).
pub const HOST_SOCKETS: usize = "/gms/".len() + crate::paths::GMS_HOST_SOCKET.len();
/// … and with GPUs: `/gms/gms-GPU-<36-character UUID>.sock`.
pub const CUDA_SOCKETS: usize = "/gms/gms-GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx.sock".len();

/// A pair's directory: `<state_dir>/<key>/<namespace>/<id>`, where the id
/// (then the namespace) is shortened when the sockets below it, the
/// longest `longest_socket` bytes, would not fit `sun_path`; see
/// [`dir_name`].
pub fn pair_root(
    state_dir: &Path,
    key: &str,
    namespace: &str,
    id: &str,
    longest_socket: usize,
) -> PathBuf {
    let base = state_dir.join(key);
    let max_dir = SUN_PATH_MAX.saturating_sub(longest_socket);
    // The namespace leaves room for the id, whole or as a bare digest.
    let id_room = id.len().min(DIGEST_HEX);
    let ns_room = max_dir.saturating_sub(base.as_os_str().len() + 1 + 1 + id_room);
    let parent = base.join(dir_name(namespace, ns_room));
    let room = max_dir.saturating_sub(parent.as_os_str().len() + 1);
    parent.join(dir_name(id, room))
}

/// The hex digits of a shortened name's digest (fewer when room is short).
const DIGEST_HEX: usize = 16;

/// The directory name for `name` (an id or a namespace): itself when it
/// fits in `room` bytes, else its first characters and a 64-bit FNV-1a
/// digest of the whole (`<up to 12 chars>-<16 hex>`; only the digest, and
/// down to 8 of its digits, when room is short), stable across shim
/// versions. `state.json` keeps the
/// full names for tools.
fn dir_name(name: &str, room: usize) -> String {
    if name.len() <= room {
        return name.to_string();
    }
    let digest = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    let hex = format!("{digest:016x}");
    let head_len = room.saturating_sub(DIGEST_HEX + 1).min(12);
    let head: String = name.chars().take(head_len).collect();
    if head.is_empty() {
        hex[..room.clamp(8, DIGEST_HEX)].to_string()
    } else {
        format!("{head}-{hex}")
    }
}

/// The metrics file name of a pair.
pub fn metrics_file_name(key: &str, namespace: &str, id: &str) -> String {
    format!("shadow-{key}-{namespace}-{id}.prom")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every socket the shim binds below a pair directory, for every slot
    /// a pair may have, fits the room [`pair_root`] leaves: a longer one
    /// would fail Create for ids and namespaces shortened to the limit.
    #[test]
    fn every_pair_socket_fits_the_room_left_for_it() {
        use crate::paths::{slot_fdstore_file, slot_notify_file};
        for slot in 0..=crate::annotations::MAX_SHADOWS {
            for name in [slot_notify_file(slot), slot_fdstore_file(slot)] {
                let path = format!("/pair/{name}");
                assert!(
                    path.len() <= HOST_SOCKETS,
                    "{path}: longer than {HOST_SOCKETS}"
                );
            }
        }
        // At the limit: a namespace and an id long enough to be shortened.
        let ns = "n".repeat(80);
        let root = pair_root(
            Path::new("/tmp/shadow-it-XXXXXX/pairs"),
            "1a2b3c4d",
            &ns,
            &"i".repeat(90),
            HOST_SOCKETS,
        );
        let store = root
            .join("pair")
            .join(slot_fdstore_file(crate::annotations::MAX_SHADOWS));
        assert!(
            store.as_os_str().len() <= SUN_PATH_MAX,
            "{}",
            store.display()
        );
    }

    #[test]
    fn keys_are_short_stable_and_ignore_the_scheme() {
        let k = containerd_key("/run/containerd/containerd.sock");
        assert_eq!(k.len(), 8);
        assert!(is_containerd_key(&k));
        assert_eq!(containerd_key("unix:///run/containerd/containerd.sock"), k);
        assert_ne!(containerd_key("/tmp/other/containerd.sock"), k);
        // A value computed once, so a change of the digest is noticed.
        assert_eq!(containerd_key(""), "811c9dc5");
        assert!(!is_containerd_key("metrics") && !is_containerd_key("hooks"));
        let root = pair_root(
            Path::new("/run/shadow"),
            "1a2b3c4d",
            "k8s.io",
            &"4f".repeat(32),
            CUDA_SOCKETS,
        );
        assert!(root.starts_with("/run/shadow/1a2b3c4d/k8s.io/"), "{root:?}");
        assert!(root.as_os_str().len() + CUDA_SOCKETS <= SUN_PATH_MAX);
        assert_eq!(
            metrics_file_name(&k, "default", "eng"),
            format!("shadow-{k}-default-eng.prom")
        );
    }
}
