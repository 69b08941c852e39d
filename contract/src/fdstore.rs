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

/// `SIOCOUTQ` (bytes in a TCP socket's send queue, sent or not, not yet
/// acknowledged): the same request number as `TIOCOUTQ` on Linux.
const SIOCOUTQ: libc::Ioctl = libc::TIOCOUTQ;

/// TCP states (`include/net/tcp_states.h`) in which this side's FIN is in
/// the sequence space: it takes one sequence number, counted by
/// `SIOCOUTQ` until acknowledged and by `tcpi_bytes_acked` after.
const FIN_SENT: [u8; 5] = [
    4,  // FIN_WAIT1
    5,  // FIN_WAIT2
    6,  // TIME_WAIT
    9,  // LAST_ACK
    11, // CLOSING
];

/// `tcpi_state` and `tcpi_bytes_acked` of a TCP socket.
fn tcp_acked(fd: BorrowedFd<'_>) -> io::Result<(u8, u64)> {
    // SAFETY: tcp_info is a C struct of integers: all zeroes is a value.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `info`, which is
    // that large, and sets `len` to what it wrote; `fd` is open (borrowed).
    let r = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    let need = std::mem::offset_of!(libc::tcp_info, tcpi_bytes_acked) + 8;
    if (len as usize) < need {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "the kernel's tcp_info has no tcpi_bytes_acked",
        ));
    }
    Ok((info.tcpi_state, info.tcpi_bytes_acked))
}

fn out_queue(fd: BorrowedFd<'_>) -> io::Result<u64> {
    let mut n: libc::c_int = 0;
    // SAFETY: SIOCOUTQ writes one int through the pointer, to `n`.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), SIOCOUTQ, &mut n as *mut libc::c_int) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    u64::try_from(n).map_err(|_| io::Error::other(format!("SIOCOUTQ {n}")))
}

/// How many bytes the processes that held this accepted TCP socket wrote
/// to it, in all: those acknowledged by the peer (`tcpi_bytes_acked`,
/// which on an accepted socket starts after the handshake; on a socket
/// that connected it counts the SYN as one) and those still in the send queue (`SIOCOUTQ`), less one
/// for this side's FIN if it was sent. The sum holds only while nobody
/// writes; ACKs may move bytes from one count to the other between the two
/// calls, so it is read again until the acknowledged count stood still
/// (it only grows) around the queue's. An error for a socket that is not
/// TCP (a Unix socket has no such counts).
pub fn bytes_written(fd: BorrowedFd<'_>) -> io::Result<u64> {
    for _ in 0..1000 {
        let (_, before) = tcp_acked(fd)?;
        let queued = out_queue(fd)?;
        let (state, after) = tcp_acked(fd)?;
        if before == after {
            let fin = u64::from(FIN_SENT.contains(&state));
            return Ok((after + queued).saturating_sub(fin));
        }
    }
    Err(io::Error::other(
        "the socket's acknowledged count never stood still",
    ))
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
    use std::io::{Read, Write};
    use std::net::{Shutdown, TcpListener, TcpStream};
    use std::os::fd::AsFd;
    use std::time::Instant;

    /// A loopback connection: (the accepted side, the client).
    fn tcp_pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        (s, c)
    }

    /// Writes until the socket takes no more (the peer not reading), the
    /// last writes taken only in part: how many bytes it took.
    fn fill(s: &mut TcpStream) -> u64 {
        s.set_nonblocking(true).unwrap();
        let chunk = vec![0x5au8; 7001];
        let mut total = 0u64;
        let mut stuck = 0;
        while stuck < 50 {
            match s.write(&chunk) {
                Ok(n) => {
                    total += n as u64;
                    stuck = 0;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    stuck += 1;
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) => panic!("write: {e}"),
            }
        }
        s.set_nonblocking(false).unwrap();
        total
    }

    /// What a process wrote is what the kernel's counts say, whether the
    /// peer read it (acknowledged), left it in its window, or it is still
    /// queued here (a write only partly taken included); the SYN is not
    /// counted, the FIN is taken off.
    #[test]
    fn the_bytes_written_are_the_kernels_counts() {
        let (mut s, mut c) = tcp_pair();
        assert_eq!(bytes_written(s.as_fd()).unwrap(), 0, "the SYN is no byte");
        s.write_all(b"hello").unwrap();
        let mut five = [0u8; 5];
        c.read_exact(&mut five).unwrap();
        assert_eq!(bytes_written(s.as_fd()).unwrap(), 5);
        // The peer stops reading: the rest sits in its window and in our
        // send queue, the last write only partly taken.
        let wrote = 5 + fill(&mut s);
        assert!(wrote > 100_000, "{wrote}");
        assert_eq!(bytes_written(s.as_fd()).unwrap(), wrote);
        assert!(out_queue(s.as_fd()).unwrap() > 0, "some still queued");
        // Another owner of the socket (a copy, as the store holds) counts
        // the same.
        let copy = s.as_fd().try_clone_to_owned().unwrap();
        assert_eq!(bytes_written(copy.as_fd()).unwrap(), wrote);
        // Our FIN: one sequence number, not a byte written.
        s.shutdown(Shutdown::Write).unwrap();
        let (state, acked) = tcp_acked(s.as_fd()).unwrap();
        assert!(FIN_SENT.contains(&state), "state {state}");
        assert_eq!(acked + out_queue(s.as_fd()).unwrap(), wrote + 1);
        assert_eq!(bytes_written(s.as_fd()).unwrap(), wrote);
        // The peer reads it all, the FIN acknowledged too.
        let mut got = Vec::new();
        c.read_to_end(&mut got).unwrap();
        assert_eq!(5 + got.len() as u64, wrote, "all but the hello read before");
        let t = Instant::now();
        while out_queue(s.as_fd()).unwrap() > 0 && t.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(1));
        }
        let (_, acked) = tcp_acked(s.as_fd()).unwrap();
        assert_eq!(acked, wrote + 1, "the FIN acknowledged");
        assert_eq!(bytes_written(s.as_fd()).unwrap(), wrote);
        // The side that connected is another matter: the kernel counts
        // its SYN, acknowledged by the SYN-ACK, as one byte acknowledged.
        // The engine only ever counts accepted connections.
        let (s, mut c) = tcp_pair();
        assert_eq!(bytes_written(s.as_fd()).unwrap(), 0);
        assert_eq!(bytes_written(c.as_fd()).unwrap(), 1, "the SYN");
        c.write_all(b"xyz").unwrap();
        assert_eq!(bytes_written(c.as_fd()).unwrap(), 4);
    }

    #[test]
    fn a_unix_socket_has_no_count() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        assert!(bytes_written(a.as_fd()).is_err());
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
