//! A directory that paths are resolved beneath, by the kernel.
//!
//! Every lookup is `openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)` relative to the
//! directory's file descriptor: a resolution that would leave it, through `..` or through a
//! symbolic link (one placed by anyone, at any time, even after a textual check), fails with
//! `EXDEV` ([`leads_out`]). Symbolic links that stay beneath are followed.

use std::{
    ffi::OsStr,
    fs::File,
    io,
    os::fd::OwnedFd,
    path::{Component, Path, PathBuf},
};

use rustix::fs::{Mode, OFlags, ResolveFlags};

const BENEATH: ResolveFlags = ResolveFlags::BENEATH.union(ResolveFlags::NO_MAGICLINKS);

/// A directory, opened once, that every later lookup stays beneath.
#[derive(Debug)]
pub struct Beneath {
    root: PathBuf,
    fd: OwnedFd,
}

/// Whether `error` is a resolution that would have left the directory.
pub fn leads_out(error: &io::Error) -> bool {
    error.raw_os_error() == Some(rustix::io::Errno::XDEV.raw_os_error())
}

impl Beneath {
    pub fn open(root: &Path) -> io::Result<Self> {
        let fd = rustix::fs::open(
            root,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        Ok(Beneath {
            root: root.to_path_buf(),
            fd,
        })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Opens `relative` with `flags`, beneath.
    pub fn open_at(&self, relative: &Path, flags: OFlags) -> io::Result<OwnedFd> {
        let relative = if relative.as_os_str().is_empty() {
            Path::new(".")
        } else {
            relative
        };
        Ok(rustix::fs::openat2(
            &self.fd,
            relative,
            flags | OFlags::CLOEXEC,
            Mode::empty(),
            BENEATH,
        )?)
    }

    /// Opens the existing regular file `relative` for reading. Anything else (a FIFO, a
    /// device, a socket, a directory) is refused with [`io::ErrorKind::InvalidInput`], and
    /// without blocking: the open is non-blocking, so a FIFO with no writer cannot hold the
    /// calling thread, and the flag is cleared once the file is known to be regular.
    pub fn open_read(&self, relative: &Path) -> io::Result<File> {
        let fd = self.open_at(relative, OFlags::RDONLY | OFlags::NONBLOCK)?;
        let kind = rustix::fs::FileType::from_raw_mode(rustix::fs::fstat(&fd)?.st_mode);
        if kind != rustix::fs::FileType::RegularFile {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "not a regular file",
            ));
        }
        rustix::fs::fcntl_setfl(&fd, OFlags::empty())?;
        Ok(File::from(fd))
    }

    /// Opens the directory `relative` (the root itself when empty), creating what is missing
    /// with `mode`, beneath at every step.
    pub fn create_dir_all(&self, relative: &Path, mode: u32) -> io::Result<OwnedFd> {
        let directory = OFlags::RDONLY | OFlags::DIRECTORY;
        let mut current = PathBuf::new();
        let mut fd = self.open_at(&current, directory)?;
        for part in relative.components() {
            let Component::Normal(part) = part else {
                continue;
            };
            current.push(part);
            match rustix::fs::mkdirat(&fd, part, Mode::from_raw_mode(mode)) {
                Ok(()) | Err(rustix::io::Errno::EXIST) => {}
                Err(error) => return Err(error.into()),
            }
            fd = self.open_at(&current, directory)?;
        }
        Ok(fd)
    }

    /// The directory that holds `relative` (created with `mode` as needed) and the name
    /// `relative` has in it.
    pub fn parent_of<'p>(&self, relative: &'p Path, mode: u32) -> io::Result<(OwnedFd, &'p OsStr)> {
        let name = relative
            .file_name()
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "the path names no file"))?;
        let parent = relative.parent().unwrap_or(Path::new(""));
        Ok((self.create_dir_all(parent, mode)?, name))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn links_out_are_refused_and_links_within_followed() {
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("secret"), b"secret").unwrap();
        let root = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(outside.path(), root.path().join("out")).unwrap();
        std::os::unix::fs::symlink("..", root.path().join("up")).unwrap();
        std::fs::write(root.path().join("inside"), b"ok").unwrap();
        std::os::unix::fs::symlink("inside", root.path().join("alias")).unwrap();
        let beneath = Beneath::open(root.path()).unwrap();
        for attack in ["out/secret", "up/x", "../x"] {
            let error = beneath.open_read(Path::new(attack)).unwrap_err();
            assert!(leads_out(&error), "{attack}: {error}");
        }
        assert!(beneath.create_dir_all(Path::new("out/new"), 0o700).is_err());
        assert!(!outside.path().join("new").exists());
        beneath.open_read(Path::new("alias")).unwrap();
        let (_, name) = beneath.parent_of(Path::new("a/b/c"), 0o700).unwrap();
        assert_eq!(name, "c");
        assert!(root.path().join("a/b").is_dir());
    }
}
