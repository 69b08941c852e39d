//! CDI (Container Device Interface) specs: `--device shadow.dev/gms=<pair>`
//! on any CDI-aware runtime (podman ≥ 4.1, CRI-O, containerd ≥ 1.7 with
//! CDI on) gives a container the same binds and env as the hook, with no
//! hook installed. One spec file per pair, named after it, so pairs come
//! and go without touching each other's files.

use crate::error::{Error, Result};
use crate::layout::PairLayout;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

pub const KIND: &str = "shadow.dev/gms";
/// The version podman 4.3 (Debian 12) accepts and that carries every edit used.
pub const CDI_VERSION: &str = "0.5.0";

/// The spec for one pair. `SHADOW_ENGINE_ID` is not in it: both slots use
/// the same device, and each container says its slot with `-e`.
pub fn spec(layout: &PairLayout) -> Value {
    let env: Vec<String> = layout
        .env(None)
        .into_iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    let mounts: Vec<Value> = layout
        .binds()
        .into_iter()
        .map(|(src, dst)| {
            json!({
                "hostPath": src,
                "containerPath": dst,
                "options": ["rbind", "rw"],
            })
        })
        .collect();
    json!({
        "cdiVersion": CDI_VERSION,
        "kind": KIND,
        "devices": [{
            "name": layout.name,
            "containerEdits": {"env": env, "mounts": mounts},
        }],
        "containerEdits": {},
    })
}

pub fn spec_path(dir: &Path, layout: &PairLayout) -> PathBuf {
    dir.join(format!("shadow-gms-{}.json", layout.name))
}

/// Writes the spec (and the host directories its mounts name, which must
/// exist when a container starts). Written whole then renamed, because a
/// runtime may rescan the directory at any moment.
pub fn generate(dir: &Path, layout: &PairLayout) -> Result<PathBuf> {
    layout.prepare()?;
    std::fs::create_dir_all(dir).map_err(|e| Error::io("creating CDI spec dir", dir, e))?;
    let path = spec_path(dir, layout);
    let text = serde_json::to_string_pretty(&spec(layout)).map_err(|source| Error::Json {
        what: "CDI spec",
        source,
    })?;
    crate::files::replace(&path, (text + "\n").as_bytes(), 0o644, "writing CDI spec")?;
    Ok(path)
}

pub fn remove(dir: &Path, layout: &PairLayout) -> Result<()> {
    let path = spec_path(dir, layout);
    match std::fs::remove_file(&path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(Error::io("removing CDI spec", &path, e))
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_names_the_kind_the_device_and_both_binds() {
        let t = tempfile::tempdir().unwrap();
        let l = PairLayout::new(&t.path().join("root"), "p9").unwrap();
        let path = generate(&t.path().join("cdi"), &l).unwrap();
        let s: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(s["kind"], KIND);
        assert_eq!(s["devices"][0]["name"], "p9");
        let edits = &s["devices"][0]["containerEdits"];
        assert_eq!(edits["mounts"][0]["containerPath"], "/run/shadow/pair");
        assert_eq!(edits["mounts"][1]["containerPath"], "/run/shadow/gms");
        assert!(edits["env"]
            .as_array()
            .unwrap()
            .contains(&json!("GMS_SOCKET_DIR=/run/shadow/gms")));
        remove(&t.path().join("cdi"), &l).unwrap();
        remove(&t.path().join("cdi"), &l).unwrap();
        assert!(!path.exists());
    }
}
