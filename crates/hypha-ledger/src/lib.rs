//! Exactly-once iteration over a dataset's slices.
//!
//! An iteration covers a dataset for a number of epochs. Each epoch hands its slices out in a
//! [`permutation`] fixed by the iteration's seed, and every slice of every epoch moves through
//!
//! ```text
//! AVAILABLE ──assign──▶ ASSIGNED ──consume──▶ CONSUMED ──commit round──▶ USED
//!     ▲                    │                     │
//!     └──── lease expired, worker lost ──────────┘ (and: round dropped)
//! ```
//!
//! - ASSIGNED: handed to a worker, which holds a lease on its assignments; any request of the
//!   worker renews it. An expired lease returns the worker's ASSIGNED slices.
//! - CONSUMED: the worker says the slice's samples went into its round `r`.
//! - USED: round `r`'s update reached the model (the parameter server, or for jobs without
//!   one the scheduler, says so). A dropped round, or a worker declared lost, returns its
//!   CONSUMED slices.
//!
//! A slice becomes USED at most once per epoch, and an epoch ends only when all its slices are
//! USED. Epochs meet at their boundary: once epoch `e` has nothing AVAILABLE, workers get
//! slices of `e + 1` while `e`'s last slices finish, and a slice that `e` gets back is handed
//! out before anything of `e + 1`.
//!
//! [`Ledger`] is the state machine and its durable store (`redb`); every transition is one row
//! of the audit log, and the log *is* the state: opening a ledger replays it. [`LedgerHandle`]
//! runs a ledger as an actor that commits many callers' transitions in one transaction (group
//! commit) and answers each caller only once its transitions are on disk.
//!
//! This crate knows nothing of networks, workers' addresses or data nodes: a worker is a name,
//! a slice is a number.

mod audit;
mod handle;
mod ledger;
mod permutation;
mod store;

use std::{fmt, path::PathBuf};

use serde::{Deserialize, Serialize};

pub use audit::{
    Audit, AuditRecord, EpochSummary, Finished, Problem, Report, Use, WorkerSummary, read_audit,
};
pub use handle::LedgerHandle;
pub use ledger::{Assignment, Consumed, EpochProgress, Grant, Ledger, Progress, WorkerProgress};
pub use permutation::permutation;

/// The most epochs an iteration may have: a ledger, its progress and its audit grow with them.
/// Data nodes and schedulers refuse more; `audit` refuses a ledger file that claims more.
pub const MAX_EPOCHS: u32 = 10_000;

/// What an iteration covers. Two ledgers with equal specs hand out slices in the same order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IterationSpec {
    /// The dataset's name.
    pub dataset: String,
    /// How many times every slice is used.
    pub epochs: u32,
    /// Fixes each epoch's order.
    pub seed: u64,
    /// Samples per slice, in slice order; its length is the slice count.
    pub samples: Vec<u64>,
}

impl IterationSpec {
    /// The number of slices in one epoch.
    pub fn slices(&self) -> usize {
        self.samples.len()
    }

    /// A short fingerprint of the spec (BLAKE3 of its JSON form).
    fn fingerprint(&self) -> String {
        let json = serde_json::to_vec(self).unwrap_or_default();
        blake3::hash(&json).to_hex()[..16].to_string()
    }
}

/// One slice in one epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct SliceKey {
    pub epoch: u32,
    pub slice: u64,
}

impl fmt::Display for SliceKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "epoch {} slice {}", self.epoch, self.slice)
    }
}

/// A transition as the audit log records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    Assigned {
        worker: String,
        deadline_ms: u64,
    },
    Consumed {
        worker: String,
        round: u64,
    },
    Used {
        worker: String,
        round: u64,
    },
    Returned {
        worker: String,
        reason: ReturnReason,
    },
}

/// Why a slice went back to AVAILABLE.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReturnReason {
    /// The worker's lease on its assignments lapsed.
    Expired,
    /// The worker was declared lost (its market lease ended, its process died).
    WorkerLost,
    /// The round the slice went into never reached the model.
    Dropped,
    /// The worker never got the grant (it says it does not hold the slice).
    NeverReceived,
}

impl ReturnReason {
    fn code(self) -> u64 {
        match self {
            Self::Expired => 1,
            Self::WorkerLost => 2,
            Self::Dropped => 3,
            Self::NeverReceived => 4,
        }
    }

    fn from_code(code: u64) -> Self {
        match code {
            1 => Self::Expired,
            2 => Self::WorkerLost,
            4 => Self::NeverReceived,
            _ => Self::Dropped,
        }
    }
}

/// Names an iteration: its id and the fingerprint of its spec. Handing it to
/// [`Ledger::resume`] continues the iteration where its ledger file left off, and refuses a
/// file that holds another iteration.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct CheckpointToken(String);

impl CheckpointToken {
    fn new(id: &str, spec: &IterationSpec) -> Self {
        Self(format!("{id}.{}", spec.fingerprint()))
    }
}

impl fmt::Display for CheckpointToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::str::FromStr for CheckpointToken {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.split_once('.') {
            Some((id, fingerprint)) if !id.is_empty() && fingerprint.len() == 16 => {
                Ok(Self(s.to_string()))
            }
            _ => Err(Error::Invalid(format!(
                "{s:?} is not a checkpoint token (it looks like \"<iteration id>.<16 hex digits>\")"
            ))),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("the ledger store failed: {0}")]
    Store(#[from] redb::Error),
    /// Which of the ledger's invariants a stored row breaks, described: only a person can
    /// repair it, and no caller decides on which.
    #[error("the ledger is damaged: {0}")]
    Corrupt(String),
    #[error("{} already holds a ledger; resume it, or choose another path", .0.display())]
    Exists(PathBuf),
    #[error("{} holds no ledger", .0.display())]
    Missing(PathBuf),
    #[error(
        "{} is open in another process (a running scheduler or data node holds its ledger); read it once that process stops, or ask the running node with `progress`",
        .0.display()
    )]
    InUse(PathBuf),
    /// The file holds another iteration than the one asked for: what it holds, what was
    /// asked, and the fix, in one sentence for the user.
    #[error("{0}")]
    Mismatch(String),
    /// What is wrong with the iteration asked for (no dataset, no slices, …), described for
    /// the job file's author.
    #[error("{0}")]
    Invalid(String),
    #[error("the ledger has stopped")]
    Stopped,
    #[error("reading the ledger: {0}")]
    Io(#[from] std::io::Error),
}
