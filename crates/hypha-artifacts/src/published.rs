//! Files a node publishes, and the protocol that makes the publishing peer an origin.
//!
//! ```text
//! /hypha/artifact/published/1.0.0   one read per stream
//!   client → server   {"name": "<published name>", "e_tag": "<version>", "range": [start, end]}
//!                     (range null: only the size and version)
//!   server → client   {"ok": {"size": 123, "e_tag": "…"}} and exactly end - start bytes, or
//!                     {"error": {"code": "not_found", "message": "…"}}; then the server closes.
//! ```
//!
//! A [`Published`] file is fetched like any artifact ([`crate::Distributor::fetch_published`]):
//! its swarm's origin is the publisher, read through this protocol, so the swarm's rules hold
//! unchanged. Each chunk is read from the publisher by one member and passed on among the
//! members, hashes are vouched for by the members that read them from the publisher, and a
//! lie is settled by the publisher. The publisher serves only the files it published, to
//! the peers their [`Admission`] lets in, at most [`MAX_READS`] reads at once.

use std::{
    collections::HashMap,
    ops::Range,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex, Weak,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use bytes::Bytes;
use futures::{AsyncReadExt, AsyncWriteExt, StreamExt, stream::BoxStream};
use hypha_messages::artifact::Published;
use hypha_network::{Network, NetworkError, PeerId, Stream, StreamProtocol, shares::PeerShares};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::{
    io::{AsyncReadExt as _, AsyncSeekExt},
    sync::Semaphore,
};

use crate::{
    Admission,
    error::OriginError,
    manifest::FileEntry,
    protocol::{read_frame, write_frame},
};

pub const PUBLISHED_PROTOCOL: StreamProtocol =
    StreamProtocol::new("/hypha/artifact/published/1.0.0");
/// Reads served at once; more are answered `busy`, and the reader tries again a moment later.
pub const MAX_READS: usize = 16;
/// Reads of one peer served at once: one reader never takes every slot.
pub const MAX_READS_PER_PEER: usize = 4;
/// How long a read may make no progress, either way.
const STALL_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a client has to send its request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Bytes per read from the file and write to the stream.
const BLOCK: usize = 256 * 1024;

/// One read of a published file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReadRequest {
    pub name: String,
    pub e_tag: String,
    pub range: Option<(u64, u64)>,
}

/// The answer to a [`ReadRequest`], before any bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReadHeader {
    Ok {
        size: u64,
        e_tag: String,
    },
    Error {
        code: ReadErrorCode,
        message: String,
    },
}

/// Why a read was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReadErrorCode {
    /// Nothing of that name is published here (any more).
    NotFound,
    /// The file is published here at another version.
    Changed,
    /// The publication does not admit the client.
    NotAdmitted,
    /// Every read slot is taken.
    Busy,
    Malformed,
}

/// A file this node serves under its published name.
#[derive(Debug)]
struct Publication {
    path: PathBuf,
    size: u64,
    e_tag: String,
    admission: Admission,
}

/// The files this node publishes.
#[derive(Debug)]
pub(crate) struct Publications {
    files: Mutex<HashMap<String, Arc<Publication>>>,
    reads: Arc<Semaphore>,
    shares: PeerShares,
    /// Bytes of published files sent to readers.
    served: AtomicU64,
}

impl Publications {
    pub(crate) fn new() -> Self {
        Publications {
            files: Mutex::default(),
            reads: Arc::new(Semaphore::new(MAX_READS)),
            shares: PeerShares::new(MAX_READS_PER_PEER),
            served: AtomicU64::new(0),
        }
    }

    fn files(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Publication>>> {
        self.files.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Serves the file at `path` to the peers `admission` lets in, under a new random name.
    /// The file must not change while it is published: its version is its inode, size and
    /// modification time, and reads of another version are refused. Reads the whole file
    /// once, for its SHA-256 (blocking).
    pub(crate) fn publish(
        &self,
        local: PeerId,
        path: &Path,
        admission: Admission,
    ) -> std::io::Result<Published> {
        let metadata = std::fs::metadata(path)?;
        if !metadata.is_file() {
            return Err(std::io::Error::other(format!(
                "{} is not a file",
                path.display()
            )));
        }
        let e_tag = version(&metadata);
        let mut hasher = Sha256::new();
        std::io::copy(&mut std::fs::File::open(path)?, &mut hasher)?;
        let sha256 = hex::encode(hasher.finalize());
        let name = hex::encode(rand::random::<[u8; 16]>());
        self.files().insert(
            name.clone(),
            Arc::new(Publication {
                path: path.to_path_buf(),
                size: metadata.len(),
                e_tag: e_tag.clone(),
                admission,
            }),
        );
        Ok(Published {
            peer: local.to_base58(),
            name,
            size: metadata.len(),
            e_tag,
            sha256,
            fetchers: 0,
        })
    }

    /// Bytes of published files sent to readers so far.
    pub(crate) fn served(&self) -> u64 {
        self.served.load(Ordering::Relaxed)
    }

    /// Stops serving `name`; reads under way finish.
    pub(crate) fn unpublish(&self, name: &str) {
        self.files().remove(name);
    }
}

/// Serves reads of published files until `incoming` ends or the publications are dropped.
pub(crate) async fn accept(
    incoming: hypha_network::IncomingStreams,
    publications: Weak<Publications>,
) {
    hypha_network::frame::serve_each(incoming, |peer, stream| {
        Some(serve(stream, peer, publications.upgrade()?))
    })
    .await;
}

async fn serve(mut stream: Stream, peer: PeerId, publications: Arc<Publications>) {
    let refuse = |code, message: String| ReadHeader::Error { code, message };
    let request: ReadRequest =
        match tokio::time::timeout(REQUEST_TIMEOUT, read_frame(&mut stream)).await {
            Ok(Ok(request)) => request,
            Ok(Err(e)) => {
                let _ = write_frame(
                    &mut stream,
                    &refuse(ReadErrorCode::Malformed, e.to_string()),
                )
                .await;
                return;
            }
            Err(_) => return,
        };
    let found = publications.files().get(&request.name).cloned();
    let answer = match found {
        None => Err(refuse(
            ReadErrorCode::NotFound,
            format!("nothing named {} is published here", request.name),
        )),
        Some(file) if !file.admission.admits(&peer) => Err(refuse(
            ReadErrorCode::NotAdmitted,
            format!("{} is not published to you", request.name),
        )),
        Some(file) if file.e_tag != request.e_tag => Err(refuse(
            ReadErrorCode::Changed,
            format!("{} is published at version {}", request.name, file.e_tag),
        )),
        Some(file) => match request.range {
            Some((start, end)) if start > end || end > file.size => Err(refuse(
                ReadErrorCode::Malformed,
                format!("bytes {start}..{end} of a file of {}", file.size),
            )),
            range => Ok((file, range)),
        },
    };
    let (file, range) = match answer {
        Ok(found) => found,
        Err(refusal) => {
            let _ = write_frame(&mut stream, &refusal).await;
            return;
        }
    };
    let Ok(_permit) = publications.reads.clone().try_acquire_owned() else {
        let _ = write_frame(
            &mut stream,
            &refuse(ReadErrorCode::Busy, "every read slot is taken".into()),
        )
        .await;
        return;
    };
    let Some(_share) = publications.shares.try_take(peer) else {
        let _ = write_frame(
            &mut stream,
            &refuse(
                ReadErrorCode::Busy,
                format!("you have {MAX_READS_PER_PEER} reads under way"),
            ),
        )
        .await;
        return;
    };
    let header = ReadHeader::Ok {
        size: file.size,
        e_tag: file.e_tag.clone(),
    };
    if write_frame(&mut stream, &header).await.is_err() {
        return;
    }
    if let Some((start, end)) = range
        && let Err(error) = send_range(
            &mut stream,
            &file.path,
            &file.e_tag,
            start..end,
            &publications.served,
        )
        .await
    {
        tracing::debug!(%peer, name = %request.name, %error, "a read of a published file broke off");
        return;
    }
    let _ = stream.close().await;
}

/// A file's version: its inode, modification time and size.
fn version(metadata: &std::fs::Metadata) -> String {
    format!(
        "{:x}-{:x}-{:x}",
        metadata.ino(),
        metadata.mtime_nsec() + metadata.mtime() * 1_000_000_000,
        metadata.len()
    )
}

/// Sends bytes `range` of the file at `path`, if it is still at `e_tag`; each write may
/// take at most [`STALL_TIMEOUT`] (a reader that stops reading frees its slot).
async fn send_range(
    stream: &mut Stream,
    path: &Path,
    e_tag: &str,
    range: Range<u64>,
    served: &AtomicU64,
) -> std::io::Result<()> {
    let mut file = tokio::fs::File::open(path).await?;
    if version(&file.metadata().await?) != e_tag {
        return Err(std::io::Error::other(
            "the published file changed; it is served no more",
        ));
    }
    file.seek(std::io::SeekFrom::Start(range.start)).await?;
    let mut left = range.end - range.start;
    let mut block = vec![0u8; BLOCK];
    while left > 0 {
        let want = usize::try_from(left).unwrap_or(BLOCK).min(BLOCK);
        let read = file.read(&mut block[..want]).await?;
        if read == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the published file is shorter than it was",
            ));
        }
        tokio::time::timeout(STALL_TIMEOUT, stream.write_all(&block[..read]))
            .await
            .map_err(|_| std::io::Error::other("the reader stopped reading"))??;
        served.fetch_add(read as u64, Ordering::Relaxed);
        left -= read as u64;
    }
    stream.flush().await
}

/// The reading end: a publisher seen as an origin.
#[derive(Debug, Clone)]
pub(crate) struct Publisher {
    network: Network,
    peer: PeerId,
    published: Published,
}

impl Publisher {
    pub(crate) fn new(network: Network, published: &Published) -> Result<Self, OriginError> {
        let peer = published
            .peer
            .parse()
            .map_err(|_| OriginError::BadProfile {
                profile: published.peer.clone(),
                reason: "the publisher is not a peer ID".into(),
            })?;
        Ok(Publisher {
            network,
            peer,
            published: published.clone(),
        })
    }

    pub(crate) fn url(&self) -> String {
        format!("hypha-published://{}", self.published.peer)
    }

    /// The one file, as the publisher describes it now.
    pub(crate) async fn resolve(&self) -> Result<Vec<FileEntry>, OriginError> {
        let (mut stream, size, e_tag) = self.open(None).await?;
        let _ = stream.close().await;
        Ok(vec![FileEntry {
            relative: String::new(),
            location: self.published.name.clone(),
            size,
            e_tag: Some(e_tag),
            version: None,
            last_modified_ms: 0,
        }])
    }

    /// Bytes `range` of the file, as they arrive.
    pub(crate) async fn read(
        &self,
        range: Range<u64>,
    ) -> Result<BoxStream<'static, Result<Bytes, OriginError>>, OriginError> {
        let (stream, _, _) = self.open(Some(range.clone())).await?;
        let uri = self.published.name.clone();
        let left = range.end - range.start;
        Ok(
            futures::stream::unfold((stream, left, uri), |(mut stream, left, uri)| async move {
                if left == 0 {
                    return None;
                }
                let mut block = vec![0u8; usize::try_from(left).unwrap_or(BLOCK).min(BLOCK)];
                let read = tokio::time::timeout(STALL_TIMEOUT, stream.read(&mut block))
                    .await
                    .unwrap_or_else(|_| Err(std::io::Error::other("the publisher stalled")));
                match read {
                    Ok(0) => Some((
                        Err(self::broke_off(
                            &uri,
                            "the publisher closed the stream early",
                        )),
                        (stream, 0, uri),
                    )),
                    Ok(read) => {
                        block.truncate(read);
                        Some((Ok(Bytes::from(block)), (stream, left - read as u64, uri)))
                    }
                    Err(error) => Some((
                        Err(self::broke_off(&uri, &error.to_string())),
                        (stream, 0, uri),
                    )),
                }
            })
            .boxed(),
        )
    }

    /// Opens a read, trying again while the exchange breaks off before the publisher
    /// answered: a second connection between two peers that dialled each other at once is
    /// closed with the streams on it.
    async fn open(&self, range: Option<Range<u64>>) -> Result<(Stream, u64, String), OriginError> {
        let (mut attempt, mut busy) = (1, 0);
        loop {
            match self.open_once(range.clone()).await {
                Err(Opened::Busy(reason)) if busy < BUSY_ATTEMPTS => {
                    tracing::debug!(publisher = %self.peer, %reason, "the publisher is busy; trying again");
                    tokio::time::sleep(BUSY_PAUSE).await;
                    busy += 1;
                }
                Err(Opened::Busy(reason)) => return Err(broke_off(&self.published.name, &reason)),
                Err(Opened::BrokeOff(reason)) if attempt < OPEN_ATTEMPTS => {
                    tracing::debug!(publisher = %self.peer, %reason, "a read broke off before its answer; trying again");
                    tokio::time::sleep(Duration::from_millis(200 * attempt)).await;
                    attempt += 1;
                }
                Err(Opened::BrokeOff(reason)) => {
                    return Err(broke_off(&self.published.name, &reason));
                }
                Err(Opened::Refused(error)) => return Err(error),
                Ok(opened) => return Ok(opened),
            }
        }
    }

    async fn open_once(&self, range: Option<Range<u64>>) -> Result<(Stream, u64, String), Opened> {
        let uri = &self.published.name;
        let broke = |reason: String| Opened::BrokeOff(reason);
        let mut stream = self
            .network
            .open_stream(self.peer, PUBLISHED_PROTOCOL)
            .await
            .map_err(|e: NetworkError| broke(e.to_string()))?;
        let request = ReadRequest {
            name: uri.clone(),
            e_tag: self.published.e_tag.clone(),
            range: range.map(|r| (r.start, r.end)),
        };
        write_frame(&mut stream, &request)
            .await
            .map_err(|e| broke(e.to_string()))?;
        let header = tokio::time::timeout(REQUEST_TIMEOUT, read_frame(&mut stream))
            .await
            .map_err(|_| broke("the publisher did not answer".into()))?
            .map_err(|e| broke(e.to_string()))?;
        let refused = Opened::Refused;
        match header {
            ReadHeader::Ok { size, e_tag } if size == self.published.size => {
                Ok((stream, size, e_tag))
            }
            ReadHeader::Ok { size, e_tag } => Err(refused(OriginError::Changed {
                uri: uri.clone(),
                expected: format!("{} bytes", self.published.size),
                found: format!("{size} bytes, version {e_tag}"),
            })),
            ReadHeader::Error {
                code: ReadErrorCode::NotFound | ReadErrorCode::Changed,
                message,
            } => Err(refused(OriginError::Changed {
                uri: uri.clone(),
                expected: format!("version {}", self.published.e_tag),
                found: message,
            })),
            ReadHeader::Error {
                code: ReadErrorCode::Busy,
                message,
            } => Err(Opened::Busy(message)),
            ReadHeader::Error { message, .. } => Err(refused(broke_off(uri, &message))),
        }
    }
}

/// How many times a read is opened before it fails.
const OPEN_ATTEMPTS: u64 = 3;
/// A publisher that answers `busy` is asked again after [`BUSY_PAUSE`], this many times
/// (a minute): dozens of fetchers each reading from it at first take turns.
const BUSY_ATTEMPTS: u32 = 240;
const BUSY_PAUSE: Duration = Duration::from_millis(250);

/// Why a read was not opened.
enum Opened {
    /// The exchange broke off before the publisher answered: worth another try.
    BrokeOff(String),
    /// Every read slot of the publisher was taken: try again in a moment.
    Busy(String),
    /// The publisher answered no.
    Refused(OriginError),
}

fn broke_off(uri: &str, reason: &str) -> OriginError {
    OriginError::Store {
        uri: uri.to_string(),
        source: object_store::Error::Generic {
            store: "publisher",
            source: reason.to_string().into(),
        },
    }
}
