//! The state machine of one iteration, and its store.

use std::{
    collections::{BTreeSet, HashMap, HashSet, VecDeque},
    path::Path,
    sync::{Arc, Mutex},
};

use serde::Serialize;

use crate::{
    CheckpointToken, Error, IterationSpec, ReturnReason, SliceKey,
    permutation::permutation,
    store::{Kind, Loaded, Record, Store, Writes},
};

/// How far into an epoch's remaining order [`Ledger::assign`] looks for slices the worker
/// already holds: far enough to find cached slices, near enough that the order stays the
/// seed's order to within a few hundred positions.
const PREFERENCE_WINDOW: usize = 256;

/// The window over which per-worker rates are measured.
const RATE_WINDOW_MS: u64 = 30_000;

/// The state of one iteration, kept in memory and mirrored to its ledger file.
///
/// Operations change the memory at once and queue their audit rows; [`Ledger::flush`] makes
/// them durable in one transaction. A caller must not act on an operation's result (hand out a
/// slice, say it was consumed) before the flush that follows it has returned.
#[derive(Debug)]
pub struct Ledger {
    spec: IterationSpec,
    id: String,
    store: SharedStore,
    lease_ms: u64,
    workers: Vec<String>,
    worker_numbers: HashMap<String, u32>,
    epochs: Vec<Epoch>,
    /// Per worker: when its lease on its ASSIGNED slices ends.
    leases: HashMap<u32, u64>,
    /// Per worker: the slices ASSIGNED to it.
    held: HashMap<u32, BTreeSet<SliceKey>>,
    /// Per worker and round: the slices CONSUMED into it.
    rounds: HashMap<(u32, u64), BTreeSet<SliceKey>>,
    stats: HashMap<u32, WorkerStats>,
    /// Applied in memory, not yet committed.
    writes: Writes,
}

/// The store, shareable with the thread that commits while the ledger goes on in memory
/// (see [`crate::LedgerHandle`]). Commits are serialised by the ledger's owner; the mutex only
/// satisfies the borrow checker across threads.
#[derive(Clone)]
pub(crate) struct SharedStore(Arc<Mutex<Store>>);

impl SharedStore {
    pub fn commit(&self, writes: &Writes) -> Result<(), Error> {
        self.0.lock().map_err(|_| Error::Stopped)?.commit(writes)
    }
}

impl std::fmt::Debug for SharedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Store")
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Free to hand out; with the worker that held it last, if one did.
    Available(Option<u32>),
    Assigned(u32),
    Consumed(u32, u64),
    Used,
}

#[derive(Debug)]
struct Epoch {
    /// Slices in hand-out order; emptied once the epoch is complete.
    order: Vec<u64>,
    /// Each slice's position in `order`.
    position: Vec<u32>,
    states: Vec<State>,
    /// Positions of AVAILABLE slices, so the lowest is the next to hand out.
    available: BTreeSet<u32>,
    counts: EpochProgress,
}

impl Epoch {
    fn new(spec: &IterationSpec, epoch: u32) -> Self {
        let order = permutation(spec.seed, epoch, spec.slices());
        let mut position = vec![0u32; order.len()];
        for (at, &slice) in order.iter().enumerate() {
            position[slice as usize] = at as u32;
        }
        Self {
            available: (0..order.len() as u32).collect(),
            states: vec![State::Available(None); order.len()],
            counts: EpochProgress {
                epoch,
                available: order.len() as u64,
                ..EpochProgress::default()
            },
            order,
            position,
        }
    }

    /// Every slice is USED (a complete epoch drops its per-slice state; epochs are never
    /// empty).
    fn is_complete(&self) -> bool {
        self.states.is_empty()
    }
}

#[derive(Debug, Default)]
struct WorkerStats {
    consumed: u64,
    used: u64,
    samples_used: u64,
    /// (time, samples) of recent consumes, for rates.
    recent: VecDeque<(u64, u64)>,
}

/// What [`Ledger::assign`] hands a worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Grant {
    /// Slices now ASSIGNED to the worker, in the order to use them.
    Slices(Vec<Assignment>),
    /// Nothing is AVAILABLE now, but slices held by others may come back: ask again later.
    Wait,
    /// Every slice of every epoch is USED or on its way to it for other workers; this worker
    /// is done.
    Finished,
}

/// One slice handed to a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Assignment {
    #[serde(flatten)]
    pub key: SliceKey,
    pub samples: u64,
}

/// What [`Ledger::consume`] accepted.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Consumed {
    pub accepted: Vec<SliceKey>,
    /// Slices the worker may not count: CONSUMED or USED already, or ASSIGNED to another
    /// worker since the worker's lease lapsed.
    pub refused: Vec<SliceKey>,
}

/// Where an iteration stands.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Progress {
    pub dataset: String,
    pub epochs: Vec<EpochProgress>,
    pub workers: Vec<WorkerProgress>,
    /// Every slice of every epoch is USED.
    pub finished: bool,
}

/// One epoch's slices by state.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct EpochProgress {
    pub epoch: u32,
    pub available: u64,
    pub assigned: u64,
    pub consumed: u64,
    pub used: u64,
}

/// One worker's share.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WorkerProgress {
    pub worker: String,
    pub assigned: u64,
    pub consumed: u64,
    pub used: u64,
    pub samples_used: u64,
    /// Over the last 30 s.
    pub slices_per_s: f64,
    pub samples_per_s: f64,
}

impl Ledger {
    /// Starts a new iteration in a new ledger file at `path`. `lease_ms` is how long a
    /// worker's assignments last without a word from it.
    pub fn create(path: &Path, spec: IterationSpec, lease_ms: u64) -> Result<Self, Error> {
        validate(&spec)?;
        let id = uuid::Uuid::new_v4().simple().to_string();
        let store = Store::create(path, &spec, &id)?;
        Ok(Self::empty(spec, id, store, lease_ms))
    }

    /// Continues the iteration `token` names from its ledger file.
    pub fn resume(
        path: &Path,
        token: &CheckpointToken,
        lease_ms: u64,
        now_ms: u64,
    ) -> Result<Self, Error> {
        let (store, loaded) = Store::open(path)?;
        let found = CheckpointToken::new(&loaded.id, &loaded.spec);
        if &found != token {
            return Err(Error::Mismatch(format!(
                "{} holds iteration {found}, not {token}",
                path.display()
            )));
        }
        Ok(Self::replay(store, loaded, lease_ms, now_ms))
    }

    /// Continues the iteration in `path` if it iterates `spec`, else starts it there.
    pub fn open_or_create(
        path: &Path,
        spec: IterationSpec,
        lease_ms: u64,
        now_ms: u64,
    ) -> Result<Self, Error> {
        if !path.exists() {
            return Self::create(path, spec, lease_ms);
        }
        let (store, loaded) = Store::open(path)?;
        if loaded.spec != spec {
            return Err(Error::Mismatch(format!(
                "{} holds an iteration of {:?} ({} slices, {} epochs, seed {}), not of {:?} \
                 ({} slices, {} epochs, seed {}); remove the file to start over, or use another",
                path.display(),
                loaded.spec.dataset,
                loaded.spec.slices(),
                loaded.spec.epochs,
                loaded.spec.seed,
                spec.dataset,
                spec.slices(),
                spec.epochs,
                spec.seed,
            )));
        }
        Ok(Self::replay(store, loaded, lease_ms, now_ms))
    }

    fn empty(spec: IterationSpec, id: String, store: Store, lease_ms: u64) -> Self {
        Self {
            spec,
            id,
            store: SharedStore(Arc::new(Mutex::new(store))),
            lease_ms,
            workers: Vec::new(),
            worker_numbers: HashMap::new(),
            epochs: Vec::new(),
            leases: HashMap::new(),
            held: HashMap::new(),
            rounds: HashMap::new(),
            stats: HashMap::new(),
            writes: Writes::default(),
        }
    }

    fn replay(store: Store, loaded: Loaded, lease_ms: u64, now_ms: u64) -> Self {
        let Loaded {
            spec,
            id,
            workers,
            records,
        } = loaded;
        let mut ledger = Self::empty(spec, id, store, lease_ms);
        for (number, name) in workers.into_iter().enumerate() {
            ledger.worker_numbers.insert(name.clone(), number as u32);
            ledger.workers.push(name);
        }
        for record in records {
            ledger.apply(record);
        }
        // Leases were not stored: every holder gets a fresh one, so a worker that lived
        // through the restart keeps its slices and a dead one loses them one lease later.
        let holders: Vec<u32> = ledger.held.keys().copied().collect();
        for worker in holders {
            ledger.leases.insert(worker, now_ms + lease_ms);
        }
        ledger
    }

    /// Names this iteration for [`Ledger::resume`].
    pub fn token(&self) -> CheckpointToken {
        CheckpointToken::new(&self.id, &self.spec)
    }

    pub fn spec(&self) -> &IterationSpec {
        &self.spec
    }

    /// Hands `worker` up to `want` AVAILABLE slices, lowest epoch first and in its order,
    /// preferring slices in `cached` (slice numbers the worker already holds) among the next
    /// few hundred; renews the worker's lease.
    pub fn assign(
        &mut self,
        worker: &str,
        want: usize,
        cached: &HashSet<u64>,
        now_ms: u64,
    ) -> Grant {
        let number = self.worker_number(worker);
        self.leases.insert(number, now_ms + self.lease_ms);
        let mut slices = Vec::new();
        while slices.len() < want {
            let Some(epoch) = self.epoch_with_available() else {
                break;
            };
            let state = &self.epochs[epoch];
            let pick = state
                .available
                .iter()
                .take(if cached.is_empty() {
                    1
                } else {
                    PREFERENCE_WINDOW
                })
                .copied()
                .find(|&at| cached.contains(&state.order[at as usize]))
                .or_else(|| state.available.first().copied());
            let Some(at) = pick else { break };
            let key = SliceKey {
                epoch: epoch as u32,
                slice: state.order[at as usize],
            };
            self.record(Record {
                time_ms: now_ms,
                key,
                kind: Kind::Assigned,
                worker: number,
                value: now_ms + self.lease_ms,
            });
            slices.push(Assignment {
                key,
                samples: self.samples(key),
            });
        }
        if !slices.is_empty() {
            Grant::Slices(slices)
        } else if self.is_finished_for_newcomers() {
            Grant::Finished
        } else {
            Grant::Wait
        }
    }

    /// Renews `worker`'s lease on its assignments.
    pub fn renew(&mut self, worker: &str, now_ms: u64) {
        if let Some(&number) = self.worker_numbers.get(worker) {
            self.leases.insert(number, now_ms + self.lease_ms);
        }
    }

    /// Records that `worker` put these slices' samples into its round `round`. Accepted are
    /// slices ASSIGNED to it, and slices it held whose lease lapsed but which nobody else
    /// took. Any other slice is refused: a worker cannot use up slices it was never given.
    pub fn consume(
        &mut self,
        worker: &str,
        keys: &[SliceKey],
        round: u64,
        now_ms: u64,
    ) -> Consumed {
        let number = self.worker_number(worker);
        self.leases.insert(number, now_ms + self.lease_ms);
        let mut outcome = Consumed::default();
        for &key in keys {
            match self.state(key) {
                Some(State::Assigned(holder)) if holder == number => {}
                Some(State::Available(Some(last))) if last == number => {}
                _ => {
                    outcome.refused.push(key);
                    continue;
                }
            }
            self.record(Record {
                time_ms: now_ms,
                key,
                kind: Kind::Consumed,
                worker: number,
                value: round,
            });
            outcome.accepted.push(key);
        }
        outcome
    }

    /// Round `round` of `worker` reached the model: its CONSUMED slices become USED.
    pub fn commit_round(&mut self, worker: &str, round: u64, now_ms: u64) -> Vec<SliceKey> {
        self.close_round(worker, round, now_ms, Kind::Used)
    }

    /// Round `round` of `worker` never reached the model: its slices become AVAILABLE again.
    pub fn drop_round(&mut self, worker: &str, round: u64, now_ms: u64) -> Vec<SliceKey> {
        self.close_round(worker, round, now_ms, Kind::Returned)
    }

    fn close_round(&mut self, worker: &str, round: u64, now_ms: u64, kind: Kind) -> Vec<SliceKey> {
        let Some(&number) = self.worker_numbers.get(worker) else {
            return Vec::new();
        };
        let keys: Vec<SliceKey> = self
            .rounds
            .get(&(number, round))
            .map(|keys| keys.iter().copied().collect())
            .unwrap_or_default();
        let value = match kind {
            Kind::Returned => ReturnReason::Dropped.code(),
            _ => round,
        };
        for &key in &keys {
            self.record(Record {
                time_ms: now_ms,
                key,
                kind,
                worker: number,
                value,
            });
        }
        keys
    }

    /// `worker` is gone: everything ASSIGNED to it or CONSUMED into a round that has not
    /// reached the model becomes AVAILABLE again.
    pub fn release_worker(&mut self, worker: &str, now_ms: u64) -> usize {
        match self.worker_numbers.get(worker) {
            Some(&number) => self.release(number, None, now_ms),
            None => 0,
        }
    }

    /// `worker` is gone, but rounds it consumed slices into may still reach the model: its
    /// ASSIGNED slices (fetched ahead, never trained) become AVAILABLE again now, its CONSUMED
    /// ones wait for their rounds to be settled.
    pub fn release_assigned(&mut self, worker: &str, now_ms: u64) -> usize {
        let Some(&number) = self.worker_numbers.get(worker) else {
            return 0;
        };
        let keys = self.held_keys(number);
        self.return_keys(number, &keys, ReturnReason::WorkerLost, now_ms);
        keys.len()
    }

    /// Worker `number`'s ASSIGNED slices.
    fn held_keys(&self, number: u32) -> Vec<SliceKey> {
        self.held
            .get(&number)
            .map(|keys| keys.iter().copied().collect())
            .unwrap_or_default()
    }

    /// `worker` holds only `holding` of what it was granted: its other ASSIGNED slices are
    /// grants that never reached it, and become AVAILABLE again.
    pub fn release_unheld(
        &mut self,
        worker: &str,
        holding: &HashSet<SliceKey>,
        now_ms: u64,
    ) -> usize {
        let Some(&number) = self.worker_numbers.get(worker) else {
            return 0;
        };
        let lost: Vec<SliceKey> = self
            .held
            .get(&number)
            .map(|keys| {
                keys.iter()
                    .filter(|key| !holding.contains(key))
                    .copied()
                    .collect()
            })
            .unwrap_or_default();
        self.return_keys(number, &lost, ReturnReason::NeverReceived, now_ms);
        lost.len()
    }

    /// `keys` of worker `number` become AVAILABLE again, for `reason`.
    fn return_keys(&mut self, number: u32, keys: &[SliceKey], reason: ReturnReason, now_ms: u64) {
        for &key in keys {
            self.record(Record {
                time_ms: now_ms,
                key,
                kind: Kind::Returned,
                worker: number,
                value: reason.code(),
            });
        }
    }

    /// A scheduler resumes its iteration after a restart: everything CONSUMED into a round
    /// that has not reached the model becomes AVAILABLE again, and everything ASSIGNED too,
    /// except for the workers in `going_on` (jobs the resumed run may take over): they keep
    /// what they fetched ahead and what they consumed into rounds from `open_from` on, which
    /// may still reach the model the run goes on from (a parameter server that goes on holds
    /// them); the run settles those rounds itself.
    pub fn release_all(&mut self, going_on: &[String], open_from: u64, now_ms: u64) -> usize {
        let workers: Vec<(u32, Option<u64>)> = self
            .workers
            .iter()
            .filter_map(|worker| {
                let number = *self.worker_numbers.get(worker)?;
                Some((number, going_on.contains(worker).then_some(open_from)))
            })
            .collect();
        workers
            .into_iter()
            .map(|(number, kept_from)| self.release(number, kept_from, now_ms))
            .sum()
    }

    /// Returns worker `number`'s CONSUMED slices of rounds not yet used and its ASSIGNED
    /// ones; with `kept_from`, only its CONSUMED slices of rounds before that one.
    fn release(&mut self, number: u32, kept_from: Option<u64>, now_ms: u64) -> usize {
        let mut keys: Vec<SliceKey> = match kept_from {
            Some(_) => Vec::new(),
            None => self.held_keys(number),
        };
        for ((holder, round), consumed) in &self.rounds {
            if *holder == number && kept_from.is_none_or(|from| *round < from) {
                keys.extend(consumed.iter().copied());
            }
        }
        self.return_keys(number, &keys, ReturnReason::WorkerLost, now_ms);
        if kept_from.is_none() {
            self.leases.remove(&number);
        }
        keys.len()
    }

    /// Returns the ASSIGNED slices of every worker whose lease ended before `now_ms`.
    pub fn expire(&mut self, now_ms: u64) -> usize {
        let lapsed: Vec<u32> = self
            .leases
            .iter()
            .filter(|&(_, &deadline)| deadline < now_ms)
            .map(|(&worker, _)| worker)
            .collect();
        let mut returned = 0;
        for number in lapsed {
            self.leases.remove(&number);
            let keys = self.held_keys(number);
            self.return_keys(number, &keys, ReturnReason::Expired, now_ms);
            returned += keys.len();
        }
        returned
    }

    /// Where the iteration stands.
    pub fn progress(&self, now_ms: u64) -> Progress {
        let epochs = (0..self.spec.epochs)
            .map(|epoch| match self.epochs.get(epoch as usize) {
                Some(state) => state.counts.clone(),
                None => EpochProgress {
                    epoch,
                    available: self.spec.slices() as u64,
                    ..EpochProgress::default()
                },
            })
            .collect();
        let mut workers: Vec<WorkerProgress> = self
            .workers
            .iter()
            .enumerate()
            .map(|(number, name)| {
                let number = number as u32;
                let stats = self.stats.get(&number);
                let since = now_ms.saturating_sub(RATE_WINDOW_MS);
                let (slices, samples) = stats
                    .map(|s| {
                        s.recent
                            .iter()
                            .filter(|(time, _)| *time >= since)
                            .fold((0u64, 0u64), |(n, m), (_, samples)| (n + 1, m + samples))
                    })
                    .unwrap_or_default();
                let window_s = RATE_WINDOW_MS as f64 / 1000.0;
                WorkerProgress {
                    worker: name.clone(),
                    assigned: self.held.get(&number).map_or(0, |h| h.len() as u64),
                    consumed: stats.map_or(0, |s| s.consumed),
                    used: stats.map_or(0, |s| s.used),
                    samples_used: stats.map_or(0, |s| s.samples_used),
                    slices_per_s: slices as f64 / window_s,
                    samples_per_s: samples as f64 / window_s,
                }
            })
            .collect();
        workers.sort_by(|a, b| a.worker.cmp(&b.worker));
        Progress {
            dataset: self.spec.dataset.clone(),
            epochs,
            workers,
            finished: self.is_finished(),
        }
    }

    /// Every slice of every epoch is USED.
    pub fn is_finished(&self) -> bool {
        self.epochs.len() == self.spec.epochs as usize && self.epochs.iter().all(Epoch::is_complete)
    }

    /// How many transitions wait for [`Ledger::flush`].
    pub fn pending(&self) -> usize {
        self.writes.records.len()
    }

    /// Makes every transition so far durable, in one transaction. After a failed flush the
    /// ledger's memory is ahead of its file: drop it and reopen the file.
    pub fn flush(&mut self) -> Result<(), Error> {
        let writes = self.take_writes();
        self.store.commit(&writes)
    }

    /// Hands over what waits to be committed, for a commit elsewhere.
    pub(crate) fn take_writes(&mut self) -> Writes {
        std::mem::take(&mut self.writes)
    }

    pub(crate) fn store(&self) -> SharedStore {
        self.store.clone()
    }

    fn worker_number(&mut self, worker: &str) -> u32 {
        if let Some(&number) = self.worker_numbers.get(worker) {
            return number;
        }
        let number = self.workers.len() as u32;
        self.workers.push(worker.to_string());
        self.worker_numbers.insert(worker.to_string(), number);
        self.writes.workers.push((number, worker.to_string()));
        number
    }

    fn samples(&self, key: SliceKey) -> u64 {
        self.spec
            .samples
            .get(key.slice as usize)
            .copied()
            .unwrap_or(0)
    }

    fn state(&self, key: SliceKey) -> Option<State> {
        let epoch = self.epochs.get(key.epoch as usize)?;
        if epoch.states.is_empty() {
            // A complete epoch keeps no per-slice state: everything in it is USED.
            return (key.slice < self.spec.slices() as u64).then_some(State::Used);
        }
        epoch.states.get(key.slice as usize).copied()
    }

    /// The lowest epoch with an AVAILABLE slice, starting the next epoch when every started
    /// one has none.
    fn epoch_with_available(&mut self) -> Option<usize> {
        if let Some(epoch) = self.epochs.iter().position(|e| !e.available.is_empty()) {
            return Some(epoch);
        }
        if self.epochs.len() < self.spec.epochs as usize && self.spec.slices() > 0 {
            let epoch = self.epochs.len() as u32;
            self.epochs.push(Epoch::new(&self.spec, epoch));
            return Some(epoch as usize);
        }
        None
    }

    /// No AVAILABLE slice is left or can be started; slices still ASSIGNED or CONSUMED may
    /// come back only if their holders fail.
    fn is_finished_for_newcomers(&self) -> bool {
        self.epochs.len() == self.spec.epochs as usize
            && self
                .epochs
                .iter()
                .all(|e| e.available.is_empty() && e.counts.assigned == 0 && e.counts.consumed == 0)
    }

    /// Queues a transition for the store and applies it.
    fn record(&mut self, record: Record) {
        self.writes.records.push(record);
        self.apply(record);
    }

    /// Moves one slice to the state `record` names, keeping every index in step. Replays
    /// trust the log; live callers have checked the transition.
    fn apply(&mut self, record: Record) {
        let key = record.key;
        while self.epochs.len() <= key.epoch as usize {
            let epoch = self.epochs.len() as u32;
            self.epochs.push(Epoch::new(&self.spec, epoch));
        }
        let samples = self.samples(key);
        let slices = self.spec.slices();
        let epoch = &mut self.epochs[key.epoch as usize];
        let Some(&old) = epoch.states.get(key.slice as usize) else {
            return;
        };
        let at = epoch.position[key.slice as usize];
        match old {
            State::Available(_) => {
                epoch.available.remove(&at);
                epoch.counts.available -= 1;
            }
            State::Assigned(worker) => {
                if let Some(held) = self.held.get_mut(&worker) {
                    held.remove(&key);
                }
                epoch.counts.assigned -= 1;
            }
            State::Consumed(worker, round) => {
                if let Some(consumed) = self.rounds.get_mut(&(worker, round)) {
                    consumed.remove(&key);
                    if consumed.is_empty() {
                        self.rounds.remove(&(worker, round));
                    }
                }
                epoch.counts.consumed -= 1;
            }
            State::Used => return,
        }
        let new = match record.kind {
            Kind::Assigned => {
                self.held.entry(record.worker).or_default().insert(key);
                epoch.counts.assigned += 1;
                State::Assigned(record.worker)
            }
            Kind::Consumed => {
                self.rounds
                    .entry((record.worker, record.value))
                    .or_default()
                    .insert(key);
                epoch.counts.consumed += 1;
                let stats = self.stats.entry(record.worker).or_default();
                stats.consumed += 1;
                stats.recent.push_back((record.time_ms, samples));
                while stats
                    .recent
                    .front()
                    .is_some_and(|(time, _)| *time + RATE_WINDOW_MS < record.time_ms)
                {
                    stats.recent.pop_front();
                }
                State::Consumed(record.worker, record.value)
            }
            Kind::Used => {
                epoch.counts.used += 1;
                let stats = self.stats.entry(record.worker).or_default();
                stats.used += 1;
                stats.samples_used += samples;
                State::Used
            }
            Kind::Returned => {
                epoch.available.insert(at);
                epoch.counts.available += 1;
                State::Available(Some(record.worker))
            }
        };
        epoch.states[key.slice as usize] = new;
        if epoch.counts.used as usize == slices {
            // Complete: nothing in it can change again, so its per-slice state goes.
            epoch.order = Vec::new();
            epoch.position = Vec::new();
            epoch.states = Vec::new();
        }
    }
}

#[cfg(feature = "testing")]
impl Ledger {
    /// Writes `event` for `key` without checking that the slice's state allows it: for tests
    /// of audits, which must find a log that exactly-once does not hold in.
    pub fn record_unchecked(&mut self, key: SliceKey, event: &crate::Event, now_ms: u64) {
        use crate::Event;
        let (worker, kind, value) = match event {
            Event::Assigned {
                worker,
                deadline_ms,
            } => (worker, Kind::Assigned, *deadline_ms),
            Event::Consumed { worker, round } => (worker, Kind::Consumed, *round),
            Event::Used { worker, round } => (worker, Kind::Used, *round),
            Event::Returned { worker, reason } => (worker, Kind::Returned, reason.code()),
        };
        let worker = self.worker_number(worker);
        self.record(Record {
            time_ms: now_ms,
            key,
            kind,
            worker,
            value,
        });
    }
}

fn validate(spec: &IterationSpec) -> Result<(), Error> {
    if spec.dataset.is_empty() {
        return Err(Error::Invalid("the iteration names no dataset".into()));
    }
    if spec.epochs == 0 {
        return Err(Error::Invalid(
            "an iteration needs at least one epoch (set epochs = 1 or more)".into(),
        ));
    }
    if spec.slices() == 0 {
        return Err(Error::Invalid(format!(
            "dataset {:?} has no slices to iterate",
            spec.dataset
        )));
    }
    if spec.slices() > u32::MAX as usize {
        return Err(Error::Invalid(format!(
            "dataset {:?} has {} slices; a ledger iterates at most {}",
            spec.dataset,
            spec.slices(),
            u32::MAX
        )));
    }
    Ok(())
}
