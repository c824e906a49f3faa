//! Real swarms on 127.0.0.1 with real certificates, for the worker's network tests.

#![allow(clippy::unwrap_used, dead_code)] // tests fail loudly by design; not every test uses every helper

use std::sync::Arc;

use hypha_messages::job::TaskPeers;
use hypha_network::Network;
use hypha_worker::{
    artifacts::ArtifactStore,
    bridge::{
        paths::JobDir,
        transfer::{self, Inboxes, Registration},
    },
    config::ArtifactsConfig,
};

/// A scheduler's list of the task's peers.
pub fn peers(version: u64, of: &[&Network]) -> TaskPeers {
    TaskPeers {
        version,
        peers: of.iter().map(|n| n.local_peer_id().to_string()).collect(),
    }
}

/// Job `job-1` of task `task-1`, dispatched by `scheduler` with `peers`, with its inbox on
/// `receiver`, which serves transfers.
pub struct JobInbox {
    pub inboxes: Arc<Inboxes>,
    pub dir: tempfile::TempDir,
    pub registration: Registration,
    /// The receiver's artifact store (published files are fetched into it).
    pub artifacts: Arc<ArtifactStore>,
    pub artifacts_dir: tempfile::TempDir,
}

pub fn job_inbox(receiver: &Network, scheduler: &Network, peers: &TaskPeers) -> JobInbox {
    let inboxes = Arc::new(Inboxes::default());
    let artifacts_dir = tempfile::tempdir().unwrap();
    let artifacts = Arc::new(
        ArtifactStore::start(
            receiver.clone(),
            &ArtifactsConfig {
                dir: artifacts_dir.path().to_path_buf(),
                settings: hypha_artifacts::Settings::default(),
                profiles: Default::default(),
            },
        )
        .unwrap(),
    );
    tokio::spawn(transfer::serve(
        receiver.clone(),
        inboxes.clone(),
        artifacts.clone(),
    ));
    let dir = tempfile::tempdir().unwrap();
    let registration = inboxes
        .open(
            "task-1",
            "job-1",
            Arc::new(JobDir::open(dir.path()).unwrap()),
            scheduler.local_peer_id(),
            peers,
        )
        .unwrap();
    JobInbox {
        inboxes,
        dir,
        registration,
        artifacts,
        artifacts_dir,
    }
}
