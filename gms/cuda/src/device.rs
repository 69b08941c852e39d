//! Finding the driver and the devices: load `libcuda` at run time, name a
//! device by index or by GPU UUID (what `nvidia-smi -L` prints and what the
//! GMS socket name carries), and query its allocation granularity.

use std::{ffi::CStr, fmt, str::FromStr};

use cudarc::driver::sys;

use crate::error::{check, check_with, Error, Result};

/// Proof that `libcuda` is loaded and `cuInit` succeeded in this process.
/// Every other type of this crate is reached through one.
#[derive(Clone, Copy, Debug)]
pub struct Driver {
    _loaded: (),
}

impl Driver {
    /// Loads the driver library and initialises the driver API. Creates no
    /// context: `gmsd` holds memory without one.
    pub fn load() -> Result<Driver> {
        // SAFETY: only probes whether the library can be opened; it calls no
        // symbol from it.
        if !unsafe { sys::is_culib_present() } {
            return Err(Error::NoDriver);
        }
        // SAFETY: cuInit takes a flags word that must be 0; the library is
        // present, so resolving the symbol does not panic.
        check("cuInit", unsafe { sys::cuInit(0) })?;
        Ok(Driver { _loaded: () })
    }

    /// The driver's CUDA version as `major * 1000 + minor * 10` (13000 = 13.0).
    pub fn version(&self) -> Result<i32> {
        let mut v = 0;
        // SAFETY: `v` is a valid out-pointer for the duration of the call.
        check("cuDriverGetVersion", unsafe {
            sys::cuDriverGetVersion(&mut v)
        })?;
        Ok(v)
    }

    /// Number of devices visible to this process.
    pub fn device_count(&self) -> Result<i32> {
        let mut n = 0;
        // SAFETY: `n` is a valid out-pointer for the duration of the call.
        check("cuDeviceGetCount", unsafe { sys::cuDeviceGetCount(&mut n) })?;
        Ok(n)
    }

    /// The device at `ordinal`.
    pub fn device_at(&self, ordinal: i32) -> Result<Device> {
        let mut handle: sys::CUdevice = 0;
        check_with(
            "cuDeviceGet",
            // SAFETY: `handle` is a valid out-pointer; the driver checks the ordinal.
            unsafe { sys::cuDeviceGet(&mut handle, ordinal) },
            || format!("device {ordinal}"),
        )?;
        let mut raw = sys::CUuuid_st { bytes: [0; 16] };
        check_with(
            "cuDeviceGetUuid",
            // SAFETY: `raw` is a valid out-pointer to a 16-byte CUuuid.
            unsafe { sys::cuDeviceGetUuid_v2(&mut raw, handle) },
            || format!("device {ordinal}"),
        )?;
        let uuid = GpuUuid(raw.bytes.map(|b| b as u8));
        let mut name = [0 as std::ffi::c_char; 128];
        // SAFETY: `name` is a writable buffer of the length passed.
        check("cuDeviceGetName", unsafe {
            sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as i32, handle)
        })?;
        // SAFETY: the driver NUL-terminates the name within the buffer.
        let name = unsafe { CStr::from_ptr(name.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        Ok(Device {
            ordinal,
            handle,
            uuid,
            name,
        })
    }

    /// The device a selector names.
    pub fn device(&self, selector: &DeviceSelector) -> Result<Device> {
        let count = self.device_count()?;
        match selector {
            DeviceSelector::Index(i) => {
                if *i >= count {
                    return Err(Error::NoSuchDevice {
                        wanted: selector.to_string(),
                        count,
                        known: String::new(),
                    });
                }
                self.device_at(*i)
            }
            DeviceSelector::Uuid(want) => {
                let mut known = Vec::new();
                for i in 0..count {
                    let d = self.device_at(i)?;
                    if d.uuid == *want {
                        return Ok(d);
                    }
                    known.push(d.uuid.to_string());
                }
                Err(Error::NoSuchDevice {
                    wanted: selector.to_string(),
                    count,
                    known: if known.is_empty() {
                        String::new()
                    } else {
                        format!(": {}", known.join(", "))
                    },
                })
            }
        }
    }
}

/// A GPU's UUID, printed as `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GpuUuid(pub [u8; 16]);

impl fmt::Display for GpuUuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = &self.0;
        write!(f, "GPU-")?;
        for (i, byte) in b.iter().enumerate() {
            if matches!(i, 4 | 6 | 8 | 10) {
                write!(f, "-")?;
            }
            write!(f, "{byte:02x}")?;
        }
        Ok(())
    }
}

impl FromStr for GpuUuid {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let bad = || Error::BadSelector(s.to_string());
        let hex = s.strip_prefix("GPU-").ok_or_else(bad)?;
        let groups: Vec<&str> = hex.split('-').collect();
        let lens: Vec<usize> = groups.iter().map(|g| g.len()).collect();
        if lens != [8, 4, 4, 4, 12] {
            return Err(bad());
        }
        let digits: String = groups.concat();
        let mut out = [0u8; 16];
        for (i, slot) in out.iter_mut().enumerate() {
            let pair = digits.get(2 * i..2 * i + 2).ok_or_else(bad)?;
            *slot = u8::from_str_radix(pair, 16).map_err(|_| bad())?;
        }
        Ok(GpuUuid(out))
    }
}

/// How a person names a device: `0`, `1`, … or a GPU UUID.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceSelector {
    Index(i32),
    Uuid(GpuUuid),
}

impl FromStr for DeviceSelector {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        if s.starts_with("GPU-") {
            return Ok(DeviceSelector::Uuid(s.parse()?));
        }
        match s.parse::<i32>() {
            Ok(i) if i >= 0 => Ok(DeviceSelector::Index(i)),
            _ => Err(Error::BadSelector(s.to_string())),
        }
    }
}

impl fmt::Display for DeviceSelector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSelector::Index(i) => write!(f, "{i}"),
            DeviceSelector::Uuid(u) => write!(f, "{u}"),
        }
    }
}

/// One GPU, as the driver numbers it in this process.
#[derive(Clone, Debug)]
pub struct Device {
    ordinal: i32,
    handle: sys::CUdevice,
    uuid: GpuUuid,
    name: String,
}

impl Device {
    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    pub fn uuid(&self) -> GpuUuid {
        self.uuid
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The allocation properties GMS uses everywhere: pinned device memory
    /// exportable as a POSIX file descriptor.
    pub(crate) fn allocation_prop(&self) -> sys::CUmemAllocationProp {
        // SAFETY: CUmemAllocationProp is a plain C struct for which all-zero
        // is the documented "no flags" value of every field.
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.requestedHandleTypes =
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = self.ordinal;
        prop
    }

    /// The size every allocation and mapping is rounded to. `recommended`
    /// asks for the driver's performance granularity rather than the minimum.
    pub fn granularity(&self, recommended: bool) -> Result<usize> {
        let prop = self.allocation_prop();
        let flag = if recommended {
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
        } else {
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM
        };
        let mut g = 0usize;
        // SAFETY: `g` and `prop` are valid for the duration of the call.
        check("cuMemGetAllocationGranularity", unsafe {
            sys::cuMemGetAllocationGranularity(&mut g, &prop, flag)
        })?;
        Ok(g)
    }

    /// Makes this device's primary context current on the calling thread,
    /// as an engine needs before it maps or touches memory. The context is
    /// the one PyTorch and the runtime API share.
    pub fn retain_primary_context(&self) -> Result<PrimaryContext> {
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `ctx` is a valid out-pointer; the device handle is valid.
        check("cuDevicePrimaryCtxRetain", unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut ctx, self.handle)
        })?;
        let held = PrimaryContext {
            device: self.handle,
            ctx,
        };
        held.make_current()?;
        Ok(held)
    }

    /// Free and total bytes of device memory, as the driver counts them.
    /// Needs a current context.
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: both out-pointers are valid for the duration of the call.
        check("cuMemGetInfo", unsafe {
            sys::cuMemGetInfo_v2(&mut free, &mut total)
        })?;
        Ok((free, total))
    }
}

/// A retained primary context; released on drop.
#[derive(Debug)]
pub struct PrimaryContext {
    device: sys::CUdevice,
    ctx: sys::CUcontext,
}

impl PrimaryContext {
    /// Makes the context current on the calling thread (each thread that
    /// calls the driver needs it).
    pub fn make_current(&self) -> Result<()> {
        // SAFETY: `ctx` was returned by cuDevicePrimaryCtxRetain and is still
        // retained by `self`.
        check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(self.ctx) })
    }

    /// Waits for all work queued in the context.
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: no arguments; acts on the current context.
        check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
    }
}

impl Drop for PrimaryContext {
    fn drop(&mut self) {
        // SAFETY: balances the retain made when `self` was created.
        let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.device) };
    }
}

/// Parses a `--device` flag: `0`, `cuda:0`, or a GPU UUID (`GPU-…`).
pub fn parse_device(text: &str) -> gms::Result<DeviceSelector> {
    let bare = text.strip_prefix("cuda:").unwrap_or(text);
    bare.parse::<DeviceSelector>().map_err(|e| {
        gms::Error::Config(format!(
            "--device {text:?}: {e} (also accepted: cuda:N, or 'host')"
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_flags_parse() {
        assert_eq!(parse_device("0").unwrap(), DeviceSelector::Index(0));
        assert_eq!(parse_device("cuda:3").unwrap(), DeviceSelector::Index(3));
        let uuid = "GPU-5a2b1c3d-0e1f-2a3b-4c5d-6e7f8a9b0c1d";
        assert!(matches!(parse_device(uuid), Ok(DeviceSelector::Uuid(_))));
        for bad in ["cuda:", "cuda:-1", "gpu0", "GPU-12", "host"] {
            let err = parse_device(bad).unwrap_err();
            assert!(matches!(err, gms::Error::Config(_)), "{bad}: {err}");
        }
    }

    #[test]
    fn uuid_round_trip() {
        let text = "GPU-5a2b1c3d-0e1f-2a3b-4c5d-6e7f8a9b0c1d";
        let u: GpuUuid = text.parse().unwrap();
        assert_eq!(u.to_string(), text);
        assert_eq!(u.0[0], 0x5a);
        assert_eq!(u.0[15], 0x1d);
    }

    #[test]
    fn selectors() {
        assert_eq!(
            "0".parse::<DeviceSelector>().unwrap(),
            DeviceSelector::Index(0)
        );
        assert_eq!(
            "3".parse::<DeviceSelector>().unwrap(),
            DeviceSelector::Index(3)
        );
        assert!(matches!(
            "GPU-5a2b1c3d-0e1f-2a3b-4c5d-6e7f8a9b0c1d".parse::<DeviceSelector>(),
            Ok(DeviceSelector::Uuid(_))
        ));
        for bad in [
            "",
            "-1",
            "gpu0",
            "GPU-",
            "GPU-5a2b1c3d-0e1f-2a3b-4c5d-6e7f8a9b0c1",
            "GPU-zz2b1c3d-0e1f-2a3b-4c5d-6e7f8a9b0c1d",
        ] {
            assert!(
                matches!(bad.parse::<DeviceSelector>(), Err(Error::BadSelector(_))),
                "{bad:?} should be refused"
            );
        }
    }

    /// CI machines have no GPU: loading must answer an error, never panic
    /// (cudarc panics if a symbol is resolved without the library).
    #[test]
    fn load_without_driver_is_an_error_not_a_panic() {
        // SAFETY: only probes for the library.
        let present = unsafe { sys::is_culib_present() };
        match Driver::load() {
            Ok(_) => assert!(present),
            Err(Error::NoDriver) => assert!(!present),
            // A driver library without a usable GPU fails in cuInit.
            Err(Error::Driver { call, .. }) => assert!(present && call == "cuInit"),
            Err(e) => panic!("unexpected error: {e}"),
        }
    }
}
