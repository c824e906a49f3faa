//! Hypha's benchmarks.
//!
//! One entry point, `cargo run --release -p hypha-bench -- SUITE [--quick]`. Every suite
//! measures the ceiling it is compared against in the same run on the same machine (raw TCP, raw
//! TLS, memcpy…), so its ratios are meaningful wherever it runs. Each prints a table and writes
//! `target/bench/SUITE.json` as `{"suite": …, "metrics": {…}, "ratios": {…}}`; the key names
//! are stable so that runs can be compared. `BENCHMARKS.md` records method and results.

use std::{collections::BTreeMap, path::PathBuf, time::Duration};

mod suites;

/// The suites.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Suite {
    /// One stream and four parallel streams over the mTLS + yamux stack, against raw TLS and TCP.
    Transport,
    /// Slices from a data node to 1, 4 and 16 concurrent verified fetchers, against raw TLS.
    Dataserve,
    /// Time from advertisement to N leased and dispatched workers, N = 4, 16, 64.
    Allocation,
    /// Durable slice assignments and acknowledgements per second of the scheduler's ledger.
    Ledger,
    /// The share of a slow executor's time spent waiting for prefetched slices.
    Prefetch,
    /// Parameter-server aggregation against memcpy, its peak memory, DiLoCo's traffic.
    Diloco,
    /// One artifact to N = 4 and 8 nodes from a throttled origin: origin bytes and time.
    Distribute,
    /// An elastic DiLoCo run while trainers are killed, told to stop and started (real
    /// processes; build them first with `cargo build --release`): goodput, a joiner's time
    /// to its first applied update, loss against the run left alone.
    Churn,
    /// Seconds from a SIGKILL of the scheduler, and of the parameter server's worker, to the
    /// next applied DiLoCo round (real processes; build them first with `cargo build
    /// --release`).
    Recovery,
    /// DiLoCo with a parameter server and 3 trainers each behind a 50 Mbit/s link (network
    /// namespaces and `tc … tbf`; needs root): bytes, utilisation and loss without
    /// compression, with int8, and with int8 and overlap.
    Wan,
    /// DiLoCo across three sites behind NAT routers with 50 Mbit/s uplinks (network
    /// namespaces, `tc`, `iptables`; needs root): direct pairs, bytes through the gateway's
    /// relay, round and job time against the same links without NAT.
    Sites,
    /// DiLoCo at 100 M parameters (`--quick`: 25 M), real trainers, int8 both ways (real
    /// processes; build them first with `cargo build --release`): the parameter server's
    /// peak memory over the model, its round close over a copy of the model, checkpoint bytes
    /// over DiLoCo bytes, and the time to the next round after its worker is killed.
    Scale,
    /// Robust aggregation: DiLoCo with 4 trainers (the reference learner, the parameter
    /// server and the scheduler's rounds, in this process), honest and under each attack of
    /// one trainer; a long honest run with a loss spike: honest updates refused, trainers
    /// benched, rounds with every trainer.
    Byzantine,
    /// DiLoCo against one machine on real text at equal tokens: a byte-level transformer on
    /// the Python standard library's sources (the reference learner and the parameter server
    /// in this process), one learner with the trainers' batches together against 4 trainers
    /// with f32, int8, sparse and sparse with overlap: held-out bits per byte, the curves in
    /// target/bench/outcome.svg.
    Outcome,
}

impl Suite {
    fn name(self) -> &'static str {
        match self {
            Suite::Transport => "transport",
            Suite::Dataserve => "dataserve",
            Suite::Allocation => "allocation",
            Suite::Ledger => "ledger",
            Suite::Prefetch => "prefetch",
            Suite::Diloco => "diloco",
            Suite::Distribute => "distribute",
            Suite::Churn => "churn",
            Suite::Recovery => "recovery",
            Suite::Wan => "wan",
            Suite::Sites => "sites",
            Suite::Scale => "scale",
            Suite::Byzantine => "byzantine",
            Suite::Outcome => "outcome",
        }
    }
}

/// If this process was started as a suite's helper process, runs it and returns its outcome.
pub fn run_child(args: &[String]) -> Option<anyhow::Result<()>> {
    match args.split_first() {
        Some((command, rest)) if command == suites::dataserve::CHILD_COMMAND => {
            Some(suites::dataserve::child_main(rest))
        }
        Some((command, rest)) if command == suites::diloco::CHILD_COMMAND => {
            Some(suites::diloco::child_main(rest))
        }
        Some((command, _)) if command == suites::allocation::SPIN_COMMAND => {
            suites::allocation::spin_main()
        }
        _ => None,
    }
}

/// A suite's results.
#[derive(Debug, Default, serde::Serialize)]
pub struct Report {
    pub suite: String,
    pub metrics: BTreeMap<String, f64>,
    pub ratios: BTreeMap<String, f64>,
    /// The settings a study changed (`--set`), none for a suite as it stands.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub settings: BTreeMap<String, String>,
}

/// Runs a suite, prints its table and writes its JSON; returns the JSON's path. `settings`
/// (KEY, VALUE) change the suite's runs for a study; only `outcome` takes any.
pub fn run(suite: Suite, quick: bool, settings: &[(String, String)]) -> anyhow::Result<PathBuf> {
    if suite != Suite::Outcome && !settings.is_empty() {
        anyhow::bail!(
            "--set is for the outcome suite; {} takes no settings",
            suite.name()
        );
    }
    let study = suites::outcome::Study::parse(settings)?;
    // Logs go to stderr (RUST_LOG), so the table on stdout stays clean.
    let _telemetry =
        hypha_telemetry::init(&hypha_telemetry::Settings::console_only("hypha-bench"))?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    // The suite runs as a spawned task so that every measurement, ceiling or not, runs on the
    // runtime's worker threads (one per core) and none gets the extra `block_on` thread.
    let mut report = runtime.block_on(async move {
        tokio::spawn(async move {
            match suite {
                Suite::Transport => suites::transport::run(quick).await,
                Suite::Dataserve => suites::dataserve::run(quick).await,
                Suite::Allocation => suites::allocation::run(quick).await,
                Suite::Ledger => suites::ledger::run(quick).await,
                Suite::Prefetch => suites::prefetch::run(quick).await,
                Suite::Diloco => suites::diloco::run(quick).await,
                Suite::Distribute => suites::distribute::run(quick).await,
                Suite::Churn => suites::churn::run(quick).await,
                Suite::Recovery => suites::recovery::run(quick).await,
                Suite::Wan => suites::wan::run(quick).await,
                Suite::Sites => suites::sites::run(quick).await,
                Suite::Scale => suites::scale::run(quick).await,
                Suite::Byzantine => suites::byzantine::run(quick).await,
                Suite::Outcome => suites::outcome::run(quick, study).await,
            }
        })
        .await
    })??;
    report.suite = suite.name().to_string();
    report.settings = settings.iter().cloned().collect();
    print_table(&report);
    let dir = target_dir().join("bench");
    std::fs::create_dir_all(&dir)?;
    let path = dir.join(format!("{}.json", suite.name()));
    std::fs::write(&path, serde_json::to_string_pretty(&report)? + "\n")?;
    Ok(path)
}

pub(crate) fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target"))
}

fn print_table(report: &Report) {
    println!("\n{} benchmark", report.suite);
    println!("{:<40} {:>14}", "metric", "value");
    for (name, value) in &report.metrics {
        println!("{name:<40} {value:>14.2}");
    }
    println!("{:<40} {:>14}", "ratio", "");
    for (name, value) in &report.ratios {
        println!("{name:<40} {value:>14.3}");
    }
}

/// Waits until the scheduler's events file at `path` satisfies `until`, looking every 10 ms
/// (the suites time what it waits for); fails, naming `what`, when the job ends first or
/// `patience` passes.
pub(crate) fn wait_for_events(
    path: &std::path::Path,
    patience: Duration,
    what: &str,
    until: impl Fn(&[serde_json::Value]) -> bool,
) -> anyhow::Result<()> {
    use hypha_testing::cluster::{events, of_kind};
    let deadline = std::time::Instant::now() + patience;
    loop {
        let all = events(path);
        if until(&all) {
            return Ok(());
        }
        if let Some(done) = of_kind(&all, "done").last() {
            anyhow::bail!("the job ended before {what}: {}", done["event"]);
        }
        if std::time::Instant::now() >= deadline {
            anyhow::bail!("no {what} within {patience:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The median of some measurements.
/// The parameter-server workers of [`spare_server_cluster`].
pub(crate) const SERVER_WORKERS: [&str; 2] = ["ps-a", "ps-b"];

/// A cluster for DiLoCo runs whose parameter server is killed (`hypha_testing`'s, the
/// workers' leases at their default): a data node serving `blobs`, the parameter-server
/// workers [`SERVER_WORKERS`] (one the spare) and two trainer workers, their executors run
/// with `trainer_args` after the usual ones. The servers, and the other processes (kept
/// alive as long as they are held).
pub(crate) fn spare_server_cluster(
    trainer_args: &[&str],
) -> (
    hypha_testing::cluster::Cluster,
    Vec<hypha_testing::cluster::Proc>,
    Vec<hypha_testing::cluster::Proc>,
) {
    let mut cluster = hypha_testing::cluster::Cluster::new();
    cluster.worker_lease_ms = None;
    let mut others = vec![cluster.blobs_data_node("data")];
    let servers = SERVER_WORKERS
        .iter()
        .map(|n| cluster.server_worker(n))
        .collect();
    others.extend(
        (0..2).map(|i| cluster.trainer_worker_with_args(&format!("trainer{i}"), trainer_args, "")),
    );
    (cluster, servers, others)
}

/// The trainers of [`spare_server_cluster`] by name, with their work directories: their
/// executors' logs for [`write_logs`].
pub(crate) fn trainer_executors(
    cluster: &hypha_testing::cluster::Cluster,
) -> Vec<(String, PathBuf)> {
    (0..2)
        .map(|i| {
            let name = format!("trainer{i}");
            let work = cluster.path(&format!("{name}-work"));
            (format!("{name}-executor"), work)
        })
        .collect()
}

/// Which of the workers `names` runs the job's `slot` now (the parameter server's is the slot
/// after the trainers'): the peer of the last dispatch for it.
pub(crate) fn current_server(
    cluster: &hypha_testing::cluster::Cluster,
    events_path: &std::path::Path,
    names: &[&str],
    slot: u64,
) -> anyhow::Result<usize> {
    use anyhow::Context;
    let all = hypha_testing::cluster::events(events_path);
    let peer = hypha_testing::cluster::of_kind(&all, "dispatched")
        .into_iter()
        .rev()
        .find(|e| e["event"]["slot"] == slot)
        .and_then(|e| e["event"]["peer"].as_str().map(str::to_string))
        .context("no parameter server was dispatched")?;
    names
        .iter()
        .position(|name| cluster.peer_id(name) == peer)
        .context("the parameter server runs on none of the parameter-server workers")
}

/// Writes every line `procs` logged, and the executor logs (`stderr.log`) of the job
/// directories under the workers' work directories `executors` (name, path), as `name: line`,
/// to the file the environment variable `var` names; nothing where it is not set. Where a
/// measured second went.
pub(crate) fn write_logs<'a>(
    var: &str,
    procs: impl IntoIterator<Item = &'a mut hypha_testing::cluster::Proc>,
    executors: &[(String, PathBuf)],
) -> anyhow::Result<()> {
    let Some(path) = std::env::var_os(var) else {
        return Ok(());
    };
    let mut logs: Vec<(String, String)> = Vec::new();
    for proc in procs {
        let name = proc.name.clone();
        logs.extend(
            proc.logged()
                .iter()
                .map(|line| (name.clone(), line.clone())),
        );
    }
    for (name, work) in executors {
        let jobs = std::fs::read_dir(work).into_iter().flatten().flatten();
        for job in jobs {
            let log = std::fs::read_to_string(job.path().join("stderr.log")).unwrap_or_default();
            logs.extend(log.lines().map(|line| (name.clone(), line.to_string())));
        }
    }
    let text: String = logs
        .iter()
        .map(|(name, line)| format!("{name}: {line}\n"))
        .collect();
    std::fs::write(&path, text)
        .map_err(|error| anyhow::anyhow!("{var}: could not write {path:?}: {error}"))
}

pub(crate) fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => 0.0,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

/// Megabytes (10^6 bytes) per second.
pub(crate) fn mb_per_s(bytes: u64, elapsed: Duration) -> f64 {
    bytes as f64 / 1e6 / elapsed.as_secs_f64()
}
