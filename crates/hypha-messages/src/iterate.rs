//! Iterating a dataset exactly once: asking the iteration's ledger for slices and reporting on
//! them.
//!
//! With `cluster_sync = true` the ledger is the scheduler's and the askers are the jobs of its
//! task; with `cluster_sync = false` the ledger is a data node's own and the askers are its
//! clients. Either way one [`IterateRequest`] both reports (slices consumed, a round that
//! reached the model) and asks (more slices), so a consumer needs one round trip per step.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// One slice in one epoch.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
pub struct SliceRef {
    pub epoch: u32,
    pub slice: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IterateRequest {
    /// The iteration: a scheduler's task, or a name a data node's clients share.
    pub iteration: String,
    pub dataset: String,
    /// Who asks, within the asking peer: a job's id on a worker, a client's name.
    pub consumer: String,
    /// The iteration the asker expects; a ledger that iterates otherwise refuses. Epochs 0
    /// takes the ledger's epochs and seed, whatever they are.
    pub epochs: u32,
    pub seed: u64,
    /// Slices wanted now; 0 only reports.
    pub want: u32,
    /// Slice numbers the asker holds already; preferred among the next ones.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cached: Vec<u64>,
    /// Slices whose samples went into round `round`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub consumed: Vec<SliceRef>,
    #[serde(default)]
    pub round: u64,
    /// A round of the asker's that reached the model, for iterations without a parameter
    /// server to say so.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completed_round: Option<u64>,
    /// Every slice granted to the asker that it still holds unconsumed (fetched ahead, being
    /// fetched, being read), from askers that keep count: the ledger takes back the asker's
    /// other ASSIGNED slices, grants whose answer never reached it (a scheduler killed as it
    /// answered, a connection lost).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holding: Option<Vec<SliceRef>>,
    /// A data node's own iteration (`cluster_sync = false`) belongs to the peer that started
    /// it; these other peers (ids) may consume from it too. Sent by the owner, it replaces the
    /// list; from anyone else it is ignored.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub share_with: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IterateGrant {
    /// Slices now assigned to the asker, in the order to use them.
    pub slices: Vec<GrantedSlice>,
    /// Reported slices the asker may not count (its lease lapsed and another took them).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub refused: Vec<SliceRef>,
    pub status: IterateStatus,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IterateStatus {
    /// Slices were granted (or none were wanted).
    Granted,
    /// Nothing is free now but slices others hold may come back: ask again after `retry_ms`.
    Wait { retry_ms: u64 },
    /// Every slice is used or on its way to it: the asker is done.
    Finished,
}

/// A slice handed out, with what the asker needs to fetch and check it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GrantedSlice {
    pub epoch: u32,
    pub slice: u64,
    /// The slice's file: how to ask providers for it, whatever number they give it.
    pub file: String,
    pub samples: u64,
    /// The slice file's size and BLAKE3 (hex), as its manifest lists them.
    pub size: u64,
    pub blake3: String,
    /// Peers that hold it, the one to try first first.
    pub providers: Vec<String>,
}

impl GrantedSlice {
    pub fn key(&self) -> SliceRef {
        SliceRef {
            epoch: self.epoch,
            slice: self.slice,
        }
    }
}

/// Where an iteration stands.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IterationProgress {
    pub iteration: String,
    pub dataset: String,
    pub finished: bool,
    pub epochs: Vec<EpochCounts>,
    pub consumers: Vec<ConsumerRate>,
    /// How the run this iteration feeds has fared: present when a scheduler answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run: Option<Box<RunProgress>>,
}

/// How a scheduler's run has fared, over every process that ran it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RunProgress {
    pub task: String,
    /// Times a scheduler resumed the run its earlier process left.
    pub restarts: u32,
    /// Leases of an earlier process taken over.
    pub readoptions: u32,
    /// Parameter servers replaced from a checkpoint.
    pub failovers: u32,
    /// Workers lost and replaced.
    pub lost: u32,
    /// Trainers benched: their updates were refused, or missing, too many rounds in a row.
    #[serde(default)]
    pub benched: u32,
    /// Updates the parameter server refused.
    #[serde(default)]
    pub refused: u32,
    /// Updates that counted for a share of themselves (clipped).
    #[serde(default)]
    pub clipped: u32,
    /// The last DiLoCo round applied.
    pub round: Option<u64>,
    /// The latest score of a global model on the job's held-out data (`[data] eval`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held_out: Option<crate::diloco::Evaluation>,
    /// The latest restarts, re-adoptions, failovers and losses, oldest first.
    pub recent: Vec<RunNote>,
}

/// One thing that happened to a run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunNote {
    pub time_ms: u64,
    /// `restart`, `readoption`, `failover`, `lost`, `benched`, `joined` (a trainer joined
    /// after the first round) or `late` (the first round began without trainers still
    /// loading).
    pub kind: String,
    pub detail: String,
}

/// One epoch's slices by state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EpochCounts {
    pub epoch: u32,
    pub available: u64,
    pub assigned: u64,
    pub consumed: u64,
    pub used: u64,
}

/// One consumer's share and pace (rates over the last 30 s).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConsumerRate {
    pub consumer: String,
    pub assigned: u64,
    pub consumed: u64,
    pub used: u64,
    pub samples_used: u64,
    pub slices_per_s: f64,
    pub samples_per_s: f64,
}
