//! The pair's GMS daemon: one `gmsd` per device, started before the engines
//! in the pair-private socket directory, with every capability dropped,
//! supervised like an engine (its reaped exit is `Event::GmsDied`), and
//! replaced by a fresh one (empty state) when the pair restarts cold.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use nix::unistd::Pid;
use shadow_pair::metrics::GmsFigures;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::supervisor::Input;
use crate::error::{Error, Result};
use crate::exits::ExitRouter;

/// How long a stopping gmsd gets after SIGTERM before SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(3);
/// How often the status (bytes, leases) is refreshed for metrics.
const STATUS_PERIOD: Duration = Duration::from_secs(1);

pub struct GmsDaemon {
    binary: PathBuf,
    dir: PathBuf,
    /// `host`, or the CUDA device (`0`, `cuda:0`, `GPU-…`).
    device: String,
    max_bytes: u64,
    max_allocations: u64,
    start_timeout: Duration,
    pid: u32,
    generation: u64,
    status: Arc<Mutex<Option<gms::status::StatusReport>>>,
    poller: Option<JoinHandle<()>>,
}

/// Drop every capability in the child between fork and exec. Raw syscalls
/// only (no allocation after fork): the bounding set first (needs
/// CAP_SETPCAP, which we still have), then ambient, then the three sets.
fn drop_all_capabilities() -> std::io::Result<()> {
    for cap in 0..64 {
        // SAFETY: prctl with integer arguments only; EINVAL past the last
        // capability the kernel knows is expected and ignored.
        unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) };
    }
    // SAFETY: integer arguments only.
    unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL,
            0,
            0,
            0,
        )
    };
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    let header = Header {
        version: 0x2008_0522, // _LINUX_CAPABILITY_VERSION_3
        pid: 0,
    };
    let data = [Data {
        effective: 0,
        permitted: 0,
        inheritable: 0,
    }; 2];
    // SAFETY: capset reads one header and two data structs (version 3),
    // both valid for the duration of the call.
    let rc = unsafe { libc::syscall(libc::SYS_capset, &header as *const Header, data.as_ptr()) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

impl GmsDaemon {
    pub fn new(config: &super::config::PairConfig, dir: &Path, device: String) -> GmsDaemon {
        GmsDaemon {
            binary: config.gmsd_binary(),
            dir: dir.to_path_buf(),
            device,
            max_bytes: config.gms_max_bytes,
            max_allocations: config.gms_max_allocations,
            start_timeout: config.gms_start_timeout(),
            pid: 0,
            generation: 0,
            status: Arc::new(Mutex::new(None)),
            poller: None,
        }
    }

    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The socket engines connect to, once gmsd made it.
    fn socket(&self) -> Option<PathBuf> {
        let entries = std::fs::read_dir(&self.dir).ok()?;
        entries.filter_map(|e| e.ok().map(|e| e.path())).find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("gms-") && n.ends_with(".sock"))
        })
    }

    /// Start gmsd and wait (bounded) until its socket exists.
    pub async fn start(&mut self) -> Result<()> {
        std::fs::create_dir_all(&self.dir)
            .map_err(|e| Error::io(format!("creating GMS dir {}", self.dir.display()), e))?;
        let mut cmd = std::process::Command::new(&self.binary);
        cmd.arg("serve")
            .arg("--socket-dir")
            .arg(&self.dir)
            .arg("--device")
            .arg(&self.device)
            .stdin(std::process::Stdio::null());
        if self.max_bytes > 0 {
            cmd.arg("--max-bytes").arg(self.max_bytes.to_string());
        }
        if self.max_allocations > 0 {
            cmd.arg("--max-allocations")
                .arg(self.max_allocations.to_string());
        }
        // SAFETY: the closure runs between fork and exec and calls only
        // setsid, prctl and capset (no allocation, no locks).
        unsafe {
            cmd.pre_exec(|| {
                nix::unistd::setsid().map_err(std::io::Error::from)?;
                drop_all_capabilities()
            });
        }
        // Spawned through std: the shim's reaper, not tokio, collects it.
        let child = cmd.spawn().map_err(|e| {
            Error::io(
                format!("starting gmsd {} (config pair.gmsd)", self.binary.display()),
                e,
            )
        })?;
        self.pid = child.id();
        self.generation += 1;
        drop(child);
        let deadline = Instant::now() + self.start_timeout;
        loop {
            if self.socket().is_some() {
                break;
            }
            if nix::sys::signal::kill(Pid::from_raw(self.pid as i32), None).is_err()
                || Instant::now() >= deadline
            {
                self.terminate().await;
                return Err(Error::FailedPrecondition(format!(
                    "gmsd {} (pid {}) made no socket in {} within {} ms (config pair.gms_start_timeout_ms); see the shim log",
                    self.binary.display(),
                    self.pid,
                    self.dir.display(),
                    self.start_timeout.as_millis()
                )));
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        log::info!(
            "gmsd pid {} serves device {} in {}",
            self.pid,
            self.device,
            self.dir.display()
        );
        self.start_poller();
        Ok(())
    }

    fn start_poller(&mut self) {
        if let Some(p) = self.poller.take() {
            p.abort();
        }
        let Some(socket) = self.socket() else {
            return;
        };
        let status = self.status.clone();
        self.poller = Some(tokio::spawn(async move {
            loop {
                let s = socket.clone();
                let report = tokio::task::spawn_blocking(move || gms::client::status(&s).ok())
                    .await
                    .ok()
                    .flatten();
                *status.lock().unwrap_or_else(|p| p.into_inner()) = report;
                tokio::time::sleep(STATUS_PERIOD).await;
            }
        }));
    }

    /// Report this daemon's death to the supervisor.
    pub fn watch(&self, router: Arc<ExitRouter>, tx: mpsc::UnboundedSender<Input>) {
        let generation = self.generation;
        let exit = router.watch(self.pid as i32);
        tokio::spawn(async move {
            if exit.await.is_ok() {
                let _ = tx.send(Input::GmsDied { generation });
            }
        });
    }

    /// SIGTERM, then SIGKILL after a bound; removes its sockets.
    pub async fn terminate(&mut self) {
        if let Some(p) = self.poller.take() {
            p.abort();
        }
        *self.status.lock().unwrap_or_else(|p| p.into_inner()) = None;
        if self.pid > 0 {
            let pid = Pid::from_raw(self.pid as i32);
            let _ = nix::sys::signal::kill(pid, Signal::SIGTERM);
            let deadline = Instant::now() + STOP_GRACE;
            while nix::sys::signal::kill(pid, None).is_ok() {
                if Instant::now() >= deadline {
                    let _ = nix::sys::signal::kill(pid, Signal::SIGKILL);
                    break;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            self.pid = 0;
        }
        while let Some(s) = self.socket() {
            if std::fs::remove_file(&s).is_err() {
                break;
            }
        }
    }

    /// A fresh daemon with empty state (cold restart).
    pub async fn restart(&mut self) -> Result<()> {
        self.terminate().await;
        self.start().await
    }

    pub fn cached_status(&self) -> Option<serde_json::Value> {
        let s = self.status.lock().unwrap_or_else(|p| p.into_inner());
        s.as_ref().and_then(|r| serde_json::to_value(r).ok())
    }

    pub fn figures(&self) -> Vec<GmsFigures> {
        let s = self.status.lock().unwrap_or_else(|p| p.into_inner());
        s.as_ref()
            .map(|r| {
                vec![GmsFigures {
                    device: r.device.clone(),
                    bytes: r.bytes,
                    allocations: r.allocations as u64,
                    leases: r.leases.len() as u64,
                    committed: r.committed.is_some(),
                }]
            })
            .unwrap_or_default()
    }
}
