//! The built-in parameter server (`runtime = "parameter-server"`): DiLoCo's outer loop as a
//! job.
//!
//! It takes files from the job's inbox (what the task's trainers send over the resource
//! protocol, see [`transfer`](crate::bridge::transfer)): trainers' offers of their initial
//! models (held while the server has none, until the scheduler names the one to adopt; see
//! "What trainers get") and pseudo-gradients (added to the round they were trained for, as they
//! arrive, or dropped when that round is closed; taken only from the trainers the scheduler
//! named). It reports to the job's scheduler after every file and every [`REPORT_EVERY`],
//! and does what the answer says: wait, take updates from these trainers, adopt this
//! trainer's model, close the round (weighted mean, Nesterov step, checkpoint, new global
//! model to every trainer), skip the round (too few of its updates were taken: the model
//! stays as it was), or finish. Refused updates are in every status until their round
//! ends, with a reason of at most 200 characters: the scheduler does not wait for them.
//!
//! **What trainers get.** A job that compresses (`"compression"` in its config) has the
//! server send each round's change of the global model, compressed with that codec, to the
//! trainers whose update made the round and that take changes (their pseudo-gradient says
//! so, [`meta::ACCEPTS`]): they hold the round's model. Everybody else, and a trainer that
//! asks ([`meta::KIND_MODEL_REQUEST`]: its copy did not fit the change), gets the whole model.
//! Both carry the fingerprint of the model they lead to ([`meta::MODEL_HASH`]). A trainer
//! that joins names the model it holds by its fingerprint ([`meta::KIND_MODEL_HELD`]; its
//! initial model drawn from the job's seed, or a model of an earlier server): it is told when
//! the server holds the same, sent the change when it is one round behind, the whole model
//! otherwise. While the server holds none, the offer waits with the whole ones until the
//! scheduler names the one to adopt: only that trainer is asked for its model whole, and at
//! adoption every offerer whose fingerprint is the adopted model's is told the server holds
//! it. Trainers drawing the same initial model thus send it once, and get nothing back.
//!
//! Files in the job's directory: `parameter-server.safetensors` (the checkpoint: model,
//! momentum, carried residual, round; written atomically when the model is adopted, then as
//! [`Cadence`] says: every `checkpoint_every` rounds, or by default once the server moved ten
//! checkpoints' worth of updates and models since the last, and when training is over),
//! `models/round-{r}.safetensors` (the global model each round starts from, as sent),
//! `models/delta-{r}.safetensors` (the change that leads to it, when the job compresses; both
//! kept for the last two rounds), `final.safetensors` (the model when training is over).
//!
//! **Memory.** Updates are read from their files a chunk at a time and the round closes in
//! place, a parameter at a time ([`hypha_diloco::server`]): the server holds the model, its
//! momentum, the running sum and (compressing) the carried residual, whatever the number of
//! trainers.
//!
//! **The checkpoint's second place.** Every checkpoint is pushed to the scheduler over the
//! resource protocol in the background (only the newest while one is on its way, retried
//! until the scheduler takes it; a round's once the scheduler answered the status saying the
//! round was applied): the scheduler marks a round's slices used only once the
//! round is in a checkpoint it holds, and restores a replacement from it. A server given
//! `{"restore": {"round": r}}` waits for that checkpoint from the scheduler before it serves;
//! a server told that training is over pushes its last checkpoint before it exits.
//!
//! **The standby.** A job whose config says `"standby": true` follows the serving server
//! ([`standby`]) until the scheduler tells it to take over. The serving server sends the
//! standby the scheduler names ([`ServerOrder::Standby`]) every round's model before it
//! sends trainers theirs ([`STANDBY_HEAD_START`]): the change when it made one, whole
//! otherwise, counted apart from the round's DiLoCo traffic (`Applied::standby_bytes`).

use std::{
    collections::{HashSet, VecDeque},
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use hypha_artifacts::Published;
use hypha_diloco::{
    Codec, MAX_HEADER, Metadata, OuterOptimizer,
    file::FileSource,
    server::{ParameterServer, Taken, round_of, samples_of},
};
use hypha_messages::{
    diloco::{Applied, Late, ServerConfig, ServerStatus, Status, meta},
    job::JobStatus,
};
use hypha_network::{Network, PeerId};
use tokio::sync::oneshot;

pub use checkpoints::CHECKPOINT_TRAFFIC_RATIO;
pub use publish::{ModelPublisher, PUBLISH_FROM_BYTES};

use self::{
    checkpoints::{Cadence, Uploads},
    rules::{Effect, Event, HeldReply, Loop},
};
use crate::bridge::transfer::{self, Header, Inbox};

mod checkpoints;
mod publish;
mod rules;
mod standby;

/// How often the server reports when nothing arrives.
pub const REPORT_EVERY: Duration = Duration::from_millis(250);
/// The checkpoint, in the job's directory.
pub const CHECKPOINT: &str = "parameter-server.safetensors";
/// The name a checkpoint travels under, to and from the scheduler.
pub const CHECKPOINT_TRANSFER: &str = "checkpoint.safetensors";
/// How long a restored server waits for its checkpoint, and a finishing one for its last
/// checkpoint to reach the scheduler.
pub const CHECKPOINT_PATIENCE: Duration = Duration::from_secs(120);
/// The model when training is over, in the job's directory.
pub const FINAL_MODEL: &str = "final.safetensors";
/// The global models and changes sent, in the job's directory.
const MODELS_DIR: &str = "models";
/// Where initial models wait for the scheduler to name the one to adopt, in the job's
/// directory (one file per peer, its last offer).
const OFFERS_DIR: &str = "offers";
/// How often the trainer whose initial model is to be adopted is asked for it while it does
/// not come: the request or the upload may have been lost; a trainer answers no request that
/// queued while its last upload ran (`hypha-executor`'s `OFFER_AGAIN`).
const REQUEST_AGAIN: Duration = Duration::from_secs(5);

/// Offers by fingerprint held at once (a hundred bytes each); further ones are refused until
/// a model is adopted.
const MAX_FINGERPRINTS: usize = 4096;

/// Initial models held at once; offers from further peers are refused until one is adopted.
const MAX_OFFERS: usize = 64;
/// How often a peer is sent the whole model on its own offer or request, at most: a trainer
/// asks again after `hypha_executor::train::OFFER_AGAIN` (5 s) without an answer.
const WHOLE_MODEL_EVERY: Duration = Duration::from_secs(4);
/// How often a peer's offer by fingerprint is answered, at most (a trainer offers again
/// every second until it is).
const ANSWER_EVERY: Duration = Duration::from_millis(500);
/// The longest header the server reads of a file from a peer the scheduler has not named a
/// trainer or the standby: a model offer's tensor entries and metadata (about 100 bytes a
/// tensor: ten thousand tensors), not the [`MAX_HEADER`] of 100 MiB a named peer may send.
pub const UNNAMED_HEADER: u64 = 1 << 20;
/// How long the trainers' copies of a round's model wait for the standby's to arrive first.
/// A server lost right after a round then leaves that round's model on the standby, and no
/// trainer holds a newer model than the standby that takes over (it would be sent the whole
/// standby's). Over a link shared by all, the trainers' copies arrive about as late either
/// way; a standby on a link slower than the trainers' costs each round this at most.
const STANDBY_HEAD_START: Duration = Duration::from_secs(2);
/// The link a peer asking again for the round's whole model is assumed to have at worst
/// (25 MB/s): the whole model of that round goes to it again only once it would have
/// arrived over one.
const SLOW_LINK_BYTES_PER_S: f64 = 25e6;

/// One parameter-server job.
#[derive(Debug)]
pub struct ServerJob {
    pub network: Network,
    pub scheduler: PeerId,
    pub job: String,
    pub task: String,
    pub dir: PathBuf,
    pub inbox: Arc<Inbox>,
    /// The job's config as the scheduler sent it.
    pub config: serde_json::Value,
    /// Publishes whole models for the trainers' workers to fetch.
    pub publisher: ModelPublisher,
    /// The transfers of models and changes under way.
    pub sends: Sends,
}

/// The server's transfers under way, each a task the job owns: ended with the job when it
/// fails or is cancelled (its model is nobody's to take), and let go of when training is
/// over, so that the last models on their way still reach their trainers (each transfer
/// ends by itself, delivered or given up after `SEND_PATIENCE`).
#[derive(Debug, Default)]
pub struct Sends(std::sync::Mutex<tokio::task::JoinSet<()>>);

impl Sends {
    fn spawn(&self, send: impl std::future::Future<Output = ()> + Send + 'static) {
        let mut sends = self.0.lock().unwrap_or_else(|p| p.into_inner());
        // Those that ended are let go of as new ones start.
        while sends.try_join_next().is_some() {}
        sends.spawn(send);
    }

    /// Lets the transfers under way finish on their own, past the job.
    fn let_go(&self) {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .detach_all();
    }
}

/// Turns true once every transfer of one send has ended, arrived or given up.
type Ended = tokio::sync::watch::Receiver<bool>;

/// Says so when the last transfer of a send lets go of it (each holds a clone).
#[derive(Debug)]
struct EndsOnDrop(tokio::sync::watch::Sender<bool>);

impl Drop for EndsOnDrop {
    fn drop(&mut self) {
        self.0.send_replace(true);
    }
}

/// What the actor holds while it serves: the server, the job's codec, who it hears from,
/// the checkpoint's way to the scheduler, the loop's rules, and the standby's transfer of
/// the round the rules wait to announce.
struct Serving {
    server: ParameterServer,
    codec: Codec,
    peers: Peers,
    uploads: Uploads,
    rules: Loop,
    standby_ended: Option<Ended>,
}

/// What a round's end (a close or a skip) did.
struct RoundEnd {
    applied: Applied,
    /// Bytes sent to the trainers.
    sent: u64,
    /// Bytes sent to the standby, and the end of that transfer (`None` without a standby).
    to_standby: u64,
    standby: Option<Ended>,
}

impl RoundEnd {
    /// The event the rules hear; the standby's transfer goes to `standby_ended`, for
    /// [`standby_holds`].
    fn into_event(self, standby_ended: &mut Option<Ended>, has_standby: bool) -> Event {
        *standby_ended = self.standby;
        Event::Ended {
            applied: self.applied,
            sent: self.sent,
            to_standby: self.to_standby,
            has_standby,
        }
    }
}

/// Resolves once the round the rules wait to announce (`until`: its head start's end;
/// `None`: none waits, and this never resolves) may be said: the standby's transfer
/// ended, or `until` passed; at once without a standby.
async fn standby_holds(until: Option<tokio::time::Instant>, standby: &mut Option<Ended>) {
    let Some(until) = until else {
        return std::future::pending().await;
    };
    if let Some(standby) = standby.as_mut() {
        let _ = tokio::time::timeout_at(until, standby.wait_for(|ended| *ended)).await;
    }
}

/// Why the server stopped before training was over.
#[derive(Debug, thiserror::Error)]
enum ServerError {
    #[error(
        "the job's config is not a parameter server's ({0}); it needs {{\"outer\": {{\"learning_rate\": …, \"momentum\": …}}}}"
    )]
    Config(serde_json::Error),
    /// The job config's `compression` as the codec's parser describes what is wrong with it.
    #[error("the job's config: compression {0}")]
    Codec(String),
    #[error(transparent)]
    Diloco(#[from] hypha_diloco::Error),
    /// Why the standby holds no model it could take over with, described by its own checks.
    #[error("the standby cannot take over: {0}")]
    Standby(String),
    #[error(
        "the scheduler's checkpoint of round {round} did not come within {:?}: {reason}",
        CHECKPOINT_PATIENCE
    )]
    NoCheckpoint { round: u64, reason: String },
}

impl ServerJob {
    /// Serves until the scheduler says training is over, or `cancel` fires.
    pub async fn run(self, cancel: oneshot::Receiver<String>) -> JobStatus {
        tokio::pin!(cancel);
        let result = tokio::select! {
            result = self.serve() => result,
            reason = &mut cancel => {
                let reason = reason.unwrap_or_else(|_| "the worker is shutting down".into());
                return JobStatus::Failed { reason: format!("cancelled: {reason}"), stderr_tail: vec![] };
            }
        };
        match result {
            Ok(()) => {
                self.sends.let_go();
                JobStatus::Finished {
                    exit_code: 0,
                    stderr_tail: Vec::new(),
                }
            }
            Err(error) => JobStatus::Failed {
                reason: error.to_string(),
                stderr_tail: vec![],
            },
        }
    }

    /// Serves until the scheduler says training is over: the actor of [`rules::Loop`].
    async fn serve(&self) -> Result<(), ServerError> {
        let config: ServerConfig =
            serde_json::from_value(self.config.clone()).map_err(ServerError::Config)?;
        let Some((server, codec, cadence)) = self.start(config).await? else {
            return Ok(());
        };
        let mut serving = Serving {
            server,
            codec,
            peers: Peers::default(),
            uploads: Uploads::start(
                self.network.clone(),
                self.scheduler,
                self.task.clone(),
                self.dir.join(CHECKPOINT),
            ),
            rules: Loop::new(cadence),
            standby_ended: None,
        };
        let mut report = tokio::time::interval(REPORT_EVERY);
        report.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let anyone = HashSet::new();
        loop {
            let until = serving.rules.announcing_until();
            let event = tokio::select! {
                arrived = self.inbox.next(&anyone) => {
                    let (bytes, dropped) = self.take(
                        &mut serving.server,
                        codec,
                        &arrived,
                        &mut serving.peers,
                    );
                    Event::Took { bytes, dropped }
                }
                _ = report.tick() => Event::Tick,
                () = standby_holds(until, &mut serving.standby_ended) => Event::Held,
            };
            if self.carry_out(&mut serving, event).await? {
                serving.uploads.finish().await;
                return Ok(());
            }
        }
    }

    /// The server this job serves with (restored from the scheduler's checkpoint, resumed
    /// from its own, or taken over as the standby), the job's codec, and when it
    /// checkpoints; `None` when a standby ends without taking over.
    async fn start(
        &self,
        config: ServerConfig,
    ) -> Result<Option<(ParameterServer, Codec, Cadence)>, ServerError> {
        let optimizer = OuterOptimizer::from(config.outer);
        let checkpoint = self.dir.join(CHECKPOINT);
        if let Some(restore) = config.restore {
            self.restore(restore.round).await?;
        }
        let mut server = if config.standby {
            let Some(model) = self.stand_by().await.map_err(ServerError::Standby)? else {
                return Ok(None);
            };
            let held = checkpoint.exists().then_some(checkpoint.as_path());
            let taken = tokio::task::block_in_place(|| {
                ParameterServer::take_over(&model, held, optimizer.clone())
            });
            match taken {
                Ok(server) => server,
                Err(error) if held.is_some() => {
                    tracing::warn!(%error, "the checkpoint held is unreadable; taking over without its momentum");
                    let _ = std::fs::remove_file(&checkpoint);
                    tokio::task::block_in_place(|| {
                        ParameterServer::take_over(&model, None, optimizer)
                    })?
                }
                Err(error) => return Err(error.into()),
            }
        } else {
            ParameterServer::resume(&checkpoint, optimizer)?
        };
        if let Some(max) = config.max_samples {
            server = server.limit_samples(max);
        }
        if let Some(ratio) = config.max_update_norm_ratio {
            server = server.limit_norm(ratio);
        }
        if let Some(planned) = config.samples_per_round {
            server = server.plan_samples(planned);
        }
        let codec = Codec::try_from(config.compression).map_err(ServerError::Codec)?;
        server = server.broadcast_changes(codec.for_broadcast());
        let mut cadence = Cadence::new(
            config.checkpoint_every,
            std::fs::metadata(&checkpoint).map_or(0, |m| m.len()),
        );
        if config.standby {
            // The rounds it took over past the checkpoint it holds are used once a checkpoint
            // of its own holds them: at the latest when training is over.
            cadence.round_applied(0);
        }
        Ok(Some((server, codec, cadence)))
    }

    /// Applies `event` and what the effects it leads to report, each in turn; whether
    /// training is over.
    async fn carry_out(&self, serving: &mut Serving, event: Event) -> Result<bool, ServerError> {
        let mut events = VecDeque::from([event]);
        while let Some(event) = events.pop_front() {
            for effect in serving.rules.apply(event, tokio::time::Instant::now()) {
                match self.effect(serving, effect).await? {
                    Some(reported) => events.extend(reported),
                    None => return Ok(true),
                }
            }
        }
        Ok(false)
    }

    /// Carries out one effect: what it reports back, `None` once training is over (the
    /// final model written; the last checkpoint's upload is the caller's to see through).
    async fn effect(
        &self,
        serving: &mut Serving,
        effect: Effect,
    ) -> Result<Option<Vec<Event>>, ServerError> {
        let Serving {
            server,
            codec,
            peers,
            uploads,
            standby_ended,
            ..
        } = serving;
        let reported = match effect {
            Effect::Ask { dropped, applied } => {
                let status = ServerStatus {
                    round: server.round(),
                    arrived: server.arrivals(),
                    dropped,
                    refused: server.refusals(),
                    applied,
                    trainers: peers.trainers.iter().cloned().collect(),
                    offered: peers.offered(),
                    standby: peers.standby.clone(),
                };
                let order = self.ask(Status::ParameterServer(status)).await;
                vec![Event::Answered {
                    order,
                    round: server.round(),
                }]
            }
            Effect::Upload => {
                uploads.checkpointed();
                vec![]
            }
            Effect::TakeWaiting => {
                let (bytes, dropped) = self.take_waiting(server, *codec, peers);
                vec![Event::TookWaiting { bytes, dropped }]
            }
            Effect::Close(send_to) => {
                let ended = self.close(server, &send_to, peers)?;
                vec![ended.into_event(standby_ended, peers.standby.is_some())]
            }
            Effect::Skip(send_to) => {
                let ended = self.skip(server, &send_to, peers)?;
                vec![ended.into_event(standby_ended, peers.standby.is_some())]
            }
            Effect::NameTrainers(named) => {
                peers.trainers = named.into_iter().collect();
                let mut sent = 0;
                for (peer, offered) in peers.named_since_they_offered() {
                    let offered = offered
                        .as_ref()
                        .map(|(round, hash)| (*round, hash.as_str()));
                    sent += self.send_model(server, &peer, offered, peers);
                }
                vec![Event::SentToTrainers(sent)]
            }
            Effect::Adopt(from) => {
                let checkpoint = self.adopt(server, &from, peers);
                let to_standby = self.send_standby(server, None, peers).0;
                vec![Event::Adopted(checkpoint), Event::SentToStandby(to_standby)]
            }
            Effect::Standby(peer) if peer != peers.standby => {
                tracing::info!(standby = ?peer, "every round's model goes to the standby too");
                peers.standby = peer;
                vec![Event::SentToStandby(
                    self.send_standby(server, None, peers).0,
                )]
            }
            Effect::Standby(_) => vec![],
            Effect::Checkpoint => {
                let size =
                    tokio::task::block_in_place(|| server.checkpoint(&self.dir.join(CHECKPOINT)))?;
                tracing::debug!(round = ?server.round(), size, "checkpoint written");
                vec![Event::Checkpointed(size)]
            }
            Effect::Finish => {
                let path = self.dir.join(FINAL_MODEL);
                tokio::task::block_in_place(|| server.write_model(&path, true))?;
                tracing::info!(round = ?server.round(), path = %path.display(), "training over; final model written");
                return Ok(None);
            }
        };
        Ok(Some(reported))
    }

    /// Takes the files of the trainers that wait in the inbox now (not those that come
    /// while it takes them): the bytes they moved, `None` when there were none, and the
    /// updates among them for rounds already closed.
    fn take_waiting(
        &self,
        server: &mut ParameterServer,
        codec: Codec,
        peers: &mut Peers,
    ) -> (Option<u64>, Vec<Late>) {
        let trainers: HashSet<PeerId> = peers
            .trainers
            .iter()
            .filter_map(|peer| peer.parse().ok())
            .collect();
        let mut moved = None;
        let mut dropped = Vec::new();
        if trainers.is_empty() {
            // An empty set would take anyone's.
            return (moved, dropped);
        }
        let waiting = self.inbox.waiting();
        for _ in 0..waiting {
            let Some(arrived) = self.inbox.try_next(&trainers) else {
                break;
            };
            let (bytes, late) = self.take(server, codec, &arrived, peers);
            *moved.get_or_insert(0) += bytes;
            dropped.extend(late);
        }
        (moved, dropped)
    }

    /// Takes one file from the inbox: a model offered by a trainer that joins, or a
    /// pseudo-gradient (compressed with `codec`, the job's). The bytes this put on the
    /// server's link (the file's, and a whole model sent in answer), and the update when it
    /// came for a round already closed.
    fn take(
        &self,
        server: &mut ParameterServer,
        codec: Codec,
        arrived: &transfer::Arrived,
        peers: &mut Peers,
    ) -> (u64, Option<Late>) {
        let from = arrived.from.to_string();
        let path = match self.inbox.deliver(arrived, Path::new("received")) {
            Ok(path) => self.dir.join(path),
            Err(error) => {
                tracing::warn!(%from, %error, "could not take a file a trainer sent");
                return (0, None);
            }
        };
        let received = std::fs::metadata(&path).map_or(0, |m| m.len());
        // Any peer of the task may offer a model (a trainer the scheduler names a moment
        // later); only those it named may make the server read a header of 100 MiB.
        let named = peers.named(&from);
        let limit = if named { MAX_HEADER } else { UNNAMED_HEADER };
        let metadata = std::fs::File::open(&path)
            .ok()
            .and_then(|mut file| hypha_diloco::read_metadata_within(&mut file, limit).ok())
            .unwrap_or_default();
        match metadata.get(meta::KIND).map(String::as_str) {
            Some(meta::KIND_MODEL) if server.round().is_none() => {
                // A trainer that offered by fingerprint and was asked for its model names both
                // again: answered "held" at adoption, it needs nothing back.
                if let (Some(hash), Some(offer)) =
                    (metadata.get(meta::MODEL_HASH), metadata.get(meta::OFFER))
                {
                    peers.hold_fingerprint(&from, (0, hash), Some(offer));
                }
                peers.hold_offer(&self.dir, &from, &path);
            }
            Some(meta::KIND_MODEL_HELD) => {
                let _ = std::fs::remove_file(&path);
                let answered = self.answer_held(server, &from, &metadata, named, peers);
                return (received + answered, None);
            }
            Some(kind @ (meta::KIND_MODEL | meta::KIND_MODEL_REQUEST)) => {
                let _ = std::fs::remove_file(&path);
                if !named {
                    if kind == meta::KIND_MODEL_REQUEST {
                        tracing::warn!(%from, "a request for the model from a peer the scheduler did not name a trainer of the job: refused");
                    } else {
                        peers.defer(&from, None);
                    }
                    return (received, None);
                }
                return (received + self.send_model(server, &from, None, peers), None);
            }
            Some(meta::KIND_PSEUDO_GRADIENT) => {
                let late = self.take_update(server, codec, &from, &path, &metadata, peers);
                let _ = std::fs::remove_file(&path);
                return (received, late);
            }
            other => {
                let _ = std::fs::remove_file(&path);
                tracing::warn!(%from, kind = ?other, "a file that is neither a model nor a pseudo-gradient: ignored")
            }
        }
        (received, None)
    }

    /// Answers a trainer that names the model it holds by its fingerprint (`metadata`):
    /// from anyone, as whole offers are (the scheduler names a trainer that joins a moment
    /// after it is told to), one answer per peer per [`ANSWER_EVERY`], and models under the
    /// per-peer limit of `send_model`. The bytes sent.
    fn answer_held(
        &self,
        server: &ParameterServer,
        from: &str,
        metadata: &Metadata,
        named: bool,
        peers: &mut Peers,
    ) -> u64 {
        let now = std::time::Instant::now();
        if peers
            .answered
            .get(from)
            .is_some_and(|at| now.duration_since(*at) < ANSWER_EVERY)
        {
            return 0;
        }
        peers.answered.insert(from.to_string(), now);
        let offered = round_of(metadata)
            .ok()
            .zip(metadata.get(meta::MODEL_HASH).map(String::as_str));
        let offer = metadata.get(meta::OFFER).map(String::as_str);
        let held = server.round().zip(server.model_hash());
        match rules::reply_to_held(held, offered, named) {
            HeldReply::WaitForAdoption(offered) => {
                peers.hold_fingerprint(from, offered, offer);
                0
            }
            HeldReply::AskForIt => self.answer(from, meta::KIND_MODEL_REQUEST, None, offer),
            HeldReply::Held(held) => {
                tracing::info!(%from, round = held.0, "a trainer holds this server's global model: it starts from its own copy");
                self.answer(from, meta::KIND_MODEL_HELD, Some(held), offer)
            }
            HeldReply::SendModel => self.send_model(server, from, offered, peers),
            HeldReply::UntilNamed => {
                peers.defer(from, offered);
                0
            }
        }
    }

    /// Adds the pseudo-gradient `from` sent in the file at `path` (with `metadata`) to its
    /// round, or refuses it: it must come from a trainer the scheduler named, for a round,
    /// with samples, within what an update of this model with `codec` can weigh. The update
    /// when it came for a round already closed.
    fn take_update(
        &self,
        server: &mut ParameterServer,
        codec: Codec,
        from: &str,
        path: &Path,
        metadata: &Metadata,
        peers: &mut Peers,
    ) -> Option<Late> {
        // Who sent it and how large it is are known before a byte of it is read.
        if !peers.trainers.contains(from) {
            tracing::warn!(%from, "a pseudo-gradient from a peer the scheduler did not name a trainer of the job: refused");
            return None;
        }
        let (round, samples) = match (round_of(metadata), samples_of(metadata)) {
            (Ok(round), Ok(samples)) => (round, samples),
            (Err(error), _) | (_, Err(error)) => {
                tracing::warn!(%from, %error, "refused a pseudo-gradient");
                return None;
            }
        };
        let size = std::fs::metadata(path).map_or(0, |m| m.len());
        if let Some(limit) = update_limit(server, codec).filter(|limit| size > *limit) {
            let reason = format!(
                "{size} bytes, more than an update of this model can take with {} or f32 ({limit})",
                codec.name()
            );
            tracing::warn!(%from, round, "refused a pseudo-gradient: {reason}");
            if server.round() == Some(round) {
                server.refuse(from, reason);
            }
            return None;
        }
        // Read a chunk at a time to check it, never whole, off the runtime's async threads;
        // the server keeps the file open and reads it again at the close (its name goes
        // once this returns: nobody else opens it).
        let taken = FileSource::open(path).and_then(|update| {
            tokio::task::block_in_place(|| server.add_from(from, update, round, samples))
        });
        match taken {
            Ok(Taken::Added) => {
                tracing::debug!(%from, round, samples, "pseudo-gradient added");
                let accepts = metadata.get(meta::ACCEPTS).map(String::as_str);
                if accepts.is_some_and(|kinds| {
                    kinds.split(',').any(|k| k.trim() == meta::KIND_MODEL_DELTA)
                }) {
                    peers.take_changes.insert(from.to_string());
                } else {
                    peers.take_changes.remove(from);
                }
            }
            Ok(Taken::Late { round }) => {
                tracing::info!(%from, round, "a pseudo-gradient for a closed round: dropped");
                return Some(Late {
                    peer: from.to_string(),
                    round,
                });
            }
            Ok(Taken::Duplicate) => {
                tracing::warn!(%from, round, "a second pseudo-gradient for one round: dropped")
            }
            Err(error) => tracing::warn!(%from, %error, "refused a pseudo-gradient"),
        }
        None
    }

    /// Sends `from` the global model: a joining trainer starts from it; one whose copy does
    /// not fit a change asks for it. The change that leads to it when `from` holds the
    /// model it changes (`base`: round and fingerprint), the whole model otherwise. One
    /// model per peer per [`WHOLE_MODEL_EVERY`]: asking more often cannot fill the server's
    /// link. The same round's again only once it would have arrived on a slow link: a
    /// trainer offers again now and then while a model of gigabytes is still on its way to
    /// it. The bytes sent.
    fn send_model(
        &self,
        server: &ParameterServer,
        from: &str,
        base: Option<(u64, &str)>,
        peers: &mut Peers,
    ) -> u64 {
        let now = std::time::Instant::now();
        let round = server.round();
        let arrives_within = WHOLE_MODEL_EVERY
            + Duration::from_secs_f64(
                server.max_update_bytes(Codec::None).unwrap_or(0) as f64 / SLOW_LINK_BYTES_PER_S,
            );
        let too_soon = peers.whole_sent.get(from).is_some_and(|(sent, of)| {
            let since = now.duration_since(*sent);
            since < WHOLE_MODEL_EVERY || (*of == round && since < arrives_within)
        });
        if too_soon {
            tracing::debug!(%from, "sent the whole model a moment ago: not again yet");
            return 0;
        }
        peers.whole_sent.insert(from.to_string(), (now, round));
        if let Some(sent) = base.and_then(|base| self.send_change(server, from, base)) {
            return sent;
        }
        self.send_models(server, None, &[], &[from.to_string()], None)
            .unwrap_or_else(|error| {
                tracing::warn!(%from, %error, "could not send the global model");
                0
            })
    }

    /// Sends `to`, which holds the model `base` (its round and fingerprint), the change that
    /// leads from it to this server's model: the bytes sent; `None` where this server holds
    /// no such change (it keeps the last round's, a standby that took over the last it took).
    fn send_change(&self, server: &ParameterServer, to: &str, base: (u64, &str)) -> Option<u64> {
        let round = server
            .round()
            .filter(|round| Some(*round) == base.0.checked_add(1))?;
        let path = self
            .dir
            .join(MODELS_DIR)
            .join(format!("delta-{round}.safetensors"));
        let metadata = std::fs::File::open(&path)
            .ok()
            .and_then(|mut file| hypha_diloco::read_metadata(&mut file).ok())?;
        let fits = metadata.get(meta::BASE_ROUND) == Some(&base.0.to_string())
            && metadata.get(meta::BASE_HASH).map(String::as_str) == Some(base.1)
            && metadata.get(meta::MODEL_HASH).map(String::as_str) == server.model_hash();
        fits.then(|| {
            tracing::info!(%to, round, "a trainer holds the model of the round before: sending it the change");
            self.send_file(&path, round, &[to.to_string()], false, None).0
        })
    }

    /// Answers a trainer's offer by fingerprint (`offer`, its name for it) with a file of
    /// `kind` and no tensors: the model it names is this server's (`held`: its round and
    /// fingerprint), or this server holds none yet. The bytes sent.
    fn answer(&self, to: &str, kind: &str, held: Option<(u64, &str)>, offer: Option<&str>) -> u64 {
        let mut metadata = Metadata::from([(meta::KIND.to_string(), kind.to_string())]);
        if let Some(offer) = offer {
            metadata.insert(meta::OFFER.to_string(), offer.to_string());
        }
        if let Some((round, hash)) = held {
            metadata.insert(meta::ROUND.to_string(), round.to_string());
            metadata.insert(meta::MODEL_HASH.to_string(), hash.to_string());
        }
        // One file per peer, its last answer (replaced whole: a transfer reading the one
        // before goes on reading it).
        let path = self
            .dir
            .join(MODELS_DIR)
            .join(format!("answer-{to}.safetensors"));
        let written = std::fs::create_dir_all(self.dir.join(MODELS_DIR))
            .map_err(|error| error.to_string())
            .and_then(|()| {
                tokio::task::block_in_place(|| {
                    hypha_diloco::Tensors::default().save(&path, &metadata)
                })
                .map_err(|error| error.to_string())
            });
        if let Err(error) = written {
            tracing::warn!(%to, %error, "could not answer a trainer's offer");
            return 0;
        }
        self.send_file(
            &path,
            held.map_or(0, |(round, _)| round),
            &[to.to_string()],
            false,
            None,
        )
        .0
    }

    /// Adopts the initial model `from` offered, as the scheduler said (asking `from` for it
    /// first when it offered it by fingerprint), and answers every offer: "held" to those
    /// holding the same model, the model whole to the others. The size of the checkpoint
    /// written of it, `None` where none was.
    fn adopt(&self, server: &mut ParameterServer, from: &str, peers: &mut Peers) -> Option<u64> {
        if server.round().is_some() {
            return None;
        }
        let Some(path) = peers.offers.get(from) else {
            match peers.fingerprints.get(from) {
                // Offered by fingerprint: asked for it whole (again, while the scheduler
                // names it and it does not come, every REQUEST_AGAIN).
                Some(offered) => {
                    let now = std::time::Instant::now();
                    let recently = (peers.requested.as_ref()).is_some_and(|(peer, at)| {
                        peer == from && now.duration_since(*at) < REQUEST_AGAIN
                    });
                    if !recently {
                        peers.requested = Some((from.to_string(), now));
                        tracing::info!(%from, "asking the trainer the scheduler named for its initial model");
                        let offer = offered.offer.clone();
                        self.answer(from, meta::KIND_MODEL_REQUEST, None, offer.as_deref());
                    }
                }
                None => {
                    tracing::warn!(%from, "the scheduler named an initial model this server does not hold")
                }
            }
            return None;
        };
        let adopted = FileSource::open(path)
            .and_then(|model| tokio::task::block_in_place(|| server.offer_from(&model)))
            .map_err(|e| e.to_string());
        match adopted {
            Ok(_) => {
                tracing::info!(%from, "adopted the initial model the scheduler chose as the global model");
                let written =
                    tokio::task::block_in_place(|| server.checkpoint(&self.dir.join(CHECKPOINT)));
                // The next checkpoints hold momentum and residual too: the traffic they are
                // weighed against is theirs, not the model's alone.
                let checkpoint = written
                    .map(|size| size.max(server.checkpoint_bytes().unwrap_or(0)))
                    .inspect_err(
                        |error| tracing::warn!(%error, "could not checkpoint the adopted model"),
                    )
                    .ok();
                // Every offerer holding the adopted model (the same seed draws the same one)
                // is told so; the others get it whole once named.
                let held = server.round().zip(server.model_hash());
                let mut whole = Vec::new();
                for peer in peers.offered() {
                    let fingerprint = peers.fingerprints.get(&peer);
                    let holds = fingerprint.is_some_and(|f| {
                        f.offer.is_some() && Some((f.round, f.hash.as_str())) == held
                    });
                    match fingerprint {
                        Some(f) if holds => {
                            self.answer(&peer, meta::KIND_MODEL_HELD, held, f.offer.as_deref());
                        }
                        _ if peers.named(&peer) => whole.push(peer),
                        f => {
                            let base = f.map(|f| (f.round, f.hash.clone()));
                            peers.defer(&peer, base.as_ref().map(|(r, h)| (*r, h.as_str())));
                        }
                    }
                }
                peers.clear_offers(&self.dir);
                if let Err(error) = self.send_models(server, None, &[], &whole, None) {
                    tracing::warn!(%error, "could not send the global model");
                }
                checkpoint
            }
            Err(error) => {
                // Its next status no longer names it: the scheduler chooses another.
                tracing::warn!(%from, %error, "refused the initial model the scheduler chose");
                peers.fingerprints.remove(from);
                peers.refused_initial.insert(from.to_string());
                if let Some(path) = peers.offers.remove(from) {
                    let _ = std::fs::remove_file(path);
                }
                None
            }
        }
    }

    /// Closes the round: the step, and the new model to `send_to`: as the round's change to
    /// those whose update made the round and that take changes, whole to the rest. What was
    /// applied, and the bytes sent.
    fn close(
        &self,
        server: &mut ParameterServer,
        send_to: &[String],
        peers: &mut Peers,
    ) -> Result<RoundEnd, ServerError> {
        let started = std::time::Instant::now();
        let delta = self.dir.join(MODELS_DIR).join(format!(
            "delta-{}.safetensors",
            server.round().unwrap_or(0) + 1
        ));
        let closed = tokio::task::block_in_place(|| {
            // A change is made only for trainers that take one.
            let changes_wanted = server
                .arrived()
                .iter()
                .any(|(peer, _)| peers.take_changes.contains(peer));
            if changes_wanted {
                server.close_to_file(&delta)
            } else {
                server.close_without_change()
            }
        });
        let closed = match closed {
            // An update's file failed between its check and its addition to the round's sum:
            // the round is given up, its slices trained again, the job goes on.
            Err(error @ hypha_diloco::Error::SumLost(_)) => {
                tracing::warn!(round = ?server.round(), "{error}; the round ends without a change");
                return self.skip(server, send_to, peers);
            }
            // One that fails at the close leaves a model part-stepped (`RoundBroken`): this
            // server ends, and the scheduler restores the next one from its checkpoint.
            closed => closed?,
        };
        tracing::info!(
            round = closed.round,
            trainers = closed.included.len(),
            samples = closed.samples,
            step_ms = started.elapsed().as_millis() as u64,
            "round closed"
        );
        if let Some(why) = &closed.uncompressed {
            tracing::warn!(round = closed.round, %why, "the round's change cannot be compressed; every trainer gets the whole model");
        }
        let delta = closed.delta_bytes.map(|_| delta);
        let (changed, whole): (Vec<String>, Vec<String>) =
            send_to.iter().cloned().partition(|peer| {
                delta.is_some()
                    && peers.take_changes.contains(peer)
                    && closed.included.contains(peer)
            });
        let (to_standby, standby) = self.send_standby(server, delta.as_deref(), peers);
        let sent = self
            .send_models(server, delta.as_deref(), &changed, &whole, standby.as_ref())
            .unwrap_or_else(|error| {
                tracing::warn!(%error, "could not send the new global model");
                0
            });
        for clipped in &closed.clipped {
            tracing::info!(
                round = closed.round,
                peer = %clipped.peer,
                share = clipped.share,
                ratio = ?clipped.ratio,
                tensors = ?clipped.tensors,
                "an update counted for a share of itself (clipped): its norm was beyond the round's"
            );
        }
        let applied = Applied {
            round: closed.round,
            delta_bytes: closed.delta_bytes,
            included: closed.included,
            model_hash: server.model_hash().map(str::to_string),
            largest_norm_ratio: closed.largest_norm_ratio,
            clipped: closed.clipped,
            close_ms: Some(started.elapsed().as_millis() as u64),
            traffic_bytes: None,
            standby_bytes: None,
        };
        Ok(RoundEnd {
            applied,
            sent,
            to_standby,
            standby,
        })
    }

    /// Ends the round without a change, as the scheduler said: what arrived is discarded,
    /// and every trainer in `send_to` gets the model whole, marked for the next round (after
    /// the standby, as at a close).
    fn skip(
        &self,
        server: &mut ParameterServer,
        send_to: &[String],
        peers: &mut Peers,
    ) -> Result<RoundEnd, ServerError> {
        let skipped = server.skip()?;
        tracing::warn!(
            round = skipped.round,
            "round ended without a change: too few of its updates were taken"
        );
        let (to_standby, standby) = self.send_standby(server, None, peers);
        let sent = self
            .send_models(server, None, &[], send_to, standby.as_ref())
            .unwrap_or_else(|error| {
                tracing::warn!(%error, "could not send the global model");
                0
            });
        let applied = Applied {
            round: skipped.round,
            delta_bytes: None,
            included: Vec::new(),
            model_hash: server.model_hash().map(str::to_string),
            largest_norm_ratio: None,
            clipped: Vec::new(),
            close_ms: None,
            traffic_bytes: None,
            standby_bytes: None,
        };
        Ok(RoundEnd {
            applied,
            sent,
            to_standby,
            standby,
        })
    }

    /// Sends the global model of the current round in the background, as the change in the
    /// file `delta` (when there is one) to `changed` and whole to `whole`: a slow trainer does
    /// not hold up the others or the server. `after`: the standby's transfer, which these
    /// wait for (see [`STANDBY_HEAD_START`]).
    fn send_models(
        &self,
        server: &ParameterServer,
        delta: Option<&Path>,
        changed: &[String],
        whole: &[String],
        after: Option<&Ended>,
    ) -> Result<u64, ServerError> {
        let round = server.round().unwrap_or(0);
        self.prune_models(round);
        let mut sent = 0;
        if let Some(delta) = delta.filter(|_| !changed.is_empty()) {
            sent += self.send_file(delta, round, changed, false, after).0;
        }
        if !whole.is_empty() {
            let path = self.whole_model(server)?;
            sent += self.send_file(&path, round, whole, true, after).0;
        }
        Ok(sent)
    }

    /// The file of the current round's whole model, written once per round.
    fn whole_model(&self, server: &ParameterServer) -> Result<PathBuf, ServerError> {
        let round = server.round().unwrap_or(0);
        let path = self
            .dir
            .join(MODELS_DIR)
            .join(format!("round-{round}.safetensors"));
        if !path.exists() {
            // Not fsynced: it is written again from the model if lost.
            tokio::task::block_in_place(|| server.write_model(&path, false))?;
        }
        Ok(path)
    }

    /// Sends the standby (if any) the current global model: as the change in the file
    /// `delta` (the one just made) when there is one, whole otherwise (to it alone, not
    /// published: the transfer ends when the standby holds the file). The bytes sent, and
    /// the transfer's end.
    fn send_standby(
        &self,
        server: &ParameterServer,
        delta: Option<&Path>,
        peers: &mut Peers,
    ) -> (u64, Option<Ended>) {
        let (Some(standby), Some(round)) = (&peers.standby, server.round()) else {
            return (0, None);
        };
        let to = std::slice::from_ref(standby);
        let path = match delta {
            Some(delta) => Ok(delta.to_path_buf()),
            None => {
                // Its request for the whole model, which may cross this, waits for it.
                peers
                    .whole_sent
                    .insert(standby.clone(), (std::time::Instant::now(), Some(round)));
                self.prune_models(round);
                self.whole_model(server)
            }
        };
        match path {
            Ok(path) => {
                let (sent, ended) = self.send_file(&path, round, to, false, None);
                (sent, Some(ended))
            }
            Err(error) => {
                tracing::warn!(%error, "could not send the standby the global model");
                (0, None)
            }
        }
    }

    /// Removes the models and changes of rounds before the last: nobody is sent them again
    /// (a transfer that still reads one holds it open), and a large model's would fill the
    /// disk round by round.
    fn prune_models(&self, round: u64) {
        let Ok(entries) = std::fs::read_dir(self.dir.join(MODELS_DIR)) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let old = name
                .to_str()
                .and_then(|n| n.strip_suffix(".safetensors"))
                .and_then(|n| {
                    n.strip_prefix("round-")
                        .or_else(|| n.strip_prefix("delta-"))
                })
                .and_then(|r| r.parse::<u64>().ok())
                .is_some_and(|r| r + 1 < round);
            if old {
                self.publisher.withdraw(&entry.path());
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }

    /// Sends the file at `path` to `peers`, each in a task of its own. A whole model
    /// (`publish`) of [`PUBLISH_FROM_BYTES`] or more is published instead
    /// ([`ModelPublisher`]): the trainers' workers fetch it from this one and from each
    /// other, so that trainers joining together do not each take a model's worth of this
    /// server's link.
    ///
    /// Transfers of a trainer's model wait for `after` (the standby's) to end first, for at
    /// most [`STANDBY_HEAD_START`]. Returns the bytes this puts on the server's link, and
    /// the end of the transfers started (arrived or given up).
    fn send_file(
        &self,
        path: &Path,
        round: u64,
        peers: &[String],
        publish: bool,
        after: Option<&Ended>,
    ) -> (u64, Ended) {
        let name = path
            .file_name()
            .map(|name| name.to_string_lossy().into_owned())
            .unwrap_or_default();
        let size = path.metadata().map(|m| m.len()).unwrap_or(0);
        let published = if publish && size >= PUBLISH_FROM_BYTES {
            // Those told together wait for each other before they read from this server.
            self.publisher.publish(path).map(|published| Published {
                fetchers: peers.len(),
                ..published
            })
        } else {
            None
        };
        // Hashed once for every trainer's resumable transfer, not once a trainer.
        let sha256 = (published.is_none()
            && size >= hypha_transfer::RESUMABLE_FROM_BYTES
            && peers.len() > 1)
            .then(|| {
                tokio::task::block_in_place(|| {
                    std::fs::File::open(path)
                        .and_then(|file| hypha_transfer::sha256_of(&file, size))
                        .ok()
                })
            })
            .flatten();
        // A published file leaves this server about once, however many fetch it.
        let sent = if published.is_some() {
            size
        } else {
            size * peers.len() as u64
        };
        let (ends, ended) = tokio::sync::watch::channel(false);
        let ends = Arc::new(EndsOnDrop(ends));
        for peer in peers {
            let Ok(peer) = peer.parse::<PeerId>() else {
                tracing::warn!(%peer, "the scheduler named a trainer that is not a peer ID");
                continue;
            };
            let network = self.network.clone();
            let path = path.to_path_buf();
            let header = Header {
                task: self.task.clone(),
                name: name.clone(),
                size,
                published: published.clone(),
                sha256: sha256.clone(),
            };
            let (ends, after) = (ends.clone(), after.cloned());
            // Reports through `ended` as it ends (or is aborted with the job).
            self.sends.spawn(async move {
                let _ends = ends;
                if let Some(mut first) = after {
                    let _ =
                        tokio::time::timeout(STANDBY_HEAD_START, first.wait_for(|ended| *ended))
                            .await;
                }
                let sent = match (&header.published, std::fs::File::open(&path)) {
                    (Some(_), _) => hypha_transfer::send_published(
                        &network,
                        peer,
                        &header,
                        transfer::SEND_PATIENCE,
                    )
                    .await
                    .map_err(|e| e.to_string()),
                    (None, Ok(file)) => {
                        transfer::send(&network, peer, &header, file, transfer::SEND_PATIENCE)
                            .await
                            .map(drop)
                            .map_err(|e| e.to_string())
                    }
                    (None, Err(e)) => Err(e.to_string()),
                };
                if let Err(error) = sent {
                    tracing::warn!(%peer, round, %error, "a trainer did not take the global model");
                }
            });
        }
        (sent, ended)
    }

    /// Waits for the scheduler's checkpoint of `round` and makes it this server's.
    async fn restore(&self, round: u64) -> Result<(), ServerError> {
        let scheduler = HashSet::from([self.scheduler]);
        let taken = async {
            loop {
                let arrived = self.inbox.next(&scheduler).await;
                let delivered = self
                    .inbox
                    .deliver(&arrived, Path::new("restore"))
                    .map_err(|e| e.to_string())?;
                let path = self.dir.join(delivered);
                let metadata = std::fs::File::open(&path)
                    .map_err(|e| e.to_string())
                    .and_then(|mut file| {
                        hypha_diloco::read_metadata(&mut file).map_err(|e| e.to_string())
                    });
                let kind = metadata
                    .as_ref()
                    .ok()
                    .and_then(|m| m.get(meta::KIND).cloned());
                let its_round = metadata.as_ref().ok().and_then(|m| round_of(m).ok());
                if kind.as_deref() == Some(meta::KIND_CHECKPOINT) && its_round == Some(round) {
                    std::fs::rename(&path, self.dir.join(CHECKPOINT)).map_err(|e| e.to_string())?;
                    return Ok::<(), String>(());
                }
                tracing::warn!(
                    ?kind,
                    ?its_round,
                    "the scheduler sent a file that is not the checkpoint asked for; ignored"
                );
                let _ = std::fs::remove_file(&path);
            }
        };
        match tokio::time::timeout(CHECKPOINT_PATIENCE, taken).await {
            Ok(Ok(())) => {
                tracing::info!(round, "restored from the scheduler's checkpoint");
                Ok(())
            }
            Ok(Err(reason)) => Err(ServerError::NoCheckpoint { round, reason }),
            Err(_) => Err(ServerError::NoCheckpoint {
                round,
                reason: "nothing arrived".into(),
            }),
        }
    }
}

/// Who the server hears from, as far as the scheduler said.
#[derive(Debug, Default)]
struct Peers {
    /// The peers whose pseudo-gradients it takes.
    trainers: std::collections::BTreeSet<String>,
    /// Initial models offered while the server has none, by peer: the files in
    /// [`OFFERS_DIR`].
    offers: std::collections::BTreeMap<String, PathBuf>,
    /// Trainers whose last pseudo-gradient said they take the model's changes.
    take_changes: std::collections::BTreeSet<String>,
    /// When each peer was last sent the whole model on its own offer or request, and of
    /// which round.
    whole_sent: std::collections::HashMap<String, (std::time::Instant, Option<u64>)>,
    /// The standby that gets every round's model, as the scheduler named it.
    standby: Option<String>,
    /// When each peer's offer by fingerprint was last answered.
    answered: std::collections::HashMap<String, std::time::Instant>,
    /// Peers the scheduler had not named a trainer when they offered their model (by
    /// fingerprint: the round and fingerprint they hold), answered once it names them.
    deferred: std::collections::BTreeMap<String, Option<(u64, String)>>,
    /// While the server has no model: the model each offerer holds, by fingerprint (offered
    /// so, or named on its whole offer), with its name for the offer.
    fingerprints: std::collections::BTreeMap<String, Fingerprint>,
    /// The offerer last asked for its model whole (the scheduler names it in every answer
    /// until it is adopted), and when.
    requested: Option<(String, std::time::Instant)>,
    /// Offerers whose initial model was refused: their offers are not held again, so that the
    /// scheduler names another.
    refused_initial: std::collections::BTreeSet<String>,
}

/// A model an offerer holds, and the offer's name its answer echoes.
#[derive(Debug, Clone)]
struct Fingerprint {
    round: u64,
    hash: String,
    offer: Option<String>,
}

impl Peers {
    /// Keeps `from`'s initial model (the file at `path`) until the scheduler names one.
    fn hold_offer(&mut self, dir: &Path, from: &str, path: &Path) {
        if self.refused_initial.contains(from) {
            let _ = std::fs::remove_file(path);
            return;
        }
        if self.offers.len() >= MAX_OFFERS && !self.offers.contains_key(from) {
            tracing::warn!(%from, "{MAX_OFFERS} initial models are waiting already: refused");
            let _ = std::fs::remove_file(path);
            return;
        }
        // Peer ids are base58: a file name as they are.
        let held = dir.join(OFFERS_DIR).join(format!("{from}.safetensors"));
        let moved = std::fs::create_dir_all(dir.join(OFFERS_DIR))
            .and_then(|()| std::fs::rename(path, &held));
        match moved {
            Ok(()) => {
                tracing::info!(%from, "holding an initial model until the scheduler names the one to adopt");
                self.offers.insert(from.to_string(), held);
            }
            Err(error) => {
                tracing::warn!(%from, %error, "could not keep an initial model");
                let _ = std::fs::remove_file(path);
            }
        }
    }

    /// Answers `from`'s offer with the global model once the scheduler names it a trainer:
    /// the model goes to the job's trainers and its standby only, and a trainer the
    /// scheduler names a moment after it is told to join offers before the server hears.
    /// At most [`MAX_OFFERS`] wait; more are dropped (the peer offers again).
    fn defer(&mut self, from: &str, offered: Option<(u64, &str)>) {
        if self.deferred.len() >= MAX_OFFERS && !self.deferred.contains_key(from) {
            tracing::debug!(%from, "{MAX_OFFERS} offers wait for their peers to be named already: dropped");
            return;
        }
        tracing::debug!(%from, "an offer from a peer the scheduler has not named a trainer: answered once it does");
        let offered = offered.map(|(round, hash)| (round, hash.to_string()));
        self.deferred.insert(from.to_string(), offered);
    }

    /// Whether the scheduler named `peer` a trainer of the job or its standby.
    fn named(&self, peer: &str) -> bool {
        self.trainers.contains(peer) || self.standby.as_deref() == Some(peer)
    }

    /// The deferred offers of peers the scheduler has named since: no longer deferred.
    fn named_since_they_offered(&mut self) -> Vec<(String, Option<(u64, String)>)> {
        let named: Vec<String> = (self.deferred.keys())
            .filter(|peer| self.named(peer))
            .cloned()
            .collect();
        (named.into_iter())
            .filter_map(|peer| self.deferred.remove_entry(&peer))
            .collect()
    }

    /// Keeps `from`'s offer of the model `offered` (round, fingerprint) named `offer` until
    /// the scheduler names the one to adopt; at most [`MAX_FINGERPRINTS`] offerers, none whose
    /// model was refused.
    fn hold_fingerprint(&mut self, from: &str, offered: (u64, &str), offer: Option<&str>) {
        if self.refused_initial.contains(from) {
            return;
        }
        if self.fingerprints.len() >= MAX_FINGERPRINTS && !self.fingerprints.contains_key(from) {
            tracing::warn!(%from, "{MAX_FINGERPRINTS} offers by fingerprint are waiting already: refused");
            return;
        }
        self.fingerprints.insert(
            from.to_string(),
            Fingerprint {
                round: offered.0,
                hash: offered.1.to_string(),
                offer: offer.map(str::to_string),
            },
        );
    }

    /// The peers that offered an initial model, whole or by fingerprint.
    fn offered(&self) -> Vec<String> {
        let mut offered: Vec<String> = self.offers.keys().cloned().collect();
        offered.extend(
            (self.fingerprints.keys())
                .filter(|peer| !self.offers.contains_key(*peer))
                .cloned(),
        );
        offered
    }

    fn clear_offers(&mut self, dir: &Path) {
        self.offers.clear();
        self.fingerprints.clear();
        let _ = std::fs::remove_dir_all(dir.join(OFFERS_DIR));
    }
}

/// The most bytes a pseudo-gradient of the server's model may take: an update compressed with
/// the job's `codec`, or one in f32, since a trainer that does not compress (the Python SDK's
/// loop in an int8 job) is read like any other. `None` before there is a model.
fn update_limit(server: &ParameterServer, codec: Codec) -> Option<u64> {
    server
        .max_update_bytes(codec)
        .max(server.max_update_bytes(Codec::None))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use hypha_diloco::{Tensor, Tensors};

    use super::*;

    /// A regression: an int8 job's limit refused every f32 update of a model of more than
    /// about 20,000 values (a numpy trainer beside Rust ones lost each round it trained).
    #[test]
    fn an_f32_update_fits_the_limit_of_an_int8_job_and_four_times_one_does_not() {
        let tensors = |n: usize| {
            let w = Tensor {
                shape: vec![n],
                values: vec![0.25; n],
                dtype: safetensors::Dtype::F32,
            };
            Tensors([("w".to_string(), w)].into())
                .to_bytes(&Metadata::new())
                .unwrap()
        };
        let mut server = ParameterServer::new(OuterOptimizer::new(0.7, 0.9));
        server.offer(&tensors(100_000)).unwrap();
        let limit = update_limit(&server, Codec::Int8).unwrap();
        assert!(tensors(100_000).len() as u64 <= limit, "{limit}");
        assert!(tensors(400_000).len() as u64 > limit, "{limit}");
    }
}
