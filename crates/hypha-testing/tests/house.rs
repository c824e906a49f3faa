//! Rules of the house that hold for the whole workspace.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::path::Path;

/// No crate's modules import each other in a circle (`scripts/module-circles.py` finds them:
/// `crate::` and `super::` paths between module files, comments and test modules left out).
#[test]
fn no_crate_has_a_circle_of_module_imports() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let output = match std::process::Command::new("python3")
        .arg(root.join("scripts/module-circles.py"))
        .arg(root.join("crates"))
        .output()
    {
        Ok(output) => output,
        Err(e) => {
            eprintln!("skipped: no python3 to run scripts/module-circles.py ({e})");
            return;
        }
    };
    let report = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "module import circles:\n{report}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(report.contains("circles: 0"), "{report}");
}
