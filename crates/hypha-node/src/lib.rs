//! What every Hypha node program shares, so that each binary stays a few lines long.
//!
//! - [`NodeCommand`]: the `init`, `run` and `probe` subcommands every program has, and
//!   [`InitArgs`], [`RunArgs`], [`ProbeArgs`], their flags.
//! - [`init`] writes the program's commented config template.
//! - [`Node::start`] loads the layered config, sets up telemetry, loads the certificate and
//!   trust store, and starts the network.
//! - [`probe`] checks a running node's health over the network.
//! - [`trust_reload`]: CRLs and trust anchors reloaded when their files change or on SIGHUP.
//! - [`Error`] carries the exit code: 2 for bad input (config, certificates, addresses),
//!   1 for everything else. [`report`] prints one line and returns the code.
//!
//! This crate knows the shape of a node program, not what any particular node does.

mod args;
mod command;
mod error;
mod node;
mod probe;
pub mod trust_reload;

pub use args::{InitArgs, Overrides, ProbeArgs, RunArgs};
pub use command::NodeCommand;
pub use error::{Error, report};
pub use node::{Node, init, load_run_config, shutdown_signal};
pub use probe::{probe, start_client};
