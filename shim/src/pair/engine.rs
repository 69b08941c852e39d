//! Spawning engines: one slot's runc container, the task output every
//! engine writes into, and `runc run --detach` of a slot's bundle. The
//! supervisor reaches this through [`super::host::Host`], so that its
//! ordering logic is tested without runc.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use crate::error::Result;
use crate::runc::{RuncClient, RuncStdio};
use async_trait::async_trait;

/// One slot's runc container.
#[derive(Debug)]
pub struct EngineSlot {
    pub runc_id: String,
    pub bundle: PathBuf,
    pub client: RuncClient,
    /// The engine's cgroup path (`<pair cgroup>/s<slot>`).
    pub cgroup: String,
    /// The engine has no PID namespace of its own: when its main process
    /// dies, the rest of it must be killed by the shim (`runc kill --all`).
    pub kills_rest_on_exit: bool,
    /// The engine-contract entries of its spec's environment, for execs
    /// (`spec::contract_env`), read once when the spec was written.
    pub contract_env: Vec<String>,
}

/// The write ends of the task's stdout/stderr pipes, handed to every engine
/// spawn, and the read end of the task's stdin pipe, handed to the first
/// spawn only: the task's input is one stream and goes to the first engine
/// the pair makes (slot 0's, created at Create); the other engine
/// and every respawn read /dev/null. Closed when the pair ends, so that the
/// copiers see EOF.
#[derive(Debug, Default)]
pub struct SharedOutput {
    fds: Mutex<[Option<OwnedFd>; 2]>,
    stdin: Mutex<Option<OwnedFd>>,
}

impl SharedOutput {
    pub fn new(stdout: Option<OwnedFd>, stderr: Option<OwnedFd>) -> Self {
        SharedOutput {
            fds: Mutex::new([stdout, stderr]),
            stdin: Mutex::new(None),
        }
    }

    /// The task's stdin, for the next spawn only.
    pub fn with_stdin(self, stdin: Option<OwnedFd>) -> Self {
        *self.stdin.lock().unwrap_or_else(|p| p.into_inner()) = stdin;
        self
    }

    pub fn close(&self) {
        let mut fds = self.fds.lock().unwrap_or_else(|p| p.into_inner());
        *fds = [None, None];
        drop(self.stdin.lock().unwrap_or_else(|p| p.into_inner()).take());
    }
}

#[async_trait]
impl runc::io::Io for SharedOutput {
    async fn set(&self, cmd: &mut runc::Command) -> std::io::Result<()> {
        let fds = self.fds.lock().unwrap_or_else(|p| p.into_inner());
        let pick = |fd: &Option<OwnedFd>| -> std::io::Result<std::process::Stdio> {
            Ok(match fd {
                Some(fd) => std::process::Stdio::from(fd.try_clone()?),
                None => std::process::Stdio::null(),
            })
        };
        // Moved into this spawn's command: once runc has started the
        // engine, the engine holds the only read end.
        let stdin = self.stdin.lock().unwrap_or_else(|p| p.into_inner()).take();
        cmd.stdin(match stdin {
            Some(fd) => std::process::Stdio::from(fd),
            None => std::process::Stdio::null(),
        });
        cmd.stdout(pick(&fds[0])?);
        cmd.stderr(pick(&fds[1])?);
        Ok(())
    }

    async fn close_after_start(&self) {
        // Kept for the next respawn; `close` drops them at the pair's end.
    }
}

/// Start one engine: `runc run --detach` of the slot's bundle, with
/// `listening` (the pair's listening sockets, or the engine's hand-off
/// sockets in their place) as its descriptors 3.., then `stored` (the fd
/// store's copies, with their names), as systemd hands a restarted service
/// its sockets and its store. A previous generation's stopped container of
/// the same id is removed first.
pub async fn run_engine(
    e: &EngineSlot,
    output: Arc<SharedOutput>,
    fresh: bool,
    listening: &[BorrowedFd<'_>],
    stored: &[(String, OwnedFd)],
) -> Result<u32> {
    if !fresh {
        let _ = e.client.delete_force(&e.runc_id).await;
    }
    let mut inherit = listening.to_vec();
    inherit.extend(stored.iter().map(|(_, fd)| fd.as_fd()));
    e.client
        .run_detached(&e.runc_id, &e.bundle, RuncStdio::Fds(output), &inherit)
        .await
}

/// Create one engine without starting it: `runc create` of the slot's
/// bundle (so that its pid, and a spec that cannot run, are known at the
/// task's Create, as runc-v2 does); `runc start` runs it.
pub async fn create_engine(
    e: &EngineSlot,
    output: Arc<SharedOutput>,
    listening: &[BorrowedFd<'_>],
) -> Result<u32> {
    e.client
        .create_inheriting(&e.runc_id, &e.bundle, RuncStdio::Fds(output), listening)
        .await
}
