//! The `precreate` stage (a podman/CRI-O extension of OCI hooks, see
//! `oci-hooks(5)`): the runtime hands the container's config.json on stdin
//! and runs whatever the hook prints. This is the one stage where a hook
//! can add environment variables, so it is the clean path: bind mounts of
//! the pair's host directories plus the contract's env, added to the spec
//! before any namespace exists. The spec is edited as plain JSON so that
//! fields this crate does not model survive untouched.

use crate::admission::{admit, uid_of, Candidate};
use crate::error::{Error, Result};
use crate::layout::PairLayout;
use serde_json::{json, Value};
use shadow_contract::annotations::Annotations;
use std::collections::HashMap;
use std::path::Path;

/// The spec's `shadow.dev/` annotations, validated as the shim validates
/// them (the shim's own keys are accepted and left to the shim).
pub fn annotations_of(spec: &Value) -> Result<Annotations> {
    let strings = spec
        .get("annotations")
        .and_then(Value::as_object)
        .into_iter()
        .flatten()
        .filter_map(|(k, v)| Some((k.as_str(), v.as_str()?)));
    Ok(Annotations::parse(strings)?)
}

/// A pair the hooks assemble has no supervisor to end a hung engine: the
/// hang-detection keys are the shim's alone, so one here is refused rather
/// than left to do nothing.
fn refuse_hang_keys(spec: &Value) -> Result<()> {
    refuse_hang_keys_in(
        spec.get("annotations")
            .and_then(Value::as_object)
            .into_iter()
            .flatten()
            .map(|(k, v)| (k.as_str(), v.as_str().unwrap_or_default())),
    )
}

/// [`refuse_hang_keys`] over `(key, value)` annotations (the createRuntime
/// hook's, from the OCI state).
pub(crate) fn refuse_hang_keys_in<'a>(
    mut annotations: impl Iterator<Item = (&'a str, &'a str)>,
) -> Result<()> {
    match annotations.find(|(k, _)| shadow_contract::annotations::HANG_KEYS.contains(k)) {
        Some((key, value)) => Err(shadow_contract::annotations::AnnotationError {
            key: key.to_string(),
            value: value.to_string(),
            allowed: "nothing here: hang detection needs the shim runtime (io.containerd.shadow.v1); a pair assembled by the OCI hooks has no supervisor to end a hung engine".into(),
        }
        .into()),
        None => Ok(()),
    }
}

/// Returns the edited spec, or the spec unchanged when its annotations do
/// not name a pair (a hooks.d `when` clause should already have filtered).
/// A container that names a pair it was not admitted to (see `admission`)
/// is refused: an error, so the runtime does not create it.
pub fn edit_spec(mut spec: Value, root: &Path) -> Result<Value> {
    let annotations = annotations_of(&spec)?;
    let Some(name) = annotations.pair_name else {
        return Ok(spec);
    };
    refuse_hang_keys(&spec)?;
    if let Some(n) = annotations.shadows {
        // The hooks run no supervisor: a pair's shadows are the containers
        // the operator runs under its name, one `shadow.dev/slot` each.
        return Err(shadow_contract::annotations::AnnotationError {
            key: shadow_contract::annotations::SHADOWS.to_string(),
            value: n.to_string(),
            allowed: format!(
                "nothing here: a pair assembled by the OCI hooks has as many shadows as containers run with {} = {name}, each with its own {} (0 to {})",
                shadow_contract::annotations::PAIR_NAME,
                shadow_contract::annotations::SLOT,
                shadow_contract::annotations::MAX_SHADOWS
            ),
        }
        .into());
    }
    if let Some(n) = annotations.fdstore_max.filter(|n| *n > 0) {
        // Nobody reads the notify socket on this path: no store to keep.
        return Err(shadow_contract::annotations::AnnotationError {
            key: shadow_contract::annotations::FDSTORE_MAX.to_string(),
            value: n.to_string(),
            allowed: "0 here: a pair assembled by the OCI hooks has no runtime to keep an fd store (the shim's pairs do)".to_string(),
        }
        .into());
    }
    if annotations.accept == Some(shadow_contract::handoff::Accept::Runtime) {
        // Nothing on this path accepts for the engines.
        return Err(shadow_contract::annotations::AnnotationError {
            key: shadow_contract::annotations::ACCEPT.to_string(),
            value: "runtime".to_string(),
            allowed: "engine here: a pair assembled by the OCI hooks has no runtime to accept for it (the shim's pairs do)".to_string(),
        }
        .into());
    }
    let layout = PairLayout::of(root, &name);
    let slot = annotations.slot;
    let all: HashMap<String, String> = spec
        .get("annotations")
        .and_then(Value::as_object)
        .into_iter()
        .flatten()
        .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_owned())))
        .collect();
    admit(
        &layout,
        &Candidate {
            id: None,
            uid: uid_of(&spec),
            annotations: &all,
        },
    )?;
    layout.prepare()?;

    let obj = spec.as_object_mut().ok_or_else(|| Error::Shape {
        what: "config.json",
        why: "not a JSON object".into(),
    })?;
    let mounts = obj
        .entry("mounts")
        .or_insert_with(|| Value::Array(Vec::new()))
        .as_array_mut()
        .ok_or_else(|| Error::Shape {
            what: "config.json mounts",
            why: "not an array".into(),
        })?;
    for (source, destination) in layout.binds() {
        // A mount the user asked for at the same place wins: they meant it.
        if mounts
            .iter()
            .any(|m| m.get("destination").and_then(Value::as_str) == Some(destination))
        {
            eprintln!("shadow-oci-hook: {destination} is already mounted by the spec; keeping it");
            continue;
        }
        mounts.push(json!({
            "destination": destination,
            "type": "bind",
            "source": source,
            "options": ["rbind", "rw"],
        }));
    }

    let env = obj
        .entry("process")
        .or_insert_with(|| json!({}))
        .as_object_mut()
        .ok_or_else(|| Error::Shape {
            what: "config.json process",
            why: "not an object".into(),
        })?
        .entry("env")
        .or_insert_with(|| Value::Array(Vec::new()))
        .as_array_mut()
        .ok_or_else(|| Error::Shape {
            what: "config.json process.env",
            why: "not an array".into(),
        })?;
    for (k, v) in layout.env(slot) {
        let prefix = format!("{k}=");
        // Replace, so the contract's values are the ones the engine sees.
        env.retain(|e| !e.as_str().is_some_and(|s| s.starts_with(&prefix)));
        env.push(Value::String(format!("{k}={v}")));
    }
    Ok(spec)
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::admission::Admission;
    use shadow_contract::annotations::{GMS, PAIR, PAIR_NAME, SHADOW, SLOT};

    /// What `gms start --pair <name> --allow-uid 0` records.
    fn started(root: &Path, name: &str) {
        let l = PairLayout::new(root, name).unwrap();
        l.prepare().unwrap();
        Admission::from_flags(&[0], &[]).unwrap().save(&l).unwrap();
    }

    fn spec(annotations: Value) -> Value {
        json!({
            "ociVersion": "1.0.2-dev",
            "process": {"user": {"uid": 0, "gid": 0}, "env": ["PATH=/bin", "GMS_SOCKET_DIR=/elsewhere"], "args": ["sh"]},
            "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"}],
            "annotations": annotations,
            "x-unknown-field": {"kept": true},
        })
    }

    #[test]
    fn without_the_annotation_the_spec_is_unchanged() {
        let t = tempfile::tempdir().unwrap();
        let s = spec(json!({"other": "1"}));
        assert_eq!(edit_spec(s.clone(), t.path()).unwrap(), s);
        assert_eq!(std::fs::read_dir(t.path()).unwrap().count(), 0);
    }

    #[test]
    fn the_annotation_adds_binds_and_env_and_keeps_the_rest() {
        let t = tempfile::tempdir().unwrap();
        started(t.path(), "p1");
        let s = spec(json!({PAIR_NAME: "p1", SLOT: "1"}));
        let out = edit_spec(s, t.path()).unwrap();
        assert_eq!(out["x-unknown-field"]["kept"], true);
        let env: Vec<&str> = out["process"]["env"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(Value::as_str)
            .collect();
        assert!(env.contains(&"GMS_SOCKET_DIR=/run/shadow/gms"));
        assert!(!env.contains(&"GMS_SOCKET_DIR=/elsewhere"));
        assert!(env.contains(&"SHADOW_ENGINE_ID=1"));
        assert!(env.contains(&"SHADOW_LOCK_PATH=/run/shadow/pair/engine.lock"));
        let mounts = out["mounts"].as_array().unwrap();
        assert_eq!(mounts.len(), 3);
        assert_eq!(
            mounts[1]["source"],
            t.path().join("p1/pair").display().to_string()
        );
        assert!(t.path().join("p1/pair/engine.lock").is_file());
    }

    #[test]
    fn bad_names_and_slots_are_errors_not_edits() {
        let t = tempfile::tempdir().unwrap();
        started(t.path(), "p");
        assert!(edit_spec(spec(json!({PAIR_NAME: "../etc"})), t.path()).is_err());
        let e = edit_spec(spec(json!({PAIR_NAME: "p", SLOT: "4"})), t.path()).unwrap_err();
        assert!(e.to_string().contains(SLOT), "{e}");
        // No fd store on this path.
        let key = shadow_contract::annotations::FDSTORE_MAX;
        let e = edit_spec(spec(json!({PAIR_NAME: "p", key: "16"})), t.path()).unwrap_err();
        assert!(
            e.to_string().contains("no runtime to keep an fd store"),
            "{e}"
        );
        assert!(edit_spec(spec(json!({PAIR_NAME: "p", key: "0"})), t.path()).is_ok());
        // Nobody to accept for the engines on this path.
        let key = shadow_contract::annotations::ACCEPT;
        let e = edit_spec(spec(json!({PAIR_NAME: "p", key: "runtime"})), t.path()).unwrap_err();
        assert!(e.to_string().contains("no runtime to accept"), "{e}");
        assert!(edit_spec(spec(json!({PAIR_NAME: "p", key: "engine"})), t.path()).is_ok());
        // Slots beyond 1: a pair of several shadows.
        let edited = edit_spec(spec(json!({PAIR_NAME: "p", SLOT: "3"})), t.path()).unwrap();
        assert!(
            edited.to_string().contains("SHADOW_ENGINE_ID=3"),
            "{edited}"
        );
        let shadows = shadow_contract::annotations::SHADOWS;
        let e = edit_spec(spec(json!({PAIR_NAME: "p", shadows: "2"})), t.path()).unwrap_err();
        assert!(
            e.to_string().contains("as many shadows as containers"),
            "{e}"
        );
        // The shim's keys are validated the same way here.
        let e = edit_spec(spec(json!({PAIR_NAME: "p", GMS: "tpu"})), t.path()).unwrap_err();
        assert!(e.to_string().contains("cuda|host|off"), "{e}");
        // Hang detection is the shim's: a valid value is refused, a bad
        // one too (with the parser's words).
        let watchdog = shadow_contract::annotations::WATCHDOG;
        let e = edit_spec(spec(json!({PAIR_NAME: "p", watchdog: "100ms"})), t.path()).unwrap_err();
        assert!(e.to_string().contains("io.containerd.shadow.v1"), "{e}");
        let e = edit_spec(spec(json!({PAIR_NAME: "p", watchdog: "1ms"})), t.path()).unwrap_err();
        assert!(e.to_string().contains("from 50ms"), "{e}");
        // Without a pair name the hook leaves the spec to the shim.
        let s = spec(json!({watchdog: "100ms"}));
        assert_eq!(edit_spec(s.clone(), t.path()).unwrap(), s);
    }

    /// Naming a pair is not enough to join it: the operator must have
    /// started it, and the container must match its rules.
    #[test]
    fn a_container_not_admitted_to_the_pair_it_names_is_refused() {
        let t = tempfile::tempdir().unwrap();
        let e = edit_spec(spec(json!({PAIR_NAME: "victim"})), t.path()).unwrap_err();
        assert!(e.to_string().contains("not created by the operator"), "{e}");
        assert!(!t.path().join("victim").exists(), "the hook made the pair");

        let l = PairLayout::new(t.path(), "victim").unwrap();
        l.prepare().unwrap();
        Admission::from_flags(&[], &["io.kubernetes.pod.namespace=team-a".into()])
            .unwrap()
            .save(&l)
            .unwrap();
        let intruder = spec(json!({PAIR_NAME: "victim", "io.kubernetes.pod.namespace": "team-b"}));
        let e = edit_spec(intruder, t.path()).unwrap_err();
        assert!(e.to_string().contains("may not join pair victim"), "{e}");
        let member = spec(json!({PAIR_NAME: "victim", "io.kubernetes.pod.namespace": "team-a"}));
        let out = edit_spec(member, t.path()).unwrap();
        assert_eq!(out["mounts"].as_array().unwrap().len(), 3);
    }

    /// One spec serves both paths: the shim's keys do not stop the hook.
    #[test]
    fn the_shims_annotations_are_tolerated() {
        let t = tempfile::tempdir().unwrap();
        let shim_only = spec(json!({PAIR: "true", GMS: "host", SHADOW: "true"}));
        assert_eq!(edit_spec(shim_only.clone(), t.path()).unwrap(), shim_only);
        started(t.path(), "p2");
        let both = spec(json!({PAIR: "true", GMS: "host", PAIR_NAME: "p2", SLOT: "0"}));
        let out = edit_spec(both, t.path()).unwrap();
        assert!(out["process"]["env"]
            .as_array()
            .unwrap()
            .contains(&json!("SHADOW_ENGINE_ID=0")));
    }
}
