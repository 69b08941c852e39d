//! Where a pair lives on the host: `<state_dir>/<namespace>/<name>/` with
//! the engines' shared directory (lock, notify socket), the GMS socket
//! directory, the pinned namespaces, one bundle per slot and `state.json`.
//! Its own file because the one constraint on it is subtle: every Unix
//! socket below it must fit `sun_path`, which long (CRI) ids would break.

use std::path::{Path, PathBuf};

/// The host-side files of one pair: `<state_dir>/<namespace>/<name>/`,
/// where `<name>` is the container id, or a shortened form of it when the
/// id would make the pair's Unix sockets too long for `sun_path` (CRI ids
/// are 64 hex characters; see [`dir_name`]).
#[derive(Debug, Clone)]
pub struct PairDirs {
    pub root: PathBuf,
    pub pair: PathBuf,
    pub gms: PathBuf,
    pub ns: PathBuf,
    pub slots: [PathBuf; 2],
    pub state_json: PathBuf,
}

impl PairDirs {
    /// `longest_socket`: the longest socket path below the pair directory
    /// ([`HOST_SOCKETS`] or [`CUDA_SOCKETS`]).
    pub fn new(state_dir: &Path, namespace: &str, id: &str, longest_socket: usize) -> Self {
        let parent = state_dir.join(namespace);
        let max_dir = SUN_PATH_MAX.saturating_sub(longest_socket);
        let room = max_dir.saturating_sub(parent.as_os_str().len() + 1);
        let root = parent.join(dir_name(id, room));
        PairDirs {
            pair: root.join("pair"),
            gms: root.join("gms"),
            ns: root.join("ns"),
            slots: [root.join("slot-0"), root.join("slot-1")],
            state_json: root.join("state.json"),
            root,
        }
    }

    /// Whether every socket below the pair directory fits `sun_path`: the
    /// id is shortened to fit, but `<state_dir>/<namespace>/` alone may be
    /// too long for the sockets of a GPU pair (`gms-GPU-<uuid>.sock`).
    pub fn fits(&self, longest_socket: usize) -> Result<(), String> {
        let longest = self.root.as_os_str().len() + longest_socket;
        if longest <= SUN_PATH_MAX {
            return Ok(());
        }
        Err(format!(
            "its Unix sockets under {} would be {longest} bytes long, more than a Unix socket path \
             may be ({SUN_PATH_MAX}); use a shorter pair.state_dir (shim config) or namespace",
            self.root.display()
        ))
    }
}

/// Longest Unix socket path (`sun_path` is 108 bytes with its NUL).
const SUN_PATH_MAX: usize = 107;
/// Longest socket below a pair directory without GPUs:
/// `/gms/gms-host.sock` and `/pair/notify.sock`.
pub const HOST_SOCKETS: usize = "/gms/".len() + shadow_contract::paths::GMS_HOST_SOCKET.len();
/// … and with GPUs: `/gms/gms-GPU-<36-character UUID>.sock`.
pub const CUDA_SOCKETS: usize = "/gms/gms-GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx.sock".len();

/// The directory name of a pair: its id when it fits in `room` bytes, else
/// the id's first characters and a 64-bit FNV-1a digest of the whole id
/// (`<12 chars>-<16 hex>`), stable across shim versions. `state.json` keeps
/// the full id for tools.
fn dir_name(id: &str, room: usize) -> String {
    if id.len() <= room {
        return id.to_string();
    }
    let digest = id.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    let head: String = id.chars().take(12).collect();
    format!("{head}-{digest:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    const CRI_ID: &str = "4f0c1b2d3e4f5a6b7c8d9e0f1a2b3c4d5e6f7a8b9c0d1e2f3a4b5c6d7e8f9a0b";

    fn dirs(ns: &str, id: &str, longest: usize) -> PairDirs {
        PairDirs::new(Path::new("/run/shadow"), ns, id, longest)
    }

    #[test]
    fn pair_dirs_keep_sockets_within_sun_path() {
        let d = dirs("k8s.io", CRI_ID, CUDA_SOCKETS);
        let gms_sock = d
            .gms
            .join("gms-GPU-5a2b1c3d-0e1f-2a3b-4c5d-6e7f8a9b0c1d.sock");
        assert!(gms_sock.as_os_str().len() <= 107, "{}", gms_sock.display());
        assert!(d.pair.join("notify.sock").as_os_str().len() <= 107);
        let name = d.root.file_name().unwrap().to_string_lossy().into_owned();
        assert!(name.starts_with("4f0c1b2d3e4f-"), "{name}");
        // Deterministic, and distinct for distinct ids.
        assert_eq!(dirs("k8s.io", CRI_ID, CUDA_SOCKETS).root, d.root);
        let other = CRI_ID.replace('b', "c");
        assert_ne!(dirs("k8s.io", &other, CUDA_SOCKETS).root, d.root);
        // A host pair with the same id fits whole; so do short ids.
        let d = dirs("k8s.io", CRI_ID, HOST_SOCKETS);
        assert_eq!(d.root.file_name().unwrap().to_string_lossy(), CRI_ID);
        assert!(d.gms.join("gms-host.sock").as_os_str().len() <= 107);
        let d = dirs("default", "llm", CUDA_SOCKETS);
        assert_eq!(d.root, Path::new("/run/shadow/default/llm"));
        assert!(d.fits(CUDA_SOCKETS).is_ok());
    }

    #[test]
    fn a_namespace_too_long_for_gpu_sockets_is_said_so() {
        let ns = "n".repeat(40);
        let d = dirs(&ns, "llm", CUDA_SOCKETS);
        let e = d.fits(CUDA_SOCKETS).unwrap_err();
        assert!(e.contains("pair.state_dir") && e.contains("107"), "{e}");
        assert!(dirs(&ns, "llm", HOST_SOCKETS).fits(HOST_SOCKETS).is_ok());
    }
}
