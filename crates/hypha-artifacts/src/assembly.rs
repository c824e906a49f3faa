//! Assembling an artifact's files from chunks that arrive in any order, and reading them back
//! for peers.
//!
//! Each file is written in place: a sparse part file of its final size beside the destination
//! (`.NAME.hypha-part`), every chunk written once at its offset (`pwrite`), so no byte is
//! written twice. When every chunk is in, the part files are fsynced and renamed over their
//! destinations. Reads and writes of different chunks run in parallel on the same handles.
//!
//! Where the file system allows it (Linux `O_DIRECT`; not tmpfs), whole aligned blocks are
//! written and read with direct I/O: the bytes go from the receive buffer to the disk without a
//! copy into the page cache, and nodes that assemble several large artifacts do not fill memory
//! with pages nobody reads again. Writing into fresh page-cache pages was the largest cost of a
//! distribution (see BENCHMARKS.md, `distribute`). A block that is not aligned (a file's tail),
//! and every block where direct I/O is refused, goes through the page cache as before.

use hypha_messages::artifact::Request;
use std::{
    fs::{File, OpenOptions},
    io,
    os::unix::fs::{FileExt, PermissionsExt},
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

/// Alignment of direct I/O: the buffer's address, the file offset and the length. 4 KiB
/// covers the logical block size of common disks (512 B or 4 KiB).
const DIRECT_ALIGN: usize = 4096;

/// A block of bytes that starts at a [`DIRECT_ALIGN`]-aligned address, found inside an
/// allocation one alignment larger, so that no unsafe code is needed.
#[derive(Debug)]
pub(crate) struct AlignedBlock {
    storage: Vec<u8>,
    start: usize,
    len: usize,
}

impl AlignedBlock {
    fn new(capacity: usize) -> AlignedBlock {
        let storage = vec![0u8; capacity + DIRECT_ALIGN];
        let start = storage.as_ptr().align_offset(DIRECT_ALIGN);
        AlignedBlock {
            storage,
            start,
            len: 0,
        }
    }

    fn capacity(&self) -> usize {
        self.storage.len() - DIRECT_ALIGN
    }

    fn as_slice(&self) -> &[u8] {
        &self.storage[self.start..self.start + self.len]
    }

    /// Appends as much of `bytes` as fits and returns how much that was.
    fn extend(&mut self, bytes: &[u8]) -> usize {
        let n = bytes.len().min(self.capacity() - self.len);
        let at = self.start + self.len;
        self.storage[at..at + n].copy_from_slice(&bytes[..n]);
        self.len += n;
        n
    }

    /// The whole capacity, to read into; [`AlignedBlock::set_len`] says how much was read.
    fn spare(&mut self) -> &mut [u8] {
        let end = self.start + self.capacity();
        &mut self.storage[self.start..end]
    }

    fn set_len(&mut self, len: usize) {
        self.len = len.min(self.capacity());
    }

    fn into_bytes(self) -> Bytes {
        Bytes::from(self.storage).slice(self.start..self.start + self.len)
    }
}

fn is_aligned(offset: u64, bytes: &[u8]) -> bool {
    offset.is_multiple_of(DIRECT_ALIGN as u64)
        && bytes.len().is_multiple_of(DIRECT_ALIGN)
        && bytes.as_ptr().align_offset(DIRECT_ALIGN) == 0
}

/// The file opened again for direct I/O, where the file system allows it.
#[cfg(target_os = "linux")]
fn open_direct(path: &Path, write: bool) -> Option<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let flags = rustix::fs::OFlags::DIRECT.bits();
    OpenOptions::new()
        .read(true)
        .write(write)
        .custom_flags(i32::try_from(flags).ok()?)
        .open(path)
        .ok()
}

#[cfg(not(target_os = "linux"))]
fn open_direct(_: &Path, _: bool) -> Option<File> {
    None
}

/// Whether direct I/O was refused for this file or block (`EINVAL`): the page cache takes it.
fn refused(e: &io::Error) -> bool {
    e.raw_os_error() == Some(rustix::io::Errno::INVAL.raw_os_error())
}

/// An artifact's files on disk, being assembled or complete.
#[derive(Debug)]
pub struct Assembly {
    manifest: Arc<Manifest>,
    files: Vec<File>,
    /// Per file: a second handle with `O_DIRECT`, where the file system allows it.
    direct: Vec<Option<File>>,
    parts: Vec<PathBuf>,
    targets: Vec<PathBuf>,
    /// Per file: a background `fdatasync` is under way.
    syncing: Vec<AtomicBool>,
}

fn with_path(path: &Path) -> impl FnOnce(io::Error) -> io::Error + '_ {
    move |e| io::Error::new(e.kind(), format!("{}: {e}", path.display()))
}

pub fn part_path(target: &Path) -> PathBuf {
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
        let mut direct = Vec::new();
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
            direct.push(open_direct(&part, true));
            files.push(file);
            parts.push(part);
            targets.push(target);
        }
        Ok(Assembly {
            syncing: files.iter().map(|_| AtomicBool::new(false)).collect(),
            manifest,
            files,
            direct,
            parts,
            targets,
        })
    }

    /// Opens the complete files of a cached artifact, to serve them.
    pub fn open_complete(manifest: Arc<Manifest>, request: &Request) -> io::Result<Assembly> {
        let mut files = Vec::new();
        let mut direct = Vec::new();
        let mut targets = Vec::new();
        for i in 0..manifest.files.len() {
            let target = manifest.target(request, i);
            files.push(File::open(&target).map_err(with_path(&target))?);
            direct.push(open_direct(&target, false));
            targets.push(target);
        }
        Ok(Assembly {
            syncing: files.iter().map(|_| AtomicBool::new(false)).collect(),
            manifest,
            files,
            direct,
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
        let at = chunk.offset + offset;
        if let Some(direct) = &self.direct[chunk.file]
            && is_aligned(at, bytes)
        {
            match direct.write_all_at(bytes, at) {
                Err(e) if refused(&e) => {}
                result => return result,
            }
        }
        self.files[chunk.file].write_all_at(bytes, at)
    }

    /// Reads up to `len` bytes at `offset` within `chunk` (blocking).
    pub fn read_at(&self, chunk: Chunk, offset: u64, len: usize) -> io::Result<Bytes> {
        let len = len.min((chunk.len - offset.min(chunk.len)) as usize);
        let at = chunk.offset + offset;
        if let Some(direct) = &self.direct[chunk.file]
            && at.is_multiple_of(DIRECT_ALIGN as u64)
        {
            // Whole aligned blocks, past the end where `len` is not a multiple: a direct read
            // stops at the end of the file.
            let mut block = AlignedBlock::new(len.next_multiple_of(DIRECT_ALIGN));
            let mut read = 0;
            let buffer = block.spare();
            let outcome = loop {
                if read >= len {
                    break Ok(());
                }
                match direct.read_at(&mut buffer[read..], at + read as u64) {
                    Ok(0) => break Err(io::ErrorKind::UnexpectedEof.into()),
                    Ok(n) => read += n,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => break Err(e),
                }
            };
            match outcome {
                Ok(()) => {
                    block.set_len(len);
                    return Ok(block.into_bytes());
                }
                Err(e) if refused(&e) => {}
                Err(e) => return Err(e),
            }
        }
        let mut buf = BytesMut::zeroed(len);
        self.files[chunk.file].read_exact_at(&mut buf, at)?;
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

    /// Makes every part file read-only (see `cache::make_read_only`), syncs it and renames it
    /// over its destination (blocking). The open handles keep working, so the files can still
    /// be served.
    pub fn finish(&self) -> io::Result<()> {
        for ((file, part), target) in self.files.iter().zip(&self.parts).zip(&self.targets) {
            let mode = file
                .metadata()
                .map_err(with_path(part))?
                .permissions()
                .mode();
            file.set_permissions(std::fs::Permissions::from_mode(mode & !0o222))
                .map_err(with_path(part))?;
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
    /// Taken while a block is being written on the blocking pool.
    pending: Option<AlignedBlock>,
    hasher: Option<blake3::Hasher>,
}

impl ChunkSink {
    pub(crate) fn new(assembly: Arc<Assembly>, chunk: Chunk) -> ChunkSink {
        ChunkSink {
            assembly,
            chunk,
            written: 0,
            pending: None,
            hasher: Some(blake3::Hasher::new()),
        }
    }

    /// Bytes received so far.
    pub(crate) fn received(&self) -> u64 {
        self.written + self.pending.as_ref().map_or(0, |p| p.len) as u64
    }

    pub(crate) async fn push(&mut self, bytes: &[u8]) -> io::Result<()> {
        if self.received() + bytes.len() as u64 > self.chunk.len {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("more than the chunk's {} bytes", self.chunk.len),
            ));
        }
        let mut bytes = bytes;
        while !bytes.is_empty() {
            let block = self
                .pending
                .get_or_insert_with(|| AlignedBlock::new(IO_BLOCK));
            let n = block.extend(bytes);
            bytes = &bytes[n..];
            if block.len == block.capacity() {
                self.flush().await?;
            }
        }
        Ok(())
    }

    async fn flush(&mut self) -> io::Result<()> {
        let Some(mut block) = self.pending.take().filter(|b| b.len > 0) else {
            return Ok(());
        };
        let assembly = self.assembly.clone();
        let chunk = self.chunk;
        let offset = self.written;
        let mut hasher = self.hasher.take().unwrap_or_default();
        let (block_back, hasher, result) = tokio::task::spawn_blocking(move || {
            hasher.update(block.as_slice());
            let result = assembly.write_at(chunk, offset, block.as_slice());
            let written = block.len as u64;
            block.set_len(0);
            (block, hasher, result.map(|()| written))
        })
        .await
        .map_err(io::Error::other)?;
        self.hasher = Some(hasher);
        // The block is written: the next one reuses its memory.
        self.pending = Some(block_back);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::FileEntry;
    use hypha_messages::artifact::Kind;

    const CHUNK: u64 = 1024 * 1024;

    fn manifest(sizes: &[u64], chunk_size: u64) -> Arc<Manifest> {
        let files = sizes
            .iter()
            .enumerate()
            .map(|(i, &size)| FileEntry {
                relative: format!("f{i}"),
                location: format!("p/f{i}"),
                size,
                e_tag: Some("\"1\"".into()),
                version: None,
                last_modified_ms: 0,
            })
            .collect();
        Arc::new(Manifest::new("s3://bucket/p", chunk_size, files))
    }

    fn request(destination: &Path) -> Request {
        Request {
            profile: "default".into(),
            uri: "p".into(),
            kind: Kind::Prefix,
            destination: destination.to_path_buf(),
            unpack: None,
        }
    }

    fn pattern(len: u64, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i % 251) as u8 ^ seed.wrapping_mul(31))
            .collect()
    }

    /// Every chunk arrives in pieces of an awkward size, in reverse order; the files must be
    /// exact, and reads and hashes of each chunk must match, whether a block went to the disk
    /// directly (aligned) or through the page cache (the 1000-byte tail, a chunk size that is
    /// not a multiple of 4 KiB).
    async fn assemble(sizes: &[u64], chunk_size: u64) {
        let dir = tempfile::tempdir().unwrap();
        let manifest = manifest(sizes, chunk_size);
        let request = request(dir.path());
        let assembly = Arc::new(Assembly::create(manifest.clone(), &request, true).unwrap());
        let contents: Vec<Vec<u8>> = sizes
            .iter()
            .enumerate()
            .map(|(i, &size)| pattern(size, i as u8))
            .collect();
        for &chunk in manifest.chunks().iter().rev() {
            let bytes = &contents[chunk.file][chunk.offset as usize..][..chunk.len as usize];
            let mut sink = ChunkSink::new(assembly.clone(), chunk);
            for piece in bytes.chunks(7000) {
                sink.push(piece).await.unwrap();
            }
            assert_eq!(sink.received(), chunk.len);
            let hash = sink.finish().await.unwrap();
            assert_eq!(hash, *blake3::hash(bytes).as_bytes());
            assert_eq!(assembly.hash_chunk(chunk).unwrap(), hash);
            let mut read = Vec::new();
            while (read.len() as u64) < chunk.len {
                read.extend_from_slice(
                    &assembly
                        .read_at(chunk, read.len() as u64, IO_BLOCK / 2)
                        .unwrap(),
                );
            }
            assert!(read == bytes, "chunk {chunk:?} reads back as written");
        }
        assembly.finish().unwrap();
        for (i, content) in contents.iter().enumerate() {
            let on_disk = std::fs::read(dir.path().join(format!("f{i}"))).unwrap();
            assert!(&on_disk == content, "file {i} is byte-exact");
        }
        let complete = Assembly::open_complete(manifest.clone(), &request).unwrap();
        let last = *manifest.chunks().last().unwrap();
        let tail = &contents[last.file][last.offset as usize..];
        assert!(complete.read_at(last, 0, IO_BLOCK).unwrap() == tail);
    }

    #[tokio::test]
    async fn aligned_and_unaligned_blocks_assemble_exact_files() {
        assemble(&[3 * CHUNK + 1000, 4096, 10], CHUNK).await;
    }

    #[tokio::test]
    async fn a_chunk_size_off_the_alignment_goes_through_the_page_cache() {
        assemble(&[2 * CHUNK + 12_345], CHUNK + 100).await;
    }

    #[test]
    fn an_aligned_block_starts_aligned_and_fills_to_its_capacity() {
        let mut block = AlignedBlock::new(8192);
        assert_eq!(block.as_slice().as_ptr().align_offset(DIRECT_ALIGN), 0);
        assert_eq!(block.extend(&[7; 5000]), 5000);
        assert_eq!(block.extend(&[8; 5000]), 3192, "only what fits");
        assert_eq!(block.len, block.capacity());
        let bytes = block.into_bytes();
        assert_eq!(bytes.len(), 8192);
        assert!(bytes[..5000].iter().all(|&b| b == 7) && bytes[5000..].iter().all(|&b| b == 8));
    }
}
