//! What the Task service needs from a container, independent of how the
//! container is made: `plain` (runc, one process tree) and `pair` (one
//! spec as a supervised engine pair) implement it, picked at Create from
//! the `shadow.dev/` annotations; the service does not know which it has.

use std::sync::Arc;

use async_trait::async_trait;
use containerd_shim_protos::protobuf::well_known_types::any::Any;
use containerd_shim_protos::types::task::ProcessInfo;
use oci_spec::runtime::{LinuxResources, Process as ProcessSpec};

use crate::error::Result;
use crate::process::Process;
use crate::status::{ExitInfo, ProcessState};

/// What the Task service needs of a container: its init's lifecycle, and
/// where its execs run. The execs themselves (their table, kill, wait,
/// delete, terminal and stdin) are the service's, the same for every kind
/// of container (`execs.rs`).
#[async_trait]
pub trait Container: Send + Sync {
    fn bundle(&self) -> &str;
    /// Pid of the init process (0 before it exists).
    fn pid(&self) -> u32;

    async fn start(&self) -> Result<u32>;
    async fn state(&self) -> Result<ProcessState>;
    async fn kill(&self, signal: u32, all: bool) -> Result<()>;
    /// Block until the init (the container) has exited.
    async fn wait(&self) -> Result<ExitInfo>;
    /// Remove a stopped (or never started) container.
    async fn delete(&self) -> Result<ExitInfo>;
    /// Whether an exec may be added now (the container's state allows it).
    async fn exec_allowed(&self, exec_id: &str) -> Result<()>;
    /// Start the exec `proc` (added earlier) where this container runs its
    /// execs; its pid.
    async fn start_exec(
        &self,
        proc: &Arc<Process>,
        exec_id: &str,
        spec: ProcessSpec,
    ) -> Result<u32>;
    async fn resize_pty(&self, width: u32, height: u32) -> Result<()>;
    async fn close_io(&self) -> Result<()>;
    async fn pause(&self) -> Result<()>;
    async fn resume(&self) -> Result<()>;
    async fn pids(&self) -> Result<Vec<ProcessInfo>>;
    async fn update(&self, resources: LinuxResources) -> Result<()>;
    /// Cgroup metrics as the `Any` runc-v2 returns.
    async fn stats(&self) -> Result<Any>;
}
