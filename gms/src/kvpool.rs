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
//! the lease), the range the pool is mapped over (unmapped before the
//! descriptor closes), the index's descriptor and the fence's.

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

use crate::client::{open, receive_response, send_request, unexpected};
use crate::mapper::{Access, Mapper, Range};
use crate::protocol::{Request, Response};
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

/// The pool's write lease and its memory, mapped read-write.
pub struct KvPool<R: Range> {
    pool: u64,
    created: bool,
    // Field order: the range is unmapped before the descriptor closes.
    range: R,
    memory: OwnedFd,
    index: File,
    index_bytes: u64,
    fence: Fence,
    grant: GrantTimes,
    /// The lease: dropped last.
    _lease: UnixStream,
}

/// Where a grant's time went: gmsd's answer (the request sent → the
/// answer read) and the mapping (import, map and access of the pool).
#[derive(Clone, Copy, Debug, Default)]
pub struct GrantTimes {
    pub answer: Duration,
    pub map: Duration,
}

/// A `kv_pool` request sent, its answer not read yet ([`KvPool::ask`]).
pub struct Asked<R: Range> {
    range: R,
    sock: UnixStream,
    req: Request,
    sent: Instant,
}

impl<R: Range> Asked<R> {
    /// Waits for gmsd's answer and maps the pool (see [`KvPool::open`]).
    pub fn granted<M: Mapper<Range = R>>(self, mapper: &M) -> Result<KvPool<R>> {
        let Asked {
            mut range,
            sock,
            req,
            sent,
        } = self;
        let (granted, fds) = receive_response(&sock)?;
        let answered = Instant::now();
        let Response::KvGranted {
            pool,
            size: got,
            index_bytes,
            va,
            created,
            fenced: _,
        } = granted
        else {
            return Err(unexpected(&req, &granted));
        };
        let [memory, index, fence]: [OwnedFd; 3] = fds
            .try_into()
            .map_err(|_| Error::Malformed("kv_granted without its three descriptors".into()))?;
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
        range.map(memory.as_fd(), Access::ReadWrite)?;
        let grant = GrantTimes {
            answer: answered.duration_since(sent),
            map: answered.elapsed(),
        };
        Ok(KvPool {
            pool,
            created,
            range,
            memory,
            index: File::from(index),
            index_bytes,
            fence: Fence {
                fd: fence,
                passed: AtomicBool::new(false),
            },
            grant,
            _lease: sock,
        })
    }
}

impl<R: Range> KvPool<R> {
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
        self.range.addr()
    }

    pub fn len(&self) -> u64 {
        self.range.len()
    }

    pub fn is_empty(&self) -> bool {
        self.range.is_empty()
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

    /// The pool's descriptor (for a device API that imports it).
    pub fn memory_fd(&self) -> BorrowedFd<'_> {
        self.memory.as_fd()
    }

    /// The range the pool is mapped over.
    pub fn range(&self) -> &R {
        &self.range
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
            Some(end) if end <= self.range.len() => Ok(self.range.addr() + offset),
            _ => Err(Error::Invalid(format!(
                "{len} bytes at {offset} of a KV pool of {} bytes",
                self.range.len()
            ))),
        }
    }
}
