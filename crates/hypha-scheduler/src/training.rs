//! A DiLoCo job's side of the run loop: answers trainers' and the parameter server's statuses
//! from its [`Rounds`], settles rounds in the ledger, and writes the metrics file.
//!
//! A round's slices become used only once the round is in a checkpoint the scheduler holds
//! ([`checkpoint`](crate::checkpoint)): an applied round waits for it, and so do the slices of
//! a trainer that ended meanwhile. Rounds that a lost parameter server took with it go back.
//!
//! The metrics file gets one JSON object per line: `{"kind": "trainer", …}` for a trainer's
//! report (round, batches, samples, batch time, loss; twenty a second per trainer at most,
//! [`throttle`](crate::throttle); a status that does not read, a fingerprint of a
//! megabyte or a loss that is no number, is refused and never written) and
//! `{"kind": "round", …}` for every round the parameter server applied (with how long it took
//! the server to close and the DiLoCo bytes it moved, `close_ms` and `traffic_bytes`, and what
//! it sent its standby, `standby_bytes`), and
//! `{"kind": "checkpoint", "round", "bytes"}` for every checkpoint stored, and
//! `{"kind": "eval", "round", "peer", "loss", "accuracy", "scored"}` for every score of a
//! global model on the job's held-out data (`[data] eval`). Each line is written
//! whole and flushed, so it can be followed while the job runs. With `forward`, each line is
//! also POSTed to that URL as JSON by a background task; when the URL cannot keep up (more
//! than [`FORWARD_QUEUE`] lines waiting), lines are dropped for it, never for the file, and
//! the job never waits for it.

use std::{
    collections::{BTreeMap, HashMap},
    io::Write,
    path::Path,
};

use hypha_messages::diloco::{
    ModelOfRound, Order, ServerOrder, ServerStatus, StandbyOrder, StandbyStatus, Status,
    TrainerOrder,
};
use hypha_network::PeerId;
use serde::Serialize;

use crate::{
    data::JobData,
    record::{RecordedRound, RunRecord},
    rounds::{AppliedRound, News, RoundPlan, Rounds, Settle},
    unix_ms,
};

/// Metrics lines waiting for the `forward` URL; more are dropped.
pub const FORWARD_QUEUE: usize = 1024;
/// How long a trainer the scheduler cannot answer yet waits before it asks again.
const WAIT_MS: u64 = 200;

/// How long a finished job waits for the `forward` URL to take the lines still queued.
pub const FORWARD_FLUSH: std::time::Duration = std::time::Duration::from_secs(5);

/// A DiLoCo job's rounds, ledger and metrics.
#[derive(Debug)]
pub struct Training {
    rounds: Rounds,
    data: JobData,
    metrics: std::fs::File,
    forward: Option<(
        tokio::sync::mpsc::Sender<String>,
        tokio::task::JoinHandle<()>,
    )>,
    dropped: u64,
    peers: HashMap<String, PeerId>,
    server: Option<String>,
    round_started_ms: u64,
    /// How often each trainer's status is written to the metrics file.
    throttle: crate::throttle::Throttle,
    /// The round of the newest checkpoint the scheduler holds: the rounds before it are in the
    /// model the run continues from.
    checkpointed: Option<u64>,
    /// Applied rounds of trainers' jobs waiting for a checkpoint that holds them.
    uncommitted: Vec<Uncommitted>,
    /// Jobs that ended while rounds of theirs waited: their slices go back once those settle.
    deferred: Vec<(PeerId, String)>,
    /// The server is an earlier process's, taken over: its first status says where it is.
    resuming: bool,
    /// The trainers' jobs of the earlier process, by peer: whose slices a round the server
    /// applied while the scheduler was away used.
    earlier_trainers: HashMap<String, String>,
    /// The rounds the earlier process recorded applied past the checkpoint, with a peer
    /// included in each: what the server that goes on must have applied.
    earlier_rounds: Vec<(u64, String)>,
    /// The standby server (`[diloco] standby`), when one runs.
    standby: Option<Standby>,
    /// The fingerprint of the global model each round starts from, as the server said when
    /// it applied the round before: what a standby must hold to take over at that round.
    model_hashes: BTreeMap<u64, String>,
}

/// The standby server's job, its peer, and what it last said it holds.
#[derive(Debug)]
struct Standby {
    job: String,
    peer: PeerId,
    status: StandbyStatus,
}

/// A standby that can take over from the lost server: its job and peer, and the round whose
/// model it holds.
#[derive(Debug, Clone, PartialEq)]
pub struct Promotion {
    pub job: String,
    pub peer: PeerId,
    pub round: u64,
}

#[derive(Debug)]
struct Uncommitted {
    round: u64,
    peer: PeerId,
    job: String,
}

/// What a status was answered with, for the run loop to report.
#[derive(Debug)]
pub struct Answered {
    pub order: Order,
    pub applied: Option<AppliedRound>,
    /// The first status of a parameter server that was taken over: whether it goes on (at
    /// the round it said, with the round it applied as the earlier process died, if any), or
    /// why it cannot.
    pub resumed: Option<Result<Option<AppliedRound>, String>>,
    /// A trainer that held a model of an earlier server went on with the current one: the
    /// run's record must say so before it is answered.
    pub rejoined: bool,
}

impl Training {
    /// Starts with round 0; the metrics file at `metrics` is created or truncated (appended
    /// to when `append`: a resumed run), and each line is also POSTed to `forward`.
    pub fn new(
        plan: RoundPlan,
        data: JobData,
        metrics: &Path,
        forward: Option<&str>,
        append: bool,
    ) -> std::io::Result<Self> {
        let metrics = if append {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(metrics)?
        } else {
            std::fs::File::create(metrics)?
        };
        Ok(Self {
            rounds: Rounds::new(plan),
            data,
            metrics,
            forward: forward.map(forwarder),
            dropped: 0,
            peers: HashMap::new(),
            server: None,
            round_started_ms: unix_ms(),
            throttle: crate::throttle::Throttle::default(),
            checkpointed: None,
            uncommitted: Vec::new(),
            deferred: Vec::new(),
            resuming: false,
            earlier_trainers: HashMap::new(),
            earlier_rounds: Vec::new(),
            standby: None,
            model_hashes: BTreeMap::new(),
        })
    }

    /// Whether trainer `job` was told to train a round of the run: it did some of the work.
    pub fn joined(&self, job: &str) -> bool {
        self.rounds.joined(job)
    }

    /// What happened to the trainers since the last call (see [`News`]).
    pub fn take_news(&mut self) -> Vec<News> {
        let news = self.rounds.take_news();
        for item in &news {
            if let News::Evaluated { peer, eval } = item {
                self.record(&EvalLine {
                    kind: "eval",
                    time_ms: unix_ms(),
                    peer,
                    eval,
                });
            }
        }
        news
    }

    pub fn trainer_started(&mut self, job: &str, peer: PeerId) {
        self.peers.insert(job.to_string(), peer);
        self.rounds
            .trainer_started(job.to_string(), peer.to_string());
    }

    /// What a trainer is told when the scheduler cannot say more yet: ask again soon.
    pub fn wait_order() -> Order {
        Order::Trainer(TrainerOrder::wait(WAIT_MS))
    }

    /// What the parameter server is told when the scheduler cannot say more yet: go on
    /// collecting.
    pub fn server_wait_order() -> Order {
        Order::ParameterServer(ServerOrder::Wait)
    }

    /// Trainer `job` of an earlier process of the scheduler goes on, on `peer`; `rejoin`:
    /// that process had not yet told it to join its server.
    pub fn trainer_taken_over(&mut self, job: &str, peer: PeerId, rejoin: bool) {
        self.peers.insert(job.to_string(), peer);
        self.rounds
            .trainer_taken_over(job.to_string(), peer.to_string(), rejoin);
    }

    /// The earlier process's trainer on `peer` is being taken over (see
    /// [`Rounds::taking_over`]).
    pub fn taking_over(&mut self, peer: PeerId) {
        self.rounds.taking_over(peer.to_string());
    }

    /// The takeover of the trainer on `peer` ended without its job going on.
    pub fn takeover_ended(&mut self, peer: PeerId) {
        self.rounds.takeover_ended(&peer.to_string());
    }

    /// Whether trainer `job` is still to join the current server, for the run's record.
    pub fn must_rejoin(&self, job: &str) -> bool {
        self.rounds.must_rejoin(job)
    }

    /// The newest round a checkpoint may have from what the record holds: the round after
    /// the last one recorded applied.
    pub fn recorded_through(&self) -> Option<u64> {
        self.uncommitted.iter().map(|u| u.round + 1).max()
    }

    /// The server of an earlier process finished training with its checkpoint of `round`
    /// stored here, or the data is used up: trainers are told to finish. False when training
    /// is not over.
    pub async fn ended_with(&mut self, round: Option<u64>) -> bool {
        let over = round.is_some_and(|round| self.rounds.planned_through(round))
            || self.data.finished().await;
        if over {
            self.rounds.end();
        }
        over
    }

    /// The parameter server's job `job` of an earlier process of the scheduler goes on, on
    /// `peer`: trainers wait until its first status says which round it collects.
    pub fn server_taken_over(&mut self, job: &str, peer: PeerId) {
        self.server = Some(job.to_string());
        self.peers.insert(job.to_string(), peer);
        self.resuming = true;
    }

    /// The parameter server's job `job` starts on `peer`; a replacement restored from the
    /// checkpoint of `restored` trains on from that round.
    pub fn server_started(&mut self, job: &str, peer: PeerId, restored: Option<u64>) {
        if let Some(round) = restored {
            self.rounds.restored(round);
            // The models of the rounds after it are nobody's now.
            self.model_hashes
                .retain(|model_round, _| *model_round <= round);
        }
        self.server = Some(job.to_string());
        self.peers.insert(job.to_string(), peer);
        self.rounds.server_started(peer.to_string());
        // Trainers that hold the model it starts from need not start their round over.
        if let Some(hash) = restored.and_then(|round| self.model_hashes.get(&round)) {
            self.rounds.goes_on_from(hash.clone());
        }
    }

    /// The standby server's job `job` starts on `peer`.
    pub fn standby_started(&mut self, job: &str, peer: PeerId) {
        self.standby = Some(Standby {
            job: job.to_string(),
            peer,
            status: StandbyStatus::default(),
        });
    }

    /// What the standby is told when the scheduler cannot say more yet: go on following.
    pub fn standby_wait_order() -> Order {
        Order::Standby(StandbyOrder::Wait)
    }

    /// The standby that can take over from the server just lost, if there is one: it holds
    /// the model of a round the run reached, with the fingerprint the server gave it, and no
    /// older than the checkpoint held here (a restore from that would lose fewer rounds).
    /// `stored`: the round of the checkpoint stored here, which may be newer than the last
    /// one the run heard of. The model it held before serves when the newest is of a round
    /// the run did not hear of (the server was lost before it said it applied the round).
    pub fn promotion(&self, stored: Option<u64>) -> Option<Promotion> {
        let standby = self.standby.as_ref()?;
        let round = takeover_round(&standby.status, |round, hash| {
            round <= self.rounds.round()
                && self
                    .checkpointed
                    .max(stored)
                    .is_none_or(|held| round >= held)
                && self.model_hashes.get(&round).map(String::as_str) == Some(hash)
        })?;
        Some(Promotion {
            job: standby.job.clone(),
            peer: standby.peer,
            round,
        })
    }

    /// The standby takes over from the lost server (see [`promotion`](Self::promotion)): it
    /// serves from the round it holds, the rounds after that are gone, and the trainers join
    /// it.
    pub fn promote(&mut self, promotion: &Promotion) {
        self.standby = None;
        self.server_started(&promotion.job, promotion.peer, Some(promotion.round));
    }

    /// A job of the training ended or lost its worker; true when it was the parameter server.
    pub fn ended(&mut self, job: &str) -> bool {
        if self.standby.as_ref().is_some_and(|s| s.job == job) {
            self.standby = None;
            return false;
        }
        if self.server.as_deref() == Some(job) {
            self.peers.remove(job);
            self.server = None;
            self.resuming = false;
            self.rounds.server_lost();
            return true;
        }
        // A trainer whose update is in the open round keeps its peer until the round settles.
        if !self.rounds.trainer_ended(job, unix_ms()) {
            self.peers.remove(job);
        }
        false
    }

    /// The scheduler holds a checkpoint of `round` (`bytes` long): the rounds before it are
    /// used.
    pub async fn checkpoint_stored(&mut self, round: u64, bytes: u64) {
        self.record(&CheckpointLine {
            kind: "checkpoint",
            time_ms: unix_ms(),
            round,
            bytes,
        });
        self.checkpointed = self.checkpointed.max(Some(round));
        self.model_hashes
            .retain(|model_round, _| *model_round >= round);
        let (held, waiting) = std::mem::take(&mut self.uncommitted)
            .into_iter()
            .partition(|u| u.round < round);
        self.uncommitted = waiting;
        for u in held {
            self.settle_now(&u.peer, &u.job, u.round, true).await;
        }
        self.release_deferred().await;
    }

    /// The parameter server is gone with the rounds it applied after its last checkpoint
    /// here, and the open round: their slices go back.
    pub async fn rounds_lost(&mut self) {
        self.rounds_lost_from(0).await;
    }

    /// The parameter server is gone, and the one that takes over holds the rounds before
    /// `round`: those wait for its checkpoints; the slices of the rounds from `round` on and
    /// of the open round go back.
    pub async fn rounds_lost_from(&mut self, round: u64) {
        let (lost, held) = std::mem::take(&mut self.uncommitted)
            .into_iter()
            .partition(|u| u.round >= round);
        self.uncommitted = held;
        for u in lost {
            self.settle_now(&u.peer, &u.job, u.round, false).await;
        }
        for settle in self.rounds.abandon_departed() {
            self.settle(settle).await;
        }
        self.release_deferred().await;
    }

    /// Job `job` on `peer` ended: its slices go back, those of its rounds once they are
    /// settled (checkpoints may be rounds apart), those it fetched ahead at once.
    pub async fn release(&mut self, peer: PeerId, job: &str) {
        if self.waits(job) {
            self.data.release_assigned(&peer, job).await;
            self.deferred.push((peer, job.to_string()));
        } else {
            self.data.release(&peer, job).await;
        }
    }

    /// Whether a round of `job` waits to be settled: applied, waiting for a checkpoint, or
    /// open with its update in it.
    fn waits(&self, job: &str) -> bool {
        self.uncommitted.iter().any(|u| u.job == job) || self.rounds.departed(job)
    }

    async fn release_deferred(&mut self) {
        let (ready, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut self.deferred)
            .into_iter()
            .partition(|(_, job)| !self.waits(job));
        self.deferred = waiting;
        for (peer, job) in ready {
            self.peers.remove(&job);
            self.data.release(&peer, &job).await;
        }
    }

    /// Gives the forward URL up to [`FORWARD_FLUSH`] to take the lines still queued; the
    /// slices of jobs that ended go back, rounds that never reached a checkpoint with them.
    pub async fn finish(mut self) {
        self.rounds_lost().await;
        if let Some((lines, task)) = self.forward {
            drop(lines);
            if tokio::time::timeout(FORWARD_FLUSH, task).await.is_err() {
                tracing::warn!("the metrics URL did not take the last lines in time");
            }
        }
    }

    /// A resumed run goes on from the checkpoint of `round` the scheduler holds; the earlier
    /// run's server may have reached round `reached`. The rounds `earlier` recorded applied
    /// from `round` on wait, as they did there: for a checkpoint that holds them if its server
    /// goes on, to go back if not; the slices of its jobs that are gone go back after.
    pub fn resume_from(&mut self, round: u64, reached: u64, earlier: &RunRecord) {
        self.rounds.restored(round);
        self.rounds.reached(reached);
        self.checkpointed = Some(round);
        for recorded in earlier.uncommitted.iter().filter(|u| u.round >= round) {
            self.earlier_rounds
                .push((recorded.round, recorded.peer.clone()));
            let Ok(peer) = recorded.peer.parse::<PeerId>() else {
                continue;
            };
            self.uncommitted.push(Uncommitted {
                round: recorded.round,
                peer,
                job: recorded.job.clone(),
            });
            let running = earlier.jobs.iter().any(|j| j.job == recorded.job);
            if !running && !self.deferred.iter().any(|(_, job)| *job == recorded.job) {
                self.deferred.push((peer, recorded.job.clone()));
            }
        }
        self.earlier_trainers = earlier
            .jobs
            .iter()
            .map(|j| (j.peer.clone(), j.job.clone()))
            .collect();
    }

    /// The first status of the server taken over, `job`: where training goes on. The round
    /// it applied that the earlier process did not hear of (returned) waits for the next
    /// checkpoint.
    fn server_resumed(
        &mut self,
        job: &str,
        status: &ServerStatus,
    ) -> Result<Option<AppliedRound>, String> {
        let peer = self
            .peers
            .get(job)
            .ok_or("the parameter server is not known")?;
        // Not the rounds waiting now: a checkpoint taken before this status may hold some.
        let unheard = self
            .rounds
            .server_resumed(peer.to_string(), status, &self.earlier_rounds)?;
        let Some(applied) = unheard else {
            return Ok(None);
        };
        for included in &applied.included {
            match (self.earlier_trainers.get(included), included.parse()) {
                (Some(job), Ok(peer)) => self.uncommitted.push(Uncommitted {
                    round: applied.round,
                    peer,
                    job: job.clone(),
                }),
                _ => tracing::warn!(
                    %included,
                    round = applied.round,
                    "the parameter server included a peer that ran no trainer of this run"
                ),
            }
        }
        // What the process that heard it would have known of its samples and loss is gone.
        Ok(Some(AppliedRound {
            round: applied.round,
            included: applied.included,
            samples: 0,
            loss: None,
            model_hash: applied.model_hash,
            delta_bytes: applied.delta_bytes,
            benched: Vec::new(),
            clipped: applied.clipped,
            largest_norm_ratio: applied.largest_norm_ratio,
            close_ms: applied.close_ms,
            traffic_bytes: applied.traffic_bytes,
            standby_bytes: applied.standby_bytes,
        }))
    }

    /// Applied rounds of trainers' jobs that wait for a checkpoint, for the run's record.
    pub fn uncommitted(&self) -> Vec<RecordedRound> {
        self.uncommitted
            .iter()
            .map(|u| RecordedRound {
                round: u.round,
                peer: u.peer.to_string(),
                job: u.job.clone(),
            })
            .collect()
    }

    /// The round being trained.
    pub fn round(&self) -> u64 {
        self.rounds.round()
    }

    /// Every round is trained.
    pub fn done(&self) -> bool {
        self.rounds.done()
    }

    /// The answer to job `job`'s status.
    pub async fn status(&mut self, job: &str, status: Status) -> Answered {
        let now = unix_ms();
        let mut resumed = None;
        let mut rejoined = false;
        let (answer, settle, applied) = match status {
            Status::Trainer(status) => {
                if let Some(problem) = status.problem() {
                    if self.throttle.records(job, now, false) {
                        tracing::warn!(%job, "a trainer's status refused: {problem}");
                    }
                    return Answered {
                        order: Order::Trainer(TrainerOrder::wait(WAIT_MS)),
                        applied: None,
                        resumed: None,
                        rejoined: false,
                    };
                }
                if self.rounds.is_trainer(job)
                    && self.throttle.records(job, now, status.eval.is_some())
                {
                    self.record(&TrainerLine {
                        kind: "trainer",
                        time_ms: now,
                        job,
                        status: &status,
                    });
                }
                if status.data_done {
                    // Out of data may be only for now: slices still on their way to workers.
                    self.rounds.data_left(!self.data.drained().await);
                }
                let stale = self.rounds.must_rejoin(job);
                let (order, settle) = self.rounds.trainer_status(job, status, now);
                rejoined = stale && !self.rounds.must_rejoin(job);
                (Order::Trainer(order), settle, None)
            }
            Status::ParameterServer(status) if self.server.as_deref() == Some(job) => {
                if std::mem::take(&mut self.resuming) {
                    let fits = self.server_resumed(job, &status);
                    let refused = fits.is_err();
                    resumed = Some(fits);
                    if refused {
                        return Answered {
                            order: Self::server_wait_order(),
                            applied: None,
                            resumed,
                            rejoined: false,
                        };
                    }
                }
                if self.rounds.applies(&status) {
                    // A round applied with everyone out of data ends the training, unless
                    // slices went back since a trainer last asked (a job lost or ended).
                    self.rounds.data_left(!self.data.drained().await);
                }
                let named = self.standby.as_ref().map(|s| s.peer.to_string());
                let standby_named = status.standby == named;
                let (order, settle, applied) = self.rounds.server_status(status, now);
                let order = match order {
                    ServerOrder::Wait if !standby_named => ServerOrder::Standby { peer: named },
                    order => order,
                };
                (Order::ParameterServer(order), settle, applied)
            }
            Status::ParameterServer(_) => (Order::ParameterServer(ServerOrder::Done), vec![], None),
            Status::Standby(status) => {
                let order = self.standby_status(job, status);
                return Answered {
                    order: Order::Standby(order),
                    applied: None,
                    resumed: None,
                    rejoined: false,
                };
            }
        };
        for settle in settle {
            self.settle(settle).await;
        }
        self.release_deferred().await;
        if let Some(applied) = &applied {
            if let Some(hash) = &applied.model_hash {
                self.model_hashes.insert(applied.round + 1, hash.clone());
            }
            self.record(&RoundLine {
                kind: "round",
                time_ms: now,
                seconds: now.saturating_sub(self.round_started_ms) as f64 / 1000.0,
                applied,
            });
            self.round_started_ms = now;
        }
        Answered {
            order: answer,
            applied,
            resumed,
            rejoined,
        }
    }

    /// The answer to a standby's status: take over when it was made the server, follow the
    /// server, or finish with the training.
    fn standby_status(&mut self, job: &str, status: StandbyStatus) -> StandbyOrder {
        if self.server.as_deref() == Some(job) {
            return StandbyOrder::Serve {
                round: self.rounds.round(),
            };
        }
        let Some(standby) = self.standby.as_mut().filter(|s| s.job == job) else {
            return StandbyOrder::Done;
        };
        if self.rounds.done() {
            return StandbyOrder::Done;
        }
        let server = self
            .server
            .as_ref()
            .and_then(|server| self.peers.get(server));
        let following = status.following.clone();
        standby.status = status;
        match server {
            Some(server) if following != Some(server.to_string()) => StandbyOrder::Follow {
                server: server.to_string(),
            },
            _ => StandbyOrder::Wait,
        }
    }

    async fn settle(&mut self, settle: Settle) {
        let (job, round, commit) = match settle {
            Settle::Commit { job, round } => (job, round, true),
            Settle::Drop { job, round } => (job, round, false),
        };
        let Some(peer) = self.peers.get(&job).copied() else {
            return;
        };
        if commit && self.checkpointed.is_none_or(|held| round >= held) {
            self.uncommitted.push(Uncommitted { round, peer, job });
            return;
        }
        self.settle_now(&peer, &job, round, commit).await;
    }

    async fn settle_now(&self, peer: &PeerId, job: &str, round: u64, commit: bool) {
        if let Err(error) = self.data.settle_round(peer, job, round, commit).await {
            tracing::warn!(%job, round, %error, "could not settle a round's slices in the ledger");
        }
    }

    fn record(&mut self, line: &impl Serialize) {
        let Ok(line) = serde_json::to_string(line) else {
            return;
        };
        let _ = writeln!(self.metrics, "{line}").and_then(|_| self.metrics.flush());
        if let Some((forward, _)) = &self.forward
            && forward.try_send(line).is_err()
        {
            self.dropped += 1;
            if self.dropped % 100 == 1 {
                tracing::warn!(
                    dropped = self.dropped,
                    "the metrics URL does not keep up; lines are dropped for it (the metrics file has them all)"
                );
            }
        }
    }
}

/// POSTs every line it is given to `url`, in order, until the sender is dropped.
fn forwarder(
    url: &str,
) -> (
    tokio::sync::mpsc::Sender<String>,
    tokio::task::JoinHandle<()>,
) {
    let (lines, mut queue) = tokio::sync::mpsc::channel::<String>(FORWARD_QUEUE);
    let url = url.to_string();
    let task = tokio::spawn(async move {
        let client = reqwest::Client::new();
        let mut failing = false;
        while let Some(line) = queue.recv().await {
            let sent = client
                .post(&url)
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .body(line)
                .send()
                .await
                .and_then(reqwest::Response::error_for_status);
            match sent {
                Ok(_) if failing => {
                    tracing::info!(%url, "the metrics URL takes lines again");
                    failing = false;
                }
                Ok(_) => {}
                Err(error) if !failing => {
                    tracing::warn!(%url, %error, "cannot forward metrics; the metrics file has them");
                    failing = true;
                }
                Err(_) => {}
            }
        }
    });
    (lines, task)
}

#[derive(Serialize)]
struct TrainerLine<'a> {
    kind: &'static str,
    time_ms: u64,
    job: &'a str,
    #[serde(flatten)]
    status: &'a hypha_messages::diloco::TrainerStatus,
}

#[derive(Serialize)]
struct EvalLine<'a> {
    kind: &'static str,
    time_ms: u64,
    peer: &'a str,
    #[serde(flatten)]
    eval: &'a hypha_messages::diloco::Evaluation,
}

#[derive(Serialize)]
struct CheckpointLine {
    kind: &'static str,
    time_ms: u64,
    round: u64,
    bytes: u64,
}

#[derive(Serialize)]
struct RoundLine<'a> {
    kind: &'static str,
    time_ms: u64,
    seconds: f64,
    #[serde(flatten)]
    applied: &'a AppliedRound,
}

/// The round a standby with `status` takes over at: of the models it holds or is building
/// (it serves that one once built), the newest that `fits` (its round and fingerprint are the
/// run's).
fn takeover_round(status: &StandbyStatus, fits: impl Fn(u64, &str) -> bool) -> Option<u64> {
    fn of(model: &ModelOfRound) -> (u64, &str) {
        (model.round, model.model_hash.as_str())
    }
    let building = status.building.as_ref().map(of);
    let newest = status.round.zip(status.model_hash.as_deref());
    let previous = status.previous.as_ref().map(of);
    [building, newest, previous]
        .into_iter()
        .flatten()
        .find(|(round, hash)| fits(*round, hash))
        .map(|(round, _)| round)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The run knows the models `rounds` (round, fingerprint).
    fn known(rounds: &'static [(u64, &'static str)]) -> impl Fn(u64, &str) -> bool {
        move |round, hash| rounds.contains(&(round, hash))
    }

    #[test]
    fn a_standby_takes_over_at_its_newest_model_the_run_knows() {
        let status = StandbyStatus {
            round: Some(8),
            model_hash: Some("h8".into()),
            previous: Some(ModelOfRound {
                round: 7,
                model_hash: "h7".into(),
            }),
            ..StandbyStatus::default()
        };
        assert_eq!(
            takeover_round(&status, known(&[(7, "h7"), (8, "h8")])),
            Some(8)
        );
        // The server was lost before it said it applied round 7: the model before serves.
        assert_eq!(takeover_round(&status, known(&[(7, "h7")])), Some(7));
        assert_eq!(takeover_round(&status, known(&[(7, "other")])), None);
        let alone = StandbyStatus {
            previous: None,
            ..status
        };
        assert_eq!(takeover_round(&alone, known(&[(7, "h7")])), None);
    }

    /// At a billion parameters a standby builds a round's model from its change for seconds:
    /// a server lost meanwhile, after it said it applied that round, is replaced at that
    /// round, not the one before (which would train it again).
    #[test]
    fn a_standby_building_the_newest_round_takes_over_at_it() {
        let status = StandbyStatus {
            round: Some(8),
            model_hash: Some("h8".into()),
            building: Some(ModelOfRound {
                round: 9,
                model_hash: "h9".into(),
            }),
            ..StandbyStatus::default()
        };
        assert_eq!(
            takeover_round(&status, known(&[(8, "h8"), (9, "h9")])),
            Some(9)
        );
        // Lost before it said so: the model the standby holds serves.
        assert_eq!(takeover_round(&status, known(&[(8, "h8")])), Some(8));
        // A model the server never fingerprinted so is not taken over at.
        assert_eq!(
            takeover_round(&status, known(&[(8, "h8"), (9, "other")])),
            Some(8)
        );
    }
}
