//! What an earlier process of the scheduler left of a run it was killed in: its record and
//! checkpoint, what the run's data carries over from it, which of its jobs go on, and the
//! leases of its jobs taken over.

use std::{collections::HashSet, path::Path};

use hypha_messages::iterate::RunProgress;
use libp2p::PeerId;

use super::error::RunError;
use crate::{
    allocator::Lease,
    checkpoint,
    data::CarriedOver,
    record::{BenchedTrainer, RecordedJob, RunRecord},
    slots::{SlotState, Slots},
    spec::JobFile,
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

/// How a run resumed from an earlier process's record begins: from the checkpoint of
/// `round` (none: no job goes on), with the history so far, the trainers the earlier run
/// benched kept out, and the leases of the earlier run's jobs to take over.
pub(super) struct Resumption {
    pub(super) round: Option<u64>,
    pub(super) history: RunProgress,
    pub(super) benched: Vec<BenchedTrainer>,
    pub(super) takeovers: Vec<Takeover>,
}

/// The lease of the earlier run's job `recorded` on `peer`, to take over.
pub(super) struct Takeover {
    pub(super) recorded: RecordedJob,
    pub(super) peer: PeerId,
    /// The job goes on if it still runs ([`goes_on`]).
    pub(super) may_go_on: bool,
}

impl Resumption {
    /// The resumption of `earlier` from the checkpoint of `round`, into a run of `spec` whose
    /// fresh `slots` say which slots there are. A recorded job is taken over when its slot is
    /// one of them, not a benched trainer's, and not already another recorded job's (the
    /// first one recorded keeps it), and its peer is a peer id.
    pub(super) fn of(
        spec: &JobFile,
        slots: &Slots,
        earlier: RunRecord,
        round: Option<u64>,
    ) -> Self {
        let mut taken: HashSet<usize> = earlier.benched.iter().map(|b| b.slot).collect();
        let mut takeovers = Vec::new();
        for recorded in earlier.jobs {
            let Ok(peer) = recorded.peer.parse::<PeerId>() else {
                continue;
            };
            if slots.state(recorded.slot) == Some(&SlotState::Wanted) && taken.insert(recorded.slot)
            {
                takeovers.push(Takeover {
                    peer,
                    may_go_on: goes_on(spec, recorded.slot, round),
                    recorded,
                });
            }
        }
        Self {
            round,
            history: earlier.history,
            benched: earlier.benched,
            takeovers,
        }
    }

    /// Whether the earlier run's parameter server, in `server_slot`, may go on: until it is
    /// known whether it does, trainers taken over wait.
    pub(super) fn server_may_go_on(&self, server_slot: usize) -> bool {
        (self.takeovers.iter()).any(|t| t.recorded.slot == server_slot && t.may_go_on)
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
    pub(super) slot: usize,
    pub(super) peer: PeerId,
    pub(super) job: String,
    pub(super) lease: Result<Box<Lease>, String>,
    pub(super) going_on: bool,
    /// A trainer the earlier run had not yet told to join its server.
    pub(super) rejoin: bool,
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use libp2p::PeerId;

    use super::{Resumption, carried_over, goes_on};
    use crate::{
        record::{BenchedTrainer, RecordedJob, RecordedRound, RunRecord},
        slots::Slots,
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

    /// Resumed from the checkpoint of round 5 into a run of two trainers and a server: the
    /// leases taken over are those of jobs in the run's slots, one a slot (the first
    /// recorded), none of a benched trainer's slot or a peer that is no peer id; the server
    /// and the trainer may go on. Without a checkpoint the same leases are taken over, and
    /// no job goes on.
    #[test]
    fn a_resumption_takes_over_one_lease_a_slot_and_lets_jobs_go_on_from_a_checkpoint() {
        let spec = diloco();
        let slots = Slots::new((2, 2), (true, false), 3);
        let (a, b, c, server) = (
            PeerId::random(),
            PeerId::random(),
            PeerId::random(),
            PeerId::random(),
        );
        let mut unreadable = job(0, a, "j0");
        unreadable.peer = "not a peer".into();
        let earlier = RunRecord {
            task: "task".into(),
            jobs: vec![
                unreadable,
                job(0, a, "ja"),
                job(0, c, "jc"),
                job(1, b, "jb"),
                job(2, server, "js"),
                job(3, c, "beyond the slots"),
            ],
            benched: vec![BenchedTrainer {
                peer: b.to_string(),
                slot: 1,
                round: 3,
                reason: "refused".into(),
            }],
            ..RunRecord::default()
        };
        let resumed = Resumption::of(&spec, &slots, earlier.clone(), Some(5));
        let taken: Vec<_> = (resumed.takeovers.iter())
            .map(|t| (t.recorded.job.as_str(), t.peer, t.may_go_on))
            .collect();
        assert_eq!(taken, vec![("ja", a, true), ("js", server, true)]);
        assert!(resumed.server_may_go_on(2));
        assert_eq!((resumed.round, resumed.benched.len()), (Some(5), 1));

        let fresh = Resumption::of(&spec, &slots, earlier, None);
        assert_eq!(fresh.takeovers.len(), 2);
        assert!(fresh.takeovers.iter().all(|t| !t.may_go_on));
        assert!(!fresh.server_may_go_on(2));
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
