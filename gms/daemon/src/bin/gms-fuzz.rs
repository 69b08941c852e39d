//! `gms-fuzz`: runs the stable-toolchain mutation fuzzer for a bounded time
//! (`make fuzz`). Exits non-zero and saves the input on a finding.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use gmsd::fuzz::{run, Budget};

#[derive(Parser)]
#[command(
    name = "gms-fuzz",
    about = "Fuzz the GMS message decoder and lease state machine"
)]
struct Cli {
    /// How long to run.
    #[arg(long, default_value_t = 60)]
    seconds: u64,
    /// Seed (default: from the clock; printed so a run can be repeated).
    #[arg(long)]
    seed: Option<u64>,
    /// Where a failing input is written.
    #[arg(long, default_value = "target/gms-fuzz-finding.bin")]
    artifact: PathBuf,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let seed = cli.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
    });
    println!("gms-fuzz: seed {seed}, {} s", cli.seconds);
    let started = Instant::now();
    match run(
        seed,
        Budget::Until(started + Duration::from_secs(cli.seconds)),
    ) {
        Ok(stats) => {
            let secs = started.elapsed().as_secs_f64();
            println!(
                "gms-fuzz: no findings; {} inputs ({:.0}/s), {} accepted, {} lease steps, corpus {}",
                stats.inputs,
                stats.inputs as f64 / secs,
                stats.accepted,
                stats.lease_steps,
                stats.corpus
            );
            ExitCode::SUCCESS
        }
        Err(finding) => {
            eprintln!(
                "gms-fuzz: FINDING with {} fd(s): {}\ninput: {:?}",
                finding.fd_count,
                finding.problem,
                String::from_utf8_lossy(&finding.input)
            );
            if let Err(e) = std::fs::write(&cli.artifact, &finding.input) {
                eprintln!("gms-fuzz: cannot save {}: {e}", cli.artifact.display());
            } else {
                eprintln!("gms-fuzz: saved to {}", cli.artifact.display());
            }
            ExitCode::FAILURE
        }
    }
}
