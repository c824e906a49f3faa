#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::time::{Duration, Instant};

use hypha_messages::market::{Advertisement, ExecutorRef, MARKET_VERSION, Resources};
use hypha_worker::{
    arbiter::{Arbiter, Dropped, Pricing, Strategy},
    lease::{LeaseError, LeaseManager, Stage},
};

const NOW: u64 = 1_000_000;

fn capacity() -> Resources {
    Resources {
        cpu: 16.0,
        memory: 64.0,
        storage: 500.0,
        gpu: 24.0,
    }
}

fn train() -> ExecutorRef {
    ExecutorRef {
        class: "train".into(),
        name: "diloco-transformer".into(),
    }
}

fn ad(id: &str, bid: f64, cpu: f64, memory: f64) -> Advertisement {
    Advertisement {
        version: MARKET_VERSION,
        id: id.into(),
        resources: Resources {
            cpu,
            memory,
            storage: 0.0,
            gpu: 0.0,
        },
        executor: train(),
        bid,
        deadline_ms: NOW + 5_000,
    }
}

fn arbiter(strategy: Strategy) -> Arbiter {
    Arbiter::new(
        Pricing {
            price: 150.0,
            floor: 120.0,
            strategy,
        },
        capacity(),
        [train()],
    )
}

#[test]
fn floor_deadline_executor_and_version_drop_advertisements() {
    let a = arbiter(Strategy::Flexible);
    let all = capacity();
    assert_eq!(
        a.quote(&ad("low", 119.0, 1.0, 1.0), all, NOW),
        Err(Dropped::BelowFloor)
    );
    let mut late = ad("late", 200.0, 1.0, 1.0);
    late.deadline_ms = NOW;
    assert_eq!(a.quote(&late, all, NOW), Err(Dropped::PastDeadline));
    let mut other = ad("other", 200.0, 1.0, 1.0);
    other.executor.name = "something-else".into();
    assert_eq!(a.quote(&other, all, NOW), Err(Dropped::UnknownExecutor));
    let mut future = ad("v2", 200.0, 1.0, 1.0);
    future.version = MARKET_VERSION + 1;
    assert_eq!(a.quote(&future, all, NOW), Err(Dropped::OtherVersion));
    assert_eq!(
        a.quote(&ad("huge", 900.0, 32.0, 1.0), all, NOW),
        Err(Dropped::Insufficient)
    );
    let mut nan = ad("nan", f64::NAN, 1.0, 1.0);
    nan.bid = f64::NAN;
    assert_eq!(a.quote(&nan, all, NOW), Err(Dropped::BelowFloor));
}

#[test]
fn flexible_mirrors_bids_that_meet_the_price_for_the_share_asked() {
    let a = arbiter(Strategy::Flexible);
    // Half the cores and a quarter of the memory: a share of 0.5, so the bid must reach 75 —
    // but the floor (120) is higher, so 120 is the real threshold here.
    let half = ad("half", 125.0, 8.0, 16.0);
    let q = a.quote(&half, capacity(), NOW).unwrap();
    assert_eq!(q.price, 125.0, "flexible mirrors the bid");
    assert_eq!(
        q.resources, half.resources,
        "and reserves exactly what was asked"
    );
    // The whole worker: share 1.0, the bid must reach the price.
    assert_eq!(
        a.quote(&ad("all-cheap", 140.0, 16.0, 64.0), capacity(), NOW)
            .unwrap_err(),
        Dropped::BelowPrice
    );
    assert!(
        a.quote(&ad("all", 150.0, 16.0, 64.0), capacity(), NOW)
            .is_ok()
    );
}

#[test]
fn whole_offers_everything_at_the_higher_of_bid_and_price_and_is_never_shared() {
    let a = arbiter(Strategy::Whole);
    let q = a
        .quote(&ad("small", 130.0, 1.0, 1.0), capacity(), NOW)
        .unwrap();
    assert_eq!(q.price, 150.0, "max(bid, price)");
    assert_eq!(q.resources, capacity());
    let q = a
        .quote(&ad("rich", 400.0, 1.0, 1.0), capacity(), NOW)
        .unwrap();
    assert_eq!(q.price, 400.0);
    let partly_leased = Resources {
        cpu: 15.0,
        ..capacity()
    };
    assert_eq!(
        a.quote(&ad("small", 130.0, 1.0, 1.0), partly_leased, NOW),
        Err(Dropped::Insufficient)
    );
}

#[test]
fn batches_are_granted_by_price_while_resources_last() {
    let a = arbiter(Strategy::Flexible);
    let batch = vec![
        ad("cheap", 121.0, 8.0, 8.0),
        ad("best", 300.0, 8.0, 8.0),
        ad("good", 200.0, 8.0, 8.0),
        ad("too-low", 100.0, 1.0, 1.0),
    ];
    let granted: Vec<String> = a
        .select(&batch, capacity(), NOW)
        .into_iter()
        .map(|(ad, _)| ad.id)
        .collect();
    assert_eq!(
        granted,
        ["best", "good"],
        "16 cores hold two 8-core requests, the best paid"
    );

    let whole = arbiter(Strategy::Whole);
    let granted = whole.select(&batch, capacity(), NOW);
    assert_eq!(granted.len(), 1, "a whole worker takes one job");
    assert_eq!(granted[0].0.id, "best");
}

#[test]
fn leases_never_double_book_and_expire_on_their_own() {
    let t0 = Instant::now();
    let mut leases = LeaseManager::new(capacity());
    let eight = Resources {
        cpu: 8.0,
        ..Resources::default()
    };
    let offer_a = leases.reserve(eight, Duration::from_secs(2), t0).unwrap();
    let offer_b = leases.reserve(eight, Duration::from_secs(2), t0).unwrap();
    assert_eq!(
        leases.reserve(eight, Duration::from_secs(2), t0),
        Err(LeaseError::Insufficient),
        "both offers hold their cores"
    );
    assert_eq!(leases.available(t0).cpu, 0.0);

    // A accepts in time and renews; B's scheduler never answers.
    let t1 = t0 + Duration::from_secs(1);
    leases.accept(offer_a, Duration::from_secs(10), t1).unwrap();
    let t3 = t0 + Duration::from_secs(3);
    assert_eq!(
        leases.accept(offer_b, Duration::from_secs(10), t3),
        Err(LeaseError::Unknown),
        "an offer accepted too late"
    );
    assert_eq!(
        leases.available(t3).cpu,
        8.0,
        "B's cores are free again without any message"
    );
    let expired = leases.expire(t3);
    assert_eq!(expired.len(), 1);
    assert_eq!(expired[0].id, offer_b);
    assert_eq!(expired[0].stage, Stage::Temporary);

    leases
        .renew(
            offer_a,
            Duration::from_secs(10),
            t0 + Duration::from_secs(9),
        )
        .unwrap();
    assert!(
        leases.expire(t0 + Duration::from_secs(12)).is_empty(),
        "renewed in time"
    );
    let gone = leases.expire(t0 + Duration::from_secs(20));
    assert_eq!(
        gone.len(),
        1,
        "a scheduler that stops renewing loses the worker"
    );
    assert_eq!(gone[0].stage, Stage::Renewable);
    assert_eq!(
        leases.leased(t0 + Duration::from_secs(20)),
        Resources::default()
    );
    assert_eq!(
        leases.renew(
            offer_a,
            Duration::from_secs(10),
            t0 + Duration::from_secs(21)
        ),
        Err(LeaseError::Unknown)
    );
}

#[test]
fn a_restarted_worker_never_reuses_a_lease_id() {
    let now = Instant::now();
    let one = Resources {
        cpu: 0.001,
        ..Resources::default()
    };
    let ids = |leases: &mut LeaseManager| -> std::collections::HashSet<u64> {
        (0..1000)
            .map(|_| leases.reserve(one, Duration::from_secs(1), now).unwrap())
            .collect()
    };
    let before = ids(&mut LeaseManager::new(capacity()));
    let after = ids(&mut LeaseManager::new(capacity()));
    assert_eq!(before.len(), 1000, "ids within one run are distinct");
    assert!(
        before.is_disjoint(&after),
        "a scheduler renewing a lease it remembers from before the worker restarted must not reach a new one"
    );
    assert!(!before.contains(&0) && !after.contains(&0));
}
