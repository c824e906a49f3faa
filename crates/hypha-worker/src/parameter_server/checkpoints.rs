//! When the server checkpoints, and the checkpoint's way to the scheduler.

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use hypha_network::{Network, PeerId};

use super::{CHECKPOINT_PATIENCE, CHECKPOINT_TRANSFER};
use crate::bridge::transfer::{self, Header};

/// How many times a checkpoint's size the server moves in updates and models before it
/// checkpoints again, by default: checkpoints then take at most a tenth of its link.
pub const CHECKPOINT_TRAFFIC_RATIO: u64 = 10;

/// When the server checkpoints (and pushes the checkpoint to the scheduler): every `every`
/// rounds, or, by default, once the bytes of DiLoCo traffic on its link since the last
/// checkpoint (updates in, models and changes out) reach [`CHECKPOINT_TRAFFIC_RATIO`] times
/// the last checkpoint's size. Every round's checkpoint (the reference system's way) cost a
/// 10 M-parameter model 124 MB a round, twice the DiLoCo traffic of the round. A server that
/// fails loses the rounds after its last checkpoint: the scheduler gives their slices back.
#[derive(Debug)]
pub(super) struct Cadence {
    every: Option<u64>,
    /// Rounds applied since the last checkpoint.
    rounds: u64,
    /// Bytes moved since the last checkpoint.
    traffic: u64,
    /// The last checkpoint's size; 0 before there is one.
    size: u64,
}

impl Cadence {
    pub(super) fn new(every: Option<u64>, size: u64) -> Self {
        Self {
            every,
            rounds: 0,
            traffic: 0,
            size,
        }
    }

    pub(super) fn moved(&mut self, bytes: u64) {
        self.traffic = self.traffic.saturating_add(bytes);
    }

    pub(super) fn round_applied(&mut self, moved: u64) {
        self.rounds += 1;
        self.moved(moved);
    }

    /// Whether a round was applied since the last checkpoint.
    pub(super) fn behind(&self) -> bool {
        self.rounds > 0
    }

    pub(super) fn due(&self) -> bool {
        // Until a checkpoint exists (the adopted model's could not be written), every round:
        // a server lost with none leaves the run nothing to go on from.
        self.behind()
            && (self.size == 0
                || match self.every {
                    Some(every) => self.rounds >= every,
                    None => self.traffic >= CHECKPOINT_TRAFFIC_RATIO.saturating_mul(self.size),
                })
    }

    pub(super) fn written(&mut self, size: u64) {
        self.rounds = 0;
        self.traffic = 0;
        self.size = size;
    }
}

/// The checkpoint's way to the scheduler: a task that pushes the newest checkpoint each time
/// one is written, retrying until the scheduler takes it.
#[derive(Debug)]
pub(super) struct Uploads {
    written: tokio::sync::watch::Sender<u64>,
    uploaded: tokio::sync::watch::Receiver<u64>,
    task: tokio::task::JoinHandle<()>,
}

/// How long an upload that failed waits before the next try, at most.
pub(super) const UPLOAD_BACKOFF: Duration = Duration::from_secs(5);

impl Uploads {
    pub(super) fn start(network: Network, scheduler: PeerId, task: String, path: PathBuf) -> Self {
        let (written, mut wanted) = tokio::sync::watch::channel(0u64);
        let (done, uploaded) = tokio::sync::watch::channel(0u64);
        let task = tokio::spawn(async move {
            let mut backoff = Duration::from_millis(200);
            let mut failing = false;
            while wanted.changed().await.is_ok() {
                let generation = *wanted.borrow_and_update();
                loop {
                    match upload(&network, scheduler, &task, &path).await {
                        Ok(()) => {
                            let _ = done.send(generation);
                            if failing {
                                tracing::info!("the scheduler takes checkpoints again");
                            }
                            failing = false;
                            backoff = Duration::from_millis(200);
                            break;
                        }
                        Err(error) => {
                            if !failing {
                                tracing::warn!(%error, "the scheduler did not take the checkpoint; trying again");
                            }
                            failing = true;
                            tokio::time::sleep(backoff).await;
                            backoff = (backoff * 2).min(UPLOAD_BACKOFF);
                            // A newer checkpoint replaces the one that did not go through.
                            if wanted.has_changed().unwrap_or(false) {
                                break;
                            }
                        }
                    }
                }
            }
        });
        Self {
            written,
            uploaded,
            task,
        }
    }

    /// A new checkpoint is on disk.
    pub(super) fn checkpointed(&self) {
        self.written.send_modify(|generation| *generation += 1);
    }

    /// Waits up to [`CHECKPOINT_PATIENCE`] for the newest checkpoint to reach the scheduler.
    pub(super) async fn finish(mut self) {
        let newest = *self.written.borrow();
        let reached = tokio::time::timeout(
            CHECKPOINT_PATIENCE,
            self.uploaded.wait_for(|uploaded| *uploaded >= newest),
        )
        .await;
        if !matches!(reached, Ok(Ok(_))) {
            tracing::warn!(
                "the last checkpoint did not reach the scheduler; its last rounds' slices stay unused"
            );
        }
    }
}

impl Drop for Uploads {
    /// A job that ends, however it ends, sends nothing more: a cancelled server's checkpoint
    /// must not reach a scheduler that has moved on.
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Pushes the checkpoint at `path` (as it is now) to the scheduler.
pub(super) async fn upload(
    network: &Network,
    scheduler: PeerId,
    task: &str,
    path: &Path,
) -> Result<(), String> {
    // Opened once: a checkpoint written meanwhile replaces the name, not these bytes.
    let file = std::fs::File::open(path).map_err(|e| e.to_string())?;
    let size = file.metadata().map_err(|e| e.to_string())?.len();
    let header = Header {
        task: task.to_string(),
        name: CHECKPOINT_TRANSFER.to_string(),
        size,
        published: None,
        sha256: None,
    };
    transfer::send(network, scheduler, &header, file, transfer::SEND_PATIENCE)
        .await
        .map(drop)
        .map_err(|e| e.to_string())
}
