//! Peer-to-peer artifact distribution: big files (model weights, environments, archives)
//! reach many nodes with each chunk pulled from the origin once.
//!
//! - [`origin`]: named origins through `object_store` (S3 and S3-compatible, GCS, Azure,
//!   HTTP(S), local files), reads pinned to the version an artifact was resolved at.
//! - [`published`]: a file one node publishes, the publisher serving as the origin of its
//!   swarm (a parameter server's model, fetched by its trainers from it and each other).
//! - [`manifest`]: an artifact's files and chunks, and its content-derived [`ArtifactId`].
//! - [`swarm`]: the coordinator-free exchange between the nodes fetching one artifact
//!   ([`protocol`] on `libp2p-stream`): each chunk pulled from the origin by one node, shared
//!   rarest first, every transfer checked against a BLAKE3 the origin vouches for (members
//!   that announce false hashes are found out against the origin and banned).
//! - [`assembly`]: files written in place from chunks, fsynced and renamed atomically.
//! - [`cache`]: completed artifacts reused while the origin still describes them the same way;
//!   partial ones resumed chunk by chunk.
//! - [`contents`]: what a fetch verified, for the copies handed on to be checked against.
//! - [`unpack`]: tar, tar.gz and zip, refusing entries that would escape the destination.
//! - [`Distributor`]: the handle a node uses: fetch, seed, settle.
//!
//! This crate knows nothing of jobs, workers or config files: nodes build [`Settings`] and
//! [`Origins`] and hand in their [`Network`](hypha_network::Network).

pub mod assembly;
pub mod cache;
pub mod contents;
mod distributor;
mod error;
pub mod manifest;
pub mod origin;
pub mod protocol;
pub mod published;
pub mod swarm;
pub mod unpack;

use std::time::Duration;

pub use contents::{ContentError, Contents};
pub use distributor::{Admission, Distributor, FetchError, FetchOptions, Fetched};
pub use hypha_messages::artifact::{
    self as request, Kind, Published, Request, Unpack, UnpackMethod,
};
pub use manifest::{ArtifactId, Manifest, auto_chunk_size};
pub use origin::{Origin, OriginError, Origins, Profile};
pub use swarm::{PeerProgress, Progress};

/// How a node takes part in distributions.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Bytes per chunk; `None` (the default): [`auto_chunk_size`], about 256 chunks per
    /// artifact within 1–64 MiB. Nodes share chunks only with nodes using the same size.
    pub chunk_size: Option<u64>,
    /// Chunks this node receives at once, from the origin and from peers together.
    /// Default: 8.
    pub download_slots: usize,
    /// Chunks this node sends at once; further requests are answered `busy`. Default: 8.
    pub upload_slots: usize,
    /// Origin connections of all members of a swarm together: each of n members opens at
    /// most `max(1, origin_connections / n)`. Default: 16, two per node in a swarm of
    /// eight, so that one request's latency hides behind another's transfer. Fewer connections finish chunks
    /// one after another, so peers share early ones while later ones are still coming;
    /// many finish them all together at the end.
    pub origin_connections: usize,
    /// The longest a fetch waits for the members it expects before it pulls from the origin.
    /// Default: 10 s.
    pub join_timeout: Duration,
    /// How often the DHT is asked for the members of a swarm. Default: 500 ms.
    pub discovery_interval: Duration,
    /// How much one archive may unpack to.
    pub unpack_limits: unpack::Limits,
    /// The share of chunks (0–1) this node reads from the origin although peers hold them,
    /// to check the hashes the members that read them announced. Each node picks its own at
    /// random and tells nobody. A member lying about a chunk that was its own to read is
    /// caught with probability `1 - (1 - share)^(n - 1)` in a swarm of n (lies about other
    /// members' chunks are caught by their owners whatever the share); the origin sends about
    /// `1 + share × (n - 1)` times the artifact. 1 reads everything from the origin (no
    /// member's word is taken). Default: 0, each chunk leaves the origin once: set a share
    /// (0.02 costs 2% per other member) where a certified worker of the task may lie.
    pub origin_audit: f64,
    /// How long this node waits, receiving nothing, on a chunk whose holders do not send it
    /// (they answer `busy` or report full loads), or on a member whose turn it is to read
    /// chunks from the origin and that reads nothing, before the next member in turn reads
    /// those chunks from the origin. A certified member that holds chunks back delays the
    /// others by about this much instead of stalling them. Default: 60 s.
    pub stall_patience: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            chunk_size: None,
            download_slots: 8,
            upload_slots: 8,
            origin_connections: 16,
            join_timeout: Duration::from_secs(10),
            discovery_interval: Duration::from_millis(500),
            unpack_limits: unpack::Limits::default(),
            origin_audit: 0.0,
            stall_patience: Duration::from_secs(60),
        }
    }
}
