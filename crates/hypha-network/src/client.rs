//! [`Network`]: the cheap, cloneable handle through which a node uses the network.

use std::collections::HashSet;

use hypha_certs::{Rejection, Role, Roles};
use hypha_messages::{Envelope, Request, Response, TraceContext, health};
use libp2p::{
    Multiaddr, PeerId, StreamProtocol, kad::RecordKey, request_response::ResponseChannel,
};
use tokio::sync::{mpsc, oneshot, watch};

use crate::{IncomingStreams, Stream, Trust, certified::CertifiedPeers};

/// How long a stream whose opening failed waits before it is opened again.
const STREAM_OPEN_AGAIN_AFTER: std::time::Duration = std::time::Duration::from_millis(100);

/// Something the network could not do.
#[derive(Debug, Clone, thiserror::Error)]
pub enum NetworkError {
    /// `reason` by its text: one connect fans out to every caller waiting for the peer
    /// (a `NetworkError` is cloned), and it fails in many ways (the reach check, libp2p's
    /// `DialError`, which cannot be cloned, a relay or a hole punch that ended); callers
    /// decide on the variant, not on why.
    #[error("cannot dial {target}: {reason}")]
    Dial { target: String, reason: String },
    #[error("cannot listen on {address}: {reason}")]
    Listen { address: Multiaddr, reason: String },
    #[error("request to {peer} failed: {failure}")]
    Request {
        peer: PeerId,
        failure: RequestFailure,
    },
    #[error("{protocol} already has an acceptor on this node")]
    AcceptorTaken { protocol: StreamProtocol },
    #[error("{peer} answered with an error: {error}")]
    Remote {
        peer: PeerId,
        error: hypha_messages::Error,
    },
    #[error("{peer} answered with an unexpected message")]
    UnexpectedResponse { peer: PeerId },
    #[error("DHT: {0}")]
    Dht(DhtFailure),
    #[error("gossip: {0}")]
    Gossip(GossipFailure),
    #[error("{peer} may not act as {role}: its certificate holds {held}")]
    Role {
        peer: PeerId,
        role: Role,
        held: Roles,
    },
    #[error("the network has shut down")]
    Shutdown,
}

/// Why a request or a stream to a peer failed, as rust-libp2p says (its `OutboundFailure`
/// and `OpenStreamError`), so that a caller can tell a peer that is away from one that will
/// never take the request.
/// Why a DHT operation failed, as Kademlia says.
#[derive(Debug, Clone, thiserror::Error)]
pub enum DhtFailure {
    #[error(transparent)]
    NoKnownPeers(#[from] libp2p::kad::NoKnownPeers),
    #[error(transparent)]
    Store(#[from] libp2p::kad::store::Error),
    #[error(transparent)]
    AddProvider(#[from] libp2p::kad::AddProviderError),
    #[error(transparent)]
    Bootstrap(#[from] libp2p::kad::BootstrapError),
}

/// Why gossipsub did not publish or subscribe, as it says (shared: its errors cannot be
/// cloned, and a [`NetworkError`] can).
#[derive(Debug, Clone, thiserror::Error)]
pub enum GossipFailure {
    #[error(transparent)]
    Publish(std::sync::Arc<libp2p::gossipsub::PublishError>),
    #[error(transparent)]
    Subscribe(std::sync::Arc<libp2p::gossipsub::SubscriptionError>),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestFailure {
    #[error("the peer could not be dialled")]
    Dial,
    #[error("no answer in time (the peer may have taken the request)")]
    Timeout,
    #[error("the connection closed before an answer (the peer may have taken the request)")]
    ConnectionClosed,
    #[error("the peer speaks none of the protocols asked for")]
    UnsupportedProtocol,
    /// An I/O error on the stream, by its text (`std::io::Error` cannot be cloned).
    #[error("{0}")]
    Io(String),
}

impl RequestFailure {
    /// Whether asking again may go through: not when the peer does not speak the protocol.
    pub fn is_transient(&self) -> bool {
        !matches!(self, RequestFailure::UnsupportedProtocol)
    }
}

impl From<libp2p::request_response::OutboundFailure> for RequestFailure {
    fn from(failure: libp2p::request_response::OutboundFailure) -> Self {
        use libp2p::request_response::OutboundFailure;
        match failure {
            OutboundFailure::DialFailure => RequestFailure::Dial,
            OutboundFailure::Timeout => RequestFailure::Timeout,
            OutboundFailure::ConnectionClosed => RequestFailure::ConnectionClosed,
            OutboundFailure::UnsupportedProtocols => RequestFailure::UnsupportedProtocol,
            OutboundFailure::Io(error) => RequestFailure::Io(error.to_string()),
        }
    }
}

impl From<libp2p_stream::OpenStreamError> for RequestFailure {
    fn from(error: libp2p_stream::OpenStreamError) -> Self {
        match error {
            libp2p_stream::OpenStreamError::UnsupportedProtocol(_) => {
                RequestFailure::UnsupportedProtocol
            }
            libp2p_stream::OpenStreamError::Io(error) => RequestFailure::Io(error.to_string()),
            // The enum is not exhaustive.
            other => RequestFailure::Io(other.to_string()),
        }
    }
}

/// A gossip message received on a subscribed topic.
#[derive(Debug, Clone)]
pub struct GossipMessage {
    /// The author (messages are signed, so this is verified).
    pub source: Option<PeerId>,
    pub topic: String,
    pub data: Vec<u8>,
}

/// A request from a peer, for the application to answer.
#[derive(Debug)]
pub struct InboundRequest {
    pub peer: PeerId,
    pub request: Request,
    /// The sender's trace context; see [`hypha_telemetry::propagation::set_parent`].
    pub trace: TraceContext,
    pub responder: Responder,
}

/// Answers one inbound request. Dropping it unanswered tells the peer the request failed.
#[derive(Debug)]
pub struct Responder {
    channel: Option<ResponseChannel<Envelope<Response>>>,
    commands: mpsc::Sender<Command>,
}

impl Responder {
    pub(crate) fn new(
        channel: ResponseChannel<Envelope<Response>>,
        commands: mpsc::Sender<Command>,
    ) -> Self {
        Responder {
            channel: Some(channel),
            commands,
        }
    }

    pub(crate) fn take_channel(&mut self) -> Option<ResponseChannel<Envelope<Response>>> {
        self.channel.take()
    }

    /// Sends the answer.
    pub async fn respond(mut self, response: Response) -> Result<(), NetworkError> {
        let channel = self.channel.take().ok_or(NetworkError::Shutdown)?;
        let trace = hypha_telemetry::propagation::inject(&tracing::Span::current());
        self.commands
            .send(Command::Respond {
                channel,
                response: Envelope::new(response, trace),
            })
            .await
            .map_err(|_| NetworkError::Shutdown)
    }
}

impl Drop for Responder {
    fn drop(&mut self) {
        if let Some(channel) = self.channel.take() {
            // Best effort; if the loop is gone or busy the peer sees the stream close instead.
            let _ = self.commands.try_send(Command::Respond {
                channel,
                response: Envelope::new(
                    Response::Error(hypha_messages::Error {
                        code: hypha_messages::ErrorCode::Internal,
                        message: "the node dropped the request without answering".into(),
                    }),
                    TraceContext::new(),
                ),
            });
        }
    }
}

type Reply<T> = oneshot::Sender<Result<T, NetworkError>>;

/// What the handle asks of the event loop.
#[derive(Debug)]
pub(crate) enum Command {
    Dial {
        address: Multiaddr,
        reply: Reply<PeerId>,
    },
    Connect {
        peer: PeerId,
        reply: Reply<()>,
    },
    AddAddress {
        peer: PeerId,
        address: Multiaddr,
    },
    ConnectedPeers {
        reply: oneshot::Sender<Vec<PeerId>>,
    },
    Paths {
        reply: oneshot::Sender<Vec<(PeerId, crate::paths::Path)>>,
    },
    StartProviding {
        key: RecordKey,
        reply: Reply<()>,
    },
    StopProviding {
        key: RecordKey,
    },
    GetProviders {
        key: RecordKey,
        reply: Reply<HashSet<PeerId>>,
    },
    Bootstrap {
        reply: Reply<()>,
    },
    Subscribe {
        topic: String,
        capacity: usize,
        reply: Reply<mpsc::Receiver<GossipMessage>>,
    },
    Publish {
        topic: String,
        data: Vec<u8>,
        reply: Reply<()>,
    },
    Request {
        peer: PeerId,
        request: Envelope<Request>,
        reply: Reply<Response>,
    },
    Respond {
        channel: ResponseChannel<Envelope<Response>>,
        response: Envelope<Response>,
    },
    SetHealth {
        healthy: bool,
        detail: String,
    },
    /// Closes the connections of peers the trust store in force no longer accepts.
    Recheck {
        store: std::sync::Arc<hypha_certs::TrustStore>,
        reply: oneshot::Sender<Vec<(PeerId, Rejection)>>,
    },
    Shutdown {
        reply: oneshot::Sender<()>,
    },
}

/// A handle to a running node's network. Cheap to clone; every method is a message to the event
/// loop that owns the swarm, so no caller ever holds a lock on it.
///
/// The loop stops when [`shutdown`](Self::shutdown) is called or the last handle is dropped.
#[derive(Clone)]
pub struct Network {
    pub(crate) local_peer_id: PeerId,
    pub(crate) commands: mpsc::Sender<Command>,
    pub(crate) streams: libp2p_stream::Control,
    /// What is under way with each peer; the streams opened and accepted here count in it.
    pub(crate) in_flight: crate::in_flight::InFlight,
    pub(crate) peers: CertifiedPeers,
    pub(crate) trust: Trust,
    /// Every address the node listens on, kept current by the event loop.
    pub(crate) listening: watch::Receiver<Vec<Multiaddr>>,
}

impl std::fmt::Debug for Network {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Network")
            .field("local_peer_id", &self.local_peer_id)
            .finish_non_exhaustive()
    }
}

impl Network {
    /// This node's peer id.
    pub fn local_peer_id(&self) -> PeerId {
        self.local_peer_id
    }

    async fn ask<T>(&self, make: impl FnOnce(Reply<T>) -> Command) -> Result<T, NetworkError> {
        let (tx, rx) = oneshot::channel();
        self.commands
            .send(make(tx))
            .await
            .map_err(|_| NetworkError::Shutdown)?;
        rx.await.map_err(|_| NetworkError::Shutdown)?
    }

    async fn tell<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<T>) -> Command,
    ) -> Result<T, NetworkError> {
        let (tx, rx) = oneshot::channel();
        self.commands
            .send(make(tx))
            .await
            .map_err(|_| NetworkError::Shutdown)?;
        rx.await.map_err(|_| NetworkError::Shutdown)
    }

    /// Dials an address and waits until the connection is established and authenticated.
    /// Returns the remote's peer id (taken from its certificate).
    pub async fn dial(&self, address: Multiaddr) -> Result<PeerId, NetworkError> {
        self.ask(|reply| Command::Dial { address, reply }).await
    }

    /// Makes sure there is a connection to `peer`, dialling its known addresses if needed and,
    /// failing that, reaching it through a gateway's relay.
    pub async fn connect(&self, peer: PeerId) -> Result<(), NetworkError> {
        self.ask(|reply| Command::Connect { peer, reply }).await
    }

    /// What `peer`'s certificate lets it do (as this node applies roles); `None` when it has
    /// not been connected in the last few seconds.
    pub fn roles(&self, peer: &PeerId) -> Option<Roles> {
        self.peers.roles(peer)
    }

    /// The organisation `peer`'s certificate belongs to (the CA that signed it); `None` when it
    /// has not been connected in the last few seconds.
    pub fn organisation(&self, peer: &PeerId) -> Option<String> {
        self.peers.organisation(peer)
    }

    /// [`connect`](Self::connect)s to `peer` and checks that its certificate grants `role`:
    /// for peers learnt from gossip or the DHT, before trusting them with what the role is for.
    pub async fn connect_as(&self, peer: PeerId, role: Role) -> Result<(), NetworkError> {
        self.connect(peer).await?;
        let held = self.roles(&peer).unwrap_or_default();
        if held.contains(role) {
            Ok(())
        } else {
            Err(NetworkError::Role { peer, role, held })
        }
    }

    /// Puts `store` in force (a reloaded revocation list, say): new handshakes are verified
    /// with it, and connected peers it refuses are disconnected. Returns those peers and why.
    pub async fn replace_trust(
        &self,
        store: hypha_certs::TrustStore,
    ) -> Result<Vec<(PeerId, Rejection)>, NetworkError> {
        self.trust.replace(store);
        let store = self.trust.current();
        self.tell(|reply| Command::Recheck { store, reply }).await
    }

    /// Tells the network where `peer` can be reached (unless the address is excluded).
    pub async fn add_address(&self, peer: PeerId, address: Multiaddr) -> Result<(), NetworkError> {
        self.commands
            .send(Command::AddAddress { peer, address })
            .await
            .map_err(|_| NetworkError::Shutdown)
    }

    /// The addresses this node listens on now. A listener on a wildcard address (`0.0.0.0`)
    /// reports one address per interface, some of them after `start` returns: to learn of
    /// those, watch [`Network::listen_address_changes`].
    pub async fn listen_addresses(&self) -> Result<Vec<Multiaddr>, NetworkError> {
        if self.listening.has_changed().is_err() {
            return Err(NetworkError::Shutdown);
        }
        Ok(self.listening.borrow().clone())
    }

    /// Every address this node listens on, updated whenever one comes or goes.
    pub fn listen_address_changes(&self) -> watch::Receiver<Vec<Multiaddr>> {
        self.listening.clone()
    }

    /// The peers this node is connected to.
    pub async fn connected_peers(&self) -> Result<Vec<PeerId>, NetworkError> {
        self.tell(|reply| Command::ConnectedPeers { reply }).await
    }

    /// Every connected peer and how it is reached: directly, hole-punched, or only through a
    /// gateway's relay.
    pub async fn paths(&self) -> Result<Vec<(PeerId, crate::paths::Path)>, NetworkError> {
        self.tell(|reply| Command::Paths { reply }).await
    }

    /// Announces this node as a provider of `key` in the DHT. The record is republished
    /// periodically while the node runs.
    pub async fn start_providing(&self, key: impl AsRef<[u8]>) -> Result<(), NetworkError> {
        let key = RecordKey::new(&key);
        self.ask(|reply| Command::StartProviding { key, reply })
            .await
    }

    /// Stops announcing `key`.
    pub async fn stop_providing(&self, key: impl AsRef<[u8]>) -> Result<(), NetworkError> {
        let key = RecordKey::new(&key);
        self.commands
            .send(Command::StopProviding { key })
            .await
            .map_err(|_| NetworkError::Shutdown)
    }

    /// Finds the providers of `key` in the DHT.
    pub async fn get_providers(
        &self,
        key: impl AsRef<[u8]>,
    ) -> Result<HashSet<PeerId>, NetworkError> {
        let key = RecordKey::new(&key);
        self.ask(|reply| Command::GetProviders { key, reply }).await
    }

    /// Refreshes the routing table from the known peers (gateways first).
    pub async fn bootstrap(&self) -> Result<(), NetworkError> {
        self.ask(|reply| Command::Bootstrap { reply }).await
    }

    /// Subscribes to a gossip topic. Messages arrive on the returned receiver, which holds up to
    /// `capacity` of them; when it is full, new messages for it are dropped (and counted) so
    /// that a slow subscriber never stalls the network.
    pub async fn subscribe(
        &self,
        topic: &str,
        capacity: usize,
    ) -> Result<mpsc::Receiver<GossipMessage>, NetworkError> {
        let topic = topic.to_string();
        self.ask(|reply| Command::Subscribe {
            topic,
            capacity: capacity.max(1),
            reply,
        })
        .await
    }

    /// Publishes a signed message on a gossip topic.
    pub async fn publish(&self, topic: &str, data: Vec<u8>) -> Result<(), NetworkError> {
        let topic = topic.to_string();
        self.ask(|reply| Command::Publish { topic, data, reply })
            .await
    }

    /// Sends a request and waits for the answer. The current span's trace context travels with
    /// it. A [`Response::Error`] from the peer comes back as [`NetworkError::Remote`].
    pub async fn request(&self, peer: PeerId, request: Request) -> Result<Response, NetworkError> {
        // request-response dials only the addresses the swarm already has; connecting first
        // reaches a peer known only to the DHT or only through a relay, as streams do. (A
        // worker answering an advertisement knows no more of the scheduler than its ID.)
        self.connect(peer).await?;
        let trace = hypha_telemetry::propagation::inject(&tracing::Span::current());
        let request = Envelope::new(request, trace);
        match self
            .ask(|reply| Command::Request {
                peer,
                request,
                reply,
            })
            .await?
        {
            Response::Error(error) => Err(NetworkError::Remote { peer, error }),
            response => Ok(response),
        }
    }

    /// Asks `peer` for its health.
    pub async fn health(&self, peer: PeerId) -> Result<health::Status, NetworkError> {
        match self.request(peer, Request::Health).await? {
            Response::Health(status) => Ok(*status),
            _ => Err(NetworkError::UnexpectedResponse { peer }),
        }
    }

    /// Sets what this node reports when asked for its health.
    pub async fn set_health(
        &self,
        healthy: bool,
        detail: impl Into<String>,
    ) -> Result<(), NetworkError> {
        self.commands
            .send(Command::SetHealth {
                healthy,
                detail: detail.into(),
            })
            .await
            .map_err(|_| NetworkError::Shutdown)
    }

    /// Opens a raw byte stream to `peer` for `protocol` (bulk transfers).
    pub async fn open_stream(
        &self,
        peer: PeerId,
        protocol: StreamProtocol,
    ) -> Result<Stream, NetworkError> {
        self.connect(peer).await?;
        let underway = self.in_flight.begin(peer);
        let mut control = self.streams.clone();
        let mut opened = control.open_stream(peer, protocol.clone()).await;
        if let Err(libp2p_stream::OpenStreamError::Io(_)) = &opened {
            // The connection it took may be a relay closing as a direct one replaces it;
            // nothing went over the stream yet, so opening it again is safe, once the close
            // has had a moment to take the relay out of the choice.
            tokio::time::sleep(STREAM_OPEN_AGAIN_AFTER).await;
            opened = control.open_stream(peer, protocol).await;
        }
        let stream = opened.map_err(|e| NetworkError::Request {
            peer,
            failure: e.into(),
        })?;
        Ok(Stream::new(stream, underway))
    }

    /// Accepts inbound streams of `protocol`. Only one acceptor per protocol may exist.
    pub fn accept_streams(
        &self,
        protocol: StreamProtocol,
    ) -> Result<IncomingStreams, NetworkError> {
        let incoming = (self.streams.clone())
            .accept(protocol.clone())
            .map_err(|_| NetworkError::AcceptorTaken { protocol })?;
        Ok(IncomingStreams::new(incoming, self.in_flight.clone()))
    }

    /// Closes every connection and stops the event loop.
    pub async fn shutdown(&self) {
        let _ = self.tell(|reply| Command::Shutdown { reply }).await;
    }
}
