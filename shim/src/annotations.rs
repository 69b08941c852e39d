//! The `shadow.dev/` annotations: the user-facing switch between a plain
//! container and an engine pair. Parsed and validated once, at Create, so a
//! typo is refused with the key, the value and what is allowed, before any
//! process exists.
//!
//! The key set and its parser are `shadow_contract::annotations`, shared
//! with the OCI hook: a spec written for the hooks (`shadow.dev/pair-name`,
//! `shadow.dev/slot`) is accepted here too, its values validated. The shim
//! acts only on `pair`, `gms` and `shadow`; a pair it makes numbers its
//! own slots. What is left here is the shim's own question: does this
//! container, in this pod, become a pair?

use std::collections::HashMap;

pub use shadow_contract::annotations::{Annotations as ShadowAnnotations, GmsBackend, PairRequest};

/// CRI annotations that decide whether a pod-style request names us.
pub const CRI_CONTAINER_TYPE: &str = "io.kubernetes.cri.container-type";
pub const CRI_CONTAINER_NAME: &str = "io.kubernetes.cri.container-name";
pub const CRI_SANDBOX_ID: &str = "io.kubernetes.cri.sandbox-id";

/// The pairing decision, on the parsed annotations.
pub trait Pairing {
    /// Whether this container becomes an engine pair. The sandbox (pause)
    /// container never does; a pod-wide name list applies only to the
    /// containers it names.
    ///
    /// `by_default` (the config's `pair.pair_by_default`) pairs containers
    /// that carry no `shadow.dev/pair` at all; `shadow.dev/pair=false` still
    /// opts out.
    fn pairs(&self, annotations: &HashMap<String, String>, by_default: bool) -> bool;
}

impl Pairing for ShadowAnnotations {
    fn pairs(&self, annotations: &HashMap<String, String>, by_default: bool) -> bool {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use shadow_contract::annotations::{GMS, PAIR, PAIR_NAME, SHADOW, SLOT};

    fn parse(a: &HashMap<String, String>) -> crate::error::Result<ShadowAnnotations> {
        Ok(ShadowAnnotations::parse(a)?)
    }

    fn map(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn no_annotations_is_plain() {
        let a = map(&[("other.io/x", "y")]);
        let s = parse(&a).unwrap();
        assert_eq!(s, ShadowAnnotations::default());
        assert!(!s.pairs(&a, false));
    }

    #[test]
    fn pair_true_and_false() {
        let single = map(&[(PAIR, "true"), (SHADOW, "false")]);
        assert!(parse(&single).unwrap().no_shadow);
        assert!(!parse(&map(&[(SHADOW, "true")])).unwrap().no_shadow);
        let a = map(&[(PAIR, "true"), (GMS, "host")]);
        let s = parse(&a).unwrap();
        assert_eq!(s.gms, Some(GmsBackend::Host));
        assert!(s.pairs(&a, false));
        let a = map(&[(PAIR, "false")]);
        assert!(!parse(&a).unwrap().pairs(&a, false));
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
            let s = parse(a).unwrap();
            assert_eq!(s.pairs(a, false), want, "{a:?}");
        }
    }

    #[test]
    fn pairing_by_default_spares_the_sandbox_and_explicit_opt_outs() {
        let none = map(&[]);
        let off = map(&[(PAIR, "false")]);
        let sandbox = map(&[(CRI_CONTAINER_TYPE, "sandbox")]);
        let s = |a: &HashMap<String, String>| parse(a).unwrap();
        assert!(s(&none).pairs(&none, true));
        assert!(!s(&none).pairs(&none, false));
        assert!(!s(&off).pairs(&off, true));
        assert!(!s(&sandbox).pairs(&sandbox, true));
    }

    /// One spec serves both paths: the hook's keys do not make the shim
    /// refuse it, nor pair it.
    #[test]
    fn hook_annotations_are_accepted_and_leave_the_container_plain() {
        let a = map(&[(PAIR_NAME, "llama"), (SLOT, "1")]);
        let s = parse(&a).unwrap();
        assert_eq!(s.slot, Some(1));
        assert!(!s.pairs(&a, false));
        let both = map(&[(PAIR, "true"), (PAIR_NAME, "llama"), (SLOT, "0")]);
        assert!(parse(&both).unwrap().pairs(&both, false));
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
            (SLOT, "4", "0 to 3"),
            (PAIR_NAME, "../x", "[A-Za-z0-9_.-]"),
        ] {
            let e = parse(&map(&[(k, v)])).unwrap_err();
            let msg = e.to_string();
            assert!(matches!(e, Error::Annotation { .. }));
            assert!(msg.contains(k) && msg.contains(allowed), "{msg}");
        }
    }
}
