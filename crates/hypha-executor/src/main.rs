//! `hypha-executor`: see the library's documentation.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use hypha_executor::{
    contract::TensorNames,
    learner::SyntheticUpdates,
    local::{Tally, evaluate_dataset},
    model::{Model, ModelSpec},
    synthetic::Synthetic,
    train::{JobConfig, Trainer},
};

/// Hypha's reference executor: trains small models with DiLoCo on the CPU.
#[derive(Debug, Parser)]
#[command(version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run one training job (as a worker starts it: `args = ["train", "--socket",
    /// "{SOCKET_PATH}", "--work-dir", "{WORK_DIR}", "--job", "{JOB_JSON}"]`).
    Train {
        /// The job bridge's socket.
        #[arg(long)]
        socket: PathBuf,
        /// The job's directory.
        #[arg(long)]
        work_dir: PathBuf,
        /// The job's specification (JSON, with the scheduler's `config`).
        #[arg(long)]
        job: String,
        /// Train nothing: send pseudo-gradients of the model's shapes drawn at random, and
        /// keep the global model in a file of the job's directory, never whole in memory.
        /// For benchmarks of the pipeline at model sizes this machine cannot train; the
        /// rest (slices, reports, fingerprints) is a trainer's.
        #[arg(long)]
        synthetic_updates: bool,
    },
    /// Write a learnable synthetic dataset for a model into a directory a data node can serve.
    Dataset {
        /// The model, as JSON: `{"type": "mlp", "inputs": 16, "hidden": 64, "classes": 4}`,
        /// `{"type": "cnn", "channels": 1, "classes": 4}` or `{"type": "transformer", "vocab":
        /// 32, "context": 16, "dim": 64, "heads": 4, "layers": 2}`.
        #[arg(long)]
        model: String,
        /// The dataset's directory; its name is the dataset's name.
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value_t = 32)]
        slices: usize,
        /// Samples per slice.
        #[arg(long, default_value_t = 256)]
        samples: usize,
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
    /// Score a model file (SafeTensors) on a dataset directory, or on fresh samples of the
    /// model's synthetic dataset; prints {"loss", "accuracy", "samples"} as JSON.
    Evaluate {
        /// The model, as JSON (as in the job's `[config] model`).
        #[arg(long)]
        model: String,
        /// The model file.
        #[arg(long)]
        weights: PathBuf,
        /// A dataset directory (seed recipe, `hypha-data prepare` output or plain
        /// SafeTensors slices) to score on, read as trainers read it.
        #[arg(long)]
        dataset: Option<PathBuf>,
        /// With --dataset: the slices to score, as START..END (default: all).
        #[arg(long, value_parser = parse_range)]
        slices: Option<std::ops::Range<usize>>,
        /// With --dataset: the input tensor (default: the first of inputs, images,
        /// input_ids, tokens).
        #[arg(long)]
        input: Option<String>,
        /// With --dataset: the classifiers' target tensor (default: labels).
        #[arg(long)]
        target: Option<String>,
        /// Without --dataset: synthetic samples to score.
        #[arg(long, default_value_t = 2048)]
        samples: usize,
        /// Without --dataset: seeds the synthetic samples; keep it apart from the training
        /// seeds.
        #[arg(long, default_value_t = 1 << 40)]
        seed: u64,
    },
}

/// `START..END` as a range of slice indices.
fn parse_range(text: &str) -> Result<std::ops::Range<usize>, String> {
    let (start, end) = text
        .split_once("..")
        .ok_or_else(|| format!("{text:?}: write the slices as START..END, e.g. 30..32"))?;
    let number = |s: &str| {
        s.trim()
            .parse::<usize>()
            .map_err(|e| format!("{text:?}: {s:?} is not a slice index ({e})"))
    };
    Ok(number(start)?..number(end)?)
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
        Command::Train {
            socket,
            work_dir,
            job,
            synthetic_updates,
        } => {
            let job: hypha_bridge::JobDescription =
                serde_json::from_str(&job).context("--job is not the job's JSON")?;
            let config: JobConfig = serde_json::from_value(job.config).context(
                "the job's config is not a trainer's: it needs \"model\", \"data\" and \"diloco\" (a [diloco] job file gives them)",
            )?;
            if synthetic_updates {
                let codec = config.codec().map_err(anyhow::Error::msg)?;
                let learner = SyntheticUpdates::new(
                    &config.model,
                    config.seed,
                    codec,
                    &work_dir.join("synthetic"),
                )?;
                Trainer::with_learner(&socket, &work_dir, config, learner).run()?;
            } else {
                Trainer::new(&socket, &work_dir, config)?.run()?;
            }
        }
        Command::Dataset {
            model,
            out,
            slices,
            samples,
            seed,
        } => {
            let spec: ModelSpec = serde_json::from_str(&model).context("--model")?;
            Synthetic::for_model(&spec).write(&out, slices, samples, seed)?;
            println!("{slices} slices of {samples} samples in {}", out.display());
        }
        Command::Evaluate {
            model,
            weights,
            dataset,
            slices,
            input,
            target,
            samples,
            seed,
        } => {
            let spec: ModelSpec = serde_json::from_str(&model).context("--model")?;
            let trained = Model::new(&spec, 0)?;
            trained.load(&hypha_diloco::Tensors::load(&weights)?)?;
            let score = match dataset {
                Some(dir) => {
                    let names = TensorNames { input, target };
                    evaluate_dataset(&trained, &dir, &names, slices)?
                }
                None => {
                    let batch = Synthetic::for_model(&spec).batch(samples, seed)?;
                    let mut tally = Tally::default();
                    tally.add(&trained, &batch)?;
                    tally.score()
                }
            };
            println!("{}", serde_json::to_string(&score)?);
        }
    }
    Ok(())
}
