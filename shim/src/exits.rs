//! Exit routing: the one place child exits arrive.
//!
//! containerd-shim's SIGCHLD loop reaps every child with `waitpid(-1)` and
//! publishes (pid, status) through its monitor; a signal death is already
//! reported as 128+signal there. The router subscribes once and hands each
//! exit to whoever `watch`ed that pid: a runc command, a container's init,
//! an exec. A process can exit before its watcher knows its pid (an exec
//! that dies before `runc exec` returns), so an exit nobody claimed is kept
//! for a while and handed over when the watcher arrives.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use containerd_shim::monitor::{monitor_subscribe, ExitEvent, Subject, Topic};
use tokio::sync::oneshot;

use crate::error::Result;

/// Unclaimed exits older than this are dropped (pids are not reused that fast).
const UNCLAIMED_TTL: Duration = Duration::from_secs(60);
const UNCLAIMED_MAX: usize = 4096;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exit {
    pub pid: i32,
    /// Exit code, or 128+signal for a signal death.
    pub status: i32,
    pub at: SystemTime,
}

#[derive(Default)]
struct Routes {
    watchers: HashMap<i32, oneshot::Sender<Exit>>,
    unclaimed: HashMap<i32, (Exit, Instant)>,
}

#[derive(Default)]
pub struct ExitRouter {
    routes: Mutex<Routes>,
}

impl ExitRouter {
    /// Subscribe to the reaper and route its exits until the shim ends.
    pub async fn start() -> Result<Arc<Self>> {
        let router = Arc::new(ExitRouter::default());
        let mut sub = monitor_subscribe(Topic::Pid).await?;
        let r = router.clone();
        tokio::spawn(async move {
            while let Some(ExitEvent { subject, exit_code }) = sub.rx.recv().await {
                if let Subject::Pid(pid) = subject {
                    r.deliver(Exit {
                        pid,
                        status: exit_code,
                        at: SystemTime::now(),
                    });
                }
            }
        });
        Ok(router)
    }

    /// The exit of `pid`, whether it already happened or is still to come.
    pub fn watch(&self, pid: i32) -> oneshot::Receiver<Exit> {
        let (tx, rx) = oneshot::channel();
        let mut routes = self.lock();
        match routes.unclaimed.remove(&pid) {
            Some((exit, _)) => {
                let _ = tx.send(exit);
            }
            None => {
                routes.watchers.insert(pid, tx);
            }
        }
        rx
    }

    pub fn deliver(&self, exit: Exit) {
        let mut routes = self.lock();
        if let Some(tx) = routes.watchers.remove(&exit.pid) {
            let _ = tx.send(exit);
            return;
        }
        let now = Instant::now();
        routes
            .unclaimed
            .retain(|_, (_, t)| now.duration_since(*t) < UNCLAIMED_TTL);
        if routes.unclaimed.len() >= UNCLAIMED_MAX {
            // Orphans nobody waits for (daemonised grandchildren): drop the oldest.
            if let Some(oldest) = routes
                .unclaimed
                .iter()
                .min_by_key(|(_, (_, t))| *t)
                .map(|(p, _)| *p)
            {
                routes.unclaimed.remove(&oldest);
            }
        }
        routes.unclaimed.insert(exit.pid, (exit, now));
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Routes> {
        // A panic while holding this lock cannot leave the maps half-updated
        // in a way that matters more than losing exits, so recover the guard.
        self.routes.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exit(pid: i32, status: i32) -> Exit {
        Exit {
            pid,
            status,
            at: SystemTime::now(),
        }
    }

    #[tokio::test]
    async fn exit_before_watch_is_handed_over() {
        let r = ExitRouter::default();
        r.deliver(exit(10, 3));
        assert_eq!(r.watch(10).await.unwrap().status, 3);
        // Claimed once only.
        let mut again = r.watch(10);
        assert!(again.try_recv().is_err());
    }

    #[tokio::test]
    async fn watch_before_exit_receives_it() {
        let r = ExitRouter::default();
        let rx = r.watch(11);
        r.deliver(exit(12, 0));
        r.deliver(exit(11, 137));
        assert_eq!(rx.await.unwrap().status, 137);
    }

    #[test]
    fn unclaimed_exits_are_bounded() {
        let r = ExitRouter::default();
        for pid in 0..(UNCLAIMED_MAX as i32 + 10) {
            r.deliver(exit(pid, 0));
        }
        assert!(r.lock().unclaimed.len() <= UNCLAIMED_MAX);
    }
}
