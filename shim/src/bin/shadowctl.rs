//! `shadowctl`: what the shim knows about its engine pairs, read from the
//! `state.json` each pair's supervisor rewrites atomically on every change
//! (`<state_dir>/<containerd key>/<namespace>/<id>/state.json`). No ttrpc:
//! it works while containerd is down and never disturbs a pair. Pairs of
//! every containerd on the host are shown, unless `--address` names one.
//!
//! ```text
//! shadowctl list [--state-dir D] [--address A]
//! shadowctl show <id> [--namespace N] [--state-dir D] [--address A] [--json]
//! ```

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use shadow_contract::host::{containerd_key, is_containerd_key};
use shadow_contract::state::{ColdRestartCause, HangCause, PairState, FILE_NAME};

const DEFAULT_STATE_DIR: &str = "/run/shadow";

#[derive(Parser)]
#[command(
    name = "shadowctl",
    about = "What the shadow shim knows about its engine pairs, read from each pair's state.json (works while containerd is down)"
)]
struct Cli {
    /// The shim's state directory: <state-dir>/<key>/<namespace>/<id>/state.json.
    #[arg(long, global = true, default_value = DEFAULT_STATE_DIR)]
    state_dir: PathBuf,
    /// Only the pairs of the containerd at this address (default: every
    /// containerd's).
    #[arg(long, short = 'a', global = true)]
    address: Option<String>,
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

/// One pair found under the state dir.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Found {
    namespace: String,
    id: String,
    /// The containerd's address (its key when the file does not say).
    containerd: String,
    path: PathBuf,
}

/// Every `state.json` under the state dir, of one containerd (`address`)
/// or of all.
fn pairs(state_dir: &Path, address: Option<&str>) -> Vec<Found> {
    let mut out = Vec::new();
    let only = address.map(containerd_key);
    let Ok(keys) = std::fs::read_dir(state_dir) else {
        return out;
    };
    for key in keys.flatten() {
        let key_name = key.file_name().to_string_lossy().into_owned();
        if !is_containerd_key(&key_name) || only.as_ref().is_some_and(|k| *k != key_name) {
            continue;
        }
        let Ok(namespaces) = std::fs::read_dir(key.path()) else {
            continue;
        };
        for ns in namespaces.flatten() {
            let Ok(ids) = std::fs::read_dir(ns.path()) else {
                continue;
            };
            for id in ids.flatten() {
                let state = id.path().join(FILE_NAME);
                if !state.is_file() {
                    continue;
                }
                // Directory names may be shortened (long CRI ids, long
                // namespaces): state.json carries the full ones.
                let s = read(&state).ok();
                let name = |d: &std::fs::DirEntry| d.file_name().to_string_lossy().into_owned();
                out.push(Found {
                    namespace: s
                        .as_ref()
                        .map_or_else(|| name(&ns), |s| s.namespace.clone()),
                    id: s.as_ref().map_or_else(|| name(&id), |s| s.id.clone()),
                    containerd: s
                        .map(|s| s.containerd)
                        .filter(|c| !c.is_empty())
                        .unwrap_or_else(|| key_name.clone()),
                    path: state,
                });
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

fn list(state_dir: &Path, address: Option<&str>) -> ExitCode {
    println!(
        "{:<40} {:<7} {:<10} {:<8} {:<10} {:<15} CONTAINERD",
        "NAMESPACE/ID", "ACTIVE", "PROTECTED", "PARKED", "FAILOVERS", "LAST PROMOTION"
    );
    for f in pairs(state_dir, address) {
        match read(&f.path) {
            Ok(s) => println!(
                "{:<40} {:<7} {:<10} {:<8} {:<10} {:<15} {}",
                format!("{}/{}", f.namespace, f.id),
                or_dash(s.pair.active),
                s.pair.protected,
                format!("{}/{}", s.pair.shadows_parked, s.pair.shadows),
                s.pair.failovers,
                last_total_ms(&s),
                f.containerd
            ),
            Err(e) => eprintln!("shadowctl: {e}"),
        }
    }
    ExitCode::SUCCESS
}

fn show(
    state_dir: &Path,
    address: Option<&str>,
    id: &str,
    namespace: Option<&str>,
    json: bool,
) -> ExitCode {
    let found: Vec<_> = pairs(state_dir, address)
        .into_iter()
        .filter(|f| f.id == id && namespace.is_none_or(|n| n == f.namespace))
        .collect();
    let (ns, containerd, path) = match found.as_slice() {
        [one] => (
            one.namespace.clone(),
            one.containerd.clone(),
            one.path.clone(),
        ),
        [] => {
            eprintln!(
                "shadowctl: no pair {id}{}{} under {}",
                namespace
                    .map(|n| format!(" in namespace {n}"))
                    .unwrap_or_default(),
                address
                    .map(|a| format!(" of containerd {a}"))
                    .unwrap_or_default(),
                state_dir.display()
            );
            return ExitCode::from(1);
        }
        many => {
            let names: Vec<_> = many
                .iter()
                .map(|f| format!("{}/{id} of containerd {}", f.namespace, f.containerd))
                .collect();
            eprintln!(
                "shadowctl: there are several pairs {id}: {}; name one with --namespace or --address",
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
        "  task pid {}  active slot {}  protected {}  shadows parked {} of {}  failovers {}  cold restarts {}  oom kills {}  hangs {}",
        s.pid,
        or_dash(s.pair.active),
        s.pair.protected,
        s.pair.shadows_parked,
        s.pair.shadows,
        s.pair.failovers,
        s.pair.cold_restarts,
        s.pair.oom_kills,
        s.pair.hangs.total()
    );
    if s.pair.hangs.total() > 0 {
        let by: Vec<String> = HangCause::ALL
            .iter()
            .filter(|c| s.pair.hangs.of(**c) > 0)
            .map(|c| format!("{} {}", c.as_str(), s.pair.hangs.of(*c)))
            .collect();
        println!("  hung engines ended: {}", by.join(", "));
    }
    for slot in &s.pair.slots {
        println!(
            "  slot {}: {:<9} pid {:<8} generation {:<5} notify {} last exit {}{}",
            slot.id,
            slot.state.as_str(),
            or_dash(slot.pid),
            slot.generation,
            slot.speaks_notify,
            or_dash(slot.last_exit),
            slot.last_hang
                .map(|c| format!(" (hung: {c})"))
                .unwrap_or_default()
                + if slot.watchdog_armed {
                    "  watchdog armed"
                } else {
                    ""
                }
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
    if let Some(h) = s.promotions.last().and_then(|r| r.promotion.hang) {
        // The hang's own steps: detected → killed (→ lock → ready above).
        let killed = h
            .killed_at
            .map(|k| {
                format!(
                    "{:.3} ms",
                    k.saturating_sub(h.detected_at).as_secs_f64() * 1e3
                )
            })
            .unwrap_or_else(|| "-".into());
        println!(
            "  that failover followed a hang ({}): detected → killed {killed}",
            h.cause
        );
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
    if s.pair.kv_drops > 0 {
        println!(
            "  KV pool dropped {} time(s), with the GMS state of a cold restart (the last one's cause below)",
            s.pair.kv_drops
        );
    }
    if let Some(c) = &s.pair.last_cold_restart {
        match c {
            ColdRestartCause::GmsDied { device } => {
                println!("  last cold restart: the GMS daemon of {device} died")
            }
            ColdRestartCause::Xid { xid } => println!("  last cold restart: XID {xid}"),
            ColdRestartCause::WeightsCorrupt { slot } => println!(
                "  last cold restart: the engine of slot {slot} found the weights changed ({} in all)",
                s.pair.weights_corrupt
            ),
        }
    }
    if let Some(status) = s.exit_status {
        println!("  exited with status {status}");
    }
    println!("  containerd {containerd}");
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
        Command::List => list(&cli.state_dir, cli.address.as_deref()),
        Command::Show {
            id,
            namespace,
            json,
        } => show(
            &cli.state_dir,
            cli.address.as_deref(),
            &id,
            namespace.as_deref(),
            json,
        ),
    }
}
