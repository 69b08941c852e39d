//! An engine ended because it hung. For now the one sign is its watchdog,
//! as systemd defines it (sd_notify(3), `WatchdogSec=`; issue 22): the
//! pair's interval ([`Pair::with_watchdog`]), armed by the engine's first
//! `WATCHDOG=1`; once armed, a gap longer than the interval ends the
//! engine at the next [`Event::WatchdogCheck`](crate::Event::WatchdogCheck),
//! and `WATCHDOG=trigger` ends it at once. `WATCHDOG_USEC=` sets that engine's
//! own interval. It exists because a hung engine never dies on its own:
//! this is the one place a live engine is ended for what it did not do.
//!
//! Ending is [`Action::Kill`]; the pair records why ([`HangCause`]) and
//! decides nothing else until the reap, so a hung engine's death takes the
//! path of every death (`death`): a hung active fails over, a hung shadow
//! is respawned while the active serves, a single engine restarts in place.
//!
//! What may be touched here: which engines are watched, when a hang ends
//! one, and a new sign of a hang (issue 22's probe and start timeout go
//! here). How one engine's watchdog keeps time is `crate::watchdog`'s;
//! what the death then means is `death`'s.

use std::time::Duration;

use super::Pair;
use crate::failure::HangCause;
use crate::notify::Notification;
use crate::slot::SlotId;
use crate::vocabulary::{Action, EngineState};

impl Pair {
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
        let s = &mut self.slots[slot.index()];
        if s.state == EngineState::Spawning {
            // It speaks, so it runs: its spawn is reported later.
            s.state = EngineState::Starting;
        }
        if !s.alive() || s.state == EngineState::Superseded || self.hung[slot.index()].is_some() {
            return Vec::new();
        }
        let w = &mut self.watchdogs[slot.index()];
        match n {
            Notification::WatchdogPing => w.ping(now),
            Notification::WatchdogUsec(interval) => w.set_interval(interval, now),
            Notification::WatchdogTrigger => return vec![self.end_hung(slot, HangCause::Trigger)],
            _ => {}
        }
        Vec::new()
    }

    /// Ends every engine whose armed watchdog expired before `now`.
    pub(super) fn on_watchdog_check(&mut self, now: Duration) -> Vec<Action> {
        if self.ending.is_some() || self.cold_restart {
            return Vec::new();
        }
        SlotId::BOTH
            .into_iter()
            .filter(|s| self.watchdog_expiry(*s).is_some_and(|e| now > e))
            .collect::<Vec<_>>()
            .into_iter()
            .map(|s| self.end_hung(s, HangCause::Watchdog))
            .collect()
    }

    /// When the watchdog of the engine of `slot` expires: `None` unless it
    /// is armed, on a live engine not superseded nor already ended (or the
    /// expiry is past any clock).
    pub(super) fn watchdog_expiry(&self, slot: SlotId) -> Option<Duration> {
        let s = self.slot(slot);
        if !s.alive() || s.state == EngineState::Superseded || self.hung[slot.index()].is_some() {
            return None;
        }
        self.watchdogs[slot.index()].expiry(self.watchdog?)
    }

    /// The engine of `slot` hung (`cause`): kill it, and keep why for its
    /// reap. Its watchdog stops: it is not ended twice.
    fn end_hung(&mut self, slot: SlotId, cause: HangCause) -> Action {
        self.hung[slot.index()] = Some(cause);
        self.watchdogs[slot.index()].disarm();
        Action::Kill { slot }
    }
}
