//! One connection's thread, from its first message to its close: how long
//! the peer may stay silent (by what it holds), reading one frame within the
//! frame timeout, answering, and ending the lease on every path out.
//!
//! It exists so that "the connection is the lease" is one guard in one
//! place: [`Session`] ends the connection (and with it the lease) when the
//! thread leaves, whether the peer closed, died, stalled or broke a rule.
//! What a request does is `requests`' business; this module only moves
//! frames and decides when to stop.

use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

use gms::protocol::{self, LeaseKind, Request, Response, MAX_REQUEST_BYTES, MAX_RESPONSE_BYTES};
use gms::{wire, Error, Result};

use super::Daemon;
use crate::lease::Ended;

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

/// What a connection thread waits for next.
enum Wait {
    /// At most this long for the next request.
    Within(Duration, &'static str),
    /// A reader: its connection is its lease and may stay silent for ever.
    Forever,
}

/// Sends `err` as the connection's last message (best effort: the peer may
/// be gone already).
pub(super) fn refuse(stream: &UnixStream, err: &Error) {
    if let Ok(body) = protocol::encode_response(&Response::error(err)) {
        let _ = wire::send(stream.as_fd(), &body, &[]);
    }
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

impl Daemon {
    /// One connection, from first message to close.
    pub(super) fn converse(&self, id: u64, stream: UnixStream) {
        let _session = Session { daemon: self, id };
        while self.exchange(id, &stream) {}
    }

    /// Waits for one request, handles it and answers; false once the
    /// connection is to close (the peer has been told why, where it can be).
    fn exchange(&self, id: u64, stream: &UnixStream) -> bool {
        if !self.await_request(id, stream) {
            return false;
        }
        let outcome = self
            .receive(stream)
            .and_then(|(req, fds)| self.handle(id, req, fds));
        match outcome {
            Ok((resp, fds)) => self.answer(id, stream, &resp, &fds),
            Err(Error::Closed) => false,
            Err(err) => {
                tracing::info!(connection = id, code = %err.code(), "closing: {err}");
                refuse(stream, &err);
                false
            }
        }
    }

    /// Waits until the first byte of the next request is here, within what
    /// the connection may stay silent; then arms the frame timeout for the
    /// rest. False (the peer told of a timeout) if the connection is to close.
    fn await_request(&self, id: u64, stream: &UnixStream) -> bool {
        let wait = self.next_wait(id);
        match readable_within(stream, &wait) {
            Ok(true) => {}
            Ok(false) => {
                let Wait::Within(limit, what) = wait else {
                    return false;
                };
                let err = Error::Timeout(format!("{what} within {limit:?}"));
                tracing::warn!(connection = id, "closing: {err}");
                refuse(stream, &err);
                return false;
            }
            Err(e) => {
                tracing::warn!(connection = id, "closing: {e}");
                return false;
            }
        }
        // The first byte is here; the rest of the frame must follow
        // within the frame timeout (a slow peer cannot hold a thread).
        if let Err(e) = stream.set_read_timeout(Some(self.config.timeouts.frame)) {
            tracing::warn!(connection = id, "SO_RCVTIMEO: {e}");
            return false;
        }
        true
    }

    /// Reads and decodes one request, with the descriptors it carried; a
    /// frame left half-sent past the frame timeout is a `timeout`.
    fn receive(&self, stream: &UnixStream) -> Result<(Request, Vec<OwnedFd>)> {
        let frame = wire::recv(stream, MAX_REQUEST_BYTES).map_err(|e| match e {
            Error::Sys {
                source: nix::errno::Errno::EAGAIN,
                ..
            } => Error::Timeout(format!(
                "a message started but not finished within {:?}",
                self.config.timeouts.frame
            )),
            other => other,
        })?;
        let req = protocol::decode(&frame.body, frame.fds.len())?;
        Ok((req, frame.fds))
    }

    /// Sends one answer with its descriptors; false if the connection is to
    /// close (an answer larger than a client accepts is refused instead).
    fn answer(&self, id: u64, stream: &UnixStream, resp: &Response, fds: &[OwnedFd]) -> bool {
        let sent = protocol::encode_response(resp).and_then(|body| {
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
            Ok(()) => true,
            Err(err @ Error::LimitExceeded(_)) => {
                tracing::warn!(connection = id, "closing: {err}");
                refuse(stream, &err);
                false
            }
            Err(e) => {
                tracing::info!(connection = id, "reply not delivered: {e}");
                false
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
        if conn.kv_writer {
            // The KV pool's write lease: like a reader, its connection is
            // its lease and may stay silent for ever.
            return Wait::Forever;
        }
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

    /// Ends a connection: releases its lease, discarding a writer's
    /// uncommitted allocations.
    pub(super) fn end(&self, id: u64) {
        let mut st = self.lock();
        let Some(conn) = st.connections.remove(&id) else {
            return;
        };
        if let Some(lease) = conn.lease {
            if st.leases.release(lease) == Ended::DiscardWorking {
                let (n, bytes) = st.discard_working();
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
}
