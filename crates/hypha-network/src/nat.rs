//! What a node believes of the NAT it is behind, from what it knows of itself and what peers
//! observe of it.
//!
//! A node on a public address (an interface's, or `external_addresses` it was given) is not
//! behind a NAT. Otherwise the gateways it dials tell it (identify) the address they saw the
//! connection come from (the event loop takes the word of certified gateways only, on its own
//! dials of them, which leave from its listen port): on a NAT that keeps ports (a cone NAT, as
//! Linux MASQUERADE and most home routers) that is the router's address with this node's own
//! listen port, because dials reuse the listen port; a NAT that gives every connection a port
//! of its own (symmetric, or `--random-fully`) shows other ports, and different ones to
//! different peers. Hole punching works through the first kind and not through the second.
//!
//! One observation of its own port is enough to call a NAT one that keeps ports: a NAT that
//! keeps ports still gives another port where its own is taken, by a second connection to the
//! same gateway address (which cannot leave from the listen port) or by another machine behind
//! the same NAT listening on the same port (see [`port_move`](crate::port_move)).

use std::{
    collections::{HashMap, HashSet},
    net::SocketAddr,
    sync::{Arc, Mutex},
};

use libp2p::{Multiaddr, PeerId, multiaddr::Protocol};

use crate::reach::{Scope, first_ip, is_relayed};

/// What the node believes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Nat {
    /// No public peer has said how it sees this node yet.
    Unknown,
    /// On a public address: reachable directly.
    Public,
    /// Behind a NAT that keeps this node's port: hole punching can work.
    KeepsPorts,
    /// Behind a NAT that changes ports: hole punching will fail, peers go through the relay.
    ChangesPorts,
}

impl std::fmt::Display for Nat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Nat::Unknown => "unknown (no public peer has observed this node yet)",
            Nat::Public => "none: on a public address, reachable directly",
            Nat::KeepsPorts => {
                "behind a NAT that keeps ports (cone): hole punching can make direct connections"
            }
            Nat::ChangesPorts => {
                "behind a NAT that changes ports (symmetric): hole punching will fail, peers reach this node through a gateway's relay"
            }
        })
    }
}

/// The local port each TCP connection this node dialled left from, by the address it
/// reached (the latest connection to each; at most [`DIALS_KEPT`]): what a peer observes of a
/// connection is weighed against the port it really left from. A dial meant to leave from the
/// listen port leaves from another where that pair of addresses is taken (a second connection
/// to the same gateway, a socket of an earlier run in `TIME_WAIT`). Filled by the transport.
#[derive(Debug, Clone, Default)]
pub struct DialedFrom(Arc<Mutex<HashMap<SocketAddr, u16>>>);

/// How many dials [`DialedFrom`] remembers.
const DIALS_KEPT: usize = 4096;

impl DialedFrom {
    /// A dial reached `remote` from `local`.
    pub fn record(&self, remote: SocketAddr, local: SocketAddr) {
        let mut dials = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if dials.len() >= DIALS_KEPT && !dials.contains_key(&remote) {
            dials.clear();
        }
        dials.insert(remote, local.port());
    }

    /// The local port of the latest dial to `remote` (an IP and TCP address), if known.
    pub fn port_to(&self, remote: &Multiaddr) -> Option<u16> {
        let remote = SocketAddr::new(first_ip(remote)?, tcp_port(remote)?);
        let dials = self.0.lock().unwrap_or_else(|p| p.into_inner());
        dials.get(&remote).copied()
    }
}

/// The evidence, and the belief it makes.
#[derive(Debug, Default)]
pub struct NatBelief {
    public_address: bool,
    /// The addresses this node listens on (not relay circuits).
    listening: HashSet<Multiaddr>,
    /// The address and the ports each public peer observed on connections this node dialled.
    observed: HashMap<PeerId, Observed>,
}

/// What one peer observed.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Observed {
    ip: std::net::IpAddr,
    /// The latest ports, at most [`PORTS_KEPT`], each with whether the NAT kept it (it is the
    /// port the connection left from).
    ports: Vec<(u16, bool)>,
}

/// How many observed ports are kept per observer.
const PORTS_KEPT: usize = 8;

impl NatBelief {
    /// This node listens at or was given `address` to announce.
    pub fn own_address(&mut self, address: &Multiaddr) {
        if is_relayed(address) {
            return;
        }
        if tcp_port(address).is_some() {
            self.listening.insert(address.clone());
        }
        if Scope::of_address(address) == Some(Scope::Public) {
            self.public_address = true;
        }
    }

    /// This node no longer listens at `address`.
    pub fn forget_address(&mut self, address: &Multiaddr) {
        self.listening.remove(address);
    }

    /// `observer` saw a connection this node dialled, from local port `local_port` where
    /// known (else a listen port, as dials reuse it), come from `observed`. Returns the new
    /// belief when it changed.
    pub fn observed(
        &mut self,
        observer: PeerId,
        observed: &Multiaddr,
        local_port: Option<u16>,
    ) -> Option<Nat> {
        let (Some(ip), Some(port)) = (first_ip(observed), tcp_port(observed)) else {
            return None;
        };
        // A peer on this node's LAN sees its private address: nothing about the NAT.
        if is_relayed(observed) || Scope::of(ip) != Scope::Public {
            return None;
        }
        let kept = match local_port {
            Some(local) => local == port,
            None => self.listen_ports().contains(&port),
        };
        let before = self.belief();
        let seen = self.observed.entry(observer).or_insert(Observed {
            ip,
            ports: Vec::new(),
        });
        if seen.ip != ip {
            *seen = Observed {
                ip,
                ports: Vec::new(),
            };
        }
        seen.ports.retain(|(p, _)| *p != port);
        seen.ports.push((port, kept));
        if seen.ports.len() > PORTS_KEPT {
            seen.ports.remove(0);
        }
        let after = self.belief();
        (after != before).then_some(after)
    }

    /// A peer left: what it observed no longer counts.
    pub fn forget(&mut self, observer: &PeerId) {
        self.observed.remove(observer);
    }

    /// Whether some peer saw a dial of this node leave its NAT from `port`, the port it left
    /// from.
    pub fn kept(&self, port: u16) -> bool {
        self.observed
            .values()
            .any(|o| o.ports.contains(&(port, true)))
    }

    /// Whether `observed` (as a peer saw a connection this node dialled from `local_port`,
    /// where known) is an address peers can punch to: on one of this node's listen ports,
    /// the port the connection left from (a private address where the NAT sits inside a
    /// private network).
    pub fn on_listen_port(&self, observed: &Multiaddr, local_port: Option<u16>) -> bool {
        let Some(port) = tcp_port(observed) else {
            return false;
        };
        first_ip(observed).is_some_and(|ip| matches!(Scope::of(ip), Scope::Public | Scope::Private))
            && !is_relayed(observed)
            && self.listen_ports().contains(&port)
            && local_port.is_none_or(|local| local == port)
    }

    /// This node's public IPs: those it listens on, and those gateways observed its dials
    /// come from (its NAT's).
    pub fn public_ips(&self) -> HashSet<std::net::IpAddr> {
        let listening = self.listening.iter().filter_map(first_ip);
        (listening.filter(|ip| Scope::of(*ip) == Scope::Public))
            .chain(self.observed.values().map(|o| o.ip))
            .collect()
    }

    /// The ports this node listens on.
    pub fn listen_ports(&self) -> HashSet<u16> {
        self.listening.iter().filter_map(tcp_port).collect()
    }

    pub fn belief(&self) -> Nat {
        if self.public_address {
            return Nat::Public;
        }
        let mut seen = self.observed.values();
        let Some(first) = seen.next() else {
            return Nat::Unknown;
        };
        let one_address = seen.all(|other| other.ip == first.ip);
        let kept = self
            .observed
            .values()
            .any(|o| o.ports.iter().any(|(_, kept)| *kept));
        if one_address && kept {
            Nat::KeepsPorts
        } else {
            Nat::ChangesPorts
        }
    }
}

pub(crate) fn tcp_port(address: &Multiaddr) -> Option<u16> {
    address.iter().find_map(|p| match p {
        Protocol::Tcp(port) => Some(port),
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(text: &str) -> Multiaddr {
        text.parse().unwrap()
    }

    #[test]
    fn a_node_with_a_public_address_is_behind_no_nat() {
        let mut nat = NatBelief::default();
        nat.own_address(&addr("/ip4/198.51.100.2/tcp/4001"));
        assert_eq!(nat.belief(), Nat::Public);
    }

    #[test]
    fn observations_of_its_own_port_mean_a_nat_that_keeps_ports() {
        let mut nat = NatBelief::default();
        nat.own_address(&addr("/ip4/10.60.0.10/tcp/40123"));
        nat.own_address(&addr("/ip4/127.0.0.1/tcp/40123"));
        assert_eq!(nat.belief(), Nat::Unknown);
        // A peer on the LAN says nothing about the NAT.
        assert_eq!(
            nat.observed(PeerId::random(), &addr("/ip4/10.60.0.11/tcp/40123"), None),
            None
        );
        assert_eq!(
            nat.observed(
                PeerId::random(),
                &addr("/ip4/198.51.100.10/tcp/40123"),
                None
            ),
            Some(Nat::KeepsPorts)
        );
        assert_eq!(
            nat.observed(
                PeerId::random(),
                &addr("/ip4/198.51.100.10/tcp/40123"),
                None
            ),
            None
        );
    }

    #[test]
    fn only_other_ports_or_other_addresses_mean_a_nat_that_changes_ports() {
        let mut nat = NatBelief::default();
        nat.own_address(&addr("/ip4/10.61.0.10/tcp/40123"));
        assert_eq!(
            nat.observed(
                PeerId::random(),
                &addr("/ip4/198.51.100.11/tcp/61001"),
                None
            ),
            Some(Nat::ChangesPorts)
        );

        // Two public addresses: several NATs, or one that changes its address.
        let mut nat = NatBelief::default();
        nat.own_address(&addr("/ip4/10.61.0.10/tcp/40123"));
        let (gateway, other) = (PeerId::random(), PeerId::random());
        nat.observed(gateway, &addr("/ip4/198.51.100.11/tcp/40123"), None);
        assert_eq!(
            nat.observed(other, &addr("/ip4/198.51.100.99/tcp/40123"), None),
            Some(Nat::ChangesPorts)
        );
        nat.forget(&other);
        assert_eq!(nat.belief(), Nat::KeepsPorts);
    }

    #[test]
    fn a_second_connection_from_another_port_leaves_a_nat_that_keeps_ports() {
        // The second dial of one gateway cannot leave from the listen port (the first holds
        // that pair of addresses): the NAT keeps its port all the same.
        let mut nat = NatBelief::default();
        nat.own_address(&addr("/ip4/10.60.0.11/tcp/43425"));
        let gateway = PeerId::random();
        assert_eq!(
            nat.observed(gateway, &addr("/ip4/198.51.100.10/tcp/43425"), None),
            Some(Nat::KeepsPorts)
        );
        assert_eq!(
            nat.observed(gateway, &addr("/ip4/198.51.100.10/tcp/54948"), None),
            None
        );
        // Seen the other way round, too.
        let mut nat = NatBelief::default();
        nat.own_address(&addr("/ip4/10.60.0.11/tcp/43425"));
        nat.observed(gateway, &addr("/ip4/198.51.100.10/tcp/54948"), None);
        assert_eq!(
            nat.observed(gateway, &addr("/ip4/198.51.100.10/tcp/43425"), None),
            Some(Nat::KeepsPorts)
        );
    }

    #[test]
    fn what_a_dial_left_from_decides_whether_the_nat_kept_it() {
        let mut nat = NatBelief::default();
        nat.own_address(&addr("/ip4/10.60.0.11/tcp/4001"));
        let gateway = PeerId::random();
        // Restarted within TIME_WAIT: the dial meant for the listen port left from 51234,
        // which the NAT kept.
        assert_eq!(
            nat.observed(gateway, &addr("/ip4/198.51.100.10/tcp/51234"), Some(51234)),
            Some(Nat::KeepsPorts)
        );
        assert!(!nat.on_listen_port(&addr("/ip4/198.51.100.10/tcp/51234"), Some(51234)));
        // From the listen port, seen on another: the NAT gave it another.
        let mut nat = NatBelief::default();
        nat.own_address(&addr("/ip4/10.60.0.11/tcp/4001"));
        assert_eq!(
            nat.observed(gateway, &addr("/ip4/198.51.100.10/tcp/23456"), Some(4001)),
            Some(Nat::ChangesPorts)
        );
        assert!(!nat.on_listen_port(&addr("/ip4/198.51.100.10/tcp/4001"), Some(23456)));
        assert!(nat.on_listen_port(&addr("/ip4/198.51.100.10/tcp/4001"), Some(4001)));
    }

    #[test]
    fn dials_are_known_by_the_address_they_reached() {
        let dials = DialedFrom::default();
        let gateway: SocketAddr = "198.51.100.2:4001".parse().unwrap();
        dials.record(gateway, "10.60.0.11:4001".parse().unwrap());
        dials.record(gateway, "10.60.0.11:51234".parse().unwrap());
        assert_eq!(
            dials.port_to(&addr("/ip4/198.51.100.2/tcp/4001/p2p/12D3KooWRBhwfeP2Y4TCx1SM6s9rUoHhR5STiGwxBhgFRcw3UERE")),
            Some(51234)
        );
        assert_eq!(
            dials.port_to(&addr("/dns4/gateway.example.org/tcp/4001")),
            None
        );
    }

    #[test]
    fn a_port_given_up_no_longer_counts() {
        let mut nat = NatBelief::default();
        let configured = addr("/ip4/10.60.0.11/tcp/4001");
        nat.own_address(&configured);
        nat.observed(PeerId::random(), &addr("/ip4/198.51.100.10/tcp/4001"), None);
        assert!(nat.on_listen_port(&addr("/ip4/198.51.100.10/tcp/4001"), None));
        nat.forget_address(&configured);
        nat.own_address(&addr("/ip4/10.60.0.11/tcp/40500"));
        assert!(!nat.on_listen_port(&addr("/ip4/198.51.100.10/tcp/4001"), None));
        assert_eq!(nat.listen_ports(), HashSet::from([40500]));
    }
}
