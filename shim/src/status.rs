//! The states, exits and stdio of a task's processes, as containerd's Task
//! API speaks of them: the vocabulary every layer above uses (processes,
//! their stdio, both kinds of container, the service), so it sits at the
//! bottom and uses nothing of the shim's.

use std::time::SystemTime;

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
