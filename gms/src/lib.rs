//! GPU Memory Service (GMS), the side every peer of `gmsd` shares: the wire
//! protocol and the engine-side client.
//!
//! One `gmsd` per device owns every physical allocation. Engines connect over
//! a Unix socket; the connection *is* the lease (`rw`, `ro`, `rw_or_ro`), and
//! allocations travel as file descriptors. Weights therefore outlive the
//! engine that loaded them, and a shadow engine maps them at the same
//! virtual addresses in milliseconds. See `docs/gms-protocol.md`.
//!
//! This crate exists apart from the daemon (crate `gmsd`, in `gms/daemon`)
//! so that whoever only talks to a daemon — an engine, the shim asking for a
//! status report, the tests — links neither the daemon, nor the CUDA driver
//! bindings, nor a CLI parser. On a GPU, `gms-cuda` adds the CUDA mapper.
//!
//! Layers, each in its own module, each using only those listed before it:
//! - [`types`]: the plain data every layer shares (lease modes and kinds,
//!   error codes, an allocation, metadata);
//! - `error`: the one error type and its wire code ([`Error`]);
//! - [`layout`]: allocations, metadata and the committed layout;
//! - [`status`]: what a daemon reports;
//! - [`protocol`]: versioned JSON messages and the pure decoder;
//! - [`wire`]: framing and `SCM_RIGHTS` over a stream socket;
//! - [`mapper`], [`kv`] and [`client`]: the engine side (host memory
//!   mapper, the KV cache that grows on wake);
//! - [`kvpool`]: the engine side of the pair's KV pool (its write lease,
//!   index and fence), which outlives every engine;
//! - [`holder`]: who holds the pair's election lock, read off `fdinfo`
//!   (the shim's proof of an engine, gmsd's of a KV pool's writer).

pub mod client;
mod error;
pub mod holder;
pub mod kv;
pub mod kvpool;
pub mod layout;
pub mod mapper;
pub mod protocol;
pub mod status;
pub mod types;
pub mod wire;

pub use error::{Error, Result};
pub use mapper::Access;
