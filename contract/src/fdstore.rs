//! The pair's file-descriptor store (`shadow.dev/fdstore-max`, config
//! `pair.fdstore_max`), both sides of it. It is systemd's store
//! (`sd_notify(3)`, `systemd.service(5)` `FileDescriptorStoreMax=`) for a
//! pair of engines:
//!
//! - an engine stores descriptors by sending `FDSTORE=1` (with `FDNAME=`,
//!   and `FDPOLL=0` to keep a socket whose peer hung up) and the
//!   descriptors (`SCM_RIGHTS`) on `NOTIFY_SOCKET`, and drops them by name
//!   with `FDSTOREREMOVE=1` and `FDNAME=`; only sockets and memfds are
//!   kept. Any sd_notify library sends these as systemd would have them;
//!   [`store`] and [`remove`] are this crate's own;
//! - every engine the pair starts gets the store after the listening
//!   sockets, in `LISTEN_FDS`/`LISTEN_FDNAMES`, as systemd hands it to a
//!   restarted service;
//! - an engine that takes the election lock is already running: it
//!   [`fetch`]es the store from its `SHADOW_FDSTORE_SOCKET`, which answers
//!   the lock holder only, once everything the engines sent before is in.
//!
//! The fetch socket is a `SOCK_SEQPACKET` Unix socket; the client sends
//! nothing. Each packet is one line of text: `FDNAMES=<name>:<name>…` with
//! as many descriptors as names (at most [`FDS_PER_PACKET`]), then
//! `END=<count>` with the total, or `ERROR=<why>` alone.

use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::time::Duration;

use nix::sys::socket::{
    connect, recvmsg, sendmsg, socket, AddressFamily, ControlMessage, ControlMessageOwned,
    MsgFlags, SockFlag, SockType, UnixAddr,
};

use crate::env;
use crate::error::AnnotationError;

/// The annotation: how many descriptors a pair's store keeps at most.
pub const KEY: &str = "shadow.dev/fdstore-max";
/// Without the annotation: room for one connection and its state each for
/// a few hundred clients (systemd's own default is 0, no store).
pub const DEFAULT_MAX: u32 = 1024;
/// The largest value allowed. Every stored descriptor is one open file of
/// the shim (containerd starts its shims with a limit of 1 048 576).
pub const MAX_MAX: u32 = 16384;
/// A stored descriptor without `FDNAME=` is named so (systemd's name).
pub const DEFAULT_NAME: &str = "stored";
/// Longest name (systemd's `FDNAME=` bound).
pub const NAME_MAX: usize = 255;
/// Descriptors in one packet of a fetch.
pub const FDS_PER_PACKET: usize = 64;
/// The largest packet of a fetch: the names of [`FDS_PER_PACKET`]
/// descriptors, separators and the key.
pub const PACKET_MAX: usize = FDS_PER_PACKET * (NAME_MAX + 1) + 64;
/// How long [`fetch`] waits for each packet.
pub const FETCH_TIMEOUT: Duration = Duration::from_secs(10);
/// How long [`store`] and [`remove`] wait for room in the notify socket.
pub const SEND_TIMEOUT: Duration = Duration::from_secs(1);

/// `shadow.dev/fdstore-max`: `0` (no store: descriptors sent are refused
/// by the kernel, as before the store) to [`MAX_MAX`].
pub fn parse_max(value: &str) -> Result<u32, AnnotationError> {
    let t = value.trim();
    match t.parse::<u32>() {
        Ok(n) if t.bytes().all(|b| b.is_ascii_digit()) && n <= MAX_MAX => Ok(n),
        _ => Err(AnnotationError {
            key: KEY.to_string(),
            value: value.to_string(),
            allowed: format!("0 (no store) to {MAX_MAX}"),
        }),
    }
}

/// Whether `name` may name stored descriptors: 1 to [`NAME_MAX`]
/// printable ASCII characters, no `:` (it separates `LISTEN_FDNAMES`), as
/// systemd's `fdname_is_valid`.
pub fn name_is_valid(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= NAME_MAX
        && name.bytes().all(|b| (0x20..0x7f).contains(&b) && b != b':')
}

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

fn send(text: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    let Some(path) = std::env::var_os(env::NOTIFY_SOCKET) else {
        return Ok(());
    };
    let sock = UnixDatagram::unbound()?;
    sock.set_write_timeout(Some(SEND_TIMEOUT))?;
    let addr = UnixAddr::new(Path::new(&path)).map_err(io::Error::from)?;
    let raw: Vec<RawFd> = fds.iter().map(AsRawFd::as_raw_fd).collect();
    let rights = [ControlMessage::ScmRights(&raw)];
    let cmsgs: &[ControlMessage<'_>] = if raw.is_empty() { &[] } else { &rights };
    let sent = sendmsg(
        sock.as_raw_fd(),
        &[IoSlice::new(text)],
        cmsgs,
        MsgFlags::MSG_NOSIGNAL,
        Some(&addr),
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

/// How many bytes have been written to the TCP connection `sock` so far,
/// by every process that held it: what the peer acknowledged (`TCP_INFO`'s
/// `tcpi_bytes_acked`) plus what is still queued, unsent or unacknowledged
/// (`ioctl(SIOCOUTQ)`). A promoted engine resumes a connection the dead
/// engine was answering right after this many bytes of the answer. Not for
/// a connection whose write side was shut down (the FIN counts in the queue).
pub fn bytes_written(sock: BorrowedFd<'_>) -> io::Result<u64> {
    // SAFETY: tcp_info is plain old data, all zeroes is a valid value.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: a valid descriptor, a buffer of `len` bytes owned here and a
    // length the kernel updates in place.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // Kernels before 4.2 have no tcpi_bytes_acked: a shorter answer.
    let end_of_acked = std::mem::offset_of!(libc::tcp_info, tcpi_bytes_acked) + 8;
    if (len as usize) < end_of_acked {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "TCP_INFO has no tcpi_bytes_acked on this kernel",
        ));
    }
    let mut queued: libc::c_int = 0;
    // SAFETY: SIOCOUTQ (TIOCOUTQ) writes one int into `queued`.
    let rc = unsafe { libc::ioctl(sock.as_raw_fd(), libc::TIOCOUTQ, &mut queued) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(info.tcpi_bytes_acked + queued.max(0) as u64)
}

/// The descriptors of `inherited` (`crate::listen::inherited`) that are
/// not among the `listen` sockets' names: the store, handed at start.
pub fn split_inherited(
    inherited: Vec<crate::listen::Inherited>,
    is_listen_name: impl Fn(&str) -> bool,
) -> (Vec<crate::listen::Inherited>, Vec<Stored>) {
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

    /// What a process wrote is what the socket says, whether the peer read
    /// it, left it unacknowledged, or left it queued.
    #[test]
    fn the_socket_says_how_much_was_written() {
        use std::io::{Read, Write};
        use std::os::fd::AsFd;
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut s, _) = l.accept().unwrap();
        assert_eq!(bytes_written(s.as_fd()).unwrap(), 0);
        s.write_all(&[7u8; 1000]).unwrap();
        let mut got = [0u8; 100];
        c.read_exact(&mut got).unwrap();
        assert_eq!(bytes_written(s.as_fd()).unwrap(), 1000);
        // The peer stops reading: the rest waits in the queues.
        s.set_nonblocking(true).unwrap();
        let mut total = 1000u64;
        let chunk = vec![1u8; 1 << 16];
        while let Ok(n) = s.write(&chunk) {
            total += n as u64;
        }
        assert_eq!(bytes_written(s.as_fd()).unwrap(), total);
        // Another copy of the socket says the same (the promoted engine's).
        let twin = s.as_fd().try_clone_to_owned().unwrap();
        assert_eq!(bytes_written(twin.as_fd()).unwrap(), total);
        let f = std::fs::File::open("/dev/null").unwrap();
        assert!(bytes_written(f.as_fd()).is_err());
    }

    #[test]
    fn the_bound_parses_from_zero_to_its_maximum() {
        assert_eq!(parse_max("0"), Ok(0));
        assert_eq!(parse_max(" 4096 "), Ok(4096));
        assert_eq!(parse_max(&MAX_MAX.to_string()), Ok(MAX_MAX));
        for bad in ["", "-1", "+5", "16385", "1e3", "many"] {
            let e = parse_max(bad).unwrap_err();
            assert_eq!(e.key, KEY);
            assert!(e.allowed.contains("16384"), "{e}");
        }
    }

    #[test]
    fn names_are_systemds() {
        assert!(name_is_valid("conn-17"));
        assert!(name_is_valid(&"x".repeat(NAME_MAX)));
        for bad in ["", "a:b", "tab\there", "é", "new\nline"] {
            assert!(!name_is_valid(bad), "{bad:?}");
        }
        assert!(!name_is_valid(&"x".repeat(NAME_MAX + 1)));
    }

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
