//! The supervisor's wakes without an input: when the next one is due (the
//! lock's poll, a hang deadline, gmsd's status, counters to write, a
//! probe), and what it does then.

use std::time::Duration;

use shadow_pair::{Action, LockWatch};
use tokio::time::Instant;

use super::{Supervisor, GMS_STATUS_PERIOD, HANG_TICK};

impl Supervisor {
    /// When to wake without an input: to poll the lock for engines that do
    /// not speak sd_notify, to pick up gmsd's status, and to write counters
    /// that moved while their write waited ([`super::publish::COUNTERS_EVERY`]).
    pub(super) fn next_wake(&self) -> Option<Duration> {
        let now = Instant::now();
        // From the last poll, not from now: inputs (a watchdog's pings come
        // every few ms) restart this wait each time, and must not put the
        // poll off for ever.
        let lock = self
            .lock_period()
            .map(|p| (self.lock_polled + p).saturating_duration_since(now));
        let gms = self.made.gms.as_ref().map(|_| GMS_STATUS_PERIOD);
        let counters = self.publisher.counters_due(&self.pair, now);
        let hang = self.hang_wait();
        let probe = self
            .probing
            .as_ref()
            .filter(|p| !p.in_flight)
            .and_then(|p| p.next)
            .map(|at| at.saturating_duration_since(now));
        [lock, gms, counters, hang, probe]
            .into_iter()
            .flatten()
            .min()
    }

    /// How often `/proc/locks` is polled now, if at all.
    pub(super) fn lock_period(&self) -> Option<Duration> {
        match self.pair.lock_watch() {
            LockWatch::Off => None,
            LockWatch::Idle => Some(self.config.lock_poll_idle_ms),
            LockWatch::Fast => Some(self.config.lock_poll_fast_ms),
        }
        .map(Duration::from_millis)
    }

    /// How long until the pair's next hang deadline has passed (a check
    /// exactly at it ends nobody: one tick later).
    pub(super) fn hang_wait(&self) -> Option<Duration> {
        let deadline = self.pair.hang_deadline()?;
        Some(deadline.saturating_sub(self.clock.now()) + HANG_TICK)
    }

    /// A wake without an input: the lock's poll, a hang deadline passed,
    /// a probe due (the counters and gmsd's status are the publish's).
    pub(super) async fn on_wake(&mut self) -> Vec<Action> {
        let mut actions = Vec::new();
        if self
            .pair
            .hang_deadline()
            .is_some_and(|d| self.clock.now() > d)
        {
            actions.extend(self.check_hangs().await);
        }
        self.launch_probe();
        if self
            .lock_period()
            .is_some_and(|p| self.lock_polled + p <= Instant::now())
        {
            actions.extend(self.poll_lock().await);
        }
        actions
    }

    /// Ends the engines that hung (the pair decides). An engine about to
    /// be ended for its start timeout may be parked without saying so: the
    /// lock is looked at first, and one seen waiting on it is parked.
    pub(super) async fn check_hangs(&mut self) -> Vec<Action> {
        let now = self.clock.now();
        let mut actions = Vec::new();
        let starting = self
            .pair
            .slot_ids()
            .any(|s| self.pair.slot(s).state == shadow_pair::EngineState::Starting);
        if starting {
            let look = self.host.lock().await;
            for slot in self.pair.slot_ids() {
                if look.waiting.get(slot.index()).copied().unwrap_or(false) {
                    actions.extend(
                        self.pair
                            .handle(shadow_pair::Event::LockWaiting { slot }, now),
                    );
                }
            }
        }
        actions.extend(self.pair.handle(shadow_pair::Event::HangCheck, now));
        actions
    }
}
