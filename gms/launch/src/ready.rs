//! The readiness pipe: reading gmsd's stdout, together with its pidfd,
//! until it announces its socket (`ready <socket>`), ends, or runs out of
//! time, and checking that the socket it names is one of its socket dir.
//!
//! It exists apart because this is the launcher's one loop and its one
//! piece of parsing: the launch hands it a started [`Gmsd`] and gets back
//! the socket or the [`LaunchError`] to kill it for. Free to change: the
//! polling, the buffer sizes. Relied on elsewhere: the line
//! [`READY_PREFIX`]` <socket>`, written by `gms/daemon/src/bin/gmsd.rs`,
//! and that the socket must be a GMS socket name directly in the socket
//! dir.

use std::io::Read;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::ChildStdout;
use std::time::{Duration, Instant};

use shadow_contract::paths::is_gms_socket_name;

use crate::error::LaunchError;
use crate::handle::Gmsd;

/// The line gmsd writes on stdout once its socket listens.
pub const READY_PREFIX: &str = "ready ";
/// Most bytes kept of what gmsd says on stdout before `ready` (a
/// misbehaving binary must not grow the launcher without bound).
const STDOUT_KEPT: usize = 4096;

/// One wait for one gmsd's announcement.
pub(crate) struct Readiness<'a> {
    /// The binary and socket dir it was started with, for the check and
    /// the errors.
    pub binary: &'a Path,
    pub socket_dir: &'a Path,
    pub gmsd: &'a Gmsd,
    pub timeout: Duration,
}

impl Readiness<'_> {
    /// Reads `stdout` until gmsd announces a socket (returned once checked),
    /// ends, or is silent past the timeout. Kills nothing: on an error the
    /// caller kills it.
    pub(crate) fn await_on(&self, mut stdout: ChildStdout) -> Result<PathBuf, LaunchError> {
        let pid = self.gmsd.pid();
        let pipe_err = |source| LaunchError::Pipe {
            binary: self.binary.to_path_buf(),
            pid,
            source,
        };
        let deadline = Instant::now() + self.timeout;
        // Bytes not yet split into lines, and the lines other than `ready`
        // (gmsd logs to stderr, so these are rare; kept for the error).
        let mut seen: Vec<u8> = Vec::new();
        let mut said = String::new();
        let mut exited = false;
        loop {
            // Whole lines first: `ready` may arrive in the same read as
            // its process's end.
            while let Some(end) = seen.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = seen.drain(..=end).collect();
                let line = String::from_utf8_lossy(&line);
                if let Some(socket) = line.trim_end().strip_prefix(READY_PREFIX) {
                    return self.check_announcement(socket);
                }
                keep(&mut said, &line);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(self.not_ready());
            }
            let mut fds = vec![libc::pollfd {
                fd: stdout.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            }];
            if let (Some(fd), false) = (self.gmsd.pidfd(), exited) {
                fds.push(libc::pollfd {
                    fd: fd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                });
            }
            let ms = left.as_millis().clamp(1, i32::MAX as u128) as i32;
            // SAFETY: fds is a valid array of fds.len() pollfd structs that
            // outlives the call.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(pipe_err(e));
            }
            if fds.get(1).is_some_and(|p| p.revents != 0) {
                // Ended. Its stdout closed before it became a zombie, so
                // what it wrote is in the pipe: read to EOF, then report.
                exited = true;
            }
            if fds[0].revents != 0 {
                let mut buf = [0u8; 512];
                match stdout.read(&mut buf) {
                    Ok(0) => {
                        // Stdout closed: it ended, or is ending (its files
                        // close before it turns zombie), or it closed
                        // stdout and lives on, which counts as not ready.
                        if !exited && !self.gmsd.ends_within(deadline) {
                            return Err(self.not_ready());
                        }
                        keep(&mut said, &String::from_utf8_lossy(&seen));
                        return Err(self.exited(said));
                    }
                    Ok(k) => {
                        if seen.len() < STDOUT_KEPT {
                            seen.extend_from_slice(&buf[..k]);
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(pipe_err(e)),
                }
            }
        }
    }

    fn check_announcement(&self, socket: &str) -> Result<PathBuf, LaunchError> {
        announced_in(self.socket_dir, socket).ok_or_else(|| LaunchError::Announcement {
            binary: self.binary.to_path_buf(),
            pid: self.gmsd.pid(),
            socket: socket.to_string(),
            dir: self.socket_dir.to_path_buf(),
        })
    }

    fn not_ready(&self) -> LaunchError {
        LaunchError::NotReady {
            binary: self.binary.to_path_buf(),
            pid: self.gmsd.pid(),
            timeout: self.timeout,
        }
    }

    fn exited(&self, stdout: String) -> LaunchError {
        LaunchError::Exited {
            binary: self.binary.to_path_buf(),
            pid: self.gmsd.pid(),
            exit: self.gmsd.peek_exit(true),
            stdout,
        }
    }
}

/// The announced `socket` as a path, if it is a GMS socket name directly
/// in `socket_dir`.
fn announced_in(socket_dir: &Path, socket: &str) -> Option<PathBuf> {
    let path = PathBuf::from(socket);
    let named_right = path
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(is_gms_socket_name);
    (named_right && path.parent() == Some(socket_dir)).then_some(path)
}

fn keep(into: &mut String, line: &str) {
    if into.len() < STDOUT_KEPT {
        into.push_str(line);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_gms_socket_directly_in_the_dir_is_taken() {
        let dir = Path::new("/run/pair/gms");
        assert_eq!(
            announced_in(dir, "/run/pair/gms/gms-host.sock"),
            Some(dir.join("gms-host.sock"))
        );
        for refused in [
            "/etc/gms-host.sock",
            "/run/pair/gms/sub/gms-host.sock",
            "/run/pair/gms/other.sock",
            "/run/pair/gms/gms-.sock",
            "gms-host.sock",
            "",
        ] {
            assert_eq!(announced_in(dir, refused), None, "{refused:?}");
        }
    }

    #[test]
    fn what_is_kept_of_stdout_is_bounded() {
        let mut said = String::new();
        let line = "x".repeat(1000);
        for _ in 0..10 {
            keep(&mut said, &line);
        }
        assert!(said.len() < STDOUT_KEPT + line.len(), "{}", said.len());
    }
}
