//! `gmsd`, the GPU Memory Service daemon: one per device, owner of every
//! physical allocation of an engine pair, so that weights outlive the engine
//! that loaded them. Engines reach it through the `gms` crate (protocol and
//! client); this crate is what only the daemon and its tools need, kept
//! apart so that a client never links it. See `docs/gms-protocol.md`.
//!
//! Layers, each in its own module:
//! - [`lease`]: the lease state machine (pure logic);
//! - [`backend`]: the physical memory behind allocations (`host`, `cuda`);
//! - [`daemon`]: the accept loop, peer checks, limits, one thread per lease;
//! - [`fuzz`]: the stable-toolchain fuzzer of the decoder and lease machine.

pub mod backend;
pub mod daemon;
pub mod fuzz;
pub mod lease;
