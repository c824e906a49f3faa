//! The resource market: schedulers advertise work on gossipsub topic [`WORKER_TOPIC`],
//! workers answer with offers over request-response, schedulers accept and renew leases.
//!
//! The exchange, step by step:
//!
//! 1. A scheduler publishes an [`Advertisement`] (gossip; signed, so its author is known).
//! 2. A worker that wants the task holds the resources under a temporary lease and sends an
//!    [`Offer`] to the advertisement's author (`Request::Offer`, answered `Ack`).
//! 3. The scheduler accepts the offers it chooses ([`LeaseRequest::Accept`], answered with a
//!    [`LeaseGrant`]) and releases the others ([`LeaseRequest::Release`]); an offer nobody
//!    answers lapses by itself.
//! 4. The scheduler renews each lease well before it runs out ([`LeaseRequest::Renew`]). A lease
//!    that is not renewed lapses: the worker stops its job and frees its resources, without
//!    any message, so a scheduler that vanishes never holds a worker for long.
//!
//! Leases belong to the peer the offer went to: a worker refuses lease requests for a lease
//! from any other peer, so competing schedulers can neither take nor release each other's
//! workers. Durations travel as relative milliseconds (clocks differ between machines); the
//! advertisement deadline is absolute Unix time because it must survive gossip delays.
//!
//! Every advertisement and offer carries the market protocol version ([`MARKET_VERSION`]); a
//! node ignores those of a version it does not speak.

use serde::{Deserialize, Serialize};

/// The gossipsub topic task advertisements travel on.
pub const WORKER_TOPIC: &str = "hypha/worker";
/// The version of the market messages below.
pub const MARKET_VERSION: u16 = 1;

/// Resources in the seed's units: CPU cores, memory, storage and GPU memory in GB.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Resources {
    #[serde(default)]
    pub cpu: f64,
    #[serde(default)]
    pub memory: f64,
    #[serde(default)]
    pub storage: f64,
    #[serde(default)]
    pub gpu: f64,
}

/// Which executor a task needs.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ExecutorRef {
    /// `train`, `inference`, `aggregate`, …
    pub class: String,
    /// `diloco-transformer`, `parameter-server`, …
    pub name: String,
}

impl std::fmt::Display for ExecutorRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.class, self.name)
    }
}

/// A scheduler looking for a worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Advertisement {
    pub version: u16,
    /// Unique per advertisement; offers refer to it.
    pub id: String,
    pub resources: Resources,
    pub executor: ExecutorRef,
    /// What the scheduler pays for the resources asked, per lease period.
    pub bid: f64,
    /// Unix time (ms) after which the advertisement is void.
    pub deadline_ms: u64,
}

/// A worker's answer to an advertisement.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Offer {
    pub version: u16,
    pub advertisement: String,
    /// The temporary lease held for this offer; accepting names it.
    pub lease: u64,
    pub price: f64,
    /// What the worker reserves: the request (flexible) or everything it has (whole).
    pub resources: Resources,
    /// How long (ms, from when the worker sent it) the worker holds the resources for this offer.
    pub valid_ms: u64,
}

/// What a scheduler asks about a lease it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum LeaseRequest {
    /// Take the offer that holds this temporary lease.
    Accept { lease: u64 },
    /// Extend an accepted lease by another period.
    Renew { lease: u64 },
    /// Give the lease back (a declined offer, a finished job).
    Release { lease: u64 },
}

/// A lease the worker holds for the scheduler until `expires_in_ms` from its answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseGrant {
    pub lease: u64,
    pub expires_in_ms: u64,
    /// The jobs running under the lease (in answers to renewals): a scheduler that restarted
    /// learns which jobs of its earlier process it can take over. Absent from workers that
    /// predate it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub jobs: Vec<String>,
}

impl Advertisement {
    /// The advertisement as published on [`WORKER_TOPIC`] (JSON, so that it can be read with
    /// any gossipsub tool).
    pub fn to_gossip(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Reads a message from [`WORKER_TOPIC`].
    pub fn from_gossip(data: &[u8]) -> Result<Self, serde_json::Error> {
        serde_json::from_slice(data)
    }
}
