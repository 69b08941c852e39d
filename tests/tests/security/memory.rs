//! Memory is charged to the pod (docs/security.md): a pair's gmsd runs in
//! a leaf of the pair's cgroup (`<pair>/gms`, beside the engines' `s0` and
//! `s1`) with the pod's OOM score, so the weights it holds count against
//! the pod's memory limit, and it refuses more than that limit. A pod's
//! annotation cannot turn GMS on where the node's config says `off`.

use std::path::Path;
use std::time::Duration;

use shadow_tests::wait::{until, within};
use shadow_tests::Containerd;

use crate::control::{hostile_env, HOSTILE, LONG};

const STEP: Duration = Duration::from_millis(5);
const LIMIT: u64 = 256 << 20;

fn gmsd() -> String {
    let p = Path::new(HOSTILE).with_file_name("gmsd");
    assert!(p.is_file(), "build gmsd: cargo build -p gmsd --bin gmsd");
    p.display().to_string()
}

/// The path of `pid`'s cgroup in the `controller` hierarchy (v1), or its
/// one cgroup (v2).
fn cgroup_of(pid: u32, controller: &str) -> String {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).expect("cgroup file");
    text.lines()
        .find_map(|l| {
            let mut parts = l.splitn(3, ':');
            let (_, ctrls, path) = (parts.next()?, parts.next()?, parts.next()?);
            (ctrls.is_empty() || ctrls.split(',').any(|c| c == controller))
                .then(|| path.to_string())
        })
        .unwrap_or_else(|| panic!("no {controller} cgroup in {text}"))
}

/// `memory.usage_in_bytes` (v1) or `memory.current` (v2) of a cgroup path.
fn memory_charged(path: &str) -> u64 {
    let rel = path.trim_start_matches('/');
    let v1 = Path::new("/sys/fs/cgroup/memory")
        .join(rel)
        .join("memory.usage_in_bytes");
    let v2 = Path::new("/sys/fs/cgroup").join(rel).join("memory.current");
    let file = if v1.exists() { v1 } else { v2 };
    std::fs::read_to_string(&file)
        .unwrap_or_else(|e| panic!("{}: {e}", file.display()))
        .trim()
        .parse()
        .expect("a byte count")
}

#[test]
fn gmsd_runs_in_the_pods_cgroup_and_is_held_to_its_memory_limit() {
    let cd = Containerd::start().expect("containerd");
    let id = "memory";
    let env = hostile_env(&cd, &format!("gms = \"host\"\ngmsd = \"{}\"", gmsd()));
    let limit = LIMIT.to_string();
    let mut ctr = env
        .run(
            &cd,
            id,
            &[],
            &["--rm", "--net-host", "--memory-limit", &limit],
            &[
                "/bin/hostile-engine",
                "weights",
                "--mib",
                "64",
                "--over-mib",
                "512",
            ],
        )
        .expect("ctr run");
    let Some(st) = within(LONG, STEP, || {
        env.state(&cd, id).filter(|s| s.pair.protected)
    }) else {
        panic!(
            "pair not protected; engines said:\n{}\n{}",
            ctr.stdout_so_far(),
            ctr.stderr_so_far()
        );
    };
    let gms = until("gmsd status in state.json", LONG, STEP, || {
        env.state(&cd, id).and_then(|s| s.gms)
    });
    let engine = st.pids[0].expect("engine pid");
    let engine_cg = cgroup_of(engine, "memory");
    let pair_cg = engine_cg.rsplit_once('/').expect("engine below the pair").0;
    let gms_cg = cgroup_of(gms.pid, "memory");
    assert_eq!(gms_cg, format!("{pair_cg}/gms"), "gmsd's memory cgroup");
    assert_eq!(cgroup_of(gms.pid, "pids"), format!("{pair_cg}/gms"));
    let adj = std::fs::read_to_string(format!("/proc/{}/oom_score_adj", gms.pid)).expect("oom");
    assert_eq!(adj.trim(), "0", "gmsd's OOM score is a pod process's");
    // The weights (gmsd fallocates them) are charged to its leaf.
    let charged = memory_charged(&gms_cg);
    assert!(charged >= 64 << 20, "gmsd's leaf holds {charged} bytes");
    // gmsd holds no more than the pod may: the limit is its --max-bytes.
    assert_eq!(
        gms.rest["limits"]["max_bytes"].as_u64(),
        Some(LIMIT),
        "{:?}",
        gms.rest
    );
    // The pair's state can be ahead of the engines' output, which reaches
    // us through containerd's FIFOs and ctr: wait for the engines' reports.
    ctr.wait_output(LONG, |out, _| {
        out.contains("step=committed") && out.contains("step=imported")
    })
    .expect("one engine committed the weights and the other imported them");
    let said = ctr.stdout_so_far();
    assert!(said.contains("step=refused:over"), "{said}");
    cd.ctr()
        .run(&["task", "kill", "--signal", "SIGKILL", id])
        .expect("ctr task kill")
        .assert_success();
    ctr.wait(LONG).expect("ctr run ends");
    cd.assert_no_leftovers();
}

#[test]
fn a_pod_annotation_cannot_turn_gms_on_where_the_node_says_off() {
    let cd = Containerd::start().expect("containerd");
    let id = "gmsoff";
    let env = hostile_env(&cd, &format!("gms = \"off\"\ngmsd = \"{}\"", gmsd()));
    let ctr = env
        .run(
            &cd,
            id,
            &[("shadow.dev/gms", "host")],
            &["--rm", "--net-host"],
            &["/bin/hostile-engine", "park"],
        )
        .expect("ctr run");
    let st = env.wait_protected(&cd, id, LONG);
    assert!(st.gms.is_none() && st.gms_daemons.is_empty(), "{st:?}");
    assert!(!env.pair_dir(&cd, id).join("gms").exists(), "a gms dir");
    let environ =
        std::fs::read(format!("/proc/{}/environ", st.pids[0].expect("pid"))).expect("environ");
    assert!(
        !String::from_utf8_lossy(&environ).contains("GMS_SOCKET_DIR"),
        "the engine was told of a GMS"
    );
    cd.ctr()
        .run(&["task", "kill", "--signal", "SIGKILL", id])
        .expect("ctr task kill")
        .assert_success();
    ctr.wait(LONG).expect("ctr run ends");
    cd.assert_no_leftovers();
}
