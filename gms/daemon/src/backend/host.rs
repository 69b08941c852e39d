//! The `host` backend: each allocation is a `memfd`.
//!
//! - The daemon `fallocate`s the whole file and maps it read-only with
//!   `MAP_POPULATE`, so every page is allocated by (and charged to) `gmsd`,
//!   not to whichever engine touches it first, and shows in its RSS.
//! - Readers get a descriptor reopened `O_RDONLY` through `/proc/self/fd`: a
//!   read-only open file description, so `mmap(PROT_WRITE, MAP_SHARED)`,
//!   `mprotect(PROT_WRITE)`, `write`, `ftruncate` and `fallocate` all fail
//!   whatever the reader tries.
//! - At commit the memfd is sealed (`F_SEAL_WRITE|GROW|SHRINK|SEAL`), so not
//!   even the writer's own read-write descriptor can change it afterwards.
//!   The kernel refuses the write seal while any writable shared mapping
//!   exists, which is why the daemon's own view maps the read-only
//!   descriptor, and why the client unmaps its writable view before commit.

use std::ffi::c_void;
use std::fs::OpenOptions;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::ptr::NonNull;

use nix::fcntl::{fallocate, fcntl, FallocateFlags, FcntlArg, SealFlag};
use nix::sys::memfd::{memfd_create, MFdFlags};
use nix::sys::stat::fstat;
use nix::unistd::ftruncate;

use gms::{Access, Error, Result};

use super::{Backend, Memory};

pub struct HostBackend {
    page: u64,
    /// The GPU this backend stands in for (`gmsd --device host:GPU-…`), or
    /// none for plain `host`.
    stands_for: Option<String>,
}

impl HostBackend {
    pub fn new() -> Result<Self> {
        let page = nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
            .map_err(|e| Error::sys("sysconf(_SC_PAGESIZE)", e))?
            .ok_or_else(|| Error::Backend("the kernel reports no page size".into()))?;
        Ok(HostBackend {
            page: page as u64,
            stands_for: None,
        })
    }

    /// Host memory served under a GPU's name: the socket is that GPU's
    /// (`gms-<GPU-UUID>.sock`) and the status names it. For tests of
    /// multi-GPU pairs on machines without GPUs.
    pub fn standing_for(uuid: &str) -> Result<Self> {
        let valid = uuid.starts_with("GPU-")
            && uuid.len() <= 64
            && uuid[4..]
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-');
        if !valid {
            return Err(Error::Backend(format!(
                "host:{uuid}: not a GPU UUID (GPU-<hex and dashes>)"
            )));
        }
        Ok(HostBackend {
            stands_for: Some(uuid.to_string()),
            ..HostBackend::new()?
        })
    }
}

impl Backend for HostBackend {
    fn name(&self) -> &'static str {
        "host"
    }

    fn device(&self) -> String {
        self.stands_for.clone().unwrap_or_else(|| "host".into())
    }

    fn socket_name(&self) -> String {
        match &self.stands_for {
            Some(uuid) => shadow_contract::paths::gms_socket_name(uuid),
            None => shadow_contract::paths::GMS_HOST_SOCKET.into(),
        }
    }

    fn granularity(&self) -> u64 {
        self.page
    }

    fn allocate(&self, size: u64, tag: &str) -> Result<Box<dyn Memory>> {
        Ok(Box::new(HostMemory::new(size, tag)?))
    }
}

/// A read-only, populated view of a memfd in the daemon; unmapped on drop.
struct View {
    addr: NonNull<c_void>,
    len: usize,
}

// SAFETY: the view is only a keep-resident mapping, never dereferenced;
// moving the address between threads is sound.
unsafe impl Send for View {}

impl Drop for View {
    fn drop(&mut self) {
        // SAFETY: addr/len describe a mapping this View created and owns.
        if let Err(e) = unsafe { nix::sys::mman::munmap(self.addr, self.len) } {
            tracing::error!("munmap of daemon view at {:p} failed: {e}", self.addr);
        }
    }
}

pub struct HostMemory {
    rw: OwnedFd,
    ro: OwnedFd,
    size: u64,
    sealed: bool,
    _view: View,
}

impl HostMemory {
    fn new(size: u64, tag: &str) -> Result<Self> {
        let len = usize::try_from(size)
            .ok()
            .and_then(std::num::NonZeroUsize::new)
            .ok_or_else(|| Error::Invalid(format!("allocation size {size}")))?;
        let off = libc::off_t::try_from(size)
            .map_err(|_| Error::Invalid(format!("allocation size {size} exceeds off_t")))?;
        let name = format!("gms:{tag}");
        let rw = memfd_create(
            name.as_str(),
            MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING,
        )
        .map_err(|e| Error::sys(format!("memfd_create({name})"), e))?;
        ftruncate(&rw, off)
            .map_err(|e| Error::sys(format!("ftruncate of memfd {name} to {size} bytes"), e))?;
        // Allocate every page now, in this process: ENOSPC/ENOMEM here is a
        // clear allocation failure instead of a SIGBUS in an engine later.
        fallocate(&rw, FallocateFlags::empty(), 0, off).map_err(|e| {
            Error::sys(
                format!("fallocate of {size} bytes for memfd {name} (tmpfs/memory full?)"),
                e,
            )
        })?;
        let ro = reopen_read_only(&rw)?;
        // SAFETY: a fresh shared read-only mapping of our own memfd at a
        // kernel-chosen address; nothing else aliases it.
        let addr = unsafe {
            nix::sys::mman::mmap(
                None,
                len,
                nix::sys::mman::ProtFlags::PROT_READ,
                nix::sys::mman::MapFlags::MAP_SHARED | nix::sys::mman::MapFlags::MAP_POPULATE,
                &ro,
                0,
            )
        }
        .map_err(|e| Error::sys(format!("mmap of daemon view of {name} ({size} bytes)"), e))?;
        Ok(HostMemory {
            rw,
            ro,
            size,
            sealed: false,
            _view: View {
                addr,
                len: len.get(),
            },
        })
    }
}

fn reopen_read_only(fd: &OwnedFd) -> Result<OwnedFd> {
    let path = format!("/proc/self/fd/{}", fd.as_raw_fd());
    let file = OpenOptions::new()
        .read(true)
        .open(&path)
        .map_err(|e| Error::io(format!("reopening {path} read-only"), e))?;
    Ok(OwnedFd::from(file))
}

impl Memory for HostMemory {
    fn size(&self) -> u64 {
        self.size
    }

    fn seal(&mut self) -> Result<()> {
        if self.sealed {
            return Ok(());
        }
        let seals = SealFlag::F_SEAL_WRITE
            | SealFlag::F_SEAL_GROW
            | SealFlag::F_SEAL_SHRINK
            | SealFlag::F_SEAL_SEAL;
        match fcntl(&self.rw, FcntlArg::F_ADD_SEALS(seals)) {
            Ok(_) => {
                self.sealed = true;
                Ok(())
            }
            Err(nix::errno::Errno::EBUSY) => Err(Error::NotPermitted {
                op: "commit".into(),
                why: "an allocation is still mapped writable somewhere; the writer must \
                      unmap (or remap read-only) every allocation before commit"
                    .into(),
            }),
            Err(e) => Err(Error::sys(
                format!("sealing memfd fd {}", self.rw.as_raw_fd()),
                e,
            )),
        }
    }

    fn sealed(&self) -> bool {
        self.sealed
    }

    fn export(&self, access: Access) -> Result<OwnedFd> {
        let fd = match access {
            Access::ReadWrite if self.sealed => {
                return Err(Error::NotPermitted {
                    op: "export".into(),
                    why: "allocation is committed; only read-only export".into(),
                })
            }
            Access::ReadWrite => &self.rw,
            Access::ReadOnly => &self.ro,
        };
        fd.as_fd()
            .try_clone_to_owned()
            .map_err(|e| Error::io(format!("dup of memfd fd {}", fd.as_raw_fd()), e))
    }

    fn resident_bytes(&self) -> Result<u64> {
        let st = fstat(&self.rw)
            .map_err(|e| Error::sys(format!("fstat of memfd fd {}", self.rw.as_raw_fd()), e))?;
        Ok(st.st_blocks as u64 * 512)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn memory_is_resident_sealed_and_read_only_for_readers() {
        let backend = HostBackend::new().unwrap();
        let size = 16 * backend.granularity();
        let mut mem = backend.allocate(size, "weights").unwrap();
        assert_eq!(mem.resident_bytes().unwrap(), size, "fallocated up front");

        let rw = mem.export(Access::ReadWrite).unwrap();
        std::fs::File::from(rw.try_clone().unwrap())
            .write_all(b"abc")
            .unwrap();

        let ro = mem.export(Access::ReadOnly).unwrap();
        assert!(
            std::fs::File::from(ro).write_all(b"x").is_err(),
            "a read-only descriptor cannot write"
        );

        mem.seal().unwrap();
        assert!(mem.sealed());
        assert!(
            std::fs::File::from(rw).write_all(b"x").is_err(),
            "after sealing even the writer's descriptor cannot write"
        );
        assert!(mem.export(Access::ReadWrite).is_err());
        assert!(mem.export(Access::ReadOnly).is_ok());
    }

    #[test]
    fn seal_is_refused_while_a_writable_mapping_exists() {
        let backend = HostBackend::new().unwrap();
        let size = backend.granularity();
        let mut mem = backend.allocate(size, "w").unwrap();
        let rw = mem.export(Access::ReadWrite).unwrap();
        let len = std::num::NonZeroUsize::new(size as usize).unwrap();
        // SAFETY: fresh mapping of our own memfd, unmapped below.
        let addr = unsafe {
            nix::sys::mman::mmap(
                None,
                len,
                nix::sys::mman::ProtFlags::PROT_READ | nix::sys::mman::ProtFlags::PROT_WRITE,
                nix::sys::mman::MapFlags::MAP_SHARED,
                &rw,
                0,
            )
        }
        .unwrap();
        assert!(matches!(mem.seal(), Err(Error::NotPermitted { .. })));
        // SAFETY: the mapping made above.
        unsafe { nix::sys::mman::munmap(addr, size as usize) }.unwrap();
        mem.seal().unwrap();
    }
}
