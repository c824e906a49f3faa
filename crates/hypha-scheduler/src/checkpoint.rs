//! A DiLoCo run's checkpoints, kept by the scheduler: the second place the global model, the
//! outer momentum and the round live, beside the ledger (`job.checkpoint.safetensors` for
//! `job.ledger`).
//!
//! The parameter server pushes its checkpoint over the resource protocol ([`hypha_transfer`])
//! after it adopts the first model and after every round it applies. The scheduler takes a
//! checkpoint only for its own run's task, only from the worker that runs the run's parameter
//! server now, and only when it is newer than the one it holds; it writes it through a temp
//! file, fsync and rename, so a scheduler killed mid-transfer keeps the previous one whole.
//! What arrived of a checkpoint whose transfer broke off is kept (one at a time) until the
//! server's next try of it, which sends only the rest. A checkpoint is refused before a byte
//! of it is read when it is larger than the run's checkpoints can be (four times its first,
//! and 16 MiB) or than the disk has room for with [`DISK_RESERVE`] left free.
//! Then it tells the run, which marks a round's slices used only once the round is in a
//! checkpoint here ([`training`](crate::training)), and restores a replacement parameter
//! server from it, or keeps a standby's copy current ([`send`]).

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
    /// What arrived of the last checkpoint whose transfer broke off: the server's next try of
    /// it sends only the rest.
    broken: Option<Broken>,
    /// The size of the run's first checkpoint (of a resumed run: of the one it went on
    /// from): the model's measure, by which later ones are bounded ([`largest`]).
    first_bytes: Option<u64>,
}

/// The disk a scheduler keeps free of checkpoints: a parameter server cannot fill it (the
/// ledger and the run's record are written there too).
pub const DISK_RESERVE: u64 = 1024 * 1024 * 1024;

/// The largest checkpoint taken after one of `first` bytes, the run's first: a checkpoint
/// holds the model and the outer momentum, and with `sparse` the server's residual, three
/// times the model the first held, with the norm history and the trainers' agreements
/// (kilobytes) in its metadata. Four times and 16 MiB leave room; a server that sends more
/// is not sending checkpoints. Before the first: what a transfer may be.
fn largest(first: Option<u64>) -> u64 {
    first.map_or(hypha_transfer::MAX_TRANSFER_BYTES, |first| {
        first.saturating_mul(4).saturating_add(16 << 20)
    })
}

/// Whether the rest of a checkpoint of `size` bytes, of which `held` are kept already, fits
/// on the disk of `dir` with [`DISK_RESERVE`] to spare.
fn check_room(dir: &Path, size: u64, held: u64) -> Result<(), Refusal> {
    let free = rustix::fs::statvfs(dir)
        .map(|stat| stat.f_bavail.saturating_mul(stat.f_frsize))
        .map_err(|e| Refusal::new(RefusalCode::Io, e.to_string()))?;
    if (size - held.min(size)).saturating_add(DISK_RESERVE) > free {
        return Err(Refusal::new(
            RefusalCode::TooLarge,
            format!(
                "a checkpoint of {size} bytes does not fit: the scheduler's disk has {free} bytes free and keeps {DISK_RESERVE}"
            ),
        ));
    }
    Ok(())
}

/// A checkpoint transfer that broke off, kept for the sender's next try.
#[derive(Debug)]
struct Broken {
    from: PeerId,
    size: u64,
    sha256: String,
    temp: tempfile::NamedTempFile,
    received: Received,
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
        let first_bytes = round.and(std::fs::metadata(&path).ok()).map(|m| m.len());
        Self {
            path,
            state: Arc::new(Mutex::new(State {
                from: None,
                round,
                limit: round.unwrap_or(0),
                broken: None,
                first_bytes,
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
        let io = |e: &dyn std::fmt::Display| Refusal::new(RefusalCode::Io, e.to_string());
        let dir = match self.path.parent() {
            Some(dir) if !dir.as_os_str().is_empty() => dir.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let sha256 = header.resumable_sha256().map(str::to_ascii_lowercase);
        // A transfer of the same checkpoint from the same server goes on where it broke off;
        // any other replaces what was kept.
        let broken = self.lock().broken.take().filter(|broken| {
            broken.from == peer
                && broken.size == header.size
                && Some(&broken.sha256) == sha256.as_ref()
        });
        let largest = largest(self.lock().first_bytes);
        if header.size > largest {
            return Err(Refusal::new(
                RefusalCode::TooLarge,
                format!(
                    "a checkpoint of {} bytes: this run's checkpoints are at most {largest} (four times its first, and 16 MiB)",
                    header.size
                ),
            ));
        }
        let held = broken.as_ref().map_or(0, |b| b.received.bytes());
        check_room(&dir, header.size, held)?;
        let (temp, mut received) = match broken {
            Some(broken) => (broken.temp, broken.received),
            None => {
                let temp = tempfile::Builder::new()
                    .prefix(".checkpoint-")
                    .suffix(".partial")
                    .tempfile_in(&dir)
                    .map_err(|e| io(&e))?;
                (temp, Received::default())
            }
        };
        let answer = match received.bytes() {
            0 => Answer::Ready,
            offset => Answer::Resume { offset },
        };
        write_frame(stream, &answer)
            .await
            .map_err(|e| Refusal::new(RefusalCode::BadRequest, e.to_string()))?;
        let file = temp.reopen().map_err(|e| io(&e))?;
        if let Err(refusal) = receive_bytes(stream, file, header.size, &mut received, peer).await {
            if let Some(sha256) = sha256
                && refusal.code != RefusalCode::Mismatch
            {
                self.lock().broken = Some(Broken {
                    from: peer,
                    size: header.size,
                    sha256,
                    temp,
                    received,
                });
            }
            return Err(refusal);
        }
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
            state.first_bytes.get_or_insert(header.size);
        }
        tracing::debug!(round, path = %self.path.display(), "checkpoint stored");
        // Told before the server hears it arrived: a server that then exits finds its last
        // checkpoint already counted.
        let _ = stored.send((round, header.size)).await;
        Ok(())
    }
}

/// Sends the checkpoint in `file` to the jobs of `task` on `peer`.
pub async fn send(
    network: &Network,
    peer: PeerId,
    task: String,
    file: std::fs::File,
) -> Result<String, hypha_transfer::SendError> {
    let size = file.metadata().map(|m| m.len()).unwrap_or(0);
    let header = Header {
        task,
        name: TRANSFER_NAME.to_string(),
        size,
        published: None,
        sha256: None,
    };
    hypha_transfer::send(network, peer, &header, file, hypha_transfer::SEND_PATIENCE).await
}

/// Why a file is not a checkpoint whose round can be read.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Format(#[from] hypha_diloco::Error),
    #[error("its {} is not {:?}", meta::KIND, meta::KIND_CHECKPOINT)]
    NotACheckpoint,
}

/// The round of the checkpoint at `path`, read from its header.
pub fn checkpoint_round(path: &Path) -> Result<u64, CheckpointError> {
    let mut file = std::fs::File::open(path)?;
    let metadata = hypha_diloco::read_metadata(&mut file)?;
    if metadata.get(meta::KIND).map(String::as_str) != Some(meta::KIND_CHECKPOINT) {
        return Err(CheckpointError::NotACheckpoint);
    }
    Ok(hypha_diloco::server::round_of(&metadata)?)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests fail loudly by design

    use futures::AsyncWriteExt;
    use hypha_network::frame::read_frame;
    use hypha_testing::network::connected;

    use super::*;

    /// A SafeTensors checkpoint of `round` with one tensor of `values` f32s.
    fn checkpoint_bytes(round: u64, values: usize) -> Vec<u8> {
        let header = format!(
            r#"{{"__metadata__":{{"{}":"{}","{}":"{round}"}},"w":{{"dtype":"F32","shape":[{values}],"data_offsets":[0,{}]}}}}"#,
            meta::KIND,
            meta::KIND_CHECKPOINT,
            meta::ROUND,
            values * 4
        );
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.extend((0..values).flat_map(|i| (i as f32).to_le_bytes()));
        bytes
    }

    /// A checkpoint whose transfer broke off is taken on from where it stopped when the
    /// parameter server tries again: the scheduler answers `resume` with what it kept, the
    /// server (`hypha_transfer::send`, which names the file's SHA-256) sends the rest, and the
    /// stored checkpoint is the server's byte for byte. (Checked by answering `ready` always:
    /// the offset assertion fails.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_checkpoint_whose_transfer_broke_off_goes_on_where_it_stopped() {
        let networks = connected(&["server", "scheduler"]).await;
        let (server, scheduler) = (&networks[0], &networks[1]);
        let dir = tempfile::tempdir().unwrap();
        let checkpoints = Checkpoints::new(dir.path().join("job.checkpoint.safetensors"));
        checkpoints.accept_from(Some(server.local_peer_id()));
        checkpoints.accept_up_to(3);
        let (stored_tx, mut stored) = mpsc::channel(4);
        tokio::spawn(
            checkpoints
                .clone()
                .serve(scheduler.clone(), "task-1".into(), stored_tx),
        );
        let bytes = checkpoint_bytes(3, 5 << 20);
        let source = dir.path().join("sent.safetensors");
        std::fs::write(&source, &bytes).unwrap();
        let size = bytes.len() as u64;
        let sha256 =
            hypha_transfer::sha256_of(&std::fs::File::open(&source).unwrap(), size).unwrap();
        let header = Header {
            task: "task-1".into(),
            name: TRANSFER_NAME.into(),
            size,
            published: None,
            sha256: Some(sha256),
        };
        let to = scheduler.local_peer_id();

        let sent_first = 7 << 20;
        let mut stream = server.open_stream(to, PROTOCOL).await.unwrap();
        write_frame(&mut stream, &header).await.unwrap();
        assert_eq!(
            read_frame::<Answer>(&mut stream).await.unwrap(),
            Answer::Ready
        );
        stream.write_all(&bytes[..sent_first]).await.unwrap();
        stream.flush().await.unwrap();
        drop(stream);
        // The next try is answered once the broken one has ended there.
        let mut stream = server.open_stream(to, PROTOCOL).await.unwrap();
        write_frame(&mut stream, &header).await.unwrap();
        let Answer::Resume { offset: kept } = read_frame::<Answer>(&mut stream).await.unwrap()
        else {
            panic!("the scheduler did not resume the checkpoint");
        };
        // Broken off again before a byte: what was kept stays.
        drop(stream);
        assert!(kept > 0 && kept <= sent_first as u64, "resumed at {kept}");

        let checksum = hypha_transfer::send(
            server,
            to,
            &Header {
                sha256: None,
                ..header
            },
            std::fs::File::open(&source).unwrap(),
            hypha_transfer::SEND_PATIENCE,
        )
        .await
        .unwrap();
        assert!(checksum.starts_with("sha256:"));
        assert_eq!(stored.recv().await, Some((3, size)));
        assert!(std::fs::read(checkpoints.path()).unwrap() == bytes);
        assert_eq!(checkpoints.round(), Some(3));
    }

    /// Issue 58, item 4: a parameter server cannot fill the scheduler's disk with
    /// checkpoints. Once the run's first is stored, one more than four times its size and
    /// 16 MiB is refused before a byte of it is read, and nothing is written. (Checked
    /// without the bound: the scheduler answers `ready`.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_checkpoint_larger_than_the_runs_can_be_is_refused_unread() {
        let networks = connected(&["server", "scheduler"]).await;
        let (server, scheduler) = (&networks[0], &networks[1]);
        let dir = tempfile::tempdir().unwrap();
        let checkpoints = Checkpoints::new(dir.path().join("job.checkpoint.safetensors"));
        checkpoints.accept_from(Some(server.local_peer_id()));
        checkpoints.accept_up_to(5);
        let (stored_tx, mut stored) = mpsc::channel(4);
        tokio::spawn(
            checkpoints
                .clone()
                .serve(scheduler.clone(), "task-1".into(), stored_tx),
        );
        let to = scheduler.local_peer_id();
        let first = checkpoint_bytes(1, 1000);
        let source = dir.path().join("first.safetensors");
        std::fs::write(&source, &first).unwrap();
        let header = |size: u64| Header {
            task: "task-1".into(),
            name: TRANSFER_NAME.into(),
            size,
            published: None,
            sha256: None,
        };
        hypha_transfer::send(
            server,
            to,
            &header(first.len() as u64),
            std::fs::File::open(&source).unwrap(),
            hypha_transfer::SEND_PATIENCE,
        )
        .await
        .unwrap();
        assert_eq!(stored.recv().await, Some((1, first.len() as u64)));

        let huge = 4 * first.len() as u64 + (16 << 20) + 1;
        let mut stream = server.open_stream(to, PROTOCOL).await.unwrap();
        write_frame(&mut stream, &header(huge)).await.unwrap();
        let Answer::Refused(refusal) = read_frame::<Answer>(&mut stream).await.unwrap() else {
            panic!("a checkpoint of {huge} bytes was taken");
        };
        assert_eq!(refusal.code, RefusalCode::TooLarge, "{refusal:?}");
        assert!(refusal.message.contains("at most"), "{refusal:?}");
        assert_eq!(checkpoints.round(), Some(1));
        assert!(std::fs::read(checkpoints.path()).unwrap() == first);
        let partial = std::fs::read_dir(dir.path())
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .ends_with(".partial")
            })
            .count();
        assert_eq!(partial, 0, "nothing of it written");
    }
}
