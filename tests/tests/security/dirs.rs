//! Host-side directories (docs/security.md): an engine gets the election
//! lock and each socket bound alone and read-only, so nothing it does
//! changes a host directory: files, fills, directories, replaced sockets.
//! A GMS daemon that cannot be started again makes the pair back off and
//! end, not spin.

use std::collections::BTreeMap;
use std::os::unix::fs::FileTypeExt;
use std::path::Path;
use std::time::Duration;

use shadow_tests::pair::until;
use shadow_tests::Containerd;

use crate::control::{hostile_env, HOSTILE, LONG};

const STEP: Duration = Duration::from_millis(5);

/// Every entry below `dir` (relative path → kind and size of files).
fn tree(dir: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).expect("read_dir").flatten() {
            let p = e.path();
            let rel = p.strip_prefix(dir).unwrap().display().to_string();
            let md = std::fs::symlink_metadata(&p).expect("lstat");
            let ft = md.file_type();
            let kind = if ft.is_dir() {
                todo.push(p.clone());
                "dir".to_string()
            } else if ft.is_socket() {
                "socket".to_string()
            } else if ft.is_file() {
                format!("file {} bytes", md.len())
            } else {
                format!("{ft:?}")
            };
            out.insert(rel, kind);
        }
    }
    out
}

fn kill(pid: u32, sig: i32) {
    // SAFETY: kill(2) with a pid read from the pair's state.
    assert_eq!(unsafe { libc::kill(pid as i32, sig) }, 0, "kill {pid}");
}

#[test]
fn an_engine_cannot_write_host_directories_and_a_gmsd_that_will_not_start_ends_the_pair() {
    let cd = Containerd::start().expect("containerd");
    let id = "dirs";
    let gmsd = Path::new(HOSTILE).with_file_name("gmsd");
    assert!(gmsd.is_file(), "build gmsd: cargo build -p gmsd --bin gmsd");
    let env = hostile_env(
        &cd,
        &format!(
            "gms = \"host\"\ngmsd = \"{}\"\n[pair.restart]\nmax_consecutive_failures = 2\nbackoff_initial = 20\nbackoff_max = 40",
            gmsd.display()
        ),
    );
    let ctr = env
        .run(
            &cd,
            id,
            &[],
            &["--rm", "--net-host"],
            &["/bin/hostile-engine", "dirs", "--fill-mib", "2"],
        )
        .expect("ctr run");
    // Both engines attacked, then parked: one serves, one waits.
    let st = env.wait_protected(&cd, id, LONG);
    // The pair's state can be ahead of the engines' output, which reaches
    // us through containerd's FIFOs and ctr: wait for both reports.
    let said = until(
        "both engines to report their attack",
        LONG,
        Duration::from_millis(5),
        || {
            let said = ctr.stdout_so_far();
            (said.matches("step=attacked").count() >= 2).then_some(said)
        },
    );
    assert_eq!(said.matches("step=attacked").count(), 2, "{said}");
    assert!(
        said.contains("step=refused:write /run/shadow/pair/engine.lock"),
        "{said}"
    );

    // The host directories hold what the shim put there, nothing else.
    let root = env.pair_dir(&cd, id);
    let pair = tree(&root.join("pair"));
    let want: BTreeMap<String, String> = [
        ("engine.lock", "file 0 bytes"),
        ("notify0.sock", "socket"),
        ("notify1.sock", "socket"),
        ("store0.sock", "socket"),
        ("store1.sock", "socket"),
    ]
    .into_iter()
    .map(|(a, b)| (a.to_string(), b.to_string()))
    .collect();
    assert_eq!(pair, want, "pair dir");
    let gms = tree(&root.join("gms"));
    assert_eq!(
        gms.into_iter().collect::<Vec<_>>(),
        [("gms-host.sock".to_string(), "socket".to_string())],
        "gms dir"
    );
    let everything = tree(&root);
    assert!(
        everything.keys().all(|k| !k.contains("hostile")),
        "{everything:?}"
    );

    // The socket is still gmsd's: the shim's status comes from it.
    let gms_pid = env.gmsd_pid(&cd, id, LONG);

    // The pair still fails over…
    let active = st.pair.active.expect("active");
    kill(st.pid_of(active).expect("active pid"), libc::SIGKILL);
    until("the shadow takes over", LONG, STEP, || {
        env.state(&cd, id)
            .filter(|s| s.pair.failovers == 1 && s.pair.protected)
    });
    // …and restarts cold when gmsd dies.
    kill(gms_pid, libc::SIGKILL);
    let gms_pid = until("cold restart done", LONG, STEP, || {
        env.state(&cd, id)
            .filter(|s| s.pair.cold_restarts == 1 && s.pair.protected)
            .and_then(|s| s.gms.map(|g| g.pid))
            .filter(|p| *p != gms_pid)
    });

    // What the attack used to achieve (a directory where gmsd binds), made
    // host-side: every later start of gmsd fails. The cold restart backs
    // off and the budget ends the pair, instead of a loop without end.
    let socket = root.join("gms").join("gms-host.sock");
    std::fs::remove_file(&socket).expect("remove gmsd's socket");
    std::fs::create_dir(&socket).expect("mkdir in its place");
    kill(gms_pid, libc::SIGKILL);
    let out = ctr.wait(LONG).expect("ctr run ends");
    assert_eq!(out.code(), 255, "{out}");
    cd.assert_no_leftovers();
    assert!(!root.exists(), "pair dir left");
}
