//! The slowest a peer may send what it is sending: a peer that trickles a byte now and then,
//! never silent long enough for a read timeout, would otherwise hold the receiver's slot (a
//! transfer's, a slice download's) for as long as it likes.

use std::time::Duration;

/// The slowest bytes may come, on average over each period a [`RateFloor`] measures.
pub const MIN_BYTES_PER_SECOND: u64 = 32 * 1024;

/// Checks that bytes keep coming at a rate: over each `period` (or the longer time until bytes
/// came after it), at least `per_second` on average.
#[derive(Debug)]
pub struct RateFloor {
    period: Duration,
    per_second: u64,
    since: tokio::time::Instant,
    bytes: u64,
}

impl RateFloor {
    pub fn new(period: Duration, per_second: u64) -> Self {
        RateFloor {
            period,
            per_second,
            since: tokio::time::Instant::now(),
            bytes: 0,
        }
    }

    /// Counts `bytes` that came at `now`; `false` once a whole period brought fewer than the
    /// floor.
    pub fn add(&mut self, bytes: u64, now: tokio::time::Instant) -> bool {
        self.bytes += bytes;
        let elapsed = now.duration_since(self.since);
        if elapsed < self.period {
            return true;
        }
        let enough =
            u128::from(self.bytes) * 1000 >= u128::from(self.per_second) * elapsed.as_millis();
        self.since = now;
        self.bytes = 0;
        enough
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sender that trickles, never silent long enough to stall, is still cut off; one that
    /// keeps the pace is not.
    #[test]
    fn a_trickle_falls_below_the_floor_and_a_steady_stream_does_not() {
        let start = tokio::time::Instant::now();
        let second = Duration::from_secs(1);
        let mut trickle = RateFloor::new(Duration::from_secs(30), 32 * 1024);
        let mut steady = RateFloor::new(Duration::from_secs(30), 32 * 1024);
        let mut trickle_ok = true;
        for s in 1..=90u32 {
            let now = start + second * s;
            trickle_ok &= trickle.add(1024, now);
            assert!(
                steady.add(40 * 1024, now),
                "a steady 40 KiB/s is fine at {s} s"
            );
        }
        assert!(!trickle_ok, "1 KiB/s is cut off");
    }
}
