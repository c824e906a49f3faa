//! A run resumed after its scheduler was killed: the leases and jobs of the earlier process
//! taken over.

use std::path::Path;

use hypha_messages::Request;
use libp2p::PeerId;

use super::{Dispatched, Internal, JobRun, RunError};
use crate::{
    allocator::Lease,
    checkpoint,
    data::CarriedOver,
    event::Event,
    record::RunRecord,
    slots::{Role, SlotState},
    spec::JobFile,
    training::Training,
};

/// What an earlier process of the scheduler left of this run: its record, and for DiLoCo
/// the round of the checkpoint held beside the ledger, which the run goes on from.
pub(super) struct Earlier {
    pub(super) record: Option<RunRecord>,
    pub(super) round: Option<u64>,
}

impl Earlier {
    /// Reads the record at `record` (none: a fresh run) and the checkpoint beside the
    /// ledger. A checkpoint that is there but cannot be read ends the run: the ledger counts
    /// its rounds as used.
    pub(super) fn load(spec: &JobFile, record: Option<&Path>) -> Result<Self, RunError> {
        let record = match record {
            Some(path) => RunRecord::load(path)?,
            None => None,
        };
        let round = match (&record, &spec.diloco, spec.ledger_path()) {
            (Some(_), Some(_), Some(ledger)) => {
                let path = checkpoint::path_beside(&ledger);
                match checkpoint::checkpoint_round(&path) {
                    Ok(round) => Some(round),
                    // No checkpoint: no round of the earlier run counted as used.
                    Err(_) if !path.exists() => None,
                    Err(error) => {
                        return Err(RunError::Checkpoint {
                            path: path.display().to_string(),
                            error,
                        });
                    }
                }
            }
            _ => None,
        };
        Ok(Self { record, round })
    }
}

/// What the data of a run resumed from `earlier` with the checkpoint of `round` carries over
/// from it.
pub(super) fn carried_over(
    spec: &JobFile,
    earlier: Option<&RunRecord>,
    round: Option<u64>,
) -> CarriedOver {
    CarriedOver {
        // Rounds the earlier run applied that are in the checkpoint: their slices are used.
        committed: earlier
            .iter()
            .flat_map(|r| &r.uncommitted)
            .filter(|u| round.is_some_and(|held| u.round < held))
            .filter_map(|u| Some((u.peer.parse().ok()?, u.job.clone(), u.round)))
            .collect(),
        // Jobs that may go on, and those whose rounds past the checkpoint wait for the
        // earlier server to go on.
        going_on: earlier
            .iter()
            .flat_map(|r| {
                let jobs = r
                    .jobs
                    .iter()
                    .filter(|j| goes_on(spec, j.slot, round))
                    .map(|j| (&j.peer, &j.job));
                let waiting = r
                    .uncommitted
                    .iter()
                    .filter(|u| round.is_some_and(|held| u.round >= held))
                    .map(|u| (&u.peer, &u.job));
                jobs.chain(waiting)
            })
            .filter_map(|(peer, job)| Some((peer.parse().ok()?, job.clone())))
            .collect(),
        open_from: round.unwrap_or(0),
        data_nodes: earlier
            .iter()
            .flat_map(|r| &r.data_nodes)
            .filter_map(|peer| peer.parse().ok())
            .collect(),
    }
}

/// Whether the job of `slot` that an earlier process of the scheduler ran goes on when its
/// lease is taken over and it still runs. A DiLoCo job's do, when the scheduler holds a
/// checkpoint (`restored`): the parameter server trains on from the round it is at (its
/// first status says which; the rounds it applied since the checkpoint are used with its
/// next one), and trainers with it, keeping what they set up and fetched ahead. When the
/// server does not go on, a new one is restored from the checkpoint and the trainers join it,
/// giving back the rounds they held, as after a failover. Without a checkpoint nothing goes
/// on: a new server would adopt the model a trainer offers, which holds rounds whose slices
/// went back at the restart. Nor does a plain iteration's job: the rounds it completes are
/// used at its word, and it may be working on slices given back at the restart.
pub(super) fn goes_on(spec: &JobFile, slot: usize, restored: Option<u64>) -> bool {
    spec.diloco.is_some() && slot <= spec.workers.max && restored.is_some()
}

/// A lease of an earlier run taken over for `slot`, with its job `job` on `peer` still
/// running (`going_on`) or stopped, or one that could not be.
pub(super) struct Adoption {
    slot: usize,
    peer: PeerId,
    job: String,
    lease: Result<Box<Lease>, String>,
    going_on: bool,
    /// A trainer the earlier run had not yet told to join its server.
    rejoin: bool,
}

impl JobRun<'_> {
    /// Takes over what the earlier run of this job left: the lease of each job it ran, with
    /// the job itself where it still runs and [`goes_on`] (a new job in the same slot
    /// otherwise, the old one stopped), and for a parameter server that does not go on the
    /// checkpoint of `round`.
    pub(super) async fn resume(&mut self, earlier: RunRecord, round: Option<u64>) {
        self.restore = round;
        let server_slot = self.spec.workers.max;
        if let (Some(checkpoints), Some(round)) = (&self.checkpoints, round) {
            checkpoints.accept_up_to(round);
        }
        self.events.begin(&self.task, earlier.history);
        for benched in &earlier.benched {
            self.slots.give_up(benched.slot);
        }
        self.benched = earlier.benched;
        self.events.record(Event::Resumed {
            task: self.task.clone(),
            round,
            jobs: earlier.jobs.len(),
        });
        for recorded in earlier.jobs {
            let Ok(peer) = recorded.peer.parse::<PeerId>() else {
                continue;
            };
            if self.slots.state(recorded.slot) != Some(&SlotState::Wanted) {
                continue;
            }
            self.slots.adopting(recorded.slot);
            // Kept in the record until taken over: a scheduler killed again meanwhile takes
            // it over then.
            self.adopting.push(recorded.clone());
            let allocator = self.allocator.clone();
            let network = self.network.clone();
            let lost = self.lost.clone();
            let may_go_on = goes_on(self.spec, recorded.slot, round);
            if may_go_on {
                // Its prefetcher keeps asking while its lease is taken over.
                self.live.insert(peer, &recorded.job);
                if recorded.slot == server_slot {
                    self.server_pending = true;
                } else if let Some(training) = self.training.as_mut() {
                    training.taking_over(peer);
                }
            }
            self.tasks.spawn(async move {
                let adopted = allocator
                    .adopt(peer, recorded.lease, recorded.price, &lost)
                    .await;
                // A worker that does not list its jobs (older than the list) is taken to run
                // none of them.
                let going_on = may_go_on
                    && adopted
                        .as_ref()
                        .is_ok_and(|(_, jobs)| jobs.contains(&recorded.job));
                if adopted.is_ok() && !going_on {
                    // Its executor works on a state this run does not have (or is gone): a
                    // new job starts.
                    let cancel = Request::Cancel {
                        job: recorded.job.clone(),
                    };
                    let _ = network.request(peer, cancel).await;
                }
                Internal::Adopted(Adoption {
                    slot: recorded.slot,
                    peer,
                    job: recorded.job,
                    lease: adopted.map(|(lease, _)| Box::new(lease)),
                    going_on,
                    rejoin: recorded.rejoin,
                })
            });
        }
        if !self.server_pending
            && let Some(training) = self.training.as_mut()
        {
            // No server to go on: the rounds it applied past the checkpoint are gone.
            training.rounds_lost().await;
        }
    }

    /// A lease of the earlier run was taken over, or could not be: its job goes on, or a new
    /// one starts in its slot. Trainers wait while it is not known whether the earlier
    /// parameter server goes on.
    pub(super) async fn adopted(&mut self, mut adoption: Adoption) -> Result<(), RunError> {
        let role = self.slots.role(adoption.slot);
        if role == Role::Trainer && self.server_pending {
            self.parked.push(adoption);
            return Ok(());
        }
        // Lost while it waited.
        if let Ok(lease) = &adoption.lease
            && let Some(reason) = lease.lost()
        {
            adoption.lease = Err(reason.to_string());
            adoption.going_on = false;
        }
        let Adoption {
            slot,
            peer,
            job,
            lease,
            going_on,
            rejoin,
        } = adoption;
        self.adopting.retain(|recorded| recorded.job != job);
        if !going_on {
            if let Some(training) = self.training.as_mut() {
                training.takeover_ended(peer);
            }
            self.live.remove(peer, &job);
            self.ended_early.retain(|(_, report)| report.job != job);
            // The earlier run's job is stopped (or its lease is gone): what it held goes back.
            self.release_data(peer, &job).await;
            if role == Role::ParameterServer && self.server_pending {
                // The rounds it applied past the checkpoint are gone with it: a new server is
                // restored from the checkpoint, as after any failover.
                self.server_pending = false;
                let trained = self.training.as_ref().map_or(0, Training::round);
                if let Some(training) = self.training.as_mut() {
                    training.rounds_lost().await;
                }
                let round = self.restore.unwrap_or(0);
                self.events.record(Event::Failover {
                    peer: peer.to_string(),
                    reason: match &lease {
                        Err(reason) => reason.clone(),
                        Ok(_) => "its job ended while the scheduler was away".into(),
                    },
                    round,
                    lost_rounds: trained.saturating_sub(round),
                    standby: None,
                });
            }
        }
        match lease {
            Ok(lease) => {
                self.events.record(Event::Readopted {
                    slot,
                    peer: peer.to_string(),
                    lease: lease.id,
                    job: going_on.then(|| job.clone()),
                });
                if going_on {
                    self.take_over(slot, job, *lease, rejoin).await
                } else {
                    self.dispatch(slot, *lease)
                }
            }
            Err(reason) => {
                tracing::info!(slot, %peer, %reason, "the earlier run's lease is gone; leasing another worker");
                self.slots.adoption_failed(slot);
                self.store_record()?;
                self.allocate_next();
                Ok(())
            }
        }
    }

    /// Goes on with `job` of the earlier run, still running under `lease`: a trainer trains
    /// on with the parameter server that went on, or joins the one restored from the
    /// checkpoint as trainers do after a failover; a parameter server says in its first
    /// status which round it is at.
    pub(super) async fn take_over(
        &mut self,
        slot: usize,
        job: String,
        lease: Lease,
        rejoin: bool,
    ) -> Result<(), RunError> {
        let peer = lease.peer;
        let role = self.slots.role(slot);
        if let Some(training) = self.training.as_mut() {
            match role {
                Role::Trainer => training.trainer_taken_over(&job, peer, rejoin),
                // A standby does not go on ([`goes_on`]): a new one follows the server.
                Role::Standby => {}
                Role::ParameterServer => {
                    training.server_taken_over(&job, peer);
                    self.server_heard = std::time::Instant::now();
                    if let Some(checkpoints) = &self.checkpoints {
                        checkpoints.accept_from(Some(peer));
                        // Those of the rounds recorded applied (the last one, of a server
                        // that finished, comes without another status).
                        if let Some(round) = training.recorded_through() {
                            checkpoints.accept_up_to(round);
                        }
                    }
                }
            }
        }
        self.slots.started(slot, &job);
        self.live.insert(peer, &job);
        self.jobs.insert(
            job.clone(),
            Dispatched {
                slot,
                lease,
                // Taken over running: the earlier process announced it.
                announced: true,
                // What the earlier process told its worker is not known: told again.
                peers_version: 0,
            },
        );
        self.task_peers_changed();
        self.peers_due = Some(tokio::time::Instant::now());
        self.store_record()?;
        let early = self
            .ended_early
            .iter()
            .position(|(p, r)| *p == peer && r.job == job);
        if let Some(at) = early {
            let (peer, report) = self.ended_early.swap_remove(at);
            self.on_status(peer, report).await?;
        }
        Ok(())
    }

    /// The role of `job` on `peer` when it is a job of the earlier run that may go on, whose
    /// lease is being taken over.
    pub(super) fn taking_over(&self, peer: PeerId, job: &str) -> Option<Role> {
        self.adopting
            .iter()
            .find(|recorded| {
                recorded.job == job
                    && recorded.peer == peer.to_string()
                    && goes_on(self.spec, recorded.slot, self.restore)
            })
            .map(|recorded| self.slots.role(recorded.slot))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use libp2p::PeerId;

    use super::{carried_over, goes_on};
    use crate::{
        record::{RecordedJob, RecordedRound, RunRecord},
        spec::JobFile,
    };

    const PLAIN: &str = "workers = 2\nbid = 50\n[executor]\nclass = \"train\"\nname = \"x\"\n[data]\ndataset = \"blobs\"\n";
    const DILOCO: &str = "[diloco]\nsamples_per_round = 512\nbatch_size = 32\n[diloco.parameter_server]\nbid = 10\nexecutor = { class = \"aggregate\", name = \"parameter-server\" }\n";

    fn diloco() -> JobFile {
        JobFile::parse("job.toml", &format!("{PLAIN}{DILOCO}")).unwrap()
    }

    fn job(slot: usize, peer: PeerId, job: &str) -> RecordedJob {
        RecordedJob {
            job: job.into(),
            slot,
            peer: peer.to_string(),
            lease: 1,
            price: 1.0,
            rejoin: false,
        }
    }

    fn round(round: u64, peer: PeerId, job: &str) -> RecordedRound {
        RecordedRound {
            round,
            peer: peer.to_string(),
            job: job.into(),
        }
    }

    /// Resumed from the checkpoint of round 5: the rounds before it that trainers applied are
    /// used; the jobs that go on, and those whose rounds past it may still reach the model,
    /// keep their slices; rounds are open from 5; the data nodes are asked first (a record
    /// that names something else is passed over). Without a checkpoint nothing is kept.
    #[test]
    fn a_run_resumed_from_a_checkpoint_keeps_what_the_model_and_its_jobs_hold() {
        let spec = diloco();
        let (a, b, server) = (PeerId::random(), PeerId::random(), PeerId::random());
        let earlier = RunRecord {
            task: "task".into(),
            // Slot 2 is the parameter server's (workers = 2).
            jobs: vec![job(0, a, "ja"), job(2, server, "js")],
            uncommitted: vec![round(4, a, "ja"), round(5, b, "jb"), round(6, a, "ja")],
            data_nodes: vec![server.to_string(), "not a peer".into()],
            ..RunRecord::default()
        };
        let carried = carried_over(&spec, Some(&earlier), Some(5));
        assert_eq!(carried.committed, vec![(a, "ja".to_string(), 4)]);
        let going_on = [(a, "ja"), (server, "js"), (b, "jb"), (a, "ja")];
        let going_on: Vec<_> = going_on.iter().map(|(p, j)| (*p, j.to_string())).collect();
        assert_eq!(carried.going_on, going_on);
        assert_eq!(carried.open_from, 5);
        assert_eq!(carried.data_nodes, vec![server]);
        let fresh = carried_over(&spec, Some(&earlier), None);
        assert!(fresh.committed.is_empty() && fresh.going_on.is_empty());
        assert_eq!(fresh.open_from, 0);
    }

    /// A DiLoCo trainer or parameter server goes on when the scheduler holds a checkpoint; a
    /// standby does not, nor any job without a checkpoint, nor a plain iteration's.
    #[test]
    fn only_a_diloco_runs_trainers_and_server_go_on_and_only_from_a_checkpoint() {
        let spec = diloco();
        assert!(goes_on(&spec, 0, Some(5)) && goes_on(&spec, 2, Some(5)));
        assert!(!goes_on(&spec, 3, Some(5)), "the standby's slot");
        assert!(!goes_on(&spec, 0, None));
        let plain = JobFile::parse("job.toml", PLAIN).unwrap();
        assert!(!goes_on(&plain, 0, Some(5)));
    }
}
