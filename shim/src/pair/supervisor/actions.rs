//! Carrying out what the pair decides: each `shadow_pair::Action` becomes
//! a spawn, a timer, a signal, a gmsd restart, a promotion record or the
//! pair's end, through the [`Host`](super::super::host::Host). Actions that
//! lead to more events (a failed gmsd restart) are carried out in order.

use std::collections::VecDeque;

use nix::sys::signal::Signal;
use shadow_pair::{Action, Event as PairEvent, HangCause, SlotId};
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
                    let pid = self.pair.slot(slot).pid;
                    match self.pair.hang_of(slot) {
                        Some(h) => log::warn!(
                            "pair {}: slot {slot} pid {} hung: {}; killing every process of it",
                            self.id,
                            pid.map_or("-".to_string(), |p| p.to_string()),
                            self.why_hung(h.cause, slot)
                        ),
                        None => log::info!(
                            "pair {}: slot {slot} pid {pid:?} killed on arrival",
                            self.id
                        ),
                    }
                    self.host.kill_engine(slot, pid);
                    let now = self.clock.now();
                    queue.extend(self.pair.handle(PairEvent::Killed { slot }, now));
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

    /// Why the engine of `slot` was found hung, in words for the log.
    fn why_hung(&self, cause: HangCause, slot: SlotId) -> String {
        let ms = |d: std::time::Duration| format!("{} ms", d.as_millis());
        match cause {
            HangCause::Watchdog => format!(
                "no WATCHDOG=1 within its watchdog interval ({})",
                self.pair.watchdog_interval(slot).map_or("-".into(), ms)
            ),
            HangCause::Trigger => "it sent WATCHDOG=trigger".into(),
            HangCause::Probe => match &self.probing {
                Some(p) => format!(
                    "{} probes of {} failed in a row (the last: {})",
                    p.settings.failures, p.settings.target, p.last_failure
                ),
                None => "its probes failed".into(),
            },
            HangCause::StartTimeout => format!(
                "it neither parked nor served within its start timeout ({}, or as EXTEND_TIMEOUT_USEC= extended it)",
                shadow_contract::hang::Written(self.start_timeout)
            ),
        }
    }

    /// Start the engine of `slot` in the background; `Input::Spawned` reports it.
    fn spawn(&mut self, slot: SlotId) {
        let generation = self.pair.slot(slot).generation;
        self.spawned_at[slot.index()] = Instant::now();
        let (host, give) = (self.host.clone(), self.passing.clone());
        let tx = self.tx.clone();
        tokio::spawn(async move {
            let result = host
                .spawn(slot, give.as_ref())
                .await
                .map_err(|e| e.to_string());
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
