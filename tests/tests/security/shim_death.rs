//! When the shim dies (SIGKILL here; the OOM killer or a crash alike),
//! containerd runs the shim binary's `delete`: it must leave nothing of the
//! pair running or mounted — both engines, the pair's gmsd (its own
//! session, no parent-death signal), the namespace pins, the pair cgroup,
//! the pair directory and the metrics file — so the same id can be created
//! again and serves.

use shadow_tests::pair::{ask, free_port, kill_shim, PairEnv};
use shadow_tests::wait::{until, within};
use shadow_tests::{mounts_under, runc_containers, Containerd, RUNC_STATE_ROOT};
use std::path::{Path, PathBuf};

use crate::control::LONG;

const STEP: std::time::Duration = std::time::Duration::from_millis(20);

const ENGINE: &str = env!("CARGO_BIN_EXE_test-engine");

/// Alive: not gone and not a zombie waiting to be reaped.
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            !s.rsplit(')')
                .next()
                .unwrap_or("")
                .trim_start()
                .starts_with('Z')
        })
        .unwrap_or(false)
}

#[test]
fn a_killed_shims_pair_is_removed_by_containerds_cleanup_and_its_id_runs_again() {
    let cd = Containerd::start().expect("containerd");
    let id = "shimdeath";
    PairEnv::install_engine(&cd, Path::new(ENGINE)).expect("install engine");
    let gmsd = Path::new(ENGINE).with_file_name("gmsd");
    let env = PairEnv::new(
        &cd,
        &format!("gmsd = \"{}\"\ngms = \"host\"", gmsd.display()),
    )
    .expect("shim config");
    let port = free_port();
    let port_s = port.to_string();
    let run = || {
        env.run(
            &cd,
            id,
            &[],
            &["--rm", "--net-host"],
            &["/bin/test-engine", "--port", &port_s],
        )
        .expect("ctr run")
    };
    let ctr = run();
    let st = env.wait_protected(&cd, id, LONG);
    let engines: Vec<u32> = st.pids.iter().flatten().copied().collect();
    assert_eq!(engines.len(), 2, "{st:?}");
    let gms_pid = until("gmsd's status in state.json", LONG, STEP, || {
        env.state(&cd, id).and_then(|s| s.gms).map(|g| g.pid)
    });
    assert!(alive(gms_pid), "gmsd {gms_pid}");
    let pair_dir = env.pair_dir(&cd, id);
    let metrics = env.metrics_file(&cd, id);
    let cgroup = PathBuf::from("/sys/fs/cgroup/memory")
        .join(cd.namespace())
        .join(id);
    assert!(metrics.is_file() && cgroup.is_dir());
    assert!(
        !mounts_under(&pair_dir).is_empty(),
        "the pair's namespace pins are mounts below {}",
        pair_dir.display()
    );
    ask(port).expect("the pair serves");

    kill_shim(&cd, id, LONG);
    let _ = ctr.wait(LONG).expect("ctr run ends when the shim is gone");
    let runc_root = Path::new(RUNC_STATE_ROOT).join(cd.namespace());
    // What is left of the pair, each thing named.
    let left = || {
        let mut v: Vec<String> = engines
            .iter()
            .chain([&gms_pid])
            .filter(|p| alive(**p))
            .map(|p| format!("process {p}"))
            .collect();
        v.extend(
            runc_containers(&runc_root)
                .into_iter()
                .map(|c| format!("runc {c}")),
        );
        v.extend(
            mounts_under(&pair_dir)
                .iter()
                .map(|m| format!("mount {}", m.display())),
        );
        v.extend(
            [&cgroup, &pair_dir, &metrics]
                .into_iter()
                .filter(|p| p.exists())
                .map(|p| p.display().to_string()),
        );
        v
    };
    // containerd runs the cleanup when it notices the closed connection:
    // wait for it, bounded, then name anything it left.
    let _ = within(LONG, STEP, || left().is_empty().then_some(()));
    assert_eq!(left(), Vec::<String>::new(), "left after the shim's death");
    if cd.ctr().containers().expect("ls").iter().any(|c| c == id) {
        cd.ctr()
            .run(&["c", "rm", id])
            .expect("c rm")
            .assert_success();
    }
    cd.assert_no_leftovers();

    // The same id again: created from scratch, it serves.
    let ctr = run();
    env.wait_protected(&cd, id, LONG);
    ask(port).expect("the same id serves again");
    cd.ctr()
        .run(&["task", "kill", "--signal", "SIGKILL", id])
        .expect("ctr task kill")
        .assert_success();
    let out = ctr.wait(LONG).expect("ctr run ends");
    assert_ne!(out.code(), 0, "{out}");
    cd.assert_no_leftovers();
    assert!(!pair_dir.exists() && !metrics.exists());
}
