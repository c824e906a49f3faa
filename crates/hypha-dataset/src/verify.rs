use std::io::Read;

use crate::{Dataset, SliceEntry};

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
    if size != entry.size {
        return Err(format!(
            "{size} bytes on disk, the manifest says {} (truncated or replaced)",
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
