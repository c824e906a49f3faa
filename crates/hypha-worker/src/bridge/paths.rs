//! Keeping every path a job names inside the job's directory.
//!
//! A path from an executor is checked twice. First as text: it must be relative, made of
//! normal components (no `..`, no `.`-only tricks, no NUL, no backslash), and no component may
//! percent-decode to something else that is dangerous (`%2e%2e`, `%2f`), so that an executor
//! that decodes before it writes cannot be led astray. Then at the moment of use: files and
//! directories are opened with `openat2(RESOLVE_BENEATH)` relative to the job directory's file
//! descriptor, so the kernel refuses any resolution that leaves it, through `..` or through a
//! symlink, even one swapped in after the textual check. Symlinks that stay inside the job's
//! directory are followed.

use std::{
    ffi::OsStr,
    fs::File,
    os::{fd::OwnedFd, unix::ffi::OsStrExt},
    path::{Component, Path, PathBuf},
};

use hypha_files::beneath::{Beneath, leads_out};
use rustix::fs::{Mode, OFlags};

/// A path an executor may not use.
#[derive(Debug, thiserror::Error)]
pub enum PathError {
    #[error("{path:?} is refused: {why}")]
    Refused { path: String, why: &'static str },
    #[error("{path:?}: {error}")]
    Io { path: String, error: std::io::Error },
}

impl PathError {
    fn refused(path: &str, why: &'static str) -> Self {
        PathError::Refused {
            path: path.to_string(),
            why,
        }
    }
}

/// Checks `path` as text; returns it as a relative path of normal components.
pub fn check(path: &str) -> Result<PathBuf, PathError> {
    if path.is_empty() {
        return Err(PathError::refused(path, "it is empty"));
    }
    if path.contains('\0') {
        return Err(PathError::refused(path, "it contains a NUL byte"));
    }
    if path.contains('\\') {
        return Err(PathError::refused(path, "it contains a backslash"));
    }
    let candidate = Path::new(path);
    if candidate.is_absolute() {
        return Err(PathError::refused(
            path,
            "it is absolute; paths are relative to the job's directory",
        ));
    }
    let mut clean = PathBuf::new();
    for component in candidate.components() {
        match component {
            Component::Normal(part) => {
                let decoded = percent_decode(part.as_bytes());
                if decoded.contains(&b'/') || decoded == b".." || decoded == b"." {
                    return Err(PathError::refused(
                        path,
                        "it hides a separator or a dot directory in percent-encoding",
                    ));
                }
                clean.push(part);
            }
            Component::CurDir => {}
            Component::ParentDir => {
                return Err(PathError::refused(path, "it climbs out with .."));
            }
            Component::RootDir | Component::Prefix(_) => {
                return Err(PathError::refused(path, "it is absolute"));
            }
        }
    }
    if clean.as_os_str().is_empty() {
        return Err(PathError::refused(
            path,
            "it names the job directory itself",
        ));
    }
    Ok(clean)
}

fn percent_decode(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).ok();
            if let Some(value) = hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                out.push(value);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    out
}

/// A job's directory, opened once so that every later lookup is relative to it.
#[derive(Debug)]
pub struct JobDir(Beneath);

impl JobDir {
    pub fn open(root: &Path) -> std::io::Result<Self> {
        Beneath::open(root).map(JobDir)
    }

    pub fn root(&self) -> &Path {
        self.0.root()
    }

    fn io(path: &Path, error: std::io::Error) -> PathError {
        if leads_out(&error) {
            return PathError::Refused {
                path: path.display().to_string(),
                why: "it leads out of the job's directory (through a symlink or ..)",
            };
        }
        PathError::Io {
            path: path.display().to_string(),
            error,
        }
    }

    /// Opens an existing regular file for reading; anything else (a FIFO an executor made,
    /// a device, a directory) is refused without blocking.
    pub fn open_read(&self, relative: &Path) -> Result<File, PathError> {
        self.0.open_read(relative).map_err(|e| {
            if e.kind() == std::io::ErrorKind::InvalidInput {
                PathError::refused(&relative.display().to_string(), "it is not a regular file")
            } else {
                Self::io(relative, e)
            }
        })
    }

    /// Opens (creating as needed, mode 0700) the directory `relative`, beneath the job's
    /// directory at every step.
    pub fn create_dir_all(&self, relative: &Path) -> Result<OwnedFd, PathError> {
        self.0
            .create_dir_all(relative, 0o700)
            .map_err(|e| Self::io(relative, e))
    }

    /// Creates a fresh temporary file in the directory `parent` (opened by
    /// [`create_dir_all`](Self::create_dir_all)), for [`publish`](Self::publish) to rename.
    pub fn create_temp(parent: &OwnedFd, name: &OsStr) -> std::io::Result<(File, Vec<u8>)> {
        let temp = temp_name(name);
        Ok((Self::create_new(parent, &temp)?, temp))
    }

    /// Creates the file `name` in `parent` for reading and writing; fails if anything is there.
    pub fn create_new(parent: &OwnedFd, name: &[u8]) -> std::io::Result<File> {
        let fd = rustix::fs::openat(
            parent,
            OsStr::from_bytes(name),
            OFlags::RDWR | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )?;
        Ok(File::from(fd))
    }

    /// Opens the file `name` in `parent` for reading and writing if it is a regular file of
    /// one link (not a symlink, a FIFO or a hard link to a file elsewhere); `None` otherwise.
    pub fn open_own_file(parent: &OwnedFd, name: &[u8]) -> Option<File> {
        let fd = rustix::fs::openat(
            parent,
            OsStr::from_bytes(name),
            OFlags::RDWR | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .ok()?;
        let stat = rustix::fs::fstat(&fd).ok()?;
        let regular = rustix::fs::FileType::from_raw_mode(stat.st_mode).is_file();
        (regular && stat.st_nlink == 1).then(|| File::from(fd))
    }

    /// Renames `name` in `parent` to a new temporary name for `final_name`, and returns it.
    pub fn rename_to_temp(
        parent: &OwnedFd,
        name: &[u8],
        final_name: &OsStr,
    ) -> std::io::Result<Vec<u8>> {
        let temp = temp_name(final_name);
        rustix::fs::renameat(
            parent,
            OsStr::from_bytes(name),
            parent,
            OsStr::from_bytes(&temp),
        )?;
        Ok(temp)
    }

    /// The names in `parent` that start with `prefix`.
    pub fn names_with_prefix(parent: &OwnedFd, prefix: &[u8]) -> std::io::Result<Vec<Vec<u8>>> {
        let mut names = Vec::new();
        for entry in rustix::fs::Dir::read_from(parent)? {
            let name = entry?.file_name().to_bytes().to_vec();
            if name.starts_with(prefix) {
                names.push(name);
            }
        }
        Ok(names)
    }

    /// Renames a finished temporary file onto `name` in the same directory, atomically; a
    /// symlink already at `name` is replaced, never followed.
    pub fn publish(parent: &OwnedFd, temp: &[u8], name: &OsStr) -> std::io::Result<()> {
        rustix::fs::renameat(parent, OsStr::from_bytes(temp), parent, name)?;
        rustix::fs::fsync(parent)?;
        Ok(())
    }

    /// Removes a temporary file that will not be published.
    pub fn discard(parent: &OwnedFd, temp: &[u8]) {
        let _ = rustix::fs::unlinkat(
            parent,
            OsStr::from_bytes(temp),
            rustix::fs::AtFlags::empty(),
        );
    }
}

/// A new name for a temporary file that will become `name`.
fn temp_name(name: &OsStr) -> Vec<u8> {
    let mut temp = b".hypha-partial-".to_vec();
    temp.extend_from_slice(&rand::random::<u64>().to_le_bytes().map(|b| b'a' + b % 26));
    temp.push(b'-');
    temp.extend_from_slice(name.as_bytes());
    temp
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn textual_attacks_are_refused() {
        for attack in [
            "/etc/passwd",
            "../secret",
            "a/../../b",
            "a/..",
            "..",
            "",
            ".",
            "%2e%2e/x",
            "a%2fb/../c",
            "x/%2E%2E",
            "a\\..\\b",
            "nul\0byte",
        ] {
            assert!(check(attack).is_err(), "{attack:?} must be refused");
        }
        assert_eq!(check("./a/b.txt").unwrap(), PathBuf::from("a/b.txt"));
        assert_eq!(
            check("models/x.safetensors").unwrap(),
            PathBuf::from("models/x.safetensors")
        );
        assert_eq!(check("100%.txt").unwrap(), PathBuf::from("100%.txt"));
    }

    #[test]
    fn symlinks_out_are_refused_at_open_time() {
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("secret"), b"secret").unwrap();
        let job = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(outside.path(), job.path().join("out")).unwrap();
        std::os::unix::fs::symlink(outside.path().join("secret"), job.path().join("s")).unwrap();
        std::fs::write(job.path().join("inside"), b"ok").unwrap();
        std::os::unix::fs::symlink("inside", job.path().join("alias")).unwrap();
        let dir = JobDir::open(job.path()).unwrap();
        assert!(matches!(
            dir.open_read(Path::new("out/secret")),
            Err(PathError::Refused { .. })
        ));
        assert!(matches!(
            dir.open_read(Path::new("s")),
            Err(PathError::Refused { .. })
        ));
        assert!(dir.create_dir_all(Path::new("out/new")).is_err());
        assert!(!outside.path().join("new").exists());
        dir.open_read(Path::new("alias")).unwrap();
    }

    /// `/resources/send` of a FIFO an executor made (or a device, or a directory) is refused
    /// at once: it never blocks a runtime thread waiting for a writer. (Checked by opening
    /// without `NONBLOCK`: the open hangs and the deadline fails the test.)
    #[test]
    fn a_fifo_or_anything_but_a_regular_file_is_refused_without_blocking() {
        let job = tempfile::tempdir().unwrap();
        rustix::fs::mknodat(
            rustix::fs::CWD,
            job.path().join("fifo"),
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        std::fs::create_dir(job.path().join("directory")).unwrap();
        let dir = JobDir::open(job.path()).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let refused = ["fifo", "directory"].map(|name| {
                matches!(
                    dir.open_read(Path::new(name)),
                    Err(PathError::Refused {
                        why: "it is not a regular file",
                        ..
                    })
                )
            });
            let _ = tx.send(refused);
        });
        let refused = rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("opening a FIFO blocked");
        assert_eq!(refused, [true, true]);
    }
}
