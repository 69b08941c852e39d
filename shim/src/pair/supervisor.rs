//! The pair's one supervising task: it owns the `shadow_pair::Pair`, feeds
//! it what the observers report (spawns, reaped exits, notify datagrams,
//! the lock holder, XIDs, gmsd's death, backoff timers, Kill) and carries
//! out the actions it returns through the [`Host`]. Nothing else changes a
//! pair's state, so inputs are decided in the order they arrive, at the
//! time they were observed; order races are states of the pair, not
//! buffers here. The task's end (the pair's exit) publishes exactly one
//! TaskExit.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use containerd_shim_protos::events::task::TaskExit;
use nix::sys::signal::Signal;
use shadow_pair::{
    parse_notify, Action, Event as PairEvent, LockHolder, LockWatch, Notification, Pair, SlotId,
};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use super::config::PairConfig;
use super::engine::SharedOutput;
use super::gms::GmsDaemons;
use super::host::Host;
use super::input::Input;
use super::lock::LockSeen;
use super::notify::{DropCounts, NotifySocket, Queue};
use super::observe::{self, Clock};
use super::publish::{GmsStatus, Outlets, Publisher, View};
use crate::error::Result;
use crate::events::{Event, EventSink};
use crate::exits::ExitRouter;
use crate::status::ExitInfo;
use crate::time::timestamp;

/// How long the pair's exit waits for the engines' output to reach the FIFOs.
const OUTPUT_DRAIN: Duration = Duration::from_secs(1);
/// How often a pair with gmsd looks at its (separately polled) status.
const GMS_STATUS_PERIOD: Duration = Duration::from_secs(1);
/// Refused `READY=1`s are logged at most this often per pair.
const REFUSED_LOG_PERIOD: Duration = Duration::from_secs(10);

/// The parts a Supervisor is made of, gathered by Create.
pub struct Parts {
    pub id: String,
    pub namespace: String,
    pub config: PairConfig,
    pub host: Arc<dyn Host>,
    pub runc_ids: [String; 2],
    pub output: Arc<SharedOutput>,
    pub copiers: Vec<JoinHandle<()>>,
    pub router: Arc<ExitRouter>,
    pub events: EventSink,
    pub view: watch::Sender<View>,
    pub notify: Option<NotifySocket>,
    /// The election lock file, watched for closes (inotify).
    pub lock_path: Option<PathBuf>,
    pub state_json: PathBuf,
    /// containerd's address, recorded in `state.json`.
    pub containerd: String,
    pub metrics_file: PathBuf,
    pub gms: Option<GmsDaemons>,
    /// PCI buses of the GPUs the spec's devices grant: their XIDs are watched.
    pub gpu_buses: Vec<String>,
    /// One engine, restarted in place, no shadow.
    pub single: bool,
}

pub struct Supervisor {
    id: String,
    pair: Pair,
    config: PairConfig,
    host: Arc<dyn Host>,
    output: Arc<SharedOutput>,
    copiers: Vec<JoinHandle<()>>,
    router: Arc<ExitRouter>,
    events: EventSink,
    notify: Option<NotifySocket>,
    /// Datagrams the notify reader forwarded and this task has not taken.
    notify_queue: Arc<Queue>,
    /// What the notify reader dropped, by reason (published as a metric).
    notify_drops: Arc<DropCounts>,
    lock_path: Option<PathBuf>,
    gms: Option<GmsDaemons>,
    gpu_buses: Vec<String>,
    /// Ends the XID watcher thread with the pair.
    xid_stop: Arc<AtomicBool>,
    tx: mpsc::UnboundedSender<Input>,
    rx: mpsc::UnboundedReceiver<Input>,
    clock: Clock,
    publisher: Publisher,
    /// Slots spawned at least once (a respawn must remove the old container).
    spawned_once: [bool; 2],
    stop_signal: Option<u32>,
    /// When a refused `READY=1` was last logged, and the count then.
    refused_logged: Option<(Instant, u64)>,
}

impl Supervisor {
    pub fn new(p: Parts) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        let clock = Clock::start();
        let notify_drops = Arc::new(DropCounts::default());
        let publisher = Publisher::new(
            Outlets {
                id: p.id.clone(),
                namespace: p.namespace,
                runc_ids: p.runc_ids,
                state_json: p.state_json,
                containerd: p.containerd,
                metrics_file: p.metrics_file,
                view: p.view,
                promotions_kept: p.config.promotions_kept,
            },
            notify_drops.clone(),
            SystemTime::now(),
        );
        Supervisor {
            pair: if p.single {
                Pair::single(p.config.restart.clone())
            } else {
                Pair::new(p.config.restart.clone())
            },
            id: p.id,
            config: p.config,
            host: p.host,
            output: p.output,
            copiers: p.copiers,
            router: p.router,
            events: p.events,
            notify: p.notify,
            notify_queue: Arc::new(Queue::default()),
            notify_drops,
            lock_path: p.lock_path,
            gms: p.gms,
            gpu_buses: p.gpu_buses,
            xid_stop: Arc::new(AtomicBool::new(false)),
            tx,
            rx,
            clock,
            publisher,
            spawned_once: [false, false],
            stop_signal: None,
            refused_logged: None,
        }
    }

    /// How Kill (and tests) reach the running supervisor.
    pub fn input(&self) -> mpsc::UnboundedSender<Input> {
        self.tx.clone()
    }

    /// A pair that will not run (Start failed, or Delete before Start):
    /// close the output and hand back the GMS daemon.
    pub fn abandon(mut self) -> Option<GmsDaemons> {
        self.output.close();
        self.gms.take()
    }

    /// Kill of a pair that was created and never started: nothing runs,
    /// yet the task ends, with `status`, as a created runc container killed
    /// before its start does (its init dies of the signal). Without this
    /// exit, Wait and Delete(WithProcessKill) would wait forever; CRI does
    /// exactly this when a start fails.
    pub fn end_unstarted(&mut self, status: u32, pid: u32) {
        self.output.close();
        let info = ExitInfo {
            pid,
            status,
            at: SystemTime::now(),
        };
        log::info!(
            "pair {}: killed before it started, exit status {status}",
            self.id
        );
        self.events.send(Event::Exit(TaskExit {
            container_id: self.id.clone(),
            id: self.id.clone(),
            pid: info.pid,
            exit_status: info.status,
            exited_at: Some(timestamp(info.at)).into(),
            ..Default::default()
        }));
        self.publisher.exited(&self.pair, None, info);
    }

    /// Start both engines inline (Start waits for them), so that a spec
    /// that cannot run fails Start with runc's own error.
    pub async fn start_engines(&mut self) -> Result<u32> {
        for action in self.pair.start() {
            let Action::Spawn { slot } = action else {
                continue;
            };
            let generation = self.pair.slot(slot).generation;
            self.spawned_once[slot.index()] = true;
            match self.host.spawn(slot, true).await {
                Ok(pid) => {
                    let actions = self.on_spawned(slot, generation, Ok(pid));
                    self.carry_out(actions).await;
                }
                Err(e) => {
                    for s in SlotId::BOTH {
                        if let Some(pid) = self.pair.slot(s).pid {
                            self.host.signal(pid, Signal::SIGKILL);
                        }
                    }
                    return Err(e);
                }
            }
        }
        self.publish(true);
        Ok(self.publisher.last_pid())
    }

    /// Run until the pair is gone; hands back the GMS daemon for Delete.
    pub async fn run_to_end(mut self) -> Option<GmsDaemons> {
        self.run().await;
        self.xid_stop.store(true, Ordering::Relaxed);
        self.gms.take()
    }

    async fn run(&mut self) {
        if let Some(sock) = self.notify.take() {
            observe::notify(
                &self.id,
                sock,
                self.host.clone(),
                self.notify_queue.clone(),
                self.notify_drops.clone(),
                self.tx.clone(),
            );
        }
        if let Some(path) = self.lock_path.take() {
            if let Err(e) = observe::lock_closes(&path, self.tx.clone()) {
                // The reap and READY=1 still tell; deaths are dated later.
                log::warn!("pair {}: watching {}: {e}", self.id, path.display());
            }
        }
        if let Some(g) = &self.gms {
            g.watch(&self.router, &self.tx);
        }
        observe::xids(
            &self.id,
            &self.gpu_buses,
            self.xid_stop.clone(),
            self.tx.clone(),
        );
        loop {
            let wake = self.next_wake();
            let input = tokio::select! {
                i = self.rx.recv() => i,
                _ = sleep_or_never(wake) => None,
            };
            let actions = match input {
                Some(i) => self.on_input(i).await,
                None => self.poll_lock(),
            };
            if self.carry_out(actions).await {
                return;
            }
            self.publish(false);
        }
    }

    /// When to wake without an input: to poll the lock for engines that do
    /// not speak sd_notify, to pick up gmsd's status, and to write counters
    /// that moved while their write waited ([`super::publish::COUNTERS_EVERY`]).
    fn next_wake(&self) -> Option<Duration> {
        let lock = match self.pair.lock_watch() {
            LockWatch::Off => None,
            LockWatch::Idle => Some(self.config.lock_poll_idle_ms),
            LockWatch::Fast => Some(self.config.lock_poll_fast_ms),
        }
        .map(Duration::from_millis);
        let gms = self.gms.as_ref().map(|_| GMS_STATUS_PERIOD);
        let counters = self.publisher.counters_due(&self.pair, Instant::now());
        [lock, gms, counters].into_iter().flatten().min()
    }

    /// A `READY=1` from an engine that did not hold the election lock was
    /// refused: say so, at most every [`REFUSED_LOG_PERIOD`].
    fn log_refused_ready(&mut self, slot: SlotId, pid: u32, holder: Option<LockHolder>) {
        let total = self.pair.ready_refused();
        let now = Instant::now();
        if let Some((at, _)) = self.refused_logged {
            if now.duration_since(at) < REFUSED_LOG_PERIOD {
                return;
            }
        }
        let since = total - self.refused_logged.map_or(0, |(_, n)| n);
        let held = match holder {
            Some(LockHolder::Slot(s)) => format!("slot {s}"),
            Some(LockHolder::Free) => "nobody".to_owned(),
            Some(LockHolder::Unknown) | None => "no engine seen".to_owned(),
        };
        log::warn!(
            "pair {}: ignored READY=1 from slot {slot} (pid {pid}): it does not hold the election lock (held by {held}); {since} refused since the last report, {total} in all",
            self.id
        );
        self.refused_logged = Some((now, total));
    }

    fn poll_lock(&mut self) -> Vec<Action> {
        if self.pair.lock_watch() == LockWatch::Off {
            return Vec::new();
        }
        let now = self.clock.now();
        let look = self.host.lock();
        let mut actions = Vec::new();
        for slot in SlotId::BOTH {
            if look.waiting[slot.index()] {
                actions.extend(self.pair.handle(PairEvent::LockWaiting { slot }, now));
            }
        }
        actions.extend(match look.seen {
            LockSeen::Held(slot) => self.pair.handle(PairEvent::LockHeld { slot }, now),
            LockSeen::Free => self.pair.handle(PairEvent::LockFree, now),
            LockSeen::Unknown => Vec::new(),
        });
        actions
    }

    fn on_spawned(
        &mut self,
        slot: SlotId,
        generation: u32,
        result: std::result::Result<u32, String>,
    ) -> Vec<Action> {
        let ours = self.pair.awaits_pid(slot, generation);
        match result {
            Ok(pid) if !ours => {
                log::warn!(
                    "pair {}: stale engine pid {pid} of slot {slot}: killing it",
                    self.id
                );
                self.host.signal(pid, Signal::SIGKILL);
                Vec::new()
            }
            Ok(pid) => {
                observe::exit(self.host.as_ref(), slot, pid, self.tx.clone());
                log::info!(
                    "pair {}: slot {slot} generation {generation} runs as pid {pid}",
                    self.id
                );
                let now = self.clock.now();
                self.pair.handle(PairEvent::Spawned { slot, pid }, now)
            }
            Err(e) => {
                log::warn!("pair {}: spawning slot {slot}: {e}", self.id);
                if ours {
                    let now = self.clock.now();
                    self.pair.handle(PairEvent::SpawnFailed { slot }, now)
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
                let exit = observe::exit_of(status);
                log::info!("pair {}: slot {slot} pid {pid} exited ({exit:?})", self.id);
                // In the host's PID namespace the engine's other processes
                // outlive it: they go before its death is decided on (and
                // before the task's exit, if this was the last engine).
                self.host.kill_rest(slot).await;
                let reaped = self.clock.of_wall(at);
                let mut actions = Vec::new();
                // The kernel counts the kill before it sends SIGKILL, so the
                // count is there at the reap (and until runc deletes the
                // engine's cgroup, which the respawn does after this).
                let oom_kills = self.host.oom_kills(slot);
                if oom_kills > 0 {
                    log::warn!(
                        "pair {}: slot {slot} pid {pid}: the OOM killer killed {oom_kills} of its processes",
                        self.id
                    );
                    actions.extend(self.pair.handle(PairEvent::OomKilled { slot }, reaped));
                }
                actions.extend(self.pair.handle(PairEvent::Exited { slot, exit }, reaped));
                actions
            }
            Input::Notify(d, at) => {
                self.notify_queue.taken();
                let Some(slot) = self.host.slot_of_pid(d.pid) else {
                    log::debug!("pair {}: notify from pid {} of no engine", self.id, d.pid);
                    return Vec::new();
                };
                let now = self.clock.since(at);
                let mut actions = Vec::new();
                // Read at most once per datagram, and only for a READY=1
                // that would make a new engine active.
                let mut holder = None;
                for notification in parse_notify(&d.bytes) {
                    let event = if notification == Notification::Ready
                        && self.pair.ready_needs_proof(slot)
                    {
                        let holder = *holder.get_or_insert_with(|| self.host.lock().seen.holder());
                        PairEvent::Ready { slot, holder }
                    } else {
                        PairEvent::Notified { slot, notification }
                    };
                    let refused = self.pair.ready_refused();
                    actions.extend(self.pair.handle(event, now));
                    if self.pair.ready_refused() > refused {
                        self.log_refused_ready(slot, d.pid, holder);
                    }
                }
                actions
            }
            // Written by the `publish` that follows this input, or when due.
            Input::NotifyDropped => Vec::new(),
            Input::LockClosed(at) => {
                // Whose close it was, the pair learns from what follows:
                // reading /proc/locks now would stall on the exiting
                // engine (measured: 6-15 ms added to READY and the reap).
                let now = self.clock.since(at);
                self.pair.handle(PairEvent::LockClosed, now)
            }
            Input::Backoff { slot } => {
                let now = self.clock.now();
                self.pair.handle(PairEvent::BackoffElapsed { slot }, now)
            }
            Input::Kill { signal } => {
                // Every Kill reaches the engines at once, as under runc-v2:
                // CRI follows its SIGTERM with a SIGKILL after its own grace
                // period, which must not wait for ours. The latest signal is
                // also the one a respawn that lands afterwards gets.
                let s = Signal::try_from(signal as i32).unwrap_or(Signal::SIGKILL);
                self.kill_all(s);
                let first = self.stop_signal.is_none();
                self.stop_signal = Some(signal);
                if first && s != Signal::SIGKILL {
                    let tx = self.tx.clone();
                    let grace = self.config.stop_grace();
                    tokio::spawn(async move {
                        tokio::time::sleep(grace).await;
                        let _ = tx.send(Input::Escalate);
                    });
                }
                let now = self.clock.now();
                self.pair.handle(PairEvent::Stop, now)
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
                let now = self.clock.now();
                self.pair.handle(PairEvent::Xid(xid), now)
            }
            Input::ColdRestartDue => {
                let now = self.clock.now();
                self.pair.handle(PairEvent::ColdRestartDue, now)
            }
            Input::GmsDied { index, generation } => {
                let Some(g) = self
                    .gms
                    .as_ref()
                    .and_then(|g| g.daemon(index))
                    .filter(|g| g.generation() == generation)
                else {
                    return Vec::new();
                };
                let device = g.name().to_string();
                log::warn!(
                    "pair {}: gmsd of {device} died: cold restart of the pair",
                    self.id
                );
                let now = self.clock.now();
                self.pair.handle(PairEvent::GmsDied { device }, now)
            }
        }
    }

    /// Signal every engine whose pid is known; one still being spawned is
    /// killed when its spawn is reported (the pair answers `Kill`).
    fn kill_all(&self, sig: Signal) {
        for slot in SlotId::BOTH {
            if let Some(pid) = self.pair.slot(slot).pid {
                self.host.signal(pid, sig);
            }
        }
    }

    /// Carries out actions (and those they lead to); true once the pair is gone.
    async fn carry_out(&mut self, actions: Vec<Action>) -> bool {
        let mut queue: VecDeque<Action> = actions.into();
        while let Some(action) = queue.pop_front() {
            match action {
                Action::Spawn { slot } => self.spawn(slot),
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
                Action::Kill { slot } => {
                    if let Some(pid) = self.pair.slot(slot).pid {
                        log::info!("pair {}: slot {slot} pid {pid} killed on arrival", self.id);
                        self.host.signal(pid, Signal::SIGKILL);
                    }
                }
                Action::RestartGms => {
                    if let Some(g) = self.gms.as_mut() {
                        match g.restart().await {
                            Ok(()) => g.watch(&self.router, &self.tx),
                            Err(e) => {
                                // A failed cold restart, judged by the
                                // restart budget: backoff, then a crash
                                // loop. The spawns queued behind this are
                                // killed as they land.
                                log::error!("pair {}: restarting gmsd: {e}", self.id);
                                let now = self.clock.now();
                                queue.extend(self.pair.handle(PairEvent::GmsStartFailed, now));
                            }
                        }
                    }
                }
                Action::RestartGmsAfter { delay } => {
                    log::warn!(
                        "pair {}: cold restart in {} ms (restart backoff)",
                        self.id,
                        delay.as_millis()
                    );
                    let tx = self.tx.clone();
                    tokio::spawn(async move {
                        tokio::time::sleep(delay).await;
                        let _ = tx.send(Input::ColdRestartDue);
                    });
                }
                Action::Promoted(p) => self.publisher.record(p),
                Action::Exit { status } => {
                    self.finish(status).await;
                    return true;
                }
            }
        }
        false
    }

    /// Start the engine of `slot` in the background; `Input::Spawned` reports it.
    fn spawn(&mut self, slot: SlotId) {
        let generation = self.pair.slot(slot).generation;
        let fresh = !self.spawned_once[slot.index()];
        self.spawned_once[slot.index()] = true;
        let host = self.host.clone();
        let tx = self.tx.clone();
        tokio::spawn(async move {
            let result = host.spawn(slot, fresh).await.map_err(|e| e.to_string());
            let _ = tx.send(Input::Spawned {
                slot,
                generation,
                result,
            });
        });
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
            pid: self.publisher.last_pid(),
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
        let gms = self.gms_status();
        self.publisher.exited(&self.pair, gms, info);
    }

    fn gms_status(&self) -> Option<GmsStatus> {
        self.gms.as_ref().map(|g| GmsStatus {
            reports: g.cached_statuses(),
            figures: g.figures(),
        })
    }

    fn publish(&mut self, force: bool) {
        let gms = self.gms_status();
        self.publisher.publish(&self.pair, gms, force);
    }
}

async fn sleep_or_never(d: Option<Duration>) {
    match d {
        Some(d) => tokio::time::sleep(d).await,
        None => std::future::pending().await,
    }
}
