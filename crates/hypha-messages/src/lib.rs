//! The messages Hypha nodes exchange over request-response.
//!
//! Every request travels in an [`Envelope`] that carries the sender's trace context, so a span
//! started on one node continues on the next. Bodies are enums so that one protocol
//! (`/hypha/rpc/1.0.0`, CBOR-encoded, size-capped) carries every control exchange; a node that
//! does not handle a request kind answers [`Response::Error`] with [`ErrorCode::Unsupported`].
//!
//! The protocol version is part of the protocol name: an incompatible change gets a new name,
//! so old and new nodes never misread each other.
//!
//! This crate knows the shapes of messages and nothing about transports or handlers.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Now, in milliseconds since the Unix epoch: the clock of every absolute time a message,
/// an event or a record carries (advertisement deadlines, task peer versions, metrics lines).
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The request-response protocol every control message travels on.
pub const RPC_PROTOCOL: &str = "/hypha/rpc/1.0.0";

/// W3C trace context (`traceparent`, `tracestate`) carried across nodes.
pub type TraceContext = BTreeMap<String, String>;

/// A message with the trace context of the span that sent it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Envelope<T> {
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub trace: TraceContext,
    pub body: T,
}

impl<T> Envelope<T> {
    pub fn new(body: T, trace: TraceContext) -> Self {
        Envelope { trace, body }
    }
}

/// Every request a node can receive.
///
/// Exhaustive on purpose: the network's role check (`hypha_network::required_role`) matches
/// every kind, so a kind added here does not compile until it has a role decided.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Request {
    /// Is the node up, and what is it? Every node kind answers.
    Health,
    /// The manifest of a dataset the node serves (data nodes).
    Manifest { dataset: String },
    /// A worker offers to take an advertised task (worker → scheduler; answered `Ack`).
    Offer(market::Offer),
    /// A scheduler accepts an offer, renews or releases a lease (scheduler → worker; answered
    /// `Lease` or `Ack`).
    Lease(market::LeaseRequest),
    /// A scheduler starts a job under a lease it holds (scheduler → worker; answered `Ack`).
    Dispatch(job::JobSpec),
    /// A scheduler stops a job it dispatched (scheduler → worker; answered `Ack`).
    Cancel { job: String },
    /// The workers that now run the jobs of `task`: with the job's scheduler, the only peers
    /// whose transfers reach the task's jobs on the receiving worker (scheduler → worker,
    /// whenever they change; answered `Ack`).
    TaskPeers { task: String, peers: job::TaskPeers },
    /// A worker reports what became of a job (worker → scheduler; answered `Ack`).
    JobStatus(job::StatusReport),
    /// An executor's status through the job bridge's `/status/send`, forwarded to the job's
    /// scheduler, whose answer goes back to the executor (worker → scheduler; answered
    /// `ExecutorStatus`). Both payloads are JSON documents.
    ExecutorStatus { job: String, payload: String },
    /// Reports on slices and asks for more, from an iteration's ledger (worker → scheduler
    /// with `cluster_sync = true`, client → data node with `cluster_sync = false`; answered
    /// `Iterate`).
    Iterate(iterate::IterateRequest),
    /// Where an iteration stands (anyone → the ledger's node; answered `Progress`).
    Progress { iteration: String },
    /// The asker's public IPs, as gateways observe them: a peer behind the same NAT answers
    /// with the private addresses it listens on, anyone else with none (any peer → any peer,
    /// over a relayed connection; answered `Neighbour`). Private addresses are told only this
    /// way, never announced.
    Neighbour { public_ips: Vec<String> },
}

impl Request {
    /// The request's kind, for logs and spans: a request's body can hold a job's secrets
    /// and is never recorded whole.
    pub fn kind(&self) -> &'static str {
        match self {
            Request::Health => "health",
            Request::Manifest { .. } => "manifest",
            Request::Offer(_) => "offer",
            Request::Lease(_) => "lease",
            Request::Dispatch(_) => "dispatch",
            Request::Cancel { .. } => "cancel",
            Request::TaskPeers { .. } => "task_peers",
            Request::JobStatus(_) => "job_status",
            Request::ExecutorStatus { .. } => "executor_status",
            Request::Iterate(_) => "iterate",
            Request::Progress { .. } => "progress",
            Request::Neighbour { .. } => "neighbour",
        }
    }
}

/// Every response a node can send.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Response {
    Health(Box<health::Status>),
    Manifest(hypha_dataset::Manifest),
    /// The request was taken; nothing more to say.
    Ack,
    Lease(market::LeaseGrant),
    ExecutorStatus {
        payload: String,
    },
    Iterate(iterate::IterateGrant),
    Progress(iterate::IterationProgress),
    /// The private addresses a peer behind the asker's NAT listens on (empty from others).
    Neighbour {
        addresses: Vec<String>,
    },
    Error(Error),
}

/// A request that could not be served.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{code:?}: {message}")]
pub struct Error {
    pub code: ErrorCode,
    pub message: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum ErrorCode {
    /// The node does not serve this kind of request.
    Unsupported,
    /// The node is overloaded; try again later.
    Busy,
    /// The request was malformed or named something that does not exist.
    BadRequest,
    /// The node failed while serving the request.
    Internal,
    /// What the request names existed once and is gone (an expired lease, a finished job), or
    /// belongs to someone else.
    Gone,
    /// The sender may not ask this: its certificate lacks the role, or it has no part in
    /// what the request names.
    Forbidden,
}

impl Error {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Error {
            code,
            message: message.into(),
        }
    }
}

pub mod health {
    //! The health check every node answers.

    use serde::{Deserialize, Serialize};

    /// A node's answer to [`Request::Health`](crate::Request::Health).
    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    pub struct Status {
        /// `gateway`, `data`, `worker`, `scheduler`, …
        pub kind: String,
        /// The node's software version.
        pub version: String,
        /// Whether the node considers itself able to do its job.
        pub healthy: bool,
        /// Why not, when it is not; otherwise a short summary.
        pub detail: String,
        pub uptime_secs: u64,
        pub connected_peers: u32,
        /// What the node believes of the NAT it is behind, in words (absent from nodes older
        /// than it).
        #[serde(default)]
        pub nat: String,
        /// How the node reaches its connected peers (at most [`MAX_PATHS`] of them).
        #[serde(default)]
        pub paths: Vec<PeerPath>,
    }

    /// Peers listed in a [`Status`] at most.
    pub const MAX_PATHS: usize = 256;

    /// How a node reaches one peer.
    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    pub struct PeerPath {
        pub peer: String,
        /// `direct`, `hole-punched` or `relayed`.
        pub path: String,
    }
}

pub mod artifact;
pub mod diloco;
pub mod iterate;
pub mod job;
pub mod market;
