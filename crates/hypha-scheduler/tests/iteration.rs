//! Exactly-once iteration with real processes: data nodes, workers whose executors take
//! slices through the job bridge, and a scheduler whose ledger hands them out, under failures.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

mod common;

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use common::*;
use hypha_dataset::slice::{self, Dtype, Encoding, Tensors};
use hypha_ledger::ReturnReason;
use hypha_telemetry::testing::{Collector, Point};

/// Writes Snappy slices `slices` of a dataset into `dir` (as `slice-{i}.safetensors`);
/// returns each slice's plain form.
fn write_dataset(dir: &Path, slices: std::ops::Range<u64>) -> Vec<Vec<u8>> {
    std::fs::create_dir_all(dir).unwrap();
    slices
        .map(|i| {
            let tensors = Tensors::new()
                .with("x", Dtype::U8, vec![4, 8], vec![i as u8; 32])
                .unwrap()
                .with("id", Dtype::U64, vec![4], i.to_le_bytes().repeat(4))
                .unwrap();
            std::fs::write(
                dir.join(format!("slice-{i}.safetensors")),
                slice::encode(&tensors, Encoding::Snappy).unwrap(),
            )
            .unwrap();
            slice::encode(&tensors, Encoding::Plain).unwrap()
        })
        .collect()
}

/// A job of `workers` workers running [`ITERATE`] over `dataset`.
fn iterate_job(
    cluster: &Cluster,
    name: &str,
    workers: usize,
    dataset: &str,
    epochs: u32,
) -> PathBuf {
    cluster.job(
        name,
        &format!(
            "workers = {workers}\nbid = 50\nmax_attempts = 5\n[executor]\nclass = \"test\"\nname = \"sh\"\n[resources]\ncpu = 1\n[data]\ndataset = \"{dataset}\"\nepochs = {epochs}\nseed = 7\n"
        ),
    )
}

/// Slices the executors of every worker whose work directory is under the cluster noted in
/// their `used.txt` so far.
fn executor_uses(cluster: &Cluster) -> usize {
    let mut count = 0;
    for entry in std::fs::read_dir(cluster.path("")).unwrap() {
        let work = entry.unwrap().path();
        if !work.to_string_lossy().ends_with("-work") {
            continue;
        }
        for job in std::fs::read_dir(&work).into_iter().flatten() {
            let used = job.unwrap().path().join("used.txt");
            count += std::fs::read_to_string(used)
                .unwrap_or_default()
                .lines()
                .count();
        }
    }
    count
}

/// Asserts that the executors of workers `w0..w{workers}` took every slice of every epoch
/// once, each as its plain file.
fn assert_executors_saw_each_once(
    cluster: &Cluster,
    workers: usize,
    plain: &[Vec<u8>],
    epochs: u32,
) {
    let mut seen = HashMap::<(u32, u64), u32>::new();
    for i in 0..workers {
        let dir = job_dir(&cluster.path(&format!("w{i}-work")));
        let used = std::fs::read_to_string(dir.join("used.txt")).unwrap_or_default();
        for line in used.lines() {
            let words: Vec<&str> = line.split_whitespace().collect();
            let (epoch, slice) = (words[0].parse().unwrap(), words[1].parse::<u64>().unwrap());
            *seen.entry((epoch, slice)).or_default() += 1;
            assert_eq!(
                std::fs::read(dir.join(words[2])).unwrap(),
                plain[slice as usize],
                "{line}"
            );
        }
    }
    assert_each_used_once(&seen, epochs, plain.len() as u64);
}

fn wait_for_uses(cluster: &Cluster, count: usize) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while executor_uses(cluster) < count {
        assert!(
            Instant::now() < deadline,
            "the executors never used {count} slices"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// An executor that takes slices through the bridge until the iteration is done, checks each
/// is a plain SafeTensors file, notes it in `used.txt` and reports it consumed into a round
/// that it then completes.
const ITERATE: &str = r#"D="$1"; S="$2"
DATA=$(sed -n 's/.*"data":\({[^}]*}\).*/\1/p' "$D/job.json")
round=0
while :; do
  curl -sf -o "$D/resp.json" --unix-socket "$S" -X POST -H 'content-type: application/json' --data '{"fetch":'"$DATA"',"out_dir":"slices"}' http://bridge/resources/fetch || exit 3
  grep -q '"path"' "$D/resp.json" || break
  E=$(sed -n 's/.*"epoch":\([0-9]*\).*/\1/p' "$D/resp.json")
  N=$(sed -n 's/.*"slice":\([0-9]*\).*/\1/p' "$D/resp.json")
  P=$(sed -n 's/.*"path":"\([^"]*\)".*/\1/p' "$D/resp.json")
  test -s "$D/$P" || exit 4
  echo "$E $N $P" >> "$D/used.txt"
  if grep -q '"provider":"cache"' "$D/resp.json"; then echo "$E $N" >> "$D/cached.txt"; fi
  curl -sf -o /dev/null --unix-socket "$S" -X POST -H 'content-type: application/json' --data '{"slices":[{"epoch":'$E',"slice":'$N'}],"round":'$round',"completed_round":'$round',"data":'"$DATA"'}' http://bridge/data/consumed || exit 5
  round=$((round+1))
done
exit 0"#;

#[test]
fn workers_iterate_the_schedulers_ledger_and_every_slice_is_used_once_per_epoch() {
    const SLICES: u64 = 12;
    let cluster = Cluster::new();
    let plain = write_dataset(&cluster.path("digits"), 0..SLICES);
    let _data_node = data_node(&cluster, "data", &cluster.path("digits"));
    // The workers export their metrics to a collector of the test's.
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let collector = runtime.block_on(Collector::start()).unwrap();
    let telemetry = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", collector.endpoint()),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf".to_string()),
        ("OTEL_METRIC_EXPORT_INTERVAL", "300".to_string()),
    ];
    let _workers: Vec<Proc> = (0..2)
        .map(|i| {
            let name = format!("w{i}");
            cluster.worker_with_env(&name, "price = 10", "cpu = 1", ITERATE, &telemetry)
        })
        .collect();
    let job = iterate_job(&cluster, "iterate", 2, "digits", 2);
    let (mut scheduler, _events) = cluster.scheduler("scheduler", &job);
    let (ok, log) = scheduler.wait(Duration::from_secs(90));
    assert!(ok, "{}", log.join("\n"));
    assert!(
        !log.iter().any(|l| l.contains("ERROR")),
        "{}",
        log.join("\n")
    );

    // What the executors saw: every slice of every epoch once, as the plain file.
    assert_executors_saw_each_once(&cluster, 2, &plain, 2);
    // Epoch 1 found slices in the workers' caches (the ledger prefers what a worker holds);
    // epoch 0 could not.
    let cached: Vec<String> = (0..2)
        .flat_map(|i| {
            let dir = job_dir(&cluster.path(&format!("w{i}-work")));
            std::fs::read_to_string(dir.join("cached.txt"))
                .unwrap_or_default()
                .lines()
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .collect();
    assert!(!cached.is_empty(), "no slice came from a cache");
    assert!(cached.iter().all(|l| l.starts_with("1 ")), "{cached:?}");

    // The data path's metrics reached the collector: slices from the network and from the
    // cache, bytes fetched, the prefetch depth.
    let deadline = Instant::now() + Duration::from_secs(10);
    let wanted = |points: &[Point]| {
        let positive = |metric: &str, source: Option<&str>| {
            points.iter().any(|p| {
                p.metric == metric
                    && p.value > 0.0
                    && source.is_none_or(|s| p.attributes.contains(&("source".into(), s.into())))
            })
        };
        positive("hypha.worker.data.slices", Some("network"))
            && positive("hypha.worker.data.slices", Some("cache"))
            && positive("hypha.worker.data.bytes", None)
            && points
                .iter()
                .any(|p| p.metric == "hypha.worker.data.prefetch_depth")
    };
    while !wanted(&collector.metric_points()) {
        assert!(
            Instant::now() < deadline,
            "{:#?}",
            collector
                .metric_points()
                .iter()
                .filter(|p| p.metric.starts_with("hypha.worker.data"))
                .collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    // What the ledger recorded: the same, each slice USED once.
    assert_audit_passes(&cluster.path("iterate-job.ledger"), 2, SLICES);
}

#[test]
fn a_dataset_sharded_over_data_nodes_is_iterated_whole() {
    // Three data nodes: two shards, and a third holding a replica of the second shard only.
    // Each numbers its slices from 0; the scheduler matches them by file.
    let cluster = Cluster::new();
    let mut plain = write_dataset(&cluster.path("a/shards"), 0..6);
    plain.extend(write_dataset(&cluster.path("b/shards"), 6..14));
    write_dataset(&cluster.path("c/shards"), 6..14);
    let _nodes = [
        data_node(&cluster, "d0", &cluster.path("a/shards")),
        data_node(&cluster, "d1", &cluster.path("b/shards")),
        data_node(&cluster, "d2", &cluster.path("c/shards")),
    ];
    let _workers: Vec<Proc> = (0..2)
        .map(|i| cluster.worker(&format!("w{i}"), "price = 10", "cpu = 1", ITERATE))
        .collect();
    let job = iterate_job(&cluster, "shards", 2, "shards", 1);
    let (mut scheduler, _events) = cluster.scheduler("scheduler", &job);
    let (ok, log) = scheduler.wait(Duration::from_secs(90));
    assert!(ok, "{}", log.join("\n"));
    assert!(
        log.iter()
            .any(|l| l.contains("iteration ready") && l.contains("slices=14")),
        "{}",
        log.join("\n")
    );
    assert_executors_saw_each_once(&cluster, 2, &plain, 1);
    assert_audit_passes(&cluster.path("shards-job.ledger"), 1, 14);
}

#[test]
fn workers_and_a_data_node_killed_mid_iteration_leave_every_slice_used_once_per_epoch() {
    const SLICES: u64 = 500;
    let cluster = Cluster::new();
    write_dataset(&cluster.path("a/tokens"), 0..SLICES);
    write_dataset(&cluster.path("b/tokens"), 0..SLICES);
    let mut replicas = [
        data_node(&cluster, "d0", &cluster.path("a/tokens")),
        data_node(&cluster, "d1", &cluster.path("b/tokens")),
    ];
    let mut workers: Vec<Proc> = (0..4)
        .map(|i| cluster.worker(&format!("w{i}"), "price = 10", "cpu = 1", ITERATE))
        .collect();
    let job = iterate_job(&cluster, "chaos", 4, "tokens", 2);
    let (mut scheduler, _events) = cluster.scheduler("scheduler", &job);

    wait_for_uses(&cluster, 150);
    workers[1].kill();
    workers.push(cluster.worker("w4", "price = 10", "cpu = 1", ITERATE));
    wait_for_uses(&cluster, 400);
    replicas[0].kill();
    workers[2].kill();
    workers.push(cluster.worker("w5", "price = 10", "cpu = 1", ITERATE));

    let (ok, log) = scheduler.wait(Duration::from_secs(180));
    assert!(ok, "{}", log.join("\n"));
    assert_audit_passes(&cluster.path("chaos-job.ledger"), 2, SLICES);
    let (_, returned) = audit(&cluster.path("chaos-job.ledger"));
    assert!(
        returned.contains(&ReturnReason::WorkerLost),
        "the killed workers' slices went back: {returned:?}"
    );
}

#[test]
fn a_scheduler_killed_mid_epoch_resumes_its_ledger_with_nothing_used_twice_or_lost() {
    const SLICES: u64 = 200;
    let cluster = Cluster::new();
    write_dataset(&cluster.path("tokens"), 0..SLICES);
    let _data_node = data_node(&cluster, "data", &cluster.path("tokens"));
    let _workers: Vec<Proc> = (0..2)
        .map(|i| cluster.worker(&format!("w{i}"), "price = 10", "cpu = 1", ITERATE))
        .collect();
    let job = iterate_job(&cluster, "resume", 2, "tokens", 2);
    let (mut first, _) = cluster.scheduler("first", &job);
    let listening = first.wait_for("listening");
    wait_for_uses(&cluster, 80);

    // An operator can ask how far it got.
    let progress = cluster.progress("first", &listening);
    assert_eq!(progress["dataset"], "tokens");
    assert_eq!(progress["run"]["restarts"], 0, "{progress}");
    // Any other certified peer is not told, a worker of no job of the run included: the
    // answer names the run's task.
    cluster.config("outsider", hypha_certs::Role::Worker, "");
    let refused = cluster
        .progress_as("first", &listening, "outsider")
        .unwrap_err();
    assert!(refused.contains("--role operator"), "{refused}");
    // Nor does it get the run's slices, knowing the iteration's id.
    let address = listening
        .split("address=")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap();
    let address: hypha_network::Multiaddr = format!("{address}/p2p/{}", cluster.peer_id("first"))
        .parse()
        .unwrap();
    let asked = tokio::runtime::Runtime::new().unwrap().block_on(async {
        let network = hypha_node::start_client(
            "outsider",
            &hypha_scheduler::node::schema(),
            Some(&cluster.path("outsider.toml")),
            &hypha_node::Overrides::default(),
            false,
        )
        .await
        .unwrap();
        let scheduler = network.dial(address).await.unwrap();
        // Say the iteration's id leaked (an operator's screen).
        let request = hypha_messages::iterate::IterateRequest {
            iteration: progress["iteration"].as_str().unwrap().to_string(),
            dataset: "tokens".into(),
            consumer: "a-job-of-my-own".into(),
            epochs: 0,
            seed: 0,
            want: 8,
            cached: Vec::new(),
            consumed: Vec::new(),
            round: 0,
            completed_round: None,
            holding: None,
            share_with: Vec::new(),
        };
        let asked = hypha_data::iteration::ask(&network, scheduler, request).await;
        network.shutdown().await;
        asked
    });
    let refused = asked.unwrap_err().to_string();
    assert!(
        refused.contains("not a running job of this run"),
        "{refused}"
    );
    assert_eq!(progress["epochs"].as_array().unwrap().len(), 2);
    let epoch0 = &progress["epochs"][0];
    let total: u64 = ["available", "assigned", "consumed", "used"]
        .iter()
        .map(|k| epoch0[k].as_u64().unwrap())
        .sum();
    assert_eq!(total, SLICES, "{progress}");
    assert!(epoch0["used"].as_u64().unwrap() > 0, "{progress}");
    let consumers = progress["consumers"].as_array().unwrap();
    assert_eq!(consumers.len(), 2, "{progress}");
    // Prefetching stays bounded: no job hoards the epoch (16 ahead, 1 in the executor's hands).
    assert!(
        consumers
            .iter()
            .all(|c| c["assigned"].as_u64().unwrap() <= 17),
        "{progress}"
    );
    assert!(
        consumers
            .iter()
            .all(|c| c["samples_per_s"].as_f64().unwrap() > 0.0),
        "{progress}"
    );
    first.kill();
    let (used_before, _) = audit(&cluster.path("resume-job.ledger"));
    assert!(!used_before.is_empty(), "nothing was used before the kill");
    assert!(
        (used_before.len() as u64) < 2 * SLICES,
        "the first run finished"
    );

    // The workers' leases lapse (3 s) and a new run of the same job file takes them again.
    let (mut second, _) = cluster.scheduler("second", &job);
    let (ok, log) = second.wait(Duration::from_secs(120));
    assert!(ok, "{}", log.join("\n"));
    assert!(
        log.iter().any(|l| l.contains("iteration ready")),
        "{}",
        log.join("\n")
    );
    assert_audit_passes(&cluster.path("resume-job.ledger"), 2, SLICES);
}
