//! Harness for engine pairs: a shim config that keeps every pair artefact
//! under the test's temp dir, the test engine (and its shared libraries)
//! installed into the rootfs, `state.json` reading, and the TCP question
//! "who serves?" — all waits are bounded polls on real state.

use crate::{Containerd, Error, Result, Runtime, Spawned};
use shadow_contract::state::{PairState, FILE_NAME};
use std::io::Read;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// A pair's configuration and files, under one private containerd.
pub struct PairEnv {
    pub state_dir: PathBuf,
    pub metrics_dir: PathBuf,
    pub config: PathBuf,
}

/// Copy `bin` to `dest` (path inside the rootfs) with every shared library
/// `ldd` lists, at the same paths, so a dynamically linked program runs.
pub fn install_binary(rootfs: &Path, bin: &Path, dest: &str) -> Result<()> {
    let target = rootfs.join(dest.trim_start_matches('/'));
    if let Some(p) = target.parent() {
        std::fs::create_dir_all(p).map_err(|e| Error::io("create dir", p, e))?;
    }
    std::fs::copy(bin, &target).map_err(|e| Error::io("copy binary", bin, e))?;
    let out = Command::new("ldd")
        .arg(bin)
        .output()
        .map_err(|e| Error::io("ldd", bin, e))?;
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        // "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x…)" or "/lib64/ld-linux-x86-64.so.2 (0x…)"
        let path = line
            .split("=>")
            .last()
            .and_then(|s| s.split_whitespace().next())
            .filter(|p| p.starts_with('/'));
        if let Some(lib) = path {
            let dst = rootfs.join(lib.trim_start_matches('/'));
            if dst.exists() {
                continue;
            }
            if let Some(p) = dst.parent() {
                std::fs::create_dir_all(p).map_err(|e| Error::io("create dir", p, e))?;
            }
            std::fs::copy(lib, &dst).map_err(|e| Error::io("copy library", Path::new(lib), e))?;
        }
    }
    Ok(())
}

/// A TCP port nothing listens on now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or(18_000)
}

/// One answer of the test engine, parsed (`key=value` words).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub slot: String,
    /// The engine's start time (µs): names one engine instance.
    pub boot: u128,
    pub weights: String,
    pub loaded: bool,
    pub lock_us: u128,
    pub ready_us: u128,
    /// Processes in the engine's group.
    pub ranks: u32,
    /// The GMS daemons' socket names the engine attached to, comma-separated.
    pub gms: String,
}

/// Ask whoever serves on `port`; None if nobody answers now.
pub fn ask(port: u16) -> Option<Answer> {
    let mut s = TcpStream::connect_timeout(
        &std::net::SocketAddr::from(([127, 0, 0, 1], port)),
        Duration::from_millis(500),
    )
    .ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let get = |k: &str| {
        text.split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{k}=")).map(str::to_owned))
    };
    Some(Answer {
        slot: get("slot")?,
        boot: get("boot").and_then(|v| v.parse().ok()).unwrap_or(0),
        weights: get("weights").unwrap_or_default(),
        loaded: get("loaded").as_deref() == Some("true"),
        lock_us: get("lock_us").and_then(|v| v.parse().ok()).unwrap_or(0),
        ready_us: get("ready_us").and_then(|v| v.parse().ok()).unwrap_or(0),
        ranks: get("ranks").and_then(|v| v.parse().ok()).unwrap_or(1),
        gms: get("gms").unwrap_or_default(),
    })
}

/// Poll `f` every `step` until it returns Some, or fail after `limit`.
pub fn until<T>(
    what: &str,
    limit: Duration,
    step: Duration,
    mut f: impl FnMut() -> Option<T>,
) -> T {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {limit:?} waiting for {what}"
        );
        std::thread::sleep(step);
    }
}

impl PairEnv {
    /// Config under `cd`'s dir; `extra` is appended inside `[pair]`.
    pub fn new(cd: &Containerd, extra: &str) -> Result<Self> {
        let state_dir = cd.dir().join("pairs");
        let metrics_dir = cd.dir().join("metrics");
        let config = cd.dir().join("shadow-pair.toml");
        let text = format!(
            "log_level = \"debug\"\n[pair]\nstate_dir = \"{}\"\nmetrics_dir = \"{}\"\n{extra}\n",
            state_dir.display(),
            metrics_dir.display()
        );
        std::fs::write(&config, text).map_err(|e| Error::io("write shim config", &config, e))?;
        Ok(PairEnv {
            state_dir,
            metrics_dir,
            config,
        })
    }

    /// Install the test engine as /bin/test-engine in `cd`'s rootfs.
    pub fn install_engine(cd: &Containerd, engine: &Path) -> Result<()> {
        install_binary(cd.rootfs(), engine, "/bin/test-engine")
    }

    /// `ctr run -d`-less background run of a pair (ctr stays attached, as a
    /// user's `ctr run` does), host network.
    pub fn run(
        &self,
        cd: &Containerd,
        id: &str,
        annotations: &[(&str, &str)],
        flags: &[&str],
        cmd: &[&str],
    ) -> Result<Spawned> {
        let mut c = cd
            .container(Runtime::Shadow, id)
            .flags(&["--runtime-config-path", &self.config.display().to_string()])
            .annotation(shadow_contract::annotations::PAIR, "true")
            .flags(flags);
        for (k, v) in annotations {
            c = c.annotation(k, v);
        }
        c.cmd(cmd).spawn(false)
    }

    pub fn pair_dir(&self, cd: &Containerd, id: &str) -> PathBuf {
        self.state_dir.join(cd.namespace()).join(id)
    }

    /// The pair's `state.json`, if it exists and parses.
    pub fn state(&self, cd: &Containerd, id: &str) -> Option<PairState> {
        PairState::read(&self.pair_dir(cd, id).join(FILE_NAME)).ok()
    }

    /// Wait until the pair has an active engine and a parked shadow.
    pub fn wait_protected(&self, cd: &Containerd, id: &str, limit: Duration) -> PairState {
        until(
            &format!("pair {id} protected"),
            limit,
            Duration::from_millis(5),
            || self.state(cd, id).filter(|s| s.pair.protected),
        )
    }
}

/// The pid of a task as `ctr task ls` shows it.
pub fn task_pid(cd: &Containerd, id: &str) -> Option<u32> {
    cd.ctr()
        .tasks()
        .ok()?
        .into_iter()
        .find(|t| t.id == id)
        .map(|t| t.pid)
}
