//! A crate cut into layers (the shim's `LAYERS`): a module may use modules
//! of its own layer and of the layers below it, never one above, and no
//! modules may use each other in a circle, even within a layer, and no
//! files either (two files of one listed module are checked against each
//! other too).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use crate::graph::find_circle;
use crate::text::{blank_literals, strip_test_items, used_paths};

/// Layers, lowest first: `(name, modules)`. A module is named by its path
/// in the crate; a file belongs to the longest listed prefix of its path.
pub type Layers<'a> = &'a [(&'a str, &'a [&'a str])];

/// The module path of a file below `src/` (`pair/mod.rs` → `pair`).
fn module_of(rel: &str) -> String {
    let rel = rel.strip_suffix(".rs").unwrap_or(rel);
    let rel = rel.strip_suffix("/mod").unwrap_or(rel);
    rel.replace('/', "::")
}

/// The unit (listed module) a module path belongs to, and its layer index.
/// An item of the crate root (`crate::RUNTIME_ID`) belongs to `main`.
fn unit_of(layers: Layers<'_>, path: &str) -> Option<(String, usize)> {
    let segments: Vec<&str> = path.split("::").collect();
    for n in (1..=segments.len()).rev() {
        let prefix = segments[..n].join("::");
        for (i, (_, modules)) in layers.iter().enumerate() {
            if modules.contains(&prefix.as_str()) {
                return Some((prefix, i));
            }
        }
    }
    None
}

/// The path a file's own `self::` and `mod` children resolve from: a
/// crate root (`main`, `lib`) is the crate itself.
fn resolves_from(module: &str) -> &str {
    if module == "main" || module == "lib" {
        ""
    } else {
        module
    }
}

/// Every layering fault of `files` (`(path below src/, source)`): uses
/// of a higher layer, circles of use, files in no layer, listed modules
/// with no file. Empty when the shim is layered.
pub fn check(layers: Layers<'_>, files: &[(String, String)]) -> Vec<String> {
    let mut faults = Vec::new();
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut seen = BTreeSet::new();
    for (rel, source) in files {
        let module = module_of(rel);
        let Some((unit, layer)) = unit_of(layers, &module) else {
            faults.push(format!(
                "src/{rel}: module {module} is in no layer of LAYERS"
            ));
            continue;
        };
        seen.insert(unit.clone());
        let code = strip_test_items(&blank_literals(source));
        for path in used_paths(resolves_from(&module), &code) {
            let (used, used_layer) = unit_of(layers, &path)
                .or_else(|| unit_of(layers, "main"))
                .unwrap_or(("main".into(), usize::MAX));
            if used == unit {
                continue;
            }
            if used_layer > layer {
                let name = |i: usize| layers.get(i).map_or("the crate root", |l| l.0);
                faults.push(format!(
                    "src/{rel}: {module} (layer {}) uses {path} (layer {}), a higher layer",
                    name(layer),
                    name(used_layer)
                ));
            }
            edges.entry(unit.clone()).or_default().insert(used);
        }
    }
    for (_, modules) in layers {
        for m in modules.iter() {
            if !seen.contains(*m) {
                faults.push(format!("LAYERS lists {m}, which has no file"));
            }
        }
    }
    if let Some(circle) = find_circle(&edges) {
        faults.push(format!("modules use each other: {}", circle.join(" → ")));
    }
    // The same between files, inside a unit too (`pair::gms` and
    // `pair::supervisor` are both `pair`): a use reaches the file that
    // defines the longest prefix of its path.
    let modules: BTreeSet<String> = files.iter().map(|(rel, _)| module_of(rel)).collect();
    let file_of = |path: &str| -> Option<String> {
        let segments: Vec<&str> = path.split("::").collect();
        (1..=segments.len())
            .rev()
            .map(|n| segments[..n].join("::"))
            .find(|m| modules.contains(m))
    };
    let mut file_edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (rel, source) in files {
        let module = module_of(rel);
        let code = strip_test_items(&blank_literals(source));
        for path in used_paths(resolves_from(&module), &code) {
            if let Some(used) = file_of(&path).filter(|u| *u != module) {
                file_edges.entry(module.clone()).or_default().insert(used);
            }
        }
    }
    if let Some(circle) = find_circle(&file_edges) {
        faults.push(format!("files use each other: {}", circle.join(" → ")));
    }
    faults
}

/// Every `.rs` file below `dir`, as `(path relative to dir, source)`;
/// `bin/` holds other crates' roots and is left out.
pub fn sources(dir: &Path) -> std::io::Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for entry in std::fs::read_dir(&d)? {
            let path = entry?.path();
            let rel = path
                .strip_prefix(dir)
                .map_err(std::io::Error::other)?
                .to_string_lossy()
                .into_owned();
            if path.is_dir() {
                if rel != "bin" {
                    todo.push(path);
                }
            } else if rel.ends_with(".rs") {
                out.push((rel, std::fs::read_to_string(&path)?));
            }
        }
    }
    out.sort();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SYNTHETIC: Layers<'static> = &[
        ("low", &["error", "pair::config"]),
        ("mid", &["process", "runc"]),
        ("high", &["service", "pair"]),
    ];

    fn files(list: &[(&str, &str)]) -> Vec<(String, String)> {
        let mut all: Vec<(String, String)> = [
            "error.rs",
            "pair/config.rs",
            "process.rs",
            "runc.rs",
            "service.rs",
            "pair/mod.rs",
        ]
        .iter()
        .map(|f| (f.to_string(), String::new()))
        .collect();
        for (name, text) in list {
            all.retain(|(n, _)| n != name);
            all.push((name.to_string(), text.to_string()));
        }
        all
    }

    #[test]
    fn a_use_of_a_higher_layer_is_a_fault() {
        let f = files(&[("process.rs", "use crate::service::timestamp;\n")]);
        let faults = check(SYNTHETIC, &f);
        assert_eq!(faults.len(), 1, "{faults:?}");
        assert!(
            faults[0].contains("src/process.rs")
                && faults[0].contains("uses service::timestamp (layer high)"),
            "{faults:?}"
        );
        // Also as a full path in an expression, and inside a group.
        let f = files(&[(
            "runc.rs",
            "fn f() { let t = crate::service::timestamp(x); }\n",
        )]);
        assert_eq!(check(SYNTHETIC, &f).len(), 1);
        let f = files(&[("runc.rs", "use crate::{error::Error, service::Task};\n")]);
        let faults = check(SYNTHETIC, &f);
        assert_eq!(faults.len(), 1, "{faults:?}");
        assert!(faults[0].contains("service::Task"), "{faults:?}");
    }

    #[test]
    fn own_and_lower_layers_are_fine() {
        let f = files(&[
            (
                "service.rs",
                "use crate::process::Process;\nuse crate::pair::PairedContainer;\n",
            ),
            (
                "process.rs",
                "use crate::error::{Error, Result};\nuse crate::runc::RuncClient;\n",
            ),
            (
                "pair/mod.rs",
                "use self::config::GmsMode;\nuse crate::error::Error;\n",
            ),
        ]);
        assert_eq!(check(SYNTHETIC, &f), Vec::<String>::new());
    }

    #[test]
    fn super_paths_resolve_and_submodules_take_the_longest_listing() {
        // pair::config is low: reaching pair's supervisor is up.
        let f = files(&[("pair/config.rs", "use super::supervisor::Input;\n")]);
        let faults = check(SYNTHETIC, &f);
        assert_eq!(faults.len(), 1, "{faults:?}");
        assert!(faults[0].contains("pair::supervisor"), "{faults:?}");
        // pair::gms is pair: its sibling pair::config is lower, fine.
        let f = files(&[("pair/gms.rs", "use super::config::PairConfig;\n")]);
        assert_eq!(check(SYNTHETIC, &f), Vec::<String>::new());
    }

    #[test]
    fn comments_strings_and_tests_are_not_uses() {
        let text = r##"
//! Unlike crate::service, this module …
/* crate::service::x */
const S: &str = "crate::service::timestamp";
const R: &str = r#"crate::service"#;
const C: char = '{';
fn f<'a>(x: &'a str) -> &'a str { x }
#[cfg(test)]
mod tests {
    use crate::service::TaskService;
    fn g() { let _ = '}'; }
}
"##;
        let f = files(&[("process.rs", text)]);
        assert_eq!(check(SYNTHETIC, &f), Vec::<String>::new());
        // Code after a test module is checked again.
        let f = files(&[("process.rs", &format!("{text}\nuse crate::service::X;\n"))]);
        assert_eq!(check(SYNTHETIC, &f).len(), 1);
    }

    #[test]
    fn a_circle_within_a_layer_is_a_fault() {
        let f = files(&[
            ("process.rs", "use crate::runc::RuncClient;\n"),
            ("runc.rs", "use crate::process::Process;\n"),
        ]);
        let faults = check(SYNTHETIC, &f);
        assert_eq!(faults.len(), 2, "{faults:?}");
        assert!(
            faults[0].contains("modules use each other: process → runc → process"),
            "{faults:?}"
        );
        assert!(
            faults[1].contains("files use each other: process → runc → process"),
            "{faults:?}"
        );
    }

    #[test]
    fn a_circle_between_files_of_one_unit_is_a_fault() {
        // Both files are `pair`, so the units see no circle; the files do,
        // and a child that uses an item of its parent while the parent uses
        // the child is one too.
        let mut f = files(&[(
            "pair/mod.rs",
            "mod gms; mod supervisor;\nuse self::supervisor::Supervisor;\npub struct Request;\n",
        )]);
        f.push((
            "pair/gms.rs".into(),
            "use super::supervisor::Input;\n".into(),
        ));
        f.push((
            "pair/supervisor.rs".into(),
            "use super::gms::Daemons;\nuse super::Request;\n".into(),
        ));
        let faults = check(SYNTHETIC, &f);
        assert_eq!(faults.len(), 1, "{faults:?}");
        assert!(
            faults[0].starts_with("files use each other: pair"),
            "{faults:?}"
        );
        // Moved below both, the circle is gone.
        let fixed: Vec<(String, String)> = f
            .into_iter()
            .map(|(n, src)| {
                let src = src
                    .replace("use super::supervisor::Input;", "")
                    .replace("use super::Request;", "");
                (n, src)
            })
            .collect();
        assert_eq!(check(SYNTHETIC, &fixed), Vec::<String>::new());
    }

    #[test]
    fn unlisted_files_and_stale_listings_are_faults() {
        let mut f = files(&[]);
        f.push(("newthing.rs".into(), String::new()));
        f.retain(|(n, _)| n != "runc.rs");
        let faults = check(SYNTHETIC, &f);
        assert!(
            faults.iter().any(|x| x.contains("newthing is in no layer")),
            "{faults:?}"
        );
        assert!(
            faults.iter().any(|x| x.contains("LAYERS lists runc")),
            "{faults:?}"
        );
    }
}
