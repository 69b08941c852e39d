//! The Kubernetes path, for real: a private containerd with its CRI plugin
//! and the runtime entry shipped in `config/containerd-1.6.toml`, driven
//! over gRPC the way the kubelet drives it (RunPodSandbox with handler
//! `shadow`, CreateContainer, StartContainer, ContainerStatus, Stop/Remove),
//! with images built here and imported locally (no registry, no CNI: the pod
//! uses the host network). Also: the supervisor script of the Nomad job in
//! `config/nomad/engine-ctr.nomad.hcl` runs a pair from an imported image
//! across a containerd restart, and every file in `config/` parses and names the runtime the way the
//! docs say.
//!
//! The CRI plugin always works in containerd namespace `k8s.io`, so the
//! harness's cleanup of this test covers `/run/containerd/runc/k8s.io` and
//! the `k8s.io` cgroups: do not run it on a node that serves a real kubelet.

use serde_json::Value;
use shadow_contract::state::PairState;
use shadow_tests::cri::{self, v1::ContainerState, Cri};
use shadow_tests::pair::{ask, free_port, install_binary, until, PairEnv};
use shadow_tests::{
    mounts_under, our_processes, Containerd, OciImage, Rootfs, Spawned, SHIM_BINARY,
};
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
        "{} missing: build it with `cargo build -p gmsd --bin gmsd`",
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
        .replace("/etc/containerd/shadow.toml", "@DIR@/shadow-pair.toml");
    assert!(
        entry.contains("@DIR@/shadow-pair.toml"),
        "{} no longer names /etc/containerd/shadow.toml",
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
/// engine, stripped) and import them into `cd`'s namespace with `ctr`.
fn import_images(cd: &Containerd) -> [OciImage; 2] {
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
    }
    images
}

/// Our shim daemons (not the short-lived `start` invocations).
fn shims(cd: &Containerd) -> Vec<(i32, String)> {
    our_processes(cd.dir(), cd.address())
        .into_iter()
        .filter(|(_, c)| c.contains(SHIM_BINARY) && !c.ends_with(" start"))
        .collect()
}

/// The pair state dir, outside the harness's temp dir (see [`pair_env`]).
/// Made before the containerd guard so that it is dropped after it: by then
/// the shims are gone; what a killed shim left mounted is unmounted, then
/// the dir is removed.
struct StateDir(PathBuf);

impl StateDir {
    fn new() -> Self {
        StateDir(PathBuf::from(format!("/tmp/sc-{}", std::process::id())))
    }
}

impl Drop for StateDir {
    fn drop(&mut self) {
        for m in mounts_under(&self.0) {
            let _ = nix::mount::umount2(&m, nix::mount::MntFlags::MNT_DETACH);
        }
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The supervisor script of `config/nomad/engine-ctr.nomad.hcl` (its
/// template's `data` heredoc), as the job writes it to `local/`.
fn nomad_script() -> String {
    let text = read("nomad/engine-ctr.nomad.hcl");
    let start = text
        .find("<<EOF\n")
        .expect("data = <<EOF in engine-ctr.nomad.hcl");
    let body = &text[start + "<<EOF\n".len()..];
    let end = body.find("\nEOF\n").expect("closing EOF");
    let script = &body[..=end];
    // HCL would expand these in a heredoc: the script must have none.
    assert!(!script.contains("${") && !script.contains("%{"), "{script}");
    script.to_owned()
}

#[test]
fn the_nomad_raw_exec_job_runs_a_pair_from_an_image_across_a_containerd_restart() {
    let mut cd = Containerd::start().expect("containerd");
    import_images(&cd);
    let env = PairEnv::new(&cd, "gms = \"off\"").expect("config");
    let port = free_port();
    let alloc = "0f1e2d3c";
    let id = format!("llm-engine-{alloc}");
    cd.record_id(&id);
    // The job's own script with the test's image, engine and port; what
    // Nomad would give it (NOMAD_ALLOC_ID) and the test's containerd,
    // namespace, shim config and fifo dir through the variables it reads.
    let script = nomad_script()
        .replace("registry.example.com/llm/engine:1.0", ENGINE_IMAGE)
        .replace("/engine --port", "/bin/test-engine --port")
        .replace("8000", &port.to_string());
    let path = cd.dir().join("ctr-pair.sh");
    std::fs::write(&path, &script).expect("write the job's script");
    let mut cmd = std::process::Command::new("/bin/sh");
    cmd.arg(&path)
        .env("NOMAD_ALLOC_ID", alloc)
        .env("CONTAINERD_ADDRESS", cd.address())
        .env("CONTAINERD_NAMESPACE", cd.namespace())
        .env(
            "CTR_RUN_FLAGS",
            format!(
                "--runtime-config-path {} --fifo-dir {}",
                env.config.display(),
                cd.fifo_dir().display()
            ),
        );
    let mut job = Spawned::start(cmd, "the Nomad job's script", false).expect("sh");
    let st = until("pair protected, the script running", LONG, STEP, || {
        assert!(
            !job.has_exited(),
            "the script ended: {}{}",
            job.stdout_so_far(),
            job.stderr_so_far()
        );
        env.state(&cd, &id).filter(|v| v.pair.protected)
    });
    let (slot, pid) = active_of(&st);
    let first = until("the active engine to answer", LONG, STEP, || ask(port));
    assert_eq!(first.slot, slot.to_string());
    kill(pid, libc::SIGKILL);
    let second = until("the other engine to serve", LONG, STEP, || {
        ask(port).filter(|a| a.slot != first.slot)
    });
    // A containerd restart (as ctr 2.x's foreground run would not survive
    // it), once the script follows the task: the pair goes on serving and
    // the script attaches again.
    let attached = |job: &mut Spawned| {
        assert!(
            !job.has_exited(),
            "the script ended: {}",
            job.stderr_so_far()
        );
        our_attach(job.pid())
    };
    let before = until("the script to attach", LONG, STEP, || attached(&mut job));
    cd.restart().expect("restart containerd");
    assert_eq!(
        ask(port).expect("serving after the restart").boot,
        second.boot
    );
    assert_eq!(
        cd.ctr().task_status(&id).expect("task ls").as_deref(),
        Some("RUNNING")
    );
    until("the script to attach again", LONG, STEP, || {
        attached(&mut job).filter(|pid| *pid != before)
    });
    // The engines' output reaches the job's log through the attach.
    assert!(!job.stdout_so_far().is_empty() || !job.stderr_so_far().is_empty());
    // Nomad stops the job with SIGTERM to the script, which sends it on to
    // the task; the script ends when the task has, and removes it.
    job.signal(libc::SIGTERM).expect("SIGTERM to the script");
    let out = job.wait(LONG).expect("the script ends");
    assert_ne!(out.code(), 0, "a signalled task: {out}");
    cd.assert_no_leftovers();
    assert!(!env.pair_dir(&cd, &id).exists(), "pair dir left");
}

/// The pid of a `ctr task attach` child of `pid`, if one runs.
fn our_attach(pid: u32) -> Option<u32> {
    let dir = std::fs::read_dir("/proc").ok()?;
    dir.flatten().find_map(|e| {
        let child: u32 = e.file_name().to_str()?.parse().ok()?;
        let p = e.path();
        let stat = std::fs::read_to_string(p.join("stat")).ok()?;
        let ppid: u32 = stat
            .rsplit_once(") ")
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))?
            .parse()
            .ok()?;
        let cmdline = std::fs::read(p.join("cmdline")).ok()?;
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        let attach = args
            .windows(2)
            .any(|w| w == [b"task".as_slice(), b"attach".as_slice()]);
        (ppid == pid && attach).then_some(child)
    })
}

/// The shim config for the pod. The pair state dir is short and outside the
/// temp dir: CRI ids are 64 characters, and `<state_dir>/k8s.io/<id>/pair/
/// notify.sock` must fit a unix socket path (107 bytes), which leaves 18
/// characters for `state_dir` (`/run/shadow`, the default, fits).
fn pair_env(cd: &Containerd, state: &StateDir) -> PairEnv {
    let state_dir = state.0.clone();
    let metrics_dir = cd.dir().join("metrics");
    let config = cd.dir().join("shadow-pair.toml");
    let text = format!(
        "log_level = \"debug\"\n[pair]\nstate_dir = \"{}\"\nmetrics_dir = \"{}\"\ngmsd = \"{}\"\ngms = \"host\"\n",
        state_dir.display(),
        metrics_dir.display(),
        gmsd()
    );
    std::fs::write(&config, text).expect("write shim config");
    PairEnv {
        state_dir,
        metrics_dir,
        config,
    }
}

fn active_of(st: &PairState) -> (usize, u32) {
    let slot = st.pair.active.expect("active slot");
    let pid = st.pid_of(slot).expect("active pid");
    (usize::from(slot), pid)
}

/// A file of the cgroup of `pid` (`rel` "." itself, ".." its parent); `ctrl`
/// names the v1 hierarchy, "" the unified one.
fn cgroup_file(pid: u32, ctrl: &str, rel: &str, file: &str) -> String {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).expect("cgroup file");
    let path = text
        .lines()
        .find_map(|l| {
            let mut f = l.splitn(3, ':').skip(1);
            let (ctrls, path) = (f.next()?, f.next()?);
            (ctrls == ctrl || ctrls.split(',').any(|c| c == ctrl)).then_some(path)
        })
        .unwrap_or_else(|| panic!("no {ctrl:?} line in {text}"));
    let p = Path::new("/sys/fs/cgroup")
        .join(ctrl)
        .join(path.trim_start_matches('/'))
        .join(rel)
        .join(file);
    let body = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    body.trim().to_string()
}

fn task_pid_of(cri: &Cri, id: &str) -> u32 {
    let status = cri.container_status(id).expect("status");
    let info: Value =
        serde_json::from_str(status.info.get("info").expect("verbose info")).expect("info is JSON");
    info["pid"].as_u64().expect("pid") as u32
}

#[test]
fn a_pod_with_runtime_class_shadow_survives_sigkill_of_its_active_engine() {
    let state = StateDir::new();
    let cd = Containerd::builder()
        .cri(true)
        .namespace(K8S_NAMESPACE)
        .config_append(cri_config())
        .start()
        .expect("containerd with CRI");
    let env = pair_env(&cd, &state);
    let cri = Cri::connect(cd.address()).expect("CRI connect");
    let v = cri.version().expect("CRI Version");
    assert_eq!(v.runtime_name, "containerd", "{v:?}");
    for img in import_images(&cd) {
        until(&format!("CRI to see {}", img.name()), LONG, STEP, || {
            cri.image(img.name()).ok().flatten()
        });
    }

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
    // A sidecar the annotation does not name: it must run plain, in the same shim.
    let side_cfg = cri::container(
        "sidecar",
        ENGINE_IMAGE,
        &["/bin/sh", "-c"],
        &["trap 'exit 0' TERM; while :; do sleep 1; done"],
        &[],
    );
    let side = cri
        .create_container(&pod, &side_cfg, &pod_cfg)
        .expect("CreateContainer sidecar");
    cd.record_id(&side);
    cri.start_container(&side).expect("StartContainer sidecar");

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
    assert_eq!(
        cri.container_state(&side).expect("sidecar status"),
        ContainerState::ContainerRunning
    );
    assert!(
        !env.pair_dir(&cd, &side).exists(),
        "the sidecar is not named by shadow.dev/pair and must not be paired"
    );
    // One shim for the whole pod: the sandbox, the engine pair, the sidecar.
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
    let st = until(
        "the killed slot back as a parked shadow",
        LONG,
        STEP,
        || {
            env.state(&cd, &cid)
                .filter(|v| v.pair.protected && v.pair.active.map(usize::from) == Some(1 - slot))
        },
    );
    // Update reaches the pair's cgroup, the engines' parent; stats read it.
    let (_, engine) = active_of(&st);
    let pair_file = |ctrl: &str, file: &str| cgroup_file(engine, ctrl, "..", file);
    let resources = |mib: i64| cri::v1::LinuxContainerResources {
        memory_limit_in_bytes: mib << 20,
        cpu_shares: 512,
        // The kubelet's static CPU manager pins with cpuset.
        cpuset_cpus: "0".into(),
        ..Default::default()
    };
    cri.update_resources(&cid, resources(256))
        .expect("UpdateContainerResources of the pair");
    let v2 = Path::new("/sys/fs/cgroup/cgroup.controllers").exists();
    let (mem, cpu) = if v2 {
        (pair_file("", "memory.max"), pair_file("", "cpu.weight"))
    } else {
        (
            pair_file("memory", "memory.limit_in_bytes"),
            pair_file("cpu", "cpu.shares"),
        )
    };
    assert_eq!(
        (mem.as_str(), cpu.as_str()),
        ("268435456", if v2 { "20" } else { "512" })
    );
    let cpuset = if v2 {
        pair_file("", "cpuset.cpus")
    } else {
        pair_file("cpuset", "cpuset.cpus")
    };
    assert_eq!(cpuset, "0", "the pair is pinned");
    let stats = cri
        .container_stats(&cid)
        .expect("ContainerStats of the pair");
    let working_set = stats.memory.and_then(|m| m.working_set_bytes);
    assert!(working_set.is_some_and(|w| w.value > 0), "{working_set:?}");
    // A plain container's Update is runc's, as with runc-v2.
    let side_pid = task_pid_of(&cri, &side);
    cri.update_resources(&side, resources(128))
        .expect("UpdateContainerResources of the sidecar");
    let file = if v2 {
        "memory.max"
    } else {
        "memory.limit_in_bytes"
    };
    let ctrl = if v2 { "" } else { "memory" };
    assert_eq!(cgroup_file(side_pid, ctrl, ".", file), "134217728");
    assert!(cri.container_stats(&side).is_ok(), "sidecar stats");
    let status = cri.container_status(&cid).expect("status");
    let s = status.status.expect("status");
    assert_eq!(
        ContainerState::try_from(s.state),
        Ok(ContainerState::ContainerRunning),
        "{s:?}"
    );
    assert_eq!(s.exit_code, 0, "no exit reported: {s:?}");
    assert_eq!(shims(&cd).len(), 1, "still one shim");
    assert_eq!(
        cri.container_state(&side).expect("sidecar status"),
        ContainerState::ContainerRunning,
        "the sidecar is untouched by the failover"
    );

    // Tear down the way the kubelet does; nothing may be left.
    cri.stop_container(&cid, Duration::from_secs(10))
        .expect("StopContainer");
    assert_eq!(
        cri.container_state(&cid).expect("status"),
        ContainerState::ContainerExited
    );
    // Both engines were up (the killed slot came back), both got SIGTERM:
    // the test engine's SIGTERM exit, not the earlier SIGKILL's 137.
    let s = cri
        .container_status(&cid)
        .expect("status")
        .status
        .expect("status");
    assert_eq!(s.exit_code, 143, "{s:?}");
    cri.remove_container(&cid).expect("RemoveContainer");
    cri.stop_container(&side, Duration::from_secs(10))
        .expect("StopContainer sidecar");
    cri.remove_container(&side)
        .expect("RemoveContainer sidecar");
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

fn read(rel: &str) -> String {
    let p = config_dir().join(rel);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn toml_file(rel: &str) -> toml::Table {
    read(rel)
        .parse::<toml::Table>()
        .unwrap_or_else(|e| panic!("config/{rel}: {e}"))
}

fn yaml_file(rel: &str) -> serde_yaml::Value {
    serde_yaml::from_str(&read(rel)).unwrap_or_else(|e| panic!("config/{rel}: {e}"))
}

/// Follow a path of table keys; panic naming the file and the missing key.
fn at<'a>(t: &'a toml::Table, file: &str, path: &[&str]) -> &'a toml::Value {
    let mut v: Option<&toml::Value> = None;
    let mut table = t;
    for (i, k) in path.iter().enumerate() {
        let next = table
            .get(*k)
            .unwrap_or_else(|| panic!("config/{file}: no key {}", path[..=i].join(".")));
        if i + 1 < path.len() {
            table = next.as_table().unwrap_or_else(|| {
                panic!("config/{file}: {} is not a table", path[..=i].join("."))
            });
        }
        v = Some(next);
    }
    v.expect("non-empty path")
}

/// The CRI runtime table of a containerd config: runc kept, shadow entry
/// with the runtime type, the annotation pass-through and a ConfigPath.
fn check_containerd_config(file: &str, version: i64, cri_plugin: &str) -> Vec<String> {
    let t = toml_file(file);
    assert_eq!(at(&t, file, &["version"]).as_integer(), Some(version));
    let cd = ["plugins", cri_plugin, "containerd"];
    let runtimes = at(&t, file, &[&cd[..], &["runtimes"]].concat())
        .as_table()
        .expect("runtimes table");
    let default = at(&t, file, &[&cd[..], &["default_runtime_name"]].concat())
        .as_str()
        .expect("string");
    assert!(
        runtimes.contains_key(default),
        "config/{file}: default runtime {default} is not in the runtime table"
    );
    let shadow = ["plugins", cri_plugin, "containerd", "runtimes", "shadow"];
    assert_eq!(
        at(&t, file, &[&shadow[..], &["runtime_type"]].concat()).as_str(),
        Some("io.containerd.shadow.v1"),
        "config/{file}"
    );
    let ann: Vec<&str> = at(&t, file, &[&shadow[..], &["pod_annotations"]].concat())
        .as_array()
        .expect("array")
        .iter()
        .filter_map(toml::Value::as_str)
        .collect();
    assert_eq!(ann, ["shadow.dev/*"], "config/{file}");
    assert_eq!(
        at(
            &t,
            file,
            &[&shadow[..], &["options", "ConfigPath"]].concat()
        )
        .as_str(),
        Some("/etc/containerd/shadow.toml"),
        "config/{file}"
    );
    runtimes.keys().cloned().collect()
}

/// HCL without an HCL parser: balanced braces and brackets outside strings
/// and comments, and quoted strings closed on their line.
fn check_hcl_shape(rel: &str) -> String {
    let text = read(rel);
    let mut depth: Vec<char> = Vec::new();
    // The body of a heredoc (`<<EOF` … `EOF`) is text, not HCL.
    let mut heredoc: Option<String> = None;
    for (n, line) in text.lines().enumerate() {
        if let Some(end) = &heredoc {
            if line.trim() == end {
                heredoc = None;
            }
            continue;
        }
        if let Some((_, tag)) = line.split_once("<<") {
            heredoc = Some(tag.trim_start_matches('-').trim().to_owned());
            continue;
        }
        let mut in_str = false;
        let mut prev = ' ';
        for c in line.chars() {
            if in_str {
                if c == '"' && prev != '\\' {
                    in_str = false;
                }
            } else if c == '#' {
                break;
            } else if c == '"' {
                in_str = true;
            } else if c == '{' || c == '[' {
                depth.push(c);
            } else if c == '}' || c == ']' {
                let open = depth.pop();
                let want = if c == '}' { '{' } else { '[' };
                assert_eq!(open, Some(want), "config/{rel}:{}: unbalanced {c}", n + 1);
            }
            prev = c;
        }
        assert!(!in_str, "config/{rel}:{}: unterminated string", n + 1);
    }
    assert!(heredoc.is_none(), "config/{rel}: unclosed heredoc");
    assert!(depth.is_empty(), "config/{rel}: unclosed {depth:?}");
    text
}

#[test]
fn every_config_file_parses_and_names_the_runtime_as_the_docs_say() {
    // containerd runtime entries (1.6 is also run for real by the pod test).
    let v16 = check_containerd_config("containerd-1.6.toml", 2, "io.containerd.grpc.v1.cri");
    let v2x = check_containerd_config("containerd-2.x.toml", 3, "io.containerd.cri.v1.runtime");
    assert_eq!(v16, v2x, "both versions declare the same runtimes");

    // The shim's own config: TOML with only the sections the shim knows.
    let shim = toml_file("shadow.toml");
    for k in shim.keys() {
        assert!(
            ["log_level", "runc", "pair"].contains(&k.as_str()),
            "config/shadow.toml: unknown top-level key {k}"
        );
    }

    // Kubernetes: the RuntimeClass's handler is the containerd entry's name;
    // the pod uses the class, and its pair annotation names its containers.
    let rc = yaml_file("kubernetes/runtimeclass.yaml");
    assert_eq!(rc["apiVersion"].as_str(), Some("node.k8s.io/v1"));
    assert_eq!(rc["kind"].as_str(), Some("RuntimeClass"));
    let handler = rc["handler"].as_str().expect("handler");
    assert!(
        v16.iter().any(|r| r == handler),
        "handler {handler} not in {v16:?}"
    );
    let pod = yaml_file("kubernetes/pod.yaml");
    assert_eq!(pod["kind"].as_str(), Some("Pod"));
    assert_eq!(
        pod["spec"]["runtimeClassName"].as_str(),
        rc["metadata"]["name"].as_str()
    );
    let names: Vec<&str> = pod["spec"]["containers"]
        .as_sequence()
        .expect("containers")
        .iter()
        .filter_map(|c| c["name"].as_str())
        .collect();
    let annotations = pod["metadata"]["annotations"]
        .as_mapping()
        .expect("annotations");
    let pair = pod["metadata"]["annotations"]["shadow.dev/pair"]
        .as_str()
        .expect("shadow.dev/pair");
    for n in pair.split(',') {
        assert!(
            names.contains(&n.trim()),
            "pair names {n}, not a container of {names:?}"
        );
    }
    for k in annotations.keys().filter_map(|k| k.as_str()) {
        assert!(
            k.starts_with("shadow.dev/"),
            "{k}: pod_annotations passes only shadow.dev/*"
        );
    }

    // The vLLM pod (docs/vllm.md): the class, a pair of one of its
    // containers, every annotation as the shim parses it, the pair's socket
    // on the port that container declares, and a pid namespace per engine
    // (the shim refuses shadow.dev/listen in a shared one).
    let vllm = yaml_file("kubernetes/vllm-pod.yaml");
    assert_eq!(vllm["kind"].as_str(), Some("Pod"));
    assert_eq!(
        vllm["spec"]["runtimeClassName"].as_str(),
        rc["metadata"]["name"].as_str()
    );
    assert_ne!(vllm["spec"]["shareProcessNamespace"].as_bool(), Some(true));
    let annotations: Vec<(String, String)> = vllm["metadata"]["annotations"]
        .as_mapping()
        .expect("vllm-pod annotations")
        .iter()
        .map(|(k, v)| {
            let (k, v) = (k.as_str(), v.as_str());
            assert!(
                k.is_some_and(|k| k.starts_with("shadow.dev/")) && v.is_some(),
                "vllm-pod.yaml: annotation {k:?}={v:?}: only shadow.dev/* strings pass"
            );
            (
                k.unwrap_or_default().to_owned(),
                v.unwrap_or_default().to_owned(),
            )
        })
        .collect();
    let parsed =
        shadow_contract::annotations::Annotations::parse(annotations.iter().map(|(k, v)| (k, v)))
            .unwrap_or_else(|e| panic!("vllm-pod.yaml's annotations, as the shim reads them: {e}"));
    let pair = vllm["metadata"]["annotations"]["shadow.dev/pair"]
        .as_str()
        .expect("vllm-pod shadow.dev/pair");
    let paired = vllm["spec"]["containers"]
        .as_sequence()
        .expect("vllm-pod containers")
        .iter()
        .find(|c| c["name"].as_str() == Some(pair))
        .unwrap_or_else(|| panic!("vllm-pod.yaml: shadow.dev/pair={pair} names no container"));
    let ports: Vec<u64> = paired["ports"]
        .as_sequence()
        .map(|p| {
            p.iter()
                .filter_map(|p| p["containerPort"].as_u64())
                .collect()
        })
        .unwrap_or_default();
    let listen = parsed.listen.expect("vllm-pod.yaml: shadow.dev/listen");
    for l in &listen {
        if let shadow_contract::listen::Listen::Tcp(a) = l {
            assert!(
                ports.contains(&u64::from(a.port())),
                "vllm-pod.yaml: shadow.dev/listen port {} is not a containerPort ({ports:?})",
                a.port()
            );
        }
    }
    assert!(
        paired.get("livenessProbe").is_none(),
        "vllm-pod.yaml: a liveness kill ends both engines (docs/kubernetes.md, section 5)"
    );

    // Nomad: the node-level runtime, and the job shapes.
    let client = check_hcl_shape("nomad/client.hcl");
    assert!(client.contains("plugin \"containerd-driver\""));
    assert!(client.contains("containerd_runtime = \"io.containerd.shadow.v1\""));
    let job = check_hcl_shape("nomad/engine.nomad.hcl");
    assert!(job.contains("driver = \"containerd-driver\""));
    let ctr_job = check_hcl_shape("nomad/engine-ctr.nomad.hcl");
    for want in [
        "io.containerd.shadow.v1",
        "shadow.dev/pair=true",
        "--detach",
        "ctr task attach",
        "driver = \"raw_exec\"",
    ] {
        assert!(ctr_job.contains(want), "engine-ctr.nomad.hcl lacks {want}");
    }

    // Nothing in config/ escapes these checks.
    let mut seen = Vec::new();
    let mut stack = vec![config_dir()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).expect("read config dir").flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if let Some(ext) = p.extension().and_then(|e| e.to_str()) {
                let rel = p
                    .strip_prefix(config_dir())
                    .expect("under config")
                    .display()
                    .to_string();
                match ext {
                    "toml" => drop(toml_file(&rel)),
                    "yaml" | "yml" => drop(yaml_file(&rel)),
                    "hcl" => drop(check_hcl_shape(&rel)),
                    _ => {}
                }
                seen.push(rel);
            }
        }
    }
    assert!(seen.len() >= 8, "config files found: {seen:?}");
}

/// `containerd --config ROOT config dump` of a main config of `version`
/// that imports the runtime entry `file`, as docs/kubernetes.md says to.
fn dump_with_import(version: u32, file: &str) -> std::process::Output {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path().join("config.toml");
    let entry = config_dir().join(file);
    std::fs::write(
        &root,
        format!(
            "version = {version}\nimports = [{:?}]\n",
            entry.display().to_string()
        ),
    )
    .expect("write the main config");
    Command::new("containerd")
        .arg("--config")
        .arg(&root)
        .args(["config", "dump"])
        .output()
        .expect("containerd config dump")
}

/// The runtime entries load as docs/kubernetes.md says, with the
/// containerd on `PATH` (1.6 in CI; 2.x by hand): imported from a main
/// config of each version that containerd takes, the dump names the shadow
/// runtime and its pod annotations; and with containerd 2.3, a version-2
/// main config refuses the version-3 file, as the docs warn.
#[test]
fn the_runtime_entries_load_from_the_main_config_versions_the_docs_name() {
    let Some((major, minor)) = shadow_tests::containerd_version() else {
        panic!("containerd --version unreadable (make deps installs containerd)");
    };
    let mut cases = vec![(2, "containerd-1.6.toml")];
    if major >= 2 {
        cases.extend([(3, "containerd-1.6.toml"), (3, "containerd-2.x.toml")]);
        if minor >= 3 {
            cases.extend([(4, "containerd-1.6.toml"), (4, "containerd-2.x.toml")]);
        } else {
            cases.push((2, "containerd-2.x.toml"));
        }
    }
    for (version, file) in cases {
        let out = dump_with_import(version, file);
        let dump = String::from_utf8_lossy(&out.stdout);
        let runtime = dump
            .split("runtimes.shadow]")
            .nth(1)
            .unwrap_or_default()
            .split("\n\n")
            .next()
            .unwrap_or_default()
            .to_owned();
        assert!(
            out.status.success()
                && runtime.contains("io.containerd.shadow.v1")
                && runtime.contains("shadow.dev/*"),
            "version {version} importing {file}: {}\n{dump}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    if (major, minor) >= (2, 3) {
        let out = dump_with_import(2, "containerd-2.x.toml");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && stderr.contains("higher than root config version 2"),
            "{stderr}"
        );
    }
}
