//! The one place that knows how runc is driven. [`RuncClient`] is the only
//! type that runs runc: plain containers, the pair's engines and the
//! `delete` action call its methods, one per runc command, and nothing else
//! touches the `runc` crate's client. It owns runc's conventions too, each
//! in its own file: the command lines, options and pid files (`client`),
//! the spawner that waits through the exit router, since the shim's reaper
//! takes every child and a `waitpid` on runc's own pid would race it
//! (`spawner`), `--preserve-fds`, which the crate lacks (`preserve`), and
//! runc's JSON log read back to give errors runc's own words, classified
//! into error codes (`failure`). This file only names them; callers use
//! `crate::runc::…` and never the files below.

mod client;
mod failure;
mod preserve;
mod spawner;

pub use self::client::{RuncClient, RuncStdio, INIT_PID_FILE};
