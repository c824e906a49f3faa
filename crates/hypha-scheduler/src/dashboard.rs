//! The live dashboard: one page and its JSON API, served by the scheduler while a job runs
//! (`hypha-scheduler run --http 127.0.0.1:8080`, or the `http` config key).
//!
//! The run's events keep a [`Board`] up to date (its workers, rounds and recent events); the
//! iteration's counts are asked of its ledger per request. Endpoints, all `GET`:
//!
//! | path              | what                                                                |
//! |-------------------|---------------------------------------------------------------------|
//! | `/`               | the page (HTML, CSS and script served from the binary; no CDN)      |
//! | `/api/state`      | everything below in one object (what the page polls once a second) |
//! | `/api/run`        | the job, its task id, restarts and failures, and how it ended       |
//! | `/api/workers`    | per slot: role, peer, job, lease, state, pace                       |
//! | `/api/iteration`  | per epoch: available, assigned, consumed, used (`null`: no data)   |
//! | `/api/rounds`     | the DiLoCo rounds applied: trainers, samples, training loss         |
//! | `/api/held_out`   | the global models scored on the held-out data (`[data] eval`)      |
//! | `/api/events`     | the latest events, oldest first                                     |
//! | `/api/loss.svg`   | training and held-out loss by round (the plot the quickstart writes) |
//!
//! The dashboard has no login: it listens on loopback unless given another address, and
//! says so in the log when it is not. It answers only requests whose `Host` is an IP address
//! or `localhost` (421 otherwise): a web page that points a DNS name of its own at 127.0.0.1
//! (DNS rebinding) cannot make the operator's browser read it. On loopback its reader is the operator at the
//! scheduler's machine; beyond loopback anyone who reaches it reads it, so it withholds the
//! run's task id (`run.task` and `iteration.iteration` read [`WITHHELD`]): whoever knows a
//! task id could try to dispatch under it (workers refuse a second scheduler, but a first one
//! on a worker the run has not reached yet would take the id there).

use std::{
    collections::{BTreeMap, VecDeque},
    net::SocketAddr,
};

use axum::{
    Json, Router,
    extract::State,
    http::{StatusCode, header},
    response::{Html, IntoResponse, Response},
    routing::get,
};
use hypha_data::iteration::IterationService;
use hypha_messages::{
    iterate::{IterationProgress, RunProgress},
    job::JobStatus,
};
use serde::Serialize;
use tokio::sync::watch;

use crate::event::Event;

/// What the dashboard shows for the task id when it listens beyond loopback.
pub const WITHHELD: &str = "withheld (the dashboard listens beyond loopback)";

/// Events the board keeps for `/api/events`.
const RECENT_EVENTS: usize = 100;

/// The page, served as it is.
const PAGE: &str = include_str!("dashboard.html");

/// What the dashboard knows of a run from its events.
#[derive(Debug, Clone, Default)]
pub struct Board {
    job: JobView,
    task: String,
    workers: BTreeMap<usize, WorkerView>,
    rounds: Vec<RoundView>,
    held_out: Vec<HeldOutView>,
    events: VecDeque<Stamped>,
    next_event: u64,
    done: Option<Outcome>,
    iteration: Option<IterationService>,
}

/// The job file, as the dashboard names it.
#[derive(Debug, Clone, Default, Serialize)]
pub struct JobView {
    /// The job file's name without its extension.
    pub name: String,
    /// `class/name` of the trainers' executor.
    pub executor: String,
    /// The trainers' slots (an elastic run's `max`); the parameter server's slot follows.
    pub workers: usize,
    /// An elastic run's `min`; the same as `workers` otherwise.
    pub min_workers: usize,
    pub diloco: bool,
    pub dataset: Option<String>,
    pub epochs: Option<u32>,
    /// The planned rounds, when the job file limits them.
    pub rounds: Option<u64>,
}

/// One worker slot of the job.
#[derive(Debug, Clone, Serialize)]
pub struct WorkerView {
    pub slot: usize,
    /// `trainer`, `parameter server` or `worker`.
    pub role: &'static str,
    pub peer: String,
    pub job: Option<String>,
    pub lease: Option<u64>,
    pub price: Option<f64>,
    /// `leased`, `dispatched`, `running`, `finished`, `failed` or `lost`.
    pub state: &'static str,
    /// Why it failed or was lost.
    pub reason: Option<String>,
    pub since_ms: u64,
    /// Jobs dispatched to this slot so far.
    pub dispatches: u32,
    /// Its updates the parameter server refused, and those that counted for a share of
    /// themselves (clipped).
    pub refused: u32,
    pub clipped: u32,
    /// Its pace over the last 30 s, when it takes slices.
    pub slices_per_s: Option<f64>,
    pub samples_per_s: Option<f64>,
    /// How the scheduler reaches it: `direct`, `hole-punched` or `relayed` (`None`: not
    /// connected now).
    pub path: Option<String>,
}

/// A DiLoCo round the parameter server applied.
#[derive(Debug, Clone, Serialize)]
pub struct RoundView {
    pub round: u64,
    pub trainers: usize,
    pub samples: u64,
    pub loss: Option<f64>,
    pub time_ms: u64,
}

/// A global model scored on the job's held-out data.
#[derive(Debug, Clone, Serialize)]
pub struct HeldOutView {
    /// The model's round: the one round `round − 1` led to.
    pub round: u64,
    pub loss: f64,
    pub accuracy: Option<f64>,
    pub time_ms: u64,
}

/// An event as the dashboard lists it.
#[derive(Debug, Clone, Serialize)]
pub struct Stamped {
    pub seq: u64,
    pub time_ms: u64,
    pub event: serde_json::Value,
}

/// How the job ended.
#[derive(Debug, Clone, Serialize)]
pub struct Outcome {
    pub ok: bool,
    pub message: String,
    pub time_ms: u64,
}

impl Board {
    /// A board for the job `job`, whose iteration (if it has data) is `iteration`.
    pub(crate) fn new(job: JobView, iteration: Option<IterationService>) -> Self {
        Self {
            job,
            iteration,
            ..Self::default()
        }
    }

    pub(crate) fn set_task(&mut self, task: &str) {
        self.task = task.to_string();
    }

    fn role(&self, slot: usize) -> &'static str {
        match (self.job.diloco, slot >= self.job.workers) {
            (true, true) => "parameter server",
            (true, false) => "trainer",
            (false, _) => "worker",
        }
    }

    /// Takes in one event of the run.
    pub(crate) fn apply(&mut self, event: &Event, time_ms: u64) {
        match event {
            Event::Leased {
                slot,
                peer,
                lease,
                price,
            } => self.leased(*slot, peer, *lease, *price, time_ms),
            Event::Readopted {
                slot,
                peer,
                lease,
                job,
            } => {
                let worker = self.worker(*slot, peer, time_ms);
                worker.lease = Some(*lease);
                worker.state = if job.is_some() { "running" } else { "leased" };
                worker.job = job.clone();
                worker.reason = None;
            }
            Event::Dispatched { slot, job, peer } => {
                let worker = self.worker(*slot, peer, time_ms);
                worker.job = Some(job.clone());
                worker.state = "dispatched";
                worker.reason = None;
                worker.dispatches += 1;
            }
            Event::Status {
                slot, peer, status, ..
            } => {
                let worker = self.worker(*slot, peer, time_ms);
                let (state, reason) = state_of(status);
                if worker.state != state {
                    worker.since_ms = time_ms;
                }
                worker.state = state;
                worker.reason = reason;
            }
            Event::Lost { slot, peer, reason } => {
                let worker = self.worker(*slot, peer, time_ms);
                worker.state = "lost";
                worker.reason = Some(reason.clone());
            }
            Event::Benched {
                slot, peer, reason, ..
            } => {
                let worker = self.worker(*slot, peer, time_ms);
                worker.state = "benched";
                worker.reason = Some(reason.clone());
            }
            Event::Refused { peer, .. } => {
                if let Some(worker) = self.workers.values_mut().find(|w| &w.peer == peer) {
                    worker.refused += 1;
                }
            }
            Event::Clipped { peer, .. } => {
                if let Some(worker) = self.workers.values_mut().find(|w| &w.peer == peer) {
                    worker.clipped += 1;
                }
            }
            Event::Round {
                round,
                trainers,
                samples,
                loss,
                ..
            } => self.rounds.push(RoundView {
                round: *round,
                trainers: *trainers,
                samples: *samples,
                loss: *loss,
                time_ms,
            }),
            Event::Evaluated {
                round,
                loss,
                accuracy,
                ..
            } => self.held_out.push(HeldOutView {
                round: *round,
                loss: *loss,
                accuracy: *accuracy,
                time_ms,
            }),
            Event::Done { ok, message } => {
                self.done = Some(Outcome {
                    ok: *ok,
                    message: message.clone(),
                    time_ms,
                });
            }
            Event::Joined {
                slot, peer, round, ..
            } => {
                let worker = self.worker(*slot, peer, time_ms);
                worker.state = "training";
                worker.reason = Some(format!("joined at round {round}"));
                worker.since_ms = time_ms;
            }
            Event::ExecutorStatus { .. }
            | Event::DataReady { .. }
            | Event::Resumed { .. }
            | Event::Failover { .. }
            | Event::WaitingForTrainers { .. }
            | Event::RoundsBegin { .. }
            | Event::Missed { .. } => {}
        }
        // Executors report several times a round: listing them would push out everything else.
        if !matches!(event, Event::ExecutorStatus { .. }) {
            self.remember(event, time_ms);
        }
    }

    /// A worker leased for `slot`: a new view of it, counting the slot's dispatches so far.
    fn leased(&mut self, slot: usize, peer: &str, lease: u64, price: f64, time_ms: u64) {
        let dispatches = self.workers.get(&slot).map_or(0, |w| w.dispatches);
        let view = WorkerView {
            slot,
            role: self.role(slot),
            peer: peer.to_string(),
            job: None,
            lease: Some(lease),
            price: Some(price),
            state: "leased",
            reason: None,
            since_ms: time_ms,
            dispatches,
            refused: 0,
            clipped: 0,
            slices_per_s: None,
            samples_per_s: None,
            path: None,
        };
        self.workers.insert(slot, view);
    }

    /// Keeps `event` among the [`RECENT_EVENTS`] the dashboard lists.
    fn remember(&mut self, event: &Event, time_ms: u64) {
        if self.events.len() == RECENT_EVENTS {
            self.events.pop_front();
        }
        self.events.push_back(Stamped {
            seq: self.next_event,
            time_ms,
            event: serde_json::to_value(event).unwrap_or_default(),
        });
        self.next_event += 1;
    }

    /// The worker of `slot`, now on `peer` (a slot's first event may be any of them after a
    /// restart).
    fn worker(&mut self, slot: usize, peer: &str, time_ms: u64) -> &mut WorkerView {
        let role = self.role(slot);
        let worker = self.workers.entry(slot).or_insert_with(|| WorkerView {
            slot,
            role,
            peer: peer.to_string(),
            job: None,
            lease: None,
            price: None,
            state: "leased",
            reason: None,
            since_ms: time_ms,
            dispatches: 0,
            refused: 0,
            clipped: 0,
            slices_per_s: None,
            samples_per_s: None,
            path: None,
        });
        if worker.peer != peer {
            worker.peer = peer.to_string();
            worker.since_ms = time_ms;
        }
        worker
    }

    /// The rounds' training losses and the held-out losses, plotted.
    fn loss_plot(&self) -> Result<String, hypha_plot::PlotError> {
        let training: Vec<(u64, f64)> = (self.rounds.iter())
            .filter_map(|r| Some((r.round, r.loss?)))
            .collect();
        let held_out: Vec<(u64, f64)> = self.held_out.iter().map(|h| (h.round, h.loss)).collect();
        hypha_plot::loss_by_round(&training, &held_out)
    }
}

/// Everything `/api/state` answers.
#[derive(Debug, Serialize)]
pub struct Snapshot {
    pub now_ms: u64,
    pub run: RunView,
    pub workers: Vec<WorkerView>,
    pub iteration: Option<IterationProgress>,
    pub rounds: Vec<RoundView>,
    /// The global models scored on the job's held-out data (`[data] eval`).
    pub held_out: Vec<HeldOutView>,
    pub events: Vec<Stamped>,
}

/// The run as a whole: `/api/run`.
#[derive(Debug, Serialize)]
pub struct RunView {
    pub job: JobView,
    pub task: String,
    /// Restarts, re-adoptions, failovers and losses, counted over every process of the run.
    pub history: RunProgress,
    pub done: Option<Outcome>,
}

/// What the dashboard's handlers read.
#[derive(Debug, Clone)]
pub struct Sources {
    pub board: watch::Receiver<Board>,
    pub history: watch::Receiver<RunProgress>,
    /// Whether the task id is shown; [`serve`] decides by the address it listens on.
    pub reveal_task: bool,
    /// How the scheduler reaches each peer (`direct`, `hole-punched`, `relayed`), by peer id.
    pub paths: watch::Receiver<BTreeMap<String, String>>,
}

impl Sources {
    /// The board as it is now, with the iteration's counts and each worker's pace.
    pub async fn snapshot(&self) -> Snapshot {
        let (mut board, history) = (self.board.borrow().clone(), self.history.borrow().clone());
        let mut iteration = match &board.iteration {
            Some(service) => service.progress().await.ok(),
            None => None,
        };
        if !self.reveal_task {
            board.task = WITHHELD.to_string();
            if let Some(progress) = &mut iteration {
                progress.iteration = WITHHELD.to_string();
            }
        }
        let paths = self.paths.borrow().clone();
        for worker in board.workers.values_mut() {
            worker.path = paths.get(&worker.peer).cloned();
        }
        if let Some(progress) = &iteration {
            for worker in board.workers.values_mut() {
                let (Some(job), Ok(peer)) = (&worker.job, worker.peer.parse()) else {
                    continue;
                };
                let consumer = IterationService::consumer_name(&peer, job);
                if let Some(rate) = progress.consumers.iter().find(|c| c.consumer == consumer) {
                    worker.slices_per_s = Some(rate.slices_per_s);
                    worker.samples_per_s = Some(rate.samples_per_s);
                }
            }
        }
        Snapshot {
            now_ms: crate::unix_ms(),
            run: RunView {
                job: board.job,
                task: board.task,
                history,
                done: board.done,
            },
            workers: board.workers.into_values().collect(),
            iteration,
            rounds: board.rounds,
            held_out: board.held_out,
            events: board.events.into(),
        }
    }
}

/// Where the dashboard listens: `PORT` (on 127.0.0.1) or `IP:PORT`.
pub fn parse_address(text: &str) -> Result<SocketAddr, String> {
    let text = text.trim();
    if let Ok(port) = text.parse::<u16>() {
        return Ok(SocketAddr::from(([127, 0, 0, 1], port)));
    }
    text.parse::<SocketAddr>().map_err(|_| {
        format!("{text:?} is not a port or an IP:PORT (e.g. 8080, 127.0.0.1:8080, [::1]:8080)")
    })
}

/// Serves the dashboard on `listener` until the returned future is dropped.
pub async fn serve(listener: tokio::net::TcpListener, mut sources: Sources) -> std::io::Result<()> {
    let address = listener.local_addr()?;
    sources.reveal_task = address.ip().is_loopback();
    if !sources.reveal_task {
        tracing::warn!(
            %address,
            "the dashboard listens beyond this machine and has no login: anyone who reaches the address sees the job (not its task id)"
        );
    }
    let app = Router::new()
        .route("/", get(|| async { Html(PAGE) }))
        .route("/api/state", get(state))
        .route("/api/run", get(run))
        .route("/api/workers", get(workers))
        .route("/api/iteration", get(iteration))
        .route("/api/rounds", get(rounds))
        .route("/api/held_out", get(held_out))
        .route("/api/events", get(events))
        .route("/api/loss.svg", get(loss_plot))
        .layer(axum::middleware::from_fn(literal_hosts_only))
        .with_state(sources);
    axum::serve(listener, app).await
}

/// Passes on requests whose `Host` is an IP address or `localhost`; others get 421.
async fn literal_hosts_only(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let host = request
        .headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or_default();
    if is_literal_host(host) {
        next.run(request).await
    } else {
        (
            StatusCode::MISDIRECTED_REQUEST,
            "the dashboard answers requests to an IP address or localhost only",
        )
            .into_response()
    }
}

/// Whether a `Host` header (with or without a port) names an IP address or `localhost`.
fn is_literal_host(host: &str) -> bool {
    let name = match host.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or_default(),
        None => host.split(':').next().unwrap_or_default(),
    };
    name.eq_ignore_ascii_case("localhost") || name.parse::<std::net::IpAddr>().is_ok()
}

async fn state(State(sources): State<Sources>) -> Json<Snapshot> {
    Json(sources.snapshot().await)
}

async fn run(State(sources): State<Sources>) -> Json<RunView> {
    Json(sources.snapshot().await.run)
}

async fn workers(State(sources): State<Sources>) -> Json<Vec<WorkerView>> {
    Json(sources.snapshot().await.workers)
}

async fn iteration(State(sources): State<Sources>) -> Json<Option<IterationProgress>> {
    Json(sources.snapshot().await.iteration)
}

async fn rounds(State(sources): State<Sources>) -> Json<Vec<RoundView>> {
    Json(sources.board.borrow().rounds.clone())
}

async fn held_out(State(sources): State<Sources>) -> Json<Vec<HeldOutView>> {
    Json(sources.board.borrow().held_out.clone())
}

async fn events(State(sources): State<Sources>) -> Json<Vec<Stamped>> {
    Json(sources.board.borrow().events.iter().cloned().collect())
}

async fn loss_plot(State(sources): State<Sources>) -> Response {
    let plot = sources.board.borrow().loss_plot();
    match plot {
        Ok(svg) => (
            [
                (header::CONTENT_TYPE, "image/svg+xml"),
                (header::CACHE_CONTROL, "no-store"),
            ],
            svg,
        )
            .into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

/// A job's state as the dashboard shows it, and why it failed.
fn state_of(status: &JobStatus) -> (&'static str, Option<String>) {
    match status {
        JobStatus::Running => ("running", None),
        JobStatus::Finished { exit_code: 0, .. } => ("finished", None),
        JobStatus::Finished { exit_code, .. } => ("failed", Some(format!("exit code {exit_code}"))),
        JobStatus::Failed { reason, .. } => ("failed", Some(reason.clone())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_ip_addresses_and_localhost_are_hosts_it_answers() {
        for host in [
            "127.0.0.1:8080",
            "127.0.0.1",
            "localhost:8080",
            "LOCALHOST",
            "[::1]:8080",
            "10.0.0.5:80",
        ] {
            assert!(is_literal_host(host), "{host}");
        }
        for host in [
            "",
            "evil.example:8080",
            "localhost.evil.example",
            "127.0.0.1.nip.io",
        ] {
            assert!(!is_literal_host(host), "{host}");
        }
    }

    /// A browser led to the dashboard under a DNS name of an attacker's gets nothing; under
    /// its address it gets the run.
    #[tokio::test]
    async fn a_request_under_a_foreign_host_name_is_refused() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let sources = Sources {
            board: watch::channel(Board::default()).1,
            history: watch::channel(RunProgress::default()).1,
            reveal_task: false,
            paths: watch::channel(BTreeMap::new()).1,
        };
        tokio::spawn(serve(listener, sources));
        let ask = |host: String| async move {
            let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
            let request =
                format!("GET /api/run HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
            stream.write_all(request.as_bytes()).await.unwrap();
            let mut answer = String::new();
            stream.read_to_string(&mut answer).await.unwrap();
            answer
        };
        assert!(ask("evil.example".into()).await.starts_with("HTTP/1.1 421"));
        assert!(ask(address.to_string()).await.starts_with("HTTP/1.1 200"));
    }
}
