//! The harness checks itself: the leftover check must see what a test left
//! running, and dropping the private containerd must remove all of it. A
//! leftover check that cannot fail would make every other test weaker.

use shadow_tests::{
    mounts_under, our_processes, shim_socket_paths, Containerd, Leftover, Runtime, RUNC_STATE_ROOT,
};
use std::path::Path;
use std::time::Duration;

#[test]
fn leftover_check_sees_a_live_task_and_drop_removes_it() {
    let cd = Containerd::start().expect("start containerd");
    let dir = cd.dir().to_owned();
    let address = cd.address().to_owned();
    let ns = cd.namespace().to_owned();
    // No --rm, and the ctr client goes away: the task stays, as after a
    // test that panicked half-way.
    let mut run = cd
        .container(Runtime::RuncV2, "stay")
        .cmd(&["sh", "-c", "echo ready; exec sleep 100000"])
        .spawn(false)
        .expect("ctr run");
    run.wait_line(Duration::from_secs(60), |l| l == "ready")
        .expect("ready");
    drop(run);
    // A mount under the test's dir, as a shim mounting a bundle rootfs makes.
    let mnt = dir.join("mnt");
    std::fs::create_dir(&mnt).expect("mkdir");
    nix::mount::mount(
        Some("tmpfs"),
        &mnt,
        Some("tmpfs"),
        nix::mount::MsFlags::empty(),
        None::<&str>,
    )
    .expect("mount tmpfs");

    let left = cd.leftovers(false);
    let has = |f: &dyn Fn(&Leftover) -> bool| left.iter().any(f);
    assert!(
        has(&|l| matches!(l, Leftover::Task { id, .. } if id == "stay")),
        "{left:#?}"
    );
    assert!(
        has(&|l| matches!(l, Leftover::Container { id } if id == "stay")),
        "{left:#?}"
    );
    assert!(
        has(&|l| matches!(l, Leftover::RuncContainer { id, .. } if id == "stay")),
        "{left:#?}"
    );
    assert!(
        has(
            &|l| matches!(l, Leftover::Process { cmdline, .. } if cmdline.contains("containerd-shim-runc-v2"))
        ),
        "{left:#?}"
    );
    assert!(has(&|l| matches!(l, Leftover::Socket { .. })), "{left:#?}");
    assert!(has(&|l| matches!(l, Leftover::Cgroup { .. })), "{left:#?}");
    assert!(
        has(&|l| matches!(l, Leftover::Mount { path } if *path == mnt)),
        "{left:#?}"
    );

    drop(cd);

    assert!(!dir.exists(), "{} not removed", dir.display());
    assert_eq!(our_processes(&dir, &address), Vec::new());
    assert!(mounts_under(&dir).is_empty());
    assert!(!Path::new(RUNC_STATE_ROOT).join(&ns).exists());
    for s in shim_socket_paths(&address, &ns, "stay") {
        assert!(!s.exists(), "{} left", s.display());
    }
    for ctl in ["pids", "memory", "cpu", "freezer"] {
        let cg = Path::new("/sys/fs/cgroup").join(ctl).join(&ns);
        assert!(!cg.exists(), "{} left", cg.display());
    }
}

#[test]
fn restart_keeps_state_and_address() {
    let mut cd = Containerd::start().expect("start containerd");
    let before = cd.pid().expect("running");
    cd.ctr()
        .run(&[
            "containers",
            "create",
            "--rootfs",
            &cd.rootfs().display().to_string(),
            "kept",
            "true",
        ])
        .expect("ctr containers create")
        .assert_success();
    cd.record_id("kept");
    cd.restart().expect("restart");
    assert_ne!(cd.pid(), Some(before));
    assert_eq!(
        cd.ctr().containers().expect("containers ls"),
        vec!["kept".to_owned()]
    );
    cd.ctr()
        .run(&["containers", "delete", "kept"])
        .expect("delete")
        .assert_success();
    cd.assert_no_leftovers();
}
