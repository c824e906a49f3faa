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
    /// Slices one peer may be sent at the same time. Its further requests wait in its own
    /// queue, so one greedy client never fills the global one. Default: 8.
    pub per_peer: usize,
    /// Requests one peer may have open (sending or waiting) before new ones are answered
    /// `Busy` at once. Default: 64.
    pub queued_per_peer: usize,
    /// How long a client may take to send its request. Default: 10 s.
    pub request_timeout: Duration,
    /// How long a send may make no progress (the client stopped reading) before the server
    /// gives up on the stream and frees its slot. Default: 30 s.
    pub stall_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            concurrent: 64,
            per_peer: 8,
            queued_per_peer: 64,
            request_timeout: Duration::from_secs(10),
            stall_timeout: Duration::from_secs(30),
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
    let peers: Arc<Mutex<HashMap<PeerId, Arc<PeerQueue>>>> = Arc::default();
    while let Some((peer, stream)) = incoming.next().await {
        let catalog = catalog.clone();
        let global = global.clone();
        let limits = limits.clone();
        let admission = Admission::new(peers.clone(), peer, &limits);
        tokio::spawn(async move {
            serve_one(stream, peer, &catalog, &global, admission, &limits).await;
        });
    }
}

/// One peer's requests: at most `per_peer` being sent, the rest waiting in arrival order.
#[derive(Debug)]
struct PeerQueue {
    sending: Semaphore,
    open: std::sync::atomic::AtomicUsize,
}

/// A request's place in its peer's queue; leaving it (however the request ends) frees it.
struct Admission {
    peers: Arc<Mutex<HashMap<PeerId, Arc<PeerQueue>>>>,
    peer: PeerId,
    /// `None` when the peer already had too many requests open.
    queue: Option<Arc<PeerQueue>>,
}

impl Admission {
    fn new(
        peers: Arc<Mutex<HashMap<PeerId, Arc<PeerQueue>>>>,
        peer: PeerId,
        limits: &Limits,
    ) -> Self {
        use std::sync::atomic::Ordering;
        let queue = peers.lock().ok().and_then(|mut map| {
            let queue = map
                .entry(peer)
                .or_insert_with(|| {
                    Arc::new(PeerQueue {
                        sending: Semaphore::new(limits.per_peer.max(1)),
                        open: Default::default(),
                    })
                })
                .clone();
            (queue.open.fetch_add(1, Ordering::SeqCst) < limits.queued_per_peer.max(1))
                .then_some(queue)
        });
        Admission { peers, peer, queue }
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        use std::sync::atomic::Ordering;
        if let Ok(mut map) = self.peers.lock()
            && let Some(queue) = map.get(&self.peer)
            && queue.open.fetch_sub(1, Ordering::SeqCst) == 1
        {
            map.remove(&self.peer);
        }
    }
}

async fn serve_one(
    mut stream: hypha_network::Stream,
    peer: PeerId,
    catalog: &RwLock<Catalog>,
    global: &Semaphore,
    admission: Admission,
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
    let Some(queue) = &admission.queue else {
        return refuse(
            &mut stream,
            ErrorCode::Busy,
            &format!("at most {} open requests per peer", limits.queued_per_peer),
        )
        .await;
    };
    // The peer's own turn first, then a global one: a peer never holds more than `per_peer`
    // of the global slots, and each queue is served in arrival order.
    let Ok(_peer_turn) = queue.sending.acquire().await else {
        return;
    };
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
    let found = match &request.file {
        Some(file) => dataset
            .manifest()
            .slices
            .iter()
            .find(|e| &e.file == file)
            .map(|e| (e, dataset.root().join(&e.file)))
            .ok_or((
                ErrorCode::UnknownSlice,
                format!("{:?} has no slice file {file:?}", request.dataset),
            )),
        None => usize::try_from(request.slice)
            .ok()
            .and_then(|i| dataset.manifest().slices.get(i))
            .zip(dataset.slice_path(request.slice))
            .ok_or((
                ErrorCode::SliceOutOfRange,
                format!(
                    "slice {} requested; {:?} has slices 0..{count}",
                    request.slice, request.dataset
                ),
            )),
    };
    let (entry, path) = match found {
        Ok(found) => found,
        Err((code, message)) => return refuse(&mut stream, code, &message).await,
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
        match tokio::time::timeout(limits.stall_timeout, stream.write_all(&buffer[..n])).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => break, // the client went away
            Err(_) => {
                tracing::debug!(%peer, "the client stopped reading; abandoning the transfer");
                break;
            }
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
