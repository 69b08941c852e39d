//! The error of a `shadow.dev/` value the contract does not allow, apart
//! from both modules that build it: [`crate::annotations`] (the set, which
//! parses every key) and [`crate::listen`] (one key's grammar, which
//! `annotations` calls). Kept below the two so that they use each other in
//! one direction only. Its public name is `annotations::AnnotationError`.

/// A value the contract does not allow for its key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("annotation {key}={value:?} is not valid; allowed: {allowed}")]
pub struct AnnotationError {
    pub key: String,
    pub value: String,
    pub allowed: String,
}
