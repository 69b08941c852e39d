//! `gmsd-launch`: the one launcher of `gmsd`, used by the shim (one daemon
//! per device of a pair) and by the OCI hook (`gms start` / `gms run`, for
//! podman, CRI-O and runc, where no shim supervises).
//!
//! It was `shadow_contract::gmsd`; it is a crate of its own because
//! `shadow-contract` holds the names other tools depend on, and this is
//! process code (fork/exec, cgroup join, capset, the readiness pipe). What
//! may be changed here freely, and what the shim, the hook and the docs
//! rely on, is in this crate's README.md.
//!
//! Readiness is a pipe, not a poll of the socket directory: gmsd's stdout
//! is a pipe to the launcher, and gmsd writes `ready <socket>` on it once
//! the socket listens. The launcher polls that pipe together with a pidfd
//! of the child, so it learns, within its timeout, one of three things:
//! the socket; that gmsd ended first, with its exit status; or that it did
//! not answer in time, after which it is killed.
//!
//! Who reaps the child is the caller's choice ([`Reaper`]). The shim is a
//! subreaper whose one reaper loop calls `waitpid(-1)`; nothing else may
//! take an exit from it, so there the launcher only *peeks* at an early
//! exit (`waitid(P_PIDFD, …, WNOWAIT)`) and leaves the zombie to the
//! reaper. The hook owns its child and lets the launcher reap it.
//!
//! Every capability is dropped in the child before exec: gmsd serves a
//! socket in a directory its uid owns and needs none.
//!
//! [`pidfd`] is the workspace's one `pidfd_open(2)`: the launcher's, the
//! shim's leftover cleanup's and the test harness's.
//!
//! One job a module, each using only the ones before it in this list:
//! `error` ([`LaunchError`]), `handle` ([`Gmsd`], [`Reaper`]), `pre_exec`
//! (what runs between fork and exec, [`JOIN_FAILED`]), `command`
//! ([`GmsdCommand`], the command line), `ready` (the readiness pipe,
//! [`READY_PREFIX`]) and `spawn` (`GmsdCommand::spawn`, which uses all of
//! them and `pidfd`). This file only declares them and re-exports their public items,
//! so `gmsd_launch::X` is the one path callers name.

mod command;
mod error;
mod handle;
pub mod pidfd;
mod pre_exec;
mod ready;
mod spawn;

pub use command::GmsdCommand;
pub use error::LaunchError;
pub use handle::{Gmsd, Reaper};
pub use pre_exec::JOIN_FAILED;
pub use ready::READY_PREFIX;
