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
//! The server takes one update of a peer a round: a job started on a peer whose earlier job
//! ended in the round, its update at the server or on its way, sits the round out, and when
//! both trained in it (the new one told to before the old one's end was known), both rounds'
//! slices go back, since which update the model holds cannot be told.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use hypha_messages::diloco::{
    Applied, Evaluation, ServerOrder, ServerStatus, TrainerOrder, TrainerStatus,
};

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
    /// Rounds in a row a trainer's update may be refused, or missing from a round it was
    /// expected in, before it is benched; 0: never.
    pub bench_after_refusals: u32,
    /// How long the first round waits for the leased trainers that are not ready yet, from
    /// when the first one was (see [`Start`]).
    pub start_grace_ms: u64,
    /// Score the global model on the job's held-out data every this many rounds, and the
    /// last planned one; `None`: the job names none.
    pub eval_every: Option<u64>,
}

/// How long the trainer asked to score the run's last model may take to report it before it
/// is told the training is over anyway.
pub const FINAL_EVAL_WAIT_MS: u64 = 60_000;

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
    /// The server refused `peer`'s update of `round`, for `reason` (told once a round).
    Refused {
        round: u64,
        peer: String,
        reason: String,
    },
    /// `peer` scored a global model on the held-out data.
    Evaluated { peer: String, eval: Evaluation },
}

/// A trainer benched as a round ended, and why.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Benching {
    pub peer: String,
    pub reason: String,
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

/// How long after a trainer first offered its initial model the server is told which to
/// adopt, where other trainers have not offered yet (one loading slowly holds the choice up
/// no longer).
const ADOPT_WAIT_MS: u64 = 2_000;

/// How long the trainer whose initial model the server is to adopt has to send it before
/// another is chosen: a model of gigabytes on a slow uplink takes minutes, a trainer that
/// cannot send it must not hold the start for good.
const ADOPT_UPLOAD_MS: u64 = 300_000;

/// How long a trainer that finds no parameter server waits before asking again.
const RETRY_MS: u64 = 500;

/// How long a trainer's job that ended having trained in the round waits for the server to
/// report its update: the server's status composed before the update arrived may reach the
/// scheduler after the job's end. The server reports every 250 ms and after each file it
/// takes, so this is four of its ticks, not a count of statuses (several can come at once).
const DEPARTING_MS: u64 = 1_000;

/// A trainer's job that ended having trained in `round`, at `ended_ms`, before the server
/// said it holds its update.
#[derive(Debug)]
struct Departing {
    job: String,
    round: u64,
    ended_ms: u64,
}

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
    /// The rounds in a row it was expected in that ended without its update, refused or
    /// late: a trainer that claims to train and sends nothing holds every round to its
    /// deadline.
    silent_in_a_row: u32,
    /// The last reason the server gave for refusing its update.
    refused_for: Option<String>,
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
    /// Trainers benched as this round ended: their updates were refused, or missing from the
    /// rounds they were expected in, in `bench_after_refusals` rounds in a row, this one
    /// included. The run ends their jobs and never leases them again for the task.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub benched: Vec<Benching>,
    /// Updates that counted for a share of themselves (clipped), as the server said.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub clipped: Vec<hypha_messages::diloco::ClippedUpdate>,
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
    /// A server with no model: when its status first named an offer of a trainer's, and the
    /// trainer whose model it is to adopt, once chosen (see [`initial_model_source`](Self::initial_model_source)).
    first_offer_ms: Option<u64>,
    adopt_from: Option<(String, u64)>,
    /// Trainers chosen whose model never came within [`ADOPT_UPLOAD_MS`].
    passed_over: BTreeSet<String>,
    /// Peers whose pseudo-gradients of `round` the server holds, with their samples.
    arrived: HashMap<String, u64>,
    /// Peers whose pseudo-gradient of `round` the server refused, with why: they sent what
    /// they had, so the round does not wait for them.
    refused: HashMap<String, String>,
    /// Trainers' jobs that ended after their pseudo-gradient of `round` arrived, by peer: the
    /// round settles their slices when it is applied (or lost).
    departed: HashMap<String, String>,
    /// Trainers' jobs that ended having trained in `round` before the server said it holds
    /// their update, by peer: a trainer that leaves sends its update as it goes, and the
    /// server may report it next. After [`DEPARTING_MS`] without it, their slices go back.
    departing: HashMap<String, Departing>,
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
    /// The held-out scoring ([`RoundPlan::eval_every`]).
    eval: Scoring,
}

/// Who scores the global models on the held-out data, and how far it got. One trainer does,
/// as each model to score reaches it (before it trains on it): the first that said it can,
/// another once it is gone or out of data. A Python trainer of the SDK does not say it can.
#[derive(Debug, Default)]
struct Scoring {
    /// The evaluating trainer's job.
    by: Option<String>,
    /// The latest score it reported, with the peer it came from.
    scored: Option<(String, Evaluation)>,
    /// When the training was over for it: it may still report the last model's score.
    done_ms: Option<u64>,
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
            first_offer_ms: None,
            adopt_from: None,
            passed_over: BTreeSet::new(),
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
            eval: Scoring::default(),
        }
    }

    /// Whether job `job` is one of the job's trainers.
    pub fn is_trainer(&self, job: &str) -> bool {
        self.trainers.contains_key(job)
    }

    /// The latest score of a global model on the held-out data, and the peer that scored it.
    pub fn evaluation(&self) -> Option<&(String, Evaluation)> {
        self.eval.scored.as_ref()
    }

    /// Whether the global model of round `model` is to be scored: every
    /// [`eval_every`](RoundPlan::eval_every) rounds, and the last planned one.
    fn scores(&self, model: u64) -> bool {
        let due = self
            .plan
            .eval_every
            .is_some_and(|every| model.is_multiple_of(every.max(1)) || self.planned_through(model));
        due && self
            .eval
            .scored
            .as_ref()
            .is_none_or(|(_, e)| e.round < model)
    }

    /// Takes trainer `job`'s score and its offer to score: the evaluator is the first
    /// trainer that can, until it is gone.
    fn take_score(&mut self, job: &str, peer: &str, status: &TrainerStatus) {
        if let Some(eval) = status.eval
            && self
                .eval
                .scored
                .as_ref()
                .is_none_or(|(_, e)| e.round < eval.round)
        {
            self.eval.scored = Some((peer.to_string(), eval));
            self.news.push(News::Evaluated {
                peer: peer.to_string(),
                eval,
            });
        }
        // A trainer out of data is in no round, and gets no model after the last one.
        let idle = status.data_done && status.samples == 0;
        if idle && self.eval.by.as_deref() == Some(job) {
            self.eval.by = None;
        }
        let present = |by: &String| self.trainers.contains_key(by);
        if status.evaluates && !idle && !self.eval.by.as_ref().is_some_and(present) {
            self.eval.by = Some(job.to_string());
        }
    }

    /// What trainer `job` (with `status`), told the training is over at `now_ms`, is to do
    /// first, if anything: score the last model. That model is scored whenever the job scores
    /// held-out data, by a trainer that holds it or is to (its update is in the
    /// last round: the server sends it the last model) and can: the evaluator if it is one,
    /// else the first such to ask. It waits, and scores the model once it holds it, until its
    /// score arrives, [`FINAL_EVAL_WAIT_MS`] at most.
    fn last_score_order(
        &mut self,
        job: &str,
        status: &TrainerStatus,
        now_ms: u64,
    ) -> Option<TrainerOrder> {
        let last = self.round;
        // The last model is due whatever its round: a run that ends when its data does
        // ends at a round nobody planned.
        let scored = (self.eval.scored.as_ref()).is_some_and(|(_, e)| e.round >= last);
        if self.plan.eval_every.is_none() || scored {
            return None;
        }
        let since = *self.eval.done_ms.get_or_insert(now_ms);
        if now_ms >= since.saturating_add(FINAL_EVAL_WAIT_MS) {
            return None;
        }
        let in_last = |peer: &str| {
            last.checked_sub(1)
                .and_then(|round| self.included.get(&round))
                .is_some_and(|included| included.contains(peer))
        };
        let can = |job: &str, evaluates: bool| {
            evaluates && self.trainers.get(job).is_some_and(|t| in_last(&t.peer))
        };
        let other = self.eval.by.as_deref().filter(|by| *by != job);
        if other.is_some_and(|by| {
            can(
                by,
                self.trainers.get(by).is_some_and(|t| t.status.evaluates),
            )
        }) {
            return None;
        }
        if !can(job, status.evaluates) {
            return None;
        }
        self.eval.by = Some(job.to_string());
        Some(TrainerOrder::Wait {
            retry_ms: WAIT_MS,
            evaluate: status.round == Some(last),
        })
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
        self.first_offer_ms = None;
        self.adopt_from = None;
        self.passed_over.clear();
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
            silent_in_a_row: 0,
            refused_for: None,
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
            let departing = Departing {
                job: job.to_string(),
                round: self.round,
                ended_ms: now_ms,
            };
            self.departing.insert(trainer.peer, departing);
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
                .any(|departing| departing.job == job)
    }

    /// Jobs that ended without the server having said it holds their update: those whose
    /// update `status` names arrived are departed, the others wait at most [`DEPARTING_MS`],
    /// then their round's slices go back (returned, so that this status, which may also
    /// apply the last round, knows the data is not over).
    fn resolve_departing(&mut self, status: &ServerStatus, now_ms: u64) -> Vec<Settle> {
        let mut heard: HashSet<&str> = HashSet::new();
        if status.round == Some(self.round) {
            heard.extend(status.arrived.iter().map(|a| a.peer.as_str()));
        }
        if let Some(applied) = status.applied.as_ref().filter(|a| a.round == self.round) {
            heard.extend(applied.included.iter().map(String::as_str));
        }
        let mut settle = Vec::new();
        for (peer, departing) in std::mem::take(&mut self.departing) {
            if heard.contains(peer.as_str()) {
                self.departed.insert(peer, departing.job);
            } else if now_ms < departing.ended_ms.saturating_add(DEPARTING_MS) {
                self.departing.insert(peer, departing);
            } else {
                settle.push(Settle::Drop {
                    job: departing.job,
                    round: departing.round,
                });
            }
        }
        settle
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
        let Some(peer) = self.trainers.get(job).map(|t| t.peer.clone()) else {
            // Not (or no longer) one of this job's trainers.
            return (TrainerOrder::Done, settle);
        };
        self.take_score(job, &peer, &status);
        if self.done {
            let order = self.last_score_order(job, &status, now_ms);
            return (order.unwrap_or(TrainerOrder::Done), settle);
        }
        let Some(server) = self.server.clone() else {
            return (TrainerOrder::wait(RETRY_MS), settle);
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
            return (TrainerOrder::wait(RETRY_MS / 5), settle);
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
            return (TrainerOrder::wait(RETRY_MS / 5), settle);
        }
        self.heard_at(job, round, &status, now_ms, &mut settle);
        if round == self.round && self.trainers.get(job).is_some_and(|t| self.sits_out(t)) {
            return (TrainerOrder::wait(WAIT_MS), settle);
        }
        if round == self.round && !self.may_begin(now_ms) {
            return (TrainerOrder::wait(WAIT_MS), settle);
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
        self.ordered(job, round, batches);
        let evaluate =
            round == self.round && self.eval.by.as_deref() == Some(job) && self.scores(round + 1);
        let order = TrainerOrder::Train {
            round,
            batches,
            parameter_server: server,
            evaluate,
        };
        (order, settle)
    }

    /// The trainer of `job` said `status`, holding the model of `round`: the rounds it is
    /// past settle its slices left out of them, and its status is kept.
    fn heard_at(
        &mut self,
        job: &str,
        round: u64,
        status: &TrainerStatus,
        now_ms: u64,
        settle: &mut Vec<Settle>,
    ) {
        let Some(trainer) = self.trainers.get_mut(job) else {
            return;
        };
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

    /// The trainer of `job` is told to train `batches` of `round`; its first order is news.
    fn ordered(&mut self, job: &str, round: u64, batches: u64) {
        let Some(trainer) = self.trainers.get_mut(job) else {
            return;
        };
        trainer.ordered = Some((round, batches));
        if !std::mem::replace(&mut trainer.joined, true) {
            self.news.push(News::Joined {
                job: job.to_string(),
                peer: trainer.peer.clone(),
                round,
            });
        }
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
        // the first would hand the first trainer to ask the whole round. Not one sitting the
        // round out.
        let in_round: Vec<&Trainer> = self
            .trainers
            .values()
            .filter(|t| {
                t.status
                    .round
                    .is_some_and(|r| r.saturating_add(1) >= self.round)
                    && !self.sits_out(t)
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
                Some(round) if round.saturating_add(1) == self.round => {
                    self.believed_ahead(t).saturating_mul(plan.batch_size)
                }
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

    /// The batches `trainer` says it trained ahead into this round, believed up to the target
    /// it was last given (a round's worth before it was given any): a trainer trains ahead
    /// while its update travels, never more than a round, and a claim of 10¹² would leave the
    /// others nothing to train (issue 55).
    fn believed_ahead(&self, trainer: &Trainer) -> u64 {
        let plan = &self.plan;
        let round_batches = plan.samples_per_round.div_ceil(plan.batch_size.max(1));
        let told = trainer.ordered.map_or(round_batches, |(_, target)| target);
        trainer.status.ahead_batches.min(told).min(round_batches)
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
        let mut settle = self.resolve_departing(&status, now_ms);
        for late in &status.dropped {
            self.heard_late(&late.peer);
        }
        let applies = self.applies(&status);
        let applied_round = (status.applied)
            .filter(|_| applies)
            .map(|applied| self.round_applied(applied, &mut settle));
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
            && let Some(from) = self.initial_model_source(&status.offered, now_ms)
        {
            return (ServerOrder::Adopt { from }, settle, applied_round);
        }
        if status.round == Some(self.round) {
            self.arrived = status
                .arrived
                .iter()
                .map(|a| (a.peer.clone(), a.samples))
                .collect();
            // The server bounds its reasons; a server that does not is not believed.
            let refused: HashMap<String, String> = status
                .refused
                .into_iter()
                .map(|refusal| {
                    let reason: String = refusal.reason.chars().take(REASON_CHARS).collect();
                    (refusal.peer, reason)
                })
                .collect();
            for (peer, reason) in &refused {
                if !self.refused.contains_key(peer) {
                    tracing::warn!(
                        round = self.round,
                        %peer,
                        reason = %reason.escape_debug(),
                        "the parameter server refused a trainer's update: the round goes on without it"
                    );
                    self.news.push(News::Refused {
                        round: self.round,
                        peer: peer.clone(),
                        reason: reason.clone(),
                    });
                }
            }
            self.refused = refused;
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

    /// The server applied `applied`: the slices of the trainers it included are committed to
    /// the round (and those of departed jobs it left out dropped, into `settle`), the next
    /// round opens, and the run is done after its planned rounds or when every trainer is
    /// out of data for good.
    fn round_applied(&mut self, applied: Applied, settle: &mut Vec<Settle>) -> AppliedRound {
        let included: HashSet<String> = applied.included.iter().cloned().collect();
        let samples = included.iter().filter_map(|p| self.arrived.get(p)).sum();
        let mut weighted_loss = (0.0, 0u64);
        // The server takes one update of a peer a round. A peer's update in the round is its
        // departed job's, unless a job started on the peer since trained in the round too
        // (told to before the earlier one was known to have ended): which of the two the
        // model holds cannot be told then, and both give their slices of the round back,
        // since slices trained twice cost less than slices counted used that the model does
        // not hold. A job started since is never credited: its slices of the round go back.
        let departed = std::mem::take(&mut self.departed);
        for (peer, job) in &departed {
            let (job, round) = (job.clone(), applied.round);
            let successor_trained = self
                .trainers
                .values()
                .any(|t| t.peer == *peer && t.status.round == Some(round) && t.status.samples > 0);
            settle.push(match included.contains(peer) && !successor_trained {
                true => Settle::Commit { job, round },
                false => Settle::Drop { job, round },
            });
        }
        for (job, trainer) in &mut self.trainers {
            if departed.contains_key(&trainer.peer) {
                let told_to_train = trainer.ordered.is_some_and(|(r, _)| r == applied.round);
                if told_to_train && trainer.settled_below <= applied.round {
                    settle.push(Settle::Drop {
                        job: job.clone(),
                        round: applied.round,
                    });
                    trainer.settled_below = applied.round + 1;
                }
            } else if included.contains(&trainer.peer) {
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
        let benched = self.count_misses(&included);
        self.included.insert(applied.round, included);
        self.closing = None;
        self.round = applied.round + 1;
        self.highest = self.highest.max(self.round);
        self.started_ms = None;
        self.arrived.clear();
        self.refused.clear();
        self.done = self.plan.rounds.is_some_and(|n| self.round >= n) || everyone_out_of_data;
        AppliedRound {
            round: applied.round,
            included: applied.included,
            samples,
            loss: (weighted_loss.1 > 0).then(|| weighted_loss.0 / weighted_loss.1 as f64),
            model_hash: applied.model_hash,
            delta_bytes: applied.delta_bytes,
            benched,
            // The server bounds its reasons; a server that does not is not believed.
            clipped: (applied.clipped.into_iter())
                .map(|mut clipped| {
                    clipped.reason = clipped.reason.chars().take(REASON_CHARS).collect();
                    clipped
                })
                .collect(),
            largest_norm_ratio: applied.largest_norm_ratio,
            close_ms: applied.close_ms,
            traffic_bytes: applied.traffic_bytes,
            standby_bytes: applied.standby_bytes,
        }
    }

    /// Counts, as a round ends with `included` taken, the rounds in a row each trainer's
    /// update was refused, and those it was expected in (it holds a model, as
    /// [`ending`](Self::ending) counts it) and sent nothing (a taken update starts both
    /// counts again); the trainers that reach `bench_after_refusals` now, with why. An honest
    /// outlier refused once in a while is never benched; a trainer that lies in every update
    /// is, before its slices are taken and given back round after round to the end of the
    /// data, and so is one that claims to train and never sends (every round would wait for
    /// it to its deadline).
    fn count_misses(&mut self, included: &HashSet<String>) -> Vec<Benching> {
        let limit = self.plan.bench_after_refusals;
        let mut benched = Vec::new();
        for trainer in self.trainers.values_mut() {
            if let Some(reason) = self.refused.get(&trainer.peer) {
                trainer.refused_in_a_row += 1;
                trainer.silent_in_a_row = 0;
                trainer.refused_for = Some(reason.clone());
            } else if included.contains(&trainer.peer) {
                trainer.refused_in_a_row = 0;
                trainer.silent_in_a_row = 0;
            } else if expected(trainer) {
                trainer.silent_in_a_row += 1;
            }
            let reason = if trainer.refused_in_a_row == limit {
                format!(
                    "its updates were refused {limit} rounds in a row, the last because {}",
                    trainer.refused_for.as_deref().unwrap_or("of what it sent")
                )
            } else if trainer.silent_in_a_row == limit {
                format!(
                    "it was expected in {limit} rounds in a row and sent no update for any of them"
                )
            } else {
                continue;
            };
            if limit > 0 {
                benched.push(Benching {
                    peer: trainer.peer.clone(),
                    reason,
                });
            }
        }
        benched.sort_by(|a, b| a.peer.cmp(&b.peer));
        benched
    }

    /// The server dropped `peer`'s update of a round already closed: it trains and sends,
    /// late; it is not silent.
    fn heard_late(&mut self, peer: &str) {
        for trainer in self.trainers.values_mut().filter(|t| t.peer == peer) {
            trainer.silent_in_a_row = 0;
        }
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

    /// Whose initial model the server is to adopt, of those `offered` at `now_ms`: the trainer
    /// of the lowest job id among them, so that one trainer, chosen here, sets the start,
    /// never a peer that merely sent first. Chosen once every trainer offered, or
    /// [`ADOPT_WAIT_MS`] after the first did, and kept while that trainer's offer stands: the
    /// server asks the chosen trainer for its model (trainers offer by fingerprint), and a
    /// choice that changed with each offer would have several send it. One whose model has not
    /// come within [`ADOPT_UPLOAD_MS`] is passed over for the next.
    fn initial_model_source(&mut self, offered: &[String], now_ms: u64) -> Option<String> {
        let offering = |peer: &String| offered.contains(peer);
        if let Some((chosen, since)) = &self.adopt_from
            && offering(chosen)
            && self.trainers.values().any(|t| t.peer == *chosen)
        {
            if now_ms < since.saturating_add(ADOPT_UPLOAD_MS) {
                return Some(chosen.clone());
            }
            self.passed_over.insert(chosen.clone());
        }
        let candidates = (self.trainers.iter())
            .filter(|(_, t)| offering(&t.peer) && !self.passed_over.contains(&t.peer));
        let Some((_, lowest)) = candidates.min_by_key(|(job, _)| job.as_str()) else {
            // Every one offering was passed over: each gets another turn.
            self.passed_over.clear();
            return None;
        };
        let lowest = lowest.peer.clone();
        let since = *self.first_offer_ms.get_or_insert(now_ms);
        let everyone = self.trainers.values().all(|t| offering(&t.peer));
        if !everyone && now_ms < since.saturating_add(ADOPT_WAIT_MS) {
            return None;
        }
        self.adopt_from = Some((lowest.clone(), now_ms));
        Some(lowest)
    }

    /// Whether `trainer` sits the open round out: a job of its peer ended in the round with
    /// its update at the server, or maybe on its way, and this one was not told to train the
    /// round. The server takes one update of a peer a round, so the peer's update is the
    /// earlier job's; this one trains from the next round on.
    fn sits_out(&self, trainer: &Trainer) -> bool {
        (self.departed.contains_key(&trainer.peer) || self.departing.contains_key(&trainer.peer))
            && trainer.ordered.is_none_or(|(round, _)| round != self.round)
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
        let expected: Vec<&Trainer> = (self.trainers.values())
            .filter(|t| expected(t) && !self.sits_out(t))
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

/// Whether a round waits for `trainer`'s update: every trainer that holds a model trains the
/// round, even one that has not taken the round's model yet; one out of data with nothing
/// trained sends nothing.
fn expected(trainer: &Trainer) -> bool {
    (trainer.status.round.is_some() || trainer.awaited)
        && !(trainer.status.data_done && trainer.status.samples == 0)
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
mod tests;
