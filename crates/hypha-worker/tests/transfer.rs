//! The resource protocol between two real swarms on 127.0.0.1 with real certificates: what
//! arrives is exactly what was sent, and bad or dishonest transfers are refused with a reason
//! while the receiver keeps serving.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::{collections::HashSet, path::Path, sync::Arc};

use futures::{AsyncReadExt, AsyncWriteExt};
use hypha_certs::{
    NodeIdentity, TrustStore,
    authority::{self, Validity},
};
use hypha_network::{
    Network, Settings,
    frame::{read_frame, write_frame},
};
use hypha_transfer::{Answer, RefusalCode, Trailer};
use hypha_worker::bridge::{
    paths::JobDir,
    transfer::{self, Header, Inboxes, STAGING_DIR},
};

async fn pair() -> (Network, Network) {
    let root = authority::create_root("Transfer Root", Validity::days(2)).unwrap();
    let org = authority::create_org(&root, "Transfer Org", Validity::days(2)).unwrap();
    let trust = Arc::new(TrustStore::from_pem(root.cert_pem().as_bytes(), &[]).unwrap());
    let mut networks = Vec::new();
    for name in ["sender", "receiver"] {
        let node = authority::create_node(&org, name, &[], Validity::days(1)).unwrap();
        let identity =
            NodeIdentity::from_pem(node.chain_pem().as_bytes(), node.key_pem().as_bytes()).unwrap();
        let mut settings = Settings::new(name);
        settings.listen_addresses = vec!["/ip4/127.0.0.1/tcp/0".parse().unwrap()];
        settings.relay_circuit = false;
        let (network, _inbound) = hypha_network::start(settings, &identity, trust.clone())
            .await
            .unwrap();
        networks.push(network);
    }
    let receiver = networks.pop().unwrap();
    let sender = networks.pop().unwrap();
    let address = receiver.listen_addresses().await.unwrap().remove(0);
    sender.dial(address).await.unwrap();
    (sender, receiver)
}

/// Sends `header` and, when the receiver is ready, `bytes` with `sha256` as the trailer;
/// returns the receiver's last answer.
async fn raw_send(
    network: &Network,
    to: hypha_network::PeerId,
    header: &Header,
    bytes: &[u8],
    sha256: &str,
) -> Answer {
    let mut stream = network.open_stream(to, transfer::PROTOCOL).await.unwrap();
    write_frame(&mut stream, header).await.unwrap();
    let answer: Answer = read_frame(&mut stream).await.unwrap();
    if answer != Answer::Ready {
        return answer;
    }
    stream.write_all(bytes).await.unwrap();
    write_frame(
        &mut stream,
        &Trailer {
            sha256: sha256.to_string(),
        },
    )
    .await
    .unwrap();
    let answer = read_frame(&mut stream).await.unwrap();
    let mut rest = Vec::new();
    let _ = stream.read_to_end(&mut rest).await;
    answer
}

fn refusal(answer: Answer) -> RefusalCode {
    match answer {
        Answer::Refused(refusal) => refusal.code,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

fn staged_files(job: &Path) -> usize {
    std::fs::read_dir(job.join(STAGING_DIR))
        .map(|d| d.count())
        .unwrap_or(0)
}

#[tokio::test]
async fn sent_files_arrive_whole_and_bad_transfers_are_refused() {
    let (sender, receiver) = pair().await;
    let inboxes = Arc::new(Inboxes::default());
    tokio::spawn(transfer::serve(receiver.clone(), inboxes.clone()));
    let job = tempfile::tempdir().unwrap();
    let registration = inboxes.open(
        "task-1",
        "job-1",
        Arc::new(JobDir::open(job.path()).unwrap()),
    );
    let to = receiver.local_peer_id();
    let header = |task: &str, name: &str, size: u64| Header {
        task: task.to_string(),
        name: name.to_string(),
        size,
    };

    // A real send of 3 MiB: the bytes and checksum survive.
    let bytes: Vec<u8> = (0..3 * 1024 * 1024u32).map(|i| (i % 251) as u8).collect();
    let source = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(source.path(), &bytes).unwrap();
    let checksum = transfer::send(
        &sender,
        to,
        &header("task-1", "weights.bin", bytes.len() as u64),
        std::fs::File::open(source.path()).unwrap(),
        transfer::SEND_PATIENCE,
    )
    .await
    .unwrap();
    let expected = format!(
        "sha256:{}",
        hex::encode(<sha2::Sha256 as sha2::Digest>::digest(&bytes))
    );
    assert_eq!(checksum, expected);
    let arrived = registration.inbox().next(&HashSet::new()).await;
    assert_eq!(
        (arrived.sequence, arrived.size, arrived.from),
        (0, bytes.len() as u64, sender.local_peer_id())
    );
    assert_eq!(arrived.checksum, expected);
    let path = registration
        .inbox()
        .deliver(&arrived, Path::new("in"))
        .unwrap();
    assert_eq!(path, "in/0-weights.bin");
    assert_eq!(std::fs::read(job.path().join(&path)).unwrap(), bytes);

    // Refused before any byte moves: a task with no job here, names that are not plain files.
    assert_eq!(
        refusal(raw_send(&sender, to, &header("task-2", "x", 1), b"x", "").await),
        RefusalCode::NoJob
    );
    for name in ["../escape", "a/b", "/etc/passwd", "", ".."] {
        assert_eq!(
            refusal(raw_send(&sender, to, &header("task-1", name, 1), b"x", "").await),
            RefusalCode::BadRequest,
            "{name:?}"
        );
    }
    // A malformed header.
    let mut stream = sender.open_stream(to, transfer::PROTOCOL).await.unwrap();
    stream
        .write_all(&[0, 0, 0, 5, b'{', b'x', b'y', b'z', b'}'])
        .await
        .unwrap();
    assert_eq!(
        refusal(read_frame(&mut stream).await.unwrap()),
        RefusalCode::BadRequest
    );
    // Bytes that do not match the announced checksum, and a transfer that ends early: refused,
    // and nothing is left behind or queued.
    let wrong = "0".repeat(64);
    assert_eq!(
        refusal(raw_send(&sender, to, &header("task-1", "bad", 4), b"abcd", &wrong).await),
        RefusalCode::Corrupt
    );
    let mut stream = sender.open_stream(to, transfer::PROTOCOL).await.unwrap();
    write_frame(&mut stream, &header("task-1", "short", 1000))
        .await
        .unwrap();
    assert_eq!(
        read_frame::<Answer>(&mut stream).await.unwrap(),
        Answer::Ready
    );
    stream.write_all(b"only a little").await.unwrap();
    stream.close().await.unwrap();
    assert_eq!(
        refusal(read_frame(&mut stream).await.unwrap()),
        RefusalCode::Corrupt
    );
    assert_eq!(
        staged_files(job.path()),
        0,
        "refused transfers leave no staged file"
    );

    // The receiver still serves: the next honest transfer gets the next sequence number.
    let good = b"after all that";
    let sum = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(good));
    assert_eq!(
        raw_send(
            &sender,
            to,
            &header("task-1", "ok.txt", good.len() as u64),
            good,
            &sum
        )
        .await,
        Answer::Received { jobs: 1 }
    );
    let arrived = registration.inbox().next(&HashSet::new()).await;
    assert_eq!((arrived.sequence, arrived.name.as_str()), (1, "ok.txt"));

    // Once the job's inbox closes, its task is unknown here.
    drop(registration);
    assert_eq!(
        refusal(raw_send(&sender, to, &header("task-1", "late", 1), b"x", "").await),
        RefusalCode::NoJob
    );
}
