//! The weighted mean of pseudo-gradients, accumulated as they arrive.

use std::collections::BTreeMap;

use crate::{Error, Tensor, Tensors};

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

    /// Adds one worker's pseudo-gradient, weighted by the samples it trained on. The first
    /// update fixes the tensors' names and shapes; every later one must have the same, or it
    /// is refused and the sum is left as it was.
    pub fn add(&mut self, update: &Tensors, weight: f64) -> Result<(), Error> {
        if !weight.is_finite() || weight <= 0.0 {
            return Err(Error::Weight(weight));
        }
        if self.updates == 0 {
            self.sums = update
                .0
                .iter()
                .map(|(name, t)| {
                    let values = vec![0.0; t.values.len()];
                    (
                        name.clone(),
                        Tensor {
                            values,
                            ..t.clone()
                        },
                    )
                })
                .collect();
        } else {
            check_same(&self.sums, update)?;
        }
        let w = weight as f32;
        for (name, tensor) in &update.0 {
            if let Some(sum) = self.sums.get_mut(name) {
                for (s, v) in sum.values.iter_mut().zip(&tensor.values) {
                    *s += w * v;
                }
            }
        }
        self.weight += weight;
        self.updates += 1;
        Ok(())
    }

    /// How many updates were added.
    pub fn updates(&self) -> usize {
        self.updates
    }

    /// The total weight (samples) added.
    pub fn weight(&self) -> f64 {
        self.weight
    }

    /// Σ nᵢΔᵢ / Σ nᵢ.
    pub fn mean(mut self) -> Result<Tensors, Error> {
        if self.updates == 0 {
            return Err(Error::Empty);
        }
        let scale = (1.0 / self.weight) as f32;
        for sum in self.sums.values_mut() {
            for s in &mut sum.values {
                *s *= scale;
            }
        }
        Ok(Tensors(self.sums))
    }
}

/// Refuses `update` unless it has exactly the tensors and shapes of `known`.
pub(crate) fn check_same(known: &BTreeMap<String, Tensor>, update: &Tensors) -> Result<(), Error> {
    for (name, tensor) in &update.0 {
        match known.get(name) {
            None => {
                return Err(Error::Mismatch {
                    name: name.clone(),
                    problem: "is not a parameter of the model".into(),
                });
            }
            Some(expected) if expected.shape != tensor.shape => {
                return Err(Error::Mismatch {
                    name: name.clone(),
                    problem: format!(
                        "has shape {:?}; the model's is {:?}",
                        tensor.shape, expected.shape
                    ),
                });
            }
            Some(_) => {}
        }
    }
    if let Some(missing) = known.keys().find(|name| !update.0.contains_key(*name)) {
        return Err(Error::Mismatch {
            name: missing.clone(),
            problem: "is missing from the update".into(),
        });
    }
    Ok(())
}
