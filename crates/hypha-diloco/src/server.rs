//! The parameter server's state between rounds: the global model, the outer optimizer, the
//! round being collected and what arrived for it, and the checkpoint that survives a restart.
//!
//! **Broadcast changes.** With a codec ([`ParameterServer::broadcast_changes`]) a closed round
//! also yields the change of the global model, compressed with that codec and error feedback
//! on the server: the global model everybody holds moves by exactly the decoded change
//! (θ̂ ← θ̂ + C(step + e)), what the codec dropped (e) is carried into the next round's
//! change. Trainers that hold the round's model apply the same bytes with the same code
//! ([`Update::add_to`]) and check the result against the fingerprint the change carries
//! ([`Tensors::digest`]); the server sends the whole model to everybody else.

use std::{collections::BTreeMap, path::Path};

use hypha_messages::diloco::meta;

use crate::{
    Accumulator, Codec, Error, ErrorFeedback, Metadata, OuterOptimizer, Tensor, Tensors, Update,
    metadata, with_metadata,
};

/// What became of a pseudo-gradient handed to [`ParameterServer::add`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Taken {
    /// Added to the current round.
    Added,
    /// It was trained for `round`, which is closed (or not yet open): dropped.
    Late { round: u64 },
    /// This sender already contributed to the round: dropped, so nobody counts twice.
    Duplicate,
}

/// A round the server closed.
#[derive(Debug, Clone, PartialEq)]
pub struct Closed {
    pub round: u64,
    /// Who contributed, in arrival order.
    pub included: Vec<String>,
    pub samples: u64,
    /// The change the round made to the global model, as the file sent to trainers that hold
    /// the round's model ([`meta::KIND_MODEL_DELTA`]); `None` without
    /// [`broadcast_changes`](ParameterServer::broadcast_changes).
    pub delta: Option<Vec<u8>>,
    /// Why a compressing server sends no change this round (the step took values the codec
    /// cannot carry): the model took the step exactly and goes whole to everybody.
    pub uncompressed: Option<String>,
    /// The largest norm of the round's updates taken, as a multiple of the typical norm they
    /// were held against ([`limit_norm`](ParameterServer::limit_norm)); `None` without a
    /// limit or before the typical norm is known. How near honest updates come to the limit.
    pub largest_norm_ratio: Option<f64>,
}

/// The DiLoCo parameter server's state.
#[derive(Debug)]
pub struct ParameterServer {
    model: Option<Tensors>,
    optimizer: OuterOptimizer,
    round: u64,
    sum: Accumulator,
    arrived: Vec<(String, u64)>,
    /// Who sent an update of the current round that was refused, with why (the last one).
    refused: Vec<(String, String)>,
    /// The most samples one update may claim; `None`: any.
    max_samples: Option<u64>,
    /// How many times the typical norm an update's may be; `None`: any.
    max_norm_ratio: Option<f64>,
    /// The norms of the updates last taken, newest last, at most [`NORM_HISTORY`].
    norms: std::collections::VecDeque<f64>,
    /// The largest norm ratio of the round's updates taken so far.
    largest_norm_ratio: Option<f64>,
    /// How the changes of the global model are compressed; [`Codec::None`]: not sent.
    broadcast: Codec,
    /// What compressing the last changes dropped.
    feedback: ErrorFeedback,
    /// The global model's fingerprint.
    hash: Option<String>,
}

/// How many of the last updates' norms make the typical norm.
pub const NORM_HISTORY: usize = 32;
/// Updates taken unchecked before norms are compared: the typical norm of fewer is no norm.
pub const NORM_WARMUP: usize = 3;

const MODEL_PREFIX: &str = "model/";
const MOMENTUM_PREFIX: &str = "momentum/";
const RESIDUAL_PREFIX: &str = "residual/";

impl ParameterServer {
    /// A server without a model: it adopts the first one [`offered`](Self::offer).
    pub fn new(optimizer: OuterOptimizer) -> Self {
        Self {
            model: None,
            optimizer,
            round: 0,
            sum: Accumulator::new(),
            arrived: Vec::new(),
            refused: Vec::new(),
            max_samples: None,
            max_norm_ratio: None,
            norms: std::collections::VecDeque::new(),
            largest_norm_ratio: None,
            broadcast: Codec::None,
            feedback: ErrorFeedback::new(),
            hash: None,
        }
    }

    /// The same server making each round's change of the global model a file compressed
    /// with `codec` ([`Closed::delta`]), with error feedback; the global model is then held
    /// and sent as F32, the values its holders compute. [`Codec::None`]: no changes, the
    /// whole model is sent.
    pub fn broadcast_changes(mut self, codec: Codec) -> Self {
        self.broadcast = codec;
        if codec != Codec::None
            && let Some(model) = self.model.take()
        {
            let model = model.into_f32();
            self.hash = Some(model.digest());
            self.model = Some(model);
        }
        self
    }

    /// The same server refusing an update whose L2 norm is more than `ratio` times the
    /// median norm of the last [`NORM_HISTORY`] updates it took (once it took
    /// [`NORM_WARMUP`]): one scaled-up update would otherwise move the model as far as its
    /// sender likes. The history starts empty after a restart.
    pub fn limit_norm(mut self, ratio: f64) -> Self {
        self.max_norm_ratio = Some(ratio);
        self
    }

    /// The same server refusing updates that claim more than `max` samples: one update's
    /// weight in the mean is its samples, so a claim of `u64::MAX` would outweigh every
    /// honest one.
    pub fn limit_samples(mut self, max: u64) -> Self {
        self.max_samples = Some(max);
        self
    }

    /// The server as its last [`checkpoint`](Self::checkpoint) left it, or a new one when
    /// there is none at `path`.
    pub fn resume(path: &Path, optimizer: OuterOptimizer) -> Result<Self, Error> {
        let bytes = match std::fs::read(path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Self::new(optimizer)),
            Err(e) => {
                return Err(hypha_files::Error::Read {
                    path: path.to_path_buf(),
                    error: e,
                }
                .into());
            }
        };
        let round = round_of(&metadata(&bytes)?)?;
        let mut model = BTreeMap::new();
        let mut buffers = BTreeMap::new();
        let mut residual = BTreeMap::new();
        for (name, tensor) in Tensors::from_bytes(&bytes)?.0 {
            if let Some(name) = name.strip_prefix(MODEL_PREFIX) {
                model.insert(name.to_string(), tensor);
            } else if let Some(name) = name.strip_prefix(MOMENTUM_PREFIX) {
                buffers.insert(name.to_string(), tensor.values);
            } else if let Some(name) = name.strip_prefix(RESIDUAL_PREFIX) {
                residual.insert(name.to_string(), tensor.values);
            }
        }
        let model = Tensors(model);
        Ok(Self {
            sum: Accumulator::shaped_like(&model),
            hash: Some(model.digest()),
            broadcast: Codec::None,
            feedback: ErrorFeedback::with_residual(residual),
            model: Some(model),
            optimizer: optimizer.with_buffers(buffers),
            round,
            arrived: Vec::new(),
            refused: Vec::new(),
            max_samples: None,
            max_norm_ratio: None,
            norms: std::collections::VecDeque::new(),
            largest_norm_ratio: None,
        })
    }

    /// The round being collected; `None` before the server holds a model.
    pub fn round(&self) -> Option<u64> {
        self.model.as_ref().map(|_| self.round)
    }

    /// Who contributed to the current round so far, with their samples.
    pub fn arrived(&self) -> &[(String, u64)] {
        &self.arrived
    }

    /// Who sent an update of the current round that was [refused](Self::add) and has none in
    /// it, with the reason: the round need not wait for them.
    pub fn refused(&self) -> &[(String, String)] {
        &self.refused
    }

    /// A trainer's initial model: adopted when the server has none (true), ignored otherwise.
    pub fn offer(&mut self, bytes: &[u8]) -> Result<bool, Error> {
        if self.model.is_some() {
            return Ok(false);
        }
        let mut model = Tensors::from_bytes(bytes)?;
        if self.broadcast != Codec::None {
            model = model.into_f32();
        }
        self.sum = Accumulator::shaped_like(&model);
        self.hash = Some(model.digest());
        self.feedback.reset();
        self.model = Some(model);
        Ok(true)
    }

    /// A pseudo-gradient from `from`, trained in `round` on `samples` samples, as SafeTensors
    /// bytes. Refused (and the round left as it was, but for `from` in
    /// [`refused`](Self::refused)) when its tensors are not the model's, hold a NaN or an
    /// infinity, it claims more samples than the server's limit, or its norm is an outlier
    /// ([`limit_norm`](Self::limit_norm)).
    pub fn add(
        &mut self,
        from: &str,
        bytes: &[u8],
        round: u64,
        samples: u64,
    ) -> Result<Taken, Error> {
        if self.model.is_none() || round != self.round {
            return Ok(Taken::Late { round });
        }
        if self.arrived.iter().any(|(peer, _)| peer == from) {
            return Ok(Taken::Duplicate);
        }
        self.refused.retain(|(peer, _)| peer != from);
        let taken = self.take(from, bytes, samples);
        if let Err(error) = &taken {
            self.refused.push((from.to_string(), reason(error)));
        }
        taken
    }

    /// Refuses `from`'s update of the current round without reading it (it was found out
    /// before, say by its size), as [`add`](Self::add) refuses one.
    pub fn refuse(&mut self, from: &str, reason: String) {
        self.refused.retain(|(peer, _)| peer != from);
        self.refused.push((from.to_string(), reason));
    }

    fn take(&mut self, from: &str, bytes: &[u8], samples: u64) -> Result<Taken, Error> {
        if let Some(max) = self.max_samples.filter(|max| samples > *max) {
            return Err(Error::Samples { samples, max });
        }
        let update = Update::read(bytes)?;
        let norm = self.max_norm_ratio.map(|_| update.norm());
        let limit = self.norm_limit();
        if let (Some(norm), Some(limit)) = (norm, limit)
            && norm > limit
        {
            return Err(Error::Norm { norm, limit });
        }
        if let (Some(norm), Some(limit), Some(ratio)) = (norm, limit, self.max_norm_ratio)
            && limit > 0.0
        {
            let typical = norm / (limit / ratio);
            self.largest_norm_ratio =
                Some(self.largest_norm_ratio.map_or(typical, |r| r.max(typical)));
        }
        self.sum.add_update(&update, samples as f64)?;
        self.arrived.push((from.to_string(), samples));
        if let Some(norm) = norm {
            if self.norms.len() == NORM_HISTORY {
                self.norms.pop_front();
            }
            self.norms.push_back(norm);
        }
        Ok(Taken::Added)
    }

    /// The largest norm an update may have now, if there is a limit yet.
    fn norm_limit(&self) -> Option<f64> {
        let ratio = self.max_norm_ratio?;
        if self.norms.len() < NORM_WARMUP {
            return None;
        }
        let mut sorted: Vec<f64> = self.norms.iter().copied().collect();
        sorted.sort_by(f64::total_cmp);
        Some(ratio * sorted[sorted.len() / 2])
    }

    /// Closes the round: the sample-weighted mean of what arrived is the outer gradient of one
    /// Nesterov step. Fails (leaving everything as it was) when nothing arrived.
    ///
    /// With [`broadcast_changes`](Self::broadcast_changes), the step is compressed (with
    /// what earlier compressions dropped) and the model moves by exactly the decoded change,
    /// which [`Closed::delta`] holds.
    pub fn close(&mut self) -> Result<Closed, Error> {
        self.close_with(true)
    }

    /// [`close`](Self::close) with the step applied exactly and no change made: for a round
    /// whose trainers all take whole models, a compressed change would cost the model
    /// precision and save no bytes.
    pub fn close_without_change(&mut self) -> Result<Closed, Error> {
        self.close_with(false)
    }

    /// Ends the round without a change (too few of its updates were taken to apply any):
    /// what arrived is discarded; the model, its momentum and fingerprint stay as they are
    /// and the next round starts from them. Fails before the server holds a model.
    pub fn skip(&mut self) -> Result<Closed, Error> {
        let model = self.model.as_ref().ok_or(Error::Empty)?;
        self.sum = Accumulator::shaped_like(model);
        self.arrived.clear();
        self.refused.clear();
        let closed = Closed {
            round: self.round,
            included: Vec::new(),
            samples: 0,
            delta: None,
            uncompressed: None,
            largest_norm_ratio: self.largest_norm_ratio.take(),
        };
        self.round += 1;
        Ok(closed)
    }

    fn close_with(&mut self, change: bool) -> Result<Closed, Error> {
        let model = self.model.as_mut().ok_or(Error::Empty)?;
        if self.arrived.is_empty() {
            return Err(Error::Empty);
        }
        let gradient = self.sum.mean()?;
        let delta = if self.broadcast == Codec::None || !change {
            self.optimizer.step(model, &gradient)?;
            Ok(None)
        } else {
            let mut stepped = model.clone();
            self.optimizer.step(&mut stepped, &gradient)?;
            drop(gradient);
            let change = compress_change(
                &mut self.feedback,
                self.broadcast,
                model,
                &stepped,
                self.round,
                self.hash.clone().unwrap_or_default(),
            );
            match change {
                Ok(bytes) => Ok(bytes),
                Err(error) => {
                    // A step the codec cannot carry (values beyond what a reader takes):
                    // the model takes it exactly and goes whole to everybody this round.
                    self.feedback.reset();
                    *model = stepped;
                    Err(error.to_string())
                }
            }
            .map(Some)
        };
        let hash = model.digest();
        let (delta, uncompressed) = match delta {
            Ok(delta) => (delta, None),
            Err(why) => (None, Some(why)),
        };
        let delta = match delta {
            Some(bytes) => {
                let mut metadata = metadata(&bytes)?;
                metadata.insert(meta::MODEL_HASH.to_string(), hash.clone());
                Some(with_metadata(&bytes, &metadata)?)
            }
            None => None,
        };
        self.hash = Some(hash);
        self.sum = Accumulator::shaped_like(model);
        let arrived = std::mem::take(&mut self.arrived);
        self.refused.clear();
        let closed = Closed {
            round: self.round,
            samples: arrived.iter().map(|(_, n)| n).sum(),
            included: arrived.into_iter().map(|(peer, _)| peer).collect(),
            delta,
            uncompressed,
            largest_norm_ratio: self.largest_norm_ratio.take(),
        };
        self.round += 1;
        Ok(closed)
    }

    /// The global model's fingerprint ([`Tensors::digest`]); `None` before it holds one.
    pub fn model_hash(&self) -> Option<&str> {
        self.hash.as_deref()
    }

    /// The global model as SafeTensors, marked as the model to train round
    /// [`round`](Self::round) from, with its fingerprint.
    /// The most bytes an update of the model may take with `codec` (see
    /// [`max_encoded_bytes`](crate::codec::max_encoded_bytes)); `None` before there is a model.
    pub fn max_update_bytes(&self, codec: Codec) -> Option<u64> {
        let model = self.model.as_ref()?;
        Some(crate::codec::max_encoded_bytes(
            codec,
            model.0.values().map(|tensor| tensor.values.len()),
        ))
    }

    pub fn model_bytes(&self) -> Result<Vec<u8>, Error> {
        let model = self.model.as_ref().ok_or(Error::Empty)?;
        model.to_bytes(&Metadata::from([
            (meta::KIND.to_string(), meta::KIND_MODEL.to_string()),
            (meta::ROUND.to_string(), self.round.to_string()),
            (
                meta::MODEL_HASH.to_string(),
                self.hash.clone().unwrap_or_default(),
            ),
        ]))
    }

    /// Writes model, momentum, what the broadcast compression dropped, and round atomically
    /// to `path`.
    pub fn checkpoint(&self, path: &Path) -> Result<(), Error> {
        let model = self.model.as_ref().ok_or(Error::Empty)?;
        let mut all = BTreeMap::new();
        for (name, tensor) in &model.0 {
            all.insert(format!("{MODEL_PREFIX}{name}"), tensor.clone());
            if let Some(buffer) = self.optimizer.buffers().get(name) {
                let momentum = Tensor {
                    values: buffer.clone(),
                    ..tensor.clone()
                };
                all.insert(format!("{MOMENTUM_PREFIX}{name}"), momentum);
            }
            if let Some(residual) = self.feedback.residual().get(name) {
                let residual = Tensor {
                    values: residual.clone(),
                    shape: tensor.shape.clone(),
                    dtype: safetensors::Dtype::F32,
                };
                all.insert(format!("{RESIDUAL_PREFIX}{name}"), residual);
            }
        }
        Tensors(all).save(
            path,
            &Metadata::from([
                (meta::KIND.to_string(), meta::KIND_CHECKPOINT.to_string()),
                (meta::ROUND.to_string(), self.round.to_string()),
            ]),
        )
    }
}

/// The longest reason kept for a refusal, in characters.
pub const REASON_CHARS: usize = 200;

/// `error` as a refusal's reason: at most [`REASON_CHARS`] characters, control characters
/// escaped. Its text may quote the refused file (a tensor's name, a codec's), which its sender
/// chose: a reason of megabytes would make every status too large to send.
fn reason(error: &Error) -> String {
    let text = error.to_string();
    let mut escaped = text.chars().flat_map(char::escape_debug);
    let mut reason: String = escaped.by_ref().take(REASON_CHARS).collect();
    if escaped.next().is_some() {
        reason.push('…');
    }
    reason
}

/// The change from `model` to `stepped` (round `round` to the next), compressed with `codec`
/// and error feedback, as the file trainers get; `model` is moved by exactly the decoded
/// change. On an error, `model` and `feedback` are as they were.
fn compress_change(
    feedback: &mut ErrorFeedback,
    codec: Codec,
    model: &mut Tensors,
    stepped: &Tensors,
    round: u64,
    base_hash: String,
) -> Result<Vec<u8>, Error> {
    let mut change = stepped.clone();
    for (name, tensor) in &mut change.0 {
        if let Some(base) = model.0.get(name) {
            for (c, b) in tensor.values.iter_mut().zip(&base.values) {
                *c -= b;
            }
        }
    }
    let metadata = Metadata::from([
        (meta::KIND.to_string(), meta::KIND_MODEL_DELTA.to_string()),
        (meta::ROUND.to_string(), (round + 1).to_string()),
        (meta::BASE_ROUND.to_string(), round.to_string()),
        (meta::BASE_HASH.to_string(), base_hash),
    ]);
    let mut next = feedback.clone();
    let bytes = next.compress(&change, codec, &metadata)?;
    drop(change);
    Update::read(&bytes)?.add_to(model)?;
    *feedback = next;
    Ok(bytes)
}

/// The round a file's metadata names.
pub fn round_of(metadata: &Metadata) -> Result<u64, Error> {
    number(metadata, meta::ROUND)
}

/// The samples a pseudo-gradient's metadata names.
pub fn samples_of(metadata: &Metadata) -> Result<u64, Error> {
    number(metadata, meta::SAMPLES)
}

fn number(metadata: &Metadata, key: &str) -> Result<u64, Error> {
    let value = metadata
        .get(key)
        .ok_or_else(|| Error::Format(format!("the metadata has no {key:?}")))?;
    value.parse().map_err(|_| {
        Error::Format(format!(
            "metadata {key:?} = {value:?} is not a whole number"
        ))
    })
}
