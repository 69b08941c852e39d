//! What the reference engine's tests share: a client of its completions
//! API, as a user's would be, and the pair they run the engine in.

// Each test file compiles its own copy of this module and uses a part.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Child;
use std::time::Duration;

use serde_json::Value;

/// An engine run as a plain process, killed when the test ends however
/// it ends.
pub struct Engine(pub Child);

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// POSTs `body` to `/v1/completions` on `port`, waiting at most `timeout`
/// for each read; the whole response as it came, until the engine closed
/// the connection: the head (status line and headers) and the body bytes.
pub fn post(port: u16, body: &str, timeout: Duration) -> Option<(String, Vec<u8>)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(timeout)).ok()?;
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .ok()?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).ok()?;
    let end = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = String::from_utf8(raw[..end + 4].to_vec()).ok()?;
    Some((head, raw[end + 4..].to_vec()))
}

/// POSTs a completion of `max_tokens` to the engine on `port`, waiting at
/// most `timeout` for the answer; the parsed body of a 200, else None.
pub fn complete(port: u16, prompt: &str, max_tokens: usize, timeout: Duration) -> Option<Value> {
    let body = serde_json::json!({ "prompt": prompt, "max_tokens": max_tokens }).to_string();
    let (head, body) = post(port, &body, timeout)?;
    head.starts_with("HTTP/1.1 200")
        .then(|| serde_json::from_slice(&body).ok())
        .flatten()
}

/// A streamed completion (`"stream": true`) of `max_tokens` from the engine
/// on `port`: the bytes of a 200 from its status line on (head and
/// events, as `shadow_engine::openai::stream_bytes` makes them), else None.
pub fn stream(port: u16, prompt: &str, max_tokens: usize, timeout: Duration) -> Option<Vec<u8>> {
    let body = serde_json::json!({ "prompt": prompt, "max_tokens": max_tokens, "stream": true })
        .to_string();
    let (head, body) = post(port, &body, timeout)?;
    head.starts_with("HTTP/1.1 200").then(|| {
        let mut all = head.into_bytes();
        all.extend(body);
        all
    })
}

/// The payloads of the `data: ` events of a streamed response, its head
/// left out (an unterminated tail, if any, is the last item).
pub fn events(response: &[u8]) -> Vec<String> {
    let text = String::from_utf8_lossy(response);
    let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    body.split_terminator("\n\n")
        .map(|e| e.strip_prefix("data: ").unwrap_or(e).to_owned())
        .collect()
}

/// The reference engine as a pair in `cd` (GMS host backend, host
/// network): the binary and an 8-layer weights file in its rootfs, then
/// `ctr run` of `id` with `annotations`, serving on `port`. The pair's
/// environment and its attached `ctr run`.
pub fn run_pair(
    cd: &shadow_tests::Containerd,
    id: &str,
    annotations: &[(&str, &str)],
    port: u16,
) -> (shadow_tests::pair::PairEnv, shadow_tests::Spawned) {
    shadow_tests::pair::install_binary(
        cd.rootfs(),
        std::path::Path::new(env!("CARGO_BIN_EXE_shadow-engine")),
        "/bin/shadow-engine",
    )
    .expect("install the engine");
    shadow_engine::model::generate(&cd.rootfs().join("weights.safetensors"), 8, 3)
        .expect("weights");
    let env = shadow_tests::pair::PairEnv::new(cd, "gms = \"host\"").expect("config");
    let port = port.to_string();
    let ctr = env
        .run(
            cd,
            id,
            annotations,
            &["--net-host"],
            &[
                "/bin/shadow-engine",
                "serve",
                "--weights",
                "/weights.safetensors",
                "--port",
                &port,
            ],
        )
        .expect("ctr run");
    (env, ctr)
}
