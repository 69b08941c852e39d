//! Answering: one request, one response, on a connection; with the pair's
//! fd store every step of the answer is recorded before its bytes are
//! written, and an answer the engine before this one recorded is gone on
//! with from the byte its socket got to. The HTTP routes are here too.

use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::time::Duration;

use serde_json::{json, Value};
use shadow_engine::model::{Decoder, Model};
use shadow_engine::openai::{self, StreamHead};
use shadow_engine::promotion::Part;

use crate::conn::{self, Conn};
use crate::continuity::{Link, Progress as Phase, Work};
use crate::live::Live;
use crate::worker::{Ctx, Kv, Resumed};

/// Largest request head + body the server reads.
const MAX_REQUEST: usize = 64 << 10;
/// Most tokens one completion may ask for.
pub const MAX_TOKENS: usize = 256;
/// How long a streamed answer waits for its client to take an event.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// What [`route`] answers.
enum Reply<'a> {
    /// A whole JSON answer.
    Json(u16, Value),
    /// A completion to stream (`"stream": true`), accepted and its state
    /// already in the KV cache: [`stream`] writes it as it decodes.
    Stream {
        head: StreamHead,
        prompt: String,
        decoder: Decoder<'a>,
        max_tokens: usize,
    },
}

/// One request, one response, connection closed. With a link to the store
/// the request is read with `MSG_PEEK` and taken off the socket only once
/// its answer is recorded (a plain answer's bytes, a stream's head and
/// prompt), and every step of the answer is recorded before its bytes are
/// written; without one, as without a store.
pub fn answer(mut conn: Conn, mut link: Link, ctx: &Ctx<'_>, worker: usize) {
    let Some(kv) = ctx.kv.get() else {
        return link.drop_entry(); // no job comes before the wake
    };
    let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
    let on = |method: &str, path: &str, body: &[u8]| {
        ctx.live.computing(worker, |step| {
            route(method, path, body, ctx.model, ctx.bytes, kv, ctx.info, step)
        })
    };
    let bad = |reason: String| Reply::Json(400, json!({ "error": reason }));
    let reply = if link.tracked() {
        let (reply, request_len, whole) = match conn::peek_request(&conn, MAX_REQUEST) {
            Ok(req) => {
                ctx.promoted.mark(Part::Read);
                (on(&req.method, &req.path, &req.body), req.len, true)
            }
            Err(e) => (bad(e.reason), e.peeked, false),
        };
        let reply = Ready::from(reply);
        let work = match &reply {
            Plain(bytes) => Work::Plain(bytes.clone()),
            Streamed(head, prompt, _, max_tokens) => Work::Stream {
                head: head.clone(),
                prompt: prompt.clone(),
                max_tokens: *max_tokens,
            },
        };
        link.record(request_len as u64, &work);
        // Recorded: now the request may leave the socket.
        if whole {
            let _ = conn.consume(request_len);
        } else {
            conn.drain(request_len);
        }
        reply
    } else {
        match read_request(&mut conn) {
            Ok((method, path, body)) => {
                ctx.promoted.mark(Part::Read);
                Ready::from(on(&method, &path, &body))
            }
            Err(reason) => Plain(openai::json_response(400, &json!({ "error": reason }))),
        }
    };
    match reply {
        Plain(bytes) => {
            link.note(Phase::Answering(0));
            if conn.write_all(&bytes).is_ok() {
                ctx.promoted.mark(Part::Answered);
            }
        }
        Streamed(head, _, decoder, max_tokens) => {
            link.note(Phase::Answering(0));
            stream(
                &mut conn,
                &mut link,
                &head,
                decoder,
                max_tokens,
                openai::STREAM_HEAD,
                ctx.live,
                worker,
            );
            ctx.promoted.mark(Part::Answered);
        }
    }
    link.finish(conn.as_fd());
}

/// An answer ready to write.
enum Ready<'a> {
    /// Its bytes, whole.
    Plain(Vec<u8>),
    /// A stream's head, prompt, decoder (after the prefill) and length.
    Streamed(StreamHead, String, Decoder<'a>, usize),
}

impl<'a> From<Reply<'a>> for Ready<'a> {
    /// A route's reply as it is sent: a JSON answer as its bytes.
    fn from(reply: Reply<'a>) -> Ready<'a> {
        match reply {
            Reply::Json(status, body) => Ready::Plain(openai::json_response(status, &body)),
            Reply::Stream {
                head,
                prompt,
                decoder,
                max_tokens,
            } => Ready::Streamed(head, prompt, decoder, max_tokens),
        }
    }
}
use Ready::{Plain, Streamed};

/// Goes on with an answer the engine before this one recorded: what the
/// socket did not get of it yet (the kernel's count of the bytes written
/// says where that starts), then for a stream the tokens still to decode,
/// recorded as they go, as [`answer`] does. The prompt and the tokens
/// already sent are computed again (the KV cache died with that engine),
/// step by step under the watchdog. A count beyond what was recorded (a
/// state that lags the socket) is not gone on with: closed.
pub fn go_on(r: Resumed, ctx: &Ctx<'_>, worker: usize) {
    let Resumed {
        mut conn,
        mut link,
        work,
        progress,
        written,
    } = r;
    let written = usize::try_from(written).unwrap_or(usize::MAX);
    let _ = conn.set_write_timeout(Some(WRITE_TIMEOUT));
    let beyond = |name: &str, len: usize| {
        eprintln!(
            "shadow-engine: resuming {name}: {written} bytes written, more than the {len} recorded: closed"
        );
    };
    if progress == Phase::Recorded {
        link.note(Phase::Answering(0));
    }
    match work {
        Work::Plain(bytes) => {
            let Some(rest) = bytes.get(written..) else {
                beyond("a plain answer", bytes.len());
                link.drop_entry();
                return;
            };
            let _ = ctx.live.waiting(worker, || conn.write_all(rest));
        }
        Work::Stream {
            head,
            prompt,
            max_tokens,
        } => {
            let (n, finishing) = match progress {
                Phase::Answering(n) => (n, false),
                Phase::Finishing(n) => (n, true),
                _ => (0, false),
            };
            let n = usize::try_from(n).unwrap_or(usize::MAX);
            if max_tokens > MAX_TOKENS || n > max_tokens {
                eprintln!("shadow-engine: resuming a stream at {n} of {max_tokens} tokens: closed");
                link.drop_entry();
                return;
            }
            let decoder = ctx.live.computing(worker, |step| {
                ctx.model.resume_with(ctx.bytes, &prompt, n, step)
            });
            // The sequence's state back in the KV cache, as at its start.
            if let Some(kv) = ctx.kv.get() {
                let _ = kv.write(prompt.as_bytes());
            }
            let sent = openai::stream_bytes(&head, decoder.generated(), finishing);
            let Some(rest) = sent.get(written..) else {
                beyond("a stream", sent.len());
                link.drop_entry();
                return;
            };
            if finishing {
                let _ = ctx.live.waiting(worker, || conn.write_all(rest));
            } else {
                stream(
                    &mut conn, &mut link, &head, decoder, max_tokens, rest, ctx.live, worker,
                );
            }
        }
    }
    link.finish(conn.as_fd());
}

/// Streams a completion: `first` (the response head, or what a resumed
/// stream still owes of the events so far), then each token's event with
/// a write of its own as soon as it is decoded, then the final event and
/// `[DONE]`, as [`openai::stream_bytes`] says; the close ends the body.
/// Each event's count is recorded before its bytes are written, so the
/// bytes in the socket never go beyond what the state says. Decode steps
/// feed the watchdog; the writes are waits on the client. A client gone
/// (or not reading for [`WRITE_TIMEOUT`]) ends the stream.
#[allow(clippy::too_many_arguments)]
fn stream(
    conn: &mut Conn,
    link: &mut Link,
    head: &StreamHead,
    mut decoder: Decoder<'_>,
    max_tokens: usize,
    first: &[u8],
    live: &Live,
    worker: usize,
) {
    conn.set_nodelay();
    let _ = conn.set_write_timeout(Some(WRITE_TIMEOUT));
    let mut send = |bytes: &[u8]| live.waiting(worker, || conn.write_all(bytes)).is_ok();
    if !send(first) {
        return;
    }
    live.computing(worker, |step| {
        while decoder.tokens() < max_tokens {
            let index = decoder.tokens();
            let token = decoder.next_token();
            step();
            link.note(Phase::Answering(index as u64 + 1));
            if !send(&openai::token_event(head, index, token)) {
                return;
            }
        }
        link.note(Phase::Finishing(decoder.tokens() as u64));
        if send(&openai::final_event(head, decoder.tokens())) {
            send(openai::DONE_EVENT);
        }
    });
}

/// Reads a whole request off the socket (a connection the store does not
/// hold).
fn read_request(conn: &mut Conn) -> std::result::Result<(String, String, Vec<u8>), String> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 4096];
    loop {
        let n = conn.read(&mut chunk).map_err(|e| format!("read: {e}"))?;
        if n == 0 {
            return Err("connection closed before a full request".into());
        }
        buf.extend_from_slice(&chunk[..n]);
        if buf.len() > MAX_REQUEST {
            return Err(format!("request larger than {MAX_REQUEST} bytes"));
        }
        let Some(head) = conn::parse_head(&buf)? else {
            continue;
        };
        let total = head.head_len + head.body_len;
        if total > MAX_REQUEST {
            return Err(format!("request larger than {MAX_REQUEST} bytes"));
        }
        while buf.len() < total {
            let n = conn
                .read(&mut chunk)
                .map_err(|e| format!("read body: {e}"))?;
            if n == 0 {
                return Err("connection closed inside the body".into());
            }
            buf.extend_from_slice(&chunk[..n]);
        }
        return Ok((head.method, head.path, buf[head.head_len..total].to_vec()));
    }
}

#[allow(clippy::too_many_arguments)]
fn route<'a>(
    method: &str,
    path: &str,
    body: &[u8],
    model: &'a Model,
    bytes: &'a [u8],
    kv: &Kv,
    info: &Value,
    step: &mut dyn FnMut(),
) -> Reply<'a> {
    let error = |status: u16, reason: String| Reply::Json(status, json!({ "error": reason }));
    match (method, path) {
        ("GET", "/health") => Reply::Json(200, json!({ "status": "ok", "engine": info })),
        ("POST", "/v1/completions") => {
            let req: Value = match serde_json::from_slice(body) {
                Ok(v) => v,
                Err(e) => return error(400, format!("body is not JSON: {e}")),
            };
            let Some(prompt) = req["prompt"].as_str() else {
                return error(400, "\"prompt\" (a string) is required".into());
            };
            let max_tokens = req["max_tokens"].as_u64().unwrap_or(16) as usize;
            if max_tokens > MAX_TOKENS {
                return error(400, format!("max_tokens is at most {MAX_TOKENS}"));
            }
            // Absent or null (OpenAI's default): one JSON answer.
            let streamed = match &req["stream"] {
                Value::Null => false,
                Value::Bool(b) => *b,
                _ => return error(400, "\"stream\" is a boolean".into()),
            };
            // Accepted: the id and time the answer carries, chosen once.
            let head = StreamHead::new(prompt.len());
            if streamed {
                let decoder = model.start(bytes, prompt);
                // The prefill's state goes to the KV cache before the
                // response head, so that no room is still a plain 503.
                if let Err(e) = kv.write(prompt.as_bytes()) {
                    return error(503, e);
                }
                return Reply::Stream {
                    head,
                    prompt: prompt.to_owned(),
                    decoder,
                    max_tokens,
                };
            }
            let c = model.complete_with(bytes, prompt, max_tokens, step);
            // The KV cache holds the sequence's state; a real engine keeps
            // pages per sequence, here one page is rewritten per request.
            if let Err(e) = kv.write(c.text.as_bytes()) {
                return error(503, e);
            }
            Reply::Json(200, openai::completion_body(&head, &c, info))
        }
        _ => error(404, format!("no route {method} {path}")),
    }
}
