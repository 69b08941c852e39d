//! What a new engine is passed from the connection side: the hand-off
//! ends of `shadow.dev/accept: runtime` and the fd store's copies. They
//! are made here, by what owns them (the store, the hand-offs), and given
//! to the machine's start ([`Host::spawn`]), so the runc seam runs
//! engines without knowing the store or the hand-offs.
//!
//! [`Host::spawn`]: super::host::Host::spawn

use std::sync::Arc;

use shadow_pair::SlotId;

use super::fdstore::{self, Shared};
use super::handoff::Handoff;
use super::host::{Passed, Passing};
use crate::error::Result;

/// The pair's store and hand-offs, as the starts of its engines see them.
pub struct StartFds {
    pub store: Option<Shared>,
    pub handoff: Option<Arc<Handoff>>,
}

impl Passing for StartFds {
    fn for_start(&self, slot: SlotId, with_store: bool) -> Result<Passed> {
        // Fresh hand-off sockets: the new engine is another recipient,
        // handed nothing until it proves it holds the lock.
        let ends = match &self.handoff {
            Some(h) => h.ends_for(slot)?,
            None => Vec::new(),
        };
        let stored = match (&self.store, with_store) {
            (Some(store), true) => fdstore::lock(store).copies(),
            _ => Vec::new(),
        };
        Ok(Passed { ends, stored })
    }
}
