//! The `shadow.dev/` annotations: one set, parsed the same way by the shim
//! and by the OCI hook, so one container spec can serve both paths.
//!
//! - `shadow.dev/pair`, `shadow.dev/gms`, `shadow.dev/shadow`,
//!   `shadow.dev/listen`, `shadow.dev/shadows`, `shadow.dev/fdstore-max`,
//!   `shadow.dev/accept`
//!   ask the shim to make (and shape) an engine pair;
//! - `shadow.dev/watchdog`, `shadow.dev/probe` (with `-period`, `-timeout`,
//!   `-failures`) and `shadow.dev/start-timeout` tell the shim how to find
//!   a hung engine ([`crate::hang`]);
//! - `shadow.dev/pair-name`, `shadow.dev/slot` place a container in a pair
//!   that the hooks assemble from two containers (podman, CRI-O, runc).
//!
//! Each side acts on its own keys and validates the others', so a typo is
//! refused by either runtime with the key, the value and what is allowed.
//! A key under the prefix that is not in the set is refused too: a
//! misspelt knob must not silently do nothing.

use std::fmt;

pub use crate::error::AnnotationError;
use crate::fdstore;
use crate::handoff::{self, Accept};
use crate::hang::{self, HangSettings};
use crate::listen::{self, Listen};

/// The prefix every key here lives under (also what a CRI runtime passes
/// through with `pod_annotations = ["shadow.dev/*"]`).
pub const PREFIX: &str = "shadow.dev/";
/// `true`, `false`, or a list of CRI container names to pair.
pub const PAIR: &str = "shadow.dev/pair";
/// The GMS backend: `cuda`, `host` or `off`.
pub const GMS: &str = "shadow.dev/gms";
/// `false`: one engine, restarted in place, no shadow ("GMS only").
pub const SHADOW: &str = "shadow.dev/shadow";
/// The pair a hook-assembled container belongs to.
pub const PAIR_NAME: &str = "shadow.dev/pair-name";
/// The slot (`SHADOW_ENGINE_ID`) of a hook-assembled container.
pub const SLOT: &str = "shadow.dev/slot";
/// How many shadows a pair keeps parked: `1` (the default) to
/// [`MAX_SHADOWS`]; `N + 1` engines, `SHADOW_ENGINE_ID` `0 ..= N`.
pub const SHADOWS: &str = "shadow.dev/shadows";
/// The most shadows a pair may have: each is a whole engine parked (on a
/// GPU its runtime's context, CUDA graphs and workspaces: 760 MiB for the
/// torch engine of examples/), and three cover three failures within one
/// respawn's time.
pub const MAX_SHADOWS: u8 = 3;
/// Listening sockets the pair owns and hands to every engine
/// (`tcp:0.0.0.0:8000,unix:/run/engine.sock`; see [`crate::listen`], which
/// spells the key because its parser names it in its errors).
pub const LISTEN: &str = listen::KEY;
/// How many descriptors the pair's fd store keeps (`0`: no store; see
/// [`crate::fdstore`], which spells the key).
pub const FDSTORE_MAX: &str = fdstore::KEY;
/// Who accepts the pair's connections: `engine` (the default) or
/// `runtime` (see [`crate::handoff`], which spells the key).
pub const ACCEPT: &str = handoff::KEY;

/// Every key of the set.
pub const KEYS: [&str; 15] = [
    PAIR,
    GMS,
    SHADOW,
    SHADOWS,
    PAIR_NAME,
    SLOT,
    LISTEN,
    FDSTORE_MAX,
    ACCEPT,
    WATCHDOG,
    PROBE,
    PROBE_PERIOD,
    PROBE_TIMEOUT,
    PROBE_FAILURES,
    START_TIMEOUT,
];

// Hang detection (issue 22), parsed by [`crate::hang::HangSettings`], which
// spells the keys because its errors name them.

/// The systemd watchdog interval every engine gets as `WATCHDOG_USEC`
/// (`100ms`, `2s`; at least 50ms). Config key `pair.watchdog`.
pub const WATCHDOG: &str = hang::WATCHDOG;
/// The probe the shim runs against the serving engine:
/// `http://<host>:<port>[/<path>]` (healthy: a 2xx status) or
/// `tcp://<host>:<port>` (healthy: the connect succeeds).
pub const PROBE: &str = hang::PROBE;
/// From one probe's start to the next's (default 1s, at least 50ms).
pub const PROBE_PERIOD: &str = hang::PROBE_PERIOD;
/// How long one probe may take (default and most: the period).
pub const PROBE_TIMEOUT: &str = hang::PROBE_TIMEOUT;
/// Probe failures in a row that end the serving engine (default 3, 1 to 100).
pub const PROBE_FAILURES: &str = hang::PROBE_FAILURES;
/// How long an engine may take to park or serve before it is ended as an
/// early death (default 1h; `EXTEND_TIMEOUT_USEC=` extends it).
pub const START_TIMEOUT: &str = hang::START_TIMEOUT;

/// The hang-detection keys (a part of [`KEYS`]), which
/// [`Annotations::parse`] hands to [`crate::hang::HangSettings::parse`].
pub const HANG_KEYS: [&str; 6] = hang::KEYS;

fn bad(key: &str, value: &str, allowed: &str) -> AnnotationError {
    AnnotationError {
        key: key.to_string(),
        value: value.to_string(),
        allowed: allowed.to_string(),
    }
}

/// What `shadow.dev/pair` asked for.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum PairRequest {
    #[default]
    Absent,
    Off,
    On,
    /// Pod style: pair the containers with these CRI container names.
    Names(Vec<String>),
}

/// `shadow.dev/gms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GmsBackend {
    Cuda,
    Host,
    Off,
}

/// A pair name: a path component on the host and a CDI device name, so
/// nothing that could climb out of the pairs' root.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PairName(String);

impl PairName {
    pub const ALLOWED: &str = "1 to 64 of [A-Za-z0-9_.-], not starting with '.'";

    pub fn new(name: &str) -> Result<PairName, AnnotationError> {
        let ok = !name.is_empty()
            && name.len() <= 64
            && !name.starts_with('.')
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
        if ok {
            Ok(PairName(name.to_string()))
        } else {
            Err(bad(PAIR_NAME, name, Self::ALLOWED))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for PairName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// An engine slot from `shadow.dev/slot`: `0` to [`MAX_SHADOWS`].
pub fn parse_slot(value: &str) -> Result<u8, AnnotationError> {
    small_number(SLOT, value, 0)
}

/// A number of shadows from `shadow.dev/shadows`: `1` to [`MAX_SHADOWS`].
pub fn parse_shadows(value: &str) -> Result<u8, AnnotationError> {
    small_number(SHADOWS, value, 1)
}

/// `min ..= MAX_SHADOWS`, digits only (no sign, no spaces inside).
fn small_number(key: &str, value: &str, min: u8) -> Result<u8, AnnotationError> {
    let t = value.trim();
    match t.parse::<u8>() {
        Ok(n) if t.bytes().all(|b| b.is_ascii_digit()) && (min..=MAX_SHADOWS).contains(&n) => Ok(n),
        _ => Err(bad(key, value, &format!("{min} to {MAX_SHADOWS}"))),
    }
}

/// Every `shadow.dev/` annotation of one container spec, validated.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Annotations {
    pub pair: PairRequest,
    pub gms: Option<GmsBackend>,
    /// `shadow.dev/shadow=false`: one engine, restarted in place.
    pub no_shadow: bool,
    pub pair_name: Option<PairName>,
    pub slot: Option<u8>,
    /// `shadow.dev/shadows`: how many shadows the pair keeps parked.
    pub shadows: Option<u8>,
    /// `shadow.dev/listen`: the pair's listening sockets.
    pub listen: Option<Vec<Listen>>,
    /// `shadow.dev/fdstore-max`: the fd store's bound (`0`: none).
    pub fdstore_max: Option<u32>,
    /// `shadow.dev/accept`: who accepts the pair's connections.
    pub accept: Option<Accept>,
    /// The hang-detection keys ([`HANG_KEYS`]), validated; the defaults
    /// when none is given.
    pub hang: HangSettings,
    /// Whether any of [`HANG_KEYS`] was given (a runtime that cannot act
    /// on them refuses them).
    pub hang_given: bool,
}

impl Annotations {
    /// Parses the `shadow.dev/` keys among `annotations` and ignores the
    /// rest. Keys are taken in sorted order, so the first error reported is
    /// the same whatever the map's order.
    pub fn parse<'a, I, K, V>(annotations: I) -> Result<Annotations, AnnotationError>
    where
        I: IntoIterator<Item = (&'a K, &'a V)>,
        K: AsRef<str> + ?Sized + 'a,
        V: AsRef<str> + ?Sized + 'a,
    {
        let mut ours: Vec<(&str, &str)> = annotations
            .into_iter()
            .map(|(k, v)| (k.as_ref(), v.as_ref()))
            .filter(|(k, _)| k.starts_with(PREFIX))
            .collect();
        ours.sort();
        let mut out = Annotations::default();
        // The hang keys are read as one set (a probe knob needs the
        // probe), after every other key has been checked in order.
        let hang: Vec<(&str, &str)> = ours
            .iter()
            .copied()
            .filter(|(k, _)| HANG_KEYS.contains(k))
            .collect();
        for (key, value) in ours {
            if HANG_KEYS.contains(&key) {
                continue;
            }
            match key {
                PAIR => out.pair = parse_pair(value)?,
                GMS => {
                    out.gms = Some(match value {
                        "cuda" => GmsBackend::Cuda,
                        "host" => GmsBackend::Host,
                        "off" => GmsBackend::Off,
                        _ => return Err(bad(key, value, "cuda|host|off")),
                    })
                }
                SHADOW => {
                    out.no_shadow = match value {
                        "true" => false,
                        "false" => true,
                        _ => return Err(bad(key, value, "true|false")),
                    }
                }
                PAIR_NAME => out.pair_name = Some(PairName::new(value)?),
                SLOT => out.slot = Some(parse_slot(value)?),
                SHADOWS => out.shadows = Some(parse_shadows(value)?),
                LISTEN => out.listen = Some(listen::parse(value)?),
                FDSTORE_MAX => out.fdstore_max = Some(fdstore::parse_max(value)?),
                ACCEPT => out.accept = Some(handoff::parse(value)?),
                _ => {
                    return Err(bad(
                        key,
                        value,
                        &format!("keys {} under {PREFIX}", KEYS.join(", ")),
                    ))
                }
            }
        }
        out.hang_given = !hang.is_empty();
        out.hang = HangSettings::parse(hang.iter().map(|(k, v)| (*k, *v)))?;
        Ok(out)
    }
}

fn parse_pair(value: &str) -> Result<PairRequest, AnnotationError> {
    const ALLOWED: &str = "true|false|<container-name>[,<container-name>...]";
    match value {
        "true" => return Ok(PairRequest::On),
        "false" => return Ok(PairRequest::Off),
        _ => {}
    }
    let names: Vec<String> = value.split(',').map(|s| s.trim().to_string()).collect();
    // A CRI container name is a DNS-1123 label-ish name.
    let valid = |n: &String| {
        !n.is_empty()
            && n.len() <= 253
            && n.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
    };
    if names.iter().all(valid) {
        Ok(PairRequest::Names(names))
    } else {
        Err(bad(PAIR, value, ALLOWED))
    }
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

    #[test]
    fn both_sets_parse_together() {
        let a = map(&[
            (PAIR, "true"),
            (GMS, "host"),
            (SHADOW, "false"),
            (PAIR_NAME, "llama-70b_v2.1"),
            (SLOT, "1"),
            (LISTEN, "tcp:0.0.0.0:8000"),
            ("io.kubernetes.cri.container-name", "engine"),
        ]);
        let s = Annotations::parse(&a).unwrap();
        assert_eq!(s.pair, PairRequest::On);
        assert_eq!(s.gms, Some(GmsBackend::Host));
        assert!(s.no_shadow);
        assert_eq!(
            s.pair_name.as_ref().map(PairName::as_str),
            Some("llama-70b_v2.1")
        );
        assert_eq!(s.slot, Some(1));
        assert_eq!(
            s.listen,
            Some(vec![Listen::Tcp("0.0.0.0:8000".parse().unwrap())])
        );
    }

    #[test]
    fn hook_keys_alone_and_shim_keys_alone() {
        let hook = Annotations::parse(&map(&[(PAIR_NAME, "p"), (SLOT, " 0 ")])).unwrap();
        assert_eq!(hook.pair, PairRequest::Absent);
        assert_eq!(hook.slot, Some(0));
        let shim = Annotations::parse(&map(&[(PAIR, "engine, sidecar2")])).unwrap();
        assert_eq!(
            shim.pair,
            PairRequest::Names(vec!["engine".into(), "sidecar2".into()])
        );
        assert_eq!(shim.pair_name, None);
        assert_eq!(
            Annotations::parse(&map(&[])).unwrap(),
            Annotations::default()
        );
    }

    #[test]
    fn hang_keys_are_part_of_the_set() {
        let a = Annotations::parse(&map(&[
            (PAIR, "true"),
            (WATCHDOG, "100ms"),
            (PROBE, "http://127.0.0.1:8000/health"),
            (PROBE_PERIOD, "100ms"),
            (PROBE_FAILURES, "2"),
            (START_TIMEOUT, "90s"),
        ]))
        .unwrap();
        assert!(a.hang_given);
        assert_eq!(a.hang.watchdog, Some(std::time::Duration::from_millis(100)));
        let probe = a.hang.probe.unwrap();
        assert_eq!(probe.failures, 2);
        assert_eq!(probe.timeout, std::time::Duration::from_millis(100));
        assert_eq!(a.hang.start_timeout, std::time::Duration::from_secs(90));
        let none = Annotations::parse(&map(&[(PAIR, "true")])).unwrap();
        assert!(!none.hang_given);
        assert_eq!(none.hang, HangSettings::default());
        for k in HANG_KEYS {
            assert!(KEYS.contains(&k), "{k}");
        }
    }

    #[test]
    fn a_vec_of_str_pairs_parses_too() {
        let v = [(PAIR_NAME, "p")];
        let s = Annotations::parse(v.iter().map(|(k, v)| (*k, *v))).unwrap();
        assert_eq!(s.pair_name.unwrap().to_string(), "p");
    }

    #[test]
    fn bad_values_name_key_value_and_allowed() {
        for (k, v, allowed) in [
            (GMS, "gpu", "cuda|host|off"),
            (SHADOW, "no", "true|false"),
            (PAIR, "yes please", "true|false"),
            (PAIR, "", "true|false"),
            (PAIR, "a,,b", "true|false"),
            (SLOT, "4", "0 to 3"),
            (SLOT, "-1", "0 to 3"),
            (SLOT, "+1", "0 to 3"),
            (SHADOWS, "0", "1 to 3"),
            (SHADOWS, "4", "1 to 3"),
            (SHADOWS, "two", "1 to 3"),
            (LISTEN, "udp:0.0.0.0:53", "tcp:<ipv4>"),
            (PAIR_NAME, "../etc", "[A-Za-z0-9_.-]"),
            (PAIR_NAME, ".x", "[A-Za-z0-9_.-]"),
            (PAIR_NAME, "", "[A-Za-z0-9_.-]"),
            ("shadow.dev/colour", "blue", PAIR_NAME),
            ("shadow.dev/colour", "blue", START_TIMEOUT),
            (WATCHDOG, "10ms", "from 50ms to 24h"),
            (PROBE, "udp://x:1", "tcp://"),
            (PROBE_FAILURES, "3", "only together with"),
            (START_TIMEOUT, "5", "a duration such as"),
        ] {
            let e = Annotations::parse(&map(&[(k, v)])).unwrap_err();
            let msg = e.to_string();
            assert_eq!(e.key, k);
            assert!(msg.contains(k) && msg.contains(allowed), "{msg}");
        }
        let a = Annotations::parse(&map(&[(SHADOWS, "3"), (SLOT, "3")])).unwrap();
        assert_eq!((a.shadows, a.slot), (Some(3), Some(3)));
        assert!(PairName::new(&"x".repeat(65)).is_err());
        assert!(PairName::new(&"x".repeat(64)).is_ok());
    }
}
