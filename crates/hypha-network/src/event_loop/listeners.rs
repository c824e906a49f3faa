//! This node's TCP listeners, and moving them where [`port_move`](crate::port_move) says: the
//! swarm's side of its rules.

use std::{
    collections::{BTreeSet, HashSet},
    time::Instant,
};

use libp2p::{
    Multiaddr, PeerId,
    core::transport::ListenerId,
    multiaddr::Protocol,
    swarm::{
        ConnectionId,
        dial_opts::{DialOpts, PeerCondition},
    },
};

use super::EventLoop;
use crate::{
    nat::DialedFrom,
    port_move::{Action, Outcome, PortMove},
    reach::{Scope, first_ip},
};

/// The listeners, and a move between them in progress.
pub(super) struct Listeners {
    /// The addresses the node was configured to listen on.
    configured: Vec<Multiaddr>,
    /// The listeners it listens with now (the configured ones, or the fresh ones).
    current: Vec<ListenerId>,
    moving: PortMove,
    switch: Option<Switch>,
    /// The local port each TCP dial left from.
    pub(super) dialed_from: DialedFrom,
    /// Dials of gateways from new ports (a probe), and from the fresh ports (a move's check):
    /// what a gateway observes on them decides.
    probe_dials: HashSet<ConnectionId>,
    check_dials: HashSet<ConnectionId>,
    /// After a move: the configured listeners not closed yet, and the fresh ports, from which
    /// the gateways are dialled once those closed (dials reuse any listen port).
    closing: HashSet<ListenerId>,
    fresh_ports: Option<BTreeSet<u16>>,
}

/// New listeners opening; the current ones close once they are all up.
struct Switch {
    listeners: Vec<ListenerId>,
    /// Those not up yet.
    opening: HashSet<ListenerId>,
    /// The ports they listen on (a move's fresh ports); `None`: a return.
    fresh: Option<BTreeSet<u16>>,
}

impl Listeners {
    pub(super) fn new(configured: Vec<(ListenerId, Multiaddr)>, dialed_from: DialedFrom) -> Self {
        Listeners {
            current: configured.iter().map(|(id, _)| *id).collect(),
            configured: configured.into_iter().map(|(_, address)| address).collect(),
            moving: PortMove::default(),
            switch: None,
            dialed_from,
            probe_dials: HashSet::new(),
            check_dials: HashSet::new(),
            closing: HashSet::new(),
            fresh_ports: None,
        }
    }

    /// Whether no probe, move or check is under way: what gateways observe of the listen
    /// port then holds.
    pub(super) fn settled(&self) -> bool {
        self.moving.settled()
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
    /// Does what [`PortMove`] says is due, and dials the gateways from the fresh ports once
    /// the configured listeners closed.
    pub(super) fn move_port_when_due(&mut self) {
        if self.listeners.closing.is_empty()
            && let Some(ports) = self.listeners.fresh_ports.take()
        {
            self.listeners.moving.moved(ports, Instant::now());
            let dials = self.dial_gateways_again(false);
            self.listeners.check_dials.extend(dials);
        }
        match self.listeners.moving.poll(&self.nat, Instant::now()) {
            Some(Action::Probe) => {
                let dials = self.dial_gateways_again(true);
                if dials.is_empty() {
                    self.listeners.moving.give_up();
                }
                self.listeners.probe_dials.extend(dials);
            }
            Some(Action::Move) => self.move_to_fresh_port(),
            Some(Action::Return) => self.return_to_configured(),
            None => {}
        }
    }

    /// A gateway observed `observed` on connection `connection`, which this node dialled from
    /// `local_port` where known.
    pub(super) fn observed_by_gateway(
        &mut self,
        connection: ConnectionId,
        observed: &Multiaddr,
        local_port: Option<u16>,
    ) {
        // A gateway on this node's LAN sees its private address: nothing about the NAT.
        if first_ip(observed).is_none_or(|ip| Scope::of(ip) != Scope::Public) {
            return;
        }
        let Some(port) = tcp_port(observed) else {
            return;
        };
        let now = Instant::now();
        let ended = if self.listeners.probe_dials.remove(&connection) {
            self.listeners.moving.probed(local_port == Some(port), now)
        } else if self.listeners.check_dials.remove(&connection) {
            self.listeners.moving.checked(port)
        } else {
            None
        };
        let Some((outcome, action)) = ended else {
            return;
        };
        let ports: Vec<String> = (self.nat.listen_ports().iter())
            .map(u16::to_string)
            .collect();
        let ports = ports.join(",");
        match outcome {
            Outcome::Taken => tracing::info!(
                %ports,
                "the NAT keeps ports, but gives this node's listen port to another machine behind it (one listening on the same port): moving to a port of its own"
            ),
            Outcome::Symmetric => tracing::debug!(
                %observed,
                "the NAT changes every port: no port of its own would help"
            ),
            Outcome::Stayed { port } => {
                tracing::info!(
                    port,
                    "the NAT keeps this node's fresh port: staying on {port}"
                )
            }
            Outcome::Returned => tracing::info!(
                %observed,
                "the NAT did not keep the fresh port: back to the configured listen addresses"
            ),
        }
        match action {
            Some(Action::Move) => self.move_to_fresh_port(),
            Some(Action::Return) => self.return_to_configured(),
            Some(Action::Probe) | None => {}
        }
    }

    fn move_to_fresh_port(&mut self) {
        let fresh: Vec<Multiaddr> = (self.listeners.configured.iter())
            .map(|address| with_port(address, 0))
            .collect();
        self.switch_to(fresh, true);
    }

    fn return_to_configured(&mut self) {
        self.listeners.check_dials.clear();
        self.listeners.fresh_ports = None;
        let configured = self.listeners.configured.clone();
        self.switch_to(configured, false);
    }

    /// Opens listeners on `addresses` (a move's `fresh` ones, or the configured ones); the
    /// current ones close once these are all up. One that cannot be opened leaves the
    /// listeners as they are.
    fn switch_to(&mut self, addresses: Vec<Multiaddr>, fresh: bool) {
        let mut listeners = Vec::new();
        for address in addresses {
            match self.swarm.listen_on(address.clone()) {
                Ok(id) => listeners.push(id),
                Err(error) => {
                    tracing::warn!(%address, %error, "cannot listen; keeping the listeners as they are");
                    for id in listeners {
                        self.swarm.remove_listener(id);
                    }
                    self.listeners.moving.give_up();
                    return;
                }
            }
        }
        if listeners.is_empty() {
            self.listeners.moving.give_up();
            return;
        }
        self.listeners.switch = Some(Switch {
            opening: listeners.iter().copied().collect(),
            listeners,
            fresh: fresh.then(BTreeSet::new),
        });
    }

    /// Listener `id` is up at `address`: completes a switch once all its listeners are.
    pub(super) fn on_listener_up(&mut self, id: ListenerId, address: &Multiaddr) {
        let Some(switch) = &mut self.listeners.switch else {
            return;
        };
        if let (Some(ports), Some(port)) = (&mut switch.fresh, tcp_port(address))
            && switch.listeners.contains(&id)
        {
            ports.insert(port);
        }
        // A listener on every interface reports each address; the first one counts.
        if !switch.opening.remove(&id) || !switch.opening.is_empty() {
            return;
        }
        let Some(switch) = self.listeners.switch.take() else {
            return;
        };
        for old in std::mem::replace(&mut self.listeners.current, switch.listeners) {
            if self.swarm.remove_listener(old) && switch.fresh.is_some() {
                self.listeners.closing.insert(old);
            }
        }
        self.listeners.fresh_ports = switch.fresh;
        // Identify tells peers only when asked: the addresses they hold lead elsewhere now.
        let peers: Vec<PeerId> = self.swarm.connected_peers().copied().collect();
        self.swarm.behaviour_mut().identify.push(peers);
    }

    /// Listener `id` closed: one of a move's old ones, or a new one that failed before it was
    /// up (the switch is given up).
    pub(super) fn on_listener_closed(&mut self, id: ListenerId) {
        self.listeners.closing.remove(&id);
        let failed = (self.listeners.switch.as_ref()).is_some_and(|s| s.opening.contains(&id));
        if failed && let Some(switch) = self.listeners.switch.take() {
            tracing::warn!(
                "a new listener closed before it was up; keeping the listeners as they are"
            );
            for listener in switch.listeners.into_iter().filter(|l| *l != id) {
                self.swarm.remove_listener(listener);
            }
            self.listeners.moving.give_up();
        }
    }

    /// Dials every connected gateway once more, from a new port (`new_port`: a probe) or from
    /// the listen port; returns the dials.
    fn dial_gateways_again(&mut self, new_port: bool) -> Vec<ConnectionId> {
        let gateways: Vec<(PeerId, Multiaddr)> = (self.gateway_peers.iter())
            .map(|(peer, address)| (*peer, address.clone()))
            .collect();
        let mut dials = Vec::new();
        for (peer, address) in gateways {
            let opts = DialOpts::peer_id(peer)
                .addresses(vec![address])
                .condition(PeerCondition::Always);
            let opts = if new_port {
                opts.allocate_new_port().build()
            } else {
                opts.build()
            };
            let id = opts.connection_id();
            if self.swarm.dial(opts).is_ok() {
                self.gateway_dials.insert(id);
                dials.push(id);
            }
        }
        dials
    }
}
