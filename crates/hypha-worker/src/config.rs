//! The worker's settings: which keys it accepts and what they mean once checked.

use std::{collections::BTreeMap, path::PathBuf, time::Duration};

use hypha_artifacts::Profile;
use hypha_config::{ConfigError, DefaultValue, Key, Kind, Loaded, Schema, network, telemetry};
use hypha_messages::market::{ExecutorRef, Resources};
use serde::Deserialize;

use crate::arbiter::{Pricing, Strategy};

static RESOURCE_KEYS: [Key; 4] = [
    Key {
        name: "cpu",
        kind: Kind::Float,
        default: DefaultValue::Value("1"),
        doc: "CPU cores offered to jobs.",
    },
    Key {
        name: "memory",
        kind: Kind::Float,
        default: DefaultValue::Value("1"),
        doc: "Memory offered to jobs, in GB.",
    },
    Key {
        name: "storage",
        kind: Kind::Float,
        default: DefaultValue::Value("10"),
        doc: "Disk space under work_dir offered to jobs, in GB.",
    },
    Key {
        name: "gpu",
        kind: Kind::Float,
        default: DefaultValue::Value("0"),
        doc: "GPU memory offered to jobs, in GB.",
    },
];

static OFFER_KEYS: [Key; 6] = [
    Key {
        name: "price",
        kind: Kind::Float,
        default: DefaultValue::Value("100.0"),
        doc: "The ask for the whole worker per lease period. `whole` offers at max(bid, price); `flexible` needs bid >= price x the largest share of any resource asked.",
    },
    Key {
        name: "floor",
        kind: Kind::Float,
        default: DefaultValue::Value("0.0"),
        doc: "The hard minimum bid: advertisements bidding less are dropped without an answer.",
    },
    Key {
        name: "strategy",
        kind: Kind::String,
        default: DefaultValue::Value(r#""flexible""#),
        doc: "\"flexible\": offer exactly the resources asked at the bid, several jobs at once. \"whole\": offer all resources as one unit at max(bid, price), one scheduler at a time.",
    },
    Key {
        name: "window_ms",
        kind: Kind::Integer,
        default: DefaultValue::Value("50"),
        doc: "How long advertisements are collected before they are evaluated together, so that competing schedulers are compared rather than served first come.",
    },
    Key {
        name: "hold_ms",
        kind: Kind::Integer,
        default: DefaultValue::Value("5000"),
        doc: "How long resources stay reserved for an open offer; the scheduler must accept within this time.",
    },
    Key {
        name: "lease_ms",
        kind: Kind::Integer,
        default: DefaultValue::Value("10000"),
        doc: "How long an accepted lease lasts without renewal. A job whose lease lapses is stopped and its resources freed, so a vanished scheduler holds a worker for at most this long.",
    },
];

static BRIDGE_KEYS: [Key; 1] = [Key {
    name: "download_read_timeout_ms",
    kind: Kind::Integer,
    default: DefaultValue::Value("60000"),
    doc: "How long a download an executor asks for (`/resources/fetch` of a URL or a Hugging Face file) may receive nothing, headers included, before it fails: a server that stops sending does not hold the request for ever.",
}];

static EXECUTOR_KEYS: [Key; 6] = [
    Key {
        name: "class",
        kind: Kind::String,
        default: DefaultValue::Required {
            example: r#""train""#,
        },
        doc: "The job category schedulers ask for: train, inference, aggregate, ...",
    },
    Key {
        name: "name",
        kind: Kind::String,
        default: DefaultValue::Required {
            example: r#""diloco-transformer""#,
        },
        doc: "The executor variant schedulers ask for.",
    },
    Key {
        name: "runtime",
        kind: Kind::String,
        default: DefaultValue::Required {
            example: r#""process""#,
        },
        doc: "\"process\" runs cmd with args; \"parameter-server\" is built in and takes no cmd.",
    },
    Key {
        name: "cmd",
        kind: Kind::String,
        default: DefaultValue::Unset {
            example: r#""python3""#,
        },
        doc: "The program a process executor runs: a name looked up in PATH, or an absolute path.",
    },
    Key {
        name: "args",
        kind: Kind::StringList,
        default: DefaultValue::Value("[]"),
        doc: "Its arguments; {SOCKET_PATH}, {WORK_DIR} and {JOB_JSON} are replaced by the job's bridge socket, work directory and specification (JSON, without secrets).",
    },
    Key {
        name: "env",
        kind: Kind::StringList,
        default: DefaultValue::Value("[]"),
        doc: "Its environment besides PATH, HOME, USER, LOGNAME, LANG, LC_ALL, TZ and TMPDIR: \"NAME\" passes the worker's variable, \"NAME=value\" sets one. Nothing else of the worker's environment (HF_TOKEN, cloud credentials) reaches an executor.",
    },
];

static PROFILE_KEYS: [Key; 2] = [
    Key {
        name: "url",
        kind: Kind::String,
        default: DefaultValue::Required {
            example: r#""s3://bucket/prefix""#,
        },
        doc: "The store and the path under it that artifact URIs are relative to: s3://, gs://, az:// (or abfs://), http(s)://, file:///.",
    },
    Key {
        name: "options",
        kind: Kind::StringMap,
        default: DefaultValue::Value("{}"),
        doc: "object_store options: aws_access_key_id, aws_secret_access_key, aws_region, aws_endpoint, aws_allow_http, google_service_account, azure_storage_account_name, ... Unset ones come from AWS_*, GOOGLE_*, AZURE_* variables.",
    },
];

static ARTIFACT_KEYS: [Key; 11] = [
    Key {
        name: "dir",
        kind: Kind::Path,
        default: DefaultValue::Unset {
            example: r#""/var/hypha/artifacts""#,
        },
        doc: "Where fetched artifacts and their cache index live; job directories get copies (copy-on-write clones where the file system has them). Default: work_dir/.artifacts.",
    },
    Key {
        name: "chunk_bytes",
        kind: Kind::Integer,
        default: DefaultValue::Unset {
            example: "16777216",
        },
        doc: "Bytes per chunk. Default: about 256 chunks per artifact, within 1-64 MiB. Nodes share chunks only with nodes using the same size.",
    },
    Key {
        name: "download_slots",
        kind: Kind::Integer,
        default: DefaultValue::Value("8"),
        doc: "Chunks this node receives at once, from the origin and from peers together.",
    },
    Key {
        name: "upload_slots",
        kind: Kind::Integer,
        default: DefaultValue::Value("8"),
        doc: "Chunks this node sends to peers at once; further requests are answered busy.",
    },
    Key {
        name: "origin_connections",
        kind: Kind::Integer,
        default: DefaultValue::Value("16"),
        doc: "Origin connections of all nodes fetching one artifact together; each of n nodes opens at most max(1, this / n).",
    },
    Key {
        name: "join_timeout_ms",
        kind: Kind::Integer,
        default: DefaultValue::Value("10000"),
        doc: "The longest a fetch that expects other nodes waits for them before it reads from the origin or from peers.",
    },
    Key {
        name: "origin_audit",
        kind: Kind::Float,
        default: DefaultValue::Value("0.0"),
        doc: "The share of an artifact's chunks (0-1) this node reads from the origin although peers hold them, to check the hashes other members announced. A member lying about chunks that were its own to read is caught with probability 1 - (1 - share)^(n - 1); the origin sends about 1 + share x (n - 1) times the artifact. 0 (the default): each chunk leaves the origin once; 1: take no member's word.",
    },
    Key {
        name: "stall_patience_ms",
        kind: Kind::Integer,
        default: DefaultValue::Value("60000"),
        doc: "How long this node, receiving nothing, waits on chunks whose holders do not send them, or on a member whose turn it is to read chunks from the origin and that reads nothing, before the next member in turn reads those chunks from the origin. Raise it on links where one chunk takes longer than this to arrive.",
    },
    Key {
        name: "max_unpacked_bytes",
        kind: Kind::Integer,
        default: DefaultValue::Value("68719476736"),
        doc: "The most bytes one archive may unpack to (64 GiB); never more than the file system has free, less 1 GiB. A larger archive fails before it fills the disk.",
    },
    Key {
        name: "max_unpacked_entries",
        kind: Kind::Integer,
        default: DefaultValue::Value("1000000"),
        doc: "The most files, directories and links one archive may unpack to.",
    },
    Key {
        name: "profiles",
        kind: Kind::Map(&PROFILE_KEYS),
        default: DefaultValue::Value("{}"),
        doc: "Named origins; requests name one with profile = \"NAME\" (default: \"default\").",
    },
];

/// Every key a worker accepts.
pub fn schema() -> Schema {
    let mut keys = network::keys();
    keys.extend(telemetry::keys());
    keys.extend([
        Key {
            name: "work_dir",
            kind: Kind::Path,
            default: DefaultValue::Required {
                example: r#""/var/hypha/work""#,
            },
            doc: "Where jobs run: each gets a directory hypha-{uuid} (mode 0700) with its bridge socket and logs. Created if missing.",
        },
        Key {
            name: "kill_grace_ms",
            kind: Kind::Integer,
            default: DefaultValue::Value("5000"),
            doc: "How long a cancelled executor has between SIGTERM and SIGKILL.",
        },
        Key {
            name: "prefetch_bytes",
            kind: Kind::Integer,
            default: DefaultValue::Value("1073741824"),
            doc: "How many bytes of verified slices each job keeps ready ahead of its executor (at least one slice, whatever its size).",
        },
        Key {
            name: "slice_cache_bytes",
            kind: Kind::Integer,
            default: DefaultValue::Value("10737418240"),
            doc: "The size of the worker's slice cache (work_dir/.slices): slices kept for later epochs and jobs, least recently used first out.",
        },
        Key {
            name: "resources",
            kind: Kind::Table(&RESOURCE_KEYS),
            default: DefaultValue::Value("{}"),
            doc: "What this worker offers to schedulers.",
        },
        Key {
            name: "offer",
            kind: Kind::Table(&OFFER_KEYS),
            default: DefaultValue::Value("{}"),
            doc: "How this worker prices and bundles its resources.",
        },
        Key {
            name: "artifacts",
            kind: Kind::Table(&ARTIFACT_KEYS),
            default: DefaultValue::Value("{}"),
            doc: "Artifacts (weights, environments, archives) jobs and `hypha-worker fetch` bring in: each chunk read from the origin by one node and shared peer to peer.",
        },
        Key {
            name: "bridge",
            kind: Kind::Table(&BRIDGE_KEYS),
            default: DefaultValue::Value("{}"),
            doc: "What the bridge does for executors beyond the network: downloads.",
        },
        Key {
            name: "executors",
            kind: Kind::TableArray(&EXECUTOR_KEYS),
            default: DefaultValue::Value("[]"),
            doc: "The executors this worker runs; a worker only answers advertisements for one of them.",
        },
    ]);
    Schema::new("hypha-worker", keys)
}

/// How an executor runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Runtime {
    /// A program, started once per job, with the environment `env` allows.
    Process {
        cmd: String,
        args: Vec<String>,
        env: Vec<EnvVar>,
    },
    /// The built-in DiLoCo parameter server.
    ParameterServer,
}

/// One configured executor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Executor {
    pub executor: ExecutorRef,
    pub runtime: Runtime,
}

/// One entry of an executor's `env`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EnvVar {
    /// The worker's own value, if it has one.
    Pass(String),
    Set(String, String),
}

impl EnvVar {
    fn parse(entry: &str) -> Option<Self> {
        let (name, value) = match entry.split_once('=') {
            Some((name, value)) => (name, Some(value)),
            None => (entry, None),
        };
        let valid = name.chars().next().is_some_and(|c| !c.is_ascii_digit())
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
            && !value.is_some_and(|v| v.contains('\0'));
        valid.then(|| match value {
            Some(value) => EnvVar::Set(name.to_string(), value.to_string()),
            None => EnvVar::Pass(name.to_string()),
        })
    }
}

/// A worker's checked settings.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    pub work_dir: PathBuf,
    pub capacity: Resources,
    pub pricing: Pricing,
    pub window: Duration,
    pub hold: Duration,
    pub lease: Duration,
    pub kill_grace: Duration,
    pub executors: Vec<Executor>,
    pub prefetch_bytes: u64,
    pub slice_cache_bytes: u64,
    pub artifacts: ArtifactsConfig,
    /// How long an executor's download may receive nothing.
    pub download_read_timeout: Duration,
}

/// The `[artifacts]` section, checked.
#[derive(Debug, Clone)]
pub struct ArtifactsConfig {
    /// Holds the fetched artifacts and their cache index.
    pub dir: PathBuf,
    pub settings: hypha_artifacts::Settings,
    pub profiles: BTreeMap<String, Profile>,
}

#[derive(Debug, Deserialize)]
struct Raw {
    work_dir: PathBuf,
    kill_grace_ms: i64,
    prefetch_bytes: i64,
    slice_cache_bytes: i64,
    resources: Resources,
    offer: RawOffer,
    artifacts: RawArtifacts,
    bridge: RawBridge,
    #[serde(default)]
    executors: Vec<RawExecutor>,
}

#[derive(Debug, Deserialize)]
struct RawBridge {
    download_read_timeout_ms: i64,
}

#[derive(Debug, Deserialize)]
struct RawOffer {
    price: f64,
    floor: f64,
    strategy: String,
    window_ms: i64,
    hold_ms: i64,
    lease_ms: i64,
}

#[derive(Debug, Deserialize)]
struct RawArtifacts {
    dir: Option<PathBuf>,
    chunk_bytes: Option<i64>,
    download_slots: i64,
    upload_slots: i64,
    origin_connections: i64,
    join_timeout_ms: i64,
    origin_audit: f64,
    stall_patience_ms: i64,
    max_unpacked_bytes: i64,
    max_unpacked_entries: i64,
    profiles: BTreeMap<String, Profile>,
}

#[derive(Debug, Deserialize)]
struct RawExecutor {
    class: String,
    name: String,
    runtime: String,
    cmd: Option<String>,
    #[serde(default)]
    args: Vec<String>,
    #[serde(default)]
    env: Vec<String>,
}

impl WorkerConfig {
    /// Checks the worker's keys in `loaded`; every error names the key and the fix.
    pub fn from_loaded(loaded: &Loaded) -> Result<Self, ConfigError> {
        let raw: Raw = loaded.section()?;
        for (key, value) in [
            ("resources.cpu", raw.resources.cpu),
            ("resources.memory", raw.resources.memory),
            ("resources.storage", raw.resources.storage),
            ("resources.gpu", raw.resources.gpu),
            ("offer.price", raw.offer.price),
            ("offer.floor", raw.offer.floor),
        ] {
            if !value.is_finite() || value < 0.0 {
                return Err(loaded.error(
                    key,
                    format!("{value} is negative or not a number"),
                    "use 0 or a positive number",
                ));
            }
        }
        let strategy = match raw.offer.strategy.as_str() {
            "whole" => Strategy::Whole,
            "flexible" => Strategy::Flexible,
            other => {
                return Err(loaded.error(
                    "offer.strategy",
                    format!("{other:?} is not a strategy"),
                    "use \"whole\" or \"flexible\"",
                ));
            }
        };
        let artifacts = artifacts_config(loaded, raw.artifacts, &raw.work_dir)?;
        let hold = millis(loaded, "offer.hold_ms", raw.offer.hold_ms)?;
        let lease = millis(loaded, "offer.lease_ms", raw.offer.lease_ms)?;
        let executors = executors(loaded, raw.executors)?;
        Ok(WorkerConfig {
            work_dir: raw.work_dir,
            capacity: raw.resources,
            pricing: Pricing {
                price: raw.offer.price,
                floor: raw.offer.floor,
                strategy,
            },
            window: millis(loaded, "offer.window_ms", raw.offer.window_ms)?,
            hold,
            lease,
            kill_grace: millis(loaded, "kill_grace_ms", raw.kill_grace_ms)?,
            executors,
            prefetch_bytes: bytes(loaded, "prefetch_bytes", raw.prefetch_bytes)?,
            slice_cache_bytes: bytes(loaded, "slice_cache_bytes", raw.slice_cache_bytes)?,
            artifacts,
            download_read_timeout: millis(
                loaded,
                "bridge.download_read_timeout_ms",
                raw.bridge.download_read_timeout_ms,
            )?,
        })
    }
}

/// `value` as a positive number of milliseconds, or the error naming `key`.
fn millis(loaded: &Loaded, key: &str, value: i64) -> Result<Duration, ConfigError> {
    u64::try_from(value)
        .ok()
        .filter(|v| *v > 0)
        .map(Duration::from_millis)
        .ok_or_else(|| {
            loaded.error(
                key,
                format!("{value} is not a positive number of milliseconds"),
                "use a duration of 1 ms or more",
            )
        })
}

/// `value` as a positive number of bytes, or the error naming `key`.
fn bytes(loaded: &Loaded, key: &str, value: i64) -> Result<u64, ConfigError> {
    u64::try_from(value).ok().filter(|v| *v > 0).ok_or_else(|| {
        loaded.error(
            key,
            format!("{value} is not a positive number of bytes"),
            "use a size of 1 byte or more",
        )
    })
}

/// `value` as a positive count, or the error naming `key`.
fn count(loaded: &Loaded, key: &str, value: i64) -> Result<usize, ConfigError> {
    usize::try_from(value)
        .ok()
        .filter(|v| *v > 0)
        .ok_or_else(|| {
            loaded.error(
                key,
                format!("{value} is not a positive count"),
                "use 1 or more",
            )
        })
}

/// The `[artifacts]` table checked: sizes, counts and durations positive, the audit share
/// a share, and the store beside the work directory `work_dir` unless it names its own.
fn artifacts_config(
    loaded: &Loaded,
    raw: RawArtifacts,
    work_dir: &std::path::Path,
) -> Result<ArtifactsConfig, ConfigError> {
    let artifacts = ArtifactsConfig {
        dir: raw.dir.unwrap_or_else(|| work_dir.join(".artifacts")),
        settings: hypha_artifacts::Settings {
            chunk_size: raw
                .chunk_bytes
                .map(|v| bytes(loaded, "artifacts.chunk_bytes", v))
                .transpose()?,
            download_slots: count(loaded, "artifacts.download_slots", raw.download_slots)?,
            upload_slots: count(loaded, "artifacts.upload_slots", raw.upload_slots)?,
            origin_connections: count(
                loaded,
                "artifacts.origin_connections",
                raw.origin_connections,
            )?,
            join_timeout: millis(loaded, "artifacts.join_timeout_ms", raw.join_timeout_ms)?,
            stall_patience: millis(
                loaded,
                "artifacts.stall_patience_ms",
                raw.stall_patience_ms,
            )?,
            origin_audit: Some(raw.origin_audit)
                .filter(|share| (0.0..=1.0).contains(share))
                .ok_or_else(|| {
                    loaded.error(
                        "artifacts.origin_audit",
                        format!("{} is not a share between 0 and 1", raw.origin_audit),
                        "use 0 (the default: no audit), 0.02 to check 2% of the chunks, or 1 to read every chunk from the origin",
                    )
                })?,
            unpack_limits: hypha_artifacts::unpack::Limits {
                bytes: bytes(
                    loaded,
                    "artifacts.max_unpacked_bytes",
                    raw.max_unpacked_bytes,
                )?,
                entries: count(
                    loaded,
                    "artifacts.max_unpacked_entries",
                    raw.max_unpacked_entries,
                )? as u64,
            },
            ..hypha_artifacts::Settings::default()
        },
        profiles: raw.profiles,
    };
    // Build every origin now, so that a bad url or option is reported at start with its key.
    for (name, profile) in &artifacts.profiles {
        if let Err(e) = hypha_artifacts::Origin::new(name, profile) {
            return Err(loaded.error(
                &format!("artifacts.profiles.{name}"),
                e.to_string(),
                "fix the url or the option (object_store's config key names), or remove the profile",
            ));
        }
    }
    Ok(artifacts)
}

/// The `[[executors]]` checked: each once, a process with a command, the built-in parameter
/// server without one, environment entries that name a variable.
fn executors(loaded: &Loaded, raw: Vec<RawExecutor>) -> Result<Vec<Executor>, ConfigError> {
    let mut executors: Vec<Executor> = Vec::new();
    for (i, e) in raw.into_iter().enumerate() {
        let key = format!("executors[{i}]");
        let executor = ExecutorRef {
            class: e.class,
            name: e.name,
        };
        if executors.iter().any(|known| known.executor == executor) {
            return Err(loaded.error(
                &key,
                format!("executor {executor} is configured twice"),
                "give each [[executors]] entry its own class and name",
            ));
        }
        let mut env = Vec::new();
        for (j, entry) in e.env.iter().enumerate() {
            env.push(EnvVar::parse(entry).ok_or_else(|| {
                // The value may be a credential: only the name is shown.
                let shown = match entry.split_once('=') {
                    Some((name, _)) => format!("{name:?}=…"),
                    None => format!("{entry:?}"),
                };
                loaded.error(
                    &format!("{key}.env[{j}]"),
                    format!("{shown} is not NAME or NAME=value"),
                    "name a variable (letters, digits, _; not starting with a digit), optionally with =value",
                )
            })?);
        }
        let runtime = match (e.runtime.as_str(), e.cmd) {
            ("process", Some(cmd)) if !cmd.trim().is_empty() => Runtime::Process {
                cmd,
                args: e.args,
                env,
            },
            ("process", _) => {
                return Err(loaded.error(
                    &key,
                    format!("process executor {executor} has no cmd"),
                    "add cmd = \"program\" (and args = [...]) to this [[executors]] entry",
                ));
            }
            ("parameter-server", None) => Runtime::ParameterServer,
            ("parameter-server", Some(_)) => {
                return Err(loaded.error(
                    &key,
                    "the parameter-server runtime is built in and takes no cmd",
                    "remove cmd and args from this [[executors]] entry",
                ));
            }
            (other, _) => {
                return Err(loaded.error(
                    &key,
                    format!("{other:?} is not a runtime"),
                    "use runtime = \"process\" or runtime = \"parameter-server\"",
                ));
            }
        };
        executors.push(Executor { executor, runtime });
    }
    Ok(executors)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use hypha_config::Layers;

    use super::*;

    const BASE: &str = "cert_pem = \"c.pem\"\nkey_pem = \"k.pem\"\ntrust_pem = \"r.pem\"\nwork_dir = \"/srv/work\"\n";

    fn load(text: &str) -> Result<WorkerConfig, ConfigError> {
        let schema = schema();
        let loaded = Layers::new(&schema)
            .file_text("/etc/hypha/worker.toml", text)?
            .load()?;
        WorkerConfig::from_loaded(&loaded)
    }

    #[test]
    fn artifacts_have_defaults_and_named_profiles() {
        let config = load(&format!(
            "{BASE}[artifacts]\nupload_slots = 3\n[artifacts.profiles.models]\nurl = \"s3://models/llama\"\noptions = {{ aws_region = \"eu-west-1\" }}\n[artifacts.profiles.local]\nurl = \"file:///srv/artifacts\"\n"
        ))
        .unwrap();
        let artifacts = &config.artifacts;
        assert_eq!(artifacts.dir, PathBuf::from("/srv/work/.artifacts"));
        assert_eq!(artifacts.settings.upload_slots, 3);
        assert_eq!(artifacts.settings.download_slots, 8);
        assert_eq!(
            artifacts.settings.unpack_limits,
            hypha_artifacts::unpack::Limits::default(),
            "the documented defaults are the code's"
        );
        assert_eq!(artifacts.settings.chunk_size, None);
        assert_eq!(
            artifacts.profiles.keys().collect::<Vec<_>>(),
            ["local", "models"]
        );
        assert_eq!(
            artifacts.profiles["models"].options["aws_region"],
            "eu-west-1"
        );
    }

    #[test]
    fn a_bad_profile_is_named_where_it_is_written() {
        let err = load(&format!(
            "{BASE}[artifacts.profiles.models]\nurl = \"s3://models\"\noptions = {{ aws_regoin = \"x\" }}\n"
        ))
        .unwrap_err();
        assert_eq!(err.key, "artifacts.profiles.models");
        assert!(
            err.problem.contains("\"aws_regoin\" is not a S3 option"),
            "{err}"
        );
        assert!(
            err.to_string().starts_with("/etc/hypha/worker.toml:5:"),
            "{err}"
        );

        let err = load(&format!(
            "{BASE}[artifacts.profiles.models]\noptions = {{}}\n"
        ))
        .unwrap_err();
        assert_eq!(err.key, "artifacts.profiles.models.url");

        let err = load(&format!("{BASE}[artifacts]\ndownload_slots = 0\n")).unwrap_err();
        assert_eq!(err.key, "artifacts.download_slots");

        let err = load(&format!("{BASE}[artifacts]\norigin_audit = 1.5\n")).unwrap_err();
        assert_eq!(err.key, "artifacts.origin_audit");
        let audited = load(&format!("{BASE}[artifacts]\norigin_audit = 0.25\n")).unwrap();
        assert_eq!(audited.artifacts.settings.origin_audit, 0.25);
    }

    #[test]
    fn an_executors_env_is_names_or_assignments_and_a_bad_entry_is_named() {
        let executor = "[[executors]]\nclass = \"train\"\nname = \"x\"\nruntime = \"process\"\ncmd = \"python3\"\n";
        let config = load(&format!(
            "{BASE}{executor}env = [\"HF_HOME\", \"OMP_NUM_THREADS=4\", \"EMPTY=\"]\n"
        ))
        .unwrap();
        let Runtime::Process { env, .. } = &config.executors[0].runtime else {
            panic!("a process executor");
        };
        assert_eq!(
            env,
            &[
                EnvVar::Pass("HF_HOME".into()),
                EnvVar::Set("OMP_NUM_THREADS".into(), "4".into()),
                EnvVar::Set("EMPTY".into(), String::new()),
            ]
        );
        for bad in ["", "1X", "A-B", "=x"] {
            let err = load(&format!("{BASE}{executor}env = [\"OK\", {bad:?}]\n")).unwrap_err();
            assert_eq!(err.key, "executors[0].env[1]", "{bad:?}: {err}");
        }
    }
}
