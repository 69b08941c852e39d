//! The Kubernetes path, for real: a private containerd with its CRI plugin
//! and the runtime entry shipped in `config/containerd-1.6.toml`, driven
//! over gRPC the way the kubelet drives it (RunPodSandbox with handler
//! `shadow`, CreateContainer, StartContainer, ContainerStatus, Stop/Remove),
//! with images built here and imported locally (no registry, no CNI: the pod
//! uses the host network). Also: every file in `config/` parses and names
//! the runtime the way the docs say.

use serde_json::Value;
use shadow_tests::cri::{self, v1::ContainerState, Cri};
use shadow_tests::pair::{ask, free_port, install_binary, until, PairEnv};
use shadow_tests::{our_processes, Containerd, OciImage, Rootfs, SHIM_BINARY};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

const ENGINE: &str = env!("CARGO_BIN_EXE_test-engine");
const PAUSE_IMAGE: &str = "shadow.test/pause:1";
const ENGINE_IMAGE: &str = "shadow.test/engine:1";
/// The CRI plugin works in this containerd namespace, always.
const K8S_NAMESPACE: &str = "k8s.io";
const LONG: Duration = Duration::from_secs(30);
const STEP: Duration = Duration::from_millis(5);

fn config_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../config")
}

fn gmsd() -> String {
    let p = Path::new(ENGINE).with_file_name("gmsd");
    assert!(
        p.is_file(),
        "{} missing: build it with `cargo build -p gms --bin gmsd`",
        p.display()
    );
    p.display().to_string()
}

fn kill(pid: u32, sig: i32) {
    // SAFETY: kill(2) with a pid read from the pair's state and a signal number.
    let rc = unsafe { libc::kill(pid as i32, sig) };
    assert_eq!(rc, 0, "kill {pid}: {}", std::io::Error::last_os_error());
}

/// containerd config for the test: the CRI plugin with our local pause
/// image and empty CNI dirs (host-network pods never call CNI), then the
/// runtime entry exactly as shipped, its ConfigPath pointed at the test's
/// shim config.
fn cri_config() -> String {
    let shipped_path = config_dir().join("containerd-1.6.toml");
    let shipped = std::fs::read_to_string(&shipped_path)
        .unwrap_or_else(|e| panic!("{}: {e}", shipped_path.display()));
    let entry: String = shipped
        .lines()
        .filter(|l| !l.trim_start().starts_with("version"))
        .map(|l| format!("{l}\n"))
        .collect::<String>()
        .replace("/etc/shadow/config.toml", "@DIR@/shadow-pair.toml");
    assert!(
        entry.contains("@DIR@/shadow-pair.toml"),
        "{} no longer names /etc/shadow/config.toml",
        shipped_path.display()
    );
    format!(
        r#"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  # This VM may not lower oom_score_adj (runc: "failed to update
  # /proc/self/oom_score_adj: Permission denied" for the sandbox's -998).
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "@DIR@/cni/bin"
    conf_dir = "@DIR@/cni/net.d"

# --- config/containerd-1.6.toml ---
{entry}"#
    )
}

/// Build the pause and engine images from one busybox rootfs (+ the test
/// engine, stripped) and import them into the CRI namespace; wait until the
/// CRI plugin lists both.
fn import_images(cd: &Containerd, cri: &Cri) {
    let work = cd.dir().join("images");
    let rootfs = Rootfs::busybox()
        .build(&work.join("rootfs"))
        .expect("image rootfs");
    install_binary(&rootfs, Path::new(ENGINE), "/bin/test-engine").expect("install engine");
    // Debug info is most of the binary; the image does not need it.
    let _ = Command::new("strip")
        .arg("--strip-debug")
        .arg(rootfs.join("bin/test-engine"))
        .status();
    let images = [
        OciImage::new(PAUSE_IMAGE).entrypoint(&["/bin/sleep", "1000000000"]),
        OciImage::new(ENGINE_IMAGE).entrypoint(&["/bin/test-engine"]),
    ];
    for img in &images {
        let archive = img.write_archive(&rootfs, &work).expect("image archive");
        cd.ctr()
            .run(&["images", "import", &archive.display().to_string()])
            .expect("ctr images import")
            .assert_success();
        until(&format!("CRI to see {}", img.name()), LONG, STEP, || {
            cri.image(img.name()).ok().flatten()
        });
    }
}

/// Our shim daemons (not the short-lived `start` invocations).
fn shims(cd: &Containerd) -> Vec<(i32, String)> {
    our_processes(cd.dir(), cd.address())
        .into_iter()
        .filter(|(_, c)| c.contains(SHIM_BINARY) && !c.ends_with(" start"))
        .collect()
}

/// Removes the pair state dir (outside the harness's temp dir) at the end.
struct StateDir(PathBuf);

impl Drop for StateDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The shim config for the pod. The pair state dir is short and outside the
/// temp dir: CRI ids are 64 characters, and `<state_dir>/k8s.io/<id>/pair/
/// notify.sock` must fit a unix socket path (107 bytes), which leaves 18
/// characters for `state_dir` (`/run/shadow`, the default, fits).
fn pair_env(cd: &Containerd) -> (PairEnv, StateDir) {
    let state_dir = PathBuf::from(format!("/tmp/sc-{}", std::process::id()));
    let guard = StateDir(state_dir.clone());
    let metrics_dir = cd.dir().join("metrics");
    let config = cd.dir().join("shadow-pair.toml");
    let text = format!(
        "log_level = \"debug\"\n[pair]\nstate_dir = \"{}\"\nmetrics_dir = \"{}\"\ngmsd = \"{}\"\ngms = \"host\"\n",
        state_dir.display(),
        metrics_dir.display(),
        gmsd()
    );
    std::fs::write(&config, text).expect("write shim config");
    let env = PairEnv {
        state_dir,
        metrics_dir,
        config,
    };
    (env, guard)
}

fn active_of(st: &Value) -> (usize, u32) {
    let slot = st["pair"]["active"].as_u64().expect("active slot") as usize;
    let pid = st["pids"][slot].as_u64().expect("active pid") as u32;
    (slot, pid)
}

#[test]
fn a_pod_with_runtime_class_shadow_survives_sigkill_of_its_active_engine() {
    let cd = Containerd::builder()
        .cri(true)
        .namespace(K8S_NAMESPACE)
        .config_append(cri_config())
        .start()
        .expect("containerd with CRI");
    let (env, _state) = pair_env(&cd);
    let cri = Cri::connect(cd.address()).expect("CRI connect");
    let v = cri.version().expect("CRI Version");
    assert_eq!(v.runtime_name, "containerd", "{v:?}");
    import_images(&cd, &cri);

    let port = free_port();
    let port_s = port.to_string();
    let logs = cd.dir().join("pod-logs");
    std::fs::create_dir_all(&logs).expect("log dir");
    let pod_cfg = cri::host_network_pod(
        "engine-pod",
        &format!("uid-{}", std::process::id()),
        &[("shadow.dev/pair", "engine")],
        &logs,
    );
    let pod = cri.run_pod(&pod_cfg, "shadow").expect("RunPodSandbox");
    cd.record_id(&pod);
    let ctr_cfg = cri::container(
        "engine",
        ENGINE_IMAGE,
        &["/bin/test-engine"],
        &["--port", &port_s],
        &[("PORT", &port_s)],
    );
    let cid = cri
        .create_container(&pod, &ctr_cfg, &pod_cfg)
        .expect("CreateContainer");
    cd.record_id(&cid);
    cri.start_container(&cid).expect("StartContainer");

    // Both engines run; one serves on the host network.
    let st = env.wait_protected(&cd, &cid, LONG);
    let (slot, pid) = active_of(&st);
    let first = until("the active engine to answer", LONG, STEP, || ask(port));
    assert_eq!(first.slot, slot.to_string(), "the active slot serves");
    assert!(!first.weights.is_empty(), "weights through GMS: {first:?}");
    assert_eq!(
        cri.container_state(&cid).expect("status"),
        ContainerState::ContainerRunning
    );
    // containerd's view of the task pid is the active engine.
    let status = cri.container_status(&cid).expect("status");
    let info: Value =
        serde_json::from_str(status.info.get("info").expect("verbose info")).expect("info is JSON");
    assert_eq!(info["pid"].as_u64(), Some(u64::from(pid)), "{info}");
    // One shim for the whole pod: the sandbox and the engine pair.
    let one = until("one shim for the pod", LONG, STEP, || {
        let s = shims(&cd);
        (s.len() == 1).then_some(s)
    });
    // Give a second shim the chance to show up if grouping were broken:
    // it would have been started by CreateContainer, which has returned.
    assert_eq!(shims(&cd), one, "exactly one shim, still");

    // SIGKILL of the active engine: the other one serves, Kubernetes sees nothing.
    kill(pid, libc::SIGKILL);
    let next = until("the other engine to serve", LONG, STEP, || {
        ask(port).filter(|a| a.slot != first.slot)
    });
    assert_eq!(next.weights, first.weights, "same weights, shared");
    assert!(!next.loaded, "the promoted engine did not reload weights");
    until(
        "the killed slot back as a parked shadow",
        LONG,
        STEP,
        || {
            env.state(&cd, &cid)
                .filter(|v| v["pair"]["protected"] == true && v["pair"]["active"] == 1 - slot)
        },
    );
    let status = cri.container_status(&cid).expect("status");
    let s = status.status.expect("status");
    assert_eq!(
        ContainerState::try_from(s.state),
        Ok(ContainerState::ContainerRunning),
        "{s:?}"
    );
    assert_eq!(s.exit_code, 0, "no exit reported: {s:?}");
    assert_eq!(shims(&cd).len(), 1, "still one shim");

    // Tear down the way the kubelet does; nothing may be left.
    cri.stop_container(&cid, Duration::from_secs(10))
        .expect("StopContainer");
    assert_eq!(
        cri.container_state(&cid).expect("status"),
        ContainerState::ContainerExited
    );
    cri.remove_container(&cid).expect("RemoveContainer");
    cri.stop_pod(&pod).expect("StopPodSandbox");
    cri.remove_pod(&pod).expect("RemovePodSandbox");
    assert_eq!(cri.containers().expect("list"), Vec::<String>::new());
    assert_eq!(cri.pods().expect("list"), Vec::<String>::new());
    cd.assert_no_leftovers();
    assert!(!env.pair_dir(&cd, &cid).exists(), "pair dir left");
    until("the shim to exit", LONG, STEP, || {
        shims(&cd).is_empty().then_some(())
    });
}
