//! The reference engine's watchdog pings, as a process of its own (no
//! container, no root): the test plays the runtime's part, with the
//! notify socket, the lock held by "the other engine", and
//! `WATCHDOG_USEC`. A parked engine pings while it waits for the lock,
//! wakes when it is released, and pings while it serves and while it
//! computes a long answer.

use std::os::unix::net::UnixDatagram;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use nix::fcntl::{Flock, FlockArg};
mod common;

use common::Engine;
use serde_json::Value;
use shadow_tests::pair::free_port;

/// Only a broken engine makes a test wait this long.
const LIMIT: Duration = Duration::from_secs(20);

/// The lines the engine sent on the notify socket (a datagram may hold
/// several), read as they come by a thread of their own, as the runtime
/// reads them: an engine must never wait for the socket to have room.
struct Notes(mpsc::Receiver<String>);

impl Notes {
    fn read(sock: UnixDatagram) -> Notes {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = sock.recv(&mut buf) {
                for l in String::from_utf8_lossy(&buf[..n]).lines() {
                    if tx.send(l.to_owned()).is_err() {
                        return;
                    }
                }
            }
        });
        Notes(rx)
    }

    fn next(&mut self) -> String {
        self.0
            .recv_timeout(LIMIT)
            .expect("a notification before the limit")
    }

    /// Reads until `line`; returns how many `WATCHDOG=1` came before it.
    fn until(&mut self, line: &str) -> usize {
        let mut pings = 0;
        loop {
            match self.next() {
                l if l == line => return pings,
                l if l == "WATCHDOG=1" => pings += 1,
                _ => {}
            }
        }
    }
}

fn complete(port: u16, prompt: &str, max_tokens: usize) -> Option<Value> {
    common::complete(port, prompt, max_tokens, LIMIT)
}

#[test]
fn pings_while_parked_and_while_serving() {
    let d = tempfile::tempdir().unwrap();
    let weights = d.path().join("weights.safetensors");
    shadow_engine::model::generate(&weights, 2, 5).unwrap();
    let lock_path = d.path().join("engine.lock");
    std::fs::write(&lock_path, b"").unwrap();
    let other = Flock::lock(
        std::fs::File::open(&lock_path).unwrap(),
        FlockArg::LockExclusive,
    )
    .unwrap();
    let notify_path = d.path().join("notify.sock");
    let mut notes = Notes::read(UnixDatagram::bind(&notify_path).unwrap());
    let port = free_port();
    let _engine = Engine(
        Command::new(env!("CARGO_BIN_EXE_shadow-engine"))
            .args(["serve", "--kv-mib", "1", "--port", &port.to_string()])
            .arg("--weights")
            .arg(&weights)
            .env("NOTIFY_SOCKET", &notify_path)
            .env("SHADOW_LOCK_PATH", &lock_path)
            .env("SHADOW_ENGINE_ID", "0")
            // 50 ms: a ping every 25 ms.
            .env("WATCHDOG_USEC", "50000")
            .env_remove("WATCHDOG_PID")
            .env_remove("GMS_SOCKET_DIR")
            .env_remove("LISTEN_FDS")
            .env_remove("LISTEN_PID")
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );

    assert_eq!(notes.until("STATUS=parked"), 0, "no ping before parking");
    // Parked behind the other engine's lock: it pings, and is not ready.
    for _ in 0..3 {
        assert_eq!(notes.next(), "WATCHDOG=1");
    }
    // The other engine dies: this one wakes and serves.
    drop(other);
    notes.until("READY=1");
    for _ in 0..3 {
        assert_eq!(notes.next(), "WATCHDOG=1", "serving, idle");
    }
    // Long answers (256 decode steps each) from every worker at once,
    // half of them streamed: answered, and the pings go on throughout.
    let answers: Vec<_> = (0..8)
        .map(|i| std::thread::spawn(move || complete(port, &format!("prompt {i}"), 256)))
        .collect();
    let streams: Vec<_> = (0..8)
        .map(|i| {
            std::thread::spawn(move || common::stream(port, &format!("stream {i}"), 256, LIMIT))
        })
        .collect();
    for a in answers {
        let v = a.join().unwrap().expect("an answer");
        assert_eq!(v["usage"]["completion_tokens"], 256);
    }
    for s in streams {
        let ev = common::events(&s.join().unwrap().expect("a stream"));
        // 256 tokens, the last event, [DONE].
        assert_eq!(ev.len(), 256 + 2);
        assert_eq!(ev[ev.len() - 1], "[DONE]");
    }
    for _ in 0..3 {
        assert_eq!(notes.next(), "WATCHDOG=1", "serving after the answers");
    }
}

/// A runtime that stops reading its notify socket fills it: the pings
/// are lost, but the engine never waits for room, and goes on serving.
#[test]
fn a_full_notify_socket_never_stalls_the_engine() {
    let d = tempfile::tempdir().unwrap();
    let weights = d.path().join("weights.safetensors");
    shadow_engine::model::generate(&weights, 2, 5).unwrap();
    let notify_path = d.path().join("notify.sock");
    // Bound, never read.
    let _sock = UnixDatagram::bind(&notify_path).unwrap();
    let port = free_port();
    let _engine = Engine(
        Command::new(env!("CARGO_BIN_EXE_shadow-engine"))
            .args(["serve", "--kv-mib", "1", "--port", &port.to_string()])
            .arg("--weights")
            .arg(&weights)
            .env("NOTIFY_SOCKET", &notify_path)
            // A ping each millisecond: the socket's queue is full at once.
            .env("WATCHDOG_USEC", "2000")
            .env_remove("SHADOW_LOCK_PATH")
            .env_remove("WATCHDOG_PID")
            .env_remove("GMS_SOCKET_DIR")
            .env_remove("LISTEN_FDS")
            .env_remove("LISTEN_PID")
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let first = shadow_tests::wait::until(
        "the engine serves",
        LIMIT,
        Duration::from_millis(20),
        || complete(port, "first", 4),
    );
    assert_eq!(first["usage"]["completion_tokens"], 4);
    for i in 0..3 {
        let v = complete(port, &format!("long {i}"), 256).expect("an answer");
        assert_eq!(v["usage"]["completion_tokens"], 256);
    }
}
