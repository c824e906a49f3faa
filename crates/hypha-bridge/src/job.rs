//! What an executor is told about its job: `{JOB_JSON}` in its arguments, `job.json` in its
//! directory.

use hypha_messages::market::ExecutorRef;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// A job as its executor sees it: everything but the secrets.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct JobDescription {
    /// The job's id (a UUID).
    pub id: String,
    /// The same id, where the upstream Hypha executors read it.
    #[serde(default)]
    pub job_id: String,
    /// The scheduler's run: files are sent only between jobs of one task.
    pub task: String,
    /// The lease the job runs under.
    pub lease: u64,
    pub executor: ExecutorDescription,
    /// The job file's `[config]`, as JSON; a DiLoCo trainer's has `data` (the reference its
    /// slices are fetched with) and `diloco` (a `TrainerConfig`) added.
    pub config: Value,
    /// `secrets.json` (in the job's directory, readable by the job's user alone) when the
    /// job has secrets.
    #[serde(default)]
    pub secrets_file: Option<String>,
}

/// The executor a job runs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ExecutorDescription {
    /// `train`, `aggregate`, …
    pub class: String,
    pub name: String,
    /// The job's `config` again, where the upstream Hypha executors read it.
    #[serde(default)]
    pub config: Value,
}

impl JobDescription {
    /// The description of job `id` of `task`, running `executor` with `config` under
    /// `lease`.
    pub fn new(
        id: &str,
        task: &str,
        lease: u64,
        executor: &ExecutorRef,
        config: Value,
        has_secrets: bool,
    ) -> Self {
        JobDescription {
            id: id.to_string(),
            job_id: id.to_string(),
            task: task.to_string(),
            lease,
            executor: ExecutorDescription {
                class: executor.class.clone(),
                name: executor.name.clone(),
                config: config.clone(),
            },
            config,
            secrets_file: has_secrets.then(|| "secrets.json".to_string()),
        }
    }
}
