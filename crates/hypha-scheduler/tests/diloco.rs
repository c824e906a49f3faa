//! DiLoCo end to end with real processes: a data node serving a learnable dataset, workers
//! running the reference executor (`hypha-executor train`), a worker running the built-in
//! parameter server, and the scheduler driving rounds; also with a trainer, the parameter
//! server or the scheduler SIGKILLed, and under seeded schedules of kills of every role.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

mod common;

use std::{
    collections::{HashMap, HashSet},
    io::{BufRead, BufReader, Read, Write},
    net::TcpListener,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::Duration,
};

use common::*;
use hypha_executor::{
    model::{Model, ModelSpec},
    synthetic::Synthetic,
};
use hypha_ledger::ReturnReason;

const MODEL: ModelSpec = DILOCO_MODEL;
const SLICES: u64 = DILOCO_SLICES;

/// A cluster with the dataset `blobs` on a data node and a parameter-server worker.
fn cluster() -> (Cluster, Proc, Proc) {
    let cluster = Cluster::new();
    let data = cluster.blobs_data_node("data");
    let server = cluster.server_worker("ps");
    (cluster, data, server)
}

/// An HTTP server on 127.0.0.1 that answers every POST with 200 and keeps its JSON body.
fn http_collector() -> (String, Arc<Mutex<Vec<serde_json::Value>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/metrics", listener.local_addr().unwrap());
    let bodies = Arc::new(Mutex::new(Vec::new()));
    let kept = bodies.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming().map_while(Result::ok) {
            let kept = kept.clone();
            std::thread::spawn(move || {
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut stream = stream;
                loop {
                    let mut length = 0;
                    loop {
                        let mut line = String::new();
                        if reader.read_line(&mut line).unwrap_or(0) == 0 {
                            return;
                        }
                        let lower = line.to_ascii_lowercase();
                        if let Some(value) = lower.strip_prefix("content-length:") {
                            length = value.trim().parse().unwrap();
                        }
                        if line == "\r\n" {
                            break;
                        }
                    }
                    let mut body = vec![0; length];
                    reader.read_exact(&mut body).unwrap();
                    kept.lock()
                        .unwrap()
                        .push(serde_json::from_slice(&body).unwrap());
                    stream
                        .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                        .unwrap();
                }
            });
        }
    });
    (url, bodies)
}

fn lines_of(path: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Evaluation loss of a model file, or of the model every trainer starts from.
fn evaluation_loss(weights: Option<PathBuf>) -> f64 {
    let model = Model::new(&MODEL, 1).unwrap();
    if let Some(path) = weights {
        model
            .load(&hypha_diloco::Tensors::load(&path).unwrap())
            .unwrap();
    }
    let held_out = Synthetic::for_model(&MODEL).batch(1024, 1 << 40).unwrap();
    model.evaluate(&held_out).unwrap().0
}

/// Checks that every trainer report naming a global model (`model_hash`) names the one the
/// server's round before led to, and that the final model is the last round's; returns how
/// many reports were checked, by job.
fn trainers_held_the_rounds_models(
    metrics: &[serde_json::Value],
    ps_dir: &std::path::Path,
) -> HashMap<String, usize> {
    // The model each applied round led to, by the round it starts.
    let hashes: HashMap<u64, &str> = metrics
        .iter()
        .filter(|m| m["kind"] == "round")
        .map(|m| {
            (
                m["round"].as_u64().unwrap() + 1,
                m["model_hash"].as_str().unwrap(),
            )
        })
        .collect();
    let last = hashes.keys().max().expect("no round was applied");
    let final_model = hypha_diloco::Tensors::load(&ps_dir.join("final.safetensors")).unwrap();
    assert_eq!(
        hashes[last],
        final_model.digest(),
        "the final model is the last round's"
    );
    let mut checked = HashMap::new();
    for line in metrics.iter().filter(|m| m["kind"] == "trainer") {
        let (Some(round), Some(hash)) = (line["round"].as_u64(), line["model_hash"].as_str())
        else {
            continue;
        };
        if let Some(expected) = hashes.get(&round) {
            assert_eq!(
                hash, *expected,
                "a trainer's global model of round {round}: {line}"
            );
            *checked
                .entry(line["job"].as_str().unwrap().to_string())
                .or_default() += 1;
        }
    }
    checked
}

/// The id of the job that the worker `worker` of `cluster` ran (its one job directory).
fn job_id_of(cluster: &Cluster, worker: &str) -> String {
    job_dir(&cluster.path(&format!("{worker}-work")))
        .file_name()
        .unwrap()
        .to_string_lossy()
        .trim_start_matches("hypha-")
        .to_string()
}

/// How many of the applied rounds in `metrics` included an update of `peer`, and of how many.
fn rounds_including(metrics: &[serde_json::Value], peer: &str) -> (usize, usize) {
    let rounds: Vec<&serde_json::Value> = metrics.iter().filter(|m| m["kind"] == "round").collect();
    let with = rounds
        .iter()
        .filter(|r| r["included"].as_array().unwrap().iter().any(|p| p == peer))
        .count();
    (with, rounds.len())
}

/// What the executors and workers said, for a failed test's message.
fn diagnostics(cluster: &Cluster, procs: &mut [&mut Proc]) -> String {
    let mut out = String::new();
    for proc in procs.iter_mut() {
        while let Ok(line) = proc.lines.try_recv() {
            proc.seen.push(line);
        }
        out += &format!("--- {}\n{}\n", proc.name, proc.seen.join("\n"));
    }
    for entry in std::fs::read_dir(cluster.path("")).unwrap() {
        let work = entry.unwrap().path();
        if work.to_string_lossy().ends_with("-work") {
            for job in std::fs::read_dir(&work).into_iter().flatten() {
                let log = job.unwrap().path().join("stderr.log");
                if let Ok(text) = std::fs::read_to_string(&log) {
                    out += &format!("--- {}\n{text}\n", log.display());
                }
            }
        }
    }
    out
}

/// The scheduler exited successfully and logged no error; if not, what `procs` and the
/// executors said goes into the failure.
fn assert_succeeded(cluster: &Cluster, ok: bool, lines: &[String], procs: &mut [&mut Proc]) {
    if !ok {
        panic!(
            "the scheduler failed:\n{}\n{}",
            lines.join("\n"),
            diagnostics(cluster, procs)
        );
    }
    no_errors("the scheduler", lines);
}

/// The norm check is on by default (`max_update_norm_ratio`): honest updates stay within a
/// few times the round's reference (the quickstart's 3,731 rounds: 99.9 % under 3.8, all
/// under 6; BENCHMARKS.md, "Update norms"). Each round says how near its updates came. The
/// limits may hold an honest outlier back now and then (clipped, never refused).
fn assert_norms_well_within_the_default(rounds: &[&serde_json::Value]) {
    let largest = rounds
        .iter()
        .filter_map(|r| r["largest_norm_ratio"].as_f64())
        .fold(0.0f64, f64::max);
    assert!(
        rounds.iter().any(|r| r["largest_norm_ratio"].is_f64()),
        "no round reported its norms: {rounds:?}"
    );
    let default = hypha_scheduler::spec::DEFAULT_NORM_RATIO;
    assert!(
        largest < 3.0 * default,
        "an honest update came to {largest:.2} times the round's reference; the default clips at {default}"
    );
}

fn no_errors(name: &str, lines: &[String]) {
    let errors: Vec<&String> = lines.iter().filter(|l| l.contains("ERROR")).collect();
    assert!(errors.is_empty(), "{name} logged errors: {errors:#?}");
}

#[test]
fn three_trainers_and_a_parameter_server_train_every_slice_once_and_the_loss_falls() {
    let (cluster, _data, mut server) = cluster();
    let mut trainers: Vec<Proc> = (0..3)
        .map(|i| cluster.trainer_worker(&format!("trainer{i}"), ""))
        .collect();
    let (forward, forwarded) = http_collector();
    let job = cluster.diloco_job("train", 3, 2, &format!("forward = \"{forward}\"\n"));
    let (mut scheduler, events_path) = cluster.scheduler("scheduler", &job);
    let (ok, lines) = scheduler.wait(Duration::from_secs(120));
    let mut procs: Vec<&mut Proc> = trainers.iter_mut().collect();
    procs.push(&mut server);
    assert_succeeded(&cluster, ok, &lines, &mut procs);

    // Rounds were applied and reported: in the events and in the metrics file.
    let events = events(&events_path);
    let rounds = of_kind(&events, "round");
    assert!(rounds.len() >= 3, "{} rounds", rounds.len());
    let metrics = lines_of(&cluster.path("train-job.metrics.jsonl"));
    let applied: Vec<_> = metrics.iter().filter(|m| m["kind"] == "round").collect();
    assert_eq!(applied.len(), rounds.len());
    assert!(
        metrics
            .iter()
            .any(|m| m["kind"] == "trainer" && m["loss"].is_f64())
    );
    // Every round but possibly the last (the data running out) has all three trainers.
    assert!(
        applied
            .iter()
            .any(|r| r["included"].as_array().unwrap().len() == 3)
    );
    assert_norms_well_within_the_default(&applied);
    // The same lines reached the forward URL.
    let forwarded = forwarded.lock().unwrap().clone();
    let forwarded_rounds = forwarded.iter().filter(|l| l["kind"] == "round").count();
    assert_eq!(
        forwarded_rounds,
        applied.len(),
        "{} lines forwarded",
        forwarded.len()
    );

    // The scheduler holds the checkpoint of the last round beside its ledger: the model
    // and momentum the run would continue from.
    let held = hypha_scheduler::checkpoint::checkpoint_round(
        &cluster.path("train-job.checkpoint.safetensors"),
    )
    .unwrap();
    assert_eq!(
        held,
        rounds.len() as u64,
        "the checkpoint starts the round after the last"
    );

    // Each slice was trained exactly once per epoch; nothing went back to the ledger.
    assert_audit_passes(&cluster.path("train-job.ledger"), 2, SLICES);
    let (_, returned) = audit(&cluster.path("train-job.ledger"));
    assert!(returned.is_empty(), "{returned:?}");

    // The parameter server wrote the final model; it is better than the starting one.
    let ps_dir = job_dir(&cluster.path("ps-work"));
    let before = evaluation_loss(None);
    let after = evaluation_loss(Some(ps_dir.join("final.safetensors")));
    assert!(after < 0.5 * before, "evaluation loss {before} → {after}");
    assert!(ps_dir.join("parameter-server.safetensors").exists());

    for (i, trainer) in trainers.iter_mut().enumerate() {
        trainer.kill();
        no_errors(&format!("trainer{i}"), &trainer.seen);
    }
    server.kill();
    no_errors("the parameter server's worker", &server.seen);
}

/// Trainers that send int8 pseudo-gradients with error feedback (`compression = "int8"`),
/// take the global model back as int8 changes, and train on while their update travels
/// (`overlap = true`): every slice still once per epoch, the loss still halves, the changes
/// are about a quarter of the model, every trainer holds the server's global model bit for
/// bit in every round, and batches trained ahead were moved onto new global models (issue 21,
/// items 2 and 3).
#[test]
fn int8_compressed_overlapped_rounds_train_every_slice_once_and_the_loss_falls() {
    let (cluster, _data, mut server) = cluster();
    let mut trainers: Vec<Proc> = (0..3)
        .map(|i| cluster.trainer_worker(&format!("trainer{i}"), ""))
        .collect();
    let job = cluster.diloco_job("int8", 3, 2, "compression = \"int8\"\noverlap = true\n");
    let (mut scheduler, events_path) = cluster.scheduler("scheduler", &job);
    let (ok, lines) = scheduler.wait(Duration::from_secs(120));
    let mut procs: Vec<&mut Proc> = trainers.iter_mut().collect();
    procs.push(&mut server);
    assert_succeeded(&cluster, ok, &lines, &mut procs);
    assert!(of_kind(&events(&events_path), "round").len() >= 3);
    assert_audit_passes(&cluster.path("int8-job.ledger"), 2, SLICES);
    let ps_dir = job_dir(&cluster.path("ps-work"));
    let before = evaluation_loss(None);
    let after = evaluation_loss(Some(ps_dir.join("final.safetensors")));
    assert!(after < 0.5 * before, "evaluation loss {before} → {after}");

    // The model each applied round led to, by the round it starts: what every trainer that
    // reports that round must hold.
    let metrics = lines_of(&cluster.path("int8-job.metrics.jsonl"));
    assert_norms_well_within_the_default(
        &metrics
            .iter()
            .filter(|m| m["kind"] == "round")
            .collect::<Vec<_>>(),
    );
    let model_size = std::fs::metadata(ps_dir.join("final.safetensors"))
        .unwrap()
        .len();
    for line in metrics.iter().filter(|m| m["kind"] == "round") {
        let delta = line["delta_bytes"].as_u64().unwrap();
        // A byte a parameter instead of four; in a model this small the headers (names,
        // shapes, fingerprints) weigh in, so the bound is a half, not the quarter of a large
        // model (hypha-bench wan measures that).
        assert!(
            (delta as f64) < 0.5 * model_size as f64,
            "a change of {delta} bytes for a model of {model_size}"
        );
    }
    let checked: usize = trainers_held_the_rounds_models(&metrics, &ps_dir)
        .values()
        .sum();
    assert!(
        checked >= 3,
        "{checked} trainer reports checked against the server's model"
    );
    let changes_applied = metrics
        .iter()
        .filter(|line| line["kind"] == "trainer")
        .filter_map(|line| line["deltas_applied"].as_u64())
        .max()
        .unwrap_or(0);
    assert!(
        changes_applied >= 1,
        "no trainer built a global model from a change"
    );
    // What the trainers printed: models taken as changes, batches trained ahead.
    let logs: String = (0..3)
        .map(|i| {
            let dir = job_dir(&cluster.path(&format!("trainer{i}-work")));
            std::fs::read_to_string(dir.join("stderr.log")).unwrap_or_default()
        })
        .collect();
    assert!(logs.contains("(as a change)"), "{logs}");
    assert!(
        logs.contains("trained ahead moved onto the new global model"),
        "{logs}"
    );
    assert!(!logs.contains("does not match"), "{logs}");

    for (i, trainer) in trainers.iter_mut().enumerate() {
        trainer.kill();
        no_errors(&format!("trainer{i}"), &trainer.seen);
    }
}

#[test]
fn a_trainer_killed_mid_round_leaves_it_and_its_slices_are_trained_by_others() {
    let (cluster, _data, _server) = cluster();
    let mut trainers: Vec<Proc> = (0..3)
        .map(|i| cluster.trainer_worker(&format!("trainer{i}"), ""))
        .collect();
    let job = cluster.diloco_job("chaos", 2, 2, "");
    let (mut scheduler, events_path) = cluster.scheduler("scheduler", &job);
    // Once a round is applied, kill a trainer that holds a job.
    scheduler.wait_for("round applied");
    let victim = (0..3)
        .find(|i| {
            std::fs::read_dir(cluster.path(&format!("trainer{i}-work"))).is_ok_and(|dir| {
                dir.flatten()
                    .any(|e| e.file_name().to_string_lossy().starts_with("hypha-"))
            })
        })
        .unwrap();
    trainers[victim].child.kill().unwrap();
    let (ok, lines) = scheduler.wait(Duration::from_secs(120));
    assert!(ok, "the scheduler failed:\n{}", lines.join("\n"));

    let events = events(&events_path);
    let killed_at = events
        .iter()
        .position(|e| e["event"]["kind"] == "lost")
        .expect("the killed trainer is reported lost");
    assert!(
        events[killed_at..]
            .iter()
            .any(|e| e["event"]["kind"] == "round"),
        "rounds go on after the kill"
    );
    assert_audit_passes(&cluster.path("chaos-job.ledger"), 2, SLICES);
    let (_, returned) = audit(&cluster.path("chaos-job.ledger"));
    assert!(
        returned.contains(&ReturnReason::WorkerLost),
        "the killed trainer's slices went back: {returned:?}"
    );
}

#[test]
fn the_parameter_server_keeps_its_lease_while_trainers_are_busy_for_three_lease_periods() {
    let (cluster, _data, _server) = cluster();
    // Both trainers are leased by another scheduler's job for 10 s: over three of the
    // workers' 3 s lease periods.
    let sleeper = "[[executors]]\nclass = \"test\"\nname = \"sh\"\nruntime = \"process\"\ncmd = \"sh\"\nargs = [\"-c\", \"sleep 10\"]\n";
    let _trainers: Vec<Proc> = (0..2)
        .map(|i| cluster.trainer_worker(&format!("trainer{i}"), sleeper))
        .collect();
    let busy = cluster.job(
        "busy",
        "workers = 2\nbid = 50\n[executor]\nclass = \"test\"\nname = \"sh\"\n[resources]\ncpu = 1\n",
    );
    let (mut other, _) = cluster.scheduler("other", &busy);
    other.wait_for("job dispatched");
    other.wait_for("job dispatched");

    let job = cluster.diloco_job("patient", 2, 1, "");
    let (mut scheduler, events_path) = cluster.scheduler("scheduler", &job);
    let (ok, lines) = scheduler.wait(Duration::from_secs(120));
    assert!(ok, "the scheduler failed:\n{}", lines.join("\n"));
    assert!(other.wait(Duration::from_secs(30)).0);

    let events = events(&events_path);
    assert!(
        of_kind(&events, "lost").is_empty(),
        "no worker was lost: {:#?}",
        of_kind(&events, "lost")
    );
    let leased = of_kind(&events, "leased");
    assert_eq!(leased.len(), 3, "{leased:#?}");
    let server_leased = leased[0]["time_ms"].as_u64().unwrap();
    let trainers_leased = leased[1]["time_ms"].as_u64().unwrap();
    assert!(
        trainers_leased >= server_leased + 3 * 3000,
        "the trainers were busy for three lease periods: leased {} ms after the server",
        trainers_leased - server_leased
    );
    assert!(!of_kind(&events, "round").is_empty());
    assert_audit_passes(&cluster.path("patient-job.ledger"), 1, SLICES);
}

/// An elastic run (`workers = { min = 2, max = 4 }`) starts with the two trainers online and
/// takes two more that come online while it trains: each joins at a round after the first
/// (a `joined` event) and its updates go into rounds. Then it shrinks back: one of them is
/// killed (SIGKILL), and after a round the other is told to stop (SIGTERM); the run goes on
/// with three, then two (its `min`; nobody else is online, so nobody is leased). Every slice
/// is used once per epoch and the training loss falls.
#[test]
fn an_elastic_run_grows_from_two_trainers_to_four_and_shrinks_back() {
    // Two trainers apply a round of this job every quarter second: 40 epochs (some 80
    // rounds) leave the later trainers time to come online and join.
    const EPOCHS: u32 = 40;
    let (cluster, _data, _server) = cluster();
    let mut first: Vec<Proc> = (0..2)
        .map(|i| cluster.trainer_worker(&format!("first{i}"), ""))
        .collect();
    let job = cluster.diloco_job("elastic", "{ min = 2, max = 4 }", EPOCHS, "");
    let (mut scheduler, events_path) = cluster.scheduler("scheduler", &job);
    scheduler.wait_for("round applied");
    let mut later: Vec<(String, Proc)> = (0..2)
        .map(|i| {
            let name = format!("later{i}");
            cluster.peer_id_after(&name, |cluster| cluster.trainer_worker(&name, ""))
        })
        .collect();
    // Once both joined and a round went by, one of them is killed.
    let later_peers: Vec<String> = later.iter().map(|(peer, _)| peer.clone()).collect();
    let joined_later = |events: &[serde_json::Value]| {
        of_kind(events, "joined")
            .into_iter()
            .filter(|j| {
                later_peers
                    .iter()
                    .any(|peer| j["event"]["peer"] == peer.as_str())
            })
            .map(|j| j["event"]["round"].as_u64().unwrap())
            .collect::<Vec<_>>()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let events = events(&events_path);
        let joined = joined_later(&events);
        if let (2, Some(last)) = (joined.len(), joined.iter().max()) {
            let rounds = of_kind(&events, "round");
            if rounds
                .iter()
                .any(|r| r["event"]["round"].as_u64() > Some(*last))
            {
                break;
            }
        }
        if std::time::Instant::now() > deadline {
            while let Ok(line) = scheduler.lines.try_recv() {
                scheduler.seen.push(line);
            }
            panic!(
                "the later trainers did not join: {:?}; the scheduler logged:\n{}",
                of_kind(&events, "joined"),
                scheduler.seen.join("\n")
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    later[1].1.child.kill().unwrap();
    // Rounds applied by the time each left.
    let lost_at = loop {
        let events = events(&events_path);
        if let Some(at) = events.iter().position(|e| e["event"]["kind"] == "lost")
            && of_kind(&events[at..], "round").len() >= 2
        {
            break of_kind(&events[..at], "round").len();
        }
        assert!(std::time::Instant::now() < deadline + Duration::from_secs(60));
        std::thread::sleep(Duration::from_millis(100));
    };
    let left_at = of_kind(&events(&events_path), "round").len();
    let stopped = std::process::Command::new("kill")
        .args(["-TERM", &later[0].1.child.id().to_string()])
        .status()
        .unwrap();
    assert!(stopped.success());
    assert!(
        later[0].1.child.wait().unwrap().success(),
        "it left cleanly"
    );
    let (ok, lines) = scheduler.wait(Duration::from_secs(180));
    let mut procs: Vec<&mut Proc> = first.iter_mut().collect();
    procs.extend(later.iter_mut().map(|(_, p)| p));
    assert_succeeded(&cluster, ok, &lines, &mut procs);

    let events = events(&events_path);
    let joined = joined_later(&events);
    assert!(
        joined.len() == 2 && joined.iter().all(|round| *round > 0),
        "both later trainers joined mid-run: {joined:?}"
    );
    let metrics = lines_of(&cluster.path("elastic-job.metrics.jsonl"));
    let included = |peer: &str| {
        metrics
            .iter()
            .filter(|m| m["kind"] == "round")
            .filter(|r| r["included"].as_array().unwrap().iter().any(|p| p == peer))
            .count()
    };
    for peer in &later_peers {
        assert!(included(peer) >= 1, "{peer} is in no round");
    }
    let killed_at = events
        .iter()
        .position(|e| e["event"]["kind"] == "lost")
        .expect("the killed trainer is reported lost");
    assert!(
        of_kind(&events[killed_at..], "round").len() >= 2,
        "rounds go on after the kill"
    );
    assert_eq!(
        of_kind(&events, "leased").len(),
        5,
        "the parameter server and four trainers, none to replace those that left"
    );
    let rounds = of_kind(&events, "round");
    assert!(
        rounds[lost_at..left_at]
            .iter()
            .any(|r| r["event"]["trainers"] == 3),
        "three trained on after the kill"
    );
    assert!(
        rounds[left_at + 1..]
            .iter()
            .any(|r| r["event"]["trainers"] == 2),
        "two trained on after the leave"
    );
    assert_audit_passes(&cluster.path("elastic-job.ledger"), EPOCHS, SLICES);
    // The model learns: the training loss falls. (Scored on fresh samples it does not: 40
    // epochs of these 1,536 samples overfit them.)
    let losses: Vec<f64> = metrics
        .iter()
        .filter(|m| m["kind"] == "round")
        .filter_map(|r| r["loss"].as_f64())
        .collect();
    let (first, last) = (losses[0], losses[losses.len() - 1]);
    assert!(last < 0.25 * first, "training loss {first} → {last}");
}

/// A worker told to stop (SIGTERM) while its trainer trains: the trainer sends what it
/// trained in the round as it goes, and that round takes it (its peer is in the round's
/// included trainers); no round waits for it (each closes well within its 5 s), the run goes
/// on with the other two (an elastic run's `min`), and every slice is used once per epoch.
#[test]
fn a_trainer_told_to_stop_sends_its_update_and_no_round_waits_for_it() {
    told_to_stop(
        |cluster, name| cluster.trainer_worker(name, ""),
        Stop::Drain,
    );
}

/// The same with a trainer of the Python SDK leaving (the numpy example).
#[test]
fn a_python_trainer_told_to_stop_sends_its_update_too() {
    if python_with(&["numpy"], true) {
        told_to_stop(
            |cluster, name| {
                cluster.python_worker(name, "train", "diloco", "examples/numpy_trainer.py", &[])
            },
            Stop::Signal,
        );
    }
}

/// How a worker is told to stop: the two ways a user has.
enum Stop {
    /// `kill -TERM`, what a service manager sends.
    Signal,
    /// `hypha-worker drain --config`, which waits until the worker has exited.
    Drain,
}

/// Runs an elastic job of three trainers, the first started by `leaver`, and tells the first
/// to stop once a round was applied.
fn told_to_stop(leaver: impl Fn(&Cluster, &str) -> Proc, stop: Stop) {
    const EPOCHS: u32 = 10;
    let (mut cluster, _data, _server) = cluster();
    cluster.worker_prefetch_bytes = Some(1);
    let mut trainers: Vec<(String, Proc)> = (0..3)
        .map(|i| {
            let name = format!("trainer{i}");
            cluster.peer_id_after(&name, |cluster| match i {
                0 => leaver(cluster, &name),
                _ => cluster.trainer_worker(&name, ""),
            })
        })
        .collect();
    let job = cluster.diloco_job("leave", "{ min = 2, max = 3 }", EPOCHS, "");
    let (mut scheduler, events_path) = cluster.scheduler("scheduler", &job);
    scheduler.wait_for("round applied");
    let leaver = trainers[0].0.clone();
    let proc = &mut trainers[0].1;
    match stop {
        Stop::Signal => {
            let stopped = std::process::Command::new("kill")
                .args(["-TERM", &proc.child.id().to_string()])
                .status()
                .unwrap();
            assert!(stopped.success());
        }
        Stop::Drain => {
            let drained = std::process::Command::new(bin("hypha-worker"))
                .args(["drain", "--config"])
                .arg(cluster.path("trainer0.toml"))
                .output()
                .unwrap();
            let said = String::from_utf8_lossy(&drained.stdout);
            assert!(
                drained.status.success() && said.contains("drained and exited"),
                "drain failed: {said}{}",
                String::from_utf8_lossy(&drained.stderr)
            );
            // It returned once the worker had exited.
            assert!(
                proc.child.try_wait().unwrap().is_some(),
                "the worker still runs after drain"
            );
        }
    }
    assert!(
        proc.child.wait().unwrap().success(),
        "the worker left cleanly"
    );
    while let Ok(line) = proc.lines.try_recv() {
        proc.seen.push(line);
    }
    let worker_said = proc.seen.join("\n");
    let (ok, lines) = scheduler.wait(Duration::from_secs(180));
    let mut procs: Vec<&mut Proc> = trainers.iter_mut().map(|(_, p)| p).collect();
    assert_succeeded(&cluster, ok, &lines, &mut procs);

    let said = std::fs::read_to_string(job_dir(&cluster.path("trainer0-work")).join("stderr.log"))
        .unwrap();
    let round: u64 = said
        .lines()
        .find_map(|l| l.strip_prefix("told to stop in round "))
        .and_then(|rest| rest.split(':').next()?.parse().ok())
        .unwrap_or_else(|| panic!("the trainer did not say it was told to stop:\n{said}"));
    let metrics = lines_of(&cluster.path("leave-job.metrics.jsonl"));
    let rounds: Vec<_> = metrics.iter().filter(|m| m["kind"] == "round").collect();
    let left_in = rounds
        .iter()
        .find(|r| r["round"] == round)
        .unwrap_or_else(|| panic!("round {round} was not applied: {rounds:?}"));
    assert!(
        left_in["included"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p == leaver.as_str()),
        "the leaving trainer's update of round {round} is not in it: {left_in}\nit said:\n{said}\nits worker said:\n{worker_said}"
    );
    assert!(
        rounds.iter().all(|r| r["seconds"].as_f64().unwrap() < 4.0),
        "a round waited: {rounds:?}"
    );
    assert!(
        rounds.iter().any(|r| r["round"].as_u64() > Some(round + 1)
            && r["included"].as_array().unwrap().len() == 2),
        "the run went on with the other two"
    );
    let events = events(&events_path);
    assert_eq!(of_kind(&events, "leased").len(), 4, "nobody replaced it");
    assert_audit_passes(&cluster.path("leave-job.ledger"), EPOCHS, SLICES);
    // The slices it trained in that round are used with the round, not given back when its
    // job ended (and trained again by others).
    let leaver_job = of_kind(&events, "dispatched")
        .into_iter()
        .find(|e| e["event"]["peer"] == leaver.as_str())
        .and_then(|e| e["event"]["job"].as_str().map(str::to_string))
        .unwrap();
    let records = hypha_ledger::read_audit(&cluster.path("leave-job.ledger"))
        .unwrap()
        .records;
    let by_leaver = |event: &hypha_ledger::Event| match event {
        hypha_ledger::Event::Consumed { worker, round: r } => {
            worker.contains(&leaver_job) && *r == round
        }
        _ => false,
    };
    let consumed: Vec<_> = records.iter().filter(|r| by_leaver(&r.event)).collect();
    assert!(
        !consumed.is_empty(),
        "the leaver consumed nothing in round {round}"
    );
    for slice in consumed {
        let used = records.iter().any(|r| {
            r.key == slice.key
                && matches!(&r.event, hypha_ledger::Event::Used { worker, round: r }
                    if worker.contains(&leaver_job) && *r == round)
        });
        assert!(
            used,
            "{:?} went back instead of being used with round {round}",
            slice.key
        );
    }
}

#[test]
fn a_parameter_server_killed_mid_round_is_replaced_from_the_checkpoint_and_training_goes_on() {
    server_killed_mid_round(1);
}

/// A server that checkpoints every third round takes the rounds it applied since its last
/// checkpoint with it: the new one goes on from the checkpoint of round 0, the run's record
/// says how many rounds were lost, and their slices are trained again, each still once.
#[test]
fn a_parameter_server_that_checkpoints_every_third_round_loses_only_those_rounds_when_killed() {
    server_killed_mid_round(3);
}

fn server_killed_mid_round(checkpoint_every: u64) {
    let (cluster, _data, first) = cluster();
    let second = cluster.server_worker("ps2");
    let mut servers = [("ps", first), ("ps2", second)];
    let mut trainers: Vec<Proc> = (0..2)
        .map(|i| cluster.trainer_worker(&format!("trainer{i}"), ""))
        .collect();
    let job = cluster.diloco_job(
        "failover",
        2,
        2,
        &format!("checkpoint_every = {checkpoint_every}\n"),
    );
    let (mut scheduler, events_path) = cluster.scheduler("scheduler", &job);
    // Once two rounds are applied (the first one's checkpoint is in), the third is under
    // way: kill the worker of the server.
    scheduler.wait_for("round applied");
    scheduler.wait_for("round applied");
    let victim = servers
        .iter()
        .position(|(name, _)| {
            std::fs::read_dir(cluster.path(&format!("{name}-work"))).is_ok_and(|dir| {
                dir.flatten()
                    .any(|e| e.file_name().to_string_lossy().starts_with("hypha-"))
            })
        })
        .unwrap();
    servers[victim].1.child.kill().unwrap();
    let (ok, lines) = scheduler.wait(Duration::from_secs(240));
    let mut procs: Vec<&mut Proc> = trainers.iter_mut().collect();
    let [(_, a), (_, b)] = &mut servers;
    procs.push(a);
    procs.push(b);
    assert_succeeded(&cluster, ok, &lines, &mut procs);

    let events = events(&events_path);
    let failovers = of_kind(&events, "failover");
    assert_eq!(failovers.len(), 1, "{failovers:#?}");
    let from = failovers[0]["event"]["round"].as_u64().unwrap();
    let lost_rounds = failovers[0]["event"]["lost_rounds"].as_u64().unwrap();
    if checkpoint_every == 1 {
        assert!(
            from >= 1,
            "restored from a checkpoint after the first round"
        );
        assert!(lost_rounds <= 1, "{failovers:#?}");
    } else {
        // Two rounds were applied; the only checkpoint is the adopted model's.
        assert_eq!((from, lost_rounds), (0, 2), "{failovers:#?}");
    }
    let at = events
        .iter()
        .position(|e| e["event"]["kind"] == "failover")
        .unwrap();
    let round = |e: &serde_json::Value| e["event"]["round"].as_u64().unwrap();
    let before: Vec<&serde_json::Value> = events[..at]
        .iter()
        .filter(|e| e["event"]["kind"] == "round")
        .collect();
    let after: Vec<&serde_json::Value> = events[at..]
        .iter()
        .filter(|e| e["event"]["kind"] == "round")
        .collect();
    // The run goes on from the checkpoint's round: the model it continues holds rounds
    // 0..from of the lost server and from.. of the new one, each once.
    let continued = continued_rounds(&events);
    assert_eq!(
        continued,
        (0..continued.len() as u64).collect::<Vec<_>>(),
        "rounds before the failover: {:?}",
        before.iter().map(|e| round(e)).collect::<Vec<_>>()
    );
    assert!(!after.is_empty(), "rounds were applied after the failover");
    assert_eq!(
        lost_rounds,
        before.iter().filter(|e| round(e) >= from).count() as u64,
        "the record counts the rounds applied past the checkpoint"
    );
    if from > 0 {
        let metrics = lines_of(&cluster.path("failover-job.metrics.jsonl"));
        went_on_with_the_model_of_round(from, &metrics, &events[at]);
    }

    // The survivor ran the new server and wrote the final model.
    let survivor = servers[1 - victim].0;
    let final_model = job_dir(&cluster.path(&format!("{survivor}-work"))).join("final.safetensors");
    assert!(final_model.exists(), "{}", final_model.display());
    // The final model learned. How much varies from run to run with how the rounds fell
    // (measured 0.30..0.59 of the start in five runs: a last round of one trainer and a few
    // batches moves the model by its momentum mostly); one that learned nothing stays near 1.
    let (start, end) = (evaluation_loss(None), evaluation_loss(Some(final_model)));
    assert!(
        end < 0.75 * start,
        "evaluation loss {start} → {end}: {events:#?}"
    );

    assert_audit_passes(&cluster.path("failover-job.ledger"), 2, SLICES);
}

/// Checks that training went on after a `failover` event with the model of round `from`:
/// every trainer report of that round names the model round `from - 1` led to, and some came
/// after the failover. (Not the loss: a round resumed with a batch or two reads about as high
/// as round 0's mean over thirty, from the same model.)
fn went_on_with_the_model_of_round(
    from: u64,
    metrics: &[serde_json::Value],
    failover: &serde_json::Value,
) {
    let led_to = metrics
        .iter()
        .find(|m| m["kind"] == "round" && m["round"] == from - 1)
        .map(|m| m["model_hash"].clone())
        .unwrap();
    let reports: Vec<&serde_json::Value> = metrics
        .iter()
        .filter(|m| m["kind"] == "trainer" && m["round"] == from)
        .collect();
    for report in &reports {
        assert_eq!(report["model_hash"], led_to, "{report}");
    }
    assert!(
        reports
            .iter()
            .any(|r| r["time_ms"].as_u64() > failover["time_ms"].as_u64()),
        "no trainer reported round {from} after the failover: {reports:#?}"
    );
}

/// Issue 36, item 3: with `standby = true` a second server follows the first, taking every
/// round's change as trainers do. When the first one's worker is killed, the standby takes
/// over at the round it holds (the checkpoint, every third round, holds only round 0): the
/// rounds it holds are not trained again, no checkpoint travels, training goes on with the
/// same model, a new standby is leased, and every slice is used once.
#[test]
fn a_parameter_server_killed_with_a_standby_is_replaced_by_it_without_losing_its_rounds() {
    server_killed_with_a_standby(3);
}

/// The same with no worker left for a new standby: the run goes on without one and
/// completes.
#[test]
fn a_run_whose_standby_took_over_completes_without_a_new_one() {
    server_killed_with_a_standby(2);
}

fn server_killed_with_a_standby(server_workers: usize) {
    let (cluster, _data, first) = cluster();
    let mut servers = vec![("ps", first)];
    for name in ["ps2", "ps3"].into_iter().take(server_workers - 1) {
        servers.push((name, cluster.server_worker(name)));
    }
    let mut trainers: Vec<Proc> = (0..2)
        .map(|i| cluster.trainer_worker(&format!("trainer{i}"), ""))
        .collect();
    let job = cluster.diloco_job(
        "standby",
        2,
        2,
        "checkpoint_every = 3\ncompression = \"int8\"\nstandby = true\n",
    );
    let (mut scheduler, events_path) = cluster.scheduler("scheduler", &job);
    scheduler.wait_for("round applied");
    scheduler.wait_for("round applied");
    // Once the standby holds the model of round 2 (two rounds applied), the server's worker
    // is killed.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let holds = |proc: &mut Proc, needle: &str| proc.logged().iter().any(|l| l.contains(needle));
    let standby = loop {
        let found = servers
            .iter_mut()
            .position(|(_, proc)| holds(proc, "standby: holding the global model round=2"));
        if let Some(found) = found {
            break found;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no standby held round 2"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let victim = servers
        .iter_mut()
        .position(|(_, proc)| holds(proc, "round closed"))
        .unwrap();
    assert_ne!(victim, standby);
    servers[victim].1.child.kill().unwrap();
    let (ok, lines) = scheduler.wait(Duration::from_secs(240));
    let mut procs: Vec<&mut Proc> = trainers.iter_mut().collect();
    procs.extend(servers.iter_mut().map(|(_, proc)| proc));
    assert_succeeded(&cluster, ok, &lines, &mut procs);

    let events = events(&events_path);
    let failovers = of_kind(&events, "failover");
    assert_eq!(failovers.len(), 1, "{failovers:#?}");
    let failover = &failovers[0]["event"];
    assert!(failover["standby"].is_string(), "{failover:#?}");
    let from = failover["round"].as_u64().unwrap();
    assert!(
        from >= 2,
        "the standby held round 2 before the kill: {failover:#?}"
    );
    let round = |e: &serde_json::Value| e["event"]["round"].as_u64().unwrap();
    let at = events
        .iter()
        .position(|e| e["event"]["kind"] == "failover")
        .unwrap();
    let before: Vec<&serde_json::Value> = events[..at]
        .iter()
        .filter(|e| e["event"]["kind"] == "round")
        .collect();
    let after: Vec<&serde_json::Value> = events[at..]
        .iter()
        .filter(|e| e["event"]["kind"] == "round")
        .collect();
    assert_eq!(
        failover["lost_rounds"].as_u64().unwrap(),
        before.iter().filter(|e| round(e) >= from).count() as u64,
        "only rounds past the one the standby held are lost"
    );
    let continued = continued_rounds(&events);
    assert_eq!(continued, (0..continued.len() as u64).collect::<Vec<_>>());
    assert!(!after.is_empty(), "rounds were applied after the failover");
    let metrics = lines_of(&cluster.path("standby-job.metrics.jsonl"));
    went_on_with_the_model_of_round(from, &metrics, &events[at]);
    // No trainer holding the model the standby took over at was sent that model again: each
    // went on with its round (no join), or offered the model by its fingerprint and started
    // the round over from its own copy.
    let said: Vec<String> = (0..trainers.len())
        .map(|i| {
            let dir = job_dir(&cluster.path(&format!("trainer{i}-work")));
            std::fs::read_to_string(dir.join("stderr.log")).unwrap()
        })
        .collect();
    for said in &said {
        let said: Vec<&str> = said.lines().collect();
        let joined_with_it = format!("with the global model of round Some({from})");
        let Some(joined) = said.iter().position(|l| l.contains(&joined_with_it)) else {
            continue;
        };
        let after_join = &said[joined..];
        let started = after_join.iter().find(|l| {
            l.contains("global model received") || l.contains("holds this trainer's global model")
        });
        // A whole model of a later round is what a trainer left out of a round gets (the
        // standby closed the round while it joined).
        let sent_again = format!("round {from}: global model received (whole)");
        assert!(
            started.is_some_and(|l| !l.contains(&sent_again)),
            "a trainer that held round {from}'s model joined the standby and was sent it whole: {after_join:#?}"
        );
    }
    // The kill comes as the standby takes round 2: the trainers train or sync that round,
    // or have yet to take its change.
    let moved_no_model = |said: &String| {
        let lines: Vec<&str> = said.lines().collect();
        let after_join = lines
            .iter()
            .position(|l| l.contains("; joining the parameter server"))
            .map(|joined| &lines[joined..]);
        said.contains("going on with the parameter server")
            || said.contains("holds this trainer's global model")
            || after_join.is_some_and(|lines| {
                lines
                    .iter()
                    .find(|l| l.contains("global model received"))
                    .is_some_and(|l| l.contains("(as a change)"))
            })
    };
    assert!(
        said.iter().any(moved_no_model),
        "no trainer went on with its round, started it over from its own copy or took a change: {said:#?}"
    );
    // The server counted what it sent the standby apart from the round's traffic.
    let followed: Vec<u64> = metrics
        .iter()
        .filter(|l| l["kind"] == "round")
        .filter_map(|l| l["standby_bytes"].as_u64())
        .collect();
    assert!(
        followed.iter().any(|bytes| *bytes > 0),
        "rounds said no bytes went to the standby: {followed:?}"
    );
    // The standby took over from what it held: nobody sent it a checkpoint to restore.
    let (_, taker) = &mut servers[standby];
    assert!(holds(taker, "taking over"));
    assert!(!holds(taker, "restored from the scheduler's checkpoint"));
    // The standby's slot (after the two trainers' and the server's) was filled again.
    let standby_leases = of_kind(&events, "leased")
        .into_iter()
        .filter(|e| e["event"]["slot"] == 3)
        .count();
    assert_eq!(standby_leases, server_workers - 1, "{events:#?}");

    let final_model =
        job_dir(&cluster.path(&format!("{}-work", servers[standby].0))).join("final.safetensors");
    let (start, end) = (evaluation_loss(None), evaluation_loss(Some(final_model)));
    assert!(end < 0.75 * start, "evaluation loss {start} → {end}");
    assert_audit_passes(&cluster.path("standby-job.ledger"), 2, SLICES);
}

/// The round events of a run as the model it ends with saw them: each failover (with the
/// checkpoint's `round` the new server goes on from) throws away the rounds applied at or
/// after that round before it. A restart of the scheduler throws nothing away when the
/// parameter server goes on through it, and is a failover when it does not.
fn continued_rounds(events: &[serde_json::Value]) -> Vec<u64> {
    let mut rounds: Vec<u64> = Vec::new();
    for event in events {
        let kind = event["event"]["kind"].as_str().unwrap_or("");
        if kind == "round" {
            rounds.push(event["event"]["round"].as_u64().unwrap());
        } else if kind == "failover" {
            let from = event["event"]["round"].as_u64().unwrap_or(0);
            rounds.retain(|r| *r < from);
        }
    }
    rounds
}

#[test]
fn a_scheduler_killed_between_rounds_and_restarted_resumes_the_same_run() {
    scheduler_killed_and_restarted(false);
}

#[test]
fn a_scheduler_killed_mid_round_and_restarted_resumes_the_same_run() {
    scheduler_killed_and_restarted(true);
}

/// Once two rounds are applied (the first one's checkpoint is in), the scheduler is killed
/// and started again: as it logs the second (between rounds), or once a trainer reported
/// batches of the next (`mid_round`).
fn scheduler_killed_and_restarted(mid_round: bool) {
    let (cluster, _data, mut server) = cluster();
    let mut trainers: Vec<Proc> = (0..2)
        .map(|i| cluster.trainer_worker(&format!("trainer{i}"), ""))
        .collect();
    // Three epochs: rounds overshoot their size by up to a slice a trainer, and with two the
    // data could run out in the round the restart interrupts, leaving no later round whose
    // loss the checks below compare (seen once in a loaded full-suite run).
    // Every round checkpointed: the restarted scheduler finds the first round's checkpoint.
    let job = cluster.diloco_job("resume", 2, 3, "checkpoint_every = 1\n");
    let (mut first, events_path) = cluster.scheduler("scheduler", &job);
    first.wait_for("round applied");
    first.wait_for("round applied");
    if mid_round {
        let metrics = cluster.path("resume-job.metrics.jsonl");
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while !events(&metrics).iter().any(|line| {
            line["kind"] == "trainer"
                && line["round"].as_u64() >= Some(2)
                && line["batches"].as_u64() >= Some(1)
        }) {
            assert!(
                std::time::Instant::now() < deadline,
                "no trainer trained round 2"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    first.child.kill().unwrap();
    first.child.wait().unwrap();
    let before = events(&events_path);
    let (mut second, _) = cluster.restart_scheduler("scheduler", &job);
    // Anyone can see that the run was restarted and took its leases over.
    let listening = second.wait_for("listening");
    second.wait_for("round applied");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while of_kind(&events(&events_path)[before.len()..], "readopted").len() < 3
        && std::time::Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(100));
    }
    let progress = cluster.progress("scheduler", &listening);
    let run = &progress["run"];
    assert_eq!(
        (&run["restarts"], &run["readoptions"], &run["failovers"]),
        (&1.into(), &3.into(), &0.into()),
        "{progress:#}"
    );
    assert_eq!(run["recent"][0]["kind"], "restart", "{progress:#}");
    let (ok, lines) = second.wait(Duration::from_secs(150));
    let mut procs: Vec<&mut Proc> = trainers.iter_mut().chain([&mut server]).collect();
    assert_succeeded(&cluster, ok, &lines, &mut procs);

    let events = events(&events_path);
    let resumed = of_kind(&events, "resumed");
    assert_eq!(resumed.len(), 1, "{resumed:#?}");
    let from = resumed[0]["event"]["round"].as_u64().unwrap();
    let task = resumed[0]["event"]["task"].as_str().unwrap();
    assert_eq!(
        resumed[0]["event"]["jobs"], 3,
        "the trainers and the server"
    );
    assert!(from >= 1, "the checkpoint of the first round was held");
    // The same run: the workers' leases were taken over with their jobs, none was leased
    // or dispatched anew.
    let after = &events[before.len()..];
    let readopted = of_kind(after, "readopted");
    assert_eq!(readopted.len(), 3, "{after:#?}");
    assert!(
        readopted.iter().all(|e| e["event"]["job"].is_string()),
        "every job went on: {readopted:#?}"
    );
    assert!(of_kind(after, "leased").is_empty(), "{after:#?}");
    assert!(of_kind(after, "dispatched").is_empty(), "{after:#?}");
    assert!(of_kind(after, "failover").is_empty(), "{after:#?}");
    for worker in ["trainer0", "trainer1", "ps"] {
        let jobs = std::fs::read_dir(cluster.path(&format!("{worker}-work")))
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("hypha-"))
            .count();
        assert_eq!(jobs, 1, "{worker} ran one job through the restart");
    }
    assert!(
        std::fs::read_dir(cluster.path("trainer0-work"))
            .unwrap()
            .flatten()
            .filter_map(|e| std::fs::read_to_string(e.path().join("job.json")).ok())
            .all(|job| job.contains(task)),
        "every job of both processes ran for one task"
    );
    // No round number is applied twice, and the server went on with the round after the
    // last one applied before the kill (or the one after that, applied unheard).
    let applied: Vec<u64> = of_kind(&events, "round")
        .iter()
        .map(|e| e["event"]["round"].as_u64().unwrap())
        .collect();
    assert!(
        applied.windows(2).all(|w| w[0] < w[1]),
        "rounds applied: {applied:?}"
    );
    let last_round_before = of_kind(&before, "round").len() as u64 - 1;
    let first_round_after = of_kind(after, "round")[0]["event"]["round"]
        .as_u64()
        .unwrap();
    assert!(
        (last_round_before + 1..=last_round_before + 2).contains(&first_round_after),
        "round {last_round_before} applied before the kill, {first_round_after} first after it"
    );
    let continued = continued_rounds(&events);
    assert_eq!(continued, applied, "{events:#?}");
    // The loss goes on from where it was, not from a fresh model's.
    let losses: Vec<f64> = of_kind(&events, "round")
        .iter()
        .filter_map(|e| e["event"]["loss"].as_f64())
        .collect();
    let resumed_at = before.len();
    // The first round with a loss: one applied as the scheduler died has none.
    let first_after = events[resumed_at..]
        .iter()
        .filter(|e| e["event"]["kind"] == "round")
        .find_map(|e| e["event"]["loss"].as_f64())
        .unwrap();
    assert!(
        first_after < 0.9 * losses[0],
        "loss {} in round 0, {first_after} right after the restart",
        losses[0]
    );
    // Within a small tolerance of the last loss before the kill (measured: at most 4 % above
    // in six runs, often below; a fresh model's is about 30 % above).
    let last_before = of_kind(&before, "round")
        .last()
        .and_then(|e| e["event"]["loss"].as_f64())
        .unwrap();
    assert!(
        first_after < 1.15 * last_before,
        "loss {last_before} before the restart, {first_after} right after it"
    );
    assert_audit_passes(&cluster.path("resume-job.ledger"), 3, SLICES);
    assert!(
        !cluster.path("resume-job.run.json").exists(),
        "a completed run leaves no record to resume"
    );
}

#[test]
fn a_parameter_server_lost_while_the_scheduler_is_down_is_replaced_from_the_checkpoint_at_the_restart()
 {
    let (cluster, _data, mut server) = cluster();
    let mut trainers: Vec<Proc> = (0..2)
        .map(|i| cluster.trainer_worker(&format!("trainer{i}"), ""))
        .collect();
    let job = cluster.diloco_job("outage", 2, 2, "");
    let (mut first, events_path) = cluster.scheduler("scheduler", &job);
    first.wait_for("round applied");
    first.wait_for("round applied");
    first.kill();
    // The parameter server's worker goes down too and comes back without its job or lease.
    server.kill();
    let mut server = cluster.restart("ps", "hypha-worker", "worker ready for advertisements");
    let before = events(&events_path).len();
    let (mut second, _) = cluster.restart_scheduler("scheduler", &job);
    let (ok, lines) = second.wait(Duration::from_secs(150));
    let mut procs: Vec<&mut Proc> = trainers.iter_mut().chain([&mut server]).collect();
    assert_succeeded(&cluster, ok, &lines, &mut procs);

    let events = events(&events_path);
    let after = &events[before..];
    let from = of_kind(after, "resumed")[0]["event"]["round"]
        .as_u64()
        .unwrap();
    // The server is replaced from the checkpoint the scheduler holds; the trainers went on.
    let failovers = of_kind(after, "failover");
    assert_eq!(failovers.len(), 1, "{after:#?}");
    assert_eq!(failovers[0]["event"]["round"].as_u64(), Some(from));
    let went_on = of_kind(after, "readopted")
        .iter()
        .filter(|e| e["event"]["job"].is_string())
        .count();
    assert_eq!(went_on, 2, "both trainers' jobs went on: {after:#?}");
    // The rounds the lost server applied past the checkpoint were trained again, once.
    let continued = continued_rounds(&events);
    assert_eq!(
        continued,
        (0..continued.len() as u64).collect::<Vec<_>>(),
        "{events:#?}"
    );
    assert_audit_passes(&cluster.path("outage-job.ledger"), 2, SLICES);
}

#[test]
fn a_scheduler_killed_while_it_leases_trainers_resumes_with_the_server_it_had() {
    let (cluster, _data, _server) = cluster();
    let job = cluster.diloco_job("allocating", 2, 1, "");
    // No trainer is online yet: the scheduler leases the parameter server, dispatches it and
    // waits for trainers when it is killed.
    let (mut first, events_path) = cluster.scheduler("scheduler", &job);
    first.wait_for("job dispatched");
    first.child.kill().unwrap();
    first.child.wait().unwrap();
    let before = events(&events_path).len();
    let _trainers: Vec<Proc> = (0..2)
        .map(|i| cluster.trainer_worker(&format!("trainer{i}"), ""))
        .collect();
    let (mut second, _) = cluster.restart_scheduler("scheduler", &job);
    let (ok, lines) = second.wait(Duration::from_secs(120));
    assert!(ok, "the restarted scheduler failed:\n{}", lines.join("\n"));
    no_errors("the restarted scheduler", &lines);

    let events = events(&events_path);
    let after = &events[before..];
    let resumed = of_kind(after, "resumed");
    assert_eq!(resumed.len(), 1, "{after:#?}");
    assert_eq!(resumed[0]["event"]["jobs"], 1, "the parameter server's job");
    assert!(resumed[0]["event"]["round"].is_null(), "no checkpoint yet");
    let readopted = of_kind(after, "readopted");
    assert_eq!(readopted.len(), 1, "{after:#?}");
    assert_eq!(
        readopted[0]["event"]["slot"], 2,
        "the parameter server's slot"
    );
    assert_eq!(
        of_kind(after, "leased").len(),
        2,
        "the trainers, leased anew"
    );
    let continued = continued_rounds(&events);
    assert!(!continued.is_empty());
    assert_eq!(continued, (0..continued.len() as u64).collect::<Vec<_>>());
    assert_audit_passes(&cluster.path("allocating-job.ledger"), 1, SLICES);
}

/// The same seed, the same kill schedule (xorshift64*).
struct Schedule(u64);

impl Schedule {
    fn new(seed: u64) -> Self {
        Schedule(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// A number below `bound`.
    fn below(&mut self, bound: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 32) % bound
    }
}

/// What the ledger at `path` recorded of the slices it never saw used.
fn never_used(path: &std::path::Path) -> String {
    let Ok(audit) = hypha_ledger::read_audit(path) else {
        return "(the ledger cannot be read)".into();
    };
    let used: std::collections::HashSet<_> = audit
        .records
        .iter()
        .filter(|r| matches!(r.event, hypha_ledger::Event::Used { .. }))
        .map(|r| r.key)
        .collect();
    audit
        .records
        .iter()
        .filter(|r| !used.contains(&r.key))
        .map(|r| format!("{} {:?} {:?}", r.time_ms, r.key, r.event))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Rounds the events file at `path` tells of, over every process of the scheduler.
fn rounds_applied(path: &std::path::Path) -> usize {
    of_kind(&events(path), "round").len()
}

/// One run of three trainers and a parameter server (with a second worker that offers one)
/// under four kills chosen by `seed`, each after a few more rounds were applied: a trainer's
/// worker, the data node, the parameter server's worker or the scheduler, SIGKILLed and
/// started again with the identity it had within 1.5 s.
fn survive_kill_schedule(seed: u64) {
    const TRAINERS: usize = 3;
    const EPOCHS: u32 = 3;
    let mut schedule = Schedule::new(seed);
    let cluster = Cluster::new();
    let mut nodes: std::collections::HashMap<String, Proc> = std::collections::HashMap::new();
    nodes.insert("data".into(), cluster.blobs_data_node("data"));
    for name in ["ps", "ps2"] {
        nodes.insert(name.into(), cluster.server_worker(name));
    }
    for i in 0..TRAINERS {
        let name = format!("trainer{i}");
        nodes.insert(name.clone(), cluster.trainer_worker(&name, ""));
    }
    // Smaller rounds than the other tests' (about 36 of them), and attempts enough for every
    // kill to land on one slot.
    let job = cluster.diloco_job("chaos", TRAINERS, EPOCHS, "");
    let text = std::fs::read_to_string(&job)
        .unwrap()
        .replace("samples_per_round = 768", "samples_per_round = 128")
        .replace("max_attempts = 3", "max_attempts = 10");
    std::fs::write(&job, text).unwrap();
    let (mut scheduler, events_path) = cluster.scheduler("scheduler", &job);
    let servers: Vec<(String, String)> = ["ps", "ps2"]
        .iter()
        .map(|name| (cluster.peer_id(name), name.to_string()))
        .collect();

    let mut kills = Vec::new();
    let mut at = 0;
    for _ in 0..4 {
        at += 2 + schedule.below(3) as usize;
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while rounds_applied(&events_path) < at {
            if scheduler.child.try_wait().unwrap().is_some() {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "seed {seed}: no round {at} within 60 s after kills {kills:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        if scheduler.child.try_wait().unwrap().is_some() {
            break;
        }
        let pause = Duration::from_millis(schedule.below(1500));
        let victim = match schedule.below(4) {
            0 => format!("trainer{}", schedule.below(TRAINERS as u64)),
            1 => "data".to_string(),
            2 => {
                // The worker the latest parameter-server job was dispatched to.
                let events = events(&events_path);
                let peer = of_kind(&events, "dispatched")
                    .into_iter()
                    .rev()
                    .find(|e| e["event"]["slot"] == TRAINERS)
                    .and_then(|e| e["event"]["peer"].as_str().map(str::to_string))
                    .unwrap();
                servers
                    .iter()
                    .find(|(id, _)| *id == peer)
                    .map(|(_, name)| name.clone())
                    .unwrap()
            }
            _ => "scheduler".to_string(),
        };
        kills.push((at, victim.clone(), pause));
        if victim == "scheduler" {
            scheduler.kill();
            std::thread::sleep(pause);
            scheduler = cluster.restart_scheduler("scheduler", &job).0;
        } else {
            nodes.get_mut(&victim).unwrap().kill();
            std::thread::sleep(pause);
            let restarted = if victim == "data" {
                cluster.restart("data", "hypha-data", "announced")
            } else {
                cluster.restart(&victim, "hypha-worker", "worker ready for advertisements")
            };
            nodes.insert(victim, restarted);
        }
    }

    let (ok, lines) = scheduler.wait(Duration::from_secs(180));
    let mut procs: Vec<&mut Proc> = nodes.values_mut().collect();
    if !ok {
        // What the end shows again at the end, where a log cut in the middle (CI's) still
        // shows it: the slices never used, how the jobs ended and, last, the scheduler's
        // last lines (its error among them).
        let last = &lines[lines.len().saturating_sub(12)..];
        let endings: Vec<&String> = (lines.iter())
            .filter(|l| l.contains("job done") || l.contains("exited") || l.contains("data done"))
            .collect();
        let endings = &endings[endings.len().saturating_sub(12)..];
        panic!(
            "seed {seed}, kills {kills:?}: the scheduler failed:\n{}\n{}\nslices never used:\n{}\nhow jobs ended:\n{}\nthe scheduler's last lines:\n{}",
            lines.join("\n"),
            diagnostics(&cluster, &mut procs),
            never_used(&cluster.path("chaos-job.ledger")),
            endings
                .iter()
                .map(|l| l.as_str())
                .collect::<Vec<_>>()
                .join("\n"),
            last.join("\n"),
        );
    }
    no_errors(
        &format!("seed {seed}, kills {kills:?}: the scheduler"),
        &lines,
    );
    let events = events(&events_path);
    let continued = continued_rounds(&events);
    assert_eq!(
        continued,
        (0..continued.len() as u64).collect::<Vec<_>>(),
        "seed {seed}, kills {kills:?}: no round applied twice to the final model"
    );
    assert_audit_passes(&cluster.path("chaos-job.ledger"), EPOCHS, SLICES);
    eprintln!(
        "seed {seed}: kills {kills:?}, {} rounds in the final model",
        continued.len()
    );
}

/// Seeds 1 to 3; `CHAOS_SEED=N` runs seed N alone (to reproduce a failure's schedule).
#[test]
fn seeded_kill_schedules_over_every_role_leave_each_slice_used_once() {
    let seeds = match std::env::var("CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        Some(seed) => seed..=seed,
        None => 1..=3,
    };
    for seed in seeds {
        survive_kill_schedule(seed);
    }
}

/// Two Rust reference trainers and one numpy trainer written with the Python SDK
/// (`python/examples/numpy_trainer.py`, the same MLP under the same parameter names) train one
/// DiLoCo job: every slice once per epoch, the Python trainer's pseudo-gradients in the rounds,
/// the loss falls.
#[test]
fn rust_and_numpy_trainers_train_one_job_together() {
    if python_with(&["numpy"], true) {
        train_with_python_trainer("examples/numpy_trainer.py", 2, "");
    }
}

/// The same mixed fleet with `compression = "sparse"`: the numpy trainer sends its
/// pseudo-gradients sparse with error feedback as the Rust trainers do (the SDK's
/// `hypha_sdk.codec`, with the job's density), the server takes them into its rounds (it
/// refuses a file it cannot read), and the model learns. A quarter of each chunk, in 8 rounds:
/// the default 1 % needs tens of rounds (in the 4 rounds of this dataset's two epochs the
/// loss went from 1.37 to 1.32 only).
#[test]
fn rust_and_numpy_trainers_train_one_job_together_with_sparse_updates() {
    if python_with(&["numpy"], true) {
        train_with_python_trainer(
            "examples/numpy_trainer.py",
            2,
            "compression = \"sparse\"\nsparse_density = 0.25\nsamples_per_round = 384\n",
        );
    }
}

/// A trainer that takes 10 s to load (`python/tests/slow_trainer.py`: the numpy trainer
/// sleeping first, as a PyTorch trainer importing torch and starting CUDA does) beside two
/// reference trainers ready within a second or two trains the run's first round: the round
/// waits for it (`start_grace_seconds`, default 60 s), the events say so as more get ready,
/// and every trainer joins at round 0. Each slice used is used once. (Checked with
/// `start_grace_seconds = 0`: the reference trainers train the three rounds before it has
/// loaded.)
#[test]
fn a_trainer_slow_to_load_trains_the_first_round() {
    if !python_with(&["numpy"], true) {
        return;
    }
    let (mut cluster, _data, mut server) = cluster();
    cluster.worker_prefetch_bytes = Some(1);
    let mut rust: Vec<Proc> = (0..2)
        .map(|i| cluster.trainer_worker(&format!("rust{i}"), ""))
        .collect();
    let (slow_peer, mut slow) = cluster.peer_id_after("slow", |cluster| {
        cluster.python_worker("slow", "train", "diloco", "tests/slow_trainer.py", &[])
    });
    let job = cluster.diloco_job("slow", 3, 2, "rounds = 3\n");
    let (mut scheduler, events_path) = cluster.scheduler("scheduler", &job);
    let (ok, lines) = scheduler.wait(Duration::from_secs(120));
    let mut procs: Vec<&mut Proc> = rust.iter_mut().collect();
    procs.push(&mut slow);
    procs.push(&mut server);
    assert_succeeded(&cluster, ok, &lines, &mut procs);

    let metrics = lines_of(&cluster.path("slow-job.metrics.jsonl"));
    let rounds: Vec<_> = metrics.iter().filter(|m| m["kind"] == "round").collect();
    assert_eq!(rounds.len(), 3, "{rounds:?}");
    let first = rounds.iter().find(|r| r["round"] == 0).unwrap();
    assert!(
        first["included"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p == slow_peer.as_str()),
        "the slow trainer {slow_peer} is not in the first round: {first}"
    );
    let events = events(&events_path);
    // Told each time more trainers are ready, the slow one last.
    let waiting = of_kind(&events, "waiting_for_trainers");
    let ready: Vec<_> = waiting.iter().map(|w| &w["event"]["ready"]).collect();
    assert!(ready == [1, 2] || ready == [2], "{waiting:?}");
    assert!(waiting.iter().all(|w| w["event"]["trainers"] == 3));
    let begin = of_kind(&events, "rounds_begin");
    assert_eq!(begin.len(), 1, "{begin:?}");
    assert_eq!(begin[0]["event"]["trainers"], 3, "{begin:?}");
    assert!(begin[0]["event"].get("late").is_none(), "{begin:?}");
    assert!(
        begin[0]["event"]["waited_s"].as_f64().unwrap() > 5.0,
        "the first round waited for the slow trainer: {begin:?}"
    );
    let joined = of_kind(&events, "joined");
    assert_eq!(joined.len(), 3, "{joined:?}");
    assert!(
        joined.iter().all(|j| j["event"]["round"] == 0),
        "{joined:?}"
    );
    assert!(
        joined
            .iter()
            .any(|j| j["event"]["peer"] == slow_peer.as_str())
    );
    let (used, _) = audit(&cluster.path("slow-job.ledger"));
    assert!(
        !used.is_empty() && used.values().all(|n| *n == 1),
        "{used:?}"
    );

    for trainer in rust.iter_mut().chain([&mut slow]) {
        trainer.kill();
        no_errors(&trainer.name.clone(), &trainer.seen);
    }
}

/// The PyTorch example trainer (`python/examples/torch_trainer.py`) trains a job (CI installs
/// torch; elsewhere the test says it skipped without it). It trains alone: importing
/// torch takes seconds, longer than a reference trainer needs for this whole job.
#[test]
fn a_torch_trainer_trains_a_job() {
    if python_with(&["numpy", "torch"], true) {
        train_with_python_trainer("examples/torch_trainer.py", 0, "");
    }
}

/// The byte-level transformer of the language-model tests: 1.4 M parameters, sequences of
/// the 64 tokens `prepare_prose` cuts.
const TEXT_MODEL: &str =
    r#"{ type = "transformer", vocab = 258, context = 63, dim = 192, heads = 4, layers = 3 }"#;

fn text_model() -> ModelSpec {
    let table: toml::Table = toml::from_str(&format!("model = {TEXT_MODEL}")).unwrap();
    table["model"].clone().try_into().unwrap()
}

/// `documents` documents of short English sentences drawn from `seed`: learnable by a small
/// byte-level model within a test.
fn prose(seed: u64, documents: usize) -> Vec<String> {
    const SUBJECTS: [&str; 6] = [
        "The cat",
        "A dog",
        "The old man",
        "My sister",
        "The bird",
        "A child",
    ];
    const VERBS: [&str; 6] = ["sees", "likes", "follows", "draws", "finds", "calls"];
    const OBJECTS: [&str; 6] = [
        "the river",
        "a red ball",
        "the tall tree",
        "her friend",
        "the moon",
        "a small house",
    ];
    let mut state = seed;
    let mut pick = |words: &[&'static str; 6]| {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        words[(state >> 33) as usize % words.len()]
    };
    (0..documents)
        .map(|_| {
            (0..3)
                .map(|_| {
                    let subject = pick(&SUBJECTS);
                    let verb = pick(&VERBS);
                    format!("{subject} {verb} {}.", pick(&OBJECTS))
                })
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect()
}

/// Writes `documents` as text files under `text/{name}` and prepares them into `output` with
/// `hypha-data prepare`, as a user would: byte-level tokens in sequences of 64, 16 a slice.
fn prepare_prose(cluster: &Cluster, name: &str, documents: &[String], output: &Path, plain: bool) {
    let text = cluster.path(&format!("text/{name}"));
    std::fs::create_dir_all(&text).unwrap();
    for (i, document) in documents.iter().enumerate() {
        std::fs::write(text.join(format!("{i:04}.txt")), document).unwrap();
    }
    let mut prepare = std::process::Command::new(bin("hypha-data"));
    prepare.arg("prepare").arg(&text).arg("-o").arg(output);
    prepare.args(["--sequence-length", "64", "--slice-size", "16"]);
    if plain {
        prepare.arg("--plain");
    }
    let out = prepare.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The PyTorch transformer (`python/examples/torch_lm_trainer.py`) has the reference
/// executor's parameter names and shapes and computes its loss: the same weights score a
/// batch of `hypha-data prepare`'s text, padding included, alike in both (to float rounding).
#[test]
fn the_pytorch_transformer_scores_a_batch_as_the_reference_executor_does() {
    if !python_with(&["numpy", "torch"], true) {
        return;
    }
    let cluster = Cluster::new();
    let dataset = cluster.path("prose");
    prepare_prose(&cluster, "prose", &prose(5, 12), &dataset, true);
    // The last slice ends in padding: the mask is part of what is compared.
    let last = std::fs::read_dir(&dataset)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .max()
        .unwrap();
    let spec = text_model();
    let model = Model::new(&spec, 5).unwrap();
    // Weights 3× their initial scale: activations large enough that a different GELU, norm or
    // attention scaling would show in the loss (at the initial scale they barely do).
    let mut tensors = model.tensors().unwrap();
    for tensor in tensors.0.values_mut() {
        tensor.values.iter_mut().for_each(|v| *v *= 3.0);
    }
    model.load(&tensors).unwrap();
    let weights = cluster.path("weights.safetensors");
    std::fs::write(&weights, model.to_bytes(&Default::default()).unwrap()).unwrap();
    let batch = hypha_executor::model::Batch::read(
        &std::fs::read(&last).unwrap(),
        &spec,
        &Default::default(),
    )
    .unwrap();
    let (rust_loss, _, counted) = model.evaluate_counted(&batch).unwrap();
    let tokens = batch.rows() * 63;
    assert!(
        (counted as usize) < tokens,
        "the slice has no padding: {counted} of {tokens} tokens are real"
    );

    let script = format!(
        r#"
import sys
sys.path.insert(0, {examples:?})
import torch
from hypha_sdk import safetensors
from torch_lm_trainer import LanguageModel
model = LanguageModel({{"model": {model}}}, "cpu", False)
weights, _ = safetensors.loads(open({weights:?}, "rb").read())
model.load({{name: t.to_numpy() for name, t in weights.items()}})
batch, _ = safetensors.loads(open({slice:?}, "rb").read())
with torch.no_grad():
    print(float(model.loss({{name: t.to_numpy() for name, t in batch.items()}})))
"#,
        examples = python_dir().join("examples").display().to_string(),
        model = serde_json::to_string(&spec).unwrap(),
        weights = weights.display().to_string(),
        slice = last.display().to_string(),
    );
    let out = std::process::Command::new("python3")
        .args(["-c", &script])
        .env("PYTHONPATH", python_dir())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let torch_loss: f64 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    assert!(
        (torch_loss - rust_loss).abs() < 1e-5 * rust_loss.max(1.0),
        "the same weights score the batch {rust_loss} in Rust and {torch_loss} in PyTorch"
    );
}

/// A job of the byte-level transformer on text that `hypha-data prepare` made of a folder of
/// text files, trained by a reference (Rust, candle) trainer and the PyTorch trainer together:
/// it succeeds, every slice is trained once, both kinds of trainers are in its rounds and
/// report the very global models the server made (fingerprints), and the model learns (scored
/// on held-out text). Skipped with a message where torch is not installed (CI installs it).
#[test]
fn rust_and_pytorch_trainers_train_the_transformer_together_on_the_same_global_models() {
    if !python_with(&["numpy", "torch", "blake3"], true) {
        return;
    }
    let mut cluster = Cluster::new();
    prepare_prose(
        &cluster,
        "prose",
        &prose(1, 200),
        &cluster.path("data/prose"),
        false,
    );
    let held_out = cluster.path("held-out");
    prepare_prose(&cluster, "held-out", &prose(2, 20), &held_out, false);
    let _data = data_node(&cluster, "data", &cluster.path("data"));
    let mut server = cluster.server_worker("ps");
    // A few slices of 16 sequences: without a small prefetch budget the Rust trainer's worker
    // would take them all before the PyTorch trainer, seconds slower to start, asks.
    cluster.worker_prefetch_bytes = Some(1);
    let mut rust = cluster.trainer_worker("rust", "");
    let (python_peer, mut python) = cluster.peer_id_after("python", |cluster| {
        cluster.python_worker(
            "python",
            "train",
            "diloco",
            "examples/torch_lm_trainer.py",
            &[("OMP_NUM_THREADS", "1".into())],
        )
    });
    let job = cluster.job(
        "text",
        &format!(
            "workers = 2\nbid = 50\nmax_attempts = 3\n\
             [executor]\nclass = \"train\"\nname = \"diloco\"\n\
             [resources]\ncpu = 1\n\
             [config]\nseed = 1\nmodel = {TEXT_MODEL}\n\
             [data]\ndataset = \"prose\"\nepochs = 1\nseed = 3\n\
             [diloco]\nsamples_per_round = 48\nbatch_size = 8\nround_seconds = 60\n\
             inner = {{ learning_rate = 0.003, weight_decay = 0.01, beta1 = 0.9, beta2 = 0.999 }}\n\
             [diloco.parameter_server]\nbid = 20\nexecutor = {{ class = \"aggregate\", name = \"parameter-server\" }}\n"
        ),
    );
    let (mut scheduler, _events) = cluster.scheduler("scheduler", &job);
    let (ok, lines) = scheduler.wait(Duration::from_secs(300));
    let mut procs: Vec<&mut Proc> = vec![&mut rust, &mut python, &mut server];
    assert_succeeded(&cluster, ok, &lines, &mut procs);

    let metrics = lines_of(&cluster.path("text-job.metrics.jsonl"));
    let (with_python, rounds) = rounds_including(&metrics, &python_peer);
    assert!(
        with_python >= 2,
        "the PyTorch trainer is in {with_python} of {rounds} rounds"
    );
    let ps_dir = job_dir(&cluster.path("ps-work"));
    let checked = trainers_held_the_rounds_models(&metrics, &ps_dir);
    for worker in ["rust", "python"] {
        assert!(
            checked
                .get(&job_id_of(&cluster, worker))
                .is_some_and(|n| *n >= 2),
            "the {worker} trainer's reports of the global model it held, checked: {checked:?}"
        );
    }
    let slices = std::fs::read_dir(cluster.path("data/prose"))
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .path()
                .extension()
                .is_some_and(|x| x == "safetensors")
        })
        .count();
    assert_audit_passes(&cluster.path("text-job.ledger"), 1, slices as u64);

    let spec = text_model();
    let score = |model: &Model| {
        hypha_executor::local::evaluate_dataset(model, &held_out, &Default::default(), None)
            .unwrap()
            .loss
    };
    let before = score(&Model::new(&spec, 1).unwrap());
    let trained = Model::new(&spec, 1).unwrap();
    trained
        .load(&hypha_diloco::Tensors::load(&ps_dir.join("final.safetensors")).unwrap())
        .unwrap();
    let after = score(&trained);
    assert!(after < 0.7 * before, "held-out loss {before} → {after}");
    let said = std::fs::read_to_string(job_dir(&cluster.path("python-work")).join("stderr.log"))
        .unwrap_or_default();
    assert!(said.contains("tokens/s"), "{said}");

    for trainer in [&mut rust, &mut python] {
        trainer.kill();
        no_errors(&trainer.name.clone(), &trainer.seen);
    }
}

/// `hypha-executor train --synthetic-updates` (the trainers of `hypha-bench scale`) in a job of
/// `int8` changes: they read their slices as trainers do and send drawn pseudo-gradients,
/// which the server takes; they apply its changes to the model they keep in a file, a chunk
/// at a time, and report the fingerprint of the server's model in the rounds they train. Every
/// slice is used once.
#[test]
fn synthetic_trainers_apply_the_servers_changes_to_the_model_they_keep_on_disk() {
    let (cluster, _data, mut server) = cluster();
    let mut trainers: Vec<Proc> = (0..2)
        .map(|i| {
            cluster.trainer_worker_with_args(&format!("synthetic{i}"), &["--synthetic-updates"], "")
        })
        .collect();
    let job = cluster.diloco_job("synthetic", 2, 2, "compression = \"int8\"\n");
    let (mut scheduler, _events) = cluster.scheduler("scheduler", &job);
    let (ok, lines) = scheduler.wait(Duration::from_secs(120));
    let mut procs: Vec<&mut Proc> = trainers.iter_mut().collect();
    procs.push(&mut server);
    assert_succeeded(&cluster, ok, &lines, &mut procs);

    let metrics = lines_of(&cluster.path("synthetic-job.metrics.jsonl"));
    let ps_dir = job_dir(&cluster.path("ps-work"));
    let checked = trainers_held_the_rounds_models(&metrics, &ps_dir);
    for i in 0..2 {
        let job = job_id_of(&cluster, &format!("synthetic{i}"));
        assert!(
            checked.get(&job).is_some_and(|n| *n >= 2),
            "synthetic{i}'s reports of the global model it held, checked: {checked:?}"
        );
    }
    let logs: String = (0..2)
        .map(|i| {
            let dir = job_dir(&cluster.path(&format!("synthetic{i}-work")));
            std::fs::read_to_string(dir.join("stderr.log")).unwrap_or_default()
        })
        .collect();
    assert!(logs.contains("(as a change)"), "{logs}");
    assert!(!logs.contains("does not match"), "{logs}");
    // Nothing was learned: no trainer reports a loss.
    assert!(
        metrics
            .iter()
            .filter(|m| m["kind"] == "trainer")
            .all(|m| m["loss"].is_null()),
        "a synthetic trainer reported a loss"
    );
    assert_audit_passes(&cluster.path("synthetic-job.ledger"), 2, SLICES);

    for (i, trainer) in trainers.iter_mut().enumerate() {
        trainer.kill();
        no_errors(&format!("synthetic{i}"), &trainer.seen);
    }
}

/// Issue 58, item 3: a trainer that sends 40 statuses of 64 KiB before each of its reports
/// (its own with a fingerprint that long, and other JSON) fills neither the metrics file
/// nor the events file: a status that does not read is refused unwritten, and a job's
/// statuses are written twenty a second at most, each other one of more than
/// 4 KiB as its size. The run trains with its honest trainers. (Checked by writing every
/// status as it came: the metrics file grew past 10 MB.)
#[test]
fn a_trainer_that_floods_its_scheduler_with_statuses_fills_no_disk() {
    if !python_with(&["numpy"], true) {
        return;
    }
    let Beside {
        cluster,
        events: events_path,
        ..
    } = run_beside_a_python_trainer("flood", 2, "tests/flooding_trainer.py", &[], fixed_rounds());
    let metrics_path = cluster.path("flood-job.metrics.jsonl");
    let metrics = lines_of(&metrics_path);
    let rounds = metrics.iter().filter(|m| m["kind"] == "round").count();
    assert_eq!(rounds, ROUNDS, "the run trained every round");
    let flooded = metrics
        .iter()
        .filter(|m| m["model_hash"].as_str().is_some_and(|h| h.len() > 128))
        .count();
    assert_eq!(flooded, 0, "a fingerprint of 64 KiB was written");
    let size = |path: &std::path::Path| std::fs::metadata(path).unwrap().len();
    assert!(
        size(&metrics_path) < 1 << 20,
        "metrics: {} bytes",
        size(&metrics_path)
    );
    assert!(
        size(&events_path) < 1 << 20,
        "events: {} bytes",
        size(&events_path)
    );
}

/// A trainer of the run that lies (`python/tests/lying_trainer.py`: the numpy trainer, its
/// every pseudo-gradient claiming a trillion samples) beside two honest reference trainers.
/// The parameter server refuses its updates and the rounds go on without waiting for it: the
/// two honest updates make the quorum, so each round closes when they are in, not at its
/// deadline (120 s here: rounds that waited for it would outlast the test). After its
/// third refused round it is benched (`bench_after_refusals`, default 3): its job ends, it is
/// never leased again, and the last round is the honest trainers' alone. Its slices go back
/// to the ledger, none is used twice, the scheduler's log names the liar and why, and the
/// model learns from the honest trainers. (Checked with benching off: the liar trains and is
/// refused in every round.)
#[test]
fn a_trainer_whose_updates_are_refused_holds_up_no_round() {
    if !python_with(&["numpy"], true) {
        return;
    }
    let Beside {
        cluster,
        peer: liar_peer,
        events: events_path,
        lines,
        mut honest,
        ..
    } = run_beside_a_python_trainer("lies", 2, "tests/lying_trainer.py", &[], fixed_rounds());

    assert_eq!(of_kind(&events(&events_path), "round").len(), ROUNDS);
    let metrics = lines_of(&cluster.path("lies-job.metrics.jsonl"));
    for round in metrics.iter().filter(|m| m["kind"] == "round") {
        let included = round["included"].as_array().unwrap();
        assert!(!included.is_empty(), "{round}");
        assert!(
            !included.iter().any(|p| p == liar_peer.as_str()),
            "the liar's update is in {round}"
        );
    }
    let refusals: Vec<&String> = lines
        .iter()
        .filter(|l| l.contains("refused a trainer's update") && l.contains(liar_peer.as_str()))
        .collect();
    assert!(
        refusals.iter().any(|l| l.contains("1000000000000")),
        "the scheduler's log names the liar and its claim: {refusals:#?}"
    );
    let events = events(&events_path);
    let benched = of_kind(&events, "benched");
    assert_eq!(benched.len(), 1, "{benched:?}");
    assert_eq!(benched[0]["event"]["peer"], liar_peer.as_str());
    // Its first round may pass before Python is up: benched as its third refused round ends.
    // (It may still say it holds the next round's model, untrained, before its job is gone.)
    let benched_in = benched[0]["event"]["round"].as_u64().unwrap();
    assert!(
        (2..ROUNDS as u64 - 1).contains(&benched_in),
        "benched in round {benched_in}"
    );
    let liar_job = benched[0]["event"]["job"].as_str().unwrap();
    let refused_rounds: HashSet<u64> = lines
        .iter()
        .filter(|l| l.contains("refused a trainer's update") && l.contains(liar_peer.as_str()))
        .filter_map(|l| l.split("round=").nth(1)?.split(' ').next()?.parse().ok())
        .collect();
    assert_eq!(
        refused_rounds,
        (benched_in - 2..=benched_in).collect(),
        "benched after three refused rounds in a row"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.contains("trainer benched") && l.contains(liar_peer.as_str())),
        "the scheduler's log names the benched trainer"
    );
    let leased_liar = of_kind(&events, "leased")
        .into_iter()
        .filter(|e| e["event"]["peer"] == liar_peer.as_str())
        .count();
    assert_eq!(leased_liar, 1, "the benched trainer was leased again");
    let after: Vec<&serde_json::Value> = metrics
        .iter()
        .filter(|m| m["kind"] == "trainer" && m["job"] == liar_job)
        .filter(|m| m["round"].as_u64().is_some_and(|r| r > benched_in))
        .filter(|m| m["batches"].as_u64() != Some(0))
        .collect();
    assert!(
        after.is_empty(),
        "the benched trainer trained on: {after:?}"
    );
    let (used, returned) = audit(&cluster.path("lies-job.ledger"));
    assert!(
        used.values().all(|times| *times == 1),
        "a slice used twice: {used:?}"
    );
    assert!(
        returned.contains(&ReturnReason::Dropped),
        "the liar's slices went back: {returned:?}"
    );
    learned_and_logged_no_errors(&cluster, &mut honest, 0.8);
}

/// Issue 55: a run whose every trainer is benched (here its only one, the lying Python
/// trainer) ends at once, failed, saying so and why, instead of waiting for ever with nothing
/// left to train.
#[test]
fn a_run_whose_every_trainer_is_benched_ends_and_says_why() {
    if !python_with(&["numpy"], true) {
        return;
    }
    let (mut cluster, _data, mut server) = cluster();
    cluster.worker_prefetch_bytes = Some(1);
    let mut liar = cluster.python_worker("liar", "train", "diloco", "tests/lying_trainer.py", &[]);
    let job = cluster.diloco_job("alone", 1, 6, "rounds = 20\n");
    let (mut scheduler, events_path) = cluster.scheduler("scheduler", &job);
    let (ok, lines) = scheduler.wait(Duration::from_secs(180));
    assert!(!ok, "the run succeeded: {lines:#?}");
    assert!(
        lines
            .iter()
            .any(|l| l.contains("every trainer of the run was benched") && l.contains("refused")),
        "{lines:#?}"
    );
    let events = events(&events_path);
    assert_eq!(of_kind(&events, "benched").len(), 1);
    let done = of_kind(&events, "done");
    assert_eq!(done[0]["event"]["ok"], false);
    liar.kill();
    server.kill();
}

/// Issue 55: a trainer of the run that scales its every update up a hundredfold
/// (`python/tests/scaling_trainer.py`, the numpy trainer) beside three honest reference
/// trainers. Once the run knows a typical norm the parameter server does not refuse it: it
/// clips it at each close to `max_update_norm_ratio` times the round's reference (the
/// reference itself in a round of fewer than three updates), so it is in the rounds, counted
/// for a share of itself, never benched, and the model learns. Every clip is an event naming
/// it, and the job's last words say every trainer stayed. (Before rounds of one or two
/// updates were held to the reference itself, one run in three ended with the evaluation
/// loss risen, 1.37 → 2.55.) Three honest trainers, not two: clipped to three times the
/// reference, a liar in the same direction as the honest ones still steps like an honest
/// trainer two or three times its size, as the ratio allows; beside two honest ones that made
/// the round's step about 1.8 times theirs, and with the outer Nesterov momentum one run in
/// forty of these six rounds overshot (evaluation loss 1.37 → 1.81, session 51).
#[test]
fn a_trainer_that_scales_its_updates_up_is_clipped_and_the_run_keeps_its_trainers() {
    if !python_with(&["numpy"], true) {
        return;
    }
    let Beside {
        cluster,
        peer: scaler_peer,
        events: events_path,
        mut honest,
        ..
    } = run_beside_a_python_trainer("scaled", 3, "tests/scaling_trainer.py", &[], fixed_rounds());

    let events = events(&events_path);
    assert!(
        of_kind(&events, "benched").is_empty(),
        "a trainer was benched"
    );
    // Before the run has a typical norm (its first rounds), a hundredfold update can be more
    // than ten times the model's norm: refused as absurd, in those rounds only.
    let refused = of_kind(&events, "refused");
    assert!(refused.len() <= 2, "{refused:?}");
    for event in &refused {
        assert_eq!(event["event"]["peer"], scaler_peer.as_str(), "{event}");
        assert!(event["event"]["round"].as_u64().unwrap() < 2, "{event}");
    }
    // With four updates a round, the centre may also hold an honest one back (reported as
    // clipped); the scaler's is clipped in every round it is in.
    let clipped: Vec<&serde_json::Value> = of_kind(&events, "clipped")
        .into_iter()
        .filter(|e| e["event"]["peer"] == scaler_peer.as_str())
        .collect();
    assert!(!clipped.is_empty(), "the scaled updates were taken whole");
    // It moved the model no further than `max_update_norm_ratio` times the round's reference
    // norm. (Not a share of itself below a tenth: with a slower pace than the others its
    // unscaled update is smaller than theirs, and a share of 0.11 of a ×100 update measured
    // 26.7 times the reference was exactly three times it.)
    for event in &clipped {
        let share = event["event"]["share"].as_f64().unwrap();
        let ratio = event["event"]["ratio"].as_f64().unwrap();
        assert!(
            share * ratio <= hypha_scheduler::spec::DEFAULT_NORM_RATIO * 1.0001,
            "a hundredfold update, {ratio} times the reference, counted for {share} of itself"
        );
    }
    let metrics = lines_of(&cluster.path("scaled-job.metrics.jsonl"));
    let rounds: Vec<&serde_json::Value> = metrics.iter().filter(|m| m["kind"] == "round").collect();
    assert_eq!(rounds.len(), ROUNDS);
    let with_scaler = rounds
        .iter()
        .filter(|r| {
            r["included"]
                .as_array()
                .is_some_and(|peers| peers.iter().any(|p| p == scaler_peer.as_str()))
        })
        .count();
    assert!(with_scaler >= 2, "the scaler was in {with_scaler} rounds");
    assert_eq!(
        clipped.len(),
        with_scaler,
        "every round it was in clipped it"
    );
    let done = of_kind(&events, "done");
    let words = done[0]["event"]["message"].as_str().unwrap();
    assert!(words.contains("every trainer stayed to the end"), "{words}");
    learned_and_logged_no_errors(&cluster, &mut honest, 1.0);
}

/// Issue 55: a trainer of four that flips the sign of its every update (the numpy example's,
/// negated) sends updates of an honest norm, so no norm limit holds it; but they point against
/// the others', round after round, and the parameter server counts it for next to nothing and
/// says why. It is never benched, and the model learns from the honest three. (Checked by
/// trusting every trainer whole: its flipped update of round 1 counted whole.)
#[test]
fn a_trainer_that_flips_its_updates_counts_for_nothing_and_the_run_keeps_it() {
    if !python_with(&["numpy"], true) {
        return;
    }
    let env = [("HYPHA_TEST_UPDATE_FACTOR", "-1".to_string())];
    let Beside {
        cluster,
        peer: flipper,
        events: events_path,
        mut honest,
        ..
    } = run_beside_a_python_trainer(
        "flipped",
        3,
        "tests/scaling_trainer.py",
        &env,
        fixed_rounds(),
    );

    let events = events(&events_path);
    assert!(
        of_kind(&events, "benched").is_empty(),
        "a trainer was benched"
    );
    assert!(
        of_kind(&events, "refused").is_empty(),
        "an update was refused"
    );
    let metrics = lines_of(&cluster.path("flipped-job.metrics.jsonl"));
    let rounds_in: Vec<u64> = metrics
        .iter()
        .filter(|m| m["kind"] == "round")
        .filter(|r| {
            r["included"]
                .as_array()
                .is_some_and(|peers| peers.iter().any(|p| p == flipper.as_str()))
        })
        .filter_map(|r| r["round"].as_u64())
        .collect();
    assert!(
        rounds_in.len() >= 2,
        "the flipper was in rounds {rounds_in:?}"
    );
    let clipped: HashMap<u64, &serde_json::Value> = of_kind(&events, "clipped")
        .into_iter()
        .filter(|e| e["event"]["peer"] == flipper.as_str())
        .filter_map(|e| Some((e["event"]["round"].as_u64()?, e)))
        .collect();
    // The first round it is in, nothing is known of it yet (and the run's first updates may
    // disagree among themselves): from then on it counts for next to nothing.
    for round in &rounds_in[1..] {
        let event = clipped.get(round).unwrap_or_else(|| {
            let record = metrics
                .iter()
                .find(|r| r["kind"] == "round" && r["round"] == *round);
            panic!("the flipped update of round {round} counted whole: {record:?}")
        });
        let share = event["event"]["share"].as_f64().unwrap();
        assert!(
            share < 0.1,
            "round {round}: it counted for {share} of itself"
        );
        let reason = event["event"]["reason"].as_str().unwrap();
        assert!(reason.contains("point away from the others"), "{reason}");
    }
    let done = of_kind(&events, "done");
    let words = done[0]["event"]["message"].as_str().unwrap();
    assert!(words.contains("every trainer stayed to the end"), "{words}");
    learned_and_logged_no_errors(&cluster, &mut honest, 0.5);
}

/// Checks that the final model of a run beside a Python trainer scores below `factor` of the
/// initial model's evaluation loss, and that its `honest` trainers logged no errors.
fn learned_and_logged_no_errors(cluster: &Cluster, honest: &mut [Proc], factor: f64) {
    let before = evaluation_loss(None);
    let after = evaluation_loss(Some(
        job_dir(&cluster.path("ps-work")).join("final.safetensors"),
    ));
    assert!(
        after < factor * before,
        "evaluation loss {before} → {after}"
    );
    for trainer in honest {
        trainer.kill();
        no_errors(&trainer.name.clone(), &trainer.seen);
    }
}

/// The rounds of a run beside a Python trainer ([`run_beside_a_python_trainer`]).
const ROUNDS: usize = 6;

/// What a run beside a Python trainer left.
struct Beside {
    cluster: Cluster,
    /// The Python trainer's peer ID.
    peer: String,
    /// The scheduler's events file, and its log.
    events: PathBuf,
    lines: Vec<String>,
    /// The reference trainers' workers, still running.
    honest: Vec<Proc>,
    /// The Python trainer's worker, still running.
    python: Proc,
}

/// The epochs and `[diloco]` keys of a run of [`ROUNDS`] rounds (120 s each at most) whose
/// data outlasts them, so that it ends after its rounds.
fn fixed_rounds() -> (u32, String) {
    (6, format!("rounds = {ROUNDS}\nround_seconds = 120\n"))
}

/// Runs job `name` of `epochs` and `diloco` keys by `honest` reference trainers and one Python
/// trainer, `script` with `env`, and checks that it succeeded. Each worker prefetches one byte
/// ahead: the dataset is tiny (24 slices of 4 KiB), and the Python trainer, a second slower to
/// start, would otherwise find every slice prefetched (a real dataset's thousands of slices of
/// megabytes leave the default budget a few ahead of each).
fn run_beside_a_python_trainer(
    name: &str,
    honest: usize,
    script: &str,
    env: &[(&str, String)],
    (epochs, diloco): (u32, String),
) -> Beside {
    let (mut cluster, _data, mut server) = cluster();
    cluster.worker_prefetch_bytes = Some(1);
    let mut rust: Vec<Proc> = (0..honest)
        .map(|i| cluster.trainer_worker(&format!("honest{i}"), ""))
        .collect();
    let (peer, mut python) = cluster.peer_id_after("python", |cluster| {
        cluster.python_worker("python", "train", "diloco", script, env)
    });
    let job = cluster.diloco_job(name, honest + 1, epochs, &diloco);
    let (mut scheduler, events) = cluster.scheduler("scheduler", &job);
    let (ok, lines) = scheduler.wait(Duration::from_secs(180));
    let mut procs: Vec<&mut Proc> = rust.iter_mut().collect();
    procs.push(&mut python);
    procs.push(&mut server);
    assert_succeeded(&cluster, ok, &lines, &mut procs);
    Beside {
        cluster,
        peer,
        events,
        lines,
        honest: rust,
        python,
    }
}

/// Runs a DiLoCo job of `rust_trainers` reference trainers and one trainer that is the Python
/// `script`, with `extra` in its `[diloco]` table, and checks what a user would: it succeeded,
/// exactly once, the Python trainer reported and was in at least two rounds (with a codec, its
/// updates sent with it), the model learned.
fn train_with_python_trainer(script: &str, rust_trainers: usize, extra: &str) {
    const EPOCHS: u32 = 2;
    let Beside {
        cluster,
        peer: python_peer,
        events: events_path,
        honest: mut rust,
        mut python,
        ..
    } = run_beside_a_python_trainer("mixed", rust_trainers, script, &[], (EPOCHS, extra.into()));

    // The Python trainer reported, and its pseudo-gradients went into rounds.
    let python_dir = job_dir(&cluster.path("python-work"));
    let python_job = job_id_of(&cluster, "python");
    let metrics = lines_of(&cluster.path("mixed-job.metrics.jsonl"));
    assert_norms_well_within_the_default(
        &metrics
            .iter()
            .filter(|m| m["kind"] == "round")
            .collect::<Vec<_>>(),
    );
    let trainers: HashSet<&str> = metrics.iter().filter_map(|m| m["job"].as_str()).collect();
    assert!(
        metrics.iter().any(|m| m["kind"] == "trainer"
            && m["job"] == python_job.as_str()
            && m["loss"].is_f64()),
        "no loss from the Python trainer {python_job} (trainers: {trainers:?}); its reports: {:?}; it said:\n{}",
        metrics
            .iter()
            .filter(|m| m["job"] == python_job.as_str())
            .map(|m| m.to_string())
            .collect::<Vec<_>>(),
        std::fs::read_to_string(python_dir.join("stderr.log")).unwrap_or_default()
    );
    let (with_python, rounds) = rounds_including(&metrics, &python_peer);
    assert!(
        with_python >= 2,
        "the Python trainer is in {with_python} of {rounds} rounds"
    );
    // The Python trainer checks every model against the server's fingerprint, as the Rust
    // ones do: it agrees with the server's, on every model.
    let said = std::fs::read_to_string(python_dir.join("stderr.log")).unwrap_or_default();
    assert!(
        !said.contains("does not match the fingerprint"),
        "the Python trainer's fingerprint disagrees with the server's:\n{said}"
    );
    if extra.contains("\"sparse\"") {
        assert!(
            said.contains("sent sparse"),
            "the Python trainer sent no sparse update:\n{said}"
        );
        assert!(
            said.contains("change of the global model received") && !said.contains("is refused"),
            "the Python trainer did not take the server's sparse changes:\n{said}"
        );
    }
    assert_eq!(of_kind(&events(&events_path), "round").len(), rounds);

    // Each slice trained once per epoch; the model learned.
    assert_audit_passes(&cluster.path("mixed-job.ledger"), EPOCHS, SLICES);
    let ps_dir = job_dir(&cluster.path("ps-work"));
    let before = evaluation_loss(None);
    let after = evaluation_loss(Some(ps_dir.join("final.safetensors")));
    assert!(after < 0.5 * before, "evaluation loss {before} → {after}");

    for trainer in rust.iter_mut().chain([&mut python]) {
        trainer.kill();
        no_errors(&trainer.name.clone(), &trainer.seen);
    }
}

/// Trainers get a model of over 16 MiB published, not sent to each:
/// the server's worker sends it about once, the trainers' workers pass it on to each other,
/// and the run trains as ever. (Checked by sending it whole: each trainer's worker logs no
/// fetch, and the assertion on the fetches fails.)
#[test]
fn trainers_starting_together_fetch_a_large_model_that_leaves_the_server_about_once() {
    // The reference MLP has two hidden layers: about HIDDEN² parameters, 16.2 MiB here.
    const HIDDEN: usize = 2_048;
    let (cluster, _data, mut server) = cluster();
    let mut trainers: Vec<Proc> = (0..4)
        .map(|i| cluster.trainer_worker(&format!("trainer{i}"), ""))
        .collect();
    let job = cluster.job(
        "large",
        &diloco_job_text(4, 2, HIDDEN, "round_seconds = 10\n"),
    );
    let (mut scheduler, _events) = cluster.scheduler("scheduler", &job);
    let (ok, lines) = scheduler.wait(Duration::from_secs(240));
    let mut procs: Vec<&mut Proc> = trainers.iter_mut().collect();
    procs.push(&mut server);
    assert_succeeded(&cluster, ok, &lines, &mut procs);

    // What each trainer's worker fetched: (file, size, from the publisher, from peers).
    let field = |line: &str, key: &str| -> String {
        line.split_whitespace()
            .find_map(|part| part.strip_prefix(&format!("{key}=")))
            .map(|v| v.trim_matches('"').to_string())
            .unwrap_or_else(|| panic!("no {key} in {line}"))
    };
    let number = |line: &str, key: &str| -> u64 { field(line, key).parse().unwrap() };
    let mut fetches: HashMap<String, Vec<(u64, u64, u64)>> = HashMap::new();
    for trainer in &mut trainers {
        while let Ok(line) = trainer.lines.try_recv() {
            trainer.seen.push(line);
        }
        for line in &trainer.seen {
            if line.contains("fetched a file its sender published") {
                fetches.entry(field(line, "name")).or_default().push((
                    number(line, "size"),
                    number(line, "from_publisher"),
                    number(line, "from_peers"),
                ));
            }
        }
    }
    eprintln!("published models fetched (size, from the server, from peers): {fetches:?}");
    // Without compression every round's model goes whole to every trainer, together (the
    // first, round 0, goes to each as its offer came, so not necessarily together).
    let together: Vec<_> = fetches
        .iter()
        .filter(|(name, f)| name.as_str() != "round-0.safetensors" && f.len() >= 3)
        .collect();
    assert!(
        !together.is_empty(),
        "no model of a later round was fetched by three trainers or more: {fetches:?}"
    );
    for (name, fetched) in together {
        let size = fetched[0].0;
        assert!(
            size > 4 * (HIDDEN * HIDDEN) as u64,
            "{name} is {size} bytes"
        );
        let from_server: u64 = fetched.iter().map(|f| f.1).sum();
        let from_peers: u64 = fetched.iter().map(|f| f.2).sum();
        let receivers = fetched.len() as u64;
        assert_eq!(from_server + from_peers, size * receivers);
        // Sending it to each would be `receivers` times the model.
        assert!(
            2 * from_server <= (receivers + 1) * size,
            "{name}: the server sent {from_server} bytes of a {size}-byte model to {receivers} trainers: {fetched:?}"
        );
    }
}
