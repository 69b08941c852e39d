//! The lease model of docs/gms-protocol.md ("Leases") as a pure state machine: who may hold which
//! lease, what commit does, what a lease's end discards. No sockets here, so
//! every rule is unit-tested exhaustively; the daemon only calls it.
//!
//! - `rw` is exclusive: granted only with no writer and no reader attached,
//!   and only while nothing is committed: once a layout is committed, no
//!   engine may replace it; only the pair's supervisor may `reset` the
//!   daemon (which needs no lease attached), after which the next engine
//!   loads again.
//! - `ro` is shared and needs a committed layout and no writer.
//! - `rw_or_ro` is `ro` when a layout is committed, else `rw`.
//! - a writer that ends before commit has its work discarded; commit turns
//!   the writer into a reader; a committed layout survives zero readers.
//!
//! Requests that cannot be granted now are refused (`lease_busy`), never
//! queued: the connection would otherwise hold a half-granted lease.

use std::collections::BTreeSet;

use gms::protocol::{LeaseKind, Mode};
use gms::{Error, Result};

pub type LeaseId = u64;

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Leases {
    writer: Option<LeaseId>,
    readers: BTreeSet<LeaseId>,
    committed: bool,
    next: LeaseId,
}

/// What ending a lease means for the memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// A writer ended before commit: discard its working layout.
    DiscardWorking,
    /// Nothing to free (a reader, or an unknown id).
    Nothing,
}

impl Leases {
    pub fn writer(&self) -> Option<LeaseId> {
        self.writer
    }

    pub fn readers(&self) -> usize {
        self.readers.len()
    }

    pub fn committed(&self) -> bool {
        self.committed
    }

    pub fn kind(&self, id: LeaseId) -> Option<LeaseKind> {
        if self.writer == Some(id) {
            Some(LeaseKind::Rw)
        } else if self.readers.contains(&id) {
            Some(LeaseKind::Ro)
        } else {
            None
        }
    }

    pub fn acquire(&mut self, mode: Mode) -> Result<(LeaseId, LeaseKind)> {
        let kind = match mode {
            Mode::Rw => LeaseKind::Rw,
            Mode::Ro => LeaseKind::Ro,
            Mode::RwOrRo if self.committed => LeaseKind::Ro,
            Mode::RwOrRo => LeaseKind::Rw,
        };
        if kind == LeaseKind::Rw && self.committed {
            return Err(Error::NotPermitted {
                op: "hello".into(),
                why: "a layout is committed and engines may not replace it; ask for \
                      rw_or_ro or ro (only the pair's supervisor can reset the daemon)"
                    .into(),
            });
        }
        if let Some(w) = self.writer {
            return Err(Error::LeaseBusy(format!(
                "writer lease {w} is held; retry after it commits or ends"
            )));
        }
        match kind {
            LeaseKind::Rw if !self.readers.is_empty() => {
                return Err(Error::LeaseBusy(format!(
                    "{} reader(s) attached; rw is exclusive",
                    self.readers.len()
                )))
            }
            LeaseKind::Ro if !self.committed => {
                return Err(Error::NoLayout(
                    "ro needs a committed layout; use rw or rw_or_ro to load one".into(),
                ))
            }
            _ => {}
        }
        self.next += 1;
        let id = self.next;
        match kind {
            LeaseKind::Rw => self.writer = Some(id),
            LeaseKind::Ro => {
                self.readers.insert(id);
            }
        }
        Ok((id, kind))
    }

    /// The writer commits and continues as a reader.
    pub fn commit(&mut self, id: LeaseId) -> Result<()> {
        if self.writer != Some(id) {
            return Err(Error::NotPermitted {
                op: "commit".into(),
                why: "only the rw lease holder commits".into(),
            });
        }
        self.writer = None;
        self.readers.insert(id);
        self.committed = true;
        Ok(())
    }

    /// The supervisor's reset: forget the committed layout, so that the
    /// next engine loads again. Only with no lease attached: a reader's
    /// mapping must not change under it, and a writer is loading already.
    pub fn reset(&mut self) -> Result<()> {
        if let Some(w) = self.writer {
            return Err(Error::LeaseBusy(format!(
                "writer lease {w} is held; reset needs no lease attached"
            )));
        }
        if !self.readers.is_empty() {
            return Err(Error::LeaseBusy(format!(
                "{} reader(s) attached; reset needs no lease attached",
                self.readers.len()
            )));
        }
        self.committed = false;
        Ok(())
    }

    pub fn release(&mut self, id: LeaseId) -> Ended {
        if self.writer == Some(id) {
            self.writer = None;
            Ended::DiscardWorking
        } else {
            self.readers.remove(&id);
            Ended::Nothing
        }
    }

    /// The invariants every reachable state satisfies.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        if self.writer.is_some() && !self.readers.is_empty() {
            return Err(format!(
                "writer {:?} coexists with readers {:?}",
                self.writer, self.readers
            ));
        }
        if !self.committed && !self.readers.is_empty() {
            return Err("readers attached without a committed layout".into());
        }
        if let Some(w) = self.writer {
            if self.readers.contains(&w) {
                return Err(format!("lease {w} is both writer and reader"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gms::protocol::ErrorCode;

    #[test]
    fn rw_or_ro_picks_rw_then_ro() {
        let mut l = Leases::default();
        let (w, kind) = l.acquire(Mode::RwOrRo).unwrap();
        assert_eq!(kind, LeaseKind::Rw);
        assert_eq!(
            l.acquire(Mode::RwOrRo).unwrap_err().code(),
            ErrorCode::LeaseBusy
        );
        assert_eq!(
            l.acquire(Mode::Ro).unwrap_err().code(),
            ErrorCode::LeaseBusy
        );
        l.commit(w).unwrap();
        assert_eq!(l.kind(w), Some(LeaseKind::Ro));
        assert_eq!(l.acquire(Mode::RwOrRo).unwrap().1, LeaseKind::Ro);
    }

    #[test]
    fn rw_is_refused_after_commit_until_a_reset_with_no_lease() {
        let mut l = Leases::default();
        let (w, _) = l.acquire(Mode::Rw).unwrap();
        l.commit(w).unwrap();
        let (r, _) = l.acquire(Mode::Ro).unwrap();
        assert_eq!(
            l.acquire(Mode::Rw).unwrap_err().code(),
            ErrorCode::NotPermitted
        );
        assert_eq!(l.release(w), Ended::Nothing);
        assert_eq!(l.reset().unwrap_err().code(), ErrorCode::LeaseBusy);
        assert_eq!(l.release(r), Ended::Nothing);
        // Committed state survives zero readers, and no engine may replace
        // it: only a reset (the supervisor's) opens rw again.
        assert!(l.committed());
        assert_eq!(
            l.acquire(Mode::Rw).unwrap_err().code(),
            ErrorCode::NotPermitted
        );
        l.reset().unwrap();
        assert!(!l.committed());
        assert_eq!(l.acquire(Mode::Rw).unwrap().1, LeaseKind::Rw);
    }

    #[test]
    fn rw_after_commit_is_refused_with_or_without_readers() {
        let mut l = Leases::default();
        let (w, _) = l.acquire(Mode::Rw).unwrap();
        l.commit(w).unwrap();
        let err = l.acquire(Mode::Rw).unwrap_err();
        assert_eq!(err.code(), ErrorCode::NotPermitted, "{err}");
        assert_eq!(l.reset().unwrap_err().code(), ErrorCode::LeaseBusy);
        assert_eq!(l.release(w), Ended::Nothing);
        let err = l.acquire(Mode::Rw).unwrap_err();
        assert_eq!(err.code(), ErrorCode::NotPermitted, "{err}");
        assert_eq!(l.acquire(Mode::RwOrRo).unwrap().1, LeaseKind::Ro);
    }

    #[test]
    fn writer_death_before_commit_discards_and_ro_needs_a_layout() {
        let mut l = Leases::default();
        assert_eq!(l.acquire(Mode::Ro).unwrap_err().code(), ErrorCode::NoLayout);
        let (w, _) = l.acquire(Mode::Rw).unwrap();
        assert_eq!(l.release(w), Ended::DiscardWorking);
        assert!(!l.committed());
        assert_eq!(l.acquire(Mode::RwOrRo).unwrap().1, LeaseKind::Rw);
    }

    #[test]
    fn only_the_writer_commits() {
        let mut l = Leases::default();
        let (w, _) = l.acquire(Mode::Rw).unwrap();
        assert!(l.commit(w + 1).is_err());
        l.commit(w).unwrap();
        assert!(l.commit(w).is_err(), "a second commit is refused");
    }

    /// Every sequence of up to 6 operations over a few leases keeps the
    /// invariants, and every grant obeys the rules above.
    #[test]
    fn exhaustive_sequences_keep_invariants() {
        #[derive(Clone, Copy, Debug)]
        enum Op {
            Acquire(Mode),
            Commit(usize),
            Release(usize),
            Reset,
        }
        let mut ops = vec![
            Op::Acquire(Mode::Rw),
            Op::Acquire(Mode::Ro),
            Op::Acquire(Mode::RwOrRo),
            Op::Reset,
        ];
        for i in 0..3 {
            ops.push(Op::Commit(i));
            ops.push(Op::Release(i));
        }
        fn walk(l: &Leases, held: &[LeaseId], ops: &[Op], depth: usize, count: &mut usize) {
            *count += 1;
            if depth == 0 {
                return;
            }
            for op in ops {
                let mut next = l.clone();
                let mut held = held.to_vec();
                match *op {
                    Op::Acquire(mode) => {
                        let before = next.clone();
                        match next.acquire(mode) {
                            Ok((id, kind)) => {
                                assert!(before.writer.is_none(), "grant beside a writer");
                                if kind == LeaseKind::Rw {
                                    assert_eq!(before.readers(), 0, "rw beside readers");
                                    assert!(mode != Mode::Ro);
                                    assert!(!before.committed, "rw over a committed layout");
                                } else {
                                    assert!(before.committed && mode != Mode::Rw);
                                }
                                held.push(id);
                            }
                            Err(_) => assert_eq!(next, before, "a refusal changes nothing"),
                        }
                    }
                    Op::Reset => {
                        let before = next.clone();
                        match next.reset() {
                            Ok(()) => {
                                assert!(before.writer.is_none() && before.readers() == 0);
                                assert!(!next.committed());
                            }
                            Err(_) => assert_eq!(next, before, "a refused reset changes nothing"),
                        }
                    }
                    Op::Commit(i) => {
                        if let Some(&id) = held.get(i) {
                            let was_writer = next.writer == Some(id);
                            assert_eq!(next.commit(id).is_ok(), was_writer);
                        }
                    }
                    Op::Release(i) => {
                        if i < held.len() {
                            let id = held.remove(i);
                            let was_writer = next.writer == Some(id);
                            let ended = next.release(id);
                            assert_eq!(ended == Ended::DiscardWorking, was_writer);
                            assert_eq!(next.kind(id), None);
                        }
                    }
                }
                next.check_invariants().unwrap();
                walk(&next, &held, ops, depth - 1, count);
            }
        }
        let mut count = 0;
        walk(&Leases::default(), &[], &ops, 6, &mut count);
        assert!(count > 100_000, "explored {count} states");
    }
}
