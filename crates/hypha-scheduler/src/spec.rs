//! The job file a scheduler runs (`hypha-scheduler run --job job.toml`).
//!
//! ```toml
//! workers = 3          # how many workers run the executor at once; or, for a run that
//!                      # takes workers as they come: workers = { min = 2, max = 16 }
//! bid = 100.0          # the most paid per worker and lease period
//! max_attempts = 3     # how often one worker's share may be started before the job fails
//!
//! [executor]
//! class = "train"
//! name = "diloco-transformer"
//!
//! [resources]          # what each worker must offer
//! cpu = 2
//! memory = 4
//!
//! [config]             # handed to the executor as JSON ({JOB_JSON}'s "config")
//! epochs = 1
//!
//! [secrets]            # reach the worker, never an executor's argv or environment
//! hf_token = "hf_..."
//!
//! [[artifacts]]        # fetched into each worker's job directory before the executor starts
//! profile = "models"   # a profile of the worker's [artifacts.profiles] (default: "default")
//! uri = "llama/weights.safetensors"
//! destination = "model/weights.safetensors"
//!
//! [[artifacts]]
//! uri = "envs/python.tar.gz"
//! destination = "python.tar.gz"
//! unpack = { destination = "python" }   # tar, tar.gz or zip; method = "auto" by default
//!
//! [data]               # the dataset the job iterates, each slice used once per epoch
//! dataset = "digits"
//! epochs = 2
//! seed = 7             # fixes each epoch's order
//! cluster_sync = true  # the scheduler's ledger hands out every slice (the default)
//! ledger = "digits.ledger"  # default: next to the job file, named after it
//! eval = "digits-heldout"   # DiLoCo: score the global model on this held-out dataset
//!                           # (another name on the data nodes) every `eval_every` rounds
//! ```
//!
//! A DiLoCo job adds a parameter server and rounds (see [`rounds`](crate::rounds)); the
//! executors are its trainers:
//!
//! ```toml
//! [diloco]
//! rounds = 20              # stop after this many rounds (default: when the data is done)
//! samples_per_round = 4096 # over all trainers together
//! batch_size = 32
//! round_seconds = 60       # the longest a round is planned to take
//! quorum = 0.5             # after that (plus a quarter), close with this share of trainers
//! bench_after_refusals = 3 # a trainer whose updates were refused this many rounds in a row
//!                          # leaves the run for good (0: never)
//! start_grace_seconds = 60 # the first round waits this long (at most) for every trainer
//!                          # to load, from when the first was ready (0: begin at once)
//! max_update_norm_ratio = 3   # an update whose L2 norm is above 3× the round's reference
//!                             # (its lower median, at least the last rounds' typical norm)
//!                             # counts as one of 3× (clipped; the default; 0: off)
//! eval_every = 10          # with [data] eval: score every this many rounds, and the last
//! metrics = "job.metrics.jsonl"  # default: next to the job file, named after it
//! forward = "http://127.0.0.1:8080/metrics"  # also POST each metrics line there (optional)
//! inner = { learning_rate = 0.001, weight_decay = 0.01, beta1 = 0.9, beta2 = 0.999 }
//! outer = { learning_rate = 0.7, momentum = 0.9 }
//! compression = "int8"     # pseudo-gradients: "none" (default), "bf16", "int8", "topk" or
//!                          # "sparse", with error feedback (see hypha_diloco::codec)
//! topk_density = 0.01      # topk: the share of each tensor's values sent (no default)
//! sparse_density = 0.015625  # sparse: the share of each chunk of 4,096 values sent (default: 64)
//! sparse_bits = 2          # sparse: bits a value sent, 2 (default) or 4
//! sparse_decay = 0.97      # sparse: share of the residual carried on (default); with sparse
//!                          # the outer step defaults to plain SGD, { learning_rate = 1.25,
//!                          # momentum = 0.0 }, the residual being the momentum
//! overlap = true           # train on while the update travels (default false)
//! checkpoint_every = 5     # the parameter server checkpoints every 5 rounds (default: when
//!                          # its DiLoCo traffic since the last is 10× a checkpoint's size)
//! standby = true           # a second server on another worker follows every round and
//!                          # takes over at once when the server is lost (default false)
//!
//! [diloco.parameter_server]
//! bid = 50.0
//! executor = { class = "aggregate", name = "parameter-server" }
//! resources = { cpu = 1, memory = 2 }
//! ```
//!
//! Trainers' config gains `"diloco": {"batch_size", "inner", "compression", "overlap"}` and the
//! codec's keys that are set (`"topk_density"`, `"sparse_density"`, `"sparse_bits"`);
//! the parameter server's is `{"outer", "max_samples", "compression", "checkpoint_every"}` and
//! the same codec keys (it reads
//! every codec from the files themselves, and sends the global model's changes compressed with
//! the job's).
//!
//! With `[data]`, the executor's config gains `"data"`: the reference to hand the job bridge's
//! `/resources/fetch` for the next slice (`{"type": "Scheduler", "peer": …, "dataset": …}`).
//!
//! A `[config] model` of the reference executor's form (a table whose `type` is `mlp`, `cnn`
//! or `transformer`; see [`hypha_executor::model`]) is checked when the file is read, and
//! again against the dataset's manifest, with `[config] input` and `target`, before any worker
//! is leased ([`hypha_executor::contract`]). Other `[config]`s belong to other executors and
//! are passed on unread.

use std::path::{Path, PathBuf};

use hypha_dataset::Manifest;
use hypha_diloco::Codec;
use hypha_executor::{contract::TensorNames, model::ModelSpec};
pub use hypha_messages::diloco::{InnerOptimizer, OuterOptimizer};
use hypha_messages::{
    artifact,
    diloco::{Compression, ServerConfig, TrainerConfig},
    market::{ExecutorRef, Resources},
};
use serde::Deserialize;

/// A parsed job file.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobFile {
    pub workers: Workers,
    pub bid: f64,
    #[serde(default = "default_attempts")]
    pub max_attempts: u32,
    pub executor: ExecutorRef,
    #[serde(default)]
    pub resources: Resources,
    #[serde(default)]
    pub config: toml::Table,
    #[serde(default)]
    pub secrets: hypha_messages::job::Secrets,
    /// What every worker of the job fetches before its executor starts (duplicates dropped;
    /// destinations relative to the job's directory). See [`hypha_messages::artifact`].
    #[serde(default)]
    pub artifacts: Vec<artifact::Request>,
    #[serde(default)]
    pub data: Option<DataSpec>,
    #[serde(default)]
    pub diloco: Option<DilocoSpec>,
    /// The job file's name without its extension (`job` for `job.toml`; empty when parsed
    /// from text).
    #[serde(skip)]
    pub name: String,
}

/// How many workers run the executor. `workers = 3` runs three throughout (a lost one is
/// replaced). `workers = { min = 2, max = 16 }` starts once two are leased and keeps
/// advertising while fewer than 16 run: workers that come online later join the run, and one
/// that leaves is replaced only while fewer than `min` run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Workers {
    pub min: usize,
    pub max: usize,
}

impl Workers {
    /// Whether the run takes workers beyond `min` as they come.
    pub fn elastic(&self) -> bool {
        self.max > self.min
    }
}

impl std::fmt::Display for Workers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.elastic() {
            true => write!(f, "{{ min = {}, max = {} }}", self.min, self.max),
            false => write!(f, "{}", self.max),
        }
    }
}

impl<'de> Deserialize<'de> for Workers {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Range {
            min: usize,
            max: usize,
        }
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = Workers;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a number of workers (workers = 3) or a range (workers = { min = 2, max = 16 })")
            }
            fn visit_i64<E: serde::de::Error>(self, count: i64) -> Result<Workers, E> {
                let count = usize::try_from(count)
                    .map_err(|_| E::custom(format!("workers = {count}: give 1 or more")))?;
                Ok(Workers {
                    min: count,
                    max: count,
                })
            }
            fn visit_u64<E: serde::de::Error>(self, count: u64) -> Result<Workers, E> {
                self.visit_i64(i64::try_from(count).unwrap_or(-1))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<Workers, A::Error> {
                let Range { min, max } =
                    Range::deserialize(serde::de::value::MapAccessDeserializer::new(map))?;
                Ok(Workers { min, max })
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}

/// DiLoCo training: rounds, optimizers and the parameter server.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DilocoSpec {
    #[serde(default)]
    pub rounds: Option<u64>,
    pub samples_per_round: u64,
    pub batch_size: u64,
    #[serde(default = "default_round_seconds")]
    pub round_seconds: f64,
    #[serde(default = "default_quorum")]
    pub quorum: f64,
    /// A trainer whose update the parameter server refused in this many rounds in a row is
    /// benched: its lease goes back, its slices go back, it is never leased again for the
    /// task, and rounds no longer count it. 0: never.
    #[serde(default = "default_bench_after_refusals")]
    pub bench_after_refusals: u32,
    /// The run's first round begins once every leased trainer holds the model, or this long
    /// after the first did: a trainer still loading (PyTorch, CUDA) is in it, and a broken
    /// one holds the start this long at most. 0: the first round begins with the first
    /// trainer ready, the others joining as they get ready.
    #[serde(default = "default_start_grace_seconds")]
    pub start_grace_seconds: f64,
    /// An update whose L2 norm is more than this many times the round's reference norm
    /// counts as one of this many times it (clipped, `hypha_diloco::robust`): one trainer
    /// scaling its update up would otherwise move the model as far as it likes. Updates no
    /// honest trainer sends (ten times the model's norm and a thousand times the typical
    /// update's) are refused. Default [`DEFAULT_NORM_RATIO`]; 0 turns the check off.
    #[serde(default = "default_norm_ratio")]
    pub max_update_norm_ratio: f64,
    /// With `[data] eval`: the global model is scored on the held-out data every this many
    /// rounds (and the last one at the end), by one trainer as the model reaches it.
    #[serde(default = "default_eval_every")]
    pub eval_every: u64,
    /// Where trainers' reports and closed rounds are written as JSON lines.
    #[serde(default)]
    pub metrics: Option<PathBuf>,
    /// An HTTP(S) URL each metrics line is also POSTed to, as JSON (a status bridge).
    #[serde(default)]
    pub forward: Option<String>,
    #[serde(default)]
    pub inner: InnerOptimizer,
    /// The parameter server's step; unset: [`outer`](Self::outer)'s default for the codec.
    #[serde(default)]
    pub outer: Option<OuterOptimizer>,
    /// How trainers compress their pseudo-gradients (`none`, `bf16`, `int8`, `topk`,
    /// `sparse`).
    #[serde(default = "default_compression")]
    pub compression: String,
    /// For `topk`: the share of each tensor's values sent.
    #[serde(default)]
    pub topk_density: Option<f32>,
    /// For `sparse`: the share of each chunk's values sent.
    #[serde(default)]
    pub sparse_density: Option<f32>,
    /// For `sparse`: the bits of each value sent.
    #[serde(default)]
    pub sparse_bits: Option<u8>,
    /// For `sparse`: the share of a trainer's residual carried into its next update.
    #[serde(default)]
    pub sparse_decay: Option<f32>,
    /// Trainers go on training into the next round while their update is on its way and
    /// apply the outer update when it arrives (one round of delay), so that communication
    /// hides behind compute. Off by default.
    #[serde(default)]
    pub overlap: bool,
    /// The parameter server checkpoints (and sends the checkpoint here) every this many
    /// rounds. Unset: whenever the bytes of updates and models it moved since the last
    /// checkpoint reach ten times a checkpoint's size, so that checkpoints take at most a
    /// tenth of its link. A server that fails loses the rounds after its last checkpoint:
    /// their slices are trained again.
    #[serde(default)]
    pub checkpoint_every: Option<u64>,
    /// A standby parameter server, on a worker of its own leased like the server's (its
    /// `parameter_server` settings), follows the server: it takes every round's model (the
    /// change, as trainers take it) and every checkpoint the scheduler stores. When the
    /// server is lost it takes over at the round it holds, with the momentum of that
    /// checkpoint: no round is lost and no checkpoint travels at the failover (a restore
    /// from the checkpoint loses the rounds since it and sends it whole). It costs the
    /// server's link a round's change a round. Off by default.
    #[serde(default)]
    pub standby: bool,
    pub parameter_server: ServerSpec,
}

/// The outer step of a job that names none, for its `compression`: the DiLoCo paper's
/// Nesterov (learning rate 0.7, momentum 0.9), or with `sparse` plain SGD at 1.25
/// ([`hypha_diloco::codec::SPARSE_OUTER`]).
pub fn default_outer(compression: &str) -> OuterOptimizer {
    match compression {
        "sparse" => {
            let (learning_rate, momentum) = hypha_diloco::codec::SPARSE_OUTER;
            OuterOptimizer {
                learning_rate: f64::from(learning_rate),
                momentum: f64::from(momentum),
            }
        }
        _ => OuterOptimizer::default(),
    }
}

fn default_compression() -> String {
    Codec::None.name().to_string()
}

/// The worker the parameter server runs on.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerSpec {
    pub bid: f64,
    pub executor: ExecutorRef,
    #[serde(default)]
    pub resources: Resources,
}

fn default_round_seconds() -> f64 {
    60.0
}

fn default_quorum() -> f64 {
    0.5
}

/// The default `max_update_norm_ratio`. Honest updates in this project's runs came to at most
/// 1.94 times the typical norm of the last rounds (BENCHMARKS.md, "Update norms"), and the
/// round's reference is its own lower median: three times it leaves the honest spread whole,
/// and holds a liar of four trainers to a step 1.5 times an honest round's.
pub const DEFAULT_NORM_RATIO: f64 = 3.0;

fn default_norm_ratio() -> f64 {
    DEFAULT_NORM_RATIO
}

/// Scoring a held-out set as large as a tenth of what a round trains costs a third of a
/// round's compute (a forward pass of a third of a step's); every tenth round, a few percent
/// of one trainer's time.
fn default_eval_every() -> u64 {
    10
}

fn default_bench_after_refusals() -> u32 {
    3
}

/// Importing torch and starting CUDA took 10 to 30 s on the machines measured (issue 38);
/// twice the slowest, so that a slow trainer is in, and a broken one costs a minute.
fn default_start_grace_seconds() -> f64 {
    60.0
}

/// The dataset a job iterates.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataSpec {
    pub dataset: String,
    #[serde(default = "default_epochs")]
    pub epochs: u32,
    #[serde(default)]
    pub seed: u64,
    /// `true`: this scheduler's ledger hands out every slice once across all workers and data
    /// nodes. `false`: each data node hands out its own slices (`hypha-data iterate`), which
    /// is exactly-once only when one data node serves the dataset.
    #[serde(default = "default_cluster_sync")]
    pub cluster_sync: bool,
    /// Where the ledger is kept; a scheduler restarted with the same job file resumes it.
    #[serde(default)]
    pub ledger: Option<PathBuf>,
    /// A dataset held out of training (another name on the data nodes: its slices never
    /// train), on which one trainer scores the global model every `diloco.eval_every`
    /// rounds and at the end.
    #[serde(default)]
    pub eval: Option<String>,
}

fn default_epochs() -> u32 {
    1
}

fn default_cluster_sync() -> bool {
    true
}

fn default_attempts() -> u32 {
    3
}

/// A job file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error("cannot read job file {path}: {error}")]
    Read { path: String, error: std::io::Error },
    /// What is wrong in the job file, with its key, position and fix, as the config's
    /// parser and this crate's checks write it for the file's author.
    #[error("job file {path}: {message}")]
    Invalid { path: String, message: String },
}

impl JobFile {
    /// Reads a job file; a relative `data.ledger` is taken relative to the file, and an
    /// absent one becomes `{file stem}.ledger` beside it.
    pub fn load(path: &Path) -> Result<Self, SpecError> {
        let text = std::fs::read_to_string(path).map_err(|error| SpecError::Read {
            path: path.display().to_string(),
            error,
        })?;
        let mut spec = Self::parse(&path.display().to_string(), &text)?;
        let dir = path.parent().unwrap_or(Path::new(""));
        let beside = |given: Option<PathBuf>, suffix: &str| {
            dir.join(given.unwrap_or_else(|| {
                let stem = path.file_stem().unwrap_or_default().to_string_lossy();
                PathBuf::from(format!("{stem}.{suffix}"))
            }))
        };
        if let Some(data) = &mut spec.data {
            data.ledger = Some(beside(data.ledger.take(), "ledger"));
        }
        if let Some(diloco) = &mut spec.diloco {
            diloco.metrics = Some(beside(diloco.metrics.take(), "metrics.jsonl"));
        }
        spec.name = path
            .file_stem()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        Ok(spec)
    }

    /// The job as the dashboard names it.
    pub fn view(&self) -> crate::dashboard::JobView {
        crate::dashboard::JobView {
            name: self.name.clone(),
            executor: format!("{}/{}", self.executor.class, self.executor.name),
            workers: self.workers.max,
            min_workers: self.workers.min,
            diloco: self.diloco.is_some(),
            dataset: self.data.as_ref().map(|d| d.dataset.clone()),
            epochs: self.data.as_ref().map(|d| d.epochs),
            rounds: self.diloco.as_ref().and_then(|d| d.rounds),
        }
    }

    /// Parses and checks a job file; errors name the file, the line and the key.
    pub fn parse(path: &str, text: &str) -> Result<Self, SpecError> {
        let invalid = |message: String| SpecError::Invalid {
            path: path.to_string(),
            message,
        };
        let mut spec: JobFile = toml::from_str(text).map_err(|e| {
            let position = e
                .span()
                .map(|span| {
                    let line = text.as_bytes()[..span.start.min(text.len())]
                        .iter()
                        .filter(|b| **b == b'\n')
                        .count()
                        + 1;
                    format!("line {line}: ")
                })
                .unwrap_or_default();
            invalid(format!("{position}{}", e.message()))
        })?;
        let workers = spec.workers;
        if workers.min == 0 {
            return Err(invalid(format!(
                "workers = {workers}: give 1 or more (the run starts with that many)"
            )));
        }
        if workers.max < workers.min {
            return Err(invalid(format!(
                "workers = {workers}: max must be at least min"
            )));
        }
        if !spec.bid.is_finite() || spec.bid <= 0.0 {
            return Err(invalid(format!(
                "bid = {} must be a positive number",
                spec.bid
            )));
        }
        if let Some(data) = &spec.data {
            if data.dataset.is_empty() {
                return Err(invalid("data.dataset names no dataset".into()));
            }
            if data.epochs == 0 || data.epochs > hypha_ledger::MAX_EPOCHS {
                return Err(invalid(format!(
                    "data.epochs = {} is out of range: give 1 to {}",
                    data.epochs,
                    hypha_ledger::MAX_EPOCHS
                )));
            }
            if !data.cluster_sync {
                return Err(invalid(
                    "data.cluster_sync = false: this scheduler runs iterations itself; drop the key, or have executors iterate a data node with `hypha-data iterate`".into(),
                ));
            }
            match &data.eval {
                Some(eval) if eval == &data.dataset => {
                    return Err(invalid(format!(
                        "data.eval = {eval:?} is the dataset trained on: name a dataset held out of it (e.g. its last slices, prepared apart as \"{eval}-heldout\")"
                    )));
                }
                Some(eval) if eval.is_empty() => {
                    return Err(invalid(
                        "data.eval names no dataset: name the held-out one, or drop the key".into(),
                    ));
                }
                Some(_) if spec.diloco.is_none() => {
                    return Err(invalid("data.eval scores the global models of DiLoCo training: add a [diloco] section, or drop the key".into()));
                }
                _ => {}
            }
        }
        if let Some(diloco) = &spec.diloco {
            diloco.check().map_err(invalid)?;
            if spec.data.is_none() {
                return Err(invalid(
                    "[diloco] trains on a dataset: add a [data] section naming it".into(),
                ));
            }
        }
        if spec.max_attempts == 0 {
            return Err(invalid("max_attempts must be 1 or more".into()));
        }
        for (i, request) in spec.artifacts.iter().enumerate() {
            request
                .check_destinations()
                .map_err(|e| invalid(format!("artifacts[{i}]: {e}")))?;
        }
        spec.artifacts = artifact::deduplicate(std::mem::take(&mut spec.artifacts));
        spec.reference_model().map_err(invalid)?;
        for (key, value) in [
            ("resources.cpu", spec.resources.cpu),
            ("resources.memory", spec.resources.memory),
            ("resources.storage", spec.resources.storage),
            ("resources.gpu", spec.resources.gpu),
        ] {
            if !value.is_finite() || value < 0.0 {
                return Err(invalid(format!("{key} = {value} must be 0 or more")));
            }
        }
        Ok(spec)
    }

    /// A trainer's settings as JSON: the executor's config, with `data` (see
    /// [`config_json`](Self::config_json)) and, for DiLoCo jobs, `diloco`.
    pub fn trainer_config(&self, data: Option<&serde_json::Value>) -> String {
        let config = self.config_json(data);
        let Some(diloco) = &self.diloco else {
            return config;
        };
        let mut config: serde_json::Value = serde_json::from_str(&config).unwrap_or_default();
        if let Some(object) = config.as_object_mut() {
            object.insert(
                "diloco".into(),
                serde_json::to_value(diloco.trainer_config()).unwrap_or_default(),
            );
            if let Some(eval) = self.data.as_ref().and_then(|d| d.eval.as_ref()) {
                object.insert(
                    "eval".into(),
                    serde_json::json!({"type": "HeldOut", "dataset": eval}),
                );
            }
        }
        config.to_string()
    }

    /// How rounds are planned and closed, the held-out scoring included.
    pub fn plan(&self) -> Option<crate::rounds::RoundPlan> {
        let diloco = self.diloco.as_ref()?;
        let evaluates = self.data.as_ref().is_some_and(|d| d.eval.is_some());
        Some(crate::rounds::RoundPlan {
            eval_every: evaluates.then_some(diloco.eval_every),
            ..diloco.plan()
        })
    }

    /// The executor's settings as JSON, with `data` (the reference to fetch slices with)
    /// when the job iterates a dataset.
    pub fn config_json(&self, data: Option<&serde_json::Value>) -> String {
        let mut config = serde_json::to_value(&self.config).unwrap_or_default();
        if let (Some(data), Some(object)) = (data, config.as_object_mut()) {
            object.insert("data".into(), data.clone());
        }
        serde_json::to_string(&config).unwrap_or_else(|_| "{}".into())
    }

    /// The reference executor's model and tensor names, when `[config] model` is one of its
    /// families; `None` for other executors' configs.
    pub fn reference_model(&self) -> Result<Option<(ModelSpec, TensorNames)>, String> {
        let Some(model) = self.config.get("model") else {
            return Ok(None);
        };
        let family = model
            .as_table()
            .and_then(|t| t.get("type"))
            .and_then(toml::Value::as_str);
        if !matches!(family, Some("mlp" | "cnn" | "transformer")) {
            return Ok(None);
        }
        let spec: ModelSpec = model
            .clone()
            .try_into()
            .map_err(|e: toml::de::Error| format!("config.model: {}", e.message()))?;
        let name = |key: &str| match self.config.get(key) {
            None => Ok(None),
            Some(toml::Value::String(name)) => Ok(Some(name.clone())),
            Some(other) => Err(format!(
                "config.{key} = {other}: name a tensor of the slices, e.g. {key} = \"images\""
            )),
        };
        let names = TensorNames {
            input: name("input")?,
            target: name("target")?,
        };
        Ok(Some((spec, names)))
    }

    /// Whether the dataset described by `manifest` fits the job's model: the reference
    /// executor's data contract, checked for every distinct slice schema. Jobs of other
    /// executors always fit.
    pub fn check_dataset(&self, manifest: &Manifest) -> Result<(), String> {
        match self.reference_model()? {
            Some((model, names)) => {
                hypha_executor::contract::check_manifest(&model, &names, manifest)
                    .map(drop)
                    .map_err(|e| e.to_string())
            }
            None => Ok(()),
        }
    }

    /// Where the job's ledger is kept (see [`JobFile::load`]).
    pub fn ledger_path(&self) -> Option<PathBuf> {
        let data = self.data.as_ref()?;
        Some(
            data.ledger
                .clone()
                .unwrap_or_else(|| PathBuf::from(format!("{}.ledger", data.dataset))),
        )
    }
}

impl DilocoSpec {
    fn check(&self) -> Result<(), String> {
        let positive = [
            ("diloco.samples_per_round", self.samples_per_round as f64),
            ("diloco.batch_size", self.batch_size as f64),
            ("diloco.round_seconds", self.round_seconds),
            ("diloco.eval_every", self.eval_every as f64),
            ("diloco.inner.learning_rate", self.inner.learning_rate),
            ("diloco.outer.learning_rate", self.outer().learning_rate),
            ("diloco.parameter_server.bid", self.parameter_server.bid),
        ];
        for (key, value) in positive {
            if !value.is_finite() || value <= 0.0 {
                return Err(format!("{key} = {value} must be a positive number"));
            }
        }
        if self.rounds == Some(0) {
            return Err("diloco.rounds = 0: give 1 or more, or leave it out to train until the data is done".into());
        }
        let fractions = [
            ("diloco.quorum", self.quorum),
            ("diloco.outer.momentum", self.outer().momentum),
            ("diloco.inner.beta1", self.inner.beta1),
            ("diloco.inner.beta2", self.inner.beta2),
        ];
        for (key, value) in fractions {
            if !(0.0..=1.0).contains(&value) {
                return Err(format!("{key} = {value} must be between 0 and 1"));
            }
        }
        if let Some(url) = &self.forward {
            match reqwest::Url::parse(url) {
                Ok(parsed) if matches!(parsed.scheme(), "http" | "https") => {}
                _ => {
                    return Err(format!(
                        "diloco.forward = {url:?} is not an http(s) URL; write it like \"http://127.0.0.1:8080/metrics\""
                    ));
                }
            }
        }
        let grace = self.start_grace_seconds;
        if !(grace.is_finite() && (0.0..=86_400.0).contains(&grace)) {
            return Err(format!(
                "diloco.start_grace_seconds = {grace}: give the seconds the first round may wait for trainers still loading, from 0 (begin at once) to 86400 (default 60)"
            ));
        }
        if self.quorum == 0.0 {
            return Err("diloco.quorum = 0 would close rounds with nobody's update: give a share above 0, e.g. 0.5".into());
        }
        self.compression()
            .and_then(Codec::try_from)
            .map_err(|e| format!("diloco.compression = {:?}: {e}", self.compression))?;
        for (key, set, codec) in [
            ("topk_density", self.topk_density.is_some(), "topk"),
            ("sparse_density", self.sparse_density.is_some(), "sparse"),
            ("sparse_bits", self.sparse_bits.is_some(), "sparse"),
            ("sparse_decay", self.sparse_decay.is_some(), "sparse"),
        ] {
            if set && self.compression != codec {
                return Err(format!(
                    "diloco.{key} is read only with compression = {codec:?} (this job compresses with {:?}): remove it or choose {codec}",
                    self.compression
                ));
            }
        }
        if self.checkpoint_every == Some(0) {
            return Err("diloco.checkpoint_every = 0: give the rounds between checkpoints, from 1 (every round), or remove the key to checkpoint by traffic".into());
        }
        let ratio = self.max_update_norm_ratio;
        if ratio != 0.0 && !(ratio.is_finite() && ratio > 1.0) {
            return Err(format!(
                "diloco.max_update_norm_ratio = {ratio} would clip typical updates: give a ratio above 1 (default {DEFAULT_NORM_RATIO}), or 0 to turn the check off"
            ));
        }
        Ok(())
    }

    /// The parameter server's step: the job's, or [`default_outer`] for its codec.
    pub fn outer(&self) -> OuterOptimizer {
        self.outer
            .unwrap_or_else(|| default_outer(&self.compression))
    }

    /// The job's codec with the keys it set for it.
    pub fn compression(&self) -> Result<Compression, String> {
        Ok(match self.compression.as_str() {
            "none" => Compression::None,
            "bf16" => Compression::Bf16,
            "int8" => Compression::Int8,
            "topk" => Compression::Topk {
                topk_density: self.topk_density.ok_or(
                    "topk needs a density, the share of values kept: add e.g. topk_density = 0.01",
                )?,
            },
            "sparse" => Compression::Sparse {
                sparse_density: self.sparse_density,
                sparse_bits: self.sparse_bits,
                sparse_decay: self.sparse_decay,
            },
            other => {
                return Err(format!(
                    "{other:?} is not a codec: write \"none\", \"bf16\", \"int8\", \"topk\" or \"sparse\""
                ));
            }
        })
    }

    /// What the trainers are told of DiLoCo (the `diloco` key of their config).
    pub fn trainer_config(&self) -> TrainerConfig {
        TrainerConfig {
            batch_size: self.batch_size,
            inner: self.inner,
            // A job file is checked when it is read: its compression is one.
            compression: self.compression().unwrap_or_default(),
            overlap: self.overlap,
        }
    }

    /// How rounds are planned and closed.
    pub fn plan(&self) -> crate::rounds::RoundPlan {
        crate::rounds::RoundPlan {
            rounds: self.rounds,
            samples_per_round: self.samples_per_round,
            batch_size: self.batch_size,
            round_ms: (self.round_seconds * 1000.0) as u64,
            quorum: self.quorum,
            bench_after_refusals: self.bench_after_refusals,
            start_grace_ms: (self.start_grace_seconds * 1000.0) as u64,
            eval_every: None,
        }
    }

    /// The parameter server's config, for slices of at most `largest_slice` samples. An
    /// update may claim at most two rounds' planned samples and a slice (a trainer finishes
    /// the slice it reads before it syncs): more is a lie that would outweigh every honest
    /// update in the mean.
    pub fn server_config(&self, largest_slice: u64) -> ServerConfig {
        let max_samples = self
            .samples_per_round
            .saturating_mul(2)
            .saturating_add(largest_slice);
        ServerConfig {
            outer: self.outer(),
            compression: self.compression().unwrap_or_default(),
            max_samples: Some(max_samples),
            max_update_norm_ratio: (self.max_update_norm_ratio > 0.0)
                .then_some(self.max_update_norm_ratio),
            samples_per_round: Some(self.samples_per_round),
            checkpoint_every: self.checkpoint_every,
            restore: None,
            standby: false,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn a_job_file_parses_and_bad_ones_name_the_problem() {
        let spec = JobFile::parse(
            "job.toml",
            "workers = 2\nbid = 50\n[executor]\nclass = \"train\"\nname = \"x\"\n[resources]\ncpu = 1\n[config]\nsteps = 3\n",
        )
        .unwrap();
        assert_eq!(spec.workers, Workers { min: 2, max: 2 });
        assert_eq!(spec.config_json(None), r#"{"steps":3}"#);
        let err = JobFile::parse(
            "job.toml",
            "workers = 2\nbid = 50\nbdi = 3\n[executor]\nclass = \"a\"\nname = \"b\"\n",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("line 3") && err.contains("bdi"), "{err}");
        let err = JobFile::parse(
            "job.toml",
            "workers = 0\nbid = 1\n[executor]\nclass = \"a\"\nname = \"b\"\n",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("workers = 0: give 1 or more"), "{err}");
        let job = |workers: &str| {
            JobFile::parse(
                "job.toml",
                &format!("workers = {workers}\nbid = 1\n[executor]\nclass = \"a\"\nname = \"b\"\n"),
            )
        };
        let elastic = job("{ min = 2, max = 16 }").unwrap().workers;
        assert_eq!(elastic, Workers { min: 2, max: 16 });
        assert!(elastic.elastic());
        let err = job("{ min = 3, max = 2 }").unwrap_err().to_string();
        assert!(err.contains("max must be at least min"), "{err}");
        let err = job("{ min = 2, most = 4 }").unwrap_err().to_string();
        assert!(err.contains("line 1") && err.contains("most"), "{err}");
        let err = job("-1").unwrap_err().to_string();
        assert!(err.contains("workers = -1: give 1 or more"), "{err}");
        let err = job("\"many\"").unwrap_err().to_string();
        assert!(err.contains("{ min = 2, max = 16 }"), "{err}");
    }

    #[test]
    fn diloco_job_files_parse_and_bad_settings_name_their_key() {
        let base = "workers = 3\nbid = 50\n[executor]\nclass = \"train\"\nname = \"diloco\"\n[config]\nseed = 1\n[data]\ndataset = \"blobs\"\n";
        let diloco = "[diloco]\nsamples_per_round = 512\nbatch_size = 32\n[diloco.parameter_server]\nbid = 10\nexecutor = { class = \"aggregate\", name = \"parameter-server\" }\n";
        let spec = JobFile::parse("job.toml", &format!("{base}{diloco}")).unwrap();
        let d = spec.diloco.as_ref().unwrap();
        assert_eq!(
            (d.round_seconds, d.quorum, d.outer().momentum),
            (60.0, 0.5, 0.9)
        );
        let trainer: serde_json::Value = serde_json::from_str(&spec.trainer_config(None)).unwrap();
        assert_eq!(trainer["diloco"]["batch_size"], 32);
        assert_eq!(trainer["seed"], 1);
        assert_eq!(
            serde_json::to_value(d.server_config(64)).unwrap(),
            serde_json::json!({"compression": "none", "max_update_norm_ratio": 3.0, "max_samples": 1088, "samples_per_round": 512, "outer": {"learning_rate": 0.7, "momentum": 0.9}}),
            "the norm check is on by default"
        );
        assert_eq!(d.bench_after_refusals, 3);
        assert_eq!(d.plan().start_grace_ms, 60_000);
        let off = JobFile::parse(
            "job.toml",
            &format!("{base}{diloco}").replace(
                "batch_size = 32\n",
                "batch_size = 32\nmax_update_norm_ratio = 0\n",
            ),
        )
        .unwrap();
        let off = off.diloco.unwrap().server_config(64);
        assert_eq!(off.max_update_norm_ratio, None, "0 turns it off");

        let bad = |extra: &str| {
            let text = format!("{base}{diloco}")
                .replace("batch_size = 32\n", &format!("batch_size = 32\n{extra}\n"));
            JobFile::parse("job.toml", &text).unwrap_err().to_string()
        };
        assert!(bad("quorum = 1.5").contains("diloco.quorum = 1.5"));
        assert!(bad("compression = \"zip\"").contains("diloco.compression = \"zip\""));
        assert!(bad("compression = \"topk\"").contains("topk needs a density"));
        assert!(bad("compression = \"topk\"\ntopk_density = 2.0").contains("not in (0, 1]"));
        assert!(bad("topk_density = 0.1").contains("read only with compression = \"topk\""));
        assert!(bad("sparse_bits = 4").contains("read only with compression = \"sparse\""));
        assert!(
            bad("compression = \"sparse\"\nsparse_bits = 3").contains("write 2 (the default) or 4")
        );
        assert!(bad("compression = \"sparse\"\nsparse_density = 0").contains("not in (0, 1]"));
        let sparse = format!("{base}{diloco}").replace(
            "batch_size = 32\n",
            "batch_size = 32\ncompression = \"sparse\"\nsparse_bits = 4\n",
        );
        let spec = JobFile::parse("job.toml", &sparse).unwrap();
        let trainer: serde_json::Value = serde_json::from_str(&spec.trainer_config(None)).unwrap();
        assert_eq!(trainer["diloco"]["compression"], "sparse");
        assert_eq!(trainer["diloco"]["sparse_bits"], 4);
        assert!(
            trainer["diloco"].get("sparse_density").is_none(),
            "unset: the default"
        );
        let server = serde_json::to_value(spec.diloco.as_ref().unwrap().server_config(64)).unwrap();
        assert_eq!(server["sparse_bits"], 4);
        assert_eq!(
            server["outer"],
            serde_json::json!({"learning_rate": 1.25, "momentum": 0.0}),
            "sparse steps with plain SGD unless the job says otherwise"
        );
        let compressed = format!("{base}{diloco}").replace(
            "batch_size = 32\n",
            "batch_size = 32\ncompression = \"int8\"\n",
        );
        let spec = JobFile::parse("job.toml", &compressed).unwrap();
        let trainer: serde_json::Value = serde_json::from_str(&spec.trainer_config(None)).unwrap();
        assert_eq!(trainer["diloco"]["compression"], "int8");
        assert_eq!(trainer["diloco"]["overlap"], false);
        let server = serde_json::to_value(spec.diloco.as_ref().unwrap().server_config(64)).unwrap();
        assert_eq!(
            server["compression"], "int8",
            "the server compresses its changes alike"
        );
        assert!(bad("max_update_norm_ratio = 0.5").contains("diloco.max_update_norm_ratio = 0.5"));
        assert!(bad("forward = \"ftp://x\"").contains("diloco.forward"));
        assert!(bad("rounds = 0").contains("diloco.rounds = 0"));
        assert!(bad("start_grace_seconds = -1").contains("diloco.start_grace_seconds = -1"));
        let err = JobFile::parse(
            "job.toml",
            &format!("{base}{diloco}").replace("[data]\ndataset = \"blobs\"\n", ""),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("add a [data] section"), "{err}");

        // Issue 56: a held-out dataset to score the global model on.
        let with_eval = |eval: &str| {
            let text = format!("{base}{eval}\n{diloco}");
            JobFile::parse("job.toml", &text).map_err(|e| e.to_string())
        };
        let spec = with_eval("eval = \"blobs-heldout\"").unwrap();
        let trainer: serde_json::Value = serde_json::from_str(&spec.trainer_config(None)).unwrap();
        assert_eq!(
            trainer["eval"],
            serde_json::json!({"type": "HeldOut", "dataset": "blobs-heldout"})
        );
        assert_eq!(spec.plan().unwrap().eval_every, Some(10));
        assert_eq!(
            JobFile::parse("job.toml", &format!("{base}{diloco}"))
                .unwrap()
                .plan()
                .unwrap()
                .eval_every,
            None
        );
        let err = with_eval("eval = \"blobs\"").unwrap_err();
        assert!(
            err.contains("data.eval = \"blobs\" is the dataset trained on"),
            "{err}"
        );
        assert!(bad("eval_every = 0").contains("diloco.eval_every = 0"));
    }
}
