//! The operator guide, run as written: every ```` ```sh ```` block of
//! `docs/operator-ctr.md` (and of the README's pair section) is executed in
//! order with bash against a private containerd, and every ```` ```text ````
//! block that follows one is the output that block must print. A guide that
//! drifts from what the project does fails `make test` instead of failing
//! an operator.
//!
//! What the test changes, and only this, through wrappers first on `PATH`:
//! - `ctr` talks to the private containerd in the test's namespace, and
//!   `ctr run` gets `--env PORT=<free port>` (the example image's port), so
//!   two runs of the suite never meet on port 8000;
//! - `make install` installs into the test's temp dir from the test build's
//!   `debug` directory (`target/debug`, or under `$CARGO_TARGET_DIR`),
//!   and `make example` builds the image in the test's temp dir and imports
//!   it through that `ctr` without running cargo (the test build made the
//!   binaries);
//! - `shadowctl` reads the private state dir.
//!
//! The text is adapted the same way in commands and expected output:
//! `/usr/local/bin/`, the `default` namespace, `/run/shadow/metrics/`,
//! `127.0.0.1:8000`. Blocks fenced as ```` ```sh host-setup ```` start
//! containerd on a real host; the test has started its own instead.
//!
//! Expected output is matched line by line after trimming and folding runs
//! of white space: `...` inside a line stands for any text, a line that is
//! only `...` for any number of lines (none included). Everything else must
//! match, to the last line.

use shadow_tests::pair::{free_port, PairEnv};
use shadow_tests::{Containerd, Spawned};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// One block may build and import an image: generous, but bounded.
const BLOCK_LIMIT: Duration = Duration::from_secs(240);
const GUIDE: &str = "docs/operator-ctr.md";
const README: &str = "README.md";
/// The README's section that an operator copies.
const README_SECTION: &str = "## Run a pair on this host";

#[derive(Debug, Clone, PartialEq, Eq)]
struct Block {
    info: String,
    body: String,
    /// Line of the opening fence, for messages.
    line: usize,
}

/// The fenced blocks of a Markdown text, in order.
fn blocks(markdown: &str) -> Vec<Block> {
    let mut out = Vec::new();
    let mut open: Option<Block> = None;
    for (n, line) in markdown.lines().enumerate() {
        let fence = line.trim_start().strip_prefix("```");
        match (&mut open, fence) {
            (None, Some(info)) => {
                open = Some(Block {
                    info: info.trim().to_owned(),
                    body: String::new(),
                    line: n + 1,
                })
            }
            (Some(_), Some(_)) => out.extend(open.take()),
            (Some(b), None) => {
                b.body.push_str(line);
                b.body.push('\n');
            }
            (None, None) => {}
        }
    }
    out
}

/// A command block and the output shown after it, if any.
#[derive(Debug)]
struct Step {
    block: Block,
    expect: Option<String>,
}

fn steps(markdown: &str) -> (Vec<Step>, Vec<Block>) {
    let all = blocks(markdown);
    let mut steps = Vec::new();
    let mut host = Vec::new();
    let mut i = 0;
    while i < all.len() {
        let b = &all[i];
        match b.info.as_str() {
            "sh" => {
                let expect = all
                    .get(i + 1)
                    .filter(|n| n.info == "text")
                    .map(|n| n.body.clone());
                i += if expect.is_some() { 2 } else { 1 };
                steps.push(Step {
                    block: b.clone(),
                    expect,
                });
                continue;
            }
            "sh host-setup" => host.push(b.clone()),
            _ => {}
        }
        i += 1;
    }
    (steps, host)
}

fn fold(line: &str) -> String {
    line.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// `pattern` (with `...` wildcards) against one line. A wildcard takes
/// the blanks around it with it: `PID ... STATUS` matches `PID STATUS`.
fn line_matches(pattern: &str, line: &str) -> bool {
    let pattern = pattern.replace(" ...", "...").replace("... ", "...");
    let pieces: Vec<&str> = pattern.split("...").collect();
    if pieces.len() == 1 {
        return pattern == line;
    }
    let (first, last) = (pieces[0], pieces[pieces.len() - 1]);
    if !line.starts_with(first) || line.len() < first.len() + last.len() {
        return false;
    }
    let mut rest = &line[first.len()..line.len() - last.len()];
    if !line.ends_with(last) {
        return false;
    }
    for piece in &pieces[1..pieces.len() - 1] {
        match rest.find(piece) {
            Some(at) => rest = &rest[at + piece.len()..],
            None => return false,
        }
    }
    true
}

/// The whole expected block against the whole output.
fn output_matches(expected: &[String], actual: &[String]) -> bool {
    match expected.split_first() {
        None => actual.is_empty(),
        Some((p, rest)) if p == "..." => {
            (0..=actual.len()).any(|skip| output_matches(rest, &actual[skip..]))
        }
        Some((p, rest)) => match actual.split_first() {
            Some((a, more)) => line_matches(p, a) && output_matches(rest, more),
            None => false,
        },
    }
}

fn folded_lines(text: &str) -> Vec<String> {
    text.lines().map(fold).filter(|l| !l.is_empty()).collect()
}

fn write_script(path: &Path, body: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, body).expect("write wrapper");
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).expect("chmod wrapper");
}

fn which(tool: &str) -> PathBuf {
    let out = Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .output()
        .expect("sh");
    let path = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    assert!(!path.is_empty(), "{tool} is not installed (make deps)");
    PathBuf::from(path)
}

/// Everything the guide's text becomes in this test.
struct Substitutions(Vec<(String, String)>);

impl Substitutions {
    fn apply(&self, text: &str) -> String {
        self.0
            .iter()
            .fold(text.to_owned(), |t, (from, to)| t.replace(from, to))
    }
}

/// The text from `heading` (a whole line) to the next heading of the same
/// or a higher level; line numbers stay those of the file.
fn section(markdown: &str, heading: &str) -> Option<String> {
    let level = heading.chars().take_while(|c| *c == '#').count();
    let mut out = Vec::new();
    let mut inside = false;
    for line in markdown.lines() {
        if inside {
            let hashes = line.chars().take_while(|c| *c == '#').count();
            if hashes > 0 && hashes <= level && line[hashes..].starts_with(' ') {
                break;
            }
        } else if line == heading {
            inside = true;
        }
        // Lines outside keep their place as blanks, for the line numbers.
        out.push(if inside { line } else { "" });
    }
    inside.then(|| out.join("\n"))
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("repo root")
        .to_path_buf()
}

#[test]
fn the_ctr_quickstart_runs_as_written() {
    let markdown = std::fs::read_to_string(repo().join(GUIDE)).expect("read the guide");
    let (steps, host) = steps(&markdown);
    assert!(
        steps.len() >= 8,
        "{GUIDE}: only {} command blocks",
        steps.len()
    );
    run_guide(GUIDE, &steps, &host);
}

#[test]
fn the_readme_pair_section_runs_as_written() {
    let markdown = std::fs::read_to_string(repo().join(README)).expect("read the README");
    let text = section(&markdown, README_SECTION)
        .unwrap_or_else(|| panic!("{README} has no section {README_SECTION:?}"));
    let (steps, host) = steps(&text);
    assert!(
        steps.len() >= 2,
        "{README}: only {} command blocks",
        steps.len()
    );
    run_guide(README, &steps, &host);
}

/// Run `steps` of the file `guide` against a private containerd.
fn run_guide(guide: &str, steps: &[Step], host: &[Block]) {
    let repo = repo();
    for b in host {
        assert!(
            b.body.contains("containerd"),
            "{guide}:{}: a host-setup block is skipped by this test, so it may only start containerd",
            b.line
        );
    }

    let cd = Containerd::builder()
        .env("SHADOW_CONFIG", "@DIR@/shadow-pair.toml")
        .start()
        .expect("containerd");
    let env = PairEnv::new(&cd, "").expect("shim config");
    cd.record_id("eng");
    cd.record_id("hello");
    let port = free_port();
    let prefix = cd.dir().join("prefix");
    let confdir = cd.dir().join("etc/containerd");
    let bin = cd.dir().join("docbin");
    std::fs::create_dir_all(&bin).expect("wrapper dir");

    let ctr = which("ctr");
    let make = which("make");
    // The test build's binaries, wherever cargo put them ($CARGO_TARGET_DIR).
    let shim = shadow_tests::shim_path("debug").expect("the test build's shim");
    let built = shim.parent().expect("the shim's directory").to_path_buf();
    write_script(
        &bin.join("ctr"),
        &format!(
            "#!/bin/sh\nif [ \"$1\" = run ]; then shift; set -- run --env PORT={port} \"$@\"; fi\nexec {} --address {} --namespace {} \"$@\"\n",
            ctr.display(),
            cd.address().display(),
            cd.namespace()
        ),
    );
    write_script(
        &bin.join("shadowctl"),
        &format!(
            "#!/bin/sh\nsub=$1; shift\nexec {}/bin/shadowctl \"$sub\" --state-dir {} \"$@\"\n",
            prefix.display(),
            env.state_dir.display()
        ),
    );
    write_script(
        &bin.join("make"),
        &format!(
            "#!/bin/sh\nm='{make} -C {repo} --no-print-directory'\ncase \"$*\" in\n\
             install) exec $m install PREFIX={prefix} CONFDIR={confdir} INSTALL_FROM={built} ;;\n\
             example) exec $m example EXAMPLE_PROFILE=debug EXAMPLE_OUT={example} CARGO=true CTR={bin}/ctr ;;\n\
             *) echo \"docs test: 'make $*' is not part of the guide's test\" >&2; exit 2 ;;\nesac\n",
            make = make.display(),
            repo = repo.display(),
            prefix = prefix.display(),
            confdir = confdir.display(),
            built = built.display(),
            bin = bin.display(),
            example = cd.dir().join("example").display(),
        ),
    );

    let subs = Substitutions(vec![
        (
            "/usr/local/bin/".into(),
            format!("{}/bin/", prefix.display()),
        ),
        (
            "/run/shadow/metrics/".into(),
            format!("{}/", env.metrics_dir.display()),
        ),
        (
            "-default-eng.prom".into(),
            format!("-{}-eng.prom", cd.namespace()),
        ),
        ("default/eng".into(), format!("{}/eng", cd.namespace())),
        ("127.0.0.1:8000".into(), format!("127.0.0.1:{port}")),
    ]);
    let path = format!(
        "{}:{}/bin:{}",
        bin.display(),
        prefix.display(),
        std::env::var("PATH").unwrap_or_default()
    );

    for step in steps {
        let script = subs.apply(&step.block.body);
        let mut cmd = Command::new("bash");
        cmd.args(["-eo", "pipefail", "-c", &script])
            .current_dir(&repo)
            .env("PATH", &path);
        let out = Spawned::start(cmd, format!("{guide}:{}", step.block.line), false)
            .expect("bash")
            .wait(BLOCK_LIMIT)
            .expect("the block ends");
        assert_eq!(
            out.code(),
            0,
            "{guide}:{}: the block failed:\n{script}\n{out}",
            step.block.line
        );
        if let Some(expect) = &step.expect {
            let expected = folded_lines(&subs.apply(expect));
            let actual = folded_lines(&out.stdout);
            assert!(
                output_matches(&expected, &actual),
                "{guide}:{}: the output differs from the guide's.\n--- guide\n{}\n--- printed\n{}\n--- stderr\n{}",
                step.block.line,
                expected.join("\n"),
                actual.join("\n"),
                out.stderr
            );
        }
    }
    for b in [
        "containerd-shim-shadow-v1",
        "shadowctl",
        "gmsd",
        "shadow-oci-hook",
    ] {
        assert!(
            prefix.join("bin").join(b).is_file(),
            "make install left out {b}"
        );
    }
    assert!(
        confdir.join("shadow.toml").is_file(),
        "make install left out the config"
    );
    cd.assert_no_leftovers();
}

#[test]
fn fenced_blocks_and_outputs_are_paired() {
    let md = "text\n```sh\necho a\n```\nprose\n```text\na\n```\n```sh host-setup\ncontainerd &\n```\n```sh\ntrue\n```\n";
    let (steps, host) = steps(md);
    assert_eq!(steps.len(), 2);
    assert_eq!(steps[0].block.body, "echo a\n");
    assert_eq!(steps[0].expect.as_deref(), Some("a\n"));
    assert_eq!(steps[1].expect, None);
    assert_eq!(host.len(), 1);
    assert_eq!(host[0].line, 9);
}

#[test]
fn a_section_ends_at_the_next_heading_of_its_level() {
    let md = "# T\n## A\na1\n### A.1\na2\n## B\nb\n";
    let a = section(md, "## A").expect("section A");
    assert_eq!(a, "\n## A\na1\n### A.1\na2");
    assert_eq!(section(md, "## C"), None);
}

#[test]
fn expected_output_wildcards() {
    let lines = |t: &str| folded_lines(t);
    assert!(output_matches(&lines("hello"), &lines("hello\n")));
    assert!(!output_matches(&lines("hello"), &lines("hello\nmore\n")));
    assert!(output_matches(&lines("...\nlast"), &lines("a\nb\nlast")));
    assert!(output_matches(&lines("...\nlast"), &lines("last")));
    assert!(!output_matches(&lines("...\nlast"), &lines("last\nnot")));
    assert!(output_matches(
        &lines("TASK PID ... STATUS\neng ... RUNNING"),
        &lines("TASK    PID      STATUS    \neng     4242     RUNNING    \n")
    ));
    assert!(!output_matches(
        &lines("eng ... RUNNING"),
        &lines("eng     4242     STOPPED")
    ));
    assert!(line_matches(
        "{...\"slot\":\"...\"...}",
        "{\"a\":1,\"slot\":\"0\",\"z\":2}"
    ));
    assert!(!line_matches("a...b...c", "a c b"));
    assert!(!line_matches("ab...ba", "aba"));
}
