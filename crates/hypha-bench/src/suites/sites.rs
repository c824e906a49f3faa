//! `sites`: DiLoCo across sites behind NATs ([`hypha_testing::sites`]). A gateway on a public
//! host and three sites, each a LAN behind a router with a 50 Mbit/s uplink and downlink: site
//! A the data node and the scheduler, site B two trainers, site C the parameter server and a
//! trainer. Every node is configured as `init` writes it plus `gateway_addresses` (listening on
//! every interface, default `exclude_cidr`). Real processes of the release binaries, the
//! reference executor's MLP on `blobs`, the same job in three networks:
//!
//! - `cone`: every router a cone NAT (Linux MASQUERADE) with a stateful firewall;
//! - `symmetric`: site B's router gives every connection a port of its own
//!   (`--random-fully`), the others cone;
//! - `ideal`: the same LANs and links without NAT, on public addresses: what the links allow
//!   for the job's traffic, the yardstick of the other two.
//!
//! Measured per network: the job's wall time (scheduler start to its `done` event: discovery,
//! leases, the first round and every round after), the median time between applied rounds,
//! the bytes the gateway received against those the sites sent (what went through the relay),
//! how each node reaches each peer at the end (`hypha-gateway probe` from a LAN neighbour:
//! cross-site pairs with a direct or hole-punched connection against all connected cross-site
//! pairs), and from the nodes' logs how long a peer was reached only through the relay before a
//! direct connection replaced it.
//!
//! Needs root (network namespaces, `tc`, `iptables`); without, the suite says so and reports
//! nothing. Targets (issue 35): `direct_pairs_cone` ≥ 0.9, `relayed_bytes_share_cone` ≤ 0.1,
//! `round_s_sites_vs_ideal` ≤ 1.2, `job_s_sites_vs_ideal` ≤ 1.5.

use std::time::{Duration, Instant};

use anyhow::bail;
use hypha_testing::{
    cluster::{Cluster, Place, Proc, diloco_job_text, events, of_kind},
    sites::{Nat, Site, Sites, probe, start_three_site_nodes},
};

use crate::{Report, median};

/// Every site's uplink and downlink.
const MBIT: u32 = 50;
/// The MLP's hidden width: about 1.1 M parameters, 4.4 MB an update in f32, so that the
/// model's traffic, not the control plane's, fills the links.
const HIDDEN: usize = 1024;
/// The longest one network's job may take.
const PATIENCE: Duration = Duration::from_secs(600);

/// What one network measured.
#[derive(Debug)]
struct Measured {
    job_s: f64,
    round_s: f64,
    gateway_received: u64,
    sites_sent: u64,
    /// Connected cross-site pairs, and those with a direct (or hole-punched) connection.
    pairs: usize,
    direct_pairs: usize,
    /// Each relayed-then-direct peer's time on the relay, in seconds.
    to_direct_s: Vec<f64>,
}

pub(crate) async fn run(quick: bool) -> anyhow::Result<Report> {
    // Starting and watching processes blocks: off the runtime's threads.
    tokio::task::spawn_blocking(move || measure(quick)).await?
}

fn measure(quick: bool) -> anyhow::Result<Report> {
    let epochs = if quick { 2 } else { 4 };
    let mut report = Report::default();
    report.metrics.insert("link_mbit".into(), f64::from(MBIT));
    let mut results = Vec::new();
    for (name, nat_of_b, nat) in [
        ("cone", Nat::Cone, Nat::Cone),
        ("symmetric", Nat::Symmetric, Nat::Cone),
        ("ideal", Nat::None, Nat::None),
    ] {
        let sites = [
            Site { nat, nodes: 2 },
            Site {
                nat: nat_of_b,
                nodes: 2,
            },
            Site { nat, nodes: 2 },
        ];
        let sites = match Sites::new("hyb", &sites, MBIT) {
            Ok(sites) => sites,
            Err(why) => {
                eprintln!(
                    "sites: skipped: the suite needs root for network namespaces, tc and iptables ({why}); no ratios"
                );
                return Ok(Report::default());
            }
        };
        let measured = run_network(&sites, epochs)?;
        eprintln!("sites: {name}: {measured:?}");
        let metrics = &mut report.metrics;
        metrics.insert(format!("job_s_{name}"), measured.job_s);
        metrics.insert(format!("round_s_{name}"), measured.round_s);
        metrics.insert(
            format!("gateway_received_mb_{name}"),
            measured.gateway_received as f64 / 1e6,
        );
        metrics.insert(
            format!("sites_sent_mb_{name}"),
            measured.sites_sent as f64 / 1e6,
        );
        metrics.insert(format!("cross_site_pairs_{name}"), measured.pairs as f64);
        results.push(measured);
    }
    let [cone, symmetric, ideal] = &results[..] else {
        bail!("three networks measured");
    };
    let share = |m: &Measured| m.gateway_received as f64 / m.sites_sent.max(1) as f64;
    let ratios = &mut report.ratios;
    ratios.insert(
        "direct_pairs_cone".into(),
        cone.direct_pairs as f64 / cone.pairs.max(1) as f64,
    );
    ratios.insert("relayed_bytes_share_cone".into(), share(cone));
    ratios.insert("relayed_bytes_share_symmetric".into(), share(symmetric));
    ratios.insert(
        "round_s_sites_vs_ideal".into(),
        cone.round_s / ideal.round_s,
    );
    ratios.insert("job_s_sites_vs_ideal".into(), cone.job_s / ideal.job_s);
    if !cone.to_direct_s.is_empty() {
        report
            .metrics
            .insert("time_to_direct_s".into(), median(cone.to_direct_s.clone()));
    }
    Ok(report)
}

/// Runs the job on `sites` and measures it.
fn run_network(sites: &Sites, epochs: u32) -> anyhow::Result<Measured> {
    let mut cluster = Cluster::at(sites.gateway());
    // Lease renewals cross the uplinks too: long leases, as in production.
    cluster.worker_lease_ms = Some(60_000);
    let mut nodes = start_three_site_nodes(&mut cluster, sites);
    let job = cluster.job(
        "sites",
        &diloco_job_text(3, epochs, HIDDEN, "round_seconds = 60\n"),
    );
    let gateway_before = sites.gateway_bytes().1;
    let sent_before: u64 = (0..3).map(|k| sites.site_bytes(k).0).sum();
    let started = Instant::now();
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
    let gateway_received = sites.gateway_bytes().1 - gateway_before;
    let sites_sent = (0..3).map(|k| sites.site_bytes(k).0).sum::<u64>() - sent_before;

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

    let (pairs, direct_pairs) = cross_site_paths(&cluster, sites, &mut nodes);
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
        gateway_received,
        sites_sent,
        pairs,
        direct_pairs,
        to_direct_s,
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
