//! The shim's layers, and the check that keeps them. [`LAYERS`] is the one
//! definition (docs/shim.md shows it, and a test keeps the two equal): a
//! module may use (`crate::…`, `super::…`) modules of its own layer and of
//! the layers below it, never one above, and no modules may use each other
//! in a circle, even within a layer, and no files either (two files of one
//! listed module, such as `pair::gms` and `pair::supervisor`, are checked
//! against each other too). `make lint` runs these tests, so a
//! lower module that reaches up fails the build. Tests (`#[cfg(test)]`
//! items) are exempt: a test may build its fixtures from anywhere.
//!
//! The checker reads the sources as text: comments and literals are
//! blanked first, so a path in a doc comment or a message is no use.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

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

/// The module path of a file below `src/` (`pair/mod.rs` → `pair`).
fn module_of(rel: &str) -> String {
    let rel = rel.strip_suffix(".rs").unwrap_or(rel);
    let rel = rel.strip_suffix("/mod").unwrap_or(rel);
    rel.replace('/', "::")
}

/// The unit (listed module) a module path belongs to, and its layer index.
/// An item of the crate root (`crate::RUNTIME_ID`) belongs to `main`.
fn unit_of(layers: &[(&str, &[&str])], path: &str) -> Option<(String, usize)> {
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

/// `text` with comments, string and char literals blanked (newlines kept).
fn blank_literals(text: &str) -> String {
    let c: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let ident = |ch: char| ch.is_alphanumeric() || ch == '_';
    let mut i = 0;
    while i < c.len() {
        let prev_ident = i > 0 && ident(c[i - 1]);
        if c[i] == '/' && c.get(i + 1) == Some(&'/') {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if c[i] == '/' && c.get(i + 1) == Some(&'*') {
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && c.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    if c[i] == '\n' {
                        out.push('\n');
                    }
                    i += 1;
                }
            }
        } else if let Some((open, hashes)) = raw_string_at(&c, i, prev_ident) {
            // A raw string: r"…", r#"…"#, br"…".
            let mut j = open + 1;
            while j < c.len() {
                if c[j] == '"' && (0..hashes).all(|k| c.get(j + 1 + k) == Some(&'#')) {
                    j += 1 + hashes;
                    break;
                }
                if c[j] == '\n' {
                    out.push('\n');
                }
                j += 1;
            }
            out.push_str("\"\"");
            i = j;
        } else if c[i] == '"' {
            i += 1;
            while i < c.len() && c[i] != '"' {
                if c[i] == '\\' {
                    i += 1;
                }
                if c.get(i) == Some(&'\n') {
                    out.push('\n');
                }
                i += 1;
            }
            i += 1;
            out.push_str("\"\"");
        } else if c[i] == '\'' && c.get(i + 1) == Some(&'\\') {
            // An escaped char literal: '\n', '\'', '\u{7f}'.
            i += 2;
            while i < c.len() && c[i] != '\'' {
                i += 1;
            }
            i += 1;
            out.push_str("' '");
        } else if c[i] == '\'' && c.get(i + 2) == Some(&'\'') {
            i += 3;
            out.push_str("' '");
        } else {
            // Code, or the quote of a lifetime.
            out.push(c[i]);
            i += 1;
        }
    }
    out
}

/// At `c[i]`, the start of a raw string (`r"`, `r#"`, `br"`): the index
/// of its opening quote and its number of `#`.
fn raw_string_at(c: &[char], i: usize, prev_ident: bool) -> Option<(usize, usize)> {
    if prev_ident {
        return None;
    }
    let mut j = match (c[i], c.get(i + 1)) {
        ('r', _) => i + 1,
        ('b', Some('r')) => i + 2,
        _ => return None,
    };
    let mut hashes = 0;
    while c.get(j) == Some(&'#') {
        hashes += 1;
        j += 1;
    }
    (c.get(j) == Some(&'"')).then_some((j, hashes))
}

/// `code` (already blanked) without its `#[cfg(test)]` items.
fn strip_test_items(code: &str) -> String {
    const ATTR: &str = "#[cfg(test)]";
    let mut out = String::new();
    let mut rest = code;
    while let Some(at) = rest.find(ATTR) {
        out.push_str(&rest[..at]);
        let item = &rest[at + ATTR.len()..];
        let end = match item.find(['{', ';']) {
            Some(k) if item.as_bytes()[k] == b';' => k + 1,
            Some(k) => {
                let mut depth = 0usize;
                let mut end = item.len();
                for (n, b) in item.bytes().enumerate().skip(k) {
                    match b {
                        b'{' => depth += 1,
                        b'}' => {
                            depth -= 1;
                            if depth == 0 {
                                end = n + 1;
                                break;
                            }
                        }
                        _ => {}
                    }
                }
                end
            }
            None => item.len(),
        };
        rest = &item[end..];
    }
    out.push_str(rest);
    out
}

/// The module paths `code` (blanked, tests stripped) of module `module`
/// uses: every `crate::a::b`, `super::…` and `self::…` path, resolved, and
/// each member of a `crate::{…}` group.
fn used_paths(module: &str, code: &str) -> Vec<String> {
    let b = code.as_bytes();
    let ident = |x: u8| x.is_ascii_alphanumeric() || x == b'_';
    let mut found = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let boundary = i == 0 || !(ident(b[i - 1]) || b[i - 1] == b':' || b[i - 1] == b'$');
        let head = ["crate::", "super::", "self::"]
            .into_iter()
            .find(|h| boundary && code[i..].starts_with(h));
        let Some(head) = head else {
            i += 1;
            continue;
        };
        // The module the path starts from.
        let mut base: Vec<&str> = match head {
            "crate::" => Vec::new(),
            _ => module.split("::").collect(),
        };
        let mut j = i + head.len();
        if head == "super::" {
            base.pop();
            while code[j..].starts_with("super::") {
                base.pop();
                j += "super::".len();
            }
        }
        let rest = &code[j..];
        let prefix = base.join("::");
        let join = |tail: &str| match (prefix.is_empty(), tail.is_empty()) {
            (true, _) => tail.to_string(),
            (false, true) => prefix.clone(),
            (false, false) => format!("{prefix}::{tail}"),
        };
        if let Some(group) = rest.strip_prefix('{') {
            // `crate::{a::X, b::{Y, Z}}`: the leading path of each member.
            let mut depth = 0;
            let mut member = String::new();
            for ch in group.chars() {
                match ch {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        found.push(join(&leading_path(&member)));
                        member.clear();
                        continue;
                    }
                    _ => {}
                }
                member.push(ch);
            }
            found.push(join(&leading_path(&member)));
        } else {
            found.push(join(&leading_path(rest)));
        }
        i = j;
    }
    found.retain(|p| !p.is_empty());
    found
}

/// `a::b::c` of `a::b::c::{X}` or `a::b::c;`: the identifiers joined by `::`.
fn leading_path(s: &str) -> String {
    let s = s.trim_start();
    let end = s
        .find(|ch: char| !(ch.is_alphanumeric() || ch == '_' || ch == ':'))
        .unwrap_or(s.len());
    s[..end].trim_end_matches(':').to_string()
}

/// Every layering fault of `files` (`(path below src/, source)`): uses
/// of a higher layer, circles of use, files in no layer, listed modules
/// with no file. Empty when the shim is layered.
pub fn check(layers: &[(&str, &[&str])], files: &[(String, String)]) -> Vec<String> {
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
        for path in used_paths(&module, &code) {
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
        for path in used_paths(&module, &code) {
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

/// One circle in the use graph, as the path that closes it.
fn find_circle(edges: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|p| p == node) {
            let mut circle = path[at..].to_vec();
            circle.push(node.to_string());
            return Some(circle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_string());
        for next in edges.get(node).into_iter().flatten() {
            if let Some(c) = visit(next, edges, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(node.to_string());
        None
    }
    let mut done = BTreeSet::new();
    for node in edges.keys() {
        if let Some(c) = visit(node, edges, &mut Vec::new(), &mut done) {
            return Some(c);
        }
    }
    None
}

/// Every `.rs` file below `dir`, as `(path relative to dir, source)`;
/// `bin/` holds other crates' roots and is left out.
fn sources(dir: &Path) -> std::io::Result<Vec<(String, String)>> {
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

    const SYNTHETIC: &[(&str, &[&str])] = &[
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
