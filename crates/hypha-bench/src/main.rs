//! `hypha-bench SUITE [--quick]`: see the `hypha_bench` library.

use std::process::ExitCode;

use clap::Parser;

hypha_network::global_allocator!();

/// Hypha's benchmarks. Each suite measures its own ceiling in the same run (raw TCP, raw TLS,
/// …), prints a table, and writes target/bench/SUITE.json.
#[derive(Debug, Parser)]
#[command(version, about, long_about, max_term_width = 100)]
struct Cli {
    /// The suite to run.
    #[arg(value_enum)]
    suite: hypha_bench::Suite,
    /// Smaller sizes and fewer repetitions: finishes in under a minute.
    #[arg(long)]
    quick: bool,
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Some(outcome) = hypha_bench::run_child(&args) {
        return match outcome {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: {e:#}");
                ExitCode::FAILURE
            }
        };
    }
    let cli = Cli::parse();
    match hypha_bench::run(cli.suite, cli.quick) {
        Ok(path) => {
            println!("wrote {}", path.display());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
