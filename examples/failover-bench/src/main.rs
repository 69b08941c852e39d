//! `failover-bench`: the recovery gap, side by side. One engine
//! (`shadow-engine`), one open-loop load, one SIGKILL of the serving engine
//! (or several: `--kills N --gap-ms G`), on a private containerd, in arms:
//!
//! - `cold`: `io.containerd.runc.v2`, no GMS; the task is run again the
//!   instant `ctr run` returns (the best a restart policy can do). The
//!   restarted engine reads and verifies the file and rebuilds its state;
//! - `shadow`: this shim with a pair (`shadow.dev/pair=true`, GMS host
//!   backend, and by default `shadow.dev/listen`: the pair owns the
//!   listening socket, so no connection is refused): the parked shadow
//!   takes the lock and serves.
//!
//! - `gms`: this shim with one engine and no shadow
//!   (`shadow.dev/shadow=false`, GMS host backend): the shim restarts the
//!   engine in place and the restart maps the weights GMS kept.
//!
//! Failed requests are counted by kind: `refused` (nobody listened),
//! `reset_in_flight` (queued on or accepted by the engine that died),
//! `timeouts`, `wrong`. Writes `<out>/report.json` (one object per arm),
//! `<out>/timeline.svg` (each kind its own marker), `<out>/containerd.log`
//! (the shim's lines among containerd's), and prints a table; the
//! last line states each arm's failover time and the cold ÷ shadow ratio.
//! No figure is asserted.

mod error;
mod load;
mod report;

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::Parser;
use error::{Error, Result};
use load::{Progress, Workload};
use report::ArmRun;
use shadow_engine::model::{generate, Model};
use shadow_engine::promotion;
use shadow_tests::pair::{free_port, install_binary, PairEnv};
use shadow_tests::{Containerd, ContainerdBuilder, Runtime};

#[derive(Parser)]
#[command(
    name = "failover-bench",
    about = "Open-loop load through a SIGKILL of the serving engine: cold restart (runc-v2), GMS restart in place, shadow pair"
)]
struct Opts {
    /// Size of the engine's weights, in MiB.
    #[arg(long, default_value_t = 256)]
    mib: u64,
    /// Seed of the weights' values.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Open-loop request rate, per second (at least 1).
    #[arg(long, default_value_t = 200.0)]
    rate: f64,
    /// Load before the first SIGKILL, in ms.
    #[arg(long, default_value_t = 1000)]
    before_ms: u64,
    /// Load after the last recovery, in ms.
    #[arg(long, default_value_t = 1000)]
    after_ms: u64,
    /// SIGKILLs of the serving engine per arm (at least 1).
    #[arg(long, default_value_t = 1)]
    kills: usize,
    /// Pause between a recovery and the next SIGKILL, in ms.
    #[arg(long, default_value_t = 300)]
    gap_ms: u64,
    /// Arms to run, in order.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "cold,gms,shadow",
        value_parser = ["cold", "gms", "shadow"]
    )]
    arms: Vec<String>,
    /// Shim arms whose pair owns the listening socket
    /// (`shadow.dev/listen`); the others' engines bind the port themselves.
    /// `none` for none.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "shadow",
        value_parser = ["gms", "shadow", "none"]
    )]
    listen_arms: Vec<String>,
    /// Run the engines with `--no-fdstore` (no connection kept in the
    /// pair's fd store: what a kill finds in flight is lost).
    #[arg(long)]
    no_fdstore: bool,
    /// Who accepts the connections of the arms that own their socket
    /// (`shadow.dev/accept`): `engine` (each engine, storing what it
    /// accepted) or `runtime` (the shim, handing them to the serving one).
    #[arg(long, default_value = "engine", value_parser = ["engine", "runtime"])]
    accept: String,
    /// Directory of report.json and timeline.svg.
    #[arg(long, default_value = "target/shadow-bench")]
    out: PathBuf,
    /// Tokens asked of each completion.
    #[arg(long, default_value_t = 8)]
    max_tokens: usize,
}

fn parse_opts() -> Opts {
    let mut o = Opts::parse();
    o.rate = o.rate.max(1.0);
    o.kills = o.kills.max(1);
    o
}

fn now_unix_us() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_micros()
}

fn sigkill(pid: u32) -> bool {
    // SAFETY: kill(2) with a pid read from containerd or the pair's state
    // file a moment ago; no memory is involved.
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) == 0 }
}

/// `f` every 5 ms until it gives Some, for at most `limit`.
fn poll<T>(limit: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Ask `/health` until it answers 200, `limit` passes or `gone` says
/// nothing will answer (the `ctr run` that starts it has exited).
fn wait_healthy(port: u16, limit: Duration, mut gone: impl FnMut() -> bool) -> bool {
    use std::io::{Read, Write};
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline && !gone() {
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        if let Ok(mut s) = std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)) {
            let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
            let mut text = String::new();
            if s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                .and_then(|_| s.read_to_string(&mut text))
                .is_ok()
                && text.starts_with("HTTP/1.1 200")
            {
                return true;
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    false
}

/// When a SIGKILL was sent, on each clock something is compared with.
#[derive(Clone, Copy)]
struct Killed {
    at: Instant,
    unix_us: u128,
    /// `CLOCK_MONOTONIC`, the clock of the engine's promotion lines.
    mono_us: u64,
}

/// SIGKILLs `pid`, and says when.
fn kill_now(pid: u32) -> Option<Killed> {
    let t = Killed {
        at: Instant::now(),
        unix_us: now_unix_us(),
        mono_us: promotion::mono_us(),
    };
    sigkill(pid).then_some(t)
}

/// Runs the load, sends the kills on schedule (each `kill` returns when it
/// signalled, or None when there was nothing to kill), waits for a good
/// answer after the last kill, then `after_ms` more.
fn drive(
    o: &Opts,
    w: &Workload,
    mut kill: impl FnMut() -> Option<Killed>,
) -> (Vec<load::Sample>, Vec<f64>, Vec<Killed>) {
    let progress = Progress::new();
    let start = Instant::now();
    std::thread::scope(|s| {
        let h = s.spawn(|| load::run(w, &progress, start));
        let (mut kills_ms, mut kills) = (vec![], vec![]);
        for k in 0..o.kills {
            let at = start + Duration::from_millis(o.before_ms + o.gap_ms * k as u64);
            std::thread::sleep(at.saturating_duration_since(Instant::now()));
            if let Some(t) = kill() {
                kills_ms.push((t.at - start).as_secs_f64() * 1e3);
                kills.push(t);
            }
        }
        let last = kills_ms.last().copied().unwrap_or(0.0);
        let deadline = Instant::now() + Duration::from_secs(600);
        while (progress.last_ok_us.load(Ordering::Acquire) as f64) < last * 1e3
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(2));
        }
        std::thread::sleep(Duration::from_millis(o.after_ms));
        progress.stop.store(true, Ordering::Release);
        let samples = h.join().unwrap_or_default();
        (samples, kills_ms, kills)
    })
}

/// `cold`: a runc-v2 task run again the instant it exits.
fn restart_arm(
    cd: &Containerd,
    o: &Opts,
    w: &Workload,
    cmd: &[String],
    arm: &str,
    flags: &[String],
) -> Result<ArmRun> {
    let id = format!("bench-{arm}");
    let id = id.as_str();
    let stop = std::sync::atomic::AtomicBool::new(false);
    let restarts = std::sync::atomic::AtomicUsize::new(0);
    // containerd's guard stays on this thread; the restarter gets plain ctr.
    let args = cd
        .container(Runtime::RuncV2, id)
        .flags(&["--net-host"])
        .flags(flags)
        .rm()
        .cmd(cmd)
        .args()?;
    let ctr = cd.ctr();
    let ctr = &ctr;
    std::thread::scope(|s| {
        let runner = s.spawn(|| {
            while !stop.load(Ordering::Acquire) {
                match ctr.spawn(&args, false) {
                    Ok(mut sp) => {
                        // The restart policy: poll for the exit, run again at once.
                        while !sp.has_exited() {
                            std::thread::sleep(Duration::from_millis(1));
                        }
                    }
                    Err(e) => {
                        eprintln!("{arm} arm: ctr run: {e}");
                        std::thread::sleep(Duration::from_millis(50));
                    }
                }
                restarts.fetch_add(1, Ordering::AcqRel);
            }
        });
        // The restarter runs `ctr run` again and again: only time ends this.
        let result = if wait_healthy(w.port, Duration::from_secs(600), || false) {
            let (samples, kills_ms, _) = drive(o, w, || {
                let pid = ctr.tasks().ok()?.into_iter().find(|t| t.id == id)?.pid;
                kill_now(pid)
            });
            Ok(ArmRun {
                arm: arm.into(),
                samples,
                kills_ms,
                promotion_ready_ms: vec![],
                promotions: vec![],
            })
        } else {
            Err(Error::Arm {
                arm: arm.into(),
                reason: format!("engine not healthy on port {} within 600 s", w.port),
            })
        };
        stop.store(true, Ordering::Release);
        while !runner.is_finished() {
            let _ = cd.ctr().run_timeout(
                &["task", "kill", "-s", "SIGKILL", id],
                Duration::from_secs(5),
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        result
    })
}

/// `shadow` (a pair) and `gms` (`single`: one engine, restarted in place by
/// the shim, weights kept by the pair's gmsd).
fn shim_arm(
    cd: &Containerd,
    o: &Opts,
    w: &Workload,
    cmd: &[String],
    arm: &str,
    single: bool,
) -> Result<ArmRun> {
    let id = format!("bench-{arm}");
    let id = id.as_str();
    let env = PairEnv::new(cd, "gms = \"host\"")?;
    let cmd: Vec<&str> = cmd.iter().map(String::as_str).collect();
    let socket = format!("tcp:127.0.0.1:{}", w.port);
    let mut annotations: Vec<(&str, &str)> = vec![];
    if single {
        annotations.push((shadow_contract::annotations::SHADOW, "false"));
    }
    if o.listen_arms.iter().any(|a| a == arm) {
        annotations.push((shadow_contract::annotations::LISTEN, &socket));
        annotations.push((shadow_contract::annotations::ACCEPT, &o.accept));
    }
    let mut ctr = env.run(cd, id, &annotations, &["--rm", "--net-host"], &cmd)?;
    let ready = wait_healthy(w.port, Duration::from_secs(600), || ctr.has_exited());
    if !ready && ctr.has_exited() {
        // Create or Start failed: say why now rather than wait out the limit.
        return Err(Error::Arm {
            arm: arm.into(),
            reason: format!(
                "ctr run exited before the engine served: {}",
                ctr.stderr_so_far().trim()
            ),
        });
    }
    // A pair is ready for the kill once its shadow is parked; a single
    // engine once it serves.
    let protected = ready
        && poll(Duration::from_secs(600), || {
            env.state(cd, id).filter(|v| single || v.pair.protected)
        })
        .is_some();
    let result = if protected {
        let (samples, kills_ms, kills) = drive(o, w, || {
            let st = env.state(cd, id)?;
            kill_now(st.active_pid()?)
        });
        // READY of each promotion as the shim recorded it.
        let promotions = env.state(cd, id).map(|v| v.promotions).unwrap_or_default();
        let promotion_ready_ms = kills
            .iter()
            .filter_map(|k| {
                promotions
                    .iter()
                    .filter_map(|p| p.ready_unix_us)
                    .find(|&r| r as u128 > k.unix_us)
                    .map(|r| (r as u128 - k.unix_us) as f64 / 1e3)
            })
            .collect();
        // Each kill's promotion as the promoted engine timed it: the first
        // line whose lock came after that kill.
        let logged: Vec<promotion::Promoted> = ctr
            .stdout_so_far()
            .lines()
            .filter_map(promotion::parse)
            .collect();
        let promotions = kills
            .iter()
            .map(|k| {
                logged
                    .iter()
                    .filter(|p| p.lock_us > k.mono_us)
                    .min_by_key(|p| p.lock_us)
                    .map(|p| report::Promotion::since(k.mono_us, p))
            })
            .collect();
        Ok(ArmRun {
            arm: arm.into(),
            samples,
            kills_ms,
            promotion_ready_ms,
            promotions,
        })
    } else {
        Err(Error::Arm {
            arm: arm.into(),
            reason: format!(
                "engine not serving (and, for a pair, protected) within 600 s (port {})",
                w.port
            ),
        })
    };
    let _ = cd.ctr().run_timeout(
        &["task", "kill", "-s", "SIGKILL", id],
        Duration::from_secs(10),
    );
    let _ = ctr.wait(Duration::from_secs(30));
    result
}

/// The weights file for `mib`/`seed`, generated once and kept in `out`.
fn weights_file(o: &Opts) -> Result<PathBuf> {
    std::fs::create_dir_all(&o.out).map_err(|source| Error::Io {
        what: "create",
        path: o.out.clone(),
        source,
    })?;
    let path = o
        .out
        .join(format!("weights-{}mib-seed{}.safetensors", o.mib, o.seed));
    if !path.exists() {
        let t = Instant::now();
        generate(&path, o.mib, o.seed)?;
        println!(
            "generated {} in {:.1} s",
            path.display(),
            t.elapsed().as_secs_f64()
        );
    }
    Ok(path)
}

/// Hard link (same filesystem) or copy the weights into the rootfs.
fn place(weights: &Path, rootfs: &Path) -> Result<()> {
    let dir = rootfs.join("weights");
    let io = |what, path: &Path| {
        let path = path.to_owned();
        move |source| Error::Io { what, path, source }
    };
    std::fs::create_dir_all(&dir).map_err(io("create", &dir))?;
    let dst = dir.join("model.safetensors");
    if std::fs::hard_link(weights, &dst).is_err() {
        std::fs::copy(weights, &dst).map_err(io("copy weights to", &dst))?;
    }
    Ok(())
}

fn main() {
    if let Err(e) = run() {
        eprintln!("failover-bench: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let o = parse_opts();
    let weights = weights_file(&o)?;
    // What every answer must be: computed here from the same file.
    let bytes = std::fs::read(&weights).map_err(|source| Error::Io {
        what: "read",
        path: weights.clone(),
        source,
    })?;
    let model = Model::build(&bytes, &weights)?;
    let prompts: Vec<(String, String)> = (0..8)
        .map(|i| {
            let p = format!("request {i}: where does the time go when an engine dies?");
            let text = model.complete(&bytes, &p, o.max_tokens).text;
            (p, text)
        })
        .collect();
    drop(model);
    drop(bytes);

    let profile = if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    };
    let engine = std::env::current_exe()
        .map_err(|source| Error::Io {
            what: "locate",
            path: PathBuf::from("/proc/self/exe"),
            source,
        })?
        .with_file_name("shadow-engine");
    let cd = ContainerdBuilder::default().shim_profile(profile).start()?;
    install_binary(cd.rootfs(), &engine, "/bin/shadow-engine")?;
    place(&weights, cd.rootfs())?;

    let mut runs = vec![];
    for arm in &o.arms {
        let port = free_port();
        let w = Workload {
            port,
            rate: o.rate,
            max_tokens: o.max_tokens,
            prompts: prompts.clone(),
            timeout: Duration::from_secs(2),
        };
        let mut cmd: Vec<String> = [
            "/bin/shadow-engine",
            "serve",
            "--weights",
            "/weights/model.safetensors",
            "--port",
            &port.to_string(),
        ]
        .map(String::from)
        .to_vec();
        if o.no_fdstore {
            cmd.push("--no-fdstore".into());
        }
        let socket = if o.listen_arms.contains(arm) {
            ", the pair's listening socket"
        } else {
            ""
        };
        println!(
            "arm {arm}: {} MiB of weights, {} req/s, {} kill(s){socket}",
            o.mib, o.rate, o.kills
        );
        let run = match arm.as_str() {
            "cold" => restart_arm(&cd, &o, &w, &cmd, "cold", &[])?,
            "gms" => shim_arm(&cd, &o, &w, &cmd, "gms", true)?,
            _ => shim_arm(&cd, &o, &w, &cmd, "shadow", false)?,
        };
        runs.push(run);
    }

    let rows: Vec<serde_json::Value> = runs.iter().map(|r| r.summary(o.mib, o.rate)).collect();
    let report = o.out.join("report.json");
    let text = serde_json::to_string_pretty(&rows).unwrap_or_default();
    std::fs::write(&report, text).map_err(|source| Error::Io {
        what: "write",
        path: report.clone(),
        source,
    })?;
    // containerd's log, with the shim's lines (each promotion's timeline,
    // each fetch's), beside the report for whoever reads the figures.
    let log = o.out.join("containerd.log");
    if let Err(e) = std::fs::copy(cd.log(), &log) {
        eprintln!("failover-bench: keeping {}: {e}", log.display());
    }
    let svg = o.out.join("timeline.svg");
    report::chart(
        &runs,
        &svg,
        &format!(
            "SIGKILL of the serving engine under {} req/s, {} MiB of weights",
            o.rate, o.mib
        ),
    )?;
    print!("{}", report::table(&rows));
    for r in &rows {
        let Some(parts) = r["promotion_ms_p50"].as_object().filter(|p| !p.is_empty()) else {
            continue;
        };
        let said: Vec<String> = parts
            .iter()
            .map(|(k, v)| {
                format!(
                    "{k} {}",
                    v.as_f64().map_or("-".into(), |x| format!("{x:.1}"))
                )
            })
            .collect();
        println!(
            "{}: the promoted engine, ms after the SIGKILL (median of {} kills): {}",
            r["arm"].as_str().unwrap_or("?"),
            r["promotion_ms"]
                .as_array()
                .map_or(0, |a| a.iter().filter(|p| !p.is_null()).count()),
            said.join(", ")
        );
    }
    println!("report: {}  chart: {}", report.display(), svg.display());
    let get = |arm: &str| {
        rows.iter()
            .find(|r| r["arm"] == arm)
            .and_then(|r| r["unavailable_ms"].as_f64())
    };
    let mut last = String::from("failover (SIGKILL → first good answer):");
    for r in &rows {
        last += &format!(
            " {} {} ms,",
            r["arm"].as_str().unwrap_or("?"),
            r["unavailable_ms"]
                .as_f64()
                .map_or("-".into(), |x| format!("{x:.1}"))
        );
    }
    if let (Some(c), Some(s)) = (get("cold"), get("shadow")) {
        last += &format!(" cold ÷ shadow = {:.0}×", c / s.max(0.001));
    }
    println!("{}", last.trim_end_matches(','));
    Ok(())
}
