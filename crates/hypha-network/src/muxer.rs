//! Yamux as a libp2p [`StreamMuxer`], with the frame size under our control.
//!
//! `libp2p-yamux` fixes yamux's split send size at 16 KiB, so every 16 KiB of payload becomes its
//! own frame and, under TLS, two records and a syscall; bulk transfers then stall at a fraction
//! of what TLS can carry. This adapter is the same thin glue as `libp2p-yamux` (MIT-licensed,
//! Parity Technologies) over the same `yamux` crate, but exposes [`yamux::Config`], and
//! [`Config::default`] sends frames of up to [`DEFAULT_SPLIT_SEND_SIZE`].

use std::{
    collections::VecDeque,
    io,
    io::{IoSlice, IoSliceMut},
    iter,
    pin::Pin,
    task::{Context, Poll, Waker},
};

use futures::{AsyncRead, AsyncWrite, future, ready};
use libp2p::core::{
    muxing::{StreamMuxer, StreamMuxerEvent},
    upgrade::{InboundConnectionUpgrade, OutboundConnectionUpgrade, UpgradeInfo},
};

/// Payload bytes per yamux data frame. Large frames amortise framing and TLS record overhead; the
/// cost is head-of-line latency for small messages sharing a connection with a bulk transfer
/// (a 1 MiB frame takes under a millisecond at loopback speeds and ~80 ms at 100 Mbit/s).
pub const DEFAULT_SPLIT_SEND_SIZE: usize = 1024 * 1024;

/// How many inbound streams to hold while the node is not accepting them. Matches yamux's ACK
/// backlog, so well-behaved peers stop opening streams before this fills; past it, new inbound
/// streams are dropped (reset).
const MAX_BUFFERED_INBOUND_STREAMS: usize = 256;

/// The muxer upgrade.
#[derive(Debug, Clone)]
pub struct Config(yamux::Config);

impl Default for Config {
    fn default() -> Self {
        let mut config = yamux::Config::default();
        config.set_split_send_size(DEFAULT_SPLIT_SEND_SIZE);
        Config(config)
    }
}

impl Config {
    /// Sets the payload size of data frames (see [`DEFAULT_SPLIT_SEND_SIZE`]).
    pub fn set_split_send_size(&mut self, bytes: usize) -> &mut Self {
        self.0.set_split_send_size(bytes);
        self
    }
}

impl UpgradeInfo for Config {
    type Info = &'static str;
    type InfoIter = iter::Once<Self::Info>;

    fn protocol_info(&self) -> Self::InfoIter {
        iter::once("/yamux/1.0.0")
    }
}

impl<C> InboundConnectionUpgrade<C> for Config
where
    C: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    type Output = Muxer<C>;
    type Error = io::Error;
    type Future = future::Ready<Result<Self::Output, Self::Error>>;

    fn upgrade_inbound(self, io: C, _: Self::Info) -> Self::Future {
        future::ready(Ok(Muxer::new(yamux::Connection::new(
            io,
            self.0,
            yamux::Mode::Server,
        ))))
    }
}

impl<C> OutboundConnectionUpgrade<C> for Config
where
    C: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    type Output = Muxer<C>;
    type Error = io::Error;
    type Future = future::Ready<Result<Self::Output, Self::Error>>;

    fn upgrade_outbound(self, io: C, _: Self::Info) -> Self::Future {
        future::ready(Ok(Muxer::new(yamux::Connection::new(
            io,
            self.0,
            yamux::Mode::Client,
        ))))
    }
}

/// A yamux connection.
#[derive(Debug)]
pub struct Muxer<C> {
    connection: yamux::Connection<C>,
    /// Inbound streams that arrived while [`StreamMuxer::poll`] drove the connection; yamux only
    /// makes progress through `poll_next_inbound`, so they must be held until asked for.
    inbound: VecDeque<Stream>,
    inbound_waker: Option<Waker>,
}

impl<C> Muxer<C> {
    fn new(connection: yamux::Connection<C>) -> Self {
        Muxer {
            connection,
            inbound: VecDeque::new(),
            inbound_waker: None,
        }
    }
}

impl<C> Muxer<C>
where
    C: AsyncRead + AsyncWrite + Unpin + 'static,
{
    fn poll_next_inbound(&mut self, cx: &mut Context<'_>) -> Poll<Result<Stream, Error>> {
        let stream = ready!(self.connection.poll_next_inbound(cx))
            .ok_or(Error(yamux::ConnectionError::Closed))?
            .map_err(Error)?;
        Poll::Ready(Ok(Stream(stream)))
    }
}

impl<C> StreamMuxer for Muxer<C>
where
    C: AsyncRead + AsyncWrite + Unpin + 'static,
{
    type Substream = Stream;
    type Error = Error;

    fn poll_inbound(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Self::Substream, Self::Error>> {
        if let Some(stream) = self.inbound.pop_front() {
            return Poll::Ready(Ok(stream));
        }
        if let Poll::Ready(result) = self.poll_next_inbound(cx) {
            return Poll::Ready(result);
        }
        self.inbound_waker = Some(cx.waker().clone());
        Poll::Pending
    }

    fn poll_outbound(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Self::Substream, Self::Error>> {
        let stream = ready!(self.connection.poll_new_outbound(cx)).map_err(Error)?;
        Poll::Ready(Ok(Stream(stream)))
    }

    fn poll_close(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.connection.poll_close(cx).map_err(Error)
    }

    fn poll(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Result<StreamMuxerEvent, Self::Error>> {
        let this = self.get_mut();
        let stream = ready!(this.poll_next_inbound(cx))?;
        if this.inbound.len() >= MAX_BUFFERED_INBOUND_STREAMS {
            tracing::warn!(stream = %stream.0, "dropping an inbound stream: too many unaccepted streams");
            drop(stream);
        } else {
            this.inbound.push_back(stream);
            if let Some(waker) = this.inbound_waker.take() {
                waker.wake();
            }
        }
        // Let other work run before driving the connection again.
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

/// A stream of a yamux connection.
#[derive(Debug)]
pub struct Stream(yamux::Stream);

impl AsyncRead for Stream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }

    fn poll_read_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &mut [IoSliceMut<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_read_vectored(cx, bufs)
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write_vectored(cx, bufs)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_close(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_close(cx)
    }
}

/// A yamux connection error.
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
pub struct Error(yamux::ConnectionError);

impl From<Error> for io::Error {
    fn from(err: Error) -> Self {
        match err.0 {
            yamux::ConnectionError::Io(e) => e,
            e => io::Error::other(e),
        }
    }
}
