//! What the pair's supervisor is told, by whom it is told: the observers
//! (`observe.rs`: reaped exits, notify datagrams, lock closes, XIDs), the
//! gmsd watchers (`gms.rs`) and the timers; the Task service speaks in
//! `command.rs`. Its own module, below all of them, so that those who
//! send and the one who receives do not import each other.

use tokio::sync::mpsc;
use tokio::time::Instant;

use shadow_pair::SlotId;

use super::notify::{Datagram, SenderSlot, QUEUE_MAX};

/// Where the supervisor is told: a channel of [`QUEUE_MAX`] inputs. The
/// notify reader drops a datagram that finds it full (an engine can send
/// as fast as it likes); every other observer waits for room.
pub type Inputs = mpsc::Sender<Input>;

/// The supervisor's input channel.
pub fn channel() -> (Inputs, mpsc::Receiver<Input>) {
    mpsc::channel(QUEUE_MAX)
}

/// What the supervisor is told.
#[derive(Debug)]
pub enum Input {
    Spawned {
        slot: SlotId,
        generation: u32,
        result: std::result::Result<u32, String>,
    },
    /// A reaped engine; `at` is the reaper's time.
    Exited {
        slot: SlotId,
        pid: u32,
        status: i32,
        at: Instant,
    },
    /// A datagram the notify gate admitted, received at `at`, from a
    /// sender it found in `slot`.
    Notify {
        datagram: Datagram,
        at: Instant,
        slot: SenderSlot,
    },
    /// The notify socket dropped a datagram, the first since its counts
    /// were last written (the metrics file is due an update).
    NotifyDropped,
    /// The fd store's figures moved, the first time since they were last
    /// written (stored, handed, fetched, hung up …: the metrics file is
    /// due an update, at most once a `publish::COUNTERS_EVERY`).
    StoreMoved,
    /// Slot `slot`'s notify reader stopped reading a flood for a while
    /// (`stalled`), or reads again.
    NotifyStalled {
        slot: SlotId,
        stalled: bool,
    },
    /// The lock file was closed for good (inotify), at this time.
    LockClosed(Instant),
    Backoff {
        slot: SlotId,
    },
    /// The stop grace of a Kill is over: SIGKILL.
    Escalate,
    /// The GMS daemon at `index` of the pair's daemons died.
    GmsDied {
        index: usize,
        generation: u64,
    },
    /// A cold restart's backoff is over.
    ColdRestartDue,
    /// An XID on one of the pair's GPUs (kernel log).
    Xid(u32),
    /// A probe of the engine of `slot` (its generation `generation`) ended.
    Probed {
        slot: SlotId,
        generation: u32,
        outcome: super::probe::Outcome,
    },
}
