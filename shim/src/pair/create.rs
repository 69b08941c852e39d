//! Create of a pair, step by step, each step recorded in [`Made`] so that a
//! failure at any point undoes exactly what was done: the pair directory,
//! the rootfs mounts, the pinned namespaces, the pair cgroup, gmsd, the
//! engine bundles and the output pipes. The last step hands all of it to
//! the pair's supervisor, which creates the first engine and owns the pair
//! from then on.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use containerd_shim_protos::events::task::TaskOOM;
use serde_json::Value;
use shadow_pair::SlotId;
use tokio::net::unix::pipe;
use tokio::task::JoinHandle;

use super::cgroup::PairCgroup;
use super::config::GmsMode;
use super::dirs::{PairDirs, CUDA_SOCKETS, HOST_SOCKETS};
use super::engine::{EngineSlot, SharedOutput};
use super::fdstore::FdStore;
use super::fetch::FetchSocket;
use super::gms::{GmsDaemons, InPod};
use super::gpus::{self, Gpu};
use super::host::Machine;
use super::keeper::Keeper;
use super::keeping::Keeping;
use super::leftovers::{self, PairName};
use super::listen::{ListenSockets, Site};
use super::made::Made;
use super::netns::PinnedNamespaces;
use super::notify::NotifySocket;
use super::owner;
use super::passing::StartFds;
use super::probe::{self, Prober};
use super::supervisor::{Handle, Hang, PairProbe, Parts, Supervisor};
use super::{lock, spec};
use crate::annotations::GmsBackend;
use crate::error::{Error, Result};
use crate::events::Event;
use crate::runc::RuncClient;
use crate::runtime::Runtime;
use crate::status::Stdio;
use containerd_shim_protos::api::Mount;

/// The parts of a Create request a pair needs.
pub struct PairRequest {
    pub id: String,
    pub bundle: String,
    pub rootfs: Vec<Mount>,
    pub stdio: Stdio,
    pub gms: Option<GmsBackend>,
    /// One engine and no shadow (`shadow.dev/shadow=false`).
    pub single: bool,
    /// `shadow.dev/shadows` (else the config's `pair.shadows`).
    pub shadows: Option<u8>,
    /// `shadow.dev/fdstore-max` (else the config's `pair.fdstore_max`).
    pub fdstore_max: Option<u32>,
    /// `shadow.dev/accept` (else the config's `pair.accept`).
    pub accept: Option<shadow_contract::handoff::Accept>,
    /// `shadow.dev/listen`: the sockets the pair owns (else the config's).
    pub listen: Option<Vec<shadow_contract::listen::Listen>>,
    /// The hang-detection annotations (the watchdog else the config's).
    pub hang: shadow_contract::hang::HangSettings,
    /// runc settings from the task's options, for both engines.
    pub runc: crate::options::RuncOptions,
    /// The bundle's spec as read at Create (`BundleSpec::raw`).
    pub spec: Value,
}

fn mkdir(p: &Path, mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(p).map_err(|e| Error::io(format!("creating {}", p.display()), e))?;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode))
        .map_err(|e| Error::io(format!("chmod {}", p.display()), e))
}

/// Open the task's output FIFO and return the pipe's write end and the
/// copier that drains the pipe into the FIFO.
fn output_pipe(fifo: &str) -> Result<(Option<std::os::fd::OwnedFd>, Option<JoinHandle<()>>)> {
    if fifo.is_empty() {
        return Ok((None, None));
    }
    let mut to = pipe::OpenOptions::new()
        .read_write(true)
        .open_sender(fifo)
        .map_err(|e| Error::io(format!("opening output FIFO {fifo}"), e))?;
    let (tx, mut rx) = pipe::pipe().map_err(|e| Error::io("creating output pipe", e))?;
    let tx = tx
        .into_blocking_fd()
        .map_err(|e| Error::io("output pipe", e))?;
    let copier = tokio::spawn(async move {
        let _ = tokio::io::copy(&mut rx, &mut to).await;
    });
    Ok((Some(tx), Some(copier)))
}

/// The pair's GMS backend and its GPUs. The GPUs are those the spec's
/// `linux.devices` grants (`gpus.rs`), never those its environment names;
/// the backend is the annotation's, else the config's mode (`auto`: cuda
/// when the devices grant a GPU), except that a node whose config says
/// `gms = "off"` runs no gmsd whatever a pod asks for. `gms=cuda` without a granted GPU is
/// refused: there is no GPU of the pod's to allocate on.
fn gms_plan(
    cfg: &super::config::PairConfig,
    req: &PairRequest,
    spec: &Value,
) -> Result<(GmsBackend, Vec<Gpu>)> {
    let minors = gpus::granted_minors(spec);
    let backend = gms_backend(req.gms, cfg.gms, !minors.is_empty());
    if req.gms.is_some_and(|b| b != backend) {
        log::warn!(
            "pair {}: annotation asks for GMS {:?}; the node's config says gms = \"off\"",
            req.id,
            req.gms
        );
    }
    if backend == GmsBackend::Cuda && minors.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "container {}: {}=cuda, but the spec grants no NVIDIA GPU (no /dev/nvidiaN of major {} in linux.devices); \
             a pair's GPUs are the devices its runtime grants (device plugin, CDI), never NVIDIA_VISIBLE_DEVICES",
            req.id,
            shadow_contract::annotations::GMS,
            gpus::NVIDIA_MAJOR
        )));
    }
    let gpus = match gpus::resolve(&cfg.nvidia_gpus_dir, &minors) {
        Ok(g) => g,
        Err(e) if backend == GmsBackend::Cuda => {
            return Err(Error::FailedPrecondition(format!(
                "container {}: {e} (config pair.nvidia_gpus_dir)",
                req.id
            )))
        }
        Err(e) => {
            // No GMS on the GPUs: only their XIDs go unwatched.
            log::warn!("pair {}: {e}: XIDs of its GPUs are not watched", req.id);
            Vec::new()
        }
    };
    Ok((backend, gpus))
}

/// The pair's GMS backend: the annotation, else the config's mode (`auto`:
/// cuda when the spec has NVIDIA GPUs, else host). A node whose config says
/// `gms = "off"` runs no gmsd whatever a pod asks for.
fn gms_backend(annotation: Option<GmsBackend>, mode: GmsMode, gpus: bool) -> GmsBackend {
    match (annotation, mode) {
        (_, GmsMode::Off) => GmsBackend::Off,
        (Some(b), _) => b,
        (None, GmsMode::Host) => GmsBackend::Host,
        (None, GmsMode::Auto) if gpus => GmsBackend::Cuda,
        (None, GmsMode::Auto) => GmsBackend::Host,
    }
}

/// How many engine slots a pair of `req` has: `N + 1` for N shadows
/// (`shadow.dev/shadows`, else `pair.shadows`); two for a single engine
/// (the second never started, as the pure pair keeps it).
fn slot_count(cfg: &super::config::PairConfig, req: &PairRequest) -> Result<usize> {
    match (req.single, req.shadows) {
        (true, Some(n)) => Err(Error::InvalidArgument(format!(
            "container {}: {}=false (no shadow) and {}={n} contradict each other",
            req.id,
            shadow_contract::annotations::SHADOW,
            shadow_contract::annotations::SHADOWS
        ))),
        (true, None) => Ok(2),
        (false, n) => Ok(usize::from(n.unwrap_or(cfg.shadows)) + 1),
    }
}

/// Create of a pair: its engines (for execs) and its running supervisor.
pub(super) async fn create(rt: &Runtime, req: &PairRequest) -> Result<(Arc<[EngineSlot]>, Handle)> {
    let mut made = Made::default();
    match create_steps(rt, req, &mut made).await {
        Ok((engines, mut parts)) => {
            parts.made = made;
            let handle = Supervisor::launch(parts).await?;
            Ok((engines, handle))
        }
        Err(e) => {
            made.undo().await;
            Err(e)
        }
    }
}

/// Everything Create makes for a pair before its supervisor takes over, in
/// order; what was made so far is recorded in `made`, which the caller
/// undoes on an error.
async fn create_steps(
    rt: &Runtime,
    req: &PairRequest,
    made: &mut Made,
) -> Result<(Arc<[EngineSlot]>, Parts)> {
    let cfg = &rt.config.pair;
    let count = slot_count(cfg, req)?;
    let slot_ids: Vec<SlotId> = SlotId::first(count).collect();
    let bundle = PathBuf::from(&req.bundle);
    if req.stdio.terminal {
        return Err(Error::InvalidArgument(format!(
                "container {}: a paired container cannot have a terminal (both engines share the task's output)",
                req.id
            )));
    }
    let spec = &req.spec;
    let cgroup_path = spec::pair_cgroup(spec, &rt.namespace, &req.id)?;
    let (backend, gpus) = gms_plan(cfg, req, spec)?;

    // A GPU pair's gmsd socket carries the GPU's UUID: leave room for it.
    let longest_socket = if gpus.is_empty() {
        HOST_SOCKETS
    } else {
        CUDA_SOCKETS
    };
    let key = shadow_contract::host::containerd_key(&rt.containerd);
    let dirs = PairDirs::new(&cfg.state_dir, &key, &rt.namespace, &req.id, longest_socket);
    dirs.fits(longest_socket)
        .map_err(|e| Error::InvalidArgument(format!("container {}: {e}", req.id)))?;
    let name = PairName {
        config: &rt.config,
        containerd: &rt.containerd,
        namespace: &rt.namespace,
        id: &req.id,
    };
    if dirs.root.exists() || name.metrics_file().exists() {
        // containerd creates an id only once at a time: what is there
        // is a dead shim's, which containerd could not clean up.
        log::warn!(
            "pair {}: {} is left from an earlier pair of this id whose shim died: removing it",
            req.id,
            dirs.root.display()
        );
        leftovers::remove(&name, &bundle, rt.router.clone(), &req.runc).await;
    }
    made.dirs = Some(dirs.clone());
    // Root's alone: engines get the lock and the sockets bound one by
    // one (spec.rs), never a directory of the host to write in.
    mkdir(&dirs.root, 0o711)?;
    mkdir(&dirs.pair, 0o700)?;
    // For a cleanup after this shim's death (the spec may be gone).
    std::fs::write(&dirs.cgroup_record, &cgroup_path)
        .map_err(|e| Error::io(format!("writing {}", dirs.cgroup_record.display()), e))?;
    for s in &dirs.slots[..count] {
        mkdir(s, 0o700)?;
    }

    if !req.rootfs.is_empty() {
        let target = bundle.join("rootfs");
        made.mounted_rootfs = Some(target.clone());
        crate::mount::mount_all(&req.rootfs, &target).await?;
    }
    let rootfs = spec::rootfs_of(spec, &bundle);
    if !rootfs.is_dir() {
        return Err(Error::InvalidArgument(format!(
            "container {}: rootfs {} does not exist",
            req.id,
            rootfs.display()
        )));
    }

    let lock_file = lock::create_lock_file(&dirs.pair.join(shadow_contract::paths::LOCK_FILE))?;
    // One notify socket per slot: each engine its own kernel queue. With
    // an fd store, descriptors may be sent on them, and each slot has a
    // fetch socket too.
    let fdstore_max = req.fdstore_max.unwrap_or(cfg.fdstore_max) as usize;
    // Read on the connection thread (`owner.rs`), so registered with its
    // reactor: what an engine stores right before it dies is in the store
    // without waiting for the supervisor's thread, which is busiest then.
    let conns = owner::handle()?;
    let on_conns = conns.enter();
    let notify = slot_ids
        .iter()
        .map(|s| {
            NotifySocket::bind(
                &dirs.pair.join(shadow_contract::paths::slot_notify_file(s)),
                fdstore_max > 0,
            )
        })
        .collect::<Result<Vec<_>>>()?;
    drop(on_conns);
    let fdstore = if fdstore_max > 0 {
        let fetch = slot_ids
            .iter()
            .map(|s| {
                FetchSocket::bind(&dirs.pair.join(shadow_contract::paths::slot_fdstore_file(s)))
            })
            .collect::<Result<Vec<_>>>()?;
        Some((FdStore::new(fdstore_max)?, fetch))
    } else {
        None
    };

    let pins = if spec::needs_pinned_namespaces(spec) {
        let p = PinnedNamespaces::pin(&dirs.ns)?;
        made.pins = Some(p);
        made.pins.as_ref()
    } else {
        None
    };

    // Before gmsd and the cgroup: a socket that cannot be made (port in
    // use, privileged) is the user's error, found cheaply.
    let listen = match (&req.listen, cfg.listen.as_str()) {
        (Some(list), _) => Some(list.clone()),
        (None, "") => None,
        (None, value) => Some(shadow_contract::listen::parse(value)?),
    };
    let listen = match listen {
        Some(list) => {
            spec::check_listen_pid(spec, &req.id)?;
            let netns = spec::network_namespace(spec, pins.map(|p| p.net.as_path()))?;
            Some(ListenSockets::open(
                &list,
                &Site {
                    netns: netns.as_deref(),
                    dir: &dirs.root.join("listen"),
                    may_bind_privileged: super::listen::may_bind_privileged(spec),
                },
            )?)
        }
        None => None,
    };
    let accept = accept_for(
        req.accept,
        &cfg.accept,
        listen.is_some() && fdstore.is_some(),
    )?;
    let accept_runtime = accept == shadow_contract::handoff::Accept::Runtime;
    if accept_runtime && (listen.is_none() || fdstore.is_none()) {
        return Err(Error::InvalidArgument(format!(
            "container {}: {}=runtime needs the pair's listening sockets ({}) and its fd store ({} not 0): the shim accepts on the first and keeps each connection in the second",
            req.id,
            shadow_contract::annotations::ACCEPT,
            shadow_contract::annotations::LISTEN,
            shadow_contract::annotations::FDSTORE_MAX,
        )));
    }

    // The probe runs from the pair's network namespace (the sandbox's, or
    // the pinned one), opened now: nothing is opened by path later.
    let probe = match &req.hang.probe {
        Some(p) => {
            let ns = spec::network_namespace(spec, pins.map(|p| p.net.as_path())).map_err(|_| {
                Error::FailedPrecondition(format!(
                    "container {}: {} probes from the network namespace both engines share; with a user namespace in the spec the shim pins none, so name one by path (a sandbox's) or use the host's",
                    req.id,
                    shadow_contract::annotations::PROBE
                ))
            })?;
            let fd = ns.as_deref().map(probe::open_netns).transpose()?;
            Some(PairProbe {
                prober: Prober::start(&req.id, fd, p.target.clone())?,
                settings: p.clone(),
            })
        }
        None => None,
    };
    let watchdog = req.hang.watchdog.or_else(|| cfg.watchdog());

    made.cgroup = Some(PairCgroup::create(
        &cgroup_path,
        spec.pointer("/linux/resources"),
    )?);
    if let Some(cg) = &made.cgroup {
        // As runc-v2 does for a container: every OOM in the pair (an
        // engine's victim, whichever slot) is the task's `/tasks/oom`.
        let events = rt.events.clone();
        let id = req.id.clone();
        match cg.watch_oom(move || {
            events.send(Event::Oom(TaskOOM {
                container_id: id.clone(),
                ..Default::default()
            }))
        }) {
            Ok(w) => made.oom = w,
            Err(e) => log::warn!("pair {}: no OOM events: {e}", req.id),
        }
    }

    if backend != GmsBackend::Off {
        // One daemon per GPU the devices grant, or one `host` daemon.
        let devices: Vec<String> = match backend {
            GmsBackend::Cuda if cfg.gms_gpus_on_host => {
                gpus.iter().map(|g| format!("host:{}", g.uuid)).collect()
            }
            GmsBackend::Cuda => gpus.iter().map(|g| g.uuid.clone()).collect(),
            _ => vec!["host".into()],
        };
        mkdir(&dirs.gms, 0o700)?;
        let leaf = match made.cgroup.as_ref() {
            Some(c) => c.gms_leaf()?,
            None => Vec::new(),
        };
        // Host memory is the pod's memory: gmsd may hold no more than
        // the pod's limit. GPU memory is not, so CUDA keeps gmsd's own.
        let pod = InPod {
            cgroup: leaf,
            oom_score_adj: spec::oom_score_adj(spec),
            max_bytes: match backend {
                GmsBackend::Host => spec::memory_limit(spec).unwrap_or(0),
                _ => 0,
            },
            lock: Some(dirs.pair.join(shadow_contract::paths::LOCK_FILE)),
        };
        made.gms = Some(GmsDaemons::start(cfg, &dirs.gms, devices, &pod).await?);
    }
    let gms_sockets = made
        .gms
        .as_ref()
        .map(GmsDaemons::sockets)
        .unwrap_or_default();

    let shm_bytes = spec::shared_shm_bytes(spec);
    let mut engines = Vec::new();
    for &slot in &slot_ids {
        let inputs = spec::EngineInputs {
            slot,
            rootfs: &rootfs,
            pair_dir: &dirs.pair,
            gms_sockets: &gms_sockets,
            pinned: pins.map(|p| (p.net.as_path(), p.ipc.as_path())),
            cgroup_parent: &cgroup_path,
            listen_names: listen.as_ref().map_or(&[], |l| l.names()),
            listen_mounts: listen.as_ref().map_or(&[], |l| l.mounts()),
            watchdog,
            fdstore: fdstore.is_some(),
            accept_runtime,
            shm_bytes,
        };
        let engine = spec::engine_spec(spec, &inputs)?;
        let dir = &dirs.slots[slot.index()];
        let bytes = serde_json::to_vec(&engine).map_err(|e| Error::Internal {
            what: format!("engine spec for {}", dir.display()),
            reason: e.to_string(),
        })?;
        std::fs::write(dir.join("config.json"), bytes)
            .map_err(|e| Error::io(format!("writing engine bundle {}", dir.display()), e))?;
        engines.push(EngineSlot {
            runc_id: spec::engine_id(&req.id, slot),
            bundle: dir.clone(),
            client: RuncClient::new(&rt.config, &rt.namespace, dir, rt.router.clone(), &req.runc)?,
            cgroup: spec::engine_cgroup(&cgroup_path, slot),
            kills_rest_on_exit: spec::kills_rest_on_exit(&engine),
            contract_env: spec::contract_env(&engine),
        });
    }
    let engines: Arc<[EngineSlot]> = engines.into();

    let (out, out_copier) = output_pipe(&req.stdio.stdout)?;
    let (err, err_copier) = output_pipe(&req.stdio.stderr)?;
    let metrics_file = name.metrics_file();
    made.metrics_file = Some(metrics_file.clone());
    let stdin = if req.stdio.stdin.is_empty() {
        None
    } else {
        let (end, io) = crate::io::ProcessIo::stdin_pipe(&req.stdio.stdin)?;
        made.stdin = Some(io);
        Some(end)
    };
    let output = Arc::new(SharedOutput::new(out, err).with_stdin(stdin));
    let listen_count = listen.as_ref().map_or(0, |l| l.names().len());
    // The store's one owner, and the acceptor when the runtime accepts.
    let keeper = match fdstore {
        Some((store, fetch)) => {
            let listening = match &listen {
                Some(l) if accept_runtime => l.copies()?,
                _ => Vec::new(),
            };
            Some(Keeper::new(
                &req.id,
                store,
                fetch,
                listening,
                engines.len(),
            )?)
        }
        None => None,
    };
    let host = Arc::new(Machine::new(
        engines.clone(),
        output.clone(),
        rt.router.clone(),
        lock_file,
        listen,
    ));
    let passing = Arc::new(StartFds {
        keeper: keeper.clone(),
    });
    log::info!(
        "pair {}: created in {} (cgroup {cgroup_path}, gms {backend:?}, pinned namespaces {}, listening sockets {listen_count}, accepted by the {})",
        req.id,
        dirs.root.display(),
        pins.is_some(),
        accept.as_str(),
    );
    let parts = Parts {
        id: req.id.clone(),
        namespace: rt.namespace.clone(),
        config: cfg.clone(),
        host,
        passing,
        store_figures: keeper.as_ref().map(|k| k.figures()),
        keeper: keeper.map(|k| k as Arc<dyn Keeping>),
        runc_ids: engines.iter().map(|e| e.runc_id.clone()).collect(),
        output,
        copiers: out_copier.into_iter().chain(err_copier).collect(),
        router: rt.router.clone(),
        events: rt.events.clone(),
        notify: Some(notify),
        lock_path: Some(dirs.pair.join(shadow_contract::paths::LOCK_FILE)),
        state_json: dirs.state_json.clone(),
        containerd: rt.containerd.clone(),
        metrics_file,
        made: Made::default(),
        gpu_buses: gpus.iter().map(|g| g.bus.clone()).collect(),
        single: req.single,
        shadows: count - 1,
        hang: Hang {
            watchdog,
            probe,
            start_timeout: req.hang.start_timeout,
        },
    };
    Ok((engines, parts))
}

/// Who accepts: the spec's word stands (and `runtime` without listening
/// sockets or a store is refused after this); the config's default
/// applies where it can, `runtime` only to a pair that `can_hand` (has
/// both), the others' engines accepting (they have nothing else to do).
fn accept_for(
    spec: Option<shadow_contract::handoff::Accept>,
    config: &str,
    can_hand: bool,
) -> Result<shadow_contract::handoff::Accept> {
    use shadow_contract::handoff::Accept;
    Ok(match spec {
        Some(a) => a,
        None => match shadow_contract::handoff::parse(config)? {
            Accept::Runtime if !can_hand => Accept::Engine,
            a => a,
        },
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_configs_runtime_default_applies_to_pairs_that_can_hand_only() {
        use shadow_contract::handoff::Accept;
        assert_eq!(accept_for(None, "runtime", true).unwrap(), Accept::Runtime);
        assert_eq!(accept_for(None, "runtime", false).unwrap(), Accept::Engine);
        assert_eq!(accept_for(None, "engine", true).unwrap(), Accept::Engine);
        // The spec's word stands, whatever the config says (a runtime
        // that cannot hand is refused by the caller, naming what it needs).
        assert_eq!(
            accept_for(Some(Accept::Engine), "runtime", true).unwrap(),
            Accept::Engine
        );
        assert_eq!(
            accept_for(Some(Accept::Runtime), "engine", false).unwrap(),
            Accept::Runtime
        );
        assert!(accept_for(None, "kernel", true).is_err());
    }

    use super::*;

    #[test]
    fn a_pod_annotation_never_overrides_a_node_that_says_off() {
        for b in [GmsBackend::Cuda, GmsBackend::Host, GmsBackend::Off] {
            assert_eq!(gms_backend(Some(b), GmsMode::Off, true), GmsBackend::Off);
            assert_eq!(gms_backend(Some(b), GmsMode::Auto, false), b);
        }
        assert_eq!(gms_backend(None, GmsMode::Auto, true), GmsBackend::Cuda);
        assert_eq!(gms_backend(None, GmsMode::Auto, false), GmsBackend::Host);
        assert_eq!(gms_backend(None, GmsMode::Host, true), GmsBackend::Host);
    }
}
