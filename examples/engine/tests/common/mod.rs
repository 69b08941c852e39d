//! What the reference engine's tests share: a client of its completions
//! API, as a user's would be.

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
