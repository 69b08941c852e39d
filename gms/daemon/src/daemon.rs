//! `gmsd serve`: one process per device that owns every allocation.
//!
//! Shape: a main thread polls the listening socket and a signalfd
//! (SIGTERM/SIGINT); each accepted connection gets a thread; all state sits
//! in one `Mutex<State>`. A connection thread ends when its peer closes,
//! dies (EOF/ECONNRESET), or breaks a rule; either way its `Session` guard
//! releases the lease on drop, so "the connection is the lease" holds by
//! construction, also for a writer SIGKILLed halfway through a load.
//!
//! Every error a peer causes is answered with one `error` message and the
//! connection is closed (for a writer that also discards its uncommitted
//! work). Nothing a peer sends can panic the daemon: all input goes through
//! `protocol::decode`, and the lock is taken poison-tolerant.
//!
//! Engines are untrusted (docs/security.md, "Leases and gmsd"), so no peer
//! can hold the daemon: a connection must say `hello` (or `status`) within
//! `hello` time, finish every frame it starts within `frame` time and read
//! its answers as fast; an uncommitted `rw` lease idle past `writer_idle`
//! is dropped with its allocations; one peer process holds at most
//! `max_connections_per_peer` connections; an allocation is created and
//! populated outside the global lock; a failing `accept` (EMFILE) backs off
//! instead of spinning. The supervisor (gmsd's parent: the shim, or whoever
//! started it) is told apart from engines by its pid (`SO_PEERCRED`) and is
//! the only peer that may `reset`; no engine gets `rw` once a layout is
//! committed.
//!
//! This file holds what every part shares (the daemon, its state and its
//! stores, the lock), and uses none of the parts, which use it;
//! each job is a module of its own, in the order a connection meets them:
//! - `config`: limits, timeouts, who the supervisor is;
//! - `socket`: the socket directory and the bound socket;
//! - `listener`: [`serve`], the accept loop with its back-off, and shutdown;
//! - `admission`: peer credentials and connection limits at accept;
//! - `connection`: one connection's thread, its deadlines, its end;
//! - `requests`: one function per request kind, and the lease checks;
//! - `allocate`: `allocate`, whose memory is made outside the lock;
//! - `store`: the working and committed stores: commit replaces, reset
//!   drops, a writer's end discards;
//! - `pool` and `kv`: the pair's KV pool (its state; its write lease for
//!   the lock's holder and the fence that says its earlier writers are
//!   gone);
//! - `report`: the status report, one snapshot under the lock.

use std::collections::BTreeMap;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};

use gms::layout::Layout;

use crate::backend::{Backend, Memory};
use crate::lease::{LeaseId, Leases};

mod admission;
mod allocate;
mod config;
mod connection;
mod kv;
mod listener;
mod pool;
mod report;
mod requests;
mod socket;
mod store;

pub use config::{Config, Limits, Supervisor, Timeouts};
pub use listener::serve;

pub struct Daemon {
    backend: Box<dyn Backend>,
    config: Config,
    socket: PathBuf,
    state: Mutex<State>,
}

/// One accepted connection, as the daemon knows it.
struct Connection {
    pid: i32,
    uid: u32,
    gid: u32,
    client: String,
    lease: Option<LeaseId>,
    said_hello: bool,
    /// The peer is gmsd's supervisor (see [`Supervisor`]).
    supervisor: bool,
    /// The connection is the KV pool's write lease (`kv`).
    kv_writer: bool,
    /// A second handle on the socket, so shutdown can wake the thread.
    stream: UnixStream,
}

/// Allocations with their memory, plus the layout that describes them
/// (the working and committed ones; their transitions are `store`'s).
#[derive(Default)]
struct Store {
    layout: Layout,
    memory: BTreeMap<u64, Box<dyn Memory>>,
    /// `layout.metadata_encoded_bytes()`, kept as entries come and go.
    metadata_encoded: usize,
}

/// Everything behind the daemon's one lock.
#[derive(Default)]
struct State {
    leases: Leases,
    /// The writer's layout while it loads (a `rw` lease holds it).
    working: Option<Store>,
    /// The layout readers import.
    committed: Option<Store>,
    next_alloc: u64,
    generation: u64,
    next_conn: u64,
    connections: BTreeMap<u64, Connection>,
    /// The pair's KV pool, from its first grant (`kv`).
    kv: Option<pool::Pool>,
}

impl Daemon {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic elsewhere must not take every later lease down with it.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}
