//! The handle of a started gmsd ([`Gmsd`]) and who reaps it ([`Reaper`]):
//! signals, the exit check and the bounded wait, through a pidfd so that a
//! recycled pid is never hit.
//!
//! It exists apart because the handle outlives the launch: the shim keeps
//! it for the pair's life and the hook waits on it or detaches it, while
//! the launch code only builds it. Free to change: how the wait polls.
//! Relied on elsewhere: [`Reaper::Elsewhere`] never reaps (the shim is a
//! subreaper whose exit router alone calls `waitpid`, so an exit is read
//! here only with `WNOWAIT`), and dropping the handle neither kills nor
//! waits.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

use shadow_contract::state::Exit;

/// Who collects the child's exit status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reaper {
    /// The launcher and its [`Gmsd`] handle (the hook: a plain process).
    Launcher,
    /// Someone else's `waitpid` loop (the shim: a subreaper). The launcher
    /// never reaps; an early exit is read with `WNOWAIT`.
    Elsewhere,
}
/// A running gmsd that announced its socket. Dropping the handle leaves
/// the daemon running (it is a service, not a scope); stop it with
/// [`Gmsd::signal`].
#[derive(Debug)]
pub struct Gmsd {
    pid: u32,
    socket: PathBuf,
    /// Signals and exit checks go through it, so a recycled pid is never
    /// hit. None on kernels without pidfds (< 5.3).
    pidfd: Option<OwnedFd>,
    /// Held when the launcher reaps ([`Reaper::Launcher`]).
    child: Option<Child>,
    reaper: Reaper,
}

impl Gmsd {
    /// The handle of a child just started, before it announced a socket.
    /// With [`Reaper::Elsewhere`] the std `Child` is dropped, which neither
    /// waits nor kills.
    pub(crate) fn started(child: Child, pidfd: Option<OwnedFd>, reaper: Reaper) -> Gmsd {
        Gmsd {
            pid: child.id(),
            socket: PathBuf::new(),
            pidfd,
            child: (reaper == Reaper::Launcher).then_some(child),
            reaper,
        }
    }

    /// The handle once the child announced `socket`.
    pub(crate) fn announced(mut self, socket: PathBuf) -> Gmsd {
        self.socket = socket;
        self
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The socket engines connect to.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The pidfd, for callers that watch the exit themselves.
    pub fn pidfd(&self) -> Option<BorrowedFd<'_>> {
        self.pidfd.as_ref().map(|fd| fd.as_fd())
    }

    /// Sends `signal` (e.g. `libc::SIGTERM`).
    pub fn signal(&self, signal: i32) -> std::io::Result<()> {
        let rc = match &self.pidfd {
            // SAFETY: pidfd_send_signal with a pidfd we own, a signal
            // number and a null siginfo (the kernel fills it in).
            Some(fd) => unsafe {
                libc::syscall(
                    libc::SYS_pidfd_send_signal,
                    fd.as_raw_fd(),
                    signal,
                    std::ptr::null::<libc::siginfo_t>(),
                    0,
                )
            },
            // SAFETY: kill(2) with integer arguments.
            None => libc::c_long::from(unsafe { libc::kill(self.pid as libc::pid_t, signal) }),
        };
        if rc < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// Whether the process has ended (zombie or reaped). Does not reap.
    pub fn has_exited(&self) -> bool {
        match &self.pidfd {
            Some(fd) => {
                let mut p = libc::pollfd {
                    fd: fd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: one valid pollfd, zero timeout.
                unsafe { libc::poll(&mut p, 1, 0) == 1 }
            }
            // SAFETY: kill(2) with signal 0 only checks existence.
            None => (unsafe { libc::kill(self.pid as libc::pid_t, 0) }) != 0,
        }
    }

    /// Whether the process ends before `deadline` (true without a pidfd:
    /// then there is nothing to wait on but the reaper).
    pub(crate) fn ends_within(&self, deadline: Instant) -> bool {
        let Some(fd) = &self.pidfd else {
            return true;
        };
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let mut p = libc::pollfd {
                fd: fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            let ms = left.as_millis().min(i32::MAX as u128) as i32;
            // SAFETY: one valid pollfd that outlives the call.
            match unsafe { libc::poll(&mut p, 1, ms) } {
                1 => return true,
                0 => return false,
                _ if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted => {}
                _ => return false,
            }
        }
    }

    /// Waits for the end of a gmsd this launcher reaps, bounded: SIGKILL
    /// after `grace`. Returns how it ended. With [`Reaper::Elsewhere`] it
    /// waits for the end without reaping and returns None.
    pub fn wait(mut self, grace: Duration) -> Option<Exit> {
        let deadline = Instant::now() + grace;
        while !self.has_exited() {
            if Instant::now() >= deadline {
                let _ = self.signal(libc::SIGKILL);
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        self.collect()
    }

    /// Gives the daemon up: it keeps running, and this process will not
    /// reap it (the hook's detached `gms start`). Returns its pid.
    pub fn detach(mut self) -> u32 {
        self.child = None;
        self.pid
    }

    /// Reaps (when ours to reap) a gmsd that was killed or ended.
    pub(crate) fn collect(&mut self) -> Option<Exit> {
        if self.reaper != Reaper::Launcher {
            return None;
        }
        let child = self.child.take()?;
        if self.pidfd.is_some() {
            return self.peek_exit(false).or_else(|| wait_child(child));
        }
        wait_child(child)
    }

    /// The exit status of an ended child, read through its pidfd. `peek`
    /// leaves it a zombie (for the shim's reaper); otherwise it is reaped
    /// here, which only a [`Reaper::Launcher`] may do.
    pub(crate) fn peek_exit(&self, peek: bool) -> Option<Exit> {
        let fd = self.pidfd.as_ref()?;
        let mut flags = libc::WEXITED;
        if peek || self.reaper != Reaper::Launcher {
            flags |= libc::WNOWAIT;
        }
        // SAFETY: a zeroed siginfo_t is a valid value to be overwritten.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: waitid on our pidfd with a valid siginfo pointer; it
        // blocks until the child ends, which the caller knows it did.
        let rc = unsafe {
            libc::waitid(
                libc::P_PIDFD,
                fd.as_raw_fd() as libc::id_t,
                &mut info,
                flags,
            )
        };
        if rc != 0 {
            return None;
        }
        // SAFETY: after a successful waitid, si_status is valid.
        let status = unsafe { info.si_status() };
        match info.si_code {
            libc::CLD_EXITED => Some(Exit::Code(status)),
            libc::CLD_KILLED | libc::CLD_DUMPED => Some(Exit::Signal(status)),
            _ => None,
        }
    }
}

fn wait_child(mut child: Child) -> Option<Exit> {
    use std::os::unix::process::ExitStatusExt;
    let status = child.wait().ok()?;
    status
        .code()
        .map(Exit::Code)
        .or_else(|| status.signal().map(Exit::Signal))
}
