//! The pair's GMS daemons: one `gmsd` per device (each GPU the spec's devices
//! grant, or one `host` daemon), started before the engines in the
//! pair-private socket directory, with every capability dropped, supervised
//! like an engine (a reaped exit is `Event::GmsDied` naming that device),
//! and all replaced by fresh ones (empty state) when the pair restarts cold:
//! one GPU's weights lost means the whole group reloads.
//!
//! Launching is `gmsd_launch` (gms/launch), shared with the OCI hook: gmsd
//! announces readiness on a pipe, and the launcher runs on a blocking
//! thread with `Reaper::Elsewhere`, because this shim is a subreaper whose
//! exit router alone reaps: an early death is read without reaping, and
//! the router still delivers every exit.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gmsd_launch::{Gmsd, GmsdCommand, Reaper};
use shadow_pair::metrics::GmsFigures;
use tokio::task::JoinHandle;

use super::input::{Input, Inputs};
use crate::error::{Error, Result};
use crate::exits::ExitRouter;

/// How long a stopping gmsd gets after SIGTERM before SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(3);
/// How often the status (bytes, leases) is refreshed for metrics.
const STATUS_PERIOD: Duration = Duration::from_secs(1);
/// How long one status call may take (connect, send, each receive): a
/// daemon that does not answer costs the poller this, never a thread.
const STATUS_TIMEOUT: Duration = Duration::from_secs(2);

pub struct GmsDaemon {
    binary: PathBuf,
    dir: PathBuf,
    /// gmsd's `--device`: `host`, a GPU UUID (`GPU-…`), or `host:GPU-…`.
    device: String,
    /// What reports name it by: `host` or the GPU's UUID.
    name: String,
    max_bytes: u64,
    max_allocations: u64,
    kv_chunk: u64,
    start_timeout: Duration,
    /// The pair's gmsd cgroup (`cgroup.procs` files), joined before exec.
    cgroup: Vec<PathBuf>,
    oom_score_adj: i32,
    /// The pair's election lock: gmsd grants the KV pool's write lease to
    /// its holder only.
    lock: Option<PathBuf>,
    /// The running daemon, once it announced its socket.
    daemon: Option<Gmsd>,
    generation: u64,
    status: Arc<Mutex<Option<gms::status::StatusReport>>>,
    poller: Option<JoinHandle<()>>,
}

impl GmsDaemon {
    pub fn new(config: &super::config::PairConfig, dir: &Path, device: String) -> GmsDaemon {
        let name = device.strip_prefix("host:").unwrap_or(&device).to_string();
        GmsDaemon {
            binary: config.gmsd_binary(),
            dir: dir.to_path_buf(),
            name,
            device,
            max_bytes: config.gms_max_bytes,
            max_allocations: config.gms_max_allocations,
            kv_chunk: config.gms_kv_chunk,
            start_timeout: config.gms_start_timeout(),
            cgroup: Vec::new(),
            oom_score_adj: 0,
            lock: None,
            daemon: None,
            generation: 0,
            status: Arc::new(Mutex::new(None)),
            poller: None,
        }
    }

    /// Run in the pair's cgroup (its gmsd leaf), with the pod's OOM score,
    /// and, when the config leaves `gms_max_bytes` at 0, at most
    /// `default_max_bytes` (the pod's memory limit; 0: gmsd's default).
    pub fn in_pod(
        mut self,
        cgroup: Vec<PathBuf>,
        oom_score_adj: i32,
        default_max_bytes: u64,
        lock: Option<PathBuf>,
    ) -> Self {
        self.cgroup = cgroup;
        self.oom_score_adj = oom_score_adj;
        self.lock = lock;
        if self.max_bytes == 0 {
            self.max_bytes = default_max_bytes;
        }
        self
    }

    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// `host` or the GPU's UUID.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The socket of the running daemon (its path stays the same across
    /// restarts: the device's socket name in the pair's GMS directory).
    pub fn socket(&self) -> Option<&Path> {
        self.daemon.as_ref().map(Gmsd::socket)
    }

    fn pid(&self) -> u32 {
        self.daemon.as_ref().map_or(0, Gmsd::pid)
    }

    /// Start gmsd and wait (bounded) until it announces its socket.
    pub async fn start(&mut self) -> Result<()> {
        std::fs::create_dir_all(&self.dir)
            .map_err(|e| Error::io(format!("creating GMS dir {}", self.dir.display()), e))?;
        let command = GmsdCommand::new(&self.binary, &self.dir, &self.device)
            .max_bytes(self.max_bytes)
            .max_allocations(self.max_allocations)
            .kv_chunk(self.kv_chunk)
            .cgroup(self.cgroup.clone())
            .oom_score_adj(self.oom_score_adj)
            .lock(self.lock.as_deref())
            .reaper(Reaper::Elsewhere);
        let timeout = self.start_timeout;
        let launched = tokio::task::spawn_blocking(move || command.spawn(timeout))
            .await
            .map_err(|e| Error::FailedPrecondition(format!("gmsd launcher thread: {e}")))?;
        self.generation += 1;
        let daemon = launched.map_err(|e| {
            Error::FailedPrecondition(format!(
                "{e} (config pair.gmsd, pair.gms_start_timeout_ms; gmsd's log is in the shim log)"
            ))
        })?;
        log::info!(
            "gmsd pid {} serves device {} at {}",
            daemon.pid(),
            self.device,
            daemon.socket().display()
        );
        self.daemon = Some(daemon);
        self.start_poller();
        Ok(())
    }

    fn start_poller(&mut self) {
        if let Some(p) = self.poller.take() {
            p.abort();
        }
        let Some(socket) = self.daemon.as_ref().map(|d| d.socket().to_path_buf()) else {
            return;
        };
        let status = self.status.clone();
        self.poller = Some(tokio::spawn(async move {
            loop {
                let s = socket.clone();
                let report = tokio::task::spawn_blocking(move || {
                    gms::client::status_within(&s, STATUS_TIMEOUT).ok()
                })
                .await
                .ok()
                .flatten();
                *status.lock().unwrap_or_else(|p| p.into_inner()) = report;
                tokio::time::sleep(STATUS_PERIOD).await;
            }
        }));
    }

    /// Report this daemon's death to the supervisor; `index` is its place
    /// in the pair's [`GmsDaemons`].
    pub fn watch(&self, index: usize, router: Arc<ExitRouter>, tx: Inputs) {
        let generation = self.generation;
        let exit = router.watch(self.pid() as i32);
        tokio::spawn(async move {
            if exit.await.is_ok() {
                let _ = tx.send(Input::GmsDied { index, generation }).await;
            }
        });
    }

    /// SIGTERM, then SIGKILL after a bound; removes its socket. The exit
    /// itself is the router's to reap.
    pub async fn terminate(&mut self) {
        if let Some(p) = self.poller.take() {
            p.abort();
        }
        *self.status.lock().unwrap_or_else(|p| p.into_inner()) = None;
        let Some(daemon) = self.daemon.take() else {
            return;
        };
        let _ = daemon.signal(libc::SIGTERM);
        let deadline = Instant::now() + STOP_GRACE;
        while !daemon.has_exited() {
            if Instant::now() >= deadline {
                let _ = daemon.signal(libc::SIGKILL);
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let _ = std::fs::remove_file(daemon.socket());
    }

    pub fn cached_status(&self) -> Option<serde_json::Value> {
        let s = self.status.lock().unwrap_or_else(|p| p.into_inner());
        s.as_ref().and_then(|r| serde_json::to_value(r).ok())
    }

    pub fn figures(&self) -> Option<GmsFigures> {
        let s = self.status.lock().unwrap_or_else(|p| p.into_inner());
        s.as_ref().map(|r| GmsFigures {
            device: r.device.clone(),
            bytes: r.bytes,
            allocations: r.allocations as u64,
            leases: r.leases.len() as u64,
            committed: r.committed.is_some(),
        })
    }
}

/// Where a pair's daemons run: the pod's cgroup (the `cgroup.procs` files
/// of the pair's gmsd leaf), its OOM score, and the most memory a daemon
/// may hold when the config leaves `gms_max_bytes` at 0 (0: gmsd's own
/// default).
#[derive(Debug, Clone, Default)]
pub struct InPod {
    pub cgroup: Vec<PathBuf>,
    pub oom_score_adj: i32,
    pub max_bytes: u64,
    /// The pair's election lock file (host path).
    pub lock: Option<PathBuf>,
}

/// Every GMS daemon of a pair, in the order of the spec's devices.
pub struct GmsDaemons {
    daemons: Vec<GmsDaemon>,
}

impl GmsDaemons {
    /// Starts one daemon per device (gmsd `--device` values); on any
    /// failure those already started are stopped again.
    pub async fn start(
        config: &super::config::PairConfig,
        dir: &Path,
        devices: Vec<String>,
        pod: &InPod,
    ) -> Result<GmsDaemons> {
        let mut set = GmsDaemons {
            daemons: Vec::new(),
        };
        for device in devices {
            let mut g = GmsDaemon::new(config, dir, device).in_pod(
                pod.cgroup.clone(),
                pod.oom_score_adj,
                pod.max_bytes,
                pod.lock.clone(),
            );
            let started = g.start().await;
            set.daemons.push(g);
            if let Err(e) = started {
                set.terminate().await;
                return Err(e);
            }
        }
        Ok(set)
    }

    /// The daemons' sockets, in device order (each bound alone into the
    /// engines; the paths stay the same across cold restarts).
    pub fn sockets(&self) -> Vec<PathBuf> {
        self.daemons
            .iter()
            .filter_map(|g| g.socket().map(Path::to_path_buf))
            .collect()
    }

    pub fn daemon(&self, index: usize) -> Option<&GmsDaemon> {
        self.daemons.get(index)
    }

    pub fn watch(&self, router: &Arc<ExitRouter>, tx: &Inputs) {
        for (i, g) in self.daemons.iter().enumerate() {
            g.watch(i, router.clone(), tx.clone());
        }
    }

    pub async fn terminate(&mut self) {
        for g in &mut self.daemons {
            g.terminate().await;
        }
    }

    /// Fresh daemons with empty state (cold restart): every GPU's, since the
    /// whole group reloads its weights.
    pub async fn restart(&mut self) -> Result<()> {
        self.terminate().await;
        for g in &mut self.daemons {
            g.start().await?;
        }
        Ok(())
    }

    /// Each daemon's last report, in device order (those that answered).
    pub fn cached_statuses(&self) -> Vec<serde_json::Value> {
        self.daemons
            .iter()
            .filter_map(GmsDaemon::cached_status)
            .collect()
    }

    pub fn figures(&self) -> Vec<GmsFigures> {
        self.daemons.iter().filter_map(GmsDaemon::figures).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_missing_gmsd_is_a_precondition_naming_binary_and_key() {
        let dir = tempfile::tempdir().unwrap();
        let config = super::super::config::PairConfig {
            gmsd: "/nonexistent/gmsd".into(),
            ..Default::default()
        };
        let mut daemon = GmsDaemon::new(&config, &dir.path().join("gms"), "host".into());
        let e = daemon.start().await.unwrap_err();
        // Not NOT_FOUND: that would tell containerd the container is missing.
        assert_eq!(
            e.code(),
            containerd_shim_protos::ttrpc::Code::FAILED_PRECONDITION,
            "{e}"
        );
        let msg = e.to_string();
        assert!(
            msg.contains("/nonexistent/gmsd") && msg.contains("pair.gmsd"),
            "{msg}"
        );
    }
}
