//! Where a pair lives on the host: `<state_dir>/<key>/<namespace>/<name>/`
//! (`<key>`: the owning containerd, `shadow_contract::host`) with the
//! engines' shared directory (lock, notify socket), the GMS socket
//! directory, the pinned namespaces, one bundle per slot and `state.json`.
//! Its own file because the one constraint on it is subtle: every Unix
//! socket below it must fit `sun_path`, which long (CRI) ids and long
//! namespace names would break.

use std::path::{Path, PathBuf};

use shadow_contract::host::{pair_root, SUN_PATH_MAX};
pub use shadow_contract::host::{CUDA_SOCKETS, HOST_SOCKETS};

/// The host-side files of one pair: `<state_dir>/<key>/<namespace>/<name>/`,
/// where `<name>` is the container id, or a shortened form of it when the
/// id would make the pair's Unix sockets too long for `sun_path` (CRI ids
/// are 64 hex characters; see `shadow_contract::host::pair_root`); a
/// namespace too long to leave room for a shortened id is shortened too.
#[derive(Debug, Clone)]
pub struct PairDirs {
    pub root: PathBuf,
    pub pair: PathBuf,
    pub gms: PathBuf,
    pub ns: PathBuf,
    /// Every bundle directory a pair of this id may have, `slot-0` to
    /// `slot-<MAX_SHADOWS>`: a pair uses the first `N + 1`; a cleanup
    /// that does not know `N` looks at them all.
    pub slots: Vec<PathBuf>,
    pub state_json: PathBuf,
    /// What Create recorded for a later cleanup (the pair cgroup's path).
    pub cgroup_record: PathBuf,
}

impl PairDirs {
    /// `key`: the containerd's key (`shadow_contract::host::containerd_key`);
    /// `longest_socket`: the longest socket path below the pair directory
    /// ([`HOST_SOCKETS`] or [`CUDA_SOCKETS`]).
    pub fn new(
        state_dir: &Path,
        key: &str,
        namespace: &str,
        id: &str,
        longest_socket: usize,
    ) -> Self {
        let root = pair_root(state_dir, key, namespace, id, longest_socket);
        PairDirs {
            pair: root.join("pair"),
            gms: root.join("gms"),
            ns: root.join("ns"),
            slots: (0..=shadow_contract::annotations::MAX_SHADOWS)
                .map(|n| root.join(format!("slot-{n}")))
                .collect(),
            state_json: root.join("state.json"),
            cgroup_record: root.join("cgroup"),
            root,
        }
    }

    /// Whether every socket below the pair directory fits `sun_path`: the
    /// id and the namespace are shortened to fit, down to 8-digit digests,
    /// but a long `state_dir` alone may leave too little room for the
    /// sockets of a GPU pair (`gms-GPU-<uuid>.sock`).
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

    /// Where a pair of `id` may be, with or without GPUs (the socket room
    /// differs): for a cleanup that does not know which it was.
    pub fn candidates(state_dir: &Path, key: &str, namespace: &str, id: &str) -> Vec<PairDirs> {
        let host = PairDirs::new(state_dir, key, namespace, id, HOST_SOCKETS);
        let cuda = PairDirs::new(state_dir, key, namespace, id, CUDA_SOCKETS);
        if cuda.root == host.root {
            vec![host]
        } else {
            vec![host, cuda]
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "1a2b3c4d";
    const CRI_ID: &str = "4f0c1b2d3e4f5a6b7c8d9e0f1a2b3c4d5e6f7a8b9c0d1e2f3a4b5c6d7e8f9a0b";

    fn dirs(ns: &str, id: &str, longest: usize) -> PairDirs {
        PairDirs::new(Path::new("/run/shadow"), KEY, ns, id, longest)
    }

    #[test]
    fn pair_dirs_keep_sockets_within_sun_path() {
        let d = dirs("k8s.io", CRI_ID, CUDA_SOCKETS);
        let gms_sock = d
            .gms
            .join("gms-GPU-5a2b1c3d-0e1f-2a3b-4c5d-6e7f8a9b0c1d.sock");
        assert!(gms_sock.as_os_str().len() <= 107, "{}", gms_sock.display());
        for slot in 0..2 {
            let notify = d.pair.join(shadow_contract::paths::slot_notify_file(slot));
            assert!(notify.as_os_str().len() <= 107, "{}", notify.display());
        }
        let name = d.root.file_name().unwrap().to_string_lossy().into_owned();
        assert!(name.starts_with("4f0c1b2d-"), "{name}");
        // Deterministic, and distinct for distinct ids.
        assert_eq!(dirs("k8s.io", CRI_ID, CUDA_SOCKETS).root, d.root);
        let other = CRI_ID.replace('b', "c");
        assert_ne!(dirs("k8s.io", &other, CUDA_SOCKETS).root, d.root);
        // A host pair with the same id has more room; short ids fit whole.
        let d = dirs("k8s.io", CRI_ID, HOST_SOCKETS);
        let name = d.root.file_name().unwrap().to_string_lossy().into_owned();
        assert!(name.starts_with("4f0c1b2d3e4f-"), "{name}");
        assert!(d.gms.join("gms-host.sock").as_os_str().len() <= 107);
        let d = dirs("default", "llm", CUDA_SOCKETS);
        assert_eq!(d.root, Path::new("/run/shadow/1a2b3c4d/default/llm"));
    }

    #[test]
    fn containerds_and_long_namespaces_get_their_own_dirs() {
        let a = PairDirs::new(
            Path::new("/run/shadow"),
            "1a2b3c4d",
            "default",
            "llm",
            HOST_SOCKETS,
        );
        let b = PairDirs::new(
            Path::new("/run/shadow"),
            "5e6f7a8b",
            "default",
            "llm",
            HOST_SOCKETS,
        );
        assert_ne!(a.root, b.root);
        // containerd's longest namespace (76 characters) with a CRI id.
        let ns = "n".repeat(76);
        for longest in [HOST_SOCKETS, CUDA_SOCKETS] {
            let d = dirs(&ns, CRI_ID, longest);
            assert!(
                d.root.as_os_str().len() + longest <= 107,
                "{}",
                d.root.display()
            );
            let other = dirs(&"m".repeat(76), CRI_ID, longest);
            assert_ne!(other.root, d.root);
        }
        let c = PairDirs::candidates(Path::new("/run/shadow"), KEY, "k8s.io", CRI_ID);
        assert_eq!(c.len(), 2);
        assert_eq!(
            PairDirs::candidates(Path::new("/run/shadow"), KEY, "default", "llm").len(),
            1
        );
    }

    #[test]
    fn a_state_dir_too_long_for_gpu_sockets_is_said_so() {
        let long = Path::new("/run/").join("s".repeat(40));
        let d = PairDirs::new(&long, KEY, "default", "llm", CUDA_SOCKETS);
        let e = d.fits(CUDA_SOCKETS).unwrap_err();
        assert!(e.contains("pair.state_dir") && e.contains("107"), "{e}");
        let d = PairDirs::new(&long, KEY, "default", "llm", HOST_SOCKETS);
        assert!(d.fits(HOST_SOCKETS).is_ok());
        assert!(dirs(&"n".repeat(76), "llm", CUDA_SOCKETS)
            .fits(CUDA_SOCKETS)
            .is_ok());
    }
}
