//! `hypha`: see the library's documentation.

use std::{io::IsTerminal, path::PathBuf};

use anyhow::Context;
use clap::{Parser, Subcommand};
use hypha::quickstart::{self, OwnData, Progress, PythonTrainer, Settings};
use hypha_executor::{contract::TensorNames, model::ModelSpec};

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
        /// Samples per inner step of each trainer.
        #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..))]
        batch_size: u32,
        /// The longest a round is planned to take: raise it for models whose every step takes
        /// seconds (a round ends at its deadline without the updates still on their way).
        #[arg(long, default_value_t = 10.0, value_name = "SECONDS", value_parser = positive)]
        round_seconds: f64,
        /// The trainers' inner AdamW learning rate (3e-4 suits a transformer of GPT-2's size).
        #[arg(long, default_value_t = 0.003, value_parser = positive)]
        learning_rate: f64,
        /// Train on this dataset instead of a generated one: a directory of slices written by
        /// the seed recipe, by `hypha-data prepare`, or plain SafeTensors. Its last slices
        /// (a tenth, at least one) are held out and scored before and after.
        #[arg(long, value_name = "DIR")]
        dataset: Option<PathBuf>,
        /// With --dataset: the model, as JSON, e.g. '{"type": "cnn", "channels": 1,
        /// "classes": 10}' (default: suggested by the data: a transformer for token ids, a
        /// cnn for images, an mlp otherwise).
        #[arg(long, value_name = "JSON", requires = "dataset")]
        model: Option<String>,
        /// With --dataset: the input tensor (default: the first of inputs, images,
        /// input_ids, tokens).
        #[arg(long, value_name = "NAME", requires = "dataset")]
        input: Option<String>,
        /// With --dataset: the classifiers' target tensor (default: labels).
        #[arg(long, value_name = "NAME", requires = "dataset")]
        target: Option<String>,
        /// Where the scheduler serves the live dashboard: a port or IP:PORT (default: a free
        /// port on 127.0.0.1; the address is printed when training starts).
        #[arg(long, value_name = "ADDRESS", default_value = "127.0.0.1:0")]
        http: String,
        /// Keep the network and its dashboard up after training, until Ctrl-C.
        #[arg(long)]
        hold: bool,
        /// One more trainer: this Python script, written with the SDK in `python/` (e.g.
        /// python/examples/numpy_trainer.py; `pip install ./python` first, or set
        /// PYTHONPATH=python).
        #[arg(long, value_name = "SCRIPT")]
        python_trainer: Option<PathBuf>,
        /// How the trainers compress their pseudo-gradients and the server the model's
        /// changes: none, bf16, int8 or sparse (docs/diloco.md, "Choosing a codec and overlap").
        #[arg(long, default_value = "none", value_parser = ["none", "bf16", "int8", "sparse"])]
        compression: String,
        /// Trainers train on while their update travels (docs/diloco.md).
        #[arg(long)]
        overlap: bool,
        /// The interpreter that runs --python-trainer (a virtual environment's python, …).
        #[arg(
            long,
            value_name = "PROGRAM",
            default_value = "python3",
            requires = "python_trainer"
        )]
        python: String,
    },
}

/// A number above 0, for clap.
fn positive(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(value) if value.is_finite() && value > 0.0 => Ok(value),
        _ => Err(format!("{text:?} is not a number above 0")),
    }
}

/// Errors are the user's to read: one line with its causes, never a backtrace (those stay for
/// panics), whatever `RUST_BACKTRACE` says.
fn main() -> std::process::ExitCode {
    match run(Cli::parse()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Quickstart {
            dir,
            trainers,
            rounds,
            slices,
            samples_per_slice,
            samples_per_round,
            batch_size,
            round_seconds,
            learning_rate,
            dataset,
            model,
            input,
            target,
            http,
            hold,
            python_trainer,
            python,
            compression,
            overlap,
        } => {
            let exe = std::env::current_exe().context("cannot find this program's path")?;
            let model = model
                .map(|json| serde_json::from_str::<ModelSpec>(&json))
                .transpose()
                .context("--model is not a model: write it like '{\"type\": \"mlp\", \"inputs\": 64, \"hidden\": 64, \"classes\": 10}'")?;
            let dataset = dataset.map(|dir| OwnData {
                dir,
                model,
                tensors: TensorNames { input, target },
            });
            let settings = Settings {
                dir: dir.clone(),
                trainers,
                rounds,
                slices,
                samples_per_slice,
                samples_per_round,
                batch_size: batch_size as usize,
                round_seconds,
                learning_rate,
                bin_dir: exe.parent().map(PathBuf::from).unwrap_or_default(),
                dataset,
                http,
                hold,
                python_trainer: python_trainer.map(|script| PythonTrainer { script, python }),
                compression,
                overlap,
            };
            let bar = if std::io::stderr().is_terminal() {
                let bar = indicatif::ProgressBar::new_spinner();
                bar.enable_steady_tick(std::time::Duration::from_millis(120));
                bar
            } else {
                indicatif::ProgressBar::hidden()
            };
            let finished = quickstart::run(&settings, |progress| match progress {
                Progress::Step(step) if !bar.is_hidden() => bar.set_message(step.to_string()),
                Progress::Notice(notice) if !bar.is_hidden() => bar.println(notice),
                Progress::Step(line) | Progress::Notice(line) => eprintln!("{line}"),
            })?;
            bar.finish_and_clear();
            let summary = finished.summary;
            let dir = dir.display();
            println!(
                "trained {} for {} rounds in {:.0} s\n{}; updates refused {}, clipped {}\nevaluated on {}\nevaluation loss {:.4} → {:.4}, accuracy {:.1} % → {:.1} %\nwrote {dir}/model.safetensors, {dir}/metrics.jsonl, {dir}/loss.svg; logs in {dir}/logs",
                serde_json::to_string(&summary.model).unwrap_or_default(),
                summary.rounds,
                summary.seconds,
                summary.outcome,
                summary.refused,
                summary.clipped,
                summary.evaluated_on,
                summary.loss_before,
                summary.loss_after,
                100.0 * summary.accuracy_before,
                100.0 * summary.accuracy_after,
            );
            if let Some((round, loss)) = summary.held_out {
                println!(
                    "held-out loss scored by the job as it trained: {loss:.4} (the model of round {round})"
                );
            }
            if let Some(held) = finished.held {
                println!(
                    "the network stays up: the dashboard is at {}; press Ctrl-C to stop it",
                    held.dashboard
                );
                held.wait()?;
            }
        }
    }
    Ok(())
}
