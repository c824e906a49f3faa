//! What happens to a run, as [`Event`]s: what the console, the events file, the dashboard
//! and the run's history are made of. It knows nothing of how a run is driven; the run
//! ([`run`](crate::run)) records them, [`dashboard`](crate::dashboard) and
//! [`history`](crate::history) read them.

use hypha_messages::job::JobStatus;
use serde::Serialize;

/// Something that happened to the job.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Event {
    /// The dataset's data nodes answered and the iteration is open: `slices` a epoch from
    /// `data_nodes` nodes, `used` of them already (a resumed run), tracked in `ledger`.
    DataReady {
        dataset: String,
        slices: usize,
        data_nodes: usize,
        used: u64,
        ledger: String,
    },
    Leased {
        slot: usize,
        peer: String,
        lease: u64,
        price: f64,
    },
    Dispatched {
        slot: usize,
        job: String,
        peer: String,
    },
    Status {
        slot: usize,
        job: String,
        peer: String,
        status: JobStatus,
    },
    ExecutorStatus {
        job: String,
        payload: serde_json::Value,
    },
    Lost {
        slot: usize,
        peer: String,
        reason: String,
    },
    /// A trainer's updates were refused, or missing from the rounds it was expected in,
    /// rounds in a row, the last `round` (`reason` says which): its job ends, its slices go
    /// back, its slot is given up and its worker is never leased again for the task.
    Benched {
        slot: usize,
        job: String,
        peer: String,
        round: u64,
        reason: String,
    },
    /// The parameter server refused `peer`'s update of `round`: the round goes on without it.
    Refused {
        round: u64,
        peer: String,
        reason: String,
    },
    /// `peer`'s update of `round` counted for `share` of itself, for `reason` (its norm was
    /// `ratio` times the round's reference, beyond `max_update_norm_ratio`; a tensor of it
    /// beyond the model's scale; far from the round's robust centre; its trainer's updates
    /// pointing away from the others').
    Clipped {
        round: u64,
        peer: String,
        share: f32,
        #[serde(skip_serializing_if = "Option::is_none")]
        ratio: Option<f64>,
        #[serde(default, skip_serializing_if = "String::is_empty")]
        reason: String,
    },
    /// A scheduler resumed the run its earlier process left: the same task, `jobs` of it to
    /// take over, and for DiLoCo the checkpoint of `round` to go on from.
    Resumed {
        task: String,
        round: Option<u64>,
        jobs: usize,
    },
    /// A lease of the earlier run was taken over for `slot`, with its `job` where that still
    /// runs and goes on (a new job is dispatched otherwise).
    Readopted {
        slot: usize,
        peer: String,
        lease: u64,
        #[serde(skip_serializing_if = "Option::is_none")]
        job: Option<String>,
    },
    /// The parameter server's worker was lost or its job failed: a new one is leased and
    /// restored from the checkpoint of `round` (0 and no checkpoint: it starts afresh).
    /// `lost_rounds` were applied after that checkpoint (the server checkpoints every
    /// `checkpoint_every` rounds, or by traffic): their slices are trained again.
    Failover {
        peer: String,
        reason: String,
        round: u64,
        #[serde(default)]
        lost_rounds: u64,
        /// The standby that took over (`[diloco] standby`): it held the model of `round`, and
        /// no checkpoint was sent.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        standby: Option<String>,
    },
    /// The parameter server applied a DiLoCo round. `away`: it did so as the scheduler's
    /// earlier process died, which did not hear of it; the process that took the server over
    /// tells it (its samples and loss are not known: 0 and none).
    Round {
        round: u64,
        trainers: usize,
        samples: u64,
        loss: Option<f64>,
        #[serde(skip_serializing_if = "std::ops::Not::not")]
        away: bool,
    },
    /// `peer` scored the global model of `round` (the one after round `round − 1`) on the
    /// job's held-out data: mean `loss` over `scored` targets.
    Evaluated {
        round: u64,
        peer: String,
        loss: f64,
        #[serde(skip_serializing_if = "Option::is_none")]
        accuracy: Option<f64>,
        scored: u64,
    },
    /// The first trainers hold the model: the run's first round waits for the other leased
    /// trainers to load, `grace_s` at most (`[diloco] start_grace_seconds`).
    WaitingForTrainers {
        ready: usize,
        trainers: usize,
        grace_s: f64,
    },
    /// The run's first round begins with `trainers` trainers, `waited_s` after the first was
    /// ready; `late` (peers) were still loading when the grace ran out and join once ready.
    RoundsBegin {
        round: u64,
        trainers: usize,
        #[serde(skip_serializing_if = "Vec::is_empty")]
        late: Vec<String>,
        waited_s: f64,
    },
    /// A trainer trains its first round of the run (from the start, or joining later).
    Joined {
        slot: usize,
        job: String,
        peer: String,
        round: u64,
    },
    Done {
        ok: bool,
        message: String,
    },
    /// Only to an observer that fell behind: `missed` events were dropped for it before this
    /// one (the console, the events file and the dashboard have them all).
    Missed {
        missed: u64,
    },
}

/// How much of an executor's stderr a failure shows: what a worker sends is not trusted to be
/// short or printable.
const STDERR_LINES: usize = 20;
const STDERR_LINE_CHARS: usize = 500;

/// A job's failure with the last lines its executor wrote to stderr, indented below it; at
/// most [`STDERR_LINES`] of [`STDERR_LINE_CHARS`], control characters shown as U+FFFD so that
/// a line can neither fake another nor steer the terminal.
pub fn with_stderr(reason: String, stderr_tail: &[String]) -> String {
    let lines: Vec<String> = stderr_tail
        .iter()
        .filter(|l| !l.trim().is_empty())
        .map(|line| {
            line.chars()
                .take(STDERR_LINE_CHARS)
                .map(|c| if c.is_control() { '\u{fffd}' } else { c })
                .collect()
        })
        .collect();
    if lines.is_empty() {
        return reason;
    }
    let mut text = format!("{reason}; the executor's stderr ended with:");
    for line in &lines[lines.len().saturating_sub(STDERR_LINES)..] {
        text.push_str("\n    ");
        text.push_str(line);
    }
    text
}

#[cfg(test)]
mod tests {
    use super::with_stderr;

    #[test]
    fn an_executors_stderr_is_shown_short_and_printable() {
        let tail: Vec<String> = (0..30).map(|i| format!("line {i}")).collect();
        let shown = with_stderr("exit code 1".into(), &tail);
        assert!(shown.starts_with("exit code 1; the executor's stderr ended with:\n    line 10\n"));
        assert!(shown.ends_with("\n    line 29"));
        let hostile = vec![format!("ok\rerror: forged\x1b[2J{}", "x".repeat(10_000))];
        let shown = with_stderr("exit code 1".into(), &hostile);
        assert_eq!(shown.lines().count(), 2, "{shown}");
        assert!(!shown.contains('\r') && !shown.contains('\x1b'));
        assert!(shown.len() < 1_000);
        assert_eq!(with_stderr("killed".into(), &["  ".into()]), "killed");
    }
}
