//! Running a job file: lease workers, dispatch the executor to each, follow the statuses,
//! replace workers that are lost or whose job fails, until every worker's share finished.
//!
//! Each worker's share of the job is a *slot*. A slot is done when its executor exits with
//! code 0. When its job fails (non-zero exit, killed, refused) or its worker is lost (a lease
//! renewal is refused or the lease lapses), the slot is given to a newly leased worker, up to
//! `max_attempts` starts per slot; the other slots carry on meanwhile ([`slots`](crate::slots)
//! decides). A DiLoCo job's parameter server is replaced the same way: the new one is
//! restored from the checkpoint the scheduler holds ([`checkpoint`](crate::checkpoint)),
//! which goes to it with its dispatch, and the trainers are told to join it.
//!
//! A run is one actor (`JobRun`): it owns the slots, the jobs with their leases, the training
//! and the data, and one `JoinSet` with every task it starts (the router of inbound requests,
//! allocations, dispatches). Its loop takes what those tasks, the workers and the executors
//! report, one at a time; whatever ends the run (success, a failure, an interrupt, an
//! allocation that gives up), `finish` lets go of everything in one place: it stops the tasks
//! (an allocation stopped halfway releases what it leased), releases every lease (which stops
//! its job on the worker) and gives every job's slices back.
//!
//! A run resumed after the scheduler was killed takes over the leases the earlier process
//! recorded ([`record`](crate::record)), and with a checkpoint the jobs still running under
//! them (`goes_on`): the parameter server first (trainers taken over wait until its first
//! status says which round it collects, or until it is known not to go on), then the trainers.
//!
//! What happens is reported as [`Event`]s: one line each on the console and, when asked,
//! one JSON object per line in an events file.

use std::{
    collections::{HashMap, HashSet},
    io::Write,
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use hypha_data::iteration::IterationService;
use hypha_messages::{
    Error as RemoteError, ErrorCode, Request, Response,
    diloco::{ServerConfig, config::Restore},
    iterate::RunProgress,
    job::{JobSpec, JobStatus, StatusReport, TaskPeers},
};
use hypha_network::{InboundRequest, Network, NetworkError};
use libp2p::PeerId;
use serde::Serialize;
use tokio::{
    sync::{mpsc, oneshot, watch},
    task::JoinSet,
};

use crate::{
    allocator::{AllocationError, Allocator, Lease, Lost, WorkerRequest},
    checkpoint::{self, Checkpoints},
    dashboard::{self, Board, JobView},
    data::{CarriedOver, JobData},
    history,
    record::{self, BenchedTrainer, RecordedJob, RunRecord},
    rounds::News,
    slots::{Allocation, Role, SlotState, Slots, Verdict},
    spec::JobFile,
    training::{Answered, Promotion, Training},
    unix_ms,
};

/// Iterate and progress requests a scheduler answers at the same time.
const ANSWERING: usize = 256;

/// How long the parameter server may say nothing (it reports every quarter second) before
/// its lease is renewed at once to learn whether its worker is still there.
const SERVER_SILENCE: Duration = Duration::from_secs(1);
/// How long a parameter server taken over after a restart has to send its first status
/// (it reports four times a second).
const FIRST_STATUS_PATIENCE: Duration = Duration::from_secs(10);

/// How long an elastic run waits after an advertisement for more trainers that nobody
/// answered before it advertises again: a worker coming online sees one within this and an
/// advertisement's round (2 s), and the gossip carries one small message every 3 s.
const JOINERS_PAUSE: Duration = Duration::from_secs(1);

/// How long a finished job waits for its lease releases to reach the workers.
const RELEASE_LIMIT: Duration = Duration::from_secs(5);
/// A worker that answers a task's peers `Gone` (its dispatch is still on the way) is told
/// again this many times, this long apart.
const TASK_PEERS_TRIES: usize = 20;
const TASK_PEERS_RETRY: Duration = Duration::from_millis(250);
/// Workers hear within this that others left the task (at once that one joined): a worker
/// that left is refused a little later, and the run's end tells each worker once, not once
/// per job that ended.
const PEERS_LEFT_WITHIN: Duration = Duration::from_secs(1);

/// Something that happened to the job.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Event {
    Leased {
        slot: usize,
        peer: String,
        lease: u64,
        price: f64,
    },
    Dispatched {
        slot: usize,
        job: String,
        peer: String,
    },
    Status {
        slot: usize,
        job: String,
        peer: String,
        status: JobStatus,
    },
    ExecutorStatus {
        job: String,
        payload: serde_json::Value,
    },
    Lost {
        slot: usize,
        peer: String,
        reason: String,
    },
    /// A trainer's updates were refused in `refusals` rounds in a row, the last `round`: its
    /// job ends, its slices go back, its slot is given up and its worker is never leased
    /// again for the task.
    Benched {
        slot: usize,
        job: String,
        peer: String,
        round: u64,
        refusals: u32,
    },
    /// A scheduler resumed the run its earlier process left: the same task, `jobs` of it to
    /// take over, and for DiLoCo the checkpoint of `round` to go on from.
    Resumed {
        task: String,
        round: Option<u64>,
        jobs: usize,
    },
    /// A lease of the earlier run was taken over for `slot`, with its `job` where that still
    /// runs and goes on (a new job is dispatched otherwise).
    Readopted {
        slot: usize,
        peer: String,
        lease: u64,
        #[serde(skip_serializing_if = "Option::is_none")]
        job: Option<String>,
    },
    /// The parameter server's worker was lost or its job failed: a new one is leased and
    /// restored from the checkpoint of `round` (0 and no checkpoint: it starts afresh).
    /// `lost_rounds` were applied after that checkpoint (the server checkpoints every
    /// `checkpoint_every` rounds, or by traffic): their slices are trained again.
    Failover {
        peer: String,
        reason: String,
        round: u64,
        #[serde(default)]
        lost_rounds: u64,
        /// The standby that took over (`[diloco] standby`): it held the model of `round`, and
        /// no checkpoint was sent.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        standby: Option<String>,
    },
    /// The parameter server applied a DiLoCo round. `away`: it did so as the scheduler's
    /// earlier process died, which did not hear of it; the process that took the server over
    /// tells it (its samples and loss are not known: 0 and none).
    Round {
        round: u64,
        trainers: usize,
        samples: u64,
        loss: Option<f64>,
        #[serde(skip_serializing_if = "std::ops::Not::not")]
        away: bool,
    },
    /// The first trainers hold the model: the run's first round waits for the other leased
    /// trainers to load, `grace_s` at most (`[diloco] start_grace_seconds`).
    WaitingForTrainers {
        ready: usize,
        trainers: usize,
        grace_s: f64,
    },
    /// The run's first round begins with `trainers` trainers, `waited_s` after the first was
    /// ready; `late` (peers) were still loading when the grace ran out and join once ready.
    RoundsBegin {
        round: u64,
        trainers: usize,
        #[serde(skip_serializing_if = "Vec::is_empty")]
        late: Vec<String>,
        waited_s: f64,
    },
    /// A trainer trains its first round of the run (from the start, or joining later).
    Joined {
        slot: usize,
        job: String,
        peer: String,
        round: u64,
    },
    Done {
        ok: bool,
        message: String,
    },
    /// Only to an observer that fell behind: `missed` events were dropped for it before this
    /// one (the console, the events file and the dashboard have them all).
    Missed {
        missed: u64,
    },
}

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
    fn begin(&mut self, task: &str, earlier: RunProgress) {
        self.history.send_replace(RunProgress {
            task: task.to_string(),
            ..earlier
        });
        self.board.send_modify(|board| board.set_task(task));
    }

    /// Names the job on the board, and where its iteration's counts are asked.
    fn describe(&mut self, job: JobView, iteration: Option<IterationService>) {
        self.board.send_replace(Board::new(job, iteration));
    }

    /// The run's history as it is now.
    fn history(&self) -> RunProgress {
        self.history.borrow().clone()
    }

    fn record(&mut self, event: Event) {
        match &event {
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
                refusals,
            } => tracing::warn!(
                slot,
                %job,
                %peer,
                round,
                refusals,
                "trainer benched: the parameter server refused its updates {refusals} rounds in a row; its job ends, its slices go back, and it is not leased again for this task"
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
        }
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

/// How much of an executor's stderr a failure shows: what a worker sends is not trusted to be
/// short or printable.
const STDERR_LINES: usize = 20;
const STDERR_LINE_CHARS: usize = 500;

/// A job's failure with the last lines its executor wrote to stderr, indented below it; at
/// most [`STDERR_LINES`] of [`STDERR_LINE_CHARS`], control characters shown as U+FFFD so that
/// a line can neither fake another nor steer the terminal.
pub fn with_stderr(reason: String, stderr_tail: &[String]) -> String {
    let lines: Vec<String> = stderr_tail
        .iter()
        .filter(|l| !l.trim().is_empty())
        .map(|line| {
            line.chars()
                .take(STDERR_LINE_CHARS)
                .map(|c| if c.is_control() { '\u{fffd}' } else { c })
                .collect()
        })
        .collect();
    if lines.is_empty() {
        return reason;
    }
    let mut text = format!("{reason}; the executor's stderr ended with:");
    for line in &lines[lines.len().saturating_sub(STDERR_LINES)..] {
        text.push_str("\n    ");
        text.push_str(line);
    }
    text
}

/// Why a job did not complete.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Allocation(#[from] AllocationError),
    #[error("slot {slot} failed {attempts} times; last: {last}")]
    Exhausted {
        slot: usize,
        attempts: u32,
        last: String,
    },
    #[error("stopped before the job completed")]
    Interrupted,
    #[error(transparent)]
    Data(#[from] crate::data::DataError),
    #[error(
        "the parameter server on {peer} is gone ({reason}) and no checkpoint of its rounds reached the scheduler; the global model of the last round may be in its checkpoint there (parameter-server.safetensors in the job's directory)"
    )]
    ServerLost { peer: String, reason: String },
    #[error(transparent)]
    Record(#[from] crate::record::RecordError),
    #[error(
        "the run's checkpoint {path} cannot be read ({error}); the ledger counts the rounds in it as used, so the run cannot go on without it: put the file back, or start training afresh with a new ledger"
    )]
    Checkpoint { path: String, error: String },
    #[error("the job file's [diloco] metrics file {path}: {error}")]
    Metrics { path: String, error: std::io::Error },
    #[error(
        "every executor exited, but the iteration still has slices that were never used; executors should fetch from their \"data\" reference until it answers that the data is done"
    )]
    Unfinished,
}

/// An executor's status (from a peer, for a job) and where its answer goes.
pub type ExecutorStatus = (PeerId, String, serde_json::Value, oneshot::Sender<String>);

/// The (worker, job) pairs whose requests for data a run answers: its jobs, and jobs of an
/// earlier process being taken over. Anyone else (a job that ended, a peer that was never
/// leased) is refused, so that no one outside the run can hold or churn its slices.
#[derive(Debug, Clone, Default)]
struct LiveJobs(Arc<std::sync::RwLock<HashSet<(PeerId, String)>>>);

impl LiveJobs {
    fn insert(&self, peer: PeerId, job: &str) {
        self.0
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert((peer, job.to_string()));
    }

    fn remove(&self, peer: PeerId, job: &str) {
        self.0
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&(peer, job.to_string()));
    }

    fn contains(&self, peer: PeerId, job: &str) -> bool {
        self.0
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .contains(&(peer, job.to_string()))
    }

    /// Whether `peer` runs a job of the run.
    fn runs_any(&self, peer: PeerId) -> bool {
        self.0
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .any(|(p, _)| *p == peer)
    }
}

/// Who may ask a run for what: its live jobs for data, its workers and operators for its
/// progress.
#[derive(Debug, Clone)]
struct Askers {
    live: LiveJobs,
    network: Network,
}

impl Askers {
    /// Whether `peer` may hear the run's progress, which names its task (whoever knows a task
    /// id can dispatch under it, and a worker refuses only a second scheduler, not the
    /// first): the run's workers and operators (certificates with the `operator` role) may.
    fn may_watch(&self, peer: PeerId) -> bool {
        self.live.runs_any(peer)
            || self
                .network
                .roles(&peer)
                .is_some_and(|roles| roles.contains(hypha_network::Role::Operator))
    }
}

/// What an executor status is answered with when nobody has more to say.
const RECEIVED: &str = r#"{"received":true}"#;

/// Answers what reaches a scheduler from the network: offers go to the allocator, job
/// statuses to `statuses`, executor statuses to `executor_statuses`, whose answer goes back
/// to the executor; progress requests get the iteration's counts and the run's `history`, if
/// the asking peer [`may watch`](Askers::may_watch) the run. Answers still on their way are
/// dropped with the returned future.
async fn route_inbound(
    mut inbound: mpsc::Receiver<InboundRequest>,
    allocator: Allocator,
    statuses: mpsc::Sender<(PeerId, StatusReport)>,
    executor_statuses: mpsc::Sender<ExecutorStatus>,
    data: Option<JobData>,
    history: watch::Receiver<RunProgress>,
    askers: Askers,
) {
    // Iterate and progress requests wait for the ledger: they are answered concurrently, at
    // most ANSWERING at once; the inbound queue fills behind them.
    let answering = Arc::new(tokio::sync::Semaphore::new(ANSWERING));
    let mut answers = JoinSet::new();
    while let Some(request) = inbound.recv().await {
        while answers.try_join_next().is_some() {}
        let peer = request.peer;
        if let (Request::Iterate(_) | Request::Progress { .. }, Some(data)) =
            (&request.request, &data)
        {
            let Ok(permit) = answering.clone().acquire_owned().await else {
                break;
            };
            let service = data.service().clone();
            let history = history.clone();
            let askers = askers.clone();
            answers.spawn(async move {
                let response = match &request.request {
                    Request::Iterate(iterate) if !askers.live.contains(peer, &iterate.consumer) => {
                        Err(RemoteError::new(
                            ErrorCode::Gone,
                            format!("{} is not a running job of this run", iterate.consumer),
                        ))
                    }
                    Request::Iterate(iterate) => {
                        service.iterate(&peer, iterate).await.map(Response::Iterate)
                    }
                    _ if !askers.may_watch(peer) => Err(RemoteError::new(
                        ErrorCode::Forbidden,
                        "a run's progress names its task, so a scheduler tells it only to the run's workers and to operators; ask with a certificate issued with `hypha-certutil node --role operator`",
                    )),
                    _ => service.progress().await.map(|progress| {
                        Response::Progress(hypha_messages::iterate::IterationProgress {
                            run: Some(Box::new(history.borrow().clone())),
                            ..progress
                        })
                    }),
                };
                let _ = request
                    .responder
                    .respond(response.unwrap_or_else(Response::Error))
                    .await;
                drop(permit);
            });
            continue;
        }
        let response = match request.request {
            Request::Offer(offer) => {
                if allocator.offer_arrived(peer, offer) {
                    Response::Ack
                } else {
                    Response::Error(RemoteError::new(
                        ErrorCode::Gone,
                        "that advertisement is closed",
                    ))
                }
            }
            Request::JobStatus(report) => match statuses.try_send((peer, report)) {
                Ok(()) => Response::Ack,
                Err(_) => Response::Error(RemoteError::new(ErrorCode::Busy, "try again")),
            },
            Request::ExecutorStatus { job, payload } => {
                match serde_json::from_str::<serde_json::Value>(&payload) {
                    Ok(payload) => {
                        let (answer_tx, answer) = oneshot::channel();
                        if executor_statuses
                            .try_send((peer, job, payload, answer_tx))
                            .is_err()
                        {
                            Response::Error(RemoteError::new(ErrorCode::Busy, "try again"))
                        } else {
                            // The job's loop answers; the router goes on meanwhile.
                            answers.spawn(async move {
                                let payload = answer.await.unwrap_or_else(|_| RECEIVED.to_string());
                                let _ = request
                                    .responder
                                    .respond(Response::ExecutorStatus { payload })
                                    .await;
                            });
                            continue;
                        }
                    }
                    Err(e) => Response::Error(RemoteError::new(
                        ErrorCode::BadRequest,
                        format!("the status is not JSON: {e}"),
                    )),
                }
            }
            _ => Response::Error(RemoteError::new(
                ErrorCode::Unsupported,
                "schedulers answer health, offers, job statuses and, for jobs with data, iterate and progress requests",
            )),
        };
        let _ = request.responder.respond(response).await;
    }
}

/// Runs `spec` to completion (or until `shutdown`).
pub async fn run_job(
    network: Network,
    inbound: mpsc::Receiver<InboundRequest>,
    allocator: Allocator,
    spec: JobFile,
    events: EventLog,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), RunError> {
    tokio::pin!(shutdown);
    let record_path = spec
        .ledger_path()
        .map(|ledger| record::path_beside(&ledger));
    let earlier = match &record_path {
        Some(path) => RunRecord::load(path)?,
        None => None,
    };
    // A resumed DiLoCo run goes on from the checkpoint held beside the ledger, if any.
    let resumed_round = match (&earlier, &spec.diloco, spec.ledger_path()) {
        (Some(_), Some(_), Some(ledger)) => {
            let path = checkpoint::path_beside(&ledger);
            match checkpoint::checkpoint_round(&path) {
                Ok(round) => Some(round),
                // No checkpoint: no round of the earlier run counted as used.
                Err(_) if !path.exists() => None,
                Err(error) => {
                    return Err(RunError::Checkpoint {
                        path: path.display().to_string(),
                        error,
                    });
                }
            }
        }
        _ => None,
    };
    let task = earlier
        .as_ref()
        .map_or_else(|| uuid::Uuid::new_v4().to_string(), |r| r.task.clone());
    let carried = CarriedOver {
        // Rounds the earlier run applied that are in the checkpoint: their slices are used.
        committed: earlier
            .iter()
            .flat_map(|r| &r.uncommitted)
            .filter(|u| resumed_round.is_some_and(|held| u.round < held))
            .filter_map(|u| Some((u.peer.parse().ok()?, u.job.clone(), u.round)))
            .collect(),
        // Jobs that may go on, and those whose rounds past the checkpoint wait for the
        // earlier server to go on.
        going_on: earlier
            .iter()
            .flat_map(|r| {
                let jobs = r
                    .jobs
                    .iter()
                    .filter(|j| goes_on(&spec, j.slot, resumed_round))
                    .map(|j| (&j.peer, &j.job));
                let waiting = r
                    .uncommitted
                    .iter()
                    .filter(|u| resumed_round.is_some_and(|held| u.round >= held))
                    .map(|u| (&u.peer, &u.job));
                jobs.chain(waiting)
            })
            .filter_map(|(peer, job)| Some((peer.parse().ok()?, job.clone())))
            .collect(),
        open_from: resumed_round.unwrap_or(0),
        data_nodes: earlier
            .iter()
            .flat_map(|r| &r.data_nodes)
            .filter_map(|peer| peer.parse().ok())
            .collect(),
    };
    let data = match (&spec.data, spec.ledger_path()) {
        (Some(data), Some(ledger)) => tokio::select! {
            started = JobData::start(&network, data, &ledger, &task, &carried, |manifest| spec.check_dataset(manifest)) => Some(started?),
            _ = &mut shutdown => return Err(RunError::Interrupted),
        },
        _ => None,
    };
    let training = match (&spec.diloco, &data) {
        (Some(diloco), Some(data)) => {
            let path = diloco
                .metrics
                .clone()
                .unwrap_or_else(|| "metrics.jsonl".into());
            let forward = diloco.forward.as_deref();
            let resumed = earlier.is_some();
            let mut started = Training::new(diloco.plan(), data.clone(), &path, forward, resumed)
                .map_err(|error| RunError::Metrics {
                path: path.display().to_string(),
                error,
            })?;
            if let (Some(round), Some(earlier)) = (resumed_round, &earlier) {
                // The earlier server may have applied the recorded rounds past the
                // checkpoint, and one more before the scheduler heard.
                let reached = earlier
                    .uncommitted
                    .iter()
                    .map(|u| u.round + 1)
                    .fold(round, u64::max)
                    + 1;
                started.resume_from(round, reached, earlier);
            }
            Some(started)
        }
        _ => None,
    };
    let checkpoints = match (&training, spec.ledger_path()) {
        (Some(_), Some(ledger)) => {
            let path = checkpoint::path_beside(&ledger);
            Some(match resumed_round {
                Some(_) => Checkpoints::resumed(path),
                None => Checkpoints::new(path),
            })
        }
        _ => None,
    };
    let (mut run, mut channels) = JobRun::new(
        network,
        inbound,
        allocator,
        &spec,
        task,
        data,
        training.map(|t| (t, checkpoints)),
        events,
        record_path,
    );
    if let Some(earlier) = earlier {
        run.resume(earlier, resumed_round).await;
    }
    let outcome = run.drive(&mut channels, &mut shutdown).await;
    run.finish(outcome).await
}

/// Whether the job of `slot` that an earlier process of the scheduler ran goes on when its
/// lease is taken over and it still runs. A DiLoCo job's do, when the scheduler holds a
/// checkpoint (`restored`): the parameter server trains on from the round it is at (its
/// first status says which; the rounds it applied since the checkpoint are used with its
/// next one), and trainers with it, keeping what they set up and fetched ahead. When the
/// server does not go on, a new one is restored from the checkpoint and the trainers join it,
/// giving back the rounds they held, as after a failover. Without a checkpoint nothing goes
/// on: a new server would adopt the model a trainer offers, which holds rounds whose slices
/// went back at the restart. Nor does a plain iteration's job: the rounds it completes are
/// used at its word, and it may be working on slices given back at the restart.
fn goes_on(spec: &JobFile, slot: usize, restored: Option<u64>) -> bool {
    spec.diloco.is_some() && slot <= spec.workers.max && restored.is_some()
}

/// What one kind of slot asks of a worker, and the config its executor gets.
struct Work {
    request: WorkerRequest,
    config: WorkConfig,
    artifacts: Vec<hypha_messages::artifact::Request>,
}

/// What a slot's executor is configured with.
enum WorkConfig {
    /// The job's `[config]` as JSON, for trainers with `data` and `diloco` added.
    Executor(String),
    /// The parameter server's, given its role and checkpoint at each dispatch.
    Server(ServerConfig),
}

impl WorkConfig {
    /// The config as JSON for an executor in `role`, restored from the checkpoint of round
    /// `restore` if any.
    fn json(&self, role: Role, restore: Option<u64>) -> String {
        match self {
            WorkConfig::Executor(json) => json.clone(),
            WorkConfig::Server(config) => {
                let config = ServerConfig {
                    restore: restore.map(|round| Restore { round }),
                    standby: role == Role::Standby,
                    ..*config
                };
                // Its fields are numbers, strings and options of them: it always serialises.
                serde_json::to_string(&config).unwrap_or_default()
            }
        }
    }
}

/// A job dispatched for a slot, and the lease it runs under.
struct Dispatched {
    slot: usize,
    lease: Lease,
    /// Its `dispatched` event was recorded: when the worker answered the dispatch, or, for a
    /// job so short that its status came first, just before that status.
    announced: bool,
    /// The version of the task's peers its worker was told (with the dispatch, or since).
    peers_version: u64,
}

/// A lease of an earlier run taken over for `slot`, with its job `job` on `peer` still
/// running (`going_on`) or stopped, or one that could not be.
struct Adoption {
    slot: usize,
    peer: PeerId,
    job: String,
    lease: Result<Box<Lease>, String>,
    going_on: bool,
    /// A trainer the earlier run had not yet told to join its server.
    rejoin: bool,
}

/// What the run's tasks hand back when they end.
enum Internal {
    Allocated {
        slots: Vec<usize>,
        /// It was optional (more trainers for an elastic run).
        optional: bool,
        leased: Result<Vec<Lease>, AllocationError>,
    },
    /// An elastic run may advertise for more trainers again.
    JoinersDue,
    Adopted(Adoption),
    /// The dispatch of `job` was answered (or failed).
    Dispatch {
        job: String,
        result: Result<(), String>,
    },
    /// The checkpoint of `round` was sent to the standby (or could not be).
    Forwarded {
        round: u64,
        result: Result<(), String>,
    },
    /// The network stopped handing over requests (`router`) or streams (`checkpoints`).
    Stopped(&'static str),
}

/// What reaches the run from outside its own tasks.
struct Channels {
    statuses: mpsc::Receiver<(PeerId, StatusReport)>,
    executor_statuses: mpsc::Receiver<ExecutorStatus>,
    lost: mpsc::Receiver<Lost>,
    /// Rounds and sizes of the checkpoints stored.
    checkpoints: mpsc::Receiver<(u64, u64)>,
}

/// One run of a job file: everything it holds, and the one place that lets go of it
/// ([`finish`](JobRun::finish)). Every task it starts (the router, allocations, dispatches)
/// is in `tasks`; every lease is in `jobs` or in the allocation that found it, and released
/// when dropped.
struct JobRun<'a> {
    network: Network,
    allocator: Allocator,
    spec: &'a JobFile,
    task: String,
    trainer: Work,
    /// A DiLoCo job's parameter server.
    server: Option<Work>,
    data: Option<JobData>,
    training: Option<Training>,
    /// A DiLoCo job's checkpoints, when it has a ledger to keep them beside.
    checkpoints: Option<Checkpoints>,
    /// The round of the checkpoint the next parameter server is restored from.
    restore: Option<u64>,
    /// Where the run's record is kept, when it has a ledger to keep it beside.
    record: Option<PathBuf>,
    /// Jobs of the earlier run whose leases are being taken over.
    adopting: Vec<RecordedJob>,
    /// The earlier run's parameter server may go on: until it is known whether it does, and
    /// at which round, trainers taken over wait in `parked`.
    server_pending: bool,
    parked: Vec<Adoption>,
    /// Statuses of jobs being taken over that ended meanwhile.
    ended_early: Vec<(PeerId, StatusReport)>,
    /// The jobs whose data requests are answered.
    live: LiveJobs,
    /// When the parameter server's job was last heard from (or dispatched).
    server_heard: std::time::Instant,
    events: EventLog,
    slots: Slots,
    jobs: HashMap<String, Dispatched>,
    /// The task's peers as the workers are told them.
    told_peers: TaskPeers,
    /// When the workers must next be told the task's peers (see [`Run::tell_task_peers`]).
    peers_due: Option<tokio::time::Instant>,
    tasks: JoinSet<Internal>,
    lost: mpsc::Sender<Lost>,
    /// Trainers benched (see [`Event::Benched`]): never leased again for the task.
    benched: Vec<BenchedTrainer>,
    /// An elastic run advertises for more trainers not before this: an advertisement that
    /// found nobody is followed by a pause ([`JOINERS_PAUSE`]), not another at once.
    joiners_after: tokio::time::Instant,
    /// A [`Internal::JoinersDue`] is on its way.
    joiners_timer: bool,
    /// A checkpoint is on its way to the standby; `forward_again`: a newer one was stored
    /// meanwhile.
    forwarding: bool,
    forward_again: bool,
}

impl<'a> JobRun<'a> {
    #[allow(clippy::too_many_arguments)]
    fn new(
        network: Network,
        inbound: mpsc::Receiver<InboundRequest>,
        allocator: Allocator,
        spec: &'a JobFile,
        task: String,
        data: Option<JobData>,
        training: Option<(Training, Option<Checkpoints>)>,
        mut events: EventLog,
        record: Option<PathBuf>,
    ) -> (Self, Channels) {
        events.describe(spec.view(), data.as_ref().map(|d| d.service().clone()));
        events.begin(&task, RunProgress::default());
        let (status_tx, statuses) = mpsc::channel(256);
        let (executor_tx, executor_statuses) = mpsc::channel(256);
        let (lost_tx, lost) = mpsc::channel(64);
        let (stored_tx, stored) = mpsc::channel(16);
        let live = LiveJobs::default();
        let (training, checkpoints) = match training {
            Some((training, checkpoints)) => (Some(training), checkpoints),
            None => (None, None),
        };
        let mut tasks = JoinSet::new();
        if let Some(checkpoints) = checkpoints.clone() {
            let serve = checkpoints.serve(network.clone(), task.clone(), stored_tx);
            tasks.spawn(async move {
                serve.await;
                Internal::Stopped("checkpoints")
            });
        }
        let router = route_inbound(
            inbound,
            allocator.clone(),
            status_tx,
            executor_tx,
            data.clone(),
            events.history.subscribe(),
            Askers {
                live: live.clone(),
                network: network.clone(),
            },
        );
        tasks.spawn(async move {
            router.await;
            Internal::Stopped("router")
        });
        let trainer = Work {
            request: WorkerRequest {
                executor: spec.executor.clone(),
                resources: spec.resources,
                bid: spec.bid,
            },
            config: WorkConfig::Executor(
                spec.trainer_config(data.as_ref().map(JobData::reference)),
            ),
            artifacts: spec.artifacts.clone(),
        };
        let server = spec.diloco.as_ref().map(|diloco| Work {
            request: WorkerRequest {
                executor: diloco.parameter_server.executor.clone(),
                resources: diloco.parameter_server.resources,
                bid: diloco.parameter_server.bid,
            },
            config: WorkConfig::Server(
                diloco.server_config(data.as_ref().map_or(0, JobData::largest_slice)),
            ),
            // The built-in parameter server runs no program that could read artifacts.
            artifacts: Vec::new(),
        });
        let run = JobRun {
            network,
            allocator,
            spec,
            task,
            trainer,
            slots: Slots::new(
                (spec.workers.min, spec.workers.max),
                (
                    server.is_some(),
                    spec.diloco.as_ref().is_some_and(|d| d.standby),
                ),
                spec.max_attempts,
            ),
            server,
            data,
            training,
            checkpoints,
            restore: None,
            record,
            adopting: Vec::new(),
            server_pending: false,
            parked: Vec::new(),
            ended_early: Vec::new(),
            live,
            server_heard: std::time::Instant::now(),
            events,
            jobs: HashMap::new(),
            told_peers: TaskPeers::default(),
            peers_due: None,
            tasks,
            lost: lost_tx,
            benched: Vec::new(),
            joiners_after: tokio::time::Instant::now(),
            joiners_timer: false,
            forwarding: false,
            forward_again: false,
        };
        let channels = Channels {
            statuses,
            executor_statuses,
            lost,
            checkpoints: stored,
        };
        (run, channels)
    }

    /// Takes over what the earlier run of this job left: the lease of each job it ran, with
    /// the job itself where it still runs and [`goes_on`] (a new job in the same slot
    /// otherwise, the old one stopped), and for a parameter server that does not go on the
    /// checkpoint of `round`.
    async fn resume(&mut self, earlier: RunRecord, round: Option<u64>) {
        self.restore = round;
        let server_slot = self.spec.workers.max;
        if let (Some(checkpoints), Some(round)) = (&self.checkpoints, round) {
            checkpoints.accept_up_to(round);
        }
        self.events.begin(&self.task, earlier.history);
        for benched in &earlier.benched {
            self.slots.give_up(benched.slot);
        }
        self.benched = earlier.benched;
        self.events.record(Event::Resumed {
            task: self.task.clone(),
            round,
            jobs: earlier.jobs.len(),
        });
        for recorded in earlier.jobs {
            let Ok(peer) = recorded.peer.parse::<PeerId>() else {
                continue;
            };
            if self.slots.state(recorded.slot) != Some(&SlotState::Wanted) {
                continue;
            }
            self.slots.adopting(recorded.slot);
            // Kept in the record until taken over: a scheduler killed again meanwhile takes
            // it over then.
            self.adopting.push(recorded.clone());
            let allocator = self.allocator.clone();
            let network = self.network.clone();
            let lost = self.lost.clone();
            let may_go_on = goes_on(self.spec, recorded.slot, round);
            if may_go_on {
                // Its prefetcher keeps asking while its lease is taken over.
                self.live.insert(peer, &recorded.job);
                if recorded.slot == server_slot {
                    self.server_pending = true;
                } else if let Some(training) = self.training.as_mut() {
                    training.taking_over(peer);
                }
            }
            self.tasks.spawn(async move {
                let adopted = allocator
                    .adopt(peer, recorded.lease, recorded.price, &lost)
                    .await;
                // A worker that does not list its jobs (older than the list) is taken to run
                // none of them.
                let going_on = may_go_on
                    && adopted
                        .as_ref()
                        .is_ok_and(|(_, jobs)| jobs.contains(&recorded.job));
                if adopted.is_ok() && !going_on {
                    // Its executor works on a state this run does not have (or is gone): a
                    // new job starts.
                    let cancel = Request::Cancel {
                        job: recorded.job.clone(),
                    };
                    let _ = network.request(peer, cancel).await;
                }
                Internal::Adopted(Adoption {
                    slot: recorded.slot,
                    peer,
                    job: recorded.job,
                    lease: adopted.map(|(lease, _)| Box::new(lease)),
                    going_on,
                    rejoin: recorded.rejoin,
                })
            });
        }
        if !self.server_pending
            && let Some(training) = self.training.as_mut()
        {
            // No server to go on: the rounds it applied past the checkpoint are gone.
            training.rounds_lost().await;
        }
    }

    /// Writes the run's record: its task, its jobs and leases, the rounds waiting for a
    /// checkpoint. A record that cannot be written ends the run: going on would hand out
    /// work that a restart could not account for.
    fn store_record(&self) -> Result<(), RunError> {
        let Some(path) = &self.record else {
            return Ok(());
        };
        let record = RunRecord {
            task: self.task.clone(),
            jobs: self
                .jobs
                .iter()
                .map(|(job, d)| RecordedJob {
                    job: job.clone(),
                    slot: d.slot,
                    peer: d.lease.peer.to_string(),
                    lease: d.lease.id,
                    price: d.lease.price,
                    rejoin: self.training.as_ref().is_some_and(|t| t.must_rejoin(job)),
                })
                .chain(self.adopting.iter().cloned())
                .collect(),
            uncommitted: self
                .training
                .as_ref()
                .map(Training::uncommitted)
                .unwrap_or_default(),
            history: self.events.history(),
            benched: self.benched.clone(),
            data_nodes: self
                .data
                .as_ref()
                .map(|data| data.data_nodes().iter().map(PeerId::to_string).collect())
                .unwrap_or_default(),
        };
        record.store(path)?;
        Ok(())
    }

    /// Follows the job until every slot is done, a slot fails for good, or `shutdown`.
    async fn drive(
        &mut self,
        channels: &mut Channels,
        shutdown: &mut (impl std::future::Future<Output = ()> + Unpin),
    ) -> Result<(), RunError> {
        self.allocate_next();
        let mut silence = tokio::time::interval(SERVER_SILENCE / 2);
        silence.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            if !self.server_pending {
                for adoption in std::mem::take(&mut self.parked) {
                    self.adopted(adoption).await?;
                }
            }
            if self.slots.complete() {
                // A parameter server exits only once its last checkpoint is stored, and that
                // was told before it heard so: count it before the run's end is judged.
                while let Ok((round, bytes)) = channels.checkpoints.try_recv() {
                    self.checkpoint_stored(round, bytes).await?;
                }
                return self.completed().await;
            }
            self.tell_task_peers();
            let peers_due = self.peers_due;
            tokio::select! {
                _ = &mut *shutdown => return Err(RunError::Interrupted),
                () = sleep_until(peers_due) => {}
                Some(ended) = self.tasks.join_next() => match ended {
                    Ok(internal) => self.on_task(internal).await?,
                    // A task that panicked took its leases with it (dropped, so released);
                    // its slots stay where they were.
                    Err(error) => tracing::warn!(%error, "a task of the run failed"),
                },
                Some((peer, report)) = channels.statuses.recv() => self.on_status(peer, report).await?,
                Some(lost) = channels.lost.recv() => self.on_lost(lost).await?,
                Some((peer, job, payload, answer)) = channels.executor_statuses.recv() => {
                    self.on_executor_status(peer, job, payload, answer).await?;
                }
                Some((round, bytes)) = channels.checkpoints.recv() => self.checkpoint_stored(round, bytes).await?,
                _ = silence.tick() => self.on_server_silence().await?,
            }
        }
    }

    /// A parameter server that went quiet may have lost its worker: its lease is renewed now,
    /// so that a worker that is gone is replaced within seconds, not a lease period. One taken
    /// over that has not said which round it is at within [`FIRST_STATUS_PATIENCE`] is
    /// replaced from the checkpoint: the trainers wait for it.
    async fn on_server_silence(&mut self) -> Result<(), RunError> {
        let silent = self.server_heard.elapsed();
        if silent < SERVER_SILENCE {
            return Ok(());
        }
        let server = self
            .jobs
            .iter()
            .find(|(_, d)| self.slots.role(d.slot) == Role::ParameterServer);
        let Some((job, server)) = server else {
            return Ok(());
        };
        if self.server_pending && silent >= FIRST_STATUS_PATIENCE {
            let reason = format!(
                "the parameter server taken over sent no status within {} s",
                FIRST_STATUS_PATIENCE.as_secs()
            );
            let job = job.clone();
            return self.ended(&job, Some(reason)).await;
        }
        if !self.server_pending {
            server.lease.probe();
            self.server_heard = std::time::Instant::now();
        }
        Ok(())
    }

    /// Every slot is done: the job succeeded, unless it should have used its data up.
    async fn completed(&self) -> Result<(), RunError> {
        // A DiLoCo job with a number of rounds ends with its rounds, data left or not.
        let ends_with_data = self.spec.diloco.as_ref().is_none_or(|d| d.rounds.is_none());
        match &self.data {
            Some(data) if ends_with_data && !data.finished().await => Err(RunError::Unfinished),
            _ => Ok(()),
        }
    }

    /// Starts the next allocation the slots want, if any. An elastic run below its `max`
    /// advertises for more trainers whenever no other allocation is needed, pausing
    /// [`JOINERS_PAUSE`] after an advertisement nobody answered.
    fn allocate_next(&mut self) {
        let now = tokio::time::Instant::now();
        let optional = now >= self.joiners_after;
        let Some(Allocation {
            role,
            slots,
            at_least,
        }) = self.slots.next_allocation(optional)
        else {
            if !optional && !self.joiners_timer {
                self.joiners_timer = true;
                let due = self.joiners_after;
                self.tasks.spawn(async move {
                    tokio::time::sleep_until(due).await;
                    Internal::JoinersDue
                });
            }
            return;
        };
        let busy: HashSet<PeerId> = self
            .jobs
            .values()
            .map(|j| j.lease.peer)
            .chain(self.benched.iter().filter_map(|b| b.peer.parse().ok()))
            .collect();
        let allocator = self.allocator.clone();
        let request = self.work(role).request.clone();
        let lost = self.lost.clone();
        self.tasks.spawn(async move {
            let leased = allocator
                .allocate(&request, (at_least, slots.len()), &busy, &lost)
                .await;
            Internal::Allocated {
                slots,
                optional: at_least == 0,
                leased,
            }
        });
    }

    fn work(&self, role: Role) -> &Work {
        match (role, &self.server) {
            (Role::ParameterServer | Role::Standby, Some(server)) => server,
            _ => &self.trainer,
        }
    }

    async fn on_task(&mut self, internal: Internal) -> Result<(), RunError> {
        match internal {
            Internal::Allocated {
                slots,
                optional,
                leased,
            } => {
                let leased = match leased {
                    Ok(leased) => leased,
                    // More trainers were only welcome: the run goes on with those it has.
                    Err(error) if optional => {
                        tracing::debug!(%error, "an advertisement for more trainers failed");
                        Vec::new()
                    }
                    Err(error) => return Err(error.into()),
                };
                if optional && leased.is_empty() {
                    self.joiners_after = tokio::time::Instant::now() + JOINERS_PAUSE;
                }
                for (slot, lease) in slots.into_iter().zip(leased) {
                    if !self.slots.allocating(slot) {
                        // The run's work ended meanwhile: the lease goes back (dropped).
                        continue;
                    }
                    match lease.lost() {
                        // Lost before it was taken up: the slot is wanted again.
                        Some(reason) => {
                            tracing::info!(peer = %lease.peer, %reason, "a worker was lost right after it was leased")
                        }
                        None => {
                            self.events.record(Event::Leased {
                                slot,
                                peer: lease.peer.to_string(),
                                lease: lease.id,
                                price: lease.price,
                            });
                            self.dispatch(slot, lease)?;
                        }
                    }
                }
                self.slots.allocation_ended();
                self.allocate_next();
            }
            Internal::JoinersDue => {
                self.joiners_timer = false;
                self.allocate_next();
            }
            Internal::Adopted(adoption) => self.adopted(adoption).await?,
            Internal::Dispatch { job, result } => {
                let Some(dispatched) = self.jobs.get(&job) else {
                    return Ok(());
                };
                let (slot, peer) = (dispatched.slot, dispatched.lease.peer.to_string());
                match result {
                    Ok(()) => {
                        self.announce_dispatched(&job);
                        if self.slots.role(slot) == Role::Standby {
                            self.forward_checkpoint();
                        }
                    }
                    Err(error) => {
                        let reason = format!("dispatch failed: {error}");
                        self.events.record(Event::Lost {
                            slot,
                            peer,
                            reason: reason.clone(),
                        });
                        self.ended(&job, Some(reason)).await?;
                    }
                }
            }
            Internal::Forwarded { round, result } => {
                self.forwarding = false;
                match result {
                    Ok(()) => tracing::debug!(round, "the standby has the checkpoint"),
                    Err(error) => {
                        tracing::warn!(round, %error, "the checkpoint did not reach the standby")
                    }
                }
                if std::mem::take(&mut self.forward_again) {
                    self.forward_checkpoint();
                }
            }
            Internal::Stopped(what) => {
                tracing::debug!(what, "the network stopped handing the job what it receives");
            }
        }
        Ok(())
    }

    /// A lease of the earlier run was taken over, or could not be: its job goes on, or a new
    /// one starts in its slot. Trainers wait while it is not known whether the earlier
    /// parameter server goes on.
    async fn adopted(&mut self, mut adoption: Adoption) -> Result<(), RunError> {
        let role = self.slots.role(adoption.slot);
        if role == Role::Trainer && self.server_pending {
            self.parked.push(adoption);
            return Ok(());
        }
        // Lost while it waited.
        if let Ok(lease) = &adoption.lease
            && let Some(reason) = lease.lost()
        {
            adoption.lease = Err(reason.to_string());
            adoption.going_on = false;
        }
        let Adoption {
            slot,
            peer,
            job,
            lease,
            going_on,
            rejoin,
        } = adoption;
        self.adopting.retain(|recorded| recorded.job != job);
        if !going_on {
            if let Some(training) = self.training.as_mut() {
                training.takeover_ended(peer);
            }
            self.live.remove(peer, &job);
            self.ended_early.retain(|(_, report)| report.job != job);
            // The earlier run's job is stopped (or its lease is gone): what it held goes back.
            self.release_data(peer, &job).await;
            if role == Role::ParameterServer && self.server_pending {
                // The rounds it applied past the checkpoint are gone with it: a new server is
                // restored from the checkpoint, as after any failover.
                self.server_pending = false;
                let trained = self.training.as_ref().map_or(0, Training::round);
                if let Some(training) = self.training.as_mut() {
                    training.rounds_lost().await;
                }
                let round = self.restore.unwrap_or(0);
                self.events.record(Event::Failover {
                    peer: peer.to_string(),
                    reason: match &lease {
                        Err(reason) => reason.clone(),
                        Ok(_) => "its job ended while the scheduler was away".into(),
                    },
                    round,
                    lost_rounds: trained.saturating_sub(round),
                    standby: None,
                });
            }
        }
        match lease {
            Ok(lease) => {
                self.events.record(Event::Readopted {
                    slot,
                    peer: peer.to_string(),
                    lease: lease.id,
                    job: going_on.then(|| job.clone()),
                });
                if going_on {
                    self.take_over(slot, job, *lease, rejoin).await
                } else {
                    self.dispatch(slot, *lease)
                }
            }
            Err(reason) => {
                tracing::info!(slot, %peer, %reason, "the earlier run's lease is gone; leasing another worker");
                self.slots.adoption_failed(slot);
                self.store_record()?;
                self.allocate_next();
                Ok(())
            }
        }
    }

    /// Goes on with `job` of the earlier run, still running under `lease`: a trainer trains
    /// on with the parameter server that went on, or joins the one restored from the
    /// checkpoint as trainers do after a failover; a parameter server says in its first
    /// status which round it is at.
    async fn take_over(
        &mut self,
        slot: usize,
        job: String,
        lease: Lease,
        rejoin: bool,
    ) -> Result<(), RunError> {
        let peer = lease.peer;
        let role = self.slots.role(slot);
        if let Some(training) = self.training.as_mut() {
            match role {
                Role::Trainer => training.trainer_taken_over(&job, peer, rejoin),
                // A standby does not go on ([`goes_on`]): a new one follows the server.
                Role::Standby => {}
                Role::ParameterServer => {
                    training.server_taken_over(&job, peer);
                    self.server_heard = std::time::Instant::now();
                    if let Some(checkpoints) = &self.checkpoints {
                        checkpoints.accept_from(Some(peer));
                        // Those of the rounds recorded applied (the last one, of a server
                        // that finished, comes without another status).
                        if let Some(round) = training.recorded_through() {
                            checkpoints.accept_up_to(round);
                        }
                    }
                }
            }
        }
        self.slots.started(slot, &job);
        self.live.insert(peer, &job);
        self.jobs.insert(
            job.clone(),
            Dispatched {
                slot,
                lease,
                // Taken over running: the earlier process announced it.
                announced: true,
                // What the earlier process told its worker is not known: told again.
                peers_version: 0,
            },
        );
        self.task_peers_changed();
        self.peers_due = Some(tokio::time::Instant::now());
        self.store_record()?;
        let early = self
            .ended_early
            .iter()
            .position(|(p, r)| *p == peer && r.job == job);
        if let Some(at) = early {
            let (peer, report) = self.ended_early.swap_remove(at);
            self.on_status(peer, report).await?;
        }
        Ok(())
    }

    /// The role of `job` on `peer` when it is a job of the earlier run that may go on, whose
    /// lease is being taken over.
    fn taking_over(&self, peer: PeerId, job: &str) -> Option<Role> {
        self.adopting
            .iter()
            .find(|recorded| {
                recorded.job == job
                    && recorded.peer == peer.to_string()
                    && goes_on(self.spec, recorded.slot, self.restore)
            })
            .map(|recorded| self.slots.role(recorded.slot))
    }

    /// Notes who the task's peers are now (the workers of its jobs: with the scheduler, the
    /// only peers whose transfers the jobs take), and when the workers must hear it: at once
    /// when a worker joined (the others must take its transfers), within
    /// [`PEERS_LEFT_WITHIN`] when workers only left. [`Run::tell_task_peers`] tells them.
    ///
    /// Told once per turn of the run's loop, not once per change: a run that dispatches 64
    /// jobs at once, or whose 64 jobs end within a second, tells each worker once or twice
    /// instead of once per job (quadratic: 2,000 requests at 64 workers, measured by
    /// `hypha-bench allocation`).
    fn task_peers_changed(&mut self) {
        let peers: Vec<String> = self
            .jobs
            .values()
            .map(|d| d.lease.peer.to_string())
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        if peers == self.told_peers.peers {
            return;
        }
        let joined = peers.iter().any(|p| !self.told_peers.peers.contains(p));
        self.told_peers = TaskPeers {
            version: unix_ms().max(self.told_peers.version + 1),
            peers,
        };
        let now = tokio::time::Instant::now();
        let due = if joined { now } else { now + PEERS_LEFT_WITHIN };
        self.peers_due = Some(self.peers_due.map_or(due, |earlier| earlier.min(due)));
    }

    /// Tells each worker whose jobs know an older list of the task's peers the current one,
    /// once it is due (see [`Run::task_peers_changed`]); a job whose dispatch is not
    /// answered yet is told once it is (its dispatch carried the list of its time).
    ///
    /// Sent in the background. The lists carry rising versions, so one that arrives late
    /// changes nothing; one that arrives before the dispatch it follows (answered `Gone`) is
    /// sent again for a few seconds. A worker that never hears it keeps what it was told
    /// before, and a sender it refuses tries again for a while (`not_in_task` is transient).
    fn tell_task_peers(&mut self) {
        if self
            .peers_due
            .is_none_or(|due| due > tokio::time::Instant::now())
        {
            return;
        }
        self.peers_due = None;
        let version = self.told_peers.version;
        let mut workers = HashSet::new();
        // Jobs still being dispatched are told when they answer (`announce_dispatched`).
        for job in self.jobs.values_mut().filter(|job| job.announced) {
            if job.peers_version < version {
                job.peers_version = version;
                workers.insert(job.lease.peer);
            }
        }
        for worker in workers {
            let network = self.network.clone();
            let request = Request::TaskPeers {
                task: self.task.clone(),
                peers: self.told_peers.clone(),
            };
            tokio::spawn(async move {
                for _ in 0..TASK_PEERS_TRIES {
                    match network.request(worker, request.clone()).await {
                        Err(NetworkError::Remote { error, .. })
                            if error.code == ErrorCode::Gone =>
                        {
                            tokio::time::sleep(TASK_PEERS_RETRY).await;
                        }
                        Err(error) => {
                            tracing::debug!(%worker, %error, "a worker did not hear who its task's peers are");
                            return;
                        }
                        Ok(_) => return,
                    }
                }
            });
        }
    }

    /// Dispatches the slot's executor under `lease`; the answer comes back as a task.
    fn dispatch(&mut self, slot: usize, lease: Lease) -> Result<(), RunError> {
        let id = uuid::Uuid::new_v4().to_string();
        let role = self.slots.role(slot);
        let work = self.work(role);
        let restore = match role {
            Role::ParameterServer => self.restore,
            Role::Trainer | Role::Standby => None,
        };
        let config = work.config.json(role, restore);
        let mut spec = JobSpec {
            id: id.clone(),
            task: self.task.clone(),
            lease: lease.id,
            executor: work.request.executor.clone(),
            config,
            secrets: self.spec.secrets.clone(),
            artifacts: work.artifacts.clone(),
            // An elastic run's later joiners find the others there already.
            artifact_peers: if work.artifacts.is_empty() {
                0
            } else {
                self.spec.workers.min
            },
            task_peers: TaskPeers::default(),
        };
        // Known to the training before the job can send its first status or checkpoint.
        if let Some(training) = self.training.as_mut() {
            match role {
                Role::ParameterServer => training.server_started(&id, lease.peer, restore),
                Role::Standby => training.standby_started(&id, lease.peer),
                Role::Trainer => training.trainer_started(&id, lease.peer),
            }
        }
        if role == Role::ParameterServer {
            self.server_heard = std::time::Instant::now();
            if let Some(checkpoints) = &self.checkpoints {
                checkpoints.accept_from(Some(lease.peer));
            }
        }
        self.slots.started(slot, &id);
        let network = self.network.clone();
        let peer = lease.peer;
        self.live.insert(peer, &id);
        self.jobs.insert(
            id.clone(),
            Dispatched {
                slot,
                lease,
                announced: false,
                peers_version: 0,
            },
        );
        self.task_peers_changed();
        spec.task_peers = self.told_peers.clone();
        if let Some(job) = self.jobs.get_mut(&id) {
            job.peers_version = spec.task_peers.version;
        }
        self.store_record()?;
        // The checkpoint goes with the dispatch of a restored server, which waits for it.
        let checkpoint = match (restore, &self.checkpoints) {
            (Some(_), Some(checkpoints)) => checkpoints.open(),
            _ => None,
        };
        let task = self.task.clone();
        self.tasks.spawn(async move {
            let mut result = network
                .request(peer, Request::Dispatch(spec))
                .await
                .map(drop)
                .map_err(|e| e.to_string());
            if let (Ok(()), Some((round, file))) = (&result, checkpoint) {
                result = send_checkpoint(&network, peer, task, file)
                    .await
                    .map(drop)
                    .map_err(|e| format!("the checkpoint of round {round} did not reach it: {e}"));
            }
            Internal::Dispatch { job: id, result }
        });
        Ok(())
    }

    async fn on_status(&mut self, peer: PeerId, report: StatusReport) -> Result<(), RunError> {
        let Some(dispatched) = self.jobs.get(&report.job) else {
            if self.taking_over(peer, &report.job).is_some() && report.status != JobStatus::Running
            {
                // It ended while its lease was being taken over: heard once it is.
                self.ended_early.push((peer, report));
            }
            return Ok(());
        };
        if dispatched.lease.peer != peer {
            return Ok(());
        }
        // A job can end before its dispatch's answer is in: its status says it was
        // dispatched, and every job's `dispatched` comes before its status.
        self.announce_dispatched(&report.job);
        let Some(dispatched) = self.jobs.get(&report.job) else {
            return Ok(());
        };
        self.events.record(Event::Status {
            slot: dispatched.slot,
            job: report.job.clone(),
            peer: peer.to_string(),
            status: report.status.clone(),
        });
        let failure = match report.status {
            JobStatus::Running => return Ok(()),
            JobStatus::Finished { exit_code: 0, .. } => None,
            JobStatus::Finished {
                exit_code,
                stderr_tail,
            } => Some(with_stderr(format!("exit code {exit_code}"), &stderr_tail)),
            JobStatus::Failed {
                reason,
                stderr_tail,
            } => Some(with_stderr(reason, &stderr_tail)),
        };
        self.ended(&report.job, failure).await
    }

    /// Records that `job` was dispatched, once.
    fn announce_dispatched(&mut self, job: &str) {
        let Some(dispatched) = self.jobs.get_mut(job).filter(|d| !d.announced) else {
            return;
        };
        dispatched.announced = true;
        if dispatched.peers_version < self.told_peers.version {
            self.peers_due = Some(tokio::time::Instant::now());
        }
        let (slot, peer) = (dispatched.slot, dispatched.lease.peer.to_string());
        self.events.record(Event::Dispatched {
            slot,
            job: job.to_string(),
            peer,
        });
    }

    async fn on_lost(&mut self, lost: Lost) -> Result<(), RunError> {
        let Some((job, slot)) = self
            .jobs
            .iter()
            .find(|(_, j)| j.lease.peer == lost.peer && j.lease.id == lost.lease)
            .map(|(job, j)| (job.clone(), j.slot))
        else {
            return Ok(());
        };
        self.events.record(Event::Lost {
            slot,
            peer: lost.peer.to_string(),
            reason: lost.reason.clone(),
        });
        self.ended(&job, Some(lost.reason)).await
    }

    /// Job `job` ended (`failure`: why not successfully): its lease goes back, its data
    /// goes back, and its slot is done or wants another worker.
    async fn ended(&mut self, job: &str, mut failure: Option<String>) -> Result<(), RunError> {
        let Some(dispatched) = self.jobs.remove(job) else {
            return Ok(());
        };
        self.task_peers_changed();
        let role = self.slots.role(dispatched.slot);
        if role == Role::ParameterServer && self.server_pending && failure.is_none() {
            // A server taken over that finished before it said where it was: the earlier
            // process told it training was over, or it is replaced.
            let round = self.checkpoints.as_ref().and_then(Checkpoints::round);
            let over = match self.training.as_mut() {
                Some(training) => training.ended_with(round).await,
                None => true,
            };
            if !over {
                failure = Some("it ended before it said which round it was at".into());
            }
        }
        self.live.remove(dispatched.lease.peer, job);
        let peer = dispatched.lease.peer;
        drop(dispatched.lease);
        // A trainer that progressed (it trained a round) spent no attempt: elastic runs see
        // workers come and go all the time, and the attempts are for jobs that cannot run.
        let progressed = self.training.as_ref().is_some_and(|t| t.joined(job));
        // Known to the rounds first: a trainer whose update of the open round is (or may be)
        // at the server keeps its slices of that round until the round settles.
        let server = self.training.as_mut().is_some_and(|t| t.ended(job));
        self.release_data(peer, job).await;
        // A server that failed is replaced by its standby where that holds a round the run
        // reached; the rounds before it are kept.
        let stored = self.checkpoints.as_ref().and_then(Checkpoints::round);
        let promotion = match (server, &failure, &self.training) {
            (true, Some(_), Some(training)) => training.promotion(stored),
            _ => None,
        };
        if server {
            // A server taken over that ended before it said where it was does not go on.
            self.server_pending = false;
            if let Some(checkpoints) = &self.checkpoints {
                checkpoints.accept_from(None);
            }
            if let (Some(training), Some(_)) = (self.training.as_mut(), &failure) {
                let kept = promotion.as_ref().map_or(0, |p| p.round);
                training.rounds_lost_from(kept).await;
            }
        }
        self.store_record()?;
        let Some(reason) = failure else {
            self.slots.finished(job);
            let no_work = self.training.is_none() && self.data.is_none();
            // A server that finished ended the training: a standby's slot still wanting a
            // worker (its last one took over) wants none now.
            if (self.spec.workers.elastic() || server) && (no_work || self.work_done().await) {
                // No worker that joins now would have anything to do.
                self.slots.close();
            }
            return Ok(());
        };
        if let Some(promotion) = promotion {
            return self.promote(job, peer, &reason, promotion);
        }
        if server {
            self.fail_over(peer, &reason)?;
        }
        let verdict = self.slots.failed(job, progressed);
        if !server && self.work_done().await {
            // Training or the data is done: nobody replaces it.
            self.slots.close();
            return Ok(());
        }
        match verdict {
            Verdict::Exhausted { slot, attempts } => Err(RunError::Exhausted {
                slot,
                attempts,
                last: reason,
            }),
            Verdict::GivenUp { slot, attempts } => {
                tracing::warn!(
                    slot,
                    attempts,
                    "a slot failed its attempts; the run has the trainers it needs without it and goes on"
                );
                self.allocate_next();
                Ok(())
            }
            _ => {
                self.allocate_next();
                Ok(())
            }
        }
    }

    /// Whether the run's work is done, so that no worker starting now would have anything to
    /// do: training ended, or the data is used up.
    async fn work_done(&self) -> bool {
        match (&self.training, &self.data) {
            (Some(training), _) => training.done(),
            (None, Some(data)) => data.finished().await,
            (None, None) => false,
        }
    }

    /// The trainer on `peer` is benched: its job ends (its lease and its slices go back), its
    /// slot is given up rather than filled again (a worker that lies in every update would
    /// only be replaced by the next one the market offers; elastic runs may refill it), and
    /// its worker is never leased again for the task, also after a restart.
    async fn bench(&mut self, peer: &str, round: u64) -> Result<(), RunError> {
        let Some((job, slot)) = self
            .jobs
            .iter()
            .find(|(_, d)| {
                d.lease.peer.to_string() == peer && self.slots.role(d.slot) == Role::Trainer
            })
            .map(|(job, d)| (job.clone(), d.slot))
        else {
            return Ok(());
        };
        let refusals = self
            .spec
            .diloco
            .as_ref()
            .map_or(0, |d| d.bench_after_refusals);
        self.events.record(Event::Benched {
            slot,
            job: job.clone(),
            peer: peer.to_string(),
            round,
            refusals,
        });
        self.benched.push(BenchedTrainer {
            peer: peer.to_string(),
            slot,
        });
        self.ended(&job, None).await
    }

    /// The parameter server on `peer` is gone: the next one is restored from the checkpoint
    /// held here. Without one, it starts afresh when no round was applied yet; otherwise the
    /// run cannot go on with the model it trained.
    fn fail_over(&mut self, peer: PeerId, reason: &str) -> Result<(), RunError> {
        let held = self.checkpoints.as_ref().and_then(Checkpoints::round);
        let trained = self.training.as_ref().map_or(0, Training::round);
        if held.is_none() && trained > 0 {
            return Err(RunError::ServerLost {
                peer: peer.to_string(),
                reason: reason.to_string(),
            });
        }
        self.restore = held;
        self.events.record(Event::Failover {
            peer: peer.to_string(),
            reason: reason.to_string(),
            round: held.unwrap_or(0),
            lost_rounds: trained.saturating_sub(held.unwrap_or(0)),
            standby: None,
        });
        Ok(())
    }

    /// The server's job `lost` on `peer` failed, and its standby takes over at the round it
    /// holds: its job moves into the server's slot, the trainers join it, and a new standby
    /// is leased. The rounds after that one are lost; those before wait for its checkpoints.
    fn promote(
        &mut self,
        lost: &str,
        peer: PeerId,
        reason: &str,
        promotion: Promotion,
    ) -> Result<(), RunError> {
        let trained = self.training.as_ref().map_or(0, Training::round);
        if !self.slots.promote(lost, &promotion.job) {
            return Err(RunError::ServerLost {
                peer: peer.to_string(),
                reason: format!("{reason}; its standby could not take its slot"),
            });
        }
        if let (Some(slot), Some(dispatched)) = (
            self.slots.slot_of(&promotion.job),
            self.jobs.get_mut(&promotion.job),
        ) {
            dispatched.slot = slot;
        }
        if let Some(training) = self.training.as_mut() {
            training.promote(&promotion);
        }
        if let Some(checkpoints) = &self.checkpoints {
            checkpoints.accept_from(Some(promotion.peer));
        }
        self.server_heard = std::time::Instant::now();
        self.events.record(Event::Failover {
            peer: peer.to_string(),
            reason: reason.to_string(),
            round: promotion.round,
            lost_rounds: trained.saturating_sub(promotion.round),
            standby: Some(promotion.peer.to_string()),
        });
        self.task_peers_changed();
        self.store_record()?;
        self.allocate_next();
        Ok(())
    }

    /// Job `job` on `peer` ended: its slices go back (a trainer's once its applied rounds
    /// are settled).
    async fn release_data(&mut self, peer: PeerId, job: &str) {
        match (self.training.as_mut(), &self.data) {
            (Some(training), _) => training.release(peer, job).await,
            (None, Some(data)) => data.release(&peer, job).await,
            (None, None) => {}
        }
    }

    async fn checkpoint_stored(&mut self, round: u64, bytes: u64) -> Result<(), RunError> {
        if let Some(training) = self.training.as_mut() {
            training.checkpoint_stored(round, bytes).await;
            self.store_record()?;
        }
        self.forward_checkpoint();
        Ok(())
    }

    /// Sends the newest checkpoint held to the standby, if one runs: one at a time, the
    /// newest again when one was stored meanwhile. Over this scheduler's link, not the
    /// server's.
    fn forward_checkpoint(&mut self) {
        if self.forwarding {
            self.forward_again = true;
            return;
        }
        let standby = self
            .jobs
            .values()
            .find(|d| self.slots.role(d.slot) == Role::Standby)
            .map(|d| d.lease.peer);
        let (Some(peer), Some((round, file))) = (
            standby,
            self.checkpoints.as_ref().and_then(Checkpoints::open),
        ) else {
            return;
        };
        self.forwarding = true;
        let network = self.network.clone();
        let task = self.task.clone();
        self.tasks.spawn(async move {
            let result = send_checkpoint(&network, peer, task, file)
                .await
                .map(drop)
                .map_err(|e| e.to_string());
            Internal::Forwarded { round, result }
        });
    }

    async fn on_executor_status(
        &mut self,
        peer: PeerId,
        job: String,
        payload: serde_json::Value,
        answer: oneshot::Sender<String>,
    ) -> Result<(), RunError> {
        // Only the worker running a job speaks for it.
        let Some(dispatched) = self.jobs.get(&job).filter(|d| d.lease.peer == peer) else {
            // A job being taken over waits until it is.
            let _ = answer.send(match (&self.training, self.taking_over(peer, &job)) {
                (Some(_), Some(Role::Trainer)) => Training::wait_order(),
                (Some(_), Some(Role::ParameterServer)) => Training::server_wait_order(),
                (Some(_), Some(Role::Standby)) => Training::standby_wait_order(),
                _ => RECEIVED.to_string(),
            });
            return Ok(());
        };
        if self.slots.role(dispatched.slot) == Role::ParameterServer {
            self.server_heard = std::time::Instant::now();
        }
        let answered = match self.training.as_mut() {
            Some(training) => training.status(&job, &payload).await,
            None => None,
        };
        match answered {
            Some(Answered {
                resumed: Some(Err(reason)),
                payload,
                ..
            }) => {
                let _ = answer.send(payload);
                let reason = format!("the parameter server taken over cannot go on: {reason}");
                self.ended(&job, Some(reason)).await?;
            }
            Some(answered) => {
                if let Some(Ok(unheard)) = answered.resumed {
                    // It goes on: the trainers taken over train on with it, and its
                    // checkpoints up to the round it is at are taken.
                    self.server_pending = false;
                    if let Some(applied) = unheard {
                        self.events.record(Event::Round {
                            round: applied.round,
                            trainers: applied.included.len(),
                            samples: applied.samples,
                            loss: applied.loss,
                            away: true,
                        });
                    }
                    self.store_record()?;
                    if let (Some(checkpoints), Some(training)) = (&self.checkpoints, &self.training)
                    {
                        checkpoints.accept_up_to(training.round());
                    }
                }
                if answered.applied.is_some() {
                    // Recorded before the server hears its round was taken: only then may it
                    // send the round's checkpoint, which makes the round's slices used.
                    self.store_record()?;
                    if let (Some(checkpoints), Some(training)) = (&self.checkpoints, &self.training)
                    {
                        checkpoints.accept_up_to(training.round());
                    }
                }
                if answered.rejoined {
                    // A restarted scheduler must not tell it to join again (and drop the
                    // round its update may be in).
                    self.store_record()?;
                }
                let _ = answer.send(answered.payload);
                self.report_news();
                if let Some(applied) = answered.applied {
                    self.events.record(Event::Round {
                        round: applied.round,
                        trainers: applied.included.len(),
                        samples: applied.samples,
                        loss: applied.loss,
                        away: false,
                    });
                    for peer in &applied.benched {
                        self.bench(peer, applied.round).await?;
                    }
                }
            }
            None => {
                let _ = answer.send(RECEIVED.to_string());
                self.events.record(Event::ExecutorStatus { job, payload });
            }
        }
        Ok(())
    }

    /// Records what the rounds say happened to the trainers.
    fn report_news(&mut self) {
        let Some(training) = self.training.as_mut() else {
            return;
        };
        for news in training.take_news() {
            let event = match news {
                News::Waiting {
                    ready,
                    trainers,
                    grace_ms,
                } => Event::WaitingForTrainers {
                    ready,
                    trainers,
                    grace_s: grace_ms as f64 / 1000.0,
                },
                News::Began {
                    round,
                    ready,
                    late,
                    waited_ms,
                } => Event::RoundsBegin {
                    round,
                    trainers: ready,
                    late,
                    waited_s: waited_ms as f64 / 1000.0,
                },
                News::Joined { job, peer, round } => {
                    let Some(slot) = self.jobs.get(&job).map(|d| d.slot) else {
                        continue;
                    };
                    Event::Joined {
                        slot,
                        job,
                        peer,
                        round,
                    }
                }
            };
            self.events.record(event);
        }
    }

    /// The one way a run ends: every task stops (an allocation in flight releases what it
    /// leased), every lease goes back (which stops its job on the worker), every job's data
    /// goes back, and the outcome is recorded.
    async fn finish(mut self, outcome: Result<(), RunError>) -> Result<(), RunError> {
        self.tasks.shutdown().await;
        for (job, dispatched) in std::mem::take(&mut self.jobs) {
            let peer = dispatched.lease.peer;
            drop(dispatched.lease);
            self.release_data(peer, &job).await;
        }
        self.allocator.settle(RELEASE_LIMIT).await;
        if let Some(training) = self.training.take() {
            training.finish().await;
        }
        match (&outcome, &self.record) {
            // Done: nothing to resume.
            (Ok(()), Some(path)) => {
                if let Err(error) = std::fs::remove_file(path) {
                    tracing::debug!(%error, "the run's record was not removed");
                }
            }
            // Every lease is given back: what is left to resume is the task and the
            // checkpoint.
            (Err(_), Some(_)) => {
                if let Err(error) = self.store_record() {
                    tracing::warn!(%error, "the run's record could not be updated");
                }
            }
            _ => {}
        }
        self.events.record(Event::Done {
            ok: outcome.is_ok(),
            message: match &outcome {
                Ok(()) => {
                    let trainers = self.slots.done(Role::Trainer);
                    match &self.spec.diloco {
                        Some(_) => {
                            format!("{trainers} trainers and the parameter server finished")
                        }
                        None => format!("{trainers} workers finished"),
                    }
                }
                Err(e) => e.to_string(),
            },
        });
        outcome
    }
}

/// Sends the checkpoint in `file` to the jobs of `task` on `peer`.
async fn send_checkpoint(
    network: &Network,
    peer: PeerId,
    task: String,
    file: std::fs::File,
) -> Result<String, hypha_transfer::SendError> {
    let size = file.metadata().map(|m| m.len()).unwrap_or(0);
    let header = hypha_transfer::Header {
        task,
        name: checkpoint::TRANSFER_NAME.to_string(),
        size,
        published: None,
        sha256: None,
    };
    hypha_transfer::send(network, peer, &header, file, hypha_transfer::SEND_PATIENCE).await
}

/// Sleeps until `deadline`, or forever without one.
async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::{Event, EventLog, with_stderr};

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

    #[test]
    fn an_executors_stderr_is_shown_short_and_printable() {
        let tail: Vec<String> = (0..30).map(|i| format!("line {i}")).collect();
        let shown = with_stderr("exit code 1".into(), &tail);
        assert!(shown.starts_with("exit code 1; the executor's stderr ended with:\n    line 10\n"));
        assert!(shown.ends_with("\n    line 29"));
        let hostile = vec![format!("ok\rerror: forged\x1b[2J{}", "x".repeat(10_000))];
        let shown = with_stderr("exit code 1".into(), &hostile);
        assert_eq!(shown.lines().count(), 2, "{shown}");
        assert!(!shown.contains('\r') && !shown.contains('\x1b'));
        assert!(shown.len() < 1_000);
        assert_eq!(with_stderr("killed".into(), &["  ".into()]), "killed");
    }
}
