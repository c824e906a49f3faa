//! What a trainer trains: the [`Learner`] behind the loop of [`crate::train::Trainer`], which
//! holds the model being trained, its inner optimiser and the round's global model, and turns
//! them into the files that travel (offers, pseudo-gradients) and back.
//!
//! - [`Trained`]: the reference models on candle's CPU backend, trained with AdamW, the
//!   global model held in memory; pseudo-gradients compressed with error feedback.
//! - [`SyntheticUpdates`]: trains nothing. It sends pseudo-gradients of the model's shapes
//!   drawn at random and keeps the global model in a file, applying each change to it a
//!   parameter at a time: the memory of the largest parameter, whatever the model's size.
//!   For benchmarks of the pipeline (parameter server, transfers, checkpoints) at sizes this
//!   machine's CPUs cannot train (`hypha-executor train --synthetic-updates`); everything
//!   else a trainer does (slices, reports, joins, fingerprints) it does as a trained one.

use std::path::{Path, PathBuf};

use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use hypha_diloco::{
    Codec, ErrorFeedback, Metadata, Tensors, Update,
    file::{FileSource, rewrite},
};
use hypha_messages::diloco::InnerOptimizer;
use rand::{Rng, SeedableRng, rngs::StdRng};

use crate::{
    local::{Score, Tally},
    model::{Batch, Model, ModelSpec, initial_values},
    train::TrainError,
};

/// The model side of a trainer.
pub trait Learner {
    /// A global model taken from the parameter server, not yet trained from.
    type Global;

    /// One inner step on `batch`; its loss, where something was learned.
    fn train(&mut self, batch: &Batch) -> Result<Option<f64>, TrainError>;

    /// The fingerprint of the global model it holds.
    fn global_hash(&self) -> &str;

    /// Writes the global model it holds to `path`, with `metadata` (an offer to a server).
    fn write_global(&self, path: &Path, metadata: &Metadata) -> Result<(), TrainError>;

    /// Writes the round's pseudo-gradient θ_global − θ_local, compressed with the job's
    /// codec, to `path` with `metadata`. Called once a round.
    fn write_pseudo_gradient(&mut self, path: &Path, metadata: &Metadata)
    -> Result<(), TrainError>;

    /// The whole global model in the file at `path` (the file may be moved), with its
    /// fingerprint.
    fn read_model(&mut self, path: &Path) -> Result<(Self::Global, String), TrainError>;

    /// The global model the change in the file at `path` makes of the one it holds, with its
    /// fingerprint; why not, when the change does not fit that model.
    fn apply_change(&mut self, path: &Path) -> Result<(Self::Global, String), String>;

    /// Remembers its own model at a sync, to move what it learns ahead onto the next global
    /// model ([`start`](Self::start) with `keep_ahead`).
    fn remember_sync(&mut self) -> Result<(), TrainError>;

    /// Starts a round from `global` (with its fingerprint; `None`: the global model it
    /// holds): trains from it, or, `keep_ahead`, moves what it learned since the sync onto
    /// it (θ ← θ + (θ̂ − θ_sync)).
    fn start(
        &mut self,
        global: Option<(Self::Global, String)>,
        keep_ahead: bool,
    ) -> Result<(), TrainError>;

    /// Forgets what compression dropped: it was measured against a server that is gone.
    fn forget_dropped(&mut self);

    /// Scores the global model it holds on `batches` (held-out data); `None` for a learner
    /// that cannot, which then never says it evaluates.
    fn evaluate(&mut self, batches: &[Batch]) -> Result<Option<Score>, TrainError> {
        let _ = batches;
        Ok(None)
    }

    /// Whether [`evaluate`](Self::evaluate) scores.
    fn evaluates(&self) -> bool {
        false
    }
}

/// A reference model trained with AdamW on candle's CPU backend.
#[derive(Debug)]
pub struct Trained {
    model: Model,
    optimizer: AdamW,
    /// The global model this round started from, and its fingerprint.
    global: Tensors,
    global_hash: String,
    /// How pseudo-gradients are compressed, and what compression dropped so far.
    codec: Codec,
    feedback: ErrorFeedback,
    /// Its own model at the last sync, while it trains ahead.
    synced: Option<Tensors>,
    /// The model global models are scored in, made at the first evaluation.
    scorer: Option<Model>,
}

impl Trained {
    /// A model of `spec` drawn from `seed`, trained with `inner`'s AdamW.
    pub fn new(
        spec: &ModelSpec,
        seed: u64,
        inner: InnerOptimizer,
        codec: Codec,
    ) -> Result<Self, TrainError> {
        let model = Model::new(spec, seed)?;
        let optimizer = AdamW::new(
            model.parameters(),
            ParamsAdamW {
                lr: inner.learning_rate,
                beta1: inner.beta1,
                beta2: inner.beta2,
                eps: 1e-8,
                weight_decay: inner.weight_decay,
            },
        )?;
        let global = model.tensors()?;
        Ok(Self {
            global_hash: global.digest(),
            model,
            optimizer,
            global,
            codec,
            feedback: ErrorFeedback::for_codec(codec),
            synced: None,
            scorer: None,
        })
    }

    /// The model as it trains (the global model plus what this trainer learned since).
    pub fn model(&self) -> &Model {
        &self.model
    }
}

impl Learner for Trained {
    type Global = Tensors;

    fn train(&mut self, batch: &Batch) -> Result<Option<f64>, TrainError> {
        let loss = self.model.loss(batch)?;
        self.optimizer.backward_step(&loss)?;
        Ok(Some(f64::from(loss.to_scalar::<f32>()?)))
    }

    fn global_hash(&self) -> &str {
        &self.global_hash
    }

    fn write_global(&self, path: &Path, metadata: &Metadata) -> Result<(), TrainError> {
        write_file(path, &self.global.to_bytes(metadata)?)
    }

    fn write_pseudo_gradient(
        &mut self,
        path: &Path,
        metadata: &Metadata,
    ) -> Result<(), TrainError> {
        let mut delta = self.global.clone();
        let local = self.model.tensors()?;
        for (name, tensor) in &mut delta.0 {
            let trained = local.0.get(name).ok_or_else(|| {
                TrainError::Protocol(format!(
                    "the global model's {name} is not a parameter of this trainer's model"
                ))
            })?;
            for (g, l) in tensor.values.iter_mut().zip(&trained.values) {
                *g -= l;
            }
        }
        write_file(path, &self.feedback.compress(&delta, self.codec, metadata)?)
    }

    fn read_model(&mut self, path: &Path) -> Result<(Tensors, String), TrainError> {
        let global = Tensors::load(path)?;
        let hash = global.digest();
        Ok((global, hash))
    }

    fn apply_change(&mut self, path: &Path) -> Result<(Tensors, String), String> {
        let mut global = self.global.clone();
        let change = FileSource::open(path).map_err(|error| error.to_string())?;
        Update::from_source(&change)
            .and_then(|change| change.add_to(&mut global))
            .map_err(|error| error.to_string())?;
        let hash = global.digest();
        Ok((global, hash))
    }

    fn remember_sync(&mut self) -> Result<(), TrainError> {
        self.synced = Some(self.model.tensors()?);
        Ok(())
    }

    fn start(
        &mut self,
        global: Option<(Tensors, String)>,
        keep_ahead: bool,
    ) -> Result<(), TrainError> {
        if let Some((global, hash)) = global {
            self.global = global;
            self.global_hash = hash;
        }
        let global = &self.global;
        match self.synced.take() {
            Some(synced) if keep_ahead => {
                let mut local = self.model.tensors()?;
                for (name, tensor) in &mut local.0 {
                    let (Some(new), Some(synced)) = (global.0.get(name), synced.0.get(name)) else {
                        continue;
                    };
                    for ((l, n), s) in tensor
                        .values
                        .iter_mut()
                        .zip(&new.values)
                        .zip(&synced.values)
                    {
                        *l += n - s;
                    }
                }
                self.model.load(&local)?;
            }
            _ => self.model.load(global)?,
        }
        Ok(())
    }

    fn forget_dropped(&mut self) {
        self.feedback.reset();
    }

    /// Scores the global model in a model of its own: the one training may already hold
    /// batches trained ahead of it.
    fn evaluate(&mut self, batches: &[Batch]) -> Result<Option<Score>, TrainError> {
        let scorer = match &mut self.scorer {
            Some(scorer) => scorer,
            empty => empty.insert(Model::new(self.model.spec(), 0)?),
        };
        scorer.load(&self.global)?;
        let mut tally = Tally::default();
        for batch in batches {
            tally.add(scorer, batch)?;
        }
        Ok(Some(tally.score()))
    }

    fn evaluates(&self) -> bool {
        true
    }
}

/// A trainer's stand-in that learns nothing: see the module's documentation.
#[derive(Debug)]
pub struct SyntheticUpdates {
    /// Where it keeps the global model (`global.safetensors`) and the one being taken.
    dir: PathBuf,
    shapes: Vec<(String, Vec<usize>)>,
    global_hash: String,
    codec: Codec,
    /// Draws the pseudo-gradients.
    rng: StdRng,
}

/// The largest value of a synthetic pseudo-gradient: the size of the change a round of
/// AdamW steps at a learning rate of 1e-3 makes to a parameter.
const SYNTHETIC_STEP: f32 = 1e-3;

impl SyntheticUpdates {
    /// A stand-in for a trainer of a model of `spec`: its first global model is drawn from
    /// `seed` as [`Model::new`] draws it and written into `dir` (created), a parameter at a
    /// time.
    pub fn new(spec: &ModelSpec, seed: u64, codec: Codec, dir: &Path) -> Result<Self, TrainError> {
        let shapes = spec.parameter_shapes()?;
        if let Codec::TopK { .. } = codec {
            return Err(TrainError::Protocol(
                "synthetic updates are drawn dense: use the codec none, bf16 or int8".into(),
            ));
        }
        std::fs::create_dir_all(dir).map_err(|error| TrainError::File {
            path: dir.to_path_buf(),
            error,
        })?;
        let mut learner = Self {
            dir: dir.to_path_buf(),
            shapes,
            global_hash: String::new(),
            codec,
            rng: StdRng::seed_from_u64(seed ^ 0x005E_ED0F_D17F),
        };
        let mut rng = StdRng::seed_from_u64(seed);
        let global = learner.global_path();
        hypha_diloco::codec::encode_file(
            &global,
            false,
            Codec::None,
            &learner.shapes,
            &Metadata::new(),
            |name, shape, values| {
                initial_values(name, shape, &mut rng, values);
                Ok(())
            },
        )?;
        learner.global_hash = Tensors::fingerprint_of(&FileSource::open(&global)?)?;
        Ok(learner)
    }

    fn global_path(&self) -> PathBuf {
        self.dir.join("global.safetensors")
    }

    fn candidate_path(&self) -> PathBuf {
        self.dir.join("candidate.safetensors")
    }
}

impl Learner for SyntheticUpdates {
    /// A file in its directory.
    type Global = PathBuf;

    fn train(&mut self, _: &Batch) -> Result<Option<f64>, TrainError> {
        Ok(None)
    }

    fn global_hash(&self) -> &str {
        &self.global_hash
    }

    fn write_global(&self, path: &Path, metadata: &Metadata) -> Result<(), TrainError> {
        rewrite(&FileSource::open(&self.global_path())?, path, metadata)?;
        Ok(())
    }

    fn write_pseudo_gradient(
        &mut self,
        path: &Path,
        metadata: &Metadata,
    ) -> Result<(), TrainError> {
        let rng = &mut self.rng;
        hypha_diloco::codec::encode_file(
            path,
            false,
            self.codec,
            &self.shapes,
            metadata,
            |_, shape, values| {
                let count: usize = shape.iter().product();
                values
                    .extend((0..count).map(|_| rng.random_range(-SYNTHETIC_STEP..SYNTHETIC_STEP)));
                Ok(())
            },
        )?;
        Ok(())
    }

    fn read_model(&mut self, path: &Path) -> Result<(PathBuf, String), TrainError> {
        let candidate = self.candidate_path();
        std::fs::rename(path, &candidate).map_err(|error| TrainError::File {
            path: path.to_path_buf(),
            error,
        })?;
        let hash = Tensors::fingerprint_of(&FileSource::open(&candidate)?)?;
        Ok((candidate, hash))
    }

    fn apply_change(&mut self, path: &Path) -> Result<(PathBuf, String), String> {
        let candidate = self.candidate_path();
        let apply = || {
            let change = FileSource::open(path)?;
            let model = FileSource::open(&self.global_path())?;
            Update::from_source(&change)?.add_to_file(&model, &candidate, Metadata::new())
        };
        let hash = apply().map_err(|error: hypha_diloco::Error| error.to_string())?;
        Ok((candidate, hash))
    }

    fn remember_sync(&mut self) -> Result<(), TrainError> {
        Ok(())
    }

    /// Nothing is learned ahead: the new global model is taken as it is.
    fn start(&mut self, global: Option<(PathBuf, String)>, _: bool) -> Result<(), TrainError> {
        if let Some((global, hash)) = global {
            let path = self.global_path();
            std::fs::rename(&global, &path).map_err(|error| TrainError::File { path, error })?;
            self.global_hash = hash;
        }
        Ok(())
    }

    fn forget_dropped(&mut self) {}
}

/// Writes `bytes` to the file at `path`.
fn write_file(path: &Path, bytes: &[u8]) -> Result<(), TrainError> {
    std::fs::write(path, bytes).map_err(|error| TrainError::File {
        path: path.to_path_buf(),
        error,
    })
}
