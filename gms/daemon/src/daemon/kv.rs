//! The pair's KV pool: device memory that gmsd owns, as it owns the
//! weights, and that one engine at a time may write, the holder of the
//! pair's election lock.
//!
//! Why it exists: an engine's KV cache died with it, so a promoted engine
//! recomputed every cut request from its prompt (seconds) and started with
//! a cold prefix cache; and a cache that filled the device had to wait for
//! the dead context's memory. A pool that gmsd owns outlives every engine:
//! the promoted engine maps the same pages (at the same address) and goes
//! on from what its predecessor committed.
//!
//! The write lease is a connection whose first and only request is
//! `kv_pool`, as a weights lease is one that said `hello`; it is granted
//! only to the lock's holder, proven by a descriptor sent with the request
//! through which the pair's election lock is held (the engine kit's lock
//! holder sends the engine a copy of its own). gmsd reads the lock off its
//! own copy's `/proc/self/fdinfo`: no capability, no `/proc/locks` (whose
//! read waits out an RCU grace period), no look at the engine's `/proc`
//! (which a gmsd without capabilities may not read). Granting it to a new holder takes nothing from the old
//! one, which is dying (it lost the lock): a mapping cannot be revoked. So
//! the grant carries a **fence**, an eventfd gmsd makes readable once every
//! engine that held the lease before is gone (its pidfd readable: the
//! process reaped or a zombie, after the kernel closed its files, which for
//! a CUDA process is after the driver tore its context down). Until then
//! the new writer writes only where no predecessor could have been writing
//! (docs/engine-contract.md, "Carrying the KV cache").
//!
//! The pool is made by the first grant, with its index (host memory: a
//! memfd the engines use for their block table and prefix index), and
//! lives until `reset` (the supervisor's cold restart) or gmsd's end; a
//! pool made anew has a new id, so an index that names another pool is
//! never trusted.

use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};
use nix::sys::memfd::{memfd_create, MFdFlags};
use nix::unistd::ftruncate;

use gms::holder::{self, FileId};
use gms::protocol::{Response, MAX_KV_CHUNKS};
use gms::status::KvReport;
use gms::{Access, Error, Result};

use super::pool::{Pool, Writer};
use super::{Daemon, State};

/// How often a fence thread looks whether it was superseded.
const FENCE_LOOK: Duration = Duration::from_millis(250);

type Reply = (Response, Vec<OwnedFd>);

impl Daemon {
    /// `kv_pool`: the write lease of the pair's KV pool, for the lock's
    /// holder only; the pool made at the first grant.
    pub(super) fn kv_pool(
        &self,
        conn_id: u64,
        proof: OwnedFd,
        size: u64,
        index_bytes: u64,
        va: u64,
    ) -> Result<Reply> {
        let op = "kv_pool";
        let pid = {
            let st = self.lock();
            let conn = st
                .connections
                .get(&conn_id)
                .ok_or_else(|| Error::Backend(format!("connection {conn_id} vanished")))?;
            if conn.said_hello || conn.kv_writer || conn.lease.is_some() {
                return Err(Error::NotPermitted {
                    op: op.into(),
                    why: "kv_pool is the first and only request of its connection".into(),
                });
            }
            conn.pid
        };
        let lock = self.config.lock.ok_or_else(|| Error::NotPermitted {
            op: op.into(),
            why: "this gmsd was started without --lock, so it cannot tell the lock's \
                  holder: no engine may write a KV pool"
                .into(),
        })?;
        if let Err(seen) = proves_the_lock(&proof, lock) {
            return Err(Error::NotPermitted {
                op: op.into(),
                why: format!(
                    "pid {pid}'s proof does not hold the pair's election lock ({seen}): \
                     only the active engine writes the KV pool"
                ),
            });
        }
        drop(proof);
        let pidfd = Arc::new(pidfd_open(pid)?);
        let made = if self.lock().kv.is_none() {
            Some(self.make_pool(size, index_bytes, va)?)
        } else {
            None
        };
        let mut st = self.lock();
        // A pool another grant made meanwhile stays; this one's goes.
        let created = made.is_some() && st.kv.is_none();
        if created {
            st.kv = made;
        }
        let st = &mut *st;
        let conn = st
            .connections
            .get_mut(&conn_id)
            .ok_or_else(|| Error::Backend(format!("connection {conn_id} vanished")))?;
        conn.kv_writer = true;
        conn.said_hello = true;
        let pool = st
            .kv
            .as_mut()
            .ok_or_else(|| Error::Backend("the KV pool vanished".into()))?;
        let mut fds = pool
            .exported
            .iter()
            .map(|fd| {
                fd.try_clone()
                    .map_err(|e| Error::Backend(format!("dup of the exported KV pool: {e}")))
            })
            .collect::<Result<Vec<_>>>()?;
        let index = pool
            .index
            .try_clone()
            .map_err(|e| Error::Backend(format!("dup of the KV index: {e}")))?;
        // Everyone who wrote before and may not be gone yet.
        if let Some(old) = pool.writer.take() {
            pool.earlier.push(old.pidfd);
        }
        pool.earlier.retain(|p| !gone(p));
        if let Some(stop) = pool.fence_stop.take() {
            stop.store(true, Ordering::Relaxed);
        }
        let event = EventFd::from_value_and_flags(0, EfdFlags::EFD_CLOEXEC)
            .map_err(|e| Error::sys("eventfd for the KV fence", e))?;
        let fence = event
            .as_fd()
            .try_clone_to_owned()
            .map_err(|e| Error::Backend(format!("dup of the KV fence: {e}")))?;
        let fenced = pool.earlier.is_empty();
        if fenced {
            event
                .write(1)
                .map_err(|e| Error::sys("writing the KV fence", e))?;
        } else {
            let stop = Arc::new(AtomicBool::new(false));
            pool.fence_stop = Some(stop.clone());
            spawn_fence(pool.id, pool.earlier.clone(), event, stop)?;
        }
        pool.grants += 1;
        pool.writer = Some(Writer {
            conn: conn_id,
            pid,
            pidfd,
        });
        tracing::info!(
            pool = pool.id,
            pid,
            created,
            fenced,
            waits_for = pool.earlier.len(),
            "KV pool write lease granted"
        );
        fds.extend([index, fence]);
        Ok((
            Response::KvGranted {
                pool: pool.id,
                size: pool.size,
                index_bytes: pool.index_bytes,
                va: pool.va,
                created,
                fenced,
                chunk: pool.chunk,
            },
            fds,
        ))
    }

    /// A new pool: memory of `size` (rounded up), within the daemon's
    /// byte limit, and its zeroed index.
    fn make_pool(&self, size: u64, index_bytes: u64, va: u64) -> Result<Pool> {
        let gran = self.backend.granularity();
        let size = size
            .checked_next_multiple_of(gran)
            .ok_or_else(|| Error::Invalid(format!("KV pool size {size} overflows")))?;
        if va % gran != 0 {
            return Err(Error::Invalid(format!(
                "address {va:#x} is not a multiple of the granularity {gran}"
            )));
        }
        let used: u64 = {
            let st = self.lock();
            [&st.working, &st.committed]
                .into_iter()
                .flatten()
                .map(|s| s.layout.bytes())
                .sum()
        };
        if used.saturating_add(size) > self.config.limits.max_bytes {
            return Err(Error::LimitExceeded(format!(
                "a KV pool of {size} bytes on top of {used} exceeds the limit of {} bytes",
                self.config.limits.max_bytes
            )));
        }
        // Allocations of the configured size, fewer and larger where the
        // grant's descriptors would not fit one message.
        let chunk = self
            .config
            .kv_chunk
            .max(size.div_ceil(MAX_KV_CHUNKS as u64))
            .checked_next_multiple_of(gran)
            .ok_or_else(|| Error::Invalid(format!("KV pool chunk for {size} bytes overflows")))?
            .min(size);
        let (mut memory, mut exported) = (Vec::new(), Vec::new());
        let mut at = 0;
        while at < size {
            let len = chunk.min(size - at);
            let m = self.backend.allocate(len, "kv")?;
            exported.push(m.export(Access::ReadWrite)?);
            memory.push(m);
            at += len;
        }
        let index = memfd_create(c"gms-kv-index", MFdFlags::MFD_CLOEXEC)
            .map_err(|e| Error::sys("memfd_create(gms-kv-index)", e))?;
        let len = i64::try_from(index_bytes)
            .map_err(|_| Error::Invalid(format!("KV index of {index_bytes} bytes")))?;
        ftruncate(&index, len).map_err(|e| Error::sys("ftruncate of the KV index", e))?;
        Ok(Pool {
            id: new_pool_id(),
            size,
            va,
            index_bytes,
            chunk,
            exported,
            memory,
            index,
            grants: 0,
            writer: None,
            earlier: Vec::new(),
            fence_stop: None,
        })
    }
}

impl State {
    /// What the status report says of the pool.
    pub(super) fn kv_report(&self) -> Option<KvReport> {
        let pool = self.kv.as_ref()?;
        Some(KvReport {
            pool: pool.id,
            size: pool.size,
            index_bytes: pool.index_bytes,
            va: pool.va,
            grants: pool.grants,
            writer_pid: pool.writer.as_ref().map(|w| w.pid),
            writer_connected: pool
                .writer
                .as_ref()
                .is_some_and(|w| self.connections.contains_key(&w.conn)),
            fence_waits_for: pool.earlier.iter().filter(|p| !gone(p)).count(),
        })
    }

    /// Bytes of the pool's memory, resident as the kernel counts them.
    pub(super) fn kv_bytes(&self) -> (u64, u64) {
        self.kv.as_ref().map_or((0, 0), |p| {
            let resident = p.memory.iter().map(|m| m.resident_bytes().unwrap_or(0));
            (p.size, resident.sum())
        })
    }
}

/// Whether `proof` is a descriptor of the lock file through which its
/// exclusive flock is held: its identity by `fstat`, the lock by this
/// process's own `fdinfo` of it (the kernel lists there the flocks held
/// through that open file). Err: what it is instead.
fn proves_the_lock(proof: &OwnedFd, lock: FileId) -> std::result::Result<(), String> {
    use std::os::fd::AsRawFd;
    let st = nix::sys::stat::fstat(proof.as_fd()).map_err(|e| format!("fstat: {e}"))?;
    let file = FileId::from_stat(st.st_dev, st.st_ino);
    if file != lock {
        return Err("a descriptor of another file".into());
    }
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", proof.as_raw_fd()))
        .map_err(|e| format!("reading its fdinfo: {e}"))?;
    if holder::fdinfo_holds(&info, lock) {
        Ok(())
    } else {
        Err("no exclusive flock is held through it".into())
    }
}

fn pidfd_open(pid: i32) -> Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new
    // descriptor or -1; no memory is passed.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(Error::sys(
            format!("pidfd_open({pid}) of the KV pool's writer"),
            nix::errno::Errno::last(),
        ));
    }
    let fd = i32::try_from(fd).map_err(|_| Error::Backend("pidfd out of range".into()))?;
    // SAFETY: the kernel just returned this descriptor, and nothing else
    // owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Whether the process behind `pidfd` is gone (its pidfd readable).
fn gone(pidfd: &OwnedFd) -> bool {
    let mut fds = [PollFd::new(pidfd.as_fd(), PollFlags::POLLIN)];
    matches!(poll(&mut fds, PollTimeout::ZERO), Ok(n) if n > 0)
}

/// A thread that makes `event` readable once every one of `earlier` is
/// gone, unless `stop` is set first.
fn spawn_fence(
    pool: u64,
    mut earlier: Vec<Arc<OwnedFd>>,
    event: EventFd,
    stop: Arc<AtomicBool>,
) -> Result<()> {
    std::thread::Builder::new()
        .name("kv-fence".into())
        .spawn(move || {
            let started = std::time::Instant::now();
            while !earlier.is_empty() {
                if stop.load(Ordering::Relaxed) {
                    return;
                }
                let mut fds: Vec<PollFd> = earlier
                    .iter()
                    .map(|p| PollFd::new(p.as_fd(), PollFlags::POLLIN))
                    .collect();
                let timeout = PollTimeout::try_from(FENCE_LOOK).unwrap_or(PollTimeout::MAX);
                match poll(&mut fds, timeout) {
                    Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                    Err(e) => {
                        tracing::warn!(pool, "KV fence: poll: {e}; the fence stays closed");
                        return;
                    }
                }
                drop(fds);
                earlier.retain(|p| !gone(p));
            }
            if stop.load(Ordering::Relaxed) {
                return;
            }
            match event.write(1) {
                Ok(_) => tracing::info!(
                    pool,
                    after_ms = started.elapsed().as_secs_f64() * 1e3,
                    "KV fence passed: every earlier writer is gone"
                ),
                Err(e) => tracing::warn!(pool, "KV fence: writing the eventfd: {e}"),
            }
        })
        .map(|_| ())
        .map_err(|e| Error::Backend(format!("starting the KV fence thread: {e}")))
}

/// A pool id no earlier pool of this host had: the clock in nanoseconds
/// mixed with the daemon's pid (never 0).
fn new_pool_id() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut x = nanos ^ (u64::from(std::process::id()) << 40);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (x ^ (x >> 31)).max(1)
}

/// What `reset` does to the pool: refused while a writer's connection is
/// open, else the pool goes.
pub(super) fn reset_pool(st: &mut State) -> Result<Option<u64>> {
    if st.connections.values().any(|c| c.kv_writer) {
        return Err(Error::NotPermitted {
            op: "reset".into(),
            why: "the KV pool's write lease is held".into(),
        });
    }
    Ok(st.kv.take().map(|p| p.id))
}
