//! `shadow-engine`: the reference engine. It follows the engine contract
//! (docs/engine-contract.md) for real, so that the failover benchmark measures what a real
//! engine would see:
//!
//! 1. weights: with `GMS_SOCKET_DIR/gms-host.sock`, `rw_or_ro`. The writer
//!    reads the safetensors file into a GMS allocation, verifies every
//!    tensor's SHA-256, commits; a reader maps the committed bytes instead.
//!    Without GMS (e.g. under plain runc) it reads and verifies the file
//!    into private memory. Either way it then derives its per-row scales;
//! 2. reserves its KV range; takes the pair's listening socket when
//!    `LISTEN_FDS` is set (`shadow.dev/listen`: already listening, held but
//!    never accepted on while parked), else binds its port (not
//!    listening); `STATUS=parked`;
//! 3. `flock(LOCK_EX)` on `SHADOW_LOCK_PATH` (skipped when unset: alone);
//! 4. wakes the KV range (it grows as memory allows: a request waits
//!    until the part it writes is backed), listens (its own socket),
//!    `READY=1`, accepts and serves HTTP:
//!    `POST /v1/completions` (`{"prompt": "...", "max_tokens": n,
//!    "stream": bool}`, OpenAI's completions API: one JSON answer, or with
//!    `"stream": true` a server-sent event per token, see
//!    `shadow_engine::openai`) and `GET /health`.
//!
//! With a watchdog (`WATCHDOG_USEC`, `shadow.dev/watchdog`) it pings
//! `WATCHDOG=1` each half interval from the loops that work, never from a
//! timer: while parked from the wait for the lock (the flock blocks in a
//! thread of its own, so a wake never waits for a ping), and while serving
//! from the accept loop, but only when every worker that is computing an
//! answer made a decode step since the last ping. A worker stuck in a step
//! stops the pings and the runtime ends the engine; one waiting on its
//! client (reading the request, writing the answer) is not stuck.
//!
//! With the pair's fd store (`SHADOW_FDSTORE_SOCKET`, `shadow.dev/fdstore-max`)
//! a connection outlives the engine answering it: each one is stored
//! with a memfd of its state as soon as it is accepted, its request is
//! taken off the socket only once its answer is recorded, and every step
//! of the answer is recorded before its bytes are written; the engine that
//! takes the lock next fetches the store and goes on with each answer
//! from the byte the socket got to (`continuity`, `conn`; README.md,
//! "Continuity"). `--no-fdstore` turns this off.
//!
//! Usage: `shadow-engine serve --weights FILE [--port N] [--kv-mib N] [--no-fdstore]`,
//! `shadow-engine generate --out FILE --mib N [--seed N]` (`--help`).

mod conn;
mod continuity;

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::{Parser, Subcommand};
use gms::client::{host_socket, Client, Imported, KvCache, Weights};
use gms::protocol::{LeaseKind, Mode};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::socket::{
    bind, listen, setsockopt, socket, sockopt, AddressFamily, Backlog, SockFlag, SockType,
    SockaddrIn,
};
use serde_json::{json, Value};
use shadow_contract::env;
use shadow_engine::model::{generate, verify, Decoder, Model};
use shadow_engine::openai::{self, StreamHead};
use shadow_engine::promotion::{self, Part, Timeline};
use shadow_engine::{Error, Result};
use shadow_engine_kit::fdstore::{self, FetchError, Stored};
use shadow_engine_kit::watchdog::{self, Pacer, Progress};

use conn::Conn;
use continuity::{Link, Progress as Phase, Track, Work};

/// Largest request head + body the server reads.
const MAX_REQUEST: usize = 64 << 10;
/// Most tokens one completion may ask for.
const MAX_TOKENS: usize = 256;
/// How long a streamed answer waits for its client to take an event.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// Threads answering connections.
const WORKERS: usize = 4;
/// Metadata key: bytes of the file inside the GMS allocation (it is rounded up).
const LEN_KEY: &str = "weights.len";

fn now_us() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_micros()
}

fn notify(state: sd_notify::NotifyState<'_>) {
    // Optional by the contract: no socket, or a full one, only loses the hint.
    let _ = sd_notify::notify(&[state]);
}

/// Sends `WATCHDOG=1` without ever blocking: a full notify socket (a
/// runtime that is not reading) loses the ping instead of stalling the loop
/// that sends it, as the socket's own gate drops what goes beyond its rate.
fn ping() {
    let Some(path) = std::env::var_os(env::NOTIFY_SOCKET) else {
        return;
    };
    let Ok(sock) = UnixDatagram::unbound() else {
        return;
    };
    if sock.set_nonblocking(true).is_ok() {
        let _ = sock.send_to(b"WATCHDOG=1\n", path);
    }
}

/// The GMS connection: held, never read, because closing it ends the lease.
struct Lease(#[allow(dead_code)] Client);

/// Where the weights live; each variant owns its memory (and lease).
enum Source {
    Private(Vec<u8>),
    // Field order: the mapping goes before the lease that granted it.
    GmsWriter(Weights, #[allow(dead_code)] Lease, usize),
    GmsReader(Imported, #[allow(dead_code)] Lease, usize),
}

impl Source {
    fn name(&self) -> &'static str {
        match self {
            Source::Private(_) => "file",
            Source::GmsWriter(..) => "gms-writer",
            Source::GmsReader(..) => "gms-reader",
        }
    }

    fn bytes(&self) -> &[u8] {
        match self {
            Source::Private(v) => v,
            Source::GmsWriter(w, _, len) => w.bytes().map(|b| &b[..*len]).unwrap_or(&[]),
            Source::GmsReader(imp, _, len) => imp
                .weights
                .iter()
                .find(|w| w.allocation().tag == "weights")
                .and_then(|w| w.bytes())
                .map(|b| &b[..(*len).min(b.len())])
                .unwrap_or(&[]),
        }
    }
}

fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> Error + 'a {
    move |source| Error::Io {
        what,
        path: path.to_owned(),
        source,
    }
}

fn gms_err(what: &'static str) -> impl FnOnce(gms::Error) -> Error {
    move |source| Error::Gms { what, source }
}

/// Attach the weights: through GMS when its socket is there, else privately.
fn attach(file: &Path, slot: &str, kv_bytes: u64) -> Result<(Source, Option<KvCache>)> {
    let socket = std::env::var_os(env::GMS_SOCKET_DIR).map(|d| host_socket(Path::new(&d)));
    let Some(socket) = socket.filter(|s| s.exists()) else {
        let bytes = std::fs::read(file).map_err(io("read weights", file))?;
        verify(&bytes, file)?;
        return Ok((Source::Private(bytes), None));
    };
    let name = format!("shadow-engine-{slot}");
    let mut c = Client::connect_wait(&socket, Mode::RwOrRo, &name, Duration::from_secs(10))
        .map_err(gms_err("connect"))?;
    // Reserved now (addresses only), backed at wake-up.
    let kv = match kv_bytes {
        0 => None,
        n => Some(c.reserve_kv(n).map_err(gms_err("reserve KV"))?),
    };
    if c.lease() == LeaseKind::Rw {
        let mut f = std::fs::File::open(file).map_err(io("open weights", file))?;
        let len = f.metadata().map_err(io("stat weights", file))?.len() as usize;
        let mut w = c
            .allocate("weights", len as u64)
            .map_err(gms_err("allocate weights"))?;
        {
            let buf = w
                .bytes_mut()
                .ok_or_else(|| Error::Usage("GMS allocation is not mapped".into()))?;
            f.read_exact(&mut buf[..len])
                .map_err(io("read weights", file))?;
            verify(&buf[..len], file)?;
        }
        c.put_meta(LEN_KEY, &len.to_string())
            .map_err(gms_err("put_meta"))?;
        c.commit(std::slice::from_mut(&mut w))
            .map_err(gms_err("commit"))?;
        Ok((Source::GmsWriter(w, Lease(c), len), kv))
    } else {
        let imp = c.import().map_err(gms_err("import"))?;
        let len = c
            .get_meta(LEN_KEY)
            .map_err(gms_err("get_meta"))?
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| {
                Error::Usage(format!(
                    "GMS layout has no {LEN_KEY}: not written by shadow-engine"
                ))
            })?;
        Ok((Source::GmsReader(imp, Lease(c), len), kv))
    }
}

#[derive(Parser)]
#[command(
    name = "shadow-engine",
    about = "Reference engine: safetensors weights shared through GMS, the engine contract (lock, sd_notify), an HTTP completions API"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve completions once this engine holds SHADOW_LOCK_PATH.
    Serve(Args),
    /// Write a deterministic safetensors weights file.
    Generate {
        /// The file to write.
        #[arg(long)]
        out: PathBuf,
        /// Size of the weights, in MiB.
        #[arg(long, default_value_t = 256)]
        mib: u64,
        /// Seed of the weights' values.
        #[arg(long, default_value_t = 42)]
        seed: u64,
    },
}

#[derive(clap::Args)]
struct Args {
    /// The safetensors file (through GMS when GMS_SOCKET_DIR has a host daemon).
    #[arg(long)]
    weights: PathBuf,
    /// TCP port on 127.0.0.1 (SO_REUSEPORT: both engines of a pair bind
    /// it); unused when the pair hands its socket down (LISTEN_FDS).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// KV cache, in MiB: reserved while parked, materialised on wake.
    #[arg(long, default_value_t = 16)]
    kv_mib: u64,
    /// Keep no connection in the pair's fd store: each one dies with this
    /// engine, as in a pair without a store (to measure what the store
    /// costs a request that no failover touches).
    #[arg(long)]
    no_fdstore: bool,
}

fn main() {
    let result = match Cli::parse().command {
        Command::Generate { out, mib, seed } => generate(&out, mib, seed),
        Command::Serve(args) => serve(args),
    };
    if let Err(e) = result {
        eprintln!("shadow-engine: {e}");
        std::process::exit(70);
    }
}

fn serve(args: Args) -> Result<()> {
    // The election lock is held by a small forked process (see
    // shadow_engine_kit::lock): a SIGKILLed engine's own flock would drop
    // only once its memory (weights, KV) is freed, ~100 ms a GiB. Forked
    // first, while this process is small and has one thread.
    let mut holder = shadow_engine_kit::lock::Holder::from_env()
        .map_err(|e| Error::Usage(format!("starting the election lock's holder: {e}")))?;
    // As pid 1 of a container SIGTERM is ignored without a handler: take it
    // on one thread and exit as a shell would.
    let mut term = nix::sys::signal::SigSet::empty();
    term.add(nix::sys::signal::Signal::SIGTERM);
    let _ = term.thread_block();
    std::thread::spawn(move || {
        if term.wait().is_ok() {
            std::process::exit(143);
        }
    });
    let slot = std::env::var(env::ENGINE_ID).unwrap_or_else(|_| "-".into());
    let boot_us = now_us();
    // What the pair hands down: its listening sockets (`tcp-<port>`,
    // `unix-<file>`), then its fd store. A store this engine fetches once
    // it takes the lock: what it was handed at its start (the active
    // engine's connections, as they were then) is fetched again then, so
    // it is closed now and a parked engine holds none of it.
    let (listening, inherited_store) =
        fdstore::split_inherited(shadow_engine_kit::listen::inherited(), is_listen_name);
    // Handed its connections by the runtime (`SHADOW_ACCEPT=runtime`): they
    // are in the store already, and its fetch once active is what makes
    // them go to this engine.
    let handed = shadow_engine_kit::handoff::enabled();
    let use_store = (handed || !args.no_fdstore) && has_store();
    let fetches = std::env::var_os(env::FDSTORE_SOCKET).is_some()
        && std::env::var_os(env::LOCK_PATH).is_some();
    let mut inherited_store = (use_store && !fetches).then_some(inherited_store);
    let t0 = Instant::now();
    let kv_bytes = args.kv_mib << 20;
    let (source, gms_kv) = attach(&args.weights, &slot, kv_bytes)?;
    let load_ms = t0.elapsed().as_secs_f64() * 1e3;
    let model = Model::build(source.bytes(), &args.weights)?;
    let init_ms = t0.elapsed().as_secs_f64() * 1e3;

    // The pair's socket, handed down already listening: connections wait in
    // its backlog (never refused) until this engine, once active, accepts.
    // Else one bound now and listening only once active: the kernel sends
    // connections to the listening socket of the active engine only.
    let port = args.port;
    let sockerr =
        |what: &str, e: nix::Error| Error::Usage(format!("{what} on 127.0.0.1:{port}: {e}"));
    let (sock, address): (OwnedFd, String) = match listening.into_iter().next() {
        Some(s) => (s.fd, format!("inherited socket {}", s.name)),
        None => {
            let sock = socket(
                AddressFamily::Inet,
                SockType::Stream,
                SockFlag::SOCK_CLOEXEC,
                None,
            )
            .map_err(|e| Error::Usage(format!("socket: {e}")))?;
            setsockopt(&sock, sockopt::ReusePort, &true).map_err(|e| sockerr("SO_REUSEPORT", e))?;
            setsockopt(&sock, sockopt::ReuseAddr, &true).map_err(|e| sockerr("SO_REUSEADDR", e))?;
            bind(sock.as_raw_fd(), &SockaddrIn::new(127, 0, 0, 1, port))
                .map_err(|e| sockerr("bind", e))?;
            (sock, format!("127.0.0.1:{port}"))
        }
    };
    let own = address.starts_with("127.");

    // Everything that does not need the lock, made while parked: the
    // workers (waiting for jobs), the takeover's fetcher (waiting to be
    // told), the store's first state memfd, the health answer. Once the
    // lock is taken only the KV cache's wake, `listen` and `READY=1` stand
    // between it and the first accept.
    let info = json!({
        "slot": slot, "boot_us": boot_us.to_string(), "source": source.name(),
        "load_ms": load_ms, "init_ms": init_ms,
    });
    let mut keeper = use_store.then(|| continuity::Keeper::new(&slot, boot_us));
    if let Some(k) = keeper.as_mut() {
        k.prepare();
    }
    let inherited_store = inherited_store.take().unwrap_or_default();
    let promoted = Timeline::new(&slot, use_store);
    let live = Live::new(watchdog::interval_from_env().map(Pacer::new));
    let kv = std::sync::OnceLock::new();
    let ctx = Ctx {
        model: &model,
        bytes: source.bytes(),
        kv: &kv,
        info: &info,
        live: &live,
        promoted: &promoted,
    };
    let (from_acceptor, from_acceptor_rx) = {
        let (tx, rx) = mpsc::channel::<Job>();
        (tx, Mutex::new(rx))
    };
    std::thread::scope(|s| {
        // Dropped on every way out of this scope: the workers and the
        // fetcher then end.
        let to_workers = from_acceptor;
        for worker in 0..WORKERS {
            let (ctx, from_acceptor) = (&ctx, &from_acceptor_rx);
            s.spawn(move || loop {
                // A worker that panicked poisons nothing the others need.
                let next = from_acceptor
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .recv();
                let Ok(job) = next else { return };
                match job {
                    Job::Fresh(conn, link) => answer(conn, link, ctx, worker),
                    Job::Resume(r) => go_on(r, ctx, worker),
                }
                ctx.live.idle();
            });
        }
        // The connections the engine before this one left in the store,
        // once this one is ready: fetched on a thread of their own while
        // the acceptor serves new connections (the fetch waits on the
        // runtime, which is busiest right after a failover), and handed to
        // the workers first once here.
        let (resumed_tx, resumed) = mpsc::channel::<VecDeque<Job>>();
        let (go, fetch_when) = mpsc::channel::<()>();
        if use_store {
            let (slot, promoted) = (&slot, &promoted);
            s.spawn(move || {
                if fetch_when.recv().is_err() {
                    return; // never promoted
                }
                let own = continuity::own_prefix(slot, boot_us);
                let jobs = take_over(slot, &own, inherited_store);
                promoted.mark(Part::Fetched);
                let _ = resumed_tx.send(jobs);
            });
        } else {
            drop(resumed_tx);
        }
        notify(sd_notify::NotifyState::Status("parked"));

        if let Some(h) = holder.as_mut() {
            h.acquire(live.lock().pacer.as_mut(), ping)
                .map_err(|e| Error::Usage(format!("taking the election lock: {e}")))?;
        }
        promoted.locked(promotion::mono_us());
        let lock_us = now_us();
        // The KV cache: the reserved GMS range's first chunk backed here
        // (on the host backend one mmap, no page touched: the first request
        // then waits for no grower thread to be scheduled, and with the
        // default 16 MiB there is no grower at all), the rest growing as
        // memory allows, serving not waiting for it; or private memory.
        let woken = match gms_kv {
            Some(mut cache) => {
                let first = cache.chunk().min(cache.len());
                if let Err(e) = cache.wake(first) {
                    eprintln!("shadow-engine: backing the KV cache's first {first} bytes at once: {e}: growing it instead");
                    cache.wake(0).map_err(gms_err("wake KV"))?;
                }
                Kv::Gms(cache)
            }
            None => Kv::Private(Mutex::new(vec![0u8; kv_bytes as usize])),
        };
        let _ = kv.set(woken);
        promoted.mark(Part::Kv);
        if own {
            listen(&sock, Backlog::new(256).unwrap_or(Backlog::MAXCONN))
                .map_err(|e| sockerr("listen", e))?;
        }
        notify(sd_notify::NotifyState::Ready);
        promoted.mark(Part::Ready);
        let _ = go.send(());
        let ready_us = now_us();
        println!(
            "shadow-engine slot {slot} ready on {address}: weights {} MiB from {}, load {load_ms:.1} ms, init {init_ms:.1} ms, lock→ready {} µs",
            model.file_len >> 20,
            source.name(),
            ready_us.saturating_sub(lock_us)
        );
        let _ = std::io::stdout().flush();
        accept_loop(
            sock.as_fd(),
            handed,
            &to_workers,
            &live,
            resumed,
            keeper,
            &promoted,
        );
        Ok(())
    })
}

/// Whether the runtime keeps a store for this engine: a pair's
/// (`SHADOW_FDSTORE_SOCKET`, set when `shadow.dev/fdstore-max` is not 0)
/// or systemd's (`FDSTORE`, its `FileDescriptorStoreMax=`), reached
/// through `NOTIFY_SOCKET`. A runtime without one is sent no descriptors.
fn has_store() -> bool {
    let systemd = std::env::var("FDSTORE")
        .ok()
        .and_then(|v| v.trim().parse::<u32>().ok())
        .is_some_and(|n| n > 0);
    std::env::var_os(env::NOTIFY_SOCKET).is_some()
        && (std::env::var_os(env::FDSTORE_SOCKET).is_some() || systemd)
}

/// Whether an inherited descriptor is one of the pair's listening sockets
/// (`shadow_contract::listen`'s names; `unknown` when none was given),
/// not a descriptor of its store.
fn is_listen_name(name: &str) -> bool {
    name.starts_with("tcp-") || name.starts_with("unix-") || name == "unknown"
}

/// What a worker reads from, computes with and reports to.
struct Ctx<'a> {
    model: &'a Model,
    /// The weights the model was built from.
    bytes: &'a [u8],
    /// Set once the lock is taken (no job comes before).
    kv: &'a std::sync::OnceLock<Kv>,
    info: &'a Value,
    live: &'a Live,
    /// This promotion's timeline.
    promoted: &'a Timeline,
}

/// A worker's next connection.
enum Job {
    /// A connection to read a request from: accepted now, or left by the
    /// engine before with nothing recorded (its request, if any, still in
    /// the socket).
    Fresh(Conn, Link),
    /// An answer the engine before this one recorded, to go on with.
    Resume(Resumed),
}

/// A recorded answer and how far it got.
struct Resumed {
    conn: Conn,
    link: Link,
    work: Work,
    /// `Recorded` (nothing written), `Answering(n)` or `Finishing(n)`.
    progress: Phase,
    /// Bytes of the answer already in the socket.
    written: u64,
}

/// What the store holds for a new active engine, fetched (the store
/// answers the lock holder; it may not yet see this engine as one, so a
/// refusal is tried again a few times); without a fetch socket, what this
/// engine was handed at its start.
fn fetch_store(inherited: Vec<Stored>) -> Vec<Stored> {
    for attempt in 1..=5u32 {
        match fdstore::fetch() {
            Ok(got) => return got,
            Err(FetchError::NoStore) => return inherited,
            Err(e) => {
                eprintln!("shadow-engine: fetching the fd store (attempt {attempt}): {e}");
                std::thread::sleep(Duration::from_millis(20 * u64::from(attempt)));
            }
        }
    }
    inherited
}

/// How a takeover went, by kind, for its log line.
#[derive(Default)]
struct Takeover {
    fetched: usize,
    descriptors: usize,
    /// Resumed with no request recorded: served as new connections.
    fresh: usize,
    /// Plain answers recorded, written on.
    plain: usize,
    /// Streams recorded, decoded again and written on.
    streams: usize,
    /// Answered already: closed.
    done: usize,
    /// Nothing this engine can go on from: closed.
    dropped: usize,
}

/// Once this engine holds the lock and is ready: every connection the
/// store holds (each a socket and its state memfd under one name), but
/// those named `own`-… (this engine's), becomes a job for the workers, or
/// is closed when done or beyond resuming; all are said in one line.
fn take_over(slot: &str, own: &str, inherited: Vec<Stored>) -> VecDeque<Job> {
    let t0 = Instant::now();
    let stored = fetch_store(inherited);
    let mut t = Takeover {
        descriptors: stored.len(),
        ..Takeover::default()
    };
    let mut jobs = VecDeque::new();
    // The fetch runs while this engine serves: what it stored itself since
    // is in the answer too, and is its own workers' (these copies close).
    let own = format!("{own}-");
    for entry in continuity::group(stored)
        .into_iter()
        .filter(|e| !e.name.starts_with(&own))
    {
        t.fetched += 1;
        let name = entry.name.clone();
        match resume(entry) {
            Ok(Some(job)) => {
                match &job {
                    Job::Fresh(..) => t.fresh += 1,
                    Job::Resume(r) if matches!(r.work, Work::Plain(_)) => t.plain += 1,
                    Job::Resume(_) => t.streams += 1,
                }
                jobs.push_back(job);
            }
            Ok(None) => t.done += 1,
            Err(why) => {
                t.dropped += 1;
                eprintln!("shadow-engine: stored connection {name}: {why}: closed");
                let _ = fdstore::remove(&name);
            }
        }
    }
    println!(
        "shadow-engine slot {slot} took over: {} connections fetched ({} descriptors), {} resumed (request unread {}, plain {}, stream {}), done {}, dropped {}; fetched and sorted in {:.1} ms",
        t.fetched,
        t.descriptors,
        t.fresh + t.plain + t.streams,
        t.fresh,
        t.plain,
        t.streams,
        t.done,
        t.dropped,
        t0.elapsed().as_secs_f64() * 1e3
    );
    let _ = std::io::stdout().flush();
    jobs
}

/// The job of one stored connection; None when it was done (now closed).
fn resume(entry: continuity::Entry) -> std::result::Result<Option<Job>, String> {
    let Some(state) = entry.state else {
        // One the runtime accepted and handed to an engine that died
        // before it stored a state (or to nobody yet): its request, if
        // any, is still in the socket.
        return match entry.socket {
            Some(sock) if shadow_contract::handoff::is_accepted_name(&entry.name) => {
                let conn = Conn::from_fd(sock).map_err(|e| format!("socket: {e}"))?;
                let _ = conn.set_blocking();
                match continuity::bytes_written(conn.as_fd()) {
                    Ok(n) if n > 0 => Err(format!("{n} bytes written, and no state")),
                    _ => Ok(Some(Job::Fresh(conn, Link::adopt(entry.name)))),
                }
            }
            _ => Err("a socket without its state".into()),
        };
    };
    let track = Track::fetched(entry.name, state);
    let saved = track.read().map_err(|e| format!("state refused: {e}"))?;
    let Some(sock) = entry.socket else {
        // The store let go of the socket when its client hung up: after
        // the answer (its state says done), or before.
        if saved.progress == Phase::Done {
            Link::new(Some(track)).drop_entry();
            return Ok(None);
        }
        return Err("its socket is gone: the client hung up".into());
    };
    let conn = Conn::from_fd(sock).map_err(|e| format!("socket: {e}"))?;
    let _ = conn.set_blocking();
    let link = Link::new(Some(track));
    // What the socket got: none before the answer starts, which a state
    // that lagged (its updates failed, and so did its removal) would
    // contradict; all the resumption goes by once it has.
    let sent = continuity::bytes_written(conn.as_fd());
    let unstarted = |p: Phase| match sent {
        Ok(n) if n > 0 => Err(format!("{n} bytes written, its state says {p:?}")),
        _ => Ok(()),
    };
    let written = match saved.progress {
        Phase::New => {
            unstarted(Phase::New)?;
            return Ok(Some(Job::Fresh(conn, link)));
        }
        Phase::Done => {
            link.finish(conn.as_fd());
            return Ok(None);
        }
        Phase::Recorded => {
            unstarted(Phase::Recorded)?;
            // The request may still be in the socket: taken off, so that
            // the close is no reset.
            conn.drain(usize::try_from(saved.request_len).unwrap_or(usize::MAX));
            0
        }
        Phase::Answering(_) | Phase::Finishing(_) => sent.map_err(|e| {
            format!(
                "an answer under way, but no count of the bytes written ({e}): only TCP has one"
            )
        })?,
    };
    let work = saved.work.ok_or("no answer recorded")?;
    Ok(Some(Job::Resume(Resumed {
        conn,
        link,
        work,
        progress: saved.progress,
        written,
    })))
}

/// What the watchdog needs to know of the workers, and the count of idle
/// ones (the acceptor accepts only for an idle worker, so that connections
/// beyond them wait in the listening socket's backlog, which outlives this
/// engine, rather than in this process).
struct Live {
    state: Mutex<LiveState>,
    /// A worker became idle.
    freed: Condvar,
}

struct LiveState {
    /// None: no watchdog.
    pacer: Option<Pacer>,
    /// Which workers advanced since the last ping.
    progress: Progress,
    /// Which workers are computing an answer (only those can be stuck).
    computing: [bool; WORKERS],
    idle: usize,
}

impl Live {
    fn new(pacer: Option<Pacer>) -> Live {
        Live {
            state: Mutex::new(LiveState {
                pacer,
                progress: Progress::new(WORKERS),
                computing: [false; WORKERS],
                idle: WORKERS,
            }),
            freed: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, LiveState> {
        // A panicked worker poisons nothing that matters here: counts and flags.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// How long the acceptor may block before a ping is due (None: forever).
    fn wait(&self) -> Option<Duration> {
        self.lock().wait()
    }

    /// Pings if one is due and every computing worker advanced.
    fn tick(&self) {
        let due = self.lock().take_ping();
        if due {
            ping();
        }
    }

    /// Runs `f` as worker `worker`'s computation of an answer, given a
    /// step hook: each call marks a decode step done (and may ping).
    fn computing<R>(&self, worker: usize, f: impl FnOnce(&mut dyn FnMut()) -> R) -> R {
        self.lock().computing[worker] = true;
        let out = f(&mut || {
            let due = self.lock().stepped(worker);
            if due {
                ping();
            }
        });
        let mut st = self.lock();
        st.computing[worker] = false;
        st.progress.advanced(worker);
        out
    }

    /// Runs `f`, a wait of worker `worker` on its client (writing to it),
    /// inside a computation: the worker is not computing meanwhile, so a
    /// slow client never holds the pings back; then it is as before (and,
    /// computing, must step again before the next ping).
    fn waiting<R>(&self, worker: usize, f: impl FnOnce() -> R) -> R {
        let was = std::mem::replace(&mut self.lock().computing[worker], false);
        let out = f();
        self.lock().computing[worker] = was;
        out
    }

    /// A worker is done with its connection.
    fn idle(&self) {
        self.lock().idle += 1;
        self.freed.notify_one();
    }
}

impl LiveState {
    /// How long the acceptor may block: until the next ping is due; once
    /// it is due but a computing worker has not stepped yet, an eighth of
    /// the interval (that worker's next step pings by itself). Never zero:
    /// a zero wait would spin on this lock against the workers' steps, and
    /// under load starve them into a missed ping.
    fn wait(&self) -> Option<Duration> {
        self.pacer.as_ref().map(|p| {
            let w = p.wait(Instant::now());
            if w.is_zero() {
                (p.interval() / 8).max(Duration::from_millis(1))
            } else {
                w
            }
        })
    }

    /// `worker` made a decode step; whether to ping now, as [`take_ping`](Self::take_ping).
    fn stepped(&mut self, worker: usize) -> bool {
        self.progress.advanced(worker);
        self.take_ping()
    }

    /// Whether to ping now (and, if so, records it): due, and every worker
    /// either not computing or past a step since the last ping.
    fn take_ping(&mut self) -> bool {
        let now = Instant::now();
        let Some(pacer) = self.pacer.as_mut() else {
            return false;
        };
        if !pacer.due(now) {
            return false;
        }
        for (w, &busy) in self.computing.iter().enumerate() {
            if !busy {
                self.progress.advanced(w);
            }
        }
        if !self.progress.all_advanced() {
            return false;
        }
        pacer.pinged(now);
        self.progress.reset();
        true
    }
}

/// `poll`'s timeout for `wait`, rounded up to a whole millisecond so that
/// a wait shorter than one does not spin (None: forever).
fn poll_timeout(wait: Option<Duration>) -> PollTimeout {
    match wait {
        None => PollTimeout::NONE,
        Some(d) => {
            let ms = d.as_micros().div_ceil(1000);
            PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX)
        }
    }
}

/// How often the acceptor looks for the takeover's jobs while they are
/// being fetched.
const TAKEOVER_LOOK: Duration = Duration::from_millis(1);

/// The serving loop: waits for an idle worker, hands it the next resumed
/// connection, else accepts one for it (stored at once with its state
/// when there is a `keeper`); between these, and at least each half
/// interval, it pings when the workers' progress allows.
fn accept_loop(
    listener: BorrowedFd<'_>,
    handed: bool,
    to_workers: &mpsc::Sender<Job>,
    live: &Live,
    taken_over: mpsc::Receiver<VecDeque<Job>>,
    mut keeper: Option<continuity::Keeper>,
    promoted: &Timeline,
) {
    promoted.mark(Part::Serving);
    let mut resumed = VecDeque::new();
    // Until the takeover's jobs are here: looked for at least each
    // millisecond.
    let mut awaiting = true;
    loop {
        if awaiting {
            match taken_over.try_recv() {
                Ok(jobs) => {
                    resumed.extend(jobs);
                    awaiting = false;
                }
                Err(mpsc::TryRecvError::Empty) => {}
                Err(mpsc::TryRecvError::Disconnected) => awaiting = false,
            }
        }
        {
            let mut st = live.lock();
            while st.idle == 0 {
                st = match st.wait() {
                    None => live.freed.wait(st).unwrap_or_else(|e| e.into_inner()),
                    Some(t) => {
                        let st = live.freed.wait_timeout(st, t);
                        st.unwrap_or_else(|e| e.into_inner()).0
                    }
                };
                if st.take_ping() {
                    ping();
                }
            }
        }
        if let Some(job) = resumed.pop_front() {
            live.lock().idle -= 1;
            if to_workers.send(job).is_err() {
                return; // every worker is gone
            }
            continue;
        }
        if let Some(k) = keeper.as_mut() {
            k.prepare();
        }
        let mut fds = [PollFd::new(listener, PollFlags::POLLIN)];
        // EINTR or a timeout: the tick below, then again.
        let wait = match (live.wait(), awaiting) {
            (w, false) => w,
            (None, true) => Some(TAKEOVER_LOOK),
            (Some(w), true) => Some(w.min(TAKEOVER_LOOK)),
        };
        if poll(&mut fds, poll_timeout(wait)).is_ok_and(|n| n > 0) {
            // accept errors (ECONNABORTED, EMFILE) concern one peer.
            match next_connection(listener, handed, keeper.as_mut(), promoted) {
                Ok((fd, link)) => match Conn::from_fd(fd) {
                    Ok(conn) => {
                        live.lock().idle -= 1;
                        if to_workers.send(Job::Fresh(conn, link)).is_err() {
                            return; // every worker is gone
                        }
                    }
                    Err(_) => link.drop_entry(),
                },
                // Nothing will come again: the engine ends.
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                    eprintln!("shadow-engine: {e}: exiting");
                    std::process::exit(1);
                }
                Err(_) => {}
            }
        }
        live.tick();
    }
}

/// The next connection and its link to the store: handed over by the
/// runtime (stored already, under its name: this engine stores its state
/// memfd beside it), or accepted and stored first (until the store holds
/// it, the connection dies with this engine).
fn next_connection(
    listener: BorrowedFd<'_>,
    handed: bool,
    keeper: Option<&mut continuity::Keeper>,
    promoted: &Timeline,
) -> std::io::Result<(OwnedFd, Link)> {
    if handed {
        let h = shadow_engine_kit::handoff::receive(listener)?.ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the runtime closed the hand-off socket",
            )
        })?;
        promoted.mark(Part::Accepted);
        let link = match keeper {
            Some(k) => k.keep_handed(h.name),
            None => Link::handed(h.name, None),
        };
        promoted.mark(Part::Stored);
        return Ok((h.conn, link));
    }
    let fd = conn::accept(listener)?;
    promoted.mark(Part::Accepted);
    let link = match keeper {
        Some(k) => k.keep(fd.as_fd()),
        None => Link::new(None),
    };
    promoted.mark(Part::Stored);
    Ok((fd, link))
}

/// The engine's KV cache.
enum Kv {
    /// At the GMS range reserved while parked: a prefix of it is backed,
    /// growing after the wake.
    Gms(KvCache),
    /// Without GMS: private memory.
    Private(Mutex<Vec<u8>>),
}

impl Kv {
    /// Writes a sequence's state at the start of the cache. Through GMS it
    /// waits (a queued request) until that much is backed, if it is not yet.
    fn write(&self, data: &[u8]) -> Result<(), String> {
        let n = (data.len() as u64).min(self.len());
        match self {
            Kv::Gms(cache) => {
                let backed = cache.watch().wait_backed(n, cache.oom_wait());
                if backed < n {
                    return Err(format!(
                        "the KV cache has {backed} bytes backed, this request needs {n}: {}",
                        cache.watch().info_json()
                    ));
                }
                cache.with_backed_mut(|kv| kv[..n as usize].copy_from_slice(&data[..n as usize]));
            }
            Kv::Private(kv) => {
                let mut kv = kv.lock().unwrap_or_else(|e| e.into_inner());
                kv[..n as usize].copy_from_slice(&data[..n as usize]);
            }
        }
        Ok(())
    }

    fn len(&self) -> u64 {
        match self {
            Kv::Gms(cache) => cache.len(),
            Kv::Private(kv) => kv.lock().map_or(0, |kv| kv.len() as u64),
        }
    }
}

/// What [`route`] answers.
enum Reply<'a> {
    /// A whole JSON answer.
    Json(u16, Value),
    /// A completion to stream (`"stream": true`), accepted and its state
    /// already in the KV cache: [`stream`] writes it as it decodes.
    Stream {
        head: StreamHead,
        prompt: String,
        decoder: Decoder<'a>,
        max_tokens: usize,
    },
}

/// One request, one response, connection closed. With a link to the store
/// the request is read with `MSG_PEEK` and taken off the socket only once
/// its answer is recorded (a plain answer's bytes, a stream's head and
/// prompt), and every step of the answer is recorded before its bytes are
/// written; without one, as without a store.
fn answer(mut conn: Conn, mut link: Link, ctx: &Ctx<'_>, worker: usize) {
    let Some(kv) = ctx.kv.get() else {
        return link.drop_entry(); // no job comes before the wake
    };
    let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
    let on = |method: &str, path: &str, body: &[u8]| {
        ctx.live.computing(worker, |step| {
            route(method, path, body, ctx.model, ctx.bytes, kv, ctx.info, step)
        })
    };
    let bad = |reason: String| Reply::Json(400, json!({ "error": reason }));
    let reply = if link.tracked() {
        let (reply, request_len, whole) = match conn::peek_request(&conn, MAX_REQUEST) {
            Ok(req) => {
                ctx.promoted.mark(Part::Read);
                (on(&req.method, &req.path, &req.body), req.len, true)
            }
            Err(e) => (bad(e.reason), e.peeked, false),
        };
        let reply = Ready::from(reply);
        let work = match &reply {
            Plain(bytes) => Work::Plain(bytes.clone()),
            Streamed(head, prompt, _, max_tokens) => Work::Stream {
                head: head.clone(),
                prompt: prompt.clone(),
                max_tokens: *max_tokens,
            },
        };
        link.record(request_len as u64, &work);
        // Recorded: now the request may leave the socket.
        if whole {
            let _ = conn.consume(request_len);
        } else {
            conn.drain(request_len);
        }
        reply
    } else {
        match read_request(&mut conn) {
            Ok((method, path, body)) => {
                ctx.promoted.mark(Part::Read);
                Ready::from(on(&method, &path, &body))
            }
            Err(reason) => Plain(openai::json_response(400, &json!({ "error": reason }))),
        }
    };
    match reply {
        Plain(bytes) => {
            link.note(Phase::Answering(0));
            if conn.write_all(&bytes).is_ok() {
                ctx.promoted.mark(Part::Answered);
            }
        }
        Streamed(head, _, decoder, max_tokens) => {
            link.note(Phase::Answering(0));
            stream(
                &mut conn,
                &mut link,
                &head,
                decoder,
                max_tokens,
                openai::STREAM_HEAD,
                ctx.live,
                worker,
            );
            ctx.promoted.mark(Part::Answered);
        }
    }
    link.finish(conn.as_fd());
}

/// An answer ready to write.
enum Ready<'a> {
    /// Its bytes, whole.
    Plain(Vec<u8>),
    /// A stream's head, prompt, decoder (after the prefill) and length.
    Streamed(StreamHead, String, Decoder<'a>, usize),
}

impl<'a> From<Reply<'a>> for Ready<'a> {
    /// A route's reply as it is sent: a JSON answer as its bytes.
    fn from(reply: Reply<'a>) -> Ready<'a> {
        match reply {
            Reply::Json(status, body) => Ready::Plain(openai::json_response(status, &body)),
            Reply::Stream {
                head,
                prompt,
                decoder,
                max_tokens,
            } => Ready::Streamed(head, prompt, decoder, max_tokens),
        }
    }
}
use Ready::{Plain, Streamed};

/// Goes on with an answer the engine before this one recorded: what the
/// socket did not get of it yet (the kernel's count of the bytes written
/// says where that starts), then for a stream the tokens still to decode,
/// recorded as they go, as [`answer`] does. The prompt and the tokens
/// already sent are computed again (the KV cache died with that engine),
/// step by step under the watchdog. A count beyond what was recorded (a
/// state that lags the socket) is not gone on with: closed.
fn go_on(r: Resumed, ctx: &Ctx<'_>, worker: usize) {
    let Resumed {
        mut conn,
        mut link,
        work,
        progress,
        written,
    } = r;
    let written = usize::try_from(written).unwrap_or(usize::MAX);
    let _ = conn.set_write_timeout(Some(WRITE_TIMEOUT));
    let beyond = |name: &str, len: usize| {
        eprintln!(
            "shadow-engine: resuming {name}: {written} bytes written, more than the {len} recorded: closed"
        );
    };
    if progress == Phase::Recorded {
        link.note(Phase::Answering(0));
    }
    match work {
        Work::Plain(bytes) => {
            let Some(rest) = bytes.get(written..) else {
                beyond("a plain answer", bytes.len());
                link.drop_entry();
                return;
            };
            let _ = ctx.live.waiting(worker, || conn.write_all(rest));
        }
        Work::Stream {
            head,
            prompt,
            max_tokens,
        } => {
            let (n, finishing) = match progress {
                Phase::Answering(n) => (n, false),
                Phase::Finishing(n) => (n, true),
                _ => (0, false),
            };
            let n = usize::try_from(n).unwrap_or(usize::MAX);
            if max_tokens > MAX_TOKENS || n > max_tokens {
                eprintln!("shadow-engine: resuming a stream at {n} of {max_tokens} tokens: closed");
                link.drop_entry();
                return;
            }
            let decoder = ctx.live.computing(worker, |step| {
                ctx.model.resume_with(ctx.bytes, &prompt, n, step)
            });
            // The sequence's state back in the KV cache, as at its start.
            if let Some(kv) = ctx.kv.get() {
                let _ = kv.write(prompt.as_bytes());
            }
            let sent = openai::stream_bytes(&head, decoder.generated(), finishing);
            let Some(rest) = sent.get(written..) else {
                beyond("a stream", sent.len());
                link.drop_entry();
                return;
            };
            if finishing {
                let _ = ctx.live.waiting(worker, || conn.write_all(rest));
            } else {
                stream(
                    &mut conn, &mut link, &head, decoder, max_tokens, rest, ctx.live, worker,
                );
            }
        }
    }
    link.finish(conn.as_fd());
}

/// Streams a completion: `first` (the response head, or what a resumed
/// stream still owes of the events so far), then each token's event with
/// a write of its own as soon as it is decoded, then the final event and
/// `[DONE]`, as [`openai::stream_bytes`] says; the close ends the body.
/// Each event's count is recorded before its bytes are written, so the
/// bytes in the socket never go beyond what the state says. Decode steps
/// feed the watchdog; the writes are waits on the client. A client gone
/// (or not reading for [`WRITE_TIMEOUT`]) ends the stream.
#[allow(clippy::too_many_arguments)]
fn stream(
    conn: &mut Conn,
    link: &mut Link,
    head: &StreamHead,
    mut decoder: Decoder<'_>,
    max_tokens: usize,
    first: &[u8],
    live: &Live,
    worker: usize,
) {
    conn.set_nodelay();
    let _ = conn.set_write_timeout(Some(WRITE_TIMEOUT));
    let mut send = |bytes: &[u8]| live.waiting(worker, || conn.write_all(bytes)).is_ok();
    if !send(first) {
        return;
    }
    live.computing(worker, |step| {
        while decoder.tokens() < max_tokens {
            let index = decoder.tokens();
            let token = decoder.next_token();
            step();
            link.note(Phase::Answering(index as u64 + 1));
            if !send(&openai::token_event(head, index, token)) {
                return;
            }
        }
        link.note(Phase::Finishing(decoder.tokens() as u64));
        if send(&openai::final_event(head, decoder.tokens())) {
            send(openai::DONE_EVENT);
        }
    });
}

/// Reads a whole request off the socket (a connection the store does not
/// hold).
fn read_request(conn: &mut Conn) -> std::result::Result<(String, String, Vec<u8>), String> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 4096];
    loop {
        let n = conn.read(&mut chunk).map_err(|e| format!("read: {e}"))?;
        if n == 0 {
            return Err("connection closed before a full request".into());
        }
        buf.extend_from_slice(&chunk[..n]);
        if buf.len() > MAX_REQUEST {
            return Err(format!("request larger than {MAX_REQUEST} bytes"));
        }
        let Some(head) = conn::parse_head(&buf)? else {
            continue;
        };
        let total = head.head_len + head.body_len;
        if total > MAX_REQUEST {
            return Err(format!("request larger than {MAX_REQUEST} bytes"));
        }
        while buf.len() < total {
            let n = conn
                .read(&mut chunk)
                .map_err(|e| format!("read body: {e}"))?;
            if n == 0 {
                return Err("connection closed inside the body".into());
            }
            buf.extend_from_slice(&chunk[..n]);
        }
        return Ok((head.method, head.path, buf[head.head_len..total].to_vec()));
    }
}

#[allow(clippy::too_many_arguments)]
fn route<'a>(
    method: &str,
    path: &str,
    body: &[u8],
    model: &'a Model,
    bytes: &'a [u8],
    kv: &Kv,
    info: &Value,
    step: &mut dyn FnMut(),
) -> Reply<'a> {
    let error = |status: u16, reason: String| Reply::Json(status, json!({ "error": reason }));
    match (method, path) {
        ("GET", "/health") => Reply::Json(200, json!({ "status": "ok", "engine": info })),
        ("POST", "/v1/completions") => {
            let req: Value = match serde_json::from_slice(body) {
                Ok(v) => v,
                Err(e) => return error(400, format!("body is not JSON: {e}")),
            };
            let Some(prompt) = req["prompt"].as_str() else {
                return error(400, "\"prompt\" (a string) is required".into());
            };
            let max_tokens = req["max_tokens"].as_u64().unwrap_or(16) as usize;
            if max_tokens > MAX_TOKENS {
                return error(400, format!("max_tokens is at most {MAX_TOKENS}"));
            }
            // Absent or null (OpenAI's default): one JSON answer.
            let streamed = match &req["stream"] {
                Value::Null => false,
                Value::Bool(b) => *b,
                _ => return error(400, "\"stream\" is a boolean".into()),
            };
            // Accepted: the id and time the answer carries, chosen once.
            let head = StreamHead::new(prompt.len());
            if streamed {
                let decoder = model.start(bytes, prompt);
                // The prefill's state goes to the KV cache before the
                // response head, so that no room is still a plain 503.
                if let Err(e) = kv.write(prompt.as_bytes()) {
                    return error(503, e);
                }
                return Reply::Stream {
                    head,
                    prompt: prompt.to_owned(),
                    decoder,
                    max_tokens,
                };
            }
            let c = model.complete_with(bytes, prompt, max_tokens, step);
            // The KV cache holds the sequence's state; a real engine keeps
            // pages per sequence, here one page is rewritten per request.
            if let Err(e) = kv.write(c.text.as_bytes()) {
                return error(503, e);
            }
            Reply::Json(200, openai::completion_body(&head, &c, info))
        }
        _ => error(404, format!("no route {method} {path}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A watchdog always due (an interval too short to halve): only the
    /// workers' progress decides.
    fn always_due() -> Live {
        Live::new(Some(Pacer::new(Duration::from_nanos(1))))
    }

    #[test]
    fn idle_workers_never_hold_a_ping_back() {
        let live = always_due();
        assert!(live.lock().take_ping());
        assert!(live.lock().take_ping());
        let none = Live::new(None);
        assert!(!none.lock().take_ping(), "no watchdog, no ping");
        assert_eq!(none.wait(), None);
    }

    #[test]
    fn a_computing_worker_must_step_before_the_next_ping() {
        let live = always_due();
        assert!(live.lock().take_ping());
        live.computing(2, |_| {
            assert!(
                !live.lock().take_ping(),
                "no step yet: worker 2 may be stuck"
            );
            assert!(live.lock().stepped(2), "its step was the one missing");
            assert!(!live.lock().take_ping(), "and each ping needs another");
            assert!(live.lock().stepped(2));
        });
        // Done computing: idle again, never in the way.
        assert!(live.lock().take_ping());
        assert!(live.lock().take_ping());
    }

    #[test]
    fn a_stuck_worker_stops_the_pings_while_others_step() {
        let live = always_due();
        live.computing(0, |_| {
            assert!(live.lock().stepped(0));
            // Worker 0 is stuck from here on; worker 1 steps on.
            live.computing(1, |_| {
                for _ in 0..3 {
                    assert!(!live.lock().stepped(1), "worker 0 made no step since");
                    assert!(!live.lock().take_ping());
                }
            });
        });
        assert!(live.lock().take_ping(), "worker 0 done: the pings resume");
    }

    #[test]
    fn a_worker_waiting_on_its_client_never_holds_a_ping_back() {
        let live = always_due();
        assert!(live.lock().take_ping());
        live.computing(1, |_| {
            assert!(!live.lock().take_ping(), "computing, no step yet");
            // Writing a streamed event to a slow client: not stuck.
            live.waiting(1, || {
                assert!(live.lock().take_ping());
                assert!(live.lock().take_ping());
            });
            // Back to decoding: a step before the next ping, as before.
            assert!(!live.lock().take_ping());
            assert!(live.lock().stepped(1));
        });
        // Outside a computation a wait changes nothing.
        live.waiting(3, || assert!(live.lock().take_ping()));
        assert!(!live.lock().computing[3]);
    }

    #[test]
    fn poll_timeouts_round_up() {
        assert_eq!(poll_timeout(None), PollTimeout::NONE);
        assert_eq!(poll_timeout(Some(Duration::ZERO)), PollTimeout::from(0u16));
        assert_eq!(
            poll_timeout(Some(Duration::from_micros(1))),
            PollTimeout::from(1u16)
        );
        assert_eq!(
            poll_timeout(Some(Duration::from_micros(2001))),
            PollTimeout::from(3u16)
        );
        assert_eq!(
            poll_timeout(Some(Duration::from_secs(u64::MAX))),
            PollTimeout::MAX
        );
    }
}
