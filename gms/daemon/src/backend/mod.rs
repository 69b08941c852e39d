//! The physical memory behind allocations. The daemon, the protocol and the
//! lease code see only these two traits; a backend is one implementation of
//! them (`host`: memfd; `cuda`: `cuMemCreate` + POSIX fd handles).

pub mod cuda;
pub mod host;

use std::os::fd::OwnedFd;

use gms::{Access, Result};

/// One device's memory supply.
pub trait Backend: Send + Sync {
    /// Backend name as reported to clients: `host`, `cuda`.
    fn name(&self) -> &'static str;
    /// The device this daemon serves: `host`, or a GPU UUID.
    fn device(&self) -> String;
    /// File name of the daemon's socket in the socket directory
    /// (`gms-host.sock`, `gms-<GPU-UUID>.sock`).
    fn socket_name(&self) -> String;
    /// Allocation sizes and addresses are multiples of this.
    fn granularity(&self) -> u64;
    /// New physical memory of `size` bytes (a multiple of the granularity),
    /// resident and charged to the daemon before this returns.
    fn allocate(&self, size: u64, tag: &str) -> Result<Box<dyn Memory>>;
}

/// One physical allocation, owned by the daemon. Dropping it releases the
/// daemon's hold; engines that still map it keep the pages alive until they
/// unmap (that is the kernel's refcount, not ours).
pub trait Memory: Send {
    fn size(&self) -> u64;
    /// Commit hook: after this, no one can change the bytes, whatever
    /// descriptor they hold.
    fn seal(&mut self) -> Result<()>;
    fn sealed(&self) -> bool;
    /// A new descriptor for a client. `ReadWrite` is refused once sealed.
    fn export(&self, access: Access) -> Result<OwnedFd>;
    /// Bytes actually backed by memory right now, as the kernel counts them.
    fn resident_bytes(&self) -> Result<u64>;
}
