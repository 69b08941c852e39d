//! The pair's fd store through containerd: what an engine stores outlives
//! it. `test-engine --memo` keeps a counter in a memfd it stores; each
//! engine that becomes active takes it from the store (fetched right after
//! the lock, or inherited at its start) and adds one. Through SIGKILLs of
//! the serving engine the counter goes on, in a pair (the promoted shadow
//! fetches it) and for a single engine restarted in place (it gets the
//! store in `LISTEN_FDS`, as systemd hands a restarted service its store).

use std::io::Read;
use std::net::TcpStream;
use std::path::Path;
use std::time::Duration;

use shadow_contract::annotations::{LISTEN, SHADOW};
use shadow_contract::state::PairState;
use shadow_tests::pair::{free_port, PairEnv};
use shadow_tests::wait::until;
use shadow_tests::{Containerd, Spawned};

const ENGINE: &str = env!("CARGO_BIN_EXE_test-engine");
const LONG: Duration = Duration::from_secs(30);
const STEP: Duration = Duration::from_millis(5);

fn gmsd() -> String {
    let p = Path::new(ENGINE).with_file_name("gmsd");
    assert!(p.is_file(), "{} missing: cargo build -p gmsd", p.display());
    p.display().to_string()
}

/// The memo part of an answer: (slot, memo, memo_from, inherited).
fn memo(port: u16) -> Option<(String, u64, String, usize)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let get = |k: &str| {
        text.split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{k}=")).map(str::to_owned))
    };
    Some((
        get("slot")?,
        get("memo")?.parse().ok()?,
        get("memo_from")?,
        get("inherited")?.parse().ok()?,
    ))
}

fn kill(pid: u32) {
    // SAFETY: kill(2) with a pid read from the pair's state a moment ago.
    let rc = unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    assert_eq!(rc, 0, "kill {pid}: {}", std::io::Error::last_os_error());
}

fn active_pid(st: &PairState) -> Option<u32> {
    st.pid_of(st.pair.active?)
}

struct Run {
    env: PairEnv,
    ctr: Spawned,
    port: u16,
}

fn start(cd: &Containerd, id: &str, extra: &[(&str, &str)]) -> Run {
    let env = PairEnv::new(cd, &format!("gmsd = \"{}\"\ngms = \"host\"", gmsd())).expect("config");
    let port = free_port();
    let listen = format!("tcp:127.0.0.1:{port}");
    let mut annotations = vec![(LISTEN, listen.as_str())];
    annotations.extend_from_slice(extra);
    let ctr = env
        .run(
            cd,
            id,
            &annotations,
            &["--rm", "--net-host"],
            &["/bin/test-engine", "--memo"],
        )
        .expect("ctr run");
    Run { env, ctr, port }
}

impl Run {
    /// Waits for an answer whose memo is `want` (a new engine serves).
    fn memo_is(&self, want: u64) -> (String, u64, String, usize) {
        until(&format!("an answer with memo={want}"), LONG, STEP, || {
            memo(self.port).filter(|m| m.1 == want)
        })
    }

    fn stop(self, cd: &Containerd, id: &str) {
        cd.ctr()
            .run(&["task", "kill", "-s", "SIGKILL", id])
            .expect("ctr task kill")
            .assert_success();
        self.ctr.wait(LONG).expect("ctr run ends");
        cd.assert_no_leftovers();
        assert!(!self.env.pair_dir(cd, id).exists(), "pair dir left");
    }
}

/// In a pair every promoted shadow fetches the memo, three failovers in a
/// row; the store holds that one memfd all along and says how often it was
/// fetched; what the respawned shadows inherited at their start is the
/// store too.
#[test]
fn what_an_engine_stores_outlives_it_through_failovers() {
    let cd = Containerd::start().expect("containerd");
    PairEnv::install_engine(&cd, Path::new(ENGINE)).expect("install engine");
    let id = "memo";
    let run = start(&cd, id, &[]);
    run.env.wait_protected(&cd, id, LONG);
    let first = run.memo_is(1);
    assert_eq!(
        first.2, "new",
        "the first engine found an empty store: {first:?}"
    );
    let mut killed = 0;
    for round in 2..=4u64 {
        // state.json may still show the engine killed last, until its reap.
        let st = until("protected by a new active", LONG, STEP, || {
            run.env
                .state(&cd, id)
                .filter(|s| s.pair.protected && active_pid(s).is_some_and(|p| p != killed))
        });
        killed = active_pid(&st).expect("an active engine");
        kill(killed);
        let m = run.memo_is(round);
        assert_eq!(m.2, "fetched", "round {round}: {m:?}");
        eprintln!(
            "failover {}: slot {} serves memo={} (inherited {} at its start)",
            round - 1,
            m.0,
            m.1,
            m.3
        );
        if round >= 3 {
            // Slot of the first kill, respawned while the memo was stored.
            assert!(
                m.3 >= 1,
                "a shadow respawned after the memo inherited it: {m:?}"
            );
        }
    }
    // Four fetches (one per engine that served), three of them the memo.
    let f = until("the store's figures", LONG, STEP, || {
        run.env
            .state(&cd, id)
            .and_then(|s| s.fdstore)
            .filter(|f| f.fetches >= 4)
    });
    assert_eq!((f.fds, f.stored, f.fetched), (1, 1, 3), "{f:#?}");
    assert_eq!(f.fetches_refused, 0, "{f:#?}");
    run.stop(&cd, id);
}

/// A single engine restarted in place: it gets the store at its start,
/// after the listening socket, and fetches the same (it holds the lock).
#[test]
fn a_single_engine_restarted_in_place_gets_the_store_at_its_start() {
    let cd = Containerd::start().expect("containerd");
    PairEnv::install_engine(&cd, Path::new(ENGINE)).expect("install engine");
    let id = "memo1";
    let run = start(&cd, id, &[(SHADOW, "false")]);
    let first = run.memo_is(1);
    assert_eq!(
        first.3, 0,
        "nothing stored before the first start: {first:?}"
    );
    let mut killed = 0;
    for round in 2..=3u64 {
        let st = until("the engine serving", LONG, STEP, || {
            run.env
                .state(&cd, id)
                .filter(|s| active_pid(s).is_some_and(|p| p != killed))
        });
        killed = active_pid(&st).expect("an active engine");
        kill(killed);
        let m = run.memo_is(round);
        assert_eq!(m.3, 1, "the restarted engine inherited the memo: {m:?}");
    }
    run.stop(&cd, id);
}
