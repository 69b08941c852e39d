//! `shadowctl`: what the shim knows about its engine pairs, read from the
//! `state.json` each pair's supervisor rewrites atomically on every change
//! (`<state_dir>/<namespace>/<id>/state.json`). No ttrpc: it works while
//! containerd is down and never disturbs a pair.
//!
//! ```text
//! shadowctl list [--state-dir D]
//! shadowctl show <id> [--namespace N] [--state-dir D] [--json]
//! ```

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use shadow_contract::state::{ColdRestartCause, PairState, FILE_NAME};

const DEFAULT_STATE_DIR: &str = "/run/shadow";

#[derive(Parser)]
#[command(
    name = "shadowctl",
    about = "What the shadow shim knows about its engine pairs, read from each pair's state.json (works while containerd is down)"
)]
struct Cli {
    /// The shim's state directory: <state-dir>/<namespace>/<id>/state.json.
    #[arg(long, global = true, default_value = DEFAULT_STATE_DIR)]
    state_dir: PathBuf,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// One line per pair: active slot, protection, failovers, last promotion.
    List,
    /// One pair: slots, last failover and its phases, GMS.
    Show {
        /// The container id (as containerd names the task).
        id: String,
        /// The containerd namespace, when the id exists in several.
        #[arg(long, short = 'n')]
        namespace: Option<String>,
        /// Print the whole state.json instead.
        #[arg(long)]
        json: bool,
    },
}

/// Every `state.json` under the state dir: (namespace, id, path).
fn pairs(state_dir: &Path) -> Vec<(String, String, PathBuf)> {
    let mut out = Vec::new();
    let Ok(namespaces) = std::fs::read_dir(state_dir) else {
        return out;
    };
    for ns in namespaces.flatten() {
        let Ok(ids) = std::fs::read_dir(ns.path()) else {
            continue;
        };
        for id in ids.flatten() {
            let state = id.path().join(FILE_NAME);
            if state.is_file() {
                // The directory name may be a shortened id (long CRI ids):
                // state.json carries the full one.
                let full = read(&state)
                    .map(|s| s.id)
                    .unwrap_or_else(|_| id.file_name().to_string_lossy().into_owned());
                out.push((ns.file_name().to_string_lossy().into_owned(), full, state));
            }
        }
    }
    out.sort();
    out
}

fn read(path: &Path) -> Result<PairState, String> {
    PairState::read(path).map_err(|e| e.to_string())
}

/// A value, or `-` when there is none.
fn or_dash<T: ToString>(v: Option<T>) -> String {
    v.map(|v| v.to_string()).unwrap_or_else(|| "-".into())
}

fn last_total_ms(s: &PairState) -> String {
    s.promotions
        .last()
        .and_then(|p| p.total_ms)
        .map(|ms| format!("{ms:.2} ms"))
        .unwrap_or_else(|| "-".into())
}

fn list(state_dir: &Path) -> ExitCode {
    println!(
        "{:<40} {:<7} {:<10} {:<10} LAST PROMOTION",
        "NAMESPACE/ID", "ACTIVE", "PROTECTED", "FAILOVERS"
    );
    for (ns, id, path) in pairs(state_dir) {
        match read(&path) {
            Ok(s) => println!(
                "{:<40} {:<7} {:<10} {:<10} {}",
                format!("{ns}/{id}"),
                or_dash(s.pair.active),
                s.pair.protected,
                s.pair.failovers,
                last_total_ms(&s)
            ),
            Err(e) => eprintln!("shadowctl: {e}"),
        }
    }
    ExitCode::SUCCESS
}

fn show(state_dir: &Path, id: &str, namespace: Option<&str>, json: bool) -> ExitCode {
    let found: Vec<_> = pairs(state_dir)
        .into_iter()
        .filter(|(ns, i, _)| i == id && namespace.is_none_or(|n| n == ns))
        .collect();
    let (ns, _, path) = match found.as_slice() {
        [one] => one.clone(),
        [] => {
            eprintln!(
                "shadowctl: no pair {id}{} under {}",
                namespace
                    .map(|n| format!(" in namespace {n}"))
                    .unwrap_or_default(),
                state_dir.display()
            );
            return ExitCode::from(1);
        }
        many => {
            let names: Vec<_> = many.iter().map(|(n, _, _)| n.as_str()).collect();
            eprintln!(
                "shadowctl: pair {id} exists in namespaces {}: name one with --namespace",
                names.join(", ")
            );
            return ExitCode::from(1);
        }
    };
    let s = match read(&path) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("shadowctl: {e}");
            return ExitCode::from(1);
        }
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&s).unwrap_or_default());
        return ExitCode::SUCCESS;
    }
    println!("pair {ns}/{id}");
    println!(
        "  task pid {}  active slot {}  protected {}  failovers {}  cold restarts {}  oom kills {}",
        s.pid,
        or_dash(s.pair.active),
        s.pair.protected,
        s.pair.failovers,
        s.pair.cold_restarts,
        s.pair.oom_kills
    );
    for slot in &s.pair.slots {
        println!(
            "  slot {}: {:<9} pid {:<8} generation {:<5} notify {} last exit {}",
            slot.id,
            slot.state.as_str(),
            or_dash(slot.pid),
            slot.generation,
            slot.speaks_notify,
            or_dash(slot.last_exit)
        );
    }
    match s.promotions.last() {
        Some(r) => {
            let p = &r.promotion;
            // Phases from the first sign of the death (never negative).
            let phase = |at: Option<std::time::Duration>| {
                at.map(|t| format!("{:.3} ms", t.saturating_sub(p.death_at).as_secs_f64() * 1e3))
                    .unwrap_or_else(|| "-".into())
            };
            println!(
                "  last failover #{}: slot {} -> {} ({}, {}): death seen by {}; death → reap {}, → lock {}, → ready {}; total {}",
                p.number,
                p.from,
                or_dash(p.to),
                p.exit,
                p.class.as_str(),
                p.death_seen.as_str(),
                phase(Some(p.reaped_at)),
                phase(p.lock_at),
                phase(p.ready_at),
                r.total_ms
                    .map(|ms| format!("{ms:.2} ms"))
                    .unwrap_or_else(|| "-".into())
            );
        }
        None => println!("  no failover yet"),
    }
    // Every daemon (one per GPU); a file of an older shim has `gms` only.
    let daemons: Vec<_> = if s.gms_daemons.is_empty() {
        s.gms.iter().collect()
    } else {
        s.gms_daemons.iter().collect()
    };
    if daemons.is_empty() {
        println!("  gms: none");
    }
    for g in daemons {
        println!(
            "  gms: device {} state {} bytes {} allocations {} leases {}",
            g.device,
            g.state,
            g.bytes,
            g.allocations,
            g.leases.len()
        );
    }
    if let Some(c) = &s.pair.last_cold_restart {
        match c {
            ColdRestartCause::GmsDied { device } => {
                println!("  last cold restart: the GMS daemon of {device} died")
            }
            ColdRestartCause::Xid { xid } => println!("  last cold restart: XID {xid}"),
        }
    }
    if let Some(status) = s.exit_status {
        println!("  exited with status {status}");
    }
    ExitCode::SUCCESS
}

fn main() -> ExitCode {
    // A reader that stops early (`shadowctl list | head -1`) ends us the
    // way it ends any filter, instead of a panic in println!.
    // SAFETY: called first thing in main, before any thread exists; the
    // default disposition of SIGPIPE takes no handler code.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = Cli::parse();
    match cli.command {
        Command::List => list(&cli.state_dir),
        Command::Show {
            id,
            namespace,
            json,
        } => show(&cli.state_dir, &id, namespace.as_deref(), json),
    }
}
