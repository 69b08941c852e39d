//! The notify socket (docs/security.md, "The notify socket"): a parked
//! shadow that passes fds, floods or sends garbage on `NOTIFY_SOCKET` must
//! not freeze the shim (State and Kill answer within [`ANSWER`] throughout)
//! nor grow it past [`RSS_CAP_KIB`] or spend more than [`CPU_CAP`] on it;
//! the pair still fails over afterwards and ends with nothing left.

use super::control::{hostile_env, LONG};
use shadow_contract::state::PairState;
use shadow_tests::pair::PairEnv;
use shadow_tests::wait::{poll, until, within};
use shadow_tests::{our_processes, Containerd, Spawned};
use std::time::Duration;

/// How long one `ctr task ps` / `ctr task kill` may take while an engine
/// attacks: generous for a loaded CI machine, far below what the attacks
/// used to cost (a 60 s freeze, minutes of flood backlog).
const ANSWER: Duration = Duration::from_secs(5);
/// The shim's resident memory, at most, while an engine floods it (an idle
/// debug shim is about 6-10 MiB).
const RSS_CAP_KIB: u64 = 64 * 1024;

/// The shim's CPU time (user + system) spent while an engine attacks, at
/// most: the notify socket must not turn an engine's flood into a core of
/// the node's CPU outside the pod's cgroup.
const CPU_CAP: Duration = Duration::from_secs(1);

/// The CPU time `pid` has used so far (utime + stime of /proc/<pid>/stat).
fn cpu_time(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command (which may hold spaces) end with ')'.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = [11, 12]
        .iter()
        .filter_map(|i| fields.get(*i)?.parse::<u64>().ok())
        .sum();
    // SAFETY: sysconf takes a constant and touches no memory.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Duration::from_millis(ticks * 1000 / hz)
}

/// The pid of the shim serving `id` under `cd`.
fn shim_pid(cd: &Containerd, id: &str) -> u32 {
    until("the pair's shim", LONG, Duration::from_millis(20), || {
        our_processes(cd.dir(), cd.address())
            .into_iter()
            .find(|(_, cmd)| {
                let words: Vec<&str> = cmd.split_whitespace().collect();
                words
                    .first()
                    .is_some_and(|w| w.ends_with(shadow_tests::SHIM_BINARY))
                    && words.windows(2).any(|w| w == ["-id", id])
            })
            .map(|(pid, _)| pid as u32)
    })
}

/// The resident memory of `pid` in KiB (VmRSS), 0 once it is gone.
fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// `ctr task ps <id>` answers within [`ANSWER`]; the shim stays under the cap.
fn assert_answers(cd: &Containerd, id: &str, shim: u32, during: &str) {
    let out = cd
        .ctr()
        .run_timeout(&["task", "ps", id], ANSWER)
        .unwrap_or_else(|e| panic!("ctr task ps {during}: {e}"));
    out.assert_success();
    let rss = rss_kib(shim);
    assert!(
        rss < RSS_CAP_KIB,
        "shim {shim} resident {rss} KiB {during} (cap {RSS_CAP_KIB} KiB)"
    );
}

/// Runs a pair of `hostile-engine <attack> <args>`: one engine serves, the
/// other attacks as the parked shadow. While the attack lasts (until its
/// `step=attacked` line) the shim must answer and stay small; then the
/// pair must still be protected by the attacker, fail over to it and end
/// cleanly. The attacks that say `READY=1` without the lock (the flood)
/// must not move the active either: only the lock's holder is believed
/// (`ready_liar.rs` tests that alone).
fn survive(id: &str, attack: &str, args: &[&str]) {
    survive_with(id, attack, args, &[]);
}

/// [`survive`], the pair made with `annotations`; the state after the
/// attack, before the failover.
fn survive_with(id: &str, attack: &str, args: &[&str], annotations: &[(&str, &str)]) -> PairState {
    survive_checking(id, attack, args, annotations, |_, _, _, _| {})
}

/// [`survive_with`], running `after` (given the shim's pid and how many
/// descriptors it held before the attack) once the attack has ended and
/// the shim answered, before the failover.
pub(super) fn survive_checking(
    id: &str,
    attack: &str,
    args: &[&str],
    annotations: &[(&str, &str)],
    after: impl FnOnce(&Containerd, &PairEnv, u32, usize),
) -> PairState {
    let cd = Containerd::start().expect("containerd");
    let env = hostile_env(&cd, "gms = \"off\"");
    let mut cmd = vec!["/bin/hostile-engine", attack];
    cmd.extend_from_slice(args);
    let ctr = env
        .run(&cd, id, annotations, &["--rm", "--net-host"], &cmd)
        .expect("ctr run");
    let st = settle(&cd, &env, id, &ctr, "protected before the attack", |s| {
        s.pair.protected
    });
    let active = st.pair.active.expect("active slot");
    let shim = shim_pid(&cd, id);
    // The attacker waits a second after parking before it attacks.
    let fds_before = std::fs::read_dir(format!("/proc/{shim}/fd")).map_or(0, |d| d.count());
    let attacked = format!("attack={attack} step=attacked");
    let cpu_before = cpu_time(shim);
    let mut polls = 0;
    let ended = within(LONG, Duration::from_millis(250), || {
        if ctr.stdout_so_far().contains(&attacked) {
            return Some(());
        }
        assert_answers(&cd, id, shim, "during the attack");
        polls += 1;
        None
    });
    assert!(
        ended.is_some(),
        "the attack never ended; engine output:\n{}",
        ctr.stdout_so_far()
    );
    let cpu = cpu_time(shim).saturating_sub(cpu_before);
    assert!(
        cpu <= CPU_CAP,
        "the shim spent {cpu:?} of CPU during the attack (cap {CPU_CAP:?})"
    );
    // After it, too: what it left queued must not stall or bloat the shim.
    for _ in 0..3 {
        assert_answers(&cd, id, shim, "after the attack");
        std::thread::sleep(Duration::from_millis(200));
    }
    let said = ctr.stdout_so_far();
    let report = said
        .lines()
        .find(|l| l.contains("sent=") || l.contains(" step=sent") || l.contains("refused"))
        .unwrap_or("");
    eprintln!(
        "{attack}: {polls} ctr task ps answered during the attack; shim cpu {cpu:?}, rss {} KiB; {report}",
        rss_kib(shim)
    );
    after(&cd, &env, shim, fds_before);
    let holder = st.pid_of(active).expect("active pid");
    let st = env.state(&cd, id).expect("state.json");
    assert!(
        st.pair.active == Some(active) && st.pair.protected,
        "the attack moved the active or unparked the attacker: {st:#?}\nengines said:\n{}",
        ctr.stdout_so_far()
    );
    if attack == "notify-flood" {
        // What was dropped is said, once per 10 s at most.
        let log = std::fs::read_to_string(cd.log()).unwrap_or_default();
        assert!(
            log.contains("notify socket dropped datagrams"),
            "no drop was logged:\n{}",
            cd.log_tail(20)
        );
    }
    // And counted in the metrics file, by reason, within a second or so.
    let reason = match attack {
        "notify-flood" => Some("rate_limited"),
        // Its 60 kB datagrams.
        "notify-garbage" => Some("oversized"),
        // Linux 6.16 and later refuse the fd at the sender: nothing arrives.
        _ => None,
    };
    if let Some(reason) = reason {
        let labels = format!(",reason=\"{reason}\"");
        until(
            &format!("shadow_notify_dropped_total{{reason=\"{reason}\"}} > 0"),
            LONG,
            Duration::from_millis(20),
            || {
                env.metric(&cd, id, "shadow_notify_dropped_total", &labels)
                    .filter(|n| *n > 0.0)
            },
        );
    }
    fail_over_and_end(&cd, &env, id, ctr, holder);
    st
}

/// Waits until the pair's state satisfies `ok`; on a timeout, fails with the
/// state, what the engines said and the containerd log.
fn settle(
    cd: &Containerd,
    env: &PairEnv,
    id: &str,
    ctr: &Spawned,
    what: &str,
    ok: impl Fn(&PairState) -> bool,
) -> PairState {
    let waited = poll(LONG, Duration::from_millis(5), || match env.state(cd, id) {
        Some(st) if ok(&st) => Ok(st),
        // Boxed: a state is large, and only a failure message reads it.
        st => Err(Box::new(st)),
    });
    match waited {
        Ok(st) => st,
        Err(st) => panic!(
            "timed out waiting for: {what}; state: {st:#?}\nengines said:\n{}{}\ncontainerd log:\n{}",
            ctr.stdout_so_far(),
            ctr.stderr_so_far(),
            cd.log_tail(40)
        ),
    }
}

fn fail_over_and_end(cd: &Containerd, env: &PairEnv, id: &str, ctr: Spawned, pid: u32) {
    // SAFETY: kill(2) with the active engine's pid, read from the pair's state.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
    settle(cd, env, id, &ctr, "the attacker takes over", |s| {
        s.pair.failovers == 1 && s.pair.protected
    });
    cd.ctr()
        .run_timeout(&["task", "kill", "--signal", "SIGKILL", id], ANSWER)
        .expect("ctr task kill")
        .assert_success();
    let out = ctr.wait(LONG).expect("ctr run ends");
    assert_ne!(out.code(), 0, "{out}");
    cd.assert_no_leftovers();
    assert!(!env.pair_dir(cd, id).exists(), "pair dir left");
}

#[test]
fn notify_fd_with_lingering_close_does_not_freeze_the_shim() {
    survive("linger", "notify-linger-fd", &["60"]);
}

#[test]
fn notify_flood_neither_freezes_nor_bloats_the_shim() {
    survive("flood", "notify-flood", &["5"]);
}

/// A shadow that floods its notify socket costs the watched active no
/// ping: each engine has a socket (a kernel queue) of its own, so the
/// active's non-blocking pings are never refused for the flood's sake,
/// and the pause of the flooder's reader blinds only the flooder. 8 s of
/// flood must end nobody. (100 ms, not the shortest 50: tests run side by
/// side on two cores, and a shim starved of CPU reads a ping late.)
#[test]
fn a_notify_flood_never_gets_a_watched_active_ended() {
    let st = survive_with(
        "floodwd",
        "notify-flood",
        &["8"],
        &[("shadow.dev/watchdog", "100ms")],
    );
    assert_eq!(st.pair.hangs.total(), 0, "{:#?}", st.pair);
    assert_eq!(st.pair.failovers, 0, "{:#?}", st.pair);
}

#[test]
fn notify_garbage_changes_nothing() {
    survive("garbage", "notify-garbage", &["3"]);
}

#[test]
fn notify_flood_does_not_delay_kill() {
    let cd = Containerd::start().expect("containerd");
    let env = hostile_env(&cd, "gms = \"off\"");
    let id = "floodkill";
    let ctr = env
        .run(
            &cd,
            id,
            &[],
            &["--rm", "--net-host"],
            &["/bin/hostile-engine", "notify-flood", "30"],
        )
        .expect("ctr run");
    settle(&cd, &env, id, &ctr, "protected before the attack", |s| {
        s.pair.protected
    });
    until("the shadow floods", LONG, Duration::from_millis(20), || {
        ctr.stdout_so_far()
            .contains("attack=notify-flood step=parked")
            .then_some(())
    });
    // Kill once the flood is under way: the shim has started dropping it.
    until(
        "the shim drops the flood",
        LONG,
        Duration::from_millis(20),
        || {
            let log = std::fs::read_to_string(cd.log()).unwrap_or_default();
            (ctr.stdout_so_far()
                .contains("attack=notify-flood step=flooding")
                && log.contains("notify socket dropped datagrams"))
            .then_some(())
        },
    );
    cd.ctr()
        .run_timeout(&["task", "kill", "--signal", "SIGKILL", id], ANSWER)
        .expect("ctr task kill during the flood")
        .assert_success();
    let out = ctr.wait(LONG).expect("ctr run ends");
    assert_ne!(out.code(), 0, "{out}");
    cd.assert_no_leftovers();
    assert!(!env.pair_dir(&cd, id).exists(), "pair dir left");
}
