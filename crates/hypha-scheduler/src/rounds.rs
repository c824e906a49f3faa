//! DiLoCo rounds as the scheduler drives them: who trains which round for how many batches,
//! when the parameter server closes a round, and which trainers' slices each round makes used.
//!
//! The messages are those of [`hypha_messages::diloco`]. This is a plain state machine with
//! the clock passed in; [`run`](crate::run) feeds it statuses and carries out what it returns.
//!
//! **Adaptive rounds.** A round aims at `samples_per_round` samples over all trainers. From
//! the batch times trainers report, the scheduler predicts when the round's samples will be
//! done if everyone keeps their pace, bounded by `round_seconds`, and gives each trainer a
//! batch target it reaches by then: fast and slow trainers finish together and none idles. A
//! trainer that has not reported a batch time yet gets an even share.
//!
//! **Closing.** A round closes when every trainer holding a model has sent its pseudo-gradient,
//! or, once `round_seconds` (plus a grace of a quarter of it) have passed since the round
//! began, with at least `quorum` of them. Trainers that are lost leave the round at once. A
//! trainer whose update the server refused (a liar, or an honest outlier) has sent what it
//! had: the round does not wait for it, but its refusal counts against the quorum, and a
//! round that cannot reach its quorum any more ends without a change at its deadline, its
//! slices going back.
//!
//! **Data.** A trainer reports the slices of round `r` consumed before it sends the round's
//! pseudo-gradient. When the server applies round `r`, the round's slices of each included
//! trainer are made used ([`Settle::Commit`]); a trainer that was not included learns it when
//! it reports a later round, and its round-`r` slices go back to the ledger ([`Settle::Drop`]).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use hypha_messages::diloco::{Applied, ServerOrder, ServerStatus, TrainerOrder, TrainerStatus};

/// How a round is planned and closed.
#[derive(Debug, Clone, PartialEq)]
pub struct RoundPlan {
    /// Stop after this many rounds; `None`: when the data is done.
    pub rounds: Option<u64>,
    pub samples_per_round: u64,
    pub batch_size: u64,
    /// The longest a round is planned to take.
    pub round_ms: u64,
    /// The share of a round's trainers it may close with once its time is up.
    pub quorum: f64,
    /// Rounds in a row a trainer's update may be refused before it is benched; 0: never.
    pub bench_after_refusals: u32,
    /// How long the first round waits for the leased trainers that are not ready yet, from
    /// when the first one was (see [`Start`]).
    pub start_grace_ms: u64,
}

/// Whether the run's first round may begin. Trainers that hold the model wait until every
/// leased trainer holds it, or until `start_grace_ms` after the first did. A trainer that
/// loads slowly (PyTorch importing, CUDA starting: 10 s and more) would otherwise miss a
/// short run, the others having trained its rounds without it; a broken one holds the start
/// for the grace at most, and joins later if it ever gets ready. A run that goes on (a
/// scheduler or parameter server taken over, a checkpoint past round 0) does not wait.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Start {
    /// The first trainer ready since `since_ms` (none yet when `None`), `ready` of them when
    /// last told.
    Waiting {
        since_ms: Option<u64>,
        ready: usize,
    },
    Begun,
}

/// What happened to the run's trainers, for the run to report as events.
#[derive(Debug, Clone, PartialEq)]
pub enum News {
    /// `ready` trainers are, more than when last told; the first round waits for the others,
    /// `grace_ms` at most from when the first was.
    Waiting {
        ready: usize,
        trainers: usize,
        grace_ms: u64,
    },
    /// The first round begins with `ready` trainers, `waited_ms` after the first was ready;
    /// `late` (peers) were not ready when the grace ran out.
    Began {
        round: u64,
        ready: usize,
        late: Vec<String>,
        waited_ms: u64,
    },
    /// Trainer `job` trains its first round of the run.
    Joined {
        job: String,
        peer: String,
        round: u64,
    },
}

/// What the ledger must do with a trainer's round.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Settle {
    /// The round reached the model: its slices are used.
    Commit { job: String, round: u64 },
    /// The round was left out: its slices are available again.
    Drop { job: String, round: u64 },
}

/// When (s from now) the round's updates should all arrive, for trainers of `paces` (samples
/// per s, seconds their update takes to reach the server) with `remaining` samples to train:
/// the A with Σ rateᵢ · max(0, A − sendᵢ) = remaining. Trainer i trains until A − sendᵢ, so
/// that every update arrives together; one whose send alone outlasts A trains no more.
fn arrival(paces: &mut [(f64, f64)], remaining: f64) -> f64 {
    paces.sort_by(|a, b| a.1.total_cmp(&b.1));
    let (mut rate, mut lag, mut arrive) = (0.0, 0.0, f64::INFINITY);
    for (i, (r, send)) in paces.iter().enumerate() {
        rate += r;
        lag += r * send;
        arrive = (remaining + lag) / rate;
        if paces.get(i + 1).is_none_or(|next| next.1 >= arrive) {
            break;
        }
    }
    arrive
}

/// How long `status`'s trainer said its updates take to reach the server (0 when it did not).
fn send_ms(status: &TrainerStatus) -> f64 {
    status
        .send_ms
        .filter(|ms| ms.is_finite() && *ms > 0.0)
        .unwrap_or(0.0)
}

/// The shortest batch time the plan believes, in ms.
const MIN_BATCH_MS: f64 = 0.01;

/// The most of a refusal's reason logged, in characters.
const REASON_CHARS: usize = 200;

/// How long a trainer that finds no parameter server waits before asking again.
const RETRY_MS: u64 = 500;

/// How long a trainer's job that ended having trained in the round waits for the server to
/// report its update: the server's status composed before the update arrived may reach the
/// scheduler after the job's end. The server reports every 250 ms and after each file it
/// takes, so this is four of its ticks, not a count of statuses (several can come at once).
const DEPARTING_MS: u64 = 1_000;

/// How long a trainer waiting for the first round to begin waits before asking again: the
/// round begins as the last trainer gets ready, and the others should not idle long after.
const WAIT_MS: u64 = 100;

#[derive(Debug)]
struct Trainer {
    peer: String,
    status: TrainerStatus,
    /// The last loss it reported: (round, loss, samples), kept past the round's end.
    last_loss: Option<(u64, f64, u64)>,
    /// Rounds before this one are settled in the ledger.
    settled_below: u64,
    /// The server generation whose model it holds; `None` before it was told of any.
    generation: Option<u64>,
    /// Taken over with the server that went on: it trains the current round before it has
    /// said so, and the round waits for it.
    awaited: bool,
    /// When its last status arrived.
    heard_ms: u64,
    /// The batch target it was last given: (round, batches).
    ordered: Option<(u64, u64)>,
    /// The rounds in a row that ended with its update refused.
    refused_in_a_row: u32,
    /// It was told to train a round of the run (by this process, or by the earlier one that
    /// started it).
    joined: bool,
}

/// A round the server applied.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct AppliedRound {
    pub round: u64,
    pub included: Vec<String>,
    /// Samples of the included trainers, as they last reported them.
    pub samples: u64,
    /// Mean training loss over the included trainers, weighted by samples.
    pub loss: Option<f64>,
    /// The fingerprint of the global model the round led to, as the server said.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model_hash: Option<String>,
    /// The size of the compressed change the server sent instead of the model.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub delta_bytes: Option<u64>,
    /// Trainers (peers) benched as this round ended: their updates were refused in
    /// `bench_after_refusals` rounds in a row, this one included. The run ends their jobs and
    /// never leases them again for the task.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub benched: Vec<String>,
    /// How near the round's updates came to `max_update_norm_ratio`: the largest norm, as a
    /// multiple of the typical one, as the server said.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub largest_norm_ratio: Option<f64>,
    /// How long the server took to close the round, as it said (milliseconds).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub close_ms: Option<u64>,
    /// The DiLoCo bytes the round put on the server's link, as it said.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub traffic_bytes: Option<u64>,
    /// The bytes the server sent its standby for the round, as it said.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub standby_bytes: Option<u64>,
}

/// The rounds of one DiLoCo job.
#[derive(Debug)]
pub struct Rounds {
    plan: RoundPlan,
    /// The round being trained and collected.
    round: u64,
    /// The highest round any server of the job reached: no trainer holds a later one.
    highest: u64,
    started_ms: Option<u64>,
    trainers: HashMap<String, Trainer>,
    server: Option<String>,
    /// Counts the servers the job had: a trainer holding a model of an earlier one joins the
    /// current one.
    generation: u64,
    /// The server is an earlier process's that went on from the checkpoint of this round:
    /// trainers taken over hold its models and train on with it.
    continued_from: Option<u64>,
    /// The round a replacement server starts from and its model's fingerprint: a trainer
    /// of an earlier server that trains that round on that very model, and has not begun to
    /// send its update, goes on with its round rather than start it over.
    goes_on_from: Option<(u64, String)>,
    /// The current server said it takes the updates of every trainer of the job (its status
    /// named them all): a trainer that goes on sends it its update only then (a standby
    /// still taking over, or a server restored a moment ago, would drop it).
    server_knows_trainers: bool,
    /// Peers whose pseudo-gradients of `round` the server holds, with their samples.
    arrived: HashMap<String, u64>,
    /// Peers whose pseudo-gradient of `round` the server refused, with why: they sent what
    /// they had, so the round does not wait for them.
    refused: HashMap<String, String>,
    /// Trainers' jobs that ended after their pseudo-gradient of `round` arrived, by peer: the
    /// round settles their slices when it is applied (or lost).
    departed: HashMap<String, String>,
    /// Trainers' jobs that ended having trained in `round` before the server said it holds
    /// their update, by peer, with when they ended: a trainer that leaves sends its update as
    /// it goes, and the server may report it next. After [`DEPARTING_MS`] without it, their
    /// slices go back.
    departing: HashMap<String, (String, u64)>,
    /// A close (or skip) was ordered for this round and is not applied yet.
    closing: Option<(u64, Ending)>,
    /// Peers of the earlier process's trainers whose leases are being taken over: the server
    /// keeps taking their updates meanwhile.
    taking_over: HashSet<String>,
    included: BTreeMap<u64, HashSet<String>>,
    done: bool,
    start: Start,
    /// What the run has not reported yet, oldest first.
    news: Vec<News>,
    /// The ledger, when last asked, still had slices to hand out or handed out and not yet
    /// consumed: trainers out of data wait for them rather than end the training.
    data_left: bool,
}

impl Rounds {
    pub fn new(plan: RoundPlan) -> Self {
        Self {
            plan,
            round: 0,
            highest: 0,
            started_ms: None,
            trainers: HashMap::new(),
            server: None,
            generation: 0,
            continued_from: None,
            goes_on_from: None,
            server_knows_trainers: false,
            arrived: HashMap::new(),
            refused: HashMap::new(),
            departed: HashMap::new(),
            departing: HashMap::new(),
            closing: None,
            taking_over: HashSet::new(),
            included: BTreeMap::new(),
            done: false,
            start: Start::Waiting {
                since_ms: None,
                ready: 0,
            },
            news: Vec::new(),
            data_left: false,
        }
    }

    /// Whether the ledger still has slices to hand out or handed out and not yet consumed:
    /// asked when a trainer says it is out of data, which may be only for now (its worker
    /// still fetching the slices it was given, others holding the rest), and before a
    /// server status that applies a round (slices may have gone back since).
    pub fn data_left(&mut self, left: bool) {
        self.data_left = left;
    }

    /// What happened since the last call, oldest first.
    pub fn take_news(&mut self) -> Vec<News> {
        std::mem::take(&mut self.news)
    }

    /// The round being trained.
    pub fn round(&self) -> u64 {
        self.round
    }

    /// Training is over: every trainer and the server are told to finish.
    pub fn done(&self) -> bool {
        self.done
    }

    /// Whether a model holding the rounds before `round` has every planned round.
    pub fn planned_through(&self, round: u64) -> bool {
        self.plan.rounds.is_some_and(|rounds| round >= rounds)
    }

    /// Training is over as something other than a status said (the server of an earlier
    /// process finished it): trainers are told to finish.
    pub fn end(&mut self) {
        self.done = true;
    }

    /// The job's parameter server is `peer` from now on; trainers holding a model of an
    /// earlier server join it (see [`goes_on_from`](Self::goes_on_from) for those that
    /// need not).
    pub fn server_started(&mut self, peer: String) {
        self.server = Some(peer);
        self.generation += 1;
        self.continued_from = None;
        self.goes_on_from = None;
        self.server_knows_trainers = false;
    }

    /// The server started last starts from the model of the current round whose
    /// fingerprint is `model_hash`: trainers that train this round on that model and have
    /// not begun to send their update go on with it, their update to the new server.
    pub fn goes_on_from(&mut self, model_hash: String) {
        self.goes_on_from = Some((self.round, model_hash));
    }

    /// The parameter server of an earlier process of the scheduler goes on, on `peer`; its
    /// first status says the round it collects. The job went on from the checkpoint of the
    /// current round, and the server applied the rounds since: those the earlier process
    /// heard of are `recorded` (round, a peer included in it), and at most one more, the last
    /// it applied, whose answer that process did not live to give. That one is returned
    /// when it is not recorded, for its trainers' slices to be used with the next
    /// checkpoint. A status that does not fit (a round before the checkpoint or past any the
    /// job can have reached, an applied round missing in between) is refused: the server is
    /// replaced from the checkpoint.
    pub fn server_resumed(
        &mut self,
        peer: String,
        status: &ServerStatus,
        recorded: &[(u64, String)],
    ) -> Result<Option<Applied>, String> {
        let from = self.round;
        let Some(round) = status.round else {
            return Err("it holds no model".into());
        };
        if round < from || round > self.highest {
            return Err(format!(
                "it collects round {round}; the job can be at rounds {from} to {}",
                self.highest
            ));
        }
        let mut included: BTreeMap<u64, HashSet<String>> = BTreeMap::new();
        for (applied, peer) in recorded.iter().filter(|(applied, _)| *applied >= from) {
            included.entry(*applied).or_default().insert(peer.clone());
        }
        let last = status.applied.as_ref().filter(|a| a.round >= from);
        let unheard = last.filter(|a| !included.contains_key(&a.round)).cloned();
        if let Some(last) = last {
            included
                .entry(last.round)
                .or_default()
                .extend(last.included.iter().cloned());
        }
        if let Some(missing) = (from..round).find(|r| !included.contains_key(r)) {
            return Err(format!(
                "it collects round {round} but round {missing} was not applied as far as this job knows"
            ));
        }
        if let Some(ahead) = included.keys().find(|applied| **applied >= round) {
            return Err(format!(
                "it collects round {round} but round {ahead} was applied"
            ));
        }
        self.included.extend(included);
        self.round = round;
        self.highest = self.highest.max(round);
        self.started_ms = None;
        self.arrived.clear();
        self.refused.clear();
        self.closing = None;
        self.server_started(peer);
        self.continued_from = Some(from);
        self.start = Start::Begun;
        Ok(unheard)
    }

    /// The server (started next) is restored from the checkpoint of `round`: training goes on
    /// from there, and what the lost server applied after it is gone with it.
    pub fn restored(&mut self, round: u64) {
        if round > 0 {
            self.start = Start::Begun;
        }
        self.round = round;
        self.highest = self.highest.max(round);
        self.started_ms = None;
        self.arrived.clear();
        self.refused.clear();
        self.closing = None;
        self.included.retain(|applied, _| *applied < round);
    }

    /// A server of the job may have reached `round` (an earlier process of the scheduler's,
    /// past the checkpoint it goes on from): trainers may hold models up to it.
    pub fn reached(&mut self, round: u64) {
        self.highest = self.highest.max(round);
    }

    pub fn server_lost(&mut self) {
        self.server = None;
        self.continued_from = None;
    }

    pub fn trainer_started(&mut self, job: String, peer: String) {
        let trainer = Trainer {
            peer,
            status: TrainerStatus::default(),
            last_loss: None,
            settled_below: self.round,
            generation: None,
            awaited: false,
            heard_ms: 0,
            ordered: None,
            refused_in_a_row: 0,
            joined: false,
        };
        self.trainers.insert(job, trainer);
    }

    /// A trainer's job of an earlier process of the scheduler goes on. With the server that
    /// went on too, it trains on: its rounds from the checkpoint on settle as they would
    /// have. Otherwise, or when the earlier process had not yet told it to join the server
    /// (`rejoin`: it holds a model of one lost before), it joins the current one, and every
    /// round it held that is not in the model gives its slices back: those it reported while
    /// the scheduler was away arrive with its old round numbers, whatever the current server
    /// reached meanwhile.
    /// The earlier process's trainer on `peer` is being taken over: until it is (or cannot
    /// be, [`takeover_ended`](Self::takeover_ended)), the server is told to keep taking its
    /// updates. A restarted scheduler otherwise names the server only the trainers taken over
    /// so far, the server refuses the others' updates of the round in flight, and the round
    /// waits for them until its deadline (7 s of a 5 s round in `hypha-bench recovery`).
    pub fn taking_over(&mut self, peer: String) {
        self.taking_over.insert(peer);
    }

    /// The takeover of the trainer on `peer` ended, with or without its job.
    pub fn takeover_ended(&mut self, peer: &str) {
        self.taking_over.remove(peer);
    }

    pub fn trainer_taken_over(&mut self, job: String, peer: String, rejoin: bool) {
        self.taking_over.remove(&peer);
        self.trainer_started(job.clone(), peer);
        self.start = Start::Begun;
        let (generation, continued_from) = (self.generation, self.continued_from);
        if let Some(trainer) = self.trainers.get_mut(&job) {
            trainer.joined = true;
            match continued_from.filter(|_| !rejoin) {
                Some(from) => {
                    trainer.generation = Some(generation);
                    trainer.settled_below = from;
                    trainer.awaited = true;
                }
                None => {
                    // Generation 0 is before any server of this process: never the current one.
                    trainer.generation = Some(0);
                    trainer.settled_below = 0;
                }
            }
        }
    }

    /// Whether trainer `job` was told to train a round of the run.
    pub fn joined(&self, job: &str) -> bool {
        self.trainers.get(job).is_some_and(|t| t.joined)
    }

    /// Whether trainer `job` holds a model of a server that is not the current one: it is
    /// to join the current one.
    pub fn must_rejoin(&self, job: &str) -> bool {
        self.trainers
            .get(job)
            .and_then(|t| t.generation)
            .is_some_and(|joined| joined != self.generation)
    }

    /// A trainer's job ended or its worker is gone. True when its pseudo-gradient of the
    /// current round is at the server already, or may be (it trained in the round, and a
    /// trainer told to stop sends its update as it goes): the round settles its slices when
    /// it is applied or lost, or once the server's statuses say the update is not coming;
    /// otherwise the ledger returns them at once.
    pub fn trainer_ended(&mut self, job: &str, now_ms: u64) -> bool {
        let Some(trainer) = self.trainers.remove(job) else {
            return false;
        };
        if self.arrived.contains_key(&trainer.peer) {
            self.departed.insert(trainer.peer, job.to_string());
            return true;
        }
        let trained = trainer.status.round == Some(self.round) && trainer.status.samples > 0;
        if trained && self.server.is_some() {
            self.departing
                .insert(trainer.peer, (job.to_string(), now_ms));
            return true;
        }
        false
    }

    /// Whether `job` ended with its pseudo-gradient at the server (or maybe on its way), its
    /// round still open.
    pub fn departed(&self, job: &str) -> bool {
        self.departed.values().any(|departed| departed == job)
            || self
                .departing
                .values()
                .any(|(departing, _)| departing == job)
    }

    /// Jobs that ended without the server having said it holds their update: those whose
    /// update `status` names arrived are departed, the others wait at most [`DEPARTING_MS`].
    fn resolve_departing(&mut self, status: &ServerStatus, now_ms: u64) {
        let mut heard: HashSet<&str> = HashSet::new();
        if status.round == Some(self.round) {
            heard.extend(status.arrived.iter().map(|a| a.peer.as_str()));
        }
        if let Some(applied) = status.applied.as_ref().filter(|a| a.round == self.round) {
            heard.extend(applied.included.iter().map(String::as_str));
        }
        for (peer, (job, ended_ms)) in std::mem::take(&mut self.departing) {
            if heard.contains(peer.as_str()) {
                self.departed.insert(peer, job);
            } else if now_ms < ended_ms.saturating_add(DEPARTING_MS) {
                self.departing.insert(peer, (job, ended_ms));
            }
        }
    }

    /// The open round is lost with the server: the slices of the jobs that ended with their
    /// pseudo-gradient in it go back.
    pub fn abandon_departed(&mut self) -> Vec<Settle> {
        let round = self.round;
        self.departing.clear();
        self.departed
            .drain()
            .map(|(_, job)| Settle::Drop { job, round })
            .collect()
    }

    /// A trainer's status: what it should do next, and what the ledger must settle.
    pub fn trainer_status(
        &mut self,
        job: &str,
        status: TrainerStatus,
        now_ms: u64,
    ) -> (TrainerOrder, Vec<Settle>) {
        let mut settle = Vec::new();
        if !self.trainers.contains_key(job) {
            // Not (or no longer) one of this job's trainers.
            return (TrainerOrder::Done, settle);
        }
        if self.done {
            return (TrainerOrder::Done, settle);
        }
        let Some(server) = self.server.clone() else {
            return (TrainerOrder::Wait { retry_ms: RETRY_MS }, settle);
        };
        let generation = self.generation;
        let restart = self.round;
        let highest = self.highest;
        let Some(trainer) = self.trainers.get_mut(job) else {
            return (TrainerOrder::Done, settle);
        };
        let goes_on = self.goes_on_from.as_ref().is_some_and(|(round, hash)| {
            *round == restart
                && status.round == Some(*round)
                && status.model_hash.as_ref() == Some(hash)
                && status.syncing == Some(false)
                && status.ahead_batches == 0
        });
        let stale = trainer
            .generation
            .is_some_and(|joined| joined != generation);
        if stale && goes_on && !self.server_knows_trainers {
            return (
                TrainerOrder::Wait {
                    retry_ms: RETRY_MS / 5,
                },
                settle,
            );
        }
        let stale = stale && !goes_on;
        // A trainer joins the current server once it holds no model of an earlier one: until
        // then (an answer to join that was lost) it is told again.
        if !stale || status.round.is_none() {
            trainer.generation = Some(generation);
        }
        let Some(round) = status.round.filter(|_| !stale) else {
            if let (true, Some(held)) = (stale, status.round) {
                // It trained on a model of a server that is gone: its rounds that are not in
                // the model the job goes on from give their slices back (again, harmlessly,
                // if it is told twice). It sent its consumed slices before it asked.
                // Batches trained ahead were read into the round after the one it held.
                let held = held.min(highest) + u64::from(status.ahead_batches > 0);
                let lost = trainer.settled_below.min(restart)..held + 1;
                settle.extend(left_out(&self.included, job, &trainer.peer, lost));
                trainer.settled_below = restart;
                trainer.status = TrainerStatus::default();
                trainer.last_loss = None;
            }
            return (
                TrainerOrder::Join {
                    parameter_server: server,
                },
                settle,
            );
        };
        if round > self.round {
            // The server sent the next model before its status said it applied the round.
            return (
                TrainerOrder::Wait {
                    retry_ms: RETRY_MS / 5,
                },
                settle,
            );
        }
        if let Some(trainer) = self.trainers.get_mut(job) {
            let closed = trainer.settled_below..round.min(self.round);
            settle.extend(left_out(&self.included, job, &trainer.peer, closed));
            trainer.settled_below = trainer.settled_below.max(round.min(self.round));
            if let Some(loss) = status.loss {
                trainer.last_loss = Some((round, loss, status.samples));
            }
            trainer.status = status.clone();
            trainer.heard_ms = now_ms;
            trainer.awaited = false;
        }
        if round == self.round && !self.may_begin(now_ms) {
            return (TrainerOrder::Wait { retry_ms: WAIT_MS }, settle);
        }
        if round == self.round && self.started_ms.is_none() {
            self.started_ms = Some(now_ms);
        }
        // Slices this status gives back make data again: not the end.
        let gives_back = settle.iter().any(|s| matches!(s, Settle::Drop { .. }));
        if !gives_back && self.out_of_data() {
            self.done = true;
            return (TrainerOrder::Done, settle);
        }
        let closing = self.closing.is_some_and(|(closing, _)| closing == round);
        let batches = if round != self.round || closing {
            // Behind, or the round is closing: sync now.
            status.batches
        } else if status.data_done {
            // Out of data: sync what it has; with nothing, keep asking for slices.
            status
                .batches
                .saturating_add(u64::from(status.samples == 0))
        } else {
            self.target(&status, now_ms)
        };
        if let Some(trainer) = self.trainers.get_mut(job) {
            trainer.ordered = Some((round, batches));
            if !std::mem::replace(&mut trainer.joined, true) {
                self.news.push(News::Joined {
                    job: job.to_string(),
                    peer: trainer.peer.clone(),
                    round,
                });
            }
        }
        let order = TrainerOrder::Train {
            round,
            batches,
            parameter_server: server,
        };
        (order, settle)
    }

    /// Whether the run's first round may begin, asked by a trainer ready for it (see
    /// [`Start`]): every trainer holds the current server's model of the round, or the grace
    /// since the first did is over.
    fn may_begin(&mut self, now_ms: u64) -> bool {
        let Start::Waiting {
            since_ms,
            ready: told,
        } = self.start
        else {
            return true;
        };
        let (round, generation) = (self.round, self.generation);
        let ready = |t: &Trainer| t.generation == Some(generation) && t.status.round == Some(round);
        let late: Vec<String> = self
            .trainers
            .values()
            .filter(|t| !ready(t))
            .map(|t| t.peer.clone())
            .collect();
        let since = since_ms.unwrap_or(now_ms);
        let grace = self.plan.start_grace_ms;
        if late.is_empty() || now_ms >= since.saturating_add(grace) {
            self.start = Start::Begun;
            let mut late = late;
            late.sort();
            self.news.push(News::Began {
                round,
                ready: self.trainers.len() - late.len(),
                late,
                waited_ms: now_ms.saturating_sub(since),
            });
            return true;
        }
        let ready = self.trainers.len() - late.len();
        if ready > told {
            self.start = Start::Waiting {
                since_ms: Some(since),
                ready,
            };
            self.news.push(News::Waiting {
                ready,
                trainers: self.trainers.len(),
                grace_ms: grace,
            });
        }
        false
    }

    /// The batches `status`'s trainer should have done when the round ends.
    fn target(&self, status: &TrainerStatus, now_ms: u64) -> u64 {
        let plan = &self.plan;
        // Those who train this round: trainers in it, and those that just sent the last
        // round and will ask for this one (their status still names the last). Counting only
        // the first would hand the first trainer to ask the whole round.
        let in_round: Vec<&Trainer> = self
            .trainers
            .values()
            .filter(|t| {
                t.status
                    .round
                    .is_some_and(|r| r.saturating_add(1) >= self.round)
            })
            .collect();
        let count = self.trainers.len().max(1) as u64;
        let even = plan
            .samples_per_round
            .div_ceil(plan.batch_size.max(1) * count)
            .max(1);
        let Some(batch_ms) = status.batch_ms.filter(|ms| *ms > 0.0) else {
            return even.max(status.batches.saturating_add(1));
        };
        // A pace of more than a batch every 10 µs is a report to distrust, not a plan.
        let batch_ms = batch_ms.max(MIN_BATCH_MS);
        let send_ms = |status: &TrainerStatus| send_ms(status).min(plan.round_ms as f64);
        // Each trainer's pace (samples per s) and how long its update takes to reach the
        // server (s); trainers without a pace yet count as the average of those with one.
        let mut paces: Vec<(f64, f64)> = in_round
            .iter()
            .filter_map(|t| {
                let ms = t.status.batch_ms.filter(|ms| *ms > 0.0)?.max(MIN_BATCH_MS);
                Some((
                    plan.batch_size as f64 * 1000.0 / ms,
                    send_ms(&t.status) / 1000.0,
                ))
            })
            .collect();
        let known = paces.len().max(1) as f64;
        let average = (
            paces.iter().map(|(rate, _)| rate).sum::<f64>() / known,
            paces.iter().map(|(_, send)| send).sum::<f64>() / known,
        );
        paces.extend(std::iter::repeat_n(
            average,
            in_round.len().saturating_sub(paces.len()),
        ));
        // What trainers said they trained this round, and what those still waiting for its
        // model trained ahead into it.
        let done: u64 = in_round
            .iter()
            .map(|t| match t.status.round {
                Some(round) if round == self.round => self.trained_by_now(t, now_ms),
                Some(round) if round.saturating_add(1) == self.round => t
                    .status
                    .ahead_batches
                    .saturating_mul(plan.batch_size)
                    .min(plan.samples_per_round),
                _ => 0,
            })
            .sum();
        let remaining = plan.samples_per_round.saturating_sub(done) as f64;
        let bound_ms = self.started_ms.map_or(plan.round_ms, |start| {
            (start + plan.round_ms).saturating_sub(now_ms)
        }) as f64;
        let arrive_ms = arrival(&mut paces, remaining) * 1000.0;
        let arrive_ms = if arrive_ms.is_finite() {
            arrive_ms.min(bound_ms)
        } else {
            bound_ms
        };
        let more = ((arrive_ms - send_ms(status)).max(0.0) / batch_ms).floor() as u64;
        status.batches.saturating_add(more).max(1)
    }

    /// The samples `trainer` has trained in this round by `now_ms`: what it last said, plus
    /// the batches its pace gave it since, up to the target it was given. Trainers report
    /// only every few seconds or at their target, so without this each one reaching its
    /// target would see the others where they last spoke, and be told to train their share
    /// again: rounds twice `samples_per_round`.
    ///
    /// What a trainer says it trained is believed up to what it was told to train this round
    /// (or a whole round before it was told anything): a trainer claiming 10¹² samples would
    /// otherwise leave the others nothing to train, and every honest target one batch.
    fn trained_by_now(&self, trainer: &Trainer, now_ms: u64) -> u64 {
        let status = &trainer.status;
        let batch = self.plan.batch_size;
        let told = match trainer.ordered {
            Some((round, target)) if round == self.round => target.saturating_mul(batch),
            _ => self.plan.samples_per_round,
        };
        let since = match (status.batch_ms, trainer.ordered) {
            (Some(batch_ms), Some((round, target))) if batch_ms > 0.0 && round == self.round => {
                let paced = (now_ms.saturating_sub(trainer.heard_ms) as f64 / batch_ms) as u64;
                paced.min(target.saturating_sub(status.batches))
            }
            _ => 0,
        };
        status
            .samples
            .min(told)
            .saturating_add(since.saturating_mul(batch))
    }

    /// Whether the server's `status` says it applied the round it was told to close.
    pub fn applies(&self, status: &ServerStatus) -> bool {
        status.applied.as_ref().is_some_and(|applied| {
            self.closing
                .is_some_and(|(closing, _)| closing == applied.round)
        })
    }

    /// The server's status: what it should do next, and what the ledger must settle.
    pub fn server_status(
        &mut self,
        status: ServerStatus,
        now_ms: u64,
    ) -> (ServerOrder, Vec<Settle>, Option<AppliedRound>) {
        let mut settle = Vec::new();
        let mut applied_round = None;
        self.resolve_departing(&status, now_ms);
        let applies = self.applies(&status);
        if let Some(applied) = status.applied.filter(|_| applies) {
            let included: HashSet<String> = applied.included.iter().cloned().collect();
            let samples = included.iter().filter_map(|p| self.arrived.get(p)).sum();
            let mut weighted_loss = (0.0, 0u64);
            // A peer's update in the round is its departed job's, not that of a job started on
            // the same peer after it (whose own update for the round was a duplicate; its
            // slices of the round go back when it ends).
            let departed = std::mem::take(&mut self.departed);
            for (peer, job) in &departed {
                let (job, round) = (job.clone(), applied.round);
                settle.push(match included.contains(peer) {
                    true => Settle::Commit { job, round },
                    false => Settle::Drop { job, round },
                });
            }
            for (job, trainer) in &mut self.trainers {
                if included.contains(&trainer.peer) && !departed.contains_key(&trainer.peer) {
                    settle.push(Settle::Commit {
                        job: job.clone(),
                        round: applied.round,
                    });
                    trainer.settled_below = trainer.settled_below.max(applied.round + 1);
                    if let Some((round, loss, samples)) = trainer.last_loss
                        && round == applied.round
                    {
                        weighted_loss.0 += loss * samples as f64;
                        weighted_loss.1 += samples;
                    }
                }
            }
            // Out of data for good: none left in the ledger, and no slices of the round go
            // back: no trainer's that trained in it and is not included, no departed one's
            // left out, none of a job that ended with its update maybe still on its way.
            let gives_back = settle.iter().any(|s| matches!(s, Settle::Drop { .. }));
            let everyone_out_of_data = !self.trainers.is_empty()
                && !self.data_left
                && !gives_back
                && self.departing.is_empty()
                && self.trainers.values().all(|t| {
                    t.status.data_done
                        && t.status.round == Some(applied.round)
                        && (t.status.samples == 0 || included.contains(&t.peer))
                });
            let benched = self.count_refusals(&included);
            self.included.insert(applied.round, included);
            self.closing = None;
            self.round = applied.round + 1;
            self.highest = self.highest.max(self.round);
            self.started_ms = None;
            self.arrived.clear();
            self.refused.clear();
            self.done = self.plan.rounds.is_some_and(|n| self.round >= n) || everyone_out_of_data;
            applied_round = Some(AppliedRound {
                round: applied.round,
                included: applied.included,
                samples,
                loss: (weighted_loss.1 > 0).then(|| weighted_loss.0 / weighted_loss.1 as f64),
                model_hash: applied.model_hash,
                delta_bytes: applied.delta_bytes,
                benched,
                largest_norm_ratio: applied.largest_norm_ratio,
                close_ms: applied.close_ms,
                traffic_bytes: applied.traffic_bytes,
                standby_bytes: applied.standby_bytes,
            });
        }
        if self.done {
            return (ServerOrder::Done, settle, applied_round);
        }
        let trainers = self.server_trainers();
        if status.trainers.iter().cloned().collect::<BTreeSet<_>>() != trainers {
            let peers = trainers.into_iter().collect();
            return (ServerOrder::Trainers { peers }, settle, applied_round);
        }
        self.server_knows_trainers = status.round.is_some();
        if status.round.is_none()
            && let Some(from) = self.initial_model_source(&status.offered)
        {
            return (ServerOrder::Adopt { from }, settle, applied_round);
        }
        if status.round == Some(self.round) {
            self.arrived = status
                .arrived
                .iter()
                .map(|a| (a.peer.clone(), a.samples))
                .collect();
            for refusal in &status.refused {
                if !self.refused.contains_key(&refusal.peer) {
                    // The server bounds its reasons; a server that does not is not believed.
                    let reason: String = refusal.reason.chars().take(REASON_CHARS).collect();
                    tracing::warn!(
                        round = self.round,
                        peer = %refusal.peer,
                        reason = %reason.escape_debug(),
                        "the parameter server refused a trainer's update: the round goes on without it"
                    );
                }
            }
            self.refused = status
                .refused
                .into_iter()
                .map(|refusal| (refusal.peer, refusal.reason))
                .collect();
        }
        let ending = match self.closing {
            Some((round, ending)) if round == self.round => Some(ending),
            _ if status.round == Some(self.round) => self.ending(now_ms),
            _ => None,
        };
        let Some(ending) = ending else {
            return (ServerOrder::Wait, settle, applied_round);
        };
        self.closing = Some((self.round, ending));
        let (round, send_to) = (
            self.round,
            self.trainers.values().map(|t| t.peer.clone()).collect(),
        );
        let order = match ending {
            Ending::Close => ServerOrder::Close { round, send_to },
            Ending::Skip => {
                tracing::warn!(
                    round,
                    refused = self.refused.len(),
                    arrived = self.arrived.len(),
                    "too few of the round's updates were taken for its quorum: it ends without a change"
                );
                ServerOrder::Skip { round, send_to }
            }
        };
        (order, settle, applied_round)
    }

    /// Counts, as a round ends with `included` taken, the rounds in a row each trainer's
    /// update was refused (a taken update starts the count again); the peers that reach
    /// `bench_after_refusals` now. An honest outlier refused once in a while is never benched;
    /// a trainer that lies in every update is, before its slices are taken and given back
    /// round after round to the end of the data.
    fn count_refusals(&mut self, included: &HashSet<String>) -> Vec<String> {
        let limit = self.plan.bench_after_refusals;
        let mut benched = Vec::new();
        for trainer in self.trainers.values_mut() {
            if self.refused.contains_key(&trainer.peer) {
                trainer.refused_in_a_row += 1;
                if limit > 0 && trainer.refused_in_a_row == limit {
                    benched.push(trainer.peer.clone());
                }
            } else if included.contains(&trainer.peer) {
                trainer.refused_in_a_row = 0;
            }
        }
        benched.sort();
        benched
    }

    /// The peers whose pseudo-gradients the server is to take: the trainers, those that left
    /// with their update of the round at the server, and those being taken over.
    fn server_trainers(&self) -> BTreeSet<String> {
        self.trainers
            .values()
            .map(|t| t.peer.clone())
            .chain(self.departed.keys().cloned())
            .chain(self.departing.keys().cloned())
            .chain(self.taking_over.iter().cloned())
            .collect()
    }

    /// Whose initial model the server is to adopt, of those `offered`: the trainer of the
    /// lowest job id among them, so that one trainer, chosen here, sets the start, never a
    /// peer that merely sent first.
    fn initial_model_source(&self, offered: &[String]) -> Option<String> {
        self.trainers
            .iter()
            .filter(|(_, t)| offered.contains(&t.peer))
            .min_by_key(|(job, _)| job.as_str())
            .map(|(_, t)| t.peer.clone())
    }

    /// Every trainer is in the current round with nothing trained and no data left, and
    /// nothing arrived for it: there is no round left to train.
    fn out_of_data(&self) -> bool {
        !self.data_left
            && self.departing.is_empty()
            && self.closing.is_none()
            && self.arrived.is_empty()
            && self.trainers.values().all(|t| {
                t.status.round == Some(self.round) && t.status.data_done && t.status.samples == 0
            })
    }

    /// Whether and how the round ends now. It closes once every trainer that can still send
    /// has sent, or after its deadline, with updates from at least `quorum` of the trainers
    /// expected in it; refused updates count against the quorum (a liar whose update alone
    /// was taken cannot steer the model where the others' were refused). A round that cannot
    /// reach its quorum any more (everybody sent, too many refused) ends without a change
    /// once its deadline passed, so that honest trainers still joining get their chance.
    fn ending(&self, now_ms: u64) -> Option<Ending> {
        // Every trainer that holds a model trains this round, even one that has not taken
        // this round's model yet; one out of data with nothing trained sends nothing.
        let expected: Vec<&Trainer> = self
            .trainers
            .values()
            .filter(|t| t.status.round.is_some() || t.awaited)
            .filter(|t| !(t.status.data_done && t.status.samples == 0))
            .collect();
        // One whose update was refused has sent what it had: nothing more will come. With
        // none known (trainers taken over after a restart are known only once the server
        // is), the new model would go to nobody: only arrivals at the deadline close it.
        let all_sent = !expected.is_empty()
            && expected
                .iter()
                .all(|t| self.arrived.contains_key(&t.peer) || self.refused.contains_key(&t.peer));
        let grace = self.plan.round_ms / 4;
        let overdue = self
            .started_ms
            .is_some_and(|start| now_ms >= start + self.plan.round_ms + grace);
        let needed = ((self.plan.quorum * expected.len() as f64).ceil() as usize).max(1);
        let quorate = self.arrived.len() >= needed;
        match (all_sent, overdue, quorate) {
            (_, _, true) if all_sent || overdue => Some(Ending::Close),
            (true, true, false) if !self.refused.is_empty() => Some(Ending::Skip),
            _ => None,
        }
    }
}

/// How a round ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ending {
    /// With the updates that arrived.
    Close,
    /// Without a change to the model: too few updates were taken.
    Skip,
}

/// A [`Settle::Drop`] for each of `rounds` that `peer`'s job `job` is not included in.
fn left_out(
    included: &BTreeMap<u64, HashSet<String>>,
    job: &str,
    peer: &str,
    rounds: std::ops::Range<u64>,
) -> Vec<Settle> {
    rounds
        .filter(|round| {
            !included
                .get(round)
                .is_some_and(|peers| peers.contains(peer))
        })
        .map(|round| Settle::Drop {
            job: job.to_string(),
            round,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use hypha_messages::diloco::{Applied, Arrival, Refusal};

    use super::*;

    fn plan() -> RoundPlan {
        RoundPlan {
            rounds: Some(2),
            samples_per_round: 1200,
            batch_size: 10,
            round_ms: 10_000,
            quorum: 0.5,
            bench_after_refusals: 3,
            start_grace_ms: 0,
        }
    }

    fn status(round: u64, batches: u64, batch_ms: Option<f64>) -> TrainerStatus {
        TrainerStatus {
            round: Some(round),
            batches,
            samples: batches * 10,
            batch_ms,
            ..TrainerStatus::default()
        }
    }

    /// A trainer's status in `round`: one batch trained, and out of data.
    fn last_batch(round: u64) -> TrainerStatus {
        TrainerStatus {
            data_done: true,
            ..status(round, 1, Some(100.0))
        }
    }

    fn target(order: TrainerOrder) -> u64 {
        match order {
            TrainerOrder::Train { batches, .. } => batches,
            other => panic!("expected a batch target, got {other:?}"),
        }
    }

    fn rounds_with(trainers: &[(&str, &str)]) -> Rounds {
        let mut rounds = Rounds::new(plan());
        rounds.server_started("ps".into());
        for (job, peer) in trainers {
            rounds.trainer_started(job.to_string(), peer.to_string());
        }
        rounds
    }

    /// The server's status as a server that holds the trainers the scheduler names.
    fn report(
        rounds: &mut Rounds,
        mut status: ServerStatus,
        now_ms: u64,
    ) -> (ServerOrder, Vec<Settle>, Option<AppliedRound>) {
        status.trainers = rounds.server_trainers().into_iter().collect();
        rounds.server_status(status, now_ms)
    }

    fn server(round: u64, arrived: &[&str], applied: Option<(u64, &[&str])>) -> ServerStatus {
        ServerStatus {
            round: Some(round),
            arrived: arrived
                .iter()
                .map(|p| Arrival {
                    peer: p.to_string(),
                    samples: 100,
                })
                .collect(),
            dropped: vec![],
            applied: applied.map(|(round, included)| Applied {
                round,
                included: included.iter().map(|p| p.to_string()).collect(),
                model_hash: None,
                delta_bytes: None,
                largest_norm_ratio: None,
                close_ms: None,
                traffic_bytes: None,
                standby_bytes: None,
            }),
            ..ServerStatus::default()
        }
    }

    fn joined(job: &str, peer: &str, round: u64) -> News {
        News::Joined {
            job: job.into(),
            peer: peer.into(),
            round,
        }
    }

    /// The first round waits for every leased trainer to hold the model, the start grace at
    /// most after the first did: a trainer that loads slowly trains the run's first round, a
    /// broken one holds the start for the grace only, and joins the round in flight once it
    /// is ready.
    #[test]
    fn the_first_round_waits_for_slow_trainers_for_the_start_grace() {
        let mut rounds = Rounds::new(RoundPlan {
            start_grace_ms: 5_000,
            ..plan()
        });
        rounds.server_started("ps".into());
        for (job, peer) in [("job-a", "pa"), ("job-b", "pb"), ("job-c", "pc")] {
            rounds.trainer_started(job.into(), peer.into());
        }
        let wait = TrainerOrder::Wait { retry_ms: WAIT_MS };
        let (order, _) = rounds.trainer_status("job-a", status(0, 0, None), 1_000);
        assert_eq!(order, wait);
        assert_eq!(
            rounds.take_news(),
            vec![News::Waiting {
                ready: 1,
                trainers: 3,
                grace_ms: 5_000
            }]
        );
        let (order, _) = rounds.trainer_status("job-b", TrainerStatus::default(), 2_000);
        assert!(matches!(order, TrainerOrder::Join { .. }), "{order:?}");
        let (order, _) = rounds.trainer_status("job-b", status(0, 0, None), 3_000);
        assert_eq!(order, wait);
        assert_eq!(
            rounds.take_news(),
            vec![News::Waiting {
                ready: 2,
                trainers: 3,
                grace_ms: 5_000
            }]
        );
        let (order, _) = rounds.trainer_status("job-a", status(0, 0, None), 5_999);
        assert_eq!(order, wait);
        assert!(rounds.take_news().is_empty());
        // The grace since pa was ready is over: the round begins without pc.
        let (order, _) = rounds.trainer_status("job-a", status(0, 0, None), 6_000);
        assert!(target(order) > 0);
        assert_eq!(
            rounds.take_news(),
            vec![
                News::Began {
                    round: 0,
                    ready: 2,
                    late: vec!["pc".into()],
                    waited_ms: 5_000
                },
                joined("job-a", "pa", 0)
            ]
        );
        let (order, _) = rounds.trainer_status("job-b", status(0, 0, None), 6_100);
        assert!(target(order) > 0);
        assert_eq!(rounds.take_news(), vec![joined("job-b", "pb", 0)]);
        let (order, _) = rounds.trainer_status("job-c", status(0, 0, None), 9_000);
        assert!(target(order) > 0);
        assert_eq!(rounds.take_news(), vec![joined("job-c", "pc", 0)]);
    }

    /// The first round begins as soon as the last leased trainer is ready; a run that goes
    /// on from a checkpoint does not wait at all.
    #[test]
    fn the_first_round_begins_as_the_last_trainer_is_ready() {
        let grace = RoundPlan {
            start_grace_ms: 60_000,
            ..plan()
        };
        let mut rounds = Rounds::new(grace.clone());
        rounds.server_started("ps".into());
        rounds.trainer_started("job-a".into(), "pa".into());
        rounds.trainer_started("job-b".into(), "pb".into());
        let (order, _) = rounds.trainer_status("job-a", status(0, 0, None), 0);
        assert_eq!(order, TrainerOrder::Wait { retry_ms: WAIT_MS });
        let (order, _) = rounds.trainer_status("job-b", status(0, 0, None), 700);
        assert!(target(order) > 0);
        let news = rounds.take_news();
        assert_eq!(
            news[1..],
            [
                News::Began {
                    round: 0,
                    ready: 2,
                    late: vec![],
                    waited_ms: 700
                },
                joined("job-b", "pb", 0)
            ]
        );
        let (order, _) = rounds.trainer_status("job-a", status(0, 0, None), 800);
        assert!(target(order) > 0);

        let mut resumed = Rounds::new(grace);
        resumed.restored(4);
        resumed.server_started("ps".into());
        resumed.trainer_started("job-a".into(), "pa".into());
        resumed.trainer_started("job-b".into(), "pb".into());
        let (order, _) = resumed.trainer_status("job-a", status(4, 0, None), 0);
        assert!(target(order) > 0);
    }

    /// The server takes updates only from the trainers named to it, is told again when they
    /// change, and adopts the initial model of the trainer the scheduler picks, not of
    /// whoever offered first.
    #[test]
    fn the_server_is_told_its_trainers_and_whose_initial_model_to_adopt() {
        let mut rounds = rounds_with(&[("job-b", "pb"), ("job-a", "pa")]);
        let fresh = ServerStatus {
            offered: vec!["outsider".into(), "pb".into()],
            ..ServerStatus::default()
        };
        let (order, _, _) = rounds.server_status(fresh.clone(), 0);
        assert_eq!(
            order,
            ServerOrder::Trainers {
                peers: vec!["pa".into(), "pb".into()]
            }
        );
        let named = ServerStatus {
            trainers: vec!["pb".into(), "pa".into()],
            ..fresh
        };
        // pb offered; pa (the lower job id) has not yet: pb's is the one.
        let (order, _, _) = rounds.server_status(named.clone(), 10);
        assert_eq!(order, ServerOrder::Adopt { from: "pb".into() });
        let both = ServerStatus {
            offered: vec!["pb".into(), "pa".into()],
            ..named.clone()
        };
        let (order, _, _) = rounds.server_status(both, 20);
        assert_eq!(order, ServerOrder::Adopt { from: "pa".into() });
        // Only an outsider offered: nothing to adopt.
        let outsider_only = ServerStatus {
            offered: vec!["outsider".into()],
            ..named.clone()
        };
        let (order, _, _) = rounds.server_status(outsider_only, 30);
        assert_eq!(order, ServerOrder::Wait);

        rounds.trainer_started("job-c".into(), "pc".into());
        let (order, _, _) = rounds.server_status(named, 40);
        assert_eq!(
            order,
            ServerOrder::Trainers {
                peers: vec!["pa".into(), "pb".into(), "pc".into()]
            }
        );
    }

    #[test]
    fn trainers_join_then_get_targets_that_make_fast_and_slow_finish_together() {
        let mut rounds = rounds_with(&[("a", "pa"), ("b", "pb")]);
        let (order, _) = rounds.trainer_status("a", TrainerStatus::default(), 0);
        assert_eq!(
            order,
            TrainerOrder::Join {
                parameter_server: "ps".into()
            }
        );
        // Before anyone reports a batch time: an even share, 1200 / 10 / 2 = 60 batches.
        assert_eq!(
            target(rounds.trainer_status("a", status(0, 0, None), 0).0),
            60
        );
        rounds.trainer_status("b", status(0, 0, None), 0);
        // a does a batch in 100 ms, b in 300 ms: 100 + 33.3 samples/s, 1200 − 40 samples left
        // → 8.7 s more; a gets ≈ 87 more batches, b ≈ 29: each ends at the same time.
        rounds.trainer_status("b", status(0, 1, Some(300.0)), 300);
        let a = target(rounds.trainer_status("a", status(0, 3, Some(100.0)), 300).0);
        let b = target(rounds.trainer_status("b", status(0, 1, Some(300.0)), 300).0);
        assert!((88..=90).contains(&a), "a: {a}");
        assert!((29..=31).contains(&b), "b: {b}");
        let (a_ms, b_ms) = ((a - 3) as f64 * 100.0, (b - 1) as f64 * 300.0);
        assert!((a_ms - b_ms).abs() <= 300.0, "{a_ms} vs {b_ms}");
    }

    /// Issue 21, item 3: a trainer whose update takes 2 s to reach the server stops its
    /// inner steps 2 s earlier than one on a fast link, so that both updates arrive together,
    /// and the round still holds its samples.
    #[test]
    fn a_trainer_on_a_slow_link_stops_earlier_so_that_updates_arrive_together() {
        let mut rounds = rounds_with(&[("a", "pa"), ("b", "pb")]);
        let slow_link = |batches| TrainerStatus {
            send_ms: Some(2000.0),
            ..status(0, batches, Some(100.0))
        };
        rounds.trainer_status("a", status(0, 0, Some(100.0)), 0);
        rounds.trainer_status("b", slow_link(0), 0);
        let a = target(rounds.trainer_status("a", status(0, 0, Some(100.0)), 0).0);
        let b = target(rounds.trainer_status("b", slow_link(0), 0).0);
        // 1200 samples at 0.1 + 0.1 samples/ms, 200 of them lost to b's send: A = 7 s; a
        // trains 70 batches, b 50, and b's update arrives at 5 s + 2 s.
        assert!((69..=70).contains(&a), "a: {a}");
        assert!((49..=50).contains(&b), "b: {b}");
        assert!((a + b) * 10 >= 1180, "{} samples", (a + b) * 10);
        let arrivals = (a as f64 * 100.0, b as f64 * 100.0 + 2000.0);
        assert!((arrivals.0 - arrivals.1).abs() <= 200.0, "{arrivals:?}");
    }

    /// Once a round holds its samples, no trainer is given more, whatever its link: a
    /// trainer quicker to send than the others must not be told to fill their send time.
    #[test]
    fn a_full_round_gives_nobody_more_batches_whatever_their_links() {
        let mut rounds = rounds_with(&[("a", "pa"), ("b", "pb"), ("c", "pc")]);
        let linked = |batches, send| TrainerStatus {
            send_ms: Some(send),
            ..status(0, batches, Some(1.0))
        };
        for (job, send) in [("a", 4.0), ("b", 7.0), ("c", 19.0)] {
            rounds.trainer_status(job, linked(0, send), 0);
        }
        // Each has trained 40 batches of 10: the round's 1200 samples are done.
        for (job, send) in [("a", 4.0), ("b", 7.0), ("c", 19.0)] {
            rounds.trainer_status(job, linked(40, send), 40);
        }
        for (job, send) in [("a", 4.0), ("b", 7.0), ("c", 19.0)] {
            assert_eq!(
                target(rounds.trainer_status(job, linked(40, send), 41).0),
                40
            );
        }
        assert_eq!(arrival(&mut [(1.0, 0.5), (1.0, 1.0)], 0.0), 0.5);
        assert_eq!(arrival(&mut [(1.0, 1.0), (1.0, 0.0)], 1.0), 1.0);
        assert_eq!(arrival(&mut [(1.0, 0.0), (1.0, 0.0)], 2.0), 1.0);
    }

    /// A liar's impossible pace (a batch in 1e-310 ms) and send time (1e300 ms) neither make
    /// the plan NaN nor overflow its target: the others are planned within the round's time.
    #[test]
    fn impossible_paces_and_send_times_neither_overflow_nor_unbound_the_plan() {
        let mut rounds = rounds_with(&[("a", "pa"), ("b", "pb")]);
        let liar = |batches| TrainerStatus {
            send_ms: Some(1e300),
            ..status(0, batches, Some(1e-310))
        };
        rounds.trainer_status("a", status(0, 0, Some(100.0)), 0);
        rounds.trainer_status("b", liar(0), 0);
        let a = target(rounds.trainer_status("a", status(0, 0, Some(100.0)), 0).0);
        assert!(
            (1..=100).contains(&a),
            "a: {a} (the round's 10 s are 100 batches)"
        );
        // Its own target: as many as it likes, without overflowing.
        let b = target(rounds.trainer_status("b", liar(1 << 40), 0).0);
        assert!(b >= 1 << 40, "b: {b}");
    }

    #[test]
    fn a_trainer_at_its_target_counts_what_the_others_trained_since_they_last_spoke() {
        let mut rounds = rounds_with(&[("a", "pa"), ("b", "pb"), ("c", "pc")]);
        // Each at 100 ms a batch: 1200 samples are 40 batches each, 4 s.
        let mut targets = Vec::new();
        for job in ["a", "b", "c"] {
            rounds.trainer_status(job, status(0, 0, Some(100.0)), 0);
        }
        for job in ["a", "b", "c"] {
            targets.push(target(
                rounds.trainer_status(job, status(0, 0, Some(100.0)), 0).0,
            ));
        }
        assert_eq!(targets, [40, 40, 40]);
        // At 4 s, a reaches its target and speaks first; b and c last spoke at 0 but have
        // trained theirs too: the round is full, a syncs now.
        let a = target(
            rounds
                .trainer_status("a", status(0, 40, Some(100.0)), 4000)
                .0,
        );
        assert_eq!(a, 40, "a was told to train {} more batches", a - 40);
        // Halfway, a trainer that speaks gets what is left of its own share, not more.
        let mut rounds = rounds_with(&[("a", "pa"), ("b", "pb")]);
        for job in ["a", "b", "a", "b"] {
            rounds.trainer_status(job, status(0, 0, Some(100.0)), 0);
        }
        let a = target(
            rounds
                .trainer_status("a", status(0, 30, Some(100.0)), 3000)
                .0,
        );
        assert!((59..=61).contains(&a), "a: {a}");
    }

    /// A trainer that claims 10¹² samples (or u64::MAX) is believed only up to what it was
    /// told to train: the honest trainer's target is what it would be had the liar trained
    /// its share, and nothing overflows.
    #[test]
    fn a_trainer_claiming_more_samples_than_it_was_given_does_not_shrink_the_others_rounds() {
        let honest_target = |claim: u64| {
            let mut rounds = rounds_with(&[("liar", "l"), ("honest", "h")]);
            let paced = |batches| status(0, batches, Some(100.0));
            rounds.trainer_status("liar", TrainerStatus::default(), 0);
            rounds.trainer_status("honest", TrainerStatus::default(), 0);
            rounds.trainer_status("liar", paced(0), 0);
            rounds.trainer_status("honest", paced(0), 0);
            let lie = TrainerStatus {
                samples: claim,
                ..paced(4)
            };
            rounds.trainer_status("liar", lie, 400);
            target(rounds.trainer_status("honest", paced(4), 400).0)
        };
        let truthful = honest_target(40);
        assert!(
            truthful > 1,
            "an honest report leaves the round to train: {truthful}"
        );
        for claim in [1_000_000_000_000, u64::MAX] {
            assert!(
                honest_target(claim) >= truthful / 2,
                "a claim of {claim} samples shrank the honest target to {} (from {truthful})",
                honest_target(claim)
            );
        }
    }

    #[test]
    fn the_first_trainer_to_ask_in_a_new_round_gets_its_share_not_the_whole_round() {
        let mut rounds = rounds_with(&[("a", "pa"), ("b", "pb"), ("c", "pc")]);
        for job in ["a", "b", "c"] {
            rounds.trainer_status(job, status(0, 40, Some(100.0)), 0);
        }
        report(&mut rounds, server(0, &["pa", "pb", "pc"], None), 100);
        report(
            &mut rounds,
            server(1, &[], Some((0, &["pa", "pb", "pc"]))),
            200,
        );
        assert_eq!(rounds.round(), 1);
        // a asks for round 1 while b's and c's last word is still of round 0: the round's
        // 1200 samples are 120 batches over three, 40 each.
        let a = target(rounds.trainer_status("a", status(1, 0, Some(100.0)), 300).0);
        assert!((39..=41).contains(&a), "a: {a}");
    }

    #[test]
    fn a_round_is_bounded_in_time() {
        let mut rounds = rounds_with(&[("a", "pa")]);
        rounds.trainer_status("a", status(0, 0, None), 0);
        // 1 s per batch would need 120 s; the round may take 10 s.
        let t = target(
            rounds
                .trainer_status("a", status(0, 2, Some(1000.0)), 2000)
                .0,
        );
        assert_eq!(t, 2 + 8);
    }

    #[test]
    fn a_round_closes_when_all_arrived_and_commits_only_the_included() {
        let mut rounds = rounds_with(&[("a", "pa"), ("b", "pb")]);
        rounds.trainer_status("a", status(0, 5, Some(100.0)), 0);
        rounds.trainer_status("b", status(0, 5, Some(100.0)), 0);
        let (order, _, _) = report(&mut rounds, server(0, &["pa"], None), 100);
        assert_eq!(order, ServerOrder::Wait);
        let (order, _, _) = report(&mut rounds, server(0, &["pa", "pb"], None), 200);
        let ServerOrder::Close {
            round: 0,
            mut send_to,
        } = order
        else {
            panic!("expected a close, got {order:?}")
        };
        send_to.sort();
        assert_eq!(send_to, ["pa", "pb"]);
        // While the close is pending, trainers are told to sync.
        assert_eq!(
            target(rounds.trainer_status("a", status(0, 7, Some(100.0)), 250).0),
            7
        );
        let (_, settle, applied) =
            report(&mut rounds, server(1, &[], Some((0, &["pa", "pb"]))), 300);
        assert_eq!(settle.len(), 2);
        assert_eq!(applied.unwrap().samples, 200, "as the server counted them");
        assert_eq!(rounds.round(), 1);
        // Round 1 is the last: once applied, everyone is done.
        rounds.trainer_status("a", status(1, 1, Some(100.0)), 400);
        report(&mut rounds, server(1, &["pa"], None), 500);
        rounds.trainer_ended("b", 0);
        let (order, _, _) = report(&mut rounds, server(1, &["pa"], None), 600);
        assert!(
            matches!(order, ServerOrder::Close { round: 1, .. }),
            "{order:?}"
        );
        let (order, _, _) = report(&mut rounds, server(2, &[], Some((1, &["pa"]))), 700);
        assert_eq!(order, ServerOrder::Done);
        assert_eq!(
            rounds.trainer_status("a", status(2, 0, None), 800).0,
            TrainerOrder::Done
        );
    }

    #[test]
    fn a_trainer_ahead_of_the_applied_round_waits() {
        let mut rounds = rounds_with(&[("a", "pa")]);
        rounds.trainer_status("a", status(0, 1, Some(100.0)), 0);
        report(&mut rounds, server(0, &["pa"], None), 10);
        // The model of round 1 reached the trainer before the server reported round 0 applied.
        assert!(matches!(
            rounds.trainer_status("a", status(1, 0, None), 20).0,
            TrainerOrder::Wait { .. }
        ));
        report(&mut rounds, server(1, &[], Some((0, &["pa"]))), 30);
        assert!(target(rounds.trainer_status("a", status(1, 0, None), 40).0) > 0);
    }

    /// `status` saying the server refused an update of each of `peers`.
    fn refusing(mut status: ServerStatus, peers: &[&str]) -> ServerStatus {
        status.refused = peers
            .iter()
            .map(|peer| Refusal {
                peer: peer.to_string(),
                reason: "claims 1000000000000 samples, more than 1200".into(),
            })
            .collect();
        status
    }

    /// A trainer whose update the server refused is not waited for: the round closes as soon
    /// as the others are in (long before its deadline) where they make the quorum, and the
    /// refused trainer's slices go back. Refusals count against the quorum: where too few
    /// updates were taken (a liar's alone, say), the round ends without a change at its
    /// deadline, everybody left out; so does a round whose every update was refused.
    #[test]
    fn a_round_does_not_wait_for_a_trainer_whose_update_was_refused() {
        let mut rounds = Rounds::new(RoundPlan {
            rounds: Some(4),
            ..plan()
        });
        rounds.server_started("ps".into());
        for (job, peer) in [("a", "pa"), ("b", "pb"), ("c", "pc")] {
            rounds.trainer_started(job.into(), peer.into());
            rounds.trainer_status(job, status(0, 1, Some(100.0)), 0);
        }
        let (order, _, _) = report(&mut rounds, server(0, &["pa", "pb"], None), 100);
        assert_eq!(order, ServerOrder::Wait, "c may still send");
        let (order, _, _) = report(
            &mut rounds,
            refusing(server(0, &["pa", "pb"], None), &["pc"]),
            200,
        );
        assert!(
            matches!(order, ServerOrder::Close { round: 0, .. }),
            "{order:?}"
        );
        let (_, settle, applied) =
            report(&mut rounds, server(1, &[], Some((0, &["pa", "pb"]))), 300);
        assert_eq!(settle.len(), 2);
        assert_eq!(applied.unwrap().included, ["pa", "pb"]);
        let (_, settle) = rounds.trainer_status("c", status(1, 0, None), 400);
        assert_eq!(settle, [drop("c", 0)]);

        // Round 1: a and b refused, c's update taken: 1 of 3, below the quorum of 2. Not
        // applied; at the deadline (10 s + 2.5 s), skipped.
        for job in ["a", "b", "c"] {
            rounds.trainer_status(job, status(1, 1, Some(100.0)), 500);
        }
        let refused = || refusing(server(1, &["pc"], None), &["pa", "pb"]);
        let (order, _, _) = report(&mut rounds, refused(), 600);
        assert_eq!(order, ServerOrder::Wait);
        let (order, _, _) = report(&mut rounds, refused(), 13_000);
        assert!(
            matches!(order, ServerOrder::Skip { round: 1, .. }),
            "{order:?}"
        );
        let (order, settle, applied) = report(&mut rounds, server(2, &[], Some((1, &[]))), 13_100);
        assert!(settle.is_empty());
        assert!(applied.unwrap().included.is_empty());
        assert_eq!(order, ServerOrder::Wait);
        assert_eq!(rounds.round(), 2);
        for job in ["a", "b", "c"] {
            let (_, settle) = rounds.trainer_status(job, status(2, 1, Some(100.0)), 13_200);
            assert_eq!(settle, [drop(job, 1)], "{job}");
        }

        // Round 2: every update refused: skipped at the deadline, not before.
        let refused = || refusing(server(2, &[], None), &["pa", "pb", "pc"]);
        let (order, _, _) = report(&mut rounds, refused(), 13_300);
        assert_eq!(order, ServerOrder::Wait);
        let (order, _, _) = report(&mut rounds, refused(), 30_000);
        assert!(
            matches!(order, ServerOrder::Skip { round: 2, .. }),
            "{order:?}"
        );
    }

    /// A trainer whose update is refused in `bench_after_refusals` (3) rounds in a row is
    /// benched as the third of them ends, and rounds no longer count it once its job ended; one
    /// whose update is taken in between starts its count again, and is not benched.
    #[test]
    fn a_trainer_refused_three_rounds_in_a_row_is_benched() {
        let mut rounds = Rounds::new(RoundPlan {
            rounds: Some(10),
            ..plan()
        });
        rounds.server_started("ps".into());
        let trainers = [("a", "pa"), ("b", "pb"), ("c", "pc"), ("l", "pl")];
        for (job, peer) in trainers {
            rounds.trainer_started(job.into(), peer.into());
        }
        // l is refused in every round; b in every round but round 2.
        let mut now = 0;
        for round in 0..5u64 {
            for (job, _) in trainers.iter().filter(|(job, _)| round < 3 || *job != "l") {
                rounds.trainer_status(job, status(round, 1, Some(100.0)), now);
            }
            let (taken, refused): (&[&str], &[&str]) = match round {
                2 => (&["pa", "pb", "pc"], &["pl"]),
                0 | 1 => (&["pa", "pc"], &["pb", "pl"]),
                _ => (&["pa", "pc"], &["pb"]),
            };
            now += 100;
            let (order, _, _) = report(
                &mut rounds,
                refusing(server(round, taken, None), refused),
                now,
            );
            assert!(
                matches!(order, ServerOrder::Close { round: r, .. } if r == round),
                "round {round}: {order:?}"
            );
            now += 100;
            let (_, _, applied) = report(
                &mut rounds,
                server(round + 1, &[], Some((round, taken))),
                now,
            );
            let benched = applied.unwrap().benched;
            if round == 2 {
                assert_eq!(benched, ["pl"]);
                rounds.trainer_ended("l", 0);
                assert!(!rounds.server_trainers().contains("pl"));
            } else {
                assert!(benched.is_empty(), "round {round}: {benched:?}");
            }
        }
    }

    /// A restarted scheduler names the server every trainer of the earlier process still
    /// being taken over, so that the server keeps taking their updates of the round in flight;
    /// one whose takeover ended without its job is named no more. (Checked by naming only the
    /// trainers taken over: the first answer drops pb, whose update the server then refuses.)
    #[test]
    fn trainers_being_taken_over_stay_named_to_the_server() {
        let mut rounds = rounds_with(&[]);
        rounds.taking_over("pa".into());
        rounds.taking_over("pb".into());
        let named = |order: ServerOrder| match order {
            ServerOrder::Trainers { mut peers } => {
                peers.sort();
                Some(peers)
            }
            _ => None,
        };
        let mut status = server(0, &["pb"], None);
        status.trainers = vec!["pa".into(), "pb".into()];
        let (order, _, _) = rounds.server_status(status.clone(), 100);
        assert_eq!(named(order), None, "the server's list stands");
        rounds.trainer_taken_over("a".into(), "pa".into(), false);
        let (order, _, _) = rounds.server_status(status.clone(), 200);
        assert_eq!(named(order), None);
        rounds.takeover_ended("pb");
        let (order, _, _) = rounds.server_status(status, 300);
        assert_eq!(named(order), Some(vec!["pa".to_string()]));
    }

    fn drop(job: &str, round: u64) -> Settle {
        Settle::Drop {
            job: job.into(),
            round,
        }
    }

    #[test]
    fn a_straggler_is_left_out_after_the_deadline_and_its_slices_go_back() {
        let mut rounds = rounds_with(&[("a", "pa"), ("b", "pb"), ("c", "pc")]);
        for job in ["a", "b", "c"] {
            rounds.trainer_status(job, status(0, 1, Some(100.0)), 0);
        }
        // Two of three arrived: not before 10 s + 2.5 s grace, then with quorum 0.5.
        let (order, _, _) = report(&mut rounds, server(0, &["pa", "pb"], None), 12_000);
        assert_eq!(order, ServerOrder::Wait);
        let (order, _, _) = report(&mut rounds, server(0, &["pa", "pb"], None), 12_500);
        assert!(matches!(order, ServerOrder::Close { round: 0, .. }));
        let (_, settle, _) = report(
            &mut rounds,
            server(1, &[], Some((0, &["pa", "pb"]))),
            12_600,
        );
        assert_eq!(settle.len(), 2);
        // c still trains round 0: told to sync now; its update will be late. When it reports
        // round 1, its round 0 goes back to the ledger.
        assert_eq!(
            target(
                rounds
                    .trainer_status("c", status(0, 90, Some(100.0)), 12_700)
                    .0
            ),
            90
        );
        let (_, settle) = rounds.trainer_status("c", status(1, 0, None), 13_000);
        assert_eq!(
            settle,
            vec![Settle::Drop {
                job: "c".into(),
                round: 0
            }]
        );
        // Settled once only.
        assert!(
            rounds
                .trainer_status("c", status(1, 1, Some(100.0)), 13_100)
                .1
                .is_empty()
        );
    }

    /// Training ends when every trainer is out of data and the ledger has none left to hand
    /// out: while slices are still on their way to workers (or held by others), trainers
    /// out of data for now ask again.
    #[test]
    fn training_ends_when_every_trainer_is_out_of_data() {
        let mut rounds = rounds_with(&[("a", "pa"), ("b", "pb")]);
        let out = TrainerStatus {
            round: Some(0),
            data_done: true,
            ..TrainerStatus::default()
        };
        let (order, _) = rounds.trainer_status("a", out.clone(), 0);
        assert!(
            matches!(order, TrainerOrder::Train { .. }),
            "b may still have data: {order:?}"
        );
        rounds.data_left(true);
        let (order, _) = rounds.trainer_status("b", out.clone(), 5);
        assert!(
            matches!(order, TrainerOrder::Train { .. }),
            "slices are on their way: {order:?}"
        );
        rounds.data_left(false);
        assert_eq!(rounds.trainer_status("b", out, 10).0, TrainerOrder::Done);
        assert_eq!(
            report(&mut rounds, server(0, &[], None), 20).0,
            ServerOrder::Done
        );
    }

    /// The last round applied with every trainer out of data does not end the training
    /// while slices of the round go back: those of a job that ended with its update maybe
    /// still on its way (a trainer killed as it sent it), and those of a departed job whose
    /// update did not make the round. The run gives them back, and trainers train them.
    #[test]
    fn slices_going_back_with_the_last_round_are_not_the_end_of_the_data() {
        let mut rounds = Rounds::new(RoundPlan {
            rounds: None,
            ..plan()
        });
        rounds.server_started("ps".into());
        for (job, peer) in [("a", "pa"), ("b", "pb")] {
            rounds.trainer_started(job.into(), peer.into());
            rounds.trainer_status(job, status(0, 1, Some(100.0)), 0);
        }
        // b ends having trained round 0; a trains the last slice and is out of data.
        assert!(
            rounds.trainer_ended("b", 100),
            "b's update may be on its way"
        );
        rounds.trainer_status("a", last_batch(0), 200);
        let (order, _, _) = report(&mut rounds, server(0, &["pa"], None), 300);
        assert!(
            matches!(order, ServerOrder::Close { round: 0, .. }),
            "{order:?}"
        );
        // Applied without b, whose update was not heard yet.
        let applied = server(1, &[], Some((0, &["pa"])));
        assert!(rounds.applies(&applied));
        let (order, _, _) = report(&mut rounds, applied, 400);
        assert_ne!(order, ServerOrder::Done, "b's slices may go back");
        assert!(!rounds.done());

        // Round 1: a trains on; c ends with its update arrived, and the round is applied
        // without it (too late for the server): c's slices go back. b's wait is over by now.
        rounds.trainer_started("c".into(), "pc".into());
        rounds.trainer_status("c", status(1, 1, Some(100.0)), 2_500);
        rounds.trainer_status("a", last_batch(1), 2_600);
        let (order, _, _) = report(&mut rounds, server(1, &["pa"], None), 2_650);
        assert_eq!(
            order,
            ServerOrder::Trainers {
                peers: vec!["pa".into(), "pc".into()]
            },
            "b no longer"
        );
        let (order, _, _) = report(&mut rounds, server(1, &["pa", "pc"], None), 2_700);
        assert!(
            matches!(order, ServerOrder::Close { round: 1, .. }),
            "{order:?}"
        );
        assert!(rounds.trainer_ended("c", 2_800), "c's update arrived");
        let (order, settle, _) = report(&mut rounds, server(2, &[], Some((1, &["pa"]))), 2_900);
        assert!(settle.contains(&drop("c", 1)), "{settle:?}");
        assert_ne!(order, ServerOrder::Done, "c's slices go back");
        assert!(!rounds.done());
    }

    #[test]
    fn a_lost_trainer_leaves_the_round_at_once() {
        let mut rounds = rounds_with(&[("a", "pa"), ("b", "pb")]);
        rounds.trainer_status("a", status(0, 1, Some(100.0)), 0);
        rounds.trainer_status("b", status(0, 1, Some(100.0)), 0);
        assert_eq!(
            report(&mut rounds, server(0, &["pa"], None), 100).0,
            ServerOrder::Wait
        );
        rounds.trainer_ended("b", 0);
        let (order, _, _) = report(&mut rounds, server(0, &["pa"], None), 200);
        assert_eq!(
            order,
            ServerOrder::Close {
                round: 0,
                send_to: vec!["pa".into()]
            }
        );
    }

    #[test]
    fn trainers_taken_over_after_a_restart_rejoin_and_give_back_rounds_past_the_checkpoint() {
        // A restarted scheduler goes on from the checkpoint of round 3; the earlier server
        // may have reached round 5.
        let mut rounds = Rounds::new(RoundPlan {
            rounds: Some(10),
            ..plan()
        });
        rounds.restored(3);
        rounds.reached(5);
        rounds.trainer_taken_over("a".into(), "pa".into(), false);
        // Before the restored server runs, a trainer taken over waits.
        assert_eq!(
            rounds.trainer_status("a", status(4, 2, Some(100.0)), 0).0,
            TrainerOrder::Wait { retry_ms: RETRY_MS }
        );
        rounds.server_started("ps".into());
        let (order, settle) = rounds.trainer_status("a", status(4, 2, Some(100.0)), 10);
        assert_eq!(
            order,
            TrainerOrder::Join {
                parameter_server: "ps".into()
            }
        );
        let dropped: Vec<u64> = settle
            .iter()
            .map(|s| match s {
                Settle::Drop { round, .. } => *round,
                Settle::Commit { round, .. } => panic!("round {round} committed"),
            })
            .collect();
        // Rounds before the checkpoint's that reached the model were committed when the run
        // resumed; dropping them finds nothing. Those left out go back.
        assert_eq!(dropped, [0, 1, 2, 3, 4], "every round it held");
        // A trainer that claims a round no server reached gives back no more than reached.
        rounds.trainer_taken_over("b".into(), "pb".into(), false);
        let (_, settle) = rounds.trainer_status("b", status(1_000_000, 2, None), 20);
        assert_eq!(settle.len(), 6, "rounds 0..=5: {settle:?}");
        // Once it holds no model of the earlier server, it trains the checkpoint's round.
        rounds.trainer_status("a", TrainerStatus::default(), 30);
        let (order, _) = rounds.trainer_status("a", status(3, 0, None), 40);
        assert!(
            matches!(order, TrainerOrder::Train { round: 3, .. }),
            "{order:?}"
        );
    }

    #[test]
    fn trainers_mid_round_on_the_model_a_replacement_starts_from_go_on_with_it() {
        let mut rounds = Rounds::new(RoundPlan {
            rounds: Some(10),
            ..plan()
        });
        rounds.server_started("ps".into());
        for (job, peer) in [("a", "pa"), ("b", "pb"), ("c", "pc"), ("d", "pd")] {
            rounds.trainer_started(job.into(), peer.into());
            rounds.trainer_status(job, TrainerStatus::default(), 0);
            rounds.trainer_status(job, status(0, 1, Some(100.0)), 0);
        }
        report(&mut rounds, server(0, &["pa", "pb", "pc", "pd"], None), 10);
        report(
            &mut rounds,
            server(1, &[], Some((0, &["pa", "pb", "pc", "pd"]))),
            20,
        );
        let on = |hash: &str, syncing: Option<bool>| TrainerStatus {
            model_hash: Some(hash.into()),
            syncing,
            ..status(1, 1, Some(100.0))
        };
        // The standby holds round 1's model ("h1") and takes over.
        rounds.server_lost();
        rounds.restored(1);
        rounds.server_started("standby".into());
        rounds.goes_on_from("h1".into());
        // a trains round 1 on that model: it waits until the new server takes its update,
        // then goes on, its update to the new server, and nothing of its round goes back.
        let (order, settle) = rounds.trainer_status("a", on("h1", Some(false)), 25);
        assert!(matches!(order, TrainerOrder::Wait { .. }), "{order:?}");
        assert!(settle.is_empty(), "{settle:?}");
        report(&mut rounds, server(1, &[], None), 28);
        let (order, settle) = rounds.trainer_status("a", on("h1", Some(false)), 30);
        assert!(
            matches!(&order, TrainerOrder::Train { round: 1, parameter_server, .. } if parameter_server == "standby"),
            "{order:?}"
        );
        assert!(settle.is_empty(), "{settle:?}");
        // b sent its update to the lost server, c holds another model, d does not say
        // whether it is sending (an older trainer): each starts the round over.
        for (job, status) in [
            ("b", on("h1", Some(true))),
            ("c", on("h0", Some(false))),
            ("d", on("h1", None)),
        ] {
            let (order, settle) = rounds.trainer_status(job, status, 40);
            assert_eq!(
                order,
                TrainerOrder::Join {
                    parameter_server: "standby".into()
                },
                "{job}"
            );
            assert_eq!(
                settle,
                vec![Settle::Drop {
                    job: job.into(),
                    round: 1
                }],
                "{job}"
            );
        }
        // A server started with no fingerprint to go on from (none recorded) has everyone
        // join it.
        rounds.server_lost();
        rounds.restored(1);
        rounds.server_started("ps3".into());
        let (order, _) = rounds.trainer_status("a", on("h1", Some(false)), 50);
        assert!(matches!(order, TrainerOrder::Join { .. }), "{order:?}");
    }

    #[test]
    fn a_replaced_server_restores_its_round_and_trainers_rejoin_giving_lost_rounds_back() {
        let mut rounds = Rounds::new(RoundPlan {
            rounds: Some(10),
            ..plan()
        });
        rounds.server_started("ps".into());
        for (job, peer) in [("a", "pa"), ("b", "pb")] {
            rounds.trainer_started(job.into(), peer.into());
        }
        for job in ["a", "b"] {
            rounds.trainer_status(job, TrainerStatus::default(), 0);
        }
        // Round 0 is applied with both; round 1 with a only, then the server is lost while
        // round 2 trains. The scheduler's checkpoint holds round 1's start: round 1 is lost.
        rounds.trainer_status("a", status(0, 1, Some(100.0)), 0);
        rounds.trainer_status("b", status(0, 1, Some(100.0)), 0);
        report(&mut rounds, server(0, &["pa", "pb"], None), 10);
        report(&mut rounds, server(1, &[], Some((0, &["pa", "pb"]))), 20);
        rounds.trainer_status("a", status(1, 1, Some(100.0)), 30);
        report(&mut rounds, server(1, &["pa"], None), 13_000);
        report(&mut rounds, server(2, &[], Some((1, &["pa"]))), 13_100);
        rounds.trainer_status("a", status(2, 1, Some(100.0)), 13_200);
        assert_eq!(rounds.round(), 2);

        rounds.server_lost();
        assert_eq!(
            rounds
                .trainer_status("a", status(2, 2, Some(100.0)), 13_300)
                .0,
            TrainerOrder::Wait { retry_ms: RETRY_MS }
        );
        rounds.restored(1);
        rounds.server_started("ps2".into());
        assert_eq!(rounds.round(), 1);
        let (order, settle) = rounds.trainer_status("a", status(2, 2, Some(100.0)), 13_400);
        assert_eq!(
            order,
            TrainerOrder::Join {
                parameter_server: "ps2".into()
            }
        );
        assert_eq!(
            settle,
            vec![
                Settle::Drop {
                    job: "a".into(),
                    round: 1
                },
                Settle::Drop {
                    job: "a".into(),
                    round: 2
                }
            ],
            "round 1 was applied by the lost server only; round 2 never was"
        );
        // b was left out of round 1 and still holds round 1's model.
        let (order, settle) = rounds.trainer_status("b", status(1, 1, Some(100.0)), 13_400);
        assert!(matches!(order, TrainerOrder::Join { .. }));
        assert_eq!(
            settle,
            vec![Settle::Drop {
                job: "b".into(),
                round: 1
            }]
        );
        // An answer to join that was lost: a is told again, with the same rounds given back.
        let (order, again) = rounds.trainer_status("a", status(2, 2, Some(100.0)), 13_450);
        assert!(matches!(order, TrainerOrder::Join { .. }));
        assert_eq!(again.len(), 2, "{again:?}");
        // Both abandon their rounds and join (no round while they wait for the new server's
        // model), then train round 1 under the new server; it is applied as round 1.
        for job in ["a", "b"] {
            let (order, settle) = rounds.trainer_status(job, TrainerStatus::default(), 13_480);
            assert!(
                matches!(order, TrainerOrder::Join { ref parameter_server } if parameter_server == "ps2")
            );
            assert!(settle.is_empty());
            let (order, settle) = rounds.trainer_status(job, status(1, 0, None), 13_500);
            assert!(
                matches!(order, TrainerOrder::Train { round: 1, ref parameter_server, .. } if parameter_server == "ps2")
            );
            assert!(settle.is_empty());
        }
        rounds.trainer_status("a", status(1, 3, Some(100.0)), 14_000);
        rounds.trainer_status("b", status(1, 3, Some(100.0)), 14_000);
        assert!(matches!(
            report(&mut rounds, server(1, &["pa", "pb"], None), 14_100).0,
            ServerOrder::Close { round: 1, .. }
        ));
        let (_, settle, applied) = report(
            &mut rounds,
            server(2, &[], Some((1, &["pa", "pb"]))),
            14_200,
        );
        assert_eq!(applied.unwrap().round, 1);
        assert_eq!(settle.len(), 2);
    }

    #[test]
    fn a_server_that_went_on_is_resumed_at_its_round_and_trainers_train_on_with_it() {
        // A restarted scheduler goes on from the checkpoint of round 3. The earlier process
        // heard rounds 3 (a and b) and 4 (a only) applied; the server applied round 5 (a and
        // b) and collects round 6.
        let start = || {
            let mut rounds = Rounds::new(RoundPlan {
                rounds: Some(10),
                ..plan()
            });
            rounds.restored(3);
            rounds.reached(6);
            rounds
        };
        let recorded = [(3, "pa".to_string()), (3, "pb".into()), (4, "pa".into())];
        // What does not fit is refused, and changes nothing.
        let mut rounds = start();
        for (status, why) in [
            (
                server(7, &[], Some((6, &["pa"]))),
                "past what the job can have reached",
            ),
            (server(2, &[], None), "before the checkpoint"),
            (server(6, &[], Some((5, &["pa"]))), "round 4 missing"),
            (ServerStatus::default(), "no model"),
        ] {
            let recorded = if why == "round 4 missing" {
                &recorded[..2]
            } else {
                &recorded[..]
            };
            assert!(
                rounds
                    .server_resumed("ps".into(), &status, recorded)
                    .is_err(),
                "{why}"
            );
            assert_eq!(rounds.round(), 3, "{why}");
        }
        let mut rounds = start();
        let first = server(6, &["pa", "pb"], Some((5, &["pa", "pb"])));
        let unheard = rounds
            .server_resumed("ps".into(), &first, &recorded)
            .unwrap();
        assert_eq!(
            unheard.map(|a| a.round),
            Some(5),
            "its last round was not heard"
        );
        assert_eq!(rounds.round(), 6);
        // Pseudo-gradients arrived while the scheduler was away; the round does not close
        // before the trainers are known, or the new model would go to nobody.
        assert_eq!(rounds.server_status(first, 5).0, ServerOrder::Wait);
        // Trainers taken over now train on with it, without joining; each gives back the
        // rounds it was left out of since the checkpoint.
        rounds.trainer_taken_over("a".into(), "pa".into(), false);
        rounds.trainer_taken_over("b".into(), "pb".into(), false);
        let (order, settle) = rounds.trainer_status("a", status(6, 2, Some(100.0)), 10);
        assert!(
            matches!(order, TrainerOrder::Train { round: 6, ref parameter_server, .. } if parameter_server == "ps"),
            "{order:?}"
        );
        assert!(settle.is_empty(), "{settle:?}");
        let (order, settle) = rounds.trainer_status("b", status(6, 1, Some(100.0)), 10);
        assert!(
            matches!(order, TrainerOrder::Train { round: 6, .. }),
            "{order:?}"
        );
        assert_eq!(
            settle,
            vec![Settle::Drop {
                job: "b".into(),
                round: 4
            }]
        );
        // The round closes and is applied as round 6.
        rounds.trainer_status("a", status(6, 5, Some(100.0)), 20);
        rounds.trainer_status("b", status(6, 5, Some(100.0)), 20);
        assert!(matches!(
            report(&mut rounds, server(6, &["pa", "pb"], None), 30).0,
            ServerOrder::Close { round: 6, .. }
        ));
        let (_, settle, applied) =
            report(&mut rounds, server(7, &[], Some((6, &["pa", "pb"]))), 40);
        assert_eq!(applied.unwrap().round, 6);
        assert_eq!(settle.len(), 2);
        // A server that replaces it later is a new one: trainers taken over then rejoin.
        rounds.server_lost();
        rounds.restored(7);
        rounds.server_started("ps2".into());
        rounds.trainer_taken_over("c".into(), "pc".into(), false);
        let (order, _) = rounds.trainer_status("c", status(7, 1, None), 50);
        assert!(matches!(order, TrainerOrder::Join { .. }), "{order:?}");
    }

    #[test]
    fn a_trainer_that_ends_after_its_update_arrived_is_settled_with_the_round() {
        let mut rounds = rounds_with(&[("a", "pa"), ("b", "pb")]);
        for job in ["a", "b"] {
            rounds.trainer_status(job, TrainerStatus::default(), 0);
            rounds.trainer_status(job, status(0, 2, Some(100.0)), 0);
        }
        report(&mut rounds, server(0, &["pa"], None), 10);
        // a's update is at the server when its job ends; b's is not when its job ends, and
        // the server's statuses of the next second do not name it either: its slices go back.
        assert!(
            rounds.trainer_ended("a", 10),
            "a's slices wait for the round"
        );
        assert!(rounds.departed("a"));
        assert!(
            rounds.trainer_ended("b", 10),
            "b's update may be on its way"
        );
        report(&mut rounds, server(0, &["pa"], None), 11);
        report(&mut rounds, server(0, &["pa"], None), 12);
        assert!(rounds.departed("b"), "statuses in a burst are not a second");
        report(&mut rounds, server(0, &["pa"], None), 1_010);
        assert!(!rounds.departed("b"), "b's slices go back");
        // A new job on a's peer is not credited with a's update.
        rounds.trainer_started("a2".into(), "pa".into());
        rounds.trainer_status("a2", TrainerStatus::default(), 20);
        report(&mut rounds, server(0, &["pa"], None), 13_000);
        let (_, settle, applied) = report(&mut rounds, server(1, &[], Some((0, &["pa"]))), 13_100);
        assert_eq!(applied.unwrap().included, ["pa"]);
        assert_eq!(
            settle,
            vec![Settle::Commit {
                job: "a".into(),
                round: 0
            }]
        );
        assert!(!rounds.departed("a"));
        // Had the server been lost instead, a's round would have gone back.
        let mut rounds = rounds_with(&[("a", "pa")]);
        rounds.trainer_status("a", TrainerStatus::default(), 0);
        rounds.trainer_status("a", status(0, 2, Some(100.0)), 0);
        report(&mut rounds, server(0, &["pa"], None), 10);
        rounds.trainer_ended("a", 0);
        rounds.server_lost();
        assert_eq!(
            rounds.abandon_departed(),
            vec![Settle::Drop {
                job: "a".into(),
                round: 0
            }]
        );
    }

    /// A trainer that leaves (told to stop, or killed) right after sending its update is
    /// settled with the round when the server reports the update after the job's end; one
    /// that trained nothing in the round gives its slices back at once.
    #[test]
    fn a_trainer_that_ends_as_its_update_arrives_is_settled_with_the_round() {
        let mut rounds = rounds_with(&[("a", "pa"), ("b", "pb"), ("c", "pc")]);
        for job in ["a", "b", "c"] {
            rounds.trainer_status(job, TrainerStatus::default(), 0);
        }
        rounds.trainer_status("a", status(0, 2, Some(100.0)), 0);
        rounds.trainer_status("b", status(0, 2, Some(100.0)), 0);
        rounds.trainer_status("c", status(0, 0, None), 0);
        assert!(rounds.trainer_ended("a", 0));
        assert!(
            !rounds.trainer_ended("c", 0),
            "c trained nothing: its slices go back"
        );
        assert!(
            rounds.server_trainers().contains("pa"),
            "the server keeps taking a's update"
        );
        report(&mut rounds, server(0, &["pa"], None), 10);
        report(&mut rounds, server(0, &["pa", "pb"], None), 20);
        let (_, settle, applied) =
            report(&mut rounds, server(1, &[], Some((0, &["pa", "pb"]))), 30);
        assert_eq!(applied.unwrap().round, 0);
        assert!(settle.contains(&Settle::Commit {
            job: "a".into(),
            round: 0
        }));
        assert!(!rounds.departed("a"));
    }

    #[test]
    fn a_trainer_still_to_join_joins_the_server_that_went_on() {
        let mut rounds = Rounds::new(RoundPlan {
            rounds: Some(10),
            ..plan()
        });
        rounds.restored(3);
        rounds.reached(4);
        rounds
            .server_resumed("ps".into(), &server(3, &[], None), &[])
            .unwrap();
        rounds.trainer_taken_over("a".into(), "pa".into(), true);
        assert!(rounds.must_rejoin("a"));
        let (order, _) = rounds.trainer_status("a", status(7, 1, None), 10);
        assert!(matches!(order, TrainerOrder::Join { .. }), "{order:?}");
        rounds.trainer_taken_over("b".into(), "pb".into(), false);
        assert!(!rounds.must_rejoin("b"));
    }
}
