//! [`Distributor`]: a node's handle on artifact distribution: fetch, seed, settle.

use hypha_messages::artifact::{Published, Request};
use std::{
    collections::HashMap,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    sync::{Arc, Mutex, Weak},
    time::Duration,
};

use hypha_network::{Network, NetworkError, PeerId};
use tokio::{
    sync::{mpsc, watch},
    task::JoinSet,
};

use crate::{
    Settings,
    assembly::{Assembly, part_path},
    cache::{Cache, CacheError, Record, Stamp, make_read_only, stamp_and_read_tree},
    contents::Contents,
    manifest::{ArtifactId, Manifest, auto_chunk_size},
    origin::{Origin, OriginError, Origins},
    protocol::{
        CHUNK_PROTOCOL, ChunkErrorCode, HelloReply, SWARM_PROTOCOL, SwarmMessage, read_frame,
        write_frame,
    },
    published::{self, PUBLISHED_PROTOCOL, Publications},
    swarm::{self, Context, Event, Failure, Held, Holding, Progress},
    unpack::{UnpackError, unpack},
};

/// The cache's name for a fetch of `published` to `destination`.
fn published_request(published: &Published, destination: &Path) -> Request {
    Request {
        profile: format!("published:{}", published.peer),
        uri: published.name.clone(),
        kind: crate::Kind::Object,
        destination: destination.to_path_buf(),
        unpack: None,
    }
}

/// How long a peer may take to send its hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// A fetch failed.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error(transparent)]
    Origin(#[from] OriginError),
    #[error(transparent)]
    Cache(#[from] CacheError),
    #[error(transparent)]
    Unpack(#[from] UnpackError),
    #[error(transparent)]
    Network(#[from] NetworkError),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("artifact {artifact}: {reason}")]
    Failed {
        artifact: ArtifactId,
        reason: String,
    },
    #[error("artifact {artifact} changed at the origin twice while being fetched: {reason}")]
    Changed {
        artifact: ArtifactId,
        reason: String,
    },
    #[error("{destination}: the same artifact is already being fetched to {other} on this node")]
    Busy {
        destination: PathBuf,
        other: PathBuf,
    },
}

/// Which peers a fetch lets into this node's swarm of the artifact (and fetch chunks here):
/// those a job or request on this node names, such as the workers of the job's task.
#[derive(Clone)]
pub struct Admission {
    admits: Arc<dyn Fn(&PeerId) -> bool + Send + Sync>,
    named: Option<Arc<dyn Fn() -> Vec<PeerId> + Send + Sync>>,
}

impl Admission {
    pub fn new(admits: impl Fn(&PeerId) -> bool + Send + Sync + 'static) -> Admission {
        Admission {
            admits: Arc::new(admits),
            named: None,
        }
    }

    /// Names the peers expected to fetch the artifact too (the workers of a job's task, as
    /// its scheduler said): while the swarm waits for the members it expects, it dials them
    /// itself and does not wait for the DHT to find them, which on a loaded network can take
    /// longer than the join timeout (a member found too late reads its own turns of a ring
    /// the others never saw, and the origin sends those chunks twice).
    pub fn naming(mut self, named: impl Fn() -> Vec<PeerId> + Send + Sync + 'static) -> Admission {
        self.named = Some(Arc::new(named));
        self
    }

    pub fn admits(&self, peer: &PeerId) -> bool {
        (self.admits)(peer)
    }

    /// The peers it names (see [`naming`](Self::naming)); none if it names nobody.
    pub fn named(&self) -> Vec<PeerId> {
        self.named.as_ref().map(|named| named()).unwrap_or_default()
    }
}

impl std::fmt::Debug for Admission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Admission(..)")
    }
}

/// How one fetch behaves.
#[derive(Debug, Clone, Default)]
pub struct FetchOptions {
    /// Members (this node included) to wait for, at most `Settings::join_timeout`, before
    /// pulling anything, so that the first chunks are not pulled by whoever happened to start
    /// first, and every member knows which chunks are whose to read from the origin. 0 or 1:
    /// start at once.
    pub expect: usize,
    /// Receives this node's view of the distribution as it changes.
    pub progress: Option<watch::Sender<Progress>>,
    /// Who may join this node's swarm of the artifact; `None`: any certified peer that names
    /// it (for fetches by hand, where each node's operator asked for the artifact). While
    /// several fetches of one artifact are in the swarm, a peer any of them admits is in.
    pub admission: Option<Admission>,
}

/// A completed fetch.
#[derive(Debug, Clone)]
pub struct Fetched {
    pub artifact: ArtifactId,
    /// The files, at their destinations.
    pub files: Vec<PathBuf>,
    /// Where the archive was unpacked, if asked.
    pub unpacked: Option<PathBuf>,
    /// Served from this node's cache without a transfer.
    pub from_cache: bool,
    pub progress: Progress,
    /// What the files and the unpacked tree hold, for a copy of them to be checked against.
    pub contents: Contents,
}

/// A node's artifact distribution. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Distributor {
    inner: Arc<Inner>,
    /// The loops serving the artifact protocols' streams, and the streams they serve: they
    /// end when the last handle is dropped.
    _accepting: Arc<JoinSet<()>>,
}

#[derive(Debug)]
struct Inner {
    network: Network,
    origins: Origins,
    cache: Arc<Cache>,
    settings: Settings,
    swarms: Mutex<HashMap<ArtifactId, Member>>,
    publications: Arc<Publications>,
}

/// A swarm this node is in.
#[derive(Debug)]
struct Member {
    events: mpsc::Sender<Event>,
    holding: Arc<Holding>,
    progress: watch::Receiver<Progress>,
    destination: PathBuf,
    /// A fetch without an [`Admission`] let everyone in.
    anyone: bool,
    admissions: Vec<Admission>,
}

impl Member {
    fn admits(&self, peer: &PeerId) -> bool {
        self.anyone || self.admissions.iter().any(|a| a.admits(peer))
    }

    fn named(&self) -> Vec<PeerId> {
        let mut named: Vec<PeerId> = self.admissions.iter().flat_map(Admission::named).collect();
        named.sort_unstable();
        named.dedup();
        named
    }
}

impl Inner {
    fn swarms(&self) -> std::sync::MutexGuard<'_, HashMap<ArtifactId, Member>> {
        self.swarms.lock().unwrap_or_else(|e| e.into_inner())
    }
}

async fn blocking<T: Send + 'static, E: From<std::io::Error> + Send + 'static>(
    f: impl FnOnce() -> Result<T, E> + Send + 'static,
) -> Result<T, E> {
    tokio::task::spawn_blocking(f)
        .await
        .unwrap_or_else(|e| Err(std::io::Error::other(e).into()))
}

impl Distributor {
    /// Starts serving the artifact protocols on `network`, with the cache in `cache_dir`.
    pub fn start(
        network: Network,
        origins: Origins,
        cache_dir: &Path,
        settings: Settings,
    ) -> Result<Distributor, FetchError> {
        let cache = Arc::new(Cache::open(cache_dir)?);
        let swarm_streams = network.accept_streams(SWARM_PROTOCOL)?;
        let chunk_streams = network.accept_streams(CHUNK_PROTOCOL)?;
        let published_streams = network.accept_streams(PUBLISHED_PROTOCOL)?;
        let publications = Arc::new(Publications::new());
        let inner = Arc::new(Inner {
            network,
            origins,
            cache,
            settings,
            swarms: Mutex::default(),
            publications: publications.clone(),
        });
        let mut accepting = JoinSet::new();
        accepting.spawn(accept_swarm_streams(swarm_streams, Arc::downgrade(&inner)));
        accepting.spawn(accept_chunk_streams(chunk_streams, Arc::downgrade(&inner)));
        accepting.spawn(published::accept(
            published_streams,
            Arc::downgrade(&publications),
        ));
        Ok(Distributor {
            inner,
            _accepting: Arc::new(accepting),
        })
    }

    pub fn settings(&self) -> &Settings {
        &self.inner.settings
    }

    pub fn network(&self) -> &Network {
        &self.inner.network
    }

    /// Fetches `request`: from the cache if the origin still describes it the same way, else
    /// with every other node fetching the same version. If the origin's object changes
    /// mid-way, the fetch starts once more on the new version, then gives up.
    ///
    /// After it returns, this node keeps serving the artifact to the others until
    /// [`leave`](Self::leave) or until the distributor is dropped.
    pub async fn fetch(
        &self,
        request: &Request,
        options: &FetchOptions,
    ) -> Result<Fetched, FetchError> {
        match self.fetch_once(request, options).await {
            Err(FetchError::Changed { artifact, reason }) => {
                tracing::warn!(%artifact, uri = %request.uri, "{reason}; starting again on the new version");
                self.fetch_once(request, options).await
            }
            other => other,
        }
    }

    /// Serves the file at `path` to the peers `admission` lets in: they fetch it with
    /// [`fetch_published`](Self::fetch_published), this node as their origin, until
    /// [`unpublish`](Self::unpublish). The file must not change meanwhile (a changed file is
    /// refused to them, as an origin's changed object is).
    pub fn publish(&self, path: &Path, admission: Admission) -> Result<Published, FetchError> {
        Ok(self
            .inner
            .publications
            .publish(self.inner.network.local_peer_id(), path, admission)?)
    }

    /// Bytes of this node's published files its readers were sent so far.
    pub fn published_bytes(&self) -> u64 {
        self.inner.publications.served()
    }

    /// Stops serving a file [`publish`](Self::publish)ed here.
    pub fn unpublish(&self, published: &Published) {
        self.inner.publications.unpublish(&published.name);
    }

    /// Fetches a file another peer published to `destination`, with every other node
    /// fetching it: each chunk is read from the publisher about once and passed on between
    /// the fetchers, verified like the chunks of any artifact.
    pub async fn fetch_published(
        &self,
        published: &Published,
        destination: &Path,
        options: &FetchOptions,
    ) -> Result<Fetched, FetchError> {
        let origin = Arc::new(Origin::publisher(self.inner.network.clone(), published)?);
        self.fetch_from(origin, &published_request(published, destination), options)
            .await
    }

    /// Serves a file [`fetch_published`](Self::fetch_published)ed to `destination` (artifact
    /// `id`) until every member of its swarm this node knows holds it all, or `linger`
    /// passes; then leaves the swarm and forgets it (the file is the caller's to remove).
    pub async fn retire_published(
        &self,
        published: &Published,
        destination: &Path,
        id: ArtifactId,
        linger: Duration,
    ) {
        let progress = self.inner.swarms().get(&id).map(|m| m.progress.clone());
        if let Some(mut progress) = progress {
            let _ =
                tokio::time::timeout(linger, progress.wait_for(|p| p.complete && p.peers_done()))
                    .await;
        }
        self.leave(id);
        let cache = self.inner.cache.clone();
        let request = published_request(published, destination);
        let forgotten = blocking(move || {
            cache.forget_completed(&request)?;
            cache.forget_chunks(id)
        })
        .await;
        if let Err(error) = forgotten {
            tracing::debug!(artifact = %id, %error, "cannot forget a published file fetched here");
        }
    }

    async fn fetch_once(
        &self,
        request: &Request,
        options: &FetchOptions,
    ) -> Result<Fetched, FetchError> {
        let origin = self.inner.origins.get(&request.profile)?;
        self.fetch_from(origin, request, options).await
    }

    async fn fetch_from(
        &self,
        origin: Arc<Origin>,
        request: &Request,
        options: &FetchOptions,
    ) -> Result<Fetched, FetchError> {
        let files = origin.resolve(request).await?;
        let size = files.iter().map(|f| f.size).sum();
        let chunk_size = self
            .inner
            .settings
            .chunk_size
            .unwrap_or_else(|| auto_chunk_size(size));
        let manifest = Arc::new(Manifest::new(origin.url(), chunk_size, files));
        let id = manifest.id;

        let cache = self.inner.cache.clone();
        let lookup = request.clone();
        let record = blocking(move || cache.completed(&lookup)).await?;
        let record =
            match record.filter(|r| r.manifest.same_files(&manifest) && r.satisfies(request)) {
                Some(record) => {
                    let cache = self.inner.cache.clone();
                    let request = request.clone();
                    blocking(move || check_cached(&cache, record, &request)).await?
                }
                None => None,
            };
        if let Some(record) = record {
            tracing::info!(artifact = %id, destination = %request.destination.display(), "cached, and the origin still has this version");
            if record.files_present() && !self.inner.swarms().contains_key(&id) {
                let admission = &options.admission;
                self.seed(&record, origin.clone(), manifest.clone(), admission)
                    .await;
            } else {
                self.admit(id, &options.admission);
            }
            let unpacked = self.unpack_if_asked(request, record).await?;
            let contents = self.contents(request, unpacked.as_deref()).await?;
            let progress = self
                .inner
                .swarms()
                .get(&id)
                .map(|m| m.progress.borrow().clone())
                .unwrap_or_default();
            return Ok(Fetched {
                artifact: id,
                files: (0..manifest.files.len())
                    .map(|i| manifest.target(request, i))
                    .collect(),
                unpacked,
                from_cache: true,
                progress,
                contents,
            });
        }

        let mut progress = self
            .join(
                request,
                origin.clone(),
                manifest.clone(),
                options.expect,
                &options.admission,
            )
            .await?;
        let outcome = loop {
            let current = progress.borrow_and_update().clone();
            if let Some(sender) = &options.progress {
                sender.send_replace(current.clone());
            }
            if let Some(failure) = current.failure {
                break Err(failure);
            }
            if current.complete {
                break Ok(current);
            }
            if progress.changed().await.is_err() {
                break Err(Failure::Failed("the swarm stopped".into()));
            }
        };
        let current = match outcome {
            Ok(current) => current,
            Err(failure) => {
                self.leave(id);
                return Err(match failure {
                    Failure::Changed(reason) => FetchError::Changed {
                        artifact: id,
                        reason,
                    },
                    Failure::Failed(reason) => FetchError::Failed {
                        artifact: id,
                        reason,
                    },
                });
            }
        };
        let record = Record {
            request: request.clone(),
            manifest: (*manifest).clone(),
            hashes: Vec::new(),
            from_origin: Vec::new(),
            unpacked: false,
            stamps: Vec::new(),
            unpacked_stamps: Default::default(),
            unpacked_contents: Default::default(),
        };
        let unpacked = self.unpack_if_asked(request, record).await?;
        let contents = self.contents(request, unpacked.as_deref()).await?;
        Ok(Fetched {
            artifact: id,
            files: (0..manifest.files.len())
                .map(|i| manifest.target(request, i))
                .collect(),
            unpacked,
            from_cache: false,
            progress: current,
            contents,
        })
    }

    /// What `request`'s files and its tree unpacked at `unpacked` hold, as the cache recorded
    /// them when they were verified.
    async fn contents(
        &self,
        request: &Request,
        unpacked: Option<&Path>,
    ) -> Result<Contents, FetchError> {
        let cache = self.inner.cache.clone();
        let lookup = request.clone();
        let record = blocking(move || cache.completed(&lookup)).await?;
        Ok(record
            .map(|record| Contents::of(&record, unpacked))
            .unwrap_or_default())
    }

    /// Joins (or finds) the swarm of `manifest`, resuming from chunks recorded in the cache.
    async fn join(
        &self,
        request: &Request,
        origin: Arc<Origin>,
        manifest: Arc<Manifest>,
        expect: usize,
        admission: &Option<Admission>,
    ) -> Result<watch::Receiver<Progress>, FetchError> {
        let id = manifest.id;
        if let Some(progress) = self.existing(id, request)? {
            self.admit(id, admission);
            return Ok(progress);
        }
        let cache = self.inner.cache.clone();
        let recorded = blocking(move || cache.chunks(id)).await?;
        let create = (manifest.clone(), request.clone(), recorded.is_empty());
        let assembly =
            Arc::new(blocking(move || Assembly::create(create.0, &create.1, create.2)).await?);
        let holding = Arc::new(Holding::new(assembly, self.inner.settings.upload_slots));
        let resumed = if recorded.is_empty() {
            0
        } else {
            let holding = holding.clone();
            blocking(move || {
                let mut resumed = 0;
                for (chunk, hash, from_origin) in recorded {
                    let Some(span) = holding.assembly.manifest().chunk(chunk) else {
                        continue;
                    };
                    if holding.assembly.hash_chunk(span)? == hash {
                        holding.hold(chunk, Held { hash, from_origin });
                        resumed += 1;
                    }
                }
                Ok::<_, std::io::Error>(resumed)
            })
            .await?
        };
        if resumed > 0 {
            tracing::info!(artifact = %id, resumed, "resuming with chunks verified from an earlier run");
        }
        Ok(self.register(request, origin, holding, expect, resumed, admission))
    }

    /// The swarm of `id` this node is already in, if it is still fetching.
    fn existing(
        &self,
        id: ArtifactId,
        request: &Request,
    ) -> Result<Option<watch::Receiver<Progress>>, FetchError> {
        let mut swarms = self.inner.swarms();
        // A finished swarm whose files did not satisfy the cache check lost them: start over.
        if swarms
            .get(&id)
            .is_some_and(|m| m.progress.borrow().complete)
        {
            swarms.remove(&id);
        }
        match swarms.get(&id) {
            Some(member) if member.destination != request.destination => Err(FetchError::Busy {
                destination: request.destination.clone(),
                other: member.destination.clone(),
            }),
            Some(member) => Ok(Some(member.progress.clone())),
            None => Ok(None),
        }
    }

    fn register(
        &self,
        request: &Request,
        origin: Arc<Origin>,
        holding: Arc<Holding>,
        expect: usize,
        resumed: u32,
        admission: &Option<Admission>,
    ) -> watch::Receiver<Progress> {
        let id = holding.assembly.manifest().id;
        let inner = Arc::downgrade(&self.inner);
        let context = Context {
            network: self.inner.network.clone(),
            origin,
            cache: self.inner.cache.clone(),
            settings: self.inner.settings.clone(),
            named: swarm::Named::new(move || {
                inner
                    .upgrade()
                    .and_then(|inner| inner.swarms().get(&id).map(Member::named))
                    .unwrap_or_default()
            }),
        };
        // Locked from before the swarm announces itself until it is in, admission included:
        // a peer's hello in between would be answered `not_member`, and the peer would stay
        // away until its next discovery, which can take a DHT query's timeout.
        let mut swarms = self.inner.swarms();
        let (events, progress) =
            swarm::spawn(context, request.clone(), holding.clone(), expect, resumed);
        swarms.insert(
            id,
            Member {
                events,
                holding,
                progress: progress.clone(),
                destination: request.destination.clone(),
                anyone: admission.is_none(),
                admissions: admission.iter().cloned().collect(),
            },
        );
        progress
    }

    /// Lets the peers `admission` names (everyone, for `None`) into the swarm of `id`.
    fn admit(&self, id: ArtifactId, admission: &Option<Admission>) {
        if let Some(member) = self.inner.swarms().get_mut(&id) {
            match admission {
                Some(admission) => member.admissions.push(admission.clone()),
                None => member.anyone = true,
            }
        }
    }

    /// Serves a cached artifact to others.
    async fn seed(
        &self,
        record: &Record,
        origin: Arc<Origin>,
        manifest: Arc<Manifest>,
        admission: &Option<Admission>,
    ) {
        let request = record.request.clone();
        let (hashes, from_origin) = if record.manifest.chunk_size == manifest.chunk_size {
            (record.chunk_hashes(), record.from_origin.clone())
        } else {
            // Chunks of another size are hashed again here, not read from the origin: this
            // node vouches for none of them.
            (None, Vec::new())
        };
        let opened = {
            let manifest = manifest.clone();
            let request = request.clone();
            blocking(move || {
                let assembly = Assembly::open_complete(manifest, &request)?;
                let hashes = match hashes {
                    Some(hashes) => hashes,
                    None => assembly
                        .manifest()
                        .chunks()
                        .iter()
                        .map(|span| assembly.hash_chunk(*span))
                        .collect::<Result<_, _>>()?,
                };
                Ok::<_, std::io::Error>((assembly, hashes))
            })
            .await
        };
        match opened {
            Ok((assembly, hashes)) => {
                let holding = Arc::new(Holding::new(
                    Arc::new(assembly),
                    self.inner.settings.upload_slots,
                ));
                for (chunk, hash) in hashes.into_iter().enumerate() {
                    let chunk = chunk as u32;
                    let from_origin = from_origin.contains(&chunk);
                    holding.hold(chunk, Held { hash, from_origin });
                }
                self.register(&request, origin, holding, 1, 0, admission);
            }
            Err(e) => tracing::warn!(artifact = %manifest.id, "cannot serve the cached files: {e}"),
        }
    }

    /// Unpacks the archive as `request` asks, unless the cache says it already is.
    async fn unpack_if_asked(
        &self,
        request: &Request,
        mut record: Record,
    ) -> Result<Option<PathBuf>, FetchError> {
        let Some(options) = request.unpack.clone() else {
            return Ok(None);
        };
        let archive = record.manifest.target(request, 0);
        let cache = self.inner.cache.clone();
        let destination = options.destination.clone();
        let request = request.clone();
        let limits = self.inner.settings.unpack_limits;
        blocking(move || {
            if record.unpacked_as(&request) {
                if record.tree_intact(&request) {
                    return Ok(());
                }
                tracing::warn!(destination = %options.destination.display(), "the unpacked tree changed on disk since it was unpacked; unpacking the archive again");
            }
            unpack(&archive, &options, &limits)?;
            make_read_only(&options.destination)?;
            let (unpacked_stamps, unpacked_contents) = stamp_and_read_tree(&options.destination)?;
            if let Some(done) = cache.completed(&request)? {
                record = done;
            }
            record.request = request;
            record.unpacked = true;
            record.unpacked_stamps = unpacked_stamps;
            record.unpacked_contents = unpacked_contents;
            cache.record_completed(&record)?;
            Ok::<_, FetchError>(())
        })
        .await?;
        Ok(Some(destination))
    }

    /// Trusts nothing of `request`'s cached files on the next fetch: their stamps are
    /// forgotten, so that every chunk is hashed again (the damaged ones fetched again) and the
    /// tree unpacked again. For a copy that differed from what the fetch verified while the
    /// stamps said nothing changed (a disk, a file system with coarse times).
    pub async fn distrust(&self, request: &Request) -> Result<(), FetchError> {
        let cache = self.inner.cache.clone();
        let request = request.clone();
        blocking(move || {
            if let Some(mut record) = cache.completed(&request)? {
                record.stamps.clear();
                record.unpacked_stamps.clear();
                record.unpacked_contents.clear();
                cache.record_completed(&record)?;
            }
            Ok::<_, FetchError>(())
        })
        .await
    }

    /// Stops serving artifact `id` and leaves its swarm.
    pub fn leave(&self, id: ArtifactId) {
        self.inner.swarms().remove(&id);
    }

    /// Leaves every swarm.
    pub fn leave_all(&self) {
        self.inner.swarms().clear();
    }

    /// Waits until every member of every swarm this node is in says it holds everything, or
    /// `timeout` passes. Returns whether they all did.
    pub async fn settle(&self, timeout: Duration) -> bool {
        let watches: Vec<watch::Receiver<Progress>> = self
            .inner
            .swarms()
            .values()
            .map(|m| m.progress.clone())
            .collect();
        let all = async {
            for mut progress in watches {
                if progress
                    .wait_for(|p| p.complete && p.peers_done())
                    .await
                    .is_err()
                {
                    return;
                }
            }
        };
        tokio::time::timeout(timeout, all).await.is_ok()
    }

    /// This node's view of artifact `id`, while it is in its swarm.
    pub fn progress(&self, id: ArtifactId) -> Option<watch::Receiver<Progress>> {
        self.inner.swarms().get(&id).map(|m| m.progress.clone())
    }
}

/// A cache hit, checked before its files are used: files whose stamps changed since they were
/// recorded are hashed chunk by chunk. The record if every chunk is as fetched (its stamps
/// renewed where they changed); `None` for a damaged entry, which is left ready for the swarm
/// to repair: its files moved back to part files, its good chunks recorded, so that only the
/// damaged ones are fetched again (blocking).
fn check_cached(
    cache: &Cache,
    mut record: Record,
    request: &Request,
) -> Result<Option<Record>, FetchError> {
    if !record.files_present() {
        // Only the unpacked tree is left: a hit while it is intact.
        return Ok(record.tree_intact(request).then_some(record));
    }
    let manifest = Arc::new(record.manifest.clone());
    let targets: Vec<PathBuf> = (0..manifest.files.len())
        .map(|i| manifest.target(request, i))
        .collect();
    let stamp_all = || {
        targets
            .iter()
            .map(|target| Stamp::of(target))
            .collect::<std::io::Result<Vec<_>>>()
    };
    let stamps = stamp_all()?;
    let changed: Vec<bool> = stamps
        .iter()
        .enumerate()
        .map(|(i, stamp)| record.stamps.get(i) != Some(stamp))
        .collect();
    if !changed.contains(&true) {
        return Ok(Some(record));
    }
    let hashes = record.chunk_hashes();
    let assembly = Assembly::open_complete(manifest.clone(), request)?;
    let mut good = Vec::new();
    let mut damaged = 0;
    for (index, span) in manifest.chunks().iter().enumerate() {
        match hashes.as_ref().map(|hashes| hashes[index]) {
            Some(hash) if !changed[span.file] || assembly.hash_chunk(*span)? == hash => {
                good.push((index as u32, hash));
            }
            _ => damaged += 1,
        }
    }
    drop(assembly);
    if damaged == 0 {
        // Touched, linked or made writable, but every byte as fetched.
        for target in &targets {
            make_read_only(target)?;
        }
        record.stamps = stamp_all()?;
        cache.record_completed(&record)?;
        return Ok(Some(record));
    }
    tracing::warn!(
        artifact = %manifest.id,
        destination = %request.destination.display(),
        damaged,
        chunks = manifest.chunk_count(),
        "the cached files changed on disk since they were fetched; fetching the changed chunks again"
    );
    // Completed record first: a crash after it leaves files the next fetch does not trust.
    cache.forget_completed(request)?;
    for target in &targets {
        let mode = std::fs::metadata(target)?.permissions().mode();
        std::fs::set_permissions(target, std::fs::Permissions::from_mode(mode | 0o200))?;
        std::fs::rename(target, part_path(target))?;
    }
    for (chunk, hash) in good {
        cache.record_chunk(
            manifest.id,
            chunk,
            &hash,
            record.from_origin.contains(&chunk),
        )?;
    }
    Ok(None)
}

async fn accept_swarm_streams(incoming: hypha_network::IncomingStreams, inner: Weak<Inner>) {
    hypha_network::frame::serve_each(incoming, |peer, mut stream| {
        let inner = inner.clone();
        Some(async move {
            let hello =
                tokio::time::timeout(HELLO_TIMEOUT, read_frame::<SwarmMessage>(&mut stream)).await;
            let Ok(Ok(SwarmMessage::Hello { artifact })) = hello else {
                tracing::debug!(%peer, "swarm stream without a hello");
                return;
            };
            let events = inner.upgrade().and_then(|inner| {
                inner
                    .swarms()
                    .get(&artifact)
                    .filter(|m| m.admits(&peer))
                    .map(|m| m.events.clone())
            });
            let Some(events) = events else {
                tracing::debug!(%peer, %artifact, "not letting a peer into a swarm: not in it, or no job or request here admits it");
                let _ = write_frame(&mut stream, &HelloReply::NotMember).await;
                return;
            };
            if write_frame(&mut stream, &HelloReply::Welcome).await.is_ok() {
                // Open while the peer is in the swarm; the peer opens it again when it is cut.
                stream.set_long_lived();
                let _ = events.send(Event::Joined { peer, stream }).await;
            }
        })
    })
    .await;
}

async fn accept_chunk_streams(incoming: hypha_network::IncomingStreams, inner: Weak<Inner>) {
    hypha_network::frame::serve_each(incoming, |peer, stream| {
        let inner = inner.clone();
        Some(swarm::serve_chunk(stream, peer, move |id| {
            let inner = inner.upgrade().ok_or(ChunkErrorCode::UnknownArtifact)?;
            let swarms = inner.swarms();
            let member = swarms.get(&id).ok_or(ChunkErrorCode::UnknownArtifact)?;
            if !member.admits(&peer) {
                return Err(ChunkErrorCode::NotAdmitted);
            }
            Ok(member.holding.clone())
        }))
    })
    .await;
}
