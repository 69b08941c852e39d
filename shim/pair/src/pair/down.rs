//! Both engines stopped: for good (containerd's Stop, a crash loop, a
//! clean finish), and the task exits once nothing lives; or for a cold
//! restart (a GMS daemon died or would not start, an XID that invalidates
//! the device, corrupt weights), and GMS and both engines start afresh
//! once nothing lives, after the restart budget's backoff. It exists
//! because both ways down share one step, `Pair::end_or_kill`: kill what
//! lives, then go on.
//!
//! What may be touched here: what starts a cold restart or an ending, and
//! what follows once both engines are down. A single engine's death is
//! `death`'s, even when it leads here.

use std::time::Duration;

use super::{Ending, Pair};
use crate::failure::{ColdRestartCause, XidClass};
use crate::policy::Verdict;
use crate::vocabulary::{Action, EngineState};

impl Pair {
    /// containerd asked the task to stop: no more respawns.
    pub(super) fn on_stop(&mut self, now: Duration) -> Vec<Action> {
        if self.ending.is_some() {
            return Vec::new();
        }
        self.ending = Some(Ending::Stopping);
        self.end_or_kill(now)
    }

    /// The GMS daemon of `device` died: the weights it held are gone.
    pub(super) fn on_gms_died(&mut self, device: String, now: Duration) -> Vec<Action> {
        self.gms_alive = false;
        *self.gms_deaths.entry(device.clone()).or_default() += 1;
        self.last_cold_restart = Some(ColdRestartCause::GmsDied { device });
        self.begin_cold_restart(true, now)
    }

    /// A GMS daemon would not start again: the cold restart failed early.
    pub(super) fn on_gms_start_failed(&mut self, now: Duration) -> Vec<Action> {
        self.gms_alive = false;
        self.begin_cold_restart(false, now)
    }

    /// A cold restart's backoff is over.
    pub(super) fn on_cold_restart_due(&mut self) -> Vec<Action> {
        if self.ending.is_some() || !self.cold_waiting {
            return Vec::new();
        }
        self.cold_waiting = false;
        self.restart_cold()
    }

    /// Every XID is kept for the class of the next death; one that
    /// invalidates the device restarts the pair cold at once.
    pub(super) fn on_xid(&mut self, xid: u32, now: Duration) -> Vec<Action> {
        self.xids.push(xid);
        if XidClass::of(xid) == XidClass::DeviceInvalidating {
            self.last_cold_restart = Some(ColdRestartCause::Xid { xid });
            self.begin_cold_restart(true, now)
        } else {
            Vec::new()
        }
    }

    /// `may_be_useful`: false when the pair's GMS would not even start, so
    /// whatever the engines reached counts for nothing.
    pub(super) fn begin_cold_restart(&mut self, may_be_useful: bool, now: Duration) -> Vec<Action> {
        if self.ending.is_some() || self.cold_restart {
            return Vec::new();
        }
        self.cold_restart = true;
        // GMS state is dropped (a daemon that died has none; a living one
        // is reset before the engines start again), the KV pool with it.
        self.kv_drops += 1;
        self.last_kv_drop = self.last_cold_restart.clone();
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
    pub(super) fn end_or_kill(&mut self, now: Duration) -> Vec<Action> {
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
