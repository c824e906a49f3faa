//! Artifacts for jobs: fetched once per worker into its artifact store, shared with the other
//! nodes fetching them (see `hypha_artifacts`), and copied into job directories.
//!
//! Each artifact (profile, URI, kind) has its own store directory
//! `{artifacts.dir}/store/{key}`, so jobs asking for the same artifact under any names share
//! one copy and one cache entry, and a later job finds it without a transfer while the origin still
//! describes it the same way.
//!
//! A job gets its own copy of each file, never a link into the store: executors run as the
//! worker's user, so no permission bit keeps a job from making a linked file writable and
//! changing what later jobs of every task on this worker get (code planted in an unpacked
//! environment) and what this node serves to its peers. Where the file system can clone
//! (btrfs, XFS, bcachefs, ZFS 2.2) the copy is copy-on-write and costs no bytes; elsewhere it is
//! a kernel-side copy: 0.6–1.2 s from the page cache, 2.1 s cold, and the disk space again
//! for 1 GiB on this project's ext4 test machine (BENCHMARKS.md, "Artifacts into jobs"). The store itself is read-only and
//! stamped (`hypha_artifacts::cache`): what a process of the worker's user changes there
//! anyway is found on the next cache hit, and fetched again, and is never served to a peer.

use std::{
    collections::HashMap,
    ffi::OsStr,
    fs::File,
    os::{fd::OwnedFd, unix::fs::PermissionsExt},
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};

use hypha_artifacts::{
    Admission, Distributor, FetchError, FetchOptions, Fetched, Origins, Progress, Published,
    Request,
};
use hypha_network::Network;
use tokio::sync::watch;

use crate::{
    bridge::paths::{JobDir, PathError},
    config::ArtifactsConfig,
};

/// Removes a fetched file and its part file, whichever exist.
fn remove_fetched(path: &Path) {
    let part = hypha_artifacts::assembly::part_path(path);
    for path in [path, part.as_path()] {
        if let Err(error) = std::fs::remove_file(path)
            && error.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(path = %path.display(), %error, "cannot remove a published file fetched here");
        }
    }
}

/// Where published files fetched for jobs wait in the store, until they are retired.
const PUBLISHED_DIR: &str = "published";
/// How long a worker serves a published file it fetched to the others fetching it.
pub const PUBLISHED_LINGER: std::time::Duration = std::time::Duration::from_secs(30);

/// A job's artifact could not be provided.
#[derive(Debug, thiserror::Error)]
pub enum ProvideError {
    #[error("{0}")]
    Fetch(#[from] FetchError),
    #[error("{0}")]
    Path(#[from] PathError),
    #[error("copying {path} into the job's directory: {error}")]
    Copy {
        path: PathBuf,
        #[source]
        error: std::io::Error,
    },
}

/// What a request put into a job's directory.
#[derive(Debug, Clone)]
pub struct Provided {
    pub fetched: Fetched,
    /// The files, relative to the job's directory, with where their bytes are in the store.
    pub files: Vec<(PathBuf, PathBuf)>,
}

/// The worker's artifact store. Cheap to share behind an `Arc`.
#[derive(Debug)]
pub struct ArtifactStore {
    distributor: Distributor,
    store: PathBuf,
    /// One fetch per store directory at a time: jobs asking for the same artifact together
    /// wait for the first, then copy what it fetched.
    busy: Mutex<HashMap<PathBuf, Arc<tokio::sync::Mutex<()>>>>,
}

impl ArtifactStore {
    /// Starts the worker's side of artifact distribution on `network`.
    pub fn start(network: Network, config: &ArtifactsConfig) -> Result<Self, FetchError> {
        let store = config.dir.join("store");
        std::fs::create_dir_all(&store)?;
        // Published files fetched by a worker that stopped are of no use to any job now.
        match std::fs::remove_dir_all(store.join(PUBLISHED_DIR)) {
            Err(error) if error.kind() != std::io::ErrorKind::NotFound => return Err(error.into()),
            _ => {}
        }
        let distributor = Distributor::start(
            network,
            Origins::new(config.profiles.clone()),
            &config.dir,
            config.settings.clone(),
        )?;
        Ok(ArtifactStore {
            distributor,
            store,
            busy: Mutex::default(),
        })
    }

    pub fn distributor(&self) -> &Distributor {
        &self.distributor
    }

    /// Fetches `request` into the store (`expect` other nodes to share it with; 0 if
    /// unknown) with the peers `admission` lets in, reporting progress on `progress`.
    pub async fn fetch(
        &self,
        request: &Request,
        expect: usize,
        admission: Admission,
        progress: Option<watch::Sender<Progress>>,
    ) -> Result<(Request, Fetched), FetchError> {
        let in_store = self.in_store(request);
        let gate = self
            .busy
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(in_store.destination.clone())
            .or_default()
            .clone();
        let _alone = gate.lock().await;
        let fetched = self
            .distributor
            .fetch(
                &in_store,
                &FetchOptions {
                    expect,
                    progress,
                    admission: Some(admission),
                },
            )
            .await?;
        Ok((in_store, fetched))
    }

    /// Fetches `request` (destinations relative to the job's directory, already checked),
    /// sharing it with the peers `admission` lets in, and copies it into `job`.
    pub async fn provide(
        &self,
        request: &Request,
        job: Arc<JobDir>,
        expect: usize,
        admission: Admission,
    ) -> Result<Provided, ProvideError> {
        let (in_store, fetched) = self.fetch(request, expect, admission, None).await?;
        let mut pairs = vec![(in_store.destination.clone(), request.destination.clone())];
        if let (Some(from), Some(to)) = (&in_store.unpack, &request.unpack) {
            pairs.push((from.destination.clone(), to.destination.clone()));
        }
        let files = tokio::task::spawn_blocking(move || {
            let mut files = Vec::new();
            for (from, to) in pairs {
                copy_tree(&job, &from, &to, &mut files)?;
            }
            Ok::<_, ProvideError>(files)
        })
        .await
        .map_err(|e| FetchError::Io(std::io::Error::other(e)))??;
        Ok(Provided { fetched, files })
    }

    /// Fetches a file a peer published (`hypha_artifacts::published`) into the store's
    /// private `published/` directory, sharing it with the peers `admission` lets in; returns
    /// its path there and the fetch. Hand it on with [`copy_to_temp`], then call
    /// [`retire_published`](Self::retire_published).
    pub async fn fetch_published(
        &self,
        published: &Published,
        admission: Admission,
    ) -> Result<(PathBuf, Fetched), FetchError> {
        let destination = self.published_path(published)?;
        let options = FetchOptions {
            expect: published.fetchers,
            progress: None,
            admission: Some(admission),
        };
        let fetched = self
            .distributor
            .fetch_published(published, &destination, &options)
            .await?;
        Ok((destination, fetched))
    }

    /// Serves a published file fetched here to the others fetching it for at most
    /// [`PUBLISHED_LINGER`] (until they all hold it), then forgets it and removes it.
    pub async fn retire_published(&self, published: &Published, path: &Path, fetched: &Fetched) {
        self.distributor
            .retire_published(published, path, fetched.artifact, PUBLISHED_LINGER)
            .await;
        remove_fetched(path);
    }

    /// Removes what a fetch of `published` that failed left behind.
    pub async fn discard_published(&self, published: &Published) {
        if let Ok(path) = self.published_path(published) {
            remove_fetched(&path);
        }
    }

    /// Where a published file is fetched to in the store: named after its publisher and its
    /// name, which must be 32 hex digits (as publishers make them), never a path of a peer's.
    fn published_path(&self, published: &Published) -> Result<PathBuf, FetchError> {
        let hex_name =
            published.name.len() == 32 && published.name.bytes().all(|b| b.is_ascii_hexdigit());
        let alphanumeric =
            !published.peer.is_empty() && published.peer.bytes().all(|b| b.is_ascii_alphanumeric());
        if !hex_name || !alphanumeric {
            return Err(FetchError::Io(std::io::Error::other(format!(
                "{:?} of {:?} is not a published file's name",
                published.name, published.peer
            ))));
        }
        let dir = self.store.join(PUBLISHED_DIR);
        std::fs::create_dir_all(&dir)?;
        Ok(dir.join(format!("{}-{}", published.peer, published.name)))
    }

    /// The same request with destinations in the store.
    fn in_store(&self, request: &Request) -> Request {
        // Named after the object, so that unpacking by name sees its real extension.
        let name = request
            .uri
            .trim_end_matches('/')
            .rsplit('/')
            .next()
            .filter(|s| !matches!(*s, "" | "." | ".."))
            .unwrap_or("artifact");
        // One store directory per artifact, whatever the jobs call it: a node is in one swarm
        // per artifact, with one destination.
        let key = blake3::hash(
            serde_json::json!([request.profile, request.uri, request.kind])
                .to_string()
                .as_bytes(),
        )
        .to_hex();
        let dir = self.store.join(&key.as_str()[..32]);
        let mut in_store = request.clone();
        in_store.destination = dir.join(name);
        if let Some(unpack) = &mut in_store.unpack {
            unpack.destination = dir.join("unpacked");
        }
        in_store
    }
}

/// Copies the file or tree at `from` (in the store) to `to` (relative to the job's
/// directory), replacing what is there; records `(to, from)` for every file.
fn copy_tree(
    job: &JobDir,
    from: &Path,
    to: &Path,
    files: &mut Vec<(PathBuf, PathBuf)>,
) -> Result<(), ProvideError> {
    let copy_error = |error: std::io::Error| ProvideError::Copy {
        path: to.to_path_buf(),
        error,
    };
    let metadata = std::fs::symlink_metadata(from).map_err(copy_error)?;
    let (Some(parent), Some(name)) = (to.parent(), to.file_name()) else {
        return Err(ProvideError::Copy {
            path: to.to_path_buf(),
            error: std::io::Error::other("the destination names no file"),
        });
    };
    if metadata.is_dir() {
        job.create_dir_all(to)?;
        for entry in std::fs::read_dir(from).map_err(copy_error)? {
            let entry = entry.map_err(copy_error)?;
            copy_tree(job, &entry.path(), &to.join(entry.file_name()), files)?;
        }
        return Ok(());
    }
    let parent_fd = job.create_dir_all(parent)?;
    if metadata.is_symlink() {
        // Unpacking kept only links that stay inside the archive's tree.
        let target = std::fs::read_link(from).map_err(copy_error)?;
        let _ = rustix::fs::unlinkat(&parent_fd, name, rustix::fs::AtFlags::empty());
        rustix::fs::symlinkat(&target, &parent_fd, name).map_err(|e| copy_error(e.into()))?;
        return Ok(());
    }
    place_file(&parent_fd, from, name).map_err(copy_error)?;
    files.push((to.to_path_buf(), from.to_path_buf()));
    Ok(())
}

/// Puts a copy of `from` at `name` in `parent`, atomically replacing what is there, writable
/// by its owner (it is the job's own): a copy-on-write clone where the file system makes one,
/// else a kernel-side copy. Never a link (see the module's documentation).
fn place_file(parent: &OwnedFd, from: &Path, name: &OsStr) -> std::io::Result<()> {
    let temp = copy_to_temp(parent, from, name)?;
    JobDir::publish(parent, &temp, name)
}

/// A copy of `from` in a new temporary file for `name` in `parent` (see
/// [`JobDir::create_temp`]), writable by its owner and fsynced; returns the temporary name.
pub fn copy_to_temp(parent: &OwnedFd, from: &Path, name: &OsStr) -> std::io::Result<Vec<u8>> {
    let source = File::open(from)?;
    let (mut copy, temp) = JobDir::create_temp(parent, name)?;
    let copied = (|| {
        if rustix::fs::ioctl_ficlone(&copy, &source).is_err() {
            std::io::copy(&mut &source, &mut copy)?;
        }
        let mode = source.metadata()?.permissions().mode();
        copy.set_permissions(std::fs::Permissions::from_mode((mode | 0o200) & 0o777))?;
        copy.sync_all()
    })();
    match copied {
        Ok(()) => Ok(temp),
        Err(e) => {
            JobDir::discard(parent, &temp);
            Err(e)
        }
    }
}
