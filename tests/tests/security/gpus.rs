//! GPUs come from the devices the spec grants (docs/security.md): a pod
//! that names another tenant's GPU in its own `NVIDIA_VISIBLE_DEVICES` gets
//! no GMS daemon on it, and `shadow.dev/gms=cuda` without a granted GPU is
//! refused at Create. The GPUs are fake device nodes and a fake driver
//! directory (tests/src/gpus.rs); the shim's decisions are the real ones.

use crate::control::{hostile_env, LONG};
use shadow_tests::gpus::FakeGpus;
use shadow_tests::pair::until;
use shadow_tests::Containerd;
use std::time::Duration;

#[test]
fn gpu_in_env_not_granted() {
    // GPU sockets are long: a short namespace keeps them within sun_path.
    let cd = Containerd::builder()
        .namespace(format!("ge-{}", std::process::id()))
        .start()
        .expect("containerd");
    let gpus = FakeGpus::new(&cd, 2).expect("fake GPUs");
    let id = "gpu-env";
    let env = hostile_env(&cd, &gpus.config());
    // Granted: GPU 0. Named in the pod's own environment: GPU 1, the victim.
    let victim = format!("NVIDIA_VISIBLE_DEVICES={}", gpus.uuids[1]);
    let mut flags = vec!["--rm", "--net-host", "--env", victim.as_str()];
    let grant = gpus.grant(&[0]);
    flags.extend(grant.iter().map(String::as_str));
    let mut ctr = env
        .run(&cd, id, &[], &flags, &["/bin/hostile-engine", "gpus"])
        .expect("ctr run");
    let verdict = ctr
        .wait_line(LONG, |l| {
            l.contains("step=victim-absent") || l.contains("step=victim-reachable")
        })
        .expect("the attack's verdict");
    assert!(verdict.contains("victim-absent"), "{verdict}");
    assert!(
        ctr.stdout_so_far()
            .contains(&format!("step=socket:{}", gpus.socket_name(0))),
        "the granted GPU's daemon is there: {}",
        ctr.stdout_so_far()
    );
    let st = until(
        "the daemon's status",
        LONG,
        Duration::from_millis(5),
        || env.state(&cd, id).filter(|s| !s.gms_daemons.is_empty()),
    );
    let devices: Vec<_> = st.gms_daemons.iter().map(|g| g.device.as_str()).collect();
    assert_eq!(
        devices,
        [gpus.uuids[0].as_str()],
        "one daemon, the granted GPU's"
    );
    let gms_dir = env.pair_dir(&cd, id).join("gms");
    assert!(!gms_dir.join(gpus.socket_name(1)).exists());
    cd.ctr()
        .run(&["task", "kill", "--signal", "SIGKILL", id])
        .expect("ctr task kill")
        .assert_success();
    let out = ctr.wait(LONG).expect("ctr run ends");
    assert_ne!(out.code(), 0, "{out}");
    cd.assert_no_leftovers();
}

#[test]
fn gms_cuda_without_gpu_refused() {
    let cd = Containerd::start().expect("containerd");
    let gpus = FakeGpus::new(&cd, 1).expect("fake GPUs");
    let id = "gpu-none";
    let env = hostile_env(&cd, &gpus.config());
    // No device granted; the environment names a GPU all the same.
    let victim = format!("NVIDIA_VISIBLE_DEVICES={}", gpus.uuids[0]);
    let ctr = env
        .run(
            &cd,
            id,
            &[(shadow_contract::annotations::GMS, "cuda")],
            &["--rm", "--net-host", "--env", victim.as_str()],
            &["/bin/hostile-engine", "park"],
        )
        .expect("ctr run");
    let out = ctr.wait(LONG).expect("ctr run ends");
    assert_ne!(out.code(), 0, "{out}");
    let text = out.to_string();
    assert!(
        text.contains("grants no NVIDIA GPU") && text.contains("NVIDIA_VISIBLE_DEVICES"),
        "the refusal says why: {text}"
    );
    assert!(!env.pair_dir(&cd, id).exists(), "pair dir left");
    cd.assert_no_leftovers();
}
