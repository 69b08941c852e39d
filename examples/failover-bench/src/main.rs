//! Placeholder while the benchmark is written.
fn main() {}
