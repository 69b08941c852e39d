//! What a pair shows the world: the [`View`] the Task service reads,
//! `state.json` (for `shadowctl`, tests and operators) and the metrics
//! textfile. This is the one writer of both files; the state file's schema
//! is `shadow_contract::state` (mapped from the pair's values by
//! `state_file`). Files are rewritten only when the pair's revision (a
//! counter kept by `shadow_pair::Pair`), the promotion records or the gmsd
//! status moved — never on a timer.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use shadow_contract::state::{PairState, PromotionRecord};
use shadow_pair::metrics::GmsFigures;
use shadow_pair::{Pair, Promotion, SlotId};
use tokio::sync::watch;

use super::state_file;

use crate::container::ExitInfo;

/// What the Task service reads about a pair, republished on every change.
#[derive(Debug, Clone, Default)]
pub struct View {
    pub started: bool,
    /// `Pair::representative_pid`, or the last one once the pair is gone.
    pub pid: u32,
    pub pids: [Option<u32>; 2],
    pub active: Option<SlotId>,
    pub exit: Option<ExitInfo>,
}

pub fn unix_us(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).unwrap_or_default().as_micros() as u64
}

/// Replace `path` with `bytes` (write a temporary file, then rename).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

/// The gmsd statuses as last polled (one per daemon that answered), when
/// the pair has GMS.
pub struct GmsStatus {
    pub reports: Vec<serde_json::Value>,
    pub figures: Vec<GmsFigures>,
}

/// Writes a pair's view, state file and metrics.
pub struct Publisher {
    id: String,
    namespace: String,
    runc_ids: [String; 2],
    state_json: PathBuf,
    containerd: String,
    metrics_file: PathBuf,
    view: watch::Sender<View>,
    /// The wall clock when the pair's clock read zero.
    epoch: SystemTime,
    promotions: VecDeque<PromotionRecord>,
    promotions_kept: usize,
    last_pid: u32,
    /// What the files were last written from: the pair's revision, the
    /// number of promotions recorded, the gmsd report.
    written: Option<(u64, u64, Vec<serde_json::Value>)>,
    recorded: u64,
    exit_status: Option<u32>,
}

/// Where a publisher writes.
pub struct Outlets {
    pub id: String,
    pub namespace: String,
    pub runc_ids: [String; 2],
    pub state_json: PathBuf,
    pub containerd: String,
    /// `<metrics_dir>/shadow-<key>-<namespace>-<id>.prom`.
    pub metrics_file: PathBuf,
    pub view: watch::Sender<View>,
    pub promotions_kept: usize,
}

impl Publisher {
    pub fn new(o: Outlets, epoch: SystemTime) -> Self {
        Publisher {
            id: o.id,
            namespace: o.namespace,
            runc_ids: o.runc_ids,
            state_json: o.state_json,
            containerd: o.containerd,
            metrics_file: o.metrics_file,
            view: o.view,
            epoch,
            promotions: VecDeque::new(),
            promotions_kept: o.promotions_kept.max(1),
            last_pid: 0,
            written: None,
            recorded: 0,
            exit_status: None,
        }
    }

    /// The pid containerd was last shown.
    pub fn last_pid(&self) -> u32 {
        self.last_pid
    }

    fn wall(&self, d: Duration) -> u64 {
        unix_us(self.epoch + d)
    }

    /// Keep a finished promotion (the last `promotions_kept` of them).
    pub fn record(&mut self, p: Promotion) {
        let ms = |d: Option<Duration>| {
            d.map(|d| format!("{:.3}", d.saturating_sub(p.death_at).as_secs_f64() * 1e3))
                .unwrap_or_else(|| "-".into())
        };
        log::info!(
            "pair {}: promotion {} slot {} -> {}: death seen by {:?}; death → reap {} ms, → lock {} ms, → ready {} ms ({:?}, {:?})",
            self.id,
            p.number,
            p.from,
            p.to.map(|s| s.to_string()).unwrap_or_else(|| "-".into()),
            p.death_seen,
            ms(Some(p.reaped_at)),
            ms(p.lock_at),
            ms(p.ready_at),
            p.exit,
            p.class
        );
        let rec = PromotionRecord {
            death_unix_us: self.wall(p.death_at),
            reaped_unix_us: self.wall(p.reaped_at),
            lock_unix_us: p.lock_at.map(|d| self.wall(d)),
            ready_unix_us: p.ready_at.map(|d| self.wall(d)),
            total_ms: p.total().map(|d| d.as_secs_f64() * 1e3),
            promotion: state_file::promotion(&p),
        };
        self.promotions.push_back(rec);
        while self.promotions.len() > self.promotions_kept {
            self.promotions.pop_front();
        }
        self.recorded += 1;
    }

    /// Republish the view, and rewrite `state.json` and the metrics file
    /// when something in them changed (or when `force`d).
    pub fn publish(&mut self, pair: &Pair, gms: Option<GmsStatus>, force: bool) {
        if let Some(pid) = pair.representative_pid() {
            self.last_pid = pid;
        }
        let pids = [pair.slot(SlotId::ZERO).pid, pair.slot(SlotId::ONE).pid];
        let active = pair.active();
        let last_pid = self.last_pid;
        self.view.send_if_modified(|v| {
            let changed = v.pid != last_pid || v.pids != pids || v.active != active || !v.started;
            v.pid = last_pid;
            v.pids = pids;
            v.active = active;
            v.started = true;
            changed
        });
        let (reports, figures) = gms.map(|g| (g.reports, g.figures)).unwrap_or_default();
        let key = (pair.revision(), self.recorded, reports);
        if !force && self.written.as_ref() == Some(&key) {
            return;
        }
        let snap = pair.snapshot();
        let state = PairState {
            containerd: self.containerd.clone(),
            namespace: self.namespace.clone(),
            id: self.id.clone(),
            pid: self.last_pid,
            pids,
            runc_ids: self.runc_ids.clone(),
            pair: state_file::snapshot(&snap),
            promotions: self.promotions.iter().cloned().collect(),
            gms: key.2.first().cloned().and_then(state_file::gms),
            gms_daemons: key.2.iter().cloned().filter_map(state_file::gms).collect(),
            exit_status: self.exit_status,
            updated_unix_us: unix_us(SystemTime::now()),
        };
        match serde_json::to_vec_pretty(&state) {
            Ok(bytes) => {
                if let Err(e) = write_atomic(&self.state_json, &bytes) {
                    log::warn!(
                        "pair {}: writing {}: {e}",
                        self.id,
                        self.state_json.display()
                    );
                }
            }
            Err(e) => log::warn!("pair {}: encoding state: {e}", self.id),
        }
        let text = shadow_pair::metrics::render(
            &self.containerd,
            &self.namespace,
            &self.id,
            &snap,
            &figures,
        );
        if let Err(e) = shadow_pair::metrics::write_textfile(&self.metrics_file, &text) {
            log::warn!(
                "pair {}: writing metrics {}: {e}",
                self.id,
                self.metrics_file.display()
            );
        }
        self.written = Some(key);
    }

    /// The pair is gone: the state file says so, then containerd's
    /// waiters see the exit (after it, so that a Delete they start never
    /// races this last write).
    pub fn exited(&mut self, pair: &Pair, gms: Option<GmsStatus>, info: ExitInfo) {
        self.exit_status = Some(info.status);
        self.publish(pair, gms, true);
        self.view.send_modify(|v| v.exit = Some(info));
    }
}
