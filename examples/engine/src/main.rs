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
//! 4. materialises the KV range, listens (its own socket), `READY=1`,
//!    accepts and serves HTTP:
//!    `POST /v1/completions` (`{"prompt": "...", "max_tokens": n}`) and
//!    `GET /health`.
//!
//! Usage: `shadow-engine serve --weights FILE [--port N] [--kv-mib N]`,
//! `shadow-engine generate --out FILE --mib N [--seed N]` (`--help`).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::{Parser, Subcommand};
use gms::client::{host_socket, Client, Imported, KvCache, Weights};
use gms::protocol::{LeaseKind, Mode};
use nix::sys::socket::{
    bind, listen, setsockopt, socket, sockopt, AddressFamily, Backlog, SockFlag, SockType,
    SockaddrIn,
};
use serde_json::{json, Value};
use shadow_contract::env;
use shadow_engine::model::{generate, verify, Model};
use shadow_engine::{Error, Result};

/// Largest request head + body the server reads.
const MAX_REQUEST: usize = 64 << 10;
/// Most tokens one completion may ask for.
const MAX_TOKENS: usize = 256;
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
    let t0 = Instant::now();
    let kv_bytes = args.kv_mib << 20;
    let (source, mut gms_kv) = attach(&args.weights, &slot, kv_bytes)?;
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
    let (sock, address): (OwnedFd, String) = match shadow_contract::listen::inherited()
        .into_iter()
        .next()
    {
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
    notify(sd_notify::NotifyState::Status("parked"));

    let _held = match std::env::var_os(env::LOCK_PATH) {
        Some(p) => {
            let path = PathBuf::from(p);
            let f = std::fs::File::open(&path).map_err(io("open lock", &path))?;
            Some(
                nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusive)
                    .map_err(|(_, e)| Error::Usage(format!("flock {}: {e}", path.display())))?,
            )
        }
        None => None,
    };
    let lock_us = now_us();
    // The KV cache: fresh pages at the reserved GMS range, or private memory.
    let mut private_kv: Vec<u8>;
    let kv_mem: &mut [u8] = match &mut gms_kv {
        Some(cache) => {
            cache.materialise().map_err(gms_err("materialise KV"))?;
            cache.bytes_mut().unwrap_or_default()
        }
        None => {
            private_kv = vec![0u8; kv_bytes as usize];
            &mut private_kv
        }
    };
    if own {
        listen(&sock, Backlog::new(256).unwrap_or(Backlog::MAXCONN))
            .map_err(|e| sockerr("listen", e))?;
    }
    let listener = TcpListener::from(sock);
    notify(sd_notify::NotifyState::Ready);
    let ready_us = now_us();
    println!(
        "shadow-engine slot {slot} ready on {address}: weights {} MiB from {}, load {load_ms:.1} ms, init {init_ms:.1} ms, lock→ready {} µs",
        model.file_len >> 20,
        source.name(),
        ready_us.saturating_sub(lock_us)
    );
    let _ = std::io::stdout().flush();

    let info = json!({
        "slot": slot, "boot_us": boot_us.to_string(), "source": source.name(),
        "load_ms": load_ms, "init_ms": init_ms,
    });
    let bytes = source.bytes();
    let kv = Mutex::new(kv_mem);
    std::thread::scope(|s| {
        for _ in 0..WORKERS {
            s.spawn(|| loop {
                // accept errors (ECONNABORTED, EMFILE) concern one peer.
                if let Ok((conn, _)) = listener.accept() {
                    answer(conn, &model, bytes, &kv, &info);
                }
            });
        }
    });
    Ok(())
}

/// One request, one response, connection closed.
fn answer(mut conn: TcpStream, model: &Model, bytes: &[u8], kv: &Mutex<&mut [u8]>, info: &Value) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
    let (status, body) = match read_request(&mut conn) {
        Ok((method, path, body)) => route(&method, &path, &body, model, bytes, kv, info),
        Err(reason) => (400, json!({ "error": reason })),
    };
    let text = body.to_string();
    let reason = match status {
        200 => "OK",
        404 => "Not Found",
        _ => "Bad Request",
    };
    let _ = write!(
        conn,
        "HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{text}",
        text.len()
    );
}

fn read_request(conn: &mut TcpStream) -> std::result::Result<(String, String, Vec<u8>), String> {
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
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut req = httparse::Request::new(&mut headers);
        match req.parse(&buf) {
            Ok(httparse::Status::Complete(head)) => {
                let len = req
                    .headers
                    .iter()
                    .find(|h| h.name.eq_ignore_ascii_case("content-length"))
                    .and_then(|h| {
                        std::str::from_utf8(h.value)
                            .ok()?
                            .trim()
                            .parse::<usize>()
                            .ok()
                    })
                    .unwrap_or(0);
                if head + len > MAX_REQUEST {
                    return Err(format!("request larger than {MAX_REQUEST} bytes"));
                }
                let method = req.method.unwrap_or("").to_owned();
                let path = req.path.unwrap_or("").to_owned();
                while buf.len() < head + len {
                    let n = conn
                        .read(&mut chunk)
                        .map_err(|e| format!("read body: {e}"))?;
                    if n == 0 {
                        return Err("connection closed inside the body".into());
                    }
                    buf.extend_from_slice(&chunk[..n]);
                }
                return Ok((method, path, buf[head..head + len].to_vec()));
            }
            Ok(httparse::Status::Partial) => continue,
            Err(e) => return Err(format!("bad HTTP request: {e}")),
        }
    }
}

fn route(
    method: &str,
    path: &str,
    body: &[u8],
    model: &Model,
    bytes: &[u8],
    kv: &Mutex<&mut [u8]>,
    info: &Value,
) -> (u16, Value) {
    match (method, path) {
        ("GET", "/health") => (200, json!({ "status": "ok", "engine": info })),
        ("POST", "/v1/completions") => {
            let req: Value = match serde_json::from_slice(body) {
                Ok(v) => v,
                Err(e) => return (400, json!({ "error": format!("body is not JSON: {e}") })),
            };
            let Some(prompt) = req["prompt"].as_str() else {
                return (400, json!({ "error": "\"prompt\" (a string) is required" }));
            };
            let max_tokens = req["max_tokens"].as_u64().unwrap_or(16) as usize;
            if max_tokens > MAX_TOKENS {
                return (
                    400,
                    json!({ "error": format!("max_tokens is at most {MAX_TOKENS}") }),
                );
            }
            let c = model.complete(bytes, prompt, max_tokens);
            // The KV cache holds the sequence's state; a real engine keeps
            // pages per sequence, here one page is rewritten per request.
            if let Ok(mut kv) = kv.lock() {
                let n = kv.len().min(c.text.len());
                kv[..n].copy_from_slice(&c.text.as_bytes()[..n]);
            }
            (
                200,
                json!({
                    "object": "text_completion",
                    "model": "shadow-reference",
                    "choices": [{ "index": 0, "text": c.text, "finish_reason": "length" }],
                    "usage": { "completion_tokens": c.tokens },
                    "fingerprint": c.fingerprint,
                    "engine": info,
                }),
            )
        }
        _ => (404, json!({ "error": format!("no route {method} {path}") })),
    }
}
