//! `recovery`: seconds from a SIGKILL of the scheduler (started again at once, same identity
//! and job file) to the next applied DiLoCo round, and from a SIGKILL of the parameter
//! server's worker to the next applied round.
//!
//! Real processes of the release binaries (`hypha_scheduler::testing`'s cluster: a gateway, a
//! data node serving the learnable `blobs` dataset, two parameter-server workers, two trainer
//! workers running `hypha-executor train`, the scheduler), every setting at its default (the
//! workers' 10 s lease included). Kills alternate, scheduler then parameter server, each
//! once the run applied two rounds since the last recovery: a restarted scheduler resets the
//! attempts of its slots, so the run never runs out of them. A killed parameter-server
//! worker is started again as the spare for the next kill. The clock starts at the kill and
//! stops when the scheduler's events file gets the next `round` event.
//!
//! The target (issue 19): each median ≤ 5 s.
//!
//! `HYPHA_RECOVERY_LOG=<file>` writes every process's log (`name: line`, the killed ones'
//! too) there at the end: where a recovery's seconds went.

use std::time::{Duration, Instant};

use hypha_testing::cluster::{events, of_kind};

use crate::{
    Report, SERVER_WORKERS, current_server, median, spare_server_cluster, trainer_executors,
    wait_for_events, write_logs,
};

/// The target for both medians.
const TARGET_S: f64 = 5.0;
/// The longest a recovery may take before the suite gives up.
const PATIENCE: Duration = Duration::from_secs(90);
/// The parameter server's slot in a job of two trainers.
const SERVER_SLOT: u64 = 2;

pub(crate) async fn run(quick: bool) -> anyhow::Result<Report> {
    // Starting, killing and watching processes blocks: off the runtime's threads.
    tokio::task::spawn_blocking(move || measure(if quick { 3 } else { 5 })).await?
}

fn measure(repetitions: usize) -> anyhow::Result<Report> {
    let (cluster, mut servers, mut others) = spare_server_cluster(&[]);
    let names = SERVER_WORKERS;
    // Enough epochs that the data outlasts every kill.
    let job = cluster.diloco_job("recovery", 2, 200, "");
    let (mut scheduler, events_path) = cluster.scheduler("scheduler", &job);
    let rounds = || of_kind(&events(&events_path), "round").len();
    wait_for_rounds(&events_path, 2)?;

    // The processes killed, for their logs.
    let mut killed_procs = Vec::new();
    let mut scheduler_s = Vec::new();
    let mut server_s = Vec::new();
    for repetition in 0..repetitions {
        scheduler.child.kill()?;
        let killed = Instant::now();
        scheduler.child.wait()?;
        // Counted once it is dead: a round it applied just before it died is not the next.
        let before = rounds();
        killed_procs.push(std::mem::replace(
            &mut scheduler,
            cluster.restart_scheduler("scheduler", &job).0,
        ));
        wait_for_rounds(&events_path, before + 1)?;
        scheduler_s.push(killed.elapsed().as_secs_f64());
        wait_for_rounds(&events_path, rounds() + 2)?;

        let server = current_server(&cluster, &events_path, &names, SERVER_SLOT)?;
        servers[server].child.kill()?;
        let killed = Instant::now();
        servers[server].child.wait()?;
        // A round the scheduler took from it just before it died is not the next.
        std::thread::sleep(Duration::from_millis(100));
        let before = rounds();
        wait_for_rounds(&events_path, before + 1)?;
        server_s.push(killed.elapsed().as_secs_f64());
        killed_procs.push(std::mem::replace(
            &mut servers[server],
            cluster.server_worker(names[server]),
        ));
        wait_for_rounds(&events_path, rounds() + 2)?;
        eprintln!(
            "repetition {}: scheduler {:.2} s, parameter server {:.2} s",
            repetition + 1,
            scheduler_s[repetition],
            server_s[repetition]
        );
    }
    write_logs(
        "HYPHA_RECOVERY_LOG",
        killed_procs
            .iter_mut()
            .chain(std::iter::once(&mut scheduler))
            .chain(&mut servers)
            .chain(&mut others),
        &trainer_executors(&cluster),
    )?;
    let mut report = Report::default();
    let scheduler_median = median(scheduler_s.clone());
    let server_median = median(server_s.clone());
    report
        .metrics
        .insert("scheduler_recovery_s".into(), scheduler_median);
    report.metrics.insert("ps_recovery_s".into(), server_median);
    report.metrics.insert(
        "scheduler_recovery_max_s".into(),
        scheduler_s.iter().copied().fold(0.0, f64::max),
    );
    report.metrics.insert(
        "ps_recovery_max_s".into(),
        server_s.iter().copied().fold(0.0, f64::max),
    );
    report
        .metrics
        .insert("repetitions".into(), repetitions as f64);
    report.ratios.insert(
        "scheduler_recovery_of_target".into(),
        scheduler_median / TARGET_S,
    );
    report
        .ratios
        .insert("ps_recovery_of_target".into(), server_median / TARGET_S);
    Ok(report)
}

/// Waits until the events file holds `count` `round` events.
fn wait_for_rounds(path: &std::path::Path, count: usize) -> anyhow::Result<()> {
    wait_for_events(path, PATIENCE, &format!("round {count}"), |all| {
        of_kind(all, "round").len() >= count
    })
}
