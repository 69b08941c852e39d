//! `shadow_engine_kit::lock::Holder` with real processes and real SIGKILLs.
//!
//! No test harness (`harness = false`): the holder is forked, which
//! `Holder::start` allows only in a process of one thread, and libtest
//! runs each test on a thread of its own. This binary is both the test and
//! its engines: run with `LOCK_TEST_ENGINE=<mode>` it is an engine
//! (`engine()`), else it runs every check below in order, and any failure
//! panics (the children are killed and reaped on the way out).
//!
//! Every wait is bounded by LIMIT, which only a broken holder reaches. The
//! one comparison of times is a ratio within one run: the shadow's wake
//! after a SIGKILL of a large engine, the lock held by the engine itself
//! against through the holder.
//!
//! Figures (not a test): `LOCK_FIGURES=1024,2048 LOCK_RUNS=5 cargo test
//! -p shadow-engine-kit --test lock_holder` prints the medians at each size,
//! for a kill of the engine alone and of its process group; with
//! `LOCK_TEST_SHARED=1` the engines' memory is a shared memfd mapping (as
//! weights mapped from a GMS host pool) instead of private memory.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};
use nix::sys::signal::{kill, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use shadow_engine_kit::lock::{Holder, LockError};
use shadow_engine_kit::watchdog::Pacer;

const LIMIT: Duration = Duration::from_secs(30);
const MODE: &str = "LOCK_TEST_ENGINE";

fn main() {
    if let Ok(mode) = std::env::var(MODE) {
        engine(&mode);
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let lock = dir.path().join("engine.lock");
    File::create(&lock).expect("create the lock file");

    // First, while this process has one thread.
    the_holder_holds_it_for_the_engine(&lock);
    a_second_thread_refuses_the_fork(&lock);
    a_parked_engine_pings_while_the_holder_waits(&lock);

    // Orphaned holders are reparented here and reaped: the proof that
    // they are gone.
    // SAFETY: prctl with integer arguments only.
    let rc = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    assert_eq!(rc, 0, "PR_SET_CHILD_SUBREAPER: {}", Errno::last());

    if let Ok(sizes) = std::env::var("LOCK_FIGURES") {
        figures(&lock, &sizes);
        return;
    }
    a_lone_kill_of_the_engine_frees_the_lock(&lock);
    a_holder_killed_alone_ends_its_engine(&lock);
    an_engine_killed_before_acquire_takes_nothing(&lock);
    the_shadow_wakes_faster_through_the_holder(&lock);
    eprintln!("lock_holder: every check passed");
}

/// An engine: takes the lock its way ("direct": flock itself; "holder":
/// a Holder started before it grows; "started": a Holder never asked),
/// grows to LOCK_TEST_MIB of touched memory, prints the pid that holds the
/// lock (or would) and whether it is held, then sleeps until killed.
fn engine(mode: &str) -> ! {
    let path = PathBuf::from(std::env::var_os("LOCK_TEST_PATH").expect("LOCK_TEST_PATH"));
    let mib: usize = std::env::var("LOCK_TEST_MIB")
        .ok()
        .and_then(|m| m.parse().ok())
        .unwrap_or(0);
    let mut holder = (mode != "direct").then(|| Holder::start(&path).expect("Holder::start"));
    let grown = if std::env::var_os("LOCK_TEST_SHARED").is_some() {
        shared_memory(mib << 20)
    } else {
        vec![1u8; mib << 20]
    };
    std::hint::black_box(&grown);
    let mut _direct = None;
    match (mode, holder.as_mut()) {
        ("direct", _) => {
            let f = File::open(&path).expect("open the lock");
            _direct = Some(Flock::lock(f, FlockArg::LockExclusive).expect("flock"));
            println!("{} true", std::process::id());
        }
        ("holder", Some(h)) => {
            h.acquire(None, || {}).expect("acquire");
            println!("{} {}", h.pid(), h.is_held());
        }
        (_, Some(h)) => println!("{} {}", h.pid(), h.is_held()),
        (_, None) => unreachable!("a holder for every mode but direct"),
    }
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

/// `len` bytes of a memfd mapped shared and touched (as weights mapped
/// from a GMS host pool are): the kernel unmaps them, too, before it drops
/// the flock. Returns an empty Vec: the mapping lives until the exit.
fn shared_memory(len: usize) -> Vec<u8> {
    use nix::sys::mman::{mmap, MapFlags, ProtFlags};
    use std::os::fd::FromRawFd;
    // SAFETY: memfd_create takes a NUL-terminated name; a descriptor it
    // returns is new and ours to own.
    let fd = unsafe {
        let raw = libc::memfd_create(c"weights".as_ptr(), libc::MFD_CLOEXEC);
        assert!(raw >= 0, "memfd_create: {}", Errno::last());
        std::os::fd::OwnedFd::from_raw_fd(raw)
    };
    nix::unistd::ftruncate(&fd, len as i64).expect("ftruncate");
    let Some(n) = std::num::NonZeroUsize::new(len) else {
        return Vec::new();
    };
    // SAFETY: a fresh mapping of a memfd of `len` bytes, written through
    // its own pointer only, and never unmapped (it lives until the exit).
    unsafe {
        let p = mmap(
            None,
            n,
            ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
            MapFlags::MAP_SHARED,
            &fd,
            0,
        )
        .expect("mmap");
        std::ptr::write_bytes(p.as_ptr().cast::<u8>(), 1, len);
    }
    Vec::new()
}

/// A child engine, killed and reaped when dropped.
struct Engine {
    child: Child,
    /// The pid that holds (or will hold) the lock, and whether it is held.
    holder: u32,
    held: bool,
}

impl Engine {
    fn start(lock: &Path, mode: &str, mib: usize, own_group: bool) -> Engine {
        let mut cmd = Command::new(std::env::current_exe().expect("current exe"));
        cmd.env(MODE, mode)
            .env("LOCK_TEST_PATH", lock)
            .env("LOCK_TEST_MIB", mib.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped());
        if own_group {
            cmd.process_group(0);
        }
        let mut child = cmd.spawn().expect("spawn an engine");
        let stdout = child.stdout.take().expect("piped stdout");
        // The engine's line, read on a thread so that the wait is bounded.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let mut e = Engine {
            child,
            holder: 0,
            held: false,
        };
        let line = rx
            .recv_timeout(LIMIT)
            .unwrap_or_else(|_| panic!("the {mode} engine never said it holds the lock"));
        let mut words = line.split_whitespace();
        match (words.next().and_then(|p| p.parse().ok()), words.next()) {
            (Some(pid), Some(held)) => {
                e.holder = pid;
                e.held = held == "true";
            }
            _ => panic!("the {mode} engine died before holding the lock: {line:?}"),
        }
        e
    }

    fn pid(&self) -> Pid {
        Pid::from_raw(self.child.id() as i32)
    }

    /// Waits (bounded) for the engine's exit: its status.
    fn wait(&mut self) -> std::process::ExitStatus {
        let deadline = Instant::now() + LIMIT;
        loop {
            if let Some(s) = self.child.try_wait().expect("try_wait") {
                return s;
            }
            assert!(Instant::now() < deadline, "the engine did not exit");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits (bounded) for an orphaned holder to exit, and reaps it (its
/// engine reaped first: only then is it this process's child).
fn reap(pid: u32) {
    let pid = Pid::from_raw(pid as i32);
    let deadline = Instant::now() + LIMIT;
    while Instant::now() < deadline {
        match waitpid(pid, Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) => std::thread::sleep(Duration::from_millis(5)),
            Ok(_) => return,
            // Reaped already, by its engine's own reaper thread (the
            // holder can die, of PDEATHSIG, before that thread does).
            Err(Errno::ECHILD) if !Path::new(&format!("/proc/{pid}")).exists() => return,
            Err(Errno::ECHILD) => std::thread::sleep(Duration::from_millis(5)),
            Err(e) => panic!("holder {pid}: waitpid: {e}"),
        }
    }
    let _ = kill(pid, Signal::SIGKILL);
    let _ = waitpid(pid, None);
    panic!("holder {pid} outlived its engine");
}

fn is_held(lock: &Path) -> bool {
    let f = File::open(lock).expect("open the lock");
    match Flock::lock(f, FlockArg::LockExclusiveNonblock) {
        Ok(_) => false,
        Err((_, Errno::EWOULDBLOCK)) => true,
        Err((_, e)) => panic!("flock: {e}"),
    }
}

/// The pids /proc/locks lists as holding `lock`.
fn lock_holders(lock: &Path) -> Vec<u32> {
    use std::os::unix::fs::MetadataExt;
    let ino = std::fs::metadata(lock).expect("stat the lock").ino();
    let text = std::fs::read_to_string("/proc/locks").expect("read /proc/locks");
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            if f.contains(&"->") || f.len() < 6 {
                return None;
            }
            let file_ino = f[5].rsplit(':').next()?.parse::<u64>().ok()?;
            (file_ino == ino).then(|| f[4].parse().ok()).flatten()
        })
        .collect()
}

/// SIGKILLs the engine (its process group with `group`) and blocks in
/// flock as the shadow does: the time from the kill to the lock.
fn wake_after_kill(lock: &Path, e: &Engine, group: bool) -> Duration {
    let f = File::open(lock).expect("open the lock");
    // The flock blocks on a thread of its own, so that the wait for it is
    // bounded; it reports the instant it returned.
    let (tx, rx) = std::sync::mpsc::channel();
    let target = if group {
        Pid::from_raw(-e.pid().as_raw())
    } else {
        e.pid()
    };
    let start = Instant::now();
    kill(target, Signal::SIGKILL).expect("kill the engine");
    std::thread::spawn(move || {
        let taken = Flock::lock(f, FlockArg::LockExclusive).map(|_| Instant::now());
        let _ = tx.send(taken.map_err(|(_, e)| e));
    });
    let at = rx
        .recv_timeout(LIMIT)
        .unwrap_or_else(|_| panic!("the lock was still held {LIMIT:?} after the kill"))
        .expect("the shadow's flock");
    at - start
}

fn the_holder_holds_it_for_the_engine(lock: &Path) {
    let mut h = Holder::start(lock).expect("Holder::start");
    assert!(
        !is_held(lock),
        "taken before acquire(): an engine still starting would be active"
    );
    assert!(!h.is_held());
    let proof = h.acquire(None, || {}).expect("acquire");
    assert!(h.is_held());
    assert!(is_held(lock));
    // The kernel lists the holder, this process's child, not this process.
    assert_eq!(lock_holders(lock), vec![h.pid().as_raw() as u32]);
    // The proof the holder sent: its own open file, through which the
    // kernel says the exclusive flock is held (what gmsd reads).
    let fd = proof.fd().expect("the holder sent its descriptor");
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", fd.as_raw_fd()))
        .expect("fdinfo of the proof");
    assert!(
        info.lines()
            .any(|l| l.starts_with("lock:") && l.contains("FLOCK") && l.contains("WRITE")),
        "{info}"
    );
    drop(proof);
    assert!(
        h.acquire(None, || {}).expect("again").fd().is_none(),
        "no second proof: the engine holds it already"
    );
    let pid = h.pid();
    drop(h);
    assert!(!is_held(lock), "dropping the Holder lets go");
    assert!(
        !Path::new(&format!("/proc/{pid}")).exists(),
        "the holder was reaped"
    );
    eprintln!("ok: the holder holds it for the engine");
}

fn a_second_thread_refuses_the_fork(lock: &Path) {
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let t = std::thread::spawn(move || {
        let _ = rx.recv();
    });
    let got = Holder::start(lock);
    drop(tx);
    t.join().expect("join");
    assert!(
        matches!(got, Err(LockError::Threads(n)) if n >= 2),
        "a fork with two threads must be refused: {:?}",
        got.err()
    );
    eprintln!("ok: a second thread refuses the fork");
}

fn a_parked_engine_pings_while_the_holder_waits(lock: &Path) {
    // Another engine holds the lock; this one, in a child process of its
    // own (a Holder needs one thread), pings until it is freed.
    let other = Flock::lock(File::open(lock).expect("open"), FlockArg::LockExclusive)
        .expect("the other engine's flock");
    let (r, w) = nix::unistd::pipe().expect("pipe");
    let threads = std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .count();
    assert_eq!(threads, 1, "every thread of the checks before was joined");
    // SAFETY: this process has one thread (just checked), so the child's
    // copy of memory holds no lock of another thread.
    let child = match unsafe { nix::unistd::fork() }.expect("fork") {
        nix::unistd::ForkResult::Child => {
            drop(r);
            let code = match Holder::start(lock) {
                Ok(mut h) => {
                    let mut pacer = Pacer::new(Duration::from_millis(20));
                    let ok = h
                        .acquire(Some(&mut pacer), || {
                            let _ = nix::unistd::write(&w, b"p");
                        })
                        .is_ok();
                    let _ = nix::unistd::write(&w, if ok { b"L" } else { b"X" });
                    drop(h);
                    0
                }
                Err(_) => 1,
            };
            // SAFETY: ends the child without running the test's atexit
            // handlers or unwinding into the parent's stack.
            unsafe { libc::_exit(code) }
        }
        nix::unistd::ForkResult::Parent { child } => child,
    };
    drop(w);
    let read_byte = |r: &std::os::fd::OwnedFd| {
        let mut fds = [nix::poll::PollFd::new(
            std::os::fd::AsFd::as_fd(r),
            nix::poll::PollFlags::POLLIN,
        )];
        let n = nix::poll::poll(
            &mut fds,
            nix::poll::PollTimeout::try_from(LIMIT).expect("ms"),
        )
        .expect("poll");
        assert_eq!(n, 1, "the parked engine went silent");
        let mut b = [0u8; 1];
        assert_eq!(nix::unistd::read(r, &mut b).expect("read"), 1);
        b[0]
    };
    for _ in 0..3 {
        assert_eq!(read_byte(&r), b'p', "parked: it pings, holds nothing");
    }
    drop(other); // the active engine dies
    let mut b = read_byte(&r);
    while b == b'p' {
        b = read_byte(&r);
    }
    assert_eq!(b, b'L', "the holder took the freed lock");
    assert_eq!(
        waitpid(child, None).expect("waitpid"),
        WaitStatus::Exited(child, 0)
    );
    assert!(!is_held(lock));
    eprintln!("ok: a parked engine pings while the holder waits");
}

fn a_lone_kill_of_the_engine_frees_the_lock(lock: &Path) {
    let e = Engine::start(lock, "holder", 0, false);
    assert!(e.held, "the engine learnt it holds the lock");
    assert_eq!(lock_holders(lock), vec![e.holder]);
    // Only the engine's main pid: its holder must go by itself.
    wake_after_kill(lock, &e, false);
    let holder = e.holder;
    drop(e); // reaped: its orphans are reparented here
    reap(holder);
    eprintln!("ok: a lone kill of the engine frees the lock");
}

fn a_holder_killed_alone_ends_its_engine(lock: &Path) {
    let mut e = Engine::start(lock, "holder", 0, false);
    assert!(e.held);
    kill(Pid::from_raw(e.holder as i32), Signal::SIGKILL).expect("kill the holder");
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(
        e.wait().signal(),
        Some(libc::SIGKILL),
        "an engine whose lock is lost must end"
    );
    assert!(!is_held(lock));
    eprintln!("ok: a holder killed alone ends its engine");
}

fn an_engine_killed_before_acquire_takes_nothing(lock: &Path) {
    let mut e = Engine::start(lock, "started", 0, false);
    assert!(!e.held);
    assert!(!is_held(lock));
    kill(e.pid(), Signal::SIGKILL).expect("kill");
    e.wait();
    reap(e.holder);
    assert!(!is_held(lock));
    eprintln!("ok: an engine killed before acquire takes nothing");
}

fn median(mut xs: Vec<Duration>) -> Duration {
    xs.sort();
    xs[xs.len() / 2]
}

/// Medians of `runs` kills of an engine of `mib` MiB: (direct, holder).
fn compare(lock: &Path, mib: usize, runs: usize, group: bool) -> (Duration, Duration) {
    let (mut direct, mut helper) = (Vec::new(), Vec::new());
    // Alternated, so that a busy machine slows both alike.
    for _ in 0..runs {
        for (mode, times) in [("direct", &mut direct), ("holder", &mut helper)] {
            let e = Engine::start(lock, mode, mib, group);
            times.push(wake_after_kill(lock, &e, group));
            let holder = e.holder;
            drop(e); // reaped: its orphans are reparented here
            if mode == "holder" {
                reap(holder);
            }
        }
    }
    (median(direct), median(helper))
}

fn the_shadow_wakes_faster_through_the_holder(lock: &Path) {
    // 1.5 GiB of touched memory: the kernel frees it before it drops the
    // flock of a process that holds the lock itself.
    let mib = 1536;
    let (direct, helper) = compare(lock, mib, 3, false);
    eprintln!(
        "kill -> shadow's flock at {mib} MiB: direct {direct:?}, through the holder {helper:?} \
         (medians of 3)"
    );
    assert!(
        helper * 4 < direct,
        "through the holder {helper:?} is no small fraction of direct {direct:?}"
    );
    eprintln!("ok: the shadow wakes faster through the holder");
}

fn figures(lock: &Path, sizes: &str) {
    let runs = std::env::var("LOCK_RUNS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(5);
    let memory = if std::env::var_os("LOCK_TEST_SHARED").is_some() {
        "a shared memfd mapping"
    } else {
        "private memory"
    };
    println!("engines of {memory}:");
    println!("| RSS | kill | direct (median) | through the holder (median) | runs |");
    println!("| --- | --- | --- | --- | --- |");
    for mib in sizes
        .split(',')
        .filter_map(|s| s.trim().parse::<usize>().ok())
    {
        for group in [false, true] {
            let (direct, helper) = compare(lock, mib, runs, group);
            println!(
                "| {mib} MiB | {} | {:.1} ms | {:.1} ms | {runs} |",
                if group {
                    "process group"
                } else {
                    "main pid alone"
                },
                direct.as_secs_f64() * 1e3,
                helper.as_secs_f64() * 1e3
            );
        }
    }
}
