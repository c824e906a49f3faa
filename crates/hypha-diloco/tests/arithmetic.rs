//! The parameter server's arithmetic against values worked out by hand from its definition:
//! the sample-weighted mean of pseudo-gradients, and `torch.optim.SGD(nesterov=True)`'s update
//! (PyTorch's documented algorithm: b₁ = g, bₜ = μbₜ₋₁ + g, θ ← θ − η(g + μbₜ)). Inputs are
//! chosen so that every intermediate value is exact or within one f32 rounding.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::collections::BTreeMap;

use hypha_diloco::{Accumulator, Error, OuterOptimizer, Tensor, Tensors};
use safetensors::Dtype;

fn tensors(values: &[f32]) -> Tensors {
    Tensors(BTreeMap::from([(
        "w".to_string(),
        Tensor {
            shape: vec![values.len()],
            values: values.to_vec(),
            dtype: Dtype::F32,
        },
    )]))
}

fn values(t: &Tensors) -> Vec<f32> {
    t.0["w"].values.clone()
}

fn assert_close(got: &[f32], want: &[f64]) {
    assert_eq!(got.len(), want.len());
    for (g, w) in got.iter().zip(want) {
        assert!(
            (f64::from(*g) - w).abs() <= 1e-6 * w.abs().max(1.0),
            "got {got:?}, want {want:?}"
        );
    }
}

fn mean(updates: &[(&[f32], f64)]) -> Vec<f32> {
    let mut acc = Accumulator::new();
    for (update, weight) in updates {
        acc.add(&tensors(update), *weight).unwrap();
    }
    values(&acc.mean().unwrap())
}

#[test]
fn weighted_means_of_one_two_three_and_five_workers() {
    // One worker: its own update, whatever its weight.
    assert_close(&mean(&[(&[1.5, -2.0], 7.0)]), &[1.5, -2.0]);
    // Two: (1·[1, 2] + 3·[3, 6]) / 4 = [2.5, 5].
    assert_close(
        &mean(&[(&[1.0, 2.0], 1.0), (&[3.0, 6.0], 3.0)]),
        &[2.5, 5.0],
    );
    // Three, equal weights: (1 + 2 + 4) / 3 = 7/3. The reference system's pairwise average,
    // ((1 + 2) / 2 + 4) / 2 = 2.75, is wrong here.
    assert_close(
        &mean(&[(&[1.0], 10.0), (&[2.0], 10.0), (&[4.0], 10.0)]),
        &[7.0 / 3.0],
    );
    // Five, weights 5..1: (5·1 + 4·2 + 3·3 + 2·4 + 1·5) / 15 = 35/15, and
    // (5·−1 + 4·0 + 3·1 + 2·0 + 1·10) / 15 = 8/15.
    assert_close(
        &mean(&[
            (&[1.0, -1.0], 5.0),
            (&[2.0, 0.0], 4.0),
            (&[3.0, 1.0], 3.0),
            (&[4.0, 0.0], 2.0),
            (&[5.0, 10.0], 1.0),
        ]),
        &[35.0 / 15.0, 8.0 / 15.0],
    );
}

#[test]
fn two_rounds_of_nesterov_momentum() {
    // η = 0.5, μ = 0.9, θ₀ = [1, −2].
    // Round 1: g = [0.2, −0.4]; b = g; θ₁ = θ₀ − 0.5·(g + 0.9·b) = [0.81, −1.62].
    // Round 2: g = [0.1, 0.3]; b = 0.9·[0.2, −0.4] + g = [0.28, −0.06];
    //          θ₂ = θ₁ − 0.5·([0.1, 0.3] + 0.9·[0.28, −0.06]) = [0.634, −1.743].
    let mut optimizer = OuterOptimizer::new(0.5, 0.9);
    let mut model = tensors(&[1.0, -2.0]);
    optimizer.step(&mut model, &tensors(&[0.2, -0.4])).unwrap();
    assert_close(&values(&model), &[0.81, -1.62]);
    optimizer.step(&mut model, &tensors(&[0.1, 0.3])).unwrap();
    assert_close(&values(&model), &[0.634, -1.743]);
    assert_close(&optimizer.buffers()["w"], &[0.28, -0.06]);
}

#[test]
fn mismatched_updates_are_refused_and_change_nothing() {
    let mut acc = Accumulator::new();
    acc.add(&tensors(&[1.0, 2.0]), 1.0).unwrap();
    let err = acc.add(&tensors(&[1.0, 2.0, 3.0]), 1.0).unwrap_err();
    assert!(matches!(err, Error::Mismatch { .. }), "{err}");
    assert!(acc.add(&tensors(&[1.0, 2.0]), 0.0).is_err());
    assert!(acc.add(&tensors(&[1.0, 2.0]), f64::NAN).is_err());
    assert_eq!(acc.updates(), 1);
    assert_close(&values(&acc.mean().unwrap()), &[1.0, 2.0]);
    assert!(matches!(Accumulator::new().mean(), Err(Error::Empty)));
}

#[test]
fn tensors_round_trip_through_safetensors_in_their_dtype() {
    let mut model = tensors(&[1.0, -0.5, 3.25]);
    model.0.insert(
        "b".into(),
        Tensor {
            shape: vec![2],
            values: vec![1.0, 2.0],
            dtype: Dtype::BF16,
        },
    );
    let metadata = BTreeMap::from([("hypha.round".to_string(), "3".to_string())]);
    let bytes = model.to_bytes(&metadata).unwrap();
    let back = Tensors::from_bytes(&bytes).unwrap();
    assert_eq!(back, model);
    assert_eq!(hypha_diloco::metadata(&bytes).unwrap(), metadata);
    let view = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(view.tensor("b").unwrap().dtype(), Dtype::BF16);
    assert!(Tensors::from_bytes(b"not safetensors").is_err());
}

#[test]
fn updates_added_from_their_bytes_sum_like_decoded_ones() {
    let updates: [(&[f32], f64); 3] = [(&[1.0, 2.0], 1.0), (&[3.0, 6.0], 3.0), (&[-1.0, 0.5], 4.0)];
    let mut from_bytes = Accumulator::new();
    for (update, weight) in updates {
        let bytes = tensors(update).to_bytes(&BTreeMap::new()).unwrap();
        from_bytes.add_safetensors(&bytes, weight).unwrap();
    }
    assert_eq!(values(&from_bytes.mean().unwrap()), mean(&updates));
    // A BF16 update adds as its f32 value; a misshapen one is refused and changes nothing.
    let mut acc = Accumulator::new();
    let mut half = tensors(&[1.5, -2.0]);
    half.0.get_mut("w").unwrap().dtype = Dtype::BF16;
    acc.add_safetensors(&half.to_bytes(&BTreeMap::new()).unwrap(), 2.0)
        .unwrap();
    let wrong = tensors(&[1.0, 2.0, 3.0])
        .to_bytes(&BTreeMap::new())
        .unwrap();
    assert!(matches!(
        acc.add_safetensors(&wrong, 1.0),
        Err(Error::Mismatch { .. })
    ));
    assert_eq!(acc.updates(), 1);
    assert_close(&values(&acc.mean().unwrap()), &[1.5, -2.0]);
}
