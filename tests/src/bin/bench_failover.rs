//! `make bench-failover`: 50+ SIGKILLs of the active engine of a real pair
//! (test engine, host network, GMS off) through a private containerd, and
//! where the time goes. For each failover:
//!
//! - end to end: SIGKILL sent (bench clock) → the shim saw `READY=1`
//!   (`ready_unix_us` in `state.json`);
//! - engine: lock taken → `READY=1` sent, as the engine reports it;
//! - kernel handoff: SIGKILL → lock taken by the shadow;
//! - shim overhead: `READY=1` sent by the engine → seen by the shim (the
//!   only part of the path the shim adds: the kernel hands the lock over
//!   without it);
//! - reap: SIGKILL → the shim reaped the dead engine;
//! - promotion total: what `state.json` (`total_ms`) and `shadowctl` show,
//!   death seen by the shim → `READY=1`; it should match end to end less
//!   the SIGKILL → death seen part, printed last.
//!
//! Prints p50/p99 of each; no figure is asserted.

use clap::Parser;
use shadow_tests::bench::{now_us, pair_bench, pct, profile, signal};
use shadow_tests::pair::{ask, free_port, until};
use std::time::Duration;

#[derive(Parser)]
#[command(
    name = "bench-failover",
    about = "SIGKILLs of a real pair's active engine through a private containerd: kill → READY=1 and where the time goes"
)]
struct Cli {
    /// Failovers to measure.
    #[arg(default_value_t = 60)]
    rounds: usize,
}

fn main() {
    let Cli { rounds } = Cli::parse();
    let profile = profile();
    let (cd, env) = pair_bench(profile);
    let port = free_port();
    let id = "bench";
    let ctr = env
        .run(
            &cd,
            id,
            &[],
            &["--rm", "--net-host"],
            &["/bin/test-engine", "--port", &port.to_string()],
        )
        .expect("ctr run");
    let long = Duration::from_secs(30);
    let step = Duration::from_millis(1);
    let (mut e2e, mut engine_t, mut handoff, mut shim, mut reap) =
        (vec![], vec![], vec![], vec![], vec![]);
    let (mut total, mut death) = (vec![], vec![]);
    let mut signs: std::collections::BTreeMap<&str, usize> = Default::default();
    let mut st = env.wait_protected(&cd, id, long);
    for round in 0..rounds {
        let slot = st.pair.active.expect("active");
        let pid = st.pid_of(slot).expect("pid");
        let killed_at = now_us();
        signal(pid, libc::SIGKILL);
        let a = until("new active answers", long, step, || {
            ask(port).filter(|a| a.slot != slot.to_string())
        });
        st = until("promotion recorded and protected", long, step, || {
            env.state(&cd, id)
                .filter(|v| v.pair.failovers == round as u64 + 1 && v.pair.protected)
        });
        let p = st.promotions.last().expect("promotion");
        let ready_seen = p.ready_unix_us.expect("ready") as f64;
        let reaped = p.reaped_unix_us as f64;
        let k = killed_at as f64;
        e2e.push((ready_seen - k) / 1e3);
        engine_t.push((a.ready_us as f64 - a.lock_us as f64) / 1e3);
        handoff.push((a.lock_us as f64 - k) / 1e3);
        shim.push((ready_seen - a.ready_us as f64) / 1e3);
        reap.push((reaped - k) / 1e3);
        total.push(p.total_ms.unwrap_or(f64::NAN));
        death.push((p.death_unix_us as f64 - k) / 1e3);
        *signs.entry(p.promotion.death_seen.as_str()).or_default() += 1;
        // Let the respawned shadow settle, as between real failures.
        std::thread::sleep(Duration::from_millis(100));
    }
    println!("failovers: {rounds} (shim profile {profile})");
    for (name, v) in [
        ("end to end: SIGKILL → READY seen by shim", &mut e2e),
        ("kernel handoff: SIGKILL → lock taken", &mut handoff),
        ("engine: lock taken → READY sent", &mut engine_t),
        ("shim overhead: READY sent → seen", &mut shim),
        ("reap: SIGKILL → shim reaped", &mut reap),
        ("promotion total (state.json total_ms)", &mut total),
        ("SIGKILL → death seen by shim", &mut death),
    ] {
        println!(
            "  {name:<45} p50 {:>8.3} ms   p99 {:>8.3} ms",
            pct(v, 0.5),
            pct(v, 0.99)
        );
    }
    let signs: Vec<String> = signs.iter().map(|(k, n)| format!("{k} {n}")).collect();
    println!("  death first seen by: {}", signs.join(", "));
    let _ = cd.ctr().run(&["task", "kill", "-s", "SIGKILL", id]);
    let _ = ctr.wait(long);
}
