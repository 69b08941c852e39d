//! The pair's sd_notify socket: one `SOCK_DGRAM` Unix socket in the pair
//! directory, bound by the shim and seen by both engines. Identity never
//! comes from the message text: `SO_PASSCRED` makes the kernel attach the
//! sender's pid (translated into the shim's pid namespace), and the
//! supervisor maps that pid to a slot through its cgroup.
//!
//! Engines are untrusted, and this socket is read on the shim's one runtime
//! thread, so nothing a sender does may block or grow the shim:
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
//! - **Floods.** [`Gate`] decides which datagrams reach the supervisor: a
//!   datagram identical to one of the same sender still waiting is
//!   coalesced, each engine has a token bucket (one token per notification
//!   in a datagram), and the supervisor's input queue is bounded
//!   ([`QUEUE_MAX`]): a datagram that finds it full is dropped. What it
//!   drops is counted ([`DropCounts`], which the supervisor publishes as a
//!   metric) and logged at most every [`LOG_EVERY`].

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use nix::sys::socket::{recvmsg, setsockopt, sockopt, ControlMessageOwned, MsgFlags};
use shadow_pair::{SlotId, MAX_DATAGRAM};
use tokio::io::Interest;
use tokio::net::UnixDatagram;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use crate::error::{Error, Result};

/// The most fds one datagram can carry (the kernel's `SCM_MAX_FD`).
const SCM_MAX_FD: usize = 253;
/// Received fds waiting for the closer thread, at most (all pairs of the
/// shim together). Past it the socket is not read until the closer catches up.
const CLOSER_BACKLOG: usize = 1024;
/// Inputs waiting for the supervisor, at most (the bound of its channel):
/// a datagram that finds them all taken is dropped; the other observers
/// wait for room (see `input.rs`).
pub const QUEUE_MAX: usize = 64;
/// Each engine's token bucket: sustained notifications (`KEY=VALUE` lines
/// the shim acts on; a datagram costs at least one) per second, and burst.
pub const RATE_PER_SEC: u32 = 50;
pub const BURST: u32 = 200;
/// Datagrams dropped in one second past which the reader pauses for the
/// rest of that second, leaving the flood in the kernel's queue (which
/// then blocks or refuses the flooder) instead of spending the shim's CPU.
const DROPS_PER_SEC_MAX: u64 = 1000;
/// How often, at most, a pair logs what its notify socket dropped.
pub const LOG_EVERY: Duration = Duration::from_secs(10);
/// How long a pid's slot, once looked up, is taken as known.
const SLOT_TTL: Duration = Duration::from_secs(1);
/// Pids remembered at once (slot lookups, last datagrams); the maps are
/// cleared when full.
const PIDS_MAX: usize = 256;

/// One datagram and who sent it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Datagram {
    pub pid: u32,
    pub bytes: Vec<u8>,
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
}

impl Dropped {
    const ALL: [Dropped; 8] = [
        Dropped::NoCredentials,
        Dropped::Oversized,
        Dropped::Truncated,
        Dropped::Fds,
        Dropped::NotAnEngine,
        Dropped::Coalesced,
        Dropped::RateLimited,
        Dropped::QueueFull,
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
        }
    }

    fn name(self) -> &'static str {
        match self {
            Dropped::NoCredentials => "no credentials",
            Dropped::Oversized => "oversized",
            Dropped::Truncated => "control data truncated",
            Dropped::Fds => "carried fds",
            Dropped::NotAnEngine => "not an engine",
            Dropped::Coalesced => "coalesced",
            Dropped::RateLimited => "rate limited",
            Dropped::QueueFull => "queue full",
        }
    }
}

/// What one read of the socket gave.
#[derive(Debug)]
pub enum Received {
    Datagram(Datagram),
    Dropped(Dropped),
}

pub struct NotifySocket {
    sock: UnixDatagram,
}

impl NotifySocket {
    /// Bind at `path` (replacing a stale file), world-writable so that
    /// engines running as any user can notify.
    pub fn bind(path: &Path) -> Result<Self> {
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
        refuse_rights(&sock, path);
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))
            .map_err(|e| Error::io(format!("chmod notify socket {}", path.display()), e))?;
        Ok(NotifySocket { sock })
    }

    /// Read the next datagram: one the supervisor may look at, or why it
    /// was dropped. Waits (without reading) while the closer is behind.
    pub async fn recv(&self) -> Result<Received> {
        let got = self
            .sock
            .async_io(Interest::READABLE, || recv_raw(self.sock.as_raw_fd()))
            .await
            .map_err(|e| Error::io("reading the notify socket", e))?;
        let dropped = if got.truncated {
            Some(Dropped::Truncated)
        } else if !got.fds.is_empty() {
            Some(Dropped::Fds)
        } else if got.len > MAX_DATAGRAM {
            Some(Dropped::Oversized)
        } else {
            None
        };
        if !got.fds.is_empty() {
            discard(got.fds).await;
        }
        if let Some(why) = dropped {
            return Ok(Received::Dropped(why));
        }
        match got.pid {
            Some(pid) if pid > 0 => Ok(Received::Datagram(Datagram {
                pid: pid as u32,
                bytes: got.bytes,
            })),
            _ => Ok(Received::Dropped(Dropped::NoCredentials)),
        }
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

/// The thread that closes fds engines passed, and the bound on how many
/// may wait for it.
struct Closer {
    tx: std::sync::mpsc::Sender<(Vec<OwnedFd>, OwnedSemaphorePermit)>,
    room: Arc<Semaphore>,
}

fn closer() -> Option<&'static Closer> {
    static CLOSER: OnceLock<Option<Closer>> = OnceLock::new();
    CLOSER
        .get_or_init(|| {
            let (tx, rx) = std::sync::mpsc::channel::<(Vec<OwnedFd>, OwnedSemaphorePermit)>();
            let spawned = std::thread::Builder::new()
                .name("notify-fd-closer".into())
                .spawn(move || {
                    for (fds, permit) in rx {
                        for fd in fds {
                            close_quickly(fd);
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

/// Close fds an engine passed us, off the runtime thread. Waits (the
/// socket unread) while [`CLOSER_BACKLOG`] fds already wait.
async fn discard(fds: Vec<OwnedFd>) {
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
    if let Err(back) = c.tx.send((fds, permit)) {
        let (fds, _permit) = back.0;
        fds.into_iter().for_each(close_quickly);
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

/// How many datagrams the reader forwarded and the supervisor took: a
/// datagram the same as its sender's last one, while that one still
/// waits, is coalesced. (The queue's bound is its channel's.)
#[derive(Default)]
pub struct Queue {
    forwarded: AtomicU64,
    taken: AtomicU64,
}

impl Queue {
    /// The supervisor took one forwarded datagram.
    pub fn taken(&self) {
        self.taken.fetch_add(1, Ordering::Relaxed);
    }
}

/// The datagrams a pair's notify socket dropped, by reason: counted by the
/// reader, published by the supervisor.
#[derive(Default)]
pub struct DropCounts {
    counts: [AtomicU64; Dropped::ALL.len()],
    /// A drop was counted since the last [`take`](Self::take).
    moved: AtomicBool,
}

impl DropCounts {
    /// Count one drop; true when it is the first since the last `take`
    /// (the supervisor is then told once, not once per drop).
    pub fn count(&self, why: Dropped) -> bool {
        self.counts[why as usize].fetch_add(1, Ordering::Relaxed);
        // Release: whoever sees `moved` set sees this count too.
        !self.moved.swap(true, Ordering::AcqRel)
    }

    /// Whether a drop was counted since the last `take`.
    pub fn moved(&self) -> bool {
        self.moved.load(Ordering::Acquire)
    }

    /// The counts of every reason (0 included), by `reason` label; a drop
    /// counted from here on is `moved` again.
    pub fn take(&self) -> Vec<(&'static str, u64)> {
        // Acquire: the counts whose `moved` this clears are seen below; a
        // drop counted after it sets `moved` again.
        self.moved.swap(false, Ordering::AcqRel);
        self.get()
    }

    fn get(&self) -> Vec<(&'static str, u64)> {
        Dropped::ALL
            .iter()
            .map(|d| (d.label(), self.counts[*d as usize].load(Ordering::Relaxed)))
            .collect()
    }
}

/// What the reader does after a drop.
#[derive(Debug, PartialEq, Eq)]
pub struct AfterDrop {
    /// Stop reading this long (past [`DROPS_PER_SEC_MAX`] drops in a second).
    pub pause: Option<Duration>,
    /// The first drop since the supervisor took the counts: tell it.
    pub tell: bool,
}

/// A token bucket.
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Bucket {
    fn full(now: Instant) -> Bucket {
        Bucket {
            tokens: f64::from(BURST),
            at: now,
        }
    }

    /// The tokens there are at `now`.
    fn refill(&mut self, now: Instant) -> f64 {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.at = now;
        self.tokens = (self.tokens + dt * f64::from(RATE_PER_SEC)).min(f64::from(BURST));
        self.tokens
    }

    /// Takes `n` tokens if there are as many.
    fn take(&mut self, n: u32, now: Instant) -> bool {
        if self.refill(now) >= f64::from(n) {
            self.tokens -= f64::from(n);
            true
        } else {
            false
        }
    }
}

/// What a datagram costs: one token per `KEY=VALUE` line (what the
/// supervisor may act on), at least one; counted without parsing.
fn cost(bytes: &[u8]) -> u32 {
    let lines = bytes
        .split(|b| *b == b'\n')
        .filter(|l| l.contains(&b'='))
        .count();
    lines.clamp(1, BURST as usize + 1) as u32
}

/// Decides which datagrams reach the supervisor; see the module doc.
/// The slot the notify gate found a datagram's sender in, and when it
/// looked (its lookups are kept a while).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SenderSlot {
    pub slot: SlotId,
    pub looked_up: Instant,
}

pub struct Gate {
    id: String,
    queue: Arc<Queue>,
    buckets: [Bucket; 2],
    /// pid -> (slot, when looked up).
    slots: HashMap<u32, (Option<SlotId>, Instant)>,
    /// pid -> (its last forwarded text, that datagram's sequence number).
    last: HashMap<u32, (Vec<u8>, u64)>,
    drops: Arc<DropCounts>,
    /// When the drops were last logged (the first drop is logged at once).
    logged_at: Option<Instant>,
    second: Instant,
    dropped_this_second: u64,
}

impl Gate {
    pub fn new(id: &str, queue: Arc<Queue>, drops: Arc<DropCounts>, now: Instant) -> Gate {
        Gate {
            id: id.to_owned(),
            queue,
            buckets: [Bucket::full(now), Bucket::full(now)],
            slots: HashMap::new(),
            last: HashMap::new(),
            drops,
            logged_at: None,
            second: now,
            dropped_this_second: 0,
        }
    }

    /// Whether `d` goes to the supervisor or why not. `slot_of` looks a
    /// pid's slot up (`/proc`), at most once per pid per [`SLOT_TTL`];
    /// `forward` hands the admitted datagram on, false when the queue is
    /// full (nothing of it is then recorded).
    pub fn admit(
        &mut self,
        d: &Datagram,
        now: Instant,
        slot_of: impl FnOnce(u32) -> Option<SlotId>,
        forward: impl FnOnce(SenderSlot) -> bool,
    ) -> std::result::Result<(), Dropped> {
        let done = self.queue.taken.load(Ordering::Relaxed);
        if let Some((text, seq)) = self.last.get(&d.pid) {
            if *seq > done && *text == d.bytes {
                return Err(Dropped::Coalesced);
            }
        }
        let (slot, looked_up) = match self.slots.get(&d.pid) {
            Some((slot, at)) if now.saturating_duration_since(*at) < SLOT_TTL => (*slot, *at),
            _ => {
                if self.slots.len() >= PIDS_MAX {
                    self.slots.clear();
                }
                let slot = slot_of(d.pid);
                self.slots.insert(d.pid, (slot, now));
                (slot, now)
            }
        };
        let Some(slot) = slot else {
            return Err(Dropped::NotAnEngine);
        };
        // An empty bucket refuses before the datagram is even looked at.
        let bucket = &mut self.buckets[slot.index()];
        if bucket.refill(now) < 1.0 || !bucket.take(cost(&d.bytes), now) {
            return Err(Dropped::RateLimited);
        }
        if !forward(SenderSlot { slot, looked_up }) {
            return Err(Dropped::QueueFull);
        }
        let seq = self.queue.forwarded.fetch_add(1, Ordering::Relaxed) + 1;
        if self.last.len() >= PIDS_MAX {
            self.last.clear();
        }
        self.last.insert(d.pid, (d.bytes.clone(), seq));
        Ok(())
    }

    /// Count a drop; log the counts if [`LOG_EVERY`] has passed. Says how
    /// long the reader should pause (past [`DROPS_PER_SEC_MAX`] drops in a
    /// second, until that second ends) and whether to tell the supervisor.
    pub fn dropped(&mut self, why: Dropped, now: Instant) -> AfterDrop {
        let tell = self.drops.count(why);
        self.log(now);
        if now.saturating_duration_since(self.second) >= Duration::from_secs(1) {
            self.second = now;
            self.dropped_this_second = 0;
        }
        self.dropped_this_second += 1;
        let pause = (self.dropped_this_second > DROPS_PER_SEC_MAX)
            .then(|| (self.second + Duration::from_secs(1)).saturating_duration_since(now));
        AfterDrop { pause, tell }
    }

    /// Datagrams dropped so far, by reason.
    pub fn counts(&self) -> impl Iterator<Item = (Dropped, u64)> + '_ {
        Dropped::ALL
            .iter()
            .map(|d| (*d, self.drops.counts[*d as usize].load(Ordering::Relaxed)))
    }

    fn log(&mut self, now: Instant) {
        if let Some(line) = self.report(now) {
            log::warn!("{line}");
        }
    }

    /// The line to log now, if the last was [`LOG_EVERY`] ago (or never).
    fn report(&mut self, now: Instant) -> Option<String> {
        if self
            .logged_at
            .is_some_and(|at| now.saturating_duration_since(at) < LOG_EVERY)
        {
            return None;
        }
        self.logged_at = Some(now);
        let parts: Vec<String> = self
            .counts()
            .filter(|(_, n)| *n > 0)
            .map(|(d, n)| format!("{}: {n}", d.name()))
            .collect();
        Some(format!(
            "pair {}: notify socket dropped datagrams (totals: {}); the contract allows {RATE_PER_SEC} notifications/s (burst {BURST}) per engine, {MAX_DATAGRAM} bytes, no fds",
            self.id,
            parts.join(", ")
        ))
    }
}

#[cfg(test)]
mod tests {
    impl Gate {
        /// `admit` into a queue of [`QUEUE_MAX`] that the test empties
        /// with `Queue::taken`.
        fn admit_ok(
            &mut self,
            d: &Datagram,
            now: Instant,
            slot_of: impl FnOnce(u32) -> Option<SlotId>,
        ) -> std::result::Result<(), Dropped> {
            let q = self.queue.clone();
            let waiting = q.forwarded.load(Ordering::Relaxed) - q.taken.load(Ordering::Relaxed);
            self.admit(d, now, slot_of, |_| waiting < QUEUE_MAX as u64)
        }
    }

    use super::*;

    #[tokio::test]
    async fn sender_pid_comes_from_the_kernel() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("notify.sock");
        let s = NotifySocket::bind(&p).unwrap();
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

    #[tokio::test]
    async fn oversized_datagrams_are_dropped_whole() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("notify.sock");
        let s = NotifySocket::bind(&p).unwrap();
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
        let s = NotifySocket { sock };
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

    fn gate() -> (Gate, Arc<Queue>, Instant) {
        let q = Arc::new(Queue::default());
        let now = Instant::now();
        let drops = Arc::new(DropCounts::default());
        (Gate::new("t", q.clone(), drops, now), q, now)
    }

    fn dg(pid: u32, text: &[u8]) -> Datagram {
        Datagram {
            pid,
            bytes: text.to_vec(),
        }
    }

    #[test]
    fn repeats_still_waiting_are_coalesced_and_later_ones_pass() {
        let (mut g, q, now) = gate();
        let s0 = |_| Some(SlotId::ZERO);
        assert_eq!(g.admit_ok(&dg(7, b"READY=1"), now, s0), Ok(()));
        assert_eq!(
            g.admit_ok(&dg(7, b"READY=1"), now, s0),
            Err(Dropped::Coalesced)
        );
        // Another text, or another sender, is not a repeat.
        assert_eq!(g.admit_ok(&dg(7, b"STATUS=x"), now, s0), Ok(()));
        assert_eq!(g.admit_ok(&dg(8, b"READY=1"), now, s0), Ok(()));
        q.taken();
        q.taken();
        q.taken();
        assert_eq!(g.admit_ok(&dg(7, b"STATUS=x"), now, s0), Ok(()));
    }

    #[test]
    fn a_flooding_engine_is_limited_and_the_other_is_not() {
        let (mut g, q, now) = gate();
        let mut passed = 0;
        for i in 0..10_000u32 {
            let text = format!("STATUS={i}");
            if g.admit_ok(&dg(7, text.as_bytes()), now, |_| Some(SlotId::ZERO)) == Ok(()) {
                passed += 1;
                q.taken();
            }
        }
        assert_eq!(passed, BURST);
        // One second later, RATE_PER_SEC more.
        let later = now + Duration::from_secs(1);
        let more = (0..1000)
            .filter(|i| {
                let text = format!("STATUS=later {i}");
                let ok =
                    g.admit_ok(&dg(7, text.as_bytes()), later, |_| Some(SlotId::ZERO)) == Ok(());
                if ok {
                    q.taken();
                }
                ok
            })
            .count();
        assert_eq!(more, RATE_PER_SEC as usize);
        assert_eq!(
            g.admit_ok(&dg(9, b"READY=1"), later, |_| Some(SlotId::ONE)),
            Ok(())
        );
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

    #[test]
    fn a_datagram_costs_one_token_per_notification() {
        let (mut g, q, now) = gate();
        let s0 = |_| Some(SlotId::ZERO);
        let lines = "STATUS=x\n".repeat(BURST as usize + 1);
        assert_eq!(
            g.admit_ok(&dg(7, lines.as_bytes()), now, s0),
            Err(Dropped::RateLimited)
        );
        let half = "STATUS=y\n".repeat(BURST as usize / 2);
        assert_eq!(g.admit_ok(&dg(7, half.as_bytes()), now, s0), Ok(()));
        q.taken();
        assert_eq!(g.admit_ok(&dg(7, half.as_bytes()), now, s0), Ok(()));
        q.taken();
        assert_eq!(
            g.admit_ok(&dg(7, b"READY=1"), now, s0),
            Err(Dropped::RateLimited)
        );
        // Garbage holds no notification and costs one token.
        let later = now + Duration::from_secs(1);
        assert_eq!(g.admit_ok(&dg(7, b"\xff\xfe"), later, s0), Ok(()));
    }

    #[test]
    fn the_queue_is_bounded_and_pids_of_no_engine_are_dropped() {
        let (mut g, q, now) = gate();
        for i in 0..QUEUE_MAX {
            let text = format!("STATUS={i}");
            assert_eq!(
                g.admit_ok(&dg(7, text.as_bytes()), now, |_| Some(SlotId::ZERO)),
                Ok(())
            );
        }
        assert_eq!(
            g.admit_ok(&dg(9, b"READY=1"), now, |_| Some(SlotId::ONE)),
            Err(Dropped::QueueFull)
        );
        q.taken();
        assert_eq!(
            g.admit_ok(&dg(9, b"READY=1"), now, |_| Some(SlotId::ONE)),
            Ok(())
        );
        assert_eq!(
            g.admit_ok(&dg(10, b"READY=1"), now, |_| None),
            Err(Dropped::NotAnEngine)
        );
    }

    #[test]
    fn a_slot_is_looked_up_once_per_pid_and_second() {
        let (mut g, q, now) = gate();
        let mut lookups = 0;
        for i in 0..100 {
            let text = format!("STATUS={i}");
            let _ = g.admit_ok(&dg(7, text.as_bytes()), now, |_| {
                lookups += 1;
                Some(SlotId::ZERO)
            });
            q.taken();
        }
        assert_eq!(lookups, 1);
        let _ = g.admit_ok(&dg(7, b"x"), now + SLOT_TTL, |_| {
            lookups += 1;
            Some(SlotId::ZERO)
        });
        assert_eq!(lookups, 2);
    }

    #[test]
    fn drops_are_logged_at_once_then_at_most_every_log_every() {
        let (mut g, _q, now) = gate();
        g.drops.counts[Dropped::RateLimited as usize].store(3, Ordering::Relaxed);
        let first = g.report(now).expect("the first drop is logged");
        assert!(first.contains("rate limited: 3"), "{first}");
        assert!(g.report(now + LOG_EVERY / 2).is_none());
        assert!(g.report(now + LOG_EVERY).is_some());
    }

    #[test]
    fn a_flood_of_drops_pauses_the_reader() {
        let (mut g, _q, now) = gate();
        for _ in 0..DROPS_PER_SEC_MAX {
            assert_eq!(g.dropped(Dropped::RateLimited, now).pause, None);
        }
        let pause = g.dropped(Dropped::RateLimited, now + Duration::from_millis(300));
        assert_eq!(pause.pause, Some(Duration::from_millis(700)));
        assert_eq!(
            g.counts().find(|(d, _)| *d == Dropped::RateLimited),
            Some((Dropped::RateLimited, DROPS_PER_SEC_MAX + 1))
        );
    }

    #[test]
    fn the_supervisor_is_told_once_until_it_takes_the_counts() {
        let (mut g, _q, now) = gate();
        let drops = g.drops.clone();
        assert!(!drops.moved());
        assert!(g.dropped(Dropped::Oversized, now).tell);
        for _ in 0..100 {
            assert!(!g.dropped(Dropped::RateLimited, now).tell);
        }
        assert!(drops.moved());
        let counts = drops.take();
        assert!(!drops.moved());
        // Every reason, 0 included, by its label.
        assert_eq!(counts.len(), Dropped::ALL.len());
        assert!(counts.contains(&("oversized", 1)));
        assert!(counts.contains(&("rate_limited", 100)));
        assert!(counts.contains(&("queue_full", 0)));
        assert!(g.dropped(Dropped::QueueFull, now).tell);
    }
}
