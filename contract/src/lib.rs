//! One definition of every name that the shim, the OCI hooks, `shadowctl`,
//! the tests and the benchmarks must agree on: the engine contract
//! (docs/engine-contract.md) and the files an operator reads (docs/pairs.md).
//!
//! Before this crate each side kept its own copy of the strings, and the
//! copies drifted: the shim refused the hook's annotations, and `state.json`
//! was written by a private struct and read through string keys. Here each
//! name exists once:
//!
//! - [`env`]: the variables an engine gets;
//! - [`paths`]: where the pair directory, the lock, the notify socket and
//!   the GMS sockets are inside a container;
//! - [`host`]: where a pair's files are on the host, per containerd;
//! - [`annotations`]: the `shadow.dev/` keys, one set that both paths parse;
//! - [`hang`]: the values of the hang-detection knobs (watchdog, probe,
//!   start timeout), typed and validated;
//! - [`listen`]: the pair's listening sockets (`shadow.dev/listen`) and
//!   how they are handed (`LISTEN_FDS`);
//! - [`fdstore`]: the pair's file-descriptor store (`FDSTORE=1`): its
//!   bounds, names and fetch packets;
//! - [`handoff`]: connections the runtime accepts (`shadow.dev/accept`):
//!   the names and packet of a hand-off;
//! - [`state`]: the `state.json` schema, for its writer and its readers;
//! - [`weights`]: the digest of committed weights and the exit status of
//!   an engine that found them changed;
//! - [`oci`]: what both paths read out of an OCI spec (its rootfs, its
//!   init's PID namespace), read one way;
//! - [`lockfile`]: the election lock file's identity, as the kernel's lock
//!   records print it (the shim and gmsd both match them against it).
//!
//! Names only: the launcher of the GMS daemon, which lived here, is the
//! crate `gmsd-launch` (gms/launch), and the engine's side of the contract
//! (storing and fetching descriptors, receiving hand-offs, taking the
//! listening sockets, pacing the watchdog, holding the election lock) is
//! `shadow-engine-kit` (engine-kit), which uses these names. The crate is
//! synchronous and small on purpose: the hook is a short-lived sync
//! binary, and the shim wraps the blocking parts itself.

pub mod annotations;
pub mod env;
mod error;
pub mod fdstore;
pub mod handoff;
pub mod hang;
pub mod host;
pub mod listen;
pub mod lockfile;
pub mod oci;
pub mod paths;
pub mod state;
pub mod weights;
