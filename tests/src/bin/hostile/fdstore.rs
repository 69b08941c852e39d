//! Attacks on the pair's fd store (docs/security.md, "The fd store"), each
//! as the parked shadow of a pair (see `notify.rs`): the store must keep
//! only what its bound and its rules allow, answer fetches only for the
//! lock holder, and let a busy engine store and remove thousands of
//! descriptors a second without its watchdog pings being pushed out.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixDatagram;
use std::time::{Duration, Instant};

use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags, UnixAddr};
use shadow_engine_kit::fdstore;

use crate::common::{as_shadow, notify_path, step};

fn secs(args: &[String], i: usize, default: u64) -> Result<u64, String> {
    match args.get(i) {
        None => Ok(default),
        Some(a) => a.parse().map_err(|_| format!("not a number: {a:?}")),
    }
}

fn memfd(name: &str) -> Result<OwnedFd, String> {
    nix::sys::memfd::memfd_create(name, nix::sys::memfd::MFdFlags::MFD_CLOEXEC)
        .map_err(|e| format!("memfd_create: {e}"))
}

/// The engine's pinger: `WATCHDOG=1` each half interval (if the pair has a
/// watchdog), from the loop that stores, as a real engine's serving loop;
/// a blocking send, as libsystemd's, given up after a quarter interval.
struct Pinger {
    every: Option<Duration>,
    next: Instant,
    sock: UnixDatagram,
    path: String,
    sent: u64,
    lost: u64,
}

impl Pinger {
    fn new() -> Result<Pinger, String> {
        let sock = UnixDatagram::unbound().map_err(|e| format!("socket: {e}"))?;
        let interval = shadow_engine_kit::watchdog::interval_from_env();
        let patience = interval.map_or(Duration::from_millis(20), |i| i / 4);
        sock.set_write_timeout(Some(patience))
            .map_err(|e| format!("SO_SNDTIMEO: {e}"))?;
        Ok(Pinger {
            every: interval.map(|i| i / 2),
            next: Instant::now(),
            sock,
            path: notify_path()?,
            sent: 0,
            lost: 0,
        })
    }

    fn tick(&mut self) {
        let Some(every) = self.every else { return };
        let now = Instant::now();
        if now >= self.next {
            match self.sock.send_to(b"WATCHDOG=1", &self.path) {
                Ok(_) => self.sent += 1,
                Err(_) => self.lost += 1,
            }
            self.next = now + every;
        }
    }
}

/// One datagram with `fds` on the notify socket (a blocked send gives up
/// after a while: the kernel queue is the shim's to drain).
fn send(sock: &UnixDatagram, path: &str, text: &str, fds: &[BorrowedFd<'_>]) -> bool {
    let Ok(addr) = UnixAddr::new(path) else {
        return false;
    };
    let raw: Vec<i32> = fds.iter().map(AsRawFd::as_raw_fd).collect();
    let rights = [ControlMessage::ScmRights(&raw)];
    let cm: &[ControlMessage<'_>] = if raw.is_empty() { &[] } else { &rights };
    sendmsg(
        sock.as_raw_fd(),
        &[std::io::IoSlice::new(text.as_bytes())],
        cm,
        MsgFlags::empty(),
        Some(&addr),
    )
    .is_ok()
}

/// `fdstore-fetch`: fetch the store without holding the lock. The shim
/// must refuse (`step=fetch-refused why=…`).
pub fn fetch(_args: &[String]) -> Result<(), String> {
    as_shadow("fdstore-fetch", || {
        match fdstore::fetch() {
            Ok(got) => step("fdstore-fetch", &format!("fetch-got n={}", got.len())),
            Err(fdstore::FetchError::Refused(why)) => {
                step("fdstore-fetch", &format!("fetch-refused why={why}"))
            }
            Err(e) => step("fdstore-fetch", &format!("fetch-error {e}")),
        }
        Ok(())
    })
}

/// `fdstore-flood [seconds]`: what the store must refuse — a pipe, a
/// regular file, a directory, an eventfd, `/dev/null`; names systemd does
/// not allow; then, for `seconds` (default 2), datagrams of 253 copies of
/// one memfd, far past the store's bound, pinging all along; then removes
/// everything it stored (`FDSTOREREMOVE=1`) and says `step=removed`.
pub fn flood(args: &[String]) -> Result<(), String> {
    let how_long = Duration::from_secs(secs(args, 0, 2)?);
    as_shadow("fdstore-flood", || {
        let path = notify_path()?;
        let sock = UnixDatagram::unbound().map_err(|e| format!("socket: {e}"))?;
        sock.set_write_timeout(Some(Duration::from_millis(200)))
            .map_err(|e| format!("SO_SNDTIMEO: {e}"))?;
        let mut pinger = Pinger::new()?;
        let (r, w) = nix::unistd::pipe().map_err(|e| format!("pipe: {e}"))?;
        let file =
            std::fs::File::create("/tmp/fdstore-flood-file").map_err(|e| format!("create: {e}"))?;
        let dir = std::fs::File::open("/").map_err(|e| format!("open /: {e}"))?;
        let ev = nix::sys::eventfd::EventFd::new().map_err(|e| format!("eventfd: {e}"))?;
        let null = std::fs::File::open("/dev/null").map_err(|e| format!("/dev/null: {e}"))?;
        let wrong: [BorrowedFd<'_>; 6] = [
            r.as_fd(),
            w.as_fd(),
            file.as_fd(),
            dir.as_fd(),
            ev.as_fd(),
            null.as_fd(),
        ];
        let mut sent = 0u64;
        for fd in wrong {
            sent += u64::from(send(&sock, &path, "FDSTORE=1\nFDNAME=wrong\n", &[fd]));
        }
        let m = memfd("flood")?;
        for name in ["a:b", "", &"x".repeat(300), "tab\there"] {
            let text = format!("FDSTORE=1\nFDNAME={name}\n");
            sent += u64::from(send(&sock, &path, &text, &[m.as_fd()]));
        }
        step("fdstore-flood", &format!("refusables sent={sent}"));
        let many: Vec<BorrowedFd<'_>> = (0..253).map(|_| m.as_fd()).collect();
        let end = Instant::now() + how_long;
        let (mut sent, mut refused) = (0u64, 0u64);
        while Instant::now() < end {
            pinger.tick();
            if send(&sock, &path, "FDSTORE=1\nFDNAME=flood\n", &many) {
                sent += 1;
            } else {
                refused += 1;
            }
        }
        let removed = send(&sock, &path, "FDSTOREREMOVE=1\nFDNAME=flood\n", &[]);
        step(
            "fdstore-flood",
            &format!(
                "flooded sent={sent} refused={refused} pings={} pings_lost={} removed={removed}",
                pinger.sent, pinger.lost
            ),
        );
        Ok(())
    })
}

/// `fdstore-churn [seconds] [per-second]`: a busy engine's store traffic
/// for `seconds` (default 3): a memfd stored and removed `per-second`
/// times a second (default 2000), each under a name of its own, pinging
/// all along; says how many it sent and how many pings it could not.
pub fn churn(args: &[String]) -> Result<(), String> {
    let how_long = Duration::from_secs(secs(args, 0, 3)?);
    let rate = secs(args, 1, 2000)?.max(1);
    as_shadow("fdstore-churn", || {
        let path = notify_path()?;
        let sock = UnixDatagram::unbound().map_err(|e| format!("socket: {e}"))?;
        sock.set_write_timeout(Some(Duration::from_millis(200)))
            .map_err(|e| format!("SO_SNDTIMEO: {e}"))?;
        let mut pinger = Pinger::new()?;
        let m = memfd("churn")?;
        let start = Instant::now();
        let gap = Duration::from_secs(1) / rate as u32;
        let (mut stored, mut removed, mut failed) = (0u64, 0u64, 0u64);
        let mut i = 0u64;
        while start.elapsed() < how_long {
            pinger.tick();
            let name = format!("conn-{i}");
            if send(
                &sock,
                &path,
                &format!("FDSTORE=1\nFDNAME={name}\n"),
                &[m.as_fd()],
            ) {
                stored += 1;
            } else {
                failed += 1;
            }
            if send(
                &sock,
                &path,
                &format!("FDSTOREREMOVE=1\nFDNAME={name}\n"),
                &[],
            ) {
                removed += 1;
            } else {
                failed += 1;
            }
            i += 1;
            // Paced, not busy: the rate of a busy server, not a flood.
            let due = start + gap * i as u32;
            if let Some(wait) = due.checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
        }
        step(
            "fdstore-churn",
            &format!(
                "churned stored={stored} removed={removed} failed={failed} pings={} pings_lost={}",
                pinger.sent, pinger.lost
            ),
        );
        // Its watchdog is armed now: it goes on pinging while it parks, as
        // a correct engine does.
        std::thread::spawn(move || loop {
            pinger.tick();
            std::thread::sleep(Duration::from_millis(5));
        });
        Ok(())
    })
}
