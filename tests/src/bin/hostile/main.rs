//! `hostile-engine`: an engine that attacks the runtime from inside its
//! container, for the security tests (docs/security.md, `tests/tests/security/`).
//!
//! Engines run untrusted model code, so the shim and gmsd must survive
//! whatever an engine does with what the runtime hands it: the notify
//! socket, the election lock, the GMS sockets, the directories they live in.
//! Each attack is one subcommand; the test that runs it asserts the outcome
//! from outside (the shim still answers, nothing host-side changed, the
//! pair's limits still hold).
//!
//! `hostile-engine <attack> [args…]`; `hostile-engine list` prints the attacks.
//! Every attack prints `attack=<name> step=<what>` lines on stdout as it goes,
//! so a test can wait for the moment it cares about.

mod common;
mod dirs;
mod fdstore;
mod gms;
mod gpus;
mod notify;
mod ready_liar;
mod weights;

use std::process::ExitCode;

/// An attack: its name, a one-line description, and its entry point, which
/// gets the arguments after the attack's name.
struct Attack {
    name: &'static str,
    about: &'static str,
    run: fn(&[String]) -> Result<(), String>,
}

/// Every attack this binary knows. Add one by writing a module with a
/// `run(&[String]) -> Result<(), String>` and listing it here.
const ATTACKS: &[Attack] = &[
    Attack {
        name: "park",
        about:
            "behave as a well-formed parked shadow (STATUS=parked, block on the lock), the control arm",
        run: common::park_forever,
    },
    Attack {
        name: "gpus",
        about: "name another tenant's GPU in NVIDIA_VISIBLE_DEVICES and look for its GMS daemon",
        run: gpus::run,
    },
    Attack {
        name: "dirs",
        about: "write, fill, mkdir in every runtime-provided directory, squat the sockets, then park",
        run: dirs::run,
    },
    Attack {
        name: "gms-rw-after-commit",
        about: "slot 1 asks gmsd for rw in a loop to replace the committed weights when readers drop to zero (a failover)",
        run: gms::rw_after_commit,
    },
    Attack {
        name: "notify-linger-fd",
        about: "as the parked shadow, pass the shim a TCP socket whose last close lingers (SCM_RIGHTS)",
        run: notify::linger_fd,
    },
    Attack {
        name: "notify-flood",
        about: "as the parked shadow, flood the notify socket with READY=1 and STATUS for N seconds",
        run: notify::flood,
    },
    Attack {
        name: "notify-garbage",
        about: "as the parked shadow, send oversized, malformed, lying and fd-laden datagrams for N seconds",
        run: notify::garbage,
    },
    Attack {
        name: "fdstore-fetch",
        about: "as the parked shadow, fetch the fd store without holding the lock",
        run: fdstore::fetch,
    },
    Attack {
        name: "fdstore-flood",
        about: "as the parked shadow, store wrong types and bad names, then flood the fd store past its bound for N seconds",
        run: fdstore::flood,
    },
    Attack {
        name: "fdstore-churn",
        about: "as the parked shadow, store and remove a memfd R times a second for N seconds, pinging (a busy engine)",
        run: fdstore::churn,
    },
    Attack {
        name: "notify-ready-liar",
        about: "as the parked shadow, say READY=1 without the lock, then take the lock once free",
        run: ready_liar::run,
    },
    Attack {
        name: "weights",
        about: "ask gmsd for more than the pod's memory limit, then load (or map) weights and park",
        run: weights::run,
    },
];

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(name) = args.first() else {
        eprintln!("usage: hostile-engine <attack> [args…]; `hostile-engine list` lists them");
        return ExitCode::from(2);
    };
    if name == "list" {
        for a in ATTACKS {
            println!("{:<24} {}", a.name, a.about);
        }
        return ExitCode::SUCCESS;
    }
    let Some(attack) = ATTACKS.iter().find(|a| a.name == name.as_str()) else {
        eprintln!("hostile-engine: no attack named {name:?}; `hostile-engine list` lists them");
        return ExitCode::from(2);
    };
    common::step(attack.name, "start");
    match (attack.run)(&args[1..]) {
        Ok(()) => {
            common::step(attack.name, "done");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("hostile-engine {}: {e}", attack.name);
            ExitCode::from(1)
        }
    }
}
