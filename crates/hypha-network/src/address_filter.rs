//! The transport's dial filter: `exclude_cidr` (address ranges a node never dials and never
//! puts in its routing table) and the rest of [`Reach`]'s rules (no loopback of other
//! machines, no private address of another site).
//!
//! The filter sits in the transport, under DNS resolution, so it holds for every dial whatever
//! asked for it (Kademlia queries, DCUtR, the application) and for names that resolve into a
//! range.

use std::{
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};

use ipnet::IpNet;
use libp2p::{
    Multiaddr,
    core::transport::{DialOpts, ListenerId, TransportError, TransportEvent},
};

use crate::reach::Reach;

/// Address ranges to stay away from.
#[derive(Debug, Clone, Default)]
pub struct ExcludedRanges(Arc<[IpNet]>);

impl ExcludedRanges {
    pub fn new(ranges: impl IntoIterator<Item = IpNet>) -> Self {
        ExcludedRanges(ranges.into_iter().collect())
    }

    /// Whether `addr` points into an excluded range (judged by its first IP component;
    /// addresses without one, such as DNS names before resolution, are not excluded).
    pub fn excludes(&self, addr: &Multiaddr) -> bool {
        crate::reach::first_ip(addr).is_some_and(|ip| self.0.iter().any(|net| net.contains(&ip)))
    }
}

/// A transport that refuses to dial what [`Reach`] says leads nowhere, and passes everything
/// else through.
#[derive(Debug)]
pub struct Transport<T> {
    inner: T,
    reach: Reach,
}

impl<T> Transport<T> {
    pub fn new(inner: T, reach: Reach) -> Self {
        Transport { inner, reach }
    }
}

impl<T: libp2p::core::Transport + Unpin> libp2p::core::Transport for Transport<T> {
    type Output = T::Output;
    type Error = T::Error;
    type ListenerUpgrade = T::ListenerUpgrade;
    type Dial = T::Dial;

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
        if let Err(why) = self.reach.check(&addr) {
            tracing::debug!(%addr, %why, "not dialling");
            return Err(TransportError::MultiaddrNotSupported(addr));
        }
        self.inner.dial(addr, opts)
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

    #[test]
    fn excludes_by_first_ip_component() {
        let ranges =
            ExcludedRanges::new(["10.0.0.0/8".parse().unwrap(), "fd00::/8".parse().unwrap()]);
        assert!(ranges.excludes(&"/ip4/10.1.2.3/tcp/1".parse().unwrap()));
        assert!(ranges.excludes(&"/ip6/fd00::1/tcp/1".parse().unwrap()));
        assert!(!ranges.excludes(&"/ip4/127.0.0.1/tcp/1".parse().unwrap()));
        assert!(!ranges.excludes(&"/dns4/example.com/tcp/1".parse().unwrap()));
    }
}
