//! What an engine's death means for the pair (docs/pairs.md, "Failure classes").
//!
//! An engine that exited or was killed on a healthy GPU leaves the weights in
//! GMS valid: the shadow takes over and the slot is respawned. An XID of the
//! memory-integrity or reset class, or the death of a GMS daemon, means the
//! shared state cannot be trusted: both engines stop and the pair starts cold.
//! So does an engine that found the committed weights changed (it exits with
//! [`WEIGHTS_CORRUPT_EXIT`]): what every engine maps is wrong, and only a
//! fresh load from the source mends it. An engine the pair ended because
//! it hung ([`HangCause`]) is [`FailureClass::Hung`], handled as
//! device-preserving unless the device says worse.

use serde::Serialize;

// One definition of each, with state.json's spelling: the pair decides
// with the types the file records.
pub use shadow_contract::state::{ColdRestartCause, Exit, FailureClass, Hang, HangCause, Hangs};
pub use shadow_contract::weights::CORRUPT_EXIT as WEIGHTS_CORRUPT_EXIT;

/// The class of an NVIDIA XID for the pair's GPUs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum XidClass {
    /// Scoped to the faulting context (13 graphics engine exception, 31 MMU
    /// fault, 43 reset channel): other contexts and GMS memory are intact.
    DevicePreserving,
    /// Memory integrity (48 DBE, 94/95 contained/uncontained ECC) or the
    /// reset class (32, 79 fallen off the bus, 109, 119 GSP timeout): device
    /// memory, and so every GMS allocation, is suspect.
    DeviceInvalidating,
    /// Anything else: logged, no action of its own.
    Informational,
}

impl XidClass {
    pub fn of(xid: u32) -> XidClass {
        match xid {
            13 | 31 | 43 => XidClass::DevicePreserving,
            48 | 94 | 95 | 32 | 79 | 109 | 119 => XidClass::DeviceInvalidating,
            _ => XidClass::Informational,
        }
    }
}

/// Classifies an engine death. `xids` are the XIDs seen on the pair's GPUs
/// since the engine started; `gms_alive` is false when a GMS daemon of the
/// pair has died. A bad device explains more than an engine's verdict on
/// the weights, so it wins. The restart budget is the policy's business, so
/// this never answers [`FailureClass::CrashLoop`].
pub fn classify(exit: Exit, xids: &[u32], gms_alive: bool) -> FailureClass {
    classify_death(exit, xids, gms_alive, false)
}

/// [`classify`], for an engine the pair ended as hung when `hung`: a bad
/// device still explains more; otherwise the death is [`FailureClass::Hung`]
/// whatever its exit (the kill's, or the engine's own if it beat the kill).
pub fn classify_death(exit: Exit, xids: &[u32], gms_alive: bool, hung: bool) -> FailureClass {
    if !gms_alive
        || xids
            .iter()
            .any(|x| XidClass::of(*x) == XidClass::DeviceInvalidating)
    {
        FailureClass::DeviceInvalidating
    } else if hung {
        FailureClass::Hung
    } else if exit == Exit::Code(WEIGHTS_CORRUPT_EXIT) {
        FailureClass::WeightsCorrupt
    } else {
        FailureClass::DevicePreserving
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xid_table_matches_design() {
        for x in [13, 31, 43] {
            assert_eq!(XidClass::of(x), XidClass::DevicePreserving, "xid {x}");
        }
        for x in [48, 94, 95, 32, 79, 109, 119] {
            assert_eq!(XidClass::of(x), XidClass::DeviceInvalidating, "xid {x}");
        }
        for x in [0, 1, 8, 62, 92, 120] {
            assert_eq!(XidClass::of(x), XidClass::Informational, "xid {x}");
        }
    }

    #[test]
    fn classification() {
        let kill = Exit::Signal(9);
        assert_eq!(classify(kill, &[], true), FailureClass::DevicePreserving);
        assert_eq!(
            classify(Exit::Code(1), &[13, 31], true),
            FailureClass::DevicePreserving
        );
        assert_eq!(classify(kill, &[62], true), FailureClass::DevicePreserving);
        assert_eq!(
            classify(kill, &[13, 79], true),
            FailureClass::DeviceInvalidating
        );
        assert_eq!(
            classify(Exit::Code(0), &[], false),
            FailureClass::DeviceInvalidating
        );
        // The weights' own verdict: only that exit status, and a bad device
        // still explains more.
        let corrupt = Exit::Code(65);
        assert_eq!(classify(corrupt, &[], true), FailureClass::WeightsCorrupt);
        assert_eq!(
            classify(corrupt, &[94], true),
            FailureClass::DeviceInvalidating
        );
        assert_eq!(
            classify(Exit::Code(64), &[], true),
            FailureClass::DevicePreserving
        );
        for c in [
            FailureClass::DeviceInvalidating,
            FailureClass::WeightsCorrupt,
        ] {
            assert!(c.restarts_cold());
        }
        assert!(!FailureClass::OutOfMemory.restarts_cold());
        // A hang: its own class, unless the device is bad.
        assert_eq!(classify_death(kill, &[], true, true), FailureClass::Hung);
        assert_eq!(
            classify_death(corrupt, &[13], true, true),
            FailureClass::Hung
        );
        assert_eq!(
            classify_death(kill, &[79], true, true),
            FailureClass::DeviceInvalidating
        );
        assert_eq!(
            classify_death(kill, &[], false, true),
            FailureClass::DeviceInvalidating
        );
    }
}
