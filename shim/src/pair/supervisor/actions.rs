//! Carrying out what the pair decides: each `shadow_pair::Action` becomes
//! a spawn, a timer, a signal, a gmsd restart, a promotion record or the
//! pair's end, through the [`Host`](super::super::host::Host). Actions that
//! lead to more events (a failed gmsd restart) are carried out in order.

use std::collections::VecDeque;

use nix::sys::signal::Signal;
use shadow_pair::{Action, Event as PairEvent, SlotId};
use tokio::time::Instant;

use super::super::input::Input;
use super::Supervisor;

impl Supervisor {
    /// Carries out actions (and those they lead to); true once the pair is gone.
    pub(super) async fn carry_out(&mut self, actions: Vec<Action>) -> bool {
        let mut queue: VecDeque<Action> = actions.into();
        while let Some(action) = queue.pop_front() {
            match action {
                Action::Spawn { slot } => self.spawn(slot),
                Action::SpawnAfter { slot, delay } => {
                    log::info!(
                        "pair {}: slot {slot} respawns in {} ms",
                        self.id,
                        delay.as_millis()
                    );
                    let tx = self.tx.clone();
                    tokio::spawn(async move {
                        tokio::time::sleep(delay).await;
                        let _ = tx.send(Input::Backoff { slot }).await;
                    });
                }
                Action::KillAll => {
                    let sig = match self.stop_signal {
                        Some(s) if self.pair.is_ending() => {
                            Signal::try_from(s as i32).unwrap_or(Signal::SIGKILL)
                        }
                        _ => Signal::SIGKILL,
                    };
                    self.kill_all(sig);
                }
                Action::Kill { slot } => {
                    if let Some(pid) = self.pair.slot(slot).pid {
                        log::info!("pair {}: slot {slot} pid {pid} killed on arrival", self.id);
                        self.host.signal(pid, Signal::SIGKILL);
                    }
                }
                Action::RestartGms => {
                    if let Some(g) = self.made.gms.as_mut() {
                        match g.restart().await {
                            Ok(()) => g.watch(&self.router, &self.tx),
                            Err(e) => {
                                // A failed cold restart, judged by the
                                // restart budget: backoff, then a crash
                                // loop. The spawns queued behind this are
                                // killed as they land.
                                log::error!("pair {}: restarting gmsd: {e}", self.id);
                                let now = self.clock.now();
                                queue.extend(self.pair.handle(PairEvent::GmsStartFailed, now));
                            }
                        }
                    }
                }
                Action::RestartGmsAfter { delay } => {
                    log::warn!(
                        "pair {}: cold restart in {} ms (restart backoff)",
                        self.id,
                        delay.as_millis()
                    );
                    let tx = self.tx.clone();
                    tokio::spawn(async move {
                        tokio::time::sleep(delay).await;
                        let _ = tx.send(Input::ColdRestartDue).await;
                    });
                }
                Action::Promoted(p) => self.publisher.record(p),
                Action::Exit { status } => {
                    self.finish(status).await;
                    return true;
                }
            }
        }
        false
    }

    /// Start the engine of `slot` in the background; `Input::Spawned` reports it.
    fn spawn(&mut self, slot: SlotId) {
        let generation = self.pair.slot(slot).generation;
        self.spawned_at[slot.index()] = Instant::now();
        let host = self.host.clone();
        let tx = self.tx.clone();
        tokio::spawn(async move {
            let result = host.spawn(slot).await.map_err(|e| e.to_string());
            let _ = tx
                .send(Input::Spawned {
                    slot,
                    generation,
                    result,
                })
                .await;
        });
    }
}
