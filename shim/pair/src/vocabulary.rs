//! The words the shim and the pair speak: what the shim observed
//! ([`Event`], and who held the lock when it looked, [`LockHolder`]), what
//! it must do ([`Action`], and how closely to watch `/proc/locks`,
//! [`LockWatch`]), and what it may show of the pair ([`Slot`],
//! [`Snapshot`]). It exists so that these types sit below every rule of
//! the pair: the rules (`pair` and its modules) use them, they use no rule.
//!
//! What may be touched here: a new kind of event or action, a field the
//! shim must see, their docs. No decision belongs here: the one fact every
//! rule asks of a slot, [`Slot::alive`], is all the logic there is, and a
//! new rule goes to its module below `pair`.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;

use crate::failure::{ColdRestartCause, Exit, HangCause, Hangs};
use crate::notify::Notification;
use crate::promotion::Promotion;
use crate::slot::SlotId;

pub use shadow_contract::state::EngineState;

/// One slot of the pair.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Slot {
    pub id: SlotId,
    pub state: EngineState,
    /// `None` while spawning, and for an engine that spoke before its spawn
    /// was reported.
    pub pid: Option<u32>,
    /// Incremented at each spawn of this slot.
    pub generation: u32,
    /// The engine sent at least one sd_notify message: it will send READY=1.
    pub speaks_notify: bool,
    pub last_exit: Option<Exit>,
    /// The pair ended this slot's last engine as hung, and why (beside
    /// `last_exit`, which it explains; `None` for any other death).
    pub last_hang: Option<HangCause>,
    /// Its engine armed its watchdog (pinged under a configured watchdog):
    /// it is watched from then on. Filled in by [`Pair::snapshot`](crate::Pair::snapshot)
    /// (the pair keeps the clock itself, off the slots: a ping of an armed
    /// watchdog is no change); false in the pair's own slots.
    pub watchdog_armed: bool,
}

impl Slot {
    pub(crate) fn new(id: SlotId) -> Slot {
        Slot {
            id,
            state: EngineState::Stopped,
            pid: None,
            generation: 0,
            speaks_notify: false,
            last_exit: None,
            last_hang: None,
            watchdog_armed: false,
        }
    }

    /// Running: an exit is still to come.
    pub(crate) fn alive(&self) -> bool {
        matches!(
            self.state,
            EngineState::Starting
                | EngineState::Parked
                | EngineState::Active
                | EngineState::Superseded
        )
    }
}

/// Who `/proc/locks` showed holding the election lock when the shim looked
/// (see [`Event::Ready`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LockHolder {
    /// A process of the engine of this slot (one in its cgroup).
    Slot(SlotId),
    /// Nobody.
    Free,
    /// A process of no engine, an unreadable `/proc/locks`, or the shim
    /// did not look.
    Unknown,
}

/// What the shim observed.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// The engine of `slot` is running with this pid.
    Spawned { slot: SlotId, pid: u32 },
    /// Starting the engine failed before it ran (runc create/start error).
    SpawnFailed { slot: SlotId },
    /// The engine of `slot` sent these on the notify socket. A
    /// `READY=1` here is [`Event::Ready`] with [`LockHolder::Unknown`].
    Notified {
        slot: SlotId,
        notification: Notification,
    },
    /// The engine of `slot` sent `READY=1`, and the election lock's holder
    /// was `holder` when the shim looked, after the datagram arrived (an
    /// engine takes the lock before it says `READY=1`). Engines are
    /// untrusted: a `READY=1` that would make a new engine active
    /// ([`Pair::ready_needs_proof`](crate::Pair::ready_needs_proof)) is believed only from the holder, so a
    /// shadow that lies does not displace the engine that serves. It is
    /// refused and counted ([`Pair::ready_refused`](crate::Pair::ready_refused)) instead.
    Ready { slot: SlotId, holder: LockHolder },
    /// `/proc/locks` shows the engine of `slot` holding the election lock.
    LockHeld { slot: SlotId },
    /// `/proc/locks` shows nobody holding the election lock.
    LockFree,
    /// `/proc/locks` shows the engine of `slot` waiting for the election
    /// lock: it is initialised and parked, whether or not it says so.
    LockWaiting { slot: SlotId },
    /// The kernel reported the lock file closed for good (inotify), and
    /// the active engine's pid was not then seen holding the lock: an
    /// engine let go of it (dying or on purpose), which releases its flock.
    /// Whose it was is learnt from what follows.
    LockClosed,
    /// The reaper collected the engine of `slot` (`now`: the reaper's time).
    Exited { slot: SlotId, exit: Exit },
    /// The GMS daemon of `device` (a GPU UUID, or `host`) died.
    GmsDied { device: String },
    /// A GMS daemon could not be started again after `RestartGms`: the
    /// cold restart failed early, like an engine that died starting.
    GmsStartFailed,
    /// A `RestartGmsAfter` delay has elapsed.
    ColdRestartDue,
    /// An XID was reported for one of the pair's GPUs.
    Xid(u32),
    /// The OOM killer killed a process of the engine of `slot` (its
    /// cgroup's `oom_kill` count), seen at its reap and sent just before
    /// its `Exited`: the death is then of class `OutOfMemory`.
    OomKilled { slot: SlotId },
    /// A `SpawnAfter` delay for `slot` has elapsed.
    BackoffElapsed { slot: SlotId },
    /// containerd asked the task to stop (Kill): no more respawns.
    Stop,
    /// Time to look for hung engines (the shim sends it at
    /// [`Pair::hang_deadline`](crate::Pair::hang_deadline)): every armed
    /// engine not pinged within its interval before `now`, and every engine
    /// still starting past its start timeout, is ended.
    HangCheck,
    /// The shim's probe of the engine of `slot` (generation `generation`,
    /// the one that served when the probe began) ended: `healthy` or not.
    /// Only the serving engine's results count; enough failures in a row
    /// end it.
    Probed {
        slot: SlotId,
        generation: u32,
        healthy: bool,
    },
    /// The shim sent SIGKILL to every process of the engine of `slot`
    /// (after [`Action::Kill`]): the hang's timeline records when.
    Killed { slot: SlotId },
    /// The pair's cgroup was frozen (Pause): no hang is judged until
    /// [`Event::Resumed`].
    Paused,
    /// The pair's cgroup was thawed (Resume): watchdogs and start clocks
    /// go on from now, as if the pause had not been.
    Resumed,
    /// The reader of slot `slot`'s notify socket stopped reading for a
    /// while (a flood on that socket): that engine's pings wait unread, so
    /// its watchdog and start clock are not judged until
    /// [`Event::NotifyResumed`], and that time is taken out of them.
    NotifyStalled { slot: SlotId },
    /// The reader of slot `slot`'s notify socket reads again.
    NotifyResumed { slot: SlotId },
}

/// What the shim must do.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "action")]
pub enum Action {
    /// Start the engine of `slot` now.
    Spawn { slot: SlotId },
    /// Deliver `Event::BackoffElapsed { slot }` after `delay`.
    SpawnAfter { slot: SlotId, delay: Duration },
    /// Kill every engine still alive (SIGKILL).
    KillAll,
    /// SIGKILL every process of the engine of `slot`: it was reported
    /// running after the pair began to stop or to restart cold, or it hung
    /// ([`Pair::hang_of`](crate::Pair::hang_of) says why). Its death is
    /// decided at its reap, as any other; the shim reports the kill
    /// ([`Event::Killed`]).
    Kill { slot: SlotId },
    /// Drop GMS state and start the daemons afresh before the next spawns.
    RestartGms,
    /// Deliver `Event::ColdRestartDue` after `delay`: a cold restart waits
    /// out its backoff like a respawn.
    RestartGmsAfter { delay: Duration },
    /// A promotion finished: record it.
    Promoted(Promotion),
    /// The pair is down for good: the task exits with `status`.
    Exit { status: u32 },
}

/// How closely the shim must watch `/proc/locks`: only engines that do not
/// speak sd_notify are learnt from the lock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LockWatch {
    /// Every live engine speaks sd_notify (or the pair is going down).
    Off,
    /// An engine serves; a silent one could still take the lock over.
    Idle,
    /// Nobody serves and a silent engine may be the next active.
    Fast,
}

/// A pair's observable state, for metrics and `shadowctl`.
#[derive(Clone, Debug, Serialize)]
pub struct Snapshot {
    /// One per engine of the pair (`0 ..= N`).
    pub slots: Vec<Slot>,
    pub active: Option<SlotId>,
    /// An active engine with at least one parked shadow behind it.
    pub protected: bool,
    /// Shadows the pair is made for (`shadow.dev/shadows`; 0: a single
    /// engine).
    pub shadows: usize,
    /// Shadows parked now: the failures the pair can take before one finds
    /// no shadow.
    pub shadows_parked: usize,
    /// Completed promotions (successor serving, old active reaped).
    pub failovers: u64,
    pub cold_restarts: u64,
    /// Engine deaths in which the OOM killer had a hand.
    pub oom_kills: u64,
    /// Engines that found the committed weights changed (each began a cold
    /// restart).
    pub weights_corrupt: u64,
    pub last_promotion: Option<Promotion>,
    /// Why the pair last restarted cold (or began to).
    pub last_cold_restart: Option<ColdRestartCause>,
    /// Cold restarts that dropped the KV pool (with the rest of the GMS
    /// state), and why the last one did.
    pub kv_drops: u64,
    pub last_kv_drop: Option<ColdRestartCause>,
    /// Deaths of each GMS daemon (by device) since the pair was created.
    pub gms_deaths: BTreeMap<String, u64>,
    /// `READY=1`s refused ([`Pair::ready_refused`](crate::Pair::ready_refused)); not part of the
    /// revision, so a liar's repeats do not republish the pair each time.
    /// A metric only: `state.json`'s schema does not have it.
    #[serde(skip)]
    pub ready_refused: u64,
    /// Engines the pair ended as hung, by cause (counted at their reap;
    /// each slot's cause is its `last_hang`).
    pub hangs: Hangs,
}
