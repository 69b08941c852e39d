//! The reference engine in a real pair with a watchdog
//! (`shadow.dev/watchdog=500ms`; private containerd, runc, this shim, gmsd
//! host backend; root): a healthy pair is never ended as hung, neither the
//! parked shadow (it pings from its wait for the lock) nor the active
//! through long answers (it pings from its decode steps); a stopped active
//! is ended by its watchdog and the promoted shadow gives the same answer.

use std::time::Duration;

mod common;

use serde_json::Value;
use shadow_contract::state::{FailureClass, HangCause};
use shadow_tests::pair::{free_port, until};
use shadow_tests::Containerd;

const LONG: Duration = Duration::from_secs(45);
const STEP: Duration = Duration::from_millis(5);

fn complete(port: u16, prompt: &str, max_tokens: usize) -> Option<Value> {
    common::complete(port, prompt, max_tokens, LONG)
}

/// Eight answers of 256 decode steps each, from the four workers at once.
fn long_answers(port: u16) {
    let all: Vec<_> = (0..8)
        .map(|i| std::thread::spawn(move || complete(port, &format!("long {i}"), 256)))
        .collect();
    for a in all {
        let v = a.join().expect("a client thread").expect("an answer");
        assert_eq!(v["usage"]["completion_tokens"], 256, "{v}");
    }
}

#[test]
fn a_watched_pair_is_ended_only_when_it_stops() {
    let cd = Containerd::start().unwrap();
    let port = free_port();
    let id = "engine-watchdog";
    // 500 ms, not 100: this engine pings only once every computing worker
    // has stepped, and on a loaded 2-core machine four CPU-bound workers'
    // decode steps can take longer than 50 ms (seen: a healthy engine
    // ended at 100 ms with three CPU hogs beside it). The watchdog's own
    // figures at 100 ms are the test engine's (make bench-hang).
    let (env, ctr) = common::run_pair(&cd, id, &[("shadow.dev/watchdog", "500ms")], port);
    env.wait_protected(&cd, id, LONG);
    let prompt = "what survives a hang?";
    let before = until("first answer", LONG, STEP, || complete(port, prompt, 12));
    // Long answers on the active while the shadow waits for the lock: both
    // keep pinging, so neither is ended.
    long_answers(port);
    let st = env.state(&cd, id).expect("state");
    assert_eq!(
        (st.pair.hangs.total(), st.pair.failovers),
        (0, 0),
        "a healthy engine was ended: {:?}",
        st.pair
    );
    assert!(st.pair.protected, "{:?}", st.pair);

    // The active stops with its lock held: its pings stop, the pair ends it.
    let old = st.pair.active.expect("an active engine");
    let pid = st.pid_of(old).expect("its pid");
    // SAFETY: kill(2) of the active engine's pid from the pair's state file.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGSTOP) }, 0);
    let old_slot = old.to_string();
    let after = until("an answer from the promoted engine", LONG, STEP, || {
        complete(port, prompt, 12).filter(|v| v["engine"]["slot"] != old_slot.as_str())
    });
    assert_eq!(after["choices"][0]["text"], before["choices"][0]["text"]);
    let st = until("protected again", LONG, STEP, || {
        env.state(&cd, id)
            .filter(|s| s.pair.protected && s.pair.failovers == 1)
    });
    let last = &st.promotions.last().expect("a promotion").promotion;
    assert_eq!(last.class, FailureClass::Hung);
    assert_eq!(last.hang.expect("its hang").cause, HangCause::Watchdog);
    // The promoted engine serves long answers, the respawned shadow waits:
    // still only the one hang.
    long_answers(port);
    let st = env.state(&cd, id).expect("state");
    assert_eq!(st.pair.hangs.total(), 1, "{:?}", st.pair);
    assert_eq!(st.pair.hangs.watchdog, 1, "{:?}", st.pair);

    cd.ctr()
        .run(&["task", "kill", "-s", "SIGKILL", id])
        .unwrap()
        .assert_success();
    ctr.wait(LONG).unwrap();
    let _ = cd.ctr().run(&["container", "rm", id]);
    cd.assert_no_leftovers();
}
