//! DiLoCo against plain training, seeded and in one process: three trainers with AdamW inner
//! steps and the parameter server's weighted mean and Nesterov outer step reach within 10 % of
//! the evaluation loss of one trainer that sees the same samples, as the DiLoCo paper compares
//! them: the same number of steps, each on the three trainers' batches together. And the same
//! DiLoCo with compressed pseudo-gradients (error feedback on) against it uncompressed.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::collections::BTreeMap;

use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use hypha_diloco::{Codec, ErrorFeedback, OuterOptimizer, server::ParameterServer};
use hypha_executor::{
    model::{Model, ModelSpec},
    synthetic::Synthetic,
};

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
    let batch = Synthetic::for_model(&SPEC).batch(2048, 1 << 40).unwrap();
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
            let joined = hypha_executor::contract::Batch::concat(&batches).unwrap();
            optimizer
                .backward_step(&single.loss(&joined).unwrap())
                .unwrap();
        }
    }

    let initial = Model::new(&SPEC, 1).unwrap();
    let diloco = diloco(&data, Codec::None);

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
/// pseudo-gradients compressed with `codec`, with error feedback. The final global model.
fn diloco(data: &Synthetic, codec: Codec) -> Model {
    let mut server = ParameterServer::new(OuterOptimizer::new(0.7, 0.9));
    let initial = Model::new(&SPEC, 1).unwrap();
    server
        .offer(&initial.to_bytes(&BTreeMap::new()).unwrap())
        .unwrap();
    let trainers: Vec<Model> = (0..TRAINERS)
        .map(|_| Model::new(&SPEC, 1).unwrap())
        .collect();
    let mut optimizers: Vec<AdamW> = trainers.iter().map(adamw).collect();
    let mut feedback: Vec<ErrorFeedback> = trainers.iter().map(|_| ErrorFeedback::new()).collect();
    for round in 0..ROUNDS {
        let global = hypha_diloco::Tensors::from_bytes(&server.model_bytes().unwrap()).unwrap();
        for (i, (trainer, optimizer)) in trainers.iter().zip(&mut optimizers).enumerate() {
            trainer.load(&global).unwrap();
            for inner in 0..INNER_STEPS {
                let batch = data
                    .batch(BATCH, step_seed(round, i as u64, inner))
                    .unwrap();
                optimizer
                    .backward_step(&trainer.loss(&batch).unwrap())
                    .unwrap();
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
        }
        server.close().unwrap();
    }
    let model = Model::new(&SPEC, 1).unwrap();
    model
        .load(&hypha_diloco::Tensors::from_bytes(&server.model_bytes().unwrap()).unwrap())
        .unwrap();
    model
}

/// DiLoCo with int8 pseudo-gradients and error feedback comes within 2 % of uncompressed
/// DiLoCo's evaluation loss on the same samples (and bf16 and top-k 10 % are reported).
#[test]
fn int8_with_error_feedback_comes_within_two_percent_of_uncompressed_diloco() {
    let data = Synthetic::for_model(&SPEC);
    let plain = held_out_loss(&diloco(&data, Codec::None));
    let int8 = held_out_loss(&diloco(&data, Codec::Int8));
    let bf16 = held_out_loss(&diloco(&data, Codec::Bf16));
    let topk = held_out_loss(&diloco(&data, Codec::TopK { density: 0.1 }));
    eprintln!(
        "evaluation loss: none {plain:.4}, int8 {int8:.4}, bf16 {bf16:.4}, topk 10 % {topk:.4}"
    );
    assert!(int8 <= 1.02 * plain, "int8 {int8} against none {plain}");
    assert!(bf16 <= 1.02 * plain, "bf16 {bf16} against none {plain}");
}
