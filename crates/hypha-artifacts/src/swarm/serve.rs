//! Serving one chunk to a member that asks for it.

use std::sync::{Arc, atomic::Ordering};

use futures::AsyncWriteExt;
use hypha_network::{PeerId, Stream};

use super::{Holding, PEER_TIMEOUT};
use crate::{
    manifest::{ArtifactId, Chunk},
    protocol::{ChunkErrorCode, ChunkHeader, ChunkRequest, read_frame, write_frame},
};

/// Serves one chunk request on an inbound stream.
pub(crate) async fn serve_chunk(
    mut stream: Stream,
    peer: PeerId,
    lookup: impl FnOnce(ArtifactId) -> Result<Arc<Holding>, ChunkErrorCode>,
) {
    let refuse = |code, message: String| ChunkHeader::Error { code, message };
    let request: ChunkRequest =
        match tokio::time::timeout(PEER_TIMEOUT, read_frame(&mut stream)).await {
            Ok(Ok(request)) => request,
            Ok(Err(e)) => {
                let _ = write_frame(
                    &mut stream,
                    &refuse(ChunkErrorCode::Malformed, e.to_string()),
                )
                .await;
                return;
            }
            Err(_) => return,
        };
    let holding = match lookup(request.artifact) {
        Ok(holding) => holding,
        Err(code) => {
            let message = match code {
                ChunkErrorCode::NotAdmitted => format!(
                    "no job or request for {} here lets you in its swarm",
                    request.artifact
                ),
                _ => format!("not in the swarm of {}", request.artifact),
            };
            let _ = write_frame(&mut stream, &refuse(code, message)).await;
            return;
        }
    };
    let Some(span) = holding.assembly.manifest().chunk(request.chunk) else {
        let _ = write_frame(
            &mut stream,
            &refuse(
                ChunkErrorCode::Malformed,
                format!(
                    "artifact {} has no chunk {}",
                    request.artifact, request.chunk
                ),
            ),
        )
        .await;
        return;
    };
    let Some(serving) = holding
        .held(request.chunk)
        .filter(|_| !holding.is_damaged(request.chunk))
    else {
        let _ = write_frame(
            &mut stream,
            &refuse(
                ChunkErrorCode::Missing,
                format!("chunk {} is not held here", request.chunk),
            ),
        )
        .await;
        return;
    };
    let Ok(_permit) = holding.uploads.clone().try_acquire_owned() else {
        let _ = write_frame(
            &mut stream,
            &refuse(ChunkErrorCode::Busy, "every upload slot is taken".into()),
        )
        .await;
        return;
    };
    let Some(_share) = holding.upload_shares.try_take(peer) else {
        let _ = write_frame(
            &mut stream,
            &refuse(
                ChunkErrorCode::Busy,
                format!(
                    "you hold {} of the upload slots already",
                    holding.upload_shares.per_peer()
                ),
            ),
        )
        .await;
        return;
    };
    let result = send_chunk(&mut stream, &holding, request.chunk, span, serving).await;
    match result {
        Ok(()) => {
            holding.uploaded_chunks.fetch_add(1, Ordering::Relaxed);
            holding
                .uploaded_bytes
                .fetch_add(span.len, Ordering::Relaxed);
        }
        Err(reason) => {
            tracing::debug!(%peer, chunk = request.chunk, "upload ended early: {reason}")
        }
    }
}

/// Sends `chunk` (at `span` of the files) whole, or ends the stream short when its bytes
/// no longer hash to `serving`, the hash it is held with.
async fn send_chunk(
    stream: &mut Stream,
    holding: &Arc<Holding>,
    chunk: u32,
    span: Chunk,
    serving: [u8; 32],
) -> Result<(), String> {
    write_frame(stream, &ChunkHeader::Ok { size: span.len })
        .await
        .map_err(|e| e.to_string())?;
    // Read the next block while the current one is being sent.
    let read = |offset: u64| {
        let assembly = holding.assembly.clone();
        tokio::task::spawn_blocking(move || {
            assembly.read_at(span, offset, crate::assembly::IO_BLOCK)
        })
    };
    let mut offset = 0u64;
    let mut next = (span.len > 0).then(|| read(0));
    // The bytes are hashed as they are read, and the last block goes out only if they
    // match what this node holds: a chunk changed on disk since it was verified (by a
    // process of this node's user, by the disk) ends short, which costs the peer a retry
    // elsewhere, instead of reaching it whole, costing it a download and this node its
    // place in the swarm.
    let mut hasher = blake3::Hasher::new();
    while let Some(pending) = next.take() {
        let block = pending
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())?;
        hasher.update(&block);
        offset += block.len() as u64;
        if offset < span.len {
            next = Some(read(offset));
        } else if holding.held(chunk) != Some(serving) {
            // Dropped (and perhaps being written again) while it was being sent: end the
            // stream short rather than hand out bytes that match no hash.
            return Err("the chunk was dropped while being sent".to_string());
        } else if *hasher.finalize().as_bytes() != serving {
            holding.damaged(chunk);
            return Err("the chunk on disk no longer matches its hash".to_string());
        }
        tokio::time::timeout(PEER_TIMEOUT, stream.write_all(&block))
            .await
            .map_err(|_| "the peer stopped reading".to_string())?
            .map_err(|e| e.to_string())?;
    }
    stream.close().await.map_err(|e| e.to_string())?;
    Ok(())
}
