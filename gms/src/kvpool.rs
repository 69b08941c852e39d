//! The engine side of the pair's KV pool: the write lease (its own
//! connection), the pool mapped read-write at the pool's address, its
//! index, and the fence.
//!
//! Why apart from [`crate::kv`]: that cache is an engine's own memory and
//! dies with it; this pool is gmsd's and outlives every engine, so what is
//! in it must be read with care. The rules an engine follows with it are
//! docs/engine-contract.md's ("Carrying the KV cache"): what the index
//! says is committed may be read at once; blocks an earlier writer may
//! still have been writing are written only after [`Fence::passed`].
//!
//! Ownership: a [`KvPool`] owns the lease's connection (dropping it ends
//! the lease), the range the pool is mapped over, the index's descriptor
//! and the fence's, and the thread that maps the pool's allocations the
//! grant left to it (stopped and joined before the range is unmapped).
//! Each allocation's descriptor is closed once it is mapped: the mapping
//! keeps the memory.

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

use crate::client::{open, receive_response, send_request, unexpected};
use crate::mapper::{Access, Mapper, Range};
use crate::protocol::{kv_chunks, Request, Response};
use crate::{Error, Result};

/// Addresses for the pair's KV pool, reserved before this engine holds
/// its lease ([`KvPool::ask_in`]): where the pool lives when the gmsd at
/// `socket` has one (`placed`), else `size` bytes (rounded up to
/// `granularity`) wherever the mapper puts them, where this engine makes
/// the pool if it is the first to be granted it. `current` is what an
/// earlier call reserved: it is kept while there is no pool, or while the
/// pool's address cannot be reserved here, so that asking again never
/// moves addresses work was captured over for nothing. A pool that lives
/// at an address this process cannot reserve is not placed: the grant
/// then maps it where it lives (and fails if that is taken).
///
/// It also makes room in this process's descriptor table for the grant's
/// descriptors ([`GRANT_ROOM`]), so that receiving them, on a failover's
/// path, never waits for the table to grow ([`crate::wire::make_room`]).
pub fn reserve_ahead<M: Mapper>(
    mapper: &M,
    socket: &Path,
    size: u64,
    granularity: u64,
    current: Option<M::Range>,
) -> Result<Reserved<M::Range>> {
    let size = size
        .checked_next_multiple_of(granularity.max(1))
        .ok_or_else(|| Error::Invalid(format!("KV pool size {size} overflows")))?;
    crate::wire::make_room(GRANT_ROOM)?;
    let pool = crate::client::status(socket)?.kv;
    let current = match (&pool, current) {
        (Some(kv), Some(range)) if range.addr() == kv.va && range.len() == kv.size => {
            return Ok(Reserved {
                range,
                placed: true,
            });
        }
        (_, current) => current,
    };
    if let Some(kv) = pool {
        if let Ok(range) = mapper.reserve(kv.size, Some(kv.va)) {
            if range.addr() == kv.va {
                return Ok(Reserved {
                    range,
                    placed: true,
                });
            }
        }
    }
    let range = match current {
        Some(range) => range,
        None => mapper.reserve(size, None)?,
    };
    Ok(Reserved {
        range,
        placed: false,
    })
}

/// The descriptors [`reserve_ahead`] makes room for: the most one answer
/// carries (a grant: an allocation's each, the index's and the fence's),
/// and as many again for what the engine opens before its grant (the
/// lock's descriptor from its holder, handed connections), which take the
/// lowest free slots first.
pub const GRANT_ROOM: usize = 2 * crate::protocol::MAX_FDS_PER_MESSAGE;

/// What [`reserve_ahead`] reserved.
pub struct Reserved<R: Range> {
    pub range: R,
    /// At the address of the pool that exists (false: no pool yet, or its
    /// address was taken in this process).
    pub placed: bool,
}

/// The eventfd gmsd makes readable once every engine that wrote the pool
/// before this one is gone.
#[derive(Debug)]
pub struct Fence {
    fd: OwnedFd,
    /// Seen readable once: it stays so (nobody reads the count).
    passed: AtomicBool,
}

impl Fence {
    /// Whether no earlier writer can write any more (never waits).
    pub fn passed(&self) -> bool {
        self.wait(Duration::ZERO)
    }

    /// Waits up to `timeout` for the fence; whether it passed.
    pub fn wait(&self, timeout: Duration) -> bool {
        if self.passed.load(Ordering::Acquire) {
            return true;
        }
        let mut fds = [PollFd::new(self.fd.as_fd(), PollFlags::POLLIN)];
        let t = PollTimeout::try_from(timeout).unwrap_or(PollTimeout::MAX);
        let open = matches!(poll(&mut fds, t), Ok(n) if n > 0);
        if open {
            self.passed.store(true, Ordering::Release);
        }
        open
    }

    /// The eventfd, for an event loop (readable once passed; do not read it).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// The pool's write lease and its memory, mapped read-write: all of it
/// ([`Asked::granted`]), or its first allocations at the grant and the
/// rest on a thread of libgms while the engine serves
/// ([`Asked::granted_first`], [`KvPool::mapped`]).
pub struct KvPool<R: Range + 'static> {
    pool: u64,
    created: bool,
    addr: u64,
    len: u64,
    // Field order: the mapping thread is stopped and joined before the
    // range (its last reference) is unmapped, then the descriptors close.
    mapping: Mapping,
    _range: Arc<Mutex<R>>,
    index: File,
    index_bytes: u64,
    fence: Fence,
    grant: GrantTimes,
    mapped_at_grant: u64,
    /// The lease: dropped last.
    _lease: UnixStream,
}

/// Where a grant's time went: gmsd's answer (the request sent → the
/// answer read) and the mapping of what was mapped before the grant
/// returned (import, map and access).
#[derive(Clone, Copy, Debug, Default)]
pub struct GrantTimes {
    pub answer: Duration,
    pub map: Duration,
}

/// How much of the pool is mapped, from its start; shared with the thread
/// that maps the rest. Cloned handles watch one pool.
#[derive(Clone, Debug)]
pub struct MapWatch(Arc<(Mutex<MapState>, Condvar)>);

#[derive(Debug)]
struct MapState {
    mapped: u64,
    error: Option<String>,
    /// When the whole pool was mapped, after the grant returned.
    done_after: Option<Duration>,
}

impl MapWatch {
    fn new(mapped: u64) -> MapWatch {
        let state = MapState {
            mapped,
            error: None,
            done_after: None,
        };
        MapWatch(Arc::new((Mutex::new(state), Condvar::new())))
    }

    fn state(&self) -> MutexGuard<'_, MapState> {
        self.0 .0.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn update(&self, f: impl FnOnce(&mut MapState)) {
        f(&mut self.state());
        self.0 .1.notify_all();
    }

    /// Bytes mapped from the pool's start.
    pub fn mapped(&self) -> u64 {
        self.state().mapped
    }

    /// Why the rest of the pool could not be mapped (the mapped part stays
    /// usable; the rest never will be).
    pub fn error(&self) -> Option<String> {
        self.state().error.clone()
    }

    /// How long the rest took, once the whole pool is mapped.
    pub fn done_after(&self) -> Option<Duration> {
        self.state().done_after
    }

    /// Waits up to `timeout` until `bytes` are mapped or the mapping
    /// failed; the bytes mapped then.
    pub fn wait_mapped(&self, bytes: u64, timeout: Duration) -> u64 {
        let deadline = Instant::now() + timeout;
        let mut st = self.state();
        while st.mapped < bytes && st.error.is_none() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            st = self
                .0
                 .1
                .wait_timeout(st, left)
                .map(|(g, _)| g)
                .unwrap_or_else(|p| p.into_inner().0);
        }
        st.mapped
    }
}

/// The thread that maps what the grant did not, and how to stop it.
struct Mapping {
    watch: MapWatch,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for Mapping {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            // It ends after the allocation it is mapping, if any.
            let _ = t.join();
        }
    }
}

/// One allocation of the pool: its offset, its length, its descriptor.
type Part = (u64, u64, OwnedFd);

/// Maps `parts` into `range` in order, saying so in `watch` after each.
fn map_rest<R: Range>(range: &Mutex<R>, parts: Vec<Part>, watch: &MapWatch, stop: &AtomicBool) {
    let t0 = Instant::now();
    for (offset, len, fd) in parts {
        if stop.load(Ordering::Acquire) {
            return;
        }
        let mapped = range.lock().unwrap_or_else(|p| p.into_inner()).map_part(
            offset,
            len,
            fd.as_fd(),
            Access::ReadWrite,
        );
        drop(fd);
        match mapped {
            Ok(()) => watch.update(|st| st.mapped = offset + len),
            Err(e) => {
                watch.update(|st| {
                    st.error = Some(format!(
                        "mapping the KV pool's {len} bytes at +{offset:#x}: {e}"
                    ))
                });
                return;
            }
        }
    }
    watch.update(|st| st.done_after = Some(t0.elapsed()));
}

/// A `kv_pool` request sent, its answer not read yet ([`KvPool::ask`]).
pub struct Asked<R: Range> {
    range: R,
    sock: UnixStream,
    req: Request,
    sent: Instant,
}

impl<R: Range + 'static> Asked<R> {
    /// Waits for gmsd's answer and maps the whole pool (see
    /// [`KvPool::open`]).
    pub fn granted<M: Mapper<Range = R>>(self, mapper: &M) -> Result<KvPool<R>> {
        self.granted_first(mapper, u64::MAX)
    }

    /// Waits for gmsd's answer and maps the pool's allocations that hold
    /// its first `first` bytes (the first one at least); a thread of
    /// libgms maps the others, in order, while the engine goes on: use
    /// only the first [`KvPool::mapped`] bytes until they are all mapped.
    /// A pool that fills a GPU is tens of milliseconds of driver calls to
    /// map, on a failover's path, while the driver tears the dead
    /// engine's context down; its first allocation is one or two.
    pub fn granted_first<M: Mapper<Range = R>>(self, mapper: &M, first: u64) -> Result<KvPool<R>> {
        let Asked {
            mut range,
            sock,
            req,
            sent,
        } = self;
        let (granted, mut fds) = receive_response(&sock)?;
        let answered = Instant::now();
        let Response::KvGranted {
            pool,
            size: got,
            index_bytes,
            va,
            created,
            fenced: _,
            chunk,
        } = granted
        else {
            return Err(unexpected(&req, &granted));
        };
        let chunks = kv_chunks(got, chunk);
        if fds.len() != chunks + 2 {
            return Err(Error::Malformed(format!(
                "kv_granted of {chunks} allocations with {} descriptors",
                fds.len()
            )));
        }
        let (fence, index) = match (fds.pop(), fds.pop()) {
            (Some(fence), Some(index)) => (fence, index),
            _ => {
                return Err(Error::Malformed(
                    "kv_granted without its index and fence".into(),
                ))
            }
        };
        if got != range.len() || va != range.addr() {
            // The pool was made by an engine before this one: map it where
            // that one did.
            drop(range);
            range = mapper.reserve(got, Some(va))?;
            if range.addr() != va {
                return Err(Error::AddressConflict(format!(
                    "the KV pool lives at {va:#x}, which this process could not reserve \
                     (got {:#x})",
                    range.addr()
                )));
            }
        }
        let chunk = if chunks == 1 { got } else { chunk };
        let mut parts = fds
            .into_iter()
            .enumerate()
            .map(|(i, fd)| {
                let offset = i as u64 * chunk;
                (offset, chunk.min(got - offset), fd)
            })
            .peekable();
        let mut mapped = 0;
        while let Some((offset, len, fd)) =
            parts.next_if(|(offset, _, _)| *offset == 0 || *offset < first)
        {
            range.map_part(offset, len, fd.as_fd(), Access::ReadWrite)?;
            mapped = offset + len;
        }
        let grant = GrantTimes {
            answer: answered.duration_since(sent),
            map: answered.elapsed(),
        };
        let rest: Vec<Part> = parts.collect();
        let range = Arc::new(Mutex::new(range));
        let mut mapping = Mapping {
            watch: MapWatch::new(mapped),
            stop: Arc::new(AtomicBool::new(false)),
            thread: None,
        };
        if !rest.is_empty() {
            let (r, w, stop) = (range.clone(), mapping.watch.clone(), mapping.stop.clone());
            let spawned = std::thread::Builder::new()
                .name("gms-kv-pool-map".into())
                .spawn(move || map_rest(&r, rest, &w, &stop));
            mapping.thread =
                Some(spawned.map_err(|e| Error::io("spawning the KV pool's mapper", e))?);
        }
        Ok(KvPool {
            pool,
            created,
            addr: va,
            len: got,
            mapping,
            _range: range,
            index: File::from(index),
            index_bytes,
            fence: Fence {
                fd: fence,
                passed: AtomicBool::new(false),
            },
            grant,
            mapped_at_grant: mapped,
            _lease: sock,
        })
    }
}

impl<R: Range + 'static> KvPool<R> {
    /// Asks the gmsd at `socket` for the write lease of the pair's KV pool,
    /// showing `proof`, a descriptor through which the pair's election
    /// lock is held (the engine kit's `LockProof`), and maps the pool
    /// read-write: at the pool's address when it exists (where every
    /// engine of the pair maps it), else at an address this process
    /// reserves for `size` bytes. `index_bytes` is the index a new pool
    /// gets. [`KvPool::ask`] and [`Asked::granted`] in one.
    pub fn open<M: Mapper<Range = R>>(
        mapper: &M,
        socket: &Path,
        proof: BorrowedFd<'_>,
        size: u64,
        index_bytes: u64,
        granularity: u64,
    ) -> Result<KvPool<R>> {
        Self::ask(mapper, socket, proof, size, index_bytes, granularity)?.granted(mapper)
    }

    /// The first half of [`KvPool::open`]: reserves the addresses, connects
    /// and sends the request with its proof, and returns without waiting
    /// for the answer. The proof may be closed as soon as this returns (the
    /// kernel holds the copy in flight), and the engine may go on (say
    /// `READY=1`, serve what needs no KV) while gmsd answers.
    pub fn ask<M: Mapper<Range = R>>(
        mapper: &M,
        socket: &Path,
        proof: BorrowedFd<'_>,
        size: u64,
        index_bytes: u64,
        granularity: u64,
    ) -> Result<Asked<R>> {
        let size = size
            .checked_next_multiple_of(granularity.max(1))
            .ok_or_else(|| Error::Invalid(format!("KV pool size {size} overflows")))?;
        Self::ask_in(mapper.reserve(size, None)?, socket, proof, index_bytes)
    }

    /// [`KvPool::ask`] into addresses reserved before ([`reserve_ahead`]):
    /// an engine that reserved them while parked, where the pool lives,
    /// has every address it captured work over (a CUDA graph) valid once
    /// the pool is granted. A new pool is made `range.len()` bytes.
    pub fn ask_in(
        range: R,
        socket: &Path,
        proof: BorrowedFd<'_>,
        index_bytes: u64,
    ) -> Result<Asked<R>> {
        let size = range.len();
        let sock = open(socket)?;
        let req = Request::KvPool {
            size,
            index_bytes,
            va: range.addr(),
        };
        send_request(&sock, &req, &[proof]).map_err(|e| match e {
            // A gmsd that grants no KV pool refuses descriptors at the
            // kernel (SO_PASSRIGHTS off), so the proof never leaves.
            Error::Sys {
                source: nix::errno::Errno::EPERM,
                ..
            } => Error::NotPermitted {
                op: "kv_pool".into(),
                why: "gmsd refuses descriptors: it was started without --lock, so it \
                      grants no KV pool"
                    .into(),
            },
            other => other,
        })?;
        Ok(Asked {
            range,
            sock,
            req,
            sent: Instant::now(),
        })
    }

    /// The pool's id: another pool (after a reset, or in another gmsd)
    /// has another one.
    pub fn id(&self) -> u64 {
        self.pool
    }

    /// Whether this grant made the pool (nothing is in it yet).
    pub fn created(&self) -> bool {
        self.created
    }

    pub fn addr(&self) -> u64 {
        self.addr
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes mapped from the pool's start (all of it once the mapping
    /// thread is done, or a grant that mapped it all).
    pub fn mapped(&self) -> u64 {
        self.mapping.watch.mapped()
    }

    /// Bytes mapped before the grant returned (the rest by the mapping
    /// thread).
    pub fn mapped_at_grant(&self) -> u64 {
        self.mapped_at_grant
    }

    /// The mapping's progress, to watch without holding the pool.
    pub fn map_watch(&self) -> MapWatch {
        self.mapping.watch.clone()
    }

    /// The index: a memfd of [`Self::index_bytes`], shared by every engine
    /// that holds the lease in turn.
    pub fn index(&self) -> &File {
        &self.index
    }

    pub fn index_bytes(&self) -> u64 {
        self.index_bytes
    }

    pub fn fence(&self) -> &Fence {
        &self.fence
    }

    /// Where the grant's time went.
    pub fn grant_times(&self) -> GrantTimes {
        self.grant
    }
}

impl KvPool<crate::mapper::HostRange> {
    /// Copies `data` into the pool at `offset`. Threads may write disjoint
    /// parts at once; the pool is shared memory, so what another engine
    /// wrote there is simply overwritten.
    pub fn write_at(&self, offset: u64, data: &[u8]) -> Result<()> {
        let at = self.checked(offset, data.len())?;
        // SAFETY: `at .. at + data.len()` lies inside the range, which is
        // mapped read-write (MAP_SHARED over the pool's memfd) for as long
        // as `self` lives; the pool is plain bytes with no Rust invariant,
        // shared with other processes by design.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), at as *mut u8, data.len()) };
        Ok(())
    }

    /// Copies the pool's bytes at `offset` into `out`.
    pub fn read_at(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        let at = self.checked(offset, out.len())?;
        // SAFETY: as in `write_at`: inside the range, mapped for as long as
        // `self` lives; any byte pattern is a valid `u8`.
        unsafe { std::ptr::copy_nonoverlapping(at as *const u8, out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    fn checked(&self, offset: u64, len: usize) -> Result<u64> {
        let end = offset.checked_add(len as u64);
        match end {
            Some(end) if end <= self.mapped() => Ok(self.addr + offset),
            _ => Err(Error::Invalid(format!(
                "{len} bytes at {offset} of a KV pool of {} bytes, {} of them mapped",
                self.len,
                self.mapped()
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mapper::HostMapper;
    use crate::protocol::{decode, encode_response, MAX_REQUEST_BYTES};
    use nix::sys::memfd::{memfd_create, MFdFlags};
    use std::os::unix::net::UnixListener;

    const CHUNK: u64 = 64 << 10;

    fn memfd(len: u64) -> OwnedFd {
        let fd = memfd_create(c"kv-pool-test", MFdFlags::MFD_CLOEXEC).expect("memfd");
        nix::unistd::ftruncate(&fd, len as i64).expect("ftruncate");
        fd
    }

    /// A gmsd stand-in: grants one `kv_pool` request a pool of allocations
    /// of CHUNK bytes whose memfds hold `sizes` bytes, where the engine
    /// asked for it, and holds the lease until the engine closes it.
    fn grant_once(listener: UnixListener, sizes: Vec<u64>) -> JoinHandle<()> {
        std::thread::spawn(move || {
            let (sock, _) = listener.accept().expect("accept");
            let frame = crate::wire::recv(&sock, MAX_REQUEST_BYTES).expect("request");
            let Ok(Request::KvPool { size, va, .. }) = decode(&frame.body, frame.fds.len()) else {
                panic!("not a kv_pool request");
            };
            let mut fds: Vec<OwnedFd> = sizes.iter().map(|&n| memfd(n)).collect();
            fds.extend([memfd(4096), memfd(0)]);
            let resp = Response::KvGranted {
                pool: 9,
                size,
                index_bytes: 4096,
                va,
                created: true,
                fenced: true,
                chunk: CHUNK,
            };
            let body = encode_response(&resp).expect("encode");
            let lent: Vec<BorrowedFd<'_>> = fds.iter().map(AsFd::as_fd).collect();
            crate::wire::send(sock.as_fd(), &body, &lent).expect("answer");
            let _ = crate::wire::recv(&sock, MAX_REQUEST_BYTES);
        })
    }

    fn granted(sizes: Vec<u64>, first: u64) -> (KvPool<crate::mapper::HostRange>, JoinHandle<()>) {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("gms.sock");
        let server = grant_once(UnixListener::bind(&socket).expect("bind"), sizes.clone());
        let mapper = HostMapper::default();
        let proof = memfd(0);
        let size: u64 = CHUNK * sizes.len() as u64;
        let pool = KvPool::ask(&mapper, &socket, proof.as_fd(), size, 4096, 4096)
            .and_then(|a| a.granted_first(&mapper, first))
            .expect("granted");
        (pool, server)
    }

    #[test]
    fn the_first_allocation_at_the_grant_the_rest_after_it() {
        let (pool, server) = granted(vec![CHUNK; 4], 1);
        assert_eq!(pool.mapped_at_grant(), CHUNK);
        let all = pool
            .map_watch()
            .wait_mapped(4 * CHUNK, Duration::from_secs(10));
        assert_eq!(all, 4 * CHUNK);
        assert!(pool.map_watch().done_after().is_some());
        pool.write_at(4 * CHUNK - 8, &[7; 8])
            .expect("the last allocation is writable");
        let mut back = [0; 8];
        pool.read_at(4 * CHUNK - 8, &mut back).expect("read");
        assert_eq!(back, [7; 8]);
        drop(pool);
        server.join().expect("stand-in");
    }

    #[test]
    fn an_allocation_that_cannot_be_mapped_stops_the_mapping_and_says_why() {
        // The third memfd is shorter than an allocation: mapping it would
        // fault, so the mapping thread refuses it and stops there.
        let (pool, server) = granted(vec![CHUNK, CHUNK, CHUNK / 2, CHUNK], 1);
        let got = pool
            .map_watch()
            .wait_mapped(4 * CHUNK, Duration::from_secs(10));
        assert_eq!(got, 2 * CHUNK, "the two allocations before it stay mapped");
        let why = pool.map_watch().error().expect("the failure is said");
        assert!(why.contains(&format!("+{:#x}", 2 * CHUNK)), "{why}");
        assert!(
            pool.write_at(2 * CHUNK, &[1]).is_err(),
            "nothing is written past what is mapped"
        );
        pool.write_at(2 * CHUNK - 1, &[1])
            .expect("what is mapped is usable");
        drop(pool);
        server.join().expect("stand-in");
    }

    #[test]
    fn a_grant_asked_to_map_everything_fails_on_such_an_allocation() {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("gms.sock");
        let server = grant_once(
            UnixListener::bind(&socket).expect("bind"),
            vec![CHUNK, CHUNK / 2],
        );
        let mapper = HostMapper::default();
        let proof = memfd(0);
        let got = KvPool::ask(&mapper, &socket, proof.as_fd(), 2 * CHUNK, 4096, 4096)
            .and_then(|a| a.granted(&mapper));
        assert!(got.is_err(), "granted a pool it could not map");
        drop(got);
        server.join().expect("stand-in");
    }
}
