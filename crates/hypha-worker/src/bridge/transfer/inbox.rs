//! One job's inbox: the files that arrived for it, in order, until its executor takes them.

use std::{
    collections::{HashSet, VecDeque},
    ffi::OsString,
    path::Path,
    sync::{Arc, Mutex},
};

use hypha_network::PeerId;
use tokio::sync::Notify;

use super::{MAX_WAITING, STAGING_DIR};
use crate::bridge::paths::{JobDir, PathError};

/// A file that arrived for a job and waits for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Arrived {
    /// Per job, from 0, in order of arrival.
    pub sequence: u64,
    pub from: PeerId,
    pub name: String,
    pub size: u64,
    /// `sha256:<hex>`.
    pub checksum: String,
    /// The file's name in [`STAGING_DIR`].
    pub(super) staged: OsString,
}

/// One job's inbox.
#[derive(Debug)]
pub struct Inbox {
    job: String,
    pub(super) dir: Arc<JobDir>,
    state: Mutex<InboxState>,
    arrived: Notify,
}

#[derive(Debug, Default)]
struct InboxState {
    next_sequence: u64,
    waiting: VecDeque<Arrived>,
}

impl Inbox {
    /// An empty inbox for `job`, whose files are staged in `dir`.
    pub(super) fn new(job: &str, dir: Arc<JobDir>) -> Self {
        Self {
            job: job.to_string(),
            dir,
            state: Mutex::default(),
            arrived: Notify::new(),
        }
    }

    pub(super) fn has_room(&self) -> bool {
        self.lock().waiting.len() < MAX_WAITING
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, InboxState> {
        // A panic while holding the lock leaves a consistent queue behind: take it anyway.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn push(
        &self,
        from: PeerId,
        name: &str,
        size: u64,
        checksum: &str,
        staged: OsString,
    ) {
        let mut state = self.lock();
        let sequence = state.next_sequence;
        state.next_sequence += 1;
        state.waiting.push_back(Arrived {
            sequence,
            from,
            name: name.to_string(),
            size,
            checksum: checksum.to_string(),
            staged,
        });
        drop(state);
        self.arrived.notify_waiters();
    }

    /// Waits for the oldest file sent by one of `from` (by anyone when `from` is empty) and
    /// takes it out of the queue.
    pub async fn next(&self, from: &HashSet<PeerId>) -> Arrived {
        loop {
            let notified = self.arrived.notified();
            tokio::pin!(notified);
            // Register before looking, so a push between the look and the wait is not missed.
            notified.as_mut().enable();
            if let Some(arrived) = self.try_next(from) {
                return arrived;
            }
            notified.await;
        }
    }

    /// The files waiting.
    pub fn waiting(&self) -> usize {
        self.lock().waiting.len()
    }

    /// The oldest file waiting that one of `from` sent (anyone's when `from` is empty),
    /// taken out of the queue; `None` at once when there is none.
    pub fn try_next(&self, from: &HashSet<PeerId>) -> Option<Arrived> {
        let mut state = self.lock();
        let position = state
            .waiting
            .iter()
            .position(|a| from.is_empty() || from.contains(&a.from))?;
        state.waiting.remove(position)
    }

    /// Moves a taken file into `out_dir` (relative to the job's directory) as
    /// `{sequence}-{name}` and returns that path.
    pub fn deliver(&self, arrived: &Arrived, out_dir: &Path) -> Result<String, PathError> {
        let staging = self.dir.create_dir_all(Path::new(STAGING_DIR))?;
        let target_dir = self.dir.create_dir_all(out_dir)?;
        let name = format!("{}-{}", arrived.sequence, arrived.name);
        let target = out_dir.join(&name);
        let io = |error: rustix::io::Errno| PathError::Io {
            path: target.display().to_string(),
            error: error.into(),
        };
        rustix::fs::renameat(&staging, &arrived.staged, &target_dir, name.as_str()).map_err(io)?;
        rustix::fs::fsync(&target_dir).map_err(io)?;
        Ok(target.display().to_string())
    }

    /// The job this inbox belongs to.
    pub fn job(&self) -> &str {
        &self.job
    }
}
