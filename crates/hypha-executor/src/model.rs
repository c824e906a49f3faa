//! The model families the reference executor trains, on candle's CPU backend:
//!
//! - `{"type": "mlp", "inputs": 64, "hidden": 64, "classes": 10}`: a classifier of feature
//!   vectors (two hidden ReLU layers); samples of any shape are flattened to `inputs` features.
//! - `{"type": "cnn", "channels": 3, "classes": 10, "width": 16}`: a classifier of images
//!   `[C, H, W]` of any size: two 3×3 convolutions (`width` and `2 × width` filters, ReLU, a
//!   2×2 max-pool between them), global average pooling, a linear head.
//! - `{"type": "transformer", "vocab": 258, "context": 255, "dim": 64, "heads": 4, "layers":
//!   2}`: a small decoder-only transformer (pre-norm blocks, causal self-attention, learned
//!   positions) predicting each next token of its sequences; padding marked by an attention
//!   mask is neither attended to nor scored.
//!
//! Which tensors of a slice each reads, and how they are converted, is the data contract of
//! [`crate::contract`].
//!
//! Parameters are created from a seed, so the same spec and seed give the same model on every
//! machine; they travel as SafeTensors through [`hypha_diloco::Tensors`].

use std::collections::BTreeMap;

use candle_core::{D, DType, Device, Tensor, Var};
use candle_nn::{Conv2d, Conv2dConfig, Embedding, LayerNorm, Linear, Module, VarBuilder, VarMap};
use hypha_diloco::Metadata;
use rand::{Rng, SeedableRng, rngs::StdRng};
use serde::{Deserialize, Serialize};

/// Samples in the form a model reads them; the data contract ([`crate::contract`]) reads them
/// from a slice.
#[derive(Debug, Clone)]
pub struct Batch {
    /// f32 features (`[N, features]` for the mlp, `[N, C, H, W]` for the cnn), or u32 token
    /// ids `[N, L]` for the transformer.
    pub input: Tensor,
    /// u32 class labels `[N]`.
    pub target: Option<Tensor>,
    /// f32 `[N, L]`: 1 for a real token, 0 for padding.
    pub mask: Option<Tensor>,
}

/// A model family and its sizes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ModelSpec {
    Mlp {
        inputs: usize,
        hidden: usize,
        classes: usize,
    },
    Cnn {
        channels: usize,
        classes: usize,
        /// Filters of the first convolution (the second has twice as many).
        #[serde(default = "default_cnn_width")]
        width: usize,
    },
    Transformer {
        vocab: usize,
        context: usize,
        dim: usize,
        heads: usize,
        layers: usize,
    },
}

fn default_cnn_width() -> usize {
    16
}

/// Why a model could not be built, run or loaded.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error(transparent)]
    Tensors(#[from] hypha_diloco::Error),
    /// What of the model's spec does not fit (sizes, names, kinds), described for the job
    /// file's author; found by this crate's checks, not flattened from another error.
    #[error("{0}")]
    Spec(String),
    #[error("the batch has no {0}; this model needs one")]
    Missing(&'static str),
}

/// A model with its parameters.
pub struct Model {
    spec: ModelSpec,
    vars: VarMap,
    net: Net,
}

#[derive(Debug)]
enum Net {
    Mlp([Linear; 3]),
    Cnn(Cnn),
    Transformer(Transformer),
}

#[derive(Debug)]
struct Cnn {
    first: Conv2d,
    second: Conv2d,
    head: Linear,
}

#[derive(Debug)]
struct Transformer {
    tokens: Embedding,
    positions: Embedding,
    blocks: Vec<Block>,
    norm: LayerNorm,
    head: Linear,
    heads: usize,
}

#[derive(Debug)]
struct Block {
    norm1: LayerNorm,
    query: Linear,
    key: Linear,
    value: Linear,
    out: Linear,
    norm2: LayerNorm,
    up: Linear,
    down: Linear,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("spec", &self.spec)
            .finish_non_exhaustive()
    }
}

impl Model {
    /// A model of `spec` with parameters drawn from `seed`.
    pub fn new(spec: &ModelSpec, seed: u64) -> Result<Self, ModelError> {
        let vars = VarMap::new();
        let vb = VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
        let net = Net::build(spec, vb)?;
        let model = Self {
            spec: spec.clone(),
            vars,
            net,
        };
        model.initialise(seed)?;
        Ok(model)
    }
}

impl Net {
    /// The layers of a model of `spec`, their parameters asked of `vb`.
    fn build(spec: &ModelSpec, vb: VarBuilder) -> Result<Self, ModelError> {
        Ok(match *spec {
            ModelSpec::Mlp {
                inputs,
                hidden,
                classes,
            } => {
                if inputs == 0 || hidden == 0 || classes < 2 {
                    return Err(ModelError::Spec(
                        "an mlp needs inputs ≥ 1, hidden ≥ 1 and classes ≥ 2".into(),
                    ));
                }
                Net::Mlp([
                    candle_nn::linear(inputs, hidden, vb.pp("l1"))?,
                    candle_nn::linear(hidden, hidden, vb.pp("l2"))?,
                    candle_nn::linear(hidden, classes, vb.pp("l3"))?,
                ])
            }
            ModelSpec::Cnn {
                channels,
                classes,
                width,
            } => {
                if channels == 0 || width == 0 || classes < 2 {
                    return Err(ModelError::Spec(
                        "a cnn needs channels ≥ 1, width ≥ 1 and classes ≥ 2".into(),
                    ));
                }
                let same = Conv2dConfig {
                    padding: 1,
                    ..Conv2dConfig::default()
                };
                Net::Cnn(Cnn {
                    first: candle_nn::conv2d(channels, width, 3, same, vb.pp("conv1"))?,
                    second: candle_nn::conv2d(width, 2 * width, 3, same, vb.pp("conv2"))?,
                    head: candle_nn::linear(2 * width, classes, vb.pp("head"))?,
                })
            }
            ModelSpec::Transformer {
                vocab,
                context,
                dim,
                heads,
                layers,
            } => {
                if heads == 0 || dim % heads != 0 || vocab < 2 || context == 0 {
                    return Err(ModelError::Spec(format!(
                        "a transformer needs vocab ≥ 2, context ≥ 1 and dim ({dim}) divisible by heads ({heads})"
                    )));
                }
                let blocks = (0..layers)
                    .map(|i| {
                        let vb = vb.pp(format!("block{i}"));
                        Ok(Block {
                            norm1: candle_nn::layer_norm(dim, 1e-5, vb.pp("norm1"))?,
                            query: candle_nn::linear(dim, dim, vb.pp("query"))?,
                            key: candle_nn::linear(dim, dim, vb.pp("key"))?,
                            value: candle_nn::linear(dim, dim, vb.pp("value"))?,
                            out: candle_nn::linear(dim, dim, vb.pp("out"))?,
                            norm2: candle_nn::layer_norm(dim, 1e-5, vb.pp("norm2"))?,
                            up: candle_nn::linear(dim, 4 * dim, vb.pp("up"))?,
                            down: candle_nn::linear(4 * dim, dim, vb.pp("down"))?,
                        })
                    })
                    .collect::<Result<Vec<_>, candle_core::Error>>()?;
                Net::Transformer(Transformer {
                    tokens: candle_nn::embedding(vocab, dim, vb.pp("tokens"))?,
                    positions: candle_nn::embedding(context, dim, vb.pp("positions"))?,
                    blocks,
                    norm: candle_nn::layer_norm(dim, 1e-5, vb.pp("norm"))?,
                    head: candle_nn::linear(dim, vocab, vb.pp("head"))?,
                    heads,
                })
            }
        })
    }
}

impl ModelSpec {
    /// Every parameter's name and shape, in name order, without making the model: its
    /// layers are built over a backend that only records what they ask for.
    pub fn parameter_shapes(&self) -> Result<Vec<(String, Vec<usize>)>, ModelError> {
        let recorder = Recorder::default();
        let vb = VarBuilder::from_backend(Box::new(recorder.clone()), DType::F32, Device::Cpu);
        Net::build(self, vb)?;
        let shapes = recorder
            .0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone();
        Ok(shapes.into_iter().collect())
    }
}

/// Records the name and shape of every parameter a model asks for, and answers with a
/// broadcast zero of that shape (no memory: nothing is computed with it).
#[derive(Debug, Clone, Default)]
struct Recorder(std::sync::Arc<std::sync::Mutex<BTreeMap<String, Vec<usize>>>>);

impl candle_nn::var_builder::SimpleBackend for Recorder {
    fn get(
        &self,
        shape: candle_core::Shape,
        name: &str,
        _: candle_nn::Init,
        dtype: DType,
        device: &Device,
    ) -> candle_core::Result<Tensor> {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .insert(name.to_string(), shape.dims().to_vec());
        Tensor::zeros((), dtype, device)?.broadcast_as(shape)
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        Err(candle_core::Error::Msg(format!(
            "{name}: only shapes are recorded here"
        )))
    }

    fn contains_tensor(&self, _: &str) -> bool {
        false
    }
}

impl Model {
    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// The trainable parameters, in name order.
    pub fn parameters(&self) -> Vec<Var> {
        self.named().into_values().collect()
    }

    fn named(&self) -> BTreeMap<String, Var> {
        let data = self
            .vars
            .data()
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        data.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
    }

    /// Draws every parameter from `seed` ([`initial_values`]).
    fn initialise(&self, seed: u64) -> Result<(), ModelError> {
        let mut rng = StdRng::seed_from_u64(seed);
        for (name, var) in self.named() {
            let dims = var.dims().to_vec();
            let mut values = Vec::new();
            initial_values(&name, &dims, &mut rng, &mut values);
            var.set(&Tensor::from_vec(values, dims, &Device::Cpu)?)?;
        }
        Ok(())
    }

    /// The mean loss over `batch`: cross-entropy of the labels, or of each real next token.
    pub fn loss(&self, batch: &Batch) -> Result<Tensor, ModelError> {
        let scored = self.logits(batch)?;
        Ok(scored.cross_entropy()?)
    }

    /// Loss and accuracy (of the labels, or of the next tokens) over `batch`, without
    /// gradients.
    pub fn evaluate(&self, batch: &Batch) -> Result<(f64, f64), ModelError> {
        let (loss, accuracy, _) = self.evaluate_counted(batch)?;
        Ok((loss, accuracy))
    }

    /// [`evaluate`](Self::evaluate) with the number of targets scored (samples for the
    /// classifiers, real next tokens for the transformer), to weigh batches by.
    pub fn evaluate_counted(&self, batch: &Batch) -> Result<(f64, f64, f64), ModelError> {
        let scored = self.logits(batch)?;
        let loss = scored.cross_entropy()?.to_scalar::<f32>()?;
        let correct = scored
            .logits
            .argmax(D::Minus1)?
            .eq(&scored.targets)?
            .to_dtype(DType::F32)?;
        let (accuracy, counted) = match &scored.weights {
            Some(weights) => (
                weighted_mean(&correct, weights)?,
                weights.sum_all()?.to_scalar::<f32>()?,
            ),
            None => (correct.mean_all()?, scored.targets.dim(0)? as f32),
        };
        Ok((
            f64::from(loss),
            f64::from(accuracy.to_scalar::<f32>()?),
            f64::from(counted),
        ))
    }

    /// Logits `[rows, classes]` and the targets `[rows]` (U32) they are scored against.
    fn logits(&self, batch: &Batch) -> Result<Scored, ModelError> {
        match &self.net {
            Net::Mlp(layers) => {
                let hidden = layers[0].forward(&batch.input)?.relu()?;
                let hidden = layers[1].forward(&hidden)?.relu()?;
                Ok(Scored {
                    logits: layers[2].forward(&hidden)?,
                    targets: labels(batch)?,
                    weights: None,
                })
            }
            Net::Cnn(net) => Ok(Scored {
                logits: net.forward(&batch.input)?,
                targets: labels(batch)?,
                weights: None,
            }),
            Net::Transformer(net) => {
                let (rows, width) = batch.input.dims2()?;
                let length = width.saturating_sub(1);
                let inputs = batch.input.narrow(1, 0, length)?;
                let targets = batch.input.narrow(1, 1, length)?.flatten_all()?;
                let mask = batch
                    .mask
                    .as_ref()
                    .map(|m| m.narrow(1, 0, length))
                    .transpose()?;
                let logits = net.forward(&inputs, mask.as_ref())?;
                let vocab = logits.dim(D::Minus1)?;
                // A target counts when it is a real token.
                let weights = batch
                    .mask
                    .as_ref()
                    .map(|m| m.narrow(1, 1, length)?.flatten_all())
                    .transpose()?;
                Ok(Scored {
                    logits: logits.reshape((rows * length, vocab))?,
                    targets,
                    weights,
                })
            }
        }
    }

    /// The parameters as SafeTensors with `metadata`.
    pub fn to_bytes(&self, metadata: &Metadata) -> Result<Vec<u8>, ModelError> {
        Ok(self.tensors()?.to_bytes(metadata)?)
    }

    /// The parameters as named f32 tensors.
    pub fn tensors(&self) -> Result<hypha_diloco::Tensors, ModelError> {
        let mut tensors = BTreeMap::new();
        for (name, var) in self.named() {
            let tensor = hypha_diloco::Tensor {
                shape: var.dims().to_vec(),
                values: var.flatten_all()?.to_vec1::<f32>()?,
                dtype: safetensors::Dtype::F32,
            };
            tensors.insert(name, tensor);
        }
        Ok(hypha_diloco::Tensors(tensors))
    }

    /// Sets every parameter from `tensors`, which must hold exactly this model's.
    pub fn load(&self, tensors: &hypha_diloco::Tensors) -> Result<(), ModelError> {
        let named = self.named();
        if named.len() != tensors.0.len() {
            return Err(ModelError::Spec(format!(
                "the model file has {} tensors; this {:?} model has {}",
                tensors.0.len(),
                self.spec,
                named.len()
            )));
        }
        for (name, var) in named {
            let tensor = tensors.0.get(&name).ok_or_else(|| {
                ModelError::Spec(format!("the model file has no parameter {name:?}"))
            })?;
            if tensor.shape != var.dims() {
                return Err(ModelError::Spec(format!(
                    "parameter {name:?} is {:?} in the file and {:?} in the model",
                    tensor.shape,
                    var.dims()
                )));
            }
            var.set(&Tensor::from_slice(
                &tensor.values,
                var.dims(),
                &Device::Cpu,
            )?)?;
        }
        Ok(())
    }
}

/// The first values of the parameter `name` of shape `dims`, drawn from `rng` into `values`
/// (the parameters are drawn in name order from one generator): weights uniform in
/// ±1/√fan_in (the product of every dimension but the first), biases 0, layer-norm scales 1.
pub fn initial_values(name: &str, dims: &[usize], rng: &mut StdRng, values: &mut Vec<f32>) {
    let count: usize = dims.iter().product();
    values.clear();
    if name.contains("norm") && name.ends_with(".weight") {
        values.resize(count, 1.0);
    } else if name.ends_with(".bias") {
        values.resize(count, 0.0);
    } else {
        let fan_in: usize = dims.iter().skip(1).product();
        let bound = 1.0 / (fan_in.max(1) as f32).sqrt();
        values.extend((0..count).map(|_| rng.random_range(-bound..bound)));
    }
}

/// Logits with the targets they are scored against and, where some do not count (padding),
/// a weight per target.
struct Scored {
    logits: Tensor,
    targets: Tensor,
    weights: Option<Tensor>,
}

impl Scored {
    /// Mean cross-entropy over the targets that count.
    fn cross_entropy(&self) -> Result<Tensor, candle_core::Error> {
        match &self.weights {
            None => candle_nn::loss::cross_entropy(&self.logits, &self.targets),
            Some(weights) => {
                let log_p = candle_nn::ops::log_softmax(&self.logits, D::Minus1)?;
                let picked = log_p.gather(&self.targets.unsqueeze(1)?, 1)?.squeeze(1)?;
                weighted_mean(&picked, weights)?.neg()
            }
        }
    }
}

/// Σ values·weights / Σ weights (0 when no weight is set).
fn weighted_mean(values: &Tensor, weights: &Tensor) -> Result<Tensor, candle_core::Error> {
    let total = weights.sum_all()?.clamp(1.0f32, f32::MAX)?;
    (values * weights)?.sum_all()?.div(&total)
}

fn labels(batch: &Batch) -> Result<Tensor, ModelError> {
    batch
        .target
        .clone()
        .ok_or(ModelError::Missing("class labels (a target tensor)"))
}

impl Cnn {
    fn forward(&self, images: &Tensor) -> Result<Tensor, candle_core::Error> {
        let x = self.first.forward(images)?.relu()?.max_pool2d(2)?;
        let x = self.second.forward(&x)?.relu()?;
        // Global average pooling: any image size gives [rows, 2 × width].
        self.head.forward(&x.mean((2, 3))?)
    }
}

/// What a padding position adds to an attention score: far below any real score, yet finite,
/// so that a row whose keys are all padding stays a valid softmax.
const PADDING_SCORE: f64 = -1e9;

impl Transformer {
    /// Logits `[rows, length, vocab]`; `mask` (`[rows, length]`, 1 real, 0 padding) keeps
    /// padding from being attended to.
    fn forward(
        &self,
        inputs: &Tensor,
        mask: Option<&Tensor>,
    ) -> Result<Tensor, candle_core::Error> {
        let (rows, length) = inputs.dims2()?;
        let positions = Tensor::arange(0u32, length as u32, &Device::Cpu)?;
        let mut x = self
            .tokens
            .forward(inputs)?
            .broadcast_add(&self.positions.forward(&positions)?)?;
        let mut attention = causal_mask(length)?.reshape((1, 1, length, length))?;
        if let Some(real) = mask {
            let padding = (real.affine(-1.0, 1.0)? * PADDING_SCORE)?;
            attention = attention.broadcast_add(&padding.reshape((rows, 1, 1, length))?)?;
        }
        for block in &self.blocks {
            x = (&x + block.attend(&block.norm1.forward(&x)?, self.heads, &attention)?)?;
            let hidden = block.up.forward(&block.norm2.forward(&x)?)?.gelu()?;
            x = (&x + block.down.forward(&hidden)?)?;
        }
        self.head.forward(&self.norm.forward(&x)?)
    }
}

impl Block {
    fn attend(
        &self,
        x: &Tensor,
        heads: usize,
        mask: &Tensor,
    ) -> Result<Tensor, candle_core::Error> {
        let (batch, length, dim) = x.dims3()?;
        let size = dim / heads;
        let split = |t: Tensor| {
            t.reshape((batch, length, heads, size))?
                .transpose(1, 2)?
                .contiguous()
        };
        let query = split(self.query.forward(x)?)?;
        let key = split(self.key.forward(x)?)?;
        let value = split(self.value.forward(x)?)?;
        let scores = (query.matmul(&key.t()?)? / (size as f64).sqrt())?.broadcast_add(mask)?;
        let weights = candle_nn::ops::softmax_last_dim(&scores)?;
        let mixed = weights
            .matmul(&value)?
            .transpose(1, 2)?
            .reshape((batch, length, dim))?;
        self.out.forward(&mixed)
    }
}

/// 0 where a position may look (itself and before), −∞ after.
fn causal_mask(length: usize) -> Result<Tensor, candle_core::Error> {
    let values: Vec<f32> = (0..length)
        .flat_map(|i| (0..length).map(move |j| if j <= i { 0.0 } else { f32::NEG_INFINITY }))
        .collect();
    Tensor::from_vec(values, (length, length), &Device::Cpu)
}
