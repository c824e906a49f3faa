//! The scheduler program: `hypha-scheduler run --config scheduler.toml --job job.toml`.

use std::path::PathBuf;

use hypha_config::{Schema, network, telemetry};
use hypha_node::{Error, Node, RunArgs};

use crate::{
    allocator::{Allocator, Settings},
    run::{EventLog, RunError, run_job},
    spec::JobFile,
};

/// Every key a scheduler accepts.
pub fn schema() -> Schema {
    let mut keys = network::keys();
    keys.extend(telemetry::keys());
    Schema::new("hypha-scheduler", keys)
}

/// The `run` command's arguments.
#[derive(Debug, clap::Args)]
pub struct RunJobArgs {
    #[command(flatten)]
    pub node: RunArgs,
    /// The job file: workers, bid, executor, resources, config (see the README).
    #[arg(long, value_name = "FILE")]
    pub job: PathBuf,
    /// Also write every event (leases, dispatches, statuses, losses, resumptions) as JSON
    /// lines here, appended to what the file holds.
    #[arg(long, value_name = "FILE")]
    pub events: Option<PathBuf>,
}

/// Runs a job to completion; exit 0 when every worker's share finished.
pub async fn run(args: &RunJobArgs) -> Result<(), Error> {
    let spec = JobFile::load(&args.job).map_err(|e| Error::BadInput(e.to_string()))?;
    let events = match &args.events {
        Some(path) => EventLog::with_file(path).map_err(|e| {
            Error::BadInput(format!(
                "cannot write the events file {}: {e}",
                path.display()
            ))
        })?,
        None => EventLog::console(),
    };
    let node = Node::start("scheduler", &schema(), &args.node, |_| {}).await?;
    let allocator = Allocator::new(node.network.clone(), Settings::default());
    let outcome = run_job(
        node.network.clone(),
        node.inbound,
        allocator,
        spec,
        events,
        hypha_node::shutdown_signal(),
    )
    .await;
    node.network.shutdown().await;
    match outcome {
        Ok(()) => Ok(()),
        Err(RunError::Interrupted) => Err(Error::Failed("interrupted".into())),
        Err(e) => Err(Error::Failed(e.to_string())),
    }
}
