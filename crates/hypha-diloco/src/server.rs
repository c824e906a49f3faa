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

use std::{
    collections::BTreeMap,
    io::{Seek, Write},
    path::Path,
};

use hypha_messages::diloco::{Arrival, ClippedUpdate, Refusal, meta};
use rayon::prelude::*;
use safetensors::Dtype;

use crate::{
    Accumulator, Codec, Error, ErrorFeedback, Fingerprint, Metadata, OuterOptimizer, Tensor,
    Tensors, Update,
    accumulate::{RoundTrip, round_trip},
    codec,
    file::{FileSource, Layout, Scratch, Source, Writer, write_file},
    optimizer::step_values,
    robust::{self, Agreement, Limits, Norms, Scale},
    tensors::stored_bytes,
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
    /// The size of the change's file, wherever it was written.
    pub delta_bytes: Option<u64>,
    /// Why a compressing server sends no change this round (the step took values the codec
    /// cannot carry): the model took the step exactly and goes whole to everybody.
    pub uncompressed: Option<String>,
    /// The largest norm of the round's updates taken, as a multiple of the round's reference
    /// norm ([`Limits::reference`]); `None` without a limit
    /// ([`limit_norm`](ParameterServer::limit_norm)) or a reference. How near honest updates
    /// come to being clipped.
    pub largest_norm_ratio: Option<f64>,
    /// The updates that counted for less than their whole ([`crate::robust`]), in arrival
    /// order, with at most [`CLIPPED_TENSORS_NAMED`] of the tensors clipped on their own.
    pub clipped: Vec<ClippedUpdate>,
}

/// Tensors clipped on their own that a round's report names, per update: a status stays
/// small whatever the model.
pub const CLIPPED_TENSORS_NAMED: usize = 4;

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
    /// The samples a round is planned to hold; `None`: every round steps whole.
    planned_samples: Option<u64>,
    /// How far an update may move the model, and the norms taken lately.
    limits: Limits,
    /// The norms of the round's updates, in the order they came (as `arrived`), while
    /// the limits are on.
    round_norms: Vec<Norms>,
    /// The model's scale, measured once a round when the first update is judged.
    scale: Option<Scale>,
    /// How well each trainer's updates have lately agreed with their rounds', while the
    /// limits are on.
    agreement: Agreement,
    /// How the changes of the global model are compressed; [`Codec::None`]: not sent.
    broadcast: Codec,
    /// What compressing the last changes dropped.
    feedback: ErrorFeedback,
    /// The global model's fingerprint.
    hash: Option<String>,
}

const MODEL_PREFIX: &str = "model/";
const MOMENTUM_PREFIX: &str = "momentum/";
const RESIDUAL_PREFIX: &str = "residual/";
/// The share of a round's planned samples that makes a whole step ([`ParameterServer::plan_samples`]).
pub const FULL_STEP_SHARE: f64 = 0.5;
/// A checkpoint's metadata key for the norms the limits took lately.
const NORMS_KEY: &str = "hypha.norm_history";
/// A checkpoint's metadata key for the trainers' agreements ([`Agreement::to_text`]).
const AGREEMENT_KEY: &str = "hypha.agreement";

/// Ends the change `writer` wrote, naming the model it leads to (`hash`): its output and
/// size.
fn finish_change<W: Write + Seek>(mut writer: Writer<W>, hash: &str) -> Result<(W, u64), Error> {
    writer.set_metadata(meta::MODEL_HASH, hash.to_string());
    let mut out = writer.finish()?;
    let size = out.stream_position().map_err(Error::Write)?;
    Ok((out, size))
}

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
            planned_samples: None,
            limits: Limits::default(),
            round_norms: Vec::new(),
            scale: None,
            agreement: Agreement::default(),
            broadcast: Codec::None,
            feedback: ErrorFeedback::new(),
            hash: None,
        }
    }

    /// The same server making each round's change of the global model a file compressed
    /// with `codec` ([`Closed::delta`]), with error feedback; the global model is then held
    /// and sent as F32, the values its holders compute. [`Codec::None`]: no changes, the
    /// whole model is sent.
    ///
    /// The codec is the changes' own: for trainers that compress with a codec, its
    /// [`Codec::for_broadcast`]. Whole-tensor top-k cannot be made a chunk at a time, as a
    /// close makes a change: given it, the server sends int8.
    pub fn broadcast_changes(mut self, codec: Codec) -> Self {
        let codec = match codec {
            Codec::TopK { .. } => Codec::Int8,
            codec => codec,
        };
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

    /// The same server judging every update ([`crate::robust`]): refused when absurd, clipped at
    /// the close to `ratio` times the round's reference norm and bounded by the model's
    /// size. One scaled-up update would otherwise move the model as far as its sender likes.
    /// The norms taken lately come back with a [`resume`](Self::resume) and a
    /// [`take_over`](Self::take_over) from a checkpoint. A server judging updates holds each
    /// of them to the close (their shares are known only then).
    pub fn limit_norm(mut self, ratio: f64) -> Self {
        self.limits = std::mem::take(&mut self.limits).with_ratio(Some(ratio));
        self.sum.keep_every_update(true);
        self
    }

    /// The same server stepping a round that holds far fewer than `planned` samples (a tail
    /// round, one trainer left at the end of the data) by what it holds: a round of a few
    /// batches from one trainer is a noisy estimate, and taken at the full outer learning
    /// rate it can undo what the run trained (issue 55: a digits run's last rounds raised its
    /// loss from 0.25 to 1.33). A round of at least [`FULL_STEP_SHARE`] of its plan (one
    /// closed with its quorum) steps whole.
    pub fn plan_samples(mut self, planned: u64) -> Self {
        self.planned_samples = Some(planned).filter(|n| *n > 0);
        self
    }

    /// The share of a full step the round takes: its samples over [`FULL_STEP_SHARE`] of the
    /// planned ones, at most 1.
    fn tail_share(&self) -> f32 {
        match self.planned_samples {
            Some(planned) => {
                (self.sum.weight() / (FULL_STEP_SHARE * planned as f64)).min(1.0) as f32
            }
            None => 1.0,
        }
    }

    /// The same server refusing updates that claim more than `max` samples: one update's
    /// weight in the mean is its samples, so a claim of `u64::MAX` would outweigh every
    /// honest one.
    pub fn limit_samples(mut self, max: u64) -> Self {
        self.max_samples = Some(max);
        self
    }

    /// The server as its last [`checkpoint`](Self::checkpoint) left it, or a new one when
    /// there is none at `path`. The file is read a chunk at a time.
    pub fn resume(path: &Path, optimizer: OuterOptimizer) -> Result<Self, Error> {
        let source = match FileSource::open(path) {
            Ok(source) => source,
            Err(Error::File(hypha_files::Error::Read { error, .. }))
                if error.kind() == std::io::ErrorKind::NotFound =>
            {
                return Ok(Self::new(optimizer));
            }
            Err(error) => return Err(error),
        };
        let metadata = Layout::read(&source)?.metadata;
        let round = round_of(&metadata)?;
        let mut model = BTreeMap::new();
        let mut buffers = BTreeMap::new();
        let mut residual = BTreeMap::new();
        for (name, tensor) in Tensors::read(&source)?.0 {
            if let Some(name) = name.strip_prefix(MODEL_PREFIX) {
                model.insert(name.to_string(), tensor);
            } else if let Some(name) = name.strip_prefix(MOMENTUM_PREFIX) {
                buffers.insert(name.to_string(), tensor.values);
            } else if let Some(name) = name.strip_prefix(RESIDUAL_PREFIX) {
                residual.insert(name.to_string(), tensor.values);
            }
        }
        Ok(Self::holding(
            Tensors(model),
            round,
            optimizer.with_buffers(buffers),
            ErrorFeedback::with_residual(residual),
        )
        .with_history(&metadata))
    }

    /// A server that goes on from what a standby holds (`[diloco] standby`): the global model
    /// in the SafeTensors file `model`, of the round its metadata names (built from the
    /// server's changes, as trainers build theirs), with the momentum of the
    /// [`checkpoint`](Self::checkpoint) at `checkpoint`. A checkpoint of that round is the
    /// whole state ([`resume`](Self::resume)). Another one's momentum is the best there is:
    /// the rounds between moved the model, and the momentum by what this server cannot know,
    /// their mean updates. What compression dropped is not carried: it was measured against
    /// the changes of those rounds. The server is at the model's round, whatever the
    /// checkpoint's.
    pub fn take_over(
        model: &Path,
        checkpoint: Option<&Path>,
        optimizer: OuterOptimizer,
    ) -> Result<Self, Error> {
        let source = FileSource::open(model)?;
        let round = round_of(&Layout::read(&source)?.metadata)?;
        let checkpoint = match checkpoint {
            Some(path) => {
                let source = FileSource::open(path)?;
                let layout = Layout::read(&source)?;
                if round_of(&layout.metadata)? == round {
                    return Self::resume(path, optimizer);
                }
                Some((source, layout))
            }
            None => None,
        };
        let model = Tensors::read(&source)?;
        let mut buffers = BTreeMap::new();
        let history = checkpoint
            .as_ref()
            .map(|(_, layout)| layout.metadata.clone())
            .unwrap_or_default();
        if let Some((source, layout)) = checkpoint {
            let mut buffer = Vec::new();
            for (name, entry) in &layout.entries {
                let Some(parameter) = name.strip_prefix(MOMENTUM_PREFIX) else {
                    continue;
                };
                if model
                    .0
                    .get(parameter)
                    .is_some_and(|t| t.shape == entry.shape)
                {
                    let momentum = Tensor::read(&source, name, entry, &mut buffer)?;
                    buffers.insert(parameter.to_string(), momentum.values);
                }
            }
        }
        Ok(Self::holding(
            model,
            round,
            optimizer.with_buffers(buffers),
            ErrorFeedback::new(),
        )
        .with_history(&history))
    }

    /// The same server with the norms a checkpoint's `metadata` kept (none when it has none).
    fn with_history(mut self, metadata: &Metadata) -> Self {
        if let Some(history) = metadata.get(NORMS_KEY) {
            self.limits = std::mem::take(&mut self.limits).with_history(history);
        }
        if let Some(agreement) = metadata.get(AGREEMENT_KEY) {
            self.agreement = Agreement::from_text(agreement);
        }
        self
    }

    /// A server holding `model` at `round`, collecting nothing yet.
    fn holding(
        model: Tensors,
        round: u64,
        optimizer: OuterOptimizer,
        feedback: ErrorFeedback,
    ) -> Self {
        Self {
            sum: Accumulator::shaped_like(&model),
            hash: Some(model.digest()),
            broadcast: Codec::None,
            feedback,
            model: Some(model),
            optimizer,
            round,
            arrived: Vec::new(),
            refused: Vec::new(),
            max_samples: None,
            planned_samples: None,
            limits: Limits::default(),
            round_norms: Vec::new(),
            scale: None,
            agreement: Agreement::default(),
        }
    }

    /// The round being collected; `None` before the server holds a model.
    pub fn round(&self) -> Option<u64> {
        self.model.as_ref().map(|_| self.round)
    }

    /// Who contributed to the current round so far, with their samples.
    pub fn arrived(&self) -> &[(String, u64)] {
        &self.arrived
    }

    /// [`arrived`](Self::arrived) as a status reports it.
    pub fn arrivals(&self) -> Vec<Arrival> {
        (self.arrived.iter())
            .map(|(peer, samples)| Arrival {
                peer: peer.clone(),
                samples: *samples,
            })
            .collect()
    }

    /// [`refused`](Self::refused) as a status reports it.
    pub fn refusals(&self) -> Vec<Refusal> {
        (self.refused.iter())
            .map(|(peer, reason)| Refusal {
                peer: peer.clone(),
                reason: reason.clone(),
            })
            .collect()
    }

    /// Who sent an update of the current round that was [refused](Self::add) and has none in
    /// it, with the reason: the round need not wait for them.
    pub fn refused(&self) -> &[(String, String)] {
        &self.refused
    }

    /// A trainer's initial model: adopted when the server has none (true), ignored otherwise.
    pub fn offer(&mut self, bytes: &[u8]) -> Result<bool, Error> {
        self.offer_from(bytes)
    }

    /// [`offer`](Self::offer) of the model in `source` (a file is read a chunk at a time).
    pub fn offer_from(&mut self, source: &(impl Source + ?Sized)) -> Result<bool, Error> {
        if self.model.is_some() {
            return Ok(false);
        }
        let mut model = Tensors::read(source)?;
        if self.broadcast != Codec::None {
            model = model.into_f32();
        }
        self.sum = Accumulator::shaped_like(&model);
        self.sum.keep_every_update(self.limits.is_on());
        self.scale = None;
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
        self.add_from(from, bytes.to_vec(), round, samples)
    }

    /// [`add`](Self::add) of the pseudo-gradient in `source`: a file is read a chunk at a
    /// time to check it, kept (open) until the round closes and read again then, and never
    /// held in memory.
    pub fn add_from(
        &mut self,
        from: &str,
        source: impl Source + Send + Sync + 'static,
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
        let taken = self.take(from, source, samples);
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

    fn take(
        &mut self,
        from: &str,
        source: impl Source + Send + Sync + 'static,
        samples: u64,
    ) -> Result<Taken, Error> {
        if let Some(max) = self.max_samples.filter(|max| samples > *max) {
            return Err(Error::Samples { samples, max });
        }
        let update = Update::from_source(&source)?;
        let norms = match (self.limits.is_on(), &self.model) {
            (true, Some(model)) => {
                let norms = update.norms()?;
                let scale = self.scale.get_or_insert_with(|| scale_of(model));
                if let Some(absurd) = self.limits.refuses(scale, &norms) {
                    return Err(Error::Norm(absurd));
                }
                Some(norms)
            }
            _ => None,
        };
        let parts = update.into_parts();
        self.sum.hold(source, parts, samples as f64)?;
        self.arrived.push((from.to_string(), samples));
        self.round_norms.extend(norms);
        Ok(Taken::Added)
    }

    /// The limits' verdict on the round's updates: each update's share counted in the sum,
    /// the norms recorded; the updates that counted for less than their whole and the largest
    /// norm ratio, for the round's [`Closed`].
    fn judge(&mut self) -> Result<(Vec<ClippedUpdate>, Option<f64>), Error> {
        if !self.limits.is_on() || self.round_norms.len() != self.arrived.len() {
            return Ok((Vec::new(), None));
        }
        let Some(model) = &self.model else {
            return Ok((Vec::new(), None));
        };
        let scale = self.scale.get_or_insert_with(|| scale_of(model));
        let round: Vec<&Norms> = self.round_norms.iter().collect();
        let mut clips = self.limits.clip(scale, &round);
        self.limits.record(&round, &clips);
        let (trust, centred) = match clips.len() {
            0..robust::MAJORITY => (vec![1.0; clips.len()], vec![1.0; clips.len()]),
            _ => {
                let grams = self.sum.gram()?;
                let gram = robust::clipped_gram(&grams, &clips).unwrap_or_default();
                let weights = self.sum.weights();
                let peers: Vec<&str> = self.arrived.iter().map(|(p, _)| p.as_str()).collect();
                let trust = self.agreement.weigh(self.round, &peers, &gram);
                let centred = robust::centre(&gram, &weights, &trust);
                (trust, centred)
            }
        };
        let largest = clips.iter().filter_map(|c| c.ratio).reduce(f64::max);
        let clipped = self
            .arrived
            .iter()
            .zip(&clips)
            .zip(centred.iter().zip(&trust))
            .filter(|((_, clip), (centred, _))| {
                !clip.is_whole() || **centred < robust::CENTRE_REPORT
            })
            .map(|(((peer, _), clip), (centred, trust))| ClippedUpdate {
                peer: peer.clone(),
                share: robust::counted(clip, *centred).min(1.0),
                ratio: clip.ratio,
                tensors: (clip.tensors.keys())
                    .take(CLIPPED_TENSORS_NAMED)
                    .cloned()
                    .collect(),
                reason: robust::why_clipped(clip, *trust, *centred),
            })
            .collect();
        for (clip, centred) in clips.iter_mut().zip(&centred) {
            clip.whole = robust::counted(clip, *centred);
        }
        self.sum.clip(&clips)?;
        Ok((clipped, largest))
    }

    /// Closes the round: the sample-weighted mean of what arrived is the outer gradient of one
    /// Nesterov step. Fails (leaving everything as it was) when nothing arrived. An update
    /// that cannot be read again (its file failed after it was checked) fails it with
    /// [`Error::RoundBroken`]: part of the model has stepped, and the server holds no model
    /// any more (restore it from its checkpoint).
    ///
    /// With [`broadcast_changes`](Self::broadcast_changes), the step is compressed (with
    /// what earlier compressions dropped) and the model moves by exactly the decoded change,
    /// which [`Closed::delta`] holds.
    pub fn close(&mut self) -> Result<Closed, Error> {
        let (mut closed, delta) = self.close_with(Some(std::io::Cursor::new(Vec::new())))?;
        closed.delta = delta.map(std::io::Cursor::into_inner);
        Ok(closed)
    }

    /// [`close`](Self::close) with the change written to a file at `delta` (atomically, not
    /// fsynced: it is made again from nothing if lost) instead of held in memory.
    pub fn close_to_file(&mut self, delta: &Path) -> Result<Closed, Error> {
        if self.broadcast == Codec::None {
            return Ok(self.close_with(None::<std::io::Cursor<Vec<u8>>>)?.0);
        }
        let mut file = hypha_files::AtomicFile::create(delta, hypha_files::Mode::Private)?;
        let (mut closed, written) = {
            let out = std::io::BufWriter::with_capacity(crate::file::CHUNK, file.file());
            let (closed, written) = self.close_with(Some(out))?;
            let written = written.map(|mut out| out.flush().map_err(Error::Write));
            (closed, written)
        };
        // The round is closed whatever becomes of its change: trainers without it get the
        // whole model.
        let failed = match written {
            Some(Ok(())) => file.commit(true, false).err().map(Error::from),
            Some(Err(error)) => Some(error),
            None => None,
        };
        if let Some(error) = failed {
            closed.delta_bytes = None;
            closed.uncompressed = Some(format!("cannot write the change: {error}"));
        }
        Ok(closed)
    }

    /// [`close`](Self::close) with the step applied exactly and no change made: for a round
    /// whose trainers all take whole models, a compressed change would cost the model
    /// precision and save no bytes.
    pub fn close_without_change(&mut self) -> Result<Closed, Error> {
        Ok(self.close_with(None::<std::io::Cursor<Vec<u8>>>)?.0)
    }

    /// Ends the round without a change (too few of its updates were taken to apply any):
    /// what arrived is discarded; the model, its momentum and fingerprint stay as they are
    /// and the next round starts from them. Fails before the server holds a model.
    pub fn skip(&mut self) -> Result<Closed, Error> {
        if self.model.is_none() {
            return Err(Error::Empty);
        }
        self.sum.clear();
        self.arrived.clear();
        self.refused.clear();
        self.round_norms.clear();
        let closed = Closed {
            round: self.round,
            included: Vec::new(),
            samples: 0,
            delta: None,
            delta_bytes: None,
            uncompressed: None,
            largest_norm_ratio: None,
            clipped: Vec::new(),
        };
        self.round += 1;
        Ok(closed)
    }

    /// The step, a parameter at a time and in place: a chunk's updates are summed, the sum
    /// becomes the mean, the mean the step, the step is added to the model (compressed, with
    /// what earlier compressions dropped, when a change is written to `out`); the fingerprint
    /// is taken as each parameter is done. Beside the model, its momentum and the carried
    /// residual, the server holds a window's temporaries: a model of gigabytes closes in a
    /// few passes over its bytes and no more memory.
    ///
    /// A step the codec cannot carry (a value beyond what a reader takes) is taken exactly
    /// from that parameter on, with nothing carried for those parameters, and no change is
    /// made (`out` is given back `None`): the model goes whole to everybody this round.
    ///
    /// An error writing to `out` makes no change either: the round is closed all the same,
    /// each chunk having moved by what the codec would have sent.
    fn close_with<W: Write + Seek + Send>(
        &mut self,
        out: Option<W>,
    ) -> Result<(Closed, Option<W>), Error> {
        if self.model.is_none() || self.arrived.is_empty() {
            return Err(Error::Empty);
        }
        let scale = self.sum.scale()? * self.tail_share();
        let (clipped, largest_norm_ratio) = self.judge()?;
        let codec = self.broadcast;
        let mut writer = self.change_writer(out)?;
        let model = self.model.as_mut().ok_or(Error::Empty)?;
        let mut uncompressed = None;
        let mut fingerprint = Fingerprint::new();
        let step = Step {
            codec,
            learning_rate: self.optimizer.learning_rate,
            momentum: self.optimizer.momentum,
            scale,
        };
        // A window of chunks closes at once, one chunk per thread at a time, while the window
        // before it is written and hashed (in order): two sets of buffers take turns.
        let slots_per_window = CLOSE_WINDOW_CHUNKS_PER_THREAD * rayon::current_num_threads();
        let window = slots_per_window * CLOSE_CHUNK;
        let mut slots = [(); 2].map(|_| {
            std::iter::repeat_with(ChunkClose::default)
                .take(slots_per_window)
                .collect::<Vec<_>>()
        });
        let mut unread = None;
        'parameters: for (name, parameter) in &mut model.0 {
            let len = parameter.values.len();
            let momentum = self.optimizer.buffer_mut(name, len);
            let compressing = writer.is_some() && uncompressed.is_none();
            if !compressing && uncompressed.is_some() {
                self.feedback.forget(name);
            }
            let mut residual = compressing.then(|| self.feedback.residual_mut(name, len));
            // int8's scales follow the parameter's values in the file.
            let mut companion = Vec::new();
            fingerprint.begin(name, parameter.dtype, &parameter.shape);
            // The window closed last, to be written and hashed.
            let mut closed: Option<std::ops::Range<usize>> = None;
            for start in (0..len).step_by(window).map(Some).chain([None]) {
                let next = start.map(|start| start..(start + window).min(len));
                // A window closes compressed unless one before it, written by now, could not.
                let compress = writer.is_some() && uncompressed.is_none();
                let (done, rest) = parameter
                    .values
                    .split_at_mut(next.as_ref().map_or(len, |n| n.start));
                let [computing, emitting] = &mut slots;
                let sum = &self.sum;
                rayon::join(
                    || {
                        if let Some(next) = next.clone() {
                            let residual = residual.as_deref_mut().map(|r| &mut r[next.clone()]);
                            close_window(
                                &step,
                                name,
                                compress,
                                (sum, next.start),
                                &mut momentum[next.clone()],
                                &mut rest[..next.len()],
                                residual,
                                computing,
                            );
                        }
                    },
                    || {
                        if let Some(closed) = closed.clone() {
                            let chunks = closed.len().div_ceil(CLOSE_CHUNK);
                            for slot in &emitting[..chunks] {
                                slot.emit(codec, &mut writer, &mut companion, &mut uncompressed);
                            }
                            fingerprint.values(&done[closed], parameter.dtype);
                        }
                    },
                );
                unread = slots[0].iter_mut().find_map(|slot| slot.unread.take());
                if unread.is_some() {
                    break 'parameters;
                }
                slots.swap(0, 1);
                closed = next;
            }
            if let Some(writer) = writer.as_mut().filter(|_| uncompressed.is_none())
                && let Err(error) = writer.write(&companion)
            {
                uncompressed = Some(format!("cannot write the change: {error}"));
            }
        }
        if let Some(error) = unread {
            return Err(self.broken(error));
        }
        let hash = fingerprint.finish();
        let delta = match writer.filter(|_| uncompressed.is_none()) {
            Some(writer) => finish_change(writer, &hash)
                .inspect_err(|error| {
                    uncompressed = Some(format!("cannot write the change: {error}"));
                })
                .ok(),
            None => None,
        };
        let arrived = self.end_round(hash);
        let closed = Closed {
            round: self.round,
            samples: arrived.iter().map(|(_, n)| n).sum(),
            included: arrived.into_iter().map(|(peer, _)| peer).collect(),
            delta: None,
            delta_bytes: delta.as_ref().map(|(_, size)| *size),
            uncompressed,
            largest_norm_ratio,
            clipped,
        };
        self.round += 1;
        Ok((closed, delta.map(|(out, _)| out)))
    }

    /// A close that failed part-way: some chunks stepped, others not, so this model is
    /// nobody's and the server holds none.
    fn broken(&mut self, error: Error) -> Error {
        self.model = None;
        self.sum.clear();
        self.round_norms.clear();
        Error::RoundBroken(Box::new(error))
    }

    /// Forgets the round's sum, norms and refusals as it closes, the model now the one of
    /// fingerprint `hash`: the updates that arrived for it, with their samples.
    fn end_round(&mut self, hash: String) -> Vec<(String, u64)> {
        self.sum.clear();
        self.hash = Some(hash);
        self.scale = None;
        self.round_norms.clear();
        self.refused.clear();
        std::mem::take(&mut self.arrived)
    }

    /// The writer of the round's change into `out`, compressed with the codec the server
    /// broadcasts with; `None` without one (and with none, nothing is carried over).
    fn change_writer<W: Write + Seek + Send>(
        &mut self,
        out: Option<W>,
    ) -> Result<Option<Writer<W>>, Error> {
        let codec = self.broadcast;
        let (Some(out), Some(model)) = (out.filter(|_| codec != Codec::None), &self.model) else {
            if codec == Codec::None {
                self.feedback.reset();
            }
            return Ok(None);
        };
        let shapes = model
            .0
            .iter()
            .map(|(name, t)| (name.as_str(), &t.shape[..]));
        let metadata = Metadata::from([
            (meta::KIND.to_string(), meta::KIND_MODEL_DELTA.to_string()),
            (meta::ROUND.to_string(), (self.round + 1).to_string()),
            (meta::BASE_ROUND.to_string(), self.round.to_string()),
            (
                meta::BASE_HASH.to_string(),
                self.hash.clone().unwrap_or_default(),
            ),
            // Set once every parameter has moved; a fingerprint's length kept for it.
            (meta::MODEL_HASH.to_string(), Fingerprint::new().finish()),
        ]);
        Ok(Some(Writer::new(
            out,
            codec::stored(codec, shapes.clone())?,
            codec::with_codec(codec, &metadata, shapes),
        )?))
    }

    /// The global model's fingerprint ([`Fingerprint`]); `None` before it holds one.
    pub fn model_hash(&self) -> Option<&str> {
        self.hash.as_deref()
    }

    /// The most bytes an update of the model may take with `codec` (see
    /// [`max_encoded_bytes`](crate::codec::max_encoded_bytes)); `None` before there is a model.
    pub fn max_update_bytes(&self, codec: Codec) -> Option<u64> {
        let model = self.model.as_ref()?;
        Some(crate::codec::max_encoded_bytes(
            codec,
            model.0.values().map(|tensor| tensor.values.len()),
        ))
    }

    /// The metadata of the global model's file: the model to train round
    /// [`round`](Self::round) from, with its fingerprint.
    fn model_metadata(&self) -> Metadata {
        Metadata::from([
            (meta::KIND.to_string(), meta::KIND_MODEL.to_string()),
            (meta::ROUND.to_string(), self.round.to_string()),
            (
                meta::MODEL_HASH.to_string(),
                self.hash.clone().unwrap_or_default(),
            ),
        ])
    }

    /// The global model as SafeTensors, marked as the model to train round
    /// [`round`](Self::round) from, with its fingerprint.
    pub fn model_bytes(&self) -> Result<Vec<u8>, Error> {
        let model = self.model.as_ref().ok_or(Error::Empty)?;
        model.to_bytes(&self.model_metadata())
    }

    /// [`model_bytes`](Self::model_bytes) written to a file at `path`, a tensor at a time
    /// (atomically; fsynced when `durable`); the file's size.
    pub fn write_model(&self, path: &Path, durable: bool) -> Result<u64, Error> {
        let model = self.model.as_ref().ok_or(Error::Empty)?;
        let listing = model
            .0
            .iter()
            .map(|(name, t)| (name.clone(), t.dtype, t.shape.clone()));
        write_file(path, durable, listing, self.model_metadata(), |writer| {
            for tensor in model.0.values() {
                stored_bytes(&tensor.values, tensor.dtype, |bytes| writer.write(bytes))?;
            }
            Ok(())
        })
    }

    /// The bytes of a checkpoint once the server has stepped: the model as stored, and
    /// momentum and (when it sends changes) the carried residual in f32. The adopted model's
    /// checkpoint is the model alone; later ones are this.
    pub fn checkpoint_bytes(&self) -> Option<u64> {
        let model = self.model.as_ref()?;
        let values: u64 = model.0.values().map(|t| t.values.len() as u64).sum();
        let stored: u64 = model
            .0
            .values()
            .map(|t| (t.values.len() * crate::file::dtype_bytes(t.dtype)) as u64)
            .sum();
        let kept = if self.broadcast == Codec::None { 1 } else { 2 };
        Some(stored + kept * 4 * values)
    }

    /// Writes model, momentum, what the broadcast compression dropped, and round atomically
    /// to `path`, a tensor at a time; the file's size. Momentum and residual are written as
    /// F32, whatever the model's dtype.
    pub fn checkpoint(&self, path: &Path) -> Result<u64, Error> {
        let model = self.model.as_ref().ok_or(Error::Empty)?;
        let buffers = self.optimizer.buffers();
        let residual = self.feedback.residual();
        let mut listing = Vec::new();
        let mut values: Vec<(&[f32], Dtype)> = Vec::new();
        for (name, tensor) in &model.0 {
            listing.push((
                format!("{MODEL_PREFIX}{name}"),
                tensor.dtype,
                tensor.shape.clone(),
            ));
            values.push((&tensor.values, tensor.dtype));
            for (prefix, kept) in [(MOMENTUM_PREFIX, buffers), (RESIDUAL_PREFIX, residual)] {
                if let Some(kept) = kept.get(name).filter(|v| v.len() == tensor.values.len()) {
                    listing.push((format!("{prefix}{name}"), Dtype::F32, tensor.shape.clone()));
                    values.push((kept, Dtype::F32));
                }
            }
        }
        // The file lists its tensors in this order; a reader finds them by name.
        let metadata = Metadata::from([
            (meta::KIND.to_string(), meta::KIND_CHECKPOINT.to_string()),
            (meta::ROUND.to_string(), self.round.to_string()),
            (NORMS_KEY.to_string(), self.limits.to_text()),
            (AGREEMENT_KEY.to_string(), self.agreement.to_text()),
        ]);
        write_file(path, true, listing, metadata, |writer| {
            for (values, dtype) in values {
                stored_bytes(values, dtype, |bytes| writer.write(bytes))?;
            }
            Ok(())
        })
    }
}

/// The values of a parameter the round's close takes at once: its temporaries (the carried
/// change, what the codec makes of it, the bytes hashed) are this long, whatever the model.
/// A multiple of `int8`'s block and of `sparse`'s chunk, so that each block and chunk is
/// compressed as the whole tensor's is and the pieces' bytes, one after the other, are the
/// whole tensor's encoding.
const CLOSE_CHUNK: usize = 1 << 16;
const _: () = assert!(
    CLOSE_CHUNK.is_multiple_of(codec::INT8_BLOCK)
        && CLOSE_CHUNK.is_multiple_of(codec::sparse::CHUNK)
);

/// Chunks per thread in a window of a close: enough that no thread waits long for the
/// slowest of the others, few enough that a window stays in the caches while it is hashed.
const CLOSE_WINDOW_CHUNKS_PER_THREAD: usize = 4;

/// The outer step's settings, shared by the chunks of a close.
struct Step {
    codec: Codec,
    learning_rate: f32,
    momentum: f32,
    scale: f32,
}

/// One chunk of a close, on whichever thread takes it: its buffers (kept from chunk to
/// chunk), and what became of its change.
#[derive(Debug, Default)]
struct ChunkClose {
    /// The chunk's sum of the round's updates, made the step in place.
    sum: Vec<f32>,
    /// Where the updates are read from.
    scratch: Scratch,
    /// An update could not be read: the chunk did not step.
    unread: Option<Error>,
    carried: Vec<f32>,
    buffers: RoundTrip,
    /// The chunk's values in `buffers` were compressed and moved the model.
    sent: Option<usize>,
    /// Why the codec could not carry the chunk's step (taken exactly instead).
    failed: Option<String>,
}

impl ChunkClose {
    /// The step on one chunk, the values of parameter `name` from `start`: the round's
    /// updates are summed and the sum becomes the step (momentum updated), the step is added
    /// to `target` (compressed with what earlier compressions dropped, where `compress` and
    /// the parameter carries a residual; exactly otherwise). Nothing moves when an update
    /// cannot be read (`unread`).
    #[allow(clippy::too_many_arguments)]
    fn close(
        &mut self,
        step: &Step,
        name: &str,
        (updates, start): (&Accumulator, usize),
        momentum: &mut [f32],
        target: &mut [f32],
        residual: Option<&mut [f32]>,
        compress: bool,
    ) {
        self.sent = None;
        self.failed = None;
        self.sum.resize(target.len(), 0.0);
        if let Err(error) = updates.sum_into(name, start, &mut self.sum, &mut self.scratch) {
            self.unread = Some(error);
            return;
        }
        let sum = &mut self.sum[..];
        step_values(step.learning_rate, step.momentum, momentum, sum, step.scale);
        match residual {
            Some(residual) if compress => {
                self.carried.clear();
                self.carried
                    .extend(sum.iter().zip(residual.iter()).map(|(s, r)| s + r));
                match round_trip(
                    step.codec,
                    name,
                    &[sum.len()],
                    &self.carried,
                    &mut self.buffers,
                ) {
                    Ok((_, sent)) => {
                        add(target, sent);
                        for ((r, c), s) in residual.iter_mut().zip(&self.carried).zip(sent) {
                            *r = c - s;
                        }
                        self.sent = Some(sum.len());
                    }
                    Err(error) => {
                        self.failed = Some(error.to_string());
                        add(target, sum);
                        residual.fill(0.0);
                    }
                }
            }
            Some(residual) => {
                // The codec could not carry an earlier part: exact from there on.
                add(target, sum);
                residual.fill(0.0);
            }
            None => add(target, sum),
        }
    }

    /// Writes the chunk's compressed values to `writer` and keeps their scales (int8) for
    /// after the parameter's values, while the change is still being made; notes why it no
    /// longer is (the codec could not carry the chunk, or the writer failed).
    fn emit<W: Write + Seek>(
        &self,
        codec: Codec,
        writer: &mut Option<Writer<W>>,
        companion: &mut Vec<u8>,
        uncompressed: &mut Option<String>,
    ) {
        if let Some(error) = &self.failed {
            uncompressed.get_or_insert_with(|| error.clone());
        }
        let (Some(len), Some(writer)) = (self.sent, writer.as_mut()) else {
            return;
        };
        if uncompressed.is_some() {
            return;
        }
        // The change is for trainers that hold the model; without it they get the whole
        // model. The chunk still moved by what was sent, and carries what the codec dropped.
        let (values, scales) = codec::split_encoded(codec, len, self.buffers.encoded());
        if let Err(error) = writer.write(values) {
            *uncompressed = Some(format!("cannot write the change: {error}"));
        }
        companion.extend_from_slice(scales);
    }
}

/// One window of a parameter's close, the values from `start` (in `updates`): its chunks
/// ([`CLOSE_CHUNK`] values each) on the threads at hand, each with its slot's buffers.
#[allow(clippy::too_many_arguments)]
fn close_window(
    step: &Step,
    name: &str,
    compress: bool,
    (updates, start): (&Accumulator, usize),
    momentum: &mut [f32],
    target: &mut [f32],
    residual: Option<&mut [f32]>,
    slots: &mut [ChunkClose],
) {
    let residuals: Vec<Option<&mut [f32]>> = match residual {
        Some(residual) => residual.chunks_mut(CLOSE_CHUNK).map(Some).collect(),
        None => target.chunks(CLOSE_CHUNK).map(|_| None).collect(),
    };
    momentum
        .par_chunks_mut(CLOSE_CHUNK)
        .zip(target.par_chunks_mut(CLOSE_CHUNK))
        .zip(residuals)
        .zip(slots)
        .enumerate()
        .for_each(|(i, (((momentum, target), residual), slot))| {
            let chunk = (updates, start + i * CLOSE_CHUNK);
            slot.close(step, name, chunk, momentum, target, residual, compress);
        });
}

/// The scale of `model` that updates are held against ([`Scale`]).
fn scale_of(model: &Tensors) -> Scale {
    Scale::new(
        model
            .0
            .par_iter()
            .map(|(name, tensor)| {
                let squared = tensor
                    .values
                    .par_chunks(CLOSE_CHUNK)
                    .map(|chunk| chunk.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>())
                    .sum();
                (name.clone(), squared, tensor.values.len())
            })
            .collect::<Vec<_>>(),
    )
}

/// `target` += `values`, value by value.
fn add(target: &mut [f32], values: &[f32]) {
    for (t, v) in target.iter_mut().zip(values) {
        *t += v;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Tensor;

    /// A change file on a full disk: writes fail after `room` bytes.
    struct FullDisk {
        written: std::io::Cursor<Vec<u8>>,
        room: usize,
    }

    impl Write for FullDisk {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            if self.written.get_ref().len() + buf.len() > self.room {
                return Err(std::io::Error::other("no space left on device"));
            }
            self.written.write(buf)
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Seek for FullDisk {
        fn seek(&mut self, to: std::io::SeekFrom) -> std::io::Result<u64> {
            self.written.seek(to)
        }
    }

    fn file(values: Vec<f32>) -> Vec<u8> {
        let tensor = Tensor {
            shape: vec![values.len()],
            values,
            dtype: Dtype::F32,
        };
        Tensors(BTreeMap::from([("w".to_string(), tensor)]))
            .to_bytes(&Metadata::new())
            .unwrap()
    }

    /// The change is an optimisation: a round whose change cannot be written closes all the
    /// same, says why, and the model it holds is the one its fingerprint names.
    #[test]
    fn a_change_that_cannot_be_written_leaves_a_closed_round_and_a_whole_model() {
        let n = 3 * CLOSE_CHUNK;
        let mut server =
            ParameterServer::new(OuterOptimizer::new(0.7, 0.9)).broadcast_changes(Codec::Int8);
        server.offer(&file(vec![1.0; n])).unwrap();
        server
            .add(
                "a",
                &file((0..n).map(|i| (i % 7) as f32 * 0.01).collect()),
                0,
                8,
            )
            .unwrap();
        let out = FullDisk {
            written: std::io::Cursor::new(Vec::new()),
            room: CLOSE_CHUNK,
        };
        let (closed, written) = server.close_with(Some(out)).unwrap();
        assert!(written.is_none());
        assert_eq!(closed.delta_bytes, None);
        assert!(
            closed
                .uncompressed
                .as_deref()
                .is_some_and(|why| why.contains("no space left")),
            "{closed:?}"
        );
        assert_eq!(server.round(), Some(1));
        let model = Tensors::from_bytes(&server.model_bytes().unwrap()).unwrap();
        assert_eq!(Some(model.digest().as_str()), server.model_hash());
        assert_ne!(model.0["w"].values, vec![1.0; n], "the step was taken");
    }
}
