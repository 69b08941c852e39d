//! What the workers share: the context they answer with (model, weights,
//! KV cache, watchdog, promotion timeline), the jobs the acceptor hands
//! them (a fresh connection, or an answer the engine before this one
//! recorded).

use serde_json::Value;
use shadow_engine::model::Model;
use shadow_engine::promotion::Timeline;

use crate::conn::Conn;
use crate::continuity::{Link, Progress as Phase, Work};
use crate::live::Live;
use crate::paged::Pool;

/// What a worker reads from, computes with and reports to.
pub struct Ctx<'a> {
    pub model: &'a Model,
    /// The weights the model was built from.
    pub bytes: &'a [u8],
    /// The pair's KV pool, asked for at the wake and taken by the first
    /// stream that needs it.
    pub kv: &'a Pool,
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
