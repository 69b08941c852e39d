//! The `shadow.dev/` annotations: the user-facing switch between a plain
//! container and an engine pair. Parsed and validated once, at Create, so a
//! typo is refused with the key, the value and what is allowed, before any
//! process exists.

use std::collections::HashMap;

use crate::error::{Error, Result};

pub const PREFIX: &str = "shadow.dev/";
pub const PAIR: &str = "shadow.dev/pair";
pub const GMS: &str = "shadow.dev/gms";

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
                _ => {
                    return Err(bad(
                        key,
                        value,
                        &format!("keys {PAIR} and {GMS} under {PREFIX}"),
                    ))
                }
            }
        }
        Ok(out)
    }

    /// Whether this container becomes an engine pair. The sandbox (pause)
    /// container never does; a pod-wide name list applies only to the
    /// containers it names.
    pub fn wants_pairing(&self, annotations: &HashMap<String, String>) -> bool {
        if annotations.get(CRI_CONTAINER_TYPE).map(String::as_str) == Some("sandbox") {
            return false;
        }
        match &self.pair {
            PairRequest::Absent | PairRequest::Off => false,
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
        assert!(!s.wants_pairing(&a));
    }

    #[test]
    fn pair_true_and_false() {
        let a = map(&[(PAIR, "true"), (GMS, "host")]);
        let s = ShadowAnnotations::parse(&a).unwrap();
        assert_eq!(s.gms, Some(GmsBackend::Host));
        assert!(s.wants_pairing(&a));
        let a = map(&[(PAIR, "false")]);
        assert!(!ShadowAnnotations::parse(&a).unwrap().wants_pairing(&a));
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
            assert_eq!(s.wants_pairing(a), want, "{a:?}");
        }
    }

    #[test]
    fn bad_values_name_key_value_and_allowed() {
        for (k, v, allowed) in [
            (GMS, "gpu", "cuda|host|off"),
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
