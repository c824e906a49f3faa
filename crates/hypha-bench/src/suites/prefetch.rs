//! `prefetch`: the share of an executor's time spent waiting for data when it consumes slower
//! than the network delivers.
//!
//! Three nodes in this process over loopback TCP with real certificates: a data node (the
//! `hypha-data run` code) serving Snappy slices, a scheduler's iteration service (the ledger
//! and `hypha_data::iteration::IterationService`, as `hypha-scheduler run` answers workers)
//! and a worker's [`Prefetcher`] with its slice cache (the code behind the job bridge's
//! `Scheduler` reference). A simulated executor takes each slice as the bridge hands it over
//! (waiting for the prefetcher, then moving the staged plain file into its directory),
//! "trains" on it for a fixed time, and reports it consumed and its round completed without waiting for the
//! answer, as an executor would over `/data/consumed`.
//!
//! `wait_fraction` is the time spent taking slices over the executor's whole time, from its
//! second slice on: the first slice cannot have been fetched ahead and is reported apart as
//! `first_slice_wait_s`. The network's own pace is measured in the same run
//! (`network_slices_per_s`: the same prefetcher drained by an executor that never trains),
//! so `ratios.consume_vs_network` shows how much slower than the network the executor is.

use std::{
    collections::{HashMap, HashSet},
    path::Path,
    sync::Arc,
    time::{Duration, Instant},
};

use hypha_data::iteration::{IterationService, SliceSource, spec_of};
use hypha_dataset::slice::{Dtype, Encoding, Tensors, encode};
use hypha_ledger::{Ledger, LedgerHandle};
use hypha_messages::{Request, Response, iterate::IterateRequest};
use hypha_network::{InboundRequest, Network, PeerId};
use hypha_worker::slices::{Next, Prefetcher, SliceCache, Source};
use tokio_util::sync::CancellationToken;

use super::{allocation::start_node, ceilings::Pki};
use crate::Report;

/// The target of PRODUCT.md: at most 1 % of the executor's time waiting for data.
const TARGET_WAIT_FRACTION: f64 = 0.01;
const SLICE_BYTES: usize = 4 << 20;
const DATASET: &str = "prefetch";

pub(crate) async fn run(quick: bool) -> anyhow::Result<Report> {
    let slices = if quick { 60 } else { 200 };
    let train = Duration::from_millis(40);
    let pki = Pki::new()?;
    let tmp = tempfile::tempdir()?;
    let dataset = tmp.path().join(DATASET);
    write_dataset(&dataset, slices)?;
    let stop = CancellationToken::new();

    let (data, data_inbound) = start_node(&pki, "data", None).await?;
    let catalog = Arc::new(std::sync::RwLock::new(hypha_data::Catalog::open(&dataset)?));
    // Detached: it ends with `stop`, cancelled as the suite ends.
    tokio::spawn(hypha_data::node::serve(
        data.clone(),
        data_inbound,
        catalog.clone(),
        hypha_data::node::Iterations::in_dir(tmp.path().join("iterations")),
        hypha_data::server::Limits::default(),
        hypha_data::node::REFRESH_INTERVAL,
        stop.clone().cancelled_owned(),
    ));
    let manifest = catalog
        .read()
        .map_err(|_| anyhow::anyhow!("catalog lock"))?
        .get(DATASET)
        .map(|d| d.manifest().clone())
        .ok_or_else(|| anyhow::anyhow!("the data node does not serve the dataset"))?;

    let (scheduler, scheduler_inbound) = start_node(&pki, "scheduler", None).await?;
    let (worker, _worker_inbound) = start_node(&pki, "worker", None).await?;
    for node in [&data, &scheduler] {
        let address = node
            .listen_addresses()
            .await?
            .into_iter()
            .next()
            .ok_or_else(|| anyhow::anyhow!("no listen address"))?;
        worker.dial(address).await?;
    }

    // Two iterations over the same data: one drained as fast as possible (the network's
    // pace), one by the slow executor. Each worker run gets a fresh cache, so both fetch.
    let services = iterations(tmp.path(), &manifest, data.local_peer_id())?;
    let answering = tokio::spawn(answer(scheduler_inbound, services));

    let mut report = Report::default();
    let mut rates = Vec::new();
    for (round, train) in [(0, Duration::ZERO), (1, train)] {
        let cache = Arc::new(SliceCache::open(
            tmp.path().join(format!("cache-{round}")),
            1 << 40,
        )?);
        let source = Source {
            scheduler: scheduler.local_peer_id(),
            dataset: DATASET.into(),
            iteration: format!("run-{round}"),
            consumer: "bench".into(),
            epochs: 0,
            seed: 0,
        };
        let out = tmp.path().join(format!("job-{round}"));
        let outcome = consume(
            &worker,
            cache,
            source,
            scheduler.local_peer_id(),
            train,
            &out,
        )
        .await?;
        anyhow::ensure!(
            outcome.slices == slices,
            "took {} of {slices} slices",
            outcome.slices
        );
        rates.push(outcome.slices as f64 / outcome.total.as_secs_f64());
        if round == 1 {
            let steady = outcome.total - outcome.first_wait;
            let waited = outcome.waited - outcome.first_wait;
            report.metrics.insert(
                "wait_fraction".into(),
                waited.as_secs_f64() / steady.as_secs_f64(),
            );
            report.metrics.insert(
                "first_slice_wait_s".into(),
                outcome.first_wait.as_secs_f64(),
            );
            report.metrics.insert(
                "mean_take_ms".into(),
                waited.as_secs_f64() * 1e3 / (slices - 1) as f64,
            );
        }
    }
    answering.abort();
    stop.cancel();
    report
        .metrics
        .insert("network_slices_per_s".into(), rates[0]);
    report
        .metrics
        .insert("executor_slices_per_s".into(), rates[1]);
    report
        .metrics
        .insert("slice_mb".into(), SLICE_BYTES as f64 / 1e6);
    report
        .metrics
        .insert("train_ms".into(), train.as_secs_f64() * 1e3);
    report
        .ratios
        .insert("consume_vs_network".into(), rates[1] / rates[0]);
    report.ratios.insert(
        "wait_over_target".into(),
        report.metrics["wait_fraction"] / TARGET_WAIT_FRACTION,
    );
    Ok(report)
}

/// Two iterations over the same data, `run-0` and `run-1`, their ledgers in `dir`, every
/// slice held by `data_node`.
fn iterations(
    dir: &Path,
    manifest: &hypha_dataset::Manifest,
    data_node: PeerId,
) -> anyhow::Result<HashMap<String, IterationService>> {
    let mut services = HashMap::new();
    for round in 0..2 {
        let iteration = format!("run-{round}");
        let ledger = Ledger::create(
            &dir.join(format!("{iteration}.ledger")),
            spec_of(manifest, 1, 1),
            60_000,
        )?;
        let (handle, _task) = LedgerHandle::spawn(ledger);
        let sources = SliceSource::all_held_by(manifest, data_node);
        services.insert(
            iteration.clone(),
            IterationService::new(iteration, handle, sources, false),
        );
    }
    Ok(services)
}

/// Answers iterate requests from the iteration services, as a scheduler does.
async fn answer(
    mut inbound: tokio::sync::mpsc::Receiver<InboundRequest>,
    services: HashMap<String, IterationService>,
) {
    while let Some(request) = inbound.recv().await {
        let Request::Iterate(iterate) = &request.request else {
            continue;
        };
        let Some(service) = services.get(&iterate.iteration).cloned() else {
            continue;
        };
        // Detached: one answer, ended by the request's own time-outs.
        tokio::spawn(async move {
            let Request::Iterate(iterate) = &request.request else {
                return;
            };
            let response = service
                .iterate(&request.peer, iterate)
                .await
                .map_or_else(Response::Error, Response::Iterate);
            let _ = request.responder.respond(response).await;
        });
    }
}

struct Outcome {
    slices: usize,
    total: Duration,
    waited: Duration,
    first_wait: Duration,
}

/// The simulated executor: takes every slice into its directory as the bridge does, trains
/// `train` on each, acknowledges it.
async fn consume(
    worker: &Network,
    cache: Arc<SliceCache>,
    source: Source,
    scheduler: PeerId,
    train: Duration,
    out: &Path,
) -> anyhow::Result<Outcome> {
    std::fs::create_dir_all(out)?;
    let out_fd = std::fs::File::open(out)?;
    let out_fd = std::os::fd::OwnedFd::from(out_fd);
    let holding = hypha_worker::slices::Holding::default();
    let mut prefetcher = Prefetcher::start(
        worker.clone(),
        cache,
        source.clone(),
        1 << 30,
        holding.clone(),
    )?;
    let started = Instant::now();
    let (mut waited, mut first_wait, mut slices) = (Duration::ZERO, None, 0);
    let mut seen = HashSet::new();
    loop {
        let asked = Instant::now();
        let ready = match prefetcher.next().await {
            Next::Slice(ready) => ready,
            Next::Finished => break,
            Next::Failed(why) => anyhow::bail!("{why}"),
        };
        let key = ready.slice.key();
        let name = format!("e{}-slice-{}.safetensors", key.epoch, key.slice);
        let size = ready.size;
        ready.place(&out_fd, std::ffi::OsStr::new(&name))?;
        let took = asked.elapsed();
        waited += took;
        first_wait.get_or_insert(took);
        anyhow::ensure!(size > SLICE_BYTES as u64, "a slice decoded short");
        anyhow::ensure!(seen.insert(key), "slice {} twice", key.slice);
        slices += 1;
        tokio::time::sleep(train).await;
        std::fs::remove_file(out.join(&name))?;
        let report = IterateRequest {
            iteration: source.iteration.clone(),
            dataset: source.dataset.clone(),
            consumer: source.consumer.clone(),
            epochs: 0,
            seed: 0,
            want: 0,
            cached: Vec::new(),
            consumed: vec![key],
            round: slices as u64,
            completed_round: Some(slices as u64),
            holding: None,
            share_with: Vec::new(),
        };
        // Reported as the bridge reports it: no longer held.
        holding.let_go(&[key]);
        let worker = worker.clone();
        tokio::spawn(async move { worker.request(scheduler, Request::Iterate(report)).await });
    }
    Ok(Outcome {
        slices,
        total: started.elapsed(),
        waited,
        first_wait: first_wait.unwrap_or_default(),
    })
}

/// `count` Snappy slices of a little over [`SLICE_BYTES`] of poorly compressible bytes.
fn write_dataset(dir: &Path, count: usize) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    for i in 0..count {
        let data: Vec<u8> = (0..SLICE_BYTES)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state as u8
            })
            .collect();
        let tensors = Tensors::new().with("x", Dtype::U8, vec![SLICE_BYTES], data)?;
        std::fs::write(
            dir.join(format!("slice-{i}.safetensors")),
            encode(&tensors, Encoding::Snappy)?,
        )?;
    }
    hypha_dataset::Dataset::derive(dir)?.write_manifest()?;
    Ok(())
}
