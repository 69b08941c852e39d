//! More than one shadow (`shadow.dev/shadows=N`) through real containerd
//! and runc: N + 1 engines, whichever holds the lock serves, every dead
//! slot is started again, and the pair is protected while one shadow is
//! parked. The figure: kills of whoever serves, 20 ms apart, each
//! recovered in about one failover's time with enough shadows, against a
//! pair of one shadow in the same run, whose second kill waits for a
//! respawn.

use shadow_contract::state::{EngineState, PairState};
use shadow_tests::pair::{ask, free_port, until, PairEnv};
use shadow_tests::{Containerd, Spawned};
use std::path::Path;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const ENGINE: &str = env!("CARGO_BIN_EXE_test-engine");
const LONG: Duration = Duration::from_secs(30);
const STEP: Duration = Duration::from_millis(1);
/// Between two kills of a burst.
const APART: Duration = Duration::from_millis(20);

fn kill(pid: u32) {
    // SAFETY: kill(2) with a pid read from the pair's state.
    let rc = unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    assert_eq!(rc, 0, "kill {pid}: {}", std::io::Error::last_os_error());
}

fn unix_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_micros() as u64
}

struct Pair {
    env: PairEnv,
    id: String,
    port: u16,
    ctr: Option<Spawned>,
}

impl Pair {
    fn start(cd: &Containerd, id: &str, shadows: Option<&str>) -> Pair {
        PairEnv::install_engine(cd, Path::new(ENGINE)).expect("install engine");
        let env = PairEnv::new(cd, "gms = \"off\"").expect("config");
        let port = free_port();
        let port_s = port.to_string();
        let annotations: Vec<(&str, &str)> = shadows
            .map(|n| (shadow_contract::annotations::SHADOWS, n))
            .into_iter()
            .collect();
        let ctr = env
            .run(
                cd,
                id,
                &annotations,
                &["--rm", "--net-host"],
                &["/bin/test-engine", "--port", &port_s],
            )
            .expect("ctr run");
        Pair {
            env,
            id: id.to_string(),
            port,
            ctr: Some(ctr),
        }
    }

    fn state(&self, cd: &Containerd) -> Option<PairState> {
        self.env.state(cd, &self.id)
    }

    /// Every shadow parked behind the active, every pid known.
    fn wait_all_parked(&self, cd: &Containerd) -> PairState {
        let deadline = Instant::now() + LONG;
        loop {
            let st = self.state(cd);
            if let Some(s) = st.as_ref().filter(|s| {
                s.pair.protected
                    && s.pair.shadows_parked == s.pair.shadows
                    && s.pids.iter().all(Option::is_some)
            }) {
                return s.clone();
            }
            assert!(
                Instant::now() < deadline,
                "pair {}: not every shadow parked within {LONG:?}; last state {st:#?}",
                self.id
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// SIGKILLs whoever serves `kills` times, `APART` after each other (the
    /// next one as soon as a new engine serves, if that is later), and
    /// returns each kill's time (µs since the epoch) and slot.
    fn burst(&self, cd: &Containerd, kills: usize) -> Vec<(u64, u8)> {
        let mut times = Vec::new();
        let mut dead = Vec::new();
        let mut last = Instant::now() - APART;
        for k in 0..kills {
            let (slot, pid) = until(&format!("kill {k}: someone serves"), LONG, STEP, || {
                let s = self.state(cd)?;
                let slot = s.pair.active?;
                let pid = s.pid_of(slot)?;
                let serving = s.pair.slots[usize::from(slot)].state == EngineState::Active;
                (serving && !dead.contains(&pid)).then_some((slot, pid))
            });
            let due = last + APART;
            std::thread::sleep(due.saturating_duration_since(Instant::now()));
            last = Instant::now();
            times.push((unix_us(), slot));
            kill(pid);
            dead.push(pid);
            eprintln!("pair {}: kill {k}: slot {slot} pid {pid}", self.id);
        }
        times
    }

    /// For each kill, ms from it to the `READY=1` of the engine that took
    /// over (the promotion that ended the killed engine's service), and
    /// that engine's slot.
    fn recoveries(&self, cd: &Containerd, kills: &[(u64, u8)], before: u64) -> Vec<(f64, u8)> {
        let want = before + kills.len() as u64;
        let st = until(
            "every kill's promotion recorded",
            LONG,
            Duration::from_millis(5),
            || self.state(cd).filter(|s| s.pair.failovers >= want),
        );
        // A failover is numbered when it completes: one whose old engine
        // was reaped late may come after the next. Each kill's is the one
        // from its slot dated at or after it.
        kills
            .iter()
            .map(|(at, slot)| {
                let p = st
                    .promotions
                    .iter()
                    .filter(|p| p.promotion.number > before)
                    .find(|p| p.promotion.from == *slot && p.death_unix_us >= *at)
                    .unwrap_or_else(|| {
                        panic!(
                            "no promotion from slot {slot} after {at}: {:#?}",
                            st.promotions
                        )
                    });
                let ready = p
                    .ready_unix_us
                    .or(p.lock_unix_us)
                    .unwrap_or_else(|| panic!("no READY=1 nor lock in {p:#?}"));
                let to = p.promotion.to.expect("a successor");
                (ready.saturating_sub(*at) as f64 / 1e3, to)
            })
            .collect()
    }

    /// Kills the task; ctr run ends with a failure, and the pair's
    /// directory goes. What is left of containerd's is checked once every
    /// pair of the test has stopped ([`stop_all`]).
    fn stop(mut self, cd: &Containerd) {
        cd.ctr()
            .run(&["task", "kill", "--signal", "SIGKILL", &self.id])
            .expect("ctr task kill")
            .assert_success();
        let out = self
            .ctr
            .take()
            .expect("ctr")
            .wait(LONG)
            .expect("ctr run ends");
        assert_ne!(out.code(), 0, "{out}");
        let dir = self.env.pair_dir(cd, &self.id);
        until(
            "the pair directory removed",
            LONG,
            Duration::from_millis(5),
            || (!dir.exists()).then_some(()),
        );
    }
}

/// Stops every pair, then checks that nothing of any is left.
fn stop_all(cd: &Containerd, pairs: Vec<Pair>) {
    for p in pairs {
        p.stop(cd);
    }
    cd.assert_no_leftovers();
}

fn show(what: &str, r: &[(f64, u8)]) -> String {
    let parts: Vec<String> = r.iter().map(|(ms, _)| format!("{ms:.1}")).collect();
    format!("{what}: [{}] ms", parts.join(", "))
}

/// Whether kill `k`'s successor was parked before the burst began: a slot
/// no kill of the burst up to this one had emptied (an emptied slot comes
/// back only through a respawn).
fn found_a_parked_shadow(kills: &[(u64, u8)], r: &[(f64, u8)], k: usize) -> bool {
    !kills[..=k].iter().any(|(_, slot)| *slot == r[k].1)
}

/// Two kills 20 ms apart with two shadows and three with three: each one
/// recovered by a parked shadow in about one failover's time. The same
/// two kills on a pair of one shadow: the second waits for the first
/// one's slot to be started again and park.
#[test]
fn kills_20_ms_apart_each_find_a_parked_shadow_when_the_pair_has_enough() {
    let cd = Containerd::start().expect("containerd");
    let one = Pair::start(&cd, "shadows1", None);
    let two = Pair::start(&cd, "shadows2", Some("2"));
    let three = Pair::start(&cd, "shadows3", Some("3"));

    let st = one.wait_all_parked(&cd);
    assert_eq!((st.pair.shadows, st.pids.len()), (1, 2));
    let st = two.wait_all_parked(&cd);
    assert_eq!(
        (st.pair.shadows, st.pids.len(), st.runc_ids.len()),
        (2, 3, 3)
    );
    // The metrics file is written after state.json: wait for it too.
    until(
        "the metric of parked shadows",
        LONG,
        Duration::from_millis(5),
        || {
            (two.env
                .metric(&cd, "shadows2", "shadow_pair_shadows_parked", "")
                == Some(2.0))
            .then_some(())
        },
    );
    let st = three.wait_all_parked(&cd);
    assert_eq!((st.pair.shadows, st.pids.len()), (3, 4));
    // SHADOW_ENGINE_ID runs 0 ..= N: every slot has served or parked
    // under its own id, one engine each.
    let slots: Vec<u8> = st.pair.slots.iter().map(|s| s.id).collect();
    assert_eq!(slots, vec![0, 1, 2, 3]);

    // One burst at a time, each after every engine of the others has
    // parked again: a burst's respawns take the machine's CPUs.
    let k1 = one.burst(&cd, 2);
    one.wait_all_parked(&cd);
    let k2 = two.burst(&cd, 2);
    two.wait_all_parked(&cd);
    let k3 = three.burst(&cd, 3);
    let r1 = one.recoveries(&cd, &k1, 0);
    let r2 = two.recoveries(&cd, &k2, 0);
    let r3 = three.recoveries(&cd, &k3, 0);
    eprintln!(
        "FIGURE {}",
        show(
            "shadows=1, 2 kills 20 ms apart: kill -> READY=1 of the next",
            &r1
        )
    );
    eprintln!(
        "FIGURE {}",
        show(
            "shadows=2, 2 kills 20 ms apart: kill -> READY=1 of the next",
            &r2
        )
    );
    eprintln!(
        "FIGURE {}",
        show(
            "shadows=3, 3 kills 20 ms apart: kill -> READY=1 of the next",
            &r3
        )
    );
    // With enough shadows each kill's successor was parked before the
    // burst; with one, the second kill's successor is the first kill's
    // slot, started again.
    for (what, kills, r) in [("shadows=2", &k2, &r2), ("shadows=3", &k3, &r3)] {
        for k in 0..kills.len() {
            assert!(
                found_a_parked_shadow(kills, r, k),
                "{what}, kill {k}: slot {} took over, which an earlier kill emptied: kills {kills:?}, successors {r:?}",
                r[k].1
            );
        }
    }
    assert!(found_a_parked_shadow(&k1, &r1, 0));
    assert!(
        !found_a_parked_shadow(&k1, &r1, 1),
        "with one shadow the second kill's successor is a respawn: kills {k1:?}, successors {r1:?}"
    );

    // Every dead slot comes back: all shadows parked again, and the engine
    // that answers is the one the state names active.
    for p in [&one, &two, &three] {
        let st = p.wait_all_parked(&cd);
        let a = until("an answer", LONG, STEP, || ask(p.port));
        assert_eq!(
            Some(a.slot.clone()),
            st.pair.active.map(|s| s.to_string()),
            "{st:#?}"
        );
    }
    stop_all(&cd, vec![one, two, three]);
}

/// Bad values fail Create and leave nothing; `shadow.dev/shadow=false`
/// with shadows contradicts itself.
#[test]
fn shadows_out_of_range_or_contradicted_fail_create() {
    let cd = Containerd::start().expect("containerd");
    PairEnv::install_engine(&cd, Path::new(ENGINE)).expect("install engine");
    let env = PairEnv::new(&cd, "gms = \"off\"").expect("config");
    let shadows = shadow_contract::annotations::SHADOWS;
    let shadow = shadow_contract::annotations::SHADOW;
    for (i, (annotations, says)) in [
        (vec![(shadows, "0")], "1 to 3"),
        (vec![(shadows, "4")], "1 to 3"),
        (vec![(shadows, "2"), (shadow, "false")], "contradict"),
    ]
    .into_iter()
    .enumerate()
    {
        let id = format!("bad{i}");
        let ctr = env
            .run(
                &cd,
                &id,
                &annotations,
                &["--rm", "--net-host"],
                &["/bin/test-engine"],
            )
            .expect("ctr run");
        let out = ctr.wait(LONG).expect("ctr run ends");
        assert_ne!(out.code(), 0, "{out}");
        assert!(out.to_string().contains(says), "{annotations:?}: {out}");
        cd.assert_no_leftovers();
        assert!(!env.pair_dir(&cd, &id).exists(), "pair dir left");
    }
}
