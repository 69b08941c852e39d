//! `containerd-shim-shadow-v1 -info`, run exactly as containerd 2.x runs it
//! (core/runtime/v2/task_manager.go, `getRuntimeInfo`): the flag alone, no
//! containerd address, id or namespace in the environment or the command
//! line, the serialized runtime options (or nothing) on stdin, and a binary
//! `containerd.types.RuntimeInfo` expected on stdout with exit status 0.
//! containerd 1.6 never runs it, so the answer is decoded here; with a
//! containerd 2.x first on `PATH` the test also asks containerd itself.

use containerd_shim_protos::protobuf::{well_known_types::any::Any, CodedOutputStream, Message};
use containerd_shim_protos::types::introspection::RuntimeInfo;
use shadow_tests::{shim_path, Containerd, Runtime};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn runc_path() -> PathBuf {
    let out = Command::new("sh")
        .args(["-c", "command -v runc"])
        .output()
        .expect("sh");
    let p = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(!p.is_empty(), "runc not on PATH (make deps installs it)");
    PathBuf::from(p)
}

/// `runtimeoptions.v1.Options{type_url, config_path}` in an `Any`, as CRI
/// sends it for a runtime entry with `ConfigPath`.
fn runtimeoptions(config_path: &Path) -> Any {
    let mut value = Vec::new();
    {
        let mut os = CodedOutputStream::vec(&mut value);
        os.write_string(1, "io.containerd.shadow.v1.Config")
            .expect("encode");
        os.write_string(2, &config_path.display().to_string())
            .expect("encode");
        os.flush().expect("encode");
    }
    Any {
        type_url: "runtimeoptions.v1.Options".into(),
        value,
        ..Default::default()
    }
}

/// Run `-info` as containerd does: a clean environment (containerd's own
/// has no `TTRPC_ADDRESS` for this command), `stdin` piped in.
fn run_info(stdin: &[u8], env: &[(&str, &str)]) -> std::process::Output {
    let shim = shim_path("debug").expect("shim built");
    let mut cmd = Command::new(shim);
    cmd.arg("-info")
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("spawn the shim");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(stdin)
        .expect("write options");
    child.wait_with_output().expect("wait for the shim")
}

fn runc_features(runc: &Path) -> serde_json::Value {
    let out = Command::new(runc)
        .arg("features")
        .output()
        .expect("runc features");
    assert!(out.status.success(), "runc features: {out:?}");
    serde_json::from_slice(&out.stdout).expect("runc features prints JSON")
}

fn decode(out: &std::process::Output) -> RuntimeInfo {
    assert!(
        out.status.success(),
        "-info failed: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    RuntimeInfo::parse_from_bytes(&out.stdout).expect("stdout is one RuntimeInfo")
}

#[test]
fn info_answers_as_runc_v2_with_the_configured_runcs_features() {
    let dir = tempfile::tempdir().expect("tempdir");
    let runc = runc_path();
    let config = dir.path().join("shadow.toml");
    std::fs::write(
        &config,
        format!("[runc]\nbinary = {:?}\n", runc.display().to_string()),
    )
    .expect("write config");

    // What CRI sends: the runtime entry's options.
    let options = runtimeoptions(&config);
    let out = run_info(&options.write_to_bytes().expect("encode"), &[]);
    let info = decode(&out);
    assert_eq!(info.name, Runtime::Shadow.runtime_type());
    assert!(!info.version.version.is_empty(), "{info:?}");
    assert_eq!(*info.options, options, "the options come back as given");
    assert_eq!(
        info.features.type_url,
        "types.containerd.io/opencontainers/runtime-spec/1/features/Features"
    );
    let features: serde_json::Value =
        serde_json::from_slice(&info.features.value).expect("features are JSON");
    assert_eq!(
        features,
        runc_features(&runc),
        "the features are runc's own"
    );

    // What `ctr plugins inspect-runtime` and a Create with no options send:
    // nothing. The config then comes from the default place (moved here by
    // SHADOW_CONFIG, as on a host without systemd).
    let out = run_info(b"", &[("SHADOW_CONFIG", &config.display().to_string())]);
    let info = decode(&out);
    assert!(info.options.is_none(), "{info:?}");
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&info.features.value).expect("JSON"),
        runc_features(&runc)
    );
}

#[test]
fn info_errors_name_the_cause_and_exit_non_zero() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("shadow.toml");
    std::fs::write(&config, "[runc]\nbinary = \"/nonexistent/runc\"\n").expect("write config");
    let out = run_info(
        &runtimeoptions(&config).write_to_bytes().expect("encode"),
        &[],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{out:?}");
    assert!(out.stdout.is_empty(), "{out:?}");
    assert!(
        stderr.contains("/nonexistent/runc") && stderr.contains("runc.binary"),
        "{stderr}"
    );

    // Options that are no protobuf at all.
    let out = run_info(b"\xff\xff\xff\xff", &[]);
    assert!(!out.status.success(), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("runtime options"),
        "{out:?}"
    );
}

/// With containerd 2.x on `PATH` (run by hand; CI has 1.6, whose ctr has
/// no `inspect-runtime`): containerd itself runs `-info` and shows it.
#[test]
fn containerd_2_inspects_the_runtime_when_it_is_on_path() {
    if shadow_tests::containerd_version().is_none_or(|(major, _)| major < 2) {
        eprintln!("containerd on PATH is older than 2.0: nothing to ask it");
        return;
    }
    let cd = Containerd::start().expect("start containerd");
    let out = cd
        .ctr()
        .run(&[
            "plugins",
            "inspect-runtime",
            "--runtime",
            Runtime::Shadow.runtime_type(),
        ])
        .expect("ctr plugins inspect-runtime");
    out.assert_success();
    assert!(
        out.stdout.contains(Runtime::Shadow.runtime_type()) && out.stdout.contains("mountOptions"),
        "{out}"
    );
    cd.assert_no_leftovers();
}
