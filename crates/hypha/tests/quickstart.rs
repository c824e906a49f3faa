//! `hypha quickstart` end to end with small settings: the real binaries train a model and the
//! quickstart leaves the files it promises, with the evaluation loss fallen and no ERROR line
//! in any process's log; and the same on datasets users bring: the seed recipe's output, and
//! what `hypha-data prepare` makes of an image folder and of JSONL text.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::{
    ffi::OsStr,
    io::{BufRead, BufReader, Read, Write},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

/// The workspace's binaries the quickstart starts; `cargo test --workspace` builds them all,
/// a lone `cargo test -p hypha` may not, so missing ones are built here.
fn ensure_built(bin_dir: &Path) {
    for name in [
        "hypha-gateway",
        "hypha-data",
        "hypha-worker",
        "hypha-scheduler",
        "hypha-executor",
        "hypha-data",
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
fn quickstart_trains_a_model_shows_it_on_the_dashboard_and_leaves_its_files() {
    let hypha = Path::new(env!("CARGO_BIN_EXE_hypha"));
    ensure_built(hypha.parent().unwrap());
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("quick");
    let mut child = Command::new(hypha)
        .args(["quickstart", "--hold", "--dir"])
        .arg(&dir)
        // A stray variable in the user's shell names no setting: every program ignores it.
        .env("HYPHA_MIRROR", "x")
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
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (lines, stdout_lines) = mpsc::channel();
    let stderr_lines = lines.clone();
    let stdout = child.stdout.take().unwrap();
    let stderr = child.stderr.take().unwrap();
    let out = std::thread::spawn(move || read_lines(stdout, "", lines));
    let err = std::thread::spawn(move || read_lines(stderr, "stderr: ", stderr_lines));
    let browser = browser();

    // During training: the page renders the job.
    let dashboard = wait_for_line(&stdout_lines, "the dashboard of the training: ")
        .unwrap_or_else(|seen| panic!("no dashboard address; it printed:\n{seen}"));
    if let Some(browser) = &browser {
        let page = dump_dom(browser, &dashboard);
        assert!(page.contains(r#"data-rendered="yes""#), "{page}");
        assert!(page.contains("job · train/diloco"), "{page}");
    }

    // Trained and held: the dashboard tells the whole job.
    let held = wait_for_line(&stdout_lines, "the network stays up: the dashboard is at ")
        .unwrap_or_else(|seen| panic!("the quickstart did not hold; it printed:\n{seen}"));
    let held = held.split(';').next().unwrap().trim().to_string();
    assert_eq!(held, dashboard);
    let state: serde_json::Value =
        serde_json::from_str(&http_get(&dashboard, "/api/state")).unwrap();
    assert_eq!(state["run"]["done"]["ok"], true, "{state:#}");
    let roles: Vec<&str> = state["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["role"].as_str().unwrap())
        .collect();
    assert_eq!(
        roles,
        ["trainer", "trainer", "trainer", "parameter server"],
        "{state:#}"
    );
    assert_eq!(state["rounds"].as_array().unwrap().len(), 4, "{state:#}");
    let used: u64 = state["iteration"]["epochs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["used"].as_u64().unwrap())
        .sum();
    assert!(used > 0, "{state:#}");
    // Issue 56: the global model scored on the held-out data as it trained, here every
    // round (the quickstart scores about twenty times a run): the models of rounds 1 to 4.
    let held_out: Vec<u64> = state["held_out"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h["round"].as_u64().unwrap())
        .collect();
    assert_eq!(held_out, [1, 2, 3, 4], "{state:#}");
    let plot = http_get(&dashboard, "/api/loss.svg");
    assert_eq!(markers(&plot), 4 + 4);

    match &browser {
        Some(browser) => {
            let page = dump_dom(browser, &dashboard);
            assert!(page.contains(r#"id="status" class="badge ok""#), "{page}");
            assert!(
                page.contains(r#"<span id="rounds-count">4</span>"#),
                "{page}"
            );
            assert_eq!(page.matches("data-peer=").count(), 4, "{page}");
            assert_eq!(
                page.matches(r#"data-state="finished""#).count(),
                4,
                "{page}"
            );
            assert!(page.contains(r#"data-epoch="0""#), "{page}");
            // Each worker shows its updates refused and clipped (issue 55): none refused.
            assert_eq!(
                page.matches(r#"<td class="num refused-count">0</td>"#)
                    .count(),
                4,
                "{page}"
            );
            // The loss plot arrived and has its size.
            assert!(page.contains(r#"data-loaded="720""#), "{page}");
            assert!(
                page.contains("· held-out loss ") && page.contains("(model of round 4)"),
                "{page}"
            );
        }
        None => eprintln!(
            "SKIPPED the browser check: no headless Chromium found (apt-get install chromium-headless-shell); the dashboard's JSON and plot were checked"
        ),
    }

    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGINT,
    )
    .unwrap();
    let status = child.wait().unwrap();
    let stdout = out.join().unwrap();
    let stderr = err.join().unwrap();
    assert!(status.success(), "quickstart failed:\n{stdout}\n{stderr}");

    for file in ["model.safetensors", "metrics.jsonl", "loss.svg", "job.toml"] {
        assert!(
            dir.join(file).exists(),
            "{file} missing; it printed:\n{stdout}"
        );
    }
    let metrics = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    let rounds = metrics
        .lines()
        .filter(|l| l.contains("\"kind\":\"round\""))
        .count();
    assert_eq!(rounds, 4);
    let scores = metrics
        .lines()
        .filter(|l| l.contains("\"kind\":\"eval\""))
        .count();
    assert_eq!(scores, 4, "{metrics}");
    assert_eq!(
        markers(&std::fs::read_to_string(dir.join("loss.svg")).unwrap()),
        4 + 4
    );
    same_held_out_loss_as_offline(&stdout);

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
    // Issue 55: the end says whether every trainer stayed and what the limits did.
    assert!(
        stdout.contains("every trainer stayed to the end; updates refused 0"),
        "{stdout}"
    );
    no_errors_logged(&dir);
}

/// The job's own score of its last model on the held-out data, as it trained, is the
/// quickstart's offline score of the saved model on the same data (issue 56), but for the
/// order of a sum: the trainer's matrix products run on other threads than the quickstart's.
fn same_held_out_loss_as_offline(stdout: &str) {
    let offline = stdout
        .lines()
        .find_map(|l| l.strip_prefix("evaluation loss ")?.split(" → ").nth(1))
        .and_then(|rest| rest.split(',').next())
        .unwrap_or_else(|| panic!("{stdout}"));
    let in_run = stdout
        .lines()
        .find_map(|l| l.strip_prefix("held-out loss scored by the job as it trained: "))
        .and_then(|rest| rest.split(' ').next())
        .unwrap_or_else(|| panic!("{stdout}"));
    let (in_run, offline): (f64, f64) = (in_run.parse().unwrap(), offline.parse().unwrap());
    assert!(
        (in_run - offline).abs() <= 1e-3 * offline.max(0.1),
        "{stdout}"
    );
    let last = stdout
        .lines()
        .find(|l| l.starts_with("held-out loss scored by the job as it trained: "))
        .unwrap();
    let rounds = stdout
        .lines()
        .find_map(|l| l.strip_prefix("trained ")?.split(" for ").nth(1))
        .and_then(|rest| rest.split(' ').next())
        .unwrap();
    assert!(
        last.ends_with(&format!("(the model of round {rounds})")),
        "the last model is scored: {stdout}"
    );
}

/// Sends each line of `stream` to `lines` (prefixed) and returns them all at its end.
fn read_lines(stream: impl std::io::Read, prefix: &str, lines: mpsc::Sender<String>) -> String {
    let mut all = String::new();
    for line in BufReader::new(stream).lines().map_while(Result::ok) {
        all.push_str(&line);
        all.push('\n');
        let _ = lines.send(format!("{prefix}{line}"));
    }
    all
}

/// What follows `needle` on the first line holding it, within five minutes; what was seen
/// until then otherwise.
fn wait_for_line(lines: &mpsc::Receiver<String>, needle: &str) -> Result<String, String> {
    let deadline = Instant::now() + Duration::from_secs(300);
    let mut seen = String::new();
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        let Ok(line) = lines.recv_timeout(left) else {
            break;
        };
        if let Some((_, rest)) = line.split_once(needle) {
            return Ok(rest.trim().to_string());
        }
        seen.push_str(&line);
        seen.push('\n');
    }
    Err(seen)
}

/// A headless Chromium on this machine, if there is one.
fn browser() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    [
        "chromium-headless-shell",
        "chromium",
        "chromium-browser",
        "google-chrome",
    ]
    .iter()
    .flat_map(|name| std::env::split_paths(&path).map(move |dir| dir.join(name)))
    .find(|candidate| candidate.is_file())
}

/// The page at `url` as the browser rendered it, after its script fetched the state and the
/// plot.
fn dump_dom(browser: &Path, url: &str) -> String {
    let profile = tempfile::tempdir().unwrap();
    let output = Command::new(browser)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--virtual-time-budget=5000",
            "--dump-dom",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .arg(url)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{} failed: {}",
        browser.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// The body of `GET path` from the server at `url` (`http://IP:PORT/`).
fn http_get(url: &str, path: &str) -> String {
    let address = url.trim_start_matches("http://").trim_end_matches('/');
    let mut stream = std::net::TcpStream::connect(address).unwrap();
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    body.to_string()
}

/// The markers of a loss plot: one per round, read by an XML parser.
fn markers(svg: &str) -> usize {
    let doc = roxmltree::Document::parse(svg).unwrap();
    assert_eq!(doc.root_element().tag_name().name(), "svg");
    doc.descendants()
        .filter(|n| n.has_tag_name("circle"))
        .count()
}

/// Runs `hypha quickstart ARGS --dataset DATASET` in `cwd`; exit success, stdout and stderr.
/// A node that cannot start (here every node: a bad `HYPHA_LISTEN_ADDRESSES` in the shell) is
/// reported as soon as it exits, with the end of its log, not after the minute a slow start
/// is given (the error says which of the two happened).
#[test]
fn a_node_that_exits_while_starting_is_reported_at_once_with_its_log() {
    let hypha = Path::new(env!("CARGO_BIN_EXE_hypha"));
    ensure_built(hypha.parent().unwrap());
    let tmp = tempfile::tempdir().unwrap();
    let output = Command::new(hypha)
        .args(["quickstart", "--dir"])
        .arg(tmp.path().join("quick"))
        .env("HYPHA_LISTEN_ADDRESSES", "not-an-address")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(
        stderr.contains("gateway exited while starting")
            && stderr.contains("HYPHA_LISTEN_ADDRESSES"),
        "{stderr}"
    );
    // Not the minute's timeout: the exit itself was noticed.
    assert!(!stderr.contains("did not get ready"), "{stderr}");
}

fn quickstart(cwd: &Path, args: &[&str], dataset: &Path) -> (bool, String, String) {
    let hypha = Path::new(env!("CARGO_BIN_EXE_hypha"));
    ensure_built(hypha.parent().unwrap());
    let output = Command::new(hypha)
        .arg("quickstart")
        .args(args)
        .arg("--dataset")
        .arg(dataset)
        .current_dir(cwd)
        .output()
        .unwrap();
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// "evaluation loss A → B, accuracy C % → D %" as (A, B, C, D).
fn scores(stdout: &str) -> (f64, f64, f64, f64) {
    let line = stdout
        .lines()
        .find(|l| l.starts_with("evaluation loss"))
        .unwrap_or_else(|| panic!("no evaluation line in:\n{stdout}"));
    let n: Vec<f64> = line
        .split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .filter_map(|t| t.parse().ok())
        .collect();
    (n[0], n[1], n[2], n[3])
}

fn no_errors_logged(dir: &Path) {
    for log in std::fs::read_dir(dir.join("logs")).unwrap() {
        let log = log.unwrap().path();
        let text = std::fs::read_to_string(&log).unwrap();
        let errors: Vec<&str> = text.lines().filter(|l| l.contains("ERROR")).collect();
        assert!(errors.is_empty(), "{}: {errors:#?}", log.display());
    }
}

/// A small deterministic generator, so that the datasets below need no crate.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> f64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The seed recipe, verbatim but for `safetensors.numpy` in place of `safetensors.torch` (one
/// serializer behind both), over ten classes of 8×8 patterns with noise.
const SEED_RECIPE: &str = r#"
import os, sys
import numpy as np
from safetensors.numpy import save
from snappy import compress

def save_slice(images, labels, output_dir, slice_idx):
    tensors = {"images": np.stack(images), "labels": np.array(labels, dtype=np.int64)}
    with open(os.path.join(output_dir, f"slice-{slice_idx:04d}.safetensors"), 'wb') as out_file:
        out_file.write(compress(save(tensors)))

output_dir, slices, per_slice = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
os.makedirs(output_dir, exist_ok=True)
rng = np.random.default_rng(7)
patterns = rng.normal(size=(10, 1, 8, 8)).astype(np.float32)
for slice_idx in range(slices):
    labels = [int(l) for l in rng.integers(0, 10, size=per_slice)]
    images = [(patterns[l] + rng.normal(size=(1, 8, 8))).astype(np.float32) for l in labels]
    save_slice(images, labels, output_dir, slice_idx)
"#;

/// A dataset as the seed recipe writes it (`images` f32 [N, 1, 8, 8], `labels` i64 [N], raw
/// Snappy, no manifest), with a class structure to learn. Written by the recipe itself when
/// this machine's Python has numpy, safetensors and python-snappy (CI installs them), else by
/// this crate's encoder of the same format.
fn seed_recipe_dataset(dir: &Path, slices: usize, per_slice: usize) {
    let by_python = Command::new("python3")
        .args(["-c", SEED_RECIPE])
        .arg(dir)
        .args([slices.to_string(), per_slice.to_string()])
        .output();
    if by_python.as_ref().is_ok_and(|o| o.status.success()) {
        return;
    }
    eprintln!(
        "python3 with numpy, safetensors and python-snappy is missing; writing the seed recipe's format with hypha-dataset's encoder instead"
    );
    hypha_dataset::testing::seed_recipe_dataset(dir, slices, per_slice, 7);
}

#[test]
fn the_seed_recipes_dataset_trains_an_mlp_and_a_cnn_from_a_deep_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("digits");
    seed_recipe_dataset(&data, 10, 256);
    assert!(!data.join("manifest.json").exists());
    // A working directory deep enough that work_dir/hypha-{uuid}/bridge.sock cannot be a
    // socket path.
    let deep: PathBuf = tmp
        .path()
        .join("home".repeat(20))
        .join("projects".repeat(10));
    std::fs::create_dir_all(&deep).unwrap();
    assert!(deep.as_os_str().len() > 150);

    // No model named: the images suggest a cnn.
    let (ok, stdout, stderr) = quickstart(&deep, &["--dir", "cnn", "--rounds", "10"], &data);
    assert!(ok, "quickstart failed:\n{stdout}\n{stderr}");
    assert!(
        stdout.contains(r#""type":"cnn","channels":1,"classes":10"#),
        "{stdout}"
    );
    assert!(stdout.contains("held-out slice(s) 9..10"), "{stdout}");
    let (loss_before, loss_after, _, accuracy) = scores(&stdout);
    assert!(loss_after < 0.5 * loss_before, "{stdout}");
    assert!(accuracy > 70.0, "chance is 10 %: {stdout}");
    no_errors_logged(&deep.join("cnn"));
    // The held-out slice is a dataset of its own on the data node, which the run scores
    // models on and never trains on: the ledger iterates the nine others.
    same_held_out_loss_as_offline(&stdout);
    let served = |name: &str| {
        let mut files: Vec<String> = std::fs::read_dir(deep.join("cnn/data").join(name))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|f| f.ends_with(".safetensors"))
            .collect();
        files.sort();
        files
    };
    assert_eq!(served("digits-heldout"), ["slice-0009.safetensors"]);
    assert_eq!(served("digits").len(), 9);
    assert!(!served("digits").contains(&"slice-0009.safetensors".to_string()));
    let hypha = Path::new(env!("CARGO_BIN_EXE_hypha"));
    let audit = Command::new(hypha.parent().unwrap().join("hypha-scheduler"))
        .arg("audit")
        .arg(deep.join("cnn/job.ledger"))
        .output()
        .unwrap();
    let audit = String::from_utf8_lossy(&audit.stdout);
    assert!(audit.contains("epoch(s) of 9 slices"), "{audit}");

    // `hypha-executor evaluate --dataset` scores the model file as the quickstart did.
    let model = stdout
        .lines()
        .find_map(|l| l.strip_prefix("trained ")?.split(" for ").next())
        .unwrap();
    let hypha = Path::new(env!("CARGO_BIN_EXE_hypha"));
    let output = Command::new(hypha.parent().unwrap().join("hypha-executor"))
        .args(["evaluate", "--model", model, "--weights"])
        .arg(deep.join("cnn/model.safetensors"))
        .arg("--dataset")
        .arg(&data)
        .args(["--slices", "9..10"])
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let score: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(score["samples"], 256);
    assert!(
        (score["accuracy"].as_f64().unwrap() * 100.0 - accuracy).abs() < 0.1,
        "{score} vs {stdout}"
    );

    let mlp = r#"{"type": "mlp", "inputs": 64, "hidden": 64, "classes": 10}"#;
    let (ok, stdout, stderr) = quickstart(
        &deep,
        &["--dir", "mlp", "--rounds", "6", "--model", mlp],
        &data,
    );
    assert!(ok, "quickstart failed:\n{stdout}\n{stderr}");
    let (loss_before, loss_after, _, accuracy) = scores(&stdout);
    assert!(loss_after < 0.5 * loss_before, "{stdout}");
    assert!(accuracy > 80.0, "chance is 10 %: {stdout}");
    assert!(
        !data.join("manifest.json").exists(),
        "the user's directory is left as it was"
    );

    // A model that cannot read the data is refused before anything is written or started.
    let wrong = r#"{"type": "mlp", "inputs": 16, "hidden": 64, "classes": 10}"#;
    let (ok, stdout, stderr) = quickstart(&deep, &["--dir", "wrong", "--model", wrong], &data);
    assert!(!ok, "{stdout}");
    assert!(
        stderr.contains("tensor \"images\" is F32 [256, 1, 8, 8]")
            && stderr.contains("set `inputs = 64`"),
        "{stderr}"
    );
    assert!(!stderr.contains("backtrace"), "{stderr}");
    assert!(!deep.join("wrong").exists());
}

/// Runs `hypha-data prepare ARGS`.
fn prepare(args: &[&OsStr]) {
    let hypha = Path::new(env!("CARGO_BIN_EXE_hypha"));
    ensure_built(hypha.parent().unwrap());
    let output = Command::new(hypha.parent().unwrap().join("hypha-data"))
        .arg("prepare")
        .args(args)
        .output()
        .unwrap();
    assert!(output.status.success(), "prepare failed: {output:?}");
}

#[test]
fn what_prepare_makes_of_images_and_text_trains() {
    let tmp = tempfile::tempdir().unwrap();

    // An image folder: three classes of 12×12 pictures, each its colour with noise.
    let folder = tmp.path().join("shapes");
    let mut rng = Lcg(3);
    for (class, colour) in [
        ("red", [200.0, 40.0, 40.0]),
        ("green", [40.0, 200.0, 40.0]),
        ("blue", [40.0, 40.0, 200.0]),
    ] {
        std::fs::create_dir_all(folder.join(class)).unwrap();
        for i in 0..60 {
            let image = image::RgbImage::from_fn(12, 12, |_, _| {
                image::Rgb(
                    colour.map(|c: f64| (c + rng.next() * 110.0 - 55.0).clamp(0.0, 255.0) as u8),
                )
            });
            image
                .save(folder.join(class).join(format!("{i}.png")))
                .unwrap();
        }
    }
    let images = tmp.path().join("shapes-8px");
    prepare(&[
        folder.as_os_str(),
        "-o".as_ref(),
        images.as_os_str(),
        "--image-size".as_ref(),
        "8".as_ref(),
        "--slice-size".as_ref(),
        "20".as_ref(),
    ]);
    let (ok, stdout, stderr) = quickstart(
        tmp.path(),
        &[
            "--dir",
            "images",
            "--rounds",
            "6",
            "--samples-per-round",
            "384",
        ],
        &images,
    );
    assert!(ok, "quickstart failed:\n{stdout}\n{stderr}");
    assert!(
        stdout.contains(r#""type":"cnn","channels":3,"classes":3"#),
        "{stdout}"
    );
    let (loss_before, loss_after, _, accuracy) = scores(&stdout);
    assert!(loss_after < 0.5 * loss_before, "{stdout}");
    assert!(accuracy > 80.0, "chance is 33 %: {stdout}");

    // JSONL text: sentences from a small vocabulary, in order, so the next byte is learnable.
    let words = [
        "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "hypha",
        "trains",
    ];
    let mut lines = String::new();
    for _ in 0..1500 {
        let start = (rng.next() * words.len() as f64) as usize;
        let length = 4 + (rng.next() * 6.0) as usize;
        let text: Vec<&str> = (0..length)
            .map(|j| words[(start + j) % words.len()])
            .collect();
        lines.push_str(&format!("{{\"text\": \"{}\"}}\n", text.join(" ")));
    }
    let corpus = tmp.path().join("corpus.jsonl");
    std::fs::write(&corpus, lines).unwrap();
    let text = tmp.path().join("corpus");
    prepare(&[
        corpus.as_os_str(),
        "-o".as_ref(),
        text.as_os_str(),
        "--sequence-length".as_ref(),
        "24".as_ref(),
        "--slice-size".as_ref(),
        "128".as_ref(),
    ]);
    let (ok, stdout, stderr) = quickstart(
        tmp.path(),
        &[
            "--dir",
            "text",
            "--rounds",
            "6",
            "--round-seconds",
            "30",
            "--learning-rate",
            "0.004",
        ],
        &text,
    );
    assert!(ok, "quickstart failed:\n{stdout}\n{stderr}");
    let job = std::fs::read_to_string(tmp.path().join("text/job.toml")).unwrap();
    assert!(
        job.contains("round_seconds = 30.0") && job.contains("learning_rate = 0.004"),
        "{job}"
    );
    assert!(
        stdout.contains(r#""type":"transformer""#) && stdout.contains(r#""context":23"#),
        "{stdout}"
    );
    let (loss_before, loss_after, _, accuracy) = scores(&stdout);
    // Uniform over 258 byte-level ids is ln 258 ≈ 5.55.
    assert!(loss_after < 0.6 * loss_before, "{stdout}");
    assert!(
        accuracy > 20.0,
        "next-byte accuracy by chance is under 1 %: {stdout}"
    );
    no_errors_logged(&tmp.path().join("text"));
}
