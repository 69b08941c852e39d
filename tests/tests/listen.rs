//! `shadow.dev/listen`: the pair owns the listening socket and hands it to
//! every engine (`LISTEN_FDS`), so a client that connects while nobody is
//! active waits in the backlog instead of being refused. A client opens a
//! new connection every millisecond through SIGKILLs of the active engine;
//! the same client against a pair whose engines bind their own port, and
//! against a runc-v2 container restarted after its SIGKILL, shows what the
//! socket removes.

use std::io::Read;
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use shadow_contract::annotations::{ACCEPT, FDSTORE_MAX, LISTEN};
use shadow_contract::state::PairState;
use shadow_tests::pair::{ask, free_port, task_pid, PairEnv};
use shadow_tests::wait::until;
use shadow_tests::{Containerd, Runtime, Spawned};

const ENGINE: &str = env!("CARGO_BIN_EXE_test-engine");
const LONG: Duration = Duration::from_secs(30);
const STEP: Duration = Duration::from_millis(2);

fn kill(pid: u32) {
    // SAFETY: kill(2) with a pid read from the pair's state a moment ago.
    let rc = unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    assert_eq!(rc, 0, "kill {pid}: {}", std::io::Error::last_os_error());
}

fn gmsd() -> String {
    let p = Path::new(ENGINE).with_file_name("gmsd");
    assert!(p.is_file(), "{} missing: cargo build -p gmsd", p.display());
    p.display().to_string()
}

/// What the client saw, by kind.
#[derive(Debug, Default)]
struct Tally {
    ok: usize,
    /// connect(2) refused: nobody listened.
    refused: usize,
    /// Connected, then reset or closed without an answer: lost in flight.
    reset_in_flight: usize,
    timeouts: usize,
    /// Answers that are not what an engine of this pair must say (the
    /// first few, and how many).
    wrong: Vec<String>,
    wrong_count: usize,
}

enum Outcome {
    Answer(String),
    Refused,
    Reset,
    Timeout,
}

fn attempt(port: u16) -> Outcome {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let mut s = match TcpStream::connect_timeout(&addr, Duration::from_secs(5)) {
        Ok(s) => s,
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => return Outcome::Refused,
        Err(_) => return Outcome::Timeout,
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let mut text = String::new();
    match s.read_to_string(&mut text) {
        // Closed before the whole line: the engine died while answering.
        Ok(_) if !text.ends_with('\n') => Outcome::Reset,
        Ok(_) => Outcome::Answer(text),
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            Outcome::Timeout
        }
        Err(_) => Outcome::Reset,
    }
}

/// How far the client has got, for the test to wait on while it runs.
#[derive(Default)]
struct Progress {
    /// Connections started so far; the next one is number `started`.
    started: AtomicU32,
    /// 1 + the number of the latest-started connection that was answered
    /// (0: none yet).
    answered: AtomicU32,
}

impl Progress {
    /// Wait until a connection the client starts from now on is answered.
    fn next_answer(&self, what: &str) {
        let mark = self.started.load(Ordering::Acquire);
        until(what, LONG, STEP, || {
            (self.answered.load(Ordering::Acquire) > mark).then_some(())
        });
    }
}

/// Sets the flag when dropped: a failed wait stops the client too, so the
/// panic is not held up by a client that never ends.
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// A new connection every millisecond (open loop: each on its own thread)
/// until `stop`, counted in `progress`; `good` judges each answer.
fn client(
    port: u16,
    stop: &AtomicBool,
    progress: &Progress,
    good: &(dyn Fn(&str) -> bool + Sync),
) -> Tally {
    let (tx, rx) = mpsc::channel();
    std::thread::scope(|s| {
        let start = Instant::now();
        let mut i = 0u32;
        while !stop.load(Ordering::Acquire) {
            let due = start + Duration::from_millis(u64::from(i));
            std::thread::sleep(due.saturating_duration_since(Instant::now()));
            let tx = tx.clone();
            progress.started.store(i + 1, Ordering::Release);
            s.spawn(move || {
                let o = attempt(port);
                if matches!(o, Outcome::Answer(_)) {
                    progress.answered.fetch_max(i + 1, Ordering::AcqRel);
                }
                let _ = tx.send(o);
            });
            i += 1;
        }
    });
    drop(tx);
    let mut t = Tally::default();
    for o in rx {
        match o {
            Outcome::Answer(a) if good(&a) => t.ok += 1,
            Outcome::Answer(a) => {
                t.wrong_count += 1;
                if t.wrong.len() < 3 {
                    t.wrong.push(a);
                }
            }
            Outcome::Refused => t.refused += 1,
            Outcome::Reset => t.reset_in_flight += 1,
            Outcome::Timeout => t.timeouts += 1,
        }
    }
    t
}

/// Runs `client` while `drive` does its work, from an answer the client
/// got before it to one the client got after it; returns what it saw.
fn under_load(
    port: u16,
    good: &(dyn Fn(&str) -> bool + Sync),
    drive: impl FnOnce(&Progress),
) -> Tally {
    let stop = AtomicBool::new(false);
    let progress = Progress::default();
    std::thread::scope(|s| {
        let c = s.spawn(|| client(port, &stop, &progress, good));
        let stopper = StopOnDrop(&stop);
        progress.next_answer("the client's first answer, before the drive");
        drive(&progress);
        progress.next_answer("an answer to the client after the drive");
        drop(stopper);
        c.join().expect("client thread")
    })
}

fn active(st: &PairState) -> Option<(usize, u32)> {
    let slot = st.pair.active?;
    Some((usize::from(slot), st.pid_of(slot)?))
}

/// SIGKILL the active engine `rounds` times, each time once the pair is
/// protected again (a new active, a parked shadow) and the client has had
/// an answer since.
fn kill_active(env: &PairEnv, cd: &Containerd, id: &str, rounds: usize, client: &Progress) {
    for _ in 0..rounds {
        let st = env.wait_protected(cd, id, LONG);
        let (slot, pid) = active(&st).expect("an active engine");
        kill(pid);
        until(
            "the other engine active, a shadow parked",
            LONG,
            STEP,
            || {
                env.state(cd, id)
                    .filter(|s| s.pair.protected && active(s).is_some_and(|(a, _)| a != slot))
            },
        );
        client.next_answer("an answer to the client after the failover");
    }
}

struct Pair {
    env: PairEnv,
    ctr: Spawned,
}

fn start_pair(cd: &Containerd, id: &str, port: u16, listen: bool) -> Pair {
    start_pair_with(cd, id, port, listen, &[], &[])
}

/// A pair of test engines, with `more` annotations and `args` for the
/// engine beyond its port.
fn start_pair_with(
    cd: &Containerd,
    id: &str,
    port: u16,
    listen: bool,
    more: &[(&str, &str)],
    args: &[&str],
) -> Pair {
    let env = PairEnv::new(cd, &format!("gmsd = \"{}\"\ngms = \"host\"", gmsd())).expect("config");
    let value = format!("tcp:127.0.0.1:{port}");
    let mut annotations: Vec<(&str, &str)> = if listen {
        vec![(LISTEN, value.as_str())]
    } else {
        vec![]
    };
    annotations.extend_from_slice(more);
    let port_s = port.to_string();
    let mut cmd = vec!["/bin/test-engine", "--port", &port_s];
    cmd.extend_from_slice(args);
    let ctr = env
        .run(cd, id, &annotations, &["--rm", "--net-host"], &cmd)
        .expect("ctr run");
    Pair { env, ctr }
}

impl Pair {
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

/// An answer of an engine of this pair: its slots, its weights, the
/// socket kind.
fn judge(
    slots: &'static [&'static str],
    weights: String,
    kind: &'static str,
) -> impl Fn(&str) -> bool + Sync {
    move |a: &str| {
        a.contains(&format!("weights={weights} "))
            && a.trim_end().ends_with(&format!("listen={kind}"))
            && slots.iter().any(|s| a.starts_with(&format!("slot={s} ")))
    }
}

const PAIR_SLOTS: &[&str] = &["0", "1"];

#[test]
fn with_the_pairs_socket_no_connection_is_refused_through_sigkills() {
    let cd = Containerd::start().expect("containerd");
    PairEnv::install_engine(&cd, Path::new(ENGINE)).expect("install engine");

    // The pair owns the socket: zero refused, every answer right.
    let (id, port) = ("listen", free_port());
    let p = start_pair(&cd, id, port, true);
    p.env.wait_protected(&cd, id, LONG);
    let first = until("an answer", LONG, STEP, || ask(port));
    let good = judge(PAIR_SLOTS, first.weights.clone(), "inherited");
    let with = under_load(port, &good, |c| kill_active(&p.env, &cd, id, 4, c));
    p.stop(&cd, id);
    // The socket is gone with the pair.
    assert!(matches!(attempt(port), Outcome::Refused));

    // Engines that bind their own port: the same kills.
    let (id, port) = ("ownport", free_port());
    let p = start_pair(&cd, id, port, false);
    p.env.wait_protected(&cd, id, LONG);
    let first = until("an answer", LONG, STEP, || ask(port));
    let good = judge(PAIR_SLOTS, first.weights.clone(), "own");
    let own = under_load(port, &good, |c| kill_active(&p.env, &cd, id, 4, c));
    p.stop(&cd, id);

    // runc-v2, the task run again the moment it ends.
    let (id, port) = ("runcv2", free_port());
    let port_s = port.to_string();
    let run = || {
        cd.container(Runtime::RuncV2, id)
            .flags(&["--net-host"])
            .rm()
            .cmd(&["/bin/test-engine", "--port", &port_s])
            .spawn(false)
            .expect("ctr run")
    };
    let first_run = run();
    until("runc-v2 engine answers", LONG, STEP, || ask(port));
    let good = judge(&["?"], "0000000000000000".into(), "own");
    let mut again = None;
    let runc = under_load(port, &good, |_| {
        kill(task_pid(&cd, id).expect("runc-v2 task pid"));
        first_run.wait(LONG).expect("ctr run ends");
        again = Some(run());
        until("runc-v2 engine answers again", LONG, STEP, || ask(port));
    });
    cd.ctr()
        .run(&["task", "kill", "-s", "SIGKILL", id])
        .expect("ctr task kill");
    again.expect("second run").wait(LONG).expect("ctr run ends");
    cd.assert_no_leftovers();

    eprintln!("shadow.dev/listen: {with:?}\nown port: {own:?}\nrunc-v2: {runc:?}");
    assert_eq!(with.refused, 0, "refused with the pair's socket: {with:?}");
    assert_eq!(with.timeouts, 0, "{with:?}");
    assert_eq!(with.wrong_count, 0, "{with:?}");
    assert!(with.ok > 100, "{with:?}");
    assert_eq!(own.wrong_count + runc.wrong_count, 0, "{own:?} {runc:?}");
    // The contrast proves the client sees refusals when they happen.
    assert!(runc.refused > 0, "{runc:?}");
}

/// `shadow.dev/accept: runtime`: the shim accepts, stores each connection
/// at once and hands it to the serving engine, so not even a connection
/// the dying engine had just been handed is lost; and a pair without a
/// socket of its own cannot ask for it.
#[test]
fn when_the_runtime_accepts_no_connection_is_lost_through_sigkills() {
    let cd = Containerd::start().expect("containerd");
    PairEnv::install_engine(&cd, Path::new(ENGINE)).expect("install engine");
    let (id, port) = ("accept", free_port());
    let p = start_pair_with(&cd, id, port, true, &[(ACCEPT, "runtime")], &[]);
    p.env.wait_protected(&cd, id, LONG);
    let first = until("an answer", LONG, STEP, || ask(port));
    let good = judge(PAIR_SLOTS, first.weights.clone(), "handed");
    let seen = under_load(port, &good, |c| kill_active(&p.env, &cd, id, 6, c));
    let store = until("the store empty, once all is answered", LONG, STEP, || {
        p.env
            .state(&cd, id)
            .and_then(|s| s.fdstore)
            .filter(|f| f.fds == 0)
    });
    eprintln!("shadow.dev/accept=runtime: {seen:?}\nfd store: {store:?}");
    p.stop(&cd, id);
    assert!(matches!(attempt(port), Outcome::Refused));
    assert_eq!(
        (
            seen.refused,
            seen.reset_in_flight,
            seen.timeouts,
            seen.wrong_count
        ),
        (0, 0, 0, 0),
        "{seen:?}"
    );
    assert!(seen.ok > 100, "{seen:?}");
    // state.json's figures are those of its last write, which may lag.
    assert!(store.accepted > 100 && store.handed > 0, "{store:?}");
    assert!(
        store.fetches >= 6,
        "a fetch by each promoted engine: {store:?}"
    );

    // An engine that never removes what it was handed: a store of 16 fills,
    // then lets go of each connection whose client closed, and no request
    // waits for room.
    let (id, port) = ("acceptforget", free_port());
    let forgets = start_pair_with(
        &cd,
        id,
        port,
        true,
        &[(ACCEPT, "runtime"), (FDSTORE_MAX, "16")],
        &["--no-remove"],
    );
    let env = &forgets.env;
    env.wait_protected(&cd, id, LONG);
    for i in 0..100 {
        assert!(
            matches!(attempt(port), Outcome::Answer(_)),
            "request {i} to an engine that never removes"
        );
    }
    let st = until("the store's figures written", LONG, STEP, || {
        env.state(&cd, id)
            .and_then(|s| s.fdstore)
            .filter(|f| f.accepted >= 100)
    });
    assert!(st.hung_up > 0 && st.removed == 0, "{st:?}");
    forgets.stop(&cd, id);

    let env = PairEnv::new(&cd, "gms = \"off\"").expect("config");
    let out = cd
        .container(Runtime::Shadow, "acceptnosock")
        .rm()
        .flags(&["--runtime-config-path", &env.config.display().to_string()])
        .annotation(shadow_contract::annotations::PAIR, "true")
        .annotation(ACCEPT, "runtime")
        .cmd(&["/bin/test-engine"])
        .run()
        .expect("ctr run");
    assert_ne!(out.code(), 0, "{out}");
    assert!(
        out.stderr.contains(ACCEPT) && out.stderr.contains(LISTEN),
        "{out}"
    );
    cd.assert_no_leftovers();
}

#[test]
fn the_pairs_socket_survives_a_cold_restart() {
    let cd = Containerd::start().expect("containerd");
    PairEnv::install_engine(&cd, Path::new(ENGINE)).expect("install engine");
    let (id, port) = ("listencold", free_port());
    let p = start_pair(&cd, id, port, true);
    p.env.wait_protected(&cd, id, LONG);
    let first = until("an answer", LONG, STEP, || ask(port));
    let good = judge(PAIR_SLOTS, first.weights.clone(), "inherited");
    let gms_pid = p.env.gmsd_pid(&cd, id, LONG);
    let seen = under_load(port, &good, |_| {
        kill(gms_pid);
        until("cold restart done", LONG, STEP, || {
            p.env
                .state(&cd, id)
                .filter(|v| v.pair.cold_restarts == 1 && v.pair.protected)
        });
    });
    // Both engines were replaced; the socket was not.
    let after = until("an answer", LONG, STEP, || ask(port));
    assert_ne!(after.boot, first.boot);
    assert_eq!(seen.refused, 0, "{seen:?}");
    assert!(seen.wrong_count == 0 && seen.timeouts == 0, "{seen:?}");
    p.stop(&cd, id);
}

#[test]
fn bad_listen_values_are_refused_at_create_leaving_nothing() {
    let cd = Containerd::start().expect("containerd");
    PairEnv::install_engine(&cd, Path::new(ENGINE)).expect("install engine");
    let env = PairEnv::new(&cd, "gms = \"off\"").expect("config");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let busy = format!("tcp:127.0.0.1:{}", taken.local_addr().expect("addr").port());
    for (id, value, flags, says) in [
        (
            "scheme",
            "udp:0.0.0.0:53",
            &[][..],
            "unknown scheme \"udp\"",
        ),
        (
            "inuse",
            busy.as_str(),
            &["--net-host"][..],
            "already in use",
        ),
        (
            "privport",
            "tcp:127.0.0.1:80",
            &["--net-host", "--cap-drop", "CAP_NET_BIND_SERVICE"][..],
            "CAP_NET_BIND_SERVICE",
        ),
        (
            "outside",
            "unix:/run/../../etc/engine.sock",
            &[][..],
            "not a path inside the container",
        ),
    ] {
        let out = cd
            .container(Runtime::Shadow, id)
            .rm()
            .flags(&["--runtime-config-path", &env.config.display().to_string()])
            .flags(flags)
            .annotation(shadow_contract::annotations::PAIR, "true")
            .annotation(LISTEN, value)
            .cmd(&["/bin/test-engine"])
            .run()
            .expect("ctr run");
        assert_ne!(out.code(), 0, "{id}: {out}");
        assert!(
            out.stderr.contains(LISTEN) && out.stderr.contains(says),
            "{id}: {out}"
        );
        cd.assert_no_leftovers();
        assert!(!env.pair_dir(&cd, id).exists(), "{id}: pair dir left");
    }
    drop(taken);
}
