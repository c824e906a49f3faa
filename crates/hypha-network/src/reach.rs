//! Which addresses lead somewhere from this node, and so are worth dialling.
//!
//! Peers announce every address they listen on; behind NATs most of them lead nowhere from
//! here, and some lead to the wrong place: a peer's `127.0.0.1` is this machine, and its
//! `10.0.0.5` is whatever host has that address on this node's LAN, if any. Dialling them
//! wastes the time of a connect that never answers, or reaches this node itself. So an
//! address is dialled only where it can work:
//!
//! - **loopback** only in a network that lives on one machine: every gateway this node joins,
//!   and every address it listens on, is a loopback address (the quickstart, the tests);
//! - a **configured gateway's** address always, whatever its scope: the operator named it
//!   (a node that listens on every interface and joins a gateway on `127.0.0.1`, as the
//!   README's tour does, must reach that gateway even though other peers' loopback addresses
//!   lead nowhere from it);
//! - **private** ranges (RFC 1918, shared 100.64.0.0/10, unique-local fc00::/7) where this
//!   node is on the same network: a network of one of its interfaces holds the address, the
//!   network was seen to route (a direct connection came from or went to an address of the
//!   same /24, or /64), or a gateway this node joins sits in the same private range (a
//!   deployment on one routed private network);
//! - **public** addresses always;
//! - never anything in `exclude_cidr`.
//!
//! The check sits in the transport, under DNS resolution, so it holds for every dial whatever
//! asked for it (Kademlia queries, DCUtR, the application) and for names that resolve into a
//! range.

use std::{
    collections::{HashSet, VecDeque},
    net::IpAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use ipnet::IpNet;
use libp2p::{Multiaddr, multiaddr::Protocol};

use crate::ExcludedRanges;

/// How many addresses told by neighbours are dialable at once.
const NEIGHBOUR_ADDRESSES_KEPT: usize = 64;

/// How long the list of this machine's interfaces is trusted before it is read again (a
/// laptop moves between networks).
const INTERFACES_FRESH: Duration = Duration::from_secs(10);

/// Why an address is not dialled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unreachable {
    Excluded,
    Unspecified,
    Loopback,
    ForeignPrivate,
}

impl std::fmt::Display for Unreachable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Unreachable::Excluded => "the address lies inside exclude_cidr",
            Unreachable::Unspecified => "an unspecified address (0.0.0.0, ::) leads to this machine",
            Unreachable::Loopback => {
                "a loopback address leads to this machine, and this node's network is not on one machine"
            }
            Unreachable::ForeignPrivate => {
                "a private address on no network this machine is on (another site's LAN)"
            }
        })
    }
}

/// What kind of address an IP is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// `0.0.0.0`, `::`: a connect to it reaches this machine.
    Unspecified,
    Loopback,
    Private,
    Public,
}

impl Scope {
    pub fn of(ip: IpAddr) -> Scope {
        match ip.to_canonical() {
            IpAddr::V4(v4) if v4.is_unspecified() => Scope::Unspecified,
            IpAddr::V6(v6) if v6.is_unspecified() => Scope::Unspecified,
            IpAddr::V4(v4) if v4.is_loopback() => Scope::Loopback,
            IpAddr::V4(v4) if v4.is_private() || is_shared(v4) || v4.is_link_local() => {
                Scope::Private
            }
            IpAddr::V6(v6) if v6.is_loopback() => Scope::Loopback,
            IpAddr::V6(v6) if v6.is_unique_local() || v6.is_unicast_link_local() => Scope::Private,
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => Scope::of(IpAddr::V4(v4)),
                None => Scope::Public,
            },
            IpAddr::V4(_) => Scope::Public,
        }
    }

    /// The scope of a multiaddr's first IP component; `None` for addresses without one (DNS
    /// names before resolution, relay circuits by peer id).
    pub fn of_address(address: &Multiaddr) -> Option<Scope> {
        first_ip(address).map(Scope::of)
    }
}

/// 100.64.0.0/10, the carrier-grade NAT range.
fn is_shared(ip: std::net::Ipv4Addr) -> bool {
    let [a, b, ..] = ip.octets();
    a == 100 && (b & 0b1100_0000) == 64
}

/// The first IP component of `address`, an IPv4-mapped IPv6 address as the IPv4 address it
/// is (so that ranges and scopes judge what the connect reaches).
pub fn first_ip(address: &Multiaddr) -> Option<IpAddr> {
    address.iter().find_map(|p| match p {
        Protocol::Ip4(ip) => Some(IpAddr::V4(ip)),
        Protocol::Ip6(ip) => Some(IpAddr::V6(ip).to_canonical()),
        _ => None,
    })
}

/// `address` without its `/p2p/…` components: the transport address a dial connects to.
fn without_peer_id(address: &Multiaddr) -> Multiaddr {
    address
        .iter()
        .filter(|p| !matches!(p, Protocol::P2p(_)))
        .collect()
}

/// The private range (10/8, 172.16/12, 192.168/16, 100.64/10, fc00::/7) holding `ip`.
fn private_range_of(ip: IpAddr) -> Option<IpNet> {
    let ranges = [
        "10.0.0.0/8",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "100.64.0.0/10",
        "fc00::/7",
    ];
    ranges
        .iter()
        .filter_map(|r| r.parse::<IpNet>().ok())
        .find(|net| net.contains(&ip))
}

/// The /24 (IPv4) or /64 (IPv6) around `ip`: what one LAN usually is.
fn lan_of(ip: IpAddr) -> Option<IpNet> {
    let prefix = if ip.is_ipv4() { 24 } else { 64 };
    IpNet::new(ip, prefix).ok().map(|net| net.trunc())
}

/// Decides which addresses are dialled; cheap to clone (one shared state).
#[derive(Debug, Clone)]
pub struct Reach(Arc<Inner>);

#[derive(Debug)]
struct Inner {
    excluded: ExcludedRanges,
    one_machine: bool,
    /// The configured gateways' addresses, without their `/p2p/…`.
    gateways: HashSet<Multiaddr>,
    /// The private ranges of configured gateways: a deployment on one routed private network.
    gateway_ranges: Vec<IpNet>,
    /// Private ranges that route here: learnt from direct connections, and those of private
    /// gateways.
    routed: Mutex<HashSet<IpNet>>,
    /// Addresses neighbours told this node, dialled though their range is not known to route.
    neighbours: Mutex<VecDeque<Multiaddr>>,
    /// A gateway saw this node at a private or loopback address: it is on the deployment's
    /// own network, not behind a NAT to it.
    inside: AtomicBool,
    interfaces: Mutex<Option<(Instant, Vec<IpNet>)>>,
}

impl Reach {
    /// The reach of a node that joins `gateways` and listens on `listen` (as configured,
    /// wildcards included).
    pub fn new(excluded: ExcludedRanges, gateways: &[Multiaddr], listen: &[Multiaddr]) -> Self {
        let is_loopback = |a: &Multiaddr| Scope::of_address(a) == Some(Scope::Loopback);
        let one_machine = gateways.iter().all(is_loopback) && listen.iter().all(is_loopback);
        let gateway_ranges: Vec<IpNet> = gateways
            .iter()
            .filter_map(first_ip)
            .filter_map(private_range_of)
            .collect();
        Reach(Arc::new(Inner {
            excluded,
            one_machine,
            gateways: gateways.iter().map(without_peer_id).collect(),
            routed: Mutex::new(gateway_ranges.iter().copied().collect()),
            neighbours: Mutex::new(VecDeque::new()),
            inside: AtomicBool::new(false),
            gateway_ranges,
            interfaces: Mutex::new(None),
        }))
    }

    /// Whether this node's whole network is on this machine (loopback addresses are dialled).
    pub fn one_machine(&self) -> bool {
        self.0.one_machine
    }

    /// Whether `address` is worth dialling from here, and why not.
    pub fn check(&self, address: &Multiaddr) -> Result<(), Unreachable> {
        if self.0.excluded.excludes(address) {
            return Err(Unreachable::Excluded);
        }
        if self.0.gateways.contains(&without_peer_id(address)) {
            return Ok(());
        }
        let Some(ip) = first_ip(address) else {
            return Ok(());
        };
        match Scope::of(ip) {
            Scope::Unspecified => Err(Unreachable::Unspecified),
            Scope::Public => Ok(()),
            Scope::Loopback if self.0.one_machine => Ok(()),
            Scope::Loopback => Err(Unreachable::Loopback),
            Scope::Private if self.is_routed(ip) || self.is_neighbour(address) => Ok(()),
            Scope::Private => Err(Unreachable::ForeignPrivate),
        }
    }

    /// Whether this node announces `address`, one it listens on, to every peer: public
    /// addresses, loopback in a network on one machine, and private addresses only where the
    /// whole deployment is one private network (a gateway in the same private range, or one
    /// that saw this node at a private address: [`observed_by_gateway`](Self::observed_by_gateway)); other
    /// private addresses are told only to peers behind the same NAT ([`crate::neighbours`]).
    /// Its circuits through gateways' relays too: how a node behind a NAT is reached from
    /// outside, and the address its DHT records carry (a provider without one is never handed
    /// out). Never wildcards, excluded ranges, or container and VM bridges (the same addresses
    /// on every machine: docker0 is 172.17.0.1 everywhere).
    pub fn announces(&self, address: &Multiaddr) -> bool {
        if self.0.excluded.excludes(address) {
            return false;
        }
        if is_relayed(address) {
            return true;
        }
        let Some(ip) = first_ip(address) else {
            return false;
        };
        match Scope::of(ip) {
            Scope::Public => true,
            Scope::Private => {
                (self.in_private_deployment(ip) || self.0.inside.load(Ordering::Relaxed))
                    && !on_virtual_bridge(ip)
            }
            Scope::Loopback => self.one_machine(),
            Scope::Unspecified => false,
        }
    }

    /// Whether `address` is worth keeping for others (in the routing table, handed out to
    /// other peers): everything but excluded ranges and, outside a one-machine network,
    /// loopback. A private address may be reachable from the peer that asks.
    pub fn worth_keeping(&self, address: &Multiaddr) -> bool {
        match self.check(address) {
            Ok(()) | Err(Unreachable::ForeignPrivate) => true,
            Err(Unreachable::Excluded | Unreachable::Unspecified | Unreachable::Loopback) => false,
        }
    }

    /// A direct connection with `remote` (an address of the peer, not a relay circuit)
    /// shows that its LAN routes to this node.
    pub fn learn_direct(&self, remote: &Multiaddr) {
        if is_relayed(remote) {
            return;
        }
        if let Some(ip) = first_ip(remote).filter(|ip| Scope::of(*ip) == Scope::Private)
            && let Some(lan) = lan_of(ip)
        {
            self.0
                .routed
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(lan);
        }
    }

    /// A peer behind this node's NAT said it listens at `address` ([`crate::neighbours`]):
    /// that one address is dialled, nothing else of its network until a connection there
    /// shows the network routes ([`learn_direct`](Self::learn_direct)). The latest
    /// [`NEIGHBOUR_ADDRESSES_KEPT`] are kept.
    pub fn allow_neighbour(&self, address: &Multiaddr) {
        let address = without_peer_id(address);
        let mut allowed = (self.0.neighbours.lock()).unwrap_or_else(|p| p.into_inner());
        if !allowed.contains(&address) {
            allowed.push_back(address);
            if allowed.len() > NEIGHBOUR_ADDRESSES_KEPT {
                allowed.pop_front();
            }
        }
    }

    fn is_neighbour(&self, address: &Multiaddr) -> bool {
        let allowed = (self.0.neighbours.lock()).unwrap_or_else(|p| p.into_inner());
        allowed.contains(&without_peer_id(address))
    }

    /// A gateway observed this node at `observed`. At a private or loopback address, the node
    /// and the gateway share a network (a private deployment, one machine with a gateway on
    /// `127.0.0.1`, a gateway given by name): its private addresses are announced from now.
    /// Returns whether that is new.
    pub fn observed_by_gateway(&self, observed: &Multiaddr) -> bool {
        let inside = matches!(
            Scope::of_address(observed),
            Some(Scope::Private | Scope::Loopback)
        ) && !is_relayed(observed);
        inside && !self.0.inside.swap(true, Ordering::Relaxed)
    }

    /// Whether `ip` lies in the private range of a configured gateway: the deployment lives
    /// on one routed private network, where private addresses are announced to every peer.
    fn in_private_deployment(&self, ip: IpAddr) -> bool {
        self.0.gateway_ranges.iter().any(|net| net.contains(&ip))
    }

    fn is_routed(&self, ip: IpAddr) -> bool {
        let routed = self.0.routed.lock().unwrap_or_else(|p| p.into_inner());
        routed.iter().any(|net| net.contains(&ip)) || self.on_link(ip)
    }

    /// Whether a network of one of this machine's interfaces holds `ip`.
    fn on_link(&self, ip: IpAddr) -> bool {
        let mut cached = self.0.interfaces.lock().unwrap_or_else(|p| p.into_inner());
        let fresh = cached
            .as_ref()
            .is_some_and(|(read, _)| read.elapsed() < INTERFACES_FRESH);
        if !fresh {
            *cached = Some((Instant::now(), interface_networks()));
        }
        cached
            .as_ref()
            .is_some_and(|(_, nets)| nets.iter().any(|net| net.contains(&ip)))
    }
}

/// Name prefixes of the interfaces container runtimes and hypervisors make: the same
/// addresses on every machine that runs them.
const VIRTUAL_BRIDGES: [&str; 8] = [
    "docker", "br-", "virbr", "cni", "flannel", "cali", "kube", "podman",
];

/// Whether `ip` belongs to a container or VM bridge of this machine (`docker0`, `virbr0`, …).
pub fn on_virtual_bridge(ip: IpAddr) -> bool {
    interfaces().any(|(name, own, _)| {
        own == ip
            && VIRTUAL_BRIDGES
                .iter()
                .any(|prefix| name.starts_with(prefix))
    })
}

/// The networks of this machine's interfaces (address and netmask), loopback left out.
pub fn interface_networks() -> Vec<IpNet> {
    interfaces()
        .filter(|(_, ip, _)| Scope::of(*ip) != Scope::Loopback)
        .filter_map(|(_, ip, mask)| Some(IpNet::with_netmask(ip, mask?).ok()?.trunc()))
        .collect()
}

/// This machine's interface addresses: name, address and netmask.
fn interfaces() -> impl Iterator<Item = (String, IpAddr, Option<IpAddr>)> {
    let ip_of = |address: &nix::sys::socket::SockaddrStorage| {
        address
            .as_sockaddr_in()
            .map(|a| IpAddr::V4(a.ip()))
            .or_else(|| address.as_sockaddr_in6().map(|a| IpAddr::V6(a.ip())))
    };
    nix::ifaddrs::getifaddrs()
        .into_iter()
        .flatten()
        .filter_map(move |interface| {
            let ip = ip_of(interface.address.as_ref()?)?;
            let mask = interface.netmask.as_ref().and_then(ip_of);
            Some((interface.interface_name, ip, mask))
        })
}

/// Whether `address` goes through a relay (`…/p2p-circuit/…`).
pub fn is_relayed(address: &Multiaddr) -> bool {
    address.iter().any(|p| matches!(p, Protocol::P2pCircuit))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(text: &str) -> Multiaddr {
        text.parse().unwrap()
    }

    /// A private address names the inside of a site: announced only where the deployment is
    /// one private network; told to peers behind the same NAT otherwise (`neighbours`).
    #[test]
    fn private_addresses_are_announced_only_in_a_private_deployment() {
        let none = ExcludedRanges::default();
        let listen = [addr("/ip4/0.0.0.0/tcp/4001")];
        let behind_a_nat = Reach::new(none.clone(), &[addr("/ip4/198.51.100.1/tcp/4001")], &listen);
        assert!(behind_a_nat.announces(&addr("/ip4/203.0.113.7/tcp/4001")));
        assert!(!behind_a_nat.announces(&addr("/ip4/192.168.1.7/tcp/4001")));
        assert!(!behind_a_nat.announces(&addr("/ip4/127.0.0.1/tcp/4001")));
        assert!(!behind_a_nat.announces(&addr("/ip4/0.0.0.0/tcp/4001")));
        assert!(behind_a_nat.announces(&addr(
            "/ip4/198.51.100.1/tcp/4001/p2p/12D3KooWLaRKzpDpPg3aVQtprKVWsunLndN3Db3DsnoDqNQNxKrm/p2p-circuit"
        )));

        let private = Reach::new(none.clone(), &[addr("/ip4/10.0.0.1/tcp/4001")], &listen);
        assert!(private.announces(&addr("/ip4/10.8.0.7/tcp/4001")));
        assert!(!private.announces(&addr("/ip4/192.168.1.7/tcp/4001")));

        // A gateway on this machine, or given by name, that sees the node from inside.
        let by_name = Reach::new(none, &[addr("/dns4/gateway.lab/tcp/4001")], &listen);
        assert!(!by_name.announces(&addr("/ip4/192.168.1.7/tcp/4001")));
        assert!(!by_name.observed_by_gateway(&addr("/ip4/198.51.100.9/tcp/4001")));
        assert!(!by_name.announces(&addr("/ip4/192.168.1.7/tcp/4001")));
        assert!(by_name.observed_by_gateway(&addr("/ip4/192.168.1.7/tcp/4001")));
        assert!(by_name.announces(&addr("/ip4/192.168.1.7/tcp/4001")));
        assert!(!by_name.observed_by_gateway(&addr("/ip4/192.168.1.7/tcp/4001")));

        let one_machine = Reach::new(
            ExcludedRanges::default(),
            &[addr("/ip4/127.0.0.1/tcp/4001")],
            &[addr("/ip4/127.0.0.1/tcp/0")],
        );
        assert!(one_machine.announces(&addr("/ip4/127.0.0.1/tcp/4001")));
    }

    #[test]
    fn scopes() {
        for (ip, scope) in [
            ("127.0.0.1", Scope::Loopback),
            ("::1", Scope::Loopback),
            ("10.1.2.3", Scope::Private),
            ("172.20.0.1", Scope::Private),
            ("192.168.1.7", Scope::Private),
            ("100.100.0.1", Scope::Private),
            ("100.128.0.1", Scope::Public),
            ("fd00::1", Scope::Private),
            ("198.51.100.7", Scope::Public),
            ("2001:db8::1", Scope::Public),
            ("::ffff:10.0.0.1", Scope::Private),
            ("::ffff:127.0.0.1", Scope::Loopback),
            ("0.0.0.0", Scope::Unspecified),
            ("::", Scope::Unspecified),
            ("::ffff:0.0.0.0", Scope::Unspecified),
        ] {
            assert_eq!(Scope::of(ip.parse().unwrap()), scope, "{ip}");
        }
    }

    #[test]
    fn loopback_is_dialled_only_in_a_network_on_one_machine() {
        let local = Reach::new(
            ExcludedRanges::default(),
            &[addr("/ip4/127.0.0.1/tcp/4001")],
            &[addr("/ip4/127.0.0.1/tcp/0")],
        );
        assert!(local.one_machine());
        assert_eq!(local.check(&addr("/ip4/127.0.0.1/tcp/9")), Ok(()));

        // The README's nodes listen on every interface: their network is not one machine,
        // but the gateway they were told to join is dialled.
        let behind_nat = Reach::new(
            ExcludedRanges::default(),
            &[addr("/ip4/127.0.0.1/tcp/4001")],
            &[addr("/ip4/0.0.0.0/tcp/0")],
        );
        assert_eq!(
            behind_nat.check(&addr("/ip4/127.0.0.1/tcp/9")),
            Err(Unreachable::Loopback)
        );
        assert_eq!(behind_nat.check(&addr("/ip4/127.0.0.1/tcp/4001")), Ok(()));
        assert_eq!(
            behind_nat.check(&addr(
                "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
            )),
            Ok(())
        );
        assert!(behind_nat.worth_keeping(&addr("/ip4/127.0.0.1/tcp/4001")));
        let public_gateway = Reach::new(
            ExcludedRanges::default(),
            &[addr("/ip4/198.51.100.2/tcp/4001")],
            &[addr("/ip4/127.0.0.1/tcp/0")],
        );
        assert_eq!(
            public_gateway.check(&addr("/ip4/127.0.0.1/tcp/9")),
            Err(Unreachable::Loopback)
        );
        assert!(!public_gateway.worth_keeping(&addr("/ip4/127.0.0.1/tcp/9")));
        assert_eq!(
            public_gateway.check(&addr("/ip4/203.0.113.9/tcp/9")),
            Ok(())
        );
    }

    #[test]
    fn private_addresses_are_dialled_where_their_network_routes() {
        let reach = Reach::new(
            ExcludedRanges::default(),
            &[addr("/ip4/198.51.100.2/tcp/4001")],
            &[addr("/ip4/0.0.0.0/tcp/0")],
        );
        // 10.250.x is on no interface of a test machine.
        let elsewhere = addr("/ip4/10.250.3.4/tcp/9");
        assert_eq!(reach.check(&elsewhere), Err(Unreachable::ForeignPrivate));
        assert!(
            reach.worth_keeping(&elsewhere),
            "another peer may be on that LAN"
        );
        reach.learn_direct(&addr("/ip4/10.250.3.9/tcp/5"));
        assert_eq!(reach.check(&elsewhere), Ok(()));
        assert_eq!(
            reach.check(&addr("/ip4/10.250.4.4/tcp/9")),
            Err(Unreachable::ForeignPrivate),
            "another /24"
        );

        // A gateway on a private address: the deployment's private range routes.
        let private = Reach::new(
            ExcludedRanges::default(),
            &[addr("/ip4/10.77.0.1/tcp/4001")],
            &[addr("/ip4/0.0.0.0/tcp/0")],
        );
        assert_eq!(private.check(&addr("/ip4/10.1.2.3/tcp/9")), Ok(()));
        assert_eq!(
            private.check(&addr("/ip4/192.168.1.1/tcp/9")),
            Err(Unreachable::ForeignPrivate)
        );
    }

    #[test]
    fn excluded_ranges_and_unspecified_addresses_are_never_dialled() {
        let reach = Reach::new(
            ExcludedRanges::new(["203.0.113.0/24".parse().unwrap()]),
            &[],
            &[],
        );
        assert_eq!(
            reach.check(&addr("/ip4/203.0.113.9/tcp/9")),
            Err(Unreachable::Excluded)
        );
        assert!(!reach.worth_keeping(&addr("/ip4/203.0.113.9/tcp/9")));
        // The same address written as IPv4-mapped IPv6 is the same address.
        assert_eq!(
            reach.check(&addr("/ip6/::ffff:203.0.113.9/tcp/9")),
            Err(Unreachable::Excluded)
        );
        for unspecified in [
            "/ip4/0.0.0.0/tcp/9",
            "/ip6/::/tcp/9",
            "/ip6/::ffff:0.0.0.0/tcp/9",
        ] {
            assert_eq!(
                reach.check(&addr(unspecified)),
                Err(Unreachable::Unspecified),
                "{unspecified}"
            );
            assert!(!reach.worth_keeping(&addr(unspecified)));
        }
    }
}
