//! Where a pair lives on the host when no shim supervises it: one directory
//! per pair name under a root (default `/run/shadow/hooks`), holding
//! `pair/` (the election lock, bound at `/run/shadow/pair`) and `gms/`
//! (gmsd's socket, bound at `/run/shadow/gms`). The precreate hook, the
//! createRuntime hook, the CDI generator and the gmsd launcher all derive
//! the same paths from the same name, so they agree without talking.

//!
//! The in-container paths, the variable names and the pair-name rules are
//! `shadow_contract`'s, the same the shim uses.

use crate::error::{Error, Result};
use nix::fcntl::{open, openat, OFlag};
use nix::sys::stat::Mode;
use shadow_contract::annotations::PairName;
use shadow_contract::{env, paths};
use std::fs::File;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt};
use std::path::{Path, PathBuf};

/// Default root of the per-pair host directories.
pub const DEFAULT_ROOT: &str = "/run/shadow/hooks";

/// The host paths of one named pair.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PairLayout {
    pub name: String,
    pub dir: PathBuf,
}

impl PairLayout {
    /// Checks the name, because it becomes a path component and a CDI
    /// device name: nothing that could climb out of `root`.
    pub fn new(root: &Path, name: &str) -> Result<Self> {
        Ok(Self::of(root, &PairName::new(name)?))
    }

    /// The layout of a name already checked (parsed from annotations).
    pub fn of(root: &Path, name: &PairName) -> Self {
        PairLayout {
            name: name.as_str().to_owned(),
            dir: root.join(name.as_str()),
        }
    }

    pub fn pair_dir(&self) -> PathBuf {
        self.dir.join("pair")
    }

    pub fn gms_dir(&self) -> PathBuf {
        self.dir.join("gms")
    }

    pub fn lock_file(&self) -> PathBuf {
        self.pair_dir().join(paths::LOCK_FILE)
    }

    pub fn notify_socket(&self) -> PathBuf {
        self.pair_dir().join(paths::NOTIFY_FILE)
    }

    pub fn gmsd_pid_file(&self) -> PathBuf {
        self.dir.join("gmsd.pid")
    }

    pub fn gmsd_log(&self) -> PathBuf {
        self.dir.join("gmsd.log")
    }

    /// Who may join (written by `gms start`/`gms run`; see `admission`).
    pub fn admission_file(&self) -> PathBuf {
        self.dir.join("admission.json")
    }

    /// Opens the election lock inside `pair/`, a directory every container
    /// of the pair can write (it is bound into them): so never through a
    /// symlink (`O_NOFOLLOW` under a directory fd), never blocking on a
    /// FIFO (`O_NONBLOCK`), and only a regular file. `None`: no lock file
    /// and `create` was false.
    fn open_lock(&self, create: bool) -> Result<Option<File>> {
        let dir_path = self.pair_dir();
        let dir = open(
            &dir_path,
            OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_RDONLY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| Error::io("opening pair directory", &dir_path, e.into()))?;
        let mut flags = OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC;
        if create {
            flags |= OFlag::O_CREAT;
        }
        let lock = self.lock_file();
        let fd = match openat(
            &dir,
            paths::LOCK_FILE,
            flags,
            Mode::from_bits_truncate(0o600),
        ) {
            Ok(fd) => fd,
            Err(nix::errno::Errno::ENOENT) if !create => return Ok(None),
            Err(nix::errno::Errno::ELOOP) => {
                return Err(Error::Shape {
                    what: "pair lock",
                    why: format!(
                        "{} is a symlink (planted by a container?); refusing to follow it",
                        lock.display()
                    ),
                })
            }
            Err(e) => return Err(Error::io("opening lock file", &lock, e.into())),
        };
        let file = File::from(fd);
        let meta = file
            .metadata()
            .map_err(|e| Error::io("fstat of lock file", &lock, e))?;
        if !meta.file_type().is_file() {
            return Err(Error::Shape {
                what: "pair lock",
                why: format!(
                    "{} is not a regular file ({:?}); refusing to use it",
                    lock.display(),
                    meta.file_type()
                ),
            });
        }
        Ok(Some(file))
    }

    /// Creates the directories (0700: only root's engines and gmsd use
    /// them) and the lock file, which engines open read-only to flock.
    /// Idempotent, so every hook invocation may call it.
    pub fn prepare(&self) -> Result<()> {
        for d in [self.dir.clone(), self.pair_dir(), self.gms_dir()] {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&d)
                .map_err(|e| Error::io("creating pair directory", &d, e))?;
        }
        self.open_lock(true)?;
        Ok(())
    }

    /// Whether some engine holds the election lock now (a non-blocking
    /// flock attempt that is released at once).
    pub fn lock_held(&self) -> bool {
        let Ok(Some(f)) = self.open_lock(false) else {
            return false;
        };
        match nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusiveNonblock) {
            Ok(_released_on_drop) => false,
            Err((_, e)) => e == nix::errno::Errno::EWOULDBLOCK,
        }
    }

    /// The environment an engine of this pair gets (NOTIFY_SOCKET only
    /// when something on the host listens there: nobody reads sd_notify
    /// without the shim, unless a user binds a socket of their own).
    pub fn env(&self, slot: Option<u8>) -> Vec<(String, String)> {
        let mut vars = vec![
            (env::LOCK_PATH.to_owned(), paths::LOCK_PATH.to_owned()),
            (env::GMS_SOCKET_DIR.to_owned(), paths::GMS_DIR.to_owned()),
        ];
        if let Some(s) = slot {
            vars.push((env::ENGINE_ID.to_owned(), s.to_string()));
        }
        // lstat: a link planted in the container-writable pair dir is not
        // a socket.
        let is_socket = std::fs::symlink_metadata(self.notify_socket())
            .is_ok_and(|m| m.file_type().is_socket());
        if is_socket {
            vars.push((
                env::NOTIFY_SOCKET.to_owned(),
                paths::NOTIFY_SOCKET.to_owned(),
            ));
        }
        vars
    }

    /// (host source, container destination) of the two bind mounts.
    pub fn binds(&self) -> [(PathBuf, &'static str); 2] {
        [
            (self.pair_dir(), paths::PAIR_DIR),
            (self.gms_dir(), paths::GMS_DIR),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_that_could_escape_the_root_are_refused() {
        let root = Path::new("/r");
        for bad in ["", "..", ".x", "a/b", "a b", &"x".repeat(65)] {
            assert!(PairLayout::new(root, bad).is_err(), "{bad:?} accepted");
        }
        let l = PairLayout::new(root, "llama-70b_v2.1").unwrap();
        assert_eq!(
            l.lock_file(),
            Path::new("/r/llama-70b_v2.1/pair/engine.lock")
        );
        assert_eq!(l.gms_dir(), Path::new("/r/llama-70b_v2.1/gms"));
    }

    #[test]
    fn prepare_makes_the_lock_and_the_lock_is_seen_held() {
        let t = tempfile::tempdir().unwrap();
        let l = PairLayout::new(t.path(), "p").unwrap();
        l.prepare().unwrap();
        l.prepare().unwrap();
        assert!(!l.lock_held());
        let f = std::fs::File::open(l.lock_file()).unwrap();
        let held = nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusive).unwrap();
        assert!(l.lock_held());
        drop(held);
        assert!(!l.lock_held());
    }

    /// `pair/` is writable by the pair's containers: a symlink planted as
    /// the lock is not followed (nothing is created where it points), and
    /// a FIFO does not block the hook.
    #[test]
    fn a_planted_symlink_or_fifo_lock_is_refused_without_blocking() {
        let t = tempfile::tempdir().unwrap();
        let l = PairLayout::new(t.path(), "p").unwrap();
        l.prepare().unwrap();
        std::fs::remove_file(l.lock_file()).unwrap();
        let target = t.path().join("root-owned-file-elsewhere");
        std::os::unix::fs::symlink(&target, l.lock_file()).unwrap();
        let e = l.prepare().unwrap_err();
        assert!(e.to_string().contains("symlink"), "{e}");
        assert!(!target.exists(), "the hook followed the link");
        assert!(!l.lock_held());

        std::fs::remove_file(l.lock_file()).unwrap();
        nix::unistd::mkfifo(&l.lock_file(), Mode::from_bits_truncate(0o600)).unwrap();
        // A blocking open of a FIFO would hang here for ever.
        let e = l.prepare().unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
        assert!(!l.lock_held());
    }

    #[test]
    fn env_has_notify_only_when_a_socket_exists() {
        let t = tempfile::tempdir().unwrap();
        let l = PairLayout::new(t.path(), "p").unwrap();
        l.prepare().unwrap();
        let keys = |e: Vec<(String, String)>| e.into_iter().map(|(k, _)| k).collect::<Vec<_>>();
        assert_eq!(
            keys(l.env(Some(1))),
            ["SHADOW_LOCK_PATH", "GMS_SOCKET_DIR", "SHADOW_ENGINE_ID"]
        );
        let _s = std::os::unix::net::UnixDatagram::bind(l.notify_socket()).unwrap();
        assert!(keys(l.env(None)).contains(&"NOTIFY_SOCKET".to_owned()));
    }
}
