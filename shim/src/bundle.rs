//! What the shim reads from and leaves in a container's bundle: its OCI
//! spec, read once at Create for every part of the shim that looks at it;
//! and, for both the `start` action and the serving daemon (or its `delete`
//! action), the group a container's shim serves and the resolved config
//! that `start` saves for `delete`. Kept apart from both actions so that
//! neither imports the other.

use std::path::Path;

use serde_json::Value;

use crate::annotations::CRI_SANDBOX_ID;
use crate::error::{Error, Result};

/// A bundle's `config.json`, parsed once: typed for what the shim decides
/// from it, and as the JSON it was, for the rules shared with the hooks
/// (`shadow_contract::oci`) and for the engine specs a pair writes from it,
/// so that fields oci-spec does not know survive.
#[derive(Debug, Clone)]
pub struct BundleSpec {
    pub typed: oci_spec::runtime::Spec,
    pub raw: Value,
}

impl BundleSpec {
    /// Read and parse `config.json` of `bundle`, naming the file on failure.
    pub fn read(bundle: &Path) -> Result<Self> {
        let path = bundle.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| {
            Error::InvalidArgument(format!("reading OCI spec {}: {e}", path.display()))
        })?;
        let bad = |e: serde_json::Error| {
            Error::InvalidArgument(format!("parsing OCI spec {}: {e}", path.display()))
        };
        let raw: Value = serde_json::from_str(&text).map_err(bad)?;
        let typed = serde_json::from_value(raw.clone()).map_err(bad)?;
        Ok(BundleSpec { typed, raw })
    }
}

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
