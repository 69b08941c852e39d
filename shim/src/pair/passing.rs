//! What a new engine is passed from the connection side: the hand-off
//! ends of `shadow.dev/accept: runtime` and the fd store's copies. They
//! are made by their owner, the pair's keeper (`keeper.rs`), and given to
//! the machine's start ([`Host::spawn`]), so the runc seam runs engines
//! without knowing the store or the hand-offs.
//!
//! [`Host::spawn`]: super::host::Host::spawn

use std::sync::Arc;

use async_trait::async_trait;
use shadow_pair::SlotId;

use super::host::{Passed, Passing};
use super::keeper::Keeper;
use crate::error::Result;

/// The pair's keeper, as the starts of its engines see it (none: the pair
/// has no fd store).
pub struct StartFds {
    pub keeper: Option<Arc<Keeper>>,
}

#[async_trait]
impl Passing for StartFds {
    async fn for_start(&self, slot: SlotId, with_store: bool) -> Result<Passed> {
        let Some(k) = &self.keeper else {
            return Ok(Passed::default());
        };
        // Fresh hand-off sockets: the new engine is another recipient,
        // handed nothing until it proves it holds the lock.
        let ends = k.ends_for(slot)?;
        let stored = if with_store {
            k.copies().await
        } else {
            Vec::new()
        };
        Ok(Passed { ends, stored })
    }
}
