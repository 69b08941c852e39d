//! A paired container: one container spec run as two engine containers
//! (slots 0 and 1) behind one containerd task. Create (`create.rs`) lays
//! out the pair's directory, derives the engine bundles, pins namespaces,
//! makes the pair's cgroup, starts GMS and creates the first engine; from
//! then on the pair's supervisor (`supervisor/`) owns all of it, keeps the
//! pair alive across failovers and removes it at Delete. The
//! [`PairedContainer`] the Task service holds only sends the supervisor
//! [`Command`]s and watches its [`View`]. containerd sees one task whose
//! pid is the active engine.

pub mod cgroup;
pub mod command;
pub mod config;
mod create;
pub mod dirs;
pub mod engine;
pub mod fdstore;
pub mod fetch;
pub mod gms;
pub mod gpus;
pub mod host;
pub mod input;
pub mod keeper;
pub mod keeping;
pub mod leftovers;
pub mod listen;
pub mod lock;
pub mod made;
pub mod netns;
pub mod notify;
pub mod observe;
pub mod owner;
pub mod passing;
pub mod probe;
pub mod publish;
#[cfg(test)]
mod races;
pub mod spec;
pub mod state_file;
pub mod supervisor;
pub mod xid;

use std::sync::Arc;

use async_trait::async_trait;
use containerd_shim_protos::protobuf::well_known_types::any::Any;
use containerd_shim_protos::types::task::ProcessInfo;
use oci_spec::runtime::{LinuxResources, Process as ProcessSpec};
use shadow_pair::SlotId;
use tokio::sync::{mpsc, oneshot, watch};

use self::command::{Command, Reply};
pub use self::create::PairRequest;
use self::engine::EngineSlot;
use self::publish::View;
use crate::container::Container;
use crate::error::{Error, Result};
use crate::events::EventSink;
use crate::exits::ExitRouter;
use crate::process::Process;
use crate::runtime::Runtime;
use crate::status::{ExitInfo, ProcessState, Status, Stdio};

pub struct PairedContainer {
    id: String,
    bundle: String,
    stdio: Stdio,
    /// The engines, for execs (read only: the supervisor owns the pair).
    engines: Arc<[EngineSlot]>,
    router: Arc<ExitRouter>,
    events: EventSink,
    view: watch::Receiver<View>,
    commands: mpsc::UnboundedSender<Command>,
}

impl PairedContainer {
    pub async fn create(rt: &Runtime, req: PairRequest) -> Result<Arc<Self>> {
        let (engines, handle) = create::create(rt, &req).await?;
        Ok(Arc::new(PairedContainer {
            id: req.id,
            bundle: req.bundle,
            stdio: req.stdio,
            engines,
            router: rt.router.clone(),
            events: rt.events.clone(),
            view: handle.view,
            commands: handle.commands,
        }))
    }

    /// Ask the supervisor, and wait for its answer.
    async fn ask<T>(&self, command: impl FnOnce(Reply<T>) -> Command) -> Result<T> {
        let (reply, answer) = oneshot::channel();
        self.commands
            .send(command(reply))
            .map_err(|_| self.deleted())?;
        answer.await.map_err(|_| self.deleted())?
    }

    fn deleted(&self) -> Error {
        Error::FailedPrecondition(format!("pair {} is deleted", self.id))
    }

    fn status(&self) -> Status {
        let v = self.view.borrow();
        if v.exit.is_some() {
            Status::Stopped
        } else if v.paused {
            Status::Paused
        } else if v.started {
            Status::Running
        } else {
            Status::Created
        }
    }

    /// An exec runs in the engine that serves (else any live one).
    fn exec_target(&self) -> Result<&EngineSlot> {
        let v = self.view.borrow();
        let slot = v
            .active
            .or_else(|| SlotId::first(v.pids.len()).find(|s| v.pids[s.index()].is_some()))
            .ok_or_else(|| {
                Error::FailedPrecondition(format!("pair {} has no live engine to exec in", self.id))
            })?;
        Ok(&self.engines[slot.index()])
    }
}

#[async_trait]
impl Container for PairedContainer {
    fn bundle(&self) -> &str {
        &self.bundle
    }

    fn pid(&self) -> u32 {
        self.view.borrow().pid
    }

    async fn start(&self) -> Result<u32> {
        self.ask(Command::Start).await
    }

    async fn state(&self) -> Result<ProcessState> {
        let v = self.view.borrow().clone();
        Ok(ProcessState {
            pid: v.pid,
            status: self.status(),
            stdio: self.stdio.clone(),
            exit: v.exit,
        })
    }

    async fn kill(&self, signal: u32, all: bool) -> Result<()> {
        self.ask(|reply| Command::Kill { signal, all, reply }).await
    }

    async fn wait(&self) -> Result<ExitInfo> {
        let mut rx = self.view.clone();
        let v = rx
            .wait_for(|v| v.exit.is_some())
            .await
            .map_err(|_| Error::FailedPrecondition("pair supervisor is gone".into()))?;
        v.exit
            .ok_or_else(|| Error::FailedPrecondition("no exit recorded".into()))
    }

    async fn delete(&self) -> Result<ExitInfo> {
        match self.ask(Command::Delete).await {
            Ok(exit) => Ok(exit),
            // Deleted before: the same answer again.
            Err(_) if self.commands.is_closed() => {
                let v = self.view.borrow();
                Ok(v.exit.unwrap_or(ExitInfo {
                    pid: v.pid,
                    status: 128 + libc::SIGKILL as u32,
                    at: std::time::SystemTime::now(),
                }))
            }
            Err(e) => Err(e),
        }
    }

    async fn exec_allowed(&self, exec_id: &str) -> Result<()> {
        if self.status() != Status::Running {
            return Err(Error::FailedPrecondition(format!(
                "pair {} is not running; cannot exec {exec_id}",
                self.id
            )));
        }
        Ok(())
    }

    /// An exec runs in the engine that serves (else any live one), with
    /// that engine's contract environment.
    async fn start_exec(
        &self,
        proc: &Arc<Process>,
        exec_id: &str,
        mut spec: ProcessSpec,
    ) -> Result<u32> {
        let engine = self.exec_target()?;
        let env = spec::with_contract_env(
            spec.env().as_deref().unwrap_or_default(),
            &engine.contract_env,
        );
        spec.set_env(Some(env));
        let exec = crate::exec::Exec {
            client: &engine.client,
            runc_id: &engine.runc_id,
            bundle: &engine.bundle,
            container_id: &self.id,
            router: &self.router,
            events: &self.events,
        };
        exec.start(proc, exec_id, &spec).await
    }

    async fn resize_pty(&self, _width: u32, _height: u32) -> Result<()> {
        // An engine pair has no terminal: nothing to resize, which runc-v2
        // answers with OK for any process without one.
        Ok(())
    }

    async fn close_io(&self) -> Result<()> {
        self.ask(Command::CloseIo).await
    }

    async fn pause(&self) -> Result<()> {
        self.ask(Command::Pause).await
    }

    async fn resume(&self) -> Result<()> {
        self.ask(Command::Resume).await
    }

    async fn pids(&self) -> Result<Vec<ProcessInfo>> {
        self.ask(Command::Pids).await
    }

    async fn update(&self, resources: LinuxResources) -> Result<()> {
        self.ask(|reply| Command::Update(Box::new(resources), reply))
            .await
    }

    async fn stats(&self) -> Result<Any> {
        self.ask(Command::Stats).await
    }
}
