//! The `shadow.dev/` annotations: the user-facing switch between a plain
//! container and an engine pair. Parsed and validated once, at Create, so a
//! typo is refused with the key, the value and what is allowed, before any
//! process exists.

use std::collections::HashMap;

use crate::error::{Error, Result};

pub const PREFIX: &str = "shadow.dev/";
pub const PAIR: &str = "shadow.dev/pair";
pub const GMS: &str = "shadow.dev/gms";
/// `false`: a paired container runs one engine and no shadow; the engine is
/// restarted in place and GMS keeps its weights (the "GMS only" setup).
pub const SHADOW: &str = "shadow.dev/shadow";

/// CRI annotations that decide whether a pod-style request names us.
pub const CRI_CONTAINER_TYPE: &str = "io.kubernetes.cri.container-type";
pub const CRI_CONTAINER_NAME: &str = "io.kubernetes.cri.container-name";
pub const CRI_SANDBOX_ID: &str = "io.kubernetes.cri.sandbox-id";

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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GmsBackend {
    Cuda,
    Host,
    Off,
}

/// Every `shadow.dev/` annotation of one container spec, validated.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ShadowAnnotations {
    pub pair: PairRequest,
    pub gms: Option<GmsBackend>,
    /// `shadow.dev/shadow=false`: one engine, restarted in place.
    pub no_shadow: bool,
}

impl ShadowAnnotations {
    pub fn parse(annotations: &HashMap<String, String>) -> Result<Self> {
        let mut out = ShadowAnnotations::default();
        // Sorted so that the first error reported is deterministic.
        let mut ours: Vec<_> = annotations
            .iter()
            .filter(|(k, _)| k.starts_with(PREFIX))
            .collect();
        ours.sort();
        for (key, value) in ours {
            match key.as_str() {
                PAIR => out.pair = parse_pair(value)?,
                GMS => {
                    out.gms = Some(match value.as_str() {
                        "cuda" => GmsBackend::Cuda,
                        "host" => GmsBackend::Host,
                        "off" => GmsBackend::Off,
                        _ => return Err(bad(key, value, "cuda|host|off")),
                    })
                }
                SHADOW => {
                    out.no_shadow = match value.as_str() {
                        "true" => false,
                        "false" => true,
                        _ => return Err(bad(key, value, "true|false")),
                    }
                }
                _ => {
                    return Err(bad(
                        key,
                        value,
                        &format!("keys {PAIR}, {GMS} and {SHADOW} under {PREFIX}"),
                    ))
                }
            }
        }
        Ok(out)
    }

    /// Whether this container becomes an engine pair. The sandbox (pause)
    /// container never does; a pod-wide name list applies only to the
    /// containers it names.
    ///
    /// `by_default` (the config's `pair.pair_by_default`) pairs containers
    /// that carry no `shadow.dev/pair` at all; `shadow.dev/pair=false` still
    /// opts out.
    pub fn pairs(&self, annotations: &HashMap<String, String>, by_default: bool) -> bool {
        if annotations.get(CRI_CONTAINER_TYPE).map(String::as_str) == Some("sandbox") {
            return false;
        }
        match &self.pair {
            PairRequest::Absent => by_default,
            PairRequest::Off => false,
            PairRequest::On => true,
            PairRequest::Names(names) => annotations
                .get(CRI_CONTAINER_NAME)
                .is_some_and(|n| names.iter().any(|x| x == n)),
        }
    }
}

fn parse_pair(value: &str) -> Result<PairRequest> {
    const ALLOWED: &str = "true|false|<container-name>[,<container-name>...]";
    match value {
        "true" => return Ok(PairRequest::On),
        "false" => return Ok(PairRequest::Off),
        _ => {}
    }
    let names: Vec<String> = value.split(',').map(|s| s.trim().to_string()).collect();
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

fn bad(key: &str, value: &str, allowed: &str) -> Error {
    Error::Annotation {
        key: key.to_string(),
        value: value.to_string(),
        allowed: allowed.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn no_annotations_is_plain() {
        let a = map(&[("other.io/x", "y")]);
        let s = ShadowAnnotations::parse(&a).unwrap();
        assert_eq!(s, ShadowAnnotations::default());
        assert!(!s.pairs(&a, false));
    }

    #[test]
    fn pair_true_and_false() {
        let single = map(&[(PAIR, "true"), (SHADOW, "false")]);
        assert!(ShadowAnnotations::parse(&single).unwrap().no_shadow);
        assert!(
            !ShadowAnnotations::parse(&map(&[(SHADOW, "true")]))
                .unwrap()
                .no_shadow
        );
        let a = map(&[(PAIR, "true"), (GMS, "host")]);
        let s = ShadowAnnotations::parse(&a).unwrap();
        assert_eq!(s.gms, Some(GmsBackend::Host));
        assert!(s.pairs(&a, false));
        let a = map(&[(PAIR, "false")]);
        assert!(!ShadowAnnotations::parse(&a).unwrap().pairs(&a, false));
    }

    #[test]
    fn pod_names_pair_only_named_containers_never_the_sandbox() {
        let engine = map(&[(PAIR, "engine, sidecar2"), (CRI_CONTAINER_NAME, "engine")]);
        let other = map(&[(PAIR, "engine,sidecar2"), (CRI_CONTAINER_NAME, "proxy")]);
        let sandbox = map(&[(PAIR, "true"), (CRI_CONTAINER_TYPE, "sandbox")]);
        let unnamed = map(&[(PAIR, "engine")]);
        for (a, want) in [
            (&engine, true),
            (&other, false),
            (&sandbox, false),
            (&unnamed, false),
        ] {
            let s = ShadowAnnotations::parse(a).unwrap();
            assert_eq!(s.pairs(a, false), want, "{a:?}");
        }
    }

    #[test]
    fn pairing_by_default_spares_the_sandbox_and_explicit_opt_outs() {
        let none = map(&[]);
        let off = map(&[(PAIR, "false")]);
        let sandbox = map(&[(CRI_CONTAINER_TYPE, "sandbox")]);
        let s = |a: &HashMap<String, String>| ShadowAnnotations::parse(a).unwrap();
        assert!(s(&none).pairs(&none, true));
        assert!(!s(&none).pairs(&none, false));
        assert!(!s(&off).pairs(&off, true));
        assert!(!s(&sandbox).pairs(&sandbox, true));
    }

    #[test]
    fn bad_values_name_key_value_and_allowed() {
        for (k, v, allowed) in [
            (GMS, "gpu", "cuda|host|off"),
            (SHADOW, "no", "true|false"),
            (PAIR, "yes please", "true|false"),
            (PAIR, "", "true|false"),
            (PAIR, "a,,b", "true|false"),
            ("shadow.dev/colour", "blue", PAIR),
        ] {
            let e = ShadowAnnotations::parse(&map(&[(k, v)])).unwrap_err();
            let msg = e.to_string();
            assert!(matches!(e, Error::Annotation { .. }));
            assert!(msg.contains(k) && msg.contains(allowed), "{msg}");
        }
    }
}
