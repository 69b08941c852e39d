//! The Python module's own tests (`gms/python/tests`, standard library
//! only: no torch, no GPU), run from here so that `cargo test -p gms`, and
//! with it `make test`, runs them too. The Python helpers (the lock,
//! sd_notify, the watchdog's pacing) are the engine contract's side in
//! PyTorch engines, and nothing else would run their tests off a GPU host.

use std::path::Path;
use std::process::Command;

#[test]
fn python_unit_tests_pass() {
    let tests = Path::new(env!("CARGO_MANIFEST_DIR")).join("python/tests");
    let out = Command::new("python3")
        .args(["-m", "unittest", "discover", "-s"])
        .arg(&tests)
        .arg("-t")
        .arg(&tests)
        // No __pycache__ left in the source tree.
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output();
    let out = match out {
        Ok(out) => out,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            // As the shim's notify test: a host without python3 runs no
            // Python engine either.
            eprintln!("python3 not found: gms/python/tests not run");
            return;
        }
        Err(e) => panic!("python3: {e}"),
    };
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "python3 -m unittest: {}\n{stderr}",
        out.status
    );
    // unittest's summary ("Ran N tests"): an empty discovery is a failure.
    let ran = stderr.lines().find_map(|l| {
        l.strip_prefix("Ran ")?
            .split_whitespace()
            .next()?
            .parse::<u32>()
            .ok()
    });
    assert!(ran.is_some_and(|n| n > 0), "no Python test ran:\n{stderr}");
}
