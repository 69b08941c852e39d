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

pub struct TaskService {
    runtime: Runtime,
    containers: Mutex<HashMap<String, Entry>>,
    /// Serialises Creates so that an id is checked and taken atomically.
    creating: Mutex<()>,
    exit: Arc<ExitSignal>,
}

impl TaskService {
    pub fn new(runtime: Runtime, exit: Arc<ExitSignal>) -> Self {
        TaskService {
            runtime,
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
        let annotations = spec.typed.annotations().clone().unwrap_or_default();
        let shadow = ShadowAnnotations::parse(&annotations)?;
        let stdio = Stdio {
            stdin: req.stdin.clone(),
            stdout: req.stdout.clone(),
            stderr: req.stderr.clone(),
            terminal: req.terminal,
        };
        let by_default = self.runtime.config.pair.pair_by_default;
        let container: Arc<dyn Container> = if shadow.pairs(&annotations, by_default) {
            PairedContainer::create(
                &self.runtime,
                PairRequest {
                    id: req.id.clone(),
                    bundle: req.bundle.clone(),
                    rootfs: req.rootfs.clone(),
                    stdio,
                    gms: shadow.gms,
                    single: shadow.no_shadow,
                    listen: shadow.listen.clone(),
                    runc: runc.clone(),
                    spec: spec.raw,
                },
            )
            .await?
        } else {
            PlainContainer::create(
                &self.runtime,
                CreateRequest {
                    id: req.id.clone(),
                    bundle: req.bundle.clone(),
                    rootfs: req.rootfs.clone(),
                    stdio,
                    runc: runc.clone(),
                },
                &spec,
            )
            .await?
        };
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

    pub async fn container_count(&self) -> usize {
        self.containers.lock().await.len()
    }
}

#[async_trait]
impl Task for TaskService {
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
        let e = self.entry(&req.id).await?;
        let pid = match exec_of(&req.exec_id) {
            Some(exec_id) => {
                let (proc, spec) = e.execs.spec(exec_id).await?;
                e.container.start_exec(&proc, exec_id, spec).await?
            }
            None => e.container.start().await?,
        };
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
        let e = self.entry(&req.id).await?;
        match exec_of(&req.exec_id) {
            Some(exec_id) => e.execs.kill(exec_id, req.signal).await?,
            None => e.container.kill(req.signal, req.all).await?,
        }
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
        let e = self.entry(&req.id).await?;
        let exit = match exec_of(&req.exec_id) {
            Some(exec_id) => e.execs.wait(exec_id).await?,
            None => e.container.wait().await?,
        };
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

    fn service() -> (TaskService, crate::events::EventQueue) {
        let (events, rx) = EventSink::channel();
        let runtime = Runtime {
            config: crate::config::Config::default(),
            containerd: "/run/containerd/containerd.sock".into(),
            namespace: "test".into(),
            router: Arc::new(crate::exits::ExitRouter::default()),
            events,
        };
        (
            TaskService::new(runtime, Arc::new(ExitSignal::default())),
            rx,
        )
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
}
