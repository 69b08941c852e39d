//! gmsd for stacks without the shim: the shim starts and supervises one
//! gmsd per pair, but under podman or CRI-O nobody does, so this starts one
//! per pair name, in its pair's socket directory — in the foreground for a
//! systemd unit (`gms run`, exec'd so systemd supervises gmsd itself), or
//! detached with a pid file for scripts and tests (`gms start` / `gms stop`).

//!
//! Launching is `gmsd_launch` (gms/launch), the launcher the shim uses too:
//! readiness comes through a pipe (gmsd's `ready <socket>` line), an early
//! death is reported with its exit status, and capabilities are dropped.

use crate::admission::Admission;
use crate::error::{Error, Result};
use crate::layout::PairLayout;
use gmsd_launch::{GmsdCommand, Reaper};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// How a gmsd is launched.
#[derive(Debug, Clone)]
pub struct GmsdLaunch {
    pub gmsd: PathBuf,
    pub device: String,
    pub extra: Vec<String>,
    /// Who may join the pair; recorded before gmsd starts.
    pub admission: Admission,
}

impl GmsdLaunch {
    fn command(&self, layout: &PairLayout) -> GmsdCommand {
        GmsdCommand::new(&self.gmsd, layout.gms_dir(), &self.device)
            .args(&self.extra)
            .reaper(Reaper::Launcher)
    }
}

/// `gmsd` next to this binary if it is there (an install or a cargo target
/// dir), else the one on PATH.
pub fn default_gmsd() -> PathBuf {
    std::env::current_exe()
        .ok()
        .map(|p| p.with_file_name("gmsd"))
        .filter(|p| p.is_file())
        .unwrap_or_else(|| PathBuf::from("gmsd"))
}

/// Replaces this process with gmsd (for `ExecStart=` of a systemd unit,
/// which then supervises gmsd itself and reads readiness its own way).
pub fn run(layout: &PairLayout, launch: &GmsdLaunch) -> Result<()> {
    layout.prepare()?;
    launch.admission.save(layout)?;
    let e = launch.command(layout).command().exec();
    Err(Error::io("executing gmsd", &launch.gmsd, e))
}

/// Starts gmsd detached (own session, log file, pid file) and returns its
/// pid once it announced its socket.
pub fn start(layout: &PairLayout, launch: &GmsdLaunch, wait: Duration) -> Result<u32> {
    let gmsd_err = |why: String| Error::Gmsd {
        pair: layout.name.clone(),
        why,
    };
    if let Some(pid) = running_pid(layout) {
        return Err(gmsd_err(format!("already running as pid {pid}")));
    }
    layout.prepare()?;
    launch.admission.save(layout)?;
    let log_path = layout.gmsd_log();
    let log = std::fs::File::create(&log_path).map_err(|e| Error::io("creating", &log_path, e))?;
    let gmsd = launch
        .command(layout)
        .stderr(log)
        .spawn(wait)
        .map_err(|e| {
            let log = std::fs::read_to_string(&log_path).unwrap_or_default();
            gmsd_err(format!("{e}; log {}: {}", log_path.display(), log.trim()))
        })?;
    let pid_file = layout.gmsd_pid_file();
    if let Err(e) = std::fs::write(&pid_file, format!("{}\n", gmsd.pid())) {
        // Without its pid file nobody could stop it: do not leave it.
        let _ = gmsd.signal(libc::SIGKILL);
        gmsd.wait(Duration::from_secs(1));
        return Err(Error::io("writing pid file", &pid_file, e));
    }
    // The daemon outlives this process: nobody here will reap it.
    Ok(gmsd.detach())
}

/// The pid in the pid file, if that process is alive and is a gmsd (a
/// stale file after a reboot must not make us signal a stranger).
pub fn running_pid(layout: &PairLayout) -> Option<u32> {
    let text = std::fs::read_to_string(layout.gmsd_pid_file()).ok()?;
    let pid: u32 = text.trim().parse().ok()?;
    alive_gmsd(pid).then_some(pid)
}

fn alive_gmsd(pid: u32) -> bool {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let argv0 = cmdline.split(|b| *b == 0).next().unwrap_or_default();
    !exited(pid) && argv0.ends_with(b"gmsd")
}

/// Gone or a zombie. (An exiting process loses its cmdline before it turns
/// zombie, so only the state field tells when it is really done.)
fn exited(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return true;
    };
    // "pid (comm) S …": comm may hold spaces and parentheses, so split at the last ')'.
    let state = stat
        .rsplit_once(')')
        .and_then(|(_, r)| r.split_whitespace().next());
    matches!(state, Some("Z" | "X") | None)
}

/// Stops the pair's gmsd (SIGTERM, then waits) and removes the pair's host
/// directory unless an engine still holds the lock. Returns whether a gmsd
/// was running.
pub fn stop(layout: &PairLayout, wait: Duration) -> Result<bool> {
    let was = running_pid(layout);
    if let Some(pid) = was {
        let target = nix::unistd::Pid::from_raw(pid as i32);
        nix::sys::signal::kill(target, nix::sys::signal::Signal::SIGTERM).map_err(|e| {
            Error::Gmsd {
                pair: layout.name.clone(),
                why: format!("SIGTERM to pid {pid}: {e}"),
            }
        })?;
        let deadline = Instant::now() + wait;
        while !exited(pid) {
            if Instant::now() >= deadline {
                return Err(Error::Gmsd {
                    pair: layout.name.clone(),
                    why: format!("pid {pid} still alive {wait:?} after SIGTERM"),
                });
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    release(layout)?;
    Ok(was.is_some())
}

/// Removes the pair's host directory when nothing uses it: no engine holds
/// the lock and no gmsd runs. Used by `gms stop` and the poststop hook.
pub fn release(layout: &PairLayout) -> Result<bool> {
    if !layout.dir.exists() || layout.lock_held() || running_pid(layout).is_some() {
        return Ok(false);
    }
    std::fs::remove_dir_all(&layout.dir)
        .map_err(|e| Error::io("removing pair directory", &layout.dir, e))?;
    Ok(true)
}
