//! The config files the quickstart writes for its nodes, as typed values serialised to TOML:
//! the keys every node shares ([`NodeFile`]) and each kind's own. A path or an address is
//! written as TOML escapes it, whatever characters it holds (a `format!` with `{:?}` writes
//! Rust's escapes, which TOML does not read for every character); each node's schema still
//! checks the file as it loads, so a key that drifts from the node's fails the quickstart's
//! test.

use std::path::PathBuf;

use serde::Serialize;

/// A node's config file: its certificate, key and trust (relative to the quickstart's
/// directory, where the nodes run), where it listens, the gateway it joins (none for the
/// gateway itself), and `own`, the keys of its kind.
#[derive(Debug, Serialize)]
pub(super) struct NodeFile<T> {
    pub cert_pem: String,
    pub key_pem: String,
    pub trust_pem: String,
    pub listen_addresses: Vec<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub gateway_addresses: Vec<String>,
    #[serde(flatten)]
    pub own: T,
}

/// The gateway and the scheduler: no keys of their own here.
#[derive(Debug, Serialize)]
pub(super) struct NoKeys {}

/// A data node's: the directory of datasets it serves.
#[derive(Debug, Serialize)]
pub(super) struct DataKeys {
    pub dataset_path: PathBuf,
}

/// A worker's: its work directory, what it offers at which price, and its executors.
#[derive(Debug, Serialize)]
pub(super) struct WorkerKeys {
    pub work_dir: PathBuf,
    pub resources: Resources,
    pub offer: Offer,
    pub executors: Vec<Executor>,
}

#[derive(Debug, Serialize)]
pub(super) struct Resources {
    pub cpu: f64,
    pub memory: f64,
}

#[derive(Debug, Serialize)]
pub(super) struct Offer {
    pub price: f64,
}

/// One `[[executors]]` entry: the built-in parameter server, or a process.
#[derive(Debug, Clone, Serialize)]
pub(super) struct Executor {
    pub class: &'static str,
    pub name: &'static str,
    pub runtime: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cmd: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
}

impl Executor {
    /// The built-in parameter server (`aggregate/parameter-server`).
    pub(super) fn parameter_server() -> Self {
        Executor {
            class: "aggregate",
            name: "parameter-server",
            runtime: "parameter-server",
            cmd: None,
            args: Vec::new(),
            env: Vec::new(),
        }
    }

    /// A DiLoCo trainer (`train/diloco`) run as `cmd` with `args` before the bridge's
    /// socket, work directory and job, and `env`.
    pub(super) fn trainer(cmd: String, first_args: &[String], env: Vec<String>) -> Self {
        let bridge = [
            "--socket",
            "{SOCKET_PATH}",
            "--work-dir",
            "{WORK_DIR}",
            "--job",
            "{JOB_JSON}",
        ];
        Executor {
            class: "train",
            name: "diloco",
            runtime: "process",
            cmd: Some(cmd),
            args: first_args
                .iter()
                .cloned()
                .chain(bridge.iter().map(|a| a.to_string()))
                .collect(),
            env,
        }
    }
}

/// The quickstart's DiLoCo job (docs/diloco.md): its trainers and their model, the data
/// and its held-out part, the rounds, and the parameter server. The scheduler's own job
/// schema (`hypha_scheduler::spec::JobFile`, which denies unknown keys) checks it as it loads.
#[derive(Debug, Serialize)]
pub(super) struct JobFile<'a> {
    pub workers: usize,
    pub bid: f64,
    pub executor: ExecutorName,
    pub resources: JobResources,
    pub config: ModelConfig<'a>,
    pub data: JobData<'a>,
    pub diloco: Diloco,
}

/// An executor a job asks for, by class and name.
#[derive(Debug, Serialize)]
pub(super) struct ExecutorName {
    pub class: &'static str,
    pub name: &'static str,
}

/// What each of the job's workers must offer.
#[derive(Debug, Serialize)]
pub(super) struct JobResources {
    pub cpu: f64,
}

/// The reference trainer's `[config]`: the model, its seed, and the dataset's tensors it
/// reads (none: the dataset's own).
#[derive(Debug, Serialize)]
pub(super) struct ModelConfig<'a> {
    pub seed: u64,
    pub model: &'a hypha_executor::model::ModelSpec,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub input: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target: Option<&'a str>,
}

/// `[data]`: the dataset trained on, the held-out one scored, epochs and their order's seed.
#[derive(Debug, Serialize)]
pub(super) struct JobData<'a> {
    pub dataset: &'a str,
    pub eval: &'a str,
    pub epochs: u64,
    pub seed: u64,
}

/// `[diloco]`: rounds, the trainers' inner step and the parameter server.
#[derive(Debug, Serialize)]
pub(super) struct Diloco {
    pub rounds: u64,
    pub eval_every: u64,
    pub samples_per_round: u64,
    pub batch_size: usize,
    pub round_seconds: f64,
    pub compression: String,
    pub overlap: bool,
    pub inner: InnerOptimizer,
    pub parameter_server: ParameterServer,
}

/// The trainers' AdamW.
#[derive(Debug, Serialize)]
pub(super) struct InnerOptimizer {
    pub learning_rate: f64,
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
}

/// `[diloco.parameter_server]`: what it is paid and which executor runs it.
#[derive(Debug, Serialize)]
pub(super) struct ParameterServer {
    pub bid: f64,
    pub executor: ExecutorName,
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// A path with a quote, a backslash and a control character reads back as it was.
    #[test]
    fn a_path_of_any_characters_reads_back_whole() {
        let odd = PathBuf::from("/tmp/a \"b\" \\c\u{1b}d\u{ad}e/work");
        let file = NodeFile {
            cert_pem: "certs/w-cert.pem".into(),
            key_pem: "certs/w-key.pem".into(),
            trust_pem: "certs/root.pem".into(),
            listen_addresses: vec!["/ip4/127.0.0.1/tcp/0".into()],
            gateway_addresses: vec!["/ip4/127.0.0.1/tcp/4001/p2p/12D3KooW".into()],
            own: WorkerKeys {
                work_dir: odd.clone(),
                resources: Resources {
                    cpu: 1.0,
                    memory: 1.0,
                },
                offer: Offer { price: 1.0 },
                executors: vec![
                    Executor::parameter_server(),
                    Executor::trainer("python3".into(), &["t.py".into()], vec!["A=b".into()]),
                ],
            },
        };
        let text = toml::to_string(&file).unwrap();
        let read: toml::Table = toml::from_str(&text).unwrap();
        assert_eq!(read["work_dir"].as_str(), odd.to_str(), "{text}");
        let executors = read["executors"].as_array().unwrap();
        assert_eq!(executors.len(), 2, "{text}");
        assert!(executors[0].get("cmd").is_none(), "{text}");
        assert_eq!(executors[1]["args"][0].as_str(), Some("t.py"));
        assert_eq!(executors[1]["args"][2].as_str(), Some("{SOCKET_PATH}"));
        assert_eq!(
            read["gateway_addresses"][0].as_str(),
            Some("/ip4/127.0.0.1/tcp/4001/p2p/12D3KooW")
        );
    }
}
