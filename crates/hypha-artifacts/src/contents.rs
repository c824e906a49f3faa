//! What a fetch's files hold, for a copy of them to be checked against.
//!
//! A cache hit is checked (its stamps, and its chunks where they changed) before its files are
//! used, but a process of the node's user can still change a store file, or swap a directory of
//! an unpacked tree, between that check and the copy a job gets. So a copy is hashed once made
//! and compared with what the fetch verified: each file's chunk hashes, each unpacked file's
//! hash and each link's target. A copy that differs, or a file the artifact never had, is
//! refused and never handed to the job.

use std::{
    collections::HashMap,
    io::{self, Read},
    path::{Path, PathBuf},
};

use crate::{
    cache::{Entry, Record, key_of, path_of_key},
    manifest::Manifest,
};

/// A copy that does not hold what the fetch verified.
#[derive(Debug, thiserror::Error)]
pub enum ContentError {
    #[error(
        "{path}: the artifact never had this file; something added it to the store since it was fetched"
    )]
    Unknown { path: PathBuf },
    #[error(
        "{path}: the copy differs from what the artifact was fetched with; something changed the store since"
    )]
    Changed { path: PathBuf },
    #[error("{path}: {error}")]
    Io { path: PathBuf, error: io::Error },
}

/// What one store path holds.
#[derive(Debug, Clone)]
enum Content {
    /// A fetched file: its size and the BLAKE3 of each of its chunks of `chunk_size` bytes.
    Chunks {
        size: u64,
        chunk_size: u64,
        hashes: Vec<[u8; 32]>,
    },
    /// A file or link of the unpacked tree.
    Unpacked(Entry),
}

/// What a fetch's files hold, by their paths in the store.
#[derive(Debug, Clone, Default)]
pub struct Contents {
    by_path: HashMap<PathBuf, Content>,
    /// Where the archive was unpacked, if it was.
    unpacked: Option<PathBuf>,
}

impl Contents {
    /// What `record`'s files hold at their targets for `request` (`Record::request`), and its
    /// unpacked tree at `unpacked`.
    pub(crate) fn of(record: &Record, unpacked: Option<&Path>) -> Contents {
        let mut by_path = HashMap::new();
        if let Some(hashes) = record.chunk_hashes() {
            let manifest: &Manifest = &record.manifest;
            let mut per_file: Vec<Vec<[u8; 32]>> = vec![Vec::new(); manifest.files.len()];
            for (chunk, hash) in manifest.chunks().iter().zip(hashes) {
                per_file[chunk.file].push(hash);
            }
            for (file, hashes) in per_file.into_iter().enumerate() {
                by_path.insert(
                    manifest.target(&record.request, file),
                    Content::Chunks {
                        size: manifest.files[file].size,
                        chunk_size: manifest.chunk_size,
                        hashes,
                    },
                );
            }
        }
        if let Some(dir) = unpacked {
            for (relative, entry) in &record.unpacked_contents {
                by_path.insert(
                    dir.join(path_of_key(relative)),
                    Content::Unpacked(entry.clone()),
                );
            }
        }
        Contents {
            by_path,
            unpacked: unpacked.map(Path::to_path_buf),
        }
    }

    /// Checks that `copy`, a copy of the store's file at `path` read from its start, holds what
    /// the fetch verified (blocking: it reads the whole copy).
    pub fn check_file(&self, path: &Path, copy: &mut impl Read) -> Result<(), ContentError> {
        let changed = || ContentError::Changed {
            path: path.to_path_buf(),
        };
        let io = |error| ContentError::Io {
            path: path.to_path_buf(),
            error,
        };
        match self.content(path)? {
            Content::Chunks {
                size,
                chunk_size,
                hashes,
            } => {
                let mut read = 0u64;
                for expected in hashes {
                    let mut hasher = blake3::Hasher::new();
                    let len = std::io::copy(&mut copy.by_ref().take(*chunk_size), &mut hasher)
                        .map_err(io)?;
                    read += len;
                    if hasher.finalize().as_bytes() != expected {
                        return Err(changed());
                    }
                }
                let mut rest = [0u8; 1];
                if read != *size || copy.read(&mut rest).map_err(io)? != 0 {
                    return Err(changed());
                }
                Ok(())
            }
            Content::Unpacked(Entry::File(expected)) => {
                let mut hasher = blake3::Hasher::new();
                std::io::copy(copy, &mut hasher).map_err(io)?;
                if hasher.finalize().to_hex().as_str() != expected {
                    return Err(changed());
                }
                Ok(())
            }
            Content::Unpacked(Entry::Link(_)) => Err(changed()),
        }
    }

    /// Checks that the store's link at `path`, read as pointing at `target`, is a link of the
    /// unpacked tree to that target.
    pub fn check_link(&self, path: &Path, target: &Path) -> Result<(), ContentError> {
        match self.content(path)? {
            Content::Unpacked(Entry::Link(expected)) if *expected == key_of(target) => Ok(()),
            _ => Err(ContentError::Changed {
                path: path.to_path_buf(),
            }),
        }
    }

    /// Whether the fetch verified a file or link at the store's `path`.
    pub fn check_known(&self, path: &Path) -> Result<(), ContentError> {
        self.content(path).map(|_| ())
    }

    /// Whether `path` lies in the unpacked tree, where a file the archive never had may be
    /// left out of a copy (the tree is unpacked afresh when its stamps change); anywhere else
    /// a file the fetch did not verify fails the copy.
    pub fn in_unpacked_tree(&self, path: &Path) -> bool {
        self.unpacked
            .as_ref()
            .is_some_and(|dir| path.starts_with(dir))
    }

    fn content(&self, path: &Path) -> Result<&Content, ContentError> {
        self.by_path.get(path).ok_or_else(|| ContentError::Unknown {
            path: path.to_path_buf(),
        })
    }

    /// Store paths whose content is known, for a copy to be checked complete.
    pub fn paths(&self) -> impl Iterator<Item = &Path> {
        self.by_path.keys().map(PathBuf::as_path)
    }
}
