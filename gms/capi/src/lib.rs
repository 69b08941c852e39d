//! `libgms`: the GMS engine-side client behind a C ABI, for engines that are
//! not written in Rust — PyTorch first. Header: `gms/include/gms.h`.
//!
//! PyTorch's `CUDAPluggableAllocator` calls plain C functions that carry no
//! user pointer, so the client is process-wide: one [`Session`] behind one
//! mutex. Every entry point
//! - takes that lock (calls from any thread are serialised),
//! - runs inside `catch_unwind` (a panic never crosses into C),
//! - reports failure as NULL / a negative number, with the reason kept for
//!   `gms_last_error()` on the calling thread.
//!
//! Ownership: the session owns every mapping and descriptor; C callers get
//! addresses only. Strings returned by `gms_layout_json`/`gms_get_meta` are
//! the caller's, freed with `gms_string_free`.
//!
//! Two backends behind the same calls: a CUDA device (`device` >= 0, the
//! CUDA mapper) or the host backend (`device` < 0, memfds mapped into
//! this process: a CPU engine such as vLLM's CPU build shares its weights
//! the same way). Only the mapper differs; every entry point runs the same
//! code over either session.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use gms_core::client::{host_socket, Client, Imported, KvCache, KvWatch, Weights};
use gms_core::kvpool::{KvPool, MapWatch};
use gms_core::mapper::{HostRange, Mapper, Range};
use gms_core::protocol::{LeaseKind, Mode};
use gms_cuda::mapper::{connect_wait, CudaMapper};
use gms_cuda::parse_device;

/// What a session needs of its mapper beyond [`Mapper`]: the CUDA one has
/// a context to make current and a device to wait for; host memory has
/// neither.
trait Backend: Mapper + Clone {
    fn make_current(&self) -> Result<(), String>;
    fn synchronize(&self) -> Result<(), String>;
}

impl Backend for CudaMapper {
    fn make_current(&self) -> Result<(), String> {
        CudaMapper::make_current(self).map_err(|e| e.to_string())
    }
    fn synchronize(&self) -> Result<(), String> {
        CudaMapper::synchronize(self).map_err(|e| e.to_string())
    }
}

/// Start of the host backend's window (`GMS_HOST_VA_BASE` overrides it).
/// A reader maps every allocation at the writer's address, so the writer
/// places them where another process is unlikely to have anything: far
/// below the kernel's mmap area (near 0x7f..) and far above the heap
/// (near 0x55..), as the CUDA mapper keeps its own window.
const HOST_VA_BASE: u64 = 0x3f00_0000_0000;
/// Host allocations start on 2 MiB boundaries in the window.
const HOST_VA_ALIGN: u64 = 2 << 20;

/// The host mapper with addresses of its own window: allocations are
/// reserved at the window's next free address (skipping what this process
/// already maps there), readers' ranges at the address asked for.
#[derive(Clone)]
struct HostWindow {
    next: std::sync::Arc<Mutex<u64>>,
}

impl HostWindow {
    fn new() -> Result<Self, String> {
        let base = match std::env::var("GMS_HOST_VA_BASE") {
            Ok(text) => {
                let digits = text.trim_start_matches("0x");
                u64::from_str_radix(digits, 16)
                    .ok()
                    .filter(|b| *b > 0 && b % HOST_VA_ALIGN == 0)
                    .ok_or_else(|| {
                        format!("GMS_HOST_VA_BASE={text}: a hex address, a multiple of 2 MiB")
                    })?
            }
            Err(_) => HOST_VA_BASE,
        };
        Ok(HostWindow {
            next: std::sync::Arc::new(Mutex::new(base)),
        })
    }
}

impl Mapper for HostWindow {
    type Range = HostRange;

    fn reserve(&self, len: u64, at: Option<u64>) -> gms_core::Result<HostRange> {
        if at.is_some() {
            return HostRange::reserve(len, at);
        }
        let mut next = self.next.lock().unwrap_or_else(|p| p.into_inner());
        let step = len
            .checked_next_multiple_of(HOST_VA_ALIGN)
            .ok_or_else(|| gms_core::Error::Invalid(format!("reservation of {len} bytes")))?;
        // Something of this process in the way: try further up, a bounded
        // number of times, then let the kernel choose (readers may then
        // conflict, and say so).
        for _ in 0..64 {
            let at = *next;
            *next = at.saturating_add(step);
            match HostRange::reserve(len, Some(at)) {
                Ok(range) => return Ok(range),
                Err(gms_core::Error::AddressConflict(_)) => continue,
                Err(e) => return Err(e),
            }
        }
        HostRange::reserve(len, None)
    }
}

impl Backend for HostWindow {
    fn make_current(&self) -> Result<(), String> {
        Ok(())
    }
    fn synchronize(&self) -> Result<(), String> {
        Ok(())
    }
}

/// Everything this process holds from its GMS daemon.
struct Session<M: Mapper>
where
    M::Range: 'static,
{
    /// Field order: mappings go before the connection (the lease) ends.
    written: BTreeMap<u64, Weights<M::Range>>,
    imported: Option<Imported<M::Range>>,
    kv: BTreeMap<i64, KvCache<M::Range>>,
    next_kv: i64,
    /// The pair's KV pool, once this process holds its write lease.
    kv_pool: Option<KvPool<M::Range>>,
    /// Addresses reserved for the pool ahead of the lease
    /// (`gms_kv_pool_reserve`), taken by `gms_kv_pool_open`. Boxed: a
    /// range is large, and most sessions never hold one.
    kv_pool_ahead: Option<Box<M::Range>>,
    /// The CUDA ordinal, or -1 for the host backend.
    ordinal: i32,
    /// The daemon's socket (a KV pool's lease is a connection of its own).
    socket: PathBuf,
    client: Client<M>,
    mapper: M,
}

enum AnySession {
    Cuda(Session<CudaMapper>),
    Host(Session<HostWindow>),
}

static SESSION: Mutex<Option<AnySession>> = Mutex::new(None);

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn session() -> MutexGuard<'static, Option<AnySession>> {
    // A panic caught in an earlier call must not make every later call fail.
    SESSION.lock().unwrap_or_else(|p| p.into_inner())
}

fn set_error(msg: String) {
    let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = c);
}

/// Runs `f`, turning an error or a panic into `fallback` + a recorded error.
fn guarded<T>(what: &str, fallback: T, f: impl FnOnce() -> Result<T, String>) -> T {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(v)) => v,
        Ok(Err(msg)) => {
            set_error(format!("{what}: {msg}"));
            fallback
        }
        Err(_) => {
            set_error(format!("{what}: internal panic (a bug in libgms)"));
            fallback
        }
    }
}

/// Runs `$body` with `$s` bound to this process's session, whichever its
/// backend (the body is compiled once per backend), after making the
/// device current; "not connected" without one.
macro_rules! with_session {
    (|$s:ident| $body:expr) => {{
        let mut guard = session();
        match guard.as_mut() {
            None => Err(String::from("not connected: call gms_connect first")),
            Some(AnySession::Cuda(inner)) => {
                let f = |$s: &mut Session<CudaMapper>| -> Result<_, String> {
                    Backend::make_current(&$s.mapper)?;
                    $body
                };
                f(inner)
            }
            Some(AnySession::Host(inner)) => {
                let f = |$s: &mut Session<HostWindow>| -> Result<_, String> { $body };
                f(inner)
            }
        }
    }};
}

/// `$body` over the session without making anything current (for calls
/// that touch no device).
macro_rules! on_session {
    ($guard:expr, |$s:ident| $body:expr) => {
        match $guard {
            None => Err(String::from("not connected")),
            Some(AnySession::Cuda($s)) => $body,
            Some(AnySession::Host($s)) => $body,
        }
    };
}

/// A C string argument, or None for NULL.
///
/// # Safety
/// `p` is NULL or a NUL-terminated string valid for the call.
unsafe fn opt_str(p: *const c_char, name: &str) -> Result<Option<String>, String> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: the caller promises a NUL-terminated string (header contract).
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str()
        .map(|s| Some(s.to_owned()))
        .map_err(|_| format!("{name} is not UTF-8"))
}

/// # Safety
/// As [`opt_str`]; NULL is an error.
unsafe fn req_str(p: *const c_char, name: &str) -> Result<String, String> {
    // SAFETY: forwarded contract.
    unsafe { opt_str(p, name) }?.ok_or_else(|| format!("{name} is NULL"))
}

fn owned_c_string(s: String) -> Result<*mut c_char, String> {
    CString::new(s)
        .map(CString::into_raw)
        .map_err(|_| "result contains a NUL byte".to_string())
}

/// The reason for the last failure on this thread ("" if none). Valid until
/// the next libgms call on this thread.
#[no_mangle]
pub extern "C" fn gms_last_error() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

/// Connects this process to the GMS daemon of CUDA device `device`, or to
/// the host backend's daemon when `device` is negative.
///
/// # Safety
/// `socket_path` and `client` are NULL or NUL-terminated strings.
#[no_mangle]
pub unsafe extern "C" fn gms_connect(
    socket_path: *const c_char,
    mode: c_int,
    client: *const c_char,
    device: c_int,
    timeout_ms: c_int,
) -> c_int {
    guarded("gms_connect", -1, || {
        // SAFETY: header contract.
        let socket_path = unsafe { opt_str(socket_path, "socket_path") }?;
        // SAFETY: header contract.
        let name = unsafe { opt_str(client, "client") }?.unwrap_or_else(|| "libgms".into());
        let mode = match mode {
            0 => Mode::Rw,
            1 => Mode::Ro,
            2 => Mode::RwOrRo,
            other => return Err(format!("mode {other}: 0 (rw), 1 (ro) or 2 (rw_or_ro)")),
        };
        let mut guard = session();
        if guard.is_some() {
            return Err("already connected (gms_disconnect first)".into());
        }
        let dir = || {
            PathBuf::from(
                std::env::var("GMS_SOCKET_DIR").unwrap_or_else(|_| "/run/shadow/gms".to_string()),
            )
        };
        let timeout = Duration::from_millis(timeout_ms.max(0) as u64);
        if device < 0 {
            let mapper = HostWindow::new()?;
            let socket = socket_path
                .map(PathBuf::from)
                .unwrap_or_else(|| host_socket(&dir()));
            let client = Client::connect_with_wait(mapper.clone(), &socket, mode, &name, timeout)
                .map_err(|e| format!("{}: {e}", socket.display()))?;
            let lease = client.lease();
            *guard = Some(AnySession::Host(Session::new(client, mapper, -1, socket)));
            return Ok(lease_code(lease));
        }
        let selector = parse_device(&device.to_string()).map_err(|e| e.to_string())?;
        let mapper = CudaMapper::open(&selector).map_err(|e| e.to_string())?;
        let socket = socket_path
            .map(PathBuf::from)
            .unwrap_or_else(|| mapper.socket_in(&dir()));
        let client = connect_wait(mapper.clone(), &socket, mode, &name, timeout)
            .map_err(|e| format!("{}: {e}", socket.display()))?;
        let lease = client.lease();
        *guard = Some(AnySession::Cuda(Session::new(
            client, mapper, device, socket,
        )));
        Ok(lease_code(lease))
    })
}

impl<M: Mapper> Session<M>
where
    M::Range: 'static,
{
    fn new(client: Client<M>, mapper: M, ordinal: i32, socket: PathBuf) -> Self {
        Session {
            written: BTreeMap::new(),
            imported: None,
            kv: BTreeMap::new(),
            next_kv: 0,
            kv_pool: None,
            kv_pool_ahead: None,
            ordinal,
            socket,
            client,
            mapper,
        }
    }
}

fn lease_code(lease: LeaseKind) -> c_int {
    match lease {
        LeaseKind::Rw => 0,
        LeaseKind::Ro => 1,
    }
}

/// 0 = rw, 1 = ro, -1 = not connected.
#[no_mangle]
pub extern "C" fn gms_lease() -> c_int {
    guarded("gms_lease", -1, || {
        on_session!(session().as_ref(), |s| Ok(lease_code(s.client.lease())))
    })
}

/// Allocation granularity of the device in bytes; 0 if not connected.
#[no_mangle]
pub extern "C" fn gms_granularity() -> u64 {
    guarded("gms_granularity", 0, || match session().as_ref() {
        None => Err("not connected".into()),
        Some(AnySession::Cuda(s)) => Ok(s.mapper.granularity()),
        Some(AnySession::Host(s)) => Ok(s.client.welcome().granularity),
    })
}

fn allocate<M: Mapper>(s: &mut Session<M>, size: u64, tag: &str) -> Result<*mut c_void, String>
where
    M::Range: 'static,
{
    if s.client.lease() != LeaseKind::Rw {
        return Err("this process holds an ro lease: only the writer allocates".into());
    }
    let w = s.client.allocate(tag, size).map_err(|e| e.to_string())?;
    let addr = w.addr();
    s.written.insert(addr, w);
    Ok(addr as *mut c_void)
}

/// Writer: a new GMS allocation of at least `size` bytes, mapped read-write.
///
/// # Safety
/// `tag` is NULL (means "weights") or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn gms_allocate(size: u64, tag: *const c_char) -> *mut c_void {
    guarded("gms_allocate", std::ptr::null_mut(), || {
        // SAFETY: header contract.
        let tag = unsafe { opt_str(tag, "tag") }?.unwrap_or_else(|| "weights".into());
        with_session!(|s| allocate(s, size, &tag))
    })
}

fn free<M: Mapper>(s: &mut Session<M>, ptr: *mut c_void) -> Result<c_int, String>
where
    M::Range: 'static,
{
    let addr = ptr as u64;
    if s.client.welcome().committed {
        // Committed weights are immutable and outlive this engine.
        return Ok(1);
    }
    let w = s
        .written
        .remove(&addr)
        .ok_or_else(|| format!("{addr:#x} is not a GMS allocation of this process"))?;
    s.client.free(w).map_err(|e| e.to_string())?;
    Ok(0)
}

/// Writer: gives an uncommitted allocation back. 0 = freed, 1 = no-op
/// (layout committed), -1 = error.
#[no_mangle]
pub extern "C" fn gms_free(ptr: *mut c_void) -> c_int {
    guarded("gms_free", -1, || with_session!(|s| free(s, ptr)))
}

/// PyTorch `CUDAPluggableAllocator` malloc: one GMS allocation per call,
/// tagged "weights". NULL on failure (torch then reports out-of-memory).
#[no_mangle]
pub extern "C" fn gms_torch_malloc(
    size: isize,
    device: c_int,
    _stream: *mut c_void,
) -> *mut c_void {
    guarded("gms_torch_malloc", std::ptr::null_mut(), || {
        let size = u64::try_from(size)
            .ok()
            .filter(|s| *s > 0)
            .ok_or_else(|| format!("size {size}"))?;
        with_session!(|s| {
            if device != s.ordinal {
                return Err(format!(
                    "torch asked for device {device}, libgms is connected to device {}",
                    s.ordinal
                ));
            }
            allocate(s, size, "weights")
        })
    })
}

/// PyTorch `CUDAPluggableAllocator` free. Before commit the allocation is
/// returned to gmsd; after commit it is a no-op (the weights are shared).
#[no_mangle]
pub extern "C" fn gms_torch_free(
    ptr: *mut c_void,
    _size: isize,
    _device: c_int,
    _stream: *mut c_void,
) {
    guarded("gms_torch_free", (), || {
        with_session!(|s| free(s, ptr).map(|_| ()))
    })
}

/// Writer: stores a metadata entry (e.g. a tensor's allocation, offset,
/// shape, dtype as JSON). 0 or -1.
///
/// # Safety
/// `key` and `value` are NUL-terminated strings.
#[no_mangle]
pub unsafe extern "C" fn gms_put_meta(key: *const c_char, value: *const c_char) -> c_int {
    guarded("gms_put_meta", -1, || {
        // SAFETY: header contract.
        let key = unsafe { req_str(key, "key") }?;
        // SAFETY: header contract.
        let value = unsafe { req_str(value, "value") }?;
        with_session!(|s| s.client.put_meta(&key, &value).map_err(|e| e.to_string()))?;
        Ok(0)
    })
}

/// A metadata value: 1 and `*out` set (free with gms_string_free), 0 if the
/// key is absent, -1 on error.
///
/// # Safety
/// `key` is a NUL-terminated string; `out` a valid pointer.
#[no_mangle]
pub unsafe extern "C" fn gms_get_meta(key: *const c_char, out: *mut *mut c_char) -> c_int {
    guarded("gms_get_meta", -1, || {
        if out.is_null() {
            return Err("out is NULL".into());
        }
        // SAFETY: header contract.
        let key = unsafe { req_str(key, "key") }?;
        let value = with_session!(|s| s.client.get_meta(&key).map_err(|e| e.to_string()))?;
        match value {
            Some(v) => {
                let p = owned_c_string(v)?;
                // SAFETY: `out` is non-NULL and valid per the header.
                unsafe { *out = p };
                Ok(1)
            }
            None => Ok(0),
        }
    })
}

/// Writer: synchronises the device, freezes the layout (every allocation is
/// remapped read-only at the same address) and continues as a reader.
/// Returns the layout generation (> 0) or -1.
#[no_mangle]
pub extern "C" fn gms_commit() -> i64 {
    guarded("gms_commit", -1, || {
        with_session!(|s| {
            Backend::synchronize(&s.mapper)?;
            let mut weights: Vec<Weights<_>> =
                std::mem::take(&mut s.written).into_values().collect();
            let result = s.client.commit(&mut weights);
            s.written = weights.into_iter().map(|w| (w.addr(), w)).collect();
            let generation = result.map_err(|e| e.to_string())?;
            i64::try_from(generation).map_err(|_| format!("generation {generation}"))
        })
    })
}

/// Reader: maps the committed layout read-only at the writer's addresses.
/// Returns the number of allocations mapped, or -1.
#[no_mangle]
pub extern "C" fn gms_import() -> c_int {
    guarded("gms_import", -1, || {
        with_session!(|s| {
            if s.imported.is_some() {
                return Err("the layout is already imported".into());
            }
            let imported = s.client.import().map_err(|e| e.to_string())?;
            let n = imported.weights.len();
            s.imported = Some(imported);
            c_int::try_from(n).map_err(|_| format!("{n} allocations"))
        })
    })
}

/// The layout this lease sees (allocations with id, tag, size, va; and the
/// metadata) as JSON. Free with gms_string_free. NULL on error.
#[no_mangle]
pub extern "C" fn gms_layout_json() -> *mut c_char {
    guarded("gms_layout_json", std::ptr::null_mut(), || {
        let layout = with_session!(|s| s.client.layout().map_err(|e| e.to_string()))?;
        let text = serde_json::to_string(&layout).map_err(|e| e.to_string())?;
        owned_c_string(text)
    })
}

/// Frees a string returned by libgms. NULL is ignored.
///
/// # Safety
/// `s` is NULL or a pointer returned by libgms, not freed before.
#[no_mangle]
pub unsafe extern "C" fn gms_string_free(s: *mut c_char) {
    if !s.is_null() {
        // SAFETY: per the contract, `s` came from CString::into_raw here.
        drop(unsafe { CString::from_raw(s) });
    }
}

/// Reserves `bytes` (rounded up to the granularity) of addresses for a KV
/// cache, backed by nothing yet. Returns a handle >= 0 and stores the
/// address in `*addr`, or -1.
///
/// # Safety
/// `addr` is a valid pointer.
#[no_mangle]
pub unsafe extern "C" fn gms_kv_reserve(bytes: u64, addr: *mut u64) -> i64 {
    guarded("gms_kv_reserve", -1, || {
        if addr.is_null() {
            return Err("addr is NULL".into());
        }
        with_session!(|s| {
            let kv = s.client.reserve_kv(bytes).map_err(|e| e.to_string())?;
            // SAFETY: non-NULL and valid per the header.
            unsafe { *addr = kv.addr() };
            let id = s.next_kv;
            s.next_kv += 1;
            s.kv.insert(id, kv);
            Ok(id)
        })
    })
}

/// What a KV call does to a cache of either backend.
enum KvOp {
    Materialise,
    Release,
}

fn kv_apply<R: gms_core::mapper::Range + 'static>(
    cache: &mut KvCache<R>,
    op: &KvOp,
) -> gms_core::Result<()> {
    match op {
        KvOp::Materialise => cache.materialise(),
        KvOp::Release => cache.release(),
    }
}

fn kv_op(kv: i64, op: KvOp) -> Result<c_int, String> {
    with_session!(|s| {
        let cache =
            s.kv.get_mut(&kv)
                .ok_or_else(|| format!("no KV cache {kv}"))?;
        kv_apply(cache, &op).map_err(|e| e.to_string())?;
        Ok(0)
    })
}

/// Backs a reserved KV cache with fresh device pages (not zeroed). 0 or -1.
#[no_mangle]
pub extern "C" fn gms_kv_materialise(kv: i64) -> c_int {
    guarded("gms_kv_materialise", -1, || kv_op(kv, KvOp::Materialise))
}

/// The KV cache's watch, taken under the session lock and used without it:
/// waits must not hold every other call of the process back.
fn kv_watch(kv: i64) -> Result<KvWatch, String> {
    with_session!(|s| {
        s.kv.get(&kv)
            .map(|c| c.watch())
            .ok_or_else(|| format!("no KV cache {kv}"))
    })
}

fn to_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// Starts backing a reserved KV cache as memory allows, and returns once at
/// least `min_bytes` are backed (0: at once), waiting up to
/// GMS_KV_OOM_WAIT_MS for them; a thread of libgms backs the rest, in
/// order from the start, as the device's memory comes back. Returns the
/// bytes backed on return, or -1.
#[no_mangle]
pub extern "C" fn gms_kv_wake(kv: i64, min_bytes: u64) -> i64 {
    guarded("gms_kv_wake", -1, || {
        let (watch, wait) = with_session!(|s| {
            let cache =
                s.kv.get_mut(&kv)
                    .ok_or_else(|| format!("no KV cache {kv}"))?;
            cache.wake(0).map_err(|e| e.to_string())?;
            Ok((cache.watch(), cache.oom_wait()))
        })?;
        let backed = watch.wait_backed(min_bytes, wait);
        if backed < min_bytes {
            return Err(format!(
                "{backed} of the {min_bytes} bytes needed at once are backed after {} ms \
                 (GMS_KV_OOM_WAIT_MS): {}",
                wait.as_millis(),
                watch.info_json()
            ));
        }
        Ok(to_i64(backed))
    })
}

/// Bytes of the KV cache backed now, from its start; or -1.
#[no_mangle]
pub extern "C" fn gms_kv_backed(kv: i64) -> i64 {
    guarded("gms_kv_backed", -1, || Ok(to_i64(kv_watch(kv)?.backed())))
}

/// Waits (without holding libgms's lock) until at least `bytes` of the KV
/// cache are backed, it stops growing, or `timeout_ms` pass. Returns the
/// bytes backed then, or -1.
#[no_mangle]
pub extern "C" fn gms_kv_wait(kv: i64, bytes: u64, timeout_ms: u64) -> i64 {
    guarded("gms_kv_wait", -1, || {
        let watch = kv_watch(kv)?;
        Ok(to_i64(
            watch.wait_backed(bytes, Duration::from_millis(timeout_ms)),
        ))
    })
}

/// An eventfd, readable after each change of the KV cache's backing (read
/// 8 bytes to reset it). libgms owns it: valid until gms_disconnect, never
/// to be closed by the caller. -1 on error.
#[no_mangle]
pub extern "C" fn gms_kv_event_fd(kv: i64) -> c_int {
    guarded("gms_kv_event_fd", -1, || {
        with_session!(|s| {
            s.kv.get(&kv)
                .map(|c| c.watch().event_fd().as_raw_fd())
                .ok_or_else(|| format!("no KV cache {kv}"))
        })
    })
}

/// The KV cache's state as JSON: bytes, chunk, backed, growth (reserved,
/// growing, backed, stalled, failed), full_after_ms, waited_ms or error.
/// Free with gms_string_free; NULL on error.
#[no_mangle]
pub extern "C" fn gms_kv_info_json(kv: i64) -> *mut c_char {
    guarded("gms_kv_info_json", std::ptr::null_mut(), || {
        let json = kv_watch(kv)?.info_json();
        CString::new(json)
            .map(CString::into_raw)
            .map_err(|e| e.to_string())
    })
}

/// Gives a KV cache's pages back, keeping its addresses. 0 or -1.
#[no_mangle]
pub extern "C" fn gms_kv_release(kv: i64) -> c_int {
    guarded("gms_kv_release", -1, || kv_op(kv, KvOp::Release))
}

/// What `gms_kv_pool_open` fills in. The descriptors stay libgms's (valid
/// until `gms_kv_pool_close` or `gms_disconnect`): read the index with
/// `pread`/`pwrite`, poll the fence for readability, close neither.
#[repr(C)]
pub struct GmsKvPool {
    pub addr: u64,
    pub size: u64,
    pub pool: u64,
    pub index_bytes: u64,
    pub created: c_int,
    pub index_fd: c_int,
    pub fence_fd: c_int,
}

/// The write lease of the pair's KV pool, showing `proof_fd` (a
/// descriptor through which this engine holds the pair's election lock),
/// with the pool mapped read-write at its address (the one every engine
/// of the pair maps it at) and its index and fence described in `*out`.
/// `bytes` and `index_bytes` size a pool made now; an existing pool is
/// taken as it is. One per process. 0 or -1.
///
/// # Safety
/// `out` is a valid pointer.
#[no_mangle]
pub unsafe extern "C" fn gms_kv_pool_open(
    proof_fd: c_int,
    bytes: u64,
    index_bytes: u64,
    out: *mut GmsKvPool,
) -> c_int {
    // SAFETY: as the caller promised.
    unsafe {
        kv_pool_open(
            "gms_kv_pool_open",
            proof_fd,
            bytes,
            index_bytes,
            u64::MAX,
            out,
        )
    }
}

/// `gms_kv_pool_open`, mapping only the pool's allocations that hold its
/// first `first_bytes` (the first one at least) before it returns; a
/// thread of libgms maps the others, in order. Use the first
/// `gms_kv_pool_mapped()` bytes only, until they are all mapped. 0 or -1.
///
/// # Safety
/// `out` is a valid pointer.
#[no_mangle]
pub unsafe extern "C" fn gms_kv_pool_open_first(
    proof_fd: c_int,
    bytes: u64,
    index_bytes: u64,
    first_bytes: u64,
    out: *mut GmsKvPool,
) -> c_int {
    // SAFETY: as the caller promised.
    unsafe {
        kv_pool_open(
            "gms_kv_pool_open_first",
            proof_fd,
            bytes,
            index_bytes,
            first_bytes,
            out,
        )
    }
}

/// # Safety
/// `out` is NULL or valid.
unsafe fn kv_pool_open(
    what: &str,
    proof_fd: c_int,
    bytes: u64,
    index_bytes: u64,
    first_bytes: u64,
    out: *mut GmsKvPool,
) -> c_int {
    guarded(what, -1, || {
        if out.is_null() {
            return Err("out is NULL".into());
        }
        if proof_fd < 0 {
            return Err(format!("proof_fd {proof_fd} is no descriptor"));
        }
        // SAFETY: the caller lends a descriptor that stays open for the
        // call; it is only sent, never closed here.
        let proof = unsafe { std::os::fd::BorrowedFd::borrow_raw(proof_fd) };
        with_session!(|s| {
            if s.kv_pool.is_some() {
                return Err("this process holds the KV pool's lease already".into());
            }
            let gran = s.client.welcome().granularity;
            let asked = match s.kv_pool_ahead.take() {
                Some(range) => KvPool::ask_in(*range, &s.socket, proof, index_bytes),
                None => KvPool::ask(&s.mapper, &s.socket, proof, bytes, index_bytes, gran),
            };
            let pool = asked
                .and_then(|a| a.granted_first(&s.mapper, first_bytes))
                .map_err(|e| e.to_string())?;
            let desc = GmsKvPool {
                addr: pool.addr(),
                size: pool.len(),
                pool: pool.id(),
                index_bytes: pool.index_bytes(),
                created: c_int::from(pool.created()),
                index_fd: pool.index().as_raw_fd(),
                fence_fd: pool.fence().fd().as_raw_fd(),
            };
            // SAFETY: non-NULL and valid per the header.
            unsafe { out.write(desc) };
            s.kv_pool = Some(pool);
            Ok(0)
        })
    })
}

fn kv_pool_watch() -> Result<MapWatch, String> {
    with_session!(|s| {
        s.kv_pool
            .as_ref()
            .map(KvPool::map_watch)
            .ok_or_else(|| "this process holds no KV pool".to_string())
    })
}

/// Bytes of the KV pool mapped from its start (its size once all of it
/// is); -1 without a pool, or once mapping the rest failed (the mapped
/// part stays usable; `gms_last_error()` says why).
#[no_mangle]
pub extern "C" fn gms_kv_pool_mapped() -> i64 {
    guarded("gms_kv_pool_mapped", -1, || {
        let watch = kv_pool_watch()?;
        match watch.error() {
            Some(e) => Err(e),
            None => Ok(to_i64(watch.mapped())),
        }
    })
}

/// Bytes of the KV pool mapped before the grant returned (the rest is
/// the mapping thread's); -1 without a pool.
#[no_mangle]
pub extern "C" fn gms_kv_pool_mapped_at_grant() -> i64 {
    guarded("gms_kv_pool_mapped_at_grant", -1, || {
        with_session!(|s| {
            let pool = s.kv_pool.as_ref().ok_or("this process holds no KV pool")?;
            Ok(to_i64(pool.mapped_at_grant()))
        })
    })
}

/// Waits (without holding libgms's lock) until `bytes` of the KV pool are
/// mapped, mapping the rest failed, or `timeout_ms` pass; the bytes mapped
/// then, or -1.
#[no_mangle]
pub extern "C" fn gms_kv_pool_wait_mapped(bytes: u64, timeout_ms: u64) -> i64 {
    guarded("gms_kv_pool_wait_mapped", -1, || {
        let watch = kv_pool_watch()?;
        Ok(to_i64(
            watch.wait_mapped(bytes, Duration::from_millis(timeout_ms)),
        ))
    })
}

/// Reserves addresses for the pair's KV pool before this process holds
/// its lease (a parked engine): where the pool lives if gmsd has one,
/// else `bytes` wherever the device puts them, where a pool this process
/// is the first to be granted is made. Nothing is mapped there until
/// `gms_kv_pool_open`, which takes these addresses: work captured over
/// them now (a CUDA graph) runs on the pool once it is granted, if the
/// pool is there (`gms_kv_pool_open`'s `addr` says). A later call moves
/// the reservation to the pool's address once a pool exists, and keeps it
/// where it is otherwise. Each call also makes room in this process's
/// descriptor table for the grant's descriptors, so that receiving them
/// never waits for the table to grow (an RCU grace period, tens of
/// milliseconds). `*out_addr` gets the address; returns 1 when it
/// is the existing pool's, 0 when not (no pool yet, or its address was
/// taken here), -1 on error (the reservation is then dropped).
///
/// # Safety
/// `out_addr` is a valid pointer.
#[no_mangle]
pub unsafe extern "C" fn gms_kv_pool_reserve(bytes: u64, out_addr: *mut u64) -> c_int {
    guarded("gms_kv_pool_reserve", -1, || {
        if out_addr.is_null() {
            return Err("out_addr is NULL".into());
        }
        with_session!(|s| {
            if s.kv_pool.is_some() {
                return Err("this process holds the KV pool's lease already".into());
            }
            let gran = s.client.welcome().granularity;
            let current = s.kv_pool_ahead.take().map(|r| *r);
            let got = gms_core::kvpool::reserve_ahead(&s.mapper, &s.socket, bytes, gran, current)
                .map_err(|e| e.to_string())?;
            // SAFETY: non-NULL and valid per the header.
            unsafe { out_addr.write(got.range.addr()) };
            s.kv_pool_ahead = Some(Box::new(got.range));
            Ok(c_int::from(got.placed))
        })
    })
}

/// Where the KV pool's grant spent its time, in microseconds: gmsd's
/// answer (request sent → answer read) into `*answer_us`, the mapping
/// (import, map, access) into `*map_us`. 0, or -1 without a pool.
///
/// # Safety
/// `answer_us` and `map_us` are valid pointers.
#[no_mangle]
pub unsafe extern "C" fn gms_kv_pool_grant_us(answer_us: *mut u64, map_us: *mut u64) -> c_int {
    guarded("gms_kv_pool_grant_us", -1, || {
        if answer_us.is_null() || map_us.is_null() {
            return Err("answer_us or map_us is NULL".into());
        }
        with_session!(|s| {
            let t = s
                .kv_pool
                .as_ref()
                .ok_or("this process holds no KV pool")?
                .grant_times();
            let us = |d: Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
            // SAFETY: both non-NULL and valid per the header.
            unsafe {
                answer_us.write(us(t.answer));
                map_us.write(us(t.map));
            }
            Ok(0)
        })
    })
}

/// Gives the KV pool's write lease back (the pool stays gmsd's): the
/// device is synchronised, the pool unmapped, its descriptors closed.
/// 0 or -1.
#[no_mangle]
pub extern "C" fn gms_kv_pool_close() -> c_int {
    guarded("gms_kv_pool_close", -1, || {
        with_session!(|s| {
            Backend::synchronize(&s.mapper)?;
            s.kv_pool = None;
            Ok(0)
        })
    })
}

/// Unmaps (1) or remaps (0) every weight mapping of this process in place.
/// 0 or -1.
#[no_mangle]
pub extern "C" fn gms_weights_sleep(sleep: c_int) -> c_int {
    guarded("gms_weights_sleep", -1, || {
        with_session!(|s| {
            let imported = s.imported.iter_mut().flat_map(|i| i.weights.iter_mut());
            for w in s.written.values_mut().chain(imported) {
                let r = if sleep != 0 { w.sleep() } else { w.wake() };
                r.map_err(|e| e.to_string())?;
            }
            Ok(0)
        })
    })
}

/// Ends the lease: unmaps everything, closes the connection. A writer that
/// has not committed has its allocations discarded by gmsd.
#[no_mangle]
pub extern "C" fn gms_disconnect() {
    guarded("gms_disconnect", (), || {
        let mut guard = session();
        let _ = on_session!(guard.as_ref(), |s| Backend::synchronize(&s.mapper));
        *guard = None;
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn last_error() -> String {
        // SAFETY: gms_last_error returns a valid NUL-terminated string.
        unsafe { CStr::from_ptr(gms_last_error()) }
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn calls_without_a_session_fail_with_a_reason() {
        assert!(gms_torch_malloc(1 << 20, 0, std::ptr::null_mut()).is_null());
        assert!(last_error().contains("not connected"), "{}", last_error());
        assert_eq!(gms_commit(), -1);
        assert_eq!(gms_lease(), -1);
        gms_torch_free(std::ptr::null_mut(), 0, 0, std::ptr::null_mut());
        assert!(last_error().contains("gms_torch_free"));
    }

    #[test]
    fn bad_arguments_are_refused_before_the_driver_is_touched() {
        // SAFETY: NULL strings are allowed by the contract.
        let r = unsafe { gms_connect(std::ptr::null(), 9, std::ptr::null(), 0, 0) };
        assert_eq!(r, -1);
        assert!(last_error().contains("mode 9"), "{}", last_error());
        assert_eq!(
            // SAFETY: a NULL key is refused before either pointer is read.
            unsafe { gms_put_meta(std::ptr::null(), std::ptr::null()) },
            -1
        );
        assert!(last_error().contains("key is NULL"));
    }

    /// On a machine without a GPU, connecting names the missing driver.
    #[test]
    fn connect_without_a_gpu_is_an_error_not_a_crash() {
        let dir = CString::new("/nonexistent/gms.sock").unwrap();
        // SAFETY: valid strings.
        let r = unsafe { gms_connect(dir.as_ptr(), 2, std::ptr::null(), 0, 0) };
        assert_eq!(r, -1);
        let err = last_error();
        assert!(
            err.contains("CUDA") || err.contains("/nonexistent"),
            "{err}"
        );
    }
}
