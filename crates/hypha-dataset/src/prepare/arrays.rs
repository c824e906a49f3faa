//! Arrays: `.npy` files (one column each, named after the file) or a `.safetensors` file (one
//! column per tensor). Every column must have the same leading dimension: the sample count.
//! Samples are read from disk slice by slice, never whole files at once.

use std::{
    io::{Read, Seek, SeekFrom},
    path::{Path, PathBuf},
};

use safetensors::Dtype;

use super::{Column, PrepareError, Source};

/// Columns stored as contiguous little-endian arrays in files.
#[derive(Debug)]
pub struct Arrays {
    columns: Vec<Column>,
    /// Per column: the file and where its data starts.
    locations: Vec<(PathBuf, u64)>,
    samples: u64,
}

impl Arrays {
    /// Opens `path`: a `.npy` file, a `.safetensors` file, or a directory of `.npy` files.
    pub fn open(path: &Path) -> Result<Self, PrepareError> {
        let mut columns = Vec::new();
        let mut locations = Vec::new();
        let mut leading = Vec::new();
        let mut add = |file: &Path, name: String, dtype: Dtype, shape: Vec<usize>, offset: u64| {
            let Some((&first, rest)) = shape.split_first() else {
                return Err(PrepareError::input(
                    file,
                    format!("{name} is a scalar; columns need a sample dimension"),
                ));
            };
            leading.push((name.clone(), first as u64));
            columns.push(Column {
                name,
                dtype,
                sample_shape: rest.to_vec(),
            });
            locations.push((file.to_path_buf(), offset));
            Ok(())
        };
        if path.is_dir() {
            let mut files: Vec<PathBuf> = std::fs::read_dir(path)
                .map_err(|e| PrepareError::io(path, e))?
                .filter_map(Result::ok)
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|e| e == "npy"))
                .collect();
            files.sort();
            for file in files {
                let (dtype, shape, offset) = npy_header(&file)?;
                let name = file
                    .file_stem()
                    .map(|s| s.to_string_lossy().into_owned())
                    .unwrap_or_default();
                add(&file, name, dtype, shape, offset)?;
            }
        } else if path.extension().is_some_and(|e| e == "npy") {
            let (dtype, shape, offset) = npy_header(path)?;
            let name = path
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            add(path, name, dtype, shape, offset)?;
        } else {
            for (name, dtype, shape, offset) in safetensors_header(path)? {
                add(path, name, dtype, shape, offset)?;
            }
        }
        if columns.is_empty() {
            return Err(PrepareError::input(
                path,
                "no .npy or .safetensors arrays found",
            ));
        }
        let samples = leading[0].1;
        if let Some((name, n)) = leading.iter().find(|(_, n)| *n != samples) {
            return Err(PrepareError::input(
                path,
                format!(
                    "{name} has {n} samples but {} has {samples}; every array needs the same leading dimension",
                    leading[0].0
                ),
            ));
        }
        Ok(Arrays {
            columns,
            locations,
            samples,
        })
    }
}

impl Source for Arrays {
    fn columns(&self) -> &[Column] {
        &self.columns
    }

    fn samples(&self) -> u64 {
        self.samples
    }

    fn read(&self, column: usize, start: u64, count: u64) -> Result<Vec<u8>, PrepareError> {
        let (path, offset) = &self.locations[column];
        let per_sample = self.columns[column].sample_bytes() as u64;
        let mut file = std::fs::File::open(path).map_err(|e| PrepareError::io(path, e))?;
        file.seek(SeekFrom::Start(offset + start * per_sample))
            .map_err(|e| PrepareError::io(path, e))?;
        let mut data = vec![0u8; (count * per_sample) as usize];
        file.read_exact(&mut data).map_err(|e| {
            PrepareError::input(path, format!("shorter than its header says ({e})"))
        })?;
        Ok(data)
    }
}

/// Parses an NPY header (format versions 1–3): dtype, shape and where the data starts.
fn npy_header(path: &Path) -> Result<(Dtype, Vec<usize>, u64), PrepareError> {
    let mut file = std::fs::File::open(path).map_err(|e| PrepareError::io(path, e))?;
    let mut prefix = [0u8; 10];
    file.read_exact(&mut prefix)
        .map_err(|_| PrepareError::input(path, "too short to be a .npy file"))?;
    if &prefix[..6] != b"\x93NUMPY" {
        return Err(PrepareError::input(path, "not a .npy file (bad magic)"));
    }
    let (header_len, header_start) = match prefix[6] {
        1 => (u64::from(u16::from_le_bytes([prefix[8], prefix[9]])), 10u64),
        2 | 3 => {
            let mut rest = [0u8; 2];
            file.read_exact(&mut rest)
                .map_err(|_| PrepareError::input(path, "truncated .npy header"))?;
            (
                u64::from(u32::from_le_bytes([prefix[8], prefix[9], rest[0], rest[1]])),
                12u64,
            )
        }
        v => {
            return Err(PrepareError::input(
                path,
                format!("unsupported .npy version {v}"),
            ));
        }
    };
    if header_len > 1024 * 1024 {
        return Err(PrepareError::input(path, "implausibly large .npy header"));
    }
    let mut header = vec![0u8; header_len as usize];
    file.read_exact(&mut header)
        .map_err(|_| PrepareError::input(path, "truncated .npy header"))?;
    let header = String::from_utf8_lossy(&header);
    let field = |key: &str| -> Option<String> {
        let at = header.find(&format!("'{key}'"))? + key.len() + 2;
        let rest = header[at..].trim_start().strip_prefix(':')?.trim_start();
        Some(rest.to_string())
    };
    let descr = field("descr")
        .and_then(|r| {
            r.strip_prefix('\'')
                .and_then(|r| r.split('\'').next())
                .map(str::to_string)
        })
        .ok_or_else(|| PrepareError::input(path, "no descr in the .npy header"))?;
    if field("fortran_order").is_some_and(|r| r.starts_with("True")) {
        return Err(PrepareError::input(
            path,
            "Fortran-ordered arrays are not supported; save with numpy.ascontiguousarray",
        ));
    }
    let shape_text = field("shape")
        .and_then(|r| {
            r.strip_prefix('(')
                .and_then(|r| r.split(')').next())
                .map(str::to_string)
        })
        .ok_or_else(|| PrepareError::input(path, "no shape in the .npy header"))?;
    let shape = shape_text
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse::<usize>())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| PrepareError::input(path, format!("bad shape ({shape_text})")))?;
    let dtype = match descr.as_str() {
        "<f4" => Dtype::F32,
        "<f8" => Dtype::F64,
        "<f2" => Dtype::F16,
        "<i8" => Dtype::I64,
        "<i4" => Dtype::I32,
        "<i2" => Dtype::I16,
        "|i1" => Dtype::I8,
        "|u1" => Dtype::U8,
        "<u2" => Dtype::U16,
        "<u4" => Dtype::U32,
        "<u8" => Dtype::U64,
        "|b1" => Dtype::BOOL,
        other => {
            return Err(PrepareError::input(
                path,
                format!("dtype {other} is not supported (little-endian numbers and bool are)"),
            ));
        }
    };
    Ok((dtype, shape, header_start + header_len))
}

/// A tensor in a file: name, dtype, shape and the offset where its data starts.
type StoredTensor = (String, Dtype, Vec<usize>, u64);

/// The tensors of a SafeTensors file and where each one's data starts.
fn safetensors_header(path: &Path) -> Result<Vec<StoredTensor>, PrepareError> {
    let mut file = std::fs::File::open(path).map_err(|e| PrepareError::io(path, e))?;
    let mut length = [0u8; 8];
    file.read_exact(&mut length)
        .map_err(|_| PrepareError::input(path, "too short to be a .safetensors file"))?;
    let length = u64::from_le_bytes(length);
    if length > 100 * 1024 * 1024 {
        return Err(PrepareError::input(
            path,
            "implausibly large SafeTensors header",
        ));
    }
    let mut buffer = length.to_le_bytes().to_vec();
    buffer.resize(8 + length as usize, 0);
    file.read_exact(&mut buffer[8..])
        .map_err(|_| PrepareError::input(path, "truncated SafeTensors header"))?;
    // `read_metadata` validates offsets against the buffer, so hand it a header-only buffer
    // by checking offsets ourselves instead.
    let header: std::collections::BTreeMap<String, serde_json::Value> =
        serde_json::from_slice(&buffer[8..])
            .map_err(|e| PrepareError::input(path, format!("not a SafeTensors header: {e}")))?;
    let mut tensors = Vec::new();
    for (name, info) in header {
        if name == "__metadata__" {
            continue;
        }
        let info: TensorInfo = serde_json::from_value(info)
            .map_err(|e| PrepareError::input(path, format!("tensor {name}: {e}")))?;
        tensors.push((
            name,
            info.dtype,
            info.shape,
            8 + length + info.data_offsets.0,
        ));
    }
    Ok(tensors)
}

#[derive(serde::Deserialize)]
struct TensorInfo {
    dtype: Dtype,
    shape: Vec<usize>,
    data_offsets: (u64, u64),
}
