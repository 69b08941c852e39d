//! Open-loop load: requests leave on a fixed schedule whether or not earlier
//! ones have answered, so an outage shows as failures and late answers
//! instead of silently slowing the sender down (no coordinated omission).
//! Each request is one HTTP/1.1 connection on loopback; an answer counts as
//! a success only if its text is the one the weights must produce.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// One request's fate. Times are ms from the start of the load.
#[derive(Debug, Clone)]
pub struct Sample {
    pub sent_ms: f64,
    pub latency_ms: f64,
    pub ok: bool,
    /// Why it failed (refused, reset, timeout, wrong answer).
    pub error: Option<String>,
}

/// What every request asks and what the weights must answer.
pub struct Workload {
    pub port: u16,
    pub rate: f64,
    pub max_tokens: usize,
    /// (prompt, expected text), used round-robin.
    pub prompts: Vec<(String, String)>,
    /// Connect + answer limit of one request.
    pub timeout: Duration,
}

/// Shared with the caller while the load runs.
pub struct Progress {
    pub stop: AtomicBool,
    /// Send time (µs from start) of the latest request that succeeded.
    pub last_ok_us: AtomicU64,
}

impl Progress {
    pub fn new() -> Self {
        Progress {
            stop: AtomicBool::new(false),
            last_ok_us: AtomicU64::new(0),
        }
    }
}

fn ask(w: &Workload, i: usize) -> Result<(), String> {
    let (prompt, expected) = &w.prompts[i % w.prompts.len()];
    let addr = SocketAddr::from(([127, 0, 0, 1], w.port));
    let mut s =
        TcpStream::connect_timeout(&addr, w.timeout).map_err(|e| format!("connect: {e}"))?;
    s.set_read_timeout(Some(w.timeout))
        .and_then(|_| s.set_write_timeout(Some(w.timeout)))
        .map_err(|e| format!("socket timeouts: {e}"))?;
    let body = serde_json::json!({ "prompt": prompt, "max_tokens": w.max_tokens }).to_string();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .map_err(|e| format!("send: {e}"))?;
    let mut text = String::new();
    s.read_to_string(&mut text)
        .map_err(|e| format!("receive: {e}"))?;
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("no HTTP answer ({} bytes)", text.len()))?;
    if !head.starts_with("HTTP/1.1 200") {
        return Err(format!(
            "status {}",
            head.lines().next().unwrap_or_default()
        ));
    }
    let v: serde_json::Value =
        serde_json::from_str(body).map_err(|e| format!("answer is not JSON: {e}"))?;
    match v["choices"][0]["text"].as_str() {
        Some(t) if t == expected => Ok(()),
        Some(t) => Err(format!("wrong answer {t:?}, weights say {expected:?}")),
        None => Err("answer without text".into()),
    }
}

/// Sends requests at `w.rate` per second from `start` until `p.stop`; each
/// request runs on its own thread. Returns every sample, in send order.
pub fn run(w: &Workload, p: &Progress, start: Instant) -> Vec<Sample> {
    let period = Duration::from_secs_f64(1.0 / w.rate);
    let (tx, rx) = mpsc::channel::<(usize, Sample)>();
    std::thread::scope(|s| {
        let mut i = 0usize;
        loop {
            let due = start + period * i as u32;
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
            if p.stop.load(Ordering::Acquire) {
                break;
            }
            let tx = tx.clone();
            s.spawn(move || {
                let sent = Instant::now();
                let r = ask(w, i);
                let done = Instant::now();
                if r.is_ok() {
                    // By send time: an answer to a request sent before a
                    // kill says nothing about recovery from it.
                    p.last_ok_us
                        .fetch_max((due - start).as_micros() as u64, Ordering::AcqRel);
                }
                // Latency from the scheduled time: a late send is the server's fault too.
                let _ = tx.send((
                    i,
                    Sample {
                        sent_ms: (due - start).as_secs_f64() * 1e3,
                        latency_ms: (done - due.min(sent)).as_secs_f64() * 1e3,
                        ok: r.is_ok(),
                        error: r.err(),
                    },
                ));
            });
            i += 1;
        }
    });
    drop(tx);
    let mut out: Vec<(usize, Sample)> = rx.into_iter().collect();
    out.sort_by_key(|(i, _)| *i);
    out.into_iter().map(|(_, s)| s).collect()
}
