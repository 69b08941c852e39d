//! The pair's cgroup: the spec's resource limits apply to the pair as a
//! whole, so they go on a parent cgroup (the spec's `cgroupsPath`) and each
//! engine runs in a child (`s0`, `s1`) that runc creates without limits.
//! cgroup v1 (one directory per controller hierarchy) and v2 (one directory)
//! are both written straight to cgroupfs.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::error::{Error, Result};
use crate::stats::CGROUP_ROOT;

/// How long removal retries while the last engine processes leave.
const REMOVE_WAIT: Duration = Duration::from_secs(2);

fn unified() -> bool {
    Path::new(CGROUP_ROOT).join("cgroup.controllers").exists()
}

/// (controller dir under /sys/fs/cgroup for v1, file, value)
fn limits(resources: &Value) -> Vec<(&'static str, &'static str, String)> {
    let mut out = Vec::new();
    let num = |p: &str| resources.pointer(p).and_then(Value::as_i64);
    let v2 = unified();
    if let Some(l) = num("/memory/limit").filter(|l| *l > 0) {
        out.push(if v2 {
            ("", "memory.max", l.to_string())
        } else {
            ("memory", "memory.limit_in_bytes", l.to_string())
        });
    }
    if let Some(l) = num("/pids/limit").filter(|l| *l > 0) {
        out.push(if v2 {
            ("", "pids.max", l.to_string())
        } else {
            ("pids", "pids.max", l.to_string())
        });
    }
    let period = num("/cpu/period").filter(|p| *p > 0);
    if let Some(q) = num("/cpu/quota").filter(|q| *q > 0) {
        let period = period.unwrap_or(100_000);
        if v2 {
            out.push(("", "cpu.max", format!("{q} {period}")));
        } else {
            out.push(("cpu", "cpu.cfs_period_us", period.to_string()));
            out.push(("cpu", "cpu.cfs_quota_us", q.to_string()));
        }
    }
    if let Some(s) = num("/cpu/shares").filter(|s| *s > 0) {
        if v2 {
            let weight = 1 + ((s.clamp(2, 262_144) - 2) * 9999) / 262_142;
            out.push(("", "cpu.weight", weight.to_string()));
        } else {
            out.push(("cpu", "cpu.shares", s.to_string()));
        }
    }
    out
}

/// The pair's parent cgroup, as created.
#[derive(Debug)]
pub struct PairCgroup {
    /// `cgroupsPath` of the pair (`/ns/id`).
    pub path: String,
}

impl PairCgroup {
    /// Create the parent and write the spec's limits into it.
    pub fn create(path: &str, resources: Option<&Value>) -> Result<Self> {
        let cg = PairCgroup {
            path: path.to_string(),
        };
        let rel = path.trim_start_matches('/');
        let Some(resources) = resources else {
            return Ok(cg);
        };
        let v2 = unified();
        for (ctrl, file, value) in limits(resources) {
            let dir = Path::new(CGROUP_ROOT).join(ctrl).join(rel);
            if v2 {
                enable_v2_controllers(rel);
            }
            std::fs::create_dir_all(&dir)
                .map_err(|e| Error::io(format!("creating pair cgroup {}", dir.display()), e))?;
            let f = dir.join(file);
            if let Err(e) = std::fs::write(&f, &value) {
                cg.remove_now();
                return Err(Error::io(
                    format!("setting pair limit {} = {value}", f.display()),
                    e,
                ));
            }
        }
        Ok(cg)
    }

    /// Every directory of this cgroup in every hierarchy, children first.
    fn dirs(&self) -> Vec<PathBuf> {
        let rel = self.path.trim_start_matches('/');
        let mut roots = vec![PathBuf::from(CGROUP_ROOT)];
        if let Ok(rd) = std::fs::read_dir(CGROUP_ROOT) {
            for e in rd.flatten() {
                // Skip the cpu -> cpu,cpuacct style links: same hierarchy.
                if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                    roots.push(e.path());
                }
            }
        }
        let mut out = Vec::new();
        for r in roots {
            let d = r.join(rel);
            if !d.is_dir() || d == r {
                continue;
            }
            for child in ["s0", "s1"] {
                let c = d.join(child);
                if c.is_dir() {
                    out.push(c);
                }
            }
            out.push(d);
        }
        out
    }

    fn remove_now(&self) -> Vec<PathBuf> {
        self.dirs()
            .into_iter()
            .filter(|d| std::fs::remove_dir(d).is_err())
            .collect()
    }

    /// Remove the parent (and children runc left), retrying while processes
    /// are still leaving; logs what would not go.
    pub async fn remove(&self) {
        let deadline = Instant::now() + REMOVE_WAIT;
        loop {
            let left = self.remove_now();
            if left.is_empty() {
                return;
            }
            if Instant::now() >= deadline {
                log::warn!("pair cgroup {}: could not remove {left:?}", self.path);
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// v2: controllers must be enabled down the path for limits to apply.
fn enable_v2_controllers(rel: &str) {
    let mut dir = PathBuf::from(CGROUP_ROOT);
    for part in Path::new(rel).components() {
        let _ = std::fs::write(dir.join("cgroup.subtree_control"), "+memory +pids +cpu");
        dir = dir.join(part);
        let _ = std::fs::create_dir_all(&dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn limits_of_a_spec() {
        let r = json!({"memory": {"limit": 1048576}, "pids": {"limit": 20},
                       "cpu": {"quota": 50000, "period": 100000, "shares": 512},
                       "devices": [{"allow": false}]});
        let l = limits(&r);
        if unified() {
            assert!(l.contains(&("", "memory.max", "1048576".into())));
            assert!(l.contains(&("", "cpu.max", "50000 100000".into())));
        } else {
            assert!(l.contains(&("memory", "memory.limit_in_bytes", "1048576".into())));
            assert!(l.contains(&("pids", "pids.max", "20".into())));
            assert!(l.contains(&("cpu", "cpu.cfs_quota_us", "50000".into())));
            assert!(l.contains(&("cpu", "cpu.shares", "512".into())));
        }
        assert!(limits(&json!({"devices": []})).is_empty());
    }
}
