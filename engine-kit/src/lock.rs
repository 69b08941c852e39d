//! The election lock held by a small process of the engine's
//! ([`Holder`]), so that the shadow wakes at the speed of the kill however
//! large the engine is.
//!
//! Why: the kernel drops a dead process's `flock` only when it closes the
//! process's files, and it closes them after it has freed the process's
//! memory, about 100 ms per GiB of resident memory. An engine of gigabytes
//! that holds `SHADOW_LOCK_PATH` itself frees it that much late.
//!
//! How: [`Holder::start`], first thing in `main`, forks a child (the
//! holder) while the process is still small and has one thread, and locks
//! a robust, process-shared mutex in a shared page from the main thread.
//! [`Holder::acquire`] asks the holder to take the flock and waits for its
//! answer, pinging the watchdog meanwhile. Holding the lock, the holder
//! waits on the mutex: when the engine's main thread dies, the kernel walks
//! its robust-futex list before it frees the engine's memory, marks the
//! mutex's owner dead and wakes the holder, which exits; its flock goes
//! with its few pages. `PR_SET_PDEATHSIG(SIGKILL)` guards the wait before
//! the lock (it fires only after the engine's memory is freed, too late to
//! be the release itself).
//!
//! Why a fork and not a spawn of a program: the engine's own binary may be
//! large, and no other program is sure to be in the image. The fork is
//! sound because [`Holder::start`] refuses unless the process has exactly
//! one thread (read from `/proc/self/task`): no lock of another thread can
//! be held in the child's copy of memory. The child still calls only what
//! needs no allocation (`prctl`, `getppid`, `close_range`, `read`, `open`,
//! `flock`, `write`, `pthread_mutex_lock`, `_exit`).
//!
//! The runtime finds the lock's holder in `/proc/locks` and maps its pid to
//! a slot by its cgroup: the holder, the engine's child in its container,
//! counts as the engine.
//!
//! The proof: with its answer the holder sends a copy of the descriptor it
//! holds the lock through (`SCM_RIGHTS`), which [`Holder::acquire`] returns
//! as a [`LockProof`]. gmsd grants the pair's KV pool to whoever shows it
//! (it reads the lock off its own copy's `/proc/self/fdinfo`, which needs
//! no capability). The engine must drop it as soon as it was shown: while
//! the engine's copy is open, the lock outlives the holder.

use std::ffi::CString;
use std::num::NonZeroUsize;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Instant;

use nix::errno::Errno;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::mman::{mmap_anonymous, munmap, MapFlags, ProtFlags};
use nix::sys::signal::{kill, Signal};
use nix::sys::socket::{socketpair, AddressFamily, SockFlag, SockType};
use nix::sys::wait::{waitpid, WaitStatus};
use nix::unistd::{fork, getpid, ForkResult, Pid};

use crate::watchdog::Pacer;

/// A copy of the descriptor through which the holder holds the lock, to
/// show gmsd (`gms::kvpool`). Drop it at once after: while it is open, a
/// kill of this engine releases the lock only once the engine's own
/// descriptors close (after its memory is freed), not with the holder.
#[derive(Debug)]
pub struct LockProof(Option<OwnedFd>);

impl LockProof {
    /// The descriptor, if the holder sent one (not on a second `acquire`).
    pub fn fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        self.0.as_ref().map(AsFd::as_fd)
    }
}

/// What went wrong holding the lock.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// `start` was called while the process had other threads.
    #[error(
        "lock holder: the process has {0} threads; the holder is forked, which is sound \
         only while there is one: call Holder::start first thing in main"
    )]
    Threads(usize),
    /// A call that sets the holder up failed.
    #[error("lock holder: {what}: {source}")]
    Setup { what: &'static str, source: Errno },
    /// The holder could not open or flock the lock file.
    #[error("lock holder: flock {}: {source}", path.display())]
    Flock { path: PathBuf, source: Errno },
    /// The holder died before it took the lock.
    #[error("lock holder of {}: died before taking the lock ({status})", path.display())]
    Died { path: PathBuf, status: String },
}

fn setup(what: &'static str) -> impl FnOnce(Errno) -> LockError {
    move |source| LockError::Setup { what, source }
}

/// The holder's exit statuses (for a person reading `ps` or a log).
const EXIT_PRCTL: i32 = 70;
const EXIT_ORPHANED: i32 = 71;
const EXIT_FLOCK: i32 = 72;

/// The engine's side of the holder; see the module. Not `Send`: the
/// mutex is the creating (main) thread's, which must stay the owner.
/// Dropping it lets the lock go (the holder is killed and reaped).
pub struct Holder {
    path: PathBuf,
    pid: Pid,
    link: OwnedFd,
    /// Kept for its drop: unlocked (were the holder alive, it would exit)
    /// and unmapped after the holder is reaped.
    _mutex: SharedMutex,
    asked: bool,
    state: Arc<Mutex<State>>,
    reaper: Option<JoinHandle<()>>,
}

/// Shared by the engine and the reaper thread.
#[derive(Default)]
struct State {
    held: bool,
    /// The holder exited (reaped); its status.
    gone: Option<String>,
    /// The engine lets go on purpose.
    releasing: bool,
}

impl Holder {
    /// The holder for `SHADOW_LOCK_PATH`, or None when it is unset (an
    /// engine running alone).
    pub fn from_env() -> Result<Option<Holder>, LockError> {
        match std::env::var_os(shadow_contract::env::LOCK_PATH) {
            Some(p) if !p.is_empty() => Holder::start(Path::new(&p)).map(Some),
            _ => Ok(None),
        }
    }

    /// Forks the holder for the lock at `path`; it takes nothing until
    /// [`Holder::acquire`]. Call it first thing in `main`, while the
    /// process is small and has one thread ([`LockError::Threads`]
    /// otherwise).
    pub fn start(path: &Path) -> Result<Holder, LockError> {
        let threads = std::fs::read_dir("/proc/self/task")
            .map_err(|e| LockError::Setup {
                what: "counting this process's threads in /proc/self/task",
                source: Errno::from_raw(e.raw_os_error().unwrap_or(0)),
            })?
            .count();
        if threads != 1 {
            return Err(LockError::Threads(threads));
        }
        let c_path = CString::new(path.as_os_str().as_bytes()).map_err(|_| LockError::Flock {
            path: path.to_owned(),
            source: Errno::EINVAL,
        })?;
        let mutex = SharedMutex::new_locked()?;
        let (ours, theirs) = socketpair(
            AddressFamily::Unix,
            SockType::Stream,
            None,
            SockFlag::SOCK_CLOEXEC,
        )
        .map_err(setup("socketpair"))?;
        let max_fd = max_fd();
        let engine = getpid();
        // SAFETY: the process has one thread (checked above, and nothing
        // here starts one), so the child's copy of memory holds no lock
        // of another thread; the child runs only `hold`, which allocates
        // nothing and ends in `_exit`.
        match unsafe { fork() }.map_err(setup("fork"))? {
            ForkResult::Child => hold(
                theirs.as_raw_fd(),
                max_fd,
                mutex.ptr.as_ptr(),
                &c_path,
                engine.as_raw(),
            ),
            ForkResult::Parent { child } => {
                drop(theirs);
                let state = Arc::new(Mutex::new(State::default()));
                let reaper = reap(child, path.to_owned(), Arc::clone(&state));
                Ok(Holder {
                    path: path.to_owned(),
                    pid: child,
                    link: ours,
                    _mutex: mutex,
                    asked: false,
                    state,
                    reaper: Some(reaper),
                })
            }
        }
    }

    /// The holder's pid.
    pub fn pid(&self) -> Pid {
        self.pid
    }

    /// Whether the holder holds the lock for this engine.
    pub fn is_held(&self) -> bool {
        lock(&self.state).held
    }

    /// Asks the holder to take the lock and blocks until it has it: the
    /// engine is then the active one. With a `pacer` (a watchdog) the wait
    /// times out when a ping is due and calls `ping` (`WATCHDOG=1`); the
    /// wait ends the moment the holder says it has the lock. Returns the
    /// [`LockProof`] the holder sent (drop it at once after use).
    pub fn acquire(
        &mut self,
        mut pacer: Option<&mut Pacer>,
        mut ping: impl FnMut(),
    ) -> Result<LockProof, LockError> {
        if self.is_held() {
            return Ok(LockProof(None));
        }
        let mut proof = None;
        if !self.asked {
            write_all(self.link.as_fd(), b"G").map_err(setup("asking the holder"))?;
            self.asked = true;
        }
        let mut said = [0u8; 8];
        let mut len = 0;
        loop {
            let timeout = match pacer.as_deref() {
                Some(p) => {
                    // Rounded up: a wait under a millisecond is not a spin.
                    let ms = p.wait(Instant::now()).as_micros().div_ceil(1000);
                    PollTimeout::try_from(ms.min(i32::MAX as u128) as i32)
                        .unwrap_or(PollTimeout::MAX)
                }
                None => PollTimeout::NONE,
            };
            let mut fds = [PollFd::new(self.link.as_fd(), PollFlags::POLLIN)];
            match poll(&mut fds, timeout) {
                Ok(0) => {
                    if let Some(p) = pacer.as_deref_mut() {
                        let now = Instant::now();
                        if p.due(now) {
                            p.pinged(now);
                            ping();
                        }
                    }
                    continue;
                }
                Ok(_) => {}
                Err(Errno::EINTR) => continue,
                Err(e) => return Err(setup("waiting for the holder")(e)),
            }
            let n = match read_answer(&self.link, &mut said[len..], &mut proof) {
                Ok(n) => n,
                Err(Errno::EINTR) => continue,
                Err(e) => return Err(setup("reading the holder's answer")(e)),
            };
            len += n;
            match (n, said[0]) {
                (0, _) => break,
                (_, b'L') => {
                    let mut st = lock(&self.state);
                    if st.gone.is_none() {
                        st.held = true;
                        return Ok(LockProof(proof));
                    }
                    break; // it died right after saying so
                }
                (_, b'E') if len >= 5 => {
                    let errno = i32::from_le_bytes([said[1], said[2], said[3], said[4]]);
                    return Err(LockError::Flock {
                        path: self.path.clone(),
                        source: Errno::from_raw(errno),
                    });
                }
                (_, b'E') => {}
                _ => break,
            }
        }
        // The holder is gone (or spoke nonsense): wait for its status.
        let _ = kill(self.pid, Signal::SIGKILL);
        if let Some(r) = self.reaper.take() {
            let _ = r.join();
        }
        let status = lock(&self.state)
            .gone
            .clone()
            .unwrap_or_else(|| "not reaped".into());
        Err(LockError::Died {
            path: self.path.clone(),
            status,
        })
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        lock(&self.state).releasing = true;
        if let Some(r) = self.reaper.take() {
            // Small: its flock goes at once.
            let _ = kill(self.pid, Signal::SIGKILL);
            let _ = r.join();
        }
    }
}

/// One read of the holder's answer, with the descriptor that may come
/// with it (kept in `fd`; any more are closed).
fn read_answer(link: &OwnedFd, buf: &mut [u8], fd: &mut Option<OwnedFd>) -> nix::Result<usize> {
    use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
    use std::os::fd::FromRawFd;
    let mut iov = [std::io::IoSliceMut::new(buf)];
    let mut space = nix::cmsg_space!([RawFd; 1]);
    let msg = recvmsg::<()>(
        link.as_raw_fd(),
        &mut iov,
        Some(&mut space),
        MsgFlags::MSG_CMSG_CLOEXEC,
    )?;
    let n = msg.bytes;
    for c in msg.cmsgs()? {
        if let ControlMessageOwned::ScmRights(fds) = c {
            for raw in fds {
                // SAFETY: the kernel just installed this descriptor in
                // this process for this message; nothing else owns it.
                let owned = unsafe { OwnedFd::from_raw_fd(raw) };
                if fd.is_none() {
                    *fd = Some(owned);
                }
            }
        }
    }
    Ok(n)
}

fn lock(state: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    state.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The one reaper of the holder. A holder gone while it held the lock,
/// unasked, has freed it: the shadow may be serving already, and this
/// engine must not go on serving beside it, so it ends.
fn reap(child: Pid, path: PathBuf, state: Arc<Mutex<State>>) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let status = loop {
            match waitpid(child, None) {
                Err(Errno::EINTR) => continue,
                Ok(WaitStatus::Exited(_, code)) => break format!("exit status {code}"),
                Ok(WaitStatus::Signaled(_, sig, _)) => break format!("killed by {sig}"),
                Ok(other) => break format!("{other:?}"),
                // Reaped by someone else: gone all the same.
                Err(e) => break format!("waitpid: {e}"),
            }
        };
        let mut st = lock(&state);
        let lost = st.held && !st.releasing;
        st.gone = Some(status.clone());
        drop(st);
        if lost {
            eprintln!(
                "lock holder of {} (pid {child}) died ({status}): the lock is lost, ending this engine",
                path.display()
            );
            let _ = kill(getpid(), Signal::SIGKILL);
        }
    })
}

/// The highest descriptor number the child may have open (for the
/// fallback where `close_range(2)` is missing).
fn max_fd() -> libc::c_uint {
    nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .map(|(soft, _)| soft.min(1 << 20) as libc::c_uint)
        .unwrap_or(1 << 16)
}

/// The holder, in the forked child: never returns.
fn hold(
    link: RawFd,
    max_fd: libc::c_uint,
    mutex: *mut libc::pthread_mutex_t,
    path: &CString,
    engine: libc::pid_t,
) -> ! {
    // SAFETY: each call below is a plain system call or, for
    // pthread_mutex_lock, a call on a mutex that lives in a shared mapping
    // for the life of this process; none allocates, and the child has one
    // thread. Buffers passed are locals that outlive the calls.
    unsafe {
        if libc::prctl(
            libc::PR_SET_PDEATHSIG,
            libc::SIGKILL as libc::c_ulong,
            0,
            0,
            0,
        ) != 0
        {
            libc::_exit(EXIT_PRCTL);
        }
        if libc::getppid() != engine {
            libc::_exit(EXIT_ORPHANED); // the engine died before the prctl
        }
        // Copies of the engine's descriptors (listening sockets,
        // connections) must not outlive the engine's own closes.
        let link_u = link as libc::c_uint;
        let below = (link_u > 0).then(|| (0, link_u - 1));
        for (first, last) in below.into_iter().chain([(link_u + 1, libc::c_uint::MAX)]) {
            if libc::syscall(libc::SYS_close_range, first, last, 0) != 0 {
                for fd in first..=last.min(max_fd) {
                    libc::close(fd as libc::c_int);
                }
            }
        }
        let mut go = 0u8;
        loop {
            let n = libc::read(link, (&mut go as *mut u8).cast(), 1);
            if n < 0 && *libc::__errno_location() == libc::EINTR {
                continue;
            }
            if n != 1 || go != b'G' {
                libc::_exit(0); // the engine died or let go before asking
            }
            break;
        }
        let fd = libc::open(
            path.as_ptr(),
            libc::O_RDONLY | libc::O_CREAT | libc::O_CLOEXEC,
            0o644 as libc::c_uint,
        );
        let mut taken = fd >= 0;
        while taken && libc::flock(fd, libc::LOCK_EX) != 0 {
            taken = *libc::__errno_location() == libc::EINTR;
        }
        if !taken {
            let e = (*libc::__errno_location()).to_le_bytes();
            let msg = [b'E', e[0], e[1], e[2], e[3]];
            libc::write(link, msg.as_ptr().cast(), msg.len());
            libc::_exit(EXIT_FLOCK);
        }
        // "L", with a copy of the locked descriptor: the engine's proof.
        // The message and its control buffer are locals (no allocation).
        let said = b'L';
        let mut iov = libc::iovec {
            iov_base: (&said as *const u8).cast_mut().cast(),
            iov_len: 1,
        };
        let mut control = [0u64; 4];
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = libc::CMSG_SPACE(4) as _;
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        if cmsg.is_null() {
            libc::write(link, b"L".as_ptr().cast(), 1);
        } else {
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(4) as _;
            std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<libc::c_int>(), fd);
            if libc::sendmsg(link, &msg, libc::MSG_NOSIGNAL) != 1 {
                libc::write(link, b"L".as_ptr().cast(), 1);
            }
        }
        // Returns when the engine's main thread dies (EOWNERDEAD) or, at
        // the engine's release, never (the holder is killed): either way
        // this exit drops the flock.
        libc::pthread_mutex_lock(mutex);
        libc::_exit(0)
    }
}

/// A robust, process-shared mutex in an anonymous shared page, locked by
/// the thread that made it; unlocked and unmapped on drop (by that thread:
/// `Holder` is not `Send`).
struct SharedMutex {
    ptr: NonNull<libc::pthread_mutex_t>,
}

impl SharedMutex {
    fn new_locked() -> Result<SharedMutex, LockError> {
        let page = NonZeroUsize::new(4096).ok_or(LockError::Setup {
            what: "page size",
            source: Errno::EINVAL,
        })?;
        // SAFETY: a fresh anonymous mapping, no existing memory is touched.
        let mem = unsafe {
            mmap_anonymous(
                None,
                page,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED,
            )
        }
        .map_err(setup("mmap of the shared mutex"))?;
        let m = SharedMutex { ptr: mem.cast() };
        let check = |what, rc: libc::c_int| match rc {
            0 => Ok(()),
            e => Err(LockError::Setup {
                what,
                source: Errno::from_raw(e),
            }),
        };
        // SAFETY: `attr` is a local initialised by pthread_mutexattr_init
        // before use; the mutex lies in the page just mapped (4096 bytes,
        // page-aligned, more than a pthread_mutex_t), which lives until
        // `m` drops.
        unsafe {
            let mut attr = std::mem::MaybeUninit::<libc::pthread_mutexattr_t>::uninit();
            check(
                "pthread_mutexattr_init",
                libc::pthread_mutexattr_init(attr.as_mut_ptr()),
            )?;
            let mut attr = attr.assume_init();
            let set = check(
                "pthread_mutexattr_setpshared",
                libc::pthread_mutexattr_setpshared(&mut attr, libc::PTHREAD_PROCESS_SHARED),
            )
            .and_then(|()| {
                check(
                    "pthread_mutexattr_setrobust",
                    libc::pthread_mutexattr_setrobust(&mut attr, libc::PTHREAD_MUTEX_ROBUST),
                )
            })
            .and_then(|()| {
                check(
                    "pthread_mutex_init",
                    libc::pthread_mutex_init(m.ptr.as_ptr(), &attr),
                )
            });
            libc::pthread_mutexattr_destroy(&mut attr);
            set?;
            check(
                "pthread_mutex_lock",
                libc::pthread_mutex_lock(m.ptr.as_ptr()),
            )?;
        }
        Ok(m)
    }
}

impl Drop for SharedMutex {
    fn drop(&mut self) {
        // SAFETY: the mapping is this struct's alone (the child's copy is
        // its own); unlocking a mutex this thread does not own only fails
        // (EPERM), and nothing uses the pointer after the unmap.
        unsafe {
            libc::pthread_mutex_unlock(self.ptr.as_ptr());
            let _ = munmap(self.ptr.cast(), 4096);
        }
    }
}

fn write_all(fd: std::os::fd::BorrowedFd<'_>, mut buf: &[u8]) -> Result<(), Errno> {
    while !buf.is_empty() {
        match nix::unistd::write(fd, buf) {
            Ok(n) => buf = &buf[n..],
            Err(Errno::EINTR) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
