//! `gms-cuda-bench`: the figures GMS promises on a GPU, measured through the
//! real daemon and client, with the writer and each reader as separate
//! processes (as engines are).
//!
//! ```text
//! gms-cuda-bench --socket-dir DIR [--device 0] [--weights-gib 32] [--chunk-gib 2]
//!                [--kv-gib 64] [--readers 3]
//! ```
//! The writer (this process) loads and commits `--weights-gib` in
//! `--chunk-gib` allocations, each filled with its own pattern; every reader
//! (`gms-cuda-bench reader …`, a child) connects `ro`, imports and maps the
//! whole layout at the writer's addresses, checks the patterns, then
//! reserves / materialises / releases a `--kv-gib` KV cache. One JSON object
//! per line. The committed layout stays in gmsd afterwards (zero readers),
//! so that other measurements can attach to it.

use std::path::PathBuf;
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use clap::{Args, Parser, Subcommand};
use gms::client::Client;
use gms::protocol::{LeaseKind, Mode};
use gms_cuda::mapper::{connect_wait, CudaMapper, CudaRange};
use gms_cuda::parse_device;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

const GIB: u64 = 1 << 30;

#[derive(Parser)]
#[command(
    name = "gms-cuda-bench",
    about = "Attach and KV-materialise figures on a GPU, through a real gmsd: this process writes and commits, each reader is a child process",
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    role: Option<Role>,
    #[command(flatten)]
    options: Options,
}

#[derive(Subcommand)]
enum Role {
    /// One reader process (started by the writer with the writer's flags).
    #[command(hide = true)]
    Reader(Options),
}

#[derive(Args, Clone)]
struct Options {
    /// Directory of the daemon's socket (gms-<GPU-UUID>.sock).
    #[arg(long, default_value = "/run/shadow/gms")]
    socket_dir: PathBuf,
    /// CUDA device: an index, cuda:N, or a GPU UUID.
    #[arg(long, default_value = "0")]
    device: String,
    /// Weights the writer loads and commits, in GiB.
    #[arg(long, default_value_t = 32)]
    weights_gib: u64,
    /// Size of each weights allocation, in GiB.
    #[arg(long, default_value_t = 2)]
    chunk_gib: u64,
    /// KV cache each reader reserves, materialises and releases, in GiB.
    #[arg(long, default_value_t = 64)]
    kv_gib: u64,
    /// Reader processes; the last one attaches after the writer is gone.
    #[arg(long, default_value_t = 3)]
    readers: usize,
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

fn pattern(id: u64) -> u32 {
    0x5eed_0000 | (id as u32 & 0xffff)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let run = match cli.role {
        Some(Role::Reader(options)) => reader(&options),
        None => writer(&cli.options),
    };
    match run {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gms-cuda-bench: {e}");
            ExitCode::FAILURE
        }
    }
}

fn open(options: &Options) -> Res<(CudaMapper, PathBuf)> {
    let t = Instant::now();
    let mapper = CudaMapper::open(&parse_device(&options.device)?)?;
    let context_ms = ms(t);
    let socket = mapper.socket_in(&options.socket_dir);
    println!(
        "{{\"step\":\"context\",\"pid\":{},\"primary_context_ms\":{context_ms:.1},\"device\":\"{}\"}}",
        std::process::id(),
        mapper.device().uuid()
    );
    Ok((mapper, socket))
}

fn writer(options: &Options) -> Res<()> {
    let (mapper, socket) = open(options)?;
    let weights_gib = options.weights_gib;
    let chunk = options
        .chunk_gib
        .checked_mul(GIB)
        .filter(|c| *c > 0)
        .ok_or("--chunk-gib must be at least 1 and fit in 64 bits")?;
    let readers = options.readers;
    let mut client = connect_wait(
        mapper.clone(),
        &socket,
        Mode::Rw,
        "gms-cuda-bench-writer",
        Duration::from_secs(10),
    )?;
    if client.lease() != LeaseKind::Rw {
        return Err("expected an rw lease".into());
    }
    let n = (weights_gib * GIB).div_ceil(chunk);
    let t = Instant::now();
    let mut weights = Vec::new();
    for _ in 0..n {
        weights.push(client.allocate("weights", chunk)?);
    }
    let allocate_ms = ms(t);
    let t = Instant::now();
    for w in &weights {
        let id = w.allocation().id;
        w.range().fill_u32(0, pattern(id), (chunk / 4) as usize)?;
    }
    let fill_ms = ms(t);
    client.put_meta("bench", &format!("{{\"chunks\":{n},\"chunk\":{chunk}}}"))?;
    let t = Instant::now();
    let generation = client.commit(&mut weights)?;
    let commit_ms = ms(t);
    println!(
        "{{\"step\":\"writer\",\"bytes\":{},\"allocations\":{n},\"allocate_ms\":{allocate_ms:.2},\"fill_ms\":{fill_ms:.2},\"commit_ms\":{commit_ms:.2},\"generation\":{generation},\"first_va\":\"{:#x}\"}}",
        n * chunk,
        weights.first().map_or(0, |w| w.addr())
    );
    // Readers attach while the writer still holds its (now ro) lease, and
    // after it is gone: neither may matter.
    let exe = std::env::current_exe()?;
    for i in 0..readers {
        if i == readers.saturating_sub(1) {
            drop(std::mem::take(&mut weights));
            drop(client);
            client_gone_line();
            return run_reader(&exe, options);
        }
        run_reader(&exe, options)?;
    }
    Ok(())
}

fn client_gone_line() {
    println!("{{\"step\":\"writer_disconnected\"}}");
}

fn run_reader(exe: &std::path::Path, options: &Options) -> Res<()> {
    let status = Command::new(exe)
        .arg("reader")
        .arg("--socket-dir")
        .arg(&options.socket_dir)
        .args(["--device", &options.device])
        .args(["--kv-gib", &options.kv_gib.to_string()])
        .stdin(Stdio::null())
        .status()?;
    if !status.success() {
        return Err(format!("reader exited with {status}").into());
    }
    Ok(())
}

fn reader(options: &Options) -> Res<()> {
    let (mapper, socket) = open(options)?;
    let kv_gib = options.kv_gib;
    let t = Instant::now();
    let client: Client<CudaMapper> = connect_wait(
        mapper.clone(),
        &socket,
        Mode::Ro,
        "gms-cuda-bench-reader",
        Duration::from_secs(10),
    )?;
    let connect_ms = ms(t);
    let t = Instant::now();
    let imported = client.import()?;
    let import_ms = ms(t);
    let bytes: u64 = imported.weights.iter().map(|w| w.allocation().size).sum();
    for w in &imported.weights {
        let mut word = [0u8; 4];
        let range: &CudaRange = w.range();
        range.read(w.allocation().size - 4, &mut word)?;
        if u32::from_le_bytes(word) != pattern(w.allocation().id) {
            return Err(format!(
                "allocation {} at {:#x}: read {:#x}, writer wrote {:#x}",
                w.allocation().id,
                w.addr(),
                u32::from_le_bytes(word),
                pattern(w.allocation().id)
            )
            .into());
        }
        if w.addr() != w.allocation().va {
            return Err(format!(
                "mapped at {:#x}, writer used {:#x}",
                w.addr(),
                w.allocation().va
            )
            .into());
        }
    }
    // A write through the read-only mapping must be refused by the driver.
    let refused = imported
        .weights
        .first()
        .map(|w| w.range().fill_u32(0, 0, 1).is_err())
        .unwrap_or(true);
    println!(
        "{{\"step\":\"attach\",\"bytes\":{bytes},\"allocations\":{},\"connect_ms\":{connect_ms:.3},\"import_map_ms\":{import_ms:.3},\"patterns_ok\":true,\"ro_write_refused\":{refused}}}",
        imported.weights.len()
    );
    if !refused {
        return Err("a write through a read-only mapping succeeded".into());
    }
    let t = Instant::now();
    let mut kv = client.reserve_kv(kv_gib * GIB)?;
    let reserve_ms = ms(t);
    let t = Instant::now();
    kv.materialise()?;
    let materialise_ms = ms(t);
    let len = kv.len();
    kv.with_range(|r| r.fill_u32(len - 4, 7, 1))?;
    let t = Instant::now();
    kv.release()?;
    let release_ms = ms(t);
    // The promoted engine's wake: back nothing on the caller's thread, the
    // grower backs the cache chunk by chunk.
    let t = Instant::now();
    kv.wake(0)?;
    let wake_ms = ms(t);
    let first = kv.watch().wait_backed(1, Duration::from_secs(5));
    let first_chunk_ms = ms(t);
    let full = kv.watch().wait_backed(len, Duration::from_secs(30));
    let full_ms = ms(t);
    if first == 0 || full < len {
        return Err(format!(
            "the KV cache grew to {full} of {len} bytes: {}",
            kv.watch().info_json()
        )
        .into());
    }
    kv.with_range(|r| r.fill_u32(len - 4, 7, 1))?;
    kv.release()?;
    println!(
        "{{\"step\":\"kv\",\"bytes\":{},\"reserve_ms\":{reserve_ms:.3},\"materialise_ms\":{materialise_ms:.3},\"release_ms\":{release_ms:.3},\"wake_ms\":{wake_ms:.3},\"wake_first_chunk_ms\":{first_chunk_ms:.3},\"wake_full_ms\":{full_ms:.3},\"addr\":\"{:#x}\"}}",
        kv_gib * GIB,
        kv.addr()
    );
    Ok(())
}
