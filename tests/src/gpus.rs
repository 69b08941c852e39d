//! Fake NVIDIA GPUs for the multi-GPU pair tests on machines without GPUs.
//!
//! A pair's GPUs are the `/dev/nvidiaN` character devices (major 195) that
//! the spec's `linux.devices` grants, mapped by minor to a UUID through the
//! driver's `/proc/driver/nvidia/gpus/<bus>/information`. Here the device
//! nodes are made (`mknod`, never opened) under the test's directory and
//! given to `ctr run --device`, the driver's directory is a fake one the
//! shim config names (`pair.nvidia_gpus_dir`), and each GPU's gmsd serves
//! host memory under that GPU's UUID (`pair.gms_gpus_on_host`). Everything
//! the shim does with a GPU's identity is thus real: only the memory is not.

use std::path::{Path, PathBuf};

use crate::{Containerd, Error, Result};

/// The NVIDIA driver's character-device major.
pub const NVIDIA_MAJOR: u64 = 195;

/// `n` fake GPUs under one test's containerd directory.
pub struct FakeGpus {
    /// The fake `/proc/driver/nvidia/gpus`.
    pub driver_dir: PathBuf,
    /// Each GPU's device node on the host (minor = index).
    pub nodes: Vec<PathBuf>,
    /// Each GPU's UUID (`GPU-…`).
    pub uuids: Vec<String>,
}

impl FakeGpus {
    pub fn new(cd: &Containerd, n: u32) -> Result<FakeGpus> {
        let driver_dir = cd.dir().join("nvidia-gpus");
        let dev = cd.dir().join("dev");
        std::fs::create_dir_all(&dev).map_err(|e| Error::io("create dir", &dev, e))?;
        let mut nodes = Vec::new();
        let mut uuids = Vec::new();
        for i in 0..n {
            let uuid = format!("GPU-5ad0{i:04x}-0000-4000-8000-{:012x}", 0xfacade + i);
            let bus = driver_dir.join(format!("0000:{:02x}:00.0", 0x3b + i));
            std::fs::create_dir_all(&bus).map_err(|e| Error::io("create dir", &bus, e))?;
            let info = bus.join("information");
            std::fs::write(
                &info,
                format!("Model: \t\t NVIDIA Fake\nGPU UUID: \t {uuid}\nDevice Minor: \t {i}\n"),
            )
            .map_err(|e| Error::io("write", &info, e))?;
            let node = dev.join(format!("nvidia{i}"));
            mknod_char(&node, NVIDIA_MAJOR, u64::from(i))?;
            nodes.push(node);
            uuids.push(uuid);
        }
        Ok(FakeGpus {
            driver_dir,
            nodes,
            uuids,
        })
    }

    /// The `[pair]` keys that make the shim use these GPUs.
    pub fn config(&self) -> String {
        format!(
            "nvidia_gpus_dir = \"{}\"\ngms_gpus_on_host = true",
            self.driver_dir.display()
        )
    }

    /// `ctr run` flags granting the GPUs of `indices`.
    pub fn grant(&self, indices: &[usize]) -> Vec<String> {
        indices
            .iter()
            .flat_map(|i| ["--device".to_string(), self.nodes[*i].display().to_string()])
            .collect()
    }

    /// The socket name of GPU `i`'s daemon.
    pub fn socket_name(&self, i: usize) -> String {
        shadow_contract::paths::gms_socket_name(&self.uuids[i])
    }
}

fn mknod_char(path: &Path, major: u64, minor: u64) -> Result<()> {
    use nix::sys::stat::{makedev, mknod, Mode, SFlag};
    match mknod(
        path,
        SFlag::S_IFCHR,
        Mode::from_bits_truncate(0o600),
        makedev(major, minor),
    ) {
        Ok(()) | Err(nix::errno::Errno::EEXIST) => Ok(()),
        Err(e) => Err(Error::io("mknod", path, e.into())),
    }
}
