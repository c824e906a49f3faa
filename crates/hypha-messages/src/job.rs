//! Jobs: what a scheduler dispatches to a worker under a lease, and what the worker reports
//! back.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::market::ExecutorRef;

/// A job to run on a leased worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobSpec {
    /// Unique per job (a UUID); names the job's work directory, `hypha-{id}`.
    pub id: String,
    /// The scheduler's run this job belongs to, shared by all its jobs: resources sent between
    /// jobs travel only between jobs of the same task.
    pub task: String,
    /// The lease the job runs under; the job stops when the lease ends.
    pub lease: u64,
    pub executor: ExecutorRef,
    /// The executor's settings, a JSON document handed over as `{JOB_JSON}`.
    pub config: String,
    /// Credentials the job may need (a Hugging Face token, …). They never appear in an
    /// executor's arguments or environment: the worker keeps them to itself and uses them on
    /// the job's behalf, and writes them to a file only the job's user can read.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub secrets: BTreeMap<String, String>,
    /// Artifacts the worker fetches into the job's directory before the executor starts
    /// (destinations relative to it), shared peer to peer among the workers that need them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub artifacts: Vec<crate::artifact::Request>,
    /// How many workers of the job fetch these artifacts together (this one included): each
    /// waits a moment for the others before reading from the origin, so that every chunk is
    /// read once. 0: do not wait.
    #[serde(default)]
    pub artifact_peers: usize,
}

/// What became of a job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum JobStatus {
    /// The executor started.
    Running,
    /// The executor exited by itself; when the code is not 0, with the last lines of its
    /// stderr (absent from workers that predate it).
    Finished {
        exit_code: i32,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        stderr_tail: Vec<String>,
    },
    /// The job could not start or was killed, with the last lines of the executor's stderr.
    Failed {
        reason: String,
        stderr_tail: Vec<String>,
    },
}

/// A worker telling the job's scheduler what became of it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusReport {
    pub job: String,
    pub status: JobStatus,
}
