//! What `gmsd serve`'s command line sets: limits on what peers may hold,
//! how long a peer may keep the daemon waiting, and who the supervisor is.
//! Plain values with their defaults, kept apart from the code that enforces
//! them so that the binary builds a [`Config`] without seeing the daemon's
//! state; `Limits::check` refuses a configuration that could produce a
//! layout no reader accepts.

use std::path::PathBuf;
use std::time::Duration;

use gms::layout;
use gms::protocol::MAX_RESPONSE_BYTES;
use gms::{Error, Result};

#[derive(Debug, Clone)]
pub struct Limits {
    pub max_bytes: u64,
    pub max_allocations: usize,
    pub max_metadata_entries: usize,
    pub max_metadata_bytes: usize,
    pub max_connections: usize,
    /// Connections one peer process (by pid) may hold at once.
    pub max_connections_per_peer: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_bytes: 64 << 30,
            max_allocations: 4096,
            max_metadata_entries: 65536,
            max_metadata_bytes: 8 << 20,
            max_connections: 256,
            max_connections_per_peer: 16,
        }
    }
}

impl Limits {
    /// A layout within these limits must reach a reader whole: its encoded
    /// size is bounded by the metadata bytes (counted encoded) plus the
    /// widest encoding of every allocation, and that must fit a response.
    pub(super) fn check(&self) -> Result<()> {
        let layout_max = self
            .max_metadata_bytes
            .saturating_add(
                self.max_allocations
                    .saturating_mul(layout::max_encoded_allocation_len()),
            )
            .saturating_add(4096);
        if layout_max > MAX_RESPONSE_BYTES {
            return Err(Error::Config(format!(
                "--max-metadata-bytes {} with --max-allocations {} allows a layout of up to \
                 {layout_max} bytes encoded, more than a reader accepts ({MAX_RESPONSE_BYTES})",
                self.max_metadata_bytes, self.max_allocations
            )));
        }
        if self.max_connections_per_peer == 0 {
            return Err(Error::Config(
                "--max-connections-per-peer must be at least 1".into(),
            ));
        }
        Ok(())
    }
}

/// How long a peer may keep the daemon waiting.
#[derive(Debug, Clone)]
pub struct Timeouts {
    /// From connect to the first message (`hello` or `status`), and
    /// between messages of a connection that holds no lease.
    pub hello: Duration,
    /// To receive the rest of a frame once its first byte arrived, and to
    /// send an answer.
    pub frame: Duration,
    /// Between two requests of an uncommitted `rw` lease; past it the lease
    /// is dropped and its allocations discarded.
    pub writer_idle: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            hello: Duration::from_secs(10),
            frame: Duration::from_secs(10),
            writer_idle: Duration::from_secs(900),
        }
    }
}

/// Who may `reset` the daemon: the process that supervises it, never an
/// engine. Engines cannot be told apart by uid (a root container is uid 0
/// like the shim), so the supervisor is named by pid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Supervisor {
    /// gmsd's parent process, checked at each connection (`getppid()`; not
    /// pid 1, and no longer the old pid once the parent died: a reparented
    /// gmsd has no supervisor).
    Parent,
    /// Nobody: a committed layout lives until the daemon stops.
    Nobody,
}

#[derive(Debug, Clone)]
pub struct Config {
    pub socket_dir: PathBuf,
    pub limits: Limits,
    /// Peers whose uid or gid is listed may connect; both empty means the
    /// daemon's own effective uid only.
    pub allow_uids: Vec<u32>,
    pub allow_gids: Vec<u32>,
    /// Group owner of the socket; makes it mode 0660 instead of 0600.
    pub socket_group: Option<u32>,
    pub timeouts: Timeouts,
    pub supervisor: Supervisor,
    /// The pair's election lock, as its `stat` said when the daemon started
    /// (`--lock`): only the engine that holds it is granted the KV pool's
    /// write lease. Without it no engine is.
    pub lock: Option<gms::holder::FileId>,
    /// Bytes per allocation of the KV pool (`--kv-chunk`, rounded up to
    /// the granularity; larger where a pool would need more than
    /// [`gms::protocol::MAX_KV_CHUNKS`]).
    pub kv_chunk: u64,
}
