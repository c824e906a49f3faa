//! The request-response codec: CBOR envelopes with size caps, bytes counted per direction.

use std::{
    io,
    pin::Pin,
    task::{Context, Poll},
};

use futures::{AsyncRead, AsyncWrite};
use hypha_messages::{Envelope, Request, Response};
use hypha_telemetry::metrics::{Direction, record_bytes};
use libp2p::{StreamProtocol, request_response};

/// Largest request accepted; control messages are small.
pub const MAX_REQUEST_BYTES: u64 = 1024 * 1024;
/// Largest response accepted (manifests and listings can be larger than requests).
pub const MAX_RESPONSE_BYTES: u64 = 16 * 1024 * 1024;

type Inner = request_response::cbor::codec::Codec<Envelope<Request>, Envelope<Response>>;

/// CBOR codec for [`hypha_messages`] envelopes that records bytes in and out.
#[derive(Clone)]
pub struct Codec(Inner);

impl std::fmt::Debug for Codec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("rpc::Codec")
    }
}

impl Default for Codec {
    fn default() -> Self {
        Codec(
            Inner::default()
                .set_request_size_maximum(MAX_REQUEST_BYTES)
                .set_response_size_maximum(MAX_RESPONSE_BYTES),
        )
    }
}

impl request_response::Codec for Codec {
    type Protocol = StreamProtocol;
    type Request = Envelope<Request>;
    type Response = Envelope<Response>;

    async fn read_request<T>(&mut self, p: &Self::Protocol, io: &mut T) -> io::Result<Self::Request>
    where
        T: AsyncRead + Unpin + Send,
    {
        let mut io = Counted::new(io, Direction::In);
        self.0.read_request(p, &mut io).await
    }

    async fn read_response<T>(
        &mut self,
        p: &Self::Protocol,
        io: &mut T,
    ) -> io::Result<Self::Response>
    where
        T: AsyncRead + Unpin + Send,
    {
        let mut io = Counted::new(io, Direction::In);
        self.0.read_response(p, &mut io).await
    }

    async fn write_request<T>(
        &mut self,
        p: &Self::Protocol,
        io: &mut T,
        req: Self::Request,
    ) -> io::Result<()>
    where
        T: AsyncWrite + Unpin + Send,
    {
        let mut io = Counted::new(io, Direction::Out);
        self.0.write_request(p, &mut io, req).await
    }

    async fn write_response<T>(
        &mut self,
        p: &Self::Protocol,
        io: &mut T,
        res: Self::Response,
    ) -> io::Result<()>
    where
        T: AsyncWrite + Unpin + Send,
    {
        let mut io = Counted::new(io, Direction::Out);
        self.0.write_response(p, &mut io, res).await
    }
}

/// Counts the bytes that pass through and records them when dropped.
struct Counted<'a, T> {
    io: &'a mut T,
    direction: Direction,
    bytes: u64,
}

impl<'a, T> Counted<'a, T> {
    fn new(io: &'a mut T, direction: Direction) -> Self {
        Counted {
            io,
            direction,
            bytes: 0,
        }
    }
}

impl<T> Drop for Counted<'_, T> {
    fn drop(&mut self) {
        record_bytes(hypha_messages::RPC_PROTOCOL, self.direction, self.bytes);
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Counted<'_, T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut *this.io).poll_read(cx, buf);
        if let Poll::Ready(Ok(n)) = polled {
            this.bytes += n as u64;
        }
        polled
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Counted<'_, T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut *this.io).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = polled {
            this.bytes += n as u64;
        }
        polled
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.get_mut().io).poll_flush(cx)
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.get_mut().io).poll_close(cx)
    }
}
