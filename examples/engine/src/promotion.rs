//! The promoted engine's way from the lock to its first answer, part by
//! part, as one log line per promotion: a failover's gap is the kernel's
//! (SIGKILL → lock), the runtime's, and this engine's own wake, and only
//! timestamps taken inside the engine tell the last apart. The engine
//! stamps each part the first time it happens ([`Timeline::mark`], one
//! `CLOCK_MONOTONIC` read and one atomic store); the line is printed once
//! the first new request is answered and, with a store, the takeover's
//! fetch is in. `CLOCK_MONOTONIC` is the host's clock inside a container
//! too, so a benchmark that stamps its SIGKILL with [`mono_us`] reads the
//! whole gap off the line ([`parse`]; `failover-bench` does).
//!
//! The line: `shadow-engine slot 1 promoted: lock at 123456789 µs
//! (CLOCK_MONOTONIC), then kv +0.012 ready +0.080 … ms`, the parts in the
//! order of [`Part::ALL`], each in ms after the lock, a part that did not
//! happen left out.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// `CLOCK_MONOTONIC` in µs (what `Instant` reads, as a number).
pub fn mono_us() -> u64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .map(|t| {
            u64::try_from(t.tv_sec()).unwrap_or(0) * 1_000_000
                + u64::try_from(t.tv_nsec()).unwrap_or(0) / 1000
        })
        .unwrap_or(0)
}

/// A step of the wake, in the order it normally comes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// The KV pool taken (gmsd's answer to the wake's request mapped), by
    /// the first stream that needed it.
    Kv,
    /// Listening (its own socket), `READY=1` sent.
    Ready,
    /// The acceptor's first wait for a connection.
    Serving,
    /// The first new connection taken off the listening socket (or the
    /// hand-off socket).
    Accepted,
    /// That connection in the fd store (`FDSTORE=1` sent).
    Stored,
    /// The first new request read whole by a worker.
    Read,
    /// The first answer to a new request written to its socket.
    Answered,
    /// The takeover's fetch of the fd store sorted into jobs.
    Fetched,
}

impl Part {
    pub const ALL: [Part; 8] = [
        Part::Kv,
        Part::Ready,
        Part::Serving,
        Part::Accepted,
        Part::Stored,
        Part::Read,
        Part::Answered,
        Part::Fetched,
    ];

    /// Its word in the line.
    pub fn key(self) -> &'static str {
        match self {
            Part::Kv => "kv",
            Part::Ready => "ready",
            Part::Serving => "serving",
            Part::Accepted => "accepted",
            Part::Stored => "stored",
            Part::Read => "read",
            Part::Answered => "answered",
            Part::Fetched => "fetched",
        }
    }

    fn index(self) -> usize {
        Part::ALL.iter().position(|&p| p == self).unwrap_or(0)
    }
}

/// One promotion's stamps, shared by the threads that make them.
pub struct Timeline {
    slot: String,
    /// [`mono_us`] when the lock was taken (0: not yet).
    lock_us: AtomicU64,
    /// µs after the lock, + 1 (0: not yet).
    marks: [AtomicU64; Part::ALL.len()],
    /// Whether the line waits for [`Part::Fetched`] too.
    fetches: bool,
    said: AtomicBool,
}

impl Timeline {
    /// The promotion of the engine in `slot`, made while it is parked;
    /// `fetches`: its line waits for the takeover's fetch too.
    pub fn new(slot: &str, fetches: bool) -> Timeline {
        Timeline {
            slot: slot.to_owned(),
            lock_us: AtomicU64::new(0),
            marks: Default::default(),
            fetches,
            said: AtomicBool::new(false),
        }
    }

    /// The lock was taken at `lock_us` ([`mono_us`]): the parts count
    /// from here.
    pub fn locked(&self, lock_us: u64) {
        self.lock_us.store(lock_us, Ordering::Release);
    }

    /// `part` happened now, if it had not yet; prints the line when this
    /// was the last part it waited for.
    pub fn mark(&self, part: Part) {
        let slot = &self.marks[part.index()];
        if slot.load(Ordering::Relaxed) != 0 {
            return;
        }
        let after = mono_us().saturating_sub(self.lock_us.load(Ordering::Acquire)) + 1;
        if slot
            .compare_exchange(0, after, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            self.say_when_done();
        }
    }

    fn ms(&self, part: Part) -> Option<f64> {
        match self.marks[part.index()].load(Ordering::Acquire) {
            0 => None,
            n => Some((n - 1) as f64 / 1e3),
        }
    }

    fn say_when_done(&self) {
        let done = self.ms(Part::Answered).is_some()
            && (!self.fetches || self.ms(Part::Fetched).is_some());
        if done && !self.said.swap(true, Ordering::AcqRel) {
            use std::io::Write;
            println!("{}", self.line());
            let _ = std::io::stdout().flush();
        }
    }

    /// The log line, with the parts stamped so far.
    pub fn line(&self) -> String {
        let mut line = format!(
            "shadow-engine slot {} promoted: lock at {} µs (CLOCK_MONOTONIC), then",
            self.slot,
            self.lock_us.load(Ordering::Acquire)
        );
        for p in Part::ALL {
            if let Some(ms) = self.ms(p) {
                line += &format!(" {} +{ms:.3}", p.key());
            }
        }
        line + " ms"
    }
}

/// A promotion line read back.
#[derive(Debug, Clone, PartialEq)]
pub struct Promoted {
    pub slot: String,
    /// `CLOCK_MONOTONIC` µs at which the lock was taken.
    pub lock_us: u64,
    /// Each part stamped, in ms after the lock.
    pub parts: Vec<(Part, f64)>,
}

impl Promoted {
    /// `part`'s ms after the lock, if stamped.
    pub fn get(&self, part: Part) -> Option<f64> {
        self.parts
            .iter()
            .find(|(p, _)| *p == part)
            .map(|(_, ms)| *ms)
    }
}

/// Reads a [`Timeline::line`] (anywhere in `line`); None for any other line.
pub fn parse(line: &str) -> Option<Promoted> {
    let rest = line.split("shadow-engine slot ").nth(1)?;
    let (slot, rest) = rest.split_once(" promoted: lock at ")?;
    let (lock, rest) = rest.split_once(" µs (CLOCK_MONOTONIC), then")?;
    let mut words = rest.split_whitespace();
    let mut parts = vec![];
    while let Some(key) = words.next() {
        if key == "ms" {
            break;
        }
        let part = Part::ALL.into_iter().find(|p| p.key() == key)?;
        let ms = words.next()?.strip_prefix('+')?.parse().ok()?;
        parts.push((part, ms));
    }
    Some(Promoted {
        slot: slot.to_owned(),
        lock_us: lock.parse().ok()?,
        parts,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_waits_for_the_answer_and_the_fetch_and_reads_back() {
        let t = Timeline::new("1", true);
        t.locked(mono_us());
        t.mark(Part::Kv);
        t.mark(Part::Answered);
        assert!(!t.said.load(Ordering::Acquire), "the fetch is not in yet");
        t.mark(Part::Fetched);
        assert!(t.said.load(Ordering::Acquire));
        let first = t.ms(Part::Kv);
        t.mark(Part::Kv);
        assert_eq!(t.ms(Part::Kv), first, "only the first time counts");
        let back = parse(&format!("engine 1: {}", t.line())).unwrap();
        assert_eq!(back.slot, "1");
        assert_eq!(back.lock_us, t.lock_us.load(Ordering::Acquire));
        let keys: Vec<Part> = back.parts.iter().map(|(p, _)| *p).collect();
        assert_eq!(keys, [Part::Kv, Part::Answered, Part::Fetched]);
        assert!(back.get(Part::Ready).is_none());
        assert!(back.get(Part::Fetched) >= back.get(Part::Kv));
        assert!(parse("shadow-engine slot 1 took over: 1 connections").is_none());
        assert!(
            parse("shadow-engine slot 1 promoted: lock at x µs (CLOCK_MONOTONIC), then ms")
                .is_none()
        );
    }

    #[test]
    fn without_a_store_the_answer_is_enough() {
        let t = Timeline::new("0", false);
        t.locked(mono_us());
        t.mark(Part::Answered);
        assert!(t.said.load(Ordering::Acquire));
        assert!(mono_us() >= t.lock_us.load(Ordering::Acquire));
    }
}
