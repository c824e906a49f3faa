//! Reading a ledger's audit log and checking exactly-once from it alone.
//!
//! [`read_audit`] reads every transition a ledger file holds; [`Audit::check`] replays them
//! without the ledger's own bookkeeping and reports, per epoch and per worker, where the
//! slices stand, and every breach of exactly-once it finds: a slice USED more than once in an
//! epoch, and, once the iteration is finished, a slice of an epoch that was never USED.
//!
//! An iteration counts as finished when every slice of its last epoch is USED (epochs are
//! handed out in order, so by then a correct ledger has used up every earlier epoch too), or
//! when the caller knows it ended ([`Finished::Yes`]: the job that ran it said it was done).

use std::{
    collections::{BTreeMap, HashMap},
    fmt,
    path::Path,
};

use serde::{Deserialize, Serialize};

use crate::{CheckpointToken, Error, Event, IterationSpec, SliceKey, store};

/// One row of the audit log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuditRecord {
    /// The row's position in the log, from 0.
    pub seq: u64,
    /// Milliseconds since the Unix epoch.
    pub time_ms: u64,
    #[serde(flatten)]
    pub key: SliceKey,
    #[serde(flatten)]
    pub event: Event,
}

/// A ledger file read whole: what it iterates and everything that happened.
#[derive(Debug, Clone)]
pub struct Audit {
    pub token: CheckpointToken,
    pub spec: IterationSpec,
    pub records: Vec<AuditRecord>,
}

/// The most breaches a report lists; it counts the rest (`unlisted_problems`). A ledger file
/// (a hostile one, or one of a run that broke badly) could otherwise make the audit list a
/// breach for every slice of every epoch.
pub const LISTED_PROBLEMS: usize = 1000;

/// Reads the ledger at `path` (which no running ledger may hold open), without changing it.
/// A file claiming more than [`MAX_EPOCHS`](crate::MAX_EPOCHS) epochs is refused: the audit's
/// work and memory grow with them.
pub fn read_audit(path: &Path) -> Result<Audit, Error> {
    let loaded = store::read_file(path)?;
    if loaded.spec.epochs > crate::MAX_EPOCHS {
        return Err(Error::Corrupt(format!(
            "the ledger claims {} epochs; an iteration has at most {}",
            loaded.spec.epochs,
            crate::MAX_EPOCHS
        )));
    }
    let records = loaded
        .records
        .iter()
        .enumerate()
        .map(|(seq, record)| AuditRecord {
            seq: seq as u64,
            time_ms: record.time_ms,
            key: record.key,
            event: record.event(&loaded.workers),
        })
        .collect();
    Ok(Audit {
        token: CheckpointToken::new(&loaded.id, &loaded.spec),
        spec: loaded.spec,
        records,
    })
}

/// Whether the iteration is to be checked as finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finished {
    /// When every slice of its last epoch is USED.
    WhenLastEpochIsUsed,
    /// In any case: the job that ran it ended.
    Yes,
}

/// Where an iteration stands by its audit log, and what breaks exactly-once in it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    pub token: CheckpointToken,
    pub dataset: String,
    /// Slices per epoch.
    pub slices: u64,
    /// Transitions in the log.
    pub transitions: u64,
    /// Whether the iteration was checked as finished (every slice of every epoch USED).
    pub finished: bool,
    /// Every epoch of the iteration, begun or not.
    pub epochs: Vec<EpochSummary>,
    /// Every worker the log names, by name.
    pub workers: Vec<WorkerSummary>,
    /// Breaches of exactly-once, at most [`LISTED_PROBLEMS`]; empty when it holds.
    pub problems: Vec<Problem>,
    /// Breaches found beyond those listed.
    #[serde(skip_serializing_if = "is_zero")]
    pub unlisted_problems: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// The slices of one epoch by their last state, and how often one went back.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct EpochSummary {
    pub epoch: u32,
    /// Never handed out, or handed back.
    pub available: u64,
    pub assigned: u64,
    pub consumed: u64,
    pub used: u64,
    /// Times a slice of this epoch went back to AVAILABLE.
    pub returned: u64,
}

/// What one worker did, in transitions.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct WorkerSummary {
    pub worker: String,
    pub assigned: u64,
    pub consumed: u64,
    pub used: u64,
    pub returned: u64,
}

/// A breach of exactly-once.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "problem", rename_all = "snake_case")]
pub enum Problem {
    /// The slice was USED more than once in its epoch.
    UsedTwice {
        #[serde(flatten)]
        key: SliceKey,
        uses: Vec<Use>,
    },
    /// The iteration is finished but this slice was never USED in its epoch.
    NeverUsed {
        #[serde(flatten)]
        key: SliceKey,
        /// Its last state: `available`, `assigned` or `consumed`.
        state: &'static str,
    },
}

/// One USED transition of a slice.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Use {
    pub seq: u64,
    pub worker: String,
    pub round: u64,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Problem::UsedTwice { key, uses } => {
                write!(f, "{key} was used {} times:", uses.len())?;
                for (n, u) in uses.iter().enumerate() {
                    let sep = if n == 0 { " " } else { ", " };
                    // Worker names come from the file: escaped, so a name cannot steer a terminal.
                    write!(
                        f,
                        "{sep}by {} in round {} (transition {})",
                        u.worker.escape_debug(),
                        u.round,
                        u.seq
                    )?;
                }
                Ok(())
            }
            Problem::NeverUsed { key, state } => {
                write!(f, "{key} was never used (it is left {state})")
            }
        }
    }
}

/// A slice's last state in the replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Last {
    Available,
    Assigned,
    Consumed,
    Used,
}

impl Audit {
    /// Replays the log and checks exactly-once; `finished` says when a slice never USED is a
    /// breach.
    pub fn check(&self, finished: Finished) -> Report {
        let slices = self.spec.slices() as u64;
        let epochs = self.spec.epochs;
        let mut last: HashMap<SliceKey, Last> = HashMap::new();
        let mut uses: BTreeMap<SliceKey, Vec<Use>> = BTreeMap::new();
        let mut returned = vec![0u64; epochs as usize];
        let mut workers: BTreeMap<&str, WorkerSummary> = BTreeMap::new();
        for record in &self.records {
            let (worker, state) = match &record.event {
                Event::Assigned { worker, .. } => (worker, Last::Assigned),
                Event::Consumed { worker, .. } => (worker, Last::Consumed),
                Event::Used { worker, round } => {
                    uses.entry(record.key).or_default().push(Use {
                        seq: record.seq,
                        worker: worker.clone(),
                        round: *round,
                    });
                    (worker, Last::Used)
                }
                Event::Returned { worker, .. } => {
                    if let Some(count) = returned.get_mut(record.key.epoch as usize) {
                        *count += 1;
                    }
                    (worker, Last::Available)
                }
            };
            let summary = workers
                .entry(worker.as_str())
                .or_insert_with(|| WorkerSummary {
                    worker: worker.clone(),
                    ..WorkerSummary::default()
                });
            match state {
                Last::Assigned => summary.assigned += 1,
                Last::Consumed => summary.consumed += 1,
                Last::Used => summary.used += 1,
                Last::Available => summary.returned += 1,
            }
            // USED is final: a later transition of the slice does not take it back.
            let entry = last.entry(record.key).or_insert(Last::Available);
            if *entry != Last::Used {
                *entry = state;
            }
        }

        let last_epoch_used = (0..slices).all(|slice| {
            uses.contains_key(&SliceKey {
                epoch: epochs.saturating_sub(1),
                slice,
            })
        });
        let finished = finished == Finished::Yes || last_epoch_used;
        let mut problems: Vec<Problem> = Vec::new();
        let mut unlisted_problems = 0u64;
        let mut found = |problem: Problem| {
            if problems.len() < LISTED_PROBLEMS {
                problems.push(problem);
            } else {
                unlisted_problems += 1;
            }
        };
        for (&key, uses) in uses.iter().filter(|(_, uses)| uses.len() > 1) {
            found(Problem::UsedTwice {
                key,
                uses: uses.clone(),
            });
        }
        let mut summaries = Vec::with_capacity(epochs as usize);
        for epoch in 0..epochs {
            let mut summary = EpochSummary {
                epoch,
                returned: returned[epoch as usize],
                ..EpochSummary::default()
            };
            for slice in 0..slices {
                let key = SliceKey { epoch, slice };
                let state = last.get(&key).copied().unwrap_or(Last::Available);
                let (count, name) = match state {
                    Last::Available => (&mut summary.available, "available"),
                    Last::Assigned => (&mut summary.assigned, "assigned"),
                    Last::Consumed => (&mut summary.consumed, "consumed"),
                    Last::Used => (&mut summary.used, "used"),
                };
                *count += 1;
                if finished && state != Last::Used {
                    found(Problem::NeverUsed { key, state: name });
                }
            }
            summaries.push(summary);
        }
        Report {
            token: self.token.clone(),
            dataset: self.spec.dataset.clone(),
            slices,
            transitions: self.records.len() as u64,
            finished,
            epochs: summaries,
            workers: workers.into_values().collect(),
            problems,
            unlisted_problems,
        }
    }
}

impl Report {
    /// Whether every slice was USED at most once, and exactly once if finished.
    pub fn exactly_once(&self) -> bool {
        self.problems.is_empty() && self.unlisted_problems == 0
    }
}
