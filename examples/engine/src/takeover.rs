//! Takeover: once this engine holds the lock and is ready, what the engine
//! before it left in the pair's fd store (connections, each with the
//! memfd of its state) is fetched and sorted into jobs: requests still
//! unread, answers to go on with, and what is done or beyond resuming.

use std::collections::VecDeque;
use std::io::Write;
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use shadow_engine_kit::fdstore::{self, FetchError, Stored};

use crate::conn::Conn;
use crate::continuity::{self, Link, Progress as Phase, Track, Work};
use crate::worker::{Job, Resumed};

/// What the store holds for a new active engine, fetched (the store
/// answers the lock holder; it may not yet see this engine as one, so a
/// refusal is tried again a few times); without a fetch socket, what this
/// engine was handed at its start.
fn fetch_store(inherited: Vec<Stored>) -> Vec<Stored> {
    for attempt in 1..=5u32 {
        match fdstore::fetch() {
            Ok(got) => return got,
            Err(FetchError::NoStore) => return inherited,
            Err(e) => {
                eprintln!("shadow-engine: fetching the fd store (attempt {attempt}): {e}");
                std::thread::sleep(Duration::from_millis(20 * u64::from(attempt)));
            }
        }
    }
    inherited
}

/// How a takeover went, by kind, for its log line.
#[derive(Default)]
struct Takeover {
    fetched: usize,
    descriptors: usize,
    /// Resumed with no request recorded: served as new connections.
    fresh: usize,
    /// Plain answers recorded, written on.
    plain: usize,
    /// Streams recorded, decoded again and written on.
    streams: usize,
    /// Answered already: closed.
    done: usize,
    /// Nothing this engine can go on from: closed.
    dropped: usize,
}

/// Once this engine holds the lock and is ready: every connection the
/// store holds (each a socket and its state memfd under one name), but
/// those named `own`-… (this engine's), becomes a job for the workers, or
/// is closed when done or beyond resuming; all are said in one line.
pub fn take_over(slot: &str, own: &str, inherited: Vec<Stored>) -> VecDeque<Job> {
    let t0 = Instant::now();
    let stored = fetch_store(inherited);
    let mut t = Takeover {
        descriptors: stored.len(),
        ..Takeover::default()
    };
    let mut jobs = VecDeque::new();
    // The fetch runs while this engine serves: what it stored itself since
    // is in the answer too, and is its own workers' (these copies close).
    let own = format!("{own}-");
    for entry in continuity::group(stored)
        .into_iter()
        .filter(|e| !e.name.starts_with(&own))
    {
        t.fetched += 1;
        let name = entry.name.clone();
        match resume(entry) {
            Ok(Some(job)) => {
                match &job {
                    Job::Fresh(..) => t.fresh += 1,
                    Job::Resume(r) if matches!(r.work, Work::Plain(_)) => t.plain += 1,
                    Job::Resume(_) => t.streams += 1,
                }
                jobs.push_back(job);
            }
            Ok(None) => t.done += 1,
            Err(why) => {
                t.dropped += 1;
                eprintln!("shadow-engine: stored connection {name}: {why}: closed");
                let _ = fdstore::remove(&name);
            }
        }
    }
    println!(
        "shadow-engine slot {slot} took over: {} connections fetched ({} descriptors), {} resumed (request unread {}, plain {}, stream {}), done {}, dropped {}; fetched and sorted in {:.1} ms",
        t.fetched,
        t.descriptors,
        t.fresh + t.plain + t.streams,
        t.fresh,
        t.plain,
        t.streams,
        t.done,
        t.dropped,
        t0.elapsed().as_secs_f64() * 1e3
    );
    let _ = std::io::stdout().flush();
    jobs
}

/// The job of one stored connection; None when it was done (now closed).
fn resume(entry: continuity::Entry) -> std::result::Result<Option<Job>, String> {
    let Some(state) = entry.state else {
        // One the runtime accepted and handed to an engine that died
        // before it stored a state (or to nobody yet): its request, if
        // any, is still in the socket.
        return match entry.socket {
            Some(sock) if shadow_contract::handoff::is_accepted_name(&entry.name) => {
                let conn = Conn::from_fd(sock).map_err(|e| format!("socket: {e}"))?;
                let _ = conn.set_blocking();
                match continuity::bytes_written(conn.as_fd()) {
                    Ok(n) if n > 0 => Err(format!("{n} bytes written, and no state")),
                    _ => Ok(Some(Job::Fresh(conn, Link::adopt(entry.name)))),
                }
            }
            _ => Err("a socket without its state".into()),
        };
    };
    let track = Track::fetched(entry.name, state);
    let saved = track.read().map_err(|e| format!("state refused: {e}"))?;
    let Some(sock) = entry.socket else {
        // The store let go of the socket when its client hung up: after
        // the answer (its state says done), or before.
        if saved.progress == Phase::Done {
            Link::new(Some(track)).drop_entry();
            return Ok(None);
        }
        return Err("its socket is gone: the client hung up".into());
    };
    let conn = Conn::from_fd(sock).map_err(|e| format!("socket: {e}"))?;
    let _ = conn.set_blocking();
    let link = Link::new(Some(track));
    // What the socket got: none before the answer starts, which a state
    // that lagged (its updates failed, and so did its removal) would
    // contradict; all the resumption goes by once it has.
    let sent = continuity::bytes_written(conn.as_fd());
    let unstarted = |p: Phase| match sent {
        Ok(n) if n > 0 => Err(format!("{n} bytes written, its state says {p:?}")),
        _ => Ok(()),
    };
    let written = match saved.progress {
        Phase::New => {
            unstarted(Phase::New)?;
            return Ok(Some(Job::Fresh(conn, link)));
        }
        Phase::Done => {
            link.finish(conn.as_fd());
            return Ok(None);
        }
        Phase::Recorded => {
            unstarted(Phase::Recorded)?;
            // The request may still be in the socket: taken off, so that
            // the close is no reset.
            conn.drain(usize::try_from(saved.request_len).unwrap_or(usize::MAX));
            0
        }
        Phase::Answering(_) | Phase::Finishing(_) => sent.map_err(|e| {
            format!(
                "an answer under way, but no count of the bytes written ({e}): only TCP has one"
            )
        })?,
    };
    let work = saved.work.ok_or("no answer recorded")?;
    Ok(Some(Job::Resume(Resumed {
        conn,
        link,
        work,
        progress: saved.progress,
        written,
    })))
}
