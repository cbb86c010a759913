//! Data-parallel training on the CPU: splitting a step's micro-batches across ranks of an
//! in-process collective gives the same LoRA weights, gradients and metrics as one rank training
//! on the whole batch; and a step cancelled mid-way (a lost claim) stops before its next
//! micro-batch with the weights untouched.

use std::sync::Mutex;

use rand::{rngs::StdRng, Rng, SeedableRng};
use tch::{Device, Kind, Tensor};
use tokio_util::sync::CancellationToken;
use trainq_engine::collective::{local_group, split_by_tokens, Collective};
use trainq_engine::model::{tiny_qwen3_config, Policy};
use trainq_engine::tokenize::{pack, MicroBatch, PackItem, TokenizedTrajectory};
use trainq_engine::train::{
    data_parallel_step, MicroBatchTensors, PolicyModel, RankGroup, RankReplica, StepMetrics, Trainer,
};
use trainq_queue::config::{LoraConfig, LossNormalization, TrainConfig};

const VOCAB: i64 = 96;
const SEED: i64 = 7;
const STEPS: usize = 2;
const TOLERANCE: f64 = 1e-5;

fn config(normalization: LossNormalization) -> TrainConfig {
    let mut cfg = TrainConfig {
        lora: Some(LoraConfig { rank: 4, alpha: 8.0, ..LoraConfig::default() }),
        ..TrainConfig::default()
    };
    cfg.loss.normalization = normalization;
    cfg.optimizer.learning_rate = 1e-2;
    // With the default eps AdamW's first steps move each weight by ±lr whatever the gradient's
    // scale, which would hide a mis-scaled gradient and magnify the rounding noise of near-zero
    // ones; a larger eps makes the update proportional to the gradient.
    cfg.optimizer.eps = 1e-3;
    // Small enough that clipping is active: every rank must clip with the same global norm.
    cfg.optimizer.max_grad_norm = 0.05;
    cfg
}

/// Random trajectories (the second half of each trained, some tokens with sampler log-probs
/// far from the model's so the ratio is clipped), packed into several micro-batches.
fn micro_batches() -> Vec<MicroBatch> {
    let mut rng = StdRng::seed_from_u64(3);
    let trajectories: Vec<TokenizedTrajectory> = (0..14)
        .map(|_| {
            let len = rng.gen_range(6..20);
            TokenizedTrajectory {
                ids: (0..len).map(|_| rng.gen_range(1..VOCAB)).collect(),
                trained: (0..len).map(|p| p >= len / 2).collect(),
                sampler_logprobs: (0..len).map(|_| rng.gen_bool(0.5).then(|| -rng.gen_range(2.0..8.0f32))).collect(),
            }
        })
        .collect();
    let items: Vec<PackItem<'_>> =
        trajectories.iter().map(|t| PackItem { trajectory: t, advantage: rng.gen_range(-1.0..1.0f32) }).collect();
    let batches = pack(&items, 48, 24).unwrap();
    assert!(batches.len() >= 4, "the test needs several micro-batches, got {}", batches.len());
    batches
}

/// The seed is process-global and tests run on parallel threads: one replica is built at a time.
static SEEDED_INIT: Mutex<()> = Mutex::new(());

fn replica(cfg: &TrainConfig) -> Policy {
    let _one_at_a_time = SEEDED_INIT.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    Policy::from_config(&tiny_qwen3_config(VOCAB), cfg.lora.as_ref(), Device::Cpu, SEED).unwrap()
}

/// What a run leaves behind: LoRA weights, their (clipped) gradients, each step's metrics.
struct Outcome {
    weights: Vec<(String, Tensor)>,
    grads: Vec<Tensor>,
    metrics: Vec<StepMetrics>,
}

fn outcome(policy: &Policy, metrics: Vec<StepMetrics>) -> Outcome {
    let weights: Vec<(String, Tensor)> =
        policy.lora_variables().into_iter().map(|(n, t)| (n, t.detach().copy())).collect();
    let grads = policy.trainable_variables().iter().map(|t| t.grad().copy()).collect();
    Outcome { weights, grads, metrics }
}

fn single_rank(cfg: &TrainConfig, batches: &[MicroBatch]) -> Outcome {
    let mut policy = replica(cfg);
    let mut trainer = Trainer::new(cfg, Device::Cpu);
    let metrics = (0..STEPS).map(|_| trainer.step(&mut policy, batches).unwrap()).collect();
    outcome(&policy, metrics)
}

/// Runs `STEPS` data-parallel steps, rank `r` training on `split[r]` (indices into `batches`);
/// returns every rank's outcome.
fn data_parallel(cfg: &TrainConfig, batches: &[MicroBatch], split: &[Vec<usize>]) -> Vec<Outcome> {
    let replicas: Vec<Policy> = split.iter().map(|_| replica(cfg)).collect();
    let handles: Vec<_> = local_group(split.len())
        .into_iter()
        .zip(replicas)
        .map(|(collective, mut policy)| {
            let mine: Vec<MicroBatch> = split[collective.rank()].iter().map(|&i| batches[i].clone()).collect();
            let cfg = cfg.clone();
            std::thread::spawn(move || {
                let mut trainer = Trainer::new(&cfg, Device::Cpu);
                let metrics = (0..STEPS)
                    .map(|_| data_parallel_step(&collective, &mut trainer, &mut policy, &mine).unwrap())
                    .collect();
                outcome(&policy, metrics)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().to_kind(Kind::Double).double_value(&[])
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= TOLERANCE * a.abs().max(1.0)
}

fn assert_same_as_single_rank(expected: &Outcome, ranks: &[Outcome]) {
    let moved =
        expected.weights.iter().filter(|(n, t)| n.contains("lora_A") || max_abs_diff(t, &t.zeros_like()) > 0.0).count();
    assert_eq!(moved, expected.weights.len(), "every LoRA B must have moved away from zero");
    for (rank, got) in ranks.iter().enumerate() {
        for ((name, want), (_, have)) in expected.weights.iter().zip(&got.weights) {
            let diff = max_abs_diff(want, have);
            assert!(diff < TOLERANCE, "rank {rank}: {name} differs from one rank by {diff}");
        }
        for (i, (want, have)) in expected.grads.iter().zip(&got.grads).enumerate() {
            let diff = max_abs_diff(want, have);
            assert!(diff < TOLERANCE * 1e-2, "rank {rank}: gradient {i} differs from one rank by {diff}");
        }
        for (step, (want, have)) in expected.metrics.iter().zip(&got.metrics).enumerate() {
            let same = close(want.loss, have.loss)
                && close(want.policy_loss, have.policy_loss)
                && close(want.grad_norm, have.grad_norm)
                && close(want.clip_fraction, have.clip_fraction)
                && close(want.mean_ratio, have.mean_ratio)
                && (want.tokens, want.sequences, want.micro_batches)
                    == (have.tokens, have.sequences, have.micro_batches);
            assert!(same, "rank {rank} step {step}: metrics {have:?} differ from one rank's {want:?}");
        }
    }
    let clipped =
        expected.metrics.iter().all(|m| m.grad_norm > config(LossNormalization::TokenMean).optimizer.max_grad_norm);
    assert!(clipped, "the test should exercise clipping: {:?}", expected.metrics);
    assert!(expected.metrics[1].clip_fraction > 0.0, "the test should exercise ratio clipping");
}

fn padded_sizes(batches: &[MicroBatch]) -> Vec<usize> {
    batches.iter().map(|b| b.rows * b.cols).collect()
}

#[test]
fn two_ranks_give_the_same_update_as_one_rank_with_token_mean_loss() {
    let (cfg, batches) = (config(LossNormalization::TokenMean), micro_batches());
    let split = split_by_tokens(&padded_sizes(&batches), 2);
    assert!(split.iter().all(|r| !r.is_empty()));
    assert_same_as_single_rank(&single_rank(&cfg, &batches), &data_parallel(&cfg, &batches, &split));
}

#[test]
fn two_ranks_give_the_same_update_as_one_rank_with_sequence_mean_loss() {
    let (cfg, batches) = (config(LossNormalization::SequenceMean), micro_batches());
    let split = split_by_tokens(&padded_sizes(&batches), 2);
    assert_same_as_single_rank(&single_rank(&cfg, &batches), &data_parallel(&cfg, &batches, &split));
}

#[test]
fn three_ranks_with_an_uneven_split_and_an_idle_rank_give_the_same_update() {
    let (cfg, batches) = (config(LossNormalization::TokenMean), micro_batches());
    let n = batches.len();
    let split = vec![(0..n - 1).collect(), vec![n - 1], vec![]];
    assert_same_as_single_rank(&single_rank(&cfg, &batches), &data_parallel(&cfg, &batches, &split));
}

#[test]
fn a_rank_group_trains_like_one_rank_and_reports_rank_zero_metrics() {
    let (cfg, batches) = (config(LossNormalization::SequenceMean), micro_batches());
    let expected = single_rank(&cfg, &batches);
    let replicas: Vec<RankReplica> = local_group(3)
        .into_iter()
        .map(|c| {
            let policy = replica(&cfg);
            if c.rank() > 0 {
                // As if each GPU had drawn its own LoRA A: the group must start from rank 0's.
                tch::no_grad(|| {
                    policy.trainable_variables().iter().for_each(|t| {
                        let _ = t.detach().g_add_scalar_(0.1 * c.rank() as f64);
                    })
                });
            }
            RankReplica { policy, trainer: Trainer::new(&cfg, Device::Cpu), collective: Box::new(c) }
        })
        .collect();
    let group = RankGroup::from_replicas(replicas).unwrap();
    let mut metrics = Vec::new();
    for _ in 0..STEPS {
        metrics.push(group.train_blocking(batches.clone()).unwrap());
    }
    let weights = group.run_on_rank_zero_blocking(|policy, _| Ok(outcome(policy, Vec::new()))).unwrap();
    assert_same_as_single_rank(&expected, &[Outcome { metrics, ..weights }]);
}

#[test]
fn a_rank_with_a_bad_micro_batch_makes_every_rank_fail_the_step_instead_of_hanging() {
    let (cfg, batches) = (config(LossNormalization::TokenMean), micro_batches());
    let broken = MicroBatch { rows: 1, cols: 4, ..batches[0].clone() };
    let shares = [vec![batches[0].clone()], vec![broken]];
    let handles: Vec<_> = local_group(2)
        .into_iter()
        .map(|collective| {
            let (mut policy, mine, cfg) = (replica(&cfg), shares[collective.rank()].clone(), cfg.clone());
            std::thread::spawn(move || {
                let mut trainer = Trainer::new(&cfg, Device::Cpu);
                data_parallel_step(&collective, &mut trainer, &mut policy, &mine).map_err(|e| e.to_string())
            })
        })
        .collect();
    let errors: Vec<String> = handles.into_iter().map(|h| h.join().unwrap().unwrap_err()).collect();
    assert!(errors[0].contains("other rank(s) failed") && errors[1].contains("field lengths"), "{errors:?}");
}

/// The policy, firing `cancel` as soon as its first micro-batch is done (as the lease heartbeat
/// does when it finds the claim lost in the middle of a step); counts the micro-batches it ran.
struct CancelAfterFirst {
    policy: Policy,
    cancel: CancellationToken,
    ran: usize,
}

impl PolicyModel for CancelAfterFirst {
    fn token_logprobs(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        targets: &Tensor,
    ) -> trainq_engine::Result<Tensor> {
        PolicyModel::token_logprobs(&self.policy, input_ids, position_ids, targets)
    }

    fn batch_logprobs(&self, batch: &MicroBatchTensors) -> trainq_engine::Result<Tensor> {
        PolicyModel::batch_logprobs(&self.policy, batch)
    }

    fn finish_backward(&mut self) -> trainq_engine::Result<()> {
        PolicyModel::finish_backward(&mut self.policy)?;
        self.ran += 1;
        self.cancel.cancel();
        Ok(())
    }

    fn trainable_variables(&self) -> Vec<Tensor> {
        PolicyModel::trainable_variables(&self.policy)
    }

    fn set_lora_enabled(&mut self, enabled: bool) {
        PolicyModel::set_lora_enabled(&mut self.policy, enabled)
    }

    fn set_logit_temperature(&mut self, temperature: f64) {
        PolicyModel::set_logit_temperature(&mut self.policy, temperature)
    }
}

#[test]
fn a_step_cancelled_mid_way_stops_before_its_next_micro_batch_and_leaves_the_weights_unchanged() {
    let (cfg, batches) = (config(LossNormalization::TokenMean), micro_batches());
    let cancel = CancellationToken::new();
    let mut model = CancelAfterFirst { policy: replica(&cfg), cancel: cancel.clone(), ran: 0 };
    let weights = |policy: &Policy| -> Vec<(String, Tensor)> {
        policy.lora_variables().into_iter().map(|(n, t)| (n, t.detach().copy())).collect()
    };
    let before = weights(&model.policy);
    let mut trainer = Trainer::new(&cfg, Device::Cpu);
    trainer.set_cancel(Some(cancel));

    let err = trainer.step(&mut model, &batches).unwrap_err();
    assert!(matches!(err, trainq_engine::Error::Cancelled), "{err}");
    assert_eq!(model.ran, 1, "stopped after the first of {} micro-batches", batches.len());
    for ((name, was), (_, now)) in before.iter().zip(&weights(&model.policy)) {
        assert_eq!(max_abs_diff(was, now), 0.0, "{name} moved: no optimizer step may follow a cancel");
    }
}
