//! Hypha datasets on disk.
//!
//! A dataset is a directory of slice files (`imagenet-1k/slice-0000.safetensors`, …); its name
//! is the directory's name and its slices are ordered by the number in their file names
//! (`slice-10` after `slice-9`). A slice is the SafeTensors serialization of a dict of tensors,
//! either compressed with raw (block-format) Snappy exactly as the reference recipe
//! `snappy.compress(safetensors.save(tensors))` does, or stored plain; [`slice`] tells the two
//! apart by content, never by name.
//!
//! A [`Manifest`] (`manifest.json`, written by `hypha-data prepare`, derived when absent) lists
//! every slice with its file, sizes, BLAKE3 hash, sample count and tensor schema. [`Dataset`]
//! opens a directory with its manifest; a data node stores the manifest it derived for a
//! dataset that had none ([`Dataset::store_manifest`]: beside the slices, or in its own state
//! directory when the dataset is read-only), so that later damage is caught. [`verify`] checks
//! every slice against the stored manifest; [`check_decodes`] is all that can be checked
//! without one.
//!
//! This crate knows files and formats, nothing of networks or nodes.
//!
//! ```
//! use hypha_dataset::{Dataset, slice};
//!
//! let dir = tempfile::tempdir().unwrap();
//! let root = dir.path().join("toy");
//! std::fs::create_dir(&root).unwrap();
//! let tensors = slice::Tensors::new()
//!     .with("labels", slice::Dtype::I64, vec![2], [1i64, 2].iter().flat_map(|v| v.to_le_bytes()).collect())
//!     .unwrap();
//! std::fs::write(root.join("slice-0.safetensors"), slice::encode(&tensors, slice::Encoding::Snappy).unwrap()).unwrap();
//!
//! let dataset = Dataset::open(&root).unwrap();
//! assert_eq!(dataset.name(), "toy");
//! assert_eq!(dataset.manifest().slices[0].samples, Some(2));
//! ```

mod dataset;
mod manifest;
pub mod prepare;
pub mod slice;
mod verify;

#[cfg(feature = "testing")]
pub mod testing;

pub use dataset::{
    Dataset, Error, MANIFEST_FILE, ManifestSource, default_manifest_dir, external_manifest_path,
    slice_files, slice_order,
};
pub use manifest::{Manifest, SliceEntry, TensorSpec};
pub use verify::{Problem, check_decodes, unlisted_files, verify};
