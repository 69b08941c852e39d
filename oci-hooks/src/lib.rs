//! `shadow-oci-hook`: the shadow engine contract (election lock + GMS
//! sockets, docs/engine-contract.md) for containers that our containerd shim does
//! not run — podman, CRI-O, plain runc. Pairing and supervision stay the
//! shim's job; this crate only provides the plumbing: an OCI hook
//! (`precreate` for podman/CRI-O, `createRuntime` + `poststop` for any OCI
//! runtime), CDI specs, and a gmsd launcher per pair.

pub mod admission;
pub mod cdi;
pub mod create_runtime;
pub mod error;
pub mod files;
pub mod gms_daemon;
pub mod layout;
pub mod precreate;

pub use error::{Error, Result};
pub use layout::PairLayout;
