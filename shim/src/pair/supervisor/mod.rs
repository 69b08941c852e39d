//! The pair's one owner, from the end of Create to Delete. Create hands it
//! everything it made (the [`Made`] record: directories, mounts, pinned
//! namespaces, cgroup, gmsds, the OOM watcher, stdin; the [`Host`] with the
//! engines and the listening sockets; the output pipes) and it runs as one
//! task: the Task service reaches it only by [`Command`]s, each with its
//! reply, and watches its [`View`]. It owns the `shadow_pair::Pair`, feeds
//! it what the observers report (spawns, reaped exits, notify datagrams,
//! the lock holder, XIDs, gmsd's death, backoff timers, Kill) and carries
//! out the actions it returns through the [`Host`]. Nothing else changes a
//! pair's state, so inputs are decided in the order they arrive, at the
//! time they were observed (tokio's clock, so that the tests run on paused
//! time); order races are states of the pair, not buffers here. The pair's
//! end publishes exactly one TaskExit; what it is made of goes only at
//! Delete, by this task, after which it ends.
//!
//! `commands.rs` answers the Task service, `inputs.rs` the observers,
//! `actions.rs` carries out what the pair decides, `timers.rs` wakes it
//! without an input (the lock poll, hang deadlines, gmsd's status, the
//! counters) and `probing.rs` schedules the probe of the serving engine;
//! this file is the pair's life cycle.

mod actions;
mod commands;
mod inputs;
mod probing;
mod timers;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use containerd_shim_protos::events::task::{TaskExit, TaskStart};
use nix::sys::signal::Signal;
use shadow_pair::{Action, Pair, SlotId};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::command::Command;
use super::config::PairConfig;
use super::engine::SharedOutput;
use super::fdstore::Figures;
use super::host::{Host, Passing};
use super::input::{self, Input, Inputs};
use super::keeping::{Fetching, Keeping};
use super::made::Made;
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
/// How long after a hang deadline its check runs: the pair ends an engine
/// once the time is past the deadline, not at it.
const HANG_TICK: Duration = Duration::from_millis(1);

/// The parts a Supervisor is made of, gathered by Create.
pub struct Parts {
    pub id: String,
    pub namespace: String,
    pub config: PairConfig,
    pub host: Arc<dyn Host>,
    /// What a new engine is passed besides the listening sockets.
    pub passing: Arc<dyn Passing>,
    /// The keeper of the pair's fd store and connections (`None`: no
    /// store): told who is active and who died, asked by the notify
    /// readers and the fetch servers.
    pub keeper: Option<Arc<dyn Keeping>>,
    /// The store's figures, for state.json and the metrics.
    pub store_figures: Option<Arc<Figures>>,
    /// Each slot's runc container id, `0 ..= N`.
    pub runc_ids: Vec<String>,
    pub output: Arc<SharedOutput>,
    pub copiers: Vec<JoinHandle<()>>,
    pub router: Arc<ExitRouter>,
    pub events: EventSink,
    /// Each slot's notify socket (its engine's alone).
    pub notify: Option<Vec<NotifySocket>>,
    /// The election lock file, watched for closes (inotify).
    pub lock_path: Option<PathBuf>,
    pub state_json: PathBuf,
    /// containerd's address, recorded in `state.json`.
    pub containerd: String,
    pub metrics_file: PathBuf,
    /// Everything Create made; the supervisor undoes it at Delete.
    pub made: Made,
    /// PCI buses of the GPUs the spec's devices grant: their XIDs are watched.
    pub gpu_buses: Vec<String>,
    /// One engine, restarted in place, no shadow.
    pub single: bool,
    /// Shadows the pair keeps parked (1 ..= MAX_SHADOWS; ignored when
    /// `single`).
    pub shadows: usize,
    /// How the pair finds a hung engine.
    pub hang: Hang,
}

impl Drop for Supervisor {
    /// A pair dropped without its end (the Task service let go of it):
    /// its acceptors stop with it, rather than hold its listening sockets.
    fn drop(&mut self) {
        if let Some(k) = &self.keeper {
            k.stop();
        }
    }
}

/// How a pair finds a hung engine: its engines' watchdog interval, the
/// probe of its serving engine and the start timeout (issue 22).
pub struct Hang {
    pub watchdog: Option<Duration>,
    pub probe: Option<PairProbe>,
    pub start_timeout: Duration,
}

/// The probe of a pair's serving engine: what it checks, how often, and
/// the thread in the pair's network namespace that checks it.
pub struct PairProbe {
    pub prober: super::probe::Prober,
    pub settings: shadow_contract::hang::Probe,
}

/// The probe while the pair runs: when the next is due, whether one is
/// in flight, whom it is for, and how the last ones went (for the log).
struct Probing {
    prober: Arc<super::probe::Prober>,
    settings: shadow_contract::hang::Probe,
    /// The engine (slot, generation) the schedule is for.
    target: Option<(SlotId, u32)>,
    next: Option<Instant>,
    in_flight: bool,
    /// Failures in a row, and the last one's reason.
    failing: u32,
    last_failure: String,
}

/// How the Task service reaches a pair's supervisor.
pub struct Handle {
    pub commands: mpsc::UnboundedSender<Command>,
    pub view: watch::Receiver<View>,
    /// The supervisor's inputs, for tests that play the observers.
    #[cfg(test)]
    pub input: Inputs,
}

/// Where the pair is in its life, as the Task service sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Created, not started: the first engine exists, nothing runs.
    Created,
    /// Start failed: nothing runs; Delete removes the pair.
    StartFailed,
    /// Started and not yet gone (also while paused).
    Running,
    /// Gone: the task's exit is published; Delete removes the pair.
    Exited,
    /// Killed before Start: gone as `Exited`, and never started.
    Killed,
}

pub struct Supervisor {
    id: String,
    phase: Phase,
    /// The pair's cgroup is frozen (Pause).
    paused: bool,
    pair: Pair,
    config: PairConfig,
    host: Arc<dyn Host>,
    passing: Arc<dyn Passing>,
    keeper: Option<Arc<dyn Keeping>>,
    output: Arc<SharedOutput>,
    copiers: Vec<JoinHandle<()>>,
    router: Arc<ExitRouter>,
    events: EventSink,
    notify: Option<Vec<NotifySocket>>,
    /// Datagrams the notify readers forwarded and this task has not taken.
    notify_queue: Arc<Queue>,
    /// What the notify reader dropped, by reason (published as a metric).
    notify_drops: Arc<DropCounts>,
    lock_path: Option<PathBuf>,
    made: Made,
    /// The observers started with the pair (notify socket, lock closes):
    /// they end with it.
    observers: Vec<JoinHandle<()>>,
    gpu_buses: Vec<String>,
    /// Ends the XID watcher thread with the pair.
    xid_stop: Arc<AtomicBool>,
    tx: Inputs,
    rx: mpsc::Receiver<Input>,
    clock: Clock,
    publisher: Publisher,
    /// When the current generation of each slot was asked for: a notify
    /// sender's slot looked up before then may be its predecessor's.
    spawned_at: Vec<Instant>,
    stop_signal: Option<u32>,
    /// When a refused `READY=1` was last logged, and the count then.
    refused_logged: Option<(Instant, u64)>,
    /// The probe of the serving engine, if the pair has one.
    probing: Option<Probing>,
    /// The engines' start timeout (for the log; the pair keeps time).
    start_timeout: Duration,
    /// When `/proc/locks` was last polled.
    lock_polled: Instant,
}

impl Supervisor {
    pub fn new(p: Parts) -> Self {
        let (tx, rx) = input::channel();
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
                promotions_kept: p.config.promotions_kept,
            },
            notify_drops.clone(),
            SystemTime::now(),
        )
        .with_fdstore(p.store_figures);
        let now = Instant::now();
        let pair = if p.single {
            Pair::single(p.config.restart.clone())
        } else {
            Pair::with_shadows(p.config.restart.clone(), p.shadows)
        }
        .with_watchdog(p.hang.watchdog)
        .with_probe(p.hang.probe.as_ref().map(|p| p.settings.failures))
        .with_start_timeout(Some(p.hang.start_timeout));
        let spawned_at = vec![now; pair.slot_ids().count()];
        let probing = p.hang.probe.map(|p| Probing {
            prober: Arc::new(p.prober),
            settings: p.settings,
            target: None,
            next: None,
            in_flight: false,
            failing: 0,
            last_failure: String::new(),
        });
        Supervisor {
            phase: Phase::Created,
            paused: false,
            pair,
            id: p.id,
            config: p.config,
            host: p.host,
            passing: p.passing,
            keeper: p.keeper,
            output: p.output,
            copiers: p.copiers,
            router: p.router,
            events: p.events,
            notify: p.notify,
            notify_queue: Arc::new(Queue::default()),
            notify_drops,
            lock_path: p.lock_path,
            made: p.made,
            observers: Vec::new(),
            gpu_buses: p.gpu_buses,
            xid_stop: Arc::new(AtomicBool::new(false)),
            tx,
            rx,
            clock,
            publisher,
            spawned_at,
            stop_signal: None,
            refused_logged: None,
            probing,
            start_timeout: p.hang.start_timeout,
            lock_polled: now,
        }
    }

    /// Create's last step: the first engine is created (as runc-v2's
    /// Create makes the init: the task has its pid, and a spec that cannot
    /// run fails here), and the supervisor takes over what Create made.
    /// Should the engine's create fail, that is undone here.
    pub async fn launch(p: Parts) -> Result<Handle> {
        let mut sup = Supervisor::new(p);
        match sup.host.create(SlotId::ZERO, sup.passing.as_ref()).await {
            Ok(pid) => sup.publisher.created(pid),
            Err(e) => {
                sup.output.close();
                sup.made.undo().await;
                return Err(e);
            }
        }
        let (commands, rx) = mpsc::unbounded_channel();
        let handle = Handle {
            commands,
            view: sup.publisher.subscribe(),
            #[cfg(test)]
            input: sup.tx.clone(),
        };
        tokio::spawn(sup.serve(rx));
        Ok(handle)
    }

    /// The pair's life: commands in every phase, inputs while it runs.
    /// Ends at Delete (or when the Task service lets go of the pair).
    async fn serve(mut self, mut commands: mpsc::UnboundedReceiver<Command>) {
        loop {
            let running = self.phase == Phase::Running;
            let wake = if running { self.next_wake() } else { None };
            // Commands first: a flood of inputs never keeps a Kill waiting.
            let actions = tokio::select! {
                biased;
                command = commands.recv() => {
                    let Some(command) = command else {
                        log::info!("pair {}: the Task service let go of the pair without a Delete", self.id);
                        return;
                    };
                    if self.on_command(command).await.is_break() {
                        return;
                    }
                    continue;
                }
                Some(input) = self.rx.recv(), if running => self.on_input(input).await,
                _ = sleep_or_never(wake), if running => self.on_wake().await,
            };
            self.carry_out(actions).await;
            if self.phase == Phase::Running {
                self.tell_handoff();
                self.schedule_probe();
                self.publish(false);
            }
        }
    }

    /// The observers of a started pair: its notify socket, the closes of
    /// its lock file, its gmsds' deaths and its GPUs' XIDs.
    fn observe(&mut self) {
        if let Some(socks) = self.notify.take() {
            let socks: Vec<Arc<NotifySocket>> = socks.into_iter().map(Arc::new).collect();
            for (slot, sock) in self.pair.slot_ids().zip(&socks) {
                self.observers.push(observe::notify(
                    &self.id,
                    slot,
                    sock.clone(),
                    self.host.clone(),
                    self.notify_queue.clone(),
                    self.notify_drops.clone(),
                    self.keeper.clone(),
                    self.tx.clone(),
                ));
            }
            if let Some(k) = self.keeper.clone() {
                let fetching = Fetching {
                    host: self.host.clone(),
                    notify: socks,
                };
                k.start(&self.tx, fetching);
            }
        }
        if let Some(path) = self.lock_path.take() {
            match observe::lock_closes(&path, self.tx.clone()) {
                Ok(task) => self.observers.push(task),
                // The reap and READY=1 still tell; deaths are dated later.
                Err(e) => log::warn!("pair {}: watching {}: {e}", self.id, path.display()),
            }
        }
        if let Some(g) = &self.made.gms {
            g.watch(&self.router, &self.tx);
        }
        observe::xids(
            &self.id,
            &self.gpu_buses,
            self.xid_stop.clone(),
            self.tx.clone(),
        );
    }

    /// Start both engines inline (Start waits for them), so that a spec
    /// that cannot run fails Start with runc's own error.
    async fn start_engines(&mut self) -> Result<u32> {
        for action in self.pair.start() {
            let Action::Spawn { slot } = action else {
                continue;
            };
            let generation = self.pair.slot(slot).generation;
            self.spawned_at[slot.index()] = Instant::now();
            match self.host.spawn(slot, self.passing.as_ref()).await {
                Ok(pid) => {
                    let actions = self.on_spawned(slot, generation, Ok(pid));
                    self.carry_out(actions).await;
                }
                Err(e) => {
                    for s in self.pair.slot_ids() {
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

    /// Start of the created pair: both engines run, containerd hears
    /// TaskStart, the observers begin.
    async fn start(&mut self) -> Result<u32> {
        match self.phase {
            Phase::Created => {}
            Phase::Killed => {
                return Err(crate::error::Error::FailedPrecondition(format!(
                    "pair {} was killed before it started",
                    self.id
                )))
            }
            _ => {
                return Err(crate::error::Error::FailedPrecondition(format!(
                    "container {} is not in the created state",
                    self.id
                )))
            }
        }
        let pid = match self.start_engines().await {
            Ok(pid) => pid,
            Err(e) => {
                // Nothing runs; Delete cleans up.
                self.output.close();
                self.phase = Phase::StartFailed;
                return Err(e);
            }
        };
        self.events.send(Event::Start(TaskStart {
            container_id: self.id.clone(),
            pid,
            ..Default::default()
        }));
        self.phase = Phase::Running;
        self.observe();
        Ok(pid)
    }

    /// Kill of a pair that was created and never started: nothing runs,
    /// yet the task ends, with `status`, as a created runc container killed
    /// before its start does (its init dies of the signal, and so does the
    /// engine created at Create). Without this exit, Wait and
    /// Delete(WithProcessKill) would wait forever; CRI does exactly this
    /// when a start fails.
    async fn end_unstarted(&mut self, status: u32) {
        self.output.close();
        self.host.end_created(SlotId::ZERO).await;
        log::info!(
            "pair {}: killed before it started, exit status {status}",
            self.id
        );
        self.ended(status, None);
    }

    pub(super) async fn finish(&mut self, status: u32) {
        self.output.close();
        let copiers = std::mem::take(&mut self.copiers);
        let _ = tokio::time::timeout(OUTPUT_DRAIN, async {
            for c in copiers {
                let _ = c.await;
            }
        })
        .await;
        log::info!("pair {}: gone, exit status {status}", self.id);
        let gms = self.gms_status();
        self.ended(status, gms);
    }

    /// The pair is gone: one TaskExit, the view and files say so, the
    /// observers and the listening sockets end. What the pair is made of
    /// stays for Delete.
    fn ended(&mut self, status: u32, gms: Option<GmsStatus>) {
        let info = ExitInfo {
            pid: self.publisher.last_pid(),
            status,
            at: SystemTime::now(),
        };
        self.events.send(Event::Exit(TaskExit {
            container_id: self.id.clone(),
            id: self.id.clone(),
            pid: info.pid,
            exit_status: info.status,
            exited_at: Some(timestamp(info.at)).into(),
            ..Default::default()
        }));
        self.publisher.exited(&self.pair, gms, info);
        self.phase = Phase::Exited;
        self.xid_stop.store(true, Ordering::Relaxed);
        for task in self.observers.drain(..) {
            task.abort();
        }
        // Whatever an observer still holds cannot reach a pair that is gone.
        self.rx.close();
        self.host.close_listen();
        if let Some(k) = &self.keeper {
            k.stop();
        }
        // The probe's thread ends with the pair (one in flight holds it
        // until its timeout).
        self.probing = None;
    }

    fn gms_status(&self) -> Option<GmsStatus> {
        self.made.gms.as_ref().map(|g| GmsStatus {
            reports: g.cached_statuses(),
            figures: g.figures(),
        })
    }

    /// Connections go to the active engine: the hand-off is told who it
    /// is after each step (only a change reaches the connection thread).
    fn tell_handoff(&self) {
        if let Some(k) = &self.keeper {
            k.active_is(self.pair.active());
        }
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
