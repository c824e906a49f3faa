//! The outer step: SGD with Nesterov momentum, as `torch.optim.SGD(nesterov=True)` computes it.

use std::collections::BTreeMap;

use crate::{Error, Tensors, accumulate::check_same};

/// Outer SGD with Nesterov momentum; keeps a momentum buffer per parameter.
#[derive(Debug, Clone)]
pub struct OuterOptimizer {
    pub learning_rate: f32,
    pub momentum: f32,
    buffers: BTreeMap<String, Vec<f32>>,
}

/// The step a job's config sets, in the f32 of the models it steps.
impl From<hypha_messages::diloco::OuterOptimizer> for OuterOptimizer {
    fn from(settings: hypha_messages::diloco::OuterOptimizer) -> Self {
        Self::new(settings.learning_rate as f32, settings.momentum as f32)
    }
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
            let mut step = grad.values.clone();
            step_values(lr, mu, self.buffer_mut(name, step.len()), &mut step, 1.0);
            for (p, s) in parameter.values.iter_mut().zip(&step) {
                *p += s;
            }
        }
        Ok(())
    }

    /// The momentum buffer of parameter `name` of `len` values; zeros before its first step
    /// (b = μ·0 + g is g exactly, the first step's b).
    pub(crate) fn buffer_mut(&mut self, name: &str, len: usize) -> &mut [f32] {
        let buffer = self.buffers.entry(name.to_string()).or_default();
        if buffer.len() != len {
            *buffer = vec![0.0; len];
        }
        buffer
    }
}

/// The step of some values of one parameter, in place: `gradient` (times `scale`: a sum
/// becomes its mean on the way) becomes the change −η·(g + μ·b) they take, and `momentum`
/// (b, the same values' buffer) moves on to μ·b + g. One pass over the two.
pub(crate) fn step_values(
    lr: f32,
    mu: f32,
    momentum: &mut [f32],
    gradient: &mut [f32],
    scale: f32,
) {
    for (g, b) in gradient.iter_mut().zip(momentum.iter_mut()) {
        let grad = *g * scale;
        *b = mu * *b + grad;
        *g = -lr * (grad + mu * *b);
    }
}
