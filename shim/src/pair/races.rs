//! The order races of a failover, run through the real supervisor task with
//! a fake [`Host`]: READY=1 before the reap, an engine that speaks and dies
//! before its spawn is reported, a Kill while a promotion is in flight.
//! No root, no runc: the fake hands out pids, records signals, and reaps
//! when a test says so, with the reaper's time.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use async_trait::async_trait;
use nix::sys::signal::Signal;
use shadow_contract::state::{DeathSign, EngineState, Exit as FileExit, PairState};
use shadow_pair::SlotId;
use tokio::sync::{mpsc, oneshot, watch};

use super::config::PairConfig;
use super::engine::SharedOutput;
use super::host::Host;
use super::input::Input;
use super::lock::{LockLook, LockSeen};
use super::notify::Datagram;
use super::publish::View;
use super::supervisor::{Parts, Supervisor};
use crate::error::Result;
use crate::events::EventSink;
use crate::exits::{Exit, ExitRouter};

const S0: SlotId = SlotId::ZERO;
/// How long the fake's `runc run` takes.
const SPAWN_TIME: Duration = Duration::from_millis(100);

/// What a spawn of a slot does before runc "returns".
#[derive(Clone, Default)]
struct Script {
    /// Datagrams the engine sends before its spawn is reported.
    says: Vec<&'static str>,
    /// It is dead (and reaped) before its spawn is reported.
    dies: bool,
}

#[derive(Default)]
struct FakeState {
    next_pid: u32,
    slots: HashMap<u32, SlotId>,
    waiting: HashMap<u32, oneshot::Sender<Exit>>,
    reaped: HashMap<u32, Exit>,
    signals: Vec<(u32, Signal)>,
    scripts: HashMap<SlotId, Script>,
    input: Option<mpsc::UnboundedSender<Input>>,
    /// Which engine `/proc/locks` shows holding the election lock.
    holder: Option<SlotId>,
}

#[derive(Default)]
struct FakeHost(Mutex<FakeState>);

impl FakeHost {
    fn state(&self) -> std::sync::MutexGuard<'_, FakeState> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The reaper collects `pid`, at `at`.
    fn reap(&self, pid: u32, status: i32, at: SystemTime) {
        let exit = Exit {
            pid: pid as i32,
            status,
            at,
        };
        let mut st = self.state();
        match st.waiting.remove(&pid) {
            Some(tx) => {
                let _ = tx.send(exit);
            }
            None => {
                st.reaped.insert(pid, exit);
            }
        }
    }

    fn signals(&self) -> Vec<(u32, Signal)> {
        self.state().signals.clone()
    }

    fn script(&self, slot: SlotId, script: Script) {
        self.state().scripts.insert(slot, script);
    }
}

#[async_trait]
impl Host for FakeHost {
    async fn spawn(&self, slot: SlotId, _fresh: bool) -> Result<u32> {
        let (pid, script, input) = {
            let mut st = self.state();
            st.next_pid += 1;
            let pid = 100 * (slot.index() as u32 + 1) + st.next_pid;
            st.slots.insert(pid, slot);
            let script = st.scripts.remove(&slot).unwrap_or_default();
            (pid, script, st.input.clone())
        };
        if let Some(tx) = input {
            for text in script.says {
                let d = Datagram {
                    pid,
                    bytes: text.as_bytes().to_vec(),
                };
                let _ = tx.send(Input::Notify(d, Instant::now()));
            }
        }
        if script.dies {
            self.reap(pid, 137, SystemTime::now());
        }
        // runc's own time: what the engine said is handled before this returns.
        tokio::time::sleep(SPAWN_TIME).await;
        Ok(pid)
    }

    fn reaped(&self, pid: u32) -> oneshot::Receiver<Exit> {
        let (tx, rx) = oneshot::channel();
        let mut st = self.state();
        match st.reaped.remove(&pid) {
            Some(exit) => {
                let _ = tx.send(exit);
            }
            None => {
                st.waiting.insert(pid, tx);
            }
        }
        rx
    }

    fn oom_kills(&self, _slot: SlotId) -> u64 {
        0
    }

    async fn kill_rest(&self, _slot: SlotId) {}

    fn signal(&self, pid: u32, signal: Signal) {
        self.state().signals.push((pid, signal));
    }

    fn slot_of_pid(&self, pid: u32) -> Option<SlotId> {
        self.state().slots.get(&pid).copied()
    }

    fn lock(&self) -> LockLook {
        LockLook {
            seen: self.state().holder.map_or(LockSeen::Free, LockSeen::Held),
            waiting: [false, false],
        }
    }
}

struct Rig {
    host: Arc<FakeHost>,
    input: mpsc::UnboundedSender<Input>,
    view: watch::Receiver<View>,
    state_json: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl Rig {
    /// A running pair whose engines both parked; slot 0 said READY=1.
    async fn serving() -> Rig {
        let dir = tempfile::tempdir().expect("tempdir");
        let host = Arc::new(FakeHost::default());
        let (view_tx, view) = watch::channel(View::default());
        let (events, _) = EventSink::channel();
        let mut sup = Supervisor::new(Parts {
            id: "p".into(),
            namespace: "ns".into(),
            config: PairConfig::default(),
            host: host.clone(),
            runc_ids: ["p-s0".into(), "p-s1".into()],
            output: Arc::new(SharedOutput::new(None, None)),
            copiers: Vec::new(),
            router: Arc::new(ExitRouter::default()),
            events,
            view: view_tx,
            notify: None,
            lock_path: None,
            state_json: dir.path().join("state.json"),
            containerd: "/run/containerd/containerd.sock".into(),
            metrics_file: dir.path().join("pair.prom"),
            gms: None,
            gpu_buses: Vec::new(),
            single: false,
        });
        let input = sup.input();
        host.state().input = Some(input.clone());
        sup.start_engines().await.expect("start");
        tokio::spawn(sup.run_to_end());
        let rig = Rig {
            host,
            input,
            view,
            state_json: dir.path().join("state.json"),
            _dir: dir,
        };
        for pid in rig.pids() {
            rig.say(pid, "STATUS=parked");
        }
        rig.ready(rig.pids()[0]);
        rig.until("protected", |s| s.pair.protected).await;
        rig
    }

    fn pids(&self) -> [u32; 2] {
        let v = self.view.borrow();
        [v.pids[0].unwrap_or(0), v.pids[1].unwrap_or(0)]
    }

    /// The engine `pid` takes the election lock (its holder lets go: it
    /// is dead or about to be) and says READY=1, as the contract asks.
    fn ready(&self, pid: u32) {
        let slot = self.host.state().slots.get(&pid).copied();
        self.host.state().holder = slot;
        self.say(pid, "READY=1");
    }

    fn say(&self, pid: u32, text: &str) {
        let d = Datagram {
            pid,
            bytes: text.as_bytes().to_vec(),
        };
        let _ = self.input.send(Input::Notify(d, Instant::now()));
    }

    fn state(&self) -> Option<PairState> {
        PairState::read(&self.state_json).ok()
    }

    async fn until(&self, what: &str, ok: impl Fn(&PairState) -> bool) -> PairState {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let st = self.state();
            if let Some(st) = st.as_ref().filter(|s| ok(s)) {
                return st.clone();
            }
            assert!(Instant::now() < deadline, "{what}: {st:#?}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

#[tokio::test]
async fn ready_before_the_reap_is_recorded_against_the_reapers_time() {
    let rig = Rig::serving().await;
    let [old, shadow] = rig.pids();
    // The engine dies; the reaper stamps it; its exit reaches the
    // supervisor only after the successor's READY=1.
    let died = SystemTime::now();
    tokio::time::sleep(Duration::from_millis(30)).await;
    rig.ready(shadow);
    let st = rig
        .until("superseded", |s| {
            s.pair.slots[0].state == EngineState::Superseded
        })
        .await;
    assert_eq!(st.pair.active, Some(1));
    assert_eq!(st.pid, shadow, "State.pid is the new active at once");
    assert!(st.promotions.is_empty());
    assert_eq!(st.pair.failovers, 0, "counted once complete");
    rig.host.reap(old, 137, died);
    let st = rig
        .until("promotion", |s| {
            s.pair.failovers == 1 && !s.promotions.is_empty()
        })
        .await;
    let p = &st.promotions[0];
    assert_eq!(p.promotion.death_seen, DeathSign::Reap);
    let total = p.total_ms.expect("total");
    assert!((25.0..1000.0).contains(&total), "death → READY {total} ms");
    assert_eq!(p.death_unix_us, p.reaped_unix_us);
    let ready = p.ready_unix_us.expect("ready");
    assert!(ready > p.reaped_unix_us + 25_000, "{p:?}");
    // The old slot is respawned and parks behind the new active.
    let st = rig
        .until("respawned", |s| {
            s.pair.slots[0].generation == 2 && s.pids[0].is_some()
        })
        .await;
    rig.say(st.pids[0].unwrap_or(0), "STATUS=parked");
    rig.until("protected again", |s| s.pair.protected).await;
}

/// The shadow says READY=1 without the lock (docs/security.md, "The notify
/// socket"): the active keeps serving and State's pid stays on it. Once
/// the active dies and the liar takes the lock, it is promoted as usual.
#[tokio::test]
async fn a_ready_without_the_lock_is_refused_until_the_liar_holds_it() {
    let rig = Rig::serving().await;
    let [old, liar] = rig.pids();
    rig.say(liar, "READY=1");
    rig.say(liar, "READY=1\nSTATUS=serving");
    let st = rig.state().expect("state.json");
    assert_eq!((st.pair.active, st.pid), (Some(0), old), "{st:#?}");
    // The real active dies. Inputs are taken in order, so the reap is
    // decided after the lies: had they been believed, the liar would be
    // promoted by this reap.
    rig.host.reap(old, 137, SystemTime::now());
    let st = rig
        .until("the active's reap", |s| s.pair.slots[0].last_exit.is_some())
        .await;
    assert_eq!(st.pair.active, None, "{st:#?}");
    assert_eq!(st.pair.failovers, 0, "{st:#?}");
    assert_eq!(st.pair.slots[1].state, EngineState::Parked, "{st:#?}");
    // The liar takes the lock and says so again: promoted as usual.
    rig.ready(liar);
    let st = rig
        .until("promotion", |s| {
            s.pair.failovers == 1 && s.pair.active == Some(1)
        })
        .await;
    assert_eq!(st.pid, liar);
}

#[tokio::test]
async fn an_engine_that_speaks_and_dies_before_its_spawn_is_reported() {
    let rig = Rig::serving().await;
    let [old, shadow] = rig.pids();
    rig.host.script(
        S0,
        Script {
            says: vec!["STATUS=parked"],
            dies: true,
        },
    );
    rig.host.reap(old, 137, SystemTime::now());
    rig.ready(shadow);
    // Generation 2 parked and died before runc returned; generation 3
    // is spawned at once for the useful life it had.
    let st = rig
        .until("third generation", |s| {
            s.pair.slots[0].generation == 3 && s.pair.active == Some(1)
        })
        .await;
    assert_eq!(
        st.pair.slots[0].last_exit,
        Some(FileExit::Signal(9)),
        "{st:#?}"
    );
    assert_eq!(st.pair.failovers, 1, "a shadow's death is no failover");
    assert!(rig.host.signals().is_empty(), "nothing was killed");
}

#[tokio::test]
async fn a_kill_during_a_promotion_kills_the_respawn_on_arrival_and_exits_once() {
    let rig = Rig::serving().await;
    let [old, shadow] = rig.pids();
    rig.ready(shadow);
    rig.host.reap(old, 137, SystemTime::now());
    rig.until("respawn asked for", |s| {
        s.pair.slots[0].state == EngineState::Spawning && !s.promotions.is_empty()
    })
    .await;
    // Kill while slot 0's respawn is in flight (the fake's runc is slow).
    let _ = rig.input.send(Input::Kill { signal: 15 });
    let st = rig.until("respawn reported", |s| s.pids[0].is_some()).await;
    let respawn = st.pids[0].unwrap_or(0);
    let deadline = Instant::now() + Duration::from_secs(5);
    while !rig.host.signals().contains(&(respawn, Signal::SIGKILL)) {
        assert!(Instant::now() < deadline, "{:?}", rig.host.signals());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(rig.host.signals().contains(&(shadow, Signal::SIGTERM)));
    rig.host.reap(respawn, 137, SystemTime::now());
    assert!(rig.view.borrow().exit.is_none(), "the active still runs");
    rig.host.reap(shadow, 143, SystemTime::now());
    let mut view = rig.view.clone();
    let v = tokio::time::timeout(Duration::from_secs(5), view.wait_for(|v| v.exit.is_some()))
        .await
        .expect("exit in time")
        .expect("view")
        .clone();
    assert_eq!(v.exit.map(|e| e.status), Some(143), "the active's status");
    let st = rig.state().expect("state.json");
    assert_eq!(st.exit_status, Some(143));
    assert_eq!(st.promotions[0].promotion.to, Some(1));
}

#[tokio::test]
async fn the_lock_files_close_dates_a_death_that_ready_reported_first() {
    let rig = Rig::serving().await;
    let [old, shadow] = rig.pids();
    // The kernel closes the dying engine's lock file (inotify) 20 ms
    // before the successor's READY=1 and well before the reap.
    let closed = Instant::now();
    tokio::time::sleep(Duration::from_millis(20)).await;
    rig.ready(shadow);
    let _ = rig.input.send(Input::LockClosed(closed));
    rig.until("superseded", |s| {
        s.pair.slots[0].state == EngineState::Superseded
    })
    .await;
    rig.host.reap(old, 137, SystemTime::now());
    let st = rig.until("promotion", |s| !s.promotions.is_empty()).await;
    let p = &st.promotions[0];
    assert_eq!(p.promotion.death_seen, DeathSign::LockFree, "{p:?}");
    let total = p.total_ms.expect("total");
    assert!((15.0..1000.0).contains(&total), "death → READY {total} ms");
    assert!(p.reaped_unix_us > p.death_unix_us, "{p:?}");
}

#[tokio::test]
async fn a_second_kill_reaches_the_engines_at_once_not_after_the_grace() {
    let rig = Rig::serving().await;
    let [active, shadow] = rig.pids();
    let _ = rig.input.send(Input::Kill { signal: 15 });
    let deadline = Instant::now() + Duration::from_secs(5);
    while !rig.host.signals().contains(&(shadow, Signal::SIGTERM)) {
        assert!(Instant::now() < deadline, "{:?}", rig.host.signals());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The engines ignore SIGTERM; CRI's own grace ends: SIGKILL, long
    // before the pair's stop_grace_ms (10 s by default).
    let _ = rig.input.send(Input::Kill { signal: 9 });
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let sent = rig.host.signals();
        if sent.contains(&(active, Signal::SIGKILL)) && sent.contains(&(shadow, Signal::SIGKILL)) {
            break;
        }
        assert!(Instant::now() < deadline, "{sent:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    rig.host.reap(active, 137, SystemTime::now());
    rig.host.reap(shadow, 137, SystemTime::now());
    let mut view = rig.view.clone();
    let v = tokio::time::timeout(Duration::from_secs(5), view.wait_for(|v| v.exit.is_some()))
        .await
        .expect("exit in time")
        .expect("view")
        .clone();
    assert_eq!(v.exit.map(|e| e.status), Some(137));
}
