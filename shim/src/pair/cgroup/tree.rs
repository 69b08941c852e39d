//! The pair cgroup's tree on the cgroup filesystems: the leaves below the
//! pair (the engines' `s0` and `s1`, gmsd's [`GMS_LEAF`]), where cgroup v2
//! and a hybrid host's cgroup2 are mounted, the making of gmsd's leaf and
//! the removal of the whole tree, and the error a refused cgroup write
//! gives. The lowest file of `cgroup/`: the others build on it, it uses
//! none of them.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use cgroups_rs::fs::Cgroup;

use crate::error::Error;

/// Where cgroup v2 is mounted on a v2 host.
pub const UNIFIED_ROOT: &str = "/sys/fs/cgroup";
/// cgroup v1 hosts in hybrid mode also mount cgroup2 here.
pub const HYBRID_UNIFIED: &str = "/sys/fs/cgroup/unified";

/// The leaf gmsd runs in, beside the engines' `s0` and `s1`: its memory
/// (the weights) is charged to the pair, under the pod's limit.
pub const GMS_LEAF: &str = "gms";

/// Every cgroup the pair may have below its own: the engines' and gmsd's.
pub const LEAVES: [&str; 3] = ["s0", "s1", GMS_LEAF];

/// How long removal retries while the last engine processes leave.
pub const REMOVE_WAIT: Duration = Duration::from_secs(2);

/// The error of a cgroup operation `what` that the kernel (or cgroups-rs)
/// refused, with the underlying reason.
pub fn failed(what: String, e: cgroups_rs::fs::error::Error) -> Error {
    use std::error::Error as _;
    let reason = e.source().map_or_else(|| e.to_string(), |s| s.to_string());
    Error::Internal { what, reason }
}

/// Create the gmsd leaf ([`GMS_LEAF`]) of the pair at `pair` and return
/// the `cgroup.procs` files a process writes itself into to join it (one
/// per hierarchy on cgroup v1, one on v2).
pub fn make_gms_leaf(pair: &str) -> crate::error::Result<Vec<PathBuf>> {
    let path = format!("{pair}/{GMS_LEAF}");
    let leaf = crate::stats::at(&path);
    leaf.create()
        .map_err(|e| failed(format!("creating gmsd's cgroup {path}"), e))?;
    let mut files: Vec<PathBuf> = leaf
        .subsystems()
        .iter()
        .map(|s| s.to_controller().path().join("cgroup.procs"))
        .collect();
    files.sort();
    files.dedup();
    Ok(files)
}

/// Remove the pair's cgroup `cgroup` (at `pair`) and the leaves runc or
/// the launcher left below it, retrying for `wait` while processes are
/// still leaving; logs what would not go. Blocks: cgroups-rs sleeps
/// between its own retries.
pub fn remove(pair: &str, cgroup: &Cgroup, wait: Duration) {
    let deadline = Instant::now() + wait;
    let children = LEAVES.map(|s| crate::stats::at(&format!("{pair}/{s}")));
    // A hybrid host's cgroup2 mount, where runc puts the engines too:
    // not one of cgroups-rs's v1 hierarchies.
    let hybrid = Path::new(HYBRID_UNIFIED).join(pair.trim_start_matches('/'));
    let hybrid = [hybrid.join("s0"), hybrid.join("s1"), hybrid];
    loop {
        let mut left = Vec::new();
        for cg in children.iter().chain([cgroup]) {
            if let Err(e) = cg.delete() {
                left.push(format!("{}: {e}", cg.path()));
            }
        }
        for d in hybrid.iter().filter(|d| !cgroup.v2() && d.is_dir()) {
            if let Err(e) = std::fs::remove_dir(d) {
                left.push(format!("{}: {e}", d.display()));
            }
        }
        if left.is_empty() {
            return;
        }
        if Instant::now() >= deadline {
            log::warn!("pair cgroup {pair}: could not remove {left:?}");
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}
