//! Who is handed the pair's connections when the runtime accepts them
//! (`shadow.dev/accept: runtime`): the one place that says it. The shim's
//! connection owner tells [`Connections`] what it saw and what the
//! supervisor told it, and hands each connection to
//! [`Connections::recipient`], never to anyone else.
//!
//! The rules: an engine is handed connections once it is known to hold
//! the election lock, by one of two proofs: its fetch of the fd store was
//! answered (the fetch is answered for the lock holder only), or the
//! supervisor believed its `READY=1` (believed only from the lock holder).
//! Whichever comes first wins; the failover waits for no other. It is
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
    /// The supervisor believed a `READY=1` of `slot`'s engine: it is the
    /// pair's active engine.
    ReadyBelieved { slot: SlotId },
    /// The supervisor's pair has no active engine any more; `was` was.
    NoActive { was: SlotId },
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
            ConnEvent::FetchAnswered { slot, serial } => {
                if self.engine(slot).map(|r| r.serial) == Some(serial) {
                    self.serving = Some(slot);
                }
            }
            ConnEvent::ReadyBelieved { slot } => {
                if self.engine(slot).is_some() {
                    self.serving = Some(slot);
                }
            }
            ConnEvent::NoActive { was } => {
                // A fetch answered since `was` died already moved the
                // connections on: that proof stays.
                if self.serving == Some(was) {
                    self.serving = None;
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
        assert!(!c.handle(ConnEvent::ReadyBelieved { slot: S0 }));

        let mut c = pair();
        assert!(c.handle(ConnEvent::ReadyBelieved { slot: S1 }));
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
        c.handle(ConnEvent::ReadyBelieved { slot: S0 });
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
        assert!(!c.handle(ConnEvent::NoActive { was: S0 }));
        assert!(!c.handle(ConnEvent::ReadyBelieved { slot: S1 }));
        assert_eq!(
            c.recipient(),
            Some(Recipient {
                slot: S1,
                serial: 2
            })
        );
    }

    #[test]
    fn a_dead_or_lost_engine_is_handed_nothing_more() {
        let mut c = pair();
        c.handle(ConnEvent::ReadyBelieved { slot: S0 });
        assert!(c.handle(ConnEvent::Died { slot: S0 }));
        assert_eq!(c.recipient(), None);

        let mut c = pair();
        c.handle(ConnEvent::ReadyBelieved { slot: S0 });
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
        assert!(!c.handle(ConnEvent::ReadyBelieved { slot: S0 }));
        assert_eq!(c.recipient(), None);
    }

    #[test]
    fn the_lock_seen_elsewhere_stops_the_hand_offs() {
        for holder in [LockHolder::Slot(S1), LockHolder::Free] {
            let mut c = pair();
            c.handle(ConnEvent::ReadyBelieved { slot: S0 });
            assert!(c.handle(ConnEvent::LockSeen(holder)), "{holder:?}");
            assert_eq!(c.recipient(), None);
        }
        // An unreadable look, or the serving engine seen holding it, says
        // nothing new.
        let mut c = pair();
        c.handle(ConnEvent::ReadyBelieved { slot: S0 });
        assert!(!c.handle(ConnEvent::LockSeen(LockHolder::Unknown)));
        assert!(!c.handle(ConnEvent::LockSeen(LockHolder::Slot(S0))));
        assert_eq!(c.recipient().map(|r| r.slot), Some(S0));
    }

    #[test]
    fn the_server_seen_without_the_lock_is_handed_nothing_until_proven_again() {
        let mut c = pair();
        c.handle(ConnEvent::ReadyBelieved { slot: S0 });
        assert!(
            !c.handle(ConnEvent::LockLost { slot: S1 }),
            "not the server"
        );
        assert!(c.handle(ConnEvent::LockLost { slot: S0 }));
        assert_eq!(c.recipient(), None);
        // Connections wait for the next proof: the new holder's READY.
        assert!(c.handle(ConnEvent::ReadyBelieved { slot: S1 }));
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
        c.handle(ConnEvent::ReadyBelieved { slot: S0 });
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
    fn no_active_stops_the_hand_offs_to_the_engine_that_was_active_only() {
        let mut c = pair();
        c.handle(ConnEvent::ReadyBelieved { slot: S0 });
        assert!(!c.handle(ConnEvent::NoActive { was: S1 }));
        assert_eq!(c.recipient().map(|r| r.slot), Some(S0));
        assert!(c.handle(ConnEvent::NoActive { was: S0 }));
        assert_eq!(c.recipient(), None);
    }

    #[test]
    fn an_engine_without_ends_is_never_the_recipient() {
        let mut c = Connections::new();
        assert!(!c.handle(ConnEvent::ReadyBelieved { slot: S1 }));
        assert!(!c.handle(ConnEvent::FetchAnswered {
            slot: S1,
            serial: 0
        }));
        assert_eq!(c.recipient(), None);
    }
}
