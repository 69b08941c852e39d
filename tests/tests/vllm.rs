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
//! The engines are `make bench-vllm`'s, from the module the two share
//! (`shadow_tests::vllm`): the same rootfs (what an image built on this
//! machine would hold, bound from the host), command and environment.
//! `/dev/shm` is shared by the pair's engines as a pod's is under CRI (the
//! sandbox's tmpfs, or an `emptyDir` of medium `Memory`, which vLLM's
//! docs advise): a tmpfs of the test's bound over it.
//!
//! Without the virtualenv the test says so and passes, unless `CI` is set
//! or `make test` runs it (`SHADOW_VLLM_REQUIRED=1`): there it fails.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use shadow_contract::annotations::{ACCEPT, LISTEN};
use shadow_tests::bench::signal;
use shadow_tests::pair::{free_port, PairEnv};
use shadow_tests::vllm::{
    self, engine_group, gone_within, protected, Install, LogOnPanic, Outcome, Proc, Stream,
};
use shadow_tests::wait::until;
use shadow_tests::Containerd;

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

/// The names in an engine's `/dev/shm`, seen through its root.
fn engine_shm(pid: u32) -> Vec<String> {
    dir_names(Path::new(&format!("/proc/{pid}/root/dev/shm")))
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
    let Some(install) = Install::for_test(Path::new(ENGINE)) else {
        return;
    };
    let test_started = Instant::now();
    let cd = Containerd::start().expect("containerd");
    let env = PairEnv::new(&cd, "gms = \"off\"").expect("config");
    let pod = PodShm(tempfile::tempdir().expect("a dir for the pod's /dev/shm"));
    let shm = pod.0.path().to_path_buf();
    shared_shm(&shm);
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let binds = install.binds(&repo).unwrap_or_else(|e| panic!("{e}"));
    let (root, mut flags) = vllm::rootfs(cd.dir(), &binds, Some(&shm)).expect("the rootfs");
    let port = free_port();
    let listen = format!("tcp:127.0.0.1:{port}");
    // The engines' environment is the bench's: without
    // VLLM_CPU_OMP_THREADS_BIND, which shadow-vllm sets in a pair.
    flags.extend(vllm::env_flags());
    flags.extend(["--rm".into(), "--net-host".into()]);
    let id = "vllm";
    let ctr = env
        .container(&cd, id)
        .rootfs(&root)
        .annotation(LISTEN, &listen)
        // As an operator writes it: the shipped config's default is the
        // runtime accepting, which vLLM's server cannot take.
        .annotation(ACCEPT, "engine")
        .flags(&flags)
        .cmd(&install.serve_cmd(&[]))
        .spawn(false)
        .expect("ctr run");
    let log = LogOnPanic(&ctr, "the pair");

    let st = until(
        "a vLLM pair protected",
        START,
        Duration::from_millis(200),
        || env.state(&cd, id).filter(|s| protected(s).is_some()),
    );
    let started = test_started.elapsed();
    let (_, a, s) = protected(&st).expect("protected");
    // Both engines unbound their CPU threads by themselves (two engines
    // bound to one core starve each other's start and exit).
    until(
        "both engines' log of VLLM_CPU_OMP_THREADS_BIND=nobind",
        Duration::from_secs(30),
        STEP,
        || {
            (ctr.stderr_so_far()
                .matches(vllm::NOBIND_DEFAULT_LOG)
                .count()
                >= 2)
                .then_some(())
        },
    );
    let baseline = [engine_shm(a).len(), engine_shm(s).len()];
    let reference = match vllm::complete(port, PROMPT, MAX_TOKENS, REQUEST_TIMEOUT) {
        Outcome::Text(t) => t,
        other => panic!("the pair's first answer: {other:?}"),
    };
    assert!(!reference.is_empty(), "an empty completion");

    let stream = Stream::new(port, PROMPT, MAX_TOKENS, REQUEST_TIMEOUT, PAUSE);
    let mut kills: Vec<KillRecord> = Vec::new();
    let mut killed_groups: Vec<Proc> = Vec::new();
    let mut kill_times: Vec<Instant> = Vec::new();
    std::thread::scope(|scope| {
        let c = scope.spawn(|| stream.run());
        // A failed wait (a panic) stops the client too, or the scope would
        // wait for it forever.
        let _stopper = stream.stop_on_drop();
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
            assert!(
                signal(pid, libc::SIGKILL),
                "round {round}: kill {pid}: {}",
                std::io::Error::last_os_error()
            );
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
        stream.stop();
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
