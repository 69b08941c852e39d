//! The one place that knows how runc is driven. [`RuncClient`] is the only
//! type that runs runc: plain containers, the pair's engines and the
//! `delete` action call its methods, one per runc command, and nothing else
//! touches the `runc` crate's client. It owns runc's conventions too: the
//! pid files runc writes, the spawner that waits through the exit router
//! (the shim's reaper takes every child, so `waitpid` on runc's own pid
//! would race it), runc's JSON log read back to give errors runc's own
//! words, and the classification of those words into error codes.

use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::sync::Arc;

use async_trait::async_trait;
use oci_spec::runtime::{LinuxResources, Process as ProcessSpec};
use runc::options::{CreateOpts, DeleteOpts, ExecOpts, GlobalOpts, KillOpts};
use runc::{Command, Runc, Spawner};
use tokio::io::AsyncReadExt;

use crate::config::Config;
use crate::error::{Error, Result, RuncFailure};
use crate::exits::ExitRouter;
use crate::options::RuncOptions;

/// The pid file of a container's init (or an engine), in its bundle.
pub const INIT_PID_FILE: &str = "init.pid";

/// Runs runc commands and takes their exit from the router.
#[derive(Debug)]
pub struct ReapedSpawner {
    router: Arc<ExitRouter>,
}

impl std::fmt::Debug for ExitRouter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ExitRouter")
    }
}

#[async_trait]
impl Spawner for ReapedSpawner {
    async fn execute(&self, mut cmd: Command) -> runc::Result<(ExitStatus, u32, String, String)> {
        // Spawned through std so that tokio's own child reaping stays out of
        // it: the shim's reaper is the only one. On a blocking thread: the
        // fork and runc's exec take milliseconds, during which the shim's
        // one runtime thread must stay free (a failover's READY=1 arrives
        // exactly while the dead engine's respawn starts).
        let std_cmd = std::mem::replace(cmd.as_std_mut(), std::process::Command::new("runc"));
        let mut child = tokio::task::spawn_blocking(move || {
            let mut std_cmd = std_cmd;
            std_cmd.spawn()
        })
        .await
        .map_err(|e| runc::error::Error::ProcessSpawnFailed(std::io::Error::other(e.to_string())))?
        .map_err(runc::error::Error::ProcessSpawnFailed)?;
        let pid = child.id();
        let exit = self.router.watch(pid as i32);
        let stdout = child.stdout.take().map(OwnedFd::from);
        let stderr = child.stderr.take().map(OwnedFd::from);
        drop(child);
        let (out, err) = tokio::join!(read_all(stdout), read_all(stderr));
        let exit = exit.await.map_err(|_| {
            runc::error::Error::InvalidCommand(std::io::Error::other(format!(
                "exit of runc pid {pid} was never reported"
            )))
        })?;
        let status = ExitStatus::from_raw((exit.status & 0xff) << 8);
        Ok((status, pid, out, err))
    }
}

async fn read_all(fd: Option<OwnedFd>) -> String {
    let Some(fd) = fd else {
        return String::new();
    };
    let mut buf = Vec::new();
    if let Ok(mut rx) = tokio::net::unix::pipe::Receiver::from_owned_fd(fd) {
        let _ = rx.read_to_end(&mut buf).await;
    }
    String::from_utf8_lossy(&buf).into_owned()
}

/// How the process runc starts gets its stdio.
pub enum RuncStdio<'a> {
    /// runc hands the pty master to this console socket.
    Console(&'a Path),
    /// runc's own command gets these (pipes, or a pair's shared output);
    /// they are closed in the shim once runc returns.
    Fds(Arc<dyn runc::io::Io>),
}

/// runc, configured for one bundle: its binary, its state root for the
/// namespace, and a JSON log in the bundle. Every runc command the shim
/// runs is a method here.
#[derive(Clone, Debug)]
pub struct RuncClient {
    runc: Runc,
    /// runc's state root for the namespace: `<root>/<id>` exists while runc
    /// knows the container.
    root: PathBuf,
    log: PathBuf,
    /// `--no-pivot` and `--no-new-keyring` for create and run.
    no_pivot: bool,
    no_new_keyring: bool,
    /// `IoUid`/`IoGid`: owner of the stdio pipes handed to the processes.
    io_owner: Option<(u32, u32)>,
}

impl RuncClient {
    /// The task's runc options (`options`) override the config's binary
    /// and root, as runc-v2's do: `<root>/<namespace>` is the state root.
    pub fn new(
        config: &Config,
        namespace: &str,
        bundle: &Path,
        router: Arc<ExitRouter>,
        options: &RuncOptions,
    ) -> Result<Self> {
        let log = bundle.join("log.json");
        let root = match &options.root {
            Some(root) => root.join(namespace),
            None => config.runc_root(namespace),
        };
        let (binary, source) = match &options.binary {
            Some(b) => (b.as_str(), "the task's runtime options, BinaryName"),
            None => (config.runc.binary.as_str(), "config runc.binary"),
        };
        let mut opts = GlobalOpts::new()
            .command(binary)
            .root(&root)
            .log(&log)
            .log_json()
            .systemd_cgroup(options.systemd_cgroup);
        opts.custom_spawner(Arc::new(ReapedSpawner { router }));
        let runc = opts.build().map_err(|e| {
            Error::FailedPrecondition(format!("runc binary {binary:?} ({source}): {e}"))
        })?;
        Ok(RuncClient {
            runc,
            root,
            log,
            no_pivot: options.no_pivot_root,
            no_new_keyring: options.no_new_keyring,
            io_owner: Some((options.io_uid, options.io_gid)).filter(|o| *o != (0, 0)),
        })
    }

    /// Who must own the container's ends of its stdio pipes (`IoUid`,
    /// `IoGid`), when the options name someone other than root.
    pub fn io_owner(&self) -> Option<(u32, u32)> {
        self.io_owner
    }

    fn create_opts(&self, pid_file: &Path) -> CreateOpts {
        CreateOpts::new()
            .pid_file(pid_file)
            .no_pivot(self.no_pivot)
            .no_new_keyring(self.no_new_keyring)
    }

    /// `runc create` of `bundle`; returns the init's pid.
    pub async fn create(&self, id: &str, bundle: &Path, stdio: RuncStdio<'_>) -> Result<u32> {
        let pid_file = bundle.join(INIT_PID_FILE);
        let opts = with_stdio(self.create_opts(&pid_file), stdio);
        let created = self.runc.create(id, bundle, Some(&opts)).await;
        drop(opts); // closes the container's stdio ends in the shim
        created.map_err(|e| self.error("create", id, e))?;
        read_pid(&pid_file)
    }

    /// `runc run --detach` of `bundle` (an engine: created and started in
    /// one step); returns its pid. `inherit` become the process's
    /// descriptors 3, 4, … (`runc run --preserve-fds`).
    pub async fn run_detached(
        &self,
        id: &str,
        bundle: &Path,
        stdio: RuncStdio<'_>,
        inherit: &[BorrowedFd<'_>],
    ) -> Result<u32> {
        self.create_or_run(true, id, bundle, stdio, inherit).await
    }

    /// `runc create` of `bundle` whose process will inherit `inherit` as
    /// its descriptors 3, 4, … (`runc create --preserve-fds`); returns the
    /// init's pid. `start` runs it.
    pub async fn create_inheriting(
        &self,
        id: &str,
        bundle: &Path,
        stdio: RuncStdio<'_>,
        inherit: &[BorrowedFd<'_>],
    ) -> Result<u32> {
        self.create_or_run(false, id, bundle, stdio, inherit).await
    }

    async fn create_or_run(
        &self,
        run: bool,
        id: &str,
        bundle: &Path,
        stdio: RuncStdio<'_>,
        inherit: &[BorrowedFd<'_>],
    ) -> Result<u32> {
        let pid_file = bundle.join(INIT_PID_FILE);
        // A previous generation's pid must never be read as this one's.
        let _ = std::fs::remove_file(&pid_file);
        let stdio = match stdio {
            RuncStdio::Fds(io) if !inherit.is_empty() => {
                let fds = inherit
                    .iter()
                    .map(|fd| fd.try_clone_to_owned())
                    .collect::<std::io::Result<Vec<_>>>()
                    .map_err(|e| Error::io(format!("duplicating the sockets {id} inherits"), e))?;
                RuncStdio::Fds(Arc::new(PreservedFds { inner: io, fds }))
            }
            RuncStdio::Console(_) if !inherit.is_empty() => {
                return Err(Error::InvalidArgument(format!(
                    "{id}: inherited sockets with a terminal are not supported"
                )))
            }
            stdio => stdio,
        };
        let (done, step) = if run {
            let opts = with_stdio(self.create_opts(&pid_file).detach(true), stdio);
            let ran = self.runc.run(id, bundle, Some(&opts)).await;
            drop(opts);
            (ran.map(|_| ()), "run")
        } else {
            let opts = with_stdio(self.create_opts(&pid_file), stdio);
            let created = self.runc.create(id, bundle, Some(&opts)).await;
            drop(opts);
            (created.map(|_| ()), "create")
        };
        done.map_err(|e| self.error(step, id, e))?;
        read_pid(&pid_file)
    }

    /// `runc start`: the created init runs the spec's process.
    pub async fn start(&self, id: &str) -> Result<()> {
        self.runc
            .start(id)
            .await
            .map_err(|e| self.error("start", id, e))
    }

    /// `runc exec --detach` of `spec` as `exec_id`; returns its pid. The
    /// pid file lives in `bundle` for as long as the call.
    pub async fn exec(
        &self,
        id: &str,
        bundle: &Path,
        exec_id: &str,
        spec: &ProcessSpec,
        stdio: RuncStdio<'_>,
    ) -> Result<u32> {
        let pid_file = bundle.join(format!("exec-{exec_id}.pid"));
        let spec: oci_spec_runc::runtime::Process = retype(spec)?;
        let opts = match stdio {
            RuncStdio::Console(path) => ExecOpts::new().console_socket(path),
            RuncStdio::Fds(io) => ExecOpts::new().io(io),
        }
        .pid_file(&pid_file)
        .detach(true);
        let ran = self.runc.exec(id, &spec, Some(&opts)).await;
        drop(opts);
        ran.map_err(|e| self.error("exec", id, e))?;
        let pid = read_pid(&pid_file);
        let _ = std::fs::remove_file(&pid_file);
        pid
    }

    /// `runc kill [--all] <signal>`.
    pub async fn kill(&self, id: &str, signal: u32, all: bool) -> Result<()> {
        let opts = KillOpts::new().all(all);
        self.runc
            .kill(id, signal, Some(&opts))
            .await
            .map_err(|e| finished_is_not_found(self.error("kill", id, e)))
    }

    /// `runc delete --force`: kills what still runs and removes runc's
    /// state. A container runc does not know is already deleted, and costs
    /// no runc run: runc keeps `<root>/<id>` from its create to its delete,
    /// so where there is none, nothing is asked (the `delete` action looks
    /// for a pair's engines after every container, plain ones too).
    pub async fn delete_force(&self, id: &str) -> Result<()> {
        if !self.knows(id) {
            return Ok(());
        }
        let force = DeleteOpts::new().force(true);
        match self.runc.delete(id, Some(&force)).await {
            Ok(()) => Ok(()),
            Err(e) => match self.error("delete", id, e) {
                Error::Runc {
                    kind: RuncFailure::NotFound,
                    ..
                } => Ok(()),
                e => Err(e),
            },
        }
    }

    /// `runc pause`.
    pub async fn pause(&self, id: &str) -> Result<()> {
        self.runc
            .pause(id)
            .await
            .map_err(|e| self.error("pause", id, e))
    }

    /// `runc resume`.
    pub async fn resume(&self, id: &str) -> Result<()> {
        self.runc
            .resume(id)
            .await
            .map_err(|e| self.error("resume", id, e))
    }

    /// `runc ps`: the pids of the container's processes.
    pub async fn ps(&self, id: &str) -> Result<Vec<u32>> {
        let pids = self
            .runc
            .ps(id)
            .await
            .map_err(|e| self.error("ps", id, e))?;
        Ok(pids.into_iter().map(|p| p as u32).collect())
    }

    /// `runc update` with new resource limits.
    pub async fn update(&self, id: &str, resources: &LinuxResources) -> Result<()> {
        self.runc
            .update(id, &retype(resources)?)
            .await
            .map_err(|e| self.error("update", id, e))
    }

    /// Whether runc keeps state for `id` (its directory under the root).
    fn knows(&self, id: &str) -> bool {
        self.root.join(id).is_dir()
    }

    /// Turn a runc crate error into ours, with runc's last logged error.
    /// A command on an existing container that failed while runc keeps no
    /// state for it failed because the container is gone: that fact beats
    /// any reading of the message.
    fn error(&self, op: &'static str, id: &str, e: runc::error::Error) -> Error {
        let failed = matches!(e, runc::error::Error::CommandFailed { .. });
        let message = match &e {
            runc::error::Error::CommandFailed { stderr, .. } => last_log_error(&self.log)
                .or_else(|| Some(stderr.trim().to_string()).filter(|s| !s.is_empty()))
                .unwrap_or_else(|| e.to_string()),
            _ => e.to_string(),
        };
        let kind = if failed && !makes_container(op) && !self.knows(id) {
            RuncFailure::NotFound
        } else {
            classify(op, &message)
        };
        Error::Runc {
            op,
            id: id.to_string(),
            kind,
            message,
        }
    }
}

/// A `runc run` (or `runc create`) whose process inherits `fds` as its descriptors 3.. The
/// runc crate has no option for `--preserve-fds`, so this wraps the stdio
/// (the one hook it gives into the command) and rebuilds the command with
/// the flag after the subcommand. Holds its own duplicates, closed when runc
/// has returned.
#[derive(Debug)]
struct PreservedFds {
    inner: Arc<dyn runc::io::Io>,
    fds: Vec<OwnedFd>,
}

/// `cmd` again with `--preserve-fds n` right after its `run` or `create`
/// subcommand.
fn with_preserve_fds(cmd: &std::process::Command, n: usize) -> std::io::Result<Command> {
    use std::ffi::OsStr;
    let mut args: Vec<&OsStr> = cmd.get_args().collect();
    let at = args
        .windows(2)
        .position(|w| (w[0] == "run" || w[0] == "create") && w[1] == "--bundle")
        .ok_or_else(|| {
            std::io::Error::other("--preserve-fds: not a `runc run|create --bundle` command")
        })?;
    let n = n.to_string();
    args.splice(
        at + 1..at + 1,
        [OsStr::new("--preserve-fds"), OsStr::new(&n)],
    );
    let mut out = std::process::Command::new(cmd.get_program());
    out.args(args);
    for (k, v) in cmd.get_envs() {
        match v {
            Some(v) => out.env(k, v),
            None => out.env_remove(k),
        };
    }
    if let Some(dir) = cmd.get_current_dir() {
        out.current_dir(dir);
    }
    // The runc crate's defaults; the wrapped stdio sets its own next.
    out.stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    Ok(Command::from(out))
}

#[async_trait]
impl runc::io::Io for PreservedFds {
    async fn set(&self, cmd: &mut Command) -> std::io::Result<()> {
        *cmd = with_preserve_fds(cmd.as_std(), self.fds.len())?;
        self.inner.set(cmd).await?;
        let from: Vec<RawFd> = self.fds.iter().map(AsRawFd::as_raw_fd).collect();
        let mut moved: Vec<RawFd> = vec![-1; from.len()];
        let first = shadow_contract::listen::FIRST_FD;
        let above = first + from.len() as RawFd;
        // SAFETY: the closure runs in the forked child before exec and
        // calls only fcntl(2) and dup2(2), which are async-signal-safe; it
        // allocates nothing (both vectors exist before the fork). Each
        // descriptor is first copied above the target range (close-on-exec,
        // so the copies vanish at exec), then onto 3+i: no target can
        // overwrite a source not yet copied. dup2 clears close-on-exec on
        // the target, so runc gets exactly 3..3+n. A target may replace
        // std's close-on-exec error pipe; then an exec failure shows as runc
        // exiting 127 instead of a spawn error, which the caller reports too.
        unsafe {
            cmd.pre_exec(move || {
                for (i, &fd) in from.iter().enumerate() {
                    let m = libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, above);
                    if m < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    moved[i] = m;
                }
                for (i, &m) in moved.iter().enumerate() {
                    if libc::dup2(m, first + i as RawFd) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        Ok(())
    }

    async fn close_after_start(&self) {
        self.inner.close_after_start().await
    }
}

fn with_stdio(opts: CreateOpts, stdio: RuncStdio<'_>) -> CreateOpts {
    match stdio {
        RuncStdio::Console(path) => opts.console_socket(path),
        RuncStdio::Fds(io) => opts.io(io),
    }
}

/// The pid runc wrote. The file is runc's, not the caller's: a bad one is
/// an internal error.
fn read_pid(path: &Path) -> Result<u32> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::io(format!("reading runc pid file {}", path.display()), e))?;
    text.trim().parse().map_err(|_| Error::Internal {
        what: format!("runc pid file {}", path.display()),
        reason: format!("{text:?} is not a pid"),
    })
}

/// Re-type a spec value for the runc crate, which uses an older oci-spec.
fn retype<A: serde::Serialize, B: serde::de::DeserializeOwned>(value: &A) -> Result<B> {
    serde_json::to_value(value)
        .and_then(serde_json::from_value)
        .map_err(|e| Error::InvalidArgument(format!("spec not accepted by runc client: {e}")))
}

/// The message of the last `"level":"error"` line in runc's JSON log.
fn last_log_error(log: &Path) -> Option<String> {
    let text = std::fs::read_to_string(log).ok()?;
    text.lines().rev().find_map(|line| {
        let v: serde_json::Value = serde_json::from_str(line).ok()?;
        (v.get("level")?.as_str()? == "error").then(|| v.get("msg")?.as_str().map(String::from))?
    })
}

/// A kill that finds the container's init dead but not yet reaped: runc
/// says "container not running". runc-v2 answers NotFound there ("process
/// already finished", `checkKillError`), and ctr takes NotFound for a task
/// that is already gone; a paused or otherwise wrong state stays what it is.
fn finished_is_not_found(e: Error) -> Error {
    match e {
        Error::Runc {
            op,
            id,
            message,
            kind: RuncFailure::WrongState,
        } if message
            .to_ascii_lowercase()
            .contains("container not running") =>
        {
            Error::Runc {
                op,
                id,
                message: format!("process already finished: {message}"),
                kind: RuncFailure::NotFound,
            }
        }
        e => e,
    }
}

/// Commands that make the container they name: runc keeps no state for it
/// until they succeed, so its absence means nothing.
fn makes_container(op: &str) -> bool {
    matches!(op, "create" | "run")
}

/// libcontainer's words for "no such container" (`ErrNotExist`).
const NOT_EXIST: &[&str] = &["container does not exist"];
/// … for "that id is taken" (`ErrExist`).
const EXIST: &[&str] = &["container with given id already exists"];
/// … for a container in the wrong state: `ErrNotRunning`, `ErrPaused`,
/// `ErrNotPaused`, `ErrRunning`, and the state checks of runc's start,
/// exec, delete and kill.
const WRONG_STATE: &[&str] = &[
    "container not running",
    "container paused",
    "container not paused",
    "container still running",
    "cannot start an already running container",
    "cannot start a container that has stopped",
    "cannot start a container in the ",
    "cannot exec in a stopped container",
    "cannot exec in a paused container",
    "that is not stopped",
    "container process is already dead",
];
/// How runc reports that the process the spec names could not be started
/// (runc ≥ 1.1, and the wording before it).
const PROCESS_START: &[&str] = &[
    "unable to start container process",
    "starting container process caused",
];
/// … and the reasons that are the spec's fault: no such binary or path,
/// not executable, a cwd that is not there.
const SPEC_FAULT: &[&str] = &[
    "executable file not found",
    "no such file or directory",
    "permission denied",
    "chdir to cwd",
];

/// What runc's message means for the caller of `op`, read against the
/// messages runc itself produces (libcontainer's error values and its
/// commands' checks), not against loose words.
pub fn classify(op: &str, message: &str) -> RuncFailure {
    let m = message.to_ascii_lowercase();
    let says = |phrases: &[&str]| phrases.iter().any(|p| m.contains(p));
    if says(NOT_EXIST) {
        RuncFailure::NotFound
    } else if says(EXIST) {
        RuncFailure::AlreadyExists
    } else if says(WRONG_STATE) {
        RuncFailure::WrongState
    } else if matches!(op, "create" | "run" | "exec") && says(PROCESS_START) && says(SPEC_FAULT) {
        RuncFailure::BadSpec
    } else {
        RuncFailure::Other
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifies_runc_messages() {
        // What runc 1.1 says, verbatim.
        let missing_binary = "runc create failed: unable to start container process: exec: \"nope\": executable file not found in $PATH";
        assert_eq!(classify("create", missing_binary), RuncFailure::BadSpec);
        assert_eq!(
            classify(
                "exec",
                "exec failed: unable to start container process: exec: \"/etc\": permission denied"
            ),
            RuncFailure::BadSpec
        );
        assert_eq!(
            classify("kill", "container does not exist"),
            RuncFailure::NotFound
        );
        assert_eq!(
            classify("create", "container with given ID already exists"),
            RuncFailure::AlreadyExists
        );
        for wrong_state in [
            "container not running",
            "container paused",
            "container not paused",
            "container still running",
            "cannot exec in a stopped container",
            "cannot start an already running container",
            "cannot delete container c1 that is not stopped: running",
        ] {
            assert_eq!(
                classify("kill", wrong_state),
                RuncFailure::WrongState,
                "{wrong_state}"
            );
        }
        assert_eq!(classify("create", "something else"), RuncFailure::Other);
    }

    #[test]
    fn loose_words_are_not_a_classification() {
        // Before: any "permission denied", "stopped" or "already" decided.
        // A cgroup that cannot be written is not the caller's bad spec, and
        // a message that merely mentions stopping is not a state error.
        assert_eq!(
            classify("create", "runc create failed: unable to apply cgroup configuration: mkdir /sys/fs/cgroup/x: permission denied"),
            RuncFailure::Other
        );
        assert_eq!(
            classify("kill", "the shim stopped waiting"),
            RuncFailure::Other
        );
        assert_eq!(classify("pause", "already handled"), RuncFailure::Other);
        // A process that cannot start only blames the spec for commands
        // that start one.
        assert_eq!(
            classify(
                "update",
                "unable to start container process: no such file or directory"
            ),
            RuncFailure::Other
        );
    }

    fn client_with(binary: &str, root: &Path, bundle: &Path) -> RuncClient {
        let mut config = Config::default();
        config.runc.binary = binary.into();
        config.runc.root = root.to_path_buf();
        RuncClient::new(
            &config,
            "ns",
            bundle,
            Arc::new(ExitRouter::default()),
            &RuncOptions::default(),
        )
        .unwrap()
    }

    #[tokio::test]
    async fn deleting_a_container_runc_does_not_know_runs_no_runc() {
        use std::os::unix::fs::PermissionsExt;
        // A runc that would leave a trace; it must not run at all (and so
        // no child is spawned here that another test's reaper could take).
        let d = tempfile::tempdir().unwrap();
        let calls = d.path().join("calls");
        let runc = d.path().join("runc");
        std::fs::write(&runc, format!("#!/bin/sh\ntouch {}\n", calls.display())).unwrap();
        std::fs::set_permissions(&runc, std::fs::Permissions::from_mode(0o755)).unwrap();
        let client = client_with(&runc.display().to_string(), d.path(), d.path());
        client.delete_force("c1-s0").await.unwrap();
        assert!(
            !calls.exists(),
            "runc was run for a container it has no state for"
        );
        // runc's state dir is what says it knows one.
        std::fs::create_dir_all(d.path().join("ns/c1")).unwrap();
        assert!(client.knows("c1") && !client.knows("c1-s0"));
    }

    fn command_failed(stderr: &str) -> runc::error::Error {
        runc::error::Error::CommandFailed {
            status: ExitStatus::from_raw(1 << 8),
            stdout: String::new(),
            stderr: stderr.into(),
        }
    }

    #[test]
    fn absent_state_dir_means_not_found_except_for_commands_that_make_it() {
        let d = tempfile::tempdir().unwrap();
        let client = client_with("/bin/true", d.path(), d.path());
        let e = client.error("kill", "c1", command_failed("some other wording"));
        assert!(
            matches!(
                e,
                Error::Runc {
                    kind: RuncFailure::NotFound,
                    ..
                }
            ),
            "{e:?}"
        );
        assert_eq!(e.code(), containerd_shim_protos::ttrpc::Code::NOT_FOUND);
        // create/run fail before runc keeps state: the message decides.
        let e = client.error("create", "c1", command_failed("some other wording"));
        assert!(
            matches!(
                e,
                Error::Runc {
                    kind: RuncFailure::Other,
                    ..
                }
            ),
            "{e:?}"
        );
        // While runc knows the container, its message decides.
        std::fs::create_dir_all(d.path().join("ns/c1")).unwrap();
        let e = client.error("kill", "c1", command_failed("container not running"));
        assert!(
            matches!(
                e,
                Error::Runc {
                    kind: RuncFailure::WrongState,
                    ..
                }
            ),
            "{e:?}"
        );
        // …and a kill that finds the init dead, not yet reaped, is NotFound,
        // as runc-v2 answers it; a paused container stays a wrong state.
        let e = finished_is_not_found(e);
        assert_eq!(
            e.code(),
            containerd_shim_protos::ttrpc::Code::NOT_FOUND,
            "{e:?}"
        );
        assert!(e.to_string().contains("already finished"), "{e}");
        let e =
            finished_is_not_found(client.error("kill", "c1", command_failed("container paused")));
        assert_eq!(
            e.code(),
            containerd_shim_protos::ttrpc::Code::FAILED_PRECONDITION,
            "{e:?}"
        );
    }

    #[test]
    fn missing_runc_binary_names_the_config_key() {
        let d = tempfile::tempdir().unwrap();
        let mut config = Config::default();
        config.runc.binary = "/nonexistent/runc".into();
        let router = Arc::new(ExitRouter::default());
        let e = RuncClient::new(
            &config,
            "ns",
            d.path(),
            router.clone(),
            &RuncOptions::default(),
        )
        .unwrap_err();
        assert_eq!(
            e.code(),
            containerd_shim_protos::ttrpc::Code::FAILED_PRECONDITION
        );
        let msg = e.to_string();
        assert!(
            msg.contains("/nonexistent/runc") && msg.contains("runc.binary"),
            "{msg}"
        );
        // The task's options name their own binary: the error says so.
        config.runc.binary = "runc".into();
        let options = RuncOptions {
            binary: Some("/nonexistent/no-runc".into()),
            ..Default::default()
        };
        let e = RuncClient::new(&config, "ns", d.path(), router, &options).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("/nonexistent/no-runc") && msg.contains("BinaryName"),
            "{msg}"
        );
    }

    #[test]
    fn the_tasks_runc_root_replaces_the_configs() {
        let d = tempfile::tempdir().unwrap();
        let mut config = Config::default();
        config.runc.binary = "/bin/true".into();
        config.runc.root = d.path().join("config-root");
        let options = RuncOptions {
            root: Some(d.path().join("task-root")),
            ..Default::default()
        };
        let client = RuncClient::new(
            &config,
            "ns",
            d.path(),
            Arc::new(ExitRouter::default()),
            &options,
        )
        .unwrap();
        assert_eq!(client.root, d.path().join("task-root/ns"));
        std::fs::create_dir_all(d.path().join("config-root/ns/c1")).unwrap();
        assert!(!client.knows("c1"));
        std::fs::create_dir_all(d.path().join("task-root/ns/c1")).unwrap();
        assert!(client.knows("c1"));
    }

    #[test]
    fn bad_pid_file_is_internal() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join(INIT_PID_FILE);
        std::fs::write(&p, "12\n").unwrap();
        assert_eq!(read_pid(&p).unwrap(), 12);
        std::fs::write(&p, "garbage").unwrap();
        let e = read_pid(&p).unwrap_err();
        assert_eq!(e.code(), containerd_shim_protos::ttrpc::Code::INTERNAL);
        assert!(e.to_string().contains(&p.display().to_string()), "{e}");
    }

    #[test]
    fn reads_last_error_from_json_log() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("log.json");
        std::fs::write(
            &p,
            "{\"level\":\"error\",\"msg\":\"first\"}\n{\"level\":\"info\",\"msg\":\"x\"}\n{\"level\":\"error\",\"msg\":\"second\"}\n{\"level\":\"warning\",\"msg\":\"y\"}\n",
        )
        .unwrap();
        assert_eq!(last_log_error(&p).as_deref(), Some("second"));
        assert_eq!(last_log_error(&dir.path().join("none")), None);
    }

    #[tokio::test]
    async fn spawner_reports_exit_code_through_router() {
        let router = Arc::new(ExitRouter::default());
        let spawner = ReapedSpawner {
            router: router.clone(),
        };
        let mut cmd = Command::new("/bin/sh");
        cmd.args(["-c", "echo out; echo err >&2; exit 3"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        // In the test there is no shim reaper: reap it ourselves and route.
        // Only our `sh`: other tests of this binary run children of their
        // own at the same time (a look without reaping first, WNOWAIT).
        let reaper = {
            let router = router.clone();
            tokio::spawn(async move {
                use nix::sys::wait::{waitid, waitpid, Id, WaitPidFlag, WaitStatus};
                loop {
                    let seen = waitid(
                        Id::All,
                        WaitPidFlag::WEXITED | WaitPidFlag::WNOHANG | WaitPidFlag::WNOWAIT,
                    );
                    let ours = match seen {
                        Ok(WaitStatus::Exited(pid, _)) => {
                            std::fs::read_to_string(format!("/proc/{pid}/comm"))
                                .is_ok_and(|c| c.trim() == "sh")
                                .then_some(pid)
                        }
                        _ => None,
                    };
                    let reaped = ours.map(|pid| waitpid(pid, None));
                    match reaped {
                        Some(Ok(WaitStatus::Exited(pid, code))) => {
                            router.deliver(crate::exits::Exit {
                                pid: pid.as_raw(),
                                status: code,
                                at: std::time::SystemTime::now(),
                            });
                            return;
                        }
                        _ => tokio::time::sleep(std::time::Duration::from_millis(5)).await,
                    }
                }
            })
        };
        let (status, pid, out, err) = spawner.execute(cmd).await.unwrap();
        reaper.await.unwrap();
        assert!(pid > 0);
        assert_eq!(status.code(), Some(3));
        assert_eq!(out, "out\n");
        assert_eq!(err, "err\n");
    }
}
