//! Running a job file: lease workers, dispatch the executor to each, follow the statuses,
//! replace workers that are lost or whose job fails, until every worker's share finished.
//!
//! Each worker's share of the job is a *slot*. A slot is done when its executor exits with
//! code 0. When its job fails (non-zero exit, killed, refused) or its worker is lost (a lease
//! renewal is refused or the lease lapses), the slot is given to a newly leased worker, up to
//! `max_attempts` starts per slot; the other slots carry on meanwhile ([`slots`](crate::slots)
//! decides). A DiLoCo job's parameter server is replaced the same way: the new one is
//! restored from the checkpoint the scheduler holds ([`checkpoint`](crate::checkpoint)),
//! which goes to it with its dispatch, and the trainers are told to join it.
//!
//! A run is one actor (`JobRun`): it owns the slots, the jobs with their leases, the training
//! and the data, and the `JoinSet`s of every task it starts (the router of inbound requests,
//! allocations, dispatches; apart, those telling workers the task's peers, which report
//! nothing back). Its loop takes what those tasks, the workers and the executors
//! report, one at a time; whatever ends the run (success, a failure, an interrupt, an
//! allocation that gives up), `finish` lets go of everything in one place: it stops the tasks
//! (an allocation stopped halfway releases what it leased), releases every lease (which stops
//! its job on the worker) and gives every job's slices back.
//!
//! A run resumed after the scheduler was killed takes over the leases the earlier process
//! recorded ([`record`](crate::record)), and with a checkpoint the jobs still running under
//! them (`goes_on`): the parameter server first (trainers taken over wait until its first
//! status says which round it collects, or until it is known not to go on), then the trainers.
//!
//! What happens is reported as [`Event`]s: one line each on the console and, when asked,
//! one JSON object per line in an events file.
//!
//! The actor is this module; its other parts are beside it. `rules` holds the decisions
//! that need no I/O (how a status ends a job, what a job's end means for its slot, a silent
//! server, where a lost server restarts), tested like [`rounds`](crate::rounds); `earlier`
//! what an earlier process left (its record, checkpoint, the jobs that go on); `error` why a
//! run fails; `log` where events go; `inbound` routing what the network delivers, and who
//! may ask what. The actor's own methods are spread over `resume` (taking the earlier
//! process's leases over), `diloco` (the parameter server's statuses, checkpoints, failover
//! and standby) and `peers` (telling the workers who the task's peers are): those files
//! extend `JobRun`, and this one names nothing in them, so the files depend one way.

mod diloco;
mod earlier;
mod error;
mod inbound;
mod log;
mod peers;
mod resume;
mod rules;

use std::{
    collections::{HashMap, HashSet},
    path::PathBuf,
    time::Duration,
};

use hypha_messages::{
    Request,
    diloco::{ServerConfig, config::Restore},
    iterate::RunProgress,
    job::{JobSpec, JobStatus, StatusReport, TaskPeers},
};
use hypha_network::{InboundRequest, Network};
use libp2p::PeerId;
use tokio::{sync::mpsc, task::JoinSet};

pub use crate::event::{Event, with_stderr};
pub use error::RunError;
pub use log::EventLog;

use self::{
    earlier::{Adoption, Earlier, Resumption, carried_over},
    inbound::{Askers, ExecutorStatus, LiveJobs, route_inbound},
    rules::{AfterEnd, Ended, Ending, Forwarding, SERVER_SILENCE},
};
use crate::{
    allocator::{AllocationError, Allocator, Lease, Lost, WorkerRequest},
    checkpoint::{self, Checkpoints},
    data::JobData,
    record::{self, BenchedTrainer, RecordedJob, RunRecord},
    slots::{Allocation, Role, Slots, Verdict},
    spec::JobFile,
    training::Training,
};

/// How long an elastic run waits after an advertisement for more trainers that nobody
/// answered before it advertises again: a worker coming online sees one within this and an
/// advertisement's round (2 s), and the gossip carries one small message every 3 s.
const JOINERS_PAUSE: Duration = Duration::from_secs(1);

/// How long a finished job waits for its lease releases to reach the workers.
const RELEASE_LIMIT: Duration = Duration::from_secs(5);

/// Runs `spec` to completion (or until `shutdown`).
pub async fn run_job(
    network: Network,
    inbound: mpsc::Receiver<InboundRequest>,
    allocator: Allocator,
    spec: JobFile,
    events: EventLog,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), RunError> {
    tokio::pin!(shutdown);
    let record_path = spec
        .ledger_path()
        .map(|ledger| record::path_beside(&ledger));
    let Earlier {
        record: earlier,
        round: resumed_round,
    } = Earlier::load(&spec, record_path.as_deref())?;
    let task = earlier
        .as_ref()
        .map_or_else(|| uuid::Uuid::new_v4().to_string(), |r| r.task.clone());
    let carried = carried_over(&spec, earlier.as_ref(), resumed_round);
    let data = match (&spec.data, spec.ledger_path()) {
        (Some(data), Some(ledger)) => tokio::select! {
            started = JobData::start(&network, data, &ledger, &task, &carried, |manifest| spec.check_dataset(manifest)) => Some(started?),
            _ = &mut shutdown => return Err(RunError::Interrupted),
        },
        _ => None,
    };
    let training =
        match (&spec.diloco, &data) {
            (Some(diloco), Some(data)) => {
                let path = diloco
                    .metrics
                    .clone()
                    .unwrap_or_else(|| "metrics.jsonl".into());
                let forward = diloco.forward.as_deref();
                let resumed = earlier.is_some();
                let plan = spec.plan().unwrap_or_else(|| diloco.plan());
                let mut started = Training::new(plan, data.clone(), &path, forward, resumed)
                    .map_err(|error| RunError::Metrics {
                        path: path.display().to_string(),
                        error,
                    })?;
                if let (Some(round), Some(earlier)) = (resumed_round, &earlier) {
                    // The earlier server may have applied the recorded rounds past the
                    // checkpoint, and one more before the scheduler heard.
                    let reached = earlier
                        .uncommitted
                        .iter()
                        .map(|u| u.round + 1)
                        .fold(round, u64::max)
                        + 1;
                    started.resume_from(round, reached, earlier);
                }
                Some(started)
            }
            _ => None,
        };
    let checkpoints = match (&training, spec.ledger_path()) {
        (Some(_), Some(ledger)) => {
            let path = checkpoint::path_beside(&ledger);
            Some(match resumed_round {
                Some(_) => Checkpoints::resumed(path),
                None => Checkpoints::new(path),
            })
        }
        _ => None,
    };
    let beginning = Beginning {
        task,
        data,
        diloco: training.map(|training| Diloco::new(training, checkpoints)),
        record: record_path,
    };
    let (mut run, mut channels) =
        JobRun::new(network, inbound, allocator, &spec, events, beginning);
    if let Some(earlier) = earlier {
        let resumption = Resumption::of(&spec, &run.slots, earlier, resumed_round);
        run.resume(resumption).await;
    }
    let outcome = run.drive(&mut channels, &mut shutdown).await;
    run.finish(outcome).await
}

/// What one kind of slot asks of a worker, and the config its executor gets.
struct Work {
    request: WorkerRequest,
    config: WorkConfig,
    artifacts: Vec<hypha_messages::artifact::Request>,
}

/// What a slot's executor is configured with.
enum WorkConfig {
    /// The job's `[config]` as JSON, for trainers with `data` and `diloco` added.
    Executor(String),
    /// The parameter server's, given its role and checkpoint at each dispatch.
    Server(ServerConfig),
}

impl WorkConfig {
    /// The config as JSON for an executor in `role`, restored from the checkpoint of round
    /// `restore` if any.
    fn json(&self, role: Role, restore: Option<u64>) -> String {
        match self {
            WorkConfig::Executor(json) => json.clone(),
            WorkConfig::Server(config) => {
                let config = ServerConfig {
                    restore: restore.map(|round| Restore { round }),
                    standby: role == Role::Standby,
                    ..*config
                };
                // Its fields are numbers, strings and options of them: it always serialises.
                serde_json::to_string(&config).unwrap_or_default()
            }
        }
    }
}

/// A job dispatched for a slot, and the lease it runs under.
struct Dispatched {
    slot: usize,
    lease: Lease,
    /// Its `dispatched` event was recorded: when the worker answered the dispatch, or, for a
    /// job so short that its status came first, just before that status.
    announced: bool,
    /// The version of the task's peers its worker was told (with the dispatch, or since).
    peers_version: u64,
}

/// What the run's tasks hand back when they end.
enum Internal {
    Allocated {
        slots: Vec<usize>,
        /// It was optional (more trainers for an elastic run).
        optional: bool,
        leased: Result<Vec<Lease>, AllocationError>,
    },
    /// An elastic run may advertise for more trainers again.
    JoinersDue,
    Adopted(Adoption),
    /// The dispatch of `job` was answered (or failed).
    Dispatch {
        job: String,
        result: Result<(), String>,
    },
    /// The checkpoint of `round` was sent to the standby (or could not be).
    Forwarded {
        round: u64,
        result: Result<(), String>,
    },
    /// The network stopped handing over requests (`router`) or streams (`checkpoints`).
    Stopped(&'static str),
}

/// What reaches the run from outside its own tasks.
struct Channels {
    statuses: mpsc::Receiver<(PeerId, StatusReport)>,
    executor_statuses: mpsc::Receiver<ExecutorStatus>,
    lost: mpsc::Receiver<Lost>,
    /// Rounds and sizes of the checkpoints stored.
    checkpoints: mpsc::Receiver<(u64, u64)>,
}

/// One run of a job file: everything it holds, and the one place that lets go of it
/// ([`finish`](JobRun::finish)). Every task it starts is in `tasks` (the router, allocations,
/// dispatches: what they end with comes back to the loop) or `telling` (telling workers the
/// task's peers); every lease is in `jobs` or in the allocation that found it, and released
/// when dropped.
struct JobRun<'a> {
    network: Network,
    allocator: Allocator,
    spec: &'a JobFile,
    task: String,
    trainer: Work,
    /// A DiLoCo job's parameter server.
    server: Option<Work>,
    data: Option<JobData>,
    /// A DiLoCo job's rounds, checkpoints and what is known of its parameter server.
    diloco: Option<Diloco>,
    /// Where the run's record is kept, when it has a ledger to keep it beside.
    record: Option<PathBuf>,
    /// Jobs of the earlier run whose leases are being taken over.
    adopting: Vec<RecordedJob>,
    /// Trainers taken over that wait until it is known whether the earlier run's parameter
    /// server goes on, and at which round ([`Diloco::server_pending`]).
    parked: Vec<Adoption>,
    /// Statuses of jobs being taken over that ended meanwhile.
    ended_early: Vec<(PeerId, StatusReport)>,
    /// The jobs whose data requests are answered.
    live: LiveJobs,
    events: EventLog,
    slots: Slots,
    jobs: HashMap<String, Dispatched>,
    /// The task's peers as the workers are told them.
    told_peers: TaskPeers,
    /// When the workers must next be told the task's peers (see [`JobRun::tell_task_peers`]).
    peers_due: Option<tokio::time::Instant>,
    tasks: JoinSet<Internal>,
    /// Workers being told the task's peers ([`JobRun::tell_task_peers`]).
    telling: JoinSet<()>,
    lost: mpsc::Sender<Lost>,
    /// Trainers benched (see [`Event::Benched`]): never leased again for the task.
    benched: Vec<BenchedTrainer>,
    /// How often each job's other statuses are written to the events file.
    throttle: crate::throttle::Throttle,
    /// An elastic run advertises for more trainers not before this: an advertisement that
    /// found nobody is followed by a pause ([`JOINERS_PAUSE`]), not another at once.
    joiners_after: tokio::time::Instant,
    /// A [`Internal::JoinersDue`] is on its way.
    joiners_timer: bool,
}

/// A DiLoCo run's side of the runner: its rounds, where its checkpoints are kept, and what
/// the runner knows of its parameter server between statuses.
struct Diloco {
    training: Training,
    /// The checkpoints, when the run has a ledger to keep them beside.
    checkpoints: Option<Checkpoints>,
    /// The round of the checkpoint the next parameter server is restored from.
    restore: Option<u64>,
    /// The earlier run's parameter server may go on: until it is known whether it does, and
    /// at which round, trainers taken over wait ([`JobRun::parked`]).
    server_pending: bool,
    /// When the parameter server's job was last heard from (or dispatched).
    server_heard: std::time::Instant,
    /// Checkpoints on their way to the standby.
    forwarding: Forwarding,
}

impl Diloco {
    fn new(training: Training, checkpoints: Option<Checkpoints>) -> Self {
        Diloco {
            training,
            checkpoints,
            restore: None,
            server_pending: false,
            server_heard: std::time::Instant::now(),
            forwarding: Forwarding::default(),
        }
    }

    /// The round of the newest checkpoint held.
    fn held_round(&self) -> Option<u64> {
        self.checkpoints.as_ref().and_then(Checkpoints::round)
    }

    /// The server's checkpoints up to the round the training reached are taken.
    fn accept_checkpoints_through_training(&self) {
        if let Some(checkpoints) = &self.checkpoints {
            checkpoints.accept_up_to(self.training.round());
        }
    }
}

/// What a run begins with, as [`run_job`] found it: its task (the earlier run's, when it
/// resumes one), its data, a DiLoCo run's side, and where its record is kept.
struct Beginning {
    task: String,
    data: Option<JobData>,
    diloco: Option<Diloco>,
    record: Option<PathBuf>,
}

impl<'a> JobRun<'a> {
    fn new(
        network: Network,
        inbound: mpsc::Receiver<InboundRequest>,
        allocator: Allocator,
        spec: &'a JobFile,
        mut events: EventLog,
        beginning: Beginning,
    ) -> (Self, Channels) {
        let Beginning {
            task,
            data,
            diloco,
            record,
        } = beginning;
        events.describe(spec.view(), data.as_ref().map(|d| d.service().clone()));
        events.begin(&task, RunProgress::default());
        if let Some(data) = &data {
            events.record(data.ready().clone());
        }
        let (status_tx, statuses) = mpsc::channel(256);
        let (executor_tx, executor_statuses) = mpsc::channel(256);
        let (lost_tx, lost) = mpsc::channel(64);
        let (stored_tx, stored) = mpsc::channel(16);
        let live = LiveJobs::default();
        let mut tasks = JoinSet::new();
        if let Some(checkpoints) = diloco.as_ref().and_then(|d| d.checkpoints.clone()) {
            let serve = checkpoints.serve(network.clone(), task.clone(), stored_tx);
            tasks.spawn(async move {
                serve.await;
                Internal::Stopped("checkpoints")
            });
        }
        let router = route_inbound(
            inbound,
            allocator.clone(),
            status_tx,
            executor_tx,
            data.clone(),
            events.history_watch(),
            Askers {
                live: live.clone(),
                network: network.clone(),
            },
        );
        tasks.spawn(async move {
            router.await;
            Internal::Stopped("router")
        });
        let trainer = Work {
            request: WorkerRequest {
                executor: spec.executor.clone(),
                resources: spec.resources,
                bid: spec.bid,
            },
            config: WorkConfig::Executor(
                spec.trainer_config(data.as_ref().map(JobData::reference)),
            ),
            artifacts: spec.artifacts.clone(),
        };
        let server = spec.diloco.as_ref().map(|diloco| Work {
            request: WorkerRequest {
                executor: diloco.parameter_server.executor.clone(),
                resources: diloco.parameter_server.resources,
                bid: diloco.parameter_server.bid,
            },
            config: WorkConfig::Server(
                diloco.server_config(data.as_ref().map_or(0, JobData::largest_slice)),
            ),
            // The built-in parameter server runs no program that could read artifacts.
            artifacts: Vec::new(),
        });
        let run = JobRun {
            network,
            allocator,
            spec,
            task,
            trainer,
            slots: Slots::new(
                (spec.workers.min, spec.workers.max),
                (
                    server.is_some(),
                    spec.diloco.as_ref().is_some_and(|d| d.standby),
                ),
                spec.max_attempts,
            ),
            server,
            data,
            diloco,
            record,
            adopting: Vec::new(),
            parked: Vec::new(),
            ended_early: Vec::new(),
            live,
            events,
            jobs: HashMap::new(),
            told_peers: TaskPeers::default(),
            peers_due: None,
            tasks,
            telling: JoinSet::new(),
            lost: lost_tx,
            benched: Vec::new(),
            throttle: crate::throttle::Throttle::default(),
            joiners_after: tokio::time::Instant::now(),
            joiners_timer: false,
        };
        let channels = Channels {
            statuses,
            executor_statuses,
            lost,
            checkpoints: stored,
        };
        (run, channels)
    }

    /// Writes the run's record: its task, its jobs and leases, the rounds waiting for a
    /// checkpoint. A record that cannot be written ends the run: going on would hand out
    /// work that a restart could not account for.
    fn store_record(&self) -> Result<(), RunError> {
        let Some(path) = &self.record else {
            return Ok(());
        };
        let record = RunRecord {
            task: self.task.clone(),
            jobs: self
                .jobs
                .iter()
                .map(|(job, d)| RecordedJob {
                    job: job.clone(),
                    slot: d.slot,
                    peer: d.lease.peer.to_string(),
                    lease: d.lease.id,
                    price: d.lease.price,
                    rejoin: (self.diloco.as_ref()).is_some_and(|d| d.training.must_rejoin(job)),
                })
                .chain(self.adopting.iter().cloned())
                .collect(),
            uncommitted: self
                .diloco
                .as_ref()
                .map(|d| d.training.uncommitted())
                .unwrap_or_default(),
            history: self.events.history(),
            benched: self.benched.clone(),
            data_nodes: self
                .data
                .as_ref()
                .map(|data| data.data_nodes().iter().map(PeerId::to_string).collect())
                .unwrap_or_default(),
        };
        record.store(path)?;
        Ok(())
    }

    /// Follows the job until every slot is done, a slot fails for good, or `shutdown`.
    async fn drive(
        &mut self,
        channels: &mut Channels,
        shutdown: &mut (impl std::future::Future<Output = ()> + Unpin),
    ) -> Result<(), RunError> {
        self.allocate_next();
        let mut silence = tokio::time::interval(SERVER_SILENCE / 2);
        silence.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            if !self.server_pending() {
                for adoption in std::mem::take(&mut self.parked) {
                    self.adopted(adoption).await?;
                }
            }
            if self.slots.complete() {
                // A parameter server exits only once its last checkpoint is stored, and that
                // was told before it heard so: count it before the run's end is judged.
                while let Ok((round, bytes)) = channels.checkpoints.try_recv() {
                    self.checkpoint_stored(round, bytes).await?;
                }
                return self.completed().await;
            }
            self.tell_task_peers();
            let peers_due = self.peers_due;
            tokio::select! {
                _ = &mut *shutdown => return Err(RunError::Interrupted),
                () = sleep_until(peers_due) => {}
                Some(ended) = self.tasks.join_next() => match ended {
                    Ok(internal) => self.on_task(internal).await?,
                    // A task that panicked took its leases with it (dropped, so released);
                    // its slots stay where they were.
                    Err(error) => tracing::warn!(%error, "a task of the run failed"),
                },
                Some((peer, report)) = channels.statuses.recv() => self.on_status(peer, report).await?,
                Some(lost) = channels.lost.recv() => self.on_lost(lost).await?,
                Some(status) = channels.executor_statuses.recv() => {
                    self.on_executor_status(status).await?;
                }
                Some((round, bytes)) = channels.checkpoints.recv() => self.checkpoint_stored(round, bytes).await?,
                _ = silence.tick() => self.on_server_silence().await?,
            }
        }
    }

    /// Every slot is done: the job succeeded, unless it should have used its data up.
    async fn completed(&self) -> Result<(), RunError> {
        // A DiLoCo job with a number of rounds ends with its rounds, data left or not.
        let ends_with_data = self.spec.diloco.as_ref().is_none_or(|d| d.rounds.is_none());
        match &self.data {
            Some(data) if ends_with_data && !data.finished().await => Err(RunError::Unfinished),
            _ => Ok(()),
        }
    }

    /// Starts the next allocation the slots want, if any. An elastic run below its `max`
    /// advertises for more trainers whenever no other allocation is needed, pausing
    /// [`JOINERS_PAUSE`] after an advertisement nobody answered.
    fn allocate_next(&mut self) {
        let now = tokio::time::Instant::now();
        let optional = now >= self.joiners_after;
        let Some(Allocation {
            role,
            slots,
            at_least,
        }) = self.slots.next_allocation(optional)
        else {
            if !optional && !self.joiners_timer {
                self.joiners_timer = true;
                let due = self.joiners_after;
                self.tasks.spawn(async move {
                    tokio::time::sleep_until(due).await;
                    Internal::JoinersDue
                });
            }
            return;
        };
        let busy: HashSet<PeerId> = self
            .jobs
            .values()
            .map(|j| j.lease.peer)
            .chain(self.benched.iter().filter_map(|b| b.peer.parse().ok()))
            .collect();
        let allocator = self.allocator.clone();
        let request = self.work(role).request.clone();
        let lost = self.lost.clone();
        self.tasks.spawn(async move {
            let leased = allocator
                .allocate(&request, (at_least, slots.len()), &busy, &lost)
                .await;
            Internal::Allocated {
                slots,
                optional: at_least == 0,
                leased,
            }
        });
    }

    /// Whether the earlier run's parameter server may go on, not yet known.
    fn server_pending(&self) -> bool {
        self.diloco.as_ref().is_some_and(|d| d.server_pending)
    }

    fn work(&self, role: Role) -> &Work {
        match (role, &self.server) {
            (Role::ParameterServer | Role::Standby, Some(server)) => server,
            _ => &self.trainer,
        }
    }

    async fn on_task(&mut self, internal: Internal) -> Result<(), RunError> {
        match internal {
            Internal::Allocated {
                slots,
                optional,
                leased,
            } => {
                let leased = match leased {
                    Ok(leased) => leased,
                    // More trainers were only welcome: the run goes on with those it has.
                    Err(error) if optional => {
                        tracing::debug!(%error, "an advertisement for more trainers failed");
                        Vec::new()
                    }
                    Err(error) => return Err(error.into()),
                };
                if optional && leased.is_empty() {
                    self.joiners_after = tokio::time::Instant::now() + JOINERS_PAUSE;
                }
                for (slot, lease) in slots.into_iter().zip(leased) {
                    if !self.slots.allocating(slot) {
                        // The run's work ended meanwhile: the lease goes back (dropped).
                        continue;
                    }
                    match lease.lost() {
                        // Lost before it was taken up: the slot is wanted again.
                        Some(reason) => {
                            tracing::info!(peer = %lease.peer, %reason, "a worker was lost right after it was leased")
                        }
                        None => {
                            self.events.record(Event::Leased {
                                slot,
                                peer: lease.peer.to_string(),
                                lease: lease.id,
                                price: lease.price,
                            });
                            self.dispatch(slot, lease)?;
                        }
                    }
                }
                self.slots.allocation_ended();
                self.allocate_next();
            }
            Internal::JoinersDue => {
                self.joiners_timer = false;
                self.allocate_next();
            }
            Internal::Adopted(adoption) => self.adopted(adoption).await?,
            Internal::Dispatch { job, result } => {
                let Some(dispatched) = self.jobs.get(&job) else {
                    return Ok(());
                };
                let (slot, peer) = (dispatched.slot, dispatched.lease.peer.to_string());
                match result {
                    Ok(()) => {
                        self.announce_dispatched(&job);
                        if self.slots.role(slot) == Role::Standby {
                            self.forward_checkpoint();
                        }
                    }
                    Err(error) => {
                        let reason = format!("dispatch failed: {error}");
                        self.events.record(Event::Lost {
                            slot,
                            peer,
                            reason: reason.clone(),
                        });
                        self.ended(&job, Ending::Failed(reason)).await?;
                    }
                }
            }
            Internal::Forwarded { round, result } => {
                match result {
                    Ok(()) => tracing::debug!(round, "the standby has the checkpoint"),
                    Err(error) => {
                        tracing::warn!(round, %error, "the checkpoint did not reach the standby")
                    }
                }
                if self.diloco.as_mut().is_some_and(|d| d.forwarding.arrived()) {
                    self.forward_checkpoint();
                }
            }
            Internal::Stopped(what) => {
                tracing::debug!(what, "the network stopped handing the job what it receives");
            }
        }
        Ok(())
    }

    /// Dispatches the slot's executor under `lease`; the answer comes back as a task.
    fn dispatch(&mut self, slot: usize, lease: Lease) -> Result<(), RunError> {
        let id = uuid::Uuid::new_v4().to_string();
        let role = self.slots.role(slot);
        let work = self.work(role);
        let restore = match role {
            Role::ParameterServer => self.diloco.as_ref().and_then(|d| d.restore),
            Role::Trainer | Role::Standby => None,
        };
        let config = work.config.json(role, restore);
        let mut spec = JobSpec {
            id: id.clone(),
            task: self.task.clone(),
            lease: lease.id,
            executor: work.request.executor.clone(),
            config,
            secrets: self.spec.secrets.clone(),
            artifacts: work.artifacts.clone(),
            // An elastic run's later joiners find the others there already.
            artifact_peers: if work.artifacts.is_empty() {
                0
            } else {
                self.spec.workers.min
            },
            task_peers: TaskPeers::default(),
        };
        // Known to the training before the job can send its first status or checkpoint.
        if let Some(diloco) = self.diloco.as_mut() {
            let training = &mut diloco.training;
            match role {
                Role::ParameterServer => training.server_started(&id, lease.peer, restore),
                Role::Standby => training.standby_started(&id, lease.peer),
                Role::Trainer => training.trainer_started(&id, lease.peer),
            }
            if role == Role::ParameterServer {
                diloco.server_heard = std::time::Instant::now();
                if let Some(checkpoints) = &diloco.checkpoints {
                    checkpoints.accept_from(Some(lease.peer));
                }
            }
        }
        self.slots.started(slot, &id);
        let network = self.network.clone();
        let peer = lease.peer;
        self.live.insert(peer, &id);
        self.jobs.insert(
            id.clone(),
            Dispatched {
                slot,
                lease,
                announced: false,
                peers_version: 0,
            },
        );
        self.task_peers_changed();
        spec.task_peers = self.told_peers.clone();
        if let Some(job) = self.jobs.get_mut(&id) {
            job.peers_version = spec.task_peers.version;
        }
        self.store_record()?;
        // The checkpoint goes with the dispatch of a restored server, which waits for it.
        let checkpoint = match (restore, self.diloco.as_ref()) {
            (Some(_), Some(diloco)) => diloco.checkpoints.as_ref().and_then(Checkpoints::open),
            _ => None,
        };
        let task = self.task.clone();
        self.tasks.spawn(async move {
            let mut result = network
                .request(peer, Request::Dispatch(spec))
                .await
                .map(drop)
                .map_err(|e| e.to_string());
            if let (Ok(()), Some((round, file))) = (&result, checkpoint) {
                result = checkpoint::send(&network, peer, task, file)
                    .await
                    .map(drop)
                    .map_err(|e| format!("the checkpoint of round {round} did not reach it: {e}"));
            }
            Internal::Dispatch { job: id, result }
        });
        Ok(())
    }

    async fn on_status(&mut self, peer: PeerId, report: StatusReport) -> Result<(), RunError> {
        let Some(dispatched) = self.jobs.get(&report.job) else {
            if self.taking_over(peer, &report.job).is_some() && report.status != JobStatus::Running
            {
                // It ended while its lease was being taken over: heard once it is.
                self.ended_early.push((peer, report));
            }
            return Ok(());
        };
        if dispatched.lease.peer != peer {
            return Ok(());
        }
        // A job can end before its dispatch's answer is in: its status says it was
        // dispatched, and every job's `dispatched` comes before its status.
        self.announce_dispatched(&report.job);
        let Some(dispatched) = self.jobs.get(&report.job) else {
            return Ok(());
        };
        self.events.record(Event::Status {
            slot: dispatched.slot,
            job: report.job.clone(),
            peer: peer.to_string(),
            status: report.status.clone(),
        });
        match rules::ending(&report.status) {
            Some(ending) => self.ended(&report.job, ending).await,
            None => Ok(()),
        }
    }

    /// Records that `job` was dispatched, once.
    fn announce_dispatched(&mut self, job: &str) {
        let Some(dispatched) = self.jobs.get_mut(job).filter(|d| !d.announced) else {
            return;
        };
        dispatched.announced = true;
        if dispatched.peers_version < self.told_peers.version {
            self.peers_due = Some(tokio::time::Instant::now());
        }
        let (slot, peer) = (dispatched.slot, dispatched.lease.peer.to_string());
        self.events.record(Event::Dispatched {
            slot,
            job: job.to_string(),
            peer,
        });
    }

    async fn on_lost(&mut self, lost: Lost) -> Result<(), RunError> {
        let Some((job, slot)) = self
            .jobs
            .iter()
            .find(|(_, j)| j.lease.peer == lost.peer && j.lease.id == lost.lease)
            .map(|(job, j)| (job.clone(), j.slot))
        else {
            return Ok(());
        };
        self.events.record(Event::Lost {
            slot,
            peer: lost.peer.to_string(),
            reason: lost.reason.clone(),
        });
        self.ended(&job, Ending::Failed(lost.reason)).await
    }

    /// Job `job` ended: its lease goes back, its data goes back, and its slot is done or
    /// wants another worker, as [`rules::after_end`] says.
    async fn ended(&mut self, job: &str, mut ending: Ending) -> Result<(), RunError> {
        let Some(dispatched) = self.jobs.remove(job) else {
            return Ok(());
        };
        self.task_peers_changed();
        let role = self.slots.role(dispatched.slot);
        if role == Role::ParameterServer && self.server_pending() && ending == Ending::Done {
            // A server taken over that finished before it said where it was: the earlier
            // process told it training was over, or it is replaced.
            let over = match self.diloco.as_mut() {
                Some(diloco) => {
                    let round = diloco.held_round();
                    diloco.training.ended_with(round).await
                }
                None => true,
            };
            if !over {
                ending = Ending::Failed("it ended before it said which round it was at".into());
            }
        }
        self.live.remove(dispatched.lease.peer, job);
        let peer = dispatched.lease.peer;
        drop(dispatched.lease);
        // A trainer that progressed (it trained a round) spent no attempt: elastic runs see
        // workers come and go all the time, and the attempts are for jobs that cannot run.
        let progressed = self.diloco.as_ref().is_some_and(|d| d.training.joined(job));
        // Known to the rounds first: a trainer whose update of the open round is (or may be)
        // at the server keeps its slices of that round until the round settles.
        let server = self.diloco.as_mut().is_some_and(|d| d.training.ended(job));
        self.release_data(peer, job).await;
        let failed = matches!(ending, Ending::Failed(_));
        // A server that failed is replaced by its standby where that holds a round the run
        // reached; the rounds before it are kept.
        let promotion = match (server && failed, &self.diloco) {
            (true, Some(diloco)) => diloco.training.promotion(diloco.held_round()),
            _ => None,
        };
        if server && let Some(diloco) = self.diloco.as_mut() {
            // A server taken over that ended before it said where it was does not go on.
            diloco.server_pending = false;
            if let Some(checkpoints) = &diloco.checkpoints {
                checkpoints.accept_from(None);
            }
            if failed {
                let kept = promotion.as_ref().map_or(0, |p| p.round);
                diloco.training.rounds_lost_from(kept).await;
            }
        }
        self.store_record()?;
        let next = rules::after_end(Ended {
            ending,
            server,
            promotion,
            elastic: self.spec.workers.elastic(),
            has_work: self.diloco.is_some() || self.data.is_some(),
            work_done: self.work_done().await,
        });
        match next {
            AfterEnd::Done { close } => {
                self.slots.finished(job);
                if close {
                    self.slots.close();
                }
                Ok(())
            }
            AfterEnd::Promote { promotion, reason } => self.promote(job, peer, &reason, promotion),
            AfterEnd::Close => {
                self.slots.failed(job, progressed);
                self.slots.close();
                Ok(())
            }
            AfterEnd::Replace { reason, fail_over } => {
                if fail_over {
                    self.fail_over(peer, &reason)?;
                }
                match self.slots.failed(job, progressed) {
                    Verdict::Exhausted { slot, attempts } => Err(RunError::Exhausted {
                        slot,
                        attempts,
                        last: reason,
                    }),
                    Verdict::GivenUp { slot, attempts } => {
                        tracing::warn!(
                            slot,
                            attempts,
                            "a slot failed its attempts; the run has the trainers it needs without it and goes on"
                        );
                        self.allocate_next();
                        Ok(())
                    }
                    _ => {
                        self.allocate_next();
                        Ok(())
                    }
                }
            }
        }
    }

    /// Whether the run's work is done, so that no worker starting now would have anything to
    /// do: training ended, or the data is used up.
    async fn work_done(&self) -> bool {
        match (&self.diloco, &self.data) {
            (Some(diloco), _) => diloco.training.done(),
            (None, Some(data)) => data.finished().await,
            (None, None) => false,
        }
    }

    /// Job `job` on `peer` ended: its slices go back (a trainer's once its applied rounds
    /// are settled).
    async fn release_data(&mut self, peer: PeerId, job: &str) {
        match (self.diloco.as_mut(), &self.data) {
            (Some(diloco), _) => diloco.training.release(peer, job).await,
            (None, Some(data)) => data.release(&peer, job).await,
            (None, None) => {}
        }
    }

    /// The one way a run ends: every task stops (an allocation in flight releases what it
    /// leased), every lease goes back (which stops its job on the worker), every job's data
    /// goes back, and the outcome is recorded.
    async fn finish(mut self, outcome: Result<(), RunError>) -> Result<(), RunError> {
        self.tasks.shutdown().await;
        self.telling.shutdown().await;
        for (job, dispatched) in std::mem::take(&mut self.jobs) {
            let peer = dispatched.lease.peer;
            drop(dispatched.lease);
            self.release_data(peer, &job).await;
        }
        self.allocator.settle(RELEASE_LIMIT).await;
        if let Some(diloco) = self.diloco.take() {
            diloco.training.finish().await;
        }
        match (&outcome, &self.record) {
            // Done: nothing to resume.
            (Ok(()), Some(path)) => {
                if let Err(error) = std::fs::remove_file(path) {
                    tracing::debug!(%error, "the run's record was not removed");
                }
            }
            // Every lease is given back: what is left to resume is the task and the
            // checkpoint.
            (Err(_), Some(_)) => {
                if let Err(error) = self.store_record() {
                    tracing::warn!(%error, "the run's record could not be updated");
                }
            }
            _ => {}
        }
        self.events.record(Event::Done {
            ok: outcome.is_ok(),
            message: match &outcome {
                Ok(()) => {
                    let trainers = self.slots.done(Role::Trainer);
                    match &self.spec.diloco {
                        Some(_) => rules::done_message(trainers, &self.benched),
                        None => format!("{trainers} workers finished"),
                    }
                }
                Err(e) => e.to_string(),
            },
        });
        outcome
    }
}

/// Sleeps until `deadline`, or forever without one.
async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}
