//! One container spec in, two engine specs out. The engines run the
//! spec's process unchanged on the spec's own rootfs (two runc containers can
//! share one rootfs), plus what the engine contract (docs/engine-contract.md) promises inside every engine: the
//! pair directory with the election lock and the notify socket, the GMS
//! socket directory, and the four `SHADOW_*`/`NOTIFY_SOCKET`/`GMS_*`
//! variables. The pair's resource limits move to a parent cgroup (see
//! `cgroup/`), so each engine keeps only its device rules.
//!
//! The derivation works on the JSON value rather than on typed `oci_spec`
//! structs so that fields this shim does not know survive untouched.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use shadow_contract::{env, paths};
use shadow_pair::SlotId;

use crate::error::{Error, Result};

/// The host side of what one engine gets.
#[derive(Debug, Clone)]
pub struct EngineInputs<'a> {
    pub slot: SlotId,
    /// Absolute rootfs of the original bundle.
    pub rootfs: &'a Path,
    /// The pair's host directory holding the election lock
    /// ([`paths::LOCK_FILE`]) and the slot's notify socket
    /// ([`paths::slot_notify_file`]):
    /// each is bound alone, read-only, at its place in [`paths::PAIR_DIR`].
    pub pair_dir: &'a Path,
    /// The GMS daemons' sockets on the host, when the pair has GMS: each is
    /// bound alone, read-only, under its own name in [`paths::GMS_DIR`].
    pub gms_sockets: &'a [PathBuf],
    /// Pinned network and IPC namespace files, used for namespaces the spec
    /// asks for without a path (no sandbox to share).
    pub pinned: Option<(&'a Path, &'a Path)>,
    /// The pair's cgroup (the spec's `cgroupsPath`): engines go below it.
    pub cgroup_parent: &'a str,
    /// The pair's listening sockets' `LISTEN_FDNAMES` (empty: none).
    pub listen_names: &'a [String],
    /// Unix listening sockets: (host path, path in the container).
    pub listen_mounts: &'a [(PathBuf, PathBuf)],
    /// The watchdog interval (`WATCHDOG_USEC`), if the pair has one.
    pub watchdog: Option<std::time::Duration>,
    /// The pair has an fd store: the slot's fetch socket
    /// ([`paths::slot_fdstore_file`]) is bound at [`paths::FDSTORE_SOCKET`]
    /// and named in `SHADOW_FDSTORE_SOCKET`.
    pub fdstore: bool,
    /// The runtime accepts the connections (`shadow.dev/accept: runtime`):
    /// `SHADOW_ACCEPT=runtime`, and the descriptors under the listening
    /// sockets' names are hand-off sockets.
    pub accept_runtime: bool,
    /// The size of the `/dev/shm` the spec binds from outside (a pod's,
    /// shared), which each engine gets as a tmpfs of its own instead (see
    /// [`shared_shm_bytes`]); None: the source's size is unknown, and the
    /// tmpfs has the kernel's default.
    pub shm_bytes: Option<u64>,
}

/// Where an engine finds POSIX shared memory (`shm_open`, Python's
/// `multiprocessing.shared_memory`, named semaphores).
const SHM_DIR: &str = "/dev/shm";

/// A mount of the spec that puts something from outside the container at
/// `/dev/shm`: a bind (CRI's sandbox `/dev/shm`, a pod's `emptyDir`, the
/// host's), which both engines of the pair would share. A tmpfs there
/// (`ctr`'s default spec) is made anew for each container, and stays.
fn binds_shm(m: &Value) -> bool {
    let at_shm = m
        .get("destination")
        .and_then(Value::as_str)
        .is_some_and(|d| d.trim_end_matches('/') == SHM_DIR);
    let bind = m.get("type").and_then(Value::as_str) == Some("bind")
        || m.get("options").and_then(Value::as_array).is_some_and(|o| {
            o.iter()
                .any(|v| matches!(v.as_str(), Some("bind" | "rbind")))
        });
    at_shm && bind
}

/// The size of the filesystem the spec binds at `/dev/shm`, if it binds
/// one and its source can be measured: the cap of each engine's own tmpfs,
/// so that an engine gets no more shared memory than the pod gave.
pub fn shared_shm_bytes(spec: &Value) -> Option<u64> {
    let mounts = spec.get("mounts").and_then(Value::as_array)?;
    let source = mounts
        .iter()
        .rev()
        .find(|m| binds_shm(m))?
        .get("source")
        .and_then(Value::as_str)?;
    let fs = nix::sys::statvfs::statvfs(source).ok()?;
    Some(fs.blocks().saturating_mul(fs.fragment_size()))
}

/// An engine's own `/dev/shm`: a tmpfs made when runc starts it, gone with
/// its mount namespace when its last process dies.
fn own_shm(bytes: Option<u64>) -> Value {
    let mut options = vec![
        "nosuid".to_string(),
        "noexec".into(),
        "nodev".into(),
        "mode=1777".into(),
    ];
    if let Some(b) = bytes.filter(|b| *b > 0) {
        options.push(format!("size={b}"));
    }
    json!({"destination": SHM_DIR, "type": "tmpfs", "source": "shm", "options": options})
}

/// Whether an engine of this spec has no PID namespace of its own (the
/// host's, or one joined by path), so that the kernel leaves its other
/// processes running when its main process dies: the shim kills them, as
/// it does for a plain container (runc-v2's `ShouldKillAllOnExit`).
pub fn kills_rest_on_exit(spec: &Value) -> bool {
    !shadow_contract::oci::own_pid_namespace(spec)
}

/// The runc container id of a slot's engine.
pub fn engine_id(id: &str, slot: SlotId) -> String {
    format!("{id}-s{slot}")
}

/// The cgroup path of one slot's engine below the pair's cgroup.
pub fn engine_cgroup(parent: &str, slot: SlotId) -> String {
    format!("{}/s{slot}", parent.trim_end_matches('/'))
}

/// The pair's cgroup: the spec's `cgroupsPath`, or one under `/shadow` when
/// the spec has none. systemd-style paths (`slice:prefix:name`) are refused:
/// the parent/child layout here is for cgroupfs paths.
pub fn pair_cgroup(spec: &Value, namespace: &str, id: &str) -> Result<String> {
    match spec.pointer("/linux/cgroupsPath").and_then(Value::as_str) {
        Some(p) if p.contains(':') => Err(Error::InvalidArgument(format!(
            "container {id}: cgroupsPath {p:?} is a systemd cgroup path; engine pairs need a cgroupfs path (SystemdCgroup = false)"
        ))),
        Some(p) if !p.is_empty() => Ok(if p.starts_with('/') {
            p.to_string()
        } else {
            format!("/{p}")
        }),
        _ => Ok(format!("/shadow/{namespace}/{id}")),
    }
}

/// Which namespaces of the spec the pair must pin: those asked for without a
/// path (network and IPC), unless the spec has a user namespace (see
/// [`pins_namespaces`]).
pub fn needs_pinned_namespaces(spec: &Value) -> bool {
    pins_namespaces(spec)
        && namespaces(spec).iter().any(|ns| {
            matches!(
                ns.get("type").and_then(Value::as_str),
                Some("network" | "ipc")
            ) && ns
                .get("path")
                .and_then(Value::as_str)
                .is_none_or(str::is_empty)
        })
}

/// Whether the engines join namespaces the pair pins. Not when the spec has
/// a user namespace: the pins are owned by the shim's (the host's) user
/// namespace, in which the container has no privilege, so runc could not
/// mount `mqueue` (IPC) or `sysfs` (network) in them; each engine then gets
/// the private namespaces the spec asks for, owned by its own user namespace.
pub fn pins_namespaces(spec: &Value) -> bool {
    !namespaces(spec)
        .iter()
        .any(|ns| ns.get("type").and_then(Value::as_str) == Some("user"))
}

/// The network namespace the pair's listening sockets belong in: the
/// spec's (a sandbox's path), the pinned one (`pinned`, for a namespace
/// asked for without a path), or None for a spec without one (the host's).
pub fn network_namespace(spec: &Value, pinned: Option<&Path>) -> Result<Option<PathBuf>> {
    let Some(ns) = namespaces(spec)
        .into_iter()
        .find(|ns| ns.get("type").and_then(Value::as_str) == Some("network"))
    else {
        return Ok(None);
    };
    match ns
        .get("path")
        .and_then(Value::as_str)
        .filter(|p| !p.is_empty())
    {
        Some(p) => Ok(Some(PathBuf::from(p))),
        None => pinned.map(|p| Some(p.to_path_buf())).ok_or_else(|| {
            Error::FailedPrecondition(if pins_namespaces(spec) {
                "a new network namespace without a pinned one".into()
            } else {
                "the pair's listening sockets need a network namespace shared by both engines: with a user namespace in the spec the shim pins none, so name one by path (a sandbox's) or use the host's".into()
            })
        }),
    }
}

/// `LISTEN_PID=1` must be true: each engine is the init of a pid namespace
/// of its own, so the spec must ask for a new one (not join a path).
pub fn check_listen_pid(spec: &Value, id: &str) -> Result<()> {
    let own = namespaces(spec).iter().any(|ns| {
        ns.get("type").and_then(Value::as_str) == Some("pid")
            && ns
                .get("path")
                .and_then(Value::as_str)
                .is_none_or(str::is_empty)
    });
    if own {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "container {id}: {} needs each engine in a pid namespace of its own (the sockets are handed down with LISTEN_PID=1); the spec shares the host's or another container's",
            shadow_contract::annotations::LISTEN
        )))
    }
}

fn namespaces(spec: &Value) -> Vec<Value> {
    spec.pointer("/linux/namespaces")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default()
}

/// The spec's memory limit in bytes (`linux.resources.memory.limit`), when
/// it sets one.
pub fn memory_limit(spec: &Value) -> Option<u64> {
    spec.pointer("/linux/resources/memory/limit")
        .and_then(Value::as_i64)
        .filter(|l| *l > 0)
        .map(|l| l as u64)
}

/// The OOM score the spec gives its process (CRI sets the pod's), else 0.
pub fn oom_score_adj(spec: &Value) -> i32 {
    spec.pointer("/process/oomScoreAdj")
        .and_then(Value::as_i64)
        .map_or(0, |a| a.clamp(-1000, 1000) as i32)
}

/// The absolute rootfs of a bundle's spec.
pub fn rootfs_of(spec: &Value, bundle: &Path) -> PathBuf {
    shadow_contract::oci::rootfs(spec, bundle).unwrap_or_else(|| bundle.join("rootfs"))
}

/// One file (the lock) or socket bound alone and read-only: the engine can
/// take the lock (flock needs no write access) and send to or connect to
/// a socket (the kernel does not check the mount for that), but neither
/// write nor create anything in the host directory it came from, which it
/// never sees.
fn bind_file(source: &Path, destination: String) -> Value {
    json!({
        "destination": destination,
        "type": "bind",
        "source": source.display().to_string(),
        "options": ["bind", "ro", "nosuid", "nodev", "noexec"],
    })
}

/// Whether a mount's destination is one of the contract's places (or
/// below one): the spec's own mounts there give way to ours.
fn in_contract_dirs(destination: &str) -> bool {
    let d = destination.trim_end_matches('/');
    [paths::PAIR_DIR, paths::GMS_DIR]
        .iter()
        .any(|dir| d == *dir || d.strip_prefix(dir).is_some_and(|r| r.starts_with('/')))
}

/// The engine-contract entries of an engine's spec (`SHADOW_ENGINE_ID`,
/// the lock, the notify socket…), kept with its slot when the spec is
/// written, for the execs that run in that engine.
pub fn contract_env(engine: &Value) -> Vec<String> {
    engine
        .pointer("/process/env")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .filter(|kv| env::is_engine_entry(kv))
        .map(str::to_string)
        .collect()
}

/// `env` with the engine's contract entries (`contract_env`) in place of
/// any of the same name: an exec in the active engine sees what the engine
/// itself sees.
pub fn with_contract_env(env: &[String], contract: &[String]) -> Vec<String> {
    env.iter()
        .filter(|kv| !env::is_engine_entry(kv))
        .chain(contract)
        .cloned()
        .collect()
}

/// `engine` (an engine's spec) with its socket-activation entries
/// (`LISTEN_FDS`, `LISTEN_PID`, `LISTEN_FDNAMES`) for descriptors named
/// `names` (none: no entries).
pub fn with_inherited(engine: &Value, names: &[String]) -> Result<Value> {
    let mut out = engine.clone();
    let env = out
        .pointer_mut("/process/env")
        .and_then(Value::as_array_mut)
        .ok_or_else(|| Error::InvalidArgument("engine spec has no process env".into()))?;
    env.retain(|v| {
        v.as_str()
            .and_then(env::name_of)
            .is_none_or(|k| !env::LISTEN.contains(&k))
    });
    if !names.is_empty() {
        env.extend(
            shadow_contract::listen::env_entries(names)
                .into_iter()
                .map(Value::String),
        );
    }
    Ok(out)
}

/// The spec of one engine. Pure: the same inputs give the same spec.
pub fn engine_spec(spec: &Value, e: &EngineInputs<'_>) -> Result<Value> {
    let mut out = spec.clone();
    let obj = out
        .as_object_mut()
        .ok_or_else(|| Error::InvalidArgument("OCI spec is not a JSON object".into()))?;
    obj.insert(
        "root".into(),
        json!({
            "path": e.rootfs.display().to_string(),
            "readonly": spec.pointer("/root/readonly").and_then(Value::as_bool).unwrap_or(false),
        }),
    );

    // Environment: ours replace any same-named entries of the spec.
    let mut ours = vec![
        env::entry(env::ENGINE_ID, e.slot),
        env::entry(env::LOCK_PATH, paths::LOCK_PATH),
        env::entry(env::NOTIFY_SOCKET, paths::NOTIFY_SOCKET),
    ];
    if !e.gms_sockets.is_empty() {
        ours.push(env::entry(env::GMS_SOCKET_DIR, paths::GMS_DIR));
    }
    if e.fdstore {
        ours.push(env::entry(env::FDSTORE_SOCKET, paths::FDSTORE_SOCKET));
    }
    if !e.listen_names.is_empty() {
        ours.extend(shadow_contract::listen::env_entries(e.listen_names));
        if e.accept_runtime {
            ours.push(env::entry(
                env::ACCEPT,
                shadow_contract::handoff::Accept::Runtime.as_str(),
            ));
        }
    }
    if let Some(w) = e.watchdog {
        ours.push(env::entry(env::WATCHDOG_USEC, w.as_micros()));
        // systemd's WATCHDOG_PID: the engine is pid 1 of its own PID
        // namespace. Without one its pid is unknown here, and the variable
        // is left out (a library then takes the watchdog as its own).
        if shadow_contract::oci::own_pid_namespace(spec) {
            ours.push(env::entry(env::WATCHDOG_PID, 1));
        }
    }
    let process = obj
        .get_mut("process")
        .and_then(Value::as_object_mut)
        .ok_or_else(|| Error::InvalidArgument("OCI spec has no process to run".into()))?;
    let keys: Vec<&str> = ours.iter().filter_map(|kv| env::name_of(kv)).collect();
    let mut entries: Vec<Value> = process
        .get("env")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .filter(|v| {
            v.as_str()
                .is_none_or(|s| env::name_of(s).is_none_or(|k| !keys.contains(&k)))
        })
        .collect();
    entries.extend(ours.iter().cloned().map(Value::String));
    process.insert("env".into(), Value::Array(entries));
    // Both engines share the task's output pipes; a pty cannot be shared.
    process.insert("terminal".into(), Value::Bool(false));

    let mounts = obj
        .entry("mounts")
        .or_insert_with(|| Value::Array(Vec::new()));
    let mounts = mounts
        .as_array_mut()
        .ok_or_else(|| Error::InvalidArgument("OCI spec mounts is not a list".into()))?;
    let sockets: Vec<String> = e
        .listen_mounts
        .iter()
        .map(|(_, inside)| inside.display().to_string())
        .collect();
    mounts.retain(|m| {
        let d = m.get("destination").and_then(Value::as_str).unwrap_or("");
        !in_contract_dirs(d) && !sockets.iter().any(|s| s == d)
    });
    // A /dev/shm shared by both engines (a pod's) would carry what a dead
    // engine left there (a SIGKILLed vLLM's `psm_*` and `sem.mp-*` files)
    // to the next one, and pile it up in the pod's memory, failover after
    // failover: each engine gets a fresh one instead (docs/pairs.md).
    for m in mounts.iter_mut().filter(|m| binds_shm(m)) {
        *m = own_shm(e.shm_bytes);
    }
    mounts.push(bind_file(
        &e.pair_dir.join(paths::LOCK_FILE),
        paths::LOCK_PATH.to_string(),
    ));
    mounts.push(bind_file(
        &e.pair_dir.join(paths::slot_notify_file(e.slot)),
        paths::NOTIFY_SOCKET.to_string(),
    ));
    if e.fdstore {
        mounts.push(bind_file(
            &e.pair_dir.join(paths::slot_fdstore_file(e.slot)),
            paths::FDSTORE_SOCKET.to_string(),
        ));
    }
    for socket in e.gms_sockets {
        let name = socket.file_name().and_then(|n| n.to_str()).ok_or_else(|| {
            Error::InvalidArgument(format!("GMS socket {} has no name", socket.display()))
        })?;
        mounts.push(bind_file(socket, format!("{}/{name}", paths::GMS_DIR)));
    }
    for ((host, _), inside) in e.listen_mounts.iter().zip(&sockets) {
        mounts.push(bind_file(host, inside.clone()));
    }

    let linux = obj
        .entry("linux")
        .or_insert_with(|| json!({}))
        .as_object_mut()
        .ok_or_else(|| Error::InvalidArgument("OCI spec linux is not an object".into()))?;
    linux.insert(
        "cgroupsPath".into(),
        Value::String(engine_cgroup(e.cgroup_parent, e.slot)),
    );
    // Limits belong to the pair's cgroup; device rules stay per engine.
    if let Some(res) = linux.get_mut("resources").and_then(Value::as_object_mut) {
        res.retain(|k, _| k == "devices");
    }
    let pinned = e.pinned.filter(|_| pins_namespaces(spec));
    if let (Some(list), Some((net, ipc))) = (
        linux.get_mut("namespaces").and_then(Value::as_array_mut),
        pinned,
    ) {
        for ns in list.iter_mut() {
            let pin = match ns.get("type").and_then(Value::as_str) {
                Some("network") => net,
                Some("ipc") => ipc,
                _ => continue,
            };
            if ns
                .get("path")
                .and_then(Value::as_str)
                .is_none_or(str::is_empty)
            {
                ns["path"] = Value::String(pin.display().to_string());
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> Value {
        json!({
            "ociVersion": "1.0.2",
            "root": {"path": "rootfs", "readonly": false},
            "process": {"args": ["/engine", "--port", "8000"], "cwd": "/",
                        "env": ["PATH=/bin", "SHADOW_ENGINE_ID=7"], "terminal": true},
            "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"}],
            "annotations": {"shadow.dev/pair": "true", "x.io/keep": "1"},
            "linux": {
                "cgroupsPath": "/ns1/c1",
                "resources": {"memory": {"limit": 1048576}, "pids": {"limit": 10},
                              "devices": [{"allow": false, "access": "rwm"}]},
                "namespaces": [{"type": "pid"}, {"type": "network"}, {"type": "ipc"}, {"type": "mount"}],
                "unknownField": {"kept": true}
            }
        })
    }

    static GMS_SOCKETS: std::sync::LazyLock<[PathBuf; 1]> =
        std::sync::LazyLock::new(|| [PathBuf::from("/run/shadow/ns1/c1/gms/gms-host.sock")]);

    fn inputs<'a>(slot: SlotId, pinned: Option<(&'a Path, &'a Path)>) -> EngineInputs<'a> {
        EngineInputs {
            slot,
            rootfs: Path::new("/b/rootfs"),
            pair_dir: Path::new("/run/shadow/ns1/c1/pair"),
            gms_sockets: &*GMS_SOCKETS,
            pinned,
            cgroup_parent: "/ns1/c1",
            listen_names: &[],
            listen_mounts: &[],
            watchdog: None,
            fdstore: false,
            accept_runtime: false,
            shm_bytes: None,
        }
    }

    #[test]
    fn a_shared_dev_shm_becomes_each_engines_own_tmpfs() {
        let mut s = spec();
        s["mounts"] = json!([
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
             "options": ["nosuid", "size=65536k"]},
            {"destination": "/dev/shm/", "type": "bind", "source": "/pods/p1/shm",
             "options": ["rbind", "rw"]},
            {"destination": "/dev/shm", "source": "/host/shm", "options": ["bind"]},
            {"destination": "/data", "type": "bind", "source": "/host/data", "options": ["rbind"]}
        ]);
        let mut i = inputs(SlotId::ONE, None);
        i.shm_bytes = Some(1 << 30);
        let e = engine_spec(&s, &i).unwrap();
        let mounts = e["mounts"].as_array().unwrap();
        let own = json!({"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
                         "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=1073741824"]});
        // ctr's own tmpfs stays; both binds give way; other binds stay.
        assert_eq!(mounts[0], s["mounts"][0]);
        assert_eq!(mounts[1], own);
        assert_eq!(mounts[2], own);
        assert_eq!(mounts[3], s["mounts"][3]);
        i.shm_bytes = None;
        let e = engine_spec(&s, &i).unwrap();
        let opts = e["mounts"][1]["options"].as_array().unwrap();
        assert!(!opts
            .iter()
            .any(|o| o.as_str().unwrap().starts_with("size=")));
    }

    #[test]
    fn the_shared_dev_shm_is_measured_from_its_source() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = spec();
        assert_eq!(shared_shm_bytes(&s), None, "no /dev/shm bind");
        s["mounts"] = json!([{"destination": "/dev/shm", "type": "bind",
                              "source": dir.path().display().to_string(), "options": ["rbind"]}]);
        let fs = nix::sys::statvfs::statvfs(dir.path()).unwrap();
        let want = fs.blocks() * fs.fragment_size();
        assert_eq!(shared_shm_bytes(&s), Some(want));
        s["mounts"][0]["source"] = json!("/nonexistent/shm");
        assert_eq!(shared_shm_bytes(&s), None);
    }

    fn env_of(e: &Value) -> Vec<&str> {
        e["process"]["env"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(Value::as_str)
            .collect()
    }

    #[test]
    fn a_watchdog_gives_systemds_variables() {
        let mut i = inputs(SlotId::ZERO, None);
        i.watchdog = Some(std::time::Duration::from_millis(100));
        let mut s = spec();
        s["process"]["env"] = json!(["WATCHDOG_USEC=5", "PATH=/bin"]);
        let e = engine_spec(&s, &i).unwrap();
        let env = env_of(&e);
        assert!(env.contains(&"WATCHDOG_USEC=100000"), "{env:?}");
        assert!(env.contains(&"WATCHDOG_PID=1"), "{env:?}");
        assert!(!env.contains(&"WATCHDOG_USEC=5"), "ours replace the spec's");
        // Sharing the host's PID namespace, the engine is not pid 1.
        s["linux"]["namespaces"] = json!([{"type": "network"}, {"type": "mount"}]);
        let env = env_of(&engine_spec(&s, &i).unwrap()).join(" ");
        assert!(
            env.contains("WATCHDOG_USEC=100000") && !env.contains("WATCHDOG_PID"),
            "{env}"
        );
        // No watchdog, no variables.
        let env = env_of(&engine_spec(&spec(), &inputs(SlotId::ZERO, None)).unwrap()).join(" ");
        assert!(!env.contains("WATCHDOG"), "{env}");
    }

    #[test]
    fn engine_gets_env_mounts_cgroup_and_shared_rootfs() {
        let s = spec();
        let e = engine_spec(&s, &inputs(SlotId::ONE, None)).unwrap();
        assert_eq!(e["root"]["path"], "/b/rootfs");
        assert_eq!(e["process"]["args"], s["process"]["args"]);
        assert_eq!(e["process"]["terminal"], false);
        let env: Vec<&str> = e["process"]["env"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        assert_eq!(
            env,
            [
                "PATH=/bin",
                "SHADOW_ENGINE_ID=1",
                "SHADOW_LOCK_PATH=/run/shadow/pair/engine.lock",
                "NOTIFY_SOCKET=/run/shadow/pair/notify.sock",
                "GMS_SOCKET_DIR=/run/shadow/gms"
            ]
        );
        let dests: Vec<&str> = e["mounts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["destination"].as_str().unwrap())
            .collect();
        assert_eq!(
            dests,
            [
                "/proc",
                "/run/shadow/pair/engine.lock",
                "/run/shadow/pair/notify.sock",
                "/run/shadow/gms/gms-host.sock"
            ]
        );
        assert_eq!(
            e["mounts"][1]["source"],
            "/run/shadow/ns1/c1/pair/engine.lock"
        );
        assert_eq!(
            e["mounts"][3]["source"],
            "/run/shadow/ns1/c1/gms/gms-host.sock"
        );
        // Slot 1's own notify socket, at the contract's one place.
        assert_eq!(
            e["mounts"][2]["source"],
            "/run/shadow/ns1/c1/pair/notify1.sock"
        );
        // Each alone and read-only: nothing of the host directories is
        // writable from the engine.
        for m in &e["mounts"].as_array().unwrap()[1..] {
            assert_eq!(
                m["options"],
                json!(["bind", "ro", "nosuid", "nodev", "noexec"])
            );
        }
        assert_eq!(e["linux"]["cgroupsPath"], "/ns1/c1/s1");
        assert_eq!(
            e["linux"]["resources"],
            json!({"devices": [{"allow": false, "access": "rwm"}]})
        );
        assert_eq!(e["linux"]["unknownField"], json!({"kept": true}));
        assert_eq!(e["annotations"], s["annotations"]);
        // Without pins, namespaces are left as the spec has them.
        assert_eq!(e["linux"]["namespaces"], s["linux"]["namespaces"]);
    }

    #[test]
    fn pinned_namespaces_fill_only_pathless_net_and_ipc() {
        let mut s = spec();
        s["linux"]["namespaces"][2]["path"] = "/proc/1/ns/ipc".into();
        let pins = (Path::new("/p/ns/net"), Path::new("/p/ns/ipc"));
        let e = engine_spec(&s, &inputs(SlotId::ZERO, Some(pins))).unwrap();
        assert_eq!(
            e["linux"]["namespaces"],
            json!([{"type": "pid"}, {"type": "network", "path": "/p/ns/net"},
                   {"type": "ipc", "path": "/proc/1/ns/ipc"}, {"type": "mount"}])
        );
        assert!(needs_pinned_namespaces(&s));
        let mut sandboxed = s.clone();
        sandboxed["linux"]["namespaces"][1]["path"] = "/var/run/netns/x".into();
        assert!(!needs_pinned_namespaces(&sandboxed));
        sandboxed["linux"]["namespaces"] = json!([{"type": "pid"}]);
        assert!(!needs_pinned_namespaces(&sandboxed), "host network");
    }

    #[test]
    fn with_a_user_namespace_nothing_is_pinned() {
        let mut s = spec();
        s["linux"]["namespaces"]
            .as_array_mut()
            .unwrap()
            .push(json!({"type": "user"}));
        assert!(!needs_pinned_namespaces(&s));
        let pins = (Path::new("/p/ns/net"), Path::new("/p/ns/ipc"));
        let e = engine_spec(&s, &inputs(SlotId::ZERO, Some(pins))).unwrap();
        assert_eq!(e["linux"]["namespaces"], s["linux"]["namespaces"]);
        let err = network_namespace(&s, None).unwrap_err().to_string();
        assert!(err.contains("user namespace"), "{err}");
    }

    #[test]
    fn gms_off_means_no_gms_mount_or_variable() {
        let mut i = inputs(SlotId::ZERO, None);
        i.gms_sockets = &[];
        let e = engine_spec(&spec(), &i).unwrap();
        let text = e.to_string();
        assert!(!text.contains("GMS_SOCKET_DIR") && !text.contains("/run/shadow/gms"));
        assert!(text.contains("SHADOW_ENGINE_ID=0"));
    }

    #[test]
    fn listening_sockets_give_the_socket_env_and_mounts() {
        let names = ["tcp-8000".to_string(), "unix-e.sock".to_string()];
        let mounts = [(
            PathBuf::from("/run/shadow/ns1/c1/listen/1.sock"),
            PathBuf::from("/run/e.sock"),
        )];
        let mut i = inputs(SlotId::ZERO, None);
        i.listen_names = &names;
        i.listen_mounts = &mounts;
        let mut s = spec();
        s["process"]["env"] = json!(["LISTEN_FDS=9", "PATH=/bin"]);
        s["mounts"] = json!([{"destination": "/run/e.sock", "type": "bind", "source": "/x"}]);
        let e = engine_spec(&s, &i).unwrap();
        let env: Vec<&str> = e["process"]["env"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(Value::as_str)
            .filter(|v| v.starts_with("LISTEN_"))
            .collect();
        assert_eq!(
            env,
            [
                "LISTEN_FDS=2",
                "LISTEN_PID=1",
                "LISTEN_FDNAMES=tcp-8000:unix-e.sock"
            ]
        );
        let sock: Vec<&Value> = e["mounts"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| m["destination"] == "/run/e.sock")
            .collect();
        assert_eq!(sock.len(), 1);
        assert_eq!(sock[0]["source"], "/run/shadow/ns1/c1/listen/1.sock");
        // Without sockets: no variables.
        let e = engine_spec(&spec(), &inputs(SlotId::ZERO, None)).unwrap();
        assert!(!e.to_string().contains("LISTEN_FDS"));
    }

    #[test]
    fn listening_needs_an_own_pid_namespace_and_finds_the_network_one() {
        let s = spec();
        assert!(check_listen_pid(&s, "c1").is_ok());
        let mut shared = spec();
        shared["linux"]["namespaces"][0]["path"] = "/proc/7/ns/pid".into();
        let e = check_listen_pid(&shared, "c1").unwrap_err().to_string();
        assert!(e.contains("LISTEN_PID=1"), "{e}");
        let mut host = spec();
        host["linux"]["namespaces"] = json!([{"type": "network"}]);
        assert!(check_listen_pid(&host, "c1").is_err());

        let pin = Path::new("/p/ns/net");
        assert_eq!(
            network_namespace(&s, Some(pin)).unwrap().as_deref(),
            Some(pin)
        );
        let mut sandboxed = spec();
        sandboxed["linux"]["namespaces"][1]["path"] = "/var/run/netns/cni-1".into();
        assert_eq!(
            network_namespace(&sandboxed, None).unwrap(),
            Some(PathBuf::from("/var/run/netns/cni-1"))
        );
        assert_eq!(network_namespace(&host_net(), None).unwrap(), None);
    }

    fn host_net() -> Value {
        json!({"linux": {"namespaces": [{"type": "pid"}]}})
    }

    #[test]
    fn cgroup_paths_and_ids() {
        assert_eq!(pair_cgroup(&spec(), "ns1", "c1").unwrap(), "/ns1/c1");
        assert_eq!(
            pair_cgroup(&json!({}), "ns1", "c1").unwrap(),
            "/shadow/ns1/c1"
        );
        let systemd = json!({"linux": {"cgroupsPath": "system.slice:cri:c1"}});
        let e = pair_cgroup(&systemd, "ns1", "c1").unwrap_err().to_string();
        assert!(e.contains("systemd"), "{e}");
        assert_eq!(engine_id("c1", SlotId::ONE), "c1-s1");
        assert_eq!(engine_cgroup("/ns1/c1/", SlotId::ZERO), "/ns1/c1/s0");
    }

    #[test]
    fn the_specs_own_mounts_at_the_contract_places_give_way() {
        let mut s = spec();
        s["mounts"] = json!([
            {"destination": "/run/shadow/pair", "type": "bind", "source": "/tmp/x"},
            {"destination": "/run/shadow/gms/", "type": "bind", "source": "/tmp/y"},
            {"destination": "/run/shadow/pair/engine.lock", "type": "bind", "source": "/tmp/z"},
            {"destination": "/run/shadow/pairs", "type": "bind", "source": "/tmp/kept"}
        ]);
        let e = engine_spec(&s, &inputs(SlotId::ZERO, None)).unwrap();
        let sources: Vec<&str> = e["mounts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["source"].as_str().unwrap())
            .collect();
        assert_eq!(
            sources,
            [
                "/tmp/kept",
                "/run/shadow/ns1/c1/pair/engine.lock",
                "/run/shadow/ns1/c1/pair/notify0.sock",
                "/run/shadow/ns1/c1/gms/gms-host.sock"
            ]
        );
    }

    #[test]
    fn exec_env_gets_the_engines_contract_variables() {
        let engine: Value = serde_json::from_str(
            r#"{"process": {"env": ["PATH=/bin", "SHADOW_ENGINE_ID=1", "SHADOW_LOCK_PATH=/run/shadow/pair/engine.lock", "NOTIFY_SOCKET=/run/shadow/pair/notify.sock"]}}"#,
        )
        .unwrap();
        let contract = contract_env(&engine);
        let env = with_contract_env(
            &[
                "PATH=/usr/bin".into(),
                "SHADOW_ENGINE_ID=9".into(),
                "SHADOW_ENGINE_IDX=x".into(),
            ],
            &contract,
        );
        assert_eq!(
            env,
            [
                "PATH=/usr/bin",
                "SHADOW_ENGINE_IDX=x",
                "SHADOW_ENGINE_ID=1",
                "SHADOW_LOCK_PATH=/run/shadow/pair/engine.lock",
                "NOTIFY_SOCKET=/run/shadow/pair/notify.sock"
            ]
        );
        assert!(contract_env(&serde_json::json!({})).is_empty());
    }

    #[test]
    fn memory_limit_and_oom_score_of_the_spec() {
        assert_eq!(memory_limit(&spec()), Some(1048576));
        assert_eq!(
            memory_limit(&json!({"linux": {"resources": {"memory": {"limit": -1}}}})),
            None
        );
        assert_eq!(oom_score_adj(&spec()), 0);
        assert_eq!(
            oom_score_adj(&json!({"process": {"oomScoreAdj": 999}})),
            999
        );
    }
}

#[cfg(test)]
mod kill_rest_tests {
    use super::*;

    #[test]
    fn only_engines_with_their_own_pid_namespace_leave_killing_to_the_kernel() {
        let with = |nss: &str| -> Value {
            serde_json::from_str(&format!(r#"{{"linux":{{"namespaces":{nss}}}}}"#)).unwrap()
        };
        assert!(!kills_rest_on_exit(&with(
            r#"[{"type":"mount"},{"type":"pid"}]"#
        )));
        assert!(!kills_rest_on_exit(&with(r#"[{"type":"pid","path":""}]"#)));
        assert!(kills_rest_on_exit(&with(r#"[{"type":"mount"}]"#)));
        assert!(kills_rest_on_exit(&with(
            r#"[{"type":"pid","path":"/proc/1/ns/pid"}]"#
        )));
        assert!(kills_rest_on_exit(&serde_json::json!({})));
    }
}
