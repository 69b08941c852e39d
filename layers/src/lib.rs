//! The workspace's structure checks, run by `make lint` and by `cargo
//! test` (`tests/workspace.rs`):
//!
//! - [`workspace::check`]: no crate of the workspace has modules that use
//!   each other in a circle;
//! - [`layered::check`]: a crate cut into layers (the shim's `LAYERS`,
//!   shim/src/layers.rs) uses no higher layer either.
//!
//! Why a crate of its own: the layer check was the shim's alone, and a
//! circle came back in another crate (`shadow-contract`: env → handoff →
//! fdstore → env) where nothing looked. One reader of sources ([`text`])
//! serves both checks. It reads the sources as text, not through the
//! compiler: comments and literals are blanked first, `#[cfg(test)]` items
//! are exempt (a test may build its fixtures from anywhere), and a use is
//! a `crate::`, `super::` or `self::` path or one that starts at a module
//! the file declares.

pub mod graph;
pub mod layered;
pub mod text;
pub mod workspace;
