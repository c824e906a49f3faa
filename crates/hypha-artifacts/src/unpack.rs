//! Unpacking tar, tar.gz and zip archives with the `tar`, `flate2` and `zip` crates, never by
//! shelling out, and never writing outside the destination.
//!
//! An archive is extracted into a fresh directory beside the destination, synced, and renamed
//! into place, so an interrupted unpack leaves no half-filled destination. Entries are refused,
//! and the whole unpack fails naming them, when their path is absolute or contains `..`, when
//! they are links whose target leaves the destination (as text, or once resolved through the
//! archive's other links), hard links to links, when they would be written through a link the
//! archive itself created, or when they are devices or FIFOs. Beyond these checks as text,
//! every entry is created through [`Beneath`]: the kernel refuses any write whose path leads
//! out of the staging directory, whatever links are on the way.
//!
//! An archive may unpack to at most [`Limits`] (bytes and entries), and never to more than
//! the destination's file system has free, less 1 GiB: a tar.gz or zip bomb fails before it
//! fills the disk.

use std::{
    collections::HashSet,
    fs::{self, File},
    io::{self, Read},
    os::{fd::OwnedFd, unix::fs::PermissionsExt},
    path::{Component, Path, PathBuf},
};

use hypha_files::beneath::{Beneath, leads_out};
use hypha_messages::artifact::{Unpack, UnpackMethod};
use rustix::fs::{AtFlags, Mode, OFlags};

/// How much one archive may unpack to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Bytes of file content, all entries together. Default: 64 GiB.
    pub bytes: u64,
    /// Entries: files, directories and links. Default: 1,000,000.
    pub entries: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            bytes: 64 << 30,
            entries: 1_000_000,
        }
    }
}

/// What an unpack leaves free on the destination's file system.
const RESERVE: u64 = 1 << 30;
/// The longest link target a zip archive may hold.
const MAX_LINK_TARGET: u64 = 4096;
/// The deepest an entry may lie beneath the destination.
const MAX_DEPTH: usize = 128;
/// What a tar archive may hold besides its entries' contents: each entry's header and
/// padding, and its long name or link (the `tar` crate reads those whole, into memory).
const TAR_OVERHEAD: u64 = 64 * 1024;
/// Directories an archive creates, before its own entries set their modes.
const DIR_MODE: u32 = 0o755;

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
    #[error("{archive}: it unpacks to more than {limit} {what}; nothing was unpacked ({why})")]
    TooLarge {
        archive: PathBuf,
        what: &'static str,
        limit: u64,
        why: String,
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
/// tree is complete and synced; it may unpack to no more than `limits`.
pub fn unpack(archive: &Path, options: &Unpack, limits: &Limits) -> Result<(), UnpackError> {
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
    let free = rustix::fs::statvfs(&parent)
        .map(|fs| fs.f_bavail.saturating_mul(fs.f_frsize))
        .map_err(|e| io_error(&parent, e.into()))?;
    let mut extractor = Extractor {
        archive,
        root: Beneath::open(staging.path()).map_err(|e| io_error(staging.path(), e))?,
        links: HashSet::new(),
        dirs: HashSet::new(),
        bytes_left: limits.bytes.min(free.saturating_sub(RESERVE)),
        entries_left: limits.entries,
        limits: *limits,
        free: (parent.clone(), free),
    };
    match format {
        Format::Tar => extractor.tar(open(archive)?)?,
        Format::TarGz => extractor.tar(flate2::read::GzDecoder::new(open(archive)?))?,
        Format::Zip => extractor.zip()?,
    }
    extractor.check_links()?;
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
    /// The staging directory, that every entry is created beneath.
    root: Beneath,
    /// Links this archive created: nothing may be written through them.
    links: HashSet<PathBuf>,
    /// Directories created, each counted as an entry.
    dirs: HashSet<PathBuf>,
    bytes_left: u64,
    entries_left: u64,
    limits: Limits,
    /// The destination's directory and the bytes free there when the unpack began.
    free: (PathBuf, u64),
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

    /// An I/O error at `entry`; one that would have left the staging directory is a refusal.
    fn failed(&self, entry: &Path, error: io::Error) -> UnpackError {
        if leads_out(&error) {
            return self.refuse(
                entry,
                "would be written outside the destination through a link",
            );
        }
        io_error(&self.root.root().join(entry), error)
    }

    fn too_large(&self, what: &'static str) -> UnpackError {
        let (dir, free) = &self.free;
        let (limit, why) = match what {
            "entries" => (
                self.limits.entries,
                "raise artifacts.max_unpacked_entries in the worker's config if that is expected"
                    .to_string(),
            ),
            _ if self.limits.bytes <= free.saturating_sub(RESERVE) => (
                self.limits.bytes,
                "raise artifacts.max_unpacked_bytes in the worker's config if that is expected"
                    .to_string(),
            ),
            _ => (
                free.saturating_sub(RESERVE),
                format!(
                    "{free} bytes are free on {}, and an unpack leaves 1 GiB of them free",
                    dir.display()
                ),
            ),
        };
        UnpackError::TooLarge {
            archive: self.archive.to_path_buf(),
            what,
            limit,
            why,
        }
    }

    /// Counts one more entry against the limit.
    fn count_entry(&mut self) -> Result<(), UnpackError> {
        self.entries_left = self
            .entries_left
            .checked_sub(1)
            .ok_or_else(|| self.too_large("entries"))?;
        Ok(())
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
        if relative.components().count() > MAX_DEPTH {
            return Err(self.refuse(entry, "lies more than 128 directories deep"));
        }
        if relative
            .ancestors()
            .skip(1)
            .any(|ancestor| self.links.contains(ancestor))
        {
            return Err(self.refuse(entry, "would be written through a link in the archive"));
        }
        Ok(relative)
    }

    /// Checks that a symbolic link at `entry` pointing to `target` stays inside the root, as
    /// text; [`check_links`](Self::check_links) resolves them all once every entry is in.
    fn check_symlink(&self, entry: &Path, target: &Path) -> Result<(), UnpackError> {
        if target.is_absolute() {
            return Err(self.refuse(entry, "is a link to an absolute path"));
        }
        let mut depth: usize = entry
            .components()
            .filter(|c| matches!(c, Component::Normal(_)))
            .count();
        depth = depth.saturating_sub(1); // the link's own directory
        let mut named = false;
        for component in target.components() {
            match component {
                Component::Normal(_) => {
                    depth += 1;
                    named = true;
                }
                Component::CurDir => {}
                // `x/missing/..` resolves through whatever `x/missing` becomes later (a
                // link of another archive unpacked beside this one, say).
                Component::ParentDir if named => {
                    return Err(self.refuse(entry, "is a link with `..` after a name"));
                }
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

    /// Every link the archive created, resolved by the kernel through all the others: one
    /// that leads out (`x/up -> ..` then `y -> x/up/x/up/../../..`) or loops is refused.
    /// A link to nothing inside is left as it is.
    fn check_links(&self) -> Result<(), UnpackError> {
        for link in &self.links {
            match self.root.open_at(link, OFlags::PATH) {
                Ok(_) => {}
                Err(error) if leads_out(&error) => {
                    return Err(self.refuse(
                        link,
                        "is a link that leaves the destination through other links",
                    ));
                }
                Err(error)
                    if error.raw_os_error() == Some(rustix::io::Errno::LOOP.raw_os_error()) =>
                {
                    return Err(self.refuse(link, "is a link that loops"));
                }
                Err(error) if error.kind() == io::ErrorKind::NotFound => {}
                Err(error) => return Err(self.failed(link, error)),
            }
        }
        Ok(())
    }

    fn dir(&mut self, relative: &Path) -> Result<(), UnpackError> {
        self.count_dirs(relative)?;
        self.root
            .create_dir_all(relative, DIR_MODE)
            .map(drop)
            .map_err(|e| self.failed(relative, e))
    }

    /// Counts the directories `relative` makes that no entry made before: each is an entry
    /// (an archive of deep paths makes many directories with few entries).
    fn count_dirs(&mut self, relative: &Path) -> Result<(), UnpackError> {
        let new: Vec<PathBuf> = relative
            .ancestors()
            .filter(|dir| !dir.as_os_str().is_empty() && !self.dirs.contains(*dir))
            .map(Path::to_path_buf)
            .collect();
        for dir in new {
            self.count_entry()?;
            self.dirs.insert(dir);
        }
        Ok(())
    }

    /// Creates `relative` with `create` in its directory; what an earlier entry of the same
    /// name left is replaced (a later entry wins, as tar has it), never followed.
    fn create<T>(
        &mut self,
        relative: &Path,
        create: impl Fn(&OwnedFd, &std::ffi::OsStr) -> rustix::io::Result<T>,
    ) -> Result<T, UnpackError> {
        if let Some(parent) = relative.parent() {
            self.count_dirs(parent)?;
        }
        let (dir, name) = self
            .root
            .parent_of(relative, DIR_MODE)
            .map_err(|e| self.failed(relative, e))?;
        let created = match create(&dir, name) {
            Err(rustix::io::Errno::EXIST) => {
                rustix::fs::unlinkat(&dir, name, AtFlags::empty())
                    .map_err(|e| self.failed(relative, e.into()))?;
                create(&dir, name)
            }
            other => other,
        };
        created.map_err(|e| self.failed(relative, e.into()))
    }

    /// Writes the file `relative` from `content`, counting its bytes against the limit.
    fn file(&mut self, relative: &Path, content: impl Read, mode: u32) -> Result<(), UnpackError> {
        let fd = self.create(relative, |dir, name| {
            rustix::fs::openat(
                dir,
                name,
                OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::from_raw_mode(0o600),
            )
        })?;
        let mut out = File::from(fd);
        let copied = io::copy(
            &mut content.take(self.bytes_left.saturating_add(1)),
            &mut out,
        )
        .map_err(|e| self.failed(relative, e))?;
        self.bytes_left = self
            .bytes_left
            .checked_sub(copied)
            .ok_or_else(|| self.too_large("bytes"))?;
        out.set_permissions(fs::Permissions::from_mode(mode & 0o777))
            .map_err(|e| self.failed(relative, e))
    }

    fn symlink(&mut self, entry: &Path, relative: &Path, target: &Path) -> Result<(), UnpackError> {
        self.check_symlink(entry, target)?;
        self.create(relative, |dir, name| {
            rustix::fs::symlinkat(target, dir, name)
        })?;
        self.links.insert(relative.to_path_buf());
        Ok(())
    }

    /// A hard link at `relative` to the archive's regular file `target`.
    fn hard_link(
        &mut self,
        entry: &Path,
        relative: &Path,
        target: &Path,
    ) -> Result<(), UnpackError> {
        let source = self
            .place(target)
            .map_err(|_| self.refuse(entry, "is a hard link that leaves the destination"))?;
        // Linking a link would copy it where its target means something else.
        let (source_dir, source_name) = self
            .root
            .parent_of(&source, DIR_MODE)
            .map_err(|e| self.failed(entry, e))?;
        let stat = rustix::fs::statat(&source_dir, source_name, AtFlags::SYMLINK_NOFOLLOW)
            .map_err(|e| self.failed(entry, e.into()))?;
        if rustix::fs::FileType::from_raw_mode(stat.st_mode) != rustix::fs::FileType::RegularFile {
            return Err(self.refuse(entry, "is a hard link to something other than a file"));
        }
        self.create(relative, |dir, name| {
            rustix::fs::linkat(&source_dir, source_name, dir, name, AtFlags::empty())
        })
    }

    fn tar(&mut self, reader: impl Read) -> Result<(), UnpackError> {
        let budget = std::rc::Rc::new(std::cell::Cell::new(TAR_OVERHEAD));
        let mut archive = tar::Archive::new(Budgeted {
            inner: reader,
            left: budget.clone(),
        });
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
            // What reading on may take: this entry's content, and the next one's header,
            // long name or link (set, not added: what an entry left unread is not saved up).
            budget.set(entry.size().saturating_add(TAR_OVERHEAD));
            let kind = entry.header().entry_type();
            if kind.is_pax_global_extensions() || kind.is_pax_local_extensions() {
                continue;
            }
            self.count_entry()?;
            let relative = self.place(&name)?;
            if kind.is_dir() {
                self.dir(&relative)?;
            } else if kind.is_file() || kind == tar::EntryType::Continuous {
                // Refused before a byte is written when its header says so already.
                if entry.size() > self.bytes_left {
                    return Err(self.too_large("bytes"));
                }
                let mode = entry.header().mode().unwrap_or(0o644);
                self.file(&relative, &mut entry, mode)?;
            } else if kind.is_symlink() || kind.is_hard_link() {
                let target = entry
                    .link_name()
                    .map_err(|e| self.corrupt(Format::Tar, e))?
                    .ok_or_else(|| self.refuse(&name, "is a link without a target"))?
                    .into_owned();
                if kind.is_symlink() {
                    self.symlink(&name, &relative, &target)?;
                } else {
                    self.hard_link(&name, &relative, &target)?;
                }
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
            self.count_entry()?;
            let relative = self.place(&name)?;
            if file.is_dir() {
                self.dir(&relative)?;
            } else if file.is_symlink() {
                let mut target = String::new();
                (&mut file)
                    .take(MAX_LINK_TARGET)
                    .read_to_string(&mut target)
                    .map_err(|e| self.corrupt(Format::Zip, e))?;
                self.symlink(&name, &relative, Path::new(&target))?;
            } else {
                let mode = file.unix_mode().unwrap_or(0o644);
                self.file(&relative, &mut file, mode)?;
            }
        }
        Ok(())
    }
}

/// A reader that fails once it has read `left` bytes, which its owner tops up: a tar
/// archive's metadata (a long name of gigabytes) never reaches memory whole.
struct Budgeted<R> {
    inner: R,
    left: std::rc::Rc<std::cell::Cell<u64>>,
}

impl<R: Read> Read for Budgeted<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.left.get();
        if left == 0 {
            return Err(io::Error::other(
                "a tar header, long name or link larger than 64 KiB",
            ));
        }
        let want = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
        let read = self.inner.read(&mut buf[..want])?;
        self.left.set(left - read as u64);
        Ok(read)
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
        unpack_within(dir, name, bytes, &Limits::default())
    }

    fn unpack_within(
        dir: &Path,
        name: &str,
        bytes: &[u8],
        limits: &Limits,
    ) -> Result<PathBuf, UnpackError> {
        let archive = dir.join(name);
        std::fs::write(&archive, bytes).unwrap();
        let destination = dir.join("out");
        unpack(
            &archive,
            &Unpack {
                destination: destination.clone(),
                method: UnpackMethod::Auto,
            },
            limits,
        )
        .map(|()| destination)
    }

    /// Every file named `name` anywhere under `dir`.
    fn found(dir: &Path, name: &str) -> Vec<PathBuf> {
        let mut found = Vec::new();
        let mut pending = vec![dir.to_path_buf()];
        while let Some(at) = pending.pop() {
            for entry in std::fs::read_dir(&at).into_iter().flatten().flatten() {
                let path = entry.path();
                if entry.file_name() == name {
                    found.push(path.clone());
                }
                if entry.file_type().is_ok_and(|t| t.is_dir()) {
                    pending.push(path);
                }
            }
        }
        found
    }

    fn gzip(bytes: &[u8]) -> Vec<u8> {
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        std::io::Write::write_all(&mut gz, bytes).unwrap();
        gz.finish().unwrap()
    }

    // Checked with the protections removed: without the resolution of every link at the end
    // (`check_links`) the chains unpack and these tests fail; without the limits the bombs
    // unpack whole. The hard link to a link is refused twice over: by the file-type check of
    // its source, and without that by the kernel when `h/evil` is written beneath.
    #[test]
    fn link_chains_and_hard_links_to_links_cannot_escape() {
        let cases: Vec<(&str, Vec<u8>)> = vec![
            (
                "hard link to a link, then a file through it",
                tar_with(|b| {
                    raw_entry(b, "a/b/l", tar::EntryType::Symlink, Some("../.."), b"");
                    raw_entry(b, "h", tar::EntryType::Link, Some("a/b/l"), b"");
                    raw_entry(b, "h/evil", tar::EntryType::Regular, None, b"evil");
                }),
            ),
            (
                "a chain of links",
                tar_with(|b| {
                    raw_entry(b, "x/up", tar::EntryType::Symlink, Some(".."), b"");
                    raw_entry(
                        b,
                        "y",
                        tar::EntryType::Symlink,
                        Some("x/up/x/up/../../.."),
                        b"",
                    );
                }),
            ),
            (
                "a chain whose link on the way comes last",
                tar_with(|b| {
                    raw_entry(
                        b,
                        "y",
                        tar::EntryType::Symlink,
                        Some("x/up/x/up/../../.."),
                        b"",
                    );
                    raw_entry(b, "x/up", tar::EntryType::Symlink, Some(".."), b"");
                }),
            ),
            (
                "a loop",
                tar_with(|b| {
                    raw_entry(b, "p", tar::EntryType::Symlink, Some("q"), b"");
                    raw_entry(b, "q", tar::EntryType::Symlink, Some("p"), b"");
                }),
            ),
        ];
        for (case, bytes) in cases {
            let top = tempfile::tempdir().unwrap();
            let dir = top.path().join("one/two");
            std::fs::create_dir_all(&dir).unwrap();
            let err = unpack_bytes(&dir, "a.tar", &bytes).expect_err(case);
            assert!(matches!(err, UnpackError::Refused { .. }), "{case}: {err}");
            assert!(found(top.path(), "evil").is_empty(), "{case}");
            assert!(!dir.join("out").exists(), "{case}");
        }
    }

    #[test]
    fn metadata_bombs_deep_paths_and_dotdot_after_a_name_are_refused() {
        let long_name = vec![b'a'; 1 << 20];
        let cases: Vec<(&str, Vec<u8>, Limits)> = vec![
            (
                "a long name of a megabyte",
                tar_with(|b| {
                    raw_entry(
                        b,
                        "././@LongLink",
                        tar::EntryType::GNULongName,
                        None,
                        &long_name,
                    );
                    raw_entry(b, "f", tar::EntryType::Regular, None, b"x");
                }),
                Limits::default(),
            ),
            (
                "129 directories deep",
                tar_with(|b| {
                    // Longer than a header's name field: a GNU long name carries it.
                    let deep = "d/".repeat(129);
                    raw_entry(
                        b,
                        "././@LongLink",
                        tar::EntryType::GNULongName,
                        None,
                        deep.as_bytes(),
                    );
                    raw_entry(b, "d", tar::EntryType::Directory, None, b"");
                }),
                Limits::default(),
            ),
            (
                "directories made on the way count as entries",
                tar_with(|b| {
                    raw_entry(
                        b,
                        "a/b/c/d/e/f/g/h/i/j/k",
                        tar::EntryType::Regular,
                        None,
                        b"x",
                    )
                }),
                Limits {
                    entries: 10,
                    ..Limits::default()
                },
            ),
            (
                "`..` after a name in a link",
                tar_with(|b| raw_entry(b, "l", tar::EntryType::Symlink, Some("x/../y"), b"")),
                Limits::default(),
            ),
        ];
        for (case, bytes, limits) in cases {
            let dir = tempfile::tempdir().unwrap();
            let err =
                unpack_within(dir.path(), "a.tar.gz", &gzip(&bytes), &limits).expect_err(case);
            assert!(
                matches!(
                    err,
                    UnpackError::Refused { .. }
                        | UnpackError::TooLarge { .. }
                        | UnpackError::Corrupt { .. }
                ),
                "{case}: {err}"
            );
            assert!(!dir.path().join("out").exists(), "{case}");
        }
    }

    #[test]
    fn zip_links_out_are_refused() {
        for (case, links) in [
            ("a link out", vec![("l", "../../etc")]),
            ("a chain", vec![("x/up", ".."), ("y", "x/up/x/up/../../..")]),
        ] {
            let dir = tempfile::tempdir().unwrap();
            let mut writer = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
            for (name, target) in links {
                writer
                    .add_symlink(name, target, zip::write::SimpleFileOptions::default())
                    .unwrap();
            }
            let bytes = writer.finish().unwrap().into_inner();
            let err = unpack_bytes(dir.path(), "a.zip", &bytes).expect_err(case);
            assert!(matches!(err, UnpackError::Refused { .. }), "{case}: {err}");
            assert!(!dir.path().join("out").exists(), "{case}");
        }
    }

    #[test]
    fn bombs_stop_at_the_limits_and_leave_nothing() {
        let limits = Limits {
            bytes: 1 << 20,
            entries: 10,
        };
        let zeros = vec![0u8; 4 << 20];
        let big_tar = tar_with(|b| raw_entry(b, "zeros", tar::EntryType::Regular, None, &zeros));
        let mut zip = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
        zip.start_file("zeros", zip::write::SimpleFileOptions::default())
            .unwrap();
        std::io::Write::write_all(&mut zip, &zeros).unwrap();
        let big_zip = zip.finish().unwrap().into_inner();
        let many = tar_with(|b| {
            for i in 0..11 {
                raw_entry(b, &format!("f{i}"), tar::EntryType::Regular, None, b"x");
            }
        });
        for (case, name, bytes, what) in [
            ("a tar.gz bomb", "a.tar.gz", gzip(&big_tar), "bytes"),
            ("a zip bomb", "a.zip", big_zip, "bytes"),
            ("too many entries", "a.tar", many, "entries"),
        ] {
            assert!(
                bytes.len() < 64 << 10,
                "{case}: {} bytes packed",
                bytes.len()
            );
            let dir = tempfile::tempdir().unwrap();
            let err = unpack_within(dir.path(), name, &bytes, &limits).expect_err(case);
            assert!(
                matches!(err, UnpackError::TooLarge { what: w, .. } if w == what),
                "{case}: {err}"
            );
            assert!(err.to_string().contains("max_unpacked"), "{case}: {err}");
            let left: Vec<_> = std::fs::read_dir(dir.path())
                .unwrap()
                .map(|e| e.unwrap().file_name())
                .filter(|n| *n != name)
                .collect();
            assert!(left.is_empty(), "{case}: {left:?}");
        }
        // Within the limits, the same kind of archive unpacks.
        let dir = tempfile::tempdir().unwrap();
        let small =
            tar_with(|b| raw_entry(b, "zeros", tar::EntryType::Regular, None, &zeros[..1 << 20]));
        let out = unpack_within(dir.path(), "a.tar.gz", &gzip(&small), &limits).unwrap();
        assert_eq!(std::fs::metadata(out.join("zeros")).unwrap().len(), 1 << 20);
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
