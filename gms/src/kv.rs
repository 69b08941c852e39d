//! A KV cache that serves before all of it is backed.
//!
//! Why this exists: a promoted engine takes over from one that has just
//! died, and on a GPU whose KV cache fills the device the dead engine's
//! memory comes back only when the driver has torn its context down, 100 to
//! 450 ms after the SIGKILL on an H200. Waiting for the whole cache before
//! serving makes that teardown the failover's figure. What the first
//! requests need is already there (the weights, the engine's runtime, a
//! little KV), so a [`KvCache`] can *grow*: [`KvCache::wake`] backs the
//! part the caller must have at once and a grower thread backs the rest, in
//! the range's chunks, from the start of the range on, as memory becomes
//! free. The engine asks how much is backed ([`KvCache::backed`]) and is
//! told when it grows ([`KvWatch::wait_backed`], or the readable
//! [`KvWatch::event_fd`] for an event loop); it admits the work that fits
//! in the backed prefix and queues the rest.
//!
//! The backed part is always a prefix `[addr, addr + backed)`: an engine
//! whose pool is laid out block after block uses the first `backed /
//! block_bytes` blocks and adds blocks as it grows. The grower never runs
//! in the engine's serving path: it is one thread per growing cache, and
//! while the device is out of memory it retries 1 ms after a failure,
//! doubling to [`MAX_PAUSE`], and gives up (the cache stays partly backed,
//! [`Growth::Stalled`]) after [`KvCache::oom_wait`] without any progress.
//!
//! Ownership: the [`KvCache`] owns the range (behind a mutex the grower
//! shares) and the grower thread, which it stops and joins before it
//! releases or drops the memory. A [`KvWatch`] only observes.

use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::sys::eventfd::{EfdFlags, EventFd};

use crate::mapper::{HostRange, Range};
use crate::{Error, Result};

/// How long backing a KV cache waits for device memory without any coming
/// back, unless `GMS_KV_OOM_WAIT_MS` says otherwise: a full
/// [`KvCache::materialise`] (and the part a [`KvCache::wake`] needs at
/// once) fails after it, a grower stops after it. On an H200 a dead
/// engine's memory came back 110 to 450 ms after its SIGKILL.
pub const KV_OOM_WAIT: Duration = Duration::from_secs(5);

/// The longest pause between two tries of a grower while the device is out
/// of memory: memory that comes back is used within this, and the driver
/// is asked at most this often plus once per millisecond of the first few.
pub const MAX_PAUSE: Duration = Duration::from_millis(8);

const MIN_PAUSE: Duration = Duration::from_millis(1);

/// [`KV_OOM_WAIT`], or `GMS_KV_OOM_WAIT_MS` when it is set to a number.
pub fn oom_wait_from_env() -> Duration {
    std::env::var("GMS_KV_OOM_WAIT_MS")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .map(Duration::from_millis)
        .unwrap_or(KV_OOM_WAIT)
}

/// Where the backing of a KV cache stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Growth {
    /// Addresses only (parked, or released).
    Reserved,
    /// Partly backed; a grower backs the rest as memory comes back.
    Growing,
    /// All of it backed.
    Backed,
    /// The grower gave up: no memory came back for `waited`. What is
    /// backed stays backed.
    Stalled { waited: Duration },
    /// Backing failed for another reason than a full device (a driver
    /// error); what is backed stays backed.
    Failed(String),
}

impl Growth {
    /// Whether the backed size can still change without a new call.
    pub fn is_growing(&self) -> bool {
        matches!(self, Growth::Growing)
    }

    /// The word `info_json` and the docs use.
    pub fn name(&self) -> &'static str {
        match self {
            Growth::Reserved => "reserved",
            Growth::Growing => "growing",
            Growth::Backed => "backed",
            Growth::Stalled { .. } => "stalled",
            Growth::Failed(_) => "failed",
        }
    }
}

struct State {
    growth: Growth,
    /// Set to stop the grower; it checks between two chunks and while it
    /// pauses.
    stop: bool,
    /// When the last wake began, and how long after it all was backed.
    woke: Option<Instant>,
    full_after: Option<Duration>,
}

/// What a grower and every watcher share; no driver handle in here.
struct Progress {
    len: u64,
    chunk: u64,
    backed: AtomicU64,
    state: Mutex<State>,
    changed: Condvar,
    /// Readable (a count) after each change of `backed` or of the growth.
    event: EventFd,
}

impl Progress {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records a new backed size (or growth) and wakes every watcher.
    fn publish(&self, backed: u64, growth: Option<Growth>) {
        let mut st = self.state();
        self.backed.store(backed, Ordering::Release);
        if backed == self.len && st.full_after.is_none() {
            st.full_after = st.woke.map(|t| t.elapsed());
        }
        if let Some(g) = growth {
            st.growth = g;
        }
        drop(st);
        self.changed.notify_all();
        // A full counter (2^64 - 2 unread events) only means the reader
        // has plenty to read: nothing to do about an error here.
        let _ = self.event.write(1);
    }

    /// Sleeps `pause` unless stopped first: true when asked to stop.
    fn pause(&self, pause: Duration) -> bool {
        let st = self.state();
        let (st, _) = self
            .changed
            .wait_timeout_while(st, pause, |s| !s.stop)
            .unwrap_or_else(|p| p.into_inner());
        st.stop
    }
}

/// A handle to watch a KV cache grow from any thread, without its lock:
/// cheap to clone, it outlives nothing (the memory is the cache's).
#[derive(Clone)]
pub struct KvWatch(Arc<Progress>);

impl KvWatch {
    /// Bytes backed, from the start of the range.
    pub fn backed(&self) -> u64 {
        self.0.backed.load(Ordering::Acquire)
    }

    pub fn growth(&self) -> Growth {
        self.0.state().growth.clone()
    }

    /// How long after the last wake all of the cache was backed.
    pub fn full_after(&self) -> Option<Duration> {
        self.0.state().full_after
    }

    /// Waits until at least `bytes` are backed, the cache stops growing,
    /// or `timeout` passes; returns the bytes backed then.
    pub fn wait_backed(&self, bytes: u64, timeout: Duration) -> u64 {
        let st = self.0.state();
        let want = bytes.min(self.0.len);
        let (_st, _) = self
            .0
            .changed
            .wait_timeout_while(st, timeout, |s| {
                self.0.backed.load(Ordering::Acquire) < want && s.growth.is_growing()
            })
            .unwrap_or_else(|p| p.into_inner());
        self.backed()
    }

    /// An eventfd that is readable after each change (read it to reset the
    /// count); it lives as long as the cache. For poll/select/epoll loops.
    pub fn event_fd(&self) -> BorrowedFd<'_> {
        self.0.event.as_fd()
    }

    /// One line for logs and C/Python callers.
    pub fn info_json(&self) -> String {
        let st = self.0.state();
        let mut v = serde_json::json!({
            "bytes": self.0.len,
            "chunk": self.0.chunk,
            "backed": self.0.backed.load(Ordering::Acquire),
            "growth": st.growth.name(),
        });
        match &st.growth {
            Growth::Stalled { waited } => {
                v["waited_ms"] = serde_json::json!(waited.as_secs_f64() * 1e3)
            }
            Growth::Failed(why) => v["error"] = why.clone().into(),
            _ => {}
        }
        if let Some(d) = st.full_after {
            v["full_after_ms"] = serde_json::json!(d.as_secs_f64() * 1e3);
        }
        v.to_string()
    }
}

/// A KV-cache range: reserved while parked, backed on wake, all at once
/// ([`materialise`](Self::materialise)) or growing ([`wake`](Self::wake)).
pub struct KvCache<R: Range + 'static = HostRange> {
    range: Arc<Mutex<R>>,
    progress: Arc<Progress>,
    grower: Option<JoinHandle<()>>,
    addr: u64,
    oom_wait: Duration,
}

fn lock<R>(range: &Mutex<R>) -> MutexGuard<'_, R> {
    range.lock().unwrap_or_else(|p| p.into_inner())
}

impl<R: Range + 'static> KvCache<R> {
    /// A cache over a reserved (not yet backed) range.
    pub fn new(range: R) -> Result<Self> {
        let event = EventFd::from_flags(EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)
            .map_err(|e| Error::sys("eventfd for a KV cache", e))?;
        let progress = Arc::new(Progress {
            len: range.len(),
            chunk: range.chunk(),
            backed: AtomicU64::new(range.backed()),
            state: Mutex::new(State {
                growth: Growth::Reserved,
                stop: false,
                woke: None,
                full_after: None,
            }),
            changed: Condvar::new(),
            event,
        });
        Ok(KvCache {
            addr: range.addr(),
            range: Arc::new(Mutex::new(range)),
            progress,
            grower: None,
            oom_wait: oom_wait_from_env(),
        })
    }

    pub fn addr(&self) -> u64 {
        self.addr
    }

    pub fn len(&self) -> u64 {
        self.progress.len
    }

    pub fn is_empty(&self) -> bool {
        self.progress.len == 0
    }

    /// The size the range is backed in: one allocation of the device per chunk.
    pub fn chunk(&self) -> u64 {
        self.progress.chunk
    }

    pub fn backed(&self) -> u64 {
        self.progress.backed.load(Ordering::Acquire)
    }

    pub fn growth(&self) -> Growth {
        self.progress.state().growth.clone()
    }

    pub fn watch(&self) -> KvWatch {
        KvWatch(Arc::clone(&self.progress))
    }

    /// How long backing waits for memory without any coming back.
    pub fn oom_wait(&self) -> Duration {
        self.oom_wait
    }

    pub fn set_oom_wait(&mut self, wait: Duration) {
        self.oom_wait = wait;
    }

    /// Runs `f` on the range, the grower kept out meanwhile.
    pub fn with_range<T>(&self, f: impl FnOnce(&mut R) -> T) -> T {
        f(&mut lock(&self.range))
    }

    /// All of the cache backed before it returns, waiting up to
    /// [`oom_wait`](Self::oom_wait) for memory to come back; on failure
    /// nothing stays backed.
    pub fn materialise(&mut self) -> Result<()> {
        let len = self.len();
        match self.wake(len) {
            Ok(_) => Ok(()),
            Err(e) => {
                let _ = self.release();
                Err(e)
            }
        }
    }

    /// Backs at least `min` bytes (rounded up to whole chunks) on the
    /// calling thread before it returns, waiting up to
    /// [`oom_wait`](Self::oom_wait) for them, and leaves a grower thread
    /// backing the rest, what fits now first and then as memory comes
    /// back. `min` = 0 returns at once: all of it is the grower's. Returns the bytes backed on return. A cache that is
    /// already backed or growing is left as it is (only `min` is waited for).
    pub fn wake(&mut self, min: u64) -> Result<u64> {
        let len = self.len();
        let min = min.min(len);
        let gave_up = {
            let mut st = self.progress.state();
            if st.growth == Growth::Reserved {
                st.woke = Some(Instant::now());
                st.full_after = None;
            }
            matches!(st.growth, Growth::Stalled { .. } | Growth::Failed(_))
        };
        if gave_up {
            // It stalled or failed (its thread may still be on its way
            // out after saying so): this wake tries again.
            self.stop_grower();
        }
        if self.grower.is_some() {
            let backed = self.watch().wait_backed(min, self.oom_wait);
            return if backed >= min {
                Ok(backed)
            } else {
                Err(self.short_of(min, backed))
            };
        }
        let deadline = Instant::now() + self.oom_wait;
        let mut pause = MIN_PAUSE;
        loop {
            let backed = {
                let mut range = lock(&self.range);
                // The part needed at once, chunk after chunk, while it fits;
                // the rest is the grower's.
                while range.backed() < min && range.grow()? {
                    self.progress.publish(range.backed(), None);
                }
                range.backed()
            };
            if backed >= len {
                self.progress.publish(backed, Some(Growth::Backed));
                return Ok(backed);
            }
            if backed >= min {
                self.progress.publish(backed, Some(Growth::Growing));
                self.start_grower();
                return Ok(backed);
            }
            if Instant::now() + pause >= deadline {
                return Err(self.short_of(min, backed));
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(MAX_PAUSE);
        }
    }

    fn short_of(&self, min: u64, backed: u64) -> Error {
        Error::OutOfMemory(format!(
            "{backed} of the {min} KV bytes needed at once are backed after waiting {} ms for \
             device memory (GMS_KV_OOM_WAIT_MS); the cache holds {} bytes in chunks of {}",
            self.oom_wait.as_millis(),
            self.len(),
            self.chunk()
        ))
    }

    fn start_grower(&mut self) {
        let range = Arc::clone(&self.range);
        let progress = Arc::clone(&self.progress);
        let wait = self.oom_wait;
        let spawned = std::thread::Builder::new()
            .name("gms-kv-grow".into())
            .spawn(move || grow(&range, &progress, wait));
        match spawned {
            Ok(h) => self.grower = Some(h),
            Err(e) => {
                let backed = self.backed();
                self.progress.publish(
                    backed,
                    Some(Growth::Failed(format!("spawning the KV grower: {e}"))),
                );
            }
        }
    }

    /// Stops the grower (if any) and waits for it: it finishes the chunk it
    /// is backing, if any.
    fn stop_grower(&mut self) {
        if let Some(h) = self.grower.take() {
            self.progress.state().stop = true;
            self.progress.changed.notify_all();
            let _ = h.join();
            self.progress.state().stop = false;
        }
    }

    /// Gives every page back; the addresses stay reserved.
    pub fn release(&mut self) -> Result<()> {
        self.stop_grower();
        lock(&self.range).unmap()?;
        {
            let mut st = self.progress.state();
            st.woke = None;
            st.full_after = None;
        }
        self.progress.publish(0, Some(Growth::Reserved));
        Ok(())
    }
}

impl<R: Range + 'static> Drop for KvCache<R> {
    fn drop(&mut self) {
        // The range (and its memory) goes after the grower has stopped.
        self.stop_grower();
    }
}

/// The grower: backs the rest of the range chunk by chunk, pausing while
/// the device is full, until all is backed, it is stopped, or nothing came
/// back for `wait`.
fn grow<R: Range>(range: &Mutex<R>, progress: &Progress, wait: Duration) {
    let mut pause = MIN_PAUSE;
    let mut since = Instant::now();
    loop {
        if progress.state().stop {
            return;
        }
        let step = {
            let mut r = lock(range);
            r.grow().map(|grew| (grew, r.backed()))
        };
        match step {
            Ok((true, backed)) => {
                let done = backed >= progress.len;
                progress.publish(backed, done.then_some(Growth::Backed));
                if done {
                    return;
                }
                pause = MIN_PAUSE;
                since = Instant::now();
            }
            Ok((false, backed)) => {
                let waited = since.elapsed();
                if waited >= wait {
                    progress.publish(backed, Some(Growth::Stalled { waited }));
                    return;
                }
                if progress.pause(pause) {
                    return;
                }
                pause = (pause * 2).min(MAX_PAUSE);
            }
            Err(e) => {
                let backed = progress.backed.load(Ordering::Acquire);
                progress.publish(backed, Some(Growth::Failed(e.to_string())));
                return;
            }
        }
    }
}

impl KvCache<HostRange> {
    /// The backed prefix, writable (the grower kept out while it is held).
    pub fn with_backed_mut<T>(&self, f: impl FnOnce(&mut [u8]) -> T) -> T {
        let mut range = lock(&self.range);
        f(range.backed_mut())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mapper::{HostMapper, HostMemory, Mapper};

    const CHUNK: u64 = 1 << 20;

    /// A "device" of `chunks` chunks and a mapper on it.
    fn device(chunks: u64) -> (HostMemory, HostMapper) {
        let memory = HostMemory::new(chunks * CHUNK);
        let mapper = HostMapper::with_limit(memory.clone(), CHUNK).unwrap();
        (memory, mapper)
    }

    fn cache(mapper: &HostMapper, chunks: u64, oom_wait: Duration) -> KvCache {
        let mut kv = KvCache::new(mapper.reserve(chunks * CHUNK, None).unwrap()).unwrap();
        kv.set_oom_wait(oom_wait);
        kv
    }

    /// The dead engine's KV: backed now, given back when dropped.
    fn hog(mapper: &HostMapper, chunks: u64) -> HostRange {
        let mut r = mapper.reserve(chunks * CHUNK, None).unwrap();
        r.materialise().unwrap();
        r
    }

    fn events(w: &KvWatch) -> u64 {
        let mut buf = [0u8; 8];
        match nix::unistd::read(w.event_fd(), &mut buf) {
            Ok(8) => u64::from_ne_bytes(buf),
            _ => 0,
        }
    }

    /// The promoted engine's case: the dead engine still holds most of the
    /// device. The wake returns at once, the grower backs what fits and
    /// waits; when the dead engine's memory comes back it backs the rest,
    /// and what was written in the first chunk is still there.
    #[test]
    fn a_wake_grows_into_what_fits_then_into_memory_that_comes_back() {
        let (memory, mapper) = device(8);
        let dead = hog(&mapper, 6);
        let mut kv = cache(&mapper, 8, Duration::from_secs(30));
        assert_eq!(kv.growth(), Growth::Reserved);
        assert_eq!(
            kv.wake(0).unwrap(),
            0,
            "min 0: nothing backed on the caller's thread"
        );
        let w = kv.watch();
        assert_eq!(w.wait_backed(2 * CHUNK, Duration::from_secs(10)), 2 * CHUNK);
        assert_eq!(kv.growth(), Growth::Growing, "{}", w.info_json());
        assert_eq!(memory.available(), 0);
        assert!(events(&w) >= 1, "the event fd tells of the growth");
        kv.with_backed_mut(|b| {
            assert_eq!(
                b.len() as u64,
                2 * CHUNK,
                "only the backed prefix is reachable"
            );
            b[CHUNK as usize + 5] = 42;
        });
        // Not enough memory for more, however long one waits for it.
        assert_eq!(
            w.wait_backed(3 * CHUNK, Duration::from_millis(30)),
            2 * CHUNK
        );
        drop(dead);
        assert_eq!(w.wait_backed(8 * CHUNK, Duration::from_secs(10)), 8 * CHUNK);
        assert_eq!(kv.growth(), Growth::Backed);
        assert!(w.full_after().is_some());
        let info: serde_json::Value = serde_json::from_str(&w.info_json()).unwrap();
        assert_eq!(info["growth"], "backed");
        assert_eq!(info["backed"], 8 * CHUNK);
        assert!(info["full_after_ms"].as_f64().is_some(), "{info}");
        assert_eq!(
            kv.with_backed_mut(|b| (b.len() as u64, b[CHUNK as usize + 5])),
            (8 * CHUNK, 42)
        );
        kv.release().unwrap();
        assert_eq!(memory.used(), 0, "every chunk given back");
        assert_eq!((kv.backed(), kv.growth()), (0, Growth::Reserved));
    }

    /// `min` is backed on the caller's thread, waiting for memory up to
    /// the OOM wait, or the wake fails with OutOfMemory and starts nothing.
    #[test]
    fn a_wake_waits_for_its_minimum_or_fails_out_of_memory() {
        let (memory, mapper) = device(4);
        let dead = hog(&mapper, 4);
        let mut kv = cache(&mapper, 4, Duration::from_millis(30));
        let err = kv.wake(CHUNK).unwrap_err();
        assert!(matches!(err, Error::OutOfMemory(_)), "{err}");
        assert!(err.to_string().contains("GMS_KV_OOM_WAIT_MS"), "{err}");
        assert_eq!((kv.backed(), memory.used()), (0, 4 * CHUNK));

        kv.set_oom_wait(Duration::from_secs(30));
        let giver = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            drop(dead);
        });
        let backed = kv.wake(CHUNK + 1).unwrap();
        assert!(
            backed >= 2 * CHUNK,
            "the minimum, in whole chunks: {backed}"
        );
        giver.join().unwrap();
        assert_eq!(
            kv.watch().wait_backed(4 * CHUNK, Duration::from_secs(10)),
            4 * CHUNK
        );
    }

    /// Memory that never comes back: the grower gives up after the OOM
    /// wait without progress, keeps what it has, and a waiter is told at
    /// once rather than at its timeout. A later wake tries again.
    #[test]
    fn a_grower_with_no_memory_coming_back_stalls_and_keeps_what_it_has() {
        let (memory, mapper) = device(4);
        let dead = hog(&mapper, 3);
        let mut kv = cache(&mapper, 4, Duration::from_millis(40));
        kv.wake(0).unwrap();
        let w = kv.watch();
        let t = Instant::now();
        assert_eq!(w.wait_backed(4 * CHUNK, Duration::from_secs(60)), CHUNK);
        assert!(
            t.elapsed() < Duration::from_secs(50),
            "the stall ends the wait"
        );
        assert!(
            matches!(kv.growth(), Growth::Stalled { .. }),
            "{:?}",
            kv.growth()
        );
        assert!(w.info_json().contains("\"stalled\""), "{}", w.info_json());
        assert_eq!(memory.used(), 4 * CHUNK);
        drop(dead);
        kv.set_oom_wait(Duration::from_secs(30));
        kv.wake(0).unwrap();
        assert_eq!(w.wait_backed(4 * CHUNK, Duration::from_secs(10)), 4 * CHUNK);
        assert_eq!(kv.growth(), Growth::Backed);
    }

    /// A release or a drop in the middle of a growth stops the grower
    /// first, then gives every chunk back: nothing stays counted.
    #[test]
    fn release_and_drop_stop_the_grower_and_give_every_chunk_back() {
        let (memory, mapper) = device(4);
        let dead = hog(&mapper, 2);
        let mut kv = cache(&mapper, 4, Duration::from_secs(60));
        kv.wake(0).unwrap();
        assert_eq!(
            kv.watch().wait_backed(2 * CHUNK, Duration::from_secs(10)),
            2 * CHUNK
        );
        let t = Instant::now();
        kv.release().unwrap();
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the pausing grower stops at once"
        );
        assert_eq!((kv.backed(), memory.used()), (0, 2 * CHUNK));
        kv.wake(0).unwrap();
        assert_eq!(
            kv.watch().wait_backed(2 * CHUNK, Duration::from_secs(10)),
            2 * CHUNK
        );
        drop(kv);
        assert_eq!(
            memory.used(),
            2 * CHUNK,
            "only the other range's memory is counted"
        );
        drop(dead);
        assert_eq!(memory.used(), 0);
    }

    /// The whole cache at once: waits for memory that comes back, and a
    /// failure leaves nothing backed.
    #[test]
    fn materialise_waits_for_all_of_it_or_leaves_nothing_backed() {
        let (memory, mapper) = device(4);
        let dead = hog(&mapper, 2);
        let mut kv = cache(&mapper, 4, Duration::from_millis(20));
        assert!(matches!(kv.materialise(), Err(Error::OutOfMemory(_))));
        assert_eq!((kv.backed(), memory.used()), (0, 2 * CHUNK));
        kv.set_oom_wait(Duration::from_secs(30));
        let giver = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            drop(dead);
        });
        kv.materialise().unwrap();
        giver.join().unwrap();
        assert_eq!((kv.backed(), kv.growth()), (4 * CHUNK, Growth::Backed));
        assert!(
            kv.with_range(|r| r.bytes().is_some()),
            "a whole range is readable as one"
        );
    }

    /// The last chunk of a range that is not a whole number of chunks is
    /// shorter; the limit counts exactly what is backed.
    #[test]
    fn the_last_chunk_is_the_rest_of_the_range() {
        let (memory, mapper) = device(4);
        let page = 4096;
        let mut kv = KvCache::new(mapper.reserve(2 * CHUNK + page, None).unwrap()).unwrap();
        kv.materialise().unwrap();
        assert_eq!(
            (kv.backed(), memory.used()),
            (2 * CHUNK + page, 2 * CHUNK + page)
        );
    }
}
