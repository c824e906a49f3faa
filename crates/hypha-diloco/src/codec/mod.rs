//! Compressed updates: the codecs a DiLoCo job chooses (`[diloco] compression`), their wire
//! format, and the error feedback that carries what they drop into the next round.
//!
//! # Wire format, version 2
//!
//! A compressed update is a SafeTensors file like every other file of a DiLoCo job. Its
//! `__metadata__` says how to read it: [`CODEC`] (`none` when absent) and [`CODEC_VERSION`]
//! (`2`); a reader refuses a codec or a version it does not know (version 1 wrote `sparse`
//! offsets in 12 bits each; every node of a network runs one release). For each parameter `name`
//! (its n values in row-major order):
//!
//! | codec | tensors | value i |
//! |---|---|---|
//! | `none` | `name`: F32 (or F64, BF16), the parameter's shape | as stored |
//! | `bf16` | `name`: BF16, the parameter's shape | f32 rounded to the nearest bfloat16, ties to even |
//! | `int8` | `name`: I8, the parameter's shape; `name#scale`: F32 `[⌈n / 256⌉]` | `q[i] · scale[i / 256]` |
//! | `topk` | `name#index`: U32 `[k]`, strictly increasing; `name#value`: F32 `[k]`; the shape in metadata `hypha.shape.name`, e.g. `[64,16]` | `value[j]` where `index[j] = i`, else 0 |
//! | `sparse` | `name#sparse`: U8, the records of its chunks of 4,096 values ([`sparse`]); the shape in metadata `hypha.shape.name`; `hypha.sparse.kept` and `hypha.sparse.bits` once for the file | the kept value at its offset in its chunk, else 0 |
//!
//! `int8` quantises blocks of [`INT8_BLOCK`] values: a block's scale is its largest magnitude
//! / 127 and each value becomes the whole number nearest x · (1 / scale), ties to even (a
//! block of zeros has scale 0). Readers only multiply back; how a writer rounds is its own. `topk` keeps
//! the k = ⌈density · n⌉ values of largest magnitude ([`kept_count`]; at least one of a
//! non-empty tensor; a tensor of more than 2³² values cannot be sent top-k). A reader refuses
//! values (and scales × 127) beyond [`MAX_UPDATE_VALUE`](crate::MAX_UPDATE_VALUE).
//! `sparse` keeps the top k of every chunk of 4,096 values with Elias-Fano coded offsets and
//! 2- or 4-bit codes between the chunk's smallest and largest kept magnitude ([`sparse`] has
//! its records). Sizes against f32: `bf16` ½, `int8` ¼ + 1/256 for the scales, `topk` 2 ×
//! density, `sparse` at 1.5625 % (64 of a chunk) and 2 bits 0.0054 (88 bytes a chunk), at 4
//! bits 0.0063.
//!
//! # Error feedback
//!
//! A trainer keeps what the codec dropped from its last update, a residual per parameter
//! ([`ErrorFeedback`](crate::ErrorFeedback)). The next update is compressed with the residual added, and what is
//! dropped then is the new residual: eₜ₊₁ = (Δₜ + eₜ) − C(Δₜ + eₜ). The sum of everything sent
//! is then the sum of the true updates less the last residual: what compression drops is
//! delayed rather than dropped, as long as one server takes the updates (the residual is
//! forgotten when a trainer joins another, and an update the server refuses is lost whole).

pub mod sparse;

use std::path::Path;

use hypha_messages::diloco::Compression;
use safetensors::Dtype;

use crate::{
    Error, Metadata, Tensor, Tensors,
    file::{Writer, write_file},
    tensors::bf16_bits,
};

/// Metadata key: the codec of an update (`none`, `bf16`, `int8`, `topk`, `sparse`).
pub const CODEC: &str = "hypha.codec";
/// Metadata key: the version of the wire format, [`VERSION`].
pub const CODEC_VERSION: &str = "hypha.codec_version";
/// The version of the wire format this module writes and reads.
pub const VERSION: &str = "2";
/// Metadata key prefix of a `topk` or `sparse` parameter's shape.
pub const SHAPE: &str = "hypha.shape.";
/// Values per `int8` block, each with its own scale.
pub const INT8_BLOCK: usize = 256;
/// The suffixes of a parameter's companion tensors.
pub(crate) const SCALE: &str = "#scale";
pub(crate) const INDEX: &str = "#index";
pub(crate) const VALUE: &str = "#value";

/// How updates are compressed.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub enum Codec {
    /// Full f32.
    #[default]
    None,
    /// bfloat16: half the bytes, about 3 significant digits.
    Bf16,
    /// Blockwise int8 with an f32 scale per [`INT8_BLOCK`] values: a quarter of the bytes.
    Int8,
    /// The `density` share of values of largest magnitude, with their positions.
    TopK { density: f32 },
    /// The largest values of every chunk of 4,096, in 2 or 4 bits each ([`sparse`]); a
    /// trainer's error feedback carries `decay` of its residual into the next update
    /// ([`ErrorFeedback::for_codec`](crate::ErrorFeedback::for_codec)).
    Sparse { format: sparse::Format, decay: f32 },
}

// The defaults of `sparse`'s keys are part of the job's config, described with it.
pub use hypha_messages::diloco::config::{SPARSE_BITS, SPARSE_DECAY, SPARSE_DENSITY};
/// The outer step (learning rate, momentum) that goes with `sparse` unless the job sets
/// one: plain SGD, the trainers' decaying residuals being the momentum. On `hypha-bench
/// outcome`'s text (the changes sent back at 4×, each chunk's levels fitted) 1.25 ended at
/// 1.019 of f32's held-out loss with decay 0.97, 1.5 at 1.022; with decay 0.95, 1.25 and
/// 1.5 ended alike (1.023) but with overlap 1.5 lagged (1.031 against 1.027, the levels not
/// yet fitted). Nesterov momentum on top diverged at 0.9 and lagged at 0.5 (1.050).
pub const SPARSE_OUTER: (f32, f32) = (1.25, 0.0);
/// The parameter server's changes go back at this many times the trainers' density: the
/// kept values of four trainers that share none. On `hypha-bench outcome`'s text, with
/// each chunk's levels fitted, 4× ends within 0.0006 bits per byte of sending the changes
/// back exactly (decay 0.95: 4.0583 against 4.0577); before the fitting 3× ended at 1.028
/// of f32, 4× at 1.026 and exact at 1.022. 4× is 0.016 of f32's bytes, inside `wan`'s 0.02
/// down, where 4× at 4 bits is not.
pub const SPARSE_BACK_DENSER: usize = 4;

impl TryFrom<Compression> for Codec {
    type Error = String;

    /// The codec a job's `compression` and its keys name, the defaults filled in; an error
    /// says which value is out of range and what to write.
    fn try_from(compression: Compression) -> Result<Self, String> {
        let in_range = |density: f32| density > 0.0 && density <= 1.0;
        match compression {
            Compression::None => Ok(Codec::None),
            Compression::Bf16 => Ok(Codec::Bf16),
            Compression::Int8 => Ok(Codec::Int8),
            Compression::Topk { topk_density } if in_range(topk_density) => Ok(Codec::TopK {
                density: topk_density,
            }),
            Compression::Topk { topk_density } => Err(format!(
                "a topk density of {topk_density} is not in (0, 1]: it is the share of values kept, e.g. 0.01"
            )),
            Compression::Sparse {
                sparse_density,
                sparse_bits,
                sparse_decay,
            } => {
                let density = sparse_density.unwrap_or(SPARSE_DENSITY);
                if !in_range(density) {
                    return Err(format!(
                        "a sparse density of {density} is not in (0, 1]: it is the share of each chunk's values kept, e.g. {SPARSE_DENSITY}"
                    ));
                }
                let bits = sparse_bits.unwrap_or(SPARSE_BITS);
                if bits != 2 && bits != 4 {
                    return Err(format!(
                        "sparse values of {bits} bits: write 2 (the default) or 4"
                    ));
                }
                let decay = sparse_decay.unwrap_or(SPARSE_DECAY);
                if !(decay > 0.0 && decay <= 1.0) {
                    return Err(format!(
                        "a sparse decay of {decay} is not in (0, 1]: it is the share of what was not sent carried into the next update, e.g. {SPARSE_DECAY}"
                    ));
                }
                let format = sparse::Format::of(density, bits)?;
                Ok(Codec::Sparse { format, decay })
            }
        }
    }
}

impl Codec {
    /// The codec the parameter server sends the global model's changes with when trainers
    /// compress with this one: the same, except that `topk` goes back as `int8`. A sparse
    /// change leaves most parameters behind the server's optimizer for rounds, and with
    /// Nesterov momentum the gap grows: in the seeded in-process run of
    /// `hypha-executor/tests/diloco.rs`, top-k 10 % both ways ends at an evaluation loss of
    /// 10.45 where top-k up and int8 back ends at 0.38 (uncompressed: 0.20).
    ///
    /// `sparse` goes back `sparse` at [`SPARSE_BACK_DENSER`] times the density, with the
    /// server's residual carried whole (the model must move by every step in the end).
    pub fn for_broadcast(self) -> Self {
        match self {
            Codec::TopK { .. } => Codec::Int8,
            Codec::Sparse { format, .. } => Codec::Sparse {
                format: format.denser(SPARSE_BACK_DENSER),
                decay: 1.0,
            },
            codec => codec,
        }
    }

    /// Its name, as in [`CODEC`].
    pub fn name(&self) -> &'static str {
        match self {
            Codec::None => "none",
            Codec::Bf16 => "bf16",
            Codec::Int8 => "int8",
            Codec::TopK { .. } => "topk",
            Codec::Sparse { .. } => "sparse",
        }
    }
}

/// The most bytes [`encode`] makes of tensors of `sizes` values with `codec`: their values,
/// and a SafeTensors header of [`HEADER_PER_TENSOR`] for each of the (at most two) tensors it
/// stores of each and [`HEADER_METADATA`] for the metadata. What a receiver may refuse to read
/// beyond.
pub fn max_encoded_bytes(codec: Codec, sizes: impl Iterator<Item = usize>) -> u64 {
    let (body, tensors) = sizes.fold((0u64, 0u64), |(body, tensors), n| {
        let n64 = n as u64;
        let values = match codec {
            Codec::None => 4 * n64,
            Codec::Bf16 => 2 * n64,
            Codec::Int8 => n64 + 4 * n.div_ceil(INT8_BLOCK) as u64,
            Codec::TopK { density } => 8 * kept_count(density, n) as u64,
            Codec::Sparse { format, .. } => format.bytes(n),
        };
        (body.saturating_add(values), tensors + 1)
    });
    let header =
        (HEADER_METADATA + 2 * HEADER_PER_TENSOR * tensors).min(crate::tensors::MAX_HEADER);
    body.saturating_add(8 + header)
}

/// The header room [`max_encoded_bytes`] allows each stored tensor: its name, dtype, shape and
/// offsets in JSON (a name of hundreds of characters fits).
pub const HEADER_PER_TENSOR: u64 = 1024;
/// The header room [`max_encoded_bytes`] allows the metadata.
pub const HEADER_METADATA: u64 = 64 * 1024;

/// `update` compressed with `codec`, as SafeTensors bytes carrying `metadata` and the codec's
/// own keys. Refuses an update with a NaN or infinite value.
pub fn encode(update: &Tensors, codec: Codec, metadata: &Metadata) -> Result<Vec<u8>, Error> {
    let mut writer = writer_for(update, codec, metadata)?;
    let mut encoded = Vec::new();
    for (name, tensor) in &update.0 {
        encode_values(codec, name, &tensor.values, &mut encoded)?;
        writer.write(&encoded)?;
    }
    Ok(writer.finish()?.into_inner())
}

/// Parameters of `shapes` (in name order) compressed with `codec` into a file at `path`
/// (written atomically, fsynced when `durable`), as [`encode`] lays them out: each
/// parameter's values are asked of `values` (into the buffer it is given) when its turn
/// comes, so that only one is in memory at a time, whatever the model's size. The file's size.
pub fn encode_file(
    path: &Path,
    durable: bool,
    codec: Codec,
    shapes: &[(String, Vec<usize>)],
    metadata: &Metadata,
    mut values: impl FnMut(&str, &[usize], &mut Vec<f32>) -> Result<(), Error>,
) -> Result<u64, Error> {
    let listing = shapes
        .iter()
        .map(|(name, shape)| (name.as_str(), &shape[..]));
    let mut parameter = Vec::new();
    let mut encoded = Vec::new();
    write_file(
        path,
        durable,
        stored(codec, listing.clone())?,
        with_codec(codec, metadata, listing),
        |writer| {
            for (name, shape) in shapes {
                parameter.clear();
                values(name, shape, &mut parameter)?;
                if parameter.len() != shape.iter().product::<usize>() {
                    return Err(Error::Mismatch {
                        name: name.clone(),
                        problem: format!("{} values for shape {shape:?}", parameter.len()),
                    });
                }
                encode_values(codec, name, &parameter, &mut encoded)?;
                writer.write(&encoded)?;
            }
            Ok(())
        },
    )
}

/// A writer of `update` compressed with `codec` into memory, its header written.
pub(crate) fn writer_for(
    update: &Tensors,
    codec: Codec,
    metadata: &Metadata,
) -> Result<Writer<std::io::Cursor<Vec<u8>>>, Error> {
    let shapes = update
        .0
        .iter()
        .map(|(name, t)| (name.as_str(), &t.shape[..]));
    Writer::new(
        std::io::Cursor::new(Vec::new()),
        stored(codec, shapes.clone())?,
        with_codec(codec, metadata, shapes),
    )
}

/// `metadata` with the keys that say how `codec` stored parameters of `shapes`.
pub(crate) fn with_codec<'a>(
    codec: Codec,
    metadata: &Metadata,
    shapes: impl Iterator<Item = (&'a str, &'a [usize])>,
) -> Metadata {
    let mut metadata = metadata.clone();
    metadata.insert(CODEC.into(), codec.name().into());
    metadata.insert(CODEC_VERSION.into(), VERSION.into());
    if let Codec::Sparse { format, .. } = codec {
        metadata.insert(sparse::KEPT.into(), format.kept().to_string());
        metadata.insert(sparse::BITS.into(), format.bits().to_string());
    }
    if let Codec::TopK { .. } | Codec::Sparse { .. } = codec {
        for (name, shape) in shapes {
            metadata.insert(format!("{SHAPE}{name}"), shape_text(shape));
        }
    }
    metadata
}

/// The tensors (name, dtype, shape) a file of parameters of `shapes` holds with `codec`, in
/// the order [`encode_values`] gives their bytes. Every size follows from the shapes (top-k
/// keeps [`kept_count`]), so a file is laid out before a value is compressed.
pub(crate) fn stored<'a>(
    codec: Codec,
    shapes: impl Iterator<Item = (&'a str, &'a [usize])>,
) -> Result<Vec<(String, Dtype, Vec<usize>)>, Error> {
    let mut stored = Vec::new();
    for (name, shape) in shapes {
        let n: usize = shape.iter().product();
        match codec {
            Codec::None => stored.push((name.to_string(), Dtype::F32, shape.to_vec())),
            Codec::Bf16 => stored.push((name.to_string(), Dtype::BF16, shape.to_vec())),
            Codec::Int8 => {
                stored.push((name.to_string(), Dtype::I8, shape.to_vec()));
                stored.push((
                    format!("{name}{SCALE}"),
                    Dtype::F32,
                    vec![n.div_ceil(INT8_BLOCK)],
                ));
            }
            Codec::TopK { density } => {
                if u32::try_from(n).is_err() {
                    return Err(Error::Mismatch {
                        name: name.to_string(),
                        problem: "has more values than top-k positions (u32) can name".into(),
                    });
                }
                let k = if n == 0 { 0 } else { kept_count(density, n) };
                stored.push((format!("{name}{INDEX}"), Dtype::U32, vec![k]));
                stored.push((format!("{name}{VALUE}"), Dtype::F32, vec![k]));
            }
            Codec::Sparse { format, .. } => {
                let bytes = usize::try_from(format.bytes(n)).map_err(|_| Error::Mismatch {
                    name: name.to_string(),
                    problem: "has more records than this machine can address".into(),
                })?;
                stored.push((format!("{name}{}", sparse::RECORDS), Dtype::U8, vec![bytes]));
            }
        }
    }
    Ok(stored)
}

/// The bytes of `len` values compressed with `codec` ([`encode_values`]) as two parts: the
/// values (`none`, `bf16`, `int8`'s quantised values) and their companion (`int8`'s scales;
/// none for the others). `topk` cannot be split: it selects over its whole input. `sparse`'s
/// records of whole chunks can: a run of them is the encoding of their values.
pub(crate) fn split_encoded(codec: Codec, len: usize, encoded: &[u8]) -> (&[u8], &[u8]) {
    match codec {
        Codec::Int8 => encoded.split_at(len.min(encoded.len())),
        _ => (encoded, &[]),
    }
}

/// One parameter's `values` compressed with `codec`, into `out` (emptied first): the bytes of
/// the tensors [`stored`] lists for it, one after the other. Refuses a NaN or an infinite
/// value.
pub(crate) fn encode_values(
    codec: Codec,
    name: &str,
    values: &[f32],
    out: &mut Vec<u8>,
) -> Result<(), Error> {
    if !crate::tensors::all_finite(values) {
        return Err(Error::NotFinite {
            name: name.to_string(),
        });
    }
    out.clear();
    match codec {
        Codec::None => out.extend(values.iter().flat_map(|v| v.to_le_bytes())),
        Codec::Bf16 => out.extend(values.iter().flat_map(|v| bf16_bits(*v).to_le_bytes())),
        Codec::Int8 => int8(values, out),
        Codec::TopK { density } => {
            let (indices, values) = top_k(values, density);
            out.extend(indices.iter().flat_map(|i| i.to_le_bytes()));
            out.extend(f32_bytes(&values));
        }
        Codec::Sparse { format, .. } => format.encode(values, out),
    }
    Ok(())
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Blockwise int8 into `out`: the quantised values (as bytes), then each block's scale (f32
/// LE). Written so that the compiler vectorises it on any x86-64 (no `round`, which is a
/// call there without SSE4.1): a parameter server quantises every round's change of the
/// whole model.
fn int8(values: &[f32], out: &mut Vec<u8>) {
    let blocks = values.len().div_ceil(INT8_BLOCK);
    let start = out.len();
    out.resize(start + values.len() + 4 * blocks, 0);
    let (quantised, scales) = out[start..].split_at_mut(values.len());
    let pieces = values
        .chunks(INT8_BLOCK)
        .zip(quantised.chunks_mut(INT8_BLOCK))
        .zip(scales.chunks_exact_mut(4));
    for ((block, quantised), scale_bytes) in pieces {
        let scale = largest_magnitude(block) / 127.0;
        let inverse = if scale > 0.0 { 1.0 / scale } else { 0.0 };
        for (q, v) in quantised.iter_mut().zip(block) {
            *q = nearest_i8(v * inverse) as u8;
        }
        scale_bytes.copy_from_slice(&scale.to_le_bytes());
    }
}

/// The largest |v| of `values` (finite), in 16 lanes so that it vectorises.
fn largest_magnitude(values: &[f32]) -> f32 {
    const LANES: usize = 16;
    let larger = |m: f32, v: f32| if v > m { v } else { m };
    let mut lanes = [0.0f32; LANES];
    let mut groups = values.chunks_exact(LANES);
    for group in &mut groups {
        for (lane, v) in lanes.iter_mut().zip(group) {
            *lane = larger(*lane, v.abs());
        }
    }
    let rest = groups
        .remainder()
        .iter()
        .fold(0.0, |m, v| larger(m, v.abs()));
    lanes.iter().fold(rest, |m, &v| larger(m, v))
}

/// `x` rounded to the nearest whole number (ties to even) within ±127. Adding 1.5 · 2²³
/// leaves no fraction in f32 (the processor rounds as it adds), and the whole number is then
/// the low bits of the sum: no float-to-int conversion, which does not vectorise.
fn nearest_i8(x: f32) -> i8 {
    const ROUNDER: f32 = 12_582_912.0;
    let rounded = x.clamp(-127.0, 127.0) + ROUNDER;
    (rounded.to_bits() as i32).wrapping_sub(ROUNDER.to_bits() as i32) as i8
}

/// The positions (increasing) and values of the ⌈density · n⌉ values of largest magnitude.
fn top_k(values: &[f32], density: f32) -> (Vec<u32>, Vec<f32>) {
    let n = values.len();
    if n == 0 {
        return (Vec::new(), Vec::new());
    }
    let k = kept_count(density, n);
    let mut order: Vec<u32> = (0..n as u32).collect();
    if k < n {
        // Largest magnitude first; ties by position, so that the choice is deterministic.
        order.select_nth_unstable_by(k - 1, |&a, &b| {
            values[b as usize]
                .abs()
                .total_cmp(&values[a as usize].abs())
                .then(a.cmp(&b))
        });
        order.truncate(k);
    }
    order.sort_unstable();
    let kept = order.iter().map(|&i| values[i as usize]).collect();
    (order, kept)
}

/// k = ⌈density · n⌉, at least 1, at most n. The density was written in decimal and read as
/// binary (0.1 is 0.10000000149 as an f32): a product within a millionth of a whole number is
/// that number, so a density of 0.1 keeps 100 of 1 000, not 101.
pub fn kept_count(density: f32, n: usize) -> usize {
    let exact = f64::from(density) * n as f64;
    let whole = exact.round();
    let k = if (exact - whole).abs() <= 1e-6 * exact.max(1.0) {
        whole
    } else {
        exact.ceil()
    };
    (k as usize).clamp(1, n.max(1))
}

fn shape_text(shape: &[usize]) -> String {
    let dims: Vec<String> = shape.iter().map(usize::to_string).collect();
    format!("[{}]", dims.join(","))
}

/// A `topk` or `sparse` parameter's shape from its metadata value.
pub(crate) fn parse_shape(name: &str, text: &str) -> Result<Vec<usize>, Error> {
    serde_json::from_str(text).map_err(|_| Error::Mismatch {
        name: name.to_string(),
        problem: format!("its shape {text:?} is not a list of dimensions"),
    })
}

/// A decoded update's tensor, for [`crate::Update::to_tensors`].
pub(crate) fn tensor(shape: Vec<usize>, values: Vec<f32>) -> Tensor {
    Tensor {
        shape,
        values,
        dtype: Dtype::F32,
    }
}
