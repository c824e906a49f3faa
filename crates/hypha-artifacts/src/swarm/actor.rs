//! The swarm's actor: it feeds what the node learns to the rules ([`State`]) and performs the
//! actions they call for. Every task it starts (transfers, the streams to and from each
//! member, discovery, the tick, the cache's writes) is in one `JoinSet`, so that they end
//! with the swarm.

use std::{
    collections::HashMap,
    sync::{Arc, atomic::Ordering},
};

use hypha_messages::artifact::Request;
use hypha_network::{PeerId, Stream};
use tokio::{
    sync::{mpsc, watch},
    task::{AbortHandle, JoinSet},
    time::Instant,
};

use super::{
    Context, Event, Held, Holding, PEER_QUEUE, Progress,
    state::{Action, Input, State},
    tasks::{discover, hash_origin, read_from, read_origin, read_peer, tick, write_to},
};
use crate::{
    cache::{Record, Stamp},
    protocol::{SwarmMessage, provider_key},
};

/// One artifact's swarm on this node: the rules, and what carries their actions out.
pub(super) struct Actor {
    state: State,
    context: Context,
    request: Request,
    holding: Arc<Holding>,
    events_tx: mpsc::Sender<Event>,
    progress: watch::Sender<Progress>,
    tasks: JoinSet<()>,
    /// The task reading each member's stream to us: stopped when the member opens another
    /// (a peer saying hello again and again must not leave a task per stream behind).
    readers: HashMap<PeerId, AbortHandle>,
    /// Our stream to each member: its generation and its writer's queue.
    writers: HashMap<PeerId, (u64, mpsc::Sender<SwarmMessage>)>,
}

impl Actor {
    /// The actor of the artifact `holding` assembles, `expect` members waited for.
    pub(super) fn new(
        context: Context,
        request: Request,
        holding: Arc<Holding>,
        expect: usize,
        events_tx: mpsc::Sender<Event>,
        progress: watch::Sender<Progress>,
    ) -> Self {
        let manifest = holding.assembly.manifest().clone();
        let held = (0..manifest.chunk_count())
            .map(|chunk| holding.held_as(chunk))
            .collect();
        let state = State::new(
            context.network.local_peer_id(),
            context.settings.clone(),
            manifest,
            held,
            expect,
            progress.borrow().clone(),
            Instant::now(),
            &mut rand::rng(),
        );
        Actor {
            state,
            context,
            request,
            holding,
            events_tx,
            progress,
            tasks: JoinSet::new(),
            readers: HashMap::new(),
            writers: HashMap::new(),
        }
    }

    pub(super) async fn run(mut self, mut events: mpsc::Receiver<Event>) {
        let manifest = self.holding.assembly.manifest().clone();
        let key = provider_key(manifest.id);
        // Announced beside the actor, never before it: a DHT put waits on the slowest of the
        // closest peers (up to the query timeout), and a swarm that waited for it would let
        // its join timeout pass without hearing the members that came meanwhile.
        let (network, announced, artifact) =
            (self.context.network.clone(), key.clone(), manifest.id);
        self.tasks.spawn(async move {
            if let Err(e) = network.start_providing(&announced).await {
                tracing::warn!(%artifact, "cannot announce in the DHT: {e}");
            }
        });
        self.tasks.spawn(discover(
            self.context.network.clone(),
            key.clone(),
            self.events_tx.downgrade(),
            self.context.settings.discovery_interval,
        ));
        self.tasks.spawn(tick(self.events_tx.downgrade()));
        self.apply(Input::Start, None);
        while let Some(event) = events.recv().await {
            // Tasks that ended are let go of as the swarm goes.
            while self.tasks.try_join_next().is_some() {}
            let (input, stream) = match event {
                Event::Joined { peer, stream } => (Input::Joined(peer), Some(stream)),
                Event::Tick => {
                    let named = match self.state.joining() {
                        true => self.context.named.get(),
                        false => Vec::new(),
                    };
                    let uploads = self.holding.uploads_now();
                    (Input::Tick { named, uploads }, None)
                }
                Event::Learned(input) => (input, None),
            };
            self.apply(input, stream);
            // The node dropped every handle on this swarm: leave it.
            if self.progress.is_closed() {
                break;
            }
        }
        self.tasks.shutdown().await;
        let _ = self.context.network.stop_providing(&key).await;
    }

    /// Applies `input` (with the stream a member opened, for [`Input::Joined`]), performs
    /// what it calls for, and publishes the progress.
    fn apply(&mut self, input: Input, mut stream: Option<Stream>) {
        let mut inputs = vec![input];
        while let Some(input) = inputs.pop() {
            for action in self.state.apply(input, Instant::now()) {
                self.perform(action, &mut stream, &mut inputs);
            }
        }
        // What this node sent members is counted by the chunk server, not the rules.
        let mut now = self.state.progress().clone();
        now.uploaded_chunks = self.holding.uploaded_chunks.load(Ordering::Relaxed);
        now.uploaded_bytes = self.holding.uploaded_bytes.load(Ordering::Relaxed);
        self.progress.send_if_modified(|progress| {
            let changed = *progress != now;
            if changed {
                *progress = now;
            }
            changed
        });
    }

    /// Carries `action` out; what the state must hear of it at once (writers dropped) goes
    /// to `heard`.
    fn perform(&mut self, action: Action, stream: &mut Option<Stream>, heard: &mut Vec<Input>) {
        match action {
            Action::PullFromOrigin(chunk) => {
                let (origin, holding) = (self.context.origin.clone(), self.holding.clone());
                let events = self.events_tx.clone();
                self.tasks.spawn(async move {
                    let result = read_origin(&origin, &holding, chunk).await;
                    let _ = events
                        .send(Event::Learned(Input::OriginPulled { chunk, result }))
                        .await;
                });
            }
            Action::SampleOrigin(chunk) => {
                let origin = self.context.origin.clone();
                let manifest = self.holding.assembly.manifest().clone();
                let events = self.events_tx.clone();
                self.tasks.spawn(async move {
                    let result = hash_origin(&origin, &manifest, chunk).await;
                    let _ = events
                        .send(Event::Learned(Input::Sampled { chunk, result }))
                        .await;
                });
            }
            Action::PullFromPeer {
                chunk,
                peer,
                expected,
            } => {
                let (network, holding) = (self.context.network.clone(), self.holding.clone());
                let events = self.events_tx.clone();
                self.tasks.spawn(async move {
                    let result = read_peer(&network, peer, &holding, chunk, expected).await;
                    let _ = events
                        .send(Event::Learned(Input::PeerPulled {
                            chunk,
                            peer,
                            result,
                        }))
                        .await;
                });
            }
            Action::ReadFrom { peer, generation } => {
                if let Some(stream) = stream.take() {
                    let reader = read_from(peer, generation, stream, self.events_tx.clone());
                    let task = self.tasks.spawn(reader);
                    if let Some(earlier) = self.readers.insert(peer, task) {
                        earlier.abort();
                    }
                }
            }
            Action::StopReading(peer) => {
                if let Some(task) = self.readers.remove(&peer) {
                    task.abort();
                }
            }
            Action::Connect {
                peer,
                generation,
                initial,
            } => {
                let (tx, rx) = mpsc::channel(PEER_QUEUE);
                self.writers.insert(peer, (generation, tx));
                self.tasks.spawn(write_to(
                    self.context.network.clone(),
                    peer,
                    self.holding.assembly.manifest().id,
                    generation,
                    initial,
                    rx,
                    self.events_tx.clone(),
                ));
            }
            // Its writer ends once its queue is dropped.
            Action::Disconnect(peer) => drop(self.writers.remove(&peer)),
            Action::Broadcast(message) => {
                // A member whose queue is full does not keep up: its writer is dropped.
                self.writers.retain(|&peer, &mut (generation, ref tx)| {
                    let sent = tx.try_send(message.clone()).is_ok();
                    if !sent {
                        heard.push(Input::WriterDropped { peer, generation });
                    }
                    sent
                });
            }
            Action::Hold { chunk, held } => {
                self.holding.hold(chunk, held);
                let Held { hash, from_origin } = held;
                let (cache, id) = (
                    self.context.cache.clone(),
                    self.holding.assembly.manifest().id,
                );
                self.tasks.spawn_blocking(move || {
                    if let Err(e) = cache.record_chunk(id, chunk, &hash, from_origin) {
                        tracing::warn!("cannot record chunk {chunk} of {id} for resuming: {e}");
                    }
                });
            }
            Action::Release(chunk) => {
                self.holding.release(chunk);
                let (cache, id) = (
                    self.context.cache.clone(),
                    self.holding.assembly.manifest().id,
                );
                self.tasks.spawn_blocking(move || {
                    if let Err(e) = cache.forget_chunk(id, chunk) {
                        tracing::warn!("cannot forget chunk {chunk} of {id}: {e}");
                    }
                });
            }
            Action::Finish => self.finish(),
        }
    }

    /// Every chunk is in: sync, rename into place, remember it.
    fn finish(&mut self) {
        let holding = self.holding.clone();
        let cache = self.context.cache.clone();
        let request = self.request.clone();
        let manifest = (**holding.assembly.manifest()).clone();
        let events = self.events_tx.clone();
        self.tasks.spawn(async move {
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
                        unpacked_contents: Default::default(),
                    })
                    .map_err(|e| e.to_string())
            })
            .await
            .unwrap_or_else(|e| Err(e.to_string()));
            let _ = events.send(Event::Learned(Input::Finished(result))).await;
        });
    }
}
