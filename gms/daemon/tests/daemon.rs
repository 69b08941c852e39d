//! End-to-end tests: the real `gmsd` binary, real engine processes
//! (`gms-probe`), real SIGKILL/SIGSEGV/SIGTERM. Each test has its own socket
//! directory; guards kill and reap every process they started, even when an
//! assertion fails, and the tests check that the daemon is left with nothing.

use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, ExitStatus, Stdio};
use std::time::Duration;

use gms::client::{self, Client};
use gms::protocol::{self, ErrorCode, LeaseKind, Mode, Request, Response};
use gms::status::StatusReport;
use gms::wire;
use serde_json::Value;
use shadow_wait::{poll, until};

/// How long an event in the daemon may take at most (a bound, not a wait).
const DEADLINE: Duration = Duration::from_secs(20);
/// How often a wait on the daemon's state looks again.
const STEP: Duration = Duration::from_millis(5);
const MIB: u64 = 1 << 20;

fn kill(pid: u32, sig: nix::sys::signal::Signal) {
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), sig);
}

struct Gmsd {
    child: Child,
    dir: tempfile::TempDir,
    socket: PathBuf,
    /// Open descriptors when ready, before any connection.
    idle_fds: usize,
}

impl Gmsd {
    fn start(extra: &[&str]) -> Self {
        Self::start_with(extra, Stdio::inherit())
    }

    /// gmsd with its log (warnings and up) in `log`.
    fn start_logged(extra: &[&str], log: &Path) -> Self {
        let file = std::fs::File::create(log).unwrap();
        Self::start_with(extra, Stdio::from(file))
    }

    fn start_with(extra: &[&str], stderr: Stdio) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let socket_dir = dir.path().join("gms");
        let mut child = Command::new(env!("CARGO_BIN_EXE_gmsd"))
            .args(["serve", "--socket-dir"])
            .arg(&socket_dir)
            .args(["--log-level", "warn"])
            .args(extra)
            .stdin(Stdio::null())
            .stderr(stderr)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        let stdout = child.stdout.take().unwrap();
        BufReader::new(stdout).read_line(&mut line).unwrap();
        let socket = match line.trim().strip_prefix("ready ") {
            Some(path) => PathBuf::from(path),
            None => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("gmsd did not become ready: {line:?}");
            }
        };
        assert_eq!(socket, socket_dir.join("gms-host.sock"));
        let idle_fds = std::fs::read_dir(format!("/proc/{}/fd", child.id()))
            .unwrap()
            .count();
        Gmsd {
            child,
            dir,
            socket,
            idle_fds,
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn status(&self) -> StatusReport {
        client::status(&self.socket).unwrap()
    }

    fn probe(&self, args: &[&str]) -> Probe {
        Probe::spawn(&self.socket, args)
    }

    fn rss_kib(&self) -> u64 {
        let text = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap();
        text.lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap()
    }

    fn open_fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid()))
            .unwrap()
            .count()
    }

    /// Waits until the daemon holds exactly the descriptors it had before
    /// its first connection (connection threads close theirs shortly after
    /// the peer does, so this polls with a deadline).
    #[track_caller]
    fn assert_fds_back_to_idle(&self) {
        let back = poll(DEADLINE, STEP, || match self.open_fds() {
            now if now == self.idle_fds => Ok(()),
            now => Err(now),
        });
        if let Err(now) = back {
            panic!(
                "daemon holds {now} descriptors, {} when idle",
                self.idle_fds
            );
        }
    }

    /// Waits until no connection is open (a closed peer is noticed by the
    /// daemon's connection thread, not synchronously with the close).
    fn wait_idle(&self) -> StatusReport {
        until("all connections to end", DEADLINE, STEP, || {
            let s = self.status();
            // The status connection itself is the one left.
            (s.connections == 1).then_some(s)
        })
    }

    /// SIGTERM, then the exit must be clean and the socket gone.
    fn stop(mut self) -> ExitStatus {
        kill(self.pid(), nix::sys::signal::Signal::SIGTERM);
        let status = self.child.wait().unwrap();
        assert!(!self.socket.exists(), "socket removed on stop");
        status
    }
}

impl Drop for Gmsd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = &self.dir;
    }
}

/// An engine-side process; killed and reaped on drop.
struct Probe {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
}

impl Probe {
    fn spawn(socket: &Path, args: &[&str]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_gms-probe"))
            .arg("--socket")
            .arg(socket)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        Probe {
            child,
            stdin,
            stdout,
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The next line, which must start with `keyword`; its JSON payload.
    fn expect(&mut self, keyword: &str) -> Value {
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        let rest = line
            .strip_prefix(keyword)
            .unwrap_or_else(|| panic!("expected '{keyword}', probe said {line:?}"));
        serde_json::from_str(rest.trim()).unwrap()
    }

    fn tell(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().unwrap();
        writeln!(stdin, "{line}").unwrap();
        stdin.flush().unwrap();
    }

    fn sigkill(&mut self) -> ExitStatus {
        let _ = self.child.kill();
        self.child.wait().unwrap()
    }

    fn wait(&mut self) -> ExitStatus {
        self.child.wait().unwrap()
    }
}

impl Drop for Probe {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn writer(gmsd: &Gmsd, count: usize, size: &str, commit: bool) -> (Probe, Value) {
    let count = count.to_string();
    let mut args = vec!["writer", "--count", &count, "--size", size, "--seed", "7"];
    if commit {
        args.push("--commit");
    }
    let mut p = gmsd.probe(&args);
    let ready = p.expect("ready");
    (p, ready)
}

#[test]
fn two_readers_map_the_committed_layout_at_the_writers_addresses() {
    let gmsd = Gmsd::start(&[]);
    let (_w, written) = writer(&gmsd, 3, "4M", true);
    assert_eq!(
        written["lease"], "ro",
        "a committed writer continues as a reader"
    );
    let mut r1 = gmsd.probe(&["reader"]);
    let mut r2 = gmsd.probe(&["reader"]);
    let (a, b) = (r1.expect("ready"), r2.expect("ready"));
    for r in [&a, &b] {
        assert_eq!(r["vas"], written["vas"]);
        assert_eq!(r["checksum"], written["checksum"]);
        assert_eq!(r["generation"], written["generation"]);
    }
    let s = gmsd.status();
    assert_eq!(s.state, "committed");
    assert_eq!(s.leases.len(), 3);
    assert!(s.leases.iter().all(|l| l.kind == LeaseKind::Ro));
    assert_eq!(s.bytes, 12 * MIB);
    assert_eq!(s.resident_bytes, 12 * MIB);
    let pids: Vec<i32> = s.leases.iter().map(|l| l.pid).collect();
    assert!(pids.contains(&(r1.pid() as i32)) && pids.contains(&(r2.pid() as i32)));
}

#[test]
fn writer_killed_before_commit_has_everything_discarded() {
    let gmsd = Gmsd::start(&[]);
    let rss_before = gmsd.rss_kib();
    let (mut w, _) = writer(&gmsd, 2, "32M", false);
    let s = gmsd.status();
    assert_eq!(
        (s.state.as_str(), s.bytes, s.resident_bytes),
        ("loading", 64 * MIB, 64 * MIB)
    );
    let rss_loaded = gmsd.rss_kib();
    assert!(
        rss_loaded >= rss_before + 60 * 1024,
        "pages are charged to the daemon: RSS {rss_before} -> {rss_loaded} KiB"
    );
    let status = w.sigkill();
    assert_eq!(status.signal(), Some(libc::SIGKILL));
    let s = until("the writer's lease to end", DEADLINE, STEP, || {
        let s = gmsd.status();
        s.leases.is_empty().then_some(s)
    });
    assert_eq!((s.state.as_str(), s.bytes, s.allocations), ("empty", 0, 0));
    let rss_after = gmsd.rss_kib();
    assert!(
        rss_after < rss_before + 8 * 1024,
        "memory returned: RSS {rss_before} -> {rss_loaded} -> {rss_after} KiB"
    );
    // Nothing committed, so the next rw_or_ro engine loads.
    let c = Client::connect(&gmsd.socket, Mode::RwOrRo, "next").unwrap();
    assert_eq!(c.lease(), LeaseKind::Rw);
}

#[test]
fn writer_killed_after_commit_leaves_the_layout_for_a_new_reader() {
    let gmsd = Gmsd::start(&[]);
    let (mut w, written) = writer(&gmsd, 2, "2M", true);
    w.sigkill();
    let s = until("the writer's lease to end", DEADLINE, STEP, || {
        let s = gmsd.status();
        s.leases.is_empty().then_some(s)
    });
    assert_eq!((s.state.as_str(), s.bytes), ("committed", 4 * MIB));
    let mut r = gmsd.probe(&["reader", "--mode", "rw_or_ro"]);
    let read = r.expect("ready");
    assert_eq!(read["lease"], "ro");
    assert_eq!(read["vas"], written["vas"]);
    assert_eq!(read["checksum"], written["checksum"]);
}

#[test]
fn a_killed_reader_loses_only_its_own_lease() {
    let gmsd = Gmsd::start(&[]);
    let (_w, written) = writer(&gmsd, 1, "2M", true);
    let mut r1 = gmsd.probe(&["reader"]);
    let mut r2 = gmsd.probe(&["reader"]);
    r1.expect("ready");
    r2.expect("ready");
    r1.sigkill();
    let s = until("two leases left", DEADLINE, STEP, || {
        let s = gmsd.status();
        (s.leases.len() == 2).then_some(s)
    });
    assert!(s.leases.iter().all(|l| l.pid != r1.pid() as i32));
    assert_eq!((s.state.as_str(), s.bytes), ("committed", 2 * MIB));
    r2.tell("check");
    assert_eq!(r2.expect("checksum"), written["checksum"]);
}

#[test]
fn a_reader_writing_to_its_mapping_dies_of_sigsegv_alone() {
    let gmsd = Gmsd::start(&[]);
    let (_w, written) = writer(&gmsd, 1, "2M", true);
    let mut reader = gmsd.probe(&["reader"]);
    reader.expect("ready");
    let mut vandal = gmsd.probe(&["reader-write"]);
    let mapped = vandal.expect("mapped");
    assert_ne!(
        mapped["mprotect_write"], "allowed",
        "read-only fd cannot be made writable"
    );
    let status = vandal.wait();
    assert_eq!(status.signal(), Some(libc::SIGSEGV), "{status:?}");
    reader.tell("check");
    assert_eq!(
        reader.expect("checksum"),
        written["checksum"],
        "bytes unchanged"
    );
    let s = until("the vandal's lease to end", DEADLINE, STEP, || {
        let s = gmsd.status();
        (s.leases.len() == 2).then_some(s)
    });
    assert_eq!(s.state, "committed");
}

#[test]
fn rw_is_refused_while_readers_are_attached_and_rw_or_ro_picks() {
    let gmsd = Gmsd::start(&[]);
    let first = Client::connect(&gmsd.socket, Mode::RwOrRo, "first").unwrap();
    assert_eq!(first.lease(), LeaseKind::Rw);
    // While a writer loads, nobody else gets in, whatever they ask.
    for mode in [Mode::Rw, Mode::Ro, Mode::RwOrRo] {
        let err = Client::connect(&gmsd.socket, mode, "second").err().unwrap();
        assert!(
            matches!(
                err,
                gms::Error::Remote {
                    code: ErrorCode::LeaseBusy,
                    ..
                }
            ),
            "{mode:?}: {err}"
        );
    }
    drop(first);
    let mut w = Client::connect_wait(&gmsd.socket, Mode::Rw, "w", DEADLINE).unwrap();
    let mut weights = vec![w.allocate("weights", 4096).unwrap()];
    w.commit(&mut weights).unwrap();
    let second = Client::connect(&gmsd.socket, Mode::RwOrRo, "second").unwrap();
    assert_eq!(second.lease(), LeaseKind::Ro);
    let err = Client::connect(&gmsd.socket, Mode::Rw, "replacer")
        .err()
        .unwrap();
    assert!(
        matches!(
            err,
            gms::Error::Remote {
                code: ErrorCode::NotPermitted,
                ..
            }
        ),
        "{err}"
    );
    drop((w, weights, second));
    // No reader left, and still no rw: the committed layout stays until
    // the supervisor (this test, gmsd's parent) resets.
    gmsd.wait_idle();
    let err = Client::connect(&gmsd.socket, Mode::Rw, "replacer")
        .err()
        .unwrap();
    assert!(
        matches!(
            err,
            gms::Error::Remote {
                code: ErrorCode::NotPermitted,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(gmsd.status().state, "committed");
}

/// The error a probe printed before it exited.
fn probe_error(gmsd: &Gmsd, args: &[&str]) -> String {
    let mut p = gmsd.probe(args);
    let err = p.expect("error");
    assert!(!p.wait().success());
    err["code"].as_str().unwrap_or_default().to_owned()
}

/// A failover drops readers to zero: no engine may then replace the
/// committed weights. Only gmsd's supervisor (its parent: this test, the
/// shim in a pair) may reset, and then the next engine loads again.
#[test]
fn rw_after_commit_is_refused_for_an_engine_and_only_the_supervisor_resets() {
    let gmsd = Gmsd::start(&[]);
    let (mut w, written) = writer(&gmsd, 2, "1M", true);
    w.sigkill();
    let s = gmsd.wait_idle();
    assert_eq!((s.state.as_str(), s.leases.len()), ("committed", 0));

    // An engine asks rw with zero readers: refused, nothing changes.
    assert_eq!(
        probe_error(&gmsd, &["writer", "--mode", "rw", "--seed", "99"]),
        "not_permitted"
    );
    // Nor may an engine reset.
    assert_eq!(probe_error(&gmsd, &["reset"]), "not_permitted");
    let s = gmsd.wait_idle();
    assert_eq!(s.state, "committed");
    let mut r = gmsd.probe(&["reader"]);
    let read = r.expect("ready");
    assert_eq!(read["checksum"], written["checksum"], "weights unchanged");

    // The supervisor's reset is refused while a lease is attached...
    let err = client::reset(&gmsd.socket).unwrap_err();
    assert!(
        matches!(
            err,
            gms::Error::Remote {
                code: ErrorCode::LeaseBusy,
                ..
            }
        ),
        "{err}"
    );
    drop(r);
    gmsd.wait_idle();
    // ...and done without one; then an engine loads again.
    assert_eq!(client::reset(&gmsd.socket).unwrap(), 1);
    assert_eq!(gmsd.status().state, "empty");
    let (_w2, again) = writer(&gmsd, 1, "1M", true);
    assert_eq!(again["generation"], 2);
}

/// A writer that goes silent before commit would block every engine of
/// the pair for ever: past the idle deadline its lease is dropped and its
/// allocations discarded. Readers, whose connection is their lease, may
/// stay silent.
#[test]
fn an_idle_uncommitted_writer_is_dropped_and_readers_may_stay_silent() {
    // The hello deadline is four idle deadlines: the daemon's own clock,
    // read below through a silent connection.
    let gmsd = Gmsd::start(&[
        "--writer-idle-timeout",
        "300ms",
        "--hello-timeout",
        "1200ms",
    ]);
    let (mut stalled, _) = writer(&gmsd, 2, "1M", false);
    assert_eq!(gmsd.status().state, "loading");
    let s = until("the idle writer to be dropped", DEADLINE, STEP, || {
        let s = gmsd.status();
        (s.state == "empty").then_some(s)
    });
    assert_eq!((s.bytes, s.allocations, s.leases.len()), (0, 0, 0));
    // Its commit now meets a closed lease.
    stalled.tell("commit");
    assert!(!stalled.wait().success());

    let (_w, _) = writer(&gmsd, 1, "1M", true);
    let mut r = gmsd.probe(&["reader"]);
    r.expect("ready");
    // Several idle deadlines later, as the daemon counts them (it times out
    // a silent connection made now after four), both leases are still there.
    let silent = UnixStream::connect(&gmsd.socket).unwrap();
    silent.set_read_timeout(Some(DEADLINE)).unwrap();
    let f = wire::recv(&silent, protocol::MAX_RESPONSE_BYTES).expect("an answer, not silence");
    match protocol::decode_response(&f.body, f.fds.len()).unwrap() {
        Response::Error { code, .. } => assert_eq!(code, ErrorCode::Timeout),
        other => panic!("expected a timeout, got {other:?}"),
    }
    let s = gmsd.status();
    assert_eq!((s.state.as_str(), s.leases.len()), ("committed", 2));
    r.tell("check");
    r.expect("checksum");
}

/// One process cannot take every connection: it is held to its own share,
/// others still get in, and gmsd's supervisor is not counted in the total.
#[test]
fn a_peer_is_held_to_its_connection_limit() {
    let gmsd = Gmsd::start(&["--max-connections-per-peer", "3", "--max-connections", "2"]);
    // This test is gmsd's parent (its supervisor): three connections, then no more.
    let held: Vec<UnixStream> = (0..3)
        .map(|_| UnixStream::connect(&gmsd.socket).unwrap())
        .collect();
    let err = client::status(&gmsd.socket).unwrap_err();
    assert!(
        matches!(
            err,
            gms::Error::Remote {
                code: ErrorCode::LimitExceeded,
                ..
            }
        ),
        "{err}"
    );
    drop(held);
    until("the held connections to close", DEADLINE, STEP, || {
        client::status(&gmsd.socket).ok()
    });
    // Two engines fill the total of 2; a third is refused; the supervisor
    // still gets its status.
    let (_w, _) = writer(&gmsd, 1, "1M", true);
    let mut r = gmsd.probe(&["reader"]);
    r.expect("ready");
    assert_eq!(probe_error(&gmsd, &["reader"]), "limit_exceeded");
    assert_eq!(gmsd.status().leases.len(), 2);
}

/// A peer that connects and says nothing, or starts a message and stalls,
/// is told it timed out and is closed; its thread and slot are freed.
#[test]
fn a_silent_or_slowloris_peer_times_out() {
    let gmsd = Gmsd::start(&["--hello-timeout", "200ms", "--frame-timeout", "200ms"]);
    let silent = UnixStream::connect(&gmsd.socket).unwrap();
    let slow = UnixStream::connect(&gmsd.socket).unwrap();
    // Two bytes of a four-byte header, then nothing.
    (&slow).write_all(&[5, 0]).unwrap();
    for s in [&silent, &slow] {
        // Bounded, so that a daemon that never answers fails the test.
        s.set_read_timeout(Some(DEADLINE)).unwrap();
        let f = wire::recv(s, protocol::MAX_RESPONSE_BYTES).expect("an answer, not silence");
        match protocol::decode_response(&f.body, f.fds.len()).unwrap() {
            Response::Error { code, .. } => assert_eq!(code, ErrorCode::Timeout),
            other => panic!("expected a timeout, got {other:?}"),
        }
        assert!(matches!(
            wire::recv(s, protocol::MAX_RESPONSE_BYTES),
            Err(gms::Error::Closed)
        ));
    }
    gmsd.wait_idle();
    gmsd.assert_fds_back_to_idle();
}

/// Out of descriptors, `accept` fails while the connection stays queued:
/// the daemon backs off instead of spinning on it (each failure logs the
/// pause that follows it: 10 ms, doubling, up to 1 s), and serves the
/// queued peer once descriptors are free again.
#[test]
fn accept_failing_with_emfile_does_not_spin() {
    let logs = tempfile::tempdir().unwrap();
    let log = logs.path().join("gmsd.log");
    // Only the test frees the held slot: the daemon's own deadline for a
    // silent connection must not do it first, however slow the machine.
    let gmsd = Gmsd::start_logged(&["--hello-timeout", "1h"], &log);
    // Room for one connection (the accepted socket and its dup), no more:
    // new descriptors take the lowest free numbers, so the limit is the
    // lowest free one plus two (inherited ones above it stay valid).
    let open: Vec<u32> = std::fs::read_dir(format!("/proc/{}/fd", gmsd.pid()))
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    let lowest_free = (0..).find(|n| !open.contains(n)).unwrap();
    let limit = libc::rlimit {
        rlim_cur: (lowest_free + 2) as libc::rlim_t,
        rlim_max: (lowest_free + 2) as libc::rlim_t,
    };
    // SAFETY: prlimit on our own child with a valid rlimit; no old value asked.
    let rc = unsafe {
        libc::prlimit(
            gmsd.pid() as libc::pid_t,
            libc::RLIMIT_NOFILE,
            &limit,
            std::ptr::null_mut(),
        )
    };
    assert_eq!(rc, 0, "prlimit: {}", std::io::Error::last_os_error());
    let first = UnixStream::connect(&gmsd.socket).unwrap();
    // The first takes the last descriptors; this one stays queued until
    // the first is gone.
    let socket = gmsd.socket.clone();
    let queued = std::thread::spawn(move || client::status(&socket));
    // The event this test is about: the back-off climbed to its ceiling,
    // one failed accept per step. Only then is the slot freed.
    let doubling = [
        "10ms", "20ms", "40ms", "80ms", "160ms", "320ms", "640ms", "1s",
    ];
    until(
        "the accept back-off to reach its ceiling",
        DEADLINE,
        STEP,
        || {
            accept_pauses(&log)
                .contains(&"1s".to_string())
                .then_some(())
        },
    );
    drop(first);
    let report = queued.join().unwrap().expect("the queued peer is served");
    assert_eq!(report.state, "empty");
    // Every failure, up to the one before the queued peer was served.
    let pauses = accept_pauses(&log);
    assert_eq!(
        pauses.get(..doubling.len()),
        Some(&doubling.map(String::from)[..]),
        "each failed accept doubles the pause: {pauses:?}"
    );
    assert!(
        pauses[doubling.len()..].iter().all(|p| p == "1s"),
        "the pause stays at its ceiling: {pauses:?}"
    );
    // At the ceiling a backing-off daemon fails once a second until the
    // slot is free, and the slot was freed as soon as the ceiling was seen;
    // a spin fails at every poll, thousands of times.
    assert!(
        pauses.len() < 50,
        "{} accept failures logged: a spin",
        pauses.len()
    );
}

/// The pause each failed `accept` logged, in order (`accept on …:
/// EMFILE …; pausing accepts for 20ms`).
fn accept_pauses(log: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    text.lines()
        .filter(|l| l.contains("accept on"))
        .filter_map(|l| l.split("pausing accepts for ").nth(1))
        .map(|p| {
            p.chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '.')
                .collect()
        })
        .collect()
}

/// Creating and populating memory (seconds for large sizes) happens
/// outside the daemon's lock: status is answered meanwhile, and shows the
/// allocation recorded but not yet resident. (With the lock held throughout,
/// every status would wait and then see it fully resident.)
#[test]
fn status_is_answered_while_an_allocation_is_populated() {
    let gmsd = Gmsd::start(&[]);
    let socket = gmsd.socket.clone();
    let size = 1024 * MIB;
    let writer = std::thread::spawn(move || {
        let mut c = Client::connect(&socket, Mode::Rw, "big").unwrap();
        let w = c.allocate("weights", size).unwrap();
        (c, w)
    });
    let mut seen_populating = false;
    while !writer.is_finished() {
        let s = gmsd.status();
        seen_populating |= s.bytes == size && s.resident_bytes < size;
    }
    let (c, w) = writer.join().unwrap();
    assert!(
        seen_populating,
        "no status was answered while the allocation was being populated"
    );
    let s = gmsd.status();
    assert_eq!((s.bytes, s.resident_bytes), (size, size));
    drop((w, c));
}

/// Metadata is measured as it is encoded, not as claimed: control
/// characters take six bytes each in a layout, and a layout must reach a
/// reader under its response limit.
#[test]
fn metadata_is_limited_by_its_encoded_size() {
    let gmsd = Gmsd::start(&["--max-metadata-bytes", "256K"]);
    let mut w = Client::connect(&gmsd.socket, Mode::Rw, "w").unwrap();
    let mut weights = vec![w.allocate("weights", 4096).unwrap()];
    let sneaky = "\u{1}".repeat(8000);
    let mut stored = 0usize;
    let err = loop {
        match w.put_meta(&format!("k{stored}"), &sneaky) {
            Ok(()) => stored += 1,
            Err(e) => break e,
        }
        assert!(stored < 64, "32 KiB claimed took more than 256 KiB encoded");
    };
    assert!(
        matches!(
            err,
            gms::Error::Remote {
                code: ErrorCode::LimitExceeded,
                ..
            }
        ),
        "{err}"
    );
    // 8000 control characters are 48000 bytes encoded: five fit.
    assert_eq!(stored, 5);
    drop(weights.pop());
}

#[test]
fn sleep_wake_and_kv_cache_in_a_real_lease() {
    let gmsd = Gmsd::start(&[]);
    let mut w = Client::connect(&gmsd.socket, Mode::Rw, "engine").unwrap();
    let mut weights = vec![w.allocate("weights", 3 * MIB).unwrap()];
    weights[0].bytes_mut().unwrap()[..5].copy_from_slice(b"hello");
    w.put_meta("tensor.a", r#"{"alloc":1,"offset":0}"#).unwrap();
    w.commit(&mut weights).unwrap();
    assert_eq!(
        w.get_meta("tensor.a").unwrap().as_deref(),
        Some(r#"{"alloc":1,"offset":0}"#)
    );
    let addr = weights[0].addr();
    weights[0].sleep().unwrap();
    assert!(!weights[0].is_awake() && weights[0].bytes().is_none());
    weights[0].wake().unwrap();
    assert_eq!(weights[0].addr(), addr);
    assert_eq!(&weights[0].bytes().unwrap()[..5], b"hello");
    assert!(
        weights[0].bytes_mut().is_none(),
        "committed weights are read-only"
    );

    let mut kv = w.reserve_kv(8 * MIB).unwrap();
    assert!(kv.with_backed_mut(|b| b.is_empty()));
    kv.materialise().unwrap();
    kv.with_backed_mut(|b| b[MIB as usize] = 9);
    kv.release().unwrap();
    kv.materialise().unwrap();
    assert_eq!(kv.with_backed_mut(|b| b[MIB as usize]), 0);
}

/// The promoted engine's wake through a real lease, on a host "device"
/// whose KV memory is limited: the dead engine (another client) holds most
/// of it; the new engine's cache wakes with what fits, serves writes into
/// its backed prefix, and grows to all of it when the dead engine's lease
/// ends and its cache is gone.
#[test]
fn a_woken_kv_cache_grows_when_the_dead_engines_memory_comes_back() {
    use gms::kv::Growth;
    use gms::mapper::{HostMapper, HostMemory};
    let gmsd = Gmsd::start(&[]);
    let device = HostMemory::new(16 * MIB);
    let mapper = HostMapper::with_limit(device.clone(), 2 * MIB).unwrap();
    let mut dead = Client::connect_with(mapper.clone(), &gmsd.socket, Mode::Rw, "dead").unwrap();
    let mut weights = vec![dead.allocate("weights", MIB).unwrap()];
    dead.commit(&mut weights).unwrap();
    let mut dead_kv = dead.reserve_kv(12 * MIB).unwrap();
    dead_kv.materialise().unwrap();
    let promoted = Client::connect_with(mapper, &gmsd.socket, Mode::Ro, "promoted").unwrap();
    let mut kv = promoted.reserve_kv(16 * MIB).unwrap();
    assert_eq!(kv.chunk(), 2 * MIB);
    assert_eq!(
        kv.wake(MIB).unwrap(),
        2 * MIB,
        "one chunk at once on the caller's thread"
    );
    let watch = kv.watch();
    assert_eq!(
        watch.wait_backed(4 * MIB, DEADLINE),
        4 * MIB,
        "what fits now"
    );
    assert_eq!(kv.growth(), Growth::Growing);
    kv.with_backed_mut(|b| b[3 * MIB as usize] = 5);
    drop(dead_kv);
    drop(weights);
    drop(dead);
    assert_eq!(watch.wait_backed(16 * MIB, DEADLINE), 16 * MIB);
    assert_eq!(kv.growth(), Growth::Backed);
    assert_eq!(
        kv.with_backed_mut(|b| (b.len() as u64, b[3 * MIB as usize])),
        (16 * MIB, 5)
    );
    drop(kv);
    assert_eq!(device.used(), 0, "every chunk given back");
}

#[test]
fn a_thousand_connect_allocate_disconnect_cycles_leak_nothing() {
    let gmsd = Gmsd::start(&[]);
    let cycle = || {
        // The previous cycle's lease ends when the daemon sees the close,
        // which may be a moment after it: rw is refused until then.
        let mut c = Client::connect_wait(&gmsd.socket, Mode::Rw, "cycle", DEADLINE).unwrap();
        let mut w = c.allocate("weights", MIB).unwrap();
        w.bytes_mut().unwrap()[0] = 1;
    };
    // Warm up thread stacks and allocator arenas before the baseline.
    for _ in 0..50 {
        cycle();
    }
    gmsd.wait_idle();
    gmsd.assert_fds_back_to_idle();
    let rss = gmsd.rss_kib();
    for _ in 0..1000 {
        cycle();
    }
    let s = gmsd.wait_idle();
    assert_eq!((s.bytes, s.allocations, s.state.as_str()), (0, 0, "empty"));
    gmsd.assert_fds_back_to_idle();
    let rss_after = gmsd.rss_kib();
    // A leaked 1 MiB allocation per cycle would be ~1000 MiB.
    assert!(rss_after < rss + 4 * 1024, "RSS {rss} -> {rss_after} KiB");
}

/// Sends raw bytes (and fds) on a fresh connection and returns the error
/// code the daemon answered with, checking it then closed the connection.
fn raw_exchange(socket: &Path, setup: &[Request], send: impl FnOnce(&UnixStream)) -> ErrorCode {
    let s = UnixStream::connect(socket).unwrap();
    for req in setup {
        wire::send(s.as_fd(), &protocol::encode_request(req).unwrap(), &[]).unwrap();
        let f = wire::recv(&s, protocol::MAX_RESPONSE_BYTES).unwrap();
        let resp = protocol::decode_response(&f.body, f.fds.len()).unwrap();
        assert!(
            !matches!(resp, Response::Error { .. }),
            "setup {req:?} failed: {resp:?}"
        );
    }
    send(&s);
    let f = wire::recv(&s, protocol::MAX_RESPONSE_BYTES).unwrap();
    let code = match protocol::decode_response(&f.body, f.fds.len()).unwrap() {
        Response::Error { code, message } => {
            assert!(!message.is_empty());
            code
        }
        other => panic!("expected an error, got {other:?}"),
    };
    assert!(
        matches!(
            wire::recv(&s, protocol::MAX_RESPONSE_BYTES),
            Err(gms::Error::Closed)
        ),
        "connection closed after the error"
    );
    code
}

fn frame(s: &UnixStream, body: &[u8]) {
    wire::send(s.as_fd(), body, &[]).unwrap();
}

/// Name, requests that set the stage, the bad thing sent, the expected code.
type BadCase<'a> = (
    &'static str,
    Vec<Request>,
    Box<dyn FnOnce(&UnixStream) + 'a>,
    ErrorCode,
);

#[test]
fn bad_input_gets_a_clear_error_and_a_closed_connection() {
    let gmsd = Gmsd::start(&[
        "--max-bytes",
        "8M",
        "--max-allocations",
        "2",
        "--max-metadata-bytes",
        "64",
    ]);
    let sock = &gmsd.socket;
    let rw = || {
        vec![Request::Hello {
            mode: Mode::Rw,
            client: "bad".into(),
        }]
    };
    let alloc = |va: u64, size: u64| Request::Allocate {
        tag: "weights".into(),
        size,
        va,
    };
    let cases: Vec<BadCase> = vec![
        (
            "non-JSON",
            vec![],
            Box::new(|s| frame(s, b"\x00\x01 not json")),
            ErrorCode::BadMessage,
        ),
        (
            "unknown version",
            vec![],
            Box::new(|s| frame(s, br#"{"version":9,"op":"status"}"#)),
            ErrorCode::UnsupportedVersion,
        ),
        (
            "unknown op",
            vec![],
            Box::new(|s| frame(s, br#"{"version":1,"op":"format_disk"}"#)),
            ErrorCode::BadMessage,
        ),
        (
            "oversized",
            vec![],
            Box::new(|s| {
                use std::io::Write;
                (&*s).write_all(&(1u32 << 30).to_le_bytes()).unwrap();
            }),
            ErrorCode::TooLarge,
        ),
        (
            "truncated",
            vec![],
            Box::new(|s| {
                use std::io::Write;
                (&*s).write_all(&[50, 0, 0, 0, b'{']).unwrap();
                s.shutdown(std::net::Shutdown::Write).unwrap();
            }),
            ErrorCode::Truncated,
        ),
        (
            "op before hello",
            vec![],
            Box::new(|s| frame(s, &protocol::encode_request(&Request::Commit).unwrap())),
            ErrorCode::NotPermitted,
        ),
        (
            "hello twice",
            rw(),
            Box::new(|s| frame(s, &protocol::encode_request(&rw()[0]).unwrap())),
            ErrorCode::NotPermitted,
        ),
        (
            "unknown id",
            rw(),
            Box::new(|s| {
                frame(
                    s,
                    &protocol::encode_request(&Request::Export { ids: vec![999] }).unwrap(),
                )
            }),
            ErrorCode::UnknownAllocation,
        ),
        (
            "ro without a layout",
            vec![],
            Box::new(|s| {
                let hello = Request::Hello {
                    mode: Mode::Ro,
                    client: String::new(),
                };
                frame(s, &protocol::encode_request(&hello).unwrap())
            }),
            ErrorCode::NoLayout,
        ),
        (
            "byte limit",
            rw(),
            Box::new(move |s| {
                frame(
                    s,
                    &protocol::encode_request(&alloc(0x5a00_0000_0000, 16 * MIB)).unwrap(),
                )
            }),
            ErrorCode::LimitExceeded,
        ),
        (
            "allocation limit",
            vec![
                rw()[0].clone(),
                alloc(0x5a00_0000_0000, 4096),
                alloc(0x5a00_0010_0000, 4096),
            ],
            Box::new(move |s| {
                frame(
                    s,
                    &protocol::encode_request(&alloc(0x5a00_0020_0000, 4096)).unwrap(),
                )
            }),
            ErrorCode::LimitExceeded,
        ),
        (
            "overlapping address",
            vec![rw()[0].clone(), alloc(0x5a00_0000_0000, 8192)],
            Box::new(move |s| {
                frame(
                    s,
                    &protocol::encode_request(&alloc(0x5a00_0000_1000, 4096)).unwrap(),
                )
            }),
            ErrorCode::AddressConflict,
        ),
        (
            "unaligned address",
            rw(),
            Box::new(move |s| {
                frame(
                    s,
                    &protocol::encode_request(&alloc(0x5a00_0000_0010, 4096)).unwrap(),
                )
            }),
            ErrorCode::Invalid,
        ),
        (
            "metadata limit",
            rw(),
            Box::new(|s| {
                let put = Request::PutMeta {
                    key: "k".into(),
                    value: "x".repeat(100),
                };
                frame(s, &protocol::encode_request(&put).unwrap())
            }),
            ErrorCode::LimitExceeded,
        ),
    ];
    for (name, setup, send, want) in cases {
        let got = raw_exchange(sock, &setup, send);
        assert_eq!(got, want, "case '{name}'");
        // The writer that broke a rule lost its lease and its allocations.
        let s = gmsd.wait_idle();
        assert_eq!(
            (s.bytes, s.leases.len()),
            (0, 0),
            "case '{name}' left state behind"
        );
    }
    gmsd.assert_fds_back_to_idle();
    assert!(
        gmsd.stop().success(),
        "daemon survived all of it and stops cleanly"
    );
}

/// No request carries descriptors: gmsd turns `SO_PASSRIGHTS` off, so on
/// Linux >= 6.16 the kernel refuses them at the sender; on older kernels
/// gmsd answers `wrong_fd_count` and closes the connection.
#[test]
fn a_request_with_descriptors_is_refused() {
    let gmsd = Gmsd::start(&[]);
    let s = UnixStream::connect(&gmsd.socket).unwrap();
    let body = protocol::encode_request(&Request::Status).unwrap();
    let file = tempfile::tempfile().unwrap();
    match wire::send(s.as_fd(), &body, &[file.as_fd()]) {
        Err(gms::Error::Sys {
            source: nix::errno::Errno::EPERM,
            ..
        }) => {}
        Ok(()) => {
            let f = wire::recv(&s, protocol::MAX_RESPONSE_BYTES).unwrap();
            let resp = protocol::decode_response(&f.body, f.fds.len()).unwrap();
            assert!(
                matches!(
                    resp,
                    Response::Error {
                        code: ErrorCode::WrongFdCount,
                        ..
                    }
                ),
                "{resp:?}"
            );
        }
        Err(e) => panic!("sending a request with a descriptor: {e}"),
    }
    drop(s);
    gmsd.wait_idle();
    gmsd.assert_fds_back_to_idle();
    assert!(gmsd.stop().success());
}

#[test]
fn a_peer_whose_uid_is_not_allowed_is_refused() {
    let gmsd = Gmsd::start(&["--allow-uid", "4242"]);
    for result in [
        Client::connect(&gmsd.socket, Mode::RwOrRo, "intruder").err(),
        client::status(&gmsd.socket).err(),
    ] {
        let err = result.expect("refused");
        assert!(
            matches!(
                err,
                gms::Error::Remote {
                    code: ErrorCode::PermissionDenied,
                    ..
                }
            ),
            "{err}"
        );
    }
}

#[test]
fn sigterm_frees_everything_and_mapped_readers_keep_their_pages() {
    let gmsd = Gmsd::start(&[]);
    let (_w, written) = writer(&gmsd, 2, "2M", true);
    let mut reader = gmsd.probe(&["reader"]);
    reader.expect("ready");
    let status = gmsd.stop();
    assert!(status.success(), "{status:?}");
    // The kernel keeps pages alive while a process maps them.
    reader.tell("check");
    assert_eq!(reader.expect("checksum"), written["checksum"]);
}

#[test]
fn world_writable_socket_dir_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_gmsd"))
        .args(["serve", "--socket-dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("world-writable"));
}

#[test]
fn status_command_prints_state_and_json() {
    let gmsd = Gmsd::start(&[]);
    let (_w, _) = writer(&gmsd, 1, "1M", true);
    let text = Command::new(env!("CARGO_BIN_EXE_gmsd"))
        .args(["status", "--socket"])
        .arg(&gmsd.socket)
        .output()
        .unwrap();
    assert!(text.status.success());
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("state committed") && text.contains("weights"),
        "{text}"
    );
    let json = Command::new(env!("CARGO_BIN_EXE_gmsd"))
        .args(["status", "--json", "--socket"])
        .arg(&gmsd.socket)
        .output()
        .unwrap();
    let report: StatusReport = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!((report.bytes, report.leases.len()), (MIB, 1));
}
