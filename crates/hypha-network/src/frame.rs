//! Length-prefixed JSON frames, the headers of Hypha's `libp2p-stream` protocols.
//!
//! A frame is a `u32` big-endian length followed by that many bytes of JSON. Lengths above
//! [`MAX_FRAME`] are refused before anything is read or allocated, so a peer cannot make a
//! node buffer more than that for a header.

use std::time::Duration;

use futures::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use libp2p::{PeerId, StreamProtocol};
use serde::{Deserialize, Serialize, de::DeserializeOwned};

use crate::{IncomingStreams, Network, NetworkError, Stream};

/// Tries of [`ask`] whose stream was dropped before the answer, in all.
pub const ASK_ATTEMPTS: u32 = 5;
/// The pause after [`ask`]'s first dropped try; it doubles after each (5 tries over about
/// 0.15 s).
pub const ASK_PAUSE: Duration = Duration::from_millis(10);

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
    Malformed(#[from] serde_json::Error),
}

/// Writes a length-prefixed JSON frame and flushes it.
pub async fn write_frame<T: Serialize>(
    io: &mut (impl AsyncWrite + Unpin),
    value: &T,
) -> Result<(), FrameError> {
    let json = serde_json::to_vec(value)?;
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
    Ok(serde_json::from_slice(&body)?)
}

/// Why [`ask`] got no answer.
#[derive(Debug, thiserror::Error)]
pub enum AskError {
    /// No stream could be opened: the peer cannot be reached or does not speak the protocol.
    #[error("{0}")]
    Open(#[from] NetworkError),
    /// Every try's stream broke off before the answer.
    #[error("the stream broke off before an answer, {ASK_ATTEMPTS} times: {0}")]
    Dropped(FrameError),
    /// A try's answer did not come within its deadline.
    #[error("no answer within {0:?}")]
    Silent(Duration),
}

/// Asks `peer` over a fresh stream of `protocol`: writes `request` and reads the first frame
/// of the answer, each try within `deadline`; the stream is handed back for what follows.
///
/// `libp2p-stream` hands inbound streams to their acceptor through a one-slot queue and
/// drops those that arrive while it is occupied, which a busy peer's many clients make
/// likely: the stream opens, then breaks off before any answer. A try that breaks off so is
/// made again after [`ASK_PAUSE`] (doubled each time), [`ASK_ATTEMPTS`] tries in all: far
/// better than counting a busy peer out. A stream that cannot be opened, or an answer that
/// does not come in time, is not tried again here.
pub async fn ask<Q: Serialize, A: DeserializeOwned>(
    network: &Network,
    peer: PeerId,
    protocol: StreamProtocol,
    request: &Q,
    deadline: Duration,
) -> Result<(Stream, A), AskError> {
    let mut pause = ASK_PAUSE;
    let mut attempt = 1;
    loop {
        let mut stream = network.open_stream(peer, protocol.clone()).await?;
        let exchange = async {
            write_frame(&mut stream, request).await?;
            read_frame::<A>(&mut stream).await
        };
        match tokio::time::timeout(deadline, exchange).await {
            Ok(Ok(answer)) => return Ok((stream, answer)),
            Ok(Err(error)) if attempt < ASK_ATTEMPTS => {
                tracing::trace!(%peer, %protocol, attempt, %error, "a request on a fresh stream was not taken; asking again");
                tokio::time::sleep(pause).await;
                pause *= 2;
                attempt += 1;
            }
            Ok(Err(error)) => return Err(AskError::Dropped(error)),
            Err(_) => return Err(AskError::Silent(deadline)),
        }
    }
}

/// Serves each stream `incoming` accepts with `serve`, each in a task of its own that this
/// loop owns: finished ones are reaped as new streams come, and the rest are aborted when the
/// loop ends (`incoming` ends, `serve` answers `None` because what it serves is gone, or the
/// loop's own task is aborted or dropped).
pub async fn serve_each<Serve, Served>(mut incoming: IncomingStreams, mut serve: Serve)
where
    Serve: FnMut(PeerId, Stream) -> Option<Served>,
    Served: std::future::Future<Output = ()> + Send + 'static,
{
    let mut serving = tokio::task::JoinSet::new();
    while let Some((peer, stream)) = futures::StreamExt::next(&mut incoming).await {
        while serving.try_join_next().is_some() {}
        let Some(served) = serve(peer, stream) else {
            return;
        };
        serving.spawn(served);
    }
}
