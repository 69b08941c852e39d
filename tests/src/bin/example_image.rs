//! `shadow-example-image`: the image the operator guide runs, built offline.
//!
//! A guide that starts with `ctr image pull` fails on a host without a
//! registry, and one that says "bring your own engine" leaves an operator
//! alone with the engine contract. This writes an OCI image archive made
//! only of what is on the build host: busybox (Debian's busybox-static),
//! the reference engine (`shadow-engine`, with the shared libraries it
//! links) and a small safetensors weights file generated from a seed. The
//! image's command serves those weights on 127.0.0.1:8000 (`PORT` in the
//! container's environment picks another port) and follows the
//! whole engine contract (GMS, `STATUS=parked`, the lock, `READY=1`), so
//! `ctr run --runtime io.containerd.shadow.v1 --annotation
//! shadow.dev/pair=true` of it is a working pair. `make example` builds it
//! and imports it with `ctr images import`.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use clap::Parser;
use shadow_tests::pair::install_binary;
use shadow_tests::{OciImage, Rootfs};

/// Build the guide's example engine image as an OCI archive.
#[derive(Parser, Debug)]
#[command(name = "shadow-example-image")]
struct Args {
    /// Directory for the rootfs and the archive (created).
    #[arg(long, default_value = "target/example")]
    out: PathBuf,
    /// The reference engine binary; default: `shadow-engine` next to this one.
    #[arg(long)]
    engine: Option<PathBuf>,
    /// The image's name, as `ctr run` will name it.
    #[arg(long, default_value = "shadow-example:latest")]
    name: String,
    /// Size of the generated weights.
    #[arg(long, default_value_t = 32)]
    weights_mib: u32,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match build(&args) {
        Ok(archive) => {
            println!("{}", archive.display());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("shadow-example-image: {e}");
            ExitCode::FAILURE
        }
    }
}

fn sibling(name: &str) -> Result<PathBuf, String> {
    let me = std::env::current_exe().map_err(|e| format!("finding this binary: {e}"))?;
    Ok(me.with_file_name(name))
}

fn build(args: &Args) -> Result<PathBuf, String> {
    let engine = match &args.engine {
        Some(p) => p.clone(),
        None => sibling("shadow-engine")?,
    };
    if !engine.is_file() {
        return Err(format!(
            "no engine binary at {} (build it: cargo build --release -p shadow-engine)",
            engine.display()
        ));
    }
    let rootfs = args.out.join("rootfs");
    if rootfs.exists() {
        std::fs::remove_dir_all(&rootfs)
            .map_err(|e| format!("removing the old {}: {e}", rootfs.display()))?;
    }
    Rootfs::busybox()
        .build(&rootfs)
        .map_err(|e| format!("busybox rootfs: {e}"))?;
    install_binary(&rootfs, &engine, "/bin/shadow-engine")
        .map_err(|e| format!("installing {}: {e}", engine.display()))?;
    generate_weights(
        &engine,
        &rootfs.join("weights.safetensors"),
        args.weights_mib,
    )?;
    // `PORT` from the container's environment (`ctr run --env PORT=…`)
    // moves the engine off 8000; `exec` keeps the engine the container's
    // first process, which is what the runtime watches.
    let image = OciImage::new(args.name.clone()).cmd(&[
        "/bin/sh",
        "-c",
        "exec /bin/shadow-engine serve --weights /weights.safetensors --port \"${PORT:-8000}\"",
    ]);
    image
        .write_archive(&rootfs, &args.out)
        .map_err(|e| format!("writing the image archive: {e}"))
}

/// The weights, generated on the host by the engine itself.
fn generate_weights(engine: &Path, out: &Path, mib: u32) -> Result<(), String> {
    let o = Command::new(engine)
        .arg("generate")
        .arg("--out")
        .arg(out)
        .args(["--mib", &mib.to_string()])
        .output()
        .map_err(|e| format!("running {}: {e}", engine.display()))?;
    if !o.status.success() {
        return Err(format!(
            "{} generate: {}{}",
            engine.display(),
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        ));
    }
    Ok(())
}
