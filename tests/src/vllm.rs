//! vLLM through containerd, shared by the vLLM pair test
//! (`tests/tests/vllm.rs`) and `make bench-vllm` (`bench_vllm.rs`): where
//! the virtualenv and the model are, the container's rootfs, how a
//! `shadow-vllm serve` engine is started, one greedy completion over HTTP
//! and what it came to, a client's stream of them, when a pair is
//! protected, and the processes and memory of one engine and when a
//! killed one's are all gone.
//!
//! Why here: the test and the bench must start the very same engine (same
//! rootfs, arguments and environment), or the bench's figures would be of
//! something the test does not check.
//!
//! The rootfs is what an image built on this machine would hold, without
//! the minutes a 6 GB image import would cost: a directory of mount
//! points, with the host's `/usr` and `/etc`, the python that made the
//! virtualenv, the virtualenv (`make vllm-env`, absolute paths inside) and
//! the model (`make vllm-model`) bound read-only at their own paths.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use shadow_contract::state::{EngineState, PairState};

use crate::wait::poll;
use crate::Spawned;

/// What each engine of a pair logs when it sets
/// `VLLM_CPU_OMP_THREADS_BIND=nobind`, its default there.
pub const NOBIND_DEFAULT_LOG: &str = "VLLM_CPU_OMP_THREADS_BIND=nobind: the default in a pair";

/// The name the engines serve the model under (`--served-model-name`).
pub const MODEL_NAME: &str = "tiny-llama";

/// The environment every vLLM engine of the test and the bench gets.
pub const ENV: &[&str] = &[
    // vLLM writes caches under $HOME/.cache; /tmp is the container's own.
    "HOME=/tmp",
    "PYTHONUNBUFFERED=1",
    // The KV cache of the CPU backend, GiB: the tiny model needs little.
    "VLLM_CPU_KVCACHE_SPACE=1",
    // No VLLM_CPU_OMP_THREADS_BIND: in a pair shadow-vllm makes it
    // `nobind` when it is not set (docs/vllm.md, "With `ctr`"), as the
    // pair test checks; the bench's runc-v2 engine gets it by hand.
    "VLLM_NO_USAGE_STATS=1",
    "HF_HUB_OFFLINE=1",
    "TRANSFORMERS_OFFLINE=1",
];

/// `vllm serve`'s arguments after the model, for the tiny model on a CPU.
pub const SERVE_ARGS: &[&str] = &[
    "--served-model-name",
    MODEL_NAME,
    "--enforce-eager",
    "--max-model-len",
    "256",
    "--dtype",
    "float32",
];

/// The size of a container's own `/dev/shm`: vLLM's CPU build puts two
/// shared-memory ring buffers there (160 and 240 MiB) and refuses to start
/// in the 64 MiB of `ctr`'s default.
pub const OWN_SHM: &str = "1g";

/// What `make vllm-env` and `make vllm-model` made.
#[derive(Debug, Clone)]
pub struct Install {
    /// The virtualenv with `bin/shadow-vllm`.
    pub venv: PathBuf,
    /// The model directory (`config.json`, weights, tokenizer).
    pub model: PathBuf,
}

impl Install {
    /// What `make vllm-env vllm-model` made under the build dir of the
    /// binary `exe` (a test's `env!("CARGO_BIN_EXE_…")`: `<target>/debug/…`),
    /// or None when a test is to be skipped, having said so. Under `CI`
    /// or `make test` (`SHADOW_VLLM_REQUIRED=1`) a missing one fails it.
    pub fn for_test(exe: &Path) -> Option<Install> {
        match Install::find(&build_dir(exe)) {
            Ok(install) => Some(install),
            Err(msg) => {
                assert!(!required(), "{msg} (required under CI and `make test`)");
                eprintln!("SKIPPED: {msg}");
                None
            }
        }
    }

    /// Under the build dir `target`; Err says what is missing and how to
    /// make it.
    pub fn find(target: &Path) -> Result<Install, String> {
        let (venv, model) = (target.join("vllm-venv"), target.join("vllm-model"));
        if venv.join("bin/shadow-vllm").is_file() && model.join("config.json").is_file() {
            return Ok(Install { venv, model });
        }
        Err(format!(
            "no vLLM virtualenv or model ({} with bin/shadow-vllm, {} with config.json): run `make vllm-env vllm-model`",
            venv.display(),
            model.display()
        ))
    }

    /// Where python really lives: the venv's `bin/python` resolved, two
    /// levels up (`…/versions/3.11.x`, or `/usr`), which holds its
    /// standard library.
    pub fn python_home(&self) -> Result<PathBuf, String> {
        let python = self.venv.join("bin/python");
        let real =
            std::fs::canonicalize(&python).map_err(|e| format!("{}: {e}", python.display()))?;
        real.parent()
            .and_then(Path::parent)
            .map(Path::to_path_buf)
            .ok_or_else(|| format!("python at {} has no prefix", real.display()))
    }

    /// What the rootfs binds besides the host's system: python, the venv,
    /// the model, and the repository's Python sources (`make vllm-env`
    /// installs shadow-vllm and shadow_gms editable: the venv points into
    /// the repository for them).
    pub fn binds(&self, repo: &Path) -> Result<Vec<PathBuf>, String> {
        let mut binds = vec![self.python_home()?, self.venv.clone(), self.model.clone()];
        for source in ["integrations/vllm", "gms/python"] {
            if let Ok(dir) = std::fs::canonicalize(repo.join(source)) {
                binds.push(dir);
            }
        }
        // /usr is bound whole already.
        binds.retain(|b| !b.starts_with("/usr"));
        Ok(binds)
    }

    /// The container's command: `shadow-vllm serve MODEL` with
    /// [`SERVE_ARGS`] and `extra`.
    pub fn serve_cmd(&self, extra: &[&str]) -> Vec<String> {
        let mut cmd = vec![
            self.venv.join("bin/shadow-vllm").display().to_string(),
            "serve".to_owned(),
            self.model.display().to_string(),
        ];
        cmd.extend(SERVE_ARGS.iter().chain(extra).map(|s| (*s).to_owned()));
        cmd
    }
}

/// The build dir (`target`, or `$CARGO_TARGET_DIR`) of a binary of it,
/// `<target>/debug/<exe>`.
pub fn build_dir(exe: &Path) -> PathBuf {
    exe.parent()
        .and_then(Path::parent)
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("target"))
}

/// Whether a missing virtualenv fails a test rather than skips it.
fn required() -> bool {
    let set = |k: &str| {
        std::env::var(k)
            .ok()
            .is_some_and(|v| !v.is_empty() && v != "0" && v != "false")
    };
    set("CI") || set("SHADOW_VLLM_REQUIRED")
}

/// `--env K=V` for each of [`ENV`].
pub fn env_flags() -> Vec<String> {
    ENV.iter()
        .flat_map(|kv| ["--env".to_owned(), (*kv).to_owned()])
        .collect()
}

/// The rootfs under `dir`: mount points, and the host's top-level symlinks
/// (Debian's merged /usr: /bin → usr/bin, …) as they are. Returns its path
/// and the `ctr run` flags that bind `binds` (directories or files)
/// read-only at their own paths, a private writable `/tmp`, and `shm` at
/// `/dev/shm` when given, else a tmpfs of [`OWN_SHM`] of each container's
/// (and each engine's) own.
pub fn rootfs(
    dir: &Path,
    binds: &[PathBuf],
    shm: Option<&Path>,
) -> std::io::Result<(PathBuf, Vec<String>)> {
    let root = dir.join("vllm-rootfs");
    for d in ["proc", "sys", "dev", "tmp", "run", "root", "usr", "etc"] {
        std::fs::create_dir_all(root.join(d))?;
    }
    let mut flags = Vec::new();
    let mut bind = |src: &Path, dst: &Path, mode: &str| -> std::io::Result<()> {
        let at = root.join(dst.strip_prefix("/").unwrap_or(dst));
        if src.is_file() {
            // A file is bound onto a file.
            if let Some(parent) = at.parent() {
                std::fs::create_dir_all(parent)?;
            }
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&at)?;
        } else {
            std::fs::create_dir_all(&at)?;
        }
        flags.push("--mount".to_owned());
        flags.push(format!(
            "type=bind,src={},dst={},options=rbind:{mode}",
            src.display(),
            dst.display()
        ));
        Ok(())
    };
    for system in ["/usr", "/etc"] {
        bind(Path::new(system), Path::new(system), "ro")?;
    }
    for top in ["bin", "sbin", "lib", "lib32", "lib64", "libx32"] {
        let host = Path::new("/").join(top);
        match std::fs::read_link(&host) {
            Ok(to) => {
                let link = root.join(top);
                if std::fs::symlink_metadata(&link).is_err() {
                    std::os::unix::fs::symlink(to, link)?;
                }
            }
            Err(_) if host.is_dir() => bind(&host, &host, "ro")?,
            Err(_) => {}
        }
    }
    for b in binds {
        bind(b, b, "ro")?;
    }
    let tmp = dir.join("vllm-tmp");
    std::fs::create_dir_all(&tmp)?;
    bind(&tmp, Path::new("/tmp"), "rw")?;
    match shm {
        Some(shm) => bind(shm, Path::new("/dev/shm"), "rw")?,
        None => {
            flags.push("--mount".to_owned());
            flags.push(format!(
                "type=tmpfs,src=shm,dst=/dev/shm,options=nosuid:nodev:mode=1777:size={OWN_SHM}"
            ));
        }
    }
    Ok((root, flags))
}

/// What one request came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The completion's text (or, for [`get`], the status line's code).
    Text(String),
    /// An HTTP answer other than 200 (its status and the start of its body).
    Http(String),
    /// connect(2) refused: nobody listened.
    Refused,
    /// Connected, then reset or closed before a whole answer.
    Reset,
    Timeout,
}

impl Outcome {
    pub fn kind(&self) -> &'static str {
        match self {
            Outcome::Text(_) => "text",
            Outcome::Http(_) => "http-error",
            Outcome::Refused => "refused",
            Outcome::Reset => "reset",
            Outcome::Timeout => "timeout",
        }
    }

    pub fn is_text(&self) -> bool {
        matches!(self, Outcome::Text(_))
    }
}

/// One request's outcome and when its answer's first byte came (None
/// when none came).
#[derive(Debug, Clone)]
pub struct Timed {
    pub outcome: Outcome,
    pub first_byte: Option<Instant>,
}

fn connect(port: u16, timeout: Duration) -> Result<TcpStream, Outcome> {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    match TcpStream::connect_timeout(&addr, timeout) {
        Ok(s) => Ok(s),
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => Err(Outcome::Refused),
        Err(_) => Err(Outcome::Timeout),
    }
}

/// Sends `request` on a new connection and reads the answer to its end
/// (`Connection: close`); splits status and body.
fn exchange(
    port: u16,
    request: &str,
    timeout: Duration,
) -> (Result<(String, String), Outcome>, Option<Instant>) {
    let mut s = match connect(port, timeout) {
        Ok(s) => s,
        Err(o) => return (Err(o), None),
    };
    let _ = s.set_read_timeout(Some(timeout));
    if s.write_all(request.as_bytes()).is_err() {
        return (Err(Outcome::Reset), None);
    }
    let mut raw = Vec::new();
    let mut first_byte = None;
    let mut buf = [0u8; 16 * 1024];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                first_byte.get_or_insert_with(Instant::now);
                raw.extend_from_slice(&buf[..n]);
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return (Err(Outcome::Timeout), first_byte)
            }
            Err(_) => return (Err(Outcome::Reset), first_byte),
        }
    }
    let text = String::from_utf8_lossy(&raw);
    let Some((head, body)) = text.split_once("\r\n\r\n") else {
        return (Err(Outcome::Reset), first_byte);
    };
    let status = head.split_whitespace().nth(1).unwrap_or("").to_owned();
    (Ok((status, body.to_owned())), first_byte)
}

/// A greedy completion of `prompt` (`max_tokens` tokens) on a new
/// connection to 127.0.0.1:`port`.
pub fn complete_timed(port: u16, prompt: &str, max_tokens: u32, timeout: Duration) -> Timed {
    let body = serde_json::json!({
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
    })
    .to_string();
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let (answer, first_byte) = exchange(port, &request, timeout);
    let outcome = match answer {
        Err(o) => o,
        Ok((status, body)) if status != "200" => {
            let start: String = body.chars().take(200).collect();
            Outcome::Http(format!("{status} {start}"))
        }
        // Connection: close and a JSON answer: the body is whole when it parses.
        Ok((_, body)) => match serde_json::from_str::<serde_json::Value>(&body) {
            Ok(v) => match v.pointer("/choices/0/text").and_then(|t| t.as_str()) {
                Some(t) => Outcome::Text(t.to_owned()),
                None => Outcome::Http(format!("200 without a text: {body}")),
            },
            Err(_) => Outcome::Reset,
        },
    };
    Timed {
        outcome,
        first_byte,
    }
}

/// [`complete_timed`]'s outcome alone.
pub fn complete(port: u16, prompt: &str, max_tokens: u32, timeout: Duration) -> Outcome {
    complete_timed(port, prompt, max_tokens, timeout).outcome
}

/// `GET path` on a new connection; a 200 is `Text("200")`.
pub fn get(port: u16, path: &str, timeout: Duration) -> Timed {
    let request =
        format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n");
    let (answer, first_byte) = exchange(port, &request, timeout);
    let outcome = match answer {
        Err(o) => o,
        Ok((status, _)) if status == "200" => Outcome::Text(status),
        Ok((status, body)) => {
            let start: String = body.chars().take(200).collect();
            Outcome::Http(format!("{status} {start}"))
        }
    };
    Timed {
        outcome,
        first_byte,
    }
}

/// The active slot and its pid, with the parked shadow's pid: Some once
/// the pair is protected.
pub fn protected(st: &PairState) -> Option<(u8, u32, u32)> {
    if !st.pair.protected {
        return None;
    }
    let active = st.pair.active?;
    let shadow = st
        .pair
        .slots
        .iter()
        .find(|s| s.id != active && s.state == EngineState::Parked)?;
    Some((active, st.pid_of(active)?, shadow.pid?))
}

/// One request of a [`Stream`].
#[derive(Debug, Clone)]
pub struct Done {
    pub started: Instant,
    pub ended: Instant,
    pub outcome: Outcome,
}

/// A client's greedy completions, one after another on new connections,
/// each `pause` after the last one's end, until [`Stream::stop`]: [`run`]
/// on a thread of its own, read by the test's or the bench's.
///
/// [`run`]: Stream::run
pub struct Stream {
    port: u16,
    prompt: String,
    max_tokens: u32,
    timeout: Duration,
    pause: Duration,
    done: Mutex<Vec<Done>>,
    stop: AtomicBool,
    /// Bumped by [`Stream::kick`] and [`Stream::stop`]: the pause ends.
    kicks: Mutex<u64>,
    kicked: Condvar,
}

impl Stream {
    pub fn new(
        port: u16,
        prompt: &str,
        max_tokens: u32,
        timeout: Duration,
        pause: Duration,
    ) -> Stream {
        Stream {
            port,
            prompt: prompt.to_owned(),
            max_tokens,
            timeout,
            pause,
            done: Mutex::new(Vec::new()),
            stop: AtomicBool::new(false),
            kicks: Mutex::new(0),
            kicked: Condvar::new(),
        }
    }

    fn kicks(&self) -> u64 {
        *self.kicks.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The client: requests until stopped.
    pub fn run(&self) {
        while !self.stop.load(Ordering::Acquire) {
            let seen = self.kicks();
            let started = Instant::now();
            let outcome = complete(self.port, &self.prompt, self.max_tokens, self.timeout);
            let ended = Instant::now();
            self.done
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(Done {
                    started,
                    ended,
                    outcome,
                });
            // Deliberate pacing of the stream, not a wait for an event:
            // the pause leaves the CPU to engines that start beside it. A
            // kick (or stop) since the request started ends it at once.
            let kicks = self.kicks.lock().unwrap_or_else(|p| p.into_inner());
            let _ = self
                .kicked
                .wait_timeout_while(kicks, self.pause, |k| *k == seen);
        }
    }

    /// Ends the client's pause now: its next request starts at once.
    pub fn kick(&self) {
        *self.kicks.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        self.kicked.notify_all();
    }

    /// The client stops after the request it is in, without a pause.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        self.kick();
    }

    /// A guard that stops the client when dropped: a failed wait (a
    /// panic) in the scope that runs it must not leave the scope waiting
    /// for it forever.
    pub fn stop_on_drop(&self) -> StopOnDrop<'_> {
        StopOnDrop(self)
    }

    /// The first request started at or after `since` that was answered.
    pub fn answered_since(&self, since: Instant) -> Option<Done> {
        self.done
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .find(|d| d.started >= since && d.outcome.is_text())
            .cloned()
    }

    /// Every request so far.
    pub fn all(&self) -> Vec<Done> {
        self.done.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// See [`Stream::stop_on_drop`].
pub struct StopOnDrop<'a>(&'a Stream);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.stop();
    }
}

/// Prints the engines' output (`ctr run`'s, its last 6000 bytes), under
/// a label, when the test or the bench fails while it lives.
pub struct LogOnPanic<'a>(pub &'a Spawned, pub &'static str);

impl Drop for LogOnPanic<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "--- {}: the engines' stdout ---\n{}\n--- stderr ---\n{}\n---",
                self.1,
                tail(&self.0.stdout_so_far(), 6000),
                tail(&self.0.stderr_so_far(), 6000)
            );
        }
    }
}

/// The last `n` bytes of `s` or a little less, from a character's start.
fn tail(s: &str, n: usize) -> &str {
    let cut = s.len().saturating_sub(n);
    let from = (cut..=s.len())
        .find(|i| s.is_char_boundary(*i))
        .unwrap_or(s.len());
    &s[from..]
}

/// A process as it was: its pid and its start time (field 22 of its
/// `stat`), so that a recycled pid is not taken for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Proc {
    pub pid: u32,
    pub start: u64,
}

impl Proc {
    /// None for a process that is gone or a zombie.
    pub fn of(pid: u32) -> Option<Proc> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let rest = stat.rsplit_once(')')?.1;
        let fields: Vec<&str> = rest.split_whitespace().collect();
        // After the command: state is field 3, starttime field 22.
        if fields.first() == Some(&"Z") {
            return None;
        }
        Some(Proc {
            pid,
            start: fields.get(19)?.parse().ok()?,
        })
    }

    pub fn alive(&self) -> bool {
        Proc::of(self.pid) == Some(*self)
    }

    /// `Rss` and `Pss` of `/proc/PID/smaps_rollup`, in KiB; None when the
    /// process is gone.
    pub fn memory_kib(&self) -> Option<Memory> {
        let text = std::fs::read_to_string(format!("/proc/{}/smaps_rollup", self.pid)).ok()?;
        let field = |name: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
                .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        };
        Some(Memory {
            rss_kib: field("Rss")?,
            pss_kib: field("Pss")?,
        })
    }
}

/// Resident memory of a process or a sum over several.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Memory {
    pub rss_kib: u64,
    /// Proportional set size: a page shared by n processes counts 1/n to
    /// each, so the PSS of all processes adds up to what they use together.
    pub pss_kib: u64,
}

impl std::ops::Add for Memory {
    type Output = Memory;
    fn add(self, o: Memory) -> Memory {
        Memory {
            rss_kib: self.rss_kib + o.rss_kib,
            pss_kib: self.pss_kib + o.pss_kib,
        }
    }
}

/// Every process in the cgroup of `pid` (the engine's slot cgroup: its
/// API server, EngineCore and worker), from the pids controller on cgroup
/// v1 or the unified hierarchy.
pub fn engine_group(pid: u32) -> Vec<Proc> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
    let mut dirs = Vec::new();
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next(), parts.next(), parts.next());
        let (Some(controllers), Some(path)) = (controllers, path) else {
            continue;
        };
        if controllers.split(',').any(|c| c == "pids") {
            dirs.push(format!("/sys/fs/cgroup/pids{path}"));
        } else if controllers.is_empty() {
            dirs.push(format!("/sys/fs/cgroup{path}"));
            dirs.push(format!("/sys/fs/cgroup/unified{path}"));
        }
    }
    let procs = dirs
        .iter()
        .find_map(|d| std::fs::read_to_string(format!("{d}/cgroup.procs")).ok())
        .unwrap_or_default();
    procs
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .filter_map(Proc::of)
        .collect()
}

/// The summed memory of the processes of `pid`'s cgroup, and how many.
pub fn engine_memory(pid: u32) -> (Memory, usize) {
    let group = engine_group(pid);
    let sum = group
        .iter()
        .filter_map(Proc::memory_kib)
        .fold(Memory::default(), |a, b| a + b);
    (sum, group.len())
}

/// How a process is, for a failure message: its command, its state and
/// where in the kernel it waits.
pub fn describe(p: &Proc) -> String {
    let read =
        |f: &str| std::fs::read_to_string(format!("/proc/{}/{f}", p.pid)).unwrap_or_default();
    let cmd: String = read("cmdline")
        .replace('\0', " ")
        .chars()
        .take(100)
        .collect();
    let state = read("status")
        .lines()
        .filter(|l| l.starts_with("State:") || l.starts_with("NSpid:") || l.starts_with("PPid:"))
        .collect::<Vec<_>>()
        .join(", ");
    let stack: Vec<String> = read("stack").lines().take(6).map(str::to_owned).collect();
    format!(
        "{} {cmd} [{state}; wchan {}; {stack:?}]",
        p.pid,
        read("wchan")
    )
}

/// Waits until every process of `group` is gone (exited: a zombie counts
/// as gone); how long after `start` (the kill) that was, or the ones still
/// there `limit` after it, described. The first time some are still there
/// 5 s after `start`, prints which and how they are.
pub fn gone_within(
    group: &[Proc],
    start: Instant,
    limit: Duration,
) -> Result<Duration, Vec<String>> {
    let mut told = false;
    let left = limit.saturating_sub(start.elapsed());
    poll(left, Duration::from_millis(5), || {
        let alive: Vec<Proc> = group.iter().copied().filter(Proc::alive).collect();
        if alive.is_empty() {
            return Ok(start.elapsed());
        }
        if !told && start.elapsed() >= Duration::from_secs(5) {
            told = true;
            let d: Vec<String> = alive.iter().map(describe).collect();
            eprintln!("still there 5 s after the kill: {d:#?}");
        }
        Err(alive)
    })
    .map_err(|alive| alive.iter().map(describe).collect())
}
