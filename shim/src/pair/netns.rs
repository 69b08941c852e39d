//! Pinned namespaces for a pair with no sandbox (ctr, nerdctl): one network
//! and one IPC namespace made once per pair and kept alive by bind mounts
//! onto files in the pair's `ns/` directory, so that every engine of every
//! generation joins the same ones and the serving engine always has the
//! same address. A short-lived thread unshares (network and IPC namespaces
//! are per thread), brings `lo` up, and the mounts outlive it.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sched::{unshare, CloneFlags};

use crate::error::{Error, Result};

#[derive(Debug)]
pub struct PinnedNamespaces {
    pub net: PathBuf,
    pub ipc: PathBuf,
}

/// Brings `lo` up in the calling thread's network namespace.
pub(crate) fn lo_up() -> std::io::Result<()> {
    // SAFETY: plain socket(2); the fd is owned by OwnedFd right after.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh, valid descriptor nobody else owns.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: ifreq is plain data; all-zero is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (i, b) in b"lo".iter().enumerate() {
        req.ifr_name[i] = *b as libc::c_char;
    }
    // SAFETY: SIOCGIFFLAGS/SIOCSIFFLAGS read and write one ifreq, valid for
    // both calls; the socket is ours.
    unsafe {
        if libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) < 0 {
            return Err(std::io::Error::last_os_error());
        }
        req.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
        if libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &req) < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

fn bind_ns(kind: &str, target: &Path) -> Result<()> {
    std::fs::write(target, b"")
        .map_err(|e| Error::io(format!("creating namespace pin {}", target.display()), e))?;
    let source = format!("/proc/thread-self/ns/{kind}");
    mount(
        Some(source.as_str()),
        target,
        None::<&str>,
        MsFlags::MS_BIND,
        None::<&str>,
    )
    .map_err(|e| Error::sys(format!("bind-mounting {source} on {}", target.display()), e))
}

impl PinnedNamespaces {
    /// New network + IPC namespaces pinned at `dir/net` and `dir/ipc`.
    pub fn pin(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
        let pins = PinnedNamespaces {
            net: dir.join("net"),
            ipc: dir.join("ipc"),
        };
        let (net, ipc) = (pins.net.clone(), pins.ipc.clone());
        let made = std::thread::spawn(move || -> Result<()> {
            unshare(CloneFlags::CLONE_NEWNET | CloneFlags::CLONE_NEWIPC)
                .map_err(|e| Error::sys("unshare(CLONE_NEWNET|CLONE_NEWIPC)", e))?;
            lo_up().map_err(|e| Error::io("bringing lo up in the pinned network namespace", e))?;
            bind_ns("net", &net)?;
            bind_ns("ipc", &ipc)
        })
        .join()
        .map_err(|_| Error::FailedPrecondition("namespace pinning thread panicked".into()))?;
        if let Err(e) = made {
            pins.unpin();
            return Err(e);
        }
        Ok(pins)
    }

    /// Unmount and remove the pins (the namespaces go when nothing uses them).
    pub fn unpin(&self) {
        for p in [&self.net, &self.ipc] {
            let _ = umount2(p.as_path(), MntFlags::MNT_DETACH);
            let _ = std::fs::remove_file(p);
        }
    }
}
