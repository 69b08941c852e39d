//! The security tests: a hostile engine (`hostile-engine`, tests/src/bin/hostile)
//! attacks the runtime from inside a real pair, through the private
//! containerd, and each test asserts the outcome from outside. One module per
//! item of docs/security.md.

mod control;
mod dirs;
mod fdstore;
mod gms;
mod gpus;
mod memory;
mod notify;
mod ready_liar;
mod shim_death;
