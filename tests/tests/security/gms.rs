//! Leases and gmsd (docs/security.md): an engine cannot replace the
//! committed weights of its pair, even when a failover drops the readers to
//! zero.

use crate::control::{hostile_env, HOSTILE, LONG};
use shadow_tests::pair::until;
use shadow_tests::Containerd;
use std::path::Path;
use std::time::Duration;

/// `hostile-engine gms-rw-after-commit`: slot 0 loads and serves honest
/// weights, slot 1 asks for `rw` in a loop. After the active engine is
/// killed, the respawned one must import the same weights (right sum) and
/// gmsd's committed layout must still be the first one.
#[test]
fn an_engine_cannot_replace_committed_weights_during_a_failover() {
    let cd = Containerd::start().expect("containerd");
    let id = "gmsrw";
    let gmsd = Path::new(HOSTILE).with_file_name("gmsd");
    assert!(gmsd.is_file(), "build gmsd first: {}", gmsd.display());
    let env = hostile_env(
        &cd,
        &format!("gmsd = \"{}\"\ngms = \"host\"", gmsd.display()),
    );
    let mut ctr = env
        .run(
            &cd,
            id,
            &[],
            &["--rm", "--net-host"],
            &["/bin/hostile-engine", "gms-rw-after-commit"],
        )
        .expect("ctr run");
    let serving = |out: &str| {
        out.lines()
            .filter(|l| l.contains("step=serving slot=0"))
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    ctr.wait_output(LONG, |out, _| {
        !serving(out).is_empty() && out.contains("step=parked")
    })
    .expect("the honest engine serves and the attacker is parked");
    let first = serving(&ctr.stdout_so_far())[0].clone();
    assert!(first.contains("ok=true"), "{first}");
    let st = env.wait_protected(&cd, id, LONG);
    let socket = st
        .gms
        .as_ref()
        .expect("gmsd status in state.json")
        .socket
        .clone();
    let before = gms::client::status(Path::new(&socket)).expect("gmsd status");
    let generation = before.committed.as_ref().expect("committed").generation;

    let active = st.pair.active.expect("active slot");
    let pid = st.pid_of(active).expect("active pid");
    // SAFETY: kill(2) with the active engine's pid, read from the pair's state.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);

    // The dead slot comes back, imports and serves again.
    ctr.wait_output(LONG, |out, _| serving(out).len() >= 2)
        .expect("the respawned engine serves");
    let out = ctr.stdout_so_far();
    let second = serving(&out)[1].clone();
    let sum = |l: &str| {
        l.split_whitespace()
            .find(|w| w.starts_with("sum="))
            .map(str::to_owned)
    };
    assert!(
        !out.contains("step=replaced"),
        "the attacker replaced the committed weights:\n{out}"
    );
    assert!(second.contains("ok=true"), "{second}\n{out}");
    assert_eq!(sum(&first), sum(&second), "{out}");
    let after = until("gmsd status", LONG, Duration::from_millis(5), || {
        gms::client::status(Path::new(&socket)).ok()
    });
    assert_eq!(
        after.committed.as_ref().map(|c| c.generation),
        Some(generation),
        "committed layout unchanged"
    );
    assert_eq!(after.working, None, "no writer is loading");

    cd.ctr()
        .run(&["task", "kill", "--signal", "SIGKILL", id])
        .expect("ctr task kill")
        .assert_success();
    let out = ctr.wait(LONG).expect("ctr run ends");
    assert_ne!(out.code(), 0, "{out}");
    cd.assert_no_leftovers();
    assert!(!env.pair_dir(&cd, id).exists(), "pair dir left");
}
