//! What the shim reads from and leaves in a container's bundle that both
//! the `start` action and the serving daemon (or its `delete` action) need:
//! the group a container's shim serves, and the resolved config that
//! `start` saves for `delete`. Kept apart from both actions so that neither
//! imports the other.

use std::path::Path;

use crate::annotations::CRI_SANDBOX_ID;

/// The resolved config `start` leaves in each bundle, for the `delete`
/// action (which containerd runs without the runtime options).
pub const BUNDLE_CONFIG: &str = "shadow-shim.toml";

/// The id whose shim serves this container: the pod's sandbox id when CRI
/// says so, else the container's own id. A spec that cannot be read here is
/// not an error yet: Create reports it, with a proper code.
pub fn grouping(bundle: &Path, id: &str) -> String {
    std::fs::read_to_string(bundle.join("config.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .and_then(|v| {
            v.get("annotations")?
                .get(CRI_SANDBOX_ID)?
                .as_str()
                .map(String::from)
        })
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| id.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_by_sandbox_id_else_own_id() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(grouping(d.path(), "c1"), "c1");
        std::fs::write(d.path().join("config.json"), "{not json").unwrap();
        assert_eq!(grouping(d.path(), "c1"), "c1");
        std::fs::write(
            d.path().join("config.json"),
            r#"{"ociVersion":"1.0.2","annotations":{"io.kubernetes.cri.sandbox-id":"pod9"}}"#,
        )
        .unwrap();
        assert_eq!(grouping(d.path(), "c1"), "pod9");
    }
}
