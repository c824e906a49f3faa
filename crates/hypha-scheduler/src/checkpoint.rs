//! A DiLoCo run's checkpoints, kept by the scheduler: the second place the global model, the
//! outer momentum and the round live, beside the ledger (`job.checkpoint.safetensors` for
//! `job.ledger`).
//!
//! The parameter server pushes its checkpoint over the resource protocol ([`hypha_transfer`])
//! after it adopts the first model and after every round it applies. The scheduler takes a
//! checkpoint only for its own run's task, only from the worker that runs the run's parameter
//! server now, and only when it is newer than the one it holds; it writes it through a temp
//! file, fsync and rename, so a scheduler killed mid-transfer keeps the previous one whole.
//! Then it tells the run, which marks a round's slices used only once the round is in a
//! checkpoint here ([`training`](crate::training)), and restores a replacement parameter
//! server from it.

use std::{
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};

use futures::{AsyncWriteExt, StreamExt};
use hypha_messages::diloco::meta;
use hypha_network::{Network, PeerId, frame::write_frame};
use hypha_transfer::{
    Answer, Header, PROTOCOL, Received, Refusal, RefusalCode, read_header, receive_bytes,
};
use tokio::sync::mpsc;

/// The name a checkpoint travels under.
pub const TRANSFER_NAME: &str = "checkpoint.safetensors";

/// The checkpoint file of a run whose ledger is at `ledger`.
pub fn path_beside(ledger: &Path) -> PathBuf {
    ledger.with_extension("checkpoint.safetensors")
}

/// Where the run's checkpoint is and whom it is taken from. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Checkpoints {
    path: PathBuf,
    state: Arc<Mutex<State>>,
}

#[derive(Debug, Default)]
struct State {
    /// The worker of the run's parameter server now.
    from: Option<PeerId>,
    /// The round of the checkpoint held.
    round: Option<u64>,
    /// The newest round a checkpoint may have: the round the run trains now. A later one
    /// holds a round whose slices the run has not recorded.
    limit: u64,
}

impl Checkpoints {
    /// The checkpoints at `path`; one already there (from an earlier run) is not used.
    pub fn new(path: PathBuf) -> Self {
        Self {
            path,
            state: Arc::default(),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The checkpoints at `path`, going on from the one there (a resumed run's).
    pub fn resumed(path: PathBuf) -> Self {
        let round = checkpoint_round(&path).ok();
        Self {
            path,
            state: Arc::new(Mutex::new(State {
                from: None,
                round,
                limit: round.unwrap_or(0),
            })),
        }
    }

    /// The round of the checkpoint held: the round a restored server trains next.
    pub fn round(&self) -> Option<u64> {
        self.lock().round
    }

    /// The checkpoint held, opened, with its round: what a replacement is restored from.
    pub fn open(&self) -> Option<(u64, std::fs::File)> {
        let state = self.lock();
        let round = state.round?;
        // Opened under the lock: a newer one renamed over it later leaves this one whole.
        let file = std::fs::File::open(&self.path).ok()?;
        Some((round, file))
    }

    /// Checkpoints up to round `round` are taken from now on: the run trains it.
    pub fn accept_up_to(&self, round: u64) {
        let mut state = self.lock();
        state.limit = state.limit.max(round);
    }

    /// Checkpoints are taken from `peer` only from now on (`None`: from nobody).
    pub fn accept_from(&self, peer: Option<PeerId>) {
        self.lock().from = peer;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes checkpoints for `task`, one transfer at a time, until the network stops
    /// accepting streams; each stored one's round and size go to `stored`.
    pub async fn serve(self, network: Network, task: String, stored: mpsc::Sender<(u64, u64)>) {
        let mut incoming = match network.accept_streams(PROTOCOL) {
            Ok(incoming) => incoming,
            Err(error) => {
                tracing::warn!(%error, "the parameter server cannot send checkpoints here");
                return;
            }
        };
        // One at a time: checkpoints come one after the other from one peer; anything else
        // waits (or is told busy, and the sender tries again).
        while let Some((peer, mut stream)) = incoming.next().await {
            let answer = match self.receive(peer, &mut stream, &task, &stored).await {
                Ok(()) => Answer::Received { jobs: 1 },
                Err(refusal) => {
                    tracing::debug!(%peer, %refusal, "checkpoint refused");
                    Answer::Refused(refusal)
                }
            };
            let _ = write_frame(&mut stream, &answer).await;
            let _ = stream.close().await;
        }
    }

    async fn receive(
        &self,
        peer: PeerId,
        stream: &mut hypha_network::Stream,
        task: &str,
        stored: &mpsc::Sender<(u64, u64)>,
    ) -> Result<(), Refusal> {
        let refuse = |message: String| Err(Refusal::new(RefusalCode::BadRequest, message));
        // Before anything is read: another peer cannot hold the one transfer at a time up.
        if self.lock().from != Some(peer) {
            return refuse("checkpoints are taken from the run's parameter server only".into());
        }
        let header: Header = read_header(stream).await?;
        if header.task != task || header.name != TRANSFER_NAME {
            return refuse(format!(
                "this scheduler takes only {TRANSFER_NAME} of task {task}"
            ));
        }
        write_frame(stream, &Answer::Ready)
            .await
            .map_err(|e| Refusal::new(RefusalCode::BadRequest, e.to_string()))?;
        let io = |e: &dyn std::fmt::Display| Refusal::new(RefusalCode::Io, e.to_string());
        let dir = match self.path.parent() {
            Some(dir) if !dir.as_os_str().is_empty() => dir.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let temp = tempfile::Builder::new()
            .prefix(".checkpoint-")
            .suffix(".partial")
            .tempfile_in(&dir)
            .map_err(|e| io(&e))?;
        let file = temp.reopen().map_err(|e| io(&e))?;
        receive_bytes(stream, file, header.size, &mut Received::default(), peer).await?;
        let round = checkpoint_round(temp.path()).map_err(|e| {
            Refusal::new(
                RefusalCode::BadRequest,
                format!("not a parameter server's checkpoint: {e}"),
            )
        })?;
        // Checked again, and kept, while it is stored: the server may have been replaced
        // during the transfer.
        {
            let mut state = self.lock();
            if state.from != Some(peer) {
                return refuse("the parameter server was replaced during the transfer".into());
            }
            if round > state.limit {
                return Err(Refusal::new(
                    RefusalCode::Busy,
                    format!(
                        "round {round} is not recorded here yet (the run trains round {})",
                        state.limit
                    ),
                ));
            }
            if state.round.is_some_and(|held| held >= round) {
                // An older one that took longer: the newer is already here.
                return Ok(());
            }
            temp.persist(&self.path).map_err(|e| io(&e.error))?;
            if let Ok(dir) = std::fs::File::open(&dir) {
                dir.sync_all().map_err(|e| io(&e))?;
            }
            state.round = Some(round);
        }
        tracing::debug!(round, path = %self.path.display(), "checkpoint stored");
        // Told before the server hears it arrived: a server that then exits finds its last
        // checkpoint already counted.
        let _ = stored.send((round, header.size)).await;
        Ok(())
    }
}

/// The round of the checkpoint at `path`, read from its header.
pub fn checkpoint_round(path: &Path) -> Result<u64, String> {
    let mut file = std::fs::File::open(path).map_err(|e| e.to_string())?;
    let metadata = hypha_diloco::read_metadata(&mut file).map_err(|e| e.to_string())?;
    if metadata.get(meta::KIND).map(String::as_str) != Some(meta::KIND_CHECKPOINT) {
        return Err(format!(
            "its {} is not {:?}",
            meta::KIND,
            meta::KIND_CHECKPOINT
        ));
    }
    hypha_diloco::server::round_of(&metadata).map_err(|e| e.to_string())
}
