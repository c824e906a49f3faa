//! DiLoCo against plain training, seeded and in one process: three trainers with AdamW inner
//! steps and the parameter server's weighted mean and Nesterov outer step reach within 10 % of
//! the evaluation loss of one trainer that sees the same samples, as the DiLoCo paper compares
//! them: the same number of steps, each on the three trainers' batches together. And the same
//! DiLoCo with compressed pseudo-gradients and model changes (error feedback on) against it
//! uncompressed.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::collections::BTreeMap;

use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use hypha_diloco::{
    Codec, ErrorFeedback, OuterOptimizer, Tensors, Update, codec, server::ParameterServer,
};
use hypha_executor::{
    model::{Model, ModelSpec},
    synthetic::Synthetic,
};
use hypha_messages::diloco::Compression;

const SPEC: ModelSpec = ModelSpec::Mlp {
    inputs: 16,
    hidden: 32,
    classes: 4,
};
const BATCH: usize = 32;
const ROUNDS: u64 = 30;
const INNER_STEPS: u64 = 20;
const TRAINERS: u64 = 3;

fn adamw(model: &Model) -> AdamW {
    let params = ParamsAdamW {
        lr: 3e-3,
        ..ParamsAdamW::default()
    };
    AdamW::new(model.parameters(), params).unwrap()
}

/// The seed of trainer `trainer`'s batch at inner step `inner` of `round`.
fn step_seed(round: u64, trainer: u64, inner: u64) -> u64 {
    (round * INNER_STEPS + inner) * TRAINERS + trainer
}

fn held_out_loss(model: &Model) -> f64 {
    held_out_loss_on(&Synthetic::for_model(&SPEC), model)
}

fn held_out_loss_on(data: &Synthetic, model: &Model) -> f64 {
    let batch = data.batch(2048, 1 << 40).unwrap();
    model.evaluate(&batch).unwrap().0
}

#[test]
fn three_trainers_with_diloco_come_within_ten_percent_of_one_on_the_same_samples() {
    let data = Synthetic::for_model(&SPEC);

    // One trainer: each step takes the batches the three trainers take at that step.
    let single = Model::new(&SPEC, 1).unwrap();
    let mut optimizer = adamw(&single);
    for round in 0..ROUNDS {
        for inner in 0..INNER_STEPS {
            let batches: Vec<_> = (0..TRAINERS)
                .map(|t| data.batch(BATCH, step_seed(round, t, inner)).unwrap())
                .collect();
            let joined = hypha_executor::model::Batch::concat(&batches).unwrap();
            optimizer
                .backward_step(&single.loss(&joined).unwrap())
                .unwrap();
        }
    }

    let initial = Model::new(&SPEC, 1).unwrap();
    let diloco = diloco(&data, Codec::None, 0);

    let (single, diloco, start) = (
        held_out_loss(&single),
        held_out_loss(&diloco),
        held_out_loss(&initial),
    );
    assert!(
        single < 0.5 * start,
        "plain training learns: {start} → {single}"
    );
    eprintln!("evaluation loss: start {start:.4}, one trainer {single:.4}, DiLoCo {diloco:.4}");
    assert!(
        diloco <= 1.1 * single,
        "DiLoCo {diloco} against one trainer {single} (from {start})"
    );
}

/// Three trainers, each its own third of the batches per round, and a parameter server;
/// pseudo-gradients compressed with `codec`, with error feedback, and the global model's
/// changes sent back compressed with it too (applied to the trainers' copy, which must then
/// be the server's bit for bit). With `overlap` > 0, each trainer trains the first `overlap`
/// inner steps of the next round right after it sent its update, before the new global model
/// is there, and then moves them onto it (θ ← θ + (θ̂ᵣ₊₁ − θ_sync)) as the reference executor
/// does. Every trainer takes the same batches whatever the mode. The final global model.
fn diloco(data: &Synthetic, codec: Codec, overlap: u64) -> Model {
    diloco_with(data, codec, OuterOptimizer::new(0.7, 0.9), overlap)
}

/// [`diloco_of`] the MLP of [`SPEC`].
fn diloco_with(data: &Synthetic, codec: Codec, outer: OuterOptimizer, overlap: u64) -> Model {
    diloco_of(&SPEC, data, codec, outer, overlap)
}

/// [`diloco`] of a model of `spec` on `data` with the server's outer step `outer`; the
/// server's changes go back with `codec`'s [`Codec::for_broadcast`], the trainers' error
/// feedback is [`ErrorFeedback::for_codec`].
fn diloco_of(
    spec: &ModelSpec,
    data: &Synthetic,
    codec: Codec,
    outer: OuterOptimizer,
    overlap: u64,
) -> Model {
    let back = codec.for_broadcast();
    let mut server = ParameterServer::new(outer).broadcast_changes(back);
    let initial = Model::new(spec, 1).unwrap();
    server
        .offer(&initial.to_bytes(&BTreeMap::new()).unwrap())
        .unwrap();
    let trainers: Vec<Model> = (0..TRAINERS)
        .map(|_| Model::new(spec, 1).unwrap())
        .collect();
    let mut optimizers: Vec<AdamW> = trainers.iter().map(adamw).collect();
    let mut feedback: Vec<ErrorFeedback> = (trainers.iter())
        .map(|_| ErrorFeedback::for_codec(codec))
        .collect();
    let mut synced: Vec<Option<Tensors>> = trainers.iter().map(|_| None).collect();
    let mut global = Tensors::from_bytes(&server.model_bytes().unwrap()).unwrap();
    for round in 0..ROUNDS {
        for (i, (trainer, optimizer)) in trainers.iter().zip(&mut optimizers).enumerate() {
            let step = |optimizer: &mut AdamW, round: u64, inner: u64| {
                let batch = data
                    .batch(BATCH, step_seed(round, i as u64, inner))
                    .unwrap();
                optimizer
                    .backward_step(&trainer.loss(&batch).unwrap())
                    .unwrap();
            };
            let first = match synced[i].take() {
                Some(synced) => {
                    let mut local = trainer.tensors().unwrap();
                    for (name, tensor) in &mut local.0 {
                        let pairs = global.0[name].values.iter().zip(&synced.0[name].values);
                        for (l, (new, old)) in tensor.values.iter_mut().zip(pairs) {
                            *l += new - old;
                        }
                    }
                    trainer.load(&local).unwrap();
                    overlap
                }
                None => {
                    trainer.load(&global).unwrap();
                    0
                }
            };
            for inner in first..INNER_STEPS {
                step(optimizer, round, inner);
            }
            let mut delta = global.clone();
            for (name, tensor) in &mut delta.0 {
                let trained = &trainer.tensors().unwrap().0[name];
                for (g, l) in tensor.values.iter_mut().zip(&trained.values) {
                    *g -= l;
                }
            }
            let bytes = feedback[i]
                .compress(&delta, codec, &BTreeMap::new())
                .unwrap();
            let samples = INNER_STEPS * BATCH as u64;
            server
                .add(&format!("trainer-{i}"), &bytes, round, samples)
                .unwrap();
            if overlap > 0 && round + 1 < ROUNDS {
                synced[i] = Some(trainer.tensors().unwrap());
                for inner in 0..overlap {
                    step(optimizer, round + 1, inner);
                }
            }
        }
        match server.close().unwrap().delta {
            Some(change) => {
                Update::read(&change).unwrap().add_to(&mut global).unwrap();
                assert_eq!(Some(global.digest().as_str()), server.model_hash());
            }
            None => {
                assert_eq!(back, Codec::None, "a compressing server sends changes");
                global = Tensors::from_bytes(&server.model_bytes().unwrap()).unwrap();
            }
        }
    }
    let model = Model::new(spec, 1).unwrap();
    model
        .load(&Tensors::from_bytes(&server.model_bytes().unwrap()).unwrap())
        .unwrap();
    model
}

/// DiLoCo with int8 pseudo-gradients and model changes (error feedback on both sides) comes
/// within 2 % of uncompressed DiLoCo's evaluation loss on the same samples, and within 5 %
/// with a quarter of each round's inner steps overlapped with the round's communication
/// (issue 21); bf16, top-k 10 % and overlap without compression are reported.
#[test]
fn int8_with_error_feedback_comes_within_two_percent_of_uncompressed_diloco() {
    let data = Synthetic::for_model(&SPEC);
    let plain = held_out_loss(&diloco(&data, Codec::None, 0));
    let int8 = held_out_loss(&diloco(&data, Codec::Int8, 0));
    let int8_overlap = held_out_loss(&diloco(&data, Codec::Int8, INNER_STEPS / 4));
    let overlap = held_out_loss(&diloco(&data, Codec::None, INNER_STEPS / 4));
    let bf16 = held_out_loss(&diloco(&data, Codec::Bf16, 0));
    let topk = held_out_loss(&diloco(&data, Codec::TopK { density: 0.1 }, 0));
    eprintln!(
        "evaluation loss: none {plain:.4}, int8 {int8:.4}, int8 + overlap {int8_overlap:.4}, \
         none + overlap {overlap:.4}, bf16 {bf16:.4}, topk 10 % {topk:.4}"
    );
    assert!(int8 <= 1.02 * plain, "int8 {int8} against none {plain}");
    assert!(bf16 <= 1.02 * plain, "bf16 {bf16} against none {plain}");
    assert!(
        int8_overlap <= 1.05 * plain,
        "int8 with overlap {int8_overlap} against none {plain}"
    );
}

/// `sparse` as a job gets it by default.
fn sparse() -> Codec {
    Codec::try_from(Compression::Sparse {
        sparse_density: None,
        sparse_bits: None,
        sparse_decay: None,
    })
    .unwrap()
}

/// The outer step that goes with `sparse` by default: plain SGD.
fn sgd() -> OuterOptimizer {
    let (rate, momentum) = codec::SPARSE_OUTER;
    OuterOptimizer::new(rate, momentum)
}

/// `sparse` as a job gets it by default (64 of each chunk of 4,096 at 2 bits up, four times as
/// many back, a parameter under a chunk whole, the trainers' residuals decaying by 0.97 as
/// their momentum, plain SGD at 1.25 on the server) comes within 2 % of uncompressed DiLoCo
/// with Nesterov momentum on the same samples, with and without overlap; with Nesterov
/// momentum on the server as well it ends behind (0.1983 against 0.1852 here; at 1 % of each
/// chunk and small parameters sparse too it diverged), which is why it goes without.
#[test]
fn sparse_with_decaying_error_feedback_and_plain_sgd_comes_within_two_percent_of_uncompressed_diloco()
 {
    let data = Synthetic::for_model(&SPEC);
    let sparse = sparse();
    let plain = held_out_loss(&diloco(&data, Codec::None, 0));
    let loss = held_out_loss(&diloco_with(&data, sparse, sgd(), 0));
    let overlapped = held_out_loss(&diloco_with(&data, sparse, sgd(), INNER_STEPS / 4));
    let nesterov = held_out_loss(&diloco(&data, sparse, 0));
    eprintln!(
        "evaluation loss: none {plain:.4}, sparse {loss:.4}, sparse + overlap {overlapped:.4}, \
         sparse with Nesterov momentum {nesterov:.4}"
    );
    assert!(loss <= 1.02 * plain, "sparse {loss} against none {plain}");
    assert!(
        overlapped <= 1.02 * plain,
        "sparse with overlap {overlapped} against none {plain}"
    );
    assert!(
        nesterov > 1.05 * loss,
        "sparse with Nesterov momentum {nesterov} against plain SGD {loss}: if it no longer \
         ends behind, SPARSE_OUTER's reason is gone"
    );
}

/// The same comparison on a small transformer learning the `sequences` text (each row counts
/// up by its own step; the next token follows once the step is seen): int8 comes within 2 %
/// of uncompressed DiLoCo on the same samples. `sparse` at its defaults learns, but in 30
/// rounds it stays far behind (1.33 against 1.01 from 3.61; 1.57 with decay 0.95 and each
/// chunk's levels at its ends, 1.44 with decay 0.9, a step of 1.0 and 3× back, which trained
/// the 64 rounds of `hypha-bench outcome`'s real text worse: 1.041 of f32 against 1.019;
/// BENCHMARKS.md, "Sparse on a transformer"): a round moves
/// 1.56 % of each chunk of a larger tensor, and this model needs most of them
/// moved. Its bound is that it learns at all, so that it cannot stop unseen.
#[test]
fn on_a_small_transformer_int8_comes_within_two_percent_of_uncompressed_diloco() {
    let spec = ModelSpec::Transformer {
        vocab: 32,
        context: 16,
        dim: 32,
        heads: 2,
        layers: 1,
    };
    let data = Synthetic::for_model(&spec);
    let nesterov = || OuterOptimizer::new(0.7, 0.9);
    let loss = |codec, outer| held_out_loss_on(&data, &diloco_of(&spec, &data, codec, outer, 0));
    let start = held_out_loss_on(&data, &Model::new(&spec, 1).unwrap());
    let plain = loss(Codec::None, nesterov());
    let int8 = loss(Codec::Int8, nesterov());
    let sparse = loss(sparse(), sgd());
    eprintln!(
        "transformer evaluation loss: start {start:.4}, none {plain:.6}, int8 {int8:.6}, sparse {sparse:.4}"
    );
    assert!(plain < 0.5 * start, "DiLoCo learns: {start} → {plain}");
    assert!(int8 <= 1.02 * plain, "int8 {int8} against none {plain}");
    assert!(sparse < 0.9 * start, "sparse learns: {start} → {sparse}");
}
