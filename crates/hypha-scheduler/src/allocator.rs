//! Finding, leasing and keeping workers: the scheduler's side of the market.
//!
//! [`Allocator::allocate`] advertises on gossip, collects the offers that come back for a
//! window, and chooses: at most one offer per worker, the cheapest **per weighted resource
//! unit** first ([`Weights`]), until it has as many workers as it needs. It accepts those
//! (in parallel), releases the offers it did not take so their workers are free at once, and
//! advertises again while workers are missing, until its deadline.
//!
//! Every accepted offer becomes a [`Lease`] that is renewed from the moment it is granted, at
//! a third of its period, so two renewals can fail before the worker gives up on it: a lease
//! is held while the job waits for other workers, for a dispatch, for anything. One that
//! cannot be renewed is reported as [`Lost`] (and marked so on its handle), and the caller
//! replaces the worker while the rest of the job goes on. Dropping a [`Lease`] stops renewing
//! and gives it back, so a lease is never held by nobody: an allocation abandoned halfway
//! releases what it had leased.
//!
//! Double booking is prevented on the worker's side: a worker holds every offer's resources
//! under a temporary lease until it is accepted or lapses, and answers lease requests only from
//! the scheduler the offer went to.

use std::{
    collections::{HashMap, HashSet},
    sync::{Arc, Mutex, OnceLock},
    time::{Duration, Instant},
};

use hypha_messages::{
    Request, Response,
    market::{
        Advertisement, ExecutorRef, LeaseGrant, LeaseRequest, MARKET_VERSION, Offer, Resources,
        WORKER_TOPIC,
    },
};
use hypha_network::{Network, NetworkError};
use libp2p::PeerId;
use tokio::{sync::mpsc, task::JoinSet};

use crate::unix_ms;

/// How much one unit of each resource weighs when offers are compared by price per unit.
/// The defaults make one CPU core, 4 GB of memory, 100 GB of storage and 1 GB of GPU memory
/// one unit each.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Weights {
    pub cpu: f64,
    pub memory: f64,
    pub storage: f64,
    pub gpu: f64,
}

impl Default for Weights {
    fn default() -> Self {
        Weights {
            cpu: 1.0,
            memory: 0.25,
            storage: 0.01,
            gpu: 1.0,
        }
    }
}

impl Weights {
    /// The weighted size of `resources`.
    pub fn units(&self, r: &Resources) -> f64 {
        r.cpu * self.cpu + r.memory * self.memory + r.storage * self.storage + r.gpu * self.gpu
    }
}

/// What the scheduler wants from each worker.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerRequest {
    pub executor: ExecutorRef,
    pub resources: Resources,
    /// The most the scheduler pays per worker and lease period.
    pub bid: f64,
}

/// How the allocator paces itself.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Settings {
    /// How long offers are collected after an advertisement before choosing.
    pub window: Duration,
    /// How long an advertisement stands; workers drop it afterwards.
    pub advertisement_lifetime: Duration,
    /// How often to advertise again while workers are missing.
    pub readvertise: Duration,
    /// How long [`Allocator::allocate`] tries before it gives up.
    pub timeout: Duration,
    pub weights: Weights,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            window: Duration::from_millis(200),
            advertisement_lifetime: Duration::from_secs(5),
            readvertise: Duration::from_secs(2),
            timeout: Duration::from_secs(60),
            weights: Weights::default(),
        }
    }
}

/// A worker's lease, renewed in the background until it is [released](Lease::release) or
/// dropped (which releases it too).
#[derive(Debug)]
pub struct Lease {
    pub peer: PeerId,
    /// The worker's id for the lease: unique per worker across its restarts.
    pub id: u64,
    pub price: f64,
    /// How long the worker holds the lease without renewal.
    pub period: Duration,
    renewal: tokio::task::JoinHandle<()>,
    lost: Arc<OnceLock<String>>,
    probe: Arc<tokio::sync::Notify>,
    allocator: Allocator,
}

impl Lease {
    /// Why the lease stopped being renewable, once it has.
    pub fn lost(&self) -> Option<&str> {
        self.lost.get().map(String::as_str)
    }

    /// Renews the lease now instead of at its time: the caller suspects the worker is gone
    /// (its job went quiet), and a worker that is gone is reported lost within about
    /// [`RETRY_LIMIT`].
    pub fn probe(&self) {
        self.probe.notify_one();
    }

    /// Stops renewing and gives the lease back now (dropping the handle does the same).
    pub fn release(self) {}
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.renewal.abort();
        if self.lost.get().is_none() {
            self.allocator.release(self.peer, self.id);
        }
    }
}

/// Why allocation failed.
#[derive(Debug, thiserror::Error)]
pub enum AllocationError {
    #[error(
        "found {found} of {wanted} workers for {executor} within {timeout:?}: are enough workers \
         with that executor online, with the resources asked, at or below the bid?"
    )]
    NotEnough {
        found: usize,
        wanted: usize,
        executor: ExecutorRef,
        timeout: Duration,
    },
    #[error(transparent)]
    Network(#[from] NetworkError),
}

/// A worker's lease that stopped being renewable.
#[derive(Debug, Clone, PartialEq)]
pub struct Lost {
    pub peer: PeerId,
    pub lease: u64,
    pub reason: String,
}

/// How often a lease of `period` is renewed: at a third of it, and no more often than every
/// 100 ms whatever period a worker grants.
fn renewal_interval(period: Duration) -> Duration {
    (period / 3).max(Duration::from_millis(100))
}

/// The longest a lease waits after a failed renewal before it tries again.
pub const RETRY_LIMIT: Duration = Duration::from_secs(1);

/// An offer and the worker that made it.
pub type OfferFrom = (PeerId, Offer);

type OfferRoutes = Arc<Mutex<HashMap<String, mpsc::Sender<(PeerId, Offer)>>>>;

/// The scheduler's side of the market. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Allocator {
    network: Network,
    settings: Settings,
    routes: OfferRoutes,
    /// Releases on their way to workers, so that [`settle`](Allocator::settle) can see them
    /// out before the network stops.
    releases: Arc<Mutex<JoinSet<()>>>,
}

impl Allocator {
    pub fn new(network: Network, settings: Settings) -> Self {
        Allocator {
            network,
            settings,
            routes: Arc::default(),
            releases: Arc::default(),
        }
    }

    /// Hands an inbound offer to the allocation waiting for it. Returns false when none is
    /// (the advertisement is closed): the caller answers so, and the worker frees its hold.
    pub fn offer_arrived(&self, peer: PeerId, offer: Offer) -> bool {
        let Ok(routes) = self.routes.lock() else {
            return false;
        };
        match routes.get(&offer.advertisement) {
            // A full queue means far more offers than anyone will take; dropping one lets its
            // hold lapse on the worker.
            Some(route) => route.try_send((peer, offer)).is_ok(),
            None => false,
        }
    }

    /// Leases up to `count` workers for `request`, none of them in `exclude`: all `count`, or
    /// as many as there are once `at_least` are found and an advertisement brought no more
    /// (with `at_least` 0: whoever answers one advertisement). Every lease is renewed from
    /// its grant on; one that stops being renewable is reported on `lost`. Fails when fewer
    /// than `at_least` are found within the timeout; then (or when the future is dropped) the
    /// leases found so far are released.
    pub async fn allocate(
        &self,
        request: &WorkerRequest,
        (at_least, count): (usize, usize),
        exclude: &HashSet<PeerId>,
        lost: &mpsc::Sender<Lost>,
    ) -> Result<Vec<Lease>, AllocationError> {
        let started = Instant::now();
        let deadline = started + self.settings.timeout;
        let mut leased: Vec<Lease> = Vec::new();
        let mut advertised = false;
        while leased.len() < count && !(advertised && leased.len() >= at_least) {
            let now = Instant::now();
            if now >= deadline {
                return Err(AllocationError::NotEnough {
                    found: leased.len(),
                    wanted: at_least,
                    executor: request.executor.clone(),
                    timeout: self.settings.timeout,
                });
            }
            advertised = true;
            let taken: HashSet<PeerId> = leased
                .iter()
                .map(|l| l.peer)
                .chain(exclude.iter().copied())
                .collect();
            let round_end = (now + self.settings.readvertise).min(deadline);
            // Optional workers are taken as soon as one answers: a joiner should not wait for
            // offers that will not come.
            let wanted = count - leased.len();
            let enough = if at_least == 0 { 1 } else { wanted };
            let more = self
                .round(request, (enough, wanted), &taken, round_end, lost)
                .await?;
            leased.extend(more);
        }
        tracing::info!(workers = leased.len(), elapsed = ?started.elapsed(), "workers leased");
        Ok(leased)
    }

    /// One advertisement: publish, collect offers (once `enough` are in, for the window
    /// only), choose up to `needed`, accept.
    async fn round(
        &self,
        request: &WorkerRequest,
        (enough, needed): (usize, usize),
        taken: &HashSet<PeerId>,
        round_end: Instant,
        lost: &mpsc::Sender<Lost>,
    ) -> Result<Vec<Lease>, AllocationError> {
        let id = uuid::Uuid::new_v4().to_string();
        let (tx, mut offers) = mpsc::channel(1024);
        if let Ok(mut routes) = self.routes.lock() {
            routes.insert(id.clone(), tx);
        }
        let _route = RouteGuard {
            routes: self.routes.clone(),
            id: id.clone(),
        };
        let advertisement = Advertisement {
            version: MARKET_VERSION,
            id: id.clone(),
            resources: request.resources,
            executor: request.executor.clone(),
            bid: request.bid,
            deadline_ms: unix_ms() + millis(self.settings.advertisement_lifetime),
        };
        self.publish(&advertisement, round_end).await?;
        let window_end = (Instant::now() + self.settings.window).min(round_end);

        let mut received: Vec<(PeerId, Offer)> = Vec::new();
        loop {
            // Choose once the window is over and enough offers are in, or when the round ends.
            let until = match distinct_peers(&received, taken) >= enough {
                true => window_end,
                false => round_end,
            };
            let now = Instant::now();
            if now >= until {
                break;
            }
            match tokio::time::timeout(until - now, offers.recv()).await {
                Ok(Some(offer)) => received.push(offer),
                Ok(None) | Err(_) => {
                    if Instant::now() >= until {
                        break;
                    }
                }
            }
        }
        drop(_route);
        // Offers that raced the route's removal still hold resources; they lapse on the
        // worker by themselves.
        while let Ok(offer) = offers.try_recv() {
            received.push(offer);
        }
        let (chosen, declined) =
            choose(received, needed, taken, request.bid, &self.settings.weights);
        for (peer, offer) in declined {
            self.release(peer, offer.lease);
        }
        let accepts = chosen.into_iter().map(|(peer, offer)| {
            let network = self.network.clone();
            let lost = lost.clone();
            async move {
                match network
                    .request(
                        peer,
                        Request::Lease(LeaseRequest::Accept { lease: offer.lease }),
                    )
                    .await
                {
                    Ok(Response::Lease(LeaseGrant {
                        lease,
                        expires_in_ms,
                        ..
                    })) => Some(self.hold(
                        peer,
                        lease,
                        offer.price,
                        Duration::from_millis(expires_in_ms),
                        lost.clone(),
                    )),
                    Ok(_) => None,
                    Err(e) => {
                        tracing::info!(%peer, error = %e, "accepting the offer failed");
                        None
                    }
                }
            }
        });
        Ok(futures::future::join_all(accepts)
            .await
            .into_iter()
            .flatten()
            .collect())
    }

    async fn publish(&self, ad: &Advertisement, until: Instant) -> Result<(), AllocationError> {
        // Gossipsub refuses to publish until it knows a peer on the topic, which takes a
        // moment after joining; keep trying until the round is over.
        loop {
            match self.network.publish(WORKER_TOPIC, ad.to_gossip()).await {
                Ok(()) => return Ok(()),
                Err(NetworkError::Gossip(reason)) if Instant::now() < until => {
                    tracing::debug!(%reason, "advertisement not published yet");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(NetworkError::Gossip(_)) => return Ok(()),
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Takes over lease `id` on `peer`, granted to an earlier run of this scheduler (same
    /// peer id) at `price`: renewed now, and from then on like any other; lost ones are
    /// reported on `lost`. Returns the lease and the jobs still running under it. Fails when
    /// the worker no longer holds the lease (it lapsed or was released) or cannot be reached.
    pub async fn adopt(
        &self,
        peer: PeerId,
        id: u64,
        price: f64,
        lost: &mpsc::Sender<Lost>,
    ) -> Result<(Lease, Vec<String>), String> {
        match self
            .network
            .request(peer, Request::Lease(LeaseRequest::Renew { lease: id }))
            .await
        {
            Ok(Response::Lease(grant)) => Ok((
                self.hold(
                    peer,
                    id,
                    price,
                    Duration::from_millis(grant.expires_in_ms),
                    lost.clone(),
                ),
                grant.jobs,
            )),
            Ok(_) => Err("unexpected answer to a renewal".into()),
            Err(error) => Err(error.to_string()),
        }
    }

    /// Gives a lease back without waiting for the answer ([`settle`](Self::settle) waits).
    /// Outside a runtime (a handle dropped while the program ends) the lease lapses instead.
    fn release(&self, peer: PeerId, lease: u64) {
        if tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        let network = self.network.clone();
        let mut releases = self.releases.lock().unwrap_or_else(|p| p.into_inner());
        while releases.try_join_next().is_some() {}
        releases.spawn(async move {
            let _ = network
                .request(peer, Request::Lease(LeaseRequest::Release { lease }))
                .await;
        });
    }

    /// Waits up to `limit` for every release to reach its worker, so that a scheduler that
    /// stops right after its job frees its workers at once instead of letting their leases
    /// lapse.
    pub async fn settle(&self, limit: Duration) {
        let mut pending =
            std::mem::take(&mut *self.releases.lock().unwrap_or_else(|p| p.into_inner()));
        let all = async { while pending.join_next().await.is_some() {} };
        if tokio::time::timeout(limit, all).await.is_err() {
            tracing::debug!("some lease releases did not complete; those leases will lapse");
        }
    }

    /// Starts renewing a granted lease: at a third of its period, and after a failure once
    /// more, sooner; a refusal, two failures in a row or a lease about to lapse make it lost.
    fn hold(
        &self,
        peer: PeerId,
        id: u64,
        price: f64,
        period: Duration,
        lost: mpsc::Sender<Lost>,
    ) -> Lease {
        let network = self.network.clone();
        let lost_reason = Arc::new(OnceLock::new());
        let mark = lost_reason.clone();
        let probe = Arc::new(tokio::sync::Notify::new());
        let probed = probe.clone();
        let renewal = tokio::spawn(async move {
            let mut expires = Instant::now() + period;
            let mut interval = renewal_interval(period);
            let mut failures = 0u32;
            loop {
                tokio::select! {
                    () = tokio::time::sleep(interval) => {}
                    () = probed.notified() => {}
                }
                match network
                    .request(peer, Request::Lease(LeaseRequest::Renew { lease: id }))
                    .await
                {
                    Ok(Response::Lease(grant)) => {
                        let period = Duration::from_millis(grant.expires_in_ms);
                        expires = Instant::now() + period;
                        interval = renewal_interval(period);
                        failures = 0;
                    }
                    result => {
                        let (reason, refused) = match result {
                            Err(NetworkError::Remote { error, .. }) => (error.to_string(), true),
                            Err(e) => (e.to_string(), false),
                            Ok(_) => ("unexpected answer to a renewal".to_string(), true),
                        };
                        failures += 1;
                        let left = expires.saturating_duration_since(Instant::now());
                        // A refusal is final. An unreachable worker gets one more try, sooner:
                        // a dropped connection may come back, but two failures in a row mean
                        // the worker is gone, and replacing it early keeps the job going.
                        if refused || failures >= 2 || left < Duration::from_millis(100) {
                            let _ = mark.set(reason.clone());
                            let _ = lost
                                .send(Lost {
                                    peer,
                                    lease: id,
                                    reason,
                                })
                                .await;
                            return;
                        }
                        tracing::info!(%peer, lease = id, %reason, "renewal failed; retrying");
                        interval = (left / 4).clamp(Duration::from_millis(50), RETRY_LIMIT);
                    }
                }
            }
        });
        Lease {
            peer,
            id,
            price,
            period,
            renewal,
            lost: lost_reason,
            probe,
            allocator: self.clone(),
        }
    }
}

struct RouteGuard {
    routes: OfferRoutes,
    id: String,
}

impl Drop for RouteGuard {
    fn drop(&mut self) {
        if let Ok(mut routes) = self.routes.lock() {
            routes.remove(&self.id);
        }
    }
}

fn distinct_peers(offers: &[(PeerId, Offer)], taken: &HashSet<PeerId>) -> usize {
    offers
        .iter()
        .map(|(p, _)| p)
        .filter(|p| !taken.contains(p))
        .collect::<HashSet<_>>()
        .len()
}

/// Splits `offers` into the `needed` cheapest per weighted unit (one per peer, none from
/// `taken`, none above `bid`) and the rest.
pub fn choose(
    offers: Vec<OfferFrom>,
    needed: usize,
    taken: &HashSet<PeerId>,
    bid: f64,
    weights: &Weights,
) -> (Vec<OfferFrom>, Vec<OfferFrom>) {
    let per_unit = |o: &Offer| {
        let units = weights.units(&o.resources);
        if units > 0.0 {
            o.price / units
        } else {
            f64::INFINITY
        }
    };
    let mut candidates = offers;
    candidates.sort_by(|(pa, a), (pb, b)| {
        per_unit(a)
            .total_cmp(&per_unit(b))
            .then(a.price.total_cmp(&b.price))
            .then(pa.cmp(pb))
    });
    let mut chosen = Vec::new();
    let mut declined = Vec::new();
    let mut peers: HashSet<PeerId> = taken.clone();
    for (peer, offer) in candidates {
        if chosen.len() < needed && offer.price <= bid && peers.insert(peer) {
            chosen.push((peer, offer));
        } else {
            declined.push((peer, offer));
        }
    }
    (chosen, declined)
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
