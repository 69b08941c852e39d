//! `gmsd serve`: one process per device that owns every allocation.
//!
//! Shape: a main thread polls the listening socket and a signalfd
//! (SIGTERM/SIGINT); each accepted connection gets a thread; all state sits
//! in one `Mutex<State>`. A connection thread ends when its peer closes,
//! dies (EOF/ECONNRESET), or breaks a rule; either way its `Session` guard
//! releases the lease on drop, so "the connection is the lease" holds by
//! construction, also for a writer SIGKILLed halfway through a load.
//!
//! Every error a peer causes is answered with one `error` message and the
//! connection is closed (for a writer that also discards its uncommitted
//! work). Nothing a peer sends can panic the daemon: all input goes through
//! `protocol::decode`, and the lock is taken poison-tolerant.
//!
//! Engines are untrusted (docs/security.md, "Leases and gmsd"), so no peer
//! can hold the daemon: a connection must say `hello` (or `status`) within
//! `hello` time, finish every frame it starts within `frame` time and read
//! its answers as fast; an uncommitted `rw` lease idle past `writer_idle`
//! is dropped with its allocations; one peer process holds at most
//! `max_connections_per_peer` connections; an allocation is created and
//! populated outside the global lock; a failing `accept` (EMFILE) backs off
//! instead of spinning. The supervisor (gmsd's parent: the shim, or whoever
//! started it) is told apart from engines by its pid (`SO_PEERCRED`) and is
//! the only peer that may `reset`; no engine gets `rw` once a layout is
//! committed.

use std::collections::BTreeMap;
use std::fs;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};

use gms::layout::{self as layout, Allocation, Layout, MetadataLimits};
use gms::protocol::{self, LeaseKind, Request, Response, MAX_REQUEST_BYTES, MAX_RESPONSE_BYTES};
use gms::status::{LayoutSummary, LeaseInfo, LimitsReport, StatusReport};
use gms::{wire, Access, Error, Result};

use crate::backend::{Backend, Memory};
use crate::lease::{Ended, LeaseId, Leases};

#[derive(Debug, Clone)]
pub struct Limits {
    pub max_bytes: u64,
    pub max_allocations: usize,
    pub max_metadata_entries: usize,
    pub max_metadata_bytes: usize,
    pub max_connections: usize,
    /// Connections one peer process (by pid) may hold at once.
    pub max_connections_per_peer: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_bytes: 64 << 30,
            max_allocations: 4096,
            max_metadata_entries: 65536,
            max_metadata_bytes: 8 << 20,
            max_connections: 256,
            max_connections_per_peer: 16,
        }
    }
}

impl Limits {
    /// A layout within these limits must reach a reader whole: its encoded
    /// size is bounded by the metadata bytes (counted encoded) plus the
    /// widest encoding of every allocation, and that must fit a response.
    fn check(&self) -> Result<()> {
        let layout_max = self
            .max_metadata_bytes
            .saturating_add(
                self.max_allocations
                    .saturating_mul(layout::max_encoded_allocation_len()),
            )
            .saturating_add(4096);
        if layout_max > MAX_RESPONSE_BYTES {
            return Err(Error::Config(format!(
                "--max-metadata-bytes {} with --max-allocations {} allows a layout of up to \
                 {layout_max} bytes encoded, more than a reader accepts ({MAX_RESPONSE_BYTES})",
                self.max_metadata_bytes, self.max_allocations
            )));
        }
        if self.max_connections_per_peer == 0 {
            return Err(Error::Config(
                "--max-connections-per-peer must be at least 1".into(),
            ));
        }
        Ok(())
    }
}

/// How long a peer may keep the daemon waiting.
#[derive(Debug, Clone)]
pub struct Timeouts {
    /// From connect to the first message (`hello` or `status`), and
    /// between messages of a connection that holds no lease.
    pub hello: Duration,
    /// To receive the rest of a frame once its first byte arrived, and to
    /// send an answer.
    pub frame: Duration,
    /// Between two requests of an uncommitted `rw` lease; past it the lease
    /// is dropped and its allocations discarded.
    pub writer_idle: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            hello: Duration::from_secs(10),
            frame: Duration::from_secs(10),
            writer_idle: Duration::from_secs(900),
        }
    }
}

/// Who may `reset` the daemon: the process that supervises it, never an
/// engine. Engines cannot be told apart by uid (a root container is uid 0
/// like the shim), so the supervisor is named by pid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Supervisor {
    /// gmsd's parent process, checked at each connection (`getppid()`; not
    /// pid 1, and no longer the old pid once the parent died: a reparented
    /// gmsd has no supervisor).
    Parent,
    /// Nobody: a committed layout lives until the daemon stops.
    Nobody,
}

#[derive(Debug, Clone)]
pub struct Config {
    pub socket_dir: PathBuf,
    pub limits: Limits,
    /// Peers whose uid or gid is listed may connect; both empty means the
    /// daemon's own effective uid only.
    pub allow_uids: Vec<u32>,
    pub allow_gids: Vec<u32>,
    /// Group owner of the socket; makes it mode 0660 instead of 0600.
    pub socket_group: Option<u32>,
    pub timeouts: Timeouts,
    pub supervisor: Supervisor,
}

/// Allocations with their memory, plus the layout that describes them.
#[derive(Default)]
struct Store {
    layout: Layout,
    memory: BTreeMap<u64, Box<dyn Memory>>,
    /// `layout.metadata_encoded_bytes()`, kept as entries come and go.
    metadata_encoded: usize,
}

struct Connection {
    pid: i32,
    uid: u32,
    gid: u32,
    client: String,
    lease: Option<LeaseId>,
    said_hello: bool,
    /// The peer is gmsd's supervisor (see [`Supervisor`]).
    supervisor: bool,
    /// A second handle on the socket, so shutdown can wake the thread.
    stream: UnixStream,
}

#[derive(Default)]
struct State {
    leases: Leases,
    working: Option<Store>,
    committed: Option<Store>,
    next_alloc: u64,
    generation: u64,
    next_conn: u64,
    connections: BTreeMap<u64, Connection>,
}

pub struct Daemon {
    backend: Box<dyn Backend>,
    config: Config,
    socket: PathBuf,
    state: Mutex<State>,
}

/// Removes the socket file when the daemon stops, however it stops.
struct SocketFile(PathBuf);

impl Drop for SocketFile {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.0);
    }
}

/// Ends a connection's lease when its thread leaves, on every path.
struct Session<'a> {
    daemon: &'a Daemon,
    id: u64,
}

impl Drop for Session<'_> {
    fn drop(&mut self) {
        self.daemon.end(self.id);
    }
}

fn prepare_dir(dir: &Path) -> Result<()> {
    if !dir.exists() {
        fs::create_dir_all(dir)
            .map_err(|e| Error::io(format!("creating socket directory {}", dir.display()), e))?;
        fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
            .map_err(|e| Error::io(format!("chmod 0700 {}", dir.display()), e))?;
    }
    let meta = fs::metadata(dir)
        .map_err(|e| Error::io(format!("socket directory {}", dir.display()), e))?;
    if !meta.is_dir() {
        return Err(Error::Config(format!(
            "{} is not a directory",
            dir.display()
        )));
    }
    if meta.mode() & 0o002 != 0 {
        return Err(Error::Config(format!(
            "socket directory {} is world-writable (mode {:o}); use a private directory",
            dir.display(),
            meta.mode() & 0o7777
        )));
    }
    Ok(())
}

fn bind(path: &Path, group: Option<u32>) -> Result<UnixListener> {
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            return Err(Error::Config(format!(
                "another gmsd already serves {}",
                path.display()
            )));
        }
        fs::remove_file(path)
            .map_err(|e| Error::io(format!("removing stale socket {}", path.display()), e))?;
    }
    // No window in which the socket exists with looser permissions: bind
    // under a umask that leaves 0600 (we are still single-threaded here).
    let old = nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o177));
    let bound = UnixListener::bind(path);
    nix::sys::stat::umask(old);
    let listener = bound.map_err(|e| Error::io(format!("binding {}", path.display()), e))?;
    if let Some(gid) = group {
        nix::unistd::chown(path, None, Some(nix::unistd::Gid::from_raw(gid)))
            .map_err(|e| Error::sys(format!("chown :{gid} {}", path.display()), e))?;
        fs::set_permissions(path, fs::Permissions::from_mode(0o660))
            .map_err(|e| Error::io(format!("chmod 0660 {}", path.display()), e))?;
    }
    Ok(listener)
}

/// Runs the daemon until SIGTERM or SIGINT. `ready` is called once the
/// socket accepts connections. Everything is freed before this returns.
pub fn serve(config: Config, backend: Box<dyn Backend>, ready: impl FnOnce(&Path)) -> Result<()> {
    // Block the stop signals before any thread exists, so every thread
    // inherits the mask and only the signalfd sees them.
    let mut stop = SigSet::empty();
    stop.add(Signal::SIGTERM);
    stop.add(Signal::SIGINT);
    stop.thread_block()
        .map_err(|e| Error::sys("blocking SIGTERM/SIGINT", e))?;
    let signals = SignalFd::with_flags(&stop, SfdFlags::SFD_CLOEXEC)
        .map_err(|e| Error::sys("signalfd for SIGTERM/SIGINT", e))?;

    config.limits.check()?;
    prepare_dir(&config.socket_dir)?;
    let socket = config.socket_dir.join(backend.socket_name());
    let listener = bind(&socket, config.socket_group)?;
    let _socket_file = SocketFile(socket.clone());
    listener
        .set_nonblocking(true)
        .map_err(|e| Error::io(format!("O_NONBLOCK on {}", socket.display()), e))?;

    let daemon = Arc::new(Daemon {
        backend,
        config,
        socket: socket.clone(),
        state: Mutex::new(State::default()),
    });
    tracing::info!(
        socket = %socket.display(),
        backend = daemon.backend.name(),
        device = %daemon.backend.device(),
        "gmsd serving"
    );
    ready(&socket);

    let mut threads: Vec<JoinHandle<()>> = Vec::new();
    // After a failed accept (EMFILE, ENFILE, ENOMEM, ENOBUFS) the
    // connection stays queued and the listener stays readable: polling it
    // again at once would spin. Wait this long (signals only), doubling.
    let mut backoff = Duration::ZERO;
    loop {
        let listening = backoff.is_zero();
        let mut fds = [
            PollFd::new(signals.as_fd(), PollFlags::POLLIN),
            PollFd::new(listener.as_fd(), PollFlags::POLLIN),
        ];
        let (watched, timeout) = if listening {
            (&mut fds[..], PollTimeout::NONE)
        } else {
            let ms = u16::try_from(backoff.as_millis()).unwrap_or(u16::MAX);
            (&mut fds[..1], PollTimeout::from(ms))
        };
        match poll(watched, timeout) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(Error::sys("poll on listener and signalfd", e)),
        }
        let signalled = fds[0].revents().is_some_and(|r| !r.is_empty());
        let incoming = !listening || fds[1].revents().is_some_and(|r| !r.is_empty());
        if signalled {
            if let Ok(Some(info)) = signals.read_signal() {
                tracing::info!(signal = info.ssi_signo, "stopping");
            }
            break;
        }
        if incoming {
            match listener.accept() {
                Ok((stream, _)) => {
                    backoff = Duration::ZERO;
                    // No request carries descriptors.
                    wire::refuse_rights(stream.as_fd());
                    if let Some(t) = daemon.admit(stream) {
                        threads.push(t);
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => backoff = Duration::ZERO,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    backoff = (backoff * 2).clamp(ACCEPT_BACKOFF_MIN, ACCEPT_BACKOFF_MAX);
                    tracing::warn!(
                        "accept on {}: {e}; pausing accepts for {backoff:?}",
                        socket.display()
                    );
                }
            }
            threads.retain(|t| !t.is_finished());
        }
    }

    // Wake every connection thread (its recv returns end-of-stream), let
    // each release its lease, then drop all memory.
    for conn in daemon.lock().connections.values() {
        let _ = conn.stream.shutdown(std::net::Shutdown::Both);
    }
    for t in threads {
        let _ = t.join();
    }
    let mut st = daemon.lock();
    st.working = None;
    st.committed = None;
    tracing::info!("gmsd stopped; all allocations freed");
    Ok(())
}

const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(10);
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// What a connection thread waits for next.
enum Wait {
    /// At most this long for the next request.
    Within(Duration, &'static str),
    /// A reader: its connection is its lease and may stay silent for ever.
    Forever,
}

/// Waits until `stream` is readable (or hung up); false on timeout.
fn readable_within(stream: &UnixStream, wait: &Wait) -> Result<bool> {
    let timeout = match wait {
        Wait::Within(d, _) => PollTimeout::try_from(*d).unwrap_or(PollTimeout::MAX),
        Wait::Forever => PollTimeout::NONE,
    };
    loop {
        let mut fds = [PollFd::new(stream.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, timeout) {
            Ok(0) => return Ok(false),
            Ok(_) => return Ok(true),
            // A signal restarts the whole wait: none is expected here (the
            // stop signals are blocked in every thread).
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(Error::sys("poll on a connection", e)),
        }
    }
}

fn no_working() -> Error {
    Error::NoLayout("no working layout: the rw lease has none".into())
}

fn refuse(stream: &UnixStream, err: &Error) {
    if let Ok(body) = protocol::encode_response(&Response::error(err)) {
        let _ = wire::send(stream.as_fd(), &body, &[]);
    }
}

impl Daemon {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic elsewhere must not take every later lease down with it.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn allowed(&self, uid: u32, gid: u32) -> bool {
        let c = &self.config;
        if c.allow_uids.is_empty() && c.allow_gids.is_empty() {
            return uid == nix::unistd::geteuid().as_raw();
        }
        c.allow_uids.contains(&uid) || c.allow_gids.contains(&gid)
    }

    /// Whether the peer with this pid is gmsd's supervisor. The pid comes
    /// from `SO_PEERCRED` (the kernel's, in gmsd's pid namespace), so an
    /// engine cannot claim it; the parent is read at each connection, so a
    /// supervisor that died (and whose pid may be reused) is one no more.
    fn is_supervisor(&self, pid: i32) -> bool {
        match self.config.supervisor {
            Supervisor::Nobody => false,
            Supervisor::Parent => {
                let parent = nix::unistd::getppid().as_raw();
                parent > 1 && pid == parent
            }
        }
    }

    /// Checks the peer and the connection limits; starts its thread.
    fn admit(self: &Arc<Self>, stream: UnixStream) -> Option<JoinHandle<()>> {
        let cred = match getsockopt(&stream, PeerCredentials) {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!("SO_PEERCRED: {e}");
                return None;
            }
        };
        let (pid, uid, gid) = (cred.pid(), cred.uid(), cred.gid());
        if !self.allowed(uid, gid) {
            let err = Error::PeerNotAllowed { pid, uid, gid };
            tracing::warn!("{err}");
            refuse(&stream, &err);
            return None;
        }
        let supervisor = self.is_supervisor(pid);
        // Answers go out within the frame timeout or the connection ends: a
        // peer that never reads cannot park a thread in sendmsg.
        if let Err(e) = stream.set_write_timeout(Some(self.config.timeouts.frame)) {
            tracing::warn!("SO_SNDTIMEO on connection from pid {pid}: {e}");
            return None;
        }
        let second = match stream.try_clone() {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("dup of connection socket from pid {pid}: {e}");
                return None;
            }
        };
        let id = {
            let mut st = self.lock();
            let limits = &self.config.limits;
            let from_peer = st.connections.values().filter(|c| c.pid == pid).count();
            // The supervisor is not counted against the total, so engines
            // that fill it cannot lock the shim out of status and reset.
            let refusal = if from_peer >= limits.max_connections_per_peer {
                Some(format!(
                    "pid {pid} holds {from_peer} connections, limit per peer is {}",
                    limits.max_connections_per_peer
                ))
            } else if !supervisor && st.connections.len() >= limits.max_connections {
                Some(format!(
                    "{} connections open, limit is {}",
                    st.connections.len(),
                    limits.max_connections
                ))
            } else {
                None
            };
            if let Some(why) = refusal {
                drop(st);
                let err = Error::LimitExceeded(why);
                tracing::warn!(pid, uid, "refused: {err}");
                refuse(&stream, &err);
                return None;
            }
            st.next_conn += 1;
            let id = st.next_conn;
            st.connections.insert(
                id,
                Connection {
                    pid,
                    uid,
                    gid,
                    client: String::new(),
                    lease: None,
                    said_hello: false,
                    supervisor,
                    stream: second,
                },
            );
            id
        };
        let daemon = Arc::clone(self);
        let spawned = std::thread::Builder::new()
            .name(format!("gms-conn-{id}"))
            .spawn(move || daemon.converse(id, stream));
        match spawned {
            Ok(t) => Some(t),
            Err(e) => {
                tracing::error!("cannot start a thread for connection {id}: {e}");
                self.end(id);
                None
            }
        }
    }

    /// One connection, from first message to close.
    fn converse(&self, id: u64, stream: UnixStream) {
        let _session = Session { daemon: self, id };
        loop {
            let wait = self.next_wait(id);
            match readable_within(&stream, &wait) {
                Ok(true) => {}
                Ok(false) => {
                    let Wait::Within(limit, what) = wait else {
                        return;
                    };
                    let err = Error::Timeout(format!("{what} within {limit:?}"));
                    tracing::warn!(connection = id, "closing: {err}");
                    refuse(&stream, &err);
                    return;
                }
                Err(e) => {
                    tracing::warn!(connection = id, "closing: {e}");
                    return;
                }
            }
            // The first byte is here; the rest of the frame must follow
            // within the frame timeout (a slow peer cannot hold a thread).
            if let Err(e) = stream.set_read_timeout(Some(self.config.timeouts.frame)) {
                tracing::warn!(connection = id, "SO_RCVTIMEO: {e}");
                return;
            }
            let outcome = wire::recv(&stream, MAX_REQUEST_BYTES)
                .map_err(|e| match e {
                    Error::Sys {
                        source: nix::errno::Errno::EAGAIN,
                        ..
                    } => Error::Timeout(format!(
                        "a message started but not finished within {:?}",
                        self.config.timeouts.frame
                    )),
                    other => other,
                })
                .and_then(|frame| protocol::decode(&frame.body, frame.fds.len()))
                .and_then(|req| match req {
                    Request::Allocate { tag, size, va } => self.allocate(id, tag, size, va),
                    other => self.handle(id, other),
                });
            match outcome {
                Ok((resp, fds)) => {
                    let sent = protocol::encode_response(&resp).and_then(|body| {
                        if body.len() > MAX_RESPONSE_BYTES {
                            return Err(Error::LimitExceeded(format!(
                                "the answer to this request would be {} bytes, more than a \
                                 client accepts ({MAX_RESPONSE_BYTES})",
                                body.len()
                            )));
                        }
                        let borrowed: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
                        wire::send(stream.as_fd(), &body, &borrowed)
                    });
                    match sent {
                        Ok(()) => {}
                        Err(err @ Error::LimitExceeded(_)) => {
                            tracing::warn!(connection = id, "closing: {err}");
                            refuse(&stream, &err);
                            return;
                        }
                        Err(e) => {
                            tracing::info!(connection = id, "reply not delivered: {e}");
                            return;
                        }
                    }
                }
                Err(Error::Closed) => return,
                Err(err) => {
                    tracing::info!(connection = id, code = %err.code(), "closing: {err}");
                    refuse(&stream, &err);
                    return;
                }
            }
        }
    }

    /// How long this connection may stay silent now.
    fn next_wait(&self, id: u64) -> Wait {
        let st = self.lock();
        let t = &self.config.timeouts;
        let Some(conn) = st.connections.get(&id) else {
            return Wait::Within(Duration::ZERO, "connection vanished");
        };
        match conn.lease.and_then(|l| st.leases.kind(l)) {
            Some(LeaseKind::Ro) => Wait::Forever,
            Some(LeaseKind::Rw) => Wait::Within(
                t.writer_idle,
                "the uncommitted rw lease was idle too long (its allocations are discarded); \
                 a writer sends a request",
            ),
            None => Wait::Within(t.hello, "a connection without a lease must send a request"),
        }
    }

    /// `allocate`: limits checked and the address range recorded under the
    /// lock; the memory created and populated (which may take seconds for
    /// large sizes) without it, so status and other peers are not held.
    fn allocate(
        &self,
        conn_id: u64,
        tag: String,
        size: u64,
        va: u64,
    ) -> Result<(Response, Vec<OwnedFd>)> {
        let gran = self.backend.granularity();
        let (id, size) = {
            let mut guard = self.lock();
            let st = &mut *guard;
            self.writer_lease(st, conn_id, "allocate")?;
            let size = size
                .checked_next_multiple_of(gran)
                .ok_or_else(|| Error::Invalid(format!("size {size} overflows")))?;
            if va % gran != 0 {
                return Err(Error::Invalid(format!(
                    "address {va:#x} is not a multiple of the granularity {gran}"
                )));
            }
            let limits = &self.config.limits;
            let stores = || [&st.working, &st.committed].into_iter().flatten();
            let allocations: usize = stores().map(|s| s.layout.allocations.len()).sum();
            if allocations >= limits.max_allocations {
                return Err(Error::LimitExceeded(format!(
                    "{allocations} allocations exist, limit is {}",
                    limits.max_allocations
                )));
            }
            // Recorded allocations count whether or not their memory exists
            // yet, so two can never together pass the limit.
            let used: u64 = stores().map(|s| s.layout.bytes()).sum();
            if used.saturating_add(size) > limits.max_bytes {
                return Err(Error::LimitExceeded(format!(
                    "{size} more bytes on top of {used} exceeds the limit of {} bytes",
                    limits.max_bytes
                )));
            }
            let id = st.next_alloc + 1;
            let store = st.working.as_mut().ok_or_else(no_working)?;
            store.layout.insert(Allocation {
                id,
                tag: tag.clone(),
                size,
                va,
            })?;
            st.next_alloc = id;
            (id, size)
        };
        let made = self
            .backend
            .allocate(size, &tag)
            .and_then(|memory| memory.export(Access::ReadWrite).map(|fd| (memory, fd)));
        let mut st = self.lock();
        // Only this connection's thread changes its working store, but a
        // stopping daemon may have dropped it meanwhile.
        let still_ours =
            self.writer_lease(&st, conn_id, "allocate").is_ok() && st.working.is_some();
        let store = st.working.as_mut().filter(|_| still_ours);
        match (made, store) {
            (Ok((memory, fd)), Some(store)) => {
                store.memory.insert(id, memory);
                Ok((Response::Allocated { id, size }, vec![fd]))
            }
            (Ok(_), None) => Err(Error::NotPermitted {
                op: "allocate".into(),
                why: "the lease ended while the memory was being made".into(),
            }),
            (Err(e), store) => {
                if let Some(store) = store {
                    let _ = store.layout.remove(id);
                }
                Err(e)
            }
        }
    }

    /// The connection's lease id, if it is the writer.
    fn writer_lease(&self, st: &State, conn_id: u64, op: &str) -> Result<LeaseId> {
        let conn = st
            .connections
            .get(&conn_id)
            .ok_or_else(|| Error::Backend(format!("connection {conn_id} vanished")))?;
        let lease = conn.lease.ok_or_else(|| Error::NotPermitted {
            op: op.into(),
            why: "no lease: send hello first".into(),
        })?;
        match st.leases.kind(lease) {
            Some(LeaseKind::Rw) => Ok(lease),
            Some(kind) => Err(Error::NotPermitted {
                op: op.into(),
                why: format!("needs the rw lease; this lease is {kind}"),
            }),
            None => Err(Error::NotPermitted {
                op: op.into(),
                why: "lease has ended".into(),
            }),
        }
    }

    /// Ends a connection: releases its lease, discarding a writer's
    /// uncommitted allocations.
    fn end(&self, id: u64) {
        let mut st = self.lock();
        let Some(conn) = st.connections.remove(&id) else {
            return;
        };
        if let Some(lease) = conn.lease {
            if st.leases.release(lease) == Ended::DiscardWorking {
                let discarded = st.working.take();
                let (n, bytes) = discarded
                    .as_ref()
                    .map_or((0, 0), |s| (s.layout.allocations.len(), s.layout.bytes()));
                tracing::info!(
                    lease,
                    pid = conn.pid,
                    allocations = n,
                    bytes,
                    "writer ended before commit; discarded its layout"
                );
            } else {
                tracing::debug!(lease, pid = conn.pid, "lease ended");
            }
        }
    }

    fn handle(&self, conn_id: u64, req: Request) -> Result<(Response, Vec<OwnedFd>)> {
        let mut guard = self.lock();
        let st = &mut *guard;
        let op = req.op();
        let conn = st
            .connections
            .get_mut(&conn_id)
            .ok_or_else(|| Error::Backend(format!("connection {conn_id} vanished")))?;
        if let Request::Status = req {
            return Ok((
                Response::Status {
                    status: Box::new(self.report(st)),
                },
                vec![],
            ));
        }
        if let Request::Reset = req {
            if !conn.supervisor {
                return Err(Error::NotPermitted {
                    op: op.into(),
                    why: format!(
                        "only gmsd's supervisor may reset; pid {} is not it",
                        conn.pid
                    ),
                });
            }
            if conn.lease.is_some() {
                return Err(Error::NotPermitted {
                    op: op.into(),
                    why: "reset is sent without a lease".into(),
                });
            }
            st.leases.reset()?;
            let dropped = st.committed.take();
            let generation = dropped.as_ref().map_or(0, |s| s.layout.generation);
            tracing::info!(
                generation,
                pid = conn.pid,
                "reset by the supervisor: committed layout dropped"
            );
            return Ok((Response::ResetDone { generation }, vec![]));
        }
        if let Request::Hello { mode, client } = req {
            if conn.said_hello {
                return Err(Error::NotPermitted {
                    op: op.into(),
                    why: "hello was already sent on this connection".into(),
                });
            }
            conn.said_hello = true;
            let (lease, kind) = st.leases.acquire(mode)?;
            conn.lease = Some(lease);
            conn.client = client;
            tracing::info!(lease, kind = %kind, pid = conn.pid, client = %conn.client, "lease granted");
            if kind == LeaseKind::Rw {
                st.working = Some(Store::default());
            }
            return Ok((
                Response::Welcome {
                    lease: kind,
                    lease_id: lease,
                    backend: self.backend.name().into(),
                    device: self.backend.device(),
                    granularity: self.backend.granularity(),
                    committed: st.leases.committed(),
                },
                vec![],
            ));
        }
        let lease = conn.lease.ok_or_else(|| Error::NotPermitted {
            op: op.into(),
            why: "no lease: send hello first".into(),
        })?;
        let kind = st.leases.kind(lease).ok_or_else(|| Error::NotPermitted {
            op: op.into(),
            why: "lease has ended".into(),
        })?;
        let writer_only = || Error::NotPermitted {
            op: op.into(),
            why: format!("needs the rw lease; this lease is {kind}"),
        };
        let no_store = || Error::NoLayout(format!("nothing to read for '{op}'"));
        match req {
            Request::Free { id } => {
                if kind != LeaseKind::Rw {
                    return Err(writer_only());
                }
                let store = st.working.as_mut().ok_or_else(no_store)?;
                store.layout.remove(id)?;
                store.memory.remove(&id);
                Ok((Response::Freed { id }, vec![]))
            }
            Request::PutMeta { key, value } => {
                if kind != LeaseKind::Rw {
                    return Err(writer_only());
                }
                let limits = MetadataLimits {
                    max_entries: self.config.limits.max_metadata_entries,
                    max_bytes: self.config.limits.max_metadata_bytes,
                };
                let store = st.working.as_mut().ok_or_else(no_store)?;
                store
                    .layout
                    .put_meta(key.clone(), value, &limits, &mut store.metadata_encoded)?;
                Ok((Response::MetaStored { key }, vec![]))
            }
            Request::GetMeta { key } => {
                let store = self.store_for(st, kind).ok_or_else(no_store)?;
                let value = store.layout.metadata.get(&key).cloned();
                Ok((Response::Meta { key, value }, vec![]))
            }
            Request::GetLayout => {
                let store = self.store_for(st, kind).ok_or_else(no_store)?;
                Ok((
                    Response::Layout {
                        layout: store.layout.clone(),
                    },
                    vec![],
                ))
            }
            Request::Export { ids } => {
                let store = self.store_for(st, kind).ok_or_else(no_store)?;
                let access = match kind {
                    LeaseKind::Rw => Access::ReadWrite,
                    LeaseKind::Ro => Access::ReadOnly,
                };
                let mut fds = Vec::with_capacity(ids.len());
                for id in &ids {
                    let memory = store.memory.get(id).ok_or(Error::UnknownAllocation(*id))?;
                    fds.push(memory.export(access)?);
                }
                Ok((Response::Exported { ids }, fds))
            }
            Request::Commit => {
                if kind != LeaseKind::Rw {
                    return Err(writer_only());
                }
                let store = st.working.as_mut().ok_or_else(no_store)?;
                if let Some(a) = store
                    .layout
                    .allocations
                    .iter()
                    .find(|a| !store.memory.contains_key(&a.id))
                {
                    return Err(Error::Backend(format!(
                        "allocation {} has no memory yet; commit after every allocate answered",
                        a.id
                    )));
                }
                for (id, memory) in store.memory.iter_mut() {
                    memory.seal().map_err(|e| match e {
                        Error::NotPermitted { op, why } => Error::NotPermitted {
                            op,
                            why: format!("allocation {id}: {why}"),
                        },
                        other => other,
                    })?;
                }
                st.generation += 1;
                let mut store = st.working.take().ok_or_else(no_store)?;
                store.layout.generation = st.generation;
                let (allocations, bytes) = (store.layout.allocations.len(), store.layout.bytes());
                // Replaces any previous committed layout: rw was exclusive,
                // so no reader can be using it through this daemon.
                st.committed = Some(store);
                st.leases.commit(lease)?;
                tracing::info!(
                    lease,
                    generation = st.generation,
                    allocations,
                    bytes,
                    "layout committed"
                );
                Ok((
                    Response::Committed {
                        generation: st.generation,
                        allocations,
                        bytes,
                    },
                    vec![],
                ))
            }
            Request::Allocate { .. } | Request::Hello { .. } | Request::Status | Request::Reset => {
                Err(Error::Backend(format!(
                    "'{op}' reached the lease dispatcher"
                )))
            }
        }
    }

    fn store_for<'s>(&self, st: &'s State, kind: LeaseKind) -> Option<&'s Store> {
        match kind {
            LeaseKind::Rw => st.working.as_ref(),
            LeaseKind::Ro => st.committed.as_ref(),
        }
    }

    fn report(&self, st: &State) -> StatusReport {
        let summary = |s: &Store| LayoutSummary {
            generation: s.layout.generation,
            allocations: s.layout.allocations.clone(),
            bytes: s.layout.bytes(),
            metadata_entries: s.layout.metadata.len(),
        };
        let stores = || [&st.working, &st.committed].into_iter().flatten();
        let resident_bytes = stores()
            .flat_map(|s| s.memory.values())
            .map(|m| m.resident_bytes().unwrap_or(0))
            .sum();
        let state = match (st.working.is_some(), st.committed.is_some()) {
            (false, false) => "empty",
            (true, false) => "loading",
            (false, true) => "committed",
            (true, true) => "replacing",
        };
        let l = &self.config.limits;
        StatusReport {
            pid: std::process::id(),
            backend: self.backend.name().into(),
            device: self.backend.device(),
            socket: self.socket.display().to_string(),
            state: state.into(),
            connections: st.connections.len(),
            leases: st
                .connections
                .values()
                .filter_map(|c| {
                    let id = c.lease?;
                    Some(LeaseInfo {
                        id,
                        kind: st.leases.kind(id)?,
                        pid: c.pid,
                        uid: c.uid,
                        gid: c.gid,
                        client: c.client.clone(),
                    })
                })
                .collect(),
            working: st.working.as_ref().map(summary),
            committed: st.committed.as_ref().map(summary),
            bytes: stores().map(|s| s.layout.bytes()).sum(),
            resident_bytes,
            allocations: stores().map(|s| s.layout.allocations.len()).sum(),
            limits: LimitsReport {
                max_bytes: l.max_bytes,
                max_allocations: l.max_allocations,
                max_metadata_entries: l.max_metadata_entries,
                max_metadata_bytes: l.max_metadata_bytes,
                max_connections: l.max_connections,
            },
        }
    }
}
