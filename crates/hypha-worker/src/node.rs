//! The worker node: the loop that connects the market, the leases and the jobs to the network.
//!
//! One task owns all of the worker's state ([`Arbiter`], [`LeaseManager`], [`JobManager`])
//! and reacts to four things: advertisements from gossip (buffered for `offer.window_ms`, then
//! evaluated together), requests from schedulers (accept, renew, release, dispatch, cancel),
//! the next lease expiry, and jobs that ended. Everything that waits on a peer (sending an
//! offer, pushing a job status) runs in its own task and reports back, so the loop never
//! blocks on the network.

use std::{
    collections::HashMap,
    sync::Arc,
    time::{Duration, Instant},
};

use hypha_messages::{
    Error as RemoteError, ErrorCode, Request, Response,
    job::{JobSpec, JobStatus, StatusReport},
    market::{Advertisement, LeaseGrant, LeaseRequest, MARKET_VERSION, Offer, WORKER_TOPIC},
    unix_ms,
};
use hypha_network::{GossipMessage, InboundRequest, Network, Role};
use hypha_node::{Error, Node, RunArgs};
use libp2p::PeerId;
use tokio::{sync::mpsc, task::JoinSet};
use tracing::Instrument;

use crate::{
    arbiter::Arbiter,
    artifacts::ArtifactStore,
    bridge::{self, socket::SocketPlace},
    config::{WorkerConfig, schema},
    drain::{LockError, WorkerLock},
    jobs::{Ended, JobManager, StartError},
    lease::{LeaseId, LeaseManager, Stage},
    metrics,
    slices::{self, SliceCache},
};

/// How many advertisements wait for evaluation at most; beyond that, new ones are dropped
/// (schedulers re-advertise) so a flood cannot grow the worker's memory.
const MAX_BUFFERED_ADVERTISEMENTS: usize = 1024;
/// How many times a job status is sent before the worker gives up on the scheduler.
const STATUS_ATTEMPTS: u32 = 3;

/// Runs a worker until the process is asked to stop.
pub async fn run(args: &RunArgs) -> Result<(), Error> {
    let loaded = hypha_node::load_run_config(&schema(), args)?;
    let config = WorkerConfig::from_loaded(&loaded)?;
    std::fs::create_dir_all(&config.work_dir).map_err(|e| {
        Error::from(loaded.error(
            "work_dir",
            format!("cannot create {}: {e}", config.work_dir.display()),
            "point work_dir at a directory this user may write",
        ))
    })?;
    let _lock = WorkerLock::acquire(&config.work_dir).map_err(|e| {
        let fix = match e {
            LockError::Taken { .. } => {
                "give each worker its own work_dir, or stop that one first (hypha-worker drain --config ...)"
            }
            LockError::Io { .. } => "point work_dir at a directory this user may write",
        };
        Error::from(loaded.error("work_dir", e.to_string(), fix))
    })?;
    if config.executors.is_empty() {
        tracing::warn!(
            "no [[executors]] configured: this worker will not answer any advertisement"
        );
    }
    let cache_dir = slices::cache_dir(&config.work_dir);
    let cache = SliceCache::open(cache_dir.clone(), config.slice_cache_bytes).map_err(|e| {
        Error::from(loaded.error(
            "work_dir",
            format!("cannot use {} as the slice cache: {e}", cache_dir.display()),
            "point work_dir at a directory this user may write",
        ))
    })?;
    let node = Node::start_with("worker", loaded, |_| {}).await?;
    let bridge = bridge::Settings::from_env(config.download_read_timeout);
    serve(
        node.network,
        node.inbound,
        config,
        bridge,
        Arc::new(cache),
        hypha_node::shutdown_signal(),
    )
    .await
    .map_err(|e| Error::Failed(e.to_string()))
}

/// Why a worker could not serve.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Network(#[from] hypha_network::NetworkError),
    #[error("artifacts: {0}")]
    Artifacts(#[from] hypha_artifacts::FetchError),
    #[error("work_dir {path}: {error}")]
    Sockets {
        path: String,
        error: crate::bridge::socket::SocketError,
    },
}

/// Does a worker's work on a started network until `shutdown` resolves, then cancels its jobs
/// and stops the network.
pub async fn serve(
    network: Network,
    inbound: mpsc::Receiver<InboundRequest>,
    config: WorkerConfig,
    bridge: bridge::Settings,
    cache: Arc<SliceCache>,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), ServeError> {
    let sockets =
        SocketPlace::for_work_dir(&config.work_dir).map_err(|error| ServeError::Sockets {
            path: config.work_dir.display().to_string(),
            error,
        })?;
    let adverts = network.subscribe(WORKER_TOPIC, 256).await?;
    let artifacts = Arc::new(ArtifactStore::start(network.clone(), &config.artifacts)?);
    let (ended_tx, ended) = mpsc::channel(64);
    let (internal_tx, internal) = mpsc::channel(256);
    let shared = Arc::new(bridge::Shared::new(
        network.clone(),
        bridge,
        cache,
        config.prefetch_bytes,
        artifacts,
    ));
    // Peers' transfers to this worker's jobs are received until the worker stops.
    let mut receiving = JoinSet::new();
    receiving.spawn({
        let shared = shared.clone();
        async move { shared.receive_transfers().await }
    });
    let executors: Vec<String> = config
        .executors
        .iter()
        .map(|e| e.executor.to_string())
        .collect();
    let _ = network
        .set_health(
            true,
            format!(
                "worker with executors [{}], {:?} strategy",
                executors.join(", "),
                config.pricing.strategy
            ),
        )
        .await;
    tracing::info!(executors = ?executors, capacity = ?config.capacity, "worker ready for advertisements");
    let worker = Worker {
        arbiter: Arbiter::new(
            config.pricing,
            config.capacity,
            config.executors.iter().map(|e| e.executor.clone()),
        ),
        leases: LeaseManager::new(config.capacity),
        owners: HashMap::new(),
        jobs: JobManager::new(
            config.work_dir.clone(),
            &config.executors,
            config.kill_grace,
            shared,
            sockets,
            ended_tx,
        ),
        buffered: Vec::new(),
        window_closes: None,
        network: network.clone(),
        internal: internal_tx,
        offering: JoinSet::new(),
        telling: JoinSet::new(),
        config,
    };
    worker
        .run(adverts, inbound, ended, internal, shutdown)
        .await;
    receiving.abort_all();
    network.shutdown().await;
    Ok(())
}

/// What spawned tasks tell the loop.
#[derive(Debug)]
enum Internal {
    /// An offer could not be delivered: free what it held.
    OfferFailed(LeaseId),
}

struct Worker {
    arbiter: Arbiter,
    leases: LeaseManager,
    /// The scheduler each live lease belongs to.
    owners: HashMap<LeaseId, PeerId>,
    jobs: JobManager,
    buffered: Vec<(PeerId, Advertisement)>,
    window_closes: Option<tokio::time::Instant>,
    network: Network,
    internal: mpsc::Sender<Internal>,
    /// Offers on their way to schedulers, each until delivered or given up on; a stopping
    /// worker withdraws them (it would grant no lease).
    offering: JoinSet<()>,
    /// Job statuses on their way to schedulers; shutdown waits for them as long as the
    /// executors' grace allows.
    telling: JoinSet<()>,
    config: WorkerConfig,
}

impl Worker {
    async fn run(
        mut self,
        mut adverts: mpsc::Receiver<GossipMessage>,
        mut inbound: mpsc::Receiver<InboundRequest>,
        mut ended: mpsc::Receiver<Ended>,
        mut internal: mpsc::Receiver<Internal>,
        shutdown: impl std::future::Future<Output = ()>,
    ) {
        tokio::pin!(shutdown);
        loop {
            let window = self.window_closes;
            let expiry = self
                .leases
                .next_expiry()
                .map(tokio::time::Instant::from_std);
            tokio::select! {
                _ = &mut shutdown => break,
                Some(message) = adverts.recv() => self.buffer(message),
                _ = sleep_until(window) => self.evaluate(),
                _ = sleep_until(expiry) => self.expire(),
                Some(request) = inbound.recv() => self.answer(request).await,
                Some(ended) = ended.recv() => self.job_ended(ended),
                Some(_) = self.offering.join_next() => {}
                Some(_) = self.telling.join_next() => {}
                Some(Internal::OfferFailed(lease)) = internal.recv() => {
                    if self.leases.release(lease).is_some() {
                        metrics::leases_changed(-1);
                    }
                    self.owners.remove(&lease);
                }
            }
        }
        tracing::info!(jobs = self.jobs.len(), "shutting down");
        self.offering.abort_all();
        self.jobs.cancel_all("the worker is shutting down");
        // Give executors their grace period to stop and the statuses a moment to go out.
        let deadline =
            tokio::time::Instant::now() + self.config.kill_grace + Duration::from_secs(1);
        while !self.jobs.is_empty() {
            match tokio::time::timeout_at(deadline, ended.recv()).await {
                Ok(Some(ended)) => self.job_ended(ended),
                _ => break,
            }
        }
        let telling = async { while self.telling.join_next().await.is_some() {} };
        let _ = tokio::time::timeout_at(deadline, telling).await;
    }

    fn buffer(&mut self, message: GossipMessage) {
        let Some(source) = message.source else {
            return;
        };
        let ad = match Advertisement::from_gossip(&message.data) {
            Ok(ad) => ad,
            Err(e) => {
                tracing::debug!(%source, error = %e, "ignoring a malformed advertisement");
                metrics::advertisement("malformed");
                return;
            }
        };
        if self.buffered.len() >= MAX_BUFFERED_ADVERTISEMENTS {
            metrics::advertisement("overflow");
            return;
        }
        self.buffered.push((source, ad));
        if self.window_closes.is_none() {
            self.window_closes = Some(tokio::time::Instant::now() + self.config.window);
        }
    }

    fn evaluate(&mut self) {
        self.window_closes = None;
        let batch = std::mem::take(&mut self.buffered);
        let span = tracing::info_span!("evaluate_advertisements", count = batch.len());
        let _entered = span.enter();
        let now = Instant::now();
        let now_ms = unix_ms();
        let ads: Vec<Advertisement> = batch.iter().map(|(_, ad)| ad.clone()).collect();
        let available = self.leases.available(now);
        let granted = self.arbiter.select(&ads, available, now_ms);
        for (source, ad) in &batch {
            if !granted.iter().any(|(g, _)| g.id == ad.id) {
                let reason = self
                    .arbiter
                    .quote(ad, available, now_ms)
                    .err()
                    .map_or("outranked", |d| d.as_str());
                tracing::debug!(scheduler = %source, advertisement = %ad.id, reason, "no offer");
                metrics::advertisement(reason);
            }
        }
        for (ad, quote) in granted {
            let Some(source) = batch.iter().find(|(_, a)| a.id == ad.id).map(|(s, _)| *s) else {
                continue;
            };
            let Ok(lease) = self.leases.reserve(quote.resources, self.config.hold, now) else {
                continue;
            };
            metrics::leases_changed(1);
            metrics::advertisement("offered");
            self.owners.insert(lease, source);
            let offer = Offer {
                version: MARKET_VERSION,
                advertisement: ad.id.clone(),
                lease,
                price: quote.price,
                resources: quote.resources,
                valid_ms: millis(self.config.hold),
            };
            tracing::info!(scheduler = %source, advertisement = %ad.id, price = quote.price, lease, "offering");
            let network = self.network.clone();
            let internal = self.internal.clone();
            self.offering.spawn(
                async move {
                    // Anyone can publish an advertisement; only a scheduler can lease, so
                    // the resources are held for schedulers only.
                    let sent = match network.connect_as(source, Role::Scheduler).await {
                        Ok(()) => network.request(source, Request::Offer(offer)).await,
                        Err(e) => Err(e),
                    };
                    metrics::offer_sent(sent.is_ok());
                    if let Err(e) = sent {
                        tracing::info!(error = %e, "offer not delivered; freeing its resources");
                        let _ = internal.send(Internal::OfferFailed(lease)).await;
                    }
                }
                .instrument(tracing::info_span!("offer", lease)),
            );
        }
    }

    fn expire(&mut self) {
        for lease in self.leases.expire(Instant::now()) {
            metrics::leases_changed(-1);
            metrics::lease_expired(lease.stage == Stage::Renewable);
            let owner = self.owners.remove(&lease.id);
            if lease.stage == Stage::Renewable {
                tracing::warn!(lease = lease.id, scheduler = ?owner, "lease lapsed without renewal; stopping its jobs");
            }
            for job in self.jobs.jobs_under(lease.id) {
                self.jobs.cancel(&job, "its lease lapsed");
            }
        }
    }

    async fn answer(&mut self, request: InboundRequest) {
        let peer = request.peer;
        hypha_telemetry::propagation::set_parent(&tracing::Span::current(), &request.trace);
        let response = match request.request {
            Request::Lease(lease_request) => self.lease_request(peer, lease_request),
            Request::Dispatch(spec) => self.dispatch(peer, spec),
            Request::Cancel { job } => match self.jobs.scheduler_of(&job) {
                Some(owner) if owner == peer => {
                    self.jobs
                        .cancel(&job, format!("cancelled by its scheduler {peer}"));
                    Response::Ack
                }
                _ => error(ErrorCode::Gone, format!("no job {job} of yours runs here")),
            },
            Request::TaskPeers { task, peers } => {
                if self.jobs.inboxes().set_peers(peer, &task, &peers) {
                    tracing::debug!(scheduler = %peer, task, peers = peers.peers.len(), version = peers.version, "the task's peers changed");
                    Response::Ack
                } else {
                    error(
                        ErrorCode::Gone,
                        format!("no job of task {task} of yours runs here"),
                    )
                }
            }
            _ => error(
                ErrorCode::Unsupported,
                "workers answer health, lease, dispatch, cancel and task-peers requests",
            ),
        };
        let _ = request.responder.respond(response).await;
    }

    /// The lease `id` if `peer` holds it.
    fn owned(&self, peer: PeerId, id: LeaseId) -> Result<(), Response> {
        match self.owners.get(&id) {
            Some(owner) if *owner == peer => Ok(()),
            _ => Err(error(
                ErrorCode::Gone,
                format!(
                    "lease {id} is not held for you (it lapsed, was released, or is another scheduler's)"
                ),
            )),
        }
    }

    fn lease_request(&mut self, peer: PeerId, request: LeaseRequest) -> Response {
        let now = Instant::now();
        let period = self.config.lease;
        match request {
            LeaseRequest::Accept { lease } => {
                if let Err(refused) = self.owned(peer, lease) {
                    return refused;
                }
                match self.leases.accept(lease, period, now) {
                    Ok(_) => {
                        tracing::info!(scheduler = %peer, lease, "offer accepted");
                        grant(lease, period, Vec::new())
                    }
                    Err(e) => error(ErrorCode::Gone, format!("lease {lease}: {e}")),
                }
            }
            LeaseRequest::Renew { lease } => {
                if let Err(refused) = self.owned(peer, lease) {
                    metrics::lease_renewed(false);
                    return refused;
                }
                let renewed = self.leases.renew(lease, period, now);
                metrics::lease_renewed(renewed.is_ok());
                match renewed {
                    Ok(_) => grant(lease, period, self.jobs.jobs_under(lease)),
                    Err(e) => error(ErrorCode::Gone, format!("lease {lease}: {e}")),
                }
            }
            LeaseRequest::Release { lease } => {
                if let Err(refused) = self.owned(peer, lease) {
                    return refused;
                }
                self.owners.remove(&lease);
                if self.leases.release(lease).is_some() {
                    metrics::leases_changed(-1);
                    tracing::info!(scheduler = %peer, lease, "lease released");
                }
                for job in self.jobs.jobs_under(lease) {
                    self.jobs.cancel(&job, "its lease was released");
                }
                Response::Ack
            }
        }
    }

    fn dispatch(&mut self, peer: PeerId, spec: JobSpec) -> Response {
        if let Err(refused) = self.owned(peer, spec.lease) {
            return refused;
        }
        if !self.leases.is_accepted(spec.lease, Instant::now()) {
            return error(
                ErrorCode::BadRequest,
                format!("lease {} has not been accepted", spec.lease),
            );
        }
        let job = spec.id.clone();
        match self.jobs.start(spec, peer) {
            Ok(()) => {
                tracing::info!(scheduler = %peer, %job, "job dispatched");
                Response::Ack
            }
            Err(StartError::ForeignTask(foreign)) => {
                tracing::warn!(scheduler = %peer, owner = %foreign.owner, task = foreign.task, %job, "refused a job of a task another scheduler owns on this worker");
                error(ErrorCode::Forbidden, foreign.to_string())
            }
            Err(e) => error(ErrorCode::BadRequest, e.to_string()),
        }
    }

    fn job_ended(&mut self, ended: Ended) {
        if ended.status != JobStatus::Running {
            self.jobs.remove(&ended.job);
        }
        let network = self.network.clone();
        let report = StatusReport {
            job: ended.job,
            status: ended.status,
        };
        let scheduler = ended.scheduler;
        self.telling.spawn(async move {
            for attempt in 1..=STATUS_ATTEMPTS {
                match network
                    .request(scheduler, Request::JobStatus(report.clone()))
                    .await
                {
                    Ok(_) => return,
                    Err(e) if attempt == STATUS_ATTEMPTS => {
                        tracing::info!(%scheduler, job = %report.job, error = %e, "the scheduler did not take the job's status");
                    }
                    Err(_) => {
                        tokio::time::sleep(Duration::from_millis(200 * u64::from(attempt))).await
                    }
                }
            }
        });
    }
}

fn grant(lease: LeaseId, period: Duration, jobs: Vec<String>) -> Response {
    Response::Lease(LeaseGrant {
        lease,
        expires_in_ms: millis(period),
        jobs,
    })
}

fn error(code: ErrorCode, message: impl Into<String>) -> Response {
    Response::Error(RemoteError::new(code, message))
}

async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
