//! `gmsd-launch`: the one launcher of `gmsd`, used by the shim (one daemon
//! per device of a pair) and by the OCI hook (`gms start` / `gms run`, for
//! podman, CRI-O and runc, where no shim supervises).
//!
//! It was `shadow_contract::gmsd`; it is a crate of its own because
//! `shadow-contract` holds the names other tools depend on, and this is
//! process code (fork/exec, cgroup join, capset, the readiness pipe). What
//! may be changed here freely, and what the shim, the hook and the docs
//! rely on, is in this crate's README.md.
//!
//! Readiness is a pipe, not a poll of the socket directory: gmsd's stdout
//! is a pipe to the launcher, and gmsd writes `ready <socket>` on it once
//! the socket listens. The launcher polls that pipe together with a pidfd
//! of the child, so it learns, within its timeout, one of three things:
//! the socket; that gmsd ended first, with its exit status; or that it did
//! not answer in time, after which it is killed.
//!
//! Who reaps the child is the caller's choice ([`Reaper`]). The shim is a
//! subreaper whose one reaper loop calls `waitpid(-1)`; nothing else may
//! take an exit from it, so there the launcher only *peeks* at an early
//! exit (`waitid(P_PIDFD, …, WNOWAIT)`) and leaves the zombie to the
//! reaper. The hook owns its child and lets the launcher reap it.
//!
//! Every capability is dropped in the child before exec: gmsd serves a
//! socket in a directory its uid owns and needs none.
//!
//! [`pidfd`] is the workspace's one `pidfd_open(2)`: the launcher's, the
//! shim's leftover cleanup's and the test harness's.

pub mod pidfd;

use std::ffi::{CString, OsString};
use std::fs::File;
use std::io::Read;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use shadow_contract::paths::is_gms_socket_name;
use shadow_contract::state::Exit;

/// The line gmsd writes on stdout once its socket listens.
pub const READY_PREFIX: &str = "ready ";
/// Most bytes kept of what gmsd says on stdout before `ready` (a
/// misbehaving binary must not grow the launcher without bound).
const STDOUT_KEPT: usize = 4096;

/// Who collects the child's exit status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reaper {
    /// The launcher and its [`Gmsd`] handle (the hook: a plain process).
    Launcher,
    /// Someone else's `waitpid` loop (the shim: a subreaper). The launcher
    /// never reaps; an early exit is read with `WNOWAIT`.
    Elsewhere,
}

/// How to start one gmsd: `gmsd serve --socket-dir DIR --device DEVICE …`.
#[derive(Debug)]
pub struct GmsdCommand {
    binary: PathBuf,
    socket_dir: PathBuf,
    device: String,
    args: Vec<OsString>,
    stderr: Option<File>,
    reaper: Reaper,
    /// `cgroup.procs` files gmsd moves itself into before exec.
    cgroup_procs: Vec<PathBuf>,
    oom_score_adj: Option<i32>,
}

/// Whether `binary` (a path, or a name looked up on `PATH`) names a
/// regular file someone may execute.
fn executable(binary: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let is_exec = |p: &Path| {
        std::fs::metadata(p)
            .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
            .unwrap_or(false)
    };
    let found = if binary.components().count() > 1 || binary.is_absolute() {
        is_exec(binary)
    } else {
        std::env::var_os("PATH")
            .map(|path| std::env::split_paths(&path).any(|dir| is_exec(&dir.join(binary))))
            .unwrap_or(false)
    };
    if found {
        Ok(())
    } else {
        Err(std::io::Error::new(
            std::io::ErrorKind::NotFound,
            "no executable file there (or on PATH)",
        ))
    }
}

/// Why gmsd did not become ready.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error("starting gmsd {binary}: {source}")]
    Spawn {
        binary: PathBuf,
        source: std::io::Error,
    },
    #[error("gmsd {binary} (pid {pid}) ended before it was ready ({}){}", describe(.exit), said(.stdout))]
    Exited {
        binary: PathBuf,
        pid: u32,
        /// None when the status is not ours to read (the reaper took it
        /// first) or the kernel has no pidfd.
        exit: Option<Exit>,
        /// What it wrote on stdout, if anything but `ready`.
        stdout: String,
    },
    #[error("gmsd {binary} (pid {pid}) was not ready within {} ms; killed it", .timeout.as_millis())]
    NotReady {
        binary: PathBuf,
        pid: u32,
        timeout: Duration,
    },
    #[error("gmsd {binary} (pid {pid}) announced {socket:?}, which is not a GMS socket in {dir}; killed it")]
    Announcement {
        binary: PathBuf,
        pid: u32,
        socket: String,
        dir: PathBuf,
    },
    #[error("gmsd {binary} (pid {pid}): reading its readiness pipe: {source}")]
    Pipe {
        binary: PathBuf,
        pid: u32,
        source: std::io::Error,
    },
}

fn describe(exit: &Option<Exit>) -> String {
    exit.map(|e| e.to_string())
        .unwrap_or_else(|| "status collected elsewhere".into())
}

fn said(stdout: &str) -> String {
    if stdout.trim().is_empty() {
        "; its stderr has the reason".into()
    } else {
        format!("; it said: {}", stdout.trim())
    }
}

impl GmsdCommand {
    pub fn new(
        binary: impl Into<PathBuf>,
        socket_dir: impl Into<PathBuf>,
        device: impl Into<String>,
    ) -> GmsdCommand {
        GmsdCommand {
            binary: binary.into(),
            socket_dir: socket_dir.into(),
            device: device.into(),
            args: Vec::new(),
            stderr: None,
            reaper: Reaper::Launcher,
            cgroup_procs: Vec::new(),
            oom_score_adj: None,
        }
    }

    /// Run gmsd in a cgroup: it writes its pid (`0`, itself) into each of
    /// these `cgroup.procs` files (one per hierarchy on cgroup v1) before
    /// exec, so every byte it allocates is charged there from the first.
    /// Failing to join fails the start: a gmsd must never run outside
    /// the cgroup meant to pay for it.
    pub fn cgroup(mut self, procs_files: Vec<PathBuf>) -> GmsdCommand {
        self.cgroup_procs = procs_files;
        self
    }

    /// gmsd's `oom_score_adj` (-1000..=1000), set before exec: the OOM
    /// killer weighs it as any process of its pod, not as part of the
    /// runtime that started it.
    pub fn oom_score_adj(mut self, adj: i32) -> GmsdCommand {
        self.oom_score_adj = Some(adj);
        self
    }

    /// `--max-bytes N`, unless 0 (gmsd's default).
    pub fn max_bytes(self, bytes: u64) -> GmsdCommand {
        if bytes == 0 {
            return self;
        }
        self.arg("--max-bytes").arg(bytes.to_string())
    }

    /// `--max-allocations N`, unless 0 (gmsd's default).
    pub fn max_allocations(self, count: u64) -> GmsdCommand {
        if count == 0 {
            return self;
        }
        self.arg("--max-allocations").arg(count.to_string())
    }

    /// One more argument after the socket dir and device.
    pub fn arg(mut self, arg: impl Into<OsString>) -> GmsdCommand {
        self.args.push(arg.into());
        self
    }

    pub fn args<I: IntoIterator<Item = S>, S: Into<OsString>>(mut self, args: I) -> GmsdCommand {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Where gmsd's log (stderr) goes; inherited when not set.
    pub fn stderr(mut self, log: File) -> GmsdCommand {
        self.stderr = Some(log);
        self
    }

    /// See [`Reaper`].
    pub fn reaper(mut self, reaper: Reaper) -> GmsdCommand {
        self.reaper = reaper;
        self
    }

    pub fn binary(&self) -> &Path {
        &self.binary
    }

    /// The command, capabilities dropped before exec, stdio untouched: for
    /// a caller that execs it in place (`ExecStart=` of a systemd unit).
    pub fn command(&self) -> Command {
        let mut cmd = Command::new(&self.binary);
        cmd.arg("serve")
            .arg("--socket-dir")
            .arg(&self.socket_dir)
            .arg("--device")
            .arg(&self.device)
            .args(&self.args);
        // Paths and bytes prepared here, before the fork.
        let joins: Vec<(CString, Vec<u8>)> = self
            .cgroup_procs
            .iter()
            .filter_map(|p| CString::new(p.as_os_str().as_bytes()).ok())
            .map(|p| (p, b"0".to_vec()))
            .chain(self.oom_score_adj.map(|adj| {
                let text = adj.clamp(-1000, 1000).to_string().into_bytes();
                (c"/proc/self/oom_score_adj".to_owned(), text)
            }))
            .collect();
        if !joins.is_empty() {
            // SAFETY: the closure runs between fork and exec and makes raw
            // open/write/close/_exit syscalls on paths and bytes prepared
            // before the fork: no allocation, no locks.
            unsafe {
                cmd.pre_exec(move || {
                    for (path, text) in &joins {
                        if !write_file(path, text) {
                            // Not an Err: std would then wait for this
                            // child itself, which a subreaper's reaper may
                            // have taken. An early exit is what the
                            // launcher reports, with this on gmsd's log.
                            say(b"gmsd launcher: cannot write ");
                            say(path.as_bytes());
                            say(b" (joining gmsd's cgroup, or its OOM score)\n");
                            libc::_exit(JOIN_FAILED);
                        }
                    }
                    Ok(())
                });
            }
        }
        // SAFETY: the closure runs between fork and exec (or just before
        // exec) and makes raw prctl/capset syscalls only: no allocation,
        // no locks.
        unsafe {
            cmd.pre_exec(drop_all_capabilities);
        }
        cmd
    }

    /// Starts gmsd in a session of its own and waits, at most `timeout`,
    /// until it announces its socket.
    pub fn spawn(mut self, timeout: Duration) -> Result<Gmsd, LaunchError> {
        // A binary that cannot be executed is refused before any fork: when
        // exec fails, std reaps the child itself and panics if a subreaper's
        // `waitpid(-1)` took it first, which is the shim's case.
        if let Err(source) = executable(&self.binary) {
            return Err(LaunchError::Spawn {
                binary: self.binary.clone(),
                source,
            });
        }
        let mut cmd = self.command();
        cmd.stdin(Stdio::null()).stdout(Stdio::piped());
        if let Some(log) = self.stderr.take() {
            cmd.stderr(log);
        }
        // SAFETY: setsid is async-signal-safe and allocates nothing.
        unsafe {
            cmd.pre_exec(|| {
                if libc::setsid() < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn().map_err(|source| LaunchError::Spawn {
            binary: self.binary.clone(),
            source,
        })?;
        let pid = child.id();
        // None without kernel support (< 5.3), or if a reaper elsewhere
        // already took it: then signals go by pid, and the end is learnt
        // from the pipe alone.
        let pidfd = pidfd::open(pid as libc::pid_t).ok();
        let Some(stdout) = child.stdout.take() else {
            // Stdio::piped() always gives a pipe; be defensive anyway.
            return Err(LaunchError::Pipe {
                binary: self.binary.clone(),
                pid,
                source: std::io::Error::other("no stdout pipe"),
            });
        };
        let mut gmsd = Gmsd {
            pid,
            socket: PathBuf::new(),
            pidfd,
            // Elsewhere: dropping a std Child neither waits nor kills.
            child: (self.reaper == Reaper::Launcher).then_some(child),
            reaper: self.reaper,
        };
        match self.await_ready(&gmsd, stdout, timeout) {
            Ok(socket) => {
                gmsd.socket = socket;
                Ok(gmsd)
            }
            Err(e) => {
                // Harmless on one that already ended (still a zombie, or
                // ESRCH through the pidfd); needed on every other.
                let _ = gmsd.signal(libc::SIGKILL);
                gmsd.collect();
                Err(e)
            }
        }
    }

    fn await_ready(
        &self,
        gmsd: &Gmsd,
        mut stdout: ChildStdout,
        timeout: Duration,
    ) -> Result<PathBuf, LaunchError> {
        let pid = gmsd.pid;
        let pipe_err = |source| LaunchError::Pipe {
            binary: self.binary.clone(),
            pid,
            source,
        };
        let deadline = Instant::now() + timeout;
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
                    return self.check_announcement(pid, socket);
                }
                keep(&mut said, &line);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(LaunchError::NotReady {
                    binary: self.binary.clone(),
                    pid,
                    timeout,
                });
            }
            let mut fds = vec![libc::pollfd {
                fd: stdout.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            }];
            if let (Some(fd), false) = (&gmsd.pidfd, exited) {
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
                        if !exited && !gmsd.ends_within(deadline) {
                            return Err(LaunchError::NotReady {
                                binary: self.binary.clone(),
                                pid,
                                timeout,
                            });
                        }
                        keep(&mut said, &String::from_utf8_lossy(&seen));
                        return Err(self.exited(gmsd, said));
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

    fn check_announcement(&self, pid: u32, socket: &str) -> Result<PathBuf, LaunchError> {
        let path = PathBuf::from(socket);
        let named_right = path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(is_gms_socket_name);
        if named_right && path.parent() == Some(self.socket_dir.as_path()) {
            Ok(path)
        } else {
            Err(LaunchError::Announcement {
                binary: self.binary.clone(),
                pid,
                socket: socket.to_string(),
                dir: self.socket_dir.clone(),
            })
        }
    }

    fn exited(&self, gmsd: &Gmsd, stdout: String) -> LaunchError {
        LaunchError::Exited {
            binary: self.binary.clone(),
            pid: gmsd.pid,
            exit: gmsd.peek_exit(true),
            stdout,
        }
    }
}

fn keep(into: &mut String, line: &str) {
    if into.len() < STDOUT_KEPT {
        into.push_str(line);
    }
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
    fn ends_within(&self, deadline: Instant) -> bool {
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
    fn collect(&mut self) -> Option<Exit> {
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
    fn peek_exit(&self, peek: bool) -> Option<Exit> {
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

/// gmsd's exit status when it could not join its cgroup (or set its OOM
/// score) before exec.
pub const JOIN_FAILED: i32 = 126;

/// Writes `text` into the existing file `path` with raw syscalls (safe
/// between fork and exec). False if it could not.
fn write_file(path: &CString, text: &[u8]) -> bool {
    // SAFETY: open with a NUL-terminated path we own; the fd is closed below.
    let fd = unsafe { libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC) };
    if fd < 0 {
        return false;
    }
    // SAFETY: write from a live byte slice into the fd just opened.
    let n = unsafe { libc::write(fd, text.as_ptr().cast(), text.len()) };
    // SAFETY: closing the fd this function opened, once.
    unsafe { libc::close(fd) };
    n == text.len() as isize
}

/// Best effort, on stderr, between fork and exec.
fn say(bytes: &[u8]) {
    // SAFETY: write from a live byte slice to fd 2.
    unsafe { libc::write(2, bytes.as_ptr().cast(), bytes.len()) };
}

/// Drops every capability, between fork and exec. Raw syscalls only (no
/// allocation after fork): the bounding set first (needs CAP_SETPCAP, which
/// we still have), then ambient, then the three sets.
fn drop_all_capabilities() -> std::io::Result<()> {
    for cap in 0..64 {
        // SAFETY: prctl with integer arguments only; EINVAL past the last
        // capability the kernel knows is expected and ignored.
        unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) };
    }
    // SAFETY: integer arguments only.
    unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL,
            0,
            0,
            0,
        )
    };
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    let header = Header {
        version: 0x2008_0522, // _LINUX_CAPABILITY_VERSION_3
        pid: 0,
    };
    let data = [Data {
        effective: 0,
        permitted: 0,
        inheritable: 0,
    }; 2];
    // SAFETY: capset reads one header and two data structs (version 3),
    // both valid for the duration of the call.
    let rc = unsafe { libc::syscall(libc::SYS_capset, &header as *const Header, data.as_ptr()) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// Writing a script while another thread forks makes exec fail with
    /// ETXTBSY (the fork inherits the write fd): write and spawn one at a
    /// time.
    static SPAWNS: Mutex<()> = Mutex::new(());

    /// A stand-in gmsd: `$3` is the socket dir and `$5` the device, as
    /// the launcher passes them.
    fn fake(dir: &Path, body: &str) -> PathBuf {
        let path = dir.join("gmsd");
        std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path
    }

    fn launch(
        body: &str,
        reaper: Reaper,
        timeout: Duration,
    ) -> (tempfile::TempDir, Result<Gmsd, LaunchError>) {
        let _one = SPAWNS.lock().unwrap_or_else(|p| p.into_inner());
        let dir = tempfile::tempdir().unwrap();
        let gmsd = fake(dir.path(), body);
        let log = File::create(dir.path().join("gmsd.log")).unwrap();
        let r = GmsdCommand::new(gmsd, dir.path(), "host")
            .max_bytes(0)
            .max_allocations(8)
            .stderr(log)
            .reaper(reaper)
            .spawn(timeout);
        (dir, r)
    }

    #[test]
    fn ready_line_gives_the_socket_and_a_live_daemon() {
        let (dir, r) = launch(
            r#"echo "starting on $5"; echo "ready $3/gms-$5.sock"; exec sleep 30"#,
            Reaper::Launcher,
            Duration::from_secs(10),
        );
        let g = r.unwrap();
        assert_eq!(g.socket(), dir.path().join("gms-host.sock"));
        assert!(!g.has_exited());
        g.signal(libc::SIGTERM).unwrap();
        assert_eq!(
            g.wait(Duration::from_secs(5)),
            Some(Exit::Signal(libc::SIGTERM))
        );
    }

    /// The OOM score is set, and a cgroup that cannot be joined fails the
    /// start (here: a path that is no cgroup file).
    #[test]
    fn oom_score_is_set_and_an_unjoinable_cgroup_fails_the_start() {
        let _one = SPAWNS.lock().unwrap_or_else(|p| p.into_inner());
        let dir = tempfile::tempdir().unwrap();
        let gmsd = fake(
            dir.path(),
            r#"echo "ready $3/gms-$5.sock $(cat /proc/self/oom_score_adj)""#,
        );
        let out = GmsdCommand::new(&gmsd, dir.path(), "host")
            .oom_score_adj(500)
            .command()
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stdout);
        assert!(said.trim_end().ends_with(" 500"), "{said}");
        let e = GmsdCommand::new(&gmsd, dir.path(), "host")
            .cgroup(vec![dir.path().join("absent/cgroup.procs")])
            .spawn(Duration::from_secs(10))
            .unwrap_err();
        assert!(
            matches!(
                e,
                LaunchError::Exited {
                    exit: Some(Exit::Code(JOIN_FAILED)),
                    ..
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn early_exit_reports_status_and_what_it_said() {
        let (dir, r) = launch(
            "echo 'gmsd: no such device' >&2; echo 'bad flag'; exit 3",
            Reaper::Launcher,
            Duration::from_secs(10),
        );
        let e = r.unwrap_err();
        let msg = e.to_string();
        assert!(
            matches!(&e, LaunchError::Exited { exit: Some(Exit::Code(3)), stdout, .. } if stdout.contains("bad flag")),
            "{e:?}"
        );
        assert!(msg.contains("exit code 3"), "{msg}");
        let log = std::fs::read_to_string(dir.path().join("gmsd.log")).unwrap();
        assert!(
            log.contains("no such device"),
            "stderr went to the log: {log}"
        );
    }

    /// The shim's case: the launcher learns the status but leaves the
    /// zombie for the shim's reaper, which must still find it.
    #[test]
    fn early_exit_elsewhere_is_peeked_not_reaped() {
        let (_dir, r) = launch("exit 5", Reaper::Elsewhere, Duration::from_secs(10));
        let LaunchError::Exited { exit, pid, .. } = r.unwrap_err() else {
            panic!("not an early exit");
        };
        assert_eq!(exit, Some(Exit::Code(5)));
        let mut status = 0;
        // SAFETY: waitpid on our own child with a valid status pointer.
        let reaped = unsafe { libc::waitpid(pid as libc::pid_t, &mut status, 0) };
        assert_eq!(reaped, pid as libc::pid_t, "the reaper still gets the exit");
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 5);
    }

    #[test]
    fn silence_times_out_and_the_daemon_is_killed() {
        let started = Instant::now();
        let (_dir, r) = launch(
            "exec sleep 30",
            Reaper::Launcher,
            Duration::from_millis(300),
        );
        let e = r.unwrap_err();
        let LaunchError::NotReady { pid, .. } = e else {
            panic!("{e:?}");
        };
        assert!(started.elapsed() < Duration::from_secs(5));
        // Reaped by the launcher: the pid is no child of ours any more.
        // SAFETY: waitpid with WNOHANG and a valid status pointer.
        let rc = unsafe { libc::waitpid(pid as libc::pid_t, &mut 0, libc::WNOHANG) };
        assert_eq!(rc, -1, "killed and reaped");
    }

    #[test]
    fn closing_stdout_but_living_on_is_not_ready() {
        let (_dir, r) = launch(
            "exec >&-; exec sleep 30",
            Reaper::Launcher,
            Duration::from_millis(300),
        );
        assert!(matches!(r, Err(LaunchError::NotReady { .. })), "{r:?}");
    }

    #[test]
    fn a_socket_outside_the_dir_is_refused() {
        let (_dir, r) = launch(
            "echo 'ready /etc/gms-host.sock'; exec sleep 30",
            Reaper::Launcher,
            Duration::from_secs(10),
        );
        assert!(matches!(r, Err(LaunchError::Announcement { .. })), "{r:?}");
    }

    #[test]
    fn missing_binary_is_a_spawn_error() {
        let r = GmsdCommand::new("/nonexistent/gmsd", "/tmp", "host").spawn(Duration::from_secs(1));
        assert!(matches!(r, Err(LaunchError::Spawn { .. })), "{r:?}");
    }

    /// Refused before any fork: no child whose failed exec std would reap.
    #[test]
    fn what_cannot_be_executed_is_refused_before_a_fork() {
        let d = tempfile::tempdir().unwrap();
        let plain = d.path().join("gmsd");
        std::fs::write(&plain, "not a program").unwrap();
        for binary in [plain.as_path(), d.path(), Path::new("no-such-gmsd-on-path")] {
            let err = executable(binary).expect_err("refused");
            assert_eq!(err.kind(), std::io::ErrorKind::NotFound, "{binary:?}");
        }
        assert!(executable(Path::new("sh")).is_ok(), "found on PATH");
        assert!(executable(Path::new("/bin/sh")).is_ok());
    }

    #[test]
    fn capabilities_are_dropped() {
        let (dir, r) = launch(
            r#"grep -E '^Cap(Eff|Prm|Bnd)' /proc/self/status > "$3/caps"; echo "ready $3/gms-$5.sock"; exec sleep 30"#,
            Reaper::Launcher,
            Duration::from_secs(10),
        );
        let g = r.unwrap();
        let caps = std::fs::read_to_string(dir.path().join("caps")).unwrap();
        let _ = g.signal(libc::SIGKILL);
        g.wait(Duration::from_secs(5));
        for line in caps.lines() {
            assert!(line.ends_with("0000000000000000"), "{caps}");
        }
        assert_eq!(caps.lines().count(), 3, "{caps}");
    }
}
