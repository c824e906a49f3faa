//! `hypha quickstart` end to end with small settings: the real binaries train a model and the
//! quickstart leaves the files it promises, with the evaluation loss fallen and no ERROR line
//! in any process's log.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::{path::Path, process::Command};

/// The workspace's binaries the quickstart starts; `cargo test --workspace` builds them all,
/// a lone `cargo test -p hypha` may not, so missing ones are built here.
fn ensure_built(bin_dir: &Path) {
    for name in [
        "hypha-gateway",
        "hypha-data",
        "hypha-worker",
        "hypha-scheduler",
        "hypha-executor",
    ] {
        if !bin_dir.join(name).exists() {
            let status = Command::new(env!("CARGO"))
                .args(["build", "--quiet", "--package", name, "--bin", name])
                .status()
                .unwrap();
            assert!(status.success(), "building {name}");
        }
    }
}

#[test]
fn quickstart_trains_a_model_and_leaves_its_files() {
    let hypha = Path::new(env!("CARGO_BIN_EXE_hypha"));
    ensure_built(hypha.parent().unwrap());
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("quick");
    let output = Command::new(hypha)
        .args(["quickstart", "--dir"])
        .arg(&dir)
        .args([
            "--rounds",
            "4",
            "--slices",
            "16",
            "--samples-per-slice",
            "64",
            "--samples-per-round",
            "384",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "quickstart failed:\n{stdout}\n{stderr}"
    );

    for file in ["model.safetensors", "metrics.jsonl", "loss.svg", "job.toml"] {
        assert!(
            dir.join(file).exists(),
            "{file} missing; it printed:\n{stdout}"
        );
    }
    let rounds = std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter(|l| l.contains("\"kind\":\"round\""))
        .count();
    assert_eq!(rounds, 4);
    assert!(
        std::fs::read_to_string(dir.join("loss.svg"))
            .unwrap()
            .contains("<polyline")
    );

    // "evaluation loss A → B": B < A.
    let line = stdout
        .lines()
        .find(|l| l.starts_with("evaluation loss"))
        .unwrap();
    let numbers: Vec<f64> = line
        .split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .filter_map(|t| t.parse().ok())
        .collect();
    assert!(numbers[1] < numbers[0], "{line}");

    for log in std::fs::read_dir(dir.join("logs")).unwrap() {
        let log = log.unwrap().path();
        let text = std::fs::read_to_string(&log).unwrap();
        let errors: Vec<&str> = text.lines().filter(|l| l.contains("ERROR")).collect();
        assert!(errors.is_empty(), "{}: {errors:#?}", log.display());
    }
}
