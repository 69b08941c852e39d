//! The name of a slot, `SHADOW_ENGINE_ID` inside its engine: the one word
//! every part of the pair's logic uses (the rules in `pair`, the record of
//! a promotion, the metrics), so it sits below all of them.

use serde::Serialize;

/// Slot `0` … `N` of a pair with N shadows: `SHADOW_ENGINE_ID` inside the
/// engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct SlotId(u8);

/// The most shadows a pair may have (`shadow.dev/shadows`; the contract's
/// number, and why it is what it is, in `shadow_contract::annotations`).
pub const MAX_SHADOWS: usize = shadow_contract::annotations::MAX_SHADOWS as usize;

/// The most slots a pair may have: its active and `MAX_SHADOWS` shadows.
pub const MAX_SLOTS: usize = MAX_SHADOWS + 1;

impl SlotId {
    pub const ZERO: SlotId = SlotId(0);
    pub const ONE: SlotId = SlotId(1);
    pub const BOTH: [SlotId; 2] = [SlotId::ZERO, SlotId::ONE];

    /// Slot `n`, if a pair can have it (`n <= MAX_SHADOWS`).
    pub fn new(n: usize) -> Option<SlotId> {
        (n <= MAX_SHADOWS).then_some(SlotId(n as u8))
    }

    /// The first `count` slots, `0 .. count` (at most `MAX_SHADOWS + 1`).
    pub fn first(count: usize) -> impl Iterator<Item = SlotId> + Clone {
        (0..count.min(MAX_SHADOWS + 1)).map(|n| SlotId(n as u8))
    }

    pub fn index(self) -> usize {
        self.0 as usize
    }

    /// The other slot of a pair of two (one shadow): what the tests of
    /// such pairs speak of. A pair's rules never use it: with more
    /// shadows there is no one other slot.
    pub fn other(self) -> SlotId {
        SlotId(u8::from(self.0 == 0))
    }
}

impl std::fmt::Display for SlotId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}
