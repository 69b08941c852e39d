//! `pidfd_open(2)`, written once for the workspace. A pidfd names one
//! process for as long as it is open, so a signal or an exit wait through
//! it can never reach another process that got the pid later. The launcher
//! watches its gmsd through one; the shim's leftover cleanup
//! (`shim/src/pair/leftovers.rs`) and the test harness (`tests/src`) open
//! one before they read a command line and signal, so that a pid recycled
//! in between is never hit.
//!
//! It lives in this crate because the launcher is its first user and the
//! shim and the harness already link it; `shadow-contract` stays names.

use std::os::fd::{FromRawFd, OwnedFd};

/// A pidfd for `pid` (no flags: blocking, not `PIDFD_NONBLOCK`), made
/// close-on-exec by the kernel. The error is the kernel's, unwrapped, so
/// that callers can tell `ESRCH` (no such process) from `ENOSYS` (a kernel
/// before 5.3) from `EINVAL` (a pid of 0 or less); callers add the context.
pub fn open(pid: libc::pid_t) -> std::io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and a flags word, touches no memory of
    // ours, and returns a new descriptor or -1 with errno set.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let fd = libc::c_int::try_from(fd).map_err(|_| {
        std::io::Error::other(format!("pidfd_open({pid}) returned {fd}, not a descriptor"))
    })?;
    // SAFETY: the kernel just returned this descriptor to us, open and
    // owned by nobody else; the OwnedFd closes it once.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;
    use std::time::Duration;

    /// Whether the process behind `fd` has ended, waiting at most `ms`.
    fn ended(fd: &OwnedFd, ms: i32) -> bool {
        let mut p = libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd that outlives the call.
        (unsafe { libc::poll(&mut p, 1, ms) }) == 1
    }

    #[test]
    fn a_pidfd_follows_its_process_to_its_end() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = libc::pid_t::try_from(child.id()).unwrap();
        let fd = open(pid).unwrap();
        // SAFETY: F_GETFD reads the flags of a descriptor we own.
        let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFD) };
        assert!(flags & libc::FD_CLOEXEC != 0, "close-on-exec");
        assert!(!ended(&fd, 0), "alive");
        child.kill().unwrap();
        assert!(ended(&fd, Duration::from_secs(10).as_millis() as i32));
        child.wait().unwrap();
    }

    #[test]
    fn no_process_is_the_kernels_error() {
        let gone = open(libc::pid_t::MAX).unwrap_err();
        assert_eq!(gone.raw_os_error(), Some(libc::ESRCH), "{gone}");
        let bad = open(0).unwrap_err();
        assert_eq!(bad.raw_os_error(), Some(libc::EINVAL), "{bad}");
    }
}
