//! Length-prefixed JSON frames, the headers of Hypha's `libp2p-stream` protocols.
//!
//! A frame is a `u32` big-endian length followed by that many bytes of JSON. Lengths above
//! [`MAX_FRAME`] are refused before anything is read or allocated, so a peer cannot make a
//! node buffer more than that for a header.

use futures::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use serde::{Deserialize, Serialize};

/// The largest frame either side accepts.
pub const MAX_FRAME: usize = 4 * 1024;

/// A frame could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("connection: {0}")]
    Io(#[from] std::io::Error),
    #[error("frame of {0} bytes exceeds the {MAX_FRAME}-byte limit")]
    TooLarge(usize),
    #[error("malformed frame: {0}")]
    Malformed(String),
}

/// Writes a length-prefixed JSON frame and flushes it.
pub async fn write_frame<T: Serialize>(
    io: &mut (impl AsyncWrite + Unpin),
    value: &T,
) -> Result<(), FrameError> {
    let json = serde_json::to_vec(value).map_err(|e| FrameError::Malformed(e.to_string()))?;
    if json.len() > MAX_FRAME {
        return Err(FrameError::TooLarge(json.len()));
    }
    let mut frame = Vec::with_capacity(4 + json.len());
    frame.extend_from_slice(&(json.len() as u32).to_be_bytes());
    frame.extend_from_slice(&json);
    io.write_all(&frame).await?;
    io.flush().await?;
    Ok(())
}

/// Reads a length-prefixed JSON frame, refusing lengths above [`MAX_FRAME`] before reading
/// the body.
pub async fn read_frame<T: for<'de> Deserialize<'de>>(
    io: &mut (impl AsyncRead + Unpin),
) -> Result<T, FrameError> {
    let mut length = [0u8; 4];
    io.read_exact(&mut length).await?;
    let length = u32::from_be_bytes(length) as usize;
    if length > MAX_FRAME {
        return Err(FrameError::TooLarge(length));
    }
    let mut body = vec![0u8; length];
    io.read_exact(&mut body).await?;
    serde_json::from_slice(&body).map_err(|e| FrameError::Malformed(e.to_string()))
}
