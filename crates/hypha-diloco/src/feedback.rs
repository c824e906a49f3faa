//! Error feedback: what a codec dropped of a trainer's update, carried into its next one.

use std::collections::BTreeMap;

use crate::{
    Codec, Error, Metadata, Tensors,
    accumulate::{RoundTrip, round_trip},
    codec::writer_for,
};

/// The residuals of error feedback: what the codec dropped, per parameter, carried into the
/// next update.
#[derive(Debug, Clone)]
pub struct ErrorFeedback {
    residual: BTreeMap<String, Vec<f32>>,
    /// What the residual is multiplied by before it is carried into the next update.
    decay: f32,
}

impl Default for ErrorFeedback {
    fn default() -> Self {
        Self {
            residual: BTreeMap::new(),
            decay: 1.0,
        }
    }
}

impl ErrorFeedback {
    pub fn new() -> Self {
        Self::default()
    }

    /// The error feedback of a trainer that compresses with `codec`: it carries `sparse`'s
    /// decay of its residual into each next update (e ← β·e + Δ, C(e) sent, e ← e − C(e)),
    /// every other codec's whole. Below 1 the residual is a momentum of the updates that
    /// forgets what it could not send (SparseLoCo's outer momentum).
    pub fn for_codec(codec: Codec) -> Self {
        Self {
            decay: match codec {
                Codec::Sparse { decay, .. } => decay,
                _ => 1.0,
            },
            ..Self::default()
        }
    }

    /// `update` with the carried residual added, compressed with `codec` (see [`encode`](crate::codec::encode));
    /// what the codec dropped this time is carried on. With [`Codec::None`] nothing is
    /// dropped and nothing is kept. On an error the residual is as it was.
    pub fn compress(
        &mut self,
        update: &Tensors,
        codec: Codec,
        metadata: &Metadata,
    ) -> Result<Vec<u8>, Error> {
        let mut writer = writer_for(update, codec, metadata)?;
        let mut residual = BTreeMap::new();
        let mut buffers = RoundTrip::default();
        for (name, tensor) in &update.0 {
            let mut carried = tensor.values.clone();
            self.carry(name, &mut carried);
            let (encoded, sent) = round_trip(codec, name, &tensor.shape, &carried, &mut buffers)?;
            writer.write(encoded)?;
            if codec != Codec::None {
                Self::dropped(&mut carried, sent);
                residual.insert(name.clone(), carried);
            }
        }
        let bytes = writer.finish()?.into_inner();
        self.residual = residual;
        Ok(bytes)
    }

    /// Adds what was carried for `name` to its `values`.
    pub(crate) fn carry(&self, name: &str, values: &mut [f32]) {
        if let Some(residual) = self.residual.get(name)
            && residual.len() == values.len()
        {
            let decay = self.decay;
            for (value, r) in values.iter_mut().zip(residual) {
                *value += decay * r;
            }
        }
    }

    /// `carried` − `sent`, in place: what the codec dropped of one parameter.
    pub(crate) fn dropped(carried: &mut [f32], sent: &[f32]) {
        for (c, s) in carried.iter_mut().zip(sent) {
            *c -= s;
        }
    }

    /// What is carried for parameter `name` of `len` values, to be changed in place; zeros
    /// where nothing was.
    pub(crate) fn residual_mut(&mut self, name: &str, len: usize) -> &mut [f32] {
        let residual = self.residual.entry(name.to_string()).or_default();
        if residual.len() != len {
            *residual = vec![0.0; len];
        }
        residual
    }

    /// Carries nothing for `name`.
    pub(crate) fn forget(&mut self, name: &str) {
        self.residual.remove(name);
    }

    /// Error feedback that goes on with `residual` (as [`residual`](Self::residual) gave
    /// it, e.g. from a checkpoint).
    pub fn with_residual(residual: BTreeMap<String, Vec<f32>>) -> Self {
        Self {
            residual,
            ..Self::default()
        }
    }

    /// Forgets the residuals: the model they were measured against is gone (a new parameter
    /// server, an abandoned round).
    pub fn reset(&mut self) {
        self.residual.clear();
    }

    /// The carried residual of each parameter.
    pub fn residual(&self) -> &BTreeMap<String, Vec<f32>> {
        &self.residual
    }
}
