//! What the shim reads of the pair between events: the slots, who is
//! active, the pid containerd sees, whether a pid or a `READY=1` is awaited,
//! how closely to watch `/proc/locks`, the snapshot to publish. It exists
//! so the questions sit apart from the rules that change the answers.
//!
//! What may be touched here: a new question. Everything here takes
//! `&self`: a method that changes the pair is a rule, and goes to the
//! module of its job.

use std::time::Duration;

use super::Pair;
use crate::failure::Hang;
use crate::slot::SlotId;
use crate::vocabulary::{EngineState, LockWatch, Slot, Snapshot};

impl Pair {
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
    /// ([`Event::Ready`](crate::Event::Ready)): it would make a new engine active. False for the
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

    /// When the shim must next send [`Event::HangCheck`](crate::Event::HangCheck):
    /// the earliest expiry among the armed watchdogs and the start clocks of
    /// live engines the pair sees, `None` when nothing runs out (or the
    /// pair is going down). An engine expires once `now` passes this, not at
    /// it: a check exactly then ends nobody.
    pub fn hang_deadline(&self) -> Option<Duration> {
        if self.ending.is_some() || self.cold_restart {
            return None;
        }
        self.slot_ids()
            .flat_map(|s| [self.watchdog_expiry(s), self.start_expiry(s)])
            .flatten()
            .min()
    }

    /// Why and when the current engine of `slot` was ended as hung, until
    /// its reap (then it is the slot's `last_hang`).
    pub fn hang_of(&self, slot: SlotId) -> Option<Hang> {
        self.hung[slot.index()]
    }

    /// The engine to probe now, and its generation (for
    /// [`Event::Probed`](crate::Event::Probed)): the serving engine, while
    /// the pair has a probe and judges hangs; `None` otherwise.
    pub fn probe_target(&self) -> Option<(SlotId, u32)> {
        self.probe_failures_max?;
        if self.ending.is_some() || self.cold_restart || self.frozen {
            return None;
        }
        let a = self.active?;
        self.probe_counts(a).then(|| (a, self.slot(a).generation))
    }

    /// The watchdog interval of the current engine of `slot`: its own
    /// (`WATCHDOG_USEC=`), else the pair's; `None` without a watchdog.
    pub fn watchdog_interval(&self, slot: SlotId) -> Option<Duration> {
        Some(self.watchdogs[slot.index()].interval(self.watchdog?))
    }

    /// The configured watchdog interval ([`Pair::with_watchdog`]), before
    /// any engine's own `WATCHDOG_USEC=`.
    pub fn watchdog(&self) -> Option<Duration> {
        self.watchdog
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
        let mut slots = self.slots.clone();
        for (slot, armed) in slots.iter_mut().zip(self.watchdogs_armed()) {
            slot.watchdog_armed = armed;
        }
        Snapshot {
            slots,
            active: self.active,
            protected: self.protected(),
            shadows: self.shadows(),
            shadows_parked: self.shadows_parked(),
            failovers: self.failovers,
            cold_restarts: self.cold_restarts,
            oom_kills: self.oom_kills,
            weights_corrupt: self.weights_corrupt,
            last_promotion: self.last_promotion.clone(),
            last_cold_restart: self.last_cold_restart.clone(),
            kv_drops: self.kv_drops,
            last_kv_drop: self.last_kv_drop.clone(),
            gms_deaths: self.gms_deaths.clone(),
            ready_refused: self.ready_refused,
            hangs: self.hangs,
        }
    }

    /// An engine that serves with at least one parked shadow, all with
    /// their pids known (an engine may speak before runc reports its pid).
    /// One that holds the lock and speaks sd_notify serves from its
    /// `READY=1`: until then it may still be waking, or stuck doing so.
    fn protected(&self) -> bool {
        match self.active {
            Some(a) => {
                let active = self.slot(a);
                active.state == EngineState::Active
                    && active.pid.is_some()
                    && self.shadows_parked() > 0
            }
            None => false,
        }
    }

    /// Shadows parked now, their pids known: the failures the pair can
    /// take before one of them finds no shadow.
    pub fn shadows_parked(&self) -> usize {
        self.slots
            .iter()
            .filter(|s| Some(s.id) != self.active)
            .filter(|s| s.state == EngineState::Parked && s.pid.is_some())
            .count()
    }
}
