//! One artifact's swarm on one node: an actor that decides which chunk to pull from where.
//!
//! There is no coordinator. Every node hears from every other member what it holds, what it
//! is pulling from the origin and how many chunks it is sending, and decides for itself:
//!
//! - **Origin**: a chunk nobody holds or pulls belongs to one member, `members[(chunk + k) %
//!   n]` over the sorted live members (k from the artifact id), and only its owner pulls it,
//!   within `origin_connections / n` connections. While the members agree on who is live,
//!   every chunk leaves the origin once. When a member leaves, its chunks get new owners;
//!   what it was pulling is pulled again (that is the only extra origin traffic). A node that
//!   banned every holder of a chunk pulls it itself.
//! - **Peers**: the rarest chunk first (fewest live holders; ties broken at random per node),
//!   from the holder with the fewest uploads under way, within the download slots.
//! - **Integrity**: the BLAKE3 a chunk's first holder announced is checked on every transfer;
//!   a peer whose bytes or announcements disagree is banned for this artifact.
//!
//! The actor owns all of this state; transfers, stream readers and writers are tasks that
//! report back through one bounded queue, so the actor never waits on the network.

use hypha_messages::artifact::Request;
use std::{
    collections::{BTreeMap, HashMap, HashSet},
    sync::{
        Arc, OnceLock,
        atomic::{AtomicU32, AtomicU64, Ordering},
    },
    time::Duration,
};

use futures::{AsyncReadExt, AsyncWriteExt, StreamExt};
use hypha_network::{Network, PeerId, Stream, shares::PeerShares};
use serde::Serialize;
use tokio::{
    sync::{Semaphore, mpsc, watch},
    time::Instant,
};

use crate::{
    Settings,
    assembly::{Assembly, ChunkSink},
    cache::{Cache, Record},
    manifest::{ArtifactId, Manifest},
    origin::{Origin, OriginError},
    protocol::{
        CHUNK_PROTOCOL, ChunkErrorCode, ChunkHeader, ChunkRequest, HelloReply, SWARM_PROTOCOL,
        SwarmMessage, provider_key, read_frame, write_frame,
    },
};

/// Events queued to a swarm's actor; senders wait when it is full.
pub(crate) const EVENT_QUEUE: usize = 1024;
/// Messages queued to one peer's writer. When full the peer is too slow to follow: its writer
/// is dropped and a fresh one (with a full snapshot) is opened at the next discovery.
const PEER_QUEUE: usize = 4096;
/// How long a peer may take to answer a hello or a chunk request, or stall mid-chunk.
const PEER_TIMEOUT: Duration = Duration::from_secs(30);
/// How often load is reported and stalled decisions are revisited.
const TICK: Duration = Duration::from_millis(250);
/// How often a chunk request that a holder dropped before answering is sent again, and the
/// first pause (doubled each time): 5 tries over about 0.15 s.
const NOT_ACCEPTED_ATTEMPTS: u32 = 5;
const NOT_ACCEPTED_PAUSE: Duration = Duration::from_millis(10);
/// How long a peer that refused us (busy, not a member, unreachable) is left alone.
const BACKOFF: Duration = Duration::from_secs(1);
/// Origin reads of one chunk tried before the fetch fails.
const ORIGIN_ATTEMPTS: u32 = 3;

/// What a node holds of an artifact, shared with the chunk server.
#[derive(Debug)]
pub(crate) struct Holding {
    pub(crate) assembly: Arc<Assembly>,
    hashes: Vec<OnceLock<[u8; 32]>>,
    held: AtomicU32,
    pub(crate) uploads: Arc<Semaphore>,
    upload_slots: usize,
    /// At most half the upload slots go to one peer.
    upload_shares: PeerShares,
    pub(crate) uploaded_chunks: AtomicU64,
    pub(crate) uploaded_bytes: AtomicU64,
}

impl Holding {
    pub(crate) fn new(assembly: Arc<Assembly>, upload_slots: usize) -> Holding {
        let count = assembly.manifest().chunk_count() as usize;
        Holding {
            assembly,
            hashes: (0..count).map(|_| OnceLock::new()).collect(),
            held: AtomicU32::new(0),
            uploads: Arc::new(Semaphore::new(upload_slots.max(1))),
            upload_slots: upload_slots.max(1),
            upload_shares: PeerShares::new(upload_slots.div_ceil(2)),
            uploaded_chunks: AtomicU64::new(0),
            uploaded_bytes: AtomicU64::new(0),
        }
    }

    /// The chunk's hash if it is held (written and verified).
    pub(crate) fn held(&self, chunk: u32) -> Option<[u8; 32]> {
        self.hashes
            .get(chunk as usize)
            .and_then(|h| h.get().copied())
    }

    pub(crate) fn hold(&self, chunk: u32, hash: [u8; 32]) {
        if let Some(slot) = self.hashes.get(chunk as usize)
            && slot.set(hash).is_ok()
        {
            self.held.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub(crate) fn held_count(&self) -> u32 {
        self.held.load(Ordering::Relaxed)
    }

    fn uploads_now(&self) -> u32 {
        (self.upload_slots - self.uploads.available_permits()) as u32
    }

    fn complete(&self) -> bool {
        self.held_count() as usize == self.hashes.len()
    }
}

/// Why a fetch failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Failure {
    /// The origin's object changed since the artifact was resolved.
    Changed(String),
    Failed(String),
}

/// A node's view of one artifact's distribution, for progress displays and results.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Progress {
    /// The artifact id's first 12 hex digits.
    pub artifact: String,
    pub size: u64,
    pub chunks: u32,
    pub held: u32,
    pub resumed_chunks: u32,
    pub origin_chunks: u32,
    pub origin_bytes: u64,
    pub peer_chunks: u32,
    pub peer_bytes: u64,
    pub uploaded_chunks: u64,
    pub uploaded_bytes: u64,
    /// Every live member but this node.
    pub peers: Vec<PeerProgress>,
    pub complete: bool,
    #[serde(skip)]
    pub(crate) failure: Option<Failure>,
}

impl Progress {
    /// Why the fetch failed, if it did.
    pub fn failure(&self) -> Option<String> {
        self.failure.as_ref().map(|f| match f {
            Failure::Changed(s) | Failure::Failed(s) => s.clone(),
        })
    }

    /// Whether every live member announced it holds everything.
    pub fn peers_done(&self) -> bool {
        self.peers.iter().all(|p| p.done)
    }
}

/// What this node knows of one other member.
#[derive(Debug, Clone, Serialize)]
pub struct PeerProgress {
    /// Kept as a `PeerId`, not text: progress is rebuilt on every event, and base58-encoding
    /// every member each time cost more than the rest of the progress report.
    pub peer: PeerId,
    pub held: u32,
    pub done: bool,
    /// It sent bytes that did not match their hash; it is not asked again.
    pub banned: bool,
}

/// Things the actor learns.
#[derive(Debug)]
pub(crate) enum Event {
    /// A member opened its swarm stream to us (its hello was answered).
    Joined {
        peer: PeerId,
        stream: Stream,
    },
    /// The DHT lists these members.
    Discovered(HashSet<PeerId>),
    Message {
        peer: PeerId,
        generation: u64,
        message: SwarmMessage,
    },
    ReaderClosed {
        peer: PeerId,
        generation: u64,
    },
    WriterEnded {
        peer: PeerId,
        generation: u64,
    },
    OriginPulled {
        chunk: u32,
        result: Result<[u8; 32], Failure>,
    },
    PeerPulled {
        chunk: u32,
        peer: PeerId,
        result: Result<[u8; 32], PeerFailure>,
    },
    Finished(Result<(), String>),
    Tick,
}

#[derive(Debug)]
pub(crate) enum PeerFailure {
    Busy,
    Corrupt(String),
    Failed(String),
}

#[derive(Debug, Default)]
struct Peer {
    /// Generation of the live inbound stream; `None` while the peer has not joined us.
    reader: Option<u64>,
    writer: Option<(u64, mpsc::Sender<SwarmMessage>)>,
    have: HashSet<u32>,
    pulling: HashSet<u32>,
    uploads: u32,
    done: bool,
    banned: bool,
    /// Our chunk requests to it under way.
    requests: u32,
    left_alone_until: Option<Instant>,
}

impl Peer {
    fn live(&self) -> bool {
        self.reader.is_some()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    Origin,
    Peer(PeerId),
}

/// What a swarm needs from its node.
#[derive(Debug, Clone)]
pub(crate) struct Context {
    pub network: Network,
    pub origin: Arc<Origin>,
    pub cache: Arc<Cache>,
    pub settings: Settings,
}

/// Starts the actor of one artifact. `expect` members (this node included) are waited for,
/// at most `settings.join_timeout`, before anything is pulled from the origin.
pub(crate) fn spawn(
    context: Context,
    request: Request,
    holding: Arc<Holding>,
    expect: usize,
    resumed_chunks: u32,
) -> (mpsc::Sender<Event>, watch::Receiver<Progress>) {
    let manifest = holding.assembly.manifest().clone();
    let (events_tx, events) = mpsc::channel(EVENT_QUEUE);
    let count = manifest.chunk_count();
    let progress = Progress {
        artifact: manifest.id.to_string(),
        size: manifest.size(),
        chunks: count,
        held: holding.held_count(),
        resumed_chunks,
        complete: holding.complete(),
        ..Progress::default()
    };
    let (progress_tx, progress_rx) = watch::channel(progress);
    let me = context.network.local_peer_id();
    let actor = Actor {
        me,
        offset: manifest.id.0[0] as usize,
        tie_break: rand::random(),
        join_deadline: Some(Instant::now() + context.settings.join_timeout),
        expect: expect.max(1),
        context,
        request,
        manifest,
        holding,
        peers: BTreeMap::new(),
        availability: vec![0; count as usize],
        known_hashes: vec![None; count as usize],
        in_flight: HashMap::new(),
        origin_attempts: HashMap::new(),
        origin_in_flight: 0,
        generation: 0,
        events_tx: events_tx.clone(),
        progress: progress_tx,
        finishing: false,
        reported_uploads: 0,
    };
    tokio::spawn(actor.run(events));
    (events_tx, progress_rx)
}

struct Actor {
    me: PeerId,
    offset: usize,
    tie_break: u64,
    /// Until the expected members are there (or this passes), nothing is read from the
    /// origin; `None` once they were: a member that dies later does not stop the others.
    join_deadline: Option<Instant>,
    expect: usize,
    context: Context,
    request: Request,
    manifest: Arc<Manifest>,
    holding: Arc<Holding>,
    peers: BTreeMap<PeerId, Peer>,
    /// Live, unbanned holders of each chunk.
    availability: Vec<u16>,
    /// The hash each chunk must have: ours, or the first one a member announced.
    known_hashes: Vec<Option<[u8; 32]>>,
    in_flight: HashMap<u32, Source>,
    origin_attempts: HashMap<u32, u32>,
    origin_in_flight: usize,
    generation: u64,
    events_tx: mpsc::Sender<Event>,
    progress: watch::Sender<Progress>,
    finishing: bool,
    reported_uploads: u32,
}

impl Actor {
    async fn run(mut self, mut events: mpsc::Receiver<Event>) {
        for chunk in 0..self.manifest.chunk_count() {
            self.known_hashes[chunk as usize] = self.holding.held(chunk);
        }
        let key = provider_key(self.manifest.id);
        if let Err(e) = self.context.network.start_providing(&key).await {
            tracing::warn!(artifact = %self.manifest.id, "cannot announce in the DHT: {e}");
        }
        let discovery = tokio::spawn(discover(
            self.context.network.clone(),
            key.clone(),
            self.events_tx.downgrade(),
            self.context.settings.discovery_interval,
        ));
        let ticker = tokio::spawn(tick(self.events_tx.downgrade()));
        self.schedule();
        while let Some(event) = events.recv().await {
            self.handle(event);
            self.schedule();
            self.publish();
            // The node dropped every handle on this swarm: leave it.
            if self.progress.is_closed() {
                break;
            }
        }
        discovery.abort();
        ticker.abort();
        let _ = self.context.network.stop_providing(&key).await;
    }

    fn handle(&mut self, event: Event) {
        match event {
            Event::Joined { peer, stream } => self.joined(peer, stream),
            Event::Discovered(found) => {
                for peer in found {
                    if peer != self.me {
                        self.connect(peer);
                    }
                }
            }
            Event::Message {
                peer,
                generation,
                message,
            } => {
                if self.peers.get(&peer).and_then(|p| p.reader) == Some(generation) {
                    self.message(peer, message);
                }
            }
            Event::ReaderClosed { peer, generation } => {
                if self.peers.get(&peer).and_then(|p| p.reader) == Some(generation) {
                    tracing::debug!(artifact = %self.manifest.id, %peer, "member left");
                    self.forget(peer);
                }
            }
            Event::WriterEnded { peer, generation } => {
                if let Some(p) = self.peers.get_mut(&peer)
                    && p.writer.as_ref().map(|(g, _)| *g) == Some(generation)
                {
                    p.writer = None;
                    p.left_alone_until = Some(Instant::now() + BACKOFF);
                }
            }
            Event::OriginPulled { chunk, result } => {
                self.in_flight.remove(&chunk);
                self.origin_in_flight -= 1;
                match result {
                    Ok(hash) => self.held(chunk, hash, Source::Origin),
                    Err(Failure::Changed(reason)) => self.fail(Failure::Changed(reason)),
                    Err(Failure::Failed(reason)) => {
                        self.broadcast(SwarmMessage::Released { chunk });
                        let attempts = self.origin_attempts.entry(chunk).or_default();
                        *attempts += 1;
                        tracing::warn!(artifact = %self.manifest.id, chunk, attempt = *attempts, "origin read failed: {reason}");
                        if *attempts >= ORIGIN_ATTEMPTS {
                            self.fail(Failure::Failed(reason));
                        }
                    }
                }
            }
            Event::PeerPulled {
                chunk,
                peer,
                result,
            } => {
                self.in_flight.remove(&chunk);
                if let Some(p) = self.peers.get_mut(&peer) {
                    p.requests = p.requests.saturating_sub(1);
                }
                match result {
                    Ok(hash) => self.held(chunk, hash, Source::Peer(peer)),
                    Err(PeerFailure::Busy) => {
                        if let Some(p) = self.peers.get_mut(&peer) {
                            p.left_alone_until = Some(Instant::now() + TICK);
                        }
                    }
                    Err(PeerFailure::Corrupt(reason)) => {
                        tracing::warn!(artifact = %self.manifest.id, %peer, chunk, "peer sent a bad chunk ({reason}); not asking it again for this artifact");
                        self.ban(peer);
                    }
                    Err(PeerFailure::Failed(reason)) => {
                        tracing::debug!(artifact = %self.manifest.id, %peer, chunk, "chunk transfer failed: {reason}");
                        if let Some(p) = self.peers.get_mut(&peer) {
                            p.left_alone_until = Some(Instant::now() + BACKOFF);
                        }
                    }
                }
            }
            Event::Finished(result) => match result {
                Ok(()) => {
                    tracing::info!(artifact = %self.manifest.id, "complete");
                    self.progress.send_modify(|p| p.complete = true);
                    self.broadcast(SwarmMessage::Done);
                }
                Err(reason) => self.fail(Failure::Failed(reason)),
            },
            Event::Tick => {
                let uploads = self.holding.uploads_now();
                if uploads != self.reported_uploads {
                    self.reported_uploads = uploads;
                    self.broadcast(SwarmMessage::Load { uploads });
                }
            }
        }
    }

    fn fail(&mut self, failure: Failure) {
        if self.progress.borrow().failure.is_none() {
            self.progress.send_modify(|p| p.failure = Some(failure));
        }
    }

    fn failed(&self) -> bool {
        self.progress.borrow().failure.is_some()
    }

    /// A member opened its stream to us: read it, and make sure ours to it is open.
    fn joined(&mut self, peer: PeerId, stream: Stream) {
        if self.failed() {
            return;
        }
        if self.peers.get(&peer).is_some_and(Peer::live) {
            // It reconnected: what it told us before no longer counts.
            self.forget(peer);
        }
        self.generation += 1;
        let generation = self.generation;
        let entry = self.peers.entry(peer).or_default();
        entry.reader = Some(generation);
        entry.left_alone_until = None;
        tracing::debug!(artifact = %self.manifest.id, %peer, "member joined");
        tokio::spawn(read_from(peer, generation, stream, self.events_tx.clone()));
        self.connect(peer);
    }

    /// Opens our stream to `peer` unless one is open or it was refused a moment ago.
    fn connect(&mut self, peer: PeerId) {
        if self.failed() {
            return;
        }
        let now = Instant::now();
        let entry = self.peers.entry(peer).or_default();
        if entry.writer.is_some() || entry.left_alone_until.is_some_and(|t| now < t) {
            return;
        }
        self.generation += 1;
        let generation = self.generation;
        let (tx, rx) = mpsc::channel(PEER_QUEUE);
        entry.writer = Some((generation, tx));
        let mut initial: Vec<SwarmMessage> = (0..self.manifest.chunk_count())
            .filter_map(|chunk| {
                self.holding
                    .held(chunk)
                    .map(|blake3| SwarmMessage::Have { chunk, blake3 })
            })
            .collect();
        initial.extend(
            self.in_flight
                .iter()
                .filter(|(_, s)| **s == Source::Origin)
                .map(|(&chunk, _)| SwarmMessage::Pulling { chunk }),
        );
        initial.push(SwarmMessage::Load {
            uploads: self.reported_uploads,
        });
        if self.progress.borrow().complete {
            initial.push(SwarmMessage::Done);
        }
        tokio::spawn(write_to(
            self.context.network.clone(),
            peer,
            self.manifest.id,
            generation,
            initial,
            rx,
            self.events_tx.clone(),
        ));
    }

    /// Drops everything a peer told us (it left, or reconnects).
    fn forget(&mut self, peer: PeerId) {
        if let Some(p) = self.peers.get_mut(&peer) {
            if !p.banned {
                for &chunk in &p.have {
                    self.availability[chunk as usize] -= 1;
                }
            }
            p.have.clear();
            p.pulling.clear();
            p.done = false;
            p.uploads = 0;
            p.reader = None;
            p.writer = None;
        }
    }

    fn ban(&mut self, peer: PeerId) {
        if let Some(p) = self.peers.get_mut(&peer)
            && !p.banned
        {
            p.banned = true;
            for &chunk in &p.have {
                self.availability[chunk as usize] -= 1;
            }
        }
    }

    fn message(&mut self, peer: PeerId, message: SwarmMessage) {
        let count = self.manifest.chunk_count();
        let chunk_of = |m: &SwarmMessage| match m {
            SwarmMessage::Have { chunk, .. }
            | SwarmMessage::Pulling { chunk }
            | SwarmMessage::Released { chunk } => Some(*chunk),
            _ => None,
        };
        if chunk_of(&message).is_some_and(|c| c >= count) {
            tracing::warn!(artifact = %self.manifest.id, %peer, "ignoring a message about a chunk the artifact does not have: {message:?}");
            return;
        }
        let Some(p) = self.peers.get_mut(&peer) else {
            return;
        };
        match message {
            SwarmMessage::Have { chunk, blake3 } => {
                p.pulling.remove(&chunk);
                let known = &mut self.known_hashes[chunk as usize];
                match known {
                    Some(hash) if *hash != blake3 => {
                        tracing::warn!(artifact = %self.manifest.id, %peer, chunk, "peer announced a hash that differs from the chunk's; not asking it again for this artifact");
                        self.ban(peer);
                        return;
                    }
                    _ => *known = Some(blake3),
                }
                if p.have.insert(chunk) && !p.banned {
                    self.availability[chunk as usize] += 1;
                }
            }
            SwarmMessage::Pulling { chunk } => {
                p.pulling.insert(chunk);
            }
            SwarmMessage::Released { chunk } => {
                p.pulling.remove(&chunk);
            }
            SwarmMessage::Load { uploads } => p.uploads = uploads,
            SwarmMessage::Done => p.done = true,
            SwarmMessage::Hello { .. } => {}
        }
    }

    /// A chunk arrived and was verified.
    fn held(&mut self, chunk: u32, hash: [u8; 32], source: Source) {
        if self.holding.held(chunk).is_some() {
            return;
        }
        let len = self.manifest.chunks()[chunk as usize].len;
        if let Source::Origin = source {
            if let Some(known) = self.known_hashes[chunk as usize]
                && known != hash
            {
                // A member announced another hash for bytes we just read from the origin
                // ourselves: the origin is the authority.
                tracing::warn!(artifact = %self.manifest.id, chunk, "a member's hash for this chunk disagrees with the origin's bytes");
            }
            self.known_hashes[chunk as usize] = Some(hash);
        }
        self.holding.hold(chunk, hash);
        self.progress.send_modify(|p| {
            p.held += 1;
            match source {
                Source::Origin => {
                    p.origin_chunks += 1;
                    p.origin_bytes += len;
                }
                Source::Peer(_) => {
                    p.peer_chunks += 1;
                    p.peer_bytes += len;
                }
            }
        });
        self.broadcast(SwarmMessage::Have {
            chunk,
            blake3: hash,
        });
        let cache = self.context.cache.clone();
        let id = self.manifest.id;
        tokio::task::spawn_blocking(move || {
            if let Err(e) = cache.record_chunk(id, chunk, &hash) {
                tracing::warn!("cannot record chunk {chunk} of {id} for resuming: {e}");
            }
        });
    }

    fn broadcast(&mut self, message: SwarmMessage) {
        for (peer, p) in &mut self.peers {
            if let Some((_, tx)) = &p.writer
                && tx.try_send(message.clone()).is_err()
            {
                tracing::debug!(%peer, "peer queue full or closed; reconnecting later");
                p.writer = None;
            }
        }
    }

    fn members(&self) -> Vec<PeerId> {
        let mut members: Vec<PeerId> = self
            .peers
            .iter()
            .filter(|(_, p)| p.live())
            .map(|(id, _)| *id)
            .chain(std::iter::once(self.me))
            .collect();
        members.sort();
        members
    }

    fn schedule(&mut self) {
        if self.finishing || self.failed() {
            return;
        }
        if self.holding.complete() {
            if !self.progress.borrow().complete {
                self.finish();
            }
            return;
        }
        let slots = self.context.settings.download_slots.max(1);
        let members = self.members();
        if self
            .join_deadline
            .is_some_and(|deadline| members.len() >= self.expect || Instant::now() >= deadline)
        {
            self.join_deadline = None;
        }
        if self.join_deadline.is_none() {
            let origin_slots =
                slots.min((self.context.settings.origin_connections / members.len()).max(1));
            while self.origin_in_flight < origin_slots && self.in_flight.len() < slots {
                let Some(chunk) = self.next_origin_chunk(&members) else {
                    break;
                };
                self.pull_from_origin(chunk);
            }
        }
        if self.in_flight.len() < slots {
            for (chunk, peer) in self.next_peer_chunks(slots - self.in_flight.len()) {
                self.pull_from_peer(chunk, peer);
            }
        }
    }

    fn next_origin_chunk(&self, members: &[PeerId]) -> Option<u32> {
        let n = members.len();
        (0..self.manifest.chunk_count()).find(|&chunk| {
            if self.holding.held(chunk).is_some()
                || self.in_flight.contains_key(&chunk)
                || self.availability[chunk as usize] > 0
            {
                return false;
            }
            let mut banned_has_it = false;
            for p in self.peers.values().filter(|p| p.live()) {
                if p.pulling.contains(&chunk) || p.have.contains(&chunk) {
                    if !p.banned {
                        return false;
                    }
                    banned_has_it = true;
                }
            }
            banned_has_it || members[(chunk as usize + self.offset) % n] == self.me
        })
    }

    /// Up to `want` (chunk, holder) pairs: rarest chunks first, least loaded holders.
    fn next_peer_chunks(&self, want: usize) -> Vec<(u32, PeerId)> {
        let now = Instant::now();
        let upload_slots = self.context.settings.upload_slots.max(1) as u32;
        let mut load: HashMap<PeerId, u32> = self
            .peers
            .iter()
            .filter(|(_, p)| p.live() && !p.banned && p.left_alone_until.is_none_or(|t| now >= t))
            .map(|(id, p)| (*id, p.uploads.max(p.requests)))
            .collect();
        if load.is_empty() {
            return Vec::new();
        }
        let mut candidates: Vec<(u16, u64, u32)> = (0..self.manifest.chunk_count())
            .filter(|&c| {
                self.availability[c as usize] > 0
                    && self.holding.held(c).is_none()
                    && !self.in_flight.contains_key(&c)
            })
            .map(|c| {
                let spread = (c as u64 ^ self.tie_break).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                (self.availability[c as usize], spread, c)
            })
            .collect();
        candidates.sort_unstable();
        let mut picked = Vec::new();
        for (_, _, chunk) in candidates {
            if picked.len() >= want {
                break;
            }
            let holder = load
                .iter()
                .filter(|(id, l)| **l < upload_slots && self.peers[*id].have.contains(&chunk))
                .min_by_key(|(id, l)| {
                    (
                        **l,
                        (id.to_bytes().last().copied().unwrap_or(0) as u64) ^ self.tie_break,
                    )
                })
                .map(|(id, _)| *id);
            if let Some(holder) = holder {
                *load.entry(holder).or_default() += 1;
                picked.push((chunk, holder));
            }
        }
        picked
    }

    fn pull_from_origin(&mut self, chunk: u32) {
        self.in_flight.insert(chunk, Source::Origin);
        self.origin_in_flight += 1;
        self.broadcast(SwarmMessage::Pulling { chunk });
        let origin = self.context.origin.clone();
        let holding = self.holding.clone();
        let events = self.events_tx.clone();
        tokio::spawn(async move {
            let result = read_origin(&origin, &holding, chunk).await;
            let _ = events.send(Event::OriginPulled { chunk, result }).await;
        });
    }

    fn pull_from_peer(&mut self, chunk: u32, peer: PeerId) {
        let Some(expected) = self.known_hashes[chunk as usize] else {
            return;
        };
        self.in_flight.insert(chunk, Source::Peer(peer));
        if let Some(p) = self.peers.get_mut(&peer) {
            p.requests += 1;
        }
        let network = self.context.network.clone();
        let holding = self.holding.clone();
        let events = self.events_tx.clone();
        tokio::spawn(async move {
            let result = read_peer(&network, peer, &holding, chunk, expected).await;
            let _ = events
                .send(Event::PeerPulled {
                    chunk,
                    peer,
                    result,
                })
                .await;
        });
    }

    /// Every chunk is in: sync, rename into place, remember it.
    fn finish(&mut self) {
        self.finishing = true;
        let holding = self.holding.clone();
        let cache = self.context.cache.clone();
        let request = self.request.clone();
        let manifest = (*self.manifest).clone();
        let events = self.events_tx.clone();
        tokio::spawn(async move {
            let result = tokio::task::spawn_blocking(move || {
                holding
                    .assembly
                    .finish()
                    .map_err(|e| format!("cannot complete the files: {e}"))?;
                let hashes = (0..manifest.chunk_count())
                    .map(|c| holding.held(c).map(hex::encode).unwrap_or_default())
                    .collect();
                cache
                    .record_completed(&Record {
                        request,
                        manifest,
                        hashes,
                        unpacked: false,
                    })
                    .map_err(|e| e.to_string())
            })
            .await
            .unwrap_or_else(|e| Err(e.to_string()));
            let _ = events.send(Event::Finished(result)).await;
        });
    }

    fn publish(&mut self) {
        let peers: Vec<PeerProgress> = self
            .peers
            .iter()
            .filter(|(_, p)| p.live())
            .map(|(id, p)| PeerProgress {
                peer: *id,
                held: p.have.len() as u32,
                done: p.done,
                banned: p.banned,
            })
            .collect();
        let uploaded_chunks = self.holding.uploaded_chunks.load(Ordering::Relaxed);
        let uploaded_bytes = self.holding.uploaded_bytes.load(Ordering::Relaxed);
        self.progress.send_if_modified(|p| {
            let changed = p.uploaded_bytes != uploaded_bytes
                || p.peers.len() != peers.len()
                || p.peers
                    .iter()
                    .zip(&peers)
                    .any(|(a, b)| a.held != b.held || a.done != b.done || a.banned != b.banned);
            p.uploaded_chunks = uploaded_chunks;
            p.uploaded_bytes = uploaded_bytes;
            p.peers = peers;
            changed
        });
    }
}

async fn read_origin(origin: &Origin, holding: &Holding, chunk: u32) -> Result<[u8; 32], Failure> {
    let manifest = holding.assembly.manifest();
    let span = manifest.chunks()[chunk as usize];
    let file = &manifest.files[span.file];
    let failure = |e: OriginError| match e {
        OriginError::Changed { .. } => Failure::Changed(e.to_string()),
        e => Failure::Failed(e.to_string()),
    };
    let mut stream = origin
        .read(file, span.offset..span.offset + span.len)
        .await
        .map_err(failure)?;
    let mut sink = ChunkSink::new(holding.assembly.clone(), span);
    while let Some(bytes) = stream.next().await {
        sink.push(&bytes.map_err(failure)?)
            .await
            .map_err(|e| Failure::Failed(e.to_string()))?;
    }
    sink.finish()
        .await
        .map_err(|e| Failure::Failed(format!("origin: {e}")))
}

async fn read_peer(
    network: &Network,
    peer: PeerId,
    holding: &Holding,
    chunk: u32,
    expected: [u8; 32],
) -> Result<[u8; 32], PeerFailure> {
    let failed = |e: &dyn std::fmt::Display| PeerFailure::Failed(e.to_string());
    let span = holding.assembly.manifest().chunks()[chunk as usize];
    let request = ChunkRequest {
        artifact: holding.assembly.manifest().id,
        chunk,
    };
    // `libp2p-stream` hands inbound streams to the holder through a one-slot queue and drops
    // those that arrive while it is occupied, which a busy holder's many downloaders make
    // likely; the request then fails before any answer. Asking again a moment later is far
    // better than leaving the holder alone for `BACKOFF`: at the end of a distribution the
    // last chunks have few holders.
    let mut pause = NOT_ACCEPTED_PAUSE;
    let mut attempt = 1;
    let (mut stream, header) = loop {
        let outcome = async {
            let mut stream = network
                .open_stream(peer, CHUNK_PROTOCOL)
                .await
                .map_err(|e| e.to_string())?;
            write_frame(&mut stream, &request)
                .await
                .map_err(|e| e.to_string())?;
            let header: ChunkHeader = read_frame(&mut stream).await.map_err(|e| e.to_string())?;
            Ok::<_, String>((stream, header))
        };
        match tokio::time::timeout(PEER_TIMEOUT, outcome).await {
            Ok(Ok(answered)) => break answered,
            Ok(Err(reason)) if attempt < NOT_ACCEPTED_ATTEMPTS => {
                tracing::trace!(%peer, chunk, attempt, "chunk request not accepted: {reason}");
                tokio::time::sleep(pause).await;
                pause *= 2;
                attempt += 1;
            }
            Ok(Err(reason)) => return Err(failed(&reason)),
            Err(_) => return Err(failed(&"no answer")),
        }
    };
    match header {
        ChunkHeader::Ok { size } if size == span.len => {}
        ChunkHeader::Ok { size } => {
            return Err(PeerFailure::Corrupt(format!(
                "offered {size} bytes for a chunk of {}",
                span.len
            )));
        }
        ChunkHeader::Error {
            code: ChunkErrorCode::Busy,
            ..
        } => return Err(PeerFailure::Busy),
        ChunkHeader::Error { code, message } => {
            return Err(PeerFailure::Failed(format!("{code:?}: {message}")));
        }
    }
    let mut sink = ChunkSink::new(holding.assembly.clone(), span);
    let mut buf = vec![0u8; 256 * 1024];
    while sink.received() < span.len {
        let want = buf.len().min((span.len - sink.received()) as usize);
        let n = tokio::time::timeout(PEER_TIMEOUT, stream.read(&mut buf[..want]))
            .await
            .map_err(|_| failed(&"stalled"))?
            .map_err(|e| failed(&e))?;
        if n == 0 {
            return Err(failed(&"the peer closed the stream mid-chunk"));
        }
        sink.push(&buf[..n]).await.map_err(|e| failed(&e))?;
    }
    let hash = sink.finish().await.map_err(|e| failed(&e))?;
    if hash != expected {
        return Err(PeerFailure::Corrupt("BLAKE3 mismatch".into()));
    }
    Ok(hash)
}

async fn read_from(peer: PeerId, generation: u64, mut stream: Stream, events: mpsc::Sender<Event>) {
    loop {
        match read_frame::<SwarmMessage>(&mut stream).await {
            Ok(message) => {
                if events
                    .send(Event::Message {
                        peer,
                        generation,
                        message,
                    })
                    .await
                    .is_err()
                {
                    return;
                }
            }
            Err(e) => {
                tracing::debug!(%peer, "swarm stream ended: {e}");
                break;
            }
        }
    }
    let _ = events.send(Event::ReaderClosed { peer, generation }).await;
}

async fn write_to(
    network: Network,
    peer: PeerId,
    artifact: ArtifactId,
    generation: u64,
    initial: Vec<SwarmMessage>,
    mut queue: mpsc::Receiver<SwarmMessage>,
    events: mpsc::Sender<Event>,
) {
    let result: Result<(), String> = async {
        let mut stream = network
            .open_stream(peer, SWARM_PROTOCOL)
            .await
            .map_err(|e| e.to_string())?;
        write_frame(&mut stream, &SwarmMessage::Hello { artifact })
            .await
            .map_err(|e| e.to_string())?;
        let reply: HelloReply = tokio::time::timeout(PEER_TIMEOUT, read_frame(&mut stream))
            .await
            .map_err(|_| "no answer to hello".to_string())?
            .map_err(|e| e.to_string())?;
        if reply == HelloReply::NotMember {
            return Err("not a member".into());
        }
        for message in initial {
            write_frame(&mut stream, &message)
                .await
                .map_err(|e| e.to_string())?;
        }
        while let Some(message) = queue.recv().await {
            write_frame(&mut stream, &message)
                .await
                .map_err(|e| e.to_string())?;
        }
        let _ = stream.close().await;
        Ok(())
    }
    .await;
    if let Err(reason) = result {
        tracing::debug!(%peer, %artifact, "swarm stream to peer ended: {reason}");
    }
    let _ = events.send(Event::WriterEnded { peer, generation }).await;
}

async fn discover(
    network: Network,
    key: Vec<u8>,
    events: mpsc::WeakSender<Event>,
    interval: Duration,
) {
    loop {
        match network.get_providers(&key).await {
            Ok(found) => {
                let Some(events) = events.upgrade() else {
                    return;
                };
                if events.send(Event::Discovered(found)).await.is_err() {
                    return;
                }
            }
            Err(e) => tracing::debug!("artifact discovery: {e}"),
        }
        tokio::time::sleep(interval).await;
    }
}

async fn tick(events: mpsc::WeakSender<Event>) {
    let mut interval = tokio::time::interval(TICK);
    loop {
        interval.tick().await;
        let Some(events) = events.upgrade() else {
            return;
        };
        if events.send(Event::Tick).await.is_err() {
            return;
        }
    }
}

/// Serves one chunk request on an inbound stream.
pub(crate) async fn serve_chunk(
    mut stream: Stream,
    peer: PeerId,
    lookup: impl FnOnce(ArtifactId) -> Option<Arc<Holding>>,
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
    let Some(holding) = lookup(request.artifact) else {
        let _ = write_frame(
            &mut stream,
            &refuse(
                ChunkErrorCode::UnknownArtifact,
                format!("not in the swarm of {}", request.artifact),
            ),
        )
        .await;
        return;
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
    if holding.held(request.chunk).is_none() {
        let _ = write_frame(
            &mut stream,
            &refuse(
                ChunkErrorCode::Missing,
                format!("chunk {} is not held here", request.chunk),
            ),
        )
        .await;
        return;
    }
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
    let result: Result<(), String> = async {
        write_frame(&mut stream, &ChunkHeader::Ok { size: span.len })
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
        while let Some(pending) = next.take() {
            let block = pending
                .await
                .map_err(|e| e.to_string())?
                .map_err(|e| e.to_string())?;
            offset += block.len() as u64;
            if offset < span.len {
                next = Some(read(offset));
            }
            tokio::time::timeout(PEER_TIMEOUT, stream.write_all(&block))
                .await
                .map_err(|_| "the peer stopped reading".to_string())?
                .map_err(|e| e.to_string())?;
        }
        stream.close().await.map_err(|e| e.to_string())?;
        Ok(())
    }
    .await;
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
