//! The actor that owns the swarm.
//!
//! It reacts to two sources only: swarm events and commands from [`Network`](crate::Network)
//! handles. It never awaits anything else, so no slow consumer can stall it: everything it hands
//! out goes through bounded queues with `try_send`, and the policy when a queue is full is part
//! of each queue's documentation (gossip: drop the message; inbound requests: answer `Busy`).
//!
//! The actor and its commands are here; `connect` reaches peers (known addresses, the DHT, a
//! gateway's relay) and follows each connection's path, `protocols` handles what the
//! behaviour's protocols report, `listeners` moves this node's port where its NAT needs it
//! ([`port_move`](crate::port_move)).

mod connect;
mod listeners;
mod protocols;

use std::{
    collections::{HashMap, HashSet, VecDeque},
    sync::Arc,
    time::{Duration, Instant},
};

use futures::StreamExt;
use hypha_certs::Role;
use hypha_messages::{Envelope, Request, Response};
use libp2p::{
    Multiaddr, PeerId, Swarm,
    core::ConnectedPoint,
    gossipsub, kad,
    multiaddr::Protocol,
    request_response,
    swarm::{
        ConnectionId, SwarmEvent,
        dial_opts::{DialOpts, PeerCondition},
    },
};
use tokio::sync::{mpsc, watch};

use self::{
    connect::{ConnectStage, PendingConnect},
    listeners::Listeners,
};
use crate::{
    Settings,
    behaviour::{Behaviour, BehaviourEvent, peer_id_of},
    certified::CertifiedPeers,
    client::{Command, GossipFailure, GossipMessage, InboundRequest, NetworkError},
    in_flight::{InFlight, Underway},
    nat::NatBelief,
    paths::Paths,
    reach::Reach,
};

type Reply<T> = tokio::sync::oneshot::Sender<Result<T, NetworkError>>;

/// How often gateways that dropped are redialled.
const GATEWAY_RETRY: Duration = Duration::from_secs(5);
/// How often the routing table is refreshed while it has peers.
const BOOTSTRAP_INTERVAL: Duration = Duration::from_secs(5 * 60);
/// How often windows for a direct connection ([`PUNCH_WINDOW`]) are checked for their end.
const PUNCH_WINDOW_CHECK: Duration = Duration::from_millis(250);
/// How many quietly closed relayed connections are remembered (see `quiet_closes`).
const QUIET_CLOSES_KEPT: usize = 64;
/// Ping timeouts in a row after which a connection is closed as dead.
const PING_TIMEOUTS_TO_CLOSE: u32 = 2;
/// How long a peer's certificate is kept after its last connection closed.
const DEPARTED_GRACE: Duration = Duration::from_secs(5);

/// A request sent and not answered yet.
pub(crate) struct PendingRequest {
    peer: PeerId,
    /// Kept to send it again once, where the connection it took closed before the peer took it.
    request: Envelope<Request>,
    reply: Reply<Response>,
    _underway: Underway,
    sent_again: bool,
}

pub(crate) struct EventLoop {
    pub(crate) swarm: Swarm<Behaviour>,
    pub(crate) commands: mpsc::Receiver<Command>,
    /// Kept to hand to [`Responder`]s.
    pub(crate) command_sender: mpsc::WeakSender<Command>,
    pub(crate) inbound: mpsc::Sender<InboundRequest>,
    pub(crate) reach: Reach,
    pub(crate) kind: String,
    pub(crate) gateways: Vec<Multiaddr>,
    pub(crate) relay_circuit: bool,
    pub(crate) started: Instant,
    peers: CertifiedPeers,
    /// Where [`Network::listen_addresses`](crate::Network::listen_addresses) reads from.
    listening: watch::Sender<Vec<Multiaddr>>,

    health: (bool, String),
    /// Connected gateways and the address each was reached at (relay circuits are built on it).
    gateway_peers: HashMap<PeerId, Multiaddr>,
    relay_listeners: HashMap<libp2p::core::transport::ListenerId, PeerId>,
    pending_dials: HashMap<ConnectionId, Reply<PeerId>>,
    pending_connects: HashMap<PeerId, PendingConnect>,
    pending_lookups: HashMap<kad::QueryId, PeerId>,
    pending_requests: HashMap<request_response::OutboundRequestId, PendingRequest>,
    /// Retired relayed connections this node closed with nothing of the application's under
    /// way, the latest [`QUIET_CLOSES_KEPT`]: a request that fails because one closed was sent
    /// after the close and never reached the peer, and is sent again; a request that arrives
    /// over one is not taken (its sender sees the connection close).
    quiet_closes: VecDeque<ConnectionId>,
    /// Requests from peers not answered yet (the answer is on its way until `ResponseSent`).
    answering: HashMap<request_response::InboundRequestId, Underway>,
    /// What the application has under way with each peer: a relayed connection a direct one
    /// replaced is closed only once its peer is quiet.
    in_flight: InFlight,
    pending_providers: HashMap<kad::QueryId, (HashSet<PeerId>, Reply<HashSet<PeerId>>)>,
    pending_start_providing: HashMap<kad::QueryId, Reply<()>>,
    pending_bootstrap: HashMap<kad::QueryId, Reply<()>>,
    subscribers: HashMap<gossipsub::TopicHash, Vec<mpsc::Sender<GossipMessage>>>,
    gossip_dropped: u64,
    last_drop_warning: Option<Instant>,
    /// The first dial of each gateway, and who waits until they have all succeeded or failed.
    startup: Option<(HashSet<ConnectionId>, tokio::sync::oneshot::Sender<()>)>,
    /// How each peer is reached, and the connects waiting for a direct connection.
    paths: Paths<Reply<()>>,
    /// What this node believes of its NAT, and its dials of gateways: they leave from its
    /// listen port, so the address a gateway observes on one tells of the NAT.
    nat: NatBelief,
    gateway_dials: HashSet<ConnectionId>,
    /// Dials of configured gateway addresses not yet connected or failed: an address is not
    /// dialled twice at once (the second dial could not leave from the listen port, and what
    /// the gateway observes of it would say nothing of the NAT).
    dialling_gateways: HashMap<ConnectionId, Multiaddr>,
    /// Peers whose last connection closed, and when: forgotten after [`DEPARTED_GRACE`]
    /// unless they are back.
    departed: HashMap<PeerId, Instant>,
    /// The addresses hole-punched connections were dialled at: peers' NAT mappings, kept out
    /// of the routing table.
    nat_mappings: HashMap<PeerId, HashSet<Multiaddr>>,
    /// Where each connection this node dialled leads: DCUtR names its punched connection by
    /// id.
    dialled_at: HashMap<ConnectionId, (PeerId, Multiaddr)>,
    /// Pings in a row each connection left unanswered.
    ping_timeouts: HashMap<ConnectionId, u32>,
    /// Peers behind this node's NAT ([`crate::neighbours`]): the questions out, the dials of
    /// the private addresses they answered, and those that led to them (dialled first by
    /// connects).
    neighbour_asks: HashMap<request_response::OutboundRequestId, PeerId>,
    neighbour_dials: HashMap<ConnectionId, Vec<Multiaddr>>,
    neighbours: HashMap<PeerId, Vec<Multiaddr>>,
    /// This node's TCP listeners, and moving off a port its NAT gave another machine.
    listeners: Listeners,
}

impl EventLoop {
    /// The loop for `swarm`, taking commands from `commands` (whose sender it lends to
    /// responders) and handing requests to `inbound`; it publishes its listen addresses on
    /// `listening`, `configured` are the listeners the node started with, and `dialed_from`
    /// the ports its TCP dials left from, as the transport records them.
    pub(crate) fn new(
        swarm: Swarm<Behaviour>,
        commands: (mpsc::WeakSender<Command>, mpsc::Receiver<Command>),
        inbound: mpsc::Sender<InboundRequest>,
        settings: Settings,
        (peers, in_flight): (CertifiedPeers, InFlight),
        reach: Reach,
        (listening, configured, dialed_from): (
            watch::Sender<Vec<Multiaddr>>,
            Vec<(libp2p::core::transport::ListenerId, Multiaddr)>,
            crate::nat::DialedFrom,
        ),
    ) -> Self {
        let mut nat = NatBelief::default();
        for address in swarm.listeners().chain(swarm.external_addresses()) {
            nat.own_address(address);
        }
        EventLoop {
            swarm,
            commands: commands.1,
            command_sender: commands.0,
            inbound,
            reach,
            kind: settings.kind,
            gateways: settings.gateway_addresses,
            relay_circuit: settings.relay_circuit,
            started: Instant::now(),
            peers,
            listening,
            health: match settings.healthy_at_start {
                true => (true, "running".into()),
                false => (false, "starting: not ready for its work yet".into()),
            },
            gateway_peers: HashMap::new(),
            relay_listeners: HashMap::new(),
            pending_dials: HashMap::new(),
            pending_connects: HashMap::new(),
            pending_lookups: HashMap::new(),
            pending_requests: HashMap::new(),
            quiet_closes: VecDeque::new(),
            answering: HashMap::new(),
            in_flight,
            pending_providers: HashMap::new(),
            pending_start_providing: HashMap::new(),
            pending_bootstrap: HashMap::new(),
            subscribers: HashMap::new(),
            gossip_dropped: 0,
            last_drop_warning: None,
            startup: None,
            paths: Paths::default(),
            nat,
            gateway_dials: HashSet::new(),
            dialling_gateways: HashMap::new(),
            departed: HashMap::new(),
            nat_mappings: HashMap::new(),
            dialled_at: HashMap::new(),
            ping_timeouts: HashMap::new(),
            neighbour_asks: HashMap::new(),
            neighbour_dials: HashMap::new(),
            neighbours: HashMap::new(),
            listeners: Listeners::new(configured, dialed_from),
        }
    }

    /// Runs the loop; `joined` fires once the first dial of every gateway has succeeded or
    /// failed, so a node is on the network when `start` returns.
    pub(crate) async fn run(mut self, joined: tokio::sync::oneshot::Sender<()>) {
        let first_dials: HashSet<ConnectionId> = self.dial_gateways().into_iter().collect();
        if first_dials.is_empty() {
            let _ = joined.send(());
        } else {
            self.startup = Some((first_dials, joined));
        }
        let mut gateway_retry = tokio::time::interval(GATEWAY_RETRY);
        gateway_retry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut bootstrap = tokio::time::interval(BOOTSTRAP_INTERVAL);
        bootstrap.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut punch_windows = tokio::time::interval(PUNCH_WINDOW_CHECK);
        punch_windows.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                event = self.swarm.select_next_some() => self.on_swarm_event(event),
                command = self.commands.recv() => match command {
                    Some(Command::Shutdown { reply }) => {
                        self.shut_down();
                        let _ = reply.send(());
                        return;
                    }
                    Some(command) => self.on_command(command),
                    None => {
                        self.shut_down();
                        return;
                    }
                },
                _ = gateway_retry.tick() => {
                    self.dial_gateways();
                }
                _ = punch_windows.tick() => {
                    self.end_punch_windows();
                    self.forget_departed();
                    self.move_port_when_due();
                }
                _ = bootstrap.tick() => {
                    let kad = &mut self.swarm.behaviour_mut().kad;
                    if kad.kbuckets().any(|bucket| bucket.num_entries() > 0) {
                        let _ = kad.bootstrap();
                    }
                }
            }
        }
    }

    fn shut_down(&mut self) {
        let peers: Vec<PeerId> = self.swarm.connected_peers().copied().collect();
        for peer in peers {
            let _ = self.swarm.disconnect_peer_id(peer);
        }
        tracing::debug!("network stopped");
    }

    /// Dials every gateway we are not connected to (nor dialling); returns the dials started.
    fn dial_gateways(&mut self) -> Vec<ConnectionId> {
        let mut started = Vec::new();
        for address in self.gateways.clone() {
            if self.dialling_gateways.values().any(|a| *a == address) {
                continue;
            }
            let opts = match peer_id_of(&address) {
                Some(peer) if self.swarm.is_connected(&peer) => continue,
                Some(peer) => DialOpts::peer_id(peer)
                    .addresses(vec![address.clone()])
                    .condition(PeerCondition::DisconnectedAndNotDialing)
                    .build(),
                None => {
                    if self
                        .gateway_peers
                        .keys()
                        .any(|p| self.swarm.is_connected(p))
                    {
                        continue;
                    }
                    DialOpts::unknown_peer_id().address(address.clone()).build()
                }
            };
            let id = opts.connection_id();
            match self.swarm.dial(opts) {
                Ok(()) => {
                    self.gateway_dials.insert(id);
                    self.dialling_gateways.insert(id, address);
                    started.push(id);
                }
                Err(e) => tracing::debug!(%address, error = %e, "cannot dial gateway"),
            }
        }
        started
    }

    /// Notes that a dial ended; completes start-up when it was the last first gateway dial.
    fn dial_ended(&mut self, id: ConnectionId) {
        self.dialling_gateways.remove(&id);
        if let Some((pending, _)) = &mut self.startup {
            pending.remove(&id);
            if pending.is_empty()
                && let Some((_, joined)) = self.startup.take()
            {
                let _ = joined.send(());
            }
        }
    }

    fn is_gateway_address(&self, address: &Multiaddr) -> bool {
        self.gateways.iter().any(|g| {
            let without_peer: Multiaddr = g
                .iter()
                .filter(|p| !matches!(p, Protocol::P2p(_)))
                .collect();
            address
                .iter()
                .filter(|p| !matches!(p, Protocol::P2p(_)))
                .eq(without_peer.iter())
        })
    }

    fn on_command(&mut self, command: Command) {
        match command {
            Command::Dial { address, reply } => self.dial(address, reply),
            Command::Connect { peer, reply } => self.connect(peer, reply),
            Command::AddAddress { peer, address } => {
                if self.reach.worth_keeping(&address) {
                    self.swarm
                        .behaviour_mut()
                        .kad
                        .add_address(&peer, address.clone());
                    self.swarm.add_peer_address(peer, address);
                }
            }
            Command::ConnectedPeers { reply } => {
                let _ = reply.send(self.swarm.connected_peers().copied().collect());
            }
            Command::Paths { reply } => {
                let _ = reply.send(self.paths.all());
            }
            Command::StartProviding { key, reply } => {
                match self.swarm.behaviour_mut().kad.start_providing(key) {
                    Ok(id) => {
                        self.pending_start_providing.insert(id, reply);
                    }
                    Err(e) => {
                        let _ = reply.send(Err(NetworkError::Dht(e.into())));
                    }
                }
            }
            Command::StopProviding { key } => {
                self.swarm.behaviour_mut().kad.stop_providing(&key);
            }
            Command::GetProviders { key, reply } => {
                let id = self.swarm.behaviour_mut().kad.get_providers(key);
                self.pending_providers.insert(id, (HashSet::new(), reply));
            }
            Command::Bootstrap { reply } => match self.swarm.behaviour_mut().kad.bootstrap() {
                Ok(id) => {
                    self.pending_bootstrap.insert(id, reply);
                }
                Err(e) => {
                    let _ = reply.send(Err(NetworkError::Dht(e.into())));
                }
            },
            Command::Subscribe {
                topic,
                capacity,
                reply,
            } => self.subscribe(topic, capacity, reply),
            Command::Publish { topic, data, reply } => {
                let result = self
                    .swarm
                    .behaviour_mut()
                    .gossipsub
                    .publish(gossipsub::IdentTopic::new(topic), data);
                let _ = reply.send(
                    result
                        .map(|_| ())
                        .map_err(|e| NetworkError::Gossip(GossipFailure::Publish(Arc::new(e)))),
                );
            }
            Command::Request {
                peer,
                request,
                reply,
            } => {
                let id = (self.swarm.behaviour_mut().rpc).send_request(&peer, request.clone());
                let pending = PendingRequest {
                    peer,
                    request,
                    reply,
                    _underway: self.in_flight.begin(peer),
                    sent_again: false,
                };
                self.pending_requests.insert(id, pending);
            }
            Command::Respond { channel, response } => {
                // Fails only when the peer gave up waiting; nothing else to do then.
                let _ = self
                    .swarm
                    .behaviour_mut()
                    .rpc
                    .send_response(channel, response);
            }
            Command::SetHealth { healthy, detail } => {
                self.health = (healthy, detail);
            }
            Command::Recheck { store, reply } => {
                let _ = reply.send(self.recheck(&store));
            }
            Command::Shutdown { .. } => unreachable!("handled in run"),
        }
    }

    /// Dials `address` (with or without the peer's id), if this node may reach it; `reply`
    /// hears once the connection is up or failed.
    fn dial(&mut self, address: Multiaddr, reply: Reply<PeerId>) {
        if let Err(why) = self.reach.check(&address) {
            let _ = reply.send(Err(NetworkError::Dial {
                target: address.to_string(),
                reason: why.to_string(),
            }));
            return;
        }
        let opts = match peer_id_of(&address) {
            Some(peer) => DialOpts::peer_id(peer)
                .addresses(vec![address.clone()])
                .condition(PeerCondition::Always)
                .allocate_new_port()
                .build(),
            None => DialOpts::unknown_peer_id()
                .address(address.clone())
                .allocate_new_port()
                .build(),
        };
        let id = opts.connection_id();
        match self.swarm.dial(opts) {
            Ok(()) => {
                self.pending_dials.insert(id, reply);
            }
            Err(e) => {
                let _ = reply.send(Err(NetworkError::Dial {
                    target: address.to_string(),
                    reason: e.to_string(),
                }));
            }
        }
    }

    /// Connects to `peer` however it can be reached: a direct connection, or one through a
    /// relay that a hole punch may still replace (`reply` waits for it).
    fn connect(&mut self, peer: PeerId, reply: Reply<()>) {
        if peer == *self.swarm.local_peer_id() {
            let _ = reply.send(Ok(()));
            return;
        }
        if self.swarm.is_connected(&peer) {
            // Only through a relay, and a hole punch may still come: wait for it.
            if let Some(reply) = self.paths.connect(peer, reply, Instant::now()) {
                let _ = reply.send(Ok(()));
            }
            return;
        }
        let first = !self.pending_connects.contains_key(&peer);
        self.pending_connects
            .entry(peer)
            .or_insert_with(|| PendingConnect {
                stage: ConnectStage::Known,
                failures: Vec::new(),
                unreachable_seen: Vec::new(),
                replies: Vec::new(),
            })
            .replies
            .push(reply);
        if first {
            // A neighbour's private addresses first; then what the behaviours know.
            let neighbour = self.neighbours.get(&peer).cloned().unwrap_or_default();
            let opts = DialOpts::peer_id(peer)
                .addresses(neighbour)
                .extend_addresses_through_behaviour()
                .condition(PeerCondition::DisconnectedAndNotDialing)
                .allocate_new_port()
                .build();
            if let Err(e) = self.swarm.dial(opts) {
                self.connect_failed(peer, e.to_string());
            }
        }
    }

    fn subscribe(
        &mut self,
        topic: String,
        capacity: usize,
        reply: Reply<mpsc::Receiver<GossipMessage>>,
    ) {
        let topic = gossipsub::IdentTopic::new(topic);
        match self.swarm.behaviour_mut().gossipsub.subscribe(&topic) {
            Ok(_) => {
                let (tx, rx) = mpsc::channel(capacity);
                self.subscribers.entry(topic.hash()).or_default().push(tx);
                let _ = reply.send(Ok(rx));
            }
            Err(e) => {
                let failure = GossipFailure::Subscribe(Arc::new(e));
                let _ = reply.send(Err(NetworkError::Gossip(failure)));
            }
        }
    }

    /// Forgets the certificates and NAT observations of peers gone for [`DEPARTED_GRACE`].
    fn forget_departed(&mut self) {
        let gone: Vec<PeerId> = self
            .departed
            .iter()
            .filter(|(_, since)| since.elapsed() >= DEPARTED_GRACE)
            .map(|(peer, _)| *peer)
            .collect();
        for peer in gone {
            self.departed.remove(&peer);
            if !self.swarm.is_connected(&peer) {
                self.peers.remove(&peer);
                self.nat.forget(&peer);
                self.nat_mappings.remove(&peer);
                self.neighbours.remove(&peer);
            }
        }
    }

    fn on_swarm_event(&mut self, event: SwarmEvent<BehaviourEvent>) {
        match event {
            SwarmEvent::NewListenAddr {
                listener_id,
                address,
            } => {
                tracing::info!(%address, "listening");
                self.nat.own_address(&address);
                crate::announce_listen_address(&mut self.swarm, &self.reach, address.clone());
                self.publish_listeners();
                self.on_listener_up(listener_id, &address);
            }
            SwarmEvent::ExpiredListenAddr { address, .. } => {
                tracing::info!(%address, "no longer listening");
                self.swarm.remove_external_address(&address);
                self.nat.forget_address(&address);
                self.publish_listeners();
            }
            SwarmEvent::ConnectionEstablished {
                peer_id,
                connection_id,
                endpoint,
                ..
            } => self.on_connected(peer_id, connection_id, &endpoint),
            SwarmEvent::OutgoingConnectionError {
                connection_id,
                peer_id,
                error,
            } => self.on_dial_failed(connection_id, peer_id, &error),
            SwarmEvent::ConnectionClosed {
                peer_id,
                connection_id,
                num_established,
                ..
            } => {
                self.paths.closed(peer_id, connection_id);
                self.gateway_dials.remove(&connection_id);
                self.dialled_at.remove(&connection_id);
                self.ping_timeouts.remove(&connection_id);
                if num_established == 0 && !self.swarm.is_connected(&peer_id) {
                    // Not at once: the peer's next connection may have passed its handshake
                    // (and recorded its certificate) already, as when the other side closes a
                    // relayed connection a moment before this side's hole-punched one is up.
                    self.departed.insert(peer_id, Instant::now());
                }
            }
            SwarmEvent::IncomingConnectionError {
                send_back_addr,
                error,
                ..
            } => {
                // Peers outside our CA end here, as do dialers that gave up half-way; worth
                // knowing, not an error of ours.
                tracing::info!(remote = %send_back_addr, error = %error, "an incoming connection was not established");
            }
            SwarmEvent::ListenerClosed {
                listener_id,
                reason,
                addresses,
            } => {
                if let Some(gateway) = self.relay_listeners.remove(&listener_id) {
                    tracing::info!(%gateway, ?reason, "relay listener closed; will listen again when the gateway is back");
                } else {
                    tracing::debug!(?addresses, ?reason, "listener closed");
                }
                // Its addresses are announced no more (the swarm reports no expiry for them).
                for address in &addresses {
                    self.swarm.remove_external_address(address);
                    self.nat.forget_address(address);
                }
                self.publish_listeners();
                self.on_listener_closed(listener_id);
            }
            // The relay client confirms a circuit once per reservation (not at renewals).
            SwarmEvent::ExternalAddrConfirmed { address } if crate::reach::is_relayed(&address) => {
                self.provide_again();
            }
            SwarmEvent::Behaviour(event) => self.on_behaviour_event(event),
            _ => {}
        }
    }

    /// A connection is up: the dial or connect waiting on it hears, the path is weighed, a
    /// neighbour's private address is kept, and a gateway is taken as one.
    fn on_connected(
        &mut self,
        peer_id: PeerId,
        connection_id: ConnectionId,
        endpoint: &ConnectedPoint,
    ) {
        tracing::debug!(peer = %peer_id, address = %endpoint.get_remote_address(), "connected");
        self.reach.learn_direct(endpoint.get_remote_address());
        if let Some(reply) = self.pending_dials.remove(&connection_id) {
            let _ = reply.send(Ok(peer_id));
        }
        self.dial_ended(connection_id);
        if let ConnectedPoint::Dialer { address, .. } = endpoint
            && !endpoint.is_relayed()
        {
            self.dialled_at
                .insert(connection_id, (peer_id, address.clone()));
        }
        self.on_connection_path(peer_id, connection_id, endpoint);
        if let Some(addresses) = self.neighbour_dials.remove(&connection_id) {
            tracing::info!(peer = %peer_id, address = %endpoint.get_remote_address(), "reached a peer behind the same NAT on its private address");
            self.neighbours.insert(peer_id, addresses);
        }
        self.ask_if_neighbour(peer_id, endpoint);
        if let ConnectedPoint::Dialer { address, .. } = endpoint
            && self.is_gateway_address(address)
        {
            self.on_gateway_connected(peer_id, address.clone());
        }
    }

    /// A dial failed: its dial or connect hears, unless a DHT lookup still looks for the
    /// peer (whose result decides) or it was a neighbour's private address (the relay still
    /// carries the peer).
    fn on_dial_failed(
        &mut self,
        connection_id: ConnectionId,
        peer_id: Option<PeerId>,
        error: &libp2p::swarm::DialError,
    ) {
        self.dial_ended(connection_id);
        self.gateway_dials.remove(&connection_id);
        if self.neighbour_dials.remove(&connection_id).is_some() {
            // The relay or a hole punch still carries the peer; no connect waits on this.
            tracing::info!(peer = ?peer_id, %error, "a peer behind the same NAT is not reachable on its private addresses");
            return;
        }
        if let Some(reply) = self.pending_dials.remove(&connection_id) {
            let _ = reply.send(Err(NetworkError::Dial {
                target: peer_id.map(|p| p.to_string()).unwrap_or_default(),
                reason: error.to_string(),
            }));
        }
        if let Some(peer) = peer_id {
            // During a lookup the DHT query dials peers itself; its result, not these
            // dials, decides how the connect goes on.
            match self.pending_connects.get_mut(&peer) {
                Some(pending) if pending.stage == ConnectStage::Lookup => {
                    if let libp2p::swarm::DialError::Transport(attempts) = error {
                        let reach = &self.reach;
                        pending.unreachable_seen.extend(attempts.iter().filter_map(
                            |(address, _)| {
                                reach.check(address).err().map(|why| (address.clone(), why))
                            },
                        ));
                    }
                }
                Some(_) => self.connect_failed(peer, error.to_string()),
                None => {}
            }
        }
    }

    fn publish_listeners(&self) {
        self.listening
            .send_replace(self.swarm.listeners().cloned().collect());
    }

    fn on_gateway_connected(&mut self, gateway: PeerId, address: Multiaddr) {
        let roles = self.peers.roles(&gateway).unwrap_or_default();
        if !roles.contains(Role::Gateway) {
            // Configured as a gateway, certified as something else: it is still a peer (and
            // the DHT may use it), but never a relay.
            tracing::warn!(
                peer = %gateway,
                %address,
                %roles,
                "a configured gateway's certificate holds no gateway role; not relaying through it (issue it with `hypha-certutil node --role gateway`)"
            );
            self.swarm
                .behaviour_mut()
                .kad
                .add_address(&gateway, address);
            return;
        }
        self.gateway_peers.insert(gateway, address.clone());
        self.swarm
            .behaviour_mut()
            .kad
            .add_address(&gateway, address.clone());
        if self.relay_circuit && !self.relay_listeners.values().any(|g| *g == gateway) {
            let circuit = circuit_address(&address, gateway);
            match self.swarm.listen_on(circuit.clone()) {
                Ok(id) => {
                    self.relay_listeners.insert(id, gateway);
                }
                Err(e) => {
                    tracing::warn!(address = %circuit, error = %e, "cannot listen through the gateway's relay")
                }
            }
        }
        // A fresh gateway connection is the moment to fill the routing table, and to announce
        // again what this node provides: announcements made while no gateway was reachable
        // only reached the local store.
        let _ = self.swarm.behaviour_mut().kad.bootstrap();
        self.provide_again();
    }

    /// Announces again every key this node provides: a record carries the addresses the
    /// node announced when it was made, and one without any is never handed out (a node
    /// behind a NAT has none until it listens through a relay).
    fn provide_again(&mut self) {
        let kad = &mut self.swarm.behaviour_mut().kad;
        let provided: Vec<kad::RecordKey> = {
            use libp2p::kad::store::RecordStore;
            kad.store_mut().provided().map(|r| r.key.clone()).collect()
        };
        for key in provided {
            let _ = kad.start_providing(key);
        }
    }
}

/// `<gateway transport address>/p2p/<gateway>/p2p-circuit`.
fn circuit_address(gateway_address: &Multiaddr, gateway: PeerId) -> Multiaddr {
    let transport: Multiaddr = gateway_address
        .iter()
        .filter(|p| !matches!(p, Protocol::P2p(_)))
        .collect();
    transport
        .with(Protocol::P2p(gateway))
        .with(Protocol::P2pCircuit)
}

/// The relay of a circuit address (`…/p2p/<relay>/p2p-circuit/…`), if it is one.
fn relay_of(address: &Multiaddr) -> Option<PeerId> {
    let mut relay = None;
    for protocol in address.iter() {
        match protocol {
            Protocol::P2p(peer) => relay = Some(peer),
            Protocol::P2pCircuit => return relay,
            _ => {}
        }
    }
    None
}
