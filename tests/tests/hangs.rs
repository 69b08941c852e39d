//! Hung engines through real containerd and runc (issue 22): an engine
//! that stops (SIGSTOP, or a serving loop stuck on a request) while it
//! keeps its lock is found by its watchdog or by the runtime's probe,
//! killed with every process of it, and failed over; a hung shadow is
//! replaced while the active serves; an engine stuck before parking is
//! ended at its start timeout, unless it asked for more time. Every test
//! ends the pair and checks that nothing is left.

use shadow_contract::state::{FailureClass, HangCause, PairState};
use shadow_tests::pair::{ask, children, free_port, until, PairEnv};
use shadow_tests::{Containerd, Spawned};
use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

const ENGINE: &str = env!("CARGO_BIN_EXE_test-engine");
const LONG: Duration = Duration::from_secs(30);
const STEP: Duration = Duration::from_millis(2);

fn signal(pid: u32, sig: i32) {
    // SAFETY: kill(2) with a pid read from the pair's state and a signal number.
    let rc = unsafe { libc::kill(pid as i32, sig) };
    assert_eq!(rc, 0, "kill {pid}: {}", std::io::Error::last_os_error());
}

fn alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

struct Pair {
    env: PairEnv,
    port: u16,
    ctr: Option<Spawned>,
    id: &'static str,
}

fn start(cd: &Containerd, id: &'static str, annotations: &[(&str, &str)], args: &[&str]) -> Pair {
    start_cfg(cd, id, "", annotations, args)
}

/// [`start`] with more of the shim config's `[pair]` table.
fn start_cfg(
    cd: &Containerd,
    id: &'static str,
    cfg: &str,
    annotations: &[(&str, &str)],
    args: &[&str],
) -> Pair {
    PairEnv::install_engine(cd, Path::new(ENGINE)).expect("install engine");
    let env = PairEnv::new(cd, &format!("gms = \"off\"\n{cfg}")).expect("config");
    let port = free_port();
    let port_s = port.to_string();
    let mut cmd = vec!["/bin/test-engine", "--port", &port_s];
    cmd.extend_from_slice(args);
    let ctr = env
        .run(cd, id, annotations, &["--rm", "--net-host"], &cmd)
        .expect("ctr run");
    Pair {
        env,
        port,
        ctr: Some(ctr),
        id,
    }
}

impl Pair {
    fn state(&self, cd: &Containerd) -> Option<PairState> {
        self.env.state(cd, self.id)
    }

    fn until(&self, cd: &Containerd, what: &str, ok: impl Fn(&PairState) -> bool) -> PairState {
        until(what, LONG, STEP, || self.state(cd).filter(|s| ok(s)))
    }

    /// Kill the task and check that nothing is left.
    fn stop(mut self, cd: &Containerd) {
        let ctr = self.ctr.take().expect("ctr");
        self.env.stop(cd, self.id, "SIGKILL", ctr, LONG);
    }
}

/// A test-only request to the engine serving on `port` (its health port:
/// `/hang`, `/trigger`).
fn send(port: u16, path: &str) {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.write_all(format!("GET {path} HTTP/1.0\r\n\r\n").as_bytes())
        .expect("write");
}

/// The serving engine stops with its lock held: with a 100 ms watchdog
/// the pair kills it and the shadow serves; then the new active's shadow
/// (the respawned slot) stops, and is replaced while the active serves.
#[test]
fn a_stopped_engine_is_ended_by_its_watchdog_and_failed_over() {
    let cd = Containerd::start().expect("containerd");
    let p = start(&cd, "wdstop", &[("shadow.dev/watchdog", "100ms")], &[]);
    p.env.wait_protected(&cd, p.id, LONG);
    // Both engines' pings reach the pair: both watchdogs armed.
    let st = p.until(&cd, "both watchdogs armed", |s| {
        s.pair.protected && s.pair.slots.iter().all(|s| s.watchdog_armed)
    });
    let old = st.pair.active.expect("active");
    let pid = st.pid_of(old).expect("pid");
    // A window of five intervals, armed: a healthy engine is not ended
    // (what is checked is that nothing happens, so it takes time).
    std::thread::sleep(Duration::from_millis(500));
    let st = p.state(&cd).expect("state");
    assert_eq!((st.pair.hangs.total(), st.pair.failovers), (0, 0), "{st:?}");
    signal(pid, libc::SIGSTOP);
    let stopped = Instant::now();
    let answer = until("the shadow serves", LONG, STEP, || {
        ask(p.port).filter(|a| a.slot != old.to_string())
    });
    let took = stopped.elapsed();
    // The respawned slot parked and pinged: its watchdog is armed (by its
    // first WATCHDOG=1, which may come after its STATUS=parked), so the
    // stop below is seen.
    let st = p.until(&cd, "the hang recorded, the respawn armed", |s| {
        s.pair.failovers == 1 && s.pair.protected && s.pair.slots.iter().all(|s| s.watchdog_armed)
    });
    assert!(!alive(pid), "the stopped engine was killed");
    let last = &st.promotions.last().expect("a promotion").promotion;
    assert_eq!(last.class, FailureClass::Hung);
    let hang = last.hang.expect("its hang");
    assert_eq!(hang.cause, HangCause::Watchdog);
    assert!(hang.killed_at.is_some());
    assert_eq!(st.pair.hangs.watchdog, 1);
    assert_eq!(
        st.pair.slots[usize::from(old)].last_hang,
        Some(HangCause::Watchdog)
    );
    eprintln!("SIGSTOP → first answer from slot {}: {took:?}", answer.slot);
    // The respawned slot is the shadow now: stopped, it is replaced and
    // the active keeps serving.
    let active = st.pair.active.expect("active");
    let shadow = st.pid_of(old).expect("shadow pid");
    let generation = st.pair.slots[usize::from(old)].generation;
    signal(shadow, libc::SIGSTOP);
    let st = p.until(&cd, "the shadow replaced", |s| {
        s.pair.slots[usize::from(old)].generation > generation && s.pair.protected
    });
    assert!(!alive(shadow));
    assert_eq!(st.pair.active, Some(active), "the active kept serving");
    assert_eq!(st.pair.failovers, 1);
    assert_eq!(st.pair.hangs.watchdog, 2);
    assert_eq!(ask(p.port).expect("serves").slot, active.to_string());
    p.stop(&cd);
}

/// A serving loop stuck on a request (the CPU stand-in for a decode step
/// that never ends) stops its pings; `WATCHDOG=trigger` ends an engine at
/// once.
#[test]
fn a_stuck_serving_loop_and_a_trigger_end_the_engine() {
    let cd = Containerd::start().expect("containerd");
    let health = free_port();
    let health_s = health.to_string();
    let p = start(
        &cd,
        "wdloop",
        &[("shadow.dev/watchdog", "200ms")],
        &["--health-port", &health_s],
    );
    let st = p.env.wait_protected(&cd, p.id, LONG);
    let old = st.pair.active.expect("active");
    send(health, "/hang");
    let st = p.until(&cd, "failed over", |s| {
        s.pair.failovers == 1 && s.pair.protected
    });
    assert_eq!(st.pair.hangs.watchdog, 1);
    let new = st.pair.active.expect("active");
    assert_ne!(new, old);
    send(health, "/trigger");
    let st = p.until(&cd, "failed over again", |s| {
        s.pair.failovers == 2 && s.pair.protected
    });
    assert_eq!(st.pair.hangs.trigger, 1);
    let last = &st.promotions.last().expect("promotion").promotion;
    assert_eq!(last.hang.map(|h| h.cause), Some(HangCause::Trigger));
    p.stop(&cd);
}

/// An engine that does not speak sd_notify's watchdog: the runtime's
/// HTTP probe, from the pair's network namespace, every 100 ms; two
/// failures in a row end the stopped engine.
#[test]
fn a_stopped_engine_fails_its_probe_and_is_failed_over() {
    let cd = Containerd::start().expect("containerd");
    let port = free_port();
    let health = free_port();
    let health_s = health.to_string();
    let target = format!("http://127.0.0.1:{health}/health");
    PairEnv::install_engine(&cd, Path::new(ENGINE)).expect("install engine");
    let env = PairEnv::new(&cd, "gms = \"off\"").expect("config");
    let port_s = port.to_string();
    let ctr = env
        .run(
            &cd,
            "probestop",
            &[
                ("shadow.dev/probe", &target),
                ("shadow.dev/probe-period", "100ms"),
                ("shadow.dev/probe-failures", "2"),
            ],
            &["--rm", "--net-host"],
            &[
                "/bin/test-engine",
                "--port",
                &port_s,
                "--health-port",
                &health_s,
            ],
        )
        .expect("ctr run");
    let p = Pair {
        env,
        port,
        ctr: Some(ctr),
        id: "probestop",
    };
    let st = p.env.wait_protected(&cd, p.id, LONG);
    // Healthy probes for a while: nobody ended.
    std::thread::sleep(Duration::from_millis(600));
    assert_eq!(p.state(&cd).expect("state").pair.hangs.total(), 0);
    let old = st.pair.active.expect("active");
    let pid = st.pid_of(old).expect("pid");
    signal(pid, libc::SIGSTOP);
    let stopped = Instant::now();
    until("the shadow serves", LONG, STEP, || {
        ask(p.port).filter(|a| a.slot != old.to_string())
    });
    eprintln!(
        "SIGSTOP → first answer (probe 100ms × 2): {:?}",
        stopped.elapsed()
    );
    let st = p.until(&cd, "the hang recorded", |s| s.pair.failovers == 1);
    assert!(!alive(pid));
    assert_eq!(st.pair.hangs.probe, 1);
    let last = &st.promotions.last().expect("promotion").promotion;
    assert_eq!(last.class, FailureClass::Hung);
    assert_eq!(last.hang.map(|h| h.cause), Some(HangCause::Probe));
    p.stop(&cd);
}

/// Engines stuck before they park are ended at their start timeout and
/// started again (an early death: the restart budget's backoff); one that
/// says `EXTEND_TIMEOUT_USEC=` in time is left to finish.
#[test]
fn engines_stuck_starting_are_ended_at_the_start_timeout_unless_extended() {
    let cd = Containerd::start().expect("containerd");
    // A budget that outlasts the test: early deaths back off but never
    // make a crash loop here.
    let p = start_cfg(
        &cd,
        "stuckstart",
        "[pair.restart]\nmax_consecutive_failures = 1000\n",
        &[("shadow.dev/start-timeout", "1s")],
        &["--stall-start-ms", "600000"],
    );
    let begun = Instant::now();
    let st = p.until(&cd, "both ended at the start timeout", |s| {
        s.pair.hangs.start_timeout >= 2
    });
    let took = begun.elapsed();
    assert!(st
        .pair
        .slots
        .iter()
        .all(|s| s.last_hang == Some(HangCause::StartTimeout)));
    eprintln!("stuck starting → both ended: {took:?} (start timeout 1s)");
    let st = p.until(&cd, "started again", |s| {
        s.pair.slots.iter().all(|s| s.generation >= 2)
    });
    assert_eq!(st.pair.failovers, 0);
    p.stop(&cd);

    // Stalling 3 s with a 1 s timeout, but extending by 2 s each second.
    let p = start(
        &cd,
        "extended",
        &[("shadow.dev/start-timeout", "1s")],
        &["--stall-start-ms", "3000", "--extend-start-us", "2000000"],
    );
    let st = p.env.wait_protected(&cd, p.id, LONG);
    assert_eq!(st.pair.hangs.total(), 0, "{st:?}");
    assert!(st.pair.slots.iter().all(|s| s.generation == 1));
    p.stop(&cd);
}

/// Each knob's bad value fails Create with the key, the value and what is
/// allowed, and leaves nothing behind.
#[test]
fn bad_hang_knobs_fail_create_leaving_nothing() {
    let cd = Containerd::start().expect("containerd");
    let env = PairEnv::new(&cd, "gms = \"off\"").expect("config");
    for (i, (key, value, allowed)) in [
        ("shadow.dev/watchdog", "10ms", "from 50ms to 24h"),
        ("shadow.dev/watchdog", "1.5s", "a whole number"),
        (
            "shadow.dev/probe",
            "udp://127.0.0.1:1",
            "tcp://<host>:<port>",
        ),
        (
            "shadow.dev/probe-failures",
            "2",
            "only together with shadow.dev/probe",
        ),
        ("shadow.dev/start-timeout", "100ms", "from 1s"),
    ]
    .into_iter()
    .enumerate()
    {
        let id = format!("badhang{i}");
        let out = cd
            .container(shadow_tests::Runtime::Shadow, &id)
            .rm()
            .flags(&["--runtime-config-path", &env.config.display().to_string()])
            .annotation("shadow.dev/pair", "true")
            .annotation(key, value)
            .cmd(&["true"])
            .run()
            .expect("ctr run");
        assert_ne!(out.code(), 0, "{key}={value}: {out}");
        assert!(
            out.stderr.contains(key) && out.stderr.contains(value) && out.stderr.contains(allowed),
            "{key}={value}: {out}"
        );
        assert!(!env.pair_dir(&cd, &id).exists());
    }
    // A probe period with a timeout longer than it, together.
    let out = cd
        .container(shadow_tests::Runtime::Shadow, "badtimeout")
        .rm()
        .flags(&["--runtime-config-path", &env.config.display().to_string()])
        .annotation("shadow.dev/pair", "true")
        .annotation("shadow.dev/probe", "tcp://127.0.0.1:80")
        .annotation("shadow.dev/probe-period", "100ms")
        .annotation("shadow.dev/probe-timeout", "1s")
        .cmd(&["true"])
        .run()
        .expect("ctr run");
    assert_ne!(out.code(), 0, "{out}");
    assert!(out.stderr.contains("shadow.dev/probe-timeout"), "{out}");
    cd.assert_no_leftovers();
}

/// A tensor-parallel engine (a main process and its ranks) that hangs as
/// a whole is ended as a whole: every rank goes with the main process.
#[test]
fn a_hung_group_is_ended_whole() {
    let cd = Containerd::start().expect("containerd");
    let p = start(
        &cd,
        "wdgroup",
        &[("shadow.dev/watchdog", "100ms")],
        &["--ranks", "3"],
    );
    let st = p.env.wait_protected(&cd, p.id, LONG);
    let old = st.pair.active.expect("active");
    let main = st.pid_of(old).expect("pid");
    let ranks = until("the ranks", LONG, STEP, || {
        Some(children(main)).filter(|c| c.len() == 2)
    });
    for pid in ranks.iter().chain([&main]) {
        signal(*pid, libc::SIGSTOP);
    }
    let st = p.until(&cd, "failed over", |s| {
        s.pair.failovers == 1 && s.pair.protected
    });
    assert_eq!(st.pair.hangs.watchdog, 1);
    until("every process of the hung group gone", LONG, STEP, || {
        ranks
            .iter()
            .chain([&main])
            .all(|p| !alive(*p))
            .then_some(())
    });
    p.stop(&cd);
}

/// The probe runs in the pair's network namespace, not the host's: a pair
/// without host networking gets a pinned namespace of its own, where its
/// engines listen on 127.0.0.1; from the host nothing listens there. The
/// healthy engine passes its probes (from the host they would be refused
/// and end it); stopped, it fails them and is failed over.
#[test]
fn the_probe_runs_in_the_pairs_own_network_namespace() {
    let cd = Containerd::start().expect("containerd");
    PairEnv::install_engine(&cd, Path::new(ENGINE)).expect("install engine");
    let env = PairEnv::new(&cd, "gms = \"off\"").expect("config");
    let health = free_port();
    let health_s = health.to_string();
    let target = format!("http://127.0.0.1:{health}/health");
    let id = "probens";
    let ctr = env
        .run(
            &cd,
            id,
            &[
                ("shadow.dev/probe", &target),
                ("shadow.dev/probe-period", "100ms"),
                ("shadow.dev/probe-failures", "2"),
            ],
            &["--rm"],
            &[
                "/bin/test-engine",
                "--port",
                "8000",
                "--health-port",
                &health_s,
            ],
        )
        .expect("ctr run");
    let p = Pair {
        env,
        port: 8000,
        ctr: Some(ctr),
        id,
    };
    let st = p.env.wait_protected(&cd, p.id, LONG);
    // Nothing answers on the host side of that port.
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", health)).is_err(),
        "the engine's port is reachable from the host: not the pair's own namespace"
    );
    std::thread::sleep(Duration::from_millis(600));
    let now = p.state(&cd).expect("state");
    assert_eq!(
        now.pair.hangs.total(),
        0,
        "probes from the host's namespace? {:?}",
        now.pair
    );
    let old = st.pair.active.expect("active");
    signal(st.pid_of(old).expect("pid"), libc::SIGSTOP);
    let st = p.until(&cd, "failed over on its probe", |s| {
        s.pair.failovers == 1 && s.pair.protected
    });
    assert_eq!(st.pair.hangs.probe, 1);
    assert_ne!(st.pair.active, Some(old));
    p.stop(&cd);
}
