//! Attacks on the GPU Memory Service (docs/security.md, "Leases and gmsd").
//!
//! `gms-rw-after-commit`: slot 0 is an honest engine (loads or imports
//! seeded weights, checks them, takes the lock, prints
//! `step=serving slot=0 sum=<hex> ok=<bool>`). Slot 1 is the attacker: it
//! waits for a committed layout, says it is parked, then asks gmsd for `rw`
//! in a loop. Readers drop to zero when the active engine dies (a
//! failover); an `rw` granted then would let it commit garbage that the
//! respawned engine imports as its weights. It prints `step=replaced` if
//! that worked, `step=refused` the first time gmsd says no.

use std::path::{Path, PathBuf};
use std::time::Duration;

use ::gms::client::{host_socket, Client};
use ::gms::protocol::{ErrorCode, LeaseKind, Mode};
use shadow_contract::env;

use crate::common::{notify, step, take_lock};

const NAME: &str = "gms-rw-after-commit";
const BYTES: u64 = 1 << 20;
const SEED: u64 = 0x5eed;

fn fill(buf: &mut [u8], seed: u64) {
    let mut x = seed | 1;
    for chunk in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
}

fn sum(buf: &[u8]) -> u64 {
    buf.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3)
    })
}

fn socket() -> Result<PathBuf, String> {
    let dir = std::env::var(env::GMS_SOCKET_DIR)
        .map_err(|_| format!("{} is not set", env::GMS_SOCKET_DIR))?;
    Ok(host_socket(Path::new(&dir)))
}

pub fn rw_after_commit(_args: &[String]) -> Result<(), String> {
    let slot = std::env::var(env::ENGINE_ID).unwrap_or_default();
    let socket = socket()?;
    if slot == "1" {
        attack(&socket)
    } else {
        honest(&socket, &slot)
    }
}

/// The victim: the contract's `rw_or_ro`, weights checked against the seed.
fn honest(socket: &Path, slot: &str) -> Result<(), String> {
    let mut c = Client::connect_wait(socket, Mode::RwOrRo, "honest", Duration::from_secs(20))
        .map_err(|e| format!("connecting to gmsd: {e}"))?;
    let mut expect = vec![0u8; BYTES as usize];
    fill(&mut expect, SEED);
    let (got, _keep): (u64, Box<dyn std::any::Any>) = if c.lease() == LeaseKind::Rw {
        let mut w = c.allocate("weights", BYTES).map_err(|e| e.to_string())?;
        let bytes = w.bytes_mut().ok_or("weights not mapped")?;
        bytes[..expect.len()].copy_from_slice(&expect);
        c.commit(std::slice::from_mut(&mut w))
            .map_err(|e| format!("commit: {e}"))?;
        let got = sum(&w.bytes().ok_or("weights not mapped")?[..expect.len()]);
        (got, Box::new((c, w)))
    } else {
        let imported = c.import().map_err(|e| format!("import: {e}"))?;
        let w = imported.weights.first().ok_or("empty layout")?;
        let bytes = w.bytes().ok_or("weights not mapped")?;
        let got = sum(&bytes[..expect.len().min(bytes.len())]);
        (got, Box::new((c, imported)))
    };
    let ok = got == sum(&expect);
    notify(b"STATUS=parked")?;
    let _lock = take_lock()?;
    notify(b"READY=1")?;
    step(NAME, &format!("serving slot={slot} sum={got:016x} ok={ok}"));
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

/// The attacker: `rw` over and over, from the moment something is committed.
fn attack(socket: &Path) -> Result<(), String> {
    loop {
        match ::gms::client::status(socket) {
            Ok(s) if s.committed.is_some() => break,
            _ => std::thread::sleep(Duration::from_millis(5)),
        }
    }
    notify(b"STATUS=parked")?;
    step(NAME, "parked");
    let mut said_refused = false;
    loop {
        match Client::connect(socket, Mode::Rw, "attacker") {
            Ok(mut c) => {
                let mut w = c.allocate("weights", BYTES).map_err(|e| e.to_string())?;
                w.bytes_mut().ok_or("not mapped")?.fill(0xee);
                c.commit(std::slice::from_mut(&mut w))
                    .map_err(|e| format!("commit: {e}"))?;
                step(NAME, "replaced");
                loop {
                    std::thread::sleep(Duration::from_secs(3600));
                }
            }
            Err(::gms::Error::Remote {
                code: ErrorCode::NotPermitted,
                ..
            }) if !said_refused => {
                said_refused = true;
                step(NAME, "refused");
            }
            Err(_) => {}
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}
