//! Deciding which advertisements to answer, and with what.
//!
//! The `[offer]` settings of seed 001, made precise:
//!
//! - `floor` is the hard minimum: an advertisement whose `bid` is below it is dropped without an
//!   answer, whatever the strategy.
//! - `strategy = "whole"`: the worker offers **all** its configured resources as one unit, at
//!   `max(bid, price)`. It offers only while nothing else is leased (a whole worker is never
//!   shared). An offer above the bid may be turned down by the scheduler; that is its choice.
//! - `strategy = "flexible"`: the worker mirrors the bid (offer price = bid) for **exactly** the
//!   resources asked, when the bid meets both thresholds: `bid ≥ floor` and
//!   `bid ≥ price × share`, where `share` is the largest fraction of any resource kind the request
//!   takes of the worker's capacity (asking for 4 of 16 cores and 32 of 64 GB is a share of 0.5,
//!   so the bid must reach half the whole-worker price). Requests that do not fit what is still
//!   unleased are dropped.
//!
//! Advertisements are evaluated in batches (the caller buffers them for a short window):
//! those past their deadline, of another market version, for an executor the worker lacks, or
//! failing the thresholds are dropped; the rest are ranked by offer price, highest first (profit
//! first), ties by the earlier deadline, and granted greedily while resources last.

use std::collections::HashSet;

use hypha_messages::market::{Advertisement, ExecutorRef, MARKET_VERSION, Resources};
use serde::Deserialize;

use crate::resources::{fits, minus, share};

/// How resources are bundled into offers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Strategy {
    Whole,
    Flexible,
}

/// The `[offer]` settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pricing {
    /// The ask for the whole worker.
    pub price: f64,
    /// The hard minimum bid.
    pub floor: f64,
    pub strategy: Strategy,
}

/// Why an advertisement gets no offer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dropped {
    PastDeadline,
    OtherVersion,
    UnknownExecutor,
    BelowFloor,
    BelowPrice,
    Insufficient,
}

impl Dropped {
    /// A short name for logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Dropped::PastDeadline => "past_deadline",
            Dropped::OtherVersion => "other_version",
            Dropped::UnknownExecutor => "unknown_executor",
            Dropped::BelowFloor => "below_floor",
            Dropped::BelowPrice => "below_price",
            Dropped::Insufficient => "insufficient",
        }
    }
}

/// What to offer for an advertisement.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Quote {
    pub price: f64,
    pub resources: Resources,
}

/// Evaluates advertisements for one worker.
#[derive(Debug, Clone)]
pub struct Arbiter {
    pricing: Pricing,
    capacity: Resources,
    executors: HashSet<ExecutorRef>,
}

impl Arbiter {
    pub fn new(
        pricing: Pricing,
        capacity: Resources,
        executors: impl IntoIterator<Item = ExecutorRef>,
    ) -> Self {
        Arbiter {
            pricing,
            capacity,
            executors: executors.into_iter().collect(),
        }
    }

    /// The offer for one advertisement, given what is unleased (`available`) at `now_ms`.
    pub fn quote(
        &self,
        ad: &Advertisement,
        available: Resources,
        now_ms: u64,
    ) -> Result<Quote, Dropped> {
        if ad.version != MARKET_VERSION {
            return Err(Dropped::OtherVersion);
        }
        if ad.deadline_ms <= now_ms {
            return Err(Dropped::PastDeadline);
        }
        if !self.executors.contains(&ad.executor) {
            return Err(Dropped::UnknownExecutor);
        }
        if !ad.bid.is_finite() || ad.bid < self.pricing.floor {
            return Err(Dropped::BelowFloor);
        }
        if !fits(ad.resources, self.capacity) {
            return Err(Dropped::Insufficient);
        }
        match self.pricing.strategy {
            Strategy::Whole => {
                if !fits(self.capacity, available) {
                    return Err(Dropped::Insufficient);
                }
                Ok(Quote {
                    price: ad.bid.max(self.pricing.price),
                    resources: self.capacity,
                })
            }
            Strategy::Flexible => {
                if !fits(ad.resources, available) {
                    return Err(Dropped::Insufficient);
                }
                if ad.bid < self.pricing.price * share(ad.resources, self.capacity) {
                    return Err(Dropped::BelowPrice);
                }
                Ok(Quote {
                    price: ad.bid,
                    resources: ad.resources,
                })
            }
        }
    }

    /// Evaluates a batch: ranks the acceptable advertisements by offer price (then deadline)
    /// and grants them greedily while `available` lasts. Returns the offers to make, in rank
    /// order.
    pub fn select(
        &self,
        batch: &[Advertisement],
        available: Resources,
        now_ms: u64,
    ) -> Vec<(Advertisement, Quote)> {
        let mut candidates: Vec<(Advertisement, Quote)> = batch
            .iter()
            .filter_map(|ad| {
                self.quote(ad, available, now_ms)
                    .ok()
                    .map(|q| (ad.clone(), q))
            })
            .collect();
        candidates.sort_by(|(a, qa), (b, qb)| {
            qb.price
                .total_cmp(&qa.price)
                .then(a.deadline_ms.cmp(&b.deadline_ms))
                .then(a.id.cmp(&b.id))
        });
        let mut left = available;
        let mut granted = Vec::new();
        for (ad, quote) in candidates {
            if fits(quote.resources, left) {
                left = minus(left, quote.resources);
                granted.push((ad, quote));
            }
        }
        granted
    }
}
