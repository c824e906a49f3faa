//! Whose word a chunk's hash rests on, and what happens to a member the origin contradicts.

use hypha_network::PeerId;

use super::{Claim, State, Vouched};

impl State {
    /// The origin says `truth` is chunk `chunk`'s hash, where this node holds the chunk and a
    /// member said otherwise: whoever vouched for the wrong hash is banned.
    pub(super) fn settle(&mut self, chunk: u32, truth: [u8; 32]) {
        self.verified[chunk as usize] = Some(truth);
        self.revouch(chunk);
        let vouchers = self.vouchers.remove(&chunk).unwrap_or_default();
        if self.held_hash(chunk).is_some_and(|held| held != truth) {
            self.release(chunk);
            for voucher in vouchers {
                self.convict(voucher, chunk);
            }
        }
        self.arbitrate(chunk, truth);
    }

    /// Bans every member that announced it read `chunk` from the origin with a hash other
    /// than `truth`, which this node read from the origin itself.
    pub(super) fn arbitrate(&mut self, chunk: u32, truth: [u8; 32]) {
        let contradicted: Vec<PeerId> = self
            .peers
            .iter()
            .filter(|(_, p)| !p.liar && p.vouched.get(&chunk).is_some_and(|c| c.hash != truth))
            .map(|(id, _)| *id)
            .collect();
        for peer in contradicted {
            self.convict(peer, chunk);
        }
    }

    /// `peer` vouched for a hash of `chunk` that the origin contradicts: it is banned, and
    /// what this node took on its word alone is dropped and fetched again.
    pub(super) fn convict(&mut self, peer: PeerId, chunk: u32) {
        let Some(p) = self.peers.get_mut(&peer).filter(|p| !p.liar) else {
            return;
        };
        p.liar = true;
        tracing::warn!(artifact = %self.manifest.id, %peer, chunk, "announced it read this chunk from the origin, but the origin's bytes have another hash; not trusting it again for this artifact");
        self.ban(peer);
        for chunk in 0..self.manifest.chunk_count() {
            self.revouch(chunk);
        }
        let peers = &self.peers;
        let orphaned: Vec<u32> = self
            .vouchers
            .iter()
            .filter(|(_, vouchers)| {
                vouchers
                    .iter()
                    .all(|v| peers.get(v).is_some_and(|p| p.liar))
            })
            .map(|(chunk, _)| *chunk)
            .collect();
        for chunk in orphaned {
            self.vouchers.remove(&chunk);
            self.release(chunk);
        }
    }

    /// Takes note of whose word chunk `chunk`'s hash rests on now.
    pub(super) fn revouch(&mut self, chunk: u32) {
        self.vouches[chunk as usize] = self.vouched(chunk);
    }

    /// Whose word chunk `chunk`'s hash rests on, as far as this node knows: this node's own
    /// read, a claim made in turn, or two that agree.
    pub(super) fn vouched(&self, chunk: u32) -> Vouched {
        if let Some(truth) = self.verified[chunk as usize] {
            return Vouched::For(truth);
        }
        let mut found = None;
        let mut claimants = 0;
        let mut in_turn = false;
        for claim in self.origin_claims(chunk) {
            match found {
                Some(hash) if hash != claim.hash => return Vouched::Disputed,
                _ => found = Some(claim.hash),
            }
            claimants += 1;
            in_turn |= claim.in_turn;
        }
        // One member's word is taken where it was its turn; anyone else's alone could be a
        // liar's that got in first, and the chunk is read from the origin in turn.
        match found {
            Some(hash) if in_turn || claimants >= 2 => Vouched::For(hash),
            _ => self.endorsed(chunk),
        }
    }

    /// The hash that two live members hold a chunk with, where no two hold it with another:
    /// each took it only on a word it could check, so one of them is honest and right (a
    /// newcomer to members that hold everything takes their chunks this way, not knowing
    /// whose turn each was when it was read).
    pub(super) fn endorsed(&self, chunk: u32) -> Vouched {
        let mut endorsed = None;
        let mut counts: Vec<([u8; 32], u32)> = Vec::new();
        for p in self.peers.values().filter(|p| p.live() && !p.banned) {
            let Some(claim) = p.have.get(&chunk) else {
                continue;
            };
            match counts.iter_mut().find(|(hash, _)| *hash == claim.hash) {
                Some((_, count)) => {
                    *count += 1;
                    if *count == 2 {
                        if endorsed.is_some() {
                            // Two hashes with two members each: not one liar's doing.
                            return Vouched::Disputed;
                        }
                        endorsed = Some(claim.hash);
                    }
                }
                None => counts.push((claim.hash, 1)),
            }
        }
        // Members that took a hash on the word of a member this node found out hold it in
        // good faith: it is still a lie.
        let a_liars_word = |hash: &[u8; 32]| {
            self.peers
                .values()
                .any(|p| p.liar && p.vouched.get(&chunk).is_some_and(|c| c.hash == *hash))
        };
        endorsed
            .filter(|hash| !a_liars_word(hash))
            .map_or(Vouched::Nobody, Vouched::Endorsed)
    }

    /// What members (live or gone) that said they read `chunk` from the origin announced,
    /// but for those the origin contradicted.
    pub(super) fn origin_claims(&self, chunk: u32) -> impl Iterator<Item = &Claim> {
        self.peers
            .values()
            .filter(|p| !p.liar)
            .filter_map(move |p| p.vouched.get(&chunk))
    }

    /// The members that vouch for `hash` as chunk `chunk`'s.
    pub(super) fn vouchers_of(&self, chunk: u32, hash: [u8; 32]) -> Vec<PeerId> {
        self.peers
            .iter()
            .filter(|(_, p)| !p.liar && p.vouched.get(&chunk).is_some_and(|c| c.hash == hash))
            .map(|(id, _)| *id)
            .collect()
    }

    /// `peer` says it read `chunk` from the origin and it hashes to `hash`: checked against
    /// what this node knows of the origin, or, where it holds the chunk on other members'
    /// word, against the origin itself.
    pub(super) fn check_claim(&mut self, peer: PeerId, chunk: u32, hash: [u8; 32]) {
        match self.verified[chunk as usize] {
            Some(truth) if truth != hash => self.convict(peer, chunk),
            Some(_) => {}
            None => {
                if self.held_hash(chunk).is_some_and(|held| held != hash) {
                    self.to_sample.insert(chunk);
                }
            }
        }
    }
}
