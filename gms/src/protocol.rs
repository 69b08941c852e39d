//! The GMS wire protocol, version 1: what a message may say, and the one
//! decoder every byte from a peer goes through.
//!
//! Messages are JSON objects `{"version": 1, "op": "...", ...}`. Decoding is
//! pure (`decode(bytes, fd_count)`) so the fuzzer drives exactly the code the
//! daemon runs. Every rule is checked here: size, JSON, version, shape, and
//! the number of file descriptors that came with the message.

use serde::{Deserialize, Serialize};

use crate::layout::Layout;
use crate::status::StatusReport;
use crate::{Error, Result};

// The words the messages are made of live in `types` (below `layout`,
// `status` and `error`, which need them too); they keep their paths here.
pub use crate::types::{ErrorCode, LeaseKind, Metadata, Mode};

/// The protocol version this build speaks.
pub const VERSION: u32 = 1;
/// Largest request body a daemon accepts.
pub const MAX_REQUEST_BYTES: usize = 64 * 1024;
/// Largest response body a client accepts (a layout with all its metadata).
pub const MAX_RESPONSE_BYTES: usize = 16 * 1024 * 1024;
/// Most file descriptors one message carries (well under `SCM_MAX_FD`).
pub const MAX_FDS_PER_MESSAGE: usize = 64;
/// The largest KV index a daemon makes (host memory, counted against
/// nothing else: a pool's block table and prefix index fit well within).
pub const MAX_KV_INDEX_BYTES: u64 = 64 << 20;

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// First message of a lease connection.
    Hello {
        mode: Mode,
        #[serde(default)]
        client: String,
    },
    /// Inspection; allowed as the first message, takes no lease.
    Status,
    /// Writer: new allocation of `size` bytes (rounded up to the granularity)
    /// that the writer maps at `va`. Answered with one fd.
    Allocate {
        tag: String,
        size: u64,
        va: u64,
    },
    Free {
        id: u64,
    },
    PutMeta {
        key: String,
        value: String,
    },
    GetMeta {
        key: String,
    },
    /// Writer: make the layout immutable; the lease becomes `ro`.
    Commit,
    GetLayout,
    /// File descriptors for these allocations, in this order.
    Export {
        ids: Vec<u64>,
    },
    /// The pair's supervisor only (not an engine), as the first message or
    /// without a lease: forget the committed layout (and the KV pool) so
    /// that the next engine loads again. Needs no lease attached.
    Reset,
    /// The first and only request of a connection that becomes the write
    /// lease of the pair's KV pool. Carries one fd, the proof: a descriptor
    /// of the pair's election lock file through which its exclusive
    /// `flock` is held (the engine kit's holder sends the engine a copy).
    /// The first grant makes the pool (`size` bytes, rounded up to the
    /// granularity, recorded at `va`) and its index (`index_bytes` of host
    /// memory, zeroed); later grants get the same pool, whatever they ask.
    KvPool {
        size: u64,
        index_bytes: u64,
        va: u64,
    },
}

impl Request {
    pub fn op(&self) -> &'static str {
        match self {
            Request::Hello { .. } => "hello",
            Request::Status => "status",
            Request::Allocate { .. } => "allocate",
            Request::Free { .. } => "free",
            Request::PutMeta { .. } => "put_meta",
            Request::GetMeta { .. } => "get_meta",
            Request::Commit => "commit",
            Request::GetLayout => "get_layout",
            Request::Export { .. } => "export",
            Request::Reset => "reset",
            Request::KvPool { .. } => "kv_pool",
        }
    }

    /// Memory flows from the daemon to engines only; the one descriptor a
    /// request carries is `kv_pool`'s proof: the descriptor through which
    /// the peer (or its lock holder) holds the pair's election lock.
    pub fn fd_count(&self) -> usize {
        match self {
            Request::KvPool { .. } => 1,
            _ => 0,
        }
    }
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Response {
    Welcome {
        lease: LeaseKind,
        lease_id: u64,
        backend: String,
        device: String,
        granularity: u64,
        committed: bool,
    },
    /// Carries one fd: the allocation, read-write.
    Allocated {
        id: u64,
        size: u64,
    },
    Freed {
        id: u64,
    },
    MetaStored {
        key: String,
    },
    Meta {
        key: String,
        value: Option<String>,
    },
    Committed {
        generation: u64,
        allocations: usize,
        bytes: u64,
    },
    Layout {
        layout: Layout,
    },
    /// Carries `ids.len()` fds, in the order of `ids`.
    Exported {
        ids: Vec<u64>,
    },
    Status {
        status: Box<StatusReport>,
    },
    /// `reset` done: the committed layout of `generation` (0: none) is gone.
    ResetDone {
        generation: u64,
    },
    /// The KV pool's write lease. Carries the pool's memory, one fd per
    /// allocation it is made of ([`kv_chunks`]: `chunk` bytes each, the
    /// last one shorter; read-write, mapped one after another from `va`
    /// on), then its index (a memfd of `index_bytes`, read-write) and the
    /// fence (an eventfd, readable once every engine that held this lease
    /// before is gone, so no write of theirs can land any more; readable
    /// at once when there was none). `pool` names this pool for its whole
    /// life (a new pool, after a reset or in a new gmsd, has a new one);
    /// `created`: made by this grant, so nothing is in it.
    KvGranted {
        pool: u64,
        size: u64,
        index_bytes: u64,
        va: u64,
        created: bool,
        fenced: bool,
        /// 0 (a gmsd that made pools of one allocation): one allocation.
        #[serde(default)]
        chunk: u64,
    },
    /// Always the last message on a connection: the daemon closes it next.
    Error {
        code: ErrorCode,
        message: String,
    },
}

impl Response {
    pub fn op(&self) -> &'static str {
        match self {
            Response::Welcome { .. } => "welcome",
            Response::Allocated { .. } => "allocated",
            Response::Freed { .. } => "freed",
            Response::MetaStored { .. } => "meta_stored",
            Response::Meta { .. } => "meta",
            Response::Committed { .. } => "committed",
            Response::Layout { .. } => "layout",
            Response::Exported { .. } => "exported",
            Response::Status { .. } => "status",
            Response::ResetDone { .. } => "reset_done",
            Response::KvGranted { .. } => "kv_granted",
            Response::Error { .. } => "error",
        }
    }

    pub fn fd_count(&self) -> usize {
        match self {
            Response::Allocated { .. } => 1,
            Response::Exported { ids } => ids.len(),
            Response::KvGranted { size, chunk, .. } => kv_chunks(*size, *chunk).saturating_add(2),
            _ => 0,
        }
    }

    pub fn error(err: &Error) -> Self {
        Response::Error {
            code: err.code(),
            message: err.to_string(),
        }
    }
}

#[derive(Serialize)]
struct Envelope<'a, T> {
    version: u32,
    #[serde(flatten)]
    body: &'a T,
}

fn encode<T: Serialize>(body: &T) -> Result<Vec<u8>> {
    serde_json::to_vec(&Envelope {
        version: VERSION,
        body,
    })
    .map_err(|e| Error::Malformed(format!("cannot encode message: {e}")))
}

pub fn encode_request(req: &Request) -> Result<Vec<u8>> {
    encode(req)
}

pub fn encode_response(resp: &Response) -> Result<Vec<u8>> {
    encode(resp)
}

/// Checks size, JSON and version, and returns the body without `version`.
fn open_envelope(bytes: &[u8], limit: usize) -> Result<serde_json::Value> {
    if bytes.len() > limit {
        return Err(Error::TooLarge {
            size: bytes.len(),
            limit,
        });
    }
    let mut value: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|e| Error::NotJson(e.to_string()))?;
    let object = value
        .as_object_mut()
        .ok_or_else(|| Error::Malformed("a message must be a JSON object".into()))?;
    match object.remove("version") {
        Some(serde_json::Value::Number(n)) if n.as_u64() == Some(u64::from(VERSION)) => {}
        Some(other) => {
            return Err(Error::UnsupportedVersion {
                got: other.to_string(),
                supported: VERSION,
            })
        }
        None => return Err(Error::Malformed("missing field 'version'".into())),
    }
    Ok(value)
}

/// Decodes one request body that arrived with `fd_count` descriptors.
pub fn decode(bytes: &[u8], fd_count: usize) -> Result<Request> {
    let body = open_envelope(bytes, MAX_REQUEST_BYTES)?;
    let req: Request = serde_json::from_value(body).map_err(|e| Error::Malformed(e.to_string()))?;
    if fd_count != req.fd_count() {
        return Err(Error::WrongFdCount {
            op: req.op().into(),
            got: fd_count,
            want: req.fd_count(),
        });
    }
    validate(&req)?;
    Ok(req)
}

/// Shape rules that JSON types cannot express; limits that depend on the
/// daemon's configuration are checked there.
fn validate(req: &Request) -> Result<()> {
    match req {
        Request::Hello { client, .. } if client.len() > 256 => {
            Err(Error::Invalid("client name longer than 256 bytes".into()))
        }
        Request::Allocate { tag, .. } if !valid_tag(tag) => Err(Error::Invalid(format!(
            "tag {tag:?}: 1-64 characters of [A-Za-z0-9_.-]"
        ))),
        Request::Allocate { size: 0, .. } => Err(Error::Invalid("allocation of 0 bytes".into())),
        Request::KvPool { size: 0, .. } => Err(Error::Invalid("a KV pool of 0 bytes".into())),
        Request::KvPool { index_bytes, .. }
            if *index_bytes == 0 || *index_bytes > MAX_KV_INDEX_BYTES =>
        {
            Err(Error::Invalid(format!(
                "a KV index of {index_bytes} bytes: between 1 and {MAX_KV_INDEX_BYTES}"
            )))
        }
        Request::Export { ids } if ids.is_empty() || ids.len() > MAX_FDS_PER_MESSAGE => {
            Err(Error::Invalid(format!(
                "export of {} allocations: between 1 and {MAX_FDS_PER_MESSAGE} per message",
                ids.len()
            )))
        }
        _ => Ok(()),
    }
}

/// The allocations a KV pool of `size` bytes is made of, `chunk` bytes
/// each, the last one shorter (one when `chunk` is 0 or covers it all).
pub fn kv_chunks(size: u64, chunk: u64) -> usize {
    if chunk == 0 || chunk >= size {
        1
    } else {
        usize::try_from(size.div_ceil(chunk)).unwrap_or(usize::MAX)
    }
}

/// The most allocations a KV pool is made of: its grant carries one
/// descriptor for each, and its index's and its fence's.
pub const MAX_KV_CHUNKS: usize = MAX_FDS_PER_MESSAGE - 2;

pub fn valid_tag(tag: &str) -> bool {
    !tag.is_empty()
        && tag.len() <= 64
        && tag
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.')
}

/// Decodes one response body that arrived with `fd_count` descriptors.
pub fn decode_response(bytes: &[u8], fd_count: usize) -> Result<Response> {
    let body = open_envelope(bytes, MAX_RESPONSE_BYTES)?;
    let resp: Response =
        serde_json::from_value(body).map_err(|e| Error::Malformed(e.to_string()))?;
    if fd_count != resp.fd_count() {
        return Err(Error::WrongFdCount {
            op: resp.op().into(),
            got: fd_count,
            want: resp.fd_count(),
        });
    }
    Ok(resp)
}

/// Valid requests of every kind: the fuzzer's seed corpus and round-trip tests.
pub fn sample_requests() -> Vec<Request> {
    vec![
        Request::Hello {
            mode: Mode::RwOrRo,
            client: "engine-0".into(),
        },
        Request::Hello {
            mode: Mode::Ro,
            client: String::new(),
        },
        Request::Status,
        Request::Allocate {
            tag: "weights".into(),
            size: 1 << 21,
            va: 0x7f00_0000_0000,
        },
        Request::Free { id: 3 },
        Request::PutMeta {
            key: "layer.0.w".into(),
            value: r#"{"alloc":1,"offset":0,"shape":[4096,4096],"dtype":"bf16"}"#.into(),
        },
        Request::GetMeta { key: "k".into() },
        Request::Commit,
        Request::GetLayout,
        Request::Export { ids: vec![1, 2, 3] },
        Request::Reset,
        Request::KvPool {
            size: 1 << 30,
            index_bytes: 1 << 20,
            va: 0x7e00_0000_0000,
        },
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kv_grant_carries_one_descriptor_per_allocation() {
        assert_eq!(kv_chunks(10, 3), 4);
        assert_eq!(kv_chunks(9, 3), 3);
        assert_eq!(kv_chunks(10, 0), 1);
        assert_eq!(kv_chunks(10, 10), 1);
        assert_eq!(kv_chunks(10, 64), 1);
        // A gmsd that made pools of one allocation sends no `chunk`.
        let old = br#"{"version":1,"op":"kv_granted","pool":1,"size":8,"index_bytes":4,"va":4096,"created":true,"fenced":true}"#;
        let resp = decode_response(old, 3).unwrap();
        assert_eq!(resp.fd_count(), 3);
        let chunked = br#"{"version":1,"op":"kv_granted","pool":1,"size":8,"index_bytes":4,"va":4096,"created":true,"fenced":true,"chunk":2}"#;
        assert_eq!(decode_response(chunked, 6).unwrap().fd_count(), 6);
        assert!(
            decode_response(chunked, 3).is_err(),
            "fewer descriptors than allocations"
        );
    }

    #[test]
    fn every_request_round_trips() {
        for req in sample_requests() {
            let bytes = encode_request(&req).unwrap();
            assert_eq!(
                decode(&bytes, req.fd_count()).unwrap(),
                req,
                "{}",
                String::from_utf8_lossy(&bytes)
            );
        }
    }

    #[test]
    fn wire_shape_is_the_documented_one() {
        let bytes = encode_request(&Request::Hello {
            mode: Mode::RwOrRo,
            client: "e".into(),
        })
        .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(v["version"], 1);
        assert_eq!(v["op"], "hello");
        assert_eq!(v["mode"], "rw_or_ro");
    }

    #[test]
    fn bad_input_gets_the_right_error() {
        let code = |b: &[u8], fds| decode(b, fds).unwrap_err().code();
        assert_eq!(
            code(b"{\"version\":1,\"op\":\"comm", 0),
            ErrorCode::BadMessage
        );
        assert_eq!(code(b"\xff\xfe", 0), ErrorCode::BadMessage);
        assert_eq!(code(b"[1,2]", 0), ErrorCode::BadMessage);
        assert_eq!(code(br#"{"op":"commit"}"#, 0), ErrorCode::BadMessage);
        assert_eq!(
            code(br#"{"version":2,"op":"commit"}"#, 0),
            ErrorCode::UnsupportedVersion
        );
        assert_eq!(
            code(br#"{"version":"1","op":"commit"}"#, 0),
            ErrorCode::UnsupportedVersion
        );
        assert_eq!(
            code(br#"{"version":1,"op":"commit"}"#, 2),
            ErrorCode::WrongFdCount
        );
        assert_eq!(
            code(br#"{"version":1,"op":"launch"}"#, 0),
            ErrorCode::BadMessage
        );
        assert_eq!(
            code(br#"{"version":1,"op":"free","id":1,"extra":0}"#, 0),
            ErrorCode::BadMessage
        );
        assert_eq!(
            code(
                br#"{"version":1,"op":"allocate","tag":"a b","size":1,"va":4096}"#,
                0
            ),
            ErrorCode::Invalid
        );
        assert_eq!(
            code(
                br#"{"version":1,"op":"allocate","tag":"w","size":0,"va":4096}"#,
                0
            ),
            ErrorCode::Invalid
        );
        assert_eq!(
            code(br#"{"version":1,"op":"export","ids":[]}"#, 0),
            ErrorCode::Invalid
        );
        assert_eq!(
            code(
                br#"{"version":1,"op":"kv_pool","size":0,"index_bytes":1,"va":0}"#,
                1
            ),
            ErrorCode::Invalid
        );
        assert_eq!(
            code(
                br#"{"version":1,"op":"kv_pool","size":4096,"index_bytes":1099511627776,"va":0}"#,
                1
            ),
            ErrorCode::Invalid
        );
        let big = vec![b' '; MAX_REQUEST_BYTES + 1];
        assert_eq!(code(&big, 0), ErrorCode::TooLarge);
    }

    #[test]
    fn responses_check_their_descriptor_count() {
        let bytes = encode_response(&Response::Allocated { id: 1, size: 4096 }).unwrap();
        assert!(decode_response(&bytes, 1).is_ok());
        assert_eq!(
            decode_response(&bytes, 0).unwrap_err().code(),
            ErrorCode::WrongFdCount
        );
    }
}
