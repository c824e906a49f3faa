//! `hypha-data`: see the `hypha_data` library.

use std::{path::PathBuf, process::ExitCode};

use clap::{Parser, Subcommand};
use hypha_node::NodeCommand;

hypha_network::global_allocator!();

/// The Hypha data node: serves prepared datasets to workers.
///
/// Start with `hypha-data init`, set dataset_path and the certificate paths, then
/// `hypha-data run --config config.toml`.
#[derive(Debug, Parser)]
#[command(version, about, long_about, max_term_width = 100)]
#[command(mut_subcommand("run", |run| run.about("Run the data node")))]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    #[command(flatten)]
    Node(NodeCommand),
    /// Build a dataset from arrays (.npy, .safetensors), text (.jsonl) or an image folder.
    Prepare(hypha_data::commands::PrepareArgs),
    /// Describe a dataset directory: slices, samples, sizes, compression ratio, tensor schema.
    Inspect {
        /// The dataset directory.
        path: PathBuf,
    },
    /// Check every slice against the stored manifest (size and BLAKE3), or decode every slice
    /// when none is stored; one BAD line per damaged slice, exit 1 if there is one.
    Verify(hypha_data::commands::VerifyArgs),
    /// Fetch one slice from the network, verified, into a plain SafeTensors file (--raw keeps
    /// the stored bytes).
    Fetch(hypha_data::commands::FetchArgs),
    /// Iterate a data node's slices exactly once among all clients naming the same iteration.
    Iterate(hypha_data::commands::IterateArgs),
    /// Show where an iteration on a data node stands: per epoch and per client.
    Progress(hypha_data::commands::ProgressArgs),
    /// Check exactly-once from an iteration's ledger file: per epoch and client where its
    /// slices stand; exit 1 when a slice was used twice, or a finished iteration missed one.
    Audit(hypha_data::commands::AuditArgs),
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let schema = hypha_data::node::schema();
    hypha_node::report(match cli.command {
        Command::Node(command) => {
            command
                .execute(
                    &schema,
                    &hypha_data::node::client_schema(),
                    |args| async move { hypha_data::node::run(&args).await },
                )
                .await
        }
        Command::Prepare(args) => hypha_data::commands::prepare(&args),
        Command::Inspect { path } => hypha_data::commands::inspect(&path),
        Command::Verify(args) => hypha_data::commands::verify_dataset(&args),
        Command::Fetch(args) => hypha_data::commands::fetch(&args).await,
        Command::Iterate(args) => hypha_data::commands::iterate(&args).await,
        Command::Progress(args) => {
            hypha_data::commands::progress(&hypha_data::node::client_schema(), &args).await
        }
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
