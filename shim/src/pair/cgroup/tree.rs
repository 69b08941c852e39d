//! The pair cgroup's tree on the cgroup filesystems: the leaves below the
//! pair ([`leaves`]: one per engine slot, `s0` … `sN` for a pair of `N`
//! shadows, and gmsd's [`GMS_LEAF`]), where cgroup v2 and a hybrid host's
//! cgroup2 are mounted, the making of gmsd's leaf and the removal of the
//! whole tree, and the error a refused cgroup write gives. The lowest file
//! of `cgroup/`: the others build on it, it uses none of them.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use cgroups_rs::fs::Cgroup;
use shadow_pair::SlotId;

use super::super::spec::engine_cgroup;
use crate::error::Error;

/// Where cgroup v2 is mounted on a v2 host.
pub const UNIFIED_ROOT: &str = "/sys/fs/cgroup";
/// cgroup v1 hosts in hybrid mode also mount cgroup2 here.
pub const HYBRID_UNIFIED: &str = "/sys/fs/cgroup/unified";

/// The leaf gmsd runs in, beside the engines' `s0` … `sN`: its memory
/// (the weights) is charged to the pair, under the pod's limit.
pub const GMS_LEAF: &str = "gms";

/// Every cgroup a pair of `slots` engine slots may have below its own at
/// `pair`: each slot's (where runc puts that engine, `s0` … `s{slots-1}`)
/// and gmsd's. Those that do not exist (no gmsd, a slot between two
/// engines) are passed over by whoever reads them.
pub fn leaves(pair: &str, slots: usize) -> Vec<String> {
    SlotId::first(slots)
        .map(|slot| engine_cgroup(pair, slot))
        .chain([format!("{}/{GMS_LEAF}", pair.trim_end_matches('/'))])
        .collect()
}

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

/// Remove the pair's cgroup `cgroup` (at `pair`, of `slots` engine slots)
/// and the leaves runc or the launcher left below it, retrying for `wait`
/// while processes are still leaving; logs what would not go. Blocks:
/// cgroups-rs sleeps between its own retries.
pub fn remove(pair: &str, cgroup: &Cgroup, slots: usize, wait: Duration) {
    remove_in(
        pair,
        cgroup,
        slots,
        wait,
        crate::stats::at,
        Path::new(HYBRID_UNIFIED),
    );
}

/// [`remove`], with the leaves found by `at` and a hybrid host's cgroup2
/// mounted at `hybrid_root` (the tests' own trees).
fn remove_in(
    pair: &str,
    cgroup: &Cgroup,
    slots: usize,
    wait: Duration,
    at: impl Fn(&str) -> Cgroup,
    hybrid_root: &Path,
) {
    let deadline = Instant::now() + wait;
    let children: Vec<Cgroup> = leaves(pair, slots).iter().map(|p| at(p)).collect();
    // A hybrid host's cgroup2 mount, where runc puts the engines too:
    // not one of cgroups-rs's v1 hierarchies.
    let in_hybrid = |p: &str| hybrid_root.join(p.trim_start_matches('/'));
    let hybrid: Vec<PathBuf> = SlotId::first(slots)
        .map(|slot| in_hybrid(&engine_cgroup(pair, slot)))
        .chain([in_hybrid(pair)])
        .collect();
    loop {
        let mut left = Vec::new();
        // One that does not exist (a slot never used, no gmsd) is gone
        // already: on v2 its removal would fail.
        for cg in children.iter().chain([cgroup]).filter(|cg| cg.exists()) {
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

#[cfg(test)]
mod tests {
    use super::super::tests::TempTree;
    use super::*;

    /// `shadow.dev/shadows=3`: four engine slots.
    const SLOTS: usize = 3 + 1;

    #[test]
    fn the_leaves_follow_the_slot_count() {
        assert_eq!(
            leaves("/ns/pair", SLOTS),
            [
                "/ns/pair/s0",
                "/ns/pair/s1",
                "/ns/pair/s2",
                "/ns/pair/s3",
                "/ns/pair/gms"
            ]
        );
        assert_eq!(
            leaves("/ns/pair/", 2),
            ["/ns/pair/s0", "/ns/pair/s1", "/ns/pair/gms"]
        );
    }

    /// A pair of three shadows leaves nothing behind, on cgroup v1 (one
    /// tree per controller, and a hybrid host's cgroup2 where runc puts
    /// the engines too) and on v2; a slot between two engines and a pair
    /// without gmsd have no leaf, which is no error.
    #[test]
    fn a_pair_of_three_shadows_is_removed_whole_on_v1_and_v2() {
        for v2 in [false, true] {
            for made in [&["s0", "s1", "s2", "s3", "gms"][..], &["s0", "s2", "s3"]] {
                let d = tempfile::tempdir().unwrap();
                let tree = TempTree::new(&d.path().join("cgroup"), v2);
                let hybrid = d.path().join("unified");
                tree.make("/ns/pair");
                for leaf in made {
                    tree.make(&format!("/ns/pair/{leaf}"));
                    if !v2 && leaf.starts_with('s') {
                        std::fs::create_dir_all(hybrid.join("ns/pair").join(leaf)).unwrap();
                    }
                }
                let pair = tree.at("/ns/pair");
                remove_in(
                    "/ns/pair",
                    &pair,
                    SLOTS,
                    Duration::ZERO,
                    |p| tree.at(p),
                    &hybrid,
                );
                for dir in tree.dirs("/ns/pair") {
                    assert!(!dir.exists(), "v2 {v2}, {made:?}: {} left", dir.display());
                    assert!(dir.parent().unwrap().is_dir(), "the pair's parent stays");
                }
                assert!(
                    !hybrid.join("ns/pair").exists(),
                    "v2 {v2}, {made:?}: hybrid left"
                );
            }
        }
    }
}
