//! What an engine's death means for the pair (docs/pairs.md, "Failure classes").
//!
//! An engine that exited or was killed on a healthy GPU leaves the weights in
//! GMS valid: the shadow takes over and the slot is respawned. An XID of the
//! memory-integrity or reset class, or the death of a GMS daemon, means the
//! shared state cannot be trusted: both engines stop and the pair starts cold.
//! So does an engine that found the committed weights changed (it exits with
//! [`WEIGHTS_CORRUPT_EXIT`]): what every engine maps is wrong, and only a
//! fresh load from the source mends it.

use serde::Serialize;

pub use shadow_contract::weights::CORRUPT_EXIT as WEIGHTS_CORRUPT_EXIT;

/// How an engine process ended, as the reaper saw it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Exit {
    /// `exit(code)`.
    Code(i32),
    /// Killed by a signal.
    Signal(i32),
}

impl Exit {
    /// The status containerd reports: the code, or 128 + the signal number
    /// (137 for SIGKILL), as a shell and runc-v2 report it.
    pub fn status(self) -> u32 {
        match self {
            Exit::Code(c) => (c & 0xff) as u32,
            Exit::Signal(s) => 128 + (s & 0x7f) as u32,
        }
    }

    /// From a raw `wait` status word.
    pub fn from_wait_status(raw: i32) -> Exit {
        if raw & 0x7f == 0 {
            Exit::Code((raw >> 8) & 0xff)
        } else {
            Exit::Signal(raw & 0x7f)
        }
    }
}

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

/// Why the pair last restarted cold (a device-invalidating failure).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "cause")]
pub enum ColdRestartCause {
    /// The GMS daemon of this device (a GPU UUID, or `host`) died: its
    /// weights are gone.
    GmsDied { device: String },
    /// A device-invalidating XID on one of the pair's GPUs.
    Xid { xid: u32 },
    /// The engine of `slot` exited with [`WEIGHTS_CORRUPT_EXIT`]: it found
    /// the committed weights changed since their digest was recorded.
    WeightsCorrupt { slot: u8 },
}

/// What the supervisor does about a failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureClass {
    /// Promote the shadow, respawn the slot, keep GMS.
    DevicePreserving,
    /// Stop both engines, drop GMS state, restart the pair cold.
    DeviceInvalidating,
    /// The kernel's OOM killer killed a process of the engine (its cgroup
    /// counted an `oom_kill`) on a healthy device: handled as
    /// device-preserving (promote, respawn, keep GMS), and counted apart so
    /// that an operator sees memory limits, not crashes.
    OutOfMemory,
    /// An engine found the committed weights changed (it exited with
    /// [`WEIGHTS_CORRUPT_EXIT`]): stop both engines, drop GMS state,
    /// restart the pair cold, as for [`FailureClass::DeviceInvalidating`],
    /// and counted apart.
    WeightsCorrupt,
    /// The restart budget is spent: stop and report the exit.
    CrashLoop,
}

impl FailureClass {
    /// Whether the shared state is lost: the pair restarts cold.
    pub fn restarts_cold(self) -> bool {
        matches!(
            self,
            FailureClass::DeviceInvalidating | FailureClass::WeightsCorrupt
        )
    }
}

/// Classifies an engine death. `xids` are the XIDs seen on the pair's GPUs
/// since the engine started; `gms_alive` is false when a GMS daemon of the
/// pair has died. A bad device explains more than an engine's verdict on
/// the weights, so it wins. The restart budget is the policy's business, so
/// this never answers [`FailureClass::CrashLoop`].
pub fn classify(exit: Exit, xids: &[u32], gms_alive: bool) -> FailureClass {
    if !gms_alive
        || xids
            .iter()
            .any(|x| XidClass::of(*x) == XidClass::DeviceInvalidating)
    {
        FailureClass::DeviceInvalidating
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
    fn exit_statuses_are_what_a_shell_reports() {
        assert_eq!(Exit::Code(0).status(), 0);
        assert_eq!(Exit::Code(3).status(), 3);
        assert_eq!(Exit::Signal(9).status(), 137);
        assert_eq!(Exit::Signal(15).status(), 143);
        // wait(2) words: exit 3 is 0x0300; SIGKILL is 9; SIGSEGV with core is 0x8b.
        assert_eq!(Exit::from_wait_status(0x0300), Exit::Code(3));
        assert_eq!(Exit::from_wait_status(9), Exit::Signal(9));
        assert_eq!(Exit::from_wait_status(0x8b), Exit::Signal(11));
    }

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
    }
}
