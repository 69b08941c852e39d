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
use crate::paged::{self, Seq};
use crate::worker::{Ctx, Resumed};

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
    /// A completion to stream (`"stream": true`), accepted and prefilled:
    /// [`stream`] writes it as it decodes.
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
    let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
    let on = |method: &str, path: &str, body: &[u8]| {
        ctx.live.computing(worker, |step| {
            route(method, path, body, ctx.model, ctx.bytes, ctx.info, step)
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
            // Its KV in the pool, under its name in the store (a name of
            // its own when it has none: nobody goes on with it); right
            // after a promotion the pool may still be on its way from gmsd.
            let key = link.name().map_or_else(paged::private_key, paged::key_of);
            let kv = ctx.live.waiting(worker, || ctx.kv.take());
            ctx.promoted.mark(Part::Kv);
            let mut seq = kv.map(|p| p.begin(key));
            stream(
                &mut conn,
                &mut link,
                &head,
                decoder,
                seq.as_mut(),
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
/// recorded as they go, as [`answer`] does. A stream goes on from its
/// last sent token's entry in the pair's KV pool, with nothing computed
/// again, when the pool has it (`paged`); else the prompt and the tokens
/// already sent are computed again, step by step under the watchdog, and
/// a line says why. A count beyond what was recorded (a state that lags
/// the socket) is not gone on with: closed.
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
            let pool = ctx.live.waiting(worker, || ctx.kv.take());
            ctx.promoted.mark(Part::Kv);
            let name = link.name().unwrap_or("-").to_owned();
            let (mut seq, decoder) = match pool {
                Some(p) => {
                    let (seq, decoder, why) = ctx.live.computing(worker, |step| {
                        p.resume(paged::key_of(&name), n, ctx.model, ctx.bytes, &prompt, step)
                    });
                    let (from_pool, again) = match &why {
                        Some(_) => (0, n),
                        None => (n, 0),
                    };
                    println!(
                        "shadow-engine: KV of {name} at token {n}: {from_pool} tokens from the pool, {again} computed again{}",
                        why.map_or(String::new(), |w| format!(" ({w})"))
                    );
                    (Some(seq), decoder)
                }
                None => {
                    let decoder = ctx.live.computing(worker, |step| {
                        ctx.model.resume_with(ctx.bytes, &prompt, n, step)
                    });
                    println!(
                        "shadow-engine: KV of {name} at token {n}: 0 tokens from the pool, {n} computed again (this engine has no KV pool)"
                    );
                    (None, decoder)
                }
            };
            let _ = std::io::stdout().flush();
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
                    &mut conn,
                    &mut link,
                    &head,
                    decoder,
                    seq.as_mut(),
                    max_tokens,
                    rest,
                    ctx.live,
                    worker,
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
/// Each token's KV entry goes to the pool (`seq`) and then its event's
/// count is recorded, before its bytes are written: the bytes in the
/// socket never go beyond what the state says, nor the state beyond the
/// pool. Decode steps
/// feed the watchdog; the writes are waits on the client. A client gone
/// (or not reading for [`WRITE_TIMEOUT`]) ends the stream.
#[allow(clippy::too_many_arguments)]
fn stream(
    conn: &mut Conn,
    link: &mut Link,
    head: &StreamHead,
    mut decoder: Decoder<'_>,
    mut seq: Option<&mut Seq<'_>>,
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
            if let Some(seq) = seq.as_deref_mut() {
                seq.put(index, &decoder);
            }
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
                return Reply::Stream {
                    head,
                    prompt: prompt.to_owned(),
                    decoder,
                    max_tokens,
                };
            }
            let c = model.complete_with(bytes, prompt, max_tokens, step);
            Reply::Json(200, openai::completion_body(&head, &c, info))
        }
        _ => error(404, format!("no route {method} {path}")),
    }
}
