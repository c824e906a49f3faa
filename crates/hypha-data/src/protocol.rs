//! The slice protocol, `/hypha/slice/1.0.0`, on `libp2p-stream`.
//!
//! One request per stream, so a slow or broken exchange never affects another:
//!
//! ```text
//! client → server   request:  u32 big-endian length (≤ 4 KiB), then JSON
//!                             {"dataset": "imagenet-1k", "slice": 7, "offset": 0}
//!                             ("file": "slice-0007.safetensors" names it by file instead)
//! server → client   header:   u32 big-endian length (≤ 4 KiB), then JSON, either
//!                             {"ok": {"size": 12345, "blake3": "…", "offset": 0}}
//!                             followed by exactly size − offset bytes of the slice file
//!                             from offset on, or
//!                             {"error": {"code": "unknown_dataset", "message": "…"}}
//!                   then the server closes the stream.
//! ```
//!
//! `size` and `blake3` describe the whole file as the manifest lists it, so a client resuming
//! at `offset` can check the bytes it already holds together with the rest. The file bytes are
//! sent as stored (Snappy-compressed slices stay compressed on the wire).
//!
//! Goals: a malformed or hostile request costs the server one stream and an error frame, never
//! its other clients; a transfer can resume at any offset on any provider. Non-goals: ranges
//! that end before the file does; several slices per stream.

pub use hypha_network::frame::{FrameError, MAX_FRAME, read_frame, write_frame};
use serde::{Deserialize, Serialize};

/// The protocol's name.
pub const PROTOCOL_NAME: &str = "/hypha/slice/1.0.0";
/// The protocol, for opening and accepting streams.
pub const PROTOCOL: hypha_network::StreamProtocol =
    hypha_network::StreamProtocol::new(PROTOCOL_NAME);

/// Asks for one slice from `offset` on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SliceRequest {
    pub dataset: String,
    pub slice: u64,
    /// Names the slice by its file instead of its number: data nodes that each hold part of
    /// a dataset number their slices differently, but a slice's file name is the same on all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file: Option<String>,
    #[serde(default)]
    pub offset: u64,
}

/// The server's answer, sent before any file bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SliceHeader {
    Ok {
        /// The whole file's size.
        size: u64,
        /// The whole file's BLAKE3, hex.
        blake3: String,
        /// Where the bytes that follow start.
        offset: u64,
    },
    Error(ServeError),
}

/// Why a request was refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{code:?}: {message}")]
pub struct ServeError {
    pub code: ErrorCode,
    pub message: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// The request frame was malformed or too large.
    BadRequest,
    UnknownDataset,
    /// `slice` is not below the dataset's slice count.
    SliceOutOfRange,
    /// No slice of the dataset has the requested `file`.
    UnknownSlice,
    /// `offset` is past the end of the slice.
    OffsetOutOfRange,
    /// The server is at its limits; try another provider or later.
    Busy,
    /// The server could not read the slice.
    Unavailable,
}

impl ServeError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ServeError {
            code,
            message: message.into(),
        }
    }
}

/// The DHT key under which providers of `dataset` announce themselves.
pub fn provider_key(dataset: &str) -> Vec<u8> {
    format!("/hypha/dataset/{dataset}").into_bytes()
}
