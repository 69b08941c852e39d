//! An engine ended because it hung: a live engine that stopped doing its
//! work, which never dies on its own. Four signs (issue 22):
//!
//! - its watchdog, as systemd defines it (sd_notify(3), `WatchdogSec=`):
//!   the pair's interval ([`Pair::with_watchdog`]), armed by the engine's
//!   first `WATCHDOG=1`; once armed, a gap longer than the interval ends
//!   the engine at the next [`Event::HangCheck`](crate::Event::HangCheck).
//!   `WATCHDOG_USEC=` sets that engine's own interval;
//! - `WATCHDOG=trigger`: the engine knows it is broken, and is ended at once;
//! - the shim's probe of the serving engine ([`Pair::with_probe`]): enough
//!   failed probes in a row ([`Event::Probed`](crate::Event::Probed)) end it;
//! - its start timeout ([`Pair::with_start_timeout`]): an engine that
//!   neither parked nor served within it (extended by its
//!   `EXTEND_TIMEOUT_USEC=`) is ended at the next check.
//!
//! Ending is [`Action::Kill`]; the pair records why and when ([`Hang`]),
//! and when the shim had killed it ([`Event::Killed`](crate::Event::Killed)),
//! and decides nothing else until the reap, so a hung engine's death takes
//! the path of every death (`death`): a hung active fails over, a hung
//! shadow is respawned while the active serves, a single engine restarts
//! in place, and an engine that never started is an early death for the
//! restart budget. While the pair is paused (its cgroup frozen) no engine
//! is judged; while one slot's notify reader stalls on a flood, that
//! engine's watchdog and start clock are not (the other's are). That time
//! is taken out of the clocks; a pause also stops the probe.
//!
//! What may be touched here: which engines are watched, when a hang ends
//! one, and a new sign of a hang. How one engine's clocks keep time is
//! `crate::watchdog`'s; what the death then means is `death`'s.

use std::time::Duration;

use super::Pair;
use crate::failure::{Hang, HangCause};
use crate::notify::Notification;
use crate::slot::SlotId;
use crate::vocabulary::{Action, EngineState};

impl Pair {
    /// Whether the pair judges hangs now: not while it goes down (it ends
    /// every engine anyway) or restarts cold. (A blind slot is not judged
    /// either: see [`Pair::sees`].)
    fn judges_hangs(&self) -> bool {
        self.ending.is_none() && !self.cold_restart
    }

    /// Whether probe results count now: as [`Pair::judges_hangs`], and
    /// not while the pair is frozen. A stalled notify reader does not
    /// blind the probe (so a flood cannot hide a hung engine from it).
    fn judges_probes(&self) -> bool {
        self.judges_hangs() && !self.frozen
    }

    /// Whether the pair sees the engine of `slot` now: neither frozen nor
    /// behind a stalled notify reader.
    fn sees(&self, slot: SlotId) -> bool {
        self.blind_since[slot.index()].is_none()
    }

    /// Whether the current engine of `slot` may still be ended as hung:
    /// live, not superseded (its successor serves; it is going), and not
    /// ended already.
    fn may_hang(&self, slot: SlotId) -> bool {
        let s = self.slot(slot);
        s.alive() && s.state != EngineState::Superseded && self.hung[slot.index()].is_none()
    }

    /// A watchdog message from the engine of `slot`. Ignored without a
    /// configured watchdog, from an engine whose word no longer counts
    /// (dead, superseded), already ended as hung, or while the pair goes
    /// down (it ends every engine anyway).
    pub(super) fn on_watchdog_notify(
        &mut self,
        slot: SlotId,
        n: Notification,
        now: Duration,
    ) -> Vec<Action> {
        if self.watchdog.is_none() || self.ending.is_some() || self.cold_restart {
            return Vec::new();
        }
        // It speaks, so it runs: its spawn is reported later.
        self.starting(slot, now);
        if !self.may_hang(slot) {
            return Vec::new();
        }
        let w = &mut self.watchdogs[slot.index()];
        match n {
            Notification::WatchdogPing => w.ping(now),
            Notification::WatchdogUsec(interval) => w.set_interval(interval, now),
            Notification::WatchdogTrigger => {
                return vec![self.end_hung(slot, HangCause::Trigger, now)]
            }
            _ => {}
        }
        Vec::new()
    }

    /// Ends every engine whose armed watchdog expired, or whose start
    /// timeout passed, before `now`.
    pub(super) fn on_hang_check(&mut self, now: Duration) -> Vec<Action> {
        if !self.judges_hangs() {
            return Vec::new();
        }
        let mut ended = Vec::new();
        for slot in self.slot_ids() {
            if self.watchdog_expiry(slot).is_some_and(|e| now > e) {
                ended.push((slot, HangCause::Watchdog));
            } else if self.start_expiry(slot).is_some_and(|e| now > e) {
                ended.push((slot, HangCause::StartTimeout));
            }
        }
        ended
            .into_iter()
            .map(|(slot, cause)| self.end_hung(slot, cause, now))
            .collect()
    }

    /// A probe of the engine of `slot` ended. It counts only for the
    /// engine that serves (active, `READY=1` said or the lock held
    /// without sd_notify) and only if it is the same generation the probe
    /// began with: a result that arrives after a failover is nobody's.
    pub(super) fn on_probed(
        &mut self,
        slot: SlotId,
        generation: u32,
        healthy: bool,
        now: Duration,
    ) -> Vec<Action> {
        let Some(max) = self.probe_failures_max else {
            return Vec::new();
        };
        if !self.judges_probes()
            || !self.probe_counts(slot)
            || self.slot(slot).generation != generation
        {
            return Vec::new();
        }
        let failed = &mut self.probe_failed[slot.index()];
        if healthy {
            *failed = 0;
            return Vec::new();
        }
        *failed += 1;
        if *failed >= max {
            vec![self.end_hung(slot, HangCause::Probe, now)]
        } else {
            Vec::new()
        }
    }

    /// The shim killed every process of the engine of `slot`: the hang's
    /// timeline has its second step.
    pub(super) fn on_killed(&mut self, slot: SlotId, now: Duration) -> Vec<Action> {
        if let Some(h) = self.hung[slot.index()].as_mut() {
            h.killed_at.get_or_insert(now);
        }
        Vec::new()
    }

    /// Pause (`frozen`) or Resume of the pair's cgroup: both slots go blind
    /// or (unless a stalled reader keeps one blind) see again; a thawed
    /// engine's probe failures start over (it could not answer).
    pub(super) fn on_frozen(&mut self, frozen: bool, now: Duration) -> Vec<Action> {
        if self.frozen && !frozen {
            self.probe_failed.iter_mut().for_each(|n| *n = 0);
        }
        self.frozen = frozen;
        for slot in self.slot_ids() {
            self.update_blind(slot, now);
        }
        Vec::new()
    }

    /// The reader of `slot`'s notify socket stalls on a flood, or reads
    /// again: that engine alone goes blind, or sees again.
    pub(super) fn on_stalled(&mut self, slot: SlotId, stalled: bool, now: Duration) -> Vec<Action> {
        self.stalled[slot.index()] = stalled;
        self.update_blind(slot, now);
        Vec::new()
    }

    /// Starts or ends `slot`'s blindness as its reasons say. When it ends,
    /// the time it could not see is taken out of the engine's clocks, not
    /// restarted: it keeps the budget it had when it went blind, so
    /// blindness that comes back again and again (a flood each second)
    /// slows the detection of a hung engine, never stops it.
    fn update_blind(&mut self, slot: SlotId, now: Duration) {
        let i = slot.index();
        let blind = self.frozen || self.stalled[i];
        match (blind, self.blind_since[i]) {
            (true, None) => self.blind_since[i] = Some(now),
            (false, Some(at)) => {
                self.blind_since[i] = None;
                let by = now.saturating_sub(at);
                self.watchdogs[i].shift(by);
                self.starts[i].shift(by);
            }
            _ => {}
        }
    }

    /// When the watchdog of the engine of `slot` expires: `None` unless it
    /// is armed, on an engine that may still hang (or the expiry is past
    /// any clock).
    pub(super) fn watchdog_expiry(&self, slot: SlotId) -> Option<Duration> {
        if !self.may_hang(slot) || !self.sees(slot) {
            return None;
        }
        self.watchdogs[slot.index()].expiry(self.watchdog?)
    }

    /// When the start clock of the engine of `slot` expires: `None` once
    /// it parked or serves (or holds the lock, waking), and without a
    /// start timeout.
    pub(super) fn start_expiry(&self, slot: SlotId) -> Option<Duration> {
        if !self.may_hang(slot)
            || !self.sees(slot)
            || self.slot(slot).state != EngineState::Starting
            || self.active == Some(slot)
        {
            return None;
        }
        self.starts[slot.index()].expiry()
    }

    /// Whether a probe of `slot` now would be of the engine that serves.
    pub(super) fn probe_counts(&self, slot: SlotId) -> bool {
        self.active == Some(slot)
            && self.slot(slot).state == EngineState::Active
            && self.may_hang(slot)
    }

    /// The engine of `slot` hung (`cause`, seen at `now`): kill it, and
    /// keep why for its reap. Its clocks stop: it is not ended twice.
    fn end_hung(&mut self, slot: SlotId, cause: HangCause, now: Duration) -> Action {
        self.hung[slot.index()] = Some(Hang {
            cause,
            detected_at: now,
            killed_at: None,
        });
        self.watchdogs[slot.index()].disarm();
        Action::Kill { slot }
    }
}
