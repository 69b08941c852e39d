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
mod runtime;
pub mod vllm;

pub use shadow_wait as wait;

pub use containerd::{
    assert_exit_before_delete, containerd_version, Container, Containerd, ContainerdBuilder,
};
pub use ctr::{forwards_signals, Ctr, Output};
pub use error::{Error, Result};
pub use image::OciImage;
pub use leftovers::{
    mounts_under, our_processes, runc_containers, shim_socket_paths, Leftover, RUNC_STATE_ROOT,
};
pub use process::Spawned;
pub use rootfs::Rootfs;
pub use runtime::{shim_path, Runtime, SHIM_BINARY};

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
