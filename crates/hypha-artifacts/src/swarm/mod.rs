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

mod actor;
mod holding;
mod serve;
mod state;
mod tasks;

use std::{sync::Arc, time::Duration};

use hypha_messages::artifact::Request;
use hypha_network::{Network, PeerId, Stream};
use serde::Serialize;
use tokio::sync::{mpsc, watch};

use crate::{Settings, cache::Cache, origin::Origin};

use self::{actor::Actor, state::Input};
pub(crate) use self::{
    holding::{Held, Holding},
    serve::serve_chunk,
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

/// Why a fetch failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Failure {
    /// The origin's object changed since the artifact was resolved.
    Changed(String),
    Failed(String),
}

/// A node's view of one artifact's distribution, for progress displays and results.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
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
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
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
    Joined { peer: PeerId, stream: Stream },
    /// [`TICK`] passed.
    Tick,
    /// What the rules take as it came.
    Learned(Input),
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
        // Complete once the files are final, even where every chunk is held already (an
        // empty artifact; a fetch resumed after its last chunk, before the rename): the
        // state finishes them first.
        complete: false,
        ..Progress::default()
    };
    let (progress_tx, progress_rx) = watch::channel(progress);
    let actor = Actor::new(
        context,
        request,
        holding,
        expect,
        events_tx.clone(),
        progress_tx,
    );
    // Owned through its progress: the actor leaves the swarm and ends (its own tasks with it)
    // at the first event after every receiver of `progress_rx` was dropped, and its tick
    // brings one every [`TICK`].
    tokio::spawn(actor.run(events));
    (events_tx, progress_rx)
}
