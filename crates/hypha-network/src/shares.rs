//! Fair shares of a node's slots among the peers that use them.
//!
//! A server with a fixed number of slots (transfers received at once, chunks uploaded at once)
//! also caps what one peer may hold of them, so that a single peer, greedy or hostile, never
//! takes every slot: [`PeerShares::try_take`] answers `None` once the peer holds its share,
//! and the caller refuses the request as busy.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, PoisonError},
};

use libp2p::PeerId;

/// How many slots each peer holds now, and the most one may.
#[derive(Debug, Clone)]
pub struct PeerShares {
    held: Arc<Mutex<HashMap<PeerId, usize>>>,
    per_peer: usize,
}

/// One slot held by a peer; given back when dropped.
#[derive(Debug)]
pub struct Share {
    shares: PeerShares,
    peer: PeerId,
}

impl PeerShares {
    /// Shares of at most `per_peer` (at least 1) slots each.
    pub fn new(per_peer: usize) -> Self {
        PeerShares {
            held: Arc::default(),
            per_peer: per_peer.max(1),
        }
    }

    /// The most one peer may hold.
    pub fn per_peer(&self) -> usize {
        self.per_peer
    }

    /// A slot for `peer`, unless it holds its share already.
    pub fn try_take(&self, peer: PeerId) -> Option<Share> {
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        let count = held.entry(peer).or_default();
        if *count >= self.per_peer {
            return None;
        }
        *count += 1;
        Some(Share {
            shares: self.clone(),
            peer,
        })
    }
}

impl Drop for Share {
    fn drop(&mut self) {
        let mut held = self
            .shares
            .held
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(count) = held.get_mut(&self.peer) {
            *count -= 1;
            if *count == 0 {
                held.remove(&self.peer);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_holds_its_share_and_no_more_and_gets_it_back() {
        let shares = PeerShares::new(2);
        let (a, b) = (PeerId::random(), PeerId::random());
        let first = shares.try_take(a);
        let second = shares.try_take(a);
        assert!(first.is_some() && second.is_some());
        assert!(shares.try_take(a).is_none(), "a holds its share");
        assert!(shares.try_take(b).is_some(), "b's share is its own");
        drop(first);
        assert!(
            shares.try_take(a).is_some(),
            "a slot given back can be taken again"
        );
    }
}
