//! The `start` action, owned here rather than by containerd-shim 0.11 so
//! that it works with every containerd: read stdin whole (runtime options
//! from 1.6/1.7, `BootstrapParams` from >= 2.3), pick the group (one shim
//! per pod, by `io.kubernetes.cri.sandbox-id`), start the serving daemon in
//! its own session, or reuse the group's running one, write the bundle's
//! `address` file and answer in the caller's format.

use std::io::{Read, Write};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use containerd_shim::Flags;

use crate::bootstrap::StartInput;
use crate::bundle::{grouping, BUNDLE_CONFIG};
use crate::config::ENV_CONFIG_ORIGIN;
use crate::error::{Error, Result};

pub fn run(flags: &Flags) -> Result<()> {
    let mut stdin = Vec::new();
    std::io::stdin()
        .read_to_end(&mut stdin)
        .map_err(|e| Error::io("reading start parameters from stdin", e))?;
    let input = StartInput::parse(&stdin, &flags.id, &flags.namespace)?;
    let config_source = input.options().config.clone();
    let (config, origin) = config_source.load_with_origin()?;

    let bundle = if flags.bundle.is_empty() {
        std::env::current_dir().map_err(|e| Error::io("finding the bundle (cwd)", e))?
    } else {
        PathBuf::from(&flags.bundle)
    };
    // The delete action gets no runtime options: leave it the resolved config.
    let saved = toml::to_string(&config).map_err(|e| Error::Config {
        path: bundle.join(BUNDLE_CONFIG),
        reason: e.to_string(),
    })?;
    std::fs::write(bundle.join(BUNDLE_CONFIG), saved).map_err(|e| {
        Error::io(
            format!("writing {}", bundle.join(BUNDLE_CONFIG).display()),
            e,
        )
    })?;

    let group = grouping(&bundle, &flags.id);
    let address = containerd_shim::socket_address(&flags.address, &flags.namespace, &group);

    let exe = std::env::current_exe().map_err(|e| Error::io("finding own executable", e))?;
    let mut cmd = Command::new(exe);
    cmd.current_dir(&bundle)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .args(["-namespace", &flags.namespace, "-id", &flags.id])
        .args(["-address", &flags.address, "-socket", &address]);
    if !flags.publish_binary.is_empty() {
        cmd.args(["-publish-binary", &flags.publish_binary]);
    }
    if flags.debug {
        cmd.arg("-debug");
    }
    if let StartInput::Bootstrap(params, _) = &input {
        // containerd >= 2.3 passes these in the message, not the environment.
        if !params.containerd_ttrpc_address.is_empty() {
            cmd.env("TTRPC_ADDRESS", &params.containerd_ttrpc_address);
        }
        if !params.containerd_grpc_address.is_empty() {
            cmd.env("GRPC_ADDRESS", &params.containerd_grpc_address);
        }
    }
    cmd.envs(config_source.to_env());
    // The daemon reads the bundle's copy; it logs where `start` found it.
    cmd.env(ENV_CONFIG_ORIGIN, origin.to_env());
    // SAFETY: setsid is async-signal-safe and touches no memory of ours; it
    // detaches the daemon from containerd's session so it outlives it.
    unsafe {
        cmd.pre_exec(|| {
            nix::unistd::setsid().map_err(std::io::Error::from)?;
            Ok(())
        });
    }
    let mut child = cmd
        .spawn()
        .map_err(|e| Error::io("spawning the shim daemon", e))?;
    let pid = child.id();
    if let Some(cg) = &input.options().shim_cgroup {
        containerd_shim::cgroup::add_task_to_cgroup(cg, pid)?;
    }
    containerd_shim::cgroup::adjust_oom_score(pid)?;

    // The daemon closes this pipe once it listens (or exits when the
    // group's shim already serves the socket).
    let mut ready = Vec::new();
    if let Some(mut out) = child.stdout.take() {
        let _ = out.read_to_end(&mut ready);
    }
    if let Ok(Some(status)) = child.try_wait() {
        if !status.success() {
            return Err(Error::FailedPrecondition(format!(
                "shim daemon for {} exited with {status} before serving {address}",
                flags.id
            )));
        }
    }
    std::fs::write(bundle.join("address"), &address)
        .map_err(|e| Error::io(format!("writing {}", bundle.join("address").display()), e))?;

    let reply = input.reply(&address)?;
    let mut stdout = std::io::stdout();
    stdout
        .write_all(&reply)
        .and_then(|_| stdout.flush())
        .map_err(|e| Error::io("writing the start reply", e))?;
    Ok(())
}
