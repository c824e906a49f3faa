//! `hypha-gateway`: see the `hypha_gateway` library for what a gateway does.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use hypha_node::{InitArgs, ProbeArgs, RunArgs};

hypha_network::global_allocator!();

/// The Hypha gateway: entry point, DHT anchor and relay of a Hypha network.
///
/// Start with `hypha-gateway init`, fill in the certificate paths, then
/// `hypha-gateway run --config config.toml`.
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
    /// Run the gateway.
    Run(RunArgs),
    /// Check a node's health over the network; exit 0 healthy, 1 unhealthy or unreachable.
    Probe(ProbeArgs),
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    hypha_node::report(match cli.command {
        Command::Init(args) => hypha_node::init(&hypha_gateway::schema(), &args),
        Command::Run(args) => hypha_gateway::run(&args).await,
        Command::Probe(args) => hypha_node::probe(&hypha_gateway::schema(), &args).await,
    })
}
