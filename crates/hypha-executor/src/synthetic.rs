//! Small learnable datasets, made from a seed, for the quickstart, tests and benchmarks.
//!
//! - **blobs** (for the `mlp` family): `inputs` drawn around one of `classes` fixed centres
//!   in `inputs` dimensions, `labels` the centre's number. The centres depend only on the
//!   sizes, so training and evaluation sets made with different seeds share them.
//! - **patterns** (for the `cnn` family): `images` `[C, 8, 8]`, each one of `classes` fixed
//!   random patterns with noise added, `labels` the pattern's number.
//! - **sequences** (for the `transformer` family): `tokens` rows of `context + 1` tokens
//!   counting up modulo `vocab` by a step (1, 2 or 3) each row picks: the next token follows
//!   from the ones before, once the step is seen.
//!
//! Slices are written as the seed-000 recipe writes them (Snappy over SafeTensors) and named
//! `slice-0000.safetensors`, … so that a data node serves the directory as it is.

use std::path::Path;

use hypha_dataset::slice::{self, Dtype, Encoding};
use rand::{Rng, SeedableRng, rngs::StdRng};
use serde::{Deserialize, Serialize};

use crate::{
    contract::{DataError, TensorNames},
    model::{Batch, ModelSpec},
};

/// A synthetic dataset for one model.
#[derive(Debug, Clone, PartialEq)]
pub struct Synthetic {
    model: ModelSpec,
    shape: Shape,
}

/// A synthetic dataset's shape.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Shape {
    Blobs { inputs: usize, classes: usize },
    Patterns { channels: usize, classes: usize },
    Sequences { vocab: usize, context: usize },
}

/// The side of a pattern image.
const PATTERN_SIZE: usize = 8;

/// How far a blob's points lie from its centre (the centres are unit normal).
const SPREAD: f32 = 1.25;

impl Synthetic {
    /// The dataset a model of `spec` learns from.
    pub fn for_model(spec: &ModelSpec) -> Self {
        let shape = match *spec {
            ModelSpec::Mlp {
                inputs, classes, ..
            } => Shape::Blobs { inputs, classes },
            ModelSpec::Cnn {
                channels, classes, ..
            } => Shape::Patterns { channels, classes },
            ModelSpec::Transformer { vocab, context, .. } => Shape::Sequences { vocab, context },
        };
        Self {
            model: spec.clone(),
            shape,
        }
    }

    /// `count` samples drawn from `seed`, as a slice's tensors: name → (dtype, shape, bytes).
    fn draw(&self, count: usize, seed: u64) -> Vec<(&'static str, Dtype, Vec<usize>, Vec<u8>)> {
        let mut rng = StdRng::seed_from_u64(seed);
        match self.shape {
            Shape::Blobs { inputs, classes } => {
                let centres = blob_centres(inputs, classes);
                let mut features = Vec::with_capacity(count * inputs * 4);
                let mut labels = Vec::with_capacity(count * 4);
                for _ in 0..count {
                    let class = rng.random_range(0..classes);
                    for centre in &centres[class] {
                        features.extend((centre + SPREAD * normal(&mut rng)).to_le_bytes());
                    }
                    labels.extend((class as u32).to_le_bytes());
                }
                vec![
                    ("inputs", Dtype::F32, vec![count, inputs], features),
                    ("labels", Dtype::U32, vec![count], labels),
                ]
            }
            Shape::Patterns { channels, classes } => {
                let pixels = channels * PATTERN_SIZE * PATTERN_SIZE;
                let patterns = blob_centres(pixels, classes);
                let mut images = Vec::with_capacity(count * pixels * 4);
                let mut labels = Vec::with_capacity(count * 8);
                for _ in 0..count {
                    let class = rng.random_range(0..classes);
                    for value in &patterns[class] {
                        images.extend((value + SPREAD * normal(&mut rng)).to_le_bytes());
                    }
                    labels.extend((class as i64).to_le_bytes());
                }
                vec![
                    (
                        "images",
                        Dtype::F32,
                        vec![count, channels, PATTERN_SIZE, PATTERN_SIZE],
                        images,
                    ),
                    ("labels", Dtype::I64, vec![count], labels),
                ]
            }
            Shape::Sequences { vocab, context } => {
                let mut tokens = Vec::with_capacity(count * (context + 1) * 4);
                for _ in 0..count {
                    let step = rng.random_range(1..=3usize);
                    let mut token = rng.random_range(0..vocab);
                    for _ in 0..=context {
                        tokens.extend((token as u32).to_le_bytes());
                        token = (token + step) % vocab;
                    }
                }
                vec![("tokens", Dtype::U32, vec![count, context + 1], tokens)]
            }
        }
    }

    /// Writes `slices` slices of `samples` samples each into `dir` (created if missing).
    pub fn write(
        &self,
        dir: &Path,
        slices: usize,
        samples: usize,
        seed: u64,
    ) -> Result<(), SyntheticError> {
        std::fs::create_dir_all(dir).map_err(|error| SyntheticError::Write {
            path: dir.display().to_string(),
            error,
        })?;
        for index in 0..slices {
            let tensors = self.tensors(samples, seed.wrapping_add(index as u64))?;
            let bytes = slice::encode(&tensors, Encoding::Snappy)?;
            let path = dir.join(format!("slice-{index:04}.safetensors"));
            hypha_files::write_atomic(&path, &bytes, hypha_files::Mode::Public, true)?;
        }
        Ok(())
    }

    /// `count` samples drawn from `seed` as a batch, read through the data contract as a
    /// slice would be.
    pub fn batch(&self, count: usize, seed: u64) -> Result<Batch, SyntheticError> {
        let plain = slice::encode(&self.tensors(count, seed)?, Encoding::Plain)?;
        Ok(Batch::read(&plain, &self.model, &TensorNames::default())?)
    }

    fn tensors(&self, count: usize, seed: u64) -> Result<slice::Tensors, SyntheticError> {
        let mut tensors = slice::Tensors::new();
        for (name, dtype, shape, data) in self.draw(count, seed) {
            tensors = tensors.with(name, dtype, shape, data)?;
        }
        Ok(tensors)
    }
}

/// Why a dataset was not written.
#[derive(Debug, thiserror::Error)]
pub enum SyntheticError {
    #[error("cannot create {path}: {error}")]
    Write { path: String, error: std::io::Error },
    #[error(transparent)]
    Slice(#[from] hypha_dataset::slice::SliceError),
    #[error(transparent)]
    File(#[from] hypha_files::Error),
    #[error(transparent)]
    Data(#[from] DataError),
}

fn blob_centres(inputs: usize, classes: usize) -> Vec<Vec<f32>> {
    let mut rng = StdRng::seed_from_u64(0xB10B_5EED ^ ((inputs as u64) << 16) ^ classes as u64);
    (0..classes)
        .map(|_| (0..inputs).map(|_| normal(&mut rng)).collect())
        .collect()
}

/// A standard normal draw (Box–Muller).
fn normal(rng: &mut StdRng) -> f32 {
    let u: f32 = rng.random_range(f32::EPSILON..1.0);
    let v: f32 = rng.random_range(0.0..1.0);
    (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
}
