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
    /// A setting of the suite changed for a study, KEY=VALUE (repeatable; `outcome` only:
    /// `runs=f32,sparse`, `seed=2`, `sparse_density=0.02`, `sparse_bits=4`, `sparse_decay=0.95`,
    /// `sparse_outer=0.7/0.9` (learning rate/momentum), `sparse_back=exact` or `sparse_back=4`
    /// (times the trainers' density), `sparse_back_bits=4`). The report
    /// lists the settings it ran with.
    #[arg(long = "set", value_name = "KEY=VALUE", value_parser = setting)]
    settings: Vec<(String, String)>,
}

fn setting(text: &str) -> Result<(String, String), String> {
    text.split_once('=')
        .map(|(key, value)| (key.trim().to_string(), value.trim().to_string()))
        .ok_or_else(|| format!("`{text}` is not KEY=VALUE, e.g. sparse_decay=0.95"))
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
    match hypha_bench::run(cli.suite, cli.quick, &cli.settings) {
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
