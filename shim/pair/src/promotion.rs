//! One failover's timeline. The signs that the active engine is gone reach
//! the shim on different paths — the reaper, `/proc/locks`, the successor's
//! `READY=1` on the notify socket — and in any order: the kernel drops a
//! dead engine's lock before the shim reaps it, so the successor often says
//! `READY=1` first. A [`Handover`] collects the signs, each at the time it
//! was observed, until the promotion is complete (the successor serves and
//! the old active is reaped), and then yields the [`Promotion`] record.
//! No sign is held back or replayed, so no order needs a timeout.

use std::time::Duration;

use serde::Serialize;

use crate::failure::{Exit, FailureClass, Hang};
use crate::slot::SlotId;

pub use shadow_contract::state::DeathSign;

/// The timeline of one failover. Times are since the supervisor started,
/// each taken where the fact was observed (the reaper's time for the reap).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Promotion {
    /// Failover number, from 1.
    pub number: u64,
    pub from: SlotId,
    pub to: Option<SlotId>,
    /// The first sign that the active engine was gone: the earliest of its
    /// reap, the lock seen free or held by the successor, the successor's
    /// `READY=1`.
    pub death_at: Duration,
    /// Which sign that was.
    pub death_seen: DeathSign,
    /// When the reaper collected the dead active engine.
    pub reaped_at: Duration,
    /// When the new active engine was seen holding the lock (only engines
    /// without sd_notify are watched in `/proc/locks`).
    pub lock_at: Option<Duration>,
    /// When it sent `READY=1`.
    pub ready_at: Option<Duration>,
    pub exit: Exit,
    pub class: FailureClass,
    /// The old active was ended as hung: why, when that was seen (then
    /// the death: `death_seen` is `hang`) and when it was killed.
    pub hang: Option<Hang>,
}

impl Promotion {
    /// Death observed → `READY=1` (→ lock for engines without sd_notify).
    pub fn total(&self) -> Option<Duration> {
        self.ready_at
            .or(self.lock_at)
            .map(|t| t.saturating_sub(self.death_at))
    }
}

/// The reap of the old active: when, how it ended, and its class.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Reap {
    at: Duration,
    exit: Exit,
    class: FailureClass,
}

/// A failover in progress: the signs seen so far.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Handover {
    from: SlotId,
    to: Option<SlotId>,
    death_at: Duration,
    death_seen: DeathSign,
    reap: Option<Reap>,
    lock_at: Option<Duration>,
    ready_at: Option<Duration>,
    /// The old active was ended as hung.
    hang: Option<Hang>,
    /// The successor serves: `READY=1`, or the lock for an engine that
    /// does not speak sd_notify.
    serving: bool,
}

impl Handover {
    pub(crate) fn begin(from: SlotId, at: Duration, sign: DeathSign) -> Handover {
        Handover {
            from,
            to: None,
            death_at: at,
            death_seen: sign,
            reap: None,
            lock_at: None,
            ready_at: None,
            hang: None,
            serving: false,
        }
    }

    /// The old active was ended as hung: the hang's detection is the
    /// first sign of its end (it came before the kill).
    pub(crate) fn hung(&mut self, hang: Hang) {
        self.hang = Some(hang);
        self.sign(hang.detected_at, DeathSign::Hang);
    }

    pub(crate) fn from(&self) -> SlotId {
        self.from
    }

    /// The old active is dead or leaving but not reaped yet.
    pub(crate) fn awaits_reap(&self) -> bool {
        self.reap.is_none()
    }

    /// The successor serves (its `READY=1`, or the lock without sd_notify).
    pub(crate) fn serving(&self) -> bool {
        self.serving
    }

    /// A sign of death at `at`: the earliest one is the death.
    pub(crate) fn sign(&mut self, at: Duration, sign: DeathSign) {
        if at < self.death_at {
            self.death_at = at;
            self.death_seen = sign;
        }
    }

    pub(crate) fn reaped(&mut self, at: Duration, exit: Exit, class: FailureClass) {
        if self.reap.is_none() {
            self.reap = Some(Reap { at, exit, class });
            self.sign(at, DeathSign::Reap);
        }
    }

    pub(crate) fn lock_taken(&mut self, by: SlotId, at: Duration, serves: bool) {
        self.to = Some(by);
        if self.lock_at.is_none() {
            self.lock_at = Some(at);
        }
        self.sign(at, DeathSign::LockTaken);
        self.serving |= serves;
    }

    pub(crate) fn ready(&mut self, by: SlotId, at: Duration) {
        self.to = Some(by);
        if self.ready_at.is_none() {
            self.ready_at = Some(at);
        }
        self.sign(at, DeathSign::Ready);
        self.serving = true;
    }

    /// The record (failover `number`), once the successor serves and the
    /// old active is reaped.
    pub(crate) fn complete(&self, number: u64) -> Option<Promotion> {
        let reap = self.reap?;
        if !self.serving {
            return None;
        }
        Some(Promotion {
            number,
            from: self.from,
            to: self.to,
            death_at: self.death_at,
            death_seen: self.death_seen,
            reaped_at: reap.at,
            lock_at: self.lock_at,
            ready_at: self.ready_at,
            exit: reap.exit,
            class: reap.class,
            hang: self.hang,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(ms: u64) -> Duration {
        Duration::from_millis(ms)
    }

    #[test]
    fn the_earliest_sign_is_the_death_whatever_the_order_of_arrival() {
        // READY handled first, the reap (earlier, by the reaper's clock) after.
        let mut h = Handover::begin(SlotId::ZERO, t(12), DeathSign::Ready);
        h.ready(SlotId::ONE, t(12));
        assert_eq!(h.complete(1), None, "not reaped yet");
        h.reaped(t(10), Exit::Signal(9), FailureClass::DevicePreserving);
        let p = h.complete(1).expect("complete");
        assert_eq!((p.death_at, p.death_seen), (t(10), DeathSign::Reap));
        assert_eq!(p.total(), Some(t(2)));
        assert_eq!(p.reaped_at, t(10));
        // The reap really after READY: READY stays the death, total 0.
        let mut h = Handover::begin(SlotId::ZERO, t(12), DeathSign::Ready);
        h.ready(SlotId::ONE, t(12));
        h.reaped(t(13), Exit::Signal(9), FailureClass::DevicePreserving);
        let p = h.complete(1).expect("complete");
        assert_eq!((p.death_at, p.death_seen), (t(12), DeathSign::Ready));
        assert_eq!(p.total(), Some(Duration::ZERO));
    }

    #[test]
    fn a_lock_seen_taken_by_a_notify_engine_does_not_complete_it() {
        let mut h = Handover::begin(SlotId::ZERO, t(5), DeathSign::LockFree);
        h.reaped(t(6), Exit::Code(1), FailureClass::DevicePreserving);
        h.lock_taken(SlotId::ONE, t(7), false);
        assert_eq!(h.complete(1), None, "waits for READY=1");
        h.ready(SlotId::ONE, t(9));
        let p = h.complete(1).expect("complete");
        assert_eq!(p.death_seen, DeathSign::LockFree);
        assert_eq!((p.lock_at, p.ready_at), (Some(t(7)), Some(t(9))));
        assert_eq!(p.total(), Some(t(4)));
    }
}
