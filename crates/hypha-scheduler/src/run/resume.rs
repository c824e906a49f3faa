//! A run resumed after its scheduler was killed: the leases and jobs of the earlier process
//! taken over.

use hypha_messages::Request;
use libp2p::PeerId;

use super::{
    Dispatched, Internal, JobRun, RunError,
    earlier::{Adoption, Resumption, Takeover, goes_on},
};
use crate::{allocator::Lease, event::Event, slots::Role};

impl JobRun<'_> {
    /// Takes over what the earlier run of this job left ([`Resumption`]): the lease of each
    /// job it ran, with the job itself where it still runs and may go on (a new job in the
    /// same slot otherwise, the old one stopped), and for a parameter server that does not
    /// go on the checkpoint of its round.
    pub(super) async fn resume(&mut self, resumption: Resumption) {
        let server_slot = self.spec.workers.max;
        let server_may_go_on = resumption.server_may_go_on(server_slot);
        let Resumption {
            round,
            history,
            benched,
            takeovers,
        } = resumption;
        if let Some(diloco) = self.diloco.as_mut() {
            diloco.restore = round;
            diloco.server_pending = server_may_go_on;
            if let (Some(checkpoints), Some(round)) = (&diloco.checkpoints, round) {
                checkpoints.accept_up_to(round);
            }
        }
        self.events.begin(&self.task, history);
        for benched in &benched {
            self.slots.give_up(benched.slot);
        }
        self.benched = benched;
        self.events.record(Event::Resumed {
            task: self.task.clone(),
            round,
            jobs: takeovers.len(),
        });
        for takeover in takeovers {
            self.take_over_lease(takeover, server_slot);
        }
        if let Some(diloco) = self.diloco.as_mut()
            && !diloco.server_pending
        {
            // No server to go on: the rounds it applied past the checkpoint are gone.
            diloco.training.rounds_lost().await;
        }
    }

    /// Starts taking over the lease of the earlier run's job in `takeover`: its slot waits
    /// meanwhile, and a job that may go on is counted live (its prefetcher keeps asking).
    fn take_over_lease(&mut self, takeover: Takeover, server_slot: usize) {
        let Takeover {
            recorded,
            peer,
            may_go_on,
        } = takeover;
        self.slots.adopting(recorded.slot);
        // Kept in the record until taken over: a scheduler killed again meanwhile takes it
        // over then.
        self.adopting.push(recorded.clone());
        if may_go_on {
            self.live.insert(peer, &recorded.job);
            if let Some(diloco) = self.diloco.as_mut()
                && recorded.slot != server_slot
            {
                diloco.training.taking_over(peer);
            }
        }
        let allocator = self.allocator.clone();
        let network = self.network.clone();
        let lost = self.lost.clone();
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
                // Its executor works on a state this run does not have (or is gone): a new
                // job starts.
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

    /// A lease of the earlier run was taken over, or could not be: its job goes on, or a new
    /// one starts in its slot. Trainers wait while it is not known whether the earlier
    /// parameter server goes on.
    pub(super) async fn adopted(&mut self, mut adoption: Adoption) -> Result<(), RunError> {
        let role = self.slots.role(adoption.slot);
        if role == Role::Trainer && self.server_pending() {
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
            if let Some(diloco) = self.diloco.as_mut() {
                diloco.training.takeover_ended(peer);
            }
            self.live.remove(peer, &job);
            self.ended_early.retain(|(_, report)| report.job != job);
            // The earlier run's job is stopped (or its lease is gone): what it held goes back.
            self.release_data(peer, &job).await;
            if role == Role::ParameterServer
                && let Some(diloco) = self.diloco.as_mut()
                && diloco.server_pending
            {
                // The rounds it applied past the checkpoint are gone with it: a new server is
                // restored from the checkpoint, as after any failover.
                diloco.server_pending = false;
                let trained = diloco.training.round();
                diloco.training.rounds_lost().await;
                let round = diloco.restore.unwrap_or(0);
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
        if let Some(diloco) = self.diloco.as_mut() {
            let training = &mut diloco.training;
            match role {
                Role::Trainer => training.trainer_taken_over(&job, peer, rejoin),
                // A standby does not go on ([`goes_on`]): a new one follows the server.
                Role::Standby => {}
                Role::ParameterServer => {
                    training.server_taken_over(&job, peer);
                    diloco.server_heard = std::time::Instant::now();
                    if let Some(checkpoints) = &diloco.checkpoints {
                        checkpoints.accept_from(Some(peer));
                        // Those of the rounds recorded applied (the last one, of a server
                        // that finished, comes without another status).
                        if let Some(round) = diloco.training.recorded_through() {
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
                    && goes_on(
                        self.spec,
                        recorded.slot,
                        self.diloco.as_ref().and_then(|d| d.restore),
                    )
            })
            .map(|recorded| self.slots.role(recorded.slot))
    }
}
