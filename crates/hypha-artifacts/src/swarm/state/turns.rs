//! The turn ring: who reads which chunk from the origin, when a member is passed over, and
//! which chunks this node takes from which holders.

use std::collections::HashMap;

use hypha_network::PeerId;
use tokio::time::Instant;

use super::{PULLING_PATIENCE, Peer, State, Vouched};

impl State {
    /// The next chunk this node reads from the origin: one whose hash members dispute, one
    /// it audits, one it owns that others claimed before it could read it, one its holders
    /// hold back that falls to it, or one nobody read from the origin that falls to it.
    pub(super) fn next_origin_chunk(&self, members: &[PeerId]) -> Option<u32> {
        let now = self.now;
        let patience = self.settings.stall_patience;
        // Nothing arrived for that long, so holders that do not send a chunk are not busy
        // with this node's other requests.
        let stalled = now.duration_since(self.last_arrival) >= patience;
        (0..self.manifest.chunk_count()).find(|&chunk| {
            if self.is_held(chunk) || self.in_flight.contains_key(&chunk) {
                return false;
            }
            match self.vouches[chunk as usize] {
                Vouched::Disputed => true,
                Vouched::Endorsed(_) if self.owner(chunk, members) == Some(self.me) => true,
                Vouched::For(hash) | Vouched::Endorsed(hash) => {
                    self.audit[chunk as usize]
                        // Its voucher left (or this node read it, then dropped it), and no
                        // live member that holds it so sends it.
                        || (!self.peers.values().any(|p| {
                            p.live()
                                && !p.banned
                                && p.have.get(&chunk).is_some_and(|c| c.hash == hash)
                                && !(stalled
                                    && p.held_back.get(&chunk).is_some_and(|since| {
                                        now.duration_since(*since) >= patience
                                    }))
                        }) && self.rescuer(chunk, members) == Some(self.me))
                }
                Vouched::Nobody => {
                    let someone_reads = self.peers.values().any(|p| {
                        p.live()
                            && !p.banned
                            && p.pulling.get(&chunk).is_some_and(|pull| {
                                pull.in_turn && now.duration_since(pull.since) < PULLING_PATIENCE
                            })
                    });
                    !someone_reads && self.reader(chunk, members) == Some(self.me)
                }
            }
        })
    }

    /// Claims and pulls that came while members were still joining were judged against a
    /// ring that was not yet whole: judged again against the one reading starts with.
    pub(super) fn reassess_claims(&mut self, members: &[PeerId]) {
        let said: Vec<(PeerId, u32, Option<PeerId>)> = self
            .peers
            .iter()
            .flat_map(|(id, p)| {
                p.vouched
                    .keys()
                    .chain(p.pulling.keys())
                    .map(move |chunk| (*id, *chunk))
            })
            .map(|(id, chunk)| (id, chunk, self.owner(chunk, members)))
            .collect();
        for (id, chunk, turn) in said {
            if let Some(p) = self.peers.get_mut(&id) {
                if let Some(claim) = p.vouched.get_mut(&chunk) {
                    claim.in_turn = turn == Some(id);
                }
                if let Some(pull) = p.pulling.get_mut(&chunk) {
                    pull.in_turn = turn == Some(id);
                }
            }
        }
        for chunk in 0..self.manifest.chunk_count() {
            self.revouch(chunk);
        }
    }

    /// A member that read a chunk out of its turn as this node saw the ring then, and whose
    /// turn the chunk is now (the members before it held their turns back, and this node's
    /// clock passed them over a moment after the reader's): its word is taken now, so that
    /// the chunk is not read again.
    pub(super) fn take_claims_now_in_turn(&mut self, members: &[PeerId]) {
        let promoted: Vec<(PeerId, u32)> = (0..self.manifest.chunk_count())
            .filter(|&chunk| {
                matches!(
                    self.vouches[chunk as usize],
                    Vouched::Nobody | Vouched::Endorsed(_)
                ) && self.origin_claims(chunk).next().is_some()
            })
            .filter_map(|chunk| {
                let owner = self.owner(chunk, members)?;
                let claim = self.peers.get(&owner)?.vouched.get(&chunk)?;
                (!claim.in_turn).then_some((owner, chunk))
            })
            .collect();
        for (owner, chunk) in promoted {
            if let Some(claim) = self
                .peers
                .get_mut(&owner)
                .and_then(|p| p.vouched.get_mut(&chunk))
            {
                claim.in_turn = true;
            }
            self.revouch(chunk);
        }
    }

    /// The member to read `chunk` from the origin: its owner (`members[(chunk + k) % n]`),
    /// or, where this node banned the owner or the owner has been reading it for longer than
    /// [`PULLING_PATIENCE`], the next member in that order. Each member in that order has
    /// `stall_patience` of its own, counted from the last change of the ring: one that
    /// reads nothing at all by the end of it is passed over (an honest member reads its turns
    /// one after another from the moment they fall to it).
    pub(super) fn owner(&self, chunk: u32, members: &[PeerId]) -> Option<PeerId> {
        self.in_turn(chunk, members, |_| true, true)
    }

    /// Like [`owner`](Self::owner), passing over members that hold the chunk (on a relayed
    /// word only, where this is asked): they will not read it again.
    pub(super) fn reader(&self, chunk: u32, members: &[PeerId]) -> Option<PeerId> {
        self.in_turn(chunk, members, |p| !p.have.contains_key(&chunk), true)
    }

    /// The member to read again a chunk that was read, when no live member sends it: the
    /// first after its owner that does not hold it. Idle members are not passed over: having
    /// read all their turns long ago, they are the ones free to.
    pub(super) fn rescuer(&self, chunk: u32, members: &[PeerId]) -> Option<PeerId> {
        self.in_turn(chunk, members, |p| !p.have.contains_key(&chunk), false)
    }

    pub(super) fn in_turn(
        &self,
        chunk: u32,
        members: &[PeerId],
        eligible: impl Fn(&Peer) -> bool,
        pass_idle: bool,
    ) -> Option<PeerId> {
        let n = members.len();
        let first = (chunk as usize + self.offset) % n;
        let now = self.now;
        let patience = self.settings.stall_patience;
        // `None` once past what an `Instant` can hold: nobody is passed over.
        let mut turn_ends = Some(self.ring_changed);
        (0..n).map(|i| members[(first + i) % n]).find(|m| {
            if *m == self.me {
                return true;
            }
            let Some(p) = self.peers.get(m) else {
                return true;
            };
            if p.banned
                || !eligible(p)
                || p.pulling
                    .get(&chunk)
                    .is_some_and(|pull| now.duration_since(pull.since) >= PULLING_PATIENCE)
            {
                return false;
            }
            turn_ends = turn_ends.and_then(|t| t.checked_add(patience));
            !(pass_idle && turn_ends.is_some_and(|t| now >= t) && self.idle(p, now))
        })
    }

    /// A live member that has announced no chunk read from the origin for `stall_patience`,
    /// and has not said it reads one since, or said so more than [`PULLING_PATIENCE`] ago.
    pub(super) fn idle(&self, p: &Peer, now: Instant) -> bool {
        p.live()
            && p.last_read
                .is_none_or(|t| now.duration_since(t) >= self.settings.stall_patience)
            && p.reading_since
                .is_none_or(|t| now.duration_since(t) >= PULLING_PATIENCE)
    }

    /// Up to `want` (chunk, holder, hash) triples: rarest chunks first, least loaded holders,
    /// only chunks whose hash the origin vouches for, only from holders that announced it;
    /// and the chunks looked at that no holder could send now.
    #[allow(clippy::type_complexity)]
    pub(super) fn next_peer_chunks(&self, want: usize) -> (Vec<(u32, PeerId, [u8; 32])>, Vec<u32>) {
        let now = self.now;
        let upload_slots = self.settings.upload_slots.max(1) as u32;
        let mut load: HashMap<PeerId, u32> = self
            .peers
            .iter()
            .filter(|(_, p)| p.live() && !p.banned && p.left_alone_until.is_none_or(|t| now >= t))
            .map(|(id, p)| (*id, p.uploads.max(p.requests)))
            .collect();
        if load.is_empty() {
            return (Vec::new(), Vec::new());
        }
        // Our requests under way to each holder: at most half the download slots go to one
        // while there are others, so that one sending slowly cannot take them all.
        let mut ours: HashMap<PeerId, u32> = load
            .keys()
            .map(|id| (*id, self.peers[id].requests))
            .collect();
        let slots = self.settings.download_slots.max(1) as u32;
        let per_holder = if load.len() > 1 {
            slots.div_ceil(2)
        } else {
            slots
        };
        let mut candidates: Vec<(u16, u64, u32, [u8; 32])> = (0..self.manifest.chunk_count())
            .filter(|&c| {
                self.availability[c as usize] > 0
                    && !self.audit[c as usize]
                    && !self.is_held(c)
                    && !self.in_flight.contains_key(&c)
            })
            .filter_map(|c| match self.vouches[c as usize] {
                Vouched::For(hash) | Vouched::Endorsed(hash) => {
                    let spread = (c as u64 ^ self.tie_break).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                    Some((self.availability[c as usize], spread, c, hash))
                }
                _ => None,
            })
            .collect();
        candidates.sort_unstable();
        let mut picked = Vec::new();
        let mut blocked = Vec::new();
        for (_, _, chunk, hash) in candidates {
            if picked.len() >= want {
                break;
            }
            let has_slot = |id: &PeerId, load: u32| {
                load < upload_slots
                    && self.peers[id]
                        .have
                        .get(&chunk)
                        .is_some_and(|c| c.hash == hash)
            };
            let holder = load
                .iter()
                .filter(|(id, l)| {
                    has_slot(id, **l) && ours.get(*id).is_some_and(|n| *n < per_holder)
                })
                .min_by_key(|(id, l)| {
                    (
                        **l,
                        (id.to_bytes().last().copied().unwrap_or(0) as u64) ^ self.tie_break,
                    )
                })
                .map(|(id, _)| *id);
            match holder {
                Some(holder) => {
                    *load.entry(holder).or_default() += 1;
                    *ours.entry(holder).or_default() += 1;
                    picked.push((chunk, holder, hash));
                }
                // Held back only if no holder has an upload slot for it: this node's own share
                // per holder is not the holders' doing.
                None if !load.iter().any(|(id, l)| has_slot(id, *l)) => blocked.push(chunk),
                None => {}
            }
        }
        (picked, blocked)
    }
}
