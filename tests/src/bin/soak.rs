//! `make soak`: one pair (the test engine, GMS host backend) through a
//! private containerd and the release shim, under a steady request stream,
//! killed over and over: 1000 SIGKILLs of the active engine in a row, then
//! kills of the shadow, of both engines, of gmsd, of the engine being
//! promoted, and bursts of kills 50 ms apart; then hangs: SIGSTOPs of the
//! active engine (it keeps its lock: the pair must find it hung and fail
//! over) and of the parked shadow (replaced while the active serves).
//! Every answer is checked (the committed weights' checksum, a slot of the
//! pair).
//!
//! The whole soak runs watched (`shadow.dev/watchdog=200ms`; the test
//! engine pings every half interval), not only its hang phase: the kills
//! then also prove that a watchdog never fires on an engine that did not
//! hang. No hang may be recorded before the first SIGSTOP, and
//! `pair.hangs.watchdog` must equal the SIGSTOPs sent, every other cause 0.
//!
//! Before, every 100 rounds and after, it records the shim's RSS and open
//! fds, gmsd's RSS and open fds, the mounts below the test's dir, the runc
//! state dirs, the cgroups and the processes of the pair, and prints them
//! as a table. The figure to meet, else the exit status is 1: no committed
//! weights lost (engines load them only once, and once more after each
//! gmsd kill; every answer carries them), no wrong answer, fds, mounts,
//! runc dirs, cgroups and processes flat, the shim's anonymous memory
//! (`RssAnon`, where a leak shows) growing under 1 MiB (from the record
//! taken after a warm-up of 100 failovers, which fault in the failover's
//! malloc arenas once; the rest of its RSS is the binary's pages, faulted
//! in as the soak's later phases run code the warm-up did not, and is
//! printed, not judged), and nothing left once the
//! pair is stopped; each SIGSTOP counted as a watchdog hang, no hang
//! during the kills.
//!
//! `--shadows N` runs the same with N shadows (`shadow.dev/shadows`): the
//! pair is taken as whole again only once every shadow has parked, and
//! "both engines" are all of them.
//!
//! The pair owns its socket (`shadow.dev/listen`) and the test engine
//! stores every connection it accepts until it has answered it
//! (`--resume`), so no request may go unanswered through any of it: a
//! client waits in the backlog while no engine serves, and what a dying
//! engine accepted is answered by the next. The shim accepts
//! (`shadow.dev/accept: runtime`), so a connection is in the store from
//! the moment it exists; `--accept engine` has the test engine accept and
//! store each one itself (a kill between the two loses that connection).
//! `--lossy` runs it as before
//! (engines on their own port, nothing stored), where refused and cut
//! requests are only counted.
//!
//! The restart budget is set for the soak's rate: every respawn it causes
//! fits in one window (`max_restarts_in_window` = 4 × the planned kills per
//! 10 minutes), and kills before an engine parks (promotion kills, bursts)
//! stay under `max_consecutive_failures`.

use clap::Parser;
use shadow_contract::annotations::{ACCEPT, LISTEN, SHADOWS, WATCHDOG};
use shadow_contract::state::{HangCause, PairState};
use shadow_tests::bench::{profile, signal};
use shadow_tests::pair::{ask, free_port, shim_pid, until, PairEnv};
use shadow_tests::{mounts_under, our_processes, Containerd, ContainerdBuilder, RUNC_STATE_ROOT};
use std::io::Read;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Parser)]
#[command(
    name = "soak",
    about = "Thousands of SIGKILLs of a real pair under load through a private containerd: answers, weights, and resources before/after"
)]
struct Cli {
    /// SIGKILLs of the active engine in a row.
    #[arg(long, default_value_t = 1000)]
    rounds: usize,
    /// SIGKILLs of the parked shadow.
    #[arg(long, default_value_t = 50)]
    shadow_kills: usize,
    /// SIGKILLs of both engines at once.
    #[arg(long, default_value_t = 20)]
    both_kills: usize,
    /// SIGKILLs of the pair's gmsd (a cold restart each).
    #[arg(long, default_value_t = 10)]
    gmsd_kills: usize,
    /// SIGKILLs of the engine being promoted (just after it took the lock).
    #[arg(long, default_value_t = 50)]
    promotion_kills: usize,
    /// Bursts of 5 SIGKILLs of whoever serves, 50 ms apart.
    #[arg(long, default_value_t = 10)]
    bursts: usize,
    /// SIGSTOPs of the active engine (a hang: the watchdog fails it over).
    #[arg(long, default_value_t = 50)]
    hangs: usize,
    /// SIGSTOPs of the parked shadow (the watchdog replaces it).
    #[arg(long, default_value_t = 10)]
    shadow_hangs: usize,
    /// SIGKILLs of the active before the first record: the shim's first
    /// failovers fault in their code and malloc arenas, which is not a leak.
    #[arg(long, default_value_t = 100)]
    warmup: usize,
    /// Record the resources every N active kills.
    #[arg(long, default_value_t = 100)]
    every: usize,
    /// Shadows of the pair (`shadow.dev/shadows`, 1 to 3): "protected"
    /// then waits for all of them parked, a shadow kill takes the first
    /// one after the active, the engine being promoted is whichever took
    /// the lock.
    #[arg(long, default_value_t = 1)]
    shadows: u8,
    /// Engines that bind their own port and store nothing: the soak as it
    /// ran before the pair's socket and fd store (refused and cut
    /// requests are then only counted, not failures).
    #[arg(long)]
    lossy: bool,
    /// Who accepts the pair's connections (`shadow.dev/accept`): `runtime`
    /// or `engine`.
    #[arg(long, default_value = "runtime")]
    accept: String,
}

const LONG: Duration = Duration::from_secs(60);
const STEP: Duration = Duration::from_millis(2);
const BURST: usize = 5;
const BURST_GAP: Duration = Duration::from_millis(50);
/// The watchdog interval of the whole soak.
const WATCHDOG_INTERVAL: &str = "200ms";

fn kill(pid: u32) -> bool {
    signal(pid, libc::SIGKILL)
}

fn sigstop(pid: u32) -> bool {
    signal(pid, libc::SIGSTOP)
}

/// `VmRSS` and `RssAnon` of a process in KiB, and its open fds: the fewest of a few
/// reads, so a connection of the moment (the shim polls gmsd's status
/// every second) is not counted as a leak.
fn rss_fds(pid: Option<u32>) -> (u64, u64, usize) {
    let mut best = (u64::MAX, u64::MAX, usize::MAX);
    for _ in 0..5 {
        let (rss, anon, fds) = rss_fds_once(pid);
        best = (best.0.min(rss), best.1.min(anon), best.2.min(fds));
        std::thread::sleep(Duration::from_millis(20));
    }
    best
}

fn rss_fds_once(pid: Option<u32>) -> (u64, u64, usize) {
    let Some(pid) = pid else { return (0, 0, 0) };
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kib = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    };
    let (rss, anon) = (kib("VmRSS:"), kib("RssAnon:"));
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0);
    (rss, anon, fds)
}

/// Every directory below `dir`, `dir` included.
fn dirs_below(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        if !d.is_dir() {
            continue;
        }
        if let Ok(rd) = std::fs::read_dir(&d) {
            todo.extend(rd.flatten().map(|e| e.path()).filter(|p| p.is_dir()));
        }
        out.push(d);
    }
    out
}

#[derive(Clone, Debug)]
struct Sample {
    label: String,
    shim_rss_kib: u64,
    shim_anon_kib: u64,
    shim_fds: usize,
    gmsd_rss_kib: u64,
    gmsd_fds: usize,
    mounts: usize,
    runc_dirs: usize,
    cgroups: usize,
    processes: usize,
}

struct Pair<'a> {
    cd: &'a Containerd,
    env: PairEnv,
    id: &'static str,
}

impl Pair<'_> {
    fn state(&self) -> Option<PairState> {
        self.env.state(self.cd, self.id)
    }

    fn wait(&self, what: &str, ok: impl Fn(&PairState) -> bool) -> PairState {
        until(what, LONG, STEP, || self.state().filter(|s| ok(s)))
    }

    /// Protected, with every shadow parked.
    fn protected(&self) -> PairState {
        self.wait("protected", all_back)
    }

    fn sample(&self, label: String) -> Sample {
        let st = self.state();
        let (shim_rss_kib, shim_anon_kib, shim_fds) =
            rss_fds(shim_pid(self.cd, self.id).map(|p| p as u32));
        let (gmsd_rss_kib, _, gmsd_fds) =
            rss_fds(st.as_ref().and_then(|s| s.gms.as_ref()).map(|g| g.pid));
        let ns = self.cd.namespace();
        let runc_dirs = std::fs::read_dir(Path::new(RUNC_STATE_ROOT).join(ns))
            .map(|d| d.count())
            .unwrap_or(0);
        let cgroup_roots: Vec<PathBuf> = std::fs::read_dir("/sys/fs/cgroup")
            .map(|rd| rd.flatten().map(|e| e.path().join(ns)).collect())
            .unwrap_or_default();
        let cgroups = cgroup_roots.iter().map(|r| dirs_below(r).len()).sum();
        // The pair's processes: what runs in its cgroup (engines), and the
        // shim and gmsd, whose command lines name the test's dir.
        let pair_cgroup = Path::new("/sys/fs/cgroup/pids").join(ns).join(self.id);
        let in_cgroup: usize = dirs_below(&pair_cgroup)
            .iter()
            .map(|d| {
                std::fs::read_to_string(d.join("cgroup.procs"))
                    .map(|t| t.lines().count())
                    .unwrap_or(0)
            })
            .sum();
        let processes = in_cgroup + our_processes(self.cd.dir(), self.cd.address()).len();
        Sample {
            label,
            shim_rss_kib,
            shim_anon_kib,
            shim_fds,
            gmsd_rss_kib,
            gmsd_fds,
            mounts: mounts_under(self.cd.dir()).len(),
            runc_dirs,
            cgroups,
            processes,
        }
    }

    fn loads(&self) -> usize {
        // The test engine logs each load in the rootfs both engines share.
        std::fs::read_to_string(self.cd.rootfs().join("loads.log"))
            .map(|t| t.lines().count())
            .unwrap_or(0)
    }
}

/// Protected with every shadow parked and every pid known: whatever was
/// killed is back.
fn all_back(s: &PairState) -> bool {
    s.pair.protected
        && s.pair.shadows_parked == s.pair.shadows
        && s.pids.iter().all(Option::is_some)
}

/// The first slot after the active one: a parked shadow once `all_back`.
fn a_shadow(st: &PairState) -> u8 {
    let active = st.pair.active.expect("active");
    let slots = st.pids.len() as u8;
    (active + 1) % slots
}

/// SIGKILL the active engine and wait until the pair has failed over and is
/// protected again (the killed slot respawned).
fn kill_active(pair: &Pair<'_>, st: &PairState, what: &str) -> PairState {
    let slot = st.pair.active.expect("active slot");
    let pid = st.pid_of(slot).expect("active pid");
    let before = st.pair.failovers;
    assert!(kill(pid), "{what}: kill {pid}");
    pair.wait(&format!("{what}: failover and protected"), |s| {
        s.pair.failovers > before
            && all_back(s)
            && s.pids[usize::from(slot)].is_some_and(|p| p != pid)
    })
}

/// The request stream: one request after another, each answer checked.
#[derive(Default)]
struct Stream {
    answered: AtomicU64,
    unanswered: AtomicU64,
    /// Of `unanswered`, by why: refused, cut, timed out.
    lost: [AtomicU64; 3],
    wrong: AtomicU64,
    first_wrong: Mutex<Option<String>>,
}

/// Why a request went unanswered.
#[derive(Debug, Clone, Copy)]
enum Lost {
    /// connect(2) refused or timed out: nobody listened.
    Refused,
    /// Reset or closed before a whole line: lost in flight.
    Cut,
    /// Connected, and no answer within the read timeout.
    Timeout,
}

/// One request: the whole answer line, or why there was none (a line
/// without its newline was cut: the engine was killed while writing it).
fn ask_line(port: u16) -> Result<String, Lost> {
    let mut s = TcpStream::connect_timeout(
        &std::net::SocketAddr::from(([127, 0, 0, 1], port)),
        Duration::from_millis(500),
    )
    .map_err(|_| Lost::Refused)?;
    s.set_read_timeout(Some(Duration::from_secs(2)))
        .map_err(|_| Lost::Cut)?;
    let mut text = String::new();
    match s.read_to_string(&mut text) {
        Ok(_) if text.ends_with('\n') => Ok(text),
        Ok(_) => Err(Lost::Cut),
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            Err(Lost::Timeout)
        }
        Err(_) => Err(Lost::Cut),
    }
}

/// Whether a whole answer is right: a slot of the pair (`0 ..= shadows`),
/// the committed weights' checksum.
fn right(line: &str, weights: &str, shadows: u8) -> bool {
    let get = |k: &str| {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{k}=")))
    };
    let slot_ok = get("slot")
        .and_then(|v| v.parse::<u8>().ok())
        .is_some_and(|n| n <= shadows);
    slot_ok && get("weights") == Some(weights)
}

fn stream(port: u16, weights: String, shadows: u8, stop: Arc<AtomicBool>, tally: Arc<Stream>) {
    while !stop.load(Ordering::Relaxed) {
        match ask_line(port) {
            Ok(line) if right(&line, &weights, shadows) => {
                tally.answered.fetch_add(1, Ordering::Relaxed);
            }
            Ok(line) => {
                tally.wrong.fetch_add(1, Ordering::Relaxed);
                let mut first = tally.first_wrong.lock().unwrap_or_else(|p| p.into_inner());
                first.get_or_insert(line);
            }
            Err(why) => {
                tally.unanswered.fetch_add(1, Ordering::Relaxed);
                tally.lost[why as usize].fetch_add(1, Ordering::Relaxed);
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn print_table(samples: &[Sample]) {
    println!(
        "{:<22} {:>12} {:>9} {:>8} {:>12} {:>8} {:>7} {:>9} {:>8} {:>9}",
        "",
        "shim RSS KiB",
        "anon KiB",
        "shim fds",
        "gmsd RSS KiB",
        "gmsd fds",
        "mounts",
        "runc dirs",
        "cgroups",
        "processes"
    );
    for s in samples {
        println!(
            "{:<22} {:>12} {:>9} {:>8} {:>12} {:>8} {:>7} {:>9} {:>8} {:>9}",
            s.label,
            s.shim_rss_kib,
            s.shim_anon_kib,
            s.shim_fds,
            s.gmsd_rss_kib,
            s.gmsd_fds,
            s.mounts,
            s.runc_dirs,
            s.cgroups,
            s.processes
        );
    }
}

fn main() {
    let cli = Cli::parse();
    let profile = profile();
    let planned = cli.rounds
        + cli.hangs
        + cli.shadow_hangs
        + cli.shadow_kills
        + cli.warmup
        + (usize::from(cli.shadows) + 1) * cli.both_kills
        + 2 * cli.gmsd_kills
        + 2 * cli.promotion_kills
        + BURST * cli.bursts;
    let cd: Containerd = ContainerdBuilder::default()
        .shim_profile(profile)
        .start()
        .expect("containerd");
    let exe = std::env::current_exe().expect("exe");
    PairEnv::install_engine(&cd, &exe.with_file_name("test-engine")).expect("install test-engine");
    let gmsd = exe.with_file_name("gmsd");
    assert!(
        gmsd.is_file(),
        "{} missing: build gmsd ({profile})",
        gmsd.display()
    );
    let env = PairEnv::new(
        &cd,
        &format!(
            "gms = \"host\"\ngmsd = \"{}\"\n[pair.restart]\nmax_consecutive_failures = 50\nmax_restarts_in_window = {}\nwindow = 600000\nbackoff_initial = 10\nbackoff_max = 500\n",
            gmsd.display(),
            4 * planned
        ),
    )
    .expect("config");
    let port = free_port();
    let id = "soak";
    let shadows = cli.shadows.to_string();
    // The pair owns the socket (nobody is refused: a client waits in its
    // backlog) and every engine stores what it accepted until it has
    // answered (what a dying engine accepted is answered by the next).
    let listen = format!("tcp:127.0.0.1:{port}");
    let mut annotations = vec![(WATCHDOG, WATCHDOG_INTERVAL), (SHADOWS, shadows.as_str())];
    let port_s = port.to_string();
    let mut cmd = vec!["/bin/test-engine", "--port", &port_s];
    if !cli.lossy {
        annotations.push((LISTEN, listen.as_str()));
        annotations.push((ACCEPT, cli.accept.as_str()));
        cmd.push("--resume");
    }
    let ctr = env
        .run(&cd, id, &annotations, &["--rm", "--net-host"], &cmd)
        .expect("ctr run");
    let pair = Pair { cd: &cd, env, id };
    let started = Instant::now();
    let mut st = pair.protected();
    let weights = until("a first answer", LONG, STEP, || ask(port)).weights;
    let at_start = pair.sample("start".into());
    for round in 1..=cli.warmup {
        st = kill_active(&pair, &st, &format!("warm-up {round}"));
    }
    let mut samples = vec![
        at_start,
        pair.sample(format!("before (+{} warm-up)", cli.warmup)),
    ];
    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Stream::default());
    let streamer = {
        let (w, s, t) = (weights.clone(), stop.clone(), tally.clone());
        let shadows = cli.shadows;
        std::thread::spawn(move || stream(port, w, shadows, s, t))
    };
    let mut kills = cli.warmup;
    let mut gmsd_killed = 0usize;

    // 1. The active engine, again and again.
    for round in 1..=cli.rounds {
        st = kill_active(&pair, &st, &format!("round {round}"));
        kills += 1;
        if round % cli.every == 0 {
            samples.push(pair.sample(format!("active kill {round}")));
        }
    }
    // 2. The parked shadow.
    for _ in 0..cli.shadow_kills {
        let shadow = a_shadow(&st);
        let pid = st.pid_of(shadow).expect("shadow pid");
        kills += usize::from(kill(pid));
        st = pair.wait("shadow respawned", |s| {
            all_back(s) && s.pid_of(shadow).is_some_and(|p| p != pid)
        });
    }
    samples.push(pair.sample(format!("+{} shadow", cli.shadow_kills)));
    // 3. Both engines at once.
    for _ in 0..cli.both_kills {
        let old = st.pids.clone();
        for p in old.iter().flatten() {
            kills += usize::from(kill(*p));
        }
        st = pair.wait("all respawned", |s| {
            all_back(s) && s.pids.iter().zip(&old).all(|(n, o)| n.is_some() && n != o)
        });
    }
    samples.push(pair.sample(format!("+{} both", cli.both_kills)));
    // 4. gmsd: a cold restart of the pair, weights loaded once more.
    for _ in 0..cli.gmsd_kills {
        let colds = st.pair.cold_restarts;
        let gms = st.gms.as_ref().expect("gmsd").pid;
        kills += usize::from(kill(gms));
        gmsd_killed += 1;
        st = pair.wait("cold restart done", |s| {
            s.pair.cold_restarts > colds
                && all_back(s)
                && s.gms.as_ref().is_some_and(|g| g.pid != gms)
        });
    }
    samples.push(pair.sample(format!("+{} gmsd", cli.gmsd_kills)));
    // 5. The engine being promoted, as soon as it holds the lock.
    for _ in 0..cli.promotion_kills {
        let slot = st.pair.active.expect("active");
        let pid = st.pid_of(slot).expect("active pid");
        kills += usize::from(kill(pid));
        let next = pair.wait("another engine takes the lock", |s| {
            s.pair.active.is_some_and(|a| a != slot) || s.pid_of(slot).is_some_and(|p| p != pid)
        });
        if let Some(p) = next
            .pair
            .active
            .filter(|a| *a != slot)
            .and_then(|a| next.pid_of(a))
        {
            kills += usize::from(kill(p));
        }
        st = pair.protected();
    }
    samples.push(pair.sample(format!("+{} promoting", cli.promotion_kills)));
    // 6. Bursts: whoever serves, 50 ms apart.
    for _ in 0..cli.bursts {
        for _ in 0..BURST {
            if let Some(pid) = pair.state().and_then(|s| s.active_pid()) {
                kills += usize::from(kill(pid));
            }
            std::thread::sleep(BURST_GAP);
        }
        pair.protected();
    }
    samples.push(pair.sample(format!("+{} bursts", cli.bursts)));
    // No engine was stopped yet: a hang recorded so far is a misfire, a
    // watchdog that ended an engine which only died or was starting.
    std::thread::sleep(Duration::from_secs(1));
    st = pair.protected();
    let misfires = st.pair.hangs;
    // 7. Hangs: the active engine stopped with its lock held. The pair
    // must find it (its pings stop), kill it and fail over.
    let mut stops = 0usize;
    for round in 1..=cli.hangs {
        let slot = st.pair.active.expect("active slot");
        let pid = st.pid_of(slot).expect("active pid");
        let (failovers, hangs) = (st.pair.failovers, st.pair.hangs.watchdog);
        // Armed: the promoted engine pinged since it was spawned.
        pair.wait(&format!("hang {round}: the active's watchdog armed"), |s| {
            s.pair.slots[usize::from(slot)].watchdog_armed
        });
        assert!(sigstop(pid), "hang {round}: SIGSTOP {pid}");
        stops += 1;
        st = pair.wait(&format!("hang {round}: failover and protected"), |s| {
            s.pair.failovers > failovers
                && s.pair.hangs.watchdog > hangs
                && all_back(s)
                && s.pids[usize::from(slot)].is_some_and(|p| p != pid)
        });
    }
    samples.push(pair.sample(format!("+{} hangs", cli.hangs)));
    // 8. The parked shadow stopped: replaced, the active untouched.
    let mut shadow_moved = 0usize;
    for round in 1..=cli.shadow_hangs {
        let active = st.pair.active.expect("active slot");
        let (active_pid, shadow) = (st.pid_of(active), a_shadow(&st));
        let pid = st.pid_of(shadow).expect("shadow pid");
        let (failovers, hangs) = (st.pair.failovers, st.pair.hangs.watchdog);
        pair.wait(
            &format!("shadow hang {round}: the shadow's watchdog armed"),
            |s| s.pair.slots[usize::from(shadow)].watchdog_armed,
        );
        assert!(sigstop(pid), "shadow hang {round}: SIGSTOP {pid}");
        stops += 1;
        st = pair.wait(&format!("shadow hang {round}: replaced"), |s| {
            s.pair.hangs.watchdog > hangs
                && all_back(s)
                && s.pid_of(shadow).is_some_and(|p| p != pid)
        });
        if st.pair.failovers != failovers || st.pid_of(active) != active_pid {
            shadow_moved += 1;
        }
    }
    samples.push(pair.sample(format!("+{} shadow hangs", cli.shadow_hangs)));
    // The last respawn settled: the shadow parked and watched.
    st = pair.wait("the last respawn parked and armed", |s| {
        all_back(s) && s.pair.slots.iter().all(|s| s.watchdog_armed)
    });
    samples.push(pair.sample("after".into()));
    let loads = pair.loads();
    stop.store(true, Ordering::Relaxed);
    let _ = streamer.join();
    let elapsed = started.elapsed();
    // What the notify sockets dropped, and what the fd store did.
    let dropped: Vec<String> = [
        "not_an_engine",
        "rate_limited",
        "queue_full",
        "fds",
        "fdstore_refused",
    ]
    .iter()
    .filter_map(|r| {
        let n = pair.env.metric(
            &cd,
            id,
            "shadow_notify_dropped_total",
            &format!(",reason=\"{r}\""),
        )?;
        (n > 0.0).then(|| format!("{r} {n}"))
    })
    .collect();
    let store = pair.env.state(&cd, id).and_then(|s| s.fdstore);

    // Stop the pair: nothing may be left.
    cd.ctr()
        .run(&["task", "kill", "--signal", "SIGKILL", id])
        .expect("ctr task kill");
    let _ = ctr.wait(LONG);
    let left = cd.leftovers(false);

    print_table(&samples);
    let start = &samples[0];
    let before = &samples[1];
    let after = samples.last().expect("after");
    let answered = tally.answered.load(Ordering::Relaxed);
    let unanswered = tally.unanswered.load(Ordering::Relaxed);
    let wrong = tally.wrong.load(Ordering::Relaxed);
    println!();
    println!(
        "{kills} SIGKILLs and {stops} SIGSTOPs in {:.0} s ({} + {} kills of the active in a row; {} stops of the active, {} of the shadow); failovers {}, cold restarts {}",
        elapsed.as_secs_f64(),
        cli.warmup,
        cli.rounds,
        cli.hangs,
        cli.shadow_hangs,
        st.pair.failovers,
        st.pair.cold_restarts
    );
    let hangs = &st.pair.hangs;
    println!(
        "hangs: {} watchdog for {stops} SIGSTOPs ({} trigger, {} probe, {} start timeout); before the first SIGSTOP: {} (misfires); shadow stops that moved the active: {shadow_moved}",
        hangs.watchdog,
        hangs.trigger,
        hangs.probe,
        hangs.start_timeout,
        misfires.total()
    );
    println!(
        "requests: {answered} answered, {wrong} wrong, {unanswered} unanswered ({} refused, {} cut, {} timed out){}",
        tally.lost[Lost::Refused as usize].load(Ordering::Relaxed),
        tally.lost[Lost::Cut as usize].load(Ordering::Relaxed),
        tally.lost[Lost::Timeout as usize].load(Ordering::Relaxed),
        if cli.lossy { " (--lossy: engines on their own port, no store)".to_string() } else { format!(" (the pair's socket, every accepted connection stored until answered; accepted by the {})", cli.accept) }
    );
    println!("weights loaded {loads} times (1 + {gmsd_killed} gmsd kills expected)");
    println!(
        "notify datagrams dropped: {}; fd store at the end: {store:?}",
        if dropped.is_empty() {
            "none".to_string()
        } else {
            dropped.join(", ")
        }
    );
    let rss_growth = after.shim_rss_kib as i64 - before.shim_rss_kib as i64;
    let anon_growth = after.shim_anon_kib as i64 - before.shim_anon_kib as i64;
    println!(
        "shim RSS growth {rss_growth} KiB after the warm-up (anon {anon_growth} KiB; {} KiB from the start, warm-up included); leftovers after stop: {left:?}",
        after.shim_rss_kib as i64 - start.shim_rss_kib as i64
    );

    let mut failed = Vec::new();
    if wrong > 0 {
        failed.push(format!(
            "{wrong} wrong answers, first: {}",
            tally
                .first_wrong
                .lock()
                .map(|f| f.clone().unwrap_or_default())
                .unwrap_or_default()
        ));
    }
    if loads != 1 + gmsd_killed {
        failed.push(format!(
            "weights loaded {loads} times, expected {}",
            1 + gmsd_killed
        ));
    }
    if answered == 0 {
        failed.push("no answer at all".into());
    }
    if unanswered > 0 && !cli.lossy {
        failed.push(format!(
            "{unanswered} requests unanswered (refused, reset in flight or timed out) with the pair's socket and fd store"
        ));
    }
    if misfires.total() > 0 {
        failed.push(format!(
            "{} hangs recorded during the kills, before any SIGSTOP: {misfires:?}",
            misfires.total()
        ));
    }
    if hangs.watchdog != stops as u64 || hangs.total() != hangs.of(HangCause::Watchdog) {
        failed.push(format!(
            "hangs {hangs:?}: expected {stops} of cause watchdog and no other"
        ));
    }
    if shadow_moved > 0 {
        failed.push(format!(
            "{shadow_moved} SIGSTOPs of the shadow failed over or restarted the active"
        ));
    }
    let flat = |what: &str, a: usize, b: usize, failed: &mut Vec<String>| {
        if a != b {
            failed.push(format!("{what}: {a} before, {b} after"));
        }
    };
    flat("shim fds", before.shim_fds, after.shim_fds, &mut failed);
    flat("gmsd fds", before.gmsd_fds, after.gmsd_fds, &mut failed);
    flat("mounts", before.mounts, after.mounts, &mut failed);
    flat(
        "runc state dirs",
        before.runc_dirs,
        after.runc_dirs,
        &mut failed,
    );
    flat("cgroups", before.cgroups, after.cgroups, &mut failed);
    flat("processes", before.processes, after.processes, &mut failed);
    if anon_growth >= 1024 {
        failed.push(format!(
            "shim anonymous memory grew {anon_growth} KiB (limit 1024)"
        ));
    }
    if !left.is_empty() {
        failed.push(format!("left after stop: {left:?}"));
    }
    // The private containerd and its directory go before the verdict:
    // `exit` runs no destructor, and a failed soak must leave nothing too.
    drop(pair);
    drop(cd);
    if failed.is_empty() {
        println!("soak: PASS");
    } else {
        for f in &failed {
            println!("soak: FAIL: {f}");
        }
        std::process::exit(1);
    }
}
