//! Hypha workers: they bid for work, hold leases, run executors and serve each job its bridge.
//!
//! - [`arbiter`]: which advertisements to answer and with what offer, under the `[offer]`
//!   settings (`price`, `floor`, `strategy = "whole" | "flexible"`).
//! - [`lease`]: reservations of the worker's resources: a short temporary lease per open offer
//!   (no double booking), a renewable lease once accepted, expiry on a monotonic clock.
//! - [`jobs`]: work directories, executor processes, cancellation (SIGTERM, then SIGKILL).
//! - [`bridge`]: the job bridge, HTTP over each job's Unix socket.
//! - [`parameter_server`]: the built-in DiLoCo parameter server (`runtime = "parameter-server"`).
//! - [`slices`]: the data path: the slice cache and each job's prefetcher.
//! - [`node`]: the loop that ties them to the network (`hypha-worker run`).
//! - [`artifacts`]: artifacts jobs need, fetched peer to peer into the worker's store and
//!   copied into job directories; files a peer published for a task's jobs, the same way.
//! - [`fetch_command`]: `hypha-worker fetch`, one artifact by hand with a live view.
//! - [`drain`]: `hypha-worker drain`, and the lock a running worker holds on its `work_dir`.
//! - [`config`]: the worker's keys.
//!
//! The market and lease logic are plain state machines with the clock passed in, so every
//! decision is testable without waiting. This crate knows nothing of how schedulers choose.

pub mod arbiter;
pub mod artifacts;
pub mod bridge;
pub mod config;
pub mod drain;
pub mod fetch_command;
pub mod jobs;
pub mod lease;
mod metrics;
pub mod node;
pub mod parameter_server;
pub mod resources;
pub mod slices;
