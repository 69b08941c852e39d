//! The launch: [`GmsdCommand::spawn`] forks and execs gmsd in a session of
//! its own with its stdout a pipe, hands the pipe to the readiness wait,
//! and kills (and, when ours, reaps) a gmsd that did not become ready.
//!
//! It exists apart as the one place where the other modules meet: the
//! command (command.rs), the child's setup (pre_exec.rs), the pidfd, the
//! wait (ready.rs) and the handle (handle.rs); none of them uses this one.
//! Free to change: the order of the checks before the fork. Relied on
//! elsewhere: a binary that cannot be executed is refused before any fork
//! (when exec fails, std reaps the child itself and panics if a
//! subreaper's `waitpid(-1)` took it first, which is the shim's case), and
//! a gmsd that did not become ready is never left running.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use crate::command::GmsdCommand;
use crate::error::LaunchError;
use crate::handle::Gmsd;
use crate::ready::Readiness;
use crate::{pidfd, pre_exec};

impl GmsdCommand {
    /// Starts gmsd in a session of its own and waits, at most `timeout`,
    /// until it announces its socket.
    pub fn spawn(mut self, timeout: Duration) -> Result<Gmsd, LaunchError> {
        let binary = self.binary().to_path_buf();
        // A binary that cannot be executed is refused before any fork: when
        // exec fails, std reaps the child itself and panics if a subreaper's
        // `waitpid(-1)` took it first, which is the shim's case.
        if let Err(source) = executable(&binary) {
            return Err(LaunchError::Spawn { binary, source });
        }
        let mut cmd = self.command();
        cmd.stdin(Stdio::null()).stdout(Stdio::piped());
        if let Some(log) = self.take_stderr() {
            cmd.stderr(log);
        }
        pre_exec::new_session(&mut cmd);
        let mut child = match cmd.spawn() {
            Ok(child) => child,
            Err(source) => return Err(LaunchError::Spawn { binary, source }),
        };
        let pid = child.id();
        // None without kernel support (< 5.3), or if a reaper elsewhere
        // already took it: then signals go by pid, and the end is learnt
        // from the pipe alone.
        let pidfd = pidfd::open(pid as libc::pid_t).ok();
        let Some(stdout) = child.stdout.take() else {
            // Stdio::piped() always gives a pipe; be defensive anyway.
            return Err(LaunchError::Pipe {
                binary,
                pid,
                source: std::io::Error::other("no stdout pipe"),
            });
        };
        let mut gmsd = Gmsd::started(child, pidfd, self.reaped_by());
        let readiness = Readiness {
            binary: &binary,
            socket_dir: self.socket_dir(),
            gmsd: &gmsd,
            timeout,
        };
        match readiness.await_on(stdout) {
            Ok(socket) => Ok(gmsd.announced(socket)),
            Err(e) => {
                // Harmless on one that already ended (still a zombie, or
                // ESRCH through the pidfd); needed on every other.
                let _ = gmsd.signal(libc::SIGKILL);
                gmsd.collect();
                Err(e)
            }
        }
    }
}

/// Whether `binary` (a path, or a name looked up on `PATH`) names a
/// regular file someone may execute.
fn executable(binary: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let is_exec = |p: &Path| {
        std::fs::metadata(p)
            .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
            .unwrap_or(false)
    };
    let found = if binary.components().count() > 1 || binary.is_absolute() {
        is_exec(binary)
    } else {
        std::env::var_os("PATH")
            .map(|path| std::env::split_paths(&path).any(|dir| is_exec(&dir.join(binary))))
            .unwrap_or(false)
    };
    if found {
        Ok(())
    } else {
        Err(std::io::Error::new(
            std::io::ErrorKind::NotFound,
            "no executable file there (or on PATH)",
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;
    use std::path::PathBuf;
    use std::sync::Mutex;

    use shadow_contract::state::Exit;

    use crate::handle::Reaper;
    use crate::pre_exec::JOIN_FAILED;

    /// Writing a script while another thread forks makes exec fail with
    /// ETXTBSY (the fork inherits the write fd): write and spawn one at a
    /// time.
    static SPAWNS: Mutex<()> = Mutex::new(());

    /// A stand-in gmsd: `$3` is the socket dir and `$5` the device, as
    /// the launcher passes them.
    fn fake(dir: &Path, body: &str) -> PathBuf {
        let path = dir.join("gmsd");
        std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path
    }

    fn launch(
        body: &str,
        reaper: Reaper,
        timeout: Duration,
    ) -> (tempfile::TempDir, Result<Gmsd, LaunchError>) {
        let _one = SPAWNS.lock().unwrap_or_else(|p| p.into_inner());
        let dir = tempfile::tempdir().unwrap();
        let gmsd = fake(dir.path(), body);
        let log = File::create(dir.path().join("gmsd.log")).unwrap();
        let r = GmsdCommand::new(gmsd, dir.path(), "host")
            .max_bytes(0)
            .max_allocations(8)
            .stderr(log)
            .reaper(reaper)
            .spawn(timeout);
        (dir, r)
    }

    #[test]
    fn ready_line_gives_the_socket_and_a_live_daemon() {
        let (dir, r) = launch(
            r#"echo "starting on $5"; echo "ready $3/gms-$5.sock"; exec sleep 30"#,
            Reaper::Launcher,
            Duration::from_secs(10),
        );
        let g = r.unwrap();
        assert_eq!(g.socket(), dir.path().join("gms-host.sock"));
        assert!(!g.has_exited());
        g.signal(libc::SIGTERM).unwrap();
        assert_eq!(
            g.wait(Duration::from_secs(5)),
            Some(Exit::Signal(libc::SIGTERM))
        );
    }

    /// The OOM score is set, and a cgroup that cannot be joined fails the
    /// start (here: a path that is no cgroup file).
    #[test]
    fn oom_score_is_set_and_an_unjoinable_cgroup_fails_the_start() {
        let _one = SPAWNS.lock().unwrap_or_else(|p| p.into_inner());
        let dir = tempfile::tempdir().unwrap();
        let gmsd = fake(
            dir.path(),
            r#"echo "ready $3/gms-$5.sock $(cat /proc/self/oom_score_adj)""#,
        );
        let out = GmsdCommand::new(&gmsd, dir.path(), "host")
            .oom_score_adj(500)
            .command()
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stdout);
        assert!(said.trim_end().ends_with(" 500"), "{said}");
        let e = GmsdCommand::new(&gmsd, dir.path(), "host")
            .cgroup(vec![dir.path().join("absent/cgroup.procs")])
            .spawn(Duration::from_secs(10))
            .unwrap_err();
        assert!(
            matches!(
                e,
                LaunchError::Exited {
                    exit: Some(Exit::Code(JOIN_FAILED)),
                    ..
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn early_exit_reports_status_and_what_it_said() {
        let (dir, r) = launch(
            "echo 'gmsd: no such device' >&2; echo 'bad flag'; exit 3",
            Reaper::Launcher,
            Duration::from_secs(10),
        );
        let e = r.unwrap_err();
        let msg = e.to_string();
        assert!(
            matches!(&e, LaunchError::Exited { exit: Some(Exit::Code(3)), stdout, .. } if stdout.contains("bad flag")),
            "{e:?}"
        );
        assert!(msg.contains("exit code 3"), "{msg}");
        let log = std::fs::read_to_string(dir.path().join("gmsd.log")).unwrap();
        assert!(
            log.contains("no such device"),
            "stderr went to the log: {log}"
        );
    }

    /// The shim's case: the launcher learns the status but leaves the
    /// zombie for the shim's reaper, which must still find it.
    #[test]
    fn early_exit_elsewhere_is_peeked_not_reaped() {
        let (_dir, r) = launch("exit 5", Reaper::Elsewhere, Duration::from_secs(10));
        let LaunchError::Exited { exit, pid, .. } = r.unwrap_err() else {
            panic!("not an early exit");
        };
        assert_eq!(exit, Some(Exit::Code(5)));
        let mut status = 0;
        // SAFETY: waitpid on our own child with a valid status pointer.
        let reaped = unsafe { libc::waitpid(pid as libc::pid_t, &mut status, 0) };
        assert_eq!(reaped, pid as libc::pid_t, "the reaper still gets the exit");
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 5);
    }

    /// A gmsd that never says `ready` is given up at the timeout and
    /// killed: with the launcher as reaper it is reaped too, and with a
    /// reaper elsewhere the zombie left for that reaper shows SIGKILL. The
    /// stand-in would end on its own only after 30 s, with status 0, so a
    /// launcher that waited for it instead of killing it fails the second
    /// half (slowly) rather than passing.
    #[test]
    fn silence_times_out_and_the_daemon_is_killed() {
        let timeout = Duration::from_millis(300);
        let (_dir, r) = launch("exec sleep 30", Reaper::Launcher, timeout);
        let e = r.unwrap_err();
        let msg = e.to_string();
        let LaunchError::NotReady {
            pid, timeout: t, ..
        } = e
        else {
            panic!("{e:?}");
        };
        assert_eq!(t, timeout);
        assert!(
            msg.contains("was not ready within 300 ms; killed it"),
            "{msg}"
        );
        // Reaped by the launcher: the pid is no child of ours any more.
        // SAFETY: waitpid with WNOHANG and a valid status pointer.
        let rc = unsafe { libc::waitpid(pid as libc::pid_t, &mut 0, libc::WNOHANG) };
        let errno = std::io::Error::last_os_error().raw_os_error();
        assert_eq!((rc, errno), (-1, Some(libc::ECHILD)), "killed and reaped");

        let (_dir, r) = launch("exec sleep 30", Reaper::Elsewhere, timeout);
        let e = r.unwrap_err();
        let LaunchError::NotReady { pid, .. } = e else {
            panic!("{e:?}");
        };
        let mut status = 0;
        // SAFETY: waitpid on our own child with a valid status pointer; it
        // was killed before spawn returned, so this returns at once.
        let reaped = unsafe { libc::waitpid(pid as libc::pid_t, &mut status, 0) };
        assert_eq!(reaped, pid as libc::pid_t, "left for the reaper");
        assert!(
            libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGKILL,
            "killed, not ended on its own: status {status:#x}"
        );
    }

    #[test]
    fn closing_stdout_but_living_on_is_not_ready() {
        let (_dir, r) = launch(
            "exec >&-; exec sleep 30",
            Reaper::Launcher,
            Duration::from_millis(300),
        );
        assert!(matches!(r, Err(LaunchError::NotReady { .. })), "{r:?}");
    }

    #[test]
    fn a_socket_outside_the_dir_is_refused() {
        let (_dir, r) = launch(
            "echo 'ready /etc/gms-host.sock'; exec sleep 30",
            Reaper::Launcher,
            Duration::from_secs(10),
        );
        assert!(matches!(r, Err(LaunchError::Announcement { .. })), "{r:?}");
    }

    #[test]
    fn missing_binary_is_a_spawn_error() {
        let r = GmsdCommand::new("/nonexistent/gmsd", "/tmp", "host").spawn(Duration::from_secs(1));
        assert!(matches!(r, Err(LaunchError::Spawn { .. })), "{r:?}");
    }

    /// Refused before any fork: no child whose failed exec std would reap.
    #[test]
    fn what_cannot_be_executed_is_refused_before_a_fork() {
        let d = tempfile::tempdir().unwrap();
        let plain = d.path().join("gmsd");
        std::fs::write(&plain, "not a program").unwrap();
        for binary in [plain.as_path(), d.path(), Path::new("no-such-gmsd-on-path")] {
            let err = executable(binary).expect_err("refused");
            assert_eq!(err.kind(), std::io::ErrorKind::NotFound, "{binary:?}");
        }
        assert!(executable(Path::new("sh")).is_ok(), "found on PATH");
        assert!(executable(Path::new("/bin/sh")).is_ok());
    }

    #[test]
    fn capabilities_are_dropped() {
        let (dir, r) = launch(
            r#"grep -E '^Cap(Eff|Prm|Bnd)' /proc/self/status > "$3/caps"; echo "ready $3/gms-$5.sock"; exec sleep 30"#,
            Reaper::Launcher,
            Duration::from_secs(10),
        );
        let g = r.unwrap();
        let caps = std::fs::read_to_string(dir.path().join("caps")).unwrap();
        let _ = g.signal(libc::SIGKILL);
        g.wait(Duration::from_secs(5));
        for line in caps.lines() {
            assert!(line.ends_with("0000000000000000"), "{caps}");
        }
        assert_eq!(caps.lines().count(), 3, "{caps}");
    }
}
