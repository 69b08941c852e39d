//! The name of a slot, `SHADOW_ENGINE_ID` inside its engine: the one word
//! every part of the pair's logic uses (the rules in `pair`, the record of
//! a promotion, the metrics), so it sits below all of them.

use serde::Serialize;

/// Slot `0` or `1`: `SHADOW_ENGINE_ID` inside the engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct SlotId(u8);

impl SlotId {
    pub const ZERO: SlotId = SlotId(0);
    pub const ONE: SlotId = SlotId(1);
    pub const BOTH: [SlotId; 2] = [SlotId::ZERO, SlotId::ONE];

    pub fn index(self) -> usize {
        self.0 as usize
    }

    pub fn other(self) -> SlotId {
        SlotId(1 - self.0)
    }
}

impl std::fmt::Display for SlotId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}
