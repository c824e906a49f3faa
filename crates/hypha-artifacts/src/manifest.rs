//! An artifact as resolved at its origin: its files, their versions, and its chunks.
//!
//! Every node resolves a request against the origin itself and gets the same [`Manifest`], so
//! nothing but the [`ArtifactId`] has to travel: the id is the BLAKE3 of the origin URL, every
//! file's path, size, ETag, version and modification time, and the chunk size. Two nodes share
//! chunks only if they resolved the same version of everything.

use std::{fmt, path::PathBuf};

use serde::{Deserialize, Serialize};

use hypha_messages::artifact::{Kind, Request};

/// Chunks an artifact is cut into when no chunk size is set: enough that every node of a
/// swarm has several to pull from the origin and that the last ones, which have to travel to
/// everyone after the origin is done, are a small share of the whole.
const AUTO_CHUNKS: u64 = 256;
/// Bounds of the automatic chunk size: below 1 MiB per-chunk costs show; above 64 MiB a lost
/// node costs much.
const AUTO_MIN: u64 = 1024 * 1024;
const AUTO_MAX: u64 = 64 * 1024 * 1024;

/// The chunk size for an artifact of `size` bytes: `size / 256` rounded up to a power of two,
/// within 1–64 MiB. Every node computes the same from the same origin metadata.
pub fn auto_chunk_size(size: u64) -> u64 {
    size.div_ceil(AUTO_CHUNKS)
        .next_power_of_two()
        .clamp(AUTO_MIN, AUTO_MAX)
}

/// One file of an artifact, as the origin described it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// Path under the request's destination (`""` for a single object: the destination itself).
    pub relative: String,
    /// The object's location in its store.
    pub location: String,
    pub size: u64,
    pub e_tag: Option<String>,
    pub version: Option<String>,
    pub last_modified_ms: i64,
}

impl FileEntry {
    /// How errors name the version a file was resolved at.
    pub fn describe_version(&self) -> String {
        match (&self.e_tag, &self.version) {
            (_, Some(version)) => format!("version {version}"),
            (Some(e_tag), None) => format!("ETag {e_tag}"),
            (None, None) => format!(
                "{} bytes, modified at {} ms",
                self.size, self.last_modified_ms
            ),
        }
    }
}

/// A content-derived name for one version of an artifact.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ArtifactId(#[serde(with = "hex::serde")] pub [u8; 32]);

impl ArtifactId {
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    pub fn from_hex(text: &str) -> Option<ArtifactId> {
        let mut bytes = [0u8; 32];
        hex::decode_to_slice(text, &mut bytes).ok()?;
        Some(ArtifactId(bytes))
    }
}

impl fmt::Debug for ArtifactId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")
    }
}

impl fmt::Display for ArtifactId {
    /// The first 12 hex digits, as logs show it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex()[..12])
    }
}

/// A byte range of one file, the unit of transfer and verification.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    pub file: usize,
    pub offset: u64,
    pub len: u64,
}

/// An artifact's files and chunks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub id: ArtifactId,
    pub origin_url: String,
    pub chunk_size: u64,
    pub files: Vec<FileEntry>,
    #[serde(skip)]
    chunks: Vec<Chunk>,
}

impl Manifest {
    /// Cuts `files` into chunks of `chunk_size` bytes (each file on its own; an empty file has
    /// none) and derives the id.
    pub fn new(origin_url: &str, chunk_size: u64, files: Vec<FileEntry>) -> Manifest {
        let chunk_size = chunk_size.max(1);
        let mut hasher = blake3::Hasher::new();
        hasher.update(b"hypha-artifact/1\0");
        hasher.update(origin_url.as_bytes());
        hasher.update(&chunk_size.to_le_bytes());
        for file in &files {
            // JSON of each entry: unambiguous, and stable because the struct is ours.
            hasher.update(&serde_json::to_vec(file).unwrap_or_default());
            hasher.update(b"\0");
        }
        let mut manifest = Manifest {
            id: ArtifactId(*hasher.finalize().as_bytes()),
            origin_url: origin_url.to_string(),
            chunk_size,
            files,
            chunks: Vec::new(),
        };
        manifest.cut();
        manifest
    }

    fn cut(&mut self) {
        self.chunks = self
            .files
            .iter()
            .enumerate()
            .flat_map(|(file, entry)| {
                let chunk_size = self.chunk_size;
                (0..entry.size.div_ceil(chunk_size)).map(move |i| Chunk {
                    file,
                    offset: i * chunk_size,
                    len: chunk_size.min(entry.size - i * chunk_size),
                })
            })
            .collect();
    }

    /// Restores the chunk list after deserialisation.
    pub(crate) fn recut(mut self) -> Manifest {
        self.cut();
        self
    }

    pub fn chunks(&self) -> &[Chunk] {
        &self.chunks
    }

    pub fn chunk(&self, index: u32) -> Option<Chunk> {
        self.chunks.get(index as usize).copied()
    }

    pub fn chunk_count(&self) -> u32 {
        self.chunks.len() as u32
    }

    /// The artifact's size in bytes.
    pub fn size(&self) -> u64 {
        self.files.iter().map(|f| f.size).sum()
    }

    /// Where `file` ends up for `request`.
    pub fn target(&self, request: &Request, file: usize) -> PathBuf {
        match request.kind {
            Kind::Object => request.destination.clone(),
            Kind::Prefix => request.destination.join(&self.files[file].relative),
        }
    }

    /// Whether both describe the same files at the same versions (the chunk size aside).
    pub fn same_files(&self, other: &Manifest) -> bool {
        self.origin_url == other.origin_url && self.files == other.files
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(relative: &str, size: u64, e_tag: &str) -> FileEntry {
        FileEntry {
            relative: relative.into(),
            location: format!("p/{relative}"),
            size,
            e_tag: Some(e_tag.into()),
            version: None,
            last_modified_ms: 1,
        }
    }

    #[test]
    fn files_are_cut_into_chunks_of_their_own() {
        let m = Manifest::new(
            "s3://b",
            10,
            vec![file("a", 25, "x"), file("b", 0, "y"), file("c", 10, "z")],
        );
        let spans: Vec<_> = m
            .chunks()
            .iter()
            .map(|c| (c.file, c.offset, c.len))
            .collect();
        assert_eq!(spans, vec![(0, 0, 10), (0, 10, 10), (0, 20, 5), (2, 0, 10)]);
        assert_eq!(m.size(), 35);
    }

    #[test]
    fn the_id_changes_with_any_version_and_with_the_chunk_size() {
        let a = Manifest::new("s3://b", 10, vec![file("a", 25, "x")]);
        assert_eq!(
            a.id,
            Manifest::new("s3://b", 10, vec![file("a", 25, "x")]).id
        );
        assert_ne!(
            a.id,
            Manifest::new("s3://b", 10, vec![file("a", 25, "x2")]).id
        );
        assert_ne!(
            a.id,
            Manifest::new("s3://b", 11, vec![file("a", 25, "x")]).id
        );
        assert_ne!(
            a.id,
            Manifest::new("s3://c", 10, vec![file("a", 25, "x")]).id
        );
        assert!(a.same_files(&Manifest::new("s3://b", 11, vec![file("a", 25, "x")])));
    }

    #[test]
    fn the_automatic_chunk_size_gives_a_few_hundred_chunks_within_bounds() {
        assert_eq!(auto_chunk_size(0), 1024 * 1024);
        assert_eq!(auto_chunk_size(256 * 1024 * 1024), 1024 * 1024);
        assert_eq!(auto_chunk_size(4 << 30), 16 * 1024 * 1024);
        assert_eq!(auto_chunk_size(1 << 40), 64 * 1024 * 1024);
    }

    #[test]
    fn ids_round_trip_through_hex() {
        let a = Manifest::new("s3://b", 10, vec![file("a", 25, "x")]);
        assert_eq!(ArtifactId::from_hex(&a.id.to_hex()), Some(a.id));
        assert_eq!(ArtifactId::from_hex("zz"), None);
    }
}
