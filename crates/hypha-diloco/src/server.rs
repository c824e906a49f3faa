//! The parameter server's state between rounds: the global model, the outer optimizer, the
//! round being collected and what arrived for it, and the checkpoint that survives a restart.

use std::{collections::BTreeMap, path::Path};

use hypha_messages::diloco::meta;

use crate::{Accumulator, Error, Metadata, OuterOptimizer, Tensor, Tensors, Update, metadata};

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
}

/// The DiLoCo parameter server's state.
#[derive(Debug)]
pub struct ParameterServer {
    model: Option<Tensors>,
    optimizer: OuterOptimizer,
    round: u64,
    sum: Accumulator,
    arrived: Vec<(String, u64)>,
    /// The most samples one update may claim; `None`: any.
    max_samples: Option<u64>,
    /// How many times the typical norm an update's may be; `None`: any.
    max_norm_ratio: Option<f64>,
    /// The norms of the updates last taken, newest last, at most [`NORM_HISTORY`].
    norms: std::collections::VecDeque<f64>,
}

/// How many of the last updates' norms make the typical norm.
pub const NORM_HISTORY: usize = 32;
/// Updates taken unchecked before norms are compared: the typical norm of fewer is no norm.
pub const NORM_WARMUP: usize = 3;

const MODEL_PREFIX: &str = "model/";
const MOMENTUM_PREFIX: &str = "momentum/";

impl ParameterServer {
    /// A server without a model: it adopts the first one [`offered`](Self::offer).
    pub fn new(optimizer: OuterOptimizer) -> Self {
        Self {
            model: None,
            optimizer,
            round: 0,
            sum: Accumulator::new(),
            arrived: Vec::new(),
            max_samples: None,
            max_norm_ratio: None,
            norms: std::collections::VecDeque::new(),
        }
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
        for (name, tensor) in Tensors::from_bytes(&bytes)?.0 {
            if let Some(name) = name.strip_prefix(MODEL_PREFIX) {
                model.insert(name.to_string(), tensor);
            } else if let Some(name) = name.strip_prefix(MOMENTUM_PREFIX) {
                buffers.insert(name.to_string(), tensor.values);
            }
        }
        let model = Tensors(model);
        Ok(Self {
            sum: Accumulator::shaped_like(&model),
            model: Some(model),
            optimizer: optimizer.with_buffers(buffers),
            round,
            arrived: Vec::new(),
            max_samples: None,
            max_norm_ratio: None,
            norms: std::collections::VecDeque::new(),
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

    /// A trainer's initial model: adopted when the server has none (true), ignored otherwise.
    pub fn offer(&mut self, bytes: &[u8]) -> Result<bool, Error> {
        if self.model.is_some() {
            return Ok(false);
        }
        let model = Tensors::from_bytes(bytes)?;
        self.sum = Accumulator::shaped_like(&model);
        self.model = Some(model);
        Ok(true)
    }

    /// A pseudo-gradient from `from`, trained in `round` on `samples` samples, as SafeTensors
    /// bytes. Refused (and the round left as it was) when its tensors are not the model's,
    /// hold a NaN or an infinity, it claims more samples than the server's limit, or its norm
    /// is an outlier ([`limit_norm`](Self::limit_norm)).
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
        if let Some(max) = self.max_samples.filter(|max| samples > *max) {
            return Err(Error::Samples { samples, max });
        }
        let update = Update::read(bytes)?;
        let norm = self.max_norm_ratio.map(|_| update.norm());
        if let (Some(norm), Some(limit)) = (norm, self.norm_limit())
            && norm > limit
        {
            return Err(Error::Norm { norm, limit });
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
    pub fn close(&mut self) -> Result<Closed, Error> {
        let model = self.model.as_mut().ok_or(Error::Empty)?;
        if self.arrived.is_empty() {
            return Err(Error::Empty);
        }
        let gradient = self.sum.mean()?;
        self.optimizer.step(model, &gradient)?;
        drop(gradient);
        self.sum = Accumulator::shaped_like(model);
        let arrived = std::mem::take(&mut self.arrived);
        let closed = Closed {
            round: self.round,
            samples: arrived.iter().map(|(_, n)| n).sum(),
            included: arrived.into_iter().map(|(peer, _)| peer).collect(),
        };
        self.round += 1;
        Ok(closed)
    }

    /// The global model as SafeTensors, marked as the model to train round
    /// [`round`](Self::round) from.
    pub fn model_bytes(&self) -> Result<Vec<u8>, Error> {
        let model = self.model.as_ref().ok_or(Error::Empty)?;
        model.to_bytes(&Metadata::from([
            (meta::KIND.to_string(), meta::KIND_MODEL.to_string()),
            (meta::ROUND.to_string(), self.round.to_string()),
        ]))
    }

    /// Writes model, momentum and round atomically to `path`.
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
