//! What a node remembers between runs, in an embedded ACID store (`redb`) in its cache
//! directory: the artifacts it completed (to reuse them while the origin still describes them
//! the same way) and the verified chunks of unfinished ones (to resume them).
//!
//! A chunk is recorded after its bytes were written but before they are synced; on resume
//! every recorded chunk is hashed again, so a crash between the two costs that chunk, never a
//! corrupt file.
//!
//! A completed artifact's files are made read-only and [`Stamp`]ed when they are recorded, and
//! a cache hit compares the stamps again before the files are used: whatever changed a file
//! since (a job that wrote through a link, a process of the node's user that made it writable,
//! a disk) changed its stamp, and the file's chunks are hashed again (see `Distributor::fetch`).

use hypha_messages::artifact::Request;
use std::{
    collections::BTreeMap,
    io,
    os::unix::fs::{MetadataExt, PermissionsExt},
    path::{Path, PathBuf},
};

use redb::{ReadableDatabase, TableDefinition};
use serde::{Deserialize, Serialize};

use crate::manifest::{ArtifactId, Manifest};

/// Completed artifacts by destination path: JSON [`Record`]s.
const COMPLETED: TableDefinition<&str, &[u8]> = TableDefinition::new("completed");
/// Verified chunks of unfinished artifacts: (artifact id, chunk) → BLAKE3, then one byte, 1
/// where the chunk was read from the origin by this node (absent in older caches: 0).
const CHUNKS: TableDefinition<(&[u8], u32), &[u8]> = TableDefinition::new("chunks");

/// The cache could not be used.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("cache {path}: {reason}")]
    Open { path: PathBuf, reason: String },
    #[error("cache: {0}")]
    Store(redb::Error),
    #[error("cache: {0}")]
    Record(serde_json::Error),
}

impl<E: Into<redb::Error>> From<E> for CacheError {
    fn from(error: E) -> Self {
        CacheError::Store(error.into())
    }
}

/// A completed artifact.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    pub request: Request,
    pub manifest: Manifest,
    /// BLAKE3 of every chunk, hex, in chunk order.
    pub hashes: Vec<String>,
    /// The chunks this node read from the origin itself (it vouches for their hashes to
    /// others; see `swarm`). Absent in older records: none.
    #[serde(default)]
    pub from_origin: Vec<u32>,
    /// Whether the archive was unpacked into `request.unpack`'s destination.
    pub unpacked: bool,
    /// Each file's stamp when it was completed, in manifest order. Absent in older records:
    /// their files are hashed again once.
    #[serde(default)]
    pub stamps: Vec<Stamp>,
    /// Every file and link of the unpacked tree, by its path in the tree, when it was unpacked.
    #[serde(default)]
    pub unpacked_stamps: BTreeMap<String, Stamp>,
    /// What every file and link of the unpacked tree held when it was unpacked, for copies of
    /// it to be checked against (`Contents`). Absent in older records: their trees are
    /// unpacked again once.
    #[serde(default)]
    pub unpacked_contents: BTreeMap<String, Entry>,
}

/// What a file looked like on disk: a write, a `chmod`, a new link, a rename onto it or a
/// replacement changes at least its change time, which no process can set back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stamp {
    pub len: u64,
    pub inode: u64,
    /// Modification time: seconds, nanoseconds.
    pub modified: (i64, i64),
    /// Change time: seconds, nanoseconds.
    pub changed: (i64, i64),
}

impl Stamp {
    /// The stamp of `path` (not following a link).
    pub fn of(path: &Path) -> io::Result<Stamp> {
        let m = std::fs::symlink_metadata(path)?;
        Ok(Stamp {
            len: m.len(),
            inode: m.ino(),
            modified: (m.mtime(), m.mtime_nsec()),
            changed: (m.ctime(), m.ctime_nsec()),
        })
    }

    /// Stamps of every file and link under `dir`, by path relative to it.
    pub fn of_tree(dir: &Path) -> io::Result<BTreeMap<String, Stamp>> {
        map_tree(dir, Stamp::of)
    }
}

/// A path as a record keeps it: the path itself where it is UTF-8, else a NUL and the hex of
/// its bytes (which no UTF-8 path begins with), so that every name an archive may hold
/// survives a record written as JSON.
pub fn key_of(path: &Path) -> String {
    use std::os::unix::ffi::OsStrExt;
    match path.to_str() {
        Some(text) if !text.starts_with('\0') => text.to_string(),
        _ => format!("\0{}", hex::encode(path.as_os_str().as_bytes())),
    }
}

/// The path a [`key_of`] stands for.
pub fn path_of_key(key: &str) -> PathBuf {
    use std::os::unix::ffi::OsStringExt;
    match key.strip_prefix('\0').and_then(|hex| hex::decode(hex).ok()) {
        Some(bytes) => PathBuf::from(std::ffi::OsString::from_vec(bytes)),
        None => PathBuf::from(key),
    }
}

/// `of` every file and link under `dir` (links not followed), by path relative to `dir`.
fn map_tree<T>(dir: &Path, of: impl Fn(&Path) -> io::Result<T>) -> io::Result<BTreeMap<String, T>> {
    let mut found = BTreeMap::new();
    let mut pending = vec![PathBuf::new()];
    while let Some(relative) = pending.pop() {
        for entry in std::fs::read_dir(dir.join(&relative))? {
            let entry = entry?;
            let path = relative.join(entry.file_name());
            if entry.file_type()?.is_dir() {
                pending.push(path);
            } else {
                found.insert(key_of(&path), of(&dir.join(&path))?);
            }
        }
    }
    Ok(found)
}

/// What one file or link of an unpacked tree holds, as recorded when it was unpacked.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Entry {
    /// A regular file: BLAKE3 of its bytes, hex.
    File(String),
    /// A symbolic link, to this target ([`key_of`]).
    Link(String),
}

impl Entry {
    /// What `path` holds now (not following a link; blocking). Anything but a regular file or
    /// a link is refused, and opened without waiting (a FIFO planted there blocks nothing).
    pub fn of(path: &Path) -> io::Result<Entry> {
        use rustix::fs::{Mode, OFlags};
        let metadata = std::fs::symlink_metadata(path)?;
        if metadata.is_symlink() {
            return Ok(Entry::Link(key_of(&std::fs::read_link(path)?)));
        }
        let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC;
        let file = std::fs::File::from(rustix::fs::open(path, flags, Mode::empty())?);
        if !file.metadata()?.is_file() {
            return Err(io::Error::other(format!(
                "{}: neither a regular file nor a link",
                path.display()
            )));
        }
        let mut hasher = blake3::Hasher::new();
        hasher.update_reader(file)?;
        Ok(Entry::File(hasher.finalize().to_hex().to_string()))
    }
}

/// The stamp and the contents of every file and link under `dir`, by path relative to it,
/// in one walk (blocking): what an unpacked tree is recorded with.
pub fn stamp_and_read_tree(
    dir: &Path,
) -> io::Result<(BTreeMap<String, Stamp>, BTreeMap<String, Entry>)> {
    let both = map_tree(dir, |path| Ok((Stamp::of(path)?, Entry::of(path)?)))?;
    let mut stamps = BTreeMap::new();
    let mut contents = BTreeMap::new();
    for (relative, (stamp, entry)) in both {
        stamps.insert(relative.clone(), stamp);
        contents.insert(relative, entry);
    }
    Ok((stamps, contents))
}

/// Takes every write permission off the files (not the directories) under `path`, a file or a
/// tree: the store's files are shared by jobs and served to peers, and are never written again
/// in place. (A process of the node's own user can put the permission back: the stamps find
/// out.)
pub fn make_read_only(path: &Path) -> io::Result<()> {
    let metadata = std::fs::symlink_metadata(path)?;
    if metadata.is_dir() {
        for entry in std::fs::read_dir(path)? {
            make_read_only(&entry?.path())?;
        }
    } else if metadata.is_file() && metadata.permissions().mode() & 0o222 != 0 {
        let mode = metadata.permissions().mode() & !0o222;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
    }
    Ok(())
}

impl Record {
    /// Whether `request` is satisfied by what is on disk: the files, or the tree this record's
    /// archive was unpacked into when `request` asks for that same unpack.
    pub fn satisfies(&self, request: &Request) -> bool {
        self.unpacked_as(request) || self.files_present()
    }

    /// Whether the archive was unpacked as `request` asks, and the tree is still there.
    pub fn unpacked_as(&self, request: &Request) -> bool {
        self.unpacked
            && request.unpack.is_some()
            && self.request.unpack == request.unpack
            && request
                .unpack
                .as_ref()
                .is_some_and(|u| u.destination.is_dir())
    }

    /// Whether the archive was unpacked as `request` asks and every file and link of the tree
    /// is as it was unpacked (blocking).
    pub fn tree_intact(&self, request: &Request) -> bool {
        self.unpacked_as(request)
            && self.unpacked_contents.len() == self.unpacked_stamps.len()
            && request.unpack.as_ref().is_some_and(|unpack| {
                Stamp::of_tree(&unpack.destination).is_ok_and(|now| now == self.unpacked_stamps)
            })
    }

    /// Whether every file is on disk at its size, so this node can serve it.
    pub fn files_present(&self) -> bool {
        (0..self.manifest.files.len()).all(|i| {
            std::fs::metadata(self.manifest.target(&self.request, i))
                .is_ok_and(|m| m.is_file() && m.len() == self.manifest.files[i].size)
        })
    }

    /// The chunk hashes as bytes, if they are well-formed and complete.
    pub fn chunk_hashes(&self) -> Option<Vec<[u8; 32]>> {
        if self.hashes.len() != self.manifest.chunk_count() as usize {
            return None;
        }
        self.hashes
            .iter()
            .map(|h| {
                let mut bytes = [0u8; 32];
                hex::decode_to_slice(h, &mut bytes).ok().map(|()| bytes)
            })
            .collect()
    }
}

/// A node's artifact cache. One process at a time may use a cache directory.
#[derive(Debug)]
pub struct Cache {
    db: redb::Database,
}

impl Cache {
    /// Opens (or creates) the cache in `dir`.
    pub fn open(dir: &Path) -> Result<Cache, CacheError> {
        let path = dir.join("artifacts.redb");
        let open_error = |reason: String| CacheError::Open {
            path: path.clone(),
            reason,
        };
        std::fs::create_dir_all(dir).map_err(|e| open_error(e.to_string()))?;
        let db = redb::Database::create(&path).map_err(|e| match e {
            redb::DatabaseError::DatabaseAlreadyOpen => {
                open_error("in use by another process; give each node its own work_dir".into())
            }
            e => open_error(e.to_string()),
        })?;
        let txn = db.begin_write()?;
        txn.open_table(COMPLETED)?;
        txn.open_table(CHUNKS)?;
        txn.commit()?;
        Ok(Cache { db })
    }

    fn key(request: &Request) -> String {
        request.destination.to_string_lossy().into_owned()
    }

    /// The completed artifact last written to `request`'s destination, if any.
    pub fn completed(&self, request: &Request) -> Result<Option<Record>, CacheError> {
        let txn = self.db.begin_read()?;
        let table = txn.open_table(COMPLETED)?;
        let Some(value) = table.get(Self::key(request).as_str())? else {
            return Ok(None);
        };
        // A record this version cannot read is treated as absent: the artifact is refetched.
        Ok(serde_json::from_slice::<Record>(value.value())
            .ok()
            .map(|mut r| {
                r.manifest = r.manifest.recut();
                r
            }))
    }

    /// Records a completed artifact and forgets its chunk-level progress.
    pub fn record_completed(&self, record: &Record) -> Result<(), CacheError> {
        let json = serde_json::to_vec(record).map_err(CacheError::Record)?;
        let txn = self.db.begin_write()?;
        {
            let mut table = txn.open_table(COMPLETED)?;
            table.insert(Self::key(&record.request).as_str(), json.as_slice())?;
            let mut chunks = txn.open_table(CHUNKS)?;
            let id: &[u8] = &record.manifest.id.0;
            chunks.retain_in((id, 0)..=(id, u32::MAX), |_, _| false)?;
        }
        txn.commit()?;
        Ok(())
    }

    /// Forgets a completed artifact: its files are to be fetched (or repaired) again.
    pub fn forget_completed(&self, request: &Request) -> Result<(), CacheError> {
        let txn = self.db.begin_write()?;
        {
            let mut table = txn.open_table(COMPLETED)?;
            table.remove(Self::key(request).as_str())?;
        }
        txn.commit()?;
        Ok(())
    }

    /// Records a chunk written and verified.
    pub fn record_chunk(
        &self,
        id: ArtifactId,
        chunk: u32,
        hash: &[u8; 32],
        from_origin: bool,
    ) -> Result<(), CacheError> {
        let mut value = [0u8; 33];
        value[..32].copy_from_slice(hash);
        value[32] = from_origin as u8;
        let txn = self.db.begin_write()?;
        {
            let mut chunks = txn.open_table(CHUNKS)?;
            chunks.insert((id.0.as_slice(), chunk), value.as_slice())?;
        }
        txn.commit()?;
        Ok(())
    }

    /// Forgets a recorded chunk: it is not resumed.
    pub fn forget_chunk(&self, id: ArtifactId, chunk: u32) -> Result<(), CacheError> {
        let txn = self.db.begin_write()?;
        {
            let mut chunks = txn.open_table(CHUNKS)?;
            chunks.remove((id.0.as_slice(), chunk))?;
        }
        txn.commit()?;
        Ok(())
    }

    /// Forgets every recorded chunk of `id`: it is not resumed.
    pub fn forget_chunks(&self, id: ArtifactId) -> Result<(), CacheError> {
        let txn = self.db.begin_write()?;
        {
            let mut chunks = txn.open_table(CHUNKS)?;
            let id: &[u8] = &id.0;
            chunks.retain_in((id, 0)..=(id, u32::MAX), |_, _| false)?;
        }
        txn.commit()?;
        Ok(())
    }

    /// The chunks recorded for `id`: (chunk, BLAKE3, read from the origin by this node).
    pub fn chunks(&self, id: ArtifactId) -> Result<Vec<(u32, [u8; 32], bool)>, CacheError> {
        let txn = self.db.begin_read()?;
        let table = txn.open_table(CHUNKS)?;
        let id: &[u8] = &id.0;
        let mut out = Vec::new();
        for row in table.range((id, 0)..=(id, u32::MAX))? {
            let (key, value) = row?;
            let value = value.value();
            if let Some(hash) = value.get(..32).and_then(|h| <[u8; 32]>::try_from(h).ok())
                && value.len() <= 33
            {
                out.push((key.value().1, hash, value.get(32) == Some(&1)));
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use std::{ffi::OsStr, os::unix::ffi::OsStrExt};

    use super::*;

    /// Every name an archive may hold comes back from a record as it was: UTF-8 as text, any
    /// other bytes through their hex.
    #[test]
    fn every_path_survives_a_record() {
        for path in [
            Path::new("bin/run.sh"),
            Path::new("données/é.txt"),
            Path::new(OsStr::from_bytes(b"bad/\xff\xfe.bin")),
        ] {
            let key = key_of(path);
            let json = serde_json::to_string(&key).unwrap();
            let back: String = serde_json::from_str(&json).unwrap();
            assert_eq!(path_of_key(&back), path);
        }
        assert_eq!(key_of(Path::new("bin/run.sh")), "bin/run.sh");
    }
}
