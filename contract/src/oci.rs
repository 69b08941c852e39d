//! What the shim and the OCI hooks read out of a container's OCI spec, read
//! one way for both: where its rootfs is, and whether its init has a PID
//! namespace of its own. Each rule was written twice before and the copies
//! disagreed (a namespace entry with `"path": ""` is a new namespace to
//! runc, and was taken for a joined one by one copy).

use std::path::{Path, PathBuf};

use serde_json::Value;

/// The rootfs of `spec` in `bundle`: `root.path`, relative to the bundle
/// unless absolute; `None` when the spec names none.
pub fn rootfs(spec: &Value, bundle: &Path) -> Option<PathBuf> {
    let root = Path::new(spec.pointer("/root/path")?.as_str()?);
    Some(if root.is_absolute() {
        root.to_path_buf()
    } else {
        bundle.join(root)
    })
}

/// Whether the spec gives its init a PID namespace of its own: a `pid`
/// entry without a path, or with an empty one (runc makes a new namespace
/// for both). Without one (the host's, or one joined by path) the kernel
/// leaves the other processes running when the init dies, and the runtime
/// kills them itself (runc-v2's `ShouldKillAllOnExit`).
pub fn own_pid_namespace(spec: &Value) -> bool {
    spec.pointer("/linux/namespaces")
        .and_then(Value::as_array)
        .is_some_and(|nss| {
            nss.iter().any(|ns| {
                ns.get("type").and_then(Value::as_str) == Some("pid")
                    && ns
                        .get("path")
                        .and_then(Value::as_str)
                        .is_none_or(str::is_empty)
            })
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_rootfs_is_relative_to_the_bundle_unless_absolute() {
        let b = Path::new("/run/b");
        assert_eq!(
            rootfs(&json!({"root": {"path": "rootfs"}}), b),
            Some(PathBuf::from("/run/b/rootfs"))
        );
        assert_eq!(
            rootfs(&json!({"root": {"path": "/srv/r"}}), b),
            Some(PathBuf::from("/srv/r"))
        );
        assert_eq!(rootfs(&json!({}), b), None);
    }

    #[test]
    fn an_empty_namespace_path_is_a_new_namespace() {
        let ns = |v: Value| json!({"linux": {"namespaces": v}});
        assert!(own_pid_namespace(&ns(json!([{"type": "pid"}]))));
        assert!(own_pid_namespace(&ns(json!([{"type": "pid", "path": ""}]))));
        assert!(!own_pid_namespace(&ns(
            json!([{"type": "pid", "path": "/proc/1/ns/pid"}])
        )));
        assert!(!own_pid_namespace(&ns(json!([{"type": "network"}]))));
        assert!(!own_pid_namespace(&json!({})));
    }
}
