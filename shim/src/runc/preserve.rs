//! `--preserve-fds` for `runc run` and `runc create`, which the runc crate
//! has no option for: [`PreservedFds`] wraps a command's stdio (the one
//! hook the crate gives into the command line) to add the flag and to put
//! the inherited descriptors at 3, 4, … in the child. Only that command
//! line rewrite and the descriptor moves belong here.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::Arc;

use async_trait::async_trait;
use runc::Command;

/// A `runc run` (or `runc create`) whose process inherits `fds` as its descriptors 3.. The
/// runc crate has no option for `--preserve-fds`, so this wraps the stdio
/// (the one hook it gives into the command) and rebuilds the command with
/// the flag after the subcommand. Holds its own duplicates, closed when runc
/// has returned.
#[derive(Debug)]
pub struct PreservedFds {
    inner: Arc<dyn runc::io::Io>,
    fds: Vec<OwnedFd>,
}

impl PreservedFds {
    /// `inner`'s stdio, and `fds` (the caller's duplicates) as 3, 4, ….
    pub fn new(inner: Arc<dyn runc::io::Io>, fds: Vec<OwnedFd>) -> Self {
        PreservedFds { inner, fds }
    }
}

/// `cmd` again with `--preserve-fds n` right after its `run` or `create`
/// subcommand.
fn with_preserve_fds(cmd: &std::process::Command, n: usize) -> std::io::Result<Command> {
    use std::ffi::OsStr;
    let mut args: Vec<&OsStr> = cmd.get_args().collect();
    let at = args
        .windows(2)
        .position(|w| (w[0] == "run" || w[0] == "create") && w[1] == "--bundle")
        .ok_or_else(|| {
            std::io::Error::other("--preserve-fds: not a `runc run|create --bundle` command")
        })?;
    let n = n.to_string();
    args.splice(
        at + 1..at + 1,
        [OsStr::new("--preserve-fds"), OsStr::new(&n)],
    );
    let mut out = std::process::Command::new(cmd.get_program());
    out.args(args);
    for (k, v) in cmd.get_envs() {
        match v {
            Some(v) => out.env(k, v),
            None => out.env_remove(k),
        };
    }
    if let Some(dir) = cmd.get_current_dir() {
        out.current_dir(dir);
    }
    // The runc crate's defaults; the wrapped stdio sets its own next.
    out.stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    Ok(Command::from(out))
}

#[async_trait]
impl runc::io::Io for PreservedFds {
    async fn set(&self, cmd: &mut Command) -> std::io::Result<()> {
        *cmd = with_preserve_fds(cmd.as_std(), self.fds.len())?;
        self.inner.set(cmd).await?;
        let from: Vec<RawFd> = self.fds.iter().map(AsRawFd::as_raw_fd).collect();
        let mut moved: Vec<RawFd> = vec![-1; from.len()];
        let first = shadow_contract::listen::FIRST_FD;
        let above = first + from.len() as RawFd;
        // SAFETY: the closure runs in the forked child before exec and
        // calls only fcntl(2) and dup2(2), which are async-signal-safe; it
        // allocates nothing (both vectors exist before the fork). Each
        // descriptor is first copied above the target range (close-on-exec,
        // so the copies vanish at exec), then onto 3+i: no target can
        // overwrite a source not yet copied. dup2 clears close-on-exec on
        // the target, so runc gets exactly 3..3+n. A target may replace
        // std's close-on-exec error pipe; then an exec failure shows as runc
        // exiting 127 instead of a spawn error, which the caller reports too.
        unsafe {
            cmd.pre_exec(move || {
                for (i, &fd) in from.iter().enumerate() {
                    let m = libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, above);
                    if m < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    moved[i] = m;
                }
                for (i, &m) in moved.iter().enumerate() {
                    if libc::dup2(m, first + i as RawFd) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        Ok(())
    }

    async fn close_after_start(&self) {
        self.inner.close_after_start().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_flag_goes_right_after_the_subcommand() {
        let mut cmd = std::process::Command::new("/usr/bin/runc");
        cmd.args(["--root", "/r", "run", "--bundle", "/b", "--detach", "c1"])
            .env("A", "1")
            .current_dir("/");
        let out = with_preserve_fds(&cmd, 2).unwrap();
        let args: Vec<_> = out.as_std().get_args().collect();
        assert_eq!(
            args,
            [
                "--root",
                "/r",
                "run",
                "--preserve-fds",
                "2",
                "--bundle",
                "/b",
                "--detach",
                "c1"
            ]
        );
        assert_eq!(out.as_std().get_program(), "/usr/bin/runc");
        assert!(out
            .as_std()
            .get_envs()
            .any(|(k, v)| k == "A" && v == Some("1".as_ref())));
        assert_eq!(
            out.as_std().get_current_dir(),
            Some(std::path::Path::new("/"))
        );
        // Not a run or create with a bundle: refused, not guessed at.
        let mut exec = std::process::Command::new("runc");
        exec.args(["exec", "--detach", "c1"]);
        assert!(with_preserve_fds(&exec, 1).is_err());
    }
}
