//! `sites`: DiLoCo across sites behind NATs ([`hypha_testing::sites`]). A gateway on a public
//! host and three sites, each a LAN behind a router with a 50 Mbit/s uplink and downlink: site
//! A the data node and the scheduler, site B two trainers, site C the parameter server and a
//! trainer. Every node is configured as `init` writes it plus `gateway_addresses` (listening on
//! every interface, default `exclude_cidr`). Real processes of the release binaries, the
//! reference executor's MLP on `blobs`, the same job in six networks:
//!
//! - `cone`: every router a cone NAT (Linux MASQUERADE) with a stateful firewall;
//! - `symmetric`: site B's router gives every connection a port of its own
//!   (`--random-fully`), the others cone;
//! - `shared_port`: as `cone`, but every node listens on port 4001, so the two machines of a
//!   site share their router's public ports;
//! - `carrier_grade`: site B behind two NATs in a row (a home router behind its ISP's
//!   carrier-grade NAT), the others cone;
//! - `ideal`: the same LANs and links without NAT, on public addresses: what the links allow
//!   for the job's traffic, the yardstick of the others;
//! - `loopback`: every node on 127.0.0.1, no testbed: the yardstick of the start.
//!
//! Measured per network: the job's wall time (scheduler start to its `done` event: discovery,
//! leases, the first round and every round after); the start's steps from the scheduler's
//! events (`discovery_s` to `data_ready`, `allocation_s` from there to the last lease,
//! `model_s` from the last dispatch to `rounds_begin`, when every trainer holds the first
//! model, and `start_s` from the scheduler's start to `rounds_begin`); the median time between
//! applied rounds; the bytes the gateway received against those the sites sent (what went
//! through the relay); how each node reaches each peer at the end (`hypha-gateway probe` from
//! a LAN neighbour: cross-site pairs with a direct or hole-punched connection against all
//! connected cross-site pairs); and from the nodes' logs how long a peer was reached only
//! through the relay before a direct connection replaced it. A variant whose job fails is
//! reported (`shared_port_trains`, `carrier_grade_trains`: 0), not fatal.
//!
//! Needs root (network namespaces, `tc`, `iptables`); without, the suite says so and reports
//! nothing. Targets (PRODUCT.md): `direct_pairs_cone` and `direct_pairs_shared_port` ≥ 0.9,
//! `relayed_bytes_share_cone` ≤ 0.05, `job_s_sites_vs_ideal` ≤ 1.2, `start_s` ≤ 20,
//! `discovery_s` ≤ 2, `allocation_s` ≤ 2 (the cone network's; `ideal` must meet the same),
//! `start_s_sites_vs_loopback` ≤ 3.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::bail;
use hypha_testing::{
    cluster::{Cluster, Place, Proc, diloco_job_text, events, of_kind},
    sites::{Nat, Site, Sites, probe, start_three_site_layout, start_three_site_nodes},
};

use crate::{Report, median};

/// Every site's uplink and downlink.
const MBIT: u32 = 50;
/// The MLP's hidden width: about 1.1 M parameters, 4.4 MB an update in f32, so that the
/// model's traffic, not the control plane's, fills the links.
const HIDDEN: usize = 1024;
/// The longest one network's job may take.
const PATIENCE: Duration = Duration::from_secs(600);
/// The port every node listens on in the shared-port network (IPFS's).
const SHARED_PORT: u16 = 4001;

/// One network the job runs in.
struct Network {
    name: &'static str,
    /// Each site's NAT (A, B, C); `None`: every node on loopback, no testbed.
    nats: Option<[Nat; 3]>,
    /// The port every node listens on (0: each a free one).
    port: u16,
}

const NETWORKS: [Network; 6] = [
    Network {
        name: "cone",
        nats: Some([Nat::Cone, Nat::Cone, Nat::Cone]),
        port: 0,
    },
    Network {
        name: "symmetric",
        nats: Some([Nat::Cone, Nat::Symmetric, Nat::Cone]),
        port: 0,
    },
    Network {
        name: "shared_port",
        nats: Some([Nat::Cone, Nat::Cone, Nat::Cone]),
        port: SHARED_PORT,
    },
    Network {
        name: "carrier_grade",
        nats: Some([Nat::Cone, Nat::CarrierGrade, Nat::Cone]),
        port: 0,
    },
    Network {
        name: "ideal",
        nats: Some([Nat::None, Nat::None, Nat::None]),
        port: 0,
    },
    Network {
        name: "loopback",
        nats: None,
        port: 0,
    },
];

/// What one network measured.
#[derive(Debug, Default)]
struct Measured {
    job_s: f64,
    round_s: f64,
    start: Start,
    gateway_received: u64,
    sites_sent: u64,
    /// Connected cross-site pairs, and those with a direct (or hole-punched) connection.
    pairs: usize,
    direct_pairs: usize,
    /// Each relayed-then-direct peer's time on the relay, in seconds.
    to_direct_s: Vec<f64>,
}

/// The start's steps, in seconds, from the scheduler's events.
#[derive(Debug, Default)]
struct Start {
    /// Scheduler started → the dataset's nodes answered (`data_ready`).
    discovery_s: f64,
    /// → every slot leased (the last `leased` before the first round).
    allocation_s: f64,
    /// The last dispatch before the first round → the first round begins: the trainers hold
    /// the first model (`rounds_begin`).
    model_s: f64,
    /// Scheduler started → the first round begins.
    start_s: f64,
}

pub(crate) async fn run(quick: bool) -> anyhow::Result<Report> {
    // Starting and watching processes blocks: off the runtime's threads.
    tokio::task::spawn_blocking(move || measure(quick)).await?
}

fn measure(quick: bool) -> anyhow::Result<Report> {
    let epochs = if quick { 2 } else { 4 };
    let mut report = Report::default();
    report.metrics.insert("link_mbit".into(), f64::from(MBIT));
    let mut results = std::collections::BTreeMap::new();
    for network in &NETWORKS {
        let name = network.name;
        let measured = match network.nats {
            Some(nats) => {
                let sites = nats.map(|nat| Site { nat, nodes: 2 });
                let sites = match Sites::new("hyb", &sites, MBIT) {
                    Ok(sites) => sites.with_port(network.port),
                    Err(why) => {
                        eprintln!(
                            "sites: skipped: the suite needs root for network namespaces, tc and iptables ({why}); no ratios"
                        );
                        return Ok(Report::default());
                    }
                };
                let mut cluster = Cluster::at(sites.gateway());
                let nodes = start_three_site_nodes(&mut cluster, &sites);
                run_network(cluster, nodes, Some(&sites), epochs)
            }
            None => {
                let mut cluster = Cluster::new();
                let nodes = start_three_site_layout(&mut cluster, &|_, _| Place::loopback());
                run_network(cluster, nodes, None, epochs)
            }
        };
        let measured = match measured {
            Ok(measured) => measured,
            // The variants report whether they train; the yardsticks must.
            Err(why) if matches!(name, "shared_port" | "carrier_grade") => {
                eprintln!("sites: {name}: the job did not train: {why:#}");
                report.metrics.insert(format!("{name}_trains"), 0.0);
                continue;
            }
            Err(why) => bail!("{name}: {why:#}"),
        };
        eprintln!("sites: {name}: {measured:?}");
        let metrics = &mut report.metrics;
        metrics.insert(format!("{name}_trains"), 1.0);
        metrics.insert(format!("job_s_{name}"), measured.job_s);
        metrics.insert(format!("round_s_{name}"), measured.round_s);
        let start = &measured.start;
        metrics.insert(format!("start_s_{name}"), start.start_s);
        metrics.insert(format!("discovery_s_{name}"), start.discovery_s);
        metrics.insert(format!("allocation_s_{name}"), start.allocation_s);
        metrics.insert(format!("model_s_{name}"), start.model_s);
        if network.nats.is_some() {
            metrics.insert(
                format!("gateway_received_mb_{name}"),
                measured.gateway_received as f64 / 1e6,
            );
            metrics.insert(
                format!("sites_sent_mb_{name}"),
                measured.sites_sent as f64 / 1e6,
            );
            metrics.insert(format!("cross_site_pairs_{name}"), measured.pairs as f64);
            metrics.insert(format!("direct_pairs_{name}"), measured.direct_pairs as f64);
        }
        results.insert(name, measured);
    }
    let (Some(cone), Some(symmetric), Some(ideal), Some(loopback)) = (
        results.get("cone"),
        results.get("symmetric"),
        results.get("ideal"),
        results.get("loopback"),
    ) else {
        bail!("the yardsticks measured");
    };
    for (key, value) in [
        ("start_s", cone.start.start_s),
        ("discovery_s", cone.start.discovery_s),
        ("allocation_s", cone.start.allocation_s),
        ("model_s", cone.start.model_s),
    ] {
        report.metrics.insert(key.into(), value);
    }
    let share = |m: &Measured| m.gateway_received as f64 / m.sites_sent.max(1) as f64;
    let direct = |m: &Measured| m.direct_pairs as f64 / m.pairs.max(1) as f64;
    let ratios = &mut report.ratios;
    ratios.insert("direct_pairs_cone".into(), direct(cone));
    ratios.insert("relayed_bytes_share_cone".into(), share(cone));
    ratios.insert("relayed_bytes_share_symmetric".into(), share(symmetric));
    if let Some(shared) = results.get("shared_port") {
        ratios.insert("direct_pairs_shared_port".into(), direct(shared));
        ratios.insert("relayed_bytes_share_shared_port".into(), share(shared));
    }
    if let Some(carrier_grade) = results.get("carrier_grade") {
        ratios.insert(
            "relayed_bytes_share_carrier_grade".into(),
            share(carrier_grade),
        );
    }
    ratios.insert(
        "round_s_sites_vs_ideal".into(),
        cone.round_s / ideal.round_s,
    );
    ratios.insert("job_s_sites_vs_ideal".into(), cone.job_s / ideal.job_s);
    ratios.insert(
        "start_s_sites_vs_loopback".into(),
        cone.start.start_s / loopback.start.start_s,
    );
    if !cone.to_direct_s.is_empty() {
        report
            .metrics
            .insert("time_to_direct_s".into(), median(cone.to_direct_s.clone()));
    }
    Ok(report)
}

/// Runs the job with `nodes` started in `cluster`, on `sites` (or loopback), and measures it.
fn run_network(
    mut cluster: Cluster,
    mut nodes: Vec<(Proc, Place)>,
    sites: Option<&Sites>,
    epochs: u32,
) -> anyhow::Result<Measured> {
    // Lease renewals cross the uplinks too: long leases, as in production.
    cluster.worker_lease_ms = Some(60_000);
    let job = cluster.job(
        "sites",
        &diloco_job_text(3, epochs, HIDDEN, "round_seconds = 60\n"),
    );
    let gateway_before = sites.map_or(0, |s| s.gateway_bytes().1);
    let site_count = sites.map_or(0, |s| s.count());
    let sites_sent =
        || -> u64 { sites.map_or(0, |s| (0..site_count).map(|k| s.site_bytes(k).0).sum()) };
    let sent_before = sites_sent();
    let started = Instant::now();
    let started_ms = SystemTime::now().duration_since(UNIX_EPOCH)?.as_millis() as f64;
    let (mut scheduler, events_path) = cluster.scheduler("scheduler", &job);
    let job_s = loop {
        let all = events(&events_path);
        if let Some(done) = of_kind(&all, "done").last() {
            if done["event"]["ok"] != true {
                bail!("the job failed: {}", done["event"]);
            }
            break started.elapsed().as_secs_f64();
        }
        if started.elapsed() >= PATIENCE {
            bail!("not done within {PATIENCE:?}");
        }
        if let Ok(Some(status)) = scheduler.child.try_wait() {
            bail!("the scheduler exited with {status}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let gateway_received = sites.map_or(0, |s| s.gateway_bytes().1) - gateway_before;
    let sites_sent = sites_sent() - sent_before;
    let start = start_of(&events(&events_path), started_ms)?;

    let rounds: Vec<f64> = events(&cluster.path("sites-job.metrics.jsonl"))
        .iter()
        .filter(|m| m["kind"] == "round")
        .filter_map(|m| m["time_ms"].as_f64())
        .collect();
    let intervals: Vec<f64> = rounds.windows(2).map(|w| (w[1] - w[0]) / 1000.0).collect();
    if intervals.is_empty() {
        bail!("fewer than two rounds applied");
    }
    let round_s = median(intervals);

    let (pairs, direct_pairs) = match sites {
        Some(sites) => cross_site_paths(&cluster, sites, &mut nodes),
        None => (0, 0),
    };
    let _ = scheduler.wait(Duration::from_secs(30));
    let mut to_direct_s = Vec::new();
    for line in nodes
        .iter_mut()
        .flat_map(|(proc, _)| {
            while let Ok(line) = proc.lines.try_recv() {
                proc.seen.push(line);
            }
            proc.seen.clone()
        })
        .chain(scheduler.seen.clone())
        .filter(|l| l.contains("a direct connection replaces the relayed one"))
    {
        if let Some(ms) = line
            .split("after_ms=")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|ms| ms.parse::<f64>().ok())
        {
            to_direct_s.push(ms / 1000.0);
        }
    }
    Ok(Measured {
        job_s,
        round_s,
        start,
        gateway_received,
        sites_sent,
        pairs,
        direct_pairs,
        to_direct_s,
    })
}

/// The start's steps from the scheduler's `events` (each stamped `time_ms`), the scheduler
/// started at `started_ms`.
fn start_of(events: &[serde_json::Value], started_ms: f64) -> anyhow::Result<Start> {
    let at = |kind: &str| -> Vec<f64> {
        events
            .iter()
            .filter(|e| e["event"]["kind"] == kind)
            .filter_map(|e| e["time_ms"].as_f64())
            .collect()
    };
    let (Some(ready), Some(begin)) = (
        at("data_ready").first().copied(),
        at("rounds_begin").first().copied(),
    ) else {
        bail!("no data_ready or rounds_begin event");
    };
    let before_begin = |kind: &str| {
        at(kind)
            .into_iter()
            .filter(|t| *t <= begin)
            .fold(ready, f64::max)
    };
    let leased = before_begin("leased");
    let dispatched = before_begin("dispatched");
    Ok(Start {
        discovery_s: (ready - started_ms) / 1000.0,
        allocation_s: (leased - ready) / 1000.0,
        model_s: (begin - dispatched) / 1000.0,
        start_s: (begin - started_ms) / 1000.0,
    })
}

/// Probes every node from a LAN neighbour; returns the connected pairs of nodes at different
/// sites, and how many of them have a direct (or hole-punched) connection.
fn cross_site_paths(
    cluster: &Cluster,
    sites: &Sites,
    nodes: &mut [(Proc, Place)],
) -> (usize, usize) {
    let site_of = |place: &Place| -> Option<usize> {
        (0..3).find(|k| (0..2).any(|j| sites.node(*k, j).ip == place.ip))
    };
    let neighbour = |place: &Place| -> Place {
        let k = site_of(place).unwrap_or(0);
        let other = (0..2).map(|j| sites.node(k, j)).find(|p| p.ip != place.ip);
        other.unwrap_or_else(|| place.clone())
    };
    let ids: Vec<(String, Option<usize>)> = nodes
        .iter()
        .map(|(proc, place)| (cluster.peer_id(&proc.name), site_of(place)))
        .collect();
    let mut seen = std::collections::BTreeMap::<(String, String), bool>::new();
    for (proc, place) in nodes.iter_mut() {
        let from = neighbour(place);
        let probed = probe(cluster, proc, place, &from);
        let me = cluster.peer_id(&proc.name);
        let my_site = site_of(place);
        for (peer, path) in &probed.paths {
            let Some((_, their_site)) = ids.iter().find(|(id, _)| id == peer) else {
                continue;
            };
            if *their_site == my_site {
                continue;
            }
            let key = if me < *peer {
                (me.clone(), peer.clone())
            } else {
                (peer.clone(), me.clone())
            };
            let direct = path != "relayed";
            seen.entry(key)
                .and_modify(|d| *d = *d && direct)
                .or_insert(direct);
        }
    }
    (seen.len(), seen.values().filter(|d| **d).count())
}
