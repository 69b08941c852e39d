//! The shim's layers. [`LAYERS`] is the one definition (docs/shim.md shows
//! it, and a test keeps the two equal): a module may use (`crate::…`,
//! `super::…`) modules of its own layer and of the layers below it, never
//! one above, and no modules may use each other in a circle, even within a
//! layer, and no files either (two files of one listed module, such as
//! `pair::gms` and `pair::supervisor`, are checked against each other
//! too). `make lint` runs these tests, so a lower module that reaches up
//! fails the build. Tests (`#[cfg(test)]` items) are exempt: a test may
//! build its fixtures from anywhere.
//!
//! The checker is the workspace's (`shadow-layers`, layers/), which also
//! keeps every other crate free of circles; this file holds the shim's
//! layers and runs it on the shim's sources.

/// The layers, lowest first: `(name, modules)`. A module is named by its
/// path in the crate; a file belongs to the longest listed prefix of its
/// path (so `pair::gms` is `pair`, while `pair::config`, the config file's
/// `[pair]` section, sits with the config).
pub const LAYERS: &[(&str, &[&str])] = &[
    ("base", &["error", "time", "memory", "status"]),
    (
        "inputs",
        &[
            "config",
            "pair::config",
            "annotations",
            "options",
            "bootstrap",
            "bundle",
        ],
    ),
    (
        "plumbing",
        &[
            "container",
            "events",
            "exits",
            "io",
            "stats",
            "oom",
            "mount",
            "runc",
            "process",
            "exec",
            "execs",
            "runtime",
        ],
    ),
    ("containers", &["plain", "pair"]),
    ("service", &["service"]),
    ("actions", &["shim", "start", "info"]),
    ("main", &["main", "layers"]),
];

/// The picture docs/shim.md carries, highest layer first.
pub fn render(layers: &[(&str, &[&str])]) -> String {
    let mut out = String::new();
    for (name, modules) in layers.iter().rev() {
        out.push_str(&format!("{name:<11}| {}\n", modules.join(" ")));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use shadow_layers::layered::{check, sources};
    use std::path::Path;

    #[test]
    fn the_shim_is_layered() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let faults = check(LAYERS, &sources(&src).unwrap());
        assert!(
            faults.is_empty(),
            "the shim's layers (shim/src/layers.rs) are broken:\n{}",
            faults.join("\n")
        );
    }

    #[test]
    fn the_docs_show_the_layers() {
        let doc = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/shim.md");
        let text = std::fs::read_to_string(&doc).unwrap();
        let picture = render(LAYERS);
        assert!(
            text.contains(&picture),
            "docs/shim.md must show LAYERS exactly as render() draws it:\n{picture}"
        );
    }
}
