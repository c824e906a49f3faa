//! `hypha-data` as a user runs it: real processes, real certificates, loopback TCP.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::{
    io::{BufRead, BufReader},
    path::Path,
    process::{Command, Stdio},
    sync::mpsc,
    time::Duration,
};

use hypha_certs::{
    Role, Roles,
    authority::{self, Validity},
};
use hypha_dataset::slice;

const BIN: &str = env!("CARGO_BIN_EXE_hypha-data");

/// A child process that is killed if the test fails before stopping it.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn certificates(dir: &Path) {
    let root = authority::create_root("CLI Root", Validity::days(2)).unwrap();
    let org = authority::create_org(&root, "CLI Org", Validity::days(2)).unwrap();
    std::fs::write(dir.join("root.pem"), root.cert_pem()).unwrap();
    // A client that reads a data node's slices needs no role; one that iterates, the worker's.
    for (name, roles) in [
        ("data", Roles::NONE.with(Role::Data)),
        ("fetcher", Roles::NONE),
        ("consumer", Roles::NONE.with(Role::Worker)),
    ] {
        let node = authority::create_node(&org, name, &[], roles, Validity::days(1)).unwrap();
        std::fs::write(dir.join(format!("{name}-cert.pem")), node.chain_pem()).unwrap();
        std::fs::write(dir.join(format!("{name}-key.pem")), node.key_pem()).unwrap();
    }
}

/// A dataset directory of `count` Snappy slices, slice i holding `len` bytes of value i.
fn write_dataset(dir: &Path, count: u8, len: usize) {
    std::fs::create_dir(dir).unwrap();
    for i in 0..count {
        std::fs::write(
            dir.join(format!("slice-{i}.safetensors")),
            snappy_slice(&vec![i; len]),
        )
        .unwrap();
    }
}

fn snappy_slice(values: &[u8]) -> Vec<u8> {
    let tensors = slice::Tensors::new()
        .with(
            "tokens",
            slice::Dtype::U8,
            vec![values.len()],
            values.to_vec(),
        )
        .unwrap();
    slice::encode(&tensors, slice::Encoding::Snappy).unwrap()
}

/// Starts `hypha-data run --config config` and waits for its address; returns the process,
/// its stderr lines (those read so far, and a channel for the rest) and `address/p2p/id`.
fn start_node(config: &Path) -> (KillOnDrop, mpsc::Receiver<String>, Vec<String>, String) {
    let mut node = KillOnDrop(
        Command::new(BIN)
            .args(["run", "--config"])
            .arg(config)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let (tx, lines) = mpsc::channel();
    let stderr = node.0.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let (mut address, mut peer, mut seen) = (None, None, Vec::new());
    while address.is_none() || peer.is_none() {
        let line = lines
            .recv_timeout(Duration::from_secs(30))
            .unwrap_or_else(|_| panic!("{seen:#?}"));
        if let Some(a) = line.split("listening address=").nth(1) {
            address = Some(a.trim().to_string());
        }
        if let Some(p) = line.split("peer_id=").nth(1) {
            peer = Some(p.split_whitespace().next().unwrap().to_string());
        }
        seen.push(line);
    }
    let node_address = format!("{}/p2p/{}", address.unwrap(), peer.unwrap());
    (node, lines, seen, node_address)
}

#[test]
fn serve_fetch_inspect_and_verify() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    certificates(dir);
    let data = dir.join("wikitext");
    write_dataset(&data, 3, 4096);
    std::fs::write(
        dir.join("data.toml"),
        "cert_pem = \"data-cert.pem\"\nkey_pem = \"data-key.pem\"\ntrust_pem = \"root.pem\"\nlisten_addresses = [\"/ip4/127.0.0.1/tcp/0\"]\ndataset_path = \"wikitext\"\n",
    )
    .unwrap();

    let out = Command::new(BIN)
        .arg("inspect")
        .arg(&data)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(
        text.contains("slices       3")
            && text.contains("samples      12288")
            && text.contains("compression"),
        "{text}"
    );
    assert!(text.contains("tokens") && text.contains("U8"), "{text}");

    let (mut node, lines, seen, node_address) = start_node(&dir.join("data.toml"));

    let flags = |cmd: &mut Command| {
        cmd.arg("--cert-pem")
            .arg(dir.join("fetcher-cert.pem"))
            .arg("--key-pem")
            .arg(dir.join("fetcher-key.pem"))
            .arg("--trust-pem")
            .arg(dir.join("root.pem"));
    };
    let mut probe = Command::new(BIN);
    probe.args(["probe", &node_address]);
    flags(&mut probe);
    let out = probe.output().unwrap();
    assert!(out.status.success(), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("serving wikitext"));

    // The data node doubles as the fetcher's entry point into the DHT. The slice arrives as
    // a plain SafeTensors file that any SafeTensors reader opens.
    let fetch_slice = |index: &str, dest: &Path, extra: &[&str]| {
        let mut fetch = Command::new(BIN);
        fetch
            .args([
                "fetch",
                "--dataset",
                "wikitext",
                "--slice",
                index,
                "--gateway",
                &node_address,
                "-o",
            ])
            .arg(dest)
            .args(extra);
        flags(&mut fetch);
        fetch.output().unwrap()
    };
    let dest = dir.join("got.safetensors");
    let out = fetch_slice("2", &dest, &[]);
    assert!(out.status.success(), "{out:?}");
    let bytes = std::fs::read(&dest).unwrap();
    let tensors = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let tokens = tensors.tensor("tokens").unwrap();
    assert_eq!(tokens.shape(), [4096]);
    assert!(tokens.data().iter().all(|&b| b == 2));
    let raw = dir.join("raw.safetensors");
    let out = fetch_slice("2", &raw, &["--raw"]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        std::fs::read(&raw).unwrap(),
        std::fs::read(data.join("slice-2.safetensors")).unwrap()
    );

    let mut fetch = Command::new(BIN);
    fetch.args([
        "fetch",
        "--dataset",
        "wikitext",
        "--slice",
        "3",
        "--gateway",
        &node_address,
    ]);
    flags(&mut fetch);
    let out = fetch.output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(2),
        "slice == count is the user's mistake: {out:?}"
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("has slices 0..3"));

    // The dataset came without a manifest: the node stored the one it derived, so a bit
    // flipped after the first serve (silently: the file keeps its time) is refused by a
    // fetcher and named by verify.
    assert!(data.join(hypha_dataset::MANIFEST_FILE).exists());
    hypha_dataset::testing::flip_a_bit_silently(&data.join("slice-1.safetensors"));
    let out = fetch_slice("1", &dir.join("bad.safetensors"), &[]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(!dir.join("bad.safetensors").exists());

    Command::new("kill")
        .args(["-TERM", &node.0.id().to_string()])
        .status()
        .unwrap();
    assert!(node.0.wait().unwrap().success());
    let rest: Vec<String> = lines.try_iter().collect();
    assert!(
        !seen.iter().chain(&rest).any(|l| l.contains("ERROR")),
        "{seen:#?}{rest:#?}"
    );

    // verify: the flipped slice and a truncated one each on a BAD line, the third checked,
    // exit 1.
    let truncated = data.join("slice-2.safetensors");
    let bytes = std::fs::read(&truncated).unwrap();
    std::fs::write(&truncated, &bytes[..bytes.len() - 3]).unwrap();
    let out = Command::new(BIN).arg("verify").arg(&data).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let bad: Vec<&str> = stdout.lines().filter(|l| l.starts_with("BAD")).collect();
    assert_eq!(bad.len(), 2, "{stdout}");
    assert!(bad[0].contains("slice 1 (slice-1.safetensors)") && bad[0].contains("corrupted"));
    assert!(bad[1].contains("slice 2 (slice-2.safetensors)") && bad[1].contains("truncated"));
}

#[test]
fn verify_without_a_manifest_names_each_undecodable_slice_and_checks_the_rest() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("seed");
    write_dataset(&data, 4, 1000);
    let truncated = data.join("slice-1.safetensors");
    let bytes = std::fs::read(&truncated).unwrap();
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    let out = Command::new(BIN)
        .arg("verify")
        .arg(&data)
        .args(["--manifest-dir"])
        .arg(tmp.path().join("none"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let bad: Vec<&str> = stdout.lines().filter(|l| l.starts_with("BAD")).collect();
    assert_eq!(bad.len(), 1, "{stdout}");
    assert!(bad[0].contains("slice-1.safetensors") && bad[0].contains("undecodable"));
    assert!(stdout.contains("no stored manifest"), "{stdout}");
    assert!(
        !data.join(hypha_dataset::MANIFEST_FILE).exists(),
        "verify only reads"
    );
}

#[test]
fn a_missing_dataset_is_bad_input() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    certificates(dir);
    std::fs::write(
        dir.join("data.toml"),
        "cert_pem = \"data-cert.pem\"\nkey_pem = \"data-key.pem\"\ntrust_pem = \"root.pem\"\ndataset_path = \"nowhere\"\n",
    )
    .unwrap();
    let out = Command::new(BIN)
        .args(["run", "--config"])
        .arg(dir.join("data.toml"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("data.toml:4:1: dataset_path") && stderr.contains("fix:"),
        "{stderr}"
    );
}

#[test]
fn prepare_writes_a_dataset_that_serves_and_refuses_to_overwrite() {
    let tmp = tempfile::tempdir().unwrap();
    let corpus = tmp.path().join("corpus.jsonl");
    std::fs::write(
        &corpus,
        "{\"text\": \"hello hypha\"}\n{\"text\": \"second document\"}\n",
    )
    .unwrap();
    let out_dir = tmp.path().join("datasets").join("corpus");
    let run = || {
        Command::new(BIN)
            .arg("prepare")
            .arg(&corpus)
            .arg("-o")
            .arg(&out_dir)
            .args(["--sequence-length", "8", "--slice-size", "2"])
            .output()
            .unwrap()
    };
    let out = run();
    assert!(out.status.success(), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("2 slices, 4 samples"),
        "{out:?}"
    );
    let dataset = hypha_dataset::Dataset::open(&out_dir).unwrap();
    assert_eq!(dataset.name(), "corpus");
    assert!(out_dir.join(hypha_dataset::MANIFEST_FILE).exists());

    let out = run();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--force"));
}

#[test]
fn clients_of_one_iteration_get_disjoint_slices_covering_the_node_each_epoch() {
    const SLICES: u64 = 30;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    certificates(dir);
    let data = dir.join("tokens");
    write_dataset(&data, SLICES as u8, 512);
    std::fs::write(
        dir.join("data.toml"),
        "cert_pem = \"data-cert.pem\"\nkey_pem = \"data-key.pem\"\ntrust_pem = \"root.pem\"\nlisten_addresses = [\"/ip4/127.0.0.1/tcp/0\"]\ndataset_path = \"tokens\"\niteration_dir = \"iterations\"\n",
    )
    .unwrap();
    let (_node, _lines, _seen, node_address) = start_node(&dir.join("data.toml"));

    let client = |name: &str| {
        let mut cmd = Command::new(BIN);
        cmd.args([
            "iterate",
            "--dataset",
            "tokens",
            "--iteration",
            "run-1",
            "--epochs",
            "2",
            "--seed",
            "9",
            "--batch",
            "3",
            "--client",
            name,
            "--gateway",
            &node_address,
            "--cert-pem",
        ])
        .arg(dir.join("consumer-cert.pem"))
        .arg("--key-pem")
        .arg(dir.join("consumer-key.pem"))
        .arg("--trust-pem")
        .arg(dir.join("root.pem"))
        .arg("--output")
        .arg(dir.join(name))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
        cmd.spawn().unwrap()
    };
    let (a, b) = (client("a"), client("b"));
    let outputs = [a.wait_with_output().unwrap(), b.wait_with_output().unwrap()];

    // (epoch, slice) → how many clients got it.
    let mut got = std::collections::HashMap::<(u32, u64), u32>::new();
    for (name, out) in ["a", "b"].iter().zip(&outputs) {
        assert!(out.status.success(), "{out:?}");
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let words: Vec<&str> = line.split_whitespace().collect();
            assert_eq!(words[0], "epoch", "{line}");
            let (epoch, slice) = (words[1].parse().unwrap(), words[3].parse::<u64>().unwrap());
            *got.entry((epoch, slice)).or_default() += 1;
            // The slice arrived, byte-exact.
            let path = Path::new(words[6]);
            assert!(path.starts_with(dir.join(name)), "{line}");
            assert_eq!(
                std::fs::read(path).unwrap(),
                std::fs::read(data.join(format!("slice-{slice}.safetensors"))).unwrap()
            );
        }
    }
    for epoch in 0..2 {
        for slice in 0..SLICES {
            assert_eq!(
                got.get(&(epoch, slice)),
                Some(&1),
                "epoch {epoch} slice {slice}"
            );
        }
    }
    assert_eq!(got.len() as u64, 2 * SLICES);

    // The iteration is done for latecomers too.
    let out = client("c").wait_with_output().unwrap();
    assert!(out.status.success(), "{out:?}");
    assert!(out.stdout.is_empty(), "{out:?}");
    // A client that disagrees about the iteration is told why.
    let mut wrong = Command::new(BIN);
    wrong
        .args([
            "iterate",
            "--dataset",
            "tokens",
            "--iteration",
            "run-1",
            "--epochs",
            "3",
            "--gateway",
            &node_address,
            "--cert-pem",
        ])
        .arg(dir.join("consumer-cert.pem"))
        .arg("--key-pem")
        .arg(dir.join("consumer-key.pem"))
        .arg("--trust-pem")
        .arg(dir.join("root.pem"));
    let out = wrong.output().unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("for 2 epochs with seed 9"),
        "{out:?}"
    );
}

/// `hypha-data audit LEDGER`: its exit code, what it printed on stdout, what on stderr.
fn audit(ledger: &Path, flags: &[&str]) -> (Option<i32>, String, String) {
    let output = Command::new(BIN)
        .arg("audit")
        .arg(ledger)
        .args(flags)
        .output()
        .unwrap();
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// Two epochs of four slices, every slice used by one of two workers.
fn used_up_ledger(path: &Path) -> hypha_ledger::Ledger {
    use hypha_ledger::{Grant, IterationSpec, Ledger};
    let spec = IterationSpec {
        dataset: "digits".into(),
        epochs: 2,
        seed: 7,
        samples: vec![10; 4],
    };
    let mut ledger = Ledger::create(path, spec, 60_000).unwrap();
    let mut round = 0;
    while !ledger.is_finished() {
        for worker in ["w1", "w2"] {
            let Grant::Slices(slices) = ledger.assign(worker, 1, &Default::default(), 1_000) else {
                continue;
            };
            let keys: Vec<_> = slices.iter().map(|a| a.key).collect();
            ledger.consume(worker, &keys, round, 1_000);
            ledger.commit_round(worker, round, 1_000);
        }
        round += 1;
    }
    ledger.flush().unwrap();
    ledger
}

#[test]
fn audit_passes_a_used_up_ledger_and_names_a_slice_used_twice() {
    use hypha_ledger::{Event, SliceKey};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("job.ledger");
    let mut ledger = used_up_ledger(&path);

    // Open in a running process: refused with what to do, not a store error.
    let (code, _, stderr) = audit(&path, &[]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("is open in another process"), "{stderr}");

    ledger.record_unchecked(
        SliceKey { epoch: 1, slice: 2 },
        &Event::Used {
            worker: "w2".into(),
            round: 9,
        },
        2_000,
    );
    ledger.flush().unwrap();
    drop(ledger);

    let (code, stdout, stderr) = audit(&path, &[]);
    assert_eq!(code, Some(1), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("epoch 1 slice 2 was used 2 times") && stderr.contains("by w2 in round 9"),
        "{stderr}"
    );
    assert!(
        stdout.contains("BAD  epoch 1 slice 2 was used 2 times"),
        "{stdout}"
    );
    // The summary counts both workers' uses: 8 slices, plus the forged one.
    assert!(stdout.contains("w1") && stdout.contains("w2"), "{stdout}");

    let (code, stdout, _) = audit(&path, &["--json", "--transitions"]);
    assert_eq!(code, Some(1));
    let report: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(report["exactly_once"], false);
    assert_eq!(report["finished"], true);
    let problems = report["problems"].as_array().unwrap();
    assert_eq!(problems.len(), 1, "{report:#}");
    assert_eq!(problems[0]["problem"], "used_twice");
    assert_eq!(
        (&problems[0]["epoch"], &problems[0]["slice"]),
        (&1.into(), &2.into())
    );
    let used: u64 = report["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["used"].as_u64().unwrap())
        .sum();
    assert_eq!(used, 9);
    assert_eq!(
        report["transitions_log"].as_array().unwrap().len() as u64,
        report["transitions"].as_u64().unwrap()
    );
}

#[test]
fn audit_fails_a_finished_iteration_that_misses_a_slice_only_when_it_is_finished() {
    use hypha_ledger::{Grant, IterationSpec, Ledger};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("job.ledger");
    let spec = IterationSpec {
        dataset: "digits".into(),
        epochs: 1,
        seed: 7,
        samples: vec![10; 3],
    };
    let mut ledger = Ledger::create(&path, spec, 60_000).unwrap();
    let Grant::Slices(slices) = ledger.assign("w1", 3, &Default::default(), 1_000) else {
        panic!("no slices");
    };
    let keys: Vec<_> = slices.iter().map(|a| a.key).collect();
    ledger.consume("w1", &keys[..2], 0, 1_000);
    ledger.commit_round("w1", 0, 1_000);
    ledger.flush().unwrap();
    drop(ledger);
    let missing = keys[2];

    // Running: one slice still assigned, nothing used twice.
    let (code, stdout, stderr) = audit(&path, &[]);
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("(the iteration is not finished)"),
        "{stdout}"
    );

    // The job ended: the slice it never used is named.
    let (code, stdout, stderr) = audit(&path, &["--finished"]);
    assert_eq!(code, Some(1), "{stdout}\n{stderr}");
    assert!(
        stderr.contains(&format!("{missing} was never used (it is left assigned)")),
        "{stderr}"
    );
}

/// A ledger file is input like any other: `audit` opens it read-only (the file is the same
/// bytes afterwards), escapes the names it prints (a worker named with terminal escapes cannot
/// steer the operator's terminal), refuses a file that claims more epochs than an iteration
/// may have, and lists at most `LISTED_PROBLEMS` breaches, counting the rest.
#[test]
fn audit_reads_a_hostile_ledger_without_changing_or_trusting_it() {
    use hypha_ledger::{Event, Grant, IterationSpec, Ledger};
    let dir = tempfile::tempdir().unwrap();
    let spec = |epochs| IterationSpec {
        dataset: "digits".into(),
        epochs,
        seed: 7,
        samples: vec![10; 4],
    };

    let path = dir.path().join("escape.ledger");
    let mut ledger = Ledger::create(&path, spec(1), 60_000).unwrap();
    let evil = "w\u{1b}[2J\u{7}";
    let Grant::Slices(slices) = ledger.assign(evil, 1, &Default::default(), 1_000) else {
        panic!("nothing granted");
    };
    let key = slices[0].key;
    ledger.consume(evil, &[key], 0, 1_000);
    ledger.commit_round(evil, 0, 1_000);
    ledger.record_unchecked(
        key,
        &Event::Used {
            worker: evil.into(),
            round: 1,
        },
        2_000,
    );
    ledger.flush().unwrap();
    drop(ledger);
    let before = std::fs::read(&path).unwrap();
    let (code, stdout, stderr) = audit(&path, &["--transitions"]);
    assert_eq!(code, Some(1), "{stdout}\n{stderr}");
    assert!(
        !stdout.contains('\u{1b}') && !stderr.contains('\u{1b}') && !stdout.contains('\u{7}'),
        "a control character reached the terminal:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("w\\u{1b}[2J\\u{7}"), "{stdout}");
    assert!(
        std::fs::read(&path).unwrap() == before,
        "the audit changed the file"
    );

    let path = dir.path().join("epochs.ledger");
    Ledger::create(&path, spec(hypha_ledger::MAX_EPOCHS + 1), 60_000)
        .unwrap()
        .flush()
        .unwrap();
    let (code, stdout, stderr) = audit(&path, &[]);
    assert_ne!(code, Some(0), "{stdout}");
    assert!(stderr.contains("claims 10001 epochs"), "{stderr}");

    // Every slice of every epoch never used: 40,000 breaches, 1,000 listed.
    let path = dir.path().join("many.ledger");
    Ledger::create(&path, spec(hypha_ledger::MAX_EPOCHS), 60_000)
        .unwrap()
        .flush()
        .unwrap();
    let (code, stdout, _) = audit(&path, &["--finished", "--json"]);
    assert_eq!(code, Some(1));
    let report: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(report["problems"].as_array().unwrap().len(), 1000);
    assert_eq!(report["unlisted_problems"], 39_000);
    assert_eq!(report["exactly_once"], false);
}
