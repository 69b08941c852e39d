//! The thread the pairs' connections are served on: each pair's keeper
//! (`keeper.rs`: its fd store, and the acceptors and hand-offs of
//! `shadow.dev/accept: runtime`), the fetch servers (`fetch.rs`) and the
//! notify sockets' readers (`observe.rs`, which feed the store) run on a
//! current-thread runtime of their own, not on the shim's.
//!
//! Why: the shim's runtime thread also runs every pair's supervisor, whose
//! work right after a failover (the promotion's `state.json` and metrics
//! writes, 1 to 20 ms on a busy host, the reap, the runc calls of the
//! respawn) came between a new engine's proof that it holds the lock and
//! its first connection. On a thread of its own, a hand-off waits for none
//! of it. One thread for the process, made at the first use: a shim runs
//! once per pod, and its pairs' connection work is small.

use std::future::Future;
use std::sync::OnceLock;

use tokio::runtime::Handle;
use tokio::task::JoinHandle;

use crate::error::{Error, Result};

static OWNER: OnceLock<std::result::Result<Handle, String>> = OnceLock::new();

/// The connection thread's runtime, started at the first call.
pub fn handle() -> Result<Handle> {
    OWNER.get_or_init(start).clone().map_err(|e| {
        Error::io(
            "starting the shim's connection thread",
            std::io::Error::other(e),
        )
    })
}

/// `task` on the connection thread; on the caller's runtime should that
/// thread not start (the error said once, where it is first needed).
pub fn spawn<F>(task: F) -> JoinHandle<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    match handle() {
        Ok(conns) => conns.spawn(task),
        Err(e) => {
            log::warn!("{e}: the task runs on the shim's own thread");
            tokio::spawn(task)
        }
    }
}

fn start() -> std::result::Result<Handle, String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("building its runtime: {e}"))?;
    let handle = rt.handle().clone();
    std::thread::Builder::new()
        .name("shadow-conns".into())
        .spawn(move || {
            // Runs the tasks spawned through `handle` for as long as the
            // process lives.
            rt.block_on(std::future::pending::<()>());
        })
        .map_err(|e| format!("spawning it: {e}"))?;
    Ok(handle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn tasks_run_on_the_connection_thread_while_the_caller_is_busy() {
        let h = handle().expect("connection thread");
        let (tx, rx) = std::sync::mpsc::channel();
        h.spawn(async move {
            let _ = tx.send(std::thread::current().name().map(str::to_owned));
        });
        // The caller's (current-thread) runtime is blocked here: the task
        // still runs, on its own thread.
        let name = rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("the task ran");
        assert_eq!(name.as_deref(), Some("shadow-conns"));
    }
}
