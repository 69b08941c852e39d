//! Multi-GPU pairs and engine groups through real containerd and runc, on a
//! machine without GPUs: the GPUs are fake device nodes (major 195) granted
//! with `ctr run --device`, named by a fake driver directory, and each GPU's
//! gmsd serves host memory under that GPU's UUID (tests/src/gpus.rs). What
//! is real: one supervised gmsd per granted GPU, the sockets named after
//! the UUIDs, the engines' weights on every daemon, failover, and the cold
//! restart when one GPU's daemon dies. The engine-group tests run the test
//! engine as a main process with rank processes (`--ranks`).

use shadow_contract::state::{ColdRestartCause, Exit, PairState};
use shadow_tests::gpus::FakeGpus;
use shadow_tests::pair::{ask, children, free_port, until, Answer, PairEnv};
use shadow_tests::{Containerd, Spawned};
use std::path::Path;
use std::time::Duration;

const ENGINE: &str = env!("CARGO_BIN_EXE_test-engine");
const LONG: Duration = Duration::from_secs(30);
const STEP: Duration = Duration::from_millis(5);

fn kill(pid: u32, sig: i32) {
    // SAFETY: kill(2) with a pid read from the pair's state or /proc and a signal number.
    let rc = unsafe { libc::kill(pid as i32, sig) };
    assert_eq!(rc, 0, "kill {pid}: {}", std::io::Error::last_os_error());
}

fn gmsd() -> String {
    let p = Path::new(ENGINE).with_file_name("gmsd");
    assert!(p.is_file(), "{} missing: cargo build -p gmsd", p.display());
    p.display().to_string()
}

fn active_pid(st: &PairState) -> u32 {
    st.active_pid().expect("active pid")
}

/// Runs the test engine as a pair with `flags` and `engine_args`.
fn run(
    cd: &Containerd,
    id: &str,
    cfg: &str,
    flags: &[String],
    engine_args: &[&str],
) -> (PairEnv, u16, Spawned) {
    PairEnv::install_engine(cd, Path::new(ENGINE)).expect("install engine");
    let env = PairEnv::new(cd, &format!("gmsd = \"{}\"\n{cfg}", gmsd())).expect("config");
    let port = free_port();
    let port_s = port.to_string();
    let mut cmd = vec!["/bin/test-engine", "--port", &port_s];
    cmd.extend_from_slice(engine_args);
    let mut all: Vec<&str> = vec!["--rm", "--net-host"];
    all.extend(flags.iter().map(String::as_str));
    let ctr = env.run(cd, id, &[], &all, &cmd).expect("ctr run");
    (env, port, ctr)
}

fn answer(port: u16) -> Answer {
    until("an answer", LONG, STEP, || ask(port))
}

fn stop(cd: &Containerd, env: &PairEnv, id: &str, ctr: Spawned) {
    env.stop(cd, id, "SIGKILL", ctr, LONG);
}

/// GPU sockets are long (`gms-GPU-<uuid>.sock`): a short namespace keeps
/// them within `sun_path` under the test's temp dir.
fn short_ns(tag: &str) -> Containerd {
    Containerd::builder()
        .namespace(format!("{tag}{}", std::process::id()))
        .start()
        .expect("containerd")
}

#[test]
fn two_gpu_pair_gmsd_per_gpu() {
    let cd = short_ns("g2-");
    let gpus = FakeGpus::new(&cd, 2).expect("fake GPUs");
    let id = "gpus2";
    let (env, port, ctr) = run(&cd, id, &gpus.config(), &gpus.grant(&[0, 1]), &[]);
    env.wait_protected(&cd, id, LONG);

    // One daemon per granted GPU, each socket named after its GPU.
    let st = until("both daemons reported", LONG, STEP, || {
        env.state(&cd, id).filter(|s| s.gms_daemons.len() == 2)
    });
    let devices: Vec<_> = st.gms_daemons.iter().map(|g| g.device.clone()).collect();
    assert_eq!(devices, gpus.uuids);
    let first = answer(port);
    assert_eq!(
        first.gms,
        format!("{},{}", gpus.socket_name(0), gpus.socket_name(1)),
        "the engine's weights are on both GPUs' daemons"
    );

    // SIGKILL of the active: the shadow (a reader on both daemons) serves
    // the same weights.
    kill(active_pid(&st), libc::SIGKILL);
    let st = until("failover", LONG, STEP, || {
        env.state(&cd, id)
            .filter(|s| s.pair.failovers == 1 && s.pair.protected)
    });
    assert_eq!(st.pair.cold_restarts, 0);
    let after = answer(port);
    assert_eq!(after.weights, first.weights);
    assert_ne!(after.boot, first.boot, "another engine answers");

    // SIGKILL of GPU 1's gmsd: that GPU's weights are gone, so the pair
    // restarts cold, and says which GPU it was.
    let gmsd1 = st.gms_daemons[1].pid;
    kill(gmsd1, libc::SIGKILL);
    let st = until("a cold restart naming GPU 1", LONG, STEP, || {
        env.state(&cd, id).filter(|s| {
            s.pair.cold_restarts == 1
                && s.pair.protected
                && s.gms_daemons.len() == 2
                && s.gms_daemons.iter().all(|g| g.pid != gmsd1)
        })
    });
    assert_eq!(
        st.pair.last_cold_restart,
        Some(ColdRestartCause::GmsDied {
            device: gpus.uuids[1].clone()
        })
    );
    assert_eq!(st.pair.gms_deaths.get(&gpus.uuids[1]), Some(&1));
    assert_eq!(st.pair.gms_deaths.get(&gpus.uuids[0]), None);
    let metrics = env.metrics_file(&cd, id);
    let text = std::fs::read_to_string(&metrics).expect("metrics file");
    assert!(
        text.lines()
            .any(|l| l.starts_with("shadow_gms_deaths_total{")
                && l.contains(&format!("device=\"{}\"", gpus.uuids[1]))
                && l.ends_with(" 1")),
        "{text}"
    );
    let cold = answer(port);
    assert_eq!(cold.weights, first.weights, "the same weights, reloaded");
    stop(&cd, &env, id, ctr);
}

#[test]
fn a_dead_rank_ends_its_engine_and_the_pair_fails_over() {
    let cd = Containerd::start().expect("containerd");
    let id = "ranks";
    let (env, port, ctr) = run(&cd, id, "gms = \"off\"", &[], &["--ranks", "3"]);
    let st = env.wait_protected(&cd, id, LONG);
    let first = answer(port);
    assert_eq!(first.ranks, 3);
    let main = active_pid(&st);
    let ranks = until("the active's two ranks", LONG, STEP, || {
        Some(children(main)).filter(|c| c.len() == 2)
    });

    // SIGKILL of one rank (not the main process): the main process ends the
    // group and exits non-zero; the shadow group takes over.
    kill(ranks[1], libc::SIGKILL);
    let st = until("failover after a rank's death", LONG, STEP, || {
        env.state(&cd, id)
            .filter(|s| s.pair.failovers == 1 && s.pair.protected)
    });
    let promotion = st.pair.last_promotion.clone().expect("promotion");
    assert_eq!(promotion.exit, Exit::Code(1), "the main process exits 1");
    until("the other rank is gone too", LONG, STEP, || {
        Some(()).filter(|_| !Path::new(&format!("/proc/{}", ranks[0])).exists())
    });
    let after = answer(port);
    assert_ne!(after.boot, first.boot, "the shadow group answers");
    assert_eq!(after.ranks, 3);
    stop(&cd, &env, id, ctr);
}

#[test]
fn a_gpu_pair_whose_sockets_cannot_fit_sun_path_is_refused_with_the_reason() {
    // The default namespace is long (the test's name): under the test's
    // temp dir, `.../pairs/<namespace>/<id>/gms/gms-GPU-<uuid>.sock` is
    // longer than a Unix socket path may be.
    let cd = Containerd::start().expect("containerd");
    assert!(cd.namespace().len() > 40, "{}", cd.namespace());
    let gpus = FakeGpus::new(&cd, 1).expect("fake GPUs");
    let id = "longpath";
    let (env, _port, ctr) = run(&cd, id, &gpus.config(), &gpus.grant(&[0]), &[]);
    let out = ctr.wait(LONG).expect("ctr run ends");
    assert_ne!(out.code(), 0, "{out}");
    let text = out.to_string();
    assert!(
        text.contains("Unix socket") && text.contains("pair.state_dir"),
        "Create says why and what to change: {text}"
    );
    assert!(!env.pair_dir(&cd, id).exists(), "pair dir left");
    cd.assert_no_leftovers();
}
