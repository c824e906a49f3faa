//! Reaching a peer: known addresses, a DHT lookup, a gateway's relay; and what each
//! connection's path (direct, punched, relayed) means for the peer.

use std::time::Instant;

use libp2p::{
    Multiaddr, PeerId,
    core::ConnectedPoint,
    kad,
    multiaddr::Protocol,
    swarm::{
        ConnectionId,
        dial_opts::{DialOpts, PeerCondition},
    },
};

use hypha_messages::{Envelope, Request, Response};

use super::{EventLoop, QUIET_CLOSES_KEPT, Reply, circuit_address, relay_of};
use crate::{
    client::NetworkError,
    paths::{Established, Kind, PUNCH_WINDOW, Path, StaysRelayed},
    reach::Unreachable,
};

/// Reaching a peer: the addresses already known, then the addresses the DHT knows, then each
/// connected gateway's relay. Each stage's failure is kept for the final error.
#[derive(Debug)]
pub(super) struct PendingConnect {
    pub(super) stage: ConnectStage,
    pub(super) failures: Vec<String>,
    /// Addresses of the peer that the DHT lookup came across but [`Reach`] refused, and why.
    pub(super) unreachable_seen: Vec<(Multiaddr, Unreachable)>,
    pub(super) replies: Vec<Reply<()>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ConnectStage {
    Known,
    Lookup,
    LookedUp,
    Relayed,
}

impl ConnectStage {
    pub(super) fn describe(self) -> &'static str {
        match self {
            ConnectStage::Known => "known addresses",
            ConnectStage::Lookup => "DHT lookup",
            ConnectStage::LookedUp => "addresses from the DHT",
            ConnectStage::Relayed => "through a gateway relay",
        }
    }
}

impl EventLoop {
    /// Disconnects every connected peer whose chain `store` refuses now (revoked, expired),
    /// returning them with the reason.
    pub(super) fn recheck(
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
    pub(super) fn connect_failed(&mut self, peer: PeerId, reason: String) {
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
    pub(super) fn on_lookup_done(&mut self, query: kad::QueryId, peers: Vec<kad::PeerInfo>) {
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
    pub(super) fn dial_for_connect(&mut self, peer: PeerId, addresses: Vec<Multiaddr>) {
        let opts = DialOpts::peer_id(peer)
            .addresses(addresses)
            .condition(PeerCondition::Always)
            .allocate_new_port()
            .build();
        if let Err(e) = self.swarm.dial(opts) {
            self.connect_failed(peer, e.to_string());
        }
    }

    pub(super) fn finish_connect(&mut self, peer: PeerId, result: Result<(), String>) {
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
    pub(super) fn on_connection_path(
        &mut self,
        peer: PeerId,
        id: ConnectionId,
        endpoint: &ConnectedPoint,
    ) {
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
        let (waiting, after_relay) = match self.paths.established(
            peer,
            id,
            kind,
            waiting,
            Instant::now(),
        ) {
            Established::Wait => {
                tracing::debug!(%peer, "reached through a relay; waiting for a direct connection");
                self.close_retired();
                return;
            }
            Established::Direct {
                waiting,
                after_relay,
            } => (waiting, after_relay),
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
        self.close_retired();
        for reply in waiting {
            let _ = reply.send(Ok(()));
        }
    }

    /// Connects whose window for a direct connection closed go on through the relay, and
    /// retired relayed connections close once done.
    pub(super) fn end_punch_windows(&mut self) {
        for ended in self.paths.expire(Instant::now()) {
            self.stays_relayed(ended);
        }
        self.close_retired();
    }

    /// Closes the retired relayed connections whose peer has nothing under way any more (or
    /// that carried it for too long).
    pub(super) fn close_retired(&mut self) {
        let (in_flight, now) = (&self.in_flight, Instant::now());
        let retired = (self.paths).retire(now, |peer| in_flight.is_quiet(peer, now));
        for connection in retired.quiet {
            self.closed_quietly(connection);
            self.swarm.close_connection(connection);
        }
        // What they carry is cut; its senders see the failure (not sent again: the peer may
        // have taken it).
        for connection in retired.overdue {
            self.swarm.close_connection(connection);
        }
    }

    /// Over a relayed connection this node dialled, asks the peer whether it is behind the
    /// same NAT (see [`crate::neighbours`]), unless this node reached it on its private
    /// addresses before.
    pub(super) fn ask_if_neighbour(&mut self, peer: PeerId, endpoint: &ConnectedPoint) {
        if !endpoint.is_relayed() || !endpoint.is_dialer() || self.neighbours.contains_key(&peer) {
            return;
        }
        let Some(public_ips) = crate::neighbours::question(&self.nat.public_ips()) else {
            return;
        };
        let request = Envelope::new(Request::Neighbour { public_ips }, Default::default());
        let id = self.swarm.behaviour_mut().rpc.send_request(&peer, request);
        self.neighbour_asks.insert(id, peer);
    }

    /// A peer answered whether it is behind this node's NAT: its private addresses are
    /// dialled, unless it is reached directly by now; once they lead to it, later connects try
    /// them first.
    pub(super) fn on_neighbour_answer(&mut self, peer: PeerId, answer: Response) {
        let Response::Neighbour { addresses } = answer else {
            return;
        };
        let addresses = crate::neighbours::to_dial(peer, &addresses);
        if addresses.is_empty() {
            return;
        }
        if self.paths.path(&peer) != Some(Path::Relayed) {
            return;
        }
        for address in &addresses {
            self.reach.allow_neighbour(address);
        }
        tracing::debug!(%peer, ?addresses, "a peer behind the same NAT; dialling its private addresses");
        let opts = DialOpts::peer_id(peer)
            .addresses(addresses.clone())
            .condition(PeerCondition::Always)
            .allocate_new_port()
            .build();
        let id = opts.connection_id();
        if self.swarm.dial(opts).is_ok() {
            self.neighbour_dials.insert(id, addresses);
        }
    }

    /// Remembers that retired relayed connection `id` closed carrying nothing of the
    /// application's, by this side's choice or the peer's.
    pub(super) fn closed_quietly(&mut self, id: ConnectionId) {
        self.quiet_closes.push_back(id);
        if self.quiet_closes.len() > QUIET_CLOSES_KEPT {
            self.quiet_closes.pop_front();
        }
    }

    /// No direct connection to a peer will come: its waiting connects go on through the
    /// relay, if it is still connected at all.
    pub(super) fn stays_relayed(&mut self, ended: StaysRelayed<Reply<()>>) {
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
}
