//! Several nodes fetching the same artifacts: each byte leaves the origin once, bad peers are
//! routed around, and a changed origin never yields a mixed file.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

mod common;

use std::time::Duration;

use common::*;
use hypha_artifacts::{Distributor, Fetched, Settings};
use hypha_testing::s3::S3Server;

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

/// Three nodes hold an artifact; a fourth that asks for it later takes from them every chunk
/// but those that are its own turn to read (it checks those against the origin, as every
/// owner does): it cannot know whose turn each chunk was when it was read, but two members
/// holding a chunk with the same hash cannot both be lying. (Checked by taking only in-turn
/// claims: the newcomer reads most chunks from the origin.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newcomer_takes_what_members_hold_but_its_own_turns() {
    let dir = tempfile::tempdir().unwrap();
    let s3 = S3Server::start(&dir.path().join("s3"), None).await.unwrap();
    let model = pattern(16 * 64 * 1024, 5);
    s3.put("m.bin", model.clone()).await.unwrap();
    let pki = Pki::new();
    let (_gateway, gateway_addr) = pki.gateway().await;
    let mut nodes = nodes(&pki, &gateway_addr, &s3, dir.path(), 3, 64 * 1024).await;
    let first = futures::future::join_all(nodes.iter().enumerate().map(|(i, node)| {
        let target = dir.path().join(format!("out{i}/m.bin"));
        async move { fetch(node, &object("m.bin", &target), 3).await }
    }))
    .await;
    let first_reads: u32 = first.iter().map(|f| f.progress.origin_chunks).sum();
    assert_eq!(first_reads, 16);

    nodes.push(
        node(
            &pki,
            "late",
            &gateway_addr,
            &s3,
            dir.path(),
            settings(64 * 1024),
        )
        .await,
    );
    let target = dir.path().join("late/m.bin");
    let late = fetch(&nodes[3], &object("m.bin", &target), 4).await;
    assert_eq!(std::fs::read(&target).unwrap(), model);
    // 16 chunks in turns over 4 members.
    assert!(
        late.progress.origin_chunks <= 4,
        "the newcomer read {} chunks from the origin that three members held",
        late.progress.origin_chunks
    );
}

/// A member that announces the origin's true hashes for its turns and serves other bytes
/// under them is banned by the members it served, and every member ends with the origin's
/// bytes (those it did not serve may have taken its turns from the others first).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_serving_other_bytes_than_it_announced_is_banned_and_routed_around() {
    let (fetched, liar) = fetch_beside_a_rogue(
        Rogue::ServesOtherBytes { members: 4 },
        Start::WithAllMembers,
        0.0,
    )
    .await;
    let served: Vec<_> = fetched
        .iter()
        .filter_map(|f| f.progress.peers.iter().find(|p| p.peer == liar))
        .collect();
    assert!(
        served.iter().any(|p| p.banned),
        "nobody banned the liar: {served:?}"
    );
}

/// A node whose files changed on disk after it verified them (a disk that rots, a process of
/// its user that wrote into them) hands out none of the changed chunks whole: a transfer ends
/// short and the chunk is served no more. Its own next fetch finds the damage and repairs it.
/// (Checked by serving without the hash check: all 8 chunks are uploaded.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_files_rotted_serves_none_of_them_and_repairs_them() {
    let dir = tempfile::tempdir().unwrap();
    let s3 = S3Server::start(&dir.path().join("s3"), None).await.unwrap();
    let model = pattern(8 * 64 * 1024, 9);
    s3.put("m.bin", model.clone()).await.unwrap();
    let pki = Pki::new();
    let (_gateway, gateway_addr) = pki.gateway().await;
    let nodes = nodes(&pki, &gateway_addr, &s3, dir.path(), 2, 64 * 1024).await;

    let first_target = dir.path().join("first/m.bin");
    let first = fetch(&nodes[0], &object("m.bin", &first_target), 1).await;
    rot(&first_target, &[0, 1, 2, 3, 4, 5, 6, 7], 64 * 1024);
    let second_target = dir.path().join("second/m.bin");
    let fetched = fetch(&nodes[1], &object("m.bin", &second_target), 2).await;
    assert!(std::fs::read(&second_target).unwrap() == model);
    assert_eq!(fetched.progress.peer_chunks, 0);
    assert_eq!(
        fetched.progress.origin_chunks, 8,
        "every chunk came from the origin"
    );
    let uploaded = nodes[0]
        .progress(first.artifact)
        .unwrap()
        .borrow()
        .uploaded_chunks;
    assert_eq!(uploaded, 0, "a changed chunk was handed out whole");

    let repaired = fetch(&nodes[0], &object("m.bin", &first_target), 1).await;
    assert!(
        !repaired.from_cache,
        "the damaged files are not a cache hit"
    );
    assert!(std::fs::read(&first_target).unwrap() == model);
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
                        admission: None,
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

/// What a [`rogue`] member does.
#[derive(Clone, Copy)]
enum Rogue {
    /// Announces that it read every chunk from the origin, with the hashes of bytes of its
    /// own, to each member the moment it finds it, and serves those bytes.
    LiesAboutEverything,
    /// The same, but only for the chunks that are its own to read, once it knows all
    /// `members` (itself included): the lies only an audit can find.
    LiesAboutItsOwn { members: usize },
    /// Announces the origin's true hashes of the chunks that are its own to read, once it
    /// knows all `members`, and answers `busy` to every request for them.
    HoldsBackItsOwn { members: usize },
    /// Joins every member's swarm and then says and reads nothing.
    Silent,
    /// Announces the origin's true hashes of the chunks that are its own to read, once it
    /// knows all `members`, and serves other bytes under them.
    ServesOtherBytes { members: usize },
}

/// A certified member of `request`'s swarm that behaves as `rogue` says; `truth` is the
/// object's real bytes. Returns its network (its peer id is what the others should ban).
async fn rogue(
    pki: &Pki,
    gateway: &libp2p::Multiaddr,
    s3: &S3Server,
    request: &hypha_artifacts::Request,
    truth: &[u8],
    chunk_size: u64,
    rogue: Rogue,
) -> hypha_network::Network {
    use futures::{AsyncWriteExt, StreamExt};
    use hypha_artifacts::{
        Manifest,
        protocol::{
            CHUNK_PROTOCOL, ChunkErrorCode, ChunkHeader, ChunkRequest, HelloReply, SWARM_PROTOCOL,
            SwarmMessage, provider_key, read_frame, write_frame,
        },
    };
    use std::sync::Arc;

    let network = pki.start("rogue", Some(gateway)).await;
    let origin = origins(s3).get("default").unwrap();
    let manifest = Manifest::new(
        origin.url(),
        chunk_size,
        origin.resolve(request).await.unwrap(),
    );
    // What it says it holds, and serves.
    let claimed: Arc<Vec<Vec<u8>>> = Arc::new(
        manifest
            .chunks()
            .iter()
            .enumerate()
            .map(|(i, c)| match rogue {
                Rogue::HoldsBackItsOwn { .. } => {
                    truth[c.offset as usize..(c.offset + c.len) as usize].to_vec()
                }
                _ => pattern(c.len as usize, 1000 + i as u64),
            })
            .collect(),
    );
    // The hashes it announces for them.
    let announced: Vec<[u8; 32]> = manifest
        .chunks()
        .iter()
        .zip(claimed.iter())
        .map(|(span, bytes)| match rogue {
            Rogue::ServesOtherBytes { .. } => {
                *blake3::hash(&truth[span.offset as usize..][..span.len as usize]).as_bytes()
            }
            _ => *blake3::hash(bytes).as_bytes(),
        })
        .collect();
    let key = provider_key(manifest.id);
    network.start_providing(&key).await.unwrap();

    let mut hellos = network.accept_streams(SWARM_PROTOCOL).unwrap();
    tokio::spawn(async move {
        while let Some((_, mut stream)) = hellos.next().await {
            tokio::spawn(async move {
                let _ = read_frame::<SwarmMessage>(&mut stream).await;
                let _ = write_frame(&mut stream, &HelloReply::Welcome).await;
                while read_frame::<SwarmMessage>(&mut stream).await.is_ok() {}
            });
        }
    });
    let mut requests = network.accept_streams(CHUNK_PROTOCOL).unwrap();
    let served = claimed.clone();
    tokio::spawn(async move {
        while let Some((_, mut stream)) = requests.next().await {
            let claimed = served.clone();
            tokio::spawn(async move {
                let Ok(request) = read_frame::<ChunkRequest>(&mut stream).await else {
                    return;
                };
                if let Rogue::HoldsBackItsOwn { .. } = rogue {
                    let busy = ChunkHeader::Error {
                        code: ChunkErrorCode::Busy,
                        message: "busy".into(),
                    };
                    let _ = write_frame(&mut stream, &busy).await;
                    return;
                }
                let Some(bytes) = claimed.get(request.chunk as usize) else {
                    return;
                };
                let size = bytes.len() as u64;
                let _ = write_frame(&mut stream, &ChunkHeader::Ok { size }).await;
                let _ = stream.write_all(bytes).await;
                let _ = stream.close().await;
            });
        }
    });
    let announcer = network.clone();
    let artifact = manifest.id;
    tokio::spawn(async move {
        let mut told = std::collections::HashSet::new();
        let mut streams = Vec::new();
        let me = announcer.local_peer_id();
        loop {
            let found = announcer.get_providers(&key).await.unwrap_or_default();
            // The swarm's order of turns: chunk c is members[(c + k) % n] over the sorted
            // members, k the artifact id's first byte.
            let mut members: Vec<_> = found.iter().copied().chain([me]).collect();
            members.sort();
            members.dedup();
            let announce = |chunk: usize| match rogue {
                Rogue::LiesAboutEverything => true,
                Rogue::LiesAboutItsOwn { .. }
                | Rogue::HoldsBackItsOwn { .. }
                | Rogue::ServesOtherBytes { .. } => {
                    members[(chunk + artifact.0[0] as usize) % members.len()] == me
                }
                Rogue::Silent => false,
            };
            if let Rogue::LiesAboutItsOwn { members: all }
            | Rogue::HoldsBackItsOwn { members: all }
            | Rogue::ServesOtherBytes { members: all } = rogue
                && members.len() < all
            {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            for peer in found {
                if peer == announcer.local_peer_id() || told.contains(&peer) {
                    continue;
                }
                let Ok(mut stream) = announcer.open_stream(peer, SWARM_PROTOCOL).await else {
                    continue;
                };
                if write_frame(&mut stream, &SwarmMessage::Hello { artifact })
                    .await
                    .is_err()
                    || read_frame::<HelloReply>(&mut stream).await.ok() != Some(HelloReply::Welcome)
                {
                    continue;
                }
                for chunk in (0..claimed.len()).filter(|c| announce(*c)) {
                    let have = SwarmMessage::Have {
                        chunk: chunk as u32,
                        blake3: announced[chunk],
                        from_origin: true,
                    };
                    let _ = write_frame(&mut stream, &have).await;
                }
                // What a member says on joining ends with its load.
                let _ = write_frame(&mut stream, &SwarmMessage::Load { uploads: 0 }).await;
                told.insert(peer);
                streams.push(stream);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    network
}

/// When the honest nodes of [`fetch_beside_a_rogue`] begin.
#[derive(Clone, Copy)]
enum Start {
    /// After a second, waiting for a fifth member that never comes: by then the rogue's
    /// claims are in everywhere.
    AfterTheRogueSpoke,
    /// As soon as all four members know each other.
    WithAllMembers,
}

/// Three honest nodes and a rogue member fetch a 16-chunk object. Checks that every honest
/// node ends with the origin's bytes within a minute; returns what each fetched, and the
/// rogue's peer id.
async fn fetch_beside_a_rogue(
    behaviour: Rogue,
    start: Start,
    origin_audit: f64,
) -> (Vec<Fetched>, libp2p::PeerId) {
    let (expect, join_timeout) = match start {
        Start::AfterTheRogueSpoke => (5, Duration::from_secs(1)),
        Start::WithAllMembers => (4, Duration::from_secs(60)),
    };
    let dir = tempfile::tempdir().unwrap();
    let s3 = S3Server::start(&dir.path().join("s3"), Some(4 * 1024 * 1024))
        .await
        .unwrap();
    let model = pattern(16 * 64 * 1024, 11);
    s3.put("m.bin", model.clone()).await.unwrap();
    let pki = Pki::new();
    let (_gateway, gateway_addr) = pki.gateway().await;
    let request = object("m.bin", &dir.path().join("unused"));
    let rogue = rogue(
        &pki,
        &gateway_addr,
        &s3,
        &request,
        &model,
        64 * 1024,
        behaviour,
    )
    .await;
    let mut honest = Vec::new();
    for i in 0..3 {
        let settings = Settings {
            join_timeout,
            origin_audit,
            stall_patience: Duration::from_secs(2),
            ..settings(64 * 1024)
        };
        let name = format!("n{i}");
        honest.push(node(&pki, &name, &gateway_addr, &s3, dir.path(), settings).await);
    }
    let fetches = honest.iter().enumerate().map(|(i, node)| {
        let target = dir.path().join(format!("out{i}/m.bin"));
        async move {
            let request = object("m.bin", &target);
            let fetched =
                tokio::time::timeout(Duration::from_secs(60), fetch(node, &request, expect))
                    .await
                    .unwrap_or_else(|_| panic!("node {i} was held up for a minute"));
            (fetched, target)
        }
    });
    let mut fetched = Vec::new();
    for (i, (result, target)) in futures::future::join_all(fetches)
        .await
        .into_iter()
        .enumerate()
    {
        assert!(
            std::fs::read(target).unwrap() == model,
            "node {i} ended with bytes the origin never had"
        );
        fetched.push(result);
    }
    (fetched, rogue.local_peer_id())
}

/// (Checked by taking any single member's word, and by keeping chunks a banned member vouched
/// for: the files differ from the origin's.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_announcing_false_hashes_first_is_found_out_and_the_others_get_the_origins_bytes()
{
    let (fetched, liar) =
        fetch_beside_a_rogue(Rogue::LiesAboutEverything, Start::AfterTheRogueSpoke, 0.0).await;
    for (i, fetched) in fetched.iter().enumerate() {
        let mut liar_seen = false;
        for peer in &fetched.progress.peers {
            if peer.peer == liar {
                liar_seen = true;
                assert!(peer.banned, "node {i} did not ban the liar");
            } else {
                assert!(!peer.banned, "node {i} banned an honest member");
            }
        }
        assert!(liar_seen, "node {i} never heard from the liar");
    }
}

/// A member lying only about the chunks that are its own to read is believed unless someone
/// reads them too: with `origin_audit = 1` every honest member does, and finds it out. (Checked
/// by ignoring the audit share: the files differ from the origin's.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_audit_finds_out_a_member_that_lies_only_about_its_own_chunks() {
    let lies = Rogue::LiesAboutItsOwn { members: 4 };
    let (fetched, liar) = fetch_beside_a_rogue(lies, Start::AfterTheRogueSpoke, 1.0).await;
    for (i, fetched) in fetched.iter().enumerate() {
        let seen = fetched.progress.peers.iter().find(|p| p.peer == liar);
        assert!(seen.is_some_and(|p| p.banned), "node {i}: {seen:?}");
    }
}

/// The chunks a rogue member announced and never sends, and the ones it never reads, are
/// read from the origin by the next member in turn after `stall_patience`, once each.
/// (Checked by ignoring the patience: the fetches are held up for good.)
async fn the_others_go_on_beside(behaviour: Rogue) {
    let (fetched, _) = fetch_beside_a_rogue(behaviour, Start::WithAllMembers, 0.0).await;
    let from_origin: u32 = fetched.iter().map(|f| f.progress.origin_chunks).sum();
    assert_eq!(from_origin, 16, "each chunk leaves the origin once");
    for (i, fetched) in fetched.iter().enumerate() {
        assert!(
            fetched.progress.peers.iter().all(|p| !p.banned),
            "node {i} banned a member nobody caught lying: {:?}",
            fetched.progress.peers
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_that_never_sends_the_chunks_it_read_holds_nobody_up() {
    the_others_go_on_beside(Rogue::HoldsBackItsOwn { members: 4 }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_that_never_reads_its_turns_holds_nobody_up() {
    the_others_go_on_beside(Rogue::Silent).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_no_fetch_admits_cannot_join_the_swarm_or_take_chunks() {
    use hypha_artifacts::{
        Admission, FetchOptions,
        protocol::{
            CHUNK_PROTOCOL, ChunkErrorCode, ChunkHeader, ChunkRequest, HelloReply, SWARM_PROTOCOL,
            SwarmMessage, read_frame, write_frame,
        },
    };
    let dir = tempfile::tempdir().unwrap();
    let s3 = S3Server::start(&dir.path().join("s3"), None).await.unwrap();
    s3.put("m.bin", pattern(4 * 64 * 1024, 3)).await.unwrap();
    let pki = Pki::new();
    let (_gateway, gateway_addr) = pki.gateway().await;
    let nodes = nodes(&pki, &gateway_addr, &s3, dir.path(), 2, 64 * 1024).await;
    let stranger = pki.start("stranger", Some(&gateway_addr)).await;
    let colleague = nodes[1].network().local_peer_id();
    let fetched = nodes[0]
        .fetch(
            &object("m.bin", &dir.path().join("out0/m.bin")),
            &FetchOptions {
                expect: 1,
                progress: None,
                admission: Some(Admission::new(move |peer| *peer == colleague)),
            },
        )
        .await
        .unwrap();
    let server = nodes[0].network().local_peer_id();

    let mut stream = stranger.open_stream(server, SWARM_PROTOCOL).await.unwrap();
    let hello = SwarmMessage::Hello {
        artifact: fetched.artifact,
    };
    write_frame(&mut stream, &hello).await.unwrap();
    let reply: HelloReply = read_frame(&mut stream).await.unwrap();
    assert_eq!(reply, HelloReply::NotMember);

    let mut stream = stranger.open_stream(server, CHUNK_PROTOCOL).await.unwrap();
    let request = ChunkRequest {
        artifact: fetched.artifact,
        chunk: 0,
    };
    write_frame(&mut stream, &request).await.unwrap();
    let header: ChunkHeader = read_frame(&mut stream).await.unwrap();
    assert!(
        matches!(
            header,
            ChunkHeader::Error {
                code: ChunkErrorCode::NotAdmitted,
                ..
            }
        ),
        "{header:?}"
    );

    // The peer it admits is let in and gets chunks from it (those that fall to it in the
    // swarm of two it reads from the origin itself, checking the first node's word).
    let second = fetch(
        &nodes[1],
        &object("m.bin", &dir.path().join("out1/m.bin")),
        2,
    )
    .await;
    assert!(second.progress.peer_chunks > 0, "{:?}", second.progress);
    assert!(
        second.progress.peers.iter().all(|p| !p.banned),
        "{:?}",
        second.progress.peers
    );
}

/// Where the DHT is slow (here every query waits on a peer in the routing tables that accepts
/// connections and never answers, as a vanished machine's address can), the members a fetch
/// names still find each other before the join timeout, as a job's workers do: they dial each
/// other, and each chunk leaves the origin once; one that starts a moment after the others,
/// which dialled it before it was there and were refused, is dialled again. (Checked by
/// naming nobody, by announcing in the DHT before taking any event, and by not dialling again
/// a member whose stream to this node is open: the join timeout passes first and the origin
/// sends chunks twice.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_the_fetches_name_join_although_the_dht_is_slow() {
    use hypha_artifacts::{Admission, FetchOptions};
    let dir = tempfile::tempdir().unwrap();
    let s3 = S3Server::start(&dir.path().join("s3"), None).await.unwrap();
    let model = pattern(12 * 64 * 1024 + 5, 9);
    s3.put("m.bin", model.clone()).await.unwrap();
    // Accepts connections and never speaks: a dial to it lasts until the upgrade times out.
    let black_hole = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let black_hole_addr: libp2p::Multiaddr = format!(
        "/ip4/127.0.0.1/tcp/{}",
        black_hole.local_addr().unwrap().port()
    )
    .parse()
    .unwrap();
    std::thread::spawn(move || {
        let held: Vec<_> = black_hole.incoming().collect();
        drop(held);
    });
    let pki = Pki::new();
    let (_gateway, gateway_addr) = pki.gateway().await;
    let mut settings = settings(64 * 1024);
    // Shorter than a query that waits on the silent peer (10 s), long enough for members
    // that dial each other on a loaded machine.
    settings.join_timeout = Duration::from_secs(8);
    let mut members = Vec::new();
    for i in 0..3 {
        let member = node(
            &pki,
            &format!("n{i}"),
            &gateway_addr,
            &s3,
            dir.path(),
            settings.clone(),
        )
        .await;
        member
            .network()
            .add_address(libp2p::PeerId::random(), black_hole_addr.clone())
            .await
            .unwrap();
        members.push(member);
    }
    let names: Vec<libp2p::PeerId> = members
        .iter()
        .map(|m| m.network().local_peer_id())
        .collect();
    let fetches = members.iter().enumerate().map(|(i, member)| {
        let (admitted, named) = (names.clone(), names.clone());
        let out = dir.path().join(format!("out{i}/m.bin"));
        async move {
            if i == 2 {
                // The others found it not yet in the swarm, and were refused.
                tokio::time::sleep(Duration::from_millis(1500)).await;
            }
            let options = FetchOptions {
                expect: 3,
                progress: None,
                admission: Some(
                    Admission::new(move |peer| admitted.contains(peer))
                        .naming(move || named.clone()),
                ),
            };
            member
                .fetch(&object("m.bin", &out), &options)
                .await
                .unwrap()
        }
    });
    let fetched = futures::future::join_all(fetches).await;
    for (i, fetched) in fetched.iter().enumerate() {
        assert_eq!(std::fs::read(&fetched.files[0]).unwrap(), model, "node {i}");
    }
    assert_eq!(
        s3.bytes_served(),
        model.len() as u64,
        "each chunk leaves the origin once: {:#?}",
        fetched.iter().map(|f| &f.progress).collect::<Vec<_>>()
    );
}

/// A member whose stream to this node is open, but that refused this node's stream to it (it
/// was not ready), is dialled again, although the ring is whole and the DHT never shows it:
/// otherwise it would never hear this node, and might wait for it until its join timeout.
/// (Checked by dialling again only the peers the DHT shows: the member waits in vain.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_that_refused_this_nodes_stream_once_is_dialled_again() {
    use futures::StreamExt;
    use hypha_artifacts::{
        Manifest,
        protocol::{HelloReply, SWARM_PROTOCOL, SwarmMessage, read_frame, write_frame},
    };
    let dir = tempfile::tempdir().unwrap();
    let s3 = S3Server::start(&dir.path().join("s3"), None).await.unwrap();
    s3.put("m.bin", pattern(4 * 64 * 1024, 4)).await.unwrap();
    let pki = Pki::new();
    let (_gateway, gateway_addr) = pki.gateway().await;
    let node = node(
        &pki,
        "n0",
        &gateway_addr,
        &s3,
        dir.path(),
        settings(64 * 1024),
    )
    .await;
    let request = object("m.bin", &dir.path().join("out0/m.bin"));
    let origin = origins(&s3).get("default").unwrap();
    let artifact = Manifest::new(
        origin.url(),
        64 * 1024,
        origin.resolve(&request).await.unwrap(),
    )
    .id;

    // The member: announces nothing in the DHT, refuses the first stream the node opens to
    // it, welcomes the next.
    let member = pki.start("member", Some(&gateway_addr)).await;
    let (dialled_again, mut welcomed) = tokio::sync::mpsc::channel(1);
    let mut hellos = member.accept_streams(SWARM_PROTOCOL).unwrap();
    tokio::spawn(async move {
        let mut refused = false;
        while let Some((_, mut stream)) = hellos.next().await {
            let _ = read_frame::<SwarmMessage>(&mut stream).await;
            if !refused {
                refused = true;
                let _ = write_frame(&mut stream, &HelloReply::NotMember).await;
                continue;
            }
            let _ = write_frame(&mut stream, &HelloReply::Welcome).await;
            let _ = dialled_again.try_send(());
            tokio::spawn(
                async move { while read_frame::<SwarmMessage>(&mut stream).await.is_ok() {} },
            );
        }
    });

    let fetch = tokio::spawn({
        let node = node.clone();
        async move { fetch(&node, &request, 2).await }
    });
    // Its own stream to the node, once the node is in the swarm: the ring of two is whole.
    let node_id = node.network().local_peer_id();
    let mut stream = loop {
        let mut stream = member.open_stream(node_id, SWARM_PROTOCOL).await.unwrap();
        write_frame(&mut stream, &SwarmMessage::Hello { artifact })
            .await
            .unwrap();
        if read_frame::<HelloReply>(&mut stream).await.unwrap() == HelloReply::Welcome {
            break stream;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    write_frame(&mut stream, &SwarmMessage::Load { uploads: 0 })
        .await
        .unwrap();
    assert!(
        tokio::time::timeout(Duration::from_secs(30), welcomed.recv())
            .await
            .is_ok(),
        "the node never opened its stream to the member again"
    );
    fetch.abort();
}
