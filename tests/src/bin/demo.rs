//! `make demo`: a private containerd, one container run through our shim,
//! the task listed while it runs, then everything cleaned up. (The failover
//! demo of an engine pair replaces this once pairing lands.)
//!
//! `DEMO_RUNTIME=io.containerd.runc.v2` runs the same through containerd's
//! own shim, for comparison.

use shadow_tests::{Containerd, Runtime};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

fn main() {
    if let Err(e) = run() {
        eprintln!("\ndemo failed: {e}");
        std::process::exit(1);
    }
}

fn step(text: &str) {
    println!("\n==> {text}");
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let rt = match std::env::var("DEMO_RUNTIME").as_deref() {
        Ok("io.containerd.runc.v2") => Runtime::RuncV2,
        _ => Runtime::Shadow,
    };
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
