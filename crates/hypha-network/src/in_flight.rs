//! What the application has under way with each peer (requests either way, open streams), and
//! the byte streams that count in it.
//!
//! A relayed connection that a direct one replaced is closed only once nothing is under way
//! with its peer (see [`paths`](crate::paths)), so that no request, answer or transfer is cut
//! because a hole punch succeeded. libp2p spreads a peer's requests and streams over all its
//! connections and names the one a request took only once it is answered, so the count is kept
//! per peer: a peer busy on its direct connection keeps the relayed one a little longer, which
//! costs nothing but the relay's idle connection.

use std::{
    collections::HashMap,
    io,
    pin::Pin,
    sync::{Arc, Mutex, PoisonError},
    task::{Context, Poll},
    time::{Duration, Instant},
};

use futures::{AsyncRead, AsyncWrite, StreamExt as _};
use libp2p::PeerId;

/// How long a peer must have had nothing under way before it counts as quiet: an answer
/// written a moment ago may still be on its way to the peer, and a close now would cut it.
pub(crate) const QUIET_FOR: Duration = Duration::from_secs(1);

/// Per peer, how many requests and streams are under way, and when the last one ended.
/// Shared by the network's handles (streams) and its event loop (requests); every count is an
/// [`Underway`] that lowers it when dropped, so nothing that ends, however it ends, is counted
/// for good.
#[derive(Debug, Clone, Default)]
pub(crate) struct InFlight(Arc<Mutex<Counts>>);

#[derive(Debug, Default)]
struct Counts {
    under_way: HashMap<PeerId, usize>,
    /// When the peer's last request or stream ended; kept [`QUIET_FOR`] (pruned as it grows).
    ended: HashMap<PeerId, Instant>,
}

/// Past this many, entries of `ended` older than [`QUIET_FOR`] are dropped.
const ENDED_KEPT: usize = 256;

impl InFlight {
    /// Counts one more thing under way with `peer`, until the returned value is dropped.
    pub(crate) fn begin(&self, peer: PeerId) -> Underway {
        *self.counts().under_way.entry(peer).or_default() += 1;
        Underway {
            in_flight: self.clone(),
            peer,
        }
    }

    /// Whether nothing has been under way with `peer` for [`QUIET_FOR`] by `now`.
    pub(crate) fn is_quiet(&self, peer: &PeerId, now: Instant) -> bool {
        let counts = self.counts();
        !counts.under_way.contains_key(peer)
            && (counts.ended.get(peer))
                .is_none_or(|ended| now.saturating_duration_since(*ended) >= QUIET_FOR)
    }

    fn counts(&self) -> std::sync::MutexGuard<'_, Counts> {
        // A panic elsewhere while the lock was held cannot leave a count half-written.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// One request or stream under way with a peer; see [`InFlight::begin`].
#[derive(Debug)]
pub(crate) struct Underway {
    in_flight: InFlight,
    peer: PeerId,
}

impl Drop for Underway {
    fn drop(&mut self) {
        let mut counts = self.in_flight.counts();
        let Some(count) = counts.under_way.get_mut(&self.peer) else {
            return;
        };
        *count -= 1;
        if *count == 0 {
            counts.under_way.remove(&self.peer);
            let now = Instant::now();
            if counts.ended.len() >= ENDED_KEPT {
                counts
                    .ended
                    .retain(|_, ended| now.saturating_duration_since(*ended) < QUIET_FOR);
            }
            counts.ended.insert(self.peer, now);
        }
    }
}

/// A raw byte stream to a peer, for bulk transfers. While it is open, a relayed connection to
/// the peer that a direct one replaced stays open, since the stream may run over it.
#[derive(Debug)]
pub struct Stream {
    inner: libp2p::Stream,
    underway: Option<Underway>,
}

impl Stream {
    pub(crate) fn new(inner: libp2p::Stream, underway: Underway) -> Self {
        Stream {
            inner,
            underway: Some(underway),
        }
    }

    /// Marks a stream that stays open for as long as two peers work together (the artifact
    /// swarm's messages), rather than for one transfer: it does not hold a replaced relayed
    /// connection open, and its owner opens it again if the relay's close cuts it.
    pub fn set_long_lived(&mut self) {
        self.underway = None;
    }
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }

    fn poll_read_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &mut [io::IoSliceMut<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_read_vectored(cx, bufs)
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_close(cx)
    }
}

/// The inbound streams of one protocol, each with the peer that opened it.
pub struct IncomingStreams {
    inner: libp2p_stream::IncomingStreams,
    in_flight: InFlight,
}

impl IncomingStreams {
    pub(crate) fn new(inner: libp2p_stream::IncomingStreams, in_flight: InFlight) -> Self {
        IncomingStreams { inner, in_flight }
    }
}

impl std::fmt::Debug for IncomingStreams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("IncomingStreams")
    }
}

impl futures::Stream for IncomingStreams {
    type Item = (PeerId, Stream);

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        this.inner.poll_next_unpin(cx).map(|next| {
            next.map(|(peer, stream)| (peer, Stream::new(stream, this.in_flight.begin(peer))))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_is_quiet_a_while_after_everything_under_way_with_it_ended() {
        let in_flight = InFlight::default();
        let (peer, other) = (PeerId::random(), PeerId::random());
        let now = Instant::now;
        assert!(in_flight.is_quiet(&peer, now()));
        let request = in_flight.begin(peer);
        let stream = in_flight.begin(peer);
        let elsewhere = in_flight.begin(other);
        assert!(!in_flight.is_quiet(&peer, now()));
        drop(request);
        assert!(!in_flight.is_quiet(&peer, now() + QUIET_FOR * 2));
        drop(stream);
        assert!(
            !in_flight.is_quiet(&peer, now()),
            "an answer may be on its way"
        );
        assert!(in_flight.is_quiet(&peer, now() + QUIET_FOR));
        assert!(!in_flight.is_quiet(&other, now() + QUIET_FOR));
        drop(elsewhere);
        assert!(in_flight.is_quiet(&other, now() + QUIET_FOR));
    }
}
