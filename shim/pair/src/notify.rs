//! The sd_notify messages engines send on `NOTIFY_SOCKET`.
//!
//! The protocol is systemd's: one datagram of newline-separated `KEY=VALUE`
//! assignments. Engines use stock libraries (`sd-notify`, Python `sdnotify`),
//! so the shim must accept exactly what those send and ignore what it does
//! not understand.

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
}

impl Notification {
    /// True for `STATUS=parked`, the engine contract's parked signal.
    pub fn is_parked(&self) -> bool {
        matches!(self, Notification::Status(s) if s.trim() == "parked")
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
                _ => None,
            }
        })
        .collect()
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
    fn ignores_what_it_does_not_understand() {
        assert!(parse_notify(b"").is_empty());
        assert!(parse_notify(b"READY=0").is_empty());
        assert!(parse_notify(b"READY").is_empty());
        assert!(parse_notify(b"ERRNO=x").is_empty());
        assert!(parse_notify(b"WATCHDOG=1\nFDSTORE=1").is_empty());
        assert!(parse_notify(&[0xff, 0xfe, b'\n']).is_empty());
        let mut big = b"READY=1\n".to_vec();
        big.resize(MAX_DATAGRAM * 2, b'x');
        assert_eq!(parse_notify(&big), vec![Notification::Ready]);
    }
}
