//! The pair's observers: small tasks that turn what the machine reports —
//! notify datagrams, reaped exits, XIDs in the kernel log — into
//! supervisor [`Input`]s, each stamped where it was observed (the reaper's
//! time for an exit, the receipt for a datagram), never when the
//! supervisor gets round to it. gmsd's death is watched by `GmsDaemon`.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use shadow_pair::{Exit, SlotId};
use tokio::sync::mpsc::UnboundedSender;

use super::host::Host;
use super::notify::NotifySocket;
use super::supervisor::Input;

/// The pair's monotonic clock: `Duration` since the supervisor started.
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

    /// The pair time of a recent wall-clock stamp (the reaper's), measured
    /// back from now so that an earlier clock step does not shift it.
    pub fn of_wall(&self, at: SystemTime) -> Duration {
        let ago = SystemTime::now().duration_since(at).unwrap_or_default();
        self.now().saturating_sub(ago)
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

/// Forward every datagram of the pair's notify socket, with its receipt time.
pub fn notify(sock: NotifySocket, tx: UnboundedSender<Input>) {
    tokio::spawn(async move {
        loop {
            match sock.recv().await {
                Ok(d) => {
                    if tx.send(Input::Notify(d, Instant::now())).is_err() {
                        return;
                    }
                }
                Err(e) => {
                    log::warn!("notify socket: {e}");
                    return;
                }
            }
        }
    });
}

/// Forward the reap of the engine `pid` of `slot`, with the reaper's time.
pub fn exit(host: &dyn Host, slot: SlotId, pid: u32, tx: UnboundedSender<Input>) {
    let reaped = host.reaped(pid);
    tokio::spawn(async move {
        if let Ok(e) = reaped.await {
            let _ = tx.send(Input::Exited {
                slot,
                pid,
                status: e.status,
                at: e.at,
            });
        }
    });
}

/// Watch the kernel log for XIDs of the pair's GPUs until `stop`.
pub fn xids(id: &str, gpus: &[String], stop: Arc<AtomicBool>, tx: UnboundedSender<Input>) {
    if gpus.is_empty() {
        return;
    }
    let buses = super::xid::gpu_buses(std::path::Path::new("/proc/driver/nvidia/gpus"), gpus);
    log::info!("pair {id}: watching XIDs of GPUs {buses:?}");
    super::xid::watch(buses, stop, move |xid| {
        let _ = tx.send(Input::Xid(xid));
    });
}

#[cfg(test)]
mod tests {
    use super::*;

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
