//! Every crate of a workspace: no modules may use each other in a circle.
//!
//! Each member's crate roots (its library, binaries, tests, examples,
//! benches, build script: the `path`s its `Cargo.toml` names and Cargo's
//! default places) are read with the module tree they declare (`mod a;` →
//! `a.rs` or `a/mod.rs`), and the files of one crate are checked against
//! each other: a use reaches the file that defines the longest prefix of
//! its path, and no file may reach itself through others.

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::path::{Path, PathBuf};

use crate::graph::all_circles;
use crate::text::{
    blank_literals, declared_mods, reexports, strip_test_items, used_paths, without_reexports,
};

/// One file of a crate: its module path (`""` for the root), where it is,
/// and its source.
#[derive(Debug, Clone)]
pub struct ModuleFile {
    pub module: String,
    pub path: PathBuf,
    pub source: String,
}

fn read(path: &Path) -> io::Result<String> {
    std::fs::read_to_string(path)
        .map_err(|e| io::Error::new(e.kind(), format!("reading {}: {e}", path.display())))
}

/// The members of the workspace whose `Cargo.toml` is in `root`, as
/// directories (`members` globs ending in `/*` are expanded).
pub fn members(root: &Path) -> io::Result<Vec<PathBuf>> {
    let manifest = root.join("Cargo.toml");
    let text = read(&manifest)?;
    let doc: toml::Table = text
        .parse()
        .map_err(|e| io::Error::other(format!("{}: {e}", manifest.display())))?;
    let list = doc
        .get("workspace")
        .and_then(|w| w.get("members"))
        .and_then(|m| m.as_array())
        .ok_or_else(|| {
            io::Error::other(format!("{}: no [workspace] members", manifest.display()))
        })?;
    let mut out = Vec::new();
    for m in list {
        let Some(m) = m.as_str() else {
            return Err(io::Error::other(format!(
                "{}: a member that is not a string: {m}",
                manifest.display()
            )));
        };
        if let Some(dir) = m.strip_suffix("/*") {
            let mut found: Vec<PathBuf> = std::fs::read_dir(root.join(dir))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.join("Cargo.toml").is_file())
                .collect();
            found.sort();
            out.extend(found);
        } else {
            out.push(root.join(m));
        }
    }
    Ok(out)
}

/// The crate roots of the package in `dir`: the `path` of each target its
/// `Cargo.toml` lists, and the files Cargo finds by itself.
pub fn roots(dir: &Path) -> io::Result<Vec<PathBuf>> {
    let manifest = dir.join("Cargo.toml");
    let doc: toml::Table = read(&manifest)?
        .parse()
        .map_err(|e| io::Error::other(format!("{}: {e}", manifest.display())))?;
    let mut out = BTreeSet::new();
    let path_of = |t: &toml::Value| t.get("path").and_then(|p| p.as_str()).map(|p| dir.join(p));
    if let Some(lib) = doc.get("lib") {
        out.extend(path_of(lib));
    }
    for kind in ["bin", "test", "example", "bench"] {
        for t in doc
            .get(kind)
            .and_then(|v| v.as_array())
            .into_iter()
            .flatten()
        {
            out.extend(path_of(t));
        }
    }
    if let Some(build) = doc
        .get("package")
        .and_then(|p| p.get("build"))
        .and_then(|b| b.as_str())
    {
        out.insert(dir.join(build));
    }
    for default in ["src/lib.rs", "src/main.rs", "build.rs"] {
        let p = dir.join(default);
        if p.is_file() {
            out.insert(p);
        }
    }
    for (sub, nested) in [
        ("src/bin", true),
        ("tests", true),
        ("examples", true),
        ("benches", true),
    ] {
        let Ok(entries) = std::fs::read_dir(dir.join(sub)) else {
            continue;
        };
        for entry in entries {
            let p = entry?.path();
            if p.extension().is_some_and(|e| e == "rs") && p.is_file() {
                out.insert(p);
            } else if nested && p.join("main.rs").is_file() {
                out.insert(p.join("main.rs"));
            }
        }
    }
    Ok(out.into_iter().collect())
}

/// The files of the crate whose root is `root`, found through the `mod`
/// items each declares outside its tests. A declared module with no file
/// at Cargo's places (a `#[path]` one) is left out.
pub fn crate_files(root: &Path) -> io::Result<Vec<ModuleFile>> {
    let mut out = Vec::new();
    // (module path, file, whether its children sit in its own directory)
    let mut todo = vec![(String::new(), root.to_path_buf(), true)];
    let mut seen = BTreeSet::new();
    while let Some((module, path, own_dir)) = todo.pop() {
        if !seen.insert(path.clone()) {
            continue;
        }
        let source = read(&path)?;
        let code = strip_test_items(&blank_literals(&source));
        let parent = path.parent().unwrap_or(Path::new("."));
        let dir = if own_dir {
            parent.to_path_buf()
        } else {
            let stem = path.file_stem().unwrap_or_default();
            parent.join(stem)
        };
        for (name, inline) in declared_mods(&code) {
            if inline {
                continue;
            }
            let child = if module.is_empty() {
                name.clone()
            } else {
                format!("{module}::{name}")
            };
            let flat = dir.join(format!("{name}.rs"));
            let nested = dir.join(&name).join("mod.rs");
            if flat.is_file() {
                todo.push((child, flat, false));
            } else if nested.is_file() {
                todo.push((child, nested, true));
            }
        }
        out.push(ModuleFile {
            module,
            path,
            source,
        });
    }
    out.sort_by(|a, b| a.module.cmp(&b.module));
    Ok(out)
}

/// The circles of use among the files of one crate, each as the path that
/// closes it (`crate` for the root). A use of a name a file re-exports
/// (`pub use a::X;` at the root, then `crate::X`) is a use of where it
/// comes from.
pub fn circles(files: &[ModuleFile]) -> Vec<Vec<String>> {
    let modules: BTreeSet<&str> = files.iter().map(|f| f.module.as_str()).collect();
    let file_of = |path: &str| -> Option<String> {
        let segments: Vec<&str> = path.split("::").collect();
        (0..=segments.len())
            .rev()
            .map(|n| segments[..n].join("::"))
            .find(|m| modules.contains(m.as_str()))
    };
    let codes: Vec<String> = files
        .iter()
        .map(|f| strip_test_items(&blank_literals(&f.source)))
        .collect();
    let mut exported: BTreeMap<(String, String), Option<String>> = BTreeMap::new();
    for (f, code) in files.iter().zip(&codes) {
        for (name, target) in reexports(&f.module, code) {
            exported.insert((f.module.clone(), name), target);
        }
    }
    // The file a path reaches, through re-exports (a few hops at most).
    let reach = |mut path: String| -> Option<String> {
        for _ in 0..8 {
            let file = file_of(&path)?;
            let rest = if file.is_empty() {
                path.as_str()
            } else {
                path.get(file.len() + 2..).unwrap_or("")
            };
            let (first, tail) = match rest.split_once("::") {
                Some((a, b)) => (a, Some(b)),
                None => (rest, None),
            };
            match exported.get(&(file.clone(), first.to_string())) {
                // Another crate's: no file of this one.
                Some(None) => return None,
                Some(Some(target)) if *target != path => {
                    path = match tail {
                        Some(t) => format!("{target}::{t}"),
                        None => target.clone(),
                    };
                }
                _ => return Some(file),
            }
        }
        file_of(&path)
    };
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (f, code) in files.iter().zip(&codes) {
        for path in used_paths(&f.module, &without_reexports(code)) {
            if let Some(used) = reach(path).filter(|u| *u != f.module) {
                edges.entry(f.module.clone()).or_default().insert(used);
            }
        }
    }
    let name = |m: String| if m.is_empty() { "crate".to_string() } else { m };
    all_circles(&edges)
        .into_iter()
        .map(|c| c.into_iter().map(name).collect())
        .collect()
}

/// Every circle of every crate of the workspace in `root`, one line each:
/// `<crate root>: files use each other: a → b → a`.
pub fn check(root: &Path) -> io::Result<Vec<String>> {
    let mut faults = Vec::new();
    for member in members(root)? {
        for crate_root in roots(&member)? {
            let files = crate_files(&crate_root)?;
            for c in circles(&files) {
                let shown = crate_root.strip_prefix(root).unwrap_or(&crate_root);
                faults.push(format!(
                    "{}: modules use each other: {}",
                    shown.display(),
                    c.join(" → ")
                ));
            }
        }
    }
    Ok(faults)
}
