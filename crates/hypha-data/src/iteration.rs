//! Answering [`IterateRequest`]s from a ledger: the service both a scheduler
//! (`cluster_sync = true`, one iteration per job) and a data node (`cluster_sync = false`, the
//! iterations its clients run) put in front of a [`LedgerHandle`].
//!
//! Consumers are named `{peer}/{consumer}` in the ledger, so two peers can never report on
//! each other's slices; a consumer's name is 1 to 64 letters, digits, `.`, `_` or `-`. Each
//! granted slice comes with the providers that hold it, rotated per grant so that replicas
//! share the load.
//!
//! A data node's own iterations belong to the peer that started them: only it, and the peers
//! it names (`share_with`), consume from them. One peer runs at most
//! [`MAX_ITERATIONS_PER_PEER`] on a node and one organisation (the CA that signed its peers'
//! certificates) at most [`MAX_ITERATIONS_PER_ORGANISATION`], so that many certificates of one
//! organisation cannot keep every place; asking needs the worker role (the network checks it).
//! An iteration nobody asked about for the node's
//! `iteration_idle_ms` is over: its ledger is removed and its place freed, also when that
//! time passed while the node was down.

use std::{
    collections::{HashMap, HashSet},
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, UNIX_EPOCH},
};

use hypha_dataset::Manifest;
use hypha_ledger::{Grant, IterationSpec, Ledger, LedgerHandle, SliceKey};
use hypha_messages::{
    Error as RemoteError, ErrorCode,
    iterate::{
        ConsumerRate, EpochCounts, GrantedSlice, IterateGrant, IterateRequest, IterateStatus,
        IterationProgress, SliceRef,
    },
    unix_ms,
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
/// The most iterations one peer runs at once on a data node.
pub const MAX_ITERATIONS_PER_PEER: usize = 4;
/// The most iterations the peers of one organisation run at once on a data node: half of its
/// places, so that however many certificates one organisation holds, the others keep half (and
/// a network of one organisation still runs 32).
pub const MAX_ITERATIONS_PER_ORGANISATION: usize = MAX_NODE_ITERATIONS / 2;
/// How long a data node keeps an iteration nobody asks about, unless configured otherwise.
pub const DEFAULT_IDLE: Duration = Duration::from_secs(24 * 3600);
/// How often the time an iteration was last asked about is written down.
const USED_EVERY_MS: u64 = 60_000;

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
        check_name("consumer", &request.consumer)?;
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
/// names them, kept in `dir/{dataset}/{iteration}.ledger` with their owner beside it
/// (`{iteration}.owner.json`), resumed after a restart, removed when idle.
#[derive(Debug)]
pub struct NodeIterations {
    dir: PathBuf,
    this_node: PeerId,
    idle: Duration,
    open: Mutex<HashMap<(String, String), Running>>,
}

/// An iteration this node runs, and who may use it.
#[derive(Debug)]
struct Running {
    service: IterationService,
    owner: Owner,
    /// When it was last written down that a request came.
    noted_ms: u64,
}

/// Who an iteration belongs to, as kept beside its ledger.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct Owner {
    owner: String,
    #[serde(default)]
    share_with: Vec<String>,
    /// When a request for it last came (ms since the epoch; written at most once a minute).
    last_used_ms: u64,
    /// The owner's organisation ([`Asker::organisation`]); `None` in a file written before
    /// organisations were counted, until it is reopened (then charged to the asker's).
    #[serde(default)]
    organisation: Option<String>,
}

/// Who asks a data node about an iteration.
#[derive(Debug, Clone)]
pub struct Asker {
    pub peer: PeerId,
    /// The organisation its certificate belongs to
    /// ([`hypha_certs::organisation_of_certificate`]); `None` when the network no longer
    /// knows (it asked and left): it may use iterations running already, and starts none.
    pub organisation: Option<String>,
}

impl Owner {
    fn admits(&self, peer: &PeerId) -> bool {
        let peer = peer.to_string();
        self.owner == peer || self.share_with.contains(&peer)
    }
}

/// Whether a new iteration of `owner` may start beside those `open`: this node runs at most
/// [`MAX_NODE_ITERATIONS`], one peer [`MAX_ITERATIONS_PER_PEER`] of them and one
/// organisation [`MAX_ITERATIONS_PER_ORGANISATION`]; `idle`, how long an iteration may go
/// unused before it is let go, is what the refusals suggest waiting for.
fn room_for(
    open: &HashMap<(String, String), Running>,
    owner: &Owner,
    idle: Duration,
) -> Result<(), RemoteError> {
    if open.len() >= MAX_NODE_ITERATIONS {
        return Err(RemoteError::new(
            ErrorCode::Busy,
            format!(
                "this data node runs {MAX_NODE_ITERATIONS} iterations already; use one of them or another node"
            ),
        ));
    }
    let owned = open
        .values()
        .filter(|r| r.owner.owner == owner.owner)
        .count();
    if owned >= MAX_ITERATIONS_PER_PEER {
        return Err(RemoteError::new(
            ErrorCode::Busy,
            format!(
                "{} runs {MAX_ITERATIONS_PER_PEER} iterations on this node already, the most one peer may; finish one, or let one go idle for {} s",
                owner.owner,
                idle.as_secs()
            ),
        ));
    }
    // Fails closed: an iteration counted against no organisation would escape its share.
    let Some(organisation) = &owner.organisation else {
        return Err(RemoteError::new(
            ErrorCode::Busy,
            "this node no longer knows whose certificate asked (the connection closed); ask again",
        ));
    };
    let of_organisation = open
        .values()
        .filter(|r| r.owner.organisation.as_ref() == Some(organisation))
        .count();
    if of_organisation >= MAX_ITERATIONS_PER_ORGANISATION {
        return Err(RemoteError::new(
            ErrorCode::Busy,
            format!(
                "the peers of {organisation} run {MAX_ITERATIONS_PER_ORGANISATION} iterations on this node already, the most one organisation may; finish one, or let one go idle for {} s",
                idle.as_secs()
            ),
        ));
    }
    Ok(())
}

impl NodeIterations {
    /// Iterations in `dir`, each kept until nobody asked about it for `idle`.
    pub fn new(dir: PathBuf, this_node: PeerId, idle: Duration) -> Self {
        Self {
            dir,
            this_node,
            idle,
            open: Mutex::new(HashMap::new()),
        }
    }

    fn ledger_path(&self, dataset: &str, iteration: &str) -> PathBuf {
        self.dir.join(dataset).join(format!("{iteration}.ledger"))
    }

    /// The service for `asker`'s request, opened or started from `manifest`: refused when the
    /// iteration belongs to a peer that does not share it with the asker, and a new one when
    /// the asker or its organisation runs its share of the node's places already.
    pub async fn service(
        &self,
        asker: &Asker,
        request: &IterateRequest,
        manifest: &Manifest,
    ) -> Result<IterationService, RemoteError> {
        let peer = &asker.peer;
        check_name("iteration", &request.iteration)?;
        let key = (request.dataset.clone(), request.iteration.clone());
        let path = self.ledger_path(&request.dataset, &request.iteration);
        let now = unix_ms();
        let mut open = self.open.lock().await;
        if let Some(running) = open.get_mut(&key) {
            check_admitted(&running.owner, peer, &request.iteration)?;
            let shares = running.owner.owner == peer.to_string()
                && !request.share_with.is_empty()
                && request.share_with != running.owner.share_with;
            if shares {
                running.owner.share_with = request.share_with.clone();
            }
            if shares || now.saturating_sub(running.noted_ms) >= USED_EVERY_MS {
                running.owner.last_used_ms = now;
                running.noted_ms = now;
                write_owner(&path, &running.owner).await;
            }
            return Ok(running.service.clone());
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
        // Kept beside a ledger from before the node stopped: its owner stays its owner.
        let kept = read_owner(&path).await;
        let owner = match kept {
            Some(kept) => {
                check_admitted(&kept, peer, &request.iteration)?;
                // Written before organisations were counted: charged to the asker's.
                let organisation = kept.organisation.or_else(|| asker.organisation.clone());
                Owner {
                    organisation,
                    ..kept
                }
            }
            None => Owner {
                owner: peer.to_string(),
                share_with: request.share_with.clone(),
                last_used_ms: now,
                organisation: asker.organisation.clone(),
            },
        };
        room_for(&open, &owner, self.idle)?;
        let spec = spec_of(manifest, request.epochs, request.seed);
        let ledger = open_ledger(&path, spec).await.map_err(|e| {
            RemoteError::new(
                ErrorCode::BadRequest,
                format!("iteration {:?}: {e}", request.iteration),
            )
        })?;
        let owner = Owner {
            last_used_ms: now,
            ..owner
        };
        write_owner(&path, &owner).await;
        let (handle, _task) = LedgerHandle::spawn(ledger);
        let sources = SliceSource::all_held_by(manifest, self.this_node);
        let service = IterationService::new(request.iteration.clone(), handle, sources, true);
        open.insert(
            key,
            Running {
                service: service.clone(),
                owner,
                noted_ms: now,
            },
        );
        Ok(service)
    }

    /// The service of an iteration already running on this node.
    pub async fn running(&self, iteration: &str) -> Option<IterationService> {
        let open = self.open.lock().await;
        open.iter()
            .find(|((_, name), _)| name == iteration)
            .map(|(_, running)| running.service.clone())
    }

    /// Ends the iterations nobody asked about for the idle time, running or left on disk
    /// from before a restart: their ledgers are removed and their places freed.
    pub async fn expire(&self) {
        let now = unix_ms();
        let idle_ms = u64::try_from(self.idle.as_millis()).unwrap_or(u64::MAX);
        let mut open = self.open.lock().await;
        open.retain(|(dataset, iteration), running| {
            let idle = now.saturating_sub(running.owner.last_used_ms.max(running.noted_ms));
            let keep = idle < idle_ms;
            if !keep {
                tracing::info!(dataset, iteration, owner = %running.owner.owner, "iteration idle; removing it");
            }
            keep
        });
        let running: HashSet<PathBuf> = open
            .keys()
            .map(|(dataset, iteration)| self.ledger_path(dataset, iteration))
            .collect();
        drop(open);
        let dir = self.dir.clone();
        let _ = tokio::task::spawn_blocking(move || {
            remove_idle(&dir, &running, now, idle_ms);
        })
        .await;
    }
}

/// Removes every ledger under `dir` (but those `running`) whose owner file says it was last
/// used `idle_ms` or more before `now`, with that file.
fn remove_idle(dir: &Path, running: &HashSet<PathBuf>, now: u64, idle_ms: u64) {
    let Ok(datasets) = std::fs::read_dir(dir) else {
        return;
    };
    for dataset in datasets.flatten() {
        let Ok(files) = std::fs::read_dir(dataset.path()) else {
            continue;
        };
        for file in files.flatten() {
            let path = file.path();
            if path.extension().is_none_or(|e| e != "ledger") || running.contains(&path) {
                continue;
            }
            let owner = std::fs::read(owner_path(&path))
                .ok()
                .and_then(|bytes| serde_json::from_slice::<Owner>(&bytes).ok());
            // A ledger without an owner file (an older node's) is dated by the file itself.
            let used = owner.map(|o| o.last_used_ms).or_else(|| {
                let modified = file.metadata().ok()?.modified().ok()?;
                Some(modified.duration_since(UNIX_EPOCH).ok()?.as_millis() as u64)
            });
            if used.is_some_and(|used| now.saturating_sub(used) >= idle_ms) {
                tracing::info!(ledger = %path.display(), "iteration idle since before this node started; removing it");
                let _ = std::fs::remove_file(&path);
                let _ = std::fs::remove_file(owner_path(&path));
            }
        }
    }
}

fn check_admitted(owner: &Owner, peer: &PeerId, iteration: &str) -> Result<(), RemoteError> {
    if owner.admits(peer) {
        return Ok(());
    }
    Err(RemoteError::new(
        ErrorCode::Forbidden,
        format!(
            "iteration {iteration:?} belongs to {}, which does not share it with you; start an iteration of your own name, or have its owner name you (`hypha-data iterate --share-with`)",
            owner.owner
        ),
    ))
}

fn owner_path(ledger: &Path) -> PathBuf {
    ledger.with_extension("owner.json")
}

async fn read_owner(ledger: &Path) -> Option<Owner> {
    let path = owner_path(ledger);
    let bytes = tokio::fs::read(&path).await.ok()?;
    serde_json::from_slice(&bytes).ok()
}

async fn write_owner(ledger: &Path, owner: &Owner) {
    let path = owner_path(ledger);
    let Ok(bytes) = serde_json::to_vec(owner) else {
        return;
    };
    let written = tokio::task::spawn_blocking(move || {
        hypha_files::write_atomic(&path, &bytes, hypha_files::Mode::Private, true)
    })
    .await;
    if let Ok(Err(error)) = written {
        tracing::warn!(%error, "cannot write down an iteration's owner");
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
        Ledger::open_or_create(&path, spec, LEASE_MS, unix_ms())
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
