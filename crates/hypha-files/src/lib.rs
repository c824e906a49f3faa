//! Crash-safe file output: a write either completes or leaves the old file in place.
//!
//! [`write_atomic`] writes to a temporary file in the destination's directory, fsyncs it, renames
//! it over the destination and fsyncs the directory, so a crash or a full disk never leaves a
//! torn file behind; [`AtomicFile`] does the same for a file written in pieces. Errors name the
//! file.
//!
//! [`Beneath`] is a directory that paths are resolved beneath by the kernel, for writing what
//! a peer named (an archive's entries, an executor's paths) without leaving it.

pub mod beneath;

pub use beneath::Beneath;

use std::{
    io::Write,
    path::{Path, PathBuf},
};

/// A file operation failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The file exists and the caller did not allow replacing it.
    #[error("{path} already exists; pass --force to overwrite it")]
    Exists { path: PathBuf },
    #[error("cannot read {path}: {error}")]
    Read {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("cannot write {path}: {error}")]
    Write {
        path: PathBuf,
        error: std::io::Error,
    },
}

/// Who may read a file written by [`write_atomic`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Readable by everyone (certificates, CRLs): 0644.
    Public,
    /// Readable by the owner only (private keys): 0600.
    Private,
}

/// Writes `bytes` to `path` so that a crash leaves either the old file or the new one, never a
/// torn one: a temporary file in the same directory, fsync, rename, fsync of the directory.
///
/// Refuses to replace an existing file unless `overwrite` is set.
pub fn write_atomic(path: &Path, bytes: &[u8], mode: Mode, overwrite: bool) -> Result<(), Error> {
    if !overwrite && path.exists() {
        return Err(Error::Exists {
            path: path.to_path_buf(),
        });
    }
    let mut file = AtomicFile::create(path, mode)?;
    file.write_all(bytes).map_err(|error| file.error(error))?;
    file.commit(overwrite, true)
}

/// A file written in pieces that appears at its path only once it is whole
/// ([`commit`](Self::commit)): until then it is a temporary file beside it, removed if the
/// writer is dropped. For files too large to hold in memory (models, checkpoints).
#[derive(Debug)]
pub struct AtomicFile {
    path: PathBuf,
    dir: PathBuf,
    tmp: tempfile::NamedTempFile,
}

impl AtomicFile {
    /// Starts the file that will be `path`, readable as `mode` says.
    pub fn create(path: &Path, mode: Mode) -> Result<Self, Error> {
        let write_err = |error| Error::Write {
            path: path.to_path_buf(),
            error,
        };
        let dir = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        std::fs::create_dir_all(&dir).map_err(write_err)?;
        let tmp = tempfile::Builder::new()
            .prefix(".hypha-tmp-")
            .permissions(permissions(mode))
            .tempfile_in(&dir)
            .map_err(write_err)?;
        Ok(Self {
            path: path.to_path_buf(),
            dir,
            tmp,
        })
    }

    /// The temporary file, to write and seek in.
    pub fn file(&mut self) -> &mut std::fs::File {
        self.tmp.as_file_mut()
    }

    /// `error`, naming the file it happened to.
    pub fn error(&self, error: std::io::Error) -> Error {
        Error::Write {
            path: self.path.clone(),
            error,
        }
    }

    /// Puts the file at its path: fsync (when `durable`), rename, fsync of the directory.
    /// Refuses to replace an existing file unless `overwrite` is set. Without `durable` a
    /// crash may leave an empty or torn file under the name, never a torn file that another
    /// process opened before the crash: for files that are rewritten if lost.
    pub fn commit(self, overwrite: bool, durable: bool) -> Result<(), Error> {
        let Self { path, dir, tmp } = self;
        let write_err = |error| Error::Write {
            path: path.clone(),
            error,
        };
        if durable {
            tmp.as_file().sync_all().map_err(write_err)?;
        }
        if overwrite {
            tmp.persist(&path).map_err(|e| write_err(e.error))?;
        } else {
            // `persist_noclobber` closes the race between a check for the file and the rename.
            tmp.persist_noclobber(&path).map_err(|e| {
                if e.error.kind() == std::io::ErrorKind::AlreadyExists {
                    Error::Exists { path: path.clone() }
                } else {
                    write_err(e.error)
                }
            })?;
        }
        if durable && let Ok(d) = std::fs::File::open(&dir) {
            // Best effort: makes the rename itself durable on filesystems that need it.
            let _ = d.sync_all();
        }
        Ok(())
    }
}

impl std::io::Write for AtomicFile {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.tmp.write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.tmp.flush()
    }
}

#[cfg(unix)]
fn permissions(mode: Mode) -> std::fs::Permissions {
    use std::os::unix::fs::PermissionsExt;
    std::fs::Permissions::from_mode(match mode {
        Mode::Public => 0o644,
        Mode::Private => 0o600,
    })
}

/// Reads a whole file, naming it in the error.
pub fn read(path: &Path) -> Result<Vec<u8>, Error> {
    std::fs::read(path).map_err(|error| Error::Read {
        path: path.to_path_buf(),
        error,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_to_overwrite_without_permission() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("key.pem");
        write_atomic(&path, b"one", Mode::Private, false).unwrap();
        let err = write_atomic(&path, b"two", Mode::Private, false).unwrap_err();
        assert!(matches!(err, Error::Exists { .. }), "{err}");
        assert_eq!(std::fs::read(&path).unwrap(), b"one");
        write_atomic(&path, b"two", Mode::Private, true).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two");
    }

    #[test]
    fn private_files_are_owner_only() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("key.pem");
        write_atomic(&path, b"secret", Mode::Private, false).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        // No temporary file is left behind.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }
}
