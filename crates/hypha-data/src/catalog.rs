//! The datasets a data node serves, kept in step with the disk.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    sync::Arc,
    time::SystemTime,
};

use hypha_dataset::{Dataset, MANIFEST_FILE, ManifestSource, external_manifest_path, slice_files};

/// What changed in a [`Catalog::refresh`].
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Changes {
    pub added: Vec<String>,
    pub changed: Vec<String>,
    pub removed: Vec<String>,
}

/// The datasets under one path: the path itself when it holds slice files (one dataset, as
/// `dataset_path` in the seed), otherwise each of its sub-directories that does.
///
/// A dataset without a stored manifest has one derived when it is opened, and stored (beside
/// its slices, or under `manifest_dir` when its directory is read-only), so that a slice
/// damaged later is refused by every fetcher and named by `hypha-data verify` instead of being
/// described afresh.
#[derive(Debug)]
pub struct Catalog {
    root: PathBuf,
    manifest_dir: Option<PathBuf>,
    datasets: BTreeMap<String, Entry>,
}

#[derive(Debug)]
struct Entry {
    dataset: Arc<Dataset>,
    stamp: Stamp,
}

/// Names, sizes and modification times of a dataset's files: cheap to take, and any change
/// to a slice or the manifest changes it.
type Stamp = Vec<(String, u64, Option<SystemTime>)>;

impl Catalog {
    /// Opens every dataset under `root`, storing derived manifests of read-only datasets in
    /// [`hypha_dataset::default_manifest_dir`].
    pub fn open(root: &Path) -> Result<Self, hypha_dataset::Error> {
        Self::open_with(root, hypha_dataset::default_manifest_dir())
    }

    /// Opens every dataset under `root`; derived manifests of read-only datasets are stored in
    /// `manifest_dir`. A dataset that cannot be opened is an error here, so a misconfigured
    /// node does not start.
    pub fn open_with(
        root: &Path,
        manifest_dir: Option<PathBuf>,
    ) -> Result<Self, hypha_dataset::Error> {
        let mut catalog = Catalog {
            root: root.to_path_buf(),
            manifest_dir,
            datasets: BTreeMap::new(),
        };
        let dirs = dataset_dirs(root)?;
        if dirs.is_empty() {
            return Err(hypha_dataset::Error::Empty {
                path: root.to_path_buf(),
            });
        }
        for dir in dirs {
            let entry = catalog.open_dataset(&dir)?;
            catalog
                .datasets
                .insert(entry.dataset.name().to_string(), entry);
        }
        Ok(catalog)
    }

    /// Looks at the disk again: opens new datasets, reopens changed ones, drops removed ones.
    /// A dataset that fails to open is logged and left out until it is fixed.
    pub fn refresh(&mut self) -> Changes {
        let mut changes = Changes::default();
        let dirs = dataset_dirs(&self.root).unwrap_or_default();
        let mut seen = Vec::new();
        for dir in dirs {
            let name = dir_name(&dir);
            seen.push(name.clone());
            if self
                .datasets
                .get(&name)
                .is_some_and(|e| e.stamp == stamp(&dir))
            {
                continue;
            }
            match self.open_dataset(&dir) {
                Ok(entry) => {
                    if self.datasets.insert(name.clone(), entry).is_some() {
                        changes.changed.push(name);
                    } else {
                        changes.added.push(name);
                    }
                }
                Err(e) => {
                    tracing::warn!(dataset = %name, error = %e, "cannot serve this dataset until it is fixed");
                    if self.datasets.remove(&name).is_some() {
                        changes.removed.push(name);
                    }
                }
            }
        }
        let gone: Vec<String> = self
            .datasets
            .keys()
            .filter(|name| !seen.contains(name))
            .cloned()
            .collect();
        for name in gone {
            self.datasets.remove(&name);
            changes.removed.push(name);
        }
        changes
    }

    /// Opens one dataset; stores its manifest when it was derived, and says when damaged
    /// slices kept the stored one. The entry's stamp is the one taken before the dataset was
    /// read (so a change made meanwhile is seen on the next refresh), with the manifest it
    /// stored; it is empty when the slices changed while they were described, so that the
    /// next refresh describes them again.
    fn open_dataset(&self, dir: &Path) -> Result<Entry, hypha_dataset::Error> {
        let external = self
            .manifest_dir
            .as_deref()
            .map(|d| external_manifest_path(d, dir));
        let mut stamp = stamp(dir);
        let dataset = Dataset::open_with(dir, external.as_deref())?;
        match (dataset.source(), &external) {
            (ManifestSource::Derived, Some(external)) => match dataset.store_manifest(external) {
                Ok(path) => {
                    tracing::info!(
                        dataset = %dataset.name(),
                        manifest = %path.display(),
                        "stored the manifest derived from the slices; fetchers and `hypha-data verify` check the slices against it"
                    );
                    if let Some(manifest) = stamp.iter_mut().find(|(f, _, _)| f == MANIFEST_FILE) {
                        *manifest = file_stamp(dir, MANIFEST_FILE);
                    }
                }
                Err(e @ hypha_dataset::Error::Manifest { .. }) => {
                    tracing::info!(dataset = %dataset.name(), reason = %e, "the manifest derived from the slices is not stored yet");
                    stamp.clear();
                }
                Err(e) => tracing::warn!(
                    dataset = %dataset.name(),
                    error = %e,
                    "cannot store the manifest derived from the slices; a slice damaged later would be described afresh. Set manifest_dir to a writable directory"
                ),
            },
            (ManifestSource::Derived, None) => tracing::warn!(
                dataset = %dataset.name(),
                "the manifest derived from the slices is not stored (no manifest_dir and no home directory)"
            ),
            (ManifestSource::Kept { path, problem }, _) => tracing::warn!(
                dataset = %dataset.name(),
                manifest = %path.display(),
                %problem,
                "slices changed on disk and cannot all be read; serving them against the stored manifest, so damaged ones are refused. Run `hypha-data verify`"
            ),
            (ManifestSource::Stored(_), _) => {}
        }
        Ok(Entry {
            dataset: Arc::new(dataset),
            stamp,
        })
    }

    /// The dataset called `name`.
    pub fn get(&self, name: &str) -> Option<Arc<Dataset>> {
        self.datasets.get(name).map(|e| e.dataset.clone())
    }

    /// The names of every dataset served.
    pub fn names(&self) -> Vec<String> {
        self.datasets.keys().cloned().collect()
    }
}

fn dataset_dirs(root: &Path) -> Result<Vec<PathBuf>, hypha_dataset::Error> {
    if slice_files(root).is_ok() {
        return Ok(vec![root.to_path_buf()]);
    }
    let entries = std::fs::read_dir(root).map_err(|error| hypha_dataset::Error::Io {
        path: root.to_path_buf(),
        error,
    })?;
    let mut dirs: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| e.path())
        .filter(|p| !dir_name(p).starts_with('.') && slice_files(p).is_ok())
        .collect();
    dirs.sort();
    Ok(dirs)
}

fn dir_name(dir: &Path) -> String {
    dir.canonicalize()
        .ok()
        .as_deref()
        .unwrap_or(dir)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

fn stamp(dir: &Path) -> Stamp {
    let mut files = slice_files(dir).unwrap_or_default();
    files.push(MANIFEST_FILE.to_string());
    files.iter().map(|file| file_stamp(dir, file)).collect()
}

fn file_stamp(dir: &Path, file: &str) -> (String, u64, Option<SystemTime>) {
    let meta = std::fs::metadata(dir.join(file)).ok();
    let size = meta.as_ref().map_or(0, |m| m.len());
    let modified = meta.and_then(|m| m.modified().ok());
    (file.to_string(), size, modified)
}
