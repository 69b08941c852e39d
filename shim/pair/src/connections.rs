//! Who is handed the pair's connections when the runtime accepts them
//! (`shadow.dev/accept: runtime`): the one place that says it. The shim's
//! connection owner tells [`Connections`] what it saw and what the
//! supervisor told it, and hands each connection to
//! [`Connections::recipient`], never to anyone else.
//!
//! The rules: an engine is handed connections once it is known to hold
//! the election lock, by one of three proofs: its `READY=1` came from a
//! process seen holding the lock through a descriptor of its own (the
//! notify socket's reader looks, on the connection thread, as the
//! datagram arrives), its fetch of the fd store was answered (the fetch
//! is answered for the lock holder only), or the supervisor believed its
//! `READY=1` (believed only from the lock holder). Whichever comes first
//! wins; the failover waits for no other. It is
//! handed nothing once it is known not to serve: it died, its hand-off
//! socket failed, the supervisor has no active engine any more, or the
//! lock was seen held by another slot or by nobody. A respawn of a slot is
//! another engine (another serial): it is handed nothing until it proves
//! itself, and a proof of the engine before it (a fetch answered for an
//! older serial) counts for nothing.

use crate::slot::{SlotId, MAX_SLOTS};
use crate::vocabulary::LockHolder;

/// One engine of a slot: the slot, and the serial of the hand-off ends it
/// was started with (each start of a slot has a new one).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Recipient {
    pub slot: SlotId,
    pub serial: u64,
}

/// What the connection owner saw or was told.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConnEvent {
    /// A new engine of `slot` starts with hand-off ends of `serial`.
    Started { slot: SlotId, serial: u64 },
    /// The engine of `slot` with `serial` was answered its fetch: it held
    /// the lock when it fetched.
    FetchAnswered { slot: SlotId, serial: u64 },
    /// The engine of `slot` with `serial` said `READY=1` from a process
    /// seen holding the lock at that moment.
    ReadyFromHolder { slot: SlotId, serial: u64 },
    /// The supervisor's active engine now (it becomes active when its
    /// `READY=1` is believed): told after each of the supervisor's steps,
    /// and only a change counts. A new active engine serves; none (the
    /// active died) stops the hand-offs to the one that was, unless a
    /// proof made another one serve meanwhile.
    Active(Option<SlotId>),
    /// Who held the election lock at a look at `/proc/locks`.
    LockSeen(LockHolder),
    /// The engine of `slot` was seen not holding the lock (its lock file
    /// closed, and no descriptor of it holds the lock any more).
    LockLost { slot: SlotId },
    /// The engine now in `slot` died (its reap).
    Died { slot: SlotId },
    /// A send to the engine of `slot` with `serial` failed for good.
    Lost { slot: SlotId, serial: u64 },
}

/// Who is handed connections; see the module doc.
#[derive(Debug, Clone)]
pub struct Connections {
    /// Per slot: the serial of its current engine's hand-off ends.
    engines: [Option<u64>; MAX_SLOTS],
    serving: Option<SlotId>,
    /// The supervisor's active engine, as last told.
    active: Option<SlotId>,
}

impl Default for Connections {
    fn default() -> Self {
        Self::new()
    }
}

impl Connections {
    pub fn new() -> Self {
        Connections {
            engines: [None; MAX_SLOTS],
            serving: None,
            active: None,
        }
    }

    /// Whom connections go to now: the serving engine, while it has ends.
    pub fn recipient(&self) -> Option<Recipient> {
        let slot = self.serving?;
        let serial = self.engines.get(slot.index()).copied().flatten()?;
        Some(Recipient { slot, serial })
    }

    /// The engine now running in `slot`, if it was started with ends.
    pub fn engine(&self, slot: SlotId) -> Option<Recipient> {
        let serial = self.engines.get(slot.index()).copied().flatten()?;
        Some(Recipient { slot, serial })
    }

    /// Takes in `event`; whether the recipient changed.
    pub fn handle(&mut self, event: ConnEvent) -> bool {
        let before = self.recipient();
        match event {
            ConnEvent::Started { slot, serial } => {
                if let Some(e) = self.engines.get_mut(slot.index()) {
                    *e = Some(serial);
                }
                if self.serving == Some(slot) {
                    self.serving = None;
                }
            }
            ConnEvent::FetchAnswered { slot, serial }
            | ConnEvent::ReadyFromHolder { slot, serial } => {
                if self.engine(slot).map(|r| r.serial) == Some(serial) {
                    self.serving = Some(slot);
                }
            }
            ConnEvent::Active(now) => {
                let was = std::mem::replace(&mut self.active, now);
                match (was == now, now, was) {
                    (true, _, _) => {}
                    (false, Some(slot), _) => {
                        if self.engine(slot).is_some() {
                            self.serving = Some(slot);
                        }
                    }
                    // A proof since `was` died already moved the
                    // connections on: that proof stays.
                    (false, None, Some(was)) => {
                        if self.serving == Some(was) {
                            self.serving = None;
                        }
                    }
                    (false, None, None) => {}
                }
            }
            ConnEvent::LockSeen(holder) => match holder {
                LockHolder::Slot(s) if Some(s) == self.serving => {}
                LockHolder::Slot(_) | LockHolder::Free => self.serving = None,
                LockHolder::Unknown => {}
            },
            ConnEvent::LockLost { slot } => {
                if self.serving == Some(slot) {
                    self.serving = None;
                }
            }
            ConnEvent::Died { slot } => {
                if let Some(e) = self.engines.get_mut(slot.index()) {
                    *e = None;
                }
                if self.serving == Some(slot) {
                    self.serving = None;
                }
            }
            ConnEvent::Lost { slot, serial } => {
                if self.engine(slot).map(|r| r.serial) == Some(serial) {
                    self.engines[slot.index()] = None;
                    if self.serving == Some(slot) {
                        self.serving = None;
                    }
                }
            }
        }
        self.recipient() != before
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S0: SlotId = SlotId::ZERO;
    const S1: SlotId = SlotId::ONE;

    fn started(c: &mut Connections, slot: SlotId, serial: u64) {
        c.handle(ConnEvent::Started { slot, serial });
    }

    fn pair() -> Connections {
        let mut c = Connections::new();
        started(&mut c, S0, 1);
        started(&mut c, S1, 2);
        c
    }

    #[test]
    fn nobody_is_handed_connections_before_a_proof() {
        let c = pair();
        assert_eq!(c.recipient(), None);
        let mut c = c;
        assert!(!c.handle(ConnEvent::LockSeen(LockHolder::Slot(S0))));
        assert_eq!(c.recipient(), None);
    }

    #[test]
    fn a_fetch_answered_or_a_ready_believed_makes_an_engine_the_recipient() {
        let mut c = pair();
        assert!(c.handle(ConnEvent::FetchAnswered {
            slot: S0,
            serial: 1
        }));
        assert_eq!(
            c.recipient(),
            Some(Recipient {
                slot: S0,
                serial: 1
            })
        );
        // The READY of the same engine later changes nothing.
        assert!(!c.handle(ConnEvent::Active(Some(S0))));

        let mut c = pair();
        assert!(c.handle(ConnEvent::Active(Some(S1))));
        assert_eq!(
            c.recipient(),
            Some(Recipient {
                slot: S1,
                serial: 2
            })
        );
        // Its fetch later changes nothing either.
        assert!(!c.handle(ConnEvent::FetchAnswered {
            slot: S1,
            serial: 2
        }));
    }

    #[test]
    fn a_failover_moves_connections_at_the_first_proof_of_the_new_holder() {
        let mut c = pair();
        c.handle(ConnEvent::Active(Some(S0)));
        // S0 is killed; S1 takes the lock and fetches before the
        // supervisor has even heard of the death.
        assert!(c.handle(ConnEvent::FetchAnswered {
            slot: S1,
            serial: 2
        }));
        assert_eq!(c.recipient().map(|r| r.slot), Some(S1));
        // The death of S0 and the supervisor's active gone, heard late,
        // take nothing from S1.
        assert!(!c.handle(ConnEvent::Died { slot: S0 }));
        assert!(!c.handle(ConnEvent::Active(None)));
        assert!(!c.handle(ConnEvent::Active(Some(S1))));
        assert_eq!(
            c.recipient(),
            Some(Recipient {
                slot: S1,
                serial: 2
            })
        );
    }

    #[test]
    fn a_ready_from_the_holder_moves_connections_before_the_fetch_or_the_supervisor() {
        let mut c = pair();
        c.handle(ConnEvent::Active(Some(S0)));
        // S0 is killed; S1's READY=1 comes from its lock holder, seen by
        // the notify reader before anything else is heard.
        assert!(c.handle(ConnEvent::ReadyFromHolder {
            slot: S1,
            serial: 2
        }));
        assert_eq!(c.recipient().map(|r| r.slot), Some(S1));
        // Its fetch and the supervisor's belief, later, change nothing;
        // neither does the old engine's death heard late.
        assert!(!c.handle(ConnEvent::FetchAnswered {
            slot: S1,
            serial: 2
        }));
        assert!(!c.handle(ConnEvent::Died { slot: S0 }));
        assert!(!c.handle(ConnEvent::Active(None)));
        assert_eq!(c.recipient().map(|r| r.slot), Some(S1));
        // A READY of an engine started before the slot's respawn proves
        // nothing for the respawn.
        c.handle(ConnEvent::Started {
            slot: S0,
            serial: 3,
        });
        assert!(!c.handle(ConnEvent::ReadyFromHolder {
            slot: S0,
            serial: 1
        }));
        assert_eq!(c.recipient().map(|r| r.slot), Some(S1));
    }

    #[test]
    fn a_dead_or_lost_engine_is_handed_nothing_more() {
        let mut c = pair();
        c.handle(ConnEvent::Active(Some(S0)));
        assert!(c.handle(ConnEvent::Died { slot: S0 }));
        assert_eq!(c.recipient(), None);

        let mut c = pair();
        c.handle(ConnEvent::Active(Some(S0)));
        // A stale serial's loss is not this engine's.
        assert!(!c.handle(ConnEvent::Lost {
            slot: S0,
            serial: 7
        }));
        assert!(c.handle(ConnEvent::Lost {
            slot: S0,
            serial: 1
        }));
        assert_eq!(c.recipient(), None);
        // A lost engine's READY proves nothing: it has no ends.
        assert!(!c.handle(ConnEvent::Active(Some(S0))));
        assert_eq!(c.recipient(), None);
    }

    #[test]
    fn the_lock_seen_elsewhere_stops_the_hand_offs() {
        for holder in [LockHolder::Slot(S1), LockHolder::Free] {
            let mut c = pair();
            c.handle(ConnEvent::Active(Some(S0)));
            assert!(c.handle(ConnEvent::LockSeen(holder)), "{holder:?}");
            assert_eq!(c.recipient(), None);
        }
        // An unreadable look, or the serving engine seen holding it, says
        // nothing new.
        let mut c = pair();
        c.handle(ConnEvent::Active(Some(S0)));
        assert!(!c.handle(ConnEvent::LockSeen(LockHolder::Unknown)));
        assert!(!c.handle(ConnEvent::LockSeen(LockHolder::Slot(S0))));
        assert_eq!(c.recipient().map(|r| r.slot), Some(S0));
    }

    #[test]
    fn the_server_seen_without_the_lock_is_handed_nothing_until_proven_again() {
        let mut c = pair();
        c.handle(ConnEvent::Active(Some(S0)));
        assert!(
            !c.handle(ConnEvent::LockLost { slot: S1 }),
            "not the server"
        );
        assert!(c.handle(ConnEvent::LockLost { slot: S0 }));
        assert_eq!(c.recipient(), None);
        // Connections wait for the next proof: the new holder's READY.
        assert!(c.handle(ConnEvent::Active(Some(S1))));
        assert_eq!(
            c.recipient(),
            Some(Recipient {
                slot: S1,
                serial: 2
            })
        );
    }

    #[test]
    fn a_respawn_is_another_engine_that_must_prove_itself() {
        let mut c = pair();
        c.handle(ConnEvent::Active(Some(S0)));
        // Slot 0 respawns (its engine died unseen, say): the new one is
        // handed nothing, and the old one's fetch counts for nothing.
        assert!(c.handle(ConnEvent::Started {
            slot: S0,
            serial: 3
        }));
        assert_eq!(c.recipient(), None);
        assert!(!c.handle(ConnEvent::FetchAnswered {
            slot: S0,
            serial: 1
        }));
        assert_eq!(c.recipient(), None);
        assert!(c.handle(ConnEvent::FetchAnswered {
            slot: S0,
            serial: 3
        }));
        assert_eq!(
            c.recipient(),
            Some(Recipient {
                slot: S0,
                serial: 3
            })
        );
    }

    #[test]
    fn only_a_change_of_the_active_engine_counts() {
        let mut c = pair();
        assert!(c.handle(ConnEvent::Active(Some(S0))));
        // Told again after each step of the supervisor: nothing new.
        assert!(!c.handle(ConnEvent::Active(Some(S0))));
        // Seen without the lock, it is handed nothing, though the
        // supervisor, not knowing yet, still says it is active.
        assert!(c.handle(ConnEvent::LockLost { slot: S0 }));
        assert!(!c.handle(ConnEvent::Active(Some(S0))));
        assert_eq!(c.recipient(), None);
        // Active again after being none: believed again.
        assert!(!c.handle(ConnEvent::Active(None)));
        assert!(c.handle(ConnEvent::Active(Some(S0))));
        assert!(c.handle(ConnEvent::Active(None)));
        assert_eq!(c.recipient(), None);
    }

    #[test]
    fn an_engine_without_ends_is_never_the_recipient() {
        let mut c = Connections::new();
        assert!(!c.handle(ConnEvent::Active(Some(S1))));
        assert!(!c.handle(ConnEvent::FetchAnswered {
            slot: S1,
            serial: 0
        }));
        assert_eq!(c.recipient(), None);
    }
}
