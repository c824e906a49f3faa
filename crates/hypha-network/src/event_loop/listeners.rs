//! This node's TCP listeners, and moving them where [`port_move`](crate::port_move) says: the
//! swarm's side of its rules.

use std::{collections::HashSet, time::Instant};

use libp2p::{
    Multiaddr,
    core::transport::ListenerId,
    multiaddr::Protocol,
    swarm::{
        ConnectionId,
        dial_opts::{DialOpts, PeerCondition},
    },
};

use super::EventLoop;
use crate::port_move::{Action, Outcome, PortMove};

/// The listeners, and a switch from one set to another in progress.
pub(super) struct Listeners {
    /// The addresses the node was configured to listen on.
    configured: Vec<Multiaddr>,
    /// The listeners it listens with now (the configured ones, or the fresh one).
    current: Vec<ListenerId>,
    moving: PortMove,
    switch: Option<Switch>,
    /// The dials of gateways made from the fresh port: what a gateway observes on them ends
    /// the move.
    check_dials: HashSet<ConnectionId>,
    /// After a move, the configured listeners not closed yet, and the fresh port.
    closing: HashSet<ListenerId>,
    fresh_port: Option<u16>,
}

/// New listeners opening; the current ones close once they are all up.
struct Switch {
    listeners: Vec<ListenerId>,
    /// Those not up yet.
    opening: HashSet<ListenerId>,
    /// Whether the new listeners are the fresh port (then the gateways are dialled from it).
    fresh: bool,
}

impl Listeners {
    pub(super) fn new(configured: Vec<(ListenerId, Multiaddr)>) -> Self {
        Listeners {
            current: configured.iter().map(|(id, _)| *id).collect(),
            configured: configured.into_iter().map(|(_, address)| address).collect(),
            moving: PortMove::default(),
            switch: None,
            check_dials: HashSet::new(),
            closing: HashSet::new(),
            fresh_port: None,
        }
    }
}

/// `address` with TCP port `port`.
fn with_port(address: &Multiaddr, port: u16) -> Multiaddr {
    address
        .iter()
        .map(|p| match p {
            Protocol::Tcp(_) => Protocol::Tcp(port),
            other => other,
        })
        .collect()
}

fn tcp_port(address: &Multiaddr) -> Option<u16> {
    address.iter().find_map(|p| match p {
        Protocol::Tcp(port) => Some(port),
        _ => None,
    })
}

impl EventLoop {
    /// Moves or returns the port when [`PortMove`] says it is time.
    pub(super) fn move_port_when_due(&mut self) {
        match self.listeners.moving.poll(&self.nat, Instant::now()) {
            Some(Action::Move) => {
                let ports: Vec<String> =
                    self.nat.listen_ports().iter().map(u16::to_string).collect();
                tracing::info!(
                    ports = ports.join(","),
                    "gateways never saw this node leave its NAT from its listen port: another machine behind the same NAT may hold it; trying a fresh port"
                );
                let fresh: Vec<Multiaddr> = self
                    .listeners
                    .configured
                    .iter()
                    .map(|address| with_port(address, 0))
                    .collect();
                self.switch_to(fresh, true);
            }
            Some(Action::Return) => self.return_to_configured(),
            None => {}
        }
    }

    /// A gateway observed `observed` on connection `connection`, which this node dialled.
    pub(super) fn observed_by_gateway(&mut self, connection: ConnectionId, observed: &Multiaddr) {
        if !self.listeners.check_dials.remove(&connection) {
            return;
        }
        let Some(port) = tcp_port(observed) else {
            return;
        };
        match self.listeners.moving.observed(port) {
            Some((Outcome::Stayed { port }, _)) => {
                tracing::info!(
                    port,
                    "the NAT keeps this node's fresh port: another machine behind it holds the configured one; staying on {port}"
                );
                self.listeners.check_dials.clear();
            }
            Some((Outcome::Returned { port }, _)) => {
                tracing::info!(
                    port,
                    %observed,
                    "the NAT changes this port too (a symmetric NAT): back to the configured listen addresses"
                );
                self.return_to_configured();
            }
            None => {}
        }
    }

    fn return_to_configured(&mut self) {
        self.listeners.check_dials.clear();
        let configured = self.listeners.configured.clone();
        self.switch_to(configured, false);
    }

    /// Opens listeners on `addresses`; the current ones close once these are up.
    fn switch_to(&mut self, addresses: Vec<Multiaddr>, fresh: bool) {
        let mut listeners = Vec::new();
        for address in addresses {
            match self.swarm.listen_on(address.clone()) {
                Ok(id) => listeners.push(id),
                Err(error) => {
                    tracing::warn!(%address, %error, "cannot listen; keeping the listeners as they are")
                }
            }
        }
        if listeners.is_empty() {
            return;
        }
        self.listeners.switch = Some(Switch {
            opening: listeners.iter().copied().collect(),
            listeners,
            fresh,
        });
    }

    /// Listener `id` is up at `address`: completes a switch once all its listeners are.
    pub(super) fn on_listener_up(&mut self, id: ListenerId, address: &Multiaddr) {
        let Some(switch) = &mut self.listeners.switch else {
            return;
        };
        // A listener on every interface reports each address; the first one counts.
        if !switch.opening.remove(&id) || !switch.opening.is_empty() {
            return;
        }
        let Some(switch) = self.listeners.switch.take() else {
            return;
        };
        let old = std::mem::replace(&mut self.listeners.current, switch.listeners);
        for listener in &old {
            self.swarm.remove_listener(*listener);
        }
        if switch.fresh
            && let Some(port) = tcp_port(address)
        {
            // Dials reuse a listen port: the gateways are dialled once the fresh one is the
            // only one left.
            self.listeners.closing = old.into_iter().collect();
            self.listeners.fresh_port = Some(port);
        }
    }

    /// Listener `id` closed: once the configured ones closed after a move, the gateways are
    /// dialled from the fresh port.
    pub(super) fn on_listener_closed(&mut self, id: ListenerId) {
        if !self.listeners.closing.remove(&id) || !self.listeners.closing.is_empty() {
            return;
        }
        if let Some(port) = self.listeners.fresh_port.take() {
            self.listeners.moving.moved(port, Instant::now());
            self.dial_gateways_from_fresh_port();
        }
    }

    /// The gateways dialled again, the new connections leaving from the only listen port
    /// there is now.
    fn dial_gateways_from_fresh_port(&mut self) {
        let gateways: Vec<(libp2p::PeerId, Multiaddr)> = self
            .gateway_peers
            .iter()
            .map(|(peer, address)| (*peer, address.clone()))
            .collect();
        for (peer, address) in gateways {
            let opts = DialOpts::peer_id(peer)
                .addresses(vec![address])
                .condition(PeerCondition::Always)
                .build();
            let id = opts.connection_id();
            if self.swarm.dial(opts).is_ok() {
                self.gateway_dials.insert(id);
                self.listeners.check_dials.insert(id);
            }
        }
    }
}
