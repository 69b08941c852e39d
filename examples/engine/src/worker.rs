//! What the workers share: the context they answer with (model, weights,
//! KV cache, watchdog, promotion timeline), the jobs the acceptor hands
//! them (a fresh connection, or an answer the engine before this one
//! recorded), and the KV cache itself.

use std::sync::Mutex;

use gms::client::KvCache;
use serde_json::Value;
use shadow_engine::model::Model;
use shadow_engine::promotion::Timeline;
use shadow_engine::Result;

use crate::conn::Conn;
use crate::continuity::{Link, Progress as Phase, Work};
use crate::live::Live;

/// What a worker reads from, computes with and reports to.
pub struct Ctx<'a> {
    pub model: &'a Model,
    /// The weights the model was built from.
    pub bytes: &'a [u8],
    /// Set once the lock is taken (no job comes before).
    pub kv: &'a std::sync::OnceLock<Kv>,
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

/// The engine's KV cache.
pub enum Kv {
    /// At the GMS range reserved while parked: a prefix of it is backed,
    /// growing after the wake.
    Gms(KvCache),
    /// Without GMS: private memory.
    Private(Mutex<Vec<u8>>),
}

impl Kv {
    /// Writes a sequence's state at the start of the cache. Through GMS it
    /// waits (a queued request) until that much is backed, if it is not yet.
    pub fn write(&self, data: &[u8]) -> Result<(), String> {
        let n = (data.len() as u64).min(self.len());
        match self {
            Kv::Gms(cache) => {
                let backed = cache.watch().wait_backed(n, cache.oom_wait());
                if backed < n {
                    return Err(format!(
                        "the KV cache has {backed} bytes backed, this request needs {n}: {}",
                        cache.watch().info_json()
                    ));
                }
                cache.with_backed_mut(|kv| kv[..n as usize].copy_from_slice(&data[..n as usize]));
            }
            Kv::Private(kv) => {
                let mut kv = kv.lock().unwrap_or_else(|e| e.into_inner());
                kv[..n as usize].copy_from_slice(&data[..n as usize]);
            }
        }
        Ok(())
    }

    pub fn len(&self) -> u64 {
        match self {
            Kv::Gms(cache) => cache.len(),
            Kv::Private(kv) => kv.lock().map_or(0, |kv| kv.len() as u64),
        }
    }
}
