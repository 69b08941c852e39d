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

use std::collections::BTreeMap;
use std::fs;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};

use gms::layout::{Allocation, Layout, MetadataLimits};
use gms::protocol::{self, LeaseKind, Request, Response, MAX_REQUEST_BYTES};
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
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_bytes: 64 << 30,
            max_allocations: 4096,
            max_metadata_entries: 65536,
            max_metadata_bytes: 8 << 20,
            max_connections: 256,
        }
    }
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
}

/// Allocations with their memory, plus the layout that describes them.
#[derive(Default)]
struct Store {
    layout: Layout,
    memory: BTreeMap<u64, Box<dyn Memory>>,
}

struct Connection {
    pid: i32,
    uid: u32,
    gid: u32,
    client: String,
    lease: Option<LeaseId>,
    said_hello: bool,
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
    loop {
        let mut fds = [
            PollFd::new(listener.as_fd(), PollFlags::POLLIN),
            PollFd::new(signals.as_fd(), PollFlags::POLLIN),
        ];
        match poll(&mut fds, PollTimeout::NONE) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(Error::sys("poll on listener and signalfd", e)),
        }
        let signalled = fds[1].revents().is_some_and(|r| !r.is_empty());
        let incoming = fds[0].revents().is_some_and(|r| !r.is_empty());
        if signalled {
            if let Ok(Some(info)) = signals.read_signal() {
                tracing::info!(signal = info.ssi_signo, "stopping");
            }
            break;
        }
        if incoming {
            match listener.accept() {
                Ok((stream, _)) => {
                    if let Some(t) = daemon.admit(stream) {
                        threads.push(t);
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => tracing::warn!("accept on {}: {e}", socket.display()),
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

    /// Checks the peer and the connection limit; starts its thread.
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
        let second = match stream.try_clone() {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("dup of connection socket from pid {pid}: {e}");
                return None;
            }
        };
        let id = {
            let mut st = self.lock();
            if st.connections.len() >= self.config.limits.max_connections {
                drop(st);
                let err = Error::LimitExceeded(format!(
                    "{} connections open, limit is {}",
                    self.config.limits.max_connections, self.config.limits.max_connections
                ));
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
            let outcome = wire::recv(&stream, MAX_REQUEST_BYTES)
                .and_then(|frame| protocol::decode(&frame.body, frame.fds.len()))
                .and_then(|req| self.handle(id, req));
            match outcome {
                Ok((resp, fds)) => {
                    let sent = protocol::encode_response(&resp).and_then(|body| {
                        let borrowed: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
                        wire::send(stream.as_fd(), &body, &borrowed)
                    });
                    if let Err(e) = sent {
                        tracing::info!(connection = id, "reply not delivered: {e}");
                        return;
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
        let total_bytes = |st: &State| -> u64 {
            [&st.working, &st.committed]
                .iter()
                .flat_map(|s| s.iter())
                .map(|s| s.layout.bytes())
                .sum()
        };
        let total_allocs = |st: &State| -> usize {
            [&st.working, &st.committed]
                .iter()
                .flat_map(|s| s.iter())
                .map(|s| s.layout.allocations.len())
                .sum()
        };
        match req {
            Request::Allocate { tag, size, va } => {
                if kind != LeaseKind::Rw {
                    return Err(writer_only());
                }
                let gran = self.backend.granularity();
                let size = size
                    .checked_next_multiple_of(gran)
                    .ok_or_else(|| Error::Invalid(format!("size {size} overflows")))?;
                if va % gran != 0 {
                    return Err(Error::Invalid(format!(
                        "address {va:#x} is not a multiple of the granularity {gran}"
                    )));
                }
                let limits = &self.config.limits;
                if total_allocs(st) >= limits.max_allocations {
                    return Err(Error::LimitExceeded(format!(
                        "{} allocations exist, limit is {}",
                        total_allocs(st),
                        limits.max_allocations
                    )));
                }
                let used = total_bytes(st);
                if used.saturating_add(size) > limits.max_bytes {
                    return Err(Error::LimitExceeded(format!(
                        "{size} more bytes on top of {used} exceeds the limit of {} bytes",
                        limits.max_bytes
                    )));
                }
                let id = st.next_alloc + 1;
                let store = st.working.as_mut().ok_or_else(no_store)?;
                store.layout.insert(Allocation {
                    id,
                    tag: tag.clone(),
                    size,
                    va,
                })?;
                let memory = match self.backend.allocate(size, &tag) {
                    Ok(m) => m,
                    Err(e) => {
                        let _ = store.layout.remove(id);
                        return Err(e);
                    }
                };
                let fd = memory.export(Access::ReadWrite)?;
                store.memory.insert(id, memory);
                st.next_alloc = id;
                Ok((Response::Allocated { id, size }, vec![fd]))
            }
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
                store.layout.put_meta(key.clone(), value, &limits)?;
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
            Request::Hello { .. } | Request::Status => Err(Error::Backend(format!(
                "'{op}' reached the lease dispatcher"
            ))),
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
