//! The ttrpc `containerd.task.v2.Task` service: every RPC once, over the
//! `Container` trait. It owns the table of containers (one shim serves a
//! whole pod), decides at Create which implementation a spec gets, and
//! publishes the events that are the service's own (create, delete,
//! exec-added, paused, resumed). Every RPC is implemented explicitly so
//! that nothing falls through to the generated NOT_FOUND default.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use async_trait::async_trait;
use containerd_shim::{ExitSignal, TtrpcContext, TtrpcResult};
use containerd_shim_protos::api::{
    CloseIORequest, ConnectRequest, ConnectResponse, CreateTaskRequest, CreateTaskResponse,
    DeleteRequest, DeleteResponse, Empty, ExecProcessRequest, KillRequest, PauseRequest,
    PidsRequest, PidsResponse, ResizePtyRequest, ResumeRequest, ShutdownRequest, StartRequest,
    StartResponse, StateRequest, StateResponse, StatsRequest, StatsResponse, UpdateTaskRequest,
    WaitRequest, WaitResponse,
};
use containerd_shim_protos::events::task::{
    TaskCreate, TaskDelete, TaskExecAdded, TaskIO, TaskPaused, TaskResumed,
};
use containerd_shim_protos::shim::shim::CheckpointTaskRequest;
use containerd_shim_protos::shim_async::Task;
use containerd_shim_protos::types::task::Status as ProtoStatus;
use oci_spec::runtime::{LinuxResources, Process as ProcessSpec};
use tokio::sync::Mutex;

use crate::annotations::{Pairing, ShadowAnnotations};
use crate::bundle::BundleSpec;
use crate::container::Container;
use crate::error::{Error, Result};
use crate::events::{Event, EventSink};
use crate::execs::Execs;
use crate::options::{RuncOptions, RuntimeOptions};
use crate::pair::{PairRequest, PairedContainer};
use crate::plain::{CreateRequest, PlainContainer};
use crate::runtime::Runtime;
use crate::status::{ExitInfo, Status, Stdio};
use crate::time::timestamp;

fn exec_of(exec_id: &str) -> Option<&str> {
    Some(exec_id).filter(|s| !s.is_empty())
}

/// One container of the shim and its execs.
#[derive(Clone)]
struct Entry {
    container: Arc<dyn Container>,
    execs: Arc<Execs>,
}

/// Whoever makes the service's containers: given a Create and the
/// bundle's spec, a container of whichever kind the spec asks for. The
/// service's rules (one id once, the events that are its own, execs, the
/// table) are the same whatever makes them; tests give it a stub.
#[async_trait]
pub trait Maker: Send + Sync + 'static {
    async fn make(&self, rt: &Runtime, req: Made<'_>) -> Result<Arc<dyn Container>>;
}

/// What a [`Maker`] is given for one Create.
pub struct Made<'a> {
    pub req: &'a CreateTaskRequest,
    pub spec: BundleSpec,
    pub stdio: Stdio,
    /// The task's runc settings (root, binary, flags) from its options.
    pub runc: RuncOptions,
}

/// The shim's own maker: a pair when the spec's `shadow.dev/` annotations
/// (or the config's `pair_by_default`) ask for one, else a plain runc
/// container.
pub struct RuncMaker;

#[async_trait]
impl Maker for RuncMaker {
    async fn make(&self, rt: &Runtime, made: Made<'_>) -> Result<Arc<dyn Container>> {
        let Made {
            req,
            spec,
            stdio,
            runc,
        } = made;
        let annotations = spec.typed.annotations().clone().unwrap_or_default();
        let shadow = ShadowAnnotations::parse(&annotations)?;
        let by_default = rt.config.pair.pair_by_default;
        if shadow.pairs(&annotations, by_default) {
            let pair = PairedContainer::create(
                rt,
                PairRequest {
                    id: req.id.clone(),
                    bundle: req.bundle.clone(),
                    rootfs: req.rootfs.clone(),
                    stdio,
                    gms: shadow.gms,
                    single: shadow.no_shadow,
                    shadows: shadow.shadows,
                    fdstore_max: shadow.fdstore_max,
                    accept: shadow.accept,
                    listen: shadow.listen.clone(),
                    hang: shadow.hang.clone(),
                    runc,
                    spec: spec.raw,
                },
            )
            .await?;
            Ok(pair)
        } else {
            let plain = PlainContainer::create(
                rt,
                CreateRequest {
                    id: req.id.clone(),
                    bundle: req.bundle.clone(),
                    rootfs: req.rootfs.clone(),
                    stdio,
                    runc,
                },
                &spec,
            )
            .await?;
            Ok(plain)
        }
    }
}

pub struct TaskService<M: Maker = RuncMaker> {
    runtime: Runtime,
    maker: M,
    containers: Mutex<HashMap<String, Entry>>,
    /// Serialises Creates so that an id is checked and taken atomically.
    creating: Mutex<()>,
    exit: Arc<ExitSignal>,
}

impl TaskService<RuncMaker> {
    pub fn new(runtime: Runtime, exit: Arc<ExitSignal>) -> Self {
        TaskService::with_maker(runtime, RuncMaker, exit)
    }
}

impl<M: Maker> TaskService<M> {
    pub fn with_maker(runtime: Runtime, maker: M, exit: Arc<ExitSignal>) -> Self {
        TaskService {
            runtime,
            maker,
            containers: Mutex::new(HashMap::new()),
            creating: Mutex::new(()),
            exit,
        }
    }

    fn events(&self) -> &EventSink {
        &self.runtime.events
    }

    async fn entry(&self, id: &str) -> Result<Entry> {
        self.containers
            .lock()
            .await
            .get(id)
            .cloned()
            .ok_or_else(|| Error::ContainerNotFound(id.to_string()))
    }

    async fn get(&self, id: &str) -> Result<Arc<dyn Container>> {
        Ok(self.entry(id).await?.container)
    }

    pub async fn do_create(&self, req: CreateTaskRequest) -> Result<u32> {
        let _creating = self.creating.lock().await;
        if self.containers.lock().await.contains_key(&req.id) {
            return Err(Error::AlreadyExists(format!("container {}", req.id)));
        }
        if !req.checkpoint.is_empty() {
            return Err(Error::Unimplemented(
                "checkpoint/restore is not supported".into(),
            ));
        }
        let spec = BundleSpec::read(Path::new(&req.bundle))?;
        // The task's options (containerd sends the container's runtime
        // options when the task has none): runc's root, binary and flags.
        let runc = match req.options.as_ref() {
            Some(any) => RuntimeOptions::from_any(any)?.runc,
            None => RuncOptions::default(),
        };
        let stdio = Stdio {
            stdin: req.stdin.clone(),
            stdout: req.stdout.clone(),
            stderr: req.stderr.clone(),
            terminal: req.terminal,
        };
        let container = self
            .maker
            .make(
                &self.runtime,
                Made {
                    req: &req,
                    spec,
                    stdio,
                    runc,
                },
            )
            .await?;
        let pid = container.pid();
        let execs = Arc::new(Execs::new(&req.id));
        self.containers
            .lock()
            .await
            .insert(req.id.clone(), Entry { container, execs });
        self.events().send(Event::Create(TaskCreate {
            container_id: req.id.clone(),
            bundle: req.bundle.clone(),
            rootfs: req.rootfs.clone(),
            io: Some(TaskIO {
                stdin: req.stdin.clone(),
                stdout: req.stdout.clone(),
                stderr: req.stderr.clone(),
                terminal: req.terminal,
                ..Default::default()
            })
            .into(),
            checkpoint: req.checkpoint.clone(),
            pid,
            ..Default::default()
        }));
        Ok(pid)
    }

    pub async fn do_delete(&self, id: &str, exec_id: Option<&str>) -> Result<ExitInfo> {
        let e = self.entry(id).await?;
        if let Some(exec_id) = exec_id {
            return e.execs.delete(exec_id).await;
        }
        let exit = e.container.delete().await?;
        e.execs.clear().await;
        {
            self.containers.lock().await.remove(id);
            self.events().send(Event::Delete(TaskDelete {
                container_id: id.to_string(),
                pid: exit.pid,
                exit_status: exit.status,
                exited_at: Some(timestamp(exit.at)).into(),
                ..Default::default()
            }));
        }
        Ok(exit)
    }

    pub async fn do_exec(&self, req: ExecProcessRequest) -> Result<()> {
        let e = self.entry(&req.id).await?;
        let spec_any = req.spec.as_ref().ok_or_else(|| {
            Error::InvalidArgument(format!(
                "exec {} in {}: no process spec",
                req.exec_id, req.id
            ))
        })?;
        let mut spec: ProcessSpec = serde_json::from_slice(&spec_any.value).map_err(|e| {
            Error::InvalidArgument(format!(
                "exec {} in {}: process spec: {e}",
                req.exec_id, req.id
            ))
        })?;
        // The request decides whether the exec has a terminal, whatever the
        // spec says (clients copy the init's process into it): runc-v2 sets
        // the spec's `terminal` from the request, and runc refuses a console
        // socket for a process whose spec says no terminal.
        spec.set_terminal(Some(req.terminal));
        let stdio = Stdio {
            stdin: req.stdin.clone(),
            stdout: req.stdout.clone(),
            stderr: req.stderr.clone(),
            terminal: req.terminal,
        };
        e.container.exec_allowed(&req.exec_id).await?;
        e.execs.add(&req.exec_id, stdio, spec).await?;
        self.events().send(Event::ExecAdded(TaskExecAdded {
            container_id: req.id.clone(),
            exec_id: req.exec_id.clone(),
            ..Default::default()
        }));
        Ok(())
    }

    pub async fn do_state(&self, id: &str, exec_id: Option<&str>) -> Result<StateResponse> {
        let e = self.entry(id).await?;
        let c = &e.container;
        let s = match exec_id {
            Some(exec_id) => e.execs.state(exec_id).await?,
            None => c.state().await?,
        };
        let status = match s.status {
            Status::Created => ProtoStatus::CREATED,
            Status::Running => ProtoStatus::RUNNING,
            Status::Paused => ProtoStatus::PAUSED,
            Status::Stopped => ProtoStatus::STOPPED,
        };
        Ok(StateResponse {
            id: exec_id.unwrap_or(id).to_string(),
            bundle: c.bundle().to_string(),
            pid: s.pid,
            status: status.into(),
            stdin: s.stdio.stdin,
            stdout: s.stdio.stdout,
            stderr: s.stdio.stderr,
            terminal: s.stdio.terminal,
            exit_status: s.exit.map(|e| e.status).unwrap_or(0),
            exited_at: s.exit.map(|e| timestamp(e.at)).into(),
            exec_id: exec_id.unwrap_or_default().to_string(),
            ..Default::default()
        })
    }

    pub async fn do_start(&self, id: &str, exec_id: Option<&str>) -> Result<u32> {
        let e = self.entry(id).await?;
        match exec_id {
            Some(exec_id) => {
                let (proc, spec) = e.execs.spec(exec_id).await?;
                e.container.start_exec(&proc, exec_id, spec).await
            }
            None => e.container.start().await,
        }
    }

    pub async fn do_kill(
        &self,
        id: &str,
        exec_id: Option<&str>,
        signal: u32,
        all: bool,
    ) -> Result<()> {
        let e = self.entry(id).await?;
        match exec_id {
            Some(exec_id) => e.execs.kill(exec_id, signal).await,
            None => e.container.kill(signal, all).await,
        }
    }

    pub async fn do_wait(&self, id: &str, exec_id: Option<&str>) -> Result<ExitInfo> {
        let e = self.entry(id).await?;
        match exec_id {
            Some(exec_id) => e.execs.wait(exec_id).await,
            None => e.container.wait().await,
        }
    }

    pub async fn container_count(&self) -> usize {
        self.containers.lock().await.len()
    }
}

#[async_trait]
impl<M: Maker> Task for TaskService<M> {
    async fn state(&self, _ctx: &TtrpcContext, req: StateRequest) -> TtrpcResult<StateResponse> {
        Ok(self.do_state(&req.id, exec_of(&req.exec_id)).await?)
    }

    async fn create(
        &self,
        _ctx: &TtrpcContext,
        req: CreateTaskRequest,
    ) -> TtrpcResult<CreateTaskResponse> {
        let id = req.id.clone();
        let pid = self.do_create(req).await.inspect_err(|e| {
            log::warn!("create {id}: {e}");
        })?;
        Ok(CreateTaskResponse {
            pid,
            ..Default::default()
        })
    }

    async fn start(&self, _ctx: &TtrpcContext, req: StartRequest) -> TtrpcResult<StartResponse> {
        let pid = self.do_start(&req.id, exec_of(&req.exec_id)).await?;
        // Create and Start touched code the running container will not need.
        crate::memory::trim_when_idle();
        Ok(StartResponse {
            pid,
            ..Default::default()
        })
    }

    async fn delete(&self, _ctx: &TtrpcContext, req: DeleteRequest) -> TtrpcResult<DeleteResponse> {
        let exit = self.do_delete(&req.id, exec_of(&req.exec_id)).await?;
        Ok(DeleteResponse {
            pid: exit.pid,
            exit_status: exit.status,
            exited_at: Some(timestamp(exit.at)).into(),
            ..Default::default()
        })
    }

    async fn pids(&self, _ctx: &TtrpcContext, req: PidsRequest) -> TtrpcResult<PidsResponse> {
        let c = self.get(&req.id).await?;
        Ok(PidsResponse {
            processes: c.pids().await?,
            ..Default::default()
        })
    }

    async fn pause(&self, _ctx: &TtrpcContext, req: PauseRequest) -> TtrpcResult<Empty> {
        self.get(&req.id).await?.pause().await?;
        self.events().send(Event::Paused(TaskPaused {
            container_id: req.id.clone(),
            ..Default::default()
        }));
        Ok(Empty::new())
    }

    async fn resume(&self, _ctx: &TtrpcContext, req: ResumeRequest) -> TtrpcResult<Empty> {
        self.get(&req.id).await?.resume().await?;
        self.events().send(Event::Resumed(TaskResumed {
            container_id: req.id.clone(),
            ..Default::default()
        }));
        Ok(Empty::new())
    }

    async fn checkpoint(
        &self,
        _ctx: &TtrpcContext,
        _req: CheckpointTaskRequest,
    ) -> TtrpcResult<Empty> {
        Err(Error::Unimplemented("checkpoint is not supported by the shadow shim".into()).into())
    }

    async fn kill(&self, _ctx: &TtrpcContext, req: KillRequest) -> TtrpcResult<Empty> {
        self.do_kill(&req.id, exec_of(&req.exec_id), req.signal, req.all)
            .await?;
        Ok(Empty::new())
    }

    async fn exec(&self, _ctx: &TtrpcContext, req: ExecProcessRequest) -> TtrpcResult<Empty> {
        self.do_exec(req).await?;
        Ok(Empty::new())
    }

    async fn resize_pty(&self, _ctx: &TtrpcContext, req: ResizePtyRequest) -> TtrpcResult<Empty> {
        let e = self.entry(&req.id).await?;
        match exec_of(&req.exec_id) {
            Some(exec_id) => e.execs.resize_pty(exec_id, req.width, req.height).await?,
            None => e.container.resize_pty(req.width, req.height).await?,
        }
        Ok(Empty::new())
    }

    async fn close_io(&self, _ctx: &TtrpcContext, req: CloseIORequest) -> TtrpcResult<Empty> {
        let e = self.entry(&req.id).await?;
        if req.stdin {
            match exec_of(&req.exec_id) {
                Some(exec_id) => e.execs.close_io(exec_id).await?,
                None => e.container.close_io().await?,
            }
        }
        Ok(Empty::new())
    }

    async fn update(&self, _ctx: &TtrpcContext, req: UpdateTaskRequest) -> TtrpcResult<Empty> {
        let c = self.get(&req.id).await?;
        let any = req.resources.as_ref().ok_or_else(|| {
            Error::InvalidArgument(format!("update {}: no resources given", req.id))
        })?;
        let resources: LinuxResources = serde_json::from_slice(&any.value).map_err(|e| {
            Error::InvalidArgument(format!(
                "update {}: resources ({}): {e}",
                req.id, any.type_url
            ))
        })?;
        c.update(resources).await?;
        Ok(Empty::new())
    }

    async fn wait(&self, _ctx: &TtrpcContext, req: WaitRequest) -> TtrpcResult<WaitResponse> {
        let exit = self.do_wait(&req.id, exec_of(&req.exec_id)).await?;
        Ok(WaitResponse {
            exit_status: exit.status,
            exited_at: Some(timestamp(exit.at)).into(),
            ..Default::default()
        })
    }

    async fn stats(&self, _ctx: &TtrpcContext, req: StatsRequest) -> TtrpcResult<StatsResponse> {
        let c = self.get(&req.id).await?;
        Ok(StatsResponse {
            stats: Some(c.stats().await?).into(),
            ..Default::default()
        })
    }

    async fn connect(
        &self,
        _ctx: &TtrpcContext,
        req: ConnectRequest,
    ) -> TtrpcResult<ConnectResponse> {
        let task_pid = match self.get(&req.id).await {
            Ok(c) => c.pid(),
            Err(_) => 0,
        };
        Ok(ConnectResponse {
            shim_pid: std::process::id(),
            task_pid,
            version: env!("CARGO_PKG_VERSION").to_string(),
            ..Default::default()
        })
    }

    async fn shutdown(&self, _ctx: &TtrpcContext, _req: ShutdownRequest) -> TtrpcResult<Empty> {
        // One shim serves a pod: stay while any container of it remains.
        if self.container_count().await == 0 {
            self.exit.signal();
        }
        Ok(Empty::new())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_errors_are_invalid_argument_naming_the_file() {
        let d = tempfile::tempdir().unwrap();
        let missing = BundleSpec::read(d.path()).unwrap_err();
        assert_eq!(
            missing.code(),
            containerd_shim_protos::ttrpc::Code::INVALID_ARGUMENT
        );
        assert!(missing.to_string().contains("config.json"));
        std::fs::write(d.path().join("config.json"), "{\"ociVersion\": 3").unwrap();
        let bad = BundleSpec::read(d.path()).unwrap_err();
        assert_eq!(
            bad.code(),
            containerd_shim_protos::ttrpc::Code::INVALID_ARGUMENT
        );
        assert!(bad
            .to_string()
            .contains(&d.path().join("config.json").display().to_string()));
    }

    /// The service `maker` drives, and the events it publishes.
    fn service_with<M: Maker>(maker: M) -> (TaskService<M>, crate::events::EventQueue) {
        let (events, rx) = EventSink::channel();
        let runtime = Runtime {
            config: crate::config::Config::default(),
            containerd: "/run/containerd/containerd.sock".into(),
            namespace: "test".into(),
            router: Arc::new(crate::exits::ExitRouter::default()),
            events,
        };
        let svc = TaskService::with_maker(runtime, maker, Arc::new(ExitSignal::default()));
        (svc, rx)
    }

    fn service() -> (TaskService, crate::events::EventQueue) {
        service_with(RuncMaker)
    }

    fn bundle_with(annotations: &str) -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("rootfs")).unwrap();
        let spec = format!(
            r#"{{"ociVersion":"1.0.2","root":{{"path":"rootfs"}},"process":{{"cwd":"/","user":{{"uid":0,"gid":0}},"args":["/bin/true"]}},"annotations":{{{annotations}}}}}"#
        );
        std::fs::write(d.path().join("config.json"), spec).unwrap();
        d
    }

    async fn refused(annotations: &str) -> Error {
        let (svc, mut rx) = service();
        let b = bundle_with(annotations);
        let req = CreateTaskRequest {
            id: "c1".into(),
            bundle: b.path().display().to_string(),
            ..Default::default()
        };
        let e = svc.do_create(req).await.unwrap_err();
        // Refused before anything exists: no container, no event.
        assert_eq!(svc.container_count().await, 0);
        assert!(rx.try_recv().is_err());
        e
    }

    #[tokio::test]
    async fn pair_with_a_terminal_is_refused_and_leaves_nothing() {
        let (mut svc, mut rx) = service();
        let state = tempfile::tempdir().unwrap();
        svc.runtime.config.pair.state_dir = state.path().to_path_buf();
        let b = bundle_with(r#""shadow.dev/pair":"true""#);
        let req = CreateTaskRequest {
            id: "c1".into(),
            bundle: b.path().display().to_string(),
            terminal: true,
            ..Default::default()
        };
        let e = svc.do_create(req).await.unwrap_err();
        assert_eq!(
            e.code(),
            containerd_shim_protos::ttrpc::Code::INVALID_ARGUMENT,
            "{e}"
        );
        assert!(e.to_string().contains("terminal"), "{e}");
        assert_eq!(svc.container_count().await, 0);
        assert!(rx.try_recv().is_err());
        assert_eq!(std::fs::read_dir(state.path()).unwrap().count(), 0);
    }

    #[tokio::test]
    async fn bad_annotation_is_refused_as_invalid_argument() {
        let e = refused(r#""shadow.dev/gms":"gpu""#).await;
        assert_eq!(
            e.code(),
            containerd_shim_protos::ttrpc::Code::INVALID_ARGUMENT
        );
    }

    #[tokio::test]
    async fn unknown_container_is_not_found() {
        let (svc, _rx) = service();
        let e = svc.do_state("nope", None).await.unwrap_err();
        assert_eq!(e.code(), containerd_shim_protos::ttrpc::Code::NOT_FOUND);
        let e = svc.do_delete("nope", None).await.unwrap_err();
        assert_eq!(e.code(), containerd_shim_protos::ttrpc::Code::NOT_FOUND);
    }

    /// A container that only keeps its state and emits what a real one
    /// emits (start at Start, exit when killed), so that the real service
    /// can be driven without root, runc or containerd.
    struct Stub {
        id: String,
        bundle: String,
        events: EventSink,
        exit: tokio::sync::watch::Sender<Option<ExitInfo>>,
        started: std::sync::atomic::AtomicBool,
    }

    #[async_trait]
    impl Container for Stub {
        fn bundle(&self) -> &str {
            &self.bundle
        }
        fn pid(&self) -> u32 {
            42
        }
        async fn start(&self) -> Result<u32> {
            self.started
                .store(true, std::sync::atomic::Ordering::SeqCst);
            self.events.send(Event::Start(
                containerd_shim_protos::events::task::TaskStart {
                    container_id: self.id.clone(),
                    pid: 42,
                    ..Default::default()
                },
            ));
            Ok(42)
        }
        async fn state(&self) -> Result<crate::status::ProcessState> {
            let exit = *self.exit.borrow();
            let status = match (exit, self.started.load(std::sync::atomic::Ordering::SeqCst)) {
                (Some(_), _) => Status::Stopped,
                (None, true) => Status::Running,
                (None, false) => Status::Created,
            };
            Ok(crate::status::ProcessState {
                pid: 42,
                status,
                stdio: Stdio::default(),
                exit,
            })
        }
        async fn kill(&self, signal: u32, _all: bool) -> Result<()> {
            let exit = ExitInfo {
                pid: 42,
                status: 128 + signal,
                at: std::time::SystemTime::now(),
            };
            self.exit.send_replace(Some(exit));
            self.events.send(Event::Exit(
                containerd_shim_protos::events::task::TaskExit {
                    container_id: self.id.clone(),
                    pid: 42,
                    exit_status: exit.status,
                    ..Default::default()
                },
            ));
            Ok(())
        }
        async fn wait(&self) -> Result<ExitInfo> {
            let mut rx = self.exit.subscribe();
            let exit = *rx.wait_for(Option::is_some).await.unwrap();
            Ok(exit.unwrap())
        }
        async fn delete(&self) -> Result<ExitInfo> {
            match *self.exit.borrow() {
                Some(exit) => Ok(exit),
                None => Err(Error::FailedPrecondition("still running".into())),
            }
        }
        async fn exec_allowed(&self, _exec_id: &str) -> Result<()> {
            Ok(())
        }
        async fn start_exec(
            &self,
            _proc: &Arc<crate::process::Process>,
            _exec_id: &str,
            _spec: ProcessSpec,
        ) -> Result<u32> {
            Err(Error::Unimplemented("stub".into()))
        }
        async fn resize_pty(&self, _w: u32, _h: u32) -> Result<()> {
            Ok(())
        }
        async fn close_io(&self) -> Result<()> {
            Ok(())
        }
        async fn pause(&self) -> Result<()> {
            Ok(())
        }
        async fn resume(&self) -> Result<()> {
            Ok(())
        }
        async fn pids(&self) -> Result<Vec<containerd_shim_protos::types::task::ProcessInfo>> {
            Ok(Vec::new())
        }
        async fn update(&self, _r: LinuxResources) -> Result<()> {
            Ok(())
        }
        async fn stats(
            &self,
        ) -> Result<containerd_shim_protos::protobuf::well_known_types::any::Any> {
            Err(Error::Unimplemented("stub".into()))
        }
    }

    struct StubMaker;

    #[async_trait]
    impl Maker for StubMaker {
        async fn make(&self, rt: &Runtime, made: Made<'_>) -> Result<Arc<dyn Container>> {
            Ok(Arc::new(Stub {
                id: made.req.id.clone(),
                bundle: made.req.bundle.clone(),
                events: rt.events.clone(),
                exit: tokio::sync::watch::channel(None).0,
                started: Default::default(),
            }))
        }
    }

    #[tokio::test]
    async fn the_service_publishes_create_start_exit_delete_in_order_and_forgets_the_task() {
        let (svc, mut rx) = service_with(StubMaker);
        let b = bundle_with("");
        let create = |id: &str| CreateTaskRequest {
            id: id.into(),
            bundle: b.path().display().to_string(),
            ..Default::default()
        };
        assert_eq!(svc.do_create(create("c1")).await.unwrap(), 42);
        let again = svc.do_create(create("c1")).await.unwrap_err();
        assert_eq!(
            again.code(),
            containerd_shim_protos::ttrpc::Code::ALREADY_EXISTS
        );
        assert_eq!(
            svc.do_state("c1", None).await.unwrap().status,
            ProtoStatus::CREATED.into()
        );
        // Delete of a running task is refused and publishes nothing.
        assert_eq!(svc.do_start("c1", None).await.unwrap(), 42);
        assert!(svc.do_delete("c1", None).await.is_err());
        let waiter = {
            let exit = svc.do_wait("c1", None);
            svc.do_kill("c1", None, 9, false).await.unwrap();
            exit.await.unwrap()
        };
        assert_eq!(waiter.status, 137);
        let exit = svc.do_delete("c1", None).await.unwrap();
        assert_eq!(exit.status, 137);
        let mut topics = Vec::new();
        while let Ok(e) = rx.try_recv() {
            topics.push(e.topic());
        }
        assert_eq!(
            topics,
            [
                "/tasks/create",
                "/tasks/start",
                "/tasks/exit",
                "/tasks/delete"
            ]
        );
        assert_eq!(svc.container_count().await, 0);
        assert_eq!(
            svc.do_state("c1", None).await.unwrap_err().code(),
            containerd_shim_protos::ttrpc::Code::NOT_FOUND
        );
    }
}
