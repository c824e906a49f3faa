//! The DiLoCo side of a run: the parameter server's statuses and silence, its checkpoints
//! and their standby, failover and promotion, benched trainers.

use libp2p::PeerId;

use super::{
    Internal, JobRun, RunError,
    inbound::{ExecutorAnswer, ExecutorReport, ExecutorStatus},
    rules::{self, Ending, Restart, Silence},
};
use crate::{
    checkpoint::{self, Checkpoints},
    event::Event,
    record::BenchedTrainer,
    rounds::News,
    slots::Role,
    throttle::RECORDED_STATUS_BYTES,
    training::{Answered, Promotion},
};

impl JobRun<'_> {
    /// A parameter server that went quiet may have lost its worker: its lease is renewed now,
    /// or one taken over that has not said which round it is at is replaced from the
    /// checkpoint ([`rules::server_silence`]).
    pub(super) async fn on_server_silence(&mut self) -> Result<(), RunError> {
        let Some(diloco) = &self.diloco else {
            return Ok(());
        };
        let (silent, pending) = (diloco.server_heard.elapsed(), diloco.server_pending);
        let server = self
            .jobs
            .iter()
            .find(|(_, d)| self.slots.role(d.slot) == Role::ParameterServer);
        let Some((job, server)) = server else {
            return Ok(());
        };
        match rules::server_silence(silent, pending) {
            Silence::Wait => Ok(()),
            Silence::Probe => {
                server.lease.probe();
                if let Some(diloco) = self.diloco.as_mut() {
                    diloco.server_heard = std::time::Instant::now();
                }
                Ok(())
            }
            Silence::Replace(reason) => {
                let job = job.clone();
                self.ended(&job, Ending::Failed(reason)).await
            }
        }
    }

    /// An executor's status: a DiLoCo one goes to the training, which says what to answer;
    /// any other is recorded as it came.
    pub(super) async fn on_executor_status(
        &mut self,
        status: ExecutorStatus,
    ) -> Result<(), RunError> {
        let ExecutorStatus {
            peer,
            job,
            report,
            answer,
        } = status;
        // Only the worker running a job speaks for it.
        let Some(dispatched) = self.jobs.get(&job).filter(|d| d.lease.peer == peer) else {
            // A job being taken over waits until it is.
            let _ = answer.send(match (&self.diloco, self.taking_over(peer, &job)) {
                (Some(_), Some(role)) => rules::taking_over_order(role).into(),
                _ => ExecutorAnswer::Received,
            });
            return Ok(());
        };
        if self.slots.role(dispatched.slot) == Role::ParameterServer
            && let Some(diloco) = self.diloco.as_mut()
        {
            diloco.server_heard = std::time::Instant::now();
        }
        let (diloco, status) = match (self.diloco.as_mut(), report) {
            (Some(diloco), ExecutorReport::Diloco(status)) => (diloco, status),
            (_, report) => {
                let _ = answer.send(ExecutorAnswer::Received);
                if self.throttle.records(&job, crate::unix_ms(), false) {
                    let mut payload = report.into_json();
                    let bytes = payload.to_string().len();
                    if bytes > RECORDED_STATUS_BYTES {
                        payload = serde_json::json!({ "too_large_bytes": bytes });
                    }
                    self.events.record(Event::ExecutorStatus { job, payload });
                }
                return Ok(());
            }
        };
        match diloco.training.status(&job, *status).await {
            Answered {
                resumed: Some(Err(reason)),
                order,
                ..
            } => {
                let _ = answer.send(order.into());
                let reason = format!("the parameter server taken over cannot go on: {reason}");
                self.ended(&job, Ending::Failed(reason)).await?;
            }
            answered => {
                if let Some(Ok(unheard)) = answered.resumed {
                    // It goes on: the trainers taken over train on with it, and its
                    // checkpoints up to the round it is at are taken.
                    if let Some(diloco) = self.diloco.as_mut() {
                        diloco.server_pending = false;
                    }
                    if let Some(applied) = unheard {
                        self.events.record(Event::Round {
                            round: applied.round,
                            trainers: applied.included.len(),
                            samples: applied.samples,
                            loss: applied.loss,
                            away: true,
                        });
                    }
                    self.store_record()?;
                    if let Some(diloco) = &self.diloco {
                        diloco.accept_checkpoints_through_training();
                    }
                }
                if answered.applied.is_some() {
                    // Recorded before the server hears its round was taken: only then may it
                    // send the round's checkpoint, which makes the round's slices used.
                    self.store_record()?;
                    if let Some(diloco) = &self.diloco {
                        diloco.accept_checkpoints_through_training();
                    }
                }
                if answered.rejoined {
                    // A restarted scheduler must not tell it to join again (and drop the
                    // round its update may be in).
                    self.store_record()?;
                }
                let _ = answer.send(answered.order.into());
                self.report_news();
                if let Some(applied) = answered.applied {
                    self.events.record(Event::Round {
                        round: applied.round,
                        trainers: applied.included.len(),
                        samples: applied.samples,
                        loss: applied.loss,
                        away: false,
                    });
                    for clipped in &applied.clipped {
                        self.events.record(Event::Clipped {
                            round: applied.round,
                            peer: clipped.peer.clone(),
                            share: clipped.share,
                            ratio: clipped.ratio,
                            reason: clipped.reason.clone(),
                        });
                    }
                    for benching in &applied.benched {
                        self.bench(&benching.peer, applied.round, &benching.reason)
                            .await?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Records what the rounds say happened to the trainers.
    pub(super) fn report_news(&mut self) {
        let Some(diloco) = self.diloco.as_mut() else {
            return;
        };
        for news in diloco.training.take_news() {
            let event = match news {
                News::Waiting {
                    ready,
                    trainers,
                    grace_ms,
                } => Event::WaitingForTrainers {
                    ready,
                    trainers,
                    grace_s: grace_ms as f64 / 1000.0,
                },
                News::Began {
                    round,
                    ready,
                    late,
                    waited_ms,
                } => Event::RoundsBegin {
                    round,
                    trainers: ready,
                    late,
                    waited_s: waited_ms as f64 / 1000.0,
                },
                News::Refused {
                    round,
                    peer,
                    reason,
                } => Event::Refused {
                    round,
                    peer,
                    reason,
                },
                News::Evaluated { peer, eval } => Event::Evaluated {
                    round: eval.round,
                    peer,
                    loss: eval.loss,
                    accuracy: eval.accuracy,
                    scored: eval.scored,
                },
                News::Joined { job, peer, round } => {
                    let Some(slot) = self.jobs.get(&job).map(|d| d.slot) else {
                        continue;
                    };
                    Event::Joined {
                        slot,
                        job,
                        peer,
                        round,
                    }
                }
            };
            self.events.record(event);
        }
    }

    /// The trainer on `peer` is benched: its job ends (its lease and its slices go back), its
    /// slot is given up rather than filled again (a worker that lies in every update would
    /// only be replaced by the next one the market offers; elastic runs may refill it), and
    /// its worker is never leased again for the task, also after a restart.
    pub(super) async fn bench(
        &mut self,
        peer: &str,
        round: u64,
        reason: &str,
    ) -> Result<(), RunError> {
        let Some((job, slot)) = self
            .jobs
            .iter()
            .find(|(_, d)| {
                d.lease.peer.to_string() == peer && self.slots.role(d.slot) == Role::Trainer
            })
            .map(|(job, d)| (job.clone(), d.slot))
        else {
            return Ok(());
        };
        self.events.record(Event::Benched {
            slot,
            job: job.clone(),
            peer: peer.to_string(),
            round,
            reason: reason.to_string(),
        });
        self.benched.push(BenchedTrainer {
            peer: peer.to_string(),
            slot,
            round,
            reason: reason.to_string(),
        });
        self.ended(&job, Ending::Done).await?;
        // Benched slots are given up: with every one of them benched, nobody is left to
        // train and nobody can join (issue 55: such a run waited for ever).
        let trainers = self.slots.count(Role::Trainer);
        if self.benched.len() >= trainers {
            return Err(RunError::EveryTrainerBenched {
                count: self.benched.len(),
                last: format!("{peer} at round {round}: {reason}"),
            });
        }
        Ok(())
    }

    /// The parameter server on `peer` is gone: the next one is restored from the checkpoint
    /// held here, or the run cannot go on ([`rules::restart`]).
    pub(super) fn fail_over(&mut self, peer: PeerId, reason: &str) -> Result<(), RunError> {
        let Some(diloco) = self.diloco.as_mut() else {
            return Ok(());
        };
        let (held, trained) = (diloco.held_round(), diloco.training.round());
        let Some(Restart {
            restore,
            lost_rounds,
        }) = rules::restart(held, trained)
        else {
            return Err(RunError::ServerLost {
                peer: peer.to_string(),
                reason: reason.to_string(),
            });
        };
        diloco.restore = restore;
        self.events.record(Event::Failover {
            peer: peer.to_string(),
            reason: reason.to_string(),
            round: restore.unwrap_or(0),
            lost_rounds,
            standby: None,
        });
        Ok(())
    }

    /// The server's job `lost` on `peer` failed, and its standby takes over at the round it
    /// holds: its job moves into the server's slot, the trainers join it, and a new standby
    /// is leased. The rounds after that one are lost; those before wait for its checkpoints.
    pub(super) fn promote(
        &mut self,
        lost: &str,
        peer: PeerId,
        reason: &str,
        promotion: Promotion,
    ) -> Result<(), RunError> {
        let trained = self.diloco.as_ref().map_or(0, |d| d.training.round());
        if !self.slots.promote(lost, &promotion.job) {
            return Err(RunError::ServerLost {
                peer: peer.to_string(),
                reason: format!("{reason}; its standby could not take its slot"),
            });
        }
        if let (Some(slot), Some(dispatched)) = (
            self.slots.slot_of(&promotion.job),
            self.jobs.get_mut(&promotion.job),
        ) {
            dispatched.slot = slot;
        }
        if let Some(diloco) = self.diloco.as_mut() {
            diloco.training.promote(&promotion);
            if let Some(checkpoints) = &diloco.checkpoints {
                checkpoints.accept_from(Some(promotion.peer));
            }
            diloco.server_heard = std::time::Instant::now();
        }
        self.events.record(Event::Failover {
            peer: peer.to_string(),
            reason: reason.to_string(),
            round: promotion.round,
            lost_rounds: trained.saturating_sub(promotion.round),
            standby: Some(promotion.peer.to_string()),
        });
        self.task_peers_changed();
        self.store_record()?;
        self.allocate_next();
        Ok(())
    }

    pub(super) async fn checkpoint_stored(
        &mut self,
        round: u64,
        bytes: u64,
    ) -> Result<(), RunError> {
        if let Some(diloco) = self.diloco.as_mut() {
            diloco.training.checkpoint_stored(round, bytes).await;
            self.store_record()?;
        }
        self.forward_checkpoint();
        Ok(())
    }

    /// Sends the newest checkpoint held to the standby, if one runs: one at a time, the
    /// newest again when one was stored meanwhile. Over this scheduler's link, not the
    /// server's.
    pub(super) fn forward_checkpoint(&mut self) {
        let Some(diloco) = self.diloco.as_mut() else {
            return;
        };
        if !diloco.forwarding.stored() {
            return;
        }
        let standby = self
            .jobs
            .values()
            .find(|d| self.slots.role(d.slot) == Role::Standby)
            .map(|d| d.lease.peer);
        let (Some(peer), Some((round, file))) = (
            standby,
            diloco.checkpoints.as_ref().and_then(Checkpoints::open),
        ) else {
            return;
        };
        diloco.forwarding.sending();
        let network = self.network.clone();
        let task = self.task.clone();
        self.tasks.spawn(async move {
            let result = checkpoint::send(&network, peer, task, file)
                .await
                .map(drop)
                .map_err(|e| e.to_string());
            Internal::Forwarded { round, result }
        });
    }
}
