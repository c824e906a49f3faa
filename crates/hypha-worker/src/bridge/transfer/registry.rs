//! The tasks that run jobs on this worker: each one's scheduler (its owner), the workers it
//! named as the task's peers, and its jobs' inboxes. The rules of who may run a job of a task
//! and who may send to it live here; the protocol asks them ([`super::receive`]).

use std::{
    collections::{HashMap, HashSet},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use hypha_artifacts::Admission;
use hypha_messages::job::TaskPeers;
use hypha_network::PeerId;
use hypha_transfer::{Refusal, RefusalCode};

use super::inbox::Inbox;
use crate::bridge::paths::JobDir;

/// How long the workers of a task may still fetch its artifacts from this worker after its
/// last job here ended. Jobs of one task start apart (a slower worker, an executor that
/// ends in a moment): a worker whose job ended before another's began its fetch would
/// refuse it every chunk, and the latecomer would wait out its stall patience and read
/// from the origin what the others hold (CI, session 51). Nothing else of the task outlives
/// its jobs: its inboxes close and its scheduler no longer owns it here.
pub const ARTIFACTS_AFTER_THE_TASK: Duration = Duration::from_secs(120);

/// The inboxes of every job on this worker, by task.
#[derive(Debug)]
pub struct Inboxes {
    by_task: Mutex<HashMap<String, Task>>,
    /// Tasks whose last job here ended, while their peers may still fetch their artifacts:
    /// their scheduler, their peers, and until when.
    ended: Mutex<HashMap<String, EndedTask>>,
    /// [`ARTIFACTS_AFTER_THE_TASK`]; shorter in tests.
    artifacts_after_the_task: Duration,
}

impl Default for Inboxes {
    fn default() -> Self {
        Inboxes {
            by_task: Mutex::default(),
            ended: Mutex::default(),
            artifacts_after_the_task: ARTIFACTS_AFTER_THE_TASK,
        }
    }
}

#[derive(Debug)]
struct EndedTask {
    scheduler: PeerId,
    peers: HashSet<PeerId>,
    until: Instant,
}

/// A job for a task that another scheduler owns on this worker.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "task {task} belongs to scheduler {owner} on this worker; a job of it from {claimant} is refused"
)]
pub struct ForeignTask {
    pub task: String,
    pub owner: PeerId,
    pub claimant: PeerId,
}

/// One task's jobs on this worker, and who may send to them.
#[derive(Debug)]
struct Task {
    inboxes: Vec<Arc<Inbox>>,
    /// The scheduler that dispatched the task's first job here; it alone dispatches further
    /// jobs of the task, may send to them, and tells who else may. Never changes.
    scheduler: PeerId,
    /// The workers that run the task's jobs, as the scheduler last said.
    peers: HashSet<PeerId>,
    /// The version of `peers`; an older list is not taken.
    version: u64,
}

/// A task's entry among the inboxes, while its scheduler is the one named.
struct TaskOf {
    inboxes: std::sync::Weak<Inboxes>,
    scheduler: PeerId,
    task: String,
}

impl TaskOf {
    /// `f` of the task's peers as its scheduler last said; `None` when no job of the task
    /// runs here or it belongs to another scheduler.
    /// A task whose last job here ended a moment ago still has them, for its artifacts
    /// ([`ARTIFACTS_AFTER_THE_TASK`]).
    fn peers<T>(&self, f: impl FnOnce(&HashSet<PeerId>) -> T) -> Option<T> {
        let inboxes = self.inboxes.upgrade()?;
        if let Some(task) = inboxes.lock().get(&self.task) {
            return (task.scheduler == self.scheduler).then(|| f(&task.peers));
        }
        let ended = inboxes.lock_ended();
        let task = ended.get(&self.task)?;
        (task.scheduler == self.scheduler && Instant::now() < task.until).then(|| f(&task.peers))
    }
}

impl Task {
    /// Takes `peers` if they are newer than the list held.
    fn update(&mut self, peers: &TaskPeers) -> bool {
        if peers.version < self.version {
            return false;
        }
        // Peer ids as a scheduler sends them; anything unreadable names nobody.
        self.peers = peers.peers.iter().filter_map(|p| p.parse().ok()).collect();
        self.version = peers.version;
        true
    }
}

impl Inboxes {
    /// Whether `scheduler` may run a job of `task` here: nobody else owns the task.
    pub fn check_owner(&self, task: &str, scheduler: PeerId) -> Result<(), Box<ForeignTask>> {
        match self.lock().get(task) {
            Some(entry) if entry.scheduler != scheduler => Err(Box::new(ForeignTask {
                task: task.to_string(),
                owner: entry.scheduler,
                claimant: scheduler,
            })),
            _ => Ok(()),
        }
    }

    /// Opens the inbox of `job`, dispatched by `scheduler` with the task's `peers`; it
    /// receives what those send to `task` until the returned registration is dropped. The
    /// first job of a task makes `scheduler` its owner; a job of a task another scheduler
    /// owns is refused and changes nothing.
    pub fn open(
        self: &Arc<Self>,
        task: &str,
        job: &str,
        dir: Arc<JobDir>,
        scheduler: PeerId,
        peers: &TaskPeers,
    ) -> Result<Registration, Box<ForeignTask>> {
        let mut by_task = self.lock();
        let entry = by_task.entry(task.to_string()).or_insert_with(|| Task {
            inboxes: Vec::new(),
            scheduler,
            peers: HashSet::new(),
            version: 0,
        });
        if entry.scheduler != scheduler {
            return Err(Box::new(ForeignTask {
                task: task.to_string(),
                owner: entry.scheduler,
                claimant: scheduler,
            }));
        }
        entry.update(peers);
        let inbox = Arc::new(Inbox::new(job, dir));
        entry.inboxes.push(inbox.clone());
        drop(by_task);
        Ok(Registration {
            inboxes: self.clone(),
            task: task.to_string(),
            inbox,
        })
    }

    /// `from` says which workers run `task`'s jobs now. Taken only from the scheduler that
    /// dispatched them, and only if newer than the list held (an older one is ignored, and
    /// still `true`); `false` when no job of the task runs here or `from` is not its
    /// scheduler.
    pub fn set_peers(&self, from: PeerId, task: &str, peers: &TaskPeers) -> bool {
        match self.lock().get_mut(task) {
            Some(entry) if entry.scheduler == from => {
                entry.update(peers);
                true
            }
            _ => false,
        }
    }

    /// Who may share the artifacts of `scheduler`'s `task` with this worker: the workers of
    /// the task's jobs, as its scheduler last said (while an artifact is shared, the list may
    /// change), named to the swarm so that it dials them. Nobody, should the task here
    /// belong to another scheduler.
    pub fn artifact_admission(self: &Arc<Self>, scheduler: PeerId, task: &str) -> Admission {
        let task = Arc::new(TaskOf {
            inboxes: Arc::downgrade(self),
            scheduler,
            task: task.to_string(),
        });
        let named = task.clone();
        Admission::new(move |peer| task.peers(|peers| peers.contains(peer)).unwrap_or(false))
            .naming(move || {
                named
                    .peers(|peers| peers.iter().copied().collect())
                    .unwrap_or_default()
            })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Task>> {
        self.by_task.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lock_ended(&self) -> std::sync::MutexGuard<'_, HashMap<String, EndedTask>> {
        self.ended.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Who may share artifacts with this worker for `task`: see
    /// [`artifact_admission`](Self::artifact_admission), with the task's scheduler here.
    pub(super) fn admission_of(self: &Arc<Self>, task: &str) -> Admission {
        let scheduler = self.lock().get(task).map(|t| t.scheduler);
        match scheduler {
            Some(scheduler) => self.artifact_admission(scheduler, task),
            None => Admission::new(|_| false),
        }
    }

    /// The schedulers whose tasks here `peer` may send to: as their scheduler, or as one of the
    /// workers it named. Nobody's for a peer that is refused before its header is read.
    pub(super) fn vouchers(&self, peer: &PeerId) -> Vec<PeerId> {
        let mut vouchers: Vec<PeerId> = self
            .lock()
            .values()
            .filter(|task| task.scheduler == *peer || task.peers.contains(peer))
            .map(|task| task.scheduler)
            .collect();
        vouchers.sort_unstable();
        vouchers.dedup();
        vouchers
    }

    /// The inboxes of `task`'s jobs, if `sender` may send to them.
    pub(super) fn of_task(&self, task: &str, sender: &PeerId) -> Result<Vec<Arc<Inbox>>, Refusal> {
        match self.lock().get(task) {
            None => Err(Refusal::new(
                RefusalCode::NoJob,
                format!("no job of task {task} runs on this worker"),
            )),
            Some(entry) if entry.scheduler == *sender || entry.peers.contains(sender) => {
                Ok(entry.inboxes.clone())
            }
            Some(_) => Err(Refusal::new(
                RefusalCode::NotInTask,
                format!("{sender} runs no job of task {task}, as its scheduler told this worker"),
            )),
        }
    }
}

/// A job's place among the [`Inboxes`]; dropping it closes the inbox.
#[derive(Debug)]
pub struct Registration {
    inboxes: Arc<Inboxes>,
    task: String,
    inbox: Arc<Inbox>,
}

impl Registration {
    pub fn inbox(&self) -> &Arc<Inbox> {
        &self.inbox
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut by_task = self.inboxes.lock();
        if let Some(entry) = by_task.get_mut(&self.task) {
            entry.inboxes.retain(|i| !Arc::ptr_eq(i, &self.inbox));
            if entry.inboxes.is_empty()
                && let Some(task) = by_task.remove(&self.task)
            {
                let now = Instant::now();
                let mut ended = self.inboxes.lock_ended();
                ended.retain(|_, task| now < task.until);
                ended.insert(
                    self.task.clone(),
                    EndedTask {
                        scheduler: task.scheduler,
                        peers: task.peers,
                        until: now + self.inboxes.artifacts_after_the_task,
                    },
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peers(version: u64, of: &[PeerId]) -> TaskPeers {
        TaskPeers {
            version,
            peers: of.iter().map(PeerId::to_string).collect(),
        }
    }

    /// Inboxes with nothing open, and a job directory to open them in.
    fn registry() -> (Arc<Inboxes>, Arc<JobDir>, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let job_dir = Arc::new(JobDir::open(dir.path()).unwrap());
        (Arc::new(Inboxes::default()), job_dir, dir)
    }

    fn refusal(inboxes: &Inboxes, task: &str, sender: &PeerId) -> Option<RefusalCode> {
        inboxes.of_task(task, sender).err().map(|r| r.code)
    }

    #[test]
    fn a_tasks_first_job_makes_its_scheduler_the_owner_until_its_last_job_ends() {
        let (inboxes, dir, _keep) = registry();
        let (owner, other) = (PeerId::random(), PeerId::random());
        let first = inboxes
            .open("t", "job-1", dir.clone(), owner, &peers(1, &[]))
            .unwrap();
        let second = inboxes
            .open("t", "job-2", dir.clone(), owner, &peers(1, &[]))
            .unwrap();
        let foreign = inboxes
            .open("t", "job-3", dir.clone(), other, &peers(9, &[other]))
            .unwrap_err();
        assert_eq!((foreign.owner, foreign.claimant), (owner, other));
        assert!(inboxes.check_owner("t", other).is_err());
        assert!(inboxes.check_owner("t", owner).is_ok());
        // The refused job changed nothing: its peer list was not taken.
        assert_eq!(refusal(&inboxes, "t", &other), Some(RefusalCode::NotInTask));
        assert_eq!(inboxes.of_task("t", &owner).unwrap().len(), 2);

        drop(first);
        assert!(inboxes.check_owner("t", other).is_err(), "a job still runs");
        drop(second);
        assert!(
            inboxes.check_owner("t", other).is_ok(),
            "the task is free again"
        );
        assert_eq!(refusal(&inboxes, "t", &owner), Some(RefusalCode::NoJob));
    }

    #[test]
    fn only_the_owner_names_the_peers_and_an_older_list_is_not_taken() {
        let (inboxes, dir, _keep) = registry();
        let (owner, stranger) = (PeerId::random(), PeerId::random());
        let (a, b) = (PeerId::random(), PeerId::random());
        let _job = inboxes
            .open("t", "job", dir, owner, &peers(2, &[a]))
            .unwrap();
        assert!(inboxes.of_task("t", &a).is_ok());
        assert_eq!(refusal(&inboxes, "t", &b), Some(RefusalCode::NotInTask));

        assert!(!inboxes.set_peers(stranger, "t", &peers(3, &[stranger])));
        assert_eq!(
            refusal(&inboxes, "t", &stranger),
            Some(RefusalCode::NotInTask)
        );
        assert!(!inboxes.set_peers(owner, "no-such-task", &peers(3, &[b])));

        // Older than the list held: ignored, still `true`.
        assert!(inboxes.set_peers(owner, "t", &peers(1, &[b])));
        assert_eq!(refusal(&inboxes, "t", &b), Some(RefusalCode::NotInTask));
        assert!(inboxes.set_peers(owner, "t", &peers(3, &[b])));
        assert!(inboxes.of_task("t", &b).is_ok());
        assert_eq!(refusal(&inboxes, "t", &a), Some(RefusalCode::NotInTask));
        // The scheduler itself may always send.
        assert!(inboxes.of_task("t", &owner).is_ok());
    }

    #[test]
    fn a_peer_is_vouched_for_by_the_schedulers_of_the_tasks_it_may_send_to() {
        let (inboxes, dir, _keep) = registry();
        let (s1, s2, worker, nobody) = (
            PeerId::random(),
            PeerId::random(),
            PeerId::random(),
            PeerId::random(),
        );
        let _one = inboxes
            .open("t1", "j1", dir.clone(), s1, &peers(1, &[worker]))
            .unwrap();
        let _two = inboxes
            .open("t2", "j2", dir.clone(), s2, &peers(1, &[worker]))
            .unwrap();
        let _three = inboxes
            .open("t3", "j3", dir, s1, &peers(1, &[worker]))
            .unwrap();
        let mut both = vec![s1, s2];
        both.sort_unstable();
        assert_eq!(inboxes.vouchers(&worker), both);
        assert_eq!(inboxes.vouchers(&s1), vec![s1]);
        assert!(inboxes.vouchers(&nobody).is_empty());
    }

    #[test]
    fn artifact_admission_follows_the_peers_and_admits_nobody_under_another_owner() {
        let (inboxes, dir, _keep) = registry();
        let (owner, other, a, b) = (
            PeerId::random(),
            PeerId::random(),
            PeerId::random(),
            PeerId::random(),
        );
        let job = inboxes
            .open("t", "job", dir, owner, &peers(1, &[a]))
            .unwrap();
        let admission = inboxes.artifact_admission(owner, "t");
        let claimed = inboxes.artifact_admission(other, "t");
        assert!(admission.admits(&a) && !admission.admits(&b));
        assert_eq!(admission.named(), vec![a]);
        assert!(!claimed.admits(&a) && claimed.named().is_empty());

        inboxes.set_peers(owner, "t", &peers(2, &[b]));
        assert!(admission.admits(&b) && !admission.admits(&a));
        assert!(inboxes.admission_of("t").admits(&b));
        drop(job);
        assert!(
            admission.admits(&b) && !claimed.admits(&b),
            "a moment after its last job ended, the task's peers still fetch its artifacts here"
        );
        assert!(
            !inboxes.admission_of("t").admits(&b),
            "no job of the task runs here to fetch more"
        );
    }

    /// Past [`ARTIFACTS_AFTER_THE_TASK`] (here none at all), a task that ended admits nobody.
    #[test]
    fn an_ended_task_admits_nobody_once_its_time_passed() {
        let inboxes = Arc::new(Inboxes {
            artifacts_after_the_task: Duration::ZERO,
            ..Inboxes::default()
        });
        let (_, dir, _keep) = registry();
        let (owner, a) = (PeerId::random(), PeerId::random());
        let job = inboxes
            .open("t", "job", dir, owner, &peers(1, &[a]))
            .unwrap();
        let admission = inboxes.artifact_admission(owner, "t");
        assert!(admission.admits(&a));
        drop(job);
        assert!(!admission.admits(&a));
        assert!(inboxes.check_owner("t", PeerId::random()).is_ok());
    }
}
