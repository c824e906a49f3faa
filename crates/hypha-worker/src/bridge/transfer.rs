//! Resources sent between the jobs of one task on different workers: the receiving end of
//! the resource protocol ([`hypha_transfer`]) on a worker, and each job's inbox.
//!
//! A transfer is addressed to a **task**, never to a job or a path: the sending job's task
//! comes from its job spec, not from the executor, so a job can only ever reach the jobs of
//! its own task, and the receiving worker delivers into the inboxes of exactly those jobs.
//! Other jobs on the worker never see the file.
//!
//! **Only the task's peers are heard.** Knowing a task's id is not enough to send into it: a
//! transfer is taken only from the task's scheduler and the workers that run the task's jobs,
//! as the scheduler said with the dispatch and says again whenever they change
//! ([`Inboxes::set_peers`]). A peer of no task here is refused `not_in_task` before its header
//! is read; one of another task than the header names, after it, before a byte of the file.
//!
//! **A task belongs to its scheduler.** Task ids are not secret (a run record names one, and
//! every job of the task carries it), so the task's entry here is owned by the scheduler that
//! dispatched its first job on this worker, for as long as a job of the task runs here: a job
//! of the same task id from any other scheduler is refused ([`ForeignTask`]) before anything
//! changes, and only the owner names the task's peers. A scheduler restarted with its
//! certificate's key is the same peer, so it adopts its jobs as before.
//!
//! The bytes are staged in the job's directory under [`STAGING_DIR`] (opened beneath the job
//! directory like every other path, so an executor cannot redirect them), checked against the
//! sender's SHA-256, fsynced, and only then queued. The executor takes them with
//! `/resources/receive` or `/resources/fetch` (type `Peers`), which rename them into its
//! `out_dir` as `{sequence}-{name}`: the sequence number makes names from several peers, or
//! several rounds, distinct.
//!
//! Limits, and what happens at them: a peer that is neither the scheduler nor a named peer of
//! any task here is refused `not_in_task` at once, before its header is read, so that it holds
//! nothing; at most [`MAX_HANDSHAKES`] transfers are being asked for at once (their headers
//! read and their task checked; more are refused `busy`), at most
//! [`MAX_HANDSHAKES_PER_PEER`] of them by one peer and [`MAX_HANDSHAKES_PER_SCHEDULER`] by a
//! scheduler and the peers it named together (more are refused `busy`: a hostile scheduler
//! that names many certificates leaves the other schedulers' tasks half); only a
//! transfer a task's job takes then gets one of the [`MAX_CONCURRENT`] slots, at most
//! [`MAX_PER_PEER`] of them from one peer (more are refused `busy`, so one peer never takes
//! every slot, and a peer of no task takes none); at most [`MAX_WAITING`] files wait in one
//! inbox (more are refused `inbox_full`); a file must fit the disk beside every transfer
//! under way, with [`DISK_RESERVE`] to spare (else `too_large`; files waiting in inboxes are
//! on the disk already); the protocol's own limits (size, deadlines, the slowest rate) are
//! [`hypha_transfer`]'s.

use std::{
    collections::{HashMap, HashSet, VecDeque},
    ffi::{OsStr, OsString},
    os::unix::ffi::{OsStrExt, OsStringExt},
    path::Path,
    sync::{Arc, Mutex},
    time::Duration,
};

use futures::AsyncWriteExt;
use hypha_artifacts::Admission;
use hypha_messages::job::TaskPeers;
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
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

use super::paths::{JobDir, PathError};
use crate::{artifacts::ArtifactStore, metrics};

/// Where received files wait, relative to the job's directory.
pub const STAGING_DIR: &str = ".hypha/inbox";
/// Transfers whose header is being read and task checked at the same time; more are refused
/// `busy`. Each takes at most the protocol's header timeout.
pub const MAX_HANDSHAKES: usize = 64;
/// Transfers one peer may be asking for at the same time (headers being read); more are refused
/// `busy`, so that a task peer that opens streams and sends no header leaves the others room.
pub const MAX_HANDSHAKES_PER_PEER: usize = 8;
/// Transfers a scheduler and the peers its tasks here name may be asking for at the same time,
/// all together; more are refused `busy`.
pub const MAX_HANDSHAKES_PER_SCHEDULER: usize = MAX_HANDSHAKES / 2;
/// Transfers received at the same time; more are refused `busy`.
pub const MAX_CONCURRENT: usize = 32;
/// Transfers received from one peer at the same time; more are refused `busy`.
pub const MAX_PER_PEER: usize = 8;
/// Disk space a received file must leave free.
pub const DISK_RESERVE: u64 = 1024 * 1024 * 1024;
/// Files waiting in one job's inbox; more are refused `inbox_full` until the job takes some.
pub const MAX_WAITING: usize = 256;
pub use hypha_transfer::{Header, PROTOCOL, SEND_PATIENCE, SendError};

/// A file that arrived for a job and waits for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Arrived {
    /// Per job, from 0, in order of arrival.
    pub sequence: u64,
    pub from: PeerId,
    pub name: String,
    pub size: u64,
    /// `sha256:<hex>`.
    pub checksum: String,
    /// The file's name in [`STAGING_DIR`].
    staged: OsString,
}

/// One job's inbox.
#[derive(Debug)]
pub struct Inbox {
    job: String,
    dir: Arc<JobDir>,
    state: Mutex<InboxState>,
    arrived: Notify,
}

#[derive(Debug, Default)]
struct InboxState {
    next_sequence: u64,
    waiting: VecDeque<Arrived>,
}

impl Inbox {
    fn has_room(&self) -> bool {
        self.lock().waiting.len() < MAX_WAITING
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, InboxState> {
        // A panic while holding the lock leaves a consistent queue behind: take it anyway.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn push(&self, from: PeerId, name: &str, size: u64, checksum: &str, staged: OsString) {
        let mut state = self.lock();
        let sequence = state.next_sequence;
        state.next_sequence += 1;
        state.waiting.push_back(Arrived {
            sequence,
            from,
            name: name.to_string(),
            size,
            checksum: checksum.to_string(),
            staged,
        });
        drop(state);
        self.arrived.notify_waiters();
    }

    /// Waits for the oldest file sent by one of `from` (by anyone when `from` is empty) and
    /// takes it out of the queue.
    pub async fn next(&self, from: &HashSet<PeerId>) -> Arrived {
        loop {
            let notified = self.arrived.notified();
            tokio::pin!(notified);
            // Register before looking, so a push between the look and the wait is not missed.
            notified.as_mut().enable();
            {
                let mut state = self.lock();
                let position = state
                    .waiting
                    .iter()
                    .position(|a| from.is_empty() || from.contains(&a.from));
                if let Some(arrived) = position.and_then(|i| state.waiting.remove(i)) {
                    return arrived;
                }
            }
            notified.await;
        }
    }

    /// Moves a taken file into `out_dir` (relative to the job's directory) as
    /// `{sequence}-{name}` and returns that path.
    pub fn deliver(&self, arrived: &Arrived, out_dir: &Path) -> Result<String, PathError> {
        let staging = self.dir.create_dir_all(Path::new(STAGING_DIR))?;
        let target_dir = self.dir.create_dir_all(out_dir)?;
        let name = format!("{}-{}", arrived.sequence, arrived.name);
        let target = out_dir.join(&name);
        let io = |error: rustix::io::Errno| PathError::Io {
            path: target.display().to_string(),
            error: error.into(),
        };
        rustix::fs::renameat(&staging, &arrived.staged, &target_dir, name.as_str()).map_err(io)?;
        rustix::fs::fsync(&target_dir).map_err(io)?;
        Ok(target.display().to_string())
    }

    /// The job this inbox belongs to.
    pub fn job(&self) -> &str {
        &self.job
    }
}

/// The inboxes of every job on this worker, by task.
#[derive(Debug, Default)]
pub struct Inboxes {
    by_task: Mutex<HashMap<String, Task>>,
}

/// A job for a task that another scheduler owns on this worker.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "task {task} belongs to scheduler {owner} on this worker; a job of it from {claimant} is refused"
)]
pub struct ForeignTask {
    pub task: String,
    pub owner: PeerId,
    pub claimant: PeerId,
}

/// One task's jobs on this worker, and who may send to them.
#[derive(Debug)]
struct Task {
    inboxes: Vec<Arc<Inbox>>,
    /// The scheduler that dispatched the task's first job here; it alone dispatches further
    /// jobs of the task, may send to them, and tells who else may. Never changes.
    scheduler: PeerId,
    /// The workers that run the task's jobs, as the scheduler last said.
    peers: HashSet<PeerId>,
    /// The version of `peers`; an older list is not taken.
    version: u64,
}

/// A task's entry among the inboxes, while its scheduler is the one named.
struct TaskOf {
    inboxes: std::sync::Weak<Inboxes>,
    scheduler: PeerId,
    task: String,
}

impl TaskOf {
    /// `f` of the task's peers as its scheduler last said; `None` when no job of the task
    /// runs here or it belongs to another scheduler.
    fn peers<T>(&self, f: impl FnOnce(&HashSet<PeerId>) -> T) -> Option<T> {
        let inboxes = self.inboxes.upgrade()?;
        let by_task = inboxes.lock();
        let task = by_task.get(&self.task)?;
        (task.scheduler == self.scheduler).then(|| f(&task.peers))
    }
}

impl Task {
    /// Takes `peers` if they are newer than the list held.
    fn update(&mut self, peers: &TaskPeers) -> bool {
        if peers.version < self.version {
            return false;
        }
        // Peer ids as a scheduler sends them; anything unreadable names nobody.
        self.peers = peers.peers.iter().filter_map(|p| p.parse().ok()).collect();
        self.version = peers.version;
        true
    }
}

impl Inboxes {
    /// Whether `scheduler` may run a job of `task` here: nobody else owns the task.
    pub fn check_owner(&self, task: &str, scheduler: PeerId) -> Result<(), Box<ForeignTask>> {
        match self.lock().get(task) {
            Some(entry) if entry.scheduler != scheduler => Err(Box::new(ForeignTask {
                task: task.to_string(),
                owner: entry.scheduler,
                claimant: scheduler,
            })),
            _ => Ok(()),
        }
    }

    /// Opens the inbox of `job`, dispatched by `scheduler` with the task's `peers`; it
    /// receives what those send to `task` until the returned registration is dropped. The
    /// first job of a task makes `scheduler` its owner; a job of a task another scheduler
    /// owns is refused and changes nothing.
    pub fn open(
        self: &Arc<Self>,
        task: &str,
        job: &str,
        dir: Arc<JobDir>,
        scheduler: PeerId,
        peers: &TaskPeers,
    ) -> Result<Registration, Box<ForeignTask>> {
        let mut by_task = self.lock();
        let entry = by_task.entry(task.to_string()).or_insert_with(|| Task {
            inboxes: Vec::new(),
            scheduler,
            peers: HashSet::new(),
            version: 0,
        });
        if entry.scheduler != scheduler {
            return Err(Box::new(ForeignTask {
                task: task.to_string(),
                owner: entry.scheduler,
                claimant: scheduler,
            }));
        }
        entry.update(peers);
        let inbox = Arc::new(Inbox {
            job: job.to_string(),
            dir,
            state: Mutex::default(),
            arrived: Notify::new(),
        });
        entry.inboxes.push(inbox.clone());
        drop(by_task);
        Ok(Registration {
            inboxes: self.clone(),
            task: task.to_string(),
            inbox,
        })
    }

    /// `from` says which workers run `task`'s jobs now. Taken only from the scheduler that
    /// dispatched them, and only if newer than the list held (an older one is ignored, and
    /// still `true`); `false` when no job of the task runs here or `from` is not its
    /// scheduler.
    pub fn set_peers(&self, from: PeerId, task: &str, peers: &TaskPeers) -> bool {
        match self.lock().get_mut(task) {
            Some(entry) if entry.scheduler == from => {
                entry.update(peers);
                true
            }
            _ => false,
        }
    }

    /// Who may share the artifacts of `scheduler`'s `task` with this worker: the workers of
    /// the task's jobs, as its scheduler last said (while an artifact is shared, the list may
    /// change), named to the swarm so that it dials them. Nobody, should the task here
    /// belong to another scheduler.
    pub fn artifact_admission(self: &Arc<Self>, scheduler: PeerId, task: &str) -> Admission {
        let task = Arc::new(TaskOf {
            inboxes: Arc::downgrade(self),
            scheduler,
            task: task.to_string(),
        });
        let named = task.clone();
        Admission::new(move |peer| task.peers(|peers| peers.contains(peer)).unwrap_or(false))
            .naming(move || {
                named
                    .peers(|peers| peers.iter().copied().collect())
                    .unwrap_or_default()
            })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Task>> {
        self.by_task.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Who may share artifacts with this worker for `task`: see
    /// [`artifact_admission`](Self::artifact_admission), with the task's scheduler here.
    fn admission_of(self: &Arc<Self>, task: &str) -> Admission {
        let scheduler = self.lock().get(task).map(|t| t.scheduler);
        match scheduler {
            Some(scheduler) => self.artifact_admission(scheduler, task),
            None => Admission::new(|_| false),
        }
    }

    /// The schedulers whose tasks here `peer` may send to: as their scheduler, or as one of the
    /// workers it named. Nobody's for a peer that is refused before its header is read.
    fn vouchers(&self, peer: &PeerId) -> Vec<PeerId> {
        let mut vouchers: Vec<PeerId> = self
            .lock()
            .values()
            .filter(|task| task.scheduler == *peer || task.peers.contains(peer))
            .map(|task| task.scheduler)
            .collect();
        vouchers.sort_unstable();
        vouchers.dedup();
        vouchers
    }

    /// The inboxes of `task`'s jobs, if `sender` may send to them.
    fn of_task(&self, task: &str, sender: &PeerId) -> Result<Vec<Arc<Inbox>>, Refusal> {
        match self.lock().get(task) {
            None => Err(Refusal::new(
                RefusalCode::NoJob,
                format!("no job of task {task} runs on this worker"),
            )),
            Some(entry) if entry.scheduler == *sender || entry.peers.contains(sender) => {
                Ok(entry.inboxes.clone())
            }
            Some(_) => Err(Refusal::new(
                RefusalCode::NotInTask,
                format!("{sender} runs no job of task {task}, as its scheduler told this worker"),
            )),
        }
    }
}

/// A job's place among the [`Inboxes`]; dropping it closes the inbox.
#[derive(Debug)]
pub struct Registration {
    inboxes: Arc<Inboxes>,
    task: String,
    inbox: Arc<Inbox>,
}

impl Registration {
    pub fn inbox(&self) -> &Arc<Inbox> {
        &self.inbox
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut by_task = self.inboxes.lock();
        if let Some(entry) = by_task.get_mut(&self.task) {
            entry.inboxes.retain(|i| !Arc::ptr_eq(i, &self.inbox));
            if entry.inboxes.is_empty() {
                by_task.remove(&self.task);
            }
        }
    }
}

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
    let mut partial = match header.resumable_sha256() {
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

    let temp = match partial.as_mut() {
        Some(partial) => {
            let file = partial.file.try_clone().map_err(|e| io(&e))?;
            let received =
                receive_bytes(stream, file, header.size, &mut partial.received, peer).await;
            received.and_then(|checksum| {
                // Renamed before the claim on its name ends: the sender's next transfer removes
                // the sender's unclaimed kept files, and this one now waits in an inbox.
                let temp =
                    JobDir::rename_to_temp(&staging, &partial.name, OsStr::new(&header.name))
                        .map_err(|e| io(&e))?;
                Ok((checksum, temp))
            })
        }
        None => {
            let (file, temp) =
                JobDir::create_temp(&staging, OsStr::new(&header.name)).map_err(|e| io(&e))?;
            let mut received = Received::default();
            match receive_bytes(stream, file, header.size, &mut received, peer).await {
                Ok(checksum) => Ok((checksum, temp)),
                Err(refusal) => {
                    JobDir::discard(&staging, &temp);
                    Err(refusal)
                }
            }
        }
    };
    let (checksum, temp) = match (temp, partial) {
        (Ok(done), _) => done,
        // Bytes that proved wrong are not kept; what arrived of a transfer that broke off
        // is, for the sender's next try.
        (Err(refusal), Some(partial)) if refusal.code == RefusalCode::Mismatch => {
            JobDir::discard(&staging, &partial.name);
            return Err(refusal);
        }
        (Err(refusal), Some(partial)) => {
            partial.keep();
            return Err(refusal);
        }
        (Err(refusal), None) => return Err(refusal),
    };
    metrics::resource_bytes("received", header.size);
    let temp = OsString::from(OsStr::from_bytes(&temp));
    // Other jobs of the task on this worker get hard links (same bytes, their own names),
    // all made before any job is told, so none can move the file away first.
    let mut staged = vec![(first.clone(), temp.clone())];
    for inbox in &targets[1..] {
        match link_into(&staging, &temp, inbox, &header.name) {
            Ok(link) => staged.push((inbox.clone(), link)),
            Err(e) => {
                tracing::warn!(job = inbox.job(), error = %e, "cannot hand a received file to a job")
            }
        }
    }
    let delivered = staged.len();
    for (inbox, name) in staged {
        inbox.push(peer, &header.name, header.size, &checksum, name);
    }
    tracing::debug!(%peer, task = header.task, name = header.name, size = header.size, jobs = delivered, "resource received");
    Ok(Taken {
        jobs: delivered,
        fetching: None,
    })
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
    let single = super::paths::check(name)
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

/// [`hypha_transfer::send`], counted in the worker's metrics.
pub async fn send(
    network: &Network,
    peer: PeerId,
    header: &Header,
    file: std::fs::File,
    patience: std::time::Duration,
) -> Result<String, SendError> {
    let sent = hypha_transfer::send(network, peer, header, file, patience).await?;
    metrics::resource_bytes("sent", header.size);
    Ok(sent)
}
