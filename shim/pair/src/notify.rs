//! The sd_notify messages engines send on `NOTIFY_SOCKET`.
//!
//! The protocol is systemd's: one datagram of newline-separated `KEY=VALUE`
//! assignments. Engines use stock libraries (`sd-notify`, Python `sdnotify`),
//! so the shim must accept exactly what those send and ignore what it does
//! not understand.

use std::time::Duration;

use serde::Serialize;

/// One assignment the supervisor acts on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Notification {
    /// `READY=1`: the engine holds the lock and serves.
    Ready,
    /// `STATUS=parked` (any status text is kept): free-form state; `parked`
    /// means initialised and blocked on the lock.
    Status(String),
    /// `STOPPING=1`.
    Stopping,
    /// `ERRNO=n`: the engine reports a failure before it exits.
    Errno(i32),
    /// `WATCHDOG=1`: the engine is alive; its first one arms its watchdog.
    WatchdogPing,
    /// `WATCHDOG=trigger`: the engine knows it is broken and asks to be
    /// ended now.
    WatchdogTrigger,
    /// `WATCHDOG_USEC=n`: the engine sets its own watchdog interval, in
    /// microseconds. Never zero: `0`, a value that is not a whole number
    /// of microseconds or one past `u64` is ignored.
    WatchdogUsec(Duration),
    /// `EXTEND_TIMEOUT_USEC=n`: a starting engine asks for more time
    /// before its start timeout (systemd's meaning: it will send another
    /// message within `n` µs). Never zero, parsed as `WATCHDOG_USEC=`.
    ExtendTimeout(Duration),
}

impl Notification {
    /// True for `STATUS=parked`, the engine contract's parked signal.
    pub fn is_parked(&self) -> bool {
        matches!(self, Notification::Status(s) if s.trim() == "parked")
    }

    /// True for the watchdog's messages (`WATCHDOG=1`, `WATCHDOG=trigger`,
    /// `WATCHDOG_USEC=`).
    pub fn is_watchdog(&self) -> bool {
        matches!(
            self,
            Notification::WatchdogPing
                | Notification::WatchdogTrigger
                | Notification::WatchdogUsec(_)
        )
    }
}

/// Largest datagram the shim reads; systemd's own limit is in this range and
/// nothing the engine contract needs comes close.
pub const MAX_DATAGRAM: usize = 4096;

/// The notifications in one datagram, in order. Unknown keys, malformed
/// lines and invalid UTF-8 are ignored: a confused engine must not be able to
/// confuse the supervisor.
pub fn parse_notify(datagram: &[u8]) -> Vec<Notification> {
    let datagram = &datagram[..datagram.len().min(MAX_DATAGRAM)];
    let Ok(text) = std::str::from_utf8(datagram) else {
        return Vec::new();
    };
    text.lines()
        .filter_map(|line| {
            let (key, value) = line.split_once('=')?;
            match key {
                "READY" if value == "1" => Some(Notification::Ready),
                "STOPPING" if value == "1" => Some(Notification::Stopping),
                "STATUS" => Some(Notification::Status(value.to_string())),
                "ERRNO" => value.trim().parse().ok().map(Notification::Errno),
                "WATCHDOG" if value == "1" => Some(Notification::WatchdogPing),
                "WATCHDOG" if value == "trigger" => Some(Notification::WatchdogTrigger),
                "WATCHDOG_USEC" => watchdog_usec(value).map(Notification::WatchdogUsec),
                "EXTEND_TIMEOUT_USEC" => watchdog_usec(value).map(Notification::ExtendTimeout),
                _ => None,
            }
        })
        .collect()
}

/// A `WATCHDOG_USEC=` value: a whole, non-zero number of microseconds
/// that fits a `u64` (systemd's own type). Anything else is not an
/// interval.
fn watchdog_usec(value: &str) -> Option<Duration> {
    let value = value.trim();
    if value.is_empty() || !value.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let usec: u64 = value.parse().ok()?;
    (usec > 0).then(|| Duration::from_micros(usec))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_what_libraries_send() {
        assert_eq!(parse_notify(b"READY=1"), vec![Notification::Ready]);
        assert_eq!(
            parse_notify(b"STATUS=parked\n"),
            vec![Notification::Status("parked".into())]
        );
        assert!(parse_notify(b"STATUS=parked")[0].is_parked());
        assert!(!parse_notify(b"STATUS=loading weights")[0].is_parked());
        assert_eq!(
            parse_notify(b"READY=1\nSTATUS=serving on :8000\nMAINPID=7\n"),
            vec![
                Notification::Ready,
                Notification::Status("serving on :8000".into())
            ]
        );
        assert_eq!(
            parse_notify(b"STOPPING=1\nERRNO=12"),
            vec![Notification::Stopping, Notification::Errno(12)]
        );
    }

    #[test]
    fn parses_the_watchdog() {
        assert_eq!(
            parse_notify(b"WATCHDOG=1\nFDSTORE=1"),
            vec![Notification::WatchdogPing]
        );
        assert_eq!(
            parse_notify(
                b"EXTEND_TIMEOUT_USEC=5000000\nEXTEND_TIMEOUT_USEC=0\nEXTEND_TIMEOUT_USEC=-1"
            ),
            vec![Notification::ExtendTimeout(Duration::from_secs(5))]
        );
        assert_eq!(
            parse_notify(b"WATCHDOG=trigger\n"),
            vec![Notification::WatchdogTrigger]
        );
        assert_eq!(
            parse_notify(b"WATCHDOG_USEC=250000\nWATCHDOG=1"),
            vec![
                Notification::WatchdogUsec(Duration::from_millis(250)),
                Notification::WatchdogPing
            ]
        );
        assert_eq!(
            parse_notify(b"WATCHDOG_USEC=18446744073709551615"),
            vec![Notification::WatchdogUsec(Duration::from_micros(u64::MAX))]
        );
        // Nothing an engine writes makes an interval of zero, a negative
        // or fractional one, or one past u64: all ignored.
        for bad in [
            &b"WATCHDOG_USEC=0"[..],
            b"WATCHDOG_USEC=",
            b"WATCHDOG_USEC=-5",
            b"WATCHDOG_USEC=+5",
            b"WATCHDOG_USEC=1.5",
            b"WATCHDOG_USEC=1e6",
            b"WATCHDOG_USEC=100ms",
            b"WATCHDOG_USEC=18446744073709551616",
            b"WATCHDOG_USEC=99999999999999999999999999999",
            b"WATCHDOG=Trigger",
            b"WATCHDOG=",
        ] {
            assert!(
                parse_notify(bad).is_empty(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn ignores_what_it_does_not_understand() {
        assert!(parse_notify(b"").is_empty());
        assert!(parse_notify(b"READY=0").is_empty());
        assert!(parse_notify(b"READY").is_empty());
        assert!(parse_notify(b"ERRNO=x").is_empty());
        assert!(parse_notify(b"FDSTORE=1\nWATCHDOG=0\nWATCHDOG=2").is_empty());
        assert!(parse_notify(&[0xff, 0xfe, b'\n']).is_empty());
        let mut big = b"READY=1\n".to_vec();
        big.resize(MAX_DATAGRAM * 2, b'x');
        assert_eq!(parse_notify(&big), vec![Notification::Ready]);
    }
}
