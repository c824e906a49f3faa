//! A file one node publishes, fetched by several at once: the publisher is their origin and
//! sends each byte once, the fetchers pass chunks on to each other.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

mod common;

use common::*;
use hypha_artifacts::{Admission, FetchError, FetchOptions};
use hypha_testing::s3::S3Server;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_fetch_a_published_file_that_leaves_its_publisher_once() {
    let dir = tempfile::tempdir().unwrap();
    let s3 = S3Server::start(&dir.path().join("s3"), None).await.unwrap();
    let pki = Pki::new();
    let (_gateway, gateway_addr) = pki.gateway().await;
    let mut nodes = Vec::new();
    for name in ["publisher", "a", "b", "c", "outsider"] {
        nodes.push(
            node(
                &pki,
                name,
                &gateway_addr,
                &s3,
                dir.path(),
                settings(64 * 1024),
            )
            .await,
        );
    }
    let (publisher, fetchers, outsider) = (&nodes[0], &nodes[1..4], &nodes[4]);
    let model = pattern(24 * 64 * 1024 + 777, 11);
    let path = dir.path().join("round-3.safetensors");
    std::fs::write(&path, &model).unwrap();
    let admitted: Vec<_> = fetchers
        .iter()
        .map(|n| n.network().local_peer_id())
        .collect();
    let published = publisher
        .publish(&path, Admission::new(move |peer| admitted.contains(peer)))
        .unwrap();
    assert_eq!(published.size, model.len() as u64);

    let fetches = fetchers.iter().enumerate().map(|(i, node)| {
        let destination = dir.path().join(format!("out{i}/model.safetensors"));
        let published = published.clone();
        async move {
            let options = FetchOptions {
                expect: 3,
                ..FetchOptions::default()
            };
            node.fetch_published(&published, &destination, &options)
                .await
                .unwrap()
        }
    });
    let fetched = futures::future::join_all(fetches).await;
    for (i, fetched) in fetched.iter().enumerate() {
        assert_eq!(std::fs::read(&fetched.files[0]).unwrap(), model, "node {i}");
    }
    assert_eq!(
        publisher.published_bytes(),
        model.len() as u64,
        "the publisher sends the file once, whatever the number of fetchers"
    );
    let from_peers: u64 = fetched.iter().map(|f| f.progress.peer_bytes).sum();
    assert_eq!(from_peers, 2 * model.len() as u64);

    // A peer the publication does not admit gets nothing; nor does anyone once it is withdrawn.
    let refused = outsider
        .fetch_published(
            &published,
            &dir.path().join("outsider.bin"),
            &FetchOptions::default(),
        )
        .await;
    assert!(
        matches!(&refused, Err(FetchError::Origin(e)) if e.to_string().contains("not published to you")),
        "{refused:?}"
    );
    publisher.unpublish(&published);
    let gone = fetchers[0]
        .fetch_published(
            &published,
            &dir.path().join("again.bin"),
            &FetchOptions::default(),
        )
        .await;
    assert!(gone.is_err(), "{gone:?}");
    assert_eq!(publisher.published_bytes(), model.len() as u64);
}
