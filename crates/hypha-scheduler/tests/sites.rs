//! Training across sites behind NATs (`hypha_testing::sites`): a gateway on a public host,
//! and three sites that are private LANs behind NAT routers with 50 Mbit/s uplinks, each node
//! configured as `init` writes it plus `gateway_addresses`. Skipped, with a message, where
//! network namespaces cannot be made (not root, no iptables).

#![allow(clippy::unwrap_used)] // tests fail loudly by design

mod common;

use std::time::Duration;

use common::*;
use hypha_testing::sites::{Nat, Probed, Site, Sites, probe, start_three_site_nodes};

/// Site A: the data node and the scheduler; site B: two trainers; site C: the parameter
/// server and a trainer (the layout of issue 35).
fn three_sites(prefix: &str, nat_of_b: Nat) -> Option<Sites> {
    three_sites_on(prefix, nat_of_b, 0)
}

/// [`three_sites`] with every node listening on `port` (0: each a free one).
fn three_sites_on(prefix: &str, nat_of_b: Nat, port: u16) -> Option<Sites> {
    let sites = [
        Site {
            nat: Nat::Cone,
            nodes: 2,
        },
        Site {
            nat: nat_of_b,
            nodes: 2,
        },
        Site {
            nat: Nat::Cone,
            nodes: 2,
        },
    ];
    match Sites::new(prefix, &sites, 50) {
        Ok(sites) => Some(sites.with_port(port)),
        Err(e) => {
            eprintln!("skipped: cannot make the sites testbed ({e})");
            None
        }
    }
}

/// Runs the quickstart's DiLoCo job across the sites; returns the cluster, the scheduler's
/// log and the other nodes with their places.
fn train_across(sites: &Sites) -> (Cluster, Vec<String>, Vec<(Proc, Place)>) {
    let mut cluster = Cluster::at(sites.gateway());
    let mut nodes = start_three_site_nodes(&mut cluster, sites);
    let job = cluster.diloco_job("sites", 3, 2, "");
    let (mut scheduler, _) = cluster.scheduler("scheduler", &job);
    let (ok, lines) = scheduler.wait(Duration::from_secs(300));
    if !ok {
        let mut all = lines.join("\n");
        for (proc, _) in &mut nodes {
            while let Ok(line) = proc.lines.try_recv() {
                proc.seen.push(line);
            }
            all += &format!("\n--- {}\n{}", proc.name, proc.seen.join("\n"));
            let work = cluster.path(&format!("{}-work", proc.name));
            for job in std::fs::read_dir(&work).into_iter().flatten() {
                let log = job.unwrap().path().join("stderr.log");
                if let Ok(text) = std::fs::read_to_string(&log) {
                    all += &format!("\n--- {}\n{text}", log.display());
                }
            }
        }
        panic!("the job failed across the sites:\n{all}");
    }
    (cluster, lines, nodes)
}

/// [`train_across`], then the checks every network must pass: every slice used once per
/// epoch, and no error in the scheduler's log.
fn train_and_audit(sites: &Sites) -> (Cluster, Vec<(Proc, Place)>) {
    let (cluster, lines, nodes) = train_across(sites);
    assert_audit_passes(&cluster.path("sites-job.ledger"), 2, DILOCO_SLICES);
    let errors: Vec<&String> = lines.iter().filter(|l| l.contains("ERROR")).collect();
    assert!(
        errors.is_empty(),
        "the scheduler logged errors: {errors:#?}"
    );
    (cluster, nodes)
}

/// Probes node `name` of `nodes` from its LAN neighbour `from`.
fn probe_node(cluster: &Cluster, nodes: &mut [(Proc, Place)], name: &str, from: &Place) -> Probed {
    let (proc, place) = nodes.iter_mut().find(|(p, _)| p.name == name).unwrap();
    probe(cluster, proc, place, from)
}

/// The quickstart's DiLoCo job, every node configured as `init` writes it plus
/// `gateway_addresses`, trains every slice once across three sites behind cone NATs; the
/// parameter server reaches the trainers of the other site through hole-punched connections,
/// its LAN neighbour directly, and nobody through the relay.
#[test]
fn the_diloco_job_trains_across_three_sites_behind_nats() {
    let Some(sites) = three_sites("hst", Nat::Cone) else {
        return;
    };
    let (cluster, mut nodes) = train_and_audit(&sites);

    let ps = probe_node(&cluster, &mut nodes, "ps", &sites.node(2, 1));
    let text = &ps.text;
    assert!(
        ps.nat.starts_with("behind a NAT that keeps ports"),
        "{text}"
    );
    assert_site_b_hole_punched(&cluster, &ps);
    assert_eq!(ps.path_to(&cluster, "trainer2"), Some("direct"), "{text}");
    assert!(!ps.paths.values().any(|p| p == "relayed"), "{text}");
    // No node announces its private address: the LAN neighbours found each other's by asking
    // over the relay, the one that dialled it saying so.
    let mut met = false;
    for (proc, _) in nodes
        .iter_mut()
        .filter(|(p, _)| ["ps", "trainer2"].contains(&p.name.as_str()))
    {
        met |= (proc.logged().iter()).any(|l| l.contains("reached a peer behind the same NAT"));
    }
    assert!(met, "ps and trainer2 met some other way");

    let (gateway_sent, gateway_received) = sites.gateway_bytes();
    let sent: u64 = (0..3).map(|k| sites.site_bytes(k).0).sum();
    eprintln!(
        "gateway received {gateway_received} and sent {gateway_sent} bytes; the sites sent {sent}"
    );
}

/// Behind a symmetric NAT (site B) no hole punch can work: the job still trains every slice
/// once, through the gateway's relay, and the nodes say so.
#[test]
fn behind_a_symmetric_nat_the_job_trains_through_the_relay() {
    let Some(sites) = three_sites("hsy", Nat::Symmetric) else {
        return;
    };
    let (cluster, mut nodes) = train_and_audit(&sites);

    let ps = probe_node(&cluster, &mut nodes, "ps", &sites.node(2, 1));
    let text = &ps.text;
    assert_eq!(ps.path_to(&cluster, "trainer0"), Some("relayed"), "{text}");
    assert_eq!(ps.path_to(&cluster, "trainer1"), Some("relayed"), "{text}");
    assert_eq!(ps.path_to(&cluster, "trainer2"), Some("direct"), "{text}");
    let trainer = probe_node(&cluster, &mut nodes, "trainer0", &sites.node(1, 1));
    let text = &trainer.text;
    assert!(
        trainer.nat.starts_with("behind a NAT that changes ports"),
        "{text}"
    );
}

/// Every node listens on port 4001, so the two machines of each site share their router's
/// public ports: each still learns its own observed address, and every cross-site pair ends
/// up direct (hole punches reach the machine they are meant for).
#[test]
fn machines_that_share_a_nat_and_a_port_punch_to_the_right_machine() {
    let Some(sites) = three_sites_on("hsp", Nat::Cone, 4001) else {
        return;
    };
    let (cluster, mut nodes) = train_and_audit(&sites);
    let site_of = |name: &str| match name {
        "data" | "scheduler" => 0,
        "trainer0" | "trainer1" => 1,
        _ => 2,
    };
    let names: Vec<String> = nodes.iter().map(|(p, _)| p.name.clone()).collect();
    let mut relayed = Vec::new();
    for name in &names {
        let neighbour = if site_of(name) == 1 {
            sites.node(1, usize::from(name == "trainer0"))
        } else if site_of(name) == 2 {
            sites.node(2, usize::from(name == "ps"))
        } else {
            sites.node(0, 1)
        };
        let probed = probe_node(&cluster, &mut nodes, name, &neighbour);
        assert!(
            probed.nat.starts_with("behind a NAT that keeps ports"),
            "{name}: {}",
            probed.text
        );
        for other in names.iter().filter(|o| site_of(o) != site_of(name)) {
            if probed.path_to(&cluster, other) == Some("relayed") {
                relayed.push(format!("{name} → {other}"));
            }
        }
    }
    assert!(relayed.is_empty(), "relayed cross-site pairs: {relayed:?}");
}

/// Site B behind two NATs in a row (its router behind the ISP's carrier-grade NAT): the job
/// trains every slice once, and its trainers reach the parameter server by hole punching.
#[test]
fn behind_a_carrier_grade_nat_the_job_trains() {
    let Some(sites) = three_sites("hcg", Nat::CarrierGrade) else {
        return;
    };
    let (cluster, mut nodes) = train_and_audit(&sites);
    let ps = probe_node(&cluster, &mut nodes, "ps", &sites.node(2, 1));
    assert_site_b_hole_punched(&cluster, &ps);
}

/// The parameter server (`probed`) reaches both trainers of site B by hole punching.
fn assert_site_b_hole_punched(cluster: &Cluster, probed: &Probed) {
    for trainer in ["trainer0", "trainer1"] {
        assert_eq!(
            probed.path_to(cluster, trainer),
            Some("hole-punched"),
            "{}",
            probed.text
        );
    }
}
