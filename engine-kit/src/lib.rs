//! The engine's side of the shadow engine contract (docs/engine-contract.md),
//! for engine authors who write in Rust: what an engine calls, where
//! `shadow-contract` only names things.
//!
//! Why a crate of its own: `shadow-contract` is the crate of names that
//! the shim, the OCI hooks, the tools and the tests share (annotations,
//! environment variables, packet formats, `state.json`). The helpers that
//! act on those names from inside an engine (send on the notify socket,
//! receive descriptors, fork a lock holder) grew there until the crate of
//! names held an engine's code and its modules used each other in a circle.
//! Here they depend on the names, never the other way round, and an engine
//! takes one crate:
//!
//! - [`listen`]: take the pair's listening sockets (`LISTEN_FDS`);
//! - [`fdstore`]: store, remove and fetch descriptors in the pair's store
//!   (`FDSTORE=1`), and tell the store from the sockets at start;
//! - [`handoff`]: receive the connections the runtime accepts
//!   (`shadow.dev/accept: runtime`);
//! - [`tcp`]: how many bytes the engines wrote to a connection
//!   (`TCP_INFO`, `SIOCOUTQ`), to resume one a dead engine answered in part;
//! - [`watchdog`]: when a watchdog ping is due, and whether every rank
//!   advanced since the last;
//! - [`lock`]: the election lock held by a small forked process, so that a
//!   large engine's death frees it at once.
//!
//! Synchronous and small on purpose: an engine of any kind can link it.

pub mod fdstore;
pub mod handoff;
pub mod listen;
pub mod lock;
pub mod tcp;
pub mod watchdog;
