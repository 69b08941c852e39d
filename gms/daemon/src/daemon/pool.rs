//! The pair's KV pool as the daemon holds it: its memory, its index, who
//! writes it and the fence of the last grant. Only the state lives here,
//! under the daemon's lock; what a grant, a status or a reset does with it
//! is `kv`'s. Kept apart so that the daemon's state can hold a pool
//! without the shared file using the module that works on it.

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::backend::Memory;

/// The pool and who writes it.
pub(super) struct Pool {
    pub(super) id: u64,
    pub(super) size: u64,
    pub(super) va: u64,
    pub(super) index_bytes: u64,
    /// Bytes per allocation: the pool is allocations of `chunk` bytes, the
    /// last one shorter, so that an engine maps the first one first and
    /// the rest while it serves (a pool that fills a GPU takes tens of
    /// milliseconds to map whole on a failover's path).
    pub(super) chunk: u64,
    /// The allocations exported once, read-write, when the pool was made:
    /// each grant sends duplicates. A grant comes on a failover's path,
    /// while the driver tears the dead engine's context down, and an export
    /// is a driver call; a `dup` is not. Closed before the memory goes.
    pub(super) exported: Vec<OwnedFd>,
    pub(super) memory: Vec<Box<dyn Memory>>,
    pub(super) index: OwnedFd,
    pub(super) grants: u64,
    pub(super) writer: Option<Writer>,
    /// Writers before the current one that were not gone at its grant.
    pub(super) earlier: Vec<Arc<OwnedFd>>,
    /// Set to end the fence thread of the current grant (a newer grant, a
    /// reset, the daemon's end).
    pub(super) fence_stop: Option<Arc<AtomicBool>>,
}

/// The engine that holds, or last held, the write lease.
pub(super) struct Writer {
    pub(super) conn: u64,
    pub(super) pid: i32,
    pub(super) pidfd: Arc<OwnedFd>,
}

impl Drop for Pool {
    fn drop(&mut self) {
        if let Some(stop) = &self.fence_stop {
            stop.store(true, Ordering::Relaxed);
        }
    }
}
