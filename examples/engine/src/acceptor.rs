//! The serving loop: for each idle worker, the next resumed connection or
//! a new one, accepted (and stored with its state at once) or handed over
//! by the runtime, with the watchdog's pings between.

use std::collections::VecDeque;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::mpsc;
use std::time::Duration;

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use shadow_engine::promotion::{Part, Timeline};

use crate::conn::{self, Conn};
use crate::continuity::{self, Link};
use crate::live::{ping, Live};
use crate::worker::Job;

/// `poll`'s timeout for `wait`, rounded up to a whole millisecond so that
/// a wait shorter than one does not spin (None: forever).
fn poll_timeout(wait: Option<Duration>) -> PollTimeout {
    match wait {
        None => PollTimeout::NONE,
        Some(d) => {
            let ms = d.as_micros().div_ceil(1000);
            PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX)
        }
    }
}

/// How often the acceptor looks for the takeover's jobs while they are
/// being fetched.
const TAKEOVER_LOOK: Duration = Duration::from_millis(1);

/// The serving loop: waits for an idle worker, hands it the next resumed
/// connection, else accepts one for it (stored at once with its state
/// when there is a `keeper`); between these, and at least each half
/// interval, it pings when the workers' progress allows.
pub fn accept_loop(
    listener: BorrowedFd<'_>,
    handed: bool,
    to_workers: &mpsc::Sender<Job>,
    live: &Live,
    taken_over: mpsc::Receiver<VecDeque<Job>>,
    mut keeper: Option<continuity::Keeper>,
    promoted: &Timeline,
) {
    promoted.mark(Part::Serving);
    let mut resumed = VecDeque::new();
    // Until the takeover's jobs are here: looked for at least each
    // millisecond.
    let mut awaiting = true;
    loop {
        if awaiting {
            match taken_over.try_recv() {
                Ok(jobs) => {
                    resumed.extend(jobs);
                    awaiting = false;
                }
                Err(mpsc::TryRecvError::Empty) => {}
                Err(mpsc::TryRecvError::Disconnected) => awaiting = false,
            }
        }
        {
            let mut st = live.lock();
            while st.idle == 0 {
                st = match st.wait() {
                    None => live.freed.wait(st).unwrap_or_else(|e| e.into_inner()),
                    Some(t) => {
                        let st = live.freed.wait_timeout(st, t);
                        st.unwrap_or_else(|e| e.into_inner()).0
                    }
                };
                if st.take_ping() {
                    ping();
                }
            }
        }
        if let Some(job) = resumed.pop_front() {
            live.lock().idle -= 1;
            if to_workers.send(job).is_err() {
                return; // every worker is gone
            }
            continue;
        }
        if let Some(k) = keeper.as_mut() {
            k.prepare();
        }
        let mut fds = [PollFd::new(listener, PollFlags::POLLIN)];
        // EINTR or a timeout: the tick below, then again.
        let wait = match (live.wait(), awaiting) {
            (w, false) => w,
            (None, true) => Some(TAKEOVER_LOOK),
            (Some(w), true) => Some(w.min(TAKEOVER_LOOK)),
        };
        if poll(&mut fds, poll_timeout(wait)).is_ok_and(|n| n > 0) {
            // accept errors (ECONNABORTED, EMFILE) concern one peer.
            match next_connection(listener, handed, keeper.as_mut(), promoted) {
                Ok((fd, link)) => match Conn::from_fd(fd) {
                    Ok(conn) => {
                        live.lock().idle -= 1;
                        if to_workers.send(Job::Fresh(conn, link)).is_err() {
                            return; // every worker is gone
                        }
                    }
                    Err(_) => link.drop_entry(),
                },
                // Nothing will come again: the engine ends.
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                    eprintln!("shadow-engine: {e}: exiting");
                    std::process::exit(1);
                }
                Err(_) => {}
            }
        }
        live.tick();
    }
}

/// The next connection and its link to the store: handed over by the
/// runtime (stored already, under its name: this engine stores its state
/// memfd beside it), or accepted and stored first (until the store holds
/// it, the connection dies with this engine).
fn next_connection(
    listener: BorrowedFd<'_>,
    handed: bool,
    keeper: Option<&mut continuity::Keeper>,
    promoted: &Timeline,
) -> std::io::Result<(OwnedFd, Link)> {
    if handed {
        let h = shadow_engine_kit::handoff::receive(listener)?.ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the runtime closed the hand-off socket",
            )
        })?;
        promoted.mark(Part::Accepted);
        let link = match keeper {
            Some(k) => k.keep_handed(h.name),
            None => Link::handed(h.name, None),
        };
        promoted.mark(Part::Stored);
        return Ok((h.conn, link));
    }
    let fd = conn::accept(listener)?;
    promoted.mark(Part::Accepted);
    let link = match keeper {
        Some(k) => k.keep(fd.as_fd()),
        None => Link::new(None),
    };
    promoted.mark(Part::Stored);
    Ok((fd, link))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poll_timeouts_round_up() {
        assert_eq!(poll_timeout(None), PollTimeout::NONE);
        assert_eq!(poll_timeout(Some(Duration::ZERO)), PollTimeout::from(0u16));
        assert_eq!(
            poll_timeout(Some(Duration::from_micros(1))),
            PollTimeout::from(1u16)
        );
        assert_eq!(
            poll_timeout(Some(Duration::from_micros(2001))),
            PollTimeout::from(3u16)
        );
        assert_eq!(
            poll_timeout(Some(Duration::from_secs(u64::MAX))),
            PollTimeout::MAX
        );
    }
}
