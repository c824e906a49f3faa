//! Hypha schedulers: they find and lease workers and run jobs on them.
//!
//! - [`allocator`]: the scheduler's side of the market: advertise, collect offers, choose the
//!   cheapest per weighted resource unit (one offer per worker), accept, keep leases renewed,
//!   report workers that are lost.
//! - [`spec`]: the job file.
//! - [`checkpoint`]: a DiLoCo run's checkpoints, pushed by its parameter server, kept beside
//!   the ledger.
//! - [`data`]: a job's dataset iteration (`cluster_sync = true`): the scheduler's ledger hands
//!   every slice to exactly one job.
//! - [`rounds`]: DiLoCo rounds: batch targets from trainers' speeds, when the parameter
//!   server closes a round, which rounds' slices become used.
//! - [`training`]: a DiLoCo job's statuses, ledger settlements and metrics file.
//! - [`slots`]: each worker's share of a job: wanted, allocating, running, done; retries.
//! - [`history`]: what `progress` shows of how a run fared: restarts, re-adoptions,
//!   failovers, lost workers.
//! - [`record`]: a run's durable record beside its ledger, from which a restarted scheduler
//!   resumes it.
//! - [`run`]: running a job file on leased workers, replacing lost or failed ones.
//! - [`event`]: what happens to a run, as the console, the events file, the dashboard and
//!   the history show it.
//! - [`dashboard`]: the live dashboard and its JSON API, served while a job runs.
//! - [`node`]: the `hypha-scheduler` program's commands.
//!
//! This crate knows how to choose and drive workers, not how they run executors.

pub mod allocator;
pub mod checkpoint;
pub mod dashboard;
pub mod data;
pub mod event;
pub mod history;
pub mod node;
pub mod record;
pub mod rounds;
pub mod run;
pub mod slots;
pub mod spec;
mod throttle;
pub mod training;

pub(crate) use hypha_messages::unix_ms;
