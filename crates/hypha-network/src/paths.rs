//! How each connected peer is reached, and moving its traffic off the relay.
//!
//! Two nodes behind NATs first meet through a gateway's relay; DCUtR then tries to punch a
//! direct connection. While both exist, libp2p spreads requests and streams over both
//! (request-response round-robin, streams at random), so the relay would keep carrying half of
//! everything. The rules here:
//!
//! - A connect that ends on a relayed connection waits for a direct one for at most
//!   [`PUNCH_WINDOW`] (a hole punch takes a few round trips), so that the application's first
//!   requests and streams do not start on the relay.
//! - Once a direct connection exists, the peer's relayed connections are retired: each closes
//!   once the peer is quiet, nothing of the application's under way with it (requests either
//!   way, open streams; the caller says, see `in_flight`), so that no request, answer or
//!   transfer is cut because a punch succeeded, and everything after goes direct. Inside the
//!   window nothing is under way yet, so the relay closes at once; a direct connection that comes after the
//!   window (DCUtR tries three times) lets the relay finish what it carries, for at most
//!   [`RETIRE_AT_MOST`]. Lost, a direct connection is replaced by the next connect like any
//!   other (known addresses, the DHT, a relay), and a relay still retiring is kept after all.
//! - Two peers that reach for each other at the same moment make two relayed connections, one
//!   each way, and DCUtR would run on both: each side then dials the other from its listen port
//!   twice, once as TLS client and once as server, and the simultaneous opens can pair two
//!   clients or two servers. The relayed connection dialled by the peer with the smaller id is
//!   kept, one dialled by the other closed (both sides choose the same); two dialled by the
//!   same side (through two gateways) are both kept.
//! - Without a direct connection at the end of the window, or once DCUtR gave up, the relay
//!   carries the peer's traffic, and the node says so once, with the hole punch's failure
//!   where it knows it.
//!
//! This is state and rules only (time is passed in); the event loop performs what they say.

use std::{
    collections::{HashMap, HashSet},
    time::{Duration, Instant},
};

use libp2p::{PeerId, swarm::ConnectionId};
use serde::{Deserialize, Serialize};

/// How long a connect that reached a peer only through a relay waits for a direct connection.
pub const PUNCH_WINDOW: Duration = Duration::from_secs(4);
/// How long a relayed connection stays open beside a direct one while its peer keeps something
/// under way: a peer that is never quiet must not hold half of its traffic on the relay (a
/// transfer cut then is sent again by its sender, over the direct connection).
pub const RETIRE_AT_MOST: Duration = Duration::from_secs(300);

/// How a peer is reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Path {
    /// A connection over the network, made by dialling or accepting an address.
    Direct,
    /// A direct connection that DCUtR punched through NATs, the relay closed.
    HolePunched,
    /// Only through a gateway's relay.
    Relayed,
}

impl std::fmt::Display for Path {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Path::Direct => "direct",
            Path::HolePunched => "hole-punched",
            Path::Relayed => "relayed",
        })
    }
}

/// What the event loop does after a connection came up. Relayed connections made needless
/// (by a direct one, or a duplicate) are retired: [`Paths::retire`] says when to close them.
#[derive(Debug, PartialEq, Eq)]
pub enum Established<W> {
    /// Only relayed so far: the connects wait (the event loop parks them here).
    Wait,
    /// The peer is reached directly: release the waiting connects. `after_relay`: how long the
    /// peer was reached only through a relay before this direct connection came inside the
    /// window.
    Direct {
        waiting: Vec<W>,
        after_relay: Option<Duration>,
    },
}

/// Retired relayed connections to close: `quiet` ones carry nothing (a request on its way
/// over one when it closes was not taken, and may be sent again), `overdue` ones carried
/// something for too long.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Retired {
    pub quiet: Vec<ConnectionId>,
    pub overdue: Vec<ConnectionId>,
}

/// How a connection reaches its peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Direct,
    /// Through a relay circuit; `dialled_by_smaller_id`: the side with the smaller peer id
    /// dialled it (the one kept of two).
    Relayed {
        dialled_by_smaller_id: bool,
    },
}

/// The end of a window without a direct connection.
#[derive(Debug, PartialEq, Eq)]
pub struct StaysRelayed<W> {
    pub peer: PeerId,
    pub waiting: Vec<W>,
    /// Why the last hole punch failed, if this node heard.
    pub failure: Option<String>,
}

/// Every connected peer's connections, and the connects waiting for a direct one; `W` is what
/// a waiting connect is (a reply channel in the event loop).
#[derive(Debug)]
pub struct Paths<W> {
    peers: HashMap<PeerId, PeerState<W>>,
    /// Relayed connections that are not needed any more: their peer, and since when.
    retiring: HashMap<ConnectionId, (PeerId, Instant)>,
}

#[derive(Debug)]
struct PeerState<W> {
    direct: HashSet<ConnectionId>,
    /// Relayed connections, and whether each was dialled by the peer with the smaller id.
    relayed: HashMap<ConnectionId, bool>,
    /// When the first relayed connection came up while none was direct.
    relayed_since: Option<Instant>,
    hole_punched: bool,
    waiting: Vec<W>,
    failure: Option<String>,
}

impl<W> Default for PeerState<W> {
    fn default() -> Self {
        PeerState {
            direct: HashSet::new(),
            relayed: HashMap::new(),
            relayed_since: None,
            hole_punched: false,
            waiting: Vec::new(),
            failure: None,
        }
    }
}

impl<W> Default for Paths<W> {
    fn default() -> Self {
        Paths {
            peers: HashMap::new(),
            retiring: HashMap::new(),
        }
    }
}

impl<W> Paths<W> {
    /// Connection `id` to `peer` came up, directly or through a relay circuit; `waiting` are
    /// the connects that asked for the peer.
    pub fn established(
        &mut self,
        peer: PeerId,
        id: ConnectionId,
        kind: Kind,
        mut waiting: Vec<W>,
        now: Instant,
    ) -> Established<W> {
        let state = self.peers.entry(peer).or_default();
        if let Kind::Relayed {
            dialled_by_smaller_id,
        } = kind
        {
            if !state.direct.is_empty() {
                // A direct connection is there already: this one is not needed (but is the way
                // to the peer should the direct one be lost).
                waiting.append(&mut state.waiting);
                state.relayed.insert(id, dialled_by_smaller_id);
                self.retiring.insert(id, (peer, now));
                return Established::Direct {
                    waiting,
                    after_relay: None,
                };
            }
            let kept_exists = state.relayed.values().any(|kept| *kept);
            let others_exist = state.relayed.values().any(|kept| !*kept);
            if dialled_by_smaller_id && others_exist {
                for (other, _) in state.relayed.extract_if(|_, kept| !*kept) {
                    self.retiring.insert(other, (peer, now));
                }
                state.relayed.insert(id, true);
            } else if !dialled_by_smaller_id && kept_exists {
                self.retiring.insert(id, (peer, now));
            } else {
                state.relayed.insert(id, dialled_by_smaller_id);
            }
            state.relayed_since.get_or_insert(now);
            state.waiting.append(&mut waiting);
            return Established::Wait;
        }
        state.direct.insert(id);
        waiting.append(&mut state.waiting);
        for relayed in state.relayed.keys() {
            self.retiring.entry(*relayed).or_insert((peer, now));
        }
        Established::Direct {
            waiting,
            // Inside the window: the connects waited for this.
            after_relay: (state.relayed_since.take()).map(|since| now.duration_since(since)),
        }
    }

    /// DCUtR made connection `id` to `peer` (it came up as direct before, or comes up next).
    pub fn hole_punched(&mut self, peer: PeerId) {
        let state = self.peers.entry(peer).or_default();
        state.hole_punched = true;
        state.failure = None;
    }

    /// A hole punch to `peer` failed, for `reason`; DCUtR has given up. Ends the peer's
    /// window: no direct connection will come.
    pub fn punch_failed(&mut self, peer: PeerId, reason: String) -> Option<StaysRelayed<W>> {
        let state = self.peers.entry(peer).or_default();
        state.failure = Some(reason.clone());
        state.relayed_since.take()?;
        Some(StaysRelayed {
            peer,
            waiting: std::mem::take(&mut state.waiting),
            failure: Some(reason),
        })
    }

    /// Connection `id` to `peer` closed.
    pub fn closed(&mut self, peer: PeerId, id: ConnectionId) {
        self.retiring.remove(&id);
        let Some(state) = self.peers.get_mut(&peer) else {
            return;
        };
        state.direct.remove(&id);
        state.relayed.remove(&id);
        if state.direct.is_empty() {
            state.hole_punched = false;
            // The direct connection is gone: the relay it replaced is the way to the peer again.
            self.retiring
                .retain(|relayed, _| !state.relayed.contains_key(relayed));
        }
        // The other side may close the relayed connection as soon as its own direct one is
        // up, a moment before this side's is: the window stays open for it.
        if state.direct.is_empty() && state.relayed.is_empty() && state.relayed_since.is_none() {
            self.peers.remove(&peer);
        }
    }

    /// A connect for `peer` that found it connected: returned at once unless the peer is
    /// reached only through a relay whose window for a direct connection is still open, in
    /// which case it waits here.
    pub fn connect(&mut self, peer: PeerId, waiting: W, now: Instant) -> Option<W> {
        match self.peers.get_mut(&peer) {
            Some(state)
                if state.direct.is_empty()
                    && state
                        .relayed_since
                        .is_some_and(|since| now.duration_since(since) < PUNCH_WINDOW) =>
            {
                state.waiting.push(waiting);
                None
            }
            _ => Some(waiting),
        }
    }

    /// The peers whose window closed without a direct connection by `now`: their connects go
    /// on through the relay.
    pub fn expire(&mut self, now: Instant) -> Vec<StaysRelayed<W>> {
        self.peers.retain(|_, state| {
            !(state.direct.is_empty()
                && state.relayed.is_empty()
                && state.waiting.is_empty()
                && state
                    .relayed_since
                    .is_none_or(|since| now.duration_since(since) >= PUNCH_WINDOW))
        });
        let mut ended = Vec::new();
        for (peer, state) in &mut self.peers {
            let Some(since) = state.relayed_since else {
                continue;
            };
            if now.duration_since(since) >= PUNCH_WINDOW {
                state.relayed_since = None;
                ended.push(StaysRelayed {
                    peer: *peer,
                    waiting: std::mem::take(&mut state.waiting),
                    failure: state.failure.clone(),
                });
            }
        }
        ended
    }

    /// The retired relayed connections to close now: those whose peer is `quiet` (nothing of
    /// the application's under way with it), and those retired [`RETIRE_AT_MOST`] ago.
    pub fn retire(&mut self, now: Instant, quiet: impl Fn(&PeerId) -> bool) -> Retired {
        let mut retired = Retired::default();
        self.retiring.retain(|id, (peer, since)| {
            if quiet(peer) {
                retired.quiet.push(*id);
            } else if now.duration_since(*since) >= RETIRE_AT_MOST {
                retired.overdue.push(*id);
            } else {
                return true;
            }
            false
        });
        retired
    }

    /// Whether connection `id` is a relayed one that is not needed any more.
    pub fn is_retiring(&self, id: ConnectionId) -> bool {
        self.retiring.contains_key(&id)
    }

    /// How `peer` is reached, if it is connected.
    pub fn path(&self, peer: &PeerId) -> Option<Path> {
        let state = self.peers.get(peer)?;
        if !state.direct.is_empty() {
            Some(if state.hole_punched {
                Path::HolePunched
            } else {
                Path::Direct
            })
        } else if !state.relayed.is_empty() {
            Some(Path::Relayed)
        } else {
            None
        }
    }

    /// Every connected peer and how it is reached.
    pub fn all(&self) -> Vec<(PeerId, Path)> {
        let mut all: Vec<(PeerId, Path)> = self
            .peers
            .keys()
            .filter_map(|peer| Some((*peer, self.path(peer)?)))
            .collect();
        all.sort_by_key(|(peer, _)| peer.to_bytes());
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RELAYED: Kind = Kind::Relayed {
        dialled_by_smaller_id: true,
    };

    /// Both sides reached for each other at once: each keeps the connection the smaller id
    /// dialled, whichever came up first.
    #[test]
    fn of_two_relayed_connections_both_sides_keep_the_one_the_smaller_id_dialled() {
        let t0 = Instant::now();
        let (mine, theirs) = ids();
        let peer = PeerId::random();
        let theirs_kind = Kind::Relayed {
            dialled_by_smaller_id: false,
        };
        // Mine (dialled by the smaller id) first: theirs is closed when it comes.
        let mut paths = Paths::<&str>::default();
        paths.established(peer, mine, RELAYED, Vec::new(), t0);
        assert_eq!(
            paths.established(peer, theirs, theirs_kind, Vec::new(), t0),
            Established::Wait
        );
        assert_eq!(paths.retire(t0, |_| true).quiet, vec![theirs]);
        // Theirs first: it is closed when mine comes.
        let mut paths = Paths::<&str>::default();
        paths.established(peer, theirs, theirs_kind, Vec::new(), t0);
        assert_eq!(
            paths.established(peer, mine, RELAYED, Vec::new(), t0),
            Established::Wait
        );
        assert_eq!(paths.retire(t0, |_| true).quiet, vec![theirs]);
        assert_eq!(paths.path(&peer), Some(Path::Relayed));
    }

    fn ids() -> (ConnectionId, ConnectionId) {
        (
            ConnectionId::new_unchecked(1),
            ConnectionId::new_unchecked(2),
        )
    }

    #[test]
    fn a_connect_over_the_relay_waits_for_the_hole_punch_and_the_relay_is_closed() {
        let mut paths = Paths::default();
        let peer = PeerId::random();
        let (relayed, direct) = ids();
        let t0 = Instant::now();
        assert_eq!(
            paths.established(peer, relayed, RELAYED, vec!["first"], t0),
            Established::Wait
        );
        assert_eq!(paths.path(&peer), Some(Path::Relayed));
        // A second connect finds the peer connected, but only through the relay: it waits.
        assert_eq!(
            paths.connect(peer, "second", t0 + Duration::from_secs(1)),
            None
        );
        paths.hole_punched(peer);
        assert_eq!(
            paths.established(
                peer,
                direct,
                Kind::Direct,
                Vec::new(),
                t0 + Duration::from_secs(1)
            ),
            Established::Direct {
                waiting: vec!["first", "second"],
                after_relay: Some(Duration::from_secs(1)),
            }
        );
        // Nothing is under way inside the window: the relay closes at once.
        assert_eq!(
            paths.retire(t0 + Duration::from_secs(1), |_| true).quiet,
            vec![relayed]
        );
        paths.closed(peer, relayed);
        assert_eq!(paths.path(&peer), Some(Path::HolePunched));
        // From now on connects go straight through.
        assert_eq!(
            paths.connect(peer, "third", t0 + Duration::from_secs(2)),
            Some("third")
        );
        assert!(paths.expire(t0 + Duration::from_secs(60)).is_empty());
        assert_eq!(
            paths.retire(t0 + Duration::from_secs(60), |_| true),
            Retired::default()
        );
    }

    #[test]
    fn without_a_direct_connection_the_relay_carries_the_traffic_after_the_window() {
        let mut paths = Paths::default();
        let peer = PeerId::random();
        let (relayed, _) = ids();
        let t0 = Instant::now();
        paths.established(peer, relayed, RELAYED, vec!["first"], t0);
        assert!(paths.expire(t0 + PUNCH_WINDOW / 2).is_empty());
        assert_eq!(
            paths.expire(t0 + PUNCH_WINDOW),
            vec![StaysRelayed {
                peer,
                waiting: vec!["first"],
                failure: None,
            }]
        );
        // Said once; later connects use the relay at once.
        assert!(paths.expire(t0 + PUNCH_WINDOW * 2).is_empty());
        assert_eq!(
            paths.connect(peer, "later", t0 + PUNCH_WINDOW * 2),
            Some("later")
        );
        assert_eq!(paths.path(&peer), Some(Path::Relayed));
    }

    /// DCUtR gave up (symmetric NATs): the connects go on through the relay at once, not after
    /// the rest of the window.
    #[test]
    fn a_failed_hole_punch_ends_the_window() {
        let mut paths = Paths::default();
        let peer = PeerId::random();
        let (relayed, _) = ids();
        let t0 = Instant::now();
        paths.established(peer, relayed, RELAYED, vec!["first"], t0);
        assert_eq!(
            paths.punch_failed(peer, "Giving up after 3 dial attempts".into()),
            Some(StaysRelayed {
                peer,
                waiting: vec!["first"],
                failure: Some("Giving up after 3 dial attempts".into()),
            })
        );
        assert!(paths.expire(t0 + PUNCH_WINDOW).is_empty());
        assert_eq!(paths.connect(peer, "later", t0), Some("later"));
    }

    /// A hole punch that succeeds after the window finds the relay carrying traffic: it is
    /// closed once its peer is quiet, or after [`RETIRE_AT_MOST`] whatever it carries.
    #[test]
    fn a_relay_that_carries_traffic_is_closed_once_its_peer_is_quiet() {
        let mut paths = Paths::<&str>::default();
        let peer = PeerId::random();
        let (relayed, direct) = ids();
        let t0 = Instant::now();
        paths.established(peer, relayed, RELAYED, Vec::new(), t0);
        paths.expire(t0 + PUNCH_WINDOW);
        let late = t0 + PUNCH_WINDOW * 2;
        assert_eq!(
            paths.established(peer, direct, Kind::Direct, Vec::new(), late),
            Established::Direct {
                waiting: Vec::new(),
                after_relay: None,
            }
        );
        assert_eq!(paths.path(&peer), Some(Path::Direct));
        let busy = |_: &PeerId| false;
        assert!(paths.is_retiring(relayed));
        assert_eq!(paths.retire(late, busy), Retired::default());
        assert_eq!(
            paths.retire(late + RETIRE_AT_MOST / 2, busy),
            Retired::default()
        );
        assert_eq!(
            paths
                .retire(late + RETIRE_AT_MOST / 2, |p| *p == peer)
                .quiet,
            vec![relayed]
        );
        assert!(!paths.is_retiring(relayed));
        assert_eq!(
            paths.retire(late + RETIRE_AT_MOST * 2, |_| true),
            Retired::default()
        );

        // Never quiet: closed all the same once its time is up.
        let mut paths = replaced_after_the_window(peer, (relayed, direct), t0);
        assert_eq!(
            paths.retire(late + RETIRE_AT_MOST, busy),
            Retired {
                quiet: Vec::new(),
                overdue: vec![relayed]
            }
        );
    }

    /// `peer` reached through `relayed` at `t0`, its window over, then `direct` at twice the
    /// window.
    fn replaced_after_the_window(
        peer: PeerId,
        (relayed, direct): (ConnectionId, ConnectionId),
        t0: Instant,
    ) -> Paths<&'static str> {
        let mut paths = Paths::default();
        paths.established(peer, relayed, RELAYED, Vec::new(), t0);
        paths.expire(t0 + PUNCH_WINDOW);
        paths.established(
            peer,
            direct,
            Kind::Direct,
            Vec::new(),
            t0 + PUNCH_WINDOW * 2,
        );
        paths
    }

    /// The direct connection is lost while the relay it replaced still finishes its work: the
    /// relay is the way to the peer again, and is kept.
    #[test]
    fn a_retiring_relay_is_kept_when_the_direct_connection_is_lost() {
        let peer = PeerId::random();
        let (relayed, direct) = ids();
        let t0 = Instant::now();
        let mut paths = replaced_after_the_window(peer, (relayed, direct), t0);
        paths.closed(peer, direct);
        assert_eq!(paths.path(&peer), Some(Path::Relayed));
        assert_eq!(
            paths.retire(t0 + RETIRE_AT_MOST * 2, |_| true),
            Retired::default()
        );

        // The relay came after the direct connection: kept all the same.
        let mut paths = Paths::<&str>::default();
        paths.established(peer, direct, Kind::Direct, Vec::new(), t0);
        paths.established(peer, relayed, RELAYED, Vec::new(), t0);
        assert!(paths.is_retiring(relayed));
        paths.closed(peer, direct);
        assert_eq!(paths.path(&peer), Some(Path::Relayed));
        assert!(!paths.is_retiring(relayed));
    }

    /// Two relayed connections dialled by the same side (through two gateways) are both kept:
    /// each side alone could not tell which one the other keeps.
    #[test]
    fn two_relayed_connections_dialled_by_the_same_side_are_both_kept() {
        let mut paths = Paths::<&str>::default();
        let peer = PeerId::random();
        let (one, two) = ids();
        let t0 = Instant::now();
        let theirs = Kind::Relayed {
            dialled_by_smaller_id: false,
        };
        paths.established(peer, one, theirs, Vec::new(), t0);
        assert_eq!(
            paths.established(peer, two, theirs, Vec::new(), t0),
            Established::Wait
        );
        assert_eq!(paths.retire(t0, |_| true), Retired::default());
    }

    #[test]
    fn a_relayed_connection_next_to_a_direct_one_is_closed_once_quiet() {
        let mut paths = Paths::default();
        let peer = PeerId::random();
        let (relayed, direct) = ids();
        let t0 = Instant::now();
        assert_eq!(
            paths.established(peer, direct, Kind::Direct, vec!["a"], t0),
            Established::Direct {
                waiting: vec!["a"],
                after_relay: None,
            }
        );
        assert_eq!(
            paths.established(peer, relayed, RELAYED, vec!["b"], t0),
            Established::Direct {
                waiting: vec!["b"],
                after_relay: None,
            }
        );
        assert_eq!(paths.retire(t0, |_| true).quiet, vec![relayed]);
        assert_eq!(paths.path(&peer), Some(Path::Direct));
        paths.closed(peer, direct);
        paths.closed(peer, relayed);
        assert_eq!(paths.path(&peer), None);
        assert!(paths.all().is_empty());
    }

    /// The other side closes the relay once its direct connection is up, a moment before this
    /// side's comes up: the waiting connects still wait for it, and it counts as punched.
    #[test]
    fn a_relay_closed_by_the_other_side_first_still_counts_as_replaced() {
        let mut paths = Paths::default();
        let peer = PeerId::random();
        let (relayed, direct) = ids();
        let t0 = Instant::now();
        paths.established(peer, relayed, RELAYED, vec!["first"], t0);
        paths.closed(peer, relayed);
        assert_eq!(paths.path(&peer), None);
        assert_eq!(
            paths.established(
                peer,
                direct,
                Kind::Direct,
                Vec::new(),
                t0 + Duration::from_millis(5)
            ),
            Established::Direct {
                waiting: vec!["first"],
                after_relay: Some(Duration::from_millis(5)),
            }
        );
        assert_eq!(paths.path(&peer), Some(Path::Direct));
    }
}
