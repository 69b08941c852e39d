//! Reading the pair's notify socket without letting a sender block or
//! grow the shim:
//!
//! - **File descriptors.** A datagram may carry fds (`SCM_RIGHTS`). Where the
//!   kernel allows it (Linux >= 6.16, `SO_PASSRIGHTS` off) such a datagram
//!   is refused at the sender. Elsewhere every fd is received (room for the
//!   kernel's maximum, `MSG_CMSG_CLOEXEC`) and handed to one closer thread:
//!   the last close of a socket with `SO_LINGER` can block for as long as
//!   the sender set, and must never do so on the runtime. Had the fds not
//!   fit, the kernel would close the rest on the receiving thread itself.
//!   Fds waiting for the closer are bounded: while the closer is behind, the
//!   socket is not read (the kernel queue pushes back on senders).
//! - **Size, truncation, credentials.** A datagram larger than
//!   [`MAX_DATAGRAM`], one whose control data was truncated, one with fds
//!   and one without credentials are dropped whole, never half read.
//!
//! What may change here: how the kernel is read. What reaches the
//! supervisor is the gate's (`gate.rs`).

use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::sync::{Arc, OnceLock};

use nix::sys::socket::{recvmsg, setsockopt, sockopt, ControlMessageOwned, MsgFlags};
use shadow_pair::MAX_DATAGRAM;
use tokio::io::Interest;
use tokio::net::UnixDatagram;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::error::{Error, Result};

/// The most fds one datagram can carry (the kernel's `SCM_MAX_FD`).
const SCM_MAX_FD: usize = 253;
/// Received fds waiting for the closer thread, at most (all pairs of the
/// shim together). Past it the socket is not read until the closer catches up.
const CLOSER_BACKLOG: usize = 1024;
/// One datagram and who sent it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Datagram {
    pub pid: u32,
    pub bytes: Vec<u8>,
    /// What its lines are, counted once as it is read.
    pub lines: Lines,
}

impl Datagram {
    pub fn new(pid: u32, bytes: Vec<u8>) -> Datagram {
        let lines = Lines::of(&bytes);
        Datagram { pid, bytes, lines }
    }
}

/// What a datagram's lines are, found in one pass over its bytes without
/// parsing them: every datagram read is looked at this way (a flood's
/// too, before it is refused), so it is the one scan a datagram costs
/// the reader; the supervisor parses only what the gate lets through.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Lines {
    /// `WATCHDOG=1` lines.
    pub pings: u32,
    /// Other lines with a `=`: what the supervisor may act on.
    pub others: u32,
    /// A line `FDSTORE=1` (sd_notify(3)): its fds are for the store.
    pub store: bool,
    /// A line `FDSTOREREMOVE=1`: it asks the store to drop descriptors.
    pub remove: bool,
    /// A line `READY=1`.
    pub ready: bool,
}

impl Lines {
    pub fn of(bytes: &[u8]) -> Lines {
        let mut lines = Lines::default();
        for line in bytes.split(|b| *b == b'\n') {
            match line {
                b"WATCHDOG=1" => lines.pings += 1,
                b"FDSTORE=1" => {
                    lines.store = true;
                    lines.others += 1;
                }
                b"FDSTOREREMOVE=1" => {
                    lines.remove = true;
                    lines.others += 1;
                }
                b"READY=1" => {
                    lines.ready = true;
                    lines.others += 1;
                }
                _ if line.contains(&b'=') => lines.others += 1,
                _ => {}
            }
        }
        lines
    }
}

/// Why a datagram did not reach the supervisor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dropped {
    /// No `SCM_CREDENTIALS` (or pid 0): nobody to attribute it to.
    NoCredentials,
    /// Longer than [`MAX_DATAGRAM`].
    Oversized,
    /// The control data did not fit (`MSG_CTRUNC`).
    Truncated,
    /// It carried file descriptors (closed off the runtime thread).
    Fds,
    /// From a pid in neither engine's cgroup.
    NotAnEngine,
    /// The same text as a datagram of the same sender still waiting.
    Coalesced,
    /// Its engine's token bucket was empty.
    RateLimited,
    /// [`QUEUE_MAX`] inputs were already waiting.
    QueueFull,
    /// `FDSTORE=1` whose descriptors the fd store kept none of (full,
    /// wrong types, a bad name; the store counts each descriptor).
    StoreRefused,
}

impl Dropped {
    pub(super) const ALL: [Dropped; 9] = [
        Dropped::NoCredentials,
        Dropped::Oversized,
        Dropped::Truncated,
        Dropped::Fds,
        Dropped::NotAnEngine,
        Dropped::Coalesced,
        Dropped::RateLimited,
        Dropped::QueueFull,
        Dropped::StoreRefused,
    ];

    /// The `reason` label of `shadow_notify_dropped_total`.
    pub fn label(self) -> &'static str {
        match self {
            Dropped::NoCredentials => "no_credentials",
            Dropped::Oversized => "oversized",
            Dropped::Truncated => "truncated",
            Dropped::Fds => "fds",
            Dropped::NotAnEngine => "not_an_engine",
            Dropped::Coalesced => "coalesced",
            Dropped::RateLimited => "rate_limited",
            Dropped::QueueFull => "queue_full",
            Dropped::StoreRefused => "fdstore_refused",
        }
    }

    pub(super) fn name(self) -> &'static str {
        match self {
            Dropped::NoCredentials => "no credentials",
            Dropped::Oversized => "oversized",
            Dropped::Truncated => "control data truncated",
            Dropped::Fds => "carried fds",
            Dropped::NotAnEngine => "not an engine",
            Dropped::Coalesced => "coalesced",
            Dropped::RateLimited => "rate limited",
            Dropped::QueueFull => "queue full",
            Dropped::StoreRefused => "fd store refused",
        }
    }
}

/// What one read of the socket gave.
#[derive(Debug)]
pub enum Received {
    Datagram(Datagram),
    /// `FDSTORE=1` with descriptors, on a socket that accepts them: for
    /// the pair's fd store (`crate::pair::fdstore`), which decides.
    Store(Datagram, Vec<OwnedFd>),
    Dropped(Dropped),
}

pub struct NotifySocket {
    sock: UnixDatagram,
    /// A datagram was read and its reader has not come back for the next:
    /// it may not have been acted on yet (see [`NotifySocket::has_unread`]).
    in_hand: std::sync::atomic::AtomicBool,
}

impl NotifySocket {
    /// Bind at `path` (replacing a stale file), world-writable so that
    /// engines running as any user can notify. `fds`: descriptors may be
    /// sent (the pair has an fd store); else the kernel refuses them at
    /// the sender where it can.
    pub fn bind(path: &Path, fds: bool) -> Result<Self> {
        let _ = std::fs::remove_file(path);
        let sock = UnixDatagram::bind(path)
            .map_err(|e| Error::io(format!("binding notify socket {}", path.display()), e))?;
        setsockopt(&sock, sockopt::PassCred, &true).map_err(|e| {
            Error::sys(
                format!(
                    "SO_PASSCRED on notify socket {} (fd {})",
                    path.display(),
                    sock.as_raw_fd()
                ),
                e,
            )
        })?;
        if !fds {
            refuse_rights(&sock, path);
        }
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))
            .map_err(|e| Error::io(format!("chmod notify socket {}", path.display()), e))?;
        Ok(NotifySocket {
            sock,
            in_hand: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Read the next datagram: one the supervisor may look at, or why it
    /// was dropped. Waits (without reading) while the closer is behind.
    pub async fn recv(&self) -> Result<Received> {
        use std::sync::atomic::Ordering;
        // Back for the next: the one before has been acted on.
        self.in_hand.store(false, Ordering::Release);
        let got = self
            .sock
            .async_io(Interest::READABLE, || recv_raw(self.sock.as_raw_fd()))
            .await
            .map_err(|e| Error::io("reading the notify socket", e))?;
        // In the same poll as the read: nothing runs in between.
        self.in_hand.store(true, Ordering::Release);
        let dropped = if got.truncated {
            Some(Dropped::Truncated)
        } else if got.len > MAX_DATAGRAM {
            Some(Dropped::Oversized)
        } else if got.pid.is_none_or(|p| p <= 0) {
            Some(Dropped::NoCredentials)
        } else {
            None
        };
        let d = match dropped {
            None => Datagram::new(got.pid.unwrap_or_default() as u32, got.bytes),
            Some(why) => {
                discard(got.fds).await;
                return Ok(Received::Dropped(why));
            }
        };
        match (got.fds.is_empty(), d.lines.store) {
            (true, _) => Ok(Received::Datagram(d)),
            (false, true) => Ok(Received::Store(d, got.fds)),
            (false, false) => {
                discard(got.fds).await;
                Ok(Received::Dropped(Dropped::Fds))
            }
        }
    }

    /// Whether a datagram waits unread, or was read and may not have been
    /// acted on yet (its reader has not come back for the next): the fd
    /// store's fetch waits until neither, so that what was stored before
    /// it is in its answer. Never blocks.
    pub fn has_unread(&self) -> bool {
        if self.in_hand.load(std::sync::atomic::Ordering::Acquire) {
            return true;
        }
        let mut fds = [nix::poll::PollFd::new(
            self.sock.as_fd(),
            nix::poll::PollFlags::POLLIN,
        )];
        nix::poll::poll(&mut fds, nix::poll::PollTimeout::ZERO).is_ok_and(|n| n > 0)
    }
}

/// `SO_PASSRIGHTS` off (Linux >= 6.16): a sender passing fds gets `EPERM`
/// and nothing reaches us. Older kernels do not know it; the closer thread
/// covers them.
fn refuse_rights(sock: &UnixDatagram, path: &Path) {
    // asm-generic's value; the architectures with their own socket.h
    // numbering (mips, parisc, sparc, alpha) are left to the closer.
    #[cfg(any(
        target_arch = "x86_64",
        target_arch = "aarch64",
        target_arch = "riscv64"
    ))]
    {
        const SO_PASSRIGHTS: libc::c_int = 83;
        let off: libc::c_int = 0;
        // SAFETY: a valid socket fd, a c_int option value of the right size.
        let rc = unsafe {
            libc::setsockopt(
                sock.as_raw_fd(),
                libc::SOL_SOCKET,
                SO_PASSRIGHTS,
                (&off as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            log::debug!(
                "notify socket {}: SO_PASSRIGHTS not available ({}); passed fds are closed off the runtime",
                path.display(),
                io::Error::last_os_error()
            );
        }
    }
    #[cfg(not(any(
        target_arch = "x86_64",
        target_arch = "aarch64",
        target_arch = "riscv64"
    )))]
    let _ = (sock, path);
}

/// One datagram as the kernel gave it.
struct Raw {
    /// Its full length (`MSG_TRUNC`), even where longer than the buffer.
    len: usize,
    bytes: Vec<u8>,
    pid: Option<i32>,
    fds: Vec<OwnedFd>,
    truncated: bool,
}

/// The control buffer: room for the credentials and for `SCM_MAX_FD` fds,
/// the most one datagram can carry, so that the kernel never truncates the
/// control data (and closes fds on this thread).
fn control_buffer() -> Vec<u8> {
    nix::cmsg_space!(libc::ucred, [RawFd; SCM_MAX_FD])
}

/// `recvmsg` with room for the credentials and for every fd a datagram can
/// carry; each fd received is owned (close-on-exec) from here on.
fn recv_raw(fd: RawFd) -> io::Result<Raw> {
    let mut buf = [0u8; MAX_DATAGRAM];
    let mut control = control_buffer();
    let mut pid = None;
    let mut fds = Vec::new();
    let (len, truncated) = {
        let mut iov = [io::IoSliceMut::new(&mut buf)];
        let msg = recvmsg::<()>(
            fd,
            &mut iov,
            Some(&mut control),
            MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_TRUNC | MsgFlags::MSG_CMSG_CLOEXEC,
        )
        .map_err(io::Error::from)?;
        let truncated = msg.flags.contains(MsgFlags::MSG_CTRUNC);
        match msg.cmsgs() {
            Ok(cmsgs) => {
                for c in cmsgs {
                    match c {
                        ControlMessageOwned::ScmRights(raw) => {
                            fds.extend(raw.into_iter().filter(|f| *f >= 0).map(|f| {
                                // SAFETY: recvmsg just installed this fd in
                                // our table for us; nothing else knows it,
                                // so this is its one owner.
                                unsafe { OwnedFd::from_raw_fd(f) }
                            }))
                        }
                        ControlMessageOwned::ScmCredentials(cred) => pid = Some(cred.pid()),
                        _ => {}
                    }
                }
            }
            // Only with MSG_CTRUNC, which the buffer's size rules out (a
            // test checks it): nix then cannot walk the control data.
            Err(e) => log::error!("notify socket: control data unreadable: {e}"),
        }
        (msg.bytes, truncated)
    };
    Ok(Raw {
        len,
        bytes: buf[..len.min(MAX_DATAGRAM)].to_vec(),
        pid,
        fds,
        truncated,
    })
}

/// How a descriptor is closed on the closer thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Close {
    /// Sent unasked: a socket is reset (linger 0), never waited on.
    Abort,
    /// The shim's copy of a descriptor an engine shares (the fd store's):
    /// a plain close, so that what an engine wrote still goes out if this
    /// was the last copy. It may block (an engine's `SO_LINGER`): only the
    /// closer thread ever waits on it.
    Release,
}

type Batch = (Vec<OwnedFd>, Close, OwnedSemaphorePermit);

/// The thread that closes fds engines passed, and the bound on how many
/// may wait for it.
struct Closer {
    tx: std::sync::mpsc::Sender<Batch>,
    room: Arc<Semaphore>,
}

fn closer() -> Option<&'static Closer> {
    static CLOSER: OnceLock<Option<Closer>> = OnceLock::new();
    CLOSER
        .get_or_init(|| {
            let (tx, rx) = std::sync::mpsc::channel::<Batch>();
            let spawned = std::thread::Builder::new()
                .name("notify-fd-closer".into())
                .spawn(move || {
                    for (fds, how, permit) in rx {
                        for fd in fds {
                            close(fd, how);
                        }
                        drop(permit);
                    }
                });
            match spawned {
                Ok(_) => Some(Closer {
                    tx,
                    room: Arc::new(Semaphore::new(CLOSER_BACKLOG)),
                }),
                Err(e) => {
                    log::error!("starting the notify fd closer thread: {e}");
                    None
                }
            }
        })
        .as_ref()
}

fn close(fd: OwnedFd, how: Close) {
    match how {
        Close::Abort => close_quickly(fd),
        Close::Release => drop(fd),
    }
}

/// Close fds an engine passed us unasked, off the runtime thread. Waits
/// (the socket unread) while [`CLOSER_BACKLOG`] fds already wait.
pub async fn discard(fds: Vec<OwnedFd>) {
    close_off_runtime(fds, Close::Abort).await
}

/// Close fds off the runtime thread, as `how` says; waits while
/// [`CLOSER_BACKLOG`] fds already wait (the caller, a reader, then reads
/// nothing: the kernel's queue pushes back on the sender).
pub async fn close_off_runtime(fds: Vec<OwnedFd>, how: Close) {
    if fds.is_empty() {
        return;
    }
    let Some(c) = closer() else {
        // No thread: the least blocking close we can do, here.
        fds.into_iter().for_each(close_quickly);
        return;
    };
    let n = fds.len().min(CLOSER_BACKLOG) as u32;
    let Ok(permit) = c.room.clone().acquire_many_owned(n).await else {
        fds.into_iter().for_each(close_quickly);
        return;
    };
    if let Err(back) = c.tx.send((fds, how, permit)) {
        let (fds, _, _permit) = back.0;
        fds.into_iter().for_each(close_quickly);
    }
}

/// [`Close::Release`] without waiting for room: for what a pair's fd
/// store holds when the pair ends (bounded by the store's own size).
pub fn release_now(fds: Vec<OwnedFd>) {
    if fds.is_empty() {
        return;
    }
    let Some(c) = closer() else {
        drop(fds);
        return;
    };
    // Outside the backlog's count: a permit of nothing.
    let Ok(permit) = Arc::new(Semaphore::new(0)).try_acquire_many_owned(0) else {
        drop(fds);
        return;
    };
    if let Err(back) = c.tx.send((fds, Close::Release, permit)) {
        drop(back.0 .0);
    }
}

/// Close `fd`; a socket is first told to linger for 0 s, so that its last
/// close resets the connection instead of waiting for unsent data.
fn close_quickly(fd: OwnedFd) {
    let is_socket = nix::sys::stat::fstat(&fd)
        .map(|st| st.st_mode & libc::S_IFMT == libc::S_IFSOCK)
        .unwrap_or(false);
    if is_socket {
        let abort = libc::linger {
            l_onoff: 1,
            l_linger: 0,
        };
        // Not every socket lingers (EOPNOTSUPP and the like): fine.
        let _ = setsockopt(&fd, sockopt::Linger, &abort);
    }
    drop(fd);
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;

    #[tokio::test]
    async fn sender_pid_comes_from_the_kernel() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("notify.sock");
        let s = NotifySocket::bind(&p, false).unwrap();
        // A real other process sends, as an engine would.
        let status = std::process::Command::new("python3")
            .args([
                "-c",
                "import socket,sys; s=socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); s.sendto(b'READY=1', sys.argv[1])",
            ])
            .arg(&p)
            .spawn();
        let Ok(mut child) = status else {
            // No python3: send from this process instead.
            let c = std::os::unix::net::UnixDatagram::unbound().unwrap();
            c.send_to(b"READY=1", &p).unwrap();
            let Received::Datagram(d) = s.recv().await.unwrap() else {
                panic!("dropped");
            };
            assert_eq!(d.pid, std::process::id());
            assert_eq!(d.bytes, b"READY=1");
            return;
        };
        let pid = child.id();
        let got = s.recv().await.unwrap();
        assert!(child.wait().unwrap().success());
        let Received::Datagram(d) = got else {
            panic!("dropped: {got:?}");
        };
        assert_eq!(d.pid, pid);
        assert_eq!(d.bytes, b"READY=1");
    }

    /// On a socket of a pair with an fd store, `FDSTORE=1` keeps its fds
    /// for the store; fds with any other text are still dropped; without
    /// a store every fd is.
    #[tokio::test]
    async fn fds_reach_the_store_only_with_fdstore_1() {
        let d = tempfile::tempdir().unwrap();
        let send = |p: &Path, text: &[u8]| {
            let f = std::fs::File::open("/dev/null").unwrap();
            let c = std::os::unix::net::UnixDatagram::unbound().unwrap();
            let raw = [f.as_raw_fd()];
            nix::sys::socket::sendmsg(
                c.as_raw_fd(),
                &[io::IoSlice::new(text)],
                &[nix::sys::socket::ControlMessage::ScmRights(&raw)],
                MsgFlags::empty(),
                Some(&nix::sys::socket::UnixAddr::new(p).unwrap()),
            )
        };
        let p = d.path().join("with.sock");
        let s = NotifySocket::bind(&p, true).unwrap();
        send(&p, b"FDSTORE=1\nFDNAME=conn-1\n").unwrap();
        send(&p, b"STATUS=parked").unwrap();
        match s.recv().await.unwrap() {
            Received::Store(d, fds) => {
                assert_eq!(d.pid, std::process::id());
                assert_eq!(fds.len(), 1);
                assert!(d.lines.store);
            }
            other => panic!("not for the store: {other:?}"),
        }
        assert!(matches!(
            s.recv().await.unwrap(),
            Received::Dropped(Dropped::Fds)
        ));
        let p = d.path().join("without.sock");
        let s = NotifySocket::bind(&p, false).unwrap();
        // Refused at the sender where the kernel can, else dropped here.
        if send(&p, b"FDSTORE=1\n").is_ok() {
            assert!(matches!(
                s.recv().await.unwrap(),
                Received::Dropped(Dropped::Fds) | Received::Store(..)
            ));
        }
    }

    #[tokio::test]
    async fn oversized_datagrams_are_dropped_whole() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("notify.sock");
        let s = NotifySocket::bind(&p, false).unwrap();
        let c = std::os::unix::net::UnixDatagram::unbound().unwrap();
        let mut big = b"READY=1\n".to_vec();
        big.resize(MAX_DATAGRAM + 1, b'x');
        c.send_to(&big, &p).unwrap();
        c.send_to(b"STATUS=parked", &p).unwrap();
        assert!(matches!(
            s.recv().await.unwrap(),
            Received::Dropped(Dropped::Oversized)
        ));
        assert!(
            matches!(s.recv().await.unwrap(), Received::Datagram(d) if d.bytes == b"STATUS=parked")
        );
    }

    /// A TCP socket whose last close blocks for `linger` seconds: its peer
    /// never reads, its send buffer is full. Returns it and the peer.
    fn lingering_socket(linger: i32) -> (std::net::TcpStream, std::net::TcpStream) {
        use std::io::Write;
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let s = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (peer, _) = l.accept().unwrap();
        s.set_nonblocking(true).unwrap();
        let chunk = [0u8; 65536];
        while s.try_clone().unwrap().write(&chunk).is_ok() {}
        setsockopt(
            &s,
            sockopt::Linger,
            &libc::linger {
                l_onoff: 1,
                l_linger: linger,
            },
        )
        .unwrap();
        s.set_nonblocking(false).unwrap();
        (s, peer)
    }

    #[tokio::test]
    async fn passed_fds_are_closed_off_the_runtime_without_blocking() {
        use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags, UnixAddr};
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("notify.sock");
        // Bound without SO_PASSRIGHTS off, as on a kernel without it.
        let sock = UnixDatagram::bind(&p).unwrap();
        setsockopt(&sock, sockopt::PassCred, &true).unwrap();
        let s = NotifySocket {
            sock,
            in_hand: std::sync::atomic::AtomicBool::new(false),
        };
        let (tcp, _peer) = lingering_socket(30);
        let c = std::os::unix::net::UnixDatagram::unbound().unwrap();
        let fds = [tcp.as_raw_fd()];
        let iov = [std::io::IoSlice::new(b"READY=1")];
        sendmsg(
            c.as_raw_fd(),
            &iov,
            &[ControlMessage::ScmRights(&fds)],
            MsgFlags::empty(),
            Some(&UnixAddr::new(&p).unwrap()),
        )
        .unwrap();
        drop(tcp);
        c.send_to(b"STATUS=parked", &p).unwrap();
        let started = Instant::now();
        let first = s.recv().await.unwrap();
        let second = s.recv().await.unwrap();
        // Closing the socket here would take 30 s (its linger).
        assert!(started.elapsed() < Duration::from_secs(10));
        assert!(
            matches!(first, Received::Dropped(Dropped::Fds)),
            "{first:?}"
        );
        assert!(matches!(second, Received::Datagram(d) if d.bytes == b"STATUS=parked"));
    }

    #[test]
    fn the_control_buffer_holds_credentials_and_every_fd() {
        use nix::sys::socket::{
            sendmsg, socketpair, AddressFamily, ControlMessage, SockFlag, SockType,
        };
        let (rx, tx) = socketpair(
            AddressFamily::Unix,
            SockType::Datagram,
            None,
            SockFlag::SOCK_CLOEXEC,
        )
        .unwrap();
        setsockopt(&rx, sockopt::PassCred, &true).unwrap();
        // The most a sender can pass: SCM_MAX_FD fds, and its credentials.
        let devnull = std::fs::File::open("/dev/null").unwrap();
        let fds = vec![devnull.as_raw_fd(); SCM_MAX_FD];
        let iov = [io::IoSlice::new(b"READY=1")];
        sendmsg::<()>(
            tx.as_raw_fd(),
            &iov,
            &[ControlMessage::ScmRights(&fds)],
            MsgFlags::empty(),
            None,
        )
        .unwrap();
        let raw = recv_raw(rx.as_raw_fd()).unwrap();
        assert!(!raw.truncated);
        assert_eq!(
            raw.fds.len(),
            SCM_MAX_FD,
            "every fd received, none closed by the kernel"
        );
        assert_eq!(raw.pid, Some(std::process::id() as i32));
        assert_eq!((raw.len, raw.bytes.as_slice()), (7, b"READY=1".as_slice()));
        // One more fd than the kernel carries is refused at the sender.
        let too_many = vec![devnull.as_raw_fd(); SCM_MAX_FD + 1];
        assert!(sendmsg::<()>(
            tx.as_raw_fd(),
            &iov,
            &[ControlMessage::ScmRights(&too_many)],
            MsgFlags::empty(),
            None,
        )
        .is_err());
        assert!(control_buffer().len() >= nix::sys::socket::cmsg_space::<libc::ucred>());
    }
}
