//! Engine pairs through real containerd, real runc, real signals: one
//! container spec with `shadow.dev/pair=true` runs as two engines; killing
//! the one that serves hands the port to the other; the task stays running
//! with the active engine's pid; Kill ends it with one exit; nothing is left.

use shadow_contract::state::{EngineState, PairState};
use shadow_tests::pair::{ask, free_port, kill_shim, task_pid, until, PairEnv};
use shadow_tests::{Containerd, Spawned};
use std::path::Path;
use std::time::Duration;

const ENGINE: &str = env!("CARGO_BIN_EXE_test-engine");
const LONG: Duration = Duration::from_secs(30);
const STEP: Duration = Duration::from_millis(2);

fn kill(pid: u32, sig: i32) {
    // SAFETY: kill(2) with a pid read from the pair's state and a signal number.
    let rc = unsafe { libc::kill(pid as i32, sig) };
    assert_eq!(rc, 0, "kill {pid}: {}", std::io::Error::last_os_error());
}

fn active_of(st: &PairState) -> (usize, u32) {
    let slot = st.pair.active.expect("active slot");
    let pid = st.pid_of(slot).expect("active pid");
    (usize::from(slot), pid)
}

/// gmsd from the workspace's target dir, next to the shim.
fn gmsd() -> String {
    let p = Path::new(ENGINE).with_file_name("gmsd");
    assert!(
        p.is_file(),
        "{} missing: build it with `cargo build -p gmsd --bin gmsd`",
        p.display()
    );
    p.display().to_string()
}

struct Running {
    env: PairEnv,
    port: u16,
    ctr: Option<Spawned>,
}

fn start(
    cd: &Containerd,
    id: &str,
    extra_cfg: &str,
    annotations: &[(&str, &str)],
    engine_args: &[&str],
) -> Running {
    start_with(
        cd,
        id,
        extra_cfg,
        annotations,
        engine_args,
        &["--rm", "--net-host"],
    )
}

/// [`start`] with `ctr run` flags of the caller's.
fn start_with(
    cd: &Containerd,
    id: &str,
    extra_cfg: &str,
    annotations: &[(&str, &str)],
    engine_args: &[&str],
    flags: &[&str],
) -> Running {
    PairEnv::install_engine(cd, Path::new(ENGINE)).expect("install engine");
    let env = PairEnv::new(cd, &format!("gmsd = \"{}\"\n{extra_cfg}", gmsd())).expect("config");
    let port = free_port();
    let port_s = port.to_string();
    let mut cmd = vec!["/bin/test-engine", "--port", &port_s];
    cmd.extend_from_slice(engine_args);
    let ctr = env.run(cd, id, annotations, flags, &cmd).expect("ctr run");
    Running {
        env,
        port,
        ctr: Some(ctr),
    }
}

impl Running {
    /// Kill the task with `sig` and check: ctr run ends, one exit, nothing left.
    fn stop(mut self, cd: &Containerd, id: &str, sig: &str) {
        let ctr = self.ctr.take().expect("ctr");
        self.env.stop(cd, id, sig, ctr, LONG);
    }
}

fn wait_new_active(r: &Running, old_slot: usize) -> shadow_tests::pair::Answer {
    until("the other engine to serve", LONG, STEP, || {
        ask(r.port).filter(|a| a.slot != old_slot.to_string())
    })
}

#[test]
fn killing_the_active_engine_20_times_fails_over_each_time() {
    let cd = Containerd::start().expect("containerd");
    let id = "pair20";
    let r = start(&cd, id, "gms = \"off\"", &[], &[]);
    let mut st = r.env.wait_protected(&cd, id, LONG);
    for round in 0..20 {
        let (slot, pid) = active_of(&st);
        assert_eq!(
            task_pid(&cd, id),
            Some(pid),
            "round {round}: State.pid is the active engine"
        );
        let shadow = st.pids[1 - slot].expect("shadow pid");
        kill(pid, libc::SIGKILL);
        let a = wait_new_active(&r, slot);
        assert_eq!(
            a.slot,
            (1 - slot).to_string(),
            "round {round}: the other slot serves"
        );
        // The task stays running with the new active's pid; the killed slot
        // comes back parked.
        st = until("protected again", LONG, STEP, || {
            r.env.state(&cd, id).filter(|v| {
                v.pair.protected
                    && v.pair.active.map(usize::from) == Some(1 - slot)
                    && v.pids[1 - slot] == Some(shadow)
            })
        });
        assert_eq!(st.pair.failovers, round + 1);
        until("State.pid follows", LONG, STEP, || {
            (task_pid(&cd, id) == Some(shadow)).then_some(())
        });
        assert_eq!(
            cd.ctr().task_status(id).expect("ls").as_deref(),
            Some("RUNNING")
        );
    }
    let last = st.promotions.last().expect("one promotion");
    assert!(last.total_ms.is_some(), "{last:?}");
    r.stop(&cd, id, "SIGKILL");
}

#[test]
fn killing_the_shadow_respawns_it_and_leaves_the_active_alone() {
    let cd = Containerd::start().expect("containerd");
    let id = "shadowkill";
    let r = start(&cd, id, "gms = \"off\"", &[], &[]);
    let st = r.env.wait_protected(&cd, id, LONG);
    let (slot, pid) = active_of(&st);
    let shadow = st.pids[1 - slot].expect("shadow pid");
    let generation = st.pair.slots[1 - slot].generation;
    kill(shadow, libc::SIGKILL);
    let st = until("shadow respawned and parked", LONG, STEP, || {
        r.env
            .state(&cd, id)
            .filter(|v| v.pair.slots[1 - slot].generation > generation && v.pair.protected)
    });
    assert_eq!(active_of(&st), (slot, pid), "active untouched");
    assert_eq!(st.pair.failovers, 0);
    assert_eq!(ask(r.port).expect("serves").slot, slot.to_string());
    // Exec runs in the active engine, with its own exit code.
    let out = cd
        .exec(
            id,
            "which-slot",
            &["sh", "-c", "echo slot=$SHADOW_ENGINE_ID; exit 4"],
        )
        .expect("ctr task exec");
    assert_eq!(out.stdout.trim(), format!("slot={slot}"), "{out}");
    assert_eq!(out.status.code(), Some(4), "{out}");
    r.stop(&cd, id, "SIGKILL");
}

/// Weight loads so far: lines the writers appended to `/loads.log` of the
/// engines' shared rootfs (the host's pair directory is not theirs to
/// write).
fn loads(_r: &Running, cd: &Containerd, _id: &str) -> usize {
    std::fs::read_to_string(cd.rootfs().join("loads.log"))
        .map(|t| t.lines().count())
        .unwrap_or(0)
}

#[test]
fn both_killed_come_back_without_reloading_weights() {
    let cd = Containerd::start().expect("containerd");
    let id = "bothkill";
    let r = start(&cd, id, "gms = \"host\"", &[], &[]);
    let st = r.env.wait_protected(&cd, id, LONG);
    let first = ask(r.port).expect("serves");
    assert_eq!(loads(&r, &cd, id), 1, "loaded once");
    for s in 0..2 {
        kill(st.pids[s].expect("pid"), libc::SIGKILL);
    }
    let a = until("a new engine serves", LONG, STEP, || {
        ask(r.port).filter(|a| a.boot != first.boot)
    });
    r.env.wait_protected(&cd, id, LONG);
    assert!(!a.loaded, "the committed layout is reused, not reloaded");
    assert_eq!(a.weights, first.weights);
    assert_eq!(loads(&r, &cd, id), 1, "no second load");
    r.stop(&cd, id, "SIGKILL");
}

#[test]
fn a_single_engine_without_shadow_restarts_in_place_and_maps_its_weights() {
    let cd = Containerd::start().expect("containerd");
    let id = "single";
    let r = start(
        &cd,
        id,
        "gms = \"host\"",
        &[("shadow.dev/shadow", "false")],
        &[],
    );
    let st = until("the single engine serves", LONG, STEP, || {
        r.env
            .state(&cd, id)
            .filter(|v| v.pair.active == Some(0) && v.pids[0].is_some())
    });
    assert!(st.pids[1].is_none(), "no second engine: {st:?}");
    assert!(!st.pair.protected, "a single engine is never protected");
    let first = ask(r.port).expect("serves");
    assert!(first.loaded, "the first engine loads the weights");
    kill(st.pids[0].expect("pid"), libc::SIGKILL);
    let a = until("the restarted engine serves", LONG, STEP, || {
        ask(r.port).filter(|a| a.boot != first.boot)
    });
    assert_eq!(a.slot, "0");
    assert!(!a.loaded, "the restart maps the committed weights");
    assert_eq!(a.weights, first.weights);
    assert_eq!(loads(&r, &cd, id), 1, "loaded once");
    let st = until("restart recorded", LONG, STEP, || {
        r.env
            .state(&cd, id)
            .filter(|v| v.pair.failovers == 1 && v.pair.active == Some(0))
    });
    assert_eq!(st.pair.slots[1].generation, 0, "slot 1 never ran");
    r.stop(&cd, id, "SIGKILL");
}

/// `pair_by_default`: a container with no `shadow.dev/pair` annotation (as
/// Nomad's containerd driver starts them) runs as a pair all the same.
#[test]
fn pair_by_default_pairs_a_container_without_annotations() {
    let cd = Containerd::start().expect("containerd");
    let id = "bydefault";
    PairEnv::install_engine(&cd, Path::new(ENGINE)).expect("install engine");
    let env = PairEnv::new(
        &cd,
        &format!(
            "gmsd = \"{}\"\ngms = \"off\"\npair_by_default = true",
            gmsd()
        ),
    )
    .expect("config");
    let port = free_port().to_string();
    let ctr = cd
        .container(shadow_tests::Runtime::Shadow, id)
        .flags(&["--runtime-config-path", &env.config.display().to_string()])
        .flags(&["--rm", "--net-host"])
        .cmd(&["/bin/test-engine", "--port", &port])
        .spawn(false)
        .expect("ctr run");
    let r = Running {
        env,
        port: port.parse().expect("port"),
        ctr: Some(ctr),
    };
    let st = r.env.wait_protected(&cd, id, LONG);
    assert!(st.pids[0].is_some() && st.pids[1].is_some(), "{st:?}");
    ask(r.port).expect("serves");
    r.stop(&cd, id, "SIGKILL");
}

#[test]
fn gmsd_death_restarts_the_pair_cold_and_reloads_once() {
    let cd = Containerd::start().expect("containerd");
    let id = "gmskill";
    let r = start(&cd, id, "gms = \"host\"", &[], &[]);
    r.env.wait_protected(&cd, id, LONG);
    let gms_pid = r.env.gmsd_pid(&cd, id, LONG);
    // Capabilities are dropped.
    let status = std::fs::read_to_string(format!("/proc/{gms_pid}/status")).expect("gmsd status");
    let eff = status
        .lines()
        .find(|l| l.starts_with("CapEff:"))
        .expect("CapEff");
    assert!(
        eff.ends_with("0000000000000000"),
        "gmsd keeps capabilities: {eff}"
    );
    kill(gms_pid, libc::SIGKILL);
    let st = until("cold restart done", LONG, STEP, || {
        r.env.state(&cd, id).filter(|v| {
            v.pair.cold_restarts == 1
                && v.pair.protected
                && v.gms.as_ref().is_some_and(|g| g.pid != gms_pid)
        })
    });
    let a = ask(r.port).expect("serves");
    assert_eq!(Some(a.slot), st.pair.active.map(|s| s.to_string()));
    assert_eq!(loads(&r, &cd, id), 2, "reloaded exactly once");
    r.stop(&cd, id, "SIGKILL");
}

/// An engine promoted onto weights that changed (the contract's exit
/// status, `weights_corrupt`) makes the pair restart cold: a new gmsd, the
/// weights loaded once more, the cause in state.json, shadowctl's terms and
/// the metrics, and the pair serves and is protected again.
#[test]
fn a_promoted_engine_finding_the_weights_changed_restarts_the_pair_cold() {
    use shadow_contract::state::{ColdRestartCause, Exit};
    let cd = Containerd::start().expect("containerd");
    let id = "corrupt";
    let r = start(&cd, id, "gms = \"host\"", &[], &[]);
    let st = r.env.wait_protected(&cd, id, LONG);
    let first = ask(r.port).expect("serves");
    let gms_pid = r.env.gmsd_pid(&cd, id, LONG);
    let (slot, pid) = active_of(&st);
    let shadow = 1 - slot;

    std::fs::write(cd.rootfs().join("weights-corrupt"), b"").expect("mark");
    kill(pid, libc::SIGKILL);
    let st = until("a cold restart for corrupt weights", LONG, STEP, || {
        r.env.state(&cd, id).filter(|v| {
            v.pair.cold_restarts == 1
                && v.pair.protected
                && v.gms.as_ref().is_some_and(|g| g.pid != gms_pid)
        })
    });
    assert!(
        !cd.rootfs().join("weights-corrupt").exists(),
        "the promoted engine saw the mark"
    );
    assert_eq!(
        st.pair.last_cold_restart,
        Some(ColdRestartCause::WeightsCorrupt { slot: shadow as u8 })
    );
    assert_eq!(st.pair.weights_corrupt, 1);
    assert_eq!(
        st.pair.slots[shadow].last_exit,
        Some(Exit::Code(shadow_contract::weights::CORRUPT_EXIT)),
        "the promoted engine's exit is recorded"
    );
    let a = ask(r.port).expect("serves after the cold restart");
    assert_eq!(a.weights, first.weights, "the same weights, loaded again");
    assert_eq!(loads(&r, &cd, id), 2, "reloaded exactly once");
    let metric = |name: &str, labels: &str| r.env.metric(&cd, id, name, labels);
    assert_eq!(metric("shadow_pair_weights_corrupt_total", ""), Some(1.0));
    assert_eq!(
        metric(
            "shadow_pair_last_cold_restart_info",
            &format!(",cause=\"weights_corrupt\",slot=\"{shadow}\"")
        ),
        Some(1.0)
    );
    r.stop(&cd, id, "SIGKILL");
}

#[test]
fn an_engine_that_always_crashes_ends_the_task_with_its_status() {
    let cd = Containerd::start().expect("containerd");
    let id = "crashloop";
    let r = start(
        &cd,
        id,
        "gms = \"off\"\n[pair.restart]\nmax_consecutive_failures = 3\nbackoff_initial = 20\nbackoff_max = 40",
        &[],
        &["--crash", "7"],
    );
    let mut r = r;
    let out = r.ctr.take().expect("ctr").wait(LONG).expect("ctr run ends");
    assert_eq!(out.code(), 7, "{out}");
    cd.assert_no_leftovers();
    assert!(!r.env.pair_dir(&cd, id).exists());
}

/// Restart on failure only: a one-shot command run as a pair runs once in
/// each slot, and the task ends with 0 (it used to be respawned until the
/// restart budget was spent).
#[test]
fn a_pair_of_engines_that_finish_cleanly_ends_with_0_and_runs_each_once() {
    let cd = Containerd::start().expect("containerd");
    let id = "oneshot";
    let env = PairEnv::new(&cd, "gms = \"off\"").expect("config");
    let ctr = env
        .run(
            &cd,
            id,
            &[],
            &["--rm"],
            &["sh", "-c", "echo ran-in-slot-$SHADOW_ENGINE_ID"],
        )
        .expect("ctr run");
    let out = ctr.wait(LONG).expect("ctr run ends");
    assert_eq!(out.code(), 0, "{out}");
    for slot in ["0", "1"] {
        let line = format!("ran-in-slot-{slot}");
        assert_eq!(
            out.stdout.lines().filter(|l| *l == line).count(),
            1,
            "slot {slot} ran once: {out}"
        );
    }
    cd.assert_no_leftovers();
    assert!(!env.pair_dir(&cd, id).exists());
}

#[test]
fn ctr_kill_ends_the_pair_with_one_exit_and_rm_leaves_nothing() {
    let cd = Containerd::start().expect("containerd");
    let id = "killrm";
    PairEnv::install_engine(&cd, Path::new(ENGINE)).expect("install engine");
    let env = PairEnv::new(&cd, "gms = \"off\"").expect("config");
    let port = free_port().to_string();
    let mut events = cd.ctr().spawn(&["events"], false).expect("ctr events");
    let ctr = env
        .run(
            &cd,
            id,
            &[],
            &["--net-host"],
            &["/bin/test-engine", "--port", &port],
        )
        .expect("ctr run");
    let st = env.wait_protected(&cd, id, LONG);
    let pids: Vec<u32> = (0..2).map(|s| st.pids[s].expect("pid")).collect();
    // SIGTERM (the default of `ctr task kill`): the engine dies of it.
    cd.ctr()
        .run(&["task", "kill", id])
        .expect("kill")
        .assert_success();
    let out = ctr.wait(LONG).expect("ctr run ends");
    assert_eq!(out.code(), 143, "{out}");
    for p in &pids {
        assert!(
            !Path::new(&format!("/proc/{p}")).exists(),
            "engine {p} still alive"
        );
    }
    // `ctr run` (no --rm) already removed the task: Delete ran.
    assert_eq!(cd.ctr().task_status(id).expect("ls").as_deref(), None);
    assert!(
        !env.pair_dir(&cd, id).exists(),
        "task rm removes the pair dir"
    );
    cd.ctr()
        .run(&["c", "rm", id])
        .expect("c rm")
        .assert_success();
    // One subscriber's events come in the order they were published: once
    // the container's delete is here, so is every task event before it.
    events
        .wait_output(LONG, |out, _| {
            out.lines()
                .any(|l| l.contains("/containers/delete") && l.contains(id))
        })
        .expect("the /containers/delete event");
    let seen = events.stdout_so_far();
    events.kill();
    cd.assert_no_leftovers();
    assert!(!env.pair_dir(&cd, id).exists());
    let exits = seen
        .lines()
        .filter(|l| l.contains("/tasks/exit") && l.contains(id))
        .count();
    assert_eq!(exits, 1, "exactly one TaskExit: {seen}");
    // As runc-v2's: Create already made an engine (slot 0, started by
    // Start), so `/tasks/create` carries its pid (JSON leaves out a 0).
    let create = seen
        .lines()
        .find(|l| l.contains("/tasks/create") && l.contains(id))
        .unwrap_or_else(|| panic!("no /tasks/create: {seen}"));
    let pid: u32 = create
        .split("\"pid\":")
        .nth(1)
        .map(|r| {
            r.chars()
                .take_while(char::is_ascii_digit)
                .collect::<String>()
        })
        .and_then(|d| d.parse().ok())
        .unwrap_or_else(|| panic!("no pid in {create}"));
    assert_eq!(
        pid, pids[0],
        "the pid of Create is slot 0's engine: {create}"
    );
}

/// As runc-v2's Create (`runc create`): a pair whose engine cannot run
/// fails Create with runc's error, and Create leaves nothing behind.
#[test]
fn a_pair_whose_binary_does_not_exist_fails_create_leaving_nothing() {
    let cd = Containerd::start().expect("containerd");
    let id = "nobinary";
    let env = PairEnv::new(&cd, "gms = \"off\"").expect("config");
    let out = env
        .run(&cd, id, &[], &["--rm"], &["/no/such/engine", "--port", "1"])
        .expect("ctr run")
        .wait(LONG)
        .expect("ctr run ends");
    assert_ne!(out.code(), 0, "{out}");
    assert!(
        out.stderr.contains("/no/such/engine") && out.stderr.contains("runc create"),
        "{out}"
    );
    assert_eq!(cd.ctr().task_status(id).expect("ls").as_deref(), None);
    cd.assert_no_leftovers();
    assert!(!env.pair_dir(&cd, id).exists(), "pair dir left");
}

#[test]
fn an_unmodified_program_under_flock_fails_over() {
    let cd = Containerd::start().expect("containerd");
    let id = "flockpair";
    shadow_tests::pair::install_binary(cd.rootfs(), Path::new("/usr/bin/flock"), "/usr/bin/flock")
        .expect("install flock");
    let env = PairEnv::new(&cd, "gms = \"off\"").expect("config");
    let port = free_port();
    let script = format!(
        "exec /usr/bin/flock \"$SHADOW_LOCK_PATH\" nc -ll -p {port} -e sh -c \"echo slot=$SHADOW_ENGINE_ID\""
    );
    let ctr = env
        .run(
            &cd,
            id,
            &[],
            &["--rm", "--net-host"],
            &["sh", "-c", &script],
        )
        .expect("ctr run");
    // No sd_notify: the shim learns the active engine from the lock.
    let st = until("active by lock", LONG, STEP, || {
        env.state(&cd, id).filter(|v| v.pair.active.is_some())
    });
    let (slot, pid) = active_of(&st);
    // Nor does the shadow say it is parked: the shim sees it waiting on the
    // lock (/proc/locks lists the waiter), and that is what parked means.
    let st = until("protected by a waiter on the lock", LONG, STEP, || {
        env.state(&cd, id).filter(|v| v.pair.protected)
    });
    assert_eq!(st.pair.slots[1 - slot].state, EngineState::Parked, "{st:?}");
    let first = until("nc answers", LONG, STEP, || ask(port));
    assert_eq!(first.slot, slot.to_string());
    kill(pid, libc::SIGKILL);
    let a = until("the other serves", LONG, STEP, || {
        ask(port).filter(|a| a.slot != slot.to_string())
    });
    assert_eq!(a.slot, (1 - slot).to_string());
    let st = until("promotion recorded", LONG, STEP, || {
        env.state(&cd, id)
            .filter(|v| v.pair.failovers == 1 && v.pair.active.map(usize::from) == Some(1 - slot))
    });
    assert!(st.promotions[0].promotion.lock_at.is_some(), "{st:?}");
    // The respawned slot waits on the lock in turn: protected again.
    until("protected again", LONG, STEP, || {
        env.state(&cd, id)
            .filter(|v| v.pair.protected && v.pair.active.map(usize::from) == Some(1 - slot))
    });
    cd.ctr()
        .run(&["task", "kill", "-s", "SIGKILL", id])
        .expect("kill")
        .assert_success();
    ctr.wait(LONG).expect("ctr run ends");
    cd.assert_no_leftovers();
}

#[test]
fn the_pair_survives_a_containerd_restart_and_stays_managed() {
    let mut cd = Containerd::start().expect("containerd");
    let id = "cdrestart";
    // Detached: since containerd 2.0 a foreground `ctr run` kills its task
    // once containerd answers again after a restart.
    let r = start_with(
        &cd,
        id,
        "gms = \"off\"",
        &[],
        &[],
        &["--detach", "--net-host"],
    );
    r.ctr
        .expect("ctr run --detach")
        .wait(LONG)
        .expect("ctr run --detach returns")
        .assert_success();
    let r = Running { ctr: None, ..r };
    let st = r.env.wait_protected(&cd, id, LONG);
    let (_, pid) = active_of(&st);
    let (slot, _) = active_of(&st);
    let shadow = st.pids[1 - slot].expect("shadow pid");
    let before = ask(r.port).expect("serving");
    cd.restart().expect("restart containerd");
    assert_eq!(ask(r.port).expect("still serving").boot, before.boot);
    assert_eq!(task_pid(&cd, id), Some(pid));
    kill(pid, libc::SIGKILL);
    wait_new_active(&r, slot);
    until("State.pid follows after restart", LONG, STEP, || {
        (task_pid(&cd, id) == Some(shadow)).then_some(())
    });
    // End the task through the new containerd: its exit reaches
    // containerd before its delete, over the shim's new connection.
    let mut events = cd.subscribe_events().expect("ctr events");
    cd.ctr()
        .run(&["task", "kill", "-s", "SIGKILL", id])
        .expect("kill")
        .assert_success();
    until("task stopped", LONG, STEP, || {
        (cd.ctr().task_status(id).ok().flatten().as_deref() == Some("STOPPED")).then_some(())
    });
    cd.ctr()
        .run(&["task", "rm", id])
        .expect("task rm")
        .assert_success();
    shadow_tests::assert_exit_before_delete(&mut events, id);
    cd.ctr()
        .run(&["c", "rm", id])
        .expect("container rm")
        .assert_success();
    cd.assert_no_leftovers();
    assert!(!r.env.pair_dir(&cd, id).exists());
}

#[test]
fn bad_pair_annotations_and_configs_are_refused_leaving_nothing() {
    let cd = Containerd::start().expect("containerd");
    let env = PairEnv::new(&cd, "gms = \"off\"").expect("config");
    let out = cd
        .container(shadow_tests::Runtime::Shadow, "badgms")
        .rm()
        .flags(&["--runtime-config-path", &env.config.display().to_string()])
        .annotation("shadow.dev/pair", "true")
        .annotation("shadow.dev/gms", "tpu")
        .cmd(&["true"])
        .run()
        .expect("ctr run");
    assert_ne!(out.code(), 0);
    assert!(
        out.stderr.contains("shadow.dev/gms") && out.stderr.contains("cuda|host|off"),
        "{out}"
    );
    let bad = cd.dir().join("bad-pair.toml");
    std::fs::write(&bad, "[pair]\nstate_dir = \"relative\"\n").expect("write");
    let out = cd
        .container(shadow_tests::Runtime::Shadow, "badcfg")
        .rm()
        .flags(&["--runtime-config-path", &bad.display().to_string()])
        .annotation("shadow.dev/pair", "true")
        .cmd(&["true"])
        .run()
        .expect("ctr run");
    assert_ne!(out.code(), 0);
    assert!(
        out.stderr.contains("pair.state_dir") && out.stderr.contains("bad-pair.toml"),
        "{out}"
    );
    // A gmsd that cannot start: Create fails naming it, nothing remains.
    let nogms = cd.dir().join("nogms.toml");
    std::fs::write(
        &nogms,
        format!(
            "[pair]\nstate_dir = \"{}\"\nmetrics_dir = \"{}\"\ngms = \"host\"\ngmsd = \"/nonexistent/gmsd\"\n",
            env.state_dir.display(),
            env.metrics_dir.display()
        ),
    )
    .expect("write");
    let out = cd
        .container(shadow_tests::Runtime::Shadow, "nogms")
        .rm()
        .flags(&["--runtime-config-path", &nogms.display().to_string()])
        .annotation("shadow.dev/pair", "true")
        .cmd(&["true"])
        .run()
        .expect("ctr run");
    assert_ne!(out.code(), 0);
    assert!(out.stderr.contains("/nonexistent/gmsd"), "{out}");
    cd.assert_no_leftovers();
    assert!(!env.pair_dir(&cd, "nogms").exists());
    // A gmsd that dies before it is ready: the launcher learns it from the
    // readiness pipe at once (not at the start timeout), and says so.
    let diesgms = cd.dir().join("diesgms.toml");
    std::fs::write(
        &diesgms,
        format!(
            "[pair]\nstate_dir = \"{}\"\nmetrics_dir = \"{}\"\ngms = \"host\"\ngmsd = \"/bin/false\"\ngms_start_timeout_ms = 60000\n",
            env.state_dir.display(),
            env.metrics_dir.display()
        ),
    )
    .expect("write");
    let out = cd
        .container(shadow_tests::Runtime::Shadow, "diesgms")
        .rm()
        .flags(&["--runtime-config-path", &diesgms.display().to_string()])
        .annotation("shadow.dev/pair", "true")
        .cmd(&["true"])
        .run()
        .expect("ctr run");
    assert_ne!(out.code(), 0);
    assert!(
        out.stderr.contains("/bin/false") && out.stderr.contains("ended before it was ready"),
        "{out}"
    );
    // The death, not the start timeout (which says "was not ready within").
    assert!(!out.stderr.contains("not ready within"), "{out}");
    cd.assert_no_leftovers();
    // A bad value of the hooks' keys is refused by the shim too.
    let out = cd
        .container(shadow_tests::Runtime::Shadow, "badslot")
        .rm()
        .flags(&["--runtime-config-path", &env.config.display().to_string()])
        .annotation("shadow.dev/pair", "true")
        .annotation("shadow.dev/slot", "4")
        .cmd(&["true"])
        .run()
        .expect("ctr run");
    assert_ne!(out.code(), 0);
    assert!(
        out.stderr.contains("shadow.dev/slot") && out.stderr.contains("0 to 3"),
        "{out}"
    );
}

/// One spec serves both paths: the OCI hooks' annotations do not make the
/// shim refuse it, and `shadow.dev/pair` still makes it a pair.
#[test]
fn a_spec_with_the_hooks_annotations_runs_as_a_pair_too() {
    let cd = Containerd::start().expect("containerd");
    let id = "hookkeys";
    let r = start(
        &cd,
        id,
        "gms = \"off\"",
        &[("shadow.dev/pair-name", "llama"), ("shadow.dev/slot", "1")],
        &[],
    );
    let st = r.env.wait_protected(&cd, id, LONG);
    let (slot, _) = active_of(&st);
    assert_eq!(ask(r.port).expect("serves").slot, slot.to_string());
    r.stop(&cd, id, "SIGKILL");
}

#[test]
fn pinned_network_and_pair_cgroup_limits() {
    let cd = Containerd::start().expect("containerd");
    let id = "pinned";
    PairEnv::install_engine(&cd, Path::new(ENGINE)).expect("install engine");
    let env = PairEnv::new(&cd, "gms = \"off\"").expect("config");
    // No --net-host: the spec asks for a network namespace without a path.
    let ctr = env
        .run(
            &cd,
            id,
            &[],
            &["--rm", "--memory-limit", "67108864"],
            &["/bin/test-engine", "--port", "8000"],
        )
        .expect("ctr run");
    let st = env.wait_protected(&cd, id, LONG);
    let (slot, pid) = active_of(&st);
    let shadow = st.pids[1 - slot].expect("pid");
    let net = env.pair_dir(&cd, id).join("ns/net");
    let ns_of = |p: u32| std::fs::read_link(format!("/proc/{p}/ns/net")).expect("ns link");
    assert_eq!(
        ns_of(pid),
        ns_of(shadow),
        "both engines share one network namespace"
    );
    let ask_in_ns = || {
        let out = std::process::Command::new("nsenter")
            .arg(format!("--net={}", net.display()))
            .args(["busybox", "nc", "127.0.0.1", "8000"])
            .output()
            .ok()?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        text.contains("slot=").then_some(text)
    };
    let first = until("engine answers in the pinned netns", LONG, STEP, ask_in_ns);
    assert!(first.contains(&format!("slot={slot}")), "{first}");
    // The limit is on the pair's cgroup; both engines are below it.
    let parent = format!("/sys/fs/cgroup/memory/{}/{id}", cd.namespace());
    let limit = std::fs::read_to_string(format!("{parent}/memory.limit_in_bytes"))
        .expect("pair memory cgroup");
    assert_eq!(limit.trim(), "67108864");
    // The task's metrics are the pair cgroup's: its limit, both engines.
    let m = cd
        .ctr()
        .run(&["task", "metrics", "--format", "json", id])
        .expect("ctr task metrics");
    m.assert_success();
    let v: serde_json::Value = serde_json::from_str(&m.stdout).expect("metrics JSON");
    assert_eq!(
        v["memory"]["usage"]["limit"].as_u64(),
        Some(67108864),
        "{m}"
    );
    assert!(v["pids"]["current"].as_u64() >= Some(2), "{m}");
    for (s, p) in [(slot, pid), (1 - slot, shadow)] {
        let cg = std::fs::read_to_string(format!("/proc/{p}/cgroup")).expect("cgroup");
        assert!(
            cg.contains(&format!(":memory:/{}/{id}/s{s}", cd.namespace())),
            "{cg}"
        );
    }
    kill(pid, libc::SIGKILL);
    let again = until(
        "the other engine answers at the same address",
        LONG,
        STEP,
        || ask_in_ns().filter(|t| !t.contains(&format!("slot={slot}"))),
    );
    assert!(again.contains(&format!("slot={}", 1 - slot)), "{again}");
    cd.ctr()
        .run(&["task", "kill", "-s", "SIGKILL", id])
        .expect("kill")
        .assert_success();
    ctr.wait(LONG).expect("ctr run ends");
    cd.assert_no_leftovers();
    assert!(!Path::new(&parent).exists(), "pair cgroup left");
}

/// Two containerds on one host, each with a pair of the same namespace and
/// id, and the shim's state and metrics dirs shared (as the default
/// `/run/shadow` is): each pair has its own directory, `state.json` and
/// metrics file, and both serve. When one pair's shim is killed, its
/// containerd's cleanup removes that pair's engines, directory and metrics
/// file, and the other pair runs on untouched. (runc state and cgroups
/// are containerd's and runc's to keep apart, as for runc-v2: each
/// containerd gets its own runc root and cgroup here.)
#[test]
fn two_containerds_keep_pairs_of_the_same_name_apart() {
    let ns = format!("twocd-{}", std::process::id());
    let id = "eng";
    let shared = tempfile::tempdir().expect("shared state dir");
    let state_dir = shared.path().join("pairs");
    let metrics_dir = shared.path().join("metrics");
    let cds: Vec<Containerd> = (0..2)
        .map(|_| {
            Containerd::builder()
                .namespace(ns.clone())
                .start()
                .expect("containerd")
        })
        .collect();
    let runc_root = |cd: &Containerd| cd.dir().join("runc");
    let engines_of = |cd: &Containerd| shadow_tests::runc_containers(&runc_root(cd).join(&ns));
    // Whatever happens, no engine outlives the test.
    struct Guard<'a>(&'a [Containerd], String);
    impl Drop for Guard<'_> {
        fn drop(&mut self) {
            for cd in self.0 {
                let root = cd.dir().join("runc").join(&self.1);
                for c in shadow_tests::runc_containers(&root) {
                    let _ = std::process::Command::new("runc")
                        .arg("--root")
                        .arg(&root)
                        .args(["delete", "--force", &c])
                        .status();
                }
            }
        }
    }
    let _guard = Guard(&cds, ns.clone());

    let mut runs = Vec::new();
    for (i, cd) in cds.iter().enumerate() {
        PairEnv::install_engine(cd, Path::new(ENGINE)).expect("install engine");
        let config = cd.dir().join("shadow-pair.toml");
        std::fs::write(
            &config,
            format!(
                "log_level = \"debug\"\n[pair]\nstate_dir = \"{}\"\nmetrics_dir = \"{}\"\ngms = \"off\"\n[runc]\nroot = \"{}\"\n",
                state_dir.display(),
                metrics_dir.display(),
                runc_root(cd).display()
            ),
        )
        .expect("shim config");
        let env = PairEnv {
            state_dir: state_dir.clone(),
            metrics_dir: metrics_dir.clone(),
            config,
        };
        let port = free_port();
        let cgroup = format!("/{ns}/{id}-{i}");
        let ctr = env
            .run(
                cd,
                id,
                &[],
                &["--rm", "--net-host", "--cgroup", &cgroup],
                &["/bin/test-engine", "--port", &port.to_string()],
            )
            .expect("ctr run");
        runs.push(Running {
            env,
            port,
            ctr: Some(ctr),
        });
    }
    for (cd, r) in cds.iter().zip(&runs) {
        let st = r.env.wait_protected(cd, id, LONG);
        assert_eq!(st.containerd, cd.address().display().to_string());
        assert!(r.env.metrics_file(cd, id).is_file(), "metrics file");
        ask(r.port).expect("the pair serves");
    }
    assert_ne!(
        runs[0].env.pair_dir(&cds[0], id),
        runs[1].env.pair_dir(&cds[1], id)
    );
    assert_ne!(
        runs[0].env.metrics_file(&cds[0], id),
        runs[1].env.metrics_file(&cds[1], id)
    );

    // The first pair's shim dies; its containerd cleans up after it.
    let (cd0, r0) = (&cds[0], &mut runs[0]);
    kill_shim(cd0, id, LONG);
    let _ = r0.ctr.take().expect("ctr").wait(LONG);
    until("the dead shim's engines gone", LONG, STEP, || {
        engines_of(cd0).is_empty().then_some(())
    });
    until(
        "the dead shim's pair dir and metrics file gone",
        LONG,
        STEP,
        || {
            (!r0.env.pair_dir(cd0, id).exists() && !r0.env.metrics_file(cd0, id).exists())
                .then_some(())
        },
    );
    // `ctr run --rm` removes the task and container once the exit came.
    if cd0.ctr().task_status(id).expect("ls").is_some() {
        cd0.ctr().run(&["task", "delete", id]).expect("task delete");
    }
    if cd0.ctr().containers().expect("ls").iter().any(|c| c == id) {
        cd0.ctr()
            .run(&["c", "rm", id])
            .expect("c rm")
            .assert_success();
    }
    let cgroup0 = Path::new("/sys/fs/cgroup/memory")
        .join(&ns)
        .join(format!("{id}-0"));
    assert!(!cgroup0.exists(), "{} left", cgroup0.display());

    // The other pair never noticed.
    let r1 = runs.pop().expect("second run");
    let st = r1.env.wait_protected(&cds[1], id, LONG);
    assert_eq!(st.pair.failovers, 0);
    assert!(r1.env.metrics_file(&cds[1], id).is_file());
    ask(r1.port).expect("the other pair serves");
    r1.stop(&cds[1], id, "SIGKILL");
    assert!(engines_of(&cds[1]).is_empty());
    cds[0].assert_no_leftovers();
    assert_eq!(
        std::fs::read_dir(&metrics_dir)
            .map(|d| d.count())
            .unwrap_or(0),
        0,
        "metrics files left"
    );
}

#[test]
fn an_oom_killed_engine_is_task_oom_its_own_failure_class_and_respawned() {
    let cd = Containerd::start().expect("containerd");
    let id = "oompair";
    let env = PairEnv::new(&cd, "gms = \"off\"").expect("config");
    let mut events = cd.ctr().spawn(&["events"], false).expect("ctr events");
    // Both engines wait for the trigger file; the one whose `rm` takes it
    // reads 256 MiB into one buffer under the pair's 64 MiB limit, and the
    // OOM killer ends it.
    let script = "while :; do if rm /tmp/oom-now 2>/dev/null; then exec dd if=/dev/zero of=/dev/null bs=256M count=1; fi; sleep 0.05; done";
    let ctr = env
        .run(
            &cd,
            id,
            &[],
            &["--memory-limit", &(64u64 << 20).to_string()],
            &["sh", "-c", script],
        )
        .expect("ctr run");
    let st = until("both engines running", LONG, STEP, || {
        env.state(&cd, id)
            .filter(|s| s.pids[0].is_some() && s.pids[1].is_some())
    });
    let generations: Vec<u32> = st.pair.slots.iter().map(|s| s.generation).collect();
    std::fs::write(cd.rootfs().join("tmp/oom-now"), b"").expect("trigger");
    // The pair counts it, in state.json and in its metrics.
    until("the OOM kill counted", LONG, STEP, || {
        env.state(&cd, id).filter(|s| s.pair.oom_kills == 1)
    });
    let metrics = env.metrics_file(&cd, id);
    until("the OOM metric", LONG, STEP, || {
        std::fs::read_to_string(&metrics).ok().filter(|m| {
            m.lines()
                .any(|l| l.starts_with("shadow_pair_oom_kills_total{") && l.ends_with(" 1"))
        })
    });
    // containerd got /tasks/oom for the task, as for a plain container.
    until("a /tasks/oom event", LONG, STEP, || {
        let seen = events.stdout_so_far();
        seen.lines()
            .any(|l| l.contains("/tasks/oom") && l.contains(id))
            .then_some(())
    });
    // The killed slot came back; the task never stopped.
    let st = until("the OOM-killed slot respawned", LONG, STEP, || {
        let now = env.state(&cd, id)?;
        let respawned =
            (0..2).any(|s| now.pair.slots[s].generation > generations[s] && now.pids[s].is_some());
        respawned.then_some(now)
    });
    assert_eq!(st.pair.oom_kills, 1, "{st:?}");
    assert_eq!(
        cd.ctr().task_status(id).expect("ls").as_deref(),
        Some("RUNNING")
    );
    cd.ctr()
        .run(&["task", "kill", "--signal", "SIGKILL", id])
        .expect("kill")
        .assert_success();
    let out = ctr.wait(LONG).expect("ctr run ends");
    assert_eq!(out.code(), 137, "{out}");
    cd.ctr()
        .run(&["c", "rm", id])
        .expect("c rm")
        .assert_success();
    events.kill();
    cd.assert_no_leftovers();
    assert!(!env.pair_dir(&cd, id).exists());
}

/// The freezer state of a cgroup path (v1 `freezer.state`, v2 `cgroup.freeze`).
fn frozen(cgroup: &str) -> Option<bool> {
    let v1 = format!("/sys/fs/cgroup/freezer/{cgroup}/freezer.state");
    if let Ok(s) = std::fs::read_to_string(v1) {
        return Some(s.trim() == "FROZEN");
    }
    let v2 = format!("/sys/fs/cgroup/{cgroup}/cgroup.freeze");
    std::fs::read_to_string(v2).ok().map(|s| s.trim() == "1")
}

#[test]
fn pause_freezes_both_engines_and_resume_thaws_them_with_the_shadow_still_parked() {
    let cd = Containerd::start().expect("containerd");
    let id = "pausepair";
    let r = start(&cd, id, "gms = \"off\"", &[], &[]);
    let st = r.env.wait_protected(&cd, id, LONG);
    let (slot, pid) = active_of(&st);
    let shadow = st.pids[1 - slot].expect("shadow pid");
    let ctr = cd.ctr();
    ctr.run(&["task", "pause", id])
        .expect("pause")
        .assert_success();
    assert_eq!(ctr.task_status(id).expect("ls").as_deref(), Some("PAUSED"));
    // ctr's default cgroupsPath is /<namespace>/<id>: the pair's cgroup,
    // with the engines' below it (and gmsd's, which keeps running).
    let pair_cg = format!("{}/{id}", cd.namespace());
    let engines = [format!("{pair_cg}/s0"), format!("{pair_cg}/s1")];
    for cg in &engines {
        assert_eq!(frozen(cg), Some(true), "{cg} not frozen after pause");
    }
    // Exec into a paused pair is refused, as runc refuses it.
    let out = cd.exec(id, "in-pause", &["true"]).expect("ctr task exec");
    assert_ne!(out.code(), 0, "{out}");
    ctr.run(&["task", "resume", id])
        .expect("resume")
        .assert_success();
    assert_eq!(ctr.task_status(id).expect("ls").as_deref(), Some("RUNNING"));
    for cg in &engines {
        assert_eq!(frozen(cg), Some(false), "{cg} still frozen after resume");
    }
    // The same engines, in the same roles: nothing died, nothing respawned.
    let after = r.env.wait_protected(&cd, id, LONG);
    assert_eq!(active_of(&after), (slot, pid));
    assert_eq!(after.pids[1 - slot], Some(shadow));
    assert_eq!(after.pair.failovers, 0);
    for s in 0..2 {
        assert_eq!(after.pair.slots[s].generation, st.pair.slots[s].generation);
    }
    assert_eq!(
        until("the active serves again", LONG, STEP, || ask(r.port)).slot,
        slot.to_string()
    );
    // Kill of a paused pair thaws it, so that the engines can end.
    ctr.run(&["task", "pause", id])
        .expect("pause again")
        .assert_success();
    r.stop(&cd, id, "SIGKILL");
}

#[test]
fn exec_with_a_terminal_runs_in_the_active_engine() {
    let cd = Containerd::start().expect("containerd");
    let id = "ttyexec";
    let r = start(&cd, id, "gms = \"off\"", &[], &[]);
    let st = r.env.wait_protected(&cd, id, LONG);
    let (slot, _) = active_of(&st);
    // `ctr task exec -t` needs a terminal of its own: script(1) gives it one.
    let mut exec = cd
        .ctr()
        .spawn_tty(&[
            "task",
            "exec",
            "-t",
            "--exec-id",
            "tty1",
            id,
            "sh",
            "-c",
            "tty; [ -t 0 ] && [ -t 1 ] && echo both-ttys; echo slot=$SHADOW_ENGINE_ID; read x; exit 3",
        ])
        .expect("ctr task exec -t");
    let tty = exec
        .wait_line(LONG, |l| l.starts_with("/dev/"))
        .expect("the exec prints its terminal");
    assert!(tty.starts_with("/dev/pts/"), "not a pty: {tty:?}");
    exec.wait_line(LONG, |l| l == "both-ttys")
        .expect("stdin and stdout are ttys");
    exec.wait_line(LONG, |l| l == format!("slot={slot}"))
        .expect("the exec runs in the active engine");
    exec.write_stdin(b"bye\n").expect("type a line");
    let out = exec.wait(LONG).expect("ctr task exec -t ends");
    assert_eq!(out.code(), 3, "{out}");
    r.stop(&cd, id, "SIGKILL");
}

/// Whether `pid` still runs (a zombie waiting for its reaper does not).
fn runs(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rsplit_once(") ")
            .is_some_and(|(_, rest)| !rest.starts_with('Z') && !rest.starts_with('X'))
    })
}

#[test]
fn in_the_host_pid_namespace_what_an_engine_leaves_dies_before_the_exit() {
    let cd = Containerd::start().expect("containerd");
    let id = "hostpidpair";
    let env = PairEnv::new(&cd, "gms = \"off\"").expect("config");
    // The test's own PID namespace: the host's, or the one the suite runs in.
    let pid_ns = format!("pid:/proc/{}/ns/pid", std::process::id());
    let script = "sleep 100000 & echo $! > /tmp/child-$SHADOW_ENGINE_ID.new; mv /tmp/child-$SHADOW_ENGINE_ID.new /tmp/child-$SHADOW_ENGINE_ID; exec sleep 100001";
    // Detached: nothing deletes the task (whose Delete kills everything
    // anyway) before the check.
    let out = env
        .run(
            &cd,
            id,
            &[],
            &["--detach", "--with-ns", &pid_ns],
            &["sh", "-c", script],
        )
        .expect("ctr run --detach")
        .wait(LONG)
        .expect("ctr run --detach returns");
    out.assert_success();
    let children: Vec<u32> = (0..2)
        .map(|s| {
            let f = cd.rootfs().join(format!("tmp/child-{s}"));
            until(&format!("slot {s}'s child"), LONG, STEP, || {
                std::fs::read_to_string(&f).ok()?.trim().parse().ok()
            })
        })
        .collect();
    for c in &children {
        assert!(runs(*c), "child {c} is not running");
    }
    cd.ctr()
        .run(&["task", "kill", "--signal", "SIGKILL", id])
        .expect("kill")
        .assert_success();
    until("task STOPPED", LONG, STEP, || {
        (cd.ctr().task_status(id).ok()?.as_deref() == Some("STOPPED")).then_some(())
    });
    // Reported stopped: whatever the engines left is dead, or being reaped.
    until("the engines' children gone", LONG, STEP, || {
        children.iter().all(|c| !runs(*c)).then_some(())
    });
    cd.ctr()
        .run(&["task", "delete", id])
        .expect("task delete")
        .assert_success();
    cd.ctr()
        .run(&["c", "rm", id])
        .expect("c rm")
        .assert_success();
    cd.assert_no_leftovers();
    assert!(!env.pair_dir(&cd, id).exists());
}

/// What a pair whose shim died left, when containerd could not clean up
/// (its directory with a file in it, its metrics file), is removed by the
/// next Create of the same id, which then runs.
#[test]
fn a_dead_pairs_files_are_removed_by_the_next_create_of_its_id() {
    let cd = Containerd::start().expect("containerd");
    let id = "stale";
    PairEnv::install_engine(&cd, Path::new(ENGINE)).expect("install engine");
    let env = PairEnv::new(&cd, "gms = \"off\"").expect("config");
    let dir = env.pair_dir(&cd, id);
    std::fs::create_dir_all(dir.join("pair")).expect("stale pair dir");
    std::fs::write(dir.join("pair/left-behind"), "x").expect("stale file");
    let metrics = env.metrics_file(&cd, id);
    std::fs::create_dir_all(&env.metrics_dir).expect("metrics dir");
    std::fs::write(&metrics, "shadow_pair_protected{stale=\"1\"} 1\n").expect("stale metrics");
    let port = free_port().to_string();
    let ctr = env
        .run(
            &cd,
            id,
            &[],
            &["--rm", "--net-host"],
            &["/bin/test-engine", "--port", &port],
        )
        .expect("ctr run");
    env.wait_protected(&cd, id, LONG);
    assert!(!dir.join("pair/left-behind").exists(), "stale file kept");
    until("fresh metrics", LONG, STEP, || {
        std::fs::read_to_string(&metrics)
            .ok()
            .filter(|m| !m.contains("stale=") && m.contains("shadow_pair_protected{"))
    });
    let r = Running {
        env,
        port: port.parse().expect("port"),
        ctr: Some(ctr),
    };
    r.stop(&cd, id, "SIGKILL");
}

#[test]
fn the_tasks_stdin_reaches_the_first_engine_and_the_other_reads_dev_null() {
    let cd = Containerd::start().expect("containerd");
    let id = "stdin";
    let env = PairEnv::new(&cd, "gms = \"off\"").expect("config");
    let config = env.config.display().to_string();
    // Each engine echoes the first line it reads, then stays (sleep as the
    // init of its pid namespace ignores SIGTERM: the test kills with SIGKILL).
    let script = "read line; echo \"got-[$line]-in-$SHADOW_ENGINE_ID\"; exec sleep 600";
    let mut ctr = cd
        .container(shadow_tests::Runtime::Shadow, id)
        .flags(&["--runtime-config-path", &config])
        .annotation(shadow_contract::annotations::PAIR, "true")
        .flags(&["--rm"])
        .cmd(&["sh", "-c", script])
        .spawn(true)
        .expect("ctr run");
    ctr.write_stdin(b"hello\n").expect("write stdin");
    ctr.close_stdin();
    let echoed = ctr.wait_line(LONG, |l| l.starts_with("got-[hello]-in-"));
    let other = ctr.wait_line(LONG, |l| l.starts_with("got-[]-in-"));
    let killed = cd.ctr().run(&["task", "kill", "-s", "SIGKILL", id]);
    let out = ctr.wait(LONG).expect("ctr run ends");
    killed.expect("kill").assert_success();
    let echoed = echoed.unwrap_or_else(|e| panic!("no engine echoed the task's stdin: {e}; {out}"));
    let other = other.unwrap_or_else(|e| panic!("the other engine read nothing: {e}; {out}"));
    assert_ne!(
        echoed.rsplit('-').next(),
        other.rsplit('-').next(),
        "one engine each: {out}"
    );
    assert_eq!(
        out.stdout
            .lines()
            .filter(|l| l.starts_with("got-[hello]"))
            .count(),
        1,
        "the input went to one engine only: {out}"
    );
    cd.assert_no_leftovers();
    assert!(!env.pair_dir(&cd, id).exists());
}

/// A pair whose spec has a user namespace (root mapped onto root, so that
/// the rootfs needs no chown): runc mounts `/dev/mqueue`, which fails (EPERM)
/// when the engine joins an IPC namespace its user namespace does not own.
/// `ctr run --uidmap` is ignored with `--rootfs`: the spec comes from a file.
#[test]
fn a_pair_in_a_user_namespace_mounts_mqueue_and_fails_over() {
    // The shim config through containerd's environment: ctr 2.1+ cannot
    // send `--runtime-config-path` with a uid mapping to a runtime not
    // named io.containerd.runc* (docs/operator-ctr.md).
    let cd = Containerd::builder()
        .env("SHADOW_CONFIG", "@DIR@/shadow-pair.toml")
        .start()
        .expect("containerd");
    let id = "userns";
    shadow_tests::pair::install_binary(cd.rootfs(), Path::new("/usr/bin/flock"), "/usr/bin/flock")
        .expect("install flock");
    let env = PairEnv::new(&cd, "gms = \"off\"").expect("config");
    assert_eq!(env.config, cd.dir().join("shadow-pair.toml"));
    let default = cd.ctr().run(&["oci", "spec"]).expect("ctr oci spec");
    default.assert_success();
    let mut spec: serde_json::Value = serde_json::from_str(&default.stdout).expect("spec json");
    spec["root"] = serde_json::json!({"path": cd.rootfs().display().to_string()});
    spec["process"]["args"] = serde_json::json!([
        "sh",
        "-c",
        "grep -q mqueue /proc/mounts && echo mq-in-$SHADOW_ENGINE_ID; exec /usr/bin/flock \"$SHADOW_LOCK_PATH\" sleep 600"
    ]);
    spec["process"]["env"] = serde_json::json!(["PATH=/bin:/sbin:/usr/bin:/usr/sbin"]);
    spec["annotations"] = serde_json::json!({shadow_contract::annotations::PAIR: "true"});
    let map = serde_json::json!([{"containerID": 0, "hostID": 0, "size": 65536}]);
    spec["linux"]["uidMappings"] = map.clone();
    spec["linux"]["gidMappings"] = map;
    spec["linux"]["namespaces"]
        .as_array_mut()
        .expect("namespaces")
        .push(serde_json::json!({"type": "user"}));
    let file = env.config.with_file_name("userns-spec.json");
    std::fs::write(&file, spec.to_string()).expect("write spec");
    let mut ctr = cd
        .ctr()
        .spawn(
            &[
                "run",
                "--runtime",
                shadow_tests::Runtime::Shadow.runtime_type(),
                "--rm",
                "--config",
                &file.display().to_string(),
                id,
            ],
            false,
        )
        .expect("ctr run");
    let mq = |l: &str| l.starts_with("mq-in-");
    let first = [ctr.wait_line(LONG, mq), ctr.wait_line(LONG, mq)];
    let failed_over = first.iter().all(Result::is_ok).then(|| {
        // No sd_notify: the shim learns the active engine from the lock.
        let st = until("protected by a waiter on the lock", LONG, STEP, || {
            env.state(&cd, id).filter(|v| v.pair.protected)
        });
        let (slot, pid) = active_of(&st);
        kill(pid, libc::SIGKILL);
        let respawned = ctr.wait_line(LONG, move |l| l == format!("mq-in-{slot}"));
        until("promotion recorded", LONG, STEP, || {
            env.state(&cd, id).filter(|v| {
                v.pair.failovers == 1 && v.pair.active.map(usize::from) == Some(1 - slot)
            })
        });
        respawned
    });
    let killed = cd.ctr().run(&["task", "kill", "-s", "SIGKILL", id]);
    let out = ctr.wait(LONG).expect("ctr run ends");
    let _ = std::fs::remove_file(&file);
    killed.expect("kill").assert_success();
    for line in first {
        line.unwrap_or_else(|e| panic!("an engine did not start with mqueue: {e}; {out}"));
    }
    failed_over
        .expect("both started")
        .unwrap_or_else(|e| panic!("the killed engine did not come back: {e}; {out}"));
    cd.assert_no_leftovers();
    assert!(!env.pair_dir(&cd, id).exists());
}
