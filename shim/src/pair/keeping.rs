//! What the pair's parts ask of its keeper (`keeper.rs`, the owner of
//! the fd store and the connections): a trait of its own, so that the
//! supervisor's race tests stand a fake in for the keeper, and so that the
//! fetch servers the keeper starts name it without naming the keeper.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use async_trait::async_trait;
use shadow_pair::{Recipient, SlotId};
use tokio::time::Instant;

use super::fdstore::Stored;
use super::host::Host;
use super::input::Inputs;
use super::notify::NotifySocket;

/// Descriptors with their names, in the order stored.
pub type Copies = Vec<(String, OwnedFd)>;

/// What the keeper's fetch servers need besides the keeper: who a
/// fetcher is, and the notify sockets read up to a fetch before it is
/// answered (every slot's).
pub struct Fetching {
    pub host: Arc<dyn Host>,
    pub notify: Vec<Arc<NotifySocket>>,
}

/// What the supervisor, the notify readers and the fetch servers ask of
/// the keeper: a trait, so that the supervisor's race tests stand a fake
/// in for [`Keeper`].
#[async_trait]
pub trait Keeping: Send + Sync {
    /// The pair started: each slot's fetch socket is served and the
    /// runtime accepts (when it does) from now on; `tx` hears when the
    /// store's figures moved. Once.
    fn start(self: Arc<Self>, tx: &Inputs, fetching: Fetching);
    /// Whether the runtime accepts (`shadow.dev/accept: runtime`).
    fn hands(&self) -> bool;
    /// `FDSTORE=1` with `fds`: what was kept, and what was not (to close).
    async fn store(&self, text: Vec<u8>, fds: Vec<OwnedFd>) -> Stored;
    /// `FDSTOREREMOVE=1`: what it took out of the store, to close.
    async fn remove(&self, text: Vec<u8>) -> Vec<OwnedFd>;
    /// A fetch's copies for `who` (see `FdStore::copies_for`); `None`: a
    /// copy of everything.
    async fn copies_for(&self, who: Option<Recipient>) -> Copies;
    /// A fetch was answered with `n` descriptors.
    fn fetched(&self, n: usize);
    /// A fetch was refused.
    fn fetch_refused(&self);
    /// `slot`'s engine (the one running now) was answered its fetch:
    /// that engine, once the keeper has taken it in (none when the
    /// runtime does not accept).
    async fn fetch_answered(&self, slot: SlotId) -> Option<Recipient>;
    /// `slot`'s engine (the one running now) said `READY=1` from a
    /// process seen holding the lock.
    /// `read_at`: when its reader read it, for the log of the move.
    fn ready_from_holder(&self, slot: SlotId, read_at: Instant);
    /// The slot handed connections now, if any (as last decided).
    fn serving(&self) -> Option<SlotId>;
    /// The supervisor's active engine now (told after each of its steps).
    fn active_is(&self, now: Option<SlotId>);
    /// The engine now in `slot` died (its reap).
    fn died(&self, slot: SlotId);
    /// `slot`'s engine was seen not holding the lock.
    fn lock_lost(&self, slot: SlotId);
    /// The pair ended: no more accepts or fetches, every hand-off socket
    /// closed, the store let go.
    fn stop(&self);
}
