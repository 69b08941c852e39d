//! Connections in flight outlive the engine serving them (private
//! containerd, runc, this shim, gmsd host backend; root). The pair owns
//! the listening socket (`shadow.dev/listen`) and keeps an fd store (its
//! default bound): every connection the active engine accepts is stored
//! with a memfd of its state, and the engine that takes over resumes it.
//!
//! Clients stream completions and ask plain ones, concurrently and
//! without pause, while the serving engine is SIGKILLed again and again
//! (each time once the pair is protected again, requests were completed
//! since the last kill, and both kinds are under way). Every stream must
//! end with `[DONE]`, every event parse, its id stay the same, and its
//! text be that of the same request undisturbed; every plain answer must
//! be the undisturbed one; no connection may be reset, refused or time
//! out; and once all is answered the store is empty. It runs twice: with
//! each engine accepting, and with the runtime accepting and handing
//! connections over (`shadow.dev/accept: runtime`). The verdict never
//! depends on how long anything took: the figures printed (the longest
//! silence a streaming client saw around a kill) are for reading.

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod common;

use serde_json::Value;
use shadow_contract::annotations::{ACCEPT, LISTEN};
use shadow_tests::pair::{free_port, until};
use shadow_tests::Containerd;

/// Only something broken makes the test wait this long for one thing.
const LONG: Duration = Duration::from_secs(90);
const STEP: Duration = Duration::from_millis(5);
const KILLS: u64 = 5;
/// Streaming clients; the first reads slowly through a small receive
/// buffer, so that at a kill part of what the engine wrote is still in
/// its send queue (what `SIOCOUTQ` counts).
const STREAMERS: usize = 3;
const PLAINERS: usize = 2;
const STREAM_TOKENS: usize = 256;
const PLAIN_TOKENS: usize = 128;
/// Events a stream must have had for a kill to count it under way.
const UNDER_WAY: usize = 8;

/// One streamed response, as its client saw it.
struct Seen {
    head: String,
    /// Each event's payload (after `data: `) and when it was complete.
    events: Vec<(String, Instant)>,
    /// The bytes after the last complete event (nothing, if well formed).
    tail: Vec<u8>,
    started: Instant,
    head_at: Option<Instant>,
}

/// How a request failed, as its client tells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Refused,
    Reset,
    Timeout,
    Other,
    /// Answered, but not the undisturbed answer, or not well formed.
    Wrong,
}

#[derive(Debug)]
struct Failure {
    kind: Kind,
    what: String,
    /// When its request began (to tell it apart around the kills).
    at: Instant,
}

fn wrong(what: String) -> Failure {
    Failure {
        kind: Kind::Wrong,
        what,
        at: Instant::now(),
    }
}

fn io_failure(what: &str, e: &std::io::Error) -> Failure {
    let kind = match e.kind() {
        ErrorKind::ConnectionRefused => Kind::Refused,
        ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted | ErrorKind::BrokenPipe => {
            Kind::Reset
        }
        ErrorKind::WouldBlock | ErrorKind::TimedOut => Kind::Timeout,
        _ => Kind::Other,
    };
    Failure {
        kind,
        what: format!("{what}: {e}"),
        at: Instant::now(),
    }
}

fn request(prompt: &str, max_tokens: usize, stream: bool) -> Vec<u8> {
    let body = serde_json::json!({ "prompt": prompt, "max_tokens": max_tokens, "stream": stream })
        .to_string();
    format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// A connection to the pair; with `slow`, through a receive buffer of a
/// few KiB (set before the connect, so that the window is that small).
fn connect(port: u16, slow: bool) -> std::io::Result<TcpStream> {
    if !slow {
        return TcpStream::connect(("127.0.0.1", port));
    }
    use nix::sys::socket::{self, sockopt, AddressFamily, SockFlag, SockType, SockaddrIn};
    use std::os::fd::AsRawFd;
    let fd = socket::socket(
        AddressFamily::Inet,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    socket::setsockopt(&fd, sockopt::RcvBuf, &2048)?;
    socket::connect(fd.as_raw_fd(), &SockaddrIn::new(127, 0, 0, 1, port))?;
    Ok(TcpStream::from(fd))
}

/// A streamed completion, read as it comes (with `slow`, a little at a
/// time): each event with the time it was complete. `progress` counts
/// this stream's events as they arrive.
fn stream_once(
    port: u16,
    prompt: &str,
    slow: bool,
    progress: &AtomicUsize,
) -> Result<Seen, Failure> {
    progress.store(0, Ordering::SeqCst);
    let started = Instant::now();
    let fail = |what: &str, e: std::io::Error| Failure {
        at: started,
        ..io_failure(what, &e)
    };
    let mut s = connect(port, slow).map_err(|e| fail("connect", e))?;
    s.set_read_timeout(Some(LONG))
        .map_err(|e| fail("timeout", e))?;
    s.write_all(&request(prompt, STREAM_TOKENS, true))
        .map_err(|e| fail("send", e))?;
    let mut seen = Seen {
        head: String::new(),
        events: Vec::new(),
        tail: Vec::new(),
        started,
        head_at: None,
    };
    // Bytes not yet parsed, and whether the head is behind them.
    let mut raw = Vec::new();
    let mut in_body = false;
    let mut chunk = vec![0u8; if slow { 512 } else { 16384 }];
    loop {
        if slow {
            std::thread::sleep(Duration::from_millis(3));
        }
        let n = s.read(&mut chunk).map_err(|e| fail("read", e))?;
        let now = Instant::now();
        if n == 0 {
            break;
        }
        raw.extend_from_slice(&chunk[..n]);
        if !in_body {
            let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") else {
                continue;
            };
            seen.head = String::from_utf8_lossy(&raw[..end + 4]).into_owned();
            seen.head_at = Some(now);
            raw.drain(..end + 4);
            in_body = true;
        }
        let mut at = 0;
        while let Some(end) = raw[at..].windows(2).position(|w| w == b"\n\n") {
            let text = String::from_utf8_lossy(&raw[at..at + end]).into_owned();
            let payload = text.strip_prefix("data: ").unwrap_or(&text).to_owned();
            seen.events.push((payload, now));
            progress.fetch_add(1, Ordering::SeqCst);
            at += end + 2;
        }
        raw.drain(..at);
    }
    seen.tail = raw;
    Ok(seen)
}

/// The concatenated text of a stream's events.
fn text_of(seen: &Seen) -> String {
    seen.events
        .iter()
        .filter_map(|(e, _)| serde_json::from_str::<Value>(e).ok())
        .filter_map(|v| v["choices"][0]["text"].as_str().map(str::to_owned))
        .collect()
}

/// What is wrong with a stream, if anything: the head, the framing, the
/// events (JSON, one id), the end, the text against `want_text`.
fn check_stream(seen: &Seen, want_text: &str) -> Result<(), String> {
    if !seen.head.starts_with("HTTP/1.1 200") {
        return Err(format!("head {:?}", seen.head));
    }
    if !seen.tail.is_empty() {
        return Err(format!(
            "an unterminated tail {:?}",
            String::from_utf8_lossy(&seen.tail)
        ));
    }
    let n = seen.events.len();
    if n != STREAM_TOKENS + 2 || seen.events[n - 1].0 != "[DONE]" {
        return Err(format!(
            "{n} events, the last {:?}",
            seen.events.last().map(|e| &e.0)
        ));
    }
    let mut id = None;
    let mut text = String::new();
    for (i, (e, _)) in seen.events[..n - 1].iter().enumerate() {
        let v: Value = serde_json::from_str(e).map_err(|err| format!("event {i} {e:?}: {err}"))?;
        let this = v["id"]
            .as_str()
            .ok_or(format!("event {i} has no id"))?
            .to_owned();
        if *id.get_or_insert_with(|| this.clone()) != this {
            return Err(format!("event {i}: id {this}, before {id:?}"));
        }
        text.push_str(
            v["choices"][0]["text"]
                .as_str()
                .ok_or(format!("event {i} has no text"))?,
        );
        if i == n - 2 && v["usage"]["completion_tokens"] != STREAM_TOKENS {
            return Err(format!("the final event {v}"));
        }
    }
    if text != want_text {
        return Err(format!("text {text:?}, undisturbed {want_text:?}"));
    }
    Ok(())
}

/// A plain completion's body, or why there is none; `waiting` is set
/// from the request sent to the answer read.
fn plain_once(port: u16, prompt: &str, waiting: &AtomicBool) -> Result<Value, Failure> {
    let started = Instant::now();
    let fail = |what: &str, e: std::io::Error| Failure {
        at: started,
        ..io_failure(what, &e)
    };
    let mut s = connect(port, false).map_err(|e| fail("connect", e))?;
    s.set_read_timeout(Some(LONG))
        .map_err(|e| fail("timeout", e))?;
    s.write_all(&request(prompt, PLAIN_TOKENS, false))
        .map_err(|e| fail("send", e))?;
    waiting.store(true, Ordering::SeqCst);
    let mut raw = Vec::new();
    let read = s.read_to_end(&mut raw);
    waiting.store(false, Ordering::SeqCst);
    read.map_err(|e| fail("read", e))?;
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| wrong(format!("no head in {} bytes", raw.len())))?;
    let head = String::from_utf8_lossy(&raw[..end]);
    if !head.starts_with("HTTP/1.1 200") {
        return Err(wrong(format!("head {head:?}")));
    }
    serde_json::from_slice(&raw[end + 4..])
        .map_err(|e| wrong(format!("body: {e}: {:?}", String::from_utf8_lossy(&raw))))
}

/// The largest gap between consecutive arrivals of a stream (from the
/// request to its head, then between events).
fn largest_gap(seen: &Seen) -> Duration {
    let mut last = seen.head_at.unwrap_or(seen.started);
    let mut gap = last - seen.started;
    for (_, t) in &seen.events {
        gap = gap.max(*t - last);
        last = *t;
    }
    gap
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i]
}

/// The sums of the engines' takeover lines: connections fetched; resumed
/// with the request unread, plain, stream; done; dropped.
fn tally(lines: &[&str]) -> [u64; 6] {
    let mut sum = [0u64; 6];
    for l in lines {
        let num = |key: &str| -> u64 {
            l.split(key)
                .nth(1)
                .and_then(|r| r.trim_start().split(|c: char| !c.is_ascii_digit()).next())
                .and_then(|n| n.parse().ok())
                .unwrap_or(0)
        };
        let got = [
            num("took over:"),
            num("request unread"),
            num(", plain"),
            num(", stream"),
            num("), done"),
            num(", dropped"),
        ];
        for (s, g) in sum.iter_mut().zip(got) {
            *s += g;
        }
    }
    sum
}

/// The engines' lines for each stream they went on with: (streams, tokens
/// from the KV pool, tokens computed again) and each reason given.
fn kv_tally(log: &str) -> (u64, u64, u64, Vec<String>) {
    let (mut streams, mut carried, mut again) = (0, 0, 0);
    let mut why = Vec::new();
    for l in log.lines().filter(|l| l.contains("shadow-engine: KV of ")) {
        let num = |key: &str| -> u64 {
            l.split(key)
                .next()
                .and_then(|r| r.rsplit(' ').find(|w| !w.is_empty()))
                .and_then(|n| n.parse().ok())
                .unwrap_or(0)
        };
        streams += 1;
        carried += num(" tokens from the pool");
        again += num(" computed again");
        if let Some(w) = l.split(" computed again (").nth(1) {
            why.push(w.trim_end_matches(')').to_owned());
        }
    }
    (streams, carried, again, why)
}

/// Counts shared by the clients and the test.
#[derive(Default)]
struct Shared {
    stop: AtomicBool,
    failures: Mutex<Vec<(String, Failure)>>,
    streams: Mutex<Vec<Seen>>,
    plains: AtomicUsize,
    /// Each streaming client's events in its current stream.
    progress: [AtomicUsize; STREAMERS],
    /// Each streaming client's streams read to their end.
    completed: [AtomicUsize; STREAMERS],
    /// Each plain client: waiting for its answer.
    waiting: [AtomicBool; PLAINERS],
}

impl Shared {
    fn failed(&self, who: String, f: Failure) {
        self.failures.lock().unwrap().push((who, f));
    }
}

/// Each engine accepts, and stores what it accepted with its state.
#[test]
fn streams_and_answers_survive_kills_of_the_serving_engine() {
    survive_kills("engine");
}

/// The runtime accepts (`shadow.dev/accept: runtime`): each connection is
/// in the store before any engine has it, and is handed to the serving one.
#[test]
fn streams_and_answers_survive_kills_when_the_runtime_accepts() {
    survive_kills("runtime");
}

/// The carried KV is dropped when the memory it is in can no longer be
/// trusted. A GMS daemon's death (the device-invalidating cause this
/// machine can make; on a GPU, an XID of the memory-integrity or reset
/// class does the same) restarts the pair cold: the streams under way are
/// still answered whole by the engines of the cold restart, which find a
/// new KV pool and compute what was sent again, and say why; the state
/// file counts the drop and names its cause.
#[test]
fn streams_are_computed_again_when_the_gms_daemon_dies() {
    let cd = Containerd::start().unwrap();
    let port = free_port();
    let id = "engine-kv-drop";
    let listen = format!("tcp:127.0.0.1:{port}");
    let (env, ctr) = common::run_pair(&cd, id, &[(LISTEN, listen.as_str())], port);
    env.wait_protected(&cd, id, LONG);
    let prompts: Vec<String> = (0..2)
        .map(|i| format!("a stream whose KV cannot be trusted, {i}"))
        .collect();
    let quiet = AtomicUsize::new(0);
    let want: Vec<String> = prompts
        .iter()
        .map(|p| {
            let seen = until("an undisturbed stream", LONG, STEP, || {
                stream_once(port, p, false, &quiet).ok()
            });
            text_of(&seen)
        })
        .collect();
    let progress: Arc<[AtomicUsize; 2]> = Arc::new(Default::default());
    let clients: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let (p, progress) = (p.clone(), progress.clone());
            // The first reads slowly: still streaming when the daemon dies.
            std::thread::spawn(move || stream_once(port, &p, i == 0, &progress[i]))
        })
        .collect();
    until("both streams under way", LONG, STEP, || {
        progress
            .iter()
            .all(|p| (UNDER_WAY..STREAM_TOKENS).contains(&p.load(Ordering::SeqCst)))
            .then_some(())
    });
    let st = env.state(&cd, id).expect("the pair's state");
    let gmsd = st.gms_daemons.first().expect("the host gmsd").pid;
    // SAFETY: kill(2) of the pair's gmsd, its pid from the state file.
    assert_eq!(unsafe { libc::kill(gmsd as i32, libc::SIGKILL) }, 0);
    for (i, c) in clients.into_iter().enumerate() {
        let seen = c
            .join()
            .expect("a client thread")
            .unwrap_or_else(|f| panic!("stream {i}: {:?}: {}", f.kind, f.what));
        check_stream(&seen, &want[i]).unwrap_or_else(|why| panic!("stream {i}: {why}"));
    }
    let st = until("protected after the cold restart", LONG, STEP, || {
        env.state(&cd, id)
            .filter(|s| s.pair.cold_restarts == 1 && s.pair.protected)
    });
    let cause = Some(shadow_contract::state::ColdRestartCause::GmsDied {
        device: "host".into(),
    });
    assert_eq!(st.pair.kv_drops, 1);
    assert_eq!(st.pair.last_kv_drop, cause);
    let log = ctr.stdout_so_far();
    for l in log.lines().filter(|l| l.contains("KV")) {
        println!("kv drop: {}", l.trim());
    }
    let (streams, from_pool, again, why) = kv_tally(&log);
    println!(
        "kv drop: {streams} streams gone on with: {from_pool} tokens from the pool, {again} computed again"
    );
    assert!(
        again > 0,
        "nothing was computed again after the KV pool was dropped"
    );
    assert!(
        why.iter().any(|w| w.contains("new pool")),
        "the engines said why: {why:?}"
    );
    cd.ctr()
        .run(&["task", "kill", "-s", "SIGKILL", id])
        .unwrap()
        .assert_success();
    ctr.wait(LONG).unwrap();
    let _ = cd.ctr().run(&["container", "rm", id]);
    cd.assert_no_leftovers();
}

fn survive_kills(accept: &str) {
    let cd = Containerd::start().unwrap();
    let port = free_port();
    let id = "engine-continuity";
    let listen = format!("tcp:127.0.0.1:{port}");
    let (env, ctr) = common::run_pair(
        &cd,
        id,
        &[(LISTEN, listen.as_str()), (ACCEPT, accept)],
        port,
    );
    println!("accepted by the {accept}");
    env.wait_protected(&cd, id, LONG);

    // The undisturbed answers, before any kill.
    let stream_prompts: Vec<String> = (0..STREAMERS)
        .map(|i| format!("a stream that outlives its engine, {i}"))
        .collect();
    let plain_prompts: Vec<String> = (0..PLAINERS)
        .map(|i| format!("a plain answer that outlives its engine, {i}"))
        .collect();
    let (quiet, idle) = (AtomicUsize::new(0), AtomicBool::new(false));
    let want_text: Vec<String> = stream_prompts
        .iter()
        .map(|p| {
            let seen = until("an undisturbed stream", LONG, STEP, || {
                stream_once(port, p, false, &quiet).ok()
            });
            let text = text_of(&seen);
            check_stream(&seen, &text).expect("an undisturbed stream is well formed");
            text
        })
        .collect();
    let want_plain: Vec<Value> = plain_prompts
        .iter()
        .map(|p| plain_once(port, p, &idle).expect("an undisturbed answer"))
        .collect();

    // The clients, each asking again as soon as answered, until told to
    // stop after the kills.
    let sh = Arc::new(Shared::default());
    let mut clients = Vec::new();
    for (i, (prompt, want)) in stream_prompts.iter().zip(&want_text).enumerate() {
        let (prompt, want, sh) = (prompt.clone(), want.clone(), sh.clone());
        clients.push(std::thread::spawn(move || {
            while !sh.stop.load(Ordering::SeqCst) {
                match stream_once(port, &prompt, i == 0, &sh.progress[i]) {
                    Ok(seen) => {
                        if let Err(why) = check_stream(&seen, &want) {
                            sh.failed(format!("stream {i}"), wrong(why));
                        }
                        sh.streams.lock().unwrap().push(seen);
                        sh.completed[i].fetch_add(1, Ordering::SeqCst);
                    }
                    Err(f) => sh.failed(format!("stream {i}"), f),
                }
            }
        }));
    }
    for (i, (prompt, want)) in plain_prompts.iter().zip(&want_plain).enumerate() {
        let (prompt, want, sh) = (prompt.clone(), want.clone(), sh.clone());
        clients.push(std::thread::spawn(move || {
            while !sh.stop.load(Ordering::SeqCst) {
                match plain_once(port, &prompt, &sh.waiting[i]) {
                    Ok(v) => {
                        let same = v["fingerprint"] == want["fingerprint"]
                            && v["choices"][0]["text"] == want["choices"][0]["text"];
                        if !same {
                            sh.failed(
                                format!("plain {i}"),
                                wrong(format!("{v}, undisturbed {want}")),
                            );
                        }
                        sh.plains.fetch_add(1, Ordering::SeqCst);
                    }
                    Err(f) => sh.failed(format!("plain {i}"), f),
                }
            }
        }));
    }

    // The kills: each once the pair is protected again, every stream the
    // last kill cut has ended and a plain answer came since (the engine
    // serving now finished what it took over, and took new requests), and
    // both kinds are under way: a stream past its first events, a plain
    // request waiting for its answer.
    let mut kills = Vec::new();
    let load =
        |a: &[AtomicUsize]| -> Vec<usize> { a.iter().map(|x| x.load(Ordering::SeqCst)).collect() };
    let mut cut_at_last: Vec<Option<usize>> = vec![None; STREAMERS];
    let mut plains_at_last = 0;
    for k in 0..KILLS {
        let st = until("protected again", LONG, STEP, || {
            env.state(&cd, id)
                .filter(|s| s.pair.protected && s.pair.failovers == k)
        });
        until(
            "the last kill's streams ended, both kinds under way",
            LONG,
            STEP,
            || {
                let ended = load(&sh.completed)
                    .iter()
                    .zip(&cut_at_last)
                    .all(|(now, then)| then.is_none_or(|then| *now > then));
                let answered = sh.plains.load(Ordering::SeqCst) > plains_at_last;
                let streaming = load(&sh.progress)
                    .iter()
                    .any(|p| (UNDER_WAY..STREAM_TOKENS).contains(p));
                let asking = sh.waiting.iter().any(|w| w.load(Ordering::SeqCst));
                (ended && answered && streaming && asking).then_some(())
            },
        );
        let pid = st.active_pid().expect("an active engine") as i32;
        // SAFETY: kill(2) of the active engine's pid from the pair's state file.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
        kills.push(Instant::now());
        let completed = load(&sh.completed);
        cut_at_last = load(&sh.progress)
            .iter()
            .zip(completed)
            .map(|(p, c)| (*p > 0).then_some(c))
            .collect();
        plains_at_last = sh.plains.load(Ordering::SeqCst);
    }
    until("protected after the last kill", LONG, STEP, || {
        env.state(&cd, id)
            .filter(|s| s.pair.protected && s.pair.failovers == KILLS)
    });
    // Streams that began after the last kill, answered too.
    let after = sh.streams.lock().unwrap().len();
    until("streams after the kills", LONG, STEP, || {
        (sh.streams.lock().unwrap().len() >= after + STREAMERS).then_some(())
    });
    sh.stop.store(true, Ordering::SeqCst);
    for c in clients {
        c.join().expect("a client thread");
    }
    // Every connection answered was taken out of the store.
    let st = until("an empty fd store", LONG, STEP, || {
        env.state(&cd, id)
            .filter(|s| s.fdstore.as_ref().is_some_and(|f| f.fds == 0))
    });

    // The figures: the longest silence of each stream a kill cut.
    let streams = sh.streams.lock().unwrap();
    let cut_by_kill = |s: &Seen| {
        let end = s.events.last().map_or(s.started, |e| e.1);
        kills.iter().any(|k| s.started < *k && *k < end)
    };
    let mut cut: Vec<Duration> = streams
        .iter()
        .filter(|s| cut_by_kill(s))
        .map(largest_gap)
        .collect();
    cut.sort();
    let mut calm: Vec<Duration> = streams
        .iter()
        .filter(|s| !cut_by_kill(s))
        .map(largest_gap)
        .collect();
    calm.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "continuity: {KILLS} kills; {} streams ({} cut by a kill), {} plain answers",
        streams.len(),
        cut.len(),
        sh.plains.load(Ordering::SeqCst)
    );
    println!(
        "continuity: largest gap between events of a stream cut by a kill: p50 {:.0} ms, max {:.0} ms (streams no kill cut: p50 {:.0} ms, max {:.0} ms)",
        ms(percentile(&cut, 0.5)),
        ms(percentile(&cut, 1.0)),
        ms(percentile(&calm, 0.5)),
        ms(percentile(&calm, 1.0)),
    );
    let logs = ctr.stdout_so_far();
    let takeovers: Vec<&str> = logs.lines().filter(|l| l.contains("took over")).collect();
    for l in &takeovers {
        println!("continuity: {}", l.trim());
    }
    let [fetched, unread, plain, streamed, done, dropped] = tally(&takeovers);
    println!(
        "continuity: {} takeovers: {fetched} connections fetched, {} resumed (request unread {unread}, plain {plain}, stream {streamed}), done {done}, dropped {dropped}",
        takeovers.len(),
        unread + plain + streamed
    );
    println!("continuity: fd store {:?}", st.fdstore);
    for l in ctr
        .stdout_so_far()
        .lines()
        .filter(|l| l.contains("ready on") || l.contains("KV"))
    {
        println!("continuity: {}", l.trim());
    }
    let (kv_streams, from_pool, again, why) = kv_tally(&ctr.stdout_so_far());
    println!(
        "continuity: KV: {kv_streams} streams gone on with: {from_pool} tokens from the pool, {again} computed again"
    );
    for l in ctr
        .stderr_so_far()
        .lines()
        .filter(|l| l.contains("shadow-engine"))
    {
        println!("continuity: engine said: {}", l.trim());
    }
    // Where each stream a kill cut was silent longest: the pause grows
    // with the tokens the next engine recomputes.
    for (n, s) in streams.iter().enumerate().filter(|(_, s)| cut_by_kill(s)) {
        let mut last = s.head_at.unwrap_or(s.started);
        let (mut gap, mut at) = (Duration::ZERO, 0);
        for (i, (_, t)) in s.events.iter().enumerate() {
            if *t - last > gap {
                (gap, at) = (*t - last, i);
            }
            last = *t;
        }
        println!(
            "continuity: stream {n}: {:.0} ms without events, before event {at}",
            ms(gap)
        );
    }

    let failures = sh.failures.lock().unwrap();
    for (who, f) in failures.iter() {
        // Signed: a kill before the request began is negative.
        let near: Vec<String> = kills
            .iter()
            .map(|k| {
                let after = ms(k.saturating_duration_since(f.at));
                let before = ms(f.at.saturating_duration_since(*k));
                format!("{:+.3}", after - before)
            })
            .collect();
        println!(
            "continuity: FAILED {who}: {:?}: {} (the kills, ms after its request began: {near:?})",
            f.kind, f.what
        );
    }
    let count = |k: Kind| failures.iter().filter(|(_, f)| f.kind == k).count();
    // An engine that accepts loses a connection a SIGKILL catches between
    // its accept and its FDSTORE=1 (docs/engine-contract.md: what no fd
    // store keeps); this test's kills follow completed requests, when a
    // worker frees and the acceptor takes the next connection, so one such
    // reset in a run is the documented gap, not a fault. With the runtime
    // accepting no instant exists where it could happen: none is allowed.
    let gap = usize::from(accept == "engine" && failures.len() == 1 && count(Kind::Reset) == 1);
    if gap == 1 {
        println!("continuity: 1 reset, the accept -> FDSTORE=1 gap of an accepting engine");
    }
    assert!(
        failures.len() == gap,
        "{} requests failed: {} reset, {} refused, {} timed out, {} wrong, {} other",
        failures.len(),
        count(Kind::Reset),
        count(Kind::Refused),
        count(Kind::Timeout),
        count(Kind::Wrong),
        count(Kind::Other)
    );
    assert!(!cut.is_empty(), "no stream was under way at a kill");
    // Every stream a takeover went on with had its sent tokens in the
    // pair's KV pool: none was decoded again.
    assert!(
        from_pool > 0,
        "no stream went on from the KV pool ({kv_streams} gone on with)"
    );
    assert_eq!(again, 0, "tokens computed again: {why:?}");

    cd.ctr()
        .run(&["task", "kill", "-s", "SIGKILL", id])
        .unwrap()
        .assert_success();
    ctr.wait(LONG).unwrap();
    let _ = cd.ctr().run(&["container", "rm", id]);
    cd.assert_no_leftovers();
}
