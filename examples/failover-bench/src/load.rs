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
    /// Why it failed, in words.
    pub error: Option<String>,
    /// What kind of failure it was.
    pub failure: Option<Failure>,
}

/// How a request failed, as the client sees it: the kinds a runtime can
/// do something about are kept apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// connect(2) refused: nobody listened (no socket, or between an
    /// engine's death and its successor's `listen`).
    Refused,
    /// Connected, then reset or closed without a whole answer: the request
    /// was queued on, or accepted by, the engine that died.
    ResetInFlight,
    /// No connection or no answer within the request's limit.
    Timeout,
    /// An answer, but not the right one (status, body, text).
    Wrong,
}

impl Failure {
    /// Its key in report.json.
    pub fn key(self) -> &'static str {
        match self {
            Failure::Refused => "refused",
            Failure::ResetInFlight => "reset_in_flight",
            Failure::Timeout => "timeouts",
            Failure::Wrong => "wrong",
        }
    }

    fn of_io(e: &std::io::Error) -> Failure {
        use std::io::ErrorKind as K;
        match e.kind() {
            K::ConnectionRefused => Failure::Refused,
            K::TimedOut | K::WouldBlock => Failure::Timeout,
            _ => Failure::ResetInFlight,
        }
    }
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

fn ask(w: &Workload, i: usize) -> Result<(), (Failure, String)> {
    let (prompt, expected) = &w.prompts[i % w.prompts.len()];
    let addr = SocketAddr::from(([127, 0, 0, 1], w.port));
    let io =
        |what: &'static str| move |e: std::io::Error| (Failure::of_io(&e), format!("{what}: {e}"));
    let wrong = |m: String| (Failure::Wrong, m);
    let connect_kind = |e: std::io::Error| {
        // A connect that fails otherwise than refused or timed out is the
        // client's own trouble (ports, descriptors): counted as refused.
        let kind = match Failure::of_io(&e) {
            Failure::Timeout => Failure::Timeout,
            _ => Failure::Refused,
        };
        (kind, format!("connect: {e}"))
    };
    let mut s = TcpStream::connect_timeout(&addr, w.timeout).map_err(connect_kind)?;
    s.set_read_timeout(Some(w.timeout))
        .and_then(|_| s.set_write_timeout(Some(w.timeout)))
        .map_err(io("socket timeouts"))?;
    let body = serde_json::json!({ "prompt": prompt, "max_tokens": w.max_tokens }).to_string();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .map_err(io("send"))?;
    let mut text = String::new();
    s.read_to_string(&mut text).map_err(io("receive"))?;
    // Closed before a whole head: the engine died with the request.
    let (head, body) = text.split_once("\r\n\r\n").ok_or_else(|| {
        (
            Failure::ResetInFlight,
            format!("no HTTP answer ({} bytes)", text.len()),
        )
    })?;
    if !head.starts_with("HTTP/1.1 200") {
        return Err(wrong(format!(
            "status {}",
            head.lines().next().unwrap_or_default()
        )));
    }
    let v: serde_json::Value =
        serde_json::from_str(body).map_err(|e| wrong(format!("answer is not JSON: {e}")))?;
    match v["choices"][0]["text"].as_str() {
        Some(t) if t == expected => Ok(()),
        Some(t) => Err(wrong(format!(
            "wrong answer {t:?}, weights say {expected:?}"
        ))),
        None => Err(wrong("answer without text".into())),
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
                let (failure, error) = match r {
                    Ok(()) => (None, None),
                    Err((f, e)) => (Some(f), Some(e)),
                };
                let _ = tx.send((
                    i,
                    Sample {
                        sent_ms: (due - start).as_secs_f64() * 1e3,
                        latency_ms: (done - due.min(sent)).as_secs_f64() * 1e3,
                        ok: failure.is_none(),
                        error,
                        failure,
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn workload(port: u16) -> Workload {
        Workload {
            port,
            rate: 1.0,
            max_tokens: 1,
            prompts: vec![("p".into(), "t".into())],
            timeout: Duration::from_millis(200),
        }
    }

    #[test]
    fn failures_are_told_apart_by_kind() {
        // Nobody listens: refused.
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap()
            .port();
        assert_eq!(ask(&workload(port), 0).unwrap_err().0, Failure::Refused);

        // Accepted, then closed without an answer: lost in flight.
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let w = workload(l.local_addr().unwrap().port());
        let closer = std::thread::spawn(move || drop(l.accept()));
        assert_eq!(ask(&w, 0).unwrap_err().0, Failure::ResetInFlight);
        closer.join().unwrap();

        // Queued, never answered: a timeout (the listener stays open).
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let w = workload(l.local_addr().unwrap().port());
        assert_eq!(ask(&w, 0).unwrap_err().0, Failure::Timeout);

        // An answer that is not the weights' text: wrong.
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let w = workload(l.local_addr().unwrap().port());
        let server = std::thread::spawn(move || {
            let (mut c, _) = l.accept().unwrap();
            let mut buf = [0u8; 4096];
            let _ = c.read(&mut buf);
            let body = r#"{"choices":[{"text":"x"}]}"#;
            let _ = write!(
                c,
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            );
        });
        assert_eq!(ask(&w, 0).unwrap_err().0, Failure::Wrong);
        server.join().unwrap();
    }
}
