//! Reservations of a worker's resources.
//!
//! Every offer holds a **temporary** lease until the offer expires, so resources promised to one
//! scheduler are never promised to another. A scheduler that accepts turns it into a
//! **renewable** lease, which lapses unless renewed. Time is a monotonic [`Instant`] passed in
//! by the caller; [`LeaseManager::expire`] returns the leases whose time is up so the caller can
//! cancel their jobs. Expiry needs no message from anyone: a scheduler that vanishes simply
//! stops renewing.

use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

use crate::resources::{Resources, fits, minus, plus};

/// Identifies a lease. Drawn at random, never 0 and never reused by this worker: an id names
/// one lease across restarts of the worker and of its schedulers, so that a scheduler that
/// remembers a lease from before a restart can never renew, or be cancelled by, another one
/// that happens to carry the same number.
pub type LeaseId = u64;

/// What a lease is at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Held for an open offer.
    Temporary,
    /// Accepted; kept alive by renewals.
    Renewable,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Lease {
    pub id: LeaseId,
    pub resources: Resources,
    pub stage: Stage,
    pub expires: Instant,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum LeaseError {
    #[error("not enough unleased resources")]
    Insufficient,
    #[error("no such lease (it expired or was released)")]
    Unknown,
}

/// The leases of one worker.
#[derive(Debug)]
pub struct LeaseManager {
    capacity: Resources,
    leases: HashMap<LeaseId, Lease>,
}

impl LeaseManager {
    pub fn new(capacity: Resources) -> Self {
        LeaseManager {
            capacity,
            leases: HashMap::new(),
        }
    }

    /// What no live lease holds at `now` (leases past their time no longer count, even before
    /// [`expire`](Self::expire) collects them).
    pub fn available(&self, now: Instant) -> Resources {
        self.leases
            .values()
            .filter(|l| l.expires > now)
            .fold(self.capacity, |left, l| minus(left, l.resources))
    }

    /// Reserves `resources` for an offer until `now + hold`.
    pub fn reserve(
        &mut self,
        resources: Resources,
        hold: Duration,
        now: Instant,
    ) -> Result<LeaseId, LeaseError> {
        if !fits(resources, self.available(now)) {
            return Err(LeaseError::Insufficient);
        }
        let id = loop {
            let id = rand::random::<LeaseId>();
            if id != 0 && !self.leases.contains_key(&id) {
                break id;
            }
        };
        self.leases.insert(
            id,
            Lease {
                id,
                resources,
                stage: Stage::Temporary,
                expires: now + hold,
            },
        );
        Ok(id)
    }

    /// Turns an offer's temporary lease into a renewable one lasting `period`.
    pub fn accept(
        &mut self,
        id: LeaseId,
        period: Duration,
        now: Instant,
    ) -> Result<Instant, LeaseError> {
        let lease = self.live(id, now)?;
        lease.stage = Stage::Renewable;
        lease.expires = now + period;
        Ok(lease.expires)
    }

    /// Extends a renewable lease to `now + period`.
    pub fn renew(
        &mut self,
        id: LeaseId,
        period: Duration,
        now: Instant,
    ) -> Result<Instant, LeaseError> {
        let lease = self.live(id, now)?;
        if lease.stage != Stage::Renewable {
            return Err(LeaseError::Unknown);
        }
        lease.expires = now + period;
        Ok(lease.expires)
    }

    fn live(&mut self, id: LeaseId, now: Instant) -> Result<&mut Lease, LeaseError> {
        match self.leases.get_mut(&id) {
            Some(lease) if lease.expires > now => Ok(lease),
            _ => Err(LeaseError::Unknown),
        }
    }

    /// Whether `id` is a live, accepted lease at `now`.
    pub fn is_accepted(&self, id: LeaseId, now: Instant) -> bool {
        self.leases
            .get(&id)
            .is_some_and(|l| l.stage == Stage::Renewable && l.expires > now)
    }

    /// Ends a lease early (its job finished, its offer was declined).
    pub fn release(&mut self, id: LeaseId) -> Option<Lease> {
        self.leases.remove(&id)
    }

    /// Removes and returns every lease whose time is up at `now`.
    pub fn expire(&mut self, now: Instant) -> Vec<Lease> {
        let expired: Vec<LeaseId> = self
            .leases
            .values()
            .filter(|l| l.expires <= now)
            .map(|l| l.id)
            .collect();
        expired
            .into_iter()
            .filter_map(|id| self.leases.remove(&id))
            .collect()
    }

    /// When the next lease runs out.
    pub fn next_expiry(&self) -> Option<Instant> {
        self.leases.values().map(|l| l.expires).min()
    }

    /// What the live leases hold in total.
    pub fn leased(&self, now: Instant) -> Resources {
        self.leases
            .values()
            .filter(|l| l.expires > now)
            .fold(Resources::default(), |sum, l| plus(sum, l.resources))
    }
}
