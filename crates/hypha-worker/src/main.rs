//! `hypha-worker`: see the `hypha_worker` library.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use hypha_node::NodeCommand;

hypha_network::global_allocator!();

/// The Hypha worker: bids for jobs advertised by schedulers and runs them with its executors.
///
/// Start with `hypha-worker init`, set the certificate paths, gateway_addresses, work_dir,
/// [resources], [offer] and [[executors]], then `hypha-worker run --config worker.toml`.
#[derive(Debug, Parser)]
#[command(version, about, long_about, max_term_width = 100)]
#[command(mut_subcommand("run", |run| run.about("Run the worker")))]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    #[command(flatten)]
    Node(NodeCommand),
    /// Fetch an artifact from an [artifacts.profiles] origin, sharing chunks with every other
    /// node fetching it; shows where chunks come from and prints a JSON summary.
    ///
    /// Example: `hypha-worker fetch --config worker.toml --profile models --expect 8
    /// llama/weights.safetensors weights.safetensors`
    Fetch(Box<hypha_worker::fetch_command::FetchArgs>),
    /// Tell the worker running with this config to drain, and wait until it has: it takes
    /// no new jobs, each job hands back its work (a trainer's update still goes into the
    /// round if it is ready, else its slices go back at once), then the worker exits. The same
    /// as sending the worker SIGTERM.
    ///
    /// Example: `hypha-worker drain --config worker.toml`
    Drain(hypha_worker::drain::DrainArgs),
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let schema = hypha_worker::config::schema();
    hypha_node::report(match cli.command {
        Command::Node(command) => {
            command
                .execute(&schema, &schema, |args| async move {
                    hypha_worker::node::run(&args).await
                })
                .await
        }
        Command::Fetch(args) => hypha_worker::fetch_command::run(&args).await,
        Command::Drain(args) => hypha_worker::drain::run(&args).await,
    })
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    /// Every flag and subcommand is well formed, and `run` is there to be named.
    #[test]
    fn the_command_line_is_well_formed() {
        super::Cli::command().debug_assert();
    }
}
