//! `shadow-engine`: the reference engine. It follows the engine contract
//! (docs/engine-contract.md) for real, so that the failover benchmark measures what a real
//! engine would see:
//!
//! 1. weights: with `GMS_SOCKET_DIR/gms-host.sock`, `rw_or_ro`. The writer
//!    reads the safetensors file into a GMS allocation, verifies every
//!    tensor's SHA-256, commits; a reader maps the committed bytes instead.
//!    Without GMS (e.g. under plain runc) it reads and verifies the file
//!    into private memory. Either way it then derives its per-row scales;
//! 2. takes the pair's listening socket when
//!    `LISTEN_FDS` is set (`shadow.dev/listen`: already listening, held but
//!    never accepted on while parked), else binds its port (not
//!    listening); `STATUS=parked`;
//! 3. `flock(LOCK_EX)` on `SHADOW_LOCK_PATH` (skipped when unset: alone);
//! 4. takes the pair's KV pool from gmsd, showing the lock holder's
//!    descriptor, with what the engine before it left there (`paged`: a
//!    stream it takes over goes on from its last sent token's KV, nothing
//!    decoded again), listens (its own socket), `READY=1`, accepts and
//!    serves HTTP:
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
//! The binary's modules, one job each, in the order a request meets them:
//! `weights` (startup: the weights attached through GMS or privately),
//! `paged` (the KV cache, paged in the pair's KV pool), `worker` (what the
//! workers share: their context, their jobs, the KV cache), `live` (the workers as the watchdog sees
//! them, and the ping), `acceptor` (the serving loop: accept, or take what
//! the runtime hands over, and store at once), `answer` (one request, one
//! response, each step recorded; going on with a recorded answer; the
//! routes), `takeover` (the store fetched once promoted, sorted into jobs),
//! `conn` and `continuity` (a connection's reads and writes, and its state
//! in the store); the promotion's timeline is the library's `promotion`.
//! This file holds the command line and `serve`, which starts them in that
//! order: attach, park, take the lock, wake, serve.
//!
//! Usage: `shadow-engine serve --weights FILE [--port N] [--kv-mib N] [--no-fdstore]`,
//! `shadow-engine generate --out FILE --mib N [--seed N]` (`--help`).

mod acceptor;
mod answer;
mod conn;
mod continuity;
mod live;
mod paged;
mod takeover;
mod weights;
mod worker;

use std::collections::VecDeque;
use std::io::Write;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::mpsc;
use std::sync::Mutex;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use clap::{Parser, Subcommand};
use nix::sys::socket::{
    bind, listen, setsockopt, socket, sockopt, AddressFamily, Backlog, SockFlag, SockType,
    SockaddrIn,
};
use serde_json::json;
use shadow_contract::env;
use shadow_engine::model::{generate, Model};
use shadow_engine::promotion::{self, Part, Timeline};
use shadow_engine::{Error, Result};
use shadow_engine_kit::fdstore;
use shadow_engine_kit::watchdog::{self, Pacer};

use acceptor::accept_loop;
use answer::{answer, go_on};
use live::{ping, Live, WORKERS};
use paged::Paged;
use takeover::take_over;
use weights::attach;
use worker::{Ctx, Job};

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
    /// KV cache, in MiB: the size of the pair's KV pool when this engine
    /// is the first to ask for it (later engines take the pool as it is).
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
    let (source, gms_socket) = attach(&args.weights, &slot)?;
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
    let kv = paged::Pool::new(&slot);
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
            let (slot, promoted, kv) = (&slot, &promoted, &kv);
            s.spawn(move || {
                if fetch_when.recv().is_err() {
                    return; // never promoted
                }
                // The store first (with the runtime accepting, this fetch
                // is what starts the hand-over of new connections), then
                // the pool, which the jobs go on from.
                let own = continuity::own_prefix(slot, boot_us);
                let jobs = take_over(slot, &own, inherited_store);
                // What the pool holds of sequences nobody goes on with is
                // let go (kept aside until the fence), once it is taken.
                kv.taken_over(
                    jobs.iter()
                        .filter_map(|j| match j {
                            Job::Resume(r) => r.link.name().map(paged::key_of),
                            Job::Fresh(..) => None,
                        })
                        .collect(),
                );
                promoted.mark(Part::Fetched);
                let _ = resumed_tx.send(jobs);
            });
        } else {
            drop(resumed_tx);
        }
        notify(sd_notify::NotifyState::Status("parked"));

        let proof = match holder.as_mut() {
            Some(h) => Some(
                h.acquire(live.lock().pacer.as_mut(), ping)
                    .map_err(|e| Error::Usage(format!("taking the election lock: {e}")))?,
            ),
            None => None,
        };
        promoted.locked(promotion::mono_us());
        let lock_us = now_us();
        // The KV cache: the write lease of the pair's KV pool, with what
        // the engine before this one left in it (its streams go on from
        // there); without GMS (or the lease), none: nothing is carried.
        // Asked for now, showing the holder's proof, which is closed at
        // once (while this engine holds a copy, its death would free the
        // lock late); the answer is taken after READY=1, off the path of
        // the first new request, which needs no KV.
        let shown = proof.as_ref().and_then(|p| p.fd());
        let asked = match (gms_socket.as_deref(), shown) {
            (Some(socket), Some(shown)) if kv_bytes > 0 => Paged::ask(socket, shown, kv_bytes)
                .map_err(|e| eprintln!("shadow-engine: {e}: no KV is carried to the next engine"))
                .ok(),
            _ => None,
        };
        drop(proof);
        if own {
            listen(&sock, Backlog::new(256).unwrap_or(Backlog::MAXCONN))
                .map_err(|e| sockerr("listen", e))?;
        }
        notify(sd_notify::NotifyState::Ready);
        promoted.mark(Part::Ready);
        kv.asked(asked);
        if use_store {
            let _ = go.send(());
        } else {
            kv.taken_over(Default::default());
        }
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
