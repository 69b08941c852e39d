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

use crate::common::{notify, step, take_lock};

const NAME: &str = "notify-ready-liar";

pub fn run(_args: &[String]) -> Result<(), String> {
    notify(b"STATUS=parked")?;
    let path = std::env::var(shadow_contract::env::LOCK_PATH)
        .map_err(|_| format!("{} is not set", shadow_contract::env::LOCK_PATH))?;
    // Read-only, as the contract says: the lock is bound read-only.
    let file = std::fs::File::open(&path).map_err(|e| format!("open {path}: {e}"))?;
    match nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock) {
        Ok(lock) => {
            notify(b"READY=1")?;
            step(NAME, "active");
            let _lock = lock;
            loop {
                std::thread::sleep(Duration::from_secs(3600));
            }
        }
        Err((_, nix::errno::Errno::EWOULDBLOCK)) => {}
        Err((_, e)) => return Err(format!("flock {path}: {e}")),
    }
    step(NAME, "parked");
    // Once per pair: the engine respawned after the failover only parks.
    // Both engines share the rootfs.
    let marker = format!("/tmp/hostile-{NAME}.done");
    if std::fs::metadata(&marker).is_err() {
        std::thread::sleep(Duration::from_secs(1));
        for _ in 0..3 {
            notify(b"READY=1")?;
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = std::fs::write(&marker, b"");
        step(NAME, "lied");
    }
    let _lock = take_lock()?;
    notify(b"READY=1")?;
    step(NAME, "ready");
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}
