//! A private containerd per test: its own root, state, sockets and config in
//! a temp dir, our shim first on its `PATH`, and a `Drop` that takes down
//! everything it (and the shims it started) created — tasks, the daemon,
//! shim processes, runc state, mounts, cgroups, sockets — and then checks
//! that nothing is left.

use crate::ctr::Ctr;
use crate::leftovers::{self, Leftover, Scope, RUNC_STATE_ROOT};
use crate::process::{Output, Spawned};
use crate::rootfs::Rootfs;
use crate::{shim_path, wait, Error, Result, Runtime, SHIM_BINARY};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// How long containerd may take to answer after it is started.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(30);

/// How long cleanup waits for a thing to go away before giving up on it.
const CLEANUP_TIMEOUT: Duration = Duration::from_secs(10);

static INSTANCE: AtomicUsize = AtomicUsize::new(0);

/// Options for [`Containerd`].
#[derive(Debug, Clone)]
pub struct ContainerdBuilder {
    cri: bool,
    shim_profile: &'static str,
    namespace: Option<String>,
    config_append: String,
    env: Vec<(String, String)>,
    log_level: &'static str,
}

impl Default for ContainerdBuilder {
    fn default() -> Self {
        ContainerdBuilder {
            cri: false,
            shim_profile: "debug",
            namespace: None,
            config_append: String::new(),
            env: Vec::new(),
            log_level: "info",
        }
    }
}

impl ContainerdBuilder {
    /// Keep the CRI plugin enabled (off by default: it is slow to start and
    /// `ctr run --rootfs` does not need it).
    pub fn cri(mut self, on: bool) -> Self {
        self.cri = on;
        self
    }

    /// Use our shim from `target/<profile>/` (`debug` unless told; the bench uses `release`).
    pub fn shim_profile(mut self, profile: &'static str) -> Self {
        self.shim_profile = profile;
        self
    }

    /// The containerd namespace the test works in (derived from the test's
    /// name, the pid and a counter unless told).
    pub fn namespace(mut self, ns: impl Into<String>) -> Self {
        self.namespace = Some(ns.into());
        self
    }

    /// TOML appended to the generated config (e.g. CRI plugin settings, a
    /// runtime entry); `@DIR@` in it becomes the test's temp dir, which is
    /// only known at start.
    pub fn config_append(mut self, toml: impl Into<String>) -> Self {
        self.config_append.push_str(&toml.into());
        self
    }

    /// An environment variable for containerd, and so for every shim it
    /// starts (`SHADOW_CONFIG`, as a host without systemd would set it);
    /// `@DIR@` in the value becomes the test's temp dir.
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }

    /// containerd's log level (`info` unless told); at `debug` it logs
    /// every event it takes ("event forwarded", with its topic).
    pub fn log_level(mut self, level: &'static str) -> Self {
        self.log_level = level;
        self
    }

    /// Write the config, start containerd, wait until it answers.
    pub fn start(self) -> Result<Containerd> {
        require_tool("containerd", "containerd")?;
        require_tool("ctr", "containerd")?;
        require_tool("runc", "runc")?;
        let dir = tempfile::Builder::new()
            .prefix("shadow-it-")
            .tempdir_in("/tmp")
            .map_err(|e| Error::io("create temp dir", "/tmp", e))?;
        let base = dir.path().to_owned();
        let namespace = self.namespace.unwrap_or_else(default_namespace);
        let bin = base.join("bin");
        std::fs::create_dir_all(&bin).map_err(|e| Error::io("create dir", &bin, e))?;
        // Our shim goes in a private bin dir first on containerd's PATH, so the
        // binary under test wins over any installed copy, and its command line
        // names our dir (which is how cleanup recognises our shims).
        let shim = shim_path(self.shim_profile);
        if let Ok(real) = &shim {
            let link = bin.join(SHIM_BINARY);
            std::os::unix::fs::symlink(real, &link)
                .map_err(|e| Error::io("link shim", &link, e))?;
        }
        let rootfs = Rootfs::busybox().build(&base.join("rootfs"))?;
        let cd = Containerd {
            address: base.join("containerd.sock"),
            config: base.join("config.toml"),
            log: base.join("containerd.log"),
            fifo_dir: base.join("fifo"),
            rootfs,
            namespace,
            shim,
            env: self
                .env
                .iter()
                .map(|(k, v)| (k.clone(), v.replace("@DIR@", &base.display().to_string())))
                .collect(),
            daemon: None,
            ids: Mutex::new(BTreeSet::new()),
            dir: Some(dir),
            base,
        };
        std::fs::create_dir_all(&cd.fifo_dir)
            .map_err(|e| Error::io("create dir", &cd.fifo_dir, e))?;
        let mut config = cd.config_toml(self.cri, self.log_level);
        config.push_str(
            &self
                .config_append
                .replace("@DIR@", &cd.base.display().to_string()),
        );
        std::fs::write(&cd.config, config)
            .map_err(|e| Error::io("write containerd config", &cd.config, e))?;
        let mut cd = cd;
        cd.start_daemon()?;
        Ok(cd)
    }
}

/// A running private containerd; see the module docs.
pub struct Containerd {
    base: PathBuf,
    address: PathBuf,
    config: PathBuf,
    log: PathBuf,
    fifo_dir: PathBuf,
    rootfs: PathBuf,
    namespace: String,
    shim: Result<PathBuf>,
    env: Vec<(String, String)>,
    daemon: Option<Spawned>,
    ids: Mutex<BTreeSet<String>>,
    // Last, and an Option: removed by hand at the end of cleanup.
    dir: Option<tempfile::TempDir>,
}

impl Containerd {
    /// Start one with the defaults.
    pub fn start() -> Result<Self> {
        ContainerdBuilder::default().start()
    }

    /// Options first.
    pub fn builder() -> ContainerdBuilder {
        ContainerdBuilder::default()
    }

    /// The temp dir holding everything.
    pub fn dir(&self) -> &Path {
        &self.base
    }

    /// The gRPC socket.
    pub fn address(&self) -> &Path {
        &self.address
    }

    /// The namespace this test works in.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// The busybox rootfs built for this test.
    pub fn rootfs(&self) -> &Path {
        &self.rootfs
    }

    /// containerd's log file (kept across restarts).
    pub fn log(&self) -> &Path {
        &self.log
    }

    /// A `ctr` client for our address and namespace.
    pub fn ctr(&self) -> Ctr {
        Ctr::new(&self.address, &self.namespace)
    }

    /// pid of the daemon, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.daemon.as_ref().map(Spawned::pid)
    }

    /// A container to run with `runtime`; `id` is recorded for the leftover check.
    pub fn container(&self, runtime: Runtime, id: &str) -> Container<'_> {
        self.record_id(id);
        Container {
            cd: self,
            runtime,
            id: id.to_owned(),
            flags: Vec::new(),
            rootfs: self.rootfs.clone(),
            cmd: Vec::new(),
        }
    }

    /// `ctr task exec --exec-id <exec_id> <id> <cmd…>`, to completion.
    pub fn exec<S: AsRef<str>>(&self, id: &str, exec_id: &str, cmd: &[S]) -> Result<Output> {
        self.ctr().run(&self.exec_args(id, exec_id, cmd))
    }

    /// `ctr task exec` in the background, with a stdin pipe if asked.
    pub fn exec_spawn<S: AsRef<str>>(
        &self,
        id: &str,
        exec_id: &str,
        cmd: &[S],
        with_stdin: bool,
    ) -> Result<Spawned> {
        self.ctr()
            .spawn(&self.exec_args(id, exec_id, cmd), with_stdin)
    }

    fn exec_args<S: AsRef<str>>(&self, id: &str, exec_id: &str, cmd: &[S]) -> Vec<String> {
        let mut a: Vec<String> = vec![
            "task".into(),
            "exec".into(),
            "--fifo-dir".into(),
            self.fifo_dir.display().to_string(),
            "--exec-id".into(),
            exec_id.into(),
            id.into(),
        ];
        a.extend(cmd.iter().map(|c| c.as_ref().to_owned()));
        a
    }

    /// The dir `ctr` puts its IO FIFOs in (private, so none land in /run/containerd/fifo).
    pub fn fifo_dir(&self) -> &Path {
        &self.fifo_dir
    }

    /// Remember a container id used outside [`Containerd::container`].
    pub fn record_id(&self, id: &str) {
        self.ids
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id.to_owned());
    }

    /// Stop containerd with SIGTERM (tasks and their shims keep running, as
    /// they do when an operator restarts the daemon).
    pub fn stop(&mut self) -> Result<()> {
        if let Some(d) = self.daemon.take() {
            d.signal(libc::SIGTERM)?;
            d.wait(CLEANUP_TIMEOUT)?;
        }
        Ok(())
    }

    /// `ctr events`, once it is subscribed: every event published after
    /// this returns reaches it. A throwaway container's create event proves
    /// the subscription; one made before it took hold is missed, so the
    /// probe is made again until one shows.
    pub fn subscribe_events(&self) -> Result<Spawned> {
        let mut events = self.ctr().spawn(&["events"], false)?;
        let mut n = 0;
        // Each probe waits up to 500 ms for its own event: no pause between them.
        let subscribed = wait::within(STARTUP_TIMEOUT, Duration::ZERO, || {
            let probe = format!("events-probe-{n}");
            n += 1;
            match self.probe_events(&mut events, &probe) {
                Ok(false) => None,
                seen_or_failed => Some(seen_or_failed),
            }
        });
        match subscribed {
            Some(Ok(_)) => Ok(events),
            Some(Err(e)) => Err(e),
            None => {
                events.kill();
                Err(Error::Timeout {
                    what: "ctr events to subscribe".into(),
                    after: STARTUP_TIMEOUT,
                })
            }
        }
    }

    /// Create and delete the container `probe`; whether `events` printed
    /// its create event within 500 ms.
    fn probe_events(&self, events: &mut Spawned, probe: &str) -> Result<bool> {
        let rootfs = self.rootfs.display().to_string();
        self.ctr()
            .run(&["containers", "create", "--rootfs", &rootfs, probe, "true"])?
            .assert_success();
        let seen = events.wait_line(Duration::from_millis(500), |l| {
            l.contains("/containers/create") && l.contains(probe)
        });
        self.ctr()
            .run(&["containers", "delete", probe])?
            .assert_success();
        Ok(seen.is_ok())
    }

    /// Stop and start again on the same root, state and sockets.
    pub fn restart(&mut self) -> Result<()> {
        self.stop()?;
        self.start_daemon()
    }

    /// The last lines of containerd's log, for failure messages.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// Poll until nothing of any test container is left (tasks, containers,
    /// runc state, shims, mounts, sockets, cgroups) while containerd keeps
    /// running; panic listing what is left after the deadline.
    #[track_caller]
    pub fn assert_no_leftovers(&self) {
        let Err(left) = wait::poll(CLEANUP_TIMEOUT, Duration::from_millis(50), || {
            let left = self.leftovers(false);
            if left.is_empty() {
                Ok(())
            } else {
                Err(left)
            }
        }) else {
            return;
        };
        panic!(
            "leftovers after the test in {}: {left:#?}\ncontainerd log tail:\n{}",
            self.base.display(),
            self.log_tail(30)
        );
    }

    /// What is left now. `after_cleanup` also counts the dirs cleanup removes.
    pub fn leftovers(&self, after_cleanup: bool) -> Vec<Leftover> {
        let ids = self.ids.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let scope = Scope {
            dir: &self.base,
            address: &self.address,
            namespace: &self.namespace,
            ids: &ids,
            containerd_pid: self.pid(),
            after_cleanup,
        };
        let mut found = leftovers::scan(&scope);
        if self.daemon.is_some() {
            let ctr = self.ctr();
            if let Ok(tasks) = ctr.tasks() {
                found.extend(tasks.into_iter().map(|t| Leftover::Task {
                    id: t.id,
                    status: t.status,
                }));
            }
            if let Ok(cs) = ctr.containers() {
                found.extend(cs.into_iter().map(|id| Leftover::Container { id }));
            }
        }
        found
    }

    fn config_toml(&self, cri: bool, log_level: &str) -> String {
        let b = self.base.display();
        let disabled = if cri {
            ""
        } else {
            "\"io.containerd.grpc.v1.cri\""
        };
        format!(
            r#"# Private containerd for one test; written by shadow-tests.
version = 2
root = "{b}/root"
state = "{b}/state"
disabled_plugins = [{disabled}]

[grpc]
  address = "{b}/containerd.sock"

[ttrpc]
  address = "{b}/containerd.sock.ttrpc"

[debug]
  address = "{b}/debug.sock"
  level = "{log_level}"

[metrics]
  address = ""

[plugins."io.containerd.internal.v1.opt"]
  path = "{b}/opt"
"#
        )
    }

    fn start_daemon(&mut self) -> Result<()> {
        let path = std::env::var("PATH").unwrap_or_else(|_| "/usr/sbin:/usr/bin:/sbin:/bin".into());
        let mut cmd = Command::new("containerd");
        cmd.arg("--config").arg(&self.config).env(
            "PATH",
            format!("{}:{path}", self.base.join("bin").display()),
        );
        cmd.envs(self.env.iter().map(|(k, v)| (k, v)));
        let mut daemon = Spawned::start_logged(
            cmd,
            format!("containerd --config {}", self.config.display()),
            &self.log,
        )?;
        let ctr = self.ctr();
        // Some(true): it answers; Some(false): it exited.
        let up = wait::within(STARTUP_TIMEOUT, Duration::from_millis(20), || {
            if daemon.has_exited() {
                return Some(false);
            }
            let answers = self.address.exists()
                && ctr
                    .run_timeout(&["version"], Duration::from_secs(5))
                    .is_ok_and(|out| out.code() == 0);
            answers.then_some(true)
        });
        match up {
            Some(true) => {}
            Some(false) => {
                return Err(Error::Containerd {
                    address: self.address.clone(),
                    reason: format!("exited during startup:\n{}", self.log_tail(20)),
                    log: self.log.clone(),
                })
            }
            None => {
                daemon.kill();
                return Err(Error::Containerd {
                    address: self.address.clone(),
                    reason: format!("did not answer `ctr version` within {STARTUP_TIMEOUT:?}"),
                    log: self.log.clone(),
                });
            }
        }
        self.daemon = Some(daemon);
        Ok(())
    }

    /// Take everything down; return what could not be cleaned.
    fn cleanup(&mut self) -> Vec<Leftover> {
        // 1. Through containerd while it is up: kill, delete tasks and containers.
        if self.daemon.is_some() {
            let ctr = self.ctr();
            if let Ok(tasks) = ctr.tasks() {
                for t in &tasks {
                    let _ = ctr.run(&["task", "kill", "--all", "--signal", "SIGKILL", &t.id]);
                }
                for t in &tasks {
                    let _ = ctr.run(&["task", "delete", "--force", &t.id]);
                }
            }
            if let Ok(cs) = ctr.containers() {
                for c in cs {
                    let _ = ctr.run(&["containers", "delete", &c]);
                }
            }
        }
        // 2. The daemon.
        if let Some(d) = self.daemon.take() {
            let _ = d.signal(libc::SIGTERM);
            // On timeout, wait() kills it.
            let _ = d.wait(CLEANUP_TIMEOUT);
        }
        // 3. Any shim (or stray ctr) that names our address or dir.
        leftovers::kill_our_processes(&self.base, &self.address, CLEANUP_TIMEOUT);
        // 4. runc state of our namespace: the containers and the dir.
        let runc_root = Path::new(RUNC_STATE_ROOT).join(&self.namespace);
        if runc_root.is_dir() {
            for id in leftovers::runc_containers(&runc_root) {
                let root = runc_root.display().to_string();
                let _ = Command::new("runc")
                    .args(["--root", &root, "kill", &id, "KILL"])
                    .output();
                let _ = Command::new("runc")
                    .args(["--root", &root, "delete", "--force", &id])
                    .output();
            }
            let _ = std::fs::remove_dir_all(&runc_root);
        }
        // 5. Mounts under our dir, deepest first.
        leftovers::unmount_under(&self.base);
        // 6. cgroups the containers had (runc removes the leaf, not the namespace dir).
        leftovers::remove_cgroups(&self.namespace);
        // 7. Shim sockets containerd/shims left in the shared socket dir.
        let ids = self.ids.lock().unwrap_or_else(|p| p.into_inner()).clone();
        for id in &ids {
            for p in leftovers::shim_socket_paths(&self.address, &self.namespace, id) {
                let _ = std::fs::remove_file(p);
            }
        }
        // 8. The dir itself.
        if let Some(dir) = self.dir.take() {
            let path = dir.path().to_owned();
            if let Err(e) = dir.close() {
                eprintln!("shadow-tests: cannot remove {}: {e}", path.display());
            }
        }
        self.leftovers(true)
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "--- containerd log tail ({}) ---\n{}\n---",
                self.log.display(),
                self.log_tail(40)
            );
        }
        let left = self.cleanup();
        if !left.is_empty() {
            let msg = format!("cleanup of {} left: {left:#?}", self.base.display());
            if std::thread::panicking() {
                eprintln!("{msg}");
            } else {
                panic!("{msg}");
            }
        }
    }
}

/// A `ctr run` being put together; see [`Containerd::container`].
pub struct Container<'a> {
    cd: &'a Containerd,
    runtime: Runtime,
    id: String,
    flags: Vec<String>,
    rootfs: PathBuf,
    cmd: Vec<String>,
}

impl Container<'_> {
    /// Add `ctr run` flags (they all go before the positionals).
    pub fn flags<S: AsRef<str>>(mut self, flags: &[S]) -> Self {
        self.flags
            .extend(flags.iter().map(|f| f.as_ref().to_owned()));
        self
    }

    /// `--rm`: delete the container when the task exits.
    pub fn rm(self) -> Self {
        self.flags(&["--rm"])
    }

    /// `--annotation key=value`.
    pub fn annotation(self, key: &str, value: &str) -> Self {
        self.flags(&["--annotation".to_owned(), format!("{key}={value}")])
    }

    /// Use another rootfs than the test's busybox one.
    pub fn rootfs(mut self, path: impl Into<PathBuf>) -> Self {
        self.rootfs = path.into();
        self
    }

    /// The command to run in the container.
    pub fn cmd<S: AsRef<str>>(mut self, cmd: &[S]) -> Self {
        self.cmd = cmd.iter().map(|c| c.as_ref().to_owned()).collect();
        self
    }

    /// The full `ctr` argument list.
    pub fn args(&self) -> Result<Vec<String>> {
        if self.runtime == Runtime::Shadow {
            if let Err(e) = &self.cd.shim {
                return Err(Error::ShimNotFound {
                    path: match e {
                        Error::ShimNotFound { path, .. } => path.clone(),
                        _ => PathBuf::from(SHIM_BINARY),
                    },
                    hint: "build it first: `cargo build -p shadow-shim` (or `make build`)",
                });
            }
        }
        let mut a: Vec<String> = vec![
            "run".into(),
            "--runtime".into(),
            self.runtime.runtime_type().into(),
            "--fifo-dir".into(),
            self.cd.fifo_dir.display().to_string(),
            // `ctr run --rootfs` gives the process no PATH at all.
            "--env".into(),
            "PATH=/bin:/sbin:/usr/bin:/usr/sbin".into(),
        ];
        a.extend(self.flags.iter().cloned());
        a.push("--rootfs".into());
        a.push(self.rootfs.display().to_string());
        a.push(self.id.clone());
        a.extend(self.cmd.iter().cloned());
        Ok(a)
    }

    /// Run to completion (bounded by the ctr timeout).
    pub fn run(self) -> Result<Output> {
        self.cd.ctr().run(&self.args()?)
    }

    /// Start in the background; stdin is a pipe when `with_stdin`.
    pub fn spawn(self, with_stdin: bool) -> Result<Spawned> {
        self.cd.ctr().spawn(&self.args()?, with_stdin)
    }

    /// Start with `-t` on a pty.
    pub fn spawn_tty(self) -> Result<Spawned> {
        let s = self.flags(&["--tty"]);
        s.cd.ctr().spawn_tty(&s.args()?)
    }
}

fn default_namespace() -> String {
    let thread = std::thread::current();
    let name = thread.name().unwrap_or("t");
    let mut ns: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    while ns.contains("--") {
        ns = ns.replace("--", "-");
    }
    let ns = ns.trim_matches('-');
    let ns: String = ns.chars().take(40).collect();
    let ns = ns.trim_matches('-');
    format!(
        "{}-{}-{}",
        if ns.is_empty() { "t" } else { ns },
        std::process::id(),
        INSTANCE.fetch_add(1, Ordering::Relaxed)
    )
}

fn require_tool(tool: &'static str, package: &'static str) -> Result<()> {
    let path = std::env::var("PATH").unwrap_or_default();
    if path.split(':').any(|d| Path::new(d).join(tool).is_file()) {
        Ok(())
    } else {
        Err(Error::MissingTool { tool, package })
    }
}

/// `events` (from [`Containerd::subscribe_events`]) saw `/tasks/exit` for
/// task `id`, and after it `/tasks/delete`; waits for the delete, then
/// ends `ctr events`.
pub fn assert_exit_before_delete(events: &mut Spawned, id: &str) {
    let quoted = format!("\"container_id\":\"{id}\"");
    let waited = events.wait_line(Duration::from_secs(30), |l| {
        l.contains("/tasks/delete") && l.contains(&quoted)
    });
    events.kill();
    let seen: Vec<String> = events
        .stdout_so_far()
        .lines()
        .filter(|l| l.contains(&quoted))
        .filter_map(|l| {
            l.split_whitespace()
                .find(|w| w.starts_with("/tasks/"))
                .map(String::from)
        })
        .collect();
    let exit = seen.iter().position(|t| t == "/tasks/exit");
    let delete = seen.iter().position(|t| t == "/tasks/delete");
    assert!(
        waited.is_ok() && matches!((exit, delete), (Some(e), Some(d)) if e < d),
        "task events of {id}: {seen:?}"
    );
}

/// The `(major, minor)` version of the `containerd` on `PATH`, from
/// `containerd --version` ("containerd github.com/… v2.3.4 <commit>", or
/// Debian's "… 1.6.20~ds1 …"); `None` if it cannot be run or read.
pub fn containerd_version() -> Option<(u32, u32)> {
    let out = Command::new("containerd").arg("--version").output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.split_whitespace().skip(1).find_map(|w| {
        let mut parts = w.trim_start_matches('v').split(['.', '~', '-', '+']);
        let major = parts.next()?.parse().ok()?;
        let minor = parts.next()?.parse().ok()?;
        Some((major, minor))
    })
}
