//! The parameter server's loop as rules, without I/O: when it asks the scheduler, what it
//! does with each answer, what each round moved, when it checkpoints, and when the
//! scheduler hears of a round ([`STANDBY_HEAD_START`]). [`ServerJob`](super::ServerJob) is the
//! actor: it turns what happens (a file taken, the report tick, the standby's transfer
//! ending, the scheduler's answer, what an effect did) into [`Event`]s and carries out the
//! [`Effect`]s that [`Loop::apply`] returns, in order.

use hypha_messages::diloco::{Applied, Late, ServerOrder};
use tokio::time::Instant;

use super::{STANDBY_HEAD_START, checkpoints::Cadence};

/// What the loop knows between events.
#[derive(Debug)]
pub(super) struct Loop {
    cadence: Cadence,
    /// Updates for closed rounds, for the next status.
    dropped: Vec<Late>,
    /// The last round the scheduler may hear of, in every status until the next.
    applied: Option<Applied>,
    /// A checkpoint holds a round the scheduler heard of: it goes to the scheduler once the
    /// scheduler answered that status. A scheduler that holds the checkpoint then knows whose
    /// slices the round used, even if it was restarted in between.
    announce: bool,
    /// The DiLoCo bytes of the round being collected, for its `Applied`.
    round_traffic: u64,
    /// Bytes sent to the standby since the last round ended, for the next `Applied`.
    standby_traffic: u64,
    /// The round just ended, until the standby holds it or its head start passed.
    announcing: Option<Announcing>,
    /// The round whose close was put off once to take the files that waited.
    asked_again: Option<u64>,
    /// The trainers to send the model a close goes on with once the waiting files are taken.
    closing: Option<Vec<String>>,
}

/// A round the server applied, not yet said to the scheduler: it waits until the standby
/// holds the round's model or [`STANDBY_HEAD_START`] passed, as the trainers' copies do. A
/// round the scheduler hears was applied is then on the standby too, and a failover right
/// after it loses nothing.
#[derive(Debug)]
struct Announcing {
    applied: Applied,
    /// A checkpoint of the round was written: it goes to the scheduler after the round.
    checkpointed: bool,
    until: Instant,
}

/// What happened, as the actor tells the loop.
#[derive(Debug)]
pub(super) enum Event {
    /// A file was taken from the inbox: it and any answer put `bytes` on the link, and it
    /// was `dropped`, an update for a round already closed.
    Took { bytes: u64, dropped: Option<Late> },
    /// The report interval passed.
    Tick,
    /// The round announcing may be said: the standby holds it, or its head start passed.
    Held,
    /// The scheduler answered the last status (`None`: it did not), while the server held
    /// the model of `round`.
    Answered {
        order: Option<ServerOrder>,
        round: Option<u64>,
    },
    /// Before a close, the trainers' files that waited were taken: the bytes they moved
    /// (`None` when none waited), and the updates among them for rounds already closed.
    TookWaiting {
        bytes: Option<u64>,
        dropped: Vec<Late>,
    },
    /// The model went to trainers the scheduler named: the bytes.
    SentToTrainers(u64),
    /// The model went to the standby outside a round's end: the bytes.
    SentToStandby(u64),
    /// The round ended, closed or skipped: what was applied, and the bytes its ending sent
    /// to the trainers and to the standby (`has_standby`: there is one).
    Ended {
        applied: Applied,
        sent: u64,
        to_standby: u64,
        has_standby: bool,
    },
    /// A checkpoint of `size` bytes was written.
    Checkpointed(u64),
    /// The initial model was adopted, and a checkpoint of it of this size written (`None`:
    /// the model was refused, or its checkpoint failed).
    Adopted(Option<u64>),
}

/// What the actor does, in the order given.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Effect {
    /// Tell the scheduler how things stand, with these updates dropped and this round
    /// applied, and bring its answer back ([`Event::Answered`]).
    Ask {
        dropped: Vec<Late>,
        applied: Option<Applied>,
    },
    /// Push the newest checkpoint to the scheduler.
    Upload,
    /// Take the trainers' files that wait in the inbox now ([`Event::TookWaiting`]).
    TakeWaiting,
    /// Close the round and send the new model to these trainers ([`Event::Ended`]).
    Close(Vec<String>),
    /// End the round without a change and send the model to these trainers.
    Skip(Vec<String>),
    /// Take updates from these trainers, and send the model to those named since they
    /// offered ([`Event::SentToTrainers`]).
    NameTrainers(Vec<String>),
    /// Adopt the initial model this trainer offered ([`Event::Adopted`]), and send it to the
    /// standby ([`Event::SentToStandby`]).
    Adopt(String),
    /// Send every round's model to this standby from now on ([`Event::SentToStandby`]).
    Standby(Option<String>),
    /// Write a checkpoint ([`Event::Checkpointed`]).
    Checkpoint,
    /// Write the final model, see the last checkpoint to the scheduler, and end.
    Finish,
}

impl Loop {
    /// `cadence`: when to checkpoint, from the checkpoint the server started with.
    pub(super) fn new(cadence: Cadence) -> Self {
        Loop {
            cadence,
            dropped: Vec::new(),
            applied: None,
            announce: false,
            round_traffic: 0,
            standby_traffic: 0,
            announcing: None,
            asked_again: None,
            closing: None,
        }
    }

    /// Until when the round just ended waits for the standby; `None` while none waits.
    pub(super) fn announcing_until(&self) -> Option<Instant> {
        self.announcing.as_ref().map(|a| a.until)
    }

    pub(super) fn apply(&mut self, event: Event, now: Instant) -> Vec<Effect> {
        match event {
            Event::Took { bytes, dropped } => {
                self.moved(bytes);
                self.dropped.extend(dropped);
                vec![self.ask()]
            }
            Event::Tick => vec![self.ask()],
            Event::Held => {
                if let Some(held) = self.announcing.take() {
                    self.applied = Some(held.applied);
                    self.announce |= held.checkpointed;
                }
                vec![self.ask()]
            }
            Event::Answered { order, round } => self.answered(order, round),
            Event::TookWaiting {
                bytes: Some(bytes),
                dropped,
            } => {
                // They may be updates of the round: the scheduler is asked again with them.
                self.closing = None;
                self.moved(bytes);
                self.dropped.extend(dropped);
                vec![self.ask()]
            }
            Event::TookWaiting { bytes: None, .. } => {
                self.closing.take().map(Effect::Close).into_iter().collect()
            }
            Event::SentToTrainers(bytes) => {
                self.moved(bytes);
                vec![]
            }
            Event::SentToStandby(bytes) => {
                self.standby_traffic += bytes;
                vec![]
            }
            Event::Ended {
                applied,
                sent,
                to_standby,
                has_standby,
            } => self.ended(applied, sent, to_standby, has_standby, now),
            Event::Checkpointed(size) => {
                self.cadence.written(size);
                vec![]
            }
            Event::Adopted(Some(size)) => {
                self.cadence.written(size);
                vec![Effect::Upload]
            }
            Event::Adopted(None) => vec![],
        }
    }

    fn moved(&mut self, bytes: u64) {
        self.cadence.moved(bytes);
        self.round_traffic += bytes;
    }

    fn ask(&mut self) -> Effect {
        Effect::Ask {
            dropped: std::mem::take(&mut self.dropped),
            applied: self.applied.clone(),
        }
    }

    fn answered(&mut self, order: Option<ServerOrder>, round: Option<u64>) -> Vec<Effect> {
        let mut effects = Vec::new();
        if order.is_some() && std::mem::take(&mut self.announce) {
            effects.push(Effect::Upload);
        }
        match order {
            Some(ServerOrder::Wait) | None => {}
            // Updates that came in while the scheduler answered are taken first, and the
            // scheduler asked again with them: a round closes with every update at the server
            // when it is told to close. A trainer told to stop sends its update and then ends,
            // so the update is here before the scheduler can hear of the end and stop waiting
            // for it. Once a round: a peer that keeps sending holds no close up.
            Some(ServerOrder::Close {
                round: closing,
                send_to,
            }) if round == Some(closing) => {
                if self.asked_again == Some(closing) {
                    effects.push(Effect::Close(send_to));
                } else {
                    self.asked_again = Some(closing);
                    self.closing = Some(send_to);
                    effects.push(Effect::TakeWaiting);
                }
            }
            Some(ServerOrder::Skip {
                round: skipping,
                send_to,
            }) if round == Some(skipping) => effects.push(Effect::Skip(send_to)),
            // A close or skip of a round this server is not in (it ended meanwhile).
            Some(ServerOrder::Close { .. } | ServerOrder::Skip { .. }) => {}
            Some(ServerOrder::Trainers { peers }) => effects.push(Effect::NameTrainers(peers)),
            Some(ServerOrder::Adopt { from }) => effects.push(Effect::Adopt(from)),
            Some(ServerOrder::Standby { peer }) => effects.push(Effect::Standby(peer)),
            Some(ServerOrder::Done) => {
                // The last rounds' slices are used once a checkpoint holds them: it goes on
                // its way first (the round still announcing is in it).
                if self.cadence.behind() {
                    effects.extend([Effect::Checkpoint, Effect::Upload]);
                }
                effects.push(Effect::Finish);
            }
        }
        effects
    }

    fn ended(
        &mut self,
        mut applied: Applied,
        sent: u64,
        to_standby: u64,
        has_standby: bool,
        now: Instant,
    ) -> Vec<Effect> {
        self.standby_traffic += to_standby;
        applied.traffic_bytes = Some(std::mem::take(&mut self.round_traffic) + sent);
        applied.standby_bytes =
            Some(std::mem::take(&mut self.standby_traffic)).filter(|_| has_standby);
        self.cadence.round_applied(sent);
        let checkpointed = self.cadence.due();
        if let Some(earlier) = self.announcing.take() {
            self.announce |= earlier.checkpointed;
        }
        self.announcing = Some(Announcing {
            applied,
            checkpointed,
            until: now + STANDBY_HEAD_START,
        });
        if checkpointed {
            vec![Effect::Checkpoint]
        } else {
            vec![]
        }
    }
}

/// What the server answers a trainer that names the model it holds (`offered`: its round
/// and fingerprint, if it says them), holding `held` itself (none before it adopts one).
#[derive(Debug, PartialEq, Eq)]
pub(super) enum HeldReply<'a> {
    /// A server with no model adopts the one the scheduler names: the offer waits, and only
    /// the named offerer is asked for its model whole; the others hold the same model, most
    /// often.
    WaitForAdoption((u64, &'a str)),
    /// A server with no model asks an offer that names none for the model itself.
    AskForIt,
    /// The trainer holds this server's model: it starts from its own copy.
    Held((u64, &'a str)),
    /// Send it the model (or the change to it from what it holds).
    SendModel,
    /// A peer the scheduler has not named yet gets the model once it is.
    UntilNamed,
}

pub(super) fn reply_to_held<'a>(
    held: Option<(u64, &'a str)>,
    offered: Option<(u64, &'a str)>,
    named: bool,
) -> HeldReply<'a> {
    match (held, offered) {
        (None, Some(offered)) => HeldReply::WaitForAdoption(offered),
        (None, None) => HeldReply::AskForIt,
        (Some(held), _) if offered == Some(held) => HeldReply::Held(held),
        (Some(_), _) if named => HeldReply::SendModel,
        (Some(_), _) => HeldReply::UntilNamed,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn applied(round: u64) -> Applied {
        Applied {
            round,
            delta_bytes: None,
            included: vec!["a".into()],
            model_hash: None,
            largest_norm_ratio: None,
            clipped: Vec::new(),
            close_ms: None,
            traffic_bytes: None,
            standby_bytes: None,
        }
    }

    /// Round `round` ended, its ending sending `sent` bytes to the trainers and `to_standby`
    /// to the standby (`has_standby`: there is one).
    fn ended(round: u64, sent: u64, to_standby: u64, has_standby: bool) -> Event {
        Event::Ended {
            applied: applied(round),
            sent,
            to_standby,
            has_standby,
        }
    }

    fn answered(order: ServerOrder, round: u64) -> Event {
        Event::Answered {
            order: Some(order),
            round: Some(round),
        }
    }

    fn close(round: u64) -> ServerOrder {
        ServerOrder::Close {
            round,
            send_to: vec!["a".into()],
        }
    }

    /// Every 1000 bytes moved checkpoints again after a first checkpoint of 100 bytes.
    fn rules() -> Loop {
        Loop::new(Cadence::new(None, 100))
    }

    fn asked(effects: &[Effect]) -> (Vec<Late>, Option<Applied>) {
        match effects {
            [Effect::Ask { dropped, applied }] => (dropped.clone(), applied.clone()),
            other => panic!("not one ask: {other:?}"),
        }
    }

    /// A file taken, the tick, and a dropped update each make a status, and the dropped
    /// update is in one status only.
    #[test]
    fn each_file_and_tick_asks_and_a_dropped_update_is_said_once() {
        let mut rules = rules();
        let now = Instant::now();
        let late = Late {
            peer: "late".into(),
            round: 3,
        };
        let took = Event::Took {
            bytes: 10,
            dropped: Some(late.clone()),
        };
        let (dropped, applied) = asked(&rules.apply(took, now));
        assert_eq!(dropped, [late]);
        assert!(applied.is_none());
        assert!(asked(&rules.apply(Event::Tick, now)).0.is_empty());
    }

    /// Told to close, the server first takes the files waiting and asks again if there were
    /// any; told again, it closes. Once a round: the second order closes whatever waits.
    #[test]
    fn a_close_takes_the_waiting_files_and_asks_again_once() {
        let mut rules = rules();
        let now = Instant::now();
        assert_eq!(
            rules.apply(answered(close(4), 4), now),
            [Effect::TakeWaiting]
        );
        let took = Event::TookWaiting {
            bytes: Some(50),
            dropped: Vec::new(),
        };
        asked(&rules.apply(took, now));
        assert_eq!(
            rules.apply(answered(close(4), 4), now),
            [Effect::Close(vec!["a".into()])]
        );

        // Nothing waited: it closes at once.
        assert_eq!(
            rules.apply(answered(close(5), 5), now),
            [Effect::TakeWaiting]
        );
        assert_eq!(
            rules.apply(
                Event::TookWaiting {
                    bytes: None,
                    dropped: Vec::new()
                },
                now
            ),
            [Effect::Close(vec!["a".into()])]
        );
    }

    /// A close or skip of a round the server no longer collects does nothing.
    #[test]
    fn an_order_for_another_round_is_not_carried_out() {
        let mut rules = rules();
        let now = Instant::now();
        assert!(rules.apply(answered(close(4), 5), now).is_empty());
        let skip = ServerOrder::Skip {
            round: 4,
            send_to: vec![],
        };
        assert!(rules.apply(answered(skip.clone(), 5), now).is_empty());
        assert_eq!(rules.apply(answered(skip, 4), now), [Effect::Skip(vec![])]);
    }

    /// A round's traffic is what came in for it and what its ending sent; the standby's is
    /// counted apart, and only with a standby. The scheduler hears of the round once the
    /// standby holds it (or its head start passed), with its checkpoint pushed only after
    /// the scheduler answered that status.
    #[test]
    fn a_round_ended_is_counted_announced_after_the_standby_and_its_checkpoint_uploaded_after() {
        let mut rules = rules();
        let now = Instant::now();
        rules.apply(
            Event::Took {
                bytes: 400,
                dropped: None,
            },
            now,
        );
        rules.apply(Event::SentToTrainers(100), now);
        rules.apply(Event::SentToStandby(7), now);
        // 400 + 100 + 600 moved: past ten times the checkpoint of 100 bytes.
        let effects = rules.apply(ended(1, 600, 3, true), now);
        assert_eq!(effects, [Effect::Checkpoint]);
        assert_eq!(
            rules.announcing_until(),
            Some(now + STANDBY_HEAD_START),
            "said once the standby holds it"
        );
        rules.apply(Event::Checkpointed(100), now);
        assert!(asked(&rules.apply(Event::Tick, now)).1.is_none(), "not yet");

        let (_, said) = asked(&rules.apply(Event::Held, now));
        let said = said.unwrap();
        assert_eq!(said.round, 1);
        assert_eq!(said.traffic_bytes, Some(1100));
        assert_eq!(said.standby_bytes, Some(10));
        assert_eq!(rules.announcing_until(), None);

        // The scheduler answered the status that said the round: the checkpoint goes.
        assert_eq!(
            rules.apply(answered(ServerOrder::Wait, 2), now),
            [Effect::Upload]
        );
        assert!(rules.apply(answered(ServerOrder::Wait, 2), now).is_empty());
        // A scheduler that did not answer has not heard.
        let mut rules = rules_after_a_checkpointed_round(now);
        let no_answer = Event::Answered {
            order: None,
            round: Some(2),
        };
        assert!(rules.apply(no_answer, now).is_empty());
        assert_eq!(
            rules.apply(answered(ServerOrder::Wait, 2), now),
            [Effect::Upload]
        );
    }

    fn rules_after_a_checkpointed_round(now: Instant) -> Loop {
        let mut rules = rules();
        let ended = ended(1, 2000, 0, false);
        assert_eq!(rules.apply(ended, now), [Effect::Checkpoint]);
        rules.apply(Event::Held, now);
        rules
    }

    /// Without a standby, no standby bytes are said; a round that moved little is not
    /// checkpointed.
    #[test]
    fn a_light_round_without_a_standby_is_not_checkpointed() {
        let mut rules = rules();
        let now = Instant::now();
        let ended = ended(1, 10, 0, false);
        assert!(rules.apply(ended, now).is_empty());
        let said = asked(&rules.apply(Event::Held, now)).1.unwrap();
        assert_eq!(said.standby_bytes, None);
        assert!(rules.apply(answered(ServerOrder::Wait, 2), now).is_empty());
    }

    /// A round that ends while the one before still waits for the standby: the earlier one
    /// is never said on its own, but its checkpoint still goes after the next answer.
    #[test]
    fn a_round_ended_before_the_last_was_said_takes_its_place() {
        let mut rules = rules();
        let now = Instant::now();
        let first = ended(1, 2000, 0, true);
        assert_eq!(rules.apply(first, now), [Effect::Checkpoint]);
        rules.apply(Event::Checkpointed(100), now);
        let later = now + Duration::from_millis(100);
        let second = ended(2, 1, 0, true);
        assert!(rules.apply(second, later).is_empty());
        assert_eq!(rules.announcing_until(), Some(later + STANDBY_HEAD_START));
        assert_eq!(
            rules.apply(answered(ServerOrder::Wait, 3), later),
            [Effect::Upload]
        );
        let said = asked(&rules.apply(Event::Held, later)).1.unwrap();
        assert_eq!(said.round, 2);
    }

    /// Done: a checkpoint first when a round was applied since the last, then the end; the
    /// other orders are the actor's to carry out as they come.
    #[test]
    fn done_checkpoints_what_is_behind_then_finishes() {
        let now = Instant::now();
        let mut fresh = rules();
        assert_eq!(
            fresh.apply(answered(ServerOrder::Done, 0), now),
            [Effect::Finish]
        );
        let mut behind = rules();
        behind.apply(ended(1, 1, 0, false), now);
        assert_eq!(
            behind.apply(answered(ServerOrder::Done, 2), now),
            [Effect::Checkpoint, Effect::Upload, Effect::Finish]
        );

        let mut rules = rules();
        let named = ServerOrder::Trainers {
            peers: vec!["a".into()],
        };
        assert_eq!(
            rules.apply(answered(named, 0), now),
            [Effect::NameTrainers(vec!["a".into()])]
        );
        let adopt = ServerOrder::Adopt { from: "a".into() };
        assert_eq!(
            rules.apply(answered(adopt, 0), now),
            [Effect::Adopt("a".into())]
        );
        assert_eq!(
            rules.apply(Event::Adopted(Some(100)), now),
            [Effect::Upload]
        );
        assert!(rules.apply(Event::Adopted(None), now).is_empty());
    }

    /// A trainer naming the server's own model gets told so, named or not; another model
    /// gets the server's only once the scheduler named the trainer; before the server holds
    /// a model, a fingerprint waits for the adoption and an offer without one is asked for
    /// the model.
    #[test]
    fn a_trainer_naming_its_model_is_told_held_sent_the_model_or_waits() {
        let ours = Some((3, "abc"));
        let theirs = Some((2, "old"));
        assert_eq!(
            reply_to_held(ours, ours, false),
            HeldReply::Held((3, "abc"))
        );
        assert_eq!(reply_to_held(ours, theirs, true), HeldReply::SendModel);
        assert_eq!(reply_to_held(ours, None, true), HeldReply::SendModel);
        assert_eq!(reply_to_held(ours, theirs, false), HeldReply::UntilNamed);
        assert_eq!(
            reply_to_held(None, theirs, true),
            HeldReply::WaitForAdoption((2, "old"))
        );
        assert_eq!(reply_to_held(None, None, false), HeldReply::AskForIt);
    }
}
