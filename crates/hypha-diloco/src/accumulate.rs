//! The weighted mean of pseudo-gradients, accumulated as they arrive.

use std::collections::BTreeMap;

use safetensors::{Dtype, SafeTensors, tensor::TensorView};

use crate::{
    Error, Tensor, Tensors,
    tensors::{all_finite, decode, squared_norm},
};

/// A pseudo-gradient as SafeTensors bytes, read and checked: every tensor F32, F64 or BF16,
/// every value finite (one NaN would make the whole global model NaN once averaged in). Its
/// values are decoded again only as they are added (or measured, for [`norm`](Self::norm)).
pub struct Update<'a> {
    views: Vec<(String, TensorView<'a>)>,
}

impl<'a> Update<'a> {
    pub fn read(bytes: &'a [u8]) -> Result<Self, Error> {
        let file = SafeTensors::deserialize(bytes).map_err(|e| Error::Format(e.to_string()))?;
        let mut views = Vec::new();
        for (name, view) in file.iter() {
            if !matches!(view.dtype(), Dtype::F32 | Dtype::F64 | Dtype::BF16) {
                return Err(Error::Dtype {
                    name: name.to_string(),
                    dtype: view.dtype().to_string(),
                });
            }
            if !all_finite(view.dtype(), view.data()) {
                return Err(Error::NotFinite {
                    name: name.to_string(),
                });
            }
            views.push((name.to_string(), view));
        }
        Ok(Update { views })
    }

    /// The L2 norm over all its values: one more pass over them, so taken only when asked.
    pub fn norm(&self) -> f64 {
        self.views
            .iter()
            .map(|(_, view)| squared_norm(view.dtype(), view.data()))
            .sum::<f64>()
            .sqrt()
    }
}

impl std::fmt::Debug for Update<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Update")
            .field("tensors", &self.views.len())
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
        let shapes = update
            .views
            .iter()
            .map(|(n, v)| (n.as_str(), v.shape(), v.dtype()));
        self.prepare(shapes, weight)?;
        let w = weight as f32;
        for (name, view) in &update.views {
            if let Some(sum) = self.sums.get_mut(name) {
                decode(view.dtype(), view.data(), &mut sum.values, |s, v| {
                    *s += w * v
                });
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
