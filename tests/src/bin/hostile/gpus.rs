//! `gpus`: a pod that names another tenant's GPU in its own environment
//! (`NVIDIA_VISIBLE_DEVICES=<victim UUID>`) and looks for that GPU's GMS
//! daemon, to allocate on it. The pair's GPUs are those its devices grant,
//! so the victim's daemon must not exist in this pair's `GMS_SOCKET_DIR`.
//!
//! Prints `attack=gpus step=socket:<name>` for every daemon socket it sees,
//! then `step=victim-absent` or `step=victim-reachable:<name>`, and parks
//! as a well-formed engine (so the pair stays up for the test to look at).

use super::common;
use shadow_contract::{env, paths};

pub fn run(_args: &[String]) -> Result<(), String> {
    let dir = std::env::var(env::GMS_SOCKET_DIR)
        .map_err(|_| format!("{} is not set", env::GMS_SOCKET_DIR))?;
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .map_err(|e| format!("reading {dir}: {e}"))?
        .flatten()
        .filter_map(|e| e.file_name().to_str().map(str::to_owned))
        .filter(|n| paths::is_gms_socket_name(n))
        .collect();
    names.sort();
    for n in &names {
        common::step("gpus", &format!("socket:{n}"));
    }
    let wanted = std::env::var("NVIDIA_VISIBLE_DEVICES").unwrap_or_default();
    let mut reached = Vec::new();
    for uuid in wanted.split(',').map(str::trim).filter(|u| !u.is_empty()) {
        let path = std::path::Path::new(&dir).join(paths::gms_socket_name(uuid));
        if std::os::unix::net::UnixStream::connect(&path).is_ok() {
            reached.push(paths::gms_socket_name(uuid));
        }
    }
    if reached.is_empty() {
        common::step("gpus", "victim-absent");
    } else {
        common::step("gpus", &format!("victim-reachable:{}", reached.join(",")));
    }
    common::park_forever(&[])
}
