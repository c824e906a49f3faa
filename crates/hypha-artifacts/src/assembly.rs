//! Assembling an artifact's files from chunks that arrive in any order, and reading them back
//! for peers.
//!
//! Each file is written in place: a sparse part file of its final size beside the destination
//! (`.NAME.hypha-part`), every chunk written once at its offset (`pwrite`), so no byte is
//! written twice. When every chunk is in, the part files are fsynced and renamed over their
//! destinations. Reads and writes of different chunks run in parallel on the same handles.

use hypha_messages::artifact::Request;
use std::{
    fs::{File, OpenOptions},
    io,
    os::unix::fs::FileExt,
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
};

use bytes::{Bytes, BytesMut};

use crate::manifest::{Chunk, Manifest};

/// Bytes gathered before one write: large enough to amortise the blocking-pool hop.
pub(crate) const IO_BLOCK: usize = 1024 * 1024;

/// An artifact's files on disk, being assembled or complete.
#[derive(Debug)]
pub struct Assembly {
    manifest: Arc<Manifest>,
    files: Vec<File>,
    parts: Vec<PathBuf>,
    targets: Vec<PathBuf>,
    /// Per file: a background `fdatasync` is under way.
    syncing: Vec<AtomicBool>,
}

fn with_path(path: &Path) -> impl FnOnce(io::Error) -> io::Error + '_ {
    move |e| io::Error::new(e.kind(), format!("{}: {e}", path.display()))
}

fn part_path(target: &Path) -> PathBuf {
    let name = target
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    target.with_file_name(format!(".{name}.hypha-part"))
}

impl Assembly {
    /// Opens (creating where missing) the part files of `manifest`'s files for `request`.
    /// Bytes already in a part file are kept for resuming: the cache says which chunks they
    /// hold. With `fresh` (nothing to resume), part files are new files: a part file left by
    /// another version of the artifact may still be written by that version's last transfers
    /// in this process, which must never land in this one.
    pub fn create(manifest: Arc<Manifest>, request: &Request, fresh: bool) -> io::Result<Assembly> {
        let mut files = Vec::new();
        let mut parts = Vec::new();
        let mut targets = Vec::new();
        for (i, entry) in manifest.files.iter().enumerate() {
            let target = manifest.target(request, i);
            let part = part_path(&target);
            if let Some(dir) = part.parent() {
                std::fs::create_dir_all(dir).map_err(with_path(dir))?;
            }
            if fresh {
                match std::fs::remove_file(&part) {
                    Ok(()) => {}
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                    Err(e) => return Err(with_path(&part)(e)),
                }
            }
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&part)
                .map_err(with_path(&part))?;
            if file.metadata().map_err(with_path(&part))?.len() != entry.size {
                file.set_len(entry.size).map_err(with_path(&part))?;
            }
            files.push(file);
            parts.push(part);
            targets.push(target);
        }
        Ok(Assembly {
            syncing: files.iter().map(|_| AtomicBool::new(false)).collect(),
            manifest,
            files,
            parts,
            targets,
        })
    }

    /// Opens the complete files of a cached artifact, to serve them.
    pub fn open_complete(manifest: Arc<Manifest>, request: &Request) -> io::Result<Assembly> {
        let mut files = Vec::new();
        let mut targets = Vec::new();
        for i in 0..manifest.files.len() {
            let target = manifest.target(request, i);
            files.push(File::open(&target).map_err(with_path(&target))?);
            targets.push(target);
        }
        Ok(Assembly {
            syncing: files.iter().map(|_| AtomicBool::new(false)).collect(),
            manifest,
            files,
            parts: Vec::new(),
            targets,
        })
    }

    pub fn manifest(&self) -> &Arc<Manifest> {
        &self.manifest
    }

    /// Where the files end up.
    pub fn targets(&self) -> &[PathBuf] {
        &self.targets
    }

    /// Writes `bytes` at `offset` within `chunk` (blocking).
    pub fn write_at(&self, chunk: Chunk, offset: u64, bytes: &[u8]) -> io::Result<()> {
        if offset + bytes.len() as u64 > chunk.len {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "more bytes than the chunk holds",
            ));
        }
        self.files[chunk.file].write_all_at(bytes, chunk.offset + offset)
    }

    /// Reads up to `len` bytes at `offset` within `chunk` (blocking).
    pub fn read_at(&self, chunk: Chunk, offset: u64, len: usize) -> io::Result<Bytes> {
        let len = len.min((chunk.len - offset.min(chunk.len)) as usize);
        let mut buf = BytesMut::zeroed(len);
        self.files[chunk.file].read_exact_at(&mut buf, chunk.offset + offset)?;
        Ok(buf.freeze())
    }

    /// The BLAKE3 of what is on disk for `chunk` (blocking).
    pub fn hash_chunk(&self, chunk: Chunk) -> io::Result<[u8; 32]> {
        let mut hasher = blake3::Hasher::new();
        let mut offset = 0;
        while offset < chunk.len {
            let block = self.read_at(chunk, offset, IO_BLOCK)?;
            hasher.update(&block);
            offset += block.len() as u64;
        }
        Ok(*hasher.finalize().as_bytes())
    }

    /// Starts writing `file`'s dirty pages to disk in the background unless that is already
    /// under way, so that the sync at the end finds little left to do: without it a large
    /// artifact's whole size is written out only after its last byte arrived.
    pub fn write_back(self: &Arc<Self>, file: usize) {
        if self.syncing[file].swap(true, Ordering::AcqRel) {
            return;
        }
        let assembly = self.clone();
        tokio::task::spawn_blocking(move || {
            if let Err(e) = assembly.files[file].sync_data() {
                tracing::debug!("background sync of {}: {e}", assembly.parts[file].display());
            }
            assembly.syncing[file].store(false, Ordering::Release);
        });
    }

    /// Syncs every part file and renames it over its destination (blocking). The open handles
    /// keep working, so the files can still be served.
    pub fn finish(&self) -> io::Result<()> {
        for ((file, part), target) in self.files.iter().zip(&self.parts).zip(&self.targets) {
            file.sync_all().map_err(with_path(part))?;
            std::fs::rename(part, target).map_err(with_path(target))?;
        }
        let mut dirs: Vec<&Path> = self.targets.iter().filter_map(|t| t.parent()).collect();
        dirs.sort();
        dirs.dedup();
        for dir in dirs {
            File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(with_path(dir))?;
        }
        Ok(())
    }
}

/// Receives one chunk's bytes in order, writing them in blocks and hashing them as they pass.
#[derive(Debug)]
pub(crate) struct ChunkSink {
    assembly: Arc<Assembly>,
    chunk: Chunk,
    written: u64,
    pending: BytesMut,
    hasher: Option<blake3::Hasher>,
}

impl ChunkSink {
    pub(crate) fn new(assembly: Arc<Assembly>, chunk: Chunk) -> ChunkSink {
        ChunkSink {
            assembly,
            chunk,
            written: 0,
            pending: BytesMut::with_capacity(IO_BLOCK),
            hasher: Some(blake3::Hasher::new()),
        }
    }

    /// Bytes received so far.
    pub(crate) fn received(&self) -> u64 {
        self.written + self.pending.len() as u64
    }

    pub(crate) async fn push(&mut self, bytes: &[u8]) -> io::Result<()> {
        if self.received() + bytes.len() as u64 > self.chunk.len {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("more than the chunk's {} bytes", self.chunk.len),
            ));
        }
        self.pending.extend_from_slice(bytes);
        if self.pending.len() >= IO_BLOCK {
            self.flush().await?;
        }
        Ok(())
    }

    async fn flush(&mut self) -> io::Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let block = self.pending.split().freeze();
        let assembly = self.assembly.clone();
        let chunk = self.chunk;
        let offset = self.written;
        let mut hasher = self.hasher.take().unwrap_or_default();
        let (hasher, result) = tokio::task::spawn_blocking(move || {
            hasher.update(&block);
            let result = assembly.write_at(chunk, offset, &block);
            (hasher, result.map(|()| block.len() as u64))
        })
        .await
        .map_err(io::Error::other)?;
        self.hasher = Some(hasher);
        self.written += result?;
        Ok(())
    }

    /// Writes what is left and returns the chunk's BLAKE3; fails if bytes are missing.
    pub(crate) async fn finish(mut self) -> io::Result<[u8; 32]> {
        self.flush().await?;
        self.assembly.write_back(self.chunk.file);
        if self.written != self.chunk.len {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "got {} of the chunk's {} bytes",
                    self.written, self.chunk.len
                ),
            ));
        }
        Ok(*self.hasher.take().unwrap_or_default().finalize().as_bytes())
    }
}
