//! The gmsd launcher and the poststop hook as real processes: the systemd
//! unit's own `ExecStart=` line (from config/systemd/gmsd@.service, with
//! this build's binaries) must exec gmsd in place — the pid systemd watches
//! is gmsd's — and stop cleanly on SIGTERM; `gms start|stop` manage a
//! detached one; `poststop` keeps a pair directory while its lock is held.

use serde_json::Value;
use shadow_wait::until;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

const HOOK: &str = env!("CARGO_BIN_EXE_shadow-oci-hook");
/// How long gmsd may take at most to answer on its socket (a bound, not a wait).
const LIMIT: Duration = Duration::from_secs(20);
/// How often a wait on gmsd looks again.
const STEP: Duration = Duration::from_millis(5);

fn gmsd() -> PathBuf {
    let p = Path::new(HOOK).with_file_name("gmsd");
    assert!(
        p.is_file(),
        "{} missing: build it with `cargo build -p gmsd --bin gmsd`",
        p.display()
    );
    p
}

fn status_pid(sock: &Path) -> Option<u64> {
    let out = Command::new(gmsd())
        .args(["status", "--json", "--socket"])
        .arg(sock)
        .output()
        .ok()?;
    let v: Value = serde_json::from_slice(&out.stdout).ok()?;
    v["pid"].as_u64()
}

/// Kills a child left running by a failed assertion.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        if self.0.try_wait().ok().flatten().is_none() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

#[test]
fn unit_exec_start_runs_gmsd_in_place_and_stops_on_sigterm() {
    let unit = Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/systemd/gmsd@.service");
    let text = std::fs::read_to_string(&unit).expect("unit file");
    let exec = text
        .lines()
        .find_map(|l| l.strip_prefix("ExecStart="))
        .expect("ExecStart line");
    let device = text
        .lines()
        .find_map(|l| l.strip_prefix("Environment=GMS_DEVICE="))
        .expect("default GMS_DEVICE");
    let admit = text
        .lines()
        .find_map(|l| l.strip_prefix("Environment=GMS_ADMIT="))
        .expect("default GMS_ADMIT");
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("hooks");
    let words: Vec<String> = exec
        .split_whitespace()
        .map(|w| match w {
            "/usr/local/bin/shadow-oci-hook" => HOOK.to_owned(),
            "/usr/local/bin/gmsd" => gmsd().display().to_string(),
            "%i" => "unit-pair".to_owned(),
            "${GMS_DEVICE}" => device.to_owned(),
            "$GMS_ADMIT" => admit.to_owned(),
            other => other.to_owned(),
        })
        .collect();
    let mut cmd = Command::new(&words[0]);
    cmd.arg("--root")
        .arg(&root)
        .args(&words[1..])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let mut child = Child(cmd.spawn().expect("spawn ExecStart"));
    let sock = root.join("unit-pair/gms/gms-host.sock");
    let pid = until("gmsd socket from ExecStart", LIMIT, STEP, || {
        status_pid(&sock)
    });
    assert_eq!(
        pid,
        child.0.id() as u64,
        "ExecStart must exec gmsd in place"
    );
    assert!(root.join("unit-pair/pair/engine.lock").is_file());
    assert!(root.join("unit-pair/admission.json").is_file());
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.0.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let status = child.0.wait().unwrap();
    assert!(status.success(), "gmsd after SIGTERM: {status}");
    assert!(!sock.exists(), "gmsd left its socket");
}

fn hook(root: &Path, args: &[&str]) -> std::process::Output {
    Command::new(HOOK)
        .arg("--root")
        .arg(root)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

#[test]
fn gms_start_stop_and_poststop_keep_a_used_pair() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("hooks");
    let g = gmsd().display().to_string();
    let admit = ["--allow-annotation", "test.shadow.dev/tenant=t1"];
    let out = hook(
        &root,
        &[&["gms", "start", "--pair", "p", "--gmsd", &g][..], &admit].concat(),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let pid: u64 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    assert_eq!(status_pid(&root.join("p/gms/gms-host.sock")), Some(pid));
    // A second gmsd for the same pair is refused, naming the first.
    let again = hook(
        &root,
        &[&["gms", "start", "--pair", "p", "--gmsd", &g][..], &admit].concat(),
    );
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains(&pid.to_string()));

    // poststop with gmsd running, then with the lock held: the dir stays.
    let state = r#"{"ociVersion":"1.0.2","id":"c","status":"stopped","pid":0,"bundle":"/nonexistent","annotations":{"shadow.dev/pair-name":"p","test.shadow.dev/tenant":"t1"}}"#;
    // A container that only named the pair does not clean it up.
    let stranger = r#"{"ociVersion":"1.0.2","id":"x","status":"stopped","pid":0,"bundle":"/nonexistent","annotations":{"shadow.dev/pair-name":"p"}}"#;
    let poststop_as = |state: &str| {
        let mut c = Command::new(HOOK)
            .arg("--root")
            .arg(&root)
            .arg("poststop")
            .stdin(Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write;
        c.stdin.take().unwrap().write_all(state.as_bytes()).unwrap();
        assert!(c.wait().unwrap().success());
    };
    let poststop = || poststop_as(state);
    poststop();
    assert!(root.join("p").is_dir());
    let lock = std::fs::File::open(root.join("p/pair/engine.lock")).unwrap();
    let held = nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusive).unwrap();
    let out = hook(&root, &["gms", "stop", "--pair", "p"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !Path::new(&format!("/proc/{pid}")).exists() || {
            let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            s.contains(") Z")
        },
        "gmsd {pid} still running after gms stop"
    );
    poststop();
    assert!(root.join("p").is_dir(), "removed while the lock is held");
    drop(held);
    poststop_as(stranger);
    assert!(
        root.join("p").is_dir(),
        "removed by a container not admitted"
    );
    poststop();
    assert!(!root.join("p").exists(), "unused pair dir kept");
}
