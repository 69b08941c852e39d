//! The benchmark's one error type: what failed (the harness, the engine's
//! model, a file, the chart, an arm) with the path or arm involved.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Harness(#[from] shadow_tests::Error),
    #[error(transparent)]
    Engine(#[from] shadow_engine::Error),
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("chart {path}: {reason}")]
    Chart { path: PathBuf, reason: String },
    #[error("arm {arm}: {reason}")]
    Arm { arm: String, reason: String },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
