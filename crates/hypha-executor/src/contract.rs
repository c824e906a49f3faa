//! The data contract between datasets and the reference executor's models: which tensors of a
//! slice a model reads, and how they are converted.
//!
//! A job names its tensors in its `[config]` (`input = "…"`, `target = "…"`); by default:
//!
//! - **input**: the first of [`DEFAULT_INPUTS`] (`inputs`, `images`, `input_ids`, `tokens`)
//!   that the slice holds;
//! - **target**: `labels` for the classifiers (`mlp`, `cnn`); none for the `transformer`, which
//!   predicts each next token of its input;
//! - **attention mask**: `attention_mask` when the slice holds one beside a transformer's input
//!   (1 marks a real token, 0 padding), as `hypha-data prepare` writes text.
//!
//! Conversions:
//!
//! | model | input | dtypes | becomes |
//! |---|---|---|---|
//! | `mlp` | `[N, …]` | any numeric | f32 `[N, features]`, features = the product of the other dimensions, which must equal `inputs` |
//! | `cnn` | `[N, C, H, W]` or `[N, H, W]` (one channel) | any numeric | f32 `[N, C, H, W]`; `C` must equal `channels`, `H`, `W` ≥ 2 |
//! | `transformer` | `[N, L]` | integer | token ids `[N, L]`, each below `vocab`; `L − 1` ≤ `context` (positions `0..L−1` predict `1..L`) |
//!
//! Numeric dtypes are `BOOL`, `U8`, `I8`, `U16`, `I16`, `U32`, `I32`, `U64`, `I64`, `F16`,
//! `BF16`, `F32` and `F64`. A `U8` input of a classifier is read as pixel intensities and
//! scaled to `[0, 1]`; other dtypes keep their values. Class labels are an integer tensor `[N]`
//! (or `[N, 1]`) with values in `0..classes`.
//!
//! [`plan`] checks a slice's schema (from a manifest or a slice's header) against a model
//! before anything is trained, and says what is wrong and how to fix it; the scheduler runs the
//! same check on the dataset's manifest before it leases a worker. [`Batch::read`] converts a
//! slice's tensors as planned and checks their values (labels in range, token ids below the
//! vocabulary).

use candle_core::{Device, Tensor};
use hypha_dataset::TensorSpec;
use safetensors::{Dtype, SafeTensors};
use serde::{Deserialize, Serialize};

use crate::model::{Batch, ModelSpec};

/// Input tensors tried, in this order, when the job names none.
pub const DEFAULT_INPUTS: [&str; 4] = ["inputs", "images", "input_ids", "tokens"];
/// The classifiers' target when the job names none.
pub const DEFAULT_TARGET: &str = "labels";
/// The transformer's padding mask, used when present.
pub const ATTENTION_MASK: &str = "attention_mask";
/// The most values (C × H × W) of one image the cnn takes: its activations grow with the
/// image (two convolutions of 16 and 32 filters by default, on a CPU), and the image size
/// comes from the data node, not the job.
pub const MAX_IMAGE_VALUES: u64 = 3 * 256 * 256;

/// The tensor names a job chose (`[config] input`, `[config] target`); `None` takes the
/// defaults.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorNames {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
}

/// The tensors a model reads from a slice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub input: String,
    pub target: Option<String>,
    pub mask: Option<String>,
}

/// Why a dataset does not fit a model: the tensor, what it is, what the model expects, and
/// the fix. Its message is meant for the person who wrote the job.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{problem}; {fix}")]
pub struct ContractError {
    pub problem: String,
    pub fix: String,
}

impl ContractError {
    fn new(problem: impl Into<String>, fix: impl Into<String>) -> Self {
        Self {
            problem: problem.into(),
            fix: fix.into(),
        }
    }
}

/// Decides which tensors of a slice with `schema` the model reads, and checks that they fit.
pub fn plan(
    model: &ModelSpec,
    names: &TensorNames,
    schema: &[TensorSpec],
) -> Result<Plan, ContractError> {
    let find = |name: &str| schema.iter().find(|t| t.name == name);
    let input = select_input(names, schema)?;
    let dtype = parse_dtype(input)?;
    match *model {
        ModelSpec::Mlp { inputs, .. } => {
            require_numeric(input, dtype, "the mlp")?;
            // A manifest comes from a data node: its shapes may be absurd, never a panic.
            let features = features_of(&input.shape);
            if input.shape.is_empty() || features != Some(inputs as u64) {
                let features = features.map_or("more than 2^64".into(), |f| f.to_string());
                return Err(ContractError::new(
                    format!(
                        "tensor {:?} is {} {:?}: {features} features a sample; the mlp expects inputs = {inputs}",
                        input.name, input.dtype, input.shape
                    ),
                    format!("set `inputs = {features}` in `[config] model`"),
                ));
            }
        }
        ModelSpec::Cnn { channels, .. } => {
            require_numeric(input, dtype, "the cnn")?;
            check_images(input, channels as u64)?;
        }
        ModelSpec::Transformer { context, .. } => check_sequences(input, dtype, context)?,
    }
    let target = select_target(model, names, schema, input)?;
    let mask = match model {
        ModelSpec::Transformer { .. } => find(ATTENTION_MASK)
            .filter(|mask| mask.name != input.name)
            .map(|mask| {
                if mask.shape != input.shape {
                    return Err(ContractError::new(
                        format!(
                            "tensor {ATTENTION_MASK:?} is {:?}, tensor {:?} is {:?}; the mask must have one entry per token",
                            mask.shape, input.name, input.shape
                        ),
                        format!("store the mask with the shape of {:?}, or drop it", input.name),
                    ));
                }
                require_numeric(mask, parse_dtype(mask)?, "the attention mask")?;
                Ok(mask.name.clone())
            })
            .transpose()?,
        _ => None,
    };
    Ok(Plan {
        input: input.name.clone(),
        target,
        mask,
    })
}

/// Images of `channels` channels the cnn can read: [N, C, H, W] or [N, H, W], at least 2×2
/// and at most [`MAX_IMAGE_VALUES`] values a sample.
fn check_images(input: &TensorSpec, channels: u64) -> Result<(), ContractError> {
    let (c, h, w) = match input.shape[..] {
        [_, c, h, w] => (c, h, w),
        [_, h, w] => (1, h, w),
        _ => {
            return Err(ContractError::new(
                format!(
                    "tensor {:?} is {} {:?}; the cnn reads images as [N, C, H, W] or [N, H, W]",
                    input.name, input.dtype, input.shape
                ),
                "store the images channels-first, or train flat features with `model = { type = \"mlp\", … }`",
            ));
        }
    };
    if c != channels {
        let looks_channels_last = input.shape.len() == 4 && w == channels;
        return Err(ContractError::new(
            format!(
                "tensor {:?} is {} {:?}: {c} channel(s); the cnn expects channels = {channels}",
                input.name, input.dtype, input.shape
            ),
            if looks_channels_last {
                format!(
                    "the images look channels-last [N, H, W, C]: store them as [N, C, H, W], or set `channels = {c}` in `[config] model`"
                )
            } else {
                format!("set `channels = {c}` in `[config] model`")
            },
        ));
    }
    let values = c.checked_mul(h).and_then(|v| v.checked_mul(w));
    if values.is_none_or(|v| v > MAX_IMAGE_VALUES) {
        return Err(ContractError::new(
            format!(
                "tensor {:?} is {} {:?}: images of {c}×{h}×{w} values; the cnn takes at most {MAX_IMAGE_VALUES} a sample",
                input.name, input.dtype, input.shape
            ),
            "resize the images (`hypha-data prepare --image-size`)",
        ));
    }
    if h < 2 || w < 2 {
        return Err(ContractError::new(
            format!(
                "tensor {:?} is {} {:?}: images of {h}×{w}; the cnn needs at least 2×2",
                input.name, input.dtype, input.shape
            ),
            "train these features with `model = { type = \"mlp\", … }`",
        ));
    }
    Ok(())
}

/// Token ids the transformer can read: an integer tensor [N, L] of sequences of at least
/// 2 tokens whose L − 1 positions fit its `context`.
fn check_sequences(input: &TensorSpec, dtype: Dtype, context: usize) -> Result<(), ContractError> {
    if !is_integer(dtype) {
        return Err(ContractError::new(
            format!(
                "tensor {:?} is {} {:?}; the transformer reads token ids, an integer tensor [N, L]",
                input.name, input.dtype, input.shape
            ),
            "set `[config] input` to the token ids (`hypha-data prepare` writes text as \"input_ids\")",
        ));
    }
    let [_, length] = input.shape[..] else {
        return Err(ContractError::new(
            format!(
                "tensor {:?} is {} {:?}; the transformer reads sequences [N, L]",
                input.name, input.dtype, input.shape
            ),
            "store one row of token ids per sequence",
        ));
    };
    if length < 2 {
        return Err(ContractError::new(
            format!(
                "tensor {:?} is {} {:?}: sequences of {length} token(s); predicting the next token needs at least 2",
                input.name, input.dtype, input.shape
            ),
            "prepare the text with `--sequence-length` 2 or more",
        ));
    }
    if length - 1 > context as u64 {
        return Err(ContractError::new(
            format!(
                "tensor {:?} is {} {:?}: each sequence has {} positions that predict the next token; the transformer's context is {context}",
                input.name,
                input.dtype,
                input.shape,
                length - 1
            ),
            format!(
                "set `context = {}` in `[config] model`, or prepare the text with `--sequence-length {}`",
                length - 1,
                context.saturating_add(1)
            ),
        ));
    }
    Ok(())
}

/// The class labels the model reads beside `input`: the tensor `[config] target` names (or
/// [`DEFAULT_TARGET`]), an integer tensor of one label per sample; none for the
/// transformer, which predicts its input's next tokens.
fn select_target(
    model: &ModelSpec,
    names: &TensorNames,
    schema: &[TensorSpec],
    input: &TensorSpec,
) -> Result<Option<String>, ContractError> {
    let find = |name: &str| schema.iter().find(|t| t.name == name);
    let rows = input.shape.first().copied();
    match (model, &names.target) {
        (ModelSpec::Transformer { .. }, Some(name)) => Err(ContractError::new(
            format!(
                "`[config] target = {name:?}`, but the transformer predicts each next token of its input and takes no target"
            ),
            "remove `target` from `[config]`",
        )),
        (ModelSpec::Transformer { .. }, None) => Ok(None),
        (_, named) => {
            let name = named.as_deref().unwrap_or(DEFAULT_TARGET);
            let target = find(name).ok_or_else(|| {
                let integers: Vec<&TensorSpec> = schema
                    .iter()
                    .filter(|t| t.name != input.name && parse_dtype(t).is_ok_and(is_integer))
                    .collect();
                ContractError::new(
                    format!(
                        "the slices have no target tensor {name:?} (they hold {})",
                        listing(schema)
                    ),
                    match integers.first() {
                        Some(t) => format!("set `[config] target = {:?}`", t.name),
                        None => "add an integer tensor of class labels [N] to the slices".into(),
                    },
                )
            })?;
            let target_dtype = parse_dtype(target)?;
            if !is_integer(target_dtype) {
                return Err(ContractError::new(
                    format!(
                        "tensor {:?} is {} {:?}; class labels must be integers (0 to classes − 1)",
                        target.name, target.dtype, target.shape
                    ),
                    "store the labels as an integer tensor (I64, I32 or U8), or set `[config] target` to one",
                ));
            }
            let flat = matches!(target.shape[..], [_] | [_, 1]);
            if !flat || target.shape.first().copied() != rows {
                return Err(ContractError::new(
                    format!(
                        "tensor {:?} is {} {:?}, tensor {:?} is {:?}; the labels must be one class per sample, [N] with N = {}",
                        target.name,
                        target.dtype,
                        target.shape,
                        input.name,
                        input.shape,
                        rows.unwrap_or(0)
                    ),
                    "store one label per sample",
                ));
            }
            Ok(Some(target.name.clone()))
        }
    }
}

/// The input tensor: the one the job names, else the first of [`DEFAULT_INPUTS`] present.
pub fn select_input<'a>(
    names: &TensorNames,
    schema: &'a [TensorSpec],
) -> Result<&'a TensorSpec, ContractError> {
    let find = |name: &str| schema.iter().find(|t| t.name == name);
    match &names.input {
        Some(name) => find(name).ok_or_else(|| {
            ContractError::new(
                format!(
                    "the slices have no tensor {name:?} (they hold {})",
                    listing(schema)
                ),
                format!("set `[config] input` to one of {}", names_of(schema)),
            )
        }),
        None => DEFAULT_INPUTS
            .iter()
            .find_map(|name| find(name))
            .ok_or_else(|| {
                ContractError::new(
                    format!(
                        "the slices hold none of the default inputs {} (they hold {})",
                        DEFAULT_INPUTS.join(", "),
                        listing(schema)
                    ),
                    format!("set `[config] input` to one of {}", names_of(schema)),
                )
            }),
    }
}

/// Checks every distinct schema of a dataset's slices (they may differ beyond the sample
/// count) against the model; the first misfit, naming its slice.
pub fn check_manifest(
    model: &ModelSpec,
    names: &TensorNames,
    manifest: &hypha_dataset::Manifest,
) -> Result<Plan, ContractError> {
    let mut first = None;
    for (slice, _) in manifest.schemas() {
        let plan = plan(model, names, &slice.tensors).map_err(|e| ContractError {
            problem: format!("slice {} ({}): {}", slice.index, slice.file, e.problem),
            fix: e.fix,
        })?;
        first.get_or_insert(plan);
    }
    first.ok_or_else(|| {
        ContractError::new(
            format!("dataset {:?} has no slices", manifest.name),
            "serve a dataset with at least one slice",
        )
    })
}

/// Features a sample: the product of every dimension but the first (`None` past u64).
pub(crate) fn features_of(shape: &[u64]) -> Option<u64> {
    shape
        .iter()
        .skip(1)
        .try_fold(1u64, |product, &d| product.checked_mul(d))
}

fn listing(schema: &[TensorSpec]) -> String {
    if schema.is_empty() {
        return "no tensors".into();
    }
    schema
        .iter()
        .map(|t| format!("{:?} {} {:?}", t.name, t.dtype, t.shape))
        .collect::<Vec<_>>()
        .join(", ")
}

fn names_of(schema: &[TensorSpec]) -> String {
    schema
        .iter()
        .map(|t| format!("{:?}", t.name))
        .collect::<Vec<_>>()
        .join(", ")
}

pub(crate) fn parse_dtype(tensor: &TensorSpec) -> Result<Dtype, ContractError> {
    serde_json::from_value(serde_json::Value::String(tensor.dtype.clone())).map_err(|_| {
        ContractError::new(
            format!(
                "tensor {:?} has dtype {:?}, which this executor does not read",
                tensor.name, tensor.dtype
            ),
            "store it as F32, F16, BF16, I64, I32 or U8",
        )
    })
}

pub(crate) fn is_integer(dtype: Dtype) -> bool {
    matches!(
        dtype,
        Dtype::BOOL
            | Dtype::U8
            | Dtype::I8
            | Dtype::U16
            | Dtype::I16
            | Dtype::U32
            | Dtype::I32
            | Dtype::U64
            | Dtype::I64
    )
}

fn is_numeric(dtype: Dtype) -> bool {
    is_integer(dtype) || matches!(dtype, Dtype::F16 | Dtype::BF16 | Dtype::F32 | Dtype::F64)
}

fn require_numeric(tensor: &TensorSpec, dtype: Dtype, reader: &str) -> Result<(), ContractError> {
    if is_numeric(dtype) {
        return Ok(());
    }
    Err(ContractError::new(
        format!(
            "tensor {:?} is {} {:?}; {reader} reads integers or F16, BF16, F32, F64",
            tensor.name, tensor.dtype, tensor.shape
        ),
        "store it as F32, F16, BF16, I64, I32 or U8",
    ))
}

/// Why a slice could not be read into a batch.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("the slice is not SafeTensors: {0}")]
    SafeTensors(safetensors::SafeTensorError),
    #[error(transparent)]
    Contract(#[from] ContractError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

impl Batch {
    /// Reads the tensors of a SafeTensors buffer that `model` needs, converted and checked.
    pub fn read(bytes: &[u8], model: &ModelSpec, names: &TensorNames) -> Result<Self, DataError> {
        let tensors = SafeTensors::deserialize(bytes).map_err(DataError::SafeTensors)?;
        let schema: Vec<TensorSpec> = tensors
            .tensors()
            .into_iter()
            .map(|(name, view)| TensorSpec {
                name,
                dtype: view.dtype().to_string(),
                shape: view.shape().iter().map(|&d| d as u64).collect(),
            })
            .collect();
        let plan = plan(model, names, &schema)?;
        let view = |name: &str| tensors.tensor(name).map_err(DataError::SafeTensors);
        let input = view(&plan.input)?;
        let rows = input.shape().first().copied().unwrap_or(0);
        let input = match *model {
            ModelSpec::Mlp { inputs, .. } => {
                let values = to_f32(&input, true);
                Tensor::from_vec(values, (rows, inputs), &Device::Cpu)?
            }
            ModelSpec::Cnn { .. } => {
                let shape = match input.shape() {
                    &[n, h, w] => vec![n, 1, h, w],
                    other => other.to_vec(),
                };
                Tensor::from_vec(to_f32(&input, true), shape, &Device::Cpu)?
            }
            ModelSpec::Transformer { vocab, .. } => {
                let ids = to_class(&input, vocab).map_err(|value| {
                    ContractError::new(
                        format!(
                            "tensor {:?} holds token id {value}; the transformer's vocabulary has vocab = {vocab} ids (0 to {})",
                            plan.input,
                            vocab.saturating_sub(1)
                        ),
                        format!(
                            "set `vocab` in `[config] model` above the largest token id (at least {})",
                            value.max(0) + 1
                        ),
                    )
                })?;
                Tensor::from_vec(ids, input.shape(), &Device::Cpu)?
            }
        };
        let target = match (&plan.target, model) {
            (Some(name), ModelSpec::Mlp { classes, .. } | ModelSpec::Cnn { classes, .. }) => {
                let view = view(name)?;
                let labels = to_class(&view, *classes).map_err(|value| {
                    ContractError::new(
                        format!(
                            "tensor {name:?} holds class {value}; the model has classes = {classes} (0 to {})",
                            classes.saturating_sub(1)
                        ),
                        if value < 0 {
                            "store class labels as 0, 1, 2, …".to_string()
                        } else {
                            format!("set `classes = {}` in `[config] model`", value + 1)
                        },
                    )
                })?;
                Some(Tensor::from_vec(labels, rows, &Device::Cpu)?)
            }
            _ => None,
        };
        let mask = match &plan.mask {
            Some(name) => {
                let view = view(name)?;
                let values = to_f32(&view, false)
                    .into_iter()
                    .map(|v| if v != 0.0 { 1.0 } else { 0.0 })
                    .collect::<Vec<f32>>();
                Some(Tensor::from_vec(values, view.shape(), &Device::Cpu)?)
            }
            None => None,
        };
        Ok(Self {
            input,
            target,
            mask,
        })
    }

    /// Samples in the batch.
    pub fn rows(&self) -> usize {
        self.input.dims().first().copied().unwrap_or(0)
    }

    /// The rows of `batches`, one after another (they must have the same parts).
    pub fn concat(batches: &[Batch]) -> Result<Self, candle_core::Error> {
        let joined =
            |part: fn(&Batch) -> Option<&Tensor>| -> Result<Option<Tensor>, candle_core::Error> {
                let parts: Option<Vec<&Tensor>> = batches.iter().map(part).collect();
                parts
                    .filter(|p| !p.is_empty())
                    .map(|p| Tensor::cat(&p, 0))
                    .transpose()
            };
        Ok(Self {
            input: joined(|b| Some(&b.input))?
                .ok_or_else(|| candle_core::Error::Msg("no batches to join".into()))?,
            target: joined(|b| b.target.as_ref())?,
            mask: joined(|b| b.mask.as_ref())?,
        })
    }

    /// Rows `start..start + len`.
    pub fn narrow(&self, start: usize, len: usize) -> Result<Self, candle_core::Error> {
        let part = |t: &Tensor| t.narrow(0, start, len);
        Ok(Self {
            input: part(&self.input)?,
            target: self.target.as_ref().map(part).transpose()?,
            mask: self.mask.as_ref().map(part).transpose()?,
        })
    }
}

/// Every element as f32; `U8` scaled to `[0, 1]` when `scale_bytes` (pixel intensities).
fn to_f32(view: &safetensors::tensor::TensorView<'_>, scale_bytes: bool) -> Vec<f32> {
    let data = view.data();
    macro_rules! each {
        ($n:literal, $conv:expr) => {
            data.chunks_exact($n)
                .map(|b| $conv(b.try_into().unwrap_or([0; $n])))
                .collect()
        };
    }
    match view.dtype() {
        Dtype::BOOL => data.iter().map(|&b| f32::from(u8::from(b != 0))).collect(),
        Dtype::U8 if scale_bytes => data.iter().map(|&b| f32::from(b) / 255.0).collect(),
        Dtype::U8 => data.iter().map(|&b| f32::from(b)).collect(),
        Dtype::I8 => data.iter().map(|&b| f32::from(b as i8)).collect(),
        Dtype::U16 => each!(2, |b| f32::from(u16::from_le_bytes(b))),
        Dtype::I16 => each!(2, |b| f32::from(i16::from_le_bytes(b))),
        Dtype::F16 => each!(2, |b| half::f16::from_le_bytes(b).to_f32()),
        Dtype::BF16 => each!(2, |b| half::bf16::from_le_bytes(b).to_f32()),
        Dtype::U32 => each!(4, |b| u32::from_le_bytes(b) as f32),
        Dtype::I32 => each!(4, |b| i32::from_le_bytes(b) as f32),
        Dtype::F32 => each!(4, f32::from_le_bytes),
        Dtype::U64 => each!(8, |b| u64::from_le_bytes(b) as f32),
        Dtype::I64 => each!(8, |b| i64::from_le_bytes(b) as f32),
        Dtype::F64 => each!(8, |b| f64::from_le_bytes(b) as f32),
        // `plan` refuses every other dtype before a batch is read.
        _ => Vec::new(),
    }
}

/// Integer elements as u32 indices below `limit`; the first value out of range, if any.
pub(crate) fn to_class(
    view: &safetensors::tensor::TensorView<'_>,
    limit: usize,
) -> Result<Vec<u32>, i128> {
    integers(view)
        .into_iter()
        .map(|v| match u32::try_from(v) {
            Ok(id) if (id as usize) < limit => Ok(id),
            _ => Err(v),
        })
        .collect()
}

/// The elements of an integer tensor (empty for other dtypes: `plan` refuses non-integer
/// labels and token ids before a batch is read).
pub(crate) fn integers(view: &safetensors::tensor::TensorView<'_>) -> Vec<i128> {
    let data = view.data();
    macro_rules! each {
        ($n:literal, $conv:expr) => {
            data.chunks_exact($n)
                .map(|b| i128::from($conv(b.try_into().unwrap_or([0; $n]))))
                .collect()
        };
    }
    match view.dtype() {
        Dtype::BOOL | Dtype::U8 => data.iter().map(|&b| i128::from(b)).collect(),
        Dtype::I8 => data.iter().map(|&b| i128::from(b as i8)).collect(),
        Dtype::U16 => each!(2, u16::from_le_bytes),
        Dtype::I16 => each!(2, i16::from_le_bytes),
        Dtype::U32 => each!(4, u32::from_le_bytes),
        Dtype::I32 => each!(4, i32::from_le_bytes),
        Dtype::U64 => each!(8, u64::from_le_bytes),
        Dtype::I64 => each!(8, i64::from_le_bytes),
        _ => Vec::new(),
    }
}
