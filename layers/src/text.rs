//! Reading Rust sources as text, well enough to find the paths a file
//! uses: comments and literals are blanked first (a path in a doc comment
//! or a message is no use), `#[cfg(test)]` items are stripped (a test may
//! build its fixtures from anywhere), and what is left is scanned for
//! `crate::`, `super::` and `self::` paths and for paths that start at a
//! child module the file declares (`mod a;` … `a::X`).

/// `text` with comments, string and char literals blanked (newlines kept).
pub fn blank_literals(text: &str) -> String {
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
pub fn strip_test_items(code: &str) -> String {
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

/// The modules `code` (blanked, tests stripped) declares at any depth:
/// `(name, has a body)`; `mod a;` is `("a", false)`, `mod a { … }` is
/// `("a", true)`.
pub fn declared_mods(code: &str) -> Vec<(String, bool)> {
    let b = code.as_bytes();
    let ident = |x: u8| x.is_ascii_alphanumeric() || x == b'_';
    let mut out = Vec::new();
    let mut i = 0;
    while let Some(at) = code[i..].find("mod") {
        let start = i + at;
        i = start + 3;
        let before_ok = start == 0 || !(ident(b[start - 1]) || b[start - 1] == b':');
        let after_ok = b.get(i).is_some_and(|x| x.is_ascii_whitespace());
        if !before_ok || !after_ok {
            continue;
        }
        let rest = code[i..].trim_start();
        let end = rest
            .find(|ch: char| !(ch.is_alphanumeric() || ch == '_'))
            .unwrap_or(rest.len());
        let name = rest[..end].trim_start_matches("r#");
        if name.is_empty() {
            continue;
        }
        match rest[end..].trim_start().as_bytes().first() {
            Some(b';') => out.push((name.to_string(), false)),
            Some(b'{') => out.push((name.to_string(), true)),
            _ => {}
        }
    }
    out
}

/// The module paths `code` (blanked, tests stripped) of module `module`
/// (`""`: the crate root) uses: every `crate::a::b`, `super::…` and
/// `self::…` path, resolved, each member of a `crate::{…}` group, and
/// every path that starts at a module the file declares (`mod a;` makes
/// `a::X` a use of `self::a::X`; nothing else may be named `a` there).
pub fn used_paths(module: &str, code: &str) -> Vec<String> {
    let children: Vec<String> = declared_mods(code)
        .into_iter()
        .map(|(name, _)| format!("{name}::"))
        .collect();
    paths_in(module, code, &children)
}

/// [`used_paths`] with the file's children (`a::` for each `mod a`) given.
fn paths_in(module: &str, code: &str, children: &[String]) -> Vec<String> {
    let b = code.as_bytes();
    let ident = |x: u8| x.is_ascii_alphanumeric() || x == b'_';
    let own: Vec<&str> = module.split("::").filter(|s| !s.is_empty()).collect();
    let mut found = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let boundary = i == 0 || !(ident(b[i - 1]) || b[i - 1] == b':' || b[i - 1] == b'$');
        if !boundary {
            i += 1;
            continue;
        }
        let head = ["crate::", "super::", "self::"]
            .into_iter()
            .find(|h| code[i..].starts_with(h))
            .or_else(|| {
                children
                    .iter()
                    .any(|c| code[i..].starts_with(c.as_str()))
                    .then_some("")
            });
        let Some(head) = head else {
            i += 1;
            continue;
        };
        // The module the path starts from.
        let mut base: Vec<&str> = match head {
            "crate::" => Vec::new(),
            _ => own.clone(),
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
        i = j.max(i + 1);
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

/// The names `code` (blanked, tests stripped) of module `module`
/// re-exports (`pub use a::X;`, `pub use a::{X, Y as Z};`), each with the
/// module path of what it names, resolved as [`used_paths`] resolves
/// (`None` for a path into another crate; globs are left out): a use of
/// `crate::X` is then a use of `a::X`, and one of `crate::wait` after
/// `pub use shadow_wait as wait;` a use of no file of this crate.
pub fn reexports(module: &str, code: &str) -> Vec<(String, Option<String>)> {
    let children: Vec<String> = declared_mods(code)
        .into_iter()
        .map(|(name, _)| format!("{name}::"))
        .collect();
    let mut out = Vec::new();
    for (start, end) in pub_uses(code) {
        let tree: String = code[start..end]
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ");
        let mut leaves = Vec::new();
        expand("", &tree, &mut leaves);
        for (path, name) in leaves {
            let target = paths_in(module, &format!("{path}\n"), &children)
                .into_iter()
                .next();
            out.push((name, target));
        }
    }
    out
}

/// `code` without its `pub use` items: a re-export names something for
/// the file's users, it is no use by the file's own code.
pub fn without_reexports(code: &str) -> String {
    let mut out = code.to_string();
    for (start, end) in pub_uses(code) {
        out.replace_range(start..end, &" ".repeat(end - start));
    }
    out
}

/// Where the use trees of `code`'s `pub use` and `pub(…) use` items are:
/// from after `use` to before `;`.
fn pub_uses(code: &str) -> Vec<(usize, usize)> {
    let b = code.as_bytes();
    let ident = |x: u8| x.is_ascii_alphanumeric() || x == b'_';
    let mut out = Vec::new();
    let mut i = 0;
    while let Some(at) = code[i..].find("use") {
        let start = i + at;
        i = start + 3;
        let before_ok = start == 0 || !ident(b[start - 1]);
        let after_ok = b.get(i).is_some_and(|x| x.is_ascii_whitespace());
        let before = code[..start].trim_end();
        let public = before.ends_with("pub")
            || before
                .strip_suffix(')')
                .and_then(|t| t.rsplit_once("pub("))
                .is_some_and(|(_, inside)| !inside.contains(['(', ')', ';']));
        if !before_ok || !after_ok || !public {
            continue;
        }
        let Some(end) = code[i..].find(';') else {
            break;
        };
        out.push((i, i + end));
        i += end;
    }
    out
}

/// The leaves of a use tree (`a::{b::X, Y as Z, self}`) under `prefix`:
/// `(path, the name it is known by)`; globs are left out.
fn expand(prefix: &str, tree: &str, out: &mut Vec<(String, String)>) {
    let tree = tree.trim();
    let join = |p: &str| -> String {
        match (prefix.is_empty(), p.is_empty()) {
            (true, _) => p.to_string(),
            (false, true) => prefix.to_string(),
            (false, false) => format!("{prefix}::{p}"),
        }
    };
    if let Some(open) = tree.find('{') {
        let head = tree[..open].trim().trim_end_matches("::");
        let inner = tree[open + 1..].trim_end().trim_end_matches('}');
        let base = join(head);
        let mut depth = 0;
        let mut member = String::new();
        for ch in inner.chars() {
            match ch {
                '{' => depth += 1,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    expand(&base, &member, out);
                    member.clear();
                    continue;
                }
                _ => {}
            }
            member.push(ch);
        }
        expand(&base, &member, out);
        return;
    }
    if tree.is_empty() || tree.ends_with('*') {
        return;
    }
    let (path, alias) = match tree.split_once(" as ") {
        Some((p, a)) => (p.trim(), Some(a.trim())),
        None => (tree, None),
    };
    // `self` in a group names the group's own path.
    let full = if path == "self" {
        prefix.to_string()
    } else {
        join(path)
    };
    let last = full.rsplit("::").next().unwrap_or("");
    let name = alias.unwrap_or(last);
    if !name.is_empty() && name != "_" {
        out.push((full.clone(), name.to_string()));
    }
}
