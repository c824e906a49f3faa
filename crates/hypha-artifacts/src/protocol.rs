//! The two `libp2p-stream` protocols of an artifact swarm.
//!
//! ```text
//! /hypha/artifact/swarm/1.0.0   one long-lived stream per direction and peer pair
//!   sender → receiver   frames (u32 big-endian length ≤ 4 KiB, then JSON), first
//!                       {"hello": {"artifact": "<64 hex>"}}, answered by one frame,
//!                       "welcome" (a member) or "not_member"; after a welcome any of
//!                       {"have": {"chunk": 7, "blake3": "<64 hex>"}}   holds and verified
//!                       {"pulling": {"chunk": 9}}                      fetching from the origin
//!                       {"released": {"chunk": 9}}                     gave that fetch up
//!                       {"load": {"uploads": 3}}                       chunks it is sending
//!                       "done"                                         holds every chunk
//!   The stream's end means the sender left the swarm.
//!
//! /hypha/artifact/chunk/1.0.0   one chunk per stream
//!   client → server     {"artifact": "<64 hex>", "chunk": 7}
//!   server → client     {"ok": {"size": 16777216}} and exactly size bytes, or
//!                       {"error": {"code": "busy", "message": "…"}}; then the server closes.
//! ```
//!
//! Goals: no coordinator (every node decides from what its peers announced), a malformed or
//! hostile request costs the server one stream and an error frame, chunks are served only
//! from the files of a manifest the server itself resolved, never from a path a peer names.

use hypha_network::StreamProtocol;
pub use hypha_network::frame::{FrameError, read_frame, write_frame};
use serde::{Deserialize, Serialize};

use crate::manifest::ArtifactId;

pub const SWARM_PROTOCOL: StreamProtocol = StreamProtocol::new("/hypha/artifact/swarm/1.0.0");
pub const CHUNK_PROTOCOL: StreamProtocol = StreamProtocol::new("/hypha/artifact/chunk/1.0.0");

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
    },
    Pulling {
        chunk: u32,
    },
    Released {
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
    /// The receiver is not (or no longer) in that swarm.
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
    Malformed,
}
