//! The rules of [`Rounds`](super::Rounds), as sequences of statuses and the orders and
//! settlements they bring.

#![allow(clippy::unwrap_used)]

use hypha_messages::diloco::{Applied, Arrival, Refusal};

use super::*;

fn plan() -> RoundPlan {
    RoundPlan {
        rounds: Some(2),
        samples_per_round: 1200,
        batch_size: 10,
        round_ms: 10_000,
        quorum: 0.5,
        bench_after_refusals: 3,
        start_grace_ms: 0,
        eval_every: None,
    }
}

fn status(round: u64, batches: u64, batch_ms: Option<f64>) -> TrainerStatus {
    TrainerStatus {
        round: Some(round),
        batches,
        samples: batches * 10,
        batch_ms,
        ..TrainerStatus::default()
    }
}

/// A trainer's status in `round`: one batch trained, and out of data.
fn last_batch(round: u64) -> TrainerStatus {
    TrainerStatus {
        data_done: true,
        ..status(round, 1, Some(100.0))
    }
}

fn target(order: TrainerOrder) -> u64 {
    match order {
        TrainerOrder::Train { batches, .. } => batches,
        other => panic!("expected a batch target, got {other:?}"),
    }
}

fn rounds_with(trainers: &[(&str, &str)]) -> Rounds {
    let mut rounds = Rounds::new(plan());
    rounds.server_started("ps".into());
    for (job, peer) in trainers {
        rounds.trainer_started(job.to_string(), peer.to_string());
    }
    rounds
}

/// The server's status as a server that holds the trainers the scheduler names.
fn report(
    rounds: &mut Rounds,
    mut status: ServerStatus,
    now_ms: u64,
) -> (ServerOrder, Vec<Settle>, Option<AppliedRound>) {
    status.trainers = rounds.server_trainers().into_iter().collect();
    rounds.server_status(status, now_ms)
}

fn server(round: u64, arrived: &[&str], applied: Option<(u64, &[&str])>) -> ServerStatus {
    ServerStatus {
        round: Some(round),
        arrived: arrived
            .iter()
            .map(|p| Arrival {
                peer: p.to_string(),
                samples: 100,
            })
            .collect(),
        dropped: vec![],
        applied: applied.map(|(round, included)| Applied {
            round,
            included: included.iter().map(|p| p.to_string()).collect(),
            model_hash: None,
            delta_bytes: None,
            largest_norm_ratio: None,
            clipped: vec![],
            close_ms: None,
            traffic_bytes: None,
            standby_bytes: None,
        }),
        ..ServerStatus::default()
    }
}

fn joined(job: &str, peer: &str, round: u64) -> News {
    News::Joined {
        job: job.into(),
        peer: peer.into(),
        round,
    }
}

/// The first round waits for every leased trainer to hold the model, the start grace at
/// most after the first did: a trainer that loads slowly trains the run's first round, a
/// broken one holds the start for the grace only, and joins the round in flight once it
/// is ready.
#[test]
fn the_first_round_waits_for_slow_trainers_for_the_start_grace() {
    let mut rounds = Rounds::new(RoundPlan {
        start_grace_ms: 5_000,
        ..plan()
    });
    rounds.server_started("ps".into());
    for (job, peer) in [("job-a", "pa"), ("job-b", "pb"), ("job-c", "pc")] {
        rounds.trainer_started(job.into(), peer.into());
    }
    let wait = TrainerOrder::wait(WAIT_MS);
    let (order, _) = rounds.trainer_status("job-a", status(0, 0, None), 1_000);
    assert_eq!(order, wait);
    assert_eq!(
        rounds.take_news(),
        vec![News::Waiting {
            ready: 1,
            trainers: 3,
            grace_ms: 5_000
        }]
    );
    let (order, _) = rounds.trainer_status("job-b", TrainerStatus::default(), 2_000);
    assert!(matches!(order, TrainerOrder::Join { .. }), "{order:?}");
    let (order, _) = rounds.trainer_status("job-b", status(0, 0, None), 3_000);
    assert_eq!(order, wait);
    assert_eq!(
        rounds.take_news(),
        vec![News::Waiting {
            ready: 2,
            trainers: 3,
            grace_ms: 5_000
        }]
    );
    let (order, _) = rounds.trainer_status("job-a", status(0, 0, None), 5_999);
    assert_eq!(order, wait);
    assert!(rounds.take_news().is_empty());
    // The grace since pa was ready is over: the round begins without pc.
    let (order, _) = rounds.trainer_status("job-a", status(0, 0, None), 6_000);
    assert!(target(order) > 0);
    assert_eq!(
        rounds.take_news(),
        vec![
            News::Began {
                round: 0,
                ready: 2,
                late: vec!["pc".into()],
                waited_ms: 5_000
            },
            joined("job-a", "pa", 0)
        ]
    );
    let (order, _) = rounds.trainer_status("job-b", status(0, 0, None), 6_100);
    assert!(target(order) > 0);
    assert_eq!(rounds.take_news(), vec![joined("job-b", "pb", 0)]);
    let (order, _) = rounds.trainer_status("job-c", status(0, 0, None), 9_000);
    assert!(target(order) > 0);
    assert_eq!(rounds.take_news(), vec![joined("job-c", "pc", 0)]);
}

/// The first round begins as soon as the last leased trainer is ready; a run that goes
/// on from a checkpoint does not wait at all.
#[test]
fn the_first_round_begins_as_the_last_trainer_is_ready() {
    let grace = RoundPlan {
        start_grace_ms: 60_000,
        ..plan()
    };
    let mut rounds = Rounds::new(grace.clone());
    rounds.server_started("ps".into());
    rounds.trainer_started("job-a".into(), "pa".into());
    rounds.trainer_started("job-b".into(), "pb".into());
    let (order, _) = rounds.trainer_status("job-a", status(0, 0, None), 0);
    assert_eq!(order, TrainerOrder::wait(WAIT_MS));
    let (order, _) = rounds.trainer_status("job-b", status(0, 0, None), 700);
    assert!(target(order) > 0);
    let news = rounds.take_news();
    assert_eq!(
        news[1..],
        [
            News::Began {
                round: 0,
                ready: 2,
                late: vec![],
                waited_ms: 700
            },
            joined("job-b", "pb", 0)
        ]
    );
    let (order, _) = rounds.trainer_status("job-a", status(0, 0, None), 800);
    assert!(target(order) > 0);

    let mut resumed = Rounds::new(grace);
    resumed.restored(4);
    resumed.server_started("ps".into());
    resumed.trainer_started("job-a".into(), "pa".into());
    resumed.trainer_started("job-b".into(), "pb".into());
    let (order, _) = resumed.trainer_status("job-a", status(4, 0, None), 0);
    assert!(target(order) > 0);
}

/// The server takes updates only from the trainers named to it, is told again when they
/// change, and adopts the initial model of the trainer the scheduler picks, not of
/// whoever offered first: the lowest job id once every trainer offered (or a while after the
/// first did), kept once chosen, passed over when its model does not come.
#[test]
fn the_server_is_told_its_trainers_and_whose_initial_model_to_adopt() {
    let mut rounds = rounds_with(&[("job-b", "pb"), ("job-a", "pa")]);
    let fresh = ServerStatus {
        offered: vec!["outsider".into(), "pb".into()],
        ..ServerStatus::default()
    };
    let (order, _, _) = rounds.server_status(fresh.clone(), 0);
    assert_eq!(
        order,
        ServerOrder::Trainers {
            peers: vec!["pa".into(), "pb".into()]
        }
    );
    let named = ServerStatus {
        trainers: vec!["pb".into(), "pa".into()],
        ..fresh
    };
    // Only an outsider offered: nothing to adopt.
    let outsider_only = ServerStatus {
        offered: vec!["outsider".into()],
        ..named.clone()
    };
    let (order, _, _) = rounds.server_status(outsider_only, 5);
    assert_eq!(order, ServerOrder::Wait);
    // pb offered; pa (the lower job id) has not yet: the choice waits for it.
    let (order, _, _) = rounds.server_status(named.clone(), 10);
    assert_eq!(order, ServerOrder::Wait);
    let both = ServerStatus {
        offered: vec!["pb".into(), "pa".into()],
        ..named.clone()
    };
    let (order, _, _) = rounds.server_status(both.clone(), 20);
    assert_eq!(order, ServerOrder::Adopt { from: "pa".into() });

    // pa loads slowly: after ADOPT_WAIT_MS pb's is the one, and stays it once pa offers.
    let mut slow = rounds_with(&[("job-b", "pb"), ("job-a", "pa")]);
    slow.server_status(named.clone(), 0);
    assert_eq!(slow.server_status(named.clone(), 1).0, ServerOrder::Wait);
    let (order, _, _) = slow.server_status(named.clone(), 1 + super::ADOPT_WAIT_MS);
    assert_eq!(order, ServerOrder::Adopt { from: "pb".into() });
    let (order, _, _) = slow.server_status(both.clone(), 2 + super::ADOPT_WAIT_MS);
    assert_eq!(order, ServerOrder::Adopt { from: "pb".into() });
    // pb's model never comes: after ADOPT_UPLOAD_MS, pa is asked instead.
    let late = 2 + super::ADOPT_WAIT_MS + super::ADOPT_UPLOAD_MS;
    let (order, _, _) = slow.server_status(both, late);
    assert_eq!(order, ServerOrder::Adopt { from: "pa".into() });

    rounds.trainer_started("job-c".into(), "pc".into());
    let (order, _, _) = rounds.server_status(named, 40);
    assert_eq!(
        order,
        ServerOrder::Trainers {
            peers: vec!["pa".into(), "pb".into(), "pc".into()]
        }
    );
}

#[test]
fn trainers_join_then_get_targets_that_make_fast_and_slow_finish_together() {
    let mut rounds = rounds_with(&[("a", "pa"), ("b", "pb")]);
    let (order, _) = rounds.trainer_status("a", TrainerStatus::default(), 0);
    assert_eq!(
        order,
        TrainerOrder::Join {
            parameter_server: "ps".into()
        }
    );
    // Before anyone reports a batch time: an even share, 1200 / 10 / 2 = 60 batches.
    assert_eq!(
        target(rounds.trainer_status("a", status(0, 0, None), 0).0),
        60
    );
    rounds.trainer_status("b", status(0, 0, None), 0);
    // a does a batch in 100 ms, b in 300 ms: 100 + 33.3 samples/s, 1200 − 40 samples left
    // → 8.7 s more; a gets ≈ 87 more batches, b ≈ 29: each ends at the same time.
    rounds.trainer_status("b", status(0, 1, Some(300.0)), 300);
    let a = target(rounds.trainer_status("a", status(0, 3, Some(100.0)), 300).0);
    let b = target(rounds.trainer_status("b", status(0, 1, Some(300.0)), 300).0);
    assert!((88..=90).contains(&a), "a: {a}");
    assert!((29..=31).contains(&b), "b: {b}");
    let (a_ms, b_ms) = ((a - 3) as f64 * 100.0, (b - 1) as f64 * 300.0);
    assert!((a_ms - b_ms).abs() <= 300.0, "{a_ms} vs {b_ms}");
}

/// Issue 21, item 3: a trainer whose update takes 2 s to reach the server stops its
/// inner steps 2 s earlier than one on a fast link, so that both updates arrive together,
/// and the round still holds its samples.
#[test]
fn a_trainer_on_a_slow_link_stops_earlier_so_that_updates_arrive_together() {
    let mut rounds = rounds_with(&[("a", "pa"), ("b", "pb")]);
    let slow_link = |batches| TrainerStatus {
        send_ms: Some(2000.0),
        ..status(0, batches, Some(100.0))
    };
    rounds.trainer_status("a", status(0, 0, Some(100.0)), 0);
    rounds.trainer_status("b", slow_link(0), 0);
    let a = target(rounds.trainer_status("a", status(0, 0, Some(100.0)), 0).0);
    let b = target(rounds.trainer_status("b", slow_link(0), 0).0);
    // 1200 samples at 0.1 + 0.1 samples/ms, 200 of them lost to b's send: A = 7 s; a
    // trains 70 batches, b 50, and b's update arrives at 5 s + 2 s.
    assert!((69..=70).contains(&a), "a: {a}");
    assert!((49..=50).contains(&b), "b: {b}");
    assert!((a + b) * 10 >= 1180, "{} samples", (a + b) * 10);
    let arrivals = (a as f64 * 100.0, b as f64 * 100.0 + 2000.0);
    assert!((arrivals.0 - arrivals.1).abs() <= 200.0, "{arrivals:?}");
}

/// Once a round holds its samples, no trainer is given more, whatever its link: a
/// trainer quicker to send than the others must not be told to fill their send time.
#[test]
fn a_full_round_gives_nobody_more_batches_whatever_their_links() {
    let mut rounds = rounds_with(&[("a", "pa"), ("b", "pb"), ("c", "pc")]);
    let linked = |batches, send| TrainerStatus {
        send_ms: Some(send),
        ..status(0, batches, Some(1.0))
    };
    for (job, send) in [("a", 4.0), ("b", 7.0), ("c", 19.0)] {
        rounds.trainer_status(job, linked(0, send), 0);
    }
    // Each has trained 40 batches of 10: the round's 1200 samples are done.
    for (job, send) in [("a", 4.0), ("b", 7.0), ("c", 19.0)] {
        rounds.trainer_status(job, linked(40, send), 40);
    }
    for (job, send) in [("a", 4.0), ("b", 7.0), ("c", 19.0)] {
        assert_eq!(
            target(rounds.trainer_status(job, linked(40, send), 41).0),
            40
        );
    }
    assert_eq!(arrival(&mut [(1.0, 0.5), (1.0, 1.0)], 0.0), 0.5);
    assert_eq!(arrival(&mut [(1.0, 1.0), (1.0, 0.0)], 1.0), 1.0);
    assert_eq!(arrival(&mut [(1.0, 0.0), (1.0, 0.0)], 2.0), 1.0);
}

/// A liar's impossible pace (a batch in 1e-310 ms) and send time (1e300 ms) neither make
/// the plan NaN nor overflow its target: the others are planned within the round's time.
#[test]
fn impossible_paces_and_send_times_neither_overflow_nor_unbound_the_plan() {
    let mut rounds = rounds_with(&[("a", "pa"), ("b", "pb")]);
    let liar = |batches| TrainerStatus {
        send_ms: Some(1e300),
        ..status(0, batches, Some(1e-310))
    };
    rounds.trainer_status("a", status(0, 0, Some(100.0)), 0);
    rounds.trainer_status("b", liar(0), 0);
    let a = target(rounds.trainer_status("a", status(0, 0, Some(100.0)), 0).0);
    assert!(
        (1..=100).contains(&a),
        "a: {a} (the round's 10 s are 100 batches)"
    );
    // Its own target: as many as it likes, without overflowing.
    let b = target(rounds.trainer_status("b", liar(1 << 40), 0).0);
    assert!(b >= 1 << 40, "b: {b}");
}

#[test]
fn a_trainer_at_its_target_counts_what_the_others_trained_since_they_last_spoke() {
    let mut rounds = rounds_with(&[("a", "pa"), ("b", "pb"), ("c", "pc")]);
    // Each at 100 ms a batch: 1200 samples are 40 batches each, 4 s.
    let mut targets = Vec::new();
    for job in ["a", "b", "c"] {
        rounds.trainer_status(job, status(0, 0, Some(100.0)), 0);
    }
    for job in ["a", "b", "c"] {
        targets.push(target(
            rounds.trainer_status(job, status(0, 0, Some(100.0)), 0).0,
        ));
    }
    assert_eq!(targets, [40, 40, 40]);
    // At 4 s, a reaches its target and speaks first; b and c last spoke at 0 but have
    // trained theirs too: the round is full, a syncs now.
    let a = target(
        rounds
            .trainer_status("a", status(0, 40, Some(100.0)), 4000)
            .0,
    );
    assert_eq!(a, 40, "a was told to train {} more batches", a - 40);
    // Halfway, a trainer that speaks gets what is left of its own share, not more.
    let mut rounds = rounds_with(&[("a", "pa"), ("b", "pb")]);
    for job in ["a", "b", "a", "b"] {
        rounds.trainer_status(job, status(0, 0, Some(100.0)), 0);
    }
    let a = target(
        rounds
            .trainer_status("a", status(0, 30, Some(100.0)), 3000)
            .0,
    );
    assert!((59..=61).contains(&a), "a: {a}");
}

/// A trainer that claims 10¹² samples (or u64::MAX) is believed only up to what it was
/// told to train: the honest trainer's target is what it would be had the liar trained
/// its share, and nothing overflows.
#[test]
fn a_trainer_claiming_more_samples_than_it_was_given_does_not_shrink_the_others_rounds() {
    let honest_target = |claim: u64| {
        let mut rounds = rounds_with(&[("liar", "l"), ("honest", "h")]);
        let paced = |batches| status(0, batches, Some(100.0));
        rounds.trainer_status("liar", TrainerStatus::default(), 0);
        rounds.trainer_status("honest", TrainerStatus::default(), 0);
        rounds.trainer_status("liar", paced(0), 0);
        rounds.trainer_status("honest", paced(0), 0);
        let lie = TrainerStatus {
            samples: claim,
            ..paced(4)
        };
        rounds.trainer_status("liar", lie, 400);
        target(rounds.trainer_status("honest", paced(4), 400).0)
    };
    let truthful = honest_target(40);
    assert!(
        truthful > 1,
        "an honest report leaves the round to train: {truthful}"
    );
    for claim in [1_000_000_000_000, u64::MAX] {
        assert!(
            honest_target(claim) >= truthful / 2,
            "a claim of {claim} samples shrank the honest target to {} (from {truthful})",
            honest_target(claim)
        );
    }
}

/// Issue 55, item 3 (a): a trainer that keeps saying it holds the last round's model with a
/// huge `ahead_batches` is believed up to a round's worth: the honest trainers' targets stay
/// near what a truthful claim leaves them. (Checked by believing the claim: the honest
/// target falls to one batch.)
#[test]
fn a_trainer_claiming_to_have_trained_far_ahead_does_not_shrink_the_others_rounds() {
    let honest_target = |ahead: u64| {
        let mut rounds = rounds_with(&[("liar", "l"), ("honest", "h")]);
        for job in ["liar", "honest"] {
            rounds.trainer_status(job, status(0, 10, Some(100.0)), 0);
        }
        report(&mut rounds, server(0, &["l", "h"], None), 100);
        report(&mut rounds, server(1, &[], Some((0, &["l", "h"]))), 200);
        let lie = TrainerStatus {
            ahead_batches: ahead,
            ..status(0, 10, Some(100.0))
        };
        rounds.trainer_status("liar", lie, 300);
        target(
            rounds
                .trainer_status("honest", status(1, 0, Some(100.0)), 300)
                .0,
        )
    };
    let truthful = honest_target(2);
    assert!(truthful > 20, "{truthful}");
    for claim in [1_000_000_000_000, u64::MAX] {
        let target = honest_target(claim);
        assert!(
            target >= truthful / 3,
            "a claim of {claim} batches ahead shrank the honest target to {target} (from {truthful})"
        );
    }
}

/// Issue 55, item 3: a trainer expected in every round (it holds a model) that never sends
/// is benched after `bench_after_refusals` (3) rounds in a row, with why; one whose update
/// arrived late (dropped) is not silent, and is not benched.
#[test]
fn a_trainer_expected_in_three_rounds_that_sends_nothing_is_benched() {
    let mut rounds = Rounds::new(RoundPlan {
        rounds: Some(10),
        ..plan()
    });
    rounds.server_started("ps".into());
    for (job, peer) in [("a", "pa"), ("b", "pb"), ("s", "ps1"), ("late", "pl")] {
        rounds.trainer_started(job.into(), peer.into());
    }
    let mut now = 0;
    for round in 0..3u64 {
        for job in ["a", "b", "s", "late"] {
            rounds.trainer_status(job, status(round, 1, Some(100.0)), now);
        }
        // Past the deadline, with a and b in: it closes without s and late.
        now += 20_000;
        let (order, _, _) = report(&mut rounds, server(round, &["pa", "pb"], None), now);
        assert!(
            matches!(order, ServerOrder::Close { round: r, .. } if r == round),
            "round {round}: {order:?}"
        );
        now += 100;
        let mut applied = server(round + 1, &[], Some((round, &["pa", "pb"])));
        if round > 0 {
            // late's update of the round before arrived after its close.
            applied.dropped = vec![hypha_messages::diloco::Late {
                peer: "pl".into(),
                round: round - 1,
            }];
        }
        let (_, _, applied) = report(&mut rounds, applied, now);
        let benched = applied.unwrap().benched;
        if round == 2 {
            assert_eq!(benched.len(), 1, "{benched:?}");
            assert_eq!(benched[0].peer, "ps1");
            assert!(benched[0].reason.contains("sent no update"), "{benched:?}");
        } else {
            assert!(benched.is_empty(), "round {round}: {benched:?}");
        }
    }
}

#[test]
fn the_first_trainer_to_ask_in_a_new_round_gets_its_share_not_the_whole_round() {
    let mut rounds = rounds_with(&[("a", "pa"), ("b", "pb"), ("c", "pc")]);
    for job in ["a", "b", "c"] {
        rounds.trainer_status(job, status(0, 40, Some(100.0)), 0);
    }
    report(&mut rounds, server(0, &["pa", "pb", "pc"], None), 100);
    report(
        &mut rounds,
        server(1, &[], Some((0, &["pa", "pb", "pc"]))),
        200,
    );
    assert_eq!(rounds.round(), 1);
    // a asks for round 1 while b's and c's last word is still of round 0: the round's
    // 1200 samples are 120 batches over three, 40 each.
    let a = target(rounds.trainer_status("a", status(1, 0, Some(100.0)), 300).0);
    assert!((39..=41).contains(&a), "a: {a}");
}

#[test]
fn a_round_is_bounded_in_time() {
    let mut rounds = rounds_with(&[("a", "pa")]);
    rounds.trainer_status("a", status(0, 0, None), 0);
    // 1 s per batch would need 120 s; the round may take 10 s.
    let t = target(
        rounds
            .trainer_status("a", status(0, 2, Some(1000.0)), 2000)
            .0,
    );
    assert_eq!(t, 2 + 8);
}

#[test]
fn a_round_closes_when_all_arrived_and_commits_only_the_included() {
    let mut rounds = rounds_with(&[("a", "pa"), ("b", "pb")]);
    rounds.trainer_status("a", status(0, 5, Some(100.0)), 0);
    rounds.trainer_status("b", status(0, 5, Some(100.0)), 0);
    let (order, _, _) = report(&mut rounds, server(0, &["pa"], None), 100);
    assert_eq!(order, ServerOrder::Wait);
    let (order, _, _) = report(&mut rounds, server(0, &["pa", "pb"], None), 200);
    let ServerOrder::Close {
        round: 0,
        mut send_to,
    } = order
    else {
        panic!("expected a close, got {order:?}")
    };
    send_to.sort();
    assert_eq!(send_to, ["pa", "pb"]);
    // While the close is pending, trainers are told to sync.
    assert_eq!(
        target(rounds.trainer_status("a", status(0, 7, Some(100.0)), 250).0),
        7
    );
    let (_, settle, applied) = report(&mut rounds, server(1, &[], Some((0, &["pa", "pb"]))), 300);
    assert_eq!(settle.len(), 2);
    assert_eq!(applied.unwrap().samples, 200, "as the server counted them");
    assert_eq!(rounds.round(), 1);
    // Round 1 is the last: once applied, everyone is done.
    rounds.trainer_status("a", status(1, 1, Some(100.0)), 400);
    report(&mut rounds, server(1, &["pa"], None), 500);
    rounds.trainer_ended("b", 0);
    let (order, _, _) = report(&mut rounds, server(1, &["pa"], None), 600);
    assert!(
        matches!(order, ServerOrder::Close { round: 1, .. }),
        "{order:?}"
    );
    let (order, _, _) = report(&mut rounds, server(2, &[], Some((1, &["pa"]))), 700);
    assert_eq!(order, ServerOrder::Done);
    assert_eq!(
        rounds.trainer_status("a", status(2, 0, None), 800).0,
        TrainerOrder::Done
    );
}

#[test]
fn a_trainer_ahead_of_the_applied_round_waits() {
    let mut rounds = rounds_with(&[("a", "pa")]);
    rounds.trainer_status("a", status(0, 1, Some(100.0)), 0);
    report(&mut rounds, server(0, &["pa"], None), 10);
    // The model of round 1 reached the trainer before the server reported round 0 applied.
    assert!(matches!(
        rounds.trainer_status("a", status(1, 0, None), 20).0,
        TrainerOrder::Wait { .. }
    ));
    report(&mut rounds, server(1, &[], Some((0, &["pa"]))), 30);
    assert!(target(rounds.trainer_status("a", status(1, 0, None), 40).0) > 0);
}

/// `status` saying the server refused an update of each of `peers`.
fn refusing(mut status: ServerStatus, peers: &[&str]) -> ServerStatus {
    status.refused = peers
        .iter()
        .map(|peer| Refusal {
            peer: peer.to_string(),
            reason: "claims 1000000000000 samples, more than 1200".into(),
        })
        .collect();
    status
}

/// A trainer whose update the server refused is not waited for: the round closes as soon
/// as the others are in (long before its deadline) where they make the quorum, and the
/// refused trainer's slices go back. Refusals count against the quorum: where too few
/// updates were taken (a liar's alone, say), the round ends without a change at its
/// deadline, everybody left out; so does a round whose every update was refused.
#[test]
fn a_round_does_not_wait_for_a_trainer_whose_update_was_refused() {
    let mut rounds = Rounds::new(RoundPlan {
        rounds: Some(4),
        ..plan()
    });
    rounds.server_started("ps".into());
    for (job, peer) in [("a", "pa"), ("b", "pb"), ("c", "pc")] {
        rounds.trainer_started(job.into(), peer.into());
        rounds.trainer_status(job, status(0, 1, Some(100.0)), 0);
    }
    let (order, _, _) = report(&mut rounds, server(0, &["pa", "pb"], None), 100);
    assert_eq!(order, ServerOrder::Wait, "c may still send");
    let (order, _, _) = report(
        &mut rounds,
        refusing(server(0, &["pa", "pb"], None), &["pc"]),
        200,
    );
    assert!(
        matches!(order, ServerOrder::Close { round: 0, .. }),
        "{order:?}"
    );
    let (_, settle, applied) = report(&mut rounds, server(1, &[], Some((0, &["pa", "pb"]))), 300);
    assert_eq!(settle.len(), 2);
    assert_eq!(applied.unwrap().included, ["pa", "pb"]);
    let (_, settle) = rounds.trainer_status("c", status(1, 0, None), 400);
    assert_eq!(settle, [drop("c", 0)]);

    // Round 1: a and b refused, c's update taken: 1 of 3, below the quorum of 2. Not
    // applied; at the deadline (10 s + 2.5 s), skipped.
    for job in ["a", "b", "c"] {
        rounds.trainer_status(job, status(1, 1, Some(100.0)), 500);
    }
    let refused = || refusing(server(1, &["pc"], None), &["pa", "pb"]);
    let (order, _, _) = report(&mut rounds, refused(), 600);
    assert_eq!(order, ServerOrder::Wait);
    let (order, _, _) = report(&mut rounds, refused(), 13_000);
    assert!(
        matches!(order, ServerOrder::Skip { round: 1, .. }),
        "{order:?}"
    );
    let (order, settle, applied) = report(&mut rounds, server(2, &[], Some((1, &[]))), 13_100);
    assert!(settle.is_empty());
    assert!(applied.unwrap().included.is_empty());
    assert_eq!(order, ServerOrder::Wait);
    assert_eq!(rounds.round(), 2);
    for job in ["a", "b", "c"] {
        let (_, settle) = rounds.trainer_status(job, status(2, 1, Some(100.0)), 13_200);
        assert_eq!(settle, [drop(job, 1)], "{job}");
    }

    // Round 2: every update refused: skipped at the deadline, not before.
    let refused = || refusing(server(2, &[], None), &["pa", "pb", "pc"]);
    let (order, _, _) = report(&mut rounds, refused(), 13_300);
    assert_eq!(order, ServerOrder::Wait);
    let (order, _, _) = report(&mut rounds, refused(), 30_000);
    assert!(
        matches!(order, ServerOrder::Skip { round: 2, .. }),
        "{order:?}"
    );
}

/// A trainer whose update is refused in `bench_after_refusals` (3) rounds in a row is
/// benched as the third of them ends, and rounds no longer count it once its job ended; one
/// whose update is taken in between starts its count again, and is not benched.
#[test]
fn a_trainer_refused_three_rounds_in_a_row_is_benched() {
    let mut rounds = Rounds::new(RoundPlan {
        rounds: Some(10),
        ..plan()
    });
    rounds.server_started("ps".into());
    let trainers = [("a", "pa"), ("b", "pb"), ("c", "pc"), ("l", "pl")];
    for (job, peer) in trainers {
        rounds.trainer_started(job.into(), peer.into());
    }
    // l is refused in every round; b in every round but round 2.
    let mut now = 0;
    for round in 0..5u64 {
        for (job, _) in trainers.iter().filter(|(job, _)| round < 3 || *job != "l") {
            rounds.trainer_status(job, status(round, 1, Some(100.0)), now);
        }
        let (taken, refused): (&[&str], &[&str]) = match round {
            2 => (&["pa", "pb", "pc"], &["pl"]),
            0 | 1 => (&["pa", "pc"], &["pb", "pl"]),
            _ => (&["pa", "pc"], &["pb"]),
        };
        now += 100;
        let (order, _, _) = report(
            &mut rounds,
            refusing(server(round, taken, None), refused),
            now,
        );
        assert!(
            matches!(order, ServerOrder::Close { round: r, .. } if r == round),
            "round {round}: {order:?}"
        );
        now += 100;
        let (_, _, applied) = report(
            &mut rounds,
            server(round + 1, &[], Some((round, taken))),
            now,
        );
        let benched: Vec<String> = applied
            .unwrap()
            .benched
            .into_iter()
            .map(|b| b.peer)
            .collect();
        if round == 2 {
            assert_eq!(benched, ["pl"]);
            rounds.trainer_ended("l", 0);
            assert!(!rounds.server_trainers().contains("pl"));
        } else {
            assert!(benched.is_empty(), "round {round}: {benched:?}");
        }
    }
}

/// A restarted scheduler names the server every trainer of the earlier process still
/// being taken over, so that the server keeps taking their updates of the round in flight;
/// one whose takeover ended without its job is named no more. (Checked by naming only the
/// trainers taken over: the first answer drops pb, whose update the server then refuses.)
#[test]
fn trainers_being_taken_over_stay_named_to_the_server() {
    let mut rounds = rounds_with(&[]);
    rounds.taking_over("pa".into());
    rounds.taking_over("pb".into());
    let named = |order: ServerOrder| match order {
        ServerOrder::Trainers { mut peers } => {
            peers.sort();
            Some(peers)
        }
        _ => None,
    };
    let mut status = server(0, &["pb"], None);
    status.trainers = vec!["pa".into(), "pb".into()];
    let (order, _, _) = rounds.server_status(status.clone(), 100);
    assert_eq!(named(order), None, "the server's list stands");
    rounds.trainer_taken_over("a".into(), "pa".into(), false);
    let (order, _, _) = rounds.server_status(status.clone(), 200);
    assert_eq!(named(order), None);
    rounds.takeover_ended("pb");
    let (order, _, _) = rounds.server_status(status, 300);
    assert_eq!(named(order), Some(vec!["pa".to_string()]));
}

fn drop(job: &str, round: u64) -> Settle {
    Settle::Drop {
        job: job.into(),
        round,
    }
}

#[test]
fn a_straggler_is_left_out_after_the_deadline_and_its_slices_go_back() {
    let mut rounds = rounds_with(&[("a", "pa"), ("b", "pb"), ("c", "pc")]);
    for job in ["a", "b", "c"] {
        rounds.trainer_status(job, status(0, 1, Some(100.0)), 0);
    }
    // Two of three arrived: not before 10 s + 2.5 s grace, then with quorum 0.5.
    let (order, _, _) = report(&mut rounds, server(0, &["pa", "pb"], None), 12_000);
    assert_eq!(order, ServerOrder::Wait);
    let (order, _, _) = report(&mut rounds, server(0, &["pa", "pb"], None), 12_500);
    assert!(matches!(order, ServerOrder::Close { round: 0, .. }));
    let (_, settle, _) = report(
        &mut rounds,
        server(1, &[], Some((0, &["pa", "pb"]))),
        12_600,
    );
    assert_eq!(settle.len(), 2);
    // c still trains round 0: told to sync now; its update will be late. When it reports
    // round 1, its round 0 goes back to the ledger.
    assert_eq!(
        target(
            rounds
                .trainer_status("c", status(0, 90, Some(100.0)), 12_700)
                .0
        ),
        90
    );
    let (_, settle) = rounds.trainer_status("c", status(1, 0, None), 13_000);
    assert_eq!(
        settle,
        vec![Settle::Drop {
            job: "c".into(),
            round: 0
        }]
    );
    // Settled once only.
    assert!(
        rounds
            .trainer_status("c", status(1, 1, Some(100.0)), 13_100)
            .1
            .is_empty()
    );
}

/// Training ends when every trainer is out of data and the ledger has none left to hand
/// out: while slices are still on their way to workers (or held by others), trainers
/// out of data for now ask again.
#[test]
fn training_ends_when_every_trainer_is_out_of_data() {
    let mut rounds = rounds_with(&[("a", "pa"), ("b", "pb")]);
    let out = TrainerStatus {
        round: Some(0),
        data_done: true,
        ..TrainerStatus::default()
    };
    let (order, _) = rounds.trainer_status("a", out.clone(), 0);
    assert!(
        matches!(order, TrainerOrder::Train { .. }),
        "b may still have data: {order:?}"
    );
    rounds.data_left(true);
    let (order, _) = rounds.trainer_status("b", out.clone(), 5);
    assert!(
        matches!(order, TrainerOrder::Train { .. }),
        "slices are on their way: {order:?}"
    );
    rounds.data_left(false);
    assert_eq!(rounds.trainer_status("b", out, 10).0, TrainerOrder::Done);
    assert_eq!(
        report(&mut rounds, server(0, &[], None), 20).0,
        ServerOrder::Done
    );
}

/// The last round applied with every trainer out of data does not end the training
/// while slices of the round go back: those of a job that ended with its update maybe
/// still on its way (a trainer killed as it sent it), and those of a departed job whose
/// update did not make the round. The run gives them back, and trainers train them.
#[test]
fn slices_going_back_with_the_last_round_are_not_the_end_of_the_data() {
    let mut rounds = Rounds::new(RoundPlan {
        rounds: None,
        ..plan()
    });
    rounds.server_started("ps".into());
    for (job, peer) in [("a", "pa"), ("b", "pb")] {
        rounds.trainer_started(job.into(), peer.into());
        rounds.trainer_status(job, status(0, 1, Some(100.0)), 0);
    }
    // b ends having trained round 0; a trains the last slice and is out of data.
    assert!(
        rounds.trainer_ended("b", 100),
        "b's update may be on its way"
    );
    rounds.trainer_status("a", last_batch(0), 200);
    let (order, _, _) = report(&mut rounds, server(0, &["pa"], None), 300);
    assert!(
        matches!(order, ServerOrder::Close { round: 0, .. }),
        "{order:?}"
    );
    // Applied without b, whose update was not heard yet.
    let applied = server(1, &[], Some((0, &["pa"])));
    assert!(rounds.applies(&applied));
    let (order, _, _) = report(&mut rounds, applied, 400);
    assert_ne!(order, ServerOrder::Done, "b's slices may go back");
    assert!(!rounds.done());

    // Round 1: a trains on; c ends with its update arrived, and the round is applied
    // without it (too late for the server): c's slices go back. b's wait is over by now.
    rounds.trainer_started("c".into(), "pc".into());
    rounds.trainer_status("c", status(1, 1, Some(100.0)), 2_500);
    rounds.trainer_status("a", last_batch(1), 2_600);
    let (order, _, _) = report(&mut rounds, server(1, &["pa"], None), 2_650);
    assert_eq!(
        order,
        ServerOrder::Trainers {
            peers: vec!["pa".into(), "pc".into()]
        },
        "b no longer"
    );
    let (order, _, _) = report(&mut rounds, server(1, &["pa", "pc"], None), 2_700);
    assert!(
        matches!(order, ServerOrder::Close { round: 1, .. }),
        "{order:?}"
    );
    assert!(rounds.trainer_ended("c", 2_800), "c's update arrived");
    let (order, settle, _) = report(&mut rounds, server(2, &[], Some((1, &["pa"]))), 2_900);
    assert!(settle.contains(&drop("c", 1)), "{settle:?}");
    assert_ne!(order, ServerOrder::Done, "c's slices go back");
    assert!(!rounds.done());
}

#[test]
fn a_lost_trainer_leaves_the_round_at_once() {
    let mut rounds = rounds_with(&[("a", "pa"), ("b", "pb")]);
    rounds.trainer_status("a", status(0, 1, Some(100.0)), 0);
    rounds.trainer_status("b", status(0, 1, Some(100.0)), 0);
    assert_eq!(
        report(&mut rounds, server(0, &["pa"], None), 100).0,
        ServerOrder::Wait
    );
    rounds.trainer_ended("b", 0);
    let (order, _, _) = report(&mut rounds, server(0, &["pa"], None), 200);
    assert_eq!(
        order,
        ServerOrder::Close {
            round: 0,
            send_to: vec!["pa".into()]
        }
    );
}

#[test]
fn trainers_taken_over_after_a_restart_rejoin_and_give_back_rounds_past_the_checkpoint() {
    // A restarted scheduler goes on from the checkpoint of round 3; the earlier server
    // may have reached round 5.
    let mut rounds = Rounds::new(RoundPlan {
        rounds: Some(10),
        ..plan()
    });
    rounds.restored(3);
    rounds.reached(5);
    rounds.trainer_taken_over("a".into(), "pa".into(), false);
    // Before the restored server runs, a trainer taken over waits.
    assert_eq!(
        rounds.trainer_status("a", status(4, 2, Some(100.0)), 0).0,
        TrainerOrder::wait(RETRY_MS)
    );
    rounds.server_started("ps".into());
    let (order, settle) = rounds.trainer_status("a", status(4, 2, Some(100.0)), 10);
    assert_eq!(
        order,
        TrainerOrder::Join {
            parameter_server: "ps".into()
        }
    );
    let dropped: Vec<u64> = settle
        .iter()
        .map(|s| match s {
            Settle::Drop { round, .. } => *round,
            Settle::Commit { round, .. } => panic!("round {round} committed"),
        })
        .collect();
    // Rounds before the checkpoint's that reached the model were committed when the run
    // resumed; dropping them finds nothing. Those left out go back.
    assert_eq!(dropped, [0, 1, 2, 3, 4], "every round it held");
    // A trainer that claims a round no server reached gives back no more than reached.
    rounds.trainer_taken_over("b".into(), "pb".into(), false);
    let (_, settle) = rounds.trainer_status("b", status(1_000_000, 2, None), 20);
    assert_eq!(settle.len(), 6, "rounds 0..=5: {settle:?}");
    // Once it holds no model of the earlier server, it trains the checkpoint's round.
    rounds.trainer_status("a", TrainerStatus::default(), 30);
    let (order, _) = rounds.trainer_status("a", status(3, 0, None), 40);
    assert!(
        matches!(order, TrainerOrder::Train { round: 3, .. }),
        "{order:?}"
    );
}

#[test]
fn trainers_mid_round_on_the_model_a_replacement_starts_from_go_on_with_it() {
    let mut rounds = Rounds::new(RoundPlan {
        rounds: Some(10),
        ..plan()
    });
    rounds.server_started("ps".into());
    for (job, peer) in [("a", "pa"), ("b", "pb"), ("c", "pc"), ("d", "pd")] {
        rounds.trainer_started(job.into(), peer.into());
        rounds.trainer_status(job, TrainerStatus::default(), 0);
        rounds.trainer_status(job, status(0, 1, Some(100.0)), 0);
    }
    report(&mut rounds, server(0, &["pa", "pb", "pc", "pd"], None), 10);
    report(
        &mut rounds,
        server(1, &[], Some((0, &["pa", "pb", "pc", "pd"]))),
        20,
    );
    let on = |hash: &str, syncing: Option<bool>| TrainerStatus {
        model_hash: Some(hash.into()),
        syncing,
        ..status(1, 1, Some(100.0))
    };
    // The standby holds round 1's model ("h1") and takes over.
    rounds.server_lost();
    rounds.restored(1);
    rounds.server_started("standby".into());
    rounds.goes_on_from("h1".into());
    // a trains round 1 on that model: it waits until the new server takes its update,
    // then goes on, its update to the new server, and nothing of its round goes back.
    let (order, settle) = rounds.trainer_status("a", on("h1", Some(false)), 25);
    assert!(matches!(order, TrainerOrder::Wait { .. }), "{order:?}");
    assert!(settle.is_empty(), "{settle:?}");
    report(&mut rounds, server(1, &[], None), 28);
    let (order, settle) = rounds.trainer_status("a", on("h1", Some(false)), 30);
    assert!(
        matches!(&order, TrainerOrder::Train { round: 1, parameter_server, .. } if parameter_server == "standby"),
        "{order:?}"
    );
    assert!(settle.is_empty(), "{settle:?}");
    // b sent its update to the lost server, c holds another model, d does not say
    // whether it is sending (an older trainer): each starts the round over.
    for (job, status) in [
        ("b", on("h1", Some(true))),
        ("c", on("h0", Some(false))),
        ("d", on("h1", None)),
    ] {
        let (order, settle) = rounds.trainer_status(job, status, 40);
        assert_eq!(
            order,
            TrainerOrder::Join {
                parameter_server: "standby".into()
            },
            "{job}"
        );
        assert_eq!(
            settle,
            vec![Settle::Drop {
                job: job.into(),
                round: 1
            }],
            "{job}"
        );
    }
    // A server started with no fingerprint to go on from (none recorded) has everyone
    // join it.
    rounds.server_lost();
    rounds.restored(1);
    rounds.server_started("ps3".into());
    let (order, _) = rounds.trainer_status("a", on("h1", Some(false)), 50);
    assert!(matches!(order, TrainerOrder::Join { .. }), "{order:?}");
}

#[test]
fn a_replaced_server_restores_its_round_and_trainers_rejoin_giving_lost_rounds_back() {
    let mut rounds = Rounds::new(RoundPlan {
        rounds: Some(10),
        ..plan()
    });
    rounds.server_started("ps".into());
    for (job, peer) in [("a", "pa"), ("b", "pb")] {
        rounds.trainer_started(job.into(), peer.into());
    }
    for job in ["a", "b"] {
        rounds.trainer_status(job, TrainerStatus::default(), 0);
    }
    // Round 0 is applied with both; round 1 with a only, then the server is lost while
    // round 2 trains. The scheduler's checkpoint holds round 1's start: round 1 is lost.
    rounds.trainer_status("a", status(0, 1, Some(100.0)), 0);
    rounds.trainer_status("b", status(0, 1, Some(100.0)), 0);
    report(&mut rounds, server(0, &["pa", "pb"], None), 10);
    report(&mut rounds, server(1, &[], Some((0, &["pa", "pb"]))), 20);
    rounds.trainer_status("a", status(1, 1, Some(100.0)), 30);
    report(&mut rounds, server(1, &["pa"], None), 13_000);
    report(&mut rounds, server(2, &[], Some((1, &["pa"]))), 13_100);
    rounds.trainer_status("a", status(2, 1, Some(100.0)), 13_200);
    assert_eq!(rounds.round(), 2);

    rounds.server_lost();
    assert_eq!(
        rounds
            .trainer_status("a", status(2, 2, Some(100.0)), 13_300)
            .0,
        TrainerOrder::wait(RETRY_MS)
    );
    rounds.restored(1);
    rounds.server_started("ps2".into());
    assert_eq!(rounds.round(), 1);
    let (order, settle) = rounds.trainer_status("a", status(2, 2, Some(100.0)), 13_400);
    assert_eq!(
        order,
        TrainerOrder::Join {
            parameter_server: "ps2".into()
        }
    );
    assert_eq!(
        settle,
        vec![
            Settle::Drop {
                job: "a".into(),
                round: 1
            },
            Settle::Drop {
                job: "a".into(),
                round: 2
            }
        ],
        "round 1 was applied by the lost server only; round 2 never was"
    );
    // b was left out of round 1 and still holds round 1's model.
    let (order, settle) = rounds.trainer_status("b", status(1, 1, Some(100.0)), 13_400);
    assert!(matches!(order, TrainerOrder::Join { .. }));
    assert_eq!(
        settle,
        vec![Settle::Drop {
            job: "b".into(),
            round: 1
        }]
    );
    // An answer to join that was lost: a is told again, with the same rounds given back.
    let (order, again) = rounds.trainer_status("a", status(2, 2, Some(100.0)), 13_450);
    assert!(matches!(order, TrainerOrder::Join { .. }));
    assert_eq!(again.len(), 2, "{again:?}");
    // Both abandon their rounds and join (no round while they wait for the new server's
    // model), then train round 1 under the new server; it is applied as round 1.
    for job in ["a", "b"] {
        let (order, settle) = rounds.trainer_status(job, TrainerStatus::default(), 13_480);
        assert!(
            matches!(order, TrainerOrder::Join { ref parameter_server } if parameter_server == "ps2")
        );
        assert!(settle.is_empty());
        let (order, settle) = rounds.trainer_status(job, status(1, 0, None), 13_500);
        assert!(
            matches!(order, TrainerOrder::Train { round: 1, ref parameter_server, .. } if parameter_server == "ps2")
        );
        assert!(settle.is_empty());
    }
    rounds.trainer_status("a", status(1, 3, Some(100.0)), 14_000);
    rounds.trainer_status("b", status(1, 3, Some(100.0)), 14_000);
    assert!(matches!(
        report(&mut rounds, server(1, &["pa", "pb"], None), 14_100).0,
        ServerOrder::Close { round: 1, .. }
    ));
    let (_, settle, applied) = report(
        &mut rounds,
        server(2, &[], Some((1, &["pa", "pb"]))),
        14_200,
    );
    assert_eq!(applied.unwrap().round, 1);
    assert_eq!(settle.len(), 2);
}

#[test]
fn a_server_that_went_on_is_resumed_at_its_round_and_trainers_train_on_with_it() {
    // A restarted scheduler goes on from the checkpoint of round 3. The earlier process
    // heard rounds 3 (a and b) and 4 (a only) applied; the server applied round 5 (a and
    // b) and collects round 6.
    let start = || {
        let mut rounds = Rounds::new(RoundPlan {
            rounds: Some(10),
            ..plan()
        });
        rounds.restored(3);
        rounds.reached(6);
        rounds
    };
    let recorded = [(3, "pa".to_string()), (3, "pb".into()), (4, "pa".into())];
    // What does not fit is refused, and changes nothing.
    let mut rounds = start();
    for (status, why) in [
        (
            server(7, &[], Some((6, &["pa"]))),
            "past what the job can have reached",
        ),
        (server(2, &[], None), "before the checkpoint"),
        (server(6, &[], Some((5, &["pa"]))), "round 4 missing"),
        (ServerStatus::default(), "no model"),
    ] {
        let recorded = if why == "round 4 missing" {
            &recorded[..2]
        } else {
            &recorded[..]
        };
        assert!(
            rounds
                .server_resumed("ps".into(), &status, recorded)
                .is_err(),
            "{why}"
        );
        assert_eq!(rounds.round(), 3, "{why}");
    }
    let mut rounds = start();
    let first = server(6, &["pa", "pb"], Some((5, &["pa", "pb"])));
    let unheard = rounds
        .server_resumed("ps".into(), &first, &recorded)
        .unwrap();
    assert_eq!(
        unheard.map(|a| a.round),
        Some(5),
        "its last round was not heard"
    );
    assert_eq!(rounds.round(), 6);
    // Pseudo-gradients arrived while the scheduler was away; the round does not close
    // before the trainers are known, or the new model would go to nobody.
    assert_eq!(rounds.server_status(first, 5).0, ServerOrder::Wait);
    // Trainers taken over now train on with it, without joining; each gives back the
    // rounds it was left out of since the checkpoint.
    rounds.trainer_taken_over("a".into(), "pa".into(), false);
    rounds.trainer_taken_over("b".into(), "pb".into(), false);
    let (order, settle) = rounds.trainer_status("a", status(6, 2, Some(100.0)), 10);
    assert!(
        matches!(order, TrainerOrder::Train { round: 6, ref parameter_server, .. } if parameter_server == "ps"),
        "{order:?}"
    );
    assert!(settle.is_empty(), "{settle:?}");
    let (order, settle) = rounds.trainer_status("b", status(6, 1, Some(100.0)), 10);
    assert!(
        matches!(order, TrainerOrder::Train { round: 6, .. }),
        "{order:?}"
    );
    assert_eq!(
        settle,
        vec![Settle::Drop {
            job: "b".into(),
            round: 4
        }]
    );
    // The round closes and is applied as round 6.
    rounds.trainer_status("a", status(6, 5, Some(100.0)), 20);
    rounds.trainer_status("b", status(6, 5, Some(100.0)), 20);
    assert!(matches!(
        report(&mut rounds, server(6, &["pa", "pb"], None), 30).0,
        ServerOrder::Close { round: 6, .. }
    ));
    let (_, settle, applied) = report(&mut rounds, server(7, &[], Some((6, &["pa", "pb"]))), 40);
    assert_eq!(applied.unwrap().round, 6);
    assert_eq!(settle.len(), 2);
    // A server that replaces it later is a new one: trainers taken over then rejoin.
    rounds.server_lost();
    rounds.restored(7);
    rounds.server_started("ps2".into());
    rounds.trainer_taken_over("c".into(), "pc".into(), false);
    let (order, _) = rounds.trainer_status("c", status(7, 1, None), 50);
    assert!(matches!(order, TrainerOrder::Join { .. }), "{order:?}");
}

#[test]
fn a_trainer_that_ends_after_its_update_arrived_is_settled_with_the_round() {
    let mut rounds = rounds_with(&[("a", "pa"), ("b", "pb")]);
    for job in ["a", "b"] {
        rounds.trainer_status(job, TrainerStatus::default(), 0);
        rounds.trainer_status(job, status(0, 2, Some(100.0)), 0);
    }
    report(&mut rounds, server(0, &["pa"], None), 10);
    // a's update is at the server when its job ends; b's is not when its job ends, and
    // the server's statuses of the next second do not name it either: its slices go back.
    assert!(
        rounds.trainer_ended("a", 10),
        "a's slices wait for the round"
    );
    assert!(rounds.departed("a"));
    assert!(
        rounds.trainer_ended("b", 10),
        "b's update may be on its way"
    );
    report(&mut rounds, server(0, &["pa"], None), 11);
    report(&mut rounds, server(0, &["pa"], None), 12);
    assert!(rounds.departed("b"), "statuses in a burst are not a second");
    report(&mut rounds, server(0, &["pa"], None), 1_010);
    assert!(!rounds.departed("b"), "b's slices go back");
    // A new job on a's peer is not credited with a's update.
    rounds.trainer_started("a2".into(), "pa".into());
    rounds.trainer_status("a2", TrainerStatus::default(), 20);
    report(&mut rounds, server(0, &["pa"], None), 13_000);
    let (_, settle, applied) = report(&mut rounds, server(1, &[], Some((0, &["pa"]))), 13_100);
    assert_eq!(applied.unwrap().included, ["pa"]);
    assert_eq!(
        settle,
        vec![Settle::Commit {
            job: "a".into(),
            round: 0
        }]
    );
    assert!(!rounds.departed("a"));
    // Had the server been lost instead, a's round would have gone back.
    let mut rounds = rounds_with(&[("a", "pa")]);
    rounds.trainer_status("a", TrainerStatus::default(), 0);
    rounds.trainer_status("a", status(0, 2, Some(100.0)), 0);
    report(&mut rounds, server(0, &["pa"], None), 10);
    rounds.trainer_ended("a", 0);
    rounds.server_lost();
    assert_eq!(
        rounds.abandon_departed(),
        vec![Settle::Drop {
            job: "a".into(),
            round: 0
        }]
    );
}

/// A trainer killed in the last round of the data, its update never coming: the server's
/// status that applies the round without it may be the one after which its wait is over.
/// Its slices of the round go back with that status, so the training is not over: the data
/// is not. (Before, the training ended and the slices went back after it: the run failed
/// with slices never used.)
#[test]
fn the_slices_of_a_killed_trainers_last_round_are_not_the_end_of_the_data() {
    let mut rounds = rounds_with(&[("a", "pa"), ("b", "pb")]);
    for job in ["a", "b"] {
        rounds.trainer_status(job, TrainerStatus::default(), 0);
        rounds.trainer_status(job, last_batch(0), 0);
    }
    rounds.data_left(false);
    assert!(
        rounds.trainer_ended("a", 10),
        "a's update may be on its way"
    );
    let (order, _, _) = report(&mut rounds, server(0, &["pb"], None), 20);
    assert!(
        matches!(order, ServerOrder::Close { round: 0, .. }),
        "{order:?}"
    );
    let (_, settle, applied) = report(&mut rounds, server(1, &[], Some((0, &["pb"]))), 1_500);
    assert_eq!(applied.unwrap().round, 0);
    assert!(
        settle.contains(&Settle::Drop {
            job: "a".into(),
            round: 0
        }),
        "{settle:?}"
    );
    assert!(settle.contains(&Settle::Commit {
        job: "b".into(),
        round: 0
    }));
    assert!(!rounds.departed("a"));
    assert!(!rounds.done(), "a's slices are data to train");
}

/// A worker killed while its trainer trained a round comes back, and the scheduler runs a
/// new job there. The server takes one update of a peer a round, so the new job sits the
/// round out: the round does not wait for it, the peer's update in it is the earlier job's,
/// and the new job trains the next round.
#[test]
fn a_new_job_on_the_peer_of_one_that_left_the_round_sits_it_out() {
    let mut rounds = rounds_with(&[("a", "pa"), ("b", "pb")]);
    for job in ["a", "b"] {
        rounds.trainer_status(job, TrainerStatus::default(), 0);
        rounds.trainer_status(job, status(0, 2, Some(100.0)), 0);
    }
    assert!(
        rounds.trainer_ended("a", 10),
        "a's update may be on its way"
    );
    rounds.trainer_started("a2".into(), "pa".into());
    rounds.trainer_status("a2", TrainerStatus::default(), 20);
    let (order, settle) = rounds.trainer_status("a2", status(0, 0, None), 30);
    assert!(matches!(order, TrainerOrder::Wait { .. }), "{order:?}");
    assert!(settle.is_empty());
    // a's update and b's arrive: the round closes without waiting for a2.
    let (order, _, _) = report(&mut rounds, server(0, &["pa", "pb"], None), 40);
    assert!(
        matches!(order, ServerOrder::Close { round: 0, .. }),
        "{order:?}"
    );
    let (_, settle, _) = report(&mut rounds, server(1, &[], Some((0, &["pa", "pb"]))), 50);
    assert_eq!(settle.len(), 2, "{settle:?}");
    for job in ["a", "b"] {
        assert!(settle.contains(&Settle::Commit {
            job: job.into(),
            round: 0
        }));
    }
    let (order, _) = rounds.trainer_status("a2", status(1, 0, None), 60);
    assert!(
        matches!(order, TrainerOrder::Train { round: 1, .. }),
        "{order:?}"
    );
}

/// The new job on a killed trainer's peer was told to train the round before the earlier
/// job's end was known, and trained in it: the server holds one of the two updates, and
/// which cannot be told. Both jobs' slices of the round go back (none is counted used that
/// the model may not hold), so the data is not over and the run trains them again; before,
/// the new job's slices waited for its end, and a run that ended with them held failed with
/// slices never used.
#[test]
fn two_jobs_of_one_peer_in_a_round_both_give_its_slices_back() {
    let mut rounds = rounds_with(&[("a", "pa"), ("b", "pb")]);
    for job in ["a", "b"] {
        rounds.trainer_status(job, TrainerStatus::default(), 0);
        rounds.trainer_status(job, status(0, 2, Some(100.0)), 0);
    }
    rounds.trainer_started("a2".into(), "pa".into());
    rounds.trainer_status("a2", TrainerStatus::default(), 5);
    let (order, _) = rounds.trainer_status("a2", status(0, 0, None), 6);
    assert!(matches!(order, TrainerOrder::Train { round: 0, .. }));
    rounds.trainer_status("a2", status(0, 2, Some(100.0)), 8);
    assert!(rounds.trainer_ended("a", 10));
    report(&mut rounds, server(0, &["pa", "pb"], None), 20);
    let (_, settle, _) = report(&mut rounds, server(1, &[], Some((0, &["pa", "pb"]))), 30);
    let mut settle = settle;
    settle.sort_by_key(|s| format!("{s:?}"));
    assert_eq!(
        settle,
        vec![
            Settle::Commit {
                job: "b".into(),
                round: 0
            },
            Settle::Drop {
                job: "a".into(),
                round: 0
            },
            Settle::Drop {
                job: "a2".into(),
                round: 0
            },
        ]
    );
    // Its later rounds settle as any trainer's.
    rounds.trainer_status("a2", status(1, 2, Some(100.0)), 40);
    report(&mut rounds, server(1, &["pa", "pb"], None), 45);
    let (_, settle, _) = report(&mut rounds, server(2, &[], Some((1, &["pa", "pb"]))), 50);
    assert!(
        settle.contains(&Settle::Commit {
            job: "a2".into(),
            round: 1
        }),
        "{settle:?}"
    );
}

/// A trainer that leaves (told to stop, or killed) right after sending its update is
/// settled with the round when the server reports the update after the job's end; one
/// that trained nothing in the round gives its slices back at once.
#[test]
fn a_trainer_that_ends_as_its_update_arrives_is_settled_with_the_round() {
    let mut rounds = rounds_with(&[("a", "pa"), ("b", "pb"), ("c", "pc")]);
    for job in ["a", "b", "c"] {
        rounds.trainer_status(job, TrainerStatus::default(), 0);
    }
    rounds.trainer_status("a", status(0, 2, Some(100.0)), 0);
    rounds.trainer_status("b", status(0, 2, Some(100.0)), 0);
    rounds.trainer_status("c", status(0, 0, None), 0);
    assert!(rounds.trainer_ended("a", 0));
    assert!(
        !rounds.trainer_ended("c", 0),
        "c trained nothing: its slices go back"
    );
    assert!(
        rounds.server_trainers().contains("pa"),
        "the server keeps taking a's update"
    );
    report(&mut rounds, server(0, &["pa"], None), 10);
    report(&mut rounds, server(0, &["pa", "pb"], None), 20);
    let (_, settle, applied) = report(&mut rounds, server(1, &[], Some((0, &["pa", "pb"]))), 30);
    assert_eq!(applied.unwrap().round, 0);
    assert!(settle.contains(&Settle::Commit {
        job: "a".into(),
        round: 0
    }));
    assert!(!rounds.departed("a"));
}

#[test]
fn a_trainer_still_to_join_joins_the_server_that_went_on() {
    let mut rounds = Rounds::new(RoundPlan {
        rounds: Some(10),
        ..plan()
    });
    rounds.restored(3);
    rounds.reached(4);
    rounds
        .server_resumed("ps".into(), &server(3, &[], None), &[])
        .unwrap();
    rounds.trainer_taken_over("a".into(), "pa".into(), true);
    assert!(rounds.must_rejoin("a"));
    let (order, _) = rounds.trainer_status("a", status(7, 1, None), 10);
    assert!(matches!(order, TrainerOrder::Join { .. }), "{order:?}");
    rounds.trainer_taken_over("b".into(), "pb".into(), false);
    assert!(!rounds.must_rejoin("b"));
}

/// Issue 56: one trainer scores the global model on the held-out data every `eval_every`
/// rounds and the last, asked in the round that leads to the model: the first that says it
/// can (a Python trainer of the SDK does not), another once it is out of data. Told the
/// training is over, it waits until it reported the last model's score.
#[test]
fn one_trainer_scores_the_models_due_and_the_last_one_before_the_end() {
    let mut rounds = Rounds::new(RoundPlan {
        rounds: Some(4),
        eval_every: Some(2),
        ..plan()
    });
    rounds.server_started("ps".into());
    for job in ["a", "b", "c"] {
        rounds.trainer_started(job.to_string(), format!("peer-{job}"));
    }
    let can = |status: TrainerStatus| TrainerStatus {
        evaluates: true,
        ..status
    };
    let evaluate =
        |order: &TrainerOrder| matches!(order, TrainerOrder::Train { evaluate: true, .. });
    let mut asked = Vec::new();
    let mut now = 0;
    for round in 0..4 {
        for job in ["a", "b", "c"] {
            let mut status = status(round, 1, Some(10.0));
            if job != "a" {
                status = can(status);
            }
            if job == "b" && round == 3 {
                // Out of data: it hands the scoring on.
                status.data_done = true;
                status.samples = 0;
                status.batches = 0;
            }
            if job == "b" && round == 2 {
                status.eval = Some(Evaluation {
                    round: 2,
                    loss: 0.5,
                    scored: 100,
                    accuracy: None,
                });
            }
            let (order, _) = rounds.trainer_status(job, status, now);
            if evaluate(&order) {
                asked.push((round, job));
            }
        }
        now += 1000;
        let included: &[&str] = if round == 3 {
            &["peer-a", "peer-c"]
        } else {
            &["peer-a", "peer-b", "peer-c"]
        };
        report(&mut rounds, server(round, included, None), now);
        report(
            &mut rounds,
            server(round + 1, &[], Some((round, included))),
            now,
        );
    }
    // The model of round 2 by b, asked in round 1; that of round 4, the last, by c, b being
    // out of data.
    assert_eq!(asked, [(1, "b"), (3, "c")], "{asked:?}");
    assert!(rounds.done());
    let scored = rounds.evaluation().unwrap();
    assert_eq!((scored.0.as_str(), scored.1.round), ("peer-b", 2));
    assert!(rounds.take_news().iter().any(
        |n| matches!(n, News::Evaluated { peer, eval } if peer == "peer-b" && eval.round == 2)
    ));

    // The end: everyone else is done (b gets no last model: it was out of the last round);
    // c, which holds the last model, scores it first.
    let (order, _) = rounds.trainer_status("a", status(4, 0, None), now);
    assert_eq!(order, TrainerOrder::Done);
    let (order, _) = rounds.trainer_status("b", can(status(3, 0, None)), now);
    assert_eq!(order, TrainerOrder::Done);
    let (order, _) = rounds.trainer_status("c", can(status(4, 0, None)), now);
    assert_eq!(
        order,
        TrainerOrder::Wait {
            retry_ms: WAIT_MS,
            evaluate: true
        }
    );
    let last = Evaluation {
        round: 4,
        loss: 0.25,
        scored: 100,
        accuracy: Some(0.9),
    };
    let with_score = TrainerStatus {
        eval: Some(last),
        ..can(status(4, 0, None))
    };
    let (order, _) = rounds.trainer_status("c", with_score, now + 500);
    assert_eq!(order, TrainerOrder::Done);
    assert_eq!(rounds.evaluation().unwrap().1, last);
}

/// The last model is scored by a trainer that holds it, even one that was not asked to
/// score it as it arrived (here nobody was: no trainer said it could until the end); one
/// still waiting for it is told to wait, and scores it once it holds it. A trainer that
/// never reports the score holds the end for [`FINAL_EVAL_WAIT_MS`] at most.
#[test]
fn the_end_waits_for_the_last_score_a_minute_at_most() {
    let mut rounds = Rounds::new(RoundPlan {
        rounds: Some(1),
        eval_every: Some(10),
        ..plan()
    });
    rounds.server_started("ps".into());
    rounds.trainer_started("a".into(), "peer-a".into());
    let (order, _) = rounds.trainer_status("a", status(0, 1, Some(10.0)), 0);
    assert!(
        matches!(
            order,
            TrainerOrder::Train {
                evaluate: false,
                ..
            }
        ),
        "{order:?}"
    );
    report(&mut rounds, server(0, &["peer-a"], None), 10);
    report(&mut rounds, server(1, &[], Some((0, &["peer-a"]))), 10);
    assert!(rounds.done());
    let can = |round| TrainerStatus {
        evaluates: true,
        ..status(round, 0, None)
    };
    let (order, _) = rounds.trainer_status("a", can(0), 100);
    assert_eq!(
        order,
        TrainerOrder::wait(WAIT_MS),
        "still waiting for the model"
    );
    let (order, _) = rounds.trainer_status("a", can(1), 200);
    assert!(
        matches!(order, TrainerOrder::Wait { evaluate: true, .. }),
        "{order:?}"
    );
    let (order, _) = rounds.trainer_status("a", can(1), 100 + FINAL_EVAL_WAIT_MS);
    assert_eq!(order, TrainerOrder::Done);
}
