//! What the benchmark binaries (`bench-failover`, `bench-hang`, `soak`)
//! share, so that each keeps only its own measurement: the wall clock they
//! compare with `state.json`'s `*_unix_us` stamps, percentiles of a series,
//! the profile the binary was built with (the shim they run is taken from
//! the same one), a signal to a pid read from the pair's state, and a
//! process's CPU time and context switches from `/proc`.

use std::time::{SystemTime, UNIX_EPOCH};

use crate::pair::PairEnv;
use crate::{Containerd, ContainerdBuilder};

/// Now on the wall clock, in µs since the epoch: the clock of the shim's
/// `*_unix_us` stamps in `state.json`.
pub fn now_us() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_micros()
}

/// The `p` quantile (0.0–1.0) of `v`, nearest rank; sorts `v`. NaN when empty.
pub fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        return f64::NAN;
    }
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

/// The largest of `v`; NaN when empty.
pub fn max(v: &[f64]) -> f64 {
    v.iter().copied().reduce(f64::max).unwrap_or(f64::NAN)
}

/// "release" or "debug": the profile this binary was built with, whose
/// shim it runs (the library is built with the binary, in one profile).
pub fn profile() -> &'static str {
    if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    }
}

/// Send `sig` to `pid`; whether kill(2) succeeded.
/// A private containerd running the shim of `profile` ([`profile`]), the
/// test engine installed beside the bench's binary, and a pair config
/// without GMS: what every pair bench starts from.
pub fn pair_bench(profile: &'static str) -> (Containerd, PairEnv) {
    let cd: Containerd = ContainerdBuilder::default()
        .shim_profile(profile)
        .start()
        .expect("containerd");
    let engine = std::env::current_exe()
        .expect("exe")
        .with_file_name("test-engine");
    PairEnv::install_engine(&cd, &engine).expect("install test-engine");
    let env = PairEnv::new(&cd, "gms = \"off\"").expect("config");
    (cd, env)
}

pub fn signal(pid: u32, sig: i32) -> bool {
    let Ok(pid) = i32::try_from(pid) else {
        return false;
    };
    // SAFETY: kill(2) with a pid read from the pair's state and a signal
    // number; it touches no memory of ours.
    unsafe { libc::kill(pid, sig) == 0 }
}

/// What `/proc` tells of a process's work so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProcCost {
    /// utime + stime of every thread, the exited ones included, in ms.
    pub cpu_ms: u64,
    /// Voluntary and involuntary context switches of the threads alive now.
    pub switches: u64,
}

/// The unit of `/proc/<pid>/stat`'s CPU times: clock ticks per second
/// (`_SC_CLK_TCK`, 100 on Linux); 100 if sysconf(3) says nothing usable.
pub fn clock_ticks_per_s() -> u64 {
    // SAFETY: sysconf(3) reads a constant of the system.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    u64::try_from(hz).ok().filter(|h| *h > 0).unwrap_or(100)
}

/// `pid`'s CPU time (`/proc/<pid>/stat`, fields 14 and 15, in clock ticks)
/// and context switches (`/proc/<pid>/task/*/status`); None once it is gone.
pub fn proc_cost(pid: u32) -> Option<ProcCost> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces: the fields follow its last ')'.
    // After it: state (3), ppid (4), … utime (14), stime (15).
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    let hz = clock_ticks_per_s();
    let mut switches = 0;
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))
        .ok()?
        .flatten()
    {
        let status = std::fs::read_to_string(task.path().join("status")).unwrap_or_default();
        switches += status
            .lines()
            .filter(|l| l.contains("ctxt_switches:"))
            .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
            .sum::<u64>();
    }
    Some(ProcCost {
        cpu_ms: ticks * 1000 / hz,
        switches,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_and_max() {
        let mut v = vec![5.0, 1.0, 3.0, 2.0, 4.0];
        assert_eq!(pct(&mut v, 0.5), 3.0);
        assert_eq!(pct(&mut v, 0.0), 1.0);
        assert_eq!(pct(&mut v, 1.0), 5.0);
        assert_eq!(max(&v), 5.0);
        assert!(pct(&mut [], 0.5).is_nan());
        assert!(max(&[]).is_nan());
    }

    #[test]
    fn own_cost_reads() {
        let me = proc_cost(std::process::id()).expect("our own /proc");
        assert!(me.switches > 0);
        assert_eq!(proc_cost(u32::MAX), None);
        assert!(!signal(u32::MAX, 0));
    }
}
