//! The order races of a failover, and the pair's life from Create to
//! Delete, run through the real supervisor task with a fake [`Host`]:
//! READY=1 before the reap, an engine that speaks and dies before its
//! spawn is reported, a Kill while a promotion is in flight, a Kill before
//! Start, a Delete. No root, no runc: the fake hands out pids, records what
//! runc was asked and the signals sent, and reaps when a test says so. The
//! tests run on tokio's paused clock: the gaps they make between events
//! are exact, and no test waits for real time to pass.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use nix::sys::signal::Signal;
use shadow_contract::state::{DeathSign, EngineState, Exit as FileExit, PairState};
use shadow_pair::{ConnEvent, Connections, Recipient, SlotId};
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::command::{Command, Reply};
use super::config::PairConfig;
use super::engine::SharedOutput;
use super::fdstore::Stored;
use super::host::{Host, Passed, Passing, ReapFuture, Reaped};
use super::input::Input;
use super::keeping::{Copies, Fetching, Keeping};
use super::lock::{LockLook, LockSeen};
use super::made::Made;
use super::notify::{Datagram, SenderSlot};
use super::publish::View;
use super::supervisor::{Handle, Hang, Parts, Supervisor};
use crate::error::{Error, Result};
use crate::events::EventSink;
use crate::exits::ExitRouter;
use crate::status::ExitInfo;

const S0: SlotId = SlotId::ZERO;
const S1: SlotId = SlotId::ONE;
/// How long the fake's `runc run` takes.
const SPAWN_TIME: Duration = Duration::from_millis(100);
/// How long, on the paused clock, anything the tests wait for may take.
const LIMIT: Duration = Duration::from_secs(5);

/// What a spawn of a slot does before runc "returns".
#[derive(Clone, Default)]
struct Script {
    /// Datagrams the engine sends before its spawn is reported.
    says: Vec<&'static str>,
    /// It is dead (and reaped) before its spawn is reported.
    dies: bool,
}

/// What the fake's runc was asked, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Call {
    Create(SlotId),
    Start(SlotId),
    Run(SlotId),
    EndCreated(SlotId),
    Remove(SlotId),
    KillEngine(SlotId),
}

#[derive(Default)]
struct FakeState {
    next_pid: u32,
    slots: HashMap<u32, SlotId>,
    waiting: HashMap<u32, oneshot::Sender<Reaped>>,
    reaped: HashMap<u32, Reaped>,
    signals: Vec<(u32, Signal)>,
    calls: Vec<Call>,
    created: Option<u32>,
    scripts: HashMap<SlotId, Script>,
    input: Option<super::input::Inputs>,
    /// Which engine `/proc/locks` shows holding the election lock.
    holder: Option<SlotId>,
    /// Which engines `/proc/locks` shows waiting for it.
    lock_waiters: [bool; shadow_pair::MAX_SLOTS],
    listening: bool,
}

#[derive(Default)]
struct FakeHost(Mutex<FakeState>, Arc<FakeKeeper>);

/// The hand-offs as the supervisor and a fetch tell them, carried out by
/// the real decision (`shadow_pair::Connections`); each engine's serial is
/// its pid.
#[derive(Default)]
struct FakeKeeper(Mutex<Connections>);

impl FakeKeeper {
    fn tell(&self, event: ConnEvent) {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .handle(event);
    }

    /// The engine now running in `slot`, as a recipient.
    fn recipient(&self, slot: SlotId) -> Option<Recipient> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .engine(slot)
    }

    /// Who connections go to now.
    fn to(&self) -> Option<SlotId> {
        let c = self.0.lock().unwrap_or_else(|p| p.into_inner());
        c.recipient().map(|r| r.slot)
    }
}

/// Each engine's serial is told at its pid's making (`new_pid`): the
/// start passes nothing else.
#[async_trait]
impl Passing for FakeKeeper {
    async fn for_start(&self, _slot: SlotId, _with_store: bool) -> Result<Passed> {
        Ok(Passed::default())
    }
}

#[async_trait]
impl Keeping for FakeKeeper {
    fn start(self: Arc<Self>, _tx: &super::input::Inputs, _fetching: Fetching) {}
    fn hands(&self) -> bool {
        true
    }
    // The pair of these tests has no notify sockets and no fetch servers:
    // nothing stores, removes or fetches.
    async fn store(&self, _text: Vec<u8>, fds: Vec<OwnedFd>) -> Stored {
        Stored {
            kept: 0,
            refused: fds,
            why: None,
        }
    }
    async fn remove(&self, _text: Vec<u8>) -> Vec<OwnedFd> {
        Vec::new()
    }
    async fn copies_for(&self, _who: Option<Recipient>) -> Copies {
        Vec::new()
    }
    fn fetched(&self, _n: usize) {}
    fn fetch_refused(&self) {}
    async fn fetch_answered(&self, slot: SlotId) -> Option<Recipient> {
        let r = self.recipient(slot)?;
        self.tell(ConnEvent::FetchAnswered {
            slot,
            serial: r.serial,
        });
        Some(r)
    }
    fn ready_from_holder(&self, slot: SlotId, _read_at: Instant) {
        if let Some(r) = self.recipient(slot) {
            self.tell(ConnEvent::ReadyFromHolder {
                slot,
                serial: r.serial,
            });
        }
    }
    fn serving(&self) -> Option<SlotId> {
        self.to()
    }
    fn active_is(&self, now: Option<SlotId>) {
        self.tell(ConnEvent::Active(now));
    }
    fn died(&self, slot: SlotId) {
        self.tell(ConnEvent::Died { slot });
    }
    fn stop(&self) {}
    fn lock_lost(&self, slot: SlotId) {
        self.tell(ConnEvent::LockLost { slot });
    }
}

impl FakeHost {
    fn state(&self) -> std::sync::MutexGuard<'_, FakeState> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn new_pid(&self, slot: SlotId) -> u32 {
        let mut st = self.state();
        st.next_pid += 1;
        let pid = 100 * (slot.index() as u32 + 1) + st.next_pid;
        st.slots.insert(pid, slot);
        self.1.tell(ConnEvent::Started {
            slot,
            serial: u64::from(pid),
        });
        pid
    }

    /// The reaper collects `pid`, at `at`; `/proc` forgets it.
    fn reap(&self, pid: u32, status: i32, at: Instant) {
        let exit = Reaped { status, at };
        let mut st = self.state();
        st.slots.remove(&pid);
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

    fn calls(&self) -> Vec<Call> {
        self.state().calls.clone()
    }

    fn script(&self, slot: SlotId, script: Script) {
        self.state().scripts.insert(slot, script);
    }
}

#[async_trait]
impl Host for FakeHost {
    async fn create(&self, slot: SlotId, give: &dyn Passing) -> Result<u32> {
        give.for_start(slot, false).await?;
        let pid = self.new_pid(slot);
        let mut st = self.state();
        st.calls.push(Call::Create(slot));
        st.created = Some(pid);
        st.listening = true;
        Ok(pid)
    }

    async fn spawn(&self, slot: SlotId, give: &dyn Passing) -> Result<u32> {
        let created = self.state().created.take().filter(|_| slot == S0);
        if let Some(pid) = created {
            self.state().calls.push(Call::Start(slot));
            return Ok(pid);
        }
        give.for_start(slot, true).await?;
        let pid = self.new_pid(slot);
        let (script, input) = {
            let mut st = self.state();
            st.calls.push(Call::Run(slot));
            (
                st.scripts.remove(&slot).unwrap_or_default(),
                st.input.clone(),
            )
        };
        if let Some(tx) = input {
            for text in script.says {
                let _ = tx.try_send(notify(pid, slot, text));
            }
        }
        if script.dies {
            self.reap(pid, 137, Instant::now());
        }
        // runc's own time: what the engine said is handled before this returns.
        tokio::time::sleep(SPAWN_TIME).await;
        Ok(pid)
    }

    async fn end_created(&self, slot: SlotId) {
        let mut st = self.state();
        st.calls.push(Call::EndCreated(slot));
        st.created = None;
    }

    async fn remove(&self, slot: SlotId) {
        self.state().calls.push(Call::Remove(slot));
    }

    async fn ps(&self, slot: SlotId) -> Result<Vec<u32>> {
        let st = self.state();
        let mut pids: Vec<u32> = st
            .slots
            .iter()
            .filter(|(_, s)| **s == slot)
            .map(|(p, _)| *p)
            .collect();
        pids.sort();
        Ok(pids)
    }

    fn reaped(&self, pid: u32) -> ReapFuture {
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
        Box::pin(async move { rx.await.ok() })
    }

    fn oom_kills(&self, _slot: SlotId) -> u64 {
        0
    }

    async fn kill_rest(&self, _slot: SlotId) {}

    fn kill_engine(&self, slot: SlotId, pid: Option<u32>) {
        let mut s = self.state();
        s.calls.push(Call::KillEngine(slot));
        if let Some(pid) = pid {
            s.signals.push((pid, Signal::SIGKILL));
        }
    }

    fn signal(&self, pid: u32, signal: Signal) {
        self.state().signals.push((pid, signal));
    }

    fn slot_of_pid(&self, pid: u32) -> Option<SlotId> {
        self.state().slots.get(&pid).copied()
    }

    async fn lock(&self) -> LockLook {
        let st = self.state();
        LockLook {
            seen: st.holder.map_or(LockSeen::Free, LockSeen::Held),
            waiting: st.lock_waiters,
        }
    }

    fn lock_held_by(&self, pid: u32) -> Option<bool> {
        let st = self.state();
        Some(st.holder.is_some() && st.holder == st.slots.get(&pid).copied())
    }

    fn close_listen(&self) {
        self.state().listening = false;
    }
}

/// A datagram from `pid`, which the gate found in `slot` just now.
fn notify(pid: u32, slot: SlotId, text: &str) -> Input {
    let now = Instant::now();
    Input::Notify {
        datagram: Datagram::new(pid, text.as_bytes().to_vec()),
        at: now,
        slot: SenderSlot {
            slot,
            looked_up: now,
        },
    }
}

struct Rig {
    host: Arc<FakeHost>,
    handle: Handle,
    state_json: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl Rig {
    /// A pair as Create leaves it: the first engine created, nothing run.
    async fn created() -> Rig {
        Rig::created_with(Rig::no_hang()).await
    }

    /// [`Rig::created`], finding hangs as `hang` says.
    async fn created_with(hang: Hang) -> Rig {
        let dir = tempfile::tempdir().expect("tempdir");
        let host = Arc::new(FakeHost::default());
        let (events, _) = EventSink::channel();
        let handle = Supervisor::launch(Parts {
            id: "p".into(),
            namespace: "ns".into(),
            config: PairConfig::default(),
            host: host.clone(),
            passing: host.1.clone(),
            keeper: Some(host.1.clone()),
            store_figures: None,
            runc_ids: vec!["p-s0".into(), "p-s1".into()],
            output: Arc::new(SharedOutput::new(None, None)),
            copiers: Vec::new(),
            router: Arc::new(ExitRouter::default()),
            events,
            notify: None,
            lock_path: None,
            state_json: dir.path().join("state.json"),
            containerd: "/run/containerd/containerd.sock".into(),
            metrics_file: dir.path().join("pair.prom"),
            made: Made::default(),
            gpu_buses: Vec::new(),
            single: false,
            shadows: 1,
            hang,
        })
        .await
        .expect("launch");
        host.state().input = Some(handle.input.clone());
        Rig {
            host,
            handle,
            state_json: dir.path().join("state.json"),
            _dir: dir,
        }
    }

    /// A running pair whose engines both parked; slot 0 said READY=1.
    async fn serving() -> Rig {
        Rig::serving_with(Rig::no_hang()).await
    }

    /// What Create gives a pair without hang knobs.
    fn no_hang() -> Hang {
        Hang {
            watchdog: None,
            probe: None,
            start_timeout: shadow_contract::hang::DEFAULT_START_TIMEOUT,
        }
    }

    /// [`Rig::serving`], finding hangs as `hang` says.
    async fn serving_with(hang: Hang) -> Rig {
        let rig = Rig::created_with(hang).await;
        rig.ask(Command::Start).await.expect("start");
        for pid in rig.pids() {
            rig.say(pid, "STATUS=parked");
        }
        rig.ready(rig.pids()[0]);
        rig.until("protected", |s| s.pair.protected).await;
        rig
    }

    /// What the Task service does: a command, then its answer.
    async fn ask<T>(&self, command: impl FnOnce(Reply<T>) -> Command) -> Result<T> {
        let (reply, answer) = oneshot::channel();
        self.handle
            .commands
            .send(command(reply))
            .map_err(|_| Error::FailedPrecondition("supervisor gone".into()))?;
        answer
            .await
            .map_err(|_| Error::FailedPrecondition("no answer".into()))?
    }

    async fn kill(&self, signal: u32) {
        let killed = self
            .ask(|reply| Command::Kill {
                signal,
                all: false,
                reply,
            })
            .await;
        assert!(killed.is_ok(), "kill {signal}: {killed:?}");
    }

    fn view(&self) -> View {
        self.handle.view.borrow().clone()
    }

    fn pids(&self) -> [u32; 2] {
        let v = self.view();
        [v.pids[0].unwrap_or(0), v.pids[1].unwrap_or(0)]
    }

    /// The engine `pid` takes the election lock (its holder lets go: it
    /// is dead or about to be) and says READY=1, as the contract asks.
    fn ready(&self, pid: u32) {
        let slot = self.host.state().slots.get(&pid).copied();
        self.host.state().holder = slot;
        self.say(pid, "READY=1");
    }

    /// `pid` sends `text`; the gate finds it in its slot just now.
    fn say(&self, pid: u32, text: &str) {
        let slot = self.host.state().slots.get(&pid).copied();
        let slot = slot.unwrap_or_else(|| panic!("pid {pid} is in no slot"));
        let _ = self.handle.input.try_send(notify(pid, slot, text));
    }

    fn state(&self) -> Option<PairState> {
        PairState::read(&self.state_json).ok()
    }

    /// `shadow_ready_refused_total` as the metrics file shows it.
    fn refused(&self) -> u64 {
        let text = std::fs::read_to_string(self.state_json.with_file_name("pair.prom"));
        text.unwrap_or_default()
            .lines()
            .find(|l| l.starts_with("shadow_ready_refused_total{"))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or(0)
    }

    /// Poll the state file (on the paused clock) until `ok`.
    async fn until(&self, what: &str, ok: impl Fn(&PairState) -> bool) -> PairState {
        let st = within(|| self.state().filter(|s| ok(s))).await;
        st.unwrap_or_else(|| panic!("{what}: {:#?}", self.state()))
    }

    /// Until the fake has been sent `sent`.
    async fn until_signalled(&self, sent: &[(u32, Signal)]) {
        let all = within(|| {
            let got = self.host.signals();
            sent.iter().all(|s| got.contains(s)).then_some(())
        })
        .await;
        assert!(all.is_some(), "{sent:?} not in {:?}", self.host.signals());
    }

    async fn exit(&self) -> ExitInfo {
        let mut view = self.handle.view.clone();
        let v = tokio::time::timeout(LIMIT, view.wait_for(|v| v.exit.is_some()))
            .await
            .expect("exit in time")
            .expect("view")
            .clone();
        v.exit.expect("exit")
    }
}

/// `f`'s first Some, looked for every 5 ms of the paused clock for
/// [`LIMIT`]; None after it.
async fn within<T>(f: impl FnMut() -> Option<T>) -> Option<T> {
    shadow_wait::on_tokio::within(LIMIT, Duration::from_millis(5), f).await
}

#[tokio::test(start_paused = true)]
async fn ready_before_the_reap_is_recorded_against_the_reapers_time() {
    let rig = Rig::serving().await;
    let [old, shadow] = rig.pids();
    // The engine dies; the reaper stamps it; its exit reaches the
    // supervisor only after the successor's READY=1.
    let died = Instant::now();
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
    assert!(
        (total - 30.0).abs() < 0.01,
        "death → READY {total} ms, not 30"
    );
    assert_eq!(p.death_unix_us, p.reaped_unix_us);
    let ready = p.ready_unix_us.expect("ready");
    assert_eq!(ready, p.reaped_unix_us + 30_000, "{p:?}");
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
#[tokio::test(start_paused = true)]
async fn a_ready_without_the_lock_is_refused_until_the_liar_holds_it() {
    let rig = Rig::serving().await;
    let [old, liar] = rig.pids();
    rig.say(liar, "READY=1");
    rig.say(liar, "READY=1\nSTATUS=serving");
    let refused = within(|| (rig.refused() == 2).then_some(())).await;
    assert!(refused.is_some(), "refused: {}", rig.refused());
    let st = rig.state().expect("state.json");
    assert_eq!((st.pair.active, st.pid), (Some(0), old), "{st:#?}");
    // The real active dies. Inputs are taken in order, so the reap is
    // decided after the lies: had they been believed, the liar would be
    // promoted by this reap.
    rig.host.reap(old, 137, Instant::now());
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

#[tokio::test(start_paused = true)]
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
    rig.host.reap(old, 137, Instant::now());
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

#[tokio::test(start_paused = true)]
async fn a_kill_during_a_promotion_kills_the_respawn_on_arrival_and_exits_once() {
    let rig = Rig::serving().await;
    let [old, shadow] = rig.pids();
    rig.ready(shadow);
    rig.host.reap(old, 137, Instant::now());
    rig.until("respawn asked for", |s| {
        s.pair.slots[0].state == EngineState::Spawning && !s.promotions.is_empty()
    })
    .await;
    // Kill while slot 0's respawn is in flight (the fake's runc is slow).
    rig.kill(15).await;
    let st = rig.until("respawn reported", |s| s.pids[0].is_some()).await;
    let respawn = st.pids[0].unwrap_or(0);
    rig.until_signalled(&[(respawn, Signal::SIGKILL), (shadow, Signal::SIGTERM)])
        .await;
    rig.host.reap(respawn, 137, Instant::now());
    assert!(rig.view().exit.is_none(), "the active still runs");
    rig.host.reap(shadow, 143, Instant::now());
    assert_eq!(rig.exit().await.status, 143, "the active's status");
    let st = rig.state().expect("state.json");
    assert_eq!(st.exit_status, Some(143));
    assert_eq!(st.promotions[0].promotion.to, Some(1));
}

#[tokio::test(start_paused = true)]
async fn the_lock_files_close_dates_a_death_that_ready_reported_first() {
    let rig = Rig::serving().await;
    let [old, shadow] = rig.pids();
    // The kernel closes the dying engine's lock file (inotify) 20 ms
    // before the successor's READY=1 and well before the reap.
    let closed = Instant::now();
    tokio::time::sleep(Duration::from_millis(20)).await;
    rig.ready(shadow);
    let _ = rig.handle.input.send(Input::LockClosed(closed)).await;
    rig.until("superseded", |s| {
        s.pair.slots[0].state == EngineState::Superseded
    })
    .await;
    rig.host.reap(old, 137, Instant::now());
    let st = rig.until("promotion", |s| !s.promotions.is_empty()).await;
    let p = &st.promotions[0];
    assert_eq!(p.promotion.death_seen, DeathSign::LockFree, "{p:?}");
    let total = p.total_ms.expect("total");
    assert!(
        (total - 20.0).abs() < 0.01,
        "death → READY {total} ms, not 20"
    );
    assert!(p.reaped_unix_us > p.death_unix_us, "{p:?}");
}

#[tokio::test(start_paused = true)]
async fn a_second_kill_reaches_the_engines_at_once_not_after_the_grace() {
    let rig = Rig::serving().await;
    let [active, shadow] = rig.pids();
    let asked = Instant::now();
    rig.kill(15).await;
    assert!(rig.host.signals().contains(&(shadow, Signal::SIGTERM)));
    // The engines ignore SIGTERM; CRI's own grace ends: SIGKILL, long
    // before the pair's stop_grace_ms (10 s by default).
    tokio::time::sleep(Duration::from_secs(2)).await;
    rig.kill(9).await;
    let sent = rig.host.signals();
    assert!(
        sent.contains(&(active, Signal::SIGKILL)) && sent.contains(&(shadow, Signal::SIGKILL)),
        "{sent:?}"
    );
    assert!(asked.elapsed() < PairConfig::default().stop_grace());
    rig.host.reap(active, 137, Instant::now());
    rig.host.reap(shadow, 137, Instant::now());
    assert_eq!(rig.exit().await.status, 137);
}

/// Kill before Start: the task ends with the signal's status as the
/// created engine's exit, that engine is killed, Start is refused, and
/// Delete removes both slots' containers, once; the supervisor then ends.
#[tokio::test(start_paused = true)]
async fn a_kill_before_start_ends_the_created_pair_and_delete_removes_it() {
    let rig = Rig::created().await;
    let created = rig.view().pid;
    assert_ne!(created, 0, "the task has the created engine's pid");
    assert!(!rig.view().started);
    assert_eq!(rig.host.calls(), [Call::Create(S0)]);
    let pids = rig.ask(Command::Pids).await.expect("pids");
    assert_eq!(
        pids.iter().map(|p| p.pid).collect::<Vec<_>>(),
        [created],
        "a created pair lists its created engine"
    );
    rig.kill(15).await;
    let exit = rig.exit().await;
    assert_eq!((exit.pid, exit.status), (created, 128 + 15));
    assert_eq!(rig.host.calls(), [Call::Create(S0), Call::EndCreated(S0)]);
    let again = rig
        .ask(|reply| Command::Kill {
            signal: 9,
            all: false,
            reply,
        })
        .await;
    assert!(matches!(again, Err(Error::Finished { .. })), "{again:?}");
    let all = rig
        .ask(|reply| Command::Kill {
            signal: 9,
            all: true,
            reply,
        })
        .await;
    assert!(all.is_ok(), "{all:?}");
    let start = rig.ask(Command::Start).await;
    assert!(
        matches!(&start, Err(Error::FailedPrecondition(m)) if m.contains("killed before it started")),
        "{start:?}"
    );
    let deleted = rig.ask(Command::Delete).await.expect("delete");
    assert_eq!((deleted.pid, deleted.status), (created, 128 + 15));
    assert_eq!(
        rig.host.calls(),
        [
            Call::Create(S0),
            Call::EndCreated(S0),
            Call::Remove(S0),
            Call::Remove(S1)
        ]
    );
    assert!(rig.host.signals().is_empty(), "nothing ran to signal");
    // The supervisor is gone with the pair: nothing answers any more.
    let gone = within(|| rig.handle.commands.is_closed().then_some(())).await;
    assert!(gone.is_some(), "the supervisor outlived its Delete");
}

/// Delete of a running pair is refused; once the pair is gone it removes
/// the engines, and the pair stopped listening when it ended.
#[tokio::test(start_paused = true)]
async fn delete_waits_for_the_pairs_end_and_the_pair_stops_listening_when_it_ends() {
    let rig = Rig::serving().await;
    let [active, shadow] = rig.pids();
    assert_eq!(
        rig.host.calls(),
        [Call::Create(S0), Call::Start(S0), Call::Run(S1)],
        "the created engine is started, the other run"
    );
    let refused = rig.ask(Command::Delete).await;
    assert!(
        matches!(&refused, Err(Error::FailedPrecondition(m)) if m.contains("still running")),
        "{refused:?}"
    );
    assert!(rig.host.state().listening);
    rig.kill(9).await;
    rig.host.reap(active, 137, Instant::now());
    rig.host.reap(shadow, 137, Instant::now());
    let exit = rig.exit().await;
    assert_eq!(exit.status, 137);
    assert!(!rig.host.state().listening, "the sockets outlived the pair");
    let deleted = rig.ask(Command::Delete).await.expect("delete");
    assert_eq!(deleted, exit);
    assert_eq!(
        rig.host.calls()[3..],
        [Call::Remove(S0), Call::Remove(S1)],
        "{:?}",
        rig.host.calls()
    );
}

/// A datagram the gate looked up before a slot's respawn (its pid the
/// dead engine's) is not the respawn's: it is looked up again, and a dead
/// pid is nobody's. The same words from the respawn count.
#[tokio::test(start_paused = true)]
async fn a_gate_lookup_older_than_the_respawn_is_not_credited_to_it() {
    let rig = Rig::serving().await;
    let [old, shadow] = rig.pids();
    let looked_up = Instant::now();
    rig.host.reap(old, 137, Instant::now());
    rig.ready(shadow);
    let st = rig
        .until("respawned", |s| {
            s.pair.slots[0].generation == 2 && s.pids[0].is_some()
        })
        .await;
    assert!(!st.pair.protected);
    let stale = Input::Notify {
        datagram: Datagram::new(old, b"STATUS=parked".to_vec()),
        at: Instant::now(),
        slot: SenderSlot {
            slot: S0,
            looked_up,
        },
    };
    let _ = rig.handle.input.send(stale).await;
    // Inputs are taken in order: once the respawn's own READY=1 (refused:
    // it does not hold the lock) is counted, the stale words were taken,
    // and they changed nothing.
    let respawn = st.pids[0].unwrap_or(0);
    rig.say(respawn, "READY=1");
    let taken = within(|| (rig.refused() == 1).then_some(())).await;
    assert!(taken.is_some(), "refused: {}", rig.refused());
    let st = rig.state().expect("state.json");
    assert!(!st.pair.protected, "{st:#?}");
    assert_eq!(st.pair.slots[0].state, EngineState::Starting, "{st:#?}");
    rig.say(respawn, "STATUS=parked");
    rig.until("protected by the respawn", |s| s.pair.protected)
        .await;
}

/// [`Rig::serving`] with a 100 ms watchdog.
async fn watched() -> Rig {
    Rig::serving_with(Hang {
        watchdog: Some(Duration::from_millis(100)),
        probe: None,
        start_timeout: Duration::from_secs(5),
    })
    .await
}

/// The serving engine pings every 50 ms and then stops (SIGSTOP): the
/// supervisor kills every process of it past the interval, on its own
/// clock, and the shadow's READY=1 completes a promotion that starts at
/// the hang's detection.
#[tokio::test(start_paused = true)]
async fn a_silent_watchdog_ends_the_serving_engine_and_the_shadow_takes_over() {
    let rig = watched().await;
    let [active, shadow] = rig.pids();
    let started = Instant::now();
    for _ in 0..10 {
        rig.say(active, "WATCHDOG=1");
        rig.say(shadow, "WATCHDOG=1");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        !rig.host.calls().contains(&Call::KillEngine(S0)),
        "pinged: alive"
    );
    // The active stops pinging; the shadow goes on.
    let stopped = Instant::now();
    let mut killed_after = None;
    for _ in 0..6 {
        rig.say(shadow, "WATCHDOG=1");
        tokio::time::sleep(Duration::from_millis(25)).await;
        if killed_after.is_none() && rig.host.calls().contains(&Call::KillEngine(S0)) {
            killed_after = Some(stopped.elapsed());
        }
    }
    let after = killed_after.expect("the silent engine is killed");
    // Its last ping was 50 ms before it stopped: expiry 50 ms after.
    assert!(after <= Duration::from_millis(75), "{after:?}");
    assert!(!rig.host.calls().contains(&Call::KillEngine(S1)));
    assert!(rig.host.signals().contains(&(active, Signal::SIGKILL)));
    // The kernel drops its lock: the shadow serves, then the reap.
    rig.ready(shadow);
    rig.host.reap(active, 137, Instant::now());
    let st = rig.until("promoted", |s| !s.promotions.is_empty()).await;
    let p = &st.promotions[0].promotion;
    assert_eq!(p.class, shadow_contract::state::FailureClass::Hung);
    assert_eq!(p.death_seen, DeathSign::Hang);
    let hang = p.hang.expect("a hang");
    assert_eq!(hang.cause, shadow_contract::state::HangCause::Watchdog);
    assert!(hang.killed_at.is_some_and(|k| k >= hang.detected_at));
    assert_eq!(p.death_at, hang.detected_at);
    assert_eq!(st.pair.hangs.watchdog, 1);
    assert_eq!(
        st.pair.slots[0].last_hang,
        Some(shadow_contract::state::HangCause::Watchdog)
    );
    assert!(started.elapsed() < LIMIT);
}

/// `WATCHDOG=trigger` ends the engine at once, whatever its watchdog's
/// time; the other engine is left alone.
#[tokio::test(start_paused = true)]
async fn a_trigger_ends_the_engine_at_once() {
    let rig = watched().await;
    let [active, shadow] = rig.pids();
    rig.say(active, "WATCHDOG=1");
    rig.say(shadow, "WATCHDOG=1");
    tokio::time::sleep(Duration::from_millis(10)).await;
    let sent = Instant::now();
    rig.say(shadow, "WATCHDOG=trigger");
    let killed = within(|| {
        rig.host
            .calls()
            .contains(&Call::KillEngine(S1))
            .then_some(())
    })
    .await;
    assert!(killed.is_some(), "{:?}", rig.host.calls());
    assert!(
        sent.elapsed() < Duration::from_millis(10),
        "{:?}",
        sent.elapsed()
    );
    assert!(!rig.host.calls().contains(&Call::KillEngine(S0)));
    // The shadow's death is a hang; the active keeps serving.
    rig.host.reap(shadow, 137, Instant::now());
    let st = rig
        .until("respawned", |s| s.pair.slots[1].generation == 2)
        .await;
    assert_eq!(st.pair.active, Some(0));
    assert_eq!(st.pair.hangs.trigger, 1);
    assert!(st.promotions.is_empty(), "no failover");
}

/// An engine that speaks sd_notify but parks without saying so is seen
/// parked through `/proc/locks`, however often the watchdog's pings wake
/// the supervisor (each input restarts its wait: the poll is timed from
/// the last poll, or it would never come).
#[tokio::test(start_paused = true)]
async fn pings_every_few_ms_never_put_the_lock_poll_off() {
    let rig = Rig::created_with(Hang {
        watchdog: Some(Duration::from_millis(100)),
        probe: None,
        start_timeout: Duration::from_secs(5),
    })
    .await;
    rig.ask(Command::Start).await.expect("start");
    let [active, shadow] = rig.pids();
    rig.ready(active);
    rig.say(shadow, "STATUS=parked engine 1");
    rig.host.state().lock_waiters[1] = true;
    let mut protected = false;
    for _ in 0..80 {
        rig.say(active, "WATCHDOG=1");
        rig.say(shadow, "WATCHDOG=1");
        tokio::time::sleep(Duration::from_millis(12)).await;
        if rig.state().is_some_and(|s| s.pair.protected) {
            protected = true;
            break;
        }
    }
    assert!(protected, "{:#?}", rig.state());
}

#[tokio::test(start_paused = true)]
async fn connections_move_at_the_new_holders_fetch_and_the_old_ones_late_news_takes_nothing() {
    let rig = Rig::serving().await;
    let [old, shadow] = rig.pids();
    let conns = rig.host.1.clone();
    // Accepted connections go to the active engine (its READY believed).
    within(|| (conns.to() == Some(S0)).then_some(())).await;
    assert_eq!(conns.to(), Some(S0));
    // It dies; its lock file closes, and its pid is seen holding nothing:
    // connections wait in the store from then on.
    let died = Instant::now();
    rig.host.state().holder = None;
    let _ = rig.handle.input.try_send(Input::LockClosed(died));
    within(|| conns.to().is_none().then_some(())).await;
    assert_eq!(conns.to(), None, "no hand-off into a dead engine");
    // The shadow takes the lock and its fetch is answered before the
    // supervisor hears of anything: they are its at once.
    tokio::time::sleep(Duration::from_millis(2)).await;
    rig.host.state().holder = Some(S1);
    conns.fetch_answered(S1).await;
    assert_eq!(conns.to(), Some(S1));
    // Its READY=1, then the old engine's reap, late: nothing moves.
    rig.ready(shadow);
    rig.host.reap(old, 137, died);
    rig.until("promotion", |s| s.pair.failovers == 1).await;
    assert_eq!(conns.to(), Some(S1));
    // The respawn of slot 0 is handed nothing: it has proven nothing.
    within(|| (rig.pids()[0] != old && rig.pids()[0] != 0).then_some(())).await;
    assert_eq!(conns.to(), Some(S1));
}

#[tokio::test(start_paused = true)]
async fn a_ready_before_the_fetch_moves_connections_and_a_respawn_is_handed_nothing() {
    let rig = Rig::serving().await;
    let [old, shadow] = rig.pids();
    let conns = rig.host.1.clone();
    within(|| (conns.to() == Some(S0)).then_some(())).await;
    // SIGKILL: the READY=1 of the shadow comes first (no lock close seen).
    let died = Instant::now();
    rig.ready(shadow);
    within(|| (conns.to() == Some(S1)).then_some(())).await;
    assert_eq!(conns.to(), Some(S1));
    rig.host.reap(old, 137, died);
    rig.until("promotion", |s| s.pair.failovers == 1).await;
    // Slot 0 respawns: another engine (its own serial), handed nothing.
    within(|| (rig.pids()[0] != old && rig.pids()[0] != 0).then_some(())).await;
    let fresh = conns.recipient(S0).expect("the respawn's ends");
    assert_eq!(fresh.serial, u64::from(rig.pids()[0]));
    assert_eq!(conns.to(), Some(S1));
}

/// With the runtime accepting, a `READY=1` is proof at once when its
/// sender holds the lock through its own descriptors: the promoted engine
/// is handed connections before its fetch and before the supervisor
/// believes it. From a process that does not hold the lock, or from
/// another slot's engine, it proves nothing.
#[test]
fn a_ready_from_the_lock_holder_is_proof_at_once_and_from_anyone_else_nothing() {
    let host = FakeHost::default();
    let p0 = host.new_pid(S0);
    let p1 = host.new_pid(S1);
    host.state().holder = Some(S1);
    let h = host.1.clone();
    super::observe::prove_ready(h.as_ref(), &host, S0, p0, Instant::now());
    assert_eq!(h.to(), None, "slot 0 does not hold the lock");
    super::observe::prove_ready(h.as_ref(), &host, S0, p1, Instant::now());
    assert_eq!(h.to(), None, "slot 1's process on slot 0's socket");
    super::observe::prove_ready(h.as_ref(), &host, S1, p1, Instant::now());
    assert_eq!(h.to(), Some(S1));
    // Slot 1 dies and respawns: the new engine proves itself again.
    h.died(S1);
    assert_eq!(h.to(), None);
    let p2 = host.new_pid(S1);
    super::observe::prove_ready(h.as_ref(), &host, S1, p2, Instant::now());
    assert_eq!(h.to(), Some(S1));
}
