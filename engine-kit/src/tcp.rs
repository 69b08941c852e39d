//! How many bytes the engines wrote to an accepted TCP connection, read
//! from the kernel's counts (`TCP_INFO`'s `tcpi_bytes_acked` and
//! `SIOCOUTQ`): what a promoted engine needs to tell a connection its dead
//! peer never answered from one it answered in part, whoever wrote it.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

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

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::{Shutdown, TcpListener, TcpStream};
    use std::os::fd::AsFd;
    use std::time::{Duration, Instant};

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
}
