//! `make bench-continuity`: what the pair's fd store costs a request that
//! no failover touches. The reference engine (`examples/engine`, GMS host
//! backend, host network) through a private containerd and the shim of
//! this binary's profile, as three pairs that all own their listening
//! socket (`shadow.dev/listen`) and all have the default fd store:
//!
//! - **on**: `shadow-engine serve` as it ships: every connection it
//!   accepts is stored (`FDSTORE=1`) with a memfd of its resume state,
//!   the state is updated as the answer goes out, and the entry removed
//!   (`FDSTOREREMOVE=1`) once it is done;
//! - **runtime**: the same engine, but the shim accepts
//!   (`shadow.dev/accept: runtime`): each connection is in the store from
//!   its accept, handed to the engine, which stores only its state memfd;
//! - **off**: the same with `--no-fdstore`: nothing stored, the request
//!   read as before.
//!
//! The pairs run for the whole bench (one per arm, reused across its
//! repeats), so each window sees the same machine: the other pairs idle.
//! A window is `--clients` closed-loop client threads, each sending
//! `POST /v1/completions` (`max_tokens` 8, one request per connection: the
//! engine answers `Connection: close`) and reading the answer to its end,
//! for a 1 s warm-up and then `--secs` measured seconds; the arms
//! alternate (on, runtime, off, on, …), `--repeats` windows each, for plain
//! answers and then for streamed ones (`"stream": true`, read to
//! `[DONE]`) unless `--no-stream`.
//!
//! Printed: per arm the median over its windows of requests per second,
//! p50 and p99 latency (connect → the engine's close), the CPU time per
//! request of the pair's shim and of its active engine, the errors, and
//! the ratios to off; then each pair's `state.json` fd store figures (the
//! "on" and "runtime" pairs' `stored` should be 2 fds for each connection
//! made to them, the "off" pair's 0; the "runtime" pair's `accepted` one
//! for each). No time is asserted: the exit status is 1 only when the
//! store was not used as the arms say (the comparison would then be
//! meaningless), or a pair failed over.

use clap::Parser;
use shadow_contract::annotations::{ACCEPT, LISTEN};
use shadow_contract::state::PairState;
use shadow_tests::bench::{clock_ticks_per_s, pct, proc_cost, profile};
use shadow_tests::pair::{free_port, shim_pid, until, PairEnv};
use shadow_tests::wait::within;
use shadow_tests::{Containerd, ContainerdBuilder, Spawned};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, ExitCode};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

#[derive(Parser)]
#[command(
    name = "bench-continuity",
    about = "The reference engine as a pair through a private containerd, with its fd store on, with the runtime accepting (shadow.dev/accept: runtime), and off (--no-fdstore), no kills: requests/s and latency of each, and their ratios"
)]
struct Cli {
    /// Closed-loop client threads per window.
    #[arg(long, default_value_t = 4)]
    clients: usize,
    /// Measured seconds per window (after a 1 s warm-up).
    #[arg(long, default_value_t = 5)]
    secs: u64,
    /// Windows per arm; the arms alternate.
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// Size of the generated weights, in MiB.
    #[arg(long, default_value_t = 16)]
    mib: u32,
    /// Plain answers only (no arm pair of streamed completions).
    #[arg(long)]
    no_stream: bool,
}

const LONG: Duration = Duration::from_secs(60);
const STEP: Duration = Duration::from_millis(5);
const WARMUP: Duration = Duration::from_secs(1);
/// The most one request may take; only something broken takes this long.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
const MAX_TOKENS: usize = 8;

/// Plain answers or streamed ones.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Plain,
    Stream,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Plain => "plain",
            Kind::Stream => "stream",
        }
    }
}

/// Where a pair serves, and the connections the bench made to it: what
/// the client threads share.
struct Target {
    port: u16,
    connections: AtomicU64,
}

/// What a pair does with its connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// The engine accepts and stores each.
    On,
    /// The runtime accepts, stores and hands each over.
    Runtime,
    /// The engine accepts and stores nothing.
    Off,
}

/// One pair under load: its id, arm, target and the `ctr run` attached to it.
struct Pair {
    id: &'static str,
    mode: Mode,
    target: Target,
    ctr: Spawned,
    /// The pair's shim and its active engine, whose CPU time each window
    /// reads (no failover: the active engine stays the same).
    shim: u32,
    engine: u32,
}

impl Pair {
    fn start(cd: &Containerd, env: &PairEnv, id: &'static str, mode: Mode) -> Pair {
        let port = free_port();
        let listen = format!("tcp:127.0.0.1:{port}");
        let port_s = port.to_string();
        let mut cmd = vec![
            "/bin/shadow-engine",
            "serve",
            "--weights",
            "/weights.safetensors",
            "--port",
            &port_s,
        ];
        if mode == Mode::Off {
            cmd.push("--no-fdstore");
        }
        let accept = if mode == Mode::Runtime {
            "runtime"
        } else {
            "engine"
        };
        let ctr = env
            .run(
                cd,
                id,
                &[(LISTEN, listen.as_str()), (ACCEPT, accept)],
                &["--rm", "--net-host"],
                &cmd,
            )
            .expect("ctr run of a pair");
        let st = env.wait_protected(cd, id, LONG);
        let engine = st.active_pid().expect("the active engine's pid");
        let shim = until("the pair's shim", LONG, STEP, || shim_pid(cd, id));
        let shim = u32::try_from(shim).expect("a pid");
        let pair = Pair {
            id,
            mode,
            target: Target {
                port,
                connections: AtomicU64::new(0),
            },
            ctr,
            shim,
            engine,
        };
        until(&format!("a first answer of {id}"), LONG, STEP, || {
            pair.target
                .request(&body("a first answer", Kind::Plain), Kind::Plain)
                .ok()
        });
        pair
    }

    fn arm(&self) -> &'static str {
        match self.mode {
            Mode::On => "store on",
            Mode::Runtime => "runtime",
            Mode::Off => "store off",
        }
    }
}

impl Target {
    /// One request on a connection of its own, read to the engine's close;
    /// what was wrong with it, if anything.
    fn request(&self, body: &str, kind: Kind) -> Result<(), String> {
        self.connections.fetch_add(1, Ordering::Relaxed);
        let mut s =
            TcpStream::connect(("127.0.0.1", self.port)).map_err(|e| format!("connect: {e}"))?;
        s.set_read_timeout(Some(REQUEST_TIMEOUT))
            .and_then(|()| s.set_write_timeout(Some(REQUEST_TIMEOUT)))
            .map_err(|e| format!("timeouts: {e}"))?;
        write!(
            s,
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .map_err(|e| format!("send: {e}"))?;
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).map_err(|e| format!("read: {e}"))?;
        check(&raw, kind)
    }
}

/// A completion request's body.
fn body(prompt: &str, kind: Kind) -> String {
    serde_json::json!({
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "stream": kind == Kind::Stream,
    })
    .to_string()
}

/// Whether `raw` is a whole 200 answer of `kind`: a plain one's body a
/// completion with a text, a stream's one event per token, the final one
/// and `[DONE]`.
fn check(raw: &[u8], kind: Kind) -> Result<(), String> {
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| format!("no head in {} bytes", raw.len()))?;
    let head = String::from_utf8_lossy(&raw[..end]);
    if !head.starts_with("HTTP/1.1 200") {
        return Err(format!("head {head:?}"));
    }
    let rest = &raw[end + 4..];
    match kind {
        Kind::Plain => {
            let v: serde_json::Value =
                serde_json::from_slice(rest).map_err(|e| format!("body: {e}"))?;
            if v["choices"][0]["text"].is_string() {
                Ok(())
            } else {
                Err(format!("no text in {v}"))
            }
        }
        Kind::Stream => {
            let text = String::from_utf8_lossy(rest);
            let events = text.split_terminator("\n\n").count();
            if text.ends_with("data: [DONE]\n\n") && events == MAX_TOKENS + 2 {
                Ok(())
            } else {
                Err(format!("a stream of {events} events, ending {:?}", {
                    let tail = text.len().saturating_sub(40);
                    text.get(tail..).unwrap_or("")
                }))
            }
        }
    }
}

/// What one measured window saw.
struct Window {
    rps: f64,
    p50_ms: f64,
    p99_ms: f64,
    requests: usize,
    errors: usize,
    first_error: Option<String>,
    /// CPU time (utime + stime) of the shim and of the active engine in
    /// the measured part, per request, in µs.
    shim_us: f64,
    engine_us: f64,
}

/// `clients` closed-loop clients against `pair` for the warm-up and then
/// `secs`: the requests that ended inside the measured part, and the
/// errors of those that began in it.
fn window(pair: &Pair, kind: Kind, clients: usize, secs: u64) -> Window {
    let target = &pair.target;
    let measured = Duration::from_secs(secs);
    let t0 = Instant::now() + WARMUP;
    let t_end = t0 + measured;
    let cost = || {
        let of = |pid| proc_cost(pid).map_or(f64::NAN, |c| c.cpu_ms as f64);
        (of(pair.shim), of(pair.engine))
    };
    let mut cpu = [(f64::NAN, f64::NAN); 2];
    let per_client: Vec<(Vec<f64>, Vec<String>)> = std::thread::scope(|s| {
        let threads: Vec<_> = (0..clients)
            .map(|i| {
                s.spawn(move || {
                    let body = body(&format!("continuity bench, client {i}"), kind);
                    let (mut lat, mut errs) = (Vec::new(), Vec::new());
                    loop {
                        let start = Instant::now();
                        if start >= t_end {
                            break;
                        }
                        let r = target.request(&body, kind);
                        let done = Instant::now();
                        match r {
                            Ok(()) if done >= t0 && done <= t_end => {
                                lat.push((done - start).as_secs_f64() * 1e3)
                            }
                            Ok(()) => {}
                            Err(e) if start >= t0 => errs.push(e),
                            Err(_) => {}
                        }
                    }
                    (lat, errs)
                })
            })
            .collect();
        // The CPU time of the measured part, read from this thread.
        for (at, slot) in [t0, t_end].into_iter().zip(cpu.iter_mut()) {
            std::thread::sleep(at.saturating_duration_since(Instant::now()));
            *slot = cost();
        }
        threads
            .into_iter()
            .map(|t| t.join().expect("a client thread"))
            .collect()
    });
    let mut lat: Vec<f64> = per_client.iter().flat_map(|(l, _)| l.clone()).collect();
    let errors: Vec<&String> = per_client.iter().flat_map(|(_, e)| e).collect();
    let per_request = |ms: f64| ms * 1e3 / lat.len().max(1) as f64;
    Window {
        shim_us: per_request(cpu[1].0 - cpu[0].0),
        engine_us: per_request(cpu[1].1 - cpu[0].1),
        rps: lat.len() as f64 / measured.as_secs_f64(),
        p50_ms: pct(&mut lat, 0.5),
        p99_ms: pct(&mut lat, 0.99),
        requests: lat.len(),
        errors: errors.len(),
        first_error: errors.first().map(|e| e.to_string()),
    }
}

/// The windows of one arm (a kind of request, a pair), as measured.
struct Arm<'a> {
    kind: Kind,
    pair: &'a Pair,
    windows: Vec<Window>,
}

impl Arm<'_> {
    fn median(&self, f: impl Fn(&Window) -> f64) -> f64 {
        let mut v: Vec<f64> = self.windows.iter().map(f).collect();
        pct(&mut v, 0.5)
    }
}

/// The reference engine and its weights in `cd`'s rootfs (shared by both
/// pairs): the engine next to this binary, the weights generated by it.
fn install(cd: &Containerd, mib: u32) {
    let engine = std::env::current_exe()
        .expect("this binary's path")
        .with_file_name("shadow-engine");
    assert!(
        engine.is_file(),
        "{} missing: build it (cargo build --release -p shadow-engine, or make release)",
        engine.display()
    );
    shadow_tests::pair::install_binary(cd.rootfs(), &engine, "/bin/shadow-engine")
        .expect("install shadow-engine in the rootfs");
    let weights = cd.rootfs().join("weights.safetensors");
    let out = Command::new(&engine)
        .arg("generate")
        .arg("--out")
        .arg(&weights)
        .args(["--mib", &mib.to_string()])
        .output()
        .expect("run shadow-engine generate");
    assert!(
        out.status.success(),
        "shadow-engine generate: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The pair's `state.json` once its store holds nothing (every connection
/// answered and removed), or as it is after a while.
fn settled(cd: &Containerd, env: &PairEnv, id: &str) -> Option<PairState> {
    within(Duration::from_secs(10), STEP, || {
        env.state(cd, id)
            .filter(|s| s.fdstore.as_ref().is_some_and(|f| f.fds == 0))
    })
    .or_else(|| env.state(cd, id))
}

/// "a b c" of one figure per window.
fn each(arm: &Arm, f: impl Fn(&Window) -> f64) -> String {
    let v: Vec<String> = arm.windows.iter().map(|w| format!("{:.0}", f(w))).collect();
    v.join(" ")
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let profile = profile();
    let cd: Containerd = ContainerdBuilder::default()
        .shim_profile(profile)
        .start()
        .expect("a private containerd");
    install(&cd, cli.mib);
    let gmsd = std::env::current_exe()
        .expect("this binary's path")
        .with_file_name("gmsd");
    assert!(
        gmsd.is_file(),
        "{} missing: build gmsd ({profile})",
        gmsd.display()
    );
    let env = PairEnv::new(
        &cd,
        &format!("gms = \"host\"\ngmsd = \"{}\"", gmsd.display()),
    )
    .expect("the shim's config");
    let on = Pair::start(&cd, &env, "store-on", Mode::On);
    let runtime = Pair::start(&cd, &env, "accept-runtime", Mode::Runtime);
    let off = Pair::start(&cd, &env, "store-off", Mode::Off);
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "bench-continuity: shim and engine {profile}, {} cores, {} clients, {} × ({} s warm-up + {} s) per arm, weights {} MiB, max_tokens {MAX_TOKENS}; load average {}",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        cli.clients,
        cli.repeats,
        WARMUP.as_secs(),
        cli.secs,
        cli.mib,
        load.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
    );

    let mut kinds = vec![Kind::Plain];
    if !cli.no_stream {
        kinds.push(Kind::Stream);
    }
    let mut arms: Vec<Arm> = kinds
        .iter()
        .flat_map(|&kind| {
            [&on, &runtime, &off].map(|pair| Arm {
                kind,
                pair,
                windows: Vec::new(),
            })
        })
        .collect();
    // Per kind, the arms alternate: on, runtime, off, on, …
    for chunk in arms.chunks_mut(3) {
        for r in 0..cli.repeats {
            for arm in chunk.iter_mut() {
                let w = window(arm.pair, arm.kind, cli.clients, cli.secs);
                println!(
                    "  {} {:<9} #{}: {:>7.0} req/s  p50 {:>7.3} ms  p99 {:>7.3} ms  CPU/req shim {:>5.0} µs engine {:>5.0} µs  errors {}{}",
                    arm.kind.name(),
                    arm.pair.arm(),
                    r + 1,
                    w.rps,
                    w.p50_ms,
                    w.p99_ms,
                    w.shim_us,
                    w.engine_us,
                    w.errors,
                    w.first_error
                        .as_deref()
                        .map(|e| format!(" (first: {e})"))
                        .unwrap_or_default()
                );
                arm.windows.push(w);
            }
        }
    }

    println!();
    println!(
        "{:<18} {:>8} {:>8} {:>8} {:>12} {:>12} {:>9} {:>7}   req/s per window",
        "arm", "req/s", "p50 ms", "p99 ms", "shim µs/req", "engine µs/req", "requests", "errors"
    );
    for arm in &arms {
        println!(
            "{:<18} {:>8.0} {:>8.3} {:>8.3} {:>12.0} {:>13.0} {:>9} {:>7}   {}",
            format!("{} {}", arm.kind.name(), arm.pair.arm()),
            arm.median(|w| w.rps),
            arm.median(|w| w.p50_ms),
            arm.median(|w| w.p99_ms),
            arm.median(|w| w.shim_us),
            arm.median(|w| w.engine_us),
            arm.windows.iter().map(|w| w.requests).sum::<usize>(),
            arm.windows.iter().map(|w| w.errors).sum::<usize>(),
            each(arm, |w| w.rps)
        );
    }
    println!(
        "(medians over {} windows per arm; CPU time in clock ticks of {} ms, from /proc/<pid>/stat of the pair's shim and its active engine)",
        cli.repeats,
        1000 / clock_ticks_per_s()
    );
    for kind in arms.chunks(3) {
        let [a_on, a_runtime, a_off] = kind else {
            continue;
        };
        for a in [a_on, a_runtime] {
            println!(
                "ratio {}/off, {}: req/s {:.3}, p50 {:.3}, p99 {:.3}, engine CPU/req {:.3}",
                a.pair.arm(),
                a.kind.name(),
                a.median(|w| w.rps) / a_off.median(|w| w.rps),
                a.median(|w| w.p50_ms) / a_off.median(|w| w.p50_ms),
                a.median(|w| w.p99_ms) / a_off.median(|w| w.p99_ms),
                a.median(|w| w.engine_us) / a_off.median(|w| w.engine_us),
            );
        }
    }

    // The store's own figures: the proof that the arms are what they say.
    let mut ok = true;
    for pair in [&on, &runtime, &off] {
        let made = pair.target.connections.load(Ordering::Relaxed);
        let Some(st) = settled(&cd, &env, pair.id) else {
            println!("fd store of {} ({}): no state.json", pair.id, pair.arm());
            ok = false;
            continue;
        };
        if st.pair.failovers != 0 {
            println!(
                "pair {}: {} failovers during the bench (none expected)",
                pair.id, st.pair.failovers
            );
            ok = false;
        }
        match st.fdstore {
            Some(f) => {
                println!(
                    "fd store of {} ({}): stored {}, removed {}, hung up {}, held now {}, accepted {}, handed {}, refused {:?}; {made} connections made to it{}",
                    pair.id,
                    pair.arm(),
                    f.stored,
                    f.removed,
                    f.hung_up,
                    f.fds,
                    f.accepted,
                    f.handed,
                    f.refused,
                    if pair.mode == Mode::Off {
                        ""
                    } else {
                        " (each stored as 2 fds: the socket and its state memfd)"
                    }
                );
                let right = match pair.mode {
                    Mode::On => f.stored > 0 && f.accepted == 0,
                    Mode::Runtime => f.accepted > 0 && f.handed > 0,
                    Mode::Off => f.stored == 0,
                };
                if !right {
                    println!(
                        "  wrong: the {} arm must {}",
                        pair.arm(),
                        match pair.mode {
                            Mode::On => "store its connections, the engine accepting",
                            Mode::Runtime => "have the runtime accept and hand over",
                            Mode::Off => "store nothing",
                        }
                    );
                    ok = false;
                }
            }
            None => {
                println!(
                    "fd store of {} ({}): none in state.json",
                    pair.id,
                    pair.arm()
                );
                ok = false;
            }
        }
    }

    stop(&cd, &env, [on, runtime, off]);
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// Stop the pairs and check what a pair's end must leave: nothing of
/// containerd's, no pair directory, no metrics file.
fn stop(cd: &Containerd, env: &PairEnv, pairs: [Pair; 3]) {
    for p in &pairs {
        cd.ctr()
            .run(&["task", "kill", "--signal", "SIGKILL", p.id])
            .expect("ctr task kill")
            .assert_success();
    }
    let ids = pairs.each_ref().map(|p| p.id);
    for p in pairs {
        let out = p.ctr.wait(LONG).expect("ctr run ends");
        assert_ne!(out.code(), 0, "{out}");
    }
    cd.assert_no_leftovers();
    for id in ids {
        assert!(!env.pair_dir(cd, id).exists(), "pair dir of {id} left");
    }
    let metrics = std::fs::read_dir(&env.metrics_dir).map_or(0, |d| d.count());
    assert_eq!(
        metrics,
        0,
        "metrics files left in {}",
        env.metrics_dir.display()
    );
}
