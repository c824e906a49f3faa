//! The run's decisions that need no I/O, as [`rounds`](crate::rounds) and
//! [`slots`](crate::slots) are: how a job's status ends it, what a job's end means for its
//! slot and the run, when a silent parameter server is probed or replaced, where a
//! replacement for a lost server starts, what a job being taken over is told, and checkpoints
//! on their way to the standby.
//!
//! `JobRun` gathers the facts (from its slots, training, data and clock) and performs what
//! these rules say; it holds no rule of its own that these tests do not pin.

use std::time::Duration;

use hypha_messages::{diloco::Order, job::JobStatus};

use crate::{
    event::with_stderr,
    record::BenchedTrainer,
    slots::Role,
    training::{Promotion, Training},
};

/// How long the parameter server may say nothing (it reports every quarter second) before
/// its lease is renewed at once to learn whether its worker is still there.
pub(super) const SERVER_SILENCE: Duration = Duration::from_secs(1);

/// How long a parameter server taken over after a restart has to send its first status
/// (it reports four times a second).
pub(super) const FIRST_STATUS_PATIENCE: Duration = Duration::from_secs(10);

/// How a job ended.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Ending {
    /// Its share of the work is done: its executor exited with code 0, or the run let it go
    /// (a benched trainer).
    Done,
    /// It failed, or its worker was lost: why, for the events and the run's error.
    Failed(String),
}

/// How the job whose worker reports `status` ended, or `None` while it runs.
pub(super) fn ending(status: &JobStatus) -> Option<Ending> {
    match status {
        JobStatus::Running => None,
        JobStatus::Finished { exit_code: 0, .. } => Some(Ending::Done),
        JobStatus::Finished {
            exit_code,
            stderr_tail,
        } => Some(Ending::Failed(with_stderr(
            format!("exit code {exit_code}"),
            stderr_tail,
        ))),
        JobStatus::Failed {
            reason,
            stderr_tail,
        } => Some(Ending::Failed(with_stderr(reason.clone(), stderr_tail))),
    }
}

/// What is known of a job that ended, for [`after_end`].
#[derive(Debug)]
pub(super) struct Ended {
    pub(super) ending: Ending,
    /// It was the run's parameter server.
    pub(super) server: bool,
    /// The standby that can take over from it (a failed server's only).
    pub(super) promotion: Option<Promotion>,
    /// The run takes trainers as they come (`workers.max` above `min`).
    pub(super) elastic: bool,
    /// The run has training or data that a worker's job could still be doing.
    pub(super) has_work: bool,
    /// That work is done: training ended, or the data is used up.
    pub(super) work_done: bool,
}

/// What the run does with the slot of a job that ended.
#[derive(Debug, PartialEq)]
pub(super) enum AfterEnd {
    /// The slot is done. `close`: no worker that joins now would have anything to do, so
    /// the slots still wanting one (an elastic run's, a standby's whose last one took over)
    /// want none.
    Done { close: bool },
    /// The failed server's standby takes its place.
    Promote {
        promotion: Promotion,
        reason: String,
    },
    /// The slot wants another worker, as the slots' verdict on its attempts says.
    /// `fail_over`: it was the parameter server, and the next one is restored from the
    /// checkpoint held ([`restart`]).
    Replace { reason: String, fail_over: bool },
    /// The job failed, but the work is done: nobody replaces it, and no slot wants a worker.
    Close,
}

/// What the run does once a job ended.
///
/// A job that is done closes the run to joiners when nothing is left for them: in an
/// elastic run, or when it was the server (its end ended the training). A failed server is
/// replaced, by its standby where that holds a round the run reached, otherwise from the
/// checkpoint, even when the training is done (the trainers still finishing need it); any
/// other failed job is replaced only while work is left.
pub(super) fn after_end(ended: Ended) -> AfterEnd {
    let nothing_left = !ended.has_work || ended.work_done;
    match ended.ending {
        Ending::Done => AfterEnd::Done {
            close: (ended.elastic || ended.server) && nothing_left,
        },
        Ending::Failed(reason) if ended.server => match ended.promotion {
            Some(promotion) => AfterEnd::Promote { promotion, reason },
            None => AfterEnd::Replace {
                reason,
                fail_over: true,
            },
        },
        Ending::Failed(_) if ended.work_done => AfterEnd::Close,
        Ending::Failed(reason) => AfterEnd::Replace {
            reason,
            fail_over: false,
        },
    }
}

/// Where the next parameter server starts after one was lost without a standby to take over.
#[derive(Debug, PartialEq)]
pub(super) struct Restart {
    /// The round of the checkpoint it is restored from; none: it starts afresh.
    pub(super) restore: Option<u64>,
    /// The rounds the lost server had trained past that checkpoint.
    pub(super) lost_rounds: u64,
}

/// Where the next server starts when the lost one had trained `trained` rounds and the
/// scheduler holds the checkpoint of round `held`: from that checkpoint, or afresh when no
/// round was trained. `None` when rounds were trained and no checkpoint of them reached the
/// scheduler: the run cannot go on with the model it trained.
pub(super) fn restart(held: Option<u64>, trained: u64) -> Option<Restart> {
    if held.is_none() && trained > 0 {
        return None;
    }
    Some(Restart {
        restore: held,
        lost_rounds: trained.saturating_sub(held.unwrap_or(0)),
    })
}

/// What the run does about a parameter server it has not heard from for a while.
#[derive(Debug, PartialEq)]
pub(super) enum Silence {
    /// Nothing yet.
    Wait,
    /// Renew its lease now, to learn whether its worker is still there: a worker that is
    /// gone is then replaced within seconds, not a lease period.
    Probe,
    /// Replace it (why): it was taken over after a restart and has not said which round it
    /// is at within [`FIRST_STATUS_PATIENCE`]; the trainers wait for it.
    Replace(String),
}

/// What to do about the parameter server silent for `silent`; `taken_over`: it is the
/// earlier process's, and its first status has not come yet.
pub(super) fn server_silence(silent: Duration, taken_over: bool) -> Silence {
    match (silent, taken_over) {
        (silent, _) if silent < SERVER_SILENCE => Silence::Wait,
        (silent, true) if silent >= FIRST_STATUS_PATIENCE => Silence::Replace(format!(
            "the parameter server taken over sent no status within {} s",
            FIRST_STATUS_PATIENCE.as_secs()
        )),
        // Its lease is being taken over, which is its probe.
        (_, true) => Silence::Wait,
        (_, false) => Silence::Probe,
    }
}

/// What a job of the earlier run in `role` is told while its lease is taken over: to wait.
pub(super) fn taking_over_order(role: Role) -> Order {
    match role {
        Role::Trainer => Training::wait_order(),
        Role::ParameterServer => Training::server_wait_order(),
        Role::Standby => Training::standby_wait_order(),
    }
}

/// How a DiLoCo run that succeeded says so: how many trainers finished, and each one benched,
/// at which round and why. A run that lost trainers does not end with the same words as one
/// that kept them all (issue 55: a run with two of its three trainers benched at round 649
/// said "3 trainers and the parameter server finished").
pub(super) fn done_message(trainers: usize, benched: &[BenchedTrainer]) -> String {
    let mut message = format!("{trainers} trainers and the parameter server finished");
    if benched.is_empty() {
        message.push_str("; every trainer stayed to the end");
        return message;
    }
    message.push_str(&format!("; {} benched:", benched.len()));
    for (i, trainer) in benched.iter().enumerate() {
        let separator = if i == 0 { " " } else { "; " };
        message.push_str(&format!(
            "{separator}{} at round {}: {}",
            trainer.peer, trainer.round, trainer.reason
        ));
    }
    message
}

/// Checkpoints on their way to the standby: one at a time, and when others were stored
/// while one was on its way, the newest of them once it arrived (not each of them).
#[derive(Debug, Default)]
pub(super) struct Forwarding {
    sending: bool,
    again: bool,
}

impl Forwarding {
    /// A newer checkpoint is held: whether to send it now. When one is on its way, it is
    /// sent once that one arrived ([`Forwarding::arrived`]).
    pub(super) fn stored(&mut self) -> bool {
        if self.sending {
            self.again = true;
        }
        !self.sending
    }

    /// A checkpoint is on its way.
    pub(super) fn sending(&mut self) {
        self.sending = true;
    }

    /// The one on its way arrived (or could not): whether to send the newest now.
    pub(super) fn arrived(&mut self) -> bool {
        self.sending = false;
        std::mem::take(&mut self.again)
    }
}

#[cfg(test)]
mod tests {
    use hypha_messages::diloco::{ServerOrder, TrainerOrder};
    use libp2p::PeerId;

    use super::*;

    /// Issue 55, item 4: the end of a run says who was benched, when and why.
    #[test]
    fn a_run_that_lost_trainers_does_not_end_in_the_same_words() {
        let kept = done_message(3, &[]);
        assert_eq!(
            kept,
            "3 trainers and the parameter server finished; every trainer stayed to the end"
        );
        let benched = BenchedTrainer {
            peer: "12D3KooW".into(),
            slot: 1,
            round: 649,
            reason: "its updates were refused 3 rounds in a row".into(),
        };
        let lost = done_message(3, std::slice::from_ref(&benched));
        assert_eq!(
            lost,
            "3 trainers and the parameter server finished; 1 benched: 12D3KooW at round 649: its updates were refused 3 rounds in a row"
        );
    }

    fn failed(reason: &str) -> Ending {
        Ending::Failed(reason.into())
    }

    /// A trainer's job of a run with work left.
    fn trainer(ending: Ending) -> Ended {
        Ended {
            ending,
            server: false,
            promotion: None,
            elastic: false,
            has_work: true,
            work_done: false,
        }
    }

    fn standby() -> Promotion {
        Promotion {
            job: "standby".into(),
            peer: PeerId::random(),
            round: 7,
        }
    }

    /// Exit code 0 is done, any other code or a failure is failed with the stderr's last
    /// lines; a running job has not ended.
    #[test]
    fn a_status_ends_a_job_unless_it_runs_and_only_exit_code_zero_is_done() {
        assert_eq!(ending(&JobStatus::Running), None);
        let exit = |exit_code, stderr_tail: &[&str]| JobStatus::Finished {
            exit_code,
            stderr_tail: stderr_tail.iter().map(|l| l.to_string()).collect(),
        };
        assert_eq!(ending(&exit(0, &[])), Some(Ending::Done));
        let Some(Ending::Failed(reason)) = ending(&exit(3, &["Traceback", "ValueError: x"])) else {
            panic!("exit code 3 is a failure");
        };
        assert!(reason.starts_with("exit code 3"), "{reason}");
        assert!(reason.contains("ValueError: x"), "{reason}");
        let killed = JobStatus::Failed {
            reason: "killed by signal 9".into(),
            stderr_tail: Vec::new(),
        };
        assert_eq!(ending(&killed), Some(failed("killed by signal 9")));
    }

    /// A trainer that finished in a run of fixed size leaves the others to finish theirs; in
    /// an elastic run its end closes the run to joiners once the work is done, not before.
    #[test]
    fn a_finished_job_closes_the_run_to_joiners_only_when_nothing_is_left_for_them() {
        assert_eq!(
            after_end(trainer(Ending::Done)),
            AfterEnd::Done { close: false }
        );
        let fixed_done = Ended {
            work_done: true,
            ..trainer(Ending::Done)
        };
        assert_eq!(after_end(fixed_done), AfterEnd::Done { close: false });
        let elastic = |work_done| Ended {
            elastic: true,
            work_done,
            ..trainer(Ending::Done)
        };
        assert_eq!(after_end(elastic(false)), AfterEnd::Done { close: false });
        assert_eq!(after_end(elastic(true)), AfterEnd::Done { close: true });
        // An elastic run of a plain executor (no data, no training): nothing to join for.
        let no_work = Ended {
            elastic: true,
            has_work: false,
            ..trainer(Ending::Done)
        };
        assert_eq!(after_end(no_work), AfterEnd::Done { close: true });
    }

    /// The parameter server that finished ended the training: a standby's slot waiting for a
    /// worker (its last one took over) wants none.
    #[test]
    fn the_server_finishing_ends_the_training_for_every_slot() {
        let server = Ended {
            server: true,
            work_done: true,
            ..trainer(Ending::Done)
        };
        assert_eq!(after_end(server), AfterEnd::Done { close: true });
    }

    /// A failed server's standby takes over where it can; otherwise the server is failed over
    /// to a new one, also when the training is done (trainers still finishing need it).
    #[test]
    fn a_failed_server_is_promoted_from_its_standby_or_failed_over() {
        let promotion = standby();
        let with_standby = Ended {
            server: true,
            promotion: Some(promotion.clone()),
            ..trainer(failed("lease lapsed"))
        };
        assert_eq!(
            after_end(with_standby),
            AfterEnd::Promote {
                promotion,
                reason: "lease lapsed".into()
            }
        );
        let alone = Ended {
            server: true,
            work_done: true,
            ..trainer(failed("exit code 1"))
        };
        assert_eq!(
            after_end(alone),
            AfterEnd::Replace {
                reason: "exit code 1".into(),
                fail_over: true
            }
        );
    }

    /// A failed trainer is replaced while work is left, and not once it is done; a run
    /// without data or training replaces its failed jobs (it cannot know its work is done).
    #[test]
    fn a_failed_worker_is_replaced_only_while_work_is_left() {
        let replace = AfterEnd::Replace {
            reason: "worker lost".into(),
            fail_over: false,
        };
        assert_eq!(after_end(trainer(failed("worker lost"))), replace);
        let done = Ended {
            work_done: true,
            ..trainer(failed("worker lost"))
        };
        assert_eq!(after_end(done), AfterEnd::Close);
        let plain = Ended {
            has_work: false,
            ..trainer(failed("worker lost"))
        };
        assert_eq!(after_end(plain), replace);
    }

    /// A lost server restarts from the checkpoint held, losing the rounds past it; afresh
    /// when no round was trained; not at all when rounds were trained and none reached the
    /// scheduler.
    #[test]
    fn a_lost_server_restarts_from_the_checkpoint_or_the_run_cannot_go_on() {
        assert_eq!(
            restart(Some(4), 6),
            Some(Restart {
                restore: Some(4),
                lost_rounds: 2
            })
        );
        assert_eq!(
            restart(None, 0),
            Some(Restart {
                restore: None,
                lost_rounds: 0
            })
        );
        assert_eq!(restart(None, 3), None);
    }

    /// A silent server is probed after [`SERVER_SILENCE`]; one taken over is not (its lease
    /// is being taken over), and is replaced after [`FIRST_STATUS_PATIENCE`].
    #[test]
    fn a_silent_server_is_probed_and_one_taken_over_replaced_after_its_patience() {
        let ms = Duration::from_millis;
        assert_eq!(server_silence(ms(900), false), Silence::Wait);
        assert_eq!(server_silence(SERVER_SILENCE, false), Silence::Probe);
        assert_eq!(server_silence(ms(60_000), false), Silence::Probe);
        assert_eq!(server_silence(ms(5_000), true), Silence::Wait);
        let Silence::Replace(reason) = server_silence(FIRST_STATUS_PATIENCE, true) else {
            panic!("the server taken over had its patience");
        };
        assert!(reason.contains("sent no status within 10 s"), "{reason}");
    }

    /// A trainer being taken over is told to ask again shortly, a server to go on collecting.
    #[test]
    fn a_job_being_taken_over_is_told_to_wait() {
        assert!(matches!(
            taking_over_order(Role::Trainer),
            Order::Trainer(TrainerOrder::Wait { retry_ms, .. }) if retry_ms > 0
        ));
        assert!(matches!(
            taking_over_order(Role::ParameterServer),
            Order::ParameterServer(ServerOrder::Wait)
        ));
    }

    /// Checkpoints stored while one is on its way to the standby are sent once, after it.
    #[test]
    fn checkpoints_go_to_the_standby_one_at_a_time_the_newest_after() {
        let mut forwarding = Forwarding::default();
        assert!(forwarding.stored());
        forwarding.sending();
        assert!(!forwarding.stored());
        assert!(!forwarding.stored());
        assert!(forwarding.arrived(), "the newest goes after");
        forwarding.sending();
        assert!(!forwarding.arrived(), "none was stored meanwhile");
        assert!(forwarding.stored());
    }
}
