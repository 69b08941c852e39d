//! The control arm: the hostile engine's well-formed `park` attack makes a
//! protected pair that fails over and ends cleanly. If this fails, the
//! attack tests beside it prove nothing.

use shadow_tests::pair::{install_binary, until, PairEnv};
use shadow_tests::Containerd;
use std::path::Path;
use std::time::Duration;

pub const HOSTILE: &str = env!("CARGO_BIN_EXE_hostile-engine");
pub const LONG: Duration = Duration::from_secs(30);

/// Installs `hostile-engine` at `/bin/hostile-engine` in the test's rootfs and
/// writes a shim config with `extra` (gms off unless `extra` says otherwise).
pub fn hostile_env(cd: &Containerd, extra: &str) -> PairEnv {
    install_binary(cd.rootfs(), Path::new(HOSTILE), "/bin/hostile-engine")
        .expect("install hostile-engine");
    PairEnv::new(cd, extra).expect("shim config")
}

#[test]
fn a_well_formed_hostile_engine_makes_a_protected_pair_that_fails_over() {
    let cd = Containerd::start().expect("containerd");
    let id = "control";
    let env = hostile_env(&cd, "gms = \"off\"");
    let ctr = env
        .run(
            &cd,
            id,
            &[],
            &["--rm", "--net-host"],
            &["/bin/hostile-engine", "park"],
        )
        .expect("ctr run");
    let st = env.wait_protected(&cd, id, LONG);
    let active = st.pair.active.expect("active slot");
    let pid = st.pid_of(active).expect("active pid");
    // SAFETY: kill(2) with the active engine's pid, read from the pair's state.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
    until(
        "the shadow takes over",
        LONG,
        Duration::from_millis(5),
        || {
            env.state(&cd, id)
                .filter(|s| s.pair.failovers == 1 && s.pair.protected)
        },
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
