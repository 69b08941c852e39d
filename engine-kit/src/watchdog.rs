//! The engine's side of the pair's watchdog (`shadow.dev/watchdog`, issue
//! 22): the small pure helpers an engine written in Rust needs to keep it
//! fed, and nothing that does I/O beyond reading two variables.
//!
//! With `shadow.dev/watchdog=<duration>` every engine gets
//! [`WATCHDOG_USEC`](shadow_contract::env::WATCHDOG_USEC) and
//! [`WATCHDOG_PID`](shadow_contract::env::WATCHDOG_PID) (systemd's convention,
//! `sd_watchdog_enabled(3)`). Its first `WATCHDOG=1` on `NOTIFY_SOCKET` arms
//! it; from then on a gap between two pings longer than the interval ends
//! the engine (every process of it) and fails it over. The runtime cannot
//! tell a stuck decode step from a slow one; only the engine can, by
//! pinging from the loops that do the work, so that a stuck loop stops the
//! pings. A side thread that pings on a timer would keep a hung engine
//! alive, which is why these helpers decide *when* a ping is due and leave
//! the sending to the loop that calls them:
//!
//! - [`interval_from_env`]: the interval, or `None` when this process has
//!   no watchdog (as `sd_watchdog_enabled(3)` reads it);
//! - [`Pacer`]: whether a ping is due (half the interval since the last,
//!   systemd's advice) and how long a loop may block before it is, for its
//!   `poll`/`recv_timeout`;
//! - [`Progress`]: for an engine of several workers or ranks, whether every
//!   one of them advanced since the last ping. Its main process pings only
//!   when `pacer.due(now) && progress.all_advanced()`, then calls
//!   [`Pacer::pinged`] and [`Progress::reset`].
//!
//! The `sd-notify` crate's `watchdog_enabled()` reads the same variables,
//! but this crate keeps its own reading, which is systemd's: a
//! `WATCHDOG_USEC` of `0`, with a sign or with anything but digits means no
//! watchdog (the crate takes `0` as an interval of zero and accepts `+5`),
//! and so does a `WATCHDOG_PID` that is not a pid (the crate ignores one it
//! cannot parse; systemd refuses it).

use std::ffi::OsString;
use std::time::{Duration, Instant};

use shadow_contract::env;

/// The interval of this process's watchdog: `WATCHDOG_USEC` microseconds
/// when it is set, digits only and more than zero, and `WATCHDOG_PID` is
/// unset or this process's pid (`getpid()`); otherwise `None`, and the
/// engine sends no ping. Under the shim `WATCHDOG_PID` is `1`, the engine's
/// main process: the other processes of a group (ranks, helpers started by
/// it) inherit the variables and read `None` here.
pub fn interval_from_env() -> Option<Duration> {
    interval_from(
        std::env::var_os(env::WATCHDOG_USEC),
        std::env::var_os(env::WATCHDOG_PID),
        std::process::id(),
    )
}

/// [`interval_from_env`] on given values: `usec` and `pid` as the
/// variables hold them (`None`: unset), `own_pid` the caller's pid.
pub fn interval_from(
    usec: Option<OsString>,
    pid: Option<OsString>,
    own_pid: u32,
) -> Option<Duration> {
    if let Some(pid) = pid {
        // Set but not a pid: no watchdog, as sd_watchdog_enabled(3) says.
        if digits(&pid)? != u64::from(own_pid) {
            return None;
        }
    }
    let usec = digits(&usec?)?;
    (usec > 0).then(|| Duration::from_micros(usec))
}

/// A decimal number of digits only (no sign, no space), that fits a `u64`.
fn digits(value: &OsString) -> Option<u64> {
    let s = value.to_str()?;
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

/// When a ping is due: half the interval after the last one (systemd's
/// advice: one late wake-up then still lands inside the interval). A pacer
/// that never pinged is due at once, so the first check arms the watchdog.
#[derive(Debug, Clone)]
pub struct Pacer {
    interval: Duration,
    last: Option<Instant>,
}

impl Pacer {
    /// A pacer for a watchdog of `interval`, due at once.
    pub fn new(interval: Duration) -> Pacer {
        Pacer {
            interval,
            last: None,
        }
    }

    /// The watchdog's interval.
    pub fn interval(&self) -> Duration {
        self.interval
    }

    /// Paces for another interval from now on (after the engine sent its
    /// own `WATCHDOG_USEC=`); the last ping still counts.
    pub fn set_interval(&mut self, interval: Duration) {
        self.interval = interval;
    }

    /// Time between two pings: half the interval.
    fn period(&self) -> Duration {
        self.interval / 2
    }

    /// Whether a ping is due at `now`: never pinged, or half the interval
    /// (or more) since the last ping.
    pub fn due(&self, now: Instant) -> bool {
        self.wait(now).is_zero()
    }

    /// Records a ping sent at `now`.
    pub fn pinged(&mut self, now: Instant) {
        self.last = Some(now);
    }

    /// How long from `now` until the next ping is due (zero when it is),
    /// for a `poll` or `recv_timeout` of the loop that pings.
    pub fn wait(&self, now: Instant) -> Duration {
        match self.last {
            None => Duration::ZERO,
            Some(last) => self
                .period()
                .saturating_sub(now.saturating_duration_since(last)),
        }
    }
}

/// Which of an engine's ranks (or workers) advanced since the last ping.
/// The process that pings for all of them marks a rank when it reports a
/// step, and pings only when every rank did: a rank stuck in a collective
/// or a kernel stops its reports, so the pings stop and the watchdog ends
/// the whole engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Progress {
    advanced: Vec<bool>,
}

impl Progress {
    /// `ranks` ranks, none advanced yet.
    pub fn new(ranks: usize) -> Progress {
        Progress {
            advanced: vec![false; ranks],
        }
    }

    /// How many ranks it follows.
    pub fn ranks(&self) -> usize {
        self.advanced.len()
    }

    /// Marks `rank` as advanced. A rank out of range (a report that names
    /// no rank of this engine) changes nothing.
    pub fn advanced(&mut self, rank: usize) {
        if let Some(a) = self.advanced.get_mut(rank) {
            *a = true;
        }
    }

    /// Whether every rank advanced since the last [`reset`](Self::reset)
    /// (always, with no ranks).
    pub fn all_advanced(&self) -> bool {
        self.advanced.iter().all(|&a| a)
    }

    /// Forgets every mark: called with each ping.
    pub fn reset(&mut self) {
        self.advanced.fill(false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(s: &str) -> Option<OsString> {
        Some(OsString::from(s))
    }

    #[test]
    fn the_interval_is_read_as_systemd_reads_it() {
        let us = |usec: Option<OsString>, pid: Option<OsString>| interval_from(usec, pid, 42);
        assert_eq!(us(os("500000"), None), Some(Duration::from_millis(500)));
        assert_eq!(us(os("500000"), os("42")), Some(Duration::from_millis(500)));
        assert_eq!(us(os("1"), os("42")), Some(Duration::from_micros(1)));
        // Another process's watchdog (a rank that inherited the variables).
        assert_eq!(us(os("500000"), os("1")), None);
        // No watchdog: unset, zero, not digits, too large.
        assert_eq!(us(None, None), None);
        assert_eq!(us(None, os("42")), None);
        for bad in [
            "",
            "0",
            "+5",
            "-5",
            " 5",
            "5 ",
            "5s",
            "0x10",
            "18446744073709551616",
        ] {
            assert_eq!(us(os(bad), None), None, "WATCHDOG_USEC={bad:?}");
        }
        // A WATCHDOG_PID that is not a pid disables it, as in systemd.
        for bad in ["", "x", "+42", "42 ", "-1"] {
            assert_eq!(us(os("500000"), os(bad)), None, "WATCHDOG_PID={bad:?}");
        }
        assert_eq!(
            us(os(&u64::MAX.to_string()), None),
            Some(Duration::from_micros(u64::MAX))
        );
    }

    #[test]
    fn not_utf8_is_no_watchdog() {
        use std::os::unix::ffi::OsStringExt;
        let odd = || Some(OsString::from_vec(vec![b'5', 0xff]));
        assert_eq!(interval_from(odd(), None, 42), None);
        assert_eq!(interval_from(os("5"), odd(), 42), None);
    }

    #[test]
    fn a_pacer_is_due_at_once_then_every_half_interval() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut p = Pacer::new(ms(100));
        assert_eq!(p.interval(), ms(100));
        assert!(p.due(t0), "never pinged: due, which arms the watchdog");
        assert_eq!(p.wait(t0), Duration::ZERO);
        p.pinged(t0);
        assert!(!p.due(t0));
        assert_eq!(p.wait(t0), ms(50));
        assert!(!p.due(t0 + ms(49)));
        assert_eq!(p.wait(t0 + ms(30)), ms(20));
        assert!(p.due(t0 + ms(50)));
        assert_eq!(p.wait(t0 + ms(50)), Duration::ZERO);
        assert_eq!(
            p.wait(t0 + ms(500)),
            Duration::ZERO,
            "late: due, not negative"
        );
        // A clock read before the ping (another thread's `now`) is not due.
        p.pinged(t0 + ms(60));
        assert_eq!(p.wait(t0 + ms(10)), ms(50));
        // A new interval paces from the same last ping.
        p.set_interval(ms(20));
        assert!(p.due(t0 + ms(70)));
        assert!(!p.due(t0 + ms(69)));
    }

    #[test]
    fn an_interval_too_short_to_halve_is_always_due() {
        let t0 = Instant::now();
        let mut p = Pacer::new(Duration::from_nanos(1));
        p.pinged(t0);
        assert!(p.due(t0));
    }

    #[test]
    fn progress_needs_every_rank_since_the_reset() {
        let mut g = Progress::new(3);
        assert_eq!(g.ranks(), 3);
        assert!(!g.all_advanced());
        g.advanced(0);
        g.advanced(2);
        g.advanced(2);
        assert!(!g.all_advanced(), "rank 1 never advanced");
        g.advanced(7); // no such rank: ignored
        assert!(!g.all_advanced());
        g.advanced(1);
        assert!(g.all_advanced());
        g.reset();
        assert!(!g.all_advanced(), "a reset forgets every mark");
        assert!(
            Progress::new(0).all_advanced(),
            "no ranks: nothing to wait for"
        );
    }

    #[test]
    fn the_main_process_pings_only_when_due_and_every_rank_advanced() {
        // The loop of a group's main process, on a clock of its own.
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut pacer = Pacer::new(ms(100));
        let mut progress = Progress::new(2);
        let mut pings = Vec::new();
        let mut tick = |at: Duration, pacer: &mut Pacer, progress: &mut Progress| {
            let now = t0 + at;
            if pacer.due(now) && progress.all_advanced() {
                pacer.pinged(now);
                progress.reset();
                pings.push(at);
            }
        };
        progress.advanced(0);
        progress.advanced(1);
        tick(ms(0), &mut pacer, &mut progress);
        progress.advanced(0);
        progress.advanced(1);
        tick(ms(40), &mut pacer, &mut progress); // not due yet
        tick(ms(50), &mut pacer, &mut progress);
        // Rank 1 is stuck from now on: rank 0's steps are not enough.
        for at in [60, 100, 150, 200, 400] {
            progress.advanced(0);
            tick(ms(at), &mut pacer, &mut progress);
        }
        assert_eq!(pings, vec![ms(0), ms(50)]);
    }
}
