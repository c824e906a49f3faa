//! `byzantine`: robust aggregation against trainers that lie, and against the honest runs it
//! must never harm (issue 55).
//!
//! Four trainers and a parameter server run DiLoCo in this process, with the parts the
//! programs run, minus the network: each trainer is the reference executor's learner
//! ([`Trained`]: candle, AdamW, pseudo-gradients written to files), the server is
//! [`ParameterServer`] with the job defaults a scheduler gives it (`max_update_norm_ratio`,
//! the planned samples, the sample limit), and the rounds are planned, closed and benched by
//! the scheduler's own [`Rounds`] (batch targets, quorum, deadlines, refusals and silence
//! counted). The clock is simulated: a round's deadline passes when a round waits for a
//! trainer that never sends.
//!
//! Runs, on the quickstart's MLP (blobs) and on a small transformer (token sequences):
//! - honest, four trainers;
//! - each attack by one of the four: its update scaled ×100 and ×10⁶, its sign flipped,
//!   replaced by Gaussian noise of its norm, a random model (the update that makes the
//!   global model a fresh random one), the `ahead_batches` liar (claims to have trained a
//!   round ahead, 10¹² batches, and never sends), and the warm-up attacker (in the run's first
//!   round, before any history, five times the update to a random model).
//!
//! `loss_under_attack_vs_honest_<attack>` is the held-out loss of the run under attack over
//! the honest run's, the larger of the two models' (target ≤ 1.05).
//! `loss_under_attack_vs_liar_absent_<attack>` is over the run of the three honest trainers
//! alone, each training as much a round: the liar's data is lost to the run whatever the
//! server does, so this is what the server's defence itself costs (1 when it leaves the liar
//! out entirely). A long honest run of the
//! MLP (10,000 rounds; `--quick`: 600) with one round of shuffled labels halfway (a loss
//! spike) counts what the limits did to honest trainers: `refused_honest_10k`,
//! `benched_honest_10k` (targets 0), `rounds_all_trainers_share_10k` (≥ 0.99),
//! `clipped_honest_10k`.

use std::{collections::BTreeSet, path::Path};

use candle_core::{Device, Tensor};
use hypha_diloco::{
    Metadata, OuterOptimizer, Tensors,
    file::FileSource,
    server::{Closed, ParameterServer},
};
use hypha_executor::{
    learner::{Learner, Trained},
    model::{Model, ModelSpec},
    synthetic::Synthetic,
};
use hypha_messages::diloco::{
    Applied, InnerOptimizer, ServerOrder, ServerStatus, TrainerOrder, TrainerStatus,
};
use hypha_scheduler::{
    rounds::{RoundPlan, Rounds},
    spec::DEFAULT_NORM_RATIO,
};
use rand::{Rng, SeedableRng, rngs::StdRng};

use crate::Report;

const TRAINERS: usize = 4;
const BATCH: u64 = 32;
/// Batches each trainer trains a round.
const INNER_STEPS: u64 = 8;
/// The planned round, and its pace as every trainer reports it.
const ROUND_MS: u64 = 10_000;
const BATCH_MS: f64 = 10.0;
const MODEL_SEED: u64 = 1;
/// Held-out samples the final models are scored on.
const EVAL_SAMPLES: usize = 2048;

/// What the lying trainer (the last one) does.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Attack {
    Scale(f32),
    SignFlip,
    Noise,
    RandomModel,
    AheadLiar,
    WarmUp,
}

const ATTACKS: [(&str, Attack); 7] = [
    ("scale100", Attack::Scale(100.0)),
    ("scale1e6", Attack::Scale(1e6)),
    ("sign_flip", Attack::SignFlip),
    ("noise", Attack::Noise),
    ("random_model", Attack::RandomModel),
    ("ahead_liar", Attack::AheadLiar),
    ("warm_up", Attack::WarmUp),
];

/// How a run went.
#[derive(Debug, Default)]
struct Outcome {
    /// The final global model's loss on held-out samples.
    loss: f64,
    rounds: u64,
    /// Rounds that included every honest trainer (every trainer, in an honest run).
    rounds_all_honest: u64,
    refused_honest: u64,
    clipped_honest: u64,
    benched_honest: u64,
    refused_liar: u64,
    clipped_liar: u64,
    /// The liar's clipped shares, summed (a round it counted whole adds nothing).
    liar_share_clipped: f64,
    benched_liar: bool,
}

pub(crate) async fn run(quick: bool) -> anyhow::Result<Report> {
    tokio::task::spawn_blocking(move || measure(quick)).await?
}

fn measure(quick: bool) -> anyhow::Result<Report> {
    let models = [
        (
            "mlp",
            ModelSpec::Mlp {
                inputs: 16,
                hidden: 64,
                classes: 4,
            },
            if quick { 40 } else { 150 },
        ),
        (
            "transformer",
            ModelSpec::Transformer {
                vocab: 32,
                context: 16,
                dim: 32,
                heads: 4,
                layers: 2,
            },
            if quick { 8 } else { 40 },
        ),
    ];
    let mut report = Report::default();
    let mut worst: std::collections::BTreeMap<&str, (f64, f64)> = Default::default();
    for (name, spec, rounds) in &models {
        let honest = simulate(spec, *rounds, TRAINERS, None, None)?;
        // The liar's data is lost to the run whatever the server does: the best it can do
        // is what the honest trainers alone would have done.
        let liar_absent = simulate(spec, *rounds, TRAINERS - 1, None, None)?;
        report
            .metrics
            .insert(format!("loss_{name}_honest"), honest.loss);
        report
            .metrics
            .insert(format!("loss_{name}_liar_absent"), liar_absent.loss);
        for (attack_name, attack) in ATTACKS {
            let attacked = simulate(spec, *rounds, TRAINERS, Some(attack), None)?;
            let ratio = attacked.loss / honest.loss;
            let beyond_absent = attacked.loss / liar_absent.loss;
            println!(
                "{name} {attack_name}: loss {:.4} (honest {:.4}, ×{ratio:.3}; liar absent {:.4}, ×{beyond_absent:.3}); liar refused {} clipped {} (mean share {:.3}) benched {}; honest refused {} clipped {} benched {}",
                attacked.loss,
                honest.loss,
                liar_absent.loss,
                attacked.refused_liar,
                attacked.clipped_liar,
                attacked.liar_share_clipped / attacked.clipped_liar.max(1) as f64,
                attacked.benched_liar,
                attacked.refused_honest,
                attacked.clipped_honest,
                attacked.benched_honest
            );
            report
                .metrics
                .insert(format!("loss_{name}_{attack_name}"), attacked.loss);
            report.metrics.insert(
                format!("benched_honest_{name}_{attack_name}"),
                attacked.benched_honest as f64,
            );
            let entry = worst.entry(attack_name).or_insert((0.0, 0.0));
            *entry = (entry.0.max(ratio), entry.1.max(beyond_absent));
        }
    }
    for (attack, (ratio, beyond_absent)) in worst {
        report
            .ratios
            .insert(format!("loss_under_attack_vs_honest_{attack}"), ratio);
        report.ratios.insert(
            format!("loss_under_attack_vs_liar_absent_{attack}"),
            beyond_absent,
        );
    }

    let long = if quick { 600 } else { 10_000 };
    let started = std::time::Instant::now();
    let honest = simulate(&models[0].1, long, TRAINERS, None, Some(long / 2))?;
    let share = honest.rounds_all_honest as f64 / honest.rounds.max(1) as f64;
    report.metrics.extend(
        [
            ("rounds_10k", honest.rounds as f64),
            ("refused_honest_10k", honest.refused_honest as f64),
            ("benched_honest_10k", honest.benched_honest as f64),
            ("clipped_honest_10k", honest.clipped_honest as f64),
            ("rounds_all_trainers_share_10k", share),
            ("loss_10k", honest.loss),
            ("seconds_10k", started.elapsed().as_secs_f64()),
        ]
        .map(|(key, value)| (key.to_string(), value)),
    );
    Ok(report)
}

/// One trainer of a simulated run.
struct Trainer {
    job: String,
    peer: String,
    learner: Trained,
    benched: bool,
}

/// A DiLoCo run of `rounds` rounds of `spec` with four trainers, the last one doing `attack`;
/// at round `spike`, every honest trainer trains on shuffled labels.
fn simulate(
    spec: &ModelSpec,
    rounds: u64,
    count: usize,
    attack: Option<Attack>,
    spike: Option<u64>,
) -> anyhow::Result<Outcome> {
    let dir = tempfile::tempdir()?;
    let data = Synthetic::for_model(spec);
    // Each trainer trains as many batches a round whatever their count.
    let samples_per_round = count as u64 * INNER_STEPS * BATCH;
    let codec = hypha_diloco::Codec::None;
    let first = Trained::new(spec, MODEL_SEED, InnerOptimizer::default(), codec)?;
    let mut server = ParameterServer::new(OuterOptimizer::new(0.7, 0.9))
        .limit_norm(DEFAULT_NORM_RATIO)
        .limit_samples(2 * samples_per_round + BATCH * INNER_STEPS)
        .plan_samples(samples_per_round);
    let offer = dir.path().join("offer.safetensors");
    first.write_global(&offer, &Metadata::new())?;
    server.offer_from(&FileSource::open(&offer)?)?;
    let mut trainers: Vec<Trainer> = (0..count)
        .map(|i| -> anyhow::Result<Trainer> {
            Ok(Trainer {
                job: format!("job-{i}"),
                peer: format!("trainer-{i}"),
                learner: Trained::new(spec, MODEL_SEED, InnerOptimizer::default(), codec)?,
                benched: false,
            })
        })
        .collect::<anyhow::Result<_>>()?;
    let liar = attack.map(|_| count - 1);
    let mut plan = rounds_of(rounds, samples_per_round);
    let mut now = 0u64;
    for trainer in &trainers {
        plan.trainer_started(trainer.job.clone(), trainer.peer.clone());
        plan.trainer_status(&trainer.job, TrainerStatus::default(), now);
    }
    let mut rng = StdRng::seed_from_u64(7);
    let mut outcome = Outcome::default();
    let mut named: Vec<String> = Vec::new();
    for round in 0..rounds {
        let ahead_liar = liar.filter(|_| attack == Some(Attack::AheadLiar));
        let order = targets(&mut plan, &trainers, ahead_liar, round, now);
        for (i, batches) in order {
            let silent = ahead_liar == Some(i);
            if silent {
                continue;
            }
            let shuffled = spike == Some(round);
            let trainer = &mut trainers[i];
            let seeds = (0..batches).map(|batch| (i as u64) << 40 | round << 12 | batch);
            train(&mut trainer.learner, &data, seeds, shuffled, &mut rng)?;
            let samples = batches * BATCH;
            now += batches * BATCH_MS as u64;
            let status = TrainerStatus {
                round: Some(round),
                batches,
                samples,
                batch_ms: Some(BATCH_MS),
                ..TrainerStatus::default()
            };
            plan.trainer_status(&trainer.job, status, now);
            let path = dir.path().join(format!("update-{i}.safetensors"));
            trainer
                .learner
                .write_pseudo_gradient(&path, &Metadata::new())?;
            if liar == Some(i)
                && let Some(attack) = attack
            {
                lie(attack, round, &path, &server, spec, &mut rng)?;
            }
            // A refusal is the server's answer; the round goes on without the update.
            let _ = server.add_from(&trainer.peer, FileSource::open(&path)?, round, samples);
        }
        let refused: Vec<(String, String)> = server.refused().to_vec();
        let closed = close(&mut plan, &mut server, &mut named, round, &mut now)?;
        let Some(closed) = closed else { break };
        now += 100;
        outcome.count_round(&trainers, liar, &refused, &closed);
        let applied = applied(&closed, &server);
        let (_, _, applied_round) = plan.server_status(
            ServerStatus {
                round: server.round(),
                applied: Some(applied),
                trainers: named.clone(),
                ..ServerStatus::default()
            },
            now,
        );
        for benching in applied_round.map(|a| a.benched).unwrap_or_default() {
            if let Some(i) = trainers.iter().position(|t| t.peer == benching.peer) {
                trainers[i].benched = true;
                plan.trainer_ended(&trainers[i].job, now);
                match Some(i) == liar {
                    true => outcome.benched_liar = true,
                    false => outcome.benched_honest += 1,
                }
            }
        }
        let global = Tensors::from_bytes(&server.model_bytes()?)?;
        let hash = global.digest();
        for trainer in trainers.iter_mut().filter(|t| !t.benched) {
            trainer
                .learner
                .start(Some((global.clone(), hash.clone())), false)?;
        }
    }
    outcome.loss = held_out_loss(spec, &data, &server)?;
    Ok(outcome)
}

impl Outcome {
    /// Counts a closed round: its refusals, its clips (the liar's shares apart) and whether
    /// every honest trainer of `trainers` made it.
    fn count_round(
        &mut self,
        trainers: &[Trainer],
        liar: Option<usize>,
        refused: &[(String, String)],
        closed: &Closed,
    ) {
        let is_liar = |peer: &str| trainers.iter().position(|t| t.peer == peer) == liar;
        for (peer, _) in refused {
            match liar.is_some() && is_liar(peer) {
                true => self.refused_liar += 1,
                false => self.refused_honest += 1,
            }
        }
        for clipped in &closed.clipped {
            if liar.is_some() && is_liar(&clipped.peer) {
                self.clipped_liar += 1;
                self.liar_share_clipped += f64::from(clipped.share);
            } else {
                self.clipped_honest += 1;
            }
        }
        let honest_in: BTreeSet<usize> = trainers
            .iter()
            .enumerate()
            .filter(|(i, t)| Some(*i) != liar && closed.included.contains(&t.peer))
            .map(|(i, _)| i)
            .collect();
        if honest_in.len() == trainers.len() - usize::from(liar.is_some()) {
            self.rounds_all_honest += 1;
        }
        self.rounds += 1;
    }
}

/// Each trainer not benched asks for its target of `round`, the ahead liar (claiming to be
/// a trillion batches ahead) first so that its claim counts: who trains how many batches.
fn targets(
    plan: &mut Rounds,
    trainers: &[Trainer],
    ahead_liar: Option<usize>,
    round: u64,
    now: u64,
) -> Vec<(usize, u64)> {
    let mut order = Vec::new();
    for (i, trainer) in trainers.iter().enumerate().rev() {
        if trainer.benched {
            continue;
        }
        let status = if ahead_liar == Some(i) {
            TrainerStatus {
                round: Some(round.saturating_sub(1)),
                ahead_batches: 1_000_000_000_000,
                batch_ms: Some(BATCH_MS),
                ..TrainerStatus::default()
            }
        } else {
            TrainerStatus {
                round: Some(round),
                batch_ms: Some(BATCH_MS),
                ..TrainerStatus::default()
            }
        };
        if let (TrainerOrder::Train { batches, .. }, _) =
            plan.trainer_status(&trainer.job, status, now)
        {
            order.push((i, batches));
        }
    }
    order
}

/// The server reports until the rounds order the close of `round` (the deadline passes,
/// moving `now`, when a trainer it waits for never sends): the round closed or skipped,
/// `None` once the run is done.
fn close(
    plan: &mut Rounds,
    server: &mut ParameterServer,
    named: &mut Vec<String>,
    round: u64,
    now: &mut u64,
) -> anyhow::Result<Option<Closed>> {
    loop {
        let status = ServerStatus {
            round: Some(round),
            arrived: server.arrivals(),
            refused: server.refusals(),
            trainers: named.clone(),
            ..ServerStatus::default()
        };
        match plan.server_status(status, *now).0 {
            ServerOrder::Trainers { peers } => *named = peers,
            ServerOrder::Close { .. } => return Ok(Some(server.close()?)),
            ServerOrder::Skip { .. } => return Ok(Some(server.skip()?)),
            ServerOrder::Done => return Ok(None),
            _ => *now += ROUND_MS * 2,
        }
    }
}

/// The rounds of a run of `rounds` rounds of `samples_per_round`, its server started.
fn rounds_of(rounds: u64, samples_per_round: u64) -> Rounds {
    let mut plan = Rounds::new(RoundPlan {
        rounds: Some(rounds),
        samples_per_round,
        batch_size: BATCH,
        round_ms: ROUND_MS,
        quorum: 0.5,
        bench_after_refusals: 3,
        start_grace_ms: 0,
        eval_every: None,
    });
    plan.server_started("server".into());
    plan
}

/// Trains `learner` on a batch of `data` for each of `seeds`, with shuffled labels where
/// `shuffled` (a loss spike).
fn train(
    learner: &mut Trained,
    data: &Synthetic,
    seeds: impl Iterator<Item = u64>,
    shuffled: bool,
    rng: &mut StdRng,
) -> anyhow::Result<()> {
    for seed in seeds {
        let mut batch = data.batch(BATCH as usize, seed)?;
        if shuffled {
            batch.target = match batch.target {
                Some(target) => Some(shuffle(&target, rng)?),
                None => None,
            };
        }
        learner.train(&batch)?;
    }
    Ok(())
}

/// What the server's status says of a closed round.
fn applied(closed: &Closed, server: &ParameterServer) -> Applied {
    Applied {
        round: closed.round,
        included: closed.included.clone(),
        model_hash: server.model_hash().map(str::to_string),
        delta_bytes: None,
        largest_norm_ratio: closed.largest_norm_ratio,
        clipped: closed.clipped.clone(),
        close_ms: None,
        traffic_bytes: None,
        standby_bytes: None,
    }
}

/// Rewrites the liar's honest update at `path` into its attack's.
fn lie(
    attack: Attack,
    round: u64,
    path: &Path,
    server: &ParameterServer,
    spec: &ModelSpec,
    rng: &mut StdRng,
) -> anyhow::Result<()> {
    let mut update = Tensors::load(path)?;
    let toward_random = |factor: f32, rng: &mut StdRng| -> anyhow::Result<Tensors> {
        // θ_global − θ_random: the update that, taken alone, makes the model a random one.
        let global = Tensors::from_bytes(&server.model_bytes()?)?;
        let random = Model::new(spec, rng.random())?.tensors()?;
        let mut update = global;
        for (name, tensor) in &mut update.0 {
            if let Some(random) = random.0.get(name) {
                for (g, r) in tensor.values.iter_mut().zip(&random.values) {
                    *g = factor * (*g - r);
                }
            }
        }
        Ok(update)
    };
    match attack {
        Attack::Scale(factor) => {
            for tensor in update.0.values_mut() {
                tensor.values.iter_mut().for_each(|v| *v *= factor);
            }
        }
        Attack::SignFlip => {
            for tensor in update.0.values_mut() {
                tensor.values.iter_mut().for_each(|v| *v = -*v);
            }
        }
        Attack::Noise => {
            let norm: f64 = update
                .0
                .values()
                .flat_map(|t| &t.values)
                .map(|v| f64::from(*v).powi(2))
                .sum::<f64>()
                .sqrt();
            let count: usize = update.0.values().map(|t| t.values.len()).sum();
            let scale = (norm / (count as f64).sqrt()) as f32;
            for tensor in update.0.values_mut() {
                for v in &mut tensor.values {
                    *v = scale * normal(rng);
                }
            }
        }
        Attack::RandomModel => update = toward_random(1.0, rng)?,
        Attack::WarmUp if round == 0 => update = toward_random(5.0, rng)?,
        Attack::WarmUp | Attack::AheadLiar => return Ok(()),
    }
    std::fs::write(path, update.to_bytes(&Metadata::new())?)?;
    Ok(())
}

/// A standard normal draw (Box–Muller).
fn normal(rng: &mut StdRng) -> f32 {
    let u: f32 = rng.random_range(f32::EPSILON..1.0);
    let v: f32 = rng.random();
    (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
}

/// `target`'s labels in a random order: a round of shuffled labels is a loss spike.
fn shuffle(target: &Tensor, rng: &mut StdRng) -> anyhow::Result<Tensor> {
    let dtype = target.dtype();
    let mut labels = target
        .to_dtype(candle_core::DType::U32)?
        .flatten_all()?
        .to_vec1::<u32>()?;
    for i in (1..labels.len()).rev() {
        labels.swap(i, rng.random_range(0..=i));
    }
    Ok(Tensor::from_vec(labels, target.shape(), &Device::Cpu)?.to_dtype(dtype)?)
}

/// The server's global model scored on [`EVAL_SAMPLES`] samples no trainer trained on.
fn held_out_loss(
    spec: &ModelSpec,
    data: &Synthetic,
    server: &ParameterServer,
) -> anyhow::Result<f64> {
    let model = Model::new(spec, MODEL_SEED)?;
    model.load(&Tensors::from_bytes(&server.model_bytes()?)?)?;
    let batch = data.batch(EVAL_SAMPLES, u64::MAX / 3)?;
    Ok(model.evaluate(&batch)?.0)
}
