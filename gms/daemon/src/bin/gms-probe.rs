//! `gms-probe`: a real engine-side process for tests, benchmarks and
//! people poking at a daemon. Each subcommand prints one JSON line starting
//! with a keyword once it is ready, then obeys lines on stdin until EOF:
//!
//! - `writer`: allocate, fill with a seeded pattern, optionally commit;
//!   prints `ready {...}`; `commit` on stdin commits later.
//! - `reader`: import the committed layout; prints `ready {...}`; `check` on
//!   stdin recomputes the checksum.
//! - `reader-write`: import, try to make the mapping writable, then write
//!   to it: expected to die of SIGSEGV.
//! - `import`: time one import and print it (the benchmark's reader).
//! - `reset`: ask for the supervisor's reset (refused: a probe is an engine).
//! - `kv`: take the flock of `--lock` (waiting for it, as a parked engine
//!   does; `--no-lock` asks without it), then the KV pool's write lease,
//!   showing the locked descriptor as its proof;
//!   prints `ready {...}` with the pool's first and last bytes and how
//!   much of it the grant mapped (`--first BYTES`: the allocations that
//!   hold those bytes, the rest by libgms's thread, waited for before the
//!   last byte is read); on stdin `write B` fills the pool's first and
//!   last pages with byte B, `fence MS` waits that long
//!   for the fence and prints `fence {"passed": …}`, `unlock` drops the
//!   flock and stays alive.
//!
//! Any failure prints `error {"code": …, "message": …}` and exits 1.

use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::{Parser, Subcommand};
use gms::client::{Client, Weights};
use gms::mapper::Range;
use gms::protocol::Mode;
use serde_json::json;

#[derive(Parser)]
#[command(name = "gms-probe", about = "Engine-side GMS test process")]
struct Cli {
    #[arg(long, global = true, default_value = "/run/shadow/gms/gms-host.sock")]
    socket: PathBuf,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    Writer {
        #[arg(long, default_value = "rw", value_parser = parse_mode)]
        mode: Mode,
        #[arg(long, default_value_t = 1)]
        count: usize,
        #[arg(long, default_value = "1M", value_parser = gmsd::parse_bytes)]
        size: u64,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        #[arg(long)]
        commit: bool,
    },
    Reader {
        #[arg(long, default_value = "ro", value_parser = parse_mode)]
        mode: Mode,
    },
    ReaderWrite,
    Import,
    Reset,
    Kv {
        #[arg(long)]
        lock: PathBuf,
        #[arg(long)]
        no_lock: bool,
        #[arg(long, default_value = "4M", value_parser = gmsd::parse_bytes)]
        size: u64,
        #[arg(long, value_parser = gmsd::parse_bytes)]
        first: Option<u64>,
    },
}

fn parse_mode(s: &str) -> Result<Mode, String> {
    match s {
        "rw" => Ok(Mode::Rw),
        "ro" => Ok(Mode::Ro),
        "rw_or_ro" => Ok(Mode::RwOrRo),
        _ => Err(format!("mode '{s}': rw, ro or rw_or_ro")),
    }
}

/// FNV-1a over every mapped byte, in layout order.
fn checksum(weights: &[Weights]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for w in weights {
        for &b in w.bytes().unwrap_or(&[]) {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// Fills with a pattern that differs per allocation and per seed, at
/// memcpy speed (one 64 KiB block copied over and over).
pub fn fill(bytes: &mut [u8], seed: u64, index: usize) {
    let mut block = vec![0u8; 64 << 10];
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (index as u64 + 1);
    for b in block.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    for chunk in bytes.chunks_mut(block.len()) {
        chunk.copy_from_slice(&block[..chunk.len()]);
    }
}

fn say(keyword: &str, value: serde_json::Value) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{keyword} {value}");
    let _ = out.flush();
}

fn describe(client: &Client, weights: &[Weights], generation: u64) -> serde_json::Value {
    json!({
        "pid": std::process::id(),
        "lease": client.lease().to_string(),
        "generation": generation,
        "vas": weights.iter().map(|w| w.addr()).collect::<Vec<_>>(),
        "sizes": weights.iter().map(|w| w.range().len()).collect::<Vec<_>>(),
        "checksum": checksum(weights),
    })
}

fn run(cli: Cli) -> gms::Result<()> {
    let socket = cli.socket;
    let stdin = std::io::stdin();
    match cli.command {
        Command::Writer {
            mode,
            count,
            size,
            seed,
            commit,
        } => {
            let mut client = Client::connect(&socket, mode, "gms-probe writer")?;
            if client.lease() != gms::protocol::LeaseKind::Rw {
                // rw_or_ro gave us ro: act as a reader.
                let imported = client.import()?;
                say(
                    "ready",
                    describe(&client, &imported.weights, imported.layout.generation),
                );
                for _ in stdin.lock().lines() {}
                return Ok(());
            }
            let mut weights = Vec::with_capacity(count);
            for i in 0..count {
                let mut w = client.allocate("weights", size)?;
                if let Some(bytes) = w.bytes_mut() {
                    fill(bytes, seed, i);
                }
                client.put_meta(
                    &format!("tensor.{i}"),
                    &json!({"alloc": w.allocation().id, "offset": 0, "len": size}).to_string(),
                )?;
                weights.push(w);
            }
            let mut generation = 0;
            if commit {
                generation = client.commit(&mut weights)?;
            }
            say("ready", describe(&client, &weights, generation));
            for line in stdin.lock().lines() {
                let line = line.map_err(|e| gms::Error::Invalid(format!("stdin: {e}")))?;
                if line.trim() == "commit" {
                    generation = client.commit(&mut weights)?;
                    say("committed", describe(&client, &weights, generation));
                }
            }
            Ok(())
        }
        Command::Reader { mode } => {
            let client = Client::connect(&socket, mode, "gms-probe reader")?;
            let imported = client.import()?;
            let generation = imported.layout.generation;
            say("ready", describe(&client, &imported.weights, generation));
            for line in stdin.lock().lines() {
                let line = line.map_err(|e| gms::Error::Invalid(format!("stdin: {e}")))?;
                if line.trim() == "check" {
                    say("checksum", json!(checksum(&imported.weights)));
                }
            }
            Ok(())
        }
        Command::ReaderWrite => {
            let client = Client::connect(&socket, Mode::Ro, "gms-probe reader-write")?;
            let imported = client.import()?;
            let first = imported
                .weights
                .first()
                .ok_or_else(|| gms::Error::NoLayout("layout has no allocations".into()))?;
            let addr = first.addr();
            // SAFETY: mprotect on a range this process mapped; expected to
            // fail because the descriptor is read-only.
            let rc = unsafe {
                libc::mprotect(
                    addr as *mut libc::c_void,
                    first.range().len() as usize,
                    libc::PROT_READ | libc::PROT_WRITE,
                )
            };
            let mprotect = if rc == 0 {
                "allowed".to_string()
            } else {
                std::io::Error::last_os_error().to_string()
            };
            say("mapped", json!({"addr": addr, "mprotect_write": mprotect}));
            // SAFETY: deliberately writes through a read-only mapping: the
            // test expects the kernel to kill this process with SIGSEGV.
            unsafe { std::ptr::write_volatile(addr as *mut u8, 0x5a) };
            say("wrote", json!({"addr": addr}));
            Ok(())
        }
        Command::Reset => {
            let generation = gms::client::reset(&socket)?;
            say("reset", json!({ "generation": generation }));
            Ok(())
        }
        Command::Kv {
            lock,
            no_lock,
            size,
            first,
        } => kv(&socket, &lock, no_lock, size, first.unwrap_or(u64::MAX)),
        Command::Import => {
            let started = Instant::now();
            let client = Client::connect(&socket, Mode::Ro, "gms-probe import")?;
            let connected = started.elapsed();
            let imported = client.import()?;
            let elapsed = started.elapsed();
            let bytes: u64 = imported.weights.iter().map(|w| w.range().len()).sum();
            say(
                "imported",
                json!({
                    "allocations": imported.weights.len(),
                    "bytes": bytes,
                    "connect_us": connected.as_secs_f64() * 1e6,
                    "elapsed_us": elapsed.as_secs_f64() * 1e6,
                }),
            );
            Ok(())
        }
    }
}

/// `kv`: see the module's doc.
fn kv(
    socket: &std::path::Path,
    lock: &std::path::Path,
    no_lock: bool,
    size: u64,
    first_bytes: u64,
) -> gms::Result<()> {
    use std::os::fd::AsRawFd;
    let file = std::fs::File::open(lock)
        .map_err(|e| gms::Error::io(format!("opening {}", lock.display()), e))?;
    if !no_lock {
        // SAFETY: flock on a descriptor this process owns.
        if unsafe { nix::libc::flock(file.as_raw_fd(), nix::libc::LOCK_EX) } != 0 {
            return Err(gms::Error::io("flock", std::io::Error::last_os_error()));
        }
    }
    let mapper = gms::mapper::HostMapper::default();
    use std::os::fd::AsFd;
    // The proof is the descriptor the lock is held through (with
    // `--no-lock`, one through which nothing is held).
    let pool = gms::kvpool::KvPool::ask(&mapper, socket, file.as_fd(), size, 1 << 16, 4096)?
        .granted_first(&mapper, first_bytes)?;
    let mapped_at_grant = pool.mapped_at_grant();
    let mut first = [0u8; 1];
    pool.read_at(0, &mut first)?;
    let mapped = pool
        .map_watch()
        .wait_mapped(pool.len(), std::time::Duration::from_secs(10));
    let mut last = [0u8; 1];
    pool.read_at(pool.len() - 1, &mut last)?;
    say(
        "ready",
        json!({
            "pid": std::process::id(),
            "pool": pool.id(),
            "created": pool.created(),
            "fenced": pool.fence().passed(),
            "first": first[0],
            "last": last[0],
            "mapped_at_grant": mapped_at_grant,
            "mapped": mapped,
            "va": pool.addr(),
            "size": pool.len(),
        }),
    );
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let mut words = line.split_whitespace();
        match (words.next(), words.next()) {
            (Some("write"), Some(b)) => {
                let b: u8 = b.parse().unwrap_or(0);
                pool.write_at(0, &[b; 4096])?;
                pool.write_at(pool.len() - 4096, &[b; 4096])?;
                say("written", json!({ "byte": b }));
            }
            (Some("fence"), Some(ms)) => {
                let ms: u64 = ms.parse().unwrap_or(0);
                let passed = pool.fence().wait(std::time::Duration::from_millis(ms));
                say("fence", json!({ "passed": passed }));
            }
            (Some("unlock"), _) => {
                // SAFETY: as above.
                unsafe { nix::libc::flock(file.as_raw_fd(), nix::libc::LOCK_UN) };
                say("unlocked", json!({}));
            }
            _ => {}
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gms-probe: {e}");
            say(
                "error",
                json!({ "code": e.code().to_string(), "message": e.to_string() }),
            );
            ExitCode::FAILURE
        }
    }
}
