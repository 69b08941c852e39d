//! What several attacks share: progress lines, the notify socket and the
//! election lock, taken the way a real engine takes them (the contract's
//! environment, no shortcuts).

use shadow_contract::env;
use std::io::Write;
use std::time::Duration;

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

/// The active engine of an attack's pair: does nothing, except, with a
/// watchdog (`WATCHDOG_USEC`), ping every half interval on a non-blocking
/// socket, as a correct engine does; a ping the socket refuses (its queue
/// full) is lost, never waited for.
fn serve_quietly() -> ! {
    let Some(interval) = shadow_engine_kit::watchdog::interval_from_env() else {
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    };
    let sock = std::os::unix::net::UnixDatagram::unbound().ok();
    let path = notify_path().ok();
    loop {
        if let (Some(sock), Some(path)) = (&sock, &path) {
            let _ = sock.set_nonblocking(true);
            let _ = sock.send_to(b"WATCHDOG=1", path);
        }
        std::thread::sleep(interval / 2);
    }
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
        std::thread::sleep(Duration::from_secs(3600));
    }
}

/// Says parked; if the lock is free, serves quietly for ever. Otherwise runs
/// `attack` as the parked shadow, then waits for the lock like a good one.
pub fn as_shadow(name: &str, attack: impl FnOnce() -> Result<(), String>) -> Result<(), String> {
    notify(b"STATUS=parked")?;
    let path = std::env::var(shadow_contract::env::LOCK_PATH)
        .map_err(|_| format!("{} is not set", shadow_contract::env::LOCK_PATH))?;
    // Read-only, as the contract says: the lock is bound read-only.
    let file = std::fs::File::open(&path).map_err(|e| format!("open {path}: {e}"))?;
    match nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock) {
        Ok(lock) => {
            notify(b"READY=1")?;
            step(name, "active");
            let _lock = lock;
            serve_quietly()
        }
        Err((_, nix::errno::Errno::EWOULDBLOCK)) => {}
        Err((_, e)) => return Err(format!("flock {path}: {e}")),
    }
    step(name, "parked");
    // Once per pair: the engine respawned after a failover (the shadow
    // again) only parks. Both engines share the rootfs.
    let marker = format!("/tmp/hostile-{name}.done");
    if std::fs::metadata(&marker).is_err() {
        // Let the shim record the pair as protected first: the test looks
        // for that before it watches the attack.
        std::thread::sleep(Duration::from_secs(1));
        attack()?;
        let _ = std::fs::write(&marker, b"");
        step(name, "attacked");
    }
    let _lock = take_lock()?;
    notify(b"READY=1")?;
    step(name, "ready");
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}
