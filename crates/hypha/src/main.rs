//! `hypha`: see the library's documentation.

use std::{io::IsTerminal, path::PathBuf};

use anyhow::Context;
use clap::{Parser, Subcommand};
use hypha::quickstart::{self, Settings};

/// Hypha: decentralized training over mutual TLS.
#[derive(Debug, Parser)]
#[command(version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a complete training network on this machine and train a small model with DiLoCo:
    /// certificates, a gateway, a data node, a parameter server, trainers and a scheduler, as
    /// real processes. Writes model.safetensors, metrics.jsonl and loss.svg into --dir.
    Quickstart {
        /// The directory to create and work in (must not exist or be empty).
        #[arg(long, default_value = "hypha-quickstart")]
        dir: PathBuf,
        #[arg(long, default_value_t = 3)]
        trainers: usize,
        #[arg(long, default_value_t = 10)]
        rounds: u64,
        /// Slices of the generated dataset.
        #[arg(long, default_value_t = 48)]
        slices: usize,
        #[arg(long, default_value_t = 128)]
        samples_per_slice: usize,
        /// Samples all trainers together train per round.
        #[arg(long, default_value_t = 1536)]
        samples_per_round: u64,
    },
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Quickstart {
            dir,
            trainers,
            rounds,
            slices,
            samples_per_slice,
            samples_per_round,
        } => {
            let exe = std::env::current_exe().context("cannot find this program's path")?;
            let settings = Settings {
                dir: dir.clone(),
                trainers,
                rounds,
                slices,
                samples_per_slice,
                samples_per_round,
                bin_dir: exe.parent().map(PathBuf::from).unwrap_or_default(),
            };
            let bar = if std::io::stderr().is_terminal() {
                let bar = indicatif::ProgressBar::new_spinner();
                bar.enable_steady_tick(std::time::Duration::from_millis(120));
                bar
            } else {
                indicatif::ProgressBar::hidden()
            };
            let summary = quickstart::run(&settings, |step| {
                if bar.is_hidden() {
                    eprintln!("{step}");
                } else {
                    bar.set_message(step.to_string());
                }
            })?;
            bar.finish_and_clear();
            let dir = dir.display();
            println!(
                "trained {} rounds in {:.0} s\nevaluation loss {:.4} → {:.4}, accuracy {:.1} % → {:.1} %\nwrote {dir}/model.safetensors, {dir}/metrics.jsonl, {dir}/loss.svg; logs in {dir}/logs",
                summary.rounds,
                summary.seconds,
                summary.loss_before,
                summary.loss_after,
                100.0 * summary.accuracy_before,
                100.0 * summary.accuracy_after,
            );
        }
    }
    Ok(())
}
