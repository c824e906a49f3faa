//! `churn`: an elastic DiLoCo run while trainers come and go, against the same run left
//! alone.
//!
//! Real processes of the release binaries (`hypha_testing`'s cluster: a gateway, a data node
//! serving a learnable `blobs` dataset of one epoch, a parameter-server worker, trainer
//! workers running `hypha-executor train`, the scheduler), every setting at its default. The
//! job asks for `workers = { min = 2, max = 8 }` and starts with four trainers online. Once
//! the first round is applied, every `T` seconds one running trainer's worker is stopped
//! (SIGKILL and SIGTERM alternating: a crash, then a graceful leave) and a new worker is
//! started. Then the same job runs on a fresh cluster with four trainers and no churn.
//!
//! Keys:
//! - `metrics.goodput`: samples in applied rounds ÷ samples trained: those, and the samples
//!   of every round a trainer trained that did not go into the model (its last report of that
//!   round in the metrics file: a trainer killed mid-round may have trained a batch or two
//!   more since). Target ≥ 0.9.
//! - `metrics.join_to_contribution_s`: a new worker's start to the first applied round that
//!   includes its update, median. Target ≤ one round's time plus the model's transfer time;
//!   the suite reports `metrics.round_s` (the median applied round's time) beside it, and the
//!   model here (a 2.7 kB MLP) moves in milliseconds.
//! - `ratios.loss_vs_undisturbed`: the churned run's final model against the undisturbed
//!   run's, evaluation loss on 4,096 fresh samples. Target ≤ 1.05.
//! - `metrics.audit_ok`: 1 when `hypha-scheduler audit --finished` passes on the churned
//!   run's ledger (every slice used exactly once), 0 otherwise.

use std::{path::Path, process::Command, time::Duration};

use anyhow::{Context, bail};
use hypha_executor::{model::Model, synthetic::Synthetic};
use hypha_testing::cluster::{
    Cluster, DILOCO_MODEL, Proc, bin, data_node, events, job_dir, of_kind,
};

use crate::{Report, median, wait_for_events};

/// Samples in each of the dataset's slices.
const SAMPLES_PER_SLICE: usize = 64;
/// Trainers online when the run starts, and in the undisturbed run.
const START_TRAINERS: usize = 4;
/// The longest either run may take.
const PATIENCE: Duration = Duration::from_secs(600);

struct Plan {
    slices: usize,
    every: Duration,
    changes: usize,
}

pub(crate) async fn run(quick: bool) -> anyhow::Result<Report> {
    let plan = match quick {
        true => Plan {
            slices: 1500,
            every: Duration::from_secs(3),
            changes: 4,
        },
        false => Plan {
            slices: 4000,
            every: Duration::from_secs(5),
            changes: 8,
        },
    };
    // Starting, killing and watching processes blocks: off the runtime's threads.
    tokio::task::spawn_blocking(move || measure(&plan)).await?
}

fn measure(plan: &Plan) -> anyhow::Result<Report> {
    let churned = train(plan, true)?;
    let undisturbed = train(plan, false)?;
    let mut report = Report::default();
    report.metrics.insert("goodput".into(), churned.goodput);
    report.metrics.insert(
        "join_to_contribution_s".into(),
        median(churned.join_to_contribution.clone()),
    );
    report.metrics.insert(
        "joiners_contributed".into(),
        churned.join_to_contribution.len() as f64,
    );
    report
        .metrics
        .insert("joiners".into(), churned.joiners as f64);
    report.metrics.insert("round_s".into(), churned.round_s);
    report
        .metrics
        .insert("audit_ok".into(), f64::from(u8::from(churned.audit_ok)));
    report.metrics.insert("loss_churned".into(), churned.loss);
    report
        .metrics
        .insert("loss_undisturbed".into(), undisturbed.loss);
    report
        .metrics
        .insert("goodput_undisturbed".into(), undisturbed.goodput);
    report.metrics.insert("changes".into(), plan.changes as f64);
    report.ratios.insert(
        "loss_vs_undisturbed".into(),
        churned.loss / undisturbed.loss,
    );
    Ok(report)
}

/// What one run gave.
struct Outcome {
    goodput: f64,
    joiners: usize,
    join_to_contribution: Vec<f64>,
    round_s: f64,
    audit_ok: bool,
    loss: f64,
}

fn train(plan: &Plan, churn: bool) -> anyhow::Result<Outcome> {
    let cluster = Cluster::new();
    Synthetic::for_model(&DILOCO_MODEL)
        .write(
            &cluster.path("data/blobs"),
            plan.slices,
            SAMPLES_PER_SLICE,
            0,
        )
        .context("writing the dataset")?;
    let _data = data_node(&cluster, "data", &cluster.path("data"));
    let _server = cluster.server_worker("ps");
    let mut trainers: Vec<(Proc, u64, String)> = (0..START_TRAINERS)
        .map(|i| start_trainer(&cluster, &format!("trainer{i}")))
        .collect();
    let workers = match churn {
        true => "{ min = 2, max = 8 }".to_string(),
        false => START_TRAINERS.to_string(),
    };
    let job = cluster.diloco_job("churn", workers, 1, "");
    let (_scheduler, events_path) = cluster.scheduler("scheduler", &job);
    wait_for_events(&events_path, PATIENCE, "the first round", |all| {
        !of_kind(all, "round").is_empty()
    })?;
    let mut joiners: Vec<(u64, String)> = Vec::new();
    if churn {
        for change in 0..plan.changes {
            std::thread::sleep(plan.every);
            if done(&events_path) {
                eprintln!("the run ended after {change} changes");
                break;
            }
            // The oldest trainer still running leaves: killed, or told to stop.
            if trainers.is_empty() {
                bail!("no trainer left to stop");
            }
            let (mut proc, _, _) = trainers.remove(0);
            let signal = if change % 2 == 0 { "-KILL" } else { "-TERM" };
            Command::new("kill")
                .args([signal, &proc.child.id().to_string()])
                .status()?;
            proc.child.wait()?;
            let name = format!("joiner{change}");
            let (proc, started, peer) = start_trainer(&cluster, &name);
            eprintln!("change {}: {signal} a trainer, {name} started", change + 1);
            joiners.push((started, peer.clone()));
            trainers.push((proc, started, peer));
        }
    }
    wait_for_events(&events_path, PATIENCE, "the end", |all| {
        !of_kind(all, "done").is_empty()
    })?;
    let all = events(&events_path);
    let done = &of_kind(&all, "done")[0]["event"];
    if done["ok"] != true {
        bail!("the run failed: {done}");
    }
    let metrics = lines(&cluster.path("churn-job.metrics.jsonl"));
    let rounds: Vec<&serde_json::Value> = metrics.iter().filter(|m| m["kind"] == "round").collect();
    let applied: u64 = rounds.iter().filter_map(|r| r["samples"].as_u64()).sum();
    let lost = samples_lost(&metrics, &all);
    let join_to_contribution = joiners
        .iter()
        .filter_map(|(started, peer)| {
            let first = rounds.iter().find(|r| {
                r["included"]
                    .as_array()
                    .is_some_and(|i| i.iter().any(|p| p == peer.as_str()))
            })?;
            let at_ms = first["time_ms"].as_u64()?;
            Some(at_ms.saturating_sub(*started) as f64 / 1000.0)
        })
        .collect();
    let round_s = median(
        rounds
            .iter()
            .filter_map(|r| r["seconds"].as_f64())
            .collect(),
    );
    let audit_ok = Command::new(bin("hypha-scheduler"))
        .arg("audit")
        .arg(cluster.path("churn-job.ledger"))
        .arg("--finished")
        .output()?
        .status
        .success();
    let final_model = job_dir(&cluster.path("ps-work")).join("final.safetensors");
    Ok(Outcome {
        joiners: joiners.len(),
        goodput: applied as f64 / (applied + lost).max(1) as f64,
        join_to_contribution,
        round_s,
        audit_ok,
        loss: evaluation_loss(&final_model)?,
    })
}

/// A trainer worker named `name`, when it started (ms since the epoch, as the metrics file
/// writes times), and its peer id.
fn start_trainer(cluster: &Cluster, name: &str) -> (Proc, u64, String) {
    let started = hypha_messages::unix_ms();
    let (peer, proc) = cluster.peer_id_after(name, |cluster| cluster.trainer_worker(name, ""));
    (proc, started, peer)
}

/// Samples trained in rounds that did not go into the model: each trainer's last report of
/// each round it trained whose applied round does not include its peer (or that was never
/// applied).
fn samples_lost(metrics: &[serde_json::Value], events: &[serde_json::Value]) -> u64 {
    use std::collections::{HashMap, HashSet};
    let peers: HashMap<&str, &str> = of_kind(events, "dispatched")
        .into_iter()
        .filter_map(|e| Some((e["event"]["job"].as_str()?, e["event"]["peer"].as_str()?)))
        .collect();
    let included: HashSet<(u64, &str)> = metrics
        .iter()
        .filter(|m| m["kind"] == "round")
        .flat_map(|r| {
            let round = r["round"].as_u64().unwrap_or(u64::MAX);
            r["included"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(move |p| Some((round, p.as_str()?)))
        })
        .collect();
    let mut last: HashMap<(&str, u64), u64> = HashMap::new();
    for line in metrics.iter().filter(|m| m["kind"] == "trainer") {
        let (Some(job), Some(round), Some(samples)) = (
            line["job"].as_str(),
            line["round"].as_u64(),
            line["samples"].as_u64(),
        ) else {
            continue;
        };
        last.insert((job, round), samples);
    }
    last.into_iter()
        .filter(|((job, round), _)| {
            peers
                .get(job)
                .is_none_or(|peer| !included.contains(&(*round, *peer)))
        })
        .map(|(_, samples)| samples)
        .sum()
}

fn lines(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|line| serde_json::from_str(line).ok())
        .collect()
}

fn done(events_path: &Path) -> bool {
    !of_kind(&events(events_path), "done").is_empty()
}

/// The loss of the model in `path` on 4,096 fresh samples of the dataset's distribution.
fn evaluation_loss(path: &Path) -> anyhow::Result<f64> {
    let model = Model::new(&DILOCO_MODEL, 1)?;
    model.load(&hypha_diloco::Tensors::load(path)?)?;
    let held_out = Synthetic::for_model(&DILOCO_MODEL).batch(4096, 1 << 40)?;
    Ok(model.evaluate(&held_out)?.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A round a trainer trained counts as lost unless the applied round includes its peer.
    #[test]
    fn samples_of_rounds_left_out_are_lost() {
        let json = |text: &str| -> Vec<serde_json::Value> {
            text.lines()
                .map(|l| serde_json::from_str(l).unwrap())
                .collect()
        };
        let events = json(
            r#"{"event": {"kind": "dispatched", "job": "a", "peer": "pa"}}
{"event": {"kind": "dispatched", "job": "b", "peer": "pb"}}"#,
        );
        let metrics = json(
            r#"{"kind": "trainer", "job": "a", "round": 0, "samples": 32}
{"kind": "trainer", "job": "a", "round": 0, "samples": 64}
{"kind": "trainer", "job": "b", "round": 0, "samples": 64}
{"kind": "round", "round": 0, "included": ["pa", "pb"], "samples": 128}
{"kind": "trainer", "job": "a", "round": 1, "samples": 64}
{"kind": "trainer", "job": "b", "round": 1, "samples": 32}
{"kind": "round", "round": 1, "included": ["pa"], "samples": 64}
{"kind": "trainer", "job": "a", "round": 2, "samples": 16}"#,
        );
        assert_eq!(samples_lost(&metrics, &events), 32 + 16);
    }
}
