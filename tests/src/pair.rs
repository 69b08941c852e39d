//! Harness for engine pairs: a shim config that keeps every pair artefact
//! under the test's temp dir, the test engine (and its shared libraries)
//! installed into the rootfs, `state.json` reading, and the TCP question
//! "who serves?" — all waits are bounded polls on real state.

/// The harness's poll, where the pair tests and binaries import it from.
pub use crate::wait::until;
use crate::{Containerd, Error, Result, Runtime, Spawned};
use shadow_contract::host::{containerd_key, metrics_file_name, pair_root, HOST_SOCKETS};
use shadow_contract::state::{PairState, FILE_NAME};
use std::io::Read;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

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
        // Written aside and renamed into place: a shim started by an
        // earlier PairEnv of the same containerd may be reading the file
        // right now, and a write in place would show it an empty file (a
        // valid config of defaults: another state_dir, another gms).
        let mut aside = tempfile::NamedTempFile::new_in(cd.dir())
            .map_err(|e| Error::io("write shim config", cd.dir(), e))?;
        std::io::Write::write_all(&mut aside, text.as_bytes())
            .map_err(|e| Error::io("write shim config", aside.path(), e))?;
        aside
            .persist(&config)
            .map_err(|e| Error::io("rename shim config into place", &config, e.error))?;
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

    /// A pair container `id` under this config (the shim's, and
    /// `shadow.dev/pair`), for the caller to add to and spawn.
    pub fn container<'a>(&self, cd: &'a Containerd, id: &str) -> crate::Container<'a> {
        cd.container(Runtime::Shadow, id)
            .flags(&["--runtime-config-path", &self.config.display().to_string()])
            .annotation(shadow_contract::annotations::PAIR, "true")
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
        let mut c = self.container(cd, id).flags(flags);
        for (k, v) in annotations {
            c = c.annotation(k, v);
        }
        c.cmd(cmd).spawn(false)
    }

    /// The state dir of `cd`'s pairs: `<state_dir>/<containerd key>`.
    pub fn containerd_dir(&self, cd: &Containerd) -> PathBuf {
        self.state_dir
            .join(containerd_key(&cd.address().display().to_string()))
    }

    /// A pair's directory (of a pair without GPUs), as the shim names it.
    pub fn pair_dir(&self, cd: &Containerd, id: &str) -> PathBuf {
        let key = containerd_key(&cd.address().display().to_string());
        pair_root(&self.state_dir, &key, cd.namespace(), id, HOST_SOCKETS)
    }

    /// A pair's metrics file.
    pub fn metrics_file(&self, cd: &Containerd, id: &str) -> PathBuf {
        let key = containerd_key(&cd.address().display().to_string());
        self.metrics_dir
            .join(metrics_file_name(&key, cd.namespace(), id))
    }

    /// The value of the sample `name{<the pair's labels><labels>}` in the
    /// pair's metrics file (`labels`: the rest, e.g. `,reason="oversized"`),
    /// if the file has it.
    pub fn metric(&self, cd: &Containerd, id: &str, name: &str, labels: &str) -> Option<f64> {
        let text = std::fs::read_to_string(self.metrics_file(cd, id)).ok()?;
        // The pair's labels end with its id.
        let tail = format!("pair=\"{id}\"{labels}}} ");
        text.lines()
            .filter_map(|l| l.strip_prefix(name)?.strip_prefix('{'))
            .find_map(|l| {
                let (_, value) = l.split_once(&tail)?;
                value.trim().parse().ok()
            })
    }

    /// The pid of the pair's gmsd once `state.json` reports it (the shim
    /// refreshes gmsd's status on its own schedule).
    pub fn gmsd_pid(&self, cd: &Containerd, id: &str, limit: Duration) -> u32 {
        until(
            "gmsd status in state.json",
            limit,
            Duration::from_millis(2),
            || self.state(cd, id).and_then(|v| v.gms.map(|g| g.pid)),
        )
    }

    /// The pair's `state.json`, if it exists and parses.
    pub fn state(&self, cd: &Containerd, id: &str) -> Option<PairState> {
        PairState::read(&self.pair_dir(cd, id).join(FILE_NAME)).ok()
    }

    /// Kill the task `id` with `sig` and check what a pair's end must leave:
    /// `ctr run` (its `ctr`) ends with a failure, nothing of containerd's,
    /// no pair directory and no metrics file.
    pub fn stop(&self, cd: &Containerd, id: &str, sig: &str, ctr: Spawned, limit: Duration) {
        cd.ctr()
            .run(&["task", "kill", "--signal", sig, id])
            .expect("ctr task kill")
            .assert_success();
        let out = ctr.wait(limit).expect("ctr run ends");
        assert_ne!(out.code(), 0, "{out}");
        cd.assert_no_leftovers();
        assert!(!self.pair_dir(cd, id).exists(), "pair dir left");
        assert_eq!(
            std::fs::read_dir(&self.metrics_dir)
                .map(|d| d.count())
                .unwrap_or(0),
            0,
            "metrics file left"
        );
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

/// The pid of the shim serving task `id` of `cd` (its command line names
/// the binary, `cd`'s address and `-id <id>`), if one runs.
pub fn shim_pid(cd: &Containerd, id: &str) -> Option<i32> {
    crate::leftovers::our_processes(cd.dir(), cd.address())
        .into_iter()
        .find(|(_, cmd)| {
            let words: Vec<&str> = cmd.split(' ').collect();
            words
                .first()
                .is_some_and(|w| w.ends_with("containerd-shim-shadow-v1"))
                && words.windows(2).any(|w| w == ["-id", id])
        })
        .map(|(pid, _)| pid)
}

/// SIGKILL the shim of task `id` (as the OOM killer or a crash would end
/// it), then wait until containerd has noticed and run its cleanup (the
/// shim binary's `delete`): the task is gone from `ctr task ls`, or
/// stopped. Returns the killed shim's pid.
pub fn kill_shim(cd: &Containerd, id: &str, limit: Duration) -> i32 {
    let pid = shim_pid(cd, id).unwrap_or_else(|| panic!("no shim serves {id}"));
    // SAFETY: kill(2) with a pid whose command line we just read and a
    // signal number; a recycled pid in between is not a concern in a test.
    let rc = unsafe { libc::kill(pid, libc::SIGKILL) };
    assert_eq!(
        rc,
        0,
        "kill shim {pid}: {}",
        std::io::Error::last_os_error()
    );
    until(
        &format!("containerd to clean up after shim {pid} of {id}"),
        limit,
        Duration::from_millis(20),
        || {
            // Gone, or a zombie nobody reaped yet.
            let gone = std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .map(|s| {
                    s.rsplit(')')
                        .next()
                        .unwrap_or("")
                        .trim_start()
                        .starts_with('Z')
                })
                .unwrap_or(true);
            // While containerd has not yet cleaned up, the task shows as
            // UNKNOWN (its shim does not answer); then it is stopped, or
            // gone (`ctr run --rm`).
            let status = cd.ctr().task_status(id).ok()?;
            (gone && matches!(status.as_deref(), None | Some("STOPPED"))).then_some(())
        },
    );
    pid
}

/// The pids of `pid`'s children (an engine's ranks).
pub fn children(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}
