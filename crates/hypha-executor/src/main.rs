//! `hypha-executor`: see the library's documentation.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use hypha_executor::{
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
    },
    /// Write a learnable synthetic dataset for a model into a directory a data node can serve.
    Dataset {
        /// The model, as JSON: `{"type": "mlp", "inputs": 16, "hidden": 64, "classes": 4}`
        /// or `{"type": "transformer", "vocab": 32, "context": 16, "dim": 64, "heads": 4,
        /// "layers": 2}`.
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
    /// Evaluate a model file (SafeTensors) on fresh samples of the synthetic dataset.
    Evaluate {
        #[arg(long)]
        model: String,
        /// The model file.
        #[arg(long)]
        weights: PathBuf,
        #[arg(long, default_value_t = 2048)]
        samples: usize,
        /// Seeds the evaluation samples; keep it apart from the training seeds.
        #[arg(long, default_value_t = 1 << 40)]
        seed: u64,
    },
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Train {
            socket,
            work_dir,
            job,
        } => {
            let job: serde_json::Value =
                serde_json::from_str(&job).context("--job is not the job's JSON")?;
            let config: JobConfig = serde_json::from_value(job["config"].clone()).context(
                "the job's config is not a trainer's: it needs \"model\", \"data\" and \"diloco\" (a [diloco] job file gives them)",
            )?;
            Trainer::new(&socket, &work_dir, config)?.run()?;
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
            samples,
            seed,
        } => {
            let spec: ModelSpec = serde_json::from_str(&model).context("--model")?;
            let trained = Model::new(&spec, 0)?;
            trained.load(&hypha_diloco::Tensors::load(&weights)?)?;
            let batch = Synthetic::for_model(&spec).batch(samples, seed)?;
            let (loss, accuracy) = trained.evaluate(&batch)?;
            println!(
                "{}",
                serde_json::json!({"loss": loss, "accuracy": accuracy})
            );
        }
    }
    Ok(())
}
