//! The `createRuntime` stage, the one the OCI runtime spec itself defines
//! and plain runc runs: after the container's namespaces exist, before
//! pivot_root, in the runtime's namespace, with the container state on
//! stdin. A hook cannot change the container's environment any more, but
//! it can enter the container's mount namespace and bind the pair's host
//! directories into the rootfs. The engine then relies on the contract's
//! default paths, or on env the user put into config.json.
//!
//! The sources are bound by path after entering the namespace: the
//! container's mount namespace is a copy of the runtime's, so the pair's
//! host directories resolve there as long as the pair root is not on a
//! mount made after the container was created. (A bind from an fd opened
//! outside is refused with EINVAL: the source mount must belong to the
//! caller's namespace; `open_tree`/`move_mount` would lift that, later.)

use crate::admission::{admit, uid_of, Candidate};
use crate::error::{Error, Result};
use crate::layout::PairLayout;
use nix::errno::Errno;
use nix::fcntl::{open, openat, OFlag};
use nix::mount::{mount, MsFlags};
use nix::sched::{setns, CloneFlags};
use nix::sys::stat::{fstat, mkdirat, Mode, SFlag};
use serde::Deserialize;
use shadow_contract::annotations::Annotations;
use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Component, Path, PathBuf};

/// The OCI state a runtime writes on a hook's stdin (the fields used here).
#[derive(Debug, Deserialize)]
pub struct State {
    pub id: String,
    #[serde(default)]
    pub pid: i32,
    pub bundle: PathBuf,
    #[serde(default)]
    pub annotations: HashMap<String, String>,
}

impl State {
    pub fn parse(text: &str) -> Result<Self> {
        serde_json::from_str(text).map_err(|source| Error::Json {
            what: "OCI state on stdin",
            source,
        })
    }

    /// The pair this container belongs to, if its annotations name one.
    /// Every `shadow.dev/` annotation is validated, the shim's included.
    pub fn pair(&self, root: &Path) -> Result<Option<PairLayout>> {
        let annotations = Annotations::parse(&self.annotations)?;
        if annotations.pair_name.is_some() {
            // As the precreate hook: no supervisor here acts on them.
            crate::precreate::refuse_hang_keys_in(
                self.annotations
                    .iter()
                    .map(|(k, v)| (k.as_str(), v.as_str())),
            )?;
        }
        Ok(annotations.pair_name.map(|n| PairLayout::of(root, &n)))
    }

    /// Whether this container may join `layout`'s pair (its annotations,
    /// and its uid from the bundle's config.json, the runtime's file).
    pub fn admitted(&self, layout: &PairLayout) -> Result<()> {
        let uid = bundle_spec(&self.bundle).ok().as_ref().and_then(uid_of);
        admit(
            layout,
            &Candidate {
                id: Some(&self.id),
                uid,
                annotations: &self.annotations,
            },
        )
    }
}

/// The bundle's config.json, written by the runtime.
fn bundle_spec(bundle: &Path) -> Result<serde_json::Value> {
    let cfg = bundle.join("config.json");
    let text = std::fs::read_to_string(&cfg).map_err(|e| Error::io("reading", &cfg, e))?;
    serde_json::from_str(&text).map_err(|source| Error::Json {
        what: "bundle config.json",
        source,
    })
}

/// The rootfs path from the bundle's config.json (`root.path`, relative
/// to the bundle unless absolute).
fn rootfs_of(bundle: &Path) -> Result<PathBuf> {
    let spec = bundle_spec(bundle)?;
    shadow_contract::oci::rootfs(&spec, bundle).ok_or_else(|| Error::Shape {
        what: "bundle config.json",
        why: format!("{} has no root.path", bundle.join("config.json").display()),
    })
}

/// Opens (making what is missing) `rel` under `rootfs` as an `O_PATH`
/// directory descriptor, one component at a time under the previous
/// one's descriptor with `O_NOFOLLOW`: the image and earlier runs of the
/// container control the rootfs, and neither a symlink (aiming the bind
/// elsewhere, e.g. at the host's /etc) nor a FIFO (`O_PATH` never opens
/// it for I/O, so it cannot block) nor a swap between check and use can
/// redirect it. The bind then targets `/proc/self/fd/<fd>`, exactly the
/// directory opened.
fn open_target(rootfs: &Path, rel: &str, pid: i32) -> Result<OwnedFd> {
    let dir_flags = OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let mut at = open(
        rootfs,
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| Error::io("opening the container rootfs", rootfs, e.into()))?;
    let mut shown = rootfs.to_path_buf();
    for c in Path::new(rel).components() {
        let Component::Normal(part) = c else { continue };
        shown.push(part);
        let refuse = |why: &str| Error::Shape {
            what: "container rootfs",
            why: format!(
                "{} {why} (pid {pid}); refusing to bind through it",
                shown.display()
            ),
        };
        let next = match openat(&at, part, dir_flags, Mode::empty()) {
            Ok(fd) => fd,
            Err(Errno::ENOENT) => {
                mkdirat(&at, part, Mode::from_bits_truncate(0o755)).map_err(|e| {
                    Error::io("creating mount point in the rootfs", &shown, e.into())
                })?;
                openat(&at, part, dir_flags, Mode::empty())
                    .map_err(|e| Error::io("opening new mount point", &shown, e.into()))?
            }
            Err(Errno::ENOTDIR | Errno::ELOOP) => {
                return Err(refuse("is a symlink or not a directory"))
            }
            Err(e) => return Err(Error::io("opening", &shown, e.into())),
        };
        // O_PATH|O_NOFOLLOW opens a symlink itself; make sure it is a directory.
        let st = fstat(&next).map_err(|e| Error::io("fstat of", &shown, e.into()))?;
        if SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT != SFlag::S_IFDIR {
            return Err(refuse("is not a directory"));
        }
        at = next;
    }
    Ok(at)
}

/// Binds the pair's directories into the container whose state is given.
/// Returns false (and touches nothing) when the container is not in a pair.
pub fn bind_into_container(state: &State, root: &Path) -> Result<bool> {
    let Some(layout) = state.pair(root)? else {
        return Ok(false);
    };
    if state.pid <= 0 {
        return Err(Error::Shape {
            what: "OCI state",
            why: format!("container {} has no pid at createRuntime", state.id),
        });
    }
    state.admitted(&layout)?;
    layout.prepare()?;
    let rootfs = rootfs_of(&state.bundle)?;
    let pid = state.pid;
    let ns_path = PathBuf::from(format!("/proc/{pid}/ns/mnt"));
    let ns = std::fs::File::open(&ns_path).map_err(|e| Error::io("opening", &ns_path, e))?;
    // This process is single-threaded (no runtime, no helper threads), as
    // setns(CLONE_NEWNS) requires; it exits right after the mounts.
    setns(&ns, CloneFlags::CLONE_NEWNS).map_err(|source| Error::Namespace {
        what: "entering".into(),
        pid,
        source,
    })?;
    for (src, dst) in layout.binds() {
        let target = open_target(&rootfs, dst, pid)?;
        // The magic link names exactly the directory opened above.
        let by_fd = PathBuf::from(format!("/proc/self/fd/{}", target.as_raw_fd()));
        let shown = rootfs.join(dst.trim_start_matches('/'));
        mount(
            Some(&src),
            &by_fd,
            None::<&str>,
            MsFlags::MS_BIND | MsFlags::MS_REC,
            None::<&str>,
        )
        .map_err(|source| Error::Namespace {
            what: format!("binding {} at {}", src.display(), shown.display()),
            pid,
            source,
        })?;
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_parses_as_runc_writes_it() {
        let s = State::parse(
            r#"{"ociVersion":"1.0.2","id":"c1","status":"creating","pid":42,
               "bundle":"/b","annotations":{"shadow.dev/pair-name":"p"}}"#,
        )
        .unwrap();
        assert_eq!(s.pid, 42);
        let l = s.pair(Path::new("/r")).unwrap().unwrap();
        assert_eq!(l.dir, Path::new("/r/p"));
        assert!(State::parse("{").is_err());
        // Hang detection is the shim's: refused for a hook-assembled pair.
        let s = State::parse(
            r#"{"ociVersion":"1.0.2","id":"c1","status":"creating","pid":42,"bundle":"/b",
               "annotations":{"shadow.dev/pair-name":"p","shadow.dev/watchdog":"1s"}}"#,
        )
        .unwrap();
        let e = s.pair(Path::new("/r")).unwrap_err().to_string();
        assert!(
            e.contains("shadow.dev/watchdog") && e.contains("io.containerd.shadow.v1"),
            "{e}"
        );
    }

    #[test]
    fn targets_refuse_symlinks_and_fifos_in_the_rootfs() {
        let t = tempfile::tempdir().unwrap();
        let elsewhere = tempfile::tempdir().unwrap();
        std::fs::create_dir(t.path().join("run")).unwrap();
        std::os::unix::fs::symlink(elsewhere.path(), t.path().join("run/shadow")).unwrap();
        let e = open_target(t.path(), "/run/shadow/pair", 1).unwrap_err();
        assert!(e.to_string().contains("symlink"), "{e}");
        assert!(
            !elsewhere.path().join("pair").exists(),
            "a directory was made through the link"
        );
        // A FIFO where a directory should be: refused, and nothing blocks.
        std::fs::remove_file(t.path().join("run/shadow")).unwrap();
        nix::unistd::mkfifo(
            &t.path().join("run/shadow"),
            Mode::from_bits_truncate(0o600),
        )
        .unwrap();
        assert!(open_target(t.path(), "/run/shadow/pair", 1).is_err());

        let ok = tempfile::tempdir().unwrap();
        let fd = open_target(ok.path(), "/run/shadow/pair", 1).unwrap();
        assert!(ok.path().join("run/shadow/pair").is_dir());
        let by_fd = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).unwrap();
        assert_eq!(by_fd, ok.path().join("run/shadow/pair"));
    }

    #[test]
    fn rootfs_is_relative_to_the_bundle() {
        let t = tempfile::tempdir().unwrap();
        std::fs::write(
            t.path().join("config.json"),
            r#"{"root":{"path":"rootfs"}}"#,
        )
        .unwrap();
        assert_eq!(rootfs_of(t.path()).unwrap(), t.path().join("rootfs"));
    }
}
