//! The torch engine (examples/torch-engine) as a shadow pair through
//! containerd on the CPU (`ENGINE_DEVICE=cpu`, GMS host backend): the
//! batching engine whose KV pool and index a promoted engine takes up,
//! exercised whole on a machine without a GPU. `make test-gpu` runs the
//! same engine on the GPU with the figures; this test is its hand-over
//! logic under `make test`, where every CI run sees it.
//!
//! Streams of 256 tokens are under way, concurrently, when the serving
//! engine is SIGKILLed, three times, and once more when its model loop
//! hangs (`POST /test/hang`: the pair's watchdog finds it, the runtime
//! kills it). Each must end whole and identical to
//! the same streams undisturbed; the promoted engine must take the pool
//! up (`adopted`), having mapped only the pool's first allocation before
//! its first step (`pair.gms_kv_chunk` makes the pool several), and the
//! rest after; every cut stream must go on from the pool with no token
//! computed again. A request that shares a prefix of 400 tokens with
//! earlier ones, sent right after each kill (and the hang) while the carried streams
//! run (before the promoted engine has read the dead one's prefix cache
//! in full), must get the undisturbed answer with its prefix from the
//! cache (`usage.prompt_tokens_details.cached_tokens`). Then Delete, and
//! nothing may be left.
//!
//! torch comes from `make vllm-env`'s virtualenv (the vLLM pair test's):
//! without it the test says so and passes, unless `CI` is set or `make
//! test` runs it (`SHADOW_VLLM_REQUIRED=1`): there it fails. The verdict
//! never depends on how long anything took; the longest silence each cut
//! stream saw is printed for reading.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::Value;
use shadow_contract::annotations::{LISTEN, WATCHDOG};
use shadow_tests::bench::signal;
use shadow_tests::pair::{free_port, PairEnv};
use shadow_tests::vllm::{self, protected, Install, LogOnPanic};
use shadow_tests::wait::until;
use shadow_tests::Containerd;

const ENGINE: &str = env!("CARGO_BIN_EXE_test-engine");
/// Only something broken takes this long: an engine starts in seconds
/// (torch's import, a model of 2 layers).
const LONG: Duration = Duration::from_secs(240);
const STEP: Duration = Duration::from_millis(5);
const KILLS: usize = 3;
/// The pair's watchdog (`shadow.dev/watchdog`): generous, for two engines
/// on two cores; the engine pings each half of it.
const WATCHDOG_S: &str = "2s";
const STREAMS: usize = 4;
const TOKENS: usize = 256;
/// Events every stream must have had for a kill to cut them all.
const UNDER_WAY: usize = 16;
/// The prefix the plain requests share: 400 tokens (one per byte), 25
/// blocks of 16.
const PREFIX_TOKENS: usize = 400;
/// The pool: 62 MiB in allocations of 1 MiB (`gms_kv_chunk`): the most
/// one grant carries (64 descriptors with the index's and the fence's), as
/// a pool that fills a GPU has, so that a promoted engine's descriptor
/// table would grow at its grant if it had not been made room in.
const KV_GIB: &str = "0.060546875";
const KV_BYTES: u64 = 62 << 20;
const KV_CHUNK: u64 = 1 << 20;

/// One streamed completion as its client saw it.
struct Seen {
    text: String,
    done: bool,
    /// The longest silence between two events.
    longest_gap: Duration,
}

/// Streams `prompt` from the pair; `progress` counts its events as they
/// come. Err says what broke.
fn stream(
    port: u16,
    prompt: &str,
    progress: &std::sync::atomic::AtomicUsize,
) -> Result<Seen, String> {
    let body =
        serde_json::json!({"prompt": prompt, "max_tokens": TOKENS, "stream": true}).to_string();
    let mut c = send(port, "/v1/completions", &body)?;
    let (mut raw, mut buf) = (Vec::new(), [0u8; 4096]);
    let (mut events, mut last, mut longest_gap) = (0, Instant::now(), Duration::ZERO);
    loop {
        let n = c
            .read(&mut buf)
            .map_err(|e| format!("read after {events} events: {e}"))?;
        if n == 0 {
            break;
        }
        raw.extend_from_slice(&buf[..n]);
        let now = raw.windows(2).filter(|w| w == b"\n\n").count();
        if now > events {
            longest_gap = longest_gap.max(last.elapsed());
            last = Instant::now();
            events = now;
            progress.store(events, std::sync::atomic::Ordering::SeqCst);
        }
    }
    let raw = String::from_utf8(raw).map_err(|e| format!("not UTF-8: {e}"))?;
    let (head, body) = raw
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("no header end in {:?}", &raw[..raw.len().min(200)]))?;
    if !head.starts_with("HTTP/1.1 200") || !head.contains("text/event-stream") {
        return Err(format!("not a stream: {head:?}"));
    }
    let (mut text, mut done) = (String::new(), false);
    for event in body.split("\n\n").filter(|e| !e.is_empty()) {
        let data = event
            .strip_prefix("data: ")
            .ok_or_else(|| format!("not an event: {event:?}"))?;
        if done {
            return Err(format!("an event after [DONE]: {data:?}"));
        }
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let v: Value = serde_json::from_str(data).map_err(|e| format!("event {data:?}: {e}"))?;
        text.push_str(v["choices"][0]["text"].as_str().unwrap_or_default());
    }
    Ok(Seen {
        text,
        done,
        longest_gap,
    })
}

/// A connection to the pair with the request `POST path` and `body` sent
/// (the engine closes it after its answer).
fn send(port: u16, path: &str, body: &str) -> Result<TcpStream, String> {
    let mut c = TcpStream::connect(("127.0.0.1", port)).map_err(|e| format!("connect: {e}"))?;
    c.set_read_timeout(Some(Duration::from_secs(60)))
        .map_err(|e| format!("set timeout: {e}"))?;
    write!(
        c,
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .map_err(|e| format!("send: {e}"))?;
    Ok(c)
}

/// POST `path` with `body`: the status line and the body.
fn post(port: u16, path: &str, body: &str) -> Result<(String, String), String> {
    let mut c = send(port, path, body)?;
    let mut raw = String::new();
    c.read_to_string(&mut raw)
        .map_err(|e| format!("read: {e}"))?;
    let (head, body) = raw
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("no header end in {raw:?}"))?;
    let status = head.lines().next().unwrap_or_default().to_owned();
    Ok((status, body.to_owned()))
}

/// A plain completion of `prompt`: its text and the prompt tokens its
/// usage says came from the prefix cache.
fn plain(port: u16, prompt: &str) -> Result<(String, u64), String> {
    let request = serde_json::json!({"prompt": prompt, "max_tokens": 16}).to_string();
    let (status, body) = post(port, "/v1/completions", &request)?;
    if !status.starts_with("HTTP/1.1 200") {
        return Err(format!("{status:?} {body:?}"));
    }
    let v: Value = serde_json::from_str(&body).map_err(|e| format!("{body:?}: {e}"))?;
    let text = v["choices"][0]["text"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .ok_or_else(|| format!("no cached_tokens in {body}"))?;
    Ok((text, cached))
}

/// The streams of `prompts`, concurrently; `then` runs once every one has
/// had [`UNDER_WAY`] events (all of them under way), while they go on.
fn streams_together(port: u16, prompts: &[String], then: impl FnOnce()) -> Vec<Seen> {
    let progress: Vec<std::sync::atomic::AtomicUsize> =
        prompts.iter().map(|_| Default::default()).collect();
    std::thread::scope(|scope| {
        let clients: Vec<_> = prompts
            .iter()
            .zip(&progress)
            .map(|(p, n)| scope.spawn(move || stream(port, p, n)))
            .collect();
        until(
            "every stream under way",
            LONG,
            Duration::from_millis(1),
            || {
                progress
                    .iter()
                    .all(|n| n.load(std::sync::atomic::Ordering::SeqCst) >= UNDER_WAY)
                    .then_some(())
            },
        );
        then();
        clients
            .into_iter()
            .enumerate()
            .map(|(i, c)| {
                let seen = c.join().expect("a client thread");
                seen.unwrap_or_else(|why| panic!("stream {i}: {why}"))
            })
            .collect()
    })
}

/// The engines' JSON lines of `event`.
fn events<'a>(log: &'a str, event: &'a str) -> impl Iterator<Item = Value> + 'a {
    log.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l.trim()).ok())
        .filter(move |v| v["event"] == event)
}

#[test]
fn torch_engine_pair_on_the_cpu_carries_streams_through_sigkills() {
    let Some(install) = Install::for_test(Path::new(ENGINE)) else {
        return;
    };
    let repo = std::fs::canonicalize(Path::new(env!("CARGO_MANIFEST_DIR")).join(".."))
        .expect("the repository");
    let libgms = vllm::build_dir(Path::new(ENGINE)).join("debug/libgms.so");
    assert!(
        libgms.is_file(),
        "{} missing: `cargo build --workspace` (make test's build) makes it",
        libgms.display()
    );
    let cd = Containerd::start().expect("containerd");
    let env =
        PairEnv::new(&cd, &format!("gms = \"host\"\ngms_kv_chunk = {KV_CHUNK}")).expect("config");
    let mut binds = vec![
        install.python_home().unwrap_or_else(|e| panic!("{e}")),
        install.venv.clone(),
        repo.join("examples/torch-engine"),
        repo.join("gms/python"),
        libgms.clone(),
    ];
    binds.retain(|b| !b.starts_with("/usr"));
    let (root, mut flags) = vllm::rootfs(cd.dir(), &binds, None).expect("the rootfs");
    for kv in [
        "ENGINE_DEVICE=cpu".to_owned(),
        "ENGINE_LAYERS=2".to_owned(),
        "ENGINE_HIDDEN=256".to_owned(),
        format!("ENGINE_KV_GIB={KV_GIB}"),
        format!("GMS_LIB={}", libgms.display()),
        // Two engines on two cores: one thread each.
        "OMP_NUM_THREADS=1".to_owned(),
        "PYTHONDONTWRITEBYTECODE=1".to_owned(),
        "PYTHONUNBUFFERED=1".to_owned(),
        "HOME=/tmp".to_owned(),
        // POST /test/hang, for the last round.
        "SHADOW_TEST_HANG=1".to_owned(),
    ] {
        flags.extend(["--env".to_owned(), kv]);
    }
    flags.extend(["--rm".into(), "--net-host".into()]);
    let port = free_port();
    let listen = format!("tcp:127.0.0.1:{port}");
    let id = "torch-cpu";
    let cmd = [
        install.venv.join("bin/python").display().to_string(),
        repo.join("examples/torch-engine/engine.py")
            .display()
            .to_string(),
    ];
    let ctr = env
        .container(&cd, id)
        .rootfs(&root)
        .annotation(LISTEN, &listen)
        .annotation(WATCHDOG, WATCHDOG_S)
        .flags(&flags)
        .cmd(&cmd)
        .spawn(false)
        .expect("ctr run");
    let log = LogOnPanic(&ctr, "the pair");
    until("the torch pair protected", LONG, STEP, || {
        env.state(&cd, id).filter(|s| protected(s).is_some())
    });

    let prompts: Vec<String> = (0..STREAMS)
        .map(|i| format!("stream {i} of the torch engine's pair, carried through a kill"))
        .collect();
    let want: Vec<String> = streams_together(port, &prompts, || {})
        .into_iter()
        .map(|s| {
            assert!(s.done, "an undisturbed stream without [DONE]");
            s.text
        })
        .collect();
    assert!(want.iter().all(|t| t.chars().count() == TOKENS), "{want:?}");
    let prefix: String = "the prefix all these requests share. "
        .chars()
        .cycle()
        .take(PREFIX_TOKENS)
        .collect();
    let shared = format!("{prefix}which engine answers?");
    plain(port, &format!("{prefix}a first question")).expect("the prefix's first request");
    let (want_shared, cached) = plain(port, &shared).expect("a request sharing the prefix");
    let prefix_blocks = (PREFIX_TOKENS / 16 * 16) as u64;
    assert!(
        cached >= prefix_blocks,
        "{cached} prompt tokens from the cache, before any kill"
    );

    let mut gaps = Vec::new();
    // The last round hangs the serving engine's model loop instead: the
    // watchdog finds it, the runtime kills it.
    let mut hang_gaps = Vec::new();
    for round in 0..=KILLS {
        let hang = round == KILLS;
        let st = until("the pair protected", LONG, STEP, || {
            env.state(&cd, id).filter(|s| protected(s).is_some())
        });
        let (_, pid, _) = protected(&st).expect("protected");
        let mut after = None;
        let seen = streams_together(port, &prompts, || {
            if hang {
                let (status, body) = post(port, "/test/hang", "{}")
                    .unwrap_or_else(|why| panic!("round {round}: POST /test/hang: {why}"));
                assert!(status.starts_with("HTTP/1.1 200"), "{status} {body}");
            } else {
                assert!(
                    signal(pid, libc::SIGKILL),
                    "round {round}: kill {pid}: {}",
                    std::io::Error::last_os_error()
                );
            }
            after = Some(plain(port, &shared));
        });
        let (text, cached) = after
            .expect("asked")
            .unwrap_or_else(|why| panic!("round {round}: the request sharing the prefix: {why}"));
        assert_eq!(
            text, want_shared,
            "round {round}: the request sharing the prefix"
        );
        assert!(
            cached >= prefix_blocks,
            "round {round}: only {cached} prompt tokens from the cache right after the kill"
        );
        for (i, s) in seen.iter().enumerate() {
            assert!(s.done, "round {round}, stream {i}: no [DONE]");
            assert_eq!(
                s.text, want[i],
                "round {round}, stream {i}: not the undisturbed text"
            );
            if hang {
                hang_gaps.push(s.longest_gap);
            } else {
                gaps.push(s.longest_gap);
            }
        }
        until("the killed slot parked again", LONG, STEP, || {
            env.state(&cd, id)
                .filter(|s| protected(s).is_some_and(|(_, active, _)| active != pid))
        });
    }
    gaps.sort();
    println!(
        "torch engine on the CPU: longest silence of a cut stream, p50 / max: {:?} / {:?}; \
         through the hang (watchdog {WATCHDOG_S}): {hang_gaps:?}",
        gaps[gaps.len() / 2],
        gaps[gaps.len() - 1]
    );
    let st = env.state(&cd, id).expect("the pair's state");
    assert_eq!(
        st.pair.hangs.watchdog, 1,
        "the hang was the watchdog's to find"
    );

    let out = ctr.stdout_so_far();
    // The pair's first engine made the pool; each promoted one took it up,
    // with only the first allocation mapped before its first step.
    let grants: Vec<Value> = events(&out, "kv-pool").collect();
    let adopted: Vec<&Value> = grants.iter().filter(|g| g["how"] == "adopted").collect();
    assert_eq!(
        grants.len(),
        KILLS + 2,
        "one grant per engine that served: {grants:?}"
    );
    assert_eq!(
        adopted.len(),
        KILLS + 1,
        "every promoted engine took the pool up: {grants:?}"
    );
    for g in &adopted {
        assert_eq!(g["bytes"].as_u64(), Some(KV_BYTES), "{g}");
        assert_eq!(
            g["mapped_at_grant"].as_u64(),
            Some(KV_CHUNK),
            "only the first allocation mapped at the grant: {g}"
        );
    }
    // The descriptor table was made room in while parked: the grant's
    // descriptors did not grow it (a growth waits for an RCU grace period
    // on the failover's path).
    let mut parked_table = std::collections::HashMap::new();
    for e in out
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l.trim()).ok())
    {
        if e["event"] == "parked" {
            parked_table.insert(e["engine"].to_string(), e["fd_table"].clone());
        } else if e["event"] == "kv-pool" && e["how"] == "adopted" {
            let parked = parked_table.get(&e["engine"].to_string());
            assert!(
                e["fd_table"].as_u64().is_some() && parked == Some(&e["fd_table"]),
                "the descriptor table grew between park ({parked:?}) and the grant: {e}"
            );
        }
    }
    let mapped: Vec<Value> = events(&out, "kv-pool-mapped").collect();
    assert_eq!(
        mapped.len(),
        grants.len(),
        "the whole pool mapped after each grant: {mapped:?}"
    );
    assert!(
        mapped.iter().all(|m| m["bytes"].as_u64() == Some(KV_BYTES)),
        "{mapped:?}"
    );
    // Every cut stream went on from the pool, nothing computed again.
    let carried: Vec<Value> = events(&out, "kv-carried").collect();
    assert_eq!(
        carried.len(),
        (KILLS + 1) * STREAMS,
        "every stream cut by a kill was taken up from the pool: {carried:?}"
    );
    assert!(
        carried
            .iter()
            .all(|c| c["from_pool"].as_u64().unwrap_or(0) > 0),
        "{carried:?}"
    );
    let again: Vec<Value> = events(&out, "kv-stream-done")
        .filter(|e| e["computed_again"].as_u64().unwrap_or(0) > 0)
        .collect();
    assert!(again.is_empty(), "tokens computed again: {again:?}");
    println!(
        "torch engine on the CPU: {} streams carried, {} positions from the pool, grants {:?} ms",
        carried.len(),
        carried
            .iter()
            .map(|c| c["from_pool"].as_u64().unwrap_or(0))
            .sum::<u64>(),
        adopted
            .iter()
            .map(|g| g["grant_ms"].clone())
            .collect::<Vec<_>>()
    );

    for r in events(&out, "kv-prefix-read") {
        println!("torch engine on the CPU: the dead engine's prefix cache read: {r}");
    }
    for a in events(&out, "first-answer") {
        println!("torch engine on the CPU: first answer after the lock, in parts (ms): {a}");
    }

    drop(log);
    // Delete: nothing of containerd's, no pair dir, no metrics file left.
    env.stop(&cd, id, "SIGKILL", ctr, LONG);
}
