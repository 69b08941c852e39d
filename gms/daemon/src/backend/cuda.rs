//! The `cuda` backend: each allocation is device memory made with
//! `cuMemCreate` (pinned, POSIX-fd shareable) and handed to engines as a file
//! descriptor from `cuMemExportToShareableHandle`.
//!
//! `gmsd` never creates a CUDA context: `cuInit`, `cuMemCreate` and the
//! export need none, so the daemon costs no context memory on the device and
//! holds no state that a GPU fault in an engine could poison.
//!
//! Read-only is *not* enforced on the descriptor: a CUDA shareable fd carries
//! no access mode, and whoever imports it may map it read-write. What keeps
//! committed weights intact is (a) the daemon refusing read-write exports
//! after commit (`seal` flips that switch), and (b) readers mapping with
//! `cuMemSetAccess(PROT_READ)`, so that a stray kernel write faults in that
//! reader alone. A hostile process holding a reader's fd could still map it
//! writable; the socket's peer-credential check is the boundary for that.

use std::os::fd::OwnedFd;

use gms::client::cuda_socket_name;
use gms::{Access, Error, Result};
use gms_cuda::{gms_error as cuda_error, Device, DeviceSelector, Driver, PhysicalMemory};

use super::{Backend, Memory};

pub struct CudaBackend {
    device: Device,
    granularity: u64,
}

impl CudaBackend {
    /// Loads the driver (no context) and finds the device.
    pub fn open(selector: &DeviceSelector) -> Result<Self> {
        let driver = Driver::load().map_err(cuda_error("loading the CUDA driver"))?;
        let device = driver
            .device(selector)
            .map_err(cuda_error(format!("finding CUDA device {selector}")))?;
        let granularity = device
            .granularity(false)
            .map_err(cuda_error(format!("granularity of {}", device.uuid())))?
            as u64;
        Ok(CudaBackend {
            device,
            granularity,
        })
    }

    pub fn device_name(&self) -> &str {
        self.device.name()
    }

    pub fn ordinal(&self) -> i32 {
        self.device.ordinal()
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn device(&self) -> String {
        self.device.uuid().to_string()
    }

    fn socket_name(&self) -> String {
        cuda_socket_name(&self.device.uuid().to_string())
    }

    fn granularity(&self) -> u64 {
        self.granularity
    }

    fn allocate(&self, size: u64, tag: &str) -> Result<Box<dyn Memory>> {
        let len = usize::try_from(size)
            .map_err(|_| Error::Invalid(format!("allocation size {size} exceeds usize")))?;
        let memory = PhysicalMemory::create(&self.device, len).map_err(cuda_error(format!(
            "allocating {size} bytes for tag {tag:?} on {} ({})",
            self.device.uuid(),
            self.device.name()
        )))?;
        Ok(Box::new(CudaMemory {
            memory,
            sealed: false,
        }))
    }
}

pub struct CudaMemory {
    memory: PhysicalMemory,
    sealed: bool,
}

impl Memory for CudaMemory {
    fn size(&self) -> u64 {
        self.memory.size() as u64
    }

    /// Only a switch: after it, `export(ReadWrite)` is refused. The driver
    /// has no way to make an exported handle read-only (see the module doc).
    fn seal(&mut self) -> Result<()> {
        self.sealed = true;
        Ok(())
    }

    fn sealed(&self) -> bool {
        self.sealed
    }

    fn export(&self, access: Access) -> Result<OwnedFd> {
        if access == Access::ReadWrite && self.sealed {
            return Err(Error::NotPermitted {
                op: "export".into(),
                why: "allocation is committed; only read-only export".into(),
            });
        }
        self.memory.export_fd().map_err(cuda_error(format!(
            "exporting {} bytes of device memory as a POSIX fd",
            self.memory.size()
        )))
    }

    /// `cuMemCreate` backs the whole allocation before it returns.
    fn resident_bytes(&self) -> Result<u64> {
        Ok(self.memory.size() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CI has no GPU: opening the backend must be an error that names the
    /// driver, not a panic.
    #[test]
    fn open_without_a_gpu_is_a_clear_error() {
        match CudaBackend::open(&DeviceSelector::Index(0)) {
            Ok(b) => assert_eq!(b.name(), "cuda"),
            Err(e) => assert!(e.to_string().contains("CUDA"), "{e}"),
        }
    }
}
