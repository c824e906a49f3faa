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
        for (name, parameter) in &mut model.0 {
            let Some(grad) = gradient.0.get(name) else {
                continue;
            };
            let mut step = grad.values.clone();
            self.step_in_place(name, &mut step, 1.0);
            for (p, s) in parameter.values.iter_mut().zip(&step) {
                *p += s;
            }
        }
        Ok(())
    }

    /// One parameter's step, in place: `gradient` (times `scale`: a sum becomes its mean on
    /// the way) becomes the change −η·(g + μ·b) the parameter takes, and its momentum buffer
    /// moves on. One pass over the two, whatever the model's size.
    pub(crate) fn step_in_place(&mut self, name: &str, gradient: &mut [f32], scale: f32) {
        let (lr, mu) = (self.learning_rate, self.momentum);
        match self.buffers.entry(name.to_string()) {
            Entry::Occupied(entry) => {
                for (g, b) in gradient.iter_mut().zip(entry.into_mut().iter_mut()) {
                    let grad = *g * scale;
                    *b = mu * *b + grad;
                    *g = -lr * (grad + mu * *b);
                }
            }
            Entry::Vacant(entry) => {
                let buffer = entry.insert(Vec::with_capacity(gradient.len()));
                for g in gradient.iter_mut() {
                    let grad = *g * scale;
                    buffer.push(grad);
                    *g = -lr * (grad + mu * grad);
                }
            }
        }
    }
}
