//! A client's connection, TCP or Unix (the pair's listening socket may be
//! either), and reading its request without taking it off the socket.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use nix::errno::Errno;
use nix::libc;
use nix::sys::socket::{
    accept4, getsockname, getsockopt, recv, sockopt, AddressFamily, MsgFlags, SockFlag, SockType,
    SockaddrLike, SockaddrStorage,
};

/// One connection.
#[derive(Debug)]
pub enum Conn {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Conn {
    /// A connected stream socket, whichever its family; an error for
    /// anything else.
    pub fn from_fd(fd: OwnedFd) -> io::Result<Conn> {
        let kind = getsockopt(&fd, sockopt::SockType).map_err(io::Error::from)?;
        if kind != SockType::Stream {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("a {kind:?} socket, not a stream"),
            ));
        }
        let addr: SockaddrStorage = getsockname(fd.as_raw_fd()).map_err(io::Error::from)?;
        Ok(match addr.family() {
            Some(AddressFamily::Unix) => Conn::Unix(UnixStream::from(fd)),
            Some(AddressFamily::Inet | AddressFamily::Inet6) => Conn::Tcp(TcpStream::from(fd)),
            other => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("a socket of family {other:?}"),
                ))
            }
        })
    }

    pub fn is_tcp(&self) -> bool {
        matches!(self, Conn::Tcp(_))
    }

    pub fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Conn::Tcp(s) => s.set_read_timeout(t),
            Conn::Unix(s) => s.set_read_timeout(t),
        }
    }

    pub fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Conn::Tcp(s) => s.set_write_timeout(t),
            Conn::Unix(s) => s.set_write_timeout(t),
        }
    }

    /// Blocking again (a descriptor from the store may have been left
    /// non-blocking by whoever held it).
    pub fn set_blocking(&self) -> io::Result<()> {
        match self {
            Conn::Tcp(s) => s.set_nonblocking(false),
            Conn::Unix(s) => s.set_nonblocking(false),
        }
    }

    /// TCP_NODELAY where there is such a thing.
    pub fn set_nodelay(&self) {
        if let Conn::Tcp(s) = self {
            let _ = s.set_nodelay(true);
        }
    }

    /// Takes exactly `n` bytes off the socket (they are there: peeked).
    pub fn consume(&mut self, n: usize) -> io::Result<()> {
        set_rcvlowat(self.as_fd(), 1)?;
        let mut left = n;
        let mut sink = [0u8; 8192];
        while left > 0 {
            let want = left.min(sink.len());
            let got = self.read(&mut sink[..want])?;
            if got == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            left -= got;
        }
        Ok(())
    }

    /// Takes off the socket, without waiting, at most `n` bytes of what is
    /// there; how many.
    pub fn drain(&self, n: usize) -> usize {
        let _ = set_rcvlowat(self.as_fd(), 1);
        let mut left = n;
        let mut sink = [0u8; 8192];
        while left > 0 {
            let want = left.min(sink.len());
            match recv(
                self.as_fd().as_raw_fd(),
                &mut sink[..want],
                MsgFlags::MSG_DONTWAIT,
            ) {
                Ok(0) | Err(_) => break,
                Ok(got) => left -= got,
            }
        }
        n - left
    }
}

impl AsFd for Conn {
    fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            Conn::Tcp(s) => s.as_fd(),
            Conn::Unix(s) => s.as_fd(),
        }
    }
}

impl Read for Conn {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Conn::Tcp(s) => s.read(buf),
            Conn::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Conn {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Conn::Tcp(s) => s.write(buf),
            Conn::Unix(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Conn::Tcp(s) => s.flush(),
            Conn::Unix(s) => s.flush(),
        }
    }
}

/// The next connection of a listening socket (close-on-exec, blocking).
pub fn accept(listener: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    let raw = accept4(listener.as_raw_fd(), SockFlag::SOCK_CLOEXEC).map_err(io::Error::from)?;
    // SAFETY: accept4 just returned this descriptor: nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

/// `SO_RCVLOWAT`: a read (a peek too) waits until `n` bytes are there, or
/// the end, or its timeout.
fn set_rcvlowat(fd: BorrowedFd<'_>, n: usize) -> io::Result<()> {
    let v = libc::c_int::try_from(n.max(1)).unwrap_or(libc::c_int::MAX);
    // SAFETY: setsockopt reads one int from the pointer, `v`, which lives
    // across the call; `fd` is open (borrowed).
    let r = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVLOWAT,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// A request's head, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Head {
    pub method: String,
    pub path: String,
    /// Bytes of the head (through its blank line).
    pub head_len: usize,
    /// Its `Content-Length` (0 without one).
    pub body_len: usize,
}

/// The head at the start of `buf`: None while it is incomplete.
pub fn parse_head(buf: &[u8]) -> Result<Option<Head>, String> {
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(buf) {
        Ok(httparse::Status::Complete(head_len)) => {
            let body_len = req
                .headers
                .iter()
                .find(|h| h.name.eq_ignore_ascii_case("content-length"))
                .and_then(|h| {
                    std::str::from_utf8(h.value)
                        .ok()?
                        .trim()
                        .parse::<usize>()
                        .ok()
                })
                .unwrap_or(0);
            Ok(Some(Head {
                method: req.method.unwrap_or("").to_owned(),
                path: req.path.unwrap_or("").to_owned(),
                head_len,
                body_len,
            }))
        }
        Ok(httparse::Status::Partial) => Ok(None),
        Err(e) => Err(format!("bad HTTP request: {e}")),
    }
}

/// A whole request, still in the socket.
#[derive(Debug)]
pub struct Peeked {
    pub method: String,
    pub path: String,
    pub body: Vec<u8>,
    /// Its bytes in the socket: head and body.
    pub len: usize,
}

/// Why no whole request could be peeked, and how many bytes were there.
#[derive(Debug)]
pub struct NoRequest {
    pub reason: String,
    pub peeked: usize,
}

/// `SO_PEEK_OFF` of a Unix socket: where the next peek starts (it moves
/// on by what each peek returns); -1, off.
fn set_peek_off(fd: BorrowedFd<'_>, off: libc::c_int) -> io::Result<()> {
    // SAFETY: setsockopt reads one int from the pointer, `off`, which lives
    // across the call; `fd` is open (borrowed).
    let r = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEEK_OFF,
            (&off as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// One `recv` with `MSG_PEEK`, again after a signal.
fn peek(fd: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<usize> {
    loop {
        match recv(fd.as_raw_fd(), buf, MsgFlags::MSG_PEEK) {
            Err(Errno::EINTR) => continue,
            other => return other.map_err(io::Error::from),
        }
    }
}

/// The request at the front of `conn`, read with `MSG_PEEK`: its bytes
/// stay in the socket (another engine can read them again) until the
/// caller consumes them. Over TCP each peek reads from the start and waits
/// (`SO_RCVLOWAT`) for one byte more than the last one saw, or for the
/// whole request once its head says how long it is; a Unix socket does
/// not wait for a low mark when peeking, so there each peek starts where
/// the last one ended (`SO_PEEK_OFF`) and waits for anything new. The read
/// timeout bounds every wait.
pub fn peek_request(conn: &Conn, max: usize) -> Result<Peeked, NoRequest> {
    let fd = conn.as_fd();
    let tcp = conn.is_tcp();
    if !tcp {
        set_peek_off(fd, 0).map_err(|e| NoRequest {
            reason: format!("SO_PEEK_OFF: {e}"),
            peeked: 0,
        })?;
    }
    let out = peek_whole(fd, tcp, max);
    let _ = if tcp {
        set_rcvlowat(fd, 1)
    } else {
        set_peek_off(fd, -1)
    };
    out
}

fn peek_whole(fd: BorrowedFd<'_>, tcp: bool, max: usize) -> Result<Peeked, NoRequest> {
    let mut buf = vec![0u8; max + 1];
    let mut have = 0usize;
    let mut want = 1usize;
    let fail = |reason: String, peeked: usize| NoRequest { reason, peeked };
    loop {
        // Here `have <= max`: the buffer has room for more.
        let now = if tcp {
            set_rcvlowat(fd, want).map_err(|e| fail(format!("SO_RCVLOWAT: {e}"), have))?;
            peek(fd, &mut buf).map_err(|e| fail(format!("read: {e}"), have))?
        } else {
            have + peek(fd, &mut buf[have..]).map_err(|e| fail(format!("read: {e}"), have))?
        };
        if now <= have {
            // The end (or the timeout) came before anything more.
            return Err(fail(
                if now == 0 {
                    "connection closed before a full request".into()
                } else {
                    "connection closed (or silent) inside the request".into()
                },
                now,
            ));
        }
        have = now;
        match parse_head(&buf[..have]).map_err(|r| fail(r, have))? {
            Some(h) => {
                let total = h.head_len + h.body_len;
                if total > max {
                    return Err(fail(format!("request larger than {max} bytes"), have));
                }
                if have >= total {
                    return Ok(Peeked {
                        method: h.method,
                        path: h.path,
                        body: buf[h.head_len..total].to_vec(),
                        len: total,
                    });
                }
                want = total;
            }
            None if have > max => {
                return Err(fail(format!("request larger than {max} bytes"), have));
            }
            None => want = have + 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Shutdown, TcpListener};

    fn tcp_pair() -> (Conn, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let s = Conn::from_fd(accept(l.as_fd()).unwrap()).unwrap();
        (s, c)
    }

    /// A server end and a client end, over TCP and over a Unix socket.
    fn pairs() -> Vec<(Conn, Box<dyn Write + Send>)> {
        let (s, c) = tcp_pair();
        let (x, y) = UnixStream::pair().unwrap();
        let u = Conn::from_fd(OwnedFd::from(x)).unwrap();
        assert!(s.is_tcp() && !u.is_tcp());
        vec![(s, Box::new(c)), (u, Box::new(y))]
    }

    /// A request sent in pieces is peeked whole, and stays in the socket
    /// until consumed.
    #[test]
    fn a_request_is_peeked_whole_and_left_in_the_socket() {
        for (mut server, mut client) in pairs() {
            let req = b"POST /v1/completions HTTP/1.1\r\nContent-Length: 11\r\n\r\nhello world";
            server
                .set_read_timeout(Some(Duration::from_secs(10)))
                .unwrap();
            let writer = std::thread::spawn(move || {
                for piece in [&req[..7], &req[7..40], &req[40..60], &req[60..]] {
                    client.write_all(piece).unwrap();
                    std::thread::sleep(Duration::from_millis(20));
                }
                client
            });
            let p = peek_request(&server, 1024).unwrap();
            assert_eq!(
                (p.method.as_str(), p.path.as_str()),
                ("POST", "/v1/completions")
            );
            assert_eq!(p.body, b"hello world");
            assert_eq!(p.len, req.len());
            let mut client = writer.join().unwrap();
            // Still there: a second peek sees the same.
            assert_eq!(peek_request(&server, 1024).unwrap().len, req.len());
            server.consume(p.len).unwrap();
            client.write_all(b"GET /health HTTP/1.1\r\n\r\n").unwrap();
            let next = peek_request(&server, 1024).unwrap();
            assert_eq!(next.path, "/health");
            assert_eq!(server.drain(1000), next.len);
            assert_eq!(server.drain(1000), 0);
        }
    }

    #[test]
    fn what_is_no_whole_request_says_why() {
        let (server, mut client) = tcp_pair();
        server
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        client
            .write_all(b"POST / HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc")
            .unwrap();
        client.shutdown(Shutdown::Write).unwrap();
        let e = peek_request(&server, 1024).unwrap_err();
        assert!(e.reason.contains("inside the request"), "{e:?}");
        assert_eq!(e.peeked, 42);

        let (server, mut client) = tcp_pair();
        client.write_all(b"\x01\x02 nonsense\r\n\r\n").unwrap();
        let e = peek_request(&server, 1024).unwrap_err();
        assert!(e.reason.contains("bad HTTP"), "{e:?}");

        let (server, mut client) = tcp_pair();
        client
            .write_all(b"POST / HTTP/1.1\r\nContent-Length: 5000\r\n\r\n")
            .unwrap();
        let e = peek_request(&server, 1024).unwrap_err();
        assert!(e.reason.contains("larger"), "{e:?}");

        let (server, client) = tcp_pair();
        server
            .set_read_timeout(Some(Duration::from_millis(50)))
            .unwrap();
        let e = peek_request(&server, 1024).unwrap_err();
        assert!(e.reason.starts_with("read:"), "{e:?}");
        drop(client);
    }
}
