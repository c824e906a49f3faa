//! The protocols every node runs, composed into one libp2p behaviour.

use std::{num::NonZeroU32, time::Duration};

use libp2p::{
    PeerId, StreamProtocol,
    core::{Endpoint, transport::PortUse},
    dcutr, gossipsub, identify,
    identity::Keypair,
    kad, ping, relay, request_response,
    swarm::{
        ConnectionDenied, ConnectionId, FromSwarm, NetworkBehaviour, NewExternalAddrCandidate,
        THandler, THandlerInEvent, THandlerOutEvent, ToSwarm, behaviour::toggle::Toggle,
    },
};

use crate::{Settings, rpc};

/// Kademlia under our own name, so Hypha's DHT never merges with a public libp2p DHT.
pub const KAD_PROTOCOL: StreamProtocol = StreamProtocol::new("/hypha/kad/1.0.0");
/// Identify under our own name.
pub const IDENTIFY_PROTOCOL: &str = "/hypha/id/1.0.0";

/// How long a provider record lives in other nodes' stores without being republished.
pub const PROVIDER_RECORD_TTL: Duration = Duration::from_secs(60 * 60);
/// How often a node republishes the provider records it holds, well inside their TTL.
pub const PROVIDER_PUBLICATION_INTERVAL: Duration = Duration::from_secs(20 * 60);

#[derive(NetworkBehaviour)]
pub(crate) struct Behaviour {
    pub(crate) identify: identify::Behaviour,
    pub(crate) ping: ping::Behaviour,
    pub(crate) kad: kad::Behaviour<kad::store::MemoryStore>,
    pub(crate) gossipsub: gossipsub::Behaviour,
    pub(crate) rpc: request_response::Behaviour<rpc::Codec>,
    pub(crate) streams: libp2p_stream::Behaviour,
    pub(crate) relay_server: Toggle<relay::Behaviour>,
    pub(crate) relay_client: relay::client::Behaviour,
    pub(crate) dcutr: HolePunch,
}

/// A protocol could not be configured (only invalid built-in settings can cause this).
#[derive(Debug, thiserror::Error)]
#[error("cannot configure {protocol}: {message}")]
pub struct BehaviourError {
    protocol: &'static str,
    message: String,
}

impl Behaviour {
    pub(crate) fn new(
        keypair: &Keypair,
        settings: &Settings,
        relay_client: relay::client::Behaviour,
    ) -> Result<Self, BehaviourError> {
        let peer_id = keypair.public().to_peer_id();

        let mut kad_config = kad::Config::new(KAD_PROTOCOL);
        // Routing-table entries are added by the event loop, which filters exclude_cidr.
        kad_config.set_kbucket_inserts(kad::BucketInserts::Manual);
        kad_config.set_provider_record_ttl(Some(PROVIDER_RECORD_TTL));
        kad_config.set_provider_publication_interval(Some(PROVIDER_PUBLICATION_INTERVAL));
        kad_config.set_query_timeout(Duration::from_secs(30));
        // The event loop bootstraps when a gateway connects and then periodically while the
        // routing table has peers; kad's own timer would warn every few minutes on a lone
        // gateway that has nobody to bootstrap from.
        kad_config.set_periodic_bootstrap_interval(None);
        let mut kad =
            kad::Behaviour::with_config(peer_id, kad::store::MemoryStore::new(peer_id), kad_config);
        // Every node answers DHT queries: peers are authenticated by certificate, and networks
        // are small enough that client-only nodes would leave the DHT thin.
        kad.set_mode(Some(kad::Mode::Server));

        let gossipsub_config = gossipsub::ConfigBuilder::default()
            .validation_mode(gossipsub::ValidationMode::Strict)
            .heartbeat_interval(Duration::from_millis(500))
            .max_transmit_size(1024 * 1024)
            .build()
            .map_err(|e| BehaviourError {
                protocol: "gossipsub",
                message: e.to_string(),
            })?;
        let gossipsub = gossipsub::Behaviour::new(
            gossipsub::MessageAuthenticity::Signed(keypair.clone()),
            gossipsub_config,
        )
        .map_err(|e| BehaviourError {
            protocol: "gossipsub",
            message: e.to_string(),
        })?;

        let rpc = request_response::Behaviour::with_codec(
            rpc::Codec::default(),
            [(
                StreamProtocol::new(hypha_messages::RPC_PROTOCOL),
                request_response::ProtocolSupport::Full,
            )],
            request_response::Config::default().with_request_timeout(Duration::from_secs(30)),
        );

        let relay_server = settings.relay_server.then(|| {
            relay::Behaviour::new(peer_id, relay_server_config(settings.peer_bytes_per_second))
        });

        Ok(Behaviour {
            identify: identify::Behaviour::new(
                // Only announced addresses go out (`announce_listen_address`): a listener on
                // 0.0.0.0 would otherwise tell every peer its 127.0.0.1.
                identify::Config::new(IDENTIFY_PROTOCOL.into(), keypair.public())
                    .with_hide_listen_addrs(true)
                    .with_agent_version(format!(
                        "hypha-{}/{}",
                        settings.kind,
                        env!("CARGO_PKG_VERSION")
                    )),
            ),
            ping: ping::Behaviour::default(),
            kad,
            gossipsub,
            rpc,
            streams: libp2p_stream::Behaviour::new(),
            relay_server: relay_server.into(),
            relay_client,
            dcutr: HolePunch {
                inner: dcutr::Behaviour::new(peer_id),
            },
        })
    }
}

/// How long a relay circuit lasts; its peers open another when they still need one.
const CIRCUIT_DURATION: Duration = Duration::from_secs(60 * 60);

/// Relay limits for gateways, each peer's connection carrying at most `peer_rate` bytes a
/// second each way ([`link_share`](crate::link_share)).
///
/// libp2p's defaults are meant for anonymous public relays (two minutes and 128 KiB per circuit,
/// one reservation per IP a minute), which makes relayed data transfer impossible and breaks
/// several nodes behind one address. Here every peer is authenticated by certificate, so limits
/// are per peer and generous: circuits last an hour and carry at most what the peer's share of
/// the link passes in it (unbounded without one), and a peer may hold a few reservations and 16
/// circuits.
fn relay_server_config(peer_rate: Option<u64>) -> relay::Config {
    let per_minute = NonZeroU32::new(60).unwrap_or(NonZeroU32::MIN);
    let circuit_bytes = peer_rate.map_or(0, |rate| rate.saturating_mul(CIRCUIT_DURATION.as_secs()));
    relay::Config {
        max_reservations: 1024,
        max_reservations_per_peer: 4,
        reservation_duration: Duration::from_secs(60 * 60),
        reservation_rate_limiters: Vec::new(),
        max_circuits: 1024,
        max_circuits_per_peer: 16,
        max_circuit_duration: CIRCUIT_DURATION,
        max_circuit_bytes: circuit_bytes,
        circuit_src_rate_limiters: Vec::new(),
    }
    .reservation_rate_per_peer(per_minute, Duration::from_secs(60))
    .circuit_src_per_peer(per_minute, Duration::from_secs(60))
}

/// DCUtR, told this node's public addresses by the event loop alone: those a gateway saw a
/// dial of this node leave its NAT from, on the listen port it left from
/// ([`nat`](crate::nat)), while its listeners are settled.
///
/// Identify offers every behaviour a guess for each observation on another port: the observed
/// address with the listen port in place of the observed one. Behind a NAT shared with a
/// machine on the same listen port that guess is the other machine's address, and a hole punch
/// aimed at it reaches the wrong machine; a node that moves to a fresh port
/// ([`port_move`](crate::port_move)) would keep offering it. So candidates from the swarm are
/// dropped, and [`HolePunch::observed_at`] hands DCUtR those that hold. DCUtR keeps its 20
/// latest candidates and cannot forget one, and a relayed connection punches with the
/// candidates it had when it was made: hence none while a move is under way.
pub(crate) struct HolePunch {
    inner: dcutr::Behaviour,
}

impl HolePunch {
    /// A gateway saw this node at `address`, leaving from a listen port: peers may punch to it.
    pub(crate) fn observed_at(&mut self, address: &libp2p::Multiaddr) {
        self.inner
            .on_swarm_event(FromSwarm::NewExternalAddrCandidate(
                NewExternalAddrCandidate { addr: address },
            ));
    }
}

impl NetworkBehaviour for HolePunch {
    type ConnectionHandler = <dcutr::Behaviour as NetworkBehaviour>::ConnectionHandler;
    type ToSwarm = dcutr::Event;

    fn handle_pending_inbound_connection(
        &mut self,
        connection_id: ConnectionId,
        local_addr: &libp2p::Multiaddr,
        remote_addr: &libp2p::Multiaddr,
    ) -> Result<(), ConnectionDenied> {
        self.inner
            .handle_pending_inbound_connection(connection_id, local_addr, remote_addr)
    }

    fn handle_established_inbound_connection(
        &mut self,
        connection_id: ConnectionId,
        peer: PeerId,
        local_addr: &libp2p::Multiaddr,
        remote_addr: &libp2p::Multiaddr,
    ) -> Result<THandler<Self>, ConnectionDenied> {
        self.inner.handle_established_inbound_connection(
            connection_id,
            peer,
            local_addr,
            remote_addr,
        )
    }

    fn handle_pending_outbound_connection(
        &mut self,
        connection_id: ConnectionId,
        maybe_peer: Option<PeerId>,
        addresses: &[libp2p::Multiaddr],
        effective_role: Endpoint,
    ) -> Result<Vec<libp2p::Multiaddr>, ConnectionDenied> {
        self.inner.handle_pending_outbound_connection(
            connection_id,
            maybe_peer,
            addresses,
            effective_role,
        )
    }

    fn handle_established_outbound_connection(
        &mut self,
        connection_id: ConnectionId,
        peer: PeerId,
        addr: &libp2p::Multiaddr,
        role_override: Endpoint,
        port_use: PortUse,
    ) -> Result<THandler<Self>, ConnectionDenied> {
        self.inner.handle_established_outbound_connection(
            connection_id,
            peer,
            addr,
            role_override,
            port_use,
        )
    }

    fn on_swarm_event(&mut self, event: FromSwarm) {
        if !matches!(event, FromSwarm::NewExternalAddrCandidate(_)) {
            self.inner.on_swarm_event(event);
        }
    }

    fn on_connection_handler_event(
        &mut self,
        peer_id: PeerId,
        connection_id: ConnectionId,
        event: THandlerOutEvent<Self>,
    ) {
        self.inner
            .on_connection_handler_event(peer_id, connection_id, event);
    }

    fn poll(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<ToSwarm<Self::ToSwarm, THandlerInEvent<Self>>> {
        self.inner.poll(cx)
    }
}

/// The peer id in a multiaddr's trailing `/p2p/…`, if any.
pub(crate) fn peer_id_of(addr: &libp2p::Multiaddr) -> Option<PeerId> {
    addr.iter().last().and_then(|p| match p {
        libp2p::multiaddr::Protocol::P2p(peer) => Some(peer),
        _ => None,
    })
}
