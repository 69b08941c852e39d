//! The engine side on a GPU: a [`Mapper`] whose ranges are device virtual
//! address reservations (`cuMemAddressReserve`), into which GMS descriptors
//! are imported and mapped (`cuMemImportFromShareableHandle`, `cuMemMap`,
//! `cuMemSetAccess`), and KV caches are materialised from fresh
//! `cuMemCreate` chunks. The protocol client is unchanged: it only sees
//! [`Range`]s.
//!
//! Every engine of a pair maps the weights at the writer's addresses, so
//! pointers inside the weights (and CUDA graphs captured over them) are the
//! same in every engine. A reader therefore demands the writer's address; if
//! the driver places the reservation anywhere else the import fails with
//! `AddressConflict` rather than producing a subtly different layout.
//!
//! The engine needs a current context for all of this: the mapper retains
//! the device's *primary* context, the one the CUDA runtime and PyTorch use,
//! so torch sees the mappings as ordinary device memory.

use std::os::fd::BorrowedFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gms_cuda::{Device, DeviceSelector, Driver, PhysicalMemory, PrimaryContext, Reservation};

use crate::backend::cuda::{cuda_error, socket_name};
use crate::backend::Access;
use crate::client::Client;
use crate::mapper::{Mapper, Range, RangeState};
use crate::protocol::{ErrorCode, Mode};
use crate::{Error, Result};

/// Where writers ask the driver to put weights unless `GMS_VA_BASE` says
/// otherwise: far from where the driver places ordinary allocations, so a
/// reader's own (torch) allocations are unlikely to sit at the writer's
/// addresses. Measured honoured on an H200 (driver 580).
pub const DEFAULT_VA_BASE: u64 = 0x7f00_0000_0000;

/// KV caches are materialised in chunks of this size: one `cuMemCreate` per
/// chunk. 2 GiB chunks measured 3.8–4.3 ms for 64 GiB on an H200, 512 MiB
/// chunks 91–116 ms.
pub const KV_CHUNK: u64 = 2 << 30;

/// Size of the address window above the base where writers and KV caches
/// are placed (address space only; nothing is backed by it).
pub const VA_WINDOW: u64 = 4 << 40;
const WINDOW_TRIES: usize = 64;
const WINDOW_STEP: u64 = 1 << 30;

/// Address space reserved at least per range (only the allocation's own
/// size is mapped). On an H200 the driver ignored every in-window hint for
/// a 2 MiB reservation made after a few larger ones, while 20 MiB and larger
/// reservations were honoured; padding small ranges sidesteps that. Readers
/// pad identically, and the writer's padding keeps other allocations out.
pub const MIN_RESERVATION: u64 = 64 << 20;

/// A primary context shared by a mapper and all its ranges.
struct SharedContext(PrimaryContext);

// SAFETY: a CUDA context handle may be made current on, and used from, any
// thread of the process; the driver serialises what needs serialising.
// `PrimaryContext` holds only the device and context handles.
unsafe impl Send for SharedContext {}
// SAFETY: as above; `make_current` and `synchronize` take `&self` and are
// thread-safe driver calls.
unsafe impl Sync for SharedContext {}

/// Makes ranges on one GPU, in this process's primary context.
#[derive(Clone)]
pub struct CudaMapper {
    device: Device,
    context: Arc<SharedContext>,
    granularity: u64,
    base: u64,
    next_hint: Arc<AtomicU64>,
}

impl CudaMapper {
    /// Loads the driver, finds the device and retains its primary context
    /// (creating it if this process has none yet: ≈ 0.1–0.2 s on an H200).
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
        let base = match std::env::var("GMS_VA_BASE") {
            Ok(text) => parse_address(&text)?,
            Err(_) => DEFAULT_VA_BASE,
        };
        Ok(CudaMapper {
            device,
            context: Arc::new(SharedContext(context)),
            granularity,
            base,
            next_hint: Arc::new(AtomicU64::new(base)),
        })
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn granularity(&self) -> u64 {
        self.granularity
    }

    /// The GMS socket of this device in `dir` (`GMS_SOCKET_DIR`).
    pub fn socket_in(&self, dir: &Path) -> PathBuf {
        dir.join(socket_name(&self.device.uuid().to_string()))
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

fn parse_address(text: &str) -> Result<u64> {
    let t = text.trim();
    let parsed = match t.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => t.parse(),
    };
    parsed.map_err(|_| Error::Config(format!("GMS_VA_BASE={text:?} is not an address")))
}

impl CudaMapper {
    fn in_window(&self, addr: u64, len: u64) -> bool {
        addr >= self.base && addr.saturating_add(len) <= self.base.saturating_add(VA_WINDOW)
    }

    /// A writer's (or KV) reservation inside the GMS window. Readers must
    /// find the writer's addresses free, and the window is where their own
    /// allocations do not go; so a placement the driver made elsewhere is
    /// given back and the next spot tried.
    fn reserve_in_window(&self, len: u64, size: usize) -> Result<Reservation> {
        // Hints aligned to the size's power of two (up to 1 GiB): the
        // driver was seen on an H200 to ignore hints that were only
        // granularity-aligned, while aligned ones were honoured.
        let align = len.next_power_of_two().clamp(self.granularity, WINDOW_STEP);
        let mut last = 0;
        for _ in 0..WINDOW_TRIES {
            let mut hint = 0;
            let claimed =
                self.next_hint
                    .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |cur| {
                        hint = cur.checked_next_multiple_of(align)?;
                        hint.checked_add(len)
                    });
            if claimed.is_err() {
                break;
            }
            let r = Reservation::reserve(size, self.granularity as usize, hint)
                .map_err(cuda_error(format!("reserving {len} bytes at {hint:#x}")))?;
            if r.base() == hint {
                return Ok(r);
            }
            last = r.base();
            tracing::debug!(
                hint,
                got = last,
                len,
                "address hint not honoured; trying further up"
            );
            drop(r);
            // Skip past whatever occupies the hint.
            self.next_hint
                .fetch_max(hint.saturating_add(WINDOW_STEP), Ordering::Relaxed);
        }
        Err(Error::AddressConflict(format!(
            "the driver would not place {len} bytes inside the GMS address window \
             [{:#x}, {:#x}) after {WINDOW_TRIES} tries (last offer {last:#x}); set GMS_VA_BASE \
             to a free region",
            self.base,
            self.base.saturating_add(VA_WINDOW)
        )))
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
        let padded = len.max(MIN_RESERVATION);
        let size = usize::try_from(padded)
            .map_err(|_| Error::Invalid(format!("reservation of {len} bytes exceeds usize")))?;
        self.make_current()?;
        let reservation = match at {
            Some(want) => {
                let r = Reservation::reserve(size, self.granularity as usize, want)
                    .map_err(cuda_error(format!("reserving {len} bytes at {want:#x}")))?;
                if r.base() != want {
                    return Err(Error::AddressConflict(format!(
                        "the driver placed {len} bytes at {:#x} instead of the writer's {want:#x} \
                         (this process already uses those addresses); the layout is \
                         address-dependent, so the import stops here",
                        r.base()
                    )));
                }
                r
            }
            None => self.reserve_in_window(padded, size)?,
        };
        // Keep later hints (KV caches, a writer's next allocation) above
        // every range this process holds in the window.
        let end = reservation.base().saturating_add(padded);
        if self.in_window(reservation.base(), padded) {
            self.next_hint.fetch_max(end, Ordering::Relaxed);
        }
        Ok(CudaRange {
            reservation,
            len,
            memory: Vec::new(),
            state: RangeState::Reserved,
            device: self.device.clone(),
            context: Arc::clone(&self.context),
        })
    }
}

/// One device address range and what is mapped into it.
pub struct CudaRange {
    // Field order matters for drop: the reservation unmaps and frees the
    // range first, then the handles are released, then the context.
    reservation: Reservation,
    /// Bytes used (mapped) at the start of the reservation, which may be
    /// padded to [`MIN_RESERVATION`].
    len: u64,
    /// Handles mapped here, by offset: one imported allocation, or the KV
    /// chunks created by `materialise`.
    memory: Vec<(usize, PhysicalMemory)>,
    state: RangeState,
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

    fn len_usize(&self) -> usize {
        self.len as usize
    }

    /// Copies device bytes at `offset` to the host (tests, checks).
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        self.current()?;
        self.reservation
            .read(offset as usize, out)
            .map_err(cuda_error(format!("reading {} bytes", out.len())))
    }

    /// Fills `count` u32 words at `offset` (synchronous; fails through a
    /// read-only mapping).
    pub fn fill_u32(&self, offset: u64, value: u32, count: usize) -> Result<()> {
        self.current()?;
        self.reservation
            .fill_u32(offset as usize, value, count)
            .map_err(cuda_error(format!("filling {count} words at +{offset:#x}")))
    }

    fn unmap_all(&mut self) -> Result<()> {
        self.current()?;
        // No kernel may still be using the pages we take away.
        self.context
            .0
            .synchronize()
            .map_err(cuda_error("cuCtxSynchronize before unmap"))?;
        for (offset, _) in &self.memory {
            self.reservation.unmap(*offset).map_err(cuda_error(format!(
                "unmapping +{offset:#x} of the range at {:#x}",
                self.reservation.base()
            )))?;
        }
        self.memory.clear();
        self.state = RangeState::Reserved;
        Ok(())
    }
}

impl Range for CudaRange {
    fn addr(&self) -> u64 {
        self.reservation.base()
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
        self.current()?;
        let owned = fd
            .try_clone_to_owned()
            .map_err(|e| Error::io("dup of a GMS descriptor for import", e))?;
        let memory = PhysicalMemory::import(&owned, self.len_usize()).map_err(cuda_error(
            format!("importing {} bytes for {:#x}", self.len(), self.addr()),
        ))?;
        let cuda_access = match access {
            Access::ReadOnly => gms_cuda::Access::ReadOnly,
            Access::ReadWrite => gms_cuda::Access::ReadWrite,
        };
        self.reservation
            .map(0, &memory, &self.device, cuda_access)
            .map_err(cuda_error(format!(
                "mapping {} bytes at {:#x} {access:?}",
                self.len(),
                self.addr()
            )))?;
        self.memory.push((0, memory));
        self.state = RangeState::Mapped(access);
        Ok(())
    }

    fn unmap(&mut self) -> Result<()> {
        self.unmap_all()
    }

    /// Fresh device pages over the whole range, in [`KV_CHUNK`] pieces.
    /// Unlike the host backend the pages are not zeroed (that would cost
    /// ≈ 20 ms for 64 GiB): a KV cache is written before it is read.
    fn materialise(&mut self) -> Result<()> {
        if self.state != RangeState::Reserved {
            self.unmap_all()?;
        }
        self.current()?;
        let total = self.len_usize();
        let chunk = KV_CHUNK as usize;
        let mut offset = 0usize;
        while offset < total {
            let len = chunk.min(total - offset);
            let memory = PhysicalMemory::create(&self.device, len).map_err(cuda_error(format!(
                "creating {len} bytes of KV at +{offset:#x} of {:#x} ({} of {total} bytes done)",
                self.addr(),
                offset
            )))?;
            if let Err(e) =
                self.reservation
                    .map(offset, &memory, &self.device, gms_cuda::Access::ReadWrite)
            {
                // Leave the range consistent: give back what was mapped.
                let _ = self.unmap_all();
                return Err(cuda_error(format!("mapping KV at +{offset:#x}"))(e));
            }
            self.memory.push((offset, memory));
            offset += len;
        }
        self.state = RangeState::Materialised;
        Ok(())
    }
}

impl Drop for CudaRange {
    fn drop(&mut self) {
        // The fields' own Drop impls call the driver: make sure this thread
        // has the context, and that no kernel still uses the pages.
        if self.current().is_ok() && !self.memory.is_empty() {
            let _ = self.context.0.synchronize();
        }
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
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_millis(2);
    loop {
        match Client::connect_with(mapper.clone(), socket, mode, name) {
            Ok(c) => return Ok(c),
            Err(e) if Instant::now() < deadline && retryable(&e) => {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(50));
            }
            Err(e) => return Err(e),
        }
    }
}

fn retryable(e: &Error) -> bool {
    match e {
        Error::Remote { code, .. } => *code == ErrorCode::LeaseBusy,
        Error::Io { source, .. } => matches!(
            source.kind(),
            std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
        ),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn va_base_parses() {
        assert_eq!(parse_address("0x7f0000000000").unwrap(), DEFAULT_VA_BASE);
        assert_eq!(parse_address("4096").unwrap(), 4096);
        assert!(parse_address("zz").is_err());
    }

    #[test]
    fn busy_and_absent_daemons_are_retried_other_errors_are_not() {
        let busy = Error::Remote {
            code: ErrorCode::LeaseBusy,
            message: String::new(),
        };
        assert!(retryable(&busy));
        let absent = Error::io("x", std::io::ErrorKind::NotFound.into());
        assert!(retryable(&absent));
        assert!(!retryable(&Error::NoLayout("none".into())));
    }

    /// Without a GPU, opening the mapper is an error naming the driver.
    #[test]
    fn open_without_a_gpu_is_a_clear_error() {
        if let Err(e) = CudaMapper::open(&DeviceSelector::Index(0)) {
            assert!(e.to_string().contains("CUDA"), "{e}");
        }
    }
}
