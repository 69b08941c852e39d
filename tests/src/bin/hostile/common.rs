//! What several attacks share: progress lines, the notify socket and the
//! election lock, taken the way a real engine takes them (the contract's
//! environment, no shortcuts).

use shadow_contract::env;
use std::io::Write;

/// Prints `attack=<name> step=<what>` and flushes, for the test to wait on.
pub fn step(attack: &str, what: &str) {
    let mut out = std::io::stdout().lock();
    // A closed stdout must not turn into a panic inside an attack.
    let _ = writeln!(out, "attack={attack} step={what}");
    let _ = out.flush();
}

/// The path of the notify socket the shim gave this engine.
pub fn notify_path() -> Result<String, String> {
    std::env::var(env::NOTIFY_SOCKET).map_err(|_| format!("{} is not set", env::NOTIFY_SOCKET))
}

/// Sends one sd_notify datagram (`payload` as is) to the shim.
pub fn notify(payload: &[u8]) -> Result<(), String> {
    let path = notify_path()?;
    let sock =
        std::os::unix::net::UnixDatagram::unbound().map_err(|e| format!("notify socket: {e}"))?;
    sock.send_to(payload, &path)
        .map_err(|e| format!("send to {path}: {e}"))?;
    Ok(())
}

/// Opens the election lock and blocks in `flock(LOCK_EX)` until it is ours.
pub fn take_lock() -> Result<nix::fcntl::Flock<std::fs::File>, String> {
    let path =
        std::env::var(env::LOCK_PATH).map_err(|_| format!("{} is not set", env::LOCK_PATH))?;
    // Read-only, as the contract says: the lock is bound read-only.
    let file = std::fs::File::open(&path).map_err(|e| format!("open {path}: {e}"))?;
    nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusive)
        .map_err(|(_, e)| format!("flock {path}: {e}"))
}

/// The control arm: a well-formed parked shadow that, once it holds the
/// lock, says READY=1 and sleeps.
pub fn park_forever(_args: &[String]) -> Result<(), String> {
    notify(b"STATUS=parked")?;
    step("park", "parked");
    let _lock = take_lock()?;
    notify(b"READY=1")?;
    step("park", "ready");
    loop {
        std::thread::sleep(std::time::Duration::from_secs(3600));
    }
}
