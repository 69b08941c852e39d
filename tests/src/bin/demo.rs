//! `make demo`: a private containerd, one container run through our shim,
//! the task listed while it runs, then everything cleaned up. (The failover
//! demo of an engine pair replaces this once pairing lands.)
//!
//! `DEMO_RUNTIME=io.containerd.runc.v2` (or `--runtime …`) runs the same
//! through containerd's own shim, for comparison.

use clap::Parser;
use shadow_tests::{Containerd, Runtime};
use std::time::Duration;

#[derive(Parser)]
#[command(
    name = "shadow-demo",
    about = "One container through this shim on a private containerd, listed while it runs, then cleaned up"
)]
struct Cli {
    /// The runtime to run the container with.
    #[arg(
        long,
        env = "DEMO_RUNTIME",
        default_value = "io.containerd.shadow.v1",
        value_parser = ["io.containerd.shadow.v1", "io.containerd.runc.v2"]
    )]
    runtime: String,
}

const WAIT: Duration = Duration::from_secs(60);

fn main() {
    let rt = match Cli::parse().runtime.as_str() {
        "io.containerd.runc.v2" => Runtime::RuncV2,
        _ => Runtime::Shadow,
    };
    if let Err(e) = run(rt) {
        eprintln!("\ndemo failed: {e}");
        std::process::exit(1);
    }
}

fn step(text: &str) {
    println!("\n==> {text}");
}

fn run(rt: Runtime) -> Result<(), Box<dyn std::error::Error>> {
    step("starting a private containerd (own root, state and socket; the host's is untouched)");
    let cd = Containerd::builder()
        .namespace(format!("demo-{}", std::process::id()))
        .start()?;
    println!("    address   {}", cd.address().display());
    println!("    namespace {}", cd.namespace());
    println!("    rootfs    {} (busybox)", cd.rootfs().display());

    step(&format!(
        "ctr run --rm --runtime {} … hello",
        rt.runtime_type()
    ));
    let mut task = cd
        .container(rt, "hello")
        .rm()
        .cmd(&[
            "sh",
            "-c",
            "echo \"hello from pid $$ in a container run by $RUNTIME\"; echo ready; exec sleep 100000",
        ])
        .flags(&["--env", &format!("RUNTIME={}", rt.runtime_type())])
        .spawn(false)?;
    let hello = task.wait_line(WAIT, |l| l.starts_with("hello"))?;
    println!("    container says: {hello}");
    task.wait_line(WAIT, |l| l == "ready")?;

    step("ctr task ls (while it runs)");
    print!("{}", indent(&cd.ctr().run(&["task", "ls"])?.stdout));
    step("its shim process");
    for (pid, cmdline) in shadow_tests::our_processes(cd.dir(), cd.address()) {
        if cmdline.contains(rt.shim_binary()) {
            println!("    pid {pid}: {cmdline}");
        }
    }

    step("ctr task kill --signal SIGKILL hello");
    cd.ctr()
        .run(&["task", "kill", "--signal", "SIGKILL", "hello"])?;
    let out = task.wait(WAIT)?;
    println!("    ctr run exited with {} (128 + SIGKILL)", out.code());

    step("cleaning up: containerd, shims, runc state, sockets, temp dir");
    cd.assert_no_leftovers();
    drop(cd);
    println!("    nothing left behind.");
    Ok(())
}

fn indent(s: &str) -> String {
    s.lines().map(|l| format!("    {l}\n")).collect()
}
