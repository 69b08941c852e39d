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

use crate::error::{Error, Result};
use crate::layout::PairLayout;
use nix::mount::{mount, MsFlags};
use nix::sched::{setns, CloneFlags};
use serde::Deserialize;
use shadow_contract::annotations::Annotations;
use std::collections::HashMap;
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
        Ok(annotations.pair_name.map(|n| PairLayout::of(root, &n)))
    }
}

/// The rootfs path from the bundle's config.json (`root.path`, relative
/// to the bundle unless absolute).
fn rootfs_of(bundle: &Path) -> Result<PathBuf> {
    let cfg = bundle.join("config.json");
    let text = std::fs::read_to_string(&cfg).map_err(|e| Error::io("reading", &cfg, e))?;
    let spec: serde_json::Value = serde_json::from_str(&text).map_err(|source| Error::Json {
        what: "bundle config.json",
        source,
    })?;
    let root = spec
        .get("root")
        .and_then(|r| r.get("path"))
        .and_then(|p| p.as_str())
        .ok_or_else(|| Error::Shape {
            what: "bundle config.json",
            why: format!("{} has no root.path", cfg.display()),
        })?;
    Ok(bundle.join(root))
}

/// Makes `rel` under `rootfs`, refusing symlinks on the way: the image
/// controls the rootfs, and a link must not aim the bind somewhere else.
fn make_target(rootfs: &Path, rel: &str, pid: i32) -> Result<PathBuf> {
    let mut at = rootfs.to_path_buf();
    for c in Path::new(rel).components() {
        let Component::Normal(part) = c else { continue };
        at.push(part);
        match std::fs::symlink_metadata(&at) {
            Ok(m) if m.file_type().is_symlink() => {
                return Err(Error::Shape {
                    what: "container rootfs",
                    why: format!(
                        "{} is a symlink (pid {pid}); refusing to bind through it",
                        at.display()
                    ),
                })
            }
            Ok(_) => {}
            Err(_) => std::fs::create_dir(&at)
                .map_err(|e| Error::io("creating mount point in the rootfs", &at, e))?,
        }
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
        let target = make_target(&rootfs, dst, pid)?;
        mount(
            Some(&src),
            &target,
            None::<&str>,
            MsFlags::MS_BIND | MsFlags::MS_REC,
            None::<&str>,
        )
        .map_err(|source| Error::Namespace {
            what: format!("binding {} at {}", src.display(), target.display()),
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
    }

    #[test]
    fn targets_refuse_symlinks_in_the_rootfs() {
        let t = tempfile::tempdir().unwrap();
        std::fs::create_dir(t.path().join("run")).unwrap();
        std::os::unix::fs::symlink("/etc", t.path().join("run/shadow")).unwrap();
        assert!(make_target(t.path(), "/run/shadow/pair", 1).is_err());
        let ok = tempfile::tempdir().unwrap();
        let p = make_target(ok.path(), "/run/shadow/pair", 1).unwrap();
        assert!(p.is_dir());
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
