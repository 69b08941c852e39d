//! A parked shadow that claims to serve (docs/security.md, "The notify
//! socket"): it says `READY=1` without holding the election lock, which
//! must not move the pair's active engine (State's pid, `exec`) to it.
//!
//! Runs as both engines of a pair: the engine that gets the lock at once
//! serves quietly (`step=active`). The other says `STATUS=parked`, waits a
//! second (the shim records the pair protected), lies with `READY=1`
//! three times (`step=lied`), then behaves: it blocks on the lock, and once
//! the real active dies and the lock is its own, says `READY=1` again
//! (`step=ready`), so the test can see the failover still work.

use std::time::Duration;

use crate::common::{as_shadow, notify, step};

const NAME: &str = "notify-ready-liar";

pub fn run(_args: &[String]) -> Result<(), String> {
    as_shadow(NAME, || {
        for _ in 0..3 {
            notify(b"READY=1")?;
            std::thread::sleep(Duration::from_millis(50));
        }
        step(NAME, "lied");
        Ok(())
    })
}
