//! vLLM as its users run it, as a shadow pair through containerd: two
//! `shadow-vllm serve` engines (vLLM's own OpenAI server, parked fully
//! initialised behind the election lock, serving on the pair's socket),
//! a client asking for greedy completions one after another, and three
//! SIGKILLs of the serving engine's main process. After each kill a request
//! the client starts afterwards must be answered by the other engine with
//! the very text the pair gave before any kill; the killed slot must come
//! back and park again; and what the dead engine had (its EngineCore and
//! worker processes, its `/dev/shm` files) must be gone instead of reaching
//! the next engine or piling up. Then Delete, and nothing may be left.
//!
//! The container's rootfs is what an image built on this machine would
//! hold, without the minutes a 6 GB image import would cost: a directory of
//! mount points, with the host's `/usr` and `/etc`, the python that made
//! the virtualenv, the virtualenv (`make vllm-env`, absolute paths inside)
//! and the model (`make vllm-model`) bound read-only at their own paths.
//! `/dev/shm` is shared by the pair's engines as a pod's is under CRI (the
//! sandbox's tmpfs, or an `emptyDir` of medium `Memory`, which vLLM's
//! docs advise): a tmpfs of the test's bound over it.
//!
//! Without the virtualenv the test says so and passes, unless `CI` is set
//! or `make test` runs it (`SHADOW_VLLM_REQUIRED=1`): there it fails.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use shadow_contract::annotations::LISTEN;
use shadow_contract::state::{EngineState, PairState};
use shadow_tests::pair::{free_port, PairEnv};
use shadow_tests::wait::until;
use shadow_tests::{Containerd, Runtime, Spawned};

const ENGINE: &str = env!("CARGO_BIN_EXE_test-engine");
/// Two vLLMs starting side by side on two cores: 35–90 s each alone,
/// 5 to 10 minutes beside other busy ones.
const START: Duration = Duration::from_secs(900);
/// A respawned engine's start, beside the one that serves the stream.
const RESPAWN: Duration = Duration::from_secs(900);
const STEP: Duration = Duration::from_millis(5);
const KILLS: usize = 3;
/// A request's limit: a greedy completion of a few tokens by a tiny model
/// takes well under a second; a failover leaves it waiting in the backlog.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Between two requests of the stream: leaves the CPU to a starting engine
/// (two cores here; vLLM's CPU worker spins while requests come close
/// together). A kill cuts the pause short (`Stream::kick`), so the first
/// request after it starts at once.
const PAUSE: Duration = Duration::from_millis(250);
const PROMPT: &str = "The shadow engine answers while the other one";
const MAX_TOKENS: u32 = 12;
const MODEL_NAME: &str = "tiny-llama";

/// The build dir (`target`, or `$CARGO_TARGET_DIR`): the test engine is
/// `<target>/debug/test-engine`.
fn target_dir() -> PathBuf {
    let exe = Path::new(ENGINE);
    exe.parent()
        .and_then(Path::parent)
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("target"))
}

/// Whether a missing virtualenv is a failure rather than a skip.
fn required() -> bool {
    let set = |k: &str| {
        std::env::var(k)
            .ok()
            .is_some_and(|v| !v.is_empty() && v != "0" && v != "false")
    };
    set("CI") || set("SHADOW_VLLM_REQUIRED")
}

/// The virtualenv and the model, or None when the test is to be skipped.
fn installed() -> Option<(PathBuf, PathBuf)> {
    let target = target_dir();
    let (venv, model) = (target.join("vllm-venv"), target.join("vllm-model"));
    let have = venv.join("bin/shadow-vllm").is_file() && model.join("config.json").is_file();
    if have {
        return Some((venv, model));
    }
    let msg = format!(
        "no vLLM virtualenv or model ({} with bin/shadow-vllm, {} with config.json): run `make vllm-env vllm-model`",
        venv.display(),
        model.display()
    );
    assert!(!required(), "{msg} (required under CI and `make test`)");
    eprintln!("SKIPPED: {msg}");
    None
}

/// Where python really lives: the venv's `bin/python` resolved, two levels
/// up (`…/versions/3.11.x`), which holds its standard library.
fn python_home(venv: &Path) -> PathBuf {
    let real = std::fs::canonicalize(venv.join("bin/python"))
        .unwrap_or_else(|e| panic!("{}/bin/python: {e}", venv.display()));
    real.parent()
        .and_then(Path::parent)
        .map(Path::to_path_buf)
        .unwrap_or_else(|| panic!("python at {} has no prefix", real.display()))
}

/// The rootfs: mount points, and the host's top-level symlinks (Debian's
/// merged /usr: /bin → usr/bin, …) as they are. Returns the `ctr run`
/// flags that bind what it needs read-only at the same paths.
fn rootfs(cd: &Containerd, binds: &[PathBuf], shm: &Path) -> (PathBuf, Vec<String>) {
    let root = cd.dir().join("vllm-rootfs");
    for d in ["proc", "sys", "dev", "tmp", "run", "root", "usr", "etc"] {
        std::fs::create_dir_all(root.join(d)).expect("rootfs dir");
    }
    let mut flags = Vec::new();
    let mut bind = |src: &Path, mode: &str| {
        std::fs::create_dir_all(root.join(src.strip_prefix("/").unwrap_or(src)))
            .expect("rootfs mount point");
        flags.push("--mount".to_owned());
        flags.push(format!(
            "type=bind,src={0},dst={0},options=rbind:{mode}",
            src.display()
        ));
    };
    bind(Path::new("/usr"), "ro");
    bind(Path::new("/etc"), "ro");
    for top in ["bin", "sbin", "lib", "lib32", "lib64", "libx32"] {
        let host = Path::new("/").join(top);
        match std::fs::read_link(&host) {
            Ok(to) => std::os::unix::fs::symlink(to, root.join(top)).expect("rootfs link"),
            Err(_) if host.is_dir() => bind(&host, "ro"),
            Err(_) => {}
        }
    }
    for b in binds {
        bind(b, "ro");
    }
    let tmp = cd.dir().join("vllm-tmp");
    std::fs::create_dir_all(&tmp).expect("tmp dir");
    flags.push("--mount".to_owned());
    flags.push(format!(
        "type=bind,src={},dst=/tmp,options=rbind:rw",
        tmp.display()
    ));
    flags.push("--mount".to_owned());
    flags.push(format!(
        "type=bind,src={},dst=/dev/shm,options=rbind:rw",
        shm.display()
    ));
    (root, flags)
}

/// A tmpfs at `dir`, as CRI makes a sandbox's `/dev/shm`; unmounted when
/// dropped. It lives outside the containerd's dir, whose leftovers check
/// would otherwise count the test's own mount.
struct PodShm(tempfile::TempDir);

impl Drop for PodShm {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(self.0.path())
            .status();
    }
}

fn shared_shm(dir: &Path) {
    let out = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=1g,mode=1777", "shm"])
        .arg(dir)
        .output()
        .expect("mount");
    assert!(
        out.status.success(),
        "mount tmpfs at {}: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Where the last `n` bytes of `s` begin, on a character's boundary.
fn tail_from(s: &str, n: usize) -> usize {
    let cut = s.len().saturating_sub(n);
    (cut..=s.len())
        .find(|i| s.is_char_boundary(*i))
        .unwrap_or(s.len())
}

/// What one request came to.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Outcome {
    /// The completion's text.
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
    fn kind(&self) -> &'static str {
        match self {
            Outcome::Text(_) => "text",
            Outcome::Http(_) => "http-error",
            Outcome::Refused => "refused",
            Outcome::Reset => "reset",
            Outcome::Timeout => "timeout",
        }
    }
}

fn complete(port: u16) -> Outcome {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let mut s = match TcpStream::connect_timeout(&addr, REQUEST_TIMEOUT) {
        Ok(s) => s,
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => return Outcome::Refused,
        Err(_) => return Outcome::Timeout,
    };
    let body = serde_json::json!({
        "model": MODEL_NAME,
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    })
    .to_string();
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = s.set_read_timeout(Some(REQUEST_TIMEOUT));
    if s.write_all(request.as_bytes()).is_err() {
        return Outcome::Reset;
    }
    let mut raw = Vec::new();
    match s.read_to_end(&mut raw) {
        Ok(_) => {}
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            return Outcome::Timeout
        }
        Err(_) => return Outcome::Reset,
    }
    let text = String::from_utf8_lossy(&raw);
    let Some((head, body)) = text.split_once("\r\n\r\n") else {
        return Outcome::Reset;
    };
    let status = head.split_whitespace().nth(1).unwrap_or("");
    if status != "200" {
        let start: String = body.chars().take(200).collect();
        return Outcome::Http(format!("{status} {start}"));
    }
    // Connection: close and a JSON answer: the body is whole when it parses.
    match serde_json::from_str::<serde_json::Value>(body) {
        Ok(v) => match v.pointer("/choices/0/text").and_then(|t| t.as_str()) {
            Some(t) => Outcome::Text(t.to_owned()),
            None => Outcome::Http(format!("200 without a text: {body}")),
        },
        Err(_) => Outcome::Reset,
    }
}

/// One request of the stream.
#[derive(Debug, Clone)]
struct Done {
    started: Instant,
    ended: Instant,
    outcome: Outcome,
}

/// The stream's requests so far, shared with the test's thread.
#[derive(Default)]
struct Stream {
    done: Mutex<Vec<Done>>,
    /// Bumped at each kill: the client's pause ends.
    kicks: AtomicU64,
}

impl Stream {
    /// End the client's pause now.
    fn kick(&self) {
        self.kicks.fetch_add(1, Ordering::AcqRel);
    }

    /// Sleep `PAUSE`, or less if kicked since the kicks numbered `seen`
    /// (read when the last request started).
    fn pause(&self, seen: u64) {
        let until = Instant::now() + PAUSE;
        while Instant::now() < until && self.kicks.load(Ordering::Acquire) == seen {
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// The first request started at or after `since` that was answered.
    fn answered_since(&self, since: Instant) -> Option<Done> {
        self.done
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .find(|d| d.started >= since && matches!(d.outcome, Outcome::Text(_)))
            .cloned()
    }

    fn all(&self) -> Vec<Done> {
        self.done.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// Greedy completions one after another until `stop`.
fn client(port: u16, stop: &AtomicBool, stream: &Stream) {
    while !stop.load(Ordering::Acquire) {
        let seen = stream.kicks.load(Ordering::Acquire);
        let started = Instant::now();
        let outcome = complete(port);
        let ended = Instant::now();
        stream
            .done
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Done {
                started,
                ended,
                outcome,
            });
        stream.pause(seen);
    }
}

/// Sets the flag when dropped: a failed wait stops the client too.
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// Prints the engines' output (`ctr run`'s) when the test fails.
struct LogOnPanic<'a>(&'a Spawned);

impl Drop for LogOnPanic<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let tail = |s: String| s[tail_from(&s, 6000)..].to_owned();
            eprintln!(
                "--- the engines' stdout ---\n{}\n--- stderr ---\n{}\n---",
                tail(self.0.stdout_so_far()),
                tail(self.0.stderr_so_far())
            );
        }
    }
}

/// A process as it was: its pid and its start time (field 22 of its
/// `stat`), so that a recycled pid is not taken for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Proc {
    pid: u32,
    start: u64,
}

impl Proc {
    fn of(pid: u32) -> Option<Proc> {
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

    fn alive(&self) -> bool {
        Proc::of(self.pid) == Some(*self)
    }
}

/// Every process of the engine whose main process is `pid`: those in its
/// pid namespace (each engine of a pair has its own; its API server is pid
/// 1 there, EngineCore, the worker and the lock helper its descendants).
fn engine_group(pid: u32) -> Vec<Proc> {
    let ns = |p: &str| std::fs::read_link(format!("/proc/{p}/ns/pid")).ok();
    let Some(own) = ns(&pid.to_string()) else {
        return Vec::new();
    };
    std::fs::read_dir("/proc")
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| e.file_name().to_str().map(str::to_owned))
                .filter(|p| p.chars().all(|c| c.is_ascii_digit()))
                .filter(|p| ns(p).as_ref() == Some(&own))
                .filter_map(|p| p.parse().ok().and_then(Proc::of))
                .collect()
        })
        .unwrap_or_default()
}

/// The names in an engine's `/dev/shm`, seen through its root.
fn engine_shm(pid: u32) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/root/dev/shm"))
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

fn dir_names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// How a process is, for a failure message: its command, its state and
/// where in the kernel it waits.
fn describe(p: &Proc) -> String {
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

/// Waits until every process of `group` is gone; how long after `start`
/// (the kill) that was, or the ones still there `limit` after it
/// (described). The first time some are still there 5 s after it, says
/// which and how they are.
fn gone_within(group: &[Proc], start: Instant, limit: Duration) -> Result<Duration, Vec<String>> {
    let mut told = false;
    loop {
        let alive: Vec<Proc> = group.iter().copied().filter(Proc::alive).collect();
        if alive.is_empty() {
            return Ok(start.elapsed());
        }
        if start.elapsed() >= limit {
            return Err(alive.iter().map(describe).collect());
        }
        if !told && start.elapsed() >= Duration::from_secs(5) {
            told = true;
            let d: Vec<String> = alive.iter().map(describe).collect();
            eprintln!("still there 5 s after the kill: {d:#?}");
        }
        std::thread::sleep(STEP);
    }
}

fn kill(pid: u32) {
    // SAFETY: kill(2) with a pid read from the pair's state a moment ago
    // and a signal number.
    let rc = unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    assert_eq!(rc, 0, "kill {pid}: {}", std::io::Error::last_os_error());
}

/// The active slot and its pid, with the parked shadow's.
fn protected(st: &PairState) -> Option<(u8, u32, u32)> {
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

/// What one kill came to.
#[derive(Debug)]
struct KillRecord {
    slot: u8,
    /// Processes in the killed engine's cgroup at the kill.
    group: usize,
    /// SIGKILL → the first correct answer to a request started after it.
    first_answer: Duration,
    /// SIGKILL → the last process of the killed engine gone.
    all_gone: Duration,
    /// SIGKILL → the killed slot parked again.
    parked_again: Duration,
    /// Failed requests that ended between this kill and the next, by kind.
    failures: BTreeMap<&'static str, usize>,
    /// Entries in each live engine's `/dev/shm` once protected again.
    shm: Vec<usize>,
}

#[test]
fn vllm_pair_serves_through_sigkills_and_leaves_nothing() {
    let Some((venv, model)) = installed() else {
        return;
    };
    let test_started = Instant::now();
    let cd = Containerd::start().expect("containerd");
    let env = PairEnv::new(&cd, "gms = \"off\"").expect("config");
    let pod = PodShm(tempfile::tempdir().expect("a dir for the pod's /dev/shm"));
    let shm = pod.0.path().to_path_buf();
    shared_shm(&shm);
    let mut binds = vec![python_home(&venv), venv.clone(), model.clone()];
    // `make vllm-env` installs shadow-vllm and shadow_gms editable: the
    // venv points into the repository for their sources.
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for source in ["integrations/vllm", "gms/python"] {
        if let Ok(dir) = std::fs::canonicalize(repo.join(source)) {
            binds.push(dir);
        }
    }
    let (root, mut flags) = rootfs(&cd, &binds, &shm);
    let port = free_port();
    let listen = format!("tcp:127.0.0.1:{port}");
    for kv in [
        "HOME=/tmp",
        "PYTHONUNBUFFERED=1",
        "VLLM_CPU_KVCACHE_SPACE=1",
        // vLLM's CPU worker pins its threads to core 0 in every engine:
        // the serving one then starves a killed worker's exit and a
        // respawn's start for minutes (shadow_tests::vllm::ENV says so too).
        "VLLM_CPU_OMP_THREADS_BIND=nobind",
        "VLLM_NO_USAGE_STATS=1",
        "HF_HUB_OFFLINE=1",
        "TRANSFORMERS_OFFLINE=1",
    ] {
        flags.push("--env".into());
        flags.push(kv.into());
    }
    flags.extend(["--rm".into(), "--net-host".into()]);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let shadow_vllm = venv.join("bin/shadow-vllm").display().to_string();
    let model_s = model.display().to_string();
    let cmd = [
        shadow_vllm.as_str(),
        "serve",
        model_s.as_str(),
        "--served-model-name",
        MODEL_NAME,
        "--enforce-eager",
        "--max-model-len",
        "256",
        "--dtype",
        "float32",
    ];
    let id = "vllm";
    let ctr = cd
        .container(Runtime::Shadow, id)
        .rootfs(&root)
        .flags(&["--runtime-config-path", &env.config.display().to_string()])
        .annotation(shadow_contract::annotations::PAIR, "true")
        .annotation(LISTEN, &listen)
        .flags(&flags)
        .cmd(&cmd)
        .spawn(false)
        .expect("ctr run");
    let log = LogOnPanic(&ctr);

    let st = until(
        "a vLLM pair protected",
        START,
        Duration::from_millis(200),
        || env.state(&cd, id).filter(|s| protected(s).is_some()),
    );
    let started = test_started.elapsed();
    let (_, a, s) = protected(&st).expect("protected");
    let baseline = [engine_shm(a).len(), engine_shm(s).len()];
    let reference = match complete(port) {
        Outcome::Text(t) => t,
        other => panic!("the pair's first answer: {other:?}"),
    };
    assert!(!reference.is_empty(), "an empty completion");

    let stop = AtomicBool::new(false);
    let stream = Stream::default();
    let mut kills: Vec<KillRecord> = Vec::new();
    let mut killed_groups: Vec<Proc> = Vec::new();
    let mut kill_times: Vec<Instant> = Vec::new();
    std::thread::scope(|scope| {
        let c = scope.spawn(|| client(port, &stop, &stream));
        let _stopper = StopOnDrop(&stop);
        until("the stream's first answer", RESPAWN, STEP, || {
            stream.answered_since(test_started)
        });
        for round in 0..KILLS {
            let st = until("the pair protected", RESPAWN, STEP, || {
                env.state(&cd, id).filter(|s| protected(s).is_some())
            });
            let (slot, pid, _) = protected(&st).expect("protected");
            let group = engine_group(pid);
            assert!(
                group.iter().any(|p| p.pid == pid),
                "round {round}: engine {pid} not in its own cgroup's list: {group:?}"
            );
            let at = Instant::now();
            kill(pid);
            stream.kick();
            kill_times.push(at);
            // A request started after the kill, answered: by the other
            // engine, as the killed one's slot cannot serve before it parks.
            let first = until(
                "a new request answered after the kill",
                RESPAWN,
                STEP,
                || stream.answered_since(at),
            );
            let now = env.state(&cd, id).expect("state.json");
            assert_ne!(
                now.pair.active,
                Some(slot),
                "round {round}: the killed slot serves again already: {now:?}"
            );
            assert!(now.pair.active.is_some(), "round {round}: nobody active");
            // The dead engine's other processes went with it.
            let all_gone = gone_within(&group, at, Duration::from_secs(60)).unwrap_or_else(|alive| {
                panic!("round {round}: the killed engine's processes still run 60 s on: {alive:#?}")
            });
            let st = until("the killed slot parked again", RESPAWN, STEP, || {
                env.state(&cd, id).filter(|s| {
                    protected(s).is_some_and(|(active, _, shadow)| {
                        active != slot && shadow != pid && s.pid_of(slot) == Some(shadow)
                    })
                })
            });
            let parked_again = at.elapsed();
            let (_, a, s) = protected(&st).expect("protected");
            kills.push(KillRecord {
                slot,
                group: group.len(),
                first_answer: first.ended.duration_since(at),
                all_gone,
                parked_again,
                failures: BTreeMap::new(),
                shm: vec![engine_shm(a).len(), engine_shm(s).len()],
            });
            let k = kills.last().expect("this round's record");
            eprintln!(
                "kill {}: slot {} ({} processes, all gone {:.1?}) → first correct answer of a new request {:.1?}, parked again {:.1?}; /dev/shm entries per live engine {:?}",
                round + 1,
                k.slot,
                k.group,
                k.all_gone,
                k.first_answer,
                k.parked_again,
                k.shm
            );
            killed_groups.extend(group);
        }
        // One more answer after the last respawn parked.
        let mark = Instant::now();
        until("an answer after the last respawn", RESPAWN, STEP, || {
            stream.answered_since(mark)
        });
        stop.store(true, Ordering::Release);
        c.join().expect("client thread");
    });

    // Every request: the same text, or a failure counted by kind against
    // the kill it followed.
    let all = stream.all();
    let mut wrong = Vec::new();
    let mut before_kills = BTreeMap::<&'static str, usize>::new();
    for d in &all {
        match &d.outcome {
            Outcome::Text(t) if *t == reference => continue,
            Outcome::Text(t) => wrong.push(t.clone()),
            _ => {}
        }
        let kind = d.outcome.kind();
        match kill_times.iter().rposition(|k| *k <= d.ended) {
            Some(i) => *kills[i].failures.entry(kind).or_default() += 1,
            None => *before_kills.entry(kind).or_default() += 1,
        }
    }
    let answered = all
        .iter()
        .filter(|d| d.outcome == Outcome::Text(reference.clone()))
        .count();
    let pod_shm = dir_names(&shm);
    eprintln!(
        "vLLM pair: protected {started:.1?} after the test began; reference {reference:?}\n\
         requests: {} ({answered} answered alike), failed before any kill: {before_kills:?}\n\
         /dev/shm entries per engine at the start: {baseline:?}; in the pod's shared /dev/shm: {pod_shm:?}",
        all.len()
    );
    for (i, k) in kills.iter().enumerate() {
        eprintln!(
            "kill {}: slot {} ({} processes, all gone {:.1?}) → first correct answer of a new request {:.1?}, parked again {:.1?}; failed {:?}; /dev/shm entries per live engine {:?}",
            i + 1,
            k.slot,
            k.group,
            k.all_gone,
            k.first_answer,
            k.parked_again,
            k.failures,
            k.shm
        );
    }

    drop(log);
    env.stop(&cd, id, "SIGKILL", ctr, Duration::from_secs(60));
    let left: Vec<Proc> = killed_groups.into_iter().filter(Proc::alive).collect();
    eprintln!(
        "after Delete: {} killed engines' processes alive, pod /dev/shm {:?}; test took {:.1?}",
        left.len(),
        dir_names(&shm),
        test_started.elapsed()
    );

    assert!(wrong.is_empty(), "answers unlike {reference:?}: {wrong:?}");
    assert!(before_kills.is_empty(), "{before_kills:?}");
    assert!(left.is_empty(), "processes of killed engines: {left:?}");
    // Each kill ended a whole engine: its API server and more.
    assert!(kills.iter().all(|k| k.group >= 2), "{kills:?}");
    // Nothing of any engine reached the pod's /dev/shm, and no live engine
    // holds more there than a fresh one did.
    assert!(pod_shm.is_empty(), "the pod's /dev/shm holds {pod_shm:?}");
    let most = baseline.iter().copied().max().unwrap_or(0);
    for k in &kills {
        assert!(
            k.shm.iter().all(|n| *n <= most),
            "/dev/shm entries grew from {baseline:?}: {kills:?}"
        );
    }
    // One request at a time, on a socket the pair owns: a kill can fail at
    // most the one request its engine had, and none is refused.
    for k in &kills {
        let failed: usize = k.failures.values().sum();
        assert!(
            failed <= 1 && !k.failures.contains_key("refused"),
            "{kills:?}"
        );
    }
    // The stream went on: answers between the kills.
    assert!(answered > KILLS * 2, "{answered} answers");
}
