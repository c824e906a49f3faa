//! Running a job file: lease workers, dispatch the executor to each, follow the statuses,
//! replace workers that are lost or whose job fails, until every worker's share finished.
//!
//! Each worker's share of the job is a *slot*. A slot is done when its executor exits with
//! code 0. When its job fails (non-zero exit, killed, refused) or its worker is lost (a lease
//! renewal is refused or the lease lapses), the slot is given to a newly leased worker, up to
//! `max_attempts` starts per slot; the other slots carry on meanwhile.
//!
//! What happens is reported as [`Event`]s: one line each on the console and, when asked,
//! one JSON object per line in an events file.

use std::{
    collections::{HashMap, HashSet},
    io::Write,
    path::Path,
    sync::Arc,
    time::Duration,
};

use hypha_messages::{
    Error as RemoteError, ErrorCode, Request, Response,
    job::{JobSpec, JobStatus, StatusReport},
};
use hypha_network::{InboundRequest, Network};
use libp2p::PeerId;
use serde::Serialize;
use tokio::sync::{mpsc, oneshot};

use crate::{
    allocator::{AllocationError, Allocator, Kept, Leased, Lost, WorkerRequest},
    data::JobData,
    spec::JobFile,
    training::Training,
};

/// Iterate and progress requests a scheduler answers at the same time.
const ANSWERING: usize = 256;

/// How long a finished job waits for its lease releases to reach the workers.
const RELEASE_LIMIT: Duration = Duration::from_secs(5);

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
    /// The parameter server applied a DiLoCo round.
    Round {
        round: u64,
        trainers: usize,
        samples: u64,
        loss: Option<f64>,
    },
    Done {
        ok: bool,
        message: String,
    },
}

/// Where events go: always the console; optionally a JSON-lines file and an observer.
#[derive(Debug)]
pub struct EventLog {
    file: Option<std::fs::File>,
    observer: Option<mpsc::Sender<Event>>,
}

impl EventLog {
    /// Events on the console only.
    pub fn console() -> Self {
        EventLog {
            file: None,
            observer: None,
        }
    }

    /// Events on the console and, as JSON lines, in `path` (created or truncated).
    pub fn with_file(path: &Path) -> std::io::Result<Self> {
        Ok(EventLog {
            file: Some(std::fs::File::create(path)?),
            observer: None,
        })
    }

    /// Also hands every event to `observer` (a progress display, a benchmark). The job never
    /// waits for it: when its queue is full, the event is dropped for the observer.
    pub fn observed_by(mut self, observer: mpsc::Sender<Event>) -> Self {
        self.observer = Some(observer);
        self
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
            Event::Round {
                round,
                trainers,
                samples,
                loss,
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
            Event::Done { ok, message } => tracing::info!(ok, %message, "job done"),
        }
        let stamped = serde_json::json!({ "time_ms": unix_ms(), "event": &event });
        if let Some(file) = &mut self.file
            && let Ok(line) = serde_json::to_string(&stamped)
        {
            // Each line is written whole and flushed so that a reader never sees half an
            // event, even if the scheduler dies.
            let _ = writeln!(file, "{line}").and_then(|_| file.flush());
        }
        if let Some(observer) = &self.observer {
            let _ = observer.try_send(event);
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

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
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
        "the parameter server on {peer} is gone ({reason}); the global model of the last round is in its checkpoint there (parameter-server.safetensors in the job's directory)"
    )]
    ServerLost { peer: String, reason: String },
    #[error("the job file's [diloco] metrics file {path}: {error}")]
    Metrics { path: String, error: std::io::Error },
    #[error(
        "every executor exited, but the iteration still has slices that were never used; executors should fetch from their \"data\" reference until it answers that the data is done"
    )]
    Unfinished,
}

struct Running {
    slot: usize,
    peer: PeerId,
    lease: u64,
    kept: Kept,
}

struct Slot {
    attempts: u32,
    done: bool,
}

/// An executor's status and where its answer goes.
pub type ExecutorStatus = (String, serde_json::Value, oneshot::Sender<String>);

/// What an executor status is answered with when nobody has more to say.
const RECEIVED: &str = r#"{"received":true}"#;

/// Answers what reaches a scheduler from the network: offers go to the allocator, job
/// statuses to `statuses`, executor statuses to `executor_statuses`, whose answer goes back
/// to the executor.
pub fn route_inbound(
    mut inbound: mpsc::Receiver<InboundRequest>,
    allocator: Allocator,
    statuses: mpsc::Sender<(PeerId, StatusReport)>,
    executor_statuses: mpsc::Sender<ExecutorStatus>,
    data: Option<JobData>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        // Iterate and progress requests wait for the ledger: they are answered concurrently,
        // at most ANSWERING at once; the inbound queue fills behind them.
        let answering = Arc::new(tokio::sync::Semaphore::new(ANSWERING));
        while let Some(request) = inbound.recv().await {
            let peer = request.peer;
            if let (Request::Iterate(_) | Request::Progress { .. }, Some(data)) =
                (&request.request, &data)
            {
                let Ok(permit) = answering.clone().acquire_owned().await else {
                    break;
                };
                let service = data.service().clone();
                tokio::spawn(async move {
                    let response = match &request.request {
                        Request::Iterate(iterate) => {
                            service.iterate(&peer, iterate).await.map(Response::Iterate)
                        }
                        _ => service.progress().await.map(Response::Progress),
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
                                .try_send((job, payload, answer_tx))
                                .is_err()
                            {
                                Response::Error(RemoteError::new(ErrorCode::Busy, "try again"))
                            } else {
                                // The job's loop answers; the router goes on meanwhile.
                                tokio::spawn(async move {
                                    let payload =
                                        answer.await.unwrap_or_else(|_| RECEIVED.to_string());
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
    })
}

/// Runs `spec` to completion (or until `shutdown`).
pub async fn run_job(
    network: Network,
    inbound: mpsc::Receiver<InboundRequest>,
    allocator: Allocator,
    spec: JobFile,
    mut events: EventLog,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), RunError> {
    let task = uuid::Uuid::new_v4().to_string();
    tokio::pin!(shutdown);
    let data = match (&spec.data, spec.ledger_path()) {
        (Some(data), Some(ledger)) => tokio::select! {
            started = JobData::start(&network, data, &ledger, &task, |manifest| spec.check_dataset(manifest)) => Some(started?),
            _ = &mut shutdown => return Err(RunError::Interrupted),
        },
        _ => None,
    };
    let mut training = match (&spec.diloco, &data) {
        (Some(diloco), Some(data)) => {
            let path = diloco
                .metrics
                .clone()
                .unwrap_or_else(|| "metrics.jsonl".into());
            let forward = diloco.forward.as_deref();
            let started =
                Training::new(diloco.plan(), data.clone(), &path, forward).map_err(|error| {
                    RunError::Metrics {
                        path: path.display().to_string(),
                        error,
                    }
                })?;
            Some(started)
        }
        _ => None,
    };
    let (status_tx, mut statuses) = mpsc::channel(256);
    let (executor_tx, mut executor_statuses) = mpsc::channel::<ExecutorStatus>(256);
    let router = route_inbound(
        inbound,
        allocator.clone(),
        status_tx,
        executor_tx,
        data.clone(),
    );
    let trainer = Role {
        request: WorkerRequest {
            executor: spec.executor.clone(),
            resources: spec.resources,
            bid: spec.bid,
        },
        config: spec.trainer_config(data.as_ref().map(JobData::reference)),
        artifacts: spec.artifacts.clone(),
    };
    let server = spec.diloco.as_ref().map(|diloco| Role {
        request: WorkerRequest {
            executor: diloco.parameter_server.executor.clone(),
            resources: diloco.parameter_server.resources,
            bid: diloco.parameter_server.bid,
        },
        config: diloco.server_config(),
        // The built-in parameter server runs no program that could read artifacts.
        artifacts: Vec::new(),
    });
    let (lost_tx, mut lost) = mpsc::channel::<Lost>(64);
    let (replaced_tx, mut replaced) =
        mpsc::channel::<(usize, Result<Vec<Leased>, AllocationError>)>(64);
    // Slots 0..workers are the executors (trainers); a DiLoCo job's parameter server is the
    // slot after them.
    let slot_count = spec.workers + usize::from(server.is_some());
    let mut slots: Vec<Slot> = (0..slot_count)
        .map(|_| Slot {
            attempts: 0,
            done: false,
        })
        .collect();
    let mut running: HashMap<String, Running> = HashMap::new();
    let mut job = Job {
        network: network.clone(),
        allocator: allocator.clone(),
        spec: &spec,
        task: &task,
        trainer,
        server,
        lost_tx,
    };

    // The parameter server first, so that no worker is leased as both.
    let mut initial = Vec::new();
    if let Some(server) = &job.server {
        let nobody = HashSet::new();
        let leased = tokio::select! {
            leased = allocator.allocate(&server.request, 1, &nobody) => leased?,
            _ = &mut shutdown => return Err(RunError::Interrupted),
        };
        initial.extend(leased.into_iter().map(|l| (spec.workers, l)));
    }
    let taken: HashSet<PeerId> = initial.iter().map(|(_, l)| l.peer).collect();
    let trainers = tokio::select! {
        leased = allocator.allocate(&job.trainer.request, spec.workers, &taken) => leased?,
        _ = &mut shutdown => return Err(RunError::Interrupted),
    };
    initial.extend(trainers.into_iter().enumerate());
    for (slot, reason) in job
        .start(
            initial,
            &mut slots,
            &mut running,
            &mut training,
            &mut events,
        )
        .await
    {
        job.retry(slot, reason, &slots, &running, &replaced_tx)?;
    }

    // A DiLoCo job with a number of rounds ends with its rounds, data left or not.
    let ends_with_data = spec.diloco.as_ref().is_none_or(|d| d.rounds.is_none());
    let outcome = 'events: loop {
        if slots.iter().all(|s| s.done) {
            match &data {
                Some(data) if ends_with_data && !data.finished().await => {
                    break Err(RunError::Unfinished);
                }
                _ => break Ok(()),
            }
        }
        tokio::select! {
            _ = &mut shutdown => break Err(RunError::Interrupted),
            Some((peer, report)) = statuses.recv() => {
                let Some(run) = running.get(&report.job) else { continue };
                if run.peer != peer {
                    continue;
                }
                let slot = run.slot;
                events.record(Event::Status {
                    slot,
                    job: report.job.clone(),
                    peer: peer.to_string(),
                    status: report.status.clone(),
                });
                let failure = match &report.status {
                    JobStatus::Running => continue,
                    JobStatus::Finished { exit_code: 0, .. } => None,
                    JobStatus::Finished { exit_code, stderr_tail } => {
                        Some(with_stderr(format!("exit code {exit_code}"), stderr_tail))
                    }
                    JobStatus::Failed { reason, stderr_tail } => {
                        Some(with_stderr(reason.clone(), stderr_tail))
                    }
                };
                if let Some(run) = running.remove(&report.job) {
                    run.kept.release();
                    if let Some(data) = &data {
                        data.release(&run.peer, &report.job).await;
                    }
                    let server = training.as_mut().is_some_and(|t| t.ended(&report.job));
                    if let (true, Some(reason)) = (server, &failure) {
                        break Err(RunError::ServerLost { peer: peer.to_string(), reason: reason.clone() });
                    }
                }
                match failure {
                    None => slots[slot].done = true,
                    Some(reason) => {
                        if let Err(e) = job.retry(slot, reason, &slots, &running, &replaced_tx) {
                            break Err(e);
                        }
                    }
                }
            }
            Some(lost) = lost.recv() => {
                let Some(id) = running
                    .iter()
                    .find(|(_, r)| r.peer == lost.peer && r.lease == lost.lease)
                    .map(|(id, _)| id.clone())
                else {
                    continue;
                };
                let Some(run) = running.remove(&id) else { continue };
                if let Some(data) = &data {
                    data.release(&run.peer, &id).await;
                }
                events.record(Event::Lost {
                    slot: run.slot,
                    peer: lost.peer.to_string(),
                    reason: lost.reason.clone(),
                });
                if training.as_mut().is_some_and(|t| t.ended(&id)) {
                    break Err(RunError::ServerLost { peer: lost.peer.to_string(), reason: lost.reason });
                }
                if let Err(e) = job.retry(run.slot, lost.reason, &slots, &running, &replaced_tx) {
                    break Err(e);
                }
            }
            Some((slot, leased)) = replaced.recv() => match leased {
                Ok(leased) => {
                    let batch = leased.into_iter().map(|l| (slot, l)).collect();
                    for (slot, reason) in job.start(batch, &mut slots, &mut running, &mut training, &mut events).await {
                        if let Err(e) = job.retry(slot, reason, &slots, &running, &replaced_tx) {
                            break 'events Err(e);
                        }
                    }
                }
                Err(e) => break Err(e.into()),
            },
            Some((id, payload, answer)) = executor_statuses.recv() => {
                if !running.contains_key(&id) {
                    let _ = answer.send(RECEIVED.to_string());
                    continue;
                }
                let answered = match training.as_mut() {
                    Some(training) => training.status(&id, &payload).await,
                    None => None,
                };
                match answered {
                    Some(answered) => {
                        let _ = answer.send(answered.payload);
                        if let Some(applied) = answered.applied {
                            events.record(Event::Round {
                                round: applied.round,
                                trainers: applied.included.len(),
                                samples: applied.samples,
                                loss: applied.loss,
                            });
                        }
                    }
                    None => {
                        let _ = answer.send(RECEIVED.to_string());
                        events.record(Event::ExecutorStatus { job: id, payload });
                    }
                }
            }
        }
    };
    for (id, run) in running.drain() {
        let _ = network
            .request(run.peer, Request::Cancel { job: id.clone() })
            .await;
        run.kept.release();
        if let Some(data) = &data {
            data.release(&run.peer, &id).await;
        }
    }
    allocator.settle(RELEASE_LIMIT).await;
    if let Some(training) = training {
        training.finish().await;
    }
    events.record(Event::Done {
        ok: outcome.is_ok(),
        message: match &outcome {
            Ok(()) => match &spec.diloco {
                Some(_) => format!(
                    "{} trainers and the parameter server finished",
                    spec.workers
                ),
                None => format!("all {} workers finished", spec.workers),
            },
            Err(e) => e.to_string(),
        },
    });
    router.abort();
    outcome
}

/// What one kind of slot asks of a worker, and the config its executor gets.
struct Role {
    request: WorkerRequest,
    config: String,
    artifacts: Vec<hypha_messages::artifact::Request>,
}

struct Job<'a> {
    network: Network,
    allocator: Allocator,
    spec: &'a JobFile,
    task: &'a str,
    trainer: Role,
    /// A DiLoCo job's parameter server: the slot after the trainers.
    server: Option<Role>,
    lost_tx: mpsc::Sender<Lost>,
}

impl Job<'_> {
    fn role(&self, slot: usize) -> &Role {
        match &self.server {
            Some(server) if slot == self.spec.workers => server,
            _ => &self.trainer,
        }
    }

    /// Dispatches the slot's executor on a leased worker; returns why not, when it failed.
    /// Takes up leased workers: records them, keeps their leases, and dispatches their jobs
    /// all at once. Returns the slots whose dispatch failed, with why.
    async fn start(
        &mut self,
        batch: Vec<(usize, Leased)>,
        slots: &mut [Slot],
        running: &mut HashMap<String, Running>,
        training: &mut Option<Training>,
        events: &mut EventLog,
    ) -> Vec<(usize, String)> {
        let mut dispatches = Vec::with_capacity(batch.len());
        for (slot, leased) in batch {
            slots[slot].attempts += 1;
            events.record(Event::Leased {
                slot,
                peer: leased.peer.to_string(),
                lease: leased.lease,
                price: leased.price,
            });
            let kept = self.allocator.keep(&leased, self.lost_tx.clone());
            let id = uuid::Uuid::new_v4().to_string();
            let role = self.role(slot);
            let spec = JobSpec {
                id: id.clone(),
                task: self.task.to_string(),
                lease: leased.lease,
                executor: role.request.executor.clone(),
                config: role.config.clone(),
                secrets: self.spec.secrets.clone(),
                artifacts: role.artifacts.clone(),
                artifact_peers: if role.artifacts.is_empty() {
                    0
                } else {
                    self.spec.workers
                },
            };
            running.insert(
                id.clone(),
                Running {
                    slot,
                    peer: leased.peer,
                    lease: leased.lease,
                    kept,
                },
            );
            dispatches.push((slot, id, leased.peer, spec));
        }
        let network = &self.network;
        let results = futures::future::join_all(dispatches.into_iter().map(
            |(slot, id, peer, spec)| async move {
                let result = network.request(peer, Request::Dispatch(spec)).await;
                (slot, id, peer, result)
            },
        ))
        .await;
        let mut failed = Vec::new();
        for (slot, id, peer, result) in results {
            match result {
                Ok(_) => {
                    if let Some(training) = training.as_mut() {
                        if slot == self.spec.workers {
                            training.server_started(&id, peer);
                        } else {
                            training.trainer_started(&id, peer);
                        }
                    }
                    events.record(Event::Dispatched {
                        slot,
                        job: id,
                        peer: peer.to_string(),
                    });
                }
                Err(e) => {
                    if let Some(run) = running.remove(&id) {
                        run.kept.release();
                    }
                    let reason = format!("dispatch failed: {e}");
                    events.record(Event::Lost {
                        slot,
                        peer: peer.to_string(),
                        reason: reason.clone(),
                    });
                    failed.push((slot, reason));
                }
            }
        }
        failed
    }

    /// Gives `slot` to a new worker in the background, unless it has had its attempts.
    fn retry(
        &self,
        slot: usize,
        reason: String,
        slots: &[Slot],
        running: &HashMap<String, Running>,
        replaced: &mpsc::Sender<(usize, Result<Vec<Leased>, AllocationError>)>,
    ) -> Result<(), RunError> {
        if slots[slot].attempts >= self.spec.max_attempts {
            return Err(RunError::Exhausted {
                slot,
                attempts: slots[slot].attempts,
                last: reason,
            });
        }
        let busy: HashSet<PeerId> = running.values().map(|r| r.peer).collect();
        let allocator = self.allocator.clone();
        let request = self.role(slot).request.clone();
        let replaced = replaced.clone();
        tokio::spawn(async move {
            let leased = allocator.allocate(&request, 1, &busy).await;
            let _ = replaced.send((slot, leased)).await;
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::with_stderr;

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
