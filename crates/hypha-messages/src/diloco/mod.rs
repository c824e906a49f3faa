//! DiLoCo rounds: what trainers and the parameter server tell the scheduler, and what it
//! answers.
//!
//! Both travel as the JSON payloads of [`Request::ExecutorStatus`](crate::Request) and its
//! answer: a trainer (a process executor) sends a [`Status::Trainer`] through the job bridge's
//! `POST /status/send` and reads the [`TrainerOrder`] in the response; the built-in parameter
//! server sends a [`Status::ParameterServer`] and gets a [`ServerOrder`].
//!
//! ```text
//! trainer            scheduler                 parameter server
//!   │ status (no round) ─▶│                            │
//!   │◀─ Join{ps} ─────────│                            │
//!   │ model_held (round 0, fingerprint of its initial θ) ▶│ holds the offer
//!   │                    │◀─ status (offered) ───────────│
//!   │                    │── Adopt{one trainer} ────────▶│
//!   │◀──────────────── model_request (to that trainer alone) ──│
//!   │ model (kind=model, its initial θ, same fingerprint) ─▶│ adopts it
//!   │◀──── model_held (to each trainer holding that θ), or global θ whole ──│
//!   │ status (round r, batches, batch_ms, loss) ─▶│    │
//!   │◀─ Train{round r, batches: target} ───────────│   │  … until batches ≥ target
//!   │ POST /data/consumed (slices, round r)        │   │
//!   │ pseudo-gradient (kind=pseudo_gradient, round r, samples) ─▶│
//!   │                    │◀─ status (arrived) ───────────│
//!   │                    │── Close{round r, send_to} ───▶│ weighted mean, Nesterov step,
//!   │◀──────────────────────── global θ (round r+1) ─────────────│ checkpoint
//!   │                    │◀─ status (applied r, included) ─│ → ledger: round r of each
//!   │                    │                               │   included trainer is USED
//! ```
//!
//! Whenever the trainers a server's status names are not the job's, the answer is
//! `Trainers{peers}` instead: the server takes pseudo-gradients only from those.
//!
//! Files between trainers and the parameter server go over the resource protocol
//! (`/resources/send`, `/resources/fetch` with `{"type": "Peers"}`); what a file is travels in
//! its SafeTensors metadata under the [`meta`] keys. What the trainers and the server are
//! configured with is [`config`].

pub mod config;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

pub use config::{Compression, InnerOptimizer, OuterOptimizer, ServerConfig, TrainerConfig};

/// SafeTensors metadata keys (`__metadata__`) on the files of a DiLoCo job.
pub mod meta {
    /// [`KIND_MODEL`] or [`KIND_PSEUDO_GRADIENT`].
    pub const KIND: &str = "hypha.kind";
    /// A model's round is the round it is the starting point of; a pseudo-gradient's is the
    /// round it was trained in.
    pub const ROUND: &str = "hypha.round";
    /// The samples a pseudo-gradient was trained on: its weight in the mean.
    pub const SAMPLES: &str = "hypha.samples";
    pub const KIND_MODEL: &str = "model";
    /// The change of the global model from round `BASE_ROUND` to `ROUND`, compressed with
    /// the job's codec (`hypha_diloco::codec`'s wire format): what the parameter server sends
    /// a trainer that holds the round before, instead of the whole model.
    pub const KIND_MODEL_DELTA: &str = "model_delta";
    /// A trainer asks for the whole global model (its copy does not fit the change it got):
    /// a file with no tensors.
    pub const KIND_MODEL_REQUEST: &str = "model_request";
    /// A file with no tensors that names a global model by its `ROUND` and `MODEL_HASH`. From
    /// a trainer that joins a parameter server: the model it holds (its initial model drawn
    /// from the job's seed, round 0, or a model of an earlier server), instead of the model
    /// itself (which may be gigabytes). From the server, the answer when it holds that very
    /// model: the trainer starts its round from its own copy. A server with no model holds
    /// the offer until the scheduler names the one to adopt, and answers the named trainer
    /// with a [`KIND_MODEL_REQUEST`]: it sends the model whole, naming the same `MODEL_HASH`
    /// and `OFFER`, and is answered `model_held` too once it is adopted.
    pub const KIND_MODEL_HELD: &str = "model_held";
    /// On a [`KIND_MODEL_HELD`] offer (and the whole model sent on request after it): the
    /// trainer's name for this offer, echoed in the server's answer, so that an answer to an
    /// earlier offer is not taken for this one's.
    pub const OFFER: &str = "hypha.offer";
    /// The fingerprint of the global model a model or a change leads to
    /// (`hypha_diloco::Tensors::digest`).
    pub const MODEL_HASH: &str = "hypha.model_hash";
    /// A change's base: the round and the fingerprint of the model it applies to.
    pub const BASE_ROUND: &str = "hypha.base_round";
    pub const BASE_HASH: &str = "hypha.base_hash";
    /// On a pseudo-gradient: the file kinds its sender takes besides whole models
    /// ([`KIND_MODEL_DELTA`]); a sender without it gets whole models.
    pub const ACCEPTS: &str = "hypha.accepts";
    pub const KIND_PSEUDO_GRADIENT: &str = "pseudo_gradient";
    /// The parameter server's state: model and outer momentum, its round the next one to
    /// train.
    pub const KIND_CHECKPOINT: &str = "checkpoint";
}

/// A DiLoCo status, as sent to the scheduler.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "diloco", rename_all = "snake_case")]
pub enum Status {
    Trainer(TrainerStatus),
    ParameterServer(ServerStatus),
    Standby(StandbyStatus),
}

/// Where a trainer stands in its round.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TrainerStatus {
    /// The round it trains, that is the round of the global model it holds; `None` before it
    /// holds one.
    #[serde(default)]
    pub round: Option<u64>,
    /// Batches and samples trained so far in this round.
    #[serde(default)]
    pub batches: u64,
    #[serde(default)]
    pub samples: u64,
    /// Mean wall time of its recent batches (data wait included): the scheduler's measure of
    /// its speed.
    #[serde(default)]
    pub batch_ms: Option<f64>,
    /// How long its pseudo-gradients took to reach the parameter server lately (a moving
    /// average of the sends, in ms): the scheduler has a trainer on a slow link stop its
    /// inner steps that much earlier, so that every update arrives together.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub send_ms: Option<f64>,
    /// Wall time it spent in inner steps since it started, in ms (batches read and trained;
    /// not waiting for models, slices or sends): its utilisation over an interval is the
    /// growth of this over the interval's length.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub train_ms: u64,
    /// Batches it trained ahead, into the next round, while its update was on its way
    /// (`[diloco] overlap`): they count for the round after `round`.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub ahead_batches: u64,
    /// Mean training loss of this round's batches so far.
    #[serde(default)]
    pub loss: Option<f64>,
    /// Its data reference answered that every slice is used or taken.
    #[serde(default)]
    pub data_done: bool,
    /// The fingerprint of the global model it holds (`hypha_diloco::Tensors::digest`),
    /// checked against the parameter server's when it took it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_hash: Option<String>,
    /// Global models it built from broadcast changes rather than took whole, so far.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub deltas_applied: u64,
    /// Its score of a global model on the job's held-out data, once it measured it (an
    /// order said `evaluate`), in the next status it sends.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval: Option<Evaluation>,
    /// It can score global models on the job's held-out data (`[data] eval`): the scheduler
    /// asks only such trainers to.
    #[serde(default, skip_serializing_if = "is_false")]
    pub evaluates: bool,
    /// Whether it has begun to send the round's pseudo-gradient (it trains no more batches
    /// of the round). `Some(false)` lets a trainer whose parameter server was replaced by one
    /// holding the model it trains from go on with its round; a trainer that does not say
    /// starts the round over.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub syncing: Option<bool>,
}

/// The longest `model_hash` a status may carry: `blake3:` and 64 hex digits, with room.
pub const MAX_HASH_LEN: usize = 128;

impl TrainerStatus {
    /// Why a scheduler cannot take this status (a hostile or broken trainer's: a fingerprint
    /// of a megabyte, a loss that is not a number); `None` when it can.
    pub fn problem(&self) -> Option<String> {
        if let Some(hash) = &self.model_hash
            && hash.len() > MAX_HASH_LEN
        {
            return Some(format!(
                "a model_hash of {} bytes (at most {MAX_HASH_LEN})",
                hash.len()
            ));
        }
        let numbers = [
            ("loss", self.loss),
            ("batch_ms", self.batch_ms),
            ("send_ms", self.send_ms),
            ("eval.loss", self.eval.map(|e| e.loss)),
            ("eval.accuracy", self.eval.and_then(|e| e.accuracy)),
        ];
        numbers
            .into_iter()
            .find(|(_, value)| value.is_some_and(|v| !v.is_finite()))
            .map(|(key, value)| format!("{key} = {value:?} is not a finite number"))
    }
}

/// An evaluation of a global model on the job's held-out data.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Evaluation {
    /// The round the model is the starting point of (the model after round `round − 1`).
    pub round: u64,
    /// Mean loss per scored target (a sample, or a token of a sequence), in nats.
    pub loss: f64,
    /// Targets scored.
    pub scored: u64,
    /// For classifiers: the fraction of correct predictions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accuracy: Option<f64>,
}

/// The scheduler's answer to a trainer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum TrainerOrder {
    /// Offer the model you hold to the parameter server by its fingerprint (sending it whole
    /// if the server asks), then take the global model it answers with.
    Join { parameter_server: String },
    /// Train round `round` until `batches` batches are done in it, then send the
    /// pseudo-gradient. A target at or below the batches already done means: sync now.
    Train {
        round: u64,
        batches: u64,
        parameter_server: String,
        /// Score the global model of round `round + 1` on the job's held-out data as soon as
        /// it arrives, and report it (`eval`) before training on it.
        #[serde(default, skip_serializing_if = "is_false")]
        evaluate: bool,
    },
    /// Nothing to do yet (the parameter server is not there); ask again after `retry_ms`.
    /// With `evaluate`: first score the global model you hold on the job's held-out data,
    /// unless you did, and report it (the run's last model, once training is over).
    Wait {
        retry_ms: u64,
        #[serde(default, skip_serializing_if = "is_false")]
        evaluate: bool,
    },
    /// Training is over: exit successfully.
    Done,
}

impl TrainerOrder {
    /// Ask again after `retry_ms`, nothing else to do.
    pub fn wait(retry_ms: u64) -> Self {
        Self::Wait {
            retry_ms,
            evaluate: false,
        }
    }
}

/// What the parameter server holds.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ServerStatus {
    /// The round it collects pseudo-gradients for; `None` before it holds a model.
    #[serde(default)]
    pub round: Option<u64>,
    /// Pseudo-gradients of this round taken so far.
    #[serde(default)]
    pub arrived: Vec<Arrival>,
    /// Pseudo-gradients that came for a round already closed, since the last status.
    #[serde(default)]
    pub dropped: Vec<Late>,
    /// Trainers whose pseudo-gradient of this round was refused (and that have none in it),
    /// with why: the round does not wait for them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub refused: Vec<Refusal>,
    /// The last round it applied, with whose updates.
    #[serde(default)]
    pub applied: Option<Applied>,
    /// The peers whose pseudo-gradients it takes, as the scheduler last named them.
    #[serde(default)]
    pub trainers: Vec<String>,
    /// Peers that offered an initial model (whole or by fingerprint), while it has no model:
    /// it adopts the one the scheduler names.
    #[serde(default)]
    pub offered: Vec<String>,
    /// The standby it sends every round's model to, as the scheduler last named it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub standby: Option<String>,
}

/// What a standby parameter server (`[diloco] standby = true`) holds: the global model of a
/// round, built from the server's changes as trainers build theirs, and the server's last
/// checkpoint, for its momentum. It takes over when the server is lost.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct StandbyStatus {
    /// The round whose global model it holds (the round that model is the starting point
    /// of); `None` before it holds one.
    #[serde(default)]
    pub round: Option<u64>,
    /// That model's fingerprint, checked against the server's as it was built.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_hash: Option<String>,
    /// The round of the server's checkpoint it holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<u64>,
    /// The server whose models it takes, as the scheduler last named it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub following: Option<String>,
    /// The model it held before (kept until the next one comes): the round the scheduler
    /// has not heard was applied when the server was lost between the standby taking it and
    /// the server saying so.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous: Option<ModelOfRound>,
    /// The model it is building from a file the server sent (the fingerprint the server
    /// gave it), said before it starts: a model of gigabytes takes seconds to build, and a
    /// standby told to take over at that round serves it once built.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub building: Option<ModelOfRound>,
}

/// A global model, by its round and fingerprint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ModelOfRound {
    pub round: u64,
    pub model_hash: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Arrival {
    pub peer: String,
    pub samples: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Refusal {
    pub peer: String,
    pub reason: String,
}

/// An update of an applied round that counted for a share of itself: its norm was more than
/// `max_update_norm_ratio` times the round's reference, a tensor of it more than the model's
/// scale allows, it lay far from the round's robust centre, or its trainer's updates have
/// lately pointed away from the others'.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ClippedUpdate {
    pub peer: String,
    /// The share of the whole update that counted, in (0, 1].
    pub share: f32,
    /// Its norm as a multiple of the round's reference norm.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ratio: Option<f64>,
    /// Tensors clipped on their own, at most a few named.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tensors: Vec<String>,
    /// Why, in words (a server of an earlier version says nothing).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Late {
    pub peer: String,
    pub round: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Applied {
    pub round: u64,
    pub included: Vec<String>,
    /// The fingerprint of the global model the round led to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_hash: Option<String>,
    /// The size of the compressed change sent instead of the model to the trainers that
    /// held the round's model; `None` when the job does not compress.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delta_bytes: Option<u64>,
    /// The largest norm of the round's updates, as a multiple of the round's reference norm
    /// (the lower median of the round's norms, at least the typical norm of the last ones
    /// taken) that `max_update_norm_ratio` clips them at.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub largest_norm_ratio: Option<f64>,
    /// The updates that counted for a share of themselves (clipped), in arrival order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub clipped: Vec<ClippedUpdate>,
    /// How long closing the round took the server: from the order to the new model (or
    /// change) on its way to the trainers, in milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub close_ms: Option<u64>,
    /// The DiLoCo bytes the round put on the server's link: the updates it took in, and the
    /// models and changes it sent out after it (a published model counted once).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traffic_bytes: Option<u64>,
    /// The bytes it sent its standby since the round before (the round's change, or the
    /// whole model): not in `traffic_bytes`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub standby_bytes: Option<u64>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// The scheduler's answer to the parameter server.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum ServerOrder {
    /// Keep collecting.
    Wait,
    /// Close `round` with what arrived, step, checkpoint, and send the new global model to
    /// `send_to` (every trainer of the job, contributors or not).
    Close { round: u64, send_to: Vec<String> },
    /// End `round` without a change: discard what arrived (too few of the round's updates
    /// were taken for its quorum), checkpoint, and send the model, as it was, to `send_to`.
    Skip { round: u64, send_to: Vec<String> },
    /// Take pseudo-gradients only from these peers (the job's trainers, and those that left
    /// during the round): sent whenever the status names others.
    Trainers { peers: Vec<String> },
    /// Adopt the initial model `from` offered as the global model (asking `from` for it whole
    /// if it offered it by fingerprint), and answer every offer ("held" where the offerer
    /// holds the same model): the scheduler chooses the source, not whoever sends first.
    Adopt { from: String },
    /// Send every round's model (its change, or the whole model) to this standby from now
    /// on, starting with the whole current one; `None`: to nobody. Sent whenever the status
    /// names another.
    Standby { peer: Option<String> },
    /// Training is over: write the final model and exit successfully.
    Done,
}

/// The scheduler's answer to a standby parameter server.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum StandbyOrder {
    /// Keep following.
    Wait,
    /// Take models from this server (and checkpoints from the scheduler): sent whenever the
    /// status names another.
    Follow { server: String },
    /// The server is lost: become the parameter server at `round`, the round whose model it
    /// said it holds, with the momentum of the checkpoint it holds. A standby that holds
    /// another round's model by now cannot: it fails, and the scheduler restores a server
    /// from its checkpoint.
    Serve { round: u64 },
    /// Training is over: exit successfully.
    Done,
}

/// The scheduler's answer to a DiLoCo [`Status`]: the order of the same kind, on the wire
/// as that order alone.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Order {
    Trainer(TrainerOrder),
    ParameterServer(ServerOrder),
    Standby(StandbyOrder),
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn statuses_and_orders_read_as_documented() {
        let status: Status = serde_json::from_str(
            r#"{"diloco": "trainer", "round": 2, "batches": 5, "samples": 160, "batch_ms": 41.5, "loss": 0.7}"#,
        )
        .unwrap();
        let Status::Trainer(trainer) = status else {
            panic!("a trainer's status")
        };
        assert_eq!((trainer.round, trainer.samples), (Some(2), 160));
        let order = serde_json::to_value(TrainerOrder::Train {
            round: 2,
            batches: 9,
            parameter_server: "ps".into(),
            evaluate: false,
        })
        .unwrap();
        assert_eq!(
            order,
            serde_json::json!({"action": "train", "round": 2, "batches": 9, "parameter_server": "ps"})
        );
        // Asked to score the next model on the held-out data; an older scheduler's order
        // (without the key) asks nothing.
        let order = TrainerOrder::Train {
            round: 9,
            batches: 1,
            parameter_server: "ps".into(),
            evaluate: true,
        };
        let text = serde_json::to_string(&order).unwrap();
        assert!(text.contains(r#""evaluate":true"#), "{text}");
        // A status with a fingerprint of 64 KiB says what is wrong with it.
        let flooded = TrainerStatus {
            model_hash: Some("x".repeat(65536)),
            ..trainer.clone()
        };
        assert_eq!(trainer.problem(), None);
        assert!(
            flooded
                .problem()
                .unwrap()
                .contains("a model_hash of 65536 bytes")
        );
        assert_eq!(serde_json::from_str::<TrainerOrder>(&text).unwrap(), order);
        let order: ServerOrder =
            serde_json::from_str(r#"{"action": "close", "round": 0, "send_to": ["a"]}"#).unwrap();
        assert_eq!(
            order,
            ServerOrder::Close {
                round: 0,
                send_to: vec!["a".into()]
            }
        );
        let order: ServerOrder =
            serde_json::from_str(r#"{"action": "skip", "round": 3, "send_to": []}"#).unwrap();
        assert_eq!(
            order,
            ServerOrder::Skip {
                round: 3,
                send_to: vec![]
            }
        );
        let status: ServerStatus = serde_json::from_str(
            r#"{"round": 3, "refused": [{"peer": "p", "reason": "it claims 10 samples"}]}"#,
        )
        .unwrap();
        assert_eq!(status.refused[0].peer, "p");
    }
}
