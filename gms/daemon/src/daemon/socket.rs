//! The socket a daemon serves: a private directory (created 0700, never
//! world-writable), a socket bound 0600 (0660 for `--socket-group`) with no
//! window of looser permissions, a stale socket replaced and a live one
//! refused, and the file removed when the daemon stops. Kept apart from the
//! accept loop because these are the filesystem rules of docs/gms-protocol.md
//! ("Socket"), checked once before anything is served.

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use gms::{Error, Result};

/// Removes the socket file when the daemon stops, however it stops.
pub(super) struct SocketFile(pub(super) PathBuf);

impl Drop for SocketFile {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.0);
    }
}

/// Creates the socket directory if missing; refuses one that is not a
/// directory or is world-writable.
pub(super) fn prepare_dir(dir: &Path) -> Result<()> {
    if !dir.exists() {
        fs::create_dir_all(dir)
            .map_err(|e| Error::io(format!("creating socket directory {}", dir.display()), e))?;
        fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
            .map_err(|e| Error::io(format!("chmod 0700 {}", dir.display()), e))?;
    }
    let meta = fs::metadata(dir)
        .map_err(|e| Error::io(format!("socket directory {}", dir.display()), e))?;
    if !meta.is_dir() {
        return Err(Error::Config(format!(
            "{} is not a directory",
            dir.display()
        )));
    }
    if meta.mode() & 0o002 != 0 {
        return Err(Error::Config(format!(
            "socket directory {} is world-writable (mode {:o}); use a private directory",
            dir.display(),
            meta.mode() & 0o7777
        )));
    }
    Ok(())
}

/// Binds the socket at `path`, replacing a stale one, refusing a live one.
pub(super) fn bind(path: &Path, group: Option<u32>) -> Result<UnixListener> {
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            return Err(Error::Config(format!(
                "another gmsd already serves {}",
                path.display()
            )));
        }
        fs::remove_file(path)
            .map_err(|e| Error::io(format!("removing stale socket {}", path.display()), e))?;
    }
    // No window in which the socket exists with looser permissions: bind
    // under a umask that leaves 0600 (we are still single-threaded here).
    let old = nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o177));
    let bound = UnixListener::bind(path);
    nix::sys::stat::umask(old);
    let listener = bound.map_err(|e| Error::io(format!("binding {}", path.display()), e))?;
    if let Some(gid) = group {
        nix::unistd::chown(path, None, Some(nix::unistd::Gid::from_raw(gid)))
            .map_err(|e| Error::sys(format!("chown :{gid} {}", path.display()), e))?;
        fs::set_permissions(path, fs::Permissions::from_mode(0o660))
            .map_err(|e| Error::io(format!("chmod 0660 {}", path.display()), e))?;
    }
    Ok(listener)
}
