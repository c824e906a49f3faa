//! A peer's share of a gateway's link: each TCP connection's bytes per second, each way.
//!
//! A gateway relays for every peer that cannot reach another directly. Without a bound, one
//! relayed peer (a trainer behind a symmetric NAT sending its updates, a peer that streams
//! on purpose) takes the gateway's whole link, and every other relayed pair and the gateway's
//! own work (gossip, the DHT, reservations) wait behind it. Each peer holds one connection to
//! the gateway, and everything relayed for it crosses that connection: a token bucket on each
//! connection's reads and writes bounds what any one peer can put through the relay, whatever
//! its number of circuits, and TCP's flow control slows its sender to that pace.

use std::{
    io::IoSlice,
    pin::Pin,
    task::{Context, Poll, ready},
    time::Duration,
};

use futures::{AsyncRead, AsyncWrite};
use tokio::time::{Instant, Sleep};

/// A stream whose reads and writes each pass at most `rate` bytes a second (`None`: no
/// bound), after a burst of a tenth of a second's worth.
#[derive(Debug)]
pub struct Throttled<S> {
    inner: S,
    read: Bucket,
    write: Bucket,
}

impl<S> Throttled<S> {
    pub fn new(inner: S, rate: Option<u64>) -> Self {
        Throttled {
            inner,
            read: Bucket::new(rate),
            write: Bucket::new(rate),
        }
    }
}

/// The smallest burst: one large read of a TLS record's worth at any rate.
const MIN_BURST: f64 = 64.0 * 1024.0;

#[derive(Debug)]
struct Bucket {
    /// Bytes a second; `None`: every byte passes at once.
    rate: Option<f64>,
    tokens: f64,
    burst: f64,
    refilled: Instant,
    wait: Option<Pin<Box<Sleep>>>,
}

impl Bucket {
    fn new(rate: Option<u64>) -> Self {
        let rate = rate.map(|r| r.max(1) as f64);
        let burst = rate.map_or(0.0, |r| (r / 10.0).max(MIN_BURST));
        Bucket {
            rate,
            tokens: burst,
            burst,
            refilled: Instant::now(),
            wait: None,
        }
    }

    /// How many of `want` bytes may pass now; pending (woken when some may) while none.
    fn poll_allowance(&mut self, cx: &mut Context<'_>, want: usize) -> Poll<usize> {
        let Some(rate) = self.rate else {
            return Poll::Ready(want);
        };
        loop {
            let now = Instant::now();
            let elapsed = now.duration_since(self.refilled).as_secs_f64();
            self.tokens = (self.tokens + elapsed * rate).min(self.burst);
            self.refilled = now;
            if self.tokens >= 1.0 {
                self.wait = None;
                // Tokens are at most the burst, a few MB: the cast does not truncate.
                return Poll::Ready(want.min(self.tokens as usize).max(1));
            }
            let until = now + Duration::from_secs_f64((1.0 - self.tokens) / rate);
            let wait = self
                .wait
                .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(until)));
            wait.as_mut().reset(until);
            ready!(wait.as_mut().poll(cx));
        }
    }

    fn spend(&mut self, bytes: usize) {
        if self.rate.is_some() {
            self.tokens -= bytes as f64;
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Throttled<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = &mut *self;
        let allowed = ready!(this.read.poll_allowance(cx, buf.len()));
        let read = ready!(Pin::new(&mut this.inner).poll_read(cx, &mut buf[..allowed]));
        if let Ok(bytes) = &read {
            this.read.spend(*bytes);
        }
        Poll::Ready(read)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Throttled<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = &mut *self;
        let allowed = ready!(this.write.poll_allowance(cx, buf.len()));
        let written = ready!(Pin::new(&mut this.inner).poll_write(cx, &buf[..allowed]));
        if let Ok(bytes) = &written {
            this.write.spend(*bytes);
        }
        Poll::Ready(written)
    }

    /// TLS hands its records over as many buffers at once: forwarding them whole keeps one
    /// system call per batch instead of one per record (the default writes only the first).
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let this = &mut *self;
        let want = bufs.iter().map(|b| b.len()).sum();
        let allowed = ready!(this.write.poll_allowance(cx, want));
        let written = if allowed == want {
            ready!(Pin::new(&mut this.inner).poll_write_vectored(cx, bufs))
        } else {
            let first = bufs
                .iter()
                .find(|b| !b.is_empty())
                .map_or(&[][..], |b| &b[..]);
            let allowed = allowed.min(first.len());
            ready!(Pin::new(&mut this.inner).poll_write(cx, &first[..allowed]))
        };
        if let Ok(bytes) = &written {
            this.write.spend(*bytes);
        }
        Poll::Ready(written)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_close(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_close(cx)
    }
}

#[cfg(test)]
mod tests {
    use futures::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// Reads and writes through a bound of 1 MB/s take their time (a lower bound only: a busy
    /// machine may take longer); without a bound they do not wait.
    #[tokio::test]
    async fn bytes_pass_at_the_rate_after_a_burst() {
        let data = vec![7u8; 400_000];
        let started = Instant::now();
        let mut throttled = Throttled::new(futures::io::Cursor::new(data.clone()), Some(1_000_000));
        let mut got = Vec::new();
        throttled.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, data);
        // A burst of 0.1 s worth, then 1 MB a second: 0.3 s for 0.4 MB.
        let took = started.elapsed();
        assert!(took >= Duration::from_millis(280), "{took:?}");

        let started = Instant::now();
        let mut sink = Throttled::new(futures::io::Cursor::new(Vec::new()), Some(1_000_000));
        sink.write_all(&data).await.unwrap();
        let took = started.elapsed();
        assert!(took >= Duration::from_millis(280), "{took:?}");

        let unbounded = Instant::now();
        let mut free = Throttled::new(futures::io::Cursor::new(data.clone()), None);
        let mut got = Vec::new();
        free.read_to_end(&mut got).await.unwrap();
        assert!(unbounded.elapsed() < Duration::from_millis(100));
    }

    /// A batch of buffers passes in one call when the bucket allows it all (TLS writes its
    /// records this way), and only what the bucket allows of the first buffer otherwise.
    #[tokio::test]
    async fn a_batch_of_buffers_passes_whole_or_as_the_bucket_allows() {
        let (a, b) = (vec![1u8; 40_000], vec![2u8; 40_000]);
        let batch = [IoSlice::new(&a), IoSlice::new(&b)];

        let mut free = Throttled::new(futures::io::Cursor::new(Vec::new()), None);
        assert_eq!(free.write_vectored(&batch).await.unwrap(), 80_000);

        // At 1 byte a second the burst is the smallest one, 64 KiB: less than the batch.
        let mut slow = Throttled::new(futures::io::Cursor::new(Vec::new()), Some(1));
        assert_eq!(slow.write_vectored(&batch).await.unwrap(), 40_000);
        assert_eq!(
            slow.write_vectored(&batch[1..]).await.unwrap(),
            65_536 - 40_000
        );
    }
}
