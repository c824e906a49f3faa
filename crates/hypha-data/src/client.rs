//! Fetching slices: find providers, get manifests, download with verification, resume and
//! fall back.

use std::{collections::HashSet, path::Path, time::Duration};

use futures::AsyncReadExt;
use hypha_dataset::{Manifest, SliceEntry};
use hypha_messages::{Request, Response};
use hypha_network::{
    Network, NetworkError, PeerId, Role,
    frame::{AskError, ask},
    rate::{MIN_BYTES_PER_SECOND, RateFloor},
};
use tokio::io::AsyncWriteExt;

use crate::protocol::{self, PROTOCOL, SliceHeader, SliceRequest};

/// A slice could not be fetched from any provider.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("no provider of {dataset:?} was found in the DHT")]
    NoProviders { dataset: String },
    #[error("every provider failed for slice {slice} of {dataset:?}: {}", failures.join("; "))]
    Exhausted {
        dataset: String,
        slice: u64,
        failures: Vec<String>,
    },
    #[error("{0}")]
    Network(#[from] NetworkError),
    #[error("{peer} sent an unexpected answer to a manifest request")]
    UnexpectedResponse { peer: PeerId },
    #[error("cannot write {path}: {error}")]
    Write {
        path: std::path::PathBuf,
        error: std::io::Error,
    },
}

/// How a fetch went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FetchReport {
    /// The provider that sent the last byte.
    pub provider: PeerId,
    /// Bytes received over the network (more than the slice when a transfer was restarted).
    pub bytes_received: u64,
    /// Providers whose bytes did not match the manifest's hash (not asked again).
    pub rejected: Vec<PeerId>,
    /// Transfers that broke off and were resumed from the offset reached.
    pub resumed: u32,
}

/// What names a slice on the wire and checks it on arrival: its index in the dataset and the
/// size and BLAKE3 (hex) of its file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SliceId {
    pub index: u64,
    /// When set, the slice is asked for by file name (datasets sharded over data nodes).
    pub file: Option<String>,
    pub size: u64,
    pub blake3: String,
}

impl From<&SliceEntry> for SliceId {
    fn from(entry: &SliceEntry) -> Self {
        Self {
            index: entry.index,
            file: None,
            size: entry.size,
            blake3: entry.blake3.clone(),
        }
    }
}

/// How long a provider may take to answer a slice request before the next one is asked.
pub const ANSWER_DEADLINE: Duration = Duration::from_secs(10);
/// How long a provider may send nothing in the middle of a slice before the transfer goes on
/// from another; also the period over which its bytes must come at
/// [`MIN_BYTES_PER_SECOND`] (a provider that trickles is left too).
pub const STALL_DEADLINE: Duration = Duration::from_secs(30);

/// Fetches datasets' slices from data nodes over a node's network.
#[derive(Debug, Clone)]
pub struct DataClient {
    network: Network,
    answer_deadline: Duration,
    stall_deadline: Duration,
}

impl DataClient {
    pub fn new(network: Network) -> Self {
        DataClient {
            network,
            answer_deadline: ANSWER_DEADLINE,
            stall_deadline: STALL_DEADLINE,
        }
    }

    /// The same client with other deadlines than [`ANSWER_DEADLINE`] and [`STALL_DEADLINE`]:
    /// a provider that sends half an answer and goes silent is left after `answer`, one that
    /// stops mid-slice after `stall`.
    pub fn with_deadlines(mut self, answer: Duration, stall: Duration) -> Self {
        self.answer_deadline = answer;
        self.stall_deadline = stall;
        self
    }

    /// The data nodes that announce `dataset` in the DHT.
    pub async fn providers(&self, dataset: &str) -> Result<Vec<PeerId>, FetchError> {
        let mut providers: Vec<PeerId> = self
            .network
            .get_providers(protocol::provider_key(dataset))
            .await?
            .into_iter()
            .filter(|p| *p != self.network.local_peer_id())
            .collect();
        if providers.is_empty() {
            return Err(FetchError::NoProviders {
                dataset: dataset.to_string(),
            });
        }
        providers.sort();
        Ok(providers)
    }

    /// The manifest of `dataset` as `peer` serves it. Only a data node's counts: anyone can
    /// announce itself a provider in the DHT, but only a certificate with the data role makes
    /// one.
    pub async fn manifest(&self, peer: PeerId, dataset: &str) -> Result<Manifest, FetchError> {
        self.network.connect_as(peer, Role::Data).await?;
        match self
            .network
            .request(
                peer,
                Request::Manifest {
                    dataset: dataset.to_string(),
                },
            )
            .await?
        {
            Response::Manifest(manifest) => Ok(manifest),
            _ => Err(FetchError::UnexpectedResponse { peer }),
        }
    }

    /// Fetches slice `entry` of `dataset` into `dest`, verified against the entry's size and
    /// BLAKE3 hash.
    ///
    /// Providers are tried in turn. A transfer that breaks off resumes at the offset reached,
    /// from the next provider. A provider whose bytes fail the hash is not asked again and the
    /// transfer restarts from the beginning with another. `dest` appears only when complete
    /// and verified (temporary file, fsync, rename).
    pub async fn fetch_slice(
        &self,
        dataset: &str,
        entry: impl Into<SliceId>,
        providers: &[PeerId],
        dest: &Path,
    ) -> Result<FetchReport, FetchError> {
        let write_err = |error| FetchError::Write {
            path: dest.to_path_buf(),
            error,
        };
        let dir = dest
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let partial = tempfile::Builder::new()
            .prefix(".hypha-slice-")
            .tempfile_in(dir)
            .map_err(write_err)?;
        let mut sink = FileSink {
            file: tokio::fs::File::from_std(partial.reopen().map_err(write_err)?),
            buffer: vec![0; RECEIVE_BLOCK],
        };
        let report = self
            .fetch_into(dataset, &entry.into(), providers, &mut sink)
            .await
            .map_err(|e| e.into_fetch_error(dest))?;
        sink.file.sync_all().await.map_err(write_err)?;
        drop(sink);
        partial.persist(dest).map_err(|e| write_err(e.error))?;
        Ok(report)
    }

    /// Fetches slice `entry` of `dataset` into `buffer` (cleared first), verified as
    /// [`DataClient::fetch_slice`] verifies, with the same resumption and fallback: for
    /// consumers that use a slice at once and keep nothing on disk. A buffer reused from slice
    /// to slice spares the allocation and page faults of a fresh one each time.
    pub async fn fetch_slice_to_vec(
        &self,
        dataset: &str,
        entry: impl Into<SliceId>,
        providers: &[PeerId],
        buffer: &mut Vec<u8>,
    ) -> Result<FetchReport, FetchError> {
        let entry = entry.into();
        let mut sink = MemorySink::new(buffer, entry.size);
        let outcome = self.fetch_into(dataset, &entry, providers, &mut sink).await;
        sink.finish();
        // Appending to memory cannot fail, so no `Write` error ever names this path.
        outcome.map_err(|e| e.into_fetch_error(Path::new("memory")))
    }

    /// The provider loop behind both fetches: fills `sink` with the verified slice.
    async fn fetch_into(
        &self,
        dataset: &str,
        entry: &SliceId,
        providers: &[PeerId],
        sink: &mut impl Sink,
    ) -> Result<FetchReport, FetchIntoError> {
        let mut transfer = Transfer::default();
        let mut rejected: HashSet<PeerId> = HashSet::new();
        let mut failures = Vec::new();
        let mut resumed = 0u32;
        let mut bytes_received = 0u64;
        // Set once bytes of several providers failed the hash together: no more resuming
        // one provider's bytes with another's.
        let mut whole = false;
        // Each provider gets at most two turns: one break-off is forgiven, two are not.
        let turns: Vec<PeerId> = providers.iter().chain(providers.iter()).copied().collect();
        for peer in turns {
            if rejected.contains(&peer) {
                continue;
            }
            let started_at = transfer.offset;
            let outcome = self
                .receive(peer, dataset, entry, &mut transfer, sink)
                .await;
            bytes_received += transfer.offset - started_at;
            match outcome {
                Ok(()) if transfer.offset == entry.size => {
                    let hash = transfer.hasher.finalize().to_hex().to_string();
                    if hash == entry.blake3 {
                        return Ok(FetchReport {
                            provider: peer,
                            bytes_received,
                            rejected: rejected.into_iter().collect(),
                            resumed,
                        });
                    }
                    failures.push(format!("{peer}: bytes do not match the manifest's BLAKE3"));
                    let contributors: Vec<PeerId> = transfer.contributors.drain().collect();
                    if let [alone] = contributors[..] {
                        tracing::warn!(peer = %alone, slice = entry.index, dataset, "slice failed its hash; fetching it from another provider");
                        rejected.insert(alone);
                    } else {
                        // Which of them sent the bad bytes is not known, and rejecting them
                        // all would let one liar have an honest provider's slice refused:
                        // from now on each sends the slice whole, alone.
                        tracing::warn!(
                            slice = entry.index,
                            dataset,
                            contributors = contributors.len(),
                            "slice failed its hash; fetching it whole from one provider at a time"
                        );
                        whole = true;
                    }
                    transfer = Transfer::default();
                    sink.clear().await.map_err(FetchIntoError::Local)?;
                }
                Ok(()) => {
                    resumed += 1;
                    failures.push(format!("{peer}: stream ended at byte {}", transfer.offset));
                }
                Err(Failure::Refused(reason)) => failures.push(format!("{peer}: {reason}")),
                Err(Failure::Mismatch(reason)) => {
                    failures.push(format!("{peer}: {reason}"));
                    rejected.insert(peer);
                }
                Err(Failure::Broken(reason)) => {
                    if transfer.offset > started_at {
                        resumed += 1;
                    }
                    failures.push(format!("{peer}: {reason} at byte {}", transfer.offset));
                }
                Err(Failure::Local(error)) => return Err(FetchIntoError::Local(error)),
            }
            if whole && transfer.offset > 0 {
                transfer = Transfer::default();
                sink.clear().await.map_err(FetchIntoError::Local)?;
            }
        }
        Err(FetchIntoError::Fetch(FetchError::Exhausted {
            dataset: dataset.to_string(),
            slice: entry.index,
            failures,
        }))
    }

    /// Receives what `peer` sends of the slice from `transfer.offset` on, appending to `sink`.
    async fn receive(
        &self,
        peer: PeerId,
        dataset: &str,
        entry: &SliceId,
        transfer: &mut Transfer,
        sink: &mut impl Sink,
    ) -> Result<(), Failure> {
        let request = SliceRequest {
            dataset: dataset.to_string(),
            slice: entry.index,
            offset: transfer.offset,
            file: entry.file.clone(),
        };
        let silent = |limit: Duration| format!("sent nothing for {limit:?}");
        let (mut stream, answer) = ask::<_, SliceHeader>(
            &self.network,
            peer,
            PROTOCOL,
            &request,
            self.answer_deadline,
        )
        .await
        .map_err(|error| match error {
            AskError::Silent(limit) => Failure::Refused(silent(limit)),
            error => Failure::Refused(error.to_string()),
        })?;
        match answer {
            SliceHeader::Error(e) => return Err(Failure::Refused(e.to_string())),
            SliceHeader::Ok {
                size,
                blake3,
                offset,
            } => {
                if size != entry.size || blake3 != entry.blake3 {
                    return Err(Failure::Mismatch(format!(
                        "serves a different version of the slice ({size} bytes, BLAKE3 {blake3})"
                    )));
                }
                if offset != transfer.offset {
                    return Err(Failure::Mismatch(format!(
                        "answered offset {offset} to a request for {}",
                        transfer.offset
                    )));
                }
            }
        }
        transfer.contributors.insert(peer);
        let start = transfer.offset;
        let mut rate = RateFloor::new(self.stall_deadline, MIN_BYTES_PER_SECOND);
        while transfer.offset < entry.size {
            let want = RECEIVE_BLOCK
                .min(usize::try_from(entry.size - transfer.offset).unwrap_or(usize::MAX));
            let buffer = sink.next_block(want);
            let n = tokio::time::timeout(self.stall_deadline, stream.read(buffer))
                .await
                .map_err(|_| Failure::Broken(silent(self.stall_deadline)))?
                .map_err(|e| Failure::Broken(e.to_string()))?;
            if n == 0 {
                return Ok(());
            }
            transfer.hasher.update(&buffer[..n]);
            sink.commit(n).await.map_err(Failure::Local)?;
            transfer.offset += n as u64;
            if !rate.add(n as u64, tokio::time::Instant::now()) {
                // What came stays: the next provider goes on from this offset.
                return Err(Failure::Broken(format!(
                    "sent slower than {} KiB/s",
                    MIN_BYTES_PER_SECOND / 1024
                )));
            }
        }
        hypha_telemetry::metrics::record_bytes(
            protocol::PROTOCOL_NAME,
            hypha_telemetry::metrics::Direction::In,
            transfer.offset - start,
        );
        Ok(())
    }
}

/// The state of one slice download: bytes received so far (hashed as they arrive) and who
/// sent them.
#[derive(Default)]
struct Transfer {
    offset: u64,
    hasher: blake3::Hasher,
    contributors: HashSet<PeerId>,
}

enum Failure {
    /// The provider refused or could not be reached; try another.
    Refused(String),
    /// The provider serves something else; never ask it again for this slice.
    Mismatch(String),
    /// The transfer broke off; resume elsewhere.
    Broken(String),
    /// Writing locally failed: stop.
    Local(std::io::Error),
}

/// How [`DataClient::fetch_into`] failed: the fetch itself, or the sink it writes to (which
/// the caller names).
enum FetchIntoError {
    Fetch(FetchError),
    Local(std::io::Error),
}

impl FetchIntoError {
    fn into_fetch_error(self, dest: &Path) -> FetchError {
        match self {
            FetchIntoError::Fetch(e) => e,
            FetchIntoError::Local(error) => FetchError::Write {
                path: dest.to_path_buf(),
                error,
            },
        }
    }
}

/// Bytes read from the stream per step: hashed while they are still in the CPU's cache.
const RECEIVE_BLOCK: usize = 256 * 1024;

/// Where a slice's bytes go as they arrive. The stream is read straight into the sink's own
/// memory ([`Sink::next_block`]), so a sink that keeps the slice in memory copies nothing.
trait Sink {
    /// Memory for the next `len` bytes (at most), after those already committed.
    fn next_block(&mut self, len: usize) -> &mut [u8];
    /// Keeps the first `n` bytes of the last [`Sink::next_block`].
    async fn commit(&mut self, n: usize) -> std::io::Result<()>;
    /// Drops everything committed, for a transfer that starts over.
    async fn clear(&mut self) -> std::io::Result<()>;
}

/// A slice on its way to a file: each block is read into `buffer`, then written.
struct FileSink {
    file: tokio::fs::File,
    buffer: Vec<u8>,
}

impl Sink for FileSink {
    fn next_block(&mut self, len: usize) -> &mut [u8] {
        let len = len.min(self.buffer.len());
        &mut self.buffer[..len]
    }

    async fn commit(&mut self, n: usize) -> std::io::Result<()> {
        self.file.write_all(&self.buffer[..n]).await
    }

    async fn clear(&mut self) -> std::io::Result<()> {
        use tokio::io::AsyncSeekExt;
        self.file.set_len(0).await?;
        self.file.seek(std::io::SeekFrom::Start(0)).await?;
        Ok(())
    }
}

/// A slice on its way into a caller's buffer, read in place: the buffer is sized to the slice
/// up front and `filled` counts the bytes received.
struct MemorySink<'a> {
    buffer: &'a mut Vec<u8>,
    filled: usize,
}

impl<'a> MemorySink<'a> {
    fn new(buffer: &'a mut Vec<u8>, size: u64) -> Self {
        // The size comes from the manifest, not from the provider; cap it anyway, so that a
        // wrong manifest cannot make the buffer huge (a larger slice then grows it as it
        // arrives). A buffer as long as the slice is reused as it is: its stale bytes are all
        // overwritten, so it costs no pass to zero it. A shorter one with room is lengthened
        // in place; one without room is replaced by fresh zeroed memory, which the allocator
        // gets from the kernel already zeroed, where growing would copy the stale bytes.
        let size = usize::try_from(size.min(1 << 30)).unwrap_or(0);
        if buffer.len() >= size {
            buffer.truncate(size);
        } else if buffer.capacity() >= size {
            buffer.resize(size, 0);
        } else {
            *buffer = vec![0; size];
        }
        MemorySink { buffer, filled: 0 }
    }

    /// Leaves the buffer holding exactly the bytes received.
    fn finish(self) {
        self.buffer.truncate(self.filled);
    }
}

impl Sink for MemorySink<'_> {
    fn next_block(&mut self, len: usize) -> &mut [u8] {
        let end = self.filled + len;
        if self.buffer.len() < end {
            self.buffer.resize(end, 0);
        }
        &mut self.buffer[self.filled..end]
    }

    async fn commit(&mut self, n: usize) -> std::io::Result<()> {
        self.filled += n;
        Ok(())
    }

    async fn clear(&mut self) -> std::io::Result<()> {
        self.filled = 0;
        Ok(())
    }
}
