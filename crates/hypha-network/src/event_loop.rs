//! The actor that owns the swarm.
//!
//! It reacts to two sources only: swarm events and commands from [`Network`](crate::Network)
//! handles. It never awaits anything else, so no slow consumer can stall it: everything it hands
//! out goes through bounded queues with `try_send`, and the policy when a queue is full is part
//! of each queue's documentation (gossip: drop the message; inbound requests: answer `Busy`).

use std::{
    collections::{HashMap, HashSet},
    time::{Duration, Instant},
};

use futures::StreamExt;
use hypha_certs::Role;
use hypha_messages::{Envelope, ErrorCode, Request, Response, health};
use libp2p::{
    Multiaddr, PeerId, Swarm,
    core::ConnectedPoint,
    dcutr, gossipsub, identify, kad,
    multiaddr::Protocol,
    ping, relay, request_response,
    swarm::{
        ConnectionId, SwarmEvent,
        dial_opts::{DialOpts, PeerCondition},
    },
};
use tokio::sync::mpsc;

use crate::{
    Settings,
    behaviour::{Behaviour, BehaviourEvent, KAD_PROTOCOL, peer_id_of},
    certified::{CertifiedPeers, required_role},
    client::{Command, GossipMessage, InboundRequest, NetworkError, Responder},
    nat::NatBelief,
    paths::{Established, Kind, PUNCH_WINDOW, Paths, StaysRelayed},
    reach::{Reach, Unreachable, is_relayed},
};

type Reply<T> = tokio::sync::oneshot::Sender<Result<T, NetworkError>>;

/// How often gateways that dropped are redialled.
const GATEWAY_RETRY: Duration = Duration::from_secs(5);
/// How often the routing table is refreshed while it has peers.
const BOOTSTRAP_INTERVAL: Duration = Duration::from_secs(5 * 60);
/// How often windows for a direct connection ([`PUNCH_WINDOW`]) are checked for their end.
const PUNCH_WINDOW_CHECK: Duration = Duration::from_millis(250);
/// Ping timeouts in a row after which a connection is closed as dead.
const PING_TIMEOUTS_TO_CLOSE: u32 = 2;
/// How long a peer's certificate is kept after its last connection closed.
const DEPARTED_GRACE: Duration = Duration::from_secs(5);

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

    health: (bool, String),
    /// Connected gateways and the address each was reached at (relay circuits are built on it).
    gateway_peers: HashMap<PeerId, Multiaddr>,
    relay_listeners: HashMap<libp2p::core::transport::ListenerId, PeerId>,
    pending_dials: HashMap<ConnectionId, Reply<PeerId>>,
    pending_connects: HashMap<PeerId, PendingConnect>,
    pending_lookups: HashMap<kad::QueryId, PeerId>,
    pending_requests: HashMap<request_response::OutboundRequestId, (PeerId, Reply<Response>)>,
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
}

/// Reaching a peer: the addresses already known, then the addresses the DHT knows, then each
/// connected gateway's relay. Each stage's failure is kept for the final error.
#[derive(Debug)]
struct PendingConnect {
    stage: ConnectStage,
    failures: Vec<String>,
    /// Addresses of the peer that the DHT lookup came across but [`Reach`] refused, and why.
    unreachable_seen: Vec<(Multiaddr, Unreachable)>,
    replies: Vec<Reply<()>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ConnectStage {
    Known,
    Lookup,
    LookedUp,
    Relayed,
}

impl ConnectStage {
    fn describe(self) -> &'static str {
        match self {
            ConnectStage::Known => "known addresses",
            ConnectStage::Lookup => "DHT lookup",
            ConnectStage::LookedUp => "addresses from the DHT",
            ConnectStage::Relayed => "through a gateway relay",
        }
    }
}

impl EventLoop {
    /// The loop for `swarm`, taking commands from `commands` (whose sender it lends to
    /// responders) and handing requests to `inbound`.
    pub(crate) fn new(
        swarm: Swarm<Behaviour>,
        commands: (mpsc::WeakSender<Command>, mpsc::Receiver<Command>),
        inbound: mpsc::Sender<InboundRequest>,
        settings: Settings,
        peers: CertifiedPeers,
        reach: Reach,
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
            health: (true, "running".into()),
            gateway_peers: HashMap::new(),
            relay_listeners: HashMap::new(),
            pending_dials: HashMap::new(),
            pending_connects: HashMap::new(),
            pending_lookups: HashMap::new(),
            pending_requests: HashMap::new(),
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
            departed: HashMap::new(),
            nat_mappings: HashMap::new(),
            dialled_at: HashMap::new(),
            ping_timeouts: HashMap::new(),
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
                    started.push(id);
                }
                Err(e) => tracing::debug!(%address, error = %e, "cannot dial gateway"),
            }
        }
        started
    }

    /// Notes that a dial ended; completes start-up when it was the last first gateway dial.
    fn dial_ended(&mut self, id: ConnectionId) {
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
            Command::Dial { address, reply } => {
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
            Command::Connect { peer, reply } => {
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
                    let opts = DialOpts::peer_id(peer)
                        .condition(PeerCondition::DisconnectedAndNotDialing)
                        .allocate_new_port()
                        .build();
                    if let Err(e) = self.swarm.dial(opts) {
                        self.connect_failed(peer, e.to_string());
                    }
                }
            }
            Command::AddAddress { peer, address } => {
                if self.reach.worth_keeping(&address) {
                    self.swarm
                        .behaviour_mut()
                        .kad
                        .add_address(&peer, address.clone());
                    self.swarm.add_peer_address(peer, address);
                }
            }
            Command::ListenAddresses { reply } => {
                let _ = reply.send(self.swarm.listeners().cloned().collect());
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
                        let _ = reply.send(Err(NetworkError::Dht(e.to_string())));
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
                    let _ = reply.send(Err(NetworkError::Dht(e.to_string())));
                }
            },
            Command::Subscribe {
                topic,
                capacity,
                reply,
            } => {
                let topic = gossipsub::IdentTopic::new(topic);
                match self.swarm.behaviour_mut().gossipsub.subscribe(&topic) {
                    Ok(_) => {
                        let (tx, rx) = mpsc::channel(capacity);
                        self.subscribers.entry(topic.hash()).or_default().push(tx);
                        let _ = reply.send(Ok(rx));
                    }
                    Err(e) => {
                        let _ = reply.send(Err(NetworkError::Gossip(e.to_string())));
                    }
                }
            }
            Command::Publish { topic, data, reply } => {
                let result = self
                    .swarm
                    .behaviour_mut()
                    .gossipsub
                    .publish(gossipsub::IdentTopic::new(topic), data);
                let _ = reply.send(
                    result
                        .map(|_| ())
                        .map_err(|e| NetworkError::Gossip(e.to_string())),
                );
            }
            Command::Request {
                peer,
                request,
                reply,
            } => {
                let id = self.swarm.behaviour_mut().rpc.send_request(&peer, request);
                self.pending_requests.insert(id, (peer, reply));
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

    /// Disconnects every connected peer whose chain `store` refuses now (revoked, expired),
    /// returning them with the reason.
    fn recheck(
        &mut self,
        store: &hypha_certs::TrustStore,
    ) -> Vec<(PeerId, hypha_certs::Rejection)> {
        let now = hypha_certs::now();
        let mut refused = Vec::new();
        for (peer, certificate) in self.peers.snapshot() {
            if let Err(rejection) = store.verify_peer(&certificate.chain, now) {
                tracing::warn!(%peer, %rejection, "closing the connections of a peer whose certificate is no longer accepted");
                self.peers.remove(&peer);
                let _ = self.swarm.disconnect_peer_id(peer);
                refused.push((peer, rejection));
            }
        }
        refused
    }

    /// The current stage of reaching `peer` failed; move on to the next one.
    fn connect_failed(&mut self, peer: PeerId, reason: String) {
        let Some(pending) = self.pending_connects.get_mut(&peer) else {
            return;
        };
        pending
            .failures
            .push(format!("{}: {reason}", pending.stage.describe()));
        match pending.stage {
            ConnectStage::Known => {
                pending.stage = ConnectStage::Lookup;
                let query = self.swarm.behaviour_mut().kad.get_closest_peers(peer);
                self.pending_lookups.insert(query, peer);
            }
            ConnectStage::Lookup | ConnectStage::LookedUp => {
                pending.stage = ConnectStage::Relayed;
                let circuits: Vec<Multiaddr> = self
                    .gateway_peers
                    .iter()
                    .filter(|(g, _)| self.swarm.is_connected(g))
                    .map(|(g, address)| circuit_address(address, *g).with(Protocol::P2p(peer)))
                    .collect();
                if circuits.is_empty() {
                    return self.connect_failed(peer, "no gateway is connected".into());
                }
                self.dial_for_connect(peer, circuits);
            }
            ConnectStage::Relayed => {
                let reason = pending.failures.join("; ");
                self.finish_connect(peer, Err(reason));
            }
        }
    }

    /// The DHT lookup for a peer we are connecting to has finished.
    fn on_lookup_done(&mut self, query: kad::QueryId, peers: Vec<kad::PeerInfo>) {
        let Some(peer) = self.pending_lookups.remove(&query) else {
            return;
        };
        // Only gateways relay: a circuit through any other peer is not dialled.
        let mut usable = Vec::new();
        let mut unreachable = Vec::new();
        for address in peers
            .into_iter()
            .filter(|info| info.peer_id == peer)
            .flat_map(|info| info.addrs)
            .filter(|address| relay_of(address).is_none_or(|r| self.gateway_peers.contains_key(&r)))
        {
            match self.reach.check(&address) {
                Ok(()) => usable.push(address),
                Err(why) => unreachable.push((address, why)),
            }
        }
        if let Some(pending) = self.pending_connects.get_mut(&peer) {
            unreachable.append(&mut pending.unreachable_seen);
        }
        if usable.is_empty() {
            let reason = if unreachable.is_empty() {
                "the DHT knows no address".to_string()
            } else {
                let list: Vec<String> = unreachable
                    .iter()
                    .map(|(address, why)| format!("{address}: {why}"))
                    .collect();
                format!(
                    "no address the DHT knows leads there from here ({})",
                    list.join("; ")
                )
            };
            return self.connect_failed(peer, reason);
        }
        if let Some(pending) = self.pending_connects.get_mut(&peer) {
            pending.stage = ConnectStage::LookedUp;
        }
        self.dial_for_connect(peer, usable);
    }

    /// Dials `peer` at `addresses` for the current stage of a pending connect.
    ///
    /// Dials of connects, like those of the application, leave from a new port: only gateway
    /// dials and DCUtR's reuse the listen port (the NAT mapping of the one is what the other
    /// punches through). Two peers that dial each other at the same moment from their listen
    /// ports would otherwise meet in one TCP simultaneous open, both as TLS clients.
    fn dial_for_connect(&mut self, peer: PeerId, addresses: Vec<Multiaddr>) {
        let opts = DialOpts::peer_id(peer)
            .addresses(addresses)
            .condition(PeerCondition::Always)
            .allocate_new_port()
            .build();
        if let Err(e) = self.swarm.dial(opts) {
            self.connect_failed(peer, e.to_string());
        }
    }

    fn finish_connect(&mut self, peer: PeerId, result: Result<(), String>) {
        if let Some(pending) = self.pending_connects.remove(&peer) {
            for reply in pending.replies {
                let _ = reply.send(result.clone().map_err(|reason| NetworkError::Dial {
                    target: peer.to_string(),
                    reason,
                }));
            }
        }
    }

    /// Connection `id` to `peer` came up: the connects waiting for the peer go on, unless it is
    /// only relayed and a hole punch may still come; a direct connection closes the relayed
    /// ones.
    fn on_connection_path(&mut self, peer: PeerId, id: ConnectionId, endpoint: &ConnectedPoint) {
        let waiting = self
            .pending_connects
            .remove(&peer)
            .map(|pending| pending.replies)
            .unwrap_or_default();
        let kind = if endpoint.is_relayed() {
            let local = *self.swarm.local_peer_id();
            let dialler_is_local = endpoint.is_dialer();
            Kind::Relayed {
                dialled_by_smaller_id: if dialler_is_local {
                    local < peer
                } else {
                    peer < local
                },
            }
        } else {
            Kind::Direct
        };
        let (close, waiting, after_relay) = match self.paths.established(
            peer,
            id,
            kind,
            waiting,
            Instant::now(),
        ) {
            Established::Wait { close } => {
                tracing::debug!(%peer, duplicates = close.len(), "reached through a relay; waiting for a direct connection");
                for connection in close {
                    self.swarm.close_connection(connection);
                }
                return;
            }
            Established::Direct {
                close,
                waiting,
                after_relay,
            } => (close, waiting, after_relay),
        };
        if let Some(after) = after_relay {
            tracing::info!(%peer, after_ms = after.as_millis(), "a direct connection replaces the relayed one");
            // Kademlia files the address a connection was dialled at under the peer; after a
            // relay that is the peer's NAT mapping, which takes no connection but this one.
            // Handed out by the DHT it would make third peers dial it as TLS clients while the
            // peer's own DCUtR dial is a client too.
            // Kademlia files it again when its protocol is confirmed on the connection: it is
            // remembered, and taken out each time (`RoutingUpdated`).
            if let ConnectedPoint::Dialer { address, .. } = endpoint {
                self.swarm
                    .behaviour_mut()
                    .kad
                    .remove_address(&peer, address);
                self.nat_mappings
                    .entry(peer)
                    .or_default()
                    .insert(address.clone());
            }
        }
        for connection in close {
            self.swarm.close_connection(connection);
        }
        for reply in waiting {
            let _ = reply.send(Ok(()));
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
            }
        }
    }

    /// Connects whose window for a direct connection closed go on through the relay, and
    /// relayed connections whose drain is over close.
    fn end_punch_windows(&mut self) {
        let expired = self.paths.expire(Instant::now());
        for connection in expired.close {
            self.swarm.close_connection(connection);
        }
        for ended in expired.stay_relayed {
            self.stays_relayed(ended);
        }
    }

    /// No direct connection to a peer will come: its waiting connects go on through the
    /// relay, if it is still connected at all.
    fn stays_relayed(&mut self, ended: StaysRelayed<Reply<()>>) {
        let peer = ended.peer;
        if !self.swarm.is_connected(&peer) {
            tracing::debug!(%peer, "the peer left while waiting for a direct connection");
            for reply in ended.waiting {
                let _ = reply.send(Err(NetworkError::Dial {
                    target: peer.to_string(),
                    reason: "the relayed connection closed before a direct one came".into(),
                }));
            }
            return;
        }
        match &ended.failure {
            Some(failure) => {
                tracing::info!(%peer, %failure, "no direct connection (hole punching failed); this peer's traffic goes through the gateway's relay")
            }
            None => {
                tracing::info!(%peer, window = ?PUNCH_WINDOW, "no direct connection within the window; this peer's traffic goes through the gateway's relay")
            }
        }
        for reply in ended.waiting {
            let _ = reply.send(Ok(()));
        }
    }

    fn on_swarm_event(&mut self, event: SwarmEvent<BehaviourEvent>) {
        match event {
            SwarmEvent::NewListenAddr { address, .. } => {
                tracing::info!(%address, "listening");
                self.nat.own_address(&address);
                crate::announce_listen_address(&mut self.swarm, &self.reach, address);
            }
            SwarmEvent::ExpiredListenAddr { address, .. } => {
                tracing::info!(%address, "no longer listening");
                self.swarm.remove_external_address(&address);
            }
            SwarmEvent::ConnectionEstablished {
                peer_id,
                connection_id,
                endpoint,
                ..
            } => {
                tracing::debug!(peer = %peer_id, address = %endpoint.get_remote_address(), "connected");
                self.reach.learn_direct(endpoint.get_remote_address());
                if let Some(reply) = self.pending_dials.remove(&connection_id) {
                    let _ = reply.send(Ok(peer_id));
                }
                self.dial_ended(connection_id);
                if let ConnectedPoint::Dialer { address, .. } = &endpoint
                    && !endpoint.is_relayed()
                {
                    self.dialled_at
                        .insert(connection_id, (peer_id, address.clone()));
                }
                self.on_connection_path(peer_id, connection_id, &endpoint);
                if let ConnectedPoint::Dialer { address, .. } = &endpoint
                    && self.is_gateway_address(address)
                {
                    self.on_gateway_connected(peer_id, address.clone());
                }
            }
            SwarmEvent::OutgoingConnectionError {
                connection_id,
                peer_id,
                error,
            } => {
                self.dial_ended(connection_id);
                self.gateway_dials.remove(&connection_id);
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
                            if let libp2p::swarm::DialError::Transport(attempts) = &error {
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
            }
            SwarmEvent::Behaviour(event) => self.on_behaviour_event(event),
            _ => {}
        }
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
        let kad = &mut self.swarm.behaviour_mut().kad;
        let _ = kad.bootstrap();
        let provided: Vec<kad::RecordKey> = {
            use libp2p::kad::store::RecordStore;
            kad.store_mut().provided().map(|r| r.key.clone()).collect()
        };
        for key in provided {
            let _ = kad.start_providing(key);
        }
    }

    fn on_behaviour_event(&mut self, event: BehaviourEvent) {
        match event {
            BehaviourEvent::Identify(identify::Event::Received {
                peer_id,
                info,
                connection_id,
            }) => {
                let by_gateway = self
                    .peers
                    .roles(&peer_id)
                    .is_some_and(|roles| roles.contains(Role::Gateway));
                if by_gateway
                    && self.gateway_dials.contains(&connection_id)
                    && let Some(belief) = self.nat.observed(peer_id, &info.observed_addr)
                {
                    tracing::info!(nat = %belief, observer = %peer_id, observed = %info.observed_addr, "what this node believes of its NAT changed");
                }
                if !info.protocols.contains(&KAD_PROTOCOL) {
                    return;
                }
                for address in info.listen_addrs {
                    if !self.reach.worth_keeping(&address) || is_relayed(&address) {
                        continue;
                    }
                    self.swarm
                        .behaviour_mut()
                        .kad
                        .add_address(&peer_id, address);
                }
            }
            BehaviourEvent::Kad(event) => self.on_kad_event(event),
            BehaviourEvent::Gossipsub(gossipsub::Event::Message { message, .. }) => {
                self.on_gossip(message);
            }
            BehaviourEvent::Rpc(event) => self.on_rpc_event(event),
            // A connection that stops answering pings is closed, so that the next connect finds
            // another way (a hole-punched path whose NAT mapping lapsed, a router that
            // rebooted): TCP alone would hold it for many minutes. Two timeouts in a row (20 s
            // each), so that one slow answer on a loaded link does not cut a transfer.
            BehaviourEvent::Ping(ping::Event {
                peer,
                connection,
                result,
            }) => match result {
                Err(ping::Failure::Timeout) => {
                    let timeouts = self.ping_timeouts.entry(connection).or_default();
                    *timeouts += 1;
                    if *timeouts >= PING_TIMEOUTS_TO_CLOSE {
                        tracing::info!(%peer, "a connection stopped answering pings; closing it");
                        self.swarm.close_connection(connection);
                    }
                }
                Err(_) => {}
                Ok(_) => {
                    self.ping_timeouts.remove(&connection);
                }
            },
            BehaviourEvent::Dcutr(dcutr::Event {
                remote_peer_id,
                result,
            }) => match result {
                Ok(connection) => {
                    tracing::info!(peer = %remote_peer_id, "hole punched: a direct connection through the NATs");
                    self.paths.hole_punched(remote_peer_id);
                    // Kademlia filed the address this connection was dialled at under the
                    // peer: its NAT mapping, which takes no connection but this one. Handed out
                    // by the DHT it would make third peers dial it as TLS clients while the
                    // peer's own DCUtR dial is a client too. It is taken out now and each
                    // time Kademlia files it again (`RoutingUpdated`).
                    if let Some((peer, address)) = self.dialled_at.get(&connection).cloned() {
                        self.swarm
                            .behaviour_mut()
                            .kad
                            .remove_address(&peer, &address);
                        self.nat_mappings.entry(peer).or_default().insert(address);
                    }
                }
                Err(error) => {
                    // The inner error is not a `source()`; its Debug form names the cause.
                    let failure = format!("{error} ({error:?})");
                    tracing::info!(peer = %remote_peer_id, %failure, "hole punch failed");
                    if let Some(ended) = self.paths.punch_failed(remote_peer_id, failure) {
                        self.stays_relayed(ended);
                    }
                }
            },
            BehaviourEvent::RelayClient(relay::client::Event::ReservationReqAccepted {
                relay_peer_id,
                renewal: false,
                ..
            }) => {
                tracing::info!(relay = %relay_peer_id, "reachable through the gateway's relay");
            }
            _ => {}
        }
    }

    fn on_kad_event(&mut self, event: kad::Event) {
        match event {
            kad::Event::RoutingUpdated {
                peer, addresses, ..
            } => {
                if let Some(mappings) = self.nat_mappings.get(&peer) {
                    for address in addresses.iter().filter(|a| mappings.contains(*a)) {
                        self.swarm
                            .behaviour_mut()
                            .kad
                            .remove_address(&peer, address);
                    }
                }
            }
            // Not `RoutablePeer`: its address is the one a connection was dialled at, which for
            // a hole-punched connection is the peer's NAT mapping. That takes no connection but
            // the punched one, and handed out by the DHT it makes third peers dial it as
            // clients while the peer's own DCUtR dial is a client too (a simultaneous open
            // with two TLS clients). Peers enter the routing table with what they announce
            // (identify) and gateways with the address they were configured at.
            kad::Event::OutboundQueryProgressed {
                id, result, step, ..
            } => match result {
                kad::QueryResult::GetProviders(Ok(kad::GetProvidersOk::FoundProviders {
                    providers,
                    ..
                })) => {
                    if let Some((found, _)) = self.pending_providers.get_mut(&id) {
                        found.extend(providers);
                    }
                    if step.last {
                        self.finish_providers(id);
                    }
                }
                kad::QueryResult::GetProviders(_) => {
                    // Finished (possibly timed out): report what was found.
                    self.finish_providers(id);
                }
                kad::QueryResult::StartProviding(result) => {
                    if let Some(reply) = self.pending_start_providing.remove(&id) {
                        let _ = reply.send(
                            result
                                .map(|_| ())
                                .map_err(|e| NetworkError::Dht(e.to_string())),
                        );
                    }
                }
                kad::QueryResult::GetClosestPeers(result) => {
                    let peers = match result {
                        Ok(ok) => ok.peers,
                        Err(kad::GetClosestPeersError::Timeout { peers, .. }) => peers,
                    };
                    self.on_lookup_done(id, peers);
                }
                kad::QueryResult::Bootstrap(result) if step.last || result.is_err() => {
                    if let Some(reply) = self.pending_bootstrap.remove(&id) {
                        let _ = reply.send(
                            result
                                .map(|_| ())
                                .map_err(|e| NetworkError::Dht(e.to_string())),
                        );
                    }
                }
                _ => {}
            },
            _ => {}
        }
    }

    fn finish_providers(&mut self, id: kad::QueryId) {
        if let Some((found, reply)) = self.pending_providers.remove(&id) {
            let _ = reply.send(Ok(found));
            // Stop the query: it would otherwise keep walking the DHT for more providers.
            if let Some(mut query) = self.swarm.behaviour_mut().kad.query_mut(&id) {
                query.finish();
            }
        }
    }

    fn on_gossip(&mut self, message: gossipsub::Message) {
        let Some(subscribers) = self.subscribers.get_mut(&message.topic) else {
            return;
        };
        subscribers.retain(|s| !s.is_closed());
        for subscriber in subscribers.iter() {
            let delivered = subscriber.try_send(GossipMessage {
                source: message.source,
                topic: message.topic.to_string(),
                data: message.data.clone(),
            });
            if delivered.is_err() {
                self.gossip_dropped += 1;
                let now = Instant::now();
                if self
                    .last_drop_warning
                    .is_none_or(|t| now.duration_since(t) > Duration::from_secs(10))
                {
                    self.last_drop_warning = Some(now);
                    tracing::warn!(
                        topic = %message.topic,
                        dropped_total = self.gossip_dropped,
                        "a gossip subscriber is not keeping up; dropping messages for it"
                    );
                }
            }
        }
        if subscribers.is_empty() {
            let topic = message.topic.clone();
            self.subscribers.remove(&topic);
            self.swarm
                .behaviour_mut()
                .gossipsub
                .unsubscribe(&gossipsub::IdentTopic::new(topic.into_string()));
        }
    }

    fn on_rpc_event(
        &mut self,
        event: request_response::Event<Envelope<Request>, Envelope<Response>>,
    ) {
        match event {
            request_response::Event::Message { peer, message, .. } => match message {
                request_response::Message::Request {
                    request, channel, ..
                } => self.on_inbound_request(peer, request, channel),
                request_response::Message::Response {
                    request_id,
                    response,
                } => {
                    if let Some((_, reply)) = self.pending_requests.remove(&request_id) {
                        let _ = reply.send(Ok(response.body));
                    }
                }
            },
            request_response::Event::OutboundFailure {
                request_id, error, ..
            } => {
                if let Some((peer, reply)) = self.pending_requests.remove(&request_id) {
                    let _ = reply.send(Err(NetworkError::Request {
                        peer,
                        failure: error.into(),
                    }));
                }
            }
            request_response::Event::InboundFailure { peer, error, .. } => {
                tracing::debug!(%peer, %error, "an inbound request failed");
            }
            request_response::Event::ResponseSent { .. } => {}
        }
    }

    fn on_inbound_request(
        &mut self,
        peer: PeerId,
        request: Envelope<Request>,
        channel: request_response::ResponseChannel<Envelope<Response>>,
    ) {
        // The kind only: a body can hold a job's secrets, and spans are exported.
        let span = tracing::info_span!("rpc", %peer, request = request.body.kind());
        hypha_telemetry::propagation::set_parent(&span, &request.trace);
        let _entered = span.enter();
        let answer = |this: &mut Self, channel, response| {
            let trace = hypha_telemetry::propagation::inject(&tracing::Span::current());
            let _ = this
                .swarm
                .behaviour_mut()
                .rpc
                .send_response(channel, Envelope::new(response, trace));
        };
        if let Some(role) = required_role(&request.body) {
            let held = self.peers.roles(&peer).unwrap_or_default();
            if !held.contains(role) {
                tracing::info!(%role, %held, "refused a request its sender's certificate does not allow");
                let message = format!(
                    "a {} request needs the {role} role, and your certificate holds {held}; have it issued with `hypha-certutil node --role {role}`",
                    request.body.kind()
                );
                answer(
                    self,
                    channel,
                    Response::Error(hypha_messages::Error::new(ErrorCode::Forbidden, message)),
                );
                return;
            }
        }
        match request.body {
            Request::Health => {
                let status = health::Status {
                    kind: self.kind.clone(),
                    version: env!("CARGO_PKG_VERSION").to_string(),
                    healthy: self.health.0,
                    detail: self.health.1.clone(),
                    uptime_secs: self.started.elapsed().as_secs(),
                    connected_peers: u32::try_from(self.swarm.connected_peers().count())
                        .unwrap_or(u32::MAX),
                    nat: self.nat.belief().to_string(),
                    paths: self
                        .paths
                        .all()
                        .into_iter()
                        .take(health::MAX_PATHS)
                        .map(|(peer, path)| health::PeerPath {
                            peer: peer.to_string(),
                            path: path.to_string(),
                        })
                        .collect(),
                };
                answer(self, channel, Response::Health(Box::new(status)));
            }
            body => {
                let Some(commands) = self.command_sender.upgrade() else {
                    return;
                };
                let inbound = InboundRequest {
                    peer,
                    request: body,
                    trace: request.trace,
                    responder: Responder::new(channel, commands),
                };
                if let Err(e) = self.inbound.try_send(inbound) {
                    let (code, message, inbound) = match e {
                        mpsc::error::TrySendError::Full(i) => (
                            ErrorCode::Busy,
                            "the node is overloaded; try again later",
                            i,
                        ),
                        mpsc::error::TrySendError::Closed(i) => (
                            ErrorCode::Unsupported,
                            "this node does not serve that request",
                            i,
                        ),
                    };
                    let mut responder = inbound.responder;
                    if let Some(channel) = responder.take_channel() {
                        answer(
                            self,
                            channel,
                            Response::Error(hypha_messages::Error {
                                code,
                                message: message.into(),
                            }),
                        );
                    }
                }
            }
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
