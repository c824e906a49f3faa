//! Hypha's network: libp2p over mutual TLS.
//!
//! Every node runs the same stack, built by [`start`]:
//!
//! - **Transport**: TCP (and relay circuits) → [`address_filter`] (`exclude_cidr`) → DNS →
//!   [`tls`], our mutual-TLS security upgrade (both sides verify the other's chain; the
//!   [`PeerId`](libp2p::PeerId) is the certificate's Ed25519 key) → [`muxer`], yamux with large
//!   frames.
//! - **Protocols** ([`behaviour`]): identify, ping, Kademlia (provider records), gossipsub
//!   (signed), request-response (CBOR [`hypha_messages`] envelopes), `libp2p-stream` for bulk
//!   bytes, relay client + DCUtR, and a relay server on gateways.
//! - **Handle**: [`Network`] is a cloneable handle with typed async methods; an event loop owns
//!   the swarm and never blocks on a consumer (see [`event_loop`](crate::event_loop) for the
//!   policies of its bounded queues). Inbound requests other than health arrive on the
//!   [`InboundRequest`] receiver returned by [`start`].
//!
//! This crate knows nothing of config files, datasets, jobs or training: nodes build a
//! [`Settings`] and use the handle.

pub mod address_filter;
pub mod behaviour;
pub mod certified;
mod client;
pub mod dial_budget;
mod event_loop;
pub mod frame;
mod in_flight;
pub mod link_share;
pub mod muxer;
pub mod nat;
pub mod neighbours;
pub mod paths;
pub mod port_move;
pub mod rate;
pub mod reach;
pub mod rpc;
mod settings;
pub mod shares;
pub mod tls;

use std::time::Duration;

pub use address_filter::ExcludedRanges;
use certified::CertifiedPeers;
pub use client::{
    DhtFailure, GossipFailure, GossipMessage, InboundRequest, Network, NetworkError,
    RequestFailure, Responder,
};
use futures::StreamExt;
use hypha_certs::NodeIdentity;
pub use hypha_certs::{Role, Roles};
pub use in_flight::{IncomingStreams, Stream};
pub use libp2p::{Multiaddr, PeerId, StreamProtocol};
use libp2p::{
    Swarm, Transport as _,
    core::{transport::OrTransport, upgrade::Version},
    dns, relay,
    swarm::SwarmEvent,
    tcp,
};
pub use settings::Settings;
pub use tls::Trust;
use tokio::sync::mpsc;

/// The allocator of [`global_allocator!`].
#[doc(hidden)]
pub use mimalloc::MiMalloc;

/// Makes mimalloc the program's global allocator; every node binary declares it.
///
/// A bulk transfer allocates and frees a 1 MiB buffer per yamux frame on each side (the yamux
/// crate copies every frame into a fresh `Vec`). glibc's malloc hands blocks of that size back to
/// the kernel and faults them in again: 0.4 to 1.2 million page faults per 7 GiB over one
/// stream, and half the throughput (BENCHMARKS.md, transport). mimalloc keeps and reuses them.
#[macro_export]
macro_rules! global_allocator {
    () => {
        #[global_allocator]
        static GLOBAL_ALLOCATOR: $crate::MiMalloc = $crate::MiMalloc;
    };
}

/// How long a connection may take from TCP connect to a multiplexed, authenticated connection.
const UPGRADE_TIMEOUT: Duration = Duration::from_secs(20);
/// Commands queued from handles to the event loop; senders wait when it is full.
const COMMAND_QUEUE: usize = 1024;
/// How long [`start`] waits for the first dial of every gateway to succeed or fail.
const GATEWAY_JOIN_TIMEOUT: Duration = Duration::from_secs(10);
/// How long [`start`] waits for its listeners to come up.
const LISTEN_TIMEOUT: Duration = Duration::from_secs(10);

/// The network could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Tls(#[from] tls::ConfigError),
    #[error(transparent)]
    Behaviour(#[from] behaviour::BehaviourError),
    #[error("cannot set up DNS resolution: {0}")]
    Dns(std::io::Error),
    #[error("cannot listen on {address}: {reason}")]
    Listen { address: Multiaddr, reason: String },
}

/// Starts a node's network: builds the transport and protocols, listens on
/// `settings.listen_addresses` (waiting until each listener is up), spawns the event loop on the
/// current Tokio runtime and waits until the first dial of every gateway has succeeded or failed
/// (at most 10 s).
///
/// Returns the handle and the queue of inbound requests for the application (health requests are
/// answered by the network itself). If the application stops reading that queue, requests are
/// answered `Busy` once it is full.
pub async fn start(
    settings: Settings,
    identity: &NodeIdentity,
    trust: impl Into<Trust>,
) -> Result<(Network, mpsc::Receiver<InboundRequest>), StartError> {
    let trust = trust.into();
    let peers = CertifiedPeers::new(settings.allow_roleless);
    let tls = tls::Config::new(identity, trust.clone(), peers.clone())?;
    let local_peer_id = identity.peer_id();
    let reach = reach::Reach::new(
        ExcludedRanges::new(settings.exclude_cidr.iter().copied()),
        &settings.gateway_addresses,
        &settings.listen_addresses,
    );

    let (relay_transport, relay_client) = relay::client::new(local_peer_id);
    // Which port each dial left from, to weigh what peers observe of it (`nat`).
    let dialed_from = nat::DialedFrom::default();
    let recorder = dialed_from.clone();
    let peer_rate = settings.peer_bytes_per_second;
    let tcp = tcp::tokio::Transport::new(tcp::Config::default().nodelay(true)).map(
        move |stream: tcp::tokio::TcpStream, endpoint| {
            if endpoint.is_dialer()
                && let (Ok(remote), Ok(local)) = (stream.0.peer_addr(), stream.0.local_addr())
            {
                recorder.record(remote, local);
            }
            link_share::Throttled::new(stream, peer_rate)
        },
    );
    let filtered =
        address_filter::Transport::new(OrTransport::new(relay_transport, tcp), reach.clone());
    let dns = match dns::tokio::Transport::system(filtered) {
        Ok(dns) => dns,
        Err(e) => return Err(StartError::Dns(e)),
    };
    // Plain V1, not V1Lazy: the dialer waits for the listener to confirm the muxer, which it
    // does only after verifying the dialer's certificate. With TLS 1.3 the client's handshake
    // ends before the server has judged it, so a lazy dialer would briefly believe a refused
    // connection was up.
    let transport = dns
        .upgrade(Version::V1)
        .authenticate(tls)
        .multiplex(muxer::Config::default())
        .timeout(UPGRADE_TIMEOUT)
        .boxed();
    let transport =
        dial_budget::Transport::new(transport, &settings.gateway_addresses, reach.clone()).boxed();

    let behaviour = behaviour::Behaviour::new(identity.keypair(), &settings, relay_client)?;
    let mut swarm = Swarm::new(
        transport,
        behaviour,
        local_peer_id,
        libp2p::swarm::Config::with_tokio_executor()
            .with_idle_connection_timeout(settings.idle_connection_timeout),
    );
    let streams = swarm.behaviour().streams.new_control();

    for address in &settings.external_addresses {
        swarm.add_external_address(address.clone());
    }
    let mut configured = Vec::new();
    for address in &settings.listen_addresses {
        let id = swarm
            .listen_on(address.clone())
            .map_err(|e| StartError::Listen {
                address: address.clone(),
                reason: e.to_string(),
            })?;
        configured.push((id, address.clone()));
    }
    wait_for_listeners(&mut swarm, configured.len(), &reach).await?;

    let (listening_tx, listening) =
        tokio::sync::watch::channel(swarm.listeners().cloned().collect());
    let (command_tx, command_rx) = mpsc::channel(COMMAND_QUEUE);
    let (inbound_tx, inbound_rx) = mpsc::channel(settings.inbound_request_queue.max(1));
    let in_flight = in_flight::InFlight::default();
    let event_loop = event_loop::EventLoop::new(
        swarm,
        (command_tx.downgrade(), command_rx),
        inbound_tx,
        settings,
        (peers.clone(), in_flight.clone()),
        reach,
        (listening_tx, configured, dialed_from),
    );
    let (joined_tx, joined) = tokio::sync::oneshot::channel();
    // Owned through the handle: the loop ends on `Network::shutdown` or when every `Network`
    // (the sender of its commands) is dropped.
    tokio::spawn(event_loop.run(joined_tx));
    // Being connected to a gateway is what makes a node part of the network; give the first
    // dials a bounded time, then carry on (the loop keeps retrying).
    if tokio::time::timeout(GATEWAY_JOIN_TIMEOUT, joined)
        .await
        .is_err()
    {
        tracing::warn!("no gateway answered within {GATEWAY_JOIN_TIMEOUT:?}; still trying");
    }

    Ok((
        Network {
            local_peer_id,
            commands: command_tx,
            streams,
            in_flight,
            peers,
            trust,
            listening,
        },
        inbound_rx,
    ))
}

/// Drives the swarm until `count` listeners have reported an address, announcing those
/// that [`announce_listen_address`] takes.
async fn wait_for_listeners(
    swarm: &mut Swarm<behaviour::Behaviour>,
    mut count: usize,
    reach: &reach::Reach,
) -> Result<(), StartError> {
    let deadline = tokio::time::Instant::now() + LISTEN_TIMEOUT;
    let mut seen = std::collections::HashSet::new();
    while count > 0 {
        let event = tokio::time::timeout_at(deadline, swarm.select_next_some()).await;
        match event {
            Ok(SwarmEvent::NewListenAddr {
                listener_id,
                address,
            }) => {
                tracing::info!(%address, "listening");
                announce_listen_address(swarm, reach, address);
                if seen.insert(listener_id) {
                    count -= 1;
                }
            }
            Ok(SwarmEvent::ListenerClosed {
                addresses, reason, ..
            }) => {
                return Err(StartError::Listen {
                    address: addresses.first().cloned().unwrap_or_else(Multiaddr::empty),
                    reason: format!("{reason:?}"),
                });
            }
            Ok(_) => {}
            Err(_) => {
                return Err(StartError::Listen {
                    address: Multiaddr::empty(),
                    reason: "listeners did not come up in time".into(),
                });
            }
        }
    }
    Ok(())
}

/// Announces a listen address to peers (identify sends only announced addresses) where it
/// can lead somewhere from another machine: public and private addresses (a private one
/// serves the peers on the same LAN; others do not dial it) but those of container and VM
/// bridges, loopback only in a network on one machine. Relay circuits are announced by the
/// relay client itself.
pub(crate) fn announce_listen_address(
    swarm: &mut Swarm<behaviour::Behaviour>,
    reach: &reach::Reach,
    address: Multiaddr,
) {
    if reach.announces(&address) {
        swarm.add_external_address(address);
    }
}
