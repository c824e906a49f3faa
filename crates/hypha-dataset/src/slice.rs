//! The slice format: SafeTensors, plain or raw-Snappy-compressed.

use std::{borrow::Cow, collections::BTreeMap};

pub use safetensors::Dtype;
use serde::{Deserialize, Serialize};

use crate::TensorSpec;

/// How a slice file is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Encoding {
    /// Raw (block-format) Snappy over SafeTensors: `snappy.compress(safetensors.save(t))`.
    Snappy,
    /// A plain `.safetensors` file.
    Plain,
}

/// A slice that could not be read.
#[derive(Debug, thiserror::Error)]
pub enum SliceError {
    #[error(
        "neither SafeTensors nor raw-Snappy-compressed SafeTensors (not a SafeTensors header, and not Snappy: {0})"
    )]
    Unrecognised(snap::Error),
    #[error(
        "neither SafeTensors nor raw-Snappy-compressed SafeTensors (Snappy data that does not hold SafeTensors)"
    )]
    SnappyWithoutSafeTensors,
    #[error("the Snappy data is corrupt: {0}")]
    Snappy(snap::Error),
    #[error(
        "the Snappy data is corrupt: claims {claimed} bytes decompressed, more than the {} allowed",
        MAX_SLICE_BYTES
    )]
    TooLarge { claimed: usize },
    #[error(
        "the Snappy data is corrupt: claims {claimed} bytes decompressed from {compressed} bytes, more than Snappy can expand to"
    )]
    Overexpanded { claimed: usize, compressed: usize },
    #[error("the SafeTensors data is invalid: {0}")]
    SafeTensors(safetensors::SafeTensorError),
    #[error("tensor {name:?}: shape {shape:?} of {dtype} needs {expected} bytes, got {got}")]
    Size {
        name: String,
        shape: Vec<usize>,
        dtype: Dtype,
        expected: usize,
        got: usize,
    },
    #[error("tensor {name:?}: {error}")]
    View {
        name: String,
        error: safetensors::SafeTensorError,
    },
}

/// Largest decompressed slice accepted: a corrupt or hostile Snappy header (it can claim up
/// to 4 GiB) never becomes a larger allocation.
pub const MAX_SLICE_BYTES: usize = 2 * 1024 * 1024 * 1024;

/// The most a Snappy byte can expand to: its densest element, a 3-byte copy, yields 64 bytes.
/// A header that claims more than this many times the compressed size is a lie, refused
/// before anything is allocated for it.
const MAX_SNAPPY_RATIO: usize = 22;

/// Tells the encoding from the content and returns the SafeTensors bytes.
pub fn decode(bytes: &[u8]) -> Result<(Encoding, Cow<'_, [u8]>), SliceError> {
    if looks_like_safetensors(bytes) {
        safetensors::SafeTensors::read_metadata(bytes).map_err(SliceError::SafeTensors)?;
        return Ok((Encoding::Plain, Cow::Borrowed(bytes)));
    }
    let length = snap::raw::decompress_len(bytes).map_err(SliceError::Unrecognised)?;
    if length > MAX_SLICE_BYTES {
        return Err(SliceError::TooLarge { claimed: length });
    }
    if length > bytes.len().saturating_mul(MAX_SNAPPY_RATIO) {
        return Err(SliceError::Overexpanded {
            claimed: length,
            compressed: bytes.len(),
        });
    }
    let plain = snap::raw::Decoder::new()
        .decompress_vec(bytes)
        .map_err(SliceError::Snappy)?;
    if !looks_like_safetensors(&plain) {
        return Err(SliceError::SnappyWithoutSafeTensors);
    }
    safetensors::SafeTensors::read_metadata(&plain).map_err(SliceError::SafeTensors)?;
    Ok((Encoding::Snappy, Cow::Owned(plain)))
}

/// A SafeTensors buffer starts with a little-endian u64 header length and a JSON object that
/// fits in the buffer.
fn looks_like_safetensors(bytes: &[u8]) -> bool {
    let Some(length) = bytes.get(..8) else {
        return false;
    };
    let mut le = [0u8; 8];
    le.copy_from_slice(length);
    let header = u64::from_le_bytes(le);
    header >= 2 && header <= (bytes.len() as u64 - 8) && bytes.get(8) == Some(&b'{')
}

/// The tensors of a SafeTensors buffer, sorted by name, and the slice's sample count: the
/// leading dimension when every tensor shares it.
pub fn describe(safetensors_bytes: &[u8]) -> Result<(Vec<TensorSpec>, Option<u64>), SliceError> {
    let (_, metadata) = safetensors::SafeTensors::read_metadata(safetensors_bytes)
        .map_err(SliceError::SafeTensors)?;
    let mut tensors: Vec<TensorSpec> = metadata
        .tensors()
        .into_iter()
        .map(|(name, info)| TensorSpec {
            name,
            dtype: info.dtype.to_string(),
            shape: info.shape.iter().map(|&d| d as u64).collect(),
        })
        .collect();
    tensors.sort_by(|a, b| a.name.cmp(&b.name));
    let mut leading = tensors.iter().map(|t| t.shape.first().copied());
    let samples = match leading.next() {
        Some(Some(first)) if leading.all(|d| d == Some(first)) => Some(first),
        _ => None,
    };
    Ok((tensors, samples))
}

/// Tensors to write into a slice: name → (dtype, shape, little-endian bytes).
#[derive(Debug, Clone, Default)]
pub struct Tensors(BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>);

impl Tensors {
    pub fn new() -> Self {
        Tensors::default()
    }

    /// Adds a tensor, checking that `data` holds exactly `shape` elements of `dtype`.
    pub fn with(
        mut self,
        name: &str,
        dtype: Dtype,
        shape: Vec<usize>,
        data: Vec<u8>,
    ) -> Result<Self, SliceError> {
        let elements: usize = shape.iter().product();
        let expected = elements * dtype.bitsize() / 8;
        if data.len() != expected {
            return Err(SliceError::Size {
                name: name.into(),
                shape,
                dtype,
                expected,
                got: data.len(),
            });
        }
        self.0.insert(name.to_string(), (dtype, shape, data));
        Ok(self)
    }
}

/// Serializes tensors as a slice with the given encoding.
pub fn encode(tensors: &Tensors, encoding: Encoding) -> Result<Vec<u8>, SliceError> {
    let views = tensors
        .0
        .iter()
        .map(|(name, (dtype, shape, data))| {
            safetensors::tensor::TensorView::new(*dtype, shape.clone(), data)
                .map(|view| (name.clone(), view))
                .map_err(|error| SliceError::View {
                    name: name.clone(),
                    error,
                })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let plain = safetensors::serialize(views, None).map_err(SliceError::SafeTensors)?;
    Ok(match encoding {
        Encoding::Plain => plain,
        Encoding::Snappy => snap::raw::Encoder::new()
            .compress_vec(&plain)
            .map_err(SliceError::Snappy)?,
    })
}
