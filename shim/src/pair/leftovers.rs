//! What a pair leaves behind when its shim dies (SIGKILL, the OOM killer,
//! a crash), and its removal. Without its shim nothing supervises the
//! pair: the engines run on as runc containers, gmsd (its own session, no
//! parent-death signal) keeps the weights, and the pair directory, its
//! namespace pins, its cgroup and its metrics file stay. containerd then
//! runs `containerd-shim-shadow-v1 delete`, which comes here; so does a
//! Create that finds the directory of its id still there (a shim killed
//! before containerd could run that cleanup).
//!
//! Everything is found from what the shim is given (containerd's address,
//! namespace, id, config) and what Create recorded in the pair directory,
//! which only root can write (0711): never from a file an engine wrote.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use shadow_pair::SlotId;

use super::cgroup::PairCgroup;
use super::dirs::PairDirs;
use super::spec;
use crate::config::Config;
use crate::exits::ExitRouter;
use crate::options::RuncOptions;
use crate::runc::RuncClient;

/// How long a killed gmsd gets to be gone.
const GMSD_EXIT_WAIT: Duration = Duration::from_secs(3);

/// One pair's identity on the host.
pub struct PairName<'a> {
    pub config: &'a Config,
    /// containerd's address, as the shim was given it.
    pub containerd: &'a str,
    pub namespace: &'a str,
    pub id: &'a str,
}

impl PairName<'_> {
    fn key(&self) -> String {
        shadow_contract::host::containerd_key(self.containerd)
    }

    /// The pair's directories that exist.
    pub fn existing_dirs(&self) -> Vec<PairDirs> {
        PairDirs::candidates(
            &self.config.pair.state_dir,
            &self.key(),
            self.namespace,
            self.id,
        )
        .into_iter()
        .filter(|d| d.root.exists())
        .collect()
    }

    /// `<metrics_dir>/shadow-<key>-<namespace>-<id>.prom`.
    pub fn metrics_file(&self) -> PathBuf {
        self.config
            .pair
            .metrics_dir
            .join(shadow_contract::host::metrics_file_name(
                &self.key(),
                self.namespace,
                self.id,
            ))
    }
}

/// Remove everything of the pair `name` that is left: both engines (`runc
/// delete --force`), its gmsd, the namespace pins and any other mount below
/// the pair directory, the pair cgroup, the directory and the metrics file.
/// `runc_log_dir`: where runc may write its log (a bundle); `runc`: the
/// runc root and binary the task was created with. Failures are logged: a
/// cleanup has nobody better to give them to, and goes on.
pub async fn remove(
    name: &PairName<'_>,
    runc_log_dir: &Path,
    router: Arc<ExitRouter>,
    runc: &RuncOptions,
) {
    // The slots the pair had: those whose bundle directory is there (two,
    // the most common, when none is).
    let dirs = name.existing_dirs();
    let had = SlotId::first(shadow_pair::MAX_SLOTS)
        .filter(|s| dirs.iter().any(|d| d.slots[s.index()].is_dir()))
        .count()
        .max(2);
    match RuncClient::new(name.config, name.namespace, runc_log_dir, router, runc) {
        Ok(runc) => {
            for slot in SlotId::first(had) {
                let engine = spec::engine_id(name.id, slot);
                if let Err(e) = runc.delete_force(&engine).await {
                    log::warn!("pair {}: removing engine {engine}: {e}", name.id);
                }
            }
        }
        Err(e) => log::warn!("pair {}: cannot run runc: {e}", name.id),
    }
    for dirs in dirs {
        log::info!(
            "pair {}: removing what its dead shim left in {}",
            name.id,
            dirs.root.display()
        );
        let gms = dirs.gms.clone();
        let _ = tokio::task::spawn_blocking(move || kill_gmsd(&gms)).await;
        crate::mount::unmount(&dirs.root).await;
        if let Ok(path) = std::fs::read_to_string(&dirs.cgroup_record) {
            let path = path.trim();
            if path.starts_with('/') {
                PairCgroup::open(path).remove().await;
            }
        }
        if let Err(e) = std::fs::remove_dir_all(&dirs.root) {
            if e.kind() != std::io::ErrorKind::NotFound {
                log::warn!("pair {}: removing {}: {e}", name.id, dirs.root.display());
            }
        }
        // The namespace dir too, once its last pair is gone.
        if let Some(parent) = dirs.root.parent() {
            let _ = std::fs::remove_dir(parent);
        }
    }
    let metrics = name.metrics_file();
    if let Err(e) = std::fs::remove_file(&metrics) {
        if e.kind() != std::io::ErrorKind::NotFound {
            log::warn!("pair {}: removing {}: {e}", name.id, metrics.display());
        }
    }
}

/// SIGKILL every gmsd serving `socket_dir` and wait (bounded) until each is
/// gone. A gmsd is recognised by its command line (`serve --socket-dir
/// <dir>`, as `gmsd_launch` starts it) and by leading its own
/// session; the pidfd is opened before the command line is read, so a
/// recycled pid is never signalled.
fn kill_gmsd(socket_dir: &Path) {
    let mut killed = Vec::new();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return;
    };
    for e in rd.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(pidfd) = gmsd_launch::pidfd::open(pid) else {
            continue;
        };
        if !serves(pid, socket_dir) {
            continue;
        }
        // SAFETY: a valid pidfd, a signal number, no siginfo, no flags.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                pidfd.as_raw_fd(),
                libc::SIGKILL,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
        if rc == 0 {
            log::info!("killed gmsd pid {pid} of {}", socket_dir.display());
            killed.push(pidfd);
        }
    }
    let deadline = Instant::now() + GMSD_EXIT_WAIT;
    for pidfd in killed {
        // A pidfd polls readable once its process has exited.
        let left = deadline.saturating_duration_since(Instant::now());
        let mut pfd = libc::pollfd {
            fd: pidfd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the duration of the call.
        unsafe { libc::poll(&mut pfd, 1, left.as_millis() as i32) };
    }
}

/// Whether `pid` is a session leader whose arguments are `… serve
/// --socket-dir <socket_dir> …`.
fn serves(pid: i32, socket_dir: &Path) -> bool {
    let Ok(raw) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    let dir = socket_dir.as_os_str().as_encoded_bytes();
    let args: Vec<&[u8]> = raw.split(|b| *b == 0).collect();
    let named = args
        .windows(2)
        .any(|w| w[0] == b"--socket-dir" && w[1] == dir);
    // SAFETY: getsid takes a pid and touches no memory.
    named && args.contains(&&b"serve"[..]) && unsafe { libc::getsid(pid) } == pid
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    #[test]
    fn only_a_session_leader_serving_that_dir_is_a_gmsd_of_the_pair() {
        let dir = tempfile::tempdir().unwrap();
        let gms = dir.path().join("gms");
        let spawn = |args: &[&std::ffi::OsStr], session: bool| {
            // `sleep; :` so that sh does not exec sleep: the arguments stay.
            let mut c = Command::new("sh");
            c.args(["-c", "sleep 30; :", "sh"]).args(args);
            if session {
                use std::os::unix::process::CommandExt;
                // SAFETY: setsid is async-signal-safe.
                unsafe {
                    c.pre_exec(|| {
                        libc::setsid();
                        Ok(())
                    });
                }
            }
            c.spawn().unwrap()
        };
        let g = gms.as_os_str();
        let other = dir.path().join("gms2");
        let mut ours = spawn(&["serve".as_ref(), "--socket-dir".as_ref(), g], true);
        let mut no_session = spawn(&["serve".as_ref(), "--socket-dir".as_ref(), g], false);
        let mut elsewhere = spawn(
            &["serve".as_ref(), "--socket-dir".as_ref(), other.as_os_str()],
            true,
        );
        assert!(serves(ours.id() as i32, &gms));
        assert!(!serves(no_session.id() as i32, &gms));
        assert!(!serves(elsewhere.id() as i32, &gms));
        kill_gmsd(&gms);
        assert!(ours.try_wait().unwrap().is_some(), "gmsd stand-in killed");
        assert!(no_session.try_wait().unwrap().is_none());
        assert!(elsewhere.try_wait().unwrap().is_none());
        for mut c in [no_session, elsewhere] {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = ours.wait();
    }
}
