//! `make bench-vllm`: vLLM (`shadow-vllm serve`, the CPU build, the tiny
//! model of `make vllm-model`) through a private containerd, a shadow pair
//! against a cold restart of the same engine, in one run:
//!
//! 1. **pair**: a pair under our shim with `shadow.dev/listen` (the engines
//!    serve on the pair's socket), a client sending greedy completions one
//!    after another, and `--kills` SIGKILLs of the serving engine's main
//!    process (pid 1 of its container: the kernel ends its EngineCore and
//!    worker with it). Right after each kill two new connections are
//!    opened: a `GET /health`, whose first answer byte is "new connections
//!    served", and a completion, whose whole and correct answer (the text
//!    the pair gave before any kill) is "first correct completion". The
//!    shim's own timeline gives SIGKILL → lock taken and → `READY=1`. The
//!    stream's requests that failed are counted per kill, by why (reset,
//!    refused, timeout, an HTTP error);
//! 2. **cold**: the same engine, rootfs and arguments under
//!    `io.containerd.runc.v2` (no pair: shadow-vllm is plain `vllm serve`
//!    and binds its port), SIGKILLed `--cold` times and started again the
//!    moment `ctr run` returns, as an orchestrator would: SIGKILL → first
//!    correct completion of the restarted container;
//! 3. **memory**: each engine's RSS and PSS (summed over the processes of
//!    its cgroup, from `/proc/PID/smaps_rollup`) and the pair's PSS, with
//!    the default load format (arm 1) and, with `--gms`, a second pair that
//!    loads through GMS (`--load-format gms`, `shadow.dev/gms=host`; by
//!    default when shadow-vllm has the loader, `--gms on|off|auto`).
//!
//! Never more than two vLLM instances at once (a pair is about 7.6 GB
//! here): the arms run one after another. The host's load and free memory
//! at the start are printed with the figures; no figure is asserted.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::Parser;
use shadow_contract::annotations::{ACCEPT, GMS, LISTEN, PAIR};
use shadow_tests::bench::{now_us, pct, profile, signal};
use shadow_tests::pair::{free_port, task_pid, PairEnv};
use shadow_tests::vllm::{
    self, engine_group, engine_memory, gone_within, protected, Done, Install, LogOnPanic, Memory,
    Outcome, Stream,
};
use shadow_tests::wait::{until, within};
use shadow_tests::{Containerd, ContainerdBuilder, Runtime};

/// Two vLLMs starting side by side on two cores: 35–90 s each on a quiet
/// machine, 7 minutes beside other busy vLLMs.
const START: Duration = Duration::from_secs(900);
/// A respawned engine's start, beside the one that serves the stream.
const RESPAWN: Duration = Duration::from_secs(600);
const STEP: Duration = Duration::from_millis(5);
/// A request's limit: a failover leaves it waiting in the backlog briefly;
/// a cold start's listening socket holds it until the server runs.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
const COLD_REQUEST_TIMEOUT: Duration = Duration::from_secs(120);
/// Between two requests of the stream: a deliberate pacing (the stream is
/// one client's requests one after another, not a flood).
const PAUSE: Duration = Duration::from_millis(20);
const PROMPT: &str = "The shadow engine answers while the other one";
const MAX_TOKENS: u32 = 12;
/// A pair needs about 7.6 GB; below this much available memory the bench
/// refuses to start (`--force` starts it anyway).
const NEED_GIB: f64 = 9.0;

#[derive(Parser)]
#[command(
    name = "bench-vllm",
    about = "vLLM through containerd: SIGKILLs of a shadow pair's serving engine against a cold restart under runc-v2, and the engines' memory"
)]
struct Cli {
    /// SIGKILLs of the pair's serving engine.
    #[arg(long, default_value_t = 3)]
    kills: usize,
    /// SIGKILL + restarts of the engine under io.containerd.runc.v2.
    #[arg(long, default_value_t = 2)]
    cold: usize,
    /// A third arm, a pair loading through GMS (`--load-format gms`, the
    /// host backend), for its memory: on, off, or auto (when this
    /// shadow-vllm has the GMS loader).
    #[arg(long, value_enum, default_value_t = GmsArm::Auto)]
    gms: GmsArm,
    /// Start even with less than 9 GiB of available memory.
    #[arg(long)]
    force: bool,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum GmsArm {
    On,
    Off,
    Auto,
}

fn fail(msg: impl std::fmt::Display) -> ! {
    eprintln!("bench-vllm: {msg}");
    std::process::exit(1)
}

/// A failure once containerd runs: a panic, so that the private containerd,
/// its containers and the engines are cleaned up as the guards drop.
fn broke(msg: impl std::fmt::Display) -> ! {
    panic!("bench-vllm: {msg}")
}

/// What the host was doing when the bench started.
struct HostLoad {
    load: String,
    available_gib: f64,
    total_gib: f64,
    /// vLLM engines (API server processes) running on the host.
    other_vllm: usize,
}

impl HostLoad {
    fn now() -> HostLoad {
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let kib = |k: &str| {
            meminfo
                .lines()
                .find_map(|l| l.strip_prefix(k)?.strip_prefix(':'))
                .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        let gib = |k: &str| kib(k) / (1024.0 * 1024.0);
        let load = std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ");
        // vLLM API servers: a python whose command line serves vLLM.
        let other_vllm = std::fs::read_dir("/proc")
            .map(|rd| {
                rd.flatten()
                    .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
                    .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
                    .filter(|c| {
                        c.split(' ').next().is_some_and(|a0| a0.contains("python"))
                            && (c.contains("vllm serve")
                                || c.contains("vllm.entrypoints")
                                || c.contains("shadow-vllm serve"))
                    })
                    .count()
            })
            .unwrap_or(0);
        HostLoad {
            load,
            available_gib: gib("MemAvailable"),
            total_gib: gib("MemTotal"),
            other_vllm,
        }
    }

    fn line(&self) -> String {
        format!(
            "load average {}, {:.1} of {:.1} GiB available, {} vLLM engines running",
            self.load, self.available_gib, self.total_gib, self.other_vllm
        )
    }
}

/// Everything each arm starts from.
struct Bench {
    cd: Containerd,
    env: PairEnv,
    install: Install,
    root: PathBuf,
    /// `ctr run` flags: the rootfs's binds and the engine's environment.
    flags: Vec<String>,
}

impl Bench {
    fn ctr_flags(&self) -> Vec<String> {
        let mut f = self.flags.clone();
        f.extend(vllm::env_flags());
        f.extend(["--rm".to_owned(), "--net-host".to_owned()]);
        f
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// What one kill of the pair's serving engine came to.
#[derive(Debug, Default)]
struct Kill {
    /// SIGKILL → the first byte of the answer to a `GET /health` on a
    /// connection opened right after it.
    served_ms: Option<f64>,
    /// SIGKILL → a completion on a connection opened right after it,
    /// answered whole and correct.
    completion_ms: Option<f64>,
    /// What those two probes came to, when not an answer.
    probe_failures: Vec<String>,
    /// From the shim's timeline (state.json), on the bench's clock.
    lock_ms: Option<f64>,
    ready_ms: Option<f64>,
    /// SIGKILL → every process of the killed engine gone (reaped).
    gone_ms: f64,
    /// SIGKILL → the killed slot parked again (not for the last kill).
    parked_again_s: Option<f64>,
    /// Processes of the killed engine.
    group: usize,
    /// The stream's failed requests that ended between this kill and the
    /// next, by why.
    failed: BTreeMap<&'static str, usize>,
}

/// The pair arm's figures.
struct PairArm {
    start_s: f64,
    active: (Memory, usize),
    shadow: (Memory, usize),
    reference: String,
    kills: Vec<Kill>,
    requests: usize,
    wrong: usize,
}

/// Starts a pair, measures its memory once protected, then `kills` SIGKILLs.
fn pair_arm(b: &Bench, id: &str, kills: usize, gms: bool) -> PairArm {
    let port = free_port();
    let extra: &[&str] = if gms { &["--load-format", "gms"] } else { &[] };
    let mut c =
        b.cd.container(Runtime::Shadow, id)
            .rootfs(&b.root)
            .flags(&["--runtime-config-path", &b.env.config.display().to_string()])
            .annotation(PAIR, "true")
            .annotation(LISTEN, &format!("tcp:127.0.0.1:{port}"))
            .annotation(ACCEPT, "engine");
    c = c.annotation(GMS, if gms { "host" } else { "off" });
    let t0 = Instant::now();
    let ctr = c
        .flags(&b.ctr_flags())
        .cmd(&b.install.serve_cmd(extra))
        .spawn(false)
        .unwrap_or_else(|e| broke(format!("ctr run of the pair: {e}")));
    let log = LogOnPanic(&ctr, "pair");
    let st = until(
        "the vLLM pair protected",
        START,
        Duration::from_millis(200),
        || b.env.state(&b.cd, id).filter(|s| protected(s).is_some()),
    );
    let start_s = t0.elapsed().as_secs_f64();
    let (_, a, s) = protected(&st).unwrap_or_else(|| broke("lost protection"));
    let (active, shadow) = (engine_memory(a), engine_memory(s));
    let reference = match vllm::complete(port, PROMPT, MAX_TOKENS, REQUEST_TIMEOUT) {
        Outcome::Text(t) => t,
        other => panic!("the pair's first answer: {other:?}"),
    };
    let mut arm = PairArm {
        start_s,
        active,
        shadow,
        reference: reference.clone(),
        kills: Vec::new(),
        requests: 0,
        wrong: 0,
    };
    if kills > 0 {
        let (records, done) = kill_rounds(b, id, port, &reference, kills);
        arm.requests = done.len();
        arm.wrong = done
            .iter()
            .filter(|d| matches!(&d.outcome, Outcome::Text(t) if *t != reference))
            .count();
        arm.kills = records;
    }
    drop(log);
    b.env
        .stop(&b.cd, id, "SIGKILL", ctr, Duration::from_secs(60));
    arm
}

/// The stream and the kills; returns each kill's record and every request
/// of the stream.
fn kill_rounds(
    b: &Bench,
    id: &str,
    port: u16,
    reference: &str,
    kills: usize,
) -> (Vec<Kill>, Vec<Done>) {
    let stream = Stream::new(port, PROMPT, MAX_TOKENS, REQUEST_TIMEOUT, PAUSE);
    let mut records = Vec::new();
    let mut kill_times = Vec::new();
    std::thread::scope(|scope| {
        let client = scope.spawn(|| stream.run());
        // A failed wait (a panic) stops the client too, or the scope would
        // wait for it forever.
        let _stopper = stream.stop_on_drop();
        for round in 0..kills {
            let st = until("the pair protected", RESPAWN, STEP, || {
                b.env.state(&b.cd, id).filter(|s| protected(s).is_some())
            });
            let (slot, pid, _) = protected(&st).unwrap_or_else(|| broke("lost protection"));
            // The stream runs on the protected pair: a request started now
            // answered (by the active engine, the shadow being parked).
            let since = Instant::now();
            until(
                "a request of the stream answered by the protected pair",
                RESPAWN,
                STEP,
                || stream.answered_since(since),
            );
            let group = engine_group(pid);
            let failovers = st.pair.failovers;
            let (at, at_us) = (Instant::now(), now_us());
            if !signal(pid, libc::SIGKILL) {
                broke(format!(
                    "round {round}: kill {pid}: {}",
                    std::io::Error::last_os_error()
                ));
            }
            kill_times.push(at);
            let health = scope.spawn(move || {
                let t = vllm::get(port, "/health", REQUEST_TIMEOUT);
                (t.first_byte, t.outcome)
            });
            let answer = scope.spawn(move || {
                let outcome = vllm::complete(port, PROMPT, MAX_TOKENS, REQUEST_TIMEOUT);
                (Instant::now(), outcome)
            });
            let mut k = Kill {
                group: group.len(),
                ..Kill::default()
            };
            match health.join() {
                Ok((Some(first), Outcome::Text(_))) => k.served_ms = Some(ms(first - at)),
                Ok((_, o)) => k.probe_failures.push(format!("health: {o:?}")),
                Err(_) => k.probe_failures.push("health: the probe panicked".into()),
            }
            match answer.join() {
                Ok((end, Outcome::Text(t))) if t == reference => {
                    k.completion_ms = Some(ms(end - at))
                }
                Ok((_, o)) => k.probe_failures.push(format!("completion: {o:?}")),
                Err(_) => k
                    .probe_failures
                    .push("completion: the probe panicked".into()),
            }
            let st = within(Duration::from_secs(30), STEP, || {
                b.env.state(&b.cd, id).filter(|s| {
                    s.pair.failovers > failovers
                        && s.promotions
                            .last()
                            .is_some_and(|p| p.ready_unix_us.is_some())
                })
            });
            if let Some(p) = st.as_ref().and_then(|s| s.promotions.last()) {
                let since = |t: Option<u64>| t.map(|t| (t as f64 - at_us as f64) / 1e3);
                k.lock_ms = since(p.lock_unix_us);
                k.ready_ms = since(p.ready_unix_us);
            }
            k.gone_ms = match gone_within(&group, at, RESPAWN) {
                Ok(gone) => ms(gone),
                Err(alive) => broke(format!(
                    "round {round}: the killed engine's processes still run {RESPAWN:?} on: {alive:#?}"
                )),
            };
            if round + 1 == kills {
                // Nothing follows the last kill: its respawn is not waited for.
                records.push(k);
                break;
            }
            until(
                "the killed slot parked again",
                RESPAWN,
                Duration::from_millis(50),
                || {
                    b.env.state(&b.cd, id).filter(|s| {
                        protected(s).is_some_and(|(active, _, shadow)| {
                            active != slot && shadow != pid && s.pid_of(slot) == Some(shadow)
                        })
                    })
                },
            );
            k.parked_again_s = Some(at.elapsed().as_secs_f64());
            records.push(k);
        }
        stream.stop();
        if client.join().is_err() {
            broke("the stream's client panicked");
        }
    });
    let done = stream.all();
    for d in done.iter().filter(|d| !d.outcome.is_text()) {
        if let Some(i) = kill_times.iter().rposition(|k| *k <= d.ended) {
            *records[i].failed.entry(d.outcome.kind()).or_default() += 1;
        } else {
            eprintln!(
                "bench-vllm: a request failed before any kill: {:?}",
                d.outcome
            );
        }
    }
    (records, done)
}

/// The cold arm's figures.
struct ColdArm {
    start_s: f64,
    memory: (Memory, usize),
    /// SIGKILL → the first correct completion of the restarted container, s.
    restarts_s: Vec<f64>,
    /// SIGKILL → `ctr run` returned (container gone), s.
    exits_s: Vec<f64>,
    differing: usize,
}

/// Polls completions until one is `reference`; returns when it ended and
/// how many answers differed on the way.
fn first_correct(port: u16, reference: &str, limit: Duration) -> (Instant, usize) {
    let mut differing = 0;
    let when = until(
        "a correct completion",
        limit,
        Duration::from_millis(10),
        || match vllm::complete(port, PROMPT, MAX_TOKENS, COLD_REQUEST_TIMEOUT) {
            Outcome::Text(t) if t == reference => Some(Instant::now()),
            Outcome::Text(_) => {
                differing += 1;
                None
            }
            _ => None,
        },
    );
    (when, differing)
}

fn cold_arm(b: &Bench, restarts: usize, reference: &str) -> ColdArm {
    let port = free_port();
    let port_s = port.to_string();
    let extra = ["--host", "127.0.0.1", "--port", port_s.as_str()];
    let run = |n: usize| {
        b.cd.container(Runtime::RuncV2, &format!("cold{n}"))
            .rootfs(&b.root)
            .flags(&b.ctr_flags())
            // Alone, shadow-vllm leaves VLLM_CPU_OMP_THREADS_BIND as it
            // is; a pair's engines run with `nobind`, its default there:
            // given here by hand, both arms run the same engine.
            .flags(&["--env", "VLLM_CPU_OMP_THREADS_BIND=nobind"])
            .cmd(&b.install.serve_cmd(&extra))
            .spawn(false)
            .unwrap_or_else(|e| broke(format!("ctr run (runc-v2): {e}")))
    };
    let t0 = Instant::now();
    let mut ctr = run(0);
    let (up, mut differing) = first_correct(port, reference, START);
    let mut arm = ColdArm {
        start_s: (up - t0).as_secs_f64(),
        memory: (Memory::default(), 0),
        restarts_s: Vec::new(),
        exits_s: Vec::new(),
        differing: 0,
    };
    for n in 1..=restarts {
        let id = format!("cold{}", n - 1);
        let pid = task_pid(&b.cd, &id).unwrap_or_else(|| broke(format!("no pid for task {id}")));
        if n == 1 {
            arm.memory = engine_memory(pid);
        }
        let at = Instant::now();
        if !signal(pid, libc::SIGKILL) {
            broke(format!("kill {pid}: {}", std::io::Error::last_os_error()));
        }
        // The orchestrator: the task exits, the container goes (--rm), and
        // the same container is started again at once.
        if let Err(e) = ctr.wait(RESPAWN) {
            broke(format!("ctr run of {id} after SIGKILL: {e}"));
        }
        arm.exits_s.push(at.elapsed().as_secs_f64());
        ctr = run(n);
        let (up, d) = first_correct(port, reference, START);
        differing += d;
        arm.restarts_s.push((up - at).as_secs_f64());
    }
    let last = format!("cold{restarts}");
    let _ =
        b.cd.ctr()
            .run(&["task", "kill", "--signal", "SIGKILL", &last]);
    if let Err(e) = ctr.wait(Duration::from_secs(60)) {
        broke(format!("ctr run of {last}: {e}"));
    }
    arm.differing = differing;
    arm
}

fn gib(kib: u64) -> f64 {
    kib as f64 / (1024.0 * 1024.0)
}

fn memory_row(what: &str, (m, n): (Memory, usize)) -> String {
    format!(
        "  {what:<40} RSS {:>6.2} GiB   PSS {:>6.2} GiB   ({n} processes)",
        gib(m.rss_kib),
        gib(m.pss_kib)
    )
}

/// A pair arm's memory: each engine's row, then both engines' PSS.
fn print_pair_memory(what: &str, arm: &PairArm) {
    println!(
        "{}",
        memory_row(&format!("{what}: serving engine"), arm.active)
    );
    println!(
        "{}",
        memory_row(&format!("{what}: parked engine"), arm.shadow)
    );
    println!(
        "  {:<40} PSS {:>6.2} GiB (pair start {:.1} s)",
        format!("{what}: both"),
        gib(arm.active.0.pss_kib + arm.shadow.0.pss_kib),
        arm.start_s
    );
}

fn row(name: &str, v: &mut [f64], unit: &str) -> String {
    let n = v.len();
    let lo = v.iter().copied().reduce(f64::min).unwrap_or(f64::NAN);
    let hi = v.iter().copied().reduce(f64::max).unwrap_or(f64::NAN);
    format!(
        "  {name:<52} n={n}  p50 {:>9.1} {unit}  min {:>9.1}  max {:>9.1}",
        pct(v, 0.5),
        lo,
        hi
    )
}

fn has_gms_loader(repo: &Path) -> bool {
    let dir = repo.join("integrations/vllm/shadow_vllm");
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten().any(|e| {
                std::fs::read_to_string(e.path()).is_ok_and(|t| t.contains("register_model_loader"))
            })
        })
        .unwrap_or(false)
}

fn main() {
    let cli = Cli::parse();
    let exe = std::env::current_exe().unwrap_or_else(|e| fail(format!("own path: {e}")));
    // <target>/<profile>/bench-vllm
    let target = exe
        .parent()
        .and_then(Path::parent)
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("target"));
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let install = Install::find(&target).unwrap_or_else(|m| fail(m));
    let gms_arm = match cli.gms {
        GmsArm::On if !has_gms_loader(&repo) => {
            fail("--gms on: this shadow-vllm has no GMS model loader (--load-format gms)")
        }
        GmsArm::On => true,
        GmsArm::Off => false,
        GmsArm::Auto => has_gms_loader(&repo),
    };
    let host = HostLoad::now();
    println!("host at the start: {}", host.line());
    if host.available_gib < NEED_GIB && !cli.force {
        fail(format!(
            "{:.1} GiB available; a vLLM pair needs about 7.6 GB: wait for a quieter machine or pass --force",
            host.available_gib
        ));
    }
    let cd: Containerd = ContainerdBuilder::default()
        .shim_profile(profile())
        .start()
        .unwrap_or_else(|e| fail(format!("containerd: {e}")));
    // Each pair names its GMS backend (shadow.dev/gms): gms = "off" in the
    // shim's config would override the GMS arm's annotation.
    let env =
        PairEnv::new(&cd, "gms = \"auto\"").unwrap_or_else(|e| broke(format!("shim config: {e}")));
    let mut binds = install.binds(&repo).unwrap_or_else(|m| broke(m));
    // The GMS loader's libgms.so (make bench-vllm builds it), at its path.
    let libgms = target.join("release/libgms.so");
    let libgms = gms_arm.then(|| {
        std::fs::canonicalize(&libgms).unwrap_or_else(|e| {
            broke(format!(
                "--gms: {}: {e} (cargo build --release -p gms-capi)",
                libgms.display()
            ))
        })
    });
    binds.extend(libgms.clone());
    let (root, mut flags) =
        vllm::rootfs(cd.dir(), &binds, None).unwrap_or_else(|e| broke(format!("rootfs: {e}")));
    if let Some(lib) = &libgms {
        flags.extend(["--env".to_owned(), format!("GMS_LIB={}", lib.display())]);
    }
    let b = Bench {
        cd,
        env,
        install,
        root,
        flags,
    };

    let t = Instant::now();
    let pair = pair_arm(&b, "pair", cli.kills, false);
    eprintln!(
        "bench-vllm: pair arm done in {:.0} s",
        t.elapsed().as_secs_f64()
    );
    println!(
        "vLLM 0.32.0 CPU (shim profile {}), tiny model, --enforce-eager, float32; reference answer {:?}",
        profile(),
        pair.reference
    );
    println!(
        "\nshadow pair (io.containerd.shadow.v1, shadow.dev/listen): {} kills",
        pair.kills.len()
    );
    let col =
        |f: fn(&Kill) -> Option<f64>| -> Vec<f64> { pair.kills.iter().filter_map(f).collect() };
    let mut served = col(|k| k.served_ms);
    let mut completion = col(|k| k.completion_ms);
    let mut lock = col(|k| k.lock_ms);
    let mut ready = col(|k| k.ready_ms);
    let mut gone: Vec<f64> = pair.kills.iter().map(|k| k.gone_ms).collect();
    let mut parked: Vec<f64> = pair.kills.iter().filter_map(|k| k.parked_again_s).collect();
    let lock_row = "SIGKILL → lock taken by the shadow (shim's timeline)";
    if lock.is_empty() {
        // The shim times the lock's take-over from `/proc/locks` only for
        // engines that do not speak sd_notify; shadow-vllm does, and its
        // READY=1 (the next row) is the proof the shim goes by.
        println!(
            "  {lock_row:<52} n=0  not timed: the engines speak sd_notify, READY=1 is the proof"
        );
    } else {
        println!("{}", row(lock_row, &mut lock, "ms"));
    }
    println!(
        "{}",
        row("SIGKILL → READY=1 (shim's timeline)", &mut ready, "ms")
    );
    println!(
        "{}",
        row(
            "SIGKILL → new connection served (first byte)",
            &mut served,
            "ms"
        )
    );
    println!(
        "{}",
        row(
            "SIGKILL → first correct completion (new connection)",
            &mut completion,
            "ms"
        )
    );
    println!(
        "{}",
        row(
            "SIGKILL → the killed engine's processes all gone",
            &mut gone,
            "ms"
        )
    );
    println!(
        "{}",
        row("SIGKILL → the killed slot parked again", &mut parked, "s")
    );
    for (i, k) in pair.kills.iter().enumerate() {
        let failed: Vec<String> = k.failed.iter().map(|(w, n)| format!("{n} {w}")).collect();
        println!(
            "  kill {}: {} processes ended; stream requests failed: {}{}",
            i + 1,
            k.group,
            if failed.is_empty() {
                "none".to_owned()
            } else {
                failed.join(", ")
            },
            if k.probe_failures.is_empty() {
                String::new()
            } else {
                format!("; probes: {}", k.probe_failures.join("; "))
            }
        );
    }
    println!(
        "  stream: {} requests, {} answered differently; pair start to protected {:.1} s",
        pair.requests, pair.wrong, pair.start_s
    );

    let cold = cold_arm(&b, cli.cold, &pair.reference);
    eprintln!(
        "bench-vllm: cold arm done in {:.0} s",
        t.elapsed().as_secs_f64()
    );
    println!(
        "\ncold restart (io.containerd.runc.v2, the same rootfs and arguments): {} restarts",
        cold.restarts_s.len()
    );
    let mut restarts = cold.restarts_s.clone();
    let mut exits = cold.exits_s.clone();
    println!(
        "{}",
        row(
            "SIGKILL → ctr run returned (container gone)",
            &mut exits,
            "s"
        )
    );
    println!(
        "{}",
        row(
            "SIGKILL → first correct completion (restarted)",
            &mut restarts,
            "s"
        )
    );
    println!(
        "  first start to a correct completion {:.1} s; answers that differed: {}",
        cold.start_s, cold.differing
    );

    let cold_ms = pct(&mut restarts, 0.5) * 1e3;
    println!("\nratio cold ÷ shadow (p50):");
    println!(
        "  first correct completion   {:>8.0}×",
        cold_ms / pct(&mut completion, 0.5)
    );
    println!(
        "  new connections served     {:>8.0}×",
        cold_ms / pct(&mut served, 0.5)
    );

    // The other arms' figures are printed even if this one fails.
    let gms = gms_arm.then(|| {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pair_arm(&b, "gms", 0, true)
        }))
        .ok()
    });

    println!("\nhost at the end: {}", HostLoad::now().line());
    println!("\nmemory (summed over each engine's cgroup, /proc/PID/smaps_rollup):");
    println!("{}", memory_row("runc-v2 engine (alone)", cold.memory));
    print_pair_memory("pair, default load", &pair);
    if let Some(None) = &gms {
        println!("  pair, --load-format gms: the arm failed (its error is above, on stderr)");
    }
    if let Some(Some(g)) = &gms {
        print_pair_memory("pair, --load-format gms", g);
    }
    if gms.is_none() {
        println!("  (no GMS arm: --gms off, or no GMS loader in this shadow-vllm)");
    }
}
