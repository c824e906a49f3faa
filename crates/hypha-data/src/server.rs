//! Serving slices to many clients at once.

use std::{
    collections::HashMap,
    io::SeekFrom,
    sync::{Arc, Mutex, RwLock},
    time::Duration,
};

use futures::{AsyncWriteExt, StreamExt};
use hypha_network::{Network, PeerId};
use tokio::{
    io::{AsyncReadExt, AsyncSeekExt},
    sync::Semaphore,
};

use crate::{
    Catalog,
    protocol::{self, ErrorCode, PROTOCOL, ServeError, SliceHeader, SliceRequest},
};

/// Limits of a slice server.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Slices sent at the same time, over all peers. Requests beyond it wait in arrival order.
    /// Default: 64.
    pub concurrent: usize,
    /// Slices one peer may be sent at the same time; a peer asking for more gets `Busy` at
    /// once. Keeps one greedy client from filling the global queue. Default: 8.
    pub per_peer: usize,
    /// How long a client may take to send its request. Default: 10 s.
    pub request_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            concurrent: 64,
            per_peer: 8,
            request_timeout: Duration::from_secs(10),
        }
    }
}

/// Bytes read from disk and written to a stream at a time.
const CHUNK: usize = 256 * 1024;

/// Serves slices of the datasets in `catalog` until the network stops accepting streams.
pub async fn serve(network: Network, catalog: Arc<RwLock<Catalog>>, limits: Limits) {
    let mut incoming = match network.accept_streams(PROTOCOL) {
        Ok(incoming) => incoming,
        Err(e) => {
            tracing::error!(error = %e, "cannot serve slices");
            return;
        }
    };
    let global = Arc::new(Semaphore::new(limits.concurrent.max(1)));
    let per_peer: Arc<Mutex<HashMap<PeerId, usize>>> = Arc::default();
    while let Some((peer, stream)) = incoming.next().await {
        let catalog = catalog.clone();
        let global = global.clone();
        let per_peer = per_peer.clone();
        let limits = limits.clone();
        tokio::spawn(async move {
            let admitted = admit(&per_peer, peer, limits.per_peer);
            let _guard = PeerSlot {
                peers: &per_peer,
                peer,
                held: admitted,
            };
            serve_one(stream, peer, &catalog, &global, admitted, &limits).await;
        });
    }
}

fn admit(peers: &Mutex<HashMap<PeerId, usize>>, peer: PeerId, limit: usize) -> bool {
    let Ok(mut peers) = peers.lock() else {
        return false;
    };
    let count = peers.entry(peer).or_insert(0);
    if *count >= limit {
        return false;
    }
    *count += 1;
    true
}

/// Releases a peer's slot when its request ends, however it ends.
struct PeerSlot<'a> {
    peers: &'a Mutex<HashMap<PeerId, usize>>,
    peer: PeerId,
    held: bool,
}

impl Drop for PeerSlot<'_> {
    fn drop(&mut self) {
        if !self.held {
            return;
        }
        if let Ok(mut peers) = self.peers.lock()
            && let Some(count) = peers.get_mut(&self.peer)
        {
            *count -= 1;
            if *count == 0 {
                peers.remove(&self.peer);
            }
        }
    }
}

async fn serve_one(
    mut stream: hypha_network::Stream,
    peer: PeerId,
    catalog: &RwLock<Catalog>,
    global: &Semaphore,
    admitted: bool,
    limits: &Limits,
) {
    let request = match tokio::time::timeout(
        limits.request_timeout,
        protocol::read_frame::<SliceRequest>(&mut stream),
    )
    .await
    {
        Err(_) => {
            tracing::debug!(%peer, "no slice request in time; closing the stream");
            return refuse(
                &mut stream,
                ErrorCode::BadRequest,
                "no request within the time limit",
            )
            .await;
        }
        Ok(Err(e)) => {
            tracing::debug!(%peer, error = %e, "malformed slice request");
            return refuse(&mut stream, ErrorCode::BadRequest, &e.to_string()).await;
        }
        Ok(Ok(request)) => request,
    };
    if !admitted {
        return refuse(
            &mut stream,
            ErrorCode::Busy,
            &format!("at most {} concurrent slices per peer", limits.per_peer),
        )
        .await;
    }
    let Ok(_permit) = global.acquire().await else {
        return;
    };
    let dataset = catalog.read().ok().and_then(|c| c.get(&request.dataset));
    let Some(dataset) = dataset else {
        return refuse(
            &mut stream,
            ErrorCode::UnknownDataset,
            &format!("this node does not serve {:?}", request.dataset),
        )
        .await;
    };
    let count = dataset.manifest().slices.len() as u64;
    let (Some(entry), Some(path)) = (
        usize::try_from(request.slice)
            .ok()
            .and_then(|i| dataset.manifest().slices.get(i)),
        dataset.slice_path(request.slice),
    ) else {
        return refuse(
            &mut stream,
            ErrorCode::SliceOutOfRange,
            &format!(
                "slice {} requested; {:?} has slices 0..{count}",
                request.slice, request.dataset
            ),
        )
        .await;
    };
    if request.offset > entry.size {
        return refuse(
            &mut stream,
            ErrorCode::OffsetOutOfRange,
            &format!(
                "offset {} is past the slice's {} bytes",
                request.offset, entry.size
            ),
        )
        .await;
    }
    let mut file = match tokio::fs::File::open(&path).await {
        Ok(file) => file,
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot read a slice");
            return refuse(
                &mut stream,
                ErrorCode::Unavailable,
                "the slice cannot be read",
            )
            .await;
        }
    };
    if let Err(e) = file.seek(SeekFrom::Start(request.offset)).await {
        tracing::warn!(path = %path.display(), error = %e, "cannot seek in a slice");
        return refuse(
            &mut stream,
            ErrorCode::Unavailable,
            "the slice cannot be read",
        )
        .await;
    }
    let header = SliceHeader::Ok {
        size: entry.size,
        blake3: entry.blake3.clone(),
        offset: request.offset,
    };
    if protocol::write_frame(&mut stream, &header).await.is_err() {
        return;
    }
    let mut left = entry.size - request.offset;
    let mut buffer = vec![0u8; CHUNK];
    let mut sent = 0u64;
    while left > 0 {
        let want = buffer
            .len()
            .min(usize::try_from(left).unwrap_or(usize::MAX));
        let n = match file.read(&mut buffer[..want]).await {
            Ok(0) | Err(_) => break, // the file shrank or failed: the client's hash check catches it
            Ok(n) => n,
        };
        if stream.write_all(&buffer[..n]).await.is_err() {
            break; // the client went away
        }
        left -= n as u64;
        sent += n as u64;
    }
    hypha_telemetry::metrics::record_bytes(
        protocol::PROTOCOL_NAME,
        hypha_telemetry::metrics::Direction::Out,
        sent,
    );
    let _ = stream.close().await;
}

async fn refuse(stream: &mut hypha_network::Stream, code: ErrorCode, message: &str) {
    let header = SliceHeader::Error(ServeError::new(code, message));
    let _ = protocol::write_frame(stream, &header).await;
    let _ = stream.close().await;
}
