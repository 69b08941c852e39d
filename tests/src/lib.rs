//! Integration-test harness for shadow.
//!
//! Every test gets its own private containerd (own root, state, sockets and
//! config in a temp dir; never the host's `/run/containerd` daemon), a busybox
//! rootfs, a bounded `ctr` client and a leftover check, so that tests can run
//! in parallel with each other and with other people's work on the machine,
//! and so that a test that fails still leaves nothing behind.
//!
//! The pieces:
//! - [`Containerd`]: the private daemon, as a guard that cleans up on drop;
//! - [`Rootfs`]: a busybox-static root filesystem builder;
//! - [`Ctr`], [`Spawned`]: `ctr` invocations with a hard kill deadline;
//! - [`Leftover`]: what the cleanup check looks for;
//! - [`cri::Cri`], [`OciImage`]: a CRI v1 client and local OCI images, for
//!   the Kubernetes path;
//! - [`Runtime`] and [`runtime_arms!`]: one behaviour test, run against both
//!   `io.containerd.runc.v2` (the reference) and `io.containerd.shadow.v1`;
//! - [`wait`]: the bounded polls every wait on real state goes through;
//! - [`bench`]: what the benchmark binaries share (clock, percentiles,
//!   signals, a process's CPU time);
//! - [`vllm`]: vLLM engines through containerd, for the vLLM test and bench.

pub mod bench;
mod containerd;
pub mod cri;
mod ctr;
mod error;
pub mod gpus;
mod image;
mod leftovers;
pub mod pair;
mod process;
mod rootfs;
pub mod vllm;

pub use shadow_wait as wait;

pub use containerd::{
    assert_exit_before_delete, containerd_version, Container, Containerd, ContainerdBuilder,
    RUNC_STATE_ROOT,
};
pub use ctr::{forwards_signals, Ctr, Output};
pub use error::Error;
pub use image::OciImage;
pub use leftovers::{mounts_under, our_processes, runc_containers, shim_socket_paths, Leftover};
pub use process::Spawned;
pub use rootfs::Rootfs;

use std::path::PathBuf;

/// Result of harness operations.
pub type Result<T, E = Error> = std::result::Result<T, E>;

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

/// Generate, for each named behaviour test `fn name(rt: Runtime)` in scope,
/// a `runc_v2::name` test (reference arm) and a `shadow::name` test (product arm).
///
/// ```text
/// fn prints_stdout(rt: Runtime) { /* … */ }
/// shadow_tests::runtime_arms!(prints_stdout, exit_codes);
/// ```
#[macro_export]
macro_rules! runtime_arms {
    ($($name:ident),+ $(,)?) => {
        mod runc_v2 {
            $(
                #[test]
                fn $name() {
                    super::$name($crate::Runtime::RuncV2)
                }
            )+
        }
        mod shadow {
            $(
                #[test]
                fn $name() {
                    super::$name($crate::Runtime::Shadow)
                }
            )+
        }
    };
}
