//! Jobs: what a scheduler dispatches to a worker under a lease, and what the worker reports
//! back.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::market::ExecutorRef;

/// A job's credentials (a Hugging Face token, …), by name: serialized as a plain map, shown
/// in `Debug` (and so in logs and spans) by name only.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Secrets(pub BTreeMap<String, String>);

impl Secrets {
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl std::ops::Deref for Secrets {
    type Target = BTreeMap<String, String>;

    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl From<BTreeMap<String, String>> for Secrets {
    fn from(secrets: BTreeMap<String, String>) -> Self {
        Secrets(secrets)
    }
}

impl std::fmt::Debug for Secrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.0.keys()).finish()
    }
}

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
    #[serde(default, skip_serializing_if = "Secrets::is_empty")]
    pub secrets: Secrets,
    /// Artifacts the worker fetches into the job's directory before the executor starts
    /// (destinations relative to it), shared peer to peer among the workers that need them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub artifacts: Vec<crate::artifact::Request>,
    /// How many workers of the job fetch these artifacts together (this one included): each
    /// waits a moment for the others before reading from the origin, so that every chunk is
    /// read once. 0: do not wait.
    #[serde(default)]
    pub artifact_peers: usize,
    /// The workers running the task's jobs when this one was dispatched (this worker among
    /// them): with the scheduler, the only peers whose transfers reach the job. Later changes
    /// come as [`Request::TaskPeers`](crate::Request::TaskPeers).
    #[serde(default)]
    pub task_peers: TaskPeers,
}

/// The workers that run a task's jobs, as its scheduler knows them at one moment.
///
/// Lists are sent as they change, over requests that can arrive out of order (or before the
/// dispatch they follow), so each carries a version: a receiver keeps the highest it has
/// seen. The version is the scheduler's clock in milliseconds (or one more than the last, if
/// that is later), so that it keeps rising across a restart of the scheduler.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskPeers {
    pub version: u64,
    /// Peer ids as text.
    pub peers: Vec<String>,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_specs_secrets_are_named_but_never_shown() {
        let spec = JobSpec {
            id: "j".into(),
            task: "t".into(),
            lease: 1,
            executor: ExecutorRef {
                class: "train".into(),
                name: "x".into(),
            },
            config: "{}".into(),
            secrets: BTreeMap::from([("HF_TOKEN".to_string(), "hf_the_secret".to_string())]).into(),
            artifacts: Vec::new(),
            artifact_peers: 0,
            task_peers: TaskPeers::default(),
        };
        let request = crate::Request::Dispatch(spec);
        let shown = format!("{request:?} {request:#?}");
        assert!(!shown.contains("hf_the_secret"), "{shown}");
        assert!(shown.contains("HF_TOKEN"), "{shown}");
        assert_eq!(request.kind(), "dispatch");
    }
}
