//! The engine side: connect with a lease mode, allocate and fill (writer),
//! commit, import the committed layout at the writer's addresses (reader),
//! sleep/wake mappings, and a KV-cache range with no backing until woken.
//!
//! Ownership: the `Client` owns the connection (= the lease; dropping it
//! ends the lease). Each [`Weights`] owns its descriptor and its range, so a
//! mapping stays valid and is unmapped exactly once, whatever happens to the
//! connection.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use shadow_contract::paths;

pub use crate::kv::{KvCache, KvWatch};
use crate::layout::{Allocation, Layout};
use crate::mapper::{Access, HostMapper, HostRange, Mapper, Range, RangeState};
use crate::protocol::{
    self, ErrorCode, LeaseKind, Mode, Request, Response, MAX_FDS_PER_MESSAGE, MAX_RESPONSE_BYTES,
};
use crate::status::StatusReport;
use crate::wire;
use crate::{Error, Result};

/// The socket of a host-backend daemon in `dir` (`GMS_SOCKET_DIR`). The
/// names are the engine contract's (`shadow_contract::paths`).
pub fn host_socket(dir: &Path) -> PathBuf {
    dir.join(paths::GMS_HOST_SOCKET)
}

/// File name of a CUDA daemon's socket in `GMS_SOCKET_DIR`:
/// `gms-<GPU-UUID>.sock`.
pub fn cuda_socket_name(uuid: &str) -> String {
    paths::gms_socket_name(uuid)
}

/// What the daemon granted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Welcome {
    pub lease: LeaseKind,
    pub lease_id: u64,
    pub backend: String,
    pub device: String,
    pub granularity: u64,
    pub committed: bool,
}

/// One allocation mapped into this engine.
pub struct Weights<R: Range = HostRange> {
    allocation: Allocation,
    access: Access,
    // Field order: the range is unmapped before the descriptor closes.
    range: R,
    fd: OwnedFd,
}

impl<R: Range> Weights<R> {
    pub fn allocation(&self) -> &Allocation {
        &self.allocation
    }

    pub fn addr(&self) -> u64 {
        self.range.addr()
    }

    pub fn range(&self) -> &R {
        &self.range
    }

    pub fn is_awake(&self) -> bool {
        matches!(self.range.state(), RangeState::Mapped(_))
    }

    /// Unmaps, keeping the addresses reserved (a parked engine).
    pub fn sleep(&mut self) -> Result<()> {
        self.range.unmap()
    }

    /// Maps the same memory at the same addresses again.
    pub fn wake(&mut self) -> Result<()> {
        self.range.map(self.fd.as_fd(), self.access)
    }
}

impl Weights<HostRange> {
    pub fn bytes(&self) -> Option<&[u8]> {
        self.range.bytes()
    }

    pub fn bytes_mut(&mut self) -> Option<&mut [u8]> {
        self.range.bytes_mut()
    }
}

/// The committed layout, mapped read-only at the writer's addresses.
pub struct Imported<R: Range = HostRange> {
    pub layout: Layout,
    pub weights: Vec<Weights<R>>,
}

pub struct Client<M: Mapper = HostMapper> {
    sock: UnixStream,
    mapper: M,
    welcome: Welcome,
}

impl Client<HostMapper> {
    pub fn connect(socket: &Path, mode: Mode, name: &str) -> Result<Self> {
        Self::connect_with(HostMapper::default(), socket, mode, name)
    }

    /// Connects, retrying while the daemon is not up yet or the lease is
    /// busy (another engine is loading), until `timeout` has passed.
    pub fn connect_wait(socket: &Path, mode: Mode, name: &str, timeout: Duration) -> Result<Self> {
        Self::connect_with_wait(HostMapper::default(), socket, mode, name, timeout)
    }
}

impl<M: Mapper + Clone> Client<M> {
    /// [`Client::connect_wait`] with another mapper (the CUDA one).
    pub fn connect_with_wait(
        mapper: M,
        socket: &Path,
        mode: Mode,
        name: &str,
        timeout: Duration,
    ) -> Result<Self> {
        let deadline = Instant::now() + timeout;
        let mut pause = Duration::from_millis(2);
        loop {
            match Self::connect_with(mapper.clone(), socket, mode, name) {
                Ok(c) => return Ok(c),
                Err(e) if Instant::now() < deadline && retryable(&e) => {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_millis(50));
                }
                Err(e) => return Err(e),
            }
        }
    }
}

/// Errors worth another try while an engine waits for its daemon.
pub(crate) fn retryable(e: &Error) -> bool {
    match e {
        Error::Remote { code, .. } => *code == ErrorCode::LeaseBusy,
        Error::Io { source, .. } => matches!(
            source.kind(),
            std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
        ),
        _ => false,
    }
}

pub(crate) fn open(socket: &Path) -> Result<UnixStream> {
    UnixStream::connect(socket)
        .map_err(|e| Error::io(format!("connecting to gmsd at {}", socket.display()), e))
}

pub(crate) fn call_on(sock: &UnixStream, req: &Request) -> Result<(Response, Vec<OwnedFd>)> {
    call_with(sock, req, &[])
}

/// [`call_on`], with descriptors sent along (`req.fd_count()` of them).
pub(crate) fn call_with(
    sock: &UnixStream,
    req: &Request,
    fds: &[std::os::fd::BorrowedFd<'_>],
) -> Result<(Response, Vec<OwnedFd>)> {
    send_request(sock, req, fds)?;
    receive_response(sock)
}

/// Sends `req` with `fds`; a daemon that refused and closed before reading
/// it makes this its refusal, not the broken pipe.
pub(crate) fn send_request(
    sock: &UnixStream,
    req: &Request,
    fds: &[std::os::fd::BorrowedFd<'_>],
) -> Result<()> {
    let body = protocol::encode_request(req)?;
    if let Err(sent) = wire::send(sock.as_fd(), &body, fds) {
        // gmsd answers a refused peer (not allowed, too many connections)
        // and closes before reading anything, so our request may meet a
        // closed socket. Its answer is still queued on our side: that,
        // not the broken pipe, is what the caller must see.
        if !peer_closed(&sent) {
            return Err(sent);
        }
        return match wire::recv(sock, MAX_RESPONSE_BYTES) {
            Ok(frame) => match protocol::decode_response(&frame.body, frame.fds.len())? {
                Response::Error { code, message } => Err(Error::Remote { code, message }),
                _ => Err(sent),
            },
            Err(_) => Err(sent),
        };
    }
    Ok(())
}

/// The answer to the request sent last, with its descriptors; an `error`
/// answer is the error it says.
pub(crate) fn receive_response(sock: &UnixStream) -> Result<(Response, Vec<OwnedFd>)> {
    let frame = wire::recv(sock, MAX_RESPONSE_BYTES)?;
    match protocol::decode_response(&frame.body, frame.fds.len())? {
        Response::Error { code, message } => Err(Error::Remote { code, message }),
        resp => Ok((resp, frame.fds)),
    }
}

/// A send that failed because the daemon had already closed its end.
fn peer_closed(e: &Error) -> bool {
    matches!(
        e,
        Error::Sys {
            source: nix::errno::Errno::EPIPE | nix::errno::Errno::ECONNRESET,
            ..
        }
    )
}

pub(crate) fn unexpected(req: &Request, resp: &Response) -> Error {
    Error::UnexpectedResponse {
        request: req.op().into(),
        got: resp.op().into(),
    }
}

/// One inspection round trip; takes no lease. Waits as long as the daemon
/// takes: see [`status_within`].
pub fn status(socket: &Path) -> Result<StatusReport> {
    status_on(open(socket)?)
}

/// [`status`], each send and receive bounded by `timeout`: for a caller
/// that must not hang on whatever listens at `socket` (the shim's poller).
pub fn status_within(socket: &Path, timeout: Duration) -> Result<StatusReport> {
    status_on(open_within(socket, timeout)?)
}

/// A connection whose connect, sends and receives each give up after
/// `timeout` (a listener that never accepts blocks a plain connect once
/// its backlog is full).
fn open_within(socket: &Path, timeout: Duration) -> Result<UnixStream> {
    use nix::sys::socket::{self, sockopt, AddressFamily, SockFlag, SockType, UnixAddr};
    let what = || format!("connecting to gmsd at {}", socket.display());
    let fd = socket::socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(|e| Error::sys(what(), e))?;
    let tv = nix::sys::time::TimeVal::new(
        timeout.as_secs().try_into().unwrap_or(i64::MAX),
        timeout.subsec_micros().into(),
    );
    socket::setsockopt(&fd, sockopt::SendTimeout, &tv).map_err(|e| Error::sys(what(), e))?;
    socket::setsockopt(&fd, sockopt::ReceiveTimeout, &tv).map_err(|e| Error::sys(what(), e))?;
    let addr = UnixAddr::new(socket).map_err(|e| Error::sys(what(), e))?;
    socket::connect(fd.as_raw_fd(), &addr).map_err(|e| Error::sys(what(), e))?;
    Ok(UnixStream::from(fd))
}

fn status_on(sock: UnixStream) -> Result<StatusReport> {
    let req = Request::Status;
    match call_on(&sock, &req)? {
        (Response::Status { status }, _) => Ok(*status),
        (other, _) => Err(unexpected(&req, &other)),
    }
}

/// The supervisor's reset (the shim, or whoever started gmsd): forgets the
/// committed layout so that the next engine loads again. gmsd refuses it
/// from any other process, and while any lease is attached. Returns the
/// generation that was dropped (0: nothing was committed).
pub fn reset(socket: &Path) -> Result<u64> {
    let sock = open(socket)?;
    let req = Request::Reset;
    match call_on(&sock, &req)? {
        (Response::ResetDone { generation }, _) => Ok(generation),
        (other, _) => Err(unexpected(&req, &other)),
    }
}

impl<M: Mapper> Client<M> {
    pub fn connect_with(mapper: M, socket: &Path, mode: Mode, name: &str) -> Result<Self> {
        let sock = open(socket)?;
        let req = Request::Hello {
            mode,
            client: name.into(),
        };
        let welcome = match call_on(&sock, &req)? {
            (
                Response::Welcome {
                    lease,
                    lease_id,
                    backend,
                    device,
                    granularity,
                    committed,
                },
                _,
            ) => Welcome {
                lease,
                lease_id,
                backend,
                device,
                granularity,
                committed,
            },
            (other, _) => return Err(unexpected(&req, &other)),
        };
        if welcome.granularity == 0 || !welcome.granularity.is_power_of_two() {
            return Err(Error::Malformed(format!(
                "daemon granularity {} is not a power of two",
                welcome.granularity
            )));
        }
        Ok(Client {
            sock,
            mapper,
            welcome,
        })
    }

    pub fn welcome(&self) -> &Welcome {
        &self.welcome
    }

    pub fn lease(&self) -> LeaseKind {
        self.welcome.lease
    }

    fn call(&self, req: &Request) -> Result<(Response, Vec<OwnedFd>)> {
        call_on(&self.sock, req)
    }

    /// Writer: a new allocation of at least `size` bytes, mapped read-write
    /// at an address this process reserved (recorded for readers).
    pub fn allocate(&mut self, tag: &str, size: u64) -> Result<Weights<M::Range>> {
        let gran = self.welcome.granularity;
        let rounded = size
            .checked_next_multiple_of(gran)
            .ok_or_else(|| Error::Invalid(format!("size {size} overflows")))?;
        let mut range = self.mapper.reserve(rounded, None)?;
        let req = Request::Allocate {
            tag: tag.into(),
            size: rounded,
            va: range.addr(),
        };
        let (id, size, fd) = match self.call(&req)? {
            (Response::Allocated { id, size }, mut fds) => match fds.pop() {
                Some(fd) => (id, size, fd),
                None => return Err(unexpected(&req, &Response::Allocated { id, size })),
            },
            (other, _) => return Err(unexpected(&req, &other)),
        };
        if size != rounded {
            return Err(Error::Malformed(format!(
                "asked for {rounded} bytes, daemon allocated {size}"
            )));
        }
        range.map(fd.as_fd(), Access::ReadWrite)?;
        Ok(Weights {
            allocation: Allocation {
                id,
                tag: tag.into(),
                size,
                va: range.addr(),
            },
            access: Access::ReadWrite,
            range,
            fd,
        })
    }

    /// Writer: returns an uncommitted allocation to the daemon.
    pub fn free(&mut self, weights: Weights<M::Range>) -> Result<()> {
        let id = weights.allocation.id;
        drop(weights);
        match self.call(&Request::Free { id })? {
            (Response::Freed { .. }, _) => Ok(()),
            (other, _) => Err(unexpected(&Request::Free { id }, &other)),
        }
    }

    pub fn put_meta(&mut self, key: &str, value: &str) -> Result<()> {
        let req = Request::PutMeta {
            key: key.into(),
            value: value.into(),
        };
        match self.call(&req)? {
            (Response::MetaStored { .. }, _) => Ok(()),
            (other, _) => Err(unexpected(&req, &other)),
        }
    }

    pub fn get_meta(&self, key: &str) -> Result<Option<String>> {
        let req = Request::GetMeta { key: key.into() };
        match self.call(&req)? {
            (Response::Meta { value, .. }, _) => Ok(value),
            (other, _) => Err(unexpected(&req, &other)),
        }
    }

    /// The layout this lease sees: the writer's working one, or the
    /// committed one for a reader.
    pub fn layout(&self) -> Result<Layout> {
        match self.call(&Request::GetLayout)? {
            (Response::Layout { layout }, _) => Ok(layout),
            (other, _) => Err(unexpected(&Request::GetLayout, &other)),
        }
    }

    /// Descriptors for `ids`, batched under the per-message limit.
    fn export(&self, ids: &[u64]) -> Result<Vec<OwnedFd>> {
        let mut out = Vec::with_capacity(ids.len());
        for chunk in ids.chunks(MAX_FDS_PER_MESSAGE) {
            let req = Request::Export {
                ids: chunk.to_vec(),
            };
            match self.call(&req)? {
                (Response::Exported { ids }, fds) if ids == chunk => out.extend(fds),
                (other, _) => return Err(unexpected(&req, &other)),
            }
        }
        Ok(out)
    }

    /// Writer: freezes the layout. Every allocation of this writer must be in
    /// `weights` (the kernel refuses to seal memory mapped writable): each is
    /// unmapped, the daemon seals, and each is mapped again read-only at the
    /// same address. The lease continues as `ro`. Returns the generation.
    pub fn commit(&mut self, weights: &mut [Weights<M::Range>]) -> Result<u64> {
        for w in weights.iter_mut() {
            w.range.unmap()?;
        }
        let generation = match self.call(&Request::Commit)? {
            (Response::Committed { generation, .. }, _) => generation,
            (other, _) => return Err(unexpected(&Request::Commit, &other)),
        };
        self.welcome.lease = LeaseKind::Ro;
        self.welcome.committed = true;
        let ids: Vec<u64> = weights.iter().map(|w| w.allocation.id).collect();
        let fds = self.export(&ids)?;
        for (w, fd) in weights.iter_mut().zip(fds) {
            w.fd = fd;
            w.access = Access::ReadOnly;
            w.range.map(w.fd.as_fd(), Access::ReadOnly)?;
        }
        Ok(generation)
    }

    /// Reader: the committed layout, every allocation mapped read-only at
    /// the address the writer used. Fails with `AddressConflict` if this
    /// process already uses any of those addresses.
    pub fn import(&self) -> Result<Imported<M::Range>> {
        let layout = self.layout()?;
        let ids: Vec<u64> = layout.allocations.iter().map(|a| a.id).collect();
        let fds = self.export(&ids)?;
        let mut weights = Vec::with_capacity(fds.len());
        for (alloc, fd) in layout.allocations.iter().zip(fds) {
            let mut range = self.mapper.reserve(alloc.size, Some(alloc.va))?;
            range.map(fd.as_fd(), Access::ReadOnly)?;
            weights.push(Weights {
                allocation: alloc.clone(),
                access: Access::ReadOnly,
                range,
                fd,
            });
        }
        Ok(Imported { layout, weights })
    }

    /// A KV-cache range of `len` bytes (rounded up to the granularity) with
    /// no memory behind it yet.
    pub fn reserve_kv(&self, len: u64) -> Result<KvCache<M::Range>> {
        let len = len
            .checked_next_multiple_of(self.welcome.granularity)
            .ok_or_else(|| Error::Invalid(format!("KV size {len} overflows")))?;
        KvCache::new(self.mapper.reserve(len, None)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn socket_names_follow_the_contract() {
        assert_eq!(
            host_socket(Path::new("/run/shadow/gms")),
            Path::new("/run/shadow/gms/gms-host.sock")
        );
        assert_eq!(
            cuda_socket_name("GPU-5a2b1c3d-0e1f-2a3b-4c5d-6e7f8a9b0c1d"),
            "gms-GPU-5a2b1c3d-0e1f-2a3b-4c5d-6e7f8a9b0c1d.sock"
        );
    }

    #[test]
    fn busy_and_absent_daemons_are_retried_other_errors_are_not() {
        let busy = Error::Remote {
            code: ErrorCode::LeaseBusy,
            message: String::new(),
        };
        assert!(retryable(&busy));
        let absent = Error::io("x", std::io::ErrorKind::NotFound.into());
        assert!(retryable(&absent));
        assert!(!retryable(&Error::NoLayout("none".into())));
    }
    use crate::protocol::ErrorCode;

    /// gmsd refuses a peer by answering and closing at once; a client whose
    /// request then meets the closed socket (EPIPE) must still report the
    /// daemon's answer.
    #[test]
    fn a_refusal_sent_before_our_request_is_what_we_report() {
        let (client, daemon) = UnixStream::pair().expect("socketpair");
        let refusal = Response::error(&Error::PeerNotAllowed {
            pid: 1,
            uid: 4242,
            gid: 4242,
        });
        let body = protocol::encode_response(&refusal).expect("encode");
        wire::send(daemon.as_fd(), &body, &[]).expect("send refusal");
        drop(daemon);
        let err = call_on(&client, &Request::Status).expect_err("refused");
        assert!(
            matches!(
                err,
                Error::Remote {
                    code: ErrorCode::PermissionDenied,
                    ..
                }
            ),
            "{err}"
        );
    }

    /// A daemon that closes without a word leaves the transport error.
    #[test]
    fn a_silent_close_is_a_transport_error() {
        let (client, daemon) = UnixStream::pair().expect("socketpair");
        drop(daemon);
        let err = call_on(&client, &Request::Status).expect_err("closed");
        assert!(peer_closed(&err), "{err}");
    }

    /// Whatever listens where gmsd should (a server that accepts and never
    /// answers, one that never accepts) costs a status caller its timeout,
    /// not its thread.
    #[test]
    fn status_within_gives_up_on_a_silent_listener() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("gms-host.sock");
        let listener = std::os::unix::net::UnixListener::bind(&path).expect("bind");
        let t = Duration::from_millis(50);
        let err = status_within(&path, t).expect_err("no answer");
        assert!(
            matches!(
                err,
                Error::Sys {
                    source: nix::errno::Errno::EAGAIN,
                    ..
                }
            ),
            "{err}"
        );
        drop(listener);
    }
}
