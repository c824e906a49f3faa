//! How often an executor's statuses are written down: a job that reports a thousand times a
//! second (a bug, or a certified peer filling the scheduler's disk) has its statuses
//! answered, and [`RECORDED_PER_S`] of them a second written.

use std::collections::HashMap;

/// A job's statuses written a second at most, in bursts of as many: trainers report five
/// times a second, and a few more as they join, rejoin or sync; every one of those is written.
pub const RECORDED_PER_S: f64 = 20.0;

/// The largest executor status written as it came (bytes of JSON); a larger one is written
/// as its size. A trainer's status is about 600 bytes.
pub const RECORDED_STATUS_BYTES: usize = 4096;

/// Each job's allowance of statuses to write (a token bucket).
#[derive(Debug, Default)]
pub struct Throttle {
    allowance: HashMap<String, (f64, u64)>,
}

impl Throttle {
    /// Whether job `job`'s status at `now_ms` is written: it has allowance left. `news` (a
    /// status that says something once, a score) always is.
    pub fn records(&mut self, job: &str, now_ms: u64, news: bool) -> bool {
        let (tokens, last_ms) = self
            .allowance
            .entry(job.to_string())
            .or_insert((RECORDED_PER_S, now_ms));
        let refill = now_ms.saturating_sub(*last_ms) as f64 / 1000.0 * RECORDED_PER_S;
        *tokens = (*tokens + refill).min(RECORDED_PER_S);
        *last_ms = now_ms;
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            return true;
        }
        news
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_has_twenty_statuses_a_second_written_and_its_news_always() {
        let mut throttle = Throttle::default();
        // An honest trainer: every 200 ms, with a burst of ten as it rejoins.
        let honest = (0..50u64).all(|i| throttle.records("a", i * 200, false));
        assert!(honest);
        assert!((0..10).all(|i| throttle.records("a", 10_000 + i, false)));
        // A flood of a thousand in a second: the burst and the refill.
        let written = (0..1000u64)
            .filter(|ms| throttle.records("c", 20_000 + ms, false))
            .count();
        assert!((20..=41).contains(&written), "{written}");
        assert!(throttle.records("c", 20_999, true), "news");
        assert!(throttle.records("b", 20_999, false), "each job its own");
    }
}
