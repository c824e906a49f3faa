//! What an earlier process of the scheduler left of a run it was killed in: its record and
//! checkpoint, what the run's data carries over from it, which of its jobs go on, and the
//! leases of its jobs taken over.

use std::path::Path;

use libp2p::PeerId;

use super::error::RunError;
use crate::{allocator::Lease, checkpoint, data::CarriedOver, record::RunRecord, spec::JobFile};

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
