//! The ledger as its users see it: a seeded order, exactly-once use through failures, and a
//! file that survives restarts and SIGKILL.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::{
    collections::{HashMap, HashSet},
    io::{BufRead, BufReader, Write},
    path::Path,
    process::{Command, Stdio},
};

use hypha_ledger::{
    Event, Grant, IterationSpec, Ledger, LedgerHandle, ReturnReason, SliceKey, permutation,
    read_audit,
};
use rand::{Rng, SeedableRng, rngs::StdRng};

const LEASE_MS: u64 = 10_000;

fn spec(slices: usize, epochs: u32, seed: u64) -> IterationSpec {
    IterationSpec {
        dataset: "digits".into(),
        epochs,
        seed,
        samples: (0..slices as u64).map(|i| 100 + i % 7).collect(),
    }
}

fn slices_of(grant: Grant) -> Vec<SliceKey> {
    match grant {
        Grant::Slices(slices) => slices.into_iter().map(|a| a.key).collect(),
        other => panic!("expected slices, got {other:?}"),
    }
}

/// Reads the audit and asserts that every slice of every epoch was USED exactly once.
fn assert_used_exactly_once(path: &Path) -> HashMap<SliceKey, usize> {
    let audit = read_audit(path).expect("audit");
    let mut used: HashMap<SliceKey, usize> = HashMap::new();
    for record in &audit.records {
        if let Event::Used { .. } = record.event {
            *used.entry(record.key).or_default() += 1;
        }
    }
    for epoch in 0..audit.spec.epochs {
        for slice in 0..audit.spec.slices() as u64 {
            let key = SliceKey { epoch, slice };
            assert_eq!(used.get(&key), Some(&1), "{key} was not used exactly once");
        }
    }
    assert_eq!(used.len(), audit.spec.slices() * audit.spec.epochs as usize);
    used
}

#[test]
fn the_same_seed_gives_the_same_order_whatever_the_number_of_workers() {
    let dir = tempfile::tempdir().unwrap();
    let slices = 60;
    for workers in [1usize, 3, 8] {
        let path = dir.path().join(format!("{workers}.ledger"));
        let mut ledger = Ledger::create(&path, spec(slices, 2, 99), LEASE_MS).unwrap();
        let mut handed_out: Vec<Vec<u64>> = vec![Vec::new(); 2];
        let mut now = 1_000;
        'iterate: loop {
            for w in 0..workers {
                let worker = format!("worker-{w}");
                // Workers ask for different amounts, as real ones with different speeds do.
                match ledger.assign(&worker, 1 + w % 3, &HashSet::new(), now) {
                    Grant::Slices(assigned) => {
                        let keys: Vec<SliceKey> = assigned.iter().map(|a| a.key).collect();
                        for key in &keys {
                            handed_out[key.epoch as usize].push(key.slice);
                        }
                        ledger.consume(&worker, &keys, 0, now);
                        ledger.commit_round(&worker, 0, now);
                    }
                    Grant::Finished => break 'iterate,
                    Grant::Wait => unreachable!("every slice is used at once here"),
                }
                now += 1;
            }
        }
        ledger.flush().unwrap();
        for epoch in 0..2 {
            assert_eq!(
                handed_out[epoch as usize],
                permutation(99, epoch, slices),
                "{workers} workers, epoch {epoch}"
            );
        }
        assert!(ledger.is_finished());
    }
}

#[test]
fn every_slice_is_used_once_per_epoch_through_expiries_drops_and_lost_workers() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("chaos.ledger");
    let mut ledger = Ledger::create(&path, spec(200, 3, 5), LEASE_MS).unwrap();
    let mut rng = StdRng::seed_from_u64(11);
    let mut now = 1_000u64;
    // Per worker: its assigned slices and its open round's slices.
    let mut held: HashMap<String, Vec<SliceKey>> = HashMap::new();
    let mut round_of: HashMap<String, u64> = HashMap::new();
    let mut next_worker = 0;
    let mut names: Vec<String> = (0..4).map(|i| format!("w{i}")).collect();
    next_worker += 4;
    let mut steps = 0;
    while !ledger.is_finished() {
        steps += 1;
        assert!(steps < 100_000, "the iteration never finished");
        now += rng.random_range(1..50);
        let worker = names[rng.random_range(0..names.len())].clone();
        match rng.random_range(0..100) {
            // Ask for work.
            0..40 => {
                if let Grant::Slices(slices) =
                    ledger.assign(&worker, rng.random_range(1..4), &HashSet::new(), now)
                {
                    held.entry(worker.clone())
                        .or_default()
                        .extend(slices.iter().map(|a| a.key));
                }
            }
            // Train on what it holds.
            40..75 => {
                let keys = std::mem::take(held.entry(worker.clone()).or_default());
                let round = *round_of.entry(worker.clone()).or_default();
                ledger.consume(&worker, &keys, round, now);
            }
            // Its round reaches the model (mostly) or is dropped.
            75..93 => {
                let round = round_of.entry(worker.clone()).or_default();
                if rng.random_bool(0.85) {
                    ledger.commit_round(&worker, *round, now);
                } else {
                    ledger.drop_round(&worker, *round, now);
                }
                *round += 1;
            }
            // The worker dies; a replacement joins.
            93..97 => {
                ledger.release_worker(&worker, now);
                names.retain(|n| n != &worker);
                held.remove(&worker);
                names.push(format!("w{next_worker}"));
                next_worker += 1;
            }
            // Time passes: leases lapse.
            _ => {
                now += LEASE_MS / 2;
                ledger.expire(now);
            }
        }
        if rng.random_range(0..10) == 0 {
            ledger.flush().unwrap();
        }
    }
    ledger.flush().unwrap();
    drop(ledger);
    assert_used_exactly_once(&path);
    let audit = read_audit(&path).unwrap();
    let reasons: HashSet<ReturnReason> = audit
        .records
        .iter()
        .filter_map(|r| match &r.event {
            Event::Returned { reason, .. } => Some(*reason),
            _ => None,
        })
        .collect();
    // The run exercised every way back to AVAILABLE.
    assert_eq!(reasons.len(), 3, "{reasons:?}");
}

#[test]
fn a_lapsed_lease_returns_slices_and_a_late_consume_counts_only_if_nobody_took_them() {
    let dir = tempfile::tempdir().unwrap();
    let mut ledger = Ledger::create(&dir.path().join("l"), spec(10, 1, 1), LEASE_MS).unwrap();
    let a = slices_of(ledger.assign("a", 2, &HashSet::new(), 0));
    assert_eq!(ledger.expire(LEASE_MS - 1), 0, "the lease still runs");
    ledger.renew("a", 5_000);
    assert_eq!(ledger.expire(LEASE_MS + 1), 0, "renewed");
    assert_eq!(ledger.expire(5_000 + LEASE_MS + 1), 2);
    // b takes the first of a's slices back; the second stays AVAILABLE.
    let b = slices_of(ledger.assign("b", 1, &HashSet::new(), 20_000));
    assert_eq!(b, [a[0]]);
    let late = ledger.consume("a", &a, 0, 20_001);
    assert_eq!(late.accepted, [a[1]]);
    assert_eq!(late.refused, [a[0]]);
    let progress = ledger.progress(20_002);
    let epoch = &progress.epochs[0];
    assert_eq!(
        (epoch.available, epoch.assigned, epoch.consumed, epoch.used),
        (8, 1, 1, 0)
    );
}

/// A worker of the run cannot use up slices it was never given: consuming AVAILABLE slices
/// that nobody assigned it, or that another worker held last, is refused and leaves them for
/// others. (Checked by accepting every AVAILABLE slice in `consume`: the test fails.)
#[test]
fn a_worker_cannot_consume_slices_it_was_never_given() {
    let dir = tempfile::tempdir().unwrap();
    let mut ledger = Ledger::create(&dir.path().join("l"), spec(10, 1, 1), LEASE_MS).unwrap();
    let a = slices_of(ledger.assign("a", 2, &HashSet::new(), 0));
    let never_given: Vec<SliceKey> = (0..10)
        .map(|slice| SliceKey { epoch: 0, slice })
        .filter(|k| !a.contains(k))
        .collect();
    let grabbed = ledger.consume("mallory", &never_given, 0, 1);
    assert!(grabbed.accepted.is_empty(), "{:?}", grabbed.accepted);
    assert_eq!(grabbed.refused.len(), 8);
    // Slices a held whose lease lapsed are a's to report, not anyone else's.
    assert_eq!(ledger.expire(LEASE_MS + 1), 2);
    assert!(
        ledger
            .consume("mallory", &a, 0, LEASE_MS + 2)
            .accepted
            .is_empty()
    );
    assert_eq!(ledger.consume("a", &a, 0, LEASE_MS + 3).accepted, a);
    let progress = ledger.progress(LEASE_MS + 4);
    let epoch = &progress.epochs[0];
    assert_eq!((epoch.available, epoch.consumed), (8, 2));
}

#[test]
fn a_resumed_iteration_gives_back_what_was_consumed_and_keeps_what_going_jobs_fetched_ahead() {
    let dir = tempfile::tempdir().unwrap();
    let mut ledger = Ledger::create(&dir.path().join("l"), spec(10, 1, 1), LEASE_MS).unwrap();
    let a = slices_of(ledger.assign("a", 5, &HashSet::new(), 0));
    let b = slices_of(ledger.assign("b", 3, &HashSet::new(), 0));
    ledger.consume("a", &a[..2], 0, 1);
    ledger.commit_round("a", 0, 2);
    ledger.consume("a", &a[2..3], 1, 3);
    ledger.consume("a", &a[3..4], 2, 3);
    ledger.consume("b", &b[..1], 0, 3);
    // a goes on after the restart, with rounds from 2 still open: its round-1 slice goes
    // back, its round-2 one stays consumed and its last one stays its own; b does not go on:
    // everything it held goes back.
    let returned = ledger.release_all(&["a".to_string()], 2, 4);
    assert_eq!(returned, 1 + 3);
    let progress = ledger.progress(5);
    let epoch = &progress.epochs[0];
    assert_eq!(
        (epoch.available, epoch.assigned, epoch.consumed, epoch.used),
        (6, 1, 1, 2)
    );
    assert_eq!(
        ledger.commit_round("a", 2, 6),
        &a[3..4],
        "round 2 is a's still"
    );
    let late = ledger.consume("a", &a[4..], 3, 6);
    assert_eq!(
        late.accepted,
        &a[4..],
        "a's fetched-ahead slice is still a's"
    );
}

/// A trainer that ended with a round not yet in a checkpoint: what it fetched ahead goes back
/// at once, what it consumed waits for its round.
#[test]
fn a_gone_worker_s_fetched_ahead_slices_go_back_before_its_rounds_are_settled() {
    let dir = tempfile::tempdir().unwrap();
    let mut ledger = Ledger::create(&dir.path().join("l"), spec(10, 1, 1), LEASE_MS).unwrap();
    let got = slices_of(ledger.assign("a", 3, &HashSet::new(), 0));
    ledger.consume("a", &got[..1], 0, 1);
    assert_eq!(ledger.release_assigned("a", 2), 2);
    let epoch = &ledger.progress(3).epochs[0];
    assert_eq!((epoch.available, epoch.assigned, epoch.consumed), (9, 0, 1));
    assert_eq!(
        ledger.commit_round("a", 0, 4),
        &got[..1],
        "its round is still its"
    );
    assert_eq!(ledger.progress(5).epochs[0].used, 1);
}

#[test]
fn grants_a_worker_says_it_never_received_are_available_again() {
    let dir = tempfile::tempdir().unwrap();
    let mut ledger = Ledger::create(&dir.path().join("l"), spec(10, 1, 1), LEASE_MS).unwrap();
    let received = slices_of(ledger.assign("a", 2, &HashSet::new(), 0));
    // The answer to the next request was lost on its way.
    let lost = slices_of(ledger.assign("a", 3, &HashSet::new(), 1));
    ledger.consume("a", &received[..1], 0, 2);
    let holding: HashSet<SliceKey> = received[1..].iter().copied().collect();
    assert_eq!(ledger.release_unheld("a", &holding, 3), lost.len());
    assert_eq!(ledger.release_unheld("a", &holding, 4), 0, "idempotent");
    let epoch = &ledger.progress(5).epochs[0];
    assert_eq!((epoch.available, epoch.assigned, epoch.consumed), (8, 1, 1));
    ledger.flush().unwrap();
    drop(ledger);
    let never_received = read_audit(&dir.path().join("l"))
        .unwrap()
        .records
        .iter()
        .filter(|r| {
            matches!(
                r.event,
                Event::Returned {
                    reason: ReturnReason::NeverReceived,
                    ..
                }
            )
        })
        .count();
    assert_eq!(never_received, lost.len());
}

#[test]
fn workers_get_slices_they_hold_first() {
    let dir = tempfile::tempdir().unwrap();
    let mut ledger = Ledger::create(&dir.path().join("l"), spec(100, 1, 3), LEASE_MS).unwrap();
    let order = permutation(3, 0, 100);
    let cached: HashSet<u64> = [order[40], order[70]].into();
    let got = slices_of(ledger.assign("a", 3, &cached, 0));
    let got: Vec<u64> = got.iter().map(|k| k.slice).collect();
    assert_eq!(got, [order[40], order[70], order[0]]);
}

#[test]
fn progress_counts_per_epoch_and_per_worker() {
    let dir = tempfile::tempdir().unwrap();
    let mut ledger = Ledger::create(&dir.path().join("l"), spec(4, 2, 3), LEASE_MS).unwrap();
    let keys = slices_of(ledger.assign("a", 4, &HashSet::new(), 0));
    ledger.consume("a", &keys[..3], 7, 1_000);
    ledger.commit_round("a", 7, 2_000);
    let next = slices_of(ledger.assign("b", 2, &HashSet::new(), 3_000));
    assert!(
        next.iter().all(|k| k.epoch == 1),
        "epoch 0 has nothing AVAILABLE"
    );
    let progress = ledger.progress(4_000);
    let counts: Vec<_> = progress
        .epochs
        .iter()
        .map(|e| (e.available, e.assigned, e.consumed, e.used))
        .collect();
    assert_eq!(counts, [(0, 1, 0, 3), (2, 2, 0, 0)]);
    let a = &progress.workers[0];
    assert_eq!((a.worker.as_str(), a.assigned, a.used), ("a", 1, 3));
    let samples: u64 = keys[..3].iter().map(|k| 100 + k.slice % 7).sum();
    assert_eq!(a.samples_used, samples);
    assert!((a.samples_per_s - samples as f64 / 30.0).abs() < 1e-9);
}

#[test]
fn a_ledger_resumes_from_its_file_and_refuses_another_iteration() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("l");
    let mut ledger = Ledger::create(&path, spec(20, 1, 8), LEASE_MS).unwrap();
    let token = ledger.token();
    let first = slices_of(ledger.assign("a", 5, &HashSet::new(), 0));
    ledger.consume("a", &first[..3], 0, 1);
    ledger.commit_round("a", 0, 2);
    ledger.flush().unwrap();
    // Not flushed: lost with the process, as a caller was never told it happened.
    ledger.assign("b", 5, &HashSet::new(), 3);
    let before = ledger.progress(4);
    drop(ledger);

    let err = Ledger::open_or_create(&path, spec(21, 1, 8), LEASE_MS, 10).unwrap_err();
    assert!(err.to_string().contains("remove the file"), "{err}");
    let other: hypha_ledger::CheckpointToken = "abc.0123456789abcdef".parse().unwrap();
    assert!(Ledger::resume(&path, &other, LEASE_MS, 10).is_err());
    assert!("nonsense".parse::<hypha_ledger::CheckpointToken>().is_err());

    let mut resumed = Ledger::resume(&path, &token, LEASE_MS, 10).unwrap();
    let after = resumed.progress(10);
    assert_eq!(after.epochs[0].used, 3);
    assert_eq!(after.epochs[0].assigned, 2, "a's two unconsumed slices");
    assert_eq!(before.epochs[0].assigned, 7);
    // The order continues where the file left off.
    let next = slices_of(resumed.assign("c", 1, &HashSet::new(), 11));
    assert_eq!(next[0].slice, permutation(8, 0, 20)[5]);
    // a's slices got a fresh lease at the restart, and lapse one lease later.
    assert_eq!(resumed.expire(10 + LEASE_MS + 1), 2);
}

/// Run by [`a_ledger_killed_mid_commit_keeps_every_acknowledged_transition`] in a child
/// process: iterates forever through a [`LedgerHandle`] and prints each acknowledged use.
#[test]
#[ignore = "a child process of the SIGKILL test"]
fn child_iterates_until_killed() {
    let Ok(path) = std::env::var("LEDGER_CHILD_PATH") else {
        return;
    };
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let ledger = Ledger::create(Path::new(&path), spec(5_000, 1, 4), LEASE_MS).unwrap();
        let (handle, _task) = LedgerHandle::spawn(ledger);
        let mut workers = Vec::new();
        for w in 0..8 {
            let handle = handle.clone();
            workers.push(tokio::spawn(async move {
                let worker = format!("w{w}");
                let mut round = 0;
                loop {
                    let Ok(Grant::Slices(slices)) = handle.assign(&worker, 2, HashSet::new()).await
                    else {
                        return;
                    };
                    let keys: Vec<SliceKey> = slices.iter().map(|a| a.key).collect();
                    handle.consume(&worker, keys, round).await.unwrap();
                    let used = handle.commit_round(&worker, round).await.unwrap();
                    let mut out = std::io::stdout().lock();
                    for key in used {
                        writeln!(out, "used {}", key.slice).unwrap();
                    }
                    out.flush().unwrap();
                    round += 1;
                }
            }));
        }
        for worker in workers {
            let _ = worker.await;
        }
    });
}

#[test]
fn a_ledger_killed_mid_commit_keeps_every_acknowledged_transition() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("killed.ledger");
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_iterates_until_killed",
            "--ignored",
            "--nocapture",
        ])
        .env("LEDGER_CHILD_PATH", &path)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = BufReader::new(child.stdout.take().unwrap());
    let mut acknowledged = HashSet::new();
    for line in stdout.lines() {
        let line = line.unwrap();
        if let Some(slice) = line.strip_prefix("used ") {
            acknowledged.insert(slice.parse::<u64>().unwrap());
            if acknowledged.len() >= 1_000 {
                break;
            }
        }
    }
    nix_kill(child.id());
    child.wait().unwrap();
    assert!(acknowledged.len() >= 1_000, "the child stopped early");

    let audit = read_audit(&path).expect("a killed ledger opens");
    let mut used = HashMap::new();
    for record in &audit.records {
        if let Event::Used { .. } = record.event {
            *used.entry(record.key.slice).or_insert(0) += 1;
        }
    }
    assert!(used.values().all(|&n| n == 1), "a slice was used twice");
    for slice in &acknowledged {
        assert!(
            used.contains_key(slice),
            "acknowledged slice {slice} was lost"
        );
    }

    // It resumes and finishes with every slice used once.
    let mut ledger = Ledger::resume(&path, &audit.token, LEASE_MS, 0).unwrap();
    let mut now = 1;
    loop {
        ledger.expire(now + LEASE_MS + 1);
        now += LEASE_MS + 2;
        match ledger.assign("finisher", 500, &HashSet::new(), now) {
            Grant::Slices(slices) => {
                let keys: Vec<SliceKey> = slices.iter().map(|a| a.key).collect();
                ledger.consume("finisher", &keys, 0, now);
                ledger.commit_round("finisher", 0, now);
            }
            Grant::Wait => {
                // Slices the killed workers consumed into rounds that never closed.
                for w in 0..8 {
                    ledger.release_worker(&format!("w{w}"), now);
                }
            }
            Grant::Finished => break,
        }
    }
    ledger.flush().unwrap();
    drop(ledger);
    assert_used_exactly_once(&path);
}

fn nix_kill(pid: u32) {
    use nix::{sys::signal, unistd::Pid};
    signal::kill(Pid::from_raw(pid as i32), signal::Signal::SIGKILL).unwrap();
}
