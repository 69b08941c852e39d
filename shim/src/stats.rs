//! Where a container's cgroup is, and its task metrics in the message type
//! runc-v2 returns: `io.containerd.cgroups.v1.Metrics` on cgroup v1 (this
//! machine), `io.containerd.cgroups.v2.Metrics` on the unified hierarchy.
//!
//! The cgroup and its controllers' files come from cgroups-rs (which
//! containerd-shim links), so stats, OOM watchers and the pair's cgroup
//! find a cgroup the same way. containerd-shim's own `collect_metrics` is
//! not used: it answers the v1 type on v2 too, fills a handful of fields
//! and `unwrap()`s kernel text. What is left here is the mapping of
//! cgroups-rs's values onto containerd's messages.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use cgroups_rs::fs::cpu::CpuController;
use cgroups_rs::fs::cpuacct::CpuAcctController;
use cgroups_rs::fs::memory::MemController;
use cgroups_rs::fs::pid::PidController;
use cgroups_rs::fs::{flat_keyed_to_hashmap, hierarchies, Cgroup, Controller, MaxValue};
use containerd_shim_protos::cgroups::metrics as v1;
use containerd_shim_protos::cgroups_v2::metrics as v2;
use containerd_shim_protos::protobuf::{well_known_types::any::Any, MessageFull};

use crate::error::{Error, Result};

/// The cgroup `pid` is in (on v1, its directory in every hierarchy).
pub fn of_pid(pid: u32) -> Result<Cgroup> {
    containerd_shim::cgroup::get_cgroup(pid).map_err(|e| Error::Internal {
        what: format!("finding the cgroup of pid {pid}"),
        reason: e.to_string(),
    })
}

/// The cgroup at `path` (a `cgroupsPath`: `/ns/id`), made or not.
pub fn at(path: &str) -> Cgroup {
    Cgroup::load(hierarchies::auto(), path.trim_start_matches('/'))
}

/// The memory controller's directory of `cg`, if it has one.
pub fn memory_dir(cg: &Cgroup) -> Option<PathBuf> {
    cg.controller_of::<MemController>()
        .map(|m| m.path().to_path_buf())
}

/// The metrics of `cg` as the `Any` containerd expects.
pub fn collect(cg: &Cgroup) -> Result<Any> {
    if cg.v2() {
        pack(&metrics_v2(cg))
    } else {
        pack(&metrics_v1(cg))
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

/// A flat keyed file (`key value` lines) of a controller; absent → empty.
pub fn keyed(dir: &Path, file: &str) -> HashMap<String, u64> {
    File::open(dir.join(file))
        .ok()
        .and_then(|f| flat_keyed_to_hashmap(f).ok())
        .unwrap_or_default()
        .into_iter()
        .map(|(k, v)| (k, u64::try_from(v).unwrap_or(0)))
        .collect()
}

/// A limit as runc reports it: none (`max`, -1) is 0.
fn limit(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

fn pids(cg: &Cgroup) -> Option<(u64, u64)> {
    let p = cg.controller_of::<PidController>()?;
    let max = match p.get_pid_max() {
        Ok(MaxValue::Value(v)) => limit(v),
        _ => 0,
    };
    Some((p.get_pid_current().unwrap_or(0), max))
}

/// `to.f = get("f")` for each field: containerd names these fields after
/// the kernel's keys.
macro_rules! by_key {
    ($to:expr, $get:expr; $($f:ident),+ $(,)?) => {
        $($to.$f = $get(stringify!($f));)+
    };
}

/// A v1 memory entry from any of cgroups-rs's usage/limit structs.
macro_rules! entry {
    ($s:expr) => {{
        let s = $s;
        let mut e = v1::MemoryEntry::new();
        (e.usage, e.max) = (s.usage_in_bytes, s.max_usage_in_bytes);
        (e.limit, e.failcnt) = (limit(s.limit_in_bytes), s.fail_cnt);
        Some(e).into()
    }};
}

/// A key of a keyed map, absent → 0.
fn get(map: &HashMap<String, u64>) -> impl Fn(&str) -> u64 + '_ {
    |k| map.get(k).copied().unwrap_or(0)
}

fn metrics_v1(cg: &Cgroup) -> v1::Metrics {
    let mut m = v1::Metrics::new();
    if let Some((current, max)) = pids(cg) {
        let mut p = v1::PidsStat::new();
        (p.current, p.limit) = (current, max);
        m.pids = Some(p).into();
    }
    let mut cpu = v1::CPUStat::new();
    if let Some(acct) = cg.controller_of::<CpuAcctController>() {
        let a = acct.cpuacct();
        let mut u = v1::CPUUsage::new();
        u.total = a.usage;
        let per_cpu = a.usage_percpu.split_whitespace();
        u.per_cpu = per_cpu.filter_map(|x| x.parse().ok()).collect();
        // cpuacct.stat is in USER_HZ ticks; runc reports nanoseconds.
        let stat = keyed(acct.path(), "cpuacct.stat");
        let tick_ns = 1_000_000_000 / clock_ticks();
        u.user = get(&stat)("user") * tick_ns;
        u.kernel = get(&stat)("system") * tick_ns;
        cpu.usage = Some(u).into();
    }
    if let Some(c) = cg.controller_of::<CpuController>() {
        let s = keyed(c.path(), "cpu.stat");
        let mut t = v1::Throttle::new();
        t.periods = get(&s)("nr_periods");
        t.throttled_periods = get(&s)("nr_throttled");
        t.throttled_time = get(&s)("throttled_time");
        cpu.throttling = Some(t).into();
    }
    m.cpu = Some(cpu).into();
    let Some(mem) = cg.controller_of::<MemController>() else {
        return m;
    };
    let all = mem.memory_stat();
    let g = get(&all.stat.raw);
    let mut ms = v1::MemoryStat::new();
    by_key!(ms, g; cache, rss, rss_huge, mapped_file, dirty, writeback, inactive_anon,
        active_anon, inactive_file, active_file, unevictable, hierarchical_memory_limit,
        total_cache, total_rss, total_rss_huge, total_mapped_file, total_dirty,
        total_writeback, total_inactive_anon, total_active_anon, total_inactive_file,
        total_active_file, total_unevictable);
    (ms.pg_pg_in, ms.pg_pg_out) = (g("pgpgin"), g("pgpgout"));
    (ms.pg_fault, ms.pg_maj_fault) = (g("pgfault"), g("pgmajfault"));
    (ms.total_pg_pg_in, ms.total_pg_pg_out) = (g("total_pgpgin"), g("total_pgpgout"));
    (ms.total_pg_fault, ms.total_pg_maj_fault) = (g("total_pgfault"), g("total_pgmajfault"));
    ms.hierarchical_swap_limit = g("hierarchical_memsw_limit");
    ms.usage = entry!(&all);
    ms.swap = entry!(mem.memswap());
    ms.kernel = entry!(mem.kmem_stat());
    ms.kernel_tcp = entry!(mem.kmem_tcp_stat());
    m.memory = Some(ms).into();
    let (oom, mut oc) = (&all.oom_control, v1::MemoryOomControl::new());
    (oc.oom_kill_disable, oc.under_oom) = (oom.oom_kill_disable.into(), oom.under_oom.into());
    oc.oom_kill = oom.oom_kill;
    m.memory_oom_control = Some(oc).into();
    m
}

fn metrics_v2(cg: &Cgroup) -> v2::Metrics {
    let mut m = v2::Metrics::new();
    let mut p = v2::PidsStat::new();
    (p.current, p.limit) = pids(cg).unwrap_or_default();
    m.pids = Some(p).into();

    if let Some(c) = cg.controller_of::<CpuController>() {
        let s = keyed(c.path(), "cpu.stat");
        let mut cpu = v2::CPUStat::new();
        by_key!(cpu, get(&s); usage_usec, user_usec, system_usec, nr_periods, nr_throttled,
            throttled_usec);
        m.cpu = Some(cpu).into();
    }

    let Some(mc) = cg.controller_of::<MemController>() else {
        return m;
    };
    let all = mc.memory_stat();
    let mut mem = v2::MemoryStat::new();
    by_key!(mem, get(&all.stat.raw); anon, file, kernel_stack, slab, sock, shmem, file_mapped,
        file_dirty, file_writeback, anon_thp, inactive_anon, active_anon, inactive_file,
        active_file, unevictable, slab_reclaimable, slab_unreclaimable, pgfault, pgmajfault);
    (mem.usage, mem.max_usage) = (all.usage_in_bytes, all.max_usage_in_bytes);
    mem.usage_limit = limit(all.limit_in_bytes);
    let sw = mc.memswap();
    (mem.swap_usage, mem.swap_limit) = (sw.usage_in_bytes, limit(sw.limit_in_bytes));
    m.memory = Some(mem).into();

    let e = keyed(mc.path(), "memory.events");
    let mut ev = v2::MemoryEvents::new();
    by_key!(ev, get(&e); low, high, max, oom, oom_kill);
    m.memory_events = Some(ev).into();
    m
}

fn clock_ticks() -> u64 {
    use nix::unistd::{sysconf, SysconfVar};
    match sysconf(SysconfVar::CLK_TCK) {
        Ok(Some(t)) if t > 0 => t as u64,
        _ => 100,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cgroups_rs::fs::{Hierarchy, Subsystem};

    /// A hierarchy of plain directories, so metrics are read from files a
    /// test wrote: v1 with one directory per controller, or one for v2.
    #[derive(Debug)]
    struct Files {
        root: PathBuf,
        v2: bool,
    }

    impl Hierarchy for Files {
        fn subsystems(&self) -> Vec<Subsystem> {
            let at = |c: &str| {
                let d = if self.v2 {
                    self.root.clone()
                } else {
                    self.root.join(c)
                };
                (d.clone(), d)
            };
            let (p, b) = at("pids");
            let pid = Subsystem::Pid(PidController::new(p, b, self.v2));
            let (p, b) = at("memory");
            let mem = Subsystem::Mem(MemController::new(p, b, self.v2));
            let (p, b) = at("cpu");
            let cpu = Subsystem::Cpu(CpuController::new(p, b, self.v2));
            let (p, b) = at("cpuacct");
            let mut subs = vec![pid, mem, cpu];
            if !self.v2 {
                subs.push(Subsystem::CpuAcct(CpuAcctController::new(p, b)));
            }
            subs
        }
        fn root(&self) -> PathBuf {
            self.root.clone()
        }
        fn root_control_group(&self) -> Cgroup {
            Cgroup::default()
        }
        fn parent_control_group(&self, _: &str) -> Cgroup {
            Cgroup::default()
        }
        fn v2(&self) -> bool {
            self.v2
        }
    }

    /// Writes `files` (path below the root, text) and loads cgroup `c1`.
    fn cgroup(v2: bool, files: &[(&str, &str)]) -> (tempfile::TempDir, Cgroup) {
        let d = tempfile::tempdir().unwrap();
        for (f, text) in files {
            let p = d.path().join(f);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }
        let h = Files {
            root: d.path().to_path_buf(),
            v2,
        };
        let cg = Cgroup::load(Box::new(h), "c1");
        (d, cg)
    }

    #[test]
    fn v2_metrics_from_files_with_type_url() {
        let (d, cg) = cgroup(
            true,
            &[
                ("c1/pids.current", "3\n"),
                ("c1/pids.max", "max\n"),
                (
                    "c1/cpu.stat",
                    "usage_usec 100\nuser_usec 60\nsystem_usec 40\n",
                ),
                ("c1/memory.current", "4096\n"),
                ("c1/memory.max", "8192\n"),
                ("c1/memory.swap.max", "max\n"),
                ("c1/memory.stat", "anon 11\nfile 22\npgmajfault 3\n"),
                (
                    "c1/memory.events",
                    "low 0\nhigh 0\nmax 2\noom 1\noom_kill 1\n",
                ),
            ],
        );
        let m = metrics_v2(&cg);
        assert_eq!((m.pids.current, m.pids.limit), (3, 0));
        assert_eq!((m.cpu.usage_usec, m.cpu.user_usec), (100, 60));
        assert_eq!((m.memory.usage, m.memory.usage_limit), (4096, 8192));
        assert_eq!((m.memory.anon, m.memory.file), (11, 22));
        assert_eq!((m.memory.pgmajfault, m.memory.swap_limit), (3, 0));
        assert_eq!((m.memory_events.max, m.memory_events.oom_kill), (2, 1));
        assert_eq!(memory_dir(&cg), Some(d.path().join("c1")));
        assert_eq!(
            pack(&m).unwrap().type_url,
            "io.containerd.cgroups.v2.Metrics"
        );
    }

    #[test]
    fn v1_metrics_from_files_with_type_url() {
        let (d, cg) = cgroup(
            false,
            &[
                ("memory/c1/memory.usage_in_bytes", "1000\n"),
                ("memory/c1/memory.limit_in_bytes", "9223372036854771712\n"),
                ("memory/c1/memory.memsw.failcnt", "4\n"),
                ("memory/c1/memory.kmem.tcp.usage_in_bytes", "8\n"),
                (
                    "memory/c1/memory.stat",
                    "cache 5\nrss 7\ntotal_inactive_file 9\nhierarchical_memory_limit 6\n",
                ),
                (
                    "memory/c1/memory.oom_control",
                    "oom_kill_disable 0\nunder_oom 1\noom_kill 2\n",
                ),
                ("pids/c1/pids.current", "2\n"),
                ("pids/c1/pids.max", "50\n"),
                ("cpuacct/c1/cpuacct.usage", "123\n"),
                ("cpuacct/c1/cpuacct.usage_percpu", "100 23 \n"),
                ("cpuacct/c1/cpuacct.stat", "user 2\nsystem 1\n"),
                (
                    "cpu/c1/cpu.stat",
                    "nr_periods 5\nnr_throttled 1\nthrottled_time 77\n",
                ),
            ],
        );
        let m = metrics_v1(&cg);
        let mem = &m.memory;
        assert_eq!(
            (mem.usage.usage, mem.usage.limit),
            (1000, 9223372036854771712)
        );
        assert_eq!((mem.rss, mem.cache, mem.total_inactive_file), (7, 5, 9));
        assert_eq!(mem.hierarchical_memory_limit, 6);
        assert_eq!((mem.swap.failcnt, mem.kernel_tcp.usage), (4, 8));
        // An absent kmem limit (cgroups-rs: -1) is no limit.
        assert_eq!(mem.kernel.limit, 0);
        let oom = &m.memory_oom_control;
        assert_eq!((oom.under_oom, oom.oom_kill), (1, 2));
        assert_eq!((m.pids.current, m.pids.limit), (2, 50));
        assert_eq!(m.cpu.usage.total, 123);
        assert_eq!(m.cpu.usage.per_cpu, vec![100, 23]);
        let tick = 1_000_000_000 / clock_ticks();
        assert_eq!((m.cpu.usage.user, m.cpu.usage.kernel), (2 * tick, tick));
        let t = &m.cpu.throttling;
        assert_eq!(
            (t.periods, t.throttled_periods, t.throttled_time),
            (5, 1, 77)
        );
        assert_eq!(memory_dir(&cg), Some(d.path().join("memory/c1")));
        assert_eq!(
            pack(&m).unwrap().type_url,
            "io.containerd.cgroups.v1.Metrics"
        );
    }

    #[test]
    fn a_missing_cgroup_reads_as_zeros() {
        let (_d, cg) = cgroup(false, &[]);
        let m = metrics_v1(&cg);
        assert_eq!((m.pids.current, m.memory.usage.usage), (0, 0));
    }

    #[test]
    fn the_cgroup_of_this_process_is_found() {
        let cg = of_pid(std::process::id()).unwrap();
        assert!(memory_dir(&cg).is_some_and(|d| d.is_dir()));
        assert!(of_pid(u32::MAX).is_err());
    }
}
