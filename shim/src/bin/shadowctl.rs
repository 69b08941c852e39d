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
use serde_json::Value;

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
            let state = id.path().join("state.json");
            if state.is_file() {
                // The directory name may be a shortened id (long CRI ids):
                // state.json carries the full one.
                let full = read(&state)
                    .ok()
                    .and_then(|v| v["id"].as_str().map(str::to_string))
                    .unwrap_or_else(|| id.file_name().to_string_lossy().into_owned());
                out.push((ns.file_name().to_string_lossy().into_owned(), full, state));
            }
        }
    }
    out.sort();
    out
}

fn read(path: &Path) -> Result<Value, String> {
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
    serde_json::from_str(&text).map_err(|e| format!("parsing {}: {e}", path.display()))
}

fn str_of(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn last_total_ms(v: &Value) -> String {
    v.pointer("/promotions")
        .and_then(Value::as_array)
        .and_then(|p| p.last())
        .and_then(|p| p.get("total_ms"))
        .and_then(Value::as_f64)
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
            Ok(v) => println!(
                "{:<40} {:<7} {:<10} {:<10} {}",
                format!("{ns}/{id}"),
                str_of(&v["pair"]["active"]),
                str_of(&v["pair"]["protected"]),
                str_of(&v["pair"]["failovers"]),
                last_total_ms(&v)
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
    let v = match read(&path) {
        Ok(v) => v,
        Err(e) => {
            eprintln!("shadowctl: {e}");
            return ExitCode::from(1);
        }
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
        return ExitCode::SUCCESS;
    }
    println!("pair {ns}/{id}");
    println!(
        "  task pid {}  active slot {}  protected {}  failovers {}  cold restarts {}",
        str_of(&v["pid"]),
        str_of(&v["pair"]["active"]),
        str_of(&v["pair"]["protected"]),
        str_of(&v["pair"]["failovers"]),
        str_of(&v["pair"]["cold_restarts"])
    );
    for slot in v["pair"]["slots"].as_array().into_iter().flatten() {
        println!(
            "  slot {}: {:<9} pid {:<8} generation {:<5} notify {} last exit {}",
            str_of(&slot["id"]),
            str_of(&slot["state"]),
            str_of(&slot["pid"]),
            str_of(&slot["generation"]),
            str_of(&slot["speaks_notify"]),
            str_of(&slot["last_exit"])
        );
    }
    match v["promotions"].as_array().and_then(|p| p.last()) {
        Some(p) => {
            let phase = |k: &str| {
                p[k].as_object()
                    .and_then(|d| {
                        let secs = d.get("secs")?.as_f64()?;
                        let nanos = d.get("nanos")?.as_f64()?;
                        let reaped = p["reaped_at"].as_object()?;
                        let r =
                            reaped.get("secs")?.as_f64()? + reaped.get("nanos")?.as_f64()? / 1e9;
                        Some(format!("{:.3} ms", (secs + nanos / 1e9 - r) * 1e3))
                    })
                    .unwrap_or_else(|| "-".into())
            };
            println!(
                "  last failover #{}: slot {} -> {} ({}, {}): reaped → lock {}, reaped → ready {}",
                str_of(&p["number"]),
                str_of(&p["from"]),
                str_of(&p["to"]),
                str_of(&p["exit"]),
                str_of(&p["class"]),
                phase("lock_at"),
                phase("ready_at")
            );
        }
        None => println!("  no failover yet"),
    }
    match v.get("gms") {
        Some(g) if !g.is_null() => println!(
            "  gms: device {} state {} bytes {} allocations {} leases {}",
            str_of(&g["device"]),
            str_of(&g["state"]),
            str_of(&g["bytes"]),
            str_of(&g["allocations"]),
            g["leases"].as_array().map(Vec::len).unwrap_or(0)
        ),
        _ => println!("  gms: none"),
    }
    if !v["exit_status"].is_null() {
        println!("  exited with status {}", str_of(&v["exit_status"]));
    }
    ExitCode::SUCCESS
}

fn main() -> ExitCode {
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
