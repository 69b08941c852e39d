//! The CUDA driver's virtual memory management (VMM) API as owned Rust types.
//!
//! GMS keeps model weights alive outside any engine. On a GPU that means
//! physical allocations made by `gmsd` with `cuMemCreate` (no CUDA context
//! needed), exported as POSIX file descriptors, and imported and mapped by the
//! engines at a virtual address they all agree on. This crate is the one place
//! in the project that calls those driver functions; everything above it deals
//! in [`PhysicalMemory`], [`Reservation`] and file descriptors.
//!
//! `libcuda.so.1` is loaded at run time: a binary linking this crate starts on
//! a machine without a GPU and [`Driver::load`] answers [`Error::NoDriver`].
//!
//! Ownership: a [`PhysicalMemory`] releases its handle on drop (the driver
//! keeps the pages while a mapping or another process still refers to them);
//! a [`Reservation`] unmaps whatever it still has mapped and frees its address
//! range on drop. A file descriptor is always an [`OwnedFd`].
//!
//! [`mapper`] is GMS's engine side on a GPU (the client's `Mapper` over these
//! types). It lives here, not in `gms`, so that only what maps device memory
//! links the driver bindings.

mod device;
mod error;
pub mod mapper;
mod memory;
mod reservation;

pub use device::{parse_device, Device, DeviceSelector, Driver, GpuUuid, PrimaryContext};
pub use error::{gms_error, Error, Result};
pub use memory::PhysicalMemory;
pub use reservation::{Access, Reservation};

use std::os::fd::OwnedFd;

/// Rounds `size` up to a multiple of `granularity` (a power of two or any
/// positive value); `None` on overflow or a zero granularity.
pub fn round_up(size: usize, granularity: usize) -> Option<usize> {
    if granularity == 0 {
        return None;
    }
    let rem = size % granularity;
    if rem == 0 {
        Some(size)
    } else {
        size.checked_add(granularity - rem)
    }
}

/// Keeps the import side of the API in one place: an fd received from gmsd
/// becomes a handle of this process. The fd is consumed by the caller's
/// choice (the driver duplicates what it needs), so it is borrowed here.
pub fn import_fd(fd: &OwnedFd, size: usize) -> Result<PhysicalMemory> {
    PhysicalMemory::import(fd, size)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_up_to_granularity() {
        let two_mib = 2 << 20;
        assert_eq!(round_up(0, two_mib), Some(0));
        assert_eq!(round_up(1, two_mib), Some(two_mib));
        assert_eq!(round_up(two_mib, two_mib), Some(two_mib));
        assert_eq!(round_up(two_mib + 1, two_mib), Some(2 * two_mib));
        assert_eq!(round_up(usize::MAX, two_mib), None);
        assert_eq!(round_up(5, 0), None);
    }
}
