//! Datasets on this machine: a model scored on their slices (read through the data contract
//! exactly as a trainer reads them), and the model a dataset suggests when nobody named one.

use std::{ops::Range, path::Path};

use hypha_dataset::{Dataset, slice};

use crate::{
    contract::{self, ContractError, DataError, TensorNames},
    model::{Batch, Model, ModelError, ModelSpec},
};

/// The most classes (or vocabulary entries) a suggested model gets: one stray label of a
/// billion must not become a billion outputs.
const MAX_SUGGESTED_CLASSES: i128 = 1 << 20;

/// Rows scored at a time, so that a large slice never becomes one huge forward pass.
const CHUNK_ROWS: usize = 1024;

/// A model's loss and accuracy over some samples.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Score {
    pub loss: f64,
    /// Of the labels, or of the next tokens.
    pub accuracy: f64,
    pub samples: u64,
    /// Targets scored: the samples' labels, or the sequences' real next tokens.
    pub targets: u64,
}

/// Why a dataset could not be scored.
#[derive(Debug, thiserror::Error)]
pub enum EvaluateError {
    #[error(transparent)]
    Dataset(#[from] hypha_dataset::Error),
    #[error(
        "slices {start}..{end} are not in the dataset, which has {count}; name a range within 0..{count}"
    )]
    Range {
        start: usize,
        end: usize,
        count: usize,
    },
    #[error("{file}: {error}")]
    Read {
        file: String,
        error: Box<SliceReadError>,
    },
    #[error(transparent)]
    Contract(#[from] ContractError),
    #[error(transparent)]
    Model(#[from] ModelError),
}

/// Why a slice file of the dataset could not be read.
#[derive(Debug, thiserror::Error)]
pub enum SliceReadError {
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Slice(#[from] hypha_dataset::slice::SliceError),
    #[error(transparent)]
    SafeTensors(#[from] safetensors::SafeTensorError),
    #[error(transparent)]
    Batch(#[from] DataError),
}

/// Scores `model` on `slices` of the dataset at `dir` (every slice when `None`): means over
/// every target scored (each sample's label, or each real next token).
pub fn evaluate_dataset(
    model: &Model,
    dir: &Path,
    names: &TensorNames,
    slices: Option<Range<usize>>,
) -> Result<Score, EvaluateError> {
    let dataset = Dataset::open(dir)?;
    let manifest = dataset.manifest();
    contract::check_manifest(model.spec(), names, manifest)?;
    let count = manifest.slices.len();
    let range = slices.unwrap_or(0..count);
    if range.start >= range.end || range.end > count {
        return Err(EvaluateError::Range {
            start: range.start,
            end: range.end,
            count,
        });
    }
    let mut tally = Tally::default();
    for entry in &manifest.slices[range] {
        let read_error = |error: SliceReadError| EvaluateError::Read {
            file: dataset.root().join(&entry.file).display().to_string(),
            error: Box::new(error),
        };
        let bytes =
            std::fs::read(dataset.root().join(&entry.file)).map_err(|e| read_error(e.into()))?;
        let (_, plain) = slice::decode(&bytes).map_err(|e| read_error(e.into()))?;
        let batch = Batch::read(&plain, model.spec(), names).map_err(|e| match e {
            DataError::Contract(e) => EvaluateError::Contract(e),
            other => read_error(other.into()),
        })?;
        tally.add(model, &batch)?;
    }
    Ok(tally.score())
}

/// A score summed over batches, each target (a sample's label, a real next token) counting
/// once: what [`evaluate_dataset`] and a trainer scoring held-out slices both report.
#[derive(Debug, Default)]
pub struct Tally {
    loss: f64,
    accuracy: f64,
    targets: f64,
    samples: u64,
}

impl Tally {
    /// Scores `model` on `batch`, [`CHUNK_ROWS`] rows at a time.
    pub fn add(&mut self, model: &Model, batch: &Batch) -> Result<(), ModelError> {
        let rows = batch.rows();
        for start in (0..rows).step_by(CHUNK_ROWS) {
            let take = CHUNK_ROWS.min(rows - start);
            let chunk = batch.narrow(start, take).map_err(ModelError::from)?;
            let (loss, accuracy, targets) = model.evaluate_counted(&chunk)?;
            self.loss += loss * targets;
            self.accuracy += accuracy * targets;
            self.targets += targets;
            self.samples += take as u64;
        }
        Ok(())
    }

    /// The means over every target scored.
    pub fn score(&self) -> Score {
        let total = self.targets.max(1.0);
        Score {
            loss: self.loss / total,
            accuracy: self.accuracy / total,
            samples: self.samples,
            targets: self.targets as u64,
        }
    }
}

/// The model a dataset suggests, with the hidden sizes of the quickstart:
///
/// - integer sequences `[N, L]` and no target (`input_ids` or `tokens` from `hypha-data
///   prepare`, the seed recipe or the synthetic sets): a transformer with `context = L − 1`
///   and `vocab` one above the largest token id in the dataset;
/// - images `[N, C, H, W]` (or `[N, H, W]`) with labels: a cnn of `C` channels;
/// - anything else with labels: an mlp over the flattened samples;
///
/// with `classes` one above the largest label in the dataset. Every slice is read once.
pub fn suggest_model(dir: &Path, names: &TensorNames) -> Result<ModelSpec, EvaluateError> {
    let dataset = Dataset::open(dir)?;
    let manifest = dataset.manifest();
    let first = manifest.slices.first().ok_or_else(|| ContractError {
        problem: format!("dataset {:?} has no slices", manifest.name),
        fix: "give a directory of slices".into(),
    })?;
    let input = contract::select_input(names, &first.tensors)?;
    let target_name = names
        .target
        .clone()
        .unwrap_or_else(|| contract::DEFAULT_TARGET.to_string());
    let has_target = first.tensors.iter().any(|t| t.name == target_name);
    let integer_input = contract::parse_dtype(input).is_ok_and(contract::is_integer);
    let language = integer_input && input.shape.len() == 2 && names.target.is_none() && !has_target;
    let scanned = if language { &input.name } else { &target_name };
    let largest = largest_value(&dataset, scanned)?;
    if largest >= MAX_SUGGESTED_CLASSES {
        return Err(EvaluateError::Contract(ContractError {
            problem: format!(
                "tensor {scanned:?} holds {largest}; a model suggested from it would have {} outputs",
                largest + 1
            ),
            fix: "check that tensor, or name the model with --model".into(),
        }));
    }
    let classes = usize::try_from(largest.max(1) + 1).unwrap_or(usize::MAX);
    let spec = if language {
        ModelSpec::Transformer {
            vocab: classes,
            context: input.shape[1].saturating_sub(1).max(1) as usize,
            dim: 64,
            heads: 4,
            layers: 2,
        }
    } else {
        match input.shape[..] {
            [_, c, _, _] => ModelSpec::Cnn {
                channels: c as usize,
                classes,
                width: 16,
            },
            [_, _, _] => ModelSpec::Cnn {
                channels: 1,
                classes,
                width: 16,
            },
            _ => ModelSpec::Mlp {
                inputs: contract::features_of(&input.shape)
                    .and_then(|f| usize::try_from(f).ok())
                    .unwrap_or(usize::MAX),
                hidden: 64,
                classes,
            },
        }
    };
    Ok(spec)
}

/// The largest value of integer tensor `name` over every slice.
fn largest_value(dataset: &Dataset, name: &str) -> Result<i128, EvaluateError> {
    let mut largest = None;
    for entry in &dataset.manifest().slices {
        let path = dataset.root().join(&entry.file);
        let read_error = |error: SliceReadError| EvaluateError::Read {
            file: path.display().to_string(),
            error: Box::new(error),
        };
        let bytes = std::fs::read(&path).map_err(|e| read_error(e.into()))?;
        let (_, plain) = slice::decode(&bytes).map_err(|e| read_error(e.into()))?;
        let tensors =
            safetensors::SafeTensors::deserialize(&plain).map_err(|e| read_error(e.into()))?;
        let view = tensors.tensor(name).map_err(|_| {
            EvaluateError::Contract(ContractError {
                problem: format!("{} has no tensor {name:?}", path.display()),
                fix: "name the model with --model, or the tensors with --input and --target".into(),
            })
        })?;
        let values = contract::integers(&view);
        if values.is_empty() && view.shape().iter().product::<usize>() > 0 {
            return Err(EvaluateError::Contract(ContractError {
                problem: format!(
                    "tensor {name:?} is {} {:?}; class labels and token ids must be integers",
                    view.dtype(),
                    view.shape()
                ),
                fix: "name the tensors with --input and --target".into(),
            }));
        }
        largest = values.into_iter().max().max(largest);
    }
    Ok(largest.unwrap_or(0))
}
