//! Compressed updates: what each codec keeps, what error feedback carries, what the
//! accumulator adds, and what a hostile file gets.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::collections::BTreeMap;

use hypha_diloco::{
    Accumulator, Codec, ErrorFeedback, Metadata, Tensor, Tensors, Update,
    codec::{self, INT8_BLOCK, sparse},
    robust::Clip,
};
use hypha_messages::diloco::Compression;
use rand::{Rng, SeedableRng, rngs::StdRng};
use safetensors::{Dtype, tensor::TensorView};

fn tensor(shape: &[usize], values: Vec<f32>) -> Tensor {
    Tensor {
        shape: shape.to_vec(),
        values,
        dtype: Dtype::F32,
    }
}

/// Two parameters of normal-ish values, one not a whole number of int8 blocks.
fn update(seed: u64) -> Tensors {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut values = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| rng.random_range(-1.0f32..1.0) * rng.random_range(0.0f32..1.0).powi(3))
            .collect()
    };
    // A whole chunk of 4,096 and a short one, which `sparse` sends whole.
    let weight = values(64 * 65);
    let bias = values(33);
    Tensors(
        [
            ("l1.weight".to_string(), tensor(&[65, 64], weight)),
            ("l1.bias".to_string(), tensor(&[33], bias)),
        ]
        .into(),
    )
}

/// The `sparse` codec keeping `density` of each chunk in `bits` bits.
fn sparse(density: f32, bits: u8) -> Codec {
    Codec::try_from(Compression::Sparse {
        sparse_density: Some(density),
        sparse_bits: Some(bits),
        sparse_decay: None,
    })
    .unwrap()
}

fn decoded(bytes: &[u8]) -> Tensors {
    Update::read(bytes).unwrap().to_tensors().unwrap()
}

#[test]
fn none_is_exact_and_bf16_keeps_three_digits() {
    let update = update(1);
    let none = codec::encode(&update, Codec::None, &Metadata::new()).unwrap();
    assert_eq!(decoded(&none), update);

    let bf16 = codec::encode(&update, Codec::Bf16, &Metadata::new()).unwrap();
    let back = decoded(&bf16);
    for (name, tensor) in &update.0 {
        for (x, y) in tensor.values.iter().zip(&back.0[name].values) {
            // Round to nearest: at most half a unit in the last of bfloat16's 8 bits.
            assert!((x - y).abs() <= x.abs() / 256.0, "{name}: {x} → {y}");
        }
    }
}

#[test]
fn int8_errs_by_at_most_half_a_step_of_its_block() {
    let update = update(2);
    let bytes = codec::encode(&update, Codec::Int8, &Metadata::new()).unwrap();
    let back = decoded(&bytes);
    for (name, tensor) in &update.0 {
        for (block, (xs, ys)) in tensor
            .values
            .chunks(INT8_BLOCK)
            .zip(back.0[name].values.chunks(INT8_BLOCK))
            .enumerate()
        {
            let step = xs.iter().fold(0.0f32, |m, x| m.max(x.abs())) / 127.0;
            for (x, y) in xs.iter().zip(ys) {
                assert!(
                    (x - y).abs() <= step / 2.0 * 1.0001,
                    "{name} block {block}: {x} → {y}, step {step}"
                );
            }
        }
    }
}

/// File sizes against the same update in f32, for a parameter of 256 Ki values (headers are
/// a few hundred bytes, whatever the size).
#[test]
fn bf16_is_half_int8_a_quarter_and_topk_twice_its_density() {
    let mut rng = StdRng::seed_from_u64(7);
    let values: Vec<f32> = (0..256 * 1024)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    let update = Tensors([("w".to_string(), tensor(&[256, 1024], values))].into());
    let size = |codec| {
        codec::encode(&update, codec, &Metadata::new())
            .unwrap()
            .len() as f64
    };
    let f32_size = size(Codec::None);
    let ratios = [
        (Codec::Bf16, 0.5),
        (Codec::Int8, 0.25 + 1.0 / 256.0),
        (Codec::TopK { density: 0.01 }, 0.02),
        // 64 of 4,096 kept: 8 bytes of bounds, 64 of offsets (6 low bits each, 128 bits of
        // high parts) and 16 (2 bits) or 32 (4 bits) of codes a chunk of 16,384 bytes.
        (sparse(0.015625, 2), 88.0 / 16384.0),
        (sparse(0.015625, 4), 104.0 / 16384.0),
    ];
    for (codec, expected) in ratios {
        let ratio = size(codec) / f32_size;
        assert!(
            (ratio - expected).abs() < 0.001f64.min(0.05 * expected),
            "{codec:?}: {ratio} of f32, expected {expected}"
        );
    }
}

#[test]
fn topk_keeps_a_density_of_the_values_as_written_in_decimal() {
    // 0.1 is 0.10000000149 as an f32: still 100 of 1 000, not 101.
    assert_eq!(codec::kept_count(0.1, 1000), 100);
    assert_eq!(codec::kept_count(0.1, 10), 1);
    assert_eq!(codec::kept_count(0.1, 2112), 212);
    assert_eq!(codec::kept_count(0.001, 10), 1, "at least one");
    assert_eq!(codec::kept_count(1.0, 7), 7);
}

/// Of every chunk of 4,096 values, `sparse` keeps exactly the k of largest magnitude (a
/// shorter last chunk its share), each within half a level of what it was and with its sign,
/// and nothing else.
/// Each chunk keeps its k largest magnitudes with their signs, on a grid of levels fitted to
/// them: every decoded magnitude lies between the smallest and the largest kept, and the
/// chunk's squared error is no more than on the grid from the smallest to the largest (what
/// writers used before; Lloyd's algorithm starts there and only improves on it).
#[test]
fn sparse_keeps_the_largest_values_of_each_chunk_on_a_grid_fitted_to_them() {
    let model = large_model(4);
    let mut gained = Vec::new();
    for (density, bits) in [(0.015625, 2), (0.015625, 4), (0.0625, 2), (0.5, 4)] {
        let codec = sparse(density, bits);
        let bytes = codec::encode(&model, codec, &Metadata::new()).unwrap();
        let back = decoded(&bytes);
        let steps = ((1 << (bits - 1)) - 1) as f32;
        let (mut fitted_error, mut min_max_error) = (0.0f64, 0.0f64);
        for (name, tensor) in &model.0 {
            assert_eq!(back.0[name].shape, tensor.shape);
            let chunks = tensor.values.chunks(sparse::CHUNK);
            for (chunk, (xs, ys)) in chunks
                .zip(back.0[name].values.chunks(sparse::CHUNK))
                .enumerate()
            {
                // A shorter chunk keeps every value.
                let k = if xs.len() == sparse::CHUNK {
                    codec::kept_count(density, sparse::CHUNK)
                } else {
                    xs.len()
                };
                let kept: Vec<usize> = (0..xs.len()).filter(|&i| ys[i] != 0.0).collect();
                assert_eq!(kept.len(), k, "{name} chunk {chunk}");
                let magnitudes = kept.iter().map(|&i| xs[i].abs());
                let low = magnitudes.clone().fold(f32::INFINITY, f32::min);
                let high = magnitudes.fold(0.0f32, f32::max);
                for (i, (x, y)) in xs.iter().zip(ys).enumerate() {
                    if kept.contains(&i) {
                        assert_eq!(x.signum(), y.signum(), "{name}[{i}]: {x} → {y}");
                        assert!(
                            (low..=high).contains(&y.abs()),
                            "{name} chunk {chunk}[{i}]: {x} → {y}, outside {low}..={high}"
                        );
                        fitted_error += f64::from(x - y).powi(2);
                        let span = high - low;
                        let level = if span > 0.0 {
                            ((x.abs() - low) / span * steps).round()
                        } else {
                            0.0
                        };
                        let on_min_max = low + span * (level / steps);
                        min_max_error += f64::from(x.abs() - on_min_max).powi(2);
                    } else {
                        assert!(
                            x.abs() <= low,
                            "{name}[{i}] = {x} was larger than a kept one"
                        );
                    }
                }
            }
        }
        assert!(
            fitted_error <= min_max_error,
            "{density} at {bits} bits: squared error {fitted_error} on the fitted grid, \
             {min_max_error} from the smallest to the largest"
        );
        gained.push(min_max_error / fitted_error);
    }
    eprintln!("squared error from the smallest to the largest, over the fitted grid's: {gained:?}");
    // At 2 bits a fitted pair of levels carries a tail far better than its two ends do.
    assert!(gained[0] > 1.5, "{gained:?}");
}

/// The Python SDK (`python/hypha_sdk/codec.py`) writes a sparse update's records to the bit
/// as the Rust writers do, fitted levels included: a trainer in either language sends the
/// same file for the same update.
#[test]
fn the_python_sdk_writes_the_same_sparse_records() {
    if !hypha_testing::cluster::python_with(&["numpy"], true) {
        return;
    }
    let mut rng = StdRng::seed_from_u64(11);
    // Three whole chunks and a short one; heavy tails, a run of equal values, zeros.
    let mut values: Vec<f32> = (0..3 * sparse::CHUNK + 100)
        .map(|_| rng.random_range(-1.0f32..1.0).powi(5) * 3.0)
        .collect();
    values[5000..5200].fill(0.25);
    values[9000..9100].fill(0.0);
    let dir = tempfile::tempdir().unwrap();
    let raw = dir.path().join("values.f32");
    std::fs::write(
        &raw,
        values
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect::<Vec<_>>(),
    )
    .unwrap();
    let update = Tensors(BTreeMap::from([(
        "w".to_string(),
        tensor(&[values.len()], values.clone()),
    )]));
    for (kept, bits) in [(64, 2), (64, 4), (256, 2), (4096, 4)] {
        let density = kept as f32 / sparse::CHUNK as f32;
        let file = codec::encode(&update, sparse(density, bits), &Metadata::new()).unwrap();
        let rust = safetensors::SafeTensors::deserialize(&file)
            .unwrap()
            .tensor("w#sparse")
            .unwrap()
            .data()
            .to_vec();
        let script = format!(
            "import sys, numpy as np\n\
             from hypha_sdk import codec\n\
             values = np.fromfile(sys.argv[1], dtype='<f4')\n\
             records, _ = codec.SparseFormat({kept}, {bits}).encode(values)\n\
             sys.stdout.buffer.write(records)\n"
        );
        let out = std::process::Command::new("python3")
            .args(["-c", &script])
            .arg(&raw)
            .env("PYTHONPATH", hypha_testing::cluster::python_dir())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(rust.len(), out.stdout.len(), "{kept} at {bits} bits");
        let first = rust.iter().zip(&out.stdout).position(|(a, b)| a != b);
        assert_eq!(
            first, None,
            "{kept} at {bits} bits: the records differ from byte {first:?}"
        );
    }
}

#[test]
fn topk_keeps_the_largest_values_where_they_were() {
    let update = update(3);
    let bytes = codec::encode(&update, Codec::TopK { density: 0.1 }, &Metadata::new()).unwrap();
    let back = decoded(&bytes);
    for (name, tensor) in &update.0 {
        let kept: Vec<usize> = back.0[name]
            .values
            .iter()
            .enumerate()
            .filter(|(_, v)| **v != 0.0)
            .map(|(i, _)| i)
            .collect();
        let k = codec::kept_count(0.1, tensor.values.len());
        assert_eq!(kept.len(), k, "{name}");
        let smallest_kept = kept
            .iter()
            .map(|&i| tensor.values[i].abs())
            .fold(f32::INFINITY, f32::min);
        for (i, (x, y)) in tensor.values.iter().zip(&back.0[name].values).enumerate() {
            if kept.contains(&i) {
                assert_eq!(x, y, "{name}[{i}] is kept exactly");
            } else {
                assert!(
                    x.abs() <= smallest_kept,
                    "{name}[{i}] = {x} was larger than a kept one"
                );
            }
        }
        assert_eq!(back.0[name].shape, tensor.shape);
    }
}

/// Over many rounds, the sum of what was sent is the sum of the true updates less the last
/// residual, which stays as small as one round's error: nothing is lost. Without feedback
/// the same codec's error grows with the rounds.
#[test]
fn error_feedback_delivers_the_sum_of_the_true_updates() {
    for codec in [
        Codec::Int8,
        Codec::TopK { density: 0.05 },
        Codec::Bf16,
        sparse(0.05, 2),
        sparse(0.05, 4),
    ] {
        let mut feedback = ErrorFeedback::new();
        let rounds = 200;
        let shape = update(0);
        let mut truth = zeros_like(&shape);
        let mut sent = zeros_like(&shape);
        let mut sent_plain = zeros_like(&shape);
        // Updates with a steady direction, as pseudo-gradients of a model that learns.
        let drift = update(99);
        for round in 0..rounds {
            let mut delta = update(1000 + round);
            for (name, t) in &mut delta.0 {
                for (v, d) in t.values.iter_mut().zip(&drift.0[name].values) {
                    *v = 0.1 * *v + *d;
                }
            }
            add(&mut truth, &delta);
            add(
                &mut sent,
                &decoded(&feedback.compress(&delta, codec, &Metadata::new()).unwrap()),
            );
            add(
                &mut sent_plain,
                &decoded(&codec::encode(&delta, codec, &Metadata::new()).unwrap()),
            );
        }
        let error = distance(&truth, &sent);
        let error_plain = distance(&truth, &sent_plain);
        let residual: f64 = feedback
            .residual()
            .values()
            .flatten()
            .map(|r| f64::from(*r).powi(2))
            .sum::<f64>()
            .sqrt();
        // Σ sent = Σ true − the last residual, up to f32 rounding over 200 additions.
        assert!(
            (error - residual).abs() <= 1e-3 * (1.0 + residual),
            "{codec:?}: {error} vs {residual}"
        );
        assert!(
            error * 10.0 < error_plain,
            "{codec:?}: with feedback {error}, without {error_plain}"
        );
    }
}

fn zeros_like(update: &Tensors) -> Tensors {
    let mut zeros = update.clone();
    for t in zeros.0.values_mut() {
        t.values.iter_mut().for_each(|v| *v = 0.0);
    }
    zeros
}

fn add(sum: &mut Tensors, update: &Tensors) {
    for (name, t) in &mut sum.0 {
        for (s, v) in t.values.iter_mut().zip(&update.0[name].values) {
            *s += v;
        }
    }
}

fn distance(a: &Tensors, b: &Tensors) -> f64 {
    a.0.iter()
        .flat_map(|(name, t)| t.values.iter().zip(&b.0[name].values))
        .map(|(x, y)| f64::from(x - y).powi(2))
        .sum::<f64>()
        .sqrt()
}

/// Dense updates (and `topk`'s, which the mean takes as dense) are averaged over every
/// update; `sparse` ones over those that sent each value (the next test).
#[test]
fn the_accumulator_adds_compressed_updates_as_their_decoded_values() {
    let codecs = [
        Codec::None,
        Codec::Bf16,
        Codec::Int8,
        Codec::TopK { density: 0.2 },
    ];
    let files: Vec<Vec<u8>> = codecs
        .iter()
        .enumerate()
        .map(|(i, codec)| codec::encode(&update(10 + i as u64), *codec, &Metadata::new()).unwrap())
        .collect();
    let mut compressed = Accumulator::new();
    let mut plain = Accumulator::new();
    for (i, file) in files.iter().enumerate() {
        let weight = 10.0 + i as f64;
        compressed.add_safetensors(file, weight).unwrap();
        plain.add(&decoded(file), weight).unwrap();
    }
    let (a, b) = (compressed.mean().unwrap(), plain.mean().unwrap());
    assert!(distance(&a, &b) < 1e-6, "{}", distance(&a, &b));
    // The norm is the decoded update's.
    for file in &files {
        let norm = Update::read(file).unwrap().norm().unwrap();
        let expected = distance(&decoded(file), &zeros_like(&decoded(file)));
        assert!(
            (norm - expected).abs() <= 1e-6 * expected,
            "{norm} vs {expected}"
        );
    }
}

/// The mean of a `sparse` value is over the updates that sent it (SparseLoCo's): a value
/// only one trainer kept moves the model by all of it, not by its share of the round; a
/// dense update sends every value; a clipped update stays clipped where it alone sent; and
/// updates folded into the sum early count as those held to the end.
#[test]
fn a_sparse_value_is_the_mean_of_the_updates_that_sent_it() {
    let model = update(1);
    let files = [
        (
            codec::encode(&update(20), sparse(0.05, 2), &Metadata::new()).unwrap(),
            10.0,
        ),
        (
            codec::encode(&update(21), Codec::None, &Metadata::new()).unwrap(),
            30.0,
        ),
        (
            codec::encode(&update(22), sparse(0.05, 4), &Metadata::new()).unwrap(),
            20.0,
        ),
    ];
    let share = 0.25f32;
    let sent: Vec<Tensors> = files.iter().map(|(file, _)| decoded(file)).collect();
    let expected = |clipped: Option<usize>| -> Tensors {
        let mut mean = zeros_like(&model);
        for (name, tensor) in &mut mean.0 {
            for (j, value) in tensor.values.iter_mut().enumerate() {
                let (mut sum, mut senders) = (0.0f64, 0.0f64);
                for (i, (sent, (_, samples))) in sent.iter().zip(&files).enumerate() {
                    let sent = f64::from(sent.0[name].values[j]);
                    let counts = if clipped == Some(i) {
                        f64::from(share)
                    } else {
                        1.0
                    };
                    sum += samples * counts * sent;
                    if sent != 0.0 {
                        senders += samples;
                    }
                }
                *value = if senders > 0.0 {
                    (sum / senders) as f32
                } else {
                    0.0
                };
            }
        }
        mean
    };
    let accumulated = |keep_every_update: bool, clipped: Option<usize>| -> Tensors {
        let mut sum = Accumulator::shaped_like(&model);
        sum.keep_every_update(keep_every_update);
        for (file, samples) in &files {
            sum.add_safetensors(file, *samples).unwrap();
        }
        if let Some(i) = clipped {
            let clips: Vec<Clip> = (0..files.len())
                .map(|j| Clip {
                    whole: if j == i { share } else { 1.0 },
                    tensors: Default::default(),
                    ratio: None,
                })
                .collect();
            sum.clip(&clips).unwrap();
        }
        sum.mean().unwrap()
    };
    // The dense update is as large as the model: the first two are folded when it comes.
    let (held, folded) = (accumulated(true, None), accumulated(false, None));
    assert!(distance(&held, &expected(None)) < 1e-5);
    assert!(distance(&folded, &held) < 1e-5);
    let clipped = accumulated(true, Some(0));
    assert!(distance(&clipped, &expected(Some(0))) < 1e-5);
    // A value only the first update sent (none of the dense update's is exactly zero, so
    // take one the third did not send either) is all of it, or the clipped share of it.
    let name = "l1.weight";
    let [first, dense, third] = [0, 1, 2].map(|i| &sent[i].0[name].values);
    let j = (0..first.len())
        .find(|&j| first[j] != 0.0 && third[j] == 0.0)
        .unwrap();
    let alone = (10.0 * first[j] + 30.0 * dense[j]) / 40.0;
    assert!((held.0[name].values[j] - alone).abs() < 1e-6);
    let alone_clipped = (10.0 * share * first[j] + 30.0 * dense[j]) / 40.0;
    assert!((clipped.0[name].values[j] - alone_clipped).abs() < 1e-6);
}

/// A file a peer made up: each mistake is refused with what is wrong, never a panic.
#[test]
fn hostile_compressed_files_are_refused() {
    let serialize = |tensors: Vec<(&str, Dtype, Vec<usize>, Vec<u8>)>,
                     metadata: &[(&str, &str)]| {
        let views: Vec<(String, TensorView<'_>)> = tensors
            .iter()
            .map(|(n, d, s, b)| (n.to_string(), TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        let metadata = metadata
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        safetensors::serialize(views, Some(metadata)).unwrap()
    };
    let int8 = [("hypha.codec", "int8"), ("hypha.codec_version", "2")];
    let topk = [
        ("hypha.codec", "topk"),
        ("hypha.codec_version", "2"),
        ("hypha.shape.w", "[4]"),
    ];
    let f32s = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let u32s = |v: &[u32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (
            serialize(vec![("w", Dtype::I8, vec![4], vec![1; 4])], &int8),
            "has no scales",
        ),
        (
            serialize(
                vec![
                    ("w", Dtype::I8, vec![4], vec![1; 4]),
                    ("w#scale", Dtype::F32, vec![2], f32s(&[1.0, 1.0])),
                ],
                &int8,
            ),
            "2 scales for 1 blocks",
        ),
        (
            serialize(
                vec![
                    ("w", Dtype::I8, vec![4], vec![1; 4]),
                    ("w#scale", Dtype::F32, vec![1], f32s(&[f32::NAN])),
                ],
                &int8,
            ),
            "NaN",
        ),
        (
            serialize(
                vec![
                    ("w#index", Dtype::U32, vec![2], u32s(&[1, 9])),
                    ("w#value", Dtype::F32, vec![2], f32s(&[1.0, 1.0])),
                ],
                &topk,
            ),
            "outside the tensor",
        ),
        (
            serialize(
                vec![
                    ("w#index", Dtype::U32, vec![2], u32s(&[2, 2])),
                    ("w#value", Dtype::F32, vec![2], f32s(&[1.0, 1.0])),
                ],
                &topk,
            ),
            "not increasing",
        ),
        (
            serialize(
                vec![
                    ("w#index", Dtype::U32, vec![1], u32s(&[0])),
                    ("w#value", Dtype::F32, vec![1], f32s(&[1.0])),
                ],
                &[
                    ("hypha.codec", "topk"),
                    ("hypha.codec_version", "2"),
                    ("hypha.shape.w", "[99999999999, 99999999999]"),
                ],
            ),
            "too large",
        ),
        (
            serialize(
                vec![("w", Dtype::F32, vec![1], f32s(&[1.0]))],
                &[("hypha.codec", "int8"), ("hypha.codec_version", "7")],
            ),
            "version",
        ),
        (
            serialize(
                vec![("w", Dtype::F32, vec![1], f32s(&[1.0]))],
                &[("hypha.codec", "zip"), ("hypha.codec_version", "2")],
            ),
            "codec \"zip\"",
        ),
    ];
    let f64s = |v: &[f64]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let more: Vec<(Vec<u8>, &str)> = vec![
        // Finite, but 127 × the scale is beyond f32: the sum would be infinite.
        (
            serialize(
                vec![
                    ("w", Dtype::I8, vec![4], vec![127; 4]),
                    ("w#scale", Dtype::F32, vec![1], f32s(&[3.0e38])),
                ],
                &int8,
            ),
            "beyond ±1e9",
        ),
        // A plain f64 value f32 cannot hold.
        (
            serialize(vec![("w", Dtype::F64, vec![2], f64s(&[1e300, 0.0]))], &[]),
            "beyond ±1e9",
        ),
    ];
    for (bytes, expected) in cases.into_iter().chain(more) {
        let error = Update::read(&bytes).unwrap_err().to_string();
        assert!(
            error.contains(expected),
            "{error:?} should say {expected:?}"
        );
    }

    // A top-k file claiming a shape of 2⁴⁰ values, with one value: refused by a sum not yet
    // shaped like a model, before anything is allocated.
    let huge = serialize(
        vec![
            ("w#index", Dtype::U32, vec![1], u32s(&[0])),
            ("w#value", Dtype::F32, vec![1], f32s(&[1.0])),
        ],
        &[
            ("hypha.codec", "topk"),
            ("hypha.codec_version", "2"),
            ("hypha.shape.w", "[1099511627776]"),
        ],
    );
    let error = Accumulator::new().add_safetensors(&huge, 1.0).unwrap_err();
    assert!(
        error.to_string().contains("shaped like the model"),
        "{error}"
    );
    let model = Tensors([("w".to_string(), tensor(&[4], vec![0.0; 4]))].into());
    let error = Accumulator::shaped_like(&model)
        .add_safetensors(&huge, 1.0)
        .unwrap_err();
    assert!(error.to_string().contains("shape"), "{error}");
}

/// A made-up `sparse` file of one parameter `w` of one chunk of 4,096 values keeping 2 at 2
/// bits (a record of 13 bytes), with `records` and the metadata `changes` set (an empty value
/// removes the key).
fn sparse_file(records: &[u8], changes: &[(&str, &str)]) -> Vec<u8> {
    let mut metadata: std::collections::HashMap<String, String> = [
        ("hypha.codec", "sparse"),
        ("hypha.codec_version", "2"),
        ("hypha.shape.w", "[4096]"),
        ("hypha.sparse.kept", "2"),
        ("hypha.sparse.bits", "2"),
    ]
    .into_iter()
    .chain(changes.iter().copied())
    .filter(|(_, v)| !v.is_empty())
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    metadata.retain(|k, _| !changes.iter().any(|(c, v)| c == k && v.is_empty()));
    let view = TensorView::new(Dtype::U8, vec![records.len()], records).unwrap();
    safetensors::serialize([("w#sparse".to_string(), view)], Some(metadata)).unwrap()
}

/// A record of a chunk of 4,096 values keeping 2: `low`, `high`, the two offsets Elias-Fano
/// coded (l = ⌊log₂(4096 / 2)⌋ = 11 low bits each, in 3 bytes; the high parts, bit
/// (o >> 11) + i for the i-th, in a byte of 4 bits) and two 2-bit codes.
fn record(low: f32, high: f32, offsets: [u16; 2], codes: [u8; 2]) -> Vec<u8> {
    let mut bytes = Vec::new();
    bytes.extend(low.to_le_bytes());
    bytes.extend(high.to_le_bytes());
    let lows = u32::from(offsets[0] & 0x7ff) | u32::from(offsets[1] & 0x7ff) << 11;
    bytes.extend(&lows.to_le_bytes()[..3]);
    bytes.push(1 << (offsets[0] >> 11) | 1 << ((offsets[1] >> 11) + 1));
    bytes.push(codes[0] | codes[1] << 2);
    bytes
}

#[test]
fn a_sparse_file_made_by_hand_reads_as_its_format_says_and_hostile_ones_are_refused() {
    // Level 0 is `low`, level 1 `high`; a code's top bit is the sign.
    let honest = sparse_file(&record(0.5, 1.0, [1, 5], [0, 3]), &[]);
    let values = &decoded(&honest).0["w"].values;
    let mut expected = vec![0.0; 4096];
    expected[1] = 0.5;
    expected[5] = -1.0;
    assert_eq!(values, &expected);

    let cases: Vec<(Vec<u8>, &str)> = vec![
        (
            sparse_file(&record(0.5, 1.0, [5, 5], [0, 0]), &[]),
            "not increasing",
        ),
        (
            sparse_file(&record(0.5, 1.0, [6, 5], [0, 0]), &[]),
            "not increasing",
        ),
        // Offsets 1 and 5 (high bits 0 and 1) with a third high bit set, and with one cleared.
        (
            sparse_file(
                &[&record(0.5, 1.0, [1, 5], [0, 0])[..11], &[0b1011, 0]].concat(),
                &[],
            ),
            "bits set after",
        ),
        (
            sparse_file(
                &[&record(0.5, 1.0, [1, 5], [0, 0])[..11], &[0b0001, 0]].concat(),
                &[],
            ),
            "high parts set fewer bits",
        ),
        (
            sparse_file(&record(0.5, 1.0, [1, 4096], [0, 0]), &[]),
            "outside the chunk",
        ),
        (
            sparse_file(&record(1.0, 0.5, [1, 5], [0, 0]), &[]),
            "out of order",
        ),
        (
            sparse_file(&record(-1.0, 0.5, [1, 5], [0, 0]), &[]),
            "negative",
        ),
        (
            sparse_file(&record(0.5, f32::NAN, [1, 5], [0, 0]), &[]),
            "not finite",
        ),
        (
            sparse_file(&record(0.5, 2e9, [1, 5], [0, 0]), &[]),
            "beyond ±1e9",
        ),
        (
            sparse_file(&record(0.5, 1.0, [1, 5], [0b1100_0000, 0]), &[]),
            "bits set after",
        ),
        (
            sparse_file(&record(0.5, 1.0, [1, 5], [0, 0])[..12], &[]),
            "13 expected",
        ),
        (
            sparse_file(
                &record(0.5, 1.0, [1, 5], [0, 0]),
                &[("hypha.shape.w", "[30]")],
            ),
            "records for 30 values; 16 expected",
        ),
        (
            sparse_file(
                &record(0.5, 1.0, [1, 5], [0, 0]),
                &[("hypha.sparse.kept", "")],
            ),
            "without a number at hypha.sparse.kept",
        ),
        (
            sparse_file(
                &record(0.5, 1.0, [1, 5], [0, 0]),
                &[("hypha.sparse.bits", "3")],
            ),
            "codes of 3 bits",
        ),
        (
            sparse_file(
                &record(0.5, 1.0, [1, 5], [0, 0]),
                &[("hypha.sparse.kept", "0")],
            ),
            "from 1 to 4096",
        ),
        (
            sparse_file(&record(0.5, 1.0, [1, 5], [0, 0]), &[("hypha.shape.w", "")]),
            "has no shape",
        ),
        // A claimed shape of 2⁴⁰ values is refused by the records' length, before anything
        // is allocated for it.
        (
            sparse_file(
                &record(0.5, 1.0, [1, 5], [0, 0]),
                &[("hypha.shape.w", "[1099511627776]")],
            ),
            "expected",
        ),
    ];
    // A shape whose size in records overflows: refused, not a panic (a review found it).
    let overflowing = sparse_file(
        &record(0.5, 1.0, [1, 5], [0, 0]),
        &[
            ("hypha.shape.w", "[18446744073709551615]"),
            ("hypha.sparse.kept", "4096"),
            ("hypha.sparse.bits", "4"),
        ],
    );
    let cases = cases.into_iter().chain([(overflowing, "too large")]);
    for (bytes, expected) in cases {
        let error = Update::read(&bytes).map(|_| ()).map_err(|e| e.to_string());
        let error = error.expect_err(expected);
        assert!(
            error.contains(expected),
            "{error:?} should say {expected:?}"
        );
    }

    // An honest file's records, changed on disk after they were checked, are refused when the
    // round's sum reads them again.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("update.safetensors");
    std::fs::write(&path, &honest).unwrap();
    let model = Tensors([("w".to_string(), tensor(&[4096], vec![0.0; 4096]))].into());
    let mut sum = Accumulator::shaped_like(&model);
    sum.add_source(hypha_diloco::file::FileSource::open(&path).unwrap(), 1.0)
        .unwrap();
    let mut changed = honest.clone();
    let at = changed.len() - 13;
    changed[at..].copy_from_slice(&record(0.5, 1.0, [6, 5], [0, 0]));
    std::fs::write(&path, &changed).unwrap();
    let error = sum.mean().unwrap_err().to_string();
    assert!(error.contains("not increasing"), "{error}");
}

/// What a receiver refuses to read beyond holds every honest update: each codec's encoding of
/// an update with long names and the metadata trainers send fits `max_encoded_bytes`, and the
/// same values under a looser codec (f32 where int8 was expected) do not.
#[test]
fn every_encoding_fits_its_bound_and_a_looser_one_does_not() {
    let long = "model.layers.31.self_attn.rotary_emb.inv_freq.".repeat(4);
    let mut update = update(3);
    let bias = update.0.remove("l1.bias").unwrap();
    update.0.insert(format!("{long}bias"), bias);
    let metadata: Metadata = [
        ("hypha.kind", "pseudo_gradient"),
        ("hypha.round", "12"),
        ("hypha.samples", "4096"),
        ("hypha.accepts", "model,model_delta"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    let sizes = || update.0.values().map(|t| t.values.len());
    for codec in [
        Codec::None,
        Codec::Bf16,
        Codec::Int8,
        Codec::TopK { density: 0.01 },
        Codec::TopK { density: 1.0 },
        sparse(0.01, 2),
        sparse(1.0, 4),
    ] {
        let bytes = codec::encode(&update, codec, &metadata).unwrap();
        let bound = codec::max_encoded_bytes(codec, sizes());
        assert!(
            bytes.len() as u64 <= bound,
            "{codec:?}: {} bytes, bound {bound}",
            bytes.len()
        );
    }
    // A model of a million values: f32 takes four times int8's bound.
    let big = Tensors([("w".to_string(), tensor(&[1 << 20], vec![0.5; 1 << 20]))].into());
    let f32_bytes = codec::encode(&big, Codec::None, &metadata).unwrap();
    assert!(f32_bytes.len() as u64 > codec::max_encoded_bytes(Codec::Int8, [1 << 20].into_iter()));
}

/// A model of two parameters, one of more values than a chunk read from a file holds.
fn large_model(seed: u64) -> Tensors {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut values =
        |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-1.0..1.0)).collect() };
    let big = (hypha_diloco::file::CHUNK + 3 * INT8_BLOCK + 7) / 2;
    Tensors(
        [
            ("a.weight".to_string(), tensor(&[2, big], values(2 * big))),
            ("b.bias".to_string(), tensor(&[5], values(5))),
        ]
        .into(),
    )
}

fn small_change(model: &Tensors, seed: u64) -> Tensors {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut change = model.clone();
    for t in change.0.values_mut() {
        t.values
            .iter_mut()
            .for_each(|v| *v = rng.random_range(-1e-3..1e-3));
    }
    change
}

#[test]
fn a_change_applied_to_a_model_file_a_chunk_at_a_time_gives_what_add_to_gives() {
    let dir = tempfile::tempdir().unwrap();
    let model = large_model(1);
    let model_path = dir.path().join("model.safetensors");
    model.save(&model_path, &Metadata::new()).unwrap();
    let source = hypha_diloco::file::FileSource::open(&model_path).unwrap();
    assert_eq!(Tensors::fingerprint_of(&source).unwrap(), model.digest());
    for codec in [
        Codec::None,
        Codec::Bf16,
        Codec::Int8,
        Codec::TopK { density: 0.01 },
        sparse(0.01, 2),
        sparse(0.3, 4),
    ] {
        let change = codec::encode(&small_change(&model, 2), codec, &Metadata::new()).unwrap();
        let mut expected = model.clone();
        Update::read(&change)
            .unwrap()
            .add_to(&mut expected)
            .unwrap();
        let out = dir.path().join(format!("{}.safetensors", codec.name()));
        let hash = Update::read(&change)
            .unwrap()
            .add_to_file(&source, &out, Metadata::new())
            .unwrap();
        assert_eq!(hash, expected.digest(), "{codec:?}");
        assert_eq!(Tensors::load(&out).unwrap(), expected, "{codec:?}");
    }

    // A change of another model is refused, and nothing is written.
    let mut wrong = large_model(3);
    wrong.0.remove("b.bias");
    let wrong = codec::encode(&wrong, Codec::Int8, &Metadata::new()).unwrap();
    let out = dir.path().join("refused.safetensors");
    assert!(
        Update::read(&wrong)
            .unwrap()
            .add_to_file(&source, &out, Metadata::new())
            .is_err()
    );
    assert!(!out.exists());
}

#[test]
fn a_file_encoded_a_parameter_at_a_time_is_the_file_encode_makes() {
    let dir = tempfile::tempdir().unwrap();
    let update = update(5);
    let metadata = Metadata::from([("round".to_string(), "3".to_string())]);
    let shapes: Vec<(String, Vec<usize>)> = update
        .0
        .iter()
        .map(|(name, t)| (name.clone(), t.shape.clone()))
        .collect();
    for codec in [Codec::None, Codec::Bf16, Codec::Int8, sparse(0.02, 2)] {
        let path = dir.path().join(codec.name());
        let size = codec::encode_file(
            &path,
            false,
            codec,
            &shapes,
            &metadata,
            |name, _, values| {
                values.extend_from_slice(&update.0[name].values);
                Ok(())
            },
        )
        .unwrap();
        let written = std::fs::read(&path).unwrap();
        assert_eq!(written.len() as u64, size);
        assert_eq!(
            written,
            codec::encode(&update, codec, &metadata).unwrap(),
            "{codec:?}"
        );
    }
    // Too few values for a shape: refused, nothing written.
    let path = dir.path().join("short");
    let short = codec::encode_file(
        &path,
        false,
        Codec::Int8,
        &shapes,
        &metadata,
        |_, _, values| {
            values.push(1.0);
            Ok(())
        },
    );
    assert!(short.is_err());
    assert!(!path.exists());
}

#[test]
fn a_rewritten_file_holds_the_same_tensors_with_the_new_metadata() {
    let dir = tempfile::tempdir().unwrap();
    let model = large_model(6);
    let path = dir.path().join("model.safetensors");
    model
        .save(
            &path,
            &Metadata::from([("kind".to_string(), "model".to_string())]),
        )
        .unwrap();
    let copy = dir.path().join("copy.safetensors");
    let metadata = Metadata::from([("round".to_string(), "0".to_string())]);
    let source = hypha_diloco::file::FileSource::open(&path).unwrap();
    hypha_diloco::file::rewrite(&source, &copy, &metadata).unwrap();
    let bytes = std::fs::read(&copy).unwrap();
    assert_eq!(hypha_diloco::metadata(&bytes).unwrap(), metadata);
    assert_eq!(Tensors::from_bytes(&bytes).unwrap(), model);
}
