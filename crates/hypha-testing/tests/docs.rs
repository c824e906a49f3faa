//! Every `sh` block of README.md and `docs/` runs here, the way a reader would run it: in a
//! fresh directory per document that holds the repository's documents and `python/` (the
//! blocks' paths are relative to a clone's root), each block after the one before it, under
//! `bash -euo pipefail`. `docs/deploy.md`'s blocks name the machine they run on (`sh on=…`) and
//! run across sites behind NATs in `hypha-scheduler/tests/deploy.rs`; every other `sh` block
//! runs here, so a command the documentation shows that no longer works fails a test.
//!
//! What differs from a reader's machine, and why:
//! - `target/release` is the directory of the binaries `cargo test` built (debug builds of the
//!   same programs: a release build would double CI's build time);
//! - `cargo build` does nothing (those binaries are built), and `cargo test …` is not run
//!   (it would run the suite inside itself) but checked: the package, each `--test` target and
//!   the name filter must exist, and README's test command must be the one `.ci/run` runs;
//! - [`SMALLER`] lists the few replacements that make a long run short (a model of GPT-2's
//!   shape takes minutes a round on two cores); each must match the text, so the list cannot
//!   go stale.
//!
//! `docs/config-reference.md` is generated: every node program's `init` output, which the
//! program makes from its keys (name, type, default, what it does). A test fails when it
//! differs; `HYPHA_UPDATE_DOCS=1 cargo test -p hypha-testing --test docs` writes it again.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use hypha_testing::cluster::bin;

/// Replacements in a document's blocks before they run: (document, text, replacement, why).
const SMALLER: &[(&str, &str, &str, &str)] = &[(
    "docs/data.md",
    r#""dim": 768, "heads": 12, "layers": 12"#,
    r#""dim": 64, "heads": 4, "layers": 2"#,
    "GPT-2-small's shape trains at 2.6 s a batch in a release build",
)];

/// The node programs whose keys the configuration reference lists, in its order.
const NODE_PROGRAMS: &[&str] = &[
    "hypha-gateway",
    "hypha-data",
    "hypha-worker",
    "hypha-scheduler",
];

/// The longest one block may take.
const BLOCK_LIMIT: Duration = Duration::from_secs(300);

/// The programs the blocks call.
const PROGRAMS: &[&str] = &[
    "hypha",
    "hypha-certutil",
    "hypha-data",
    "hypha-gateway",
    "hypha-worker",
    "hypha-scheduler",
    "hypha-executor",
];

fn repository() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The documents whose `sh` blocks run here.
fn documents() -> Vec<PathBuf> {
    let root = repository();
    let mut documents = vec![root.join("README.md")];
    let mut chapters: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|e| e == "md"))
        .filter(|path| !path.ends_with("deploy.md"))
        .collect();
    chapters.sort();
    documents.extend(chapters);
    documents
}

/// The `sh` blocks of a document, in order. A block that names a machine (`sh on=…`) belongs
/// to the deploy guide's test, and is refused anywhere else.
fn sh_blocks(document: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(document).unwrap();
    let mut blocks = Vec::new();
    let mut lines = text.lines();
    while let Some(line) = lines.next() {
        let Some(info) = line.strip_prefix("```") else {
            continue;
        };
        let body: Vec<&str> = lines.by_ref().take_while(|l| *l != "```").collect();
        if info.split_whitespace().next() != Some("sh") {
            continue;
        }
        assert_eq!(
            info.trim(),
            "sh",
            "{}: a block with settings ({info}) runs nowhere outside docs/deploy.md",
            document.display()
        );
        blocks.push(body.join("\n"));
    }
    blocks
}

/// A fresh directory laid out like a clone's root, as far as the blocks read it.
fn workspace(bin_dir: &Path) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let root = repository().canonicalize().unwrap();
    for name in ["README.md", "BENCHMARKS.md", "docs", "python"] {
        std::os::unix::fs::symlink(root.join(name), dir.path().join(name)).unwrap();
    }
    std::fs::create_dir(dir.path().join("target")).unwrap();
    std::os::unix::fs::symlink(bin_dir, dir.path().join("target/release")).unwrap();
    dir
}

/// What every block runs after: stop on the first failure, stop what it started in the
/// background, and record `cargo test` instead of running it.
const PRELUDE: &str = r#"set -euo pipefail
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT
cargo() {
    case "$1" in
        build) ;;
        test) printf '%s\n' "$*" >> "$CARGO_TESTS" ;;
        *) echo "the documentation runs cargo $1, which this test does not know" >&2; return 1 ;;
    esac
}
"#;

/// Runs `script` in `dir`; its output, or a failure with it.
fn run_block(dir: &Path, script: &str, cargo_tests: &Path) -> Result<String, String> {
    let log = dir.join(".block.log");
    let mut child = Command::new("bash")
        .arg("-c")
        .arg(format!("{PRELUDE}{script}\n"))
        .current_dir(dir)
        .env("CARGO_TESTS", cargo_tests)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&log).unwrap())
        .stderr(std::fs::File::options().append(true).open(&log).unwrap())
        .spawn()
        .unwrap();
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if started.elapsed() > BLOCK_LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let output = std::fs::read_to_string(&log).unwrap_or_default();
    match status {
        Some(status) if status.success() => Ok(output),
        Some(status) => Err(format!("{status}:\n{output}")),
        None => Err(format!("still running after {BLOCK_LIMIT:?}:\n{output}")),
    }
}

/// Checks a recorded `cargo test …` against the workspace: its package, test targets and
/// name filter exist.
fn check_cargo_test(command: &str) {
    let root = repository();
    let words: Vec<&str> = command.split_whitespace().collect();
    assert_eq!(words.first(), Some(&"test"), "{command}");
    let mut package = None;
    let mut targets = Vec::new();
    let mut filter = None;
    let mut rest = words[1..].iter();
    while let Some(word) = rest.next() {
        match *word {
            "-p" | "--package" => package = rest.next().copied(),
            "--test" => targets.extend(rest.next().copied()),
            "--workspace" | "--release" => {}
            flag if flag.starts_with('-') => panic!("{command}: a flag this test does not know"),
            name => filter = Some(name),
        }
    }
    let Some(package) = package else {
        assert!(
            words.contains(&"--workspace") && targets.is_empty() && filter.is_none(),
            "{command}"
        );
        let ci = std::fs::read_to_string(root.join(".ci/run")).unwrap();
        let last = ci.lines().rev().find(|l| !l.trim().is_empty()).unwrap();
        assert_eq!(
            format!("cargo {command}"),
            last.trim(),
            "the documentation's test command is not the one CI runs"
        );
        return;
    };
    let crate_dir = root.join("crates").join(package);
    assert!(
        crate_dir.join("Cargo.toml").exists(),
        "{command}: no package {package}"
    );
    let sources: Vec<PathBuf> = if targets.is_empty() {
        std::fs::read_dir(crate_dir.join("tests"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "rs"))
            .collect()
    } else {
        targets
            .iter()
            .map(|target| {
                let path = crate_dir.join("tests").join(format!("{target}.rs"));
                assert!(path.exists(), "{command}: no test target {target}");
                path
            })
            .collect()
    };
    if let Some(filter) = filter {
        let found = sources.iter().any(|path| {
            std::fs::read_to_string(path)
                .unwrap()
                .lines()
                .filter_map(|l| l.trim_start().strip_prefix("fn "))
                .any(|name| name.contains(filter))
        });
        assert!(found, "{command}: no test's name holds {filter}");
    }
}

#[test]
fn every_shell_block_of_the_readme_and_the_docs_runs() {
    let bin_dir = {
        let mut dir = None;
        for program in PROGRAMS {
            dir = bin(program).parent().map(Path::to_path_buf);
        }
        dir.unwrap()
    };
    let mut ran = 0;
    for document in documents() {
        let name = document
            .strip_prefix(repository())
            .unwrap()
            .display()
            .to_string();
        let blocks = sh_blocks(&document);
        if blocks.is_empty() {
            continue;
        }
        let dir = workspace(&bin_dir);
        let cargo_tests = dir.path().join(".cargo-tests");
        for (index, block) in blocks.iter().enumerate() {
            let mut script = block.clone();
            for (_, text, replacement, why) in SMALLER.iter().filter(|s| s.0 == name) {
                if script.contains(text) {
                    eprintln!("{name}: {text} → {replacement} ({why})");
                    script = script.replace(text, replacement);
                }
            }
            let started = Instant::now();
            match run_block(dir.path(), &script, &cargo_tests) {
                Ok(_) => eprintln!(
                    "{name}, block {}: ran in {:.1} s",
                    index + 1,
                    started.elapsed().as_secs_f64()
                ),
                Err(failure) => panic!(
                    "{name}, block {}:\n{script}\n\nfailed: {failure}",
                    index + 1
                ),
            }
            ran += 1;
        }
        for (_, text, ..) in SMALLER.iter().filter(|s| s.0 == name) {
            assert!(
                blocks.iter().any(|b| b.contains(text)),
                "{name} no longer holds {text}: remove it from SMALLER"
            );
        }
        if let Ok(recorded) = std::fs::read_to_string(&cargo_tests) {
            for command in recorded.lines() {
                check_cargo_test(command);
            }
        }
    }
    for (document, ..) in SMALLER {
        assert!(
            repository().join(document).exists(),
            "SMALLER names {document}, which is gone"
        );
    }
    assert!(ran >= 5, "{ran} blocks ran");
}

/// The configuration reference as the programs make it now.
fn config_reference() -> String {
    let dir = tempfile::tempdir().unwrap();
    let mut out = String::from(
        "# Configuration reference\n\n\
         Back to [configuration](configuration.md), which says how settings are layered.\n\n\
         Generated: each section is what the program's `init` writes, every key with its \
         default and what it does (a key commented out is unset by default). Do not edit: \
         `HYPHA_UPDATE_DOCS=1 cargo test -p hypha-testing --test docs` writes it again, and a \
         test fails while it differs from what the programs write.\n",
    );
    for program in NODE_PROGRAMS {
        let path = dir.path().join(format!("{program}.toml"));
        let status = Command::new(bin(program))
            .arg("init")
            .arg("-o")
            .arg(&path)
            .stdout(Stdio::null())
            .status()
            .unwrap();
        assert!(status.success(), "{program} init");
        let template = std::fs::read_to_string(&path).unwrap();
        out.push_str(&format!(
            "\n## {program}\n\n`{program} init -o {program}.toml`:\n\n```toml\n{}\n```\n",
            template.trim_end()
        ));
    }
    out
}

#[test]
fn the_configuration_reference_is_what_the_programs_write() {
    let path = repository().join("docs/config-reference.md");
    let now = config_reference();
    if std::env::var_os("HYPHA_UPDATE_DOCS").is_some() {
        std::fs::write(&path, &now).unwrap();
        return;
    }
    let written = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        written == now,
        "docs/config-reference.md is stale: a key, its default or its text changed. Write it \
         again with `HYPHA_UPDATE_DOCS=1 cargo test -p hypha-testing --test docs`"
    );
}
