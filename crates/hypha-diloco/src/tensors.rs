//! Named f32 tensors and their SafeTensors form.

use std::{collections::BTreeMap, path::Path};

use safetensors::{Dtype, SafeTensors};

use crate::{
    Error,
    file::{CHUNK, Entry, FileSource, Layout, Source, Writer, dtype_bytes, write_file},
};

/// One tensor, held as f32 whatever it was stored as.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    pub shape: Vec<usize>,
    pub values: Vec<f32>,
    /// The dtype it is written back as.
    pub dtype: Dtype,
}

/// Tensors by name.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Tensors(pub BTreeMap<String, Tensor>);

/// A SafeTensors file's `__metadata__`: free-form strings.
pub type Metadata = BTreeMap<String, String>;

impl Tensor {
    /// The parameter `name` at `entry` of the file `source` holds, through `buffer`.
    pub(crate) fn read(
        source: &(impl Source + ?Sized),
        name: &str,
        entry: &Entry,
        buffer: &mut Vec<u8>,
    ) -> Result<Self, Error> {
        if !matches!(entry.dtype, Dtype::F32 | Dtype::F64 | Dtype::BF16) {
            return Err(Error::Dtype {
                name: name.to_string(),
                dtype: entry.dtype.to_string(),
            });
        }
        let mut values = vec![0.0; entry.values()];
        let width = dtype_bytes(entry.dtype);
        entry.chunks(source, width, buffer, |at, bytes| {
            let from = at as usize / width;
            decode(entry.dtype, bytes, &mut values[from..], |t, v| *t = v);
            Ok(())
        })?;
        Ok(Self {
            shape: entry.shape.clone(),
            values,
            dtype: entry.dtype,
        })
    }
}

impl Tensors {
    /// Reads a SafeTensors file's bytes.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, Error> {
        Self::read(bytes)
    }

    /// Reads the SafeTensors file at `path` a chunk at a time: the file is never in memory
    /// beside the tensors.
    pub fn load(path: &Path) -> Result<Self, Error> {
        Self::read(&FileSource::open(path)?)
    }

    /// Reads the SafeTensors file `source` holds.
    pub fn read(source: &(impl Source + ?Sized)) -> Result<Self, Error> {
        let layout = Layout::read(source)?;
        let mut tensors = BTreeMap::new();
        let mut buffer = Vec::new();
        for (name, entry) in layout.entries {
            let tensor = Tensor::read(source, &name, &entry, &mut buffer)?;
            tensors.insert(name, tensor);
        }
        Ok(Self(tensors))
    }

    /// The fingerprint of the model in the SafeTensors file `source` holds, read a
    /// parameter at a time (the memory of the largest), each checked as [`read`](Self::read)
    /// checks it: what [`digest`](Self::digest) of the file's tensors would give.
    pub fn fingerprint_of(source: &(impl Source + ?Sized)) -> Result<String, Error> {
        let layout = Layout::read(source)?;
        let mut fingerprint = Fingerprint::new();
        let mut buffer = Vec::new();
        for (name, entry) in &layout.entries {
            fingerprint.tensor(name, &Tensor::read(source, name, entry, &mut buffer)?);
        }
        Ok(fingerprint.finish())
    }

    /// Each tensor's name, shape and dtype.
    pub(crate) fn shapes(&self) -> impl Iterator<Item = (&str, &[usize], Dtype)> {
        self.0
            .iter()
            .map(|(name, t)| (name.as_str(), &t.shape[..], t.dtype))
    }

    /// The name, dtype and shape of each tensor as a file of them lists it.
    fn listing(&self) -> impl Iterator<Item = (String, Dtype, Vec<usize>)> + '_ {
        self.0
            .iter()
            .map(|(name, t)| (name.clone(), t.dtype, t.shape.clone()))
    }

    /// Writes each tensor's values in its own dtype, in name order.
    fn write_values<W: std::io::Write + std::io::Seek>(
        &self,
        writer: &mut Writer<W>,
    ) -> Result<(), Error> {
        for tensor in self.0.values() {
            stored_bytes(&tensor.values, tensor.dtype, |bytes| writer.write(bytes))?;
        }
        Ok(())
    }

    /// The SafeTensors form, each tensor in its own dtype, with `metadata`.
    pub fn to_bytes(&self, metadata: &Metadata) -> Result<Vec<u8>, Error> {
        let mut writer = Writer::new(
            std::io::Cursor::new(Vec::new()),
            self.listing(),
            metadata.clone(),
        )?;
        self.write_values(&mut writer)?;
        Ok(writer.finish()?.into_inner())
    }

    /// The model's fingerprint ([`Fingerprint`]).
    pub fn digest(&self) -> String {
        let mut fingerprint = Fingerprint::new();
        for (name, tensor) in &self.0 {
            fingerprint.tensor(name, tensor);
        }
        fingerprint.finish()
    }

    /// The same parameters, each written as F32 from now on: a model that changes by
    /// broadcast deltas must be sent as the f32 values its holders compute, not rounded to a
    /// narrower dtype on the way.
    pub fn into_f32(mut self) -> Self {
        for tensor in self.0.values_mut() {
            tensor.dtype = Dtype::F32;
        }
        self
    }

    /// Writes the file atomically (temporary file, fsync, rename), a tensor at a time; the
    /// file's size.
    pub fn save(&self, path: &Path, metadata: &Metadata) -> Result<u64, Error> {
        write_file(path, true, self.listing(), metadata.clone(), |writer| {
            self.write_values(writer)
        })
    }
}

/// A model's fingerprint, `blake3:` and 64 hex digits: equal exactly when two holders hold
/// the same parameters bit for bit, as they would write them. BLAKE3 over four fields per
/// parameter, in name order, each preceded by its length in bytes (u64 LE): the name (UTF-8),
/// the dtype's name (`F32`, `BF16`, `F64`), the shape (each dimension u64 LE) and the values
/// as the file stores them (little-endian in that dtype). A trainer checks the global model it
/// built from a broadcast change against the parameter server's fingerprint
/// ([`meta::MODEL_HASH`](hypha_messages::diloco::meta::MODEL_HASH)).
///
/// BLAKE3, because the server computes it every round over the whole model, as each chunk
/// of it is closed: measured on the development machine over 100 MB, SHA-256 (with the SHA
/// extensions) 2.1 GB/s, BLAKE3 7.6 GB/s on one core, memcpy 21 GB/s. Hashing on both of its
/// cores made the close slower, not faster (BENCHMARKS.md, diloco).
#[derive(Debug, Default, Clone)]
pub struct Fingerprint(blake3::Hasher);

impl Fingerprint {
    pub fn new() -> Self {
        Self::default()
    }

    fn part(&mut self, bytes: &[u8]) {
        self.0.update(&(bytes.len() as u64).to_le_bytes());
        self.0.update(bytes);
    }

    /// Adds the next parameter (in name order), its values as [`Tensor::dtype`] stores them.
    pub fn tensor(&mut self, name: &str, tensor: &Tensor) {
        self.begin(name, tensor.dtype, &tensor.shape);
        self.values(&tensor.values, tensor.dtype);
    }

    /// Starts the next parameter (in name order): its name, dtype and shape. Its values
    /// follow, all of them, with [`values`](Self::values).
    pub fn begin(&mut self, name: &str, dtype: Dtype, shape: &[usize]) {
        self.part(name.as_bytes());
        self.part(dtype.to_string().as_bytes());
        let dims: Vec<u8> = shape
            .iter()
            .flat_map(|d| (*d as u64).to_le_bytes())
            .collect();
        self.part(&dims);
        let len = shape.iter().product::<usize>() * dtype_bytes(dtype);
        self.0.update(&(len as u64).to_le_bytes());
    }

    /// The next of the parameter's values, as `dtype` stores them. f32 values are hashed in
    /// place, on every core for big slices.
    pub fn values(&mut self, values: &[f32], dtype: Dtype) {
        if dtype == Dtype::F32 && cfg!(target_endian = "little") {
            self.0.update_rayon(bytemuck::cast_slice(values));
            return;
        }
        let _ = stored_bytes::<()>(values, dtype, |bytes| {
            self.0.update(bytes);
            Ok(())
        });
    }

    /// `blake3:` and the hash in hex.
    pub fn finish(self) -> String {
        format!("blake3:{}", self.0.finalize().to_hex())
    }
}

/// The SafeTensors file `bytes` with its `__metadata__` replaced by `metadata`, tensors
/// unchanged.
pub fn with_metadata(bytes: &[u8], metadata: &Metadata) -> Result<Vec<u8>, Error> {
    let file = SafeTensors::deserialize(bytes).map_err(Error::SafeTensors)?;
    let metadata = metadata
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    safetensors::serialize(file.iter(), Some(metadata)).map_err(Error::SafeTensors)
}

/// The `__metadata__` of a SafeTensors file's bytes (empty when it has none).
pub fn metadata(bytes: &[u8]) -> Result<Metadata, Error> {
    let (_, header) = SafeTensors::read_metadata(bytes).map_err(Error::SafeTensors)?;
    Ok(header
        .metadata()
        .iter()
        .flatten()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect())
}

/// The `__metadata__` of the SafeTensors file `reader` is at the start of, read from its
/// header alone (at most [`MAX_HEADER`] bytes), however large the tensors behind it.
pub fn read_metadata(reader: &mut impl std::io::Read) -> Result<Metadata, Error> {
    read_metadata_within(reader, MAX_HEADER)
}

/// [`read_metadata`] of a header of at most `limit` bytes: a longer one is refused before
/// a byte of it is read.
pub fn read_metadata_within(
    reader: &mut impl std::io::Read,
    limit: u64,
) -> Result<Metadata, Error> {
    let mut length = [0u8; 8];
    let io = Error::HeaderRead;
    reader.read_exact(&mut length).map_err(io)?;
    let length = u64::from_le_bytes(length);
    let limit = limit.min(MAX_HEADER);
    if length > limit {
        return Err(Error::Format(format!(
            "a header of {length} bytes (at most {limit})"
        )));
    }
    let mut header = vec![0u8; length as usize];
    reader.read_exact(&mut header).map_err(io)?;
    #[derive(serde::Deserialize)]
    struct Header {
        #[serde(rename = "__metadata__", default)]
        metadata: Metadata,
    }
    let header: Header = serde_json::from_slice(&header).map_err(Error::HeaderJson)?;
    Ok(header.metadata)
}

/// The largest SafeTensors header [`read_metadata`] reads.
pub const MAX_HEADER: u64 = 100 << 20;

/// The largest magnitude a value of an update may have. Pseudo-gradients are differences of
/// parameters after a round's steps: none moves a parameter by a billion. Bounding them
/// keeps the weighted sum, the mean and the momentum finite in f32 whatever the weights
/// (u64 samples × 1e9 is below f32::MAX by ten orders of magnitude), where a liar's finite
/// but huge value would make the global model infinite.
pub const MAX_UPDATE_VALUE: f32 = 1e9;

/// Whether every value of `data`, read as `dtype`, is finite and at most `limit` in
/// magnitude (false for another dtype).
///
/// Σ (v·0 + [|v| > limit]) is 0 exactly when every v is finite and within the limit (NaN as
/// soon as one is NaN or infinite), and unlike a test per value it vectorises: the check runs
/// near memory speed instead of at a quarter of it (BENCHMARKS.md, diloco).
pub(crate) fn all_within(dtype: Dtype, data: &[u8], limit: f32) -> bool {
    let each = |v: f32| v * 0.0 + f32::from(u8::from(v.abs() > limit));
    let zero = match dtype {
        Dtype::F32 => fold_lanes::<4>(data, f32_at, each),
        Dtype::BF16 => fold_lanes::<2>(data, bf16_at, each),
        Dtype::F64 => data
            .chunks_exact(8)
            .map(|b| {
                let v = f64_at(b);
                v * 0.0 + f64::from(u8::from(v.abs() > f64::from(limit)))
            })
            .sum(),
        _ => return false,
    };
    zero == 0.0
}

/// Whether every one of `values` is finite: the lane-wise sum of [`all_within`], without a
/// limit.
pub(crate) fn all_finite(values: &[f32]) -> bool {
    const LANES: usize = 16;
    let mut lanes = [0.0f32; LANES];
    let mut groups = values.chunks_exact(LANES);
    for group in &mut groups {
        for (lane, v) in lanes.iter_mut().zip(group) {
            *lane += v * 0.0;
        }
    }
    for v in groups.remainder() {
        lanes[0] += v * 0.0;
    }
    lanes.iter().sum::<f32>() == 0.0
}

/// The sum of the squares of `data`'s values read as `dtype` (finite ones: see
/// [`all_finite`]), in f64; 0 for a dtype other than F32, F64 and BF16.
pub(crate) fn squared_norm(dtype: Dtype, data: &[u8]) -> f64 {
    match dtype {
        Dtype::F32 => fold_lanes::<4>(data, f32_at, |v| v * v),
        Dtype::BF16 => fold_lanes::<2>(data, bf16_at, |v| v * v),
        Dtype::F64 => data.chunks_exact(8).map(|b| f64_at(b) * f64_at(b)).sum(),
        _ => 0.0,
    }
}

fn f32_at(b: &[u8]) -> f32 {
    f32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// bfloat16 is the upper half of an f32.
fn bf16_at(b: &[u8]) -> f32 {
    f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16)
}

fn f64_at(b: &[u8]) -> f64 {
    f64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])
}

/// Σ `each(v)` over the `WIDTH`-byte values of `data`. The terms add up in 16 f32 lanes,
/// which the compiler vectorises (a single running sum cannot be reordered and runs at a
/// quarter of memory speed), and each block of 4096 values is folded into an f64, so
/// precision holds over billions of values.
fn fold_lanes<const WIDTH: usize>(
    data: &[u8],
    decode: impl Fn(&[u8]) -> f32,
    each: impl Fn(f32) -> f32,
) -> f64 {
    const LANES: usize = 16;
    const BLOCK: usize = 4096;
    let mut total = 0.0f64;
    for block in data.chunks(WIDTH * BLOCK) {
        let mut lanes = [0.0f32; LANES];
        let mut groups = block.chunks_exact(WIDTH * LANES);
        for group in &mut groups {
            for (lane, bytes) in lanes.iter_mut().zip(group.chunks_exact(WIDTH)) {
                *lane += each(decode(bytes));
            }
        }
        for bytes in groups.remainder().chunks_exact(WIDTH) {
            lanes[0] += each(decode(bytes));
        }
        total += lanes.iter().map(|&l| f64::from(l)).sum::<f64>();
    }
    total
}

/// Applies `op(target, value)` to each of `targets` with the matching value of
/// little-endian `data` in `dtype`, in order; false when `dtype` is none of F32, F64 and
/// BF16. Written as zips over exact chunks so that the compiler vectorises the loops.
pub(crate) fn decode(
    dtype: Dtype,
    data: &[u8],
    targets: &mut [f32],
    op: impl Fn(&mut f32, f32),
) -> bool {
    match dtype {
        Dtype::F32 => {
            for (t, b) in targets.iter_mut().zip(data.chunks_exact(4)) {
                op(t, f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
            }
        }
        Dtype::F64 => {
            for (t, b) in targets.iter_mut().zip(data.chunks_exact(8)) {
                let v = f64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]);
                op(t, v as f32);
            }
        }
        // bfloat16 is the upper half of an f32.
        Dtype::BF16 => {
            for (t, b) in targets.iter_mut().zip(data.chunks_exact(2)) {
                op(
                    t,
                    f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16),
                );
            }
        }
        _ => return false,
    }
    true
}

/// Calls `each` with `values` as a file stores them in `dtype` (little-endian; F64, BF16,
/// else F32), a [`CHUNK`] of bytes at a time.
pub(crate) fn stored_bytes<E>(
    values: &[f32],
    dtype: Dtype,
    mut each: impl FnMut(&[u8]) -> Result<(), E>,
) -> Result<(), E> {
    let width = match dtype {
        Dtype::F64 => 8,
        Dtype::BF16 => 2,
        _ => 4,
    };
    let mut buffer = Vec::with_capacity(CHUNK);
    for chunk in values.chunks(CHUNK / width) {
        buffer.clear();
        match dtype {
            Dtype::F64 => buffer.extend(chunk.iter().flat_map(|v| f64::from(*v).to_le_bytes())),
            Dtype::BF16 => buffer.extend(chunk.iter().flat_map(|v| bf16_bits(*v).to_le_bytes())),
            _ => buffer.extend(chunk.iter().flat_map(|v| v.to_le_bytes())),
        }
        each(&buffer)?;
    }
    Ok(())
}

/// f32 → bfloat16 with round-to-nearest-even, as PyTorch converts; NaN stays NaN.
pub(crate) fn bf16_bits(value: f32) -> u16 {
    let bits = value.to_bits();
    if value.is_nan() {
        return ((bits >> 16) as u16) | 0x0040;
    }
    let rounding = 0x7FFF + ((bits >> 16) & 1);
    (bits.wrapping_add(rounding) >> 16) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Python SDK's test `test_it_is_the_parameter_servers` expects this same value.
    #[test]
    fn the_fingerprint_is_blake3_over_names_dtypes_shapes_and_values() {
        let tensor = |dtype, shape: Vec<usize>, values: Vec<f32>| Tensor {
            shape,
            values,
            dtype,
        };
        let model = Tensors(BTreeMap::from([
            ("w".to_string(), tensor(Dtype::F32, vec![2], vec![1.0, 2.0])),
            ("b".to_string(), tensor(Dtype::BF16, vec![1], vec![0.5])),
        ]));
        let mut hasher = blake3::Hasher::new();
        for field in [
            &b"b"[..],
            b"BF16",
            &1u64.to_le_bytes(),
            &0x3F00u16.to_le_bytes(),
            b"w",
            b"F32",
            &2u64.to_le_bytes(),
            &[1.0f32.to_le_bytes(), 2.0f32.to_le_bytes()].concat(),
        ] {
            hasher.update(&(field.len() as u64).to_le_bytes());
            hasher.update(field);
        }
        let expected = format!("blake3:{}", hasher.finalize().to_hex());
        assert_eq!(model.digest(), expected);
        assert_eq!(
            expected,
            "blake3:641ae45e78fdc42a6abba875c449e143b509263af1716e2b5fc8f02d9b127412"
        );
    }

    #[test]
    fn bfloat16_rounds_to_nearest_even() {
        assert_eq!(bf16_bits(1.0), 0x3F80);
        // 1 + 2⁻⁸ lies halfway between two bfloat16 values: it goes to the even one.
        assert_eq!(bf16_bits(1.0 + 1.0 / 256.0), 0x3F80);
        assert_eq!(bf16_bits(1.0 + 3.0 / 256.0), 0x3F82);
        assert!(f32::from_bits(u32::from(bf16_bits(f32::NAN)) << 16).is_nan());
    }
}
