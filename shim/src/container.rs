//! What the Task service needs from a container, independent of how the
//! container is made. `plain` (runc, one process tree) implements it today;
//! the engine pair of the next issue will be a second implementation, picked
//! at Create from the `shadow.dev/` annotations, with no change to the
//! service.

use std::time::SystemTime;

use async_trait::async_trait;
use containerd_shim_protos::protobuf::well_known_types::any::Any;
use containerd_shim_protos::types::task::ProcessInfo;
use oci_spec::runtime::{LinuxResources, Process as ProcessSpec};

use crate::error::Result;

/// Lifecycle of one process, as containerd's `task.Status` sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Created,
    Running,
    Paused,
    Stopped,
}

/// How a process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExitInfo {
    pub pid: u32,
    /// Exit code, 128+signal after a signal death.
    pub status: u32,
    pub at: SystemTime,
}

/// The FIFO paths (or terminal) containerd gave for a process.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stdio {
    pub stdin: String,
    pub stdout: String,
    pub stderr: String,
    pub terminal: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessState {
    pub pid: u32,
    pub status: Status,
    pub stdio: Stdio,
    pub exit: Option<ExitInfo>,
}

/// A process in a container: `None` is the init process, `Some(id)` an exec.
pub type ExecId<'a> = Option<&'a str>;

#[async_trait]
pub trait Container: Send + Sync {
    fn bundle(&self) -> &str;
    /// Pid of the init process (0 before it exists).
    fn pid(&self) -> u32;

    async fn start(&self, exec: ExecId<'_>) -> Result<u32>;
    async fn state(&self, exec: ExecId<'_>) -> Result<ProcessState>;
    async fn kill(&self, exec: ExecId<'_>, signal: u32, all: bool) -> Result<()>;
    /// Block until the process has exited.
    async fn wait(&self, exec: ExecId<'_>) -> Result<ExitInfo>;
    /// Remove a stopped (or never started) process; for init, the container.
    async fn delete(&self, exec: ExecId<'_>) -> Result<ExitInfo>;
    async fn exec(&self, exec_id: &str, stdio: Stdio, spec: ProcessSpec) -> Result<()>;
    async fn resize_pty(&self, exec: ExecId<'_>, width: u32, height: u32) -> Result<()>;
    async fn close_io(&self, exec: ExecId<'_>) -> Result<()>;
    async fn pause(&self) -> Result<()>;
    async fn resume(&self) -> Result<()>;
    async fn pids(&self) -> Result<Vec<ProcessInfo>>;
    async fn update(&self, resources: LinuxResources) -> Result<()>;
    /// Cgroup metrics as the `Any` runc-v2 returns.
    async fn stats(&self) -> Result<Any>;
}
