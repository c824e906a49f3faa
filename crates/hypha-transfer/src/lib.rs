//! The resource protocol, `/hypha/resource/1.0.0` on `libp2p-stream`: one file pushed to a
//! peer for the jobs of a task.
//!
//! ```text
//! sender → receiver   header:  frame {"task": "…", "name": "gradients.safetensors", "size": 123}
//! receiver → sender   answer:  frame "ready", {"resume": {"offset": N}},
//!                              or {"refused": {"code": "no_job", "message": "…"}}
//! sender → receiver   the bytes from 0 (ready) or from N (resume) to `size`, then frame
//!                     {"sha256": "<hex>"} (of the whole file)
//! receiver → sender   answer:  frame {"received": {"jobs": 1}}, or {"refused": {…}}
//! ```
//!
//! **Resuming.** A sender names the whole file's SHA-256 in its header (`"sha256"`; [`send`]
//! does for files of [`RESUMABLE_FROM_BYTES`] or more). A receiver may then keep the bytes of
//! a transfer of that file that broke off and, when the sender tries again, answer `resume`
//! with how many it holds: the sender sends only the rest. What was kept is checked with the
//! rest against the SHA-256 at the end, so a resumed file is the sender's byte for byte or is
//! refused `mismatch` (the receiver drops what it kept, and the sender's next try starts from
//! 0). Transfers of [`PROGRESS_FROM_BYTES`] or more log their progress at both ends.
//!
//! A header may name a file its sender **published** (`"published": {"peer", "name", "size",
//! "e_tag"}`, see `hypha_artifacts::published`) instead of carrying it: no bytes follow, and the
//! receiver answers `received` at once and fetches the file from the publisher and from the
//! other receivers of it, so that a file sent to many leaves the sender about once.
//!
//! (Frames are [`hypha_network::frame`]s.) The receiver answers before any bytes move, so a
//! refusal never costs the sender an upload; it takes a file only once the bytes match the
//! announced size and checksum and are on disk ([`receive_bytes`]). A sender retries what the
//! receiver expects to lift, and exchanges that broke off, for up to [`SEND_PATIENCE`]
//! ([`send`]).
//!
//! This crate owns the wire format, the limits of one exchange and both ends of it. Who may
//! receive what, and where a file goes once it arrived, is the receiver's business: a worker
//! hands it to the inboxes of the task's jobs, a scheduler keeps its parameter server's
//! checkpoints.

use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::Duration,
};

use futures::{AsyncReadExt, AsyncWriteExt};
use hypha_messages::artifact::Published;
use hypha_network::{
    Network, NetworkError, PeerId, StreamProtocol,
    frame::{FrameError, read_frame, write_frame},
};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt as _, AsyncSeekExt as _, AsyncWriteExt as _};

/// The protocol's name.
pub const PROTOCOL: StreamProtocol = StreamProtocol::new("/hypha/resource/1.1.0");
/// How long a sender has to send its header.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the bytes of a transfer may make no progress.
pub const STALL_TIMEOUT: Duration = Duration::from_secs(30);
/// The slowest a transfer's bytes may come, measured over every [`STALL_TIMEOUT`]: a sender
/// that trickles a byte now and then, never quite silent, still frees the receiver's slot.
pub use hypha_network::rate::MIN_BYTES_PER_SECOND;
/// The largest file a receiver takes, whatever its disk holds.
pub const MAX_TRANSFER_BYTES: u64 = 64 * 1024 * 1024 * 1024;
/// How long a sender keeps retrying a peer that refuses with `no_job`, `busy` or `inbox_full`,
/// or cannot be reached, unless told otherwise.
pub const SEND_PATIENCE: Duration = Duration::from_secs(30);

/// Files at least this large are sent resumably ([`send`] hashes them first, one read of the
/// file, and names the SHA-256 in the header). Below it a broken transfer costs little to
/// start again.
pub const RESUMABLE_FROM_BYTES: u64 = 16 * 1024 * 1024;
/// How many times a send that broke off after some progress gets its patience again.
const MAX_PATIENCE_RENEWALS: usize = 16;
/// Transfers at least this large log their progress, every [`PROGRESS_EVERY`].
pub const PROGRESS_FROM_BYTES: u64 = 256 * 1024 * 1024;
pub const PROGRESS_EVERY: Duration = Duration::from_secs(10);

const CHUNK: usize = 256 * 1024;

/// What a transfer carries, sent before its bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Header {
    /// The task whose jobs receive the file.
    pub task: String,
    /// The file's name: one path component.
    pub name: String,
    pub size: u64,
    /// The file is fetched from where it is published rather than sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub published: Option<Published>,
    /// SHA-256 of the whole file, hex: the transfer may be resumed (see the module's doc).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
}

impl Header {
    /// The SHA-256 the header names, when it is 64 hex digits (a receiver resumes nothing else).
    pub fn resumable_sha256(&self) -> Option<&str> {
        self.sha256
            .as_deref()
            .filter(|hash| hash.len() == 64 && hash.bytes().all(|b| b.is_ascii_hexdigit()))
    }
}

/// Sent after the bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Trailer {
    /// SHA-256 of the bytes, hex.
    pub sha256: String,
}

/// The receiver's answer to a header, and again to the bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Answer {
    Ready,
    /// Send the bytes from `offset` on: the receiver holds those before it.
    Resume {
        offset: u64,
    },
    Received {
        jobs: usize,
    },
    Refused(Refusal),
}

/// Why a receiver did not take a transfer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{code:?}: {message}")]
pub struct Refusal {
    pub code: RefusalCode,
    pub message: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RefusalCode {
    /// The header was malformed, too large, or named no plain file.
    BadRequest,
    /// No job of the task runs on the receiving worker (yet).
    NoJob,
    /// Every job of the task has as many files waiting as the receiver keeps.
    InboxFull,
    /// The sender runs no job of the task, as far as the receiver's scheduler told it (the
    /// news of a job just dispatched may still be on its way).
    NotInTask,
    /// The receiver takes no more transfers at once.
    Busy,
    /// The bytes did not come whole: they ended early, stalled or broke off.
    Corrupt,
    /// The bytes, all there, did not hash to the checksum announced.
    Mismatch,
    /// The receiver could not store the file.
    Io,
    /// The file is larger than the receiver takes ([`MAX_TRANSFER_BYTES`]) or has room for.
    TooLarge,
    /// The bytes came slower than [`MIN_BYTES_PER_SECOND`].
    TooSlow,
}

impl RefusalCode {
    /// Whether the same transfer may succeed a little later.
    fn is_transient(self) -> bool {
        matches!(
            self,
            RefusalCode::NoJob
                | RefusalCode::Busy
                | RefusalCode::InboxFull
                | RefusalCode::NotInTask
                | RefusalCode::TooSlow
        )
    }
}

impl Refusal {
    pub fn new(code: RefusalCode, message: impl Into<String>) -> Self {
        Refusal {
            code,
            message: message.into(),
        }
    }
}

/// Reads a transfer's header, allowing the sender [`HEADER_TIMEOUT`].
pub async fn read_header(stream: &mut hypha_network::Stream) -> Result<Header, Refusal> {
    tokio::time::timeout(HEADER_TIMEOUT, read_frame(stream))
        .await
        .map_err(|_| Refusal::new(RefusalCode::BadRequest, "no header within 10 s"))?
        .map_err(|e| Refusal::new(RefusalCode::BadRequest, e.to_string()))
}

/// What arrived of a file so far: its first `bytes` bytes and their SHA-256 state. A receiver
/// that keeps the bytes of a transfer that broke off keeps this beside them, so that resuming
/// reads nothing back.
#[derive(Debug, Clone, Default)]
pub struct Received {
    bytes: u64,
    hasher: Sha256,
}

impl Received {
    /// How many bytes arrived.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

/// Reads the bytes of a file of `size` bytes from `received.bytes()` on, and the trailer, into
/// `file`, which holds those before already; returns `sha256:<hex>` when the trailer's checksum
/// matches the whole file. `received` follows every byte written, so after a failure it says
/// what `file` holds (anything past it is cut off when the transfer resumes). The bytes may
/// stall for at most [`STALL_TIMEOUT`], and must come at [`MIN_BYTES_PER_SECOND`] on average
/// over each such period. `peer` names the sender in progress logs.
pub async fn receive_bytes(
    stream: &mut hypha_network::Stream,
    file: std::fs::File,
    size: u64,
    received: &mut Received,
    peer: PeerId,
) -> Result<String, Refusal> {
    let corrupt = |m: String| Refusal::new(RefusalCode::Corrupt, m);
    let io = |e: std::io::Error| Refusal::new(RefusalCode::Io, e.to_string());
    let from = received.bytes;
    if from > size {
        return Err(Refusal::new(
            RefusalCode::BadRequest,
            format!("resuming at {from} of {size} bytes"),
        ));
    }
    // Bytes written after the last that `received` counts (a write that failed half-way).
    file.set_len(from).map_err(io)?;
    let mut file = tokio::fs::File::from_std(file);
    file.seek(std::io::SeekFrom::Start(from))
        .await
        .map_err(io)?;
    let mut buffer = vec![0u8; CHUNK];
    let mut rate = hypha_network::rate::RateFloor::new(STALL_TIMEOUT, MIN_BYTES_PER_SECOND);
    let mut progress = Progress::new("receiving", peer, size, from);
    while received.bytes < size {
        let want = buffer
            .len()
            .min(usize::try_from(size - received.bytes).unwrap_or(usize::MAX));
        let read = tokio::time::timeout(STALL_TIMEOUT, stream.read(&mut buffer[..want]))
            .await
            .map_err(|_| corrupt(format!("the bytes stalled for {STALL_TIMEOUT:?}")))?
            .map_err(|e| corrupt(format!("the transfer broke off: {e}")))?;
        if read == 0 {
            return Err(corrupt(format!(
                "the transfer ended after {} of {size} bytes",
                received.bytes
            )));
        }
        file.write_all(&buffer[..read]).await.map_err(io)?;
        received.hasher.update(&buffer[..read]);
        received.bytes += read as u64;
        progress.add(read as u64);
        if !rate.add(read as u64, tokio::time::Instant::now()) {
            return Err(Refusal::new(
                RefusalCode::TooSlow,
                format!(
                    "the bytes came slower than {} KiB/s over {STALL_TIMEOUT:?}",
                    MIN_BYTES_PER_SECOND / 1024
                ),
            ));
        }
    }
    // Written bytes reach the disk before the checksum is awaited: a tokio file buffers.
    file.flush().await.map_err(io)?;
    let trailer: Trailer = tokio::time::timeout(STALL_TIMEOUT, read_frame(stream))
        .await
        .map_err(|_| corrupt("no checksum after the bytes".into()))?
        .map_err(|e| corrupt(format!("no checksum after the bytes: {e}")))?;
    let actual = hex::encode(received.hasher.clone().finalize());
    if !trailer.sha256.eq_ignore_ascii_case(&actual) {
        return Err(Refusal::new(
            RefusalCode::Mismatch,
            format!(
                "the bytes hash to {actual}, the sender announced {}",
                trailer.sha256
            ),
        ));
    }
    file.sync_all().await.map_err(io)?;
    Ok(format!("sha256:{actual}"))
}

/// The SHA-256 of the first `length` bytes of `file`, hex, read with `pread` (its position is
/// left alone): what a sender names in a resumable transfer's header.
pub fn sha256_of(file: &std::fs::File, length: u64) -> std::io::Result<String> {
    use std::os::unix::fs::FileExt;
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; 1 << 20];
    let mut at = 0;
    while at < length {
        let want = buffer
            .len()
            .min(usize::try_from(length - at).unwrap_or(usize::MAX));
        let read = file.read_at(&mut buffer[..want], at)?;
        if read == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!("the file ends at byte {at}, before {length}"),
            ));
        }
        hasher.update(&buffer[..read]);
        at += read as u64;
    }
    Ok(hex::encode(hasher.finalize()))
}

/// Logs a large transfer's progress every [`PROGRESS_EVERY`] at info.
struct Progress {
    /// "sending" or "receiving".
    doing: &'static str,
    peer: PeerId,
    size: u64,
    at: u64,
    resumed_at: u64,
    started: tokio::time::Instant,
    next_log: tokio::time::Instant,
}

impl Progress {
    fn new(doing: &'static str, peer: PeerId, size: u64, from: u64) -> Self {
        let now = tokio::time::Instant::now();
        if from > 0 {
            tracing::info!(%peer, size, "{doing} a file again from byte {from}, where its last transfer broke off");
        }
        Progress {
            doing,
            peer,
            size,
            at: from,
            resumed_at: from,
            started: now,
            next_log: now + PROGRESS_EVERY,
        }
    }

    fn add(&mut self, bytes: u64) {
        self.at += bytes;
        let now = tokio::time::Instant::now();
        if self.size < PROGRESS_FROM_BYTES || now < self.next_log {
            return;
        }
        self.next_log = now + PROGRESS_EVERY;
        let seconds = now.duration_since(self.started).as_secs_f64().max(1e-3);
        let rate = (self.at - self.resumed_at) as f64 / seconds / 1e6;
        tracing::info!(
            peer = %self.peer,
            "{} a file: {} of {} MB ({:.0} %, {rate:.1} MB/s)",
            self.doing,
            self.at / 1_000_000,
            self.size / 1_000_000,
            100.0 * self.at as f64 / self.size as f64,
        );
    }
}

/// A transfer that did not complete.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    #[error("{0}")]
    Network(#[from] NetworkError),
    #[error("the exchange broke off: {0}")]
    Frame(#[from] FrameError),
    #[error("reading the file: {0}")]
    File(std::io::Error),
    #[error("the peer refused it: {0}")]
    Refused(Refusal),
    #[error("the peer refused a resumed transfer: {0}")]
    ResumedMismatch(Refusal),
    #[error("the peer answered out of turn")]
    Protocol,
    #[error("the peer went silent for {0:?}")]
    Stalled(Duration),
}

impl SendError {
    /// Worth another try: a refusal the receiver expects to lift, or an exchange that broke
    /// off (a connection replaced mid-transfer, say). Not a peer that does not speak the
    /// transfer protocol, nor one whose certificate does not allow it.
    fn is_transient(&self) -> bool {
        match self {
            SendError::Refused(refusal) => refusal.code.is_transient(),
            SendError::Network(NetworkError::Request { failure, .. }) => failure.is_transient(),
            SendError::Network(NetworkError::Role { .. }) => false,
            SendError::Network(_)
            | SendError::Frame(_)
            | SendError::Stalled(_)
            | SendError::ResumedMismatch(_) => true,
            SendError::File(_) | SendError::Protocol => false,
        }
    }
}

/// Sends `size` bytes of `file` to the jobs of `task` on `peer`, trying again for up to
/// `patience` (no new try starts after it; [`SEND_PATIENCE`] unless the caller has its own
/// way to find out whether the peer is still there) while the peer refuses for now, cannot be
/// reached or the exchange breaks off; returns `sha256:<hex>` of what was sent.
///
/// A file of [`RESUMABLE_FROM_BYTES`] or more is hashed first and its SHA-256 named in the
/// header, so that a try after one that broke off sends only what the receiver lacks.
///
/// A receiver delivers a file only once its checksum matched, so a retried transfer is
/// delivered once, unless the receiver's last answer was lost after it delivered: then the
/// receiving job sees the file twice (DiLoCo's parameter server drops a second update of a
/// round from the same peer).
pub async fn send(
    network: &Network,
    peer: PeerId,
    header: &Header,
    file: std::fs::File,
    patience: Duration,
) -> Result<String, SendError> {
    let mut header = header.clone();
    if header.size >= RESUMABLE_FROM_BYTES && header.sha256.is_none() {
        let length = header.size;
        let hashed = file.try_clone().map_err(SendError::File)?;
        let sha256 = tokio::task::spawn_blocking(move || sha256_of(&hashed, length))
            .await
            .map_err(|e| SendError::File(std::io::Error::other(e)))?
            .map_err(SendError::File)?;
        header.sha256 = Some(sha256);
    }
    let header = &header;
    let moved = AtomicU64::new(0);
    for _ in 0..MAX_PATIENCE_RENEWALS {
        let before = moved.load(Ordering::Relaxed);
        let outcome = retrying(peer, patience, || {
            // Each try reads through its own handle on the file, from where the receiver says.
            let file = file.try_clone();
            let moved = &moved;
            async move {
                let file = tokio::fs::File::from_std(file.map_err(SendError::File)?);
                attempt(network, peer, header, file, moved).await
            }
        })
        .await;
        match outcome {
            // Tries that moved bytes earn the transfer another `patience`: a large file on a
            // link that breaks now and then gets through a piece at a time.
            Err(error) if error.is_transient() && moved.load(Ordering::Relaxed) > before => {
                tracing::debug!(%peer, %error, "a resource transfer broke off after progress; trying on");
            }
            outcome => return outcome,
        }
    }
    Err(SendError::Stalled(patience))
}

/// Tells `peer` to fetch the file `header` names as published (see the module's
/// documentation), trying again as [`send`] does. Returns once the peer took the fetch on,
/// before it has the file.
pub async fn send_published(
    network: &Network,
    peer: PeerId,
    header: &Header,
    patience: Duration,
) -> Result<(), SendError> {
    if header.published.is_none() {
        return Err(SendError::Protocol);
    }
    retrying(peer, patience, || async {
        let mut stream = network.open_stream(peer, PROTOCOL).await?;
        within(HEADER_TIMEOUT, write_frame(&mut stream, header)).await?;
        match within(HEADER_TIMEOUT, read_frame::<Answer>(&mut stream)).await? {
            Answer::Received { .. } => Ok(String::new()),
            Answer::Refused(refusal) => Err(SendError::Refused(refusal)),
            Answer::Ready | Answer::Resume { .. } => Err(SendError::Protocol),
        }
    })
    .await
    .map(drop)
}

/// Runs `once` until it succeeds, fails for good, or `patience` is spent.
async fn retrying<F: std::future::Future<Output = Result<String, SendError>>>(
    peer: PeerId,
    patience: Duration,
    mut once: impl FnMut() -> F,
) -> Result<String, SendError> {
    let give_up = tokio::time::Instant::now() + patience;
    let mut backoff = Duration::from_millis(100);
    loop {
        match once().await {
            Err(error)
                if error.is_transient() && tokio::time::Instant::now() + backoff < give_up =>
            {
                tracing::debug!(%peer, %error, "resource transfer did not go through; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
            outcome => return outcome,
        }
    }
}

/// `step` of an exchange, which fails once the peer has been silent for `limit`: a receiver
/// that stops answering or reading never holds a sender up for good.
async fn within<T, E>(
    limit: Duration,
    step: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, SendError>
where
    SendError: From<E>,
{
    match tokio::time::timeout(limit, step).await {
        Ok(done) => done.map_err(SendError::from),
        Err(_) => Err(SendError::Stalled(limit)),
    }
}

/// One try of [`send`].
async fn attempt(
    network: &Network,
    peer: PeerId,
    header: &Header,
    mut file: tokio::fs::File,
    moved: &AtomicU64,
) -> Result<String, SendError> {
    let mut stream = network.open_stream(peer, PROTOCOL).await?;
    within(HEADER_TIMEOUT, write_frame(&mut stream, header)).await?;
    let from = match within(HEADER_TIMEOUT, read_frame::<Answer>(&mut stream)).await? {
        Answer::Ready => 0,
        // Only a file whose hash the header named can be resumed: the trailer must cover
        // bytes this try does not read.
        Answer::Resume { offset } if offset <= header.size && header.sha256.is_some() => offset,
        Answer::Refused(refusal) => return Err(SendError::Refused(refusal)),
        Answer::Resume { .. } | Answer::Received { .. } => return Err(SendError::Protocol),
    };
    file.seek(std::io::SeekFrom::Start(from))
        .await
        .map_err(SendError::File)?;
    let mut hasher = header.sha256.is_none().then(Sha256::new);
    let mut left = header.size - from;
    let mut buffer = vec![0u8; CHUNK];
    let mut progress = Progress::new("sending", peer, header.size, from);
    while left > 0 {
        let want = buffer
            .len()
            .min(usize::try_from(left).unwrap_or(usize::MAX));
        let read = file
            .read(&mut buffer[..want])
            .await
            .map_err(SendError::File)?;
        if read == 0 {
            return Err(SendError::File(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the file shrank while it was sent",
            )));
        }
        if let Some(hasher) = &mut hasher {
            hasher.update(&buffer[..read]);
        }
        let chunk = &buffer[..read];
        within(STALL_TIMEOUT, async {
            stream.write_all(chunk).await.map_err(FrameError::from)
        })
        .await?;
        left -= read as u64;
        moved.fetch_add(read as u64, Ordering::Relaxed);
        progress.add(read as u64);
    }
    let sha256 = match (hasher, &header.sha256) {
        (Some(hasher), _) => hex::encode(hasher.finalize()),
        (None, Some(named)) => named.clone(),
        (None, None) => return Err(SendError::Protocol),
    };
    let trailer = Trailer {
        sha256: sha256.clone(),
    };
    within(STALL_TIMEOUT, write_frame(&mut stream, &trailer)).await?;
    match within(STALL_TIMEOUT, read_frame::<Answer>(&mut stream)).await? {
        Answer::Received { .. } => Ok(format!("sha256:{sha256}")),
        // What the receiver kept did not add up with the rest to the file's hash (its disk
        // lost it, say): it has dropped it, and the next try starts from 0.
        Answer::Refused(refusal) if from > 0 && refusal.code == RefusalCode::Mismatch => {
            Err(SendError::ResumedMismatch(refusal))
        }
        Answer::Refused(refusal) => Err(SendError::Refused(refusal)),
        Answer::Ready | Answer::Resume { .. } => Err(SendError::Protocol),
    }
}
