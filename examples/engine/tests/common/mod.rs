//! What the reference engine's tests share: a client of its completions
//! API, as a user's would be, and the pair they run the engine in.

// Each test file compiles its own copy of this module and uses a part.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use serde_json::Value;

/// POSTs a completion of `max_tokens` to the engine on `port`, waiting at
/// most `timeout` for the answer; the parsed body of a 200, else None.
pub fn complete(port: u16, prompt: &str, max_tokens: usize, timeout: Duration) -> Option<Value> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(timeout)).ok()?;
    let body = serde_json::json!({ "prompt": prompt, "max_tokens": max_tokens }).to_string();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let (head, body) = text.split_once("\r\n\r\n")?;
    head.starts_with("HTTP/1.1 200")
        .then(|| serde_json::from_str(body).ok())
        .flatten()
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
