//! `outcome`: does DiLoCo train as well as one machine would, on real text, at equal tokens?
//! (issue 56)
//!
//! - **Corpus**: text no one here wrote: the Python standard library of this machine's
//!   `python3` (`sysconfig.get_paths()["stdlib"]`), its `.py` files without `test/`,
//!   `tests/`, `idle_test/`, `site-packages/` and `dist-packages/` (12 MB on CPython 3.11.7),
//!   sorted by path. Every 20th file is held out; files that are not UTF-8 are left out. The
//!   corpus is the host's: compare runs on one machine. The held-out rows scored are evenly
//!   spaced over the held-out text, so its largest files weigh most (`tkinter/__init__.py` is
//!   about a third of it on 3.11.7); every run is scored on the same rows. Both parts
//!   are prepared with `hypha-data prepare`'s own code ([`hypha_data::commands::prepare`]):
//!   byte-level tokens, one sequence per row. `--quick` takes the first files up to
//!   [`Size::corpus_bytes`].
//! - **Model**: the reference executor's byte-level transformer ([`Size`]), the same initial
//!   weights in every run, AdamW at the job defaults ([`InnerOptimizer::default`]) inside.
//!   The full size is 0.9 M parameters and 1.3 M tokens a run, about 21 minutes on 2 cores:
//!   candle trains it at 5,000–6,000 tokens a second there, and the 10–20 M parameters issue
//!   56 names would see under 0.2 M tokens a run in 30 minutes, too few to compare models.
//! - **Runs**, all on the same tokens in the same order: the training rows are shuffled once
//!   (a fixed seed, as a data loader does) and cut into blocks of `R × batch` rows, one
//!   block a step.
//!   - `baseline`: one learner without DiLoCo that takes each block as one batch (the
//!     data-parallel equivalent of R trainers), AdamW on the same schedule;
//!   - `f32`, `int8`, `sparse`: R = 4 trainers, each taking its `batch` rows of every block,
//!     H inner steps a round, the reference learner ([`Trained`]) and the parameter server
//!     ([`ParameterServer`]) as a job at its defaults gets them: the codec both ways, the
//!     outer step the codec's default ([`default_outer`]), the norm limits on;
//!   - `sparse_overlap`: `sparse` with the trainers going on into the next round while the
//!     round closes; the global model reaches them a quarter of the way into it (a slow
//!     link), and they move what they learned since onto it, as a worker does.
//!
//! The parts run in this process, the network left out: it moves bytes, and `wan` measures
//! those. Every few rounds each run's model (the server's global model; the baseline's own)
//! is scored on [`Size::eval_rows`] held-out rows: bits per
//! byte, the mean cross-entropy of each real next token over ln 2 (a token is a byte; the
//! end of each file is one token more). The curves go to `target/bench/outcome.svg`.
//!
//! Keys: `bpb_baseline`, `bpb_f32`, `bpb_int8`, `bpb_sparse`, `bpb_sparse_overlap` (the final
//! models); `loss_f32_vs_baseline` (target ≤ 1.03), `loss_int8_vs_f32` (≤ 1.01),
//! `loss_sparse_vs_f32` (≤ 1.02), `loss_sparse_overlap_vs_f32` (≤ 1.03); `parameters`,
//! `tokens`, `seconds_<run>`, `clipped_<run>` (updates the norm limits or the centre clipped:
//! an honest run should clip next to none). `--quick` runs a small model on a small corpus
//! in under a minute and records the ratios without holding them to the targets.
//!
//! A study changes the runs with `--set KEY=VALUE` ([`Study`]): a ratio is recorded where
//! both its runs ran.

use std::{
    path::{Path, PathBuf},
    time::Instant,
};

use anyhow::{Context, bail};
use candle_core::{Device, Tensor};
use hypha_diloco::{
    Codec, Metadata, Tensors, codec::sparse, file::FileSource, server::ParameterServer,
};
use hypha_executor::{
    contract::TensorNames,
    learner::{Learner, Trained},
    model::{Batch, Model, ModelSpec},
};
use hypha_messages::diloco::{Compression, InnerOptimizer, OuterOptimizer};
use hypha_scheduler::spec::{DEFAULT_NORM_RATIO, default_outer};
use rand::{SeedableRng, rngs::StdRng, seq::SliceRandom};

use crate::Report;

/// The trainers of a DiLoCo run.
const TRAINERS: usize = 4;
/// Every this many files of the sorted corpus, one is held out.
const HOLD_OUT_EVERY: usize = 20;
/// The byte-level vocabulary of `hypha-data prepare`: 256 bytes, end of document, padding.
const VOCABULARY: usize = 258;
/// The initial weights' seed; the rows are shuffled with this plus [`SHUFFLE_SEED_AFTER`].
const MODEL_SEED: u64 = 1;
const SHUFFLE_SEED_AFTER: u64 = 6;

/// A run's size.
#[derive(Debug, Clone, Copy)]
struct Size {
    dim: usize,
    heads: usize,
    layers: usize,
    /// Tokens a row is scored on (a row holds one more: the last one's target).
    context: usize,
    /// Rows a trainer trains on a step.
    batch: usize,
    inner_steps: usize,
    rounds: usize,
    /// Held-out scores every this many rounds (and after the last).
    eval_every: usize,
    eval_rows: usize,
    /// The corpus is cut after the first files of this many bytes (`None`: all of it).
    corpus_bytes: Option<u64>,
}

const QUICK: Size = Size {
    dim: 64,
    heads: 4,
    layers: 2,
    context: 64,
    batch: 8,
    inner_steps: 10,
    rounds: 6,
    eval_every: 2,
    eval_rows: 64,
    corpus_bytes: Some(2_000_000),
};

const FULL: Size = Size {
    dim: 128,
    heads: 4,
    layers: 4,
    context: 64,
    batch: 4,
    inner_steps: 20,
    rounds: 64,
    eval_every: 8,
    eval_rows: 256,
    corpus_bytes: None,
};

impl Size {
    fn spec(&self) -> ModelSpec {
        ModelSpec::Transformer {
            vocab: VOCABULARY,
            context: self.context,
            dim: self.dim,
            heads: self.heads,
            layers: self.layers,
        }
    }

    /// Whether the models are scored once `rounds` rounds are done.
    fn scored_after(&self, rounds: usize) -> bool {
        rounds.is_multiple_of(self.eval_every) || rounds == self.rounds
    }

    /// Rows of one step of every trainer together (one step of the baseline).
    fn block(&self) -> usize {
        TRAINERS * self.batch
    }
}

/// How a DiLoCo run moves its updates.
#[derive(Debug, Clone, Copy)]
struct Mode {
    name: &'static str,
    compression: &'static str,
    overlap: bool,
}

const MODES: [Mode; 4] = [
    Mode {
        name: "f32",
        compression: "none",
        overlap: false,
    },
    Mode {
        name: "int8",
        compression: "int8",
        overlap: false,
    },
    Mode {
        name: "sparse",
        compression: "sparse",
        overlap: false,
    },
    Mode {
        name: "sparse_overlap",
        compression: "sparse",
        overlap: true,
    },
];

/// The held-out scores of a run: (tokens trained, bits per byte).
#[derive(Debug, Default)]
struct Curve {
    points: Vec<(f64, f64)>,
    clipped: usize,
    seconds: f64,
}

impl Curve {
    fn last(&self) -> f64 {
        self.points.last().map_or(f64::NAN, |p| p.1)
    }
}

/// What a study changes of the runs (`hypha-bench outcome --set KEY=VALUE`); a job's
/// defaults for the rest.
#[derive(Debug, Clone)]
pub(crate) struct Study {
    /// The runs made (`runs=f32,sparse`); all where `None`.
    runs: Option<Vec<String>>,
    /// The seed of the initial weights and of the rows' order (`seed=2`): how far seeds
    /// alone move the ratios.
    seed: u64,
    /// The sparse runs' codec keys (`sparse_density`, `sparse_bits`, `sparse_decay`), as a
    /// job's `[diloco]` would set them.
    sparse_keys: serde_json::Map<String, serde_json::Value>,
    /// The sparse runs' outer step, learning rate and momentum (`sparse_outer=0.7/0.9`).
    sparse_outer: Option<(f64, f64)>,
    /// How the sparse runs' global model reaches the trainers: exactly (`sparse_back=exact`),
    /// or as the server's sparse change at this many times the trainers' density
    /// (`sparse_back=4`); [`Codec::for_broadcast`]'s where `None`.
    back: Option<Back>,
    /// The bits of the server's sparse change's codes (`sparse_back_bits=4`); the trainers'
    /// where `None`.
    back_bits: Option<u32>,
}

#[derive(Debug, Clone, Copy)]
enum Back {
    Exact,
    Denser(usize),
}

impl Study {
    pub(crate) fn parse(settings: &[(String, String)]) -> anyhow::Result<Self> {
        let mut study = Self {
            runs: None,
            seed: MODEL_SEED,
            sparse_keys: serde_json::Map::new(),
            sparse_outer: None,
            back: None,
            back_bits: None,
        };
        let names: Vec<&str> = std::iter::once("baseline")
            .chain(MODES.iter().map(|m| m.name))
            .collect();
        for (key, value) in settings {
            let number = || -> anyhow::Result<serde_json::Value> {
                serde_json::from_str::<serde_json::Number>(value)
                    .map(serde_json::Value::Number)
                    .with_context(|| format!("{key}={value}: not a number"))
            };
            match key.as_str() {
                "runs" => {
                    let runs: Vec<String> = value.split(',').map(|r| r.trim().to_string()).collect();
                    if let Some(unknown) = runs.iter().find(|r| !names.contains(&r.as_str())) {
                        bail!("runs: no run is called `{unknown}`; the runs are {}", names.join(", "));
                    }
                    study.runs = Some(runs);
                }
                "seed" => {
                    study.seed = value
                        .parse()
                        .with_context(|| format!("seed={value}: a whole number, e.g. 2"))?;
                }
                "sparse_density" | "sparse_bits" | "sparse_decay" => {
                    study.sparse_keys.insert(key.clone(), number()?);
                }
                "sparse_back_bits" => {
                    study.back_bits = Some(
                        value
                            .parse()
                            .ok()
                            .filter(|bits| [2, 4].contains(bits))
                            .with_context(|| format!("sparse_back_bits={value}: write 2 or 4"))?,
                    );
                }
                "sparse_outer" => {
                    let parsed = value
                        .split_once('/')
                        .and_then(|(lr, mu)| Some((lr.parse().ok()?, mu.parse().ok()?)));
                    study.sparse_outer = Some(parsed.with_context(|| {
                        format!("sparse_outer={value}: write LEARNING_RATE/MOMENTUM, e.g. 0.7/0.9")
                    })?);
                }
                "sparse_back" => {
                    study.back = Some(match value.as_str() {
                        "exact" => Back::Exact,
                        times => Back::Denser(times.parse().ok().filter(|&t| t > 0).with_context(
                            || format!("sparse_back={value}: write exact, or how many times the trainers' density the server's change keeps, e.g. 4"),
                        )?),
                    })
                }
                _ => bail!(
                    "the outcome suite has no setting `{key}`; it takes runs, seed, sparse_density, sparse_bits, sparse_decay, sparse_outer, sparse_back and sparse_back_bits"
                ),
            }
        }
        // Keys out of range are named now, not after the runs before the sparse ones.
        study.back(study.codec("sparse")?)?;
        Ok(study)
    }

    /// The trainers' codec of a run with `compression`: the job's, with the study's sparse
    /// keys.
    fn codec(&self, compression: &str) -> anyhow::Result<Codec> {
        let mut keys = serde_json::Map::new();
        keys.insert("compression".into(), compression.into());
        if compression == "sparse" {
            keys.extend(self.sparse_keys.clone());
        }
        let compression: Compression = serde_json::from_value(keys.into())?;
        Codec::try_from(compression).map_err(anyhow::Error::msg)
    }

    /// The codec of the server's changes when trainers send with `codec`.
    fn back(&self, codec: Codec) -> anyhow::Result<Codec> {
        let back = match (self.back, codec) {
            (Some(Back::Exact), Codec::Sparse { .. }) => Codec::None,
            (Some(Back::Denser(times)), Codec::Sparse { format, .. }) => Codec::Sparse {
                format: format.denser(times),
                decay: 1.0,
            },
            _ => codec.for_broadcast(),
        };
        Ok(match (back, self.back_bits) {
            (Codec::Sparse { format, decay }, Some(bits)) => Codec::Sparse {
                format: sparse::Format::new(format.kept(), bits).map_err(anyhow::Error::msg)?,
                decay,
            },
            (back, _) => back,
        })
    }

    fn runs(&self, name: &str) -> bool {
        self.runs
            .as_ref()
            .is_none_or(|runs| runs.iter().any(|r| r == name))
    }
}

pub(crate) async fn run(quick: bool, study: Study) -> anyhow::Result<Report> {
    tokio::task::spawn_blocking(move || measure(if quick { QUICK } else { FULL }, quick, &study))
        .await?
}

fn measure(size: Size, quick: bool, study: &Study) -> anyhow::Result<Report> {
    let dir = tempfile::tempdir()?;
    let corpus = Corpus::prepare(
        dir.path(),
        &size,
        study.seed.wrapping_add(SHUFFLE_SEED_AFTER),
    )?;
    let spec = size.spec();
    let parameters = (Model::new(&spec, study.seed)?.tensors()?.0.values())
        .map(|t| t.values.len())
        .sum::<usize>() as f64;
    let tokens = (size.rounds * size.inner_steps * size.block() * size.context) as f64;
    println!(
        "outcome: {} training rows, {} held-out rows scored; a model of {:.1} M parameters, {:.2} M tokens a run",
        corpus.train.rows(),
        corpus.eval.rows(),
        parameters / 1e6,
        tokens / 1e6,
    );
    anyhow::ensure!(
        corpus.train.rows() >= size.rounds * size.inner_steps * size.block(),
        "the corpus has {} training rows; the runs take {}: a larger corpus or a smaller size",
        corpus.train.rows(),
        size.rounds * size.inner_steps * size.block()
    );

    let mut report = Report::default();
    report.metrics.insert("parameters".into(), parameters);
    report.metrics.insert("tokens".into(), tokens);
    let mut curves = Vec::new();
    if study.runs("baseline") {
        let baseline = baseline(&spec, &size, &corpus, study.seed)?;
        println!("baseline: {:.4} bits per byte", baseline.last());
        curves.push(("baseline", baseline));
    }
    for mode in MODES.into_iter().filter(|mode| study.runs(mode.name)) {
        let curve = diloco(&spec, &size, &corpus, mode, study)?;
        println!(
            "{}: {:.4} bits per byte, {} updates clipped",
            mode.name,
            curve.last(),
            curve.clipped
        );
        curves.push((mode.name, curve));
    }
    let bpb = |name: &str| {
        curves
            .iter()
            .find(|(n, _)| *n == name)
            .map_or(f64::NAN, |(_, c)| c.last())
    };
    for (name, curve) in &curves {
        report.metrics.insert(format!("bpb_{name}"), curve.last());
        report
            .metrics
            .insert(format!("seconds_{name}"), curve.seconds);
        if *name != "baseline" {
            report
                .metrics
                .insert(format!("clipped_{name}"), curve.clipped as f64);
        }
    }
    for (key, over, under) in [
        ("loss_f32_vs_baseline", "f32", "baseline"),
        ("loss_int8_vs_f32", "int8", "f32"),
        ("loss_sparse_vs_f32", "sparse", "f32"),
        ("loss_sparse_overlap_vs_f32", "sparse_overlap", "f32"),
    ] {
        let ratio = bpb(over) / bpb(under);
        if !ratio.is_nan() {
            report.ratios.insert(key.into(), ratio);
        }
    }
    let title = format!(
        "held-out bits per byte, {:.1} M parameters{}",
        parameters / 1e6,
        if quick { " (--quick)" } else { "" }
    );
    let series: Vec<hypha_plot::Series<'_>> = curves
        .iter()
        .map(|(name, curve)| hypha_plot::Series {
            name,
            points: &curve.points,
        })
        .collect();
    let svg = hypha_plot::line_chart(&hypha_plot::Chart {
        title: &title,
        x_label: "tokens trained (millions)",
        y_label: "bits per byte",
        series,
        size: (800, 500),
    })?;
    let path = crate::target_dir().join("bench").join("outcome.svg");
    std::fs::create_dir_all(path.parent().context("no bench directory")?)?;
    std::fs::write(&path, svg)?;
    println!("wrote {}", path.display());
    Ok(report)
}

/// The training rows, shuffled, and the held-out rows scored.
struct Corpus {
    train: Batch,
    eval: Batch,
}

impl Corpus {
    /// Copies the standard library's sources into `dir` (training and held-out files apart),
    /// prepares both as `hypha-data prepare` does, and reads them.
    fn prepare(dir: &Path, size: &Size, shuffle_seed: u64) -> anyhow::Result<Self> {
        let files = stdlib_sources()?;
        let (mut kept, mut bytes) = (Vec::new(), 0u64);
        for (path, relative) in files {
            if size.corpus_bytes.is_some_and(|most| bytes >= most) {
                break;
            }
            let Ok(text) = std::fs::read_to_string(&path) else {
                continue;
            };
            bytes += text.len() as u64;
            kept.push((relative, text));
        }
        let (mut train_bytes, mut eval_bytes) = (0u64, 0u64);
        for (index, (relative, text)) in kept.iter().enumerate() {
            let held_out = index % HOLD_OUT_EVERY == HOLD_OUT_EVERY - 1;
            let part = if held_out { "eval-src" } else { "train-src" };
            *(if held_out {
                &mut eval_bytes
            } else {
                &mut train_bytes
            }) += text.len() as u64;
            let target = dir.join(part).join(relative);
            std::fs::create_dir_all(target.parent().context("a file without a folder")?)?;
            std::fs::write(&target, text)?;
        }
        println!(
            "outcome: {} files of the Python standard library, {:.1} MB to train on, {:.2} MB held out",
            kept.len(),
            train_bytes as f64 / 1e6,
            eval_bytes as f64 / 1e6
        );
        let spec = size.spec();
        let train = read_dataset(&prepared(dir, "train", size)?, &spec)?;
        let eval = read_dataset(&prepared(dir, "eval", size)?, &spec)?;
        // Shuffled once, as a data loader would: consecutive rows are one file's.
        let mut order: Vec<u32> = (0..train.rows() as u32).collect();
        order.shuffle(&mut StdRng::seed_from_u64(shuffle_seed));
        let train = select(&train, &order)?;
        // Rows evenly spaced over the held-out text.
        let stride = (eval.rows() / size.eval_rows.max(1)).max(1);
        let picked: Vec<u32> = (0..eval.rows() as u32)
            .step_by(stride)
            .take(size.eval_rows)
            .collect();
        let eval = select(&eval, &picked)?;
        Ok(Self { train, eval })
    }

    /// Block `index` of the training rows, or its `part`-th share of `of`.
    fn block(&self, size: &Size, index: usize, part: Option<usize>) -> anyhow::Result<Batch> {
        let start = index * size.block();
        Ok(match part {
            None => self.train.narrow(start, size.block())?,
            Some(part) => self.train.narrow(start + part * size.batch, size.batch)?,
        })
    }
}

/// The `.py` files of this machine's Python standard library, sorted by path, with their
/// paths under it; tests and installed packages left out.
fn stdlib_sources() -> anyhow::Result<Vec<(PathBuf, PathBuf)>> {
    let output = std::process::Command::new("python3")
        .args([
            "-c",
            "import sysconfig; print(sysconfig.get_paths()['stdlib'])",
        ])
        .output()
        .context("the outcome suite's corpus is the Python standard library: install python3")?;
    if !output.status.success() {
        bail!(
            "python3 could not say where its standard library is: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let root = PathBuf::from(String::from_utf8(output.stdout)?.trim());
    let mut files = Vec::new();
    let mut folders = vec![root.clone()];
    while let Some(folder) = folders.pop() {
        for entry in
            std::fs::read_dir(&folder).with_context(|| format!("reading {}", folder.display()))?
        {
            let entry = entry?;
            let path = entry.path();
            let name = entry.file_name();
            let name = name.to_string_lossy();
            let kind = entry.file_type()?;
            if kind.is_dir() {
                let skipped = [
                    "test",
                    "tests",
                    "idle_test",
                    "site-packages",
                    "dist-packages",
                    "__pycache__",
                ];
                if !skipped.contains(&name.as_ref()) && !name.starts_with('.') {
                    folders.push(path);
                }
            } else if kind.is_file() && name.ends_with(".py") {
                let relative = path.strip_prefix(&root)?.to_path_buf();
                files.push((path, relative));
            }
        }
    }
    files.sort_by(|a, b| a.1.cmp(&b.1));
    if files.is_empty() {
        bail!("no .py files under {}", root.display());
    }
    Ok(files)
}

/// `dir/<part>-src` prepared into `dir/<part>` by `hypha-data prepare`'s code: byte-level
/// rows of `context + 1` tokens.
fn prepared(dir: &Path, part: &str, size: &Size) -> anyhow::Result<PathBuf> {
    let output = dir.join(part);
    hypha_data::commands::prepare(&hypha_data::commands::PrepareArgs {
        input: dir.join(format!("{part}-src")),
        output: output.clone(),
        kind: hypha_data::commands::InputKind::Text,
        slice_size: 1024,
        sequence_length: size.context + 1,
        text_field: "text".into(),
        tokenizer: None,
        image_size: 64,
        plain: false,
        threads: None,
        force: true,
    })
    .map_err(|error| anyhow::anyhow!("preparing {part}: {error}"))?;
    Ok(output)
}

/// Every row of the dataset at `dir`, read through the data contract as a trainer reads it.
fn read_dataset(dir: &Path, spec: &ModelSpec) -> anyhow::Result<Batch> {
    let dataset = hypha_dataset::Dataset::open(dir)?;
    let batches = dataset
        .manifest()
        .slices
        .iter()
        .map(|entry| -> anyhow::Result<Batch> {
            let bytes = std::fs::read(dataset.root().join(&entry.file))?;
            let (_, plain) = hypha_dataset::slice::decode(&bytes)?;
            Ok(Batch::read(&plain, spec, &TensorNames::default())?)
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    Ok(Batch::concat(&batches)?)
}

/// The rows `order` of `batch`, in that order.
fn select(batch: &Batch, order: &[u32]) -> anyhow::Result<Batch> {
    let index = Tensor::from_slice(order, order.len(), &Device::Cpu)?;
    let pick = |t: &Tensor| t.index_select(&index, 0);
    Ok(Batch {
        input: pick(&batch.input)?,
        target: batch.target.as_ref().map(pick).transpose()?,
        mask: batch.mask.as_ref().map(pick).transpose()?,
    })
}

/// `model`'s held-out bits per byte.
fn bits_per_byte(model: &Model, corpus: &Corpus) -> anyhow::Result<f64> {
    let (loss, _) = model.evaluate(&corpus.eval)?;
    Ok(loss / std::f64::consts::LN_2)
}

/// Tokens trained after `steps` steps of every trainer.
fn tokens_after(size: &Size, steps: usize) -> f64 {
    (steps * size.block() * size.context) as f64 / 1e6
}

/// One learner, each block one batch.
fn baseline(spec: &ModelSpec, size: &Size, corpus: &Corpus, seed: u64) -> anyhow::Result<Curve> {
    let started = Instant::now();
    let mut learner = Trained::new(spec, seed, InnerOptimizer::default(), Codec::None)?;
    let mut curve = Curve::default();
    curve
        .points
        .push((0.0, bits_per_byte(learner.model(), corpus)?));
    for round in 0..size.rounds {
        for step in 0..size.inner_steps {
            let block = round * size.inner_steps + step;
            learner.train(&corpus.block(size, block, None)?)?;
        }
        if size.scored_after(round + 1) {
            curve.points.push((
                tokens_after(size, (round + 1) * size.inner_steps),
                bits_per_byte(learner.model(), corpus)?,
            ));
        }
    }
    curve.seconds = started.elapsed().as_secs_f64();
    Ok(curve)
}

/// R trainers and a parameter server, `mode`'s codec and overlap.
fn diloco(
    spec: &ModelSpec,
    size: &Size,
    corpus: &Corpus,
    mode: Mode,
    study: &Study,
) -> anyhow::Result<Curve> {
    let started = Instant::now();
    let dir = tempfile::tempdir()?;
    let sparse = mode.compression == "sparse";
    let codec = study.codec(mode.compression)?;
    let mut outer = default_outer(mode.compression);
    if let Some((learning_rate, momentum)) = study.sparse_outer.filter(|_| sparse) {
        outer = OuterOptimizer {
            learning_rate,
            momentum,
        };
    }
    let back = study.back(codec)?;
    let samples = (size.inner_steps * size.batch) as u64;
    let per_round = samples * TRAINERS as u64;
    let mut server = ParameterServer::new(outer.into())
        .broadcast_changes(back)
        .limit_norm(DEFAULT_NORM_RATIO)
        .plan_samples(per_round)
        .limit_samples(2 * per_round + samples);
    let mut trainers = (0..TRAINERS)
        .map(|_| Trained::new(spec, study.seed, InnerOptimizer::default(), codec))
        .collect::<Result<Vec<_>, _>>()?;
    let offer = dir.path().join("offer.safetensors");
    trainers[0].write_global(&offer, &Metadata::new())?;
    server.offer_from(&FileSource::open(&offer)?)?;
    let scorer = Model::new(spec, study.seed)?;
    let mut curve = Curve::default();
    curve.points.push((0.0, bits_per_byte(&scorer, corpus)?));
    // With overlap, the global model of the round before, on its way to the trainers.
    let mut arriving: Option<(Tensors, String)> = None;
    let arrives_at = size.inner_steps / 4;
    for round in 0..size.rounds {
        for (i, trainer) in trainers.iter_mut().enumerate() {
            for step in 0..size.inner_steps {
                if step == arrives_at
                    && let Some(global) = arriving.clone()
                {
                    trainer.start(Some(global), true)?;
                }
                let block = round * size.inner_steps + step;
                trainer.train(&corpus.block(size, block, Some(i))?)?;
            }
            let path = dir.path().join(format!("update-{i}.safetensors"));
            trainer.write_pseudo_gradient(&path, &Metadata::new())?;
            if mode.overlap {
                trainer.remember_sync()?;
            }
            server.add_from(
                &format!("trainer-{i}"),
                FileSource::open(&path)?,
                round as u64,
                samples,
            )?;
        }
        let closed = server.close()?;
        curve.clipped += closed.clipped.len();
        let global = Tensors::from_bytes(&server.model_bytes()?)?;
        let hash = global.digest();
        if mode.overlap {
            arriving = Some((global.clone(), hash));
        } else {
            for trainer in &mut trainers {
                trainer.start(Some((global.clone(), hash.clone())), false)?;
            }
        }
        if size.scored_after(round + 1) {
            scorer.load(&global)?;
            curve.points.push((
                tokens_after(size, (round + 1) * size.inner_steps),
                bits_per_byte(&scorer, corpus)?,
            ));
        }
    }
    curve.seconds = started.elapsed().as_secs_f64();
    Ok(curve)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn study(settings: &[(&str, &str)]) -> anyhow::Result<Study> {
        let owned: Vec<(String, String)> = settings
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Study::parse(&owned)
    }

    fn sparse(study: &Study) -> Codec {
        study.codec("sparse").unwrap()
    }

    #[test]
    fn a_study_changes_only_what_it_names() {
        let none = study(&[]).unwrap();
        assert!(none.runs("baseline") && none.runs("sparse_overlap"));
        assert_eq!(none.seed, MODEL_SEED);
        assert_eq!(
            none.back(sparse(&none)).unwrap(),
            sparse(&none).for_broadcast()
        );

        let changed = study(&[
            ("runs", "f32,sparse"),
            ("sparse_decay", "0.95"),
            ("sparse_bits", "4"),
            ("sparse_back", "exact"),
            ("sparse_outer", "1.5/0"),
        ])
        .unwrap();
        assert!(changed.runs("f32") && changed.runs("sparse") && !changed.runs("baseline"));
        let Codec::Sparse { format, decay } = sparse(&changed) else {
            panic!("not sparse");
        };
        assert_eq!((decay, format.bits()), (0.95, 4));
        assert_eq!(changed.back(sparse(&changed)).unwrap(), Codec::None);
        assert_eq!(changed.back(Codec::Int8).unwrap(), Codec::Int8);
        assert_eq!(changed.sparse_outer, Some((1.5, 0.0)));

        let denser = study(&[("sparse_back", "4"), ("sparse_back_bits", "4")]).unwrap();
        let Codec::Sparse { format: back, .. } = denser.back(sparse(&denser)).unwrap() else {
            panic!("not sparse back");
        };
        let Codec::Sparse { format: up, .. } = sparse(&denser) else {
            panic!("not sparse");
        };
        assert_eq!((back.kept(), back.bits(), up.bits()), (4 * up.kept(), 4, 2));
    }

    #[test]
    fn a_setting_it_cannot_take_is_named_with_what_to_write() {
        for (setting, says) in [
            (("runs", "f32,sparce"), "no run is called `sparce`"),
            (("sparse_back", "twice"), "write exact"),
            (("sparse_back_bits", "3"), "write 2 or 4"),
            (("sparse_outer", "0.7"), "LEARNING_RATE/MOMENTUM"),
            (("sparse_decay", "most"), "not a number"),
            (("inner_steps", "10"), "no setting `inner_steps`"),
            (("sparse_decay", "2"), "not in (0, 1]"),
            (("seed", "-1"), "a whole number"),
        ] {
            let error = study(&[setting]).unwrap_err().to_string();
            assert!(error.contains(says), "{setting:?}: {error}");
        }
    }
}
