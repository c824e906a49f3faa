//! The two `libp2p-stream` protocols of an artifact swarm.
//!
//! ```text
//! /hypha/artifact/swarm/2.0.0   one long-lived stream per direction and peer pair
//!   sender → receiver   frames (u32 big-endian length ≤ 4 KiB, then JSON), first
//!                       {"hello": {"artifact": "<64 hex>"}}, answered by one frame,
//!                       "welcome" (a member the receiver admits) or "not_member"; after
//!                       a welcome any of
//!                       {"have": {"chunk": 7, "blake3": "<64 hex>", "from_origin": true}}
//!                                                   holds and verified; from_origin: read
//!                                                   from the origin by the sender itself
//!                       {"pulling": {"chunk": 9}}   fetching from the origin
//!                       {"released": {"chunk": 9}}  gave that fetch up
//!                       {"dropped": {"chunk": 7}}   no longer holds it (it was vouched
//!                                                   for by a member the origin contradicted)
//!                       {"load": {"uploads": 3}}    chunks it is sending
//!                       "done"                      holds every chunk
//!   After the welcome the sender first says everything it holds and reads, then one
//!   `load`: until then the receiver does not start reading (see [`crate::swarm`]).
//!   The stream's end means the sender left the swarm.
//!
//! /hypha/artifact/chunk/2.0.0   one chunk per stream
//!   client → server     {"artifact": "<64 hex>", "chunk": 7}
//!   server → client     {"ok": {"size": 16777216}} and exactly size bytes, or
//!                       {"error": {"code": "busy", "message": "…"}}; then the server closes.
//! ```
//!
//! 2.0.0 added `from_origin` and `dropped` (hashes are trusted only as far as the origin
//! vouches for them, see [`crate::swarm`]) and the `not_admitted` refusal.
//!
//! Goals: no coordinator (every node decides from what its peers announced), a malformed or
//! hostile request costs the server one stream and an error frame, chunks are served only
//! from the files of a manifest the server itself resolved, never from a path a peer names.

use hypha_network::StreamProtocol;
pub use hypha_network::frame::{FrameError, read_frame, write_frame};
use serde::{Deserialize, Serialize};

use crate::manifest::ArtifactId;

pub const SWARM_PROTOCOL: StreamProtocol = StreamProtocol::new("/hypha/artifact/swarm/2.0.0");
pub const CHUNK_PROTOCOL: StreamProtocol = StreamProtocol::new("/hypha/artifact/chunk/2.0.0");

/// The DHT key under which the members of an artifact's swarm announce themselves.
pub fn provider_key(id: ArtifactId) -> Vec<u8> {
    format!("/hypha/artifact/{}", id.to_hex()).into_bytes()
}

/// A frame of the swarm stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SwarmMessage {
    Hello {
        artifact: ArtifactId,
    },
    Have {
        chunk: u32,
        #[serde(with = "hex::serde")]
        blake3: [u8; 32],
        /// The sender read these bytes from the origin itself (rather than from a peer):
        /// it vouches for the hash, and is banned if the origin says otherwise.
        #[serde(default)]
        from_origin: bool,
    },
    Pulling {
        chunk: u32,
    },
    Released {
        chunk: u32,
    },
    Dropped {
        chunk: u32,
    },
    Load {
        uploads: u32,
    },
    Done,
}

/// The answer to a swarm stream's hello.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HelloReply {
    /// The receiver is in the artifact's swarm and reads what follows.
    Welcome,
    /// The receiver is not (or no longer) in that swarm, or none of its jobs or requests for
    /// the artifact admits the sender.
    NotMember,
}

/// Asks for one chunk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChunkRequest {
    pub artifact: ArtifactId,
    pub chunk: u32,
}

/// The server's answer, sent before any chunk bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ChunkHeader {
    Ok {
        size: u64,
    },
    Error {
        code: ChunkErrorCode,
        message: String,
    },
}

/// Why a chunk was not sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ChunkErrorCode {
    /// The server is not in that artifact's swarm.
    UnknownArtifact,
    /// The server does not hold that chunk.
    Missing,
    /// Every upload slot is taken; ask another holder.
    Busy,
    /// No job or request for the artifact on the server admits the client.
    NotAdmitted,
    Malformed,
}
