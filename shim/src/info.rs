//! The `-info` flag: containerd >= 2.0 runs `containerd-shim-shadow-v1
//! -info` to learn what the runtime supports (`ctr plugins inspect-runtime`,
//! CRI's handler introspection, the idmap-mount check before Create). It
//! runs with no containerd address, no `-id` and no namespace; stdin is
//! empty or holds the runtime options `Any`; stdout must be one encoded
//! `containerd.types.RuntimeInfo` and the exit status 0.
//!
//! The answer is runc-v2's: our name and version, the options as given, and
//! the JSON of `runc features` for the runc this task would run, since what
//! a shadow container can do is what that runc can do. A runc without a
//! `features` command (older than 1.1) gives an answer without features, as
//! runc-v2 gives one; a runc that cannot be found is an error naming where
//! its name came from.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use containerd_shim_protos::protobuf::{well_known_types::any::Any, Message, MessageField};
use containerd_shim_protos::types::introspection::{RuntimeInfo, RuntimeVersion};

use crate::error::{Error, Result};
use crate::options::RuntimeOptions;

/// The type URL containerd registers for the runtime-spec `Features`
/// struct (`core/runtime/typeurl.go`); the value is its JSON.
pub const FEATURES_TYPE_URL: &str =
    "types.containerd.io/opencontainers/runtime-spec/1/features/Features";

/// How long `runc features` may take: containerd waits for `-info` in the
/// path of a Create, so a runc that hangs must not hang it.
const FEATURES_TIMEOUT: Duration = Duration::from_secs(10);

/// The most of `runc features` output read (runc 1.1 prints about 2 KiB).
const FEATURES_MAX_BYTES: u64 = 1 << 20;

/// Answer `-info`: read the options from `stdin`, write the encoded
/// `RuntimeInfo` to stdout. Warnings go to stderr, which containerd shows
/// only when the command fails.
pub fn run(name: &str, stdin: &mut impl Read, stdout: &mut impl std::io::Write) -> Result<()> {
    let mut raw = Vec::new();
    stdin
        .read_to_end(&mut raw)
        .map_err(|e| Error::io("reading runtime options from stdin", e))?;
    let info = runtime_info(name, &raw, &mut |binary| features_of(binary))?;
    let bytes = info.write_to_bytes().map_err(|e| Error::Internal {
        what: "encoding RuntimeInfo".into(),
        reason: e.to_string(),
    })?;
    stdout
        .write_all(&bytes)
        .and_then(|_| stdout.flush())
        .map_err(|e| Error::io("writing RuntimeInfo to stdout", e))
}

/// What `runc features` said, or why there is nothing.
pub enum Features {
    /// The JSON object runc printed.
    Json(Vec<u8>),
    /// runc ran but gave no usable answer (no such command, a timeout, not
    /// JSON): the answer goes without features.
    Unavailable(String),
}

/// Build runtime `name`'s answer for options `raw` (possibly empty);
/// `features` runs `runc features` for a resolved runc binary.
pub fn runtime_info(
    name: &str,
    raw: &[u8],
    features: &mut dyn FnMut(&Path) -> Features,
) -> Result<RuntimeInfo> {
    let options = if raw.is_empty() {
        None
    } else {
        Some(Any::parse_from_bytes(raw).map_err(|e| Error::Decode {
            what: "runtime options on stdin",
            reason: e.to_string(),
        })?)
    };
    let parsed = match &options {
        Some(any) => RuntimeOptions::from_any(any)?,
        None => RuntimeOptions::default(),
    };
    let config = parsed.config.load_with_origin()?.0;
    let (runc, source) = match &parsed.runc.binary {
        Some(b) => (b.clone(), "the runtime options' BinaryName"),
        None => (config.runc.binary.clone(), "config runc.binary"),
    };
    let binary = resolve(&runc).ok_or_else(|| {
        Error::FailedPrecondition(format!(
            "runc binary {runc:?} (from {source}) is not an executable file or is not on PATH"
        ))
    })?;

    let mut info = RuntimeInfo {
        name: name.to_string(),
        version: MessageField::some(RuntimeVersion {
            version: env!("CARGO_PKG_VERSION").to_string(),
            revision: option_env!("SHADOW_REVISION")
                .unwrap_or_default()
                .to_string(),
            ..Default::default()
        }),
        options: options.map(MessageField::some).unwrap_or_default(),
        ..Default::default()
    };
    match features(&binary) {
        Features::Json(json) => {
            info.features = MessageField::some(Any {
                type_url: FEATURES_TYPE_URL.to_string(),
                value: json,
                ..Default::default()
            })
        }
        Features::Unavailable(why) => eprintln!(
            "containerd-shim-shadow-v1 -info: no features from {}: {why}",
            binary.display()
        ),
    }
    Ok(info)
}

/// `name` as runc would be run: an absolute or relative path as given, a
/// bare name through `PATH`. Only an executable regular file counts.
fn resolve(name: &str) -> Option<PathBuf> {
    if name.is_empty() {
        return None;
    }
    let executable = |p: &Path| {
        use std::os::unix::fs::PermissionsExt;
        std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if name.contains('/') {
        let p = PathBuf::from(name);
        return executable(&p).then_some(p);
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| executable(p))
}

/// Run `<binary> features`, bounded in time and in what is read.
pub fn features_of(binary: &Path) -> Features {
    let mut child = match Command::new(binary)
        .arg("features")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
    {
        Ok(c) => c,
        Err(e) => return Features::Unavailable(format!("cannot run it: {e}")),
    };
    // The reader ends when runc closes its stdout: at its exit, or when it
    // is killed below.
    let Some(out) = child.stdout.take() else {
        let _ = child.kill();
        let _ = child.wait();
        return Features::Unavailable("no stdout pipe".into());
    };
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = out.take(FEATURES_MAX_BYTES).read_to_end(&mut buf);
        let _ = tx.send(buf);
    });
    let deadline = Instant::now() + FEATURES_TIMEOUT;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Ok(status),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                break Err(format!(
                    "`features` did not answer within {} s",
                    FEATURES_TIMEOUT.as_secs()
                ));
            }
            Err(e) => break Err(format!("waiting for it: {e}")),
        }
    };
    // A process runc left behind may hold the pipe open: the reader is
    // not waited for beyond a moment.
    let stdout = rx.recv_timeout(Duration::from_secs(1)).unwrap_or_default();
    let status = match status {
        Ok(s) => s,
        Err(why) => return Features::Unavailable(why),
    };
    if !status.success() {
        return Features::Unavailable(format!("`features` exited with {status}"));
    }
    match serde_json::from_slice::<serde_json::Value>(&stdout) {
        Ok(v @ serde_json::Value::Object(_)) => match serde_json::to_vec(&v) {
            Ok(json) => Features::Json(json),
            Err(e) => Features::Unavailable(e.to_string()),
        },
        Ok(_) => Features::Unavailable("`features` printed JSON that is not an object".into()),
        Err(e) => Features::Unavailable(format!("`features` printed no JSON: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::options::tests::runtimeoptions_any;
    use containerd_shim_protos::shim::oci::Options as RuncV2Options;
    use std::os::unix::fs::PermissionsExt;

    const NAME: &str = "io.containerd.shadow.v1";

    fn fake_runc(dir: &Path, script: &str) -> PathBuf {
        let p = dir.join("runc");
        std::fs::write(&p, format!("#!/bin/sh\n{script}\n")).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        p
    }

    fn config_with_runc(dir: &Path, runc: &Path) -> PathBuf {
        let c = dir.join("shadow.toml");
        std::fs::write(
            &c,
            format!("[runc]\nbinary = {:?}\n", runc.display().to_string()),
        )
        .unwrap();
        c
    }

    #[test]
    fn answers_with_name_version_options_and_runcs_features() {
        let d = tempfile::tempdir().unwrap();
        let runc = fake_runc(
            d.path(),
            r#"[ "$1" = features ] && echo '{"ociVersionMin":"1.0.0","mountOptions":["idmap"],"future":1}'"#,
        );
        let any = runtimeoptions_any(&config_with_runc(d.path(), &runc).display().to_string(), "");
        let raw = any.write_to_bytes().unwrap();
        let info = runtime_info(NAME, &raw, &mut |b| features_of(b)).unwrap();
        assert_eq!(info.name, "io.containerd.shadow.v1");
        assert_eq!(info.version.version, env!("CARGO_PKG_VERSION"));
        assert_eq!(*info.options, any, "the options come back as given");
        assert_eq!(info.features.type_url, FEATURES_TYPE_URL);
        let f: serde_json::Value = serde_json::from_slice(&info.features.value).unwrap();
        assert_eq!(f["mountOptions"][0], "idmap");
        assert_eq!(f["future"], 1, "fields we do not know pass through");
    }

    #[test]
    fn the_options_binary_name_wins_over_the_config() {
        // The config is the default one here (the host's, or none): the
        // options' BinaryName decides whatever it says.
        let other = tempfile::tempdir().unwrap();
        let options_runc = fake_runc(other.path(), "echo '{\"which\":\"options\"}'");
        let mut ro = RuncV2Options::new();
        ro.binary_name = options_runc.display().to_string();
        let any = Any {
            type_url: "containerd.runc.v1.Options".into(),
            value: ro.write_to_bytes().unwrap(),
            ..Default::default()
        };
        let mut seen = Vec::new();
        let info = runtime_info(NAME, &any.write_to_bytes().unwrap(), &mut |b| {
            seen.push(b.to_path_buf());
            features_of(b)
        })
        .unwrap();
        assert_eq!(seen, vec![options_runc]);
        assert_eq!(info.features.value, b"{\"which\":\"options\"}");
    }

    #[test]
    fn a_runc_without_features_gives_an_answer_without_them() {
        let d = tempfile::tempdir().unwrap();
        for script in [
            "echo 'No help topic for features' >&2; exit 1",
            "echo not json",
            "echo '[1,2]'",
        ] {
            let runc = fake_runc(d.path(), script);
            let any =
                runtimeoptions_any(&config_with_runc(d.path(), &runc).display().to_string(), "");
            let info = runtime_info(NAME, &any.write_to_bytes().unwrap(), &mut |b| {
                features_of(b)
            })
            .unwrap_or_else(|e| panic!("{script}: {e}"));
            assert!(info.features.is_none(), "{script}");
        }
    }

    #[test]
    fn a_missing_runc_or_bad_options_are_errors_that_say_so() {
        let d = tempfile::tempdir().unwrap();
        let any = runtimeoptions_any(
            &config_with_runc(d.path(), Path::new("/nonexistent/runc"))
                .display()
                .to_string(),
            "",
        );
        let e = runtime_info(
            NAME,
            &any.write_to_bytes().unwrap(),
            &mut |_| unreachable!(),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("/nonexistent/runc") && e.contains("config runc.binary"),
            "{e}"
        );
        let e = runtime_info(NAME, b"\xff\xff\xff", &mut |_| unreachable!())
            .unwrap_err()
            .to_string();
        assert!(e.contains("runtime options on stdin"), "{e}");
    }

    #[test]
    fn a_hanging_runc_is_bounded_and_its_output_is_bounded() {
        let d = tempfile::tempdir().unwrap();
        // Endless output: read up to the bound, then runc is killed by the
        // timeout or dies of the closed pipe; either way no JSON.
        let runc = fake_runc(d.path(), "yes '{'");
        assert!(matches!(features_of(&runc), Features::Unavailable(_)));
    }
}
