//! One probe of the serving engine (`shadow.dev/probe`, issue 22): a TCP
//! connect (`tcp://`) or a GET whose status line must be 2xx (`http://`),
//! done from inside the pair's network namespace, never the host's, so
//! that `127.0.0.1:8000` is the engine's loopback and not the node's.
//!
//! Network namespaces are per thread, and a socket stays in the namespace
//! it was made in. So each [`Prober`] owns one OS thread that enters the
//! pair's namespace once (`setns(CLONE_NEWNET)`, nothing else: it never
//! joins another namespace and leaves the mount namespace alone) and then
//! runs the probes it is sent, one at a time, answering each through a
//! tokio oneshot: the supervisor awaits a probe without blocking its
//! runtime. The scheduling and the counting of failures are the
//! supervisor's; this module only says whether one probe passed, and why
//! not.
//!
//! An engine is untrusted: it may accept and say nothing, send forever or
//! send garbage. Every step has the probe's one deadline (connect, request
//! and status line together): the sockets are non-blocking and every wait
//! is a `poll(2)` bounded by the time left, and only the status line is
//! read, at most [`MAX_STATUS_LINE`] bytes.
//!
//! A DNS name is resolved on that thread, with `getaddrinfo(3)`, which has
//! no deadline and cannot be interrupted: a slow resolver can keep a probe
//! past its timeout. Its packets leave from the pair's namespace, but its
//! configuration (`/etc/hosts`, `/etc/resolv.conf`, nsswitch) is the
//! shim's, since the mount namespace is not the container's. An IP literal
//! (`http://127.0.0.1:8000/health`) avoids both, and is what the docs
//! should advise.
//!
//! A `tcp://` probe only proves that the kernel completes handshakes: the
//! socket of an engine that is stopped (SIGSTOP) or deadlocked and never
//! accepts still connects while its backlog has room. `http://` catches
//! those.

use std::future::Future;
use std::net::{SocketAddr, ToSocketAddrs};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::poll::{PollFd, PollFlags, PollTimeout};
use nix::sched::CloneFlags;
use nix::sys::socket::{
    getsockopt, sockopt, AddressFamily, MsgFlags, SockFlag, SockType, SockaddrStorage,
};
use nix::sys::stat::Mode;
use nix::unistd::Pid;
use shadow_contract::hang::{Host, ProbeTarget, Written};
use tokio::sync::oneshot;

use crate::error::{Error, Result};

/// The most an `http://` probe reads: the status line must end within it.
pub const MAX_STATUS_LINE: usize = 1024;

/// How much of a bad status line a reason shows.
const SHOWN: usize = 64;

/// One probe's verdict.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Healthy,
    /// Why not, for a log line: `timed out after 100ms (connecting to
    /// 127.0.0.1:8000)`, `HTTP status 503`, ...
    Unhealthy(String),
}

impl Outcome {
    pub fn is_healthy(&self) -> bool {
        *self == Outcome::Healthy
    }
}

/// What the thread is asked: one probe, by then.
struct Request {
    deadline: Instant,
    /// The whole timeout, for the reason of a probe that runs out of it.
    timeout: Duration,
    reply: oneshot::Sender<Outcome>,
}

/// What [`Prober`]'s drop and its thread tell each other, for the one
/// thing the thread cannot be woken from: a name's resolution.
#[derive(Default)]
struct Flags {
    /// Set by the drop before it looks at `resolving`.
    stopping: AtomicBool,
    /// Set by the thread before it looks at `stopping` and resolves.
    resolving: AtomicBool,
}

/// The probe thread of one pair, living in the pair's network namespace.
/// Dropping it ends the thread.
pub struct Prober {
    pair_id: String,
    requests: Option<mpsc::Sender<Request>>,
    /// The write end of a pipe the thread polls beside its socket: closing
    /// it wakes the thread from any wait.
    stop: Option<OwnedFd>,
    flags: Arc<Flags>,
    thread: Option<JoinHandle<()>>,
    /// The thread's id (its /proc/self/task entry), for the tests.
    #[cfg_attr(not(test), allow(dead_code))]
    tid: Pid,
}

impl Prober {
    /// Starts the thread of `pair_id`'s probe of `target`, in the network
    /// namespace `netns` (an open namespace file: `/proc/<pid>/ns/net`, a
    /// pinned bind mount, a CNI netns; see [`open_netns`]), or in the
    /// shim's own with `None`. Returns once the thread is in it, or with
    /// the error of entering it. Nothing is opened by path later; the
    /// namespace file is closed once entered.
    pub fn start(pair_id: &str, netns: Option<OwnedFd>, target: ProbeTarget) -> Result<Prober> {
        let (stop_rx, stop_tx) = nix::unistd::pipe2(OFlag::O_CLOEXEC)
            .map_err(|e| Error::sys(format!("pair {pair_id}: probe: pipe2"), e))?;
        let (requests, inbox) = mpsc::channel::<Request>();
        let (ready_tx, ready) = mpsc::channel::<Result<Pid>>();
        let flags = Arc::new(Flags::default());
        let worker = Worker {
            request: http_request(&target),
            target,
            stop: stop_rx,
            flags: flags.clone(),
        };
        let id = pair_id.to_string();
        let thread = std::thread::Builder::new()
            // A thread name may not hold a NUL (Builder panics on one).
            .name(format!("probe {}", pair_id.replace('\0', "")))
            .spawn(move || {
                if let Some(ns) = netns {
                    if let Err(e) = nix::sched::setns(&ns, CloneFlags::CLONE_NEWNET) {
                        let _ = ready_tx.send(Err(Error::sys(
                            format!("pair {id}: entering its network namespace for the probe"),
                            e,
                        )));
                        return;
                    }
                    // Entered: the thread stays there without the file.
                    drop(ns);
                }
                if ready_tx.send(Ok(nix::unistd::gettid())).is_ok() {
                    worker.serve(&inbox);
                }
            })
            .map_err(|e| Error::io(format!("pair {pair_id}: starting the probe thread"), e))?;
        let entered = ready.recv().unwrap_or_else(|_| {
            Err(Error::FailedPrecondition(format!(
                "pair {pair_id}: the probe thread ended before it started"
            )))
        });
        let tid = match entered {
            Ok(tid) => tid,
            Err(e) => {
                // It has returned or is about to: nothing blocks it.
                let _ = thread.join();
                return Err(e);
            }
        };
        Ok(Prober {
            pair_id: pair_id.to_string(),
            requests: Some(requests),
            stop: Some(stop_tx),
            flags,
            thread: Some(thread),
            tid,
        })
    }

    /// Runs one probe, with `timeout` for all of it (resolution as far as
    /// it can, connect, request and status line). The probe is queued when
    /// `check` is called, behind any still running (the thread runs one at
    /// a time), and its deadline counts from then; the future only waits
    /// for the answer, never blocks, and holds no borrow of the prober (it
    /// may be spawned). A future dropped before its answer leaves its probe
    /// to end by its deadline, or is skipped if it has not started.
    pub fn check(&self, timeout: Duration) -> impl Future<Output = Outcome> + Send + 'static {
        let (reply, answer) = oneshot::channel();
        let request = Request {
            deadline: Instant::now() + timeout,
            timeout,
            reply,
        };
        let sent = self
            .requests
            .as_ref()
            .is_some_and(|r| r.send(request).is_ok());
        let gone = format!("pair {}: the probe thread is gone", self.pair_id);
        async move {
            if !sent {
                return Outcome::Unhealthy(gone);
            }
            answer.await.unwrap_or(Outcome::Unhealthy(gone))
        }
    }
}

impl Drop for Prober {
    /// Ends the thread: closing the request channel ends its wait for a
    /// request, closing the stop pipe any wait of a probe, so the join
    /// takes microseconds. The one wait nothing can cut short is
    /// `getaddrinfo(3)`: a thread inside it is left to end by itself once
    /// the resolution returns (it then sees the pipe closed and probes no
    /// more), so that a drop on a tokio task never blocks for a resolver.
    fn drop(&mut self) {
        // Paired with Worker::addresses: whichever of the two stores comes
        // first, either this sees `resolving` or the thread sees
        // `stopping` and does not resolve.
        self.flags.stopping.store(true, SeqCst);
        self.stop.take();
        self.requests.take();
        let Some(thread) = self.thread.take() else {
            return;
        };
        if self.flags.resolving.load(SeqCst) {
            log::info!(
                "pair {}: the probe thread is resolving a name; it ends once the resolution returns",
                self.pair_id
            );
        } else if thread.join().is_err() {
            log::warn!("pair {}: the probe thread panicked", self.pair_id);
        }
    }
}

/// Opens the network namespace file at `path` (from the container spec, or
/// a pin) for [`Prober::start`]: read-only, close-on-exec, non-blocking
/// (a FIFO put there does not hang the open), and refused unless it is a
/// namespace file (nsfs) of a network namespace.
pub fn open_netns(path: &Path) -> Result<OwnedFd> {
    let fd = nix::fcntl::open(
        path,
        OFlag::O_RDONLY | OFlag::O_CLOEXEC | OFlag::O_NONBLOCK | OFlag::O_NOCTTY,
        Mode::empty(),
    )
    .map_err(|e| Error::sys(format!("opening network namespace {}", path.display()), e))?;
    let fs = nix::sys::statfs::fstatfs(&fd)
        .map_err(|e| Error::sys(format!("fstatfs of {}", path.display()), e))?
        .filesystem_type();
    if fs != nix::sys::statfs::NSFS_MAGIC {
        return Err(Error::InvalidArgument(format!(
            "{} is not a namespace file (filesystem type {:#x}, not nsfs {:#x}): a network \
             namespace is /proc/<pid>/ns/net or a bind mount of one",
            path.display(),
            fs.0,
            nix::sys::statfs::NSFS_MAGIC.0
        )));
    }
    // NS_GET_NSTYPE, _IO(0xb7, 0x3): which kind of namespace (Linux 4.11).
    nix::ioctl_none!(ns_get_nstype, 0xb7, 0x3);
    // SAFETY: NS_GET_NSTYPE takes no argument and only returns an int; fd
    // is an open nsfs file that this function owns for the whole call.
    let kind = unsafe { ns_get_nstype(fd.as_raw_fd()) }
        .map_err(|e| Error::sys(format!("NS_GET_NSTYPE of {}", path.display()), e))?;
    if kind != libc::CLONE_NEWNET {
        return Err(Error::InvalidArgument(format!(
            "{} is a namespace file but not of a network namespace",
            path.display()
        )));
    }
    Ok(fd)
}

/// The GET an `http://` target sends, made once.
fn http_request(target: &ProbeTarget) -> Option<Vec<u8>> {
    let ProbeTarget::Http { host, port, path } = target else {
        return None;
    };
    // Host's Display brackets an IPv6 address, as the header wants; the
    // contract allows only printable ASCII in the path and RFC 1123 names,
    // so neither can break the request's lines.
    let host = match port {
        80 => host.to_string(),
        p => format!("{host}:{p}"),
    };
    Some(
        format!(
            "GET {path} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: shadow-probe\r\nConnection: close\r\n\r\n"
        )
        .into_bytes(),
    )
}

/// Why one step of a probe did not succeed.
enum Fail {
    /// The prober is being dropped.
    Stopped,
    /// The deadline passed while doing this.
    TimedOut(String),
    /// It failed, for this reason.
    Failed(String),
}

impl Fail {
    fn reason(self, timeout: Duration) -> String {
        match self {
            Fail::Stopped => "the prober stopped".into(),
            Fail::TimedOut(doing) => format!("timed out after {} ({doing})", Written(timeout)),
            Fail::Failed(why) => why,
        }
    }
}

/// The kernel's words for an errno, lower-cased: `connection refused`.
fn words(e: Errno) -> String {
    e.desc().to_lowercase()
}

/// What the thread keeps.
struct Worker {
    target: ProbeTarget,
    /// [`http_request`]'s bytes (None: a `tcp://` target).
    request: Option<Vec<u8>>,
    /// The read end of the stop pipe: readable (hung up) once the prober
    /// is dropped.
    stop: OwnedFd,
    flags: Arc<Flags>,
}

impl Worker {
    fn serve(&self, inbox: &mpsc::Receiver<Request>) {
        while let Ok(req) = inbox.recv() {
            if self.flags.stopping.load(SeqCst) {
                return;
            }
            if req.reply.is_closed() {
                // Its caller gave up before it started.
                continue;
            }
            let outcome = self.probe(req.deadline, req.timeout);
            let _ = req.reply.send(outcome);
        }
    }

    fn probe(&self, deadline: Instant, timeout: Duration) -> Outcome {
        let (host, port) = match &self.target {
            ProbeTarget::Http { host, port, .. } | ProbeTarget::Tcp { host, port } => (host, *port),
        };
        let addrs = match self.addresses(host, port, deadline) {
            Ok(a) => a,
            Err(f) => return Outcome::Unhealthy(f.reason(timeout)),
        };
        let mut failed = Vec::new();
        for addr in addrs {
            match self.connect(addr, deadline) {
                Ok(sock) => {
                    // The engine answered the connect: its HTTP answer is
                    // the verdict, with no other address tried.
                    let Some(request) = &self.request else {
                        return Outcome::Healthy;
                    };
                    return match self.get(&sock, request, deadline) {
                        Ok(status) if (200..=299).contains(&status) => Outcome::Healthy,
                        Ok(status) => Outcome::Unhealthy(format!("HTTP status {status}")),
                        Err(f) => Outcome::Unhealthy(f.reason(timeout)),
                    };
                }
                Err(Fail::Failed(why)) => failed.push(format!("connecting to {addr}: {why}")),
                Err(f) => {
                    failed.push(f.reason(timeout));
                    break;
                }
            }
        }
        Outcome::Unhealthy(failed.join("; "))
    }

    /// The addresses to try: the literal, or what the name resolves to.
    fn addresses(
        &self,
        host: &Host,
        port: u16,
        deadline: Instant,
    ) -> Result<Vec<SocketAddr>, Fail> {
        let name = match host {
            Host::V4(a) => return Ok(vec![SocketAddr::from((*a, port))]),
            Host::V6(a) => return Ok(vec![SocketAddr::from((*a, port))]),
            Host::Name(n) => n,
        };
        // See Prober's drop: set `resolving` first, then look at `stopping`.
        self.flags.resolving.store(true, SeqCst);
        if self.flags.stopping.load(SeqCst) {
            self.flags.resolving.store(false, SeqCst);
            return Err(Fail::Stopped);
        }
        // getaddrinfo(3), on this thread and so from the pair's namespace.
        // It takes no deadline and cannot be interrupted: a slow resolver
        // overruns the probe's timeout, which is then reported below. An IP
        // literal in the target skips this.
        let found = (name.as_str(), port).to_socket_addrs();
        self.flags.resolving.store(false, SeqCst);
        let addrs: Vec<SocketAddr> = found
            .map_err(|e| Fail::Failed(format!("resolving {name}: {e}")))?
            .collect();
        if Instant::now() >= deadline {
            return Err(Fail::TimedOut(format!("resolving {name}")));
        }
        if addrs.is_empty() {
            return Err(Fail::Failed(format!("resolving {name}: no address")));
        }
        Ok(addrs)
    }

    /// A connected non-blocking socket to `addr`, by the deadline.
    fn connect(&self, addr: SocketAddr, deadline: Instant) -> Result<OwnedFd, Fail> {
        let family = match addr {
            SocketAddr::V4(_) => AddressFamily::Inet,
            SocketAddr::V6(_) => AddressFamily::Inet6,
        };
        let sock = nix::sys::socket::socket(
            family,
            SockType::Stream,
            SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
            None,
        )
        .map_err(|e| Fail::Failed(format!("socket: {}", words(e))))?;
        match nix::sys::socket::connect(sock.as_raw_fd(), &SockaddrStorage::from(addr)) {
            Ok(()) => return Ok(sock),
            // Interrupted, a non-blocking connect goes on all the same.
            Err(Errno::EINPROGRESS | Errno::EINTR) => {}
            Err(e) => return Err(Fail::Failed(words(e))),
        }
        self.wait(sock.as_fd(), PollFlags::POLLOUT, deadline, || {
            format!("connecting to {addr}")
        })?;
        match getsockopt(&sock, sockopt::SocketError) {
            Ok(0) => Ok(sock),
            Ok(e) => Err(Fail::Failed(words(Errno::from_raw(e)))),
            Err(e) => Err(Fail::Failed(format!("SO_ERROR: {}", words(e)))),
        }
    }

    /// Sends `request` and reads the status line's code, by the deadline.
    fn get(&self, sock: &OwnedFd, request: &[u8], deadline: Instant) -> Result<u16, Fail> {
        let fd = sock.as_raw_fd();
        let sending = || "sending the request".to_string();
        let mut sent = 0;
        while sent < request.len() {
            // MSG_NOSIGNAL: a peer that closed gives EPIPE, not SIGPIPE.
            match nix::sys::socket::send(fd, &request[sent..], MsgFlags::MSG_NOSIGNAL) {
                Ok(0) => return Err(Fail::Failed(format!("{}: nothing taken", sending()))),
                Ok(n) => sent += n,
                Err(Errno::EAGAIN) => {
                    self.wait(sock.as_fd(), PollFlags::POLLOUT, deadline, sending)?
                }
                Err(Errno::EINTR) => {}
                Err(e) => return Err(Fail::Failed(format!("{}: {}", sending(), words(e)))),
            }
        }
        let reading = || "reading the status line".to_string();
        let mut buf = [0u8; MAX_STATUS_LINE];
        let mut len = 0;
        loop {
            if let Some(end) = buf[..len].iter().position(|&b| b == b'\n') {
                return status_of(&buf[..end]).map_err(Fail::Failed);
            }
            if len == buf.len() {
                return Err(Fail::Failed(format!(
                    "no status line in the first {MAX_STATUS_LINE} bytes"
                )));
            }
            // A peer that trickles bytes never makes a read wait: look.
            if Instant::now() >= deadline {
                return Err(Fail::TimedOut(reading()));
            }
            if self.flags.stopping.load(SeqCst) {
                return Err(Fail::Stopped);
            }
            match nix::sys::socket::recv(fd, &mut buf[len..], MsgFlags::empty()) {
                Ok(0) if len == 0 => {
                    return Err(Fail::Failed("connection closed with no answer".into()))
                }
                Ok(0) => {
                    return Err(Fail::Failed(format!(
                        "connection closed inside the status line {}",
                        shown(&buf[..len])
                    )))
                }
                Ok(n) => len += n,
                Err(Errno::EAGAIN) => {
                    self.wait(sock.as_fd(), PollFlags::POLLIN, deadline, reading)?
                }
                Err(Errno::EINTR) => {}
                Err(e) => return Err(Fail::Failed(format!("{}: {}", reading(), words(e)))),
            }
        }
    }

    /// Waits until `fd` has one of `events` (or an error or hang-up, which
    /// the next call reports), the deadline passes (`doing` names the
    /// step), or the prober is dropped.
    fn wait(
        &self,
        fd: BorrowedFd<'_>,
        events: PollFlags,
        deadline: Instant,
        doing: impl Fn() -> String,
    ) -> Result<(), Fail> {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Fail::TimedOut(doing()));
            }
            // Rounded up: poll counts milliseconds, and a wait cut short
            // would only spin.
            let ms = i32::try_from(left.as_micros().div_ceil(1000)).unwrap_or(i32::MAX);
            let mut fds = [
                PollFd::new(fd, events),
                PollFd::new(self.stop.as_fd(), PollFlags::POLLIN),
            ];
            match nix::poll::poll(
                &mut fds,
                PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX),
            ) {
                Ok(0) | Err(Errno::EINTR) => continue,
                Ok(_) => {}
                Err(e) => return Err(Fail::Failed(format!("{}: poll: {}", doing(), words(e)))),
            }
            if fds[1].any().unwrap_or(false) {
                return Err(Fail::Stopped);
            }
            if fds[0].any().unwrap_or(false) {
                return Ok(());
            }
        }
    }
}

/// The code of a status line (without its `\n`): `HTTP/1.x NNN[ reason]`.
fn status_of(line: &[u8]) -> Result<u16, String> {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let malformed = || format!("malformed status line {}", shown(line));
    let rest = line.strip_prefix(b"HTTP/1.").ok_or_else(malformed)?;
    let [minor, b' ', a, b, c, tail @ ..] = rest else {
        return Err(malformed());
    };
    let digits = [*minor, *a, *b, *c];
    if !digits.iter().all(u8::is_ascii_digit) || !(tail.is_empty() || tail[0] == b' ') {
        return Err(malformed());
    }
    let code = [*a, *b, *c]
        .iter()
        .fold(0u16, |n, d| n * 10 + u16::from(d - b'0'));
    if !(100..=599).contains(&code) {
        return Err(malformed());
    }
    Ok(code)
}

/// Bytes from the peer, quoted and escaped, at most [`SHOWN`] of them.
fn shown(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(&bytes[..bytes.len().min(SHOWN)]);
    let more = if bytes.len() > SHOWN { "..." } else { "" };
    format!("{text:?}{more}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::{Ipv4Addr, TcpListener, TcpStream};

    const LOCAL: Host = Host::V4(Ipv4Addr::LOCALHOST);
    /// Long enough that no probe here fails by its deadline unless it is
    /// meant to (the machine may be slow).
    const LONG: Duration = Duration::from_secs(30);
    /// The deadline of the probes meant to time out.
    const SHORT: Duration = Duration::from_millis(200);

    fn tcp(port: u16) -> ProbeTarget {
        ProbeTarget::Tcp { host: LOCAL, port }
    }

    fn http(port: u16, path: &str) -> ProbeTarget {
        ProbeTarget::Http {
            host: LOCAL,
            port,
            path: path.into(),
        }
    }

    fn prober(target: ProbeTarget) -> Prober {
        Prober::start("test-pair", None, target).expect("start")
    }

    fn unhealthy(o: Outcome) -> String {
        match o {
            Outcome::Unhealthy(why) => why,
            Outcome::Healthy => panic!("healthy"),
        }
    }

    /// A port on 127.0.0.1 that refuses connections for as long as the
    /// socket lives: bound, never listening, so no one else can listen
    /// there meanwhile (a dropped listener's port could be taken again).
    fn refusing_port() -> (OwnedFd, u16) {
        let sock = nix::sys::socket::socket(
            AddressFamily::Inet,
            SockType::Stream,
            SockFlag::SOCK_CLOEXEC,
            None,
        )
        .unwrap();
        let any = SockaddrStorage::from(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)));
        nix::sys::socket::bind(sock.as_raw_fd(), &any).unwrap();
        let port = nix::sys::socket::getsockname::<SockaddrStorage>(sock.as_raw_fd())
            .unwrap()
            .as_sockaddr_in()
            .unwrap()
            .port();
        (sock, port)
    }

    /// A server on 127.0.0.1 that accepts one connection and hands it to
    /// `f`; the thread's result is `f`'s.
    fn serve<T: Send + 'static>(
        f: impl FnOnce(TcpStream) -> T + Send + 'static,
    ) -> (u16, std::thread::JoinHandle<T>) {
        let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let port = l.local_addr().unwrap().port();
        let t = std::thread::spawn(move || f(l.accept().unwrap().0));
        (port, t)
    }

    /// Reads a request up to its blank line.
    fn request_of(s: &mut TcpStream) -> String {
        let mut got = Vec::new();
        let mut b = [0u8; 256];
        while !got.ends_with(b"\r\n\r\n") {
            match s.read(&mut b).unwrap() {
                0 => break,
                n => got.extend_from_slice(&b[..n]),
            }
        }
        String::from_utf8(got).unwrap()
    }

    /// A server that reads the request and answers `answer`; its thread
    /// returns the request.
    fn answering(answer: &'static str) -> (u16, std::thread::JoinHandle<String>) {
        serve(move |mut s| {
            let req = request_of(&mut s);
            s.write_all(answer.as_bytes()).unwrap();
            req
        })
    }

    /// Reads until the peer closes (the prober, at its deadline or end).
    fn until_closed(mut s: TcpStream) {
        let mut b = [0u8; 1024];
        while s.read(&mut b).is_ok_and(|n| n > 0) {}
    }

    #[tokio::test]
    async fn tcp_is_healthy_when_the_connect_completes_and_not_when_refused() {
        let (port, server) = serve(until_closed);
        assert!(prober(tcp(port)).check(LONG).await.is_healthy());
        // The probe closed at once: the server saw its end.
        server.join().unwrap();
        let (_hold, port) = refusing_port();
        let why = unhealthy(prober(tcp(port)).check(LONG).await);
        assert_eq!(
            why,
            format!("connecting to 127.0.0.1:{port}: connection refused")
        );
    }

    #[tokio::test]
    async fn http_2xx_is_healthy_and_the_request_is_a_plain_get() {
        let (port, server) = answering("HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n");
        let p = prober(http(port, "/v1/health?ready=1"));
        assert_eq!(p.check(LONG).await, Outcome::Healthy);
        assert_eq!(
            server.join().unwrap(),
            format!(
                "GET /v1/health?ready=1 HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\
                 User-Agent: shadow-probe\r\nConnection: close\r\n\r\n"
            )
        );
        for answer in ["HTTP/1.1 204 No Content\r\n\r\n", "HTTP/1.0 299\r\n"] {
            let (port, server) = answering(answer);
            assert_eq!(
                prober(http(port, "/")).check(LONG).await,
                Outcome::Healthy,
                "{answer:?}"
            );
            server.join().unwrap();
        }
    }

    #[tokio::test]
    async fn http_non_2xx_is_unhealthy_with_the_status() {
        for (answer, why) in [
            (
                "HTTP/1.1 503 Service Unavailable\r\n\r\n",
                "HTTP status 503",
            ),
            (
                "HTTP/1.1 301 Moved\r\nLocation: /x\r\n\r\n",
                "HTTP status 301",
            ),
            ("HTTP/1.1 199 Early\r\n\r\n", "HTTP status 199"),
            ("HTTP/1.1 404 Not Found\n\n", "HTTP status 404"),
        ] {
            let (port, server) = answering(answer);
            let got = prober(http(port, "/health")).check(LONG).await;
            assert_eq!(got, Outcome::Unhealthy(why.into()), "{answer:?}");
            server.join().unwrap();
        }
    }

    #[tokio::test]
    async fn garbage_or_a_close_instead_of_a_status_line_is_unhealthy() {
        for (answer, why) in [
            (
                "SSH-2.0-OpenSSH_9.6\r\n",
                "malformed status line \"SSH-2.0-OpenSSH_9.6\"",
            ),
            ("HTTP/1.1 20 OK\r\n", "malformed status line"),
            ("", "connection closed with no answer"),
            (
                "HTTP/1.1 200 OK",
                "connection closed inside the status line \"HTTP/1.1 200 OK\"",
            ),
        ] {
            let (port, server) = answering(answer);
            let got = unhealthy(prober(http(port, "/")).check(LONG).await);
            assert!(got.starts_with(why), "{answer:?}: {got}");
            server.join().unwrap();
        }
    }

    #[test]
    fn status_lines_read() {
        for (line, code) in [
            (&b"HTTP/1.1 200 OK"[..], 200),
            (b"HTTP/1.0 204\r", 204),
            (b"HTTP/1.1 503 Service Unavailable\r", 503),
            (b"HTTP/1.9 599 x", 599),
            (b"HTTP/1.1 100", 100),
        ] {
            assert_eq!(status_of(line), Ok(code), "{line:?}");
        }
        for line in [
            &b""[..],
            b"HTTP/1.1",
            b"HTTP/1.1 ",
            b"HTTP/1.1 2000 OK",
            b"HTTP/1.1 20",
            b"HTTP/1.1  200 OK",
            b"HTTP/1.1 2x0 OK",
            b"HTTP/1.x 200 OK",
            b"HTTP/2 200",
            b"HTTP/1.1 099 low",
            b"HTTP/1.1 600 high",
            b"http/1.1 200 OK",
            b" HTTP/1.1 200 OK",
            b"HTTP/1.1 200OK",
            b"\xff\xfe 200",
        ] {
            let e = status_of(line).unwrap_err();
            assert!(e.starts_with("malformed status line \""), "{line:?}: {e}");
        }
        // A long line is shown cut.
        let long = [b'a'; 200];
        let e = status_of(&long).unwrap_err();
        assert_eq!(
            e,
            format!("malformed status line {:?}...", "a".repeat(SHOWN))
        );
    }

    #[tokio::test]
    async fn a_server_that_never_answers_times_out() {
        let (port, server) = serve(until_closed);
        let why = unhealthy(prober(http(port, "/")).check(SHORT).await);
        assert_eq!(why, "timed out after 200ms (reading the status line)");
        server.join().unwrap();
    }

    #[tokio::test]
    async fn endless_bytes_without_a_newline_are_cut_at_the_bound() {
        let (port, server) = serve(|mut s| {
            // Until the prober closes on it.
            while s.write_all(&[b'x'; 4096]).is_ok() {}
        });
        // The deadline is long: only the bound can end this probe early.
        let why = unhealthy(prober(http(port, "/")).check(LONG).await);
        assert_eq!(why, "no status line in the first 1024 bytes");
        server.join().unwrap();
    }

    #[tokio::test]
    async fn a_listener_that_never_accepts_passes_tcp_but_not_http() {
        // The kernel completes handshakes into the backlog whether or not
        // the engine ever calls accept (stopped, deadlocked): a tcp:// probe
        // cannot tell, which is why the docs advise http://.
        let stopped = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let port = stopped.local_addr().unwrap().port();
        assert_eq!(prober(tcp(port)).check(LONG).await, Outcome::Healthy);
        let why = unhealthy(prober(http(port, "/health")).check(SHORT).await);
        assert_eq!(why, "timed out after 200ms (reading the status line)");
    }

    #[tokio::test]
    async fn a_name_resolves_on_the_probe_thread() {
        let (port, server) = serve(until_closed);
        let p = prober(ProbeTarget::Tcp {
            host: Host::Name("localhost".into()),
            port,
        });
        // localhost may be ::1 first; the server listens on 127.0.0.1 only:
        // every address is tried until one connects.
        assert_eq!(p.check(LONG).await, Outcome::Healthy);
        server.join().unwrap();
        let p = prober(ProbeTarget::Tcp {
            host: Host::Name("no-such-host.invalid".into()),
            port,
        });
        let why = unhealthy(p.check(LONG).await);
        assert!(why.starts_with("resolving no-such-host.invalid: "), "{why}");
    }

    #[tokio::test]
    async fn probes_queue_and_a_dropped_check_is_skipped() {
        // Never accepts: each probe's connect waits in the backlog, where
        // it can be counted afterwards.
        let stopped = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let port = stopped.local_addr().unwrap().port();
        let p = prober(http(port, "/"));
        let first = p.check(SHORT);
        // Queued behind the first, and given up before it starts.
        drop(p.check(LONG));
        let second = p.check(SHORT);
        assert!(unhealthy(first.await).starts_with("timed out"));
        // Its deadline counted from its call: it ran out behind the first.
        assert!(unhealthy(second.await).starts_with("timed out"));
        drop(p);
        // Two connects, not three: the dropped check never ran.
        stopped.set_nonblocking(true).unwrap();
        let queued = std::iter::from_fn(|| stopped.accept().ok()).count();
        assert_eq!(queued, 2);
    }

    fn thread_alive(tid: Pid) -> bool {
        Path::new(&format!("/proc/self/task/{tid}")).exists()
    }

    #[tokio::test]
    async fn dropping_the_prober_ends_its_thread_even_mid_probe() {
        let idle = prober(tcp(1));
        let tid = idle.tid;
        assert!(thread_alive(tid));
        drop(idle);
        // Joined: at most the kernel's last step of the exit remains.
        shadow_wait::until("the idle probe thread to end", LONG, SHORT / 100, || {
            (!thread_alive(tid)).then_some(())
        });

        let (accepted_tx, accepted) = oneshot::channel();
        let (port, server) = serve(move |s| {
            let _ = accepted_tx.send(());
            until_closed(s)
        });
        let p = prober(http(port, "/"));
        let tid = p.tid;
        let check = tokio::spawn(p.check(Duration::from_secs(3600)));
        accepted.await.unwrap();
        // The probe now waits for a status line that never comes.
        drop(p);
        assert_eq!(
            unhealthy(check.await.unwrap()),
            "the prober stopped".to_string()
        );
        server.join().unwrap();
        shadow_wait::until("the busy probe thread to end", LONG, SHORT / 100, || {
            (!thread_alive(tid)).then_some(())
        });
    }

    #[test]
    fn a_prober_and_its_check_go_to_any_task() {
        fn sendable<T: Send + Sync>(_: &T) {}
        fn spawnable<T: std::future::Future + Send + 'static>(_: &T) {}
        let p = prober(tcp(1));
        sendable(&p);
        spawnable(&p.check(SHORT));
    }

    #[test]
    fn a_netns_fd_that_is_no_namespace_fails_start() {
        let file = tempfile::tempfile().unwrap();
        let e = Prober::start("p", Some(OwnedFd::from(file)), tcp(1))
            .err()
            .expect("setns into a plain file");
        assert!(
            e.to_string()
                .starts_with("pair p: entering its network namespace for the probe"),
            "{e}"
        );
    }

    #[test]
    fn open_netns_takes_only_a_network_namespace() {
        let fd = open_netns(Path::new("/proc/self/ns/net")).unwrap();
        let flags = nix::fcntl::fcntl(&fd, nix::fcntl::FcntlArg::F_GETFD).unwrap();
        assert_ne!(flags & libc::FD_CLOEXEC, 0);
        let file = tempfile::NamedTempFile::new().unwrap();
        let e = open_netns(file.path()).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
        assert!(e.to_string().contains("is not a namespace file"), "{e}");
        let e = open_netns(Path::new("/proc/self/ns/ipc")).unwrap_err();
        assert!(
            e.to_string()
                .ends_with("is a namespace file but not of a network namespace"),
            "{e}"
        );
        // A FIFO does not hang the open.
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        nix::unistd::mkfifo(&fifo, Mode::S_IRWXU).unwrap();
        assert!(open_netns(&fifo).unwrap_err().to_string().contains("nsfs"));
        let e = open_netns(&dir.path().join("none")).unwrap_err();
        assert!(matches!(e, Error::Sys { .. }), "{e:?}");
    }

    /// Root only (unshare(CLONE_NEWNET)); skipped otherwise.
    #[tokio::test]
    async fn the_probe_runs_in_the_given_namespace_and_not_the_hosts() {
        if !nix::unistd::Uid::effective().is_root() {
            eprintln!("skipped: making a network namespace needs root");
            return;
        }
        // The port refuses on the host for the whole test.
        let (_host_side, port) = refusing_port();
        let (listener, netns) = std::thread::spawn(move || {
            nix::sched::unshare(CloneFlags::CLONE_NEWNET).unwrap();
            crate::pair::netns::lo_up().unwrap();
            let l = TcpListener::bind((Ipv4Addr::LOCALHOST, port)).unwrap();
            // The listener and this file keep the namespace once the
            // thread has ended.
            (
                l,
                open_netns(Path::new("/proc/thread-self/ns/net")).unwrap(),
            )
        })
        .join()
        .unwrap();
        let inside = Prober::start("ns-pair", Some(netns), tcp(port)).unwrap();
        assert_eq!(inside.check(LONG).await, Outcome::Healthy);
        let outside = Prober::start("host-pair", None, tcp(port)).unwrap();
        let why = unhealthy(outside.check(LONG).await);
        assert!(why.ends_with("connection refused"), "{why}");
        // The namespace's listener got the one connect.
        listener.set_nonblocking(true).unwrap();
        assert!(listener.accept().is_ok());
        assert!(listener.accept().is_err());
    }
}
