//! One error type for the VMM layer: which driver call failed, with which
//! CUDA error, on which device, so an operator can act on it.

use cudarc::driver::sys::CUresult;

/// What went wrong talking to the CUDA driver.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// `libcuda.so.1` could not be loaded: no NVIDIA driver on this host (or
    /// not on the loader path).
    #[error("the NVIDIA driver library (libcuda.so.1) is not on this host's loader path; the cuda backend needs a GPU host with the NVIDIA driver installed")]
    NoDriver,
    /// A driver call returned an error.
    #[error("{call} failed: {name} ({code}){context}")]
    Driver {
        call: &'static str,
        code: u32,
        name: String,
        context: String,
    },
    /// No device matches what was asked for.
    #[error("no CUDA device matches {wanted:?} (this host has {count} device(s){known})")]
    NoSuchDevice {
        wanted: String,
        count: i32,
        known: String,
    },
    /// A device selector could not be parsed.
    #[error("cannot parse CUDA device {0:?}: expected an index (0, 1, …) or a GPU UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)")]
    BadSelector(String),
    /// A size or offset that the driver would refuse, caught before the call.
    #[error("{0}")]
    InvalidArgument(String),
}

impl Error {
    /// The driver had no device memory for the call
    /// (`CUDA_ERROR_OUT_OF_MEMORY`).
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, Error::Driver { code, .. }
            if *code == CUresult::CUDA_ERROR_OUT_OF_MEMORY as u32)
    }
}

/// Result of this crate.
pub type Result<T> = std::result::Result<T, Error>;

/// Wraps a driver error with what GMS was doing at the time, as the error a
/// GMS peer reports (`backend: …`): for the daemon's cuda backend and the
/// engine-side mapper alike.
pub fn gms_error(context: impl Into<String>) -> impl FnOnce(Error) -> gms::Error {
    let context = context.into();
    move |e| gms::Error::Backend(format!("{context}: {e}"))
}

/// Turns a driver status into a `Result`, naming the call.
pub(crate) fn check(call: &'static str, status: CUresult) -> Result<()> {
    check_with(call, status, String::new)
}

/// As [`check`], with context (device, size, address) computed only on error.
pub(crate) fn check_with(
    call: &'static str,
    status: CUresult,
    context: impl FnOnce() -> String,
) -> Result<()> {
    if status == CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let ctx = context();
    Err(Error::Driver {
        call,
        code: status as u32,
        name: format!("{status:?}"),
        context: if ctx.is_empty() {
            ctx
        } else {
            format!(" ({ctx})")
        },
    })
}
