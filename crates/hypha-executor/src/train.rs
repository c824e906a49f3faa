//! A DiLoCo trainer: the loop of a training job, driven by its scheduler's orders
//! ([`hypha_messages::diloco`]).
//!
//! 1. Ask the scheduler (`/status/send`). `join`: offer the model it holds to the parameter
//!    server by its fingerprint ([`meta::KIND_MODEL_HELD`]; its initial model, or the global
//!    model of an earlier server), then take what it answers: a server holding the same
//!    starts it from its own copy, one a round ahead sends the change, one with no model asks
//!    the trainer the scheduler named for it whole. A trainer told to join while it holds a
//!    round (its parameter server was replaced) abandons the round first. A
//!    trainer told to train its round with another server (one that took over holding the
//!    model it trains from) goes on with the round and sends its update there.
//! 2. `train`: run AdamW steps on batches of the job's slices (`/resources/fetch` with the
//!    job's `data` reference) until the round's batch target; report every
//!    [`REPORT_EVERY`] (batch time, loss) and take the new target.
//!    When no slice is free for [`DATA_WAIT`], the round ends early for this trainer.
//! 3. At the target, finish the slice being read (so that each slice's samples go into one
//!    round), tell the ledger which slices the round consumed (`/data/consumed`), send the
//!    pseudo-gradient θ_global − θ_local with its round and sample count to the parameter
//!    server, and wait for the next global model, asking the scheduler every [`MODEL_WAIT`]
//!    whether to wait on. AdamW's moments carry over from round to round, as in DiLoCo.
//! 4. `done`: exit.
//!
//! **Overlap** (`[diloco] overlap = true`). At the target, the pseudo-gradient goes to the
//! server in a thread of its own and the trainer goes on training, into the next round, while
//! it travels and the round closes (at most as many batches as the round it synced, and only
//! while slices come). When the new global model θ̂ᵣ₊₁ arrives, what it learned since the sync
//! is moved onto it: θ ← θ + (θ̂ᵣ₊₁ − θ_sync), θ_sync its own model at the sync, and those
//! batches are the first of round r + 1 (their slices go to the ledger as consumed by it). The
//! outer update thus lands one round late for those batches, as in Streaming DiLoCo's
//! overlapping variant, and communication hides behind compute. Reports carry the batches
//! trained ahead and how long sends take (`send_ms`), which the scheduler's plan counts.
//!
//! **Global models as changes.** The trainer's pseudo-gradients say it takes the model's
//! changes ([`meta::ACCEPTS`]); a parameter server that compresses then sends it each round's
//! change of the global model instead of the whole model. The trainer applies the change to
//! the global model it holds (the change names that model's round and fingerprint) with the
//! server's own arithmetic ([`hypha_diloco::Update::add_to`]) and checks the result against
//! the fingerprint the change carries; a change that does not fit, or a result that does not
//! match, makes it ask for the whole model ([`meta::KIND_MODEL_REQUEST`]). Its reports carry
//! the fingerprint of the model it holds, so the scheduler's metrics show that every trainer
//! and the server hold the same one.
//!
//! Slices read to their end reach the ledger with every report, not only at the round's end:
//! whatever the scheduler answers, it knows what the round holds. A peer that cannot be
//! reached is asked again every [`RETRY`].

use std::{
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use hypha_diloco::{Codec, Metadata};
use hypha_messages::{
    diloco::{Evaluation, Status, TrainerConfig, TrainerOrder, TrainerStatus, meta},
    iterate::SliceRef,
};
use serde::Deserialize;

use hypha_bridge::{
    ConsumedRequest, FetchRequest, Peers, Reference, SendRequest, Strategy, Target,
    client::{Client, ClientError},
};

use crate::{
    contract::{DataError, TensorNames},
    learner::{Learner, Trained},
    model::{Batch, ModelError, ModelSpec},
};

/// How often a trainer reports while it trains.
pub const REPORT_EVERY: Duration = Duration::from_millis(200);
/// How long a trainer waits for a slice while none is free before it syncs what it has: the
/// slices it lacks may be held by trainers that are waiting for this round to close.
pub const DATA_WAIT: Duration = Duration::from_secs(1);
/// How long a trainer waits for a global model before it asks its scheduler again (the
/// parameter server may have been replaced).
pub const MODEL_WAIT: Duration = Duration::from_secs(1);
/// How long a send keeps trying a parameter server that cannot be reached before the trainer
/// asks its scheduler whether it is still the one (tries at 0, 0.1, 0.3 and 0.7 s). A
/// trainer blind for longer joins a replacement server that much later: with 2 s, the
/// `recovery` suite's median was ~1 s slower.
pub const SEND_PATIENCE: Duration = Duration::from_secs(1);
/// How long after sending its model whole a trainer answers no further request for it (those
/// that queued while the upload ran), and how often one waiting for the whole global model asks
/// for it again. An offer by fingerprint, a few bytes, goes again every [`MODEL_WAIT`].
pub const OFFER_AGAIN: Duration = Duration::from_secs(5);
/// How long a trainer waits before it asks again after a peer could not be reached.
pub const RETRY: Duration = Duration::from_millis(500);

/// The job's config, as the scheduler writes it (other keys are ignored).
#[derive(Debug, Clone, Deserialize)]
pub struct JobConfig {
    pub model: ModelSpec,
    /// Seeds the model's parameters.
    #[serde(default)]
    pub seed: u64,
    /// Which tensors of a slice the model reads (`input`, `target`; see [`crate::contract`]).
    #[serde(flatten)]
    pub tensors: TensorNames,
    /// Where slices come from: handed to `/resources/fetch` as it is.
    pub data: Reference,
    /// The held-out slices global models are scored on when an order says `evaluate`
    /// (`{"type": "HeldOut", "dataset": …}`, from the job's `[data] eval`).
    #[serde(default)]
    pub eval: Option<Reference>,
    pub diloco: TrainerConfig,
}

impl JobConfig {
    /// The codec the job chose.
    pub fn codec(&self) -> Result<Codec, String> {
        Codec::try_from(self.diloco.compression)
    }
}

/// Why training stopped.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error(transparent)]
    Bridge(#[from] ClientError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Tensors(#[from] hypha_diloco::Error),
    /// What the scheduler or the parameter server answered that a trainer cannot follow,
    /// described: a peer's mistake, which no caller handles other than by failing the job.
    #[error("{0}")]
    Protocol(String),
    #[error("slice {slice} of epoch {epoch}: {error}")]
    Data {
        epoch: u32,
        slice: u64,
        error: DataError,
    },
    #[error("cannot use {path}: {error}")]
    File {
        path: PathBuf,
        error: std::io::Error,
    },
}

impl TrainError {
    /// A peer could not be reached or was busy (the bridge answers 502, 503 or 504): asking
    /// again later may work.
    fn is_transient(&self) -> bool {
        // A scheduler that answered something unreadable would answer it again.
        matches!(self, Self::Bridge(error)
            if matches!(error.status(), Some(502..=504)) && error.code() != Some("scheduler_answer"))
    }
}

impl From<candle_core::Error> for TrainError {
    fn from(error: candle_core::Error) -> Self {
        Self::Model(error.into())
    }
}

/// One training job, its model held by a [`Learner`].
#[derive(Debug)]
pub struct Trainer<L = Trained> {
    bridge: Client,
    dir: PathBuf,
    config: JobConfig,
    learner: L,
    /// Global models built from the server's changes so far.
    deltas_applied: u64,
    round: Option<u64>,
    /// The round of the last global model taken from the current server.
    last_model: Option<u64>,
    data: Reader,
    stats: RoundStats,
    /// With overlap: the batches trained into the next round while this round's update
    /// travels.
    ahead: Option<Ahead>,
    /// With overlap: the pseudo-gradient being sent in the background.
    sending: Option<Sending>,
    /// How long pseudo-gradients took to reach the server lately (a moving average, ms).
    send_ms: Option<f64>,
    /// Time spent in inner steps since the trainer started.
    train_time: Duration,
    /// When it last asked the server for the whole model, while it waits for it.
    asked_whole: Option<Instant>,
    /// The parameter server it was last told to train with or to join.
    server: Option<String>,
    /// Joining a parameter server with the model it holds (the global model of an earlier
    /// one, or its initial model, round 0): offered by its fingerprint
    /// ([`meta::KIND_MODEL_HELD`]) until the server answers.
    rejoining: Option<Rejoining>,
    /// When it last offered its model, and how long it waits before it offers again (zero:
    /// no offer yet in this join).
    offered: (Instant, Duration),
    /// When its last upload of the model whole ended ([`OFFER_AGAIN`]).
    whole_offered: Option<Instant>,
    /// Told to stop: it finishes its part of the round and sends it, then ends.
    leaving: bool,
    /// Set by SIGTERM (see [`Trainer::run`]).
    stop: Arc<AtomicBool>,
    /// An order of this round said to score the next global model on the held-out data.
    evaluate_next: bool,
    /// The held-out data, fetched at the first evaluation.
    held_out: Option<Vec<Batch>>,
    /// The last score, until a report told it.
    eval: Option<Evaluation>,
    /// The round of the last global model it scored (or tried to).
    scored: Option<u64>,
}

/// How long a trainer told to stop goes on training its part of the round before it sends
/// what it has: within the worker's default `kill_grace_ms` of 5 s, with time to send.
const FINISH_WITHIN: Duration = Duration::from_secs(3);

/// Training into round r + 1 before its global model arrived (one round of delay, as in
/// Streaming DiLoCo's overlapping variant): when θ̂ᵣ₊₁ arrives, the trainer keeps what it
/// learned since the sync and moves it onto the new global model,
/// θ ← θ + (θ̂ᵣ₊₁ − θ_sync), where θ_sync is its model when it sent round r's update.
#[derive(Debug)]
struct Ahead {
    /// The round it synced: the batches are of the next.
    round: u64,
    /// The batches, samples and slices of round r + 1 so far.
    stats: RoundStats,
    /// It trains ahead at most this many batches (the round it synced had as many), then
    /// waits: a round that takes long to close does not become a round of its own.
    limit: u64,
    /// No slice was free for it: it waits for the model instead.
    starved: bool,
}

/// A join with the model it holds (its initial model, or a global model of an earlier
/// server), offered by its fingerprint.
#[derive(Debug)]
struct Rejoining {
    /// The round of the model it holds (0: its initial model).
    round: u64,
    /// Its name for the offer, which the server's answer echoes.
    offer: String,
}

/// A pseudo-gradient on its way to the parameter server, in a thread of its own.
#[derive(Debug)]
struct Sending {
    task: std::thread::JoinHandle<Result<(), TrainError>>,
    started: Instant,
    /// The file in the outbox.
    name: String,
    round: u64,
}

#[derive(Debug, Default)]
struct RoundStats {
    batches: u64,
    samples: u64,
    /// The losses of the batches that measured one.
    loss_sum: f64,
    losses: u64,
    batch_ms: Option<f64>,
    /// Slices read to their end and not yet reported to the ledger.
    consumed: Vec<SliceRef>,
    /// The round is being synced: it takes no more batches, whatever the scheduler says.
    syncing: bool,
    /// The round's pseudo-gradient reached the parameter server.
    sent: bool,
    /// The round's pseudo-gradient, compressed once into this file of the outbox: a retried
    /// send sends it again, and error feedback moves on once a round.
    pseudo_gradient: Option<String>,
}

impl Trainer {
    /// A trainer of the job's reference model ([`Trained`]) for the job whose bridge is at
    /// `socket` and directory is `dir`.
    pub fn new(socket: &Path, dir: &Path, config: JobConfig) -> Result<Self, TrainError> {
        let codec = config.codec().map_err(TrainError::Protocol)?;
        let learner = Trained::new(&config.model, config.seed, config.diloco.inner, codec)?;
        Ok(Self::with_learner(socket, dir, config, learner))
    }
}

impl<L: Learner> Trainer<L> {
    /// A trainer whose model is held by `learner`, for the job whose bridge is at `socket`
    /// and directory is `dir`.
    pub fn with_learner(socket: &Path, dir: &Path, config: JobConfig, learner: L) -> Self {
        let bridge = Client::new(socket);
        Self {
            data: Reader::new(bridge.clone(), dir, &config),
            bridge,
            dir: dir.to_path_buf(),
            config,
            learner,
            deltas_applied: 0,
            round: None,
            last_model: None,
            stats: RoundStats::default(),
            ahead: None,
            sending: None,
            send_ms: None,
            train_time: Duration::ZERO,
            asked_whole: None,
            server: None,
            rejoining: None,
            offered: (Instant::now(), Duration::ZERO),
            whole_offered: None,
            leaving: false,
            stop: Arc::new(AtomicBool::new(false)),
            evaluate_next: false,
            held_out: None,
            eval: None,
            scored: None,
        }
    }

    /// Trains until the scheduler says training is over.
    ///
    /// A peer that cannot be reached (the scheduler restarting, a parameter server that is
    /// gone) is asked again every [`RETRY`], and the scheduler is asked what to do meanwhile:
    /// a parameter server that was replaced is joined, the round being trained abandoned.
    /// A scheduler that stays away stops renewing the worker's lease, which ends the job.
    ///
    /// Told to stop (SIGTERM: its worker leaving, or the job cancelled), it finishes its part
    /// of the round it holds, sends it and ends, or, after [`FINISH_WITHIN`], sends what it
    /// trained so far ([`leave`](Self::leave)).
    pub fn run(mut self) -> Result<(), TrainError> {
        let stop = self.stop.clone();
        if let Err(error) = signal_hook::flag::register(signal_hook::consts::SIGTERM, stop.clone())
        {
            eprintln!("cannot catch SIGTERM ({error}): told to stop, this trainer ends at once");
        }
        let mut told: Option<Instant> = None;
        let mut order: Option<TrainerOrder> = None;
        let mut reported = Instant::now();
        let mut unreachable = false;
        loop {
            if told.is_none() && stop.load(Ordering::Relaxed) {
                told = Some(Instant::now());
                self.leaving = true;
                match self.round {
                    Some(round) => eprintln!(
                        "told to stop in round {round}: finishing its part of the round first"
                    ),
                    None => eprintln!("told to stop holding no round"),
                }
            }
            if let Some(since) = told {
                let finished = self.round.is_none() || self.stats.sent || self.sending.is_some();
                if finished || since.elapsed() >= FINISH_WITHIN {
                    return self.leave();
                }
            }
            let began = Instant::now();
            match self.step(order.take(), &mut reported) {
                Ok(Some(TrainerOrder::Done)) if self.leaving => return self.leave(),
                Ok(Some(TrainerOrder::Done)) => return Ok(()),
                Ok(next) => {
                    order = next;
                    unreachable = false;
                }
                Err(error) if error.is_transient() => {
                    if !unreachable {
                        eprintln!("{error}; asking again (at most every {RETRY:?})");
                    }
                    unreachable = true;
                    // A try that spent its own patience (a send to a server that is gone)
                    // asks the scheduler at once: it may have named a new server meanwhile.
                    std::thread::sleep(RETRY.saturating_sub(began.elapsed()));
                }
                Err(error) => return Err(error),
            }
        }
    }

    /// Carries out `order`, asking the scheduler for a new one first when there is none, the
    /// round's batch target is reached or [`REPORT_EVERY`] has passed; returns the order to
    /// carry out next (`None`: ask).
    fn step(
        &mut self,
        order: Option<TrainerOrder>,
        reported: &mut Instant,
    ) -> Result<Option<TrainerOrder>, TrainError> {
        let target_reached = matches!(
            order,
            Some(TrainerOrder::Train { batches, .. }) if self.stats.batches >= batches
        );
        let order = match order {
            Some(order) if !target_reached && reported.elapsed() < REPORT_EVERY => order,
            _ => {
                let order = self.report()?;
                *reported = Instant::now();
                order
            }
        };
        match &order {
            TrainerOrder::Done => Ok(Some(order)),
            TrainerOrder::Wait { retry_ms, evaluate } => {
                if *evaluate && self.score_held_model() {
                    return Ok(None);
                }
                std::thread::sleep(Duration::from_millis((*retry_ms).clamp(10, 5000)));
                Ok(None)
            }
            TrainerOrder::Join { parameter_server } => self.join(parameter_server),
            TrainerOrder::Train {
                round,
                batches,
                parameter_server,
                evaluate,
            } => {
                if self.round != Some(*round) {
                    return Ok(None);
                }
                self.evaluate_next |= *evaluate;
                if self.server.as_ref() != Some(parameter_server) {
                    eprintln!(
                        "round {round}: going on with the parameter server {parameter_server}, which holds the model this round trains from"
                    );
                    self.server = Some(parameter_server.clone());
                }
                // Finish the slice being read before syncing: its samples go into one round.
                // Once the round is being synced, it takes no more: a retried sync sends the
                // same pseudo-gradient.
                let wants_more = self.stats.batches < *batches || self.data.in_slice();
                if wants_more && !self.stats.syncing {
                    if self.train_batch(false)? {
                        return Ok(Some(order));
                    }
                    if self.stats.samples == 0 {
                        // Nothing trained and nothing free: wait for slices to come back
                        // or to be told the end.
                        std::thread::sleep(REPORT_EVERY);
                        return Ok(None);
                    }
                }
                let parameter_server = parameter_server.clone();
                self.sync(&parameter_server)
            }
        }
    }

    /// Told to stop, and its part of the round sent or [`FINISH_WITHIN`] over: what it
    /// trained in the round and did not send yet goes to the server, so that the round does
    /// not lose it and its slices count (the scheduler waits for the server to report it),
    /// and training ends. The slice being read is read to its end first, since its samples
    /// go into one round; an update already on its way is waited for. The worker kills the
    /// executor after `kill_grace_ms` (default 5 s): an update that takes longer to go is
    /// lost, and its slices go back.
    fn leave(&mut self) -> Result<(), TrainError> {
        let (Some(round), Some(server)) = (self.round, self.server.clone()) else {
            eprintln!("told to stop: training ends");
            return Ok(());
        };
        if let Some(sending) = self.sending.take() {
            let sent = sending.task.join();
            if matches!(sent, Ok(Ok(()))) {
                self.sent(sending.round, sending.started.elapsed());
            }
        } else if !self.stats.sent {
            while !self.stats.syncing && self.data.in_slice() && self.train_batch(false)? {}
            if self.stats.samples > 0 {
                self.report_consumed()?;
                let name = match self.stats.pseudo_gradient.take() {
                    Some(name) => name,
                    None => self.pseudo_gradient(round)?,
                };
                let started = Instant::now();
                send_file(&self.bridge, &self.dir, &server, &name)?;
                self.sent(round, started.elapsed());
            }
        }
        eprintln!("told to stop: training ends");
        Ok(())
    }

    /// Tells the scheduler where the trainer stands and takes its order. The slices read to
    /// their end go to the ledger first, with their round: whatever the order, the scheduler
    /// knows every slice the round holds.
    fn report(&mut self) -> Result<TrainerOrder, TrainError> {
        self.report_consumed()?;
        let stats = &self.stats;
        let ahead = self.ahead.as_ref().map(|ahead| &ahead.stats);
        let status = Status::Trainer(TrainerStatus {
            round: self.round,
            batches: stats.batches,
            samples: stats.samples,
            batch_ms: ahead.and_then(|a| a.batch_ms).or(stats.batch_ms),
            send_ms: self.send_ms,
            train_ms: self.train_time.as_millis() as u64,
            ahead_batches: ahead.map_or(0, |a| a.batches),
            loss: (stats.losses > 0).then(|| stats.loss_sum / stats.losses as f64),
            // Samples trained ahead still go to the server with the next round.
            data_done: self.data.out_of_data() && ahead.is_none_or(|a| a.samples == 0),
            model_hash: self.round.map(|_| self.learner.global_hash().to_string()),
            deltas_applied: self.deltas_applied,
            eval: self.eval,
            evaluates: self.config.eval.is_some() && self.learner.evaluates(),
            syncing: Some(stats.syncing || self.sending.is_some() || ahead.is_some()),
        });
        let order = self.bridge.status(&status)?;
        // Heard: told once, not in every report after.
        self.eval = None;
        Ok(order)
    }

    /// One AdamW step on the next batch, counted for this round or, `ahead`, for the next;
    /// false when the data is done.
    fn train_batch(&mut self, ahead: bool) -> Result<bool, TrainError> {
        let started = Instant::now();
        // A batch beyond the address space is a batch of everything the slices hold.
        let batch_size = usize::try_from(self.config.diloco.batch_size).unwrap_or(usize::MAX);
        let next = self.data.next_batch(batch_size)?;
        let stats = match self.ahead.as_mut() {
            Some(next_round) if ahead => &mut next_round.stats,
            _ => &mut self.stats,
        };
        stats.consumed.append(&mut self.data.finished);
        let Some((batch, rows)) = next else {
            return Ok(false);
        };
        let loss = self.learner.train(&batch)?;
        let took = started.elapsed();
        self.train_time += took;
        let elapsed = took.as_secs_f64() * 1000.0;
        stats.batches += 1;
        stats.samples += rows as u64;
        if let Some(loss) = loss {
            stats.loss_sum += loss;
            stats.losses += 1;
        }
        // A moving average: recent batches count most, one slow batch does not swing it.
        stats.batch_ms = Some(
            stats
                .batch_ms
                .map_or(elapsed, |ms| 0.7 * ms + 0.3 * elapsed),
        );
        Ok(true)
    }

    /// Joins `parameter_server`: offers it the model this trainer holds (a new server with
    /// no model adopts the first one offered) and takes the global model it answers with.
    /// A trainer that held a round of an earlier server abandons it, and what it trained
    /// ahead: what it read into them went to the ledger with its reports, and the scheduler
    /// gives it back; the slice being read is read again from its start in the next round.
    /// It offers the global model it holds by its fingerprint: a server that holds the same
    /// one says so, and the round starts over from this trainer's copy, with nothing sent.
    fn join(&mut self, parameter_server: &str) -> Result<Option<TrainerOrder>, TrainError> {
        if self.round.is_some() {
            self.report_consumed()?;
        }
        self.server = Some(parameter_server.to_string());
        self.offered.1 = Duration::ZERO;
        self.whole_offered = None;
        // Named by its fingerprint: the global model of an earlier server, or the initial
        // model drawn from the job's seed (round 0), which every trainer of the job draws
        // alike and the server asks of one of them only.
        self.rejoining = Some(Rejoining {
            round: self.last_model.unwrap_or(0),
            offer: format!("{:016x}", rand::random::<u64>()),
        });
        if let Some(round) = self.round.take() {
            eprintln!(
                "round {round}: abandoned; joining the parameter server {parameter_server} with the global model of round {:?}",
                self.rejoining.as_ref().map(|r| r.round)
            );
            self.ahead = None;
            self.asked_whole = None;
            self.sending = None;
            self.data.rewind();
            self.stats = RoundStats {
                batch_ms: self.stats.batch_ms,
                ..RoundStats::default()
            };
            // The new server may go on from an earlier round than the lost one reached; what
            // compression dropped was measured against the lost server's model.
            self.last_model = None;
            self.learner.forget_dropped();
            // The scheduler learns that this trainer holds no model of the lost server now:
            // until then, it keeps telling it to join.
            if self.report()? == TrainerOrder::Done {
                return Ok(Some(TrainerOrder::Done));
            }
        }
        self.offer(parameter_server)?;
        self.receive(parameter_server)
    }

    /// Offers the model this trainer holds to `parameter_server` by its fingerprint
    /// ([`rejoining`](Self::rejoining)): the server answers that it holds the same, with its
    /// global model (whole, or the change of this one), or asks for this one whole.
    fn offer(&mut self, parameter_server: &str) -> Result<(), TrainError> {
        let last_model = self.last_model;
        let rejoining = self.rejoining.get_or_insert_with(|| Rejoining {
            round: last_model.unwrap_or(0),
            offer: format!("{:016x}", rand::random::<u64>()),
        });
        let (round, offer) = (rejoining.round, rejoining.offer.clone());
        let metadata = Metadata::from([
            (meta::KIND.to_string(), meta::KIND_MODEL_HELD.to_string()),
            (meta::ROUND.to_string(), round.to_string()),
            (
                meta::MODEL_HASH.to_string(),
                self.learner.global_hash().to_string(),
            ),
            (meta::OFFER.to_string(), offer),
        ]);
        let name = "held-model.safetensors";
        hypha_diloco::Tensors::default().save(&outbox(&self.dir, name)?, &metadata)?;
        send_file(&self.bridge, &self.dir, parameter_server, name)?;
        self.offered = (Instant::now(), MODEL_WAIT);
        Ok(())
    }

    /// Sends the model this trainer holds to `parameter_server` whole, as the initial model
    /// of a server that holds none and asked for it; with the fingerprint and name of the
    /// offer it answers (the server then says it holds that model: nothing comes back).
    /// Returns once the server has it.
    fn offer_whole(&mut self, parameter_server: &str, offer: &str) -> Result<(), TrainError> {
        let metadata = Metadata::from([
            (meta::KIND.to_string(), meta::KIND_MODEL.to_string()),
            (meta::ROUND.to_string(), "0".to_string()),
            (
                meta::MODEL_HASH.to_string(),
                self.learner.global_hash().to_string(),
            ),
            (meta::OFFER.to_string(), offer.to_string()),
        ]);
        let name = "initial-model.safetensors";
        self.learner
            .write_global(&outbox(&self.dir, name)?, &metadata)?;
        send_file(&self.bridge, &self.dir, parameter_server, name)?;
        self.whole_offered = Some(Instant::now());
        Ok(())
    }

    /// Reports the slices read to their end since the last report as consumed: by the round,
    /// or by the next one when they were read ahead.
    fn report_consumed(&mut self) -> Result<(), TrainError> {
        let round = self.round.unwrap_or(0);
        if !self.stats.consumed.is_empty() {
            self.report_slices(&self.stats.consumed, round)?;
            self.stats.consumed.clear();
        }
        if let Some(ahead) = &self.ahead
            && !ahead.stats.consumed.is_empty()
        {
            self.report_slices(&ahead.stats.consumed, round + 1)?;
            if let Some(ahead) = self.ahead.as_mut() {
                ahead.stats.consumed.clear();
            }
        }
        Ok(())
    }

    fn report_slices(&self, slices: &[SliceRef], round: u64) -> Result<(), TrainError> {
        self.bridge.consumed(&ConsumedRequest {
            slices: slices.to_vec(),
            round,
            completed_round: None,
            data: self.config.data.clone(),
        })?;
        Ok(())
    }

    /// Ends the round: consumed slices to the ledger, the pseudo-gradient to the parameter
    /// server, then the next global model. With overlap, the pseudo-gradient goes in the
    /// background and the trainer trains ahead until the model arrives.
    fn sync(&mut self, parameter_server: &str) -> Result<Option<TrainerOrder>, TrainError> {
        let round = self.round.unwrap_or(0);
        self.stats.syncing = true;
        self.report_consumed()?;
        let overlap = self.config.diloco.overlap;
        if self.stats.samples > 0 && !self.stats.sent && self.sending.is_none() {
            let name = match self.stats.pseudo_gradient.take() {
                Some(name) => name,
                None => self.pseudo_gradient(round)?,
            };
            if overlap && !self.leaving {
                self.send_in_background(parameter_server, round, name);
            } else {
                let started = Instant::now();
                let sent = send_file(&self.bridge, &self.dir, parameter_server, &name);
                if sent.is_err() {
                    self.stats.pseudo_gradient = Some(name);
                }
                sent?;
                self.sent(round, started.elapsed());
            }
        }
        if self.leaving {
            // Its part of the round is sent: it takes no next model.
            return Ok(Some(TrainerOrder::Done));
        }
        if overlap && self.ahead.is_none() {
            self.learner.remember_sync()?;
            self.ahead = Some(Ahead {
                round,
                stats: RoundStats {
                    batch_ms: self.stats.batch_ms,
                    ..RoundStats::default()
                },
                limit: self.stats.batches.max(1),
                starved: false,
            });
        }
        self.receive(parameter_server)
    }

    /// The round's pseudo-gradient reached the server after `took`.
    fn sent(&mut self, round: u64, took: Duration) {
        self.stats.sent = true;
        let ms = took.as_secs_f64() * 1000.0;
        self.send_ms = Some(self.send_ms.map_or(ms, |last| 0.5 * last + 0.5 * ms));
        eprintln!(
            "round {round}: pseudo-gradient of {} samples ({} batches) sent in {ms:.0} ms",
            self.stats.samples, self.stats.batches
        );
    }

    /// Starts sending round `round`'s pseudo-gradient, the outbox's file `name`, in a thread
    /// of its own.
    fn send_in_background(&mut self, peer: &str, round: u64, name: String) {
        let (bridge, dir, peer) = (self.bridge.clone(), self.dir.clone(), peer.to_string());
        let file = name.clone();
        let task = std::thread::spawn(move || send_file(&bridge, &dir, &peer, &file));
        self.sending = Some(Sending {
            task,
            started: Instant::now(),
            name,
            round,
        });
    }

    /// Looks after the pseudo-gradient being sent in the background: done, sent again after a
    /// failure that may pass, or the error.
    fn poll_send(&mut self, peer: &str) -> Result<(), TrainError> {
        if !self.sending.as_ref().is_some_and(|s| s.task.is_finished()) {
            return Ok(());
        }
        let Some(sending) = self.sending.take() else {
            return Ok(());
        };
        let result = sending.task.join().unwrap_or_else(|_| {
            Err(TrainError::Protocol(
                "the thread sending the pseudo-gradient panicked".into(),
            ))
        });
        match result {
            Ok(()) => self.sent(sending.round, sending.started.elapsed()),
            Err(error) if error.is_transient() => {
                eprintln!("round {}: {error}; sending again", sending.round);
                self.send_in_background(peer, sending.round, sending.name);
            }
            Err(error) => return Err(error),
        }
        Ok(())
    }

    /// Writes the round's pseudo-gradient θ_global − θ_local, compressed with the job's
    /// codec, into the outbox: the name of the file sent to the parameter server.
    fn pseudo_gradient(&mut self, round: u64) -> Result<String, TrainError> {
        let metadata = Metadata::from([
            (
                meta::KIND.to_string(),
                meta::KIND_PSEUDO_GRADIENT.to_string(),
            ),
            (meta::ROUND.to_string(), round.to_string()),
            (meta::SAMPLES.to_string(), self.stats.samples.to_string()),
            (
                meta::ACCEPTS.to_string(),
                meta::KIND_MODEL_DELTA.to_string(),
            ),
        ]);
        let name = format!("pseudo-gradient-{round}.safetensors");
        self.learner
            .write_pseudo_gradient(&outbox(&self.dir, &name)?, &metadata)?;
        Ok(name)
    }

    /// Waits for the parameter server's next global model (whole, or as the change of the
    /// one this trainer holds) and starts a round from it. Every [`MODEL_WAIT`] without it,
    /// asks the scheduler: an order other than to go on waiting (join another server,
    /// training is over) is returned instead. A model of a round this trainer already took
    /// (a server answers each join offer) is skipped. With overlap, it trains ahead between
    /// looks for the model, up to its limit and as long as slices come.
    ///
    /// Told to stop meanwhile, it waits no longer (its update is sent or on its way): back in
    /// [`run`](Self::run), it leaves at once rather than after the next model, which may be
    /// a round away and after the worker's `kill_grace_ms`.
    fn receive(&mut self, peer: &str) -> Result<Option<TrainerOrder>, TrainError> {
        let mut asked = Instant::now();
        loop {
            if self.stop.load(Ordering::Relaxed) {
                return Ok(None);
            }
            self.poll_send(peer)?;
            if self
                .asked_whole
                .is_some_and(|asked| asked.elapsed() >= OFFER_AGAIN)
            {
                self.ask_whole(peer)?;
            }
            let ahead = self
                .ahead
                .as_ref()
                .is_some_and(|a| a.stats.batches < a.limit && !a.starved);
            let wait = if ahead { Duration::ZERO } else { MODEL_WAIT };
            let entries = self.bridge.fetch(&FetchRequest {
                fetch: Reference::Peers(Peers::new([peer], Strategy::All)),
                out_dir: "models".to_string(),
                wait_ms: Some(wait.as_millis() as u64),
            })?;
            if let Some(entry) = entries.into_iter().next() {
                let path = self.dir.join(&entry.path);
                let taken = self.take_model(peer, &path);
                // Taken or not, the file goes: a long job's directory does not fill up.
                let _ = std::fs::remove_file(&path);
                if taken? {
                    return Ok(None);
                }
                continue;
            }
            if ahead {
                if !self.train_batch(true)?
                    && let Some(ahead) = self.ahead.as_mut()
                {
                    ahead.starved = true;
                }
                if asked.elapsed() < MODEL_WAIT {
                    continue;
                }
            }
            asked = Instant::now();
            match self.report()? {
                TrainerOrder::Done => return Ok(Some(TrainerOrder::Done)),
                // Joining this server already: its answer may be on its way. The offer is
                // made again now and then, in case it was lost or the server was replaced on
                // the same worker.
                TrainerOrder::Join { parameter_server }
                    if self.round.is_none() && parameter_server == peer =>
                {
                    if self.offered.0.elapsed() >= self.offered.1 {
                        self.offer(peer)?;
                    }
                }
                order @ TrainerOrder::Join { .. } => return Ok(Some(order)),
                TrainerOrder::Wait { evaluate, .. } => {
                    if evaluate {
                        self.score_held_model();
                    }
                }
                TrainerOrder::Train { .. } => {}
            }
        }
    }

    /// Takes the file at `path` the parameter server sent: a global model, whole or as a
    /// change of the one this trainer holds. True when a round starts from it; false when
    /// it was of an earlier round, did not fit (the whole model is asked for), or is not a
    /// model.
    fn take_model(&mut self, peer: &str, path: &Path) -> Result<bool, TrainError> {
        let file_error = |error| TrainError::File {
            path: path.to_path_buf(),
            error,
        };
        let mut file = std::fs::File::open(path).map_err(file_error)?;
        let metadata = hypha_diloco::read_metadata(&mut file)?;
        match metadata.get(meta::KIND).map(String::as_str) {
            Some(meta::KIND_MODEL_HELD) => return self.take_held(peer, &metadata),
            Some(meta::KIND_MODEL_REQUEST) => {
                // A server with no model yet, adopting this trainer's: sent whole, still
                // named by its fingerprint, so that the server's answer is "held"; requests
                // that queued while the last upload ran are not answered with another.
                let sent_lately =
                    (self.whole_offered).is_some_and(|sent| sent.elapsed() < OFFER_AGAIN);
                if let Some(offer) = self.rejoining.as_ref().map(|r| r.offer.clone())
                    && !sent_lately
                {
                    eprintln!(
                        "the parameter server {peer} holds no model yet and adopts this trainer's: sending it whole"
                    );
                    self.offer_whole(peer, &offer)?;
                }
                return Ok(false);
            }
            _ => {}
        }
        let round = hypha_diloco::server::round_of(&metadata)?;
        if self.last_model.is_some_and(|last| round <= last) {
            return Ok(false);
        }
        let (global, hash, changed) = match metadata.get(meta::KIND).map(String::as_str) {
            Some(meta::KIND_MODEL_DELTA) => match self.apply_change(path, &metadata) {
                Ok((global, hash)) => (global, hash, true),
                Err(why) => {
                    eprintln!(
                        "round {round}: the model's change does not fit this trainer's copy ({why}); asking for the whole model"
                    );
                    self.ask_whole(peer)?;
                    return Ok(false);
                }
            },
            Some(meta::KIND_MODEL) => {
                let (global, hash) = self.learner.read_model(path)?;
                (global, hash, false)
            }
            other => {
                eprintln!("a file of kind {other:?} from the parameter server: ignored");
                return Ok(false);
            }
        };
        if metadata
            .get(meta::MODEL_HASH)
            .is_some_and(|expected| *expected != hash)
        {
            let what = if changed {
                "the model built from the change"
            } else {
                "the whole model"
            };
            eprintln!(
                "round {round}: {what} does not match the server's fingerprint; asking for the whole model"
            );
            self.ask_whole(peer)?;
            return Ok(false);
        }
        self.start_round(round, Some((global, hash)))?;
        if changed {
            self.deltas_applied += 1;
        }
        let how = if changed { "as a change" } else { "whole" };
        eprintln!("round {round}: global model received ({how})");
        if std::mem::take(&mut self.evaluate_next) {
            self.score(round);
        }
        Ok(true)
    }

    /// Scores the global model it holds, unless it did: true when it scored it now.
    fn score_held_model(&mut self) -> bool {
        match self.round {
            Some(round) if self.scored != Some(round) => {
                self.score(round);
                true
            }
            _ => false,
        }
    }

    /// Scores the global model of round `round` on the held-out data, fetched the first
    /// time, for the next status to report. A score that fails is said and skipped: the
    /// training goes on.
    fn score(&mut self, round: u64) {
        self.scored = Some(round);
        let started = Instant::now();
        match self.held_out_score() {
            Ok(Some(score)) => {
                eprintln!(
                    "round {round}: held-out loss {:.4} over {} targets ({} ms)",
                    score.loss,
                    score.targets,
                    started.elapsed().as_millis()
                );
                self.eval = Some(Evaluation {
                    round,
                    loss: score.loss,
                    scored: score.targets,
                    accuracy: Some(score.accuracy),
                });
            }
            Ok(None) => {}
            Err(error) => {
                eprintln!("round {round}: the held-out data could not be scored: {error}")
            }
        }
    }

    fn held_out_score(&mut self) -> Result<Option<crate::local::Score>, TrainError> {
        let Some(reference) = self.config.eval.clone() else {
            return Ok(None);
        };
        let batches = match &mut self.held_out {
            Some(batches) => batches,
            empty => empty.insert(read_held_out(
                &self.bridge,
                &self.dir,
                reference,
                &self.config,
            )?),
        };
        self.learner.evaluate(batches)
    }

    /// The server's answer to this trainer's offer by fingerprint: it holds the model of
    /// the round `metadata` names. When that is the model this trainer offered, its round
    /// starts over from it: true.
    fn take_held(&mut self, peer: &str, metadata: &Metadata) -> Result<bool, TrainError> {
        let round = hypha_diloco::server::round_of(metadata)?;
        let hash = metadata.get(meta::MODEL_HASH).map(String::as_str);
        let offer = metadata.get(meta::OFFER);
        let answers = self
            .rejoining
            .as_ref()
            .is_some_and(|r| r.round == round && Some(&r.offer) == offer);
        if !answers || hash != Some(self.learner.global_hash()) {
            eprintln!(
                "round {round}: the parameter server {peer} says it holds a model this trainer did not offer; waiting for the global model"
            );
            return Ok(false);
        }
        self.start_round(round, None)?;
        eprintln!(
            "round {round}: the parameter server {peer} holds this trainer's global model; the round starts over from it"
        );
        Ok(true)
    }

    /// Starts round `round` from the global model `global` (with its fingerprint; `None`:
    /// the one the trainer holds): loaded as it is, or, when the trainer trained ahead, with
    /// what it learned since the sync moved onto it.
    fn start_round(
        &mut self,
        round: u64,
        global: Option<(L::Global, String)>,
    ) -> Result<(), TrainError> {
        // An update still on its way is of a round that is over.
        if let Some(sending) = self.sending.take()
            && sending.task.is_finished()
            && matches!(sending.task.join(), Ok(Ok(())))
        {
            self.sent(sending.round, sending.started.elapsed());
        }
        self.asked_whole = None;
        self.rejoining = None;
        let batch_ms = self.stats.batch_ms;
        match self.ahead.take() {
            // What it trained ahead belongs to the round after the one it synced: on any
            // other model it is thrown away, its slices reported as consumed by that round
            // (which the scheduler gives back, as the trainer was not in it).
            Some(ahead) if ahead.stats.batches > 0 && round != ahead.round + 1 => {
                eprintln!(
                    "round {round}: {} batches trained ahead for round {} thrown away",
                    ahead.stats.batches,
                    ahead.round + 1
                );
                if !ahead.stats.consumed.is_empty() {
                    self.report_slices(&ahead.stats.consumed, ahead.round + 1)?;
                }
                self.data.rewind();
                self.learner.start(global, false)?;
                self.stats = RoundStats {
                    batch_ms,
                    ..RoundStats::default()
                };
            }
            Some(ahead) if ahead.stats.batches > 0 => {
                self.learner.start(global, true)?;
                eprintln!(
                    "round {round}: {} batches trained ahead moved onto the new global model",
                    ahead.stats.batches
                );
                self.stats = RoundStats {
                    batch_ms: ahead.stats.batch_ms.or(batch_ms),
                    ..ahead.stats
                };
            }
            ahead => {
                self.learner.start(global, false)?;
                self.stats = RoundStats {
                    batch_ms,
                    consumed: ahead.map(|a| a.stats.consumed).unwrap_or_default(),
                    ..RoundStats::default()
                };
            }
        }
        self.round = Some(round);
        self.last_model = Some(round);
        Ok(())
    }

    /// The global model the change in the file at `path` (with its `metadata`) makes of the
    /// one this trainer holds, and its fingerprint; why not, when the change is of another
    /// model.
    fn apply_change(
        &mut self,
        path: &Path,
        metadata: &Metadata,
    ) -> Result<(L::Global, String), String> {
        let base_round = metadata
            .get(meta::BASE_ROUND)
            .and_then(|r| r.parse::<u64>().ok());
        let round = hypha_diloco::server::round_of(metadata).ok();
        // Joining a new server, it holds the model it offered by its fingerprint.
        let held = self
            .last_model
            .or(self.rejoining.as_ref().map(|rejoining| rejoining.round));
        if base_round.is_none() || base_round != held {
            return Err(format!(
                "it changes the model of round {base_round:?}, this trainer holds {held:?}"
            ));
        }
        if round != base_round.map(|base| base + 1) {
            return Err(format!(
                "it claims to lead from round {base_round:?} to {round:?}"
            ));
        }
        if metadata.get(meta::BASE_HASH).map(String::as_str) != Some(self.learner.global_hash()) {
            return Err("it changes a model with another fingerprint".into());
        }
        self.learner.apply_change(path)
    }

    /// Asks `parameter_server` for the whole global model, again every [`OFFER_AGAIN`] until
    /// a model arrives.
    fn ask_whole(&mut self, parameter_server: &str) -> Result<(), TrainError> {
        self.asked_whole = Some(Instant::now());
        let metadata =
            Metadata::from([(meta::KIND.to_string(), meta::KIND_MODEL_REQUEST.to_string())]);
        let name = "model-request.safetensors";
        let path = outbox(&self.dir, name)?;
        hypha_diloco::Tensors::default().save(&path, &metadata)?;
        send_file(&self.bridge, &self.dir, parameter_server, name)
    }
}

/// The path of the file `name` in the outbox of the job's directory `dir` (made if missing).
fn outbox(dir: &Path, name: &str) -> Result<PathBuf, TrainError> {
    let outbox = dir.join("outbox");
    std::fs::create_dir_all(&outbox).map_err(|error| TrainError::File {
        path: outbox.clone(),
        error,
    })?;
    Ok(outbox.join(name))
}

/// The held-out slices `reference` names, fetched through the job's bridge into `dir` and
/// read as the model reads its batches; the files go once read.
fn read_held_out(
    bridge: &Client,
    dir: &Path,
    reference: Reference,
    config: &JobConfig,
) -> Result<Vec<Batch>, TrainError> {
    let entries = bridge.fetch(&FetchRequest {
        fetch: reference,
        out_dir: "heldout".to_string(),
        wait_ms: None,
    })?;
    let mut batches = Vec::with_capacity(entries.len());
    for entry in entries {
        let path = dir.join(&entry.path);
        let bytes = std::fs::read(&path).map_err(|error| TrainError::File {
            path: path.clone(),
            error,
        });
        let _ = std::fs::remove_file(&path);
        let slice = entry
            .metadata
            .get("slice")
            .and_then(serde_json::Value::as_u64);
        let batch = Batch::read(&bytes?, &config.model, &config.tensors).map_err(|error| {
            TrainError::Data {
                epoch: 0,
                slice: slice.unwrap_or(u64::MAX),
                error,
            }
        })?;
        batches.push(batch);
    }
    Ok(batches)
}

/// Sends the file `outbox/{name}` of the job's directory `dir` to `peer` through the job's
/// bridge; removed once sent, kept to be sent again when not.
fn send_file(bridge: &Client, dir: &Path, peer: &str, name: &str) -> Result<(), TrainError> {
    bridge.send(&SendRequest {
        send: Target::Peers(Peers::new([peer], Strategy::All)),
        path: format!("outbox/{name}"),
        patience_ms: Some(SEND_PATIENCE.as_millis() as u64),
    })?;
    let _ = std::fs::remove_file(dir.join("outbox").join(name));
    Ok(())
}

/// The job's slices, read batch by batch.
#[derive(Debug)]
struct Reader {
    bridge: Client,
    dir: PathBuf,
    reference: Reference,
    model: ModelSpec,
    tensors: TensorNames,
    current: Option<Slice>,
    /// Slices read to their end, not yet reported.
    finished: Vec<SliceRef>,
    /// The iteration is done: every slice is used or held by another job.
    done: bool,
    /// No slice was free on the last try; others hold the rest for now.
    waiting: bool,
}

#[derive(Debug)]
struct Slice {
    batch: Batch,
    rows: usize,
    next: usize,
    id: SliceRef,
}

impl Reader {
    fn new(bridge: Client, dir: &Path, config: &JobConfig) -> Self {
        Self {
            bridge,
            dir: dir.to_path_buf(),
            reference: config.data.clone(),
            model: config.model.clone(),
            tensors: config.tensors.clone(),
            current: None,
            finished: Vec::new(),
            done: false,
            waiting: false,
        }
    }

    /// Nothing left to read now.
    fn out_of_data(&self) -> bool {
        (self.done || self.waiting) && !self.in_slice()
    }

    /// The slice being read is read again from its first row.
    fn rewind(&mut self) {
        if let Some(slice) = self.current.as_mut()
            && slice.next < slice.rows
        {
            slice.next = 0;
        }
    }

    /// A slice is being read and has rows left.
    fn in_slice(&self) -> bool {
        self.current.as_ref().is_some_and(|s| s.next < s.rows)
    }

    /// The next batch of at most `size` rows, never across two slices, with its row count;
    /// `None` when the data is done. Slices read to their end go to `finished`.
    fn next_batch(&mut self, size: usize) -> Result<Option<(Batch, usize)>, TrainError> {
        while !self.in_slice() {
            self.current = self.fetch()?;
            match &self.current {
                None => return Ok(None),
                // An empty slice is read as soon as it arrives.
                Some(slice) if slice.rows == 0 => self.finished.push(slice.id),
                Some(_) => {}
            }
        }
        let Some(slice) = self.current.as_mut() else {
            return Ok(None);
        };
        let take = size.max(1).min(slice.rows - slice.next);
        let batch = slice.batch.narrow(slice.next, take)?;
        slice.next += take;
        if slice.next == slice.rows {
            self.finished.push(slice.id);
        }
        Ok(Some((batch, take)))
    }

    fn fetch(&mut self) -> Result<Option<Slice>, TrainError> {
        if self.done {
            return Ok(None);
        }
        let request = FetchRequest {
            fetch: self.reference.clone(),
            out_dir: "slices".to_string(),
            wait_ms: Some(DATA_WAIT.as_millis() as u64),
        };
        let entries = match self.bridge.fetch(&request) {
            Ok(entries) => entries,
            Err(error) if error.code() == Some("data_wait") => {
                self.waiting = true;
                return Ok(None);
            }
            Err(error) => return Err(error.into()),
        };
        self.waiting = false;
        let Some(entry) = entries.first() else {
            self.done = true;
            return Ok(None);
        };
        let number = |key: &str| {
            entry
                .metadata
                .get(key)
                .and_then(serde_json::Value::as_u64)
                .ok_or_else(|| {
                    TrainError::Protocol(format!(
                        "the slice {} has no {key:?} in its metadata",
                        entry.path
                    ))
                })
        };
        let id = SliceRef {
            epoch: u32::try_from(number("epoch")?).unwrap_or(u32::MAX),
            slice: number("slice")?,
        };
        let path = self.dir.join(&entry.path);
        let bytes = std::fs::read(&path).map_err(|error| TrainError::File {
            path: path.clone(),
            error,
        });
        // Read or not, the file goes: a long job's directory does not fill up.
        let _ = std::fs::remove_file(&path);
        let batch =
            Batch::read(&bytes?, &self.model, &self.tensors).map_err(|error| TrainError::Data {
                epoch: id.epoch,
                slice: id.slice,
                error,
            })?;
        Ok(Some(Slice {
            rows: batch.rows(),
            batch,
            next: 0,
            id,
        }))
    }
}
