//! Supervision logic of an active/shadow engine pair.
//!
//! The shim observes; this crate decides. Keeping the decisions free of
//! containerd, runc and sockets means every failure policy (docs/pairs.md) is a
//! unit test over plain values, and the shim is a thin adapter that turns
//! [`Action`]s into runc calls.
//!
//! Layout, each module using only those named before it: [`SlotId`]
//! (`slot`), the failure classes (`failure`), the notify and `/proc/locks`
//! parsers (`notify`, `locks`), the restart budget (`policy`), a
//! failover's timeline (`promotion`) and one engine's watchdog clock
//! (`watchdog`); then `vocabulary`, the words the
//! shim and the pair speak ([`Event`], [`Action`], [`Slot`],
//! [`Snapshot`]); then `connections`, who is handed the connections the
//! runtime accepts ([`Connections`]); then `pair`, [`Pair`]'s state and [`Pair::handle`], whose
//! rules are `impl Pair` blocks in child modules, one per job (`spawn`,
//! `election`, `death`, `down`, `hang`, and `queries` for what the shim reads),
//! each using `pair` while `pair` only declares them; last `metrics`,
//! which renders a snapshot. The vocabulary is re-exported through `pair`,
//! as it always was (`shadow_pair::Event` is `pair::Event`).

mod connections;
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
mod vocabulary;
mod watchdog;

pub use connections::{ConnEvent, Connections, Recipient};
pub use failure::{
    classify, classify_death, ColdRestartCause, Exit, FailureClass, Hang, HangCause, Hangs,
    XidClass,
};
pub use locks::{parse_proc_lock_waiters, parse_proc_locks, FileId, FlockHolder};
pub use notify::{parse_notify, Notification, MAX_DATAGRAM};
pub use pair::{
    Action, EngineState, Event, LockHolder, LockWatch, Pair, Slot, SlotId, Snapshot, MAX_SHADOWS,
    MAX_SLOTS,
};
pub use policy::{RestartBudget, RestartPolicy, Verdict};
pub use promotion::{DeathSign, Promotion};
