//! Everything the supervisor asks of the machine, behind one small trait:
//! start an engine, learn when a pid is reaped, signal a pid, and read
//! `/proc` (which slot a pid belongs to, who holds the election lock).
//! [`Machine`] does it with runc, kill(2) and `/proc`; the supervisor's
//! tests use a fake, so the order races of a failover run without root.

use std::sync::Arc;

use async_trait::async_trait;
use nix::sys::signal::Signal;
use nix::unistd::Pid;
use shadow_pair::{FileId, SlotId};
use tokio::sync::oneshot;

use super::engine::{create_engine, run_engine, EngineSlot, SharedOutput};
use super::listen::ListenSockets;
use super::lock::{self, LockLook};
use crate::error::Result;
use crate::exits::{Exit, ExitRouter};

#[async_trait]
pub trait Host: Send + Sync + 'static {
    /// Start the engine of `slot` and return its pid. `fresh`: the slot
    /// never ran, so there is no stopped container to remove first.
    async fn spawn(&self, slot: SlotId, fresh: bool) -> Result<u32>;
    /// The reaped exit of `pid`, stamped when the reaper collected it
    /// (also when that happened before this call).
    fn reaped(&self, pid: u32) -> oneshot::Receiver<Exit>;
    fn signal(&self, pid: u32, signal: Signal);
    /// The slot whose cgroup `pid` is in.
    fn slot_of_pid(&self, pid: u32) -> Option<SlotId>;
    /// Who holds the election lock now, and who waits for it.
    fn lock(&self) -> LockLook;
    /// Processes of the current engine of `slot` that the OOM killer
    /// killed, as its cgroup counts them (a respawn makes a new cgroup).
    fn oom_kills(&self, slot: SlotId) -> u64;
    /// After the main process of `slot`'s engine died: kill what is left
    /// of it when no PID namespace of its own did that already.
    async fn kill_rest(&self, slot: SlotId);
}

/// The real machine: runc for the engines, the shim's exit router, kill(2)
/// and `/proc`.
pub struct Machine {
    pub engines: Arc<[EngineSlot; 2]>,
    pub output: Arc<SharedOutput>,
    pub router: Arc<ExitRouter>,
    pub lock_file: FileId,
    /// The pair's listening sockets, handed to every engine; closed when
    /// the pair (its supervisor) ends.
    pub listen: Option<ListenSockets>,
    cgroups: [String; 2],
    /// Engines created at the task's Create and not yet started, by slot:
    /// their first spawn is `runc start`.
    created: std::sync::Mutex<[Option<u32>; 2]>,
}

impl Machine {
    pub fn new(
        engines: Arc<[EngineSlot; 2]>,
        output: Arc<SharedOutput>,
        router: Arc<ExitRouter>,
        lock_file: FileId,
        listen: Option<ListenSockets>,
    ) -> Self {
        let cgroups = [engines[0].cgroup.clone(), engines[1].cgroup.clone()];
        Machine {
            engines,
            output,
            router,
            lock_file,
            listen,
            cgroups,
            created: std::sync::Mutex::new([None, None]),
        }
    }

    /// `runc create` of `slot`'s engine, at the task's Create: its pid is
    /// the task's until Start, and an engine that cannot run (a missing
    /// binary) fails Create. What a failed create left is removed.
    pub async fn create(&self, slot: SlotId) -> Result<u32> {
        let e = &self.engines[slot.index()];
        match create_engine(e, self.output.clone(), self.listen.as_ref()).await {
            Ok(pid) => {
                self.created.lock().unwrap_or_else(|p| p.into_inner())[slot.index()] = Some(pid);
                Ok(pid)
            }
            Err(err) => {
                if let Err(d) = e.client.delete_force(&e.runc_id).await {
                    log::warn!("{}: removing the failed create: {d}", e.runc_id);
                }
                Err(err)
            }
        }
    }
}

#[async_trait]
impl Host for Machine {
    async fn spawn(&self, slot: SlotId, fresh: bool) -> Result<u32> {
        let created = self.created.lock().unwrap_or_else(|p| p.into_inner())[slot.index()].take();
        if let Some(pid) = created.filter(|_| fresh) {
            let e = &self.engines[slot.index()];
            e.client.start(&e.runc_id).await?;
            return Ok(pid);
        }
        if let Some(l) = &self.listen {
            l.repair();
        }
        run_engine(
            &self.engines[slot.index()],
            self.output.clone(),
            fresh,
            self.listen.as_ref(),
        )
        .await
    }

    fn reaped(&self, pid: u32) -> oneshot::Receiver<Exit> {
        self.router.watch(pid as i32)
    }

    fn signal(&self, pid: u32, signal: Signal) {
        if let Ok(pid) = i32::try_from(pid) {
            if pid > 0 {
                let _ = nix::sys::signal::kill(Pid::from_raw(pid), signal);
            }
        }
    }

    fn slot_of_pid(&self, pid: u32) -> Option<SlotId> {
        lock::slot_of_pid(pid, &self.cgroups)
    }

    fn lock(&self) -> LockLook {
        lock::observe(self.lock_file, &self.cgroups)
    }

    async fn kill_rest(&self, slot: SlotId) {
        let e = &self.engines[slot.index()];
        if !e.kills_rest_on_exit {
            return;
        }
        if let Err(err) = e.client.kill(&e.runc_id, libc::SIGKILL as u32, true).await {
            log::warn!("{}: killing what its main process left: {err}", e.runc_id);
        }
    }

    fn oom_kills(&self, slot: SlotId) -> u64 {
        crate::oom::kills(&crate::stats::at(&self.cgroups[slot.index()]))
    }
}
