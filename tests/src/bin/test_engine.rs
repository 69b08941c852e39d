//! `test-engine`: a small real engine that follows the engine contract
//! (docs/engine-contract.md), for the pair tests and the failover benchmark. No test fakes
//! it: it runs in a container under runc, takes the kernel lock, speaks
//! sd_notify and GMS for real.
//!
//! 1. with `GMS_SOCKET_DIR/gms-host.sock`: `rw_or_ro`; the writer fills
//!    `--weights-mib` MiB from `--seed`, commits, and appends a line to
//!    `/run/shadow/pair/loads.log`; a reader imports and checks the sum;
//! 2. takes the pair's inherited listening socket when `LISTEN_FDS` is set
//!    (`shadow.dev/listen`; `--port` is then unused), else binds
//!    `127.0.0.1:<port>` with SO_REUSEPORT (not listening yet); sends
//!    `STATUS=parked`, blocks in `flock(LOCK_EX)` on `SHADOW_LOCK_PATH`;
//!    a parked engine never accepts;
//! 3. listens (its own socket), sends `READY=1`, and answers each
//!    connection with one line: `slot=<n> boot=<start µs> weights=<sum>
//!    loaded=<bool> lock_us=<t> ready_us=<t> listen=inherited|own`.
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
    // Held for the engine's life: the lease and the mappings.
    _keep: Box<dyn std::any::Any>,
}

fn attach_gms(dir: &Path, slot: &str, mib: u64, seed: u64) -> Option<Weights> {
    use gms::client::{host_socket, Client};
    use gms::protocol::{LeaseKind, Mode};
    let socket = host_socket(dir);
    if !socket.exists() {
        return None;
    }
    let mut c = Client::connect_wait(
        &socket,
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
        let log = Path::new(paths::PAIR_DIR).join("loads.log");
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
        {
            let _ = writeln!(f, "slot={slot} pid={}", std::process::id());
        }
        Some(Weights {
            sum,
            loaded: true,
            _keep: Box::new((c, w)),
        })
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
            fail("imported weights", "checksum mismatch");
        }
        Some(Weights {
            sum,
            loaded: false,
            _keep: Box::new((c, imported)),
        })
    }
}

fn main() {
    let Cli {
        port,
        no_notify,
        crash,
        weights_mib: mib,
        seed,
    } = Cli::parse();
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
    let weights = std::env::var_os(env::GMS_SOCKET_DIR)
        .and_then(|d| attach_gms(Path::new(&d), &slot, mib, seed));

    // The pair's socket (already listening: connections wait in its backlog
    // until an active engine accepts), else one bound now and listening
    // only once active, so that connections reach the active.
    let inherited = shadow_contract::listen::inherited().into_iter().next();
    let listen_kind = if inherited.is_some() {
        "inherited"
    } else {
        "own"
    };
    let sock: OwnedFd = match inherited {
        Some(s) => s.fd,
        None => {
            let sock = socket(
                AddressFamily::Inet,
                SockType::Stream,
                SockFlag::SOCK_CLOEXEC,
                None,
            )
            .unwrap_or_else(|e| fail("socket", e));
            setsockopt(&sock, sockopt::ReusePort, &true)
                .unwrap_or_else(|e| fail("SO_REUSEPORT", e));
            setsockopt(&sock, sockopt::ReuseAddr, &true)
                .unwrap_or_else(|e| fail("SO_REUSEADDR", e));
            bind(
                std::os::fd::AsRawFd::as_raw_fd(&sock),
                &SockaddrIn::new(127, 0, 0, 1, port),
            )
            .unwrap_or_else(|e| fail("bind", e));
            sock
        }
    };

    if speak {
        notify(sd_notify::NotifyState::Status("parked"));
    }
    // Alone (no variable, no pair directory: plain runc) it takes no lock.
    let lock_path = std::env::var(env::LOCK_PATH).ok().or_else(|| {
        Path::new(paths::LOCK_PATH)
            .exists()
            .then(|| paths::LOCK_PATH.to_string())
    });
    let _held = lock_path.map(|lock_path| {
        let lock = std::fs::File::open(&lock_path).unwrap_or_else(|e| fail(&lock_path, e));
        nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusive)
            .unwrap_or_else(|(_, e)| fail("flock", e))
    });
    let lock_us = now_us();
    if listen_kind == "own" {
        listen(&sock, Backlog::new(128).unwrap_or(Backlog::MAXCONN))
            .unwrap_or_else(|e| fail("listen", e));
    }
    let listener = TcpListener::from(sock);
    if speak {
        notify(sd_notify::NotifyState::Ready);
    }
    let ready_us = now_us();
    println!(
        "test-engine slot {slot} pid {} serving on {} socket",
        std::process::id(),
        listen_kind
    );
    let (sum, loaded) = weights
        .as_ref()
        .map(|w| (w.sum, w.loaded))
        .unwrap_or((0, false));
    for conn in listener.incoming() {
        let Ok(mut c) = conn else { continue };
        let _ = writeln!(
            c,
            "slot={slot} boot={boot} weights={sum:016x} loaded={loaded} lock_us={lock_us} ready_us={ready_us} listen={listen_kind}"
        );
    }
}
