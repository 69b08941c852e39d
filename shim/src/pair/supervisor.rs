//! The pair's one supervising task. It owns the `shadow_pair::Pair`, feeds
//! it what the shim observes — spawns, reaped exits, notify datagrams, the
//! lock holder, backoff timers, Kill — and carries out the actions it
//! returns with runc and signals. Nothing else changes a pair's state, so
//! events are handled in the order they were observed, and the task's end
//! (the pair's exit) publishes exactly one TaskExit.

use std::collections::VecDeque;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use containerd_shim_protos::events::task::TaskExit;
use nix::sys::signal::Signal;
use nix::unistd::Pid;
use runc::options::{CreateOpts, DeleteOpts};
use shadow_contract::state::PairState;
use shadow_pair::{
    parse_notify, Action, EngineState, Event as PairEvent, Exit, FileId, Notification, Pair,
    Promotion, SlotId,
};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use super::config::PairConfig;
use super::gms::GmsDaemon;
use super::lock;
use super::notify::{Datagram, NotifySocket};
use crate::container::ExitInfo;
use crate::error::{Error, Result};
use crate::events::{Event, EventSink};
use crate::exits::ExitRouter;
use crate::runc::RuncClient;
use crate::service::timestamp;

/// How long the pair's exit waits for the engines' output to reach the FIFOs.
const OUTPUT_DRAIN: Duration = Duration::from_secs(1);

/// One slot's runc container.
#[derive(Debug)]
pub struct EngineSlot {
    pub runc_id: String,
    pub bundle: PathBuf,
    pub client: RuncClient,
    /// The engine's cgroup path (`<pair cgroup>/s<slot>`).
    pub cgroup: String,
}

/// The write ends of the task's stdout/stderr pipes, handed to every engine
/// spawn (stdin is /dev/null: no engine owns the task's input). Closed when
/// the pair ends, so that the copiers see EOF.
#[derive(Debug, Default)]
pub struct SharedOutput {
    fds: Mutex<[Option<OwnedFd>; 2]>,
}

impl SharedOutput {
    pub fn new(stdout: Option<OwnedFd>, stderr: Option<OwnedFd>) -> Self {
        SharedOutput {
            fds: Mutex::new([stdout, stderr]),
        }
    }

    pub fn close(&self) {
        let mut fds = self.fds.lock().unwrap_or_else(|p| p.into_inner());
        *fds = [None, None];
    }
}

#[async_trait]
impl runc::io::Io for SharedOutput {
    async fn set(&self, cmd: &mut runc::Command) -> std::io::Result<()> {
        let fds = self.fds.lock().unwrap_or_else(|p| p.into_inner());
        let pick = |fd: &Option<OwnedFd>| -> std::io::Result<std::process::Stdio> {
            Ok(match fd {
                Some(fd) => std::process::Stdio::from(fd.try_clone()?),
                None => std::process::Stdio::null(),
            })
        };
        cmd.stdin(std::process::Stdio::null());
        cmd.stdout(pick(&fds[0])?);
        cmd.stderr(pick(&fds[1])?);
        Ok(())
    }

    async fn close_after_start(&self) {
        // Kept for the next respawn; `close` drops them at the pair's end.
    }
}

/// Start one engine: `runc run --detach` of the slot's bundle. A previous
/// generation's stopped container of the same id is removed first.
pub async fn run_engine(e: &EngineSlot, output: Arc<SharedOutput>, fresh: bool) -> Result<u32> {
    if !fresh {
        let force = DeleteOpts::new().force(true);
        let _ = e.client.runc.delete(&e.runc_id, Some(&force)).await;
    }
    let pid_file = e.bundle.join("init.pid");
    let _ = std::fs::remove_file(&pid_file);
    let opts = CreateOpts::new()
        .pid_file(&pid_file)
        .detach(true)
        .io(output);
    e.client
        .runc
        .run(&e.runc_id, &e.bundle, Some(&opts))
        .await
        .map_err(|err| e.client.error("run", &e.runc_id, err))?;
    let text = std::fs::read_to_string(&pid_file)
        .map_err(|err| Error::io(format!("reading pid file {}", pid_file.display()), err))?;
    text.trim().parse().map_err(|_| Error::Decode {
        what: "runc pid file",
        reason: format!("{}: {text:?} is not a pid", pid_file.display()),
    })
}

/// What the Task service reads about a pair, republished on every change.
#[derive(Debug, Clone, Default)]
pub struct View {
    pub started: bool,
    /// `Pair::representative_pid`, or the last one once the pair is gone.
    pub pid: u32,
    pub pids: [Option<u32>; 2],
    pub active: Option<SlotId>,
    pub exit: Option<ExitInfo>,
}

/// What the supervisor is told.
#[derive(Debug)]
pub enum Input {
    Spawned {
        slot: SlotId,
        generation: u32,
        result: std::result::Result<u32, String>,
    },
    Exited {
        slot: SlotId,
        pid: u32,
        status: i32,
        at: Instant,
    },
    Notify(Datagram, Instant),
    Backoff {
        slot: SlotId,
    },
    Kill {
        signal: u32,
    },
    Escalate,
    GmsDied {
        generation: u64,
    },
    /// An XID on one of the pair's GPUs (kernel log).
    Xid(u32),
}

/// One promotion as `state.json` keeps it (the schema is the contract's).
pub use shadow_contract::state::PromotionRecord;

/// How long a READY=1 waits for the reap of the engine it replaces.
const DEFER_LIMIT: Duration = Duration::from_millis(500);

pub struct Supervisor {
    pub pair: Pair,
    pub id: String,
    pub namespace: String,
    pub config: PairConfig,
    pub engines: Arc<[EngineSlot; 2]>,
    pub output: Arc<SharedOutput>,
    pub copiers: Vec<JoinHandle<()>>,
    pub router: Arc<ExitRouter>,
    pub events: EventSink,
    pub view: watch::Sender<View>,
    pub lock_file: FileId,
    pub notify: Option<NotifySocket>,
    pub state_json: PathBuf,
    pub metrics_dir: PathBuf,
    pub metrics_name: String,
    pub gms: Option<GmsDaemon>,
    gpus: Vec<String>,
    /// Ends the XID watcher thread with the pair.
    xid_stop: Arc<std::sync::atomic::AtomicBool>,
    pub tx: mpsc::UnboundedSender<Input>,
    pub rx: mpsc::UnboundedReceiver<Input>,
    clock: Instant,
    epoch: SystemTime,
    cgroups: [String; 2],
    /// A spawn in flight when KillAll ran: kill it as soon as it appears.
    kill_on_spawn: [Option<u32>; 2],
    /// Slots spawned at least once (a respawn must remove the old container).
    spawned_once: [bool; 2],
    stop_signal: Option<u32>,
    /// Datagrams from an engine that spoke before its spawn was reported
    /// (runc returns after the engine already runs): replayed on Spawned.
    early: [Vec<(Datagram, Instant)>; 2],
    /// Datagrams of a new active that arrived before the reap of the old
    /// one (the kernel hands the lock over without the shim): replayed
    /// right after that exit, so the promotion is recorded against it.
    deferred: Vec<(SlotId, Datagram, Instant)>,
    promotions: VecDeque<PromotionRecord>,
    last_pid: u32,
    last_written: String,
}

/// The parts a Supervisor is made of, gathered by Create.
pub struct Parts {
    pub id: String,
    pub namespace: String,
    pub config: PairConfig,
    pub engines: Arc<[EngineSlot; 2]>,
    pub output: Arc<SharedOutput>,
    pub copiers: Vec<JoinHandle<()>>,
    pub router: Arc<ExitRouter>,
    pub events: EventSink,
    pub view: watch::Sender<View>,
    pub lock_file: FileId,
    pub notify: NotifySocket,
    pub state_json: PathBuf,
    pub metrics_dir: PathBuf,
    pub gms: Option<GmsDaemon>,
    /// The spec's NVIDIA GPUs (UUIDs or indices): their XIDs are watched.
    pub gpus: Vec<String>,
    /// One engine, restarted in place, no shadow.
    pub single: bool,
}

fn unix_us(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).unwrap_or_default().as_micros() as u64
}

fn exit_of(status: i32) -> Exit {
    // The reaper reports 128+signal for a signal death, as a shell does.
    if status > 128 && status < 128 + 65 {
        Exit::Signal(status - 128)
    } else {
        Exit::Code(status)
    }
}

/// Running (not a zombie, not gone), from `/proc/<pid>/stat`.
fn process_alive(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // "pid (comm) S ...": the state follows the last ')'.
    stat.rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .is_some_and(|state| state != "Z" && state != "X")
}

fn signal(pid: u32, sig: Signal) {
    if pid > 0 {
        let _ = nix::sys::signal::kill(Pid::from_raw(pid as i32), sig);
    }
}

impl Supervisor {
    pub fn new(p: Parts) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        let cgroups = [p.engines[0].cgroup.clone(), p.engines[1].cgroup.clone()];
        Supervisor {
            pair: if p.single {
                Pair::single(p.config.restart.clone())
            } else {
                Pair::new(p.config.restart.clone())
            },
            metrics_name: format!("shadow-{}-{}.prom", p.namespace, p.id),
            id: p.id,
            namespace: p.namespace,
            config: p.config,
            engines: p.engines,
            output: p.output,
            copiers: p.copiers,
            router: p.router,
            events: p.events,
            view: p.view,
            lock_file: p.lock_file,
            notify: Some(p.notify),
            state_json: p.state_json,
            metrics_dir: p.metrics_dir,
            gms: p.gms,
            gpus: p.gpus,
            xid_stop: Arc::new(std::sync::atomic::AtomicBool::new(false)),
            tx,
            rx,
            clock: Instant::now(),
            epoch: SystemTime::now(),
            cgroups,
            kill_on_spawn: [None, None],
            spawned_once: [false, false],
            stop_signal: None,
            early: [Vec::new(), Vec::new()],
            deferred: Vec::new(),
            promotions: VecDeque::new(),
            last_pid: 0,
            last_written: String::new(),
        }
    }

    fn now(&self) -> Duration {
        self.clock.elapsed()
    }

    fn since(&self, at: Instant) -> Duration {
        at.saturating_duration_since(self.clock)
    }

    fn wall(&self, d: Duration) -> u64 {
        unix_us(self.epoch + d)
    }

    /// Start both engines inline (Start waits for them), so that a spec
    /// that cannot run fails Start with runc's own error.
    pub async fn start_engines(&mut self) -> Result<u32> {
        for action in self.pair.start() {
            let Action::Spawn { slot } = action else {
                continue;
            };
            let generation = self.pair.slot(slot).generation;
            match run_engine(&self.engines[slot.index()], self.output.clone(), true).await {
                Ok(pid) => {
                    self.spawned_once[slot.index()] = true;
                    self.on_spawned(slot, generation, Ok(pid));
                }
                Err(e) => {
                    self.spawned_once[slot.index()] = true;
                    for s in SlotId::BOTH {
                        if let Some(pid) = self.pair.slot(s).pid {
                            signal(pid, Signal::SIGKILL);
                        }
                    }
                    return Err(e);
                }
            }
        }
        self.publish(true);
        Ok(self.last_pid)
    }

    /// Run until the pair is gone; hands back the GMS daemon for Delete.
    pub async fn run_to_end(mut self) -> Option<GmsDaemon> {
        self.run().await;
        self.xid_stop
            .store(true, std::sync::atomic::Ordering::Relaxed);
        self.gms.take()
    }

    async fn run(&mut self) {
        if let Some(sock) = self.notify.take() {
            let tx = self.tx.clone();
            tokio::spawn(async move {
                loop {
                    match sock.recv().await {
                        Ok(d) => {
                            if tx.send(Input::Notify(d, Instant::now())).is_err() {
                                return;
                            }
                        }
                        Err(e) => {
                            log::warn!("notify socket: {e}");
                            return;
                        }
                    }
                }
            });
        }
        if let Some(g) = &self.gms {
            g.watch(self.router.clone(), self.tx.clone());
        }
        if !self.gpus.is_empty() {
            let buses =
                super::xid::gpu_buses(std::path::Path::new("/proc/driver/nvidia/gpus"), &self.gpus);
            log::info!("pair {}: watching XIDs of GPUs {buses:?}", self.id);
            let tx = self.tx.clone();
            super::xid::watch(buses, self.xid_stop.clone(), move |xid| {
                let _ = tx.send(Input::Xid(xid));
            });
        }
        loop {
            let fast = self.pair.active().is_none()
                || self
                    .pair
                    .slot(self.pair.active().unwrap_or(SlotId::ZERO))
                    .state
                    != EngineState::Active;
            let period = Duration::from_millis(if fast {
                self.config.lock_poll_fast_ms
            } else {
                self.config.lock_poll_idle_ms
            });
            let input = tokio::select! {
                i = self.rx.recv() => i,
                _ = tokio::time::sleep(period) => None,
            };
            let actions = match input {
                Some(i) => self.on_input(i).await,
                None => {
                    let mut actions = self.flush_stale_deferred();
                    actions.extend(self.poll_lock());
                    actions
                }
            };
            if self.carry_out(actions).await {
                return;
            }
            self.publish(false);
        }
    }

    /// The recorded active engine (another slot than `slot`) is already
    /// dead, its exit not yet processed.
    fn old_active_dead(&self, slot: SlotId) -> bool {
        match self.pair.active() {
            Some(a) if a != slot => self.pair.slot(a).pid.is_some_and(|p| !process_alive(p)),
            _ => false,
        }
    }

    fn poll_lock(&mut self) -> Vec<Action> {
        match lock::holder(self.lock_file, &self.cgroups) {
            Some(slot) if self.pair.active() != Some(slot) && !self.old_active_dead(slot) => {
                let now = self.now();
                self.pair.handle(PairEvent::LockHeld { slot }, now)
            }
            _ => Vec::new(),
        }
    }

    fn on_spawned(
        &mut self,
        slot: SlotId,
        generation: u32,
        result: std::result::Result<u32, String>,
    ) -> Vec<Action> {
        let current = self.pair.slot(slot);
        let ours = current.generation == generation && current.state == EngineState::Spawning;
        match result {
            Ok(pid) => {
                if !ours {
                    log::warn!(
                        "pair {}: stale engine pid {pid} of slot {slot}: killing it",
                        self.id
                    );
                    signal(pid, Signal::SIGKILL);
                    return Vec::new();
                }
                let mut actions = self
                    .pair
                    .handle(PairEvent::Spawned { slot, pid }, self.now());
                for (d, at) in std::mem::take(&mut self.early[slot.index()]) {
                    actions.extend(self.notified(slot, &d, at));
                }
                let exit = self.router.watch(pid as i32);
                let tx = self.tx.clone();
                tokio::spawn(async move {
                    if let Ok(e) = exit.await {
                        let _ = tx.send(Input::Exited {
                            slot,
                            pid,
                            status: e.status,
                            at: Instant::now(),
                        });
                    }
                });
                if self.kill_on_spawn[slot.index()] == Some(generation) || self.pair.is_ending() {
                    signal(pid, Signal::SIGKILL);
                }
                log::info!(
                    "pair {}: slot {slot} generation {generation} runs as pid {pid}",
                    self.id
                );
                actions
            }
            Err(e) => {
                log::warn!("pair {}: spawning slot {slot}: {e}", self.id);
                if ours {
                    self.pair
                        .handle(PairEvent::SpawnFailed { slot }, self.now())
                } else {
                    Vec::new()
                }
            }
        }
    }

    async fn on_input(&mut self, input: Input) -> Vec<Action> {
        match input {
            Input::Spawned {
                slot,
                generation,
                result,
            } => self.on_spawned(slot, generation, result),
            Input::Exited {
                slot,
                pid,
                status,
                at,
            } => {
                if self.pair.slot(slot).pid != Some(pid) {
                    return Vec::new();
                }
                let exit = exit_of(status);
                log::info!("pair {}: slot {slot} pid {pid} exited ({exit:?})", self.id);
                let now = self.since(at);
                let mut actions = self.pair.handle(PairEvent::Exited { slot, exit }, now);
                for (s, d, at) in std::mem::take(&mut self.deferred) {
                    actions.extend(self.notified(s, &d, at));
                }
                actions
            }
            Input::Notify(d, at) => {
                let Some(slot) = lock::slot_of_pid(d.pid, &self.cgroups) else {
                    log::debug!("pair {}: notify from pid {} of no engine", self.id, d.pid);
                    return Vec::new();
                };
                if self.pair.slot(slot).state == EngineState::Spawning {
                    // runc returned after the engine already ran and spoke:
                    // keep it for the Spawned report of this generation.
                    self.early[slot.index()].push((d, at));
                    return Vec::new();
                }
                let says_ready = parse_notify(&d.bytes).contains(&Notification::Ready);
                let other_active = self.pair.active().filter(|a| *a != slot);
                if says_ready && other_active.is_some() {
                    // The kernel handed the lock over before the shim reaped
                    // the old active: record the promotion against that
                    // reap, which is imminent (bounded by the flush below).
                    self.deferred.push((slot, d, at));
                    return Vec::new();
                }
                self.notified(slot, &d, at)
            }
            Input::Backoff { slot } => self
                .pair
                .handle(PairEvent::BackoffElapsed { slot }, self.now()),
            Input::Kill { signal: sig } => {
                if self.stop_signal.is_none() {
                    self.stop_signal = Some(sig);
                    let s = Signal::try_from(sig as i32).unwrap_or(Signal::SIGKILL);
                    for slot in SlotId::BOTH {
                        if let Some(pid) = self.pair.slot(slot).pid {
                            signal(pid, s);
                        }
                    }
                    if s != Signal::SIGKILL {
                        let tx = self.tx.clone();
                        let grace = self.config.stop_grace();
                        tokio::spawn(async move {
                            tokio::time::sleep(grace).await;
                            let _ = tx.send(Input::Escalate);
                        });
                    }
                }
                self.pair.handle(PairEvent::Stop, self.now())
            }
            Input::Escalate => {
                self.kill_all(Signal::SIGKILL);
                Vec::new()
            }
            Input::Xid(xid) => {
                log::warn!(
                    "pair {}: XID {xid} on a GPU of the pair ({:?})",
                    self.id,
                    shadow_pair::XidClass::of(xid)
                );
                self.pair.handle(PairEvent::Xid(xid), self.now())
            }
            Input::GmsDied { generation } => {
                if self.gms.as_ref().map(GmsDaemon::generation) != Some(generation) {
                    return Vec::new();
                }
                log::warn!("pair {}: gmsd died: cold restart of the pair", self.id);
                self.pair.handle(PairEvent::GmsDied, self.now())
            }
        }
    }

    /// A deferred READY=1 whose old active has not exited within
    /// `DEFER_LIMIT` (an engine that released the lock without dying) is
    /// applied anyway: the lock says who serves.
    fn flush_stale_deferred(&mut self) -> Vec<Action> {
        if self.deferred.is_empty() {
            return Vec::new();
        }
        let (stale, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut self.deferred)
            .into_iter()
            .partition(|(_, _, at)| at.elapsed() >= DEFER_LIMIT);
        self.deferred = keep;
        let mut actions = Vec::new();
        for (slot, d, at) in stale {
            log::warn!(
                "pair {}: slot {slot} said READY=1 while the recorded active had not exited                  after {} ms; taking it as active",
                self.id,
                DEFER_LIMIT.as_millis()
            );
            actions.extend(self.notified(slot, &d, at));
        }
        actions
    }

    fn notified(&mut self, slot: SlotId, d: &Datagram, at: Instant) -> Vec<Action> {
        let now = self.since(at);
        let mut actions = Vec::new();
        for notification in parse_notify(&d.bytes) {
            actions.extend(
                self.pair
                    .handle(PairEvent::Notified { slot, notification }, now),
            );
        }
        actions
    }

    fn kill_all(&mut self, sig: Signal) {
        for slot in SlotId::BOTH {
            let s = self.pair.slot(slot);
            if let Some(pid) = s.pid {
                signal(pid, sig);
            } else if s.state == EngineState::Spawning {
                self.kill_on_spawn[slot.index()] = Some(s.generation);
            }
        }
    }

    /// Carries out actions (and those they lead to); true once the pair is gone.
    async fn carry_out(&mut self, actions: Vec<Action>) -> bool {
        let mut queue: VecDeque<Action> = actions.into();
        while let Some(action) = queue.pop_front() {
            match action {
                Action::Spawn { slot } => {
                    self.early[slot.index()].clear();
                    let generation = self.pair.slot(slot).generation;
                    let fresh = !self.spawned_once[slot.index()];
                    self.spawned_once[slot.index()] = true;
                    let engines = self.engines.clone();
                    let output = self.output.clone();
                    let tx = self.tx.clone();
                    tokio::spawn(async move {
                        let result = run_engine(&engines[slot.index()], output, fresh)
                            .await
                            .map_err(|e| e.to_string());
                        let _ = tx.send(Input::Spawned {
                            slot,
                            generation,
                            result,
                        });
                    });
                }
                Action::SpawnAfter { slot, delay } => {
                    log::info!(
                        "pair {}: slot {slot} respawns in {} ms",
                        self.id,
                        delay.as_millis()
                    );
                    let tx = self.tx.clone();
                    tokio::spawn(async move {
                        tokio::time::sleep(delay).await;
                        let _ = tx.send(Input::Backoff { slot });
                    });
                }
                Action::KillAll => {
                    let sig = match self.stop_signal {
                        Some(s) if self.pair.is_ending() => {
                            Signal::try_from(s as i32).unwrap_or(Signal::SIGKILL)
                        }
                        _ => Signal::SIGKILL,
                    };
                    self.kill_all(sig);
                }
                Action::RestartGms => {
                    if let Some(g) = self.gms.as_mut() {
                        match g.restart().await {
                            Ok(()) => g.watch(self.router.clone(), self.tx.clone()),
                            Err(e) => {
                                // The engines will find no socket and fail
                                // early: the restart budget ends the pair.
                                log::error!("pair {}: restarting gmsd: {e}", self.id);
                            }
                        }
                    }
                }
                Action::Promoted(p) => self.record(p),
                Action::Exit { status } => {
                    self.finish(status).await;
                    return true;
                }
            }
        }
        false
    }

    fn record(&mut self, p: Promotion) {
        let ms = |d: Option<Duration>| {
            d.map(|d| format!("{:.3}", d.saturating_sub(p.reaped_at).as_secs_f64() * 1e3))
                .unwrap_or_else(|| "-".into())
        };
        log::info!(
            "pair {}: promotion {} slot {} -> {}: reaped → lock {} ms, reaped → ready {} ms ({:?}, {:?})",
            self.id,
            p.number,
            p.from,
            p.to.map(|s| s.to_string()).unwrap_or_else(|| "-".into()),
            ms(p.lock_at),
            ms(p.ready_at),
            p.exit,
            p.class
        );
        let rec = PromotionRecord {
            reaped_unix_us: self.wall(p.reaped_at),
            lock_unix_us: p.lock_at.map(|d| self.wall(d)),
            ready_unix_us: p.ready_at.map(|d| self.wall(d)),
            total_ms: p.total().map(|d| d.as_secs_f64() * 1e3),
            promotion: super::state_file::promotion(&p),
        };
        self.promotions.push_back(rec);
        while self.promotions.len() > self.config.promotions_kept.max(1) {
            self.promotions.pop_front();
        }
    }

    async fn finish(&mut self, status: u32) {
        self.output.close();
        let copiers = std::mem::take(&mut self.copiers);
        let _ = tokio::time::timeout(OUTPUT_DRAIN, async {
            for c in copiers {
                let _ = c.await;
            }
        })
        .await;
        let info = ExitInfo {
            pid: self.last_pid,
            status,
            at: SystemTime::now(),
        };
        log::info!("pair {}: gone, exit status {status}", self.id);
        self.events.send(Event::Exit(TaskExit {
            container_id: self.id.clone(),
            id: self.id.clone(),
            pid: info.pid,
            exit_status: info.status,
            exited_at: Some(timestamp(info.at)).into(),
            ..Default::default()
        }));
        self.publish(true);
        self.view.send_modify(|v| v.exit = Some(info));
    }

    /// Republish the view, and rewrite `state.json` and the metrics file
    /// when the pair changed (or when `force`d).
    fn publish(&mut self, force: bool) {
        if let Some(pid) = self.pair.representative_pid() {
            self.last_pid = pid;
        }
        let pids = [
            self.pair.slot(SlotId::ZERO).pid,
            self.pair.slot(SlotId::ONE).pid,
        ];
        let active = self.pair.active();
        let last_pid = self.last_pid;
        self.view.send_if_modified(|v| {
            let changed = v.pid != last_pid || v.pids != pids || v.active != active || !v.started;
            v.pid = last_pid;
            v.pids = pids;
            v.active = active;
            v.started = true;
            changed
        });
        let snap = self.pair.snapshot();
        let gms_status = self.gms.as_ref().and_then(GmsDaemon::cached_status);
        let state = PairState {
            namespace: self.namespace.clone(),
            id: self.id.clone(),
            pid: self.last_pid,
            pids,
            runc_ids: [
                self.engines[0].runc_id.clone(),
                self.engines[1].runc_id.clone(),
            ],
            pair: super::state_file::snapshot(&snap),
            promotions: self.promotions.iter().cloned().collect(),
            gms: gms_status.and_then(super::state_file::gms),
            exit_status: self.view.borrow().exit.map(|e| e.status),
            updated_unix_us: 0,
        };
        let Ok(key) = serde_json::to_string(&state) else {
            return;
        };
        if !force && key == self.last_written {
            return;
        }
        self.last_written = key;
        let state = PairState {
            updated_unix_us: unix_us(SystemTime::now()),
            ..state
        };
        match serde_json::to_vec_pretty(&state) {
            Ok(bytes) => {
                if let Err(e) = write_atomic(&self.state_json, &bytes) {
                    log::warn!(
                        "pair {}: writing {}: {e}",
                        self.id,
                        self.state_json.display()
                    );
                }
            }
            Err(e) => log::warn!("pair {}: encoding state: {e}", self.id),
        }
        let figures = self
            .gms
            .as_ref()
            .map(GmsDaemon::figures)
            .unwrap_or_default();
        let text = shadow_pair::metrics::render(&self.namespace, &self.id, &snap, &figures);
        if let Err(e) =
            shadow_pair::metrics::write_textfile(&self.metrics_dir, &self.metrics_name, &text)
        {
            log::warn!(
                "pair {}: writing metrics {}/{}: {e}",
                self.id,
                self.metrics_dir.display(),
                self.metrics_name
            );
        }
    }
}

/// Replace `path` with `bytes` (write a temporary file, then rename).
pub fn write_atomic(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reaper_statuses_become_exits() {
        assert_eq!(exit_of(0), Exit::Code(0));
        assert_eq!(exit_of(3), Exit::Code(3));
        assert_eq!(exit_of(137), Exit::Signal(9));
        assert_eq!(exit_of(143), Exit::Signal(15));
        assert_eq!(exit_of(128), Exit::Code(128));
        assert_eq!(exit_of(255), Exit::Code(255));
    }
}
