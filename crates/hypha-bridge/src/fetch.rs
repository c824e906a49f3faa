//! `POST /resources/fetch` and `POST /data/consumed`: where resources come from, and what a
//! job tells the ledger about the slices it read.

use hypha_messages::{artifact, iterate::SliceRef};
use schemars::JsonSchema;
use serde::{Deserialize, Deserializer, Serialize, de::Error as _};

use crate::{dialect, peers::Peers};

/// Where fetched files go when the request names no directory: the upstream executors'
/// choice, so that their bare-reference fetches land where they look.
pub const DEFAULT_FETCH_DIR: &str = "artifacts";

/// Where a resource comes from. `type` is also read in lower case (`uri`, `peers`, …), and
/// `Url` for `Uri`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "type")]
#[schemars(transform = dialect::lower_case_tags)]
pub enum Reference {
    /// One HTTP(S) download, named after the URL's last path segment.
    #[serde(alias = "uri", alias = "Url", alias = "url")]
    Uri { value: String },
    /// Files of a Hugging Face repository, through the Hub's HTTP file API
    /// (`{HF_ENDPOINT}/{repository}/resolve/{revision}/{filename}`). The token is `token`,
    /// else the job's secret `hf_token`, else the worker's `HF_TOKEN`.
    #[serde(alias = "huggingface")]
    HuggingFace {
        repository: String,
        /// Default `main`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        revision: Option<String>,
        filenames: Vec<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        token: Option<String>,
    },
    /// Files other jobs of the task sent. `All` with peers listed waits for one file from
    /// each; otherwise the first file from any of them (from anyone when the list is empty).
    #[serde(alias = "peers")]
    Peers(Peers),
    /// The next slice of the job's dataset, from the iteration its scheduler runs: the `data`
    /// reference the scheduler puts in the job's config. One entry,
    /// `{out_dir}/e{epoch}-slice-{slice}.safetensors`, with `epoch`, `slice` and `samples` in
    /// its metadata; `[]` when the iteration is done.
    #[serde(alias = "scheduler")]
    Scheduler(SchedulerReference),
    /// Every slice of a dataset held out of training, to score models on: fetched from the
    /// data nodes that announce it (verified against their manifest's BLAKE3), in slice
    /// order, as `{out_dir}/heldout-{slice}.safetensors` (plain SafeTensors) with `slice` and
    /// `samples` in their metadata. No ledger hears of them: they are not an iteration.
    #[serde(alias = "held_out", alias = "heldout")]
    HeldOut { dataset: String },
    /// An object (or, with `kind = "prefix"`, every object under a prefix) of one of the
    /// worker's artifact origins, fetched peer to peer with the other workers that need it,
    /// placed at `out_dir/{last segment of uri}`; `unpack` also unpacks an archive into
    /// `out_dir/{name without .tar, .tar.gz, .tgz, .zip}`.
    #[serde(alias = "artifact")]
    Artifact {
        /// One of the worker's `[artifacts.profiles]`.
        #[serde(default = "default_profile")]
        profile: String,
        uri: String,
        #[serde(default)]
        kind: artifact::Kind,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        unpack: Option<artifact::UnpackMethod>,
    },
}

fn default_profile() -> String {
    artifact::DEFAULT_PROFILE.to_string()
}

fn default_fetch_dir() -> String {
    DEFAULT_FETCH_DIR.to_string()
}

/// Where a job's slices come from: the reference the scheduler hands its executors.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct SchedulerReference {
    /// The scheduler's peer id.
    pub peer: String,
    pub dataset: String,
    /// 0: whatever the scheduler's iteration runs.
    #[serde(default)]
    pub epochs: u32,
    #[serde(default)]
    pub seed: u64,
}

/// Seed 003's fetch request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct FetchRequest {
    pub fetch: Reference,
    /// Relative to the job's directory; created when missing. Default `artifacts`.
    #[serde(default = "default_fetch_dir")]
    pub out_dir: String,
    /// How long to wait. Scheduler references: for a slice while none is free (all are held
    /// by running jobs); then the answer is 503 with code `data_wait`, and asking again later
    /// may get one. Peers references: for the files; then the answer lists those that arrived
    /// by then, `[]` when none did. Without it the request waits until a slice is free or the
    /// iteration is done, or until the files came.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait_ms: Option<u64>,
}

/// The body of `POST /resources/fetch`, in either dialect.
#[derive(Debug, Clone, PartialEq, Eq, JsonSchema)]
#[serde(untagged)]
pub enum FetchBody {
    /// Seed 003's: the reference under `fetch`, with `out_dir` and `wait_ms` beside it.
    Request(FetchRequest),
    /// The upstream client's: the reference alone; files go to `artifacts`.
    Bare(Reference),
}

impl From<FetchBody> for FetchRequest {
    fn from(body: FetchBody) -> Self {
        match body {
            FetchBody::Request(request) => request,
            FetchBody::Bare(reference) => FetchRequest {
                fetch: reference,
                out_dir: default_fetch_dir(),
                wait_ms: None,
            },
        }
    }
}

impl<'de> Deserialize<'de> for FetchBody {
    /// Told apart by their keys, so that a mistake in either is reported as that shape's own
    /// error, not as "matches no variant".
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let value = serde_json::Value::deserialize(deserializer)?;
        let has = |key: &str| value.get(key).is_some();
        if has("fetch") {
            FetchRequest::deserialize(value)
                .map(FetchBody::Request)
                .map_err(D::Error::custom)
        } else if has("type") {
            // A bare reference names no directory and no wait: settings beside it would be
            // silently ignored.
            if let Some(key) = ["out_dir", "wait_ms"].into_iter().find(|key| has(key)) {
                return Err(D::Error::custom(format!(
                    "\"{key}\" beside a bare reference is not read: write {{\"fetch\": <reference>, \"{key}\": …}}"
                )));
            }
            Reference::deserialize(value)
                .map(FetchBody::Bare)
                .map_err(D::Error::custom)
        } else {
            Err(D::Error::custom(
                "expected {\"fetch\": <reference>, \"out_dir\": …} or a bare reference such as {\"type\": \"uri\", \"value\": \"https://…\"}",
            ))
        }
    }
}

/// `POST /data/consumed`: the slices read to their end went into `round`; or, for jobs
/// without a parameter server, `completed_round` reached the model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ConsumedRequest {
    #[serde(default)]
    pub slices: Vec<SliceRef>,
    #[serde(default)]
    pub round: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completed_round: Option<u64>,
    /// The reference the slices came from: the job's `data`, a `Scheduler` reference.
    pub data: Reference,
}

/// The answer to `POST /data/consumed`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ConsumedAnswer {
    /// Slices the job may not count: it held them too long, another job has them now.
    pub refused: Vec<SliceRef>,
}
