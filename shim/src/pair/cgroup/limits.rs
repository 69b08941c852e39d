//! The spec's resource limits written into the pair's cgroup, at Create
//! and by Update: `linux.resources` translated, setting by setting, into
//! cgroups-rs's per-controller setters, on cgroup v1 and v2 alike, in
//! runc's order and with runc's conversions. Not `Cgroup::apply` (which
//! drops memory errors) nor containerd-shim's `update_resources` (which
//! writes shares as a v2 weight and `-1` pids as a number), so a refused
//! value fails with the setting's name. Only that translation belongs
//! here; the cgroup's tree is `tree`'s.

use std::path::Path;

use cgroups_rs::fs::blkio::BlkIoController;
use cgroups_rs::fs::cpu::CpuController;
use cgroups_rs::fs::cpuset::CpuSetController;
use cgroups_rs::fs::hugetlb::HugeTlbController;
use cgroups_rs::fs::memory::MemController;
use cgroups_rs::fs::pid::PidController;
use cgroups_rs::fs::{Cgroup, Controller, MaxValue};
use oci_spec::runtime::{LinuxBlockIo, LinuxCpu, LinuxMemory, LinuxResources};

use super::tree::{failed, UNIFIED_ROOT};
use crate::error::{Error, Result};

/// The pair's cgroup as its limits see it: the cgroup written, and its
/// path for the messages.
pub struct Limits<'a> {
    /// `cgroupsPath` of the pair (`/ns/id`).
    pub path: &'a str,
    /// The pair's own cgroup (the engines and gmsd are below it).
    pub cgroup: &'a Cgroup,
    /// The cgroups below it, one per engine slot and gmsd's
    /// (`tree::leaves`), whether they exist yet or not.
    pub leaves: &'a [Cgroup],
}

impl Limits<'_> {
    /// Apply `r` to the pair (both engines are below it). Values left out,
    /// or 0, keep what the cgroup has.
    pub fn update(&self, r: &LinuxResources) -> Result<()> {
        let what = |s: String| format!("pair cgroup {}: setting {s}", self.path);
        let cg = self.cgroup;
        if let (Some(m), Some(mc)) = (r.memory(), cg.controller_of::<MemController>()) {
            set_memory(mc, m, cg.v2()).map_err(|(s, e)| failed(what(s), e))?;
        }
        if let (Some(p), Some(pc)) = (r.pids(), cg.controller_of::<PidController>()) {
            if p.limit() != 0 {
                let max = pids_max(p.limit());
                pc.set_pid_max(max)
                    .map_err(|e| failed(what(format!("pids.max = {max}")), e))?;
            }
        }
        if let Some(c) = r.cpu() {
            set_cpu(cg, c).map_err(|(s, e)| failed(what(s), e))?;
            self.set_cpuset(c)?;
        }
        if let Some(b) = r.block_io() {
            match cg.controller_of::<BlkIoController>() {
                Some(bc) => set_block_io(bc, b).map_err(|(s, e)| failed(what(s), e))?,
                None => log::warn!(
                    "pair cgroup {}: no blkio/io controller: blockIO not applied",
                    self.path
                ),
            }
        }
        if let Some(limits) = r.hugepage_limits().as_ref().filter(|l| !l.is_empty()) {
            match cg.controller_of::<HugeTlbController>() {
                Some(hc) => {
                    for l in limits {
                        let size = l.page_size();
                        let limit = u64::try_from(l.limit()).unwrap_or(u64::MAX);
                        hc.set_limit_in_bytes(size, limit).map_err(|e| {
                            failed(what(format!("hugetlb {size} limit = {limit}")), e)
                        })?;
                    }
                }
                // runc's choice too: a controller the host does not mount
                // cannot be limited.
                None => log::warn!(
                    "pair cgroup {}: no hugetlb controller on this host: hugepage limits not applied",
                    self.path
                ),
            }
        }
        if let Some(unified) = r.unified().as_ref().filter(|u| !u.is_empty()) {
            self.set_unified(unified)?;
        }
        Ok(())
    }

    /// cpuset CPUs and memory nodes. On cgroup v1 a child's set must stay
    /// within its parent's, and the engines' and gmsd's cgroups below the
    /// pair took the pair's at their creation (they carry none of their
    /// own): a pair set that drops a CPU a child has fails (EBUSY). So on
    /// v1, with children, the pair first widens to everything its own
    /// parent allows, the children take the new set, then the pair does.
    fn set_cpuset(&self, c: &LinuxCpu) -> Result<()> {
        let cpus = c.cpus().as_deref().filter(|s| !s.is_empty());
        let mems = c.mems().as_deref().filter(|s| !s.is_empty());
        let Some(cs) = self.cgroup.controller_of::<CpuSetController>() else {
            return Ok(());
        };
        if cpus.is_none() && mems.is_none() {
            return Ok(());
        }
        let write = |cs: &CpuSetController| -> SetResult {
            if let Some(cpus) = cpus {
                cs.set_cpus(cpus)
                    .map_err(|e| (format!("cpuset.cpus = {cpus}"), e))?;
            }
            if let Some(mems) = mems {
                cs.set_mems(mems)
                    .map_err(|e| (format!("cpuset.mems = {mems}"), e))?;
            }
            Ok(())
        };
        let children: Vec<&Cgroup> = if self.cgroup.v2() {
            Vec::new()
        } else {
            self.leaves.iter().filter(|c| c.exists()).collect()
        };
        if !children.is_empty() {
            if let Some(above) = cs.path().parent() {
                for file in ["cpuset.cpus", "cpuset.mems"] {
                    // Best effort: a failure shows as the children's below.
                    if let Ok(all) = std::fs::read_to_string(above.join(file)) {
                        let _ = std::fs::write(cs.path().join(file), all.trim());
                    }
                }
            }
            for child in children {
                if let Some(ccs) = child.controller_of::<CpuSetController>() {
                    write(ccs).map_err(|(s, e)| {
                        failed(format!("cgroup {}: setting {s}", child.path()), e)
                    })?;
                }
            }
        }
        write(cs).map_err(|(s, e)| failed(format!("pair cgroup {}: setting {s}", self.path), e))
    }

    /// `linux.resources.unified`: cgroup v2 files written as given, as runc
    /// does; refused on cgroup v1 (runc: "unified resources are v2 only").
    /// A key names a file of the pair's cgroup, never a path elsewhere.
    fn set_unified(&self, unified: &std::collections::HashMap<String, String>) -> Result<()> {
        if !self.cgroup.v2() {
            return Err(Error::InvalidArgument(format!(
                "pair cgroup {}: linux.resources.unified ({:?}) needs cgroup v2; this host runs cgroup v1",
                self.path,
                unified.keys().collect::<Vec<_>>()
            )));
        }
        let dir = Path::new(UNIFIED_ROOT).join(self.path.trim_start_matches('/'));
        for (key, value) in unified {
            if key.is_empty() || key.contains('/') || key.starts_with('.') {
                return Err(Error::InvalidArgument(format!(
                    "pair cgroup {}: linux.resources.unified key {key:?} is not a cgroup file name",
                    self.path
                )));
            }
            let file = dir.join(key);
            std::fs::write(&file, value).map_err(|e| {
                Error::io(
                    format!(
                        "pair cgroup {}: setting unified {key} = {value:?}",
                        self.path
                    ),
                    e,
                )
            })?;
        }
        Ok(())
    }
}

type SetResult = std::result::Result<(), (String, cgroups_rs::fs::error::Error)>;

/// OCI: a positive count, else (negative) no limit.
fn pids_max(limit: i64) -> MaxValue {
    if limit > 0 {
        MaxValue::Value(limit)
    } else {
        MaxValue::Max
    }
}

/// runc's order: when memory+swap grows past the current limit (or goes
/// unlimited) swap is written first, else memory first — the kernel refuses
/// memory.memsw.limit_in_bytes below memory.limit_in_bytes. On v2 the swap
/// file holds swap alone (`swap - memory`, runc's conversion).
fn set_memory(mc: &MemController, m: &LinuxMemory, v2: bool) -> SetResult {
    let limit = m.limit().filter(|l| *l != 0);
    // runc: unlimited memory with swap left out makes swap unlimited too.
    let mut swap = m
        .swap()
        .filter(|s| *s != 0)
        .or((limit == Some(-1)).then_some(-1));
    if !v2 && !mc.path().join("memory.memsw.limit_in_bytes").exists() {
        swap = None; // no swap accounting in this kernel: nothing to limit
    } else if v2 {
        swap = match (swap, limit) {
            (Some(-1), _) => Some(-1),
            (Some(s), Some(l)) if l > 0 => Some(s - l),
            _ => None,
        };
    }
    let set_limit = |l: i64| {
        mc.set_limit(l)
            .map_err(|e| (format!("memory limit = {l}"), e))
    };
    let set_swap = |s: i64| {
        mc.set_memswap_limit(s)
            .map_err(|e| (format!("memory+swap limit = {s}"), e))
    };
    let swap_first = !v2
        && match (swap, limit) {
            (Some(s), Some(_)) => s == -1 || s > mc.memory_stat().limit_in_bytes,
            _ => false,
        };
    if swap_first {
        swap.map_or(Ok(()), set_swap)?;
        limit.map_or(Ok(()), set_limit)?;
    } else {
        limit.map_or(Ok(()), set_limit)?;
        swap.map_or(Ok(()), set_swap)?;
    }
    if let Some(r) = m.reservation().filter(|r| *r != 0) {
        mc.set_soft_limit(r)
            .map_err(|e| (format!("memory reservation = {r}"), e))?;
    }
    // v1 only (v2 has no swappiness file), as runc.
    if let Some(s) = m.swappiness().filter(|_| !v2) {
        mc.set_swappiness(s)
            .map_err(|e| (format!("memory swappiness = {s}"), e))?;
    }
    Ok(())
}

/// Block I/O weights and throttles, per device; v2 writes io.max and
/// io.bfq.weight through the same calls (cgroups-rs).
fn set_block_io(bc: &BlkIoController, b: &LinuxBlockIo) -> SetResult {
    if let Some(w) = b.weight().filter(|w| *w != 0) {
        bc.set_weight(w.into())
            .map_err(|e| (format!("blkio weight = {w}"), e))?;
    }
    if let Some(w) = b.leaf_weight().filter(|w| *w != 0) {
        bc.set_leaf_weight(w.into())
            .map_err(|e| (format!("blkio leaf weight = {w}"), e))?;
    }
    let dev = |major: i64, minor: i64| (major.max(0) as u64, minor.max(0) as u64);
    for d in b.weight_device().iter().flatten() {
        let (major, minor) = dev(d.major(), d.minor());
        if let Some(w) = d.weight() {
            bc.set_weight_for_device(major, minor, w.into())
                .map_err(|e| (format!("blkio weight of {major}:{minor} = {w}"), e))?;
        }
        if let Some(w) = d.leaf_weight() {
            bc.set_leaf_weight_for_device(major, minor, w.into())
                .map_err(|e| (format!("blkio leaf weight of {major}:{minor} = {w}"), e))?;
        }
    }
    type Throttle = fn(&BlkIoController, u64, u64, u64) -> cgroups_rs::fs::error::Result<()>;
    let throttles: [(&str, &Option<Vec<_>>, Throttle); 4] = [
        (
            "read bps",
            b.throttle_read_bps_device(),
            BlkIoController::throttle_read_bps_for_device,
        ),
        (
            "write bps",
            b.throttle_write_bps_device(),
            BlkIoController::throttle_write_bps_for_device,
        ),
        (
            "read iops",
            b.throttle_read_iops_device(),
            BlkIoController::throttle_read_iops_for_device,
        ),
        (
            "write iops",
            b.throttle_write_iops_device(),
            BlkIoController::throttle_write_iops_for_device,
        ),
    ];
    for (name, devices, set) in throttles {
        for d in devices.iter().flatten() {
            let (major, minor) = dev(d.major(), d.minor());
            set(bc, major, minor, d.rate())
                .map_err(|e| (format!("blkio {name} of {major}:{minor} = {}", d.rate()), e))?;
        }
    }
    Ok(())
}

/// cgroup v2 has a weight (1..10000) where v1 has shares (2..262144):
/// runc's conversion.
fn weight_of_shares(shares: u64) -> u64 {
    1 + (shares.clamp(2, 262_144) - 2) * 9999 / 262_142
}

fn set_cpu(cg: &Cgroup, c: &LinuxCpu) -> SetResult {
    if let Some(cc) = cg.controller_of::<CpuController>() {
        if let Some(s) = c.shares().filter(|s| *s != 0) {
            let v = if cg.v2() { weight_of_shares(s) } else { s };
            cc.set_shares(v)
                .map_err(|e| (format!("cpu shares = {s}"), e))?;
        }
        let quota = c.quota().filter(|q| *q != 0);
        let period = c.period().filter(|p| *p != 0);
        if quota.is_some() || period.is_some() {
            // v2: one write of cpu.max; v1: period first, as runc.
            let r = if cg.v2() {
                cc.set_cfs_quota_and_period(quota, period)
            } else {
                period
                    .map_or(Ok(()), |p| cc.set_cfs_period(p))
                    .and_then(|_| quota.map_or(Ok(()), |q| cc.set_cfs_quota(q)))
            };
            r.map_err(|e| (format!("cpu quota/period = {quota:?}/{period:?}"), e))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::tests::{read, root};
    use super::super::PairCgroup;
    use super::*;
    use serde_json::json;

    #[test]
    fn conversions_follow_runc() {
        assert_eq!(weight_of_shares(2), 1);
        assert_eq!(weight_of_shares(1024), 39);
        assert_eq!(weight_of_shares(262_144), 10_000);
        assert_eq!(pids_max(20), MaxValue::Value(20));
        assert_eq!(pids_max(-1), MaxValue::Max);
    }

    /// On cgroup v1 a pair's new CPUs reach every engine's cgroup of a pair
    /// of three shadows (a child's set must stay within its parent's: the
    /// pair's write would fail while one kept a CPU it drops); v2 has no
    /// such rule, and the children are left alone.
    #[test]
    fn new_cpus_reach_every_engine_of_three_shadows() {
        use super::super::tests::TempTree;
        use super::super::tree::leaves;
        for v2 in [false, true] {
            let d = tempfile::tempdir().unwrap();
            let tree = TempTree::new(d.path(), v2);
            let cpus_of = |path: &str| -> std::path::PathBuf {
                let rel = path.trim_start_matches('/');
                if v2 {
                    d.path().join(rel).join("cpuset.cpus")
                } else {
                    d.path().join("cpuset").join(rel).join("cpuset.cpus")
                }
            };
            tree.make("/ns/pair");
            std::fs::write(cpus_of("/ns"), "0-3").unwrap();
            std::fs::write(cpus_of("/ns/pair"), "0-3").unwrap();
            let engines = ["s0", "s1", "s2", "s3"];
            for s in engines {
                tree.make(&format!("/ns/pair/{s}"));
                std::fs::write(cpus_of(&format!("/ns/pair/{s}")), "0-3").unwrap();
            }
            let cg = tree.at("/ns/pair");
            let below: Vec<Cgroup> = leaves("/ns/pair", 4).iter().map(|p| tree.at(p)).collect();
            let limits = Limits {
                path: "/ns/pair",
                cgroup: &cg,
                leaves: &below,
            };
            let r: LinuxResources = serde_json::from_value(json!({"cpu": {"cpus": "3"}})).unwrap();
            limits.update(&r).unwrap();
            let read = |p: &str| std::fs::read_to_string(cpus_of(p)).unwrap();
            assert_eq!(read("/ns/pair"), "3");
            for s in engines {
                let want = if v2 { "0-3" } else { "3" };
                assert_eq!(read(&format!("/ns/pair/{s}")), want, "v2 {v2}: {s}");
            }
        }
    }

    /// A block device of this machine (`major:minor`), for throttles.
    fn some_block_device() -> Option<(u64, u64)> {
        let mut devs: Vec<(u64, u64)> = std::fs::read_dir("/sys/block")
            .ok()?
            .flatten()
            .filter_map(|e| std::fs::read_to_string(e.path().join("dev")).ok())
            .filter_map(|t| {
                let (a, b) = t.trim().split_once(':')?;
                Some((a.parse().ok()?, b.parse().ok()?))
            })
            .collect();
        devs.sort();
        devs.into_iter().next()
    }

    /// Every resource of the spec reaches the pair's cgroup (cpuset, swap,
    /// swappiness, block I/O, hugetlb where mounted, unified on v2), at
    /// Create and through Update; `unified` is refused on cgroup v1 (root
    /// only; skipped otherwise).
    #[tokio::test]
    #[ignore = "needs root: `make test` runs it (--include-ignored)"]
    async fn every_resource_of_the_spec_reaches_the_pair_cgroup() {
        assert!(root(), "this test makes real cgroups: run it as root");
        let top = format!("/shadow-unit-res-{}", std::process::id());
        let path = format!("{top}/pair");
        let (major, minor) = some_block_device().expect("a block device");
        let cpus = std::fs::read_to_string("/sys/fs/cgroup/cpuset/cpuset.effective_cpus")
            .or_else(|_| std::fs::read_to_string("/sys/fs/cgroup/cpuset.cpus.effective"))
            .expect("cpus");
        let last_cpu = cpus
            .trim()
            .rsplit([',', '-'])
            .next()
            .expect("a cpu")
            .to_string();
        let spec = json!({
            "memory": {"limit": 67108864, "swap": 134217728, "swappiness": 10},
            "cpu": {"cpus": "0", "mems": "0"},
            "blockIO": {"throttleReadBpsDevice": [{"major": major, "minor": minor, "rate": 1048576}],
                        "throttleWriteIOPSDevice": [{"major": major, "minor": minor, "rate": 300}]},
            "hugepageLimits": [{"pageSize": "2MB", "limit": 4194304}]
        });
        let cg = PairCgroup::create(&path, Some(&spec)).expect("create");
        let v2 = cg.cgroup.v2();
        let dev = format!("{major}:{minor}");
        assert_eq!(read(&cg, "cpuset", "cpuset.cpus", "cpuset.cpus"), "0");
        assert_eq!(read(&cg, "cpuset", "cpuset.mems", "cpuset.mems"), "0");
        if v2 {
            assert_eq!(read(&cg, "", "", "memory.swap.max"), "67108864");
            let io = read(&cg, "", "", "io.max");
            assert!(
                io.contains(&format!("{dev} rbps=1048576")) && io.contains("wiops=300"),
                "{io}"
            );
        } else {
            assert_eq!(
                read(&cg, "memory", "memory.memsw.limit_in_bytes", ""),
                "134217728"
            );
            assert_eq!(read(&cg, "memory", "memory.swappiness", ""), "10");
            assert_eq!(
                read(&cg, "blkio", "blkio.throttle.read_bps_device", ""),
                format!("{dev} 1048576")
            );
            assert_eq!(
                read(&cg, "blkio", "blkio.throttle.write_iops_device", ""),
                format!("{dev} 300")
            );
        }
        if cg.cgroup.controller_of::<HugeTlbController>().is_some() {
            assert_eq!(
                read(
                    &cg,
                    "hugetlb",
                    "hugetlb.2MB.limit_in_bytes",
                    "hugetlb.2MB.max"
                ),
                "4194304"
            );
        }

        // An engine's cgroup below the pair takes the pair's CPUs, as runc's
        // do; moving the pair to other CPUs must still work.
        let engine = crate::stats::at(&format!("{path}/s0"));
        engine.create().expect("an engine cgroup");

        // Update changes them.
        let update: LinuxResources = serde_json::from_value(json!({
            "memory": {"limit": 67108864, "swap": 268435456, "swappiness": 20},
            "cpu": {"cpus": last_cpu},
            "blockIO": {"throttleReadBpsDevice": [{"major": major, "minor": minor, "rate": 2097152}]}
        }))
        .unwrap();
        cg.update(&update).expect("update");
        assert_eq!(read(&cg, "cpuset", "cpuset.cpus", "cpuset.cpus"), last_cpu);
        if !v2 {
            let below = Path::new("/sys/fs/cgroup/cpuset")
                .join(path.trim_start_matches('/'))
                .join("s0/cpuset.cpus");
            let cpus = std::fs::read_to_string(below).expect("engine cpuset");
            assert_eq!(cpus.trim(), last_cpu, "the engine's cgroup follows");
        }
        if v2 {
            assert_eq!(read(&cg, "", "", "memory.swap.max"), "201326592");
            assert!(read(&cg, "", "", "io.max").contains("rbps=2097152"));
        } else {
            assert_eq!(
                read(&cg, "memory", "memory.memsw.limit_in_bytes", ""),
                "268435456"
            );
            assert_eq!(read(&cg, "memory", "memory.swappiness", ""), "20");
            assert_eq!(
                read(&cg, "blkio", "blkio.throttle.read_bps_device", ""),
                format!("{dev} 2097152")
            );
        }

        // unified: cgroup v2 files as given; refused on v1, naming the key.
        let unified: LinuxResources =
            serde_json::from_value(json!({"unified": {"memory.high": "134217728"}})).unwrap();
        match cg.update(&unified) {
            Ok(()) => {
                assert!(v2, "unified accepted on cgroup v1");
                assert_eq!(read(&cg, "", "", "memory.high"), "134217728");
            }
            Err(e) => {
                assert!(!v2, "{e}");
                assert!(e.to_string().contains("memory.high"), "{e}");
            }
        }
        let escape: LinuxResources =
            serde_json::from_value(json!({"unified": {"../cgroup.procs": "1"}})).unwrap();
        assert!(cg.update(&escape).is_err());

        cg.remove().await;
        crate::stats::at(&top)
            .delete()
            .expect("remove the test's top cgroup");
    }
}
