//! Answering [`IterateRequest`]s from a ledger: the service both a scheduler
//! (`cluster_sync = true`, one iteration per job) and a data node (`cluster_sync = false`, the
//! iterations its clients run) put in front of a [`LedgerHandle`].
//!
//! Consumers are named `{peer}/{consumer}` in the ledger, so two peers can never report on
//! each other's slices. Each granted slice comes with the providers that hold it, rotated per
//! grant so that replicas share the load.

use std::{
    collections::{HashMap, HashSet},
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{SystemTime, UNIX_EPOCH},
};

use hypha_dataset::Manifest;
use hypha_ledger::{Grant, IterationSpec, Ledger, LedgerHandle, SliceKey};
use hypha_messages::{
    Error as RemoteError, ErrorCode,
    iterate::{
        ConsumerRate, EpochCounts, GrantedSlice, IterateGrant, IterateRequest, IterateStatus,
        IterationProgress, SliceRef,
    },
};
use hypha_network::PeerId;
use tokio::sync::Mutex;

/// The most slices one request may be granted.
pub const MAX_WANT: u32 = 64;
/// How long a consumer's assignments last without a word from it.
pub const LEASE_MS: u64 = 60_000;
/// When nothing is free, how long a consumer is told to wait before asking again.
const RETRY_MS: u64 = 500;
pub use hypha_ledger::MAX_EPOCHS;
/// The most iterations a data node runs at once for its clients; a node restarted with more
/// on disk resumes each as it is asked for again.
pub const MAX_NODE_ITERATIONS: usize = 64;

/// Where one slice can be fetched from.
#[derive(Debug, Clone)]
pub struct SliceSource {
    pub file: String,
    pub size: u64,
    pub blake3: String,
    pub providers: Vec<PeerId>,
}

impl SliceSource {
    /// Every slice of `manifest`, each held by `node` alone.
    pub fn all_held_by(manifest: &Manifest, node: PeerId) -> Vec<Self> {
        manifest
            .slices
            .iter()
            .map(|s| Self {
                file: s.file.clone(),
                size: s.size,
                blake3: s.blake3.clone(),
                providers: vec![node],
            })
            .collect()
    }
}

/// One iteration's ledger, answering requests.
#[derive(Debug, Clone)]
pub struct IterationService {
    iteration: String,
    ledger: LedgerHandle,
    sources: Arc<Vec<SliceSource>>,
    /// Used at once when consumed: there are no rounds that could be dropped (a data node's
    /// own iterations).
    use_on_consume: bool,
    rotation: Arc<AtomicUsize>,
}

impl IterationService {
    pub fn new(
        iteration: String,
        ledger: LedgerHandle,
        sources: Vec<SliceSource>,
        use_on_consume: bool,
    ) -> Self {
        Self {
            iteration,
            ledger,
            sources: Arc::new(sources),
            use_on_consume,
            rotation: Arc::new(AtomicUsize::new(0)),
        }
    }

    pub fn ledger(&self) -> &LedgerHandle {
        &self.ledger
    }

    /// The ledger's name for `consumer` on `peer`.
    pub fn consumer_name(peer: &PeerId, consumer: &str) -> String {
        format!("{peer}/{consumer}")
    }

    /// Applies a request's reports, then grants what it asks for.
    pub async fn iterate(
        &self,
        peer: &PeerId,
        request: &IterateRequest,
    ) -> Result<IterateGrant, RemoteError> {
        let spec = self.ledger.spec();
        // Epochs 0 takes the ledger's word for epochs and seed.
        if request.iteration != self.iteration
            || request.dataset != spec.dataset
            || (request.epochs != 0 && (request.epochs != spec.epochs || request.seed != spec.seed))
        {
            return Err(RemoteError::new(
                ErrorCode::BadRequest,
                format!(
                    "iteration {:?} covers {:?} for {} epochs with seed {}; the request asks for {:?} for {} epochs with seed {}",
                    self.iteration,
                    spec.dataset,
                    spec.epochs,
                    spec.seed,
                    request.dataset,
                    request.epochs,
                    request.seed
                ),
            ));
        }
        let consumer = Self::consumer_name(peer, &request.consumer);
        let failed = |e: hypha_ledger::Error| RemoteError::new(ErrorCode::Internal, e.to_string());
        let mut refused = Vec::new();
        if !request.consumed.is_empty() {
            let keys = request.consumed.iter().map(key).collect();
            let outcome = self
                .ledger
                .consume(&consumer, keys, request.round)
                .await
                .map_err(failed)?;
            refused = outcome
                .refused
                .iter()
                .map(|k| SliceRef {
                    epoch: k.epoch,
                    slice: k.slice,
                })
                .collect();
            if self.use_on_consume {
                self.ledger
                    .commit_round(&consumer, request.round)
                    .await
                    .map_err(failed)?;
            }
        }
        if let Some(round) = request.completed_round {
            self.ledger
                .commit_round(&consumer, round)
                .await
                .map_err(failed)?;
        }
        if let Some(holding) = &request.holding {
            let holding = holding.iter().map(key).collect();
            let returned = self
                .ledger
                .release_unheld(&consumer, holding)
                .await
                .map_err(failed)?;
            if returned > 0 {
                tracing::info!(%consumer, returned, "grants that never reached their job are available again");
            }
        }
        if request.want == 0 {
            self.ledger.renew(&consumer).await.map_err(failed)?;
            return Ok(IterateGrant {
                slices: Vec::new(),
                refused,
                status: IterateStatus::Granted,
            });
        }
        let cached: HashSet<u64> = request.cached.iter().copied().collect();
        let grant = self
            .ledger
            .assign(&consumer, request.want.min(MAX_WANT) as usize, cached)
            .await
            .map_err(failed)?;
        let (slices, status) = match grant {
            Grant::Slices(assigned) => (
                assigned
                    .iter()
                    .map(|a| self.granted(a.key, a.samples))
                    .collect(),
                IterateStatus::Granted,
            ),
            Grant::Wait => (Vec::new(), IterateStatus::Wait { retry_ms: RETRY_MS }),
            Grant::Finished => (Vec::new(), IterateStatus::Finished),
        };
        Ok(IterateGrant {
            slices,
            refused,
            status,
        })
    }

    fn granted(&self, key: SliceKey, samples: u64) -> GrantedSlice {
        let source = self.sources.get(key.slice as usize);
        let mut providers: Vec<String> = source
            .map(|s| s.providers.iter().map(PeerId::to_string).collect())
            .unwrap_or_default();
        if !providers.is_empty() {
            let turn = self.rotation.fetch_add(1, Ordering::Relaxed) % providers.len();
            providers.rotate_left(turn);
        }
        GrantedSlice {
            epoch: key.epoch,
            slice: key.slice,
            file: source.map(|s| s.file.clone()).unwrap_or_default(),
            samples,
            size: source.map_or(0, |s| s.size),
            blake3: source.map(|s| s.blake3.clone()).unwrap_or_default(),
            providers,
        }
    }

    /// Where the iteration stands.
    pub async fn progress(&self) -> Result<IterationProgress, RemoteError> {
        let progress = self
            .ledger
            .progress()
            .await
            .map_err(|e| RemoteError::new(ErrorCode::Internal, e.to_string()))?;
        Ok(IterationProgress {
            iteration: self.iteration.clone(),
            dataset: progress.dataset,
            finished: progress.finished,
            epochs: progress
                .epochs
                .into_iter()
                .map(|e| EpochCounts {
                    epoch: e.epoch,
                    available: e.available,
                    assigned: e.assigned,
                    consumed: e.consumed,
                    used: e.used,
                })
                .collect(),
            consumers: progress
                .workers
                .into_iter()
                .map(|w| ConsumerRate {
                    consumer: w.worker,
                    assigned: w.assigned,
                    consumed: w.consumed,
                    used: w.used,
                    samples_used: w.samples_used,
                    slices_per_s: w.slices_per_s,
                    samples_per_s: w.samples_per_s,
                })
                .collect(),
            run: None,
        })
    }
}

/// Why an iterate request got no grant.
#[derive(Debug, thiserror::Error)]
pub enum AskError {
    #[error("{peer} did not answer: {error}")]
    Unreachable {
        peer: PeerId,
        error: hypha_network::NetworkError,
    },
    #[error("{peer} refused: {message}")]
    Refused { peer: PeerId, message: String },
    #[error("{peer} answered an iterate request with something else than a grant")]
    Unexpected { peer: PeerId },
}

/// Sends `request` to `peer`, the node that runs the iteration's ledger, and returns its grant.
pub async fn ask(
    network: &hypha_network::Network,
    peer: PeerId,
    request: IterateRequest,
) -> Result<IterateGrant, AskError> {
    use hypha_messages::{Request, Response};
    match network.request(peer, Request::Iterate(request)).await {
        Ok(Response::Iterate(grant)) => Ok(grant),
        Ok(Response::Error(e)) => Err(AskError::Refused {
            peer,
            message: e.message,
        }),
        Ok(_) => Err(AskError::Unexpected { peer }),
        Err(error) => Err(AskError::Unreachable { peer, error }),
    }
}

/// The iteration spec for `manifest`.
pub fn spec_of(manifest: &Manifest, epochs: u32, seed: u64) -> IterationSpec {
    IterationSpec {
        dataset: manifest.name.clone(),
        epochs,
        seed,
        samples: manifest
            .slices
            .iter()
            .map(|s| s.samples.unwrap_or(0))
            .collect(),
    }
}

/// A data node's own iterations (`cluster_sync = false`): started by the first client that
/// names them, kept in `dir/{dataset}/{iteration}.ledger`, resumed after a restart.
#[derive(Debug)]
pub struct NodeIterations {
    dir: PathBuf,
    this_node: PeerId,
    open: Mutex<HashMap<(String, String), IterationService>>,
}

impl NodeIterations {
    pub fn new(dir: PathBuf, this_node: PeerId) -> Self {
        Self {
            dir,
            this_node,
            open: Mutex::new(HashMap::new()),
        }
    }

    /// The service for the request's iteration, opened or started from `manifest`.
    pub async fn service(
        &self,
        request: &IterateRequest,
        manifest: &Manifest,
    ) -> Result<IterationService, RemoteError> {
        check_name("iteration", &request.iteration)?;
        let key = (request.dataset.clone(), request.iteration.clone());
        let mut open = self.open.lock().await;
        if let Some(service) = open.get(&key) {
            return Ok(service.clone());
        }
        if request.epochs > MAX_EPOCHS {
            return Err(RemoteError::new(
                ErrorCode::BadRequest,
                format!(
                    "{} epochs asked; an iteration has at most {MAX_EPOCHS}",
                    request.epochs
                ),
            ));
        }
        if open.len() >= MAX_NODE_ITERATIONS {
            return Err(RemoteError::new(
                ErrorCode::Busy,
                format!(
                    "this data node runs {MAX_NODE_ITERATIONS} iterations already; use one of them or another node"
                ),
            ));
        }
        let path = self
            .dir
            .join(&request.dataset)
            .join(format!("{}.ledger", request.iteration));
        let spec = spec_of(manifest, request.epochs, request.seed);
        let ledger = open_ledger(&path, spec).await.map_err(|e| {
            RemoteError::new(
                ErrorCode::BadRequest,
                format!("iteration {:?}: {e}", request.iteration),
            )
        })?;
        let (handle, _task) = LedgerHandle::spawn(ledger);
        let sources = SliceSource::all_held_by(manifest, self.this_node);
        let service = IterationService::new(request.iteration.clone(), handle, sources, true);
        open.insert(key, service.clone());
        Ok(service)
    }

    /// The service of an iteration already running on this node.
    pub async fn running(&self, iteration: &str) -> Option<IterationService> {
        let open = self.open.lock().await;
        open.iter()
            .find(|((_, name), _)| name == iteration)
            .map(|(_, service)| service.clone())
    }
}

async fn open_ledger(path: &Path, spec: IterationSpec) -> Result<Ledger, hypha_ledger::Error> {
    let path = path.to_path_buf();
    tokio::task::spawn_blocking(move || {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| {
                hypha_ledger::Error::Invalid(format!(
                    "cannot create {}: {e} (set iteration_dir to a writable directory)",
                    dir.display()
                ))
            })?;
        }
        Ledger::open_or_create(&path, spec, LEASE_MS, now_ms())
    })
    .await
    .map_err(|_| hypha_ledger::Error::Stopped)?
}

/// The ledger's key of a slice a request names.
fn key(slice: &SliceRef) -> SliceKey {
    SliceKey {
        epoch: slice.epoch,
        slice: slice.slice,
    }
}

/// Milliseconds since the Unix epoch.
pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Iteration names become file names: letters, digits, `.`, `_` and `-`, not starting with a
/// dot, at most 64.
fn check_name(what: &str, name: &str) -> Result<(), RemoteError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if ok {
        Ok(())
    } else {
        Err(RemoteError::new(
            ErrorCode::BadRequest,
            format!(
                "{what} {name:?}: use 1 to 64 letters, digits, '.', '_' or '-', not starting with '.'"
            ),
        ))
    }
}
