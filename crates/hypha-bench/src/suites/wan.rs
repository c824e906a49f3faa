//! `wan`: DiLoCo on slow links. The parameter server's worker and three trainer workers each
//! run in a network namespace of their own behind a link of 50 Mbit/s each way (`tc … tbf`,
//! [`hypha_testing::netns`]); the gateway, the data node and the scheduler run on the bridge.
//! Real processes of the release binaries, the reference executor's MLP with about 10 M
//! parameters (1 M with `--quick`) on the learnable `blobs` dataset. Six modes in two
//! layouts of rounds, each layout the same rounds of the same samples for all its modes:
//! - **long rounds** (4 rounds of 120 inner steps a trainer; 3 of 16 with `--quick`): `none`
//!   (f32 both ways), `int8` (int8 pseudo-gradients and model changes, error feedback on
//!   both sides) and `int8 + overlap`. Long rounds are what int8 needs to be far below data
//!   parallelism (its traffic against it is about 0.2 / inner steps).
//! - **short rounds** (12 rounds of 48 inner steps; 12 of 16 with `--quick`): `none_short`
//!   (f32), `sparse` (the job's defaults: 64 of each chunk of 4,096 at 2 bits up, three times
//!   as many back, plain SGD outer steps) and `sparse + overlap`. A round of `sparse` moves
//!   only the largest 1.6 % of each chunk, the rest waiting in the residual (measured at 1 %): in 3 or 4 rounds it is far behind (loss
//!   2.0× uncompressed in the quick size's 3 rounds), in 12 ahead (`--quick`: 0.186 against
//!   0.222). 48 steps keep its traffic below 0.0002 of data parallelism.
//!
//! The dataset holds as many
//! samples as the run trains, so no sample is seen twice: a model this wide fits a few
//! thousand samples by heart within a few epochs, and its held-out loss then measures that,
//! not the codec (the suite's first runs, on the 1,536 samples of the tests' dataset, got
//! worse with every round).
//!
//! The sparse ratios are against `none_short` and compare each direction on its own
//! (`bytes_up_sparse_vs_f32`: the trainers' sent bytes, `bytes_down_sparse_vs_f32`: what they
//! received); `traffic_sparse_vs_data_parallel` takes `sparse + overlap`'s bytes.
//!
//! Measured per mode over the rounds after the first (the first one holds the joining: one
//! trainer's initial model to the server, and the whole global model to any trainer that does
//! not hold the same):
//! - DiLoCo's bytes per round: what the trainers sent to the parameter server (up:
//!   pseudo-gradients, model requests) and what they received of the global model (down:
//!   models or changes from the server and, since a whole model of 16 MiB or more is
//!   published, its pieces from each other), as IP packets counted by `iptables` in the
//!   trainers' namespaces. Counting only the server's link would credit f32 with a way of
//!   distributing whole models that changes do not need: each trainer's downlink carries
//!   the whole model either way. Beside it, everything through the
//!   trainers' links (their slices from the data node and their statuses to the scheduler
//!   too: about 2.5 MB a round, the same in every mode) and what else crossed the parameter
//!   server's link (its checkpoint to the scheduler after every round: model, momentum and,
//!   compressing, the residual, in f32; its statuses);
//! - the trainers' utilisation: the growth of the inner-step time they report (`train_ms`)
//!   over the wall time between the first and the last round applied, averaged over trainers
//!   (their reports come every 0.2–1 s, which bounds the error);
//! - the evaluation loss of the final model on 8,192 held-out samples.
//!
//! `traffic_vs_data_parallel` compares the best mode's DiLoCo bytes with what per-step
//! data-parallel training would move for the same samples: a ring all-reduce of f32 gradients
//! every step, in which each of N trainers sends and receives 2 (N − 1) / N × 4 bytes ×
//! parameters (sent and received counted, as ours are; headers not, which favours it by ~3 %).
//!
//! Needs root (CAP_NET_ADMIN) for the namespaces and `iptables` to count between hosts;
//! without them the suite says so and reports no ratios. `WAN_BENCH_DEBUG=1` prints each
//! mode's metrics lines and the trainers' logs. Targets (issue 21): bytes ≤ 0.26 × f32, loss
//! ≤ 1.02 × uncompressed, utilisation with overlap ≥ 0.9, ≥ 500× less traffic than data
//! parallel; for sparse (issue 37): up ≤ 0.006 × f32, down ≤ 0.02 ×, loss ≤ 1.02 ×,
//! utilisation with overlap ≥ 0.95, traffic ≤ 0.0002 of data parallel.

use std::{
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use hypha_executor::{
    model::{Model, ModelSpec},
    synthetic::Synthetic,
};
use hypha_testing::{
    cluster::{Cluster, Proc, data_node, events, job_dir, of_kind},
    netns::Wan,
};

use crate::Report;

/// The rate of every link, each way.
const MBIT: u32 = 50;
const TRAINERS: usize = 3;
const BATCH: u64 = 32;
/// Samples in a slice of the suite's dataset.
const SLICE_SAMPLES: u64 = 64;
/// The longest one mode may take.
const PATIENCE: Duration = Duration::from_secs(1800);

/// A run's size.
#[derive(Debug, Clone, Copy)]
struct Size {
    /// The MLP's hidden width (two hidden layers): parameters = hidden² + 22 hidden + 4.
    hidden: usize,
    long: Rounds,
    short: Rounds,
}

impl Size {
    /// The quick run's size, or the full one's.
    fn of(quick: bool) -> Size {
        // Samples per round: inner steps × BATCH × TRAINERS.
        if quick {
            Size {
                hidden: 990,
                long: Rounds {
                    count: 3,
                    samples_per_round: 1536,
                },
                short: Rounds {
                    count: 12,
                    samples_per_round: 1536,
                },
            }
        } else {
            Size {
                hidden: 3151,
                // 120 inner steps a trainer a round: DiLoCo's traffic against per-step data
                // parallelism is about 0.2 / steps with int8 (BENCHMARKS.md, "wan").
                long: Rounds {
                    count: 4,
                    samples_per_round: 11_520,
                },
                // 48 steps: sparse's traffic (about 0.02 of f32 a round) below 0.0002 of data
                // parallelism.
                short: Rounds {
                    count: 12,
                    samples_per_round: 4_608,
                },
            }
        }
    }
}

/// How a run is cut into rounds.
#[derive(Debug, Clone, Copy)]
struct Rounds {
    count: u64,
    samples_per_round: u64,
}

#[derive(Debug, Clone, Copy)]
struct Mode {
    name: &'static str,
    compression: &'static str,
    overlap: bool,
    /// In the layout of many short rounds ([`Size::short`]).
    short: bool,
}

impl Mode {
    const fn new(
        name: &'static str,
        compression: &'static str,
        overlap: bool,
        short: bool,
    ) -> Self {
        Self {
            name,
            compression,
            overlap,
            short,
        }
    }
}

const MODES: [Mode; 6] = [
    Mode::new("none", "none", false, false),
    Mode::new("int8", "int8", false, false),
    Mode::new("int8_overlap", "int8", true, false),
    Mode::new("none_short", "none", false, true),
    Mode::new("sparse", "sparse", false, true),
    Mode::new("sparse_overlap", "sparse", true, true),
];

/// What one mode measured.
#[derive(Debug)]
struct Measured {
    /// What the trainers sent to the server and received from it or from each other.
    bytes_per_round: f64,
    /// From the trainers to the server (pseudo-gradients, model requests).
    up_bytes_per_round: f64,
    /// What the trainers received of the global model: models or changes, from the server
    /// or (a published whole model) from each other.
    down_bytes_per_round: f64,
    /// Everything through the trainers' links.
    link_bytes_per_round: f64,
    /// Bytes between the trainers and the server and samples trained over the rounds after
    /// the first.
    window_bytes: f64,
    /// What else crossed the server's link per round (checkpoints, statuses).
    other_server_bytes_per_round: f64,
    window_samples: f64,
    utilisation: f64,
    loss: f64,
    seconds_per_round: f64,
}

pub(crate) async fn run(quick: bool) -> anyhow::Result<Report> {
    // Starting and watching processes blocks: off the runtime's threads.
    tokio::task::spawn_blocking(move || measure(quick)).await?
}

fn measure(quick: bool) -> anyhow::Result<Report> {
    let wan = Wan::new("hyw", 1 + TRAINERS, MBIT).and_then(|wan| {
        // Every host a trainer talks DiLoCo with: the server and the other trainers (a
        // whole model of 16 MiB or more is published, and trainers take it from each other).
        for i in 1..=TRAINERS {
            for j in (0..=TRAINERS).filter(|&j| j != i) {
                wan.count_between(i, j)?;
            }
        }
        Ok(wan)
    });
    let wan = match wan {
        Ok(wan) => wan,
        Err(why) => {
            eprintln!(
                "wan: skipped: the suite needs root for network namespaces and tc, and iptables \
                 to count the bytes between hosts ({why}); no ratios"
            );
            return Ok(Report::default());
        }
    };
    let size = Size::of(quick);
    let spec = ModelSpec::Mlp {
        inputs: 16,
        hidden: size.hidden,
        classes: 4,
    };
    let parameters = Model::new(&spec, 1)?
        .tensors()?
        .0
        .values()
        .map(|t| t.values.len())
        .sum::<usize>() as f64;
    let mut report = Report::default();
    report.metrics.insert("parameters".into(), parameters);
    report.metrics.insert("link_mbit".into(), f64::from(MBIT));
    let mut results = Vec::new();
    for mode in MODES {
        let rounds = if mode.short { size.short } else { size.long };
        let measured =
            run_mode(&wan, mode, rounds, &spec).with_context(|| format!("mode {}", mode.name))?;
        eprintln!("wan: {}: {measured:?}", mode.name);
        let per_mode = [
            ("bytes_per_round", measured.bytes_per_round),
            ("bytes_up_per_round", measured.up_bytes_per_round),
            ("bytes_down_per_round", measured.down_bytes_per_round),
            ("link_bytes_per_round", measured.link_bytes_per_round),
            (
                "server_other_bytes_per_round",
                measured.other_server_bytes_per_round,
            ),
            ("utilisation", measured.utilisation),
            ("loss", measured.loss),
            ("seconds_per_round", measured.seconds_per_round),
        ];
        for (key, value) in per_mode {
            report.metrics.insert(format!("{key}_{}", mode.name), value);
        }
        results.push(measured);
    }
    let [none, int8, overlap, none_short, sparse, sparse_overlap] = &results[..] else {
        bail!("six modes measured");
    };
    // Per-step data parallel for the same samples: a ring all-reduce of the f32 gradient,
    // each trainer sending and receiving 2 (N − 1) / N of it.
    let vs_data_parallel = |mode: &Measured| {
        let n = TRAINERS as f64;
        let steps = mode.window_samples / (BATCH as f64 * n);
        let data_parallel = steps * n * 2.0 * (2.0 * (n - 1.0) / n) * 4.0 * parameters;
        mode.window_bytes / data_parallel
    };
    let ratios = [
        (
            "bytes_per_round_int8_vs_f32",
            int8.bytes_per_round / none.bytes_per_round,
        ),
        (
            "link_bytes_per_round_int8_vs_f32",
            int8.link_bytes_per_round / none.link_bytes_per_round,
        ),
        ("loss_int8_vs_none", int8.loss / none.loss),
        ("loss_int8_overlap_vs_none", overlap.loss / none.loss),
        ("traffic_vs_data_parallel", vs_data_parallel(overlap)),
        (
            "bytes_up_sparse_vs_f32",
            sparse.up_bytes_per_round / none_short.up_bytes_per_round,
        ),
        (
            "bytes_down_sparse_vs_f32",
            sparse.down_bytes_per_round / none_short.down_bytes_per_round,
        ),
        ("loss_sparse_vs_none", sparse.loss / none_short.loss),
        (
            "loss_sparse_overlap_vs_none",
            sparse_overlap.loss / none_short.loss,
        ),
        (
            "traffic_sparse_vs_data_parallel",
            vs_data_parallel(sparse_overlap),
        ),
    ];
    for (key, value) in ratios {
        report.ratios.insert(key.into(), value);
    }
    Ok(report)
}

fn run_mode(wan: &Wan, mode: Mode, rounds: Rounds, spec: &ModelSpec) -> anyhow::Result<Measured> {
    let mut cluster = Cluster::at(wan.root());
    // Lease renewals share the links with the models: long leases.
    cluster.worker_lease_ms = Some(60_000);
    // Every sample the run trains, once; the same file in every mode of a layout.
    let slices = (rounds.count * rounds.samples_per_round).div_ceil(SLICE_SAMPLES);
    Synthetic::for_model(spec).write(
        &cluster.path("data/blobs"),
        slices as usize,
        SLICE_SAMPLES as usize,
        0,
    )?;
    let _data = data_node(&cluster, "data", &cluster.path("data"));
    cluster.place = wan.host(0);
    let _server = cluster.server_worker("ps");
    let _trainers: Vec<Proc> = (1..=TRAINERS)
        .map(|i| {
            cluster.place = wan.host(i);
            cluster.trainer_worker(&format!("trainer{i}"), "")
        })
        .collect();
    cluster.place = wan.root();
    // A second epoch only for slices a round wasted (ahead batches thrown away).
    let epochs = 2;
    let ModelSpec::Mlp { hidden, .. } = spec else {
        bail!("the wan suite trains an MLP");
    };
    let job = cluster.job("wan", &job_text(*hidden, epochs, rounds, mode));
    let (mut scheduler, events_path) = cluster.scheduler("scheduler", &job);
    // At every applied round: the bytes between the trainers and the server, and the
    // counters of the trainers' links and of the server's.
    let mut marks: Vec<Mark> = Vec::new();
    let deadline = Instant::now() + PATIENCE;
    loop {
        let all = events(&events_path);
        let rounds = of_kind(&all, "round").len();
        while marks.len() < rounds {
            marks.push(Mark::now(wan)?);
        }
        if let Some(done) = of_kind(&all, "done").last() {
            if marks.len() < 2 {
                bail!(
                    "the job ended after {} rounds: {}",
                    marks.len(),
                    done["event"]
                );
            }
            break;
        }
        if Instant::now() >= deadline {
            bail!("not done within {PATIENCE:?} ({} rounds)", marks.len());
        }
        if let Ok(Some(status)) = scheduler.child.try_wait() {
            bail!(
                "the scheduler exited with {status} after {} rounds",
                marks.len()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let (first, last) = (marks[0], marks[marks.len() - 1]);
    let intervals = (marks.len() - 1) as f64;
    let window_bytes = (last.diloco - first.diloco) as f64;
    let up_bytes = (last.up - first.up) as f64;
    let link_bytes = (last.trainer_links - first.trainer_links) as f64;
    // Every byte between a trainer and the server crosses the server's link too.
    let server_bytes = (last.diloco_with_server - first.diloco_with_server) as f64;
    let other_server_bytes = (last.server_link - first.server_link) as f64 - server_bytes;
    // The metrics file is JSON lines, as the events file is.
    let metrics_lines = events(&cluster.path("wan-job.metrics.jsonl"));
    let applied: Vec<&serde_json::Value> = metrics_lines
        .iter()
        .filter(|m| m["kind"] == "round")
        .collect();
    let window_samples: f64 = applied
        .iter()
        .skip(1)
        .filter_map(|m| m["samples"].as_f64())
        .sum();
    let (t0, t1) = (
        applied.first().and_then(|m| m["time_ms"].as_f64()),
        applied.last().and_then(|m| m["time_ms"].as_f64()),
    );
    let (Some(t0), Some(t1)) = (t0, t1) else {
        bail!("no rounds in the metrics file");
    };
    let utilisation = utilisation(&metrics_lines, t0, t1);
    if std::env::var_os("WAN_BENCH_DEBUG").is_some() {
        for m in &metrics_lines {
            eprintln!("{m}");
        }
        for i in 1..=TRAINERS {
            let dir = job_dir(&cluster.path(&format!("trainer{i}-work")));
            eprintln!(
                "trainer{i}: {}",
                std::fs::read_to_string(dir.join("stderr.log")).unwrap_or_default()
            );
        }
    }
    let final_model = job_dir(&cluster.path("ps-work")).join("final.safetensors");
    let _ = scheduler.wait(Duration::from_secs(60));
    Ok(Measured {
        bytes_per_round: window_bytes / intervals,
        up_bytes_per_round: up_bytes / intervals,
        down_bytes_per_round: (window_bytes - up_bytes) / intervals,
        link_bytes_per_round: link_bytes / intervals,
        window_bytes,
        other_server_bytes_per_round: other_server_bytes / intervals,
        window_samples,
        utilisation,
        loss: evaluation_loss(spec, &final_model)?,
        seconds_per_round: (t1 - t0) / 1000.0 / intervals,
    })
}

/// The job of a run: an MLP of `hidden` units trained over `rounds` with `mode`'s
/// compression and overlap, by [`TRAINERS`] trainers, on `epochs` of the blobs.
fn job_text(hidden: usize, epochs: u32, rounds: Rounds, mode: Mode) -> String {
    format!(
        "workers = {TRAINERS}\nbid = 50\nmax_attempts = 3\n\
         [executor]\nclass = \"train\"\nname = \"diloco\"\n\
         [resources]\ncpu = 1\n\
         [config]\nseed = 1\nmodel = {{ type = \"mlp\", inputs = 16, hidden = {hidden}, classes = 4 }}\n\
         [data]\ndataset = \"blobs\"\nepochs = {epochs}\nseed = 3\n\
         [diloco]\nrounds = {}\nsamples_per_round = {}\nbatch_size = {BATCH}\nround_seconds = 600\n\
         compression = \"{}\"\noverlap = {}\n\
         inner = {{ learning_rate = 0.003, weight_decay = 0.01, beta1 = 0.9, beta2 = 0.999 }}\n\
         [diloco.parameter_server]\nbid = 20\nexecutor = {{ class = \"aggregate\", name = \"parameter-server\" }}\n",
        rounds.count, rounds.samples_per_round, mode.compression, mode.overlap
    )
}

/// Byte counters at an applied round.
#[derive(Debug, Clone, Copy)]
struct Mark {
    /// What the trainers sent to the server and received from it or from each other.
    diloco: u64,
    /// Between the trainers and the server, both ways.
    diloco_with_server: u64,
    /// From the trainers to the server.
    up: u64,
    /// Through the trainers' links, both ways.
    trainer_links: u64,
    /// Through the server's link, both ways.
    server_link: u64,
}

impl Mark {
    /// The counters now: between the trainers and the server, among the trainers, and of
    /// the trainers' links and the server's.
    fn now(wan: &Wan) -> anyhow::Result<Mark> {
        let link = |i: usize| {
            let (sent, received) = wan.bytes(i);
            sent + received
        };
        let (mut up, mut down, mut from_peers) = (0, 0, 0);
        for i in 1..=TRAINERS {
            let (sent, received) = wan.bytes_between(i, 0).map_err(anyhow::Error::msg)?;
            up += sent;
            down += received;
            for j in (1..=TRAINERS).filter(|&j| j != i) {
                let (_, from_peer) = wan.bytes_between(i, j).map_err(anyhow::Error::msg)?;
                from_peers += from_peer;
            }
        }
        Ok(Mark {
            diloco: up + down + from_peers,
            diloco_with_server: up + down,
            up,
            trainer_links: (1..=TRAINERS).map(link).sum(),
            server_link: link(0),
        })
    }
}

/// The trainers' mean share of the wall time from `t0` to `t1` (ms) spent in inner steps,
/// from the `train_ms` of their last reports at or before each.
fn utilisation(lines: &[serde_json::Value], t0: f64, t1: f64) -> f64 {
    let trainers: std::collections::BTreeSet<&str> = lines
        .iter()
        .filter(|m| m["kind"] == "trainer")
        .filter_map(|m| m["job"].as_str())
        .collect();
    let at = |job: &str, time: f64| {
        lines
            .iter()
            .rev()
            .filter(|m| m["kind"] == "trainer" && m["job"] == job)
            .find(|m| m["time_ms"].as_f64().is_some_and(|t| t <= time))
            .and_then(|m| m["train_ms"].as_f64())
            .unwrap_or(0.0)
    };
    let shares: Vec<f64> = trainers
        .iter()
        .map(|job| (at(job, t1) - at(job, t0)) / (t1 - t0))
        .collect();
    shares.iter().sum::<f64>() / shares.len().max(1) as f64
}

/// The evaluation loss of the model file at `path` on held-out `blobs` samples.
fn evaluation_loss(spec: &ModelSpec, path: &Path) -> anyhow::Result<f64> {
    let model = Model::new(spec, 1)?;
    model.load(&hypha_diloco::Tensors::load(path)?)?;
    let held_out = Synthetic::for_model(spec).batch(8192, 1 << 40)?;
    Ok(model.evaluate(&held_out)?.0)
}
