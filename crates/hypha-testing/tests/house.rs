//! Rules of the house that hold for the whole workspace.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::path::Path;

/// What `script` (of `scripts/`) printed over the workspace's crates, `args` before them;
/// none when there is no python3 to run it (the test says it skipped).
fn run_script(script: &str, args: &[&str]) -> Option<(bool, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let output = match std::process::Command::new("python3")
        .arg(root.join("scripts").join(script))
        .args(args)
        .arg(root.join("crates"))
        .output()
    {
        Ok(output) => output,
        Err(e) => {
            eprintln!("skipped: no python3 to run scripts/{script} ({e})");
            return None;
        }
    };
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    Some((output.status.success(), report))
}

/// No crate's modules import each other in a circle (`scripts/module-circles.py` finds them:
/// `crate::` and `super::` paths between module files, comments and test modules left out).
#[test]
fn no_crate_has_a_circle_of_module_imports() {
    let Some((ok, report)) = run_script("module-circles.py", &[]) else {
        return;
    };
    assert!(ok, "module import circles:\n{report}");
    assert!(report.contains("circles: 0"), "{report}");
}

/// No product function is longer than 120 lines (`scripts/long-functions.py` counts a
/// function's lines by its braces; test code is left out): split one that grows past it into
/// named steps.
#[test]
fn no_product_function_is_longer_than_120_lines() {
    let Some((ok, report)) = run_script("long-functions.py", &["120"]) else {
        return;
    };
    assert!(ok, "functions longer than 120 lines:\n{report}");
    assert!(report.contains("0 function(s) longer"), "{report}");
}
