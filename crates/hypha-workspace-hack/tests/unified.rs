//! The promise of this crate: building one program after the workspace rebuilds nothing,
//! because every dependency is built with the same features whichever package is selected.
//! Checked with `cargo tree` (the resolver's view, no build); when it fails, regenerate the
//! crate with `cargo hakari generate` (`cargo install cargo-hakari`).

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::{
    collections::{BTreeMap, BTreeSet},
    path::Path,
    process::Command,
};

/// The workspace's root.
fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .and_then(Path::parent)
        .unwrap()
}

fn cargo(args: &[&str]) -> String {
    let output = Command::new(env!("CARGO"))
        .args(args)
        .current_dir(root())
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "cargo {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap()
}

/// Every registry dependency with the features it is built with, host and target together,
/// when cargo builds `selection` (no selection: the default members).
fn features(selection: &[&str]) -> BTreeMap<String, BTreeSet<String>> {
    let mut args = vec![
        "tree",
        "--locked",
        "--edges",
        "normal,build",
        "--prefix",
        "none",
        "--format",
        "{p}|{f}",
    ];
    args.extend(selection);
    let mut features: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    // A package seen before ends in " (*)"; its features are the same on every line.
    for line in cargo(&args).lines().map(|l| l.trim_end_matches(" (*)")) {
        let Some((package, enabled)) = line.split_once('|') else {
            continue;
        };
        if package.contains(&*root().to_string_lossy()) {
            continue; // our own crates
        }
        let package = package.trim().to_string();
        features.entry(package).or_default().extend(
            enabled
                .split(',')
                .filter(|f| !f.is_empty())
                .map(String::from),
        );
    }
    features
}

/// The workspace's members and default members, by name, and which have programs.
fn members() -> (Vec<String>, BTreeSet<String>, BTreeSet<String>) {
    let metadata: serde_json::Value = serde_json::from_str(&cargo(&[
        "metadata",
        "--locked",
        "--no-deps",
        "--format-version",
        "1",
    ]))
    .unwrap();
    let name_of = |id: &serde_json::Value| {
        metadata["packages"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["id"] == *id)
            .map(|p| p["name"].as_str().unwrap().to_string())
            .unwrap()
    };
    let all: Vec<String> = metadata["workspace_members"]
        .as_array()
        .unwrap()
        .iter()
        .map(name_of)
        .collect();
    let defaults = metadata["workspace_default_members"]
        .as_array()
        .unwrap()
        .iter()
        .map(name_of)
        .collect();
    let programs = metadata["packages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| {
            p["targets"]
                .as_array()
                .unwrap()
                .iter()
                .any(|t| t["kind"].as_array().unwrap().iter().any(|k| k == "bin"))
        })
        .map(|p| p["name"].as_str().unwrap().to_string())
        .collect();
    (all, defaults, programs)
}

#[test]
fn every_crate_but_the_benchmarks_and_their_test_parts_is_built_by_cargo_build() {
    let (all, defaults, _) = members();
    let missing: Vec<&String> = all
        .iter()
        .filter(|m| !["hypha-bench", "hypha-testing"].contains(&m.as_str()))
        .filter(|m| !defaults.contains(*m))
        .collect();
    assert!(
        missing.is_empty(),
        "add {missing:?} to default-members in the workspace's Cargo.toml"
    );
}

#[test]
fn building_one_program_after_the_workspace_builds_its_dependencies_alike() {
    let (_, _, programs) = members();
    let workspace = features(&[]);
    let mut differing = Vec::new();
    for program in &programs {
        for (package, enabled) in features(&["--package", program]) {
            if let Some(built) = workspace.get(&package)
                && *built != enabled
            {
                let only_here: Vec<_> = enabled.difference(built).collect();
                let only_there: Vec<_> = built.difference(&enabled).collect();
                differing.push(format!(
                    "{program}: {package} with {only_here:?} and without {only_there:?}"
                ));
            }
        }
    }
    assert!(
        differing.is_empty(),
        "building a program alone would rebuild these; run `cargo hakari generate` and `cargo hakari manage-deps`:\n{}",
        differing.join("\n")
    );
}
