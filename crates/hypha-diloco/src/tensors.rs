//! Named f32 tensors and their SafeTensors form.

use std::{collections::BTreeMap, path::Path};

use safetensors::{Dtype, SafeTensors, tensor::TensorView};

use crate::Error;

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

impl Tensors {
    /// Reads a SafeTensors file's bytes.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, Error> {
        let file = SafeTensors::deserialize(bytes).map_err(|e| Error::Format(e.to_string()))?;
        let mut tensors = BTreeMap::new();
        for (name, view) in file.tensors() {
            let values = to_f32(&name, &view)?;
            tensors.insert(
                name,
                Tensor {
                    shape: view.shape().to_vec(),
                    values,
                    dtype: view.dtype(),
                },
            );
        }
        Ok(Self(tensors))
    }

    pub fn load(path: &Path) -> Result<Self, Error> {
        Self::from_bytes(&hypha_files::read(path)?)
    }

    /// The SafeTensors form, each tensor in its own dtype.
    pub fn to_bytes(&self) -> Result<Vec<u8>, Error> {
        let encoded: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = self
            .0
            .iter()
            .map(|(name, t)| (name.clone(), t.dtype, t.shape.clone(), from_f32(t)))
            .collect();
        let views = encoded
            .iter()
            .map(|(name, dtype, shape, data)| {
                TensorView::new(*dtype, shape.clone(), data)
                    .map(|view| (name.clone(), view))
                    .map_err(|e| Error::Format(e.to_string()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        safetensors::serialize(views, None).map_err(|e| Error::Format(e.to_string()))
    }

    /// Writes the file atomically (temporary file, fsync, rename).
    pub fn save(&self, path: &Path) -> Result<(), Error> {
        hypha_files::write_atomic(path, &self.to_bytes()?, hypha_files::Mode::Private, true)?;
        Ok(())
    }
}

fn to_f32(name: &str, view: &TensorView<'_>) -> Result<Vec<f32>, Error> {
    let data = view.data();
    Ok(match view.dtype() {
        Dtype::F32 => data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::F64 => data
            .chunks_exact(8)
            .map(|b| f64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]) as f32)
            .collect(),
        // bfloat16 is the upper half of an f32.
        Dtype::BF16 => data
            .chunks_exact(2)
            .map(|b| f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16))
            .collect(),
        other => {
            return Err(Error::Dtype {
                name: name.to_string(),
                dtype: other.to_string(),
            });
        }
    })
}

fn from_f32(tensor: &Tensor) -> Vec<u8> {
    match tensor.dtype {
        Dtype::F64 => tensor
            .values
            .iter()
            .flat_map(|v| f64::from(*v).to_le_bytes())
            .collect(),
        Dtype::BF16 => tensor
            .values
            .iter()
            .flat_map(|v| bf16_bits(*v).to_le_bytes())
            .collect(),
        _ => tensor.values.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

/// f32 → bfloat16 with round-to-nearest-even, as PyTorch converts; NaN stays NaN.
fn bf16_bits(value: f32) -> u16 {
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

    #[test]
    fn bfloat16_rounds_to_nearest_even() {
        assert_eq!(bf16_bits(1.0), 0x3F80);
        // 1 + 2⁻⁸ lies halfway between two bfloat16 values: it goes to the even one.
        assert_eq!(bf16_bits(1.0 + 1.0 / 256.0), 0x3F80);
        assert_eq!(bf16_bits(1.0 + 3.0 / 256.0), 0x3F82);
        assert!(f32::from_bits(u32::from(bf16_bits(f32::NAN)) << 16).is_nan());
    }
}
