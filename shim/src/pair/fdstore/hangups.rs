//! The store's hang-up watcher: a stored socket whose peer hung up is
//! dropped (systemd's `FDPOLL`), seen through the store's own epoll so
//! that data arriving for an engine never wakes the shim. It runs on the
//! connection thread (`owner.rs`), with the acceptors and fetch servers.

use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::task::JoinHandle;

use super::{lock, update, Shared};
use crate::error::{Error, Result};
use crate::pair::input::Inputs;
use crate::pair::notify::{close_off_runtime, Close};

/// Drops the stored sockets whose peer hung up, as they do; the closes go
/// to the closer thread. Ends when the store cannot be watched.
pub fn watch_hangups(id: &str, store: Shared, tx: Inputs) -> Result<JoinHandle<()>> {
    // On the connection thread, with the acceptors (`owner.rs`).
    let conns = crate::pair::owner::handle()?;
    let _on_conns = conns.enter();
    let fd = lock(&store)
        .epoll_fd()
        .try_clone_to_owned()
        .map_err(|e| Error::io("copying the fd store's epoll descriptor", e))?;
    // SAFETY: the AsyncFd owns `fd` (an OwnedFd, a copy of the epoll's)
    // and neither closes nor replaces it while registered; it is closed
    // when the AsyncFd drops.
    let fd = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }
        .map_err(|e| Error::io("watching the fd store's epoll", e.into()))?;
    let id = id.to_owned();
    Ok(conns.spawn(async move {
        loop {
            let Ok(mut ready) = fd.readable().await else {
                log::warn!("pair {id}: fd store: hang-ups are no longer watched");
                return;
            };
            let gone = update(&store, &tx, |st| {
                let gone = st.hung_up();
                let moved = !gone.is_empty();
                (gone, moved)
            });
            ready.clear_ready();
            if !gone.is_empty() {
                log::debug!("pair {id}: fd store: {} hung up", gone.len());
                close_off_runtime(gone, Close::Release).await;
            }
        }
    }))
}
