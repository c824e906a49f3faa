//! Unpacking tar, tar.gz and zip archives with the `tar`, `flate2` and `zip` crates, never by
//! shelling out, and never writing outside the destination.
//!
//! An archive is extracted into a fresh directory beside the destination, synced, and renamed
//! into place, so an interrupted unpack leaves no half-filled destination. Entries are refused,
//! and the whole unpack fails naming them, when their path is absolute or contains `..`, when
//! they are links whose target leaves the destination, when they would be written through a
//! link the archive itself created, or when they are devices or FIFOs.

use std::{
    fs::{self, File},
    io::{self, Read},
    path::{Component, Path, PathBuf},
};

use hypha_messages::artifact::{Unpack, UnpackMethod};

/// An archive could not be unpacked.
#[derive(Debug, thiserror::Error)]
pub enum UnpackError {
    #[error("{path}: {error}")]
    Io { path: PathBuf, error: io::Error },
    #[error(
        "{archive}: cannot tell its format from its name or first bytes; set unpack.method to tar, tar_gz or zip"
    )]
    UnknownFormat { archive: PathBuf },
    #[error("{archive}: entry {entry:?} {reason}; nothing was unpacked")]
    Refused {
        archive: PathBuf,
        entry: String,
        reason: &'static str,
    },
    #[error("{archive}: not a valid {format} archive: {reason}")]
    Corrupt {
        archive: PathBuf,
        format: &'static str,
        reason: String,
    },
}

/// The format an archive is read as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Tar,
    TarGz,
    Zip,
}

impl Format {
    fn name(self) -> &'static str {
        match self {
            Format::Tar => "tar",
            Format::TarGz => "tar.gz",
            Format::Zip => "zip",
        }
    }

    /// Decides by the method, else the file name, else the first bytes.
    pub fn detect(archive: &Path, method: UnpackMethod) -> Result<Format, UnpackError> {
        match method {
            UnpackMethod::Tar => return Ok(Format::Tar),
            UnpackMethod::TarGz => return Ok(Format::TarGz),
            UnpackMethod::Zip => return Ok(Format::Zip),
            UnpackMethod::Auto => {}
        }
        let name = archive
            .file_name()
            .map(|n| n.to_string_lossy().to_ascii_lowercase())
            .unwrap_or_default();
        if name.ends_with(".tar.gz") || name.ends_with(".tgz") {
            return Ok(Format::TarGz);
        }
        if name.ends_with(".tar") {
            return Ok(Format::Tar);
        }
        if name.ends_with(".zip") {
            return Ok(Format::Zip);
        }
        let mut head = [0u8; 262];
        let read = File::open(archive)
            .and_then(|mut f| read_up_to(&mut f, &mut head))
            .map_err(|error| io_error(archive, error))?;
        let head = &head[..read];
        if head.starts_with(&[0x1f, 0x8b]) {
            Ok(Format::TarGz)
        } else if head.starts_with(b"PK\x03\x04") || head.starts_with(b"PK\x05\x06") {
            Ok(Format::Zip)
        } else if head.len() >= 262 && &head[257..262] == b"ustar" {
            Ok(Format::Tar)
        } else {
            Err(UnpackError::UnknownFormat {
                archive: archive.to_path_buf(),
            })
        }
    }
}

fn read_up_to(reader: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match reader.read(&mut buf[filled..])? {
            0 => break,
            n => filled += n,
        }
    }
    Ok(filled)
}

fn io_error(path: &Path, error: io::Error) -> UnpackError {
    UnpackError::Io {
        path: path.to_path_buf(),
        error,
    }
}

/// Unpacks `archive` into `options.destination`, replacing what was there only once the new
/// tree is complete and synced.
pub fn unpack(archive: &Path, options: &Unpack) -> Result<(), UnpackError> {
    let format = Format::detect(archive, options.method)?;
    let destination = &options.destination;
    let parent = match destination.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    fs::create_dir_all(&parent).map_err(|e| io_error(&parent, e))?;
    let staging = tempfile::Builder::new()
        .prefix(".hypha-unpack-")
        .tempdir_in(&parent)
        .map_err(|e| io_error(&parent, e))?;
    let mut extractor = Extractor {
        archive,
        root: staging.path(),
        links: Vec::new(),
    };
    match format {
        Format::Tar => extractor.tar(open(archive)?)?,
        Format::TarGz => extractor.tar(flate2::read::GzDecoder::new(open(archive)?))?,
        Format::Zip => extractor.zip()?,
    }
    let root = fs::File::open(staging.path()).map_err(|e| io_error(staging.path(), e))?;
    rustix::fs::syncfs(&root).map_err(|e| io_error(staging.path(), e.into()))?;

    // Swap the old tree out, the new one in, then delete the old one.
    let old = destination
        .exists()
        .then(|| parent.join(format!(".hypha-unpack-old-{}", rand::random::<u64>())));
    if let Some(old) = &old {
        fs::rename(destination, old).map_err(|e| io_error(destination, e))?;
    }
    let staged = staging.keep();
    fs::rename(&staged, destination).map_err(|e| io_error(destination, e))?;
    File::open(&parent)
        .and_then(|d| d.sync_all())
        .map_err(|e| io_error(&parent, e))?;
    if let Some(old) = old {
        fs::remove_dir_all(&old).map_err(|e| io_error(&old, e))?;
    }
    Ok(())
}

fn open(path: &Path) -> Result<File, UnpackError> {
    File::open(path).map_err(|e| io_error(path, e))
}

struct Extractor<'a> {
    archive: &'a Path,
    root: &'a Path,
    /// Links this archive created: nothing may be written through them.
    links: Vec<PathBuf>,
}

impl Extractor<'_> {
    fn refuse(&self, entry: &Path, reason: &'static str) -> UnpackError {
        UnpackError::Refused {
            archive: self.archive.to_path_buf(),
            entry: entry.display().to_string(),
            reason,
        }
    }

    fn corrupt(&self, format: Format, reason: impl ToString) -> UnpackError {
        UnpackError::Corrupt {
            archive: self.archive.to_path_buf(),
            format: format.name(),
            reason: reason.to_string(),
        }
    }

    /// The entry's path inside the root, or a refusal.
    fn place(&self, entry: &Path) -> Result<PathBuf, UnpackError> {
        let mut relative = PathBuf::new();
        for component in entry.components() {
            match component {
                Component::Normal(part) => relative.push(part),
                Component::CurDir => {}
                Component::ParentDir => return Err(self.refuse(entry, "contains `..`")),
                Component::RootDir | Component::Prefix(_) => {
                    return Err(self.refuse(entry, "is an absolute path"));
                }
            }
        }
        if relative.as_os_str().is_empty() {
            return Ok(self.root.to_path_buf());
        }
        if self
            .links
            .iter()
            .any(|link| relative.starts_with(link) && relative != *link)
        {
            return Err(self.refuse(entry, "would be written through a link in the archive"));
        }
        Ok(self.root.join(relative))
    }

    /// Checks that a symbolic link at `entry` pointing to `target` stays inside the root.
    fn check_symlink(&self, entry: &Path, target: &Path) -> Result<(), UnpackError> {
        if target.is_absolute() {
            return Err(self.refuse(entry, "is a link to an absolute path"));
        }
        let mut depth: usize = entry
            .components()
            .filter(|c| matches!(c, Component::Normal(_)))
            .count();
        depth = depth.saturating_sub(1); // the link's own directory
        for component in target.components() {
            match component {
                Component::Normal(_) => depth += 1,
                Component::CurDir => {}
                Component::ParentDir => {
                    depth = depth.checked_sub(1).ok_or_else(|| {
                        self.refuse(entry, "is a link that leaves the destination")
                    })?;
                }
                Component::RootDir | Component::Prefix(_) => {
                    return Err(self.refuse(entry, "is a link to an absolute path"));
                }
            }
        }
        Ok(())
    }

    fn record_link(&mut self, entry: &Path) {
        let relative: PathBuf = entry
            .components()
            .filter(|c| matches!(c, Component::Normal(_)))
            .collect();
        self.links.push(relative);
    }

    fn parent_dirs(&self, path: &Path) -> Result<(), UnpackError> {
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent).map_err(|e| io_error(parent, e))?;
        }
        Ok(())
    }

    fn tar(&mut self, reader: impl Read) -> Result<(), UnpackError> {
        let mut archive = tar::Archive::new(reader);
        archive.set_preserve_ownerships(false);
        let entries = archive
            .entries()
            .map_err(|e| self.corrupt(Format::Tar, e))?;
        for entry in entries {
            let mut entry = entry.map_err(|e| self.corrupt(Format::Tar, e))?;
            let name = entry
                .path()
                .map_err(|e| self.corrupt(Format::Tar, e))?
                .into_owned();
            let kind = entry.header().entry_type();
            if kind.is_pax_global_extensions() || kind.is_pax_local_extensions() {
                continue;
            }
            let path = self.place(&name)?;
            if kind.is_dir() {
                fs::create_dir_all(&path).map_err(|e| io_error(&path, e))?;
            } else if kind.is_file() || kind == tar::EntryType::Continuous {
                self.parent_dirs(&path)?;
                entry.unpack(&path).map_err(|e| io_error(&path, e))?;
            } else if kind.is_symlink() {
                let target = entry
                    .link_name()
                    .map_err(|e| self.corrupt(Format::Tar, e))?
                    .ok_or_else(|| self.refuse(&name, "is a link without a target"))?
                    .into_owned();
                self.check_symlink(&name, &target)?;
                self.parent_dirs(&path)?;
                std::os::unix::fs::symlink(&target, &path).map_err(|e| io_error(&path, e))?;
                self.record_link(&name);
            } else if kind.is_hard_link() {
                let target = entry
                    .link_name()
                    .map_err(|e| self.corrupt(Format::Tar, e))?
                    .ok_or_else(|| self.refuse(&name, "is a link without a target"))?
                    .into_owned();
                let source = self.place(&target).map_err(|_| {
                    self.refuse(&name, "is a hard link that leaves the destination")
                })?;
                self.parent_dirs(&path)?;
                fs::hard_link(&source, &path).map_err(|e| io_error(&path, e))?;
            } else {
                return Err(self.refuse(&name, "is a device, FIFO or other special file"));
            }
        }
        Ok(())
    }

    fn zip(&mut self) -> Result<(), UnpackError> {
        let mut archive =
            zip::ZipArchive::new(open(self.archive)?).map_err(|e| self.corrupt(Format::Zip, e))?;
        for index in 0..archive.len() {
            let mut file = archive
                .by_index(index)
                .map_err(|e| self.corrupt(Format::Zip, e))?;
            let name = PathBuf::from(
                file.name()
                    .map_err(|e| self.corrupt(Format::Zip, e))?
                    .into_owned(),
            );
            // `enclosed_name` is the zip crate's own check; ours below also names the reason.
            if file.enclosed_name().is_none() {
                self.place(&name)?;
                return Err(self.refuse(&name, "leaves the destination"));
            }
            let path = self.place(&name)?;
            if file.is_dir() {
                fs::create_dir_all(&path).map_err(|e| io_error(&path, e))?;
            } else if file.is_symlink() {
                let mut target = String::new();
                file.read_to_string(&mut target)
                    .map_err(|e| self.corrupt(Format::Zip, e))?;
                let target = PathBuf::from(target);
                self.check_symlink(&name, &target)?;
                self.parent_dirs(&path)?;
                std::os::unix::fs::symlink(&target, &path).map_err(|e| io_error(&path, e))?;
                self.record_link(&name);
            } else {
                self.parent_dirs(&path)?;
                let mut out = File::create(&path).map_err(|e| io_error(&path, e))?;
                io::copy(&mut file, &mut out).map_err(|e| io_error(&path, e))?;
                if let Some(mode) = file.unix_mode() {
                    use std::os::unix::fs::PermissionsExt;
                    fs::set_permissions(&path, fs::Permissions::from_mode(mode & 0o777))
                        .map_err(|e| io_error(&path, e))?;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn tar_with(build: impl FnOnce(&mut tar::Builder<Vec<u8>>)) -> Vec<u8> {
        let mut builder = tar::Builder::new(Vec::new());
        build(&mut builder);
        builder.into_inner().unwrap()
    }

    fn raw_entry(
        builder: &mut tar::Builder<Vec<u8>>,
        name: &str,
        kind: tar::EntryType,
        link: Option<&str>,
        data: &[u8],
    ) {
        let mut header = tar::Header::new_gnu();
        // Written byte by byte: the tar crate's setters refuse `..` and absolute paths, which
        // is exactly what a hostile archive contains.
        let bytes = name.as_bytes();
        header.as_old_mut().name[..bytes.len()].copy_from_slice(bytes);
        if let Some(link) = link {
            header.as_old_mut().linkname[..link.len()].copy_from_slice(link.as_bytes());
        }
        header.set_entry_type(kind);
        header.set_size(data.len() as u64);
        header.set_mode(0o644);
        header.set_cksum();
        builder.append(&header, data).unwrap();
    }

    fn unpack_bytes(dir: &Path, name: &str, bytes: &[u8]) -> Result<PathBuf, UnpackError> {
        let archive = dir.join(name);
        std::fs::write(&archive, bytes).unwrap();
        let destination = dir.join("out");
        unpack(
            &archive,
            &Unpack {
                destination: destination.clone(),
                method: UnpackMethod::Auto,
            },
        )
        .map(|()| destination)
    }

    #[test]
    fn path_attacks_in_tar_are_refused_and_nothing_is_written() {
        let cases: Vec<(&str, Vec<u8>)> = vec![
            (
                "dotdot",
                tar_with(|b| raw_entry(b, "../escape.txt", tar::EntryType::Regular, None, b"x")),
            ),
            (
                "nested dotdot",
                tar_with(|b| {
                    raw_entry(b, "a/../../escape.txt", tar::EntryType::Regular, None, b"x")
                }),
            ),
            (
                "absolute",
                tar_with(|b| raw_entry(b, "/tmp/escape.txt", tar::EntryType::Regular, None, b"x")),
            ),
            (
                "symlink out",
                tar_with(|b| raw_entry(b, "link", tar::EntryType::Symlink, Some("../../etc"), b"")),
            ),
            (
                "absolute symlink",
                tar_with(|b| raw_entry(b, "link", tar::EntryType::Symlink, Some("/etc"), b"")),
            ),
            (
                "write through a link",
                tar_with(|b| {
                    raw_entry(b, "d/link", tar::EntryType::Symlink, Some(".."), b"");
                    raw_entry(b, "d/link/x", tar::EntryType::Regular, None, b"x");
                }),
            ),
            (
                "hard link out",
                tar_with(|b| {
                    raw_entry(b, "h", tar::EntryType::Link, Some("../../etc/passwd"), b"")
                }),
            ),
            (
                "fifo",
                tar_with(|b| raw_entry(b, "p", tar::EntryType::Fifo, None, b"")),
            ),
        ];
        for (case, bytes) in cases {
            let dir = tempfile::tempdir().unwrap();
            let err = unpack_bytes(dir.path(), "a.tar", &bytes).expect_err(case);
            assert!(matches!(err, UnpackError::Refused { .. }), "{case}: {err}");
            assert!(
                !dir.path().join("out").exists(),
                "{case}: destination created"
            );
            assert!(!dir.path().join("escape.txt").exists(), "{case}");
            let leftovers: Vec<_> = std::fs::read_dir(dir.path())
                .unwrap()
                .map(|e| e.unwrap().file_name())
                .filter(|n| n != "a.tar")
                .collect();
            assert!(leftovers.is_empty(), "{case}: {leftovers:?}");
        }
    }

    #[test]
    fn links_that_stay_inside_are_kept() {
        let dir = tempfile::tempdir().unwrap();
        let bytes = tar_with(|b| {
            raw_entry(b, "lib/real.txt", tar::EntryType::Regular, None, b"real");
            raw_entry(
                b,
                "lib/alias.txt",
                tar::EntryType::Symlink,
                Some("real.txt"),
                b"",
            );
            raw_entry(
                b,
                "bin/up",
                tar::EntryType::Symlink,
                Some("../lib/real.txt"),
                b"",
            );
            raw_entry(
                b,
                "hard.txt",
                tar::EntryType::Link,
                Some("lib/real.txt"),
                b"",
            );
        });
        let out = unpack_bytes(dir.path(), "a.tar", &bytes).unwrap();
        for path in ["lib/alias.txt", "bin/up", "hard.txt"] {
            assert_eq!(std::fs::read(out.join(path)).unwrap(), b"real", "{path}");
        }
    }

    #[test]
    fn zip_slip_is_refused() {
        for name in ["../evil.txt", "/abs/evil.txt", "a/../../evil.txt"] {
            let dir = tempfile::tempdir().unwrap();
            let mut writer = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
            writer
                .start_file(name, zip::write::SimpleFileOptions::default())
                .unwrap();
            std::io::Write::write_all(&mut writer, b"evil").unwrap();
            let bytes = writer.finish().unwrap().into_inner();
            let err = unpack_bytes(dir.path(), "a.zip", &bytes).expect_err(name);
            assert!(matches!(err, UnpackError::Refused { .. }), "{name}: {err}");
            assert!(!dir.path().join("out").exists());
            assert!(!dir.path().join("evil.txt").exists());
        }
    }

    #[test]
    fn the_format_is_found_by_name_then_by_content() {
        let dir = tempfile::tempdir().unwrap();
        let tar_bytes = tar_with(|b| raw_entry(b, "f", tar::EntryType::Regular, None, b"x"));
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        std::io::Write::write_all(&mut gz, &tar_bytes).unwrap();
        let gz = gz.finish().unwrap();
        for (name, bytes, format) in [
            ("x.tgz", gz.clone(), Format::TarGz),
            ("noext-gz", gz, Format::TarGz),
            ("noext-tar", tar_bytes, Format::Tar),
        ] {
            let path = dir.path().join(name);
            std::fs::write(&path, bytes).unwrap();
            assert_eq!(
                Format::detect(&path, UnpackMethod::Auto).unwrap(),
                format,
                "{name}"
            );
        }
        let junk = dir.path().join("junk");
        std::fs::write(&junk, b"hello").unwrap();
        let err = Format::detect(&junk, UnpackMethod::Auto).unwrap_err();
        assert!(err.to_string().contains("set unpack.method"), "{err}");
    }

    #[test]
    fn a_new_unpack_replaces_the_old_tree_whole() {
        let dir = tempfile::tempdir().unwrap();
        let first = tar_with(|b| raw_entry(b, "old.txt", tar::EntryType::Regular, None, b"1"));
        let out = unpack_bytes(dir.path(), "a.tar", &first).unwrap();
        let second = tar_with(|b| raw_entry(b, "new.txt", tar::EntryType::Regular, None, b"2"));
        unpack_bytes(dir.path(), "a.tar", &second).unwrap();
        assert!(!out.join("old.txt").exists());
        assert_eq!(std::fs::read(out.join("new.txt")).unwrap(), b"2");
    }
}
