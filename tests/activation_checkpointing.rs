//! Activation checkpointing (staged recomputation) gives the same gradients as the plain
//! backward: tiny Qwen3 in f32, LoRA and full fine-tune, packed micro-batches, KL reference on.

use tch::{Device, Kind, Tensor};
use trainq_engine::model::{tiny_qwen3_config, BatchSummary, Policy};
use trainq_engine::tokenize::{pack, MicroBatch, PackItem, TokenizedTrajectory};
use trainq_engine::train::Trainer;
use trainq_queue::config::{LoraConfig, TrainConfig};

const VOCAB: i64 = 50;

/// Seven trajectories of 4..=12 tokens packed into rows of 16, two rows per micro-batch.
fn packed_batches() -> Vec<MicroBatch> {
    let trajectories: Vec<TokenizedTrajectory> = (0..7)
        .map(|i| {
            let len = 4 + (i * 5) % 9;
            let ids = (0..len).map(|j| ((i * 7 + j * 3) % VOCAB as usize) as i64).collect();
            let trained = (0..len).map(|j| j >= 2).collect();
            let sampler_logprobs = (0..len).map(|j| (j % 2 == 0).then_some(-3.5 - 0.1 * j as f32)).collect();
            TokenizedTrajectory { ids, trained, sampler_logprobs }
        })
        .collect();
    let items: Vec<PackItem<'_>> = trajectories
        .iter()
        .enumerate()
        .map(|(i, trajectory)| PackItem { trajectory, advantage: if i % 2 == 0 { 1.0 } else { -0.5 } })
        .collect();
    pack(&items, 32, 16).unwrap()
}

/// A 3-layer tiny Qwen3; LoRA B made non-zero so that every adapter gets a gradient.
fn policy(lora: bool) -> Policy {
    let mut cfg = tiny_qwen3_config(VOCAB);
    cfg.num_hidden_layers = 3;
    let lora = lora.then(|| LoraConfig { rank: 4, alpha: 8.0, ..LoraConfig::default() });
    let policy = Policy::from_config(&cfg, lora.as_ref(), Device::Cpu, 11).unwrap();
    tch::no_grad(|| {
        for (name, mut var) in policy.lora_variables() {
            if name.contains("lora_B") {
                var.copy_(&(Tensor::randn(var.size(), (Kind::Float, Device::Cpu)) * 0.1));
            }
        }
    });
    policy
}

/// Gradients of every trainable variable after one accumulation over `batches`.
fn gradients(policy: &mut Policy, batches: &[MicroBatch], checkpointing: bool) -> (Vec<(String, Tensor)>, f64) {
    let mut cfg = TrainConfig::default();
    cfg.loss.kl_coef = 0.1;
    let trainer = Trainer::new(&cfg, Device::Cpu);
    policy.set_activation_checkpointing(checkpointing);
    let normalizer = trainer.normalizer(batches);
    let totals = trainer.accumulate_gradients(policy, batches, normalizer).unwrap();
    let grads = policy.named_trainable_variables().into_iter().map(|(n, v)| (n, v.grad().copy())).collect();
    (grads, totals.loss.double_value(&[]))
}

fn assert_same_gradients_with_and_without_checkpointing(lora: bool) {
    let batches = packed_batches();
    assert!(batches.len() >= 2, "several micro-batches");
    let packed = |b: &MicroBatch| BatchSummary::of(&b.input_ids, &b.position_ids, &b.targets, b.cols).packed;
    assert!(batches.iter().any(packed), "some row holds two documents");
    let mut policy = policy(lora);
    let (plain, plain_loss) = gradients(&mut policy, &batches, false);
    let (checkpointed, checkpointed_loss) = gradients(&mut policy, &batches, true);
    assert!((plain_loss - checkpointed_loss).abs() < 1e-6, "{plain_loss} vs {checkpointed_loss}");
    assert_eq!(plain.len(), checkpointed.len());
    for ((name, want), (_, got)) in plain.iter().zip(&checkpointed) {
        assert!(got.defined(), "{name} got no gradient with checkpointing");
        let scale = want.abs().max().double_value(&[]);
        assert!(scale > 0.0, "{name} has a zero gradient: the test would prove nothing");
        let diff = (got - want).abs().max().double_value(&[]);
        assert!(diff <= 1e-5 * scale.max(1.0), "{name}: gradients differ by {diff} (scale {scale})");
    }
}

#[test]
fn lora_gradients_with_checkpointing_equal_those_without() {
    assert_same_gradients_with_and_without_checkpointing(true);
}

#[test]
fn full_fine_tune_gradients_with_checkpointing_equal_those_without() {
    assert_same_gradients_with_and_without_checkpointing(false);
}

#[test]
fn a_forward_without_autograd_leaves_nothing_to_finish() {
    let mut policy = policy(true);
    policy.set_activation_checkpointing(true);
    let b = &packed_batches()[0];
    let shape = [b.rows as i64, b.cols as i64];
    let t = |v: &[i64]| Tensor::from_slice(v).reshape(shape);
    let plain = tch::no_grad(|| policy.token_logprobs(&t(&b.input_ids), &t(&b.position_ids), &t(&b.targets)).unwrap());
    assert!(!plain.requires_grad());
    policy.finish_backward().unwrap();
    assert!(policy.named_trainable_variables().iter().all(|(_, v)| !v.grad().defined()));
}
