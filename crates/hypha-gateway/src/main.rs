//! `hypha-gateway`: see the `hypha_gateway` library for what a gateway does.

use std::process::ExitCode;

use clap::Parser;
use hypha_node::NodeCommand;

hypha_network::global_allocator!();

/// The Hypha gateway: entry point, DHT anchor and relay of a Hypha network.
///
/// Start with `hypha-gateway init`, fill in the certificate paths, then
/// `hypha-gateway run --config config.toml`.
#[derive(Debug, Parser)]
#[command(version, about, long_about, max_term_width = 100)]
#[command(mut_subcommand("run", |run| run.about("Run the gateway")))]
struct Cli {
    #[command(subcommand)]
    command: NodeCommand,
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let schema = hypha_gateway::schema();
    hypha_node::report(
        cli.command
            .execute(&schema, &schema, |args| async move {
                hypha_gateway::run(&args).await
            })
            .await,
    )
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
