//! `ledger`: durable slice assignments and acknowledgements per second.
//!
//! One [`LedgerHandle`] (the scheduler's ledger actor, group commit) iterates a dataset of
//! many slices for one epoch. 64 simulated workers run concurrently, each in a loop that asks
//! for one slice (an assignment), acknowledges it as consumed into its round (an
//! acknowledgement) and commits the round (the slice becomes USED). Every answer arrives only
//! after its transition is fsynced. `ops_per_sec` counts assignments plus acknowledgements
//! per second of wall time, the commits' cost included; `transitions_per_sec` counts all three
//! durable transitions.
//!
//! The ceiling is the disk: `fsync_commits_per_sec` is how many one-row `redb` transactions
//! with immediate durability this machine commits per second, which is what a ledger that
//! committed each transition alone could at most do; `ratios.group_commit_gain` is how far
//! group commit lifts the ledger above it.

use std::{collections::HashSet, time::Instant};

use hypha_ledger::{Grant, IterationSpec, Ledger, LedgerHandle};

use crate::Report;

/// The target of PRODUCT.md: 50,000 durable assignments + acknowledgements per second.
const TARGET_OPS_PER_SEC: f64 = 50_000.0;
const WORKERS: usize = 64;

pub(crate) async fn run(quick: bool) -> anyhow::Result<Report> {
    let slices = if quick { 20_000 } else { 200_000 };
    let tmp = tempfile::tempdir()?;

    let fsync_rate = fsync_ceiling(
        &tmp.path().join("ceiling.redb"),
        if quick { 200 } else { 1_000 },
    )?;

    let spec = IterationSpec {
        dataset: "bench".into(),
        epochs: 1,
        seed: 1,
        samples: vec![64; slices],
    };
    let path = tmp.path().join("bench.ledger");
    let ledger = Ledger::create(&path, spec, 60_000)?;
    let (handle, task) = LedgerHandle::spawn(ledger);

    let started = Instant::now();
    let mut workers = Vec::with_capacity(WORKERS);
    for w in 0..WORKERS {
        workers.push(tokio::spawn(work(handle.clone(), format!("worker-{w}"))));
    }
    let mut assigned = 0u64;
    for worker in workers {
        assigned += worker.await??;
    }
    let elapsed = started.elapsed().as_secs_f64();
    anyhow::ensure!(
        assigned == slices as u64,
        "the workers used {assigned} slices of {slices}"
    );
    let progress = handle.progress().await?;
    anyhow::ensure!(progress.finished, "the iteration did not finish");
    drop(handle);
    task.await?;

    let ops_per_sec = 2.0 * assigned as f64 / elapsed;
    let mut report = Report::default();
    report.metrics.insert("ops_per_sec".into(), ops_per_sec);
    report.metrics.insert(
        "transitions_per_sec".into(),
        3.0 * assigned as f64 / elapsed,
    );
    report
        .metrics
        .insert("fsync_commits_per_sec".into(), fsync_rate);
    report.metrics.insert("slices".into(), slices as f64);
    report.metrics.insert("workers".into(), WORKERS as f64);
    report
        .ratios
        .insert("ops_over_target".into(), ops_per_sec / TARGET_OPS_PER_SEC);
    report.ratios.insert(
        "group_commit_gain".into(),
        3.0 * assigned as f64 / elapsed / fsync_rate,
    );
    Ok(report)
}

/// One worker: a slice at a time until the epoch is done; returns how many it used.
async fn work(ledger: LedgerHandle, name: String) -> anyhow::Result<u64> {
    let mut used = 0;
    let mut round = 0;
    loop {
        match ledger.assign(&name, 1, HashSet::new()).await? {
            Grant::Slices(slices) => {
                let keys = slices.iter().map(|a| a.key).collect();
                let consumed = ledger.consume(&name, keys, round).await?;
                anyhow::ensure!(consumed.refused.is_empty(), "a slice was refused");
                used += ledger.commit_round(&name, round).await?.len() as u64;
                round += 1;
            }
            Grant::Wait => tokio::task::yield_now().await,
            Grant::Finished => return Ok(used),
        }
    }
}

/// One-row transactions with immediate durability, one after another, per second.
fn fsync_ceiling(path: &std::path::Path, commits: u64) -> anyhow::Result<f64> {
    const TABLE: redb::TableDefinition<u64, u64> = redb::TableDefinition::new("ceiling");
    let db = redb::Database::create(path)?;
    let started = Instant::now();
    for i in 0..commits {
        let mut txn = db.begin_write()?;
        txn.set_durability(redb::Durability::Immediate)?;
        txn.open_table(TABLE)?.insert(i, i)?;
        txn.commit()?;
    }
    Ok(commits as f64 / started.elapsed().as_secs_f64())
}
