//! The data node program: `hypha-data run`.

use std::{
    path::PathBuf,
    sync::{Arc, RwLock},
    time::Duration,
};

use hypha_config::{DefaultValue, Key, Kind, Schema, network, telemetry};
use hypha_messages::{ErrorCode, Request, Response};
use hypha_network::{InboundRequest, Network};
use hypha_node::{Error, Node, RunArgs};
use serde::Deserialize;

use hypha_dataset::Manifest;

use crate::{
    Catalog,
    iteration::{Asker, NodeIterations},
    protocol::provider_key,
    server,
};

/// Requests (manifests, iterations) a data node answers at the same time.
const ANSWERING: usize = 256;

/// How often a data node looks for datasets added, changed or removed on disk.
pub const REFRESH_INTERVAL: Duration = Duration::from_secs(5);

/// Every key a data node accepts.
pub fn schema() -> Schema {
    let mut keys = network::keys();
    keys.extend(telemetry::keys());
    keys.extend([
        Key {
            name: "dataset_path",
            kind: Kind::Path,
            default: DefaultValue::Required {
                example: r#""/var/hypha/datasets/imagenet-1k""#,
            },
            doc: "The dataset to serve: a directory of slice files, announced under the directory's name. A directory whose sub-directories are datasets serves each of them. Changes on disk are picked up while running.",
        },
        Key {
            name: "iteration_dir",
            kind: Kind::Path,
            default: DefaultValue::Unset {
                example: r#""/var/hypha/iterations""#,
            },
            doc: "Where the ledgers of the iterations this node runs for its own clients (cluster_sync = false; `hypha-data iterate`) are kept, so that they survive restarts. Unset: a .hypha-iterations directory inside dataset_path.",
        },
        Key {
            name: "iteration_idle_ms",
            kind: Kind::Integer,
            default: DefaultValue::Value("86400000"),
            doc: "How long an iteration this node runs for its own clients is kept while nobody asks about it; then its ledger is removed and its place freed (also when the time passed while the node was down). Default: a day.",
        },
        Key {
            name: "manifest_dir",
            kind: Kind::Path,
            default: DefaultValue::Unset {
                example: r#""/var/lib/hypha/manifests""#,
            },
            doc: "Where the node stores the manifest it derives for a dataset that has none (manifest.json: slice sizes and BLAKE3 hashes) when the dataset's own directory is read-only; with it stored, a slice damaged later is refused by fetchers and named by `hypha-data verify --manifest-dir`. Unset: $XDG_STATE_HOME/hypha/manifests, else ~/.local/state/hypha/manifests.",
        },
        Key {
            name: "max_concurrent_slices",
            kind: Kind::Integer,
            default: DefaultValue::Value("64"),
            doc: "Slices sent at the same time over all peers; further requests wait their turn in arrival order.",
        },
        Key {
            name: "max_slices_per_peer",
            kind: Kind::Integer,
            default: DefaultValue::Value("8"),
            doc: "Slices one peer may be sent at the same time; its further requests wait their turn in its own queue (up to 64 open requests, beyond which they are answered Busy).",
        },
    ]);
    Schema::new("hypha-data", keys)
}

/// The data node's keys with `dataset_path` optional: what `fetch` reads, so that it accepts a
/// data node's config as well as one holding only certificates and gateways.
pub fn client_schema() -> Schema {
    let keys = schema()
        .keys()
        .iter()
        .map(|k| match (k.name, k.default) {
            ("dataset_path", DefaultValue::Required { example }) => Key {
                default: DefaultValue::Unset { example },
                ..*k
            },
            _ => *k,
        })
        .collect();
    Schema::new("hypha-data", keys)
}

#[derive(Debug, Deserialize)]
struct DataConfig {
    dataset_path: PathBuf,
    iteration_dir: Option<PathBuf>,
    iteration_idle_ms: i64,
    manifest_dir: Option<PathBuf>,
    max_concurrent_slices: i64,
    max_slices_per_peer: i64,
}

/// Runs a data node until the process is asked to stop.
pub async fn run(args: &RunArgs) -> Result<(), Error> {
    let loaded = hypha_node::load_run_config(&schema(), args)?;
    let config: DataConfig = loaded.section()?;
    let positive = |key: &str, value: i64| -> Result<usize, Error> {
        usize::try_from(value)
            .ok()
            .filter(|v| *v > 0)
            .ok_or_else(|| {
                loaded
                    .error(
                        key,
                        format!("{value} is not a positive number"),
                        "use a count of 1 or more",
                    )
                    .into()
            })
    };
    let limits = server::Limits {
        concurrent: positive("max_concurrent_slices", config.max_concurrent_slices)?,
        per_peer: positive("max_slices_per_peer", config.max_slices_per_peer)?,
        ..server::Limits::default()
    };
    let manifest_dir = config
        .manifest_dir
        .clone()
        .or_else(hypha_dataset::default_manifest_dir);
    let catalog = Catalog::open_with(&config.dataset_path, manifest_dir).map_err(|e| {
        Error::from(loaded.error(
            "dataset_path",
            e.to_string(),
            "point dataset_path at a directory of *.safetensors slices (or of such directories)",
        ))
    })?;
    let iteration_dir = config
        .iteration_dir
        .unwrap_or_else(|| config.dataset_path.join(".hypha-iterations"));
    let idle = u64::try_from(config.iteration_idle_ms)
        .ok()
        .filter(|ms| *ms > 0)
        .map(Duration::from_millis)
        .ok_or_else(|| {
            loaded.error(
                "iteration_idle_ms",
                format!(
                    "{} is not a positive number of milliseconds",
                    config.iteration_idle_ms
                ),
                "use a duration of 1 ms or more, e.g. 86400000 for a day",
            )
        })?;
    let node = Node::start_with("data", loaded, |_| {}).await?;
    serve(
        node.network.clone(),
        node.inbound,
        Arc::new(RwLock::new(catalog)),
        Iterations {
            dir: iteration_dir,
            idle,
        },
        limits,
        REFRESH_INTERVAL,
        hypha_node::shutdown_signal(),
    )
    .await;
    Ok(())
}

/// Where a data node keeps the iterations it runs for its own clients, and how long one may
/// go unasked.
#[derive(Debug, Clone)]
pub struct Iterations {
    pub dir: PathBuf,
    pub idle: Duration,
}

impl Iterations {
    /// Iterations in `dir`, removed after [`DEFAULT_IDLE`](crate::iteration::DEFAULT_IDLE)
    /// unasked.
    pub fn in_dir(dir: PathBuf) -> Self {
        Iterations {
            dir,
            idle: crate::iteration::DEFAULT_IDLE,
        }
    }
}

/// Does a data node's work on a started network until `shutdown` resolves: announces every
/// dataset, serves slices and manifests, runs its clients' iterations (ledgers in
/// `iterations.dir`, removed when idle), looks at the disk every `refresh` for changes; then
/// withdraws the announcements (from its own store: Kademlia has no remote withdrawal, so
/// other nodes' copies lapse with their TTL) and stops the network.
pub async fn serve(
    network: Network,
    mut inbound: tokio::sync::mpsc::Receiver<InboundRequest>,
    catalog: Arc<RwLock<Catalog>>,
    iterations: Iterations,
    limits: server::Limits,
    refresh: Duration,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let names = catalog.read().map(|c| c.names()).unwrap_or_default();
    for name in &names {
        announce(&network, name).await;
    }
    let _ = network
        .set_health(true, format!("serving {}", names.join(", ")))
        .await;
    let server = tokio::spawn(server::serve(network.clone(), catalog.clone(), limits));

    let iterations = Arc::new(NodeIterations::new(
        iterations.dir,
        network.local_peer_id(),
        iterations.idle,
    ));
    iterations.expire().await;
    let answering = Arc::new(tokio::sync::Semaphore::new(ANSWERING));
    // Answers under way; those still running at shutdown are dropped with the node (their
    // askers see the request fail, as they would for a node that died).
    let mut answers = tokio::task::JoinSet::new();
    let mut refresh = tokio::time::interval(refresh);
    refresh.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            Some(request) = inbound.recv() => {
                // Whose the asker is: known while it is connected, as it is when it asks
                // (looked up before waiting below, which may outlast its connection).
                let organisation = network.organisation(&request.peer);
                // Iterations wait for their ledger's commits: requests are answered
                // concurrently, at most ANSWERING at once (the inbound queue fills behind).
                let Ok(permit) = answering.clone().acquire_owned().await else { break };
                let (catalog, iterations) = (catalog.clone(), iterations.clone());
                while answers.try_join_next().is_some() {}
                answers.spawn(async move {
                    answer(request, organisation, &catalog, &iterations).await;
                    drop(permit);
                });
            }
            _ = refresh.tick() => {
                follow_disk(&network, &catalog).await;
                iterations.expire().await;
            }
        }
    }
    tracing::info!("shutting down");
    let names = catalog.read().map(|c| c.names()).unwrap_or_default();
    for name in names {
        let _ = network.stop_providing(provider_key(&name)).await;
    }
    server.abort();
    network.shutdown().await;
}

async fn announce(network: &Network, name: &str) {
    match network.start_providing(provider_key(name)).await {
        Ok(()) => tracing::info!(dataset = name, "announced"),
        // The local record stands and is republished periodically; peers find it once the
        // node has joined the DHT.
        Err(e) => {
            tracing::info!(dataset = name, error = %e, "announced locally; the DHT will hear of it on republication")
        }
    }
}

async fn follow_disk(network: &Network, catalog: &RwLock<Catalog>) {
    let changes = match catalog.write() {
        Ok(mut catalog) => catalog.refresh(),
        Err(_) => return,
    };
    for name in &changes.added {
        tracing::info!(dataset = %name, "new dataset on disk");
        announce(network, name).await;
    }
    for name in &changes.changed {
        tracing::info!(dataset = %name, "dataset changed on disk; serving the new version");
    }
    for name in &changes.removed {
        tracing::info!(dataset = %name, "dataset gone from disk; no longer announced");
        let _ = network.stop_providing(provider_key(name)).await;
    }
}

async fn answer(
    request: InboundRequest,
    organisation: Option<String>,
    catalog: &RwLock<Catalog>,
    iterations: &NodeIterations,
) {
    let manifest = |dataset: &str| -> Result<Manifest, hypha_messages::Error> {
        catalog
            .read()
            .ok()
            .and_then(|c| c.get(dataset).map(|d| d.manifest().clone()))
            .ok_or_else(|| {
                hypha_messages::Error::new(
                    ErrorCode::BadRequest,
                    format!("this node does not serve {dataset:?}"),
                )
            })
    };
    let response = match &request.request {
        Request::Manifest { dataset } => manifest(dataset).map(Response::Manifest),
        Request::Iterate(iterate) => {
            let service = match manifest(&iterate.dataset) {
                Ok(manifest) => {
                    let asker = Asker {
                        peer: request.peer,
                        organisation,
                    };
                    iterations.service(&asker, iterate, &manifest).await
                }
                Err(e) => Err(e),
            };
            match service {
                Ok(service) => service
                    .iterate(&request.peer, iterate)
                    .await
                    .map(Response::Iterate),
                Err(e) => Err(e),
            }
        }
        Request::Progress { iteration } => match iterations.running(iteration).await {
            Some(service) => service.progress().await.map(Response::Progress),
            None => Err(hypha_messages::Error::new(
                ErrorCode::BadRequest,
                format!("no iteration {iteration:?} runs on this node"),
            )),
        },
        _ => Err(hypha_messages::Error::new(
            ErrorCode::Unsupported,
            "data nodes answer health, manifest, iterate and progress requests",
        )),
    };
    let response = response.unwrap_or_else(Response::Error);
    let _ = request.responder.respond(response).await;
}
