//! The outer step: SGD with Nesterov momentum, as `torch.optim.SGD(nesterov=True)` computes it.

use std::collections::{BTreeMap, btree_map::Entry};

use crate::{Error, Tensors, accumulate::check_same};

/// Outer SGD with Nesterov momentum; keeps a momentum buffer per parameter.
#[derive(Debug, Clone)]
pub struct OuterOptimizer {
    pub learning_rate: f32,
    pub momentum: f32,
    buffers: BTreeMap<String, Vec<f32>>,
}

impl OuterOptimizer {
    pub fn new(learning_rate: f32, momentum: f32) -> Self {
        Self {
            learning_rate,
            momentum,
            buffers: BTreeMap::new(),
        }
    }

    /// The momentum buffers (for checkpoints), empty before the first step.
    pub fn buffers(&self) -> &BTreeMap<String, Vec<f32>> {
        &self.buffers
    }

    /// Restores buffers saved from [`buffers`](Self::buffers).
    pub fn with_buffers(mut self, buffers: BTreeMap<String, Vec<f32>>) -> Self {
        self.buffers = buffers;
        self
    }

    /// θ ← θ − η·(g + μ·b), with b = g on the first step and b = μ·b + g after.
    pub fn step(&mut self, model: &mut Tensors, gradient: &Tensors) -> Result<(), Error> {
        check_same(&model.0, gradient.shapes())?;
        let (lr, mu) = (self.learning_rate, self.momentum);
        for (name, parameter) in &mut model.0 {
            let Some(grad) = gradient.0.get(name) else {
                continue;
            };
            let buffer = match self.buffers.entry(name.clone()) {
                Entry::Occupied(entry) => {
                    let buffer = entry.into_mut();
                    for (b, g) in buffer.iter_mut().zip(&grad.values) {
                        *b = mu * *b + g;
                    }
                    buffer
                }
                Entry::Vacant(entry) => entry.insert(grad.values.clone()),
            };
            for ((p, g), b) in parameter
                .values
                .iter_mut()
                .zip(&grad.values)
                .zip(buffer.iter())
            {
                *p -= lr * (g + mu * b);
            }
        }
        Ok(())
    }
}
