use std::{
    path::{Path, PathBuf},
    sync::atomic::{AtomicUsize, Ordering},
    time::SystemTime,
};

use crate::{
    Manifest, SliceEntry,
    manifest::FORMAT,
    slice::{self, SliceError},
};

/// The file in a dataset directory that holds its manifest.
pub const MANIFEST_FILE: &str = "manifest.json";

/// A dataset could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error(
        "{path}: not a dataset directory (no *.safetensors slice files); point dataset_path at a directory of slices, or create one with `hypha-data prepare`"
    )]
    Empty { path: PathBuf },
    #[error("{path}: {error}")]
    Slice { path: PathBuf, error: SliceError },
    #[error(
        "{path}: invalid manifest: {reason}; delete it to have it derived from the slices, or rewrite it with `hypha-data prepare`"
    )]
    Manifest { path: PathBuf, reason: String },
    #[error(transparent)]
    Write(#[from] hypha_files::Error),
}

/// A dataset directory and its manifest.
#[derive(Debug, Clone)]
pub struct Dataset {
    root: PathBuf,
    name: String,
    manifest: Manifest,
    source: ManifestSource,
    /// For a derived manifest: when the slices began to be read. A slice modified since is
    /// not described by it, so it is not stored.
    described_at: Option<SystemTime>,
}

/// Where a dataset's manifest came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ManifestSource {
    /// Read from this file: `manifest.json` in the dataset, or one stored for it elsewhere
    /// (see [`Dataset::store_manifest`]).
    Stored(PathBuf),
    /// Derived from the slices now: the dataset has no stored manifest, or the stored one
    /// describes other files than the directory holds.
    Derived,
    /// The slices changed on disk but could not all be described (`problem`): the manifest
    /// stored at `path` is kept, so that the intact slices stay usable and the damaged one
    /// fails its hash check wherever it is read.
    Kept { path: PathBuf, problem: String },
}

impl Dataset {
    /// Opens a dataset directory with its manifest: [`MANIFEST_FILE`] in the directory.
    /// See [`Dataset::open_with`].
    pub fn open(root: &Path) -> Result<Self, Error> {
        Self::open_with(root, None)
    }

    /// Opens a dataset directory with its stored manifest: [`MANIFEST_FILE`] in the
    /// directory, else the file `external` (where [`Dataset::store_manifest`] puts it for a
    /// read-only dataset).
    ///
    /// The stored manifest is used when it lists exactly the directory's slice files and none
    /// of them is newer than it. Otherwise the slices changed (added, removed, rewritten) and
    /// the manifest is derived by reading every slice, in parallel, which hashes and parses
    /// each; when that fails and a manifest is stored, the stored one is kept
    /// ([`ManifestSource::Kept`]). A slice whose content changed while its time did not (a
    /// flipped bit, a truncation that kept the time) is not detected here: that is what the
    /// hashes are for (`verify`, and every client).
    pub fn open_with(root: &Path, external: Option<&Path>) -> Result<Self, Error> {
        let files = slice_files(root)?;
        let name = dataset_name(root);
        let stored = read_stored(root, external)?;
        if let Some((path, manifest)) = &stored
            && current(manifest, path, root, &files)
        {
            return Ok(Dataset {
                root: root.to_path_buf(),
                name,
                manifest: manifest.clone(),
                source: ManifestSource::Stored(path.clone()),
                described_at: None,
            });
        }
        let described_at = SystemTime::now();
        match (derive(root, &name, &files), stored) {
            (Ok(manifest), _) => Ok(Dataset {
                root: root.to_path_buf(),
                name,
                manifest,
                source: ManifestSource::Derived,
                described_at: Some(described_at),
            }),
            (Err(error), Some((path, manifest))) => Ok(Dataset {
                root: root.to_path_buf(),
                name,
                manifest,
                source: ManifestSource::Kept {
                    path,
                    problem: error.to_string(),
                },
                described_at: None,
            }),
            (Err(error), None) => Err(error),
        }
    }

    /// The dataset as its stored manifest describes it, whatever the directory holds now
    /// (`None` when no manifest is stored): what `verify` checks the files against.
    pub fn stored(root: &Path, external: Option<&Path>) -> Result<Option<Self>, Error> {
        Ok(
            read_stored(root, external)?.map(|(path, manifest)| Dataset {
                root: root.to_path_buf(),
                name: dataset_name(root),
                manifest,
                source: ManifestSource::Stored(path),
                described_at: None,
            }),
        )
    }

    /// Opens a dataset, deriving its manifest from the slices whatever is stored.
    pub fn derive(root: &Path) -> Result<Self, Error> {
        let files = slice_files(root)?;
        let name = dataset_name(root);
        let described_at = SystemTime::now();
        let manifest = derive(root, &name, &files)?;
        Ok(Dataset {
            root: root.to_path_buf(),
            name,
            manifest,
            source: ManifestSource::Derived,
            described_at: Some(described_at),
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    pub fn source(&self) -> &ManifestSource {
        &self.source
    }

    /// The path of slice `index`, or `None` past the end.
    pub fn slice_path(&self, index: u64) -> Option<PathBuf> {
        let entry = self.manifest.slices.get(usize::try_from(index).ok()?)?;
        Some(self.root.join(&entry.file))
    }

    /// Writes the manifest to [`MANIFEST_FILE`] atomically.
    pub fn write_manifest(&self) -> Result<(), Error> {
        self.write_manifest_to(&self.root.join(MANIFEST_FILE))
    }

    /// Stores the manifest so that later opens (and `verify`) check the slices against it:
    /// in the dataset's directory, or at `external` when the directory cannot be written (a
    /// read-only dataset). Returns where it went. A derived manifest is refused when a slice
    /// was modified after it began to be described (it may describe the old contents, and
    /// stored it would outdate the slice); the next open describes the slices again.
    pub fn store_manifest(&self, external: &Path) -> Result<PathBuf, Error> {
        if let Some(described_at) = self.described_at {
            for entry in &self.manifest.slices {
                let path = self.root.join(&entry.file);
                let modified = std::fs::metadata(&path).and_then(|m| m.modified());
                if !modified.is_ok_and(|m| m < described_at) {
                    return Err(Error::Manifest {
                        path,
                        reason: "the slice changed while the slices were described; not stored, described again on the next open".into(),
                    });
                }
            }
        }
        let beside = self.root.join(MANIFEST_FILE);
        match self.write_manifest_to(&beside) {
            Ok(()) => Ok(beside),
            Err(_) => {
                if let Some(dir) = external.parent() {
                    std::fs::create_dir_all(dir).map_err(|error| Error::Io {
                        path: dir.to_path_buf(),
                        error,
                    })?;
                }
                self.write_manifest_to(external)?;
                Ok(external.to_path_buf())
            }
        }
    }

    fn write_manifest_to(&self, path: &Path) -> Result<(), Error> {
        let json = serde_json::to_vec_pretty(&self.manifest).map_err(|e| Error::Manifest {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
        hypha_files::write_atomic(path, &json, hypha_files::Mode::Public, true)?;
        Ok(())
    }
}

/// Where the manifest of the dataset at `root` is stored under `dir` when the dataset's own
/// directory cannot hold it: named after the dataset and its absolute path, so that two
/// datasets of the same name never share one.
pub fn external_manifest_path(dir: &Path, root: &Path) -> PathBuf {
    let absolute = root.canonicalize().unwrap_or_else(|_| root.to_path_buf());
    let digest = blake3::hash(absolute.as_os_str().as_encoded_bytes()).to_hex();
    dir.join(format!("{}-{}.json", dataset_name(root), &digest[..16]))
}

/// Where manifests of read-only datasets are stored by default:
/// `$XDG_STATE_HOME/hypha/manifests`, else `~/.local/state/hypha/manifests`.
pub fn default_manifest_dir() -> Option<PathBuf> {
    let state = std::env::var_os("XDG_STATE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .filter(|v| !v.is_empty())
                .map(|home| Path::new(&home).join(".local/state"))
        })?;
    Some(state.join("hypha/manifests"))
}

/// The stored manifest: the dataset's own, else the one at `external`.
fn read_stored(root: &Path, external: Option<&Path>) -> Result<Option<(PathBuf, Manifest)>, Error> {
    let beside = root.join(MANIFEST_FILE);
    for path in std::iter::once(beside.as_path()).chain(external) {
        match std::fs::read(path) {
            Ok(bytes) => return Ok(Some((path.to_path_buf(), parse_manifest(&bytes, path)?))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(error) => {
                return Err(Error::Io {
                    path: path.to_path_buf(),
                    error,
                });
            }
        }
    }
    Ok(None)
}

fn dataset_name(root: &Path) -> String {
    root.canonicalize()
        .ok()
        .as_deref()
        .unwrap_or(root)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "dataset".into())
}

fn parse_manifest(bytes: &[u8], path: &Path) -> Result<Manifest, Error> {
    let manifest: Manifest = serde_json::from_slice(bytes).map_err(|e| Error::Manifest {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    if manifest.format != FORMAT {
        return Err(Error::Manifest {
            path: path.to_path_buf(),
            reason: format!("format {:?}, expected {FORMAT:?}", manifest.format),
        });
    }
    for (i, entry) in manifest.slices.iter().enumerate() {
        if entry.index != i as u64 || entry.file.contains('/') || entry.file.contains("..") {
            return Err(Error::Manifest {
                path: path.to_path_buf(),
                reason: format!(
                    "slice {i} is listed as index {} at {:?}",
                    entry.index, entry.file
                ),
            });
        }
    }
    Ok(manifest)
}

/// Whether the manifest at `path` still describes the directory: it lists exactly these
/// files, in this order, with their sizes, and each was last modified before the manifest was
/// written (a tie, possible with coarse timestamps, counts as changed: describing again is
/// only work, trusting a stale manifest would refuse good slices).
fn current(manifest: &Manifest, path: &Path, root: &Path, files: &[String]) -> bool {
    let written = std::fs::metadata(path).and_then(|m| m.modified()).ok();
    manifest.slices.len() == files.len()
        && manifest.slices.iter().zip(files).all(|(entry, file)| {
            let metadata = std::fs::metadata(root.join(file));
            entry.file == *file
                && match (metadata, written) {
                    (Ok(metadata), Some(written)) => {
                        metadata.len() == entry.size
                            && metadata.modified().is_ok_and(|m| m < written)
                    }
                    _ => false,
                }
        })
}

/// The slice files of a dataset directory, in numeric order of the number in their names
/// (`slice-9` before `slice-10`); ties and names without numbers sort by name.
pub fn slice_files(root: &Path) -> Result<Vec<String>, Error> {
    let io = |error| Error::Io {
        path: root.to_path_buf(),
        error,
    };
    let mut files = Vec::new();
    for entry in std::fs::read_dir(root).map_err(io)? {
        let entry = entry.map_err(io)?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') || !name.ends_with(".safetensors") {
            continue;
        }
        if entry.file_type().map_err(io)?.is_file() {
            files.push(name);
        }
    }
    if files.is_empty() {
        return Err(Error::Empty {
            path: root.to_path_buf(),
        });
    }
    files.sort_by(|a, b| slice_order(a, b));
    Ok(files)
}

/// The order of slice files: by the number in their names (`slice-9` before `slice-10`), then
/// by name.
pub fn slice_order(a: &str, b: &str) -> std::cmp::Ordering {
    (slice_number(a), a).cmp(&(slice_number(b), b))
}

/// The last run of digits in a file's stem.
fn slice_number(file: &str) -> Option<u64> {
    let stem = file.strip_suffix(".safetensors").unwrap_or(file);
    let end = stem.rfind(|c: char| c.is_ascii_digit())? + 1;
    let start = stem[..end]
        .rfind(|c: char| !c.is_ascii_digit())
        .map_or(0, |i| i + 1);
    stem[start..end].parse().ok()
}

/// Reads, hashes and describes every slice, spread over the machine's cores.
fn derive(root: &Path, name: &str, files: &[String]) -> Result<Manifest, Error> {
    let next = AtomicUsize::new(0);
    let workers = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(files.len());
    let mut results: Vec<Option<Result<SliceEntry, Error>>> =
        (0..files.len()).map(|_| None).collect();
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                scope.spawn(|| {
                    let mut done = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(file) = files.get(i) else { break };
                        done.push((i, describe_file(root, file, i as u64)));
                    }
                    done
                })
            })
            .collect();
        for handle in handles {
            // A worker only panics on a bug; surface it rather than hide a slice.
            if let Ok(done) = handle.join() {
                for (i, result) in done {
                    results[i] = Some(result);
                }
            }
        }
    });
    let slices = results
        .into_iter()
        .enumerate()
        .map(|(i, r)| {
            r.unwrap_or_else(|| {
                Err(Error::Manifest {
                    path: root.join(&files[i]),
                    reason: "the worker reading this slice failed".into(),
                })
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Manifest {
        format: FORMAT.to_string(),
        name: name.to_string(),
        slices,
    })
}

/// Builds the manifest entry of one slice file.
pub(crate) fn describe_file(root: &Path, file: &str, index: u64) -> Result<SliceEntry, Error> {
    let path = root.join(file);
    let bytes = std::fs::read(&path).map_err(|error| Error::Io {
        path: path.clone(),
        error,
    })?;
    describe_bytes(&bytes, file, index).map_err(|error| Error::Slice { path, error })
}

/// Builds the manifest entry of a slice held in memory.
pub(crate) fn describe_bytes(
    bytes: &[u8],
    file: &str,
    index: u64,
) -> Result<SliceEntry, SliceError> {
    let (encoding, plain) = slice::decode(bytes)?;
    let (tensors, samples) = slice::describe(&plain)?;
    Ok(SliceEntry {
        index,
        file: file.to_string(),
        encoding,
        size: bytes.len() as u64,
        uncompressed_size: plain.len() as u64,
        blake3: blake3::hash(bytes).to_hex().to_string(),
        samples,
        tensors,
    })
}

#[cfg(test)]
mod tests {
    use super::slice_number;

    #[test]
    fn numbers_come_from_the_last_digit_run() {
        assert_eq!(slice_number("slice-0010.safetensors"), Some(10));
        assert_eq!(slice_number("v2-part-7.safetensors"), Some(7));
        assert_eq!(slice_number("labels.safetensors"), None);
    }
}
