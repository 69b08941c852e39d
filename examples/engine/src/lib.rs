//! The reference engine's model, apart from its process: weights generated
//! from a seed into a safetensors file, their verification, the private
//! runtime state an engine derives from them, and the completion arithmetic
//! (token by token: `model::Decoder`); and the encoding of its HTTP answers
//! in OpenAI's completions shape, streamed or not (`openai`); and the log
//! line that times a promotion, part by part (`promotion`), which the
//! benchmark reads back.
//!
//! Kept free of sockets, locks and GMS so that the parts whose answers the
//! benchmark checks (determinism, verification, "the answer depends on every
//! tensor") are unit-tested without a container.

pub mod model;
pub mod openai;
pub mod promotion;

use std::path::PathBuf;

/// Everything that can stop the engine, with what a person needs to fix it.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("weights {path}: not a valid safetensors file: {reason}")]
    Format { path: PathBuf, reason: String },
    #[error("weights {path}: tensor {tensor}: {reason}")]
    Tensor {
        path: PathBuf,
        tensor: String,
        reason: String,
    },
    #[error("GMS {what}: {source}")]
    Gms {
        what: &'static str,
        #[source]
        source: gms::Error,
    },
    #[error("{0}")]
    Usage(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
