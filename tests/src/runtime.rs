//! The runtimes a test runs against (containerd's own runc shim, the
//! reference, and ours) and where our shim's binary is.

use std::path::PathBuf;

use crate::error::{Error, Result};

/// Binary name of our shim; containerd derives it from the runtime type.
pub const SHIM_BINARY: &str = "containerd-shim-shadow-v1";

/// The runtime a test runs against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Runtime {
    /// containerd's own Go shim, `containerd-shim-runc-v2`: proves a test is right.
    RuncV2,
    /// Our shim, `containerd-shim-shadow-v1`: the product under test.
    Shadow,
}

impl Runtime {
    /// The runtime type `ctr run --runtime` takes.
    pub fn runtime_type(self) -> &'static str {
        match self {
            Runtime::RuncV2 => "io.containerd.runc.v2",
            Runtime::Shadow => "io.containerd.shadow.v1",
        }
    }

    /// The shim binary's file name, as it appears in `/proc/<pid>/comm`-ish places.
    pub fn shim_binary(self) -> &'static str {
        match self {
            Runtime::RuncV2 => "containerd-shim-runc-v2",
            Runtime::Shadow => SHIM_BINARY,
        }
    }
}

/// Where our shim binary is: `$SHADOW_SHIM_BIN` if set, else the workspace's
/// `target/<profile>/` (honouring `$CARGO_TARGET_DIR`).
///
/// Integration tests cannot make cargo build another package's binary, so
/// `make test` builds the workspace first; a missing binary is an error that
/// says so rather than a silent fallback to some installed copy.
pub fn shim_path(profile: &str) -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("SHADOW_SHIM_BIN") {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Ok(p)
        } else {
            Err(Error::ShimNotFound {
                path: p,
                hint: "SHADOW_SHIM_BIN points at no file",
            })
        };
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"));
    let p = target.join(profile).join(SHIM_BINARY);
    if p.is_file() {
        Ok(p)
    } else {
        Err(Error::ShimNotFound {
            path: p,
            hint: "build it first: `cargo build -p shadow-shim` (or `make build`)",
        })
    }
}
