//! `gmsd`: the GPU Memory Service daemon (`serve`) and its inspection
//! command (`status`).

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use gms_cuda::parse_device;
use gmsd::backend::cuda::CudaBackend;
use gmsd::backend::host::HostBackend;
use gmsd::backend::Backend;
use gmsd::daemon::{self, Config, Limits, Supervisor, Timeouts};

#[derive(Parser)]
#[command(
    name = "gmsd",
    about = "GPU Memory Service daemon: owns weights outside any engine"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

// One value, parsed once at start: the size of its variants costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// Serve one device until SIGTERM/SIGINT.
    Serve {
        /// Directory for the socket (GMS_SOCKET_DIR); created 0700 if missing,
        /// refused if world-writable.
        #[arg(long, env = "GMS_SOCKET_DIR", default_value = "/run/shadow/gms")]
        socket_dir: PathBuf,
        /// `host`, or a CUDA device: an index (`0`), `cuda:0`, or a GPU UUID
        /// (`GPU-…`, as `nvidia-smi -L` prints it). The socket is then
        /// `gms-<GPU-UUID>.sock`. `host:GPU-<uuid>`: host memory served as
        /// that GPU's daemon (for tests of multi-GPU pairs without GPUs).
        #[arg(long, default_value = "host")]
        device: String,
        /// Most bytes allocated at once (K/M/G/T suffixes).
        #[arg(long, default_value = "64G", value_parser = gmsd::parse_bytes)]
        max_bytes: u64,
        #[arg(long, default_value_t = 4096)]
        max_allocations: usize,
        #[arg(long, default_value_t = 65536)]
        max_metadata_entries: usize,
        #[arg(long, default_value = "8M", value_parser = gmsd::parse_bytes)]
        max_metadata_bytes: u64,
        /// Open connections in all (gmsd's supervisor is not counted).
        #[arg(long, default_value_t = 256)]
        max_connections: usize,
        /// Open connections of one peer process (by pid).
        #[arg(long, default_value_t = 16)]
        max_connections_per_peer: usize,
        /// A connection without a lease must send a request within this.
        #[arg(long, default_value = "10s", value_parser = gmsd::parse_duration)]
        hello_timeout: std::time::Duration,
        /// A started message must arrive whole, and an answer be read, within this.
        #[arg(long, default_value = "10s", value_parser = gmsd::parse_duration)]
        frame_timeout: std::time::Duration,
        /// An uncommitted rw lease silent this long is dropped and its
        /// allocations discarded.
        #[arg(long, default_value = "15m", value_parser = gmsd::parse_duration)]
        writer_idle_timeout: std::time::Duration,
        /// Who may `reset` (drop the committed layout): `parent` (the
        /// process that started gmsd, e.g. the shim) or `none`.
        #[arg(long, default_value = "parent", value_parser = parse_supervisor)]
        supervisor: Supervisor,
        /// Peer uid allowed to connect (repeatable). Default: gmsd's own uid.
        #[arg(long = "allow-uid")]
        allow_uids: Vec<u32>,
        /// Peer gid allowed to connect (repeatable).
        #[arg(long = "allow-gid")]
        allow_gids: Vec<u32>,
        /// Group owner of the socket, which then gets mode 0660 (else 0600).
        #[arg(long)]
        socket_group: Option<u32>,
        /// The pair's election lock file: only the engine that holds it
        /// gets the KV pool's write lease. Without it, none does. Its
        /// identity is read once, at start.
        #[arg(long)]
        lock: Option<PathBuf>,
        /// Bytes per allocation of the KV pool: a promoted engine maps the
        /// first one before it serves and the rest while it serves.
        #[arg(long, default_value = "2G", value_parser = gmsd::parse_bytes)]
        kv_chunk: u64,
        /// error, warn, info, debug or trace (or a tracing filter).
        #[arg(long, default_value = "info")]
        log_level: String,
    },
    /// Print a running daemon's state, leases, allocations and bytes.
    /// (`--dir`: every daemon whose socket is in a GMS socket directory,
    /// one per GPU of a pair.)
    Status {
        #[arg(long, conflicts_with = "dir")]
        socket: Option<PathBuf>,
        /// A GMS socket directory: report every `gms-*.sock` in it.
        #[arg(long)]
        dir: Option<PathBuf>,
        #[arg(long)]
        json: bool,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Serve {
            socket_dir,
            device,
            max_bytes,
            max_allocations,
            max_metadata_entries,
            max_metadata_bytes,
            max_connections,
            max_connections_per_peer,
            hello_timeout,
            frame_timeout,
            writer_idle_timeout,
            supervisor,
            allow_uids,
            allow_gids,
            socket_group,
            lock,
            kv_chunk,
            log_level,
        } => {
            let filter = tracing_subscriber::EnvFilter::try_new(&log_level)
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
            tracing_subscriber::fmt()
                .with_env_filter(filter)
                .with_writer(std::io::stderr)
                .init();
            // libcuda starts threads of its own in cuInit; they must not
            // take SIGTERM/SIGINT (default action: die) before the daemon's
            // signalfd does, so block both before any backend is opened.
            let mut stop = nix::sys::signal::SigSet::empty();
            stop.add(nix::sys::signal::Signal::SIGTERM);
            stop.add(nix::sys::signal::Signal::SIGINT);
            if let Err(e) = stop.thread_block() {
                eprintln!("gmsd: blocking SIGTERM/SIGINT: {e}");
                return ExitCode::FAILURE;
            }
            let backend: Box<dyn Backend> = match device.as_str() {
                "host" => match HostBackend::new() {
                    Ok(b) => Box::new(b),
                    Err(e) => {
                        eprintln!("gmsd: host backend: {e}");
                        return ExitCode::FAILURE;
                    }
                },
                stand_in if stand_in.starts_with("host:") => {
                    match HostBackend::standing_for(&stand_in["host:".len()..]) {
                        Ok(b) => Box::new(b),
                        Err(e) => {
                            eprintln!("gmsd: host backend: {e}");
                            return ExitCode::FAILURE;
                        }
                    }
                }
                other => match parse_device(other).and_then(|sel| CudaBackend::open(&sel)) {
                    Ok(b) => {
                        tracing::info!(
                            device = %b.device(),
                            name = b.device_name(),
                            ordinal = b.ordinal(),
                            granularity = b.granularity(),
                            "cuda backend: no context in this process"
                        );
                        Box::new(b)
                    }
                    Err(e) => {
                        eprintln!("gmsd: cuda backend for device '{other}': {e}");
                        return ExitCode::FAILURE;
                    }
                },
            };
            let lock = match lock
                .as_deref()
                .map(gms::holder::FileId::of_path)
                .transpose()
            {
                Ok(lock) => lock,
                Err(e) => {
                    eprintln!("gmsd: --lock: {e}");
                    return ExitCode::FAILURE;
                }
            };
            let config = Config {
                lock,
                kv_chunk: kv_chunk.max(1),
                socket_dir,
                limits: Limits {
                    max_bytes,
                    max_allocations,
                    max_metadata_entries,
                    max_metadata_bytes: max_metadata_bytes as usize,
                    max_connections,
                    max_connections_per_peer,
                },
                allow_uids,
                allow_gids,
                socket_group,
                timeouts: Timeouts {
                    hello: hello_timeout,
                    frame: frame_timeout,
                    writer_idle: writer_idle_timeout,
                },
                supervisor,
            };
            let served = daemon::serve(config, backend, |socket| {
                // Readiness line for supervisors and tests.
                let mut out = std::io::stdout().lock();
                let _ = writeln!(out, "ready {}", socket.display());
                let _ = out.flush();
            });
            match served {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("gmsd: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Status { socket, dir, json } => {
            let sockets = match (socket, dir) {
                (Some(s), _) => vec![s],
                (None, Some(d)) => match daemon_sockets(&d) {
                    Ok(list) if !list.is_empty() => list,
                    Ok(_) => {
                        eprintln!("gmsd status: no gms-*.sock in {}", d.display());
                        return ExitCode::FAILURE;
                    }
                    Err(e) => {
                        eprintln!("gmsd status: reading {}: {e}", d.display());
                        return ExitCode::FAILURE;
                    }
                },
                (None, None) => {
                    eprintln!("gmsd status: give --socket or --dir");
                    return ExitCode::FAILURE;
                }
            };
            let many = sockets.len() > 1;
            let mut failed = false;
            let mut reports = Vec::new();
            for s in &sockets {
                match gms::client::status(s) {
                    Ok(r) => reports.push(r),
                    Err(e) => {
                        eprintln!("gmsd status: {}: {e}", s.display());
                        failed = true;
                    }
                }
            }
            if json {
                let text = if many {
                    serde_json::to_string_pretty(&reports)
                } else {
                    match reports.first() {
                        Some(r) => serde_json::to_string_pretty(r),
                        None => Ok(String::new()),
                    }
                };
                match text {
                    Ok(t) if !t.is_empty() => println!("{t}"),
                    Ok(_) => {}
                    Err(e) => {
                        eprintln!("gmsd status: {e}");
                        return ExitCode::FAILURE;
                    }
                }
            } else {
                for (i, report) in reports.iter().enumerate() {
                    if i > 0 {
                        println!();
                    }
                    print!("{}", report.render());
                    if report.backend == "cuda" {
                        println!("{}", cuda_line(report));
                    }
                }
            }
            if failed {
                ExitCode::FAILURE
            } else {
                ExitCode::SUCCESS
            }
        }
    }
}

fn parse_supervisor(s: &str) -> Result<Supervisor, String> {
    match s {
        "parent" => Ok(Supervisor::Parent),
        "none" => Ok(Supervisor::Nobody),
        _ => Err(format!("supervisor '{s}': parent or none")),
    }
}

/// The daemons' sockets in a GMS socket directory (one per device), by name.
fn daemon_sockets(dir: &std::path::Path) -> std::io::Result<Vec<PathBuf>> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)?
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_str()
                .is_some_and(shadow_contract::paths::is_gms_socket_name)
        })
        .map(|e| e.path())
        .collect();
    out.sort();
    Ok(out)
}

/// The CUDA device behind a report, named as a person looks for it: the
/// driver is asked (no context) which local device has the report's UUID.
fn cuda_line(report: &gms::status::StatusReport) -> String {
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let name = parse_device(&report.device)
        .and_then(|sel| CudaBackend::open(&sel))
        .map(|b| format!("{} (index {})", b.device_name(), b.ordinal()))
        .unwrap_or_else(|e| format!("(not resolvable here: {e})"));
    format!(
        "cuda device {} {name}: {:.2} GiB of device memory held by gmsd",
        report.device,
        gib(report.resident_bytes)
    )
}
