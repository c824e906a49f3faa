use std::{io::Read, path::Path};

use crate::{Dataset, Error, SliceEntry, dataset::describe_file, slice_files};

/// Something wrong with one slice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub index: u64,
    pub file: String,
    pub problem: String,
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "slice {} ({}): {}", self.index, self.file, self.problem)
    }
}

/// Checks every slice of `dataset` against its manifest: present, of the listed size, with the
/// listed BLAKE3 hash. Files are streamed, never held whole in memory. Returns every problem
/// found (empty when the dataset is intact).
pub fn verify(dataset: &Dataset, mut progress: impl FnMut(&SliceEntry)) -> Vec<Problem> {
    let mut problems = Vec::new();
    for entry in &dataset.manifest().slices {
        if let Err(problem) = check(dataset, entry) {
            problems.push(Problem {
                index: entry.index,
                file: entry.file.clone(),
                problem,
            });
        }
        progress(entry);
    }
    problems
}

fn check(dataset: &Dataset, entry: &SliceEntry) -> Result<(), String> {
    let path = dataset.root().join(&entry.file);
    let mut file = std::fs::File::open(&path).map_err(|e| format!("cannot open: {e}"))?;
    let mut hasher = blake3::Hasher::new();
    let mut buf = vec![0u8; 1024 * 1024];
    let mut size = 0u64;
    loop {
        let n = file
            .read(&mut buf)
            .map_err(|e| format!("cannot read: {e}"))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        size += n as u64;
    }
    if size < entry.size {
        return Err(format!(
            "truncated: {size} bytes on disk, the manifest says {}",
            entry.size
        ));
    }
    if size > entry.size {
        return Err(format!(
            "{size} bytes on disk, the manifest says {} (replaced or appended to)",
            entry.size
        ));
    }
    let hash = hasher.finalize().to_hex().to_string();
    if hash != entry.blake3 {
        return Err(format!(
            "BLAKE3 {hash} does not match the manifest's {} (corrupted)",
            entry.blake3
        ));
    }
    Ok(())
}

/// Slice files in the dataset's directory that its manifest does not list (added after it was
/// written), in slice order.
pub fn unlisted_files(dataset: &Dataset) -> Result<Vec<String>, Error> {
    let files = match slice_files(dataset.root()) {
        Ok(files) => files,
        Err(Error::Empty { .. }) => Vec::new(),
        Err(e) => return Err(e),
    };
    Ok(files
        .into_iter()
        .filter(|file| !dataset.manifest().slices.iter().any(|s| s.file == *file))
        .collect())
}

/// What can be checked of a dataset without a stored manifest: every slice file is read and
/// decoded (Snappy, SafeTensors header, tensor sizes). Returns the number of slices and every
/// one that failed; `progress` is told each file's size once it is checked.
pub fn check_decodes(
    root: &Path,
    mut progress: impl FnMut(u64),
) -> Result<(usize, Vec<Problem>), Error> {
    let files = slice_files(root)?;
    let mut problems = Vec::new();
    for (index, file) in files.iter().enumerate() {
        match describe_file(root, file, index as u64) {
            Ok(entry) => progress(entry.size),
            Err(error) => {
                let problem = match error {
                    Error::Slice { error, .. } => format!("undecodable: {error}"),
                    other => other.to_string(),
                };
                problems.push(Problem {
                    index: index as u64,
                    file: file.clone(),
                    problem,
                });
            }
        }
    }
    Ok((files.len(), problems))
}
