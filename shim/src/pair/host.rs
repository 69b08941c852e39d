//! Everything the supervisor asks of the machine, behind one small trait:
//! every runc call of a pair (create, start or run, kill, ps, delete), the
//! reap of a pid, a signal to a pid, and reads of `/proc` (which slot a
//! pid belongs to, who holds the election lock).
//! [`Machine`] does it with runc, kill(2) and `/proc`; the supervisor's
//! tests use a fake, so the order races of a failover run without root.

use std::future::Future;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::pin::Pin;
use std::sync::Arc;
use std::time::SystemTime;

use async_trait::async_trait;
use nix::sys::signal::Signal;
use nix::unistd::Pid;
use shadow_pair::{FileId, SlotId};
use tokio::time::Instant;

use super::engine::{create_engine, run_engine, EngineSlot, SharedOutput};
use super::listen::ListenSockets;
use super::lock::{self, LockLook};
use super::notify::{close_off_runtime, release_now, Close};
use crate::error::{Error, Result};
use crate::exits::ExitRouter;

/// A reaped engine, as the supervisor sees it: its status and when the
/// reaper collected it, on the supervisor's (tokio's) clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reaped {
    /// Exit code, or 128+signal for a signal death.
    pub status: i32,
    pub at: Instant,
}

/// A future of the reap of one pid (None: the reaper is gone).
pub type ReapFuture = Pin<Box<dyn Future<Output = Option<Reaped>> + Send>>;

/// What the connection side passes a new engine besides the pair's
/// listening sockets: its hand-off ends, which take their place
/// (`shadow.dev/accept: runtime`), and the fd store's copies. Each
/// descriptor is this value's own and is closed once the engine has it.
#[derive(Default)]
pub struct Passed {
    pub ends: Vec<OwnedFd>,
    pub stored: Vec<(String, OwnedFd)>,
}

/// Makes a [`Passed`] for a new engine of a slot (`pair/passing.rs`). The
/// machine asks it only when it runs a new engine, never for the one
/// Create made and Start starts, and asks for the store only when the
/// engine is to be handed it at its start.
#[async_trait]
pub trait Passing: Send + Sync {
    async fn for_start(&self, slot: SlotId, with_store: bool) -> Result<Passed>;
}

#[async_trait]
pub trait Host: Send + Sync + 'static {
    /// Create (not start) the engine of `slot`, at the task's Create: its
    /// pid is the task's until Start, and its first spawn starts it.
    async fn create(&self, slot: SlotId, give: &dyn Passing) -> Result<u32>;
    /// Run the engine of `slot` and return its pid: the created one is
    /// started; otherwise whatever container the slot had is replaced.
    async fn spawn(&self, slot: SlotId, give: &dyn Passing) -> Result<u32>;
    /// Kill the engine created at Create that was never started (a Kill
    /// before Start: it dies of SIGKILL, as a created runc init does).
    async fn end_created(&self, slot: SlotId);
    /// Remove the container of `slot`, whatever state it is in (Delete).
    async fn remove(&self, slot: SlotId);
    /// The pids of the processes in the engine of `slot`.
    async fn ps(&self, slot: SlotId) -> Result<Vec<u32>>;
    /// The reaped exit of `pid`, stamped when the reaper collected it
    /// (also when that happened before this call).
    fn reaped(&self, pid: u32) -> ReapFuture;
    fn signal(&self, pid: u32, signal: Signal);
    /// The slot whose cgroup `pid` is in.
    fn slot_of_pid(&self, pid: u32) -> Option<SlotId>;
    /// Who holds the election lock now, and who waits for it: a read of
    /// `/proc/locks`, which waits out an RCU grace period (see
    /// [`lock::held_by`]), so it is made off the runtime thread.
    async fn lock(&self) -> LockLook;
    /// Whether the process `pid` (or a child of it) is seen holding the
    /// election lock through a descriptor of its own, without a read of
    /// `/proc/locks` (see [`lock::held_by`]); None: this look cannot say.
    fn lock_held_by(&self, _pid: u32) -> Option<bool> {
        None
    }
    /// Processes of the current engine of `slot` that the OOM killer
    /// killed, as its cgroup counts them (a respawn makes a new cgroup).
    fn oom_kills(&self, slot: SlotId) -> u64;
    /// After the main process of `slot`'s engine died: kill what is left
    /// of it when no PID namespace of its own did that already.
    async fn kill_rest(&self, slot: SlotId);
    /// SIGKILL every process of the engine of `slot` now (a hung engine:
    /// every rank of a group, whatever PID namespace it has): its main
    /// process `pid` when known, then its cgroup as a whole. Never waits.
    fn kill_engine(&self, slot: SlotId, pid: Option<u32>);
    /// The pair is gone: close what it listened on, so that clients are
    /// refused rather than queued behind engines that will not come.
    fn close_listen(&self);
}

/// Where the unified cgroup hierarchy is mounted (engine cgroup paths are
/// below it).
const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// SIGKILL to every process of the cgroup at `path` (below
/// [`CGROUP_ROOT`]) at once, by cgroup v2's `cgroup.kill` (Linux 5.14+):
/// the kernel signals them all, so none can fork away in between. The file
/// is the kernel's (no link can stand in a cgroupfs), under a root only the
/// shim writes.
fn kill_cgroup(path: &str) -> std::io::Result<()> {
    let file = std::path::Path::new(CGROUP_ROOT)
        .join(path.trim_start_matches('/'))
        .join("cgroup.kill");
    std::fs::write(file, b"1")
}

/// What runc holds for a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Held {
    /// Nothing yet: the first `runc run` needs no delete before it.
    Nothing,
    /// Created at the task's Create (this pid), not started.
    Created(u32),
    /// A container that ran (or failed to): a respawn deletes it first.
    Ran,
}

/// The real machine: runc for the engines, the shim's exit router, kill(2)
/// and `/proc`.
pub struct Machine {
    /// One per slot, `0 ..= N`.
    engines: Arc<[EngineSlot]>,
    output: Arc<SharedOutput>,
    router: Arc<ExitRouter>,
    lock_file: FileId,
    /// The pair's listening sockets, handed to every engine; closed when
    /// the pair ends.
    listen: std::sync::Mutex<Option<Arc<ListenSockets>>>,
    cgroups: Vec<String>,
    /// What runc holds for each slot: the one record of which engine
    /// Create made and whether a slot ran.
    held: std::sync::Mutex<Vec<Held>>,
    /// The `LISTEN_FDNAMES` each slot's bundle says now (`None`: as Create
    /// wrote it, the listening sockets only).
    inherited: std::sync::Mutex<Vec<Option<Vec<String>>>>,
    /// Each slot's engine spec as Create wrote it, read once (at the first
    /// change of its inherited names) and kept: a respawn rewrites its
    /// `config.json` from memory, never from what is on disk.
    specs: std::sync::Mutex<Vec<Option<serde_json::Value>>>,
}

/// The longest `LISTEN_FDNAMES` an engine is started with: one environment
/// string may be at most 128 KiB (`MAX_ARG_STRLEN`). A store whose names
/// are longer is not handed at the start (the engine fetches it once it
/// holds the lock).
const FDNAMES_MAX: usize = 96 << 10;

impl Machine {
    pub fn new(
        engines: Arc<[EngineSlot]>,
        output: Arc<SharedOutput>,
        router: Arc<ExitRouter>,
        lock_file: FileId,
        listen: Option<ListenSockets>,
    ) -> Self {
        let cgroups: Vec<String> = engines.iter().map(|e| e.cgroup.clone()).collect();
        let held = vec![Held::Nothing; engines.len()];
        let engines_len = engines.len();
        Machine {
            engines,
            output,
            router,
            lock_file,
            listen: std::sync::Mutex::new(listen.map(Arc::new)),
            cgroups,
            held: std::sync::Mutex::new(held),
            inherited: std::sync::Mutex::new(vec![None; engines_len]),
            specs: std::sync::Mutex::new(vec![None; engines_len]),
        }
    }

    /// Whether `slot`'s engine is handed the fd store at its start: not
    /// when it shares a PID namespace (it is then no `LISTEN_PID=1`: it
    /// fetches instead).
    fn takes_store_at_start(&self, slot: SlotId) -> bool {
        !self.engines[slot.index()].kills_rest_on_exit
    }

    /// The store's copies `stored` for the start of `slot`'s engine, with
    /// its bundle's `LISTEN_FDS`/`LISTEN_FDNAMES` made to say them; none
    /// (closed here) when the names are too long for one environment
    /// string or the bundle cannot be written.
    fn stored_for_start(
        &self,
        slot: SlotId,
        listen: Option<&ListenSockets>,
        mut stored: Vec<(String, OwnedFd)>,
    ) -> Vec<(String, OwnedFd)> {
        let e = &self.engines[slot.index()];
        let mut names: Vec<String> = listen.map(|l| l.names().to_vec()).unwrap_or_default();
        let listen_only = names.clone();
        names.extend(stored.iter().map(|(n, _)| n.clone()));
        if names.iter().map(|n| n.len() + 1).sum::<usize>() > FDNAMES_MAX {
            log::warn!(
                "{}: the fd store's {} names are too long for LISTEN_FDNAMES: not handed at the start (the engine fetches them once it holds the lock)",
                e.runc_id,
                stored.len()
            );
            release_now(stored.drain(..).map(|(_, fd)| fd).collect());
            names = listen_only.clone();
        }
        let mut inherited = self.inherited.lock().unwrap_or_else(|p| p.into_inner());
        let now = inherited[slot.index()].clone().unwrap_or(listen_only);
        if now != names {
            let mut specs = self.specs.lock().unwrap_or_else(|p| p.into_inner());
            let spec = match specs[slot.index()].take() {
                Some(spec) => Ok(spec),
                None => read_spec(&e.bundle),
            };
            let written = spec.and_then(|spec| {
                let done = write_inherited(&e.bundle, &spec, &names);
                specs[slot.index()] = Some(spec);
                done
            });
            if let Err(err) = written {
                log::warn!(
                    "{}: the fd store is not handed at the start: {err}",
                    e.runc_id
                );
                release_now(stored.drain(..).map(|(_, fd)| fd).collect());
                return stored;
            }
            inherited[slot.index()] = Some(names);
        }
        stored
    }

    fn held(&self) -> std::sync::MutexGuard<'_, Vec<Held>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn listen(&self) -> Option<Arc<ListenSockets>> {
        self.listen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// An engine's descriptors 3..: its hand-off sockets when it has them,
/// else the pair's listening sockets themselves.
fn inherited_first<'a>(
    ends: &'a [OwnedFd],
    listen: Option<&'a ListenSockets>,
) -> Vec<BorrowedFd<'a>> {
    if ends.is_empty() {
        listen.map(ListenSockets::fds).unwrap_or_default()
    } else {
        ends.iter().map(AsFd::as_fd).collect()
    }
}

/// The engine spec Create wrote in `bundle`.
fn read_spec(bundle: &std::path::Path) -> Result<serde_json::Value> {
    let path = bundle.join("config.json");
    let text =
        std::fs::read(&path).map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
    serde_json::from_slice(&text).map_err(|e| Error::Internal {
        what: format!("engine spec {}", path.display()),
        reason: e.to_string(),
    })
}

/// Writes the bundle's `config.json` as `spec` (the one Create wrote,
/// from memory) giving its engine `names` in `LISTEN_FDS`/`LISTEN_FDNAMES`
/// (written whole, then renamed).
fn write_inherited(
    bundle: &std::path::Path,
    spec: &serde_json::Value,
    names: &[String],
) -> Result<()> {
    let path = bundle.join("config.json");
    let spec = super::spec::with_inherited(spec, names)?;
    let bytes = serde_json::to_vec(&spec).map_err(|e| Error::Internal {
        what: format!("engine spec {}", path.display()),
        reason: e.to_string(),
    })?;
    let tmp = bundle.join("config.json.new");
    std::fs::write(&tmp, bytes).map_err(|e| Error::io(format!("writing {}", tmp.display()), e))?;
    std::fs::rename(&tmp, &path).map_err(|e| Error::io(format!("renaming {}", tmp.display()), e))
}

/// The supervisor's instant of a reaper's wall-clock stamp, measured back
/// from now so that a clock step since does not shift it.
fn instant_of(at: SystemTime) -> Instant {
    let ago = SystemTime::now().duration_since(at).unwrap_or_default();
    let now = Instant::now();
    now.checked_sub(ago).unwrap_or(now)
}

#[async_trait]
impl Host for Machine {
    /// An engine that cannot run (a missing binary) fails Create; what a
    /// failed create left is removed.
    async fn create(&self, slot: SlotId, give: &dyn Passing) -> Result<u32> {
        let e = &self.engines[slot.index()];
        let listen = self.listen();
        let ends = give.for_start(slot, false).await?.ends;
        let fds = inherited_first(&ends, listen.as_deref());
        let created = create_engine(e, self.output.clone(), &fds).await;
        drop(fds);
        close_off_runtime(ends, Close::Release).await;
        match created {
            Ok(pid) => {
                self.held()[slot.index()] = Held::Created(pid);
                Ok(pid)
            }
            Err(err) => {
                if let Err(d) = e.client.delete_force(&e.runc_id).await {
                    log::warn!("{}: removing the failed create: {d}", e.runc_id);
                }
                Err(err)
            }
        }
    }

    async fn spawn(&self, slot: SlotId, give: &dyn Passing) -> Result<u32> {
        let held = std::mem::replace(&mut self.held()[slot.index()], Held::Ran);
        let e = &self.engines[slot.index()];
        if let Held::Created(pid) = held {
            e.client.start(&e.runc_id).await?;
            return Ok(pid);
        }
        let listen = self.listen();
        if let Some(l) = &listen {
            l.repair();
        }
        let fresh = held == Held::Nothing;
        let Passed { ends, stored } = give
            .for_start(slot, self.takes_store_at_start(slot))
            .await?;
        let stored = self.stored_for_start(slot, listen.as_deref(), stored);
        let fds = inherited_first(&ends, listen.as_deref());
        let started = run_engine(e, self.output.clone(), fresh, &fds, &stored).await;
        drop(fds);
        // Our copies: the engine has its own (or never started).
        let mut ours: Vec<OwnedFd> = stored.into_iter().map(|(_, fd)| fd).collect();
        ours.extend(ends);
        close_off_runtime(ours, Close::Release).await;
        started
    }

    async fn end_created(&self, slot: SlotId) {
        if !matches!(self.held()[slot.index()], Held::Created(_)) {
            return;
        }
        let e = &self.engines[slot.index()];
        if let Err(err) = e.client.kill(&e.runc_id, libc::SIGKILL as u32, false).await {
            log::warn!("{}: killing the created engine: {err}", e.runc_id);
        }
    }

    async fn remove(&self, slot: SlotId) {
        let e = &self.engines[slot.index()];
        if let Err(err) = e.client.delete_force(&e.runc_id).await {
            log::warn!("{}: {err}", e.runc_id);
        }
        self.held()[slot.index()] = Held::Nothing;
    }

    async fn ps(&self, slot: SlotId) -> Result<Vec<u32>> {
        let e = &self.engines[slot.index()];
        e.client.ps(&e.runc_id).await
    }

    fn reaped(&self, pid: u32) -> ReapFuture {
        let exit = self.router.watch(pid as i32);
        Box::pin(async move {
            exit.await.ok().map(|e| Reaped {
                status: e.status,
                at: instant_of(e.at),
            })
        })
    }

    fn signal(&self, pid: u32, signal: Signal) {
        if let Ok(pid) = i32::try_from(pid) {
            if pid > 0 {
                let _ = nix::sys::signal::kill(Pid::from_raw(pid), signal);
            }
        }
    }

    fn slot_of_pid(&self, pid: u32) -> Option<SlotId> {
        lock::slot_of_pid(pid, &self.cgroups)
    }

    async fn lock(&self) -> LockLook {
        let (file, cgroups) = (self.lock_file, self.cgroups.clone());
        tokio::task::spawn_blocking(move || lock::observe(file, &cgroups))
            .await
            .unwrap_or(LockLook::UNKNOWN)
    }

    fn lock_held_by(&self, pid: u32) -> Option<bool> {
        lock::held_by(pid, self.lock_file)
    }

    async fn kill_rest(&self, slot: SlotId) {
        let e = &self.engines[slot.index()];
        if !e.kills_rest_on_exit {
            return;
        }
        if let Err(err) = e.client.kill(&e.runc_id, libc::SIGKILL as u32, true).await {
            log::warn!("{}: killing what its main process left: {err}", e.runc_id);
        }
    }

    fn kill_engine(&self, slot: SlotId, pid: Option<u32>) {
        if let Some(pid) = pid {
            self.signal(pid, Signal::SIGKILL);
        }
        let path = &self.cgroups[slot.index()];
        match kill_cgroup(path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && pid.is_none() => {}
            Err(e) => {
                // cgroup v1, an older kernel, or the cgroup already gone:
                // runc signals what it finds, off the supervisor's task.
                let engines = self.engines.clone();
                let path = path.clone();
                tokio::spawn(async move {
                    let en = &engines[slot.index()];
                    if let Err(err) = en
                        .client
                        .kill(&en.runc_id, libc::SIGKILL as u32, true)
                        .await
                    {
                        log::debug!(
                            "{}: runc kill --all after cgroup.kill of {path} failed ({e}): {err}",
                            en.runc_id
                        );
                    }
                });
            }
        }
    }

    fn oom_kills(&self, slot: SlotId) -> u64 {
        crate::oom::kills(&crate::stats::at(&self.cgroups[slot.index()]))
    }

    fn close_listen(&self) {
        drop(self.listen.lock().unwrap_or_else(|p| p.into_inner()).take());
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_respawns_spec_is_written_from_memory_not_from_disk() {
        let dir = tempfile::tempdir().expect("temp dir");
        let spec = serde_json::json!({
            "process": {"env": ["PATH=/bin", "LISTEN_FDS=1", "LISTEN_FDNAMES=old"]}
        });
        std::fs::write(dir.path().join("config.json"), spec.to_string()).expect("write");
        let kept = read_spec(dir.path()).expect("read");
        // Whatever is on disk now is never read again.
        std::fs::write(dir.path().join("config.json"), b"not json").expect("write");
        let names = vec!["http".to_string(), "accepted.0.7".to_string()];
        write_inherited(dir.path(), &kept, &names).expect("rewrite");
        let now = read_spec(dir.path()).expect("valid again");
        let env: Vec<&str> = now["process"]["env"]
            .as_array()
            .expect("env")
            .iter()
            .filter_map(|v| v.as_str())
            .collect();
        assert!(env.contains(&"PATH=/bin"), "{env:?}");
        assert!(env.contains(&"LISTEN_FDNAMES=http:accepted.0.7"), "{env:?}");
        assert!(!env.iter().any(|e| e.ends_with("=old")), "{env:?}");
    }

    use super::*;

    /// A real cgroup with a process in it: `kill_cgroup` ends it, and says
    /// so for a cgroup that does not exist.
    #[test]
    #[ignore = "needs root: `make test` runs it (--include-ignored)"]
    fn kill_cgroup_ends_every_process_of_a_real_cgroup() {
        assert!(
            nix::unistd::geteuid().is_root(),
            "this test makes a real cgroup: run it as root"
        );
        let rel = format!("shadow-unit-kill-{}", std::process::id());
        let dir = std::path::Path::new(CGROUP_ROOT).join(&rel);
        if !std::path::Path::new(CGROUP_ROOT)
            .join("cgroup.controllers")
            .exists()
        {
            eprintln!("skipped: no cgroup v2 at {CGROUP_ROOT}");
            return;
        }
        /// Whatever happens, the test's processes and cgroup go.
        struct Guard(std::path::PathBuf, Vec<std::process::Child>);
        impl Drop for Guard {
            fn drop(&mut self) {
                for c in &mut self.1 {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                let _ = std::fs::remove_dir(&self.0);
            }
        }
        std::fs::create_dir(&dir).expect("mkdir cgroup");
        let mut guard = Guard(dir.clone(), Vec::new());
        for _ in 0..3 {
            let c = std::process::Command::new("sleep")
                .arg("1000")
                .spawn()
                .expect("sleep");
            guard.1.push(c);
        }
        let children = &mut guard.1;
        for c in children.iter() {
            std::fs::write(dir.join("cgroup.procs"), c.id().to_string()).expect("join cgroup");
        }
        kill_cgroup(&format!("/{rel}")).expect("cgroup.kill");
        use std::os::unix::process::ExitStatusExt;
        for c in children.iter_mut() {
            // Bounded: a kill that missed fails here rather than hang.
            let status = shadow_wait::until(
                "a process of the cgroup to end",
                std::time::Duration::from_secs(5),
                std::time::Duration::from_millis(2),
                || c.try_wait().ok().flatten(),
            );
            assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}");
        }
        // Empty now: it can go.
        shadow_wait::until(
            "the emptied cgroup removed",
            std::time::Duration::from_secs(5),
            std::time::Duration::from_millis(5),
            || std::fs::remove_dir(&dir).ok(),
        );
        let gone = kill_cgroup(&format!("/{rel}")).unwrap_err();
        assert_eq!(gone.kind(), std::io::ErrorKind::NotFound);
    }
}
