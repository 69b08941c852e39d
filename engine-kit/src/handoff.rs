//! The engine's side of connections the runtime accepts
//! (`shadow.dev/accept: runtime`; the protocol's names, and what an engine
//! sees, are [`shadow_contract::handoff`]'s): [`enabled`] says whether this
//! engine is handed its connections, [`receive`] reads the next one from a
//! hand-off socket (one of the descriptors under the listening sockets'
//! names in `LISTEN_FDS`).

use std::io::{self, IoSliceMut};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
use shadow_contract::fdstore::name_is_valid;
use shadow_contract::handoff::{Accept, ENV, PACKET_MAX};

/// Whether this engine is handed its connections (`SHADOW_ACCEPT=runtime`).
pub fn enabled() -> bool {
    std::env::var(ENV).is_ok_and(|v| v == Accept::Runtime.as_str())
}

/// One connection handed over.
#[derive(Debug)]
pub struct Handed {
    /// Its name in the store.
    pub name: String,
    pub conn: OwnedFd,
}

/// The next connection from a hand-off socket: `Ok(None)` once the
/// runtime closed its end (the pair ended); `WouldBlock` on a
/// non-blocking socket with nothing queued; `InvalidData` for a packet
/// that is not one name and one descriptor (what came with it is closed).
pub fn receive(sock: BorrowedFd<'_>) -> io::Result<Option<Handed>> {
    let mut buf = [0u8; PACKET_MAX];
    // Room for a few descriptors: a packet with more than one is refused,
    // and each one that came is closed, none left in this process.
    let mut space = nix::cmsg_space!([RawFd; 4]);
    let (len, truncated, fds) = loop {
        let mut iov = [IoSliceMut::new(&mut buf)];
        match recvmsg::<()>(
            sock.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::MSG_CMSG_CLOEXEC,
        ) {
            Ok(msg) => {
                let mut fds = Vec::new();
                for c in msg.cmsgs().map_err(io::Error::from)? {
                    if let ControlMessageOwned::ScmRights(raw) = c {
                        // SAFETY: the kernel just installed these
                        // descriptors in this process for this message:
                        // nothing else owns them.
                        fds.extend(raw.into_iter().map(|r| unsafe { OwnedFd::from_raw_fd(r) }));
                    }
                }
                let truncated = msg
                    .flags
                    .intersects(MsgFlags::MSG_TRUNC | MsgFlags::MSG_CTRUNC);
                break (msg.bytes, truncated, fds);
            }
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
        }
    };
    if len == 0 && fds.is_empty() && !truncated {
        return Ok(None);
    }
    let bad = |why: String| Err(io::Error::new(io::ErrorKind::InvalidData, why));
    let text = std::str::from_utf8(&buf[..len]).ok();
    let name = text
        .and_then(|t| t.strip_prefix("FDNAME="))
        .and_then(|t| t.strip_suffix('\n'))
        .filter(|n| name_is_valid(n));
    match (name, truncated, fds.len()) {
        (Some(name), false, 1) => Ok(Some(Handed {
            name: name.to_string(),
            conn: fds.into_iter().next().ok_or_else(|| io::Error::other("no descriptor"))?,
        })),
        _ => bad(format!(
            "a hand-off packet of {len} bytes{} with {} descriptors: not `FDNAME=<name>` and one connection",
            if truncated { " (truncated)" } else { "" },
            fds.len()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::sys::socket::{
        sendmsg, socketpair, AddressFamily, ControlMessage, SockFlag, SockType,
    };
    use shadow_contract::handoff::packet;
    use std::io::IoSlice;
    use std::os::fd::AsFd;

    fn pair() -> (OwnedFd, OwnedFd) {
        socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        )
        .unwrap()
    }

    fn send(sock: &OwnedFd, text: &[u8], fds: &[RawFd]) {
        let rights = [ControlMessage::ScmRights(fds)];
        let cmsgs: &[ControlMessage<'_>] = if fds.is_empty() { &[] } else { &rights };
        sendmsg::<()>(
            sock.as_raw_fd(),
            &[IoSlice::new(text)],
            cmsgs,
            MsgFlags::empty(),
            None,
        )
        .unwrap();
    }

    /// A socket pair: one end to send, the other to tell, by reading the
    /// end of it, that every copy of the sent end was closed.
    fn witness() -> (
        std::os::unix::net::UnixStream,
        std::os::unix::net::UnixStream,
    ) {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        b.set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .unwrap();
        (a, b)
    }

    fn closed_everywhere(b: &mut std::os::unix::net::UnixStream) -> bool {
        use std::io::Read;
        matches!(b.read(&mut [0u8; 1]), Ok(0))
    }

    #[test]
    fn a_packet_gives_its_name_and_connection_and_the_end_gives_none() {
        let (ours, theirs) = pair();
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        send(&ours, packet("accepted.0.1").as_bytes(), &[a.as_raw_fd()]);
        let h = receive(theirs.as_fd()).unwrap().unwrap();
        assert_eq!(h.name, "accepted.0.1");
        let st = nix::sys::stat::fstat(h.conn.as_fd()).unwrap();
        assert_eq!(st.st_mode & nix::libc::S_IFMT, nix::libc::S_IFSOCK);
        drop(ours);
        assert!(receive(theirs.as_fd()).unwrap().is_none());
    }

    /// What a confused or hostile sender could put on the socket is refused
    /// and leaves no descriptor behind.
    #[test]
    fn malformed_packets_are_refused_and_their_descriptors_closed() {
        let (ours, theirs) = pair();
        let long = vec![b'x'; PACKET_MAX + 10];
        let cases: [(&[u8], usize); 6] = [
            (b"FDNAME=x\n", 0),
            (b"FDNAME=x\n", 2),
            (b"FDNAME=a:b\n", 1),
            (b"NAME=x\n", 1),
            (&[0xff, 0xfe], 1),
            (&long, 1),
        ];
        for (text, n) in cases {
            let ends: Vec<_> = (0..n).map(|_| witness()).collect();
            let raw: Vec<RawFd> = ends.iter().map(|(a, _)| a.as_raw_fd()).collect();
            send(&ours, text, &raw);
            let mut left: Vec<_> = ends.into_iter().map(|(_, b)| b).collect();
            let e = receive(theirs.as_fd()).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{text:?}: {e}");
            for b in &mut left {
                assert!(closed_everywhere(b), "{text:?}: a descriptor was left open");
            }
        }
    }
}
