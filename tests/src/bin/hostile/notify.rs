//! Attacks on the notify socket (docs/security.md, "The notify socket").
//!
//! Each runs as both engines of a pair: the engine that gets the election
//! lock at once serves quietly (`attack=<name> step=active`); the other is
//! the parked shadow and attacks (`step=parked`, then `step=attacked`), then
//! behaves as a well-formed shadow, so that a failover afterwards shows the
//! pair still works.

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixDatagram;
use std::time::{Duration, Instant};

use nix::sys::socket::{sendmsg, setsockopt, sockopt, ControlMessage, MsgFlags, UnixAddr};

use crate::common::{as_shadow, notify_path, step};

/// The longest text the contract allows in one datagram.
const MAX_TEXT: usize = 4096;

/// Seconds from the first argument, or `default`.
fn secs(args: &[String], default: u64) -> Result<Duration, String> {
    match args.first() {
        None => Ok(Duration::from_secs(default)),
        Some(a) => a
            .parse()
            .map(Duration::from_secs)
            .map_err(|_| format!("not a number of seconds: {a:?}")),
    }
}

/// Sends `payload` with `fds` attached (SCM_RIGHTS) to the notify socket.
fn send_with_fds(payload: &[u8], fds: &[i32]) -> Result<(), nix::errno::Errno> {
    let path = notify_path().map_err(|_| nix::errno::Errno::ENOENT)?;
    let sock = UnixDatagram::unbound().map_err(|_| nix::errno::Errno::EIO)?;
    let addr = UnixAddr::new(path.as_str())?;
    let iov = [std::io::IoSlice::new(payload)];
    sendmsg(
        sock.as_raw_fd(),
        &iov,
        &[ControlMessage::ScmRights(fds)],
        MsgFlags::empty(),
        Some(&addr),
    )
    .map(|_| ())
}

/// `notify-linger-fd [linger-seconds]`: passes the shim a TCP socket whose
/// last close blocks for `linger-seconds` (default 60): SO_LINGER set, its
/// send buffer full, its peer (kept open here) never reading. A shim that
/// closes it on its runtime thread stops answering for that long.
pub fn linger_fd(args: &[String]) -> Result<(), String> {
    let linger = secs(args, 60)?;
    as_shadow("notify-linger-fd", || {
        let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| format!("listen: {e}"))?;
        let addr = listener.local_addr().map_err(|e| format!("listen: {e}"))?;
        let sock = TcpStream::connect(addr).map_err(|e| format!("connect {addr}: {e}"))?;
        let (peer, _) = listener.accept().map_err(|e| format!("accept: {e}"))?;
        sock.set_nonblocking(true)
            .map_err(|e| format!("nonblocking: {e}"))?;
        let chunk = vec![0u8; 1 << 16];
        let mut queued = 0usize;
        while let Ok(n) = (&sock).write(&chunk) {
            queued += n;
        }
        setsockopt(
            &sock,
            sockopt::Linger,
            &libc::linger {
                l_onoff: 1,
                l_linger: linger.as_secs().min(i32::MAX as u64) as i32,
            },
        )
        .map_err(|e| format!("SO_LINGER: {e}"))?;
        step(
            "notify-linger-fd",
            &format!("lingering-socket-ready unsent={queued}"),
        );
        match send_with_fds(b"STATUS=parked", &[sock.as_raw_fd()]) {
            Ok(()) => step("notify-linger-fd", "sent"),
            Err(e) => {
                // SO_PASSRIGHTS off (Linux >= 6.16): the shim refuses fds.
                // Ours is then the last close: make it not linger.
                step("notify-linger-fd", &format!("refused errno={e}"));
                let abort = libc::linger {
                    l_onoff: 1,
                    l_linger: 0,
                };
                setsockopt(&sock, sockopt::Linger, &abort)
                    .map_err(|e| format!("SO_LINGER: {e}"))?;
            }
        }
        // Ours closed, the shim's copy is the last one; the peer stays open
        // (and unread) for the life of this engine.
        drop(sock);
        std::mem::forget(peer);
        Ok(())
    })
}

/// `notify-flood [seconds]`: for `seconds` (default 5), sends sd_notify
/// datagrams as fast as the socket takes them, full ones (4 KiB of lines):
/// `READY=1` lines (a lie: this engine does not hold the lock) and
/// `STATUS=flood <n>` lines in turn, so no two alike in a row, from one
/// connected socket.
pub fn flood(args: &[String]) -> Result<(), String> {
    let how_long = secs(args, 5)?;
    as_shadow("notify-flood", || {
        let path = notify_path()?;
        let sock = UnixDatagram::unbound().map_err(|e| format!("socket: {e}"))?;
        sock.connect(&path)
            .map_err(|e| format!("connect {path}: {e}"))?;
        // A blocked send still ends: the kernel queue is the shim's to drain.
        sock.set_write_timeout(Some(Duration::from_millis(200)))
            .map_err(|e| format!("SO_SNDTIMEO: {e}"))?;
        // Full datagrams of lines: each costs the shim one read and the
        // supervisor hundreds of notifications.
        let ready = "READY=1\n".repeat(MAX_TEXT / 8);
        step("notify-flood", "flooding");
        let end = Instant::now() + how_long;
        let (mut sent, mut refused) = (0u64, 0u64);
        let mut i = 0u64;
        while Instant::now() < end {
            for _ in 0..64 {
                i += 1;
                let text = if i % 2 == 0 {
                    ready.clone()
                } else {
                    let line = format!("STATUS=flood {i}\n");
                    line.repeat(MAX_TEXT / line.len())
                };
                match sock.send(text.as_bytes()) {
                    Ok(_) => sent += 1,
                    Err(_) => refused += 1,
                }
            }
        }
        step(
            "notify-flood",
            &format!("flooded sent={sent} refused={refused}"),
        );
        Ok(())
    })
}

/// `notify-garbage [seconds]`: for `seconds` (default 3), sends what no
/// engine should: oversized datagrams, invalid UTF-8, NULs, lies
/// (`MAINPID=1`), forged credentials, 253 fds in one datagram, malformed
/// and unknown lines. It never says `READY=1`: from either engine of a
/// pair that is believed (docs/security.md).
pub fn garbage(args: &[String]) -> Result<(), String> {
    let how_long = secs(args, 3)?;
    as_shadow("notify-garbage", || {
        let path = notify_path()?;
        let sock = UnixDatagram::unbound().map_err(|e| format!("socket: {e}"))?;
        sock.set_write_timeout(Some(Duration::from_millis(200)))
            .map_err(|e| format!("SO_SNDTIMEO: {e}"))?;
        // Oversized: whatever its first 4 KiB say, it is not a datagram
        // of the contract and must not be half read.
        let big = {
            let mut b = b"READY=1\nSTATUS=".to_vec();
            b.resize(60_000, b'x');
            b
        };
        let mut many_lines = Vec::new();
        while many_lines.len() < 4000 {
            many_lines.extend_from_slice(b"STATUS=parked\nWATCHDOG=1\n");
        }
        let texts: Vec<Vec<u8>> = vec![
            big,
            many_lines,
            vec![0xff, 0xfe, b'=', 0x80, b'\n'],
            vec![0; 512],
            Vec::new(),
            b"MAINPID=1\nSTATUS=parked".to_vec(),
            b"ERRNO=-99999999999999999999\nSTOPPING=0\nREADY=0".to_vec(),
            b"=\n==\nREADY\nSTATUS\n".to_vec(),
        ];
        let devnull: Vec<OwnedFd> = (0..253)
            .filter_map(|_| std::fs::File::open("/dev/null").ok().map(OwnedFd::from))
            .collect();
        let raw: Vec<i32> = devnull.iter().map(|f| f.as_raw_fd()).collect();
        let end = Instant::now() + how_long;
        let (mut sent, mut refused) = (0u64, 0u64);
        while Instant::now() < end {
            for t in &texts {
                match sock.send_to(t, &path) {
                    Ok(_) => sent += 1,
                    Err(_) => refused += 1,
                }
            }
            match send_with_fds(b"STATUS=parked", &raw) {
                Ok(()) => sent += 1,
                Err(_) => refused += 1,
            }
            match forged_credentials(&path) {
                Ok(()) => sent += 1,
                Err(_) => refused += 1,
            }
        }
        step(
            "notify-garbage",
            &format!("garbage sent={sent} refused={refused}"),
        );
        Ok(())
    })
}

/// One datagram claiming to come from another pid (the kernel refuses it
/// to a sender without CAP_SYS_ADMIN over its pid namespace, and a pid that
/// does not exist there; any pid it may claim is one of its own container).
fn forged_credentials(path: &str) -> Result<(), nix::errno::Errno> {
    let sock = UnixDatagram::unbound().map_err(|_| nix::errno::Errno::EIO)?;
    let addr = UnixAddr::new(path)?;
    let me = std::process::id() as i32;
    let cred = libc::ucred {
        pid: if me == 1 { 2 } else { 1 },
        uid: 0,
        gid: 0,
    };
    let creds = nix::sys::socket::UnixCredentials::from(cred);
    let iov = [std::io::IoSlice::new(b"STATUS=forged\nMAINPID=1")];
    sendmsg(
        sock.as_raw_fd(),
        &iov,
        &[ControlMessage::ScmCredentials(&creds)],
        MsgFlags::empty(),
        Some(&addr),
    )
    .map(|_| ())
}
