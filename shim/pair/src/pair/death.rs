//! An engine's death (its reap, or a spawn that failed): its class (an
//! OOM kill, an XID, GMS gone, corrupt weights, a hang the pair ended),
//! the handover it begins or
//! completes, and what follows: a respawn now or after a backoff, as the
//! restart budget says, a cold restart, or the end of the pair (a crash
//! loop, or every engine finished cleanly). It exists because a death is
//! the one event that can lead to every other rule, so it is decided in
//! one place.
//!
//! What may be touched here: what a death means and what it leads to. How
//! the pair then goes down is `down`'s, how a slot is spawned `spawn`'s,
//! how the backoff grows `policy`'s.

use std::time::Duration;

use super::{Ending, Pair};
use crate::failure::{classify_death, ColdRestartCause, Exit, FailureClass};
use crate::policy::Verdict;
use crate::promotion::{DeathSign, Handover};
use crate::slot::SlotId;
use crate::vocabulary::{Action, EngineState};

impl Pair {
    /// The slots in use other than `slot`.
    fn others(&self, slot: SlotId) -> impl Iterator<Item = &crate::vocabulary::Slot> {
        self.slots[..self.slots_in_use]
            .iter()
            .filter(move |s| s.id != slot)
    }

    /// The reaper collected the engine of `slot`.
    pub(super) fn on_exited(&mut self, slot: SlotId, exit: Exit, now: Duration) -> Vec<Action> {
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

    /// The OOM killer had a hand in the current engine of `slot`: kept
    /// until its reap, whose class it changes.
    pub(super) fn on_oom_killed(&mut self, slot: SlotId) -> Vec<Action> {
        if self.slot(slot).alive() {
            self.oom_killed[slot.index()] = true;
        }
        Vec::new()
    }

    pub(super) fn on_death(
        &mut self,
        slot: SlotId,
        exit: Exit,
        useful: bool,
        now: Duration,
    ) -> Vec<Action> {
        let was_active = self.active == Some(slot);
        let superseded = self.slot(slot).state == EngineState::Superseded;
        // A hang the pair ended: its own class (unless the device says
        // worse), its cause kept beside the exit.
        let hang = self.hung[slot.index()].take();
        {
            let s = &mut self.slots[slot.index()];
            s.state = EngineState::Stopped;
            s.pid = None;
            s.last_exit = Some(exit);
            s.last_hang = hang.map(|h| h.cause);
        }
        if let Some(h) = hang {
            self.hangs.count(h.cause);
        }
        if was_active {
            self.active = None;
        } else if !superseded {
            // Another engine's end: a lock-file close just before was its.
            self.closed_at = None;
        }
        let mut class = classify_death(exit, &self.xids, self.gms_alive, hang.is_some());
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
                if let Some(hang) = hang {
                    h.hung(hang);
                }
            }
            actions.extend(self.complete_handover());
            actions.extend(self.reaped_earlier(slot, now, exit, class));
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
            if let Some(hang) = hang {
                h.hung(hang);
            }
            if let Some(closed) = self.closed_at.take() {
                h.sign(closed, DeathSign::LockFree);
            }
            self.begin_handover(h);
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
            let left = self.others(slot).any(|o| {
                o.alive() || matches!(o.state, EngineState::Spawning | EngineState::Backoff)
            });
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
        let survivor = self
            .others(slot)
            .any(|o| o.alive() || o.state == EngineState::Spawning);
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
}
