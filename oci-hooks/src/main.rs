//! Command line of `shadow-oci-hook`: the hook stages (what hooks.d JSON
//! and config.json `hooks` call), `cdi generate|remove`, and
//! `gms start|stop|run`. Every failure goes to stderr with its context and
//! a non-zero exit, which runtimes report as the hook's failure.

use clap::{Parser, Subcommand};
use shadow_oci_hook::admission::Admission;
use shadow_oci_hook::create_runtime::{self, State};
use shadow_oci_hook::gms_daemon::{self, GmsdLaunch};
use shadow_oci_hook::layout::DEFAULT_ROOT;
use shadow_oci_hook::{cdi, precreate, Error, PairLayout, Result};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

#[derive(Parser)]
#[command(
    name = "shadow-oci-hook",
    about = "Election lock and GMS sockets for engine pairs under podman, CRI-O and runc"
)]
struct Cli {
    /// Root of the per-pair host directories (<root>/<pair>/{pair,gms}).
    #[arg(long, global = true, default_value = DEFAULT_ROOT)]
    root: PathBuf,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// precreate stage (podman, CRI-O): config.json on stdin, edited on stdout.
    Precreate,
    /// createRuntime stage (OCI; plain runc): state on stdin; binds into the container.
    CreateRuntime,
    /// poststop stage: state on stdin; removes the pair's directory if nothing uses it.
    Poststop,
    /// CDI specs for `--device shadow.dev/gms=<pair>`.
    Cdi {
        #[command(subcommand)]
        action: CdiAction,
    },
    /// A gmsd for one pair.
    Gms {
        #[command(subcommand)]
        action: GmsAction,
    },
}

#[derive(Subcommand)]
enum CdiAction {
    /// Write <dir>/shadow-gms-<pair>.json (and the pair's host directories).
    Generate {
        #[arg(long)]
        pair: String,
        #[arg(long, default_value = "/etc/cdi")]
        dir: PathBuf,
    },
    /// Remove <dir>/shadow-gms-<pair>.json.
    Remove {
        #[arg(long)]
        pair: String,
        #[arg(long, default_value = "/etc/cdi")]
        dir: PathBuf,
    },
}

#[derive(clap::Args)]
struct LaunchArgs {
    #[arg(long)]
    pair: String,
    /// gmsd's --device: `host`, or a CUDA device (index, cuda:N, GPU-UUID).
    #[arg(long, default_value = "host")]
    device: String,
    /// The gmsd binary (default: next to this one, else on PATH).
    #[arg(long)]
    gmsd: Option<PathBuf>,
    /// Containers whose process runs as this uid may join (repeatable).
    #[arg(long = "allow-uid")]
    allow_uids: Vec<u32>,
    /// Containers with this annotation may join (KEY=VALUE, repeatable; all
    /// must match), e.g. `io.kubernetes.pod.namespace=team-a` under CRI-O.
    /// At least one --allow-uid or --allow-annotation is required: the hook
    /// refuses every other container that names the pair.
    #[arg(long = "allow-annotation")]
    allow_annotations: Vec<String>,
    /// More gmsd serve flags (after `--`), e.g. `-- --max-bytes 80G`.
    #[arg(last = true)]
    extra: Vec<String>,
}

#[derive(Subcommand)]
enum GmsAction {
    /// Start gmsd detached; prints its pid once its socket exists.
    Start {
        #[command(flatten)]
        launch: LaunchArgs,
        /// Seconds to wait for the socket.
        #[arg(long, default_value_t = 30)]
        wait: u64,
    },
    /// Stop the pair's gmsd and remove the pair's directory if unused.
    Stop {
        #[arg(long)]
        pair: String,
        #[arg(long, default_value_t = 30)]
        wait: u64,
    },
    /// Prepare the pair's directories and exec gmsd (systemd ExecStart).
    Run {
        #[command(flatten)]
        launch: LaunchArgs,
    },
}

fn stdin_text(what: &'static str) -> Result<String> {
    let mut text = String::new();
    std::io::stdin()
        .read_to_string(&mut text)
        .map_err(|source| Error::Stdin { what, source })?;
    Ok(text)
}

fn launch_of(root: &Path, a: LaunchArgs) -> Result<(PairLayout, GmsdLaunch)> {
    let layout = PairLayout::new(root, &a.pair)?;
    let launch = GmsdLaunch {
        gmsd: a.gmsd.unwrap_or_else(gms_daemon::default_gmsd),
        device: a.device,
        extra: a.extra,
        admission: Admission::from_flags(&a.allow_uids, &a.allow_annotations)?,
    };
    Ok((layout, launch))
}

fn run(cli: Cli) -> Result<()> {
    let root = cli.root.as_path();
    match cli.command {
        Command::Precreate => {
            let text = stdin_text("config.json")?;
            let spec = serde_json::from_str(&text).map_err(|source| Error::Json {
                what: "config.json on stdin",
                source,
            })?;
            let out = precreate::edit_spec(spec, root)?;
            let text = serde_json::to_string(&out).map_err(|source| Error::Json {
                what: "edited config.json",
                source,
            })?;
            std::io::stdout()
                .write_all(text.as_bytes())
                .map_err(|e| Error::io("writing the spec to", "stdout", e))?;
        }
        Command::CreateRuntime => {
            let state = State::parse(&stdin_text("OCI state")?)?;
            create_runtime::bind_into_container(&state, root)?;
        }
        Command::Poststop => {
            let state = State::parse(&stdin_text("OCI state")?)?;
            // A container that was never admitted never joined: its end
            // must not clean up a pair it only named.
            if let Some(layout) = state.pair(root)? {
                if state.admitted(&layout).is_ok() {
                    gms_daemon::release(&layout)?;
                }
            }
        }
        Command::Cdi { action } => match action {
            CdiAction::Generate { pair, dir } => {
                let path = cdi::generate(&dir, &PairLayout::new(root, &pair)?)?;
                println!("{}", path.display());
            }
            CdiAction::Remove { pair, dir } => cdi::remove(&dir, &PairLayout::new(root, &pair)?)?,
        },
        Command::Gms { action } => match action {
            GmsAction::Start { launch, wait } => {
                let (layout, launch) = launch_of(root, launch)?;
                let pid = gms_daemon::start(&layout, &launch, Duration::from_secs(wait))?;
                println!("{pid}");
            }
            GmsAction::Stop { pair, wait } => {
                let layout = PairLayout::new(root, &pair)?;
                gms_daemon::stop(&layout, Duration::from_secs(wait))?;
            }
            GmsAction::Run { launch } => {
                let (layout, launch) = launch_of(root, launch)?;
                gms_daemon::run(&layout, &launch)?;
            }
        },
    }
    Ok(())
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("shadow-oci-hook: {e}");
            ExitCode::FAILURE
        }
    }
}
