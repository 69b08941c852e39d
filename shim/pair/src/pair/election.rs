//! Who serves: an engine's sd_notify messages, its `READY=1` (believed,
//! when it would make a new engine active, only from the election lock's
//! holder), the lock seen held, free, waited on or closed in `/proc/locks`,
//! and the failover these begin and complete: the old active superseded,
//! the successor active, the [`Promotion`](crate::Promotion) recorded once
//! the old one is reaped too. It exists because these signs arrive on
//! different paths and in any order, and one place must make them agree.
//!
//! What may be touched here: how a sign of the lock or of `READY=1` moves
//! the slots and the handover. What a death means is `death`'s; the
//! timeline itself is kept by `promotion::Handover`.

use std::time::Duration;

use super::Pair;
use crate::notify::Notification;
use crate::promotion::{DeathSign, Handover};
use crate::slot::SlotId;
use crate::vocabulary::{Action, EngineState, LockHolder, Slot};

impl Pair {
    /// `holder`: who held the lock when the shim looked, for a `READY=1`.
    pub(super) fn on_notify(
        &mut self,
        slot: SlotId,
        n: Notification,
        holder: LockHolder,
        now: Duration,
    ) -> Vec<Action> {
        if n.is_watchdog() {
            // Apart from the rest: no watchdog configured, no change at
            // all; and a ping says nothing of readiness.
            return self.on_watchdog_notify(slot, n, now);
        }
        // It speaks, so it runs: its spawn is reported later.
        self.starting(slot, now);
        if let Notification::ExtendTimeout(by) = n {
            self.starts[slot.index()].extend(by, now);
        }
        let s = &mut self.slots[slot.index()];
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
        self.begin_handover(h);
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

    pub(super) fn on_lock(&mut self, slot: SlotId, now: Duration) -> Vec<Action> {
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
    pub(super) fn on_lock_waiting(&mut self, slot: SlotId) -> Vec<Action> {
        let s = &mut self.slots[slot.index()];
        if s.state == EngineState::Starting {
            s.state = EngineState::Parked;
        }
        Vec::new()
    }

    pub(super) fn on_lock_free(&mut self, now: Duration) -> Vec<Action> {
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
    pub(super) fn on_lock_closed(&mut self, now: Duration) -> Vec<Action> {
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

    /// `h` becomes the failover in progress. One already in progress
    /// whose successor served is kept until its old active's reap records
    /// it ([`Pair::reaped_earlier`]); one whose successor never served
    /// is over (that successor is the one leaving now).
    pub(super) fn begin_handover(&mut self, h: Handover) {
        if let Some(earlier) = self.handover.replace(h) {
            if earlier.serving() && earlier.awaits_reap() {
                self.awaiting_reap.push(earlier);
            }
        }
    }

    /// The reap of `slot` that an earlier failover awaited
    /// ([`Pair::begin_handover`]): its record, counted as a failover.
    pub(super) fn reaped_earlier(
        &mut self,
        slot: SlotId,
        now: Duration,
        exit: crate::failure::Exit,
        class: crate::failure::FailureClass,
    ) -> Vec<Action> {
        let Some(i) = self.awaiting_reap.iter().position(|h| h.from() == slot) else {
            return Vec::new();
        };
        let mut h = self.awaiting_reap.remove(i);
        h.reaped(now, exit, class);
        let number = self.failovers + 1;
        match h.complete(number) {
            Some(p) => {
                self.failovers = number;
                self.last_promotion = Some(p.clone());
                vec![Action::Promoted(p)]
            }
            None => Vec::new(),
        }
    }

    /// The promotion record, once its successor serves and the old active
    /// is reaped: only then is it counted as a failover.
    pub(super) fn complete_handover(&mut self) -> Vec<Action> {
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
}
