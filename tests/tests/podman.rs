//! The shadow contract without our shim, through real podman 4.3 and real
//! runc: two engine containers of one pair share weights through one gmsd
//! (started by `shadow-oci-hook gms start`) and fail over through the
//! election lock when the serving one is SIGKILLed. Three ways in:
//!
//! - the `precreate` hook from a hooks.d directory (podman, CRI-O);
//! - a CDI device `shadow.dev/gms=<pair>` (any CDI-aware runtime);
//! - the OCI `createRuntime` hook in config.json (plain runc).
//!
//! Each test has a private podman storage root / runc root and pair root
//! under its temp dir, and a guard that removes containers, the CDI spec,
//! gmsd, and the dirs even when the test fails, then asserts nothing is left.

use serde_json::{json, Value};
use shadow_tests::pair::{ask, free_port, install_binary, until, Answer};
use shadow_tests::{mounts_under, our_processes, wait, Rootfs};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

const ENGINE: &str = env!("CARGO_BIN_EXE_test-engine");
const LONG: Duration = Duration::from_secs(30);
const STEP: Duration = Duration::from_millis(5);
/// podman's containers start here only with these limits (raising is refused).
const ULIMITS: [&str; 4] = [
    "--ulimit",
    "nofile=1024:1024",
    "--ulimit",
    "nproc=1024:1024",
];

fn now_us() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros())
        .unwrap_or(0)
}

/// A figure, not an assertion: from the kill (for podman: the start of
/// `podman kill`, its CLI overhead included) to the promoted engine taking
/// the lock.
fn report(stack: &str, killed_us: u128, promoted: &Answer) {
    eprintln!(
        "{stack}: SIGKILL issued → slot {} holds the lock: {:.3} ms",
        promoted.slot,
        promoted.lock_us.saturating_sub(killed_us) as f64 / 1000.0
    );
}

/// A binary of the workspace, built next to the test engine.
fn sibling(name: &str) -> PathBuf {
    let p = Path::new(ENGINE).with_file_name(name);
    assert!(
        p.is_file(),
        "{} missing: build the workspace first (`cargo build --workspace`)",
        p.display()
    );
    p
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// One pair's world: a temp dir with the pair root (hook `--root`), a
/// rootfs with the test engine, and gmsd for the pair.
struct PairWorld {
    tmp: tempfile::TempDir,
    pair: String,
    port: u16,
    hook: PathBuf,
    gmsd_started: bool,
}

impl PairWorld {
    fn new(pair: &str) -> Self {
        let tmp = tempfile::Builder::new()
            .prefix("shadow-podman-")
            .tempdir()
            .expect("temp dir");
        let rootfs = Rootfs::busybox()
            .build(&tmp.path().join("rootfs"))
            .expect("rootfs");
        install_binary(&rootfs, Path::new(ENGINE), "/usr/bin/test-engine").expect("engine");
        // Unique per run, so a leftover of a killed run never collides.
        let pair = format!("{pair}-{}", std::process::id());
        PairWorld {
            tmp,
            pair,
            port: free_port(),
            hook: sibling("shadow-oci-hook"),
            gmsd_started: false,
        }
    }

    fn root(&self) -> PathBuf {
        self.tmp.path().join("pairs")
    }

    fn hook_cmd(&self) -> Command {
        let mut c = Command::new(&self.hook);
        c.arg("--root").arg(self.root());
        c
    }

    /// The annotation this test's pair admits its containers by.
    fn tenant(&self) -> (String, String) {
        ("test.shadow.dev/tenant".into(), self.pair.clone())
    }

    fn start_gmsd(&mut self) {
        let gmsd = sibling("gmsd");
        let (k, v) = self.tenant();
        run(self
            .hook_cmd()
            .args(["gms", "start", "--pair", &self.pair, "--gmsd"])
            .arg(gmsd)
            .arg("--allow-annotation")
            .arg(format!("{k}={v}")));
        self.gmsd_started = true;
    }

    fn gms_status(&self) -> Value {
        let sock = self.root().join(&self.pair).join("gms/gms-host.sock");
        let out = run(Command::new(sibling("gmsd"))
            .args(["status", "--json", "--socket"])
            .arg(sock));
        serde_json::from_slice(&out.stdout).expect("gmsd status JSON")
    }

    /// Waits until `n` engines hold leases on the committed layout.
    fn wait_leases(&self, n: usize) -> Value {
        until(&format!("{n} GMS leases"), LONG, STEP, || {
            let st = self.gms_status();
            (st["state"] == "committed" && st["leases"].as_array().map(Vec::len) == Some(n))
                .then_some(st)
        })
    }

    fn answer(&self, what: &str, pred: impl Fn(&Answer) -> bool) -> Answer {
        until(what, LONG, STEP, || ask(self.port).filter(|a| pred(a)))
    }

    /// gms stop, then the dir; returns what is left (for the assertion).
    fn teardown(&mut self) -> Vec<String> {
        let mut left = Vec::new();
        if self.gmsd_started {
            let out = self
                .hook_cmd()
                .args(["gms", "stop", "--pair", &self.pair])
                .output();
            if let Ok(o) = out {
                if !o.status.success() {
                    left.push(format!("gms stop: {}", String::from_utf8_lossy(&o.stderr)));
                }
            }
            self.gmsd_started = false;
        }
        for m in mounts_under(self.tmp.path()) {
            left.push(format!("mount {}", m.display()));
        }
        // conmon outlives `podman rm -f` by a moment (it writes the exit
        // file after the container dies): a process still there after a
        // bounded wait is a leftover, one on its way out is not.
        let (Ok(procs) | Err(procs)) =
            wait::poll(Duration::from_secs(10), Duration::from_millis(50), || {
                let procs = our_processes(self.tmp.path(), self.tmp.path());
                if procs.is_empty() {
                    Ok(procs)
                } else {
                    Err(procs)
                }
            });
        for (pid, cmd) in procs {
            left.push(format!("process {pid}: {cmd}"));
        }
        if self.root().join(&self.pair).exists() {
            left.push(format!(
                "pair dir {}",
                self.root().join(&self.pair).display()
            ));
        }
        left
    }
}

/// podman with a private storage root, runroot and hooks dir.
struct Podman {
    world: PairWorld,
    cdi_spec: Option<PathBuf>,
    image: String,
    /// The host-wide shared-memory lock existed before this test.
    shm_lock_before: bool,
    /// A host CDI directory this test created: removed again when empty.
    cdi_dir_made: Option<PathBuf>,
}

/// podman's default (shm) lock manager's segment: a test must not make it.
const SHM_LOCK: &str = "/dev/shm/libpod_lock";

impl Podman {
    fn new(pair: &str) -> Self {
        let world = PairWorld::new(pair);
        let p = Podman {
            image: format!("localhost/shadow-engine-{}:test", world.pair),
            world,
            cdi_spec: None,
            shm_lock_before: Path::new(SHM_LOCK).exists(),
            cdi_dir_made: None,
        };
        let tar = p.dir().join("image.tar");
        run(Command::new("tar")
            .arg("-C")
            .arg(p.dir().join("rootfs"))
            .arg("-cf")
            .arg(&tar)
            .arg("."));
        // podman's default lock manager is one shared-memory segment for
        // the whole host (/dev/shm/libpod_lock), created by the first
        // podman that runs: concurrent first runs race ("file exists"),
        // and every run leaves it behind. File locks live in --tmpdir.
        std::fs::write(
            p.dir().join("containers.conf"),
            "[engine]\nlock_type = \"file\"\n",
        )
        .expect("containers.conf");
        let image = p.image.clone();
        run(p.cmd().arg("import").arg(&tar).arg(&image));
        std::fs::create_dir_all(p.dir().join("hooks.d")).expect("hooks dir");
        p
    }

    fn dir(&self) -> &Path {
        self.world.tmp.path()
    }

    fn cmd(&self) -> Command {
        let mut c = Command::new("podman");
        let d = self.dir();
        // Only this file: nothing of the host's podman configuration.
        c.env("CONTAINERS_CONF", d.join("containers.conf"));
        c.arg("--root")
            .arg(d.join("storage"))
            .arg("--runroot")
            .arg(d.join("runroot"))
            // libpod's own state (alive marker, exit files, events), which
            // otherwise sits in /run/libpod for every podman of the host.
            .arg("--tmpdir")
            .arg(d.join("libpod"))
            .args([
                "--storage-driver",
                "vfs",
                "--cgroup-manager",
                "cgroupfs",
                "--events-backend",
                "file",
            ])
            .arg("--hooks-dir")
            .arg(d.join("hooks.d"));
        c
    }

    /// The repo's hooks.d JSON, with this build's binary and the test's root.
    fn install_hooks(&self) {
        for stage in ["precreate", "poststop"] {
            let src = Path::new(env!("CARGO_MANIFEST_DIR"))
                .join(format!("../oci-hooks/hooks.d/shadow-{stage}.json"));
            let mut hook: Value = serde_json::from_str(
                &std::fs::read_to_string(&src).unwrap_or_else(|e| panic!("{src:?}: {e}")),
            )
            .expect("hooks.d JSON");
            hook["hook"]["path"] = json!(self.world.hook);
            hook["hook"]["args"] = json!(["shadow-oci-hook", "--root", self.world.root(), stage]);
            let dst = self.dir().join(format!("hooks.d/shadow-{stage}.json"));
            std::fs::write(&dst, hook.to_string()).expect("write hook");
        }
    }

    fn run_engine(&self, name: &str, extra: &[&str]) {
        let port = self.world.port.to_string();
        run(self
            .cmd()
            .args(["run", "-d", "--name", name, "--network", "host"])
            .args(ULIMITS)
            .args(extra)
            .arg(&self.image)
            .args(["/usr/bin/test-engine", "--port", &port, "--no-notify"]));
    }

    fn kill(&self, name: &str) {
        run(self.cmd().args(["kill", "-s", "KILL", name]));
    }
}

impl Drop for Podman {
    fn drop(&mut self) {
        let _ = self.cmd().args(["rm", "-f", "-a", "-t", "0"]).output();
        let _ = self.cmd().args(["rmi", "-a", "-f"]).output();
        if let Some(spec) = self.cdi_spec.take() {
            let _ = std::fs::remove_file(spec);
        }
        if let Some(dir) = self.cdi_dir_made.take() {
            // Fails while another test's spec is in it; that test's own
            // guard, or a later run, removes it.
            let _ = std::fs::remove_dir(dir);
        }
        let mut left = self.world.teardown();
        if !self.shm_lock_before && Path::new(SHM_LOCK).exists() {
            left.push(format!("{SHM_LOCK} (host-wide podman state)"));
        }
        if !std::thread::panicking() {
            assert!(left.is_empty(), "left behind: {left:#?}");
        }
    }
}

/// The scenario both podman paths share: slot 0 loads and serves, slot 1
/// maps the same weights and waits; SIGKILL of slot 0 hands over to slot 1.
fn pair_fails_over(p: &mut Podman, slot_args: [Vec<String>; 2]) {
    p.world.start_gmsd();
    fn to_str(v: &[String]) -> Vec<&str> {
        v.iter().map(String::as_str).collect()
    }
    p.run_engine("e0", &to_str(&slot_args[0]));
    let first = p.world.answer("slot 0 serving", |a| a.slot == "0");
    assert!(
        first.loaded,
        "slot 0 should have loaded the weights: {first:?}"
    );
    p.run_engine("e1", &to_str(&slot_args[1]));
    let st = p.world.wait_leases(2);
    assert_eq!(
        st["committed"]["allocations"].as_array().map(Vec::len),
        Some(1)
    );
    // Still slot 0: the lock, not a race for the port, decides who serves.
    assert_eq!(p.world.answer("slot 0 still", |_| true).slot, "0");
    let killed_us = now_us();
    p.kill("e0");
    let second = p.world.answer("slot 1 serving", |a| a.slot == "1");
    report("podman", killed_us, &second);
    assert!(!second.loaded, "slot 1 must map, not load: {second:?}");
    assert_eq!(second.weights, first.weights, "same weights through GMS");
    // The killed engine's lease is gone; the survivor's stays.
    p.world.wait_leases(1);
    run(p.cmd().args(["rm", "-f", "-t", "0", "e0", "e1"]));
}

#[test]
fn podman_precreate_hook_pair_shares_weights_and_fails_over() {
    let mut p = Podman::new("hook");
    p.install_hooks();
    let pair = p.world.pair.clone();
    let (k, v) = p.world.tenant();
    let args = |slot: &str| {
        vec![
            "--annotation".to_owned(),
            format!("shadow.dev/pair-name={pair}"),
            "--annotation".to_owned(),
            format!("shadow.dev/slot={slot}"),
            "--annotation".to_owned(),
            format!("{k}={v}"),
        ]
    };
    pair_fails_over(&mut p, [args("0"), args("1")]);
    // A container that names the pair without being admitted is refused
    // by the hook: podman does not run it, and it gets nothing.
    let intruder = p
        .cmd()
        .args(["run", "--rm", "--network", "host"])
        .args(ULIMITS)
        .args(["--annotation", &format!("shadow.dev/pair-name={pair}")])
        .arg(&p.image)
        .args(["sh", "-c", "echo GMS=${GMS_SOCKET_DIR:-none}"])
        .output()
        .expect("podman run");
    assert!(
        !intruder.status.success(),
        "a container not admitted joined the pair: {}",
        String::from_utf8_lossy(&intruder.stdout)
    );
    let why = String::from_utf8_lossy(&intruder.stderr);
    assert!(why.contains("precreate") || why.contains("hook"), "{why}");
    // A container without the annotation is left alone by the hook.
    let out = run(p
        .cmd()
        .args(["run", "--rm", "--network", "host"])
        .args(ULIMITS)
        .arg(&p.image)
        .args([
            "sh",
            "-c",
            "echo GMS=${GMS_SOCKET_DIR:-none}; ls /run/shadow 2>&1 || true",
        ]));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("GMS=none"),
        "unannotated container got: {text}"
    );
}

#[test]
fn podman_cdi_device_pair_shares_weights_and_fails_over() {
    let mut p = Podman::new("cdi");
    // podman 4.3 reads CDI specs only from /etc/cdi and /var/run/cdi (no
    // configurable dir): a spec named after this run's pair, removed by Drop.
    let cdi_dir = Path::new("/var/run/cdi");
    if !cdi_dir.exists() {
        p.cdi_dir_made = Some(cdi_dir.to_path_buf());
    }
    let out = run(p
        .world
        .hook_cmd()
        .args(["cdi", "generate", "--pair", &p.world.pair, "--dir"])
        .arg(cdi_dir));
    let spec = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    assert!(spec.is_file(), "no CDI spec at {spec:?}");
    p.cdi_spec = Some(spec);
    let device = format!("shadow.dev/gms={}", p.world.pair);
    let args = |slot: &str| {
        vec![
            "--device".to_owned(),
            device.clone(),
            "-e".to_owned(),
            format!("SHADOW_ENGINE_ID={slot}"),
        ]
    };
    pair_fails_over(&mut p, [args("0"), args("1")]);
}

/// Plain runc: config.json carries the createRuntime hook and the env (a
/// hook at that stage cannot add env); the hook binds the pair's dirs.
struct Runc {
    world: PairWorld,
    ids: Vec<String>,
}

impl Runc {
    fn cmd(&self) -> Command {
        let mut c = Command::new("runc");
        c.arg("--root").arg(self.world.tmp.path().join("runc"));
        c
    }

    fn bundle(&self, slot: u8) -> PathBuf {
        let b = self.world.tmp.path().join(format!("bundle{slot}"));
        std::fs::create_dir_all(&b).expect("bundle dir");
        run(Command::new("runc").arg("spec").arg("--bundle").arg(&b));
        let path = b.join("config.json");
        let mut spec: Value =
            serde_json::from_str(&std::fs::read_to_string(&path).expect("config.json"))
                .expect("json");
        spec["root"] = json!({"path": self.world.tmp.path().join("rootfs"), "readonly": false});
        spec["process"]["terminal"] = json!(false);
        spec["process"]["args"] = json!([
            "/usr/bin/test-engine",
            "--port",
            self.world.port.to_string(),
            "--no-notify"
        ]);
        spec["process"]["env"] = json!([
            "PATH=/bin:/usr/bin",
            format!("SHADOW_ENGINE_ID={slot}"),
            "SHADOW_LOCK_PATH=/run/shadow/pair/engine.lock",
            "GMS_SOCKET_DIR=/run/shadow/gms",
        ]);
        spec["process"]["rlimits"] = json!([{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}]);
        // Host network: the test asks the engine on 127.0.0.1.
        if let Some(ns) = spec["linux"]["namespaces"].as_array_mut() {
            ns.retain(|n| n["type"] != "network");
        }
        let (tenant_key, tenant) = self.world.tenant();
        spec["annotations"] = json!({
            tenant_key: tenant,
            "shadow.dev/pair-name": self.world.pair,
            "shadow.dev/slot": slot.to_string(),
        });
        let hook = |stage: &str| {
            json!([{
                "path": self.world.hook,
                "args": ["shadow-oci-hook", "--root", self.world.root(), stage],
            }])
        };
        spec["hooks"] = json!({
            "createRuntime": hook("create-runtime"),
            "poststop": hook("poststop"),
        });
        std::fs::write(&path, spec.to_string()).expect("write config.json");
        b
    }

    fn start(&mut self, slot: u8) -> String {
        let id = format!("{}-{slot}", self.world.pair);
        let bundle = self.bundle(slot);
        let log_path = self.world.tmp.path().join(format!("engine{slot}.log"));
        let log = std::fs::File::create(&log_path).expect("log");
        self.ids.push(id.clone());
        // The detached container keeps runc's stdio: a file, not a pipe
        // that would hold `output()` open for the container's life.
        let status = self
            .cmd()
            .args(["run", "-d", "--bundle"])
            .arg(&bundle)
            .arg(&id)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .status()
            .expect("runc run");
        assert!(
            status.success(),
            "runc run {id}: {status}\n{}",
            std::fs::read_to_string(&log_path).unwrap_or_default()
        );
        id
    }
}

impl Drop for Runc {
    fn drop(&mut self) {
        for id in &self.ids {
            let _ = self.cmd().args(["delete", "-f", id]).output();
        }
        let left = self.world.teardown();
        if !std::thread::panicking() {
            assert!(left.is_empty(), "left behind: {left:#?}");
        }
    }
}

#[test]
fn runc_create_runtime_hook_pair_shares_weights_and_fails_over() {
    let mut r = Runc {
        world: PairWorld::new("runc"),
        ids: Vec::new(),
    };
    r.world.start_gmsd();
    let e0 = r.start(0);
    let first = r.world.answer("slot 0 serving", |a| a.slot == "0");
    assert!(first.loaded, "slot 0 should have loaded: {first:?}");
    r.start(1);
    r.world.wait_leases(2);
    // kill(2) of the engine's host pid, no CLI in between: the figure is
    // then the kernel's lock handoff plus the engine's wake-up.
    let state = run(r.cmd().args(["state", &e0]));
    let state: Value = serde_json::from_slice(&state.stdout).expect("runc state");
    let pid = state["pid"].as_i64().expect("engine pid") as i32;
    let killed_us = now_us();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("SIGKILL slot 0");
    let second = r.world.answer("slot 1 serving", |a| a.slot == "1");
    report("runc (kill(2) of the engine)", killed_us, &second);
    assert!(!second.loaded, "slot 1 must map, not load: {second:?}");
    assert_eq!(second.weights, first.weights);
    r.world.wait_leases(1);
}
