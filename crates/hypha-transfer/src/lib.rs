//! The resource protocol, `/hypha/resource/1.0.0` on `libp2p-stream`: one file pushed to a
//! peer for the jobs of a task.
//!
//! ```text
//! sender → receiver   header:  frame {"task": "…", "name": "gradients.safetensors", "size": 123}
//! receiver → sender   answer:  frame "ready", or {"refused": {"code": "no_job", "message": "…"}}
//! sender → receiver   exactly `size` bytes, then frame {"sha256": "<hex>"}
//! receiver → sender   answer:  frame {"received": {"jobs": 1}}, or {"refused": {…}}
//! ```
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

use std::time::Duration;

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
pub const PROTOCOL: StreamProtocol = StreamProtocol::new("/hypha/resource/1.0.0");
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
    Received { jobs: usize },
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
    /// The bytes did not match the size or checksum announced.
    Corrupt,
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

/// Reads exactly `size` bytes and the trailer into `file`; returns `sha256:<hex>` when the
/// trailer's checksum matches. The bytes may stall for at most [`STALL_TIMEOUT`], and must
/// come at [`MIN_BYTES_PER_SECOND`] on average over each such period.
pub async fn receive_bytes(
    stream: &mut hypha_network::Stream,
    file: std::fs::File,
    size: u64,
) -> Result<String, Refusal> {
    let corrupt = |m: String| Refusal::new(RefusalCode::Corrupt, m);
    let mut file = tokio::fs::File::from_std(file);
    let mut hasher = Sha256::new();
    let mut left = size;
    let mut buffer = vec![0u8; CHUNK];
    let mut rate = hypha_network::rate::RateFloor::new(STALL_TIMEOUT, MIN_BYTES_PER_SECOND);
    while left > 0 {
        let want = buffer
            .len()
            .min(usize::try_from(left).unwrap_or(usize::MAX));
        let read = tokio::time::timeout(STALL_TIMEOUT, stream.read(&mut buffer[..want]))
            .await
            .map_err(|_| corrupt(format!("the bytes stalled for {STALL_TIMEOUT:?}")))?
            .map_err(|e| corrupt(format!("the transfer broke off: {e}")))?;
        if read == 0 {
            return Err(corrupt(format!(
                "the transfer ended after {} of {size} bytes",
                size - left
            )));
        }
        hasher.update(&buffer[..read]);
        file.write_all(&buffer[..read])
            .await
            .map_err(|e| Refusal::new(RefusalCode::Io, e.to_string()))?;
        left -= read as u64;
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
    let trailer: Trailer = tokio::time::timeout(STALL_TIMEOUT, read_frame(stream))
        .await
        .map_err(|_| corrupt("no checksum after the bytes".into()))?
        .map_err(|e| corrupt(format!("no checksum after the bytes: {e}")))?;
    let actual = hex::encode(hasher.finalize());
    if !trailer.sha256.eq_ignore_ascii_case(&actual) {
        return Err(corrupt(format!(
            "the bytes hash to {actual}, the sender announced {}",
            trailer.sha256
        )));
    }
    file.sync_all()
        .await
        .map_err(|e| Refusal::new(RefusalCode::Io, e.to_string()))?;
    Ok(format!("sha256:{actual}"))
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
    #[error("the peer answered out of turn")]
    Protocol,
    #[error("the peer went silent for {0:?}")]
    Stalled(Duration),
}

impl SendError {
    /// Worth another try: a refusal the receiver expects to lift, or an exchange that broke
    /// off (a connection replaced mid-transfer, say).
    fn is_transient(&self) -> bool {
        match self {
            SendError::Refused(refusal) => refusal.code.is_transient(),
            SendError::Network(_) | SendError::Frame(_) | SendError::Stalled(_) => true,
            SendError::File(_) | SendError::Protocol => false,
        }
    }
}

/// Sends `size` bytes of `file` to the jobs of `task` on `peer`, trying again for up to
/// `patience` (no new try starts after it; [`SEND_PATIENCE`] unless the caller has its own
/// way to find out whether the peer is still there) while the peer refuses for now, cannot be
/// reached or the exchange breaks off; returns `sha256:<hex>` of what was sent.
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
    retrying(peer, patience, || {
        // Each try reads from the start, through its own handle on the file.
        let file = file.try_clone();
        async move {
            let mut file = tokio::fs::File::from_std(file.map_err(SendError::File)?);
            file.seek(std::io::SeekFrom::Start(0))
                .await
                .map_err(SendError::File)?;
            attempt(network, peer, header, &mut file).await
        }
    })
    .await
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
            Answer::Ready => Err(SendError::Protocol),
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
    file: &mut tokio::fs::File,
) -> Result<String, SendError> {
    let mut stream = network.open_stream(peer, PROTOCOL).await?;
    within(HEADER_TIMEOUT, write_frame(&mut stream, header)).await?;
    match within(HEADER_TIMEOUT, read_frame::<Answer>(&mut stream)).await? {
        Answer::Ready => {}
        Answer::Refused(refusal) => return Err(SendError::Refused(refusal)),
        Answer::Received { .. } => return Err(SendError::Protocol),
    }
    let mut hasher = Sha256::new();
    let mut left = header.size;
    let mut buffer = vec![0u8; CHUNK];
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
        hasher.update(&buffer[..read]);
        let chunk = &buffer[..read];
        within(STALL_TIMEOUT, async {
            stream.write_all(chunk).await.map_err(FrameError::from)
        })
        .await?;
        left -= read as u64;
    }
    let sha256 = hex::encode(hasher.finalize());
    let trailer = Trailer {
        sha256: sha256.clone(),
    };
    within(STALL_TIMEOUT, write_frame(&mut stream, &trailer)).await?;
    match within(STALL_TIMEOUT, read_frame::<Answer>(&mut stream)).await? {
        Answer::Received { .. } => Ok(format!("sha256:{sha256}")),
        Answer::Refused(refusal) => Err(SendError::Refused(refusal)),
        Answer::Ready => Err(SendError::Protocol),
    }
}
