//! Hypha's reference executor: a process executor that trains small models with DiLoCo on
//! the CPU, talking to its worker only through the job bridge.
//!
//! - [`bridge`]: JSON over HTTP/1.1 on the job's Unix socket.
//! - [`contract`]: the data contract: which tensors of a slice a model reads (`[config] input`,
//!   `target`, with defaults), how they are converted, and the check that a dataset fits a
//!   model before anything is leased.
//! - [`model`]: the model families (an MLP and a small CNN classifier, a small decoder-only
//!   transformer) on candle, with seeded parameters and SafeTensors in and out.
//! - [`train`]: the trainer's loop: orders from the scheduler, inner steps on the job's
//!   slices, pseudo-gradients to the parameter server, global models back.
//! - [`learner`]: what the loop trains: the reference model with AdamW, or synthetic
//!   pseudo-gradients of a model's shapes for benchmarks at sizes the CPU cannot train.
//! - [`local`]: datasets on this machine: a model scored on their slices, a model suggested for them.
//! - [`synthetic`]: learnable datasets made from a seed, for the quickstart and tests.
//!
//! A worker runs it as
//!
//! ```toml
//! [[executors]]
//! class = "train"
//! name = "diloco"
//! runtime = "process"
//! cmd = "hypha-executor"
//! args = ["train", "--socket", "{SOCKET_PATH}", "--work-dir", "{WORK_DIR}", "--job", "{JOB_JSON}"]
//! ```
//!
//! This crate knows models, the bridge's endpoints and DiLoCo's messages; it knows nothing of
//! networks, leases or ledgers.

pub mod contract;
pub mod learner;
pub mod local;
pub mod model;
pub mod synthetic;
pub mod train;
