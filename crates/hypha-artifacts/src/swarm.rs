//! One artifact's swarm on one node: an actor that decides which chunk to pull from where.
//!
//! There is no coordinator. Every node hears from every other member what it holds, what it
//! is pulling from the origin and how many chunks it is sending, and decides for itself:
//!
//! - **Membership**: a member is a peer whose stream to this node is open, and this node
//!   keeps its own stream to each open (a refused or broken one is opened again). Members
//!   are found in the DHT and, while the expected ones are not all there, among the peers the
//!   fetches name (a job's workers): a slow DHT must not let the join timeout pass.
//! - **Origin**: a chunk belongs to one member, `members[(chunk + k) % n]` over the sorted
//!   live members (k from the artifact id), and only its owner reads it from the origin,
//!   within `origin_connections / n` connections. While the members agree on who is live,
//!   every chunk leaves the origin once. When a member leaves, its chunks get new owners;
//!   what it was reading is read again. Where this node banned the owner, or the owner has
//!   said it is reading a chunk for longer than `PULLING_PATIENCE`, the next member in
//!   that order reads it.
//! - **Peers**: the rarest chunk first (fewest live holders; ties broken at random per node),
//!   from the holder with the fewest uploads under way, within the download slots.
//! - **Integrity**: a chunk's hash is trusted only as far as the origin vouches for it. A
//!   member that reads a chunk from the origin announces its hash `from_origin`. Chunks are
//!   pulled from peers only with a hash vouched for by a member whose turn it was to read the
//!   chunk when it said so (as this node saw the ring), by two members that agree, or by
//!   this node's own origin read, or held with it by two live members (where no two hold it
//!   with another: a newcomer to members that hold everything cannot know whose turn each
//!   chunk was) unless it is this node's turn to read it, and every transfer is checked
//!   against it; a claim by any
//!   other single member (a liar announcing first, say) leaves the chunk to be read in turn.
//!   What a member vouched for stands after it leaves, and it cannot take it back. When
//!   members vouch for different hashes, or for another hash than the one this node holds
//!   (even while it arrives), this node reads the chunk (or only its hash) from the origin,
//!   and the files are not final before it has; the members the origin contradicts are
//!   banned, never one that merely relayed what it was given, and chunks taken on their word
//!   alone are dropped and fetched again. A random share of the chunks
//!   (`Settings::origin_audit`, chosen by each node and told to nobody) is read from the
//!   origin although peers hold them: a member lying about chunks that were its own to read
//!   is caught with probability `1 - (1 - share)^(n - 1)` per chunk. A peer whose bytes
//!   disagree with the hash it announced, or that fails `FAILURES_BEFORE_BAN` requests in
//!   a row for chunks it announced, is not asked again for this artifact.
//! - **Liveness**: no single member can hold a chunk up for longer than
//!   `Settings::stall_patience`. A chunk whose holders never send it (they answer `busy`,
//!   `missing`, or report full loads) while this node receives nothing else is read from the
//!   origin by the next member in turn that does not hold it; a member whose turn it is to
//!   read chunks and that reads nothing for that long (since it joined, the ring last
//!   changed, or it last read one) is passed over, as one reading for longer than
//!   `PULLING_PATIENCE` is. A holder sending slower than `MIN_PEER_RATE` fails the
//!   transfer, one holder gets at most half the download slots while there are others, and
//!   a member that drops a chunk it read from the origin is not asked again.
//!
//! The actor owns all of this state; transfers, stream readers and writers are tasks that
//! report back through one bounded queue, so the actor never waits on the network.

use hypha_messages::artifact::Request;
use std::{
    collections::{BTreeMap, HashMap, HashSet},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering},
    },
    time::Duration,
};

use futures::{AsyncReadExt, AsyncWriteExt, StreamExt};
use hypha_network::{
    Network, PeerId, Stream,
    frame::{AskError, ask},
    shares::PeerShares,
};
use serde::Serialize;
use tokio::{
    sync::{Semaphore, mpsc, watch},
    time::Instant,
};

use crate::{
    Settings,
    assembly::{Assembly, ChunkSink},
    cache::{Cache, Record, Stamp},
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
/// How long a peer that refused us (busy, not a member, unreachable) is left alone.
const BACKOFF: Duration = Duration::from_secs(1);
/// The slowest a holder may send a chunk (bytes per second, after [`PEER_TIMEOUT`]) before the
/// transfer fails and counts against it.
const MIN_PEER_RATE: u64 = 32 * 1024;
/// How long a member may take to read a chunk from the origin before the next member reads it
/// too: a member that says it is reading and never finishes must not stall the swarm. Long
/// enough for a 64 MiB chunk at 256 KiB/s.
const PULLING_PATIENCE: Duration = Duration::from_secs(300);
/// Origin reads of one chunk tried before the fetch fails.
const ORIGIN_ATTEMPTS: u32 = 3;
/// Chunk requests in a row a holder may fail (no answer, stream closed, a malformed answer)
/// before it is not asked again for this artifact. Refusals an honest member gives too
/// (`busy`, `missing`, `not_admitted`) are not counted: a member that only refuses holds its
/// chunks up for at most `Settings::stall_patience`.
const FAILURES_BEFORE_BAN: u32 = 3;

/// A chunk this node holds: its hash, and whether the bytes came from the origin itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Held {
    pub(crate) hash: [u8; 32],
    pub(crate) from_origin: bool,
}

/// What a node holds of an artifact, shared with the chunk server.
#[derive(Debug)]
pub(crate) struct Holding {
    pub(crate) assembly: Arc<Assembly>,
    chunks: Vec<Mutex<Option<Held>>>,
    /// Whether each chunk is held, readable without a lock: the actor asks for every chunk
    /// on every event.
    present: Vec<AtomicBool>,
    /// Chunks found changed on disk while being served: no longer served from here (the
    /// cache's stamps have them fetched again by the next fetch of the artifact).
    damaged: Vec<AtomicBool>,
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
            chunks: (0..count).map(|_| Mutex::new(None)).collect(),
            present: (0..count).map(|_| AtomicBool::new(false)).collect(),
            damaged: (0..count).map(|_| AtomicBool::new(false)).collect(),
            held: AtomicU32::new(0),
            uploads: Arc::new(Semaphore::new(upload_slots.max(1))),
            upload_slots: upload_slots.max(1),
            upload_shares: PeerShares::new(upload_slots.div_ceil(2)),
            uploaded_chunks: AtomicU64::new(0),
            uploaded_bytes: AtomicU64::new(0),
        }
    }

    fn slot(&self, chunk: u32) -> Option<std::sync::MutexGuard<'_, Option<Held>>> {
        self.chunks
            .get(chunk as usize)
            .map(|slot| slot.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// The chunk's hash if it is held (written and verified).
    pub(crate) fn held(&self, chunk: u32) -> Option<[u8; 32]> {
        self.held_as(chunk).map(|held| held.hash)
    }

    pub(crate) fn held_as(&self, chunk: u32) -> Option<Held> {
        self.slot(chunk).and_then(|slot| *slot)
    }

    pub(crate) fn is_held(&self, chunk: u32) -> bool {
        self.present
            .get(chunk as usize)
            .is_some_and(|p| p.load(Ordering::Acquire))
    }

    /// Records a chunk as held, unless it already is.
    pub(crate) fn hold(&self, chunk: u32, held: Held) {
        if let Some(mut slot) = self.slot(chunk)
            && slot.is_none()
        {
            *slot = Some(held);
            self.present[chunk as usize].store(true, Ordering::Release);
            self.held.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Forgets a held chunk (its bytes stay until they are written again); whether it was held.
    fn release(&self, chunk: u32) -> bool {
        let released = self.slot(chunk).and_then(|mut slot| slot.take()).is_some();
        if released {
            self.present[chunk as usize].store(false, Ordering::Release);
            self.held.fetch_sub(1, Ordering::Relaxed);
        }
        released
    }

    /// Takes note that `chunk`'s bytes on disk no longer match its hash.
    fn damaged(&self, chunk: u32) {
        if let Some(flag) = self.damaged.get(chunk as usize)
            && !flag.swap(true, Ordering::AcqRel)
        {
            tracing::warn!(
                artifact = %self.assembly.manifest().id,
                chunk,
                "a chunk on disk no longer matches the hash it was verified with; no longer serving it"
            );
        }
    }

    fn is_damaged(&self, chunk: u32) -> bool {
        self.damaged
            .get(chunk as usize)
            .is_some_and(|flag| flag.load(Ordering::Acquire))
    }

    pub(crate) fn held_count(&self) -> u32 {
        self.held.load(Ordering::Relaxed)
    }

    fn uploads_now(&self) -> u32 {
        (self.upload_slots - self.uploads.available_permits()) as u32
    }

    fn complete(&self) -> bool {
        self.held_count() as usize == self.chunks.len()
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
    /// It sent bytes that did not match their hash, vouched for a hash the origin
    /// contradicted, or failed to serve what it announced; it is not asked again.
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
    /// The origin's hash of a chunk this node holds, read to settle a dispute.
    Sampled {
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
    /// An answer an honest holder gives too, for a moment: it dropped the chunk, or has not
    /// registered this node's admission yet. Not counted towards [`FAILURES_BEFORE_BAN`].
    Refused(String),
    Corrupt(String),
    Failed(String),
}

/// What a member announced it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Claim {
    hash: [u8; 32],
    from_origin: bool,
    /// It was the sender's turn to read the chunk from the origin when it said it did, or
    /// when it said it was reading it (as this node saw the ring then, or when reading
    /// started, for claims that came before): its word alone is taken.
    in_turn: bool,
}

/// A member said it reads a chunk from the origin.
#[derive(Debug, Clone, Copy)]
struct Pull {
    since: Instant,
    /// The chunk was that member's to read when it said so: its hash, when it comes, is taken
    /// even if the chunk has become this node's since (a member left meanwhile).
    in_turn: bool,
}

/// Whom a chunk's hash is known from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Vouched {
    /// Nobody read it from the origin, as far as this node knows.
    Nobody,
    /// This hash: this node read it from the origin, or the members that did agree.
    For([u8; 32]),
    /// Members that read it from the origin announced different hashes.
    Disputed,
    /// No member's word on it counts, but two live members hold it with this hash (see
    /// [`Actor::endorsed`]): taken from them, except where it is this node's turn to read it,
    /// so that each chunk's owner still checks it against the origin.
    Endorsed([u8; 32]),
}

#[derive(Debug, Default)]
struct Peer {
    /// Generation of the live inbound stream; `None` while the peer has not joined us.
    reader: Option<u64>,
    /// The task reading it: stopped when the peer opens another (a peer saying hello again
    /// and again must not leave a task per stream behind).
    reader_task: Option<tokio::task::AbortHandle>,
    writer: Option<(u64, mpsc::Sender<SwarmMessage>)>,
    /// What it holds, while it is live.
    have: HashMap<u32, Claim>,
    /// The chunks it said it read from the origin, kept after it leaves: its word on them
    /// stands (chunks others got from it are still good) unless the origin contradicts it.
    vouched: HashMap<u32, Claim>,
    /// Chunks it said it reads from the origin.
    pulling: HashMap<u32, Pull>,
    /// When it first said it reads each chunk (kept when it stops or reconnects).
    first_pulled: HashMap<u32, Instant>,
    uploads: u32,
    done: bool,
    /// Not asked again for this artifact.
    banned: bool,
    /// The origin contradicted its word: nothing it vouched for counts (it is banned too).
    liar: bool,
    /// Our chunk requests to it under way.
    requests: u32,
    /// Our chunk requests it failed in a row.
    failures: u32,
    left_alone_until: Option<Instant>,
    /// When it last announced a chunk it read from the origin.
    last_read: Option<Instant>,
    /// When it first said it reads a chunk from the origin after that (kept when it
    /// reconnects): a read may take up to [`PULLING_PATIENCE`], but saying it reads one chunk
    /// after another never finishing any does not keep a member from being passed over.
    reading_since: Option<Instant>,
    /// It told us what it holds and reads: its first `load` ends what it sends on joining.
    synced: bool,
    /// Chunks it holds and could not send this node (it refused, or had no free upload
    /// slot), since the first time; kept when it drops them or leaves, so that announcing
    /// them again does not wind the clock back.
    held_back: HashMap<u32, Instant>,
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
    /// The peers the fetches in this swarm name as fetching it too
    /// ([`Admission::naming`](crate::Admission::naming)).
    pub named: Named,
}

/// The peers a swarm's fetches name, asked for each time (the list changes as jobs come and
/// go).
#[derive(Clone)]
pub(crate) struct Named(Arc<dyn Fn() -> Vec<PeerId> + Send + Sync>);

impl Named {
    pub fn new(named: impl Fn() -> Vec<PeerId> + Send + Sync + 'static) -> Named {
        Named(Arc::new(named))
    }

    fn get(&self) -> Vec<PeerId> {
        (self.0)()
    }
}

impl std::fmt::Debug for Named {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Named(..)")
    }
}

/// Starts the actor of one artifact. `expect` members (this node included) are waited for,
/// at most `settings.join_timeout`, before anything is pulled from the origin or from peers.
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
    // Chosen here and never told: a member that knew which chunks are checked would lie
    // about the others.
    let audit = (0..count)
        .map(|_| rand::random::<f64>() < context.settings.origin_audit)
        .collect();
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
        verified: vec![None; count as usize],
        vouches: vec![Vouched::Nobody; count as usize],
        audit,
        vouchers: HashMap::new(),
        to_sample: std::collections::BTreeSet::new(),
        pending_vouchers: HashMap::new(),
        in_flight: HashMap::new(),
        origin_attempts: HashMap::new(),
        origin_in_flight: 0,
        samples_in_flight: 0,
        generation: 0,
        events_tx: events_tx.clone(),
        progress: progress_tx,
        finishing: false,
        reported_uploads: 0,
        ring_changed: Instant::now(),
        last_arrival: Instant::now(),
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
    /// The origin's hash of each chunk, where this node read it (or its hash) itself.
    verified: Vec<Option<[u8; 32]>>,
    /// Whose word each chunk's hash rests on: kept as claims change, since every event looks
    /// at every chunk.
    vouches: Vec<Vouched>,
    /// Chunks this node reads from the origin even when peers hold them, to check them.
    audit: Vec<bool>,
    /// The members whose word a chunk held from a peer was taken on (those that announced its
    /// hash `from_origin`); when the origin contradicted every one of them, it is dropped.
    vouchers: HashMap<u32, Vec<PeerId>>,
    /// Held chunks a member contradicted: their hash is to be read from the origin.
    to_sample: std::collections::BTreeSet<u32>,
    /// The vouchers of chunks being pulled from peers.
    pending_vouchers: HashMap<u32, Vec<PeerId>>,
    in_flight: HashMap<u32, Source>,
    origin_attempts: HashMap<u32, u32>,
    origin_in_flight: usize,
    /// Hash-only origin reads under way (counted in `origin_in_flight` too).
    samples_in_flight: usize,
    generation: u64,
    events_tx: mpsc::Sender<Event>,
    progress: watch::Sender<Progress>,
    finishing: bool,
    reported_uploads: u32,
    /// When a member last joined, left or was banned (or the join gate opened): turns to
    /// read from the origin changed hands, and members are given time to take them up.
    ring_changed: Instant,
    /// When a chunk last arrived (or the join gate opened).
    last_arrival: Instant,
}

impl Actor {
    async fn run(mut self, mut events: mpsc::Receiver<Event>) {
        for chunk in 0..self.manifest.chunk_count() {
            if let Some(held) = self.holding.held_as(chunk)
                && held.from_origin
            {
                self.verified[chunk as usize] = Some(held.hash);
                self.revouch(chunk);
            }
        }
        let key = provider_key(self.manifest.id);
        // Announced beside the actor, never before it: a DHT put waits on the slowest of the
        // closest peers (up to the query timeout), and a swarm that waited for it would let
        // its join timeout pass without hearing the members that came meanwhile.
        let announcement = tokio::spawn({
            let (network, key, artifact) =
                (self.context.network.clone(), key.clone(), self.manifest.id);
            async move {
                if let Err(e) = network.start_providing(&key).await {
                    tracing::warn!(%artifact, "cannot announce in the DHT: {e}");
                }
            }
        });
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
        announcement.abort();
        discovery.abort();
        ticker.abort();
        let _ = self.context.network.stop_providing(&key).await;
    }

    fn handle(&mut self, event: Event) {
        match event {
            Event::Joined { peer, stream } => self.joined(peer, stream),
            Event::Discovered(found) => self.reach(found),
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
                    Ok(hash) => {
                        self.verified[chunk as usize] = Some(hash);
                        self.revouch(chunk);
                        self.held(
                            chunk,
                            Held {
                                hash,
                                from_origin: true,
                            },
                            Source::Origin,
                        );
                        self.arbitrate(chunk, hash);
                    }
                    Err(failure) => {
                        self.broadcast(SwarmMessage::Released { chunk });
                        self.origin_failed(chunk, failure);
                    }
                }
            }
            Event::Sampled { chunk, result } => {
                self.origin_in_flight -= 1;
                self.samples_in_flight -= 1;
                match result {
                    Ok(truth) => self.settle(chunk, truth),
                    Err(failure) => {
                        self.to_sample.insert(chunk);
                        self.origin_failed(chunk, failure);
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
                let vouchers = self.pending_vouchers.remove(&chunk).unwrap_or_default();
                match result {
                    Ok(hash) => {
                        if let Some(p) = self.peers.get_mut(&peer) {
                            p.failures = 0;
                        }
                        let verified = self.verified[chunk as usize] == Some(hash);
                        let discredited = !vouchers.is_empty()
                            && vouchers
                                .iter()
                                .all(|v| self.peers.get(v).is_some_and(|p| p.liar));
                        // Taken on the word of members the origin contradicted meanwhile: not
                        // kept (its bytes are written over when it is fetched again).
                        if verified || !discredited {
                            if !verified {
                                if !vouchers.is_empty() {
                                    self.vouchers.insert(chunk, vouchers);
                                }
                                // Someone vouched for another hash while it came: ask the
                                // origin. (Members that endorsed it leaving meanwhile take
                                // nothing back.)
                                if matches!(
                                    self.vouches[chunk as usize],
                                    Vouched::For(other) | Vouched::Endorsed(other) if other != hash
                                ) || self.vouches[chunk as usize] == Vouched::Disputed
                                {
                                    self.to_sample.insert(chunk);
                                }
                            }
                            let held = Held {
                                hash,
                                from_origin: false,
                            };
                            self.held(chunk, held, Source::Peer(peer));
                        }
                    }
                    Err(PeerFailure::Busy) => {
                        if let Some(p) = self.peers.get_mut(&peer) {
                            let now = Instant::now();
                            p.held_back.entry(chunk).or_insert(now);
                            p.left_alone_until = Some(now + TICK);
                        }
                    }
                    Err(PeerFailure::Refused(reason)) => {
                        tracing::debug!(artifact = %self.manifest.id, %peer, chunk, "chunk request refused: {reason}");
                        if let Some(p) = self.peers.get_mut(&peer) {
                            let now = Instant::now();
                            p.held_back.entry(chunk).or_insert(now);
                            p.left_alone_until = Some(now + BACKOFF);
                        }
                    }
                    Err(PeerFailure::Corrupt(reason)) => {
                        tracing::warn!(artifact = %self.manifest.id, %peer, chunk, "peer sent a bad chunk ({reason}); not asking it again for this artifact");
                        self.ban(peer);
                    }
                    Err(PeerFailure::Failed(reason)) => {
                        tracing::debug!(artifact = %self.manifest.id, %peer, chunk, "chunk transfer failed: {reason}");
                        // A member that left fails what was under way; that says nothing of it.
                        if let Some(p) = self.peers.get_mut(&peer).filter(|p| p.live()) {
                            p.left_alone_until = Some(Instant::now() + BACKOFF);
                            p.failures += 1;
                            if p.failures >= FAILURES_BEFORE_BAN {
                                tracing::warn!(artifact = %self.manifest.id, %peer, "failed {FAILURES_BEFORE_BAN} chunk requests in a row ({reason}); not asking it again for this artifact");
                                self.ban(peer);
                            }
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
                // A member whose stream to this node is open hears nothing from it while ours
                // to it is closed (refused, or it broke), and may be waiting for it to join:
                // ours is opened again, whether or not the DHT shows the member.
                let unanswered: Vec<PeerId> = self
                    .peers
                    .iter()
                    .filter(|(_, p)| p.live() && p.writer.is_none())
                    .map(|(peer, _)| *peer)
                    .collect();
                self.reach(unanswered);
                if self.join_deadline.is_some() {
                    let named = self.context.named.get();
                    self.reach(named);
                }
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

    /// An origin read (of a chunk or of its hash) failed: tried again, then the fetch fails.
    fn origin_failed(&mut self, chunk: u32, failure: Failure) {
        match failure {
            Failure::Changed(reason) => self.fail(Failure::Changed(reason)),
            Failure::Failed(reason) => {
                let attempts = self.origin_attempts.entry(chunk).or_default();
                *attempts += 1;
                tracing::warn!(artifact = %self.manifest.id, chunk, attempt = *attempts, "origin read failed: {reason}");
                if *attempts >= ORIGIN_ATTEMPTS {
                    self.fail(Failure::Failed(reason));
                }
            }
        }
    }

    /// The origin says `truth` is chunk `chunk`'s hash, where this node holds the chunk and a
    /// member said otherwise: whoever vouched for the wrong hash is banned.
    fn settle(&mut self, chunk: u32, truth: [u8; 32]) {
        self.verified[chunk as usize] = Some(truth);
        self.revouch(chunk);
        let vouchers = self.vouchers.remove(&chunk).unwrap_or_default();
        if self.holding.held(chunk).is_some_and(|held| held != truth) {
            self.release(chunk);
            for voucher in vouchers {
                self.convict(voucher, chunk);
            }
        }
        self.arbitrate(chunk, truth);
    }

    /// Bans every member that announced it read `chunk` from the origin with a hash other
    /// than `truth`, which this node read from the origin itself.
    fn arbitrate(&mut self, chunk: u32, truth: [u8; 32]) {
        let contradicted: Vec<PeerId> = self
            .peers
            .iter()
            .filter(|(_, p)| !p.liar && p.vouched.get(&chunk).is_some_and(|c| c.hash != truth))
            .map(|(id, _)| *id)
            .collect();
        for peer in contradicted {
            self.convict(peer, chunk);
        }
    }

    /// `peer` vouched for a hash of `chunk` that the origin contradicts: it is banned, and
    /// what this node took on its word alone is dropped and fetched again.
    fn convict(&mut self, peer: PeerId, chunk: u32) {
        let Some(p) = self.peers.get_mut(&peer).filter(|p| !p.liar) else {
            return;
        };
        p.liar = true;
        tracing::warn!(artifact = %self.manifest.id, %peer, chunk, "announced it read this chunk from the origin, but the origin's bytes have another hash; not trusting it again for this artifact");
        self.ban(peer);
        for chunk in 0..self.manifest.chunk_count() {
            self.revouch(chunk);
        }
        let peers = &self.peers;
        let orphaned: Vec<u32> = self
            .vouchers
            .iter()
            .filter(|(_, vouchers)| {
                vouchers
                    .iter()
                    .all(|v| peers.get(v).is_some_and(|p| p.liar))
            })
            .map(|(chunk, _)| *chunk)
            .collect();
        for chunk in orphaned {
            self.vouchers.remove(&chunk);
            self.release(chunk);
        }
    }

    /// Forgets a chunk held on a word the origin contradicted, so that it is fetched again.
    fn release(&mut self, chunk: u32) {
        if self.finishing {
            tracing::warn!(artifact = %self.manifest.id, chunk, "a chunk of the completed files was vouched for by a member the origin contradicted; fetch the artifact again to be sure of it");
            return;
        }
        if !self.holding.release(chunk) {
            return;
        }
        let len = self.manifest.chunks()[chunk as usize].len;
        self.progress.send_modify(|p| {
            p.held -= 1;
            p.peer_chunks = p.peer_chunks.saturating_sub(1);
            p.peer_bytes = p.peer_bytes.saturating_sub(len);
        });
        self.broadcast(SwarmMessage::Dropped { chunk });
        let cache = self.context.cache.clone();
        let id = self.manifest.id;
        tokio::task::spawn_blocking(move || {
            if let Err(e) = cache.forget_chunk(id, chunk) {
                tracing::warn!("cannot forget chunk {chunk} of {id}: {e}");
            }
        });
    }

    /// Takes note of whose word chunk `chunk`'s hash rests on now.
    fn revouch(&mut self, chunk: u32) {
        self.vouches[chunk as usize] = self.vouched(chunk);
    }

    /// Whose word chunk `chunk`'s hash rests on, as far as this node knows: this node's own
    /// read, a claim made in turn, or two that agree.
    fn vouched(&self, chunk: u32) -> Vouched {
        if let Some(truth) = self.verified[chunk as usize] {
            return Vouched::For(truth);
        }
        let mut found = None;
        let mut claimants = 0;
        let mut in_turn = false;
        for claim in self.origin_claims(chunk) {
            match found {
                Some(hash) if hash != claim.hash => return Vouched::Disputed,
                _ => found = Some(claim.hash),
            }
            claimants += 1;
            in_turn |= claim.in_turn;
        }
        // One member's word is taken where it was its turn; anyone else's alone could be a
        // liar's that got in first, and the chunk is read from the origin in turn.
        match found {
            Some(hash) if in_turn || claimants >= 2 => Vouched::For(hash),
            _ => self.endorsed(chunk),
        }
    }

    /// The hash that two live members hold a chunk with, where no two hold it with another:
    /// each took it only on a word it could check, so one of them is honest and right (a
    /// newcomer to members that hold everything takes their chunks this way, not knowing
    /// whose turn each was when it was read).
    fn endorsed(&self, chunk: u32) -> Vouched {
        let mut endorsed = None;
        let mut counts: Vec<([u8; 32], u32)> = Vec::new();
        for p in self.peers.values().filter(|p| p.live() && !p.banned) {
            let Some(claim) = p.have.get(&chunk) else {
                continue;
            };
            match counts.iter_mut().find(|(hash, _)| *hash == claim.hash) {
                Some((_, count)) => {
                    *count += 1;
                    if *count == 2 {
                        if endorsed.is_some() {
                            // Two hashes with two members each: not one liar's doing.
                            return Vouched::Disputed;
                        }
                        endorsed = Some(claim.hash);
                    }
                }
                None => counts.push((claim.hash, 1)),
            }
        }
        // Members that took a hash on the word of a member this node found out hold it in
        // good faith: it is still a lie.
        let a_liars_word = |hash: &[u8; 32]| {
            self.peers
                .values()
                .any(|p| p.liar && p.vouched.get(&chunk).is_some_and(|c| c.hash == *hash))
        };
        endorsed
            .filter(|hash| !a_liars_word(hash))
            .map_or(Vouched::Nobody, Vouched::Endorsed)
    }

    /// What members (live or gone) that said they read `chunk` from the origin announced,
    /// but for those the origin contradicted.
    fn origin_claims(&self, chunk: u32) -> impl Iterator<Item = &Claim> {
        self.peers
            .values()
            .filter(|p| !p.liar)
            .filter_map(move |p| p.vouched.get(&chunk))
    }

    /// The members that vouch for `hash` as chunk `chunk`'s.
    fn vouchers_of(&self, chunk: u32, hash: [u8; 32]) -> Vec<PeerId> {
        self.peers
            .iter()
            .filter(|(_, p)| !p.liar && p.vouched.get(&chunk).is_some_and(|c| c.hash == hash))
            .map(|(id, _)| *id)
            .collect()
    }

    /// A member opened its stream to us: read it, and make sure ours to it is open.
    fn joined(&mut self, peer: PeerId, stream: Stream) {
        if self.failed() {
            return;
        }
        let now = Instant::now();
        if self.peers.get(&peer).is_some_and(Peer::live) {
            // It reconnected: what it told us before no longer counts, but the ring did not
            // change (reconnecting again and again must not hold its turns up).
            let ring_changed = self.ring_changed;
            self.forget(peer);
            self.ring_changed = ring_changed;
        } else {
            self.ring_changed = now;
        }
        self.generation += 1;
        let generation = self.generation;
        let entry = self.peers.entry(peer).or_default();
        entry.reader = Some(generation);
        entry.left_alone_until = None;
        tracing::debug!(artifact = %self.manifest.id, %peer, "member joined");
        let task = tokio::spawn(read_from(peer, generation, stream, self.events_tx.clone()));
        if let Some(p) = self.peers.get_mut(&peer) {
            p.reader_task = Some(task.abort_handle());
        }
        self.connect(peer);
    }

    /// Opens our streams to `peers` (found in the DHT, or named by the fetches).
    fn reach(&mut self, peers: impl IntoIterator<Item = PeerId>) {
        for peer in peers {
            if peer != self.me {
                self.connect(peer);
            }
        }
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
                self.holding.held_as(chunk).map(|held| SwarmMessage::Have {
                    chunk,
                    blake3: held.hash,
                    from_origin: held.from_origin,
                })
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
        let Some(p) = self.peers.get_mut(&peer) else {
            return;
        };
        let had: Vec<u32> = p.have.drain().map(|(chunk, _)| chunk).collect();
        if !p.banned {
            for &chunk in &had {
                self.availability[chunk as usize] -= 1;
            }
        }
        p.pulling.clear();
        p.done = false;
        p.synced = false;
        p.uploads = 0;
        p.reader = None;
        if let Some(task) = p.reader_task.take() {
            task.abort();
        }
        p.writer = None;
        self.ring_changed = Instant::now();
        // What it held counted towards endorsements.
        for chunk in had {
            self.revouch(chunk);
        }
    }

    fn ban(&mut self, peer: PeerId) {
        if let Some(p) = self.peers.get_mut(&peer)
            && !p.banned
        {
            p.banned = true;
            p.pulling.clear();
            let had: Vec<u32> = p.have.keys().copied().collect();
            for &chunk in &had {
                self.availability[chunk as usize] -= 1;
            }
            self.ring_changed = Instant::now();
            for chunk in had {
                self.revouch(chunk);
            }
        }
    }

    fn message(&mut self, peer: PeerId, message: SwarmMessage) {
        let count = self.manifest.chunk_count();
        let chunk_of = |m: &SwarmMessage| match m {
            SwarmMessage::Have { chunk, .. }
            | SwarmMessage::Pulling { chunk }
            | SwarmMessage::Released { chunk }
            | SwarmMessage::Dropped { chunk } => Some(*chunk),
            _ => None,
        };
        if chunk_of(&message).is_some_and(|c| c >= count) {
            tracing::warn!(artifact = %self.manifest.id, %peer, "ignoring a message about a chunk the artifact does not have: {message:?}");
            return;
        }
        // Whose turn the chunk is, for an origin claim (is it this node's?) or a pull (is it
        // the puller's?).
        let turn = match &message {
            SwarmMessage::Have {
                chunk,
                from_origin: true,
                ..
            }
            | SwarmMessage::Pulling { chunk } => self.owner(*chunk, &self.members()),
            _ => None,
        };
        let Some(p) = self.peers.get_mut(&peer) else {
            return;
        };
        match message {
            SwarmMessage::Have {
                chunk,
                blake3,
                from_origin,
            } => {
                let pulled_in_turn = p.pulling.remove(&chunk).is_some_and(|pull| pull.in_turn);
                if from_origin {
                    p.last_read = Some(Instant::now());
                    p.reading_since = p.pulling.values().map(|pull| pull.since).min();
                }
                let claim = Claim {
                    hash: blake3,
                    from_origin,
                    in_turn: turn == Some(peer) || pulled_in_turn,
                };
                // An honest member reads a chunk of one version of an artifact with one hash.
                let contradicts_itself = from_origin
                    && p.vouched
                        .get(&chunk)
                        .is_some_and(|earlier| earlier.hash != blake3);
                if from_origin && !contradicts_itself {
                    p.vouched.insert(chunk, claim);
                }
                if p.have.insert(chunk, claim).is_none() && !p.banned {
                    self.availability[chunk as usize] += 1;
                }
                if contradicts_itself {
                    self.convict(peer, chunk);
                } else if from_origin && !p.liar {
                    self.check_claim(peer, chunk, blake3);
                }
                self.revouch(chunk);
            }
            SwarmMessage::Dropped { chunk } => {
                // What it said it read from the origin stands: an honest member never drops
                // such a chunk, and a liar must not take its word back before it is checked.
                if p.have.remove(&chunk).is_some() && !p.banned {
                    self.availability[chunk as usize] -= 1;
                }
                if p.vouched.contains_key(&chunk) {
                    // Nobody else would read it again while it stayed the one to.
                    tracing::warn!(artifact = %self.manifest.id, %peer, chunk, "dropped a chunk it read from the origin; not asking it again for this artifact");
                    self.ban(peer);
                }
                self.revouch(chunk);
            }
            SwarmMessage::Pulling { chunk } => {
                if !p.banned {
                    // Its patience runs from the first time it said so: saying it again does
                    // not wind the clock back.
                    let since = *p.first_pulled.entry(chunk).or_insert_with(Instant::now);
                    p.reading_since.get_or_insert_with(Instant::now);
                    p.pulling.entry(chunk).or_insert(Pull {
                        since,
                        in_turn: turn == Some(peer),
                    });
                }
            }
            SwarmMessage::Released { chunk } => {
                p.pulling.remove(&chunk);
            }
            SwarmMessage::Load { uploads } => {
                p.uploads = uploads;
                p.synced = true;
            }
            SwarmMessage::Done => p.done = true,
            SwarmMessage::Hello { .. } => {}
        }
    }

    /// `peer` says it read `chunk` from the origin and it hashes to `hash`: checked against
    /// what this node knows of the origin, or, where it holds the chunk on other members'
    /// word, against the origin itself.
    fn check_claim(&mut self, peer: PeerId, chunk: u32, hash: [u8; 32]) {
        match self.verified[chunk as usize] {
            Some(truth) if truth != hash => self.convict(peer, chunk),
            Some(_) => {}
            None => {
                if self.holding.held(chunk).is_some_and(|held| held != hash) {
                    self.to_sample.insert(chunk);
                }
            }
        }
    }

    /// A chunk arrived and was verified.
    fn held(&mut self, chunk: u32, held: Held, source: Source) {
        if self.holding.is_held(chunk) {
            return;
        }
        let hash = held.hash;
        let len = self.manifest.chunks()[chunk as usize].len;
        self.holding.hold(chunk, held);
        self.last_arrival = Instant::now();
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
            from_origin: held.from_origin,
        });
        let cache = self.context.cache.clone();
        let id = self.manifest.id;
        tokio::task::spawn_blocking(move || {
            if let Err(e) = cache.record_chunk(id, chunk, &hash, held.from_origin) {
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
        // Complete, and no chunk held is in doubt: the files are final.
        if self.holding.complete() && self.to_sample.is_empty() && self.samples_in_flight == 0 {
            if !self.progress.borrow().complete {
                self.finish();
            }
            return;
        }
        let slots = self.context.settings.download_slots.max(1);
        let members = self.members();
        // The ring is whole when the members expected are there and each has said what it
        // holds (a newcomer must not read what they hold because their word is on its way).
        let whole = || {
            members.len() >= self.expect
                && self.peers.values().filter(|p| p.live()).all(|p| p.synced)
        };
        if let Some(deadline) = self.join_deadline
            && (whole() || Instant::now() >= deadline)
        {
            if !whole() {
                tracing::warn!(
                    artifact = %self.manifest.id,
                    expected = self.expect,
                    here = members.len(),
                    "the members expected did not all join within the join timeout; reading from the origin without them (chunks a late member reads in its own turn leave the origin twice)"
                );
            }
            self.join_deadline = None;
            let now = Instant::now();
            self.ring_changed = now;
            self.last_arrival = now;
            self.reassess_claims(&members);
        }
        // Nothing is read, from the origin or from peers, until the ring is whole: who owns
        // which chunk decides whose word on it is taken.
        if self.join_deadline.is_some() {
            return;
        }
        self.take_claims_now_in_turn(&members);
        let origin_slots =
            slots.min((self.context.settings.origin_connections / members.len()).max(1));
        while self.origin_in_flight < origin_slots
            && let Some(chunk) = self.to_sample.pop_first()
        {
            if self.verified[chunk as usize].is_none() && self.holding.is_held(chunk) {
                self.sample_origin(chunk);
            }
        }
        if self.holding.complete() {
            return;
        }
        while self.origin_in_flight < origin_slots && self.in_flight.len() < slots {
            let Some(chunk) = self.next_origin_chunk(&members) else {
                break;
            };
            self.pull_from_origin(chunk);
        }
        if self.in_flight.len() < slots {
            let (picked, blocked) = self.next_peer_chunks(slots - self.in_flight.len());
            let now = Instant::now();
            for chunk in blocked {
                for p in self.peers.values_mut() {
                    if p.have.contains_key(&chunk) {
                        p.held_back.entry(chunk).or_insert(now);
                    }
                }
            }
            for (chunk, peer, hash) in picked {
                self.pull_from_peer(chunk, peer, hash);
            }
        }
    }

    /// The next chunk this node reads from the origin: one whose hash members dispute, one
    /// it audits, one it owns that others claimed before it could read it, one its holders
    /// hold back that falls to it, or one nobody read from the origin that falls to it.
    fn next_origin_chunk(&self, members: &[PeerId]) -> Option<u32> {
        let now = Instant::now();
        let patience = self.context.settings.stall_patience;
        // Nothing arrived for that long, so holders that do not send a chunk are not busy
        // with this node's other requests.
        let stalled = now.duration_since(self.last_arrival) >= patience;
        (0..self.manifest.chunk_count()).find(|&chunk| {
            if self.holding.is_held(chunk) || self.in_flight.contains_key(&chunk) {
                return false;
            }
            match self.vouches[chunk as usize] {
                Vouched::Disputed => true,
                Vouched::Endorsed(_) if self.owner(chunk, members) == Some(self.me) => true,
                Vouched::For(hash) | Vouched::Endorsed(hash) => {
                    self.audit[chunk as usize]
                        // Its voucher left (or this node read it, then dropped it), and no
                        // live member that holds it so sends it.
                        || (!self.peers.values().any(|p| {
                            p.live()
                                && !p.banned
                                && p.have.get(&chunk).is_some_and(|c| c.hash == hash)
                                && !(stalled
                                    && p.held_back.get(&chunk).is_some_and(|since| {
                                        now.duration_since(*since) >= patience
                                    }))
                        }) && self.rescuer(chunk, members) == Some(self.me))
                }
                Vouched::Nobody => {
                    let someone_reads = self.peers.values().any(|p| {
                        p.live()
                            && !p.banned
                            && p.pulling.get(&chunk).is_some_and(|pull| {
                                pull.in_turn && now.duration_since(pull.since) < PULLING_PATIENCE
                            })
                    });
                    !someone_reads && self.reader(chunk, members) == Some(self.me)
                }
            }
        })
    }

    /// Claims and pulls that came while members were still joining were judged against a
    /// ring that was not yet whole: judged again against the one reading starts with.
    fn reassess_claims(&mut self, members: &[PeerId]) {
        let said: Vec<(PeerId, u32, Option<PeerId>)> = self
            .peers
            .iter()
            .flat_map(|(id, p)| {
                p.vouched
                    .keys()
                    .chain(p.pulling.keys())
                    .map(move |chunk| (*id, *chunk))
            })
            .map(|(id, chunk)| (id, chunk, self.owner(chunk, members)))
            .collect();
        for (id, chunk, turn) in said {
            if let Some(p) = self.peers.get_mut(&id) {
                if let Some(claim) = p.vouched.get_mut(&chunk) {
                    claim.in_turn = turn == Some(id);
                }
                if let Some(pull) = p.pulling.get_mut(&chunk) {
                    pull.in_turn = turn == Some(id);
                }
            }
        }
        for chunk in 0..self.manifest.chunk_count() {
            self.revouch(chunk);
        }
    }

    /// A member that read a chunk out of its turn as this node saw the ring then, and whose
    /// turn the chunk is now (the members before it held their turns back, and this node's
    /// clock passed them over a moment after the reader's): its word is taken now, so that
    /// the chunk is not read again.
    fn take_claims_now_in_turn(&mut self, members: &[PeerId]) {
        let promoted: Vec<(PeerId, u32)> = (0..self.manifest.chunk_count())
            .filter(|&chunk| {
                matches!(
                    self.vouches[chunk as usize],
                    Vouched::Nobody | Vouched::Endorsed(_)
                ) && self.origin_claims(chunk).next().is_some()
            })
            .filter_map(|chunk| {
                let owner = self.owner(chunk, members)?;
                let claim = self.peers.get(&owner)?.vouched.get(&chunk)?;
                (!claim.in_turn).then_some((owner, chunk))
            })
            .collect();
        for (owner, chunk) in promoted {
            if let Some(claim) = self
                .peers
                .get_mut(&owner)
                .and_then(|p| p.vouched.get_mut(&chunk))
            {
                claim.in_turn = true;
            }
            self.revouch(chunk);
        }
    }

    /// The member to read `chunk` from the origin: its owner (`members[(chunk + k) % n]`),
    /// or, where this node banned the owner or the owner has been reading it for longer than
    /// [`PULLING_PATIENCE`], the next member in that order. Each member in that order has
    /// `stall_patience` of its own, counted from the last change of the ring: one that
    /// reads nothing at all by the end of it is passed over (an honest member reads its turns
    /// one after another from the moment they fall to it).
    fn owner(&self, chunk: u32, members: &[PeerId]) -> Option<PeerId> {
        self.in_turn(chunk, members, |_| true, true)
    }

    /// Like [`owner`](Self::owner), passing over members that hold the chunk (on a relayed
    /// word only, where this is asked): they will not read it again.
    fn reader(&self, chunk: u32, members: &[PeerId]) -> Option<PeerId> {
        self.in_turn(chunk, members, |p| !p.have.contains_key(&chunk), true)
    }

    /// The member to read again a chunk that was read, when no live member sends it: the
    /// first after its owner that does not hold it. Idle members are not passed over: having
    /// read all their turns long ago, they are the ones free to.
    fn rescuer(&self, chunk: u32, members: &[PeerId]) -> Option<PeerId> {
        self.in_turn(chunk, members, |p| !p.have.contains_key(&chunk), false)
    }

    fn in_turn(
        &self,
        chunk: u32,
        members: &[PeerId],
        eligible: impl Fn(&Peer) -> bool,
        pass_idle: bool,
    ) -> Option<PeerId> {
        let n = members.len();
        let first = (chunk as usize + self.offset) % n;
        let now = Instant::now();
        let patience = self.context.settings.stall_patience;
        // `None` once past what an `Instant` can hold: nobody is passed over.
        let mut turn_ends = Some(self.ring_changed);
        (0..n).map(|i| members[(first + i) % n]).find(|m| {
            if *m == self.me {
                return true;
            }
            let Some(p) = self.peers.get(m) else {
                return true;
            };
            if p.banned
                || !eligible(p)
                || p.pulling
                    .get(&chunk)
                    .is_some_and(|pull| now.duration_since(pull.since) >= PULLING_PATIENCE)
            {
                return false;
            }
            turn_ends = turn_ends.and_then(|t| t.checked_add(patience));
            !(pass_idle && turn_ends.is_some_and(|t| now >= t) && self.idle(p, now))
        })
    }

    /// A live member that has announced no chunk read from the origin for `stall_patience`,
    /// and has not said it reads one since, or said so more than [`PULLING_PATIENCE`] ago.
    fn idle(&self, p: &Peer, now: Instant) -> bool {
        p.live()
            && p.last_read
                .is_none_or(|t| now.duration_since(t) >= self.context.settings.stall_patience)
            && p.reading_since
                .is_none_or(|t| now.duration_since(t) >= PULLING_PATIENCE)
    }

    /// Up to `want` (chunk, holder, hash) triples: rarest chunks first, least loaded holders,
    /// only chunks whose hash the origin vouches for, only from holders that announced it;
    /// and the chunks looked at that no holder could send now.
    #[allow(clippy::type_complexity)]
    fn next_peer_chunks(&self, want: usize) -> (Vec<(u32, PeerId, [u8; 32])>, Vec<u32>) {
        let now = Instant::now();
        let upload_slots = self.context.settings.upload_slots.max(1) as u32;
        let mut load: HashMap<PeerId, u32> = self
            .peers
            .iter()
            .filter(|(_, p)| p.live() && !p.banned && p.left_alone_until.is_none_or(|t| now >= t))
            .map(|(id, p)| (*id, p.uploads.max(p.requests)))
            .collect();
        if load.is_empty() {
            return (Vec::new(), Vec::new());
        }
        // Our requests under way to each holder: at most half the download slots go to one
        // while there are others, so that one sending slowly cannot take them all.
        let mut ours: HashMap<PeerId, u32> = load
            .keys()
            .map(|id| (*id, self.peers[id].requests))
            .collect();
        let slots = self.context.settings.download_slots.max(1) as u32;
        let per_holder = if load.len() > 1 {
            slots.div_ceil(2)
        } else {
            slots
        };
        let mut candidates: Vec<(u16, u64, u32, [u8; 32])> = (0..self.manifest.chunk_count())
            .filter(|&c| {
                self.availability[c as usize] > 0
                    && !self.audit[c as usize]
                    && !self.holding.is_held(c)
                    && !self.in_flight.contains_key(&c)
            })
            .filter_map(|c| match self.vouches[c as usize] {
                Vouched::For(hash) | Vouched::Endorsed(hash) => {
                    let spread = (c as u64 ^ self.tie_break).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                    Some((self.availability[c as usize], spread, c, hash))
                }
                _ => None,
            })
            .collect();
        candidates.sort_unstable();
        let mut picked = Vec::new();
        let mut blocked = Vec::new();
        for (_, _, chunk, hash) in candidates {
            if picked.len() >= want {
                break;
            }
            let has_slot = |id: &PeerId, load: u32| {
                load < upload_slots
                    && self.peers[id]
                        .have
                        .get(&chunk)
                        .is_some_and(|c| c.hash == hash)
            };
            let holder = load
                .iter()
                .filter(|(id, l)| {
                    has_slot(id, **l) && ours.get(*id).is_some_and(|n| *n < per_holder)
                })
                .min_by_key(|(id, l)| {
                    (
                        **l,
                        (id.to_bytes().last().copied().unwrap_or(0) as u64) ^ self.tie_break,
                    )
                })
                .map(|(id, _)| *id);
            match holder {
                Some(holder) => {
                    *load.entry(holder).or_default() += 1;
                    *ours.entry(holder).or_default() += 1;
                    picked.push((chunk, holder, hash));
                }
                // Held back only if no holder has an upload slot for it: this node's own share
                // per holder is not the holders' doing.
                None if !load.iter().any(|(id, l)| has_slot(id, *l)) => blocked.push(chunk),
                None => {}
            }
        }
        (picked, blocked)
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

    /// Reads the origin's hash of a held chunk that a member contradicted.
    fn sample_origin(&mut self, chunk: u32) {
        self.origin_in_flight += 1;
        self.samples_in_flight += 1;
        let origin = self.context.origin.clone();
        let manifest = self.manifest.clone();
        let events = self.events_tx.clone();
        tokio::spawn(async move {
            let result = hash_origin(&origin, &manifest, chunk).await;
            let _ = events.send(Event::Sampled { chunk, result }).await;
        });
    }

    fn pull_from_peer(&mut self, chunk: u32, peer: PeerId, expected: [u8; 32]) {
        if self.verified[chunk as usize] != Some(expected) {
            let vouchers = self.vouchers_of(chunk, expected);
            self.pending_vouchers.insert(chunk, vouchers);
        }
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
                let held: Vec<Option<Held>> = (0..manifest.chunk_count())
                    .map(|c| holding.held_as(c))
                    .collect();
                let hashes = held
                    .iter()
                    .map(|h| h.map(|h| hex::encode(h.hash)).unwrap_or_default())
                    .collect();
                let from_origin = (0..manifest.chunk_count())
                    .filter(|&c| held[c as usize].is_some_and(|h| h.from_origin))
                    .collect();
                let stamps = holding
                    .assembly
                    .targets()
                    .iter()
                    .map(|target| Stamp::of(target))
                    .collect::<Result<_, _>>()
                    .map_err(|e| format!("cannot stamp the completed files: {e}"))?;
                cache
                    .record_completed(&Record {
                        request,
                        manifest,
                        hashes,
                        from_origin,
                        unpacked: false,
                        stamps,
                        unpacked_stamps: Default::default(),
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

fn origin_failure(e: OriginError) -> Failure {
    match e {
        OriginError::Changed { .. } => Failure::Changed(e.to_string()),
        e => Failure::Failed(e.to_string()),
    }
}

/// Chunk `chunk`'s bytes as the origin serves them.
async fn origin_bytes(
    origin: &Origin,
    manifest: &Manifest,
    chunk: u32,
) -> Result<impl futures::Stream<Item = Result<bytes::Bytes, Failure>>, Failure> {
    let span = manifest.chunks()[chunk as usize];
    let file = &manifest.files[span.file];
    let stream = origin
        .read(file, span.offset..span.offset + span.len)
        .await
        .map_err(origin_failure)?;
    Ok(stream.map(|bytes| bytes.map_err(origin_failure)))
}

async fn read_origin(origin: &Origin, holding: &Holding, chunk: u32) -> Result<[u8; 32], Failure> {
    let manifest = holding.assembly.manifest();
    let span = manifest.chunks()[chunk as usize];
    let mut stream = std::pin::pin!(origin_bytes(origin, manifest, chunk).await?);
    let mut sink = ChunkSink::new(holding.assembly.clone(), span);
    while let Some(bytes) = stream.next().await {
        sink.push(&bytes?)
            .await
            .map_err(|e| Failure::Failed(e.to_string()))?;
    }
    sink.finish()
        .await
        .map_err(|e| Failure::Failed(format!("origin: {e}")))
}

/// The BLAKE3 of chunk `chunk` as the origin serves it, without writing it anywhere.
async fn hash_origin(
    origin: &Origin,
    manifest: &Manifest,
    chunk: u32,
) -> Result<[u8; 32], Failure> {
    let span = manifest.chunks()[chunk as usize];
    let mut stream = std::pin::pin!(origin_bytes(origin, manifest, chunk).await?);
    let mut hasher = blake3::Hasher::new();
    let mut received = 0u64;
    while let Some(bytes) = stream.next().await {
        let bytes = bytes?;
        received += bytes.len() as u64;
        hasher.update(&bytes);
    }
    if received != span.len {
        return Err(Failure::Failed(format!(
            "origin: sent {received} bytes of a {}-byte chunk",
            span.len
        )));
    }
    Ok(*hasher.finalize().as_bytes())
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
    // A busy holder may drop the request's stream before it answers (`frame::ask` asks again
    // a moment later): far better than leaving it alone for `BACKOFF`, as at the end of a
    // distribution the last chunks have few holders. A holder that does not take our
    // streams now (it may be flooded by someone else's) says nothing of what it announced.
    let (mut stream, header) =
        match ask::<_, ChunkHeader>(network, peer, CHUNK_PROTOCOL, &request, PEER_TIMEOUT).await {
            Ok(answered) => answered,
            Err(AskError::Silent(_)) => return Err(failed(&"no answer")),
            Err(error) => return Err(PeerFailure::Refused(error.to_string())),
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
        ChunkHeader::Error {
            code:
                code @ (ChunkErrorCode::Missing
                | ChunkErrorCode::NotAdmitted
                | ChunkErrorCode::UnknownArtifact),
            message,
        } => return Err(PeerFailure::Refused(format!("{code:?}: {message}"))),
        ChunkHeader::Error { code, message } => {
            return Err(PeerFailure::Failed(format!("{code:?}: {message}")));
        }
    }
    let mut sink = ChunkSink::new(holding.assembly.clone(), span);
    let mut buf = vec![0u8; 256 * 1024];
    // A holder sending a byte now and then must not keep a download slot for ever.
    let deadline = Instant::now() + PEER_TIMEOUT + Duration::from_secs(span.len / MIN_PEER_RATE);
    while sink.received() < span.len {
        if Instant::now() >= deadline {
            return Err(failed(&format!(
                "sent slower than {} KiB/s",
                MIN_PEER_RATE / 1024
            )));
        }
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
        // A member that stops reading is left, not waited for.
        let mut send = async |message: &SwarmMessage| {
            tokio::time::timeout(PEER_TIMEOUT, write_frame(&mut stream, message))
                .await
                .map_err(|_| "the peer stopped reading".to_string())?
                .map_err(|e| e.to_string())
        };
        for message in &initial {
            send(message).await?;
        }
        while let Some(message) = queue.recv().await {
            send(&message).await?;
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
    lookup: impl FnOnce(ArtifactId) -> Result<Arc<Holding>, ChunkErrorCode>,
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
    let holding = match lookup(request.artifact) {
        Ok(holding) => holding,
        Err(code) => {
            let message = match code {
                ChunkErrorCode::NotAdmitted => format!(
                    "no job or request for {} here lets you in its swarm",
                    request.artifact
                ),
                _ => format!("not in the swarm of {}", request.artifact),
            };
            let _ = write_frame(&mut stream, &refuse(code, message)).await;
            return;
        }
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
    let Some(serving) = holding
        .held(request.chunk)
        .filter(|_| !holding.is_damaged(request.chunk))
    else {
        let _ = write_frame(
            &mut stream,
            &refuse(
                ChunkErrorCode::Missing,
                format!("chunk {} is not held here", request.chunk),
            ),
        )
        .await;
        return;
    };
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
        // The bytes are hashed as they are read, and the last block goes out only if they
        // match what this node holds: a chunk changed on disk since it was verified (by a
        // process of this node's user, by the disk) ends short, which costs the peer a retry
        // elsewhere, instead of reaching it whole, costing it a download and this node its
        // place in the swarm.
        let mut hasher = blake3::Hasher::new();
        while let Some(pending) = next.take() {
            let block = pending
                .await
                .map_err(|e| e.to_string())?
                .map_err(|e| e.to_string())?;
            hasher.update(&block);
            offset += block.len() as u64;
            if offset < span.len {
                next = Some(read(offset));
            } else if holding.held(request.chunk) != Some(serving) {
                // Dropped (and perhaps being written again) while it was being sent: end the
                // stream short rather than hand out bytes that match no hash.
                return Err("the chunk was dropped while being sent".to_string());
            } else if *hasher.finalize().as_bytes() != serving {
                holding.damaged(request.chunk);
                return Err("the chunk on disk no longer matches its hash".to_string());
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
