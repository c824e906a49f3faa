//! The swarm's I/O: origin reads, chunk transfers from peers, the streams to and from each
//! member, discovery and the tick. Each is a task that reports back to the actor as an
//! [`Event`](super::Event).

use std::time::Duration;

use futures::{AsyncReadExt, AsyncWriteExt, StreamExt};
use hypha_network::{
    Network, PeerId, Stream,
    frame::{AskError, ask},
};
use tokio::{sync::mpsc, time::Instant};

use super::{
    Event, Failure, Holding, MIN_PEER_RATE, PEER_TIMEOUT, PeerFailure, TICK, state::Input,
};
use crate::{
    assembly::ChunkSink,
    manifest::{ArtifactId, Manifest},
    origin::{Origin, OriginError},
    protocol::{
        CHUNK_PROTOCOL, ChunkErrorCode, ChunkHeader, ChunkRequest, HelloReply, SWARM_PROTOCOL,
        SwarmMessage, read_frame, write_frame,
    },
};

pub(super) fn origin_failure(e: OriginError) -> Failure {
    match e {
        OriginError::Changed { .. } => Failure::Changed(e.to_string()),
        e => Failure::Failed(e.to_string()),
    }
}

/// Chunk `chunk`'s bytes as the origin serves them.
pub(super) async fn origin_bytes(
    origin: &Origin,
    manifest: &Manifest,
    chunk: u32,
) -> Result<impl futures::Stream<Item = Result<bytes::Bytes, Failure>>, Failure> {
    let span = manifest.chunks()[chunk as usize];
    let file = &manifest.files[span.file];
    let stream = origin
        .read(file, span.offset..span.offset + span.len)
        .await
        .map_err(origin_failure)?;
    Ok(stream.map(|bytes| bytes.map_err(origin_failure)))
}

pub(super) async fn read_origin(
    origin: &Origin,
    holding: &Holding,
    chunk: u32,
) -> Result<[u8; 32], Failure> {
    let manifest = holding.assembly.manifest();
    let span = manifest.chunks()[chunk as usize];
    let mut stream = std::pin::pin!(origin_bytes(origin, manifest, chunk).await?);
    let mut sink = ChunkSink::new(holding.assembly.clone(), span);
    while let Some(bytes) = stream.next().await {
        sink.push(&bytes?)
            .await
            .map_err(|e| Failure::Failed(e.to_string()))?;
    }
    sink.finish()
        .await
        .map_err(|e| Failure::Failed(format!("origin: {e}")))
}

/// The BLAKE3 of chunk `chunk` as the origin serves it, without writing it anywhere.
pub(super) async fn hash_origin(
    origin: &Origin,
    manifest: &Manifest,
    chunk: u32,
) -> Result<[u8; 32], Failure> {
    let span = manifest.chunks()[chunk as usize];
    let mut stream = std::pin::pin!(origin_bytes(origin, manifest, chunk).await?);
    let mut hasher = blake3::Hasher::new();
    let mut received = 0u64;
    while let Some(bytes) = stream.next().await {
        let bytes = bytes?;
        received += bytes.len() as u64;
        hasher.update(&bytes);
    }
    if received != span.len {
        return Err(Failure::Failed(format!(
            "origin: sent {received} bytes of a {}-byte chunk",
            span.len
        )));
    }
    Ok(*hasher.finalize().as_bytes())
}

pub(super) async fn read_peer(
    network: &Network,
    peer: PeerId,
    holding: &Holding,
    chunk: u32,
    expected: [u8; 32],
) -> Result<[u8; 32], PeerFailure> {
    let failed = |e: &dyn std::fmt::Display| PeerFailure::Failed(e.to_string());
    let span = holding.assembly.manifest().chunks()[chunk as usize];
    let request = ChunkRequest {
        artifact: holding.assembly.manifest().id,
        chunk,
    };
    // A busy holder may drop the request's stream before it answers (`frame::ask` asks again
    // a moment later): far better than leaving it alone for `BACKOFF`, as at the end of a
    // distribution the last chunks have few holders. A holder that does not take our
    // streams now (it may be flooded by someone else's) says nothing of what it announced.
    let (mut stream, header) =
        match ask::<_, ChunkHeader>(network, peer, CHUNK_PROTOCOL, &request, PEER_TIMEOUT).await {
            Ok(answered) => answered,
            Err(AskError::Silent(_)) => return Err(failed(&"no answer")),
            Err(error) => return Err(PeerFailure::Refused(error.to_string())),
        };
    match header {
        ChunkHeader::Ok { size } if size == span.len => {}
        ChunkHeader::Ok { size } => {
            return Err(PeerFailure::Corrupt(format!(
                "offered {size} bytes for a chunk of {}",
                span.len
            )));
        }
        ChunkHeader::Error {
            code: ChunkErrorCode::Busy,
            ..
        } => return Err(PeerFailure::Busy),
        ChunkHeader::Error {
            code:
                code @ (ChunkErrorCode::Missing
                | ChunkErrorCode::NotAdmitted
                | ChunkErrorCode::UnknownArtifact),
            message,
        } => return Err(PeerFailure::Refused(format!("{code:?}: {message}"))),
        ChunkHeader::Error { code, message } => {
            return Err(PeerFailure::Failed(format!("{code:?}: {message}")));
        }
    }
    let mut sink = ChunkSink::new(holding.assembly.clone(), span);
    let mut buf = vec![0u8; 256 * 1024];
    // A holder sending a byte now and then must not keep a download slot for ever.
    let deadline = Instant::now() + PEER_TIMEOUT + Duration::from_secs(span.len / MIN_PEER_RATE);
    while sink.received() < span.len {
        if Instant::now() >= deadline {
            return Err(failed(&format!(
                "sent slower than {} KiB/s",
                MIN_PEER_RATE / 1024
            )));
        }
        let want = buf.len().min((span.len - sink.received()) as usize);
        let n = tokio::time::timeout(PEER_TIMEOUT, stream.read(&mut buf[..want]))
            .await
            .map_err(|_| failed(&"stalled"))?
            .map_err(|e| failed(&e))?;
        if n == 0 {
            return Err(failed(&"the peer closed the stream mid-chunk"));
        }
        sink.push(&buf[..n]).await.map_err(|e| failed(&e))?;
    }
    let hash = sink.finish().await.map_err(|e| failed(&e))?;
    if hash != expected {
        return Err(PeerFailure::Corrupt("BLAKE3 mismatch".into()));
    }
    Ok(hash)
}

pub(super) async fn read_from(
    peer: PeerId,
    generation: u64,
    mut stream: Stream,
    events: mpsc::Sender<Event>,
) {
    loop {
        match read_frame::<SwarmMessage>(&mut stream).await {
            Ok(message) => {
                if events
                    .send(Event::Learned(Input::Message {
                        peer,
                        generation,
                        message,
                    }))
                    .await
                    .is_err()
                {
                    return;
                }
            }
            Err(e) => {
                tracing::debug!(%peer, "swarm stream ended: {e}");
                break;
            }
        }
    }
    let _ = events
        .send(Event::Learned(Input::ReaderClosed { peer, generation }))
        .await;
}

pub(super) async fn write_to(
    network: Network,
    peer: PeerId,
    artifact: ArtifactId,
    generation: u64,
    initial: Vec<SwarmMessage>,
    mut queue: mpsc::Receiver<SwarmMessage>,
    events: mpsc::Sender<Event>,
) {
    let result: Result<(), String> = async {
        let mut stream = network
            .open_stream(peer, SWARM_PROTOCOL)
            .await
            .map_err(|e| e.to_string())?;
        write_frame(&mut stream, &SwarmMessage::Hello { artifact })
            .await
            .map_err(|e| e.to_string())?;
        let reply: HelloReply = tokio::time::timeout(PEER_TIMEOUT, read_frame(&mut stream))
            .await
            .map_err(|_| "no answer to hello".to_string())?
            .map_err(|e| e.to_string())?;
        if reply == HelloReply::NotMember {
            return Err("not a member".into());
        }
        // Open while both are in the swarm; opened again (a new generation) when it is cut.
        stream.set_long_lived();
        // A member that stops reading is left, not waited for.
        let mut send = async |message: &SwarmMessage| {
            tokio::time::timeout(PEER_TIMEOUT, write_frame(&mut stream, message))
                .await
                .map_err(|_| "the peer stopped reading".to_string())?
                .map_err(|e| e.to_string())
        };
        for message in &initial {
            send(message).await?;
        }
        while let Some(message) = queue.recv().await {
            send(&message).await?;
        }
        let _ = stream.close().await;
        Ok(())
    }
    .await;
    if let Err(reason) = result {
        tracing::debug!(%peer, %artifact, "swarm stream to peer ended: {reason}");
    }
    let _ = events
        .send(Event::Learned(Input::WriterEnded { peer, generation }))
        .await;
}

pub(super) async fn discover(
    network: Network,
    key: Vec<u8>,
    events: mpsc::WeakSender<Event>,
    interval: Duration,
) {
    loop {
        match network.get_providers(&key).await {
            Ok(found) => {
                let Some(events) = events.upgrade() else {
                    return;
                };
                if events
                    .send(Event::Learned(Input::Discovered(found)))
                    .await
                    .is_err()
                {
                    return;
                }
            }
            Err(e) => tracing::debug!("artifact discovery: {e}"),
        }
        tokio::time::sleep(interval).await;
    }
}

pub(super) async fn tick(events: mpsc::WeakSender<Event>) {
    let mut interval = tokio::time::interval(TICK);
    loop {
        interval.tick().await;
        let Some(events) = events.upgrade() else {
            return;
        };
        if events.send(Event::Tick).await.is_err() {
            return;
        }
    }
}
