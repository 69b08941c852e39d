//! What to run as gmsd ([`GmsdCommand`]): its command line and how its
//! process is set up before exec, built without starting anything.
//!
//! It exists apart because it serves two callers: the launch
//! (`GmsdCommand::spawn`, in spawn.rs) and the OCI hook's `gms run`, which
//! execs [`GmsdCommand::command`] in place for systemd. Free to change: new
//! builder options. Relied on elsewhere: the command line
//! `gmsd serve --socket-dir <dir> --device <dev> …`, by which the shim's
//! leftover cleanup (`shim/src/pair/leftovers.rs`) recognises a pair's
//! gmsd.

use std::ffi::OsString;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::handle::Reaper;
use crate::pre_exec;

/// How to start one gmsd: `gmsd serve --socket-dir DIR --device DEVICE …`.
#[derive(Debug)]
pub struct GmsdCommand {
    binary: PathBuf,
    socket_dir: PathBuf,
    device: String,
    args: Vec<OsString>,
    stderr: Option<File>,
    reaper: Reaper,
    /// `cgroup.procs` files gmsd moves itself into before exec.
    cgroup_procs: Vec<PathBuf>,
    oom_score_adj: Option<i32>,
}

impl GmsdCommand {
    pub fn new(
        binary: impl Into<PathBuf>,
        socket_dir: impl Into<PathBuf>,
        device: impl Into<String>,
    ) -> GmsdCommand {
        GmsdCommand {
            binary: binary.into(),
            socket_dir: socket_dir.into(),
            device: device.into(),
            args: Vec::new(),
            stderr: None,
            reaper: Reaper::Launcher,
            cgroup_procs: Vec::new(),
            oom_score_adj: None,
        }
    }

    /// Run gmsd in a cgroup: it writes its pid (`0`, itself) into each of
    /// these `cgroup.procs` files (one per hierarchy on cgroup v1) before
    /// exec, so every byte it allocates is charged there from the first.
    /// Failing to join fails the start: a gmsd must never run outside
    /// the cgroup meant to pay for it.
    pub fn cgroup(mut self, procs_files: Vec<PathBuf>) -> GmsdCommand {
        self.cgroup_procs = procs_files;
        self
    }

    /// gmsd's `oom_score_adj` (-1000..=1000), set before exec: the OOM
    /// killer weighs it as any process of its pod, not as part of the
    /// runtime that started it.
    pub fn oom_score_adj(mut self, adj: i32) -> GmsdCommand {
        self.oom_score_adj = Some(adj);
        self
    }

    /// `--max-bytes N`, unless 0 (gmsd's default).
    pub fn max_bytes(self, bytes: u64) -> GmsdCommand {
        if bytes == 0 {
            return self;
        }
        self.arg("--max-bytes").arg(bytes.to_string())
    }

    /// `--max-allocations N`, unless 0 (gmsd's default).
    pub fn max_allocations(self, count: u64) -> GmsdCommand {
        if count == 0 {
            return self;
        }
        self.arg("--max-allocations").arg(count.to_string())
    }

    /// `--kv-chunk N`, unless 0 (gmsd's default): the bytes of each
    /// allocation of the KV pool, the part a promoted engine maps before
    /// its first step.
    pub fn kv_chunk(self, bytes: u64) -> GmsdCommand {
        if bytes == 0 {
            return self;
        }
        self.arg("--kv-chunk").arg(bytes.to_string())
    }

    /// `--lock PATH`: the pair's election lock, whose holder alone gets the
    /// KV pool's write lease.
    pub fn lock(self, path: Option<&Path>) -> GmsdCommand {
        match path {
            Some(path) => self.arg("--lock").arg(path.as_os_str()),
            None => self,
        }
    }

    /// One more argument after the socket dir and device.
    pub fn arg(mut self, arg: impl Into<OsString>) -> GmsdCommand {
        self.args.push(arg.into());
        self
    }

    pub fn args<I: IntoIterator<Item = S>, S: Into<OsString>>(mut self, args: I) -> GmsdCommand {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Where gmsd's log (stderr) goes; inherited when not set.
    pub fn stderr(mut self, log: File) -> GmsdCommand {
        self.stderr = Some(log);
        self
    }

    /// See [`Reaper`].
    pub fn reaper(mut self, reaper: Reaper) -> GmsdCommand {
        self.reaper = reaper;
        self
    }

    pub fn binary(&self) -> &Path {
        &self.binary
    }

    /// The command, capabilities dropped before exec, stdio untouched: for
    /// a caller that execs it in place (`ExecStart=` of a systemd unit).
    pub fn command(&self) -> Command {
        let mut cmd = Command::new(&self.binary);
        cmd.arg("serve")
            .arg("--socket-dir")
            .arg(&self.socket_dir)
            .arg("--device")
            .arg(&self.device)
            .args(&self.args);
        pre_exec::join_and_drop_capabilities(&mut cmd, &self.cgroup_procs, self.oom_score_adj);
        cmd
    }

    /// The socket dir, in which the announced socket must lie.
    pub(crate) fn socket_dir(&self) -> &Path {
        &self.socket_dir
    }

    /// Who reaps the started gmsd (set by [`GmsdCommand::reaper`]).
    pub(crate) fn reaped_by(&self) -> Reaper {
        self.reaper
    }

    /// The log set by [`GmsdCommand::stderr`], taken once by the launch.
    pub(crate) fn take_stderr(&mut self) -> Option<File> {
        self.stderr.take()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The command line the shim's leftover cleanup recognises, with the
    /// limits after it only when set.
    #[test]
    fn the_command_line_is_serve_dir_device_then_the_rest() {
        let cmd = GmsdCommand::new("/usr/bin/gmsd", "/run/pair/gms", "host")
            .max_bytes(0)
            .max_allocations(8)
            .kv_chunk(0)
            .kv_chunk(1 << 20)
            .arg("--verbose")
            .command();
        assert_eq!(cmd.get_program(), "/usr/bin/gmsd");
        let args: Vec<_> = cmd.get_args().collect();
        assert_eq!(
            args,
            [
                "serve",
                "--socket-dir",
                "/run/pair/gms",
                "--device",
                "host",
                "--max-allocations",
                "8",
                "--kv-chunk",
                "1048576",
                "--verbose"
            ]
        );
    }
}
