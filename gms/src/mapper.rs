//! Engine-side address space: reserve a range, map an allocation's
//! descriptor into it, unmap back to a bare reservation, materialise fresh
//! private memory (KV cache). The client speaks the protocol; a `Mapper`
//! turns descriptors into addresses, so the CUDA backend adds a mapper
//! (`cuMemAddressReserve`, `cuMemImportFromShareableHandle`, `cuMemMap`,
//! `cuMemSetAccess`) without touching the protocol.
//!
//! [`HostRange`] is the host implementation: a `PROT_NONE` anonymous
//! reservation that mappings replace in place with `MAP_FIXED` (only ever
//! inside the range it owns), and that `Drop` unmaps. Its KV memory is
//! backed in chunks like a device's, and a [`HostMemory`] limit shared by
//! several ranges plays the device's capacity: a chunk that does not fit is
//! refused until another range gives memory back, as on a full GPU, so the
//! growing KV cache (`kv`) is tested without one.

use std::os::fd::{AsRawFd, BorrowedFd};

use nix::errno::Errno;

use crate::{Error, Result};

/// How a descriptor may be used by the engine that receives it: the daemon
/// exports with it, a range maps with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    ReadWrite,
    ReadOnly,
}

/// What a range currently holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RangeState {
    /// Address space only: any access faults.
    Reserved,
    /// A GMS allocation is mapped here.
    Mapped(Access),
    /// Fresh private memory (KV cache) over all of the range.
    Materialised,
    /// Fresh private memory over a prefix of the range ([`Range::backed`]
    /// bytes), the rest still reserved: a KV cache that grows.
    PartlyBacked,
}

/// One reserved address range of an engine.
pub trait Range: Send {
    fn addr(&self) -> u64;
    /// Never 0: reservations of zero bytes are refused.
    fn len(&self) -> u64;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    fn state(&self) -> RangeState;
    /// Maps an allocation's descriptor over the whole range.
    fn map(&mut self, fd: BorrowedFd<'_>, access: Access) -> Result<()>;
    /// Maps an allocation of `len` bytes at `offset` of the range, where
    /// nothing is mapped yet (a KV pool made of several allocations, mapped
    /// one after another; the range then says `Mapped` from the first).
    fn map_part(&mut self, offset: u64, len: u64, fd: BorrowedFd<'_>, access: Access)
        -> Result<()>;
    /// Back to a bare reservation; the addresses stay ours.
    fn unmap(&mut self) -> Result<()>;
    /// The size KV memory is backed in: one allocation per chunk (the last
    /// one may be shorter, and a device short of memory may back part of a
    /// chunk first).
    fn chunk(&self) -> u64;
    /// Bytes of fresh private memory backing the range from its start.
    fn backed(&self) -> u64;
    /// Backs the next chunk after [`backed`](Self::backed) with fresh
    /// private read-write memory if the memory is there now: `Ok(true)`
    /// when it did, `Ok(false)` when the device (or limit) has no room for
    /// it at the moment, never waiting. A range with a GMS allocation
    /// mapped is unmapped first.
    fn grow(&mut self) -> Result<bool>;
    /// Fresh read-write memory over the whole range now, or an error
    /// ([`Error::OutOfMemory`] when it does not fit); waiting for memory
    /// is the KV cache's business (`kv::KvCache`).
    fn materialise(&mut self) -> Result<()> {
        while self.backed() < self.len() {
            if !self.grow()? {
                let backed = self.backed();
                let _ = self.unmap();
                return Err(Error::OutOfMemory(format!(
                    "{backed} of {} bytes backed, no room for the next chunk of {}",
                    self.len(),
                    self.chunk()
                )));
            }
        }
        Ok(())
    }
}

/// Makes ranges.
pub trait Mapper {
    type Range: Range;
    /// Reserves `len` bytes; `at` demands that exact address (a reader
    /// following the writer's layout) and fails if any of it is taken.
    fn reserve(&self, len: u64, at: Option<u64>) -> Result<Self::Range>;
}

/// KV chunk of host ranges unless [`HostMapper::with_limit`] says otherwise.
pub const HOST_KV_CHUNK: u64 = 64 << 20;

/// A byte limit on the KV memory of the host ranges that share it: what a
/// device's capacity is to CUDA ranges. Cloned handles share one count.
#[derive(Debug, Clone)]
pub struct HostMemory(std::sync::Arc<std::sync::Mutex<HostMemoryCount>>);

#[derive(Debug)]
struct HostMemoryCount {
    limit: u64,
    used: u64,
}

impl HostMemory {
    pub fn new(limit: u64) -> Self {
        HostMemory(std::sync::Arc::new(std::sync::Mutex::new(
            HostMemoryCount { limit, used: 0 },
        )))
    }

    fn count(&self) -> std::sync::MutexGuard<'_, HostMemoryCount> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Bytes backed now by the ranges under this limit.
    pub fn used(&self) -> u64 {
        self.count().used
    }

    pub fn available(&self) -> u64 {
        let c = self.count();
        c.limit.saturating_sub(c.used)
    }

    fn take(&self, len: u64) -> bool {
        let mut c = self.count();
        match c.used.checked_add(len) {
            Some(used) if used <= c.limit => {
                c.used = used;
                true
            }
            _ => false,
        }
    }

    fn give(&self, len: u64) {
        let mut c = self.count();
        c.used = c.used.saturating_sub(len);
    }
}

#[derive(Debug, Clone)]
pub struct HostMapper {
    limit: Option<HostMemory>,
    chunk: u64,
}

impl Default for HostMapper {
    fn default() -> Self {
        HostMapper {
            limit: None,
            chunk: HOST_KV_CHUNK,
        }
    }
}

impl HostMapper {
    /// Ranges whose KV memory counts against `limit`, backed `chunk` bytes
    /// at a time (a multiple of the page size).
    pub fn with_limit(limit: HostMemory, chunk: u64) -> Result<Self> {
        if chunk == 0 || chunk % page_size() != 0 {
            return Err(Error::Invalid(format!(
                "KV chunk of {chunk} bytes: must be a non-zero multiple of the page size ({})",
                page_size()
            )));
        }
        Ok(HostMapper {
            limit: Some(limit),
            chunk,
        })
    }
}

fn page_size() -> u64 {
    // SAFETY: sysconf reads a constant of the system.
    match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
        n if n > 0 => n as u64,
        _ => 4096,
    }
}

impl Mapper for HostMapper {
    type Range = HostRange;

    fn reserve(&self, len: u64, at: Option<u64>) -> Result<HostRange> {
        let mut range = HostRange::reserve(len, at)?;
        range.limit = self.limit.clone();
        range.chunk = self.chunk;
        Ok(range)
    }
}

#[derive(Debug)]
pub struct HostRange {
    addr: u64,
    len: u64,
    state: RangeState,
    /// Bytes of KV memory backing the range from its start.
    backed: u64,
    chunk: u64,
    limit: Option<HostMemory>,
}

fn mmap_raw(
    addr: u64,
    len: u64,
    prot: libc::c_int,
    flags: libc::c_int,
    fd: libc::c_int,
) -> std::result::Result<u64, Errno> {
    // SAFETY: callers pass either addr 0 (kernel chooses), MAP_FIXED_NOREPLACE
    // (never replaces anything), or MAP_FIXED over a range the calling
    // HostRange owns exclusively; no Rust reference points into such a range
    // across the call except through that HostRange's borrow.
    let ret = unsafe { libc::mmap(addr as *mut libc::c_void, len as usize, prot, flags, fd, 0) };
    if ret == libc::MAP_FAILED {
        Err(Errno::last())
    } else {
        Ok(ret as u64)
    }
}

impl HostRange {
    pub fn reserve(len: u64, at: Option<u64>) -> Result<Self> {
        if len == 0 {
            return Err(Error::Invalid("reservation of 0 bytes".into()));
        }
        let mut flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;
        if at.is_some() {
            flags |= libc::MAP_FIXED_NOREPLACE;
        }
        let want = at.unwrap_or(0);
        let addr = match mmap_raw(want, len, libc::PROT_NONE, flags, -1) {
            Ok(a) => a,
            Err(Errno::EEXIST) => {
                return Err(Error::AddressConflict(format!(
                    "[{want:#x}, {:#x}) is already mapped in this process",
                    want.saturating_add(len)
                )))
            }
            Err(e) => return Err(Error::sys(format!("reserving {len} bytes at {want:#x}"), e)),
        };
        let range = HostRange {
            addr,
            len,
            state: RangeState::Reserved,
            backed: 0,
            chunk: HOST_KV_CHUNK,
            limit: None,
        };
        // Kernels before 4.17 treat the flag as a hint; `range` unmaps on drop.
        if at.is_some() && addr != want {
            return Err(Error::AddressConflict(format!(
                "wanted {want:#x}, kernel gave {addr:#x}"
            )));
        }
        Ok(range)
    }

    fn replace(&mut self, prot: libc::c_int, flags: libc::c_int, fd: libc::c_int) -> Result<()> {
        self.replace_part(0, self.len, prot, flags, fd)
    }

    /// Maps over `[addr + offset, +len)`, a part of this range.
    fn replace_part(
        &mut self,
        offset: u64,
        len: u64,
        prot: libc::c_int,
        flags: libc::c_int,
        fd: libc::c_int,
    ) -> Result<()> {
        debug_assert!(offset.checked_add(len).is_some_and(|end| end <= self.len));
        mmap_raw(self.addr + offset, len, prot, flags | libc::MAP_FIXED, fd)
            .map(|_| ())
            .map_err(|e| {
                Error::sys(
                    format!("mmap over own range {:#x}+{offset:#x}+{len}", self.addr),
                    e,
                )
            })
    }

    /// Hands the KV memory back to the limit, if any.
    fn give_back(&mut self) {
        if let Some(limit) = &self.limit {
            limit.give(self.backed);
        }
        self.backed = 0;
    }

    /// The backed prefix of a KV range, writable (empty when none is).
    pub fn backed_mut(&mut self) -> &mut [u8] {
        match self.state {
            RangeState::Materialised | RangeState::PartlyBacked => {
                // SAFETY: [addr, addr + backed) is mapped read-write private
                // memory owned by self, exclusively borrowed through it.
                unsafe {
                    std::slice::from_raw_parts_mut(self.addr as *mut u8, self.backed as usize)
                }
            }
            _ => &mut [],
        }
    }

    /// The mapped bytes, or `None` unless readable memory is mapped over
    /// all of the range.
    pub fn bytes(&self) -> Option<&[u8]> {
        match self.state {
            RangeState::Reserved | RangeState::PartlyBacked => None,
            // SAFETY: the whole range is mapped readable and owned by self;
            // the slice borrows self, so it cannot outlive an unmap.
            _ => Some(unsafe {
                std::slice::from_raw_parts(self.addr as *const u8, self.len as usize)
            }),
        }
    }

    /// The mapped bytes for writing, or `None` unless mapped read-write.
    pub fn bytes_mut(&mut self) -> Option<&mut [u8]> {
        match self.state {
            RangeState::Mapped(Access::ReadWrite) | RangeState::Materialised => {
                // SAFETY: mapped read-write and exclusively borrowed through self.
                Some(unsafe {
                    std::slice::from_raw_parts_mut(self.addr as *mut u8, self.len as usize)
                })
            }
            _ => None,
        }
    }
}

impl Range for HostRange {
    fn addr(&self) -> u64 {
        self.addr
    }

    fn len(&self) -> u64 {
        self.len
    }

    fn state(&self) -> RangeState {
        self.state
    }

    fn map(&mut self, fd: BorrowedFd<'_>, access: Access) -> Result<()> {
        self.map_part(0, self.len, fd, access)
    }

    fn map_part(
        &mut self,
        offset: u64,
        len: u64,
        fd: BorrowedFd<'_>,
        access: Access,
    ) -> Result<()> {
        if offset.checked_add(len).is_none_or(|end| end > self.len) || len == 0 {
            return Err(Error::Invalid(format!(
                "{len} bytes at +{offset:#x} of a range of {} bytes",
                self.len
            )));
        }
        check_host_memory(fd, len, access)?;
        if !matches!(self.state, RangeState::Mapped(_)) {
            self.give_back();
        }
        let prot = match access {
            Access::ReadWrite => libc::PROT_READ | libc::PROT_WRITE,
            Access::ReadOnly => libc::PROT_READ,
        };
        self.replace_part(offset, len, prot, libc::MAP_SHARED, fd.as_raw_fd())?;
        self.state = RangeState::Mapped(access);
        Ok(())
    }

    fn unmap(&mut self) -> Result<()> {
        self.replace(
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
        )?;
        self.give_back();
        self.state = RangeState::Reserved;
        Ok(())
    }

    fn chunk(&self) -> u64 {
        self.chunk
    }

    fn backed(&self) -> u64 {
        self.backed
    }

    fn grow(&mut self) -> Result<bool> {
        if matches!(self.state, RangeState::Mapped(_)) {
            self.unmap()?;
        }
        let len = self.chunk.min(self.len - self.backed);
        if len == 0 {
            return Ok(false);
        }
        if let Some(limit) = &self.limit {
            if !limit.take(len) {
                return Ok(false);
            }
        }
        let mapped = self.replace_part(
            self.backed,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
        );
        if let Err(e) = mapped {
            if let Some(limit) = &self.limit {
                limit.give(len);
            }
            return Err(e);
        }
        self.backed += len;
        self.state = if self.backed == self.len {
            RangeState::Materialised
        } else {
            RangeState::PartlyBacked
        };
        Ok(true)
    }
}

/// What a host-backend descriptor must be before it is mapped: at least as
/// long as the range (a shorter file faults with SIGBUS on access), and,
/// for read-only weights, sealed against every change (write, grow,
/// shrink), so the bytes cannot change under a reader whoever else holds
/// the file. A descriptor that fails either came from something that is
/// not an honest gmsd (a socket replaced in a writable directory, a bug):
/// refused before it is mapped.
fn check_host_memory(fd: BorrowedFd<'_>, len: u64, access: Access) -> Result<()> {
    let st = nix::sys::stat::fstat(fd)
        .map_err(|e| Error::sys(format!("fstat of memory fd {}", fd.as_raw_fd()), e))?;
    if u64::try_from(st.st_size).map_or(true, |size| size < len) {
        return Err(Error::Invalid(format!(
            "memory fd {} holds {} bytes, the allocation claims {len}: refusing to map it",
            fd.as_raw_fd(),
            st.st_size
        )));
    }
    if access == Access::ReadOnly {
        let needed = libc::F_SEAL_WRITE | libc::F_SEAL_GROW | libc::F_SEAL_SHRINK;
        // SAFETY: fcntl(F_GET_SEALS) reads the descriptor's seals; no memory is passed.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & needed != needed {
            let why = if seals < 0 {
                format!("not a sealable memfd ({})", Errno::last())
            } else {
                format!("seals {seals:#x} lack write/grow/shrink")
            };
            return Err(Error::Invalid(format!(
                "committed memory fd {}: {why}; refusing to map weights that can still change",
                fd.as_raw_fd()
            )));
        }
    }
    Ok(())
}

impl Drop for HostRange {
    fn drop(&mut self) {
        self.give_back();
        // SAFETY: the range [addr, addr+len) was reserved by this HostRange
        // and only ever replaced in place; nothing else owns it.
        if unsafe { libc::munmap(self.addr as *mut libc::c_void, self.len as usize) } != 0 {
            tracing::error!(
                "munmap {:#x}+{} failed: {}",
                self.addr,
                self.len,
                Errno::last()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_reserve_materialise_release() {
        let mut r = HostMapper::default().reserve(1 << 20, None).unwrap();
        assert!(r.bytes().is_none());
        r.materialise().unwrap();
        r.bytes_mut().unwrap()[4096] = 7;
        assert_eq!(r.bytes().unwrap()[4096], 7);
        let addr = r.addr();
        r.unmap().unwrap();
        assert_eq!(r.addr(), addr, "address kept while released");
        r.materialise().unwrap();
        assert_eq!(r.bytes().unwrap()[4096], 0, "fresh pages after release");
    }

    fn memfd(len: i64) -> std::os::fd::OwnedFd {
        let fd = nix::sys::memfd::memfd_create(
            "t",
            nix::sys::memfd::MFdFlags::MFD_CLOEXEC | nix::sys::memfd::MFdFlags::MFD_ALLOW_SEALING,
        )
        .unwrap();
        nix::unistd::ftruncate(&fd, len).unwrap();
        fd
    }

    /// A short file would SIGBUS the reader, an unsealed one could change
    /// under it: both refused before mapping.
    #[test]
    fn short_or_unsealed_memory_is_refused_before_mapping() {
        use std::os::fd::AsFd;
        let mut r = HostMapper::default().reserve(8192, None).unwrap();
        let short = memfd(4096);
        let err = r.map(short.as_fd(), Access::ReadWrite).unwrap_err();
        assert!(err.to_string().contains("holds 4096 bytes"), "{err}");
        let unsealed = memfd(8192);
        let err = r.map(unsealed.as_fd(), Access::ReadOnly).unwrap_err();
        assert!(err.to_string().contains("seals"), "{err}");
        assert_eq!(r.state(), RangeState::Reserved);
        let seals = libc::F_SEAL_WRITE | libc::F_SEAL_GROW | libc::F_SEAL_SHRINK;
        assert_eq!(
            // SAFETY: adds seals to our own memfd.
            unsafe { libc::fcntl(unsealed.as_raw_fd(), libc::F_ADD_SEALS, seals) },
            0
        );
        r.map(unsealed.as_fd(), Access::ReadOnly).unwrap();
        assert_eq!(r.bytes().unwrap().len(), 8192);
    }

    #[test]
    fn exact_reservation_refuses_taken_addresses() {
        // A fixed address far from where this process's mappings live.
        let at = 0x5a5a_0000_0000;
        let a = HostMapper::default().reserve(1 << 20, Some(at)).unwrap();
        assert_eq!(a.addr(), at);
        let err = HostMapper::default()
            .reserve(4096, Some(at + 8192))
            .unwrap_err();
        assert!(matches!(err, Error::AddressConflict(_)), "{err}");
    }
}
