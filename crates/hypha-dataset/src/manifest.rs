use std::collections::{HashMap, hash_map::Entry};

use serde::{Deserialize, Serialize};

use crate::slice::Encoding;

/// The format tag of manifests this crate writes and reads.
pub const FORMAT: &str = "hypha-dataset/1";

/// What a dataset holds: every slice in order, with what it takes to check and use it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// Always [`FORMAT`].
    pub format: String,
    /// The dataset's name (its directory's name).
    pub name: String,
    /// Slices in numeric file order; `slices[i].index == i`.
    pub slices: Vec<SliceEntry>,
}

/// One slice of a dataset.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SliceEntry {
    pub index: u64,
    /// The file name, relative to the dataset directory.
    pub file: String,
    pub encoding: Encoding,
    /// Bytes on disk (what travels over the network).
    pub size: u64,
    /// Bytes of the SafeTensors data once decompressed.
    pub uncompressed_size: u64,
    /// BLAKE3 of the file's bytes, hex.
    pub blake3: String,
    /// Samples in the slice: the leading dimension shared by every tensor, if they share one.
    pub samples: Option<u64>,
    pub tensors: Vec<TensorSpec>,
}

/// A tensor's name, SafeTensors dtype (`F32`, `I64`, …) and shape.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorSpec {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<u64>,
}

impl Manifest {
    /// Total samples over slices that declare a count.
    pub fn samples(&self) -> u64 {
        self.slices.iter().filter_map(|s| s.samples).sum()
    }

    /// Total bytes on disk.
    pub fn size(&self) -> u64 {
        self.slices.iter().map(|s| s.size).sum()
    }

    /// Total bytes decompressed.
    pub fn uncompressed_size(&self) -> u64 {
        self.slices.iter().map(|s| s.uncompressed_size).sum()
    }

    /// The distinct schemas of the slices, in slice order: each with the first slice that has
    /// it and how many slices do. Two slices share a schema when their tensors have the same
    /// names, dtypes and shapes apart from the sample count, and either both or neither have
    /// one sample count across their tensors. Linear in the slices, whatever a manifest from
    /// a peer holds.
    pub fn schemas(&self) -> Vec<(&SliceEntry, usize)> {
        type Key<'a> = (Vec<(&'a str, &'a str, &'a [u64])>, bool);
        let mut seen: HashMap<Key<'_>, usize> = HashMap::new();
        let mut schemas: Vec<(&SliceEntry, usize)> = Vec::new();
        for slice in &self.slices {
            let tensors = slice
                .tensors
                .iter()
                .map(|t| {
                    (
                        t.name.as_str(),
                        t.dtype.as_str(),
                        t.shape.get(1..).unwrap_or(&[]),
                    )
                })
                .collect();
            let mut leading = slice.tensors.iter().map(|t| t.shape.first());
            let first = leading.next();
            let shared = leading.all(|d| Some(d) == first);
            match seen.entry((tensors, shared)) {
                Entry::Occupied(known) => schemas[*known.get()].1 += 1,
                Entry::Vacant(new) => {
                    new.insert(schemas.len());
                    schemas.push((slice, 1));
                }
            }
        }
        schemas
    }
}
