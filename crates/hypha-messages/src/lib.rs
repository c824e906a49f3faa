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
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Request {
    /// Is the node up, and what is it? Every node kind answers.
    Health,
    /// The manifest of a dataset the node serves (data nodes).
    Manifest { dataset: String },
}

/// Every response a node can send.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Response {
    Health(health::Status),
    Manifest(hypha_dataset::Manifest),
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
    }
}

pub mod market {
    //! The resource market: schedulers advertise work on gossipsub topic [`WORKER_TOPIC`],
    //! workers answer with offers over request-response, schedulers accept and renew leases.
    //!
    //! Every message carries the market protocol version ([`MARKET_VERSION`]); a node ignores
    //! advertisements of a version it does not speak.

    use serde::{Deserialize, Serialize};

    /// The gossipsub topic task advertisements travel on.
    pub const WORKER_TOPIC: &str = "hypha/worker";
    /// The version of the market messages below.
    pub const MARKET_VERSION: u16 = 1;

    /// Resources in the seed's units: CPU cores, memory, storage and GPU memory in GB.
    #[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
    pub struct Resources {
        pub cpu: f64,
        pub memory: f64,
        pub storage: f64,
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
        /// Identifies the temporary lease held for this offer.
        pub lease: String,
        pub price: f64,
        /// What the worker reserves: the request (flexible) or everything it has (whole).
        pub resources: Resources,
        /// Unix time (ms) until which the worker holds the resources for this offer.
        pub expires_ms: u64,
    }
}
