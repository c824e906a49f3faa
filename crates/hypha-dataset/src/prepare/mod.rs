//! Building datasets from common inputs.
//!
//! A [`Source`] presents samples as named columns (a tensor per column, the leading dimension
//! being the sample); [`write_dataset`] cuts it into slices of `slice_size` samples, encodes
//! them in parallel, writes each file and the manifest into a temporary directory beside the
//! destination and renames it into place only when everything is on disk, so an interrupted
//! run leaves no half-built dataset behind.
//!
//! Sources: [`arrays`] (`.npy` files or a `.safetensors` file), [`text`] (JSONL tokenised into
//! fixed-length sequences) and [`images`] (a folder per class).

pub mod arrays;
pub mod images;
pub mod text;

use std::{
    path::{Path, PathBuf},
    sync::{
        Mutex,
        atomic::{AtomicU64, Ordering},
    },
};

use safetensors::Dtype;

use crate::{
    Manifest, SliceEntry,
    dataset::describe_bytes,
    manifest::FORMAT,
    slice::{self, Encoding, SliceError, Tensors},
};

/// A preparation failed.
#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    #[error("{path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("{path}: {reason}")]
    Input { path: PathBuf, reason: String },
    #[error("{0} already exists; pass --force to replace it")]
    Exists(PathBuf),
    #[error("the input holds no samples")]
    Empty,
    #[error(transparent)]
    Slice(#[from] SliceError),
}

impl PrepareError {
    pub(crate) fn input(path: &Path, reason: impl Into<String>) -> Self {
        PrepareError::Input {
            path: path.to_path_buf(),
            reason: reason.into(),
        }
    }

    pub(crate) fn io(path: &Path, error: std::io::Error) -> Self {
        PrepareError::Io {
            path: path.to_path_buf(),
            error,
        }
    }
}

/// One column of a source: a tensor whose leading dimension is the sample.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Column {
    pub name: String,
    pub dtype: Dtype,
    /// The shape of one sample (without the leading dimension).
    pub sample_shape: Vec<usize>,
}

impl Column {
    /// Bytes per sample.
    pub fn sample_bytes(&self) -> usize {
        self.sample_shape.iter().product::<usize>() * self.dtype.bitsize() / 8
    }
}

/// Samples to cut into slices. Implementations are read from several threads at once.
pub trait Source: Sync {
    fn columns(&self) -> &[Column];
    fn samples(&self) -> u64;
    /// The little-endian bytes of samples `start..start + count` of column `column`.
    fn read(&self, column: usize, start: u64, count: u64) -> Result<Vec<u8>, PrepareError>;
    /// Files to write beside the slices (such as class names).
    fn extra_files(&self) -> Vec<(String, Vec<u8>)> {
        Vec::new()
    }
}

/// How to write a dataset.
#[derive(Debug, Clone)]
pub struct Options {
    /// Samples per slice. Default: 1024.
    pub slice_size: u64,
    /// Default: Snappy, as the reference recipe.
    pub encoding: Encoding,
    /// Worker threads. Default: the number of cores.
    pub threads: usize,
    /// Replace an existing destination. Default: no.
    pub force: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            slice_size: 1024,
            encoding: Encoding::Snappy,
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            force: false,
        }
    }
}

/// Cuts `source` into slices under `output` (whose name becomes the dataset's name) and writes
/// the manifest. `progress` is called with the number of samples written so far.
pub fn write_dataset(
    source: &dyn Source,
    output: &Path,
    options: &Options,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<Manifest, PrepareError> {
    let total = source.samples();
    if total == 0 || source.columns().is_empty() {
        return Err(PrepareError::Empty);
    }
    if output.exists() && !options.force {
        return Err(PrepareError::Exists(output.to_path_buf()));
    }
    let parent = match output.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&parent).map_err(|e| PrepareError::io(&parent, e))?;
    let name = output
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .ok_or_else(|| PrepareError::input(output, "the output needs a directory name"))?;
    let staging = tempfile::Builder::new()
        .prefix(&format!(".{name}.partial-"))
        .tempdir_in(&parent)
        .map_err(|e| PrepareError::io(&parent, e))?;

    let slice_size = options.slice_size.max(1);
    let count = total.div_ceil(slice_size);
    let width = count.saturating_sub(1).to_string().len().max(4);
    let next = AtomicU64::new(0);
    let done = AtomicU64::new(0);
    let entries: Mutex<Vec<Option<SliceEntry>>> = Mutex::new(vec![None; count as usize]);
    let failure: Mutex<Option<PrepareError>> = Mutex::new(None);
    std::thread::scope(|scope| {
        for _ in 0..options.threads.clamp(1, count as usize) {
            scope.spawn(|| {
                loop {
                    let index = next.fetch_add(1, Ordering::Relaxed);
                    if index >= count || failure.lock().map(|f| f.is_some()).unwrap_or(true) {
                        break;
                    }
                    let start = index * slice_size;
                    let samples = slice_size.min(total - start);
                    let file = format!("slice-{index:0width$}.safetensors");
                    match build_slice(source, start, samples, options.encoding)
                        .and_then(|bytes| write_slice(staging.path(), &file, bytes, index))
                    {
                        Ok(entry) => {
                            if let Ok(mut entries) = entries.lock() {
                                entries[index as usize] = Some(entry);
                            }
                            progress(done.fetch_add(samples, Ordering::Relaxed) + samples);
                        }
                        Err(e) => {
                            if let Ok(mut failure) = failure.lock() {
                                failure.get_or_insert(e);
                            }
                        }
                    }
                }
            });
        }
    });
    if let Some(e) = failure.into_inner().ok().flatten() {
        return Err(e);
    }
    let slices: Vec<SliceEntry> = entries
        .into_inner()
        .unwrap_or_default()
        .into_iter()
        .flatten()
        .collect();
    let manifest = Manifest {
        format: FORMAT.to_string(),
        name,
        slices,
    };
    let json = serde_json::to_vec_pretty(&manifest)
        .map_err(|e| PrepareError::input(output, e.to_string()))?;
    let manifest_path = staging.path().join(crate::MANIFEST_FILE);
    hypha_files::write_atomic(&manifest_path, &json, hypha_files::Mode::Public, true).map_err(
        |e| PrepareError::Input {
            path: manifest_path.clone(),
            reason: e.to_string(),
        },
    )?;

    for (file, bytes) in source.extra_files() {
        let path = staging.path().join(&file);
        hypha_files::write_atomic(&path, &bytes, hypha_files::Mode::Public, true).map_err(|e| {
            PrepareError::Input {
                path: path.clone(),
                reason: e.to_string(),
            }
        })?;
    }
    let staged = staging.keep();
    if output.exists() {
        std::fs::remove_dir_all(output).map_err(|e| PrepareError::io(output, e))?;
    }
    std::fs::rename(&staged, output).map_err(|e| PrepareError::io(output, e))?;
    if let Ok(dir) = std::fs::File::open(&parent) {
        let _ = dir.sync_all();
    }
    Ok(manifest)
}

fn build_slice(
    source: &dyn Source,
    start: u64,
    samples: u64,
    encoding: Encoding,
) -> Result<Vec<u8>, PrepareError> {
    let mut tensors = Tensors::new();
    for (i, column) in source.columns().iter().enumerate() {
        let data = source.read(i, start, samples)?;
        let mut shape = vec![samples as usize];
        shape.extend(&column.sample_shape);
        tensors = tensors.with(&column.name, column.dtype, shape, data)?;
    }
    Ok(slice::encode(&tensors, encoding)?)
}

fn write_slice(
    dir: &Path,
    file: &str,
    bytes: Vec<u8>,
    index: u64,
) -> Result<SliceEntry, PrepareError> {
    use std::io::Write;
    let path = dir.join(file);
    let mut out = std::fs::File::create(&path).map_err(|e| PrepareError::io(&path, e))?;
    out.write_all(&bytes)
        .map_err(|e| PrepareError::io(&path, e))?;
    out.sync_all().map_err(|e| PrepareError::io(&path, e))?;
    Ok(describe_bytes(&bytes, file, index)?)
}
