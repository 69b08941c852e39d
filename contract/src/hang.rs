//! The knobs of hang detection (issue 22), typed and validated: the
//! watchdog (`shadow.dev/watchdog`, config key `pair.watchdog`), the probe
//! the runtime runs (`shadow.dev/probe`, `-period`, `-timeout`,
//! `-failures`) and the start timeout (`shadow.dev/start-timeout`).
//!
//! It exists so that the shim, the hooks and the tools read these values
//! one way and refuse a bad one with the same words (the key, the value and
//! what is allowed) before anything of a pair is made. Only the values live
//! here; acting on them (the timers, the probe, the kill) is the shim's.
//!
//! The names and defaults are a contract: they change only together with
//! docs/engine-contract.md and the shim. As with `shadow.dev/listen`, the
//! keys are spelt here and re-exported by [`crate::annotations`], which
//! may use this module; this module's code never uses it.
//!
//! Durations are a whole number and a unit, with no space and no sign:
//! `500us`, `100ms`, `2s`, `10m`, `1h`. `1500ms` rather than `1.5s`; a bare
//! number is refused, because its unit would be a guess.

use std::fmt;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::time::Duration;

use crate::error::AnnotationError;

/// `shadow.dev/watchdog` (also [`crate::annotations::WATCHDOG`]).
pub(crate) const WATCHDOG: &str = "shadow.dev/watchdog";
/// `shadow.dev/probe` (also [`crate::annotations::PROBE`]).
pub(crate) const PROBE: &str = "shadow.dev/probe";
/// `shadow.dev/probe-period` (also [`crate::annotations::PROBE_PERIOD`]).
pub(crate) const PROBE_PERIOD: &str = "shadow.dev/probe-period";
/// `shadow.dev/probe-timeout` (also [`crate::annotations::PROBE_TIMEOUT`]).
pub(crate) const PROBE_TIMEOUT: &str = "shadow.dev/probe-timeout";
/// `shadow.dev/probe-failures` (also [`crate::annotations::PROBE_FAILURES`]).
pub(crate) const PROBE_FAILURES: &str = "shadow.dev/probe-failures";
/// `shadow.dev/start-timeout` (also [`crate::annotations::START_TIMEOUT`]).
pub(crate) const START_TIMEOUT: &str = "shadow.dev/start-timeout";

/// The six keys, in the order they are checked.
pub(crate) const KEYS: [&str; 6] = [
    WATCHDOG,
    PROBE,
    PROBE_PERIOD,
    PROBE_TIMEOUT,
    PROBE_FAILURES,
    START_TIMEOUT,
];

/// The shortest watchdog interval and probe period: the bound
/// ("intervals down to 50 ms"), at which the notify gate must still pass
/// every ping of a correct engine (one each half interval).
pub const MIN_INTERVAL: Duration = Duration::from_millis(50);
/// The shortest probe timeout: below a millisecond a healthy engine on a
/// busy host fails by scheduling alone.
pub const MIN_PROBE_TIMEOUT: Duration = Duration::from_millis(1);
/// The shortest start timeout: no real engine starts faster, and a shorter
/// one would only restart healthy engines in a loop.
pub const MIN_START_TIMEOUT: Duration = Duration::from_secs(1);
/// The longest duration of any knob here: a day. Longer is no longer
/// detection, and it keeps every deadline far from `Instant`'s range.
pub const MAX_DURATION: Duration = Duration::from_secs(24 * 60 * 60);

/// The probe's period when `shadow.dev/probe-period` is not given. Faster
/// than Kubernetes' 10 s on purpose: detection in seconds is this knob's
/// reason to exist, and one connect or GET a second costs nothing.
pub const DEFAULT_PROBE_PERIOD: Duration = Duration::from_secs(1);
/// Failures in a row that end the serving engine when
/// `shadow.dev/probe-failures` is not given: Kubernetes' `failureThreshold`,
/// so that one slow answer (a long prefill, a GC pause) is not a hang.
pub const DEFAULT_PROBE_FAILURES: u32 = 3;
/// Most failures in a row `shadow.dev/probe-failures` allows. More is not
/// hang detection any more: lengthen the period instead.
pub const MAX_PROBE_FAILURES: u32 = 100;
/// The start timeout when `shadow.dev/start-timeout` is not given: an hour.
/// Real engines take minutes (weights over the network, CUDA graphs,
/// compilation), and the costs are lopsided: a stuck engine waits longer,
/// but a healthy one cut short starts over from nothing, again and again
/// until its restart budget is spent. An engine that knows it needs longer
/// sends `EXTEND_TIMEOUT_USEC=`. (Dynamo's startup probe waits 2 h.)
pub const DEFAULT_START_TIMEOUT: Duration = Duration::from_secs(60 * 60);

/// What a duration value allows, whatever its bounds.
const DURATION_FORM: &str =
    "a duration such as 100ms, 2s or 10m (a whole number and us, ms, s, m or h)";
/// What `shadow.dev/probe` allows.
pub const PROBE_ALLOWED: &str =
    "http://<host>:<port>[/<path>] or tcp://<host>:<port>; host an IPv4 address, [<IPv6>] or a DNS name, port 1-65535";

fn bad(key: &str, value: &str, allowed: String) -> AnnotationError {
    AnnotationError {
        key: key.to_string(),
        value: value.to_string(),
        allowed,
    }
}

/// The duration `value` writes (`100ms`, `2s`, ...; see the module doc),
/// or `None` if it is not one. Zero is a duration here; the bounds are the
/// caller's (see [`parse_duration`]).
pub fn duration_of(value: &str) -> Option<Duration> {
    let split = value.find(|c: char| !c.is_ascii_digit())?;
    let (digits, unit) = value.split_at(split);
    if digits.is_empty() {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    let micros_per = match unit {
        "us" => 1,
        "ms" => 1_000,
        "s" => 1_000_000,
        "m" => 60_000_000,
        "h" => 3_600_000_000,
        _ => return None,
    };
    Some(Duration::from_micros(n.checked_mul(micros_per)?))
}

/// A duration for `key`, from `min` to [`MAX_DURATION`]: the check every
/// duration knob here goes through, public so that a config file's key
/// (`pair.watchdog`) is refused with the same words.
pub fn parse_duration(key: &str, value: &str, min: Duration) -> Result<Duration, AnnotationError> {
    let allowed = || {
        format!(
            "{DURATION_FORM}, from {} to {}",
            Written(min),
            Written(MAX_DURATION)
        )
    };
    match duration_of(value) {
        Some(d) if (min..=MAX_DURATION).contains(&d) => Ok(d),
        _ => Err(bad(key, value, allowed())),
    }
}

/// A watchdog interval for `key` (`shadow.dev/watchdog`, `pair.watchdog`).
pub fn parse_watchdog(key: &str, value: &str) -> Result<Duration, AnnotationError> {
    parse_duration(key, value, MIN_INTERVAL)
}

/// A duration written back the way this module reads it, in the largest
/// unit that is exact (`90s`, `1500ms`, `2h`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Written(pub Duration);

impl fmt::Display for Written {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let us = self.0.as_micros();
        let (n, unit) = [
            (3_600_000_000, "h"),
            (60_000_000, "m"),
            (1_000_000, "s"),
            (1_000, "ms"),
        ]
        .into_iter()
        .find(|(per, _)| us != 0 && us % per == 0)
        .map_or((us, "us"), |(per, unit)| (us / per, unit));
        write!(f, "{n}{unit}")
    }
}

/// The host of a probe target.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Host {
    V4(Ipv4Addr),
    V6(Ipv6Addr),
    /// A DNS name, resolved where the probe runs (the pair's network
    /// namespace), lower-cased.
    Name(String),
}

impl fmt::Display for Host {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Host::V4(a) => write!(f, "{a}"),
            Host::V6(a) => write!(f, "[{a}]"),
            Host::Name(n) => f.write_str(n),
        }
    }
}

/// What `shadow.dev/probe` checks.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ProbeTarget {
    /// Healthy: a GET of `path` answers with a 2xx status.
    Http { host: Host, port: u16, path: String },
    /// Healthy: the connect succeeds.
    Tcp { host: Host, port: u16 },
}

impl fmt::Display for ProbeTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProbeTarget::Http { host, port, path } => write!(f, "http://{host}:{port}{path}"),
            ProbeTarget::Tcp { host, port } => write!(f, "tcp://{host}:{port}"),
        }
    }
}

impl ProbeTarget {
    /// Parses a `shadow.dev/probe` value. The scheme is lower case; there
    /// is no user, no fragment and no default port; an http path may carry
    /// a query and is `/` when absent.
    pub fn parse(value: &str) -> Result<ProbeTarget, AnnotationError> {
        let no = |why: &str| bad(PROBE, value, format!("{PROBE_ALLOWED}; {why}"));
        let (http, rest) = if let Some(rest) = value.strip_prefix("http://") {
            (true, rest)
        } else if let Some(rest) = value.strip_prefix("tcp://") {
            (false, rest)
        } else {
            return Err(no("the scheme is not http:// or tcp://"));
        };
        let (authority, path) = match rest.find('/') {
            Some(i) => rest.split_at(i),
            None => (rest, ""),
        };
        let (host, port) = authority
            .rsplit_once(':')
            .ok_or_else(|| no("no :<port> after the host"))?;
        let port = port_of(port).ok_or_else(|| no(&format!("port {port:?} is not 1-65535")))?;
        let host = host_of(host)
            .ok_or_else(|| no(&format!("host {host:?} is not an address or a DNS name")))?;
        if !http {
            return if path.is_empty() {
                Ok(ProbeTarget::Tcp { host, port })
            } else {
                Err(no("a tcp:// target has no path"))
            };
        }
        if !path.bytes().all(|b| b.is_ascii_graphic() && b != b'#') {
            return Err(no(
                "the path has a space, a control, a non-ASCII character or a #",
            ));
        }
        let path = if path.is_empty() { "/" } else { path };
        Ok(ProbeTarget::Http {
            host,
            port,
            path: path.to_string(),
        })
    }
}

fn port_of(s: &str) -> Option<u16> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok().filter(|&p| p != 0)
}

fn host_of(s: &str) -> Option<Host> {
    if let Some(inner) = s.strip_prefix('[') {
        return inner.strip_suffix(']')?.parse().ok().map(Host::V6);
    }
    if let Ok(a) = s.parse::<Ipv4Addr>() {
        return Some(Host::V4(a));
    }
    // RFC 1123 labels; the last one not all digits, so that a mistyped
    // address (`10.0.0.256`) is refused rather than looked up as a name.
    let label = |l: &str| {
        (1..=63).contains(&l.len())
            && !l.starts_with('-')
            && !l.ends_with('-')
            && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
    };
    let last_is_word = s
        .rsplit('.')
        .next()
        .is_some_and(|l| !l.bytes().all(|b| b.is_ascii_digit()));
    (s.len() <= 253 && s.split('.').all(label) && last_is_word)
        .then(|| Host::Name(s.to_ascii_lowercase()))
}

/// The probe a pair runs against its serving engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Probe {
    pub target: ProbeTarget,
    /// From the start of one probe to the start of the next
    /// (`shadow.dev/probe-period`, default [`DEFAULT_PROBE_PERIOD`],
    /// at least [`MIN_INTERVAL`]).
    pub period: Duration,
    /// How long one probe may take before it counts as failed
    /// (`shadow.dev/probe-timeout`). At most the period, so that one probe
    /// is in flight at a time; the period when not given.
    pub timeout: Duration,
    /// Failures in a row that end the serving engine
    /// (`shadow.dev/probe-failures`, 1 to [`MAX_PROBE_FAILURES`], default
    /// [`DEFAULT_PROBE_FAILURES`]). A hang is detected within about
    /// `period × failures`.
    pub failures: u32,
}

/// Every hang-detection knob of one container spec, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HangSettings {
    /// `shadow.dev/watchdog`: each engine's `WATCHDOG_USEC`; none when not
    /// given (an engine is watched only when asked).
    pub watchdog: Option<Duration>,
    /// `shadow.dev/probe` and its knobs; none when not given.
    pub probe: Option<Probe>,
    /// `shadow.dev/start-timeout` (default [`DEFAULT_START_TIMEOUT`]).
    pub start_timeout: Duration,
}

impl Default for HangSettings {
    fn default() -> Self {
        HangSettings {
            watchdog: None,
            probe: None,
            start_timeout: DEFAULT_START_TIMEOUT,
        }
    }
}

impl HangSettings {
    /// Reads the six keys among `annotations` and ignores every other key
    /// (the rest of the set is [`crate::annotations::Annotations`]'s). The
    /// keys are checked in one fixed order, so the first error reported is
    /// the same whatever the map's order. A probe knob without
    /// `shadow.dev/probe` is refused: it would silently do nothing.
    pub fn parse<'a, I, K, V>(annotations: I) -> Result<HangSettings, AnnotationError>
    where
        I: IntoIterator<Item = (&'a K, &'a V)>,
        K: AsRef<str> + ?Sized + 'a,
        V: AsRef<str> + ?Sized + 'a,
    {
        let mut given: [Option<&str>; 6] = [None; 6];
        for (k, v) in annotations {
            if let Some(i) = KEYS.iter().position(|key| *key == k.as_ref()) {
                given[i] = Some(v.as_ref());
            }
        }
        let [watchdog, probe, period_raw, timeout_raw, failures_raw, start] = given;

        let mut out = HangSettings {
            watchdog: watchdog.map(|v| parse_watchdog(WATCHDOG, v)).transpose()?,
            ..HangSettings::default()
        };
        if let Some(v) = start {
            out.start_timeout = parse_duration(START_TIMEOUT, v, MIN_START_TIMEOUT)?;
        }
        let Some(target) = probe.map(ProbeTarget::parse).transpose()? else {
            let knobs = [
                (PROBE_PERIOD, period_raw),
                (PROBE_TIMEOUT, timeout_raw),
                (PROBE_FAILURES, failures_raw),
            ];
            if let Some((key, Some(value))) = knobs.into_iter().find(|(_, v)| v.is_some()) {
                return Err(bad(key, value, format!("only together with {PROBE}")));
            }
            return Ok(out);
        };
        let period = period_raw
            .map(|v| parse_duration(PROBE_PERIOD, v, MIN_INTERVAL))
            .transpose()?;
        let timeout = timeout_raw
            .map(|v| parse_duration(PROBE_TIMEOUT, v, MIN_PROBE_TIMEOUT).map(|t| (v, t)))
            .transpose()?;
        let failures = failures_raw.map(parse_failures).transpose()?;
        let period = period.unwrap_or(DEFAULT_PROBE_PERIOD);
        let timeout = match timeout {
            Some((v, t)) if t > period => {
                return Err(bad(
                    PROBE_TIMEOUT,
                    v,
                    format!(
                        "{DURATION_FORM}, from {} to the probe's period ({PROBE_PERIOD}, here {})",
                        Written(MIN_PROBE_TIMEOUT),
                        Written(period)
                    ),
                ))
            }
            Some((_, t)) => t,
            None => period,
        };
        out.probe = Some(Probe {
            target,
            period,
            timeout,
            failures: failures.unwrap_or(DEFAULT_PROBE_FAILURES),
        });
        Ok(out)
    }
}

fn parse_failures(value: &str) -> Result<u32, AnnotationError> {
    let ok = !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit());
    value
        .parse()
        .ok()
        .filter(|n| ok && (1..=MAX_PROBE_FAILURES).contains(n))
        .ok_or_else(|| {
            bad(
                PROBE_FAILURES,
                value,
                format!("a whole number from 1 to {MAX_PROBE_FAILURES}"),
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn map(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn every_unit_reads() {
        for (v, d) in [
            ("500us", Duration::from_micros(500)),
            ("100ms", ms(100)),
            ("2s", Duration::from_secs(2)),
            ("10m", Duration::from_secs(600)),
            ("1h", Duration::from_secs(3600)),
            ("0ms", Duration::ZERO),
            ("007s", Duration::from_secs(7)),
        ] {
            assert_eq!(duration_of(v), Some(d), "{v}");
        }
    }

    #[test]
    fn what_is_not_a_duration() {
        for v in [
            "",
            "2",
            "s",
            "ms",
            "-1s",
            "+1s",
            "1.5s",
            "1 s",
            " 1s",
            "1s ",
            "1S",
            "1sec",
            "1d",
            "1µs",
            "1ns",
            "1s2ms",
            "abc",
            "18446744073709551616us",
            "18446744073709551615h",
        ] {
            assert_eq!(duration_of(v), None, "{v:?}");
        }
        // The largest count of microseconds still reads.
        assert_eq!(
            duration_of("18446744073709551615us"),
            Some(Duration::from_micros(u64::MAX))
        );
    }

    #[test]
    fn bounds_are_inclusive_and_named() {
        assert_eq!(parse_duration(WATCHDOG, "50ms", MIN_INTERVAL), Ok(ms(50)));
        assert_eq!(
            parse_duration(WATCHDOG, "24h", MIN_INTERVAL),
            Ok(MAX_DURATION)
        );
        for v in ["49ms", "49999us", "0s", "25h", "1441m", "abc"] {
            let e = parse_duration(PROBE_PERIOD, v, MIN_INTERVAL).unwrap_err();
            assert_eq!((e.key.as_str(), e.value.as_str()), (PROBE_PERIOD, v));
            assert_eq!(
                e.to_string(),
                format!(
                    "annotation shadow.dev/probe-period={v:?} is not valid; allowed: a duration \
                     such as 100ms, 2s or 10m (a whole number and us, ms, s, m or h), from 50ms to 24h"
                )
            );
        }
        let e = parse_watchdog("pair.watchdog", "10ms").unwrap_err();
        assert_eq!(e.key, "pair.watchdog");
        assert!(e.allowed.contains("from 50ms"), "{e}");
    }

    #[test]
    fn written_back_in_the_largest_exact_unit() {
        for (d, w) in [
            (Duration::ZERO, "0us"),
            (Duration::from_micros(1500), "1500us"),
            (ms(50), "50ms"),
            (ms(1500), "1500ms"),
            (Duration::from_secs(90), "90s"),
            (Duration::from_secs(600), "10m"),
            (MAX_DURATION, "24h"),
        ] {
            assert_eq!(Written(d).to_string(), w);
            assert_eq!(duration_of(w), Some(d));
        }
    }

    #[test]
    fn probe_targets_parse() {
        let v4 = Host::V4(Ipv4Addr::new(127, 0, 0, 1));
        for (v, t) in [
            (
                "http://127.0.0.1:8000/health",
                ProbeTarget::Http {
                    host: v4.clone(),
                    port: 8000,
                    path: "/health".into(),
                },
            ),
            (
                "http://127.0.0.1:8000",
                ProbeTarget::Http {
                    host: v4.clone(),
                    port: 8000,
                    path: "/".into(),
                },
            ),
            (
                "http://localhost:1/v1/models?ready=1",
                ProbeTarget::Http {
                    host: Host::Name("localhost".into()),
                    port: 1,
                    path: "/v1/models?ready=1".into(),
                },
            ),
            (
                "http://[::1]:65535/",
                ProbeTarget::Http {
                    host: Host::V6(Ipv6Addr::LOCALHOST),
                    port: 65535,
                    path: "/".into(),
                },
            ),
            (
                "tcp://127.0.0.1:8000",
                ProbeTarget::Tcp {
                    host: v4,
                    port: 8000,
                },
            ),
            (
                "tcp://Engine-0.svc.cluster.local:9000",
                ProbeTarget::Tcp {
                    host: Host::Name("engine-0.svc.cluster.local".into()),
                    port: 9000,
                },
            ),
            (
                "tcp://[fe80::1]:22",
                ProbeTarget::Tcp {
                    host: Host::V6("fe80::1".parse().unwrap()),
                    port: 22,
                },
            ),
        ] {
            assert_eq!(ProbeTarget::parse(v), Ok(t.clone()), "{v}");
            // Written back, it reads the same.
            assert_eq!(ProbeTarget::parse(&t.to_string()), Ok(t));
        }
    }

    #[test]
    fn bad_probe_targets_say_why() {
        for (v, why) in [
            ("", "scheme"),
            ("https://h:443/", "scheme"),
            ("HTTP://h:80/", "scheme"),
            ("unix:/run/engine.sock", "scheme"),
            ("127.0.0.1:8000", "scheme"),
            ("http://127.0.0.1/", "no :<port>"),
            ("tcp://h", "no :<port>"),
            ("tcp://h:0", "port \"0\""),
            ("tcp://h:65536", "port \"65536\""),
            ("tcp://h:+80", "port \"+80\""),
            ("tcp://h:", "port \"\""),
            ("tcp://h:80x", "port \"80x\""),
            ("tcp://:80", "host \"\""),
            ("tcp://::1:80", "host \"::1\""),
            ("tcp://[::1:80", "host \"[::1\""),
            ("tcp://[127.0.0.1]:80", "host \"[127.0.0.1]\""),
            ("tcp://[fe80::1%eth0]:80", "host"),
            ("tcp://10.0.0.256:80", "host \"10.0.0.256\""),
            ("tcp://user@h:80", "host \"user@h\""),
            ("tcp://-h:80", "host"),
            ("tcp://h-:80", "host"),
            ("tcp://a..b:80", "host"),
            ("tcp://h.:80", "host"),
            ("tcp://h_1:80", "host"),
            ("tcp://127.0.0.1:8000/", "no path"),
            ("tcp://127.0.0.1:8000/health", "no path"),
            ("http://h:80/a b", "the path"),
            ("http://h:80/a#b", "the path"),
            ("http://h:80/é", "the path"),
            ("http://h:80/a\n", "the path"),
        ] {
            let e = ProbeTarget::parse(v).unwrap_err();
            assert_eq!((e.key.as_str(), e.value.as_str()), (PROBE, v));
            assert!(e.allowed.starts_with(PROBE_ALLOWED), "{e}");
            assert!(e.to_string().contains(why), "{v:?}: {e}");
        }
        let long = format!("tcp://{}:80", vec!["a".repeat(63); 4].join("."));
        assert!(ProbeTarget::parse(&long).is_err(), "255 characters");
        let ok = format!("tcp://{}.b:80", vec!["a".repeat(63); 3].join("."));
        assert!(ProbeTarget::parse(&ok).is_ok(), "193 characters");
        assert!(ProbeTarget::parse(&format!("tcp://{}:80", "a".repeat(64))).is_err());
    }

    #[test]
    fn nothing_given_is_the_defaults() {
        let s = HangSettings::parse(&map(&[("shadow.dev/pair", "true"), ("x", "y")])).unwrap();
        assert_eq!(s, HangSettings::default());
        assert_eq!(s.watchdog, None);
        assert_eq!(s.probe, None);
        assert_eq!(s.start_timeout, Duration::from_secs(3600));
    }

    #[test]
    fn a_probe_alone_takes_the_documented_defaults() {
        let s = HangSettings::parse(&map(&[(PROBE, "tcp://127.0.0.1:8000")])).unwrap();
        assert_eq!(
            s.probe,
            Some(Probe {
                target: ProbeTarget::Tcp {
                    host: Host::V4(Ipv4Addr::LOCALHOST),
                    port: 8000
                },
                period: Duration::from_secs(1),
                timeout: Duration::from_secs(1),
                failures: 3,
            })
        );
    }

    #[test]
    fn every_knob_given() {
        // The figures: a 100 ms watchdog, a probe every 100 ms × 2.
        let s = HangSettings::parse(&map(&[
            (WATCHDOG, "100ms"),
            (PROBE, "http://127.0.0.1:8000/health"),
            (PROBE_PERIOD, "100ms"),
            (PROBE_TIMEOUT, "80ms"),
            (PROBE_FAILURES, "2"),
            (START_TIMEOUT, "10m"),
        ]))
        .unwrap();
        assert_eq!(s.watchdog, Some(ms(100)));
        assert_eq!(s.start_timeout, Duration::from_secs(600));
        let p = s.probe.unwrap();
        assert_eq!((p.period, p.timeout, p.failures), (ms(100), ms(80), 2));
        // Without a timeout, it is the period, whatever the period.
        let p = HangSettings::parse(&map(&[(PROBE, "tcp://h:1"), (PROBE_PERIOD, "5s")]))
            .unwrap()
            .probe
            .unwrap();
        assert_eq!(p.timeout, Duration::from_secs(5));
        // The timeout may equal the period, and a vec of &str pairs reads too.
        let v = [
            (PROBE, "tcp://h:1"),
            (PROBE_PERIOD, "50ms"),
            (PROBE_TIMEOUT, "50ms"),
        ];
        let s = HangSettings::parse(v.iter().map(|(k, v)| (*k, *v))).unwrap();
        assert_eq!(
            s.probe.map(|p| (p.period, p.timeout)),
            Some((ms(50), ms(50)))
        );
        assert_eq!(
            HangSettings::parse(&map(&[(START_TIMEOUT, "1s"), (WATCHDOG, "50ms")])).unwrap(),
            HangSettings {
                watchdog: Some(ms(50)),
                probe: None,
                start_timeout: Duration::from_secs(1)
            }
        );
    }

    #[test]
    fn bad_values_name_key_value_and_allowed() {
        let probe = (PROBE, "tcp://h:1");
        for (given, key, value, allowed) in [
            (
                vec![(WATCHDOG, "49ms")],
                WATCHDOG,
                "49ms",
                "from 50ms to 24h",
            ),
            (vec![(WATCHDOG, "100")], WATCHDOG, "100", "such as 100ms"),
            (vec![(WATCHDOG, "")], WATCHDOG, "", "such as 100ms"),
            (
                vec![(START_TIMEOUT, "999ms")],
                START_TIMEOUT,
                "999ms",
                "from 1s to 24h",
            ),
            (
                vec![(START_TIMEOUT, "2d")],
                START_TIMEOUT,
                "2d",
                "from 1s to 24h",
            ),
            (
                vec![(PROBE, "udp://h:53")],
                PROBE,
                "udp://h:53",
                PROBE_ALLOWED,
            ),
            (
                vec![probe, (PROBE_PERIOD, "abc")],
                PROBE_PERIOD,
                "abc",
                "from 50ms to 24h",
            ),
            (
                vec![probe, (PROBE_PERIOD, "10ms")],
                PROBE_PERIOD,
                "10ms",
                "from 50ms",
            ),
            (
                vec![probe, (PROBE_TIMEOUT, "500us")],
                PROBE_TIMEOUT,
                "500us",
                "from 1ms to 24h",
            ),
            (
                vec![probe, (PROBE_TIMEOUT, "2s")],
                PROBE_TIMEOUT,
                "2s",
                "from 1ms to the probe's period (shadow.dev/probe-period, here 1s)",
            ),
            (
                vec![probe, (PROBE_PERIOD, "100ms"), (PROBE_TIMEOUT, "101ms")],
                PROBE_TIMEOUT,
                "101ms",
                "here 100ms",
            ),
            (
                vec![probe, (PROBE_FAILURES, "0")],
                PROBE_FAILURES,
                "0",
                "from 1 to 100",
            ),
            (
                vec![probe, (PROBE_FAILURES, "101")],
                PROBE_FAILURES,
                "101",
                "from 1 to 100",
            ),
            (
                vec![probe, (PROBE_FAILURES, "+2")],
                PROBE_FAILURES,
                "+2",
                "from 1 to 100",
            ),
            (
                vec![probe, (PROBE_FAILURES, "-1")],
                PROBE_FAILURES,
                "-1",
                "from 1 to 100",
            ),
            (
                vec![probe, (PROBE_FAILURES, "2x")],
                PROBE_FAILURES,
                "2x",
                "from 1 to 100",
            ),
            (
                vec![probe, (PROBE_FAILURES, "")],
                PROBE_FAILURES,
                "",
                "from 1 to 100",
            ),
            (
                vec![probe, (PROBE_FAILURES, "99999999999")],
                PROBE_FAILURES,
                "99999999999",
                "from 1 to 100",
            ),
            (
                vec![(PROBE_PERIOD, "1s")],
                PROBE_PERIOD,
                "1s",
                "only together with shadow.dev/probe",
            ),
            (
                vec![(PROBE_TIMEOUT, "1s")],
                PROBE_TIMEOUT,
                "1s",
                "only together with shadow.dev/probe",
            ),
            (
                vec![(PROBE_FAILURES, "x")],
                PROBE_FAILURES,
                "x",
                "only together with shadow.dev/probe",
            ),
        ] {
            let e = HangSettings::parse(&map(&given)).unwrap_err();
            assert_eq!(
                (e.key.as_str(), e.value.as_str()),
                (key, value),
                "{given:?}"
            );
            let msg = e.to_string();
            assert!(
                msg.starts_with(&format!(
                    "annotation {key}={value:?} is not valid; allowed: "
                )),
                "{msg}"
            );
            assert!(msg.contains(allowed), "{msg}");
        }
    }

    #[test]
    fn the_first_error_is_the_same_whatever_the_order() {
        let bad = [(WATCHDOG, "1ms"), (PROBE, "nope"), (START_TIMEOUT, "0s")];
        for _ in 0..8 {
            // A new HashMap each time: its iteration order is seeded anew.
            let e = HangSettings::parse(&map(&bad)).unwrap_err();
            assert_eq!(e.key, WATCHDOG);
        }
        let e = HangSettings::parse(&map(&bad[1..])).unwrap_err();
        assert_eq!(e.key, START_TIMEOUT);
    }

    #[test]
    fn the_keys_are_the_annotations_module_names() {
        use crate::annotations;
        assert_eq!(
            annotations::HANG_KEYS,
            [
                "shadow.dev/watchdog",
                "shadow.dev/probe",
                "shadow.dev/probe-period",
                "shadow.dev/probe-timeout",
                "shadow.dev/probe-failures",
                "shadow.dev/start-timeout",
            ]
        );
        assert!(annotations::HANG_KEYS
            .iter()
            .all(|k| k.starts_with(annotations::PREFIX)));
        assert!(annotations::HANG_KEYS
            .iter()
            .all(|k| annotations::KEYS.contains(k)));
    }
}
