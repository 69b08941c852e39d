//! The HTTP answers of `POST /v1/completions` in the shape of OpenAI's
//! completions API, as pure encoders: bytes out of values, no sockets.
//!
//! A streamed answer (`"stream": true`) is a server-sent event per token
//! and nothing else that differs between two engines: its bytes are a pure
//! function of a [`StreamHead`] (chosen once, when the request is accepted)
//! and the tokens, see [`stream_bytes`]. Two processes given the same head
//! and tokens write the same bytes, so a response can be taken up at any
//! byte offset by another process that knows the head, the prompt and how
//! many tokens were sent (the model recomputes them: `Model::resume`).
//!
//! The response head of a stream ([`STREAM_HEAD`]) is a constant: no
//! `Content-Length` and no chunked encoding, the body ends when the
//! connection closes. Each event is one `data: <json>\n\n`; the texts of
//! the token events concatenate to the non-streamed text (every token but
//! the first has a leading space); then a last event with an empty text,
//! `"finish_reason":"length"` and the usage, then `data: [DONE]\n\n`.

use std::borrow::Cow;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

use crate::model::{splitmix, Completion};

/// The `model` every answer names.
pub const MODEL: &str = "shadow-reference";

/// The status line and headers of every streamed answer, the same bytes
/// from every engine.
pub const STREAM_HEAD: &[u8] = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\nConnection: close\r\n\r\n";

/// The event that ends a stream.
pub const DONE_EVENT: &[u8] = b"data: [DONE]\n\n";

/// What a streamed answer says besides its tokens: given once, when the
/// request is accepted, and the same for any process that goes on with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamHead {
    /// `cmpl-` and 16 hex digits.
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    pub model: String,
    /// The prompt's length in tokens (the model embeds bytes: its bytes).
    pub prompt_tokens: usize,
}

impl StreamHead {
    /// The head of a request accepted now: a fresh id, this second,
    /// [`MODEL`].
    pub fn new(prompt_tokens: usize) -> StreamHead {
        let created = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs();
        StreamHead {
            id: new_id(),
            created,
            model: MODEL.to_owned(),
            prompt_tokens,
        }
    }

    /// The `usage` object of an answer of `completion_tokens`.
    pub fn usage(&self, completion_tokens: usize) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        })
    }
}

/// A new completion id, `cmpl-` and 16 hex digits: the time, the process
/// and a counter, mixed, so that two requests (of one engine or of two)
/// practically never share one.
pub fn new_id() -> String {
    static COUNT: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos() as u64;
    let n = COUNT.fetch_add(1, Ordering::Relaxed);
    let pid = u64::from(std::process::id());
    let x = splitmix(splitmix(nanos ^ pid.rotate_left(40)) ^ n);
    format!("cmpl-{x:016x}")
}

/// The text a stream sends for token `index` (from 0): a leading space for
/// every token but the first, so that the texts concatenate to the
/// tokens joined by spaces, the non-streamed text.
pub fn token_text(index: usize, token: &str) -> Cow<'_, str> {
    if index == 0 {
        Cow::Borrowed(token)
    } else {
        Cow::Owned(format!(" {token}"))
    }
}

/// A JSON string, quoted and escaped (serde_json's escaping: the same
/// bytes for the same string in every build).
fn quoted(s: &str) -> String {
    Value::String(s.to_owned()).to_string()
}

/// One event of a stream: its choice's `text` and `finish_reason` (JSON),
/// then what follows the choices (`,"usage":…` or nothing). The keys in the
/// order OpenAI writes them, written out rather than left to a map.
fn event(head: &StreamHead, text: &str, finish: &str, tail: &str) -> Vec<u8> {
    format!(
        "data: {{\"id\":{},\"object\":\"text_completion\",\"created\":{},\"model\":{},\"choices\":[{{\"index\":0,\"text\":{},\"logprobs\":null,\"finish_reason\":{finish}}}]{tail}}}\n\n",
        quoted(&head.id),
        head.created,
        quoted(&head.model),
        quoted(text),
    )
    .into_bytes()
}

/// The event of token `index` (from 0) of a stream.
pub fn token_event(head: &StreamHead, index: usize, token: &str) -> Vec<u8> {
    event(head, &token_text(index, token), "null", "")
}

/// The last event with a choice, once `completion_tokens` were sent: an
/// empty text, `"finish_reason":"length"`, the usage. [`DONE_EVENT`]
/// follows it.
pub fn final_event(head: &StreamHead, completion_tokens: usize) -> Vec<u8> {
    let usage = format!(
        ",\"usage\":{{\"prompt_tokens\":{},\"completion_tokens\":{completion_tokens},\"total_tokens\":{}}}",
        head.prompt_tokens,
        head.prompt_tokens + completion_tokens,
    );
    event(head, "", "\"length\"", &usage)
}

/// The bytes of a streamed answer from its status line on, once `tokens`
/// were decoded: [`STREAM_HEAD`], one [`token_event`] per token, and when
/// `done` the [`final_event`] and [`DONE_EVENT`]. Pure: the same inputs
/// give the same bytes, and the bytes of fewer tokens (not done) are a
/// prefix of those of more, so an offset into a response names a point of
/// this sequence.
pub fn stream_bytes(head: &StreamHead, tokens: &[&str], done: bool) -> Vec<u8> {
    let mut out = STREAM_HEAD.to_vec();
    for (i, t) in tokens.iter().enumerate() {
        out.extend_from_slice(&token_event(head, i, t));
    }
    if done {
        out.extend_from_slice(&final_event(head, tokens.len()));
        out.extend_from_slice(DONE_EVENT);
    }
    out
}

/// The body of a non-streamed answer: OpenAI's `text_completion`, plus
/// this engine's `fingerprint` and `engine` (which slot answered).
pub fn completion_body(head: &StreamHead, c: &Completion, engine: &Value) -> Value {
    json!({
        "id": head.id,
        "object": "text_completion",
        "created": head.created,
        "model": head.model,
        "choices": [{
            "index": 0,
            "text": c.text,
            "logprobs": null,
            "finish_reason": "length",
        }],
        "usage": head.usage(c.tokens),
        "fingerprint": c.fingerprint,
        "engine": engine,
    })
}

/// The reason phrase of the statuses the engine answers.
pub fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        404 => "Not Found",
        503 => "Service Unavailable",
        _ => "Bad Request",
    }
}

/// A whole JSON answer: status line, headers (`Content-Length`,
/// `Connection: close`), body.
pub fn json_response(status: u16, body: &Value) -> Vec<u8> {
    let text = body.to_string();
    format!(
        "HTTP/1.1 {status} {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{text}",
        reason(status),
        text.len()
    )
    .into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head() -> StreamHead {
        StreamHead {
            id: "cmpl-00112233aabbccdd".into(),
            created: 1_700_000_000,
            model: MODEL.into(),
            prompt_tokens: 5,
        }
    }

    const WORDS: [&str; 4] = ["amber", "basalt", "cobalt", "delta"];

    /// The events of a stream's body (after [`STREAM_HEAD`]): the payload
    /// of each `data: ` line, checking the framing on the way.
    fn events(bytes: &[u8]) -> Vec<String> {
        let body = bytes.strip_prefix(STREAM_HEAD).expect("the stream head");
        let body = std::str::from_utf8(body).expect("UTF-8");
        assert!(body.is_empty() || body.ends_with("\n\n"), "{body:?}");
        body.split_terminator("\n\n")
            .map(|e| {
                assert!(!e.contains('\n'), "one line per event: {e:?}");
                e.strip_prefix("data: ").expect("a data line").to_owned()
            })
            .collect()
    }

    #[test]
    fn the_same_head_and_tokens_give_the_same_bytes() {
        for done in [false, true] {
            for n in 0..=WORDS.len() {
                let a = stream_bytes(&head(), &WORDS[..n], done);
                assert_eq!(a, stream_bytes(&head().clone(), &WORDS[..n], done));
            }
        }
        let mut other = head();
        other.id = "cmpl-0000000000000001".into();
        assert_ne!(
            stream_bytes(&head(), &WORDS, true),
            stream_bytes(&other, &WORDS, true)
        );
        // The event-by-event encoders are the same bytes.
        let mut by_event = STREAM_HEAD.to_vec();
        for (i, w) in WORDS.iter().enumerate() {
            by_event.extend(token_event(&head(), i, w));
        }
        by_event.extend(final_event(&head(), WORDS.len()));
        by_event.extend(DONE_EVENT);
        assert_eq!(by_event, stream_bytes(&head(), &WORDS, true));
    }

    #[test]
    fn fewer_tokens_are_a_prefix_of_more() {
        let whole = stream_bytes(&head(), &WORDS, true);
        for n in 0..=WORDS.len() {
            let part = stream_bytes(&head(), &WORDS[..n], false);
            assert!(whole.starts_with(&part), "{n} tokens");
        }
        assert!(stream_bytes(&head(), &[], false) == STREAM_HEAD);
    }

    #[test]
    fn every_event_is_json_and_the_texts_concatenate_to_the_answer() {
        let bytes = stream_bytes(&head(), &WORDS, true);
        let ev = events(&bytes);
        assert_eq!(ev.len(), WORDS.len() + 2);
        assert_eq!(ev[ev.len() - 1], "[DONE]");
        let parsed: Vec<Value> = ev[..ev.len() - 1]
            .iter()
            .map(|e| serde_json::from_str(e).expect("JSON"))
            .collect();
        let mut text = String::new();
        for (i, v) in parsed.iter().enumerate() {
            assert_eq!(v["id"], "cmpl-00112233aabbccdd");
            assert_eq!(v["object"], "text_completion");
            assert_eq!(v["created"], 1_700_000_000);
            assert_eq!(v["model"], MODEL);
            assert_eq!(v["choices"].as_array().map(Vec::len), Some(1));
            let c = &v["choices"][0];
            assert_eq!(c["index"], 0);
            assert!(c["logprobs"].is_null());
            if i < WORDS.len() {
                assert!(c["finish_reason"].is_null(), "event {i}");
                assert!(v.get("usage").is_none(), "event {i}");
            }
            text.push_str(c["text"].as_str().expect("a text"));
        }
        assert_eq!(text, WORDS.join(" "));
        let last = &parsed[WORDS.len()];
        assert_eq!(last["choices"][0]["text"], "");
        assert_eq!(last["choices"][0]["finish_reason"], "length");
        assert_eq!(
            last["usage"],
            json!({ "prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9 })
        );
        assert_eq!(last["usage"], head().usage(4));
    }

    #[test]
    fn a_streamed_generation_is_the_plain_answer() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("m.safetensors");
        crate::model::generate(&p, 2, 9).unwrap();
        let bytes = std::fs::read(&p).unwrap();
        let m = crate::model::Model::build(&bytes, &p).unwrap();
        let plain = m.complete(&bytes, "stream this", 10);
        let mut dec = m.start(&bytes, "stream this");
        let mut out = STREAM_HEAD.to_vec();
        for i in 0..10 {
            out.extend(token_event(&head(), i, dec.next_token()));
        }
        assert_eq!(out, stream_bytes(&head(), dec.generated(), false));
        out.extend(final_event(&head(), dec.tokens()));
        out.extend(DONE_EVENT);
        let ev = events(&out);
        let text: String = ev[..10]
            .iter()
            .map(|e| {
                let v: Value = serde_json::from_str(e).expect("JSON");
                v["choices"][0]["text"].as_str().expect("a text").to_owned()
            })
            .collect();
        assert_eq!(text, plain.text);
        // Another process, resuming after 4 tokens, writes the same bytes.
        let mut again = m.resume(&bytes, "stream this", 4);
        let mut resumed = stream_bytes(&head(), again.generated(), false);
        for i in 4..10 {
            resumed.extend(token_event(&head(), i, again.next_token()));
        }
        resumed.extend(final_event(&head(), again.tokens()));
        resumed.extend(DONE_EVENT);
        assert_eq!(resumed, out);
    }

    #[test]
    fn no_tokens_still_end_the_stream() {
        let bytes = stream_bytes(&head(), &[], true);
        let ev = events(&bytes);
        assert_eq!(ev.len(), 2);
        let last: Value = serde_json::from_str(&ev[0]).expect("JSON");
        assert_eq!(last["choices"][0]["finish_reason"], "length");
        assert_eq!(last["usage"]["completion_tokens"], 0);
        assert_eq!(ev[1], "[DONE]");
    }

    #[test]
    fn strings_are_escaped() {
        let mut h = head();
        h.model = "a \"model\"\nwith\\ odd\u{1} bytes é".into();
        let tokens = ["\"quoted\"", "new\nline", "data: [DONE]\n\n"];
        let ev = events(&stream_bytes(&h, &tokens, true));
        assert_eq!(ev.len(), 5, "the texts made no events of their own");
        let mut text = String::new();
        for e in &ev[..4] {
            let v: Value = serde_json::from_str(e).expect("JSON");
            assert_eq!(v["model"], h.model.as_str());
            text.push_str(v["choices"][0]["text"].as_str().expect("a text"));
        }
        assert_eq!(text, tokens.join(" "));
    }

    #[test]
    fn the_stream_head_has_no_length_and_no_chunks() {
        let head = std::str::from_utf8(STREAM_HEAD).expect("ASCII");
        assert!(head.starts_with("HTTP/1.1 200 OK\r\n"));
        assert!(head.ends_with("\r\n\r\n"));
        let lines: Vec<&str> = head.trim_end().split("\r\n").skip(1).collect();
        assert_eq!(
            lines,
            [
                "Content-Type: text/event-stream",
                "Cache-Control: no-cache",
                "Connection: close"
            ]
        );
    }

    #[test]
    fn the_plain_answer_has_openai_shape_and_the_engine_fields() {
        let c = Completion {
            text: "amber basalt".into(),
            fingerprint: "0123456789abcdef".into(),
            tokens: 2,
        };
        let engine = json!({ "slot": "1", "source": "file" });
        let v = completion_body(&head(), &c, &engine);
        assert_eq!(
            v,
            json!({
                "id": "cmpl-00112233aabbccdd",
                "object": "text_completion",
                "created": 1_700_000_000,
                "model": "shadow-reference",
                "choices": [{ "index": 0, "text": "amber basalt", "logprobs": null, "finish_reason": "length" }],
                "usage": { "prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7 },
                "fingerprint": "0123456789abcdef",
                "engine": { "slot": "1", "source": "file" },
            })
        );
        let r = json_response(200, &v);
        let text = std::str::from_utf8(&r).expect("UTF-8");
        let (h, body) = text.split_once("\r\n\r\n").expect("a head");
        assert!(h.starts_with("HTTP/1.1 200 OK\r\n"), "{h}");
        assert!(
            h.contains(&format!("\r\nContent-Length: {}", body.len())),
            "{h}"
        );
        assert_eq!(serde_json::from_str::<Value>(body).expect("JSON"), v);
        let r = json_response(503, &json!({ "error": "full" }));
        assert!(r.starts_with(b"HTTP/1.1 503 Service Unavailable\r\n"));
    }

    #[test]
    fn ids_are_fresh_and_well_formed() {
        let ids: std::collections::HashSet<String> = (0..1000).map(|_| new_id()).collect();
        assert_eq!(ids.len(), 1000);
        for id in ids.iter().take(10) {
            let hex = id.strip_prefix("cmpl-").expect("cmpl-");
            assert_eq!(hex.len(), 16, "{id}");
            assert!(hex.bytes().all(|b| b.is_ascii_hexdigit()), "{id}");
        }
        let h = StreamHead::new(3);
        assert_eq!(h.model, MODEL);
        assert!(h.created > 1_600_000_000);
    }
}
