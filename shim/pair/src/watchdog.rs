//! One engine's watchdog clock, as systemd keeps it (sd_notify(3),
//! `WatchdogSec=`): armed by the first ping, each ping moving its expiry to
//! one interval later, the engine free to set its own interval. It exists
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

    /// Stops the clock (its engine is being ended): no expiry until the
    /// next ping.
    pub(crate) fn disarm(&mut self) {
        self.last_ping = None;
    }

    /// When it expires, given the pair's interval: `None` while unarmed,
    /// or when the expiry is past any clock. It has expired once `now`
    /// passes this (a gap of exactly the interval is fine).
    pub(crate) fn expiry(&self, pair_interval: Duration) -> Option<Duration> {
        self.last_ping?
            .checked_add(self.interval.unwrap_or(pair_interval))
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
        w.disarm();
        assert_eq!(w.expiry(t(100)), None);
        let mut w = Watchdog::default();
        w.ping(t(1));
        assert_eq!(w.expiry(t(100)), Some(t(101)), "the pair's interval");
        assert_eq!(w.expiry(Duration::MAX), None, "past any clock");
    }
}
