//! The parameter server's rounds: adopting the first model, taking each round's
//! pseudo-gradients once, dropping late ones, and resuming from a checkpoint exactly where it
//! stopped.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::collections::BTreeMap;

use hypha_diloco::{
    Codec, OuterOptimizer, Tensor, Tensors, Update, codec,
    server::{ParameterServer, Taken, round_of},
};
use hypha_messages::diloco::meta;
use rand::{Rng, SeedableRng, rngs::StdRng};
use safetensors::Dtype;

fn bytes(values: &[f32]) -> Vec<u8> {
    Tensors(BTreeMap::from([(
        "w".to_string(),
        Tensor {
            shape: vec![values.len()],
            values: values.to_vec(),
            dtype: Dtype::F32,
        },
    )]))
    .to_bytes(&BTreeMap::new())
    .unwrap()
}

fn model_of(server: &ParameterServer) -> (Vec<f32>, u64) {
    let bytes = server.model_bytes().unwrap();
    let round = round_of(&hypha_diloco::metadata(&bytes).unwrap()).unwrap();
    (
        Tensors::from_bytes(&bytes).unwrap().0["w"].values.clone(),
        round,
    )
}

#[test]
fn a_round_takes_each_trainer_once_and_drops_late_updates() {
    let mut server = ParameterServer::new(OuterOptimizer::new(0.5, 0.9));
    assert_eq!(server.round(), None);
    // Before it holds a model, nothing counts.
    assert_eq!(
        server.add("a", &bytes(&[1.0, 1.0]), 0, 10).unwrap(),
        Taken::Late { round: 0 }
    );
    assert!(server.offer(&bytes(&[1.0, 2.0])).unwrap());
    assert!(
        !server.offer(&bytes(&[9.0, 9.0])).unwrap(),
        "only the first model is adopted"
    );
    assert_eq!(server.round(), Some(0));

    assert_eq!(
        server.add("a", &bytes(&[1.0, 0.0]), 0, 10).unwrap(),
        Taken::Added
    );
    assert_eq!(
        server.add("a", &bytes(&[5.0, 5.0]), 0, 10).unwrap(),
        Taken::Duplicate
    );
    assert_eq!(
        server.add("b", &bytes(&[0.0, 4.0]), 0, 30).unwrap(),
        Taken::Added
    );
    assert!(
        server.add("c", &bytes(&[1.0, 2.0, 3.0]), 0, 5).is_err(),
        "wrong shape"
    );
    assert_eq!(server.arrived().len(), 2);

    let closed = server.close().unwrap();
    assert_eq!(closed.round, 0);
    assert_eq!(closed.included, vec!["a".to_string(), "b".to_string()]);
    assert_eq!(closed.samples, 40);
    // g = (10·[1, 0] + 30·[0, 4]) / 40 = [0.25, 3]; first step b = g:
    // θ = [1, 2] − 0.5·(g + 0.9·g) = [1 − 0.2375, 2 − 2.85].
    let (values, round) = model_of(&server);
    assert_eq!(round, 1);
    assert!(
        (values[0] - 0.7625).abs() < 1e-6 && (values[1] + 0.85).abs() < 1e-6,
        "{values:?}"
    );

    // A round-0 update after the close is late; an empty round cannot close.
    assert_eq!(
        server.add("c", &bytes(&[1.0, 1.0]), 0, 10).unwrap(),
        Taken::Late { round: 0 }
    );
    assert!(server.close().is_err());
}

#[test]
fn a_resumed_server_continues_as_if_it_never_stopped() {
    let dir = tempfile::tempdir().unwrap();
    let checkpoint = dir.path().join("checkpoint.safetensors");
    let optimizer = || OuterOptimizer::new(0.7, 0.9);
    let mut server = ParameterServer::new(optimizer());
    server.offer(&bytes(&[1.0, -1.0])).unwrap();
    server.add("a", &bytes(&[0.5, 0.25]), 0, 8).unwrap();
    server.close().unwrap();
    server.checkpoint(&checkpoint).unwrap();

    let mut resumed = ParameterServer::resume(&checkpoint, optimizer()).unwrap();
    assert_eq!(resumed.round(), Some(1));
    for s in [&mut server, &mut resumed] {
        s.add("a", &bytes(&[0.1, -0.2]), 1, 8).unwrap();
        s.close().unwrap();
    }
    // Same model after the second step: the momentum buffers came back too.
    assert_eq!(model_of(&server), model_of(&resumed));
    assert_eq!(
        ParameterServer::resume(&dir.path().join("none"), optimizer())
            .unwrap()
            .round(),
        None
    );
}

#[test]
fn updates_stay_in_their_files_until_the_close_which_fails_whole_when_one_breaks() {
    let dir = tempfile::tempdir().unwrap();
    let optimizer = || OuterOptimizer::new(0.7, 0.9);
    let file = |name: &str, values: &[f32]| {
        let path = dir.path().join(name);
        std::fs::write(&path, bytes(values)).unwrap();
        path
    };
    let (a, b) = (file("a", &[0.5, 0.25]), file("b", &[0.1, -0.2]));
    let mut from_files = ParameterServer::new(optimizer());
    let mut in_memory = ParameterServer::new(optimizer());
    for server in [&mut from_files, &mut in_memory] {
        server.offer(&bytes(&[1.0, -1.0])).unwrap();
    }
    for (peer, path) in [("a", &a), ("b", &b)] {
        let source = hypha_diloco::file::FileSource::open(path).unwrap();
        from_files.add_from(peer, source, 0, 8).unwrap();
        in_memory
            .add(peer, &std::fs::read(path).unwrap(), 0, 8)
            .unwrap();
        // The server holds the file open; its name may go, as a worker's inbox removes it.
        std::fs::remove_file(path).unwrap();
    }
    from_files.close().unwrap();
    in_memory.close().unwrap();
    assert_eq!(model_of(&from_files), model_of(&in_memory));

    // A file cut short after its check: the close cannot sum it, and the server, whose
    // model took part of the step, holds none any more.
    let c = file("c", &[0.3, 0.3]);
    let source = hypha_diloco::file::FileSource::open(&c).unwrap();
    from_files.add_from("a", source, 1, 8).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&c)
        .unwrap()
        .set_len(10)
        .unwrap();
    let error = from_files.close().unwrap_err();
    assert!(
        matches!(error, hypha_diloco::Error::RoundBroken(_)),
        "{error}"
    );
    assert_eq!(from_files.round(), None);
    assert!(
        from_files
            .checkpoint(&dir.path().join("checkpoint"))
            .is_err()
    );
}

#[test]
fn updates_past_a_models_bytes_are_folded_into_a_sum_as_they_come() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, values: &[f32]| {
        let path = dir.path().join(name);
        std::fs::write(&path, bytes(values)).unwrap();
        path
    };
    let cut = |path: &std::path::Path| {
        let file = std::fs::OpenOptions::new().write(true).open(path).unwrap();
        file.set_len(10).unwrap();
    };
    let open = |path: &std::path::Path| hypha_diloco::file::FileSource::open(path).unwrap();
    let mut server = ParameterServer::new(OuterOptimizer::new(0.7, 0.9));
    let mut reference = ParameterServer::new(OuterOptimizer::new(0.7, 0.9));
    for s in [&mut server, &mut reference] {
        s.offer(&bytes(&[1.0, -1.0])).unwrap();
    }
    // Two f32 updates carry twice the model's bytes: the second folds both into a sum, and
    // their files are not read again (cut short after it, the close does not notice).
    let updates = [("a", [0.5, 0.25]), ("b", [0.1, -0.2]), ("c", [0.3, 0.3])];
    let mut paths = Vec::new();
    for (peer, values) in &updates {
        let path = write(peer, values);
        server.add_from(peer, open(&path), 0, 8).unwrap();
        reference.add(peer, &bytes(values), 0, 8).unwrap();
        paths.push(path);
    }
    paths.iter().for_each(|path| cut(path));
    server.close().unwrap();
    reference.close().unwrap();
    assert_eq!(model_of(&server), model_of(&reference));

    // A held file cut short before the fold reads it: the round's sum is lost, the model
    // stays as it was, and the next round goes on.
    let before = model_of(&server);
    let a = write("a1", &[0.5, 0.25]);
    server.add_from("a", open(&a), 1, 8).unwrap();
    cut(&a);
    server
        .add_from("b", open(&write("b1", &[0.1, -0.2])), 1, 8)
        .unwrap();
    let error = server.close().unwrap_err();
    assert!(matches!(error, hypha_diloco::Error::SumLost(_)), "{error}");
    assert_eq!(model_of(&server), before);
    server.skip().unwrap();
    server.add("a", &bytes(&[0.5, 0.25]), 2, 8).unwrap();
    server.close().unwrap();
}

#[test]
fn poisoned_updates_are_refused_and_the_model_is_as_without_them() {
    let mut server = ParameterServer::new(OuterOptimizer::new(0.5, 0.9)).limit_samples(100);
    assert!(server.offer(&bytes(&[1.0, 2.0])).unwrap());
    for (poison, samples, why) in [
        (vec![f32::NAN, 0.0], 10, "NaN"),
        (vec![f32::INFINITY, 0.0], 10, "infinite"),
        (vec![1.0, 0.0], u64::MAX, "samples"),
        (vec![1.0, 0.0], 101, "samples"),
    ] {
        let error = server.add("liar", &bytes(&poison), 0, samples).unwrap_err();
        assert!(
            error.to_string().contains(why) || error.to_string().contains("NaN"),
            "{why}: {error}"
        );
    }
    assert!(server.arrived().is_empty(), "nothing of the liar's counted");
    let refused = server.refused();
    assert_eq!(refused.len(), 1, "one entry per peer: {refused:?}");
    assert_eq!(refused[0].0, "liar");
    assert!(refused[0].1.contains("101"), "the last reason: {refused:?}");
    assert_eq!(
        server.add("a", &bytes(&[1.0, 0.0]), 0, 100).unwrap(),
        Taken::Added
    );
    server.close().unwrap();
    assert!(server.refused().is_empty(), "refusals are the round's");
    // The honest update alone: g = [1, 0], θ = [1, 2] − 0.5·1.9·g = [0.05, 2].
    let (values, _) = model_of(&server);
    assert!(
        (values[0] - 0.05).abs() < 1e-6 && (values[1] - 2.0).abs() < 1e-6,
        "{values:?}"
    );
}

/// A skipped round (too few of its updates taken) ends with the model as it was: same
/// values, same fingerprint, same momentum (the next round steps as the skipped one would
/// have), whatever arrived discarded. A refusal's reason is bounded, however long the text
/// the sender chose for it.
#[test]
fn a_skipped_round_leaves_the_model_as_it_was() {
    let mut server = ParameterServer::new(OuterOptimizer::new(0.5, 0.9)).limit_samples(100);
    assert!(matches!(server.skip(), Err(hypha_diloco::Error::Empty)));
    server.offer(&bytes(&[1.0, 2.0])).unwrap();
    server.add("a", &bytes(&[1.0, 0.0]), 0, 10).unwrap();
    server.close().unwrap();
    let (before, hash) = (model_of(&server), server.model_hash().map(str::to_string));

    server.add("a", &bytes(&[5.0, 5.0]), 1, 10).unwrap();
    server
        .add("liar", &bytes(&[1.0, 0.0]), 1, 1000)
        .unwrap_err();
    let skipped = server.skip().unwrap();
    assert_eq!((skipped.round, skipped.samples), (1, 0));
    assert!(skipped.included.is_empty() && skipped.delta.is_none());
    let (values, round) = model_of(&server);
    assert_eq!((values, round), (before.0.clone(), 2));
    assert_eq!(server.model_hash().map(str::to_string), hash);
    assert!(server.arrived().is_empty() && server.refused().is_empty());

    // Round 2 steps as round 1 would have: momentum 0.9·g + g, Nesterov: θ − 0.5(g + 0.9·m).
    server.add("a", &bytes(&[1.0, 0.0]), 2, 10).unwrap();
    server.close().unwrap();
    let (values, _) = model_of(&server);
    let expected = before.0[0] - 0.5 * (1.0 + 0.9 * 1.9);
    assert!(
        (values[0] - expected).abs() < 1e-6,
        "{values:?} against {expected}"
    );

    // A tensor name of a megabyte, with a newline: the reason kept is short and one line.
    let name = format!("w\n{}", "x".repeat(1 << 20));
    let long = Tensors(BTreeMap::from([(
        name,
        Tensor {
            shape: vec![2],
            values: vec![1.0, 0.0],
            dtype: Dtype::F32,
        },
    )]))
    .to_bytes(&BTreeMap::new())
    .unwrap();
    server.add("liar", &long, 3, 10).unwrap_err();
    let (_, reason) = &server.refused()[0];
    assert!(
        reason.chars().count() == hypha_diloco::server::REASON_CHARS + 1
            && reason.ends_with('…')
            && !reason.contains('\n'),
        "{} characters: {:?}",
        reason.len(),
        &reason[..80.min(reason.len())]
    );
}

/// Issue 55: a trainer of the run that scales its update up a hundredfold is not refused
/// but clipped at the close to `ratio` times the round's reference (the lower median of the
/// round's norms), then held to the round's centre (CenteredClip): the model moves as the
/// honest updates would move it, and a little more.
/// One a million times the model's norm is refused as it arrives. The norms taken go into
/// the checkpoint and come back with it. (Checked by leaving `limit_norm` out: the scaled
/// update moves the model a hundred times as far.)
#[test]
fn an_outlier_of_its_round_is_clipped_and_an_absurd_update_refused() {
    let mut server = ParameterServer::new(OuterOptimizer::new(0.5, 0.0)).limit_norm(3.0);
    assert!(server.offer(&bytes(&[10.0, 20.0])).unwrap());
    let (before, _) = model_of(&server);
    for (peer, update) in [("a", [1.0, 0.0]), ("b", [1.1, 0.0]), ("c", [0.9, 0.0])] {
        assert_eq!(
            server.add(peer, &bytes(&update), 0, 10).unwrap(),
            Taken::Added
        );
    }
    assert_eq!(
        server.add("liar", &bytes(&[100.0, 0.0]), 0, 10).unwrap(),
        Taken::Added
    );
    let closed = server.close().unwrap();
    assert_eq!(closed.included.len(), 4, "nobody refused: {closed:?}");
    assert_eq!(closed.clipped.len(), 1, "{closed:?}");
    assert_eq!(closed.clipped[0].peer, "liar");
    assert!(f64::from(closed.clipped[0].share) * 100.0 < 3.0);
    assert!((closed.largest_norm_ratio.unwrap() - 100.0).abs() < 1e-6);
    let (after, _) = model_of(&server);
    // The liar's 100 clipped to 3 (three times the lower median, 1), then the centre of 1,
    // 1.1, 0.9 and 3 with the radius 0.6 (the upper median of their distances from their
    // mean, 1.5): 1.2, where 3 − 3v + 0.6 = 0. The step is 0.5 of it; the plain mean of
    // the clipped updates would step 0.75, of the updates as sent 25.75.
    let moved = before[0] - after[0];
    assert!((moved - 0.5 * 1.2).abs() < 1e-3, "{before:?} -> {after:?}");

    // A million times the model: refused, named.
    let error = server
        .add("liar", &bytes(&[2.5e7, 0.0]), 1, 10)
        .unwrap_err();
    assert!(
        error.to_string().contains("times the model norm"),
        "{error}"
    );
    assert_eq!(server.refused()[0].0, "liar");

    // The checkpoint keeps the norms: the liar alone in a round of the resumed server (no
    // majority) is held to the typical norm of those taken (1, 1.1, 0.9, 3, 1, 1 → 1).
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("checkpoint.safetensors");
    server.add("a", &bytes(&[1.0, 0.0]), 1, 10).unwrap();
    server.add("b", &bytes(&[1.0, 0.0]), 1, 10).unwrap();
    server.close().unwrap();
    server.checkpoint(&path).unwrap();
    let mut resumed = ParameterServer::resume(&path, OuterOptimizer::new(0.5, 0.0))
        .unwrap()
        .limit_norm(3.0);
    resumed.add("liar", &bytes(&[50.0, 0.0]), 2, 10).unwrap();
    let closed = resumed.close().unwrap();
    assert!(
        (f64::from(closed.clipped[0].share) * 50.0 - 1.0).abs() < 1e-4,
        "{closed:?}"
    );
}

/// Issue 55: a trainer that flips the sign of its update every round is left out of the
/// round's mean for its agreement with the others (each round's cosine with the centre of
/// the rest), says why, and is remembered in the checkpoint. (Checked by weighing with
/// trust 1: the centre alone leaves the flipped update more than half of itself, in every
/// round, unreported.)
#[test]
fn a_trainer_pointing_against_the_others_is_left_out_and_remembered() {
    let mut rng = StdRng::seed_from_u64(5);
    let mut server = ParameterServer::new(OuterOptimizer::new(0.5, 0.0)).limit_norm(3.0);
    server.offer(&bytes(&[0.0; 64])).unwrap();
    let mut last = None;
    for round in 0..6 {
        let mut honest = |sign: f32| -> Vec<u8> {
            let values: Vec<f32> = (0..64)
                .map(|_| sign * (0.3 + rng.random_range(-1.0f32..1.0)))
                .collect();
            bytes(&values)
        };
        for peer in ["a", "b", "c"] {
            server.add(peer, &honest(1.0), round, 10).unwrap();
        }
        server.add("liar", &honest(-1.0), round, 10).unwrap();
        last = Some(server.close().unwrap());
    }
    let closed = last.unwrap();
    assert_eq!(closed.included.len(), 4, "nobody refused: {closed:?}");
    let liar: Vec<_> = closed.clipped.iter().filter(|c| c.peer == "liar").collect();
    assert_eq!(liar.len(), 1, "{closed:?}");
    assert!(liar[0].share < 0.01, "{closed:?}");
    assert!(liar[0].reason.contains("point away"), "{closed:?}");
    assert!(
        closed.clipped.iter().all(|c| c.peer == "liar"),
        "no honest trainer held back: {closed:?}"
    );

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("checkpoint.safetensors");
    server.checkpoint(&path).unwrap();
    let metadata = hypha_diloco::read_metadata(&mut std::fs::File::open(&path).unwrap()).unwrap();
    let agreement = &metadata["hypha.agreement"];
    let liar_mean: f64 = agreement
        .split(',')
        .find_map(|entry| entry.strip_prefix("liar="))
        .and_then(|rest| rest.split(['~', '@']).next())
        .and_then(|mean| mean.parse().ok())
        .unwrap_or_else(|| panic!("{agreement}"));
    assert!(liar_mean < 0.0, "{agreement}");
}

/// Issue 55, item 5: a round that holds a tenth of its planned samples steps a fifth as far
/// (a round of half its plan steps whole).
#[test]
fn a_tail_round_steps_by_the_share_of_the_planned_samples_it_holds() {
    let step = |samples: u64| {
        let mut server = ParameterServer::new(OuterOptimizer::new(1.0, 0.0)).plan_samples(100);
        server.offer(&bytes(&[0.0])).unwrap();
        server.add("a", &bytes(&[1.0]), 0, samples).unwrap();
        server.close().unwrap();
        -model_of(&server).0[0]
    };
    assert!((step(100) - 1.0).abs() < 1e-6);
    assert!((step(400) - 1.0).abs() < 1e-6, "a full round steps whole");
    assert!((step(50) - 1.0).abs() < 1e-6, "half the plan steps whole");
    assert!((step(10) - 0.2).abs() < 1e-6);
}

/// A model of `n` values, stored as BF16 as a trainer in bfloat16 would offer it.
fn bf16_model(n: usize, seed: u64) -> Vec<u8> {
    let mut rng = StdRng::seed_from_u64(seed);
    Tensors(BTreeMap::from([(
        "w".to_string(),
        Tensor {
            shape: vec![n],
            values: (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect(),
            dtype: Dtype::BF16,
        },
    )]))
    .to_bytes(&BTreeMap::new())
    .unwrap()
}

fn random_update(n: usize, rng: &mut StdRng) -> Vec<u8> {
    let values: Vec<f32> = (0..n)
        .map(|_| rng.random_range(-0.1f32..0.1) * rng.random_range(0.0f32..1.0).powi(2))
        .collect();
    bytes(&values)
}

fn held(bytes: &[u8]) -> Tensors {
    Tensors::from_bytes(bytes).unwrap()
}

fn distance(a: &Tensors, b: &Tensors) -> f64 {
    a.0["w"]
        .values
        .iter()
        .zip(&b.0["w"].values)
        .map(|(x, y)| f64::from(x - y).powi(2))
        .sum::<f64>()
        .sqrt()
}

/// Issue 21, item 2: a trainer that holds the round's model and applies each round's int8
/// change holds the server's global model bit for bit (the fingerprint says so, and the
/// values agree), and that model stays within what the codec drops of the model an
/// uncompressed server reaches with the same pseudo-gradients; a server restarted from its
/// checkpoint sends the very same changes (its residual came back).
#[test]
fn broadcast_changes_keep_every_holder_bit_identical_and_close_to_uncompressed() {
    broadcast_changes_hold(1000, 20);
}

/// The same with a parameter of more values than the server closes at once (it steps,
/// compresses and hashes a tensor a chunk at a time): the chunks make the same blocks.
#[test]
fn broadcast_changes_of_a_parameter_larger_than_a_close_chunk_hold_the_same() {
    broadcast_changes_hold(300_000, 10);
}

/// The same where the server closes a parameter in several windows of chunks on its
/// threads, writing and hashing each window while it closes the next: one thread (windows of
/// four chunks) and three.
#[test]
fn broadcast_changes_closed_window_by_window_on_any_number_of_threads_hold_the_same() {
    for threads in [1, 3] {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
            .install(|| broadcast_changes_hold(1_000_000, 10));
    }
}

#[allow(non_snake_case)]
fn broadcast_changes_hold(N: usize, rounds: u64) {
    let dir = tempfile::tempdir().unwrap();
    let checkpoint = dir.path().join("checkpoint.safetensors");
    let optimizer = || OuterOptimizer::new(0.7, 0.9);
    let mut exact = ParameterServer::new(optimizer());
    let mut server = ParameterServer::new(optimizer()).broadcast_changes(Codec::Int8);
    let initial = bf16_model(N, 1);
    exact.offer(&initial).unwrap();
    server.offer(&initial).unwrap();

    let full = server.model_bytes().unwrap();
    let mut trainer = held(&full);
    assert_eq!(
        hypha_diloco::metadata(&full).unwrap()[meta::MODEL_HASH],
        trainer.digest(),
        "the whole model carries its own fingerprint"
    );
    assert_eq!(trainer.0["w"].dtype, Dtype::F32, "sent as F32");
    let start = held(&exact.model_bytes().unwrap());

    let mut rng = StdRng::seed_from_u64(7);
    let mut restarted: Option<ParameterServer> = None;
    for round in 0..rounds {
        let updates: Vec<Vec<u8>> = (0..3).map(|_| random_update(N, &mut rng)).collect();
        let mut deltas = Vec::new();
        for s in [Some(&mut exact), Some(&mut server), restarted.as_mut()]
            .into_iter()
            .flatten()
        {
            for (i, update) in updates.iter().enumerate() {
                s.add(&format!("t{i}"), update, round, 10 + i as u64)
                    .unwrap();
            }
            deltas.push(s.close().unwrap().delta);
        }
        assert!(deltas[0].is_none(), "no changes without a codec");
        let delta = deltas[1].clone().unwrap();
        if let Some(Some(again)) = deltas.get(2) {
            // The same metadata and tensors (SafeTensors writes metadata in any order).
            let read = |bytes: &[u8]| {
                let metadata = hypha_diloco::metadata(bytes).unwrap();
                (metadata, Update::read(bytes).unwrap().to_tensors().unwrap())
            };
            assert!(
                read(again) == read(&delta),
                "round {round}: the restarted server's change differs"
            );
        }
        // A byte a value, a scale per 256, and a header with the fingerprints: under 40 % of
        // the f32 model's 4 bytes a value even at this small size.
        assert!(
            delta.len() * 10 < N * 4 * 4,
            "{} bytes for {N} values",
            delta.len()
        );
        let metadata = hypha_diloco::metadata(&delta).unwrap();
        assert_eq!(metadata[meta::KIND], meta::KIND_MODEL_DELTA);
        assert_eq!(metadata[meta::ROUND], (round + 1).to_string());
        assert_eq!(metadata[meta::BASE_ROUND], round.to_string());
        assert_eq!(metadata[meta::BASE_HASH], trainer.digest());
        Update::read(&delta).unwrap().add_to(&mut trainer).unwrap();
        assert_eq!(trainer.digest(), metadata[meta::MODEL_HASH]);
        assert_eq!(Some(trainer.digest().as_str()), server.model_hash());
        assert_eq!(
            trainer.0["w"].values,
            held(&server.model_bytes().unwrap()).0["w"].values
        );
        if round == rounds / 2 {
            server.checkpoint(&checkpoint).unwrap();
            restarted = Some(
                ParameterServer::resume(&checkpoint, optimizer())
                    .unwrap()
                    .broadcast_changes(Codec::Int8),
            );
        }
    }
    let uncompressed = held(&exact.model_bytes().unwrap());
    let travelled = distance(&uncompressed, &start);
    let apart = distance(&uncompressed, &trainer);
    assert!(
        apart < 0.01 * travelled,
        "the compressed global model is {apart} from the uncompressed one, which moved {travelled}"
    );
    assert!(apart > 0.0, "int8 drops something");

    // A change that does not fit the model is refused and leaves it as it was.
    let before = trainer.clone();
    let other = Tensors(BTreeMap::from([(
        "w".to_string(),
        Tensor {
            shape: vec![N + 1],
            values: vec![0.0; N + 1],
            dtype: Dtype::F32,
        },
    )]));
    let wrong = codec::encode(&other, Codec::Int8, &BTreeMap::new()).unwrap();
    assert!(Update::read(&wrong).unwrap().add_to(&mut trainer).is_err());
    assert_eq!(trainer, before);
}

/// A round whose trainers all take whole models makes no change: the compressing server's
/// model is then the uncompressed server's, bit for bit.
#[test]
fn a_round_without_takers_of_changes_steps_the_model_exactly() {
    let optimizer = || OuterOptimizer::new(0.7, 0.9);
    let mut exact = ParameterServer::new(optimizer());
    let mut server = ParameterServer::new(optimizer()).broadcast_changes(Codec::Int8);
    let initial = bytes(&[0.25, -1.0, 3.0]);
    exact.offer(&initial).unwrap();
    server.offer(&initial).unwrap();
    for s in [&mut exact, &mut server] {
        s.add("a", &bytes(&[0.1, 0.2, -0.3]), 0, 8).unwrap();
    }
    exact.close().unwrap();
    let closed = server.close_without_change().unwrap();
    assert!(closed.delta.is_none());
    assert_eq!(model_of(&server), model_of(&exact));
    assert_eq!(
        hypha_diloco::metadata(&server.model_bytes().unwrap()).unwrap()[meta::MODEL_HASH],
        held(&exact.model_bytes().unwrap()).digest()
    );
}

/// Issue 36, item 3: a standby that builds each round's model from the server's changes, as
/// trainers do, takes over with the server's global model bit for bit, at its round, and
/// with the momentum of the last checkpoint it was given; with a checkpoint of its own round
/// it is the server as that checkpoint left it, and closes the next round as the server does.
#[test]
fn a_standby_built_from_the_changes_takes_over_with_the_model_and_the_checkpoints_momentum() {
    const N: usize = 5000;
    let dir = tempfile::tempdir().unwrap();
    let path = |name: &str| dir.path().join(name);
    let optimizer = || OuterOptimizer::new(0.7, 0.9);
    let mut server = ParameterServer::new(optimizer()).broadcast_changes(Codec::Int8);
    server.offer(&bf16_model(N, 3)).unwrap();
    std::fs::write(path("standby.safetensors"), server.model_bytes().unwrap()).unwrap();
    let mut rng = StdRng::seed_from_u64(11);
    let close = |server: &mut ParameterServer, rng: &mut StdRng| {
        let round = server.round().unwrap();
        for i in 0..2 {
            let update = random_update(N, rng);
            server.add(&format!("t{i}"), &update, round, 10).unwrap();
        }
        server.close().unwrap().delta.unwrap()
    };
    for round in 0..4u64 {
        let delta = close(&mut server, &mut rng);
        let metadata = hypha_diloco::metadata(&delta).unwrap();
        let held = hypha_diloco::file::FileSource::open(&path("standby.safetensors")).unwrap();
        let built = Update::read(&delta)
            .unwrap()
            .add_to_file(
                &held,
                &path("next.safetensors"),
                BTreeMap::from([(meta::ROUND.to_string(), (round + 1).to_string())]),
            )
            .unwrap();
        assert_eq!(built, metadata[meta::MODEL_HASH]);
        std::fs::rename(path("next.safetensors"), path("standby.safetensors")).unwrap();
        if round == 1 {
            server.checkpoint(&path("old.safetensors")).unwrap();
        }
    }
    let momentum = |file: &str| Tensors::load(&path(file)).unwrap().0.remove("momentum/w");

    let taken = ParameterServer::take_over(
        &path("standby.safetensors"),
        Some(&path("old.safetensors")),
        optimizer(),
    )
    .unwrap();
    assert_eq!(taken.round(), Some(4));
    assert_eq!(taken.model_hash(), server.model_hash());
    taken.checkpoint(&path("taken.safetensors")).unwrap();
    assert!(momentum("old.safetensors").is_some());
    assert_eq!(momentum("taken.safetensors"), momentum("old.safetensors"));
    let residual = Tensors::load(&path("taken.safetensors")).unwrap();
    assert!(!residual.0.contains_key("residual/w"), "nothing carried");

    let fresh =
        ParameterServer::take_over(&path("standby.safetensors"), None, optimizer()).unwrap();
    assert_eq!(fresh.model_hash(), server.model_hash());
    fresh.checkpoint(&path("fresh.safetensors")).unwrap();
    assert_eq!(
        momentum("fresh.safetensors"),
        None,
        "no momentum without a checkpoint"
    );

    server.checkpoint(&path("now.safetensors")).unwrap();
    let mut current = ParameterServer::take_over(
        &path("standby.safetensors"),
        Some(&path("now.safetensors")),
        optimizer(),
    )
    .unwrap()
    .broadcast_changes(Codec::Int8);
    let mut again = rng.clone();
    // The same metadata and tensors (SafeTensors writes metadata in any order).
    let read = |bytes: &[u8]| {
        let metadata = hypha_diloco::metadata(bytes).unwrap();
        (metadata, Update::read(bytes).unwrap().to_tensors().unwrap())
    };
    let expected = read(&close(&mut server, &mut rng));
    assert!(read(&close(&mut current, &mut again)) == expected);
    assert_eq!(current.model_hash(), server.model_hash());
}

/// The parameters of the quickstart's MLP (16 inputs, 64 hidden, 4 classes) as one tensor
/// each, from `values` in order (the names sort in it).
fn mlp(values: &[f32]) -> Tensors {
    let mut rest = values;
    Tensors(
        [
            ("0.weight", 1024),
            ("1.bias", 64),
            ("2.weight", 256),
            ("3.bias", 4),
        ]
        .into_iter()
        .map(|(name, size)| {
            let (these, after) = rest.split_at(size);
            rest = after;
            let tensor = Tensor {
                shape: vec![size],
                values: these.to_vec(),
                dtype: Dtype::F32,
            };
            (name.to_string(), tensor)
        })
        .collect(),
    )
}

/// Three honest trainers of a noisy quadratic over the quickstart MLP's parameters, each ten
/// steps of SGD from the global model a round, send their pseudo-gradients through `codec`
/// with its error feedback; with `liar`, a fourth flips the sign of its own. Returns, of each
/// round, who was held back for their agreement.
fn judged_by_agreement(codec: Codec, rounds: u64, liar: bool) -> Vec<Vec<String>> {
    const N: usize = 1024 + 64 + 256 + 4;
    let mut rng = StdRng::seed_from_u64(11);
    let target: Vec<f32> = (0..N).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let (lr, momentum) = match codec {
        Codec::Sparse { .. } => hypha_diloco::codec::SPARSE_OUTER,
        _ => (0.7, 0.9),
    };
    let mut server = ParameterServer::new(OuterOptimizer::new(lr, momentum)).limit_norm(3.0);
    let no_metadata = hypha_diloco::Metadata::new();
    server
        .offer(&mlp(&[0.0; N]).to_bytes(&no_metadata).unwrap())
        .unwrap();
    let peers = if liar {
        &["a", "b", "c", "liar"][..]
    } else {
        &["a", "b", "c"][..]
    };
    let mut feedback: Vec<_> = (peers.iter())
        .map(|_| hypha_diloco::ErrorFeedback::for_codec(codec))
        .collect();
    let mut held_back = Vec::new();
    for round in 0..rounds {
        let model = Tensors::from_bytes(&server.model_bytes().unwrap()).unwrap();
        let start: Vec<f32> = model.0.values().flat_map(|t| t.values.clone()).collect();
        for (peer, feedback) in peers.iter().zip(&mut feedback) {
            let mut theta = start.clone();
            for _ in 0..10 {
                for (t, goal) in theta.iter_mut().zip(&target) {
                    let gradient = *t - goal + rng.random_range(-1.0f32..1.0);
                    *t -= 0.05 * gradient;
                }
            }
            let sign = if *peer == "liar" { -1.0 } else { 1.0 };
            let update: Vec<f32> = (start.iter().zip(&theta))
                .map(|(s, t)| sign * (s - t))
                .collect();
            let sent = feedback
                .compress(&mlp(&update), codec, &no_metadata)
                .unwrap();
            server.add(peer, &sent, round, 32).unwrap();
        }
        let closed = server.close().unwrap();
        assert_eq!(closed.included.len(), peers.len(), "{closed:?}");
        held_back.push(
            (closed.clipped.iter())
                .filter(|clip| clip.reason.contains("point away"))
                .map(|clip| clip.peer.clone())
                .collect(),
        );
    }
    held_back
}

/// The sparse updates of honest trainers share few of their values, and each one's residual
/// sends late what the others sent on time: their cosines with the others' centre are mostly
/// nothing, sometimes negative, and positive only on average over many rounds. From the
/// first round to far past the loss's floor, where the updates are noise, none is held back
/// for its agreement (before the spread of each trainer's cosines over rounds counted, one
/// was in round 375; a run of `hypha quickstart --compression sparse --rounds 4000` gave
/// honest trainers no weight in 209 rounds), while a flipped sign still is.
#[test]
fn honest_sparse_trainers_keep_their_weight_through_a_long_run() {
    let sparse = Codec::try_from(hypha_messages::diloco::Compression::Sparse {
        sparse_density: None,
        sparse_bits: None,
        sparse_decay: None,
    })
    .unwrap();
    for codec in [sparse, Codec::None] {
        let held_back = judged_by_agreement(codec, 1000, false);
        let rounds: Vec<_> = (held_back.iter().enumerate())
            .filter(|(_, peers)| !peers.is_empty())
            .collect();
        assert!(rounds.is_empty(), "{}: {rounds:?}", codec.name());
    }
    // The same runs with a flipped sign: it is held back from its first rounds on (sparse:
    // 297 rounds of 300), and nobody else is.
    for codec in [sparse, Codec::None] {
        let held_back = judged_by_agreement(codec, 300, true);
        let liar = held_back.iter().filter(|peers| *peers == &["liar"]).count();
        assert!(
            liar >= 280,
            "{}: held back in {liar} rounds of 300",
            codec.name()
        );
        assert!(held_back.iter().flatten().all(|peer| peer == "liar"));
    }
}
