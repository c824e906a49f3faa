//! The weighted mean of pseudo-gradients, accumulated as they arrive.

use std::collections::BTreeMap;

use safetensors::{Dtype, SafeTensors, tensor::TensorView};

use crate::{
    Error, Metadata, Tensor, Tensors,
    codec::{self, CODEC, CODEC_VERSION, INDEX, INT8_BLOCK, SCALE, SHAPE, VALUE, VERSION},
    tensors::{MAX_UPDATE_VALUE, all_within, decode, squared_norm},
};

/// A pseudo-gradient as SafeTensors bytes, read and checked: plain (every tensor F32, F64 or
/// BF16) or compressed by one of the [`codec`](crate::codec)s, every value finite and within
/// [`MAX_UPDATE_VALUE`] (one NaN, or one value near f32's largest, would make the whole global
/// model NaN once averaged in), a compressed tensor's parts
/// consistent (scales for every block, positions inside the tensor and increasing). Its values
/// are decoded only as they are added (or measured, for [`norm`](Self::norm)): the update is
/// never held decoded.
pub struct Update<'a> {
    parts: Vec<(String, Part<'a>)>,
}

/// One parameter of an update, as its codec stored it.
enum Part<'a> {
    /// `none` and `bf16`: the values.
    Dense(TensorView<'a>),
    /// `int8`: quantised values and a scale per block.
    Int8 {
        values: TensorView<'a>,
        scales: TensorView<'a>,
    },
    /// `topk`: the shape, and the kept values at their positions.
    Sparse {
        shape: Vec<usize>,
        indices: TensorView<'a>,
        values: TensorView<'a>,
    },
}

impl Part<'_> {
    fn shape(&self) -> &[usize] {
        match self {
            Part::Dense(view) | Part::Int8 { values: view, .. } => view.shape(),
            Part::Sparse { shape, .. } => shape,
        }
    }

    /// `op(target, value)` for each value, with the target of its position in `targets`
    /// (positions a sparse part does not hold are left alone: their value is 0).
    fn apply(&self, targets: &mut [f32], op: impl Fn(&mut f32, f32)) {
        match self {
            Part::Dense(view) => {
                decode(view.dtype(), view.data(), targets, op);
            }
            Part::Int8 { values, scales } => {
                let blocks = targets
                    .chunks_mut(INT8_BLOCK)
                    .zip(values.data().chunks(INT8_BLOCK))
                    .zip(scales.data().chunks_exact(4));
                for ((targets, quantised), scale) in blocks {
                    let scale = f32::from_le_bytes([scale[0], scale[1], scale[2], scale[3]]);
                    for (t, q) in targets.iter_mut().zip(quantised) {
                        op(t, f32::from(*q as i8) * scale);
                    }
                }
            }
            Part::Sparse {
                indices, values, ..
            } => {
                let pairs = indices
                    .data()
                    .chunks_exact(4)
                    .zip(values.data().chunks_exact(4));
                for (index, value) in pairs {
                    let index = u32::from_le_bytes([index[0], index[1], index[2], index[3]]);
                    let value = f32::from_le_bytes([value[0], value[1], value[2], value[3]]);
                    if let Some(t) = targets.get_mut(index as usize) {
                        op(t, value);
                    }
                }
            }
        }
    }

    fn squared_norm(&self) -> f64 {
        match self {
            Part::Dense(view) => squared_norm(view.dtype(), view.data()),
            Part::Sparse { values, .. } => squared_norm(values.dtype(), values.data()),
            Part::Int8 { values, scales } => values
                .data()
                .chunks(INT8_BLOCK)
                .zip(scales.data().chunks_exact(4))
                .map(|(quantised, scale)| {
                    let scale =
                        f64::from(f32::from_le_bytes([scale[0], scale[1], scale[2], scale[3]]));
                    let sum: f64 = quantised.iter().map(|q| f64::from(*q as i8).powi(2)).sum();
                    sum * scale * scale
                })
                .sum(),
        }
    }
}

impl<'a> Update<'a> {
    pub fn read(bytes: &'a [u8]) -> Result<Self, Error> {
        let file = SafeTensors::deserialize(bytes).map_err(|e| Error::Format(e.to_string()))?;
        let metadata = crate::metadata(bytes)?;
        let codec = metadata.get(CODEC).map_or("none", String::as_str);
        if metadata.contains_key(CODEC)
            && metadata.get(CODEC_VERSION).map(String::as_str) != Some(VERSION)
        {
            return Err(Error::Format(format!(
                "codec version {:?}; this node reads version {VERSION}",
                metadata.get(CODEC_VERSION)
            )));
        }
        let views: BTreeMap<String, TensorView<'a>> =
            file.iter().map(|(n, v)| (n.to_string(), v)).collect();
        let parts = match codec {
            "none" | "bf16" => dense_parts(views)?,
            "int8" => int8_parts(views)?,
            "topk" => sparse_parts(views, &metadata)?,
            other => {
                return Err(Error::Format(format!(
                    "codec {other:?}; this node reads none, bf16, int8 and topk"
                )));
            }
        };
        Ok(Update { parts })
    }

    /// The L2 norm over all its values: one more pass over them, so taken only when asked.
    pub fn norm(&self) -> f64 {
        self.parts
            .iter()
            .map(|(_, part)| part.squared_norm())
            .sum::<f64>()
            .sqrt()
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
        for (name, part) in &self.parts {
            if let Some(tensor) = model.0.get_mut(name) {
                part.apply(&mut tensor.values, |t, v| *t += v);
            }
        }
        Ok(())
    }

    /// The update decoded, each parameter f32. A `topk` part is as large as the shape its
    /// file claims: decode only bytes whose shapes were checked against the model (the
    /// [`Accumulator`] never decodes a copy).
    pub fn to_tensors(&self) -> Tensors {
        Tensors(
            self.parts
                .iter()
                .map(|(name, part)| {
                    let mut values = vec![0.0; part.shape().iter().product()];
                    part.apply(&mut values, |t, v| *t = v);
                    (name.clone(), codec::tensor(part.shape().to_vec(), values))
                })
                .collect(),
        )
    }
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

fn dense_parts(views: BTreeMap<String, TensorView<'_>>) -> Result<Vec<(String, Part<'_>)>, Error> {
    let mut parts = Vec::new();
    for (name, view) in views {
        if !matches!(view.dtype(), Dtype::F32 | Dtype::F64 | Dtype::BF16) {
            return Err(Error::Dtype {
                name,
                dtype: view.dtype().to_string(),
            });
        }
        if !all_within(view.dtype(), view.data(), MAX_UPDATE_VALUE) {
            return Err(not_finite(&name));
        }
        parts.push((name, Part::Dense(view)));
    }
    Ok(parts)
}

fn int8_parts(
    mut views: BTreeMap<String, TensorView<'_>>,
) -> Result<Vec<(String, Part<'_>)>, Error> {
    let names: Vec<String> = views
        .keys()
        .filter(|n| !n.ends_with(SCALE))
        .cloned()
        .collect();
    let mut parts = Vec::new();
    for name in names {
        let values = views
            .remove(&name)
            .ok_or_else(|| malformed(&name, "is missing"))?;
        let scales = views
            .remove(&format!("{name}{SCALE}"))
            .ok_or_else(|| malformed(&name, "has no scales"))?;
        if values.dtype() != Dtype::I8 || scales.dtype() != Dtype::F32 {
            return Err(malformed(&name, "int8 values and F32 scales expected"));
        }
        let blocks = values.data().len().div_ceil(INT8_BLOCK);
        if scales.shape() != [blocks] {
            return Err(malformed(
                &name,
                format!(
                    "{} scales for {blocks} blocks",
                    scales.shape().iter().product::<usize>()
                ),
            ));
        }
        // |q| ≤ 127: a scale within the limit / 127 keeps every value within it.
        if !all_within(Dtype::F32, scales.data(), MAX_UPDATE_VALUE / 127.0) {
            return Err(not_finite(&name));
        }
        parts.push((name, Part::Int8 { values, scales }));
    }
    if let Some(stray) = views.keys().next() {
        return Err(malformed(stray, "scales of no parameter"));
    }
    Ok(parts)
}

fn sparse_parts<'a>(
    mut views: BTreeMap<String, TensorView<'a>>,
    metadata: &Metadata,
) -> Result<Vec<(String, Part<'a>)>, Error> {
    let names: Vec<String> = views
        .keys()
        .filter_map(|n| n.strip_suffix(INDEX).map(str::to_string))
        .collect();
    let mut parts = Vec::new();
    for name in names {
        let indices = views
            .remove(&format!("{name}{INDEX}"))
            .ok_or_else(|| malformed(&name, "has no positions"))?;
        let values = views
            .remove(&format!("{name}{VALUE}"))
            .ok_or_else(|| malformed(&name, "has no values"))?;
        let shape_text = metadata
            .get(&format!("{SHAPE}{name}"))
            .ok_or_else(|| malformed(&name, "has no shape in the metadata"))?;
        let shape = codec::parse_shape(&name, shape_text)?;
        let len = shape
            .iter()
            .try_fold(1usize, |n, d| n.checked_mul(*d))
            .ok_or_else(|| malformed(&name, "a shape too large"))?;
        if indices.dtype() != Dtype::U32 || values.dtype() != Dtype::F32 {
            return Err(malformed(&name, "U32 positions and F32 values expected"));
        }
        let k = indices.shape().iter().product::<usize>();
        if indices.shape().len() != 1 || values.shape() != indices.shape() || k > len {
            return Err(malformed(
                &name,
                "positions and values of different or impossible counts",
            ));
        }
        let mut previous: Option<u32> = None;
        for index in indices.data().chunks_exact(4) {
            let index = u32::from_le_bytes([index[0], index[1], index[2], index[3]]);
            if index as usize >= len || previous.is_some_and(|p| index <= p) {
                return Err(malformed(
                    &name,
                    "positions outside the tensor or not increasing",
                ));
            }
            previous = Some(index);
        }
        if !all_within(Dtype::F32, values.data(), MAX_UPDATE_VALUE) {
            return Err(not_finite(&name));
        }
        parts.push((
            name,
            Part::Sparse {
                shape,
                indices,
                values,
            },
        ));
    }
    if let Some(stray) = views.keys().next() {
        return Err(malformed(stray, "values of no parameter"));
    }
    Ok(parts)
}

impl std::fmt::Debug for Update<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Update")
            .field("tensors", &self.parts.len())
            .finish()
    }
}

/// The running sum Σ nᵢΔᵢ and Σ nᵢ of one round's updates. Holds one sum per parameter,
/// whatever the number of updates; each update can be dropped once added.
#[derive(Debug, Default)]
pub struct Accumulator {
    sums: BTreeMap<String, Tensor>,
    weight: f64,
    updates: usize,
}

impl Accumulator {
    pub fn new() -> Self {
        Self::default()
    }

    /// An accumulator that takes only updates with exactly `model`'s tensors and shapes.
    pub fn shaped_like(model: &Tensors) -> Self {
        let mut accumulator = Self::new();
        accumulator.create(model.shapes());
        accumulator
    }

    /// Adds one worker's pseudo-gradient, weighted by the samples it trained on. The first
    /// update fixes the tensors' names and shapes; every later one must have the same, or it
    /// is refused and the sum is left as it was.
    pub fn add(&mut self, update: &Tensors, weight: f64) -> Result<(), Error> {
        let shapes = update
            .0
            .iter()
            .map(|(n, t)| (n.as_str(), &t.shape[..], t.dtype));
        self.prepare(shapes, weight)?;
        let w = weight as f32;
        for (name, tensor) in &update.0 {
            if let Some(sum) = self.sums.get_mut(name) {
                for (s, v) in sum.values.iter_mut().zip(&tensor.values) {
                    *s += w * v;
                }
            }
        }
        self.added(weight);
        Ok(())
    }

    /// [`add`](Self::add) straight from a SafeTensors file's bytes, converting each value as
    /// it is added: the update is never held decoded, so the server's memory is the sum plus
    /// the bytes of the update being read.
    pub fn add_safetensors(&mut self, bytes: &[u8], weight: f64) -> Result<(), Error> {
        self.add_update(&Update::read(bytes)?, weight)
    }

    /// [`add`](Self::add) of an update already [read](Update::read) and checked.
    pub fn add_update(&mut self, update: &Update<'_>, weight: f64) -> Result<(), Error> {
        // A top-k file states its shapes in a line of metadata: only a model's shapes may
        // say how large the sum is.
        if self.sums.is_empty()
            && let Some((name, _)) = update
                .parts
                .iter()
                .find(|(_, part)| matches!(part, Part::Sparse { .. }))
        {
            return Err(Error::Mismatch {
                name: name.clone(),
                problem: "a top-k update is added only to a sum shaped like the model (Accumulator::shaped_like)".into(),
            });
        }
        let shapes = update
            .parts
            .iter()
            .map(|(n, part)| (n.as_str(), part.shape(), Dtype::F32));
        self.prepare(shapes, weight)?;
        let w = weight as f32;
        for (name, part) in &update.parts {
            if let Some(sum) = self.sums.get_mut(name) {
                part.apply(&mut sum.values, |s, v| *s += w * v);
            }
        }
        self.added(weight);
        Ok(())
    }

    /// Checks an update's weight, names and shapes; the first update creates the sums.
    fn prepare<'a>(
        &mut self,
        shapes: impl Iterator<Item = (&'a str, &'a [usize], Dtype)>,
        weight: f64,
    ) -> Result<(), Error> {
        if !weight.is_finite() || weight <= 0.0 {
            return Err(Error::Weight(weight));
        }
        if self.sums.is_empty() {
            self.create(shapes);
            return Ok(());
        }
        check_same(&self.sums, shapes)
    }

    fn create<'a>(&mut self, shapes: impl Iterator<Item = (&'a str, &'a [usize], Dtype)>) {
        self.sums = shapes
            .map(|(name, shape, dtype)| {
                let len = shape.iter().product();
                let tensor = Tensor {
                    shape: shape.to_vec(),
                    values: vec![0.0; len],
                    dtype,
                };
                (name.to_string(), tensor)
            })
            .collect();
    }

    fn added(&mut self, weight: f64) {
        self.weight += weight;
        self.updates += 1;
    }

    /// How many updates were added.
    pub fn updates(&self) -> usize {
        self.updates
    }

    /// The total weight (samples) added.
    pub fn weight(&self) -> f64 {
        self.weight
    }

    /// Σ nᵢΔᵢ / Σ nᵢ, computed in place: the accumulator is left empty and unshaped (the next
    /// update shapes it again).
    pub fn mean(&mut self) -> Result<Tensors, Error> {
        if self.updates == 0 {
            return Err(Error::Empty);
        }
        let scale = (1.0 / self.weight) as f32;
        let mut mean = std::mem::take(&mut self.sums);
        for tensor in mean.values_mut() {
            for value in &mut tensor.values {
                *value *= scale;
            }
        }
        self.weight = 0.0;
        self.updates = 0;
        Ok(Tensors(mean))
    }
}

/// Refuses an update unless it has exactly the tensors and shapes of `known`.
pub(crate) fn check_same<'a>(
    known: &BTreeMap<String, Tensor>,
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
            Some(expected) if expected.shape != shape => {
                return Err(Error::Mismatch {
                    name: name.to_string(),
                    problem: format!("has shape {shape:?}; the model's is {:?}", expected.shape),
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
