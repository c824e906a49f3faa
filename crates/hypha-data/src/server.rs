//! Serving slices to many clients at once.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, RwLock},
    time::Duration,
};

use futures::AsyncWriteExt;
use hypha_dataset::{Dataset, SliceEntry};
use hypha_network::{
    Network, PeerId,
    rate::{MIN_BYTES_PER_SECOND, RateFloor},
};
use tokio::sync::Semaphore;

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
    /// The slowest a client may read, in bytes a second, measured over every `stall_timeout`:
    /// a client that reads a little now and then, never stalling, would otherwise hold its
    /// slots for as long as it likes (eight such peers would hold all 64). Default:
    /// [`MIN_BYTES_PER_SECOND`], the floor a receiver holds its senders to.
    pub min_send_rate: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            concurrent: 64,
            per_peer: 8,
            queued_per_peer: 64,
            request_timeout: Duration::from_secs(10),
            stall_timeout: Duration::from_secs(30),
            min_send_rate: MIN_BYTES_PER_SECOND,
        }
    }
}

/// Bytes read from disk and written to a stream at a time: a transfer's buffer, however large
/// the slice.
const CHUNK: usize = 256 * 1024;

/// Serves slices of the datasets in `catalog` until the network stops accepting streams.
pub async fn serve(network: Network, catalog: Arc<RwLock<Catalog>>, limits: Limits) {
    let incoming = match network.accept_streams(PROTOCOL) {
        Ok(incoming) => incoming,
        Err(e) => {
            tracing::error!(error = %e, "cannot serve slices");
            return;
        }
    };
    let global = Arc::new(Semaphore::new(limits.concurrent.max(1)));
    let peers: Arc<Mutex<HashMap<PeerId, Arc<PeerQueue>>>> = Arc::default();
    hypha_network::frame::serve_each(incoming, |peer, stream| {
        let catalog = catalog.clone();
        let global = global.clone();
        let limits = limits.clone();
        let admission = Admission::new(peers.clone(), peer, &limits);
        Some(async move {
            serve_one(stream, peer, &catalog, &global, admission, &limits).await;
        })
    })
    .await;
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
    let found = find_slice(&dataset, &request);
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
    let file = match tokio::fs::File::open(&path).await {
        Ok(file) => file.into_std().await,
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
    let header = SliceHeader::Ok {
        size: entry.size,
        blake3: entry.blake3.clone(),
        offset: request.offset,
    };
    if protocol::write_frame(&mut stream, &header).await.is_err() {
        return;
    }
    let sent = send_slice(&mut stream, file, request.offset, entry.size, limits, peer).await;
    hypha_telemetry::metrics::record_bytes(
        protocol::PROTOCOL_NAME,
        hypha_telemetry::metrics::Direction::Out,
        sent,
    );
    let _ = stream.close().await;
}

/// The manifest entry and the file of the slice `request` names, by file or by index, or
/// why there is none.
fn find_slice(
    dataset: &Dataset,
    request: &SliceRequest,
) -> Result<(SliceEntry, std::path::PathBuf), (ErrorCode, String)> {
    let count = dataset.manifest().slices.len() as u64;
    match &request.file {
        Some(file) => dataset
            .manifest()
            .slices
            .iter()
            .find(|e| &e.file == file)
            .map(|e| (e.clone(), dataset.root().join(&e.file)))
            .ok_or((
                ErrorCode::UnknownSlice,
                format!("{:?} has no slice file {file:?}", request.dataset),
            )),
        None => usize::try_from(request.slice)
            .ok()
            .and_then(|i| dataset.manifest().slices.get(i).cloned())
            .zip(dataset.slice_path(request.slice))
            .ok_or((
                ErrorCode::SliceOutOfRange,
                format!(
                    "slice {} requested; {:?} has slices 0..{count}",
                    request.slice, request.dataset
                ),
            )),
    }
}

/// Sends a slice's bytes from `offset` to its `size`; the bytes sent. A read error or a file
/// that shrank ends the stream early (the client's hash and size checks catch it and it goes
/// to another provider), as does a client that stops reading or reads too slowly.
async fn send_slice(
    stream: &mut hypha_network::Stream,
    file: std::fs::File,
    offset: u64,
    size: u64,
    limits: &Limits,
    peer: PeerId,
) -> u64 {
    let mut reader = SliceReader::new(file, offset, size);
    let mut rate = RateFloor::new(limits.stall_timeout, limits.min_send_rate);
    let mut sent = 0u64;
    while let Ok(chunk) = reader.next().await {
        if chunk.is_empty() {
            break;
        }
        match tokio::time::timeout(limits.stall_timeout, stream.write_all(chunk)).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => break, // the client went away
            Err(_) => {
                tracing::debug!(%peer, "the client stopped reading; abandoning the transfer");
                break;
            }
        }
        sent += chunk.len() as u64;
        // Measured chunk by chunk: a chunk takes at most `stall_timeout`, so a client that
        // reads too slowly is let go within two of them.
        if !rate.add(chunk.len() as u64, tokio::time::Instant::now()) {
            tracing::debug!(
                %peer,
                "the client reads slower than {} KiB/s; abandoning the transfer",
                limits.min_send_rate / 1024
            );
            break;
        }
    }
    sent
}

/// Reads a slice file chunk by chunk into one buffer.
///
/// A chunk already in the page cache (the usual case for a node serving the same slices to
/// many workers) is read on the async task with `preadv2(RWF_NOWAIT)`, which never waits for
/// the disk; only a chunk that must come from the disk is read on a blocking thread. Reading
/// every chunk on a blocking thread cost two thread switches per chunk, and those were the data
/// node's largest cost (BENCHMARKS.md, dataserve).
struct SliceReader {
    file: Arc<std::fs::File>,
    offset: u64,
    end: u64,
    buffer: Vec<u8>,
}

impl SliceReader {
    /// Reads `file` from byte `offset` up to byte `end`.
    fn new(file: std::fs::File, offset: u64, end: u64) -> Self {
        SliceReader {
            file: Arc::new(file),
            offset,
            end,
            buffer: vec![0; CHUNK],
        }
    }

    /// The next chunk; empty at the end, or when the file ended early.
    async fn next(&mut self) -> std::io::Result<&[u8]> {
        let want = usize::try_from(self.end.saturating_sub(self.offset))
            .map_or(CHUNK, |left| left.min(CHUNK));
        if want == 0 {
            return Ok(&[]);
        }
        let read = match read_cached(&self.file, &mut self.buffer[..want], self.offset) {
            Some(read) => read?,
            None => {
                let (file, offset) = (self.file.clone(), self.offset);
                let mut buffer = std::mem::take(&mut self.buffer);
                let (buffer, read) = tokio::task::spawn_blocking(move || {
                    use std::os::unix::fs::FileExt;
                    let read = file.read_at(&mut buffer[..want], offset);
                    (buffer, read)
                })
                .await
                .map_err(std::io::Error::other)?;
                self.buffer = buffer;
                read?
            }
        };
        self.offset += read as u64;
        Ok(&self.buffer[..read])
    }
}

/// Reads from the page cache only: `None` when the bytes would have to come from the disk
/// (or the kernel cannot tell), so that the caller reads them on a blocking thread.
#[cfg(target_os = "linux")]
fn read_cached(
    file: &std::fs::File,
    buffer: &mut [u8],
    offset: u64,
) -> Option<std::io::Result<usize>> {
    use rustix::io::{Errno, ReadWriteFlags};
    let mut slices = [std::io::IoSliceMut::new(buffer)];
    loop {
        match rustix::io::preadv2(file, &mut slices, offset, ReadWriteFlags::NOWAIT) {
            Ok(read) => return Some(Ok(read)),
            Err(Errno::INTR) => {}
            // EAGAIN: not all in the cache. EOPNOTSUPP: the file system cannot tell. ENOSYS,
            // EINVAL: a kernel before 4.14. The blocking read answers all of them.
            Err(Errno::AGAIN | Errno::OPNOTSUPP | Errno::NOSYS | Errno::INVAL) => return None,
            Err(e) => return Some(Err(e.into())),
        }
    }
}

#[cfg(not(target_os = "linux"))]
fn read_cached(_: &std::fs::File, _: &mut [u8], _: u64) -> Option<std::io::Result<usize>> {
    None
}

async fn refuse(stream: &mut hypha_network::Stream, code: ErrorCode, message: &str) {
    let header = SliceHeader::Error(ServeError::new(code, message));
    let _ = protocol::write_frame(stream, &header).await;
    let _ = stream.close().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn read_all(reader: &mut SliceReader) -> Vec<u8> {
        let mut read = Vec::new();
        loop {
            let chunk = reader.next().await.unwrap();
            if chunk.is_empty() {
                return read;
            }
            assert!(chunk.len() <= CHUNK);
            read.extend_from_slice(chunk);
        }
    }

    #[tokio::test]
    async fn a_slice_reader_returns_the_bytes_from_its_offset_and_stops_where_the_file_ends() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("slice");
        let bytes: Vec<u8> = (0..CHUNK * 2 + 1234).map(|i| (i % 251) as u8).collect();
        std::fs::write(&path, &bytes).unwrap();

        let open = || std::fs::File::open(&path).unwrap();
        let offset = CHUNK as u64 - 10;
        let mut reader = SliceReader::new(open(), offset, bytes.len() as u64);
        assert!(read_all(&mut reader).await == bytes[offset as usize..]);

        // The file shrank since the manifest was written: the bytes there are, then the end.
        let mut reader = SliceReader::new(open(), 0, bytes.len() as u64 + 5000);
        assert!(read_all(&mut reader).await == bytes);
    }
}
