//! Whole models published to the trainers' workers (see `hypha_artifacts::published`)
//! instead of sent to each.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};

use hypha_artifacts::{Admission, Published};

use crate::artifacts::ArtifactStore;

/// Whole models at least this large are published to trainers rather than sent to each.
/// Below it a transfer of its own is about as quick: the fetchers of a small file each read
/// it all from the server before they have found each other (measured on loopback: a 1 MiB
/// model left the server once per trainer). Trainers told together wait for each other up
/// to `artifacts.join_timeout` (10 s) before they read from the server, so a trainer that
/// died holds the others up that long, where sending to each would cost the server's link
/// a model per trainer.
pub const PUBLISH_FROM_BYTES: u64 = 16 * 1024 * 1024;

/// The whole models a server publishes (see `hypha_artifacts::published`), once each, to the
/// workers of its task; withdrawn when the job ends.
#[derive(Debug)]
pub struct ModelPublisher {
    artifacts: Arc<ArtifactStore>,
    admission: Admission,
    published: Mutex<HashMap<PathBuf, Published>>,
}

impl ModelPublisher {
    pub fn new(artifacts: Arc<ArtifactStore>, admission: Admission) -> Self {
        ModelPublisher {
            artifacts,
            admission,
            published: Mutex::default(),
        }
    }

    /// The file at `path`, published (once); `None` where it cannot be, and it is sent.
    pub(super) fn publish(&self, path: &Path) -> Option<Published> {
        let mut published = self.published.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(done) = published.get(path) {
            return Some(done.clone());
        }
        // Publishing reads the file once, for its SHA-256.
        let done = tokio::task::block_in_place(|| {
            self.artifacts
                .distributor()
                .publish(path, self.admission.clone())
        });
        match done {
            Ok(done) => {
                published.insert(path.to_path_buf(), done.clone());
                Some(done)
            }
            Err(error) => {
                tracing::warn!(path = %path.display(), %error, "cannot publish the model; sending it to each trainer");
                None
            }
        }
    }

    /// Stops publishing the file at `path` (it is about to be removed).
    pub(super) fn withdraw(&self, path: &Path) {
        let mut published = self.published.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(done) = published.remove(path) {
            self.artifacts.distributor().unpublish(&done);
        }
    }
}

impl Drop for ModelPublisher {
    fn drop(&mut self) {
        let published = self.published.get_mut().unwrap_or_else(|e| e.into_inner());
        for (_, done) in published.drain() {
            self.artifacts.distributor().unpublish(&done);
        }
    }
}
