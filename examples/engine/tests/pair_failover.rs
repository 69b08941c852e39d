//! The reference engine in a real pair (private containerd, runc, this shim,
//! gmsd host backend): the first engine loads the file into GMS, the shadow
//! maps it; after a SIGKILL of the active the promoted shadow gives the same
//! answer, computed from the mapped weights.

use std::time::Duration;

mod common;

use serde_json::Value;
use shadow_tests::pair::{free_port, until};
use shadow_tests::Containerd;

/// A completion of 12 tokens, as every request here asks.
fn complete(port: u16, prompt: &str) -> Option<Value> {
    common::complete(port, prompt, 12, Duration::from_secs(10))
}

#[test]
fn promoted_shadow_answers_the_same_from_mapped_weights() {
    let cd = Containerd::start().unwrap();
    let weights = cd.rootfs().join("weights.safetensors");
    let port = free_port();
    let id = "engine-pair";
    let (env, ctr) = common::run_pair(&cd, id, &[], port);
    let long = Duration::from_secs(45);
    let step = Duration::from_millis(5);
    let mut st = env.wait_protected(&cd, id, long);
    let prompt = "what survives a SIGKILL?";
    let mut before = until("first answer", long, step, || complete(port, prompt));
    // Both engines race for the lock once the weights are committed; the
    // writer usually wins, but not always (a loaded machine). When the
    // reader serves first, one failover makes the writer active and the
    // respawned slot a reader parked behind it: the case this test is about.
    if before["engine"]["source"] == "gms-reader" {
        let first = st.active_pid().expect("an active engine") as i32;
        // SAFETY: kill(2) of the active engine's pid from the pair's state file.
        assert_eq!(unsafe { libc::kill(first, libc::SIGKILL) }, 0);
        before = until("the writer serving", long, step, || {
            complete(port, prompt).filter(|v| v["engine"]["source"] == "gms-writer")
        });
        st = until("protected again", long, step, || {
            env.state(&cd, id)
                .filter(|s| s.pair.protected && s.pair.failovers == 1)
        });
    }
    assert_eq!(before["engine"]["source"], "gms-writer", "{before}");

    let pid = st.active_pid().expect("an active engine") as i32;
    // SAFETY: kill(2) of the active engine's pid from the pair's state file.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);

    let after = until("answer from the promoted engine", long, step, || {
        complete(port, prompt).filter(|v| v["engine"]["slot"] != before["engine"]["slot"])
    });
    assert_eq!(after["engine"]["source"], "gms-reader", "{after}");
    assert_eq!(after["choices"][0]["text"], before["choices"][0]["text"]);
    assert_eq!(after["fingerprint"], before["fingerprint"]);
    // And the answer is the one the file's weights give, computed here.
    let bytes = std::fs::read(&weights).unwrap();
    let model = shadow_engine::model::Model::build(&bytes, &weights).unwrap();
    assert_eq!(
        after["choices"][0]["text"],
        model.complete(&bytes, prompt, 12).text
    );

    cd.ctr()
        .run(&["task", "kill", "-s", "SIGKILL", id])
        .unwrap()
        .assert_success();
    ctr.wait(long).unwrap();
    let _ = cd.ctr().run(&["container", "rm", id]);
}
