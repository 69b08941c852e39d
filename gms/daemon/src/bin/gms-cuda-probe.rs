//! `gms-cuda-probe`: checks the `gms-cuda` driver bindings against a real GPU
//! and times the operations GMS relies on. It lives with `gmsd` because it
//! plays the daemon, and so that `gms-cuda` stays a library without a CLI. The parent process plays `gmsd` (creates and
//! exports memory without a context); child processes play engines (import,
//! map at a fixed address, read-only or read-write), so every figure is a
//! cross-process one.
//!
//! ```text
//! gms-cuda-probe [--device 0] [--chunks 16] [--chunk-mib 2048] [--kv-gib 64]
//! ```
//! Prints one JSON object per step.

use std::{
    os::fd::{AsRawFd, BorrowedFd, OwnedFd},
    process::{Command, ExitCode},
    time::Instant,
};

use clap::{Parser, Subcommand, ValueEnum};
use gms_cuda::{Access, DeviceSelector, Driver, PhysicalMemory, Reservation};

const HINT: u64 = 0x7f00_0000_0000;
const PATTERN: u32 = 0x00C0_FFEE;

#[derive(Parser)]
#[command(
    name = "gms-cuda-probe",
    about = "Checks the CUDA VMM bindings on a real GPU and times them across processes; one JSON object per step",
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    role: Option<Role>,
    /// CUDA device: an index or a GPU UUID.
    #[arg(long, default_value = "0")]
    device: DeviceSelector,
    /// Allocations the owner creates and exports.
    #[arg(long, default_value_t = 16)]
    chunks: usize,
    /// Size of each allocation, in MiB.
    #[arg(long, default_value_t = 2048)]
    chunk_mib: usize,
    /// KV cache materialised after the engines ran, in GiB.
    #[arg(long, default_value_t = 64)]
    kv_gib: usize,
}

#[derive(Subcommand)]
enum Role {
    /// An engine process (started by the owner, descriptors inherited).
    #[command(hide = true)]
    Engine {
        mode: EngineMode,
        #[arg(long, default_value = "0")]
        device: DeviceSelector,
        /// The inherited descriptors, comma-separated.
        #[arg(long, value_delimiter = ',', required = true)]
        fds: Vec<i32>,
        #[arg(long, default_value_t = 2048)]
        chunk_mib: usize,
    },
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum EngineMode {
    /// Maps read-write and fills the pattern.
    Writer,
    /// Maps read-only and checks the pattern.
    Reader,
    /// As reader, then writes through the read-only mapping.
    ReaderWrite,
}

impl EngineMode {
    fn name(self) -> &'static str {
        match self {
            EngineMode::Writer => "writer",
            EngineMode::Reader => "reader",
            EngineMode::ReaderWrite => "reader-write",
        }
    }
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.role {
        Some(Role::Engine {
            mode,
            device,
            fds,
            chunk_mib,
        }) => engine(mode, &device, &fds, chunk_mib << 20),
        None => owner(&cli),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gms-cuda-probe: {e}");
            ExitCode::FAILURE
        }
    }
}

type Res = Result<(), Box<dyn std::error::Error>>;

/// The context-less owner, as gmsd is.
fn owner(cli: &Cli) -> Res {
    let driver = Driver::load()?;
    let device = driver.device(&cli.device)?;
    let chunks = cli.chunks;
    let chunk = cli.chunk_mib << 20;
    let kv_gib = cli.kv_gib;
    println!(
        "{{\"step\":\"info\",\"driver\":{},\"device\":\"{}\",\"uuid\":\"{}\",\"granularity\":{},\"recommended\":{}}}",
        driver.version()?,
        device.name(),
        device.uuid(),
        device.granularity(false)?,
        device.granularity(true)?
    );

    let t = Instant::now();
    let memory: Vec<PhysicalMemory> = (0..chunks)
        .map(|_| PhysicalMemory::create(&device, chunk))
        .collect::<Result<_, _>>()?;
    let create_ms = ms(t);
    let t = Instant::now();
    let fds: Vec<OwnedFd> = memory
        .iter()
        .map(PhysicalMemory::export_fd)
        .collect::<Result<_, _>>()?;
    println!(
        "{{\"step\":\"owner_create\",\"context\":false,\"bytes\":{},\"create_ms\":{create_ms:.3},\"export_ms\":{:.3}}}",
        chunks * chunk,
        ms(t)
    );

    let ordinal = device.ordinal().to_string();
    let fd_list = fds
        .iter()
        .map(|f| f.as_raw_fd().to_string())
        .collect::<Vec<_>>()
        .join(",");
    for fd in &fds {
        // The engines inherit the descriptors, as they would receive them
        // from gmsd over SCM_RIGHTS.
        // SAFETY: F_SETFD on a descriptor we own.
        unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, 0) };
    }
    for mode in ["writer", "reader", "reader-write", "reader"] {
        let out = Command::new(std::env::current_exe()?)
            .args(["engine", mode, "--device", &ordinal, "--fds", &fd_list])
            .args(["--chunk-mib", &(chunk >> 20).to_string()])
            .output()?;
        print!("{}", String::from_utf8_lossy(&out.stdout));
        if !out.status.success() {
            return Err(format!(
                "engine {mode} failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            )
            .into());
        }
    }
    drop(fds);
    let t = Instant::now();
    drop(memory);
    println!("{{\"step\":\"owner_release\",\"ms\":{:.3}}}", ms(t));

    // KV materialise: fresh pages at a kept reservation, 2 GiB and 512 MiB chunks.
    let ctx = device.retain_primary_context()?;
    let kv = kv_gib << 30;
    for kv_chunk in [2usize << 30, 512 << 20] {
        let mut range = Reservation::reserve(kv, 0, 0)?;
        for round in 0..2 {
            let t = Instant::now();
            for i in 0..kv / kv_chunk {
                let m = PhysicalMemory::create(&device, kv_chunk)?;
                range.map(i * kv_chunk, &m, &device, Access::ReadWrite)?;
            }
            let mat = ms(t);
            let t = Instant::now();
            for i in 0..kv / kv_chunk {
                range.unmap(i * kv_chunk)?;
            }
            println!(
                "{{\"step\":\"kv_materialise\",\"bytes\":{kv},\"chunk\":{kv_chunk},\"round\":{round},\"materialise_ms\":{mat:.3},\"release_ms\":{:.3}}}",
                ms(t)
            );
        }
    }
    drop(ctx);
    Ok(())
}

/// An engine process: imports the owner's memory and maps it at `HINT`.
fn engine(mode: EngineMode, device: &DeviceSelector, fds: &[i32], chunk: usize) -> Res {
    let driver = Driver::load()?;
    let device = driver.device(device)?;
    let fds: Vec<OwnedFd> = fds
        .iter()
        .map(|&raw| {
            // SAFETY: the parent passed these descriptors to us by inheritance.
            let b = unsafe { BorrowedFd::borrow_raw(raw) };
            b.try_clone_to_owned()
        })
        .collect::<Result<_, _>>()?;
    let total = chunk * fds.len();

    let t = Instant::now();
    let ctx = device.retain_primary_context()?;
    let ctx_ms = ms(t);
    let t = Instant::now();
    let mut range = Reservation::reserve(total, 0, HINT)?;
    let reserve_ms = ms(t);
    let access = if mode == EngineMode::Writer {
        Access::ReadWrite
    } else {
        Access::ReadOnly
    };
    let t = Instant::now();
    for (i, fd) in fds.iter().enumerate() {
        let m = PhysicalMemory::import(fd, chunk)?;
        range.map(i * chunk, &m, &device, access)?;
    }
    let attach_ms = ms(t);
    print!(
        "{{\"step\":\"engine\",\"mode\":\"{}\",\"pid\":{},\"bytes\":{total},\"va\":\"{:#x}\",\"hint_honoured\":{},\"ctx_ms\":{ctx_ms:.3},\"reserve_ms\":{reserve_ms:.3},\"import_map_access_ms\":{attach_ms:.3}",
        mode.name(),
        std::process::id(),
        range.base(),
        range.base() == HINT
    );
    match mode {
        EngineMode::Writer => {
            let t = Instant::now();
            range.fill_u32(0, PATTERN, total / 4)?;
            print!(
                ",\"fill_ms\":{:.3},\"fill_gib_s\":{:.1}",
                ms(t),
                total as f64 / (1u64 << 30) as f64 / t.elapsed().as_secs_f64()
            );
        }
        _ => {
            let mut buf = [0u8; 16];
            for off in [0, total / 2, total - 16] {
                range.read(off, &mut buf)?;
                let word = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]);
                if word != PATTERN {
                    return Err(format!("read {word:#x} at {off:#x}, expected {PATTERN:#x}").into());
                }
            }
            print!(",\"read_ok\":true");
            if mode == EngineMode::ReaderWrite {
                let r = range.fill_u32(0, 0, 4);
                print!(",\"write_refused\":{}", r.is_err());
                if let Err(e) = r {
                    print!(",\"write_error\":{:?}", e.to_string());
                }
                // A device fault poisons the context: end the process
                // without more driver calls, as a crashed engine would.
                println!("}}");
                drop(fds);
                std::mem::forget(range);
                std::mem::forget(ctx);
                return Ok(());
            }
        }
    }
    println!("}}");
    drop(range);
    drop(ctx);
    Ok(())
}
