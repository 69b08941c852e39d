//! What the workers share: the context they answer with (model, weights,
//! KV cache, watchdog, promotion timeline), the jobs the acceptor hands
//! them (a fresh connection, or an answer the engine before this one
//! recorded), and the KV cache itself.

use std::sync::{Condvar, Mutex, OnceLock};

use serde_json::Value;
use shadow_engine::model::Model;
use shadow_engine::promotion::Timeline;

use crate::conn::Conn;
use crate::continuity::{Link, Progress as Phase, Work};
use crate::live::Live;
use crate::paged::Paged;

/// What a worker reads from, computes with and reports to.
pub struct Ctx<'a> {
    pub model: &'a Model,
    /// The weights the model was built from.
    pub bytes: &'a [u8],
    /// Set once gmsd answered the wake's request for the KV pool (None
    /// inside: no pool); unset before, when a new stream runs without.
    pub kv: &'a KvSlot,
    pub info: &'a Value,
    pub live: &'a Live,
    /// This promotion's timeline.
    pub promoted: &'a Timeline,
}

/// A worker's next connection.
pub enum Job {
    /// A connection to read a request from: accepted now, or left by the
    /// engine before with nothing recorded (its request, if any, still in
    /// the socket).
    Fresh(Conn, Link),
    /// An answer the engine before this one recorded, to go on with.
    Resume(Resumed),
}

/// A recorded answer and how far it got.
pub struct Resumed {
    pub conn: Conn,
    pub link: Link,
    pub work: Work,
    /// `Recorded` (nothing written), `Answering(n)` or `Finishing(n)`.
    pub progress: Phase,
    /// Bytes of the answer already in the socket.
    pub written: u64,
}

/// The engine's KV cache: paged in the pair's KV pool (`paged`), or none
/// (no GMS, or no write lease: nothing is carried to the next engine).
pub type Kv = Option<Paged>;

/// How long a new stream waits for the KV pool that the wake asked gmsd
/// for: the pool is answered in a millisecond or so; a gmsd that does not
/// answer costs a stream this once, which then runs outside the pool.
pub const KV_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// The KV cache once gmsd answered the wake's request for the pool; a
/// stream waits for it (its KV goes there from its first token), a plain
/// answer does not.
#[derive(Default)]
pub struct KvSlot {
    cell: OnceLock<Kv>,
    set: Mutex<bool>,
    changed: Condvar,
}

impl KvSlot {
    /// This engine's KV cache from now on (once; later calls do nothing).
    pub fn set(&self, kv: Kv) {
        let _ = self.cell.set(kv);
        *self.set.lock().unwrap_or_else(|e| e.into_inner()) = true;
        self.changed.notify_all();
    }

    /// The pool, if it was answered and granted.
    pub fn get(&self) -> Option<&Paged> {
        self.cell.get().and_then(Option::as_ref)
    }

    /// The pool, once answered, waiting up to `timeout` for the answer.
    pub fn wait(&self, timeout: std::time::Duration) -> Option<&Paged> {
        let set = self.set.lock().unwrap_or_else(|e| e.into_inner());
        let _set = self
            .changed
            .wait_timeout_while(set, timeout, |set| !*set)
            .map(|(g, _)| g)
            .unwrap_or_else(|e| e.into_inner().0);
        self.get()
    }
}
