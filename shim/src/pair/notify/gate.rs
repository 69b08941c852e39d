//! **Floods.** The [`Gate`] decides which datagrams reach the supervisor: a
//! datagram identical to one of the same sender still waiting is
//! coalesced, each engine has a token bucket (one token per notification
//! in a datagram), and the supervisor's input queue is bounded
//! ([`QUEUE_MAX`]): a datagram that finds it full is dropped. What it
//! drops is counted ([`DropCounts`], which the supervisor publishes as a
//! metric) and logged at most every [`LOG_EVERY`].
//!
//! What may change here: the rules of admission and their limits. The
//! gate never blocks: its caller is the socket's reader.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use shadow_pair::{SlotId, MAX_DATAGRAM, MAX_SLOTS};
use tokio::time::Instant;

use super::socket::{Datagram, Dropped, Lines};

/// Inputs waiting for the supervisor, at most (the bound of its channel):
/// a datagram that finds them all taken is dropped; the other observers
/// wait for room (see `input.rs`).
pub const QUEUE_MAX: usize = 64;
/// Each engine's token bucket: sustained notifications (`KEY=VALUE` lines
/// the shim acts on; a datagram costs at least one) per second, and burst.
pub const RATE_PER_SEC: u32 = 50;
pub const BURST: u32 = 200;
/// Each engine's second bucket, for datagrams that are only watchdog pings
/// (`WATCHDOG=1`): they never take from the first, so no other message of
/// an engine can starve its pings. A correct engine pings every half
/// interval, 40 a second at the shortest interval (50 ms); this allows
/// two and a half times that.
pub const PING_RATE_PER_SEC: u32 = 100;
pub const PING_BURST: u32 = 20;
/// Each engine's third bucket, for the fd store's datagrams (`FDSTORE=1`,
/// `FDSTOREREMOVE=1`): a busy engine stores and removes a descriptor per
/// connection, thousands a second, and these never take from the other
/// two, so no amount of storing pushes out a `READY=1` or a ping. Nor do
/// they wait in the supervisor's queue: the reader hands them to the store.
pub const STORE_RATE_PER_SEC: u32 = 20_000;
pub const STORE_BURST: u32 = 4_000;
/// Datagrams dropped in one second past which the reader pauses for the
/// rest of that second, leaving the flood in the kernel's queue (which
/// then blocks or refuses the flooder) instead of spending the shim's CPU.
const DROPS_PER_SEC_MAX: u64 = 1000;
/// How often, at most, a pair logs what its notify socket dropped.
pub const LOG_EVERY: Duration = Duration::from_secs(10);
/// How long a pid's slot, once looked up, is taken as known.
const SLOT_TTL: Duration = Duration::from_secs(1);
/// Pids remembered at once (slot lookups, last datagrams); the maps are
/// cleared when full.
const PIDS_MAX: usize = 256;

/// How many datagrams the reader forwarded and the supervisor took: a
/// datagram the same as its sender's last one, while that one still
/// waits, is coalesced. (The queue's bound is its channel's.)
#[derive(Default)]
pub struct Queue {
    forwarded: AtomicU64,
    taken: AtomicU64,
}

impl Queue {
    /// The supervisor took one forwarded datagram.
    pub fn taken(&self) {
        self.taken.fetch_add(1, Ordering::Relaxed);
    }
}

/// The datagrams a pair's notify socket dropped, by reason: counted by the
/// reader, published by the supervisor.
#[derive(Default)]
pub struct DropCounts {
    counts: [AtomicU64; Dropped::ALL.len()],
    /// A drop was counted since the last [`take`](Self::take).
    moved: AtomicBool,
}

impl DropCounts {
    /// Count one drop; true when it is the first since the last `take`
    /// (the supervisor is then told once, not once per drop).
    pub fn count(&self, why: Dropped) -> bool {
        self.counts[why as usize].fetch_add(1, Ordering::Relaxed);
        // Release: whoever sees `moved` set sees this count too.
        !self.moved.swap(true, Ordering::AcqRel)
    }

    /// Whether a drop was counted since the last `take`.
    pub fn moved(&self) -> bool {
        self.moved.load(Ordering::Acquire)
    }

    /// The counts of every reason (0 included), by `reason` label; a drop
    /// counted from here on is `moved` again.
    pub fn take(&self) -> Vec<(&'static str, u64)> {
        // Acquire: the counts whose `moved` this clears are seen below; a
        // drop counted after it sets `moved` again.
        self.moved.swap(false, Ordering::AcqRel);
        self.get()
    }

    fn get(&self) -> Vec<(&'static str, u64)> {
        Dropped::ALL
            .iter()
            .map(|d| (d.label(), self.counts[*d as usize].load(Ordering::Relaxed)))
            .collect()
    }
}

/// What the reader does after a drop.
#[derive(Debug, PartialEq, Eq)]
pub struct AfterDrop {
    /// Stop reading this long (past [`DROPS_PER_SEC_MAX`] drops in a second).
    pub pause: Option<Duration>,
    /// The first drop since the supervisor took the counts: tell it.
    pub tell: bool,
}

/// A token bucket.
struct Bucket {
    tokens: f64,
    at: Instant,
    rate: u32,
    burst: u32,
}

impl Bucket {
    fn full(now: Instant) -> Bucket {
        Bucket::full_of(now, RATE_PER_SEC, BURST)
    }

    fn full_of(now: Instant, rate: u32, burst: u32) -> Bucket {
        Bucket {
            tokens: f64::from(burst),
            at: now,
            rate,
            burst,
        }
    }

    /// The tokens there are at `now`.
    fn refill(&mut self, now: Instant) -> f64 {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.at = now;
        self.tokens = (self.tokens + dt * f64::from(self.rate)).min(f64::from(self.burst));
        self.tokens
    }

    /// Takes `n` tokens if there are as many.
    fn take(&mut self, n: u32, now: Instant) -> bool {
        if self.refill(now) >= f64::from(n) {
            self.tokens -= f64::from(n);
            true
        } else {
            false
        }
    }
}

/// What a datagram costs: one token per `KEY=VALUE` line (what the
/// supervisor may act on) other than a watchdog ping, at least one;
/// counted without parsing, as it was read. `None`: it holds pings and
/// nothing else, and costs one token of the ping bucket.
fn cost(lines: &Lines) -> Option<u32> {
    if lines.pings > 0 && lines.others == 0 {
        return None;
    }
    Some(lines.others.clamp(1, BURST + 1))
}

/// Decides which datagrams reach the supervisor; see the module doc.
/// The slot the notify gate found a datagram's sender in, and when it
/// looked (its lookups are kept a while).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SenderSlot {
    pub slot: SlotId,
    pub looked_up: Instant,
}

pub struct Gate {
    id: String,
    queue: Arc<Queue>,
    /// Each engine's bucket, by slot (room for every slot a pair may have).
    buckets: [Bucket; MAX_SLOTS],
    /// Each engine's bucket for watchdog pings ([`PING_RATE_PER_SEC`]).
    ping_buckets: [Bucket; MAX_SLOTS],
    /// Each engine's bucket for the fd store ([`STORE_RATE_PER_SEC`]).
    store_buckets: [Bucket; MAX_SLOTS],
    /// pid -> (slot, when looked up).
    slots: HashMap<u32, (Option<SlotId>, Instant)>,
    /// pid -> (its last forwarded text, that datagram's sequence number).
    last: HashMap<u32, (Vec<u8>, u64)>,
    drops: Arc<DropCounts>,
    /// When the drops were last logged (the first drop is logged at once).
    logged_at: Option<Instant>,
    second: Instant,
    dropped_this_second: u64,
}

impl Gate {
    pub fn new(id: &str, queue: Arc<Queue>, drops: Arc<DropCounts>, now: Instant) -> Gate {
        Gate {
            id: id.to_owned(),
            queue,
            buckets: std::array::from_fn(|_| Bucket::full(now)),
            ping_buckets: std::array::from_fn(|_| {
                Bucket::full_of(now, PING_RATE_PER_SEC, PING_BURST)
            }),
            store_buckets: std::array::from_fn(|_| {
                Bucket::full_of(now, STORE_RATE_PER_SEC, STORE_BURST)
            }),
            slots: HashMap::new(),
            last: HashMap::new(),
            drops,
            logged_at: None,
            second: now,
            dropped_this_second: 0,
        }
    }

    /// The slot of `pid` (looked up at most once per [`SLOT_TTL`]).
    fn slot(
        &mut self,
        pid: u32,
        now: Instant,
        slot_of: impl FnOnce(u32) -> Option<SlotId>,
    ) -> (Option<SlotId>, Instant) {
        match self.slots.get(&pid) {
            Some((slot, at)) if now.saturating_duration_since(*at) < SLOT_TTL => (*slot, *at),
            _ => {
                if self.slots.len() >= PIDS_MAX {
                    self.slots.clear();
                }
                let slot = slot_of(pid);
                self.slots.insert(pid, (slot, now));
                (slot, now)
            }
        }
    }

    /// Whether an fd-store datagram of `pid` may reach the store: its
    /// sender is an engine (`slot_of`) and that engine's store bucket has
    /// a token. Never queued, never coalesced (a store is no repeat).
    pub fn admit_store(
        &mut self,
        pid: u32,
        now: Instant,
        slot_of: impl FnOnce(u32) -> Option<SlotId>,
    ) -> std::result::Result<SlotId, Dropped> {
        let Some(slot) = self.slot(pid, now, slot_of).0 else {
            return Err(Dropped::NotAnEngine);
        };
        if !self.store_buckets[slot.index()].take(1, now) {
            return Err(Dropped::RateLimited);
        }
        Ok(slot)
    }

    /// Whether `d` goes to the supervisor or why not. `slot_of` looks a
    /// pid's slot up (`/proc`), at most once per pid per [`SLOT_TTL`];
    /// `forward` hands the admitted datagram on, false when the queue is
    /// full (nothing of it is then recorded).
    pub fn admit(
        &mut self,
        d: &Datagram,
        now: Instant,
        slot_of: impl FnOnce(u32) -> Option<SlotId>,
        forward: impl FnOnce(SenderSlot) -> bool,
    ) -> std::result::Result<(), Dropped> {
        let done = self.queue.taken.load(Ordering::Relaxed);
        if let Some((text, seq)) = self.last.get(&d.pid) {
            if *seq > done && *text == d.bytes {
                return Err(Dropped::Coalesced);
            }
        }
        let (slot, looked_up) = self.slot(d.pid, now, slot_of);
        let Some(slot) = slot else {
            return Err(Dropped::NotAnEngine);
        };
        // An empty bucket refuses before the datagram is even looked at.
        let (bucket, cost) = match cost(&d.lines) {
            Some(n) => (&mut self.buckets[slot.index()], n),
            None => (&mut self.ping_buckets[slot.index()], 1),
        };
        if bucket.refill(now) < 1.0 || !bucket.take(cost, now) {
            return Err(Dropped::RateLimited);
        }
        if !forward(SenderSlot { slot, looked_up }) {
            return Err(Dropped::QueueFull);
        }
        let seq = self.queue.forwarded.fetch_add(1, Ordering::Relaxed) + 1;
        if self.last.len() >= PIDS_MAX {
            self.last.clear();
        }
        self.last.insert(d.pid, (d.bytes.clone(), seq));
        Ok(())
    }

    /// Count a drop; log the counts if [`LOG_EVERY`] has passed. Says how
    /// long the reader should pause (past [`DROPS_PER_SEC_MAX`] drops in a
    /// second, until that second ends) and whether to tell the supervisor.
    #[cfg(test)]
    pub fn dropped(&mut self, why: Dropped, now: Instant) -> AfterDrop {
        self.dropped_weighing(why, now, 1)
    }

    /// [`Gate::dropped`] for a datagram that weighs `weight` drops towards
    /// the pause (one per descriptor it carried: receiving and closing
    /// them is the cost, not the datagram).
    pub fn dropped_weighing(&mut self, why: Dropped, now: Instant, weight: u64) -> AfterDrop {
        let tell = self.drops.count(why);
        self.log(now);
        if now.saturating_duration_since(self.second) >= Duration::from_secs(1) {
            self.second = now;
            self.dropped_this_second = 0;
        }
        self.dropped_this_second += weight.max(1);
        let pause = (self.dropped_this_second > DROPS_PER_SEC_MAX)
            .then(|| (self.second + Duration::from_secs(1)).saturating_duration_since(now));
        AfterDrop { pause, tell }
    }

    /// Datagrams dropped so far, by reason.
    pub fn counts(&self) -> impl Iterator<Item = (Dropped, u64)> + '_ {
        Dropped::ALL
            .iter()
            .map(|d| (*d, self.drops.counts[*d as usize].load(Ordering::Relaxed)))
    }

    fn log(&mut self, now: Instant) {
        if let Some(line) = self.report(now) {
            log::warn!("{line}");
        }
    }

    /// The line to log now, if the last was [`LOG_EVERY`] ago (or never).
    fn report(&mut self, now: Instant) -> Option<String> {
        if self
            .logged_at
            .is_some_and(|at| now.saturating_duration_since(at) < LOG_EVERY)
        {
            return None;
        }
        self.logged_at = Some(now);
        let parts: Vec<String> = self
            .counts()
            .filter(|(_, n)| *n > 0)
            .map(|(d, n)| format!("{}: {n}", d.name()))
            .collect();
        Some(format!(
            "pair {}: notify socket dropped datagrams (totals: {}); the contract allows {RATE_PER_SEC} notifications/s (burst {BURST}) per engine, {MAX_DATAGRAM} bytes, no fds",
            self.id,
            parts.join(", ")
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl Gate {
        /// `admit` into a queue of [`QUEUE_MAX`] that the test empties
        /// with `Queue::taken`.
        fn admit_ok(
            &mut self,
            d: &Datagram,
            now: Instant,
            slot_of: impl FnOnce(u32) -> Option<SlotId>,
        ) -> std::result::Result<(), Dropped> {
            let q = self.queue.clone();
            let waiting = q.forwarded.load(Ordering::Relaxed) - q.taken.load(Ordering::Relaxed);
            self.admit(d, now, slot_of, |_| waiting < QUEUE_MAX as u64)
        }
    }

    fn gate() -> (Gate, Arc<Queue>, Instant) {
        let q = Arc::new(Queue::default());
        let now = Instant::now();
        let drops = Arc::new(DropCounts::default());
        (Gate::new("t", q.clone(), drops, now), q, now)
    }

    fn dg(pid: u32, text: &[u8]) -> Datagram {
        Datagram::new(pid, text.to_vec())
    }

    #[test]
    fn repeats_still_waiting_are_coalesced_and_later_ones_pass() {
        let (mut g, q, now) = gate();
        let s0 = |_| Some(SlotId::ZERO);
        assert_eq!(g.admit_ok(&dg(7, b"READY=1"), now, s0), Ok(()));
        assert_eq!(
            g.admit_ok(&dg(7, b"READY=1"), now, s0),
            Err(Dropped::Coalesced)
        );
        // Another text, or another sender, is not a repeat.
        assert_eq!(g.admit_ok(&dg(7, b"STATUS=x"), now, s0), Ok(()));
        assert_eq!(g.admit_ok(&dg(8, b"READY=1"), now, s0), Ok(()));
        q.taken();
        q.taken();
        q.taken();
        assert_eq!(g.admit_ok(&dg(7, b"STATUS=x"), now, s0), Ok(()));
    }

    #[test]
    fn a_flooding_engine_is_limited_and_the_other_is_not() {
        let (mut g, q, now) = gate();
        let mut passed = 0;
        for i in 0..10_000u32 {
            let text = format!("STATUS={i}");
            if g.admit_ok(&dg(7, text.as_bytes()), now, |_| Some(SlotId::ZERO)) == Ok(()) {
                passed += 1;
                q.taken();
            }
        }
        assert_eq!(passed, BURST);
        // One second later, RATE_PER_SEC more.
        let later = now + Duration::from_secs(1);
        let more = (0..1000)
            .filter(|i| {
                let text = format!("STATUS=later {i}");
                let ok =
                    g.admit_ok(&dg(7, text.as_bytes()), later, |_| Some(SlotId::ZERO)) == Ok(());
                if ok {
                    q.taken();
                }
                ok
            })
            .count();
        assert_eq!(more, RATE_PER_SEC as usize);
        assert_eq!(
            g.admit_ok(&dg(9, b"READY=1"), later, |_| Some(SlotId::ONE)),
            Ok(())
        );
    }

    /// The bound: pings every half interval at the shortest
    /// interval (50 ms) all pass, however the same engine floods its other
    /// messages; a ping flood is limited on its own.
    #[test]
    fn no_other_message_starves_an_engines_pings() {
        let (mut g, q, start) = gate();
        let s0 = |_| Some(SlotId::ZERO);
        let mut pings = 0;
        for tick in 0..400u32 {
            // Every 5 ms for 2 s: a flood of status lines, a ping each 25 ms.
            let now = start + Duration::from_millis(u64::from(tick) * 5);
            for i in 0..20 {
                let text = format!("STATUS={tick}.{i}");
                if g.admit_ok(&dg(7, text.as_bytes()), now, s0).is_ok() {
                    q.taken();
                }
            }
            if tick % 5 == 0 {
                assert_eq!(
                    g.admit_ok(&dg(7, b"WATCHDOG=1\n"), now, s0),
                    Ok(()),
                    "tick {tick}"
                );
                q.taken();
                pings += 1;
            }
        }
        assert_eq!(pings, 80);
        // A ping mixed with another line costs the other line only.
        assert_eq!(cost(&Lines::of(b"WATCHDOG=1\nSTATUS=x")), Some(1));
        assert_eq!(cost(&Lines::of(b"WATCHDOG=1\nWATCHDOG=1\n")), None);
        assert_eq!(cost(&Lines::of(b"WATCHDOG=trigger")), Some(1));
        // Pings alone, as fast as they come: the burst, then the rate.
        let (mut g, q, now) = gate();
        let passed = (0..1000)
            .filter(|_| {
                let ok = g.admit_ok(&dg(7, b"WATCHDOG=1"), now, s0).is_ok();
                if ok {
                    q.taken();
                }
                ok
            })
            .count();
        assert_eq!(passed, PING_BURST as usize);
    }

    #[test]
    fn a_datagram_costs_one_token_per_notification() {
        let (mut g, q, now) = gate();
        let s0 = |_| Some(SlotId::ZERO);
        let lines = "STATUS=x\n".repeat(BURST as usize + 1);
        assert_eq!(
            g.admit_ok(&dg(7, lines.as_bytes()), now, s0),
            Err(Dropped::RateLimited)
        );
        let half = "STATUS=y\n".repeat(BURST as usize / 2);
        assert_eq!(g.admit_ok(&dg(7, half.as_bytes()), now, s0), Ok(()));
        q.taken();
        assert_eq!(g.admit_ok(&dg(7, half.as_bytes()), now, s0), Ok(()));
        q.taken();
        assert_eq!(
            g.admit_ok(&dg(7, b"READY=1"), now, s0),
            Err(Dropped::RateLimited)
        );
        // Garbage holds no notification and costs one token.
        let later = now + Duration::from_secs(1);
        assert_eq!(g.admit_ok(&dg(7, b"\xff\xfe"), later, s0), Ok(()));
    }

    #[test]
    fn the_queue_is_bounded_and_pids_of_no_engine_are_dropped() {
        let (mut g, q, now) = gate();
        for i in 0..QUEUE_MAX {
            let text = format!("STATUS={i}");
            assert_eq!(
                g.admit_ok(&dg(7, text.as_bytes()), now, |_| Some(SlotId::ZERO)),
                Ok(())
            );
        }
        assert_eq!(
            g.admit_ok(&dg(9, b"READY=1"), now, |_| Some(SlotId::ONE)),
            Err(Dropped::QueueFull)
        );
        q.taken();
        assert_eq!(
            g.admit_ok(&dg(9, b"READY=1"), now, |_| Some(SlotId::ONE)),
            Ok(())
        );
        assert_eq!(
            g.admit_ok(&dg(10, b"READY=1"), now, |_| None),
            Err(Dropped::NotAnEngine)
        );
    }

    #[test]
    fn a_slot_is_looked_up_once_per_pid_and_second() {
        let (mut g, q, now) = gate();
        let mut lookups = 0;
        for i in 0..100 {
            let text = format!("STATUS={i}");
            let _ = g.admit_ok(&dg(7, text.as_bytes()), now, |_| {
                lookups += 1;
                Some(SlotId::ZERO)
            });
            q.taken();
        }
        assert_eq!(lookups, 1);
        let _ = g.admit_ok(&dg(7, b"x"), now + SLOT_TTL, |_| {
            lookups += 1;
            Some(SlotId::ZERO)
        });
        assert_eq!(lookups, 2);
    }

    #[test]
    fn drops_are_logged_at_once_then_at_most_every_log_every() {
        let (mut g, _q, now) = gate();
        g.drops.counts[Dropped::RateLimited as usize].store(3, Ordering::Relaxed);
        let first = g.report(now).expect("the first drop is logged");
        assert!(first.contains("rate limited: 3"), "{first}");
        assert!(g.report(now + LOG_EVERY / 2).is_none());
        assert!(g.report(now + LOG_EVERY).is_some());
    }

    #[test]
    fn a_flood_of_drops_pauses_the_reader() {
        let (mut g, _q, now) = gate();
        for _ in 0..DROPS_PER_SEC_MAX {
            assert_eq!(g.dropped(Dropped::RateLimited, now).pause, None);
        }
        let pause = g.dropped(Dropped::RateLimited, now + Duration::from_millis(300));
        assert_eq!(pause.pause, Some(Duration::from_millis(700)));
        assert_eq!(
            g.counts().find(|(d, _)| *d == Dropped::RateLimited),
            Some((Dropped::RateLimited, DROPS_PER_SEC_MAX + 1))
        );
    }

    #[test]
    fn the_supervisor_is_told_once_until_it_takes_the_counts() {
        let (mut g, _q, now) = gate();
        let drops = g.drops.clone();
        assert!(!drops.moved());
        assert!(g.dropped(Dropped::Oversized, now).tell);
        for _ in 0..100 {
            assert!(!g.dropped(Dropped::RateLimited, now).tell);
        }
        assert!(drops.moved());
        let counts = drops.take();
        assert!(!drops.moved());
        // Every reason, 0 included, by its label.
        assert_eq!(counts.len(), Dropped::ALL.len());
        assert!(counts.contains(&("oversized", 1)));
        assert!(counts.contains(&("rate_limited", 100)));
        assert!(counts.contains(&("queue_full", 0)));
        assert!(g.dropped(Dropped::QueueFull, now).tell);
    }
}
