//! Images: a folder with one sub-folder per class (`cats/`, `dogs/`, …), as torchvision's
//! `ImageFolder` reads it.
//!
//! Every image is decoded, converted to RGB, resized to `size`×`size` (bilinear) and scaled to
//! [0, 1]; the `images` column is F32 in channel-first layout `[3, size, size]`, the `labels`
//! column the class index (I64) in the sorted order of the class folders, whose names are also
//! written to `classes.json`. Decoding happens slice by slice on every core.

use std::path::{Path, PathBuf};

use safetensors::Dtype;

use super::{Column, PrepareError, Source};

const EXTENSIONS: [&str; 7] = ["png", "jpg", "jpeg", "bmp", "gif", "webp", "tiff"];

/// An image folder.
#[derive(Debug)]
pub struct Images {
    columns: Vec<Column>,
    files: Vec<(PathBuf, i64)>,
    classes: Vec<String>,
    size: u32,
}

impl Images {
    pub fn open(root: &Path, size: u32) -> Result<Self, PrepareError> {
        if size == 0 {
            return Err(PrepareError::input(
                root,
                "the image size must be at least 1",
            ));
        }
        let mut classes: Vec<PathBuf> = std::fs::read_dir(root)
            .map_err(|e| PrepareError::io(root, e))?
            .filter_map(Result::ok)
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .map(|e| e.path())
            .collect();
        classes.sort();
        let mut files = Vec::new();
        for (label, dir) in classes.iter().enumerate() {
            let mut images: Vec<PathBuf> = std::fs::read_dir(dir)
                .map_err(|e| PrepareError::io(dir, e))?
                .filter_map(Result::ok)
                .map(|e| e.path())
                .filter(|p| {
                    p.extension()
                        .and_then(|e| e.to_str())
                        .is_some_and(|e| EXTENSIONS.contains(&e.to_ascii_lowercase().as_str()))
                })
                .collect();
            images.sort();
            files.extend(images.into_iter().map(|p| (p, label as i64)));
        }
        if files.is_empty() {
            return Err(PrepareError::input(
                root,
                "no images found; expected one sub-folder per class holding .png/.jpg files",
            ));
        }
        let s = size as usize;
        Ok(Images {
            columns: vec![
                Column {
                    name: "images".into(),
                    dtype: Dtype::F32,
                    sample_shape: vec![3, s, s],
                },
                Column {
                    name: "labels".into(),
                    dtype: Dtype::I64,
                    sample_shape: vec![],
                },
            ],
            files,
            classes: classes
                .iter()
                .map(|c| {
                    c.file_name()
                        .map(|n| n.to_string_lossy().into_owned())
                        .unwrap_or_default()
                })
                .collect(),
            size,
        })
    }

    /// The class names, in label order.
    pub fn classes(&self) -> &[String] {
        &self.classes
    }
}

impl Source for Images {
    fn columns(&self) -> &[Column] {
        &self.columns
    }

    fn samples(&self) -> u64 {
        self.files.len() as u64
    }

    fn read(&self, column: usize, start: u64, count: u64) -> Result<Vec<u8>, PrepareError> {
        let samples = &self.files[start as usize..(start + count) as usize];
        if column == 1 {
            return Ok(samples.iter().flat_map(|(_, l)| l.to_le_bytes()).collect());
        }
        let pixels = (self.size * self.size) as usize;
        let mut out = Vec::with_capacity(samples.len() * 3 * pixels * 4);
        for (path, _) in samples {
            let image = image::open(path)
                .map_err(|e| PrepareError::input(path, format!("cannot decode the image: {e}")))?
                .to_rgb8();
            let resized = image::imageops::resize(
                &image,
                self.size,
                self.size,
                image::imageops::FilterType::Triangle,
            );
            for channel in 0..3 {
                for pixel in resized.pixels() {
                    out.extend_from_slice(&(f32::from(pixel[channel]) / 255.0).to_le_bytes());
                }
            }
        }
        Ok(out)
    }

    fn extra_files(&self) -> Vec<(String, Vec<u8>)> {
        let json = serde_json::to_vec_pretty(&self.classes).unwrap_or_default();
        vec![("classes.json".into(), json)]
    }
}
