//! How often an executor's statuses are written down: a job that reports a thousand times a
//! second (a bug, or a certified peer filling the scheduler's disk) has its statuses
//! answered, and one of them written each [`RECORD_EVERY_MS`].

use std::collections::HashMap;

/// At most one status of a job is written to the metrics or events file this often (ms):
/// trainers report every 200 ms.
pub const RECORD_EVERY_MS: u64 = 100;

/// The largest executor status written as it came (bytes of JSON); a larger one is written
/// as its size. A trainer's status is about 600 bytes.
pub const RECORDED_STATUS_BYTES: usize = 4096;

/// When each job's status was last written.
#[derive(Debug, Default)]
pub struct Throttle {
    last_ms: HashMap<String, u64>,
}

impl Throttle {
    /// Whether job `job`'s status at `now_ms` is written: none was in the last
    /// [`RECORD_EVERY_MS`]. `news` (a status that says something once, a score) always is.
    pub fn records(&mut self, job: &str, now_ms: u64, news: bool) -> bool {
        let due = (self.last_ms.get(job))
            .is_none_or(|last| now_ms >= last.saturating_add(RECORD_EVERY_MS));
        if due || news {
            self.last_ms.insert(job.to_string(), now_ms);
        }
        due || news
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_has_one_status_written_a_tenth_of_a_second_and_its_news_always() {
        let mut throttle = Throttle::default();
        assert!(throttle.records("a", 1_000, false));
        assert!(!throttle.records("a", 1_050, false));
        assert!(throttle.records("b", 1_050, false), "each job its own");
        assert!(throttle.records("a", 1_060, true), "news");
        assert!(!throttle.records("a", 1_100, false));
        assert!(throttle.records("a", 1_160, false));
        let written = (0..1000u64)
            .filter(|ms| throttle.records("c", 5_000 + ms, false))
            .count();
        assert_eq!(written, 10, "a thousand statuses in a second");
    }
}
