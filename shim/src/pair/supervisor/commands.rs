//! The supervisor's answers to the Task service: each [`Command`] is
//! decided against the pair's [`Phase`], by the one task that owns the
//! pair, so that no two calls race over its parts (a Kill and a Start, a
//! Pause and a Delete, a Delete and a gmsd restart).

use std::ops::ControlFlow;
use std::time::SystemTime;

use containerd_shim_protos::types::task::ProcessInfo;
use nix::sys::signal::Signal;
use shadow_pair::SlotId;

use super::super::cgroup::PairCgroup;
use super::super::command::{Command, Reply};
use super::{Phase, Supervisor};
use crate::error::{Error, Result};
use crate::status::ExitInfo;

impl Supervisor {
    /// Answer `command`; `Break` once the pair is deleted (the supervisor
    /// then ends).
    pub(super) async fn on_command(&mut self, command: Command) -> ControlFlow<()> {
        match command {
            Command::Start(reply) => {
                let started = self.start().await;
                let _ = reply.send(started);
            }
            Command::Kill { signal, all, reply } => {
                let killed = self.kill(signal, all).await;
                let _ = reply.send(killed);
            }
            Command::Pause(reply) => {
                let paused = self.pause().await;
                let _ = reply.send(paused);
            }
            Command::Resume(reply) => {
                let _ = reply.send(self.resume());
            }
            Command::Update(resources, reply) => {
                let _ = reply.send(self.cgroup().and_then(|cg| cg.update(&resources)));
            }
            Command::Stats(reply) => {
                let _ = reply.send(self.cgroup().and_then(PairCgroup::stats));
            }
            Command::Pids(reply) => self.pids(reply),
            Command::CloseIo(reply) => {
                // The task's stdin is the first engine's (see `engine::SharedOutput`).
                if let Some(io) = self.made.stdin.as_mut() {
                    io.close_stdin();
                }
                let _ = reply.send(Ok(()));
            }
            Command::Delete(reply) => match self.delete().await {
                Ok(exit) => {
                    let _ = reply.send(Ok(exit));
                    return ControlFlow::Break(());
                }
                Err(e) => {
                    let _ = reply.send(Err(e));
                }
            },
        }
        ControlFlow::Continue(())
    }

    async fn kill(&mut self, signal: u32, all: bool) -> Result<()> {
        if matches!(self.phase, Phase::Exited | Phase::Killed) {
            if all {
                return Ok(());
            }
            return Err(Error::Finished {
                id: self.id.clone(),
                process: "the engine pair".into(),
            });
        }
        let sig = Signal::try_from(signal as i32)
            .map_err(|_| Error::InvalidArgument(format!("unknown signal {signal}")))?;
        match self.phase {
            // Nothing runs, and the task ends now with the signal's status;
            // Delete removes the pair.
            Phase::Created => {
                self.end_unstarted(128 + signal).await;
                self.phase = Phase::Killed;
            }
            // A Start that failed left nothing running.
            Phase::StartFailed | Phase::Exited | Phase::Killed => {}
            Phase::Running => {
                if self.paused {
                    // A frozen engine acts on no signal (on cgroup v1 not
                    // even SIGKILL): a pair being stopped is thawed, so that
                    // the engines end and the escalation to SIGKILL can end
                    // them.
                    self.resume()?;
                }
                let actions = self.stop(sig);
                self.carry_out(actions).await;
                if self.phase == Phase::Running {
                    self.publish(false);
                }
            }
        }
        Ok(())
    }

    /// The pair's cgroup: from Create to Delete.
    fn cgroup(&self) -> Result<&PairCgroup> {
        self.made.cgroup.as_ref().ok_or_else(|| {
            Error::FailedPrecondition(format!("pair {} has no cgroup (deleted)", self.id))
        })
    }

    async fn pause(&mut self) -> Result<()> {
        if self.phase != Phase::Running || self.paused {
            return Err(Error::FailedPrecondition(format!(
                "pair {} is not running",
                self.id
            )));
        }
        // Both engines stop where they are: the active mid-request, the
        // shadow still parked on the lock. Nothing dies, so there is
        // nothing to decide until Resume.
        self.cgroup()?.freeze().await?;
        self.paused = true;
        self.publisher.set_paused(true);
        let now = self.clock.now();
        self.pair.handle(shadow_pair::Event::Paused, now);
        Ok(())
    }

    fn resume(&mut self) -> Result<()> {
        if self.phase != Phase::Running || !self.paused {
            return Err(Error::FailedPrecondition(format!(
                "pair {} is not paused",
                self.id
            )));
        }
        self.cgroup()?.thaw()?;
        self.paused = false;
        self.publisher.set_paused(false);
        let now = self.clock.now();
        self.pair.handle(shadow_pair::Event::Resumed, now);
        Ok(())
    }

    /// The processes of the engines that run; before Start, of the engine
    /// created at Create (as runc-v2 lists a created container's init).
    /// runc is asked off the supervisor's task: a `runc ps` never delays a
    /// failover.
    fn pids(&self, reply: Reply<Vec<ProcessInfo>>) {
        let created = matches!(self.phase, Phase::Created | Phase::StartFailed);
        let slots: Vec<SlotId> = self
            .pair
            .slot_ids()
            .filter(|&s| self.pair.slot(s).pid.is_some() || (created && s == SlotId::ZERO))
            .collect();
        let host = self.host.clone();
        let id = self.id.clone();
        tokio::spawn(async move {
            let mut out = Vec::new();
            for slot in slots {
                match host.ps(slot).await {
                    Ok(list) => out.extend(list.into_iter().map(|pid| ProcessInfo {
                        pid,
                        ..Default::default()
                    })),
                    Err(err) => log::debug!("pair {id}: ps of slot {slot}: {err}"),
                }
            }
            let _ = reply.send(Ok(out));
        });
    }

    /// Remove the pair: its engines' containers, then everything Create
    /// made (gmsds included: they outlive the engines until here, so that
    /// a pair's memory is never freed under an engine that might use it).
    async fn delete(&mut self) -> Result<ExitInfo> {
        if self.phase == Phase::Running {
            return Err(Error::FailedPrecondition(format!(
                "cannot delete {}: the engine pair is still running",
                self.id
            )));
        }
        let exit = self.publisher.view().exit.unwrap_or(ExitInfo {
            pid: self.publisher.last_pid(),
            status: 128 + libc::SIGKILL as u32,
            at: SystemTime::now(),
        });
        // A pair that never ran closes its output here.
        self.output.close();
        for slot in self.pair.slot_ids() {
            self.host.remove(slot).await;
        }
        self.made.undo().await;
        log::info!("pair {}: deleted", self.id);
        Ok(exit)
    }
}
