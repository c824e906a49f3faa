//! The swarm's rules: claims, vouches, the turn ring, chunk picks, bans and membership, as a
//! state machine. [`State::apply`] takes what the node learns ([`Input`]) and the time it
//! learned it, and says what to do ([`Action`]s): it starts no task, reads no clock and
//! touches the network nowhere; the actor ([`actor`](super::actor)) feeds it and performs
//! its actions. What the rules are is in the module above.

#[cfg(test)]
mod tests;
mod trust;
mod turns;

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    sync::Arc,
};

use hypha_network::PeerId;
use tokio::time::Instant;

use super::{
    BACKOFF, FAILURES_BEFORE_BAN, Failure, Held, ORIGIN_ATTEMPTS, PULLING_PATIENCE, PeerFailure,
    PeerProgress, Progress, TICK,
};
use crate::{Settings, manifest::Manifest, protocol::SwarmMessage};

/// What the swarm's state learns.
#[derive(Debug)]
pub(crate) enum Input {
    /// The actor started: decide what to read first.
    Start,
    /// A member opened its swarm stream to us (its hello was answered).
    Joined(PeerId),
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
    /// Our stream to the peer closed (refused, or it broke).
    WriterEnded {
        peer: PeerId,
        generation: u64,
    },
    /// Our stream to the peer could not take a message (its queue was full: the peer does not
    /// keep up) and was dropped; a fresh one (with a full snapshot) is opened later.
    WriterDropped {
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
    /// The files were completed (synced, renamed into place, recorded), or could not be.
    Finished(Result<(), String>),
    /// Time passed ([`TICK`]); `named`: the peers the fetches name, while members are
    /// still awaited ([`State::joining`]).
    Tick {
        named: Vec<PeerId>,
        /// The chunks this node sends members now.
        uploads: u32,
    },
}

/// What the swarm's state asks its actor to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Action {
    /// Read `chunk` from the origin into the files.
    PullFromOrigin(u32),
    /// Read only the origin's hash of the held `chunk`.
    SampleOrigin(u32),
    /// Read `chunk` from `peer`, expecting `expected` as its hash.
    PullFromPeer {
        chunk: u32,
        peer: PeerId,
        expected: [u8; 32],
    },
    /// Read the stream `peer` opened to us, as `generation`.
    ReadFrom { peer: PeerId, generation: u64 },
    /// Stop reading `peer`'s stream (it left, or opened another).
    StopReading(PeerId),
    /// Open our stream to `peer`, as `generation`, sending `initial` first.
    Connect {
        peer: PeerId,
        generation: u64,
        initial: Vec<SwarmMessage>,
    },
    /// Close our stream to `peer` (what it was told no longer counts).
    Disconnect(PeerId),
    /// Send to every member our stream is open to.
    Broadcast(SwarmMessage),
    /// `chunk` is held as `held`: served to members from now on, and noted in the cache for
    /// resuming. Asked before members are told.
    Hold { chunk: u32, held: Held },
    /// `chunk` is held no more: served no more, and forgotten in the cache.
    Release(u32),
    /// Every chunk is in: complete the files ([`Input::Finished`] when done).
    Finish,
}

/// What a member announced it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Claim {
    hash: [u8; 32],
    from_origin: bool,
    /// It was the sender's turn to read the chunk from the origin when it said it did, or
    /// when it said it was reading it (as this node saw the ring then, or when reading
    /// started, for claims that came before): its word alone is taken.
    in_turn: bool,
}

/// A member said it reads a chunk from the origin.
#[derive(Debug, Clone, Copy)]
pub(super) struct Pull {
    since: Instant,
    /// The chunk was that member's to read when it said so: its hash, when it comes, is taken
    /// even if the chunk has become this node's since (a member left meanwhile).
    in_turn: bool,
}

/// Whom a chunk's hash is known from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Vouched {
    /// Nobody read it from the origin, as far as this node knows.
    Nobody,
    /// This hash: this node read it from the origin, or the members that did agree.
    For([u8; 32]),
    /// Members that read it from the origin announced different hashes.
    Disputed,
    /// No member's word on it counts, but two live members hold it with this hash (see
    /// [`State::endorsed`]): taken from them, except where it is this node's turn to read it,
    /// so that each chunk's owner still checks it against the origin.
    Endorsed([u8; 32]),
}

#[derive(Debug, Default)]
pub(super) struct Peer {
    /// Generation of the live inbound stream; `None` while the peer has not joined us.
    reader: Option<u64>,
    /// Generation of our stream to it, while it is open.
    writer: Option<u64>,
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
pub(super) enum Source {
    Origin,
    Peer(PeerId),
}

/// One artifact's swarm as this node sees it.
#[derive(Debug)]
pub(super) struct State {
    me: PeerId,
    offset: usize,
    tie_break: u64,
    /// Until the expected members are there (or this passes), nothing is read from the
    /// origin; `None` once they were: a member that dies later does not stop the others.
    join_deadline: Option<Instant>,
    expect: usize,
    settings: Settings,
    manifest: Arc<Manifest>,
    /// The chunks this node holds, as it told the actor ([`Action::Hold`],
    /// [`Action::Release`]), and how many.
    held: Vec<Option<Held>>,
    held_count: usize,
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
    /// What this node's progress report says.
    progress: Progress,
    finishing: bool,
    reported_uploads: u32,
    /// When a member last joined, left or was banned (or the join gate opened): turns to
    /// read from the origin changed hands, and members are given time to take them up.
    ring_changed: Instant,
    /// When a chunk last arrived (or the join gate opened).
    last_arrival: Instant,
    /// The time of the input being applied.
    now: Instant,
    /// What the input calls for, in order.
    actions: Vec<Action>,
}

impl State {
    /// The swarm of the artifact of `manifest`, of whose chunks this node holds `held`
    /// already (one entry a chunk), as node `me` with `settings`, `expect` members (this
    /// node included) waited for from `now` on; `progress` is what this node reported so
    /// far. The chunks it audits and its tie-break are drawn from `rng`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        me: PeerId,
        settings: Settings,
        manifest: Arc<Manifest>,
        held: Vec<Option<Held>>,
        expect: usize,
        progress: Progress,
        now: Instant,
        rng: &mut impl rand::Rng,
    ) -> Self {
        let count = manifest.chunk_count();
        let mut held = held;
        held.resize(count as usize, None);
        // Chosen here and never told: a member that knew which chunks are checked would lie
        // about the others.
        let audit = (0..count)
            .map(|_| rng.random::<f64>() < settings.origin_audit)
            .collect();
        let mut state = State {
            me,
            offset: manifest.id.0[0] as usize,
            tie_break: rng.random(),
            join_deadline: Some(now + settings.join_timeout),
            expect: expect.max(1),
            settings,
            manifest,
            held_count: held.iter().flatten().count(),
            held,
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
            progress,
            finishing: false,
            reported_uploads: 0,
            ring_changed: now,
            last_arrival: now,
            now,
            actions: Vec::new(),
        };
        for chunk in 0..count {
            if let Some(held) = state.held[chunk as usize]
                && held.from_origin
            {
                state.verified[chunk as usize] = Some(held.hash);
                state.revouch(chunk);
            }
        }
        state
    }

    fn is_held(&self, chunk: u32) -> bool {
        self.held.get(chunk as usize).is_some_and(Option::is_some)
    }

    /// The hash of `chunk` if this node holds it.
    fn held_hash(&self, chunk: u32) -> Option<[u8; 32]> {
        self.held
            .get(chunk as usize)
            .copied()
            .flatten()
            .map(|h| h.hash)
    }

    fn complete(&self) -> bool {
        self.held_count == self.held.len()
    }

    /// Takes `input`, learned at `now`, and says what to do about it.
    pub(super) fn apply(&mut self, input: Input, now: Instant) -> Vec<Action> {
        self.now = now;
        self.handle(input);
        self.schedule();
        self.publish();
        std::mem::take(&mut self.actions)
    }

    /// What this node reports of the artifact's distribution.
    pub(super) fn progress(&self) -> &Progress {
        &self.progress
    }

    /// Members are still awaited: nothing is read yet, and the peers the fetches name are
    /// reached for.
    pub(super) fn joining(&self) -> bool {
        self.join_deadline.is_some()
    }

    fn handle(&mut self, input: Input) {
        match input {
            Input::Start => {}
            Input::Joined(peer) => self.joined(peer),
            Input::Discovered(found) => self.reach(found),
            Input::Message {
                peer,
                generation,
                message,
            } => {
                if self.peers.get(&peer).and_then(|p| p.reader) == Some(generation) {
                    self.message(peer, message);
                }
            }
            Input::ReaderClosed { peer, generation } => {
                if self.peers.get(&peer).and_then(|p| p.reader) == Some(generation) {
                    tracing::debug!(artifact = %self.manifest.id, %peer, "member left");
                    self.forget(peer);
                }
            }
            Input::WriterEnded { peer, generation } => {
                if let Some(p) = self.peers.get_mut(&peer)
                    && p.writer == Some(generation)
                {
                    p.writer = None;
                    p.left_alone_until = Some(self.now + BACKOFF);
                    self.actions.push(Action::Disconnect(peer));
                }
            }
            Input::WriterDropped { peer, generation } => {
                if let Some(p) = self.peers.get_mut(&peer)
                    && p.writer == Some(generation)
                {
                    tracing::debug!(%peer, "peer queue full or closed; reconnecting later");
                    p.writer = None;
                }
            }
            Input::OriginPulled { chunk, result } => self.origin_pulled(chunk, result),
            Input::Sampled { chunk, result } => {
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
            Input::PeerPulled {
                chunk,
                peer,
                result,
            } => self.peer_pulled(chunk, peer, result),
            Input::Finished(result) => match result {
                Ok(()) => {
                    tracing::info!(artifact = %self.manifest.id, "complete");
                    self.progress.complete = true;
                    self.broadcast(SwarmMessage::Done);
                }
                Err(reason) => self.fail(Failure::Failed(reason)),
            },
            Input::Tick { named, uploads } => self.tick(named, uploads),
        }
    }

    /// A chunk read from the origin arrived (its hash), or the read failed.
    fn origin_pulled(&mut self, chunk: u32, result: Result<[u8; 32], Failure>) {
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

    /// A chunk asked of `peer` arrived (its hash), or the peer failed it: busy and refusing
    /// holders are left alone a while, one that sent bad bytes or failed again and again is
    /// banned.
    fn peer_pulled(&mut self, chunk: u32, peer: PeerId, result: Result<[u8; 32], PeerFailure>) {
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
                    let now = self.now;
                    p.held_back.entry(chunk).or_insert(now);
                    p.left_alone_until = Some(now + TICK);
                }
            }
            Err(PeerFailure::Refused(reason)) => {
                tracing::debug!(artifact = %self.manifest.id, %peer, chunk, "chunk request refused: {reason}");
                if let Some(p) = self.peers.get_mut(&peer) {
                    let now = self.now;
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
                    p.left_alone_until = Some(self.now + BACKOFF);
                    p.failures += 1;
                    if p.failures >= FAILURES_BEFORE_BAN {
                        tracing::warn!(artifact = %self.manifest.id, %peer, "failed {FAILURES_BEFORE_BAN} chunk requests in a row ({reason}); not asking it again for this artifact");
                        self.ban(peer);
                    }
                }
            }
        }
    }

    /// The actor's tick, with the peers the fetches name.
    fn tick(&mut self, named: Vec<PeerId>, uploads: u32) {
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
            self.reach(named);
        }
        if uploads != self.reported_uploads {
            self.reported_uploads = uploads;
            self.broadcast(SwarmMessage::Load { uploads });
        }
    }

    fn fail(&mut self, failure: Failure) {
        if self.progress.failure.is_none() {
            self.progress.failure = Some(failure);
        }
    }

    fn failed(&self) -> bool {
        self.progress.failure.is_some()
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

    /// Forgets a chunk held on a word the origin contradicted, so that it is fetched again.
    fn release(&mut self, chunk: u32) {
        if self.finishing {
            tracing::warn!(artifact = %self.manifest.id, chunk, "a chunk of the completed files was vouched for by a member the origin contradicted; fetch the artifact again to be sure of it");
            return;
        }
        if self.held[chunk as usize].take().is_none() {
            return;
        }
        self.held_count -= 1;
        self.actions.push(Action::Release(chunk));
        let len = self.manifest.chunks()[chunk as usize].len;
        let p = &mut self.progress;
        p.held -= 1;
        p.peer_chunks = p.peer_chunks.saturating_sub(1);
        p.peer_bytes = p.peer_bytes.saturating_sub(len);
        self.broadcast(SwarmMessage::Dropped { chunk });
    }

    /// A member opened its stream to us: read it, and make sure ours to it is open.
    fn joined(&mut self, peer: PeerId) {
        if self.failed() {
            return;
        }
        let now = self.now;
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
        self.actions.push(Action::ReadFrom { peer, generation });
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
        let now = self.now;
        let entry = self.peers.entry(peer).or_default();
        if entry.writer.is_some() || entry.left_alone_until.is_some_and(|t| now < t) {
            return;
        }
        self.generation += 1;
        let generation = self.generation;
        entry.writer = Some(generation);
        let mut initial: Vec<SwarmMessage> = (0..self.manifest.chunk_count())
            .filter_map(|chunk| {
                self.held[chunk as usize].map(|held| SwarmMessage::Have {
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
        if self.progress.complete {
            initial.push(SwarmMessage::Done);
        }
        self.actions.push(Action::Connect {
            peer,
            generation,
            initial,
        });
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
        self.actions.push(Action::StopReading(peer));
        if p.writer.take().is_some() {
            self.actions.push(Action::Disconnect(peer));
        }
        self.ring_changed = self.now;
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
            self.ring_changed = self.now;
            for chunk in had {
                self.revouch(chunk);
            }
        }
    }

    fn message(&mut self, peer: PeerId, message: SwarmMessage) {
        let now = self.now;
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
                    p.last_read = Some(self.now);
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
                    let since = *p.first_pulled.entry(chunk).or_insert(now);
                    p.reading_since.get_or_insert(now);
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

    /// A chunk arrived and was verified.
    fn held(&mut self, chunk: u32, held: Held, source: Source) {
        if self.is_held(chunk) {
            return;
        }
        let hash = held.hash;
        let len = self.manifest.chunks()[chunk as usize].len;
        self.held[chunk as usize] = Some(held);
        self.held_count += 1;
        self.actions.push(Action::Hold { chunk, held });
        self.last_arrival = self.now;
        let p = &mut self.progress;
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
        self.broadcast(SwarmMessage::Have {
            chunk,
            blake3: hash,
            from_origin: held.from_origin,
        });
    }

    /// Sends `message` to every member our stream is open to.
    fn broadcast(&mut self, message: SwarmMessage) {
        self.actions.push(Action::Broadcast(message));
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
        if self.complete() && self.to_sample.is_empty() && self.samples_in_flight == 0 {
            if !self.progress.complete {
                self.finish();
            }
            return;
        }
        let slots = self.settings.download_slots.max(1);
        let members = self.members();
        // The ring is whole when the members expected are there and each has said what it
        // holds (a newcomer must not read what they hold because their word is on its way).
        let whole = || {
            members.len() >= self.expect
                && self.peers.values().filter(|p| p.live()).all(|p| p.synced)
        };
        if let Some(deadline) = self.join_deadline
            && (whole() || self.now >= deadline)
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
            let now = self.now;
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
        let origin_slots = slots.min((self.settings.origin_connections / members.len()).max(1));
        while self.origin_in_flight < origin_slots
            && let Some(chunk) = self.to_sample.pop_first()
        {
            if self.verified[chunk as usize].is_none() && self.is_held(chunk) {
                self.sample_origin(chunk);
            }
        }
        if self.complete() {
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
            let now = self.now;
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

    fn pull_from_origin(&mut self, chunk: u32) {
        self.in_flight.insert(chunk, Source::Origin);
        self.origin_in_flight += 1;
        self.broadcast(SwarmMessage::Pulling { chunk });
        self.actions.push(Action::PullFromOrigin(chunk));
    }

    /// Reads the origin's hash of a held chunk that a member contradicted.
    fn sample_origin(&mut self, chunk: u32) {
        self.origin_in_flight += 1;
        self.samples_in_flight += 1;
        self.actions.push(Action::SampleOrigin(chunk));
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
        self.actions.push(Action::PullFromPeer {
            chunk,
            peer,
            expected,
        });
    }

    /// Every chunk is in: the files are synced, renamed into place and remembered.
    fn finish(&mut self) {
        self.finishing = true;
        self.actions.push(Action::Finish);
    }

    /// Brings the members and the uploads in the progress report up to date.
    fn publish(&mut self) {
        self.progress.peers = self
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
    }
}
