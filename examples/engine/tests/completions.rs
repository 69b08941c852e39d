//! The reference engine's completions API, as a plain process (no
//! container, no root, no lock, no watchdog): OpenAI's `text_completion`,
//! one JSON answer or with `"stream": true` a server-sent event per token,
//! and the stream is exactly the bytes `openai::stream_bytes` makes of the
//! same tokens (what lets another process take a response up).

use std::process::{Command, Stdio};
use std::time::Duration;

mod common;

use common::Engine;
use serde_json::{json, Value};
use shadow_engine::openai::{stream_bytes, StreamHead, MODEL, STREAM_HEAD};
use shadow_tests::pair::free_port;

/// Only a broken engine makes a test wait this long.
const LIMIT: Duration = Duration::from_secs(20);

fn serve(weights: &std::path::Path, port: u16) -> Engine {
    Engine(
        Command::new(env!("CARGO_BIN_EXE_shadow-engine"))
            .args(["serve", "--kv-mib", "1", "--port", &port.to_string()])
            .arg("--weights")
            .arg(weights)
            .env_remove("NOTIFY_SOCKET")
            .env_remove("WATCHDOG_USEC")
            .env_remove("WATCHDOG_PID")
            .env_remove("SHADOW_LOCK_PATH")
            .env_remove("GMS_SOCKET_DIR")
            .env_remove("LISTEN_FDS")
            .env_remove("LISTEN_PID")
            .stdout(Stdio::null())
            .spawn()
            .expect("spawn the engine"),
    )
}

/// The status line of the engine's answer to `body`.
fn status_of(port: u16, body: &str) -> String {
    let (head, _) = common::post(port, body, LIMIT).expect("an answer");
    head.lines().next().unwrap_or_default().to_owned()
}

#[test]
fn a_stream_is_the_plain_answer_event_by_event() {
    let d = tempfile::tempdir().unwrap();
    let weights = d.path().join("weights.safetensors");
    shadow_engine::model::generate(&weights, 2, 11).unwrap();
    let port = free_port();
    let _engine = serve(&weights, port);
    shadow_tests::wait::until(
        "the engine serves",
        LIMIT,
        Duration::from_millis(20),
        || common::complete(port, "first", 1, LIMIT),
    );

    for (prompt, n) in [
        ("stream me", 12),
        ("", 3),
        ("no tokens", 0),
        ("é long", 256),
    ] {
        let plain = common::complete(port, prompt, n, LIMIT).expect("a plain answer");
        let text = plain["choices"][0]["text"].as_str().expect("a text");
        // OpenAI's shape, and the engine's own fields.
        assert!(plain["id"].as_str().is_some_and(|i| i.starts_with("cmpl-")));
        assert_eq!(plain["object"], "text_completion");
        assert!(plain["created"].as_u64().is_some_and(|t| t > 1_600_000_000));
        assert_eq!(plain["model"], MODEL);
        assert_eq!(plain["choices"][0]["index"], 0);
        assert!(plain["choices"][0]["logprobs"].is_null());
        assert_eq!(plain["choices"][0]["finish_reason"], "length");
        assert_eq!(
            plain["usage"],
            json!({ "prompt_tokens": prompt.len(), "completion_tokens": n, "total_tokens": prompt.len() + n })
        );
        assert!(plain["fingerprint"].is_string());
        assert_eq!(plain["engine"]["source"], "file");

        let raw = common::stream(port, prompt, n, LIMIT).expect("a stream");
        assert!(
            raw.starts_with(STREAM_HEAD),
            "{}",
            String::from_utf8_lossy(&raw)
        );
        let ev = common::events(&raw);
        assert_eq!(ev.len(), n + 2, "{prompt:?}: {ev:?}");
        assert_eq!(ev[n + 1], "[DONE]");
        let parsed: Vec<Value> = ev[..=n]
            .iter()
            .map(|e| serde_json::from_str(e).expect("each event is JSON"))
            .collect();
        let streamed: String = parsed
            .iter()
            .map(|v| v["choices"][0]["text"].as_str().expect("a text"))
            .collect();
        assert_eq!(streamed, text, "{prompt:?}");
        for v in &parsed[..n] {
            assert!(v["choices"][0]["finish_reason"].is_null());
        }
        let last = &parsed[n];
        assert_eq!(last["choices"][0]["text"], "");
        assert_eq!(last["choices"][0]["finish_reason"], "length");
        assert_eq!(last["usage"], plain["usage"]);
        // Nothing but the head's id and time differs from the pure encoding
        // of the plain answer's tokens.
        let head = StreamHead {
            id: last["id"].as_str().expect("an id").to_owned(),
            created: last["created"].as_u64().expect("a time"),
            model: MODEL.to_owned(),
            prompt_tokens: prompt.len(),
        };
        let tokens: Vec<&str> = match n {
            0 => vec![],
            _ => text.split(' ').collect(),
        };
        assert!(
            raw == stream_bytes(&head, &tokens, true),
            "{prompt:?}: the stream is not stream_bytes of its tokens"
        );
    }

    // The errors, streamed or not.
    let bad = "HTTP/1.1 400 Bad Request";
    assert_eq!(status_of(port, r#"{"prompt":"x","stream":"yes"}"#), bad);
    assert_eq!(status_of(port, r#"{"prompt":"x","stream":1}"#), bad);
    assert_eq!(
        status_of(port, r#"{"prompt":"x","stream":true,"max_tokens":257}"#),
        bad
    );
    assert_eq!(status_of(port, r#"{"stream":true}"#), bad);
    assert_eq!(status_of(port, "{not json"), bad);
    // null is OpenAI's default: not streamed.
    let (head, body) = common::post(port, r#"{"prompt":"x","stream":null}"#, LIMIT).unwrap();
    assert!(head.contains("Content-Type: application/json"), "{head}");
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["object"], "text_completion");

    official_client(port, "what the client sees", 9);
}

/// The official Python client parses both forms, when it is installed.
fn official_client(port: u16, prompt: &str, n: usize) {
    let has = Command::new("python3")
        .args(["-c", "import openai"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !has {
        println!(
            "note: python3 with the openai package not importable: official client check skipped"
        );
        return;
    }
    let script = r#"
import json, sys
import openai
port, prompt, n = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=20)
plain = c.completions.create(model="shadow-reference", prompt=prompt, max_tokens=n)
chunks = list(c.completions.create(model="shadow-reference", prompt=prompt, max_tokens=n, stream=True))
print(json.dumps({
    "plain": plain.choices[0].text,
    "finish": plain.choices[0].finish_reason,
    "tokens": plain.usage.completion_tokens,
    "stream": "".join(ch.choices[0].text for ch in chunks),
    "finishes": [ch.choices[0].finish_reason for ch in chunks],
    "ids": len({ch.id for ch in chunks}),
    "usage": chunks[-1].usage.completion_tokens if chunks[-1].usage else None,
}))
"#;
    let out = Command::new("python3")
        .args(["-c", script, &port.to_string(), prompt, &n.to_string()])
        .output()
        .expect("run python3");
    assert!(
        out.status.success(),
        "the client failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).expect("the script's JSON");
    let ours = common::complete(port, prompt, n, LIMIT).expect("a plain answer");
    assert_eq!(v["plain"], ours["choices"][0]["text"]);
    assert_eq!(v["stream"], v["plain"]);
    assert_eq!(v["finish"], "length");
    assert_eq!(v["tokens"], n);
    assert_eq!(v["usage"], n);
    assert_eq!(v["ids"], 1);
    let finishes = v["finishes"].as_array().expect("a list");
    assert_eq!(finishes.len(), n + 1);
    assert!(finishes[..n].iter().all(Value::is_null));
    assert_eq!(finishes[n], "length");
    println!("the official openai client parsed both forms");
}
