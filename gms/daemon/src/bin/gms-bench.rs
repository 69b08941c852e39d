//! `gms-bench` (`make bench-gms`): the writer's load throughput and the time
//! a new reader process takes to import and map a committed layout
//! (target: 16 GiB in ≤ 5 ms). Prints figures; asserts nothing about time.
//!
//! Scales the layout down, saying so, when MemAvailable cannot hold it.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::Instant;

use clap::Parser;
use gms::client::Client;
use gms::protocol::Mode;

const GIB: u64 = 1 << 30;

#[derive(Parser)]
#[command(
    name = "gms-bench",
    about = "GMS load and import benchmark (host backend)"
)]
struct Cli {
    /// Layout size in GiB.
    #[arg(long, default_value_t = 16)]
    gib: u64,
    /// Size of each allocation in MiB.
    #[arg(long, default_value_t = 2048)]
    chunk_mib: u64,
    /// Reader processes started one after another.
    #[arg(long, default_value_t = 7)]
    readers: usize,
}

/// Kills and reaps the daemon however the benchmark ends.
struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Removes the benchmark's socket directory however it ends.
struct Dir(PathBuf);

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kib * 1024)
}

fn sibling(name: &str) -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
    let path = exe.with_file_name(name);
    if path.exists() {
        Ok(path)
    } else {
        Err(format!(
            "{} not found next to gms-bench (build the gmsd crate's binaries)",
            path.display()
        ))
    }
}

fn gibps(bytes: u64, secs: f64) -> f64 {
    bytes as f64 / GIB as f64 / secs
}

fn run(cli: Cli) -> Result<(), String> {
    let mut gib = cli.gib.max(1);
    if let Some(avail) = mem_available() {
        // Keep 2 GiB and a quarter of the layout spare for everything else.
        while gib > 1 && gib * GIB + gib * GIB / 4 + 2 * GIB > avail {
            gib /= 2;
        }
        if gib != cli.gib {
            println!(
                "NOTE: MemAvailable is {:.1} GiB; scaled the layout down from {} GiB to {gib} GiB",
                avail as f64 / GIB as f64,
                cli.gib
            );
        }
    }
    let total = gib * GIB;
    let chunk = (cli.chunk_mib << 20).min(total);
    let dir = Dir(std::env::temp_dir().join(format!("gms-bench-{}", std::process::id())));
    let mut child = Command::new(sibling("gmsd")?)
        .args(["serve", "--socket-dir"])
        .arg(&dir.0)
        .args(["--log-level", "warn", "--max-bytes"])
        .arg((total + GIB).to_string())
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("starting gmsd: {e}"))?;
    let stdout = child.stdout.take();
    let daemon = Daemon(child);
    let mut line = String::new();
    if let Some(out) = stdout {
        BufReader::new(out)
            .read_line(&mut line)
            .map_err(|e| format!("gmsd readiness: {e}"))?;
    }
    let socket = PathBuf::from(
        line.trim()
            .strip_prefix("ready ")
            .ok_or("gmsd did not start")?,
    );

    println!(
        "layout: {gib} GiB in {} allocation(s) of {} MiB (host backend, 4 KiB pages)",
        total.div_ceil(chunk),
        chunk >> 20
    );
    let mut writer =
        Client::connect(&socket, Mode::Rw, "bench writer").map_err(|e| e.to_string())?;
    let (mut t_alloc, mut t_fill) = (0f64, 0f64);
    let started = Instant::now();
    let mut weights = Vec::new();
    let mut left = total;
    while left > 0 {
        let size = chunk.min(left);
        let t = Instant::now();
        let mut w = writer
            .allocate("weights", size)
            .map_err(|e| e.to_string())?;
        t_alloc += t.elapsed().as_secs_f64();
        let t = Instant::now();
        if let Some(bytes) = w.bytes_mut() {
            // A memset stands in for reading a checkpoint: it measures the
            // cost of the shared mapping (faults + copy), not of a disk.
            bytes.fill(0xa5);
        }
        t_fill += t.elapsed().as_secs_f64();
        weights.push(w);
        left -= size;
    }
    let t = Instant::now();
    writer.commit(&mut weights).map_err(|e| e.to_string())?;
    let t_commit = t.elapsed().as_secs_f64();
    let t_load = started.elapsed().as_secs_f64();
    println!(
        "writer: allocate (daemon fallocate + populate) {:.2} s = {:.1} GiB/s",
        t_alloc,
        gibps(total, t_alloc)
    );
    println!(
        "writer: fill through its mapping {:.2} s = {:.1} GiB/s",
        t_fill,
        gibps(total, t_fill)
    );
    println!(
        "writer: commit (unmap, seal, remap read-only) {:.2} ms",
        t_commit * 1e3
    );
    println!(
        "writer: load end to end {:.2} s = {:.1} GiB/s",
        t_load,
        gibps(total, t_load)
    );

    let probe = sibling("gms-probe")?;
    let mut times = Vec::new();
    for _ in 0..cli.readers {
        let out = Command::new(&probe)
            .arg("--socket")
            .arg(&socket)
            .arg("import")
            .output()
            .map_err(|e| format!("gms-probe import: {e}"))?;
        let text = String::from_utf8_lossy(&out.stdout);
        let json = text.trim().strip_prefix("imported ").ok_or_else(|| {
            format!(
                "gms-probe import failed: {text} {}",
                String::from_utf8_lossy(&out.stderr)
            )
        })?;
        let v: serde_json::Value = serde_json::from_str(json).map_err(|e| e.to_string())?;
        let us = v["elapsed_us"].as_f64().unwrap_or(f64::NAN);
        let connect = v["connect_us"].as_f64().unwrap_or(f64::NAN);
        println!(
            "reader: import + map {} allocation(s), {} GiB at the writer's addresses: {:.3} ms (connect + hello {:.3} ms)",
            v["allocations"],
            v["bytes"].as_u64().unwrap_or(0) / GIB,
            us / 1e3,
            connect / 1e3
        );
        times.push(us);
    }
    times.sort_by(f64::total_cmp);
    if let (Some(min), Some(med)) = (times.first(), times.get(times.len() / 2)) {
        println!(
            "reader import of {gib} GiB: min {:.3} ms, median {:.3} ms (target ≤ 5 ms for 16 GiB)",
            min / 1e3,
            med / 1e3
        );
    }

    let t = Instant::now();
    for w in weights.iter_mut() {
        w.sleep().map_err(|e| e.to_string())?;
    }
    let t_sleep = t.elapsed().as_secs_f64();
    let t = Instant::now();
    for w in weights.iter_mut() {
        w.wake().map_err(|e| e.to_string())?;
    }
    println!(
        "engine sleep (unmap, keep addresses) {:.3} ms, wake (remap) {:.3} ms",
        t_sleep * 1e3,
        t.elapsed().as_secs_f64() * 1e3
    );
    drop(weights);
    drop(writer);

    let t = Instant::now();
    stop(daemon, &socket)?;
    println!(
        "gmsd SIGTERM → exit with {gib} GiB freed: {:.1} ms",
        t.elapsed().as_secs_f64() * 1e3
    );
    Ok(())
}

fn stop(mut daemon: Daemon, socket: &Path) -> Result<(), String> {
    let pid = nix::unistd::Pid::from_raw(daemon.0.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).map_err(|e| e.to_string())?;
    let status = daemon.0.wait().map_err(|e| e.to_string())?;
    if !status.success() || socket.exists() {
        return Err(format!("gmsd did not stop cleanly: {status:?}"));
    }
    Ok(())
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gms-bench: {e}");
            ExitCode::FAILURE
        }
    }
}
