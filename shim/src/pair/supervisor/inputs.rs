//! What the supervisor does with what its observers report (spawns,
//! reaps, notify datagrams, lock closes and polls, XIDs, gmsd deaths and
//! timers): each input becomes events of the pair, stamped where it was
//! observed. The actions those return are the caller's to carry out.

use nix::sys::signal::Signal;
use shadow_pair::{
    parse_notify, Action, Event as PairEvent, LockHolder, LockWatch, Notification, SlotId,
};
use tokio::time::Instant;

use super::super::input::Input;
use super::super::lock::LockSeen;
use super::super::notify::{Datagram, SenderSlot};
use super::super::observe;
use super::super::probe::Outcome;
use super::{Supervisor, REFUSED_LOG_PERIOD};

impl Supervisor {
    /// A Kill of the running pair. Every Kill reaches the engines at once,
    /// as under runc-v2: CRI follows its SIGTERM with a SIGKILL after its
    /// own grace period, which must not wait for ours. The latest signal is
    /// also the one a respawn that lands afterwards gets.
    pub(super) fn stop(&mut self, signal: Signal) -> Vec<Action> {
        self.kill_all(signal);
        let first = self.stop_signal.is_none();
        self.stop_signal = Some(signal as i32 as u32);
        if first && signal != Signal::SIGKILL {
            let tx = self.tx.clone();
            let grace = self.config.stop_grace();
            tokio::spawn(async move {
                tokio::time::sleep(grace).await;
                let _ = tx.send(Input::Escalate).await;
            });
        }
        let now = self.clock.now();
        self.pair.handle(PairEvent::Stop, now)
    }

    /// A `READY=1` from an engine that did not hold the election lock was
    /// refused: say so, at most every [`REFUSED_LOG_PERIOD`].
    fn log_refused_ready(&mut self, slot: SlotId, pid: u32, holder: Option<LockHolder>) {
        let total = self.pair.ready_refused();
        let now = Instant::now();
        if let Some((at, _)) = self.refused_logged {
            if now.duration_since(at) < REFUSED_LOG_PERIOD {
                return;
            }
        }
        let since = total - self.refused_logged.map_or(0, |(_, n)| n);
        let held = match holder {
            Some(LockHolder::Slot(s)) => format!("slot {s}"),
            Some(LockHolder::Free) => "nobody".to_owned(),
            Some(LockHolder::Unknown) | None => "no engine seen".to_owned(),
        };
        log::warn!(
            "pair {}: ignored READY=1 from slot {slot} (pid {pid}): it does not hold the election lock (held by {held}); {since} refused since the last report, {total} in all",
            self.id
        );
        self.refused_logged = Some((now, total));
    }

    /// Who holds the election lock, as a `READY=1` from `pid` of `slot`
    /// is judged: that process (or its child) seen holding it through a
    /// descriptor of its own, or else what `/proc/locks` says.
    async fn lock_holder(&self, slot: SlotId, pid: u32) -> LockHolder {
        if self.host.lock_held_by(pid) == Some(true) {
            return LockHolder::Slot(slot);
        }
        self.host.lock().await.seen.holder()
    }

    /// A close of the lock file: if it was the active engine's lock going
    /// (its process seen holding it no more, a look that needs no
    /// `/proc/locks`), connections wait in the store for the next proven
    /// holder rather than go to an engine that died.
    fn lock_closed_handoff(&self) {
        let Some(h) = self.keeper.as_ref().filter(|k| k.hands()) else {
            return;
        };
        let Some(active) = self.pair.active() else {
            return;
        };
        let Some(pid) = self.pair.slot(active).pid else {
            return;
        };
        if self.host.lock_held_by(pid) == Some(false) {
            h.lock_lost(active);
        }
    }

    pub(super) async fn poll_lock(&mut self) -> Vec<Action> {
        self.lock_polled = Instant::now();
        if self.pair.lock_watch() == LockWatch::Off {
            return Vec::new();
        }
        // Dated when the look is over: a read of /proc/locks can take
        // milliseconds (an RCU grace period, and the blocking pool's turn),
        // and a lock seen taken at its end may have changed hands after it
        // began. Dated at its start, a takeover was once recorded 3 ms
        // before the kill that caused it (tests/tests/shadows.rs).
        let look = self.host.lock().await;
        let now = self.clock.now();
        let mut actions = Vec::new();
        for slot in self.pair.slot_ids() {
            if look.waiting.get(slot.index()).copied().unwrap_or(false) {
                actions.extend(self.pair.handle(PairEvent::LockWaiting { slot }, now));
            }
        }
        actions.extend(match look.seen {
            LockSeen::Held(slot) => self.pair.handle(PairEvent::LockHeld { slot }, now),
            LockSeen::Free => self.pair.handle(PairEvent::LockFree, now),
            LockSeen::Unknown => Vec::new(),
        });
        actions
    }

    pub(super) fn on_spawned(
        &mut self,
        slot: SlotId,
        generation: u32,
        result: std::result::Result<u32, String>,
    ) -> Vec<Action> {
        let ours = self.pair.awaits_pid(slot, generation);
        match result {
            Ok(pid) if !ours => {
                log::warn!(
                    "pair {}: stale engine pid {pid} of slot {slot}: killing it",
                    self.id
                );
                self.host.signal(pid, Signal::SIGKILL);
                Vec::new()
            }
            Ok(pid) => {
                observe::exit(self.host.as_ref(), slot, pid, self.tx.clone());
                log::info!(
                    "pair {}: slot {slot} generation {generation} runs as pid {pid}",
                    self.id
                );
                let now = self.clock.now();
                self.pair.handle(PairEvent::Spawned { slot, pid }, now)
            }
            Err(e) => {
                log::warn!("pair {}: spawning slot {slot}: {e}", self.id);
                if ours {
                    let now = self.clock.now();
                    self.pair.handle(PairEvent::SpawnFailed { slot }, now)
                } else {
                    Vec::new()
                }
            }
        }
    }

    /// The slot of a datagram's sender: the one the notify gate looked up,
    /// unless that lookup is not later than the ask for the slot's current
    /// engine (the gate keeps lookups a while, and a pid of the engine
    /// before may be in its queue): then it is looked up again, and a dead
    /// pid is nobody's.
    fn sender_slot(&self, d: &Datagram, seen: SenderSlot) -> Option<SlotId> {
        if seen.looked_up > self.spawned_at[seen.slot.index()] {
            Some(seen.slot)
        } else {
            self.host.slot_of_pid(d.pid)
        }
    }

    pub(super) async fn on_input(&mut self, input: Input) -> Vec<Action> {
        match input {
            Input::Spawned {
                slot,
                generation,
                result,
            } => self.on_spawned(slot, generation, result),
            Input::Exited {
                slot,
                pid,
                status,
                at,
            } => {
                if self.pair.slot(slot).pid != Some(pid) {
                    return Vec::new();
                }
                let exit = observe::exit_of(status);
                log::info!("pair {}: slot {slot} pid {pid} exited ({exit:?})", self.id);
                if let Some(k) = &self.keeper {
                    k.died(slot);
                }
                // In the host's PID namespace the engine's other processes
                // outlive it: they go before its death is decided on (and
                // before the task's exit, if this was the last engine).
                self.host.kill_rest(slot).await;
                let reaped = self.clock.since(at);
                let mut actions = Vec::new();
                // The kernel counts the kill before it sends SIGKILL, so the
                // count is there at the reap (and until runc deletes the
                // engine's cgroup, which the respawn does after this).
                let oom_kills = self.host.oom_kills(slot);
                if oom_kills > 0 {
                    log::warn!(
                        "pair {}: slot {slot} pid {pid}: the OOM killer killed {oom_kills} of its processes",
                        self.id
                    );
                    actions.extend(self.pair.handle(PairEvent::OomKilled { slot }, reaped));
                }
                actions.extend(self.pair.handle(PairEvent::Exited { slot, exit }, reaped));
                actions
            }
            Input::Notify {
                datagram: d,
                at,
                slot,
            } => {
                self.notify_queue.taken();
                let Some(slot) = self.sender_slot(&d, slot) else {
                    log::debug!("pair {}: notify from pid {} of no engine", self.id, d.pid);
                    return Vec::new();
                };
                let now = self.clock.since(at);
                let mut actions = Vec::new();
                // Read at most once per datagram, and only for a READY=1
                // that would make a new engine active.
                let mut holder = None;
                for notification in parse_notify(&d.bytes) {
                    let event = if notification == Notification::Ready
                        && self.pair.ready_needs_proof(slot)
                    {
                        let holder = match holder {
                            Some(h) => h,
                            None => *holder.insert(self.lock_holder(slot, d.pid).await),
                        };
                        PairEvent::Ready { slot, holder }
                    } else {
                        PairEvent::Notified { slot, notification }
                    };
                    let refused = self.pair.ready_refused();
                    actions.extend(self.pair.handle(event, now));
                    if self.pair.ready_refused() > refused {
                        self.log_refused_ready(slot, d.pid, holder);
                    }
                }
                actions
            }
            // Written by the `publish` that follows this input, or when due.
            Input::NotifyDropped | Input::StoreMoved => Vec::new(),
            Input::NotifyStalled { slot, stalled } => {
                if stalled {
                    // The gate logs the flood itself (every LOG_EVERY).
                    log::debug!(
                        "pair {}: slot {slot}'s notify reader pauses on a flood; its watchdog is not judged until it reads again",
                        self.id
                    );
                }
                let event = if stalled {
                    PairEvent::NotifyStalled { slot }
                } else {
                    PairEvent::NotifyResumed { slot }
                };
                let now = self.clock.now();
                self.pair.handle(event, now)
            }
            Input::LockClosed(at) => {
                // Whose close it was, the pair learns from what follows:
                // reading /proc/locks now would stall on the exiting
                // engine (measured: 6-15 ms added to READY and the reap).
                let now = self.clock.since(at);
                self.lock_closed_handoff();
                self.pair.handle(PairEvent::LockClosed, now)
            }
            Input::Backoff { slot } => {
                let now = self.clock.now();
                self.pair.handle(PairEvent::BackoffElapsed { slot }, now)
            }
            Input::Escalate => {
                self.kill_all(Signal::SIGKILL);
                Vec::new()
            }
            Input::Xid(xid) => {
                log::warn!(
                    "pair {}: XID {xid} on a GPU of the pair ({:?})",
                    self.id,
                    shadow_pair::XidClass::of(xid)
                );
                let now = self.clock.now();
                self.pair.handle(PairEvent::Xid(xid), now)
            }
            Input::ColdRestartDue => {
                let now = self.clock.now();
                self.pair.handle(PairEvent::ColdRestartDue, now)
            }
            Input::Probed {
                slot,
                generation,
                outcome,
            } => self.on_probed(slot, generation, outcome),
            Input::GmsDied { index, generation } => {
                let Some(g) = self
                    .made
                    .gms
                    .as_ref()
                    .and_then(|g| g.daemon(index))
                    .filter(|g| g.generation() == generation)
                else {
                    return Vec::new();
                };
                let device = g.name().to_string();
                log::warn!(
                    "pair {}: gmsd of {device} died: cold restart of the pair",
                    self.id
                );
                let now = self.clock.now();
                self.pair.handle(PairEvent::GmsDied { device }, now)
            }
        }
    }

    /// A probe's outcome: the pair counts it (for the engine and
    /// generation it was for); the log says when a streak of failures
    /// begins and ends, not each failure.
    fn on_probed(&mut self, slot: SlotId, generation: u32, outcome: Outcome) -> Vec<Action> {
        let Some(p) = self.probing.as_mut() else {
            return Vec::new();
        };
        p.in_flight = false;
        let ours = p.target == Some((slot, generation));
        let healthy = outcome.is_healthy();
        if ours {
            match outcome {
                Outcome::Healthy => {
                    if p.failing > 0 {
                        log::info!(
                            "pair {}: probe {} of slot {slot} healthy again after {} failures",
                            self.id,
                            p.settings.target,
                            p.failing
                        );
                    }
                    p.failing = 0;
                }
                Outcome::Unhealthy(why) => {
                    p.failing += 1;
                    if p.failing == 1 {
                        log::warn!(
                            "pair {}: probe {} of slot {slot} failed: {why} (1 of {} in a row ends the engine)",
                            self.id,
                            p.settings.target,
                            p.settings.failures
                        );
                    }
                    p.last_failure = why;
                }
            }
        }
        let now = self.clock.now();
        let actions = self.pair.handle(
            PairEvent::Probed {
                slot,
                generation,
                healthy,
            },
            now,
        );
        // The next probe may be due already (this one took its timeout).
        self.launch_probe();
        actions
    }

    /// Signal every engine whose pid is known; one still being spawned is
    /// killed when its spawn is reported (the pair answers `Kill`).
    pub(super) fn kill_all(&self, sig: Signal) {
        for slot in self.pair.slot_ids() {
            if let Some(pid) = self.pair.slot(slot).pid {
                self.host.signal(pid, sig);
            }
        }
    }
}
