//! Test harness: a private containerd per test run, never the host's.
