//! Per-pair metrics in the Prometheus text format, rendered for
//! node-exporter's textfile collector: one `.prom` file per pair, which the
//! shim replaces whole (`publish::write_atomic` there) so that a scrape
//! never reads half a file. Rendering only: this crate does no I/O.

use std::fmt::Write as _;

use crate::failure::{ColdRestartCause, HangCause};
use crate::pair::{EngineState, Snapshot};
use shadow_contract::state::FdStoreStatus;

/// What one GMS daemon of the pair holds, as its status reports it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GmsFigures {
    /// `host` or a GPU UUID.
    pub device: String,
    pub bytes: u64,
    pub allocations: u64,
    pub leases: u64,
    pub committed: bool,
}

/// Escapes a label value (backslash, quote, newline).
fn label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// The labels every sample of a pair has.
fn base_labels(containerd: &str, namespace: &str, id: &str) -> String {
    format!(
        "containerd=\"{}\",namespace=\"{}\",pair=\"{}\"",
        label(containerd),
        label(namespace),
        label(id)
    )
}

/// One metric family: its HELP and TYPE lines, then a sample per
/// `(extra labels, value)`.
fn family<V: std::fmt::Display>(
    out: &mut String,
    base: &str,
    name: &str,
    kind: &str,
    help: &str,
    lines: &[(String, V)],
) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
    for (labels, value) in lines {
        let _ = writeln!(out, "{name}{{{base}{labels}}} {value}");
    }
}

/// The fd store's part of a pair's metrics text (appended to [`render`]'s
/// for a pair that has a store).
pub fn render_fdstore(containerd: &str, namespace: &str, id: &str, f: &FdStoreStatus) -> String {
    let base = base_labels(containerd, namespace, id);
    let mut out = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, lines: &[(String, u64)]| {
        family(&mut out, &base, name, kind, help, lines)
    };
    let one = |v: u64| [(String::new(), v)];
    metric(
        "shadow_fdstore_fds",
        "gauge",
        "Descriptors the pair's fd store holds.",
        &one(f.fds),
    );
    metric(
        "shadow_fdstore_max",
        "gauge",
        "The fd store's bound (shadow.dev/fdstore-max).",
        &one(f.max),
    );
    let ops = [
        ("stored", f.stored),
        ("removed", f.removed),
        ("hung_up", f.hung_up),
        ("fetched", f.fetched),
        ("accepted", f.accepted),
        ("handed", f.handed),
    ];
    let ops: Vec<(String, u64)> = ops
        .iter()
        .map(|(op, n)| (format!(",op=\"{op}\""), *n))
        .collect();
    metric(
        "shadow_fdstore_descriptors_total",
        "counter",
        "Descriptors the fd store kept (stored), dropped (removed, hung_up), handed to a promoted engine (fetched), and connections the runtime accepted into it (accepted) and handed to the serving engine (handed).",
        &ops,
    );
    let refused: Vec<(String, u64)> = f
        .refused
        .iter()
        .map(|(reason, n)| (format!(",reason=\"{}\"", label(reason)), *n))
        .collect();
    metric(
        "shadow_fdstore_refused_total",
        "counter",
        "Descriptors sent to the fd store and not kept, by reason.",
        &refused,
    );
    metric(
        "shadow_fdstore_fetches_total",
        "counter",
        "Fetches of the fd store, answered (to the lock holder) and refused (not the lock holder, not the slot's engine, one in flight).",
        &[
            (",result=\"answered\"".to_string(), f.fetches),
            (",result=\"refused\"".to_string(), f.fetches_refused),
        ],
    );
    out
}

/// The metrics text of one pair. `containerd` (the owning containerd's
/// address) is a label too: two containerds on a host may each have a
/// pair of the same namespace and id. `notify_dropped`: the datagrams the
/// pair's notify socket dropped, by reason (every reason, 0 included).
pub fn render(
    containerd: &str,
    namespace: &str,
    id: &str,
    snap: &Snapshot,
    gms: &[GmsFigures],
    notify_dropped: &[(&str, u64)],
) -> String {
    let base = base_labels(containerd, namespace, id);
    let mut out = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, lines: &[(String, String)]| {
        family(&mut out, &base, name, kind, help, lines)
    };
    let one = |v: String| vec![(String::new(), v)];
    metric(
        "shadow_pair_failovers_total",
        "counter",
        "Promotions of the shadow after the active engine died.",
        &one(snap.failovers.to_string()),
    );
    metric(
        "shadow_pair_cold_restarts_total",
        "counter",
        "Restarts of both engines and GMS after a device-invalidating failure or corrupt weights.",
        &one(snap.cold_restarts.to_string()),
    );
    metric(
        "shadow_pair_kv_drops_total",
        "counter",
        "Cold restarts that dropped the pair's KV pool with its GMS state: nothing engines carried across promotions is carried across these.",
        &one(snap.kv_drops.to_string()),
    );
    metric(
        "shadow_pair_weights_corrupt_total",
        "counter",
        "Engines that found the committed weights changed since their digest was recorded (each restarts the pair cold).",
        &one(snap.weights_corrupt.to_string()),
    );
    metric(
        "shadow_pair_oom_kills_total",
        "counter",
        "Engine deaths in which the kernel's OOM killer killed a process of the engine.",
        &one(snap.oom_kills.to_string()),
    );
    let hangs: Vec<_> = HangCause::ALL
        .iter()
        .map(|c| {
            (
                format!(",cause=\"{}\"", c.as_str()),
                snap.hangs.of(*c).to_string(),
            )
        })
        .collect();
    metric(
        "shadow_pair_hangs_total",
        "counter",
        "Engines the pair ended because they hung, by cause (watchdog, trigger, probe, start_timeout).",
        &hangs,
    );
    let dropped: Vec<_> = notify_dropped
        .iter()
        .map(|(reason, n)| (format!(",reason=\"{}\"", label(reason)), n.to_string()))
        .collect();
    metric(
        "shadow_notify_dropped_total",
        "counter",
        "Datagrams the pair's notify socket dropped, by reason.",
        &dropped,
    );
    metric(
        "shadow_ready_refused_total",
        "counter",
        "READY=1s ignored because their engine did not hold the election lock.",
        &one(snap.ready_refused.to_string()),
    );
    metric(
        "shadow_pair_protected",
        "gauge",
        "1 when an active engine has a parked shadow behind it.",
        &one(u8::from(snap.protected).to_string()),
    );
    metric(
        "shadow_pair_shadows",
        "gauge",
        "Shadows the pair is made for (shadow.dev/shadows).",
        &one(snap.shadows.to_string()),
    );
    metric(
        "shadow_pair_shadows_parked",
        "gauge",
        "Shadows parked now: failures the pair can take before one finds no shadow.",
        &one(snap.shadows_parked.to_string()),
    );
    let mut states = Vec::new();
    let mut generations = Vec::new();
    for slot in &snap.slots {
        for state in EngineState::ALL {
            states.push((
                format!(",slot=\"{}\",state=\"{}\"", slot.id, state.as_str()),
                u8::from(slot.state == state).to_string(),
            ));
        }
        generations.push((
            format!(",slot=\"{}\"", slot.id),
            slot.generation.to_string(),
        ));
    }
    metric(
        "shadow_engine_state",
        "gauge",
        "1 for the state each slot's engine is in.",
        &states,
    );
    metric(
        "shadow_engine_generation",
        "counter",
        "Spawns of each slot since the pair was created.",
        &generations,
    );
    if let Some(p) = &snap.last_promotion {
        // From the first sign of the death (reap, lock, or the successor's
        // READY=1, whichever the shim saw first): never negative, and the
        // same origin as `total_ms` in state.json.
        let since_death =
            |t: std::time::Duration| format!("{:.6}", t.saturating_sub(p.death_at).as_secs_f64());
        let mut phases = vec![(
            ",phase=\"death_to_reap\"".to_string(),
            since_death(p.reaped_at),
        )];
        if let Some(k) = p.hang.and_then(|h| h.killed_at) {
            phases.push((",phase=\"death_to_kill\"".to_string(), since_death(k)));
        }
        if let Some(l) = p.lock_at {
            phases.push((",phase=\"death_to_lock\"".to_string(), since_death(l)));
        }
        if let Some(r) = p.ready_at {
            phases.push((",phase=\"death_to_ready\"".to_string(), since_death(r)));
        }
        metric(
            "shadow_pair_last_promotion_seconds",
            "gauge",
            "Phases of the last promotion, from the first sign that the active engine was gone (its hang's detection, for a hung one).",
            &phases,
        );
        if let Some(h) = p.hang {
            metric(
                "shadow_pair_last_promotion_hang_info",
                "gauge",
                "The last promotion followed a hang of the active engine: its cause.",
                &[(format!(",cause=\"{}\"", h.cause.as_str()), "1".into())],
            );
        }
        if let Some(total) = p.total() {
            metric(
                "shadow_pair_last_promotion_total_seconds",
                "gauge",
                "The last promotion: death observed to READY=1 (to the lock without sd_notify).",
                &one(format!("{:.6}", total.as_secs_f64())),
            );
        }
    }
    if !snap.gms_deaths.is_empty() {
        let deaths: Vec<_> = snap
            .gms_deaths
            .iter()
            .map(|(d, n)| (format!(",device=\"{}\"", label(d)), n.to_string()))
            .collect();
        metric(
            "shadow_gms_deaths_total",
            "counter",
            "Deaths of the pair's GMS daemon of each device (each one restarts the pair cold).",
            &deaths,
        );
    }
    if let Some(cause) = &snap.last_cold_restart {
        let labels = match cause {
            ColdRestartCause::GmsDied { device } => {
                format!(",cause=\"gms_died\",device=\"{}\"", label(device))
            }
            ColdRestartCause::Xid { xid } => format!(",cause=\"xid\",xid=\"{xid}\""),
            ColdRestartCause::WeightsCorrupt { slot } => {
                format!(",cause=\"weights_corrupt\",slot=\"{slot}\"")
            }
        };
        metric(
            "shadow_pair_last_cold_restart_info",
            "gauge",
            "Why the pair last restarted cold: the GMS daemon of a device died, an XID, or an engine found the weights corrupt.",
            &[(labels, "1".into())],
        );
    }
    if !gms.is_empty() {
        let per = |f: &dyn Fn(&GmsFigures) -> String| {
            gms.iter()
                .map(|g| (format!(",device=\"{}\"", label(&g.device)), f(g)))
                .collect::<Vec<_>>()
        };
        metric(
            "shadow_gms_bytes",
            "gauge",
            "Bytes held by the pair's GMS daemon.",
            &per(&|g| g.bytes.to_string()),
        );
        metric(
            "shadow_gms_allocations",
            "gauge",
            "Allocations held by the pair's GMS daemon.",
            &per(&|g| g.allocations.to_string()),
        );
        metric(
            "shadow_gms_leases",
            "gauge",
            "Engines attached to the pair's GMS daemon.",
            &per(&|g| g.leases.to_string()),
        );
        metric(
            "shadow_gms_committed",
            "gauge",
            "1 when the daemon holds a committed layout.",
            &per(&|g| u8::from(g.committed).to_string()),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::{
        failure::Exit,
        notify::Notification,
        pair::{Event, LockHolder, Pair, SlotId},
        policy::RestartPolicy,
    };

    fn snapshot_after_one_failover() -> Snapshot {
        let mut p = Pair::new(RestartPolicy::default());
        p.start();
        let ms = Duration::from_millis;
        p.handle(
            Event::Spawned {
                slot: SlotId::ZERO,
                pid: 1,
            },
            ms(0),
        );
        p.handle(
            Event::Spawned {
                slot: SlotId::ONE,
                pid: 2,
            },
            ms(0),
        );
        p.handle(Event::LockHeld { slot: SlotId::ZERO }, ms(1));
        p.handle(
            Event::Exited {
                slot: SlotId::ZERO,
                exit: Exit::Signal(9),
            },
            ms(100),
        );
        p.handle(Event::LockHeld { slot: SlotId::ONE }, ms(102));
        p.handle(
            Event::Spawned {
                slot: SlotId::ZERO,
                pid: 3,
            },
            ms(103),
        );
        p.handle(
            Event::Notified {
                slot: SlotId::ZERO,
                notification: Notification::Status("parked".into()),
            },
            ms(150),
        );
        // The parked shadow lies: the new active holds the lock.
        p.handle(
            Event::Ready {
                slot: SlotId::ZERO,
                holder: LockHolder::Slot(SlotId::ONE),
            },
            ms(160),
        );
        p.snapshot()
    }

    #[test]
    fn the_fd_store_has_its_figures() {
        let f = FdStoreStatus {
            fds: 3,
            max: 1024,
            stored: 10,
            removed: 6,
            hung_up: 1,
            fetched: 3,
            fetches: 2,
            fetches_refused: 2,
            refused: [("wrong_type".to_string(), 4), ("full".to_string(), 0)].into(),
            accepted: 7,
            handed: 5,
        };
        let text = render_fdstore("c", "n", "p", &f);
        let base = "containerd=\"c\",namespace=\"n\",pair=\"p\"";
        for line in [
            format!("shadow_fdstore_fds{{{base}}} 3"),
            format!("shadow_fdstore_max{{{base}}} 1024"),
            format!("shadow_fdstore_descriptors_total{{{base},op=\"removed\"}} 6"),
            format!("shadow_fdstore_descriptors_total{{{base},op=\"accepted\"}} 7"),
            format!("shadow_fdstore_descriptors_total{{{base},op=\"handed\"}} 5"),
            format!("shadow_fdstore_refused_total{{{base},reason=\"wrong_type\"}} 4"),
            format!("shadow_fdstore_refused_total{{{base},reason=\"full\"}} 0"),
            format!("shadow_fdstore_fetches_total{{{base},result=\"refused\"}} 2"),
        ] {
            assert_has_line(&text, &line);
        }
    }

    #[test]
    fn renders_every_family_with_labels() {
        let snap = snapshot_after_one_failover();
        let gms = [GmsFigures {
            device: "host".into(),
            bytes: 4096,
            allocations: 1,
            leases: 2,
            committed: true,
        }];
        let dropped = [("rate_limited", 7), ("queue_full", 0)];
        let text = render("/run/c.sock", "default", "llm\"1", &snap, &gms, &dropped);
        let base = "containerd=\"/run/c.sock\",namespace=\"default\",pair=\"llm\\\"1\"";
        for line in [
            format!("shadow_pair_failovers_total{{{base}}} 1"),
            format!("shadow_pair_hangs_total{{{base},cause=\"watchdog\"}} 0"),
            format!("shadow_pair_hangs_total{{{base},cause=\"start_timeout\"}} 0"),
            format!("shadow_pair_protected{{{base}}} 1"),
            format!("shadow_pair_shadows{{{base}}} 1"),
            format!("shadow_pair_shadows_parked{{{base}}} 1"),
            format!("shadow_engine_state{{{base},slot=\"1\",state=\"active\"}} 1"),
            format!("shadow_engine_state{{{base},slot=\"0\",state=\"parked\"}} 1"),
            format!("shadow_engine_state{{{base},slot=\"0\",state=\"active\"}} 0"),
            format!("shadow_engine_generation{{{base},slot=\"0\"}} 2"),
            format!(
                "shadow_pair_last_promotion_seconds{{{base},phase=\"death_to_lock\"}} 0.002000"
            ),
            format!(
                "shadow_pair_last_promotion_seconds{{{base},phase=\"death_to_reap\"}} 0.000000"
            ),
            format!("shadow_pair_last_promotion_total_seconds{{{base}}} 0.002000"),
            format!("shadow_gms_bytes{{{base},device=\"host\"}} 4096"),
            format!("shadow_gms_leases{{{base},device=\"host\"}} 2"),
            format!("shadow_notify_dropped_total{{{base},reason=\"rate_limited\"}} 7"),
            format!("shadow_notify_dropped_total{{{base},reason=\"queue_full\"}} 0"),
            format!("shadow_ready_refused_total{{{base}}} 1"),
        ] {
            assert_has_line(&text, &line);
        }
        // Every sample line belongs to a family announced with HELP and TYPE.
        for l in text.lines().filter(|l| !l.starts_with('#')) {
            let name = l.split('{').next().unwrap();
            assert!(
                text.contains(&format!("# TYPE {name} ")),
                "{name} has no TYPE"
            );
        }
    }

    fn assert_has_line(text: &str, line: &str) {
        assert!(
            text.lines().any(|l| l == line),
            "missing {line:?} in\n{text}"
        );
    }

    #[test]
    fn a_hang_is_counted_by_cause_and_its_promotion_says_so() {
        let mut snap = snapshot_after_one_failover();
        snap.hangs.count(HangCause::Probe);
        let p = snap.last_promotion.as_mut().unwrap();
        p.hang = Some(crate::failure::Hang {
            cause: HangCause::Probe,
            detected_at: p.death_at,
            killed_at: Some(p.death_at + Duration::from_micros(250)),
        });
        let text = render("c", "n", "p", &snap, &[], &[]);
        let base = "containerd=\"c\",namespace=\"n\",pair=\"p\"";
        for line in [
            format!("shadow_pair_hangs_total{{{base},cause=\"probe\"}} 1"),
            format!("shadow_pair_hangs_total{{{base},cause=\"trigger\"}} 0"),
            format!(
                "shadow_pair_last_promotion_seconds{{{base},phase=\"death_to_kill\"}} 0.000250"
            ),
            format!("shadow_pair_last_promotion_hang_info{{{base},cause=\"probe\"}} 1"),
        ] {
            assert_has_line(&text, &line);
        }
    }

    #[test]
    fn corrupt_weights_are_counted_and_named() {
        let mut snap = snapshot_after_one_failover();
        snap.weights_corrupt = 1;
        snap.cold_restarts = 1;
        snap.last_cold_restart = Some(ColdRestartCause::WeightsCorrupt { slot: 1 });
        let text = render("/run/c.sock", "default", "p", &snap, &[], &[]);
        let base = "containerd=\"/run/c.sock\",namespace=\"default\",pair=\"p\"";
        for line in [
            format!("shadow_pair_weights_corrupt_total{{{base}}} 1"),
            format!(
                "shadow_pair_last_cold_restart_info{{{base},cause=\"weights_corrupt\",slot=\"1\"}} 1"
            ),
        ] {
            assert_has_line(&text, &line);
        }
    }

    #[test]
    fn a_gms_death_names_its_gpu() {
        let mut snap = snapshot_after_one_failover();
        let gpu = "GPU-00000000-0000-0000-0000-000000000002";
        snap.gms_deaths.insert(gpu.into(), 1);
        snap.last_cold_restart = Some(ColdRestartCause::GmsDied { device: gpu.into() });
        let text = render("/run/c.sock", "default", "p", &snap, &[], &[]);
        let base = "containerd=\"/run/c.sock\",namespace=\"default\",pair=\"p\"";
        for line in [
            format!("shadow_gms_deaths_total{{{base},device=\"{gpu}\"}} 1"),
            format!(
                "shadow_pair_last_cold_restart_info{{{base},cause=\"gms_died\",device=\"{gpu}\"}} 1"
            ),
        ] {
            assert_has_line(&text, &line);
        }
    }
}
