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

use gms::backend::cuda::parse_device;
use gms::client::Client;
use gms::cuda_mapper::{connect_wait, CudaMapper, CudaRange};
use gms::mapper::Range;
use gms::protocol::{LeaseKind, Mode};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

const GIB: u64 = 1 << 30;

fn arg(args: &[String], name: &str, default: &str) -> String {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
        .unwrap_or_else(|| default.to_string())
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

fn pattern(id: u64) -> u32 {
    0x5eed_0000 | (id as u32 & 0xffff)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let run = if args.get(1).map(String::as_str) == Some("reader") {
        reader(&args)
    } else {
        writer(&args)
    };
    match run {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gms-cuda-bench: {e}");
            ExitCode::FAILURE
        }
    }
}

fn open(args: &[String]) -> Res<(CudaMapper, PathBuf)> {
    let t = Instant::now();
    let mapper = CudaMapper::open(&parse_device(&arg(args, "--device", "0"))?)?;
    let context_ms = ms(t);
    let socket = mapper.socket_in(&PathBuf::from(arg(args, "--socket-dir", "/run/shadow/gms")));
    println!(
        "{{\"step\":\"context\",\"pid\":{},\"primary_context_ms\":{context_ms:.1},\"device\":\"{}\"}}",
        std::process::id(),
        mapper.device().uuid()
    );
    Ok((mapper, socket))
}

fn writer(args: &[String]) -> Res<()> {
    let (mapper, socket) = open(args)?;
    let weights_gib: u64 = arg(args, "--weights-gib", "32").parse()?;
    let chunk = arg(args, "--chunk-gib", "2").parse::<u64>()? * GIB;
    let readers: usize = arg(args, "--readers", "3").parse()?;
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
            return run_reader(&exe, args);
        }
        run_reader(&exe, args)?;
    }
    Ok(())
}

fn client_gone_line() {
    println!("{{\"step\":\"writer_disconnected\"}}");
}

fn run_reader(exe: &std::path::Path, args: &[String]) -> Res<()> {
    let mut child_args = vec!["reader".to_string()];
    child_args.extend(args.iter().skip(1).cloned());
    let status = Command::new(exe)
        .args(&child_args)
        .stdin(Stdio::null())
        .status()?;
    if !status.success() {
        return Err(format!("reader exited with {status}").into());
    }
    Ok(())
}

fn reader(args: &[String]) -> Res<()> {
    let (mapper, socket) = open(args)?;
    let kv_gib: u64 = arg(args, "--kv-gib", "64").parse()?;
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
    kv.range().fill_u32(kv.range().len() - 4, 7, 1)?;
    let t = Instant::now();
    kv.release()?;
    let release_ms = ms(t);
    println!(
        "{{\"step\":\"kv\",\"bytes\":{},\"reserve_ms\":{reserve_ms:.3},\"materialise_ms\":{materialise_ms:.3},\"release_ms\":{release_ms:.3},\"addr\":\"{:#x}\"}}",
        kv_gib * GIB,
        kv.range().addr()
    );
    Ok(())
}
