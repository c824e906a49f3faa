//! A node's dials to addresses that never led to a peer, bounded per address and per IP.
//!
//! Peers tell a node where to dial: identify, Kademlia and DCUtR all carry addresses a peer
//! announces. A certified peer that announces a third party's address (a web server, a host it
//! wants flooded) would otherwise have every node of the network dial it again and again, each
//! dial a TCP connect and a TLS hello. So a node keeps a budget for what is unproven:
//!
//! - an address that once led to a connection (a handshake with a certified peer) is
//!   **proven** and never limited: a scheduler being restarted, a gateway, a parameter server
//!   coming back are redialled as fast as their callers like;
//! - an unproven address may fail [`FREE_FAILURES`] times in a row (a hole punch tries three
//!   times), then waits [`BACKOFF_FIRST`], doubling with each further failure up to
//!   [`BACKOFF_MAX`] (go-libp2p's dial backoff has the same shape);
//! - the unproven addresses of one IP (its ports) fail at most [`IP_FAILURES_PER_MINUTE`] times
//!   a minute all together; past that, no unproven address of that IP is dialled until the
//!   minute's oldest failure is a minute old;
//! - relayed addresses (`/p2p-circuit`) and the configured gateways are never limited: the
//!   relay bounds the first, and the operator named the second.
//!
//! A refused dial fails at once with why and when the address may be tried again. The
//! memory is bounded: at most [`REMEMBERED`] addresses of each kind, the oldest forgotten first.
//!
//! The budget sits outside the whole upgrade, so that a dial counts as failed when the TCP
//! connect succeeded but no certified peer answered (a third party's open port).

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

use crate::reach::first_ip;

/// Failures in a row an unproven address may have before it waits.
pub const FREE_FAILURES: u32 = 3;
/// The first wait of an unproven address after its free failures; each further failure
/// doubles it.
pub const BACKOFF_FIRST: Duration = Duration::from_secs(5);
/// The longest wait of an unproven address.
pub const BACKOFF_MAX: Duration = Duration::from_secs(5 * 60);
/// Failed dials to the unproven addresses of one IP a minute.
pub const IP_FAILURES_PER_MINUTE: usize = 30;
/// Addresses remembered, proven and failing each, and IPs with failures.
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
        "not dialled: addresses of {ip} that never led to a peer failed {IP_FAILURES_PER_MINUTE} times in the last minute; next try in {wait:?}"
    )]
    Ip { ip: IpAddr, wait: Duration },
}

/// The dial budget's record: which addresses are proven, which failing, and the recent
/// failures of each IP. Pure: every call is given the time.
#[derive(Debug, Default)]
pub struct DialBudget {
    /// Proven addresses, by when they last led to a connection.
    proven: HashMap<Multiaddr, Instant>,
    /// Unproven addresses that failed: failures in a row and when the last one was.
    failing: HashMap<Multiaddr, (u32, Instant)>,
    /// The failures of unproven addresses of each IP in the last minute, oldest first.
    ip_failures: HashMap<IpAddr, VecDeque<Instant>>,
}

impl DialBudget {
    /// Whether `address` may be dialled at `now`.
    pub fn check(&mut self, address: &Multiaddr, now: Instant) -> Result<(), Refused> {
        let key = transport_address(address);
        if self.proven.contains_key(&key) {
            return Ok(());
        }
        if let Some(&(failures, last)) = self.failing.get(&key)
            && let Some(wait) = backoff(failures)
        {
            let ready = last + wait;
            if now < ready {
                return Err(Refused::Address {
                    address: key,
                    failures,
                    wait: ready - now,
                });
            }
        }
        if let Some(ip) = first_ip(&key)
            && let Some(failures) = self.ip_failures.get_mut(&ip)
        {
            while failures.front().is_some_and(|at| now >= *at + MINUTE) {
                failures.pop_front();
            }
            if failures.len() >= IP_FAILURES_PER_MINUTE
                && let Some(oldest) = failures.front()
            {
                return Err(Refused::Ip {
                    ip,
                    wait: *oldest + MINUTE - now,
                });
            }
        }
        Ok(())
    }

    /// A dial of `address` led to a connection at `now`: it is proven.
    pub fn connected(&mut self, address: &Multiaddr, now: Instant) {
        let key = transport_address(address);
        self.failing.remove(&key);
        if !self.proven.contains_key(&key) {
            forget_oldest(&mut self.proven, |at| *at);
        }
        self.proven.insert(key, now);
    }

    /// A dial of `address` failed at `now`.
    pub fn failed(&mut self, address: &Multiaddr, now: Instant) {
        let key = transport_address(address);
        if self.proven.contains_key(&key) {
            return;
        }
        if let Some(ip) = first_ip(&key) {
            if !self.ip_failures.contains_key(&ip) {
                forget_oldest(&mut self.ip_failures, |f| f.back().copied().unwrap_or(now));
            }
            let failures = self.ip_failures.entry(ip).or_default();
            failures.push_back(now);
            // Only the last minute's count; a burst beyond it says no more.
            while failures.len() > IP_FAILURES_PER_MINUTE {
                failures.pop_front();
            }
        }
        if !self.failing.contains_key(&key) {
            forget_oldest(&mut self.failing, |(_, at)| *at);
        }
        let entry = self.failing.entry(key).or_insert((0, now));
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

/// Makes room for one more entry in `map` when it is full: the one whose `when` is oldest
/// goes.
fn forget_oldest<K: Clone + Eq + std::hash::Hash, V>(
    map: &mut HashMap<K, V>,
    when: impl Fn(&V) -> Instant,
) {
    if map.len() < REMEMBERED {
        return;
    }
    if let Some(oldest) = map
        .iter()
        .min_by_key(|(_, v)| when(v))
        .map(|(k, _)| k.clone())
    {
        map.remove(&oldest);
    }
}

/// `address` without its `/p2p/…`: what a dial connects to.
fn transport_address(address: &Multiaddr) -> Multiaddr {
    address
        .iter()
        .filter(|p| !matches!(p, Protocol::P2p(_)))
        .collect()
}

/// Whether a dial of `address` is never limited: relayed, or a configured gateway's.
fn exempt(address: &Multiaddr, gateways: &[Multiaddr]) -> bool {
    address.iter().any(|p| matches!(p, Protocol::P2pCircuit)) || {
        let key = transport_address(address);
        gateways.iter().any(|g| transport_address(g) == key)
    }
}

/// A transport that dials through `inner` within a [`DialBudget`].
#[derive(Debug)]
pub struct Transport<T> {
    inner: T,
    budget: Arc<Mutex<DialBudget>>,
    gateways: Arc<[Multiaddr]>,
}

impl<T> Transport<T> {
    /// Dials through `inner`; `gateways` are never limited.
    pub fn new(inner: T, gateways: &[Multiaddr]) -> Self {
        Transport {
            inner,
            budget: Arc::default(),
            gateways: gateways.into(),
        }
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
        if exempt(&addr, &self.gateways) {
            return Ok(self.inner.dial(addr, opts)?.boxed());
        }
        if let Err(refused) = lock(&self.budget).check(&addr, Instant::now()) {
            tracing::debug!(%refused, "dial budget");
            return Err(TransportError::Other(std::io::Error::other(refused)));
        }
        let dial = self.inner.dial(addr.clone(), opts)?;
        let budget = self.budget.clone();
        Ok(async move {
            let result = dial.await;
            let mut budget = lock(&budget);
            match &result {
                Ok(_) => budget.connected(&addr, Instant::now()),
                Err(_) => budget.failed(&addr, Instant::now()),
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

    #[test]
    fn an_unproven_address_waits_after_three_failures_doubling_to_five_minutes() {
        let mut budget = DialBudget::default();
        let start = Instant::now();
        let victim = addr("/ip4/203.0.113.5/tcp/443");
        for i in 0..FREE_FAILURES {
            let now = start + Duration::from_millis(u64::from(i));
            assert_eq!(budget.check(&victim, now), Ok(()));
            budget.failed(&victim, now);
        }
        let last = start + Duration::from_millis(2);
        let refused = budget.check(&victim, last);
        assert!(
            matches!(refused, Err(Refused::Address { failures: 3, wait, .. }) if wait == BACKOFF_FIRST),
            "{refused:?}"
        );
        // The same address under another peer id is the same address.
        let with_peer = addr(
            "/ip4/203.0.113.5/tcp/443/p2p/12D3KooWGfRU2c1wco3udtGDhRdrWWF9hi5m1h72LBdXzCRFrg7R",
        );
        assert!(budget.check(&with_peer, last).is_err());
        let mut now = last + BACKOFF_FIRST;
        let mut waits = Vec::new();
        for _ in 0..8 {
            assert_eq!(budget.check(&victim, now), Ok(()));
            budget.failed(&victim, now);
            let Err(Refused::Address { wait, .. }) = budget.check(&victim, now) else {
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
        let scheduler = addr("/ip4/198.51.100.7/tcp/4001");
        budget.connected(&scheduler, now);
        for _ in 0..100 {
            assert_eq!(budget.check(&scheduler, now), Ok(()));
            budget.failed(&scheduler, now);
        }
        let punched = addr("/ip4/198.51.100.8/tcp/4001");
        for _ in 0..FREE_FAILURES {
            budget.failed(&punched, now);
        }
        assert!(budget.check(&punched, now).is_err());
        // A punch from the other side made a connection on it.
        budget.connected(&punched, now);
        assert_eq!(budget.check(&punched, now), Ok(()));
    }

    #[test]
    fn one_ips_unproven_ports_fail_thirty_times_a_minute_at_most() {
        let mut budget = DialBudget::default();
        let start = Instant::now();
        let port = |p: u16| addr(&format!("/ip4/203.0.113.9/tcp/{p}"));
        for p in 0..IP_FAILURES_PER_MINUTE as u16 {
            let now = start + Duration::from_secs(u64::from(p));
            assert_eq!(budget.check(&port(1000 + p), now), Ok(()));
            budget.failed(&port(1000 + p), now);
        }
        let now = start + Duration::from_secs(30);
        let refused = budget.check(&port(2000), now);
        assert!(
            matches!(refused, Err(Refused::Ip { wait, .. }) if wait == Duration::from_secs(30)),
            "{refused:?}"
        );
        // Another IP is not affected, nor a proven port of this one.
        assert_eq!(budget.check(&addr("/ip4/203.0.113.10/tcp/1"), now), Ok(()));
        budget.connected(&port(4001), start);
        assert_eq!(budget.check(&port(4001), now), Ok(()));
        // Once the oldest failure is a minute old, one more may go.
        let later = start + MINUTE;
        assert_eq!(budget.check(&port(2000), later), Ok(()));
    }

    #[test]
    fn relayed_and_gateway_addresses_are_exempt() {
        let gateways = [addr(
            "/ip4/192.0.2.1/tcp/4001/p2p/12D3KooWGfRU2c1wco3udtGDhRdrWWF9hi5m1h72LBdXzCRFrg7R",
        )];
        assert!(exempt(&addr("/ip4/192.0.2.1/tcp/4001"), &gateways));
        assert!(exempt(
            &addr(
                "/ip4/192.0.2.1/tcp/4001/p2p/12D3KooWGfRU2c1wco3udtGDhRdrWWF9hi5m1h72LBdXzCRFrg7R/p2p-circuit/p2p/12D3KooWPtKwyAvxphg8y6VfnTeDfcYYo234qFjVajjZSWLfRPuH"
            ),
            &[]
        ));
        assert!(!exempt(&addr("/ip4/192.0.2.1/tcp/4002"), &gateways));
    }

    #[test]
    fn memory_is_bounded() {
        let mut budget = DialBudget::default();
        let start = Instant::now();
        for i in 0..(REMEMBERED + 100) as u32 {
            let now = start + Duration::from_millis(u64::from(i));
            let ip = std::net::Ipv4Addr::from(0xCB00_0000 + i);
            budget.failed(&addr(&format!("/ip4/{ip}/tcp/1")), now);
            budget.connected(&addr(&format!("/ip4/{ip}/tcp/2")), now);
        }
        assert_eq!(budget.failing.len(), REMEMBERED);
        assert_eq!(budget.proven.len(), REMEMBERED);
        assert_eq!(budget.ip_failures.len(), REMEMBERED);
    }
}
