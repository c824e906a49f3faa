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
//! What it changes between that check and the copy is found in the copy: every copy is hashed
//! and compared with what the fetch verified (`hypha_artifacts::Contents`) before the job
//! gets it; a copy that differs is thrown away and the artifact fetched again, once.

use std::{
    collections::{HashMap, HashSet},
    ffi::OsStr,
    fs::File,
    os::{fd::OwnedFd, unix::fs::PermissionsExt},
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};

use hypha_artifacts::{
    Admission, ContentError, Contents, Distributor, FetchError, FetchOptions, Fetched, Origins,
    Progress, Published, Request,
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
    #[error("copying into the job's directory: {0}")]
    Content(#[from] ContentError),
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
    /// wait for the first, then copy what it fetched together, and no fetch (which may repair
    /// the files or unpack the tree again) changes the directory under a copy.
    busy: Mutex<HashMap<PathBuf, Arc<tokio::sync::RwLock<()>>>>,
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
        let gate = self.gate(&in_store);
        let _alone = gate.write().await;
        let fetched = self
            .fetch_in_store(&in_store, expect, admission, progress)
            .await?;
        Ok((in_store, fetched))
    }

    /// The store directory's gate: a fetch (which may repair or unpack again) holds it alone,
    /// copies into jobs hold it together.
    fn gate(&self, in_store: &Request) -> Arc<tokio::sync::RwLock<()>> {
        self.busy
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(in_store.destination.clone())
            .or_default()
            .clone()
    }

    async fn fetch_in_store(
        &self,
        in_store: &Request,
        expect: usize,
        admission: Admission,
        progress: Option<watch::Sender<Progress>>,
    ) -> Result<Fetched, FetchError> {
        self.distributor
            .fetch(
                in_store,
                &FetchOptions {
                    expect,
                    progress,
                    admission: Some(admission),
                },
            )
            .await
    }

    /// Fetches `request` (destinations relative to the job's directory, already checked),
    /// sharing it with the peers `admission` lets in, and copies it into `job`. A copy that
    /// does not hold what the fetch verified (the store changed in between, or a disk) is
    /// thrown away, the store's files are checked whole (every chunk hashed, the tree unpacked
    /// again) and repaired, and the copy made again, once.
    pub async fn provide(
        &self,
        request: &Request,
        job: Arc<JobDir>,
        expect: usize,
        admission: Admission,
    ) -> Result<Provided, ProvideError> {
        let in_store = self.in_store(request);
        let gate = self.gate(&in_store);
        let mut distrusted = false;
        loop {
            let alone = gate.clone().write_owned().await;
            let fetched = self
                .fetch_in_store(&in_store, expect, admission.clone(), None)
                .await?;
            // Copies of the same artifact go on together; no fetch changes the store meanwhile.
            let copying = alone.downgrade();
            let mut pairs = vec![(in_store.destination.clone(), request.destination.clone())];
            if let (Some(from), Some(to)) = (&in_store.unpack, &request.unpack) {
                pairs.push((from.destination.clone(), to.destination.clone()));
            }
            let contents = fetched.contents.clone();
            let job = job.clone();
            let copied = tokio::task::spawn_blocking(move || {
                let _copying = copying;
                let mut files = Vec::new();
                for (from, to) in pairs {
                    copy_checked(&job, &contents, &from, &to, &mut files)?;
                }
                Ok::<_, ProvideError>(files)
            })
            .await
            .map_err(|e| FetchError::Io(std::io::Error::other(e)))?;
            match copied {
                Ok(files) => return Ok(Provided { fetched, files }),
                Err(ProvideError::Content(error)) if !distrusted => {
                    tracing::warn!(%error, "a copy into a job differs from what was fetched; checking the whole store entry and copying again");
                    let _alone = gate.write().await;
                    self.distributor.distrust(&in_store).await?;
                    distrusted = true;
                }
                Err(error) => return Err(error),
            }
        }
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

/// Copies the file or tree at `from` (in the store) to `to` (relative to the job's directory)
/// as [`copy_tree`] does, and checks that every file and link the fetch verified under `from`
/// was copied, each as verified.
fn copy_checked(
    job: &JobDir,
    contents: &Contents,
    from: &Path,
    to: &Path,
    files: &mut Vec<(PathBuf, PathBuf)>,
) -> Result<(), ProvideError> {
    let mut copied = HashSet::new();
    copy_tree(job, contents, from, to, files, &mut copied)?;
    match contents
        .paths()
        .find(|path| path.starts_with(from) && !copied.contains(*path))
    {
        Some(missing) => Err(ContentError::Changed {
            path: missing.to_path_buf(),
        }
        .into()),
        None => Ok(()),
    }
}

/// Copies the file or tree at `from` (in the store) to `to` (relative to the job's
/// directory), replacing what is there; records `(to, from)` for every file in `files` and
/// every store path copied in `copied`. Each copy is checked against `contents`; a file or link
/// the unpacked tree never had is left out, one anywhere else fails the copy.
fn copy_tree(
    job: &JobDir,
    contents: &Contents,
    from: &Path,
    to: &Path,
    files: &mut Vec<(PathBuf, PathBuf)>,
    copied: &mut HashSet<PathBuf>,
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
            copy_tree(
                job,
                contents,
                &entry.path(),
                &to.join(entry.file_name()),
                files,
                copied,
            )?;
        }
        return Ok(());
    }
    if let Err(error) = contents.check_known(from) {
        if !contents.in_unpacked_tree(from) {
            return Err(error.into());
        }
        tracing::warn!(%error, "left out of the job's copy");
        return Ok(());
    }
    let parent_fd = job.create_dir_all(parent)?;
    if metadata.is_symlink() {
        // Unpacking kept only links that stay inside the archive's tree.
        let target = std::fs::read_link(from).map_err(copy_error)?;
        contents.check_link(from, &target)?;
        let _ = rustix::fs::unlinkat(&parent_fd, name, rustix::fs::AtFlags::empty());
        rustix::fs::symlinkat(&target, &parent_fd, name).map_err(|e| copy_error(e.into()))?;
        copied.insert(from.to_path_buf());
        return Ok(());
    }
    let temp = copy_to_temp(&parent_fd, from, name).map_err(copy_error)?;
    let checked = match JobDir::open_own_file(&parent_fd, &temp) {
        Some(copy) => {
            let mut copy = std::io::BufReader::with_capacity(1 << 20, copy);
            contents
                .check_file(from, &mut copy)
                .map_err(ProvideError::from)
        }
        None => Err(copy_error(std::io::Error::other(
            "the copy vanished before it was checked",
        ))),
    };
    if let Err(error) = checked {
        JobDir::discard(&parent_fd, &temp);
        return Err(error);
    }
    JobDir::publish(&parent_fd, &temp, name).map_err(copy_error)?;
    copied.insert(from.to_path_buf());
    files.push((to.to_path_buf(), from.to_path_buf()));
    Ok(())
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests fail loudly by design

    use std::collections::BTreeMap;

    use hypha_artifacts::{Kind, Unpack};

    use super::*;

    /// Writes into a store file in place, as a process of the worker's user can.
    fn scribble(path: &Path) {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let mut file = std::fs::OpenOptions::new().write(true).open(path).unwrap();
        std::io::Write::write_all(&mut file, b"EVIL").unwrap();
    }

    /// The store changed after the fetch checked it and before the copy (issue 58, item 6): a
    /// process of the worker's user wrote into a fetched file and into a file of the unpacked
    /// tree, and put a file of its own into the tree. Neither copy reaches the job; `provide`
    /// fetches and unpacks again and the job gets the origin's bytes, without the planted file.
    /// (Checked by copying without the check, as before: the job gets `EVIL`.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_store_changed_between_the_check_and_the_copy_never_reaches_the_job() {
        let origin = tempfile::tempdir().unwrap();
        let s3 = hypha_testing::s3::S3Server::start(origin.path(), None)
            .await
            .unwrap();
        let model = hypha_testing::s3::pattern(3 << 20, 7);
        let script = b"#!/bin/sh\necho hello\n".to_vec();
        s3.put("model.bin", model.clone()).await.unwrap();
        let archive = hypha_testing::s3::tar_gz(&[("bin/run.sh", &script)]).unwrap();
        s3.put("env.tar.gz", archive).await.unwrap();

        let network = hypha_testing::network::connected(&["worker"])
            .await
            .remove(0);
        let dir = tempfile::tempdir().unwrap();
        let config = ArtifactsConfig {
            dir: dir.path().join("artifacts"),
            settings: hypha_artifacts::Settings::default(),
            profiles: BTreeMap::from([("default".to_string(), s3.profile())]),
        };
        let store = ArtifactStore::start(network, &config).unwrap();
        std::fs::create_dir(dir.path().join("job")).unwrap();
        let job = Arc::new(JobDir::open(&dir.path().join("job")).unwrap());
        let in_job = |path: &str| dir.path().join("job").join(path);
        let model_request = Request {
            profile: "default".into(),
            uri: "model.bin".into(),
            kind: Kind::Object,
            destination: "model.bin".into(),
            unpack: None,
        };
        let env_request = Request {
            profile: "default".into(),
            uri: "env.tar.gz".into(),
            kind: Kind::Object,
            destination: "env.tar.gz".into(),
            unpack: Some(Unpack {
                destination: "env".into(),
                method: Default::default(),
            }),
        };
        let nobody = || Admission::new(|_| false);

        // The checks pass: the store holds what the origin does.
        let (model_in_store, model_fetched) = store
            .fetch(&model_request, 0, nobody(), None)
            .await
            .unwrap();
        let (env_in_store, env_fetched) =
            store.fetch(&env_request, 0, nobody(), None).await.unwrap();
        // A copy checked against nothing the fetch verified fails; it does not leave the
        // file out.
        let error = copy_checked(
            &job,
            &Contents::default(),
            &model_in_store.destination,
            Path::new("model.bin"),
            &mut Vec::new(),
        )
        .unwrap_err();
        assert!(
            matches!(error, ProvideError::Content(ContentError::Unknown { .. })),
            "{error}"
        );

        // Then the store changes.
        scribble(&model_in_store.destination);
        let tree = env_in_store.unpack.as_ref().unwrap().destination.clone();
        scribble(&tree.join("bin/run.sh"));
        std::fs::write(tree.join("bin/planted.sh"), "#!/bin/sh\nevil\n").unwrap();

        let mut files = Vec::new();
        let error = copy_checked(
            &job,
            &model_fetched.contents,
            &model_in_store.destination,
            Path::new("model.bin"),
            &mut files,
        )
        .unwrap_err();
        assert!(
            matches!(error, ProvideError::Content(ContentError::Changed { .. })),
            "{error}"
        );
        assert!(!in_job("model.bin").exists(), "the changed copy was kept");
        let error = copy_checked(
            &job,
            &env_fetched.contents,
            &tree,
            Path::new("env"),
            &mut files,
        )
        .unwrap_err();
        assert!(
            matches!(error, ProvideError::Content(ContentError::Changed { .. })),
            "{error}"
        );
        assert!(
            !in_job("env/bin/run.sh").exists(),
            "the changed copy was kept"
        );
        assert!(
            !in_job("env/bin/planted.sh").exists(),
            "the planted file was copied"
        );

        // Provided, the artifacts are fetched and unpacked again: the job gets the origin's.
        store
            .provide(&model_request, job.clone(), 0, nobody())
            .await
            .unwrap();
        store
            .provide(&env_request, job.clone(), 0, nobody())
            .await
            .unwrap();
        assert!(std::fs::read(in_job("model.bin")).unwrap() == model);
        assert_eq!(std::fs::read(in_job("env/bin/run.sh")).unwrap(), script);
        assert!(!in_job("env/bin/planted.sh").exists());
    }
}
