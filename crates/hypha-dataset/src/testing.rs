//! Datasets and damage for tests in any crate (feature `testing`).

use std::path::Path;

use crate::slice::{self, Dtype, Encoding};

/// A dataset as the seed recipe writes it: `slice-0000.safetensors`, … each the raw Snappy of
/// SafeTensors holding `images` f32 `[per_slice, 1, 8, 8]` and `labels` i64 `[per_slice]`,
/// no manifest. The images are one of ten fixed 8×8 patterns (drawn from `seed`) with noise,
/// the label the pattern's number: a class structure a model can learn.
pub fn seed_recipe_dataset(dir: &Path, slices: usize, per_slice: usize, seed: u64) {
    let mut state = seed ^ 0x9E37_79B9_7F4A_7C15;
    let mut next = move || {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (state >> 11) as f64 / (1u64 << 53) as f64
    };
    let patterns: Vec<Vec<f32>> = (0..10)
        .map(|_| (0..64).map(|_| (next() * 4.0 - 2.0) as f32).collect())
        .collect();
    std::fs::create_dir_all(dir).expect("the test's dataset directory");
    for index in 0..slices {
        let (mut images, mut labels) = (Vec::new(), Vec::new());
        for _ in 0..per_slice {
            let label = (next() * 10.0) as usize % 10;
            labels.extend((label as i64).to_le_bytes());
            for value in &patterns[label] {
                images.extend((value + (next() * 2.0 - 1.0) as f32).to_le_bytes());
            }
        }
        let tensors = slice::Tensors::new()
            .with("images", Dtype::F32, vec![per_slice, 1, 8, 8], images)
            .and_then(|t| t.with("labels", Dtype::I64, vec![per_slice], labels))
            .expect("tensors of the sizes given");
        let bytes = slice::encode(&tensors, Encoding::Snappy).expect("encodable tensors");
        std::fs::write(dir.join(format!("slice-{index:04}.safetensors")), bytes)
            .expect("the test's slice file");
    }
}

/// Flips one bit in the middle of `path` and gives the file its old modification time back,
/// as silent corruption on a disk does.
pub fn flip_a_bit_silently(path: &Path) {
    let modified = std::fs::metadata(path)
        .and_then(|m| m.modified())
        .expect("the file to damage");
    let mut bytes = std::fs::read(path).expect("the file to damage");
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x01;
    std::fs::write(path, &bytes).expect("the damaged file");
    std::fs::File::options()
        .write(true)
        .open(path)
        .and_then(|f| f.set_modified(modified))
        .expect("the damaged file's old time");
}
