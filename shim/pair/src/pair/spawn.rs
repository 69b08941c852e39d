//! Bringing an engine up: the first spawns, the spawn of one slot (a new
//! generation), runc's report of its pid, and the end of a backoff. It
//! exists because every rule that brings a slot back (a death, a cold
//! restart, a backoff) goes through the same `Pair::spawn`.
//!
//! What may be touched here: what a spawn resets (its watchdog among
//! them), how a reported pid is taken. When a slot comes back is decided elsewhere (`death`, `down`);
//! this only carries it out.

use super::Pair;
use crate::slot::SlotId;
use crate::vocabulary::{Action, EngineState};
use crate::watchdog::{StartClock, Watchdog};
use std::time::Duration;

impl Pair {
    /// The first actions: start the engines (all of a pair's, or slot 0
    /// of a single).
    pub fn start(&mut self) -> Vec<Action> {
        self.revision += 1;
        SlotId::first(self.slots_in_use)
            .map(|s| self.spawn(s))
            .collect()
    }

    pub(super) fn spawn(&mut self, slot: SlotId) -> Action {
        let s = &mut self.slots[slot.index()];
        s.state = EngineState::Spawning;
        s.pid = None;
        s.speaks_notify = false;
        s.generation += 1;
        self.oom_killed[slot.index()] = false;
        // A new engine starts unarmed, at the configured interval.
        self.watchdogs[slot.index()] = Watchdog::default();
        self.hung[slot.index()] = None;
        self.probe_failed[slot.index()] = 0;
        self.starts[slot.index()] = StartClock::default();
        Action::Spawn { slot }
    }

    /// The engine of `slot` runs (its pid came, or it spoke first): its
    /// start clock begins at `now`.
    pub(super) fn starting(&mut self, slot: SlotId, now: Duration) {
        let s = &mut self.slots[slot.index()];
        if s.state == EngineState::Spawning {
            s.state = EngineState::Starting;
            if let Some(timeout) = self.start_timeout {
                self.starts[slot.index()] = StartClock::started(now, timeout);
            }
        }
    }

    /// runc reported the pid. The engine may have spoken already (runc
    /// returns after the engine runs): it keeps the state it reached.
    pub(super) fn on_spawned(&mut self, slot: SlotId, pid: u32, now: Duration) -> Vec<Action> {
        let s = &self.slots[slot.index()];
        if s.pid.is_some() || !(s.state == EngineState::Spawning || s.alive()) {
            return Vec::new();
        }
        self.starting(slot, now);
        self.slots[slot.index()].pid = Some(pid);
        if self.ending.is_some() || self.cold_restart {
            // Asked for before the pair began to go down: it must not live.
            return vec![Action::Kill { slot }];
        }
        Vec::new()
    }

    /// A `SpawnAfter` delay for `slot` has elapsed: the slot comes back,
    /// unless the pair is going down or has moved past that backoff.
    pub(super) fn on_backoff_elapsed(&mut self, slot: SlotId) -> Vec<Action> {
        if self.ending.is_none()
            && !self.cold_restart
            && self.slot(slot).state == EngineState::Backoff
        {
            vec![self.spawn(slot)]
        } else {
            Vec::new()
        }
    }
}
