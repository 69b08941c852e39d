//! `test-engine`: a small real engine that follows the engine contract
//! (docs/engine-contract.md), for the pair tests and the failover benchmark. No test fakes
//! it: it runs in a container under runc, takes the kernel lock, speaks
//! sd_notify and GMS for real.
//!
//! 0. with `--ranks N` (N > 1): starts N-1 rank processes (itself with
//!    `--rank I`), as a tensor-parallel engine does, and follows them: a
//!    rank's death ends the engine (the ranks are killed, exit 1), the group
//!    contract of docs/engine-contract.md;
//! 1. for each daemon socket in `GMS_SOCKET_DIR` (`gms-host.sock`, or one
//!    `gms-<GPU-UUID>.sock` per GPU): `rw_or_ro`; the writer fills
//!    `--weights-mib` MiB from `--seed` (+ the device's place), commits, and
//!    appends a line to `/loads.log` (in the rootfs both engines share:
//!    `/run` is each container's own tmpfs, and the runtime's files there
//!    are bound read-only); a reader imports and checks the sum;
//! 2. takes the pair's inherited listening socket when `LISTEN_FDS` is set
//!    (`shadow.dev/listen`; `--port` is then unused), else binds
//!    `127.0.0.1:<port>` with SO_REUSEPORT (not listening yet); sends
//!    `STATUS=parked`, blocks in `flock(LOCK_EX)` on `SHADOW_LOCK_PATH`;
//!    a parked engine never accepts;
//! 3. listens (its own socket), sends `READY=1`, and answers each
//!    connection with one line: `slot=<n> boot=<start µs> weights=<sum>
//!    loaded=<bool> lock_us=<t> ready_us=<t> ranks=<n> gms=<socket names,
//!    comma-separated> listen=inherited|own`.
//!
//! With `WATCHDOG_USEC` (a pair with `shadow.dev/watchdog`) it pings
//! (`WATCHDOG=1`) every half interval from the loop that waits for the
//! lock and from the loop that serves, never from a thread of its own, so
//! a stopped or stuck engine stops pinging. `--health-port P` answers
//! HTTP on P from the same serving loop (for `shadow.dev/probe`): `GET
//! /hang` stops that loop for good (the stand-in for a decode step that
//! never returns), `GET /trigger` sends `WATCHDOG=trigger` and then stops
//! it, anything else is `200 OK`. `--stall-start-ms N` stays starting N ms
//! before it parks (no `STATUS=parked`, no lock), sending
//! `EXTEND_TIMEOUT_USEC=X` every second with `--extend-start-us X`;
//! `--watchdog-usec X` sets its own interval (`WATCHDOG_USEC=X`).
//!
//! A reader whose imported weights do not sum as the seed says, or that
//! is promoted while `/weights-corrupt` exists in the shared rootfs (the
//! tests' stand-in for weights changed under it), exits with the contract's
//! `CORRUPT_EXIT`.
//!
//! With `--memo` it keeps a counter in the pair's fd store (a memfd named
//! `memo`, fetched once it holds the lock, else taken from what it
//! inherited at its start), adds one each time it becomes active, and
//! ends its answers with `memo=<n> memo_from=fetched|inherited|new
//! inherited=<descriptors of the store it got at its start>`. With
//! `--resume` it stores each connection it accepts until it has answered
//! it, and once active answers every connection the dead engine stored and
//! had not answered (the socket tells: `fdstore::bytes_written`). When
//! the runtime accepts (`SHADOW_ACCEPT=runtime`) it reads connections from
//! its hand-off socket instead, stores nothing itself, removes each once
//! answered, and resumes as with `--resume` (`listen=handed`).
//!
//! Flags: `--port N`, `--no-notify` (lock only), `--crash CODE` (exit with
//! CODE right after start), `--weights-mib N`, `--seed N` (`--help`).

use shadow_contract::{env, paths};
use std::io::Write;
use std::net::TcpListener;
use std::os::fd::OwnedFd;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::Parser;
use nix::sys::socket::{
    bind, listen, setsockopt, socket, sockopt, AddressFamily, Backlog, SockFlag, SockType,
    SockaddrIn,
};

fn now_us() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_micros()
}

#[derive(Parser)]
#[command(
    name = "test-engine",
    about = "A small real engine for the pair tests: GMS weights, the kernel lock, sd_notify, one line per connection"
)]
struct Cli {
    /// TCP port on 127.0.0.1 (SO_REUSEPORT: both engines of a pair bind it).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Only take the lock: send neither STATUS=parked nor READY=1.
    #[arg(long)]
    no_notify: bool,
    /// Exit with CODE right after start.
    #[arg(long, value_name = "CODE", allow_negative_numbers = true)]
    crash: Option<i32>,
    /// Weights written (writer) or checked (reader) through GMS, in MiB.
    #[arg(long, default_value_t = 4)]
    weights_mib: u64,
    /// Seed of the weights' values.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Processes in the engine's group (the main process and N-1 ranks).
    #[arg(long, default_value_t = 1)]
    ranks: u32,
    /// Run as rank I of a group (started by the main process).
    #[arg(long, hide = true)]
    rank: Option<u32>,
    /// Answer HTTP on this port too (127.0.0.1, SO_REUSEPORT), from the
    /// serving loop: `/hang`, `/trigger`, else 200.
    #[arg(long)]
    health_port: Option<u16>,
    /// Stay starting this long before parking.
    #[arg(long, default_value_t = 0)]
    stall_start_ms: u64,
    /// While stalling, send EXTEND_TIMEOUT_USEC=X every second.
    #[arg(long)]
    extend_start_us: Option<u64>,
    /// Send WATCHDOG_USEC=X: this engine's own watchdog interval.
    #[arg(long)]
    watchdog_usec: Option<u64>,
    /// Keep a counter in the pair's fd store: once active, take the memfd
    /// named `memo` (fetched, else inherited), add one, or store a new one
    /// holding 1; answers end with `memo=<n> memo_from=<how>`.
    #[arg(long)]
    memo: bool,
    /// Store each accepted connection until it is answered; once active,
    /// answer every connection the dead engine stored and had not.
    #[arg(long)]
    resume: bool,
    /// Never remove a connection from the store once answered (an engine
    /// that forgets: the store must not stay full of them).
    #[arg(long)]
    no_remove: bool,
}

/// What `--memo` found: the counter after this engine's increment, and
/// where its memfd came from (`fetched`, `inherited`, `new`, `none`).
struct Memo {
    count: u64,
    from: &'static str,
    /// How many of the store's descriptors the engine got at its start.
    inherited: usize,
    /// Held for the engine's life.
    _fd: Option<OwnedFd>,
}

/// Answers one connection with `line`. With a name (`--resume`, or a
/// connection the runtime handed over) the connection is stored under it
/// first (unless `stored` already: the runtime's), and removed once
/// answered: the write side shut down first, so the client sees the end
/// at once.
fn answer(
    mut c: std::net::TcpStream,
    line: &str,
    name: Option<String>,
    stored: bool,
    remove: bool,
) {
    use std::os::fd::AsFd;
    if let Some(name) = name.as_ref().filter(|_| !stored) {
        // FDPOLL=0: removed once answered (no hang-up watch needed).
        if let Err(e) = shadow_engine_kit::fdstore::store(&[c.as_fd()], name, false) {
            eprintln!("test-engine: storing {name}: {e}");
        }
    }
    let _ = c.write_all(line.as_bytes());
    if let Some(name) = &name {
        let _ = c.shutdown(std::net::Shutdown::Write);
        if remove {
            let _ = shadow_engine_kit::fdstore::remove(name);
        }
    }
}

/// `--resume`, once the engine holds the lock: every connection the dead
/// engine stored (`c-…`), or the runtime accepted and this engine was not
/// handed (`accepted.…`), and had not answered (the socket says no byte of
/// the line was written) gets this engine's line; every one is removed.
fn answer_stored(found: Vec<shadow_engine_kit::fdstore::Stored>, line: &str) {
    use std::os::fd::AsFd;
    let (mut answered, mut done) = (0, 0);
    for s in found
        .into_iter()
        .filter(|s| s.name.starts_with("c-") || shadow_contract::handoff::is_accepted_name(&s.name))
    {
        let mut c = std::net::TcpStream::from(s.fd);
        if shadow_engine_kit::tcp::bytes_written(c.as_fd()).is_ok_and(|n| n == 0) {
            let _ = c.write_all(line.as_bytes());
            answered += 1;
        } else {
            done += 1;
        }
        let _ = c.shutdown(std::net::Shutdown::Write);
        let _ = shadow_engine_kit::fdstore::remove(&s.name);
    }
    if answered + done > 0 {
        println!("test-engine: resumed {answered} connections the dead engine had accepted ({done} it had answered)");
    }
}

/// The store, once the engine holds the lock: fetched, else (no fetch
/// socket) what it inherited at its start; and which.
fn take_store(
    inherited: Vec<shadow_engine_kit::fdstore::Stored>,
) -> (Vec<shadow_engine_kit::fdstore::Stored>, &'static str) {
    match shadow_engine_kit::fdstore::fetch() {
        Ok(got) => (got, "fetched"),
        Err(shadow_engine_kit::fdstore::FetchError::NoStore) => (inherited, "inherited"),
        Err(e) => fail("fetching the fd store", e),
    }
}

/// `--memo`, once the engine holds the lock: `found` is the store
/// (`from`: how it came), `at_start` how many of its descriptors the
/// engine inherited at its start.
fn memo(
    found: &mut Vec<shadow_engine_kit::fdstore::Stored>,
    from: &'static str,
    at_start: usize,
) -> Memo {
    use std::os::unix::fs::FileExt;
    let memo = found
        .iter()
        .position(|s| s.name == "memo")
        .map(|i| found.swap_remove(i).fd);
    let (fd, from) = match memo {
        Some(fd) => (fd, from),
        None => {
            let fd = nix::sys::memfd::memfd_create("memo", nix::sys::memfd::MFdFlags::MFD_CLOEXEC)
                .unwrap_or_else(|e| fail("memfd_create", e));
            (fd, "new")
        }
    };
    let file = std::fs::File::from(fd);
    let mut now = [0u8; 8];
    let before = match file.read_at(&mut now, 0) {
        Ok(8) => u64::from_le_bytes(now),
        _ => 0,
    };
    let count = before + 1;
    file.write_at(&count.to_le_bytes(), 0)
        .unwrap_or_else(|e| fail("writing the memo", e));
    let fd = OwnedFd::from(file);
    if from == "new" {
        use std::os::fd::AsFd;
        shadow_engine_kit::fdstore::store(&[fd.as_fd()], "memo", true)
            .unwrap_or_else(|e| fail("storing the memo", e));
    }
    Memo {
        count,
        from,
        inherited: at_start,
        _fd: Some(fd),
    }
}

/// The watchdog's pings, paced from whichever loop the engine is in.
struct Pings(Option<shadow_engine_kit::watchdog::Pacer>);

impl Pings {
    /// Pings if one is due; says how long the caller may wait before the
    /// next is due (forever without a watchdog).
    fn tick(&mut self) -> Option<Duration> {
        let pacer = self.0.as_mut()?;
        let now = std::time::Instant::now();
        if pacer.due(now) {
            notify(sd_notify::NotifyState::Watchdog);
            pacer.pinged(now);
        }
        Some(pacer.wait(now))
    }
}

/// A socket bound on 127.0.0.1:`port` with SO_REUSEPORT, not listening.
fn bound(port: u16) -> OwnedFd {
    let sock = socket(
        AddressFamily::Inet,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .unwrap_or_else(|e| fail("socket", e));
    setsockopt(&sock, sockopt::ReusePort, &true).unwrap_or_else(|e| fail("SO_REUSEPORT", e));
    setsockopt(&sock, sockopt::ReuseAddr, &true).unwrap_or_else(|e| fail("SO_REUSEADDR", e));
    bind(
        std::os::fd::AsRawFd::as_raw_fd(&sock),
        &SockaddrIn::new(127, 0, 0, 1, port),
    )
    .unwrap_or_else(|e| fail("bind", e));
    sock
}

/// The serving loop stops here for good: no answer, no ping.
fn stop_serving() -> ! {
    loop {
        std::thread::park();
    }
}

/// One HTTP request on the health port, answered from the serving loop.
fn health(mut c: std::net::TcpStream) {
    use std::io::Read;
    let _ = c.set_read_timeout(Some(Duration::from_millis(200)));
    let mut buf = [0u8; 512];
    let n = c.read(&mut buf).unwrap_or(0);
    let line = String::from_utf8_lossy(&buf[..n]);
    let path = line.split_whitespace().nth(1).unwrap_or("/");
    match path {
        "/hang" => stop_serving(),
        "/trigger" => {
            notify(sd_notify::NotifyState::WatchdogTrigger);
            stop_serving()
        }
        _ => {
            let _ = c.write_all(b"HTTP/1.0 200 OK\r\nContent-Length: 3\r\n\r\nok\n");
        }
    }
}

fn notify(state: sd_notify::NotifyState<'_>) {
    // Optional by the contract: no socket only loses the hint.
    let _ = sd_notify::notify(&[state]);
}

fn fail(what: &str, e: impl std::fmt::Display) -> ! {
    eprintln!("test-engine: {what}: {e}");
    std::process::exit(70);
}

/// Weights from a seed: a simple xorshift stream.
fn fill(buf: &mut [u8], seed: u64) {
    let mut x = seed | 1;
    for chunk in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
}

fn checksum(buf: &[u8]) -> u64 {
    buf.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ *b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

struct Weights {
    sum: u64,
    loaded: bool,
    /// The daemons' socket names, comma-separated.
    names: String,
    // Held for the engine's life: the lease and the mappings.
    _keep: Box<dyn std::any::Any>,
}

/// The daemons' sockets in the GMS directory: the host daemon's, else one
/// per GPU, by name.
fn gms_sockets(dir: &Path) -> Vec<std::path::PathBuf> {
    let host = gms::client::host_socket(dir);
    if host.exists() {
        return vec![host];
    }
    let mut out: Vec<_> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_str()
                .is_some_and(paths::is_gms_socket_name)
        })
        .map(|e| e.path())
        .collect();
    out.sort();
    out
}

/// Weights on every daemon of the pair (one shard per GPU); the sum folds
/// every shard's, so an answer depends on all of them.
fn attach_gms(dir: &Path, slot: &str, mib: u64, seed: u64) -> Option<Weights> {
    let sockets = gms_sockets(dir);
    if sockets.is_empty() {
        return None;
    }
    let mut sum = 0u64;
    let mut loaded = false;
    let mut keep: Vec<Box<dyn std::any::Any>> = Vec::new();
    let mut names = Vec::new();
    for (i, socket) in sockets.iter().enumerate() {
        let shard = attach_one(socket, slot, mib, seed + i as u64);
        sum = sum.rotate_left(17) ^ shard.sum;
        loaded |= shard.loaded;
        keep.push(shard._keep);
        names.push(
            socket
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
        );
    }
    Some(Weights {
        sum,
        loaded,
        names: names.join(","),
        _keep: Box::new(keep),
    })
}

fn attach_one(socket: &Path, slot: &str, mib: u64, seed: u64) -> Weights {
    use gms::client::Client;
    use gms::protocol::{LeaseKind, Mode};
    let mut c = Client::connect_wait(
        socket,
        Mode::RwOrRo,
        &format!("engine-{slot}"),
        Duration::from_secs(10),
    )
    .unwrap_or_else(|e| fail("connecting to GMS", e));
    if c.lease() == LeaseKind::Rw {
        let mut w = c
            .allocate("weights", mib << 20)
            .unwrap_or_else(|e| fail("allocating weights", e));
        let bytes = w
            .bytes_mut()
            .unwrap_or_else(|| fail("weights", "not mapped"));
        let n = (mib << 20) as usize;
        fill(&mut bytes[..n], seed);
        let sum = checksum(&bytes[..n]);
        c.commit(std::slice::from_mut(&mut w))
            .unwrap_or_else(|e| fail("committing weights", e));
        let log = Path::new("/loads.log");
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
        {
            let _ = writeln!(
                f,
                "slot={slot} pid={} socket={}",
                std::process::id(),
                socket.display()
            );
        }
        Weights {
            sum,
            loaded: true,
            names: String::new(),
            _keep: Box::new((c, w)),
        }
    } else {
        let imported = c.import().unwrap_or_else(|e| fail("importing weights", e));
        let n = (mib << 20) as usize;
        let w = imported
            .weights
            .first()
            .unwrap_or_else(|| fail("importing weights", "empty layout"));
        let bytes = w.bytes().unwrap_or_else(|| fail("weights", "not mapped"));
        let sum = checksum(&bytes[..n.min(bytes.len())]);
        let mut expect = vec![0u8; n];
        fill(&mut expect, seed);
        if sum != checksum(&expect) {
            // The contract's status: the pair restarts cold and loads again.
            eprintln!("test-engine slot {slot}: imported weights: checksum mismatch");
            std::process::exit(shadow_contract::weights::CORRUPT_EXIT);
        }
        Weights {
            sum,
            loaded: false,
            names: String::new(),
            _keep: Box::new((c, imported)),
        }
    }
}

/// A rank: dies with the main process (as NCCL ranks do when their group
/// is gone) and otherwise waits.
fn run_rank(rank: u32) -> ! {
    // SAFETY: prctl(PR_SET_PDEATHSIG) takes a signal number and touches no memory.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
    eprintln!("test-engine rank {rank} pid {}", std::process::id());
    loop {
        std::thread::park();
    }
}

/// Starts ranks 1..n and follows them: the death of any ends the engine
/// (the others are killed, the main process exits 1), so the runtime, which
/// sees only the main process, never keeps a half group serving.
fn start_ranks(slot: &str, n: u32) {
    let exe = std::env::current_exe().unwrap_or_else(|e| fail("current_exe", e));
    let mut children = Vec::new();
    for rank in 1..n {
        let child = std::process::Command::new(&exe)
            .arg("--rank")
            .arg(rank.to_string())
            .spawn()
            .unwrap_or_else(|e| fail("starting a rank", e));
        children.push(child);
    }
    let pids: Vec<i32> = children.iter().map(|c| c.id() as i32).collect();
    for (i, mut child) in children.into_iter().enumerate() {
        let pids = pids.clone();
        let slot = slot.to_string();
        std::thread::spawn(move || {
            let status = child.wait();
            eprintln!(
                "test-engine slot {slot}: rank {} ended ({status:?}): ending the engine",
                i + 1
            );
            for p in pids {
                // SAFETY: kill(2) of our own rank processes.
                unsafe { libc::kill(p, libc::SIGKILL) };
            }
            std::process::exit(1);
        });
    }
}

fn main() {
    let Cli {
        port,
        no_notify,
        crash,
        weights_mib: mib,
        seed,
        ranks,
        rank,
        health_port,
        stall_start_ms,
        extend_start_us,
        watchdog_usec,
        memo: keep_memo,
        resume,
        no_remove,
    } = Cli::parse();
    // Handed its connections: the fetch once active is what makes it the
    // one they go to, and what the dead engine was handed is its own.
    let handed = shadow_engine_kit::handoff::enabled();
    let resume = resume || handed;
    if let Some(r) = rank {
        run_rank(r);
    }
    let speak = !no_notify;
    // As pid 1 of its container, SIGTERM would be ignored without a handler:
    // block it here and let one thread exit as a shell would (143).
    let mut term = nix::sys::signal::SigSet::empty();
    term.add(nix::sys::signal::Signal::SIGTERM);
    let _ = term.thread_block();
    std::thread::spawn(move || {
        if term.wait().is_ok() {
            std::process::exit(143);
        }
    });
    let slot = std::env::var(env::ENGINE_ID).unwrap_or_else(|_| "?".into());
    // Names this engine instance: its pid is 1 in its own pid namespace.
    let boot = now_us();
    if let Some(code) = crash {
        eprintln!("test-engine slot {slot}: crashing with {code}");
        std::process::exit(code);
    }
    if ranks > 1 {
        start_ranks(&slot, ranks);
    }
    let weights = std::env::var_os(env::GMS_SOCKET_DIR)
        .and_then(|d| attach_gms(Path::new(&d), &slot, mib, seed));
    let mut pings = Pings(
        shadow_engine_kit::watchdog::interval_from_env()
            .map(shadow_engine_kit::watchdog::Pacer::new),
    );
    if let (Some(us), Some(pacer)) = (watchdog_usec, pings.0.as_mut()) {
        notify(sd_notify::NotifyState::Custom(&format!(
            "WATCHDOG_USEC={us}"
        )));
        pacer.set_interval(Duration::from_micros(us));
    }
    // Stuck starting (a test's stand-in for an engine that never parks),
    // asking for more time every second if told to.
    let stall_until = std::time::Instant::now() + Duration::from_millis(stall_start_ms);
    while std::time::Instant::now() < stall_until {
        if let Some(us) = extend_start_us {
            notify(sd_notify::NotifyState::Custom(&format!(
                "EXTEND_TIMEOUT_USEC={us}"
            )));
        }
        std::thread::sleep(
            Duration::from_secs(1)
                .min(stall_until.saturating_duration_since(std::time::Instant::now())),
        );
    }

    // The pair's socket (already listening: connections wait in its backlog
    // until an active engine accepts), else one bound now and listening
    // only once active, so that connections reach the active.
    let (inherited, stored) = shadow_engine_kit::fdstore::split_inherited(
        shadow_engine_kit::listen::inherited(),
        |name| name.starts_with("tcp-") || name.starts_with("unix-"),
    );
    // What it inherited of the store: kept only where nothing can be
    // fetched (a parked engine holding every connection would keep them
    // open after the serving engine is done with them).
    let at_start = stored.len();
    let stored = if std::env::var_os(env::FDSTORE_SOCKET).is_some() {
        Vec::new()
    } else {
        stored
    };
    let inherited = inherited.into_iter().next();
    let listen_kind = if inherited.is_some() && handed {
        "handed"
    } else if inherited.is_some() {
        "inherited"
    } else {
        "own"
    };
    let sock: OwnedFd = match inherited {
        Some(s) => s.fd,
        None => bound(port),
    };
    let health_sock = health_port.map(bound);

    if speak {
        notify(sd_notify::NotifyState::Status("parked"));
    }
    // Alone (no variable, no pair directory: plain runc) it takes no lock.
    let lock_path = std::env::var(env::LOCK_PATH).ok().or_else(|| {
        Path::new(paths::LOCK_PATH)
            .exists()
            .then(|| paths::LOCK_PATH.to_string())
    });
    // The flock blocks in a thread; this loop waits for it and pings
    // meanwhile, and goes on the moment the lock is taken.
    let _held = lock_path.map(|lock_path| {
        let lock = std::fs::File::open(&lock_path).unwrap_or_else(|e| fail(&lock_path, e));
        if pings.0.is_none() {
            // Nothing to do while parked: the flock on this thread, as
            // before any watchdog, with no thread's wake between the
            // kernel's handoff and the wake (the failover bench times it).
            return nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusive)
                .unwrap_or_else(|(_, e)| fail("flock", e));
        }
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(nix::fcntl::Flock::lock(
                lock,
                nix::fcntl::FlockArg::LockExclusive,
            ));
        });
        loop {
            let got = match pings.tick() {
                Some(wait) => match rx.recv_timeout(wait) {
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) => continue,
                    got => got.map_err(|e| e.to_string()),
                },
                None => rx.recv().map_err(|e| e.to_string()),
            };
            match got {
                Ok(Ok(held)) => break held,
                Ok(Err((_, e))) => fail("flock", e),
                Err(e) => fail("flock", e),
            }
        }
    });
    let lock_us = now_us();
    let (mut found, from) = if keep_memo || resume {
        take_store(stored)
    } else {
        (stored, "inherited")
    };
    let memo = if keep_memo {
        memo(&mut found, from, at_start)
    } else {
        Memo {
            count: 0,
            from: "none",
            inherited: 0,
            _fd: None,
        }
    };
    // The test's stand-in for a failed digest check on promotion: the host
    // backend seals committed weights, so nothing can really change them.
    // A reader that becomes active while `/weights-corrupt` exists in the
    // engines' shared rootfs takes the file away (once) and exits as an
    // engine whose check failed must (docs/engine-contract.md).
    if weights.as_ref().is_some_and(|w| !w.loaded)
        && std::fs::remove_file("/weights-corrupt").is_ok()
    {
        eprintln!("test-engine slot {slot}: promoted onto weights that changed: exiting");
        std::process::exit(shadow_contract::weights::CORRUPT_EXIT);
    }
    if listen_kind == "own" {
        listen(&sock, Backlog::new(128).unwrap_or(Backlog::MAXCONN))
            .unwrap_or_else(|e| fail("listen", e));
    }
    if let Some(h) = &health_sock {
        listen(h, Backlog::new(128).unwrap_or(Backlog::MAXCONN))
            .unwrap_or_else(|e| fail("listen", e));
    }
    let listener = TcpListener::from(sock);
    let health_listener = health_sock.map(TcpListener::from);
    if speak {
        notify(sd_notify::NotifyState::Ready);
    }
    let ready_us = now_us();
    println!(
        "test-engine slot {slot} pid {} serving on {} socket",
        std::process::id(),
        listen_kind
    );
    let (sum, loaded, names) = weights
        .as_ref()
        .map(|w| (w.sum, w.loaded, w.names.as_str()))
        .unwrap_or((0, false, ""));
    let line = format!(
        "slot={slot} boot={boot} weights={sum:016x} loaded={loaded} lock_us={lock_us} ready_us={ready_us} ranks={ranks} gms={names} listen={listen_kind}{}\n",
        if keep_memo {
            format!(
                " memo={} memo_from={} inherited={}",
                memo.count, memo.from, memo.inherited
            )
        } else {
            String::new()
        }
    );
    if resume {
        answer_stored(found, &line);
    } else {
        drop(found);
    }
    let mut served = 0u64;
    // The serving loop: one poll over the sockets, its timeout the next
    // ping's, so that pings come from here and stop when this loop does.
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    use std::os::fd::AsFd;
    loop {
        let wait = pings.tick();
        let timeout = wait.map_or(PollTimeout::NONE, |w| {
            PollTimeout::try_from(w.as_millis().min(60_000) as u64 + 1).unwrap_or(PollTimeout::MAX)
        });
        let mut fds = vec![PollFd::new(listener.as_fd(), PollFlags::POLLIN)];
        if let Some(h) = &health_listener {
            fds.push(PollFd::new(h.as_fd(), PollFlags::POLLIN));
        }
        if poll(&mut fds, timeout).unwrap_or(0) == 0 {
            continue;
        }
        let ready: Vec<bool> = fds
            .iter()
            .map(|f| f.revents().is_some_and(|r| !r.is_empty()))
            .collect();
        if ready[0] {
            if handed {
                // Already in the store, under the runtime's name.
                match shadow_engine_kit::handoff::receive(listener.as_fd()) {
                    Ok(Some(h)) => {
                        served += 1;
                        answer(
                            std::net::TcpStream::from(h.conn),
                            &line,
                            Some(h.name),
                            true,
                            !no_remove,
                        );
                    }
                    Ok(None) => fail("the hand-off socket", "closed by the runtime"),
                    Err(e) => eprintln!("test-engine: a hand-off: {e}"),
                }
            } else if let Ok((c, _)) = listener.accept() {
                served += 1;
                answer(
                    c,
                    &line,
                    resume.then(|| format!("c-{boot}-{served}")),
                    false,
                    !no_remove,
                );
            }
        }
        if ready.get(1) == Some(&true) {
            if let Some(Ok((c, _))) = health_listener.as_ref().map(TcpListener::accept) {
                health(c);
            }
        }
    }
}
