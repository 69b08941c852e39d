//! Supervision logic of an active/shadow engine pair.
//!
//! The shim observes; this crate decides. Keeping the decisions free of
//! containerd, runc and sockets means every failure policy (docs/pairs.md) is a
//! unit test over plain values, and the shim is a thin adapter that turns
//! [`Action`]s into runc calls.

mod failure;
mod locks;
pub mod metrics;
mod notify;
mod pair;
mod policy;
mod promotion;
#[cfg(test)]
mod races;
mod slot;

pub use failure::{classify, ColdRestartCause, Exit, FailureClass, XidClass};
pub use locks::{parse_proc_lock_waiters, parse_proc_locks, FileId, FlockHolder};
pub use notify::{parse_notify, Notification, MAX_DATAGRAM};
pub use pair::{Action, EngineState, Event, LockHolder, LockWatch, Pair, Slot, SlotId, Snapshot};
pub use policy::{RestartBudget, RestartPolicy, Verdict};
pub use promotion::{DeathSign, Promotion};
