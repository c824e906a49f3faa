//! The datasets a data node serves, kept in step with the disk.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    sync::Arc,
    time::SystemTime,
};

use hypha_dataset::{Dataset, MANIFEST_FILE, slice_files};

/// What changed in a [`Catalog::refresh`].
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Changes {
    pub added: Vec<String>,
    pub changed: Vec<String>,
    pub removed: Vec<String>,
}

/// The datasets under one path: the path itself when it holds slice files (one dataset, as
/// `dataset_path` in the seed), otherwise each of its sub-directories that does.
#[derive(Debug)]
pub struct Catalog {
    root: PathBuf,
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
    /// Opens every dataset under `root`. A dataset that cannot be opened is an error here, so
    /// a misconfigured node does not start.
    pub fn open(root: &Path) -> Result<Self, hypha_dataset::Error> {
        let mut catalog = Catalog {
            root: root.to_path_buf(),
            datasets: BTreeMap::new(),
        };
        let dirs = dataset_dirs(root)?;
        if dirs.is_empty() {
            return Err(hypha_dataset::Error::Empty {
                path: root.to_path_buf(),
            });
        }
        for dir in dirs {
            let dataset = Dataset::open(&dir)?;
            let stamp = stamp(&dir);
            catalog.datasets.insert(
                dataset.name().to_string(),
                Entry {
                    dataset: Arc::new(dataset),
                    stamp,
                },
            );
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
            let stamp = stamp(&dir);
            if self.datasets.get(&name).is_some_and(|e| e.stamp == stamp) {
                continue;
            }
            match open_current(&dir, &stamp) {
                Ok(dataset) => {
                    let entry = Entry {
                        dataset: Arc::new(dataset),
                        stamp,
                    };
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

    /// The dataset called `name`.
    pub fn get(&self, name: &str) -> Option<Arc<Dataset>> {
        self.datasets.get(name).map(|e| e.dataset.clone())
    }

    /// The names of every dataset served.
    pub fn names(&self) -> Vec<String> {
        self.datasets.keys().cloned().collect()
    }
}

/// Opens a dataset that changed on disk. A stored manifest older than any slice describes the
/// previous contents (a slice replaced by one of the same size passes its size check), so the
/// manifest is derived afresh then.
fn open_current(dir: &Path, stamp: &Stamp) -> Result<Dataset, hypha_dataset::Error> {
    let manifest_time = stamp
        .iter()
        .find(|(file, _, _)| file == MANIFEST_FILE)
        .and_then(|(_, _, modified)| *modified);
    let newer_slice = stamp
        .iter()
        .filter(|(file, _, _)| file != MANIFEST_FILE)
        .any(|(_, _, modified)| matches!((modified, manifest_time), (Some(s), Some(m)) if s > &m));
    if newer_slice {
        tracing::info!(dataset = %dir.display(), "slices are newer than manifest.json; deriving the manifest from the slices");
        Dataset::derive(dir)
    } else {
        Dataset::open(dir)
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
    files
        .into_iter()
        .map(|file| {
            let meta = std::fs::metadata(dir.join(&file)).ok();
            let size = meta.as_ref().map_or(0, |m| m.len());
            let modified = meta.and_then(|m| m.modified().ok());
            (file, size, modified)
        })
        .collect()
}
