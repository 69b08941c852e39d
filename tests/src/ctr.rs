//! `ctr`, bounded: every call names our private address and the test's own
//! namespace, and runs under a hard deadline (a `ctr` that waits forever on a
//! stdin it never closes must fail the test, not hang it).

use crate::process::Spawned;
use crate::Result;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

pub use crate::process::Output;

/// How long any single `ctr` call may take before it is killed.
pub const CTR_TIMEOUT: Duration = Duration::from_secs(60);

/// A `ctr` client bound to one containerd address and one namespace.
#[derive(Debug, Clone)]
pub struct Ctr {
    address: PathBuf,
    namespace: String,
}

/// One row of `ctr task ls`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskRow {
    pub id: String,
    pub pid: u32,
    pub status: String,
}

impl Ctr {
    pub fn new(address: &Path, namespace: &str) -> Self {
        Ctr {
            address: address.to_owned(),
            namespace: namespace.to_owned(),
        }
    }

    /// The namespace every call uses.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// `ctr --address … --namespace … <args>` as a Command, not started.
    pub fn command<S: AsRef<str>>(&self, args: &[S]) -> Command {
        let mut cmd = Command::new("ctr");
        cmd.arg("--address")
            .arg(&self.address)
            .arg("--namespace")
            .arg(&self.namespace)
            .args(args.iter().map(|a| a.as_ref()));
        cmd
    }

    fn describe<S: AsRef<str>>(args: &[S]) -> String {
        let mut s = String::from("ctr");
        for a in args {
            s.push(' ');
            s.push_str(a.as_ref());
        }
        s
    }

    /// Run `ctr <args>` to completion (at most [`CTR_TIMEOUT`]).
    pub fn run<S: AsRef<str>>(&self, args: &[S]) -> Result<Output> {
        self.run_timeout(args, CTR_TIMEOUT)
    }

    /// Run `ctr <args>` to completion, killing it after `timeout`.
    pub fn run_timeout<S: AsRef<str>>(&self, args: &[S], timeout: Duration) -> Result<Output> {
        Spawned::start(self.command(args), Self::describe(args), false)?.wait(timeout)
    }

    /// Start `ctr <args>` in the background, with a stdin pipe if asked.
    pub fn spawn<S: AsRef<str>>(&self, args: &[S], with_stdin: bool) -> Result<Spawned> {
        Spawned::start(self.command(args), Self::describe(args), with_stdin)
    }

    /// Start `ctr run …` that a test will stop with a signal to ctr itself
    /// (as Nomad's raw_exec does). `ctr run` forwards signals to the task
    /// only from the moment its Start returned; before that a SIGTERM ends
    /// ctr and leaves the task running. That moment is made visible: ctr
    /// starts with SIGINT ignored, and Go installs a handler for an ignored
    /// SIGINT only when ctr asks for every signal (`signal.Notify`), so
    /// [`forwards_signals`] turns true exactly when forwarding is on.
    pub fn spawn_signal_proxy<S: AsRef<str>>(&self, args: &[S]) -> Result<Spawned> {
        let mut cmd = self.command(args);
        // SAFETY: runs between fork and exec; signal(2) is async-signal-safe
        // and SIG_IGN survives exec, which is the point.
        unsafe {
            use std::os::unix::process::CommandExt;
            cmd.pre_exec(|| {
                nix::sys::signal::signal(
                    nix::sys::signal::Signal::SIGINT,
                    nix::sys::signal::SigHandler::SigIgn,
                )
                .map(drop)
                .map_err(std::io::Error::from)
            });
        }
        Spawned::start(cmd, Self::describe(args), false)
    }

    /// Start `ctr <args>` with a terminal on its side (needed by `ctr run -t`),
    /// through `script(1)` from bsdutils, which allocates a pty and relays it.
    pub fn spawn_tty<S: AsRef<str>>(&self, args: &[S]) -> Result<Spawned> {
        let inner = self.command(args);
        let mut line = shell_quote(&inner.get_program().to_string_lossy());
        for a in inner.get_args() {
            line.push(' ');
            line.push_str(&shell_quote(&a.to_string_lossy()));
        }
        let mut cmd = Command::new("script");
        // -q: no banner; -e: exit with the child's status; -c: the command.
        cmd.args(["-q", "-e", "-c"]).arg(&line).arg("/dev/null");
        Spawned::start(cmd, format!("script -qec {line:?}"), true)
    }

    /// `ctr task ls`, parsed.
    pub fn tasks(&self) -> Result<Vec<TaskRow>> {
        let out = self.run(&["task", "ls"])?;
        Ok(out
            .stdout
            .lines()
            .skip(1)
            .filter_map(|l| {
                let mut f = l.split_whitespace();
                let id = f.next()?.to_owned();
                let pid = f.next()?.parse().ok()?;
                let status = f.next()?.to_owned();
                Some(TaskRow { id, pid, status })
            })
            .collect())
    }

    /// The status column of one task in `ctr task ls`, if it is listed.
    pub fn task_status(&self, id: &str) -> Result<Option<String>> {
        Ok(self
            .tasks()?
            .into_iter()
            .find(|t| t.id == id)
            .map(|t| t.status))
    }

    /// Container ids in the namespace (`ctr containers ls -q`).
    pub fn containers(&self) -> Result<Vec<String>> {
        let out = self.run(&["containers", "ls", "-q"])?;
        Ok(out
            .stdout
            .lines()
            .map(str::to_owned)
            .filter(|l| !l.is_empty())
            .collect())
    }
}

/// Quote a word for `sh -c`.
pub(crate) fn shell_quote(s: &str) -> String {
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:,@%+".contains(c))
    {
        s.to_owned()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// Whether the process `pid`, started by [`Ctr::spawn_signal_proxy`], has
/// turned signal forwarding on (its SIGINT is no longer ignored).
pub fn forwards_signals(pid: u32) -> bool {
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return false;
    };
    let ignored = status
        .lines()
        .find_map(|l| l.strip_prefix("SigIgn:"))
        .and_then(|mask| u64::from_str_radix(mask.trim(), 16).ok());
    matches!(ignored, Some(mask) if mask & (1 << (libc::SIGINT - 1)) == 0)
}
