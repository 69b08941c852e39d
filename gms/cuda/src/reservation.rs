//! A range of device virtual addresses and what is mapped into it. Engines of
//! a pair map the weights at the same addresses (the writer's), park with a
//! reserved but empty KV range, and materialise it on promotion; all of that
//! is a [`Reservation`] with mappings added and removed. Dropping it unmaps
//! what is still mapped, then frees the range.

use std::collections::BTreeMap;

use cudarc::driver::sys;

use crate::{
    device::Device,
    error::{check, check_with, Error, Result},
    memory::PhysicalMemory,
};

/// Access a device gets to a mapped range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Readers of committed weights: a write faults on the GPU.
    ReadOnly,
    /// The writer, and KV pages.
    ReadWrite,
}

/// A reserved device address range.
#[derive(Debug)]
pub struct Reservation {
    base: sys::CUdeviceptr,
    size: usize,
    /// offset → size of each live mapping.
    mapped: BTreeMap<usize, usize>,
}

impl Reservation {
    /// Reserves `size` bytes of address space. `hint` (0 for none) asks for
    /// a fixed address — a reader asks for the writer's; the driver may
    /// ignore it, see [`Reservation::base`]. Needs a current context.
    pub fn reserve(size: usize, alignment: usize, hint: u64) -> Result<Reservation> {
        if size == 0 {
            return Err(Error::InvalidArgument(
                "cannot reserve an empty address range".into(),
            ));
        }
        let mut base: sys::CUdeviceptr = 0;
        check_with(
            "cuMemAddressReserve",
            // SAFETY: `base` is a valid out-pointer; flags must be 0.
            unsafe { sys::cuMemAddressReserve(&mut base, size, alignment, hint, 0) },
            || format!("{size} bytes at hint {hint:#x}"),
        )?;
        Ok(Reservation {
            base,
            size,
            mapped: BTreeMap::new(),
        })
    }

    /// The first address of the range.
    pub fn base(&self) -> u64 {
        self.base
    }

    pub fn size(&self) -> usize {
        self.size
    }

    /// Bytes currently backed by a mapping.
    pub fn mapped_bytes(&self) -> usize {
        self.mapped.values().sum()
    }

    fn check_range(&self, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.size && len > 0 => Ok(()),
            _ => Err(Error::InvalidArgument(format!(
                "range {offset:#x}+{len:#x} is outside the reservation of {:#x} bytes at {:#x}",
                self.size, self.base
            ))),
        }
    }

    /// Maps all of `memory` at `offset` and grants `device` `access` to it.
    /// The mapping keeps the pages alive even after `memory` is dropped.
    pub fn map(
        &mut self,
        offset: usize,
        memory: &PhysicalMemory,
        device: &Device,
        access: Access,
    ) -> Result<()> {
        let len = memory.size();
        self.check_range(offset, len)?;
        if let Some((o, s)) = self.mapped.range(..offset + len).next_back() {
            if o + s > offset {
                return Err(Error::InvalidArgument(format!(
                    "offset {offset:#x}+{len:#x} overlaps the mapping at {o:#x}+{s:#x}"
                )));
            }
        }
        let va = self.base + offset as u64;
        check_with(
            "cuMemMap",
            // SAFETY: the range lies inside our reservation and is not mapped
            // (checked above); the handle is live for the call.
            unsafe { sys::cuMemMap(va, len, 0, memory.handle(), 0) },
            || format!("{len} bytes at {va:#x}"),
        )?;
        self.mapped.insert(offset, len);
        if let Err(e) = self.set_access(offset, len, device, access) {
            let _ = self.unmap(offset);
            return Err(e);
        }
        Ok(())
    }

    /// Changes the access `device` has to a mapped range.
    pub fn set_access(
        &self,
        offset: usize,
        len: usize,
        device: &Device,
        access: Access,
    ) -> Result<()> {
        self.check_range(offset, len)?;
        // SAFETY: CUmemAccessDesc is a plain C struct; zero is a valid start.
        let mut desc: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
        desc.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        desc.location.id = device.ordinal();
        desc.flags = match access {
            Access::ReadOnly => sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ,
            Access::ReadWrite => sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        let va = self.base + offset as u64;
        // SAFETY: one valid descriptor, for a mapped range of our reservation.
        check_with(
            "cuMemSetAccess",
            unsafe { sys::cuMemSetAccess(va, len, &desc, 1) },
            || format!("{len} bytes at {va:#x}, {access:?}"),
        )
    }

    /// Unmaps the mapping that starts at `offset`, keeping the addresses
    /// reserved (sleep, or KV release).
    pub fn unmap(&mut self, offset: usize) -> Result<()> {
        let len = self.mapped.remove(&offset).ok_or_else(|| {
            Error::InvalidArgument(format!("nothing is mapped at offset {offset:#x}"))
        })?;
        let va = self.base + offset as u64;
        // SAFETY: exactly this range was mapped by `map` and not unmapped yet.
        check_with("cuMemUnmap", unsafe { sys::cuMemUnmap(va, len) }, || {
            format!("{len} bytes at {va:#x}")
        })
    }

    /// Fills `count` 32-bit words at `offset` with `value` (synchronous).
    pub fn fill_u32(&self, offset: usize, value: u32, count: usize) -> Result<()> {
        self.check_range(offset, count * 4)?;
        // SAFETY: the range is inside the reservation; the driver reports an
        // error for unmapped or read-only pages instead of faulting the host.
        check("cuMemsetD32", unsafe {
            sys::cuMemsetD32_v2(self.base + offset as u64, value, count)
        })?;
        // SAFETY: no arguments.
        check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
    }

    /// Copies device bytes at `offset` into `out`.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        self.check_range(offset, out.len())?;
        // SAFETY: `out` is a writable host buffer of the length passed.
        check("cuMemcpyDtoH", unsafe {
            sys::cuMemcpyDtoH_v2(
                out.as_mut_ptr().cast(),
                self.base + offset as u64,
                out.len(),
            )
        })
    }

    /// Copies `data` to device bytes at `offset`.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.check_range(offset, data.len())?;
        // SAFETY: `data` is a readable host buffer of the length passed.
        check("cuMemcpyHtoD", unsafe {
            sys::cuMemcpyHtoD_v2(self.base + offset as u64, data.as_ptr().cast(), data.len())
        })
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        for (offset, len) in std::mem::take(&mut self.mapped) {
            // SAFETY: each entry is a live mapping of this reservation.
            let _ = unsafe { sys::cuMemUnmap(self.base + offset as u64, len) };
        }
        // SAFETY: the range came from cuMemAddressReserve and is now empty.
        let _ = unsafe { sys::cuMemAddressFree(self.base, self.size) };
    }
}
