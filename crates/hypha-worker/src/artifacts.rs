//! Artifacts for jobs: fetched once per worker into its artifact store, shared with the other
//! nodes fetching them (see `hypha_artifacts`), and hard-linked into job directories.
//!
//! Each artifact (profile, URI, kind) has its own store directory
//! `{artifacts.dir}/store/{key}`, so jobs asking for the same artifact under any names share
//! one copy and one cache entry, and a later job finds it without a transfer while the origin still
//! describes it the same way. Job directories get hard links, not copies: a 40 GB model costs
//! no second 40 GB. Store files are made read-only so that a job cannot overwrite what other
//! jobs (and peers) read; a job that wants to change a file replaces it in its own directory.
//! Where the store and the job directory are on different file systems, files are copied.

use std::{
    collections::HashMap,
    ffi::OsStr,
    fs::File,
    os::{
        fd::OwnedFd,
        unix::{ffi::OsStrExt, fs::PermissionsExt},
    },
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};

use hypha_artifacts::{
    Admission, Distributor, FetchError, FetchOptions, Fetched, Origins, Progress, Request,
};
use hypha_network::Network;
use tokio::sync::watch;

use crate::{
    bridge::paths::{JobDir, PathError},
    config::ArtifactsConfig,
};

/// A job's artifact could not be provided.
#[derive(Debug, thiserror::Error)]
pub enum ProvideError {
    #[error("{0}")]
    Fetch(#[from] FetchError),
    #[error("{0}")]
    Path(#[from] PathError),
    #[error("linking {path} into the job's directory: {error}")]
    Link {
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
    /// wait for the first, then link what it fetched.
    busy: Mutex<HashMap<PathBuf, Arc<tokio::sync::Mutex<()>>>>,
}

impl ArtifactStore {
    /// Starts the worker's side of artifact distribution on `network`.
    pub fn start(network: Network, config: &ArtifactsConfig) -> Result<Self, FetchError> {
        let store = config.dir.join("store");
        std::fs::create_dir_all(&store)?;
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
        let files: Vec<PathBuf> = fetched
            .files
            .iter()
            .cloned()
            .chain(fetched.unpacked.iter().flat_map(|dir| tree_files(dir)))
            .collect();
        tokio::task::spawn_blocking(move || {
            for file in files {
                // Readable by all who may read the store, writable by none: jobs share it.
                let _ = std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o444));
            }
        })
        .await
        .map_err(|e| FetchError::Io(std::io::Error::other(e)))?;
        Ok((in_store, fetched))
    }

    /// Fetches `request` (destinations relative to the job's directory, already checked),
    /// sharing it with the peers `admission` lets in, and links it into `job`.
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
                link_tree(&job, &from, &to, &mut files)?;
            }
            Ok::<_, ProvideError>(files)
        })
        .await
        .map_err(|e| FetchError::Io(std::io::Error::other(e)))??;
        Ok(Provided { fetched, files })
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

/// Every regular file under `dir`.
fn tree_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(dir) = pending.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            match entry.file_type() {
                Ok(t) if t.is_dir() => pending.push(entry.path()),
                Ok(t) if t.is_file() => files.push(entry.path()),
                _ => {}
            }
        }
    }
    files
}

/// Links the file or tree at `from` (in the store) to `to` (relative to the job's
/// directory), replacing what is there; records `(to, from)` for every file.
fn link_tree(
    job: &JobDir,
    from: &Path,
    to: &Path,
    files: &mut Vec<(PathBuf, PathBuf)>,
) -> Result<(), ProvideError> {
    let link_error = |error: std::io::Error| ProvideError::Link {
        path: to.to_path_buf(),
        error,
    };
    let metadata = std::fs::symlink_metadata(from).map_err(link_error)?;
    let (Some(parent), Some(name)) = (to.parent(), to.file_name()) else {
        return Err(ProvideError::Link {
            path: to.to_path_buf(),
            error: std::io::Error::other("the destination names no file"),
        });
    };
    if metadata.is_dir() {
        job.create_dir_all(to)?;
        for entry in std::fs::read_dir(from).map_err(link_error)? {
            let entry = entry.map_err(link_error)?;
            link_tree(job, &entry.path(), &to.join(entry.file_name()), files)?;
        }
        return Ok(());
    }
    let parent_fd = job.create_dir_all(parent)?;
    if metadata.is_symlink() {
        // Unpacking kept only links that stay inside the archive's tree.
        let target = std::fs::read_link(from).map_err(link_error)?;
        let _ = rustix::fs::unlinkat(&parent_fd, name, rustix::fs::AtFlags::empty());
        rustix::fs::symlinkat(&target, &parent_fd, name).map_err(|e| link_error(e.into()))?;
        return Ok(());
    }
    place_file(&parent_fd, from, name).map_err(link_error)?;
    files.push((to.to_path_buf(), from.to_path_buf()));
    Ok(())
}

/// Puts a hard link to `from` at `name` in `parent`, atomically replacing what is there; a
/// copy where a link cannot be made.
fn place_file(parent: &OwnedFd, from: &Path, name: &OsStr) -> std::io::Result<()> {
    // A fresh name beside the destination: made as an empty file, then replaced by the link.
    let (_, temp) = JobDir::create_temp(parent, name)?;
    let temp_name = OsStr::from_bytes(&temp);
    rustix::fs::unlinkat(parent, temp_name, rustix::fs::AtFlags::empty())?;
    let linked = rustix::fs::linkat(
        rustix::fs::CWD,
        from,
        parent,
        temp_name,
        rustix::fs::AtFlags::empty(),
    );
    if let Err(e) = linked {
        if !matches!(e, rustix::io::Errno::XDEV | rustix::io::Errno::PERM) {
            return Err(e.into());
        }
        let (mut copy, copy_temp) = JobDir::create_temp(parent, name)?;
        let copied = std::io::copy(&mut File::open(from)?, &mut copy).and_then(|_| copy.sync_all());
        if let Err(e) = copied {
            JobDir::discard(parent, &copy_temp);
            return Err(e);
        }
        return JobDir::publish(parent, &copy_temp, name);
    }
    JobDir::publish(parent, &temp, name)
}
