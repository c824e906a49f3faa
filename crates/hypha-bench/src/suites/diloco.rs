//! `diloco`: the parameter server's aggregation speed and memory, and DiLoCo's traffic.
//!
//! - **Aggregation**: 4 pseudo-gradients of 100 M f32 parameters (400 MB each, as SafeTensors
//!   bytes in memory) added into the weighted sum the way the parameter server adds them
//!   ([`Accumulator::add_source`], then [`Accumulator::mean`]); `aggregate_gb_per_s` is
//!   update bytes checked and summed per second.
//!   The ceiling is `memcpy_gb_per_s`, copying a 400 MB buffer in the same run;
//!   `ratios.aggregate_vs_memcpy` compares the two (target ≥ 0.5). The same updates
//!   compressed with `int8` (a quarter of the bytes): `aggregate_int8_f32_gb_per_s` counts the
//!   f32 bytes they stand for, so that it compares with `aggregate_gb_per_s` directly.
//! - **Memory and close**: a child process runs a parameter server ([`ParameterServer`])
//!   through three rounds of 2 and of 8 updates of a 25 M-parameter model (`--quick`: 5 M)
//!   read from their files as a worker's parameter server reads them, writing each round's
//!   change to a file, then the whole model and the checkpoint, and reports its peak RSS
//!   (`VmHWM`) and how long its last round took to close: `ps_peak_rss_mb_2` and
//!   `ps_peak_rss_mb_8` must be about the same; `ps_peak_rss_over_model` (and `_int8`, whose
//!   server also carries the compression's residual) is that over the model's f32 bytes,
//!   the process's own few megabytes included; `ps_close_ms` and `ps_close_int8_ms` against
//!   a memcpy of the model at this run's speed are `ps_close_vs_memcpy` and `_int8_`.
//! - **Traffic**: bytes one trainer sends and receives per round (its pseudo-gradient and the
//!   new model, as serialized) against per-step data-parallel training, which all-reduces a
//!   gradient every step: a ring all-reduce moves 2·(N−1)/N model sizes per worker per step.
//!   `ratios.traffic_vs_data_parallel` is DiLoCo's bytes over data parallelism's for the same
//!   steps (N = 4 workers, 100 inner steps per round).

use std::{collections::BTreeMap, path::Path, time::Instant};

use anyhow::Context;
use hypha_diloco::{
    Accumulator, Codec, OuterOptimizer, Tensor, Tensors, codec, file::FileSource,
    server::ParameterServer,
};
use safetensors::Dtype;

use crate::Report;

/// The helper process that measures a parameter server's memory.
pub(crate) const CHILD_COMMAND: &str = "__diloco-server";
const UPDATES: usize = 4;
const INNER_STEPS: f64 = 100.0;
const WORKERS: f64 = 4.0;

pub(crate) async fn run(quick: bool) -> anyhow::Result<Report> {
    let parameters = if quick { 25_000_000 } else { 100_000_000 };
    let update = model(parameters, 0.5).to_bytes(&BTreeMap::new())?;

    let memcpy = tokio::task::spawn_blocking({
        let update = update.clone();
        move || memcpy_gb_per_s(&update)
    })
    .await?;
    let (aggregate, aggregate_int8, update) = tokio::task::spawn_blocking(move || {
        let aggregate = aggregation_seconds(&update)?;
        let int8 = codec::encode(
            &Tensors::from_bytes(&update)?,
            Codec::Int8,
            &BTreeMap::new(),
        )?;
        let aggregate_int8 = aggregation_seconds(&int8)?;
        let f32_bytes = (UPDATES * update.len()) as f64;
        anyhow::Ok((
            f32_bytes / aggregate / 1e9,
            f32_bytes / aggregate_int8 / 1e9,
            update,
        ))
    })
    .await??;

    let tmp = tempfile::tempdir()?;
    let server_parameters = if quick { 5_000_000 } else { 25_000_000 };
    let model_bytes = model(server_parameters, 0.0).to_bytes(&BTreeMap::new())?;
    std::fs::write(tmp.path().join("model.safetensors"), &model_bytes)?;
    let gradient = model(server_parameters, 0.01).to_bytes(&BTreeMap::new())?;
    for i in 0..8 {
        std::fs::write(
            tmp.path().join(format!("update-{i}.safetensors")),
            &gradient,
        )?;
    }
    let (rss_2, _) = server_peak_rss_mb(tmp.path(), 2, Codec::None)?;
    let (rss_8, close_ms) = server_peak_rss_mb(tmp.path(), 8, Codec::None)?;
    let (rss_int8, close_int8_ms) = server_peak_rss_mb(tmp.path(), 8, Codec::Int8)?;
    let model_memcpy_ms = model_bytes.len() as f64 / (memcpy * 1e9) * 1e3;

    // Per round a trainer sends its pseudo-gradient and receives the model: both are one
    // serialized model.
    let diloco_bytes = 2.0 * update.len() as f64;
    let data_parallel_bytes = INNER_STEPS * 2.0 * (WORKERS - 1.0) / WORKERS * update.len() as f64;

    let mut report = Report::default();
    report
        .metrics
        .insert("parameters".into(), parameters as f64);
    report
        .metrics
        .insert("aggregate_gb_per_s".into(), aggregate);
    report
        .metrics
        .insert("aggregate_int8_f32_gb_per_s".into(), aggregate_int8);
    report.metrics.insert("memcpy_gb_per_s".into(), memcpy);
    report.metrics.insert("ps_peak_rss_mb_2".into(), rss_2);
    report.metrics.insert("ps_peak_rss_mb_8".into(), rss_8);
    report
        .metrics
        .insert("ps_peak_rss_mb_8_int8".into(), rss_int8);
    let model_mb = model_bytes.len() as f64 / 1e6;
    report
        .ratios
        .insert("ps_peak_rss_over_model".into(), rss_8 / model_mb);
    report
        .ratios
        .insert("ps_peak_rss_over_model_int8".into(), rss_int8 / model_mb);
    report.metrics.insert("ps_close_ms".into(), close_ms);
    report
        .metrics
        .insert("ps_close_int8_ms".into(), close_int8_ms);
    report
        .ratios
        .insert("ps_close_vs_memcpy".into(), close_ms / model_memcpy_ms);
    report.ratios.insert(
        "ps_close_int8_vs_memcpy".into(),
        close_int8_ms / model_memcpy_ms,
    );
    report
        .metrics
        .insert("ps_model_mb".into(), model_bytes.len() as f64 / 1e6);
    report
        .metrics
        .insert("round_bytes_per_trainer_mb".into(), diloco_bytes / 1e6);
    report.metrics.insert(
        "data_parallel_bytes_per_worker_mb".into(),
        data_parallel_bytes / 1e6,
    );
    report
        .ratios
        .insert("aggregate_vs_memcpy".into(), aggregate / memcpy);
    report.ratios.insert("ps_rss_8_vs_2".into(), rss_8 / rss_2);
    report.ratios.insert(
        "traffic_vs_data_parallel".into(),
        diloco_bytes / data_parallel_bytes,
    );
    Ok(report)
}

/// The best of 3 times to add [`UPDATES`] copies of `update` and take their mean, the
/// parameter server's way: each update checked as it comes, all summed a range at a time.
fn aggregation_seconds(update: &[u8]) -> anyhow::Result<f64> {
    let update: std::sync::Arc<[u8]> = update.into();
    let mut times = Vec::new();
    for _ in 0..3 {
        let mut sum = Accumulator::new();
        let started = Instant::now();
        for _ in 0..UPDATES {
            sum.add_source(update.clone(), 64.0)?;
        }
        std::hint::black_box(sum.mean()?);
        times.push(started.elapsed().as_secs_f64());
    }
    Ok(times.iter().copied().fold(f64::INFINITY, f64::min))
}

/// A model of `parameters` f32 values, all `value`, in tensors of 1 M.
fn model(parameters: usize, value: f32) -> Tensors {
    const CHUNK: usize = 1_000_000;
    let mut tensors = BTreeMap::new();
    let mut left = parameters;
    let mut index = 0;
    while left > 0 {
        let len = left.min(CHUNK);
        let tensor = Tensor {
            shape: vec![len],
            values: vec![value; len],
            dtype: Dtype::F32,
        };
        tensors.insert(format!("layer{index:04}.weight"), tensor);
        left -= len;
        index += 1;
    }
    Tensors(tensors)
}

/// Copies `bytes` into a second buffer, best of five, in GB/s.
fn memcpy_gb_per_s(bytes: &[u8]) -> f64 {
    let mut target = vec![0u8; bytes.len()];
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let started = Instant::now();
        target.copy_from_slice(bytes);
        std::hint::black_box(&target);
        best = best.min(started.elapsed().as_secs_f64());
    }
    bytes.len() as f64 / best / 1e9
}

/// Runs a parameter server through rounds of `updates` updates in a child process; its peak
/// RSS in MB and the milliseconds its last round took to close.
fn server_peak_rss_mb(dir: &Path, updates: usize, codec: Codec) -> anyhow::Result<(f64, f64)> {
    let output = std::process::Command::new(std::env::current_exe()?)
        .arg(CHILD_COMMAND)
        .arg(dir)
        .arg(updates.to_string())
        .arg(codec.name())
        .output()?;
    anyhow::ensure!(
        output.status.success(),
        "the parameter-server process failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let text = String::from_utf8(output.stdout)?;
    let numbers: Vec<f64> = text
        .split_whitespace()
        .map(str::parse)
        .collect::<Result<_, _>>()
        .with_context(|| format!("the parameter-server process printed {text:?}"))?;
    match numbers[..] {
        [rss, close_ms] => Ok((rss, close_ms)),
        _ => anyhow::bail!("the parameter-server process printed {text:?}"),
    }
}

/// The child: a parameter server adopts `dir/model.safetensors`, adds `updates` updates read
/// from their files as the worker's parameter server reads them, closes the round (writing
/// the change compressed with `codec` to a file, unless `none`), writes the whole model and
/// checkpoints; prints its peak RSS in MB.
pub(crate) fn child_main(args: &[String]) -> anyhow::Result<()> {
    let [dir, updates, codec] = args else {
        anyhow::bail!("usage: {CHILD_COMMAND} DIR UPDATES CODEC");
    };
    let dir = Path::new(dir);
    let updates: usize = updates.parse()?;
    // The codec as a job file names it, with its defaults.
    let compression: hypha_messages::diloco::Compression =
        serde_json::from_value(serde_json::json!({ "compression": codec }))?;
    let codec = Codec::try_from(compression).map_err(anyhow::Error::msg)?;
    let mut server = ParameterServer::new(OuterOptimizer::new(0.7, 0.9))
        .broadcast_changes(codec.for_broadcast());
    server.offer_from(&FileSource::open(&dir.join("model.safetensors"))?)?;
    // Three rounds: the first allocates momentum and residual, the later ones carry them.
    let mut close_s = 0.0;
    for round in 0..3 {
        for i in 0..updates {
            let update = FileSource::open(&dir.join(format!("update-{i}.safetensors")))?;
            server.add_from(&format!("trainer-{i}"), update, round, 64)?;
        }
        let started = Instant::now();
        server.close_to_file(&dir.join(format!("delta-{updates}-{}.safetensors", codec.name())))?;
        close_s = started.elapsed().as_secs_f64();
    }
    server.write_model(&dir.join(format!("model-{updates}.safetensors")), false)?;
    server.checkpoint(&dir.join(format!("checkpoint-{updates}.safetensors")))?;
    let status = std::fs::read_to_string("/proc/self/status")?;
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("no VmHWM in /proc/self/status")?;
    println!("{} {}", kb / 1000.0, close_s * 1e3);
    Ok(())
}
