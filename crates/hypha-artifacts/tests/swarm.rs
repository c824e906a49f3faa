//! Several nodes fetching the same artifacts: each byte leaves the origin once, bad peers are
//! routed around, and a changed origin never yields a mixed file.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

mod common;

use std::time::Duration;

use common::*;
use hypha_artifacts::{Distributor, testing::S3Server};

async fn nodes(
    pki: &Pki,
    gateway: &libp2p::Multiaddr,
    s3: &S3Server,
    dir: &std::path::Path,
    count: usize,
    chunk: u64,
) -> Vec<Distributor> {
    let mut nodes = Vec::new();
    for i in 0..count {
        nodes.push(node(pki, &format!("n{i}"), gateway, s3, dir, settings(chunk)).await);
    }
    nodes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn six_nodes_get_exact_files_while_the_origin_serves_each_byte_once() {
    let dir = tempfile::tempdir().unwrap();
    // Throttled so that sharing matters: 4 MiB/s.
    let s3 = S3Server::start(&dir.path().join("s3"), Some(4 * 1024 * 1024))
        .await
        .unwrap();
    let model = pattern(24 * 64 * 1024 + 777, 7);
    s3.put("m/model.bin", model.clone()).await.unwrap();
    let small: Vec<(String, Vec<u8>)> = (0..6)
        .map(|i| {
            (
                format!("tok/f{i}.json"),
                pattern(3000 + i * 7, 20 + i as u64),
            )
        })
        .collect();
    for (key, bytes) in &small {
        s3.put(key, bytes.clone()).await.unwrap();
    }
    let artifact_size = model.len() + small.iter().map(|(_, b)| b.len()).sum::<usize>();

    let pki = Pki::new();
    let (_gateway, gateway_addr) = pki.gateway().await;
    let nodes = nodes(&pki, &gateway_addr, &s3, dir.path(), 6, 64 * 1024).await;
    let fetches = nodes.iter().enumerate().map(|(i, node)| {
        let out = dir.path().join(format!("out{i}"));
        async move {
            let a = fetch(node, &object("m/model.bin", &out.join("model.bin")), 6).await;
            let b = fetch(node, &prefix("tok", &out.join("tok")), 6).await;
            (a, b)
        }
    });
    let results = futures::future::join_all(fetches).await;
    for i in 0..nodes.len() {
        let out = dir.path().join(format!("out{i}"));
        assert_eq!(
            std::fs::read(out.join("model.bin")).unwrap(),
            model,
            "node {i}"
        );
        for (key, bytes) in &small {
            assert_eq!(
                &std::fs::read(out.join(key)).unwrap(),
                bytes,
                "node {i}: {key}"
            );
        }
    }
    assert_eq!(
        s3.bytes_served(),
        artifact_size as u64,
        "origin egress is 1.00x the artifacts"
    );
    let from_peers: u64 = results.iter().map(|(a, _)| a.progress.peer_bytes).sum();
    assert_eq!(from_peers, 5 * model.len() as u64);
    let pulled: Vec<u32> = results
        .iter()
        .map(|(a, _)| a.progress.origin_chunks)
        .collect();
    assert!(
        pulled.iter().all(|&n| n >= 3),
        "origin work is spread: {pulled:?}"
    );
    for node in &nodes {
        assert!(node.settle(Duration::from_secs(10)).await);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_serving_corrupted_bytes_is_banned_and_routed_around() {
    let dir = tempfile::tempdir().unwrap();
    let s3 = S3Server::start(&dir.path().join("s3"), None).await.unwrap();
    let model = pattern(8 * 64 * 1024, 9);
    s3.put("m.bin", model.clone()).await.unwrap();
    let pki = Pki::new();
    let (_gateway, gateway_addr) = pki.gateway().await;
    let nodes = nodes(&pki, &gateway_addr, &s3, dir.path(), 2, 64 * 1024).await;

    let first_target = dir.path().join("first/m.bin");
    fetch(&nodes[0], &object("m.bin", &first_target), 1).await;
    // Its disk rots after it verified the chunks: it now serves bytes that no longer match.
    {
        use std::os::unix::fs::FileExt;
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(&first_target)
            .unwrap();
        for chunk in 0..8u64 {
            file.write_all_at(b"rot", chunk * 64 * 1024 + 100).unwrap();
        }
    }
    let second_target = dir.path().join("second/m.bin");
    let fetched = fetch(&nodes[1], &object("m.bin", &second_target), 2).await;
    assert_eq!(std::fs::read(&second_target).unwrap(), model);
    assert_eq!(fetched.progress.peer_chunks, 0);
    assert_eq!(
        fetched.progress.origin_chunks, 8,
        "every chunk came from the origin after the ban"
    );
    assert!(
        fetched.progress.peers.iter().all(|p| p.banned),
        "{:?}",
        fetched.progress.peers
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_object_replaced_mid_way_never_yields_a_mixed_file() {
    let dir = tempfile::tempdir().unwrap();
    let s3 = S3Server::start(&dir.path().join("s3"), Some(1024 * 1024))
        .await
        .unwrap();
    let v1 = pattern(32 * 64 * 1024, 1);
    let v2 = pattern(32 * 64 * 1024, 2);
    s3.put("m.bin", v1.clone()).await.unwrap();
    let pki = Pki::new();
    let (_gateway, gateway_addr) = pki.gateway().await;
    let nodes = nodes(&pki, &gateway_addr, &s3, dir.path(), 3, 64 * 1024).await;
    let fetches = nodes.iter().enumerate().map(|(i, node)| {
        let target = dir.path().join(format!("out{i}/m.bin"));
        async move {
            (
                node.fetch(
                    &object("m.bin", &target),
                    &hypha_artifacts::FetchOptions {
                        expect: 3,
                        progress: None,
                    },
                )
                .await,
                target,
            )
        }
    });
    let replace = async {
        tokio::time::sleep(Duration::from_millis(700)).await;
        s3.put("m.bin", v2.clone()).await.unwrap();
    };
    let (results, ()) = tokio::join!(futures::future::join_all(fetches), replace);
    // Two seconds of transfer, replaced after 0.7: every node notices, starts again on the
    // new version, and ends with it whole.
    for (result, target) in results {
        result.unwrap();
        assert!(
            std::fs::read(&target).unwrap() == v2,
            "{} is not the new version",
            target.display()
        );
    }
    assert!(s3.bytes_served() >= v2.len() as u64);
}
