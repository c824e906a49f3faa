//! The worker's data path: a size-limited slice cache, and per job a prefetcher that keeps
//! verified slices ready ahead of the executor.
//!
//! The cache holds slices as their data nodes serve them (Snappy-compressed or plain), one file
//! per BLAKE3 hash, so a slice is fetched once however many epochs and jobs use it, and every
//! use can check the bytes again against the hash the scheduler granted it with. It is filled
//! only with verified, fsynced files and empties least recently used first when over its limit.
//!
//! A [`Prefetcher`] asks the scheduler's ledger for slices (telling it which slices the cache
//! holds, so those are preferred), fetches them into the cache, decodes each to a plain
//! SafeTensors file in its private staging directory (fsynced, SHA-256 computed), and queues
//! them for the executor, up to `prefetch_bytes` and [`MAX_AHEAD`] slices ahead (always at
//! least one). Handing a slice over is then one rename ([`Ready::place`]): the executor waits
//! for nothing the prefetcher could have done earlier. When the queue is full it
//! keeps the ledger's lease on the queued slices alive. It stops when the iteration is done or
//! the job ends; queued slices the executor never took go back to the ledger when the scheduler
//! releases the job.

use std::{
    collections::{HashMap, HashSet},
    ffi::OsStr,
    io::Write,
    os::fd::OwnedFd,
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use hypha_data::{DataClient, SliceId};
use hypha_messages::iterate::{
    GrantedSlice, IterateGrant, IterateRequest, IterateStatus, SliceRef,
};
use hypha_network::{Network, PeerId};
use rustix::fs::{Mode, OFlags};
use sha2::{Digest, Sha256};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio_util::sync::CancellationToken;

use crate::metrics;

/// The directory under the cache where prefetchers stage decoded slices.
const STAGING: &str = "staging";

/// Slices asked for in one request at most.
const MAX_BATCH: u32 = 8;
/// Slices a job's prefetcher holds ahead of its executor at most, whatever their size: enough
/// to ride out a slow fetch, few enough that a slow worker does not hoard slices the others
/// could use.
const MAX_AHEAD: usize = 16;
/// Slices fetched at the same time by one prefetcher.
const PARALLEL_FETCHES: usize = 2;
/// How often a prefetcher whose queue is full tells the ledger it is alive (its lease is 60 s).
const HEARTBEAT: Duration = Duration::from_secs(15);
/// How long a prefetcher waits after a failed request before trying again.
const BACKOFF: Duration = Duration::from_secs(1);

/// Verified slices kept on disk, at most `limit` bytes, least recently used first out.
#[derive(Debug)]
pub struct SliceCache {
    dir: PathBuf,
    limit: u64,
    state: Mutex<CacheState>,
}

#[derive(Debug, Default)]
struct CacheState {
    /// BLAKE3 → (size, last use).
    files: HashMap<String, (u64, u64)>,
    /// Per dataset, the slice numbers whose files are here, with their hash.
    slices: HashMap<String, HashMap<u64, String>>,
    total: u64,
    clock: u64,
}

impl SliceCache {
    /// Opens the cache in `dir`, adopting the files a previous run left (their slice numbers
    /// are learnt again as slices are granted).
    pub fn open(dir: PathBuf, limit: u64) -> std::io::Result<Self> {
        std::fs::create_dir_all(&dir)?;
        // Staged slices of jobs that ended with an earlier run.
        let _ = std::fs::remove_dir_all(dir.join(STAGING));
        let mut state = CacheState::default();
        for entry in std::fs::read_dir(&dir)? {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(hash) = name.strip_suffix(".slice") else {
                // Leftovers of interrupted fetches.
                if name.starts_with(".hypha-slice-") {
                    let _ = std::fs::remove_file(entry.path());
                }
                continue;
            };
            let size = entry.metadata()?.len();
            state.files.insert(hash.to_string(), (size, 0));
            state.total += size;
        }
        Ok(Self {
            dir,
            limit,
            state: Mutex::new(state),
        })
    }

    fn path(&self, blake3: &str) -> PathBuf {
        self.dir.join(format!("{blake3}.slice"))
    }

    /// The cached file of `slice`, if the cache holds it.
    fn lookup(&self, dataset: &str, slice: &GrantedSlice) -> Option<PathBuf> {
        let mut state = self.state.lock().ok()?;
        state.clock += 1;
        let clock = state.clock;
        let (size, used) = state.files.get_mut(&slice.blake3)?;
        if *size != slice.size {
            return None;
        }
        *used = clock;
        state
            .slices
            .entry(dataset.to_string())
            .or_default()
            .insert(slice.slice, slice.blake3.clone());
        Some(self.path(&slice.blake3))
    }

    /// Records a verified file now at `self.path(hash)`, and makes room.
    fn insert(&self, dataset: &str, slice: &GrantedSlice) {
        let Ok(mut state) = self.state.lock() else {
            return;
        };
        state.clock += 1;
        let clock = state.clock;
        if state
            .files
            .insert(slice.blake3.clone(), (slice.size, clock))
            .is_none()
        {
            state.total += slice.size;
        }
        state
            .slices
            .entry(dataset.to_string())
            .or_default()
            .insert(slice.slice, slice.blake3.clone());
        while state.total > self.limit && state.files.len() > 1 {
            let Some(oldest) = state
                .files
                .iter()
                .filter(|(hash, _)| **hash != slice.blake3)
                .min_by_key(|(_, (_, used))| *used)
                .map(|(hash, _)| hash.clone())
            else {
                break;
            };
            if let Some((size, _)) = state.files.remove(&oldest) {
                state.total -= size;
            }
            for slices in state.slices.values_mut() {
                slices.retain(|_, hash| *hash != oldest);
            }
            let _ = std::fs::remove_file(self.path(&oldest));
        }
    }

    /// Forgets a file that failed its check.
    fn remove(&self, blake3: &str) {
        if let Ok(mut state) = self.state.lock()
            && let Some((size, _)) = state.files.remove(blake3)
        {
            state.total -= size;
            for slices in state.slices.values_mut() {
                slices.retain(|_, hash| hash != blake3);
            }
        }
        let _ = std::fs::remove_file(self.path(blake3));
    }

    /// The slice numbers of `dataset` the cache holds.
    fn held(&self, dataset: &str) -> Vec<u64> {
        self.state
            .lock()
            .ok()
            .and_then(|state| {
                state
                    .slices
                    .get(dataset)
                    .map(|s| s.keys().copied().collect())
            })
            .unwrap_or_default()
    }

    /// Bytes held.
    pub fn size(&self) -> u64 {
        self.state.lock().map_or(0, |state| state.total)
    }
}

/// Where a job's slices come from.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Source {
    pub scheduler: PeerId,
    pub dataset: String,
    /// The scheduler's iteration (the job's task).
    pub iteration: String,
    /// The job, as the ledger knows it.
    pub consumer: String,
    pub epochs: u32,
    pub seed: u64,
}

/// A slice ready for the executor: verified, decoded to plain SafeTensors and fsynced in the
/// prefetcher's staging directory, so that handing it over is one rename.
#[derive(Debug)]
pub struct Ready {
    pub slice: GrantedSlice,
    /// Which data node sent it, or `None` when the cache had it.
    pub provider: Option<PeerId>,
    /// The plain file's size and SHA-256 (hex).
    pub size: u64,
    pub sha256: String,
    staged: String,
    staging: Arc<Staging>,
    /// Hold the slice's share of the prefetch budget and its place ahead until the executor
    /// takes it.
    _budget: OwnedSemaphorePermit,
    _ahead: OwnedSemaphorePermit,
}

impl Ready {
    /// Moves the plain file to `name` in the directory `parent` (on the same file system as
    /// the worker's `work_dir`). The file was fsynced when staged; the rename is not, since a
    /// crash ends the job that would read it anyway.
    pub fn place(self, parent: &OwnedFd, name: &OsStr) -> std::io::Result<()> {
        rustix::fs::renameat(&self.staging.fd, self.staged.as_str(), parent, name)?;
        Ok(())
    }
}

/// A prefetcher's private directory under the cache, removed with the prefetcher.
#[derive(Debug)]
struct Staging {
    path: PathBuf,
    fd: OwnedFd,
}

impl Drop for Staging {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// What the executor gets next.
#[derive(Debug)]
pub enum Next {
    Slice(Box<Ready>),
    /// The iteration is done.
    Finished,
    /// The prefetcher could not get a slice; it goes on trying.
    Failed(String),
}

/// The slices granted to a job that it has not reported consumed: queued, being fetched, or
/// in the executor's hands. Every request for more tells the ledger, which takes back any
/// other slice it assigned to the job: a grant whose answer never arrived. Shared by the
/// job's prefetcher and its bridge (which reports what the executor consumed).
#[derive(Debug, Clone, Default)]
pub struct Holding(Arc<std::sync::Mutex<HashSet<SliceRef>>>);

impl Holding {
    fn slices(&self) -> std::sync::MutexGuard<'_, HashSet<SliceRef>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes `slice` in; false when the job holds it already.
    pub fn take(&self, slice: SliceRef) -> bool {
        self.slices().insert(slice)
    }

    /// The job no longer holds these: consumed, or never to be fetched.
    pub fn let_go(&self, slices: &[SliceRef]) {
        let mut held = self.slices();
        for slice in slices {
            held.remove(slice);
        }
    }

    /// Every slice the job holds now.
    pub fn list(&self) -> Vec<SliceRef> {
        self.slices().iter().copied().collect()
    }
}

/// Keeps one job's next slices ready; stops when dropped.
#[derive(Debug)]
pub struct Prefetcher {
    queue: mpsc::Receiver<Next>,
    finished: bool,
    stop: CancellationToken,
}

impl Drop for Prefetcher {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl Prefetcher {
    /// Starts prefetching for `source`, at most `budget` bytes ahead; what it was granted goes
    /// into `holding` (and leaves it when the job reports it consumed).
    pub fn start(
        network: Network,
        cache: Arc<SliceCache>,
        source: Source,
        budget: u64,
        holding: Holding,
    ) -> std::io::Result<Self> {
        let path = cache
            .dir
            .join(STAGING)
            .join(format!("{:016x}", rand::random::<u64>()));
        std::fs::create_dir_all(&path)?;
        let fd = rustix::fs::open(
            &path,
            OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        let staging = Arc::new(Staging { path, fd });
        // The budget counts KiB so that any realistic budget fits a semaphore.
        let budget_kib = usize::try_from(budget.div_ceil(1024))
            .unwrap_or(Semaphore::MAX_PERMITS)
            .clamp(1, Semaphore::MAX_PERMITS);
        let (sender, queue) = mpsc::channel(1024);
        let stop = CancellationToken::new();
        let run = Run {
            client: DataClient::new(network.clone()),
            network,
            cache,
            source,
            budget: Arc::new(Semaphore::new(budget_kib)),
            budget_kib,
            ahead: Arc::new(Semaphore::new(MAX_AHEAD)),
            slice_kib: AtomicU64::new(u64::MAX),
            queue: sender,
            staging,
            holding,
        };
        // Owned by the `Prefetcher`: dropping it cancels `stop`, which ends the task.
        tokio::spawn({
            let stop = stop.clone();
            async move {
                tokio::select! {
                    _ = run.run() => {}
                    _ = stop.cancelled() => {}
                }
            }
        });
        Ok(Self {
            queue,
            finished: false,
            stop,
        })
    }

    /// The next slice, waiting while none is ready.
    pub async fn next(&mut self) -> Next {
        if self.finished {
            return Next::Finished;
        }
        match self.queue.recv().await {
            Some(Next::Slice(ready)) => {
                metrics::prefetch_depth(-1);
                Next::Slice(ready)
            }
            Some(Next::Failed(why)) => Next::Failed(why),
            Some(Next::Finished) | None => {
                self.finished = true;
                Next::Finished
            }
        }
    }
}

struct Run {
    network: Network,
    client: DataClient,
    cache: Arc<SliceCache>,
    source: Source,
    budget: Arc<Semaphore>,
    budget_kib: usize,
    ahead: Arc<Semaphore>,
    /// The size of recent slices, in KiB; `u64::MAX` until the first grant, so that the
    /// first request asks for one slice.
    slice_kib: AtomicU64,
    queue: mpsc::Sender<Next>,
    staging: Arc<Staging>,
    holding: Holding,
}

impl Run {
    async fn run(self) {
        loop {
            // Room for at least one more slice (a slice larger than the whole budget takes
            // all of it).
            let room = async {
                let ahead = self.ahead.clone().acquire_owned().await;
                let budget = self.budget.clone().acquire_owned().await;
                ahead.is_ok() && budget.is_ok()
            };
            tokio::pin!(room);
            loop {
                tokio::select! {
                    open = &mut room => if open { break } else { return },
                    _ = tokio::time::sleep(HEARTBEAT) => {
                        // Full: keep the lease on what is queued.
                        let _ = self.ask(0).await;
                    }
                }
            }
            // Ask for as many as fit, going by the slices seen so far, so that granted slices
            // rarely wait for room (while they wait, their lease is not renewed).
            let free_kib = self.budget.available_permits().max(1) as u64;
            let want = (free_kib / self.slice_kib.load(Ordering::Relaxed).max(1))
                .min(self.ahead.available_permits() as u64)
                .clamp(1, u64::from(MAX_BATCH)) as u32;
            let grant = match self.ask(want).await {
                Ok(grant) => grant,
                Err(why) => {
                    if self.queue.send(Next::Failed(why)).await.is_err() {
                        return;
                    }
                    tokio::time::sleep(BACKOFF).await;
                    continue;
                }
            };
            match grant.status {
                IterateStatus::Finished => {
                    let _ = self.queue.send(Next::Finished).await;
                    return;
                }
                IterateStatus::Wait { retry_ms } => {
                    tokio::time::sleep(Duration::from_millis(retry_ms)).await;
                    continue;
                }
                IterateStatus::Granted => {}
            }
            // A slice the job holds already (its consume report lost when a scheduler died,
            // given back at the restart, and granted to it again) is not fetched twice.
            let fresh: Vec<GrantedSlice> = grant
                .slices
                .into_iter()
                .filter(|s| {
                    self.holding.take(SliceRef {
                        epoch: s.epoch,
                        slice: s.slice,
                    })
                })
                .collect();
            if let Some(largest) = fresh.iter().map(|s| s.size.div_ceil(1024)).max() {
                self.slice_kib.store(largest, Ordering::Relaxed);
            }
            let fetches = fresh.into_iter().map(|slice| self.fetch(slice));
            let mut fetched =
                futures::StreamExt::buffered(futures::stream::iter(fetches), PARALLEL_FETCHES);
            while let Some(next) = futures::StreamExt::next(&mut fetched).await {
                if matches!(next, Next::Slice(_)) {
                    metrics::prefetch_depth(1);
                }
                if self.queue.send(next).await.is_err() {
                    return;
                }
            }
        }
    }

    /// Asks the ledger for `want` slices (0: only renews the lease).
    async fn ask(&self, want: u32) -> Result<IterateGrant, String> {
        let request = IterateRequest {
            iteration: self.source.iteration.clone(),
            dataset: self.source.dataset.clone(),
            consumer: self.source.consumer.clone(),
            epochs: self.source.epochs,
            seed: self.source.seed,
            want,
            cached: if want > 0 {
                self.cache.held(&self.source.dataset)
            } else {
                Vec::new()
            },
            consumed: Vec::new(),
            round: 0,
            completed_round: None,
            // Asked with the answer to the last request in: what it does not list was never
            // received.
            holding: (want > 0).then(|| self.holding.list()),
            share_with: Vec::new(),
        };
        hypha_data::iteration::ask(&self.network, self.source.scheduler, request)
            .await
            .map_err(|e| format!("the job's scheduler {e}"))
    }

    /// Takes a slice's share of the budget, then brings it into the cache (verified). A slice
    /// that cannot be brought is no longer held: the ledger takes it back at the next request,
    /// for a job (this one, later) that reaches its providers.
    async fn fetch(&self, slice: GrantedSlice) -> Next {
        let key = SliceRef {
            epoch: slice.epoch,
            slice: slice.slice,
        };
        let next = self.bring(slice).await;
        if matches!(next, Next::Failed(_)) {
            self.holding.let_go(&[key]);
        }
        next
    }

    async fn bring(&self, slice: GrantedSlice) -> Next {
        let kib = usize::try_from(slice.size.div_ceil(1024))
            .unwrap_or(usize::MAX)
            .clamp(1, self.budget_kib);
        let (Ok(ahead), Ok(budget)) = (
            self.ahead.clone().acquire_owned().await,
            self.budget.clone().acquire_many_owned(kib as u32).await,
        ) else {
            return Next::Failed("the job is ending".into());
        };
        let dataset = &self.source.dataset;
        // A cached copy is checked again; one that fails leaves the cache and is fetched.
        if let Some(path) = self.cache.lookup(dataset, &slice) {
            match self.stage(&path, &slice, true).await {
                Ok((size, sha256, staged)) => {
                    metrics::slice_fetched("cache", 0);
                    return Next::Slice(Box::new(Ready {
                        slice,
                        provider: None,
                        size,
                        sha256,
                        staged,
                        staging: self.staging.clone(),
                        _budget: budget,
                        _ahead: ahead,
                    }));
                }
                Err(why) => {
                    tracing::warn!(slice = slice.slice, %why, "dropped a cached slice; fetching it again");
                    self.cache.remove(&slice.blake3);
                }
            }
        }
        let providers: Vec<PeerId> = slice
            .providers
            .iter()
            .filter_map(|p| p.parse().ok())
            .collect();
        let path = self.cache.path(&slice.blake3);
        let id = SliceId {
            index: slice.slice,
            file: Some(slice.file.clone()),
            size: slice.size,
            blake3: slice.blake3.clone(),
        };
        let report = match self
            .client
            .fetch_slice(dataset, id, &providers, &path)
            .await
        {
            Ok(report) => report,
            Err(e) => {
                return Next::Failed(format!(
                    "epoch {} slice {} of {dataset:?}: {e}",
                    slice.epoch, slice.slice
                ));
            }
        };
        self.cache.insert(dataset, &slice);
        metrics::slice_fetched("network", slice.size);
        match self.stage(&path, &slice, false).await {
            Ok((size, sha256, staged)) => Next::Slice(Box::new(Ready {
                slice,
                provider: Some(report.provider),
                size,
                sha256,
                staged,
                staging: self.staging.clone(),
                _budget: budget,
                _ahead: ahead,
            })),
            Err(why) => Next::Failed(why),
        }
    }

    /// Decodes the cached file at `path` into the staging directory (checking its hash first
    /// when `check`); returns the plain file's size, SHA-256 and name.
    async fn stage(
        &self,
        path: &Path,
        slice: &GrantedSlice,
        check: bool,
    ) -> Result<(u64, String, String), String> {
        let path = path.to_path_buf();
        let blake3 = slice.blake3.clone();
        let name = format!("e{}-slice-{}.safetensors", slice.epoch, slice.slice);
        let dir = self.staging.path.clone();
        tokio::task::spawn_blocking(move || {
            let bytes = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
            if check && blake3::hash(&bytes).to_hex().as_str() != blake3 {
                return Err(format!("{} does not match its hash", path.display()));
            }
            let (_, plain) =
                hypha_dataset::slice::decode(&bytes).map_err(|e| format!("not a slice: {e}"))?;
            let staged = dir.join(&name);
            let mut file =
                std::fs::File::create(&staged).map_err(|e| format!("{}: {e}", staged.display()))?;
            file.write_all(&plain)
                .and_then(|()| file.sync_all())
                .map_err(|e| format!("{}: {e}", staged.display()))?;
            let sha256 = hex::encode(Sha256::digest(&plain));
            Ok((plain.len() as u64, sha256, name))
        })
        .await
        .map_err(|e| e.to_string())?
    }
}

/// Where a worker keeps its cache.
pub fn cache_dir(work_dir: &Path) -> PathBuf {
    work_dir.join(".slices")
}
