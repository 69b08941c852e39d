//! Framing over a Unix stream socket: a 4-byte little-endian length, then
//! that many bytes of JSON; file descriptors ride along with the first bytes
//! of a frame as `SCM_RIGHTS`.
//!
//! Every descriptor the kernel installs becomes an `OwnedFd` before anything
//! else happens, including when the control data was truncated
//! (`MSG_CTRUNC`) or the frame turns out bad: nothing a peer sends can leak
//! a descriptor into this process. (`nix`'s `RecvMsg::cmsgs` refuses to
//! iterate a truncated buffer, which would leak exactly those descriptors, so
//! the receive path walks the control buffer itself.)

use std::io::IoSlice;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use nix::errno::Errno;
use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags, UnixAddr};

use crate::protocol::MAX_FDS_PER_MESSAGE;
use crate::{Error, Result};

const HEADER: usize = 4;

/// One received frame: its body and the descriptors that came with it.
#[derive(Debug)]
pub struct Frame {
    pub body: Vec<u8>,
    pub fds: Vec<OwnedFd>,
}

/// Sends one frame. Descriptors go with the first byte.
pub fn send(sock: BorrowedFd<'_>, body: &[u8], fds: &[BorrowedFd<'_>]) -> Result<()> {
    if fds.len() > MAX_FDS_PER_MESSAGE {
        return Err(Error::LimitExceeded(format!(
            "{} descriptors in one message, limit is {MAX_FDS_PER_MESSAGE}",
            fds.len()
        )));
    }
    let len = u32::try_from(body.len()).map_err(|_| Error::TooLarge {
        size: body.len(),
        limit: u32::MAX as usize,
    })?;
    let header = len.to_le_bytes();
    let raw: Vec<RawFd> = fds.iter().map(|fd| fd.as_raw_fd()).collect();
    let mut frame = Vec::with_capacity(HEADER + body.len());
    frame.extend_from_slice(&header);
    frame.extend_from_slice(body);
    let mut sent = 0;
    while sent < frame.len() {
        let cmsg = [ControlMessage::ScmRights(&raw)];
        // Descriptors only with the first chunk; later chunks are plain bytes.
        let cmsgs: &[ControlMessage] = if sent == 0 && !raw.is_empty() {
            &cmsg
        } else {
            &[]
        };
        match sendmsg::<UnixAddr>(
            sock.as_raw_fd(),
            &[IoSlice::new(&frame[sent..])],
            cmsgs,
            MsgFlags::MSG_NOSIGNAL,
            None,
        ) {
            Ok(n) => sent += n,
            Err(Errno::EINTR) => continue,
            Err(e) => {
                return Err(Error::sys(
                    format!("sendmsg on socket fd {}", sock.as_raw_fd()),
                    e,
                ))
            }
        }
    }
    Ok(())
}

/// Receives into `buf`, appending any descriptors to `fds`. Returns the byte
/// count (0 at end of stream).
fn recv_some(sock: BorrowedFd<'_>, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> Result<usize> {
    // Room for one more descriptor than allowed, so "too many" is seen as a
    // count rather than only as MSG_CTRUNC.
    let space = {
        // SAFETY: CMSG_SPACE is pure arithmetic on its argument.
        unsafe {
            libc::CMSG_SPACE(((MAX_FDS_PER_MESSAGE + 1) * std::mem::size_of::<RawFd>()) as u32)
        }
    } as usize;
    // u64 storage keeps the control buffer aligned for cmsghdr.
    let mut control = vec![0u64; space.div_ceil(8)];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    loop {
        // SAFETY: msghdr is plain data; zeroed is a valid "no name" header.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: msg points at live buffers (iov -> buf, control) that outlive
        // the call; the kernel writes at most their stated lengths.
        let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n < 0 {
            let err = Errno::last();
            if err == Errno::EINTR {
                continue;
            }
            return Err(Error::sys(
                format!("recvmsg on socket fd {}", sock.as_raw_fd()),
                err,
            ));
        }
        // Take ownership of every installed descriptor first.
        // SAFETY: the kernel set msg_controllen to the bytes it wrote, and the
        // CMSG_* macros stay within that length.
        unsafe {
            let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
            while !cmsg.is_null() {
                if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                    let data = libc::CMSG_DATA(cmsg);
                    let payload = (*cmsg).cmsg_len as usize - (data as usize - cmsg as usize);
                    for i in 0..payload / std::mem::size_of::<RawFd>() {
                        let fd = std::ptr::read_unaligned(data.cast::<RawFd>().add(i));
                        // SAFETY: the kernel just installed this descriptor for
                        // us; nothing else refers to it.
                        let fd = OwnedFd::from_raw_fd(fd);
                        never_linger(&fd);
                        fds.push(fd);
                    }
                }
                cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
            }
        }
        if msg.msg_flags & libc::MSG_CTRUNC != 0 {
            return Err(Error::ControlTruncated {
                max: MAX_FDS_PER_MESSAGE,
            });
        }
        return Ok(n as usize);
    }
}

/// A received descriptor that is a socket is told to linger for 0 s, so
/// that dropping it (a frame refused, a reply with descriptors nobody asked
/// for) resets it at once: the last close of a socket with `SO_LINGER` set
/// by its sender would otherwise block the closing thread for as long as
/// the sender chose. The protocol passes only memory (memfds, exported
/// device memory), never sockets.
fn never_linger(fd: &OwnedFd) {
    let is_socket = nix::sys::stat::fstat(fd)
        .map(|st| st.st_mode & libc::S_IFMT == libc::S_IFSOCK)
        .unwrap_or(false);
    if is_socket {
        let abort = libc::linger {
            l_onoff: 1,
            l_linger: 0,
        };
        // A socket that does not linger (EOPNOTSUPP and the like) is fine.
        let _ = nix::sys::socket::setsockopt(fd, nix::sys::socket::sockopt::Linger, &abort);
    }
}

/// Turns off `SO_PASSRIGHTS` (Linux >= 6.16) on a socket that expects no
/// descriptors: a peer that sends some gets `EPERM` and nothing reaches us.
/// On older kernels (`ENOPROTOOPT`) it does nothing, and what arrives is
/// owned and made non-lingering by [`recv`].
pub fn refuse_rights(sock: BorrowedFd<'_>) {
    // asm-generic's value; mips, parisc, sparc and alpha number it otherwise.
    #[cfg(any(
        target_arch = "x86_64",
        target_arch = "aarch64",
        target_arch = "riscv64"
    ))]
    {
        const SO_PASSRIGHTS: libc::c_int = 83;
        let off: libc::c_int = 0;
        // SAFETY: a valid socket fd and a c_int option of the stated size.
        unsafe {
            libc::setsockopt(
                sock.as_raw_fd(),
                libc::SOL_SOCKET,
                SO_PASSRIGHTS,
                (&off as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
    }
    #[cfg(not(any(
        target_arch = "x86_64",
        target_arch = "aarch64",
        target_arch = "riscv64"
    )))]
    let _ = sock;
}

/// Grows this process's descriptor table now, if it must, so that the next
/// `n` descriptors it opens or is given fit in it without growing it then.
///
/// Why: the kernel grows the table of a process with more than one thread
/// only after an RCU grace period (`expand_fdtable` waits in
/// `synchronize_rcu`): 16 ms measured on a 6.18 kernel, 15 to 48 ms while
/// a dying CUDA process is torn down on the H200. A parked engine that
/// receives a KV pool's grant (up to [`MAX_FDS_PER_MESSAGE`] descriptors
/// in one `recvmsg`) would wait for it on the failover's path; making room
/// while parked moves that wait off it. The table never shrinks, so room
/// made once stays; asking again when there is room costs `2n` cheap
/// system calls and no wait.
pub fn make_room(n: usize) -> Result<()> {
    let seed =
        nix::sys::memfd::memfd_create(c"gms-fd-room", nix::sys::memfd::MFdFlags::MFD_CLOEXEC)
            .map_err(|e| Error::sys("memfd for making room in the descriptor table", e))?;
    make_room_with(seed.as_fd(), n)
}

/// [`make_room`] with copies of `seed`: the `n` lowest free descriptors
/// are taken (as a `recvmsg` would take them), which grows the table as
/// far as they reach, and given back.
fn make_room_with(seed: BorrowedFd<'_>, n: usize) -> Result<()> {
    let mut held = Vec::with_capacity(n);
    for _ in 0..n {
        let fd = seed.try_clone_to_owned().map_err(|e| {
            Error::Backend(format!(
                "this process cannot open {n} more descriptors ({e}; had {} so far): \
                 a KV pool's grant needs as many (raise RLIMIT_NOFILE)",
                held.len()
            ))
        })?;
        held.push(fd);
    }
    Ok(())
}

fn recv_exact(
    sock: BorrowedFd<'_>,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
    already: usize,
) -> Result<()> {
    let mut got = 0;
    while got < buf.len() {
        let n = recv_some(sock, &mut buf[got..], fds)?;
        if n == 0 {
            if got + already == 0 {
                return Err(Error::Closed);
            }
            return Err(Error::Truncated {
                got: already + got,
                want: already + buf.len(),
            });
        }
        got += n;
    }
    Ok(())
}

/// Receives one frame of at most `limit` body bytes. `Error::Closed` means
/// the peer closed cleanly between frames.
pub fn recv(sock: impl AsFd, limit: usize) -> Result<Frame> {
    let sock = sock.as_fd();
    let mut fds = Vec::new();
    let mut header = [0u8; HEADER];
    recv_exact(sock, &mut header, &mut fds, 0)?;
    let len = u32::from_le_bytes(header) as usize;
    if len > limit {
        return Err(Error::TooLarge { size: len, limit });
    }
    let mut body = vec![0u8; len];
    recv_exact(sock, &mut body, &mut fds, HEADER)?;
    if fds.len() > MAX_FDS_PER_MESSAGE {
        return Err(Error::WrongFdCount {
            op: "frame".into(),
            got: fds.len(),
            want: MAX_FDS_PER_MESSAGE,
        });
    }
    Ok(Frame { body, fds })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    #[test]
    fn a_received_socket_that_lingers_is_dropped_without_blocking() {
        use std::io::Write;
        // A TCP socket whose last close would wait 30 s: SO_LINGER set, its
        // send buffer full, its peer never reading.
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let tcp = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (_peer, _) = l.accept().unwrap();
        tcp.set_nonblocking(true).unwrap();
        while (&tcp).write(&[0u8; 65536]).is_ok() {}
        let linger = libc::linger {
            l_onoff: 1,
            l_linger: 30,
        };
        nix::sys::socket::setsockopt(&tcp, nix::sys::socket::sockopt::Linger, &linger).unwrap();
        let (a, b) = UnixStream::pair().unwrap();
        send(a.as_fd(), b"{}", &[tcp.as_fd()]).unwrap();
        drop(tcp);
        let frame = recv(&b, 1024).unwrap();
        assert_eq!(frame.fds.len(), 1);
        let started = std::time::Instant::now();
        drop(frame);
        assert!(started.elapsed() < std::time::Duration::from_secs(10));
    }

    /// Descriptors of this process that refer to the memfd called `name`
    /// (tests run in parallel threads, so a plain count would be racy).
    fn fds_named(name: &str) -> usize {
        std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
            .filter(|target| target.to_string_lossy().contains(name))
            .count()
    }

    /// This process's descriptor table's size, as `/proc/self/status`
    /// reports it (`FDSize`).
    fn fd_table_size() -> usize {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let line = status.lines().find(|l| l.starts_with("FDSize:")).unwrap();
        line["FDSize:".len()..].trim().parse().unwrap()
    }

    #[test]
    fn making_room_grows_the_table_once_and_closes_what_it_took() {
        let seed = nix::sys::memfd::memfd_create(
            c"gms-test-fd-room",
            nix::sys::memfd::MFdFlags::MFD_CLOEXEC,
        )
        .unwrap();
        // Past whatever the table holds now (other tests' descriptors
        // included): making room must grow it.
        let want = fd_table_size() + 300;
        make_room_with(seed.as_fd(), want).unwrap();
        let grown = fd_table_size();
        assert!(grown >= want, "FDSize {grown} after making room for {want}");
        assert_eq!(
            fds_named("gms-test-fd-room"),
            1,
            "only the seed is left open"
        );
        // Room for fewer: nothing changes.
        make_room_with(seed.as_fd(), 10).unwrap();
        assert!(fd_table_size() >= grown);
        assert_eq!(fds_named("gms-test-fd-room"), 1);
        make_room(64).unwrap();
        assert_eq!(
            fds_named("gms-fd-room"),
            0,
            "make_room's own memfd is closed"
        );
    }

    #[test]
    fn frames_carry_bytes_and_descriptors() {
        let (a, b) = UnixStream::pair().unwrap();
        let file = tempfile::tempfile().unwrap();
        send(a.as_fd(), b"hello", &[file.as_fd(), file.as_fd()]).unwrap();
        send(a.as_fd(), b"", &[]).unwrap();
        let f = recv(&b, 1024).unwrap();
        assert_eq!(f.body, b"hello");
        assert_eq!(f.fds.len(), 2);
        let f = recv(&b, 1024).unwrap();
        assert!(f.body.is_empty() && f.fds.is_empty());
        drop(a);
        assert!(matches!(recv(&b, 1024), Err(Error::Closed)));
    }

    #[test]
    fn oversized_truncated_and_overfull_frames_are_errors_without_leaks() {
        {
            let (a, b) = UnixStream::pair().unwrap();
            send(a.as_fd(), &[b'x'; 100], &[]).unwrap();
            assert!(matches!(
                recv(&b, 10),
                Err(Error::TooLarge {
                    size: 100,
                    limit: 10
                })
            ));
        }
        {
            let (a, b) = UnixStream::pair().unwrap();
            use std::io::Write;
            (&a).write_all(&[10, 0, 0, 0, b'x']).unwrap();
            drop(a);
            assert!(matches!(
                recv(&b, 100),
                Err(Error::Truncated { got: 5, want: 14 })
            ));
        }
        {
            // More descriptors than the receiver has room for: MSG_CTRUNC;
            // the ones that did arrive must be closed, not leaked.
            let (a, b) = UnixStream::pair().unwrap();
            let file = nix::sys::memfd::memfd_create(
                "gms-wire-ctrunc-test",
                nix::sys::memfd::MFdFlags::MFD_CLOEXEC,
            )
            .unwrap();
            let many: Vec<RawFd> = vec![file.as_raw_fd(); MAX_FDS_PER_MESSAGE + 5];
            let cmsg = [ControlMessage::ScmRights(&many)];
            sendmsg::<UnixAddr>(
                a.as_raw_fd(),
                &[IoSlice::new(&[1, 0, 0, 0, b'x'])],
                &cmsg,
                MsgFlags::empty(),
                None,
            )
            .unwrap();
            assert!(matches!(recv(&b, 100), Err(Error::ControlTruncated { .. })));
            assert_eq!(
                fds_named("gms-wire-ctrunc-test"),
                1,
                "only our own descriptor is left"
            );
        }
    }
}
