//! Who may connect, checked once per connection before its thread starts:
//! the peer's credentials as the kernel reports them (`SO_PEERCRED`)
//! against `--allow-uid`/`--allow-gid`, whether the peer is gmsd's
//! supervisor, and the per-peer and total connection limits. A refused peer
//! gets one `error` message and is closed. Kept apart from the connection
//! thread because none of this is the protocol: it is the daemon deciding
//! whether to speak at all.

use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::thread::JoinHandle;

use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};

use gms::{Error, Result};

use super::connection::refuse;
use super::{Connection, Daemon, Supervisor};

impl Daemon {
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
    pub(super) fn admit(self: &Arc<Self>, stream: UnixStream) -> Option<JoinHandle<()>> {
        let cred = match getsockopt(&stream, PeerCredentials) {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!("SO_PEERCRED: {e}");
                return None;
            }
        };
        let peer = Peer {
            pid: cred.pid(),
            uid: cred.uid(),
            gid: cred.gid(),
        };
        if !self.allowed(peer.uid, peer.gid) {
            let err = Error::PeerNotAllowed {
                pid: peer.pid,
                uid: peer.uid,
                gid: peer.gid,
            };
            tracing::warn!("{err}");
            refuse(&stream, &err);
            return None;
        }
        let supervisor = self.is_supervisor(peer.pid);
        let second = self.prepare(&stream, peer.pid)?;
        let id = match self.register(&peer, supervisor, second) {
            Ok(id) => id,
            Err(err) => {
                tracing::warn!(pid = peer.pid, uid = peer.uid, "refused: {err}");
                refuse(&stream, &err);
                return None;
            }
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

    /// Sets the send timeout and makes the second handle that shutdown
    /// uses to wake the connection's thread; `None` (logged) if either fails.
    fn prepare(&self, stream: &UnixStream, pid: i32) -> Option<UnixStream> {
        // Answers go out within the frame timeout or the connection ends: a
        // peer that never reads cannot park a thread in sendmsg.
        if let Err(e) = stream.set_write_timeout(Some(self.config.timeouts.frame)) {
            tracing::warn!("SO_SNDTIMEO on connection from pid {pid}: {e}");
            return None;
        }
        match stream.try_clone() {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::warn!("dup of connection socket from pid {pid}: {e}");
                None
            }
        }
    }

    /// Records the connection unless that would pass a connection limit;
    /// returns its id.
    fn register(&self, peer: &Peer, supervisor: bool, stream: UnixStream) -> Result<u64> {
        let mut st = self.lock();
        let limits = &self.config.limits;
        let pid = peer.pid;
        let from_peer = st.connections.values().filter(|c| c.pid == pid).count();
        // The supervisor is not counted against the total, so engines
        // that fill it cannot lock the shim out of status and reset.
        if from_peer >= limits.max_connections_per_peer {
            return Err(Error::LimitExceeded(format!(
                "pid {pid} holds {from_peer} connections, limit per peer is {}",
                limits.max_connections_per_peer
            )));
        }
        if !supervisor && st.connections.len() >= limits.max_connections {
            return Err(Error::LimitExceeded(format!(
                "{} connections open, limit is {}",
                st.connections.len(),
                limits.max_connections
            )));
        }
        st.next_conn += 1;
        let id = st.next_conn;
        st.connections.insert(
            id,
            Connection {
                pid,
                uid: peer.uid,
                gid: peer.gid,
                client: String::new(),
                lease: None,
                said_hello: false,
                supervisor,
                kv_writer: false,
                stream,
            },
        );
        Ok(id)
    }
}

/// A peer's credentials, as `SO_PEERCRED` reports them.
struct Peer {
    pid: i32,
    uid: u32,
    gid: u32,
}
