//! The workspace as it stands: no crate has modules that use each other in
//! a circle. Each fixture below is a small workspace in a temporary
//! directory, with the circle the check must find.

use std::path::Path;

use shadow_layers::workspace;

#[test]
fn no_crate_of_the_workspace_has_a_circle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let faults = workspace::check(&root).unwrap();
    assert!(
        faults.is_empty(),
        "modules of a crate use each other in a circle (see layers/src/workspace.rs):\n{}",
        faults.join("\n")
    );
}

/// A workspace of `files` (`(path, text)`) in a temporary directory.
fn fixture(files: &[(&str, &str)]) -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    for (path, text) in files {
        let p = d.path().join(path);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }
    d
}

const MANIFEST: &str = "[package]\nname = \"names\"\nversion = \"0.1.0\"\n";

/// The circle `shadow-contract` had: env → handoff → fdstore → env.
#[test]
fn the_old_contract_circle_is_found() {
    let d = fixture(&[
        ("Cargo.toml", "[workspace]\nmembers = [\"contract\"]\n"),
        ("contract/Cargo.toml", MANIFEST),
        (
            "contract/src/lib.rs",
            "pub mod env;\npub mod fdstore;\npub mod handoff;\n",
        ),
        (
            "contract/src/env.rs",
            "pub const ACCEPT: &str = crate::handoff::ENV;\npub const NOTIFY: &str = \"N\";\n",
        ),
        (
            "contract/src/handoff.rs",
            "use crate::fdstore::{name_is_valid, NAME_MAX};\npub const ENV: &str = \"A\";\n",
        ),
        (
            "contract/src/fdstore.rs",
            "use crate::env;\npub const NAME_MAX: usize = 255;\n",
        ),
    ]);
    let faults = workspace::check(d.path()).unwrap();
    assert_eq!(faults.len(), 1, "{faults:?}");
    assert!(
        faults[0].starts_with("contract/src/lib.rs: modules use each other: ")
            && faults[0].contains("env")
            && faults[0].contains("handoff")
            && faults[0].contains("fdstore"),
        "{faults:?}"
    );
    // Spelt in env, taken by handoff: no circle.
    std::fs::write(
        d.path().join("contract/src/env.rs"),
        "pub const ACCEPT: &str = \"SHADOW_ACCEPT\";\n",
    )
    .unwrap();
    std::fs::write(
        d.path().join("contract/src/handoff.rs"),
        "use crate::fdstore::NAME_MAX;\npub const ENV: &str = crate::env::ACCEPT;\n",
    )
    .unwrap();
    assert_eq!(workspace::check(d.path()).unwrap(), Vec::<String>::new());
}

/// Every crate root is read: binaries, nested ones, integration tests with
/// a module directory of their own; a child reaching its parent while the
/// parent uses it by its bare name is a circle too.
#[test]
fn every_root_and_bare_child_paths_are_read() {
    let d = fixture(&[
        ("Cargo.toml", "[workspace]\nmembers = [\"a\"]\n"),
        (
            "a/Cargo.toml",
            "[package]\nname = \"a\"\nversion = \"0.1.0\"\n[[bin]]\nname = \"tool\"\npath = \"src/tools/tool.rs\"\n",
        ),
        ("a/src/lib.rs", "pub fn f() {}\n"),
        (
            "a/src/tools/tool.rs",
            "mod engine;\nfn main() { engine::run(); }\npub struct Config;\n",
        ),
        (
            "a/src/tools/engine/mod.rs",
            "mod accept;\npub fn run() { accept::go() }\n",
        ),
        (
            "a/src/tools/engine/accept.rs",
            "pub fn go() { let _ = crate::Config; }\n",
        ),
        ("a/tests/it.rs", "mod common;\n#[test]\nfn t() {}\n"),
        (
            "a/tests/common/mod.rs",
            "pub mod x;\npub mod y;\nuse self::x::X;\n",
        ),
        ("a/tests/common/x.rs", "pub struct X;\nuse super::y::Y;\n"),
        ("a/tests/common/y.rs", "pub struct Y;\n"),
    ]);
    let faults = workspace::check(d.path()).unwrap();
    assert_eq!(faults.len(), 1, "{faults:?}");
    assert_eq!(
        faults[0],
        "a/src/tools/tool.rs: modules use each other: crate → engine → engine::accept → crate"
    );
    // y using x closes a circle through the test's module directory.
    std::fs::write(
        d.path().join("a/tests/common/y.rs"),
        "pub struct Y;\nuse super::x::X;\n",
    )
    .unwrap();
    let faults = workspace::check(d.path()).unwrap();
    assert_eq!(faults.len(), 2, "{faults:?}");
    assert!(
        faults[1].starts_with("a/tests/it.rs: modules use each other: common::x → common::y"),
        "{faults:?}"
    );
}

/// Tests, comments and strings are no uses.
#[test]
fn tests_comments_and_strings_are_not_uses() {
    let d = fixture(&[
        ("Cargo.toml", "[workspace]\nmembers = [\"a\"]\n"),
        ("a/Cargo.toml", MANIFEST),
        ("a/src/lib.rs", "mod p;\nmod q;\n"),
        ("a/src/p.rs", "pub fn f() { crate::q::g() }\n"),
        (
            "a/src/q.rs",
            "//! Unlike crate::p, …\npub fn g() { let _ = \"crate::p::f\"; }\n#[cfg(test)]\nmod tests {\n    use crate::p::f;\n}\n",
        ),
    ]);
    assert_eq!(workspace::check(d.path()).unwrap(), Vec::<String>::new());
}

/// A re-export is a name, not a use: a root that re-exports its children's
/// items, and children that take them through the root (`crate::Error`),
/// make no circle; an item the root defines itself does.
#[test]
fn uses_through_reexports_reach_where_the_item_is() {
    let d = fixture(&[
        ("Cargo.toml", "[workspace]\nmembers = [\"a\"]\n"),
        ("a/Cargo.toml", MANIFEST),
        (
            "a/src/lib.rs",
            "mod error;\npub mod mapper;\npub use error::{Error, Result as R};\npub use mapper::Access;\npub use std::time as clock;\n",
        ),
        ("a/src/error.rs", "pub struct Error;\npub type Result = ();\n"),
        (
            "a/src/mapper.rs",
            "use crate::{Error, R};\nuse crate::clock::Duration;\npub struct Access;\n",
        ),
    ]);
    assert_eq!(workspace::check(d.path()).unwrap(), Vec::<String>::new());
    std::fs::write(
        d.path().join("a/src/lib.rs"),
        "mod error;\npub mod mapper;\npub use error::{Error, Result as R};\npub use std::time as clock;\npub struct Root;\nfn f() { let _ = mapper::Access; }\n",
    )
    .unwrap();
    std::fs::write(
        d.path().join("a/src/mapper.rs"),
        "use crate::{Error, R};\npub struct Access;\nfn g() { let _ = crate::Root; }\n",
    )
    .unwrap();
    let faults = workspace::check(d.path()).unwrap();
    assert_eq!(
        faults,
        ["a/src/lib.rs: modules use each other: crate → mapper → crate"]
    );
}
