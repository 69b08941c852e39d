//! `weights`: ask gmsd for more memory than the pod may have, then load
//! weights as a writer (or map them as a reader) and park.
//!
//! `weights [--mib N] [--over-mib M]`: first an allocation of M MiB
//! (default 0: skipped), which gmsd must refuse when M is above the pod's
//! memory limit (`step=refused:over` or `step=granted:over`), then N MiB
//! (default 64) of weights, filled and committed by the first engine
//! (`step=committed`), imported by the second (`step=imported`). Then the
//! engine parks as a well-formed shadow, its lease held.

use std::path::PathBuf;
use std::time::Duration;

use gms::client::{host_socket, Client};
use gms::protocol::{LeaseKind, Mode};
use shadow_contract::env;

use crate::common::{park_forever, step};

const NAME: &str = "weights";

pub fn run(args: &[String]) -> Result<(), String> {
    let mut mib: u64 = 64;
    let mut over: u64 = 0;
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let value = it
            .next()
            .ok_or_else(|| format!("{flag} needs a value"))?
            .parse::<u64>()
            .map_err(|e| format!("{flag}: {e}"))?;
        match flag.as_str() {
            "--mib" => mib = value,
            "--over-mib" => over = value,
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    let dir = std::env::var(env::GMS_SOCKET_DIR)
        .map(PathBuf::from)
        .map_err(|_| format!("{} is not set", env::GMS_SOCKET_DIR))?;
    let socket = host_socket(&dir);
    let connect = || {
        Client::connect_wait(&socket, Mode::RwOrRo, NAME, Duration::from_secs(20))
            .map_err(|e| format!("connecting to {}: {e}", socket.display()))
    };
    let mut client = connect()?;
    if over > 0 && client.lease() == LeaseKind::Rw {
        // gmsd answers a refused request and closes the connection (the
        // uncommitted lease with it): connect again for the real weights.
        match client.allocate("over", over << 20) {
            Ok(_) => step(NAME, "granted:over"),
            Err(e) => step(NAME, &format!("refused:over:{e}")),
        }
        drop(client);
        client = connect()?;
    }
    // Held as long as the engine lives (park never returns).
    let mut weights = Vec::new();
    let mut imported = None;
    if client.lease() == LeaseKind::Rw {
        let mut w = client
            .allocate("weights", mib << 20)
            .map_err(|e| format!("allocating {mib} MiB: {e}"))?;
        if let Some(bytes) = w.bytes_mut() {
            bytes.fill(0x5a);
        }
        client
            .commit(std::slice::from_mut(&mut w))
            .map_err(|e| format!("commit: {e}"))?;
        step(NAME, "committed");
        weights.push(w);
    } else {
        imported = Some(client.import().map_err(|e| format!("import: {e}"))?);
        step(NAME, "imported");
    }
    let r = park_forever(&[]);
    drop((weights, imported, client));
    r
}
