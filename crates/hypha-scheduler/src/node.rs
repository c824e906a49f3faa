//! The scheduler program: `hypha-scheduler run --config scheduler.toml --job job.toml`.

use std::path::PathBuf;

use hypha_config::{DefaultValue, Key, Kind, Schema, network, telemetry};
use hypha_node::{Error, Node, RunArgs};
use serde::Deserialize;

use crate::{
    allocator::{Allocator, Settings},
    dashboard,
    run::{EventLog, RunError, run_job},
    spec::JobFile,
};

/// Every key a scheduler accepts.
pub fn schema() -> Schema {
    let mut keys = network::keys();
    keys.extend(telemetry::keys());
    keys.push(Key {
        name: "http",
        kind: Kind::String,
        default: DefaultValue::Unset {
            example: r#""127.0.0.1:8080""#,
        },
        doc: "Serve the live dashboard (a page and its JSON API under /api) on this address while the job runs: a port (listening on 127.0.0.1) or IP:PORT. It has no login: keep it on loopback, or behind a proxy of your own. Unset: no dashboard.",
    });
    Schema::new("hypha-scheduler", keys)
}

/// The `run` command's arguments.
#[derive(Debug, clap::Args)]
pub struct RunJobArgs {
    #[command(flatten)]
    pub node: RunArgs,
    /// The job file: workers, bid, executor, resources, config (see docs/jobs.md).
    #[arg(long, value_name = "FILE")]
    pub job: PathBuf,
    /// Also write every event (leases, dispatches, statuses, losses, resumptions) as JSON
    /// lines here, appended to what the file holds.
    #[arg(long, value_name = "FILE")]
    pub events: Option<PathBuf>,
    /// Serve the live dashboard here: PORT (on 127.0.0.1) or IP:PORT (the `http` key).
    #[arg(long, value_name = "ADDRESS")]
    pub http: Option<String>,
    /// After the job ends, keep serving the dashboard until interrupted (Ctrl-C); the exit
    /// code still tells how the job ended.
    #[arg(long)]
    pub hold: bool,
}

#[derive(Debug, Deserialize)]
struct SchedulerConfig {
    http: Option<String>,
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
    let mut node_args = args.node.clone();
    if let Some(http) = &args.http {
        node_args.overrides.set.push(format!("http={http}"));
    }
    let loaded = hypha_node::load_run_config(&schema(), &node_args)?;
    let config: SchedulerConfig = loaded.section()?;
    let dashboard = match config.http.as_deref().filter(|a| !a.trim().is_empty()) {
        Some(text) => {
            let address = dashboard::parse_address(text).map_err(|problem| {
                Error::from(loaded.error(
                    "http",
                    problem,
                    "give a port such as 8080, or an address such as 127.0.0.1:8080",
                ))
            })?;
            let listener = tokio::net::TcpListener::bind(address).await.map_err(|e| {
                Error::BadInput(format!(
                    "the dashboard cannot listen on {address}: {e}; choose another port with --http"
                ))
            })?;
            let bound = listener.local_addr().unwrap_or(address);
            // Printed, not only logged: the quickstart and users read it to open the page.
            println!("dashboard: http://{bound}/");
            let sources = events.dashboard();
            Some(tokio::spawn(async move {
                if let Err(e) = dashboard::serve(listener, sources).await {
                    tracing::warn!(error = %e, "the dashboard stopped");
                }
            }))
        }
        None => None,
    };
    let node = Node::start_with("scheduler", loaded, |_| {}).await?;
    let _ = node
        .network
        .set_health(true, format!("running the job of {}", args.job.display()))
        .await;
    let paths = dashboard
        .is_some()
        .then(|| tokio::spawn(events.watch_paths(node.network.clone())));
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
    if let Some(paths) = paths {
        paths.abort();
    }
    node.network.shutdown().await;
    if let Some(dashboard) = dashboard {
        if args.hold && !matches!(outcome, Err(RunError::Interrupted)) {
            println!("the job ended; the dashboard stays up until interrupted (Ctrl-C)");
            hypha_node::shutdown_signal().await;
        }
        dashboard.abort();
    }
    match outcome {
        Ok(()) => Ok(()),
        Err(RunError::Interrupted) => Err(Error::Failed("interrupted".into())),
        Err(e) => Err(Error::Failed(e.to_string())),
    }
}
