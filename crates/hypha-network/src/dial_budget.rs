//! A node's dials to addresses that never led to a peer, bounded per address and per IP.
//!
//! Peers tell a node where to dial: identify, Kademlia and DCUtR all carry addresses a peer
//! announces. A certified peer that announces a third party's address (a web server, a host it
//! wants flooded) would otherwise have every node of the network dial it again and again, each
//! dial a TCP connect and a TLS hello. So a node keeps a budget for what is unproven:
//!
//! - an address this node once reached a certified peer at is **proven** and never limited: a
//!   scheduler or parameter server this node dialled before is redialled, once restarted, as
//!   fast as its callers like. (Only this node's own dials prove: an address of a peer that
//!   only ever dialled in is unproven here.) At most [`PROVEN_PER_IP`] proven addresses are
//!   kept per IP, so that a peer prompting dials to its own ports cannot push others out;
//! - a dial counts as failed from the moment it starts until it connects, so that dials in
//!   flight count too. An unproven address may fail [`FREE_FAILURES`] times in a row (a hole
//!   punch tries three times), then waits [`BACKOFF_FIRST`], doubling with each further
//!   failure up to [`BACKOFF_MAX`];
//! - the unproven addresses of an IP none of whose addresses is proven (its ports) fail at
//!   most [`IP_FAILURES_PER_MINUTE`] times a minute all together; past that, none of them is
//!   dialled until the minute's oldest failure is a minute old. DNS names count together, as
//!   one such IP: names resolve below this layer, and a wildcard domain has names without end;
//!   a name is never proven;
//! - relayed addresses (`/p2p-circuit`) and the configured gateways are never limited: the
//!   relay bounds the first, and the operator named the second. Neither are addresses this
//!   node does not dial over TCP (`reach` refuses them, or no transport takes them): they
//!   cost nothing and fail at once.
//!
//! A refused dial fails at once with why and when the address may be tried again. The
//! memory is bounded: at most [`REMEMBERED`] entries of each kind; addresses not waiting out
//! a backoff are forgotten first, then the oldest.
//!
//! The budget sits outside the whole upgrade, so that a dial counts as failed when the TCP
//! connect succeeded but no certified peer answered (a third party's open port).
//!
//! What remains: a certified peer that announces closed ports of a site none of whose
//! addresses this node has proven can delay direct dials to that site by a minute at a time;
//! the relay still carries its traffic.

use std::{
    collections::{HashMap, VecDeque},
    net::IpAddr,
    pin::Pin,
    sync::{Arc, Mutex},
    task::{Context, Poll},
    time::{Duration, Instant},
};

use futures::{FutureExt, future::BoxFuture};
use libp2p::{
    Multiaddr,
    core::transport::{DialOpts, ListenerId, TransportError, TransportEvent},
    multiaddr::Protocol,
};

use crate::reach::Reach;

/// Failures in a row an unproven address may have before it waits.
pub const FREE_FAILURES: u32 = 3;
/// The first wait of an unproven address after its free failures; each further failure
/// doubles it.
pub const BACKOFF_FIRST: Duration = Duration::from_secs(5);
/// The longest wait of an unproven address.
pub const BACKOFF_MAX: Duration = Duration::from_secs(5 * 60);
/// Failed dials to the unproven addresses of one IP with none proven, a minute.
pub const IP_FAILURES_PER_MINUTE: usize = 30;
/// Proven addresses kept per IP.
pub const PROVEN_PER_IP: usize = 16;
/// Entries remembered: proven addresses, failing ones, and IPs with failures, each.
pub const REMEMBERED: usize = 4096;

const MINUTE: Duration = Duration::from_secs(60);

/// Why a dial was not made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error(
        "not dialled: {address} never led to a peer and failed {failures} times in a row; next try in {wait:?}"
    )]
    Address {
        address: Multiaddr,
        failures: u32,
        wait: Duration,
    },
    #[error(
        "not dialled: addresses of {host} that never led to a peer failed {IP_FAILURES_PER_MINUTE} times in the last minute; next try in {wait:?}"
    )]
    Host { host: Host, wait: Duration },
}

/// Where a budgeted address leads: an IP, or a DNS name (all names share one budget).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Host {
    Ip(IpAddr),
    Name,
}

impl std::fmt::Display for Host {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Host::Ip(ip) => ip.fmt(f),
            Host::Name => f.write_str("DNS names"),
        }
    }
}

/// An address the budget counts: `/ip4|ip6|dns*/…/tcp/PORT`, without its `/p2p/…`, with an
/// IPv4-mapped IPv6 address written as IPv4. `None` for anything else (relayed, another
/// transport).
fn budgeted(address: &Multiaddr) -> Option<(Multiaddr, Host)> {
    let mut parts = address.iter().filter(|p| !matches!(p, Protocol::P2p(_)));
    let (host, first) = match parts.next()? {
        Protocol::Ip4(ip) => (Host::Ip(IpAddr::V4(ip)), Protocol::Ip4(ip)),
        Protocol::Ip6(ip) => match IpAddr::V6(ip).to_canonical() {
            IpAddr::V4(v4) => (Host::Ip(IpAddr::V4(v4)), Protocol::Ip4(v4)),
            v6 => (Host::Ip(v6), Protocol::Ip6(ip)),
        },
        name @ (Protocol::Dns(_) | Protocol::Dns4(_) | Protocol::Dns6(_)) => (Host::Name, name),
        _ => return None,
    };
    let port @ Protocol::Tcp(_) = parts.next()? else {
        return None;
    };
    if parts.next().is_some() {
        return None;
    }
    Some((Multiaddr::empty().with(first).with(port), host))
}

/// The dial budget's record: which addresses are proven, which failing, and the recent
/// failures of each host. Pure: every call is given the time, and takes addresses as
/// [`budgeted`] writes them.
#[derive(Debug, Default)]
pub struct DialBudget {
    /// Proven addresses, by when they were last dialled.
    proven: HashMap<Multiaddr, Instant>,
    /// How many proven addresses each IP has.
    proven_ips: HashMap<IpAddr, usize>,
    /// Unproven addresses that failed: failures in a row and when the last one began.
    failing: HashMap<Multiaddr, (u32, Instant)>,
    /// The failures of unproven addresses of each host in the last minute, oldest first.
    host_failures: HashMap<Host, VecDeque<Instant>>,
}

impl DialBudget {
    /// A dial of `address` (to `host`) begins at `now`, unless the budget refuses it: it
    /// counts as failed until [`connected`](Self::connected) says otherwise.
    pub fn begin(&mut self, address: &Multiaddr, host: Host, now: Instant) -> Result<(), Refused> {
        if let Some(dialled) = self.proven.get_mut(address) {
            *dialled = now;
            return Ok(());
        }
        if let Some(&(failures, last)) = self.failing.get(address)
            && let Some(wait) = backoff(failures)
            && now < last + wait
        {
            return Err(Refused::Address {
                address: address.clone(),
                failures,
                wait: last + wait - now,
            });
        }
        let capped = match host {
            Host::Ip(ip) => !self.proven_ips.contains_key(&ip),
            Host::Name => true,
        };
        if capped && let Some(failures) = self.host_failures.get_mut(&host) {
            while failures.front().is_some_and(|at| now >= *at + MINUTE) {
                failures.pop_front();
            }
            if failures.len() >= IP_FAILURES_PER_MINUTE
                && let Some(oldest) = failures.front()
            {
                return Err(Refused::Host {
                    host,
                    wait: *oldest + MINUTE - now,
                });
            }
        }
        self.failed(address, host, now);
        Ok(())
    }

    /// A dial of `address` (to `host`) led to a certified peer at `now`.
    pub fn connected(&mut self, address: &Multiaddr, host: Host, now: Instant) {
        self.failing.remove(address);
        // A name may resolve elsewhere tomorrow: it is never proven.
        let Host::Ip(ip) = host else {
            return;
        };
        if self.proven.contains_key(address) {
            self.proven.insert(address.clone(), now);
            return;
        }
        if self
            .proven_ips
            .get(&ip)
            .is_some_and(|n| *n >= PROVEN_PER_IP)
        {
            let oldest_of_ip = self
                .proven
                .iter()
                .filter(|(a, _)| budgeted(a).is_some_and(|(_, h)| h == host))
                .min_by_key(|(_, at)| **at)
                .map(|(a, _)| a.clone());
            if let Some(oldest) = oldest_of_ip {
                self.forget_proven(&oldest);
            }
        } else if self.proven.len() >= REMEMBERED
            && let Some(oldest) = self
                .proven
                .iter()
                .min_by_key(|(_, at)| **at)
                .map(|(a, _)| a.clone())
        {
            self.forget_proven(&oldest);
        }
        self.proven.insert(address.clone(), now);
        *self.proven_ips.entry(ip).or_default() += 1;
    }

    fn forget_proven(&mut self, address: &Multiaddr) {
        self.proven.remove(address);
        if let Some((_, Host::Ip(ip))) = budgeted(address)
            && let Some(count) = self.proven_ips.get_mut(&ip)
        {
            *count -= 1;
            if *count == 0 {
                self.proven_ips.remove(&ip);
            }
        }
    }

    /// Counts a failure of unproven `address` at `now`.
    fn failed(&mut self, address: &Multiaddr, host: Host, now: Instant) {
        if !self.host_failures.contains_key(&host) && self.host_failures.len() >= REMEMBERED {
            let oldest = self
                .host_failures
                .iter()
                .min_by_key(|(_, f)| f.back().copied().unwrap_or(now))
                .map(|(h, _)| *h);
            if let Some(oldest) = oldest {
                self.host_failures.remove(&oldest);
            }
        }
        let failures = self.host_failures.entry(host).or_default();
        failures.push_back(now);
        // Only the last minute's count matters; a burst beyond it says no more.
        while failures.len() > IP_FAILURES_PER_MINUTE {
            failures.pop_front();
        }
        if !self.failing.contains_key(address) && self.failing.len() >= REMEMBERED {
            // Those not waiting out a backoff first, then the oldest.
            let forget = self
                .failing
                .iter()
                .min_by_key(|(_, (failures, last))| {
                    let waiting = backoff(*failures).is_some_and(|wait| now < *last + wait);
                    (waiting, *last)
                })
                .map(|(a, _)| a.clone());
            if let Some(forget) = forget {
                self.failing.remove(&forget);
            }
        }
        let entry = self.failing.entry(address.clone()).or_insert((0, now));
        *entry = (entry.0.saturating_add(1), now);
    }
}

/// How long an address that failed `failures` times in a row waits after its last failure.
fn backoff(failures: u32) -> Option<Duration> {
    let beyond = failures.checked_sub(FREE_FAILURES)?;
    Some(
        BACKOFF_FIRST
            .saturating_mul(1u32 << beyond.min(16))
            .min(BACKOFF_MAX),
    )
}

/// A transport that dials through `inner` within a [`DialBudget`].
#[derive(Debug)]
pub struct Transport<T> {
    inner: T,
    budget: Arc<Mutex<DialBudget>>,
    /// The configured gateways' addresses, as [`budgeted`] writes them: never limited.
    gateways: Arc<[Multiaddr]>,
    reach: Reach,
}

impl<T> Transport<T> {
    /// Dials through `inner`; `gateways` are never limited, nor what `reach` refuses.
    pub fn new(inner: T, gateways: &[Multiaddr], reach: Reach) -> Self {
        Transport {
            inner,
            budget: Arc::default(),
            gateways: gateways
                .iter()
                .filter_map(|g| budgeted(g).map(|(a, _)| a))
                .collect(),
            reach,
        }
    }

    /// The address and host a dial of `address` is counted under; `None` when it is not.
    fn counted(&self, address: &Multiaddr) -> Option<(Multiaddr, Host)> {
        if address.iter().any(|p| matches!(p, Protocol::P2pCircuit)) {
            return None;
        }
        let (key, host) = budgeted(address)?;
        if self.gateways.contains(&key)
            || (matches!(host, Host::Ip(_)) && self.reach.check(address).is_err())
        {
            return None;
        }
        Some((key, host))
    }
}

fn lock(budget: &Mutex<DialBudget>) -> std::sync::MutexGuard<'_, DialBudget> {
    // Each update leaves the record whole: a panic elsewhere does not spoil it.
    budget.lock().unwrap_or_else(|p| p.into_inner())
}

impl<T> libp2p::core::Transport for Transport<T>
where
    T: libp2p::core::Transport<Error = std::io::Error> + Unpin,
    T::Dial: Send + 'static,
    T::Output: Send + 'static,
{
    type Output = T::Output;
    type Error = std::io::Error;
    type ListenerUpgrade = T::ListenerUpgrade;
    type Dial = BoxFuture<'static, Result<T::Output, std::io::Error>>;

    fn listen_on(
        &mut self,
        id: ListenerId,
        addr: Multiaddr,
    ) -> Result<(), TransportError<Self::Error>> {
        self.inner.listen_on(id, addr)
    }

    fn remove_listener(&mut self, id: ListenerId) -> bool {
        self.inner.remove_listener(id)
    }

    fn dial(
        &mut self,
        addr: Multiaddr,
        opts: DialOpts,
    ) -> Result<Self::Dial, TransportError<Self::Error>> {
        let Some((key, host)) = self.counted(&addr) else {
            return Ok(self.inner.dial(addr, opts)?.boxed());
        };
        if let Err(refused) = lock(&self.budget).begin(&key, host, Instant::now()) {
            tracing::debug!(%refused, "dial budget");
            return Err(TransportError::Other(std::io::Error::other(refused)));
        }
        let dial = self.inner.dial(addr, opts)?;
        let budget = self.budget.clone();
        Ok(async move {
            let result = dial.await;
            if result.is_ok() {
                lock(&budget).connected(&key, host, Instant::now());
            }
            result
        }
        .boxed())
    }

    fn poll(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<TransportEvent<Self::ListenerUpgrade, Self::Error>> {
        Pin::new(&mut self.inner).poll(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(text: &str) -> Multiaddr {
        text.parse().unwrap_or_else(|e| panic!("{text}: {e}"))
    }

    /// `text` as the budget counts it.
    fn key(text: &str) -> (Multiaddr, Host) {
        budgeted(&addr(text)).unwrap_or_else(|| panic!("{text} is not budgeted"))
    }

    const PEER: &str = "12D3KooWGfRU2c1wco3udtGDhRdrWWF9hi5m1h72LBdXzCRFrg7R";

    #[test]
    fn tcp_addresses_count_without_their_peer_id_and_ipv4_mapped_is_ipv4() {
        let (plain, host) = key("/ip4/203.0.113.5/tcp/443");
        assert_eq!(host, Host::Ip("203.0.113.5".parse().unwrap()));
        assert_eq!(
            key(&format!("/ip4/203.0.113.5/tcp/443/p2p/{PEER}")).0,
            plain
        );
        assert_eq!(key("/ip6/::ffff:203.0.113.5/tcp/443").0, plain);
        assert_eq!(key("/dns4/example.com/tcp/443").1, Host::Name);
        for other in [
            "/ip4/203.0.113.5/udp/443/quic-v1",
            "/ip4/203.0.113.5/tcp/443/ws",
            "/ip4/203.0.113.5/tcp/443/p2p/PEER/p2p-circuit",
        ] {
            let other = other.replace("PEER", PEER);
            assert!(budgeted(&addr(&other)).is_none(), "{other}");
        }
    }

    #[test]
    fn an_unproven_address_waits_after_three_failures_doubling_to_five_minutes() {
        let mut budget = DialBudget::default();
        let start = Instant::now();
        let (victim, host) = key("/ip4/203.0.113.5/tcp/443");
        // Dials in flight count: three begun, none answered yet.
        for _ in 0..FREE_FAILURES {
            assert_eq!(budget.begin(&victim, host, start), Ok(()));
        }
        let refused = budget.begin(&victim, host, start);
        assert!(
            matches!(refused, Err(Refused::Address { failures: 3, wait, .. }) if wait == BACKOFF_FIRST),
            "{refused:?}"
        );
        let mut now = start + BACKOFF_FIRST;
        let mut waits = Vec::new();
        for _ in 0..8 {
            assert_eq!(budget.begin(&victim, host, now), Ok(()));
            let Err(Refused::Address { wait, .. }) = budget.begin(&victim, host, now) else {
                panic!("dialled again at once");
            };
            waits.push(wait.as_secs());
            now += wait;
        }
        assert_eq!(waits, [10, 20, 40, 80, 160, 300, 300, 300]);
    }

    #[test]
    fn a_proven_address_is_never_limited_and_a_connection_proves_a_failing_one() {
        let mut budget = DialBudget::default();
        let now = Instant::now();
        let (scheduler, host) = key("/ip4/198.51.100.7/tcp/4001");
        assert_eq!(budget.begin(&scheduler, host, now), Ok(()));
        budget.connected(&scheduler, host, now);
        for _ in 0..100 {
            assert_eq!(budget.begin(&scheduler, host, now), Ok(()));
        }
        let (punched, host) = key("/ip4/198.51.100.8/tcp/4001");
        for _ in 0..FREE_FAILURES {
            assert_eq!(budget.begin(&punched, host, now), Ok(()));
        }
        assert!(budget.begin(&punched, host, now).is_err());
        // A punch from the other side made a connection on it.
        budget.connected(&punched, host, now);
        assert_eq!(budget.begin(&punched, host, now), Ok(()));
    }

    #[test]
    fn an_ips_unproven_ports_fail_thirty_times_a_minute_until_one_of_its_addresses_is_proven() {
        let mut budget = DialBudget::default();
        let start = Instant::now();
        let port = |p: u16| key(&format!("/ip4/203.0.113.9/tcp/{p}"));
        for p in 0..IP_FAILURES_PER_MINUTE as u16 {
            let (address, host) = port(1000 + p);
            let now = start + Duration::from_secs(u64::from(p));
            assert_eq!(budget.begin(&address, host, now), Ok(()));
        }
        let now = start + Duration::from_secs(30);
        let (fresh, host) = port(2000);
        let refused = budget.begin(&fresh, host, now);
        assert!(
            matches!(refused, Err(Refused::Host { wait, .. }) if wait == Duration::from_secs(30)),
            "{refused:?}"
        );
        // Another IP is not affected.
        let (elsewhere, other) = key("/ip4/203.0.113.10/tcp/1");
        assert_eq!(budget.begin(&elsewhere, other, now), Ok(()));
        // Once the oldest failure is a minute old, one more may go.
        assert_eq!(budget.begin(&fresh, host, start + MINUTE), Ok(()));
        // A site one of whose addresses led to a peer is not capped: a peer announcing its
        // closed ports cannot cut it off.
        let (node, _) = port(4001);
        budget.connected(&node, host, now);
        for p in 0..2 * IP_FAILURES_PER_MINUTE as u16 {
            let (address, _) = port(3000 + p);
            assert_eq!(budget.begin(&address, host, start + MINUTE), Ok(()));
        }
    }

    #[test]
    fn dns_names_share_one_budget_and_are_never_proven() {
        let mut budget = DialBudget::default();
        let now = Instant::now();
        for i in 0..IP_FAILURES_PER_MINUTE {
            let (name, host) = key(&format!("/dns4/n{i}.example.com/tcp/1"));
            assert_eq!(budget.begin(&name, host, now), Ok(()));
        }
        let (another, host) = key("/dns4/another.example.com/tcp/1");
        assert!(matches!(
            budget.begin(&another, host, now),
            Err(Refused::Host {
                host: Host::Name,
                ..
            })
        ));
        let (name, host) = key("/dns4/n0.example.com/tcp/1");
        budget.connected(&name, host, now);
        assert!(budget.proven.is_empty(), "a name is never proven");
    }

    #[test]
    fn an_ip_keeps_sixteen_proven_addresses_and_others_keep_theirs() {
        let mut budget = DialBudget::default();
        let start = Instant::now();
        let (scheduler, host) = key("/ip4/198.51.100.7/tcp/4001");
        budget.connected(&scheduler, host, start);
        for p in 0..PROVEN_PER_IP as u16 + 4 {
            let (address, host) = key(&format!("/ip4/203.0.113.66/tcp/{}", 5000 + p));
            budget.connected(
                &address,
                host,
                start + Duration::from_secs(u64::from(p) + 1),
            );
        }
        assert_eq!(budget.proven.len(), PROVEN_PER_IP + 1);
        assert!(budget.proven.contains_key(&scheduler));
        assert!(
            !budget
                .proven
                .contains_key(&key("/ip4/203.0.113.66/tcp/5000").0)
        );
        assert!(
            budget
                .proven
                .contains_key(&key("/ip4/203.0.113.66/tcp/5019").0)
        );
    }

    #[test]
    fn relayed_gateway_and_unreachable_addresses_are_not_counted() {
        let gateway = addr(&format!("/ip4/192.0.2.1/tcp/4001/p2p/{PEER}"));
        let reach = Reach::new(
            crate::ExcludedRanges::new(["198.18.0.0/15".parse().unwrap()]),
            std::slice::from_ref(&gateway),
            &[addr("/ip4/0.0.0.0/tcp/4001")],
        );
        let transport = Transport::new((), std::slice::from_ref(&gateway), reach);
        assert!(
            transport
                .counted(&addr("/ip4/192.0.2.1/tcp/4001"))
                .is_none()
        );
        assert!(
            transport
                .counted(&addr("/ip4/192.0.2.1/tcp/4002"))
                .is_some()
        );
        assert!(
            transport.counted(&addr("/ip4/198.18.0.1/tcp/1")).is_none(),
            "excluded"
        );
        assert!(
            transport.counted(&addr("/ip4/127.0.0.1/tcp/1")).is_none(),
            "another machine's loopback"
        );
        assert!(
            transport
                .counted(&addr(&format!(
                    "/ip4/192.0.2.1/tcp/4001/p2p/{PEER}/p2p-circuit"
                )))
                .is_none()
        );
    }

    #[test]
    fn memory_is_bounded() {
        let mut budget = DialBudget::default();
        let start = Instant::now();
        for i in 0..(REMEMBERED + 100) as u32 {
            let now = start + Duration::from_millis(u64::from(i));
            let ip = std::net::Ipv4Addr::from(0xCB00_0000 + i);
            let (failing, host) = key(&format!("/ip4/{ip}/tcp/1"));
            let _ = budget.begin(&failing, host, now);
            let (proven, host) = key(&format!("/ip4/{ip}/tcp/2"));
            budget.connected(&proven, host, now);
        }
        assert_eq!(budget.failing.len(), REMEMBERED);
        assert_eq!(budget.proven.len(), REMEMBERED);
        assert_eq!(budget.proven_ips.len(), REMEMBERED);
        assert_eq!(budget.host_failures.len(), REMEMBERED);
    }
}
