//! The weighted mean of pseudo-gradients, accumulated as they arrive.

use std::collections::BTreeMap;

use safetensors::Dtype;

use crate::{
    Codec, Error, Fingerprint, Metadata, Tensor, Tensors,
    codec::{self, CODEC, CODEC_VERSION, INDEX, INT8_BLOCK, SCALE, SHAPE, VALUE, VERSION, sparse},
    file::{Entry, Layout, Scratch, Source, dtype_bytes},
    robust::{Clip, Norms},
    tensors::{MAX_UPDATE_VALUE, all_within, decode, squared_norm, stored_bytes},
};

/// A pseudo-gradient in a SafeTensors file, read and checked: plain (every tensor F32, F64 or
/// BF16) or compressed by one of the [`codec`](crate::codec)s, every value finite and within
/// [`MAX_UPDATE_VALUE`] (one NaN, or one value near f32's largest, would make the whole global
/// model NaN once averaged in), a compressed tensor's parts consistent (scales for every block,
/// positions inside the tensor and increasing). Its values are read from its [`Source`] a
/// chunk at a time as they are checked, and again as they are added (or measured, for
/// [`norm`](Self::norm)): the update is never held decoded, nor whole when it is on disk.
pub struct Update<'a, S: Source + ?Sized = [u8]> {
    source: &'a S,
    parts: Vec<(String, Part)>,
    scratch: std::cell::RefCell<Scratch>,
}

/// One parameter of an update, as its codec stored it.
pub(crate) enum Part {
    /// `none` and `bf16`: the values.
    Dense(Entry),
    /// `int8`: quantised values and a scale per block.
    Int8 { values: Entry, scales: Entry },
    /// `topk`: the shape, and the kept values at their positions.
    TopK {
        shape: Vec<usize>,
        indices: Entry,
        values: Entry,
    },
    /// `sparse`: the shape, and the records of its chunks.
    Sparse {
        shape: Vec<usize>,
        records: Entry,
        format: sparse::Format,
    },
}

fn f32_of(b: &[u8]) -> f32 {
    f32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// How many values [`Part::apply`] reads at a time: a multiple of `int8`'s block.
const APPLY_VALUES: usize = crate::file::CHUNK / 4;

/// The index, in a top-k part's increasing positions (`indices`, U32), of the first
/// position at or after `position`: the count of those before it.
fn first_position(
    source: &(impl Source + ?Sized),
    indices: &Entry,
    position: usize,
    buffer: &mut Vec<u8>,
) -> Result<usize, Error> {
    let (mut low, mut high) = (0, indices.values());
    while low < high {
        let middle = low + (high - low) / 2;
        let bytes = source.bytes_at(indices.offset + 4 * middle as u64, 4, buffer)?;
        if (u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) as usize) < position {
            low = middle + 1;
        } else {
            high = middle;
        }
    }
    Ok(low)
}

impl Part {
    fn shape(&self) -> &[usize] {
        match self {
            Part::Dense(entry) | Part::Int8 { values: entry, .. } => &entry.shape,
            Part::TopK { shape, .. } | Part::Sparse { shape, .. } => shape,
        }
    }

    /// The bytes of its values in the file.
    fn bytes(&self) -> u64 {
        match self {
            Part::Dense(entry) => entry.len,
            Part::Int8 { values, scales } => values.len + scales.len,
            Part::TopK {
                indices, values, ..
            } => indices.len + values.len,
            Part::Sparse { records, .. } => records.len,
        }
    }

    /// Calls `each` with the bytes of a companion tensor (`int8`'s scales, `topk`'s values)
    /// that belong with each chunk of the main one (`int8`'s values, `topk`'s positions),
    /// `per` bytes of it for every `unit` of the main one.
    #[allow(clippy::too_many_arguments)]
    fn paired(
        source: &(impl Source + ?Sized),
        scratch: &mut Scratch,
        main: &Entry,
        companion: &Entry,
        unit: usize,
        per: usize,
        mut each: impl FnMut(u64, &[u8], &[u8]) -> Result<(), Error>,
    ) -> Result<(), Error> {
        let Scratch {
            main: buffer,
            companion: paired_buffer,
            ..
        } = scratch;
        main.chunks(source, unit, buffer, |at, bytes| {
            let units = bytes.len().div_ceil(unit);
            let offset = companion.offset + at / unit as u64 * per as u64;
            let paired = source.bytes_at(offset, units * per, paired_buffer)?;
            each(at, bytes, paired)
        })
    }

    /// `op(target, value)` for each value, with the target of its position in `targets`
    /// (positions a top-k or sparse part does not hold are left alone: their value is 0), read
    /// [`APPLY_VALUES`] values at a time.
    fn apply(
        &self,
        source: &(impl Source + ?Sized),
        scratch: &mut Scratch,
        targets: &mut [f32],
        op: impl Fn(&mut f32, f32),
    ) -> Result<(), Error> {
        for (i, targets) in targets.chunks_mut(APPLY_VALUES).enumerate() {
            self.apply_range(source, scratch, i * APPLY_VALUES, targets, &op)?;
        }
        Ok(())
    }

    /// [`apply`](Self::apply) to the values at `start..start + targets.len()` alone, reading
    /// only their bytes. `start` is a multiple of `int8`'s block.
    fn apply_range(
        &self,
        source: &(impl Source + ?Sized),
        scratch: &mut Scratch,
        start: usize,
        targets: &mut [f32],
        op: impl Fn(&mut f32, f32),
    ) -> Result<(), Error> {
        let Scratch {
            main, companion, ..
        } = scratch;
        let at =
            |entry: &Entry, values: usize, width: usize| entry.offset + (values * width) as u64;
        match self {
            Part::Dense(entry) => {
                let width = dtype_bytes(entry.dtype);
                let bytes =
                    source.bytes_at(at(entry, start, width), targets.len() * width, main)?;
                decode(entry.dtype, bytes, targets, &op);
            }
            Part::Int8 { values, scales } => {
                debug_assert_eq!(start % INT8_BLOCK, 0, "a range inside an int8 block");
                let quantised = source.bytes_at(at(values, start, 1), targets.len(), main)?;
                let blocks = targets.len().div_ceil(INT8_BLOCK);
                let scales =
                    source.bytes_at(at(scales, start / INT8_BLOCK, 4), blocks * 4, companion)?;
                let blocks = targets
                    .chunks_mut(INT8_BLOCK)
                    .zip(quantised.chunks(INT8_BLOCK))
                    .zip(scales.chunks_exact(4));
                for ((targets, quantised), scale) in blocks {
                    let scale = f32_of(scale);
                    for (t, q) in targets.iter_mut().zip(quantised) {
                        op(t, f32::from(*q as i8) * scale);
                    }
                }
            }
            Part::TopK {
                indices, values, ..
            } => {
                // Positions increase (checked as the update was read): those of the range
                // are a run, found by halving.
                let first = first_position(source, indices, start, main)?;
                let end = first_position(source, indices, start + targets.len(), main)?;
                let positions = source.bytes_at(at(indices, first, 4), (end - first) * 4, main)?;
                let kept = source.bytes_at(at(values, first, 4), (end - first) * 4, companion)?;
                for (index, value) in positions.chunks_exact(4).zip(kept.chunks_exact(4)) {
                    let index = u32::from_le_bytes([index[0], index[1], index[2], index[3]]);
                    if let Some(t) = (index as usize)
                        .checked_sub(start)
                        .and_then(|i| targets.get_mut(i))
                    {
                        op(t, f32_of(value));
                    }
                }
            }
            Part::Sparse {
                shape,
                records,
                format,
            } => {
                let end = start + targets.len();
                sparse_records(
                    source,
                    main,
                    shape,
                    records,
                    format,
                    start..end,
                    |at, value| {
                        if let Some(t) = at.checked_sub(start).and_then(|i| targets.get_mut(i)) {
                            op(t, value);
                        }
                    },
                )?;
            }
        }
        Ok(())
    }

    /// Calls `each` with the part's values in order, a chunk at a time decoded into
    /// `decoded`, with the index of the first; false, calling nothing, for a top-k part,
    /// whose chunks are not runs of values.
    fn decoded_chunks(
        &self,
        source: &(impl Source + ?Sized),
        scratch: &mut Scratch,
        decoded: &mut Vec<f32>,
        mut each: impl FnMut(usize, &[f32]) -> Result<(), Error>,
    ) -> Result<bool, Error> {
        match self {
            Part::Dense(entry) => {
                let width = dtype_bytes(entry.dtype);
                entry.chunks(source, width, &mut scratch.main, |at, bytes| {
                    decoded.clear();
                    decoded.resize(bytes.len() / width, 0.0);
                    decode(entry.dtype, bytes, decoded, |t, v| *t = v);
                    each(at as usize / width, decoded)
                })?;
            }
            Part::Int8 { values, scales } => Self::paired(
                source,
                scratch,
                values,
                scales,
                INT8_BLOCK,
                4,
                |at, quantised, scales| {
                    decoded.clear();
                    for (quantised, scale) in
                        quantised.chunks(INT8_BLOCK).zip(scales.chunks_exact(4))
                    {
                        let scale = f32_of(scale);
                        decoded.extend(quantised.iter().map(|q| f32::from(*q as i8) * scale));
                    }
                    each(at as usize, decoded)
                },
            )?,
            Part::Sparse { .. } => {
                let len = self.shape().iter().product::<usize>();
                for start in (0..len).step_by(APPLY_VALUES) {
                    decoded.clear();
                    decoded.resize(APPLY_VALUES.min(len - start), 0.0);
                    self.apply_range(source, scratch, start, decoded, |t, v| *t = v)?;
                    each(start, decoded)?;
                }
            }
            Part::TopK { .. } => return Ok(false),
        }
        Ok(true)
    }

    fn squared_norm(
        &self,
        source: &(impl Source + ?Sized),
        scratch: &mut Scratch,
    ) -> Result<f64, Error> {
        let mut sum = 0.0;
        match self {
            Part::Dense(entry) | Part::TopK { values: entry, .. } => {
                entry.chunks(
                    source,
                    dtype_bytes(entry.dtype),
                    &mut scratch.main,
                    |_, bytes| {
                        sum += squared_norm(entry.dtype, bytes);
                        Ok(())
                    },
                )?;
            }
            Part::Int8 { values, scales } => {
                Self::paired(
                    source,
                    scratch,
                    values,
                    scales,
                    INT8_BLOCK,
                    4,
                    |_, quantised, scales| {
                        for (quantised, scale) in
                            quantised.chunks(INT8_BLOCK).zip(scales.chunks_exact(4))
                        {
                            let scale = f64::from(f32_of(scale));
                            let block: f64 =
                                quantised.iter().map(|q| f64::from(*q as i8).powi(2)).sum();
                            sum += block * scale * scale;
                        }
                        Ok(())
                    },
                )?;
            }
            Part::Sparse {
                shape,
                records,
                format,
            } => {
                let len = shape.iter().product();
                sparse_records(
                    source,
                    &mut scratch.main,
                    shape,
                    records,
                    format,
                    0..len,
                    |_, v| {
                        sum += f64::from(v) * f64::from(v);
                    },
                )?;
            }
        }
        Ok(sum)
    }
}

impl<'a> Update<'a, [u8]> {
    /// The update whose SafeTensors bytes are `bytes`.
    pub fn read(bytes: &'a [u8]) -> Result<Self, Error> {
        Self::from_source(bytes)
    }
}

impl<'a, S: Source + ?Sized> Update<'a, S> {
    /// The update in the SafeTensors file `source` holds: its header read, every value
    /// checked (one pass over the file).
    pub fn from_source(source: &'a S) -> Result<Self, Error> {
        let layout = Layout::read(source)?;
        let metadata = &layout.metadata;
        let codec = metadata.get(CODEC).map_or("none", String::as_str);
        if metadata.contains_key(CODEC)
            && metadata.get(CODEC_VERSION).map(String::as_str) != Some(VERSION)
        {
            return Err(Error::Format(format!(
                "codec version {:?}; this node reads version {VERSION}",
                metadata.get(CODEC_VERSION)
            )));
        }
        let mut scratch = Scratch::default();
        let parts = parts(source, &mut scratch, codec, layout.entries, metadata)?;
        Ok(Update {
            source,
            parts,
            scratch: std::cell::RefCell::new(scratch),
        })
    }

    /// Its parameters, as read from its source: what an [`Accumulator`] holds with the source.
    pub(crate) fn into_parts(self) -> Vec<(String, Part)> {
        self.parts
    }

    /// The L2 norm over all its values: one more pass over them, so taken only when asked.
    pub fn norm(&self) -> Result<f64, Error> {
        Ok(self.norms()?.whole)
    }

    /// The L2 norms of the whole update and of each tensor: one more pass over its values.
    pub fn norms(&self) -> Result<Norms, Error> {
        let scratch = &mut self.scratch.borrow_mut();
        let mut norms = Norms::default();
        let mut sum = 0.0;
        for (name, part) in &self.parts {
            let squared = part.squared_norm(self.source, scratch)?;
            sum += squared;
            norms.tensors.insert(name.clone(), squared.sqrt());
        }
        norms.whole = sum.sqrt();
        Ok(norms)
    }

    /// Adds the update to `model` value by value in f32 (θ ← θ + d): how the parameter
    /// server and every trainer apply a broadcast change to the global model, so that they
    /// hold it bit for bit alike. Refused, with `model` left as it was, unless the update has
    /// exactly the model's parameters and shapes.
    pub fn add_to(&self, model: &mut Tensors) -> Result<(), Error> {
        check_same(
            &model.0,
            self.parts
                .iter()
                .map(|(name, part)| (name.as_str(), part.shape(), Dtype::F32)),
        )?;
        let scratch = &mut self.scratch.borrow_mut();
        for (name, part) in &self.parts {
            if let Some(tensor) = model.0.get_mut(name) {
                part.apply(self.source, scratch, &mut tensor.values, |t, v| *t += v)?;
            }
        }
        Ok(())
    }

    /// Adds the update to the model in the SafeTensors file `model` as [`add_to`](Self::add_to)
    /// adds it, writing the new model (f32) to `out` atomically, a chunk at a time (a
    /// parameter at a time for a top-k update): a few megabytes of memory, whatever the
    /// model's size. The new model's
    /// fingerprint; refused, with nothing written, unless the update has exactly the model's
    /// parameters and shapes.
    pub fn add_to_file(
        &self,
        model: &(impl Source + ?Sized),
        out: &std::path::Path,
        metadata: Metadata,
    ) -> Result<String, Error> {
        let layout = Layout::read(model)?;
        check_same(
            &layout.entries,
            self.parts
                .iter()
                .map(|(name, part)| (name.as_str(), part.shape(), Dtype::F32)),
        )?;
        let listing = layout
            .entries
            .iter()
            .map(|(name, entry)| (name.clone(), Dtype::F32, entry.shape.clone()));
        let scratch = &mut self.scratch.borrow_mut();
        let mut fingerprint = Fingerprint::new();
        let (mut buffer, mut decoded, mut sum) = (Vec::new(), Vec::new(), Vec::new());
        crate::file::write_file(out, false, listing, metadata, |writer| {
            // In the file's order, which the listing follows.
            for (name, entry) in &layout.entries {
                let Some((_, part)) = self.parts.iter().find(|(n, _)| n == name) else {
                    continue;
                };
                fingerprint.begin(name, Dtype::F32, &entry.shape);
                let width = dtype_bytes(entry.dtype);
                let streamed =
                    part.decoded_chunks(self.source, scratch, &mut decoded, |first, change| {
                        let offset = entry.offset + (first * width) as u64;
                        let bytes = model.bytes_at(offset, change.len() * width, &mut buffer)?;
                        sum.clear();
                        sum.resize(change.len(), 0.0);
                        if !decode(entry.dtype, bytes, &mut sum, |t, v| *t = v) {
                            return Err(Error::Dtype {
                                name: name.clone(),
                                dtype: entry.dtype.to_string(),
                            });
                        }
                        for (s, c) in sum.iter_mut().zip(change) {
                            *s += c;
                        }
                        fingerprint.values(&sum, Dtype::F32);
                        stored_bytes(&sum, Dtype::F32, |bytes| writer.write(bytes))
                    })?;
                if !streamed {
                    // A top-k change: the parameter whole.
                    let mut tensor = Tensor::read(model, name, entry, &mut buffer)?;
                    part.apply(self.source, scratch, &mut tensor.values, |t, v| *t += v)?;
                    fingerprint.values(&tensor.values, Dtype::F32);
                    stored_bytes(&tensor.values, Dtype::F32, |bytes| writer.write(bytes))?;
                }
            }
            Ok(())
        })?;
        Ok(fingerprint.finish())
    }

    /// The update decoded, each parameter f32. A `topk` or `sparse` part is as large as the shape its
    /// file claims: decode only bytes whose shapes were checked against the model (the
    /// [`Accumulator`] never decodes a copy).
    pub fn to_tensors(&self) -> Result<Tensors, Error> {
        let mut tensors = BTreeMap::new();
        let scratch = &mut self.scratch.borrow_mut();
        for (name, part) in &self.parts {
            let mut values = vec![0.0; part.shape().iter().product()];
            part.apply(self.source, scratch, &mut values, |t, v| *t = v)?;
            tensors.insert(name.clone(), codec::tensor(part.shape().to_vec(), values));
        }
        Ok(Tensors(tensors))
    }
}

/// The parameters stored in `entries` of `source` by the codec named `codec`, checked.
fn parts(
    source: &(impl Source + ?Sized),
    scratch: &mut Scratch,
    codec: &str,
    entries: BTreeMap<String, Entry>,
    metadata: &Metadata,
) -> Result<Vec<(String, Part)>, Error> {
    let buffer = &mut scratch.main;
    match codec {
        "none" | "bf16" => dense_parts(source, buffer, entries),
        "int8" => int8_parts(source, buffer, entries),
        "topk" => top_k_parts(source, buffer, entries, metadata),
        "sparse" => sparse_parts(source, buffer, entries, metadata),
        other => Err(Error::Format(format!(
            "codec {other:?}; this node reads none, bf16, int8, topk and sparse"
        ))),
    }
}

/// The buffers of [`round_trip`], kept from call to call.
#[derive(Debug, Default)]
pub(crate) struct RoundTrip {
    encoded: Vec<u8>,
    decoded: Vec<f32>,
    scratch: Scratch,
}

impl RoundTrip {
    /// The bytes of the last [`round_trip`].
    pub(crate) fn encoded(&self) -> &[u8] {
        &self.encoded
    }
}

/// One parameter's `values` compressed with `codec` ([`codec::encode_values`]), and the values
/// a receiver reads from those bytes, read and checked by the code every receiver uses.
pub(crate) fn round_trip<'b>(
    codec: Codec,
    name: &str,
    shape: &[usize],
    values: &[f32],
    buffers: &'b mut RoundTrip,
) -> Result<(&'b [u8], &'b [f32]), Error> {
    codec::encode_values(codec, name, values, &mut buffers.encoded)?;
    let one = || std::iter::once((name, shape));
    let mut entries = BTreeMap::new();
    let mut offset = 0;
    for (stored, dtype, shape) in codec::stored(codec, one())? {
        let len = (shape.iter().product::<usize>() * dtype.bitsize()).div_ceil(8) as u64;
        let entry = Entry {
            dtype,
            shape,
            offset,
            len,
        };
        entries.insert(stored, entry);
        offset += len;
    }
    let metadata = codec::with_codec(codec, &Metadata::new(), one());
    let source = &buffers.encoded[..];
    buffers.decoded.clear();
    buffers.decoded.resize(values.len(), 0.0);
    let scratch = &mut buffers.scratch;
    for (_, part) in parts(source, scratch, codec.name(), entries, &metadata)? {
        part.apply(source, scratch, &mut buffers.decoded, |t, v| *t = v)?;
    }
    Ok((&buffers.encoded, &buffers.decoded))
}

fn not_finite(name: &str) -> Error {
    Error::NotFinite {
        name: name.to_string(),
    }
}

fn malformed(name: &str, problem: impl Into<String>) -> Error {
    Error::Mismatch {
        name: name.to_string(),
        problem: problem.into(),
    }
}

/// Whether every value of `entry`, read as its dtype, is finite and at most `limit` in
/// magnitude.
fn entry_within(
    source: &(impl Source + ?Sized),
    buffer: &mut Vec<u8>,
    entry: &Entry,
    limit: f32,
) -> Result<bool, Error> {
    let mut within = true;
    entry.chunks(source, dtype_bytes(entry.dtype), buffer, |_, bytes| {
        within &= all_within(entry.dtype, bytes, limit);
        Ok(())
    })?;
    Ok(within)
}

fn dense_parts(
    source: &(impl Source + ?Sized),
    buffer: &mut Vec<u8>,
    entries: BTreeMap<String, Entry>,
) -> Result<Vec<(String, Part)>, Error> {
    let mut parts = Vec::new();
    for (name, entry) in entries {
        if !matches!(entry.dtype, Dtype::F32 | Dtype::F64 | Dtype::BF16) {
            return Err(Error::Dtype {
                name,
                dtype: entry.dtype.to_string(),
            });
        }
        if !entry_within(source, buffer, &entry, MAX_UPDATE_VALUE)? {
            return Err(not_finite(&name));
        }
        parts.push((name, Part::Dense(entry)));
    }
    Ok(parts)
}

fn int8_parts(
    source: &(impl Source + ?Sized),
    buffer: &mut Vec<u8>,
    mut entries: BTreeMap<String, Entry>,
) -> Result<Vec<(String, Part)>, Error> {
    let names: Vec<String> = entries
        .keys()
        .filter(|n| !n.ends_with(SCALE))
        .cloned()
        .collect();
    let mut parts = Vec::new();
    for name in names {
        let values = entries
            .remove(&name)
            .ok_or_else(|| malformed(&name, "is missing"))?;
        let scales = entries
            .remove(&format!("{name}{SCALE}"))
            .ok_or_else(|| malformed(&name, "has no scales"))?;
        if values.dtype != Dtype::I8 || scales.dtype != Dtype::F32 {
            return Err(malformed(&name, "int8 values and F32 scales expected"));
        }
        let blocks = (values.len as usize).div_ceil(INT8_BLOCK);
        if scales.shape != [blocks] {
            return Err(malformed(
                &name,
                format!("{} scales for {blocks} blocks", scales.values()),
            ));
        }
        // |q| ≤ 127: a scale within the limit / 127 keeps every value within it.
        if !entry_within(source, buffer, &scales, MAX_UPDATE_VALUE / 127.0)? {
            return Err(not_finite(&name));
        }
        parts.push((name, Part::Int8 { values, scales }));
    }
    if let Some(stray) = entries.keys().next() {
        return Err(malformed(stray, "scales of no parameter"));
    }
    Ok(parts)
}

fn top_k_parts(
    source: &(impl Source + ?Sized),
    buffer: &mut Vec<u8>,
    mut entries: BTreeMap<String, Entry>,
    metadata: &Metadata,
) -> Result<Vec<(String, Part)>, Error> {
    let names: Vec<String> = entries
        .keys()
        .filter_map(|n| n.strip_suffix(INDEX).map(str::to_string))
        .collect();
    let mut parts = Vec::new();
    for name in names {
        let indices = entries
            .remove(&format!("{name}{INDEX}"))
            .ok_or_else(|| malformed(&name, "has no positions"))?;
        let values = entries
            .remove(&format!("{name}{VALUE}"))
            .ok_or_else(|| malformed(&name, "has no values"))?;
        let (shape, len) = claimed_shape(&name, metadata)?;
        if indices.dtype != Dtype::U32 || values.dtype != Dtype::F32 {
            return Err(malformed(&name, "U32 positions and F32 values expected"));
        }
        let k = indices.values();
        if indices.shape.len() != 1 || values.shape != indices.shape || k > len {
            return Err(malformed(
                &name,
                "positions and values of different or impossible counts",
            ));
        }
        let mut previous: Option<u32> = None;
        let mut ordered = true;
        indices.chunks(source, 4, buffer, |_, bytes| {
            for index in bytes.chunks_exact(4) {
                let index = u32::from_le_bytes([index[0], index[1], index[2], index[3]]);
                ordered &= (index as usize) < len && previous.is_none_or(|p| index > p);
                previous = Some(index);
            }
            Ok(())
        })?;
        if !ordered {
            return Err(malformed(
                &name,
                "positions outside the tensor or not increasing",
            ));
        }
        if !entry_within(source, buffer, &values, MAX_UPDATE_VALUE)? {
            return Err(not_finite(&name));
        }
        parts.push((
            name,
            Part::TopK {
                shape,
                indices,
                values,
            },
        ));
    }
    if let Some(stray) = entries.keys().next() {
        return Err(malformed(stray, "values of no parameter"));
    }
    Ok(parts)
}

/// The shape, and its count of values, that the metadata of a `topk` or `sparse` file claims
/// for parameter `name`.
fn claimed_shape(name: &str, metadata: &Metadata) -> Result<(Vec<usize>, usize), Error> {
    let shape_text = metadata
        .get(&format!("{SHAPE}{name}"))
        .ok_or_else(|| malformed(name, "has no shape in the metadata"))?;
    let shape = codec::parse_shape(name, shape_text)?;
    let len = shape
        .iter()
        .try_fold(1usize, |n, d| n.checked_mul(*d))
        .filter(|len| *len <= MAX_CLAIMED_VALUES)
        .ok_or_else(|| malformed(name, "a shape too large"))?;
    Ok((shape, len))
}

/// The most values a `topk` or `sparse` file may claim for a parameter: 2⁴⁸, a thousand
/// times a trillion-parameter model, and far from where the sizes computed from it overflow.
const MAX_CLAIMED_VALUES: usize = 1 << 48;

/// The values whose `sparse` records are read at once: 256 chunks (22 KiB of records at the
/// default 64 of a chunk and 2 bits).
const SPARSE_READ_VALUES: usize = 256 * sparse::CHUNK;

/// Calls `each` with the position and value of every value kept by the records of `records`
/// (a parameter of `shape`) for the chunks that hold values `range`, checking each record
/// (those of a file read again at a round's close too), a run of chunks at a time.
fn sparse_records(
    source: &(impl Source + ?Sized),
    buffer: &mut Vec<u8>,
    shape: &[usize],
    records: &Entry,
    format: &sparse::Format,
    range: std::ops::Range<usize>,
    mut each: impl FnMut(usize, f32),
) -> Result<(), Error> {
    let len: usize = shape.iter().product();
    let name = "a sparse parameter";
    // From the start of the chunk that holds the range's first value: records are whole.
    let mut start = range.start - range.start % sparse::CHUNK;
    while start < range.end {
        let end = (start + SPARSE_READ_VALUES).min(range.end);
        let (first, offset, bytes) = format.span(len, start, end);
        let bytes = source.bytes_at(records.offset + offset, bytes, buffer)?;
        format
            .decode(len, first, bytes, &mut each)
            .map_err(|problem| malformed(name, problem))?;
        start = end;
    }
    Ok(())
}

fn sparse_parts(
    source: &(impl Source + ?Sized),
    buffer: &mut Vec<u8>,
    mut entries: BTreeMap<String, Entry>,
    metadata: &Metadata,
) -> Result<Vec<(String, Part)>, Error> {
    let number = |key: &str| {
        metadata
            .get(key)
            .and_then(|text| text.parse::<u32>().ok())
            .ok_or_else(|| Error::Format(format!("a sparse file without a number at {key}")))
    };
    let format = sparse::Format::new(number(sparse::KEPT)? as usize, number(sparse::BITS)?)
        .map_err(|problem| Error::Format(format!("a sparse file's format: {problem}")))?;
    let names: Vec<String> = entries
        .keys()
        .filter_map(|n| n.strip_suffix(sparse::RECORDS).map(str::to_string))
        .collect();
    let mut parts = Vec::new();
    for name in names {
        let Some(records) = entries.remove(&format!("{name}{}", sparse::RECORDS)) else {
            continue;
        };
        let (shape, len) = claimed_shape(&name, metadata)?;
        if records.dtype != Dtype::U8 || records.len != format.bytes(len) {
            return Err(malformed(
                &name,
                format!(
                    "{} bytes of {} records for {len} values; {} expected",
                    records.len,
                    records.dtype,
                    format.bytes(len)
                ),
            ));
        }
        sparse_records(source, buffer, &shape, &records, &format, 0..len, |_, _| ()).map_err(
            |error| match error {
                Error::Mismatch { problem, .. } => malformed(&name, problem),
                error => error,
            },
        )?;
        parts.push((
            name,
            Part::Sparse {
                shape,
                records,
                format,
            },
        ));
    }
    if let Some(stray) = entries.keys().next() {
        return Err(malformed(stray, "is not a parameter's records"));
    }
    Ok(parts)
}

impl<S: Source + ?Sized> std::fmt::Debug for Update<'_, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Update")
            .field("tensors", &self.parts.len())
            .finish()
    }
}

/// One round's pseudo-gradients, checked as they arrive and summed when asked: Σ nᵢΔᵢ and
/// Σ nᵢ. Each update stays where it is (a file is read again, not held in memory), and the
/// sum is made a range of values at a time ([`mean`](Self::mean), and the parameter server's
/// close, which steps each range as it is summed): while the updates held carry no more
/// values' bytes than the model's f32 (three `int8` updates, or one f32), no sum the size of
/// the model is kept, and the close reads each update's (compressed) bytes once instead of a
/// model-sized f32 sum written as they arrive and read back. Past that (many updates, or f32
/// ones) the held updates are folded into a sum and the later ones added to it as they come:
/// the close then reads the sum, and never more than a model's bytes of updates. An
/// accumulator that [keeps every update](Self::keep_every_update) never folds: its updates'
/// shares may change until the sum ([`clip`](Self::clip)), and the close reads each of them.
#[derive(Default)]
pub struct Accumulator {
    /// The parameters' shapes: the model's, or the first update's.
    shapes: BTreeMap<String, Vec<usize>>,
    held: Vec<Held>,
    /// The bytes of values the held updates carry.
    held_bytes: u64,
    /// Σ nᵢΔᵢ of the updates folded so far, by parameter; empty until they are.
    folded: BTreeMap<String, Vec<f32>>,
    /// Who sent each value of the updates folded so far, by parameter ([`Senders`]).
    folded_senders: BTreeMap<String, Senders>,
    /// A fold could not read an update whole: the round's sum is lost.
    damaged: Option<std::sync::Arc<Error>>,
    weight: f64,
    /// Never fold: every update is held to the sum.
    keep_every_update: bool,
}

/// An update checked and held until the sum.
struct Held {
    source: Box<dyn Source + Send + Sync>,
    parts: BTreeMap<String, Part>,
    /// What it was added with (its samples): its say in how many sent a value.
    samples: f32,
    /// `samples` times what judging the round left of it ([`Accumulator::clip`]).
    weight: f32,
    /// The share of each tensor that counts, for tensors clipped on their own.
    tensor_shares: BTreeMap<String, f32>,
}

impl Held {
    /// The weight of its tensor `name` in the sum.
    fn weight_of(&self, name: &str) -> f32 {
        self.weight * self.tensor_shares.get(name).copied().unwrap_or(1.0)
    }
}

/// The samples of the updates that sent the values of one parameter: every value of a
/// dense part, the kept ones of a `sparse` part.
#[derive(Debug, Default)]
struct Senders {
    /// Of those that sent every value.
    every: f32,
    /// Of those that sent some, by value; empty until a `sparse` part is folded.
    each: Vec<f32>,
}

impl Part {
    /// Whether it sends some of the parameter's values, not all: the mean of such a value
    /// is over the updates that sent it ([`Accumulator::sum_into`]).
    fn sends_some(&self) -> bool {
        matches!(self, Part::Sparse { .. })
    }
}

impl std::fmt::Debug for Accumulator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Accumulator")
            .field("parameters", &self.shapes.len())
            .field("updates", &self.held.len())
            .field("weight", &self.weight)
            .finish()
    }
}

impl Accumulator {
    pub fn new() -> Self {
        Self::default()
    }

    /// An accumulator that takes only updates with exactly `model`'s tensors and shapes.
    pub fn shaped_like(model: &Tensors) -> Self {
        Self {
            shapes: model
                .0
                .iter()
                .map(|(name, tensor)| (name.clone(), tensor.shape.clone()))
                .collect(),
            ..Self::default()
        }
    }

    /// Adds one worker's pseudo-gradient, weighted by the samples it trained on. The first
    /// update fixes the tensors' names and shapes (unless the accumulator is
    /// [shaped like a model](Self::shaped_like)); every later one must have the same, or it
    /// is refused and the sum is left as it was.
    pub fn add(&mut self, update: &Tensors, weight: f64) -> Result<(), Error> {
        self.add_safetensors(&update.to_bytes(&Metadata::new())?, weight)
    }

    /// [`add`](Self::add) of the SafeTensors bytes of an update (copied: see
    /// [`add_source`](Self::add_source) for updates that stay where they are).
    pub fn add_safetensors(&mut self, bytes: &[u8], weight: f64) -> Result<(), Error> {
        self.add_source(bytes.to_vec(), weight)
    }

    /// [`add`](Self::add) of the update in `source` (a file, say), read a chunk at a time to
    /// check it and held, unread, until the sum.
    pub fn add_source(
        &mut self,
        source: impl Source + Send + Sync + 'static,
        weight: f64,
    ) -> Result<(), Error> {
        let parts = Update::from_source(&source)?.parts;
        self.hold(source, parts, weight)
    }

    /// Holds an update already [read](Update::from_source) and checked from `source`, as its
    /// `parts`.
    pub(crate) fn hold(
        &mut self,
        source: impl Source + Send + Sync + 'static,
        parts: Vec<(String, Part)>,
        weight: f64,
    ) -> Result<(), Error> {
        if !weight.is_finite() || weight <= 0.0 {
            return Err(Error::Weight(weight));
        }
        let shapes = parts
            .iter()
            .map(|(name, part)| (name.as_str(), part.shape(), Dtype::F32));
        if self.shapes.is_empty() {
            // A top-k file states its shapes in a line of metadata: only a model's shapes
            // may say how large the sum is.
            if let Some((name, _)) =
                (parts.iter()).find(|(_, p)| matches!(p, Part::TopK { .. } | Part::Sparse { .. }))
            {
                return Err(Error::Mismatch {
                    name: name.clone(),
                    problem: "a top-k or sparse update is added only to a sum shaped like the model (Accumulator::shaped_like)".into(),
                });
            }
            self.shapes = shapes
                .map(|(name, shape, _)| (name.to_string(), shape.to_vec()))
                .collect();
        } else {
            check_same(&self.shapes, shapes)?;
        }
        self.held_bytes += parts.iter().map(|(_, part)| part.bytes()).sum::<u64>();
        self.held.push(Held {
            source: Box::new(source),
            parts: parts.into_iter().collect(),
            samples: weight as f32,
            weight: weight as f32,
            tensor_shares: BTreeMap::new(),
        });
        self.weight += weight;
        if self.keep_every_update {
            return Ok(());
        }
        let model_bytes: u64 = self
            .shapes
            .values()
            .map(|shape| 4 * shape.iter().product::<usize>() as u64)
            .sum();
        if !self.folded.is_empty() || self.held_bytes > model_bytes {
            self.fold();
        }
        Ok(())
    }

    /// The same accumulator holding every update to the sum (`true`) or folding them once
    /// they carry more bytes than the model (`false`, the default). Set before any update
    /// is added.
    pub fn keep_every_update(&mut self, keep: bool) {
        self.keep_every_update = keep;
    }

    /// Counts each held update, in the order they came, for its share in `clips` (the
    /// round's [`Limits::clip`](crate::robust::Limits::clip)): its weight times the whole
    /// share, each tensor clipped on its own times its share too. The total weight, which
    /// the sum is divided by, stays the samples': a clipped update is a smaller one, not a
    /// rarer one. Only an accumulator that [keeps every update](Self::keep_every_update)
    /// can; one that folded refuses.
    pub fn clip(&mut self, clips: &[Clip]) -> Result<(), Error> {
        if !self.folded.is_empty() || clips.len() != self.held.len() {
            return Err(Error::Clips {
                clips: clips.len(),
                held: self.held.len(),
                folded: !self.folded.is_empty(),
            });
        }
        for (held, clip) in self.held.iter_mut().zip(clips) {
            held.weight *= clip.whole;
            held.tensor_shares.clone_from(&clip.tensors);
        }
        Ok(())
    }

    /// Adds every held update into the sum, in the order they came, and drops them.
    fn fold(&mut self) {
        if self.folded.is_empty() {
            self.folded = (self.shapes.iter())
                .map(|(name, shape)| (name.clone(), vec![0.0; shape.iter().product()]))
                .collect();
        }
        let mut scratch = Scratch::default();
        for held in self.held.drain(..) {
            for (name, part) in &held.parts {
                let (Some(sum), None) = (self.folded.get_mut(name), &self.damaged) else {
                    continue;
                };
                let w = held.weight_of(name);
                let mut folded = part.apply(&*held.source, &mut scratch, sum, |s, v| *s += w * v);
                let senders = self.folded_senders.entry(name.clone()).or_default();
                if !part.sends_some() {
                    senders.every += held.samples;
                } else if folded.is_ok() {
                    if senders.each.is_empty() {
                        senders.each = vec![0.0; sum.len()];
                    }
                    let n = held.samples;
                    folded = part.apply(&*held.source, &mut scratch, &mut senders.each, |s, _| {
                        *s += n;
                    });
                }
                if let Err(error) = folded {
                    self.damaged = Some(std::sync::Arc::new(error));
                }
            }
        }
        self.held_bytes = 0;
    }

    /// How many updates were added.
    pub fn updates(&self) -> usize {
        self.held.len()
    }

    /// The total weight (samples) added.
    pub fn weight(&self) -> f64 {
        self.weight
    }

    /// 1 / Σ nᵢ, what each sum is multiplied by to make the mean; fails when nothing was
    /// added.
    pub(crate) fn scale(&self) -> Result<f32, Error> {
        if let Some(reason) = &self.damaged {
            return Err(Error::SumLost(reason.clone()));
        }
        if self.weight == 0.0 {
            return Err(Error::Empty);
        }
        Ok((1.0 / self.weight) as f32)
    }

    /// The dot products of the held updates with one another, by parameter: for each
    /// parameter, the k×k matrix (row-major, k the updates held, in the order they came) of
    /// ⟨Δᵢ, Δⱼ⟩ over its values. One pass over the updates, a range of values at a time on
    /// the threads at hand; what robust aggregation measures distances with
    /// ([`robust::centre`](crate::robust::centre)). Refused after a fold, which keeps no
    /// update apart.
    pub fn gram(&self) -> Result<BTreeMap<String, Vec<f64>>, Error> {
        use rayon::prelude::*;
        if !self.folded.is_empty() {
            return Err(Error::Clips {
                clips: 0,
                held: self.held.len(),
                folded: true,
            });
        }
        let k = self.held.len();
        let mut grams = BTreeMap::new();
        for (name, shape) in &self.shapes {
            let len: usize = shape.iter().product();
            let starts: Vec<usize> = (0..len).step_by(APPLY_VALUES).collect();
            let gram = starts
                .par_iter()
                .map_init(
                    || (Scratch::default(), vec![Vec::new(); k]),
                    |(scratch, values), &start| -> Result<Vec<f64>, Error> {
                        let end = (start + APPLY_VALUES).min(len);
                        for (held, values) in self.held.iter().zip(values.iter_mut()) {
                            values.clear();
                            values.resize(end - start, 0.0);
                            if let Some(part) = held.parts.get(name) {
                                part.apply_range(&*held.source, scratch, start, values, |t, v| {
                                    *t = v;
                                })?;
                            }
                        }
                        let mut gram = vec![0.0; k * k];
                        for i in 0..k {
                            for j in i..k {
                                let dot: f64 = values[i]
                                    .iter()
                                    .zip(&values[j])
                                    .map(|(a, b)| f64::from(*a) * f64::from(*b))
                                    .sum();
                                gram[i * k + j] = dot;
                                gram[j * k + i] = dot;
                            }
                        }
                        Ok(gram)
                    },
                )
                .try_reduce(
                    || vec![0.0; k * k],
                    |mut a, b| {
                        a.iter_mut().zip(b).for_each(|(a, b)| *a += b);
                        Ok(a)
                    },
                )?;
            grams.insert(name.clone(), gram);
        }
        Ok(grams)
    }

    /// The weights the held updates were added with (their samples), in the order they came.
    pub fn weights(&self) -> Vec<f64> {
        self.held.iter().map(|h| f64::from(h.weight)).collect()
    }

    /// Σ nᵢΔᵢ of parameter `name` at `start..start + sum.len()`, into `sum`, the updates
    /// added in the order they came (the same f32 arithmetic whatever the ranges). `start`
    /// is a multiple of `int8`'s block.
    ///
    /// Where `sparse` updates sent some values and not others, each value's sum is scaled
    /// to be over the updates that sent it (SparseLoCo's mean of what was sent, Templar's
    /// `scatter_reduce(mean)`): Σ nᵢΔᵢ · Σ nᵢ / Σ_{i sent it} nᵢ, so that the [`scale`]
    /// (1 / Σ nᵢ) makes it their mean. A value only one trainer kept would otherwise move
    /// by a quarter of it with four trainers, and most values of a 1 % update are kept by
    /// one. The senders count with the samples they were added with, not with what judging
    /// left of them: a clipped update's values stay clipped where it alone sent them, and
    /// one judged to count for nothing still counts among the senders, as it does in the
    /// mean of dense updates.
    ///
    /// [`scale`]: Self::scale
    pub(crate) fn sum_into(
        &self,
        name: &str,
        start: usize,
        sum: &mut [f32],
        scratch: &mut Scratch,
    ) -> Result<(), Error> {
        match self.folded.get(name) {
            Some(folded) => sum.copy_from_slice(&folded[start..start + sum.len()]),
            None => sum.fill(0.0),
        }
        for held in &self.held {
            if let Some(part) = held.parts.get(name) {
                let w = held.weight_of(name);
                part.apply_range(&*held.source, scratch, start, sum, |s, v| *s += w * v)?;
            }
        }
        let folded = self.folded_senders.get(name);
        let some_sent_some = folded.is_some_and(|f| !f.each.is_empty())
            || (self.held.iter()).any(|held| held.parts.get(name).is_some_and(Part::sends_some));
        if !some_sent_some {
            return Ok(());
        }
        let mut senders = std::mem::take(&mut scratch.senders);
        senders.clear();
        match folded {
            Some(f) if !f.each.is_empty() => {
                senders.extend(f.each[start..start + sum.len()].iter().map(|n| n + f.every));
            }
            f => senders.resize(sum.len(), f.map_or(0.0, |f| f.every)),
        }
        let mut counted = Ok(());
        for held in &self.held {
            let Some(part) = held.parts.get(name) else {
                continue;
            };
            let n = held.samples;
            if part.sends_some() {
                counted = part.apply_range(&*held.source, scratch, start, &mut senders, |s, _| {
                    *s += n;
                });
                if counted.is_err() {
                    break;
                }
            } else {
                senders.iter_mut().for_each(|s| *s += n);
            }
        }
        let all = self.weight as f32;
        for (value, sent) in sum.iter_mut().zip(&senders) {
            if *sent > 0.0 {
                *value *= all / sent;
            }
        }
        scratch.senders = senders;
        counted
    }

    /// Drops every update, keeping the shapes, for the next round.
    pub fn clear(&mut self) {
        self.held.clear();
        self.held_bytes = 0;
        self.folded.clear();
        self.folded_senders.clear();
        self.damaged = None;
        self.weight = 0.0;
    }

    /// Σ nᵢΔᵢ / Σ nᵢ: the accumulator is left empty and unshaped (the next update shapes it
    /// again).
    pub fn mean(&mut self) -> Result<Tensors, Error> {
        let scale = self.scale()?;
        let mut scratch = Scratch::default();
        let mut mean = BTreeMap::new();
        for (name, shape) in std::mem::take(&mut self.shapes) {
            // A folded sum of dense updates (nothing is held beside it) becomes the mean in
            // place.
            let sent_some = (self.folded_senders.get(&name)).is_some_and(|f| !f.each.is_empty());
            let values = match (!sent_some).then(|| self.folded.remove(&name)).flatten() {
                Some(mut values) => {
                    values.iter_mut().for_each(|value| *value *= scale);
                    values
                }
                None => {
                    let mut values = vec![0.0; shape.iter().product()];
                    for (i, range) in values.chunks_mut(APPLY_VALUES).enumerate() {
                        self.sum_into(&name, i * APPLY_VALUES, range, &mut scratch)?;
                        range.iter_mut().for_each(|value| *value *= scale);
                    }
                    values
                }
            };
            mean.insert(name, codec::tensor(shape, values));
        }
        self.clear();
        Ok(Tensors(mean))
    }
}

/// Something with a shape: a parameter in memory or in a file.
pub(crate) trait Shaped {
    fn shape(&self) -> &[usize];
}

impl Shaped for Vec<usize> {
    fn shape(&self) -> &[usize] {
        self
    }
}

impl Shaped for Tensor {
    fn shape(&self) -> &[usize] {
        &self.shape
    }
}

impl Shaped for Entry {
    fn shape(&self) -> &[usize] {
        &self.shape
    }
}

/// Refuses an update unless it has exactly the tensors and shapes of `known`.
pub(crate) fn check_same<'a>(
    known: &BTreeMap<String, impl Shaped>,
    update: impl Iterator<Item = (&'a str, &'a [usize], Dtype)>,
) -> Result<(), Error> {
    let mut seen = std::collections::HashSet::new();
    for (name, shape, _) in update {
        match known.get(name) {
            None => {
                return Err(Error::Mismatch {
                    name: name.to_string(),
                    problem: "is not a parameter of the model".into(),
                });
            }
            Some(expected) if expected.shape() != shape => {
                return Err(Error::Mismatch {
                    name: name.to_string(),
                    problem: format!("has shape {shape:?}; the model's is {:?}", expected.shape()),
                });
            }
            Some(_) => {
                seen.insert(name);
            }
        }
    }
    if let Some(missing) = known.keys().find(|name| !seen.contains(name.as_str())) {
        return Err(Error::Mismatch {
            name: missing.clone(),
            problem: "is missing from the update".into(),
        });
    }
    Ok(())
}
