//! `hypha quickstart`: a complete training network on this machine, as real processes of the
//! real binaries, in one command.
//!
//! In a new directory it makes a certificate authority and a certificate per node, writes a
//! learnable dataset (blobs for an MLP) or takes the user's own (`--dataset`: its last
//! slices held out for evaluation, the model given or suggested by the data, checked against
//! the data before anything starts), starts a gateway, a data node, a parameter-server
//! worker and three trainer workers (`hypha-executor`), runs a DiLoCo job with
//! `hypha-scheduler`, then writes `model.safetensors` (the final global model),
//! `metrics.jsonl` (every trainer report and round) and `loss.svg` (loss per round), prints the
//! evaluation loss and accuracy before and after, and stops every process. Logs of each process
//! are in `logs/`.

use std::{
    io::{BufRead, BufReader, Seek},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use hypha_certs::{
    NodeIdentity, Role, Roles, TrustStore,
    authority::{self, Validity},
};
use hypha_dataset::Dataset;
use hypha_executor::{
    contract::{self, TensorNames},
    local::{self, EvaluateError},
    model::{Model, ModelSpec},
    synthetic::Synthetic,
};
use hypha_network::PeerId;

use self::configs::{DataKeys, Executor, NoKeys, NodeFile, Offer, Resources, WorkerKeys};
use crate::readiness::{Prober, ProberError};

mod configs;

/// What the quickstart trains.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The directory it creates and works in.
    pub dir: PathBuf,
    pub trainers: usize,
    pub rounds: u64,
    pub slices: usize,
    pub samples_per_slice: usize,
    pub samples_per_round: u64,
    /// `[diloco] batch_size`: samples per inner step of each trainer.
    pub batch_size: usize,
    /// `[diloco] round_seconds`: the longest a round is planned to take.
    pub round_seconds: f64,
    /// `[diloco] inner.learning_rate`: the trainers' AdamW step size.
    pub learning_rate: f64,
    /// Where the Hypha binaries are (by default, beside this one).
    pub bin_dir: PathBuf,
    /// The user's own dataset instead of the synthetic one.
    pub dataset: Option<OwnData>,
    /// Where the scheduler serves its live dashboard: a port or IP:PORT (port 0: any free
    /// one).
    pub http: String,
    /// Keep the network and the dashboard up after training, until [`Held::wait`] returns.
    pub hold: bool,
    /// One more trainer, written in Python with `hypha_sdk`: the script and the interpreter
    /// that runs it.
    pub python_trainer: Option<PythonTrainer>,
    /// `[diloco] compression`: `none`, `bf16`, `int8` or `sparse` (with its defaults).
    pub compression: String,
    /// `[diloco] overlap`.
    pub overlap: bool,
}

/// A trainer the quickstart runs as `{python} {script} --socket … --work-dir … --job …`.
#[derive(Debug, Clone)]
pub struct PythonTrainer {
    pub script: PathBuf,
    pub python: String,
}

impl Settings {
    /// Every trainer of the job: the reference executors and the Python one.
    fn all_trainers(&self) -> usize {
        self.trainers + usize::from(self.python_trainer.is_some())
    }
}

/// What [`run`] tells its caller as it goes.
#[derive(Debug, Clone, Copy)]
pub enum Progress<'a> {
    /// The step it is at now (replaced by the next).
    Step(&'a str),
    /// Something to keep on screen: where the dashboard is.
    Notice(&'a str),
}

/// The network kept up after training (`--hold`): stopped when dropped.
#[derive(Debug)]
pub struct Held {
    nodes: Vec<Node>,
    /// The dashboard's address.
    pub dashboard: String,
}

impl Held {
    /// Waits for Ctrl-C (SIGINT) or SIGTERM, then stops every process of the network.
    pub fn wait(self) -> Result<(), QuickstartError> {
        use nix::sys::signal::{SigSet, Signal};
        let mut signals = SigSet::empty();
        signals.add(Signal::SIGINT);
        signals.add(Signal::SIGTERM);
        // Blocked, they wait for `wait` instead of ending this process before its children.
        signals
            .thread_block()
            .and_then(|()| signals.wait())
            .map_err(QuickstartError::Signal)?;
        drop(self.nodes);
        Ok(())
    }
}

/// What [`run`] leaves: the scores, and with `hold` the network still up.
#[derive(Debug)]
pub struct Finished {
    pub summary: Summary,
    pub held: Option<Held>,
}

/// A dataset the user brings (`--dataset`), and what to train on it.
#[derive(Debug, Clone)]
pub struct OwnData {
    /// A dataset directory: the seed recipe's output, `hypha-data prepare`'s, or plain
    /// SafeTensors slices.
    pub dir: PathBuf,
    /// The model (default: the one the data suggests, see
    /// [`hypha_executor::local::suggest_model`]).
    pub model: Option<ModelSpec>,
    pub tensors: TensorNames,
}

/// What the quickstart measured.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    pub loss_before: f64,
    pub accuracy_before: f64,
    pub loss_after: f64,
    pub accuracy_after: f64,
    pub rounds: u64,
    pub seconds: f64,
    /// How the scheduler said the job ended: the trainers that finished, and each one
    /// benched, when and why.
    pub outcome: String,
    /// Updates the parameter server refused, and those that counted for a share of
    /// themselves (clipped).
    pub refused: u64,
    pub clipped: u64,
    /// What the model was evaluated on.
    pub evaluated_on: String,
    /// The job's last score of the global model on the held-out data, as it trained:
    /// (the model's round, loss).
    pub held_out: Option<(u64, f64)>,
    /// The model trained.
    pub model: ModelSpec,
}

#[derive(Debug, thiserror::Error)]
pub enum QuickstartError {
    #[error("{0} exists and is not empty: choose another --dir or remove it")]
    NotEmpty(PathBuf),
    #[error("cannot write {path}: {error}")]
    Write {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error(
        "cannot start {program} (is it built? `cargo build --release` makes all of them): {error}"
    )]
    Start {
        program: PathBuf,
        error: std::io::Error,
    },
    #[error("{name} did not get ready within {seconds} s; its log: {log}")]
    NotReady {
        name: String,
        seconds: u64,
        log: PathBuf,
    },
    #[error("{name} exited while starting ({status}); the end of its log ({log}):\n{tail}")]
    Exited {
        name: String,
        status: std::process::ExitStatus,
        log: PathBuf,
        tail: String,
    },
    #[error("the training job failed: {reason}\n(the scheduler's log: {log})")]
    Job { reason: String, log: PathBuf },
    #[error(
        "{dir}: the dataset has {slices} slice(s); --dataset needs at least 2, to hold the last out for evaluation"
    )]
    TooFewSlices { dir: PathBuf, slices: usize },
    #[error("the model cannot train on {dir}: {error}")]
    Misfit {
        dir: PathBuf,
        error: contract::ContractError,
    },
    #[error("--dataset {dir}: {error}")]
    OwnData { dir: PathBuf, error: EvaluateError },
    #[error("--python-trainer {script}: {problem}")]
    PythonTrainer { script: PathBuf, problem: String },
    #[error(transparent)]
    Certs(#[from] hypha_certs::Error),
    #[error(transparent)]
    Dataset(#[from] hypha_executor::synthetic::SyntheticError),
    #[error(transparent)]
    Model(#[from] hypha_executor::model::ModelError),
    #[error(transparent)]
    Tensors(#[from] hypha_diloco::Error),
    #[error("evaluating: {0}")]
    Evaluate(#[from] candle_core::Error),
    #[error("cannot wait for Ctrl-C: {0}")]
    Signal(nix::Error),
    #[error(transparent)]
    Prober(#[from] ProberError),
}

/// The model the quickstart trains.
pub const MODEL: ModelSpec = ModelSpec::Mlp {
    inputs: 16,
    hidden: 64,
    classes: 4,
};
/// Seeds the model's initial parameters.
const MODEL_SEED: u64 = 1;
/// How long a node may take to start.
const READY: Duration = Duration::from_secs(60);

/// A child process, stopped when dropped.
#[derive(Debug)]
struct Node {
    name: String,
    child: Child,
    log: PathBuf,
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Ok(pid) = i32::try_from(self.child.id()) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGTERM,
            );
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs the quickstart; `progress` is told each step, each round's number and loss as it is
/// applied, and where the dashboard is.
pub fn run(
    settings: &Settings,
    mut report: impl FnMut(Progress<'_>),
) -> Result<Finished, QuickstartError> {
    let started = Instant::now();
    let (dir, training, python_trainer) = prepare(settings, &mut report)?;
    report(Progress::Step("making certificates"));
    let certs = Certs::new(&dir)?;
    let network = start_network(settings, &dir, &certs, python_trainer.as_ref(), &mut report)?;
    let trained = train(settings, &dir, &certs, &training, network, &mut report)?;
    let held = trained.hold.then(|| Held {
        nodes: trained.nodes,
        dashboard: trained.dashboard,
    });
    let model_path = keep_outputs(&dir, &trained.watch, &trained.metrics)?;
    let summary = score(&training, &model_path, &trained.watch, started)?;
    Ok(Finished { summary, held })
}

/// Checks the user's data and Python trainer before anything is written or started, makes
/// the quickstart's directory, and lays out the data: the directory, what is trained, and
/// the Python trainer checked.
fn prepare<'s>(
    settings: &'s Settings,
    report: &mut impl FnMut(Progress<'_>),
) -> Result<(PathBuf, Training, Option<CheckedPythonTrainer<'s>>), QuickstartError> {
    let dir = &settings.dir;
    if std::fs::read_dir(dir).is_ok_and(|mut d| d.next().is_some()) {
        return Err(QuickstartError::NotEmpty(dir.clone()));
    }
    // The user's data is checked against the model before anything is written or started.
    let own = match &settings.dataset {
        Some(own) => {
            report(Progress::Step("checking the dataset against the model"));
            Some(check_own_data(own)?)
        }
        None => None,
    };
    let python_trainer = settings
        .python_trainer
        .as_ref()
        .map(check_python_trainer)
        .transpose()?;
    for sub in ["", "certs", "logs", "data", "work"] {
        let path = dir.join(sub);
        std::fs::create_dir_all(&path).map_err(|error| QuickstartError::Write { path, error })?;
    }
    let dir = std::fs::canonicalize(dir).map_err(|error| QuickstartError::Write {
        path: dir.clone(),
        error,
    })?;
    let training = match own {
        Some(own) => lay_out_own_data(own, &dir)?,
        None => {
            report(Progress::Step("writing the dataset"));
            write_synthetic_data(settings, &dir)?
        }
    };
    Ok((dir, training, python_trainer))
}

/// Writes the learnable synthetic dataset (blobs for [`MODEL`]) and its held-out part.
fn write_synthetic_data(settings: &Settings, dir: &Path) -> Result<Training, QuickstartError> {
    let dataset = dir.join("data/blobs");
    Synthetic::for_model(&MODEL).write(&dataset, settings.slices, settings.samples_per_slice, 0)?;
    let held_out = dir.join("data/blobs-heldout");
    let (slices, samples) = SYNTHETIC_HELD_OUT;
    Synthetic::for_model(&MODEL).write(&held_out, slices, samples, 1 << 40)?;
    Ok(Training {
        model: MODEL,
        tensors: TensorNames::default(),
        dataset: "blobs".into(),
        samples: (settings.slices * settings.samples_per_slice) as u64,
        held_out: HeldOut {
            dataset: "blobs-heldout".into(),
            dir: held_out,
            described: format!(
                "{} fresh samples of the synthetic dataset",
                slices * samples
            ),
        },
    })
}

/// The nodes the job runs on, up and ready, and how a node joins them.
struct Network {
    nodes: Vec<Node>,
    /// The gateway's address, which every node joins.
    gateway: String,
}

/// Starts the gateway, then the data node and the workers (the parameter server's and the
/// trainers'), and waits until each says it is ready.
fn start_network(
    settings: &Settings,
    dir: &Path,
    certs: &Certs,
    python_trainer: Option<&CheckedPythonTrainer<'_>>,
    report: &mut impl FnMut(Progress<'_>),
) -> Result<Network, QuickstartError> {
    report(Progress::Step("starting the gateway"));
    let port = free_port(dir)?;
    let (gateway_config, gateway_peer) =
        certs.config("gateway", Role::Gateway, port, None, NoKeys {})?;
    let mut nodes = Vec::new();
    let mut gateway = start(settings, dir, "gateway", "hypha-gateway", &gateway_config)?;
    let gateway_address = format!("/ip4/127.0.0.1/tcp/{port}/p2p/{gateway_peer}");
    wait_listening(&mut gateway, port)?;
    let (identity, trust) = certs.prober()?;
    let prober = Prober::start(&identity, trust, &gateway_address)?;
    wait_ready(&mut gateway, gateway_peer, &prober)?;
    nodes.push(gateway);

    report(Progress::Step(
        "starting the data node, the parameter server and the trainers",
    ));
    let join = Some(gateway_address.as_str());
    let data_keys = DataKeys {
        dataset_path: dir.join("data"),
    };
    let (data_config, data_peer) = certs.config("data", Role::Data, 0, join, data_keys)?;
    let mut data = start(settings, dir, "data", "hypha-data", &data_config)?;
    let mut started_workers = Vec::new();
    for (name, executors) in worker_executors(settings, python_trainer) {
        let worker_keys = WorkerKeys {
            work_dir: dir.join("work").join(&name),
            resources: Resources {
                cpu: 1.0,
                memory: 1.0,
            },
            offer: Offer { price: 1.0 },
            executors,
        };
        let (config, peer) = certs.config(&name, Role::Worker, 0, join, worker_keys)?;
        started_workers.push((start(settings, dir, &name, "hypha-worker", &config)?, peer));
    }
    wait_ready(&mut data, data_peer, &prober)?;
    nodes.push(data);
    for (mut worker, peer) in started_workers {
        wait_ready(&mut worker, peer, &prober)?;
        nodes.push(worker);
    }
    Ok(Network {
        nodes,
        gateway: gateway_address,
    })
}

/// Each worker's name and its `[[executors]]`: the parameter server's, the reference
/// trainers' (`hypha-executor`), and the Python trainer's.
fn worker_executors(
    settings: &Settings,
    python_trainer: Option<&CheckedPythonTrainer<'_>>,
) -> Vec<(String, Vec<Executor>)> {
    let executor = settings.bin_dir.join("hypha-executor");
    let mut workers = vec![(
        "parameter-server".to_string(),
        vec![Executor::parameter_server()],
    )];
    for i in 0..settings.trainers {
        let trainer = Executor::trainer(
            executor.display().to_string(),
            &["train".to_string()],
            Vec::new(),
        );
        workers.push((format!("trainer-{i}"), vec![trainer]));
    }
    if let Some((python, script, python_path)) = python_trainer {
        let env = python_path
            .iter()
            .map(|path| format!("PYTHONPATH={path}"))
            .collect();
        let trainer =
            Executor::trainer(python.python.clone(), &[script.display().to_string()], env);
        workers.push(("python-trainer".to_string(), vec![trainer]));
    }
    workers
}

/// What the training left: every node (the scheduler last), the run as watched, where its
/// metrics are, and whether the network is to be held up.
struct Trained {
    nodes: Vec<Node>,
    dashboard: String,
    watch: RunWatch,
    metrics: PathBuf,
    hold: bool,
}

/// Writes the job, starts the scheduler on it and follows the run to its end, reporting each
/// round; stops the network unless it is to be held.
fn train(
    settings: &Settings,
    dir: &Path,
    certs: &Certs,
    training: &Training,
    network: Network,
    report: &mut impl FnMut(Progress<'_>),
) -> Result<Trained, QuickstartError> {
    let Network { mut nodes, gateway } = network;
    let job = dir.join("job.toml");
    write_toml(
        &job,
        "The quickstart's DiLoCo job (see docs/diloco.md).",
        &job_file(settings, training),
    )?;
    let (scheduler_config, _) =
        certs.config("scheduler", Role::Scheduler, 0, Some(&gateway), NoKeys {})?;
    let events = dir.join("logs/scheduler-events.jsonl");
    let metrics = dir.join("job.metrics.jsonl");
    let mut scheduler = start_scheduler(settings, dir, &scheduler_config, &job, &events)?;
    let dashboard = wait_for(&mut scheduler, DASHBOARD_LINE)?
        .split(DASHBOARD_LINE)
        .nth(1)
        .unwrap_or_default()
        .trim()
        .to_string();
    report(Progress::Notice(&format!(
        "the dashboard of the training: {dashboard}"
    )));
    report(Progress::Step("training"));
    let files = (events.as_path(), metrics.as_path());
    let mut watch = RunWatch::default();
    let failed = |scheduler: &Node| QuickstartError::Job {
        reason: failure(&scheduler.log),
        log: scheduler.log.clone(),
    };
    // The job ends with its `done` event; a held scheduler goes on serving the dashboard.
    loop {
        watch.follow(files, &mut *report);
        match watch.done {
            Some(true) => break,
            Some(false) => return Err(failed(&scheduler)),
            None => {}
        }
        match scheduler.child.try_wait() {
            Ok(None) => std::thread::sleep(Duration::from_millis(200)),
            Ok(Some(status)) if status.success() => {
                // Stopped: its last events may have come after the look above.
                watch.follow(files, &mut *report);
                if watch.done == Some(true) {
                    break;
                }
                return Err(failed(&scheduler));
            }
            Ok(Some(_)) | Err(_) => return Err(failed(&scheduler)),
        }
    }
    watch.follow(files, &mut *report);
    // Unless held, the scheduler ends by itself once its workers heard the job is over.
    if !settings.hold && !scheduler.child.wait().is_ok_and(|s| s.success()) {
        return Err(failed(&scheduler));
    }
    // The metrics are another file than the events: the last round's line may follow the
    // `done` event (a CI run counted 9 of 10 rounds); an exited scheduler wrote everything.
    watch.follow(files, &mut *report);
    nodes.push(scheduler);
    if !settings.hold {
        nodes.clear();
    }
    Ok(Trained {
        nodes,
        dashboard,
        watch,
        metrics,
        hold: settings.hold,
    })
}

/// Keeps what the run made: `model.safetensors` (the final global model), `metrics.jsonl` and
/// `loss.svg`; returns the model's path.
fn keep_outputs(dir: &Path, watch: &RunWatch, metrics: &Path) -> Result<PathBuf, QuickstartError> {
    let final_model =
        find_final(&dir.join("work/parameter-server")).ok_or_else(|| QuickstartError::Job {
            reason: "the parameter server left no final model".into(),
            log: dir.join("logs/parameter-server.log"),
        })?;
    let model_path = dir.join("model.safetensors");
    std::fs::copy(&final_model, &model_path).map_err(|error| QuickstartError::Write {
        path: model_path.clone(),
        error,
    })?;
    let metrics_path = dir.join("metrics.jsonl");
    std::fs::rename(metrics, &metrics_path).map_err(|error| QuickstartError::Write {
        path: metrics_path,
        error,
    })?;
    let plot = hypha_plot::loss_by_round(&watch.losses, &watch.held_out).map_err(|e| {
        QuickstartError::Write {
            path: dir.join("loss.svg"),
            error: std::io::Error::other(e.to_string()),
        }
    })?;
    write(&dir.join("loss.svg"), &plot)?;
    Ok(model_path)
}

/// Scores the first and the final model on the held-out data, the way the job did.
fn score(
    training: &Training,
    model_path: &Path,
    watch: &RunWatch,
    started: Instant,
) -> Result<Summary, QuickstartError> {
    let before = Model::new(&training.model, MODEL_SEED)?;
    let after = Model::new(&training.model, MODEL_SEED)?;
    after.load(&hypha_diloco::Tensors::load(model_path)?)?;
    let ((loss_before, accuracy_before), (loss_after, accuracy_after)) =
        (training.score(&before)?, training.score(&after)?);
    Ok(Summary {
        loss_before,
        accuracy_before,
        loss_after,
        accuracy_after,
        rounds: watch.rounds,
        seconds: started.elapsed().as_secs_f64(),
        outcome: watch.outcome.clone(),
        refused: watch.refused,
        clipped: watch.clipped,
        evaluated_on: training.held_out.described.clone(),
        held_out: watch.held_out.last().copied(),
        model: training.model.clone(),
    })
}

/// What the quickstart trains, on which data, and how it is scored.
struct Training {
    model: ModelSpec,
    tensors: TensorNames,
    /// The dataset's name, as the data node announces it.
    dataset: String,
    /// Samples the data node serves.
    samples: u64,
    held_out: HeldOut,
}

/// The data held out of training, served by the data node as a dataset of its own: the job
/// scores the global model on it as it trains (`[data] eval`), and the quickstart scores the
/// first and the final model on it, the same way.
struct HeldOut {
    /// Its name, as the data node announces it.
    dataset: String,
    /// Where the data node serves it from.
    dir: PathBuf,
    /// What it is, in words.
    described: String,
}

impl Training {
    /// Loss and accuracy of `model` on the held-out data.
    fn score(&self, model: &Model) -> Result<(f64, f64), QuickstartError> {
        let dir = &self.held_out.dir;
        let score = local::evaluate_dataset(model, dir, &self.tensors, None).map_err(|error| {
            QuickstartError::OwnData {
                dir: dir.clone(),
                error,
            }
        })?;
        Ok((score.loss, score.accuracy))
    }
}

/// Fresh samples of the synthetic dataset, drawn from seeds no training slice used, held out.
const SYNTHETIC_HELD_OUT: (usize, usize) = (4, 1024);

/// The user's dataset, opened, with the model decided and checked against it.
struct CheckedData {
    own: OwnData,
    dataset: Dataset,
    model: ModelSpec,
}

/// Takes the user's dataset: decides the model and checks that the data fits it.
fn check_own_data(own: &OwnData) -> Result<CheckedData, QuickstartError> {
    let dataset_error = |error: EvaluateError| QuickstartError::OwnData {
        dir: own.dir.clone(),
        error,
    };
    let dataset = Dataset::open(&own.dir).map_err(|e| dataset_error(e.into()))?;
    let manifest = dataset.manifest();
    let count = manifest.slices.len();
    if count < 2 {
        return Err(QuickstartError::TooFewSlices {
            dir: own.dir.clone(),
            slices: count,
        });
    }
    let model = match &own.model {
        Some(model) => model.clone(),
        None => local::suggest_model(&own.dir, &own.tensors).map_err(dataset_error)?,
    };
    contract::check_manifest(&model, &own.tensors, manifest).map_err(|error| {
        QuickstartError::Misfit {
            dir: own.dir.clone(),
            error,
        }
    })?;
    Ok(CheckedData {
        own: own.clone(),
        dataset,
        model,
    })
}

/// Lays out the training slices of the user's dataset (all but the last tenth, at least one
/// held out) for the data node, hard-linked (copied across file systems), the user's
/// directory untouched.
fn lay_out_own_data(checked: CheckedData, dir: &Path) -> Result<Training, QuickstartError> {
    let CheckedData {
        own,
        dataset,
        model,
    } = checked;
    let manifest = dataset.manifest();
    let count = manifest.slices.len();
    let train = count - (count / 10).max(1);
    let (trained, held) = manifest.slices.split_at(train);
    let held_out = format!("{}-heldout", dataset.name());
    let mut served = Vec::new();
    for (name, slices) in [(dataset.name(), trained), (&held_out, held)] {
        let to_dir = dir.join("data").join(name);
        std::fs::create_dir_all(&to_dir).map_err(|error| QuickstartError::Write {
            path: to_dir.clone(),
            error,
        })?;
        for entry in slices {
            let (from, to) = (dataset.root().join(&entry.file), to_dir.join(&entry.file));
            std::fs::hard_link(&from, &to)
                .or_else(|_| std::fs::copy(&from, &to).map(drop))
                .map_err(|error| QuickstartError::Write { path: to, error })?;
        }
        // A dataset's slices are numbered from 0, whichever files they are.
        let numbered = (slices.iter().zip(0..))
            .map(|(entry, index)| hypha_dataset::SliceEntry {
                index,
                ..entry.clone()
            })
            .collect();
        let part = hypha_dataset::Manifest {
            slices: numbered,
            name: name.to_string(),
            ..manifest.clone()
        };
        let json = serde_json::to_string_pretty(&part).unwrap_or_default();
        write(&to_dir.join(hypha_dataset::MANIFEST_FILE), &json)?;
        served.push(to_dir);
    }
    let samples =
        |range: &[hypha_dataset::SliceEntry]| range.iter().filter_map(|s| s.samples).sum::<u64>();
    Ok(Training {
        model,
        tensors: own.tensors.clone(),
        dataset: dataset.name().to_string(),
        samples: samples(trained),
        held_out: HeldOut {
            described: format!(
                "{} samples of held-out slice(s) {train}..{count} of {}",
                samples(held),
                own.dir.display()
            ),
            dataset: held_out,
            dir: served.pop().unwrap_or_default(),
        },
    })
}

/// Why the scheduler failed: its last `error:` line and what follows (a failed executor's
/// stderr), else where to look.
fn failure(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    match text.rfind("\nerror: ") {
        Some(at) => text[at + "\nerror: ".len()..].trim_end().to_string(),
        None => "the scheduler stopped without saying why".into(),
    }
}

/// The job the quickstart runs: its trainers (the reference executors and a Python one),
/// the model, the data and its held-out part, and the rounds as `settings` say.
fn job_file<'a>(settings: &Settings, training: &'a Training) -> configs::JobFile<'a> {
    use configs::{
        Diloco, ExecutorName, InnerOptimizer, JobData, JobFile, JobResources, ModelConfig,
        ParameterServer,
    };
    // Enough epochs for every round to find data; the rounds end the job.
    let wanted = settings.rounds * settings.samples_per_round;
    let epochs = (wanted / training.samples.max(1) + 2).min(1000);
    JobFile {
        workers: settings.all_trainers(),
        bid: 10.0,
        executor: ExecutorName {
            class: "train",
            name: "diloco",
        },
        resources: JobResources { cpu: 1.0 },
        config: ModelConfig {
            seed: MODEL_SEED,
            model: &training.model,
            input: training.tensors.input.as_deref(),
            target: training.tensors.target.as_deref(),
        },
        data: JobData {
            dataset: &training.dataset,
            eval: &training.held_out.dataset,
            epochs,
            seed: 7,
        },
        diloco: Diloco {
            rounds: settings.rounds,
            // About twenty scores of the held-out data in a run, and the last model's.
            eval_every: (settings.rounds / 20).max(1),
            samples_per_round: settings.samples_per_round,
            batch_size: settings.batch_size,
            round_seconds: settings.round_seconds,
            compression: settings.compression.clone(),
            overlap: settings.overlap,
            inner: InnerOptimizer {
                learning_rate: settings.learning_rate,
                weight_decay: 0.01,
                beta1: 0.9,
                beta2: 0.999,
            },
            parameter_server: ParameterServer {
                bid: 10.0,
                executor: ExecutorName {
                    class: "aggregate",
                    name: "parameter-server",
                },
            },
        },
    }
}

/// A Python trainer checked: its settings, its script and the `PYTHONPATH` its executor gets.
type CheckedPythonTrainer<'a> = (&'a PythonTrainer, PathBuf, Option<String>);

/// The Python trainer, its script and the `PYTHONPATH` its executor gets, as the worker will
/// see them: absolute, since jobs run in their own directories. Checked first: the script is
/// a file and its interpreter imports the SDK.
fn check_python_trainer(
    python: &PythonTrainer,
) -> Result<CheckedPythonTrainer<'_>, QuickstartError> {
    let problem = |problem: String| QuickstartError::PythonTrainer {
        script: python.script.clone(),
        problem,
    };
    let script = std::path::absolute(&python.script).map_err(|e| problem(e.to_string()))?;
    if !script.is_file() {
        return Err(problem("no such file".into()));
    }
    let python_path = std::env::var_os("PYTHONPATH")
        .filter(|path| !path.is_empty())
        .map(|path| {
            let absolute: Vec<PathBuf> = std::env::split_paths(&path)
                .map(|p| std::path::absolute(&p).unwrap_or(p))
                .collect();
            std::env::join_paths(absolute)
                .map(|joined| joined.to_string_lossy().into_owned())
                .unwrap_or_else(|_| path.to_string_lossy().into_owned())
        });
    let mut imports = std::process::Command::new(&python.python);
    imports.args(["-c", "import hypha_sdk.diloco, numpy"]);
    if let Some(path) = &python_path {
        imports.env("PYTHONPATH", path);
    }
    let imports = imports.output().map_err(|e| {
        problem(format!(
            "cannot run {}: {e} (--python names the interpreter)",
            python.python
        ))
    })?;
    if !imports.status.success() {
        let stderr = String::from_utf8_lossy(&imports.stderr);
        let why = stderr.lines().last().unwrap_or("it failed").to_string();
        return Err(problem(format!(
            "{} cannot import the SDK: {why}; install it with `pip install './python[numpy]'` (or set PYTHONPATH=python)",
            python.python
        )));
    }
    Ok((python, script, python_path))
}

/// The certificates of the quickstart's nodes.
struct Certs {
    dir: PathBuf,
    org: authority::Authority,
    root_pem: String,
}

impl Certs {
    fn new(dir: &Path) -> Result<Self, QuickstartError> {
        let root = authority::create_root("Hypha Quickstart Root", Validity::days(2))?;
        let org = authority::create_org(&root, "Hypha Quickstart", Validity::days(2))?;
        write(&dir.join("certs/root.pem"), &root.cert_pem())?;
        Ok(Self {
            dir: dir.to_path_buf(),
            org,
            root_pem: root.cert_pem(),
        })
    }

    /// The quickstart's own identity on its network, of no role (it only asks how the nodes
    /// are), and the trust of the network.
    fn prober(&self) -> Result<(NodeIdentity, TrustStore), QuickstartError> {
        let node =
            authority::create_node(&self.org, "quickstart", &[], Roles::NONE, Validity::days(2))?;
        let identity =
            NodeIdentity::from_pem(node.chain_pem().as_bytes(), node.key_pem().as_bytes())?;
        let trust = TrustStore::from_pem(self.root_pem.as_bytes(), &[])?;
        Ok((identity, trust))
    }

    /// A certificate for `name` and its config, listening on `port` of 127.0.0.1 (0: any),
    /// joining the gateway at `gateway`, with the keys of its kind `own`: the config's path
    /// and the node's peer id.
    fn config(
        &self,
        name: &str,
        role: Role,
        port: u16,
        gateway: Option<&str>,
        own: impl serde::Serialize,
    ) -> Result<(PathBuf, PeerId), QuickstartError> {
        let node = authority::create_node(&self.org, name, &[], role.into(), Validity::days(2))?;
        let peer = NodeIdentity::from_pem(node.chain_pem().as_bytes(), node.key_pem().as_bytes())?
            .peer_id();
        let certs = self.dir.join("certs");
        write(&certs.join(format!("{name}-cert.pem")), &node.chain_pem())?;
        write(&certs.join(format!("{name}-key.pem")), &node.key_pem())?;
        let path = self.dir.join(format!("{name}.toml"));
        let file = NodeFile {
            cert_pem: format!("certs/{name}-cert.pem"),
            key_pem: format!("certs/{name}-key.pem"),
            trust_pem: "certs/root.pem".into(),
            listen_addresses: vec![format!("/ip4/127.0.0.1/tcp/{port}")],
            gateway_addresses: gateway.into_iter().map(str::to_string).collect(),
            own,
        };
        write_toml(
            &path,
            &format!("{name}'s config, written by `hypha quickstart`."),
            &file,
        )?;
        Ok((path, peer))
    }
}

/// Writes `value` as TOML at `path`, under `header` as a comment.
fn write_toml(
    path: &Path,
    header: &str,
    value: &impl serde::Serialize,
) -> Result<(), QuickstartError> {
    let text = toml::to_string(value).map_err(|error| QuickstartError::Write {
        path: path.to_path_buf(),
        error: std::io::Error::other(error.to_string()),
    })?;
    write(path, &format!("# {header}\n{text}"))
}

fn write(path: &Path, text: &str) -> Result<(), QuickstartError> {
    hypha_files::write_atomic(path, text.as_bytes(), hypha_files::Mode::Private, false).map_err(
        |error| QuickstartError::Write {
            path: path.to_path_buf(),
            error: std::io::Error::other(error.to_string()),
        },
    )
}

fn spawn(
    settings: &Settings,
    dir: &Path,
    name: &str,
    program: &str,
    args: &[&std::ffi::OsStr],
) -> Result<Node, QuickstartError> {
    let program = settings.bin_dir.join(program);
    let log = dir.join("logs").join(format!("{name}.log"));
    let file = std::fs::File::create(&log).map_err(|error| QuickstartError::Write {
        path: log.clone(),
        error,
    })?;
    let child = Command::new(&program)
        .args(args)
        .current_dir(dir)
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(file.try_clone().map_err(|error| QuickstartError::Write {
            path: log.clone(),
            error,
        })?)
        .stderr(file)
        .spawn()
        .map_err(|error| QuickstartError::Start { program, error })?;
    Ok(Node {
        name: name.to_string(),
        child,
        log,
    })
}

fn start(
    settings: &Settings,
    dir: &Path,
    name: &str,
    program: &str,
    config: &Path,
) -> Result<Node, QuickstartError> {
    spawn(
        settings,
        dir,
        name,
        program,
        &["run".as_ref(), "--config".as_ref(), config.as_os_str()],
    )
}

/// What the scheduler prints before its dashboard's address.
const DASHBOARD_LINE: &str = "dashboard: ";

fn start_scheduler(
    settings: &Settings,
    dir: &Path,
    config: &Path,
    job: &Path,
    events: &Path,
) -> Result<Node, QuickstartError> {
    let mut args: Vec<&std::ffi::OsStr> = vec![
        "run".as_ref(),
        "--config".as_ref(),
        config.as_os_str(),
        "--job".as_ref(),
        job.as_os_str(),
        "--events".as_ref(),
        events.as_os_str(),
        "--http".as_ref(),
        settings.http.as_ref(),
    ];
    if settings.hold {
        args.push("--hold".as_ref());
    }
    spawn(settings, dir, "scheduler", "hypha-scheduler", &args)
}

/// A port of 127.0.0.1 free now, for the gateway: the nodes join it at an address known
/// before it starts. (Another program may take it in between; the gateway then exits saying
/// so, and the quickstart with it.)
fn free_port(dir: &Path) -> Result<u16, QuickstartError> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|address| address.port())
        .map_err(|error| QuickstartError::Write {
            path: dir.to_path_buf(),
            error,
        })
}

/// Waits until `node` accepts connections on `port` of 127.0.0.1.
fn wait_listening(node: &mut Node, port: u16) -> Result<(), QuickstartError> {
    wait_until(node, || {
        std::net::TcpStream::connect_timeout(
            &std::net::SocketAddr::from(([127, 0, 0, 1], port)),
            Duration::from_millis(200),
        )
        .is_ok()
    })
}

/// Waits until `node` (peer `peer`) answers healthy: it can do its work.
fn wait_ready(node: &mut Node, peer: PeerId, prober: &Prober) -> Result<(), QuickstartError> {
    wait_until(node, || prober.ready(peer))
}

/// Waits until `ready` says so, at most [`READY`]; a node that exits first is reported at
/// once, with the end of its log.
fn wait_until(node: &mut Node, mut ready: impl FnMut() -> bool) -> Result<(), QuickstartError> {
    let deadline = Instant::now() + READY;
    while Instant::now() < deadline {
        if ready() {
            return Ok(());
        }
        if let Ok(Some(status)) = node.child.try_wait() {
            return Err(exited(node, status));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Err(QuickstartError::NotReady {
        name: node.name.clone(),
        seconds: READY.as_secs(),
        log: node.log.clone(),
    })
}

/// `node` exited with `status`: the error, with the end of its log.
fn exited(node: &Node, status: std::process::ExitStatus) -> QuickstartError {
    let lines: Vec<String> = std::fs::File::open(&node.log)
        .map(|file| BufReader::new(file).lines().map_while(Result::ok).collect())
        .unwrap_or_default();
    let tail = lines[lines.len().saturating_sub(EXITED_TAIL_LINES)..].join("\n");
    QuickstartError::Exited {
        name: node.name.clone(),
        status,
        log: node.log.clone(),
        tail,
    }
}

/// Lines of a node's log shown when it exits while starting.
const EXITED_TAIL_LINES: usize = 10;

/// Waits until `node`'s output has a line containing `needle` (what a program prints for its
/// user, as the scheduler prints its dashboard's address); that line.
fn wait_for(node: &mut Node, needle: &str) -> Result<String, QuickstartError> {
    let log = node.log.clone();
    let mut found = None;
    wait_until(node, || {
        found = std::fs::File::open(&log).ok().and_then(|file| {
            BufReader::new(file)
                .lines()
                .map_while(Result::ok)
                .find(|l| l.contains(needle))
        });
        found.is_some()
    })?;
    Ok(found.unwrap_or_default())
}

/// Reads a JSON-lines file as it grows.
#[derive(Debug, Default)]
struct Follow {
    offset: u64,
}

impl Follow {
    /// The whole lines added since the last call, parsed (a line that is not JSON skipped).
    fn new_lines(&mut self, path: &Path) -> Vec<serde_json::Value> {
        let Ok(mut file) = std::fs::File::open(path) else {
            return Vec::new();
        };
        if file.seek(std::io::SeekFrom::Start(self.offset)).is_err() {
            return Vec::new();
        }
        let mut new = Vec::new();
        let mut reader = BufReader::new(file);
        let mut line = String::new();
        while reader.read_line(&mut line).unwrap_or(0) > 0 {
            if !line.ends_with('\n') {
                break; // half a line: read it whole next time
            }
            self.offset += line.len() as u64;
            if let Ok(value) = serde_json::from_str(&line) {
                new.push(value);
            }
            line.clear();
        }
        new
    }
}

/// The training as the quickstart shows it: rounds and their loss from the metrics file,
/// the start and the end from the scheduler's events.
#[derive(Debug, Default)]
struct RunWatch {
    metrics: Follow,
    events: Follow,
    /// Rounds applied (the highest applied round + 1).
    rounds: u64,
    /// The training loss of each applied round the trainers' reports came in time for (a
    /// round applied before a trainer's report of it has none).
    losses: Vec<(u64, f64)>,
    /// The global models scored on the held-out data as the job trained: (round, loss).
    held_out: Vec<(u64, f64)>,
    /// The job ended: whether it succeeded.
    done: Option<bool>,
    /// What the scheduler said as the job ended.
    outcome: String,
    /// Updates refused and clipped; the peers each was first told of.
    refused: u64,
    clipped: u64,
    told: std::collections::HashSet<(&'static str, String)>,
}

impl RunWatch {
    /// Reads what the files gained; `progress` is told of each round applied and of the
    /// start waiting for trainers still loading.
    fn follow(&mut self, (events, metrics): (&Path, &Path), progress: &mut dyn FnMut(Progress)) {
        for event in self.events.new_lines(events) {
            let event = &event["event"];
            match event["kind"].as_str() {
                Some("waiting_for_trainers") => progress(Progress::Step(&format!(
                    "{} of {} trainers ready; waiting for the others to load (rounds begin when all are, or {:.0} s after the first was)",
                    event["ready"],
                    event["trainers"],
                    event["grace_s"].as_f64().unwrap_or_default()
                ))),
                Some("rounds_begin") => match event["late"].as_array() {
                    Some(late) => progress(Progress::Notice(&format!(
                        "rounds began without {} trainers still loading; they join once ready",
                        late.len()
                    ))),
                    None => progress(Progress::Step("training")),
                },
                Some("done") => {
                    self.done = event["ok"].as_bool();
                    self.outcome = event["message"].as_str().unwrap_or_default().to_string();
                }
                Some("benched") => progress(Progress::Notice(&format!(
                    "trainer {} benched at round {}: {}",
                    event["peer"].as_str().unwrap_or_default(),
                    event["round"],
                    event["reason"].as_str().unwrap_or_default()
                ))),
                // Each trainer's first refused and first clipped update is told; the end
                // says how many there were.
                Some(kind @ ("refused" | "clipped")) => {
                    let peer = event["peer"].as_str().unwrap_or_default().to_string();
                    let kind = if kind == "refused" {
                        self.refused += 1;
                        "refused"
                    } else {
                        self.clipped += 1;
                        "clipped"
                    };
                    if self.told.insert((kind, peer.clone())) {
                        let how = match kind {
                            "refused" => {
                                format!("refused: {}", event["reason"].as_str().unwrap_or_default())
                            }
                            _ => format!(
                                "clipped to {:.3} of itself: {}",
                                event["share"].as_f64().unwrap_or_default(),
                                event["reason"]
                                    .as_str()
                                    .unwrap_or("beyond the round's limits")
                            ),
                        };
                        progress(Progress::Notice(&format!(
                            "round {}: trainer {peer}'s update {how}; later ones are counted at the end",
                            event["round"]
                        )));
                    }
                }
                _ => {}
            }
        }
        for line in self.metrics.new_lines(metrics) {
            if line["kind"] == "round"
                && let Some(round) = line["round"].as_u64()
            {
                self.rounds = self.rounds.max(round + 1);
                match line["loss"].as_f64() {
                    Some(loss) => {
                        progress(Progress::Step(&format!(
                            "round {round} applied, training loss {loss:.4}"
                        )));
                        self.losses.push((round, loss));
                    }
                    None => progress(Progress::Step(&format!("round {round} applied"))),
                }
            }
            if line["kind"] == "eval"
                && let (Some(round), Some(loss)) = (line["round"].as_u64(), line["loss"].as_f64())
            {
                progress(Progress::Step(&format!(
                    "held-out loss {loss:.4} (the model of round {round})"
                )));
                self.held_out.push((round, loss));
            }
        }
    }
}

/// The final model the parameter server wrote under its work directory.
fn find_final(work: &Path) -> Option<PathBuf> {
    std::fs::read_dir(work)
        .ok()?
        .flatten()
        .map(|e| e.path().join("final.safetensors"))
        .find(|p| p.exists())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// The job the quickstart writes, with a Python trainer and a transformer on named
    /// tensors, is one the scheduler reads (its schema denies unknown keys) as it was meant:
    /// names with quotes and backslashes included.
    #[test]
    fn the_job_file_is_read_by_the_schedulers_schema_as_written() {
        let settings = Settings {
            dir: PathBuf::from("/tmp/qs"),
            trainers: 3,
            rounds: 400,
            slices: 8,
            samples_per_slice: 64,
            samples_per_round: 96,
            batch_size: 16,
            round_seconds: 2.5,
            learning_rate: 0.003,
            bin_dir: PathBuf::new(),
            dataset: None,
            http: "0".into(),
            hold: false,
            python_trainer: Some(PythonTrainer {
                script: PathBuf::from("t.py"),
                python: "python3".into(),
            }),
            compression: "int8".into(),
            overlap: true,
        };
        let model = ModelSpec::Transformer {
            vocab: 64,
            context: 16,
            dim: 32,
            heads: 2,
            layers: 1,
        };
        let training = Training {
            model: model.clone(),
            tensors: TensorNames {
                input: Some("tokens \"in\"".into()),
                target: None,
            },
            dataset: "my \\ data".into(),
            samples: 512,
            held_out: HeldOut {
                dataset: "my \\ data-heldout".into(),
                dir: PathBuf::new(),
                described: String::new(),
            },
        };
        let text = toml::to_string(&job_file(&settings, &training)).unwrap();
        let job = hypha_scheduler::spec::JobFile::parse("job.toml", &text).unwrap();
        assert_eq!((job.workers.min, job.workers.max), (4, 4), "{text}");
        let config: serde_json::Value = serde_json::to_value(&job.config).unwrap();
        let read: ModelSpec = serde_json::from_value(config["model"].clone()).unwrap();
        assert_eq!(read, model, "{text}");
        assert_eq!(config["input"], "tokens \"in\"");
        assert!(config.get("target").is_none(), "{text}");
        let data = job.data.unwrap();
        assert_eq!(data.dataset, "my \\ data");
        assert_eq!(data.eval.as_deref(), Some("my \\ data-heldout"));
        // 400 rounds of 96 samples over 512 samples: 75 epochs, and two more.
        assert_eq!(data.epochs, 77);
        let diloco = job.diloco.unwrap();
        assert_eq!(diloco.rounds, Some(400));
        assert_eq!(diloco.eval_every, 20);
        assert_eq!((diloco.samples_per_round, diloco.batch_size), (96, 16));
        assert_eq!(diloco.round_seconds, 2.5);
        assert_eq!(diloco.inner.learning_rate, 0.003);
        assert_eq!(diloco.compression, "int8");
        assert!(diloco.overlap);
        assert_eq!(diloco.parameter_server.executor.name, "parameter-server");
    }

    #[test]
    fn a_failed_jobs_reason_is_the_schedulers_last_error_with_what_follows() {
        let tmp = tempfile::tempdir().unwrap();
        let log = tmp.path().join("scheduler.log");
        std::fs::write(
            &log,
            "2026 INFO job dispatched\nerror: an earlier one\n2026 WARN job failed\nerror: slot 0 failed 3 times; last: exit code 1; the executor's stderr ended with:\n    Traceback (most recent call last):\n    ValueError: bad labels\n",
        )
        .unwrap();
        assert_eq!(
            failure(&log),
            "slot 0 failed 3 times; last: exit code 1; the executor's stderr ended with:\n    Traceback (most recent call last):\n    ValueError: bad labels"
        );
        std::fs::write(&log, "nothing useful\n").unwrap();
        assert!(failure(&log).contains("without saying why"));
    }
}
