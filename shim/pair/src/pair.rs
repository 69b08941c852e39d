//! The pair: two slots, at most one active engine, and the rules that move
//! them. [`Pair::handle`] takes one observed [`Event`] and returns the
//! [`Action`]s the shim must carry out; it never blocks and never performs
//! I/O, so the whole failure policy is tested with plain values.
//!
//! Time is a [`Duration`] since the supervisor started (a monotonic clock
//! the caller reads), which keeps tests deterministic. `now` is when the
//! event was *observed* (the reaper's time for an exit), so events that
//! travelled different paths may be handled out of time order; every rule
//! here accepts that. Order races are states, not buffers: a successor that
//! says `READY=1` before the old active is reaped makes the old one
//! [`EngineState::Superseded`]; an engine that speaks before its spawn is
//! reported is running, its pid to come.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;

use crate::{
    failure::{classify, ColdRestartCause, Exit, FailureClass, XidClass},
    notify::Notification,
    policy::{RestartBudget, RestartPolicy, Verdict},
    promotion::{DeathSign, Handover, Promotion},
};

pub use shadow_contract::state::EngineState;

pub use crate::slot::SlotId;

/// One slot of the pair.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Slot {
    pub id: SlotId,
    pub state: EngineState,
    /// `None` while spawning, and for an engine that spoke before its spawn
    /// was reported.
    pub pid: Option<u32>,
    /// Incremented at each spawn of this slot.
    pub generation: u32,
    /// The engine sent at least one sd_notify message: it will send READY=1.
    pub speaks_notify: bool,
    pub last_exit: Option<Exit>,
}

impl Slot {
    fn new(id: SlotId) -> Slot {
        Slot {
            id,
            state: EngineState::Stopped,
            pid: None,
            generation: 0,
            speaks_notify: false,
            last_exit: None,
        }
    }

    /// Running: an exit is still to come.
    fn alive(&self) -> bool {
        matches!(
            self.state,
            EngineState::Starting
                | EngineState::Parked
                | EngineState::Active
                | EngineState::Superseded
        )
    }
}

/// Who `/proc/locks` showed holding the election lock when the shim looked
/// (see [`Event::Ready`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LockHolder {
    /// A process of the engine of this slot (one in its cgroup).
    Slot(SlotId),
    /// Nobody.
    Free,
    /// A process of no engine, an unreadable `/proc/locks`, or the shim
    /// did not look.
    Unknown,
}

/// What the shim observed.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// The engine of `slot` is running with this pid.
    Spawned { slot: SlotId, pid: u32 },
    /// Starting the engine failed before it ran (runc create/start error).
    SpawnFailed { slot: SlotId },
    /// The engine of `slot` sent these on the notify socket. A
    /// `READY=1` here is [`Event::Ready`] with [`LockHolder::Unknown`].
    Notified {
        slot: SlotId,
        notification: Notification,
    },
    /// The engine of `slot` sent `READY=1`, and the election lock's holder
    /// was `holder` when the shim looked, after the datagram arrived (an
    /// engine takes the lock before it says `READY=1`). Engines are
    /// untrusted: a `READY=1` that would make a new engine active
    /// ([`Pair::ready_needs_proof`]) is believed only from the holder, so a
    /// shadow that lies does not displace the engine that serves. It is
    /// refused and counted ([`Pair::ready_refused`]) instead.
    Ready { slot: SlotId, holder: LockHolder },
    /// `/proc/locks` shows the engine of `slot` holding the election lock.
    LockHeld { slot: SlotId },
    /// `/proc/locks` shows nobody holding the election lock.
    LockFree,
    /// `/proc/locks` shows the engine of `slot` waiting for the election
    /// lock: it is initialised and parked, whether or not it says so.
    LockWaiting { slot: SlotId },
    /// The kernel reported the lock file closed for good (inotify), and
    /// the active engine's pid was not then seen holding the lock: an
    /// engine let go of it (dying or on purpose), which releases its flock.
    /// Whose it was is learnt from what follows.
    LockClosed,
    /// The reaper collected the engine of `slot` (`now`: the reaper's time).
    Exited { slot: SlotId, exit: Exit },
    /// The GMS daemon of `device` (a GPU UUID, or `host`) died.
    GmsDied { device: String },
    /// A GMS daemon could not be started again after `RestartGms`: the
    /// cold restart failed early, like an engine that died starting.
    GmsStartFailed,
    /// A `RestartGmsAfter` delay has elapsed.
    ColdRestartDue,
    /// An XID was reported for one of the pair's GPUs.
    Xid(u32),
    /// The OOM killer killed a process of the engine of `slot` (its
    /// cgroup's `oom_kill` count), seen at its reap and sent just before
    /// its `Exited`: the death is then of class `OutOfMemory`.
    OomKilled { slot: SlotId },
    /// A `SpawnAfter` delay for `slot` has elapsed.
    BackoffElapsed { slot: SlotId },
    /// containerd asked the task to stop (Kill): no more respawns.
    Stop,
}

/// What the shim must do.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "action")]
pub enum Action {
    /// Start the engine of `slot` now.
    Spawn { slot: SlotId },
    /// Deliver `Event::BackoffElapsed { slot }` after `delay`.
    SpawnAfter { slot: SlotId, delay: Duration },
    /// Kill every engine still alive (SIGKILL).
    KillAll,
    /// SIGKILL the engine of `slot`: it was reported running after the
    /// pair began to stop or to restart cold.
    Kill { slot: SlotId },
    /// Drop GMS state and start the daemons afresh before the next spawns.
    RestartGms,
    /// Deliver `Event::ColdRestartDue` after `delay`: a cold restart waits
    /// out its backoff like a respawn.
    RestartGmsAfter { delay: Duration },
    /// A promotion finished: record it.
    Promoted(Promotion),
    /// The pair is down for good: the task exits with `status`.
    Exit { status: u32 },
}

/// How closely the shim must watch `/proc/locks`: only engines that do not
/// speak sd_notify are learnt from the lock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LockWatch {
    /// Every live engine speaks sd_notify (or the pair is going down).
    Off,
    /// An engine serves; a silent one could still take the lock over.
    Idle,
    /// Nobody serves and a silent engine may be the next active.
    Fast,
}

/// Why the pair is going down, once it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
enum Ending {
    /// containerd asked.
    Stopping,
    /// The restart budget is spent.
    CrashLoop,
    /// Every engine finished cleanly (exit 0) on its own.
    Finished,
}

/// A pair's observable state, for metrics and `shadowctl`.
#[derive(Clone, Debug, Serialize)]
pub struct Snapshot {
    pub slots: [Slot; 2],
    pub active: Option<SlotId>,
    /// An active engine with a parked shadow behind it.
    pub protected: bool,
    /// Completed promotions (successor serving, old active reaped).
    pub failovers: u64,
    pub cold_restarts: u64,
    /// Engine deaths in which the OOM killer had a hand.
    pub oom_kills: u64,
    /// Engines that found the committed weights changed (each began a cold
    /// restart).
    pub weights_corrupt: u64,
    pub last_promotion: Option<Promotion>,
    /// Why the pair last restarted cold (or began to).
    pub last_cold_restart: Option<ColdRestartCause>,
    /// Deaths of each GMS daemon (by device) since the pair was created.
    pub gms_deaths: BTreeMap<String, u64>,
    /// `READY=1`s refused ([`Pair::ready_refused`]); not part of the
    /// revision, so a liar's repeats do not republish the pair each time.
    /// A metric only: `state.json`'s schema does not have it.
    #[serde(skip)]
    pub ready_refused: u64,
}

/// What a change of the pair is judged by ([`Pair::revision`]).
#[derive(PartialEq)]
struct Observable {
    slots: [Slot; 2],
    active: Option<SlotId>,
    failovers: u64,
    cold_restarts: u64,
    oom_kills: u64,
    weights_corrupt: u64,
    last_promotion: Option<u64>,
    last_cold_restart: Option<ColdRestartCause>,
}

/// The supervisor's decisions for one pair.
#[derive(Debug)]
pub struct Pair {
    slots: [Slot; 2],
    active: Option<SlotId>,
    budget: RestartBudget,
    /// XIDs seen since the last cold start.
    xids: Vec<u32>,
    gms_alive: bool,
    /// A failover in progress: the signs of the old active's end so far.
    handover: Option<Handover>,
    /// The last close of the lock file while an engine served: the date of
    /// its death if a failover follows.
    closed_at: Option<Duration>,
    last_promotion: Option<Promotion>,
    failovers: u64,
    cold_restarts: u64,
    last_cold_restart: Option<ColdRestartCause>,
    gms_deaths: BTreeMap<String, u64>,
    /// Engine deaths the OOM killer had a hand in.
    oom_kills: u64,
    weights_corrupt: u64,
    /// `READY=1`s refused: their sender did not hold the election lock.
    ready_refused: u64,
    /// The current engine of each slot was OOM-killed (until its reap).
    oom_killed: [bool; 2],
    /// Set while both engines are being stopped for a cold restart, and
    /// while it waits out its backoff.
    cold_restart: bool,
    /// Whether an engine had become useful (parked or active) when the
    /// cold restart began: the restart budget judges it as it would that
    /// engine's death.
    cold_useful: bool,
    /// Down, waiting for `ColdRestartDue`.
    cold_waiting: bool,
    /// Slots in use: 2 for a pair, 1 for a single engine restarted in
    /// place (no shadow; GMS still keeps the weights across restarts).
    slots_in_use: usize,
    ending: Option<Ending>,
    /// Exit status to report when the pair ends.
    final_status: Option<u32>,
    /// Bumped at every observable change.
    revision: u64,
}

impl Pair {
    pub fn new(policy: RestartPolicy) -> Pair {
        Pair {
            slots: [Slot::new(SlotId::ZERO), Slot::new(SlotId::ONE)],
            active: None,
            budget: RestartBudget::new(policy),
            xids: Vec::new(),
            gms_alive: true,
            handover: None,
            closed_at: None,
            last_promotion: None,
            failovers: 0,
            cold_restarts: 0,
            last_cold_restart: None,
            gms_deaths: BTreeMap::new(),
            oom_kills: 0,
            weights_corrupt: 0,
            ready_refused: 0,
            oom_killed: [false, false],
            cold_restart: false,
            cold_useful: false,
            cold_waiting: false,
            slots_in_use: 2,
            ending: None,
            final_status: None,
            revision: 0,
        }
    }

    /// A single engine in slot 0, with no shadow: it is restarted in place
    /// when it dies (with the same backoff and budget), and GMS keeps the
    /// weights across restarts. Never protected.
    pub fn single(policy: RestartPolicy) -> Pair {
        Pair {
            slots_in_use: 1,
            ..Pair::new(policy)
        }
    }

    /// True for a [`Pair::single`].
    pub fn is_single(&self) -> bool {
        self.slots_in_use == 1
    }

    /// The first actions: start the engines (both, or slot 0 of a single).
    pub fn start(&mut self) -> Vec<Action> {
        self.revision += 1;
        SlotId::BOTH[..self.slots_in_use]
            .iter()
            .map(|s| self.spawn(*s))
            .collect()
    }

    pub fn slot(&self, id: SlotId) -> &Slot {
        &self.slots[id.index()]
    }

    pub fn active(&self) -> Option<SlotId> {
        self.active
    }

    /// A counter of observable changes (slots, active, counters, last
    /// promotion): the snapshot needs publishing only when it moved.
    pub fn revision(&self) -> u64 {
        self.revision
    }

    /// The pid containerd should see: the active engine, else a live one
    /// (one that was not superseded first).
    pub fn representative_pid(&self) -> Option<u32> {
        let live = |s: &&Slot| s.alive() && s.pid.is_some();
        self.active
            .and_then(|s| self.slot(s).pid)
            .or_else(|| {
                self.slots
                    .iter()
                    .filter(live)
                    .find(|s| s.state != EngineState::Superseded)
                    .and_then(|s| s.pid)
            })
            .or_else(|| self.slots.iter().find(live).and_then(|s| s.pid))
    }

    /// Which slot runs `pid`, if any.
    pub fn slot_of_pid(&self, pid: u32) -> Option<SlotId> {
        self.slots
            .iter()
            .find(|s| s.pid == Some(pid) && s.alive())
            .map(|s| s.id)
    }

    /// The spawn of `generation` of `slot` is still awaited: its pid is
    /// wanted (false for a spawn the pair has moved past).
    pub fn awaits_pid(&self, slot: SlotId, generation: u32) -> bool {
        let s = self.slot(slot);
        s.generation == generation
            && s.pid.is_none()
            && (s.state == EngineState::Spawning || s.alive())
    }

    /// Whether a `READY=1` from `slot` must come with the lock's holder
    /// ([`Event::Ready`]): it would make a new engine active. False for the
    /// active engine (or the one already seen holding the lock) and for an
    /// engine whose word no longer counts (dead, superseded), so the shim
    /// reads `/proc/locks` only when the answer matters.
    pub fn ready_needs_proof(&self, slot: SlotId) -> bool {
        let s = self.slot(slot);
        let speaks = s.alive() || s.state == EngineState::Spawning;
        speaks && s.state != EngineState::Superseded && self.active != Some(slot)
    }

    /// How many `READY=1`s were refused because their sender did not hold
    /// the election lock.
    pub fn ready_refused(&self) -> u64 {
        self.ready_refused
    }

    pub fn is_ending(&self) -> bool {
        self.ending.is_some()
    }

    /// Whether `/proc/locks` must be watched now, and how closely.
    pub fn lock_watch(&self) -> LockWatch {
        if self.ending.is_some() || self.cold_restart {
            return LockWatch::Off;
        }
        let silent = self
            .slots
            .iter()
            .any(|s| s.alive() && s.state != EngineState::Superseded && !s.speaks_notify);
        let serving = self
            .active
            .is_some_and(|a| self.slot(a).state == EngineState::Active);
        // An engine that speaks sd_notify but has not said it is parked may
        // be waiting on the lock all the same: worth a look at the idle
        // rate while another serves, so the pair is seen protected.
        let unsaid = serving
            && self
                .slots
                .iter()
                .any(|s| s.state == EngineState::Starting && s.speaks_notify);
        if !silent && !unsaid {
            LockWatch::Off
        } else if serving {
            LockWatch::Idle
        } else {
            LockWatch::Fast
        }
    }

    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            slots: self.slots.clone(),
            active: self.active,
            protected: self.protected(),
            failovers: self.failovers,
            cold_restarts: self.cold_restarts,
            oom_kills: self.oom_kills,
            weights_corrupt: self.weights_corrupt,
            last_promotion: self.last_promotion.clone(),
            last_cold_restart: self.last_cold_restart.clone(),
            gms_deaths: self.gms_deaths.clone(),
            ready_refused: self.ready_refused,
        }
    }

    /// An engine that serves with a parked shadow, both with their pids
    /// known (an engine may speak before runc reports its pid). One that
    /// holds the lock and speaks sd_notify serves from its `READY=1`: until
    /// then it may still be waking, or stuck doing so.
    fn protected(&self) -> bool {
        match self.active {
            Some(a) => {
                let active = self.slot(a);
                let shadow = self.slot(a.other());
                active.state == EngineState::Active
                    && active.pid.is_some()
                    && shadow.state == EngineState::Parked
                    && shadow.pid.is_some()
            }
            None => false,
        }
    }

    fn observable(&self) -> Observable {
        Observable {
            slots: self.slots.clone(),
            active: self.active,
            failovers: self.failovers,
            cold_restarts: self.cold_restarts,
            oom_kills: self.oom_kills,
            weights_corrupt: self.weights_corrupt,
            last_promotion: self.last_promotion.as_ref().map(|p| p.number),
            last_cold_restart: self.last_cold_restart.clone(),
        }
    }

    fn spawn(&mut self, slot: SlotId) -> Action {
        let s = &mut self.slots[slot.index()];
        s.state = EngineState::Spawning;
        s.pid = None;
        s.speaks_notify = false;
        s.generation += 1;
        self.oom_killed[slot.index()] = false;
        Action::Spawn { slot }
    }

    /// Applies one event, observed at `now`.
    pub fn handle(&mut self, event: Event, now: Duration) -> Vec<Action> {
        let before = self.observable();
        let actions = self.apply(event, now);
        if self.observable() != before {
            self.revision += 1;
        }
        actions
    }

    fn apply(&mut self, event: Event, now: Duration) -> Vec<Action> {
        match event {
            Event::Spawned { slot, pid } => self.on_spawned(slot, pid),
            Event::SpawnFailed { slot } => self.on_death(slot, Exit::Code(255), false, now),
            Event::Notified { slot, notification } => {
                self.on_notify(slot, notification, LockHolder::Unknown, now)
            }
            Event::Ready { slot, holder } => self.on_notify(slot, Notification::Ready, holder, now),
            Event::LockHeld { slot } => self.on_lock(slot, now),
            Event::LockFree => self.on_lock_free(now),
            Event::LockWaiting { slot } => self.on_lock_waiting(slot),
            Event::LockClosed => self.on_lock_closed(now),
            Event::Exited { slot, exit } => {
                if !self.slot(slot).alive() {
                    // A stale or duplicate exit: nothing of ours was running.
                    return Vec::new();
                }
                let useful = matches!(
                    self.slot(slot).state,
                    EngineState::Parked | EngineState::Active | EngineState::Superseded
                );
                self.on_death(slot, exit, useful, now)
            }
            Event::OomKilled { slot } => {
                if self.slot(slot).alive() {
                    self.oom_killed[slot.index()] = true;
                }
                Vec::new()
            }
            Event::GmsDied { device } => {
                self.gms_alive = false;
                *self.gms_deaths.entry(device.clone()).or_default() += 1;
                self.last_cold_restart = Some(ColdRestartCause::GmsDied { device });
                self.begin_cold_restart(true, now)
            }
            Event::GmsStartFailed => {
                self.gms_alive = false;
                self.begin_cold_restart(false, now)
            }
            Event::ColdRestartDue => {
                if self.ending.is_some() || !self.cold_waiting {
                    return Vec::new();
                }
                self.cold_waiting = false;
                self.restart_cold()
            }
            Event::Xid(xid) => {
                self.xids.push(xid);
                if XidClass::of(xid) == XidClass::DeviceInvalidating {
                    self.last_cold_restart = Some(ColdRestartCause::Xid { xid });
                    self.begin_cold_restart(true, now)
                } else {
                    Vec::new()
                }
            }
            Event::BackoffElapsed { slot } => {
                if self.ending.is_none()
                    && !self.cold_restart
                    && self.slot(slot).state == EngineState::Backoff
                {
                    vec![self.spawn(slot)]
                } else {
                    Vec::new()
                }
            }
            Event::Stop => {
                if self.ending.is_some() {
                    return Vec::new();
                }
                self.ending = Some(Ending::Stopping);
                self.end_or_kill(now)
            }
        }
    }

    /// runc reported the pid. The engine may have spoken already (runc
    /// returns after the engine runs): it keeps the state it reached.
    fn on_spawned(&mut self, slot: SlotId, pid: u32) -> Vec<Action> {
        let s = &mut self.slots[slot.index()];
        if s.pid.is_some() || !(s.state == EngineState::Spawning || s.alive()) {
            return Vec::new();
        }
        if s.state == EngineState::Spawning {
            s.state = EngineState::Starting;
        }
        s.pid = Some(pid);
        if self.ending.is_some() || self.cold_restart {
            // Asked for before the pair began to go down: it must not live.
            return vec![Action::Kill { slot }];
        }
        Vec::new()
    }

    /// `holder`: who held the lock when the shim looked, for a `READY=1`.
    fn on_notify(
        &mut self,
        slot: SlotId,
        n: Notification,
        holder: LockHolder,
        now: Duration,
    ) -> Vec<Action> {
        let s = &mut self.slots[slot.index()];
        if s.state == EngineState::Spawning {
            // It speaks, so it runs: its spawn is reported later.
            s.state = EngineState::Starting;
        }
        if !s.alive() || s.state == EngineState::Superseded {
            return Vec::new();
        }
        s.speaks_notify = true;
        match n {
            Notification::Ready
                if self.ready_needs_proof(slot) && holder != LockHolder::Slot(slot) =>
            {
                // A lie, or a READY=1 sent before the lock was taken: the
                // engine that serves keeps serving. The sender is promoted
                // as any shadow is once it holds the lock and says so.
                self.ready_refused += 1;
                Vec::new()
            }
            Notification::Ready => self.on_ready(slot, now),
            n if n.is_parked() => {
                let s = &mut self.slots[slot.index()];
                if s.state == EngineState::Starting {
                    s.state = EngineState::Parked;
                    // An engine that looked at the lock file on its way.
                    self.closed_at = None;
                }
                Vec::new()
            }
            _ => Vec::new(),
        }
    }

    /// The recorded active, when it is another live engine than `slot`.
    fn other_live_active(&self, slot: SlotId) -> Option<SlotId> {
        self.active.filter(|a| *a != slot && self.slot(*a).alive())
    }

    /// The active engine lost the lock (`sign` at `now`): it is dead or
    /// leaving, and a failover has begun before its reap.
    fn supersede(&mut self, old: SlotId, now: Duration, sign: DeathSign) {
        let mut h = Handover::begin(old, now, sign);
        if let Some(closed) = self.closed_at.take() {
            h.sign(closed, DeathSign::LockFree);
        }
        self.handover = Some(h);
        self.slots[old.index()].state = EngineState::Superseded;
        if self.active == Some(old) {
            self.active = None;
        }
    }

    fn on_ready(&mut self, slot: SlotId, now: Duration) -> Vec<Action> {
        if let Some(old) = self.other_live_active(slot) {
            // The kernel handed the lock over before the shim reaped the
            // old active.
            self.supersede(old, now, DeathSign::Ready);
        }
        if let Some(h) = self.handover.as_mut() {
            h.ready(slot, now);
        }
        self.become_active(slot);
        self.complete_handover()
    }

    fn on_lock(&mut self, slot: SlotId, now: Duration) -> Vec<Action> {
        if !self.slot(slot).alive() || self.slot(slot).state == EngineState::Superseded {
            return Vec::new();
        }
        if self.active == Some(slot) && self.handover.is_none() {
            return Vec::new();
        }
        if let Some(old) = self.other_live_active(slot) {
            self.supersede(old, now, DeathSign::LockTaken);
        }
        // An engine that never spoke sd_notify is active once it holds the
        // lock; one that speaks it is active at READY=1.
        let serves = !self.slot(slot).speaks_notify;
        if let Some(h) = self.handover.as_mut() {
            h.lock_taken(slot, now, serves);
        }
        if serves {
            self.become_active(slot);
            self.complete_handover()
        } else {
            self.active = Some(slot);
            Vec::new()
        }
    }

    /// The engine blocks on the lock: step 3 of the engine contract, so it
    /// has done everything that does not need the lock. An engine that
    /// says `STATUS=parked` gets there by its own word; one that does not
    /// (a server under `flock(1)`, or one that only says `READY=1`) by this.
    fn on_lock_waiting(&mut self, slot: SlotId) -> Vec<Action> {
        let s = &mut self.slots[slot.index()];
        if s.state == EngineState::Starting {
            s.state = EngineState::Parked;
        }
        Vec::new()
    }

    fn on_lock_free(&mut self, now: Duration) -> Vec<Action> {
        // Only an engine that is active by the lock (no sd_notify) is known
        // to hold it; READY=1 and the reap speak for the others.
        let by_lock = |s: &Slot| s.alive() && !s.speaks_notify;
        if let Some(a) = self.active.filter(|a| by_lock(self.slot(*a))) {
            self.supersede(a, now, DeathSign::LockFree);
        } else if let Some(h) = self.handover.as_mut() {
            h.sign(now, DeathSign::LockFree);
        }
        Vec::new()
    }

    /// The lock file was closed at `now`. During a failover that dates
    /// the death; while an engine serves it is kept as the candidate date
    /// of its death, taken if a failover follows, dropped when the close
    /// proves to be another's (a shadow's death, an engine that parks).
    fn on_lock_closed(&mut self, now: Duration) -> Vec<Action> {
        if let Some(h) = self.handover.as_mut() {
            h.sign(now, DeathSign::LockFree);
        } else if self
            .active
            .is_some_and(|a| self.slot(a).state == EngineState::Active)
        {
            self.closed_at = Some(now);
        }
        Vec::new()
    }

    fn become_active(&mut self, slot: SlotId) {
        self.active = Some(slot);
        self.slots[slot.index()].state = EngineState::Active;
    }

    /// The promotion record, once its successor serves and the old active
    /// is reaped: only then is it counted as a failover.
    fn complete_handover(&mut self) -> Vec<Action> {
        let number = self.failovers + 1;
        match self.handover.as_ref().and_then(|h| h.complete(number)) {
            Some(p) => {
                self.failovers = number;
                self.handover = None;
                self.last_promotion = Some(p.clone());
                vec![Action::Promoted(p)]
            }
            None => Vec::new(),
        }
    }

    fn on_death(&mut self, slot: SlotId, exit: Exit, useful: bool, now: Duration) -> Vec<Action> {
        let was_active = self.active == Some(slot);
        let superseded = self.slot(slot).state == EngineState::Superseded;
        {
            let s = &mut self.slots[slot.index()];
            s.state = EngineState::Stopped;
            s.pid = None;
            s.last_exit = Some(exit);
        }
        if was_active {
            self.active = None;
        } else if !superseded {
            // Another engine's end: a lock-file close just before was its.
            self.closed_at = None;
        }
        let mut class = classify(exit, &self.xids, self.gms_alive);
        if std::mem::take(&mut self.oom_killed[slot.index()]) {
            self.oom_kills += 1;
            // A bad device still decides what happens next.
            if class == FailureClass::DevicePreserving {
                class = FailureClass::OutOfMemory;
            }
        }
        let mut actions = Vec::new();
        if superseded {
            // The reap that a handover begun by the lock or READY=1 awaited.
            if let Some(h) = self
                .handover
                .as_mut()
                .filter(|h| h.from() == slot && h.awaits_reap())
            {
                h.reaped(now, exit, class);
            }
            actions.extend(self.complete_handover());
        }
        if self.ending.is_some() || self.cold_restart {
            if self.ending.is_some() && (was_active || self.final_status.is_none()) {
                self.final_status = Some(exit.status());
            }
            actions.extend(self.end_or_kill(now));
            return actions;
        }

        if was_active {
            let mut h = Handover::begin(slot, now, DeathSign::Reap);
            h.reaped(now, exit, class);
            if let Some(closed) = self.closed_at.take() {
                h.sign(closed, DeathSign::LockFree);
            }
            self.handover = Some(h);
        }
        if class == FailureClass::WeightsCorrupt {
            self.weights_corrupt += 1;
            self.last_cold_restart = Some(ColdRestartCause::WeightsCorrupt {
                slot: slot.index() as u8,
            });
        }
        if class.restarts_cold() {
            actions.extend(self.begin_cold_restart(true, now));
            return actions;
        }
        if exit == Exit::Code(0) {
            // Restart on failure only (systemd's Restart=on-failure): an
            // engine that finished cleanly on its own is not started again.
            // Whoever is left serves; once nobody is, the task ends with 0,
            // as a plain container whose process finished would.
            let other = self.slot(slot.other());
            let left = other.alive()
                || matches!(other.state, EngineState::Spawning | EngineState::Backoff);
            if !left {
                self.ending = Some(Ending::Finished);
                self.final_status = Some(0);
                actions.extend(self.end_or_kill(now));
            }
            return actions;
        }
        // The shadow may already hold the lock: if it is the only live
        // engine and it is active by lock, the promotion completes when the
        // shim next sees the lock or READY=1.
        let other = self.slot(slot.other());
        let survivor = other.alive() || other.state == EngineState::Spawning;
        match self.budget.on_death(useful, now) {
            Verdict::Respawn(delay) if delay.is_zero() => actions.push(self.spawn(slot)),
            Verdict::Respawn(delay) => {
                self.slots[slot.index()].state = EngineState::Backoff;
                actions.push(Action::SpawnAfter { slot, delay });
            }
            // Too many respawns lately, but an engine is left: it serves
            // (unprotected) and this slot returns when the window allows.
            // Ending the task would kill an engine that can serve.
            Verdict::WindowFull(delay) if survivor => {
                self.slots[slot.index()].state = EngineState::Backoff;
                actions.push(Action::SpawnAfter { slot, delay });
            }
            Verdict::WindowFull(_) | Verdict::CrashLoop => {
                self.ending = Some(Ending::CrashLoop);
                self.final_status = Some(exit.status());
                actions.extend(self.end_or_kill(now));
            }
        }
        actions
    }

    /// `may_be_useful`: false when the pair's GMS would not even start, so
    /// whatever the engines reached counts for nothing.
    fn begin_cold_restart(&mut self, may_be_useful: bool, now: Duration) -> Vec<Action> {
        if self.ending.is_some() || self.cold_restart {
            return Vec::new();
        }
        self.cold_restart = true;
        self.cold_useful = may_be_useful
            && self.slots.iter().any(|s| {
                matches!(
                    s.state,
                    EngineState::Parked | EngineState::Active | EngineState::Superseded
                )
            });
        self.active = None;
        for s in &mut self.slots {
            if s.state == EngineState::Backoff {
                s.state = EngineState::Stopped;
            }
        }
        let mut actions = vec![Action::KillAll];
        actions.extend(self.finish_cold_restart_if_down(now));
        actions
    }

    /// Once both engines are down, the restart budget decides, as for an
    /// engine's death: at once, after a backoff, or never (crash loop).
    fn finish_cold_restart_if_down(&mut self, now: Duration) -> Vec<Action> {
        if self.cold_waiting
            || self
                .slots
                .iter()
                .any(|s| s.alive() || s.state == EngineState::Spawning)
        {
            return Vec::new();
        }
        match self.budget.on_death(self.cold_useful, now) {
            Verdict::Respawn(delay) if delay.is_zero() => self.restart_cold(),
            Verdict::Respawn(delay) | Verdict::WindowFull(delay) => {
                self.cold_waiting = true;
                vec![Action::RestartGmsAfter { delay }]
            }
            Verdict::CrashLoop => {
                self.cold_restart = false;
                self.ending = Some(Ending::CrashLoop);
                // The engines were killed by the shim: their statuses say
                // nothing. A pair whose GMS cannot be kept up ends with 255.
                self.final_status = Some(255);
                self.end_or_kill(now)
            }
        }
    }

    fn restart_cold(&mut self) -> Vec<Action> {
        self.cold_restart = false;
        self.cold_restarts += 1;
        self.xids.clear();
        self.gms_alive = true;
        let mut actions = vec![Action::RestartGms];
        actions.extend(self.start());
        actions
    }

    /// While ending or cold-restarting: kill what lives; once nothing does,
    /// exit (ending) or start again (cold restart).
    fn end_or_kill(&mut self, now: Duration) -> Vec<Action> {
        let anything_alive = self
            .slots
            .iter()
            .any(|s| s.alive() || s.state == EngineState::Spawning);
        if self.ending.is_some() {
            for s in &mut self.slots {
                if s.state == EngineState::Backoff {
                    s.state = EngineState::Stopped;
                }
            }
            if anything_alive {
                return vec![Action::KillAll];
            }
            let status = self.final_status.unwrap_or(0);
            return vec![Action::Exit { status }];
        }
        if self.cold_restart {
            return self.finish_cold_restart_if_down(now);
        }
        Vec::new()
    }
}

#[cfg(test)]
#[path = "pair_tests.rs"]
mod tests;
