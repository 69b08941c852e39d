//! Pause and Resume of a pair: the freezer of the engines' own cgroups
//! (`s0` … `sN`), never the pair's, whose gmsd leaf keeps serving (the
//! supervisor polls its status). [`Engines`] holds those cgroups; only
//! freezing and thawing them belongs here.

use std::time::{Duration, Instant};

use cgroups_rs::fs::freezer::FreezerController;
use cgroups_rs::fs::{Cgroup, Controller};
use shadow_pair::SlotId;

use super::tree::failed;
use crate::error::{Error, Result};

/// How long Pause waits for every engine process to be frozen.
const FREEZE_WAIT: Duration = Duration::from_secs(5);

/// The engines' cgroups below a pair's (`s0` … `sN`), as runc makes them.
#[derive(Debug)]
pub struct Engines {
    /// The pair's `cgroupsPath`, for messages.
    pair: String,
    /// Whether the host runs cgroup v2 (the pair's cgroup says).
    v2: bool,
    /// Each engine's cgroup path and cgroup, one per slot (those that do
    /// not exist are passed over).
    slots: Vec<(String, Cgroup)>,
}

impl Engines {
    /// The cgroups of `slots` engine slots below the pair at `pair`, whose
    /// cgroup is `v2` or not.
    pub fn of(pair: &str, v2: bool, slots: usize) -> Self {
        Engines {
            pair: pair.to_string(),
            v2,
            slots: SlotId::first(slots)
                .map(|slot| {
                    let p = super::super::spec::engine_cgroup(pair, slot);
                    let cg = crate::stats::at(&p);
                    (p, cg)
                })
                .collect(),
        }
    }

    /// Freeze both engines. The freezer is hierarchical, so every process
    /// of an engine freezes. Returns once all are frozen; a freeze that
    /// does not complete is undone.
    pub async fn freeze(&self) -> Result<()> {
        let engines = self.freezers()?;
        for (path, fc) in &engines {
            if let Err(e) = fc.freeze() {
                thaw_all(&engines);
                return Err(failed(format!("freezing engine cgroup {path}"), e));
            }
        }
        let deadline = Instant::now() + FREEZE_WAIT;
        while !engines.iter().all(|(_, fc)| self.frozen(fc)) {
            if Instant::now() >= deadline {
                thaw_all(&engines);
                return Err(Error::Internal {
                    what: format!("freezing the engines of pair cgroup {}", self.pair),
                    reason: format!("not frozen after {FREEZE_WAIT:?}; thawed again"),
                });
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        Ok(())
    }

    /// Thaw both engines.
    pub fn thaw(&self) -> Result<()> {
        for (path, fc) in self.freezers()? {
            fc.thaw()
                .map_err(|e| failed(format!("thawing engine cgroup {path}"), e))?;
        }
        Ok(())
    }

    /// The freezers of the engines' cgroups that exist now (a slot between
    /// two engines has none).
    fn freezers(&self) -> Result<Vec<(String, &FreezerController)>> {
        let mut out = Vec::new();
        for (path, cg) in &self.slots {
            let fc = cg.controller_of::<FreezerController>().ok_or_else(|| {
                Error::FailedPrecondition(format!(
                    "engine cgroup {path}: no freezer controller to pause the pair with"
                ))
            })?;
            if fc.path().is_dir() {
                out.push((path.clone(), fc));
            }
        }
        Ok(out)
    }

    /// Whether the freeze has completed: v1 says FROZEN (not FREEZING);
    /// v2's `cgroup.events` says `frozen 1`.
    fn frozen(&self, fc: &FreezerController) -> bool {
        if self.v2 {
            crate::stats::keyed(fc.path(), "cgroup.events").get("frozen") == Some(&1)
        } else {
            matches!(fc.state(), Ok(cgroups_rs::FreezerState::Frozen))
        }
    }
}

/// Thaw what a failed freeze froze; logs what would not thaw.
fn thaw_all(engines: &[(String, &FreezerController)]) {
    for (path, fc) in engines {
        if let Err(e) = fc.thaw() {
            log::warn!("thawing engine cgroup {path}: {e}");
        }
    }
}
