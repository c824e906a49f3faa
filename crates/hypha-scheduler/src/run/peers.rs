//! Telling the workers who the task's peers are.

use std::{collections::HashSet, time::Duration};

use hypha_messages::{ErrorCode, Request, job::TaskPeers};
use hypha_network::NetworkError;

use super::JobRun;
use crate::unix_ms;

/// A worker that answers a task's peers `Gone` (its dispatch is still on the way) is told
/// again this many times, this long apart.
pub(super) const TASK_PEERS_TRIES: usize = 20;

pub(super) const TASK_PEERS_RETRY: Duration = Duration::from_millis(250);

/// Workers hear within this that others left the task (at once that one joined): a worker
/// that left is refused a little later, and the run's end tells each worker once, not once
/// per job that ended.
pub(super) const PEERS_LEFT_WITHIN: Duration = Duration::from_secs(1);

impl JobRun<'_> {
    /// Notes who the task's peers are now (the workers of its jobs: with the scheduler, the
    /// only peers whose transfers the jobs take), and when the workers must hear it: at once
    /// when a worker joined (the others must take its transfers), within
    /// [`PEERS_LEFT_WITHIN`] when workers only left. [`JobRun::tell_task_peers`] tells them.
    ///
    /// Told once per turn of the run's loop, not once per change: a run that dispatches 64
    /// jobs at once, or whose 64 jobs end within a second, tells each worker once or twice
    /// instead of once per job (quadratic: 2,000 requests at 64 workers, measured by
    /// `hypha-bench allocation`).
    pub(super) fn task_peers_changed(&mut self) {
        let peers: Vec<String> = self
            .jobs
            .values()
            .map(|d| d.lease.peer.to_string())
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        if peers == self.told_peers.peers {
            return;
        }
        let joined = peers.iter().any(|p| !self.told_peers.peers.contains(p));
        self.told_peers = TaskPeers {
            version: unix_ms().max(self.told_peers.version + 1),
            peers,
        };
        let now = tokio::time::Instant::now();
        let due = if joined { now } else { now + PEERS_LEFT_WITHIN };
        self.peers_due = Some(self.peers_due.map_or(due, |earlier| earlier.min(due)));
    }

    /// Tells each worker whose jobs know an older list of the task's peers the current one,
    /// once it is due (see [`JobRun::task_peers_changed`]); a job whose dispatch is not
    /// answered yet is told once it is (its dispatch carried the list of its time).
    ///
    /// Sent by tasks the run owns (`telling`; they end with it). The lists carry rising versions, so one that arrives late
    /// changes nothing; one that arrives before the dispatch it follows (answered `Gone`) is
    /// sent again for a few seconds. A worker that never hears it keeps what it was told
    /// before, and a sender it refuses tries again for a while (`not_in_task` is transient).
    pub(super) fn tell_task_peers(&mut self) {
        if self
            .peers_due
            .is_none_or(|due| due > tokio::time::Instant::now())
        {
            return;
        }
        self.peers_due = None;
        let version = self.told_peers.version;
        let mut workers = HashSet::new();
        // Jobs still being dispatched are told when they answer (`announce_dispatched`).
        for job in self.jobs.values_mut().filter(|job| job.announced) {
            if job.peers_version < version {
                job.peers_version = version;
                workers.insert(job.lease.peer);
            }
        }
        // Those that ended are let go of here, not in the run's loop: a run of 64 workers
        // tells thousands, and waking the loop for each slowed its dispatches (`hypha-bench
        // allocation` at N = 64: p50 0.74–1.47 s against 0.42 s).
        while self.telling.try_join_next().is_some() {}
        for worker in workers {
            let network = self.network.clone();
            let request = Request::TaskPeers {
                task: self.task.clone(),
                peers: self.told_peers.clone(),
            };
            self.telling.spawn(async move {
                for _ in 0..TASK_PEERS_TRIES {
                    match network.request(worker, request.clone()).await {
                        Err(NetworkError::Remote { error, .. })
                            if error.code == ErrorCode::Gone =>
                        {
                            tokio::time::sleep(TASK_PEERS_RETRY).await;
                        }
                        Err(error) => {
                            tracing::debug!(%worker, %error, "a worker did not hear who its task's peers are");
                            break;
                        }
                        Ok(_) => break,
                    }
                }
            });
        }
    }
}
