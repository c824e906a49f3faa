//! The parameter server's rounds: adopting the first model, taking each round's
//! pseudo-gradients once, dropping late ones, and resuming from a checkpoint exactly where it
//! stopped.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::collections::BTreeMap;

use hypha_diloco::{
    OuterOptimizer, Tensor, Tensors,
    server::{ParameterServer, Taken, round_of},
};
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
