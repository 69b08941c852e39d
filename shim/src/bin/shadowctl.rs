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

use serde_json::Value;

const DEFAULT_STATE_DIR: &str = "/run/shadow";

fn usage() -> ExitCode {
    eprintln!(
        "usage: shadowctl list [--state-dir D]\n       shadowctl show <id> [--namespace N] [--state-dir D] [--json]"
    );
    ExitCode::from(2)
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
            // Phases from the first sign of the death, in wall-clock µs.
            let death = p["death_unix_us"].as_u64();
            let phase = |k: &str| match (death, p[k].as_u64()) {
                (Some(d), Some(t)) => format!("{:.3} ms", t.saturating_sub(d) as f64 / 1e3),
                _ => "-".into(),
            };
            println!(
                "  last failover #{}: slot {} -> {} ({}, {}): death seen by {}; death → reap {}, → lock {}, → ready {}; total {}",
                str_of(&p["number"]),
                str_of(&p["from"]),
                str_of(&p["to"]),
                str_of(&p["exit"]),
                str_of(&p["class"]),
                str_of(&p["death_seen"]),
                phase("reaped_unix_us"),
                phase("lock_unix_us"),
                phase("ready_unix_us"),
                last_total_ms(&v)
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
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut state_dir = PathBuf::from(DEFAULT_STATE_DIR);
    let mut namespace = None;
    let mut json = false;
    let mut positional = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--state-dir" => match it.next() {
                Some(d) => state_dir = PathBuf::from(d),
                None => return usage(),
            },
            "--namespace" | "-n" => match it.next() {
                Some(n) => namespace = Some(n.clone()),
                None => return usage(),
            },
            "--json" => json = true,
            "-h" | "--help" => return usage(),
            _ => positional.push(a.clone()),
        }
    }
    match positional
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .as_slice()
    {
        ["list"] => list(&state_dir),
        ["show", id] => show(&state_dir, id, namespace.as_deref(), json),
        _ => usage(),
    }
}
