//! A run's durable record beside its ledger (`job.run.json` for `job.ledger`): what a
//! scheduler that was killed needs to resume the same run when it is started again.
//!
//! It holds the run's task id (the iteration and the workers' transfers are addressed to it),
//! the jobs running with the workers and leases they run under, and the applied rounds whose
//! slices wait for a checkpoint (round, job): the rounds a restarted scheduler commits in the
//! ledger when the checkpoint it holds has them, waits for the next checkpoint with when the
//! parameter server goes on through the restart, and gives back otherwise; and the run's
//! [`history`](crate::history), which `progress` shows. The record is
//! rewritten whole (temp file, fsync, rename) each time one of these changes, an applied round
//! before its parameter server hears that it was taken, so what it says is never older than
//! what the workers act on. A run that completes removes it.

use std::path::{Path, PathBuf};

use hypha_messages::iterate::RunProgress;
use serde::{Deserialize, Serialize};

/// The record of a run whose ledger is at `ledger`.
pub fn path_beside(ledger: &Path) -> PathBuf {
    ledger.with_extension("run.json")
}

/// What a run keeps on disk.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RunRecord {
    /// The run's task id.
    pub task: String,
    /// The jobs running now.
    pub jobs: Vec<RecordedJob>,
    /// Applied rounds of trainers' jobs whose slices are used once a checkpoint holds them.
    pub uncommitted: Vec<RecordedRound>,
    /// How the run fared so far: restarts, re-adoptions, failovers, workers lost.
    #[serde(default)]
    pub history: RunProgress,
    /// Trainers benched: never leased again for the task, their slots given up.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub benched: Vec<BenchedTrainer>,
    /// The data nodes the run's iteration takes its slices from.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub data_nodes: Vec<String>,
}

/// A trainer benched for updates refused, or missing, too many rounds in a row.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BenchedTrainer {
    pub peer: String,
    pub slot: usize,
    /// The round it was benched at, and why (a record of an older version has neither).
    #[serde(default)]
    pub round: u64,
    #[serde(default)]
    pub reason: String,
}

/// A job of the run and the lease it runs under.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RecordedJob {
    pub job: String,
    pub slot: usize,
    pub peer: String,
    pub lease: u64,
    pub price: f64,
    /// A trainer not yet told to join the current parameter server: it holds a model of one
    /// lost before, so it joins whichever server the run goes on with.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub rejoin: bool,
}

/// An applied round of a trainer's job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RecordedRound {
    pub round: u64,
    pub peer: String,
    pub job: String,
}

/// Why a record cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error(
        "cannot read the run record {path}: {error}; remove it to start the run afresh (the ledger keeps what was used)"
    )]
    Read { path: String, error: std::io::Error },
    #[error(
        "the run record {path} is damaged ({error}); remove it to start the run afresh (the ledger keeps what was used)"
    )]
    Damaged {
        path: String,
        error: serde_json::Error,
    },
    #[error("cannot write the run record {path}: {error}")]
    Write {
        path: String,
        error: hypha_files::Error,
    },
    #[error("the run record cannot be encoded: {0}")]
    Encode(#[from] serde_json::Error),
}

impl RunRecord {
    /// The record at `path`; `None` when there is none.
    pub fn load(path: &Path) -> Result<Option<Self>, RecordError> {
        let bytes = match std::fs::read(path) {
            Ok(bytes) => bytes,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(error) => {
                return Err(RecordError::Read {
                    path: path.display().to_string(),
                    error,
                });
            }
        };
        serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|error| RecordError::Damaged {
                path: path.display().to_string(),
                error,
            })
    }

    /// Writes the record to `path` atomically and durably.
    pub fn store(&self, path: &Path) -> Result<(), RecordError> {
        let bytes = serde_json::to_vec_pretty(self)?;
        hypha_files::write_atomic(path, &bytes, hypha_files::Mode::Private, true).map_err(|error| {
            RecordError::Write {
                path: path.display().to_string(),
                error,
            }
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn a_record_is_read_back_as_written_and_a_damaged_one_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = path_beside(&dir.path().join("train.ledger"));
        assert_eq!(path, dir.path().join("train.run.json"));
        assert_eq!(RunRecord::load(&path).unwrap(), None);
        let record = RunRecord {
            task: "t".into(),
            jobs: vec![RecordedJob {
                job: "j".into(),
                slot: 2,
                peer: "p".into(),
                lease: u64::MAX,
                price: 5.0,
                rejoin: true,
            }],
            uncommitted: vec![RecordedRound {
                round: 7,
                peer: "p".into(),
                job: "j".into(),
            }],
            history: RunProgress {
                task: "t".into(),
                restarts: 2,
                ..RunProgress::default()
            },
            benched: vec![BenchedTrainer {
                peer: "liar".into(),
                slot: 1,
                round: 7,
                reason: "its updates were refused 3 rounds in a row".into(),
            }],
            data_nodes: vec!["data".into()],
        };
        record.store(&path).unwrap();
        assert_eq!(RunRecord::load(&path).unwrap(), Some(record));
        std::fs::write(&path, b"{\"task\": ").unwrap();
        let error = RunRecord::load(&path).unwrap_err().to_string();
        assert!(
            error.contains("damaged") && error.contains("remove it"),
            "{error}"
        );
    }
}
