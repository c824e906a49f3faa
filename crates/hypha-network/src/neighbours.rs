//! Neighbours: peers behind the same NAT reach each other on their private addresses, which
//! are told only to them.
//!
//! A private address is worth something only to a peer on the same network, and names the
//! inside of a site to everyone else, so nodes do not announce theirs (unless the whole
//! deployment is one private network; see `announce_listen_address`). Two peers behind one
//! NAT still meet first through a gateway's relay, since neither announces an address the
//! other can reach; a hole punch between them would need the NAT to hairpin, which most do
//! not. So over each relayed connection it dialled, a node tells the peer its public IPs as
//! gateways observe them ([`Request::Neighbour`](hypha_messages::Request::Neighbour)); a peer
//! that sees the same IPs answers with the private addresses it listens on, and the asker
//! dials them: the direct connection replaces the relay like a punched one would.
//!
//! This reaches across subnets behind one NAT (an office's two VLANs), which multicast
//! discovery (mDNS) does not, and needs nothing a cloud network may block. A certified peer
//! that claims the asker's IPs learns its private addresses (no use from outside) and can
//! name at most [`MAX_ADDRESSES`] private addresses for it to dial (judged like any other dial
//! by the dial budget; only those exact addresses become dialable, the latest 64 of all
//! neighbours'); public, loopback, link-local and unspecified addresses in an answer are
//! ignored.
//!
//! Pure rules; the event loop sends, answers and dials.

use std::{collections::HashSet, net::IpAddr};

use libp2p::{Multiaddr, PeerId, multiaddr::Protocol};

use crate::{
    nat::tcp_port,
    reach::{Scope, first_ip, is_relayed},
};

/// The most addresses an answer names, and the most of them dialled.
pub const MAX_ADDRESSES: usize = 8;

/// The question: this node's public IPs, as text.
pub fn question(public_ips: &HashSet<IpAddr>) -> Option<Vec<String>> {
    let mut ips: Vec<String> = public_ips.iter().map(IpAddr::to_string).collect();
    ips.sort();
    (!ips.is_empty()).then_some(ips)
}

/// The answer to a peer that says it is seen at `asked`: the private addresses of `listening`
/// when this node is seen at one of the same public IPs, else none.
pub fn answer<'a>(
    asked: &[String],
    public_ips: &HashSet<IpAddr>,
    listening: impl IntoIterator<Item = &'a Multiaddr>,
) -> Vec<String> {
    let shared = asked
        .iter()
        .filter_map(|ip| ip.parse::<IpAddr>().ok())
        .any(|ip| public_ips.contains(&ip));
    if !shared {
        return Vec::new();
    }
    listening
        .into_iter()
        .filter(|address| is_private_tcp(address))
        .take(MAX_ADDRESSES)
        .map(Multiaddr::to_string)
        .collect()
}

/// The addresses of `peer`'s answer worth dialling: private TCP addresses, with the peer's id.
pub fn to_dial(peer: PeerId, answer: &[String]) -> Vec<Multiaddr> {
    answer
        .iter()
        .take(MAX_ADDRESSES)
        .filter_map(|text| text.parse::<Multiaddr>().ok())
        .filter(is_private_tcp)
        .filter(|address| {
            // Another peer's id in it would make the dial reach someone else.
            address.iter().all(|p| match p {
                Protocol::P2p(id) => id == peer,
                _ => true,
            })
        })
        .map(|address| match address.iter().last() {
            Some(Protocol::P2p(_)) => address,
            _ => address.with(Protocol::P2p(peer)),
        })
        .collect()
}

/// A TCP address in a private range, link-local ones left out (they lead nowhere off-link).
fn is_private_tcp(address: &Multiaddr) -> bool {
    let link_local = |ip: IpAddr| match ip {
        IpAddr::V4(v4) => v4.is_link_local(),
        IpAddr::V6(v6) => v6.is_unicast_link_local(),
    };
    !is_relayed(address)
        && tcp_port(address).is_some()
        && first_ip(address).is_some_and(|ip| Scope::of(ip) == Scope::Private && !link_local(ip))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addresses(texts: &[&str]) -> Vec<Multiaddr> {
        texts.iter().map(|t| t.parse().unwrap()).collect()
    }

    fn ips(texts: &[&str]) -> HashSet<IpAddr> {
        texts.iter().map(|t| t.parse().unwrap()).collect()
    }

    #[test]
    fn only_a_peer_seen_at_the_same_public_ip_hears_the_private_addresses() {
        let listening = addresses(&[
            "/ip4/192.168.1.7/tcp/4001",
            "/ip4/127.0.0.1/tcp/4001",
            "/ip4/203.0.113.9/tcp/4001",
            "/ip4/10.1.2.3/udp/4001/quic-v1",
            "/ip4/169.254.3.4/tcp/4001",
        ]);
        let mine = ips(&["198.51.100.1"]);
        assert_eq!(
            answer(&["198.51.100.1".into()], &mine, &listening),
            vec!["/ip4/192.168.1.7/tcp/4001".to_string()]
        );
        assert!(answer(&["198.51.100.2".into()], &mine, &listening).is_empty());
        assert!(answer(&["not an ip".into()], &mine, &listening).is_empty());
        assert!(answer(&[], &mine, &listening).is_empty());
    }

    #[test]
    fn only_private_addresses_of_the_peer_that_answered_are_dialled() {
        let peer = PeerId::random();
        let someone_else = PeerId::random();
        let answer: Vec<String> = vec![
            "/ip4/192.168.1.7/tcp/4001".into(),
            format!("/ip4/10.0.0.5/tcp/4001/p2p/{peer}"),
            format!("/ip4/10.0.0.6/tcp/4001/p2p/{someone_else}"),
            "/ip4/203.0.113.9/tcp/4001".into(),
            "/ip4/127.0.0.1/tcp/4001".into(),
            "/ip4/0.0.0.0/tcp/4001".into(),
            "garbage".into(),
        ];
        assert_eq!(
            to_dial(peer, &answer),
            vec![
                format!("/ip4/192.168.1.7/tcp/4001/p2p/{peer}")
                    .parse::<Multiaddr>()
                    .unwrap(),
                format!("/ip4/10.0.0.5/tcp/4001/p2p/{peer}")
                    .parse()
                    .unwrap(),
            ]
        );
        let flood: Vec<String> = (0..100)
            .map(|i| format!("/ip4/10.0.0.{i}/tcp/4001"))
            .collect();
        assert_eq!(to_dial(peer, &flood).len(), MAX_ADDRESSES);
    }

    #[test]
    fn a_node_no_gateway_has_observed_asks_nothing() {
        assert_eq!(question(&HashSet::new()), None);
        assert_eq!(
            question(&ips(&["198.51.100.1"])),
            Some(vec!["198.51.100.1".to_string()])
        );
    }
}
