//! What a node believes of the NAT it is behind, from what it knows of itself and what peers
//! observe of it.
//!
//! A node on a public address (an interface's, or `external_addresses` it was given) is not
//! behind a NAT. Otherwise the gateways it dials tell it (identify) the address they saw the
//! connection come from (the event loop takes the word of certified gateways only, on its own
//! dials of them, which leave from its listen port): on a NAT that keeps ports (a cone NAT, as Linux MASQUERADE and most
//! home routers) that is the router's address with this node's own listen port, because dials
//! reuse the listen port; a NAT that gives every connection a port of its own (symmetric, or
//! `--random-fully`) shows other ports, and different ones to different peers. Hole punching
//! works through the first kind and not through the second.

use std::collections::{HashMap, HashSet};

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

/// The evidence, and the belief it makes.
#[derive(Debug, Default)]
pub struct NatBelief {
    public_address: bool,
    listen_ports: HashSet<u16>,
    /// The address each public peer last observed on a connection this node dialled.
    observed: HashMap<PeerId, (std::net::IpAddr, u16)>,
}

impl NatBelief {
    /// This node listens at or was given `address` to announce.
    pub fn own_address(&mut self, address: &Multiaddr) {
        if is_relayed(address) {
            return;
        }
        if let Some(port) = tcp_port(address) {
            self.listen_ports.insert(port);
        }
        if Scope::of_address(address) == Some(Scope::Public) {
            self.public_address = true;
        }
    }

    /// `observer` saw a connection this node dialled come from `observed`. Returns the new
    /// belief when it changed.
    pub fn observed(&mut self, observer: PeerId, observed: &Multiaddr) -> Option<Nat> {
        let (Some(ip), Some(port)) = (first_ip(observed), tcp_port(observed)) else {
            return None;
        };
        // A peer on this node's LAN sees its private address: nothing about the NAT.
        if is_relayed(observed) || Scope::of(ip) != Scope::Public {
            return None;
        }
        let before = self.belief();
        self.observed.insert(observer, (ip, port));
        let after = self.belief();
        (after != before).then_some(after)
    }

    /// A peer left: what it observed no longer counts.
    pub fn forget(&mut self, observer: &PeerId) {
        self.observed.remove(observer);
    }

    pub fn belief(&self) -> Nat {
        if self.public_address {
            return Nat::Public;
        }
        let mut seen = self.observed.values();
        let Some(first) = seen.next() else {
            return Nat::Unknown;
        };
        let consistent = seen.all(|other| other == first);
        if consistent && self.listen_ports.contains(&first.1) {
            Nat::KeepsPorts
        } else {
            Nat::ChangesPorts
        }
    }
}

fn tcp_port(address: &Multiaddr) -> Option<u16> {
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
            nat.observed(PeerId::random(), &addr("/ip4/10.60.0.11/tcp/40123")),
            None
        );
        assert_eq!(
            nat.observed(PeerId::random(), &addr("/ip4/198.51.100.10/tcp/40123")),
            Some(Nat::KeepsPorts)
        );
        assert_eq!(
            nat.observed(PeerId::random(), &addr("/ip4/198.51.100.10/tcp/40123")),
            None
        );
    }

    #[test]
    fn other_ports_or_disagreeing_observers_mean_a_nat_that_changes_ports() {
        let mut nat = NatBelief::default();
        nat.own_address(&addr("/ip4/10.61.0.10/tcp/40123"));
        assert_eq!(
            nat.observed(PeerId::random(), &addr("/ip4/198.51.100.11/tcp/61001")),
            Some(Nat::ChangesPorts)
        );

        let mut nat = NatBelief::default();
        nat.own_address(&addr("/ip4/10.61.0.10/tcp/40123"));
        let (gateway, other) = (PeerId::random(), PeerId::random());
        nat.observed(gateway, &addr("/ip4/198.51.100.11/tcp/40123"));
        assert_eq!(
            nat.observed(other, &addr("/ip4/198.51.100.11/tcp/52000")),
            Some(Nat::ChangesPorts)
        );
        nat.forget(&other);
        assert_eq!(nat.belief(), Nat::KeepsPorts);
    }
}
