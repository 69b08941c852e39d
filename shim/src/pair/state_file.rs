//! `state.json` from the supervisor's values. The schema is
//! `shadow_contract::state` (shared with `shadowctl`, the tests and the
//! benchmarks). The pure crate `shadow_pair` decides with the schema's
//! enums; its records carry a [`SlotId`] where the file has a number, and
//! this is the one place that maps them onto the file, so the pair can
//! change its internals without changing what tools read.

use shadow_contract::state as file;
use shadow_pair::{Promotion, Slot, SlotId, Snapshot};

fn slot_id(s: SlotId) -> u8 {
    // A slot is 0 or 1 by construction.
    s.index() as u8
}

fn slot(s: &Slot) -> file::SlotState {
    file::SlotState {
        id: slot_id(s.id),
        state: s.state,
        pid: s.pid,
        generation: s.generation,
        speaks_notify: s.speaks_notify,
        last_exit: s.last_exit,
        last_hang: s.last_hang,
        watchdog_armed: s.watchdog_armed,
    }
}

pub fn promotion(p: &Promotion) -> file::Promotion {
    file::Promotion {
        number: p.number,
        from: slot_id(p.from),
        to: p.to.map(slot_id),
        death_at: p.death_at,
        death_seen: p.death_seen,
        reaped_at: p.reaped_at,
        lock_at: p.lock_at,
        ready_at: p.ready_at,
        exit: p.exit,
        class: p.class,
        hang: p.hang,
    }
}

pub fn snapshot(s: &Snapshot) -> file::PairSnapshot {
    file::PairSnapshot {
        slots: s.slots.iter().map(slot).collect(),
        active: s.active.map(slot_id),
        protected: s.protected,
        shadows: s.shadows,
        shadows_parked: s.shadows_parked,
        failovers: s.failovers,
        cold_restarts: s.cold_restarts,
        oom_kills: s.oom_kills,
        weights_corrupt: s.weights_corrupt,
        last_promotion: s.last_promotion.as_ref().map(promotion),
        last_cold_restart: s.last_cold_restart.clone(),
        kv_drops: s.kv_drops,
        last_kv_drop: s.last_kv_drop.clone(),
        gms_deaths: s.gms_deaths.clone(),
        hangs: s.hangs,
    }
}

/// gmsd's status report as the file keeps it; None if it does not have
/// the fields the schema requires (an older gmsd).
pub fn gms(report: serde_json::Value) -> Option<file::GmsStatus> {
    serde_json::from_value(report).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use shadow_pair::{DeathSign, Exit, FailureClass, Pair, RestartPolicy};

    /// Whatever the pure crate serializes, the file's types read back: the
    /// mapping loses nothing tools read.
    #[test]
    fn snapshot_maps_onto_the_schema() {
        let pair = Pair::new(RestartPolicy::default());
        let snap = pair.snapshot();
        let mapped = snapshot(&snap);
        assert_eq!(
            serde_json::to_value(&mapped).unwrap(),
            serde_json::to_value(&snap).unwrap()
        );
        let p = Promotion {
            number: 3,
            from: SlotId::ONE,
            to: Some(SlotId::ZERO),
            death_at: std::time::Duration::from_millis(4),
            death_seen: DeathSign::Ready,
            reaped_at: std::time::Duration::from_millis(5),
            lock_at: None,
            ready_at: Some(std::time::Duration::from_millis(9)),
            exit: Exit::Signal(9),
            class: FailureClass::DevicePreserving,
            hang: None,
        };
        assert_eq!(
            serde_json::to_value(promotion(&p)).unwrap(),
            serde_json::to_value(&p).unwrap()
        );
    }
}
