//! What a pair shows the world: the [`View`] the Task service reads,
//! `state.json` (for `shadowctl`, tests and operators) and the metrics
//! textfile. This is the one writer of both files; the state file's schema
//! is `shadow_contract::state` (mapped from the pair's values by
//! `state_file`). Files are rewritten only when the pair's revision (a
//! counter kept by `shadow_pair::Pair`), the promotion records or the gmsd
//! status moved, or when the counters an engine can drive as fast as it
//! likes (the notify socket's drops, refused `READY=1`s) moved, those at
//! most every [`COUNTERS_EVERY`].

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use shadow_contract::state::{FdStoreStatus, PairState, PromotionRecord};
use shadow_pair::metrics::GmsFigures;
use shadow_pair::{Pair, Promotion, SlotId};
use tokio::sync::watch;
use tokio::time::Instant;

use super::fdstore::Figures;
use super::notify::DropCounts;
use super::state_file;

use crate::status::ExitInfo;

/// How often, at most, the files are rewritten for the counters alone
/// (`shadow_notify_dropped_total`, `shadow_ready_refused_total`): they
/// move with each datagram a flooding or lying engine sends, so they ride
/// along with the writes a change of the pair makes anyway, and otherwise
/// wait until this long after the last write. A flood costs at most one
/// write a second, not one per datagram; a dashboard sees it within a
/// second (the supervisor wakes for it, see `Publisher::counters_due`).
pub const COUNTERS_EVERY: Duration = Duration::from_secs(1);

/// What the Task service reads about a pair, republished on every change.
#[derive(Debug, Clone, Default)]
pub struct View {
    pub started: bool,
    /// The pair's cgroup is frozen (Pause).
    pub paused: bool,
    /// The task's pid: `Pair::representative_pid`, or the last one (the
    /// engine created at Create until another is known; the last active
    /// once the pair is gone).
    pub pid: u32,
    /// Each slot's pid, `0 ..= N`.
    pub pids: Vec<Option<u32>>,
    pub active: Option<SlotId>,
    pub exit: Option<ExitInfo>,
}

pub fn unix_us(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).unwrap_or_default().as_micros() as u64
}

/// Replace `path` with `bytes`, whole: a reader sees the old file or the
/// new one. The bytes go to a temporary file of a fresh, unpredictable name
/// beside it (created `O_EXCL`, so no link planted there is followed),
/// mode 0644 (`state.json` and the metrics textfile are read by operators'
/// tools), then renamed over `path`; the directory is made if missing.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::PermissionsExt;
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("{}: no directory", path.display()),
            )
        })?;
    std::fs::create_dir_all(dir)?;
    let mut tmp = tempfile::Builder::new()
        .prefix(".shadow-")
        .suffix(".tmp")
        .permissions(std::fs::Permissions::from_mode(0o644))
        .tempfile_in(dir)?;
    tmp.write_all(bytes)?;
    tmp.persist(path).map(drop).map_err(|e| e.error)
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
    runc_ids: Vec<String>,
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
    /// The notify socket's drops (counted by its reader).
    drops: Arc<DropCounts>,
    /// When the files were last written, and `Pair::ready_refused` then.
    counters_written: Option<(Instant, u64)>,
    recorded: u64,
    exit_status: Option<u32>,
    /// The pair's fd store's figures, if it has one (read at each write).
    fdstore: Option<Arc<Figures>>,
}

/// Where a publisher writes.
pub struct Outlets {
    pub id: String,
    pub namespace: String,
    pub runc_ids: Vec<String>,
    pub state_json: PathBuf,
    pub containerd: String,
    /// `<metrics_dir>/shadow-<key>-<namespace>-<id>.prom`.
    pub metrics_file: PathBuf,
    pub promotions_kept: usize,
}

impl Publisher {
    pub fn new(o: Outlets, drops: Arc<DropCounts>, epoch: SystemTime) -> Self {
        Publisher {
            id: o.id,
            namespace: o.namespace,
            runc_ids: o.runc_ids,
            state_json: o.state_json,
            containerd: o.containerd,
            metrics_file: o.metrics_file,
            view: watch::channel(View::default()).0,
            epoch,
            promotions: VecDeque::new(),
            promotions_kept: o.promotions_kept.max(1),
            last_pid: 0,
            written: None,
            drops,
            counters_written: None,
            recorded: 0,
            exit_status: None,
            fdstore: None,
        }
    }

    /// Writes the pair's fd store's figures too.
    pub fn with_fdstore(mut self, figures: Option<Arc<Figures>>) -> Self {
        self.fdstore = figures;
        self
    }

    /// The store's figures now (and their changes seen).
    fn fdstore_figures(&self) -> Option<FdStoreStatus> {
        let figures = self.fdstore.as_ref()?;
        figures.take_moved();
        Some(figures.status())
    }

    /// The engine created at Create has `pid`: the task's until another
    /// is known.
    pub fn created(&mut self, pid: u32) {
        self.last_pid = pid;
        self.view.send_modify(|v| v.pid = pid);
    }

    /// A receiver of the view, for the Task service.
    pub fn subscribe(&self) -> watch::Receiver<View> {
        self.view.subscribe()
    }

    /// The view as last published.
    pub fn view(&self) -> View {
        self.view.borrow().clone()
    }

    pub fn set_paused(&mut self, paused: bool) {
        self.view.send_modify(|v| v.paused = paused);
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
        let hang = p.hang.map_or(String::new(), |h| {
            format!(
                "hang ({}) detected → killed {} ms, ",
                h.cause,
                ms(h.killed_at)
            )
        });
        log::info!(
            "pair {}: promotion {} slot {} -> {}: death seen by {:?}; {hang}death → reap {} ms, → lock {} ms, → ready {} ms ({:?}, {:?})",
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
            hang_detected_unix_us: p.hang.map(|h| self.wall(h.detected_at)),
            hang_killed_unix_us: p.hang.and_then(|h| h.killed_at).map(|d| self.wall(d)),
            total_ms: p.total().map(|d| d.as_secs_f64() * 1e3),
            promotion: state_file::promotion(&p),
        };
        self.promotions.push_back(rec);
        while self.promotions.len() > self.promotions_kept {
            self.promotions.pop_front();
        }
        self.recorded += 1;
    }

    /// How long until the counters that moved since the last write are
    /// due a write of their own (zero: now); None when none moved.
    pub fn counters_due(&self, pair: &Pair, now: Instant) -> Option<Duration> {
        let (at, refused) = self.counters_written?;
        let moved = self.drops.moved()
            || pair.ready_refused() != refused
            || self.fdstore.as_ref().is_some_and(|f| f.moved());
        moved.then(|| (at + COUNTERS_EVERY).saturating_duration_since(now))
    }

    /// Republish the view, and rewrite `state.json` and the metrics file
    /// when something in them changed (or when `force`d); see
    /// [`COUNTERS_EVERY`] for the counters.
    pub fn publish(&mut self, pair: &Pair, gms: Option<GmsStatus>, force: bool) {
        if let Some(pid) = pair.representative_pid() {
            self.last_pid = pid;
        }
        let pids: Vec<Option<u32>> = pair.slot_ids().map(|s| pair.slot(s).pid).collect();
        let active = pair.active();
        let last_pid = self.last_pid;
        self.view.send_if_modified(|v| {
            let changed = v.pid != last_pid || v.pids != pids || v.active != active || !v.started;
            v.pid = last_pid;
            v.pids = pids.clone();
            v.active = active;
            v.started = true;
            changed
        });
        let (reports, figures) = gms.map(|g| (g.reports, g.figures)).unwrap_or_default();
        let key = (pair.revision(), self.recorded, reports);
        let now = Instant::now();
        let counters = self.counters_due(pair, now).is_some_and(|d| d.is_zero());
        if !force && !counters && self.written.as_ref() == Some(&key) {
            return;
        }
        let snap = pair.snapshot();
        let notify_dropped = self.drops.take();
        let fdstore = self.fdstore_figures();
        self.counters_written = Some((now, snap.ready_refused));
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
            fdstore: fdstore.clone(),
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
        let mut text = shadow_pair::metrics::render(
            &self.containerd,
            &self.namespace,
            &self.id,
            &snap,
            &figures,
            &notify_dropped,
        );
        if let Some(f) = &fdstore {
            text.push_str(&shadow_pair::metrics::render_fdstore(
                &self.containerd,
                &self.namespace,
                &self.id,
                f,
            ));
        }
        if let Err(e) = write_atomic(&self.metrics_file, text.as_bytes()) {
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

#[cfg(test)]
mod tests {
    #[test]
    fn files_are_replaced_whole_and_readable() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("metrics/p.prom");
        write_atomic(&p, b"a 1\n").unwrap();
        write_atomic(&p, b"a 2\n").unwrap();
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "a 2\n");
        let mode = std::fs::metadata(&p).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o644);
        let names: Vec<_> = std::fs::read_dir(p.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1, "no temporary file left: {names:?}");
        // A link planted where a fixed temporary name would be is not
        // followed: the target stays untouched.
        let victim = d.path().join("victim");
        std::fs::write(&victim, "keep").unwrap();
        std::os::unix::fs::symlink(&victim, d.path().join("metrics/p.json.tmp")).unwrap();
        write_atomic(&p.with_extension("json"), b"{}").unwrap();
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep");
    }

    use super::*;
    use crate::pair::notify::Dropped;
    use shadow_pair::RestartPolicy;

    fn publisher(dir: &Path, drops: Arc<DropCounts>) -> Publisher {
        Publisher::new(
            Outlets {
                id: "p".into(),
                namespace: "default".into(),
                runc_ids: vec!["p-0".into(), "p-1".into()],
                state_json: dir.join("state.json"),
                containerd: "/run/c.sock".into(),
                metrics_file: dir.join("p.prom"),
                promotions_kept: 1,
            },
            drops,
            SystemTime::now(),
        )
    }

    fn dropped(text: &str, reason: &str) -> Option<u64> {
        let prefix = "shadow_notify_dropped_total{";
        let reason = format!("reason=\"{reason}\"}} ");
        text.lines()
            .filter(|l| l.starts_with(prefix))
            .find_map(|l| l.split_once(&reason)?.1.parse().ok())
    }

    /// A flood of drops is written with the next write, or once
    /// [`COUNTERS_EVERY`] has passed since the last: never once per drop.
    #[test]
    fn counters_are_written_at_most_every_counters_every() {
        let dir = tempfile::tempdir().unwrap();
        let drops = Arc::new(DropCounts::default());
        let mut p = publisher(dir.path(), drops.clone());
        let mut pair = Pair::new(RestartPolicy::default());
        p.publish(&pair, None, false);
        let metrics = dir.path().join("p.prom");
        let text = std::fs::read_to_string(&metrics).unwrap();
        assert_eq!(dropped(&text, "rate_limited"), Some(0), "{text}");
        assert_eq!(p.counters_due(&pair, Instant::now()), None);

        let now = Instant::now();
        assert!(drops.count(Dropped::RateLimited), "the first drop tells");
        for _ in 1..1000 {
            assert!(!drops.count(Dropped::RateLimited));
        }
        let due = p.counters_due(&pair, now).expect("due");
        assert!(due > Duration::ZERO && due <= COUNTERS_EVERY, "{due:?}");
        p.publish(&pair, None, false);
        let text = std::fs::read_to_string(&metrics).unwrap();
        assert_eq!(dropped(&text, "rate_limited"), Some(0), "not yet: {text}");

        // A change of the pair writes anyway, with the counts of now.
        pair.start();
        p.publish(&pair, None, false);
        let text = std::fs::read_to_string(&metrics).unwrap();
        assert_eq!(dropped(&text, "rate_limited"), Some(1000), "{text}");
        assert_eq!(p.counters_due(&pair, Instant::now()), None);

        // Alone, they wait for their period.
        drops.count(Dropped::RateLimited);
        p.publish(&pair, None, false);
        let text = std::fs::read_to_string(&metrics).unwrap();
        assert_eq!(dropped(&text, "rate_limited"), Some(1000), "{text}");
        let (at, refused) = p.counters_written.unwrap();
        p.counters_written = Some((at - COUNTERS_EVERY, refused));
        assert_eq!(p.counters_due(&pair, Instant::now()), Some(Duration::ZERO));
        p.publish(&pair, None, false);
        let text = std::fs::read_to_string(&metrics).unwrap();
        assert_eq!(dropped(&text, "rate_limited"), Some(1001), "{text}");
        assert_eq!(dropped(&text, "queue_full"), Some(0), "{text}");
    }
}
