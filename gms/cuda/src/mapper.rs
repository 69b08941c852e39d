//! The engine side on a GPU: a [`Mapper`] whose ranges are device virtual
//! address reservations (`cuMemAddressReserve`), into which GMS descriptors
//! are imported and mapped (`cuMemImportFromShareableHandle`, `cuMemMap`,
//! `cuMemSetAccess`), and KV caches are materialised from fresh
//! `cuMemCreate` chunks. The protocol client is unchanged: it only sees
//! [`Range`]s.
//!
//! Every engine of a pair maps the weights at the writer's addresses, so
//! pointers inside the weights (and CUDA graphs captured over them) are the
//! same in every engine. Each process therefore reserves one large address
//! *window* at the same base (`GMS_VA_BASE`) once, and places every GMS
//! range inside it itself: a writer's allocations and KV caches first-fit,
//! a reader's at exactly the writer's addresses. The driver is asked for an
//! address only once per process, for the whole window: on an H200 it
//! honoured large hinted reservations every time but stopped honouring
//! small hinted ones after a few (seen with torch temporaries in the
//! writer's pool), which made per-range hints unusable. If the window
//! cannot be placed at the base, or a reader's range is taken, the mapper
//! fails with `AddressConflict` rather than produce a different layout.
//!
//! The engine needs a current context for all of this: the mapper retains
//! the device's *primary* context, the one the CUDA runtime and PyTorch use,
//! so torch sees the mappings as ordinary device memory.

use std::collections::BTreeMap;
use std::os::fd::BorrowedFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use gms::client::{cuda_socket_name, Client};
use gms::mapper::{Mapper, Range, RangeState};
use gms::protocol::Mode;
use gms::{Access, Error, Result};

use crate::{
    gms_error as cuda_error, Device, DeviceSelector, Driver, PhysicalMemory, PrimaryContext,
    Reservation,
};

/// Where every engine's window starts unless `GMS_VA_BASE` says otherwise.
/// With unified addressing the window must be free in the *host* address
/// space as well: 32 TiB lies above the driver's own placements (from
/// 0x3_0000_0000 up) and below PIE executables (≈ 0x55…) and the mmap
/// region where libraries land (≈ 0x7f…). A window at 0x7f00_0000_0000 was
/// refused by chance in most fresh torch processes on an H200 (host
/// libraries inside it); this base was granted in every process.
pub const DEFAULT_VA_BASE: u64 = 0x2000_0000_0000;

/// Size of the window unless `GMS_VA_WINDOW` says otherwise: address space
/// only (nothing is backed by it), room for the weights and KV cache of a
/// 141 GB H200 with headroom. On an H200 (driver 580) a hinted reservation
/// of up to 512 GiB was granted, 768 GiB and more refused.
pub const DEFAULT_VA_WINDOW: u64 = 256 << 30;

/// KV caches are materialised in chunks of this size: one `cuMemCreate` per
/// chunk. 2 GiB chunks measured 3.8–4.3 ms for 64 GiB on an H200, 512 MiB
/// chunks 91–116 ms.
pub const KV_CHUNK: u64 = 2 << 30;

/// While the device cannot hold a whole [`KV_CHUNK`] (a failover on a GPU
/// whose KV cache fills it: the dead engine's memory is not back yet), a
/// KV range is backed in parts of what is free, in multiples of this...
pub const KV_PART: u64 = 256 << 20;

/// ... leaving this much free for the engine's own allocations (its
/// framework's temporaries while it serves its first requests).
pub const KV_KEEP_FREE: u64 = 512 << 20;

/// How many bytes of a chunk of `want` to create when the device cannot
/// hold all of it and has `free` bytes: a multiple of [`KV_PART`] that
/// leaves [`KV_KEEP_FREE`], or 0 (wait for memory).
fn part_of_chunk(want: u64, free: u64) -> u64 {
    let room = free.saturating_sub(KV_KEEP_FREE);
    (room - room % KV_PART).min(want)
}

/// A primary context shared by a mapper and all its ranges.
struct SharedContext(PrimaryContext);

// SAFETY: a CUDA context handle may be made current on, and used from, any
// thread of the process; the driver serialises what needs serialising.
// `PrimaryContext` holds only the device and context handles.
unsafe impl Send for SharedContext {}
// SAFETY: as above; `make_current` and `synchronize` take `&self` and are
// thread-safe driver calls.
unsafe impl Sync for SharedContext {}

/// Free sub-ranges of a window, by offset. Pure bookkeeping: the driver is
/// not involved, so it is unit-tested without a GPU.
#[derive(Debug)]
struct Extents {
    free: BTreeMap<u64, u64>,
}

impl Extents {
    fn new(len: u64) -> Self {
        Extents {
            free: BTreeMap::from([(0, len)]),
        }
    }

    /// First fit of `len` bytes at an offset aligned to `align`.
    fn take_any(&mut self, len: u64, align: u64) -> Option<u64> {
        let (start, flen, at) = self.free.iter().find_map(|(&start, &flen)| {
            let at = start.checked_next_multiple_of(align)?;
            (at.checked_add(len)? <= start + flen).then_some((start, flen, at))
        })?;
        self.split(start, flen, at, len);
        Some(at)
    }

    /// Claims exactly `[at, at + len)`, if all of it is free.
    fn take_at(&mut self, at: u64, len: u64) -> bool {
        let Some((&start, &flen)) = self.free.range(..=at).next_back() else {
            return false;
        };
        match at.checked_add(len) {
            Some(end) if end <= start + flen => {
                self.split(start, flen, at, len);
                true
            }
            _ => false,
        }
    }

    fn split(&mut self, start: u64, flen: u64, at: u64, len: u64) {
        self.free.remove(&start);
        if at > start {
            self.free.insert(start, at - start);
        }
        let end = at + len;
        if end < start + flen {
            self.free.insert(end, start + flen - end);
        }
    }

    /// Returns `[at, at + len)`, merging it with free neighbours.
    fn give(&mut self, at: u64, len: u64) {
        let mut start = at;
        let mut end = at + len;
        if let Some((&s, &l)) = self.free.range(..at).next_back() {
            if s + l == at {
                self.free.remove(&s);
                start = s;
            }
        }
        if let Some(&l) = self.free.get(&end) {
            self.free.remove(&end);
            end += l;
        }
        self.free.insert(start, end - start);
    }
}

/// This process's GMS address window: one reservation and its free list.
struct Window {
    reservation: Reservation,
    extents: Extents,
    /// The context the window was reserved in, kept retained (and made
    /// current) until the reservation is freed: freeing it after the last
    /// primary-context release would leak the addresses, and the next
    /// window of the process would not get them back.
    context: Arc<SharedContext>,
}

impl Window {
    fn base(&self) -> u64 {
        self.reservation.base()
    }
}

impl Drop for Window {
    fn drop(&mut self) {
        // The reservation (a field) is freed right after this, on this
        // thread: give the thread the context first.
        let _ = self.context.0.make_current();
    }
}

type SharedWindow = Arc<Mutex<Window>>;

/// The process-wide window: every mapper of the process (one per device)
/// shares it, since device addresses are one space per process. It is
/// freed when the last mapper and range are gone.
static WINDOW: Mutex<Weak<Mutex<Window>>> = Mutex::new(Weak::new());

fn lock(window: &SharedWindow) -> MutexGuard<'_, Window> {
    window.lock().unwrap_or_else(|p| p.into_inner())
}

fn shared_window(
    base: u64,
    len: u64,
    granularity: u64,
    context: &Arc<SharedContext>,
) -> Result<SharedWindow> {
    let mut slot = WINDOW.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(w) = slot.upgrade() {
        let have = lock(&w).base();
        if have != base {
            return Err(Error::AddressConflict(format!(
                "this process's GMS window is at {have:#x}, not at {base:#x}"
            )));
        }
        return Ok(w);
    }
    let size = usize::try_from(len)
        .map_err(|_| Error::Config(format!("GMS_VA_WINDOW of {len} bytes exceeds usize")))?;
    let reservation =
        Reservation::reserve(size, granularity as usize, base).map_err(cuda_error(format!(
            "reserving the GMS window of {len} bytes at {base:#x}"
        )))?;
    if reservation.base() != base {
        return Err(Error::AddressConflict(format!(
            "the driver placed the GMS window ({len} bytes) at {:#x} instead of {base:#x}: \
             this process already uses addresses there (open GMS before other device \
             allocations, or set GMS_VA_BASE to the same free region in every engine)",
            reservation.base()
        )));
    }
    let w = Arc::new(Mutex::new(Window {
        reservation,
        extents: Extents::new(len),
        context: Arc::clone(context),
    }));
    *slot = Arc::downgrade(&w);
    Ok(w)
}

/// Makes ranges on one GPU, in this process's primary context.
#[derive(Clone)]
pub struct CudaMapper {
    // Dropped first: the window may still need the context.
    window: SharedWindow,
    device: Device,
    context: Arc<SharedContext>,
    granularity: u64,
}

impl CudaMapper {
    /// Loads the driver, finds the device, retains its primary context
    /// (creating it if this process has none yet: ≈ 0.1–0.2 s on an H200)
    /// and reserves (or joins) the process's GMS window at `GMS_VA_BASE`.
    pub fn open(selector: &DeviceSelector) -> Result<Self> {
        let driver = Driver::load().map_err(cuda_error("loading the CUDA driver"))?;
        let device = driver
            .device(selector)
            .map_err(cuda_error(format!("finding CUDA device {selector}")))?;
        let context = device.retain_primary_context().map_err(cuda_error(format!(
            "retaining the primary context of {}",
            device.uuid()
        )))?;
        let granularity = device
            .granularity(false)
            .map_err(cuda_error(format!("granularity of {}", device.uuid())))?
            as u64;
        let base = env_address("GMS_VA_BASE", DEFAULT_VA_BASE)?;
        let len = env_address("GMS_VA_WINDOW", DEFAULT_VA_WINDOW)?;
        if base % granularity != 0 || len == 0 || len % granularity != 0 {
            return Err(Error::Config(format!(
                "GMS_VA_BASE {base:#x} and GMS_VA_WINDOW {len:#x} must be non-zero multiples of \
                 the device granularity ({granularity} bytes)"
            )));
        }
        let context = Arc::new(SharedContext(context));
        let window = shared_window(base, len, granularity, &context)?;
        Ok(CudaMapper {
            window,
            device,
            context,
            granularity,
        })
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn granularity(&self) -> u64 {
        self.granularity
    }

    /// First address of this process's GMS window.
    pub fn window_base(&self) -> u64 {
        lock(&self.window).base()
    }

    /// The GMS socket of this device in `dir` (`GMS_SOCKET_DIR`).
    pub fn socket_in(&self, dir: &Path) -> PathBuf {
        dir.join(cuda_socket_name(&self.device.uuid().to_string()))
    }

    /// Makes the primary context current on the calling thread.
    pub fn make_current(&self) -> Result<()> {
        self.context
            .0
            .make_current()
            .map_err(cuda_error("making the primary context current"))
    }

    /// Waits for all work queued in the context (before unmapping memory
    /// that a kernel may still be using).
    pub fn synchronize(&self) -> Result<()> {
        self.make_current()?;
        self.context
            .0
            .synchronize()
            .map_err(cuda_error("cuCtxSynchronize"))
    }
}

fn env_address(name: &str, default: u64) -> Result<u64> {
    match std::env::var(name) {
        Ok(text) => parse_address(&text)
            .ok_or_else(|| Error::Config(format!("{name}={text:?} is not an address"))),
        Err(_) => Ok(default),
    }
}

fn parse_address(text: &str) -> Option<u64> {
    let t = text.trim();
    match t.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => t.parse().ok(),
    }
}

impl Mapper for CudaMapper {
    type Range = CudaRange;

    fn reserve(&self, len: u64, at: Option<u64>) -> Result<CudaRange> {
        if len == 0 || len % self.granularity != 0 {
            return Err(Error::Invalid(format!(
                "reservation of {len} bytes: must be a non-zero multiple of {} bytes",
                self.granularity
            )));
        }
        let mut w = lock(&self.window);
        let base = w.base();
        let window_len = w.reservation.size() as u64;
        let offset = match at {
            Some(want) => {
                let inside = want
                    .checked_sub(base)
                    .filter(|off| off.checked_add(len).is_some_and(|end| end <= window_len));
                let Some(off) = inside else {
                    return Err(Error::AddressConflict(format!(
                        "the writer's range {want:#x}+{len:#x} is outside this process's GMS \
                         window [{base:#x}, {:#x}): engines of a pair must use the same \
                         GMS_VA_BASE and GMS_VA_WINDOW",
                        base + window_len
                    )));
                };
                if !w.extents.take_at(off, len) {
                    return Err(Error::AddressConflict(format!(
                        "{want:#x}+{len:#x} is already used in this process; the layout is \
                         address-dependent, so the import stops here"
                    )));
                }
                off
            }
            None => w.extents.take_any(len, self.granularity).ok_or_else(|| {
                Error::AddressConflict(format!(
                    "no room for {len} bytes left in the GMS window of {window_len} bytes \
                     (raise GMS_VA_WINDOW)"
                ))
            })?,
        };
        Ok(CudaRange {
            window: Arc::clone(&self.window),
            offset,
            len,
            memory: Vec::new(),
            state: RangeState::Reserved,
            backed: 0,
            device: self.device.clone(),
            context: Arc::clone(&self.context),
        })
    }
}

/// One range of the window and what is mapped into it.
pub struct CudaRange {
    window: SharedWindow,
    /// Offset of the range in the window.
    offset: u64,
    len: u64,
    /// Handles mapped here, by offset in the window: one imported
    /// allocation, or the KV chunks created by `grow`, in order.
    memory: Vec<(usize, PhysicalMemory)>,
    state: RangeState,
    /// Bytes of KV chunks mapped from the start of the range.
    backed: u64,
    device: Device,
    context: Arc<SharedContext>,
}

impl CudaRange {
    fn current(&self) -> Result<()> {
        self.context
            .0
            .make_current()
            .map_err(cuda_error("making the primary context current"))
    }

    fn start(&self) -> usize {
        self.offset as usize
    }

    /// Copies device bytes at `offset` to the host (tests, checks).
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        self.check(offset, out.len())?;
        self.current()?;
        lock(&self.window)
            .reservation
            .read(self.start() + offset as usize, out)
            .map_err(cuda_error(format!("reading {} bytes", out.len())))
    }

    /// Fills `count` u32 words at `offset` (synchronous; fails through a
    /// read-only mapping).
    pub fn fill_u32(&self, offset: u64, value: u32, count: usize) -> Result<()> {
        self.check(offset, count.saturating_mul(4))?;
        self.current()?;
        lock(&self.window)
            .reservation
            .fill_u32(self.start() + offset as usize, value, count)
            .map_err(cuda_error(format!("filling {count} words at +{offset:#x}")))
    }

    fn check(&self, offset: u64, n: usize) -> Result<()> {
        match offset.checked_add(n as u64) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Error::Invalid(format!(
                "+{offset:#x}..+{n:#x} is outside the range of {} bytes",
                self.len
            ))),
        }
    }

    fn unmap_all(&mut self) -> Result<()> {
        self.current()?;
        // No kernel may still be using the pages we take away.
        self.context
            .0
            .synchronize()
            .map_err(cuda_error("cuCtxSynchronize before unmap"))?;
        let mut w = lock(&self.window);
        for (offset, _) in &self.memory {
            w.reservation.unmap(*offset).map_err(cuda_error(format!(
                "unmapping the range at {:#x}",
                w.base() + *offset as u64
            )))?;
        }
        drop(w);
        self.memory.clear();
        self.backed = 0;
        self.state = RangeState::Reserved;
        Ok(())
    }
}

impl Range for CudaRange {
    fn addr(&self) -> u64 {
        lock(&self.window).base() + self.offset
    }

    fn len(&self) -> u64 {
        self.len
    }

    fn state(&self) -> RangeState {
        self.state
    }

    fn map(&mut self, fd: BorrowedFd<'_>, access: Access) -> Result<()> {
        if self.state != RangeState::Reserved {
            self.unmap_all()?;
        }
        self.map_part(0, self.len, fd, access)
    }

    fn map_part(
        &mut self,
        offset: u64,
        len: u64,
        fd: BorrowedFd<'_>,
        access: Access,
    ) -> Result<()> {
        self.check(offset, len as usize)?;
        if !matches!(self.state, RangeState::Mapped(_) | RangeState::Reserved) {
            self.unmap_all()?;
        }
        self.current()?;
        let owned = fd
            .try_clone_to_owned()
            .map_err(|e| Error::io("dup of a GMS descriptor for import", e))?;
        let memory = PhysicalMemory::import(&owned, len as usize).map_err(cuda_error(format!(
            "importing {len} bytes for +{offset:#x} of {:#x}",
            self.addr()
        )))?;
        let cuda_access = match access {
            Access::ReadOnly => crate::Access::ReadOnly,
            Access::ReadWrite => crate::Access::ReadWrite,
        };
        let at = self.start() + offset as usize;
        let what = format!(
            "mapping {len} bytes at +{offset:#x} of {:#x} {access:?}",
            self.addr()
        );
        lock(&self.window)
            .reservation
            .map(at, &memory, &self.device, cuda_access)
            .map_err(cuda_error(what))?;
        self.memory.push((at, memory));
        self.state = RangeState::Mapped(access);
        Ok(())
    }

    fn unmap(&mut self) -> Result<()> {
        self.unmap_all()
    }

    fn chunk(&self) -> u64 {
        KV_CHUNK
    }

    fn backed(&self) -> u64 {
        self.backed
    }

    /// The next [`KV_CHUNK`] of fresh device pages, if the device has room
    /// for it now; else the part of it that is free (multiples of
    /// [`KV_PART`], leaving [`KV_KEEP_FREE`]); else `Ok(false)`. Unlike the
    /// host backend the pages are not zeroed (that would cost ≈ 20 ms for
    /// 64 GiB): a KV cache is written before it is read. Called from the
    /// KV cache's grower thread while kernels run on the chunks before it:
    /// a chunk is mapped (and made accessible) only where nothing is yet.
    fn grow(&mut self) -> Result<bool> {
        if matches!(self.state, RangeState::Mapped(_)) {
            self.unmap_all()?;
        }
        let done = self.backed;
        let len = KV_CHUNK.min(self.len - done) as usize;
        if len == 0 {
            return Ok(false);
        }
        self.current()?;
        let failed = |len: usize, e| {
            cuda_error(format!(
                "creating {len} bytes of KV at +{done:#x} of {:#x} ({done} of {} bytes backed)",
                self.addr(),
                self.len
            ))(e)
        };
        let memory = match PhysicalMemory::create(&self.device, len) {
            Ok(m) => m,
            Err(e) if e.is_out_of_memory() => {
                // Not a whole chunk: the part that is free now, if any.
                let (free, _) = self
                    .device
                    .memory_info()
                    .map_err(cuda_error("cuMemGetInfo"))?;
                let part = part_of_chunk(len as u64, free as u64) as usize;
                if part == 0 {
                    return Ok(false);
                }
                match PhysicalMemory::create(&self.device, part) {
                    Ok(m) => m,
                    Err(e) if e.is_out_of_memory() => return Ok(false),
                    Err(e) => return Err(failed(part, e)),
                }
            }
            Err(e) => return Err(failed(len, e)),
        };
        let len = memory.size();
        let at = self.start() + done as usize;
        lock(&self.window)
            .reservation
            .map(at, &memory, &self.device, crate::Access::ReadWrite)
            .map_err(cuda_error(format!("mapping KV at +{done:#x}")))?;
        self.memory.push((at, memory));
        self.backed += len as u64;
        self.state = if self.backed == self.len {
            RangeState::Materialised
        } else {
            RangeState::PartlyBacked
        };
        Ok(true)
    }
}

impl Drop for CudaRange {
    fn drop(&mut self) {
        // Unmapping calls the driver: this thread needs the context, and no
        // kernel may still use the pages.
        if !self.memory.is_empty() && self.current().is_ok() {
            let _ = self.context.0.synchronize();
            let mut w = lock(&self.window);
            for (offset, _) in &self.memory {
                let _ = w.reservation.unmap(*offset);
            }
        }
        self.memory.clear();
        lock(&self.window).extents.give(self.offset, self.len);
    }
}

/// Connects a CUDA engine to its device's daemon, retrying while the daemon
/// is not up yet or the lease is busy (another engine is loading).
pub fn connect_wait(
    mapper: CudaMapper,
    socket: &Path,
    mode: Mode,
    name: &str,
    timeout: Duration,
) -> Result<Client<CudaMapper>> {
    Client::connect_with_wait(mapper, socket, mode, name, timeout)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn va_base_parses() {
        assert_eq!(parse_address("0x200000000000"), Some(DEFAULT_VA_BASE));
        assert_eq!(parse_address("4096"), Some(4096));
        assert_eq!(parse_address("zz"), None);
    }

    const MIB2: u64 = 2 << 20;

    #[test]
    fn window_extents_first_fit_and_exact_claims() {
        let mut e = Extents::new(100 * MIB2);
        assert_eq!(e.take_any(3 * MIB2, MIB2), Some(0));
        assert_eq!(
            e.take_any(MIB2, 4 * MIB2),
            Some(4 * MIB2),
            "aligned past the first"
        );
        assert_eq!(
            e.take_any(MIB2, MIB2),
            Some(3 * MIB2),
            "the gap left by alignment"
        );
        assert!(e.take_at(10 * MIB2, 5 * MIB2));
        assert!(!e.take_at(12 * MIB2, MIB2), "already taken");
        assert!(!e.take_at(99 * MIB2, 2 * MIB2), "runs past the end");
        assert!(
            !e.take_at(u64::MAX - 1, 4),
            "overflow is refused, not wrapped"
        );
        assert_eq!(e.take_any(200 * MIB2, MIB2), None);
    }

    #[test]
    fn a_chunk_that_does_not_fit_is_backed_in_parts_of_what_is_free() {
        const MIB: u64 = 1 << 20;
        let chunk = KV_CHUNK;
        assert_eq!(
            part_of_chunk(chunk, 1500 * MIB),
            768 * MIB,
            "leaves 512 MiB, 256 MiB steps"
        );
        assert_eq!(
            part_of_chunk(chunk, 767 * MIB),
            0,
            "less than one part beyond the margin"
        );
        assert_eq!(part_of_chunk(chunk, 0), 0);
        assert_eq!(
            part_of_chunk(chunk, 100 * chunk),
            chunk,
            "never more than the chunk"
        );
        assert_eq!(
            part_of_chunk(300 * MIB, 2000 * MIB),
            300 * MIB,
            "the range's short last chunk"
        );
        assert_eq!(part_of_chunk(chunk, u64::MAX) % KV_PART, 0);
    }

    #[test]
    fn window_extents_coalesce_back_to_one() {
        let mut e = Extents::new(64 * MIB2);
        let a = e.take_any(8 * MIB2, MIB2).unwrap();
        let b = e.take_any(8 * MIB2, MIB2).unwrap();
        let c = e.take_any(8 * MIB2, MIB2).unwrap();
        e.give(b, 8 * MIB2);
        assert!(
            e.take_at(b, 8 * MIB2),
            "a reader can claim exactly a freed range"
        );
        e.give(b, 8 * MIB2);
        e.give(a, 8 * MIB2);
        e.give(c, 8 * MIB2);
        assert_eq!(e.free.len(), 1, "{:?}", e.free);
        assert_eq!(e.free.get(&0), Some(&(64 * MIB2)));
    }

    /// Without a GPU, opening the mapper is an error naming the driver.
    #[test]
    fn open_without_a_gpu_is_a_clear_error() {
        if let Err(e) = CudaMapper::open(&DeviceSelector::Index(0)) {
            assert!(e.to_string().contains("CUDA"), "{e}");
        }
    }
}
