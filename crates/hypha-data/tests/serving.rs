//! Data nodes and clients as real swarms over TCP on 127.0.0.1 with real certificates.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::{
    path::{Path, PathBuf},
    sync::{Arc, RwLock},
    time::Duration,
};

use futures::{AsyncReadExt, AsyncWriteExt};
use hypha_certs::{
    NodeIdentity, Roles, TrustStore,
    authority::{self, Authority, Validity},
};
use hypha_data::{
    Catalog, DataClient,
    node::Iterations,
    protocol::{self, ErrorCode, PROTOCOL, SliceHeader, SliceRequest},
    server::Limits,
};
use hypha_dataset::slice;
use hypha_network::{Network, PeerId, Settings};
use tokio::sync::oneshot;

struct Pki {
    root: Authority,
    org: Authority,
}

impl Pki {
    fn new() -> Self {
        let root = authority::create_root("Data Root", Validity::days(2)).unwrap();
        let org = authority::create_org(&root, "Data Org", Validity::days(2)).unwrap();
        Pki { root, org }
    }

    async fn start(
        &self,
        name: &str,
        gateway: Option<&libp2p::Multiaddr>,
    ) -> (
        Network,
        tokio::sync::mpsc::Receiver<hypha_network::InboundRequest>,
    ) {
        self.start_as(name, &self.org, Roles::ALL, gateway).await
    }

    /// A node of `org` (signed by it) with `roles`.
    async fn start_as(
        &self,
        name: &str,
        org: &Authority,
        roles: Roles,
        gateway: Option<&libp2p::Multiaddr>,
    ) -> (
        Network,
        tokio::sync::mpsc::Receiver<hypha_network::InboundRequest>,
    ) {
        let node = authority::create_node(org, name, &[], roles, Validity::days(1)).unwrap();
        let identity =
            NodeIdentity::from_pem(node.chain_pem().as_bytes(), node.key_pem().as_bytes()).unwrap();
        let trust = Arc::new(TrustStore::from_pem(self.root.cert_pem().as_bytes(), &[]).unwrap());
        let mut settings = Settings::new(name);
        settings.listen_addresses = vec!["/ip4/127.0.0.1/tcp/0".parse().unwrap()];
        settings.gateway_addresses = gateway.into_iter().cloned().collect();
        settings.relay_circuit = false;
        settings.relay_server = gateway.is_none();
        hypha_network::start(settings, &identity, trust)
            .await
            .unwrap()
    }
}

/// A data node serving `root` until the returned sender is dropped or fired.
async fn data_node(
    pki: &Pki,
    name: &str,
    gateway: &libp2p::Multiaddr,
    root: &Path,
    limits: Limits,
) -> (Network, oneshot::Sender<()>) {
    data_node_with(
        pki,
        name,
        gateway,
        root,
        limits,
        Iterations::in_dir(root.join(".hypha-iterations")),
    )
    .await
}

async fn data_node_with(
    pki: &Pki,
    name: &str,
    gateway: &libp2p::Multiaddr,
    root: &Path,
    limits: Limits,
    iterations: Iterations,
) -> (Network, oneshot::Sender<()>) {
    let (network, inbound) = pki.start(name, Some(gateway)).await;
    let catalog = Arc::new(RwLock::new(Catalog::open(root).unwrap()));
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(hypha_data::node::serve(
        network.clone(),
        inbound,
        catalog,
        iterations,
        limits,
        Duration::from_millis(200),
        async {
            let _ = stopped.await;
        },
    ));
    (network, stop)
}

async fn gateway(pki: &Pki) -> (Network, libp2p::Multiaddr) {
    let (network, _) = pki.start("gateway", None).await;
    let addr = network
        .listen_addresses()
        .await
        .unwrap()
        .remove(0)
        .with(libp2p::multiaddr::Protocol::P2p(network.local_peer_id()));
    (network, addr)
}

/// A plain SafeTensors slice holding one U8 tensor of `len` bytes of a pattern seeded by `seed`.
fn write_slice(dir: &Path, file: &str, len: usize, seed: u8) {
    let data = (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect();
    let tensors = slice::Tensors::new()
        .with("data", slice::Dtype::U8, vec![len], data)
        .unwrap();
    std::fs::write(
        dir.join(file),
        slice::encode(&tensors, slice::Encoding::Plain).unwrap(),
    )
    .unwrap();
}

fn dataset(parent: &Path, name: &str, slices: usize, len: usize) -> PathBuf {
    let dir = parent.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    for i in 0..slices {
        write_slice(&dir, &format!("slice-{i:04}.safetensors"), len, i as u8);
    }
    dir
}

/// Connects `from` to `to` at `to`'s own listen address: a node just started may not hold its
/// gateway relay reservation yet, nor be in the DHT, so `connect` could find no way to it.
async fn dial_directly(from: &Network, to: &Network) {
    let address = to.listen_addresses().await.unwrap().remove(0);
    assert_eq!(from.dial(address).await.unwrap(), to.local_peer_id());
}

async fn wait_for_providers(client: &DataClient, dataset: &str, count: usize) -> Vec<PeerId> {
    for _ in 0..300 {
        if let Ok(providers) = client.providers(dataset).await
            && providers.len() >= count
        {
            return providers;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("never found {count} providers of {dataset}");
}

#[tokio::test]
async fn a_corrupted_copy_is_rejected_and_fetched_from_the_other_node() {
    let pki = Pki::new();
    let tmp = tempfile::tempdir().unwrap();
    let copy_a = dataset(&tmp.path().join("a"), "mnist", 3, 64 * 1024);
    let copy_b = dataset(&tmp.path().join("b"), "mnist", 3, 64 * 1024);
    let (_gw, gw_addr) = gateway(&pki).await;
    let (node_a, _stop_a) = data_node(&pki, "data-a", &gw_addr, &copy_a, Limits::default()).await;
    let (node_b, _stop_b) = data_node(&pki, "data-b", &gw_addr, &copy_b, Limits::default()).await;
    let (client_net, _) = pki.start("worker", Some(&gw_addr)).await;
    let client = DataClient::new(client_net);

    let providers = wait_for_providers(&client, "mnist", 2).await;
    assert!(
        providers.contains(&node_a.local_peer_id()) && providers.contains(&node_b.local_peer_id())
    );
    let manifest = client
        .manifest(node_a.local_peer_id(), "mnist")
        .await
        .unwrap();
    assert_eq!(manifest.slices.len(), 3);
    assert_eq!(
        manifest,
        client
            .manifest(node_b.local_peer_id(), "mnist")
            .await
            .unwrap()
    );

    // Flip one byte of slice 1 on node A's disk, keeping its size.
    let path = copy_a.join("slice-0001.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(&path, &bytes).unwrap();

    let dest = tmp.path().join("fetched.safetensors");
    let report = client
        .fetch_slice(
            "mnist",
            &manifest.slices[1],
            &[node_a.local_peer_id(), node_b.local_peer_id()],
            &dest,
        )
        .await
        .unwrap();
    assert_eq!(
        report.rejected,
        vec![node_a.local_peer_id()],
        "node A's bytes failed the hash"
    );
    assert_eq!(report.provider, node_b.local_peer_id());
    let original = std::fs::read(copy_b.join("slice-0001.safetensors")).unwrap();
    assert_eq!(std::fs::read(&dest).unwrap(), original);

    // Into memory: node A's bytes are dropped from the buffer, not left in front of B's.
    let mut buffer = Vec::new();
    let report = client
        .fetch_slice_to_vec(
            "mnist",
            &manifest.slices[1],
            &[node_a.local_peer_id(), node_b.local_peer_id()],
            &mut buffer,
        )
        .await
        .unwrap();
    assert_eq!(report.rejected, vec![node_a.local_peer_id()]);
    assert!(
        buffer == original,
        "the buffer holds exactly node B's slice"
    );
}

#[tokio::test]
async fn a_node_killed_mid_transfer_is_resumed_from_the_other_at_the_offset_reached() {
    const SIZE: usize = 192 * 1024 * 1024;
    let pki = Pki::new();
    let tmp = tempfile::tempdir().unwrap();
    // Both nodes serve the same directory: identical copies.
    let data = dataset(tmp.path(), "big", 1, SIZE);
    let (_gw, gw_addr) = gateway(&pki).await;
    let (node_a, stop_a) = data_node(&pki, "data-a", &gw_addr, &data, Limits::default()).await;
    let (node_b, _stop_b) = data_node(&pki, "data-b", &gw_addr, &data, Limits::default()).await;
    let (client_net, _) = pki.start("worker", Some(&gw_addr)).await;
    let client = DataClient::new(client_net);
    wait_for_providers(&client, "big", 2).await;
    let manifest = client
        .manifest(node_a.local_peer_id(), "big")
        .await
        .unwrap();

    let downloads = tmp.path().join("downloads");
    std::fs::create_dir(&downloads).unwrap();
    let dest = downloads.join("slice.safetensors");
    let entry = manifest.slices[0].clone();
    let order = [node_a.local_peer_id(), node_b.local_peer_id()];
    let fetch = {
        let client = client.clone();
        let dest = dest.clone();
        tokio::spawn(async move { client.fetch_slice("big", &entry, &order, &dest).await })
    };
    // Kill node A once a quarter of the slice has arrived.
    let partial_size = || {
        std::fs::read_dir(&downloads)
            .unwrap()
            .filter_map(Result::ok)
            .map(|e| e.metadata().map(|m| m.len()).unwrap_or(0))
            .max()
            .unwrap_or(0)
    };
    let mut killed_at = 0;
    for _ in 0..20_000 {
        killed_at = partial_size();
        if killed_at >= (SIZE / 4) as u64 {
            break;
        }
        tokio::time::sleep(Duration::from_micros(250)).await;
    }
    stop_a.send(()).unwrap();
    node_a.shutdown().await;

    let report = fetch.await.unwrap().unwrap();
    assert!(
        killed_at > 0 && killed_at < manifest.slices[0].size,
        "killed mid-transfer at {killed_at}"
    );
    assert_eq!(report.provider, node_b.local_peer_id());
    assert!(report.resumed >= 1, "{report:?}");
    assert!(
        report.bytes_received < manifest.slices[0].size + (SIZE / 2) as u64,
        "resumed rather than restarted: {report:?}"
    );
    let fetched = std::fs::read(&dest).unwrap();
    assert_eq!(
        blake3::hash(&fetched).to_hex().to_string(),
        manifest.slices[0].blake3
    );
}

/// Sends raw bytes as a request and reads the answer. Retries a stream the server dropped
/// before accepting it, as `DataClient` does (libp2p-stream's one-slot inbound queue).
async fn raw_exchange(client: &Network, peer: PeerId, bytes: &[u8]) -> Option<SliceHeader> {
    for attempt in 0..6 {
        tokio::time::sleep(Duration::from_millis(10 * attempt)).await;
        let mut stream = client.open_stream(peer, PROTOCOL).await.unwrap();
        if stream.write_all(bytes).await.is_err() || stream.flush().await.is_err() {
            continue;
        }
        if let Ok(header) = protocol::read_frame::<SliceHeader>(&mut stream).await {
            return Some(header);
        }
    }
    None
}

fn error_code(header: Option<SliceHeader>) -> ErrorCode {
    match header {
        Some(SliceHeader::Error(e)) => e.code,
        other => panic!("expected an error frame, got {other:?}"),
    }
}

#[tokio::test]
async fn many_fetchers_get_exact_bytes_while_bad_requests_get_errors() {
    let pki = Pki::new();
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(tmp.path(), "text", 4, 512 * 1024);
    let (_gw, gw_addr) = gateway(&pki).await;
    let limits = Limits {
        per_peer: 64,
        ..Limits::default()
    };
    let (node, _stop) = data_node(&pki, "data", &gw_addr, &data, limits).await;
    let (client_net, _) = pki.start("worker", Some(&gw_addr)).await;
    let client = DataClient::new(client_net.clone());
    let peer = node.local_peer_id();
    dial_directly(&client_net, &node).await;
    let manifest = client.manifest(peer, "text").await.unwrap();

    // Hostile and mistaken requests, each on its own stream.
    let mut abuse = Vec::new();
    let huge_length = [0xff, 0xff, 0xff, 0xff];
    abuse.push((huge_length.to_vec(), ErrorCode::BadRequest));
    abuse.push((
        [&12u32.to_be_bytes()[..], b"not json!!!!"].concat(),
        ErrorCode::BadRequest,
    ));
    let frame = |r: &SliceRequest| {
        let json = serde_json::to_vec(r).unwrap();
        [&(json.len() as u32).to_be_bytes()[..], &json].concat()
    };
    abuse.push((
        frame(&SliceRequest {
            dataset: "nope".into(),
            slice: 0,
            offset: 0,
            file: None,
        }),
        ErrorCode::UnknownDataset,
    ));
    abuse.push((
        frame(&SliceRequest {
            dataset: "text".into(),
            slice: 4,
            offset: 0,
            file: None,
        }),
        ErrorCode::SliceOutOfRange,
    ));
    abuse.push((
        frame(&SliceRequest {
            dataset: "text".into(),
            slice: u64::MAX,
            offset: 0,
            file: None,
        }),
        ErrorCode::SliceOutOfRange,
    ));
    abuse.push((
        frame(&SliceRequest {
            dataset: "text".into(),
            slice: 0,
            offset: 0,
            file: Some("../../etc/passwd".into()),
        }),
        ErrorCode::UnknownSlice,
    ));
    abuse.push((
        frame(&SliceRequest {
            dataset: "text".into(),
            slice: 0,
            offset: u64::MAX,
            file: None,
        }),
        ErrorCode::OffsetOutOfRange,
    ));

    let largest = manifest.slices.iter().map(|e| e.size).max().unwrap() as usize;
    let mut tasks = Vec::new();
    for i in 0..32usize {
        let client = client.clone();
        let entry = manifest.slices[i % 4].clone();
        let dest = tmp.path().join(format!("fetch-{i}.safetensors"));
        // Half to disk, half into memory through buffers holding stale bytes: shorter than
        // the slice, longer than it, and shorter with room to spare.
        tasks.push(tokio::spawn(async move {
            if i % 2 == 0 {
                client
                    .fetch_slice("text", &entry, &[peer], &dest)
                    .await
                    .unwrap();
                (entry.index, std::fs::read(&dest).unwrap())
            } else {
                let mut buffer = match i % 3 {
                    0 => vec![0xAA; 100],
                    1 => vec![0xAA; largest + 4096],
                    _ => {
                        let mut spacious = Vec::with_capacity(2 * largest);
                        spacious.resize(100, 0xAA);
                        spacious
                    }
                };
                client
                    .fetch_slice_to_vec("text", &entry, &[peer], &mut buffer)
                    .await
                    .unwrap();
                (entry.index, buffer)
            }
        }));
    }
    for (bytes, expected) in abuse {
        assert_eq!(
            error_code(raw_exchange(&client_net, peer, &bytes).await),
            expected
        );
    }
    // A client that opens a stream and never sends its request costs only that stream.
    let _stalled = client_net.open_stream(peer, PROTOCOL).await.unwrap();

    for task in tasks {
        let (index, bytes) = task.await.unwrap();
        let original = std::fs::read(data.join(format!("slice-{index:04}.safetensors"))).unwrap();
        assert!(bytes == original, "slice {index} differs");
    }
    // And the node still serves.
    let dest = tmp.path().join("after.safetensors");
    client
        .fetch_slice("text", &manifest.slices[3], &[peer], &dest)
        .await
        .unwrap();
}

#[tokio::test]
async fn a_peer_over_its_limit_is_told_busy() {
    let pki = Pki::new();
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(tmp.path(), "d", 1, 1024);
    let (_gw, gw_addr) = gateway(&pki).await;
    let limits = Limits {
        per_peer: 1,
        queued_per_peer: 1,
        ..Limits::default()
    };
    let (node, _stop) = data_node(&pki, "data", &gw_addr, &data, limits).await;
    let (client_net, _) = pki.start("worker", Some(&gw_addr)).await;
    let peer = node.local_peer_id();
    dial_directly(&client_net, &node).await;
    // The first stream takes the peer's only place by never finishing its request (a stream
    // reaches the server with its first bytes).
    let mut holder = client_net.open_stream(peer, PROTOCOL).await.unwrap();
    holder.write_all(&100u32.to_be_bytes()).await.unwrap();
    holder.flush().await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let request = SliceRequest {
        dataset: "d".into(),
        slice: 0,
        offset: 0,
        file: None,
    };
    let mut stream = client_net.open_stream(peer, PROTOCOL).await.unwrap();
    protocol::write_frame(&mut stream, &request).await.unwrap();
    let header: SliceHeader = protocol::read_frame(&mut stream).await.unwrap();
    assert!(
        matches!(header, SliceHeader::Error(ref e) if e.code == ErrorCode::Busy),
        "{header:?}"
    );
    let mut rest = Vec::new();
    stream.read_to_end(&mut rest).await.unwrap();
    assert!(rest.is_empty());
}

/// Reads slice 0 of `dataset` from `node` as a slow client does: `block` bytes every
/// `every`, never silent long enough to stall. Returns the bytes it got before the stream ended.
async fn read_slowly(
    client: &Network,
    node: PeerId,
    dataset: &str,
    block: usize,
    every: Duration,
    started: oneshot::Sender<()>,
) -> usize {
    let mut stream = client.open_stream(node, PROTOCOL).await.unwrap();
    let request = SliceRequest {
        dataset: dataset.into(),
        slice: 0,
        offset: 0,
        file: None,
    };
    protocol::write_frame(&mut stream, &request).await.unwrap();
    let header: SliceHeader = protocol::read_frame(&mut stream).await.unwrap();
    assert!(matches!(header, SliceHeader::Ok { .. }), "{header:?}");
    let _ = started.send(());
    let mut buffer = vec![0; block];
    let mut got = 0;
    loop {
        match stream.read(&mut buffer).await {
            Ok(0) | Err(_) => return got,
            Ok(n) => got += n,
        }
        tokio::time::sleep(every).await;
    }
}

/// Clients that read slowly, never stalling, are let go so that the others are served
/// (issue 58, item 2): two of them hold both of a node's slots reading 640 KiB/s, below the
/// node's floor of 4 MiB/s; they are cut off before the end of their slices, and a third
/// client gets its slice within seconds. (Checked without the floor on sends: the slow
/// readers keep both slots for the 25 s their slices take, and the third client waits.)
#[tokio::test]
async fn clients_that_read_too_slowly_are_let_go_and_the_others_served() {
    let pki = Pki::new();
    let tmp = tempfile::tempdir().unwrap();
    let slice_len = 16 * 1024 * 1024;
    let data = dataset(tmp.path(), "big", 2, slice_len);
    let (_gw, gw_addr) = gateway(&pki).await;
    let limits = Limits {
        concurrent: 2,
        per_peer: 1,
        stall_timeout: Duration::from_secs(1),
        min_send_rate: 4 * 1024 * 1024,
        ..Limits::default()
    };
    let (node, _stop) = data_node(&pki, "data", &gw_addr, &data, limits).await;
    let peer = node.local_peer_id();
    let mut slow = Vec::new();
    for name in ["slow-1", "slow-2"] {
        let (client, _) = pki.start(name, Some(&gw_addr)).await;
        dial_directly(&client, &node).await;
        let (started, reading) = oneshot::channel();
        slow.push(tokio::spawn(async move {
            read_slowly(
                &client,
                peer,
                "big",
                64 * 1024,
                Duration::from_millis(100),
                started,
            )
            .await
        }));
        reading.await.unwrap();
    }

    let (honest_net, _) = pki.start("honest", Some(&gw_addr)).await;
    dial_directly(&honest_net, &node).await;
    let honest = DataClient::new(honest_net);
    let manifest = honest.manifest(peer, "big").await.unwrap();
    let dest = tmp.path().join("honest.safetensors");
    tokio::time::timeout(
        Duration::from_secs(15),
        honest.fetch_slice("big", &manifest.slices[1], &[peer], &dest),
    )
    .await
    .expect("the slow readers were let go and the honest client served")
    .unwrap();
    assert_eq!(
        std::fs::read(&dest).unwrap(),
        std::fs::read(data.join("slice-0001.safetensors")).unwrap()
    );
    for reader in slow {
        let got = reader.await.unwrap();
        assert!(
            got < slice_len / 2,
            "a slow reader got {got} bytes of {slice_len} before it was let go"
        );
    }
}

#[tokio::test]
async fn datasets_added_or_changed_on_disk_are_served_without_restart() {
    let pki = Pki::new();
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("datasets");
    dataset(&root, "first", 1, 1024);
    let (_gw, gw_addr) = gateway(&pki).await;
    let (node, _stop) = data_node(&pki, "data", &gw_addr, &root, Limits::default()).await;
    let (client_net, _) = pki.start("worker", Some(&gw_addr)).await;
    let client = DataClient::new(client_net);
    wait_for_providers(&client, "first", 1).await;

    // A new dataset appears next to the first one.
    dataset(&root, "second", 2, 2048);
    let providers = wait_for_providers(&client, "second", 1).await;
    assert_eq!(providers, vec![node.local_peer_id()]);
    let manifest = client
        .manifest(node.local_peer_id(), "second")
        .await
        .unwrap();
    assert_eq!(manifest.slices.len(), 2);

    // A slice of a dataset with a stored manifest is replaced by one of the same size: the new
    // version is served, with its own hash.
    hypha_dataset::Dataset::open(&root.join("first"))
        .unwrap()
        .write_manifest()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    let before = client
        .manifest(node.local_peer_id(), "first")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    write_slice(&root.join("first"), "slice-0000.safetensors", 1024, 9);
    let mut after = before.clone();
    for _ in 0..100 {
        after = client
            .manifest(node.local_peer_id(), "first")
            .await
            .unwrap();
        if after != before {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_ne!(after.slices[0].blake3, before.slices[0].blake3);
    let dest = tmp.path().join("new.safetensors");
    client
        .fetch_slice("first", &after.slices[0], &[node.local_peer_id()], &dest)
        .await
        .unwrap();
    assert_eq!(
        std::fs::read(&dest).unwrap(),
        std::fs::read(root.join("first/slice-0000.safetensors")).unwrap()
    );
}

/// A request of `consumer` for one slice of iteration `iteration` over dataset `d` (seed 1),
/// shared with `share_with`.
fn iterate_request(
    iteration: &str,
    consumer: &str,
    epochs: u32,
    share_with: Vec<String>,
) -> hypha_messages::Request {
    hypha_messages::Request::Iterate(hypha_messages::iterate::IterateRequest {
        iteration: iteration.into(),
        dataset: "d".into(),
        consumer: consumer.into(),
        epochs,
        seed: 1,
        want: 1,
        cached: Vec::new(),
        consumed: Vec::new(),
        round: 0,
        completed_round: None,
        holding: None,
        share_with,
    })
}

#[tokio::test]
async fn an_iteration_of_too_many_epochs_is_refused_and_the_node_serves_on() {
    let pki = Pki::new();
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(tmp.path(), "d", 2, 64);
    let (_gw, gw_addr) = gateway(&pki).await;
    let (node, _stop) = data_node(&pki, "data", &gw_addr, &data, Limits::default()).await;
    let (client, _) = pki.start("client", Some(&gw_addr)).await;
    let peer = node.local_peer_id();
    dial_directly(&client, &node).await;
    let iterate = |epochs: u32| iterate_request(&format!("it-{epochs}"), "c", epochs, Vec::new());
    // u32::MAX epochs would build a ledger and a progress of billions of entries.
    let started = std::time::Instant::now();
    let error = client.request(peer, iterate(u32::MAX)).await.unwrap_err();
    assert!(error.to_string().contains("at most 10000"), "{error}");
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(
        !data
            .join(".hypha-iterations/d/it-4294967295.ledger")
            .exists()
    );
    // The node goes on serving: a reasonable iteration is granted a slice.
    match client.request(peer, iterate(2)).await.unwrap() {
        hypha_messages::Response::Iterate(grant) => assert_eq!(grant.slices.len(), 1),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn a_provider_that_sends_half_an_answer_and_goes_silent_is_left_within_the_deadline() {
    use futures::StreamExt;
    let Honest {
        pki,
        tmp,
        gw_addr,
        node: honest,
        client,
        client_net,
        entry,
        held: _held,
        ..
    } = honest_node().await;
    // A certified peer that takes the request, sends two bytes of its answer's frame and
    // then nothing, holding the stream open.
    let (stalling, _) = pki.start("staller", Some(&gw_addr)).await;
    let mut incoming = stalling.accept_streams(PROTOCOL).unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Some((_, mut stream)) = incoming.next().await {
            let _: Result<SliceRequest, _> = protocol::read_frame(&mut stream).await;
            stream.write_all(&[0, 0]).await.unwrap();
            stream.flush().await.unwrap();
            held.push(stream);
        }
    });
    let dest = tmp.path().join("slice.safetensors");
    let (report, took) =
        fetch_first_from((&client, &client_net), &entry, &stalling, &honest, &dest).await;
    assert_eq!(report.provider, honest.local_peer_id());
    // Twice half a second (each provider gets two turns), and the honest transfer.
    assert!(took < Duration::from_secs(5), "{took:?}");
}

/// A provider that answers properly and then trickles the slice's true bytes (10 every 100
/// ms, never silent long enough for the stall deadline) is left once a period brought fewer
/// bytes than the rate floor (`MIN_BYTES_PER_SECOND` over the stall deadline, 1 s here); the
/// next provider goes on from where it stopped. (Checked without the floor: the trickle holds
/// the download past the test's 20 s.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_that_trickles_is_left_at_the_rate_floor() {
    let Honest {
        pki,
        tmp,
        data,
        gw_addr,
        node: honest,
        client,
        client_net,
        entry,
        held: _held,
        ..
    } = honest_node().await;
    let truth = std::fs::read(data.join(&entry.file)).unwrap();
    let trickler = provider_sending(
        &pki,
        "trickler",
        &gw_addr,
        &entry,
        truth.clone(),
        Some(Duration::from_millis(100)),
    )
    .await;
    let dest = tmp.path().join("slice.safetensors");
    let (report, took) =
        fetch_first_from((&client, &client_net), &entry, &trickler, &honest, &dest).await;
    assert_eq!(report.provider, honest.local_peer_id());
    assert!(
        report.resumed > 0,
        "the honest provider went on from the trickle"
    );
    assert!(std::fs::read(&dest).unwrap() == truth);
    assert!(took < Duration::from_secs(8), "{took:?}");
}

/// A data node's own iterations belong to the peer that started them. Another certified peer
/// that knows the name (`default`, say) is refused, until the owner names it; one peer runs
/// at most four; a consumer's name is bounded; an iteration nobody asks about for the node's
/// idle time is removed and frees its place, also one whose time ran out while the node was
/// down; its owner stays its owner across a restart. (Checked against the node as it was:
/// the stranger drains the owner's iteration, and its fifth iteration is taken.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nodes_iteration_belongs_to_its_owner_and_ends_when_idle() {
    use hypha_messages::{ErrorCode, Request, Response};
    let pki = Pki::new();
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(tmp.path(), "d", 4, 64);
    let ledgers = tmp.path().join("iterations");
    let (_gw, gw_addr) = gateway(&pki).await;
    let long = Iterations {
        dir: ledgers.clone(),
        idle: Duration::from_secs(3600),
    };
    let (node, stop) = data_node_with(
        &pki,
        "data",
        &gw_addr,
        &data,
        Limits::default(),
        long.clone(),
    )
    .await;
    let (owner, _) = pki.start("owner", Some(&gw_addr)).await;
    let (stranger, _) = pki.start("stranger", Some(&gw_addr)).await;
    let (friend, _) = pki.start("friend", Some(&gw_addr)).await;
    let request = |iteration: &str, consumer: &str, share_with: Vec<String>| {
        iterate_request(iteration, consumer, 1, share_with)
    };
    let ask = async |from: &Network, to: &Network, request: Request| {
        dial_directly(from, to).await;
        match from.request(to.local_peer_id(), request).await {
            Ok(Response::Iterate(grant)) => Ok(grant.slices.len()),
            Ok(Response::Error(error)) | Err(hypha_network::NetworkError::Remote { error, .. }) => {
                Err(error)
            }
            other => panic!("{other:?}"),
        }
    };

    assert_eq!(
        ask(&owner, &node, request("default", "a", vec![])).await,
        Ok(1)
    );
    let refused = ask(&stranger, &node, request("default", "b", vec![]))
        .await
        .unwrap_err();
    assert_eq!(refused.code, ErrorCode::Forbidden, "{refused:?}");
    assert!(refused.message.contains("belongs to"), "{refused:?}");
    // Named by the owner, a friend takes its share.
    let named = vec![friend.local_peer_id().to_string()];
    assert_eq!(
        ask(&owner, &node, request("default", "a", named)).await,
        Ok(1)
    );
    assert_eq!(
        ask(&friend, &node, request("default", "f", vec![])).await,
        Ok(1)
    );
    // A consumer's name is one short plain word.
    let bad = ask(&owner, &node, request("default", &"x".repeat(65), vec![]))
        .await
        .unwrap_err();
    assert_eq!(bad.code, ErrorCode::BadRequest, "{bad:?}");
    // Four iterations each, no more.
    for i in 0..4 {
        let name = format!("mine-{i}");
        assert_eq!(
            ask(&stranger, &node, request(&name, "b", vec![])).await,
            Ok(1)
        );
    }
    let busy = ask(&stranger, &node, request("mine-4", "b", vec![]))
        .await
        .unwrap_err();
    assert_eq!(busy.code, ErrorCode::Busy, "{busy:?}");

    // Restarted with the same ledgers: the owner is still the owner.
    let _ = stop.send(());
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (node, stop) = data_node_with(&pki, "data", &gw_addr, &data, Limits::default(), long).await;
    let refused = ask(&stranger, &node, request("default", "b", vec![]))
        .await
        .unwrap_err();
    assert_eq!(refused.code, ErrorCode::Forbidden, "{refused:?}");
    let _ = stop.send(());
    tokio::time::sleep(Duration::from_millis(500)).await;

    // Restarted with an idle time of a second: what nobody asked about for a second is
    // removed, the ledgers left from before included, and the stranger's places are free.
    let short = Iterations {
        dir: ledgers.clone(),
        idle: Duration::from_secs(1),
    };
    let (node, _stop) =
        data_node_with(&pki, "data", &gw_addr, &data, Limits::default(), short).await;
    let ledger = ledgers.join("d/default.ledger");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while ledger.exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "the idle ledger stays"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(!ledgers.join("d/default.owner.json").exists());
    for i in 0..4 {
        let name = format!("again-{i}");
        assert_eq!(
            ask(&stranger, &node, request(&name, "b", vec![])).await,
            Ok(1)
        );
    }
}

/// A certified peer that answers every request for `entry` as a provider would, then sends
/// `bytes` ten at a time (`pace` apart, if any) and closes the stream.
async fn provider_sending(
    pki: &Pki,
    name: &str,
    gateway: &libp2p::Multiaddr,
    entry: &hypha_dataset::SliceEntry,
    bytes: Vec<u8>,
    pace: Option<Duration>,
) -> Network {
    use futures::StreamExt;
    let (network, _) = pki.start(name, Some(gateway)).await;
    let mut incoming = network.accept_streams(PROTOCOL).unwrap();
    let header = SliceHeader::Ok {
        size: entry.size,
        blake3: entry.blake3.clone(),
        offset: 0,
    };
    tokio::spawn(async move {
        while let Some((_, mut stream)) = incoming.next().await {
            let (header, bytes) = (header.clone(), bytes.clone());
            tokio::spawn(async move {
                let _: Result<SliceRequest, _> = protocol::read_frame(&mut stream).await;
                protocol::write_frame(&mut stream, &header).await.unwrap();
                for chunk in bytes.chunks(10) {
                    if stream.write_all(chunk).await.is_err() || stream.flush().await.is_err() {
                        return;
                    }
                    if let Some(pace) = pace {
                        tokio::time::sleep(pace).await;
                    }
                }
                let _ = stream.close().await;
            });
        }
    });
    network
}

/// A provider that sends bad bytes and stops, so that an honest one goes on from there and
/// the slice fails its hash with bytes of both, cannot get the honest provider refused: the
/// slice is fetched whole from one provider at a time, and only a provider whose bytes alone
/// fail is rejected. (Checked by rejecting every contributor, as before: the fetch fails.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_that_sends_bad_bytes_first_cannot_get_an_honest_one_refused() {
    let Honest {
        pki,
        tmp,
        data,
        gw_addr,
        node: honest,
        client,
        client_net,
        entry,
        held: _held,
        ..
    } = honest_node().await;
    let liar = provider_sending(&pki, "liar", &gw_addr, &entry, vec![0; 110], None).await;
    let dest = tmp.path().join("slice.safetensors");
    let (report, _) = fetch_first_from((&client, &client_net), &entry, &liar, &honest, &dest).await;
    assert_eq!(report.provider, honest.local_peer_id());
    assert!(!report.rejected.contains(&honest.local_peer_id()));
    let file = data.join(&entry.file);
    assert!(std::fs::read(&dest).unwrap() == std::fs::read(file).unwrap());
}

/// An honest data node serving dataset `d` of one slice, and a client of short deadlines (half
/// a second to answer, a second of silence mid-slice): what the dishonest providers of the
/// tests stand beside.
struct Honest {
    pki: Pki,
    tmp: tempfile::TempDir,
    data: PathBuf,
    gw_addr: libp2p::Multiaddr,
    node: Network,
    client: DataClient,
    /// The client's network.
    client_net: Network,
    entry: hypha_dataset::SliceEntry,
    /// Held while the test runs: the network's gateway, and the node's stop.
    held: (Network, oneshot::Sender<()>),
}

async fn honest_node() -> Honest {
    let pki = Pki::new();
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(tmp.path(), "d", 1, 4096);
    let (gateway, gw_addr) = gateway(&pki).await;
    let (node, stop) = data_node(&pki, "data", &gw_addr, &data, Limits::default()).await;
    let (client_net, _) = pki.start("worker", Some(&gw_addr)).await;
    let client = DataClient::new(client_net.clone())
        .with_deadlines(Duration::from_millis(500), Duration::from_secs(1));
    wait_for_providers(&client, "d", 1).await;
    let manifest = client.manifest(node.local_peer_id(), "d").await.unwrap();
    let entry = manifest.slices[0].clone();
    Honest {
        client_net,
        pki,
        tmp,
        data,
        gw_addr,
        node,
        client,
        entry,
        held: (gateway, stop),
    }
}

/// Fetches `entry` into `dest` with `client` (on `client_net`) asking `first`, then `then`;
/// fails the test if that takes 20 s.
/// The report, and how long it took.
async fn fetch_first_from(
    (client, client_net): (&DataClient, &Network),
    entry: &hypha_dataset::SliceEntry,
    first: &Network,
    then: &Network,
    dest: &Path,
) -> (hypha_data::FetchReport, Duration) {
    // Connected first: the dishonest provider is surely asked, not passed over as unreachable on a
    // loaded machine.
    dial_directly(client_net, first).await;
    let order = [first.local_peer_id(), then.local_peer_id()];
    let started = std::time::Instant::now();
    let report = tokio::time::timeout(
        Duration::from_secs(20),
        client.fetch_slice("d", entry, &order, dest),
    )
    .await
    .expect("the first provider held the fetch for 20 s")
    .unwrap();
    (report, started.elapsed())
}

/// A data node's iteration places cannot all be taken by many certificates (issue 58, item
/// 8): asking needs the worker role, and one organisation's peers together run at most half
/// of the places. Nine peers of one organisation get 32 iterations, their 33rd is refused
/// `busy`, a peer of another organisation still starts one, and a certificate of no role is
/// refused `forbidden`. (Checked against the node as it was: the role-less peer is granted,
/// and so are all 36 of the one organisation's iterations.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_certificates_of_one_organisation_fill_half_the_iteration_places() {
    use hypha_certs::Role;
    use hypha_data::iteration::{MAX_ITERATIONS_PER_ORGANISATION, MAX_ITERATIONS_PER_PEER};
    use hypha_messages::{ErrorCode, Response};
    let pki = Pki::new();
    let other_org = authority::create_org(&pki.root, "Other Org", Validity::days(2)).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(tmp.path(), "d", 4, 64);
    let (_gw, gw_addr) = gateway(&pki).await;
    let (node, _stop) = data_node(&pki, "data", &gw_addr, &data, Limits::default()).await;
    let worker = Roles::NONE.with(Role::Worker);
    let ask = async |from: &Network, iteration: String| {
        dial_directly(from, &node).await;
        match from
            .request(
                node.local_peer_id(),
                iterate_request(&iteration, "c", 1, Vec::new()),
            )
            .await
        {
            Ok(Response::Iterate(_)) => Ok(()),
            Ok(Response::Error(error)) | Err(hypha_network::NetworkError::Remote { error, .. }) => {
                Err(error)
            }
            other => panic!("{other:?}"),
        }
    };

    let (roleless, _) = pki
        .start_as("no-role", &pki.org, Roles::NONE, Some(&gw_addr))
        .await;
    let refused = ask(&roleless, "mine".into()).await.unwrap_err();
    assert_eq!(refused.code, ErrorCode::Forbidden, "{refused:?}");

    let mut granted = 0;
    let mut busy = Vec::new();
    let peers = MAX_ITERATIONS_PER_ORGANISATION / MAX_ITERATIONS_PER_PEER + 1;
    for p in 0..peers {
        let (peer, _) = pki
            .start_as(&format!("many-{p}"), &pki.org, worker, Some(&gw_addr))
            .await;
        for i in 0..MAX_ITERATIONS_PER_PEER {
            match ask(&peer, format!("it-{p}-{i}")).await {
                Ok(()) => granted += 1,
                Err(error) => busy.push(error),
            }
        }
    }
    assert_eq!(granted, MAX_ITERATIONS_PER_ORGANISATION);
    assert_eq!(busy.len(), peers * MAX_ITERATIONS_PER_PEER - granted);
    assert!(
        busy.iter()
            .all(|e| e.code == ErrorCode::Busy && e.message.contains("one organisation")),
        "{busy:?}"
    );
    let (other, _) = pki
        .start_as("other", &other_org, worker, Some(&gw_addr))
        .await;
    assert_eq!(ask(&other, "theirs".into()).await, Ok(()));
}
