//! Where a run's events go: the console, the events file, an observer, the dashboard's
//! board and the run's history.

use std::{io::Write, path::Path};

use hypha_data::iteration::IterationService;
use hypha_messages::{iterate::RunProgress, job::JobStatus};
use hypha_network::Network;
use tokio::sync::{mpsc, watch};

use crate::{
    dashboard::{self, Board, JobView},
    event::{Event, with_stderr},
    history, unix_ms,
};

/// Where events go: always the console; optionally a JSON-lines file and an observer. It
/// also keeps the run's [`history`](crate::history) for `progress`.
#[derive(Debug)]
pub struct EventLog {
    file: Option<std::fs::File>,
    observer: Option<mpsc::Sender<Event>>,
    /// Events dropped for the observer since it last took one: it is told before the next.
    missed: u64,
    history: watch::Sender<RunProgress>,
    board: watch::Sender<Board>,
    /// How the scheduler reaches its peers, for the dashboard ([`EventLog::watch_paths`]).
    paths: watch::Sender<std::collections::BTreeMap<String, String>>,
}

impl EventLog {
    /// Events on the console only.
    pub fn console() -> Self {
        EventLog {
            file: None,
            observer: None,
            missed: 0,
            history: watch::Sender::new(RunProgress::default()),
            board: watch::Sender::new(Board::default()),
            paths: watch::Sender::new(std::collections::BTreeMap::new()),
        }
    }

    /// Events on the console and, as JSON lines, appended to `path` (created if need be): a
    /// resumed run's events follow its earlier process's.
    pub fn with_file(path: &Path) -> std::io::Result<Self> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        Ok(EventLog {
            file: Some(file),
            ..EventLog::console()
        })
    }

    /// Also hands every event to `observer` (a progress display, a benchmark). The job never
    /// waits for it: when its queue is full, the event is dropped for the observer, which
    /// gets an [`Event::Missed`] with the count before the next event it takes.
    pub fn observed_by(mut self, observer: mpsc::Sender<Event>) -> Self {
        self.observer = Some(observer);
        self
    }

    /// What the dashboard reads: the board the events keep, and the run's history.
    pub fn dashboard(&self) -> dashboard::Sources {
        dashboard::Sources {
            board: self.board.subscribe(),
            history: self.history.subscribe(),
            reveal_task: false,
            paths: self.paths.subscribe(),
        }
    }

    /// Keeps the dashboard's paths (how the scheduler reaches each peer) current from
    /// `network`, every 2 s, until the network stops or nobody watches.
    pub fn watch_paths(&self, network: Network) -> impl std::future::Future<Output = ()> + use<> {
        let paths = self.paths.clone();
        async move {
            let mut every = tokio::time::interval(std::time::Duration::from_secs(2));
            while !paths.is_closed() {
                every.tick().await;
                let Ok(now) = network.paths().await else {
                    return;
                };
                paths.send_replace(
                    now.into_iter()
                        .map(|(peer, path)| (peer.to_string(), path.to_string()))
                        .collect(),
                );
            }
        }
    }

    /// Starts the history of run `task`, going on from what an earlier process of it counted.
    pub(super) fn begin(&mut self, task: &str, earlier: RunProgress) {
        self.history.send_replace(RunProgress {
            task: task.to_string(),
            ..earlier
        });
        self.board.send_modify(|board| board.set_task(task));
    }

    /// Names the job on the board, and where its iteration's counts are asked.
    pub(super) fn describe(&mut self, job: JobView, iteration: Option<IterationService>) {
        self.board.send_replace(Board::new(job, iteration));
    }

    /// The run's history, kept current.
    pub(super) fn history_watch(&self) -> watch::Receiver<RunProgress> {
        self.history.subscribe()
    }

    /// The run's history as it is now.
    pub(super) fn history(&self) -> RunProgress {
        self.history.borrow().clone()
    }

    pub(super) fn record(&mut self, event: Event) {
        log(&event);
        let now = unix_ms();
        self.history
            .send_modify(|history| history::tally(history, &event, now));
        self.board.send_modify(|board| board.apply(&event, now));
        let stamped = serde_json::json!({ "time_ms": now, "event": &event });
        if let Some(file) = &mut self.file
            && let Ok(mut line) = serde_json::to_string(&stamped)
        {
            // Each line is written whole, in one write, so that a reader never sees half an
            // event, even if the scheduler dies.
            line.push('\n');
            let _ = file.write_all(line.as_bytes()).and_then(|_| file.flush());
        }
        if let Some(observer) = &self.observer {
            let missed = Event::Missed {
                missed: self.missed,
            };
            if self.missed > 0 && observer.try_send(missed).is_ok() {
                self.missed = 0;
            }
            if self.missed > 0 || observer.try_send(event).is_err() {
                self.missed += 1;
            }
        }
    }
}

/// The console's line for `event`: the job's and its workers' here, the rounds' in
/// [`log_training`].
fn log(event: &Event) {
    match event {
        Event::DataReady {
            dataset,
            slices,
            data_nodes,
            used,
            ledger,
        } => {
            tracing::info!(%dataset, slices, data_nodes, used, %ledger, "iteration ready")
        }
        Event::Leased {
            slot, peer, price, ..
        } => {
            tracing::info!(slot, %peer, price, "worker leased")
        }
        Event::Dispatched { slot, job, peer } => {
            tracing::info!(slot, %job, %peer, "job dispatched")
        }
        Event::Status {
            slot, job, status, ..
        } => match status {
            JobStatus::Running => tracing::info!(slot, %job, "job running"),
            JobStatus::Finished { exit_code: 0, .. } => {
                tracing::info!(slot, %job, "job finished")
            }
            JobStatus::Finished {
                exit_code,
                stderr_tail,
            } => tracing::warn!(
                slot,
                %job,
                "job failed: {}",
                with_stderr(format!("exit code {exit_code}"), stderr_tail)
            ),
            JobStatus::Failed {
                reason,
                stderr_tail,
            } => {
                tracing::warn!(slot, %job, "job failed: {}", with_stderr(reason.clone(), stderr_tail))
            }
        },
        Event::ExecutorStatus { job, payload } => {
            tracing::debug!(%job, %payload, "executor status")
        }
        Event::Lost { slot, peer, reason } => {
            tracing::warn!(slot, %peer, %reason, "worker lost; replacing it")
        }
        Event::Benched {
            slot,
            job,
            peer,
            round,
            reason,
        } => tracing::warn!(
            slot,
            %job,
            %peer,
            round,
            "trainer benched: {reason}; its job ends, its slices go back, and it is not leased again for this task"
        ),
        Event::Resumed { task, round, jobs } => {
            tracing::info!(%task, ?round, jobs, "resuming the run the earlier scheduler left")
        }
        Event::Readopted {
            slot,
            peer,
            lease,
            job,
        } => match job {
            Some(job) => {
                tracing::info!(slot, %peer, lease, %job, "the earlier run's lease taken over with its running job")
            }
            None => tracing::info!(slot, %peer, lease, "the earlier run's lease taken over"),
        },
        Event::Refused { .. }
        | Event::Clipped { .. }
        | Event::Evaluated { .. }
        | Event::Failover { .. }
        | Event::Round { .. }
        | Event::WaitingForTrainers { .. }
        | Event::RoundsBegin { .. }
        | Event::Joined { .. }
        | Event::Done { .. }
        | Event::Missed { .. } => log_training(event),
    }
}

/// The console's line for an event of the training (see [`log`]).
fn log_training(event: &Event) {
    match event {
        // Each is logged where it is learnt (rounds, and the parameter server's log).
        Event::Refused { .. } => {}
        Event::Clipped {
            round,
            peer,
            share,
            ratio,
            reason,
        } => tracing::info!(
            round,
            %peer,
            share,
            ?ratio,
            reason = %reason.escape_debug(),
            "a trainer's update counted for a share of itself (clipped)"
        ),
        Event::Evaluated {
            round, peer, loss, ..
        } => tracing::info!(round, %peer, loss, "held-out loss of the global model"),
        Event::Failover {
            peer,
            reason,
            round,
            lost_rounds,
            standby: None,
        } => {
            tracing::warn!(%peer, %reason, round, lost_rounds, "parameter server lost; a new one takes over from the checkpoint")
        }
        Event::Failover {
            peer,
            reason,
            round,
            lost_rounds,
            standby: Some(standby),
        } => {
            tracing::warn!(%peer, %reason, round, lost_rounds, %standby, "parameter server lost; its standby takes over")
        }
        Event::Round {
            round,
            trainers,
            away: true,
            ..
        } => tracing::info!(
            round,
            trainers,
            "round applied while the scheduler was away; its slices are used with the next checkpoint"
        ),
        Event::Round {
            round,
            trainers,
            samples,
            loss,
            away: false,
        } => match loss {
            Some(loss) => tracing::info!(
                round,
                trainers,
                samples,
                loss = format!("{loss:.4}"),
                "round applied"
            ),
            None => tracing::info!(round, trainers, samples, "round applied"),
        },
        Event::WaitingForTrainers {
            ready,
            trainers,
            grace_s,
        } => tracing::info!(
            ready,
            trainers,
            "waiting for {} more trainers to load before the first round (at most {grace_s} s)",
            trainers - ready
        ),
        Event::RoundsBegin {
            round,
            trainers,
            late,
            waited_s,
        } => match late.len() {
            0 => tracing::info!(round, trainers, waited_s, "rounds begin"),
            n => tracing::warn!(
                round,
                trainers,
                waited_s,
                late = ?late,
                "rounds begin without {n} trainers that were still not ready after the start grace; they join once they are"
            ),
        },
        Event::Joined {
            slot,
            job,
            peer,
            round,
        } => tracing::info!(slot, %job, %peer, round, "trainer joined the run"),
        Event::Done { ok, message } => tracing::info!(ok, %message, "job done"),
        Event::Missed { .. } => {}
        // The job's and its workers' events, logged by `log`.
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::{Event, EventLog};

    /// An observer that falls behind is told how many events it missed, before the next one
    /// it takes: a gap is visible, never silent.
    #[tokio::test]
    async fn an_observer_that_falls_behind_is_told_what_it_missed() {
        let (observer, mut events) = tokio::sync::mpsc::channel(2);
        let mut log = EventLog::console().observed_by(observer);
        let round = |round| Event::Round {
            round,
            trainers: 1,
            samples: 1,
            loss: None,
            away: false,
        };
        for r in 0..5 {
            log.record(round(r));
        }
        assert_eq!(events.recv().await, Some(round(0)));
        // Room for one: the gap, and the event after it is missed too.
        log.record(round(5));
        assert_eq!(events.recv().await, Some(round(1)));
        assert_eq!(events.recv().await, Some(Event::Missed { missed: 3 }));
        assert_eq!(events.try_recv().ok(), None);
        log.record(round(6));
        assert_eq!(events.recv().await, Some(Event::Missed { missed: 1 }));
        assert_eq!(events.recv().await, Some(round(6)));
    }
}
