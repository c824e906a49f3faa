//! A standby parameter server (`[diloco] standby = true`): a server's job that follows the
//! one serving until the scheduler says to take over.
//!
//! It holds the global model of the last round it heard of, built from the serving server's
//! changes as trainers build theirs (checked against the fingerprint each change carries), or
//! taken whole when it has none or missed one, and the newest checkpoint the scheduler
//! forwards it, for its momentum. It reports both to the scheduler every [`REPORT_EVERY`];
//! told to serve, it goes on as the parameter server from the round of its model
//! ([`ParameterServer::take_over`](hypha_diloco::server::ParameterServer::take_over)): the
//! trainers lose no round and nobody sends it a checkpoint at the failover. Its memory is a
//! chunk of the model: both live in files in the job's directory until it takes over. It
//! keeps the last change it took where a server keeps its own (`models/delta-{round}`): a
//! trainer still one round behind at the takeover is sent that change, not the whole model.
//! It keeps the model before the newest too ([`STANDBY_PREVIOUS`]): the server says it
//! applied a round once the standby holds it, and when it is lost in between, the standby
//! serves from the round the scheduler knows. It says which model it is building before it
//! builds it (seconds for a model of gigabytes): a server lost meanwhile is replaced at that
//! round, and the standby serves it once built.

use std::{
    collections::HashSet,
    path::{Path, PathBuf},
    time::Instant,
};

use hypha_diloco::{Metadata, Tensors, Update, file::FileSource, server::round_of};
use hypha_messages::{
    Request, Response,
    diloco::{ModelOfRound, StandbyOrder, StandbyStatus, Status, meta},
};
use hypha_network::PeerId;

use super::{CHECKPOINT, MODELS_DIR, REPORT_EVERY, ServerJob, WHOLE_MODEL_EVERY};
use crate::bridge::transfer::{self, Header};

/// The model a standby holds, in the job's directory.
pub const STANDBY_MODEL: &str = "standby-model.safetensors";
/// The model it held before that one, until the next comes.
pub const STANDBY_PREVIOUS: &str = "standby-previous.safetensors";

/// What became of a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Taken {
    Yes,
    Not,
    /// A change that is not of the model held.
    Unfit,
}

/// Whether the change whose file says `metadata` is of the model `held`.
fn changes(metadata: &Metadata, held: Option<&Held>) -> bool {
    let base = (
        metadata.get(meta::BASE_ROUND).map(String::as_str),
        metadata.get(meta::BASE_HASH),
    );
    held.is_some_and(|held| base == (Some(held.round.to_string().as_str()), Some(&held.hash)))
}

/// What became of a file received.
enum Received {
    Done(Taken),
    /// A model or a change of the server's, to be built.
    Build(Pending),
}

/// A model or a change of the server's, received and not built yet.
#[derive(Debug)]
struct Pending {
    path: PathBuf,
    metadata: Metadata,
    round: u64,
}

/// The model a standby holds: of which round, with which fingerprint.
#[derive(Debug, Clone)]
struct Held {
    round: u64,
    hash: String,
}

/// What a standby follows, between files.
#[derive(Debug, Default)]
struct Following {
    /// The server it takes models from, as the scheduler named it.
    server: Option<PeerId>,
    model: Option<Held>,
    /// The model held before `model` (in [`STANDBY_PREVIOUS`]).
    previous: Option<Held>,
    /// The round of the checkpoint it holds.
    checkpoint: Option<u64>,
    /// When it last asked the server for the whole model.
    asked: Option<Instant>,
}

impl ServerJob {
    /// Follows the serving server until the scheduler says to serve (the model's file is
    /// returned, the checkpoint beside it in [`CHECKPOINT`]) or that training is over
    /// (`None`); an error when told to serve a round other than the one it holds.
    pub(super) async fn stand_by(&self) -> Result<Option<PathBuf>, String> {
        let mut following = Following::default();
        let mut report = tokio::time::interval(REPORT_EVERY);
        report.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Files from anyone: those not from the scheduler or the server are removed, so that
        // no other peer of the task can fill the inbox with what is never taken.
        let anyone = HashSet::new();
        // A model received and not built yet: built once the scheduler heard it is being
        // built, so that a server lost meanwhile is replaced at its round.
        let mut pending: Option<Pending> = None;
        loop {
            tokio::select! {
                arrived = self.inbox.next(&anyone) => {
                    match self.receive(&arrived, &mut following) {
                        Received::Build(model) => pending = Some(model),
                        Received::Done(Taken::Unfit) => self.ask_whole(&mut following).await,
                        Received::Done(_) => {}
                    }
                }
                _ = report.tick() => {}
            }
            let status = StandbyStatus {
                round: following.model.as_ref().map(|m| m.round),
                model_hash: following.model.as_ref().map(|m| m.hash.clone()),
                checkpoint: following.checkpoint,
                following: following.server.map(|p| p.to_string()),
                previous: following.previous.as_ref().map(|m| ModelOfRound {
                    round: m.round,
                    model_hash: m.hash.clone(),
                }),
                building: pending.as_ref().and_then(|model| {
                    Some(ModelOfRound {
                        round: model.round,
                        model_hash: model.metadata.get(meta::MODEL_HASH)?.clone(),
                    })
                }),
            };
            match self.ask(Status::Standby(status)).await {
                Some(StandbyOrder::Follow { server }) => match server.parse() {
                    Ok(server) => {
                        // Another server's models (one restored from an older checkpoint)
                        // are not this one's: its whole model first.
                        following.server = Some(server);
                        following.model = None;
                        following.previous = None;
                        following.asked = None;
                        if let Some(model) = pending.take() {
                            let _ = std::fs::remove_file(&model.path);
                        }
                        self.ask_whole(&mut following).await;
                    }
                    Err(_) => {
                        tracing::warn!(%server, "the scheduler named a server that is not a peer ID")
                    }
                },
                Some(StandbyOrder::Serve { round }) => {
                    // Told to serve the round being built: once it is. Another round's model
                    // is not built (that would take the place of the one before).
                    if let Some(model) = pending.take() {
                        if model.round == round {
                            self.build(model, &mut following).map_err(|reason| {
                                format!("could not build the model of round {round} to take over from: {reason}")
                            })?;
                        } else {
                            let _ = std::fs::remove_file(&model.path);
                        }
                    }
                    let of = |held: &Option<Held>| held.as_ref().map(|m| m.round);
                    let model = if of(&following.model) == Some(round) {
                        STANDBY_MODEL
                    } else if of(&following.previous) == Some(round) {
                        STANDBY_PREVIOUS
                    } else {
                        return Err(format!(
                            "told to take over at round {round}, holding the models of {:?} and {:?}",
                            of(&following.model),
                            of(&following.previous)
                        ));
                    };
                    tracing::info!(round, checkpoint = ?following.checkpoint, "the server is lost: taking over");
                    return Ok(Some(self.dir.join(model)));
                }
                Some(StandbyOrder::Done) => {
                    if let Some(model) = pending.take() {
                        let _ = std::fs::remove_file(&model.path);
                    }
                    return Ok(None);
                }
                Some(StandbyOrder::Wait) | None => {}
            }
            if let Some(model) = pending.take()
                && let Err(reason) = self.build(model, &mut following)
            {
                // The next changes will not fit either, and the server sends the whole model
                // only when it learns of the standby or is asked.
                tracing::info!(%reason, "a model not taken; asking for the whole model");
                self.ask_whole(&mut following).await;
            }
        }
    }

    /// Receives one file: a checkpoint from the scheduler is taken; a model or a change from
    /// the server of a round newer than the model held is to be built. Whatever is not
    /// taken is removed.
    fn receive(&self, arrived: &transfer::Arrived, following: &mut Following) -> Received {
        let from = arrived.from;
        let path = match self.inbox.deliver(arrived, Path::new("received")) {
            Ok(path) => self.dir.join(path),
            Err(error) => {
                tracing::warn!(%from, %error, "could not take a file");
                return Received::Done(Taken::Not);
            }
        };
        // Only the scheduler's checkpoints and the server's models are taken: anyone else's
        // file goes unread, however large its header.
        if from != self.scheduler && Some(from) != following.server {
            tracing::debug!(%from, "a file from a peer that is neither the scheduler nor the server: not read");
            let _ = std::fs::remove_file(&path);
            return Received::Done(Taken::Not);
        }
        let metadata = std::fs::File::open(&path)
            .ok()
            .and_then(|mut file| hypha_diloco::read_metadata(&mut file).ok())
            .unwrap_or_default();
        let round = round_of(&metadata).ok();
        let kind = metadata.get(meta::KIND).map(String::as_str);
        let taken = match (kind, round) {
            (Some(meta::KIND_CHECKPOINT), Some(round)) if from == self.scheduler => {
                if following.checkpoint.is_some_and(|held| held >= round) {
                    Taken::Not
                } else {
                    match std::fs::rename(&path, self.dir.join(CHECKPOINT)) {
                        Ok(()) => {
                            following.checkpoint = Some(round);
                            Taken::Yes
                        }
                        Err(error) => {
                            tracing::warn!(%error, "could not keep the checkpoint");
                            Taken::Not
                        }
                    }
                }
            }
            (Some(meta::KIND_MODEL | meta::KIND_MODEL_DELTA), Some(round))
                if Some(from) == following.server
                    && following.model.as_ref().is_none_or(|m| m.round < round) =>
            {
                // Said to be built only when it can be: a change of another model is not.
                if kind == Some(meta::KIND_MODEL_DELTA)
                    && !changes(&metadata, following.model.as_ref())
                {
                    tracing::info!(
                        round,
                        "a change of a model this standby does not hold; asking for the whole model"
                    );
                    Taken::Unfit
                } else {
                    return Received::Build(Pending {
                        path,
                        metadata,
                        round,
                    });
                }
            }
            _ => {
                tracing::debug!(?kind, ?round, %from, "a file not taken");
                Taken::Not
            }
        };
        let _ = std::fs::remove_file(&path);
        Received::Done(taken)
    }

    /// Builds the model `pending` leads to and holds it; why not where it could not.
    fn build(&self, pending: Pending, following: &mut Following) -> Result<(), String> {
        let Pending {
            path,
            metadata,
            round,
        } = pending;
        let built = tokio::task::block_in_place(|| {
            self.build_model(&path, &metadata, round, following.model.as_ref())
        });
        let _ = std::fs::remove_file(&path);
        let held = built?;
        tracing::info!(round, "standby: holding the global model");
        following.previous = following.model.replace(held);
        Ok(())
    }

    /// The model of `round` from the file at `path`: whole, or the change from the model
    /// `held`; checked against the fingerprint the file carries and made the one held.
    fn build_model(
        &self,
        path: &Path,
        metadata: &Metadata,
        round: u64,
        held: Option<&Held>,
    ) -> Result<Held, String> {
        let model = self.dir.join(STANDBY_MODEL);
        let next = self.dir.join("standby-next.safetensors");
        let marked = Metadata::from([
            (meta::KIND.to_string(), meta::KIND_MODEL.to_string()),
            (meta::ROUND.to_string(), round.to_string()),
        ]);
        let hash = match metadata.get(meta::KIND).map(String::as_str) {
            Some(meta::KIND_MODEL_DELTA) => {
                if !changes(metadata, held) {
                    return Err(format!(
                        "the change to round {round} is not from the model held"
                    ));
                }
                let change = FileSource::open(path).map_err(|e| e.to_string())?;
                let base = FileSource::open(&model).map_err(|e| e.to_string())?;
                Update::from_source(&change)
                    .and_then(|update| update.add_to_file(&base, &next, marked))
                    .map_err(|e| e.to_string())?
            }
            // A whole model's file says its round already: it is kept as it came.
            _ => {
                let whole = FileSource::open(path).map_err(|e| e.to_string())?;
                let hash = Tensors::fingerprint_of(&whole).map_err(|e| e.to_string())?;
                std::fs::rename(path, &next).map_err(|e| e.to_string())?;
                hash
            }
        };
        if metadata.get(meta::MODEL_HASH) != Some(&hash) {
            let _ = std::fs::remove_file(&next);
            return Err(format!(
                "the model of round {round} is not the one its server fingerprinted"
            ));
        }
        if held.is_some() {
            std::fs::rename(&model, self.dir.join(STANDBY_PREVIOUS)).map_err(|e| e.to_string())?;
        }
        std::fs::rename(&next, &model).map_err(|e| e.to_string())?;
        if metadata.get(meta::KIND).map(String::as_str) == Some(meta::KIND_MODEL_DELTA) {
            self.keep_change(path, round);
        }
        Ok(Held { round, hash })
    }

    /// Keeps the change in the file at `path`, which led to the model of `round`, as the
    /// only one held.
    fn keep_change(&self, path: &Path, round: u64) {
        let models = self.dir.join(MODELS_DIR);
        let _ = std::fs::remove_dir_all(&models);
        let kept = std::fs::create_dir_all(&models).and_then(|()| {
            std::fs::rename(path, models.join(format!("delta-{round}.safetensors")))
        });
        if let Err(error) = kept {
            tracing::debug!(%error, "could not keep the change taken");
        }
    }

    /// Asks the server for its whole model, at most every [`WHOLE_MODEL_EVERY`].
    async fn ask_whole(&self, following: &mut Following) {
        let Some(server) = following.server else {
            return;
        };
        if following
            .asked
            .is_some_and(|asked| asked.elapsed() < WHOLE_MODEL_EVERY)
        {
            return;
        }
        following.asked = Some(Instant::now());
        let path = self.dir.join("model-request.safetensors");
        let metadata =
            Metadata::from([(meta::KIND.to_string(), meta::KIND_MODEL_REQUEST.to_string())]);
        let sent = async {
            Tensors::default()
                .save(&path, &metadata)
                .map_err(|e| e.to_string())?;
            let file = std::fs::File::open(&path).map_err(|e| e.to_string())?;
            let header = Header {
                task: self.task.clone(),
                name: "model-request.safetensors".to_string(),
                size: file.metadata().map_err(|e| e.to_string())?.len(),
                published: None,
                sha256: None,
            };
            transfer::send(
                &self.network,
                server,
                &header,
                file,
                transfer::SEND_PATIENCE,
            )
            .await
            .map(drop)
            .map_err(|e| e.to_string())
        };
        if let Err(error) = sent.await {
            tracing::debug!(%server, %error, "could not ask the server for its model");
        }
    }

    /// Sends `status` to the scheduler; its answer, or `None` when it could not be asked.
    pub(super) async fn ask<O: serde::de::DeserializeOwned>(&self, status: Status) -> Option<O> {
        let payload = serde_json::to_string(&status).ok()?;
        let request = Request::ExecutorStatus {
            job: self.job.clone(),
            payload,
        };
        match self.network.request(self.scheduler, request).await {
            Ok(Response::ExecutorStatus { payload }) => match serde_json::from_str(&payload) {
                Ok(order) => Some(order),
                Err(error) => {
                    tracing::warn!(%error, %payload, "the scheduler's answer is not an order of this job's");
                    None
                }
            },
            Ok(other) => {
                tracing::warn!(answer = ?other, "the scheduler did not take the status");
                None
            }
            Err(error) => {
                tracing::debug!(%error, "the scheduler is unreachable; trying again");
                None
            }
        }
    }
}
