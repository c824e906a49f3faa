//! `allocation`: time from a scheduler's first advertisement to N leased and dispatched
//! workers, N = 4, 16 and 64, every node in this process over loopback TCP.
//!
//! The network is what a deployment has: one gateway (the `hypha-gateway` code, relaying the
//! market topic), N workers (the `hypha-worker` code, `whole` strategy, prices 10, 11, … so
//! the choice is real, an executor that is `true`) and a scheduler running a job of N workers
//! with `hypha_scheduler::run::run_job`, the code of `hypha-scheduler run`. Each round starts
//! a fresh scheduler and lets its connection to the gateway settle (not timed); the clock
//! starts when `run_job` is called and stops at its N-th `dispatched` event, with the N-th
//! `leased` event noted on the way. The round then runs to the job's end (every executor
//! exited, every lease released), so the next round finds all workers free.
//!
//! The floor of any round is the allocator's collection window (200 ms; the workers' 50 ms
//! window runs inside it); `window_share_nN` says how much of the median it is. p95 is the
//! nearest-rank percentile, which over this few rounds is close to the slowest.
//!
//! Each N is measured twice: on a quiet machine, then with [`BUSY_PROCESSES`] CPU-bound
//! processes beside (`loaded_*` keys): a scheduler's machine is rarely idle, and a control
//! plane that only meets its targets alone does not meet them.

use std::{path::Path, sync::Arc, time::Duration};

use anyhow::Context;
use hypha_messages::market::{ExecutorRef, Resources};
use hypha_network::{Network, Settings};
use hypha_scheduler::{
    allocator::{self, Allocator},
    run::{Event, EventLog, run_job},
    spec::JobFile,
};
use hypha_worker::{
    arbiter::{Pricing, Strategy},
    config::{Executor, Runtime, WorkerConfig},
};
use libp2p::Multiaddr;
use tokio::{sync::mpsc, time::Instant};
use tokio_util::sync::CancellationToken;

use super::ceilings::Pki;
use crate::{Report, median};

/// The workers' `[offer] window_ms`.
const WORKER_WINDOW: Duration = Duration::from_millis(50);
/// How long new workers get to join before the rounds: the time is steady-state allocation,
/// not joining. Workers that joined a second or two earlier are still answering the stale
/// advertisements gossip replays to newcomers (see BENCHMARKS.md).
const SETTLE: Duration = Duration::from_secs(6);
/// The target of PRODUCT.md: p50 ≤ 0.5 s.
const TARGET_P50_S: f64 = 0.5;
/// How many CPU-bound processes run beside the loaded measurements: as many as this
/// machine's cores, the two the suite was asked to be measured beside.
const BUSY_PROCESSES: usize = 2;
/// The child command of a CPU-bound process (`hypha-bench __spin`): spins until killed.
pub(crate) const SPIN_COMMAND: &str = "__spin";

/// `hypha-bench __spin`: spins on one core until killed.
pub(crate) fn spin_main() -> ! {
    let mut x: u64 = 1;
    loop {
        x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
    }
}

pub(crate) async fn run(quick: bool) -> anyhow::Result<Report> {
    let rounds = |n: usize| match (quick, n) {
        (true, 64) => 2,
        (true, _) => 3,
        (false, 64) => 5,
        (false, _) => 10,
    };
    let pki = Arc::new(Pki::new()?);
    let tmp = tempfile::tempdir()?;
    let stop = CancellationToken::new();
    let (gateway, _gateway_inbound) = start_node(&pki, "gateway", None).await?;
    let gateway_address = dial_address(&gateway).await?;
    // Detached: the gateway ends with `stop`, cancelled as the suite ends.
    tokio::spawn({
        let gateway = gateway.clone();
        let stop = stop.clone();
        async move { hypha_gateway::serve(&gateway, stop.cancelled_owned()).await }
    });

    let mut report = Report::default();
    let mut workers = 0;
    for n in [4usize, 16, 64] {
        while workers < n {
            start_worker(&pki, workers, &gateway_address, tmp.path(), &stop).await?;
            workers += 1;
        }
        tokio::time::sleep(SETTLE).await;
        for loaded in [false, true] {
            let _busy = if loaded {
                busy_processes()?
            } else {
                Vec::new()
            };
            let mut dispatched = Vec::new();
            let mut leased = Vec::new();
            for round in 0..rounds(n) {
                let name = format!(
                    "scheduler-{n}-{round}{}",
                    if loaded { "-loaded" } else { "" }
                );
                let (to_lease, to_dispatch) =
                    allocate_once(&pki, n, &name, &gateway_address).await?;
                leased.push(to_lease.as_secs_f64());
                dispatched.push(to_dispatch.as_secs_f64());
            }
            let key = |name: &str| match loaded {
                false => format!("{name}_n{n}"),
                true => format!("loaded_{name}_n{n}"),
            };
            let p50 = median(dispatched.clone());
            report.metrics.insert(key("p50_s"), p50);
            report
                .metrics
                .insert(key("p95_s"), nearest_rank(&dispatched, 0.95));
            report.metrics.insert(key("leased_p50_s"), median(leased));
            let window = allocator::Settings::default().window.as_secs_f64();
            report.ratios.insert(key("window_share"), window / p50);
            report
                .ratios
                .insert(key("p50_over_target"), p50 / TARGET_P50_S);
        }
    }
    stop.cancel();
    gateway.shutdown().await;
    Ok(report)
}

/// One scheduler, one job of `n` workers; returns the time to `n` leased and to `n`
/// dispatched.
async fn allocate_once(
    pki: &Pki,
    n: usize,
    name: &str,
    gateway: &Multiaddr,
) -> anyhow::Result<(Duration, Duration)> {
    let (network, inbound) = start_node(pki, name, Some(gateway)).await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let spec = JobFile::parse(
        "bench-job.toml",
        &format!(
            "workers = {n}\nbid = 100.0\n[executor]\nclass = \"bench\"\nname = \"true\"\n[resources]\ncpu = 1\nmemory = 1\n"
        ),
    )?;
    let (observer, mut events) = mpsc::channel(1024);
    let allocator = Allocator::new(network.clone(), allocator::Settings::default());
    let started = Instant::now();
    let job = tokio::spawn(run_job(
        network.clone(),
        inbound,
        allocator,
        spec,
        EventLog::console().observed_by(observer),
        std::future::pending(),
    ));
    let (mut leased, mut dispatched) = (0, 0);
    let mut to_lease = Duration::ZERO;
    let deadline = started + Duration::from_secs(60);
    while dispatched < n {
        let event = tokio::time::timeout_at(deadline, events.recv())
            .await
            .with_context(|| format!("{name}: only {dispatched} of {n} dispatched in 60 s"))?
            .with_context(|| format!("{name}: the job ended after {dispatched} of {n}"))?;
        match event {
            Event::Leased { .. } => {
                leased += 1;
                if leased == n {
                    to_lease = started.elapsed();
                }
            }
            Event::Dispatched { .. } => dispatched += 1,
            Event::Lost { reason, .. } => anyhow::bail!("{name}: a worker was lost: {reason}"),
            Event::Missed { missed } => {
                anyhow::bail!("{name}: this suite fell behind the events and missed {missed}")
            }
            _ => {}
        }
    }
    let to_dispatch = started.elapsed();
    tokio::time::timeout(Duration::from_secs(60), job)
        .await
        .with_context(|| format!("{name}: the job did not end"))???;
    network.shutdown().await;
    Ok((to_lease, to_dispatch))
}

async fn start_worker(
    pki: &Pki,
    index: usize,
    gateway: &Multiaddr,
    tmp: &Path,
    stop: &CancellationToken,
) -> anyhow::Result<()> {
    let (network, inbound) = start_node(pki, &format!("worker-{index}"), Some(gateway)).await?;
    let work_dir = tmp.join(format!("worker-{index}"));
    std::fs::create_dir_all(&work_dir)?;
    let config = WorkerConfig {
        artifacts: hypha_worker::config::ArtifactsConfig {
            dir: work_dir.join(".artifacts"),
            settings: hypha_artifacts::Settings::default(),
            profiles: Default::default(),
        },
        work_dir,
        capacity: Resources {
            cpu: 4.0,
            memory: 8.0,
            ..Resources::default()
        },
        pricing: Pricing {
            price: 10.0 + index as f64,
            floor: 0.0,
            strategy: Strategy::Whole,
        },
        window: WORKER_WINDOW,
        hold: Duration::from_secs(5),
        lease: Duration::from_secs(10),
        kill_grace: Duration::from_secs(1),
        executors: vec![Executor {
            executor: ExecutorRef {
                class: "bench".into(),
                name: "true".into(),
            },
            runtime: Runtime::Process {
                cmd: "true".into(),
                args: Vec::new(),
                env: Vec::new(),
            },
        }],
        prefetch_bytes: 1 << 30,
        slice_cache_bytes: 1 << 30,
        download_read_timeout: Duration::from_secs(60),
    };
    let cache = hypha_worker::slices::SliceCache::open(
        hypha_worker::slices::cache_dir(&config.work_dir),
        config.slice_cache_bytes,
    )?;
    let stop = stop.clone();
    let bridge = hypha_worker::bridge::Settings::from_env(config.download_read_timeout);
    // Detached: the worker ends with `stop`, cancelled as the suite ends.
    tokio::spawn(async move {
        hypha_worker::node::serve(
            network,
            inbound,
            config,
            bridge,
            std::sync::Arc::new(cache),
            stop.cancelled_owned(),
        )
        .await
    });
    Ok(())
}

/// A node on loopback; with a gateway it joins it, without it serves as one (relay server).
pub(crate) async fn start_node(
    pki: &Pki,
    name: &str,
    gateway: Option<&Multiaddr>,
) -> anyhow::Result<(Network, mpsc::Receiver<hypha_network::InboundRequest>)> {
    let mut settings = Settings::new(name);
    settings.listen_addresses = vec!["/ip4/127.0.0.1/tcp/0".parse()?];
    settings.gateway_addresses = gateway.into_iter().cloned().collect();
    settings.relay_circuit = false;
    settings.relay_server = gateway.is_none();
    Ok(hypha_network::start(settings, &pki.identity(name)?, pki.trust()?).await?)
}

/// The address others dial to reach `node`: its first listen address with its peer ID.
pub(crate) async fn dial_address(node: &Network) -> anyhow::Result<Multiaddr> {
    node.listen_addresses()
        .await?
        .into_iter()
        .next()
        .context("the node listens nowhere")?
        .with_p2p(node.local_peer_id())
        .map_err(|_| anyhow::anyhow!("the node's address takes no peer ID"))
}

/// [`BUSY_PROCESSES`] processes spinning on the CPU until the returned children are dropped.
fn busy_processes() -> anyhow::Result<Vec<tokio::process::Child>> {
    let exe = std::env::current_exe().context("cannot find hypha-bench's own executable")?;
    (0..BUSY_PROCESSES)
        .map(|_| {
            tokio::process::Command::new(&exe)
                .arg(SPIN_COMMAND)
                .kill_on_drop(true)
                .spawn()
                .with_context(|| format!("cannot start {} {SPIN_COMMAND}", exe.display()))
        })
        .collect()
}

/// The nearest-rank percentile `p` (0..=1) of `values`.
fn nearest_rank(values: &[f64], p: f64) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len().max(1));
    sorted.get(rank - 1).copied().unwrap_or(0.0)
}
