//! The repository's Python unit tests (standard library only: no torch,
//! no GPU), run from here so that `cargo test -p gms`, and with it `make
//! test`, runs them too: the module's own (`gms/python/tests`) and the
//! torch engine's pure parts (`examples/torch-engine/test_*.py`, which
//! import this module). The Python helpers (the lock, sd_notify, the
//! watchdog's pacing) are the engine contract's side in PyTorch engines,
//! and nothing else would run their tests off a GPU host.

use std::path::Path;
use std::process::Command;

#[test]
fn python_unit_tests_pass() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for dir in ["python/tests", "../examples/torch-engine"] {
        let Some(stderr) = unittest(&root.join(dir)) else {
            // As the shim's notify test: a host without python3 runs no
            // Python engine either.
            eprintln!("python3 not found: the Python tests were not run");
            return;
        };
        // unittest's summary ("Ran N tests"): an empty discovery is a failure.
        let ran = stderr.lines().find_map(|l| {
            l.strip_prefix("Ran ")?
                .split_whitespace()
                .next()?
                .parse::<u32>()
                .ok()
        });
        assert!(
            ran.is_some_and(|n| n > 0),
            "{dir}: no Python test ran:\n{stderr}"
        );
    }
}

/// `python3 -m unittest discover` in `dir`: its report, or None without
/// python3. Panics when a test fails.
fn unittest(dir: &Path) -> Option<String> {
    let out = Command::new("python3")
        .args(["-m", "unittest", "discover", "-s"])
        .arg(dir)
        .arg("-t")
        .arg(dir)
        // No __pycache__ left in the source tree.
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output();
    let out = match out {
        Ok(out) => out,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => panic!("python3: {e}"),
    };
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "python3 -m unittest in {}: {}\n{stderr}",
        dir.display(),
        out.status
    );
    Some(stderr)
}
