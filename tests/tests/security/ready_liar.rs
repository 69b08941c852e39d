//! A parked shadow that says `READY=1` without holding the election lock
//! (docs/security.md, "The notify socket"): the shim believes `READY=1`
//! only from the lock's holder, so the real active keeps State's pid and
//! `state.json`'s active; once it dies and the liar takes the lock, the
//! pair fails over to it as usual and ends with nothing left.

use super::control::{hostile_env, LONG};
use shadow_tests::pair::task_pid;
use shadow_tests::wait::{until, within};
use shadow_tests::Containerd;
use std::time::Duration;

/// What the shim logs (at most every 10 s) when it refuses a `READY=1`.
const REFUSED: &str = "ignored READY=1 from slot";

#[test]
fn a_shadow_that_says_ready_without_the_lock_is_not_believed() {
    let cd = Containerd::start().expect("containerd");
    let id = "liar";
    let env = hostile_env(&cd, "gms = \"off\"");
    let ctr = env
        .run(
            &cd,
            id,
            &[],
            &["--rm", "--net-host"],
            &["/bin/hostile-engine", "notify-ready-liar"],
        )
        .expect("ctr run");
    let st = env.wait_protected(&cd, id, LONG);
    let active = st.pair.active.expect("active slot");
    let holder = st.pid_of(active).expect("active pid");
    let liar = st.pid_of(1 - active).expect("shadow pid");
    until("the lies", LONG, Duration::from_millis(20), || {
        ctr.stdout_so_far()
            .contains("attack=notify-ready-liar step=lied")
            .then_some(())
    });
    // The shim says when it refuses; had it believed the lie, the active
    // would move instead.
    let refused = within(LONG, Duration::from_millis(20), || {
        let st = env.state(&cd, id).expect("state.json");
        assert!(
            st.pair.active == Some(active) && st.pid == holder,
            "the lie was believed: {st:#?}\nengines said:\n{}",
            ctr.stdout_so_far()
        );
        let log = std::fs::read_to_string(cd.log()).unwrap_or_default();
        log.contains(REFUSED).then_some(())
    });
    assert!(refused.is_some(), "no refusal logged:\n{}", cd.log_tail(30));
    // Counted in the metrics file too, within a second or so.
    until(
        "shadow_ready_refused_total > 0",
        LONG,
        Duration::from_millis(20),
        || {
            env.metric(&cd, id, "shadow_ready_refused_total", "")
                .filter(|n| *n > 0.0)
        },
    );
    let st = env.state(&cd, id).expect("state.json");
    assert_eq!(st.pair.active, Some(active), "{st:#?}");
    assert_eq!(st.pid, holder, "{st:#?}");
    assert!(
        st.pair.protected,
        "the liar is still the parked shadow: {st:#?}"
    );
    assert_eq!(
        task_pid(&cd, id),
        Some(holder),
        "ctr task ls names the holder"
    );

    // The real active dies; the liar takes the lock and is promoted.
    // SAFETY: kill(2) with the active engine's pid, read from the pair's state.
    assert_eq!(unsafe { libc::kill(holder as i32, libc::SIGKILL) }, 0);
    let st = until(
        "the liar takes over",
        LONG,
        Duration::from_millis(5),
        || {
            env.state(&cd, id).filter(|s| {
                s.pair.failovers == 1 && s.pair.protected && s.pair.active == Some(1 - active)
            })
        },
    );
    assert_eq!(st.pid, liar, "{st:#?}");
    assert_eq!(
        task_pid(&cd, id),
        Some(liar),
        "ctr task ls names the new holder"
    );
    cd.ctr()
        .run(&["task", "kill", "--signal", "SIGKILL", id])
        .expect("ctr task kill")
        .assert_success();
    let out = ctr.wait(LONG).expect("ctr run ends");
    assert_ne!(out.code(), 0, "{out}");
    cd.assert_no_leftovers();
    assert!(!env.pair_dir(&cd, id).exists(), "pair dir left");
}
