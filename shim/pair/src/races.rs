//! The orders in which the shim can observe one failover, each as a test:
//! READY=1 before the reap, the lock before the reap, the lock seen free,
//! an engine that speaks (or dies) before its spawn is reported, a Kill in
//! the middle of a promotion. Times are the observers' own (the reaper's
//! time for an exit), so an event may be handled after a later one.

use std::time::Duration;

use crate::{
    failure::{Exit, FailureClass},
    notify::Notification,
    pair::{Action, EngineState, Event, LockHolder, LockWatch, Pair, SlotId},
    policy::RestartPolicy,
    promotion::DeathSign,
};

const KILL: Exit = Exit::Signal(9);
const S0: SlotId = SlotId::ZERO;
const S1: SlotId = SlotId::ONE;

fn t(ms: u64) -> Duration {
    Duration::from_millis(ms)
}

fn notified(p: &mut Pair, slot: SlotId, n: Notification, at: u64) -> Vec<Action> {
    p.handle(
        Event::Notified {
            slot,
            notification: n,
        },
        t(at),
    )
}

/// `READY=1` from `slot`, which holds the election lock (as an engine that
/// keeps the contract does when it says so).
fn ready(p: &mut Pair, slot: SlotId, at: u64) -> Vec<Action> {
    p.handle(
        Event::Ready {
            slot,
            holder: LockHolder::Slot(slot),
        },
        t(at),
    )
}

fn parked() -> Notification {
    Notification::Status("parked".into())
}

/// Slot 0 active (READY=1), slot 1 parked, both speaking sd_notify.
fn serving() -> Pair {
    let mut p = Pair::new(RestartPolicy::default());
    p.start();
    p.handle(Event::Spawned { slot: S0, pid: 100 }, t(1));
    p.handle(Event::Spawned { slot: S1, pid: 101 }, t(1));
    notified(&mut p, S0, parked(), 2);
    notified(&mut p, S1, parked(), 2);
    assert!(ready(&mut p, S0, 3).is_empty());
    assert!(p.snapshot().protected);
    p
}

/// Slot 0 active by the lock, slot 1 running; neither speaks sd_notify.
fn serving_by_lock() -> Pair {
    let mut p = Pair::new(RestartPolicy::default());
    p.start();
    p.handle(Event::Spawned { slot: S0, pid: 100 }, t(1));
    p.handle(Event::Spawned { slot: S1, pid: 101 }, t(1));
    assert_eq!(p.lock_watch(), LockWatch::Fast, "nobody serves yet");
    p.handle(Event::LockHeld { slot: S0 }, t(2));
    assert_eq!(p.active(), Some(S0));
    p
}

fn promoted(actions: &[Action]) -> crate::Promotion {
    actions
        .iter()
        .find_map(|a| match a {
            Action::Promoted(p) => Some(p.clone()),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no promotion in {actions:?}"))
}

#[test]
fn ready_before_the_reap_supersedes_the_old_active_and_the_reap_completes_it() {
    let mut p = serving();
    // The kernel dropped slot 0's lock at its death; slot 1 woke and said
    // READY=1 before the shim had the reap in hand.
    assert!(ready(&mut p, S1, 1002).is_empty());
    assert_eq!(p.active(), Some(S1));
    assert_eq!(p.slot(S0).state, EngineState::Superseded);
    assert_eq!(p.representative_pid(), Some(101), "the new active serves");
    assert_eq!(p.snapshot().failovers, 0, "counted once complete");
    assert_eq!(p.snapshot().last_promotion, None, "the reap is still due");
    // The reap, stamped by the reaper before READY=1 was seen.
    let a = p.handle(
        Event::Exited {
            slot: S0,
            exit: KILL,
        },
        t(1000),
    );
    assert!(a.contains(&Action::Spawn { slot: S0 }), "{a:?}");
    let pr = promoted(&a);
    assert_eq!((pr.from, pr.to), (S0, Some(S1)));
    assert_eq!((pr.death_at, pr.death_seen), (t(1000), DeathSign::Reap));
    assert_eq!(pr.reaped_at, t(1000));
    assert_eq!(pr.ready_at, Some(t(1002)));
    assert_eq!(pr.total(), Some(t(2)), "real milliseconds, not 0");
    assert_eq!(pr.class, FailureClass::DevicePreserving);
    assert_eq!(pr.number, 1);
    assert_eq!(p.snapshot().failovers, 1);
    assert_eq!(p.snapshot().last_promotion, Some(pr));
    // The respawned slot parks behind the new active.
    p.handle(Event::Spawned { slot: S0, pid: 200 }, t(1010));
    notified(&mut p, S0, parked(), 1020);
    assert!(p.snapshot().protected);
}

#[test]
fn ready_seen_before_a_later_reap_is_the_death_sign() {
    let mut p = serving();
    ready(&mut p, S1, 1002);
    let pr = promoted(&p.handle(
        Event::Exited {
            slot: S0,
            exit: KILL,
        },
        t(1003),
    ));
    assert_eq!((pr.death_at, pr.death_seen), (t(1002), DeathSign::Ready));
    assert_eq!(pr.reaped_at, t(1003));
    assert_eq!(pr.total(), Some(Duration::ZERO));
}

#[test]
fn reap_before_ready_is_the_plain_order() {
    let mut p = serving();
    let a = p.handle(
        Event::Exited {
            slot: S0,
            exit: KILL,
        },
        t(1000),
    );
    assert_eq!(a, vec![Action::Spawn { slot: S0 }]);
    assert_eq!(p.active(), None);
    let pr = promoted(&ready(&mut p, S1, 1004));
    assert_eq!((pr.death_at, pr.death_seen), (t(1000), DeathSign::Reap));
    assert_eq!(pr.total(), Some(t(4)));
}

#[test]
fn an_engine_that_speaks_before_its_spawn_is_reported_keeps_what_it_said() {
    let mut p = Pair::new(RestartPolicy::default());
    p.start();
    let generation = p.slot(S0).generation;
    // runc has not returned yet; the engine already runs and parks.
    notified(&mut p, S0, parked(), 1);
    p.handle(Event::Spawned { slot: S1, pid: 9 }, t(1));
    ready(&mut p, S1, 1);
    assert_eq!(p.slot(S0).state, EngineState::Parked);
    assert_eq!(p.slot(S0).pid, None);
    assert!(
        !p.snapshot().protected,
        "not before the shadow's pid is known"
    );
    assert!(p.awaits_pid(S0, generation));
    assert!(!p.awaits_pid(S0, generation - 1), "a stale spawn");
    assert!(p
        .handle(Event::Spawned { slot: S0, pid: 7 }, t(2))
        .is_empty());
    assert_eq!(p.slot(S0).state, EngineState::Parked);
    assert_eq!(p.slot(S0).pid, Some(7));
    assert!(p.snapshot().protected);
    assert!(!p.awaits_pid(S0, generation), "reported once");
    // A second report of the same spawn changes nothing.
    p.handle(Event::Spawned { slot: S0, pid: 8 }, t(3));
    assert_eq!(p.slot(S0).pid, Some(7));
}

#[test]
fn a_respawn_that_serves_and_dies_before_its_spawn_is_reported() {
    let mut p = Pair::single(RestartPolicy::default());
    p.start();
    p.handle(Event::Spawned { slot: S0, pid: 7 }, t(0));
    ready(&mut p, S0, 1);
    assert_eq!(
        p.handle(
            Event::Exited {
                slot: S0,
                exit: KILL
            },
            t(100)
        ),
        vec![Action::Spawn { slot: S0 }]
    );
    // The restarted engine says READY=1 before runc returns: the
    // promotion completes without its pid.
    let pr = promoted(&ready(&mut p, S0, 150));
    assert_eq!(pr.total(), Some(t(50)));
    assert_eq!(p.active(), Some(S0));
    assert_eq!(p.representative_pid(), None, "pid still to come");
    // It dies at once; runc reports the pid, then the reaper the exit.
    p.handle(Event::Spawned { slot: S0, pid: 8 }, t(151));
    assert_eq!(p.representative_pid(), Some(8));
    let a = p.handle(
        Event::Exited {
            slot: S0,
            exit: KILL,
        },
        t(152),
    );
    assert_eq!(a, vec![Action::Spawn { slot: S0 }], "a useful life");
    assert_eq!(p.snapshot().failovers, 1, "the second is under way");
}

#[test]
fn the_lock_taken_before_the_reap_promotes_an_engine_without_sd_notify() {
    let mut p = serving_by_lock();
    assert_eq!(p.lock_watch(), LockWatch::Idle);
    assert!(p.handle(Event::LockHeld { slot: S1 }, t(51)).is_empty());
    assert_eq!(p.active(), Some(S1));
    assert_eq!(p.slot(S0).state, EngineState::Superseded);
    let pr = promoted(&p.handle(
        Event::Exited {
            slot: S0,
            exit: KILL,
        },
        t(50),
    ));
    assert_eq!((pr.death_at, pr.death_seen), (t(50), DeathSign::Reap));
    assert_eq!((pr.lock_at, pr.ready_at), (Some(t(51)), None));
    assert_eq!(pr.total(), Some(t(1)));
}

#[test]
fn the_lock_seen_free_dates_the_death_of_an_engine_without_sd_notify() {
    let mut p = serving_by_lock();
    assert!(p.handle(Event::LockFree, t(50)).is_empty());
    assert_eq!(p.active(), None);
    assert_eq!(p.slot(S0).state, EngineState::Superseded);
    assert_eq!(p.lock_watch(), LockWatch::Fast, "who takes it over?");
    assert_eq!(p.representative_pid(), Some(101));
    p.handle(
        Event::Exited {
            slot: S0,
            exit: KILL,
        },
        t(52),
    );
    let pr = promoted(&p.handle(Event::LockHeld { slot: S1 }, t(53)));
    assert_eq!((pr.death_at, pr.death_seen), (t(50), DeathSign::LockFree));
    assert_eq!(pr.total(), Some(t(3)));
    assert_eq!(pr.reaped_at, t(52));
}

#[test]
fn a_free_lock_says_nothing_of_an_engine_that_speaks_sd_notify() {
    let mut p = serving();
    assert!(p.handle(Event::LockFree, t(50)).is_empty());
    assert_eq!(p.active(), Some(S0));
    assert_eq!(p.slot(S0).state, EngineState::Active);
}

#[test]
fn a_kill_during_a_promotion_records_it_and_ends_once() {
    let mut p = serving();
    ready(&mut p, S1, 1002);
    assert_eq!(p.handle(Event::Stop, t(1003)), vec![Action::KillAll]);
    // The old active's reap completes the promotion; no respawn.
    let a = p.handle(
        Event::Exited {
            slot: S0,
            exit: KILL,
        },
        t(1001),
    );
    assert!(matches!(
        a.as_slice(),
        [Action::Promoted(_), Action::KillAll]
    ));
    let a = p.handle(
        Event::Exited {
            slot: S1,
            exit: Exit::Signal(15),
        },
        t(1004),
    );
    assert_eq!(a, vec![Action::Exit { status: 143 }]);
    assert!(p.handle(Event::Stop, t(1005)).is_empty());
}

#[test]
fn a_kill_while_a_respawn_is_in_flight_kills_the_engine_when_it_appears() {
    let mut p = serving();
    p.handle(
        Event::Exited {
            slot: S0,
            exit: KILL,
        },
        t(1000),
    );
    ready(&mut p, S1, 1002);
    assert_eq!(p.handle(Event::Stop, t(1003)), vec![Action::KillAll]);
    assert_eq!(
        p.handle(Event::Spawned { slot: S0, pid: 300 }, t(1004)),
        vec![Action::Kill { slot: S0 }]
    );
    assert_eq!(
        p.handle(
            Event::Exited {
                slot: S0,
                exit: KILL
            },
            t(1005)
        ),
        vec![Action::KillAll]
    );
    let a = p.handle(
        Event::Exited {
            slot: S1,
            exit: Exit::Signal(15),
        },
        t(1006),
    );
    assert_eq!(a, vec![Action::Exit { status: 143 }]);
}

#[test]
fn the_lock_is_watched_only_for_silent_engines_and_only_while_it_matters() {
    let mut p = Pair::new(RestartPolicy::default());
    assert_eq!(p.lock_watch(), LockWatch::Off, "nothing runs");
    p.start();
    assert_eq!(p.lock_watch(), LockWatch::Off, "nothing runs yet");
    p.handle(Event::Spawned { slot: S0, pid: 1 }, t(0));
    assert_eq!(p.lock_watch(), LockWatch::Fast, "a silent engine starts");
    notified(&mut p, S0, parked(), 1);
    assert_eq!(p.lock_watch(), LockWatch::Off, "it speaks sd_notify");
    assert_eq!(serving().lock_watch(), LockWatch::Off);
    let mut p = serving_by_lock();
    assert_eq!(p.lock_watch(), LockWatch::Idle);
    p.handle(Event::Stop, t(10));
    assert_eq!(p.lock_watch(), LockWatch::Off, "going down");
}

#[test]
fn the_revision_moves_only_when_the_pair_changes() {
    let mut p = serving_by_lock();
    let r = p.revision();
    p.handle(Event::LockHeld { slot: S0 }, t(10));
    p.handle(Event::LockHeld { slot: S0 }, t(11));
    assert_eq!(p.revision(), r, "polling the same holder changes nothing");
    notified(&mut p, S1, Notification::Status("loading 40%".into()), 12);
    assert_eq!(p.revision(), r + 1, "the engine speaks sd_notify now");
    notified(&mut p, S1, Notification::Status("loading 50%".into()), 13);
    assert_eq!(p.revision(), r + 1, "status text is not state");
    p.handle(
        Event::Exited {
            slot: S0,
            exit: KILL,
        },
        t(14),
    );
    assert_eq!(p.revision(), r + 2);
}

#[test]
fn the_lock_file_closed_dates_the_death_before_ready_and_reap() {
    // The close handled first (inotify): kept until the failover shows.
    let mut p = serving();
    assert!(p.handle(Event::LockClosed, t(1000)).is_empty());
    assert_eq!(p.active(), Some(S0), "nothing decided on a close alone");
    ready(&mut p, S1, 1003);
    let pr = promoted(&p.handle(
        Event::Exited {
            slot: S0,
            exit: KILL,
        },
        t(1002),
    ));
    assert_eq!((pr.death_at, pr.death_seen), (t(1000), DeathSign::LockFree));
    assert_eq!(pr.total(), Some(t(3)));
    // Handled after READY=1 and the reap: it still dates the death.
    let mut p = serving();
    ready(&mut p, S1, 1003);
    p.handle(Event::LockClosed, t(1000));
    let pr = promoted(&p.handle(
        Event::Exited {
            slot: S0,
            exit: KILL,
        },
        t(1002),
    ));
    assert_eq!((pr.death_at, pr.death_seen), (t(1000), DeathSign::LockFree));
    // Reap first, then READY=1: the close before the reap dates it.
    let mut p = serving();
    p.handle(Event::LockClosed, t(999));
    p.handle(
        Event::Exited {
            slot: S0,
            exit: KILL,
        },
        t(1002),
    );
    let pr = promoted(&ready(&mut p, S1, 1004));
    assert_eq!((pr.death_at, pr.total()), (t(999), Some(t(5))));
}

#[test]
fn a_lock_file_close_that_proves_to_be_anothers_is_dropped() {
    // The parked shadow dies: its close, then its reap.
    let mut p = serving();
    let r = p.revision();
    assert!(p.handle(Event::LockClosed, t(50)).is_empty());
    assert_eq!(p.revision(), r, "a candidate is not state");
    assert_eq!(
        p.handle(
            Event::Exited {
                slot: S1,
                exit: KILL
            },
            t(51)
        ),
        vec![Action::Spawn { slot: S1 }]
    );
    // A new shadow looks at the lock file on its way to parking.
    p.handle(Event::Spawned { slot: S1, pid: 300 }, t(60));
    p.handle(Event::LockClosed, t(70));
    notified(&mut p, S1, parked(), 80);
    // Much later the active dies: dated by its reap, not by those closes.
    p.handle(
        Event::Exited {
            slot: S0,
            exit: KILL,
        },
        t(5000),
    );
    let pr = promoted(&ready(&mut p, S1, 5004));
    assert_eq!((pr.death_at, pr.death_seen), (t(5000), DeathSign::Reap));
    // Before anyone serves, a close says nothing.
    let mut p = Pair::new(RestartPolicy::default());
    p.start();
    p.handle(Event::Spawned { slot: S0, pid: 1 }, t(0));
    p.handle(Event::Spawned { slot: S1, pid: 2 }, t(0));
    p.handle(Event::LockClosed, t(1));
    p.handle(Event::LockHeld { slot: S0 }, t(2));
    p.handle(
        Event::Exited {
            slot: S0,
            exit: KILL,
        },
        t(10),
    );
    let pr = promoted(&p.handle(Event::LockHeld { slot: S1 }, t(12)));
    assert_eq!(pr.death_at, t(10));
}

#[test]
fn a_silent_shadow_waiting_on_the_lock_is_parked_and_the_pair_protected() {
    let mut p = serving_by_lock();
    assert!(!p.snapshot().protected, "slot 1 has said nothing yet");
    // A holder is not a waiter: the active engine stays active.
    assert!(p.handle(Event::LockWaiting { slot: S1 }, t(3)).is_empty());
    assert_eq!(p.slot(S1).state, EngineState::Parked);
    assert_eq!(p.slot(S0).state, EngineState::Active);
    assert!(p.snapshot().protected);
    // The lock keeps being watched: slot 1 still has to be seen taking it.
    assert_eq!(p.lock_watch(), LockWatch::Idle);
}

#[test]
fn a_shadow_that_only_says_ready_is_parked_once_seen_waiting() {
    let mut p = Pair::new(RestartPolicy::default());
    p.start();
    p.handle(Event::Spawned { slot: S0, pid: 100 }, t(1));
    p.handle(Event::Spawned { slot: S1, pid: 101 }, t(1));
    ready(&mut p, S0, 2);
    // Slot 1 speaks (STATUS=loading), never STATUS=parked.
    notified(&mut p, S1, Notification::Status("loading".into()), 2);
    assert_eq!(p.slot(S1).state, EngineState::Starting);
    assert!(!p.snapshot().protected);
    assert_eq!(
        p.lock_watch(),
        LockWatch::Idle,
        "a speaking engine that has not said parked is looked for on the lock"
    );
    p.handle(Event::LockWaiting { slot: S1 }, t(3));
    assert!(p.snapshot().protected);
    assert_eq!(
        p.lock_watch(),
        LockWatch::Off,
        "both have said or shown all"
    );
}

#[test]
fn waiting_never_demotes_or_revives() {
    let mut p = serving();
    p.handle(Event::LockWaiting { slot: S0 }, t(4));
    assert_eq!(p.slot(S0).state, EngineState::Active);
    p.handle(
        Event::Exited {
            slot: S1,
            exit: KILL,
        },
        t(5),
    );
    let before = p.slot(S1).state;
    p.handle(Event::LockWaiting { slot: S1 }, t(6));
    assert_eq!(p.slot(S1).state, before, "a dead slot stays dead");
}

/// A spent window budget stops respawns but never the survivor: it
/// serves unprotected, and the dead slot returns when the window allows.
#[test]
fn a_full_restart_window_leaves_the_survivor_serving() {
    let policy = RestartPolicy {
        max_restarts_in_window: 2,
        window: t(10_000),
        ..RestartPolicy::default()
    };
    let mut p = Pair::new(policy);
    p.start();
    p.handle(Event::Spawned { slot: S0, pid: 100 }, t(1));
    p.handle(Event::Spawned { slot: S1, pid: 101 }, t(1));
    notified(&mut p, S0, parked(), 2);
    notified(&mut p, S1, parked(), 2);
    ready(&mut p, S0, 3);
    let mut pid = 200;
    // Two failovers, each respawning the dead slot at once.
    for (round, at) in [(0u64, 100u64), (1, 200)] {
        let dead = p.active().expect("an active engine");
        let heir = dead.other();
        ready(&mut p, heir, at);
        let a = p.handle(
            Event::Exited {
                slot: dead,
                exit: KILL,
            },
            t(at + 1),
        );
        assert!(
            a.contains(&Action::Spawn { slot: dead }),
            "round {round}: {a:?}"
        );
        p.handle(Event::Spawned { slot: dead, pid }, t(at + 2));
        notified(&mut p, dead, parked(), at + 3);
        pid += 1;
        assert!(p.snapshot().protected, "round {round}");
    }
    // The third death within the window: no respawn now, no exit either.
    let dead = p.active().expect("active");
    let heir = dead.other();
    ready(&mut p, heir, 300);
    let a = p.handle(
        Event::Exited {
            slot: dead,
            exit: KILL,
        },
        t(301),
    );
    assert!(
        !a.iter()
            .any(|x| matches!(x, Action::Exit { .. } | Action::KillAll)),
        "the survivor must not be killed: {a:?}"
    );
    let delay = a
        .iter()
        .find_map(|x| match x {
            Action::SpawnAfter { slot, delay } if *slot == dead => Some(*delay),
            _ => None,
        })
        .unwrap_or_else(|| panic!("the slot comes back later: {a:?}"));
    assert_eq!(
        delay,
        t(10_000 + 101 + 1 - 301),
        "when the first respawn ages out"
    );
    assert_eq!(p.active(), Some(heir));
    assert!(!p.snapshot().protected, "unprotected meanwhile");
    // The window has room again: the slot respawns and parks.
    let a = p.handle(Event::BackoffElapsed { slot: dead }, t(301) + delay);
    assert_eq!(a, vec![Action::Spawn { slot: dead }]);
    p.handle(Event::Spawned { slot: dead, pid }, t(10_500));
    notified(&mut p, dead, parked(), 10_600);
    assert!(p.snapshot().protected);
}

/// With no engine left, a full window ends the pair as before.
#[test]
fn a_full_restart_window_with_no_survivor_ends_the_pair() {
    let policy = RestartPolicy {
        max_restarts_in_window: 1,
        window: t(10_000),
        ..RestartPolicy::default()
    };
    let mut p = Pair::single(policy);
    p.start();
    p.handle(Event::Spawned { slot: S0, pid: 100 }, t(1));
    ready(&mut p, S0, 2);
    let a = p.handle(
        Event::Exited {
            slot: S0,
            exit: KILL,
        },
        t(3),
    );
    assert_eq!(a, vec![Action::Spawn { slot: S0 }]);
    p.handle(Event::Spawned { slot: S0, pid: 101 }, t(4));
    ready(&mut p, S0, 5);
    let a = p.handle(
        Event::Exited {
            slot: S0,
            exit: KILL,
        },
        t(6),
    );
    assert!(
        a.contains(&Action::Exit { status: 137 }),
        "no engine left: the task ends with the last status: {a:?}"
    );
}

/// Restart on failure only: a clean exit is not respawned, and the task
/// ends with 0 once no engine is left (a one-shot command run as a pair).
#[test]
fn clean_exits_are_not_respawned_and_the_last_one_ends_the_task_with_0() {
    let mut p = Pair::new(RestartPolicy::default());
    p.start();
    p.handle(Event::Spawned { slot: S0, pid: 100 }, t(1));
    p.handle(Event::Spawned { slot: S1, pid: 101 }, t(1));
    let a = p.handle(
        Event::Exited {
            slot: S0,
            exit: Exit::Code(0),
        },
        t(2),
    );
    assert!(a.is_empty(), "no respawn, slot 1 still runs: {a:?}");
    assert_eq!(p.slot(S0).state, EngineState::Stopped);
    let a = p.handle(
        Event::Exited {
            slot: S1,
            exit: Exit::Code(0),
        },
        t(3),
    );
    assert_eq!(a, vec![Action::Exit { status: 0 }]);
}

/// A clean exit of the active hands over like any death: the shadow
/// serves on, unprotected, and nothing is respawned.
#[test]
fn a_clean_exit_of_the_active_leaves_the_shadow_serving() {
    let mut p = serving();
    ready(&mut p, S1, 10);
    let a = p.handle(
        Event::Exited {
            slot: S0,
            exit: Exit::Code(0),
        },
        t(11),
    );
    assert!(
        !a.iter().any(|x| matches!(
            x,
            Action::Spawn { .. } | Action::Exit { .. } | Action::KillAll
        )),
        "{a:?}"
    );
    assert_eq!(p.active(), Some(S1));
    assert!(!p.snapshot().protected);
}

/// A parked shadow that says READY=1 without the election lock does not
/// displace the active (docs/security.md, "The notify socket"): refused and
/// counted, whatever `/proc/locks` showed instead of it.
#[test]
fn a_ready_from_a_shadow_without_the_lock_is_refused() {
    let mut p = serving();
    assert!(!p.ready_needs_proof(S0), "the active's word needs no look");
    assert!(p.ready_needs_proof(S1));
    let before = p.revision();
    assert!(notified(&mut p, S1, Notification::Ready, 10).is_empty());
    for holder in [LockHolder::Slot(S0), LockHolder::Free, LockHolder::Unknown] {
        assert!(p
            .handle(Event::Ready { slot: S1, holder }, t(11))
            .is_empty());
    }
    assert_eq!(p.ready_refused(), 4);
    assert_eq!(p.active(), Some(S0));
    assert_eq!(p.slot(S0).state, EngineState::Active);
    assert_eq!(p.slot(S1).state, EngineState::Parked);
    assert_eq!(p.representative_pid(), Some(100), "State's pid stays");
    assert!(p.snapshot().protected);
    assert_eq!(p.revision(), before, "nothing to publish");
    // The active dies; the liar is promoted once it holds the lock.
    p.handle(
        Event::Exited {
            slot: S0,
            exit: KILL,
        },
        t(1000),
    );
    assert!(p.ready_needs_proof(S1));
    assert!(p
        .handle(
            Event::Ready {
                slot: S1,
                holder: LockHolder::Free
            },
            t(1001)
        )
        .is_empty());
    assert_eq!(p.active(), None);
    let pr = promoted(&ready(&mut p, S1, 1002));
    assert_eq!(pr.to, Some(S1));
    assert_eq!(p.representative_pid(), Some(101));
    assert!(!p.ready_needs_proof(S1));
}

/// A shadow the shim saw holding the lock (`LockHeld`) is the active by the
/// kernel's word: its READY=1 needs no second look, as in a failover found
/// through `/proc/locks` first.
#[test]
fn a_ready_from_the_seen_lock_holder_needs_no_look() {
    let mut p = serving();
    p.handle(Event::LockHeld { slot: S1 }, t(1001));
    assert!(!p.ready_needs_proof(S1));
    notified(&mut p, S1, Notification::Ready, 1002);
    assert_eq!(p.active(), Some(S1));
    assert_eq!(p.slot(S1).state, EngineState::Active);
    assert_eq!(p.ready_refused(), 0);
}

/// The first READY=1 of a pair is judged like any other: only the holder
/// becomes active.
#[test]
fn the_first_ready_comes_from_the_holder_too() {
    let mut p = Pair::new(RestartPolicy::default());
    p.start();
    p.handle(Event::Spawned { slot: S0, pid: 100 }, t(1));
    assert!(p.ready_needs_proof(S0) && p.ready_needs_proof(S1));
    notified(&mut p, S0, Notification::Ready, 2);
    assert_eq!((p.active(), p.ready_refused()), (None, 1));
    ready(&mut p, S0, 3);
    assert_eq!(p.active(), Some(S0));
}
