//! What Create made for a pair, recorded step by step so that exactly
//! that is undone: by Create itself when a later step fails, else by the
//! pair's supervisor, which owns the record from the end of Create and
//! undoes it at Delete. The one place that knows how each thing goes.

use std::path::PathBuf;

use tokio::task::JoinHandle;

use super::cgroup::PairCgroup;
use super::dirs::PairDirs;
use super::gms::GmsDaemons;
use super::netns::PinnedNamespaces;

/// Everything Create made, for Delete (and for undoing a failed Create).
#[derive(Default)]
pub struct Made {
    pub dirs: Option<PairDirs>,
    pub mounted_rootfs: Option<PathBuf>,
    pub pins: Option<PinnedNamespaces>,
    pub cgroup: Option<PairCgroup>,
    /// The pair's gmsds: the supervisor restarts them and watches them,
    /// [`Made::undo`] ends them (at Delete, never before).
    pub gms: Option<GmsDaemons>,
    pub metrics_file: Option<PathBuf>,
    /// The OOM watcher of the pair's cgroup (publishes `/tasks/oom`).
    pub oom: Option<JoinHandle<()>>,
    /// The copier of the task's stdin FIFO into the first engine's stdin
    /// (CloseIO closes it).
    pub stdin: Option<crate::io::ProcessIo>,
}

impl Made {
    pub async fn undo(&mut self) {
        if let Some(w) = self.oom.take() {
            w.abort();
        }
        drop(self.stdin.take());
        if let Some(mut g) = self.gms.take() {
            g.terminate().await;
        }
        if let Some(p) = self.pins.take() {
            p.unpin();
        }
        if let Some(c) = self.cgroup.take() {
            c.remove().await;
        }
        if let Some(d) = self.dirs.take() {
            if let Err(e) = std::fs::remove_dir_all(&d.root) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    log::warn!("removing pair dir {}: {e}", d.root.display());
                }
            }
            // The namespace dir too, once its last pair is gone.
            if let Some(parent) = d.root.parent() {
                let _ = std::fs::remove_dir(parent);
            }
        }
        if let Some(m) = self.metrics_file.take() {
            let _ = std::fs::remove_file(m);
        }
        if let Some(r) = self.mounted_rootfs.take() {
            crate::mount::unmount(&r).await;
        }
    }
}
