//! What the behaviour's protocols report: Kademlia queries, gossip, request-response.

use std::time::{Duration, Instant};

use hypha_certs::Role;
use hypha_messages::{Envelope, ErrorCode, Request, Response, health};
use libp2p::{
    PeerId, dcutr, gossipsub, identify, kad, ping, relay, request_response, swarm::ConnectionId,
};
use tokio::sync::mpsc;

use super::{EventLoop, PING_TIMEOUTS_TO_CLOSE, PendingRequest};
use crate::{
    behaviour::{BehaviourEvent, KAD_PROTOCOL},
    certified::required_role,
    client::{GossipMessage, InboundRequest, NetworkError, Responder},
    reach::is_relayed,
};

impl EventLoop {
    pub(super) fn on_behaviour_event(&mut self, event: BehaviourEvent) {
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
                if by_gateway && self.gateway_dials.contains(&connection_id) {
                    let observed = &info.observed_addr;
                    let local_port = (self.dialled_at.get(&connection_id))
                        .and_then(|(_, address)| self.listeners.dialed_from.port_to(address));
                    if let Some(belief) = self.nat.observed(peer_id, observed, local_port) {
                        tracing::info!(nat = %belief, observer = %peer_id, %observed, "what this node believes of its NAT changed");
                    }
                    self.observed_by_gateway(connection_id, observed, local_port);
                    if self.reach.observed_by_gateway(observed) {
                        let listening: Vec<_> = self.swarm.listeners().cloned().collect();
                        for address in listening {
                            crate::announce_listen_address(&mut self.swarm, &self.reach, address);
                        }
                    }
                    // Peers punch to it only while this node's listeners are settled: not to
                    // a port it is about to leave, nor one it is trying.
                    if self.listeners.settled() && self.nat.on_listen_port(observed, local_port) {
                        self.swarm.behaviour_mut().dcutr.observed_at(observed);
                    }
                    self.move_port_when_due();
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

    pub(super) fn on_kad_event(&mut self, event: kad::Event) {
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
                        let _ =
                            reply.send(result.map(|_| ()).map_err(|e| NetworkError::Dht(e.into())));
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
                        let _ =
                            reply.send(result.map(|_| ()).map_err(|e| NetworkError::Dht(e.into())));
                    }
                }
                _ => {}
            },
            _ => {}
        }
    }

    pub(super) fn finish_providers(&mut self, id: kad::QueryId) {
        if let Some((found, reply)) = self.pending_providers.remove(&id) {
            let _ = reply.send(Ok(found));
            // Stop the query: it would otherwise keep walking the DHT for more providers.
            if let Some(mut query) = self.swarm.behaviour_mut().kad.query_mut(&id) {
                query.finish();
            }
        }
    }

    pub(super) fn on_gossip(&mut self, message: gossipsub::Message) {
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

    pub(super) fn on_rpc_event(
        &mut self,
        event: request_response::Event<Envelope<Request>, Envelope<Response>>,
    ) {
        match event {
            request_response::Event::Message {
                peer,
                message,
                connection_id,
            } => match message {
                request_response::Message::Request {
                    request_id,
                    request,
                    channel,
                } => {
                    if self.quiet_closes.contains(&connection_id) {
                        // It came after this node closed the relay it came over: not taken,
                        // so that its sender may send it again.
                        tracing::debug!(%peer, "a request over a retired relay, after its close; not taken");
                        return;
                    }
                    self.answering
                        .insert(request_id, self.in_flight.begin(peer));
                    self.on_inbound_request(peer, request, channel);
                }
                request_response::Message::Response {
                    request_id,
                    response,
                } => {
                    if let Some(peer) = self.neighbour_asks.remove(&request_id) {
                        self.on_neighbour_answer(peer, response.body);
                    } else if let Some(pending) = self.pending_requests.remove(&request_id) {
                        let _ = pending.reply.send(Ok(response.body));
                    }
                    self.close_retired();
                }
            },
            request_response::Event::OutboundFailure {
                request_id,
                error,
                connection_id,
                ..
            } => {
                self.neighbour_asks.remove(&request_id);
                if let Some(pending) = self.pending_requests.remove(&request_id) {
                    self.request_failed(pending, connection_id, error);
                }
                self.close_retired();
            }
            request_response::Event::InboundFailure {
                peer,
                request_id,
                error,
                ..
            } => {
                tracing::debug!(%peer, %error, "an inbound request failed");
                self.answering.remove(&request_id);
                self.close_retired();
            }
            request_response::Event::ResponseSent { request_id, .. } => {
                self.answering.remove(&request_id);
                self.close_retired();
            }
        }
    }

    /// A request failed. One whose connection was a relay this node retired quietly (nothing
    /// was under way with the peer when it closed it, so the request went out after the close
    /// and never reached the peer, which takes nothing over it any more) is sent again once,
    /// over the connection that replaced it. Any other failure is the caller's: when the peer
    /// closed the relay, it may have taken the request.
    fn request_failed(
        &mut self,
        mut pending: PendingRequest,
        connection: ConnectionId,
        error: request_response::OutboundFailure,
    ) {
        let cut_by_retiring = matches!(error, request_response::OutboundFailure::ConnectionClosed)
            && self.quiet_closes.contains(&connection);
        if cut_by_retiring && !pending.sent_again && self.swarm.is_connected(&pending.peer) {
            tracing::debug!(peer = %pending.peer, "a request met a retired relay closing; sending it again");
            pending.sent_again = true;
            let rpc = &mut self.swarm.behaviour_mut().rpc;
            let id = rpc.send_request(&pending.peer, pending.request.clone());
            self.pending_requests.insert(id, pending);
            return;
        }
        let _ = pending.reply.send(Err(NetworkError::Request {
            peer: pending.peer,
            failure: error.into(),
        }));
    }

    pub(super) fn on_inbound_request(
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
                    "{} requests need the {role} role, and your certificate holds {held}; have it issued with `hypha-certutil node --role {role}`",
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
            Request::Neighbour { public_ips } => {
                // Not a container or VM bridge's: the same addresses on every machine.
                let listening = (self.swarm.listeners()).filter(|address| {
                    !crate::reach::first_ip(address).is_some_and(crate::reach::on_virtual_bridge)
                });
                let addresses =
                    crate::neighbours::answer(&public_ips, &self.nat.public_ips(), listening);
                answer(self, channel, Response::Neighbour { addresses });
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
