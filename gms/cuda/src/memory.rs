//! Physical device memory: created by `gmsd` without a context, exported as a
//! POSIX fd, imported by engines from that fd. The handle is released on drop;
//! the driver frees the pages only when no mapping and no process refers to
//! them any more, which is what lets weights outlive the engine that loaded
//! them.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use cudarc::driver::sys;

use crate::{
    device::Device,
    error::{check_with, Error, Result},
};

/// One physical allocation, owned by this process.
#[derive(Debug)]
pub struct PhysicalMemory {
    handle: sys::CUmemGenericAllocationHandle,
    size: usize,
}

impl PhysicalMemory {
    /// Allocates `size` bytes on `device`. `size` must already be a multiple
    /// of the device granularity ([`Device::granularity`]).
    pub fn create(device: &Device, size: usize) -> Result<PhysicalMemory> {
        let granularity = device.granularity(false)?;
        if size == 0 || size % granularity != 0 {
            return Err(Error::InvalidArgument(format!(
                "allocation of {size} bytes on {}: size must be a non-zero multiple of the device granularity ({granularity} bytes)",
                device.uuid()
            )));
        }
        let prop = device.allocation_prop();
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        check_with(
            "cuMemCreate",
            // SAFETY: `handle` and `prop` are valid for the call; flags must be 0.
            unsafe { sys::cuMemCreate(&mut handle, size, &prop, 0) },
            || format!("{size} bytes on {} ({})", device.uuid(), device.name()),
        )?;
        Ok(PhysicalMemory { handle, size })
    }

    /// Imports an allocation another process exported. `size` is the size it
    /// was created with (the fd does not carry it). The fd stays the
    /// caller's: the driver takes its own reference.
    pub fn import(fd: &OwnedFd, size: usize) -> Result<PhysicalMemory> {
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // The driver reads the fd as an integer smuggled through the pointer
        // argument, as the API documents for POSIX fd handles.
        let os_handle = fd.as_raw_fd() as usize as *mut std::ffi::c_void;
        check_with(
            "cuMemImportFromShareableHandle",
            // SAFETY: `handle` is a valid out-pointer and `os_handle` is an open
            // fd kept alive by the borrow for the duration of the call.
            unsafe {
                sys::cuMemImportFromShareableHandle(
                    &mut handle,
                    os_handle,
                    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                )
            },
            || format!("fd {}, {size} bytes", fd.as_raw_fd()),
        )?;
        Ok(PhysicalMemory { handle, size })
    }

    /// A new file descriptor referring to this allocation, for another
    /// process (sent over a Unix socket with SCM_RIGHTS).
    pub fn export_fd(&self) -> Result<OwnedFd> {
        let mut fd: std::ffi::c_int = -1;
        check_with(
            "cuMemExportToShareableHandle",
            // SAFETY: for POSIX fd handles the out-parameter is an `int`.
            unsafe {
                sys::cuMemExportToShareableHandle(
                    (&mut fd as *mut std::ffi::c_int).cast(),
                    self.handle,
                    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                    0,
                )
            },
            || format!("{} bytes", self.size),
        )?;
        if fd < 0 {
            return Err(Error::InvalidArgument(format!(
                "cuMemExportToShareableHandle returned success with fd {fd}"
            )));
        }
        // SAFETY: the driver returned a new descriptor that nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    pub fn size(&self) -> usize {
        self.size
    }

    pub(crate) fn handle(&self) -> sys::CUmemGenericAllocationHandle {
        self.handle
    }
}

impl Drop for PhysicalMemory {
    fn drop(&mut self) {
        // SAFETY: `handle` came from cuMemCreate or an import and is released
        // exactly once, here. Existing mappings keep the pages alive.
        let _ = unsafe { sys::cuMemRelease(self.handle) };
    }
}
