//! One engine's clocks, as systemd keeps them: its watchdog (sd_notify(3),
//! `WatchdogSec=`): armed by the first ping, each ping moving its expiry to
//! one interval later, the engine free to set its own interval; and its
//! start clock (`TimeoutStartSec=`, extended by `EXTEND_TIMEOUT_USEC=`). It exists
//! so that the arithmetic of one clock sits apart from the rules that
//! decide whom to watch and what to do when one expires (`pair::hang`),
//! as a failover's timeline (`promotion`) sits apart from the handover.
//!
//! What may be touched here: how a ping, a new interval or an expiry is
//! counted. Whom to watch, and what an expiry leads to, is `pair::hang`'s.

use std::time::Duration;

/// The watchdog of one engine (one generation of a slot). The default is
/// a new engine's: unarmed, at the pair's interval.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Watchdog {
    /// The latest ping (`WATCHDOG=1`); `None`: not armed.
    last_ping: Option<Duration>,
    /// The engine's own interval (`WATCHDOG_USEC=`), over the pair's.
    interval: Option<Duration>,
}

impl Watchdog {
    /// A ping at `now`: arms the watchdog, or moves its expiry on. Pings
    /// may be seen out of time order: the latest counts.
    pub(crate) fn ping(&mut self, now: Duration) {
        self.last_ping = Some(self.last_ping.map_or(now, |p| p.max(now)));
    }

    /// The engine's own interval, from `now` on: as systemd does, a new
    /// interval restarts an armed watchdog's timer; an unarmed one stays
    /// unarmed.
    pub(crate) fn set_interval(&mut self, interval: Duration, now: Duration) {
        self.interval = Some(interval);
        if self.last_ping.is_some() {
            self.ping(now);
        }
    }

    /// Moves an armed watchdog's last ping `by` later (time the pair could
    /// not see the engine's pings is not held against it); an unarmed one
    /// stays unarmed.
    pub(crate) fn shift(&mut self, by: Duration) {
        self.last_ping = self.last_ping.and_then(|p| p.checked_add(by));
    }

    /// Whether a ping armed it (and it was not disarmed since).
    pub(crate) fn armed(&self) -> bool {
        self.last_ping.is_some()
    }

    /// Stops the clock (its engine is being ended): no expiry until the
    /// next ping.
    pub(crate) fn disarm(&mut self) {
        self.last_ping = None;
    }

    /// Its interval: the engine's own, else the pair's.
    pub(crate) fn interval(&self, pair_interval: Duration) -> Duration {
        self.interval.unwrap_or(pair_interval)
    }

    /// When it expires, given the pair's interval: `None` while unarmed,
    /// or when the expiry is past any clock. It has expired once `now`
    /// passes this (a gap of exactly the interval is fine).
    pub(crate) fn expiry(&self, pair_interval: Duration) -> Option<Duration> {
        self.last_ping?
            .checked_add(self.interval.unwrap_or(pair_interval))
    }
}

/// The start clock of one engine: when it must have parked or served.
/// The default is a clock not started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct StartClock {
    /// The start timeout's end, from the engine's start.
    deadline: Option<Duration>,
    /// The end of the engine's latest `EXTEND_TIMEOUT_USEC=` (its start
    /// plus the extension).
    extended: Option<Duration>,
}

impl StartClock {
    /// The engine started at `now`, with `timeout` to park or serve.
    pub(crate) fn started(now: Duration, timeout: Duration) -> StartClock {
        StartClock {
            deadline: now.checked_add(timeout),
            extended: None,
        }
    }

    /// `EXTEND_TIMEOUT_USEC=` at `now`: as systemd reads it, the engine
    /// will send another message within `by`; the clock then ends at the
    /// later of the timeout and `now + by`. The latest extension counts
    /// (a shorter one may take back a longer one, down to the timeout).
    pub(crate) fn extend(&mut self, by: Duration, now: Duration) {
        if self.deadline.is_some() {
            self.extended = now.checked_add(by);
        }
    }

    /// Moves the clock `by` later (a pause the engine could not start in).
    pub(crate) fn shift(&mut self, by: Duration) {
        self.deadline = self.deadline.and_then(|d| d.checked_add(by));
        self.extended = self.extended.and_then(|d| d.checked_add(by));
    }

    /// When it expires: `None` if not started (or past any clock). Expired
    /// once `now` passes this.
    pub(crate) fn expiry(&self) -> Option<Duration> {
        let d = self.deadline?;
        Some(self.extended.map_or(d, |e| e.max(d)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(ms: u64) -> Duration {
        Duration::from_millis(ms)
    }

    #[test]
    fn keeps_time() {
        let mut w = Watchdog::default();
        assert_eq!(w.expiry(t(100)), None, "unarmed");
        w.set_interval(t(40), t(5));
        assert_eq!(w.expiry(t(100)), None, "an interval arms nothing");
        w.ping(t(10));
        assert_eq!(w.expiry(t(100)), Some(t(50)), "the engine's own interval");
        w.ping(t(8));
        assert_eq!(
            w.expiry(t(100)),
            Some(t(50)),
            "a late ping moves nothing back"
        );
        w.set_interval(t(1000), t(30));
        assert_eq!(w.expiry(t(100)), Some(t(1030)), "restarted from now");
        w.shift(t(2000));
        assert_eq!(w.expiry(t(100)), Some(t(3030)), "the blind time taken out");
        w.disarm();
        assert_eq!(w.expiry(t(100)), None);
        w.shift(t(3000));
        assert_eq!(w.expiry(t(100)), None, "an unarmed one stays unarmed");
        let mut w = Watchdog::default();
        w.ping(t(1));
        assert_eq!(w.expiry(t(100)), Some(t(101)), "the pair's interval");
        assert_eq!(w.expiry(Duration::MAX), None, "past any clock");
    }

    #[test]
    fn start_clock_is_extended_as_systemd_does() {
        let mut c = StartClock::default();
        assert_eq!(c.expiry(), None, "not started");
        c.extend(t(500), t(1));
        assert_eq!(c.expiry(), None, "an extension starts nothing");
        let mut c = StartClock::started(t(10), t(100));
        assert_eq!(c.expiry(), Some(t(110)));
        c.extend(t(20), t(50));
        assert_eq!(c.expiry(), Some(t(110)), "never earlier than the timeout");
        c.extend(t(200), t(100));
        assert_eq!(c.expiry(), Some(t(300)));
        c.extend(t(30), t(150));
        assert_eq!(c.expiry(), Some(t(180)), "the latest extension counts");
        c.shift(t(1000));
        assert_eq!(c.expiry(), Some(t(1180)));
        assert_eq!(StartClock::started(t(1), Duration::MAX).expiry(), None);
    }
}
