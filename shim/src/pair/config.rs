//! The `[pair]` table of the shim config file: where a pair keeps its files,
//! how GMS is run, and the restart rules handed to `shadow_pair`. Every key
//! has a default, so a host with no config file runs pairs too.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use shadow_pair::RestartPolicy;

/// Which GMS backend a pair gets when its spec does not say.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GmsMode {
    /// `cuda` when the spec has NVIDIA GPUs, else `host`.
    Auto,
    Host,
    Off,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PairConfig {
    /// Per-pair directories: `<state_dir>/<key>/<namespace>/<id>/`, `<key>`
    /// the containerd's (`shadow_contract::host::containerd_key`).
    pub state_dir: PathBuf,
    /// Prometheus textfiles: `<metrics_dir>/shadow-<key>-<namespace>-<id>.prom`.
    pub metrics_dir: PathBuf,
    /// The `gmsd` binary; empty: next to the shim binary, else on PATH.
    pub gmsd: String,
    pub gms: GmsMode,
    /// `gmsd --max-bytes` (0: the pod's memory limit for a host-memory
    /// gmsd, else gmsd's own default).
    pub gms_max_bytes: u64,
    /// `gmsd --max-allocations` (0: gmsd's own default).
    pub gms_max_allocations: u64,
    /// `gmsd --kv-chunk`: bytes per allocation of the pair's KV pool, the
    /// part a promoted engine maps before its first step (0: gmsd's own
    /// default, 2 GiB).
    pub gms_kv_chunk: u64,
    /// How long a fresh gmsd may take to create its socket.
    pub gms_start_timeout_ms: u64,
    /// The NVIDIA driver's per-GPU directory: maps the minor of each
    /// `/dev/nvidiaN` the spec grants to the GPU's UUID and PCI bus.
    pub nvidia_gpus_dir: PathBuf,
    /// For tests on machines without GPUs: each GPU's gmsd keeps its memory
    /// in host memfds, under the GPU's UUID (`gmsd --device host:GPU-…`).
    pub gms_gpus_on_host: bool,
    /// After Kill's signal, how long before the engines get SIGKILL.
    pub stop_grace_ms: u64,
    /// `/proc/locks` poll period while a promotion is pending or nobody serves.
    pub lock_poll_fast_ms: u64,
    /// `/proc/locks` poll period while an engine serves.
    pub lock_poll_idle_ms: u64,
    /// Promotion timelines kept in `state.json`.
    pub promotions_kept: usize,
    pub restart: RestartPolicy,
    /// Pair containers that carry no `shadow.dev/pair` annotation too (not
    /// the CRI sandbox; `shadow.dev/pair=false` opts out): for a runtime
    /// entry or a node dedicated to engines, and for orchestrators that
    /// cannot set annotations (Nomad's containerd driver).
    pub pair_by_default: bool,
    /// Listening sockets every pair owns when its spec has no
    /// `shadow.dev/listen` (same syntax, e.g. `"tcp:0.0.0.0:8000"`); empty:
    /// none, engines bind their own ports.
    pub listen: String,
    /// The watchdog interval every pair's engines get as `WATCHDOG_USEC`
    /// when its spec has no `shadow.dev/watchdog` (same syntax, e.g.
    /// `"2s"`); empty: none. An engine is watched once it pings.
    pub watchdog: String,
    /// Shadows every pair keeps parked when its spec has no
    /// `shadow.dev/shadows`: 1 to `shadow_contract::annotations::MAX_SHADOWS`.
    pub shadows: u8,
    /// The fd store's bound for pairs whose spec has no
    /// `shadow.dev/fdstore-max`: 0 (no store) to
    /// `shadow_contract::fdstore::MAX_MAX`.
    pub fdstore_max: u32,
    /// Who accepts the connections of pairs whose spec has no
    /// `shadow.dev/accept`: `engine` (each engine, on the sockets it
    /// inherits) or `runtime` (the shim, which hands them to the serving
    /// engine: applied to the pairs with listening sockets and an fd
    /// store, the others' engines accepting). The compiled default is
    /// `engine`: an engine that does not read a hand-off socket (vLLM
    /// through shadow-vllm) keeps working under a shim with no config.
    pub accept: String,
}

impl Default for PairConfig {
    fn default() -> Self {
        PairConfig {
            state_dir: PathBuf::from("/run/shadow"),
            metrics_dir: PathBuf::from("/run/shadow/metrics"),
            gmsd: String::new(),
            pair_by_default: false,
            listen: String::new(),
            watchdog: String::new(),
            shadows: 1,
            fdstore_max: shadow_contract::fdstore::DEFAULT_MAX,
            accept: shadow_contract::handoff::Accept::Engine
                .as_str()
                .to_string(),
            gms: GmsMode::Auto,
            gms_max_bytes: 0,
            gms_max_allocations: 0,
            gms_kv_chunk: 0,
            gms_start_timeout_ms: 5000,
            nvidia_gpus_dir: PathBuf::from("/proc/driver/nvidia/gpus"),
            gms_gpus_on_host: false,
            stop_grace_ms: 10_000,
            lock_poll_fast_ms: 1,
            lock_poll_idle_ms: 200,
            promotions_kept: 20,
            restart: RestartPolicy::default(),
        }
    }
}

impl PairConfig {
    /// Checks what serde cannot; the message names the key.
    pub fn validate(&self) -> Result<(), String> {
        if !self.state_dir.is_absolute() {
            return Err(format!(
                "pair.state_dir = {:?}: must be an absolute path",
                self.state_dir
            ));
        }
        if !self.metrics_dir.is_absolute() {
            return Err(format!(
                "pair.metrics_dir = {:?}: must be an absolute path",
                self.metrics_dir
            ));
        }
        if !self.listen.is_empty() {
            shadow_contract::listen::parse(&self.listen)
                .map_err(|e| format!("pair.listen = {:?}: {}", self.listen, e.allowed))?;
        }
        if !self.watchdog.is_empty() {
            shadow_contract::hang::parse_watchdog("pair.watchdog", &self.watchdog)
                .map_err(|e| e.to_string())?;
        }
        let max = shadow_contract::annotations::MAX_SHADOWS;
        if !(1..=max).contains(&self.shadows) {
            return Err(format!(
                "pair.shadows = {}: must be 1 to {max}",
                self.shadows
            ));
        }
        if self.fdstore_max > shadow_contract::fdstore::MAX_MAX {
            return Err(format!(
                "pair.fdstore_max = {}: must be 0 (no store) to {}",
                self.fdstore_max,
                shadow_contract::fdstore::MAX_MAX
            ));
        }
        shadow_contract::handoff::parse(&self.accept)
            .map_err(|e| format!("pair.accept = {:?}: {}", self.accept, e.allowed))?;
        if self.lock_poll_fast_ms == 0 || self.lock_poll_idle_ms == 0 {
            return Err("pair.lock_poll_fast_ms and pair.lock_poll_idle_ms must be ≥ 1".into());
        }
        if self.restart.backoff_initial > self.restart.backoff_max {
            return Err(format!(
                "pair.restart.backoff_initial ({} ms) is above backoff_max ({} ms)",
                self.restart.backoff_initial.as_millis(),
                self.restart.backoff_max.as_millis()
            ));
        }
        Ok(())
    }

    /// The configured `pair.watchdog` (validated at load).
    pub fn watchdog(&self) -> Option<Duration> {
        shadow_contract::hang::parse_watchdog("pair.watchdog", &self.watchdog).ok()
    }

    pub fn stop_grace(&self) -> Duration {
        Duration::from_millis(self.stop_grace_ms)
    }

    pub fn gms_start_timeout(&self) -> Duration {
        Duration::from_millis(self.gms_start_timeout_ms)
    }

    /// The gmsd to run: the configured one, else `gmsd` next to this binary,
    /// else `gmsd` on PATH.
    pub fn gmsd_binary(&self) -> PathBuf {
        if !self.gmsd.is_empty() {
            return PathBuf::from(&self.gmsd);
        }
        std::env::current_exe()
            .ok()
            .and_then(|exe| exe.canonicalize().ok())
            .and_then(|exe| exe.parent().map(|d| d.join("gmsd")))
            .filter(|p| p.is_file())
            .unwrap_or_else(|| PathBuf::from("gmsd"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use std::path::Path;

    #[test]
    fn pair_table_parses_with_defaults_and_rejects_unknown_keys() {
        let c = Config::parse(
            "[pair]\nstate_dir = \"/tmp/x\"\ngms = \"off\"\n[pair.restart]\nmax_consecutive_failures = 2\nbackoff_initial = 50\n",
            Path::new("t.toml"),
        )
        .unwrap();
        assert_eq!(c.pair.state_dir, PathBuf::from("/tmp/x"));
        assert_eq!(c.pair.gms, GmsMode::Off);
        assert_eq!(c.pair.restart.max_consecutive_failures, 2);
        assert_eq!(c.pair.restart.backoff_initial, Duration::from_millis(50));
        assert_eq!(c.pair.lock_poll_idle_ms, 200);
        let e = Config::parse("[pair]\nstate_dirr = \"/x\"\n", Path::new("t.toml"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("t.toml") && e.contains("state_dirr"), "{e}");
    }

    #[test]
    fn the_watchdog_key_reads_as_the_annotation_does() {
        let c = Config::parse("[pair]\nwatchdog = \"2s\"\n", Path::new("t.toml")).unwrap();
        assert_eq!(c.pair.watchdog(), Some(Duration::from_secs(2)));
        assert_eq!(PairConfig::default().watchdog(), None);
        for bad in ["2", "10ms", "1.5s", "25h"] {
            let e = Config::parse(
                &format!("[pair]\nwatchdog = \"{bad}\"\n"),
                Path::new("t.toml"),
            )
            .unwrap_err()
            .to_string();
            assert!(
                e.contains("pair.watchdog") && e.contains("50ms"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn relative_dirs_and_inverted_backoff_are_refused_by_key() {
        let e = Config::parse("[pair]\nstate_dir = \"run\"\n", Path::new("t.toml"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("pair.state_dir"), "{e}");
        let e = Config::parse(
            "[pair.restart]\nbackoff_initial = 500\nbackoff_max = 100\n",
            Path::new("t.toml"),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("backoff_initial"), "{e}");
        let e = Config::parse("[pair]\nlisten = \"sctp:1\"\n", Path::new("t.toml"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("pair.listen") && e.contains("sctp"), "{e}");
        let c = Config::parse(
            "[pair]\nlisten = \"tcp:0.0.0.0:8000\"\n",
            Path::new("t.toml"),
        );
        assert_eq!(c.unwrap().pair.listen, "tcp:0.0.0.0:8000");
        for bad in ["0", "4"] {
            let e = Config::parse(&format!("[pair]\nshadows = {bad}\n"), Path::new("t.toml"))
                .unwrap_err()
                .to_string();
            assert!(e.contains("pair.shadows") && e.contains("1 to 3"), "{e}");
        }
        let c = Config::parse("[pair]\nshadows = 2\n", Path::new("t.toml")).unwrap();
        assert_eq!(c.pair.shadows, 2);
        let e = Config::parse("[pair]\nfdstore_max = 16385\n", Path::new("t.toml"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("pair.fdstore_max") && e.contains("16384"), "{e}");
        let c = Config::parse("[pair]\nfdstore_max = 0\n", Path::new("t.toml")).unwrap();
        assert_eq!(c.pair.fdstore_max, 0);
        let e = Config::parse("[pair]\naccept = \"kernel\"\n", Path::new("t.toml"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("pair.accept") && e.contains("engine|runtime"),
            "{e}"
        );
        let c = Config::parse("[pair]\naccept = \"runtime\"\n", Path::new("t.toml")).unwrap();
        assert_eq!(c.pair.accept, "runtime");
    }
}
