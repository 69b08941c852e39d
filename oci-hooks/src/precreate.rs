//! The `precreate` stage (a podman/CRI-O extension of OCI hooks, see
//! `oci-hooks(5)`): the runtime hands the container's config.json on stdin
//! and runs whatever the hook prints. This is the one stage where a hook
//! can add environment variables, so it is the clean path: bind mounts of
//! the pair's host directories plus the contract's env, added to the spec
//! before any namespace exists. The spec is edited as plain JSON so that
//! fields this crate does not model survive untouched.

use crate::error::{Error, Result};
use crate::layout::{parse_slot, PairLayout, PAIR_ANNOTATION, SLOT_ANNOTATION};
use serde_json::{json, Value};
use std::path::Path;

/// Returns the edited spec, or the spec unchanged when its annotations do
/// not name a pair (a hooks.d `when` clause should already have filtered).
pub fn edit_spec(mut spec: Value, root: &Path) -> Result<Value> {
    let annotation = |k: &str| {
        spec.get("annotations")
            .and_then(|a| a.get(k))
            .and_then(Value::as_str)
            .map(str::to_owned)
    };
    let Some(name) = annotation(PAIR_ANNOTATION) else {
        return Ok(spec);
    };
    let layout = PairLayout::new(root, &name)?;
    let slot = annotation(SLOT_ANNOTATION)
        .map(|s| parse_slot(&s))
        .transpose()?;
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

    fn spec(annotations: Value) -> Value {
        json!({
            "ociVersion": "1.0.2-dev",
            "process": {"env": ["PATH=/bin", "GMS_SOCKET_DIR=/elsewhere"], "args": ["sh"]},
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
        let s = spec(json!({PAIR_ANNOTATION: "p1", SLOT_ANNOTATION: "1"}));
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
        assert!(edit_spec(spec(json!({PAIR_ANNOTATION: "../etc"})), t.path()).is_err());
        assert!(edit_spec(
            spec(json!({PAIR_ANNOTATION: "p", SLOT_ANNOTATION: "2"})),
            t.path()
        )
        .is_err());
    }
}
