//! The schema of a pair's `state.json`: written by the shim on every change
//! of the pair (atomically, by rename), read by `shadowctl`, the tests and
//! the failover benchmarks. docs/pairs.md describes the fields.
//!
//! These types are the schema. The shim's supervision crate (`shadow-pair`)
//! decides with the enums here (`Exit`, `FailureClass`, `ColdRestartCause`,
//! `DeathSign`, `EngineState`) and converts only the records that carry its
//! slot ids, so a variant is added in one place and spelt one way.
//! Readers deserialize with these types instead of indexing JSON by
//! string, so a renamed field fails to compile instead of reading `null`.

use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The file's name in the pair's state directory.
pub const FILE_NAME: &str = "state.json";

/// The whole file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PairState {
    /// The address of the containerd that owns the pair (empty in files
    /// written before it was recorded).
    #[serde(default)]
    pub containerd: String,
    pub namespace: String,
    /// The container (task) id containerd knows.
    pub id: String,
    /// The pid containerd sees (`State.pid`): the active engine, or the
    /// last one that ran.
    pub pid: u32,
    /// Each slot's engine pid, while it runs (`0 ..= N` for N shadows).
    pub pids: Vec<Option<u32>>,
    /// Each slot's runc container id.
    pub runc_ids: Vec<String>,
    pub pair: PairSnapshot,
    /// The latest promotions, oldest first (config `pair.promotions_kept`).
    pub promotions: Vec<PromotionRecord>,
    /// The first GMS daemon's last status report, when the pair has GMS
    /// (kept for readers of one daemon; `gms_daemons` lists them all).
    pub gms: Option<GmsStatus>,
    /// Every GMS daemon's last status report: one per GPU of the pair (or
    /// the one `host` daemon), in the order of the spec's devices.
    #[serde(default)]
    pub gms_daemons: Vec<GmsStatus>,
    /// The pair's fd store (`shadow.dev/fdstore-max`), when it has one.
    #[serde(default)]
    pub fdstore: Option<FdStoreStatus>,
    /// Set when the pair has ended: the status reported to containerd.
    pub exit_status: Option<u32>,
    /// When the file was written (µs since the Unix epoch).
    pub updated_unix_us: u64,
}

impl PairState {
    /// The pid of the active engine, when there is one and it runs.
    pub fn active_pid(&self) -> Option<u32> {
        self.pair.active.and_then(|s| self.pid_of(s))
    }

    /// The pid of the engine in `slot` (`0 ..= N`), while it runs.
    pub fn pid_of(&self, slot: u8) -> Option<u32> {
        self.pids.get(usize::from(slot)).copied().flatten()
    }

    /// Reads and decodes a `state.json`.
    pub fn read(path: &Path) -> Result<PairState, StateError> {
        let text = std::fs::read_to_string(path).map_err(|source| StateError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        serde_json::from_str(&text).map_err(|source| StateError::Decode {
            path: path.to_path_buf(),
            source,
        })
    }
}

/// Why a `state.json` could not be read.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("reading {path}: {source}")]
    Read {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("decoding {path}: {source}")]
    Decode {
        path: std::path::PathBuf,
        source: serde_json::Error,
    },
}

fn one_shadow() -> usize {
    1
}

/// The pair's supervision state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PairSnapshot {
    /// One per engine, `0 ..= N` for N shadows.
    pub slots: Vec<SlotState>,
    /// The slot that holds the lock.
    pub active: Option<u8>,
    /// An active engine with at least one parked shadow behind it.
    pub protected: bool,
    /// Shadows the pair is made for (`shadow.dev/shadows`; 0 for a single
    /// engine; absent from files written before it existed: 1).
    #[serde(default = "one_shadow")]
    pub shadows: usize,
    /// Shadows parked now (absent from older files: 0).
    #[serde(default)]
    pub shadows_parked: usize,
    pub failovers: u64,
    pub cold_restarts: u64,
    /// Engine deaths in which the OOM killer killed a process of the
    /// engine (absent from files written before it existed: 0).
    #[serde(default)]
    pub oom_kills: u64,
    /// Engines that found the committed weights changed, each a cold
    /// restart (absent from files written before it existed: 0).
    #[serde(default)]
    pub weights_corrupt: u64,
    pub last_promotion: Option<Promotion>,
    /// Why the pair last restarted cold (or began to).
    #[serde(default)]
    pub last_cold_restart: Option<ColdRestartCause>,
    /// Cold restarts that dropped the pair's KV pool with the rest of its
    /// GMS state: what engines carried across promotions is not carried
    /// across these (absent from files written before it existed: 0).
    #[serde(default)]
    pub kv_drops: u64,
    /// Why the KV pool was last dropped (a device-invalidating XID, a
    /// GMS daemon's death, weights found changed).
    #[serde(default)]
    pub last_kv_drop: Option<ColdRestartCause>,
    /// Deaths of each GMS daemon, by device (a GPU UUID, or `host`).
    #[serde(default)]
    pub gms_deaths: std::collections::BTreeMap<String, u64>,
    /// Engines the pair ended as hung, by cause (absent from files
    /// written before it existed: none).
    #[serde(default)]
    pub hangs: Hangs,
}

/// Why the pair ended an engine as hung: a live engine that stopped
/// doing its work, which never dies on its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HangCause {
    /// Its armed watchdog (`WATCHDOG=1`) was not pinged within its interval.
    Watchdog,
    /// It asked to be ended (`WATCHDOG=trigger`).
    Trigger,
    /// The runtime's probe of the serving engine failed
    /// `shadow.dev/probe-failures` times in a row.
    Probe,
    /// It neither parked nor served within `shadow.dev/start-timeout`
    /// (extended by its `EXTEND_TIMEOUT_USEC=`).
    StartTimeout,
}

impl HangCause {
    /// Every cause, in the order a metric lists them.
    pub const ALL: [HangCause; 4] = [
        HangCause::Watchdog,
        HangCause::Trigger,
        HangCause::Probe,
        HangCause::StartTimeout,
    ];

    /// The name as the file spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            HangCause::Watchdog => "watchdog",
            HangCause::Trigger => "trigger",
            HangCause::Probe => "probe",
            HangCause::StartTimeout => "start_timeout",
        }
    }
}

impl std::fmt::Display for HangCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Engines ended as hung, counted at their reap, one count per cause:
/// `{"watchdog": 1, "trigger": 0, "probe": 2, "start_timeout": 0}`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Hangs {
    pub watchdog: u64,
    pub trigger: u64,
    pub probe: u64,
    pub start_timeout: u64,
}

impl Hangs {
    /// The count of `cause`.
    pub fn of(&self, cause: HangCause) -> u64 {
        match cause {
            HangCause::Watchdog => self.watchdog,
            HangCause::Trigger => self.trigger,
            HangCause::Probe => self.probe,
            HangCause::StartTimeout => self.start_timeout,
        }
    }

    /// Counts one hang of `cause`.
    pub fn count(&mut self, cause: HangCause) {
        let n = match cause {
            HangCause::Watchdog => &mut self.watchdog,
            HangCause::Trigger => &mut self.trigger,
            HangCause::Probe => &mut self.probe,
            HangCause::StartTimeout => &mut self.start_timeout,
        };
        *n += 1;
    }

    /// Every hang, whatever its cause.
    pub fn total(&self) -> u64 {
        HangCause::ALL.iter().map(|c| self.of(*c)).sum()
    }
}

/// How the pair ended an engine that hung: why, when it saw the hang, and
/// when it had killed every process of the engine (the first two steps of
/// a hang's timeline: detected → killed → lock taken → ready).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hang {
    pub cause: HangCause,
    /// When the hang was decided (the watchdog's check past its expiry,
    /// the probe failure that reached the count, the trigger's arrival,
    /// the start timeout's check).
    pub detected_at: Duration,
    /// When every process of the engine had been sent SIGKILL.
    pub killed_at: Option<Duration>,
}

/// Why the pair last restarted cold (a device-invalidating failure, or
/// weights found changed): `{"cause": "xid", "xid": 79}` and the like.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "cause")]
pub enum ColdRestartCause {
    /// The GMS daemon of this device (a GPU UUID, or `host`) died: its
    /// weights are gone.
    GmsDied { device: String },
    /// A device-invalidating XID on one of the pair's GPUs.
    Xid { xid: u32 },
    /// The engine of `slot` exited with [`crate::weights::CORRUPT_EXIT`]:
    /// it found the committed weights changed since their digest was
    /// recorded.
    WeightsCorrupt { slot: u8 },
}

/// One slot.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SlotState {
    pub id: u8,
    pub state: EngineState,
    pub pid: Option<u32>,
    /// How many times this slot was spawned.
    pub generation: u32,
    /// Whether its engine spoke sd_notify since it was spawned.
    pub speaks_notify: bool,
    pub last_exit: Option<Exit>,
    /// The pair ended this slot's last engine as hung, and why (beside
    /// `last_exit`, which it explains; absent for any other death, and
    /// from files written before it existed).
    #[serde(default)]
    pub last_hang: Option<HangCause>,
    /// Its engine armed its watchdog (a `WATCHDOG=1` under a configured
    /// watchdog): a silence past the interval now ends it. Absent from
    /// files written before it existed: false.
    #[serde(default)]
    pub watchdog_armed: bool,
}

/// Where one slot's engine is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EngineState {
    /// Asked for, not yet running.
    Spawning,
    /// Running, initialising (loading or mapping weights).
    Starting,
    /// Initialised and blocked on the lock (`STATUS=parked`).
    Parked,
    /// Holds the lock and serves.
    Active,
    /// Was active and lost the lock to its successor (dead or leaving), not
    /// yet reaped.
    Superseded,
    /// Dead, waiting for its respawn delay.
    Backoff,
    /// Dead and not coming back (stopping, cold restart, crash loop).
    Stopped,
}

impl EngineState {
    /// Every state, in the order of a life (what a metric lists, 0
    /// included). Kept next to [`EngineState::as_str`], whose match a new
    /// state must extend.
    pub const ALL: [EngineState; 7] = [
        EngineState::Spawning,
        EngineState::Starting,
        EngineState::Parked,
        EngineState::Active,
        EngineState::Superseded,
        EngineState::Backoff,
        EngineState::Stopped,
    ];

    /// The name as the file spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            EngineState::Spawning => "spawning",
            EngineState::Starting => "starting",
            EngineState::Parked => "parked",
            EngineState::Active => "active",
            EngineState::Superseded => "superseded",
            EngineState::Backoff => "backoff",
            EngineState::Stopped => "stopped",
        }
    }
}

/// How an engine process ended, as the reaper saw it: `{"code": N}` or
/// `{"signal": N}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Exit {
    /// `exit(code)`.
    Code(i32),
    /// Killed by a signal.
    Signal(i32),
}

impl Exit {
    /// The status containerd reports: the code, or 128 + the signal number
    /// (137 for SIGKILL), as a shell and runc-v2 report it.
    pub fn status(self) -> u32 {
        match self {
            Exit::Code(c) => (c & 0xff) as u32,
            Exit::Signal(s) => 128 + (s & 0x7f) as u32,
        }
    }

    /// From a raw `wait` status word.
    pub fn from_wait_status(raw: i32) -> Exit {
        if raw & 0x7f == 0 {
            Exit::Code((raw >> 8) & 0xff)
        } else {
            Exit::Signal(raw & 0x7f)
        }
    }
}

impl std::fmt::Display for Exit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Exit::Code(c) => write!(f, "exit code {c}"),
            Exit::Signal(s) => write!(f, "signal {s}"),
        }
    }
}

/// What the supervisor does about a failure (docs/pairs.md, "Failure
/// classes").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureClass {
    /// Promote the shadow, respawn the slot, keep GMS.
    DevicePreserving,
    /// Stop both engines, drop GMS state, restart the pair cold.
    DeviceInvalidating,
    /// The kernel's OOM killer killed a process of the engine (its cgroup
    /// counted an `oom_kill`) on a healthy device: handled as
    /// device-preserving (promote, respawn, keep GMS), and counted apart so
    /// that an operator sees memory limits, not crashes.
    OutOfMemory,
    /// An engine found the committed weights changed (it exited with
    /// [`crate::weights::CORRUPT_EXIT`]): stop both engines, drop GMS
    /// state, restart the pair cold, as for
    /// [`FailureClass::DeviceInvalidating`], and counted apart.
    WeightsCorrupt,
    /// The pair ended the engine because it hung (its cause is the
    /// slot's `last_hang` and the promotion's `hang`) on a healthy device:
    /// handled as device-preserving (promote, respawn, keep GMS), and
    /// counted apart. A hung engine that had not parked yet (a start
    /// timeout) is an early death, judged by the restart budget as any.
    Hung,
    /// The restart budget is spent: stop and report the exit.
    CrashLoop,
}

impl FailureClass {
    /// Whether the shared state is lost: the pair restarts cold.
    pub fn restarts_cold(self) -> bool {
        matches!(
            self,
            FailureClass::DeviceInvalidating | FailureClass::WeightsCorrupt
        )
    }

    /// The name as the file spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            FailureClass::DevicePreserving => "device_preserving",
            FailureClass::DeviceInvalidating => "device_invalidating",
            FailureClass::OutOfMemory => "out_of_memory",
            FailureClass::WeightsCorrupt => "weights_corrupt",
            FailureClass::Hung => "hung",
            FailureClass::CrashLoop => "crash_loop",
        }
    }
}

/// How the shim first learnt that the active engine was gone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeathSign {
    /// The reaper collected it.
    Reap,
    /// The election lock seen let go: the kernel reported the lock file
    /// closed (inotify) with the lock then free, or `/proc/locks` showed
    /// it free.
    LockFree,
    /// The successor seen holding the lock (right after the lock file's
    /// close, or in `/proc/locks`).
    LockTaken,
    /// The successor said `READY=1` (it can only hold the lock if the old
    /// active let go of it).
    Ready,
    /// The pair decided the active engine hung (the promotion's `hang`
    /// says why), before any sign of its death: it was killed for it.
    Hang,
}

impl DeathSign {
    /// The name as the file spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            DeathSign::Reap => "reap",
            DeathSign::LockFree => "lock_free",
            DeathSign::LockTaken => "lock_taken",
            DeathSign::Ready => "ready",
            DeathSign::Hang => "hang",
        }
    }
}

/// One failover's timeline, in time since the pair started (`secs` +
/// `nanos`, serde's encoding of a `Duration`), each time taken where the
/// fact was observed (docs/pairs.md, "Failover timing").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Promotion {
    pub number: u64,
    /// The slot whose engine died.
    pub from: u8,
    /// The slot promoted; none when no shadow took over.
    pub to: Option<u8>,
    /// The first sign of the death: the earliest of the reap, the lock
    /// seen free or taken by the successor, the successor's `READY=1`.
    pub death_at: Duration,
    /// Which sign that was.
    pub death_seen: DeathSign,
    /// When the reaper collected the dead engine.
    pub reaped_at: Duration,
    pub lock_at: Option<Duration>,
    pub ready_at: Option<Duration>,
    pub exit: Exit,
    pub class: FailureClass,
    /// Set when the old active was ended as hung: why, when that was
    /// seen and when it was killed (then `death_at` is `detected_at`).
    #[serde(default)]
    pub hang: Option<Hang>,
}

impl Promotion {
    /// Death → ready (or → lock, for an engine that does not speak
    /// sd_notify).
    pub fn total(&self) -> Option<Duration> {
        self.ready_at
            .or(self.lock_at)
            .map(|t| t.saturating_sub(self.death_at))
    }
}

/// A promotion with wall-clock times, for tools that took their own time
/// of the kill.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PromotionRecord {
    #[serde(flatten)]
    pub promotion: Promotion,
    pub death_unix_us: u64,
    pub reaped_unix_us: u64,
    pub lock_unix_us: Option<u64>,
    pub ready_unix_us: Option<u64>,
    /// When the hang was detected and the engine killed, for a promotion
    /// after a hang (absent otherwise).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hang_detected_unix_us: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hang_killed_unix_us: Option<u64>,
    /// [`Promotion::total`] in milliseconds.
    pub total_ms: Option<f64>,
}

/// What a pair's fd store holds and did since the pair started (figures
/// of the last write of the file: the store changes far more often).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FdStoreStatus {
    /// Descriptors held now.
    pub fds: u64,
    /// Its bound.
    pub max: u64,
    pub stored: u64,
    pub removed: u64,
    pub hung_up: u64,
    /// Descriptors handed to promoted engines by fetches.
    pub fetched: u64,
    /// Fetches answered, and refused (not the lock holder, not the slot's
    /// engine, one in flight already).
    #[serde(default)]
    pub fetches: u64,
    pub fetches_refused: u64,
    /// Descriptors not kept, by reason (`wrong_type`, `full`, `bad_name`).
    #[serde(default)]
    pub refused: std::collections::BTreeMap<String, u64>,
    /// Connections the runtime accepted into the store
    /// (`shadow.dev/accept: runtime`), and handed to a serving engine
    /// through its hand-off socket (a fetch's are counted in `fetched`).
    #[serde(default)]
    pub accepted: u64,
    #[serde(default)]
    pub handed: u64,
}

/// The fields of gmsd's status report that tools read; the rest of the
/// report is kept as gmsd wrote it (`gmsd status --json` documents it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GmsStatus {
    pub pid: u32,
    pub backend: String,
    pub device: String,
    pub socket: String,
    /// `empty`, `loading`, `committed` or `replacing`.
    pub state: String,
    pub bytes: u64,
    pub allocations: u64,
    #[serde(default)]
    pub leases: Vec<serde_json::Value>,
    #[serde(flatten)]
    pub rest: serde_json::Map<String, serde_json::Value>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn sample() -> PairState {
        let gms = GmsStatus {
            pid: 7,
            backend: "host".into(),
            device: "host".into(),
            socket: "/run/x/gms-host.sock".into(),
            state: "committed".into(),
            bytes: 4096,
            allocations: 1,
            leases: vec![json!({"mode": "ro"})],
            rest: [("resident_bytes".to_string(), json!(4096))]
                .into_iter()
                .collect(),
        };
        let promotion = Promotion {
            number: 1,
            from: 0,
            to: Some(1),
            death_at: Duration::from_millis(1500),
            death_seen: DeathSign::Reap,
            reaped_at: Duration::from_millis(1500),
            lock_at: Some(Duration::from_micros(1_500_040)),
            ready_at: Some(Duration::from_micros(1_502_000)),
            exit: Exit::Signal(9),
            class: FailureClass::Hung,
            hang: Some(Hang {
                cause: HangCause::Watchdog,
                detected_at: Duration::from_millis(1499),
                killed_at: Some(Duration::from_micros(1_499_100)),
            }),
        };
        let slot = |id, state, pid| SlotState {
            id,
            state,
            pid,
            generation: 2,
            speaks_notify: true,
            last_exit: Some(Exit::Code(3)),
            last_hang: (id == 0).then_some(HangCause::StartTimeout),
            watchdog_armed: id == 1,
        };
        PairState {
            containerd: "/run/containerd/containerd.sock".into(),
            namespace: "default".into(),
            id: "c1".into(),
            pid: 42,
            pids: vec![Some(41), Some(42)],
            runc_ids: vec!["c1-s0".into(), "c1-s1".into()],
            pair: PairSnapshot {
                slots: vec![
                    slot(0, EngineState::Parked, Some(41)),
                    slot(1, EngineState::Active, Some(42)),
                ],
                active: Some(1),
                protected: true,
                shadows: 1,
                shadows_parked: 1,
                failovers: 1,
                cold_restarts: 0,
                oom_kills: 0,
                weights_corrupt: 0,
                last_promotion: Some(promotion.clone()),
                last_cold_restart: None,
                kv_drops: 0,
                last_kv_drop: None,
                gms_deaths: Default::default(),
                hangs: Hangs {
                    watchdog: 1,
                    probe: 2,
                    ..Hangs::default()
                },
            },
            promotions: vec![PromotionRecord {
                total_ms: promotion.total().map(|d| d.as_secs_f64() * 1e3),
                promotion,
                death_unix_us: 1_700_000_000_000_000,
                reaped_unix_us: 1_700_000_000_000_000,
                lock_unix_us: Some(1_700_000_000_000_040),
                ready_unix_us: None,
                hang_detected_unix_us: Some(1_699_999_999_999_000),
                hang_killed_unix_us: Some(1_699_999_999_999_100),
            }],
            gms: Some(gms.clone()),
            gms_daemons: vec![gms],
            fdstore: None,
            exit_status: None,
            updated_unix_us: 1_700_000_000_100_000,
        }
    }

    #[test]
    fn state_round_trips() {
        let s = sample();
        let text = serde_json::to_string_pretty(&s).unwrap();
        let back: PairState = serde_json::from_str(&text).unwrap();
        assert_eq!(back, s);
        assert_eq!(back.active_pid(), Some(42));
        assert_eq!(back.pid_of(0), Some(41));
        assert_eq!(back.pid_of(7), None);
    }

    /// The encoding tools and docs depend on (docs/pairs.md).
    #[test]
    fn encoding_is_the_documented_one() {
        let v = serde_json::to_value(sample()).unwrap();
        assert_eq!(v["pair"]["slots"][1]["state"], "active");
        assert_eq!(v["pair"]["slots"][0]["last_exit"], json!({"code": 3}));
        let p = &v["promotions"][0];
        assert_eq!(p["reaped_at"], json!({"secs": 1, "nanos": 500_000_000}));
        assert_eq!(p["exit"], json!({"signal": 9}));
        assert_eq!(p["class"], FailureClass::Hung.as_str());
        assert_eq!(
            p["hang"],
            json!({"cause": "watchdog", "detected_at": {"secs": 1, "nanos": 499_000_000},
                   "killed_at": {"secs": 1, "nanos": 499_100_000}})
        );
        assert_eq!(v["pair"]["slots"][0]["last_hang"], "start_timeout");
        assert_eq!(v["pair"]["slots"][1]["last_hang"], json!(null));
        assert_eq!(v["pair"]["slots"][1]["watchdog_armed"], true);
        assert_eq!(
            v["pair"]["hangs"],
            json!({"watchdog": 1, "trigger": 0, "probe": 2, "start_timeout": 0})
        );
        for c in HangCause::ALL {
            assert_eq!(serde_json::to_value(c).unwrap(), c.as_str());
        }
        for e in EngineState::ALL {
            assert_eq!(serde_json::to_value(e).unwrap(), e.as_str());
        }
        for d in [
            DeathSign::Reap,
            DeathSign::LockFree,
            DeathSign::LockTaken,
            DeathSign::Ready,
            DeathSign::Hang,
        ] {
            assert_eq!(serde_json::to_value(d).unwrap(), d.as_str());
        }
        assert_eq!(p["death_seen"], "reap");
        for c in [
            FailureClass::DeviceInvalidating,
            FailureClass::OutOfMemory,
            FailureClass::Hung,
            FailureClass::CrashLoop,
        ] {
            assert_eq!(serde_json::to_value(c).unwrap(), c.as_str());
        }
        assert_eq!(p["number"], 1, "the promotion is flattened into the record");
        assert_eq!(p["total_ms"], 2.0);
        assert_eq!(v["gms"]["resident_bytes"], 4096, "gmsd's other fields kept");
    }

    /// A file written before hangs existed still reads, with none.
    #[test]
    fn files_without_hangs_read() {
        let mut v = serde_json::to_value(sample()).unwrap();
        let pair = v["pair"].as_object_mut().unwrap();
        pair.remove("hangs");
        for slot in pair["slots"].as_array_mut().unwrap() {
            slot.as_object_mut().unwrap().remove("last_hang");
            slot.as_object_mut().unwrap().remove("watchdog_armed");
        }
        v["promotions"][0].as_object_mut().unwrap().remove("hang");
        let back: PairState = serde_json::from_value(v).unwrap();
        assert_eq!(back.pair.hangs, Hangs::default());
        assert_eq!(back.pair.slots[0].last_hang, None);
        assert!(!back.pair.slots[1].watchdog_armed);
        assert_eq!(back.promotions[0].promotion.hang, None);
        let mut h = Hangs::default();
        h.count(HangCause::Probe);
        h.count(HangCause::Probe);
        h.count(HangCause::Trigger);
        assert_eq!((h.of(HangCause::Probe), h.total()), (2, 3));
        assert!(!FailureClass::Hung.restarts_cold());
    }

    #[test]
    fn exit_statuses_are_what_a_shell_reports() {
        assert_eq!(Exit::Code(0).status(), 0);
        assert_eq!(Exit::Code(3).status(), 3);
        assert_eq!(Exit::Signal(9).status(), 137);
        assert_eq!(Exit::Signal(15).status(), 143);
        // wait(2) words: exit 3 is 0x0300; SIGKILL is 9; SIGSEGV with core is 0x8b.
        assert_eq!(Exit::from_wait_status(0x0300), Exit::Code(3));
        assert_eq!(Exit::from_wait_status(9), Exit::Signal(9));
        assert_eq!(Exit::from_wait_status(0x8b), Exit::Signal(11));
    }

    #[test]
    fn read_names_the_file_on_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(FILE_NAME);
        assert!(PairState::read(&path)
            .unwrap_err()
            .to_string()
            .contains("state.json"));
        std::fs::write(&path, "{}").unwrap();
        assert!(matches!(
            PairState::read(&path),
            Err(StateError::Decode { .. })
        ));
        std::fs::write(&path, serde_json::to_vec(&sample()).unwrap()).unwrap();
        assert_eq!(PairState::read(&path).unwrap(), sample());
    }
}
