//! The engine's side of the pair's file-descriptor store
//! (`shadow.dev/fdstore-max`; the protocol's names are
//! [`shadow_contract::fdstore`]'s):
//!
//! - [`store`] and [`remove`]: `FDSTORE=1` / `FDSTOREREMOVE=1` with
//!   `FDNAME=` on `NOTIFY_SOCKET`, as systemd has them (any sd_notify
//!   library sends the same);
//! - [`split_inherited`]: what an engine got at start after its listening
//!   sockets in `LISTEN_FDS` is the store, as systemd hands it to a
//!   restarted service;
//! - [`fetch`]: an engine that takes the election lock is already running,
//!   so it fetches the store from `SHADOW_FDSTORE_SOCKET`, which answers
//!   the lock holder only, once everything the engines sent before is in.

use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::time::Duration;

use nix::sys::socket::{
    connect, recvmsg, sendmsg, socket, AddressFamily, ControlMessage, ControlMessageOwned,
    MsgFlags, SockFlag, SockType, UnixAddr,
};
use shadow_contract::env;
use shadow_contract::fdstore::{name_is_valid, FDS_PER_PACKET, NAME_MAX, PACKET_MAX};

use crate::listen::Inherited;

/// How long [`fetch`] waits for each packet.
pub const FETCH_TIMEOUT: Duration = Duration::from_secs(10);
/// How long [`store`] and [`remove`] wait for room in the notify socket.
pub const SEND_TIMEOUT: Duration = Duration::from_secs(1);

/// Stores `fds` under `name` (`FDSTORE=1`, `FDNAME=`), polled for a
/// hang-up unless `poll` is false (`FDPOLL=0`). Nothing is sent without
/// `NOTIFY_SOCKET`. Waits up to [`SEND_TIMEOUT`] for room in the socket.
pub fn store(fds: &[BorrowedFd<'_>], name: &str, poll: bool) -> io::Result<()> {
    if !name_is_valid(name) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("FDNAME {name:?}: 1 to {NAME_MAX} printable ASCII characters, no ':'"),
        ));
    }
    let mut text = format!("FDSTORE=1\nFDNAME={name}\n");
    if !poll {
        text.push_str("FDPOLL=0\n");
    }
    send(text.as_bytes(), fds)
}

/// Drops every descriptor stored under `name` (`FDSTOREREMOVE=1`).
pub fn remove(name: &str) -> io::Result<()> {
    send(format!("FDSTOREREMOVE=1\nFDNAME={name}\n").as_bytes(), &[])
}

/// The socket [`store`] and [`remove`] send from: made once per process,
/// so that a store right after an `accept` is one `sendmsg` (a connection
/// accepted and not yet stored dies with its engine). `None` without
/// `NOTIFY_SOCKET`.
fn sender() -> io::Result<Option<&'static (UnixDatagram, UnixAddr)>> {
    use std::sync::OnceLock;
    static SENDER: OnceLock<Option<(UnixDatagram, UnixAddr)>> = OnceLock::new();
    if let Some(made) = SENDER.get() {
        return Ok(made.as_ref());
    }
    let made = match std::env::var_os(env::NOTIFY_SOCKET) {
        None => None,
        Some(path) => {
            let sock = UnixDatagram::unbound()?;
            sock.set_write_timeout(Some(SEND_TIMEOUT))?;
            let addr = UnixAddr::new(Path::new(&path)).map_err(io::Error::from)?;
            Some((sock, addr))
        }
    };
    // Another thread may have made one meanwhile: either is as good.
    Ok(SENDER.get_or_init(|| made).as_ref())
}

fn send(text: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    let Some((sock, addr)) = sender()? else {
        return Ok(());
    };
    let raw: Vec<RawFd> = fds.iter().map(AsRawFd::as_raw_fd).collect();
    let rights = [ControlMessage::ScmRights(&raw)];
    let cmsgs: &[ControlMessage<'_>] = if raw.is_empty() { &[] } else { &rights };
    let sent = sendmsg(
        sock.as_raw_fd(),
        &[IoSlice::new(text)],
        cmsgs,
        MsgFlags::MSG_NOSIGNAL,
        Some(addr),
    )
    .map_err(io::Error::from)?;
    if sent != text.len() {
        return Err(io::Error::new(
            io::ErrorKind::WriteZero,
            "short notify send",
        ));
    }
    Ok(())
}

/// One descriptor of the store, as a fetch or an engine's start hands it.
#[derive(Debug)]
pub struct Stored {
    pub name: String,
    pub fd: OwnedFd,
}

/// Why a fetch gave nothing.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error(
        "no {} in the environment: the pair has no fd store",
        env::FDSTORE_SOCKET
    )]
    NoStore,
    #[error("the fd store refused: {0}")]
    Refused(String),
    #[error("fetching the fd store: {0}")]
    Io(#[from] io::Error),
    #[error("the fd store's answer is not the protocol's: {0}")]
    Protocol(String),
}

/// Everything in the store, for the engine that holds the election lock
/// (any other is refused). Call it right after the lock is taken.
pub fn fetch() -> Result<Vec<Stored>, FetchError> {
    let path = std::env::var_os(env::FDSTORE_SOCKET).ok_or(FetchError::NoStore)?;
    fetch_from(Path::new(&path))
}

/// [`fetch`] from the socket at `path`.
pub fn fetch_from(path: &Path) -> Result<Vec<Stored>, FetchError> {
    let sock = socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(io::Error::from)?;
    let addr = UnixAddr::new(path).map_err(io::Error::from)?;
    connect(sock.as_raw_fd(), &addr).map_err(io::Error::from)?;
    let sock = std::os::unix::net::UnixStream::from(sock);
    sock.set_read_timeout(Some(FETCH_TIMEOUT))?;
    let mut out = Vec::new();
    loop {
        let (text, fds) = recv_packet(sock.as_raw_fd())?;
        let text = String::from_utf8(text)
            .map_err(|_| FetchError::Protocol("a packet is not UTF-8".into()))?;
        let line = text.trim_end_matches('\n');
        if let Some(names) = line.strip_prefix("FDNAMES=") {
            let names: Vec<&str> = names.split(':').collect();
            if names.len() != fds.len() {
                return Err(FetchError::Protocol(format!(
                    "{} names for {} descriptors",
                    names.len(),
                    fds.len()
                )));
            }
            out.extend(names.into_iter().zip(fds).map(|(n, fd)| Stored {
                name: n.to_string(),
                fd,
            }));
        } else if let Some(n) = line.strip_prefix("END=") {
            return match n.parse::<usize>() {
                Ok(n) if n == out.len() && fds.is_empty() => Ok(out),
                _ => Err(FetchError::Protocol(format!(
                    "END={n} after {} descriptors",
                    out.len()
                ))),
            };
        } else if let Some(why) = line.strip_prefix("ERROR=") {
            return Err(FetchError::Refused(why.to_string()));
        } else if line.is_empty() && fds.is_empty() {
            return Err(FetchError::Protocol(
                "the store closed before END".to_string(),
            ));
        } else {
            return Err(FetchError::Protocol(format!("unknown packet {line:?}")));
        }
    }
}

/// One packet and the descriptors it carried (owned, close-on-exec).
fn recv_packet(fd: RawFd) -> Result<(Vec<u8>, Vec<OwnedFd>), FetchError> {
    let mut buf = vec![0u8; PACKET_MAX];
    let mut control = nix::cmsg_space!([RawFd; FDS_PER_PACKET]);
    let mut fds = Vec::new();
    let (len, flags) = {
        let mut iov = [IoSliceMut::new(&mut buf)];
        let msg = recvmsg::<()>(fd, &mut iov, Some(&mut control), MsgFlags::MSG_CMSG_CLOEXEC)
            .map_err(io::Error::from)?;
        if let Ok(cmsgs) = msg.cmsgs() {
            for c in cmsgs {
                if let ControlMessageOwned::ScmRights(raw) = c {
                    // SAFETY: recvmsg just installed these descriptors in
                    // this process's table for this call; nothing else
                    // knows them, so each gets its one owner here.
                    fds.extend(raw.into_iter().map(|f| unsafe { OwnedFd::from_raw_fd(f) }));
                }
            }
        }
        (msg.bytes, msg.flags)
    };
    if flags.intersects(MsgFlags::MSG_CTRUNC | MsgFlags::MSG_TRUNC) {
        return Err(FetchError::Protocol(
            "a packet or its descriptors did not fit".into(),
        ));
    }
    buf.truncate(len);
    Ok((buf, fds))
}

/// The descriptors of `inherited` ([`crate::listen::inherited`]) that are
/// not among the `listen` sockets' names: the store, handed at start.
pub fn split_inherited(
    inherited: Vec<Inherited>,
    is_listen_name: impl Fn(&str) -> bool,
) -> (Vec<Inherited>, Vec<Stored>) {
    let mut listen = Vec::new();
    let mut stored = Vec::new();
    for i in inherited {
        if is_listen_name(&i.name) {
            listen.push(i);
        } else {
            stored.push(Stored {
                name: i.name,
                fd: i.fd,
            });
        }
    }
    (listen, stored)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_name_is_refused_before_anything_is_sent() {
        let e = store(&[], "a:b", true).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
    }

    /// A fetch reads the protocol: names with their descriptors, END with
    /// the count; an ERROR or a wrong count is an error.
    #[test]
    fn a_fetch_reads_packets_until_end() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("s.sock");
        let listener = socket(
            AddressFamily::Unix,
            SockType::SeqPacket,
            SockFlag::SOCK_CLOEXEC,
            None,
        )
        .unwrap();
        nix::sys::socket::bind(listener.as_raw_fd(), &UnixAddr::new(&path).unwrap()).unwrap();
        nix::sys::socket::listen(&listener, nix::sys::socket::Backlog::new(4).unwrap()).unwrap();
        let answers: Vec<Vec<(&'static str, usize)>> = vec![
            vec![("FDNAMES=a:b\n", 2), ("FDNAMES=c\n", 1), ("END=3\n", 0)],
            vec![("ERROR=not the lock holder\n", 0)],
            vec![("FDNAMES=a\n", 1), ("END=2\n", 0)],
            vec![("FDNAMES=a:b\n", 1)],
        ];
        let server = std::thread::spawn(move || {
            for answer in answers {
                let c = nix::sys::socket::accept(listener.as_raw_fd()).unwrap();
                // SAFETY: accept just returned this descriptor, owned here.
                let c = unsafe { OwnedFd::from_raw_fd(c) };
                for (text, n) in answer {
                    let f = std::fs::File::open("/dev/null").unwrap();
                    let raw = vec![f.as_raw_fd(); n];
                    let rights = [ControlMessage::ScmRights(&raw)];
                    let cm: &[ControlMessage<'_>] = if n == 0 { &[] } else { &rights };
                    sendmsg::<()>(
                        c.as_raw_fd(),
                        &[IoSlice::new(text.as_bytes())],
                        cm,
                        MsgFlags::empty(),
                        None,
                    )
                    .unwrap();
                }
            }
        });
        let got = fetch_from(&path).unwrap();
        let names: Vec<&str> = got.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["a", "b", "c"]);
        assert!(
            matches!(fetch_from(&path), Err(FetchError::Refused(w)) if w == "not the lock holder")
        );
        assert!(matches!(fetch_from(&path), Err(FetchError::Protocol(_))));
        assert!(matches!(fetch_from(&path), Err(FetchError::Protocol(_))));
        server.join().unwrap();
    }
}
