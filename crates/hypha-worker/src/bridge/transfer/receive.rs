//! The receiving end of the resource protocol on a worker: each stream's handshake (its
//! header read and its task checked under the handshake limits), then the transfer under a
//! slot and the disk room promised to it, staged, checked and handed to the inboxes of the
//! task's jobs; a transfer broken off is kept to be resumed.

use std::{
    collections::{HashMap, HashSet},
    ffi::{OsStr, OsString},
    os::{
        fd::OwnedFd,
        unix::ffi::{OsStrExt, OsStringExt},
    },
    path::Path,
    sync::{Arc, Mutex},
    time::Duration,
};

use futures::AsyncWriteExt;
use hypha_network::{
    Network, PeerId,
    frame::write_frame,
    shares::{PeerShares, Share},
};
use hypha_transfer::{
    Answer, MIN_BYTES_PER_SECOND, Received, Refusal, RefusalCode, STALL_TIMEOUT, read_header,
    receive_bytes,
};
use sha2::{Digest, Sha256};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::{
    DISK_RESERVE, Header, MAX_CONCURRENT, MAX_HANDSHAKES, MAX_HANDSHAKES_PER_PEER,
    MAX_HANDSHAKES_PER_SCHEDULER, MAX_PER_PEER, MAX_WAITING, PROTOCOL, STAGING_DIR, inbox::Inbox,
    registry::Inboxes,
};
use crate::{
    artifacts::ArtifactStore,
    bridge::paths::{JobDir, PathError},
    metrics,
};

/// Receives transfers for this worker's jobs until the network stops accepting streams.
pub async fn serve(network: Network, inboxes: Arc<Inboxes>, artifacts: Arc<ArtifactStore>) {
    let incoming = match network.accept_streams(PROTOCOL) {
        Ok(incoming) => incoming,
        Err(e) => {
            tracing::warn!(error = %e, "peers cannot send resources to this worker's jobs");
            return;
        }
    };
    let handshakes = Handshakes::new();
    let limits = Arc::new(Limits {
        slots: Arc::new(Semaphore::new(MAX_CONCURRENT)),
        shares: PeerShares::new(MAX_PER_PEER),
        promised: Mutex::new(0),
        kept: Mutex::default(),
    });
    hypha_network::frame::serve_each(incoming, |peer, mut stream| {
        let (inboxes, limits, artifacts) = (inboxes.clone(), limits.clone(), artifacts.clone());
        let handshake = handshakes.admit(peer, &inboxes);
        Some(async move {
            let mut fetching = None;
            let answer = match handshake {
                Ok(handshake) => {
                    match receive(peer, &mut stream, &inboxes, handshake, &limits, &artifacts).await
                    {
                        Ok(taken) => {
                            fetching = taken.fetching;
                            Answer::Received { jobs: taken.jobs }
                        }
                        Err(refusal) => {
                            tracing::debug!(%peer, %refusal, "resource transfer refused");
                            Answer::Refused(refusal)
                        }
                    }
                }
                Err(refusal) => Answer::Refused(refusal),
            };
            let _ = write_frame(&mut stream, &answer).await;
            let _ = stream.close().await;
            // The sender has its answer: the stream is not kept open through the fetch.
            drop(stream);
            if let Some(fetching) = fetching {
                fetching.await;
            }
        })
    })
    .await;
}

/// The transfers being asked for: their headers read and their task checked.
struct Handshakes {
    slots: Arc<Semaphore>,
    by_peer: PeerShares,
    /// Keyed by the scheduler that vouches for the asking peer.
    by_scheduler: PeerShares,
}

/// A transfer's place while its header is read; given back when dropped.
struct Handshake {
    _slot: OwnedSemaphorePermit,
    _peer: Share,
    _scheduler: Share,
}

impl Handshakes {
    fn new() -> Self {
        Handshakes {
            slots: Arc::new(Semaphore::new(MAX_HANDSHAKES)),
            by_peer: PeerShares::new(MAX_HANDSHAKES_PER_PEER),
            by_scheduler: PeerShares::new(MAX_HANDSHAKES_PER_SCHEDULER),
        }
    }

    /// A place for `peer`'s transfer: refused at once to a peer of no task here, and when
    /// the peer, the schedulers that vouch for it, or everyone together ask for too many.
    fn admit(&self, peer: PeerId, inboxes: &Inboxes) -> Result<Handshake, Refusal> {
        let vouchers = inboxes.vouchers(&peer);
        if vouchers.is_empty() {
            return Err(Refusal::new(
                RefusalCode::NotInTask,
                format!("{peer} is no scheduler or named worker of any task on this worker"),
            ));
        }
        let scheduler = vouchers
            .into_iter()
            .find_map(|voucher| self.by_scheduler.try_take(voucher))
            .ok_or_else(|| {
                busy(format!(
                    "this worker reads {MAX_HANDSHAKES_PER_SCHEDULER} transfer headers at most at once for the tasks of one scheduler"
                ))
            })?;
        let peer_share = self.by_peer.try_take(peer).ok_or_else(|| {
            busy(format!(
                "this worker reads {MAX_HANDSHAKES_PER_PEER} transfer headers at most at once from one peer"
            ))
        })?;
        let slot = self.slots.clone().try_acquire_owned().map_err(|_| {
            busy(format!(
                "this worker is asked for {MAX_HANDSHAKES} transfers at once"
            ))
        })?;
        Ok(Handshake {
            _slot: slot,
            _peer: peer_share,
            _scheduler: scheduler,
        })
    }
}

/// What the transfers under way share.
struct Limits {
    slots: Arc<Semaphore>,
    shares: PeerShares,
    /// Bytes promised to transfers under way and not yet known to be on the disk.
    promised: Mutex<u64>,
    /// The kept files of resumable transfers ([`Partial`]).
    kept: Mutex<Kept>,
}

fn busy(message: String) -> Refusal {
    Refusal::new(RefusalCode::Busy, message)
}

/// What [`receive`] made of a transfer.
struct Taken {
    /// The jobs that take the file.
    jobs: usize,
    /// A file published in the swarm is fetched from there once the sender has its answer,
    /// in the stream's task: it holds the transfer's slot, share and disk room until then.
    fetching: Option<futures::future::BoxFuture<'static, ()>>,
}

/// Receives one transfer into the inboxes of its task's jobs; returns how many took it. The
/// header is read and the task checked under `handshake`, before a transfer slot is taken.
async fn receive(
    peer: PeerId,
    stream: &mut hypha_network::Stream,
    inboxes: &Arc<Inboxes>,
    handshake: Handshake,
    limits: &Arc<Limits>,
    artifacts: &Arc<ArtifactStore>,
) -> Result<Taken, Refusal> {
    let header = read_header(stream).await?;
    check_name(&header.name)?;
    let targets = inboxes.of_task(&header.task, &peer)?;
    let targets: Vec<Arc<Inbox>> = targets.into_iter().filter(|i| i.has_room()).collect();
    let Some(first) = targets.first() else {
        return Err(Refusal::new(
            RefusalCode::InboxFull,
            format!(
                "the jobs of task {} have {MAX_WAITING} files waiting",
                header.task
            ),
        ));
    };
    drop(handshake);
    let io = |e: &dyn std::fmt::Display| Refusal::new(RefusalCode::Io, e.to_string());
    let slot = limits.slots.clone().try_acquire_owned().map_err(|_| {
        busy(format!(
            "this worker receives {MAX_CONCURRENT} transfers at most at once"
        ))
    })?;
    let share = limits.shares.try_take(peer).ok_or_else(|| {
        busy(format!(
            "this worker receives {MAX_PER_PEER} transfers at most at once from one peer"
        ))
    })?;
    if let Some(published) = &header.published
        && (published.peer != peer.to_base58() || published.size != header.size)
    {
        return Err(Refusal::new(
            RefusalCode::BadRequest,
            "a peer may only point at a file it published itself, of the size its header says",
        ));
    }
    let staging = first
        .dir
        .create_dir_all(Path::new(STAGING_DIR))
        .map_err(|e| io(&e))?;
    if header.size > hypha_transfer::MAX_TRANSFER_BYTES {
        return Err(Refusal::new(
            RefusalCode::TooLarge,
            format!(
                "{} bytes is more than the {} a worker takes",
                header.size,
                hypha_transfer::MAX_TRANSFER_BYTES
            ),
        ));
    }
    let partial = match header.resumable_sha256() {
        Some(sha256) if header.published.is_none() => {
            Some(Partial::open(&staging, peer, &header, sha256, limits)?)
        }
        _ => None,
    };
    // Bytes kept already are on the disk.
    let from = partial.as_ref().map_or(0, |p| p.received.bytes());
    let promise = match promise_room(&staging, header.size - from, limits) {
        Ok(promise) => promise,
        Err(refusal) => {
            if let Some(partial) = partial {
                partial.keep();
            }
            return Err(refusal);
        }
    };
    if let Some(published) = header.published.clone() {
        let jobs = targets.len();
        let fetching = fetch_published(
            peer,
            header,
            published,
            inboxes.clone(),
            targets,
            artifacts.clone(),
            (promise, slot, share),
        );
        return Ok(Taken {
            jobs,
            fetching: Some(Box::pin(fetching)),
        });
    }
    let answer = match from {
        0 => Answer::Ready,
        offset => Answer::Resume { offset },
    };
    if let Err(e) = write_frame(stream, &answer).await {
        // The sender is gone before a byte came: what was kept stays as it was.
        if let Some(partial) = partial {
            partial.keep();
        }
        return Err(Refusal::new(RefusalCode::BadRequest, e.to_string()));
    }

    let (checksum, temp) = receive_to_staging(stream, &staging, partial, &header, peer).await?;
    metrics::resource_bytes("received", header.size);
    let delivered = hand_over(&staging, &temp, &targets, &header, peer, &checksum);
    tracing::debug!(%peer, task = header.task, name = header.name, size = header.size, jobs = delivered, "resource received");
    Ok(Taken {
        jobs: delivered,
        fetching: None,
    })
}

/// Receives the transfer's bytes into a temporary file of `staging`, after the bytes kept
/// of an earlier try (`partial`): the file's checksum and temporary name. Bytes that proved
/// wrong are not kept; what arrived of a transfer that broke off is, for the sender's next
/// try.
async fn receive_to_staging(
    stream: &mut hypha_network::Stream,
    staging: &OwnedFd,
    mut partial: Option<Partial>,
    header: &Header,
    peer: PeerId,
) -> Result<(String, Vec<u8>), Refusal> {
    let io = |e: &dyn std::fmt::Display| Refusal::new(RefusalCode::Io, e.to_string());
    let temp = match partial.as_mut() {
        Some(partial) => {
            let file = partial.file.try_clone().map_err(|e| io(&e))?;
            let received =
                receive_bytes(stream, file, header.size, &mut partial.received, peer).await;
            received.and_then(|checksum| {
                // Renamed before the claim on its name ends: the sender's next transfer removes
                // the sender's unclaimed kept files, and this one now waits in an inbox.
                let temp = JobDir::rename_to_temp(staging, &partial.name, OsStr::new(&header.name))
                    .map_err(|e| io(&e))?;
                Ok((checksum, temp))
            })
        }
        None => {
            let (file, temp) =
                JobDir::create_temp(staging, OsStr::new(&header.name)).map_err(|e| io(&e))?;
            let mut received = Received::default();
            match receive_bytes(stream, file, header.size, &mut received, peer).await {
                Ok(checksum) => Ok((checksum, temp)),
                Err(refusal) => {
                    JobDir::discard(staging, &temp);
                    Err(refusal)
                }
            }
        }
    };
    match (temp, partial) {
        (Ok(done), _) => Ok(done),
        // Bytes that proved wrong are not kept; what arrived of a transfer that broke off
        // is, for the sender's next try.
        (Err(refusal), Some(partial)) if refusal.code == RefusalCode::Mismatch => {
            JobDir::discard(staging, &partial.name);
            Err(refusal)
        }
        (Err(refusal), Some(partial)) => {
            partial.keep();
            Err(refusal)
        }
        (Err(refusal), None) => Err(refusal),
    }
}

/// Puts the received file (`temp` in `staging`) in the inboxes of `targets`, the first
/// its own, the others hard links (same bytes, their own names), all made before any job
/// is told, so none can move the file away first: how many jobs took it.
fn hand_over(
    staging: &OwnedFd,
    temp: &[u8],
    targets: &[Arc<Inbox>],
    header: &Header,
    peer: PeerId,
    checksum: &str,
) -> usize {
    let temp = OsString::from(OsStr::from_bytes(temp));
    // Other jobs of the task on this worker get hard links (same bytes, their own names),
    // all made before any job is told, so none can move the file away first.
    let mut staged = vec![(targets[0].clone(), temp.clone())];
    for inbox in &targets[1..] {
        match link_into(staging, &temp, inbox, &header.name) {
            Ok(link) => staged.push((inbox.clone(), link)),
            Err(e) => {
                tracing::warn!(job = inbox.job(), error = %e, "cannot hand a received file to a job")
            }
        }
    }
    let delivered = staged.len();
    for (inbox, name) in staged {
        inbox.push(peer, &header.name, header.size, checksum, name);
    }
    delivered
}

/// Fetches a file `from` published (the header said so instead of sending it) and hands it
/// to the task's jobs among `targets` that are still running, as if it had been sent: the
/// same name, size and sender, and only if its SHA-256 is the one the sender published (the
/// other fetchers' chunks are checked against the hashes those that read them from the sender
/// announced; the SHA-256 is the sender's own word). A fetch that fails, or takes longer than
/// the slowest transfer may, hands nothing (as a transfer that broke off; a trainer asks for
/// the model again). The fetched file then serves the others fetching it for a while, and is
/// removed. The transfer's slot, share and room on the disk are held throughout.
async fn fetch_published(
    from: PeerId,
    header: Header,
    published: hypha_artifacts::Published,
    inboxes: Arc<Inboxes>,
    targets: Vec<Arc<Inbox>>,
    artifacts: Arc<ArtifactStore>,
    held: (Promise, OwnedSemaphorePermit, Share),
) {
    let admission = inboxes.admission_of(&header.task);
    let limit = STALL_TIMEOUT + Duration::from_secs(header.size / MIN_BYTES_PER_SECOND);
    let fetching = artifacts.fetch_published(&published, admission);
    let (path, fetched) = match tokio::time::timeout(limit, fetching).await {
        Ok(Ok(fetched)) => fetched,
        Ok(Err(error)) => {
            tracing::warn!(%from, name = header.name, %error, "could not fetch a file a peer published for its task");
            artifacts.discard_published(&published).await;
            return;
        }
        Err(_) => {
            tracing::warn!(%from, name = header.name, ?limit, "a file a peer published for its task did not arrive in time");
            artifacts.discard_published(&published).await;
            return;
        }
    };
    // Jobs that ended meanwhile get nothing.
    let running = inboxes.of_task(&header.task, &from).unwrap_or_default();
    let targets: Vec<Arc<Inbox>> = targets
        .into_iter()
        .filter(|t| running.iter().any(|r| Arc::ptr_eq(r, t)))
        .collect();
    let handed = {
        let (path, name) = (path.clone(), header.name.clone());
        let expected = published.sha256.clone();
        tokio::task::spawn_blocking(move || hand_on(&path, &name, &expected, &targets))
            .await
            .unwrap_or_else(|e| Err(std::io::Error::other(e)))
    };
    match handed {
        Ok(staged) => {
            metrics::resource_bytes("received", header.size);
            let mut delivered = 0;
            for (inbox, temp, checksum) in staged {
                if inbox.has_room() {
                    inbox.push(from, &header.name, header.size, &checksum, temp);
                    delivered += 1;
                } else {
                    tracing::warn!(
                        job = inbox.job(),
                        name = header.name,
                        "a fetched file found its job's inbox full; dropped"
                    );
                    if let Ok(staging) = inbox.dir.create_dir_all(Path::new(STAGING_DIR)) {
                        JobDir::discard(&staging, temp.as_bytes());
                    }
                }
            }
            tracing::info!(
                %from,
                name = header.name,
                size = header.size,
                from_publisher = fetched.progress.origin_bytes,
                from_peers = fetched.progress.peer_bytes,
                jobs = delivered,
                "fetched a file its sender published"
            );
        }
        Err(error) => {
            tracing::warn!(%from, name = header.name, %error, "could not hand a fetched file to its jobs")
        }
    }
    artifacts
        .retire_published(&published, &path, &fetched)
        .await;
    drop(held);
}

/// Checks the fetched file at `path` against the SHA-256 its sender published, then copies it
/// into the staging directory of each of `targets` (a job that cannot take it is skipped);
/// returns what to push.
fn hand_on(
    path: &Path,
    name: &str,
    expected: &str,
    targets: &[Arc<Inbox>],
) -> std::io::Result<Vec<(Arc<Inbox>, OsString, String)>> {
    let mut hasher = Sha256::new();
    std::io::copy(&mut std::fs::File::open(path)?, &mut hasher)?;
    let actual = hex::encode(hasher.finalize());
    if !actual.eq_ignore_ascii_case(expected) {
        return Err(std::io::Error::other(format!(
            "its bytes hash to {actual}, its sender published {expected}: a fetcher passed on other bytes"
        )));
    }
    let checksum = format!("sha256:{actual}");
    let mut staged = Vec::new();
    for inbox in targets {
        let copied = inbox
            .dir
            .create_dir_all(Path::new(STAGING_DIR))
            .map_err(std::io::Error::other)
            .and_then(|staging| crate::artifacts::copy_to_temp(&staging, path, OsStr::new(name)));
        match copied {
            Ok(temp) => staged.push((inbox.clone(), OsString::from_vec(temp), checksum.clone())),
            Err(error) => {
                tracing::warn!(job = inbox.job(), %error, "cannot hand a fetched file to a job")
            }
        }
    }
    Ok(staged)
}

/// Room promised to one transfer under way, given back when it ends (its bytes are then on
/// the disk, or gone).
struct Promise {
    limits: Arc<Limits>,
    size: u64,
}

impl Drop for Promise {
    fn drop(&mut self) {
        let mut promised = self
            .limits
            .promised
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        *promised = promised.saturating_sub(self.size);
    }
}

/// Promises room for a file of `size` bytes in `staging`: no larger than
/// [`hypha_transfer::MAX_TRANSFER_BYTES`], and fitting the disk beside what the transfers
/// under way were promised, with [`DISK_RESERVE`] left free. (Promises count whole files,
/// though some of their bytes are on the disk already: never too little room, at times too
/// much.)
fn promise_room(
    staging: &std::os::fd::OwnedFd,
    size: u64,
    limits: &Arc<Limits>,
) -> Result<Promise, Refusal> {
    let too_large = |why: String| Refusal::new(RefusalCode::TooLarge, why);
    if size > hypha_transfer::MAX_TRANSFER_BYTES {
        return Err(too_large(format!(
            "{size} bytes is more than the {} a worker takes",
            hypha_transfer::MAX_TRANSFER_BYTES
        )));
    }
    let stat =
        rustix::fs::fstatvfs(staging).map_err(|e| Refusal::new(RefusalCode::Io, e.to_string()))?;
    let free = stat.f_bavail.saturating_mul(stat.f_frsize);
    let mut under_way = limits.promised.lock().unwrap_or_else(|p| p.into_inner());
    if size.saturating_add(*under_way).saturating_add(DISK_RESERVE) > free {
        return Err(too_large(format!(
            "{size} bytes do not fit: the worker's disk has {free} bytes free, keeps {DISK_RESERVE} and has promised {} to transfers under way",
            *under_way
        )));
    }
    *under_way += size;
    drop(under_way);
    Ok(Promise {
        limits: limits.clone(),
        size,
    })
}

/// Where the bytes of a resumable transfer go (its header named the file's SHA-256): a file
/// in the staging directory named after the sender and the file, so that a try after one that
/// broke off finds what arrived and asks only for the rest (`resume`). What arrived is known
/// from memory ([`Kept`]), never read back, so resuming costs nothing and a worker restarted
/// meanwhile starts such files again from 0. A sender keeps at most one such file per job here
/// besides those its transfers under way write: opening one removes the sender's others. Each
/// is the job's, removed with it.
struct Partial {
    file: std::fs::File,
    name: Vec<u8>,
    received: Received,
    _claim: Claim,
}

/// What the worker knows of the kept files of resumable transfers.
#[derive(Default)]
struct Kept {
    /// Those a transfer under way writes.
    under_way: HashSet<Vec<u8>>,
    /// What arrived of those whose transfer broke off, by name; at most [`MAX_KEPT`].
    broken: HashMap<Vec<u8>, Received>,
}

/// The most transfers that broke off whose progress a worker remembers.
const MAX_KEPT: usize = 1024;

impl Partial {
    const PREFIX: &'static str = ".hypha-resume-";

    fn open(
        staging: &std::os::fd::OwnedFd,
        peer: PeerId,
        header: &Header,
        sha256: &str,
        limits: &Arc<Limits>,
    ) -> Result<Self, Refusal> {
        let io = |e: &dyn std::fmt::Display| Refusal::new(RefusalCode::Io, e.to_string());
        let digest = |parts: &[&[u8]]| {
            let mut hasher = Sha256::new();
            for part in parts {
                hasher.update((part.len() as u64).to_le_bytes());
                hasher.update(part);
            }
            hex::encode(hasher.finalize())
        };
        let of_peer = format!("{}{}-", Self::PREFIX, &digest(&[&peer.to_bytes()])[..16]);
        let file = digest(&[
            header.task.as_bytes(),
            header.name.as_bytes(),
            &header.size.to_le_bytes(),
            sha256.to_ascii_lowercase().as_bytes(),
        ]);
        let name = format!("{of_peer}{}", &file[..32]).into_bytes();
        let mut kept = limits.kept.lock().unwrap_or_else(|e| e.into_inner());
        if !kept.under_way.insert(name.clone()) {
            return Err(busy(
                "a transfer of this file from this peer is under way here".into(),
            ));
        }
        // From here the name is claimed; dropping the claim gives it back.
        let claim = Claim {
            name: name.clone(),
            limits: limits.clone(),
        };
        for other in JobDir::names_with_prefix(staging, of_peer.as_bytes()).map_err(|e| io(&e))? {
            if other != name && !kept.under_way.contains(&other) {
                JobDir::discard(staging, &other);
                kept.broken.remove(&other);
            }
        }
        let arrived = kept.broken.remove(&name);
        drop(kept);
        // Only a file this worker wrote and still knows: anything else at the name (a job's
        // process can write in its directory) is replaced.
        let resumed = arrived
            .filter(|arrived| arrived.bytes() <= header.size)
            .and_then(|arrived| Some((JobDir::open_own_file(staging, &name)?, arrived)));
        let (file, received) = match resumed {
            Some(resumed) => resumed,
            None => {
                JobDir::discard(staging, &name);
                let file = JobDir::create_new(staging, &name).map_err(|e| io(&e))?;
                (file, Received::default())
            }
        };
        Ok(Partial {
            file,
            name,
            received,
            _claim: claim,
        })
    }

    /// Remembers what arrived, for the sender's next try.
    fn keep(self) {
        let mut kept = self
            ._claim
            .limits
            .kept
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if kept.broken.len() >= MAX_KEPT
            && let Some(any) = kept.broken.keys().next().cloned()
        {
            kept.broken.remove(&any);
        }
        kept.broken.insert(self.name.clone(), self.received);
    }
}

/// A kept file's name, claimed by the transfer under way that writes it.
struct Claim {
    name: Vec<u8>,
    limits: Arc<Limits>,
}

impl Drop for Claim {
    fn drop(&mut self) {
        self.limits
            .kept
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .under_way
            .remove(&self.name);
    }
}

fn link_into(
    staging: &std::os::fd::OwnedFd,
    staged: &OsStr,
    inbox: &Inbox,
    name: &str,
) -> Result<OsString, PathError> {
    let theirs = inbox.dir.create_dir_all(Path::new(STAGING_DIR))?;
    let link = format!(".hypha-linked-{:016x}-{name}", rand::random::<u64>());
    rustix::fs::linkat(
        staging,
        staged,
        &theirs,
        link.as_str(),
        rustix::fs::AtFlags::empty(),
    )
    .map_err(|e| PathError::Io {
        path: link.clone(),
        error: e.into(),
    })?;
    Ok(OsString::from(link))
}

/// A name must be one plain path component, so that it can only ever name a file in the
/// directory it is delivered to.
fn check_name(name: &str) -> Result<(), Refusal> {
    let single = crate::bridge::paths::check(name)
        .map(|p| p.components().count() == 1)
        .unwrap_or(false);
    if single && name.len() <= 255 {
        Ok(())
    } else {
        Err(Refusal::new(
            RefusalCode::BadRequest,
            format!("{name:?} is not a plain file name"),
        ))
    }
}
