//! `hypha-scheduler`: see the `hypha_scheduler` library.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use hypha_node::NodeCommand;
use hypha_scheduler::node::RunJobArgs;

hypha_network::global_allocator!();

/// The Hypha scheduler: leases workers on the market and runs jobs on them.
///
/// Start with `hypha-scheduler init`, set the certificate paths and gateway_addresses, write a
/// job file, then `hypha-scheduler run --config scheduler.toml --job job.toml`.
#[derive(Debug, Parser)]
#[command(version, about, long_about, max_term_width = 100)]
#[command(mut_subcommand("run", |run| run.about(
    "Lease workers for a job file and run it until every worker's share finished"
)))]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    #[command(flatten)]
    Node(NodeCommand<RunJobArgs>),
    /// Show where a running scheduler's iteration stands: slices per epoch and state, and
    /// each job's share and pace.
    Progress(hypha_data::commands::ProgressArgs),
    /// Check exactly-once from a job's ledger file: per epoch and worker where its slices
    /// stand; exit 1 when a slice was used twice, or a finished iteration missed one.
    Audit(hypha_data::commands::AuditArgs),
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let schema = hypha_scheduler::node::schema();
    hypha_node::report(match cli.command {
        Command::Node(command) => {
            command
                .execute(&schema, &schema, |args| async move {
                    hypha_scheduler::node::run(&args).await
                })
                .await
        }
        Command::Progress(args) => hypha_data::commands::progress(&schema, &args).await,
        Command::Audit(args) => hypha_data::commands::audit(&args),
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
