//! The memory behind layouts, and how it changes hands. A daemon holds at
//! most two [`Store`]s: the writer's working one (from `hello` granting
//! `rw` until commit or the writer's end) and the committed one that
//! readers import. The transitions live here, each under the daemon's lock:
//!
//! - `begin_working`: a writer's lease starts an empty working store;
//! - `commit`: every allocation sealed, the working store becomes the
//!   committed one, replacing any previous committed layout, and the
//!   writer's lease becomes a reader's;
//! - `reset`: the supervisor drops the committed layout (no lease attached);
//! - `discard_working`: a writer that ended before commit loses its work.
//!
//! Kept apart from request handling so that what may happen to committed
//! weights (docs/security.md: "Committed weights are never replaced by an
//! engine") is read in one place.

use gms::{Error, Result};

use super::{State, Store};
use crate::lease::LeaseId;

/// What a commit made.
pub(super) struct Committed {
    pub(super) generation: u64,
    pub(super) allocations: usize,
    pub(super) bytes: u64,
}

impl State {
    /// A writer's lease was granted: it loads into a fresh working store.
    pub(super) fn begin_working(&mut self) {
        self.working = Some(Store::default());
    }

    /// Freezes the writer's working store into the committed layout. Every
    /// allocation must have its memory (each `allocate` answered) and be
    /// sealed; the previous committed layout, if any, is replaced: `rw` was
    /// exclusive, so no reader can be using it through this daemon.
    pub(super) fn commit(&mut self, lease: LeaseId) -> Result<Committed> {
        let store = self.working.as_mut().ok_or_else(nothing_to_commit)?;
        if let Some(a) = store
            .layout
            .allocations
            .iter()
            .find(|a| !store.memory.contains_key(&a.id))
        {
            return Err(Error::Backend(format!(
                "allocation {} has no memory yet; commit after every allocate answered",
                a.id
            )));
        }
        for (id, memory) in store.memory.iter_mut() {
            memory.seal().map_err(|e| match e {
                Error::NotPermitted { op, why } => Error::NotPermitted {
                    op,
                    why: format!("allocation {id}: {why}"),
                },
                other => other,
            })?;
        }
        self.generation += 1;
        let mut store = self.working.take().ok_or_else(nothing_to_commit)?;
        store.layout.generation = self.generation;
        let (allocations, bytes) = (store.layout.allocations.len(), store.layout.bytes());
        // Replaces any previous committed layout: rw was exclusive, so no
        // reader can be using it through this daemon.
        self.committed = Some(store);
        self.leases.commit(lease)?;
        tracing::info!(
            lease,
            generation = self.generation,
            allocations,
            bytes,
            "layout committed"
        );
        Ok(Committed {
            generation: self.generation,
            allocations,
            bytes,
        })
    }

    /// Forgets the committed layout so that the next engine loads again;
    /// refused while any lease is attached. Returns the generation dropped
    /// (0: there was none).
    pub(super) fn reset(&mut self) -> Result<u64> {
        self.leases.reset()?;
        let dropped = self.committed.take();
        Ok(dropped.as_ref().map_or(0, |s| s.layout.generation))
    }

    /// Drops the working store of a writer that ended before commit;
    /// returns how many allocations and bytes went with it.
    pub(super) fn discard_working(&mut self) -> (usize, u64) {
        let discarded = self.working.take();
        discarded
            .as_ref()
            .map_or((0, 0), |s| (s.layout.allocations.len(), s.layout.bytes()))
    }
}

/// What `commit` answers without a working store (its wording is the one
/// every request that finds no layout gets).
fn nothing_to_commit() -> Error {
    Error::NoLayout("nothing to read for 'commit'".into())
}
