//! Committed weights that an engine found changed (docs/engine-contract.md,
//! "Weights verified on promotion").
//!
//! On the CUDA backend a reader's mapping cannot be made read-only by the
//! runtime: any engine holding the exported handle may map it read-write
//! and change the weights under the engine that serves. What the runtime
//! can do is notice. The writer records a digest of every committed
//! allocation in the layout's metadata under [`DIGEST_KEY`]; an engine that
//! maps the weights recomputes it (on the GPU, before `READY=1` when it is
//! promoted) and, on a mismatch, exits with [`CORRUPT_EXIT`]. The shim then
//! restarts the pair cold: the daemons start empty and the weights are
//! loaded again from their source.

/// The exit status an engine ends with when the committed weights it
/// mapped do not match their recorded digest (`EX_DATAERR` of sysexits.h:
/// the input data was incorrect). An engine of a pair must not use it for
/// anything else: whatever exits with it makes the pair restart cold.
pub const CORRUPT_EXIT: i32 = 65;

/// The layout metadata key of the digest a writer records at commit.
pub const DIGEST_KEY: &str = "shadow/weights-digest";

/// The digest scheme's name, the `scheme` field of [`DIGEST_KEY`]'s value
/// (docs/gms-protocol.md, "Weights digest").
pub const DIGEST_SCHEME: &str = "sum64-2MiB-sha256/v1";

#[cfg(test)]
mod tests {
    use super::*;

    /// `shadow_gms` (Python, for PyTorch engines) spells the same names:
    /// an engine and the runtime must agree on them.
    #[test]
    fn the_python_helpers_use_the_same_names() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../gms/python/shadow_gms");
        let read =
            |f: &str| std::fs::read_to_string(dir.join(f)).unwrap_or_else(|e| panic!("{f}: {e}"));
        let client = read("client.py");
        let contract = read("contract.py");
        assert!(
            client.contains(&format!("DIGEST_KEY = \"{DIGEST_KEY}\"")),
            "client.py's DIGEST_KEY"
        );
        assert!(
            client.contains(&format!("DIGEST_SCHEME = \"{DIGEST_SCHEME}\"")),
            "client.py's DIGEST_SCHEME"
        );
        assert!(
            client.contains("DIGEST_CHUNK = 2 << 20") && DIGEST_SCHEME.contains("2MiB"),
            "client.py's DIGEST_CHUNK"
        );
        assert!(
            contract.contains(&format!("CORRUPT_EXIT = {CORRUPT_EXIT}\n")),
            "contract.py's CORRUPT_EXIT"
        );
    }
}
