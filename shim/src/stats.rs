//! Task metrics from the container's cgroup, in the message type runc-v2
//! returns: `io.containerd.cgroups.v1.Metrics` on cgroup v1 (this machine),
//! `io.containerd.cgroups.v2.Metrics` on the unified hierarchy. Read
//! straight from cgroupfs: a handful of small files, no library state.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use containerd_shim_protos::cgroups::metrics as v1;
use containerd_shim_protos::cgroups_v2::metrics as v2;
use containerd_shim_protos::protobuf::{well_known_types::any::Any, MessageFull};

use crate::error::{Error, Result};

pub const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// Where a process's cgroup lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CgroupPaths {
    /// controller name → directory.
    V1(HashMap<String, PathBuf>),
    V2(PathBuf),
}

impl CgroupPaths {
    pub fn of_pid(pid: u32) -> Result<Self> {
        let file = format!("/proc/{pid}/cgroup");
        let text =
            std::fs::read_to_string(&file).map_err(|e| Error::io(format!("reading {file}"), e))?;
        let unified = Path::new(CGROUP_ROOT).join("cgroup.controllers").exists();
        Ok(Self::parse(&text, Path::new(CGROUP_ROOT), unified))
    }

    /// Parse `/proc/<pid>/cgroup` (`id:controllers:path` lines).
    pub fn parse(text: &str, root: &Path, unified: bool) -> Self {
        let mut v1 = HashMap::new();
        for line in text.lines() {
            let mut parts = line.splitn(3, ':');
            let (Some(_), Some(ctrls), Some(path)) = (parts.next(), parts.next(), parts.next())
            else {
                continue;
            };
            let rel = path.trim_start_matches('/');
            if unified {
                if ctrls.is_empty() {
                    return CgroupPaths::V2(root.join(rel));
                }
                continue;
            }
            if ctrls.is_empty() || ctrls.starts_with("name=") {
                continue;
            }
            for c in ctrls.split(',') {
                v1.insert(c.to_string(), root.join(ctrls).join(rel));
            }
        }
        CgroupPaths::V1(v1)
    }

    pub fn memory_dir(&self) -> Option<&Path> {
        match self {
            CgroupPaths::V1(m) => m.get("memory").map(PathBuf::as_path),
            CgroupPaths::V2(p) => Some(p),
        }
    }
}

/// Collect metrics for the cgroup of `pid` as an `Any`.
pub fn collect(pid: u32) -> Result<Any> {
    match CgroupPaths::of_pid(pid)? {
        CgroupPaths::V1(dirs) => pack(&collect_v1(&dirs)),
        CgroupPaths::V2(dir) => pack(&collect_v2(&dir)),
    }
}

/// Metrics of the cgroup *above* the one of `pid`: an engine pair's
/// cgroup, whose children are the two engines.
pub fn collect_parent(pid: u32) -> Result<Any> {
    let up = |p: PathBuf| p.parent().map(Path::to_path_buf).unwrap_or(p);
    match CgroupPaths::of_pid(pid)? {
        CgroupPaths::V1(dirs) => pack(&collect_v1(
            &dirs.into_iter().map(|(c, d)| (c, up(d))).collect(),
        )),
        CgroupPaths::V2(dir) => pack(&collect_v2(&up(dir))),
    }
}

fn pack<M: MessageFull>(m: &M) -> Result<Any> {
    Ok(Any {
        type_url: M::descriptor().full_name().to_string(),
        value: m.write_to_bytes().map_err(|e| Error::Internal {
            what: format!("encoding {}", M::descriptor().full_name()),
            reason: e.to_string(),
        })?,
        ..Default::default()
    })
}

fn read_u64(path: &Path) -> u64 {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// `max` (no limit) reads as 0, as runc reports it.
fn read_limit(path: &Path) -> u64 {
    read_u64(path)
}

/// A flat keyed file (`key value` per line).
pub fn read_keyed(path: &Path) -> HashMap<String, u64> {
    std::fs::read_to_string(path)
        .map(|s| parse_keyed(&s))
        .unwrap_or_default()
}

pub fn parse_keyed(text: &str) -> HashMap<String, u64> {
    text.lines()
        .filter_map(|l| {
            let mut it = l.split_whitespace();
            Some((it.next()?.to_string(), it.next()?.parse().ok()?))
        })
        .collect()
}

pub fn collect_v1(dirs: &HashMap<String, PathBuf>) -> v1::Metrics {
    let mut m = v1::Metrics::new();
    if let Some(d) = dirs.get("pids") {
        let mut p = v1::PidsStat::new();
        p.current = read_u64(&d.join("pids.current"));
        p.limit = read_limit(&d.join("pids.max"));
        m.pids = Some(p).into();
    }
    let mut cpu = v1::CPUStat::new();
    if let Some(d) = dirs.get("cpuacct") {
        let mut u = v1::CPUUsage::new();
        u.total = read_u64(&d.join("cpuacct.usage"));
        u.per_cpu = std::fs::read_to_string(d.join("cpuacct.usage_percpu"))
            .map(|s| {
                s.split_whitespace()
                    .filter_map(|x| x.parse().ok())
                    .collect()
            })
            .unwrap_or_default();
        // cpuacct.stat is in USER_HZ ticks; runc reports nanoseconds.
        let stat = read_keyed(&d.join("cpuacct.stat"));
        let tick_ns = 1_000_000_000 / clock_ticks();
        u.user = stat.get("user").copied().unwrap_or(0) * tick_ns;
        u.kernel = stat.get("system").copied().unwrap_or(0) * tick_ns;
        cpu.usage = Some(u).into();
    }
    if let Some(d) = dirs.get("cpu") {
        let s = read_keyed(&d.join("cpu.stat"));
        let mut t = v1::Throttle::new();
        t.periods = s.get("nr_periods").copied().unwrap_or(0);
        t.throttled_periods = s.get("nr_throttled").copied().unwrap_or(0);
        t.throttled_time = s.get("throttled_time").copied().unwrap_or(0);
        cpu.throttling = Some(t).into();
    }
    m.cpu = Some(cpu).into();
    if let Some(d) = dirs.get("memory") {
        let entry = |prefix: &str| {
            let mut e = v1::MemoryEntry::new();
            e.usage = read_u64(&d.join(format!("{prefix}.usage_in_bytes")));
            e.limit = read_u64(&d.join(format!("{prefix}.limit_in_bytes")));
            e.max = read_u64(&d.join(format!("{prefix}.max_usage_in_bytes")));
            e.failcnt = read_u64(&d.join(format!("{prefix}.failcnt")));
            e
        };
        let s = read_keyed(&d.join("memory.stat"));
        let g = |k: &str| s.get(k).copied().unwrap_or(0);
        let mut ms = v1::MemoryStat::new();
        ms.cache = g("cache");
        ms.rss = g("rss");
        ms.rss_huge = g("rss_huge");
        ms.mapped_file = g("mapped_file");
        ms.dirty = g("dirty");
        ms.writeback = g("writeback");
        ms.pg_pg_in = g("pgpgin");
        ms.pg_pg_out = g("pgpgout");
        ms.pg_fault = g("pgfault");
        ms.pg_maj_fault = g("pgmajfault");
        ms.inactive_anon = g("inactive_anon");
        ms.active_anon = g("active_anon");
        ms.inactive_file = g("inactive_file");
        ms.active_file = g("active_file");
        ms.unevictable = g("unevictable");
        ms.hierarchical_memory_limit = g("hierarchical_memory_limit");
        ms.hierarchical_swap_limit = g("hierarchical_memsw_limit");
        ms.total_cache = g("total_cache");
        ms.total_rss = g("total_rss");
        ms.total_rss_huge = g("total_rss_huge");
        ms.total_mapped_file = g("total_mapped_file");
        ms.total_dirty = g("total_dirty");
        ms.total_writeback = g("total_writeback");
        ms.total_pg_pg_in = g("total_pgpgin");
        ms.total_pg_pg_out = g("total_pgpgout");
        ms.total_pg_fault = g("total_pgfault");
        ms.total_pg_maj_fault = g("total_pgmajfault");
        ms.total_inactive_anon = g("total_inactive_anon");
        ms.total_active_anon = g("total_active_anon");
        ms.total_inactive_file = g("total_inactive_file");
        ms.total_active_file = g("total_active_file");
        ms.total_unevictable = g("total_unevictable");
        ms.usage = Some(entry("memory")).into();
        ms.swap = Some(entry("memory.memsw")).into();
        ms.kernel = Some(entry("memory.kmem")).into();
        ms.kernel_tcp = Some(entry("memory.kmem.tcp")).into();
        m.memory = Some(ms).into();
        let oom = read_keyed(&d.join("memory.oom_control"));
        let mut oc = v1::MemoryOomControl::new();
        oc.oom_kill_disable = oom.get("oom_kill_disable").copied().unwrap_or(0);
        oc.under_oom = oom.get("under_oom").copied().unwrap_or(0);
        oc.oom_kill = oom.get("oom_kill").copied().unwrap_or(0);
        m.memory_oom_control = Some(oc).into();
    }
    m
}

pub fn collect_v2(d: &Path) -> v2::Metrics {
    let mut m = v2::Metrics::new();
    let mut p = v2::PidsStat::new();
    p.current = read_u64(&d.join("pids.current"));
    p.limit = read_limit(&d.join("pids.max"));
    m.pids = Some(p).into();

    let s = read_keyed(&d.join("cpu.stat"));
    let g = |k: &str| s.get(k).copied().unwrap_or(0);
    let mut cpu = v2::CPUStat::new();
    cpu.usage_usec = g("usage_usec");
    cpu.user_usec = g("user_usec");
    cpu.system_usec = g("system_usec");
    cpu.nr_periods = g("nr_periods");
    cpu.nr_throttled = g("nr_throttled");
    cpu.throttled_usec = g("throttled_usec");
    m.cpu = Some(cpu).into();

    let s = read_keyed(&d.join("memory.stat"));
    let g = |k: &str| s.get(k).copied().unwrap_or(0);
    let mut mem = v2::MemoryStat::new();
    mem.anon = g("anon");
    mem.file = g("file");
    mem.kernel_stack = g("kernel_stack");
    mem.slab = g("slab");
    mem.sock = g("sock");
    mem.shmem = g("shmem");
    mem.file_mapped = g("file_mapped");
    mem.file_dirty = g("file_dirty");
    mem.file_writeback = g("file_writeback");
    mem.anon_thp = g("anon_thp");
    mem.inactive_anon = g("inactive_anon");
    mem.active_anon = g("active_anon");
    mem.inactive_file = g("inactive_file");
    mem.active_file = g("active_file");
    mem.unevictable = g("unevictable");
    mem.slab_reclaimable = g("slab_reclaimable");
    mem.slab_unreclaimable = g("slab_unreclaimable");
    mem.pgfault = g("pgfault");
    mem.pgmajfault = g("pgmajfault");
    mem.usage = read_u64(&d.join("memory.current"));
    mem.usage_limit = read_limit(&d.join("memory.max"));
    mem.swap_usage = read_u64(&d.join("memory.swap.current"));
    mem.swap_limit = read_limit(&d.join("memory.swap.max"));
    mem.max_usage = read_u64(&d.join("memory.peak"));
    m.memory = Some(mem).into();

    let e = read_keyed(&d.join("memory.events"));
    let g = |k: &str| e.get(k).copied().unwrap_or(0);
    let mut ev = v2::MemoryEvents::new();
    ev.low = g("low");
    ev.high = g("high");
    ev.max = g("max");
    ev.oom = g("oom");
    ev.oom_kill = g("oom_kill");
    m.memory_events = Some(ev).into();
    m
}

fn clock_ticks() -> u64 {
    // SAFETY: sysconf has no memory-safety preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as u64
    } else {
        100
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_v1_and_v2_proc_cgroup() {
        let v1text = "12:pids:/default/c1\n4:memory:/default/c1\n3:cpu,cpuacct:/default/c1\n1:name=systemd:/x\n0::/\n";
        let CgroupPaths::V1(m) = CgroupPaths::parse(v1text, Path::new("/cg"), false) else {
            panic!()
        };
        assert_eq!(m["memory"], PathBuf::from("/cg/memory/default/c1"));
        assert_eq!(m["cpuacct"], PathBuf::from("/cg/cpu,cpuacct/default/c1"));
        assert!(!m.contains_key("name=systemd"));
        let v2 = CgroupPaths::parse("0::/kubepods/pod1/c1\n", Path::new("/cg"), true);
        assert_eq!(v2, CgroupPaths::V2(PathBuf::from("/cg/kubepods/pod1/c1")));
    }

    #[test]
    fn v2_metrics_from_files_with_type_url() {
        let d = tempfile::tempdir().unwrap();
        let w = |f: &str, s: &str| std::fs::write(d.path().join(f), s).unwrap();
        w("pids.current", "3\n");
        w("pids.max", "max\n");
        w("cpu.stat", "usage_usec 100\nuser_usec 60\nsystem_usec 40\n");
        w("memory.current", "4096\n");
        w("memory.max", "8192\n");
        w("memory.events", "low 0\nhigh 0\nmax 2\noom 1\noom_kill 1\n");
        let m = collect_v2(d.path());
        assert_eq!(m.pids.current, 3);
        assert_eq!(m.pids.limit, 0);
        assert_eq!(m.cpu.usage_usec, 100);
        assert_eq!(m.memory.usage, 4096);
        assert_eq!(m.memory.usage_limit, 8192);
        assert_eq!(m.memory_events.oom_kill, 1);
        assert_eq!(
            pack(&m).unwrap().type_url,
            "io.containerd.cgroups.v2.Metrics"
        );
    }

    #[test]
    fn v1_metrics_from_files_with_type_url() {
        let d = tempfile::tempdir().unwrap();
        for c in ["memory", "pids", "cpuacct"] {
            std::fs::create_dir(d.path().join(c)).unwrap();
        }
        let w = |f: &str, s: &str| std::fs::write(d.path().join(f), s).unwrap();
        w("memory/memory.usage_in_bytes", "1000\n");
        w(
            "memory/memory.stat",
            "cache 5\nrss 7\ntotal_inactive_file 9\n",
        );
        w("pids/pids.current", "2\n");
        w("cpuacct/cpuacct.usage", "123\n");
        w("cpuacct/cpuacct.usage_percpu", "100 23 \n");
        let dirs: HashMap<_, _> = ["memory", "pids", "cpuacct"]
            .iter()
            .map(|c| (c.to_string(), d.path().join(c)))
            .collect();
        let m = collect_v1(&dirs);
        assert_eq!(m.memory.usage.usage, 1000);
        assert_eq!(m.memory.rss, 7);
        assert_eq!(m.memory.total_inactive_file, 9);
        assert_eq!(m.pids.current, 2);
        assert_eq!(m.cpu.usage.total, 123);
        assert_eq!(m.cpu.usage.per_cpu, vec![100, 23]);
        assert_eq!(
            pack(&m).unwrap().type_url,
            "io.containerd.cgroups.v1.Metrics"
        );
    }
}
