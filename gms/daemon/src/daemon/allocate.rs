//! `allocate`, the one request whose work happens mostly outside the
//! daemon's lock: limits are checked and the address range recorded under
//! it, then the memory is created and populated (seconds for large sizes)
//! without it, so that status and other peers are answered meanwhile; the
//! lock is taken again to hand the memory to the working store, unless the
//! lease ended in between.
//!
//! Recorded allocations count against the limits whether or not their
//! memory exists yet, so two allocations can never together pass them.

use std::os::fd::OwnedFd;

use gms::layout::Allocation;
use gms::protocol::Response;
use gms::{Access, Error, Result};

use super::Daemon;
use crate::backend::Memory;

/// The reply to `allocate`: the answer and the one descriptor it carries.
type Allocated = (Response, Vec<OwnedFd>);

impl Daemon {
    /// `allocate`: limits checked and the address range recorded under the
    /// lock; the memory created and populated (which may take seconds for
    /// large sizes) without it, so status and other peers are not held.
    pub(super) fn allocate(
        &self,
        conn_id: u64,
        tag: String,
        size: u64,
        va: u64,
    ) -> Result<Allocated> {
        let (id, size) = self.record(conn_id, &tag, size, va)?;
        let made = self
            .backend
            .allocate(size, &tag)
            .and_then(|memory| memory.export(Access::ReadWrite).map(|fd| (memory, fd)));
        self.hand_over(conn_id, id, size, made)
    }

    /// Under the lock: the size rounded up to the granularity, the address
    /// and the limits checked, and the allocation recorded in the working
    /// layout (its range is taken from now on). Returns its id and size.
    fn record(&self, conn_id: u64, tag: &str, size: u64, va: u64) -> Result<(u64, u64)> {
        let gran = self.backend.granularity();
        let mut guard = self.lock();
        let st = &mut *guard;
        self.writer_lease(st, conn_id, "allocate")?;
        let size = size
            .checked_next_multiple_of(gran)
            .ok_or_else(|| Error::Invalid(format!("size {size} overflows")))?;
        if va % gran != 0 {
            return Err(Error::Invalid(format!(
                "address {va:#x} is not a multiple of the granularity {gran}"
            )));
        }
        let limits = &self.config.limits;
        let stores = || [&st.working, &st.committed].into_iter().flatten();
        let allocations: usize = stores().map(|s| s.layout.allocations.len()).sum();
        if allocations >= limits.max_allocations {
            return Err(Error::LimitExceeded(format!(
                "{allocations} allocations exist, limit is {}",
                limits.max_allocations
            )));
        }
        // The KV pool counts too: its memory is the daemon's as much.
        let used: u64 = stores().map(|s| s.layout.bytes()).sum::<u64>() + st.kv_bytes().0;
        if used.saturating_add(size) > limits.max_bytes {
            return Err(Error::LimitExceeded(format!(
                "{size} more bytes on top of {used} exceeds the limit of {} bytes",
                limits.max_bytes
            )));
        }
        let id = st.next_alloc + 1;
        let store = st.working.as_mut().ok_or_else(no_working)?;
        store.layout.insert(Allocation {
            id,
            tag: tag.to_owned(),
            size,
            va,
        })?;
        st.next_alloc = id;
        Ok((id, size))
    }

    /// Under the lock again: the memory made for allocation `id` joins the
    /// working store, or, if making it failed, the recorded range is given
    /// back. A lease that ended meanwhile gets nothing.
    fn hand_over(
        &self,
        conn_id: u64,
        id: u64,
        size: u64,
        made: Result<(Box<dyn Memory>, OwnedFd)>,
    ) -> Result<Allocated> {
        let mut st = self.lock();
        // Only this connection's thread changes its working store, but a
        // stopping daemon may have dropped it meanwhile.
        let still_ours =
            self.writer_lease(&st, conn_id, "allocate").is_ok() && st.working.is_some();
        let store = st.working.as_mut().filter(|_| still_ours);
        match (made, store) {
            (Ok((memory, fd)), Some(store)) => {
                store.memory.insert(id, memory);
                Ok((Response::Allocated { id, size }, vec![fd]))
            }
            (Ok(_), None) => Err(Error::NotPermitted {
                op: "allocate".into(),
                why: "the lease ended while the memory was being made".into(),
            }),
            (Err(e), store) => {
                if let Some(store) = store {
                    let _ = store.layout.remove(id);
                }
                Err(e)
            }
        }
    }
}

fn no_working() -> Error {
    Error::NoLayout("no working layout: the rw lease has none".into())
}
