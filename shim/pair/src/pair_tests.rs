//! The pair's own unit tests: one rule of the pair (`pair.rs` and the
//! modules in `pair/`) each (the order races have theirs in `races.rs`).

use super::*;
use crate::failure::{FailureClass, HangCause, WEIGHTS_CORRUPT_EXIT};
use crate::promotion::DeathSign;

const KILL: Exit = Exit::Signal(9);

fn t(ms: u64) -> Duration {
    Duration::from_millis(ms)
}

/// A pair with slot 0 active and slot 1 parked, both speaking sd_notify.
fn running() -> Pair {
    started(Pair::new(RestartPolicy::default()))
}

/// `p` started as [`running`] makes it: slot 0 active, slot 1 parked.
fn started(mut p: Pair) -> Pair {
    assert_eq!(
        p.start(),
        vec![
            Action::Spawn { slot: SlotId::ZERO },
            Action::Spawn { slot: SlotId::ONE }
        ]
    );
    spawned(&mut p, SlotId::ZERO, 100, 1);
    spawned(&mut p, SlotId::ONE, 101, 1);
    for s in SlotId::BOTH {
        parked(&mut p, s, 2);
    }
    p.handle(Event::LockHeld { slot: SlotId::ZERO }, t(3));
    let a = p.handle(
        Event::Ready {
            slot: SlotId::ZERO,
            holder: LockHolder::Slot(SlotId::ZERO),
        },
        t(4),
    );
    assert!(a.is_empty(), "first activation is not a promotion: {a:?}");
    assert_eq!(p.active(), Some(SlotId::ZERO));
    assert!(p.snapshot().protected);
    p
}

#[test]
fn killing_the_active_promotes_the_shadow_and_respawns_the_slot() {
    let mut p = running();
    let a = p.handle(
        Event::Exited {
            slot: SlotId::ZERO,
            exit: KILL,
        },
        t(1000),
    );
    assert_eq!(a, vec![Action::Spawn { slot: SlotId::ZERO }]);
    assert_eq!(p.active(), None);
    assert_eq!(
        p.representative_pid(),
        Some(101),
        "the shadow stands for the task meanwhile"
    );
    p.handle(Event::LockHeld { slot: SlotId::ONE }, t(1001));
    let a = p.handle(
        Event::Ready {
            slot: SlotId::ONE,
            holder: LockHolder::Slot(SlotId::ONE),
        },
        t(1010),
    );
    let [Action::Promoted(pr)] = a.as_slice() else {
        panic!("{a:?}")
    };
    assert_eq!((pr.from, pr.to), (SlotId::ZERO, Some(SlotId::ONE)));
    assert_eq!(pr.lock_at, Some(t(1001)));
    assert_eq!(pr.total(), Some(t(10)));
    assert_eq!(pr.class, FailureClass::DevicePreserving);
    assert_eq!(p.active(), Some(SlotId::ONE));
    assert_eq!(p.representative_pid(), Some(101));
    assert!(!p.snapshot().protected, "slot 0 is not parked yet");
    spawned(&mut p, SlotId::ZERO, 200, 1020);
    parked(&mut p, SlotId::ZERO, 1500);
    let snap = p.snapshot();
    assert!(snap.protected);
    assert_eq!(snap.failovers, 1);
    assert_eq!(snap.slots[0].generation, 2);
}

/// The promoted engine holds the lock but has not said `READY=1`: it does
/// not serve yet, so a new shadow parked behind it does not make the pair
/// protected.
#[test]
fn a_promoted_engine_protects_nothing_before_its_ready() {
    let mut p = running();
    died(&mut p, SlotId::ZERO, KILL, 1000);
    p.handle(Event::LockHeld { slot: SlotId::ONE }, t(1001));
    spawned(&mut p, SlotId::ZERO, 200, 1002);
    parked(&mut p, SlotId::ZERO, 1003);
    assert!(!p.snapshot().protected, "slot 1 has not said READY=1");
    p.handle(
        Event::Ready {
            slot: SlotId::ONE,
            holder: LockHolder::Slot(SlotId::ONE),
        },
        t(1004),
    );
    assert!(p.snapshot().protected);
}

#[test]
fn twenty_failovers_in_a_row_never_spend_the_budget() {
    let mut p = running();
    let mut active = SlotId::ZERO;
    for (i, pid) in (0..20u64).zip(1001..) {
        let now = 10_000 * (i + 1);
        let a = p.handle(
            Event::Exited {
                slot: active,
                exit: KILL,
            },
            t(now),
        );
        assert_eq!(a, vec![Action::Spawn { slot: active }], "failover {i}");
        let next = active.other();
        p.handle(Event::LockHeld { slot: next }, t(now + 1));
        let a = p.handle(
            Event::Ready {
                slot: next,
                holder: LockHolder::Slot(next),
            },
            t(now + 2),
        );
        assert!(matches!(a.as_slice(), [Action::Promoted(pr)] if pr.number == i + 1));
        p.handle(Event::Spawned { slot: active, pid }, t(now + 3));
        parked(&mut p, active, now + 4);
        assert!(p.snapshot().protected);
        active = next;
    }
    assert_eq!(p.snapshot().failovers, 20);
}

#[test]
fn a_dead_shadow_is_respawned_and_the_active_untouched() {
    let mut p = running();
    let a = p.handle(
        Event::Exited {
            slot: SlotId::ONE,
            exit: KILL,
        },
        t(100),
    );
    assert_eq!(a, vec![Action::Spawn { slot: SlotId::ONE }]);
    assert_eq!(p.active(), Some(SlotId::ZERO));
    assert_eq!(p.snapshot().failovers, 0);
    assert!(
        !p.snapshot().protected,
        "unprotected until the new shadow parks"
    );
}

#[test]
fn engines_without_sd_notify_are_active_by_lock() {
    let mut p = Pair::new(RestartPolicy::default());
    p.start();
    spawned(&mut p, SlotId::ZERO, 10, 0);
    spawned(&mut p, SlotId::ONE, 11, 0);
    p.handle(Event::LockHeld { slot: SlotId::ONE }, t(5));
    assert_eq!(p.active(), Some(SlotId::ONE));
    p.handle(
        Event::Exited {
            slot: SlotId::ONE,
            exit: KILL,
        },
        t(100),
    );
    let a = p.handle(Event::LockHeld { slot: SlotId::ZERO }, t(103));
    let [Action::Promoted(pr)] = a.as_slice() else {
        panic!("{a:?}")
    };
    assert_eq!(pr.total(), Some(t(3)));
    assert_eq!(pr.ready_at, None);
}

#[test]
fn both_killed_at_once_both_come_back() {
    let mut p = running();
    let a = p.handle(
        Event::Exited {
            slot: SlotId::ZERO,
            exit: KILL,
        },
        t(100),
    );
    assert_eq!(a, vec![Action::Spawn { slot: SlotId::ZERO }]);
    let a = p.handle(
        Event::Exited {
            slot: SlotId::ONE,
            exit: KILL,
        },
        t(100),
    );
    assert_eq!(a, vec![Action::Spawn { slot: SlotId::ONE }]);
    assert_eq!(p.representative_pid(), None);
}

#[test]
fn an_engine_that_always_crashes_backs_off_then_the_task_exits_with_its_status() {
    let mut p = Pair::new(RestartPolicy {
        max_consecutive_failures: 3,
        ..RestartPolicy::default()
    });
    p.start();
    spawned(&mut p, SlotId::ZERO, 1, 0);
    spawned(&mut p, SlotId::ONE, 2, 0);
    let crash = Exit::Code(3);
    let a = p.handle(
        Event::Exited {
            slot: SlotId::ZERO,
            exit: crash,
        },
        t(10),
    );
    assert_eq!(a, vec![Action::Spawn { slot: SlotId::ZERO }]);
    let a = p.handle(
        Event::Exited {
            slot: SlotId::ONE,
            exit: crash,
        },
        t(20),
    );
    assert!(
        matches!(a.as_slice(), [Action::SpawnAfter { slot: SlotId::ONE, delay }] if !delay.is_zero())
    );
    assert_eq!(p.slot(SlotId::ONE).state, EngineState::Backoff);
    spawned(&mut p, SlotId::ZERO, 3, 30);
    let a = p.handle(
        Event::Exited {
            slot: SlotId::ZERO,
            exit: crash,
        },
        t(40),
    );
    assert!(matches!(a.as_slice(), [Action::SpawnAfter { .. }]));
    // Fourth early death: budget spent. Slot 1 is in backoff, slot 0 dead:
    // nothing alive, so the task exits at once with the crash's status.
    let a = p.handle(Event::BackoffElapsed { slot: SlotId::ONE }, t(500));
    assert_eq!(a, vec![Action::Spawn { slot: SlotId::ONE }]);
    spawned(&mut p, SlotId::ONE, 4, 501);
    let a = p.handle(
        Event::Exited {
            slot: SlotId::ONE,
            exit: crash,
        },
        t(510),
    );
    assert_eq!(a, vec![Action::Exit { status: 3 }]);
    assert!(p.is_ending());
    assert!(p
        .handle(Event::BackoffElapsed { slot: SlotId::ZERO }, t(900))
        .is_empty());
}

#[test]
fn stop_kills_both_and_exits_once_with_the_active_status() {
    let mut p = running();
    assert_eq!(p.handle(Event::Stop, t(10)), vec![Action::KillAll]);
    assert!(
        p.handle(Event::Stop, t(11)).is_empty(),
        "a second Kill adds nothing"
    );
    let a = p.handle(
        Event::Exited {
            slot: SlotId::ONE,
            exit: KILL,
        },
        t(12),
    );
    assert_eq!(a, vec![Action::KillAll], "still one alive, no respawn");
    let a = p.handle(
        Event::Exited {
            slot: SlotId::ZERO,
            exit: Exit::Signal(15),
        },
        t(13),
    );
    assert_eq!(a, vec![Action::Exit { status: 143 }]);
}

#[test]
fn stop_right_after_a_failover_reports_the_new_active_status() {
    let mut p = running();
    p.handle(
        Event::Exited {
            slot: SlotId::ZERO,
            exit: KILL,
        },
        t(100),
    );
    p.handle(Event::LockHeld { slot: SlotId::ONE }, t(101));
    p.handle(
        Event::Ready {
            slot: SlotId::ONE,
            holder: LockHolder::Slot(SlotId::ONE),
        },
        t(102),
    );
    // Stop while slot 0 is still being respawned.
    assert_eq!(p.handle(Event::Stop, t(103)), vec![Action::KillAll]);
    spawned(&mut p, SlotId::ZERO, 300, 104);
    // The respawned engine, killed on arrival, is reaped first.
    assert_eq!(
        p.handle(
            Event::Exited {
                slot: SlotId::ZERO,
                exit: KILL
            },
            t(105)
        ),
        vec![Action::KillAll]
    );
    let a = p.handle(
        Event::Exited {
            slot: SlotId::ONE,
            exit: Exit::Signal(15),
        },
        t(106),
    );
    assert_eq!(a, vec![Action::Exit { status: 143 }]);
}

#[test]
fn a_single_engine_restarts_in_place_and_is_never_protected() {
    let mut p = Pair::single(RestartPolicy::default());
    assert!(p.is_single());
    assert_eq!(p.start(), vec![Action::Spawn { slot: SlotId::ZERO }]);
    spawned(&mut p, SlotId::ZERO, 7, 0);
    p.handle(
        Event::Ready {
            slot: SlotId::ZERO,
            holder: LockHolder::Slot(SlotId::ZERO),
        },
        t(5),
    );
    assert_eq!(p.active(), Some(SlotId::ZERO));
    assert!(!p.snapshot().protected);
    let a = p.handle(
        Event::Exited {
            slot: SlotId::ZERO,
            exit: KILL,
        },
        t(100),
    );
    assert_eq!(a, vec![Action::Spawn { slot: SlotId::ZERO }]);
    assert_eq!(
        p.representative_pid(),
        None,
        "nothing serves until the restart is up"
    );
    spawned(&mut p, SlotId::ZERO, 8, 120);
    let a = p.handle(
        Event::Ready {
            slot: SlotId::ZERO,
            holder: LockHolder::Slot(SlotId::ZERO),
        },
        t(300),
    );
    let [Action::Promoted(pr)] = a.as_slice() else {
        panic!("{a:?}")
    };
    assert_eq!((pr.from, pr.to), (SlotId::ZERO, Some(SlotId::ZERO)));
    assert_eq!(
        pr.total(),
        Some(t(200)),
        "reap → the restarted engine's READY"
    );
    assert_eq!(p.slot(SlotId::ONE).state, EngineState::Stopped);
    // Cold restarts and stops involve slot 0 only.
    assert_eq!(p.handle(gms_died("host"), t(400)), vec![Action::KillAll]);
    let a = p.handle(
        Event::Exited {
            slot: SlotId::ZERO,
            exit: KILL,
        },
        t(401),
    );
    assert_eq!(
        a,
        vec![Action::RestartGms, Action::Spawn { slot: SlotId::ZERO }]
    );
    spawned(&mut p, SlotId::ZERO, 9, 402);
    assert_eq!(p.handle(Event::Stop, t(500)), vec![Action::KillAll]);
    let a = p.handle(
        Event::Exited {
            slot: SlotId::ZERO,
            exit: Exit::Signal(15),
        },
        t(501),
    );
    assert_eq!(a, vec![Action::Exit { status: 143 }]);
}

/// What a cold restart does once both engines are down: GMS afresh, both
/// slots spawned.
fn cold_start() -> Vec<Action> {
    vec![
        Action::RestartGms,
        Action::Spawn { slot: SlotId::ZERO },
        Action::Spawn { slot: SlotId::ONE },
    ]
}

fn gms_died(device: &str) -> Event {
    Event::GmsDied {
        device: device.into(),
    }
}

#[test]
fn gms_death_restarts_the_pair_cold() {
    let mut p = running();
    let gpu = "GPU-00000000-0000-0000-0000-000000000002";
    assert_eq!(p.handle(gms_died(gpu), t(10)), vec![Action::KillAll]);
    assert!(p
        .handle(
            Event::Exited {
                slot: SlotId::ZERO,
                exit: KILL
            },
            t(11)
        )
        .is_empty());
    let a = p.handle(
        Event::Exited {
            slot: SlotId::ONE,
            exit: KILL,
        },
        t(12),
    );
    assert_eq!(a, cold_start());
    let snap = p.snapshot();
    assert_eq!(snap.cold_restarts, 1);
    assert_eq!(snap.failovers, 0, "a cold restart is not a failover");
    assert_eq!(
        snap.last_cold_restart,
        Some(ColdRestartCause::GmsDied { device: gpu.into() }),
        "the cause names the GPU whose daemon died"
    );
    assert_eq!(snap.gms_deaths.get(gpu), Some(&1));
    // The KV pool went with the daemon: dropped, with the same cause.
    assert_eq!(snap.kv_drops, 1);
    assert_eq!(snap.last_kv_drop, snap.last_cold_restart);
}

#[test]
fn invalidating_xid_restarts_cold_preserving_xid_does_not() {
    let mut p = running();
    assert!(p.handle(Event::Xid(13), t(5)).is_empty());
    assert_eq!(
        p.snapshot().kv_drops,
        0,
        "a preserving XID keeps the KV pool"
    );
    assert_eq!(p.handle(Event::Xid(79), t(6)), vec![Action::KillAll]);
    p.handle(
        Event::Exited {
            slot: SlotId::ZERO,
            exit: KILL,
        },
        t(7),
    );
    let a = p.handle(
        Event::Exited {
            slot: SlotId::ONE,
            exit: KILL,
        },
        t(8),
    );
    assert_eq!(a.first(), Some(&Action::RestartGms));
    assert_eq!(
        p.snapshot().last_cold_restart,
        Some(ColdRestartCause::Xid { xid: 79 })
    );
    assert_eq!(
        (p.snapshot().kv_drops, p.snapshot().last_kv_drop),
        (1, Some(ColdRestartCause::Xid { xid: 79 })),
        "an XID that invalidates the device drops the carried KV"
    );
}

/// The reaper collected `slot`'s engine with `exit` at `at` ms.
fn died(p: &mut Pair, slot: SlotId, exit: Exit, at: u64) -> Vec<Action> {
    p.handle(Event::Exited { slot, exit }, t(at))
}

/// runc reported `slot`'s engine running as `pid`.
fn spawned(p: &mut Pair, slot: SlotId, pid: u32, at: u64) -> Vec<Action> {
    p.handle(Event::Spawned { slot, pid }, t(at))
}

/// `slot`'s engine said `STATUS=parked`.
fn parked(p: &mut Pair, slot: SlotId, at: u64) -> Vec<Action> {
    let notification = Notification::Status("parked".into());
    p.handle(Event::Notified { slot, notification }, t(at))
}

/// The shadow, promoted, finds the committed weights changed and exits
/// with the contract's status: both engines stop and the pair restarts
/// cold (GMS empty, the weights loaded again), counted and named apart.
#[test]
fn a_promoted_engine_finding_corrupt_weights_restarts_the_pair_cold() {
    let mut p = running();
    let a = died(&mut p, SlotId::ZERO, KILL, 1000);
    assert_eq!(a, vec![Action::Spawn { slot: SlotId::ZERO }]);
    p.handle(Event::LockHeld { slot: SlotId::ONE }, t(1001));
    spawned(&mut p, SlotId::ZERO, 200, 1002);
    // Verified before READY=1: it never says it.
    let corrupt = Exit::Code(WEIGHTS_CORRUPT_EXIT);
    let a = died(&mut p, SlotId::ONE, corrupt, 1003);
    assert!(a.contains(&Action::KillAll), "{a:?}");
    assert!(
        !a.iter().any(|a| matches!(a, Action::Spawn { .. })),
        "{a:?}"
    );
    let a = died(&mut p, SlotId::ZERO, KILL, 1004);
    assert_eq!(a, cold_start());
    let snap = p.snapshot();
    assert_eq!(snap.cold_restarts, 1);
    assert_eq!(snap.weights_corrupt, 1);
    assert_eq!(
        snap.last_cold_restart,
        Some(ColdRestartCause::WeightsCorrupt { slot: 1 })
    );
    assert_eq!(snap.slots[1].last_exit, Some(corrupt));
}

/// Any engine that exits with the status counts, a parked shadow too (it
/// may verify what it mapped); any other status of a shadow is a respawn.
#[test]
fn a_shadow_finding_corrupt_weights_restarts_cold_another_status_does_not() {
    let mut p = running();
    let a = died(&mut p, SlotId::ONE, Exit::Code(64), 10);
    assert_eq!(a, vec![Action::Spawn { slot: SlotId::ONE }]);
    spawned(&mut p, SlotId::ONE, 300, 11);
    let a = died(&mut p, SlotId::ONE, Exit::Code(WEIGHTS_CORRUPT_EXIT), 12);
    assert_eq!(a, vec![Action::KillAll]);
    assert_eq!(p.active(), None, "the active is stopped too");
    assert_eq!(p.snapshot().weights_corrupt, 1);
}

#[test]
fn stale_exits_and_events_for_dead_slots_are_ignored() {
    let mut p = running();
    p.handle(
        Event::Exited {
            slot: SlotId::ONE,
            exit: KILL,
        },
        t(10),
    );
    // Slot 1 is spawning again; a duplicate exit for the old engine.
    let before = p.snapshot().slots[1].generation;
    assert!(p
        .handle(
            Event::Exited {
                slot: SlotId::ONE,
                exit: KILL
            },
            t(11)
        )
        .is_empty());
    assert_eq!(p.snapshot().slots[1].generation, before);
    assert!(p
        .handle(Event::LockHeld { slot: SlotId::ONE }, t(12))
        .is_empty());
    assert_eq!(p.active(), Some(SlotId::ZERO));
}

#[test]
fn spawn_failure_counts_as_an_early_death() {
    let mut p = Pair::new(RestartPolicy {
        max_consecutive_failures: 1,
        ..RestartPolicy::default()
    });
    p.start();
    let a = p.handle(Event::SpawnFailed { slot: SlotId::ZERO }, t(0));
    assert_eq!(a, vec![Action::Spawn { slot: SlotId::ZERO }]);
    spawned(&mut p, SlotId::ONE, 5, 1);
    let a = p.handle(Event::SpawnFailed { slot: SlotId::ZERO }, t(2));
    assert_eq!(a, vec![Action::KillAll]);
    let a = p.handle(
        Event::Exited {
            slot: SlotId::ONE,
            exit: KILL,
        },
        t(3),
    );
    assert_eq!(a, vec![Action::Exit { status: 255 }]);
}

#[test]
fn an_oom_killed_active_fails_over_as_out_of_memory_and_is_counted() {
    let mut p = running();
    p.handle(Event::OomKilled { slot: SlotId::ZERO }, t(999));
    let a = p.handle(
        Event::Exited {
            slot: SlotId::ZERO,
            exit: KILL,
        },
        t(1000),
    );
    // Handled as device-preserving: the slot respawns at once.
    assert_eq!(a, vec![Action::Spawn { slot: SlotId::ZERO }]);
    assert_eq!(p.snapshot().oom_kills, 1);
    p.handle(Event::LockHeld { slot: SlotId::ONE }, t(1001));
    let a = p.handle(
        Event::Ready {
            slot: SlotId::ONE,
            holder: LockHolder::Slot(SlotId::ONE),
        },
        t(1010),
    );
    let [Action::Promoted(pr)] = a.as_slice() else {
        panic!("{a:?}")
    };
    assert_eq!(pr.class, FailureClass::OutOfMemory);
    // The mark went with that engine: the next death of the slot is not OOM.
    spawned(&mut p, SlotId::ZERO, 200, 1020);
    p.handle(
        Event::Exited {
            slot: SlotId::ZERO,
            exit: KILL,
        },
        t(1030),
    );
    assert_eq!(p.snapshot().oom_kills, 1);
}

#[test]
fn an_oom_mark_for_a_dead_slot_or_a_bad_device_changes_nothing_else() {
    let mut p = running();
    // A mark for an engine that is not running is dropped.
    p.handle(
        Event::Exited {
            slot: SlotId::ONE,
            exit: KILL,
        },
        t(10),
    );
    p.handle(Event::OomKilled { slot: SlotId::ONE }, t(11));
    spawned(&mut p, SlotId::ONE, 300, 12);
    p.handle(
        Event::Exited {
            slot: SlotId::ONE,
            exit: KILL,
        },
        t(13),
    );
    assert_eq!(p.snapshot().oom_kills, 0);
    // With GMS gone the pair still restarts cold; the OOM is counted.
    let mut p = running();
    p.handle(Event::OomKilled { slot: SlotId::ZERO }, t(20));
    let a = p.handle(
        Event::GmsDied {
            device: "host".into(),
        },
        t(21),
    );
    assert_eq!(a, vec![Action::KillAll]);
    p.handle(
        Event::Exited {
            slot: SlotId::ZERO,
            exit: KILL,
        },
        t(22),
    );
    assert_eq!(p.snapshot().oom_kills, 1);
}

/// Both engines reaped after a `KillAll` of a cold restart.
fn reap_both(p: &mut Pair, at: u64) -> Vec<Action> {
    let mut a = Vec::new();
    for slot in SlotId::BOTH {
        a = p.handle(Event::Exited { slot, exit: KILL }, t(at));
    }
    a
}

/// The spawns of a cold restart reported, so that the next failure has
/// engines to stop.
fn spawned_both(p: &mut Pair, at: u64) {
    for (slot, pid) in [(SlotId::ZERO, 70), (SlotId::ONE, 71)] {
        p.handle(Event::Spawned { slot, pid }, t(at));
    }
}

/// A GMS daemon that will not start again (its socket path taken, its
/// binary gone) must not make the pair restart cold in a tight loop: each
/// failed start counts as an early death, so restarts back off and the
/// pair ends as a crash loop once the budget is spent.
#[test]
fn a_gmsd_that_will_not_start_backs_off_then_ends_the_pair() {
    let policy = RestartPolicy::default();
    let mut p = Pair::new(policy.clone());
    // Engines up, then gmsd dies: the first cold restart is at once.
    let mut p2 = running();
    assert_eq!(
        p2.handle(
            Event::GmsDied {
                device: "host".into()
            },
            t(10)
        ),
        vec![Action::KillAll]
    );
    assert_eq!(reap_both(&mut p2, 11)[0], Action::RestartGms);
    // From here on every restart of gmsd fails.
    let mut now = 100;
    p.start();
    spawned_both(&mut p, now);
    let mut delays = Vec::new();
    for _ in 0..=policy.max_consecutive_failures {
        now += 1;
        assert_eq!(
            p.handle(Event::GmsStartFailed, t(now)),
            vec![Action::KillAll]
        );
        now += 1;
        let a = reap_both(&mut p, now);
        match a.as_slice() {
            [Action::RestartGms, Action::Spawn { .. }, Action::Spawn { .. }] => delays.push(0),
            [Action::RestartGmsAfter { delay }] => {
                delays.push(delay.as_millis() as u64);
                // Nothing happens before the delay is over.
                assert!(p
                    .handle(Event::BackoffElapsed { slot: SlotId::ZERO }, t(now))
                    .is_empty());
                now += delay.as_millis() as u64;
                let a = p.handle(Event::ColdRestartDue, t(now));
                assert_eq!(a[0], Action::RestartGms, "{a:?}");
            }
            [Action::Exit { status }] => {
                assert_eq!(*status, 255);
                break;
            }
            other => panic!("{other:?}"),
        }
        spawned_both(&mut p, now);
    }
    assert_eq!(delays, [0, 200, 400, 800, 1600], "backoff doubles");
    assert!(p.is_ending());
}

/// A cold restart that waits out its backoff ends at once on Stop.
#[test]
fn stop_during_a_cold_restart_backoff_ends_the_pair() {
    let mut p = Pair::new(RestartPolicy::default());
    p.start();
    spawned_both(&mut p, 1);
    p.handle(Event::GmsStartFailed, t(2));
    reap_both(&mut p, 3);
    spawned_both(&mut p, 4);
    p.handle(Event::GmsStartFailed, t(5));
    let a = reap_both(&mut p, 6);
    assert!(
        matches!(a.as_slice(), [Action::RestartGmsAfter { .. }]),
        "{a:?}"
    );
    assert_eq!(
        p.handle(Event::Stop, t(7)),
        vec![Action::Exit { status: 0 }]
    );
    assert!(p.handle(Event::ColdRestartDue, t(300)).is_empty());
}

// The watchdog (issue 22): pings, triggers, WATCHDOG_USEC, and the check.

const WD: Duration = Duration::from_millis(100);

/// [`running`] with a 100 ms watchdog; nothing armed yet.
fn watched() -> Pair {
    let p = started(Pair::new(RestartPolicy::default()).with_watchdog(Some(WD)));
    assert_eq!(p.watchdog(), Some(WD));
    assert_eq!(p.hang_deadline(), None, "nobody pinged");
    p
}

fn say(p: &mut Pair, slot: SlotId, notification: Notification, at: u64) -> Vec<Action> {
    p.handle(Event::Notified { slot, notification }, t(at))
}

fn ping(p: &mut Pair, slot: SlotId, at: u64) -> Vec<Action> {
    say(p, slot, Notification::WatchdogPing, at)
}

fn check(p: &mut Pair, at: u64) -> Vec<Action> {
    p.handle(Event::HangCheck, t(at))
}

#[test]
fn a_watchdog_is_armed_by_the_first_ping_only() {
    let mut p = watched();
    assert!(check(&mut p, 10_000).is_empty(), "unarmed: never expires");
    // The interval an engine sets arms nothing either.
    say(
        &mut p,
        SlotId::ONE,
        Notification::WatchdogUsec(t(10)),
        10_000,
    );
    assert_eq!(p.hang_deadline(), None);
    assert!(check(&mut p, 20_000).is_empty());
    assert!(ping(&mut p, SlotId::ZERO, 20_000).is_empty());
    assert_eq!(p.hang_deadline(), Some(t(20_100)));
    assert_eq!(p.active(), Some(SlotId::ZERO));
}

#[test]
fn a_gap_longer_than_the_interval_ends_the_engine_one_at_it_does_not() {
    let mut p = watched();
    let revision = p.revision();
    ping(&mut p, SlotId::ZERO, 990);
    assert_eq!(
        p.revision(),
        revision + 1,
        "arming is a change (state.json shows it)"
    );
    let armed: Vec<bool> = p
        .snapshot()
        .slots
        .iter()
        .map(|s| s.watchdog_armed)
        .collect();
    assert_eq!(armed, [true, false]);
    ping(&mut p, SlotId::ZERO, 1000);
    assert_eq!(
        p.revision(),
        revision + 1,
        "a ping of an armed watchdog is no observable change"
    );
    assert!(check(&mut p, 1050).is_empty());
    assert!(
        check(&mut p, 1100).is_empty(),
        "a gap of the interval is fine"
    );
    assert_eq!(
        check(&mut p, 1101),
        vec![Action::Kill { slot: SlotId::ZERO }]
    );
    assert_eq!(p.hang_deadline(), None, "ended once, not again");
    assert!(check(&mut p, 5000).is_empty());
    assert!(ping(&mut p, SlotId::ZERO, 5000).is_empty());
    assert_eq!(p.hang_deadline(), None, "a ping from the killed engine");
    // Until its reap, it is what it was: the reap decides its death.
    assert_eq!(p.slot(SlotId::ZERO).state, EngineState::Active);
}

#[test]
fn pings_every_half_interval_keep_an_engine_alive() {
    let mut p = watched();
    for ms in (1000..3000).step_by(10) {
        if ms % 50 == 0 {
            ping(&mut p, SlotId::ZERO, ms);
            ping(&mut p, SlotId::ONE, ms);
        }
        assert!(check(&mut p, ms).is_empty(), "at {ms} ms");
        assert!(p.hang_deadline().is_some_and(|d| d > t(ms)));
    }
    // A ping seen late (out of time order) does not move the clock back.
    ping(&mut p, SlotId::ZERO, 2000);
    assert_eq!(p.hang_deadline(), Some(t(2950 + 100)));
    assert_eq!(p.active(), Some(SlotId::ZERO));
    assert!(p.snapshot().protected);
}

#[test]
fn watchdog_usec_changes_only_that_engines_interval() {
    let mut p = watched();
    ping(&mut p, SlotId::ZERO, 1000);
    ping(&mut p, SlotId::ONE, 1000);
    say(
        &mut p,
        SlotId::ONE,
        Notification::WatchdogUsec(t(500)),
        1000,
    );
    assert_eq!(p.hang_deadline(), Some(t(1100)));
    assert_eq!(
        check(&mut p, 1200),
        vec![Action::Kill { slot: SlotId::ZERO }]
    );
    assert_eq!(p.hang_deadline(), Some(t(1500)));
    assert!(check(&mut p, 1500).is_empty());
    assert_eq!(
        check(&mut p, 1501),
        vec![Action::Kill { slot: SlotId::ONE }]
    );
    // A new interval restarts the timer of an armed watchdog (systemd's
    // reset), shorter or longer.
    let mut p = watched();
    ping(&mut p, SlotId::ZERO, 1000);
    say(
        &mut p,
        SlotId::ZERO,
        Notification::WatchdogUsec(t(30)),
        1090,
    );
    assert_eq!(p.hang_deadline(), Some(t(1120)));
    // An interval past any clock: never expires, never overflows.
    say(
        &mut p,
        SlotId::ZERO,
        Notification::WatchdogUsec(Duration::MAX),
        1100,
    );
    assert_eq!(p.hang_deadline(), None);
    assert!(check(&mut p, u64::MAX).is_empty());
}

#[test]
fn a_trigger_ends_the_engine_at_once_and_a_hung_shadow_is_respawned() {
    let mut p = watched();
    let a = say(&mut p, SlotId::ONE, Notification::WatchdogTrigger, 1000);
    assert_eq!(a, vec![Action::Kill { slot: SlotId::ONE }]);
    assert!(
        say(&mut p, SlotId::ONE, Notification::WatchdogTrigger, 1001).is_empty(),
        "ended once"
    );
    assert_eq!(
        died(&mut p, SlotId::ONE, KILL, 1005),
        vec![Action::Spawn { slot: SlotId::ONE }]
    );
    let snap = p.snapshot();
    assert_eq!(snap.slots[1].last_hang, Some(HangCause::Trigger));
    assert_eq!(snap.slots[1].last_exit, Some(KILL));
    assert_eq!(snap.slots[0].last_hang, None);
    assert_eq!(snap.hangs.total(), 1);
    assert_eq!(snap.failovers, 0);
    assert_eq!(p.active(), Some(SlotId::ZERO), "the active kept serving");
    assert_eq!(p.slot(SlotId::ZERO).state, EngineState::Active);
    spawned(&mut p, SlotId::ONE, 201, 1010);
    parked(&mut p, SlotId::ONE, 1500);
    assert!(p.snapshot().protected);
}

#[test]
fn a_respawned_engine_starts_unarmed() {
    let mut p = watched();
    ping(&mut p, SlotId::ONE, 1000);
    say(&mut p, SlotId::ONE, Notification::WatchdogUsec(t(20)), 1000);
    assert_eq!(
        check(&mut p, 1021),
        vec![Action::Kill { slot: SlotId::ONE }]
    );
    assert_eq!(p.slot(SlotId::ONE).generation, 1);
    assert_eq!(
        died(&mut p, SlotId::ONE, KILL, 1030),
        vec![Action::Spawn { slot: SlotId::ONE }]
    );
    assert_eq!(p.slot(SlotId::ONE).generation, 2);
    spawned(&mut p, SlotId::ONE, 201, 1040);
    parked(&mut p, SlotId::ONE, 1050);
    assert_eq!(p.hang_deadline(), None);
    assert!(check(&mut p, 60_000).is_empty());
    // Armed again, at the pair's interval, not the last engine's own.
    ping(&mut p, SlotId::ONE, 60_000);
    assert_eq!(p.hang_deadline(), Some(t(60_100)));
    // A later death that was no hang clears the slot's cause.
    assert_eq!(p.snapshot().slots[1].last_hang, Some(HangCause::Watchdog));
    died(&mut p, SlotId::ONE, Exit::Code(1), 60_050);
    assert_eq!(p.snapshot().slots[1].last_hang, None);
    assert_eq!(p.snapshot().hangs.total(), 1);
}

#[test]
fn without_a_watchdog_its_messages_change_nothing() {
    for mut p in [
        running(),
        started(Pair::new(RestartPolicy::default()).with_watchdog(None)),
        started(Pair::new(RestartPolicy::default()).with_watchdog(Some(Duration::ZERO))),
    ] {
        assert_eq!(p.watchdog(), None);
        let before = format!("{:?}", p.snapshot());
        let revision = p.revision();
        for n in [
            Notification::WatchdogPing,
            Notification::WatchdogUsec(t(1)),
            Notification::WatchdogTrigger,
        ] {
            for s in SlotId::BOTH {
                assert!(say(&mut p, s, n.clone(), 1000).is_empty());
            }
        }
        assert_eq!(p.hang_deadline(), None);
        assert!(check(&mut p, 100_000).is_empty());
        assert_eq!(format!("{:?}", p.snapshot()), before);
        assert_eq!(p.revision(), revision);
    }
    // Not even the sign that a spawning engine runs.
    let mut p = Pair::new(RestartPolicy::default());
    p.start();
    ping(&mut p, SlotId::ZERO, 1);
    assert_eq!(p.slot(SlotId::ZERO).state, EngineState::Spawning);
    assert!(!p.slot(SlotId::ZERO).speaks_notify);
}

#[test]
fn a_hung_active_fails_over_with_its_cause_in_the_snapshot() {
    let mut p = watched();
    ping(&mut p, SlotId::ZERO, 1000);
    ping(&mut p, SlotId::ONE, 1000);
    ping(&mut p, SlotId::ONE, 1090);
    assert_eq!(
        check(&mut p, 1150),
        vec![Action::Kill { slot: SlotId::ZERO }]
    );
    assert_eq!(p.hang_deadline(), Some(t(1190)), "the shadow's alone");
    assert_eq!(
        p.hang_of(SlotId::ZERO).map(|h| h.cause),
        Some(HangCause::Watchdog)
    );
    p.handle(Event::Killed { slot: SlotId::ZERO }, t(1151));
    p.handle(Event::Killed { slot: SlotId::ZERO }, t(1158));
    // Its death is decided at its reap, as any death of the active.
    assert_eq!(
        died(&mut p, SlotId::ZERO, KILL, 1152),
        vec![Action::Spawn { slot: SlotId::ZERO }]
    );
    assert_eq!(p.active(), None);
    p.handle(Event::LockHeld { slot: SlotId::ONE }, t(1153));
    let a = p.handle(
        Event::Ready {
            slot: SlotId::ONE,
            holder: LockHolder::Slot(SlotId::ONE),
        },
        t(1160),
    );
    let [Action::Promoted(pr)] = a.as_slice() else {
        panic!("{a:?}")
    };
    assert_eq!((pr.from, pr.to), (SlotId::ZERO, Some(SlotId::ONE)));
    assert_eq!(pr.class, FailureClass::Hung);
    assert_eq!(pr.exit, KILL);
    // The timeline: detected → killed → lock taken → ready.
    assert_eq!(
        pr.hang,
        Some(Hang {
            cause: HangCause::Watchdog,
            detected_at: t(1150),
            killed_at: Some(t(1151)),
        })
    );
    assert_eq!((pr.death_at, pr.death_seen), (t(1150), DeathSign::Hang));
    assert_eq!((pr.lock_at, pr.ready_at), (Some(t(1153)), Some(t(1160))));
    assert_eq!(pr.total(), Some(t(10)));
    assert_eq!(p.active(), Some(SlotId::ONE));
    assert_eq!(p.hang_of(SlotId::ZERO), None, "kept until the reap only");
    let snap = p.snapshot();
    assert_eq!(snap.slots[0].last_hang, Some(HangCause::Watchdog));
    assert_eq!(snap.hangs.watchdog, 1);
    assert_eq!(snap.hangs.total(), 1);
    assert_eq!(snap.failovers, 1);
    // The new active is still watched; the respawned slot is not yet.
    spawned(&mut p, SlotId::ZERO, 200, 1170);
    assert_eq!(p.hang_deadline(), Some(t(1190)));
    assert_eq!(
        check(&mut p, 1191),
        vec![Action::Kill { slot: SlotId::ONE }]
    );
}

#[test]
fn a_hung_active_superseded_before_its_reap_is_not_ended_twice() {
    let mut p = watched();
    ping(&mut p, SlotId::ZERO, 1000);
    assert_eq!(
        check(&mut p, 1101),
        vec![Action::Kill { slot: SlotId::ZERO }]
    );
    // The kill releases its flock: the shadow takes the lock first.
    p.handle(Event::LockHeld { slot: SlotId::ONE }, t(1102));
    assert_eq!(p.slot(SlotId::ZERO).state, EngineState::Superseded);
    assert!(check(&mut p, 2000).is_empty());
    p.handle(
        Event::Ready {
            slot: SlotId::ONE,
            holder: LockHolder::Slot(SlotId::ONE),
        },
        t(1105),
    );
    let a = died(&mut p, SlotId::ZERO, KILL, 1110);
    let pr = a
        .iter()
        .find_map(|a| match a {
            Action::Promoted(pr) => Some(pr),
            _ => None,
        })
        .expect("promoted");
    assert_eq!((pr.death_at, pr.death_seen), (t(1101), DeathSign::Hang));
    assert_eq!(pr.class, FailureClass::Hung);
    assert_eq!(
        pr.hang.map(|h| (h.cause, h.killed_at)),
        Some((HangCause::Watchdog, None))
    );
    assert!(a.contains(&Action::Spawn { slot: SlotId::ZERO }), "{a:?}");
    assert_eq!(p.snapshot().slots[0].last_hang, Some(HangCause::Watchdog));
    assert_eq!(p.snapshot().hangs.total(), 1);
}

#[test]
fn a_hung_single_engine_restarts_in_place() {
    let mut p = Pair::single(RestartPolicy::default()).with_watchdog(Some(WD));
    assert!(p.is_single());
    assert_eq!(p.start(), vec![Action::Spawn { slot: SlotId::ZERO }]);
    spawned(&mut p, SlotId::ZERO, 100, 1);
    ping(&mut p, SlotId::ZERO, 2);
    assert_eq!(
        check(&mut p, 103),
        vec![Action::Kill { slot: SlotId::ZERO }]
    );
    let a = died(&mut p, SlotId::ZERO, KILL, 104);
    assert_eq!(a, vec![Action::Spawn { slot: SlotId::ZERO }]);
    assert_eq!(p.snapshot().slots[0].last_hang, Some(HangCause::Watchdog));
}

#[test]
fn a_pair_going_down_ends_nobody_as_hung() {
    let mut p = watched();
    ping(&mut p, SlotId::ZERO, 1000);
    p.handle(Event::Stop, t(1050));
    assert_eq!(p.hang_deadline(), None);
    assert!(check(&mut p, 5000).is_empty());
    assert!(say(&mut p, SlotId::ONE, Notification::WatchdogTrigger, 5000).is_empty());
    died(&mut p, SlotId::ZERO, KILL, 5001);
    assert_eq!(p.snapshot().slots[0].last_hang, None);
    assert_eq!(p.snapshot().hangs.total(), 0);
}

/// [`running`] probed, ended after 2 failures in a row.
fn probed() -> Pair {
    let p = started(Pair::new(RestartPolicy::default()).with_probe(Some(2)));
    assert_eq!(p.probe_target(), Some((SlotId::ZERO, 1)));
    p
}

fn probe(p: &mut Pair, slot: SlotId, generation: u32, healthy: bool, at: u64) -> Vec<Action> {
    p.handle(
        Event::Probed {
            slot,
            generation,
            healthy,
        },
        t(at),
    )
}

#[test]
fn failed_probes_in_a_row_end_the_serving_engine() {
    let mut p = probed();
    assert!(probe(&mut p, SlotId::ZERO, 1, false, 100).is_empty());
    assert!(
        probe(&mut p, SlotId::ZERO, 1, true, 200).is_empty(),
        "reset"
    );
    assert!(probe(&mut p, SlotId::ZERO, 1, false, 300).is_empty());
    // Results for an engine that does not serve count for nothing.
    assert!(probe(&mut p, SlotId::ONE, 1, false, 310).is_empty());
    assert!(probe(&mut p, SlotId::ONE, 1, false, 320).is_empty());
    assert_eq!(
        probe(&mut p, SlotId::ZERO, 1, false, 400),
        vec![Action::Kill { slot: SlotId::ZERO }]
    );
    assert_eq!(p.probe_target(), None, "nobody serves that may be probed");
    assert!(
        probe(&mut p, SlotId::ZERO, 1, false, 500).is_empty(),
        "once"
    );
    p.handle(Event::Killed { slot: SlotId::ZERO }, t(401));
    // The shadow takes over; the dead one's death is a hang by probe.
    p.handle(
        Event::Ready {
            slot: SlotId::ONE,
            holder: LockHolder::Slot(SlotId::ONE),
        },
        t(403),
    );
    let a = died(&mut p, SlotId::ZERO, KILL, 402);
    let pr = a
        .iter()
        .find_map(|a| match a {
            Action::Promoted(pr) => Some(pr.clone()),
            _ => None,
        })
        .expect("promoted");
    assert_eq!(pr.class, FailureClass::Hung);
    assert_eq!(
        pr.hang,
        Some(Hang {
            cause: HangCause::Probe,
            detected_at: t(400),
            killed_at: Some(t(401)),
        })
    );
    assert_eq!(pr.total(), Some(t(3)));
    assert_eq!(p.snapshot().hangs.probe, 1);
    // The new active is probed, from zero failures.
    assert_eq!(p.probe_target(), Some((SlotId::ONE, 1)));
    assert!(probe(&mut p, SlotId::ONE, 1, false, 500).is_empty());
}

#[test]
fn a_probe_of_an_earlier_generation_counts_for_nothing() {
    let mut p = probed();
    assert!(probe(&mut p, SlotId::ZERO, 1, false, 100).is_empty());
    // Slot 0 dies and comes back (generation 2) and serves again.
    died(&mut p, SlotId::ZERO, KILL, 110);
    p.handle(
        Event::Ready {
            slot: SlotId::ONE,
            holder: LockHolder::Slot(SlotId::ONE),
        },
        t(111),
    );
    spawned(&mut p, SlotId::ZERO, 200, 120);
    parked(&mut p, SlotId::ZERO, 121);
    died(&mut p, SlotId::ONE, KILL, 130);
    p.handle(
        Event::Ready {
            slot: SlotId::ZERO,
            holder: LockHolder::Slot(SlotId::ZERO),
        },
        t(131),
    );
    assert_eq!(p.probe_target(), Some((SlotId::ZERO, 2)));
    assert!(probe(&mut p, SlotId::ZERO, 1, false, 140).is_empty());
    assert!(probe(&mut p, SlotId::ZERO, 1, false, 150).is_empty());
    assert!(
        probe(&mut p, SlotId::ZERO, 2, false, 160).is_empty(),
        "its first"
    );
    assert_eq!(
        probe(&mut p, SlotId::ZERO, 2, false, 170),
        vec![Action::Kill { slot: SlotId::ZERO }]
    );
}

#[test]
fn without_a_probe_results_are_ignored() {
    let mut p = running();
    assert_eq!(p.probe_target(), None);
    for at in 0..10 {
        assert!(probe(&mut p, SlotId::ZERO, 1, false, at).is_empty());
    }
    let p = started(Pair::new(RestartPolicy::default()).with_probe(Some(0)));
    assert_eq!(p.probe_target(), None, "0 failures is no probe");
}

const START: Duration = Duration::from_millis(1000);

#[test]
fn an_engine_stuck_starting_is_ended_as_an_early_death() {
    let mut p = Pair::new(RestartPolicy::default()).with_start_timeout(Some(START));
    p.start();
    assert_eq!(p.hang_deadline(), None, "not running yet");
    spawned(&mut p, SlotId::ZERO, 100, 10);
    spawned(&mut p, SlotId::ONE, 101, 20);
    assert_eq!(p.hang_deadline(), Some(t(1010)));
    parked(&mut p, SlotId::ZERO, 500);
    assert_eq!(p.hang_deadline(), Some(t(1020)), "a parked engine started");
    assert!(
        check(&mut p, 1020).is_empty(),
        "at the deadline, not past it"
    );
    assert_eq!(
        check(&mut p, 1021),
        vec![Action::Kill { slot: SlotId::ONE }]
    );
    assert_eq!(p.hang_deadline(), None);
    // An early death: the restart budget's backoff, as for a crash.
    let a = died(&mut p, SlotId::ONE, KILL, 1022);
    assert!(
        matches!(
            a.as_slice(),
            [Action::SpawnAfter {
                slot: SlotId::ONE,
                ..
            }] | [Action::Spawn { slot: SlotId::ONE }]
        ),
        "{a:?}"
    );
    let snap = p.snapshot();
    assert_eq!(snap.slots[1].last_hang, Some(HangCause::StartTimeout));
    assert_eq!(snap.hangs.start_timeout, 1);
    assert_eq!(snap.failovers, 0);
}

#[test]
fn extend_timeout_usec_extends_the_start_as_systemd_does() {
    let mut p = Pair::new(RestartPolicy::default()).with_start_timeout(Some(START));
    p.start();
    spawned(&mut p, SlotId::ZERO, 100, 0);
    let extend = |ms| Notification::ExtendTimeout(t(ms));
    assert!(say(&mut p, SlotId::ZERO, extend(300), 100).is_empty());
    assert_eq!(p.hang_deadline(), Some(START), "never before the timeout");
    say(&mut p, SlotId::ZERO, extend(3000), 900);
    assert_eq!(p.hang_deadline(), Some(t(3900)));
    assert!(check(&mut p, 3000).is_empty());
    say(&mut p, SlotId::ZERO, extend(3000), 3800);
    assert!(check(&mut p, 4000).is_empty());
    assert_eq!(
        check(&mut p, 6801),
        vec![Action::Kill { slot: SlotId::ZERO }]
    );
    // Holding the lock (waking), it is past starting.
    let mut p = Pair::single(RestartPolicy::default()).with_start_timeout(Some(START));
    p.start();
    spawned(&mut p, SlotId::ZERO, 100, 0);
    say(
        &mut p,
        SlotId::ZERO,
        Notification::Status("loading".into()),
        1,
    );
    p.handle(Event::LockHeld { slot: SlotId::ZERO }, t(2));
    assert_eq!(p.hang_deadline(), None);
    assert!(check(&mut p, 10_000).is_empty());
}

#[test]
fn a_paused_pair_judges_nobody_and_its_clocks_go_on_from_the_resume() {
    let mut p = Pair::new(RestartPolicy::default())
        .with_watchdog(Some(WD))
        .with_probe(Some(1))
        .with_start_timeout(Some(START));
    p.start();
    spawned(&mut p, SlotId::ZERO, 100, 0);
    spawned(&mut p, SlotId::ONE, 101, 0);
    parked(&mut p, SlotId::ZERO, 1);
    p.handle(
        Event::Ready {
            slot: SlotId::ZERO,
            holder: LockHolder::Slot(SlotId::ZERO),
        },
        t(2),
    );
    ping(&mut p, SlotId::ZERO, 10);
    p.handle(Event::Paused, t(50));
    assert_eq!(p.hang_deadline(), None);
    assert_eq!(p.probe_target(), None);
    assert!(check(&mut p, 5000).is_empty());
    assert!(probe(&mut p, SlotId::ZERO, 1, false, 5000).is_empty());
    p.handle(Event::Resumed, t(6000));
    // The paused time is taken out: the watchdog keeps its 60 ms left,
    // slot 1's start clock what it had.
    assert_eq!(p.hang_deadline(), Some(t(6060)));
    assert_eq!(
        check(&mut p, 6061),
        vec![Action::Kill { slot: SlotId::ZERO }]
    );
    assert_eq!(p.hang_deadline(), Some(t(1000 + 5950)));
}

const S0: SlotId = SlotId::ZERO;
const S1: SlotId = SlotId::ONE;

#[test]
fn a_stalled_notify_reader_blinds_its_own_engine_only() {
    let mut p = watched();
    ping(&mut p, S0, 1000);
    ping(&mut p, S1, 1000);
    // Slot 1's reader stalls (a flood on its socket): slot 0 is judged on.
    p.handle(Event::NotifyStalled { slot: S1 }, t(1050));
    assert_eq!(p.hang_deadline(), Some(t(1100)), "slot 0's alone");
    assert_eq!(check(&mut p, 1101), vec![Action::Kill { slot: S0 }]);
    // Slot 1 sees again: the 50 ms it had left when it went blind remain.
    p.handle(Event::NotifyResumed { slot: S1 }, t(3000));
    assert_eq!(p.hang_deadline(), Some(t(3050)));
    // A pause and a stall together: blind until both are over.
    let mut p = watched();
    ping(&mut p, S0, 1000);
    p.handle(Event::NotifyStalled { slot: S0 }, t(1050));
    p.handle(Event::Paused, t(1060));
    assert!(check(&mut p, 2000).is_empty());
    p.handle(Event::NotifyResumed { slot: S0 }, t(2000));
    assert_eq!(p.hang_deadline(), None, "still frozen");
    p.handle(Event::Resumed, t(2100));
    // Blind from 1050 to 2100: the 50 ms it had left remain.
    assert_eq!(p.hang_deadline(), Some(t(2150)));
    assert_eq!(check(&mut p, 2151), vec![Action::Kill { slot: S0 }]);
}

/// A reader that stalls every second (say its engine floods and also
/// hangs between floods) cannot keep that engine alive: each second's
/// seeing time counts; and no stall blinds the probe.
#[test]
fn a_stall_each_second_slows_a_watchdog_but_never_stops_it() {
    let mut p = watched();
    ping(&mut p, S0, 1000);
    p.handle(Event::NotifyStalled { slot: S0 }, t(1000));
    let mut ended = None;
    for second in 1..100u64 {
        let start = 1000 + second * 1000;
        // Blind until `start`, then 10 ms of reading, then blind again.
        p.handle(Event::NotifyResumed { slot: S0 }, t(start));
        if check(&mut p, start + 9) == vec![Action::Kill { slot: S0 }] {
            ended = Some(second);
            break;
        }
        p.handle(Event::NotifyStalled { slot: S0 }, t(start + 10));
    }
    assert!(
        ended.is_some_and(|s| s <= 12),
        "ended after {ended:?} seconds"
    );
    let mut p = started(Pair::new(RestartPolicy::default()).with_probe(Some(2)));
    p.handle(Event::NotifyStalled { slot: S0 }, t(10));
    assert!(probe(&mut p, S0, 1, false, 20).is_empty());
    assert_eq!(
        probe(&mut p, S0, 1, false, 30),
        vec![Action::Kill { slot: S0 }]
    );
}

/// A pair with `shadows` shadows, started: slot 0 active, the others
/// parked, every pid known.
fn running_with(shadows: usize) -> Pair {
    let mut p = Pair::with_shadows(RestartPolicy::default(), shadows);
    let ids: Vec<SlotId> = p.slot_ids().collect();
    assert_eq!(ids.len(), shadows + 1);
    let spawns: Vec<Action> = ids.iter().map(|&slot| Action::Spawn { slot }).collect();
    assert_eq!(p.start(), spawns);
    for (&slot, pid) in ids.iter().zip(100..) {
        spawned(&mut p, slot, pid, 1);
        parked(&mut p, slot, 2);
    }
    p.handle(Event::LockHeld { slot: SlotId::ZERO }, t(3));
    ready(&mut p, SlotId::ZERO, 4);
    assert_eq!(p.active(), Some(SlotId::ZERO));
    let snap = p.snapshot();
    assert!(snap.protected);
    assert_eq!((snap.shadows, snap.shadows_parked), (shadows, shadows));
    p
}

fn ready(p: &mut Pair, slot: SlotId, at: u64) -> Vec<Action> {
    p.handle(
        Event::Ready {
            slot,
            holder: LockHolder::Slot(slot),
        },
        t(at),
    )
}

fn slot(n: usize) -> SlotId {
    SlotId::new(n).unwrap()
}

/// With two shadows a second failure within the first one's respawn finds
/// the other shadow: each death is a failover of its own, the pair is
/// protected while a shadow is parked, and every dead slot is started
/// again.
#[test]
fn two_shadows_take_two_failures_before_any_respawn_has_parked() {
    let mut p = running_with(2);
    // The active dies; slot 1 wins the lock.
    assert_eq!(
        died(&mut p, slot(0), KILL, 1000),
        vec![Action::Spawn { slot: slot(0) }]
    );
    assert_eq!(
        p.snapshot().shadows_parked,
        2,
        "neither shadow has been promoted yet"
    );
    assert!(!p.snapshot().protected, "nobody serves");
    p.handle(Event::LockHeld { slot: slot(1) }, t(1001));
    let a = ready(&mut p, slot(1), 1005);
    assert!(
        matches!(a.as_slice(), [Action::Promoted(pr)] if pr.from == slot(0) && pr.to == Some(slot(1)))
    );
    let snap = p.snapshot();
    assert!(snap.protected, "slot 2 is still parked");
    assert_eq!(snap.shadows_parked, 1);
    // 20 ms later, before slot 0 has parked again, the new active dies.
    assert_eq!(
        died(&mut p, slot(1), KILL, 1020),
        vec![Action::Spawn { slot: slot(1) }]
    );
    p.handle(Event::LockHeld { slot: slot(2) }, t(1021));
    let a = ready(&mut p, slot(2), 1025);
    let [Action::Promoted(pr)] = a.as_slice() else {
        panic!("{a:?}")
    };
    assert_eq!((pr.from, pr.to, pr.number), (slot(1), Some(slot(2)), 2));
    assert_eq!(pr.total(), Some(t(5)));
    let snap = p.snapshot();
    assert_eq!(snap.shadows_parked, 0);
    assert!(!snap.protected, "no shadow is parked until a respawn parks");
    // The respawns park: protected again, by two.
    spawned(&mut p, slot(0), 200, 1100);
    parked(&mut p, slot(0), 1200);
    assert!(p.snapshot().protected);
    spawned(&mut p, slot(1), 201, 1100);
    parked(&mut p, slot(1), 1300);
    let snap = p.snapshot();
    assert_eq!((snap.shadows_parked, snap.failovers), (2, 2));
    assert_eq!(
        snap.slots.iter().map(|s| s.generation).collect::<Vec<_>>(),
        vec![2, 2, 1]
    );
}

/// A shadow's death does not touch the active, whichever shadow it is;
/// the pair stays protected by the others.
#[test]
fn a_dead_shadow_of_three_is_respawned_and_the_others_keep_the_pair_protected() {
    let mut p = running_with(3);
    assert_eq!(
        died(&mut p, slot(2), KILL, 500),
        vec![Action::Spawn { slot: slot(2) }]
    );
    let snap = p.snapshot();
    assert_eq!(snap.active, Some(slot(0)));
    assert_eq!(snap.shadows_parked, 2);
    assert!(snap.protected);
    assert_eq!(snap.failovers, 0);
}

/// Three failures in a row, each before the last respawn parked: three
/// failovers, and the pair never waits for a respawn to serve.
#[test]
fn three_shadows_take_three_failures_in_a_row() {
    let mut p = running_with(3);
    let mut active = slot(0);
    for (i, next) in [1, 2, 3].into_iter().enumerate() {
        let at = 1000 + 20 * i as u64;
        assert_eq!(
            died(&mut p, active, KILL, at),
            vec![Action::Spawn { slot: active }]
        );
        p.handle(Event::LockHeld { slot: slot(next) }, t(at + 1));
        let a = ready(&mut p, slot(next), at + 3);
        assert!(
            matches!(a.as_slice(), [Action::Promoted(pr)] if pr.number == i as u64 + 1 && pr.to == Some(slot(next))),
            "{a:?}"
        );
        active = slot(next);
    }
    assert_eq!(p.snapshot().shadows_parked, 0);
    assert_eq!(p.active(), Some(slot(3)));
}

/// The engine that finished cleanly is not started again; the pair ends
/// with 0 only once no engine of any slot is left.
#[test]
fn with_two_shadows_a_clean_finish_ends_the_pair_only_when_all_have_finished() {
    let mut p = running_with(2);
    assert!(died(&mut p, slot(1), Exit::Code(0), 100).is_empty());
    assert!(died(&mut p, slot(2), Exit::Code(0), 101).is_empty());
    let a = died(&mut p, slot(0), Exit::Code(0), 102);
    assert!(a.contains(&Action::Exit { status: 0 }), "{a:?}");
}

#[test]
fn shadows_are_between_one_and_the_maximum() {
    let p = Pair::with_shadows(RestartPolicy::default(), 0);
    assert_eq!(p.slot_ids().count(), 2);
    let p = Pair::with_shadows(RestartPolicy::default(), 99);
    assert_eq!(p.slot_ids().count(), MAX_SHADOWS + 1);
    assert_eq!(p.shadows(), MAX_SHADOWS);
    assert_eq!(SlotId::new(MAX_SHADOWS + 1), None);
    assert_eq!(Pair::single(RestartPolicy::default()).shadows(), 0);
}

/// A second failure inside a failover: the successor serves and dies
/// before the old active is even reaped. Both failovers are recorded,
/// the first at its old active's reap; none is lost.
#[test]
fn a_successor_that_dies_before_the_old_active_is_reaped_loses_no_failover() {
    let mut p = running_with(2);
    // Slot 0 dies; its reap is slow. Slot 1 takes the lock and serves.
    p.handle(Event::LockHeld { slot: slot(1) }, t(1001));
    assert!(
        ready(&mut p, slot(1), 1002).is_empty(),
        "slot 0 not reaped yet"
    );
    assert_eq!(p.active(), Some(slot(1)));
    // Slot 1 dies and is reaped first; slot 2 takes over.
    assert_eq!(
        died(&mut p, slot(1), KILL, 1020),
        vec![Action::Spawn { slot: slot(1) }]
    );
    p.handle(Event::LockHeld { slot: slot(2) }, t(1021));
    let a = ready(&mut p, slot(2), 1022);
    assert!(
        matches!(a.as_slice(), [Action::Promoted(pr)] if pr.from == slot(1) && pr.to == Some(slot(2))),
        "{a:?}"
    );
    // Slot 0's reap at last: the first failover is recorded too.
    let a = died(&mut p, slot(0), KILL, 1100);
    let promoted: Vec<_> = a
        .iter()
        .filter_map(|x| match x {
            Action::Promoted(pr) => Some((pr.from, pr.to, pr.number)),
            _ => None,
        })
        .collect();
    assert_eq!(promoted, vec![(slot(0), Some(slot(1)), 2)], "{a:?}");
    assert!(a.contains(&Action::Spawn { slot: slot(0) }), "{a:?}");
    assert_eq!(p.snapshot().failovers, 2);
}
