//! The data contract on slices as users bring them: the seed recipe's images and labels, the
//! text `hypha-data prepare` writes, every dtype the contract promises, and misfits refused
//! with the tensor and the fix named.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use hypha_dataset::{
    TensorSpec,
    slice::{self, Dtype, Encoding},
};
use hypha_executor::{
    contract::{TensorNames, check_manifest, plan},
    model::{Batch, Model, ModelSpec},
};

fn spec(name: &str, dtype: &str, shape: &[u64]) -> TensorSpec {
    TensorSpec {
        name: name.into(),
        dtype: dtype.into(),
        shape: shape.to_vec(),
    }
}

const MLP64: ModelSpec = ModelSpec::Mlp {
    inputs: 64,
    hidden: 8,
    classes: 10,
};

/// What the seed recipe writes: `images` f32 [N, 1, 8, 8], `labels` i64 [N].
fn seed_schema(n: u64) -> Vec<TensorSpec> {
    vec![
        spec("images", "F32", &[n, 1, 8, 8]),
        spec("labels", "I64", &[n]),
    ]
}

#[test]
fn defaults_find_the_seed_recipes_and_prepares_tensors() {
    let names = TensorNames::default();
    let planned = plan(&MLP64, &names, &seed_schema(256)).unwrap();
    assert_eq!(planned.input, "images");
    assert_eq!(planned.target.as_deref(), Some("labels"));

    let cnn = ModelSpec::Cnn {
        channels: 1,
        classes: 10,
        width: 4,
    };
    assert_eq!(
        plan(&cnn, &names, &seed_schema(256)).unwrap().input,
        "images"
    );

    // `prepare` on JSONL: input_ids i32 [N, L] and attention_mask u8 [N, L].
    let text = vec![
        spec("attention_mask", "U8", &[4, 17]),
        spec("input_ids", "I32", &[4, 17]),
    ];
    let transformer = ModelSpec::Transformer {
        vocab: 258,
        context: 16,
        dim: 8,
        heads: 2,
        layers: 1,
    };
    let planned = plan(&transformer, &names, &text).unwrap();
    assert_eq!(planned.input, "input_ids");
    assert_eq!(planned.target, None);
    assert_eq!(planned.mask.as_deref(), Some("attention_mask"));
}

#[test]
fn misfits_name_the_tensor_what_the_model_expects_and_the_fix() {
    let names = TensorNames::default();
    let mlp16 = ModelSpec::Mlp {
        inputs: 16,
        hidden: 8,
        classes: 10,
    };
    let err = plan(&mlp16, &names, &seed_schema(256))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("\"images\"")
            && err.contains("F32")
            && err.contains("[256, 1, 8, 8]")
            && err.contains("inputs = 16")
            && err.contains("set `inputs = 64`"),
        "{err}"
    );

    let renamed = vec![spec("x", "F32", &[9, 64]), spec("y", "I64", &[9])];
    let err = plan(&MLP64, &names, &renamed).unwrap_err().to_string();
    assert!(
        err.contains("none of the default inputs") && err.contains("set `[config] input`"),
        "{err}"
    );
    let named = TensorNames {
        input: Some("x".into()),
        target: None,
    };
    let err = plan(&MLP64, &named, &renamed).unwrap_err().to_string();
    assert!(
        err.contains("no target tensor \"labels\"")
            && err.contains("set `[config] target = \"y\"`"),
        "{err}"
    );
    let both = TensorNames {
        input: Some("x".into()),
        target: Some("y".into()),
    };
    assert!(plan(&MLP64, &both, &renamed).is_ok());

    let float_labels = vec![spec("inputs", "F32", &[9, 64]), spec("labels", "F32", &[9])];
    let err = plan(&MLP64, &names, &float_labels).unwrap_err().to_string();
    assert!(err.contains("class labels must be integers"), "{err}");

    let channels_last = vec![
        spec("images", "U8", &[9, 8, 8, 3]),
        spec("labels", "I64", &[9]),
    ];
    let cnn = ModelSpec::Cnn {
        channels: 3,
        classes: 10,
        width: 4,
    };
    let err = plan(&cnn, &names, &channels_last).unwrap_err().to_string();
    assert!(err.contains("channels-last"), "{err}");
    let huge = vec![
        spec("images", "U8", &[9, 3, 4096, 4096]),
        spec("labels", "I64", &[9]),
    ];
    let err = plan(&cnn, &names, &huge).unwrap_err().to_string();
    assert!(err.contains("--image-size"), "{err}");
    // Shapes from a peer's manifest may overflow; they are refused, never a panic.
    let absurd = vec![
        spec("inputs", "F32", &[9, u64::MAX, 3]),
        spec("labels", "I64", &[9]),
    ];
    let err = plan(&MLP64, &names, &absurd).unwrap_err().to_string();
    assert!(err.contains("more than 2^64"), "{err}");

    let transformer = ModelSpec::Transformer {
        vocab: 258,
        context: 8,
        dim: 8,
        heads: 2,
        layers: 1,
    };
    let text = vec![spec("input_ids", "I32", &[4, 17])];
    let err = plan(&transformer, &names, &text).unwrap_err().to_string();
    assert!(err.contains("set `context = 16`"), "{err}");
    let with_target = TensorNames {
        input: None,
        target: Some("labels".into()),
    };
    let fitting = ModelSpec::Transformer {
        vocab: 258,
        context: 16,
        dim: 8,
        heads: 2,
        layers: 1,
    };
    let err = plan(&fitting, &with_target, &text).unwrap_err().to_string();
    assert!(err.contains("remove `target`"), "{err}");
    let err = plan(&transformer, &names, &seed_schema(4))
        .unwrap_err()
        .to_string();
    assert!(err.contains("token ids"), "{err}");
}

#[test]
fn a_manifest_with_a_second_schema_is_checked_slice_by_slice() {
    let entry = |index: u64, tensors: Vec<TensorSpec>| hypha_dataset::SliceEntry {
        index,
        file: format!("slice-{index}.safetensors"),
        encoding: Encoding::Snappy,
        size: 1,
        uncompressed_size: 1,
        blake3: String::new(),
        samples: None,
        tensors,
    };
    let mut manifest = hypha_dataset::Manifest {
        format: "hypha-dataset/1".into(),
        name: "digits".into(),
        slices: vec![entry(0, seed_schema(256)), entry(1, seed_schema(100))],
    };
    assert!(check_manifest(&MLP64, &TensorNames::default(), &manifest).is_ok());
    manifest
        .slices
        .push(entry(2, vec![spec("images", "F32", &[5, 3, 8, 8])]));
    let err = check_manifest(&MLP64, &TensorNames::default(), &manifest)
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("slice 2 (slice-2.safetensors)"), "{err}");
}

fn bytes_of<T: Copy, const N: usize>(values: &[T], to: fn(T) -> [u8; N]) -> Vec<u8> {
    values.iter().flat_map(|v| to(*v)).collect()
}

/// A plain SafeTensors buffer of `tensors`.
fn safetensors(tensors: Vec<(&str, Dtype, Vec<usize>, Vec<u8>)>) -> Vec<u8> {
    let mut built = slice::Tensors::new();
    for (name, dtype, shape, data) in tensors {
        built = built.with(name, dtype, shape, data).unwrap();
    }
    slice::encode(&built, Encoding::Plain).unwrap()
}

#[test]
fn every_promised_dtype_converts_and_shapes_flatten() {
    let labels = bytes_of(&[1i64, 0], i64::to_le_bytes);
    let model = ModelSpec::Mlp {
        inputs: 4,
        hidden: 4,
        classes: 2,
    };
    let values = [0.5f32, -1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0];
    let cases: Vec<(Dtype, Vec<u8>, Vec<f32>)> = vec![
        (
            Dtype::F32,
            bytes_of(&values, f32::to_le_bytes),
            values.to_vec(),
        ),
        (
            Dtype::F16,
            bytes_of(&values, |v| half::f16::from_f32(v).to_le_bytes()),
            values.to_vec(),
        ),
        (
            Dtype::BF16,
            bytes_of(&values, |v| half::bf16::from_f32(v).to_le_bytes()),
            values.to_vec(),
        ),
        (
            Dtype::I32,
            bytes_of(&[1i32, -2, 3, 4, 5, 6, 7, 8], i32::to_le_bytes),
            vec![1.0, -2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0],
        ),
        (
            Dtype::I64,
            bytes_of(&[1i64, -2, 3, 4, 5, 6, 7, 8], i64::to_le_bytes),
            vec![1.0, -2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0],
        ),
        // Bytes are pixel intensities: scaled to [0, 1].
        (
            Dtype::U8,
            vec![0, 255, 51, 102, 0, 0, 0, 255],
            vec![0.0, 1.0, 0.2, 0.4, 0.0, 0.0, 0.0, 1.0],
        ),
    ];
    for (dtype, data, expected) in cases {
        // [2, 2, 2] flattens to [2, 4] for an mlp of 4 inputs.
        let bytes = safetensors(vec![
            ("inputs", dtype, vec![2, 2, 2], data),
            ("labels", Dtype::I64, vec![2], labels.clone()),
        ]);
        let batch = Batch::read(&bytes, &model, &TensorNames::default()).unwrap();
        assert_eq!(batch.input.dims(), &[2, 4], "{dtype}");
        let got = batch.input.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(got, expected, "{dtype}");
        let target = batch.target.unwrap().to_vec1::<u32>().unwrap();
        assert_eq!(target, vec![1, 0], "{dtype}");
    }
}

#[test]
fn values_out_of_range_are_named_with_the_fix() {
    let model = ModelSpec::Mlp {
        inputs: 2,
        hidden: 4,
        classes: 3,
    };
    let bytes = safetensors(vec![
        ("inputs", Dtype::F32, vec![2, 2], vec![0; 16]),
        (
            "labels",
            Dtype::I64,
            vec![2],
            bytes_of(&[2i64, 7], i64::to_le_bytes),
        ),
    ]);
    let err = Batch::read(&bytes, &model, &TensorNames::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("holds class 7") && err.contains("set `classes = 8`"),
        "{err}"
    );

    let transformer = ModelSpec::Transformer {
        vocab: 256,
        context: 3,
        dim: 8,
        heads: 2,
        layers: 1,
    };
    let bytes = safetensors(vec![(
        "input_ids",
        Dtype::I32,
        vec![1, 4],
        bytes_of(&[1i32, 2, 257, 3], i32::to_le_bytes),
    )]);
    let err = Batch::read(&bytes, &transformer, &TensorNames::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("token id 257") && err.contains("at least 258"),
        "{err}"
    );
}

#[test]
fn padding_is_neither_attended_to_nor_scored() {
    let spec = ModelSpec::Transformer {
        vocab: 8,
        context: 5,
        dim: 8,
        heads: 2,
        layers: 1,
    };
    let model = Model::new(&spec, 3).unwrap();
    let ids = |tail: i32| bytes_of(&[1i32, 2, 3, tail, tail, tail], i32::to_le_bytes);
    let mask = vec![1u8, 1, 1, 0, 0, 0];
    let loss_with = |tail: i32| {
        let bytes = safetensors(vec![
            ("input_ids", Dtype::I32, vec![1, 6], ids(tail)),
            ("attention_mask", Dtype::U8, vec![1, 6], mask.clone()),
        ]);
        let batch = Batch::read(&bytes, &spec, &TensorNames::default()).unwrap();
        model.evaluate(&batch).unwrap()
    };
    // Whatever fills the padding, the loss over the real tokens is the same.
    let (a, _) = loss_with(7);
    let (b, _) = loss_with(0);
    assert!((a - b).abs() < 1e-6, "{a} vs {b}");
    // Without the mask the padding is scored, and the loss differs.
    let unmasked = safetensors(vec![("input_ids", Dtype::I32, vec![1, 6], ids(7))]);
    let batch = Batch::read(&unmasked, &spec, &TensorNames::default()).unwrap();
    let (c, _) = model.evaluate(&batch).unwrap();
    assert!((a - c).abs() > 1e-4, "{a} vs {c}");
}
