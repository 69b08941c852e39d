//! Child processes with a hard deadline: every program the harness starts
//! (`ctr`, `script`, containerd itself) is watched through a pidfd, so a wait
//! is an event (the kernel says the process exited) bounded by a timeout, and
//! a process that outlives its deadline is killed, never left hanging a test.

use crate::{Error, Result};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What a finished process printed, and how it ended.
#[derive(Debug, Clone)]
pub struct Output {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl Output {
    /// stderr without the client's own log lines (`time="…" level=warning
    /// msg=…`): ctr 2.2+ warns there, e.g. that cgroup v1 is deprecated,
    /// before the task's own output.
    pub fn stderr_without_client_warnings(&self) -> String {
        self.stderr
            .split_inclusive('\n')
            .filter(|l| !(l.starts_with("time=\"") && l.contains(" level=warning ")))
            .collect()
    }

    /// The exit code; a process killed by signal N reports 128+N, as a shell would.
    pub fn code(&self) -> i32 {
        match (self.status.code(), self.status.signal()) {
            (Some(c), _) => c,
            (None, Some(s)) => 128 + s,
            (None, None) => -1,
        }
    }

    /// Panic with everything printed unless the process exited 0.
    #[track_caller]
    pub fn assert_success(&self) -> &Self {
        assert_eq!(self.code(), 0, "expected success, got {self}");
        self
    }
}

impl std::fmt::Display for Output {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "exit {} | stdout: {:?} | stderr: {:?}",
            self.code(),
            self.stdout,
            self.stderr
        )
    }
}

enum Line {
    Out(String),
    Eof,
}

/// A running child process with its output streamed line by line.
///
/// Dropping it kills the process (SIGKILL through its pidfd) and reaps it.
pub struct Spawned {
    what: String,
    child: Child,
    pidfd: OwnedFd,
    stdin: Option<ChildStdin>,
    lines: Receiver<Line>,
    stdout: Arc<Mutex<String>>,
    stderr: Arc<Mutex<String>>,
    open_streams: usize,
    reaped: Option<ExitStatus>,
}

impl Spawned {
    /// Start `cmd` with stdout and stderr captured; stdin is a pipe when
    /// `with_stdin`, else /dev/null.
    pub fn start(mut cmd: Command, what: impl Into<String>, with_stdin: bool) -> Result<Self> {
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        let stdin = if with_stdin {
            Stdio::piped()
        } else {
            Stdio::null()
        };
        Self::start_inner(cmd, what.into(), stdin)
    }

    fn start_inner(mut cmd: Command, what: String, stdin: Stdio) -> Result<Self> {
        cmd.stdin(stdin);
        // SAFETY: the closure runs between fork and exec and only calls
        // prctl(2), which is async-signal-safe. It ties the child's life to
        // the forking thread, so a harness that dies does not leak a ctr.
        unsafe {
            cmd.pre_exec(|| {
                nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)
                    .map_err(std::io::Error::from)
            });
        }
        let mut child = cmd.spawn().map_err(|source| Error::Spawn {
            program: what.clone(),
            source,
        })?;
        let pidfd = match gmsd_launch::pidfd::open(child.id() as libc::pid_t) {
            Ok(fd) => fd,
            Err(source) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(Error::io(
                    "pidfd_open",
                    format!("/proc/{}", child.id()),
                    source,
                ));
            }
        };
        let (tx, lines) = mpsc::channel();
        let stdout = Arc::new(Mutex::new(String::new()));
        let stderr = Arc::new(Mutex::new(String::new()));
        let mut open_streams = 0;
        if let Some(out) = child.stdout.take() {
            pump(out, stdout.clone(), tx.clone());
            open_streams += 1;
        }
        if let Some(err) = child.stderr.take() {
            pump(err, stderr.clone(), tx);
            open_streams += 1;
        }
        Ok(Spawned {
            what,
            stdin: child.stdin.take(),
            child,
            pidfd,
            lines,
            stdout,
            stderr,
            open_streams,
            reaped: None,
        })
    }

    /// Start `cmd` with stdout and stderr appended to `log` (for daemons,
    /// whose output a person reads afterwards) and stdin from /dev/null.
    pub fn start_logged(
        mut cmd: Command,
        what: impl Into<String>,
        log: &std::path::Path,
    ) -> Result<Self> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .map_err(|e| Error::io("open log", log, e))?;
        let file2 = file
            .try_clone()
            .map_err(|e| Error::io("dup log fd", log, e))?;
        cmd.stdout(file).stderr(file2);
        let mut s = Self::start_inner(cmd, what.into(), Stdio::null())?;
        s.open_streams = 0;
        Ok(s)
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Everything printed on stdout so far.
    pub fn stdout_so_far(&self) -> String {
        lock(&self.stdout).clone()
    }

    /// Everything printed on stderr so far.
    pub fn stderr_so_far(&self) -> String {
        lock(&self.stderr).clone()
    }

    /// Write to the child's stdin (it must have been started with one).
    pub fn write_stdin(&mut self, data: &[u8]) -> Result<()> {
        let stdin = self.stdin.as_mut().ok_or_else(|| Error::Io {
            what: "write to stdin",
            path: self.what.clone().into(),
            source: std::io::Error::new(std::io::ErrorKind::NotConnected, "no stdin pipe"),
        })?;
        stdin
            .write_all(data)
            .and_then(|_| stdin.flush())
            .map_err(|e| Error::io("write to stdin", self.what.clone(), e))
    }

    /// Close the child's stdin.
    pub fn close_stdin(&mut self) {
        self.stdin = None;
    }

    /// Wait until a line on stdout or stderr satisfies `pred`; return it.
    pub fn wait_line(&mut self, timeout: Duration, pred: impl Fn(&str) -> bool) -> Result<String> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(Line::Out(l)) if pred(&l) => return Ok(l),
                Ok(Line::Out(_)) => {}
                Ok(Line::Eof) => {
                    self.open_streams -= 1;
                    if self.open_streams == 0 {
                        return Err(Error::OutputEnded {
                            what: format!(
                                "`{}` (stdout: {:?}, stderr: {:?})",
                                self.what,
                                self.stdout_so_far(),
                                self.stderr_so_far()
                            ),
                        });
                    }
                }
                Err(RecvTimeoutError::Timeout) | Err(RecvTimeoutError::Disconnected) => {
                    return Err(self.timeout_error("a matching line", timeout));
                }
            }
        }
    }

    /// Wait until everything printed so far (stdout, stderr) satisfies
    /// `pred`, re-checked on each new line; for output spread over both
    /// streams, whose relative order is not defined.
    pub fn wait_output(
        &mut self,
        timeout: Duration,
        pred: impl Fn(&str, &str) -> bool,
    ) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if pred(&self.stdout_so_far(), &self.stderr_so_far()) {
                return Ok(());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(Line::Out(_)) => {}
                Ok(Line::Eof) => {
                    self.open_streams = self.open_streams.saturating_sub(1);
                    if self.open_streams == 0 && !pred(&self.stdout_so_far(), &self.stderr_so_far())
                    {
                        return Err(Error::OutputEnded {
                            what: format!(
                                "`{}` (stdout: {:?}, stderr: {:?})",
                                self.what,
                                self.stdout_so_far(),
                                self.stderr_so_far()
                            ),
                        });
                    }
                }
                Err(_) => return Err(self.timeout_error("the expected output", timeout)),
            }
        }
    }

    /// Wait for the process to exit, at most `timeout`; on timeout it is
    /// killed and the error carries what it printed.
    pub fn wait(mut self, timeout: Duration) -> Result<Output> {
        let status = self.wait_exit(timeout)?;
        // Output pipes close when the process and anything it forked are gone;
        // give stragglers a moment, then report what we have.
        let drain_deadline = Instant::now() + Duration::from_secs(2);
        while self.open_streams > 0 {
            let left = drain_deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(Line::Eof) => self.open_streams -= 1,
                Ok(Line::Out(_)) => {}
                Err(_) => break,
            }
        }
        Ok(Output {
            status,
            stdout: self.stdout_so_far(),
            stderr: self.stderr_so_far(),
        })
    }

    /// Has the process exited (without waiting)?
    pub fn has_exited(&mut self) -> bool {
        self.wait_exit(Duration::ZERO).is_ok()
    }

    fn wait_exit(&mut self, timeout: Duration) -> Result<ExitStatus> {
        if let Some(s) = self.reaped {
            return Ok(s);
        }
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let ms = PollTimeout::try_from(left).unwrap_or(PollTimeout::MAX);
            let mut fds = [PollFd::new(self.pidfd.as_fd(), PollFlags::POLLIN)];
            match poll(&mut fds, ms) {
                Ok(n) if n > 0 => {
                    let status = self
                        .child
                        .wait()
                        .map_err(|e| Error::io("waitpid", self.what.clone(), e))?;
                    self.reaped = Some(status);
                    return Ok(status);
                }
                Ok(_) => {
                    if timeout.is_zero() {
                        return Err(Error::Timeout {
                            what: self.what.clone(),
                            after: timeout,
                        });
                    }
                    self.kill();
                    return Err(self.timeout_error("exit", timeout));
                }
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => {
                    return Err(Error::io("poll pidfd", self.what.clone(), e.into()));
                }
            }
        }
    }

    fn timeout_error(&self, waiting_for: &str, after: Duration) -> Error {
        Error::Timeout {
            what: format!(
                "{waiting_for} from `{}` (stdout so far: {:?}, stderr so far: {:?})",
                self.what,
                self.stdout_so_far(),
                self.stderr_so_far()
            ),
            after,
        }
    }

    /// SIGKILL the process through its pidfd (no pid-reuse race) and reap it.
    pub fn kill(&mut self) {
        if self.reaped.is_some() {
            return;
        }
        let _ = pidfd_send_signal(&self.pidfd, libc::SIGKILL);
        if let Ok(s) = self.child.wait() {
            self.reaped = Some(s);
        }
    }

    /// Send a signal (e.g. SIGTERM) through the pidfd.
    pub fn signal(&self, sig: libc::c_int) -> Result<()> {
        if self.reaped.is_some() {
            return Ok(());
        }
        pidfd_send_signal(&self.pidfd, sig)
            .map_err(|e| Error::io("pidfd_send_signal", self.what.clone(), e))
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        self.kill();
    }
}

fn lock(m: &Mutex<String>) -> std::sync::MutexGuard<'_, String> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn pump(stream: impl Read + Send + 'static, sink: Arc<Mutex<String>>, tx: mpsc::Sender<Line>) {
    std::thread::spawn(move || {
        let mut reader = BufReader::new(stream);
        let mut buf = Vec::new();
        loop {
            buf.clear();
            match reader.read_until(b'\n', &mut buf) {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    let text = String::from_utf8_lossy(&buf).into_owned();
                    lock(&sink).push_str(&text);
                    let line = text.trim_end_matches(['\n', '\r']).to_owned();
                    let _ = tx.send(Line::Out(line));
                }
            }
        }
        let _ = tx.send(Line::Eof);
    });
}

fn pidfd_send_signal(fd: &OwnedFd, sig: libc::c_int) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: a valid pidfd we own, a signal number, a null siginfo (the
    // kernel fills one in as for kill(2)) and zero flags.
    let r = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            fd.as_raw_fd(),
            sig,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}
