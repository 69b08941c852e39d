//! A paired container: one container spec run as two engine containers
//! (slots 0 and 1) behind one containerd task. Create lays out the pair's
//! directory, derives the engine bundles, pins namespaces, makes the pair's
//! cgroup and starts GMS; Start runs both engines and hands the pair to its
//! supervisor (`supervisor.rs`), which keeps it alive across failovers until
//! Kill or a spent restart budget. containerd sees one task whose pid is the
//! active engine.

pub mod cgroup;
pub mod config;
mod create;
pub mod dirs;
pub mod engine;
pub mod gms;
pub mod gpus;
pub mod host;
pub mod input;
pub mod leftovers;
pub mod listen;
pub mod lock;
pub mod netns;
pub mod notify;
pub mod observe;
pub mod publish;
#[cfg(test)]
mod races;
pub mod spec;
pub mod state_file;
pub mod supervisor;
pub mod xid;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::SystemTime;

use async_trait::async_trait;
use containerd_shim_protos::events::task::TaskStart;
use containerd_shim_protos::protobuf::well_known_types::any::Any;
use containerd_shim_protos::types::task::ProcessInfo;
use nix::sys::signal::Signal;
use oci_spec::runtime::{LinuxResources, Process as ProcessSpec};
use shadow_pair::SlotId;
use tokio::sync::{mpsc, watch, Mutex};

use self::create::Made;
pub use self::create::PairRequest;
use self::engine::EngineSlot;
use self::input::Input;
use self::publish::View;
use self::supervisor::Supervisor;
use crate::container::Container;
use crate::error::{Error, Result};
use crate::events::{Event, EventSink};
use crate::exits::ExitRouter;
use crate::process::Process;
use crate::runtime::Runtime;
use crate::status::{ExitInfo, ProcessState, Status, Stdio};

pub struct PairedContainer {
    id: String,
    bundle: String,
    stdio: Stdio,
    engines: Arc<[EngineSlot; 2]>,
    router: Arc<ExitRouter>,
    events: EventSink,
    view: watch::Receiver<View>,
    /// Until Start: the supervisor waiting to run.
    waiting: Mutex<Option<Supervisor>>,
    /// After Start: how Kill reaches the supervisor.
    input: Mutex<Option<mpsc::UnboundedSender<Input>>>,
    made: Mutex<Made>,
    deleted: Mutex<bool>,
    /// Paused: the pair's cgroup is frozen (both engines).
    paused: AtomicBool,
    /// The pid of the engine created at Create: the task's until Start.
    created_pid: u32,
}

impl PairedContainer {
    pub async fn create(rt: &Runtime, req: PairRequest) -> Result<Arc<Self>> {
        let mut made = Made::default();
        match create::create_steps(rt, &req, &mut made).await {
            Ok((engines, sup, view, created_pid)) => Ok(Arc::new(PairedContainer {
                id: req.id.clone(),
                bundle: req.bundle.clone(),
                stdio: req.stdio.clone(),
                engines,
                router: rt.router.clone(),
                events: rt.events.clone(),
                view,
                waiting: Mutex::new(Some(sup)),
                input: Mutex::new(None),
                made: Mutex::new(made),
                deleted: Mutex::new(false),
                paused: AtomicBool::new(false),
                created_pid,
            })),
            Err(e) => {
                made.undo().await;
                Err(e)
            }
        }
    }

    /// The task's pid: the one the pair publishes once it runs, else the
    /// engine created at Create.
    fn task_pid(&self, published: u32) -> u32 {
        if published != 0 {
            published
        } else {
            self.created_pid
        }
    }

    fn status(&self) -> Status {
        let v = self.view.borrow();
        if v.exit.is_some() {
            Status::Stopped
        } else if self.paused.load(Ordering::Acquire) {
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
            .or_else(|| {
                SlotId::BOTH
                    .into_iter()
                    .find(|s| v.pids[s.index()].is_some())
            })
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
        self.task_pid(self.view.borrow().pid)
    }

    async fn start(&self) -> Result<u32> {
        let mut waiting = self.waiting.lock().await;
        if self.view.borrow().exit.is_some() {
            return Err(Error::FailedPrecondition(format!(
                "pair {} was killed before it started",
                self.id
            )));
        }
        let Some(mut sup) = waiting.take() else {
            return Err(Error::FailedPrecondition(format!(
                "container {} is not in the created state",
                self.id
            )));
        };
        let pid = match sup.start_engines().await {
            Ok(pid) => pid,
            Err(e) => {
                // Nothing runs; Delete cleans up. Keep the GMS daemon for it.
                if let Some(g) = sup.abandon() {
                    self.made.lock().await.gms = Some(Arc::new(std::sync::Mutex::new(Some(g))));
                }
                return Err(e);
            }
        };
        // Engines that ended before Start replied leave no live pid: the
        // task's is then the engine Create made (and Start started).
        let pid = self.task_pid(pid);
        *self.input.lock().await = Some(sup.input());
        self.events.send(Event::Start(TaskStart {
            container_id: self.id.clone(),
            pid,
            ..Default::default()
        }));
        let gms_slot = Arc::new(std::sync::Mutex::new(None));
        self.made.lock().await.gms = Some(gms_slot.clone());
        tokio::spawn(async move {
            // The daemon comes back to Delete once the pair is gone.
            let gms = sup.run_to_end().await;
            *gms_slot.lock().unwrap_or_else(|p| p.into_inner()) = gms;
        });
        Ok(pid)
    }

    async fn state(&self) -> Result<ProcessState> {
        let v = self.view.borrow().clone();
        Ok(ProcessState {
            pid: self.task_pid(v.pid),
            status: self.status(),
            stdio: self.stdio.clone(),
            exit: v.exit,
        })
    }

    async fn kill(&self, signal: u32, all: bool) -> Result<()> {
        if self.status() == Status::Stopped {
            if all {
                return Ok(());
            }
            return Err(Error::Finished {
                id: self.id.clone(),
                process: "the engine pair".into(),
            });
        }
        Signal::try_from(signal as i32)
            .map_err(|_| Error::InvalidArgument(format!("unknown signal {signal}")))?;
        if self.paused.load(Ordering::Acquire) {
            // A frozen engine acts on no signal (on cgroup v1 not even
            // SIGKILL): a pair being stopped is thawed, so that the
            // engines end and the escalation to SIGKILL can end them.
            self.resume().await?;
        }
        // The input lock is not held while `waiting` is taken: Start takes
        // them in the other order.
        let started = self.input.lock().await.clone();
        let tx = match started {
            Some(tx) => tx,
            None => {
                let mut waiting = self.waiting.lock().await;
                match waiting.as_mut() {
                    // Not started: nothing runs, and the task ends now with
                    // the signal's status; Delete removes the pair.
                    Some(sup) => {
                        sup.end_unstarted(128 + signal, self.created_pid);
                        // The created engine goes too (as runc-v2's
                        // created init dies of the signal); Delete
                        // removes its container.
                        let e = &self.engines[SlotId::BOTH[0].index()];
                        if let Err(err) =
                            e.client.kill(&e.runc_id, libc::SIGKILL as u32, false).await
                        {
                            log::warn!("pair {}: {err}", self.id);
                        }
                        return Ok(());
                    }
                    // Start ran meanwhile (it holds `waiting` until its
                    // sender is in place).
                    None => match self.input.lock().await.clone() {
                        Some(tx) => tx,
                        None => return Ok(()),
                    },
                }
            }
        };
        let _ = tx.send(Input::Kill { signal });
        Ok(())
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
        if matches!(self.status(), Status::Running | Status::Paused) {
            return Err(Error::FailedPrecondition(format!(
                "cannot delete {}: the engine pair is still running",
                self.id
            )));
        }
        let mut deleted = self.deleted.lock().await;
        let exit = self.view.borrow().exit.unwrap_or(ExitInfo {
            pid: self.created_pid,
            status: 128 + libc::SIGKILL as u32,
            at: SystemTime::now(),
        });
        if *deleted {
            return Ok(exit);
        }
        // A pair that never started: its supervisor (and gmsd) go now.
        if let Some(sup) = self.waiting.lock().await.take() {
            if let Some(mut g) = sup.abandon() {
                g.terminate().await;
            }
        }
        for e in self.engines.iter() {
            if let Err(err) = e.client.delete_force(&e.runc_id).await {
                log::warn!("pair {}: {err}", self.id);
            }
        }
        self.made.lock().await.undo().await;
        *deleted = true;
        Ok(exit)
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
        // The task's stdin is the first engine's (see `engine::SharedOutput`).
        if let Some(io) = self.made.lock().await.stdin.as_mut() {
            io.close_stdin();
        }
        Ok(())
    }

    async fn pause(&self) -> Result<()> {
        // `made` is held throughout: one Pause/Resume/Delete at a time.
        let made = self.made.lock().await;
        if self.status() != Status::Running {
            return Err(Error::FailedPrecondition(format!(
                "pair {} is not running",
                self.id
            )));
        }
        let cg = made.cgroup.as_ref().ok_or_else(|| {
            Error::FailedPrecondition(format!("pair {} has no cgroup (deleted)", self.id))
        })?;
        // Both engines stop where they are: the active mid-request, the
        // shadow still parked on the lock. Nothing dies, so the supervisor
        // has nothing to do until Resume.
        cg.freeze().await?;
        self.paused.store(true, Ordering::Release);
        Ok(())
    }

    async fn resume(&self) -> Result<()> {
        let made = self.made.lock().await;
        if self.status() != Status::Paused {
            return Err(Error::FailedPrecondition(format!(
                "pair {} is not paused",
                self.id
            )));
        }
        let cg = made.cgroup.as_ref().ok_or_else(|| {
            Error::FailedPrecondition(format!("pair {} has no cgroup (deleted)", self.id))
        })?;
        cg.thaw()?;
        self.paused.store(false, Ordering::Release);
        Ok(())
    }

    async fn pids(&self) -> Result<Vec<ProcessInfo>> {
        let pids = self.view.borrow().pids;
        // Before Start, the engine created at Create (as runc-v2 lists a
        // created container's init).
        let created = self.status() == Status::Created;
        let mut out = Vec::new();
        for slot in SlotId::BOTH {
            if pids[slot.index()].is_none() && !(created && slot == SlotId::BOTH[0]) {
                continue;
            }
            let e = &self.engines[slot.index()];
            match e.client.ps(&e.runc_id).await {
                Ok(list) => out.extend(list.into_iter().map(|pid| ProcessInfo {
                    pid,
                    ..Default::default()
                })),
                Err(err) => log::debug!("pair {}: ps {}: {err}", self.id, e.runc_id),
            }
        }
        Ok(out)
    }

    async fn update(&self, resources: LinuxResources) -> Result<()> {
        match &self.made.lock().await.cgroup {
            Some(cg) => cg.update(&resources),
            None => Err(Error::FailedPrecondition(format!(
                "pair {} has no cgroup (deleted)",
                self.id
            ))),
        }
    }

    async fn stats(&self) -> Result<Any> {
        // The pair's cgroup exists from Create: before Start it reads as
        // empty, as a created runc container's does.
        match &self.made.lock().await.cgroup {
            Some(cg) => cg.stats(),
            None => Err(Error::FailedPrecondition(format!(
                "pair {} has no cgroup (deleted)",
                self.id
            ))),
        }
    }
}
