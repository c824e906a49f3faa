//! Every model family learns its synthetic dataset with AdamW, and a model survives the
//! trip through SafeTensors unchanged.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use hypha_executor::{
    model::{Model, ModelSpec},
    synthetic::Synthetic,
};

/// Trains `spec` for `steps` batches of 32 fresh samples; evaluation loss before and after
/// on 512 held-out samples, and accuracy after.
fn train(spec: &ModelSpec, steps: u64) -> (f64, f64, f64) {
    let model = Model::new(spec, 7).unwrap();
    let data = Synthetic::for_model(spec);
    let held_out = data.batch(512, 1 << 40).unwrap();
    let (before, _) = model.evaluate(&held_out).unwrap();
    let params = ParamsAdamW {
        lr: 3e-3,
        ..ParamsAdamW::default()
    };
    let mut optimizer = AdamW::new(model.parameters(), params).unwrap();
    for step in 0..steps {
        let batch = data.batch(32, step).unwrap();
        optimizer
            .backward_step(&model.loss(&batch).unwrap())
            .unwrap();
    }
    let (after, accuracy) = model.evaluate(&held_out).unwrap();
    (before, after, accuracy)
}

#[test]
fn the_mlp_learns_blobs() {
    let spec = ModelSpec::Mlp {
        inputs: 16,
        hidden: 32,
        classes: 4,
    };
    let (before, after, accuracy) = train(&spec, 150);
    assert!(after < 0.5 * before, "loss {before} → {after}");
    assert!(accuracy > 0.85, "accuracy {accuracy}");
}

#[test]
fn the_cnn_learns_patterns() {
    let spec = ModelSpec::Cnn {
        channels: 2,
        classes: 4,
        width: 16,
    };
    let (before, after, accuracy) = train(&spec, 250);
    assert!(after < 0.5 * before, "loss {before} → {after}");
    assert!(accuracy > 0.85, "accuracy {accuracy}");
}

#[test]
fn the_transformer_learns_counting_sequences() {
    let spec = ModelSpec::Transformer {
        vocab: 16,
        context: 12,
        dim: 32,
        heads: 4,
        layers: 1,
    };
    let (before, after, _) = train(&spec, 400);
    // Uniform guessing costs ln 16 ≈ 2.77; knowing the step makes most tokens certain.
    assert!(after < 0.5 * before, "loss {before} → {after}");
}

#[test]
fn a_model_round_trips_through_safetensors_and_seeds_fix_it() {
    let spec = ModelSpec::Mlp {
        inputs: 4,
        hidden: 8,
        classes: 3,
    };
    let a = Model::new(&spec, 1).unwrap();
    let b = Model::new(&spec, 2).unwrap();
    assert_eq!(
        a.tensors().unwrap(),
        Model::new(&spec, 1).unwrap().tensors().unwrap()
    );
    assert_ne!(a.tensors().unwrap(), b.tensors().unwrap());
    let bytes = a.to_bytes(&Default::default()).unwrap();
    b.load(&hypha_diloco::Tensors::from_bytes(&bytes).unwrap())
        .unwrap();
    assert_eq!(a.tensors().unwrap(), b.tensors().unwrap());
    let other = Model::new(
        &ModelSpec::Mlp {
            inputs: 5,
            hidden: 8,
            classes: 3,
        },
        1,
    )
    .unwrap();
    let err = other.load(&a.tensors().unwrap()).unwrap_err().to_string();
    assert!(err.contains("l1.weight"), "{err}");
}

#[test]
fn a_specs_parameter_shapes_are_those_of_the_model_it_makes() {
    for spec in [
        ModelSpec::Mlp {
            inputs: 16,
            hidden: 32,
            classes: 4,
        },
        ModelSpec::Cnn {
            channels: 3,
            classes: 10,
            width: 8,
        },
        ModelSpec::Transformer {
            vocab: 40,
            context: 16,
            dim: 32,
            heads: 4,
            layers: 2,
        },
    ] {
        let made: Vec<(String, Vec<usize>)> = Model::new(&spec, 0)
            .unwrap()
            .tensors()
            .unwrap()
            .0
            .into_iter()
            .map(|(name, tensor)| (name, tensor.shape))
            .collect();
        assert_eq!(spec.parameter_shapes().unwrap(), made, "{spec:?}");
    }
    // A spec that makes no model makes no shapes either.
    let bad = ModelSpec::Mlp {
        inputs: 0,
        hidden: 32,
        classes: 4,
    };
    assert!(bad.parameter_shapes().is_err());
}
