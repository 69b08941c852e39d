//! `containerd-shim-shadow-v1`: the binary containerd starts for runtime type
//! `io.containerd.shadow.v1`. `start` runs our own start path (see
//! `start.rs`), `-info` our own introspection answer (`info.rs`); every other action (serve, `delete`) goes through
//! containerd-shim 0.11, which owns flag parsing, the subreaper, the reaper
//! loop and the ttrpc server.

mod annotations;
mod bootstrap;
mod bundle;
mod config;
mod container;
mod error;
mod events;
mod exec;
mod execs;
mod exits;
mod info;
mod io;
#[cfg(test)]
mod layers;
mod memory;
mod mount;
mod oom;
mod options;
mod pair;
mod plain;
mod process;
mod runc;
mod runtime;
mod service;
mod shim;
mod start;
mod stats;
mod status;
mod time;

pub const RUNTIME_ID: &str = "io.containerd.shadow.v1";

fn main() {
    let args: Vec<_> = std::env::args_os().collect();
    let flags = match containerd_shim::parse(&args[1..]) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("containerd-shim-shadow-v1: {e}");
            std::process::exit(2);
        }
    };
    if flags.version {
        println!("containerd-shim-shadow-v1 {}", env!("CARGO_PKG_VERSION"));
        return;
    }
    if flags.info {
        // containerd 2.x runs this with no address, id or namespace.
        if let Err(e) = info::run(
            RUNTIME_ID,
            &mut std::io::stdin().lock(),
            &mut std::io::stdout().lock(),
        ) {
            eprintln!("containerd-shim-shadow-v1 -info: {e}");
            std::process::exit(1);
        }
        return;
    }
    if flags.action == "start" {
        if let Err(e) = start::run(&flags) {
            eprintln!("containerd-shim-shadow-v1 start: {e}");
            std::process::exit(1);
        }
        return;
    }
    // One thread: the shim is resident once per pod and must stay small.
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("containerd-shim-shadow-v1: starting tokio: {e}");
            std::process::exit(1);
        }
    };
    rt.block_on(containerd_shim::asynchronous::run::<shim::ShadowShim>(
        RUNTIME_ID, None,
    ));
}
