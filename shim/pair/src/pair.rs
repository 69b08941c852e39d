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
//!
//! This file is the pair's state and its one entry: [`Pair`]'s fields
//! (private, so only `pair` and the modules below it touch them), its
//! constructors, and [`Pair::handle`], which sends each event to its rule
//! and bumps the revision. The rules are `impl Pair` blocks, one module
//! for each job:
//!
//! - `spawn`: starting an engine, its pid reported, a backoff elapsed;
//! - `election`: who serves: sd_notify, `READY=1`, the election lock, and
//!   the handover of a failover;
//! - `death`: an engine reaped: what its death means, and when its slot
//!   comes back;
//! - `down`: both engines stopped, for good (Stop, a crash loop, a clean
//!   finish) or for a cold restart (GMS, an XID, corrupt weights);
//! - `hang`: an engine ended because it hung: its sd_notify watchdog (`WATCHDOG=1`,
//!   `WATCHDOG=trigger`, `WATCHDOG_USEC=`), the runtime's probe of the
//!   serving engine, the start timeout (`EXTEND_TIMEOUT_USEC=`), and the
//!   check that ends the engines that hung;
//! - `queries`: what the shim reads between events (`&self` only).
//!
//! The words they speak ([`Event`], [`Action`], [`Slot`], [`Snapshot`]) are
//! in `vocabulary`, below all of them. This file uses none of its modules
//! by name (it declares them and calls their methods), and each of them
//! uses this one, so the files use each other in one direction.
//!
//! What may be touched here: a new field of the pair (with its first
//! value in [`Pair::new`]), a new event's line in `apply`. A rule's body
//! goes to the module of its job.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;

use crate::{
    failure::{ColdRestartCause, Exit, Hang, Hangs},
    notify::Notification,
    policy::{RestartBudget, RestartPolicy},
    promotion::{Handover, Promotion},
    watchdog::{StartClock, Watchdog},
};

pub use crate::slot::{SlotId, MAX_SHADOWS, MAX_SLOTS};
pub use crate::vocabulary::{Action, EngineState, Event, LockHolder, LockWatch, Slot, Snapshot};

mod death;
mod down;
mod election;
mod hang;
mod queries;
mod spawn;

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

/// What a change of the pair is judged by ([`Pair::revision`]).
#[derive(PartialEq)]
struct Observable {
    slots: Vec<Slot>,
    active: Option<SlotId>,
    failovers: u64,
    cold_restarts: u64,
    oom_kills: u64,
    weights_corrupt: u64,
    last_promotion: Option<u64>,
    last_cold_restart: Option<ColdRestartCause>,
    kv_drops: u64,
    hangs: Hangs,
    /// Arming and disarming are changes (a ping that only moves an armed
    /// watchdog on is not).
    armed: Vec<bool>,
}

/// The supervisor's decisions for one pair.
#[derive(Debug)]
pub struct Pair {
    /// One per engine: the active and its shadows (`Pair::with_shadows`),
    /// indexed by `SlotId`. Every per-slot field below has as many.
    slots: Vec<Slot>,
    active: Option<SlotId>,
    budget: RestartBudget,
    /// XIDs seen since the last cold start.
    xids: Vec<u32>,
    gms_alive: bool,
    /// A failover in progress: the signs of the old active's end so far.
    handover: Option<Handover>,
    /// Earlier failovers whose successor served but whose old active was
    /// not reaped yet when the successor failed in turn (a second failure
    /// within a failover, which more shadows make likely): each is recorded
    /// at its old active's reap.
    awaiting_reap: Vec<Handover>,
    /// The last close of the lock file while an engine served: the date of
    /// its death if a failover follows.
    closed_at: Option<Duration>,
    last_promotion: Option<Promotion>,
    failovers: u64,
    cold_restarts: u64,
    last_cold_restart: Option<ColdRestartCause>,
    /// Cold restarts that dropped the pair's GMS state, the KV pool with
    /// it, and the last one's cause.
    kv_drops: u64,
    last_kv_drop: Option<ColdRestartCause>,
    gms_deaths: BTreeMap<String, u64>,
    /// Engine deaths the OOM killer had a hand in.
    oom_kills: u64,
    weights_corrupt: u64,
    /// `READY=1`s refused: their sender did not hold the election lock.
    ready_refused: u64,
    /// The current engine of each slot was OOM-killed (until its reap).
    oom_killed: Vec<bool>,
    /// The watchdog interval every engine is given, if any
    /// ([`Pair::with_watchdog`]); `None`: no watchdog, and the engines'
    /// `WATCHDOG` messages are ignored.
    watchdog: Option<Duration>,
    /// The current engine of each slot's watchdog (reset at each spawn).
    /// Kept off the slots: a ping is no observable change.
    watchdogs: Vec<Watchdog>,
    /// The current engine of each slot was ended as hung: why, when, and
    /// when it was killed (until its reap, which records it).
    hung: Vec<Option<Hang>>,
    /// Engines ended as hung, by cause, counted at their reap.
    hangs: Hangs,
    /// Probe failures in a row that end the serving engine
    /// ([`Pair::with_probe`]); `None`: no probe, its results are ignored.
    probe_failures_max: Option<u32>,
    /// Probe failures in a row of the current engine of each slot.
    probe_failed: Vec<u32>,
    /// How long an engine may take to park or serve
    /// ([`Pair::with_start_timeout`]); `None`: forever.
    start_timeout: Option<Duration>,
    /// The current engine of each slot's start clock (set when it starts).
    starts: Vec<StartClock>,
    /// The pair's cgroup is frozen (Pause): no engine can ping, answer a
    /// probe or start, so none is judged.
    frozen: bool,
    /// Each slot's notify reader stopped reading a flood on that slot's
    /// socket: that engine's pings wait unread in the kernel, so its
    /// watchdog and start clock are not judged (the other engine's are).
    stalled: Vec<bool>,
    /// Since when each slot has been blind (frozen or stalled); `None`: seen.
    blind_since: Vec<Option<Duration>>,
    /// Set while both engines are being stopped for a cold restart, and
    /// while it waits out its backoff.
    cold_restart: bool,
    /// Whether an engine had become useful (parked or active) when the
    /// cold restart began: the restart budget judges it as it would that
    /// engine's death.
    cold_useful: bool,
    /// Down, waiting for `ColdRestartDue`.
    cold_waiting: bool,
    /// Slots in use: N + 1 for a pair with N shadows, 1 for a single
    /// engine restarted in place (no shadow; GMS still keeps the weights
    /// across restarts; its `slots` still has two, the second never used).
    slots_in_use: usize,
    ending: Option<Ending>,
    /// Exit status to report when the pair ends.
    final_status: Option<u32>,
    /// Bumped at every observable change.
    revision: u64,
}

impl Pair {
    /// A pair with one shadow.
    pub fn new(policy: RestartPolicy) -> Pair {
        Pair::with_slots(policy, 2)
    }

    /// A pair with `shadows` shadows (1 ..= `MAX_SHADOWS`, clamped):
    /// `shadows + 1` engines, whichever holds the lock serves, the others
    /// parked; every dead slot is started again. The rules are those of a
    /// pair with one shadow: a failover promotes whichever shadow takes the
    /// lock.
    pub fn with_shadows(policy: RestartPolicy, shadows: usize) -> Pair {
        Pair::with_slots(policy, shadows.clamp(1, MAX_SHADOWS) + 1)
    }

    fn with_slots(policy: RestartPolicy, n: usize) -> Pair {
        Pair {
            slots: SlotId::first(n).map(Slot::new).collect(),
            active: None,
            budget: RestartBudget::new(policy),
            xids: Vec::new(),
            gms_alive: true,
            handover: None,
            awaiting_reap: Vec::new(),
            closed_at: None,
            last_promotion: None,
            failovers: 0,
            cold_restarts: 0,
            last_cold_restart: None,
            kv_drops: 0,
            last_kv_drop: None,
            gms_deaths: BTreeMap::new(),
            oom_kills: 0,
            weights_corrupt: 0,
            ready_refused: 0,
            oom_killed: vec![false; n],
            watchdog: None,
            watchdogs: vec![Watchdog::default(); n],
            hung: vec![None; n],
            hangs: Hangs::default(),
            probe_failures_max: None,
            probe_failed: vec![0; n],
            start_timeout: None,
            starts: vec![StartClock::default(); n],
            frozen: false,
            stalled: vec![false; n],
            blind_since: vec![None; n],
            cold_restart: false,
            cold_useful: false,
            cold_waiting: false,
            slots_in_use: n,
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
            ..Pair::with_slots(policy, 2)
        }
    }

    /// The pair with a watchdog of `interval` for every engine (systemd's
    /// `WatchdogSec=`; `None`, as [`Pair::new`] and [`Pair::single`] make
    /// it: no watchdog). An engine's watchdog is armed by its first
    /// `WATCHDOG=1`; once armed, a gap longer than the interval (or the
    /// engine's own, from `WATCHDOG_USEC=`) ends it at the next
    /// [`Event::HangCheck`]. A zero interval is no watchdog.
    pub fn with_watchdog(self, interval: Option<Duration>) -> Pair {
        Pair {
            watchdog: interval.filter(|i| !i.is_zero()),
            ..self
        }
    }

    /// The pair whose serving engine is probed by the shim, ended after
    /// `failures` failed probes in a row ([`Event::Probed`]); `None` or 0:
    /// no probe.
    pub fn with_probe(self, failures: Option<u32>) -> Pair {
        Pair {
            probe_failures_max: failures.filter(|n| *n > 0),
            ..self
        }
    }

    /// The pair whose engines must park or serve within `timeout` of
    /// starting (`shadow.dev/start-timeout`), extended by their
    /// `EXTEND_TIMEOUT_USEC=`; `None`: no limit.
    pub fn with_start_timeout(self, timeout: Option<Duration>) -> Pair {
        Pair {
            start_timeout: timeout,
            ..self
        }
    }

    /// True for a [`Pair::single`].
    pub fn is_single(&self) -> bool {
        self.slots_in_use == 1
    }

    /// The slots the pair keeps (`0 ..= N`; two for a single engine, the
    /// second never started).
    pub fn slot_ids(&self) -> impl Iterator<Item = SlotId> + Clone {
        SlotId::first(self.slots.len())
    }

    /// How many shadows the pair is made for (0 for a single engine).
    pub fn shadows(&self) -> usize {
        self.slots_in_use - 1
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

    /// Sends `event` to the rule that handles it.
    fn apply(&mut self, event: Event, now: Duration) -> Vec<Action> {
        match event {
            Event::Spawned { slot, pid } => self.on_spawned(slot, pid, now),
            Event::SpawnFailed { slot } => self.on_death(slot, Exit::Code(255), false, now),
            Event::Notified { slot, notification } => {
                self.on_notify(slot, notification, LockHolder::Unknown, now)
            }
            Event::Ready { slot, holder } => self.on_notify(slot, Notification::Ready, holder, now),
            Event::LockHeld { slot } => self.on_lock(slot, now),
            Event::LockFree => self.on_lock_free(now),
            Event::LockWaiting { slot } => self.on_lock_waiting(slot),
            Event::LockClosed => self.on_lock_closed(now),
            Event::Exited { slot, exit } => self.on_exited(slot, exit, now),
            Event::OomKilled { slot } => self.on_oom_killed(slot),
            Event::GmsDied { device } => self.on_gms_died(device, now),
            Event::GmsStartFailed => self.on_gms_start_failed(now),
            Event::ColdRestartDue => self.on_cold_restart_due(),
            Event::Xid(xid) => self.on_xid(xid, now),
            Event::BackoffElapsed { slot } => self.on_backoff_elapsed(slot),
            Event::Stop => self.on_stop(now),
            Event::HangCheck => self.on_hang_check(now),
            Event::Probed {
                slot,
                generation,
                healthy,
            } => self.on_probed(slot, generation, healthy, now),
            Event::Killed { slot } => self.on_killed(slot, now),
            Event::Paused => self.on_frozen(true, now),
            Event::Resumed => self.on_frozen(false, now),
            Event::NotifyStalled { slot } => self.on_stalled(slot, true, now),
            Event::NotifyResumed { slot } => self.on_stalled(slot, false, now),
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
            kv_drops: self.kv_drops,
            hangs: self.hangs,
            armed: self.watchdogs_armed(),
        }
    }

    /// Whether each slot's watchdog is armed and counts (a configured
    /// watchdog, pinged by the current engine).
    pub(super) fn watchdogs_armed(&self) -> Vec<bool> {
        self.watchdogs
            .iter()
            .map(|w| self.watchdog.is_some() && w.armed())
            .collect()
    }
}

#[cfg(test)]
#[path = "pair_tests.rs"]
mod tests;
