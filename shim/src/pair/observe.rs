//! The pair's observers: small tasks that turn what the machine reports —
//! notify datagrams, reaped exits, closes of the lock file, XIDs in the
//! kernel log — into
//! supervisor [`Input`]s, each stamped where it was observed (the reaper's
//! time for an exit, the receipt for a datagram), never when the
//! supervisor gets round to it. gmsd's death is watched by `GmsDaemon`.

use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
use shadow_pair::{Exit, SlotId};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::sync::mpsc::error::TrySendError;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::host::Host;
use super::input::{Input, Inputs};
use super::keeping::Keeping;
use super::notify::{
    close_off_runtime, discard, Close, DropCounts, Dropped, Gate, NotifySocket, Queue, Received,
};
use super::owner;

/// Whether `pid` is gone (no such process, not even a zombie).
fn gone(pid: u32) -> bool {
    let Ok(pid) = i32::try_from(pid) else {
        return false;
    };
    pid > 0
        && nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None)
            == Err(nix::errno::Errno::ESRCH)
}

/// The pair's monotonic clock: `Duration` since the supervisor started,
/// on tokio's clock (paused in tests).
pub struct Clock {
    start: Instant,
}

impl Clock {
    pub fn start() -> Clock {
        Clock {
            start: Instant::now(),
        }
    }

    pub fn now(&self) -> Duration {
        self.start.elapsed()
    }

    pub fn since(&self, at: Instant) -> Duration {
        at.saturating_duration_since(self.start)
    }
}

pub fn exit_of(status: i32) -> Exit {
    // The reaper reports 128+signal for a signal death, as a shell does.
    if status > 128 && status < 128 + 65 {
        Exit::Signal(status - 128)
    } else {
        Exit::Code(status)
    }
}

/// Forward the datagrams of slot `slot`'s notify socket (from that
/// slot's engine only) that its [`Gate`] admits, with their receipt time; count and drop the rest (the first
/// drop since the supervisor published the counts is told to it, the
/// others only counted). Never blocks on the supervisor: a full queue
/// drops, it does not wait.
/// With an fd store, its datagrams (`FDSTORE=1` with fds,
/// `FDSTOREREMOVE=1`) go to the store's keeper here, on the engine's own
/// budget, and never to the supervisor; each in the same step as its read
/// (no await between the two), so that a fetch that finds the socket read
/// up finds the keeper told. With the runtime accepting, a `READY=1` from
/// the lock holder is told to the keeper here too ([`prove_ready`]).
///
/// Runs on the connection thread (`owner.rs`), beside the fetch servers
/// that wait for it to be read up: a fetch right after a death then waits
/// for nothing the supervisor's thread is doing, and each datagram is
/// stamped when it arrives, not when that thread is free.
#[allow(clippy::too_many_arguments)]
pub fn notify(
    id: &str,
    slot: SlotId,
    sock: Arc<NotifySocket>,
    host: Arc<dyn Host>,
    queue: Arc<Queue>,
    drops: Arc<DropCounts>,
    keeper: Option<Arc<dyn Keeping>>,
    tx: Inputs,
) -> JoinHandle<()> {
    let mut gate = Gate::new(id, queue, drops, Instant::now());
    let id = id.to_owned();
    owner::spawn(async move {
        loop {
            let got = match sock.recv().await {
                Ok(got) => got,
                Err(e) => {
                    log::warn!("pair {id}: notify socket: {e}");
                    return;
                }
            };
            let at = Instant::now();
            let slot_of = |pid| host.slot_of_pid(pid).filter(|s| *s == slot);
            // What an engine stored just before it died is read after its
            // death, when its pid names no cgroup any more: a sender that is
            // gone (reaped) counts for the slot whose socket it used, which
            // only that slot's engine can reach. A live pid elsewhere still
            // counts for nobody.
            let store_slot_of = |pid| slot_of(pid).or_else(|| gone(pid).then_some(slot));
            let weight = match &got {
                Received::Store(_, fds) => fds.len() as u64,
                _ => 1,
            };
            let verdict = match got {
                Received::Store(d, fds) => match &keeper {
                    Some(keeper) => match gate.admit_store(d.pid, at, store_slot_of) {
                        Ok(_) => {
                            let out = keeper.store(d.bytes, fds).await;
                            if let Some(why) = out.why {
                                log::debug!(
                                    "pair {id}: fd store kept {} of the descriptors slot {slot} sent, not the others: {why:?}",
                                    out.kept
                                );
                            }
                            let none_kept = out.kept == 0;
                            discard(out.refused).await;
                            // A datagram that stored nothing counts as a
                            // drop: a flood of them pauses the reader.
                            if none_kept {
                                Err(Dropped::StoreRefused)
                            } else {
                                Ok(())
                            }
                        }
                        Err(why) => {
                            discard(fds).await;
                            Err(why)
                        }
                    },
                    None => {
                        discard(fds).await;
                        Err(Dropped::Fds)
                    }
                },
                Received::Datagram(d) if keeper.is_some() && d.lines.remove => {
                    match gate.admit_store(d.pid, at, store_slot_of) {
                        Ok(_) => {
                            let gone = match &keeper {
                                Some(k) => k.remove(d.bytes).await,
                                None => Vec::new(),
                            };
                            close_off_runtime(gone, Close::Release).await;
                            Ok(())
                        }
                        Err(why) => Err(why),
                    }
                }
                Received::Datagram(d) => {
                    let mut gone = false;
                    let forward = |slot| {
                        let input = Input::Notify {
                            datagram: d.clone(),
                            at,
                            slot,
                        };
                        match tx.try_send(input) {
                            Ok(()) => true,
                            Err(TrySendError::Full(_)) => false,
                            Err(TrySendError::Closed(_)) => {
                                gone = true;
                                false
                            }
                        }
                    };
                    // Only the engine of `slot` can reach this socket (it is
                    // bound in that engine alone): a sender found anywhere
                    // else is nobody's.
                    let verdict = gate.admit(&d, at, slot_of, forward);
                    if gone {
                        return;
                    }
                    if verdict.is_ok() && d.lines.ready {
                        if let Some(k) = keeper.as_ref().filter(|k| k.hands()) {
                            prove_ready(k.as_ref(), host.as_ref(), slot, d.pid, at);
                        }
                    }
                    verdict
                }
                Received::Dropped(why) => Err(why),
            };
            if let Err(why) = verdict {
                let after = gate.dropped_weighing(why, at, weight);
                // Only a nudge: a full queue has the supervisor busy anyway.
                if after.tell
                    && matches!(
                        tx.try_send(Input::NotifyDropped),
                        Err(TrySendError::Closed(_))
                    )
                {
                    return;
                }
                if let Some(pause) = after.pause {
                    // This engine's pings wait unread meanwhile: its
                    // watchdog is not judged until the reader reads again.
                    let stalled = |stalled| Input::NotifyStalled { slot, stalled };
                    if tx.send(stalled(true)).await.is_err() {
                        return;
                    }
                    tokio::time::sleep(pause).await;
                    if tx.send(stalled(false)).await.is_err() {
                        return;
                    }
                }
            }
            // A flood keeps the socket readable: yield to the fetches, the
            // keeper and the other readers as any other task does (after
            // the datagram was dealt with, never between its read and its
            // word to the keeper).
            tokio::task::consume_budget().await;
        }
    })
}

/// A `READY=1` of `slot`'s engine, sent by `pid` and let through by the
/// gate: with the runtime accepting, its engine is handed connections at
/// once if `pid` (or a child of it) holds the lock through a descriptor of
/// its own. That is the first proof a promoted engine gives, before its
/// fetch and before the supervisor's thread is free to believe it.
/// Looked at only while the slot is not served already (as the keeper
/// last decided), so a flood of `READY=1` costs no more than the
/// gate lets through. A respawn of the serving slot whose `READY=1`
/// comes before the keeper has taken in the death is proven by its fetch
/// instead, a millisecond or two later.
pub(super) fn prove_ready(h: &dyn Keeping, host: &dyn Host, slot: SlotId, pid: u32, at: Instant) {
    if h.serving() == Some(slot) {
        return;
    }
    if host.slot_of_pid(pid) == Some(slot) && host.lock_held_by(pid) == Some(true) {
        h.ready_from_holder(slot, at);
    }
}

/// Forward every final close of the lock file (inotify `IN_CLOSE_*`),
/// with its receipt time. The kernel sends it from the close that releases
/// the closing file's flock, so a dying active is seen letting go of the
/// lock at once, well before its reap (an exiting container init is
/// reported only after its namespace is torn down), and without polling.
pub fn lock_closes(path: &Path, tx: Inputs) -> std::io::Result<JoinHandle<()>> {
    let inotify = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC)?;
    inotify.add_watch(
        path,
        AddWatchFlags::IN_CLOSE_WRITE | AddWatchFlags::IN_CLOSE_NOWRITE,
    )?;
    // SAFETY: `Watch` owns the inotify fd, returns that same fd from
    // `as_raw_fd`, and neither closes nor replaces it while the AsyncFd
    // holds it (it is closed when the AsyncFd, and the Watch in it, drop).
    let fd = unsafe { AsyncFd::register_with_interest(Watch(inotify), Interest::READABLE)? };
    Ok(tokio::spawn(async move {
        loop {
            let Ok(mut ready) = fd.readable().await else {
                return;
            };
            let at = Instant::now();
            match ready.try_io(|w| w.get_ref().0.read_events().map_err(std::io::Error::from)) {
                Ok(Ok(events)) if !events.is_empty() => {
                    if tx.send(Input::LockClosed(at)).await.is_err() {
                        return;
                    }
                }
                Ok(Ok(_)) | Err(_) => {}
                Ok(Err(e)) => {
                    log::warn!("inotify of the lock file: {e}");
                    return;
                }
            }
        }
    }))
}

/// An inotify instance as tokio polls it.
struct Watch(Inotify);

impl AsRawFd for Watch {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_fd().as_raw_fd()
    }
}

/// Forward the reap of the engine `pid` of `slot`, with the reaper's time.
pub fn exit(host: &dyn Host, slot: SlotId, pid: u32, tx: Inputs) {
    let reaped = host.reaped(pid);
    tokio::spawn(async move {
        if let Some(e) = reaped.await {
            let _ = tx
                .send(Input::Exited {
                    slot,
                    pid,
                    status: e.status,
                    at: e.at,
                })
                .await;
        }
    });
}

/// Watch the kernel log for XIDs of the pair's GPUs (by PCI bus) until `stop`.
pub fn xids(id: &str, buses: &[String], stop: Arc<AtomicBool>, tx: Inputs) {
    if buses.is_empty() {
        return;
    }
    let buses = buses.to_vec();
    log::info!("pair {id}: watching XIDs of GPUs {buses:?}");
    super::xid::watch(buses, stop, move |xid| {
        // The watcher is a thread of its own: it may wait for room.
        let _ = tx.blocking_send(Input::Xid(xid));
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_final_close_of_the_lock_file_is_reported() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("engine.lock");
        std::fs::write(&path, b"").unwrap();
        let (tx, mut rx) = crate::pair::input::channel();
        lock_closes(&path, tx).unwrap();
        let before = Instant::now();
        let held = std::fs::File::open(&path).unwrap();
        let twin = held.try_clone().unwrap();
        drop(held);
        // A duplicate still open: the file is not released, nothing said.
        let quiet = tokio::time::timeout(Duration::from_millis(50), rx.recv()).await;
        assert!(quiet.is_err(), "{quiet:?}");
        drop(twin);
        let got = tokio::time::timeout(Duration::from_secs(5), rx.recv())
            .await
            .unwrap();
        assert!(matches!(got, Some(Input::LockClosed(at)) if at >= before));
    }

    #[test]
    fn reaper_statuses_become_exits() {
        assert_eq!(exit_of(0), Exit::Code(0));
        assert_eq!(exit_of(3), Exit::Code(3));
        assert_eq!(exit_of(137), Exit::Signal(9));
        assert_eq!(exit_of(143), Exit::Signal(15));
        assert_eq!(exit_of(128), Exit::Code(128));
        assert_eq!(exit_of(255), Exit::Code(255));
    }
}
