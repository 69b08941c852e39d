//! Container behaviour through `ctr`, written once and run against both
//! runtimes: `runc_v2::*` proves each test right against containerd's own
//! shim, `shadow::*` holds our shim to the same behaviour.

use shadow_tests::wait::{poll, until};
use shadow_tests::{Containerd, Runtime, Spawned};
use std::time::{Duration, Instant};

/// Generous: the machine is small and shared; a wait is for an event and
/// only fails the test when the event never comes.
const WAIT: Duration = Duration::from_secs(60);

/// Start a container that prints `ready` and then idles; return its `ctr run`.
fn start_idle(cd: &Containerd, rt: Runtime, id: &str, script: &str) -> Spawned {
    let mut run = cd
        .container(rt, id)
        .rm()
        .cmd(&["sh", "-c", script])
        .spawn(false)
        .expect("start ctr run");
    run.wait_line(WAIT, |l| l.contains("ready"))
        .unwrap_or_else(|e| panic!("container {id} never got ready: {e}"));
    run
}

const IDLE: &str = "echo ready; exec sleep 100000";

/// `ctr run --detach` of an idle container; returns once it runs.
fn start_detached(cd: &Containerd, rt: Runtime, id: &str) {
    cd.container(rt, id)
        .flags(&["--detach"])
        .cmd(&["sh", "-c", IDLE])
        .run()
        .expect("ctr run --detach")
        .assert_success();
    until(
        &format!("{id} RUNNING"),
        WAIT,
        Duration::from_millis(20),
        || (cd.ctr().task_status(id).expect("task ls").as_deref() == Some("RUNNING")).then_some(()),
    );
}

fn kill9(cd: &Containerd, id: &str) {
    cd.ctr()
        .run(&["task", "kill", "--signal", "SIGKILL", id])
        .expect("ctr task kill")
        .assert_success();
}

fn stdout_and_stderr(rt: Runtime) {
    let cd = Containerd::start().expect("start containerd");
    // The container holds on (reading stdin) until the test has seen all its
    // output: what is checked is delivery, not a race between the last write
    // and the exit (which ctr can lose under load, even with runc-v2).
    let mut run = cd
        .container(rt, "echo")
        .rm()
        .cmd(&[
            "sh",
            "-c",
            "echo to-stderr >&2; echo hello from the container; echo second line; read x; exit 0",
        ])
        .spawn(true)
        .expect("start ctr run");
    run.wait_output(WAIT, |out, err| {
        out.ends_with("second line\n") && err.contains("to-stderr\n")
    })
    .expect("all output delivered");
    run.write_stdin(b"done\n").expect("write stdin");
    let out = run.wait(WAIT).expect("ctr run ends");
    out.assert_success();
    assert_eq!(
        out.stdout, "hello from the container\nsecond line\n",
        "{out}"
    );
    assert_eq!(out.stderr_without_client_warnings(), "to-stderr\n", "{out}");
    cd.assert_no_leftovers();
}

fn exit_codes(rt: Runtime) {
    let cd = Containerd::start().expect("start containerd");
    for (i, code) in [0, 3].into_iter().enumerate() {
        let out = cd
            .container(rt, &format!("exit{i}"))
            .rm()
            .cmd(&["sh", "-c", &format!("exit {code}")])
            .run()
            .expect("ctr run");
        assert_eq!(out.code(), code, "{out}");
    }
    cd.assert_no_leftovers();
}

fn kill_9_gives_137(rt: Runtime) {
    let cd = Containerd::start().expect("start containerd");
    let run = start_idle(&cd, rt, "victim", IDLE);
    kill9(&cd, "victim");
    let out = run.wait(WAIT).expect("ctr run ends");
    assert_eq!(out.code(), 137, "{out}");
    cd.assert_no_leftovers();
}

fn sigterm_reaches_a_trapping_process(rt: Runtime) {
    let cd = Containerd::start().expect("start containerd");
    // PID 1 ignores SIGTERM unless it handles it: trap it and exit with a
    // code of our own, so the test tells "handled" from "killed".
    let run = start_idle(
        &cd,
        rt,
        "term",
        // The pause after the echo: runc-v2 itself was seen to lose a line
        // written in the instant before its process exits (exit 42, no
        // got-term), and this test is about the signal, not that race.
        "trap 'echo got-term; sleep 0.2; exit 42' TERM; echo ready; while :; do sleep 0.1; done",
    );
    cd.ctr()
        .run(&["task", "kill", "--signal", "SIGTERM", "term"])
        .expect("ctr task kill")
        .assert_success();
    let out = run.wait(WAIT).expect("ctr run ends");
    assert_eq!(out.code(), 42, "{out}");
    assert!(out.stdout.contains("got-term"), "{out}");
    cd.assert_no_leftovers();
}

fn stdin_through_cat(rt: Runtime) {
    let cd = Containerd::start().expect("start containerd");
    let mut run = cd
        .container(rt, "cat")
        .rm()
        .cmd(&["cat"])
        .spawn(true)
        .expect("start ctr run");
    run.write_stdin(b"line one through stdin\n")
        .expect("write stdin");
    run.wait_line(WAIT, |l| l == "line one through stdin")
        .expect("cat echoes line one");
    run.write_stdin(b"line two\n").expect("write stdin");
    run.wait_line(WAIT, |l| l == "line two")
        .expect("cat echoes line two");
    // ctr 1.6 does not close the task's stdin when its own closes, so cat
    // would wait forever: end it with a signal.
    kill9(&cd, "cat");
    let out = run.wait(WAIT).expect("ctr run ends");
    assert_eq!(out.code(), 137, "{out}");
    assert_eq!(out.stdout, "line one through stdin\nline two\n", "{out}");
    cd.assert_no_leftovers();
}

fn exec_has_its_own_exit_code(rt: Runtime) {
    let cd = Containerd::start().expect("start containerd");
    let run = start_idle(&cd, rt, "host", IDLE);
    let out = cd
        .exec(
            "host",
            "e1",
            &["sh", "-c", "echo in-exec; echo exec-err >&2; exit 5"],
        )
        .expect("ctr task exec");
    assert_eq!(out.code(), 5, "{out}");
    assert_eq!(out.stdout, "in-exec\n", "{out}");
    assert!(out.stderr.contains("exec-err"), "{out}");
    let ok = cd.exec("host", "e2", &["true"]).expect("ctr task exec");
    assert_eq!(ok.code(), 0, "{ok}");
    // The exec's exit did not end the task.
    assert_eq!(
        cd.ctr().task_status("host").expect("task ls").as_deref(),
        Some("RUNNING")
    );
    kill9(&cd, "host");
    assert_eq!(run.wait(WAIT).expect("ctr run ends").code(), 137);
    cd.assert_no_leftovers();
}

/// Whether `pid` still runs (a zombie waiting for its reaper does not).
fn runs(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command's closing parenthesis.
        Ok(stat) => stat
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| !rest.starts_with('Z') && !rest.starts_with('X')),
        Err(_) => false,
    }
}

fn killing_init_in_the_host_pid_namespace_kills_the_rest(rt: Runtime) {
    let cd = Containerd::start().expect("start containerd");
    let ctr = cd.ctr();
    // In the host's PID namespace the kernel does not end the container's
    // other processes when its init dies: the shim must, before it reports
    // the exit (runc-v2 runs `runc kill --all`; containerd's suite,
    // TestContainerKillInitPidHost). Detached, so that nothing deletes the
    // task (whose Delete kills everything anyway) before the check.
    // The test's own PID namespace: the host's, or the one the suite runs in.
    let pid_ns = format!("pid:/proc/{}/ns/pid", std::process::id());
    cd.container(rt, "hostpid")
        .flags(&["--detach", "--with-ns", &pid_ns])
        .cmd(&[
            "sh",
            "-c",
            "sleep 100000 & echo $! > /tmp/child.new; mv /tmp/child.new /tmp/child; exec sleep 100001",
        ])
        .run()
        .expect("ctr run --detach")
        .assert_success();
    let child_file = cd.rootfs().join("tmp/child");
    // One WAIT for the pid and the stop together.
    let started = Instant::now();
    let child: u32 = until(
        "the container to write its child's pid",
        WAIT,
        Duration::from_millis(20),
        || {
            let text = std::fs::read_to_string(&child_file).ok()?;
            Some(text.trim().parse().expect("child pid"))
        },
    );
    assert!(runs(child), "the container's child {child} is not running");
    kill9(&cd, "hostpid");
    until(
        "the task STOPPED after SIGKILL",
        WAIT.saturating_sub(started.elapsed()),
        Duration::from_millis(20),
        || {
            (ctr.task_status("hostpid").expect("task ls").as_deref() == Some("STOPPED"))
                .then_some(())
        },
    );
    // Reported stopped: whatever was left is dead, or being reaped.
    until(
        &format!("the init's child {child} to die after the reported exit"),
        WAIT,
        Duration::from_millis(20),
        || (!runs(child)).then_some(()),
    );
    ctr.run(&["task", "delete", "hostpid"])
        .expect("task delete")
        .assert_success();
    ctr.run(&["containers", "delete", "hostpid"])
        .expect("container delete")
        .assert_success();
    cd.assert_no_leftovers();
}

fn task_ps_lists_processes(rt: Runtime) {
    let cd = Containerd::start().expect("start containerd");
    let run = start_idle(&cd, rt, "ps", "sleep 100000 & echo ready; wait");
    let init = cd
        .ctr()
        .tasks()
        .expect("task ls")
        .into_iter()
        .find(|t| t.id == "ps")
        .expect("task listed");
    let out = cd.ctr().run(&["task", "ps", "ps"]).expect("ctr task ps");
    out.assert_success();
    let pids: Vec<u32> = out
        .stdout
        .lines()
        .skip(1)
        .filter_map(|l| l.split_whitespace().next()?.parse().ok())
        .collect();
    assert!(
        pids.contains(&init.pid),
        "init pid {} not in {out}",
        init.pid
    );
    assert_eq!(pids.len(), 2, "expected the shell and its sleep: {out}");
    kill9(&cd, "ps");
    assert_eq!(run.wait(WAIT).expect("ctr run ends").code(), 137);
    cd.assert_no_leftovers();
}

/// The freezer state of the task's cgroup (v1 `freezer.state`, v2 `cgroup.freeze`).
fn frozen(cd: &Containerd, id: &str) -> Option<bool> {
    let v1 = format!(
        "/sys/fs/cgroup/freezer/{}/{id}/freezer.state",
        cd.namespace()
    );
    if let Ok(s) = std::fs::read_to_string(v1) {
        return Some(s.trim() == "FROZEN");
    }
    let v2 = format!("/sys/fs/cgroup/{}/{id}/cgroup.freeze", cd.namespace());
    std::fs::read_to_string(v2).ok().map(|s| s.trim() == "1")
}

fn pause_and_resume(rt: Runtime) {
    let cd = Containerd::start().expect("start containerd");
    // The loop counts into a file of the rootfs, which the host can read:
    // progress is visible without going through the task's stdout.
    let tick = cd.rootfs().join("tmp/tick");
    let ticks = || -> u64 {
        std::fs::read_to_string(&tick)
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0)
    };
    let run = start_idle(
        &cd,
        rt,
        "pz",
        "echo ready; i=0; while :; do i=$((i+1)); echo $i > /tmp/tick.new; mv /tmp/tick.new /tmp/tick; sleep 0.02; done",
    );
    let ctr = cd.ctr();
    ctr.run(&["task", "pause", "pz"])
        .expect("pause")
        .assert_success();
    assert_eq!(
        ctr.task_status("pz").expect("task ls").as_deref(),
        Some("PAUSED")
    );
    assert_eq!(
        frozen(&cd, "pz"),
        Some(true),
        "cgroup not frozen after pause"
    );
    let at_pause = ticks();
    ctr.run(&["task", "resume", "pz"])
        .expect("resume")
        .assert_success();
    assert_eq!(
        ctr.task_status("pz").expect("task ls").as_deref(),
        Some("RUNNING")
    );
    assert_eq!(
        frozen(&cd, "pz"),
        Some(false),
        "cgroup still frozen after resume"
    );
    // It runs again: the count moves past where the freeze held it.
    until(
        &format!("progress after resume (stuck at {at_pause})"),
        WAIT,
        Duration::from_millis(10),
        || (ticks() > at_pause).then_some(()),
    );
    kill9(&cd, "pz");
    assert_eq!(run.wait(WAIT).expect("ctr run ends").code(), 137);
    cd.assert_no_leftovers();
}

fn task_metrics(rt: Runtime) {
    let cd = Containerd::start().expect("start containerd");
    let run = start_idle(&cd, rt, "m", IDLE);
    let out = cd
        .ctr()
        .run(&["task", "metrics", "m"])
        .expect("ctr task metrics");
    out.assert_success();
    assert!(out.stdout.contains("pids.current"), "{out}");
    assert!(
        out.stdout.contains("memory.usage_in_bytes") || out.stdout.contains("memory.usage"),
        "{out}"
    );
    let json = cd
        .ctr()
        .run(&["task", "metrics", "--format", "json", "m"])
        .expect("ctr task metrics json");
    json.assert_success();
    let v: serde_json::Value = serde_json::from_str(&json.stdout).expect("metrics json parses");
    assert!(v.get("pids").is_some() || v.get("Pids").is_some(), "{json}");
    kill9(&cd, "m");
    assert_eq!(run.wait(WAIT).expect("ctr run ends").code(), 137);
    cd.assert_no_leftovers();
}

fn run_with_tty(rt: Runtime) {
    let cd = Containerd::start().expect("start containerd");
    // As above, the container waits for a line (typed into the terminal)
    // after printing, so the check is of the terminal, not of a race.
    let mut run = cd
        .container(rt, "tty")
        .rm()
        .cmd(&[
            "sh",
            "-c",
            "tty; [ -t 0 ] && [ -t 1 ] && echo both-ttys; read x; exit 4",
        ])
        .spawn_tty()
        .expect("start ctr run -t");
    let tty = run
        .wait_line(WAIT, |l| l.starts_with("/dev/"))
        .expect("tty prints the terminal");
    assert!(tty.starts_with("/dev/pts/"), "not a pty: {tty:?}");
    run.wait_line(WAIT, |l| l == "both-ttys")
        .expect("stdin and stdout are ttys");
    run.write_stdin(b"bye\n").expect("type a line");
    let out = run.wait(WAIT).expect("ctr run -t ends");
    assert_eq!(out.code(), 4, "{out}");
    cd.assert_no_leftovers();
}

fn survives_containerd_restart(rt: Runtime) {
    let mut cd = Containerd::start().expect("start containerd");
    let ctr = cd.ctr();
    // Detached: since containerd 2.0 a foreground `ctr run` kills its task
    // (a deferred Delete with WithProcessKill) once containerd answers again.
    start_detached(&cd, rt, "long");
    let before = ctr.tasks().expect("task ls");
    let pid = before
        .iter()
        .find(|t| t.id == "long")
        .expect("task listed")
        .pid;
    cd.restart().expect("restart containerd");
    assert!(
        std::path::Path::new(&format!("/proc/{pid}")).exists(),
        "task process {pid} died with containerd"
    );
    let after = ctr.tasks().expect("task ls after restart");
    let t = after
        .iter()
        .find(|t| t.id == "long")
        .expect("task still listed after restart");
    assert_eq!((t.pid, t.status.as_str()), (pid, "RUNNING"), "{after:?}");
    let exec = cd
        .exec("long", "after-restart", &["echo", "still here"])
        .expect("exec after restart");
    assert_eq!(exec.stdout, "still here\n", "{exec}");
    // The shim's first event after the restart meets a dead connection:
    // the exit must still reach containerd, and before the delete.
    let mut events = cd.subscribe_events().expect("ctr events");
    kill9(&cd, "long");
    // ctr 1.6 has no `task wait`: watch the status through the restarted daemon.
    until(
        "the task STOPPED after SIGKILL",
        WAIT,
        Duration::from_millis(20),
        || (ctr.task_status("long").expect("task ls").as_deref() == Some("STOPPED")).then_some(()),
    );
    ctr.run(&["task", "delete", "long"])
        .expect("task delete")
        .assert_success();
    // Ours only: runc-v2 has been seen to lose its delete event here (once
    // in four runs under containerd 2.2.7: the exit came, the delete never).
    if rt == Runtime::Shadow {
        shadow_tests::assert_exit_before_delete(&mut events, "long");
    } else {
        events.kill();
    }
    ctr.run(&["containers", "delete", "long"])
        .expect("container delete")
        .assert_success();
    cd.assert_no_leftovers();
}

/// containerd is down when the task dies: the shim holds the exit until
/// containerd is back, and it arrives before the delete that follows.
/// containerd logs each event it takes (at debug level, trace in 2.x), in
/// order. Ours
/// alone: containerd 1.6's runc-v2 loses this exit (containerd takes only
/// its delete), so there is no runc-v2 arm to prove the test with.
#[test]
fn an_exit_while_containerd_is_down_arrives_before_the_delete() {
    let rt = Runtime::Shadow;
    let mut cd = Containerd::builder()
        .log_level("trace")
        .start()
        .expect("start containerd");
    start_detached(&cd, rt, "downexit");
    let pid = cd
        .ctr()
        .tasks()
        .expect("task ls")
        .iter()
        .find(|t| t.id == "downexit")
        .expect("task listed")
        .pid;
    cd.stop().expect("stop containerd");
    // containerd is not there to ask: kill(2) the task's init directly.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::SIGKILL,
    )
    .expect("kill the task's init");
    // The shim reaps it (a zombie stays in /proc until then).
    until(
        &format!("pid {pid} to be reaped"),
        WAIT,
        Duration::from_millis(10),
        || (!std::path::Path::new(&format!("/proc/{pid}")).exists()).then_some(()),
    );
    let log_before = std::fs::read_to_string(cd.log()).unwrap_or_default().len();
    cd.restart().expect("start containerd again");
    let ctr = cd.ctr();
    let deleted = ctr
        .run(&["task", "delete", "downexit"])
        .expect("task delete");
    let log_since = || {
        let log = std::fs::read_to_string(cd.log()).unwrap_or_default();
        log[log_before.min(log.len())..].to_string()
    };
    if !deleted.status.success() {
        // containerd >= 2.0 takes a shim whose task has no processes left
        // for leaked when it loads it, and deletes the task without an
        // event (runc-v2 alike, seen with 2.2.7 and 2.3.4); 1.6 keeps it
        // for the shim's exit and the client's delete, checked below.
        let major = shadow_tests::containerd_version().map_or(0, |v| v.0);
        assert!(
            major >= 2
                && deleted.stderr.contains("not found")
                && log_since().contains("cleaning leaked shim process"),
            "{deleted}"
        );
        ctr.run(&["containers", "delete", "downexit"])
            .expect("container delete")
            .assert_success();
        cd.assert_no_leftovers();
        return;
    }
    // What containerd took from the shim ("event forwarded": debug in 1.6,
    // trace in 2.x) and what it published itself ("event published").
    // Until the delete shows; the check below names what was seen if never.
    let (Ok(topics) | Err(topics)) = poll(WAIT, Duration::from_millis(20), || {
        let topics: Vec<String> = log_since()
            .lines()
            .filter(|l| l.contains("event forwarded") || l.contains("event published"))
            .filter_map(|l| {
                l.split_whitespace()
                    .find_map(|w| w.strip_prefix("topic="))
                    .map(|t| t.trim_matches('"').to_string())
            })
            .filter(|t| t.starts_with("/tasks/"))
            .collect();
        if topics.iter().any(|t| t == "/tasks/delete") {
            Ok(topics)
        } else {
            Err(topics)
        }
    });
    let exit = topics.iter().position(|t| t == "/tasks/exit");
    let delete = topics.iter().position(|t| t == "/tasks/delete");
    assert!(
        matches!((exit, delete), (Some(e), Some(d)) if e < d),
        "task events containerd took after its restart: {topics:?}\n{}",
        cd.log_tail(40)
    );
    ctr.run(&["containers", "delete", "downexit"])
        .expect("container delete")
        .assert_success();
    cd.assert_no_leftovers();
}

shadow_tests::runtime_arms!(
    stdout_and_stderr,
    exit_codes,
    kill_9_gives_137,
    sigterm_reaches_a_trapping_process,
    stdin_through_cat,
    exec_has_its_own_exit_code,
    killing_init_in_the_host_pid_namespace_kills_the_rest,
    task_ps_lists_processes,
    pause_and_resume,
    task_metrics,
    run_with_tty,
    survives_containerd_restart,
);
