//! A plain container: one runc container, exactly as `io.containerd.runc.v2`
//! runs it. Create mounts the rootfs, wires stdio and runs `runc create`;
//! everything after that is a runc command plus the exit watcher. Every
//! failing step of Create undoes the earlier ones, so a refused container
//! leaves no runc state, mount or open FIFO behind.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use containerd_shim_protos::api::Mount;
use containerd_shim_protos::events::task::{TaskOOM, TaskStart};
use containerd_shim_protos::protobuf::well_known_types::any::Any;
use containerd_shim_protos::types::task::ProcessInfo;
use oci_spec::runtime::{LinuxResources, Process as ProcessSpec};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::bundle::BundleSpec;
use crate::container::Container;
use crate::error::{Error, Result};
use crate::events::{Event, EventSink};
use crate::exec::Exec;
use crate::exits::{Exit, ExitRouter};
use crate::io::{ConsoleSocket, ProcessIo};
use crate::mount::{mount_all, unmount};
use crate::options::RuncOptions;
use crate::process::Process;
use crate::runc::{RuncClient, RuncStdio, INIT_PID_FILE};
use crate::runtime::Runtime;
use crate::status::{ExitInfo, ProcessState, Status, Stdio};

/// The parts of a Create request a plain container needs.
pub struct CreateRequest {
    pub id: String,
    pub bundle: String,
    pub rootfs: Vec<Mount>,
    pub stdio: Stdio,
    /// runc settings from the task's options.
    pub runc: RuncOptions,
}

/// How long Delete waits for a killed, never-started init to be reaped.
const DELETE_REAP_WAIT: Duration = Duration::from_secs(2);

pub struct PlainContainer {
    id: String,
    bundle: String,
    client: RuncClient,
    router: Arc<ExitRouter>,
    events: EventSink,
    init: Arc<Process>,
    /// The init pid never changes once runc created it.
    init_pid: u32,
    /// `bundle/rootfs` when the shim mounted it (Create had rootfs mounts).
    mounted_rootfs: Option<PathBuf>,
    oom: std::sync::Mutex<Option<JoinHandle<()>>>,
}

/// Undo for a half-made container: runs unless disarmed.
struct CreateUndo<'a> {
    client: &'a RuncClient,
    id: &'a str,
    mounted: Option<PathBuf>,
    runc_created: bool,
}

impl CreateUndo<'_> {
    async fn run(self) {
        if self.runc_created {
            if let Err(e) = self.client.delete_force(self.id).await {
                log::warn!("cleaning up {}: {e}", self.id);
            }
        }
        if let Some(target) = &self.mounted {
            unmount(target).await;
        }
    }
}

/// The init's exit, delivered only after every other process of the
/// container was killed (`runc kill --all KILL`), as runc-v2 does before it
/// publishes the exit: whoever waits for the exit then finds nothing left.
fn kill_rest_before_exit(
    client: RuncClient,
    id: String,
    exit: oneshot::Receiver<Exit>,
) -> oneshot::Receiver<Exit> {
    let (tx, rx) = oneshot::channel();
    tokio::spawn(async move {
        let Ok(exit) = exit.await else {
            return;
        };
        if let Err(e) = client.kill(&id, libc::SIGKILL as u32, true).await {
            log::warn!("container {id}: killing what its init left: {e}");
        }
        let _ = tx.send(exit);
    });
    rx
}

impl PlainContainer {
    pub async fn create(rt: &Runtime, req: CreateRequest, spec: &BundleSpec) -> Result<Arc<Self>> {
        let bundle = PathBuf::from(&req.bundle);
        let client = RuncClient::new(
            &rt.config,
            &rt.namespace,
            &bundle,
            rt.router.clone(),
            &req.runc,
        )?;
        // For the `delete` action, which runs with no options.
        req.runc.save(&bundle)?;
        let mut undo = CreateUndo {
            client: &client,
            id: &req.id,
            mounted: None,
            runc_created: false,
        };
        match Self::create_steps(rt, &req, spec, &bundle, &client, &mut undo).await {
            Ok((init, pid)) => {
                let container = Arc::new(PlainContainer {
                    id: req.id.clone(),
                    bundle: req.bundle.clone(),
                    client: client.clone(),
                    router: rt.router.clone(),
                    events: rt.events.clone(),
                    init,
                    init_pid: pid,
                    mounted_rootfs: undo.mounted.clone(),
                    oom: std::sync::Mutex::new(None),
                });
                container.watch_oom(pid);
                Ok(container)
            }
            Err(e) => {
                undo.run().await;
                Err(e)
            }
        }
    }

    async fn create_steps(
        rt: &Runtime,
        req: &CreateRequest,
        spec: &BundleSpec,
        bundle: &Path,
        client: &RuncClient,
        undo: &mut CreateUndo<'_>,
    ) -> Result<(Arc<Process>, u32)> {
        if !req.rootfs.is_empty() {
            let target = bundle.join("rootfs");
            undo.mounted = Some(target.clone());
            mount_all(&req.rootfs, &target).await?;
        }
        let root = shadow_contract::oci::rootfs(&spec.raw, bundle)
            .unwrap_or_else(|| bundle.join("rootfs"));
        if !root.is_dir() {
            return Err(Error::InvalidArgument(format!(
                "container {}: rootfs {} does not exist",
                req.id,
                root.display()
            )));
        }

        let console = match req.stdio.terminal {
            true => Some(ConsoleSocket::new()?),
            false => None,
        };
        let console_path = console.as_ref().map(ConsoleSocket::path);
        let mut io = None;
        let stdio = match &console_path {
            Some(path) => RuncStdio::Console(path),
            None => {
                let (child, pio) = ProcessIo::pipes(&req.stdio, client.io_owner())?;
                io = Some(pio);
                RuncStdio::Fds(Arc::new(child))
            }
        };
        let created = client.create(&req.id, bundle, stdio).await;
        // Also when it failed: runc may have left state to remove.
        undo.runc_created = true;
        let pid = created?;

        if let Some(sock) = console {
            let master = sock.receive().await?;
            io = Some(ProcessIo::console(master, &req.stdio)?);
        }
        let init = Process::new(&req.id, None, req.stdio.clone(), None);
        {
            let mut st = init.state.lock().await;
            st.pid = pid;
            st.io = io;
        }
        let exit = rt.router.watch(pid as i32);
        let exit = match !shadow_contract::oci::own_pid_namespace(&spec.raw) {
            true => kill_rest_before_exit(client.clone(), req.id.clone(), exit),
            false => exit,
        };
        init.watch_exit(exit, rt.events.clone());
        Ok((init, pid))
    }

    fn watch_oom(&self, pid: u32) {
        let events = self.events.clone();
        let id = self.id.clone();
        let cg = crate::stats::of_pid(pid);
        match cg.and_then(|cg| {
            crate::oom::watch(&cg, move || {
                events.send(Event::Oom(TaskOOM {
                    container_id: id.clone(),
                    ..Default::default()
                }))
            })
        }) {
            Ok(task) => *self.oom.lock().unwrap_or_else(|p| p.into_inner()) = task,
            Err(e) => log::warn!("container {}: no OOM events: {e}", self.id),
        }
    }
}

#[async_trait]
impl Container for PlainContainer {
    fn bundle(&self) -> &str {
        &self.bundle
    }

    fn pid(&self) -> u32 {
        self.init_pid
    }

    async fn start(&self) -> Result<u32> {
        let mut st = self.init.state.lock().await;
        if st.status != Status::Created {
            return Err(Error::FailedPrecondition(format!(
                "container {} is not in the created state",
                self.id
            )));
        }
        self.client.start(&self.id).await?;
        st.status = Status::Running;
        self.events.send(Event::Start(TaskStart {
            container_id: self.id.clone(),
            pid: st.pid,
            ..Default::default()
        }));
        Ok(st.pid)
    }

    async fn state(&self) -> Result<ProcessState> {
        Ok(self.init.snapshot().await)
    }

    async fn kill(&self, signal: u32, all: bool) -> Result<()> {
        let st = self.init.state.lock().await;
        if st.status == Status::Stopped && !all {
            return Err(Error::Finished {
                id: self.id.clone(),
                process: "the init process".into(),
            });
        }
        // The window between a death and its reap is NotFound, as runc-v2
        // answers it (runc's "container not running" is mapped in
        // `RuncClient::kill`).
        self.client.kill(&self.id, signal, all).await
    }

    async fn wait(&self) -> Result<ExitInfo> {
        self.init.wait().await
    }

    async fn delete(&self) -> Result<ExitInfo> {
        let proc = &self.init;
        let (status, pid, exit) = {
            let st = proc.state.lock().await;
            (st.status, st.pid, st.exit)
        };
        if matches!(status, Status::Running | Status::Paused) {
            return Err(Error::FailedPrecondition(format!(
                "cannot delete the init process of {}: it is still running",
                self.id
            )));
        }
        // Init: remove runc's state (this kills a never-started init).
        self.client.delete_force(&self.id).await?;
        let exit = match exit {
            Some(x) => x,
            None => proc.wait_for(DELETE_REAP_WAIT).await.unwrap_or(ExitInfo {
                pid,
                status: 128 + libc::SIGKILL as u32,
                at: SystemTime::now(),
            }),
        };
        if let Some(task) = self.oom.lock().unwrap_or_else(|p| p.into_inner()).take() {
            task.abort();
        }
        proc.state.lock().await.io = None;
        if let Some(target) = &self.mounted_rootfs {
            unmount(target).await;
        }
        let _ = std::fs::remove_file(PathBuf::from(&self.bundle).join(INIT_PID_FILE));
        Ok(exit)
    }

    async fn exec_allowed(&self, exec_id: &str) -> Result<()> {
        if self.init.state.lock().await.status == Status::Stopped {
            return Err(Error::FailedPrecondition(format!(
                "container {} has exited; cannot exec {exec_id}",
                self.id
            )));
        }
        Ok(())
    }

    async fn start_exec(
        &self,
        proc: &Arc<Process>,
        exec_id: &str,
        spec: ProcessSpec,
    ) -> Result<u32> {
        let exec = Exec {
            client: &self.client,
            runc_id: &self.id,
            bundle: Path::new(&self.bundle),
            container_id: &self.id,
            router: &self.router,
            events: &self.events,
        };
        exec.start(proc, exec_id, &spec).await
    }

    async fn resize_pty(&self, width: u32, height: u32) -> Result<()> {
        match &self.init.state.lock().await.io {
            Some(io) => io.resize(width, height),
            // No stdio at all: nothing to resize (runc-v2 answers OK).
            None => Ok(()),
        }
    }

    async fn close_io(&self) -> Result<()> {
        if let Some(io) = self.init.state.lock().await.io.as_mut() {
            io.close_stdin();
        }
        Ok(())
    }

    async fn pause(&self) -> Result<()> {
        let mut st = self.init.state.lock().await;
        if st.status != Status::Running {
            return Err(Error::FailedPrecondition(format!(
                "container {} is not running",
                self.id
            )));
        }
        self.client.pause(&self.id).await?;
        st.status = Status::Paused;
        Ok(())
    }

    async fn resume(&self) -> Result<()> {
        let mut st = self.init.state.lock().await;
        if st.status != Status::Paused {
            return Err(Error::FailedPrecondition(format!(
                "container {} is not paused",
                self.id
            )));
        }
        self.client.resume(&self.id).await?;
        st.status = Status::Running;
        Ok(())
    }

    async fn pids(&self) -> Result<Vec<ProcessInfo>> {
        let pids = self.client.ps(&self.id).await?;
        Ok(pids
            .into_iter()
            .map(|pid| ProcessInfo {
                pid,
                ..Default::default()
            })
            .collect())
    }

    async fn update(&self, resources: LinuxResources) -> Result<()> {
        self.client.update(&self.id, &resources).await
    }

    async fn stats(&self) -> Result<Any> {
        let pid = self.init.state.lock().await.pid;
        if pid == 0 {
            return Err(Error::FailedPrecondition(format!(
                "container {} has no process",
                self.id
            )));
        }
        crate::stats::collect(&crate::stats::of_pid(pid)?)
    }
}
