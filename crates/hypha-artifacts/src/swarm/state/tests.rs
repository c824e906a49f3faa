//! The swarm's rules as sequences of inputs and the actions they call for: no network, no
//! task, no disk, the clock moved by hand.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::{sync::Arc, time::Duration};

use hypha_network::PeerId;
use rand::SeedableRng;
use tokio::time::Instant;

use super::{Action, Input, PULLING_PATIENCE, State};
use crate::{
    Settings,
    manifest::{FileEntry, Manifest},
    protocol::SwarmMessage,
    swarm::{Failure, PeerFailure, Progress},
};

const CHUNKS: u32 = 8;
const CHUNK_SIZE: u64 = 1024;

/// One node's swarm state over an artifact of [`CHUNKS`] chunks, and the clock.
struct Swarm {
    state: State,
    start: Instant,
    /// Every action asked for so far, in order.
    log: Vec<Action>,
}

impl Swarm {
    /// A swarm waiting for `expect` members (this node included).
    fn new(expect: usize) -> Self {
        Self::with(expect, Settings::default())
    }

    fn with(expect: usize, settings: Settings) -> Self {
        let files = vec![FileEntry {
            relative: "model.bin".into(),
            location: "p/model.bin".into(),
            size: CHUNKS as u64 * CHUNK_SIZE,
            e_tag: Some("\"1\"".into()),
            version: None,
            last_modified_ms: 0,
        }];
        let manifest = Arc::new(Manifest::new("s3://bucket/p", CHUNK_SIZE, files));
        let start = Instant::now();
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let state = State::new(
            PeerId::random(),
            settings,
            manifest,
            Vec::new(),
            expect,
            Progress::default(),
            start,
            &mut rng,
        );
        Swarm {
            state,
            start,
            log: Vec::new(),
        }
    }

    /// Applies `input` at `at` after the start.
    fn at(&mut self, at: Duration, input: Input) -> Vec<Action> {
        let actions = self.state.apply(input, self.start + at);
        self.log.extend(actions.iter().cloned());
        actions
    }

    /// The actions asked for since this was last asked.
    fn take_log(&mut self) -> Vec<Action> {
        std::mem::take(&mut self.log)
    }

    /// `peer` joins at `at` and says it holds nothing and sends nothing (so that the ring
    /// can be whole); the generation of its stream to us.
    fn join(&mut self, at: Duration, peer: PeerId) -> u64 {
        self.join_holding(at, peer, Vec::new())
    }

    /// [`join`](Self::join), saying `held` before it is synced.
    fn join_holding(&mut self, at: Duration, peer: PeerId, held: Vec<SwarmMessage>) -> u64 {
        let generation = self
            .at(at, Input::Joined(peer))
            .into_iter()
            .find_map(|action| match action {
                Action::ReadFrom {
                    peer: p,
                    generation,
                } if p == peer => Some(generation),
                _ => None,
            })
            .unwrap();
        for message in held {
            self.say(at, peer, generation, message);
        }
        self.say(at, peer, generation, SwarmMessage::Load { uploads: 0 });
        generation
    }

    /// `peer`'s stream (of `generation`) brings `message` at `at`.
    fn say(
        &mut self,
        at: Duration,
        peer: PeerId,
        generation: u64,
        message: SwarmMessage,
    ) -> Vec<Action> {
        self.at(
            at,
            Input::Message {
                peer,
                generation,
                message,
            },
        )
    }

    /// `peer` failed this node's request for `chunk` at `at`, with `failure`.
    fn refused(
        &mut self,
        at: Duration,
        chunk: u32,
        peer: PeerId,
        failure: PeerFailure,
    ) -> Vec<Action> {
        let result = Err(failure);
        self.at(
            at,
            Input::PeerPulled {
                chunk,
                peer,
                result,
            },
        )
    }

    /// The member whose turn it is to read `chunk` from the origin, as this node sees it.
    fn owner(&self, chunk: u32) -> PeerId {
        self.state.owner(chunk, &self.state.members()).unwrap()
    }

    fn me(&self) -> PeerId {
        self.state.me
    }

    fn banned(&self, peer: PeerId) -> bool {
        self.state
            .progress()
            .peers
            .iter()
            .any(|p| p.peer == peer && p.banned)
    }
}

fn origin_pulls(actions: &[Action]) -> Vec<u32> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::PullFromOrigin(chunk) => Some(*chunk),
            _ => None,
        })
        .collect()
}

fn peer_pulls(actions: &[Action]) -> Vec<(u32, PeerId)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::PullFromPeer { chunk, peer, .. } => Some((*chunk, *peer)),
            _ => None,
        })
        .collect()
}

const fn ms(ms: u64) -> Duration {
    Duration::from_millis(ms)
}

fn hash(seed: u8) -> [u8; 32] {
    [seed; 32]
}

fn have(chunk: u32, blake3: [u8; 32], from_origin: bool) -> SwarmMessage {
    SwarmMessage::Have {
        chunk,
        blake3,
        from_origin,
    }
}

#[test]
fn nothing_is_read_before_the_expected_members_joined_or_the_join_timeout_passed() {
    let mut swarm = Swarm::new(2);
    assert!(origin_pulls(&swarm.at(ms(0), Input::Start)).is_empty());
    let tick = || Input::Tick {
        named: Vec::new(),
        uploads: 0,
    };
    assert!(origin_pulls(&swarm.at(ms(9_900), tick())).is_empty());
    // Alone at the join timeout: every chunk is this node's to read, within its slots.
    let pulled = origin_pulls(&swarm.at(ms(10_000), tick()));
    assert_eq!(pulled.len(), 8, "{pulled:?}");
}

#[test]
fn a_member_that_joins_is_read_and_hears_what_this_node_holds() {
    let mut swarm = Swarm::new(2);
    swarm.at(ms(0), Input::Start);
    let peer = PeerId::random();
    let actions = swarm.at(ms(10), Input::Joined(peer));
    assert!(
        matches!(actions[0], Action::ReadFrom { peer: p, .. } if p == peer),
        "{actions:?}"
    );
    let initial = actions
        .iter()
        .find_map(|a| match a {
            Action::Connect {
                peer: p, initial, ..
            } if *p == peer => Some(initial.clone()),
            _ => None,
        })
        .unwrap();
    assert_eq!(initial, vec![SwarmMessage::Load { uploads: 0 }]);
}

#[test]
fn each_chunk_leaves_the_origin_once_read_by_its_owner() {
    let mut swarm = Swarm::new(2);
    swarm.at(ms(0), Input::Start);
    let peer = PeerId::random();
    swarm.join(ms(10), peer);
    swarm.at(
        ms(20),
        Input::Tick {
            named: Vec::new(),
            uploads: 0,
        },
    );
    let mut pulled = origin_pulls(&swarm.take_log());
    pulled.sort();
    let mine: Vec<u32> = (0..CHUNKS)
        .filter(|&c| swarm.owner(c) == swarm.me())
        .collect();
    assert!(!mine.is_empty() && mine.len() < CHUNKS as usize, "{mine:?}");
    assert_eq!(pulled, mine);
}

/// A member announces it read, from the origin, a chunk that was this node's to read, with
/// a hash the origin contradicts: it is banned, and a chunk it read in its own turn is not
/// taken from it.
#[test]
fn a_liar_found_out_is_banned_and_not_asked_again() {
    let mut swarm = Swarm::new(2);
    swarm.at(ms(0), Input::Start);
    let liar = PeerId::random();
    let generation = swarm.join(ms(10), liar);
    let mine = (0..CHUNKS).find(|&c| swarm.owner(c) == swarm.me()).unwrap();
    let its = (0..CHUNKS).find(|&c| swarm.owner(c) == liar).unwrap();
    swarm.say(ms(20), liar, generation, have(mine, hash(1), true));
    // Out of its turn, its word alone is not taken: this node reads the chunk.
    let actions = swarm.at(
        ms(30),
        Input::Tick {
            named: Vec::new(),
            uploads: 0,
        },
    );
    assert!(!peer_pulls(&actions).contains(&(mine, liar)), "{actions:?}");
    let truth = hash(2);
    swarm.at(
        ms(40),
        Input::OriginPulled {
            chunk: mine,
            result: Ok(truth),
        },
    );
    assert!(swarm.banned(liar));
    let actions = swarm.say(ms(50), liar, generation, have(its, hash(3), true));
    assert!(peer_pulls(&actions).is_empty(), "{actions:?}");
}

/// A member that holds a chunk, vouched for in its turn, and answers `busy` every time: once
/// nothing arrived for `stall_patience`, the next member in turn (this node) reads it from
/// the origin.
#[test]
fn a_silent_holder_is_passed_over_after_stall_patience() {
    let mut swarm = Swarm::new(2);
    swarm.at(ms(0), Input::Start);
    let holder = PeerId::random();
    let generation = swarm.join(ms(10), holder);
    let its = (0..CHUNKS).find(|&c| swarm.owner(c) == holder).unwrap();
    let actions = swarm.say(ms(20), holder, generation, have(its, hash(1), true));
    assert!(peer_pulls(&actions).contains(&(its, holder)), "{actions:?}");
    // The chunks this node reads itself are still on their way: nothing arrives.
    let actions = swarm.refused(ms(30), its, holder, PeerFailure::Busy);
    assert!(!origin_pulls(&actions).contains(&its));
    let patience = Settings::default().stall_patience;
    let tick = Input::Tick {
        named: Vec::new(),
        uploads: 0,
    };
    let actions = swarm.at(patience - ms(100), tick);
    assert!(!origin_pulls(&actions).contains(&its), "{actions:?}");
    // Asked again once left alone for a moment, it is busy again.
    assert!(peer_pulls(&actions).contains(&(its, holder)), "{actions:?}");
    swarm.refused(patience - ms(50), its, holder, PeerFailure::Busy);
    let actions = swarm.at(
        patience + ms(100),
        Input::Tick {
            named: Vec::new(),
            uploads: 0,
        },
    );
    assert!(origin_pulls(&actions).contains(&its), "{actions:?}");
}

/// A member that says it reads its chunk from the origin and never finishes holds it up for
/// [`PULLING_PATIENCE`], not for ever.
#[test]
fn a_member_reading_for_longer_than_pulling_patience_is_passed_over() {
    let settings = Settings {
        // Its turn is not passed over for reading nothing: only the pull's patience counts.
        stall_patience: Duration::from_secs(3600),
        ..Settings::default()
    };
    let mut swarm = Swarm::with(2, settings);
    swarm.at(ms(0), Input::Start);
    let reader = PeerId::random();
    let generation = swarm.join(ms(10), reader);
    let its = (0..CHUNKS).find(|&c| swarm.owner(c) == reader).unwrap();
    swarm.say(
        ms(20),
        reader,
        generation,
        SwarmMessage::Pulling { chunk: its },
    );
    let actions = swarm.at(
        ms(30),
        Input::Tick {
            named: Vec::new(),
            uploads: 0,
        },
    );
    assert!(!origin_pulls(&actions).contains(&its));
    let actions = swarm.at(
        PULLING_PATIENCE + ms(100),
        Input::Tick {
            named: Vec::new(),
            uploads: 0,
        },
    );
    assert!(origin_pulls(&actions).contains(&its), "{actions:?}");
}

/// A newcomer to two members that hold every chunk (taken from each other, so that neither
/// vouches for them from the origin) takes them from the members, and reads from the origin
/// only the chunks that are its own to read.
#[test]
fn a_newcomer_takes_the_chunks_two_members_hold_from_them() {
    let mut swarm = Swarm::new(3);
    swarm.at(ms(0), Input::Start);
    let members = [PeerId::random(), PeerId::random()];
    for (i, member) in members.iter().enumerate() {
        let held = (0..CHUNKS).map(|c| have(c, hash(c as u8), false)).collect();
        swarm.join_holding(ms(10 + i as u64), *member, held);
    }
    swarm.at(
        ms(20),
        Input::Tick {
            named: Vec::new(),
            uploads: 0,
        },
    );
    let actions = swarm.take_log();
    let mine: Vec<u32> = (0..CHUNKS)
        .filter(|&c| swarm.owner(c) == swarm.me())
        .collect();
    let mut from_origin = origin_pulls(&actions);
    from_origin.sort();
    assert_eq!(from_origin, mine);
    let from_peers = peer_pulls(&actions);
    assert_eq!(
        from_peers.len(),
        CHUNKS as usize - mine.len(),
        "{actions:?}"
    );
    assert!(
        from_peers
            .iter()
            .all(|(chunk, peer)| !mine.contains(chunk) && members.contains(peer))
    );
}

/// A member that sent bytes that did not match their hash stays banned when it reconnects:
/// nothing is pulled from it again.
#[test]
fn a_ban_outlives_a_reconnect() {
    let mut swarm = Swarm::new(2);
    swarm.at(ms(0), Input::Start);
    let peer = PeerId::random();
    let generation = swarm.join(ms(10), peer);
    let its: Vec<u32> = (0..CHUNKS).filter(|&c| swarm.owner(c) == peer).collect();
    let actions = swarm.say(ms(20), peer, generation, have(its[0], hash(1), true));
    assert!(
        peer_pulls(&actions).contains(&(its[0], peer)),
        "{actions:?}"
    );
    swarm.refused(
        ms(30),
        its[0],
        peer,
        PeerFailure::Corrupt("blake3 mismatch".into()),
    );
    assert!(swarm.banned(peer));
    swarm.at(ms(40), Input::ReaderClosed { peer, generation });
    let generation = swarm.join(ms(50), peer);
    let other = its[1];
    let actions = swarm.say(ms(60), peer, generation, have(other, hash(2), true));
    assert!(swarm.banned(peer));
    assert!(peer_pulls(&actions).is_empty(), "{actions:?}");
}

/// Three failed requests in a row ban a holder; refusals an honest member gives too (`busy`,
/// `missing`) do not count.
#[test]
fn a_holder_failing_three_requests_in_a_row_is_not_asked_again() {
    let mut swarm = Swarm::new(2);
    swarm.at(ms(0), Input::Start);
    let peer = PeerId::random();
    let generation = swarm.join(ms(10), peer);
    let its: Vec<u32> = (0..CHUNKS).filter(|&c| swarm.owner(c) == peer).collect();
    for &chunk in &its {
        swarm.say(
            ms(20),
            peer,
            generation,
            have(chunk, hash(chunk as u8), true),
        );
    }
    for (i, refusal) in [PeerFailure::Busy, PeerFailure::Refused("missing".into())]
        .into_iter()
        .enumerate()
    {
        swarm.refused(ms(30 + i as u64), its[0], peer, refusal);
    }
    assert!(!swarm.banned(peer));
    for i in 0..3 {
        let at = ms(2_000 * (i + 1));
        let failed = PeerFailure::Failed("stream closed".into());
        swarm.refused(at, its[0], peer, failed);
        assert_eq!(swarm.banned(peer), i == 2, "after {} failures", i + 1);
    }
}

/// A member that drops a chunk it read from the origin would leave it unread (nobody else
/// reads a chunk its reader holds): it is not asked again.
#[test]
fn a_member_that_drops_a_chunk_it_read_from_the_origin_is_banned() {
    let mut swarm = Swarm::new(2);
    swarm.at(ms(0), Input::Start);
    let peer = PeerId::random();
    let generation = swarm.join(ms(10), peer);
    let its = (0..CHUNKS).find(|&c| swarm.owner(c) == peer).unwrap();
    swarm.say(ms(20), peer, generation, have(its, hash(1), true));
    assert!(!swarm.banned(peer));
    swarm.say(
        ms(30),
        peer,
        generation,
        SwarmMessage::Dropped { chunk: its },
    );
    assert!(swarm.banned(peer));
}

/// An honest member reads a chunk of one version of an artifact with one hash: one that
/// announces two is a liar.
#[test]
fn a_member_that_vouches_for_two_hashes_of_a_chunk_is_banned() {
    let mut swarm = Swarm::new(2);
    swarm.at(ms(0), Input::Start);
    let peer = PeerId::random();
    let generation = swarm.join(ms(10), peer);
    let its = (0..CHUNKS).find(|&c| swarm.owner(c) == peer).unwrap();
    swarm.say(ms(20), peer, generation, have(its, hash(1), true));
    swarm.say(ms(30), peer, generation, have(its, hash(2), true));
    assert!(swarm.banned(peer));
}

/// An origin read that fails is tried again, and the third failure of a chunk fails the
/// fetch.
#[test]
fn an_origin_read_that_keeps_failing_fails_the_fetch() {
    let mut swarm = Swarm::new(1);
    let pulled = origin_pulls(&swarm.at(ms(0), Input::Start));
    let chunk = pulled[0];
    let failed = |reason: &str| Err(Failure::Failed(reason.into()));
    for attempt in 1..=3 {
        swarm.at(
            ms(attempt * 10),
            Input::OriginPulled {
                chunk,
                result: failed("connection reset"),
            },
        );
        assert_eq!(
            swarm.state.progress().failure.is_some(),
            attempt == 3,
            "attempt {attempt}"
        );
    }
}

/// The chunks a node audits it reads from the origin although a member holds them, vouched
/// for in the member's turn: with `origin_audit = 1`, every chunk, none from the member.
#[test]
fn audited_chunks_are_read_from_the_origin_although_a_member_holds_them() {
    let settings = Settings {
        origin_audit: 1.0,
        ..Settings::default()
    };
    let mut swarm = Swarm::with(2, settings);
    swarm.at(ms(0), Input::Start);
    let member = PeerId::random();
    let its: Vec<u32> = {
        let generation = swarm.join(ms(10), member);
        let its: Vec<u32> = (0..CHUNKS).filter(|&c| swarm.owner(c) == member).collect();
        for &chunk in &its {
            swarm.say(
                ms(20),
                member,
                generation,
                have(chunk, hash(chunk as u8), true),
            );
        }
        its
    };
    swarm.at(
        ms(30),
        Input::Tick {
            named: Vec::new(),
            uploads: 0,
        },
    );
    let actions = swarm.take_log();
    assert!(peer_pulls(&actions).is_empty(), "{actions:?}");
    let from_origin = origin_pulls(&actions);
    assert!(its.iter().all(|c| from_origin.contains(c)), "{actions:?}");
}

/// A chunk read from the origin is held (the chunk server serves it) before members hear
/// that it is: one asking at once is not answered `missing`. A member already joined hears
/// of it; the uploads the actor counts go out as the node's load once they change.
#[test]
fn a_chunk_is_held_before_members_hear_of_it_and_the_load_follows_the_uploads() {
    let mut swarm = Swarm::new(2);
    swarm.at(ms(0), Input::Start);
    let peer = PeerId::random();
    swarm.join(ms(10), peer);
    let tick = |uploads| Input::Tick {
        named: Vec::new(),
        uploads,
    };
    swarm.at(ms(20), tick(0));
    let chunk = origin_pulls(&swarm.take_log())[0];
    let actions = swarm.at(
        ms(30),
        Input::OriginPulled {
            chunk,
            result: Ok(hash(1)),
        },
    );
    let held = actions
        .iter()
        .position(
            |a| matches!(a, Action::Hold { chunk: c, held } if *c == chunk && held.from_origin),
        )
        .unwrap();
    let told = actions
        .iter()
        .position(
            |a| matches!(a, Action::Broadcast(SwarmMessage::Have { chunk: c, .. }) if *c == chunk),
        )
        .unwrap();
    assert!(held < told, "{actions:?}");

    let load = |actions: &[Action]| {
        actions
            .iter()
            .any(|a| matches!(a, Action::Broadcast(SwarmMessage::Load { uploads: 2 })))
    };
    assert!(load(&swarm.at(ms(40), tick(2))));
    assert!(!load(&swarm.at(ms(50), tick(2))), "said once");
}
