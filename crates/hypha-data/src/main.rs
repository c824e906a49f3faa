//! `hypha-data`: see the `hypha_data` library.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use hypha_node::{InitArgs, ProbeArgs, RunArgs};

/// The Hypha data node: serves prepared datasets to workers.
///
/// Start with `hypha-data init`, set dataset_path and the certificate paths, then
/// `hypha-data run --config config.toml`.
#[derive(Debug, Parser)]
#[command(version, about, long_about, max_term_width = 100)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Write a commented config file holding every key with its default.
    Init(InitArgs),
    /// Run the data node.
    Run(RunArgs),
    /// Check a node's health over the network; exit 0 healthy, 1 unhealthy or unreachable.
    Probe(ProbeArgs),
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let schema = hypha_data::node::schema();
    hypha_node::report(match cli.command {
        Command::Init(args) => hypha_node::init(&schema, &args),
        Command::Run(args) => hypha_data::node::run(&args).await,
        Command::Probe(args) => hypha_node::probe(&schema, &args).await,
    })
}
