//! The pair's KV pool through the real `gmsd` and real engine processes
//! (`gms-probe kv`): the write lease goes to the holder of the election
//! lock only, the pool and what was written in it outlive the writer, the
//! fence opens only once every earlier writer is gone, and a reset (the
//! supervisor's cold restart) makes the next pool a new one. Each test
//! has its own socket directory and lock file; every process it starts is
//! killed and reaped on drop.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Duration;

use gms::client;
use gms::protocol::ErrorCode;
use gms::status::StatusReport;
use serde_json::Value;
use shadow_wait::until;

const DEADLINE: Duration = Duration::from_secs(20);
const STEP: Duration = Duration::from_millis(5);

/// gmsd serving a socket directory of its own, with `--lock` when given.
struct Gmsd {
    child: Child,
    socket: PathBuf,
    _dir: tempfile::TempDir,
}

impl Gmsd {
    fn start(lock: Option<&Path>) -> Gmsd {
        Gmsd::start_with(lock, &[])
    }

    fn start_with(lock: Option<&Path>, extra: &[&str]) -> Gmsd {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_gmsd"));
        cmd.args(["serve", "--log-level", "warn", "--socket-dir"])
            .arg(dir.path().join("gms"));
        if let Some(lock) = lock {
            cmd.arg("--lock").arg(lock);
        }
        cmd.args(extra);
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .expect("gmsd");
        let mut line = String::new();
        let stdout = child.stdout.take().expect("stdout");
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("ready line");
        let socket = PathBuf::from(line.trim().strip_prefix("ready ").unwrap_or_else(|| {
            let _ = child.kill();
            panic!("gmsd did not become ready: {line:?}")
        }));
        Gmsd {
            child,
            socket,
            _dir: dir,
        }
    }

    fn status(&self) -> StatusReport {
        client::status(&self.socket).expect("status")
    }

    /// gmsd's open descriptors.
    fn open_fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.child.id()))
            .expect("gmsd's fd directory")
            .count()
    }
}

impl Drop for Gmsd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A `gms-probe kv` process.
struct Probe {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Probe {
    fn spawn(gmsd: &Gmsd, lock: &Path, extra: &[&str]) -> Probe {
        let mut child = Command::new(env!("CARGO_BIN_EXE_gms-probe"))
            .arg("--socket")
            .arg(&gmsd.socket)
            .args(["kv", "--size", "1M", "--lock"])
            .arg(lock)
            .args(extra)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("gms-probe");
        let stdin = child.stdin.take().expect("stdin");
        let stdout = BufReader::new(child.stdout.take().expect("stdout"));
        Probe {
            child,
            stdin,
            stdout,
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The next line: its keyword and JSON payload.
    fn line(&mut self) -> (String, Value) {
        let mut line = String::new();
        self.stdout.read_line(&mut line).expect("probe output");
        let (word, rest) = line.trim().split_once(' ').unwrap_or((line.trim(), "{}"));
        let value = serde_json::from_str(rest).unwrap_or(Value::Null);
        (word.to_owned(), value)
    }

    fn expect(&mut self, keyword: &str) -> Value {
        let (word, value) = self.line();
        assert_eq!(word, keyword, "probe said {word} {value}");
        value
    }

    fn tell(&mut self, line: &str) {
        writeln!(self.stdin, "{line}").expect("probe stdin");
        self.stdin.flush().expect("flush");
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Probe {
    fn drop(&mut self) {
        self.kill();
    }
}

fn lock_file(dir: &Path) -> PathBuf {
    let path = dir.join("lock");
    std::fs::write(&path, b"").expect("lock file");
    path
}

#[test]
fn the_write_lease_goes_to_the_lock_holder_and_the_pool_outlives_it() {
    let dir = tempfile::tempdir().expect("temp dir");
    let lock = lock_file(dir.path());
    let gmsd = Gmsd::start(Some(&lock));

    let mut first = Probe::spawn(&gmsd, &lock, &[]);
    let granted = first.expect("ready");
    assert_eq!(granted["created"], true, "{granted}");
    assert_eq!(granted["fenced"], true, "nobody wrote before: {granted}");
    assert_eq!(granted["first"], 0, "a new pool is zeroed: {granted}");
    first.tell("write 7");
    first.expect("written");

    // Parked: waits for the lock, so it has asked for nothing yet.
    let mut second = Probe::spawn(&gmsd, &lock, &[]);
    // Not holding the lock: refused, and told why.
    let mut stranger = Probe::spawn(&gmsd, &lock, &["--no-lock"]);
    let refused = stranger.expect("error");
    assert_eq!(
        refused["code"],
        ErrorCode::NotPermitted.to_string(),
        "{refused}"
    );
    assert!(
        refused["message"]
            .as_str()
            .is_some_and(|m| m.contains("election lock")),
        "{refused}"
    );

    let pool = granted["pool"].as_u64().expect("pool id");
    first.kill();
    let carried = second.expect("ready");
    assert_eq!(carried["created"], false, "{carried}");
    assert_eq!(carried["pool"].as_u64(), Some(pool), "the same pool");
    assert_eq!(carried["va"], granted["va"], "at the same address");
    assert_eq!(carried["first"], 7, "what the dead writer wrote is there");
    second.tell("fence 10000");
    assert_eq!(second.expect("fence")["passed"], true);

    let kv = gmsd.status().kv.expect("the pool in the status");
    assert_eq!((kv.pool, kv.grants), (pool, 2));
    assert_eq!(kv.writer_pid, Some(second.pid() as i32));
    assert!(kv.writer_connected);
    assert_eq!(kv.fence_waits_for, 0);
}

#[test]
fn the_fence_waits_for_an_earlier_writer_that_still_lives() {
    let dir = tempfile::tempdir().expect("temp dir");
    let lock = lock_file(dir.path());
    let gmsd = Gmsd::start(Some(&lock));

    let mut first = Probe::spawn(&gmsd, &lock, &[]);
    first.expect("ready");
    let mut second = Probe::spawn(&gmsd, &lock, &[]);
    // The first lets the lock go but lives on, its mapping writable: the
    // second is granted the lease, behind a closed fence.
    first.tell("unlock");
    first.expect("unlocked");
    let granted = second.expect("ready");
    assert_eq!(granted["fenced"], false, "{granted}");
    second.tell("fence 300");
    assert_eq!(second.expect("fence")["passed"], false);
    assert_eq!(gmsd.status().kv.expect("pool").fence_waits_for, 1);
    first.kill();
    second.tell("fence 10000");
    assert_eq!(
        second.expect("fence")["passed"],
        true,
        "the fence opens once the earlier writer is gone"
    );
}

#[test]
fn a_reset_makes_the_next_pool_a_new_one() {
    let dir = tempfile::tempdir().expect("temp dir");
    let lock = lock_file(dir.path());
    let gmsd = Gmsd::start(Some(&lock));
    // Before any connection: a status call's lingers a moment after it.
    let fds_without_pool = gmsd.open_fds();

    let mut first = Probe::spawn(&gmsd, &lock, &[]);
    let before = first.expect("ready");
    first.tell("write 9");
    first.expect("written");
    first.kill();
    until("the writer's connection to end", DEADLINE, STEP, || {
        (!gmsd.status().kv.expect("pool").writer_connected).then_some(())
    });
    // This test started gmsd: it is the supervisor, which may reset.
    client::reset(&gmsd.socket).expect("reset");
    assert!(gmsd.status().kv.is_none(), "the pool went with the reset");
    assert_eq!(gmsd.status().bytes, 0);
    // Its memory, its export, its index and the fence's pidfds are closed.
    until(
        "gmsd's descriptors back to none of the pool's",
        DEADLINE,
        STEP,
        || (gmsd.open_fds() == fds_without_pool).then_some(()),
    );

    let mut next = Probe::spawn(&gmsd, &lock, &[]);
    let after = next.expect("ready");
    assert_eq!(after["created"], true, "{after}");
    assert_ne!(after["pool"], before["pool"], "a new pool has a new id");
    assert_eq!(after["first"], 0, "nothing carried over a reset");
}

#[test]
fn a_reset_is_refused_while_the_write_lease_is_held() {
    let dir = tempfile::tempdir().expect("temp dir");
    let lock = lock_file(dir.path());
    let gmsd = Gmsd::start(Some(&lock));
    let mut writer = Probe::spawn(&gmsd, &lock, &[]);
    writer.expect("ready");
    let err = client::reset(&gmsd.socket).expect_err("reset under a write lease");
    assert_eq!(err.code(), ErrorCode::NotPermitted, "{err}");
    assert!(gmsd.status().kv.is_some());
}

#[test]
fn without_a_lock_no_engine_gets_the_write_lease() {
    let dir = tempfile::tempdir().expect("temp dir");
    let lock = lock_file(dir.path());
    let gmsd = Gmsd::start(None);
    let mut probe = Probe::spawn(&gmsd, &lock, &[]);
    let refused = probe.expect("error");
    assert!(
        refused["message"]
            .as_str()
            .is_some_and(|m| m.contains("--lock")),
        "{refused}"
    );
    assert!(gmsd.status().kv.is_none());
}

#[test]
fn the_pool_counts_against_the_daemons_byte_limit() {
    let dir = tempfile::tempdir().expect("temp dir");
    let lock = lock_file(dir.path());
    let gmsd = Gmsd::start_with(Some(&lock), &["--max-bytes", "4M"]);
    let mut pool = Probe::spawn(&gmsd, &lock, &[]);
    pool.expect("ready");
    assert_eq!(
        gmsd.status().bytes,
        1 << 20,
        "the pool's MiB is the daemon's"
    );
    // Weights of 4 MiB on top of the pool's 1 MiB: over the limit.
    let out = Command::new(env!("CARGO_BIN_EXE_gms-probe"))
        .arg("--socket")
        .arg(&gmsd.socket)
        .args(["writer", "--size", "4M", "--commit"])
        .stdin(Stdio::null())
        .output()
        .expect("gms-probe writer");
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        said.contains(&ErrorCode::LimitExceeded.to_string()),
        "a writer over the limit with the pool: {said}"
    );
}

#[test]
fn a_pool_of_several_allocations_is_mapped_first_part_first_and_carried_whole() {
    let dir = tempfile::tempdir().expect("temp dir");
    let lock = lock_file(dir.path());
    // 1 MiB in allocations of 256 KiB: four of them.
    let gmsd = Gmsd::start_with(Some(&lock), &["--kv-chunk", "256K"]);

    let mut first = Probe::spawn(&gmsd, &lock, &["--first", "1"]);
    let granted = first.expect("ready");
    assert_eq!(granted["created"], true, "{granted}");
    assert_eq!(
        granted["mapped_at_grant"],
        256 << 10,
        "the grant maps the first allocation only: {granted}"
    );
    assert_eq!(
        granted["mapped"],
        1 << 20,
        "the rest is mapped after it: {granted}"
    );
    assert_eq!(
        (granted["first"].clone(), granted["last"].clone()),
        (0.into(), 0.into())
    );
    first.tell("write 5");
    first.expect("written");

    // The next holder maps it whole before its grant returns, and finds
    // what was written in the first allocation and in the last.
    let mut second = Probe::spawn(&gmsd, &lock, &[]);
    first.kill();
    let carried = second.expect("ready");
    assert_eq!(carried["created"], false, "{carried}");
    assert_eq!(carried["pool"], granted["pool"]);
    assert_eq!(carried["va"], granted["va"], "at the same address");
    assert_eq!(carried["mapped_at_grant"], 1 << 20, "{carried}");
    assert_eq!(
        (carried["first"].clone(), carried["last"].clone()),
        (5.into(), 5.into())
    );
    drop(second);
    // gmsd kept each allocation once: its status counts the pool's bytes.
    assert_eq!(gmsd.status().kv.expect("pool").size, 1 << 20);
}

#[test]
fn a_pool_that_would_need_too_many_allocations_gets_larger_ones() {
    let dir = tempfile::tempdir().expect("temp dir");
    let lock = lock_file(dir.path());
    // 1 MiB in 4 KiB allocations would be 256 descriptors in one grant:
    // gmsd makes fewer, larger ones, and the grant still fits a message.
    let gmsd = Gmsd::start_with(Some(&lock), &["--kv-chunk", "4K"]);
    let mut probe = Probe::spawn(&gmsd, &lock, &["--first", "1"]);
    let granted = probe.expect("ready");
    let part = granted["mapped_at_grant"]
        .as_u64()
        .expect("mapped_at_grant");
    let parts = (1u64 << 20).div_ceil(part);
    assert!(
        part > 4096 && parts as usize <= gms::protocol::MAX_KV_CHUNKS,
        "{part} bytes per allocation, {parts} of them: {granted}"
    );
    assert_eq!(granted["mapped"], 1 << 20, "{granted}");
}
