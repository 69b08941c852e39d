//! The pair's cgroup: the spec's resource limits apply to the pair as a
//! whole, so they go on a parent cgroup (the spec's `cgroupsPath`) and each
//! engine runs in a child of its slot (`s0` … `sN`) that runc creates
//! without limits;
//! gmsd runs in a third (`gms`). Made, limited (at Create and by Update),
//! frozen (Pause), read for stats, watched for OOM and removed through
//! cgroups-rs, on cgroup v1 and v2 alike. [`PairCgroup`] is what the pair
//! holds, and this file is only its face: the limits' translation is
//! `limits`, the engines' freezer `freezer`, the leaves, mounts and removal
//! `tree`; callers use `pair::cgroup::…` and never the files below.

mod freezer;
mod limits;
mod tree;

use std::path::PathBuf;
use std::time::Duration;

use cgroups_rs::fs::Cgroup;
use containerd_shim_protos::protobuf::well_known_types::any::Any;
use oci_spec::runtime::LinuxResources;
use serde_json::Value;

use self::freezer::Engines;
use self::limits::Limits;
use self::tree::{failed, REMOVE_WAIT};
use crate::error::{Error, Result};

/// The pair's parent cgroup, as created.
#[derive(Debug)]
pub struct PairCgroup {
    /// `cgroupsPath` of the pair (`/ns/id`).
    pub path: String,
    cgroup: Cgroup,
    /// How many engine slots the pair's tree is read for: every slot a
    /// pair may have ([`shadow_pair::MAX_SLOTS`]), so that a pair of any
    /// `shadow.dev/shadows`, and the leftovers of a dead shim's pair, whose
    /// count is not known, are covered; the leaves runc did not make are
    /// passed over.
    slots: usize,
    /// The engines' cgroups below it (`s0` … `sN`), as runc makes them.
    engines: Engines,
}

impl PairCgroup {
    /// Create the parent and write the spec's limits into it.
    pub fn create(path: &str, resources: Option<&Value>) -> Result<Self> {
        let cg = PairCgroup::open(path);
        let resources = resources
            .map(|r| serde_json::from_value::<LinuxResources>(r.clone()))
            .transpose()
            .map_err(|e| Error::InvalidArgument(format!("linux.resources of {path}: {e}")))?;
        cg.cgroup
            .create()
            .map_err(|e| failed(format!("creating pair cgroup {path}"), e))?;
        if let Some(r) = resources {
            if let Err(e) = cg.update(&r) {
                tree::remove(&cg.path, &cg.cgroup, cg.slots, Duration::ZERO);
                return Err(e);
            }
        }
        Ok(cg)
    }

    /// The pair cgroup at `path` as a dead shim left it, for its removal.
    pub fn open(path: &str) -> Self {
        let slots = shadow_pair::MAX_SLOTS;
        let cgroup = crate::stats::at(path);
        let engines = Engines::of(path, cgroup.v2(), slots);
        PairCgroup {
            path: path.to_string(),
            cgroup,
            slots,
            engines,
        }
    }

    /// Apply `r` to the pair (both engines are below it). Values left out,
    /// or 0, keep what the cgroup has.
    pub fn update(&self, r: &LinuxResources) -> Result<()> {
        let leaves: Vec<Cgroup> = tree::leaves(&self.path, self.slots)
            .iter()
            .map(|p| crate::stats::at(p))
            .collect();
        Limits {
            path: &self.path,
            cgroup: &self.cgroup,
            leaves: &leaves,
        }
        .update(r)
    }

    /// Watch the pair for OOM events (both engines are below it, and the
    /// spec's memory limit is on it); `on_oom` runs for each.
    pub fn watch_oom(
        &self,
        on_oom: impl Fn() + Send + 'static,
    ) -> Result<Option<tokio::task::JoinHandle<()>>> {
        crate::oom::watch(&self.cgroup, on_oom)
    }

    /// Freeze the engines (Pause): the cgroups of the engines (`s0` …
    /// `sN`), not the pair's own, whose gmsd leaf keeps serving (the
    /// supervisor polls its status). The freezer is hierarchical, so every
    /// process of an engine freezes. Returns once all are frozen; a freeze
    /// that does not complete is undone.
    pub async fn freeze(&self) -> Result<()> {
        self.engines.freeze().await
    }

    /// Thaw the engines (Resume, or Kill of a paused pair).
    pub fn thaw(&self) -> Result<()> {
        self.engines.thaw()
    }

    /// Create the pair's gmsd leaf (`gms`, [`tree::GMS_LEAF`]) and return the
    /// `cgroup.procs` files a process writes itself into to join it (one
    /// per hierarchy on cgroup v1, one on v2).
    pub fn gms_leaf(&self) -> Result<Vec<PathBuf>> {
        tree::make_gms_leaf(&self.path)
    }

    /// The pair's metrics: its cgroup holds both engines.
    pub fn stats(&self) -> Result<Any> {
        crate::stats::collect(&self.cgroup)
    }

    /// Remove the parent (and children runc left), retrying while processes
    /// are still leaving; logs what would not go.
    pub async fn remove(self) {
        // cgroups-rs sleeps between its own retries: off the runtime thread.
        let _ = tokio::task::spawn_blocking(move || {
            tree::remove(&self.path, &self.cgroup, self.slots, REMOVE_WAIT)
        })
        .await;
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::tree::HYBRID_UNIFIED;
    use super::*;
    use serde_json::json;

    #[test]
    fn a_resources_object_that_is_not_oci_is_refused() {
        let e = PairCgroup::create("/shadow-test/never", Some(&json!({"memory": 5}))).unwrap_err();
        assert!(e.to_string().contains("linux.resources"), "{e}");
    }

    /// A cgroup filesystem of plain directories under a temporary root, as
    /// cgroup v1 lays it out (one tree per controller: pids, memory, cpuset,
    /// freezer) or v2 (one tree): the tree's and the limits' tests run on
    /// both layouts on any host, without root.
    #[derive(Debug)]
    pub(super) struct TempTree {
        pub(super) root: std::path::PathBuf,
        pub(super) v2: bool,
    }

    impl TempTree {
        pub(super) fn new(dir: &Path, v2: bool) -> TempTree {
            TempTree {
                root: dir.to_path_buf(),
                v2,
            }
        }

        /// The directories of cgroup `path` (one per controller on v1).
        pub(super) fn dirs(&self, path: &str) -> Vec<std::path::PathBuf> {
            let rel = path.trim_start_matches('/');
            if self.v2 {
                vec![self.root.join(rel)]
            } else {
                ["pids", "memory", "cpuset", "freezer"]
                    .iter()
                    .map(|c| self.root.join(c).join(rel))
                    .collect()
            }
        }

        /// Makes cgroup `path`'s directories.
        pub(super) fn make(&self, path: &str) {
            for d in self.dirs(path) {
                std::fs::create_dir_all(&d).unwrap();
            }
        }

        /// Cgroup `path` of this tree, as `crate::stats::at` loads a real one.
        pub(super) fn at(&self, path: &str) -> Cgroup {
            let copy = TempTree::new(&self.root, self.v2);
            Cgroup::load(Box::new(copy), path.trim_start_matches('/'))
        }
    }

    impl cgroups_rs::fs::Hierarchy for TempTree {
        fn subsystems(&self) -> Vec<cgroups_rs::fs::Subsystem> {
            use cgroups_rs::fs::cpuset::CpuSetController;
            use cgroups_rs::fs::freezer::FreezerController;
            use cgroups_rs::fs::memory::MemController;
            use cgroups_rs::fs::pid::PidController;
            use cgroups_rs::fs::Subsystem;
            let at = |c: &str| {
                let d = if self.v2 {
                    self.root.clone()
                } else {
                    self.root.join(c)
                };
                (d.clone(), d)
            };
            let (p, b) = at("pids");
            let pids = Subsystem::Pid(PidController::new(p, b, self.v2));
            let (p, b) = at("memory");
            let mem = Subsystem::Mem(MemController::new(p, b, self.v2));
            let (p, b) = at("cpuset");
            let cpuset = Subsystem::CpuSet(CpuSetController::new(p, b, self.v2));
            let (p, b) = at("freezer");
            let freezer = Subsystem::Freezer(FreezerController::new(p, b, self.v2));
            vec![pids, mem, cpuset, freezer]
        }
        fn root(&self) -> std::path::PathBuf {
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

    /// Whether the tests run as root (the real cgroup tests need it).
    pub(super) fn root() -> bool {
        nix::unistd::Uid::effective().is_root()
    }

    /// A file of `cg`'s cgroup: `v1_file` in `ctrl`'s hierarchy on v1,
    /// `v2_file` on v2.
    pub(super) fn read(cg: &PairCgroup, ctrl: &str, v1_file: &str, v2_file: &str) -> String {
        let (dir, file) = if cg.cgroup.v2() {
            (std::path::PathBuf::from("/sys/fs/cgroup"), v2_file)
        } else {
            (std::path::Path::new("/sys/fs/cgroup").join(ctrl), v1_file)
        };
        let p = dir.join(cg.path.trim_start_matches('/')).join(file);
        std::fs::read_to_string(&p)
            .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
            .trim()
            .to_string()
    }

    /// Create → limits → Update → stats → remove, on a real cgroup under a
    /// test-owned path (root only; skipped otherwise).
    #[tokio::test]
    #[ignore = "needs root: `make test` runs it (--include-ignored)"]
    async fn a_real_pair_cgroup_is_limited_updated_read_and_removed() {
        assert!(root(), "this test makes real cgroups: run it as root");
        let path = format!("/shadow-unit-{}/pair", std::process::id());
        let spec = json!({"memory": {"limit": 67108864}, "pids": {"limit": 20},
                          "cpu": {"quota": 50000, "period": 100000, "shares": 512},
                          "devices": [{"allow": false, "access": "rwm"}]});
        let cg = PairCgroup::create(&path, Some(&spec)).expect("create");
        let v2 = cg.cgroup.v2();
        let mem = |cg: &PairCgroup| read(cg, "memory", "memory.limit_in_bytes", "memory.max");
        assert_eq!(mem(&cg), "67108864");
        assert_eq!(read(&cg, "pids", "pids.max", "pids.max"), "20");
        assert_eq!(
            read(&cg, "cpu", "cpu.shares", "cpu.weight"),
            if v2 { "20" } else { "512" }
        );
        if !v2 {
            assert_eq!(read(&cg, "cpu", "cpu.cfs_quota_us", ""), "50000");
        }

        let update: LinuxResources = serde_json::from_value(json!({
            "memory": {"limit": 134217728}, "pids": {"limit": -1}, "cpu": {"quota": 20000}
        }))
        .unwrap();
        cg.update(&update).expect("update");
        assert_eq!(mem(&cg), "134217728");
        assert_eq!(read(&cg, "pids", "pids.max", "pids.max"), "max");
        if v2 {
            assert_eq!(read(&cg, "", "", "cpu.max"), "20000 100000");
        } else {
            assert_eq!(read(&cg, "cpu", "cpu.cfs_quota_us", ""), "20000");
        }

        // A limit the kernel refuses names the setting.
        let bad: LinuxResources =
            serde_json::from_value(json!({"cpu": {"quota": 500, "period": 10}})).unwrap();
        let e = cg.update(&bad).unwrap_err().to_string();
        assert!(e.contains(&path) && e.contains("cpu quota/period"), "{e}");

        let any = cg.stats().expect("stats");
        let url = if v2 { "v2" } else { "v1" };
        assert_eq!(any.type_url, format!("io.containerd.cgroups.{url}.Metrics"));

        // On a hybrid host runc also makes the engines' cgroups in cgroup2.
        let top = format!("/shadow-unit-{}", std::process::id());
        let hybrid = Path::new(HYBRID_UNIFIED).join(&top[1..]);
        let made_hybrid = !v2 && std::fs::create_dir_all(hybrid.join("pair/s0")).is_ok();
        let left = cg.cgroup.clone();
        cg.remove().await;
        assert!(!left.exists(), "pair cgroup left");
        assert!(!hybrid.join("pair").exists(), "hybrid cgroup2 dir left");
        if made_hybrid {
            std::fs::remove_dir(&hybrid).expect("remove the test's hybrid dir");
        }
        crate::stats::at(&top)
            .delete()
            .expect("remove the test's top cgroup");
    }
}
