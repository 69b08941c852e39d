//! The workers as the watchdog sees them: which are computing an answer
//! and whether each made a decode step since the last ping (a stuck one
//! holds the pings back, so the runtime ends the engine), and how many are
//! idle (the acceptor accepts only for an idle worker). Pings are sent
//! from the loops that work, never from a timer.

use std::os::unix::net::UnixDatagram;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use shadow_contract::env;
use shadow_engine_kit::watchdog::{Pacer, Progress};

/// Threads answering connections.
pub const WORKERS: usize = 4;

/// Sends `WATCHDOG=1` without ever blocking: a full notify socket (a
/// runtime that is not reading) loses the ping instead of stalling the loop
/// that sends it, as the socket's own gate drops what goes beyond its rate.
pub fn ping() {
    let Some(path) = std::env::var_os(env::NOTIFY_SOCKET) else {
        return;
    };
    let Ok(sock) = UnixDatagram::unbound() else {
        return;
    };
    if sock.set_nonblocking(true).is_ok() {
        let _ = sock.send_to(b"WATCHDOG=1\n", path);
    }
}

/// What the watchdog needs to know of the workers, and the count of idle
/// ones (the acceptor accepts only for an idle worker, so that connections
/// beyond them wait in the listening socket's backlog, which outlives this
/// engine, rather than in this process).
pub struct Live {
    pub state: Mutex<LiveState>,
    /// A worker became idle.
    pub freed: Condvar,
}

pub struct LiveState {
    /// None: no watchdog.
    pub pacer: Option<Pacer>,
    /// Which workers advanced since the last ping.
    pub progress: Progress,
    /// Which workers are computing an answer (only those can be stuck).
    pub computing: [bool; WORKERS],
    pub idle: usize,
}

impl Live {
    pub fn new(pacer: Option<Pacer>) -> Live {
        Live {
            state: Mutex::new(LiveState {
                pacer,
                progress: Progress::new(WORKERS),
                computing: [false; WORKERS],
                idle: WORKERS,
            }),
            freed: Condvar::new(),
        }
    }

    pub fn lock(&self) -> MutexGuard<'_, LiveState> {
        // A panicked worker poisons nothing that matters here: counts and flags.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// How long the acceptor may block before a ping is due (None: forever).
    pub fn wait(&self) -> Option<Duration> {
        self.lock().wait()
    }

    /// Pings if one is due and every computing worker advanced.
    pub fn tick(&self) {
        let due = self.lock().take_ping();
        if due {
            ping();
        }
    }

    /// Runs `f` as worker `worker`'s computation of an answer, given a
    /// step hook: each call marks a decode step done (and may ping).
    pub fn computing<R>(&self, worker: usize, f: impl FnOnce(&mut dyn FnMut()) -> R) -> R {
        self.lock().computing[worker] = true;
        let out = f(&mut || {
            let due = self.lock().stepped(worker);
            if due {
                ping();
            }
        });
        let mut st = self.lock();
        st.computing[worker] = false;
        st.progress.advanced(worker);
        out
    }

    /// Runs `f`, a wait of worker `worker` on its client (writing to it),
    /// inside a computation: the worker is not computing meanwhile, so a
    /// slow client never holds the pings back; then it is as before (and,
    /// computing, must step again before the next ping).
    pub fn waiting<R>(&self, worker: usize, f: impl FnOnce() -> R) -> R {
        let was = std::mem::replace(&mut self.lock().computing[worker], false);
        let out = f();
        self.lock().computing[worker] = was;
        out
    }

    /// A worker is done with its connection.
    pub fn idle(&self) {
        self.lock().idle += 1;
        self.freed.notify_one();
    }
}

impl LiveState {
    /// How long the acceptor may block: until the next ping is due; once
    /// it is due but a computing worker has not stepped yet, an eighth of
    /// the interval (that worker's next step pings by itself). Never zero:
    /// a zero wait would spin on this lock against the workers' steps, and
    /// under load starve them into a missed ping.
    pub fn wait(&self) -> Option<Duration> {
        self.pacer.as_ref().map(|p| {
            let w = p.wait(Instant::now());
            if w.is_zero() {
                (p.interval() / 8).max(Duration::from_millis(1))
            } else {
                w
            }
        })
    }

    /// `worker` made a decode step; whether to ping now, as [`take_ping`](Self::take_ping).
    fn stepped(&mut self, worker: usize) -> bool {
        self.progress.advanced(worker);
        self.take_ping()
    }

    /// Whether to ping now (and, if so, records it): due, and every worker
    /// either not computing or past a step since the last ping.
    pub fn take_ping(&mut self) -> bool {
        let now = Instant::now();
        let Some(pacer) = self.pacer.as_mut() else {
            return false;
        };
        if !pacer.due(now) {
            return false;
        }
        for (w, &busy) in self.computing.iter().enumerate() {
            if !busy {
                self.progress.advanced(w);
            }
        }
        if !self.progress.all_advanced() {
            return false;
        }
        pacer.pinged(now);
        self.progress.reset();
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A watchdog always due (an interval too short to halve): only the
    /// workers' progress decides.
    fn always_due() -> Live {
        Live::new(Some(Pacer::new(Duration::from_nanos(1))))
    }

    #[test]
    fn idle_workers_never_hold_a_ping_back() {
        let live = always_due();
        assert!(live.lock().take_ping());
        assert!(live.lock().take_ping());
        let none = Live::new(None);
        assert!(!none.lock().take_ping(), "no watchdog, no ping");
        assert_eq!(none.wait(), None);
    }

    #[test]
    fn a_computing_worker_must_step_before_the_next_ping() {
        let live = always_due();
        assert!(live.lock().take_ping());
        live.computing(2, |_| {
            assert!(
                !live.lock().take_ping(),
                "no step yet: worker 2 may be stuck"
            );
            assert!(live.lock().stepped(2), "its step was the one missing");
            assert!(!live.lock().take_ping(), "and each ping needs another");
            assert!(live.lock().stepped(2));
        });
        // Done computing: idle again, never in the way.
        assert!(live.lock().take_ping());
        assert!(live.lock().take_ping());
    }

    #[test]
    fn a_stuck_worker_stops_the_pings_while_others_step() {
        let live = always_due();
        live.computing(0, |_| {
            assert!(live.lock().stepped(0));
            // Worker 0 is stuck from here on; worker 1 steps on.
            live.computing(1, |_| {
                for _ in 0..3 {
                    assert!(!live.lock().stepped(1), "worker 0 made no step since");
                    assert!(!live.lock().take_ping());
                }
            });
        });
        assert!(live.lock().take_ping(), "worker 0 done: the pings resume");
    }

    #[test]
    fn a_worker_waiting_on_its_client_never_holds_a_ping_back() {
        let live = always_due();
        assert!(live.lock().take_ping());
        live.computing(1, |_| {
            assert!(!live.lock().take_ping(), "computing, no step yet");
            // Writing a streamed event to a slow client: not stuck.
            live.waiting(1, || {
                assert!(live.lock().take_ping());
                assert!(live.lock().take_ping());
            });
            // Back to decoding: a step before the next ping, as before.
            assert!(!live.lock().take_ping());
            assert!(live.lock().stepped(1));
        });
        // Outside a computation a wait changes nothing.
        live.waiting(3, || assert!(live.lock().take_ping()));
        assert!(!live.lock().computing[3]);
    }
}
