//! Two ways of computing the same step give the same numbers, on a tiny GQA Qwen3 in f32 with
//! packed micro-batches and the KL reference on: activation checkpointing (staged recomputation)
//! against the plain backward, and packed attention per document segment (no mask, native GQA)
//! against the dense document mask with K/V repeated to every head.

use tch::{Device, Kind, Tensor};
use trainq_engine::model::{tiny_qwen3_config, BatchSummary, PackedAttention, Policy};
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

fn packed_batches_checked() -> Vec<MicroBatch> {
    let batches = packed_batches();
    assert!(batches.len() >= 2, "several micro-batches");
    let packed = |b: &MicroBatch| BatchSummary::of(&b.input_ids, &b.position_ids, &b.targets, b.cols).packed;
    assert!(batches.iter().any(packed), "some row holds two documents");
    batches
}

fn assert_same_gradients(what: &str, want: &(Vec<(String, Tensor)>, f64), got: &(Vec<(String, Tensor)>, f64)) {
    let ((want, want_loss), (got, got_loss)) = (want, got);
    assert!((want_loss - got_loss).abs() < 1e-6, "{what}: loss {want_loss} vs {got_loss}");
    assert_eq!(want.len(), got.len());
    for ((name, want), (_, got)) in want.iter().zip(got) {
        assert!(got.defined(), "{what}: {name} got no gradient");
        let scale = want.abs().max().double_value(&[]);
        assert!(scale > 0.0, "{name} has a zero gradient: the test would prove nothing");
        let diff = (got - want).abs().max().double_value(&[]);
        assert!(diff <= 1e-5 * scale.max(1.0), "{what}: {name}: gradients differ by {diff} (scale {scale})");
    }
}

fn assert_same_gradients_with_and_without_checkpointing(lora: bool) {
    let batches = packed_batches_checked();
    let mut policy = policy(lora);
    let plain = gradients(&mut policy, &batches, false);
    let checkpointed = gradients(&mut policy, &batches, true);
    assert_same_gradients("checkpointing", &plain, &checkpointed);
}

/// Per-segment attention against the dense mask, for the loss, every gradient and the log-probs
/// themselves, with and without activation checkpointing.
fn assert_segments_equal_the_dense_mask(lora: bool) {
    let batches = packed_batches_checked();
    let mut policy = policy(lora);
    for checkpointing in [false, true] {
        policy.set_packed_attention(PackedAttention::DenseMask);
        let masked = gradients(&mut policy, &batches, checkpointing);
        policy.set_packed_attention(PackedAttention::Segments);
        let segments = gradients(&mut policy, &batches, checkpointing);
        assert_same_gradients("segments vs mask", &masked, &segments);
    }
    let b = &batches[0];
    let shape = [b.rows as i64, b.cols as i64];
    let t = |v: &[i64]| Tensor::from_slice(v).reshape(shape);
    let logprobs = |policy: &Policy| {
        tch::no_grad(|| policy.token_logprobs(&t(&b.input_ids), &t(&b.position_ids), &t(&b.targets)).unwrap())
    };
    let segments = logprobs(&policy);
    policy.set_packed_attention(PackedAttention::DenseMask);
    let masked = logprobs(&policy);
    let diff = (&segments - &masked).abs().max().double_value(&[]);
    assert!(diff < 1e-5, "log-probs differ by {diff}");
}

#[test]
fn packed_attention_per_segment_equals_the_dense_mask_for_lora() {
    assert_segments_equal_the_dense_mask(true);
}

#[test]
fn packed_attention_per_segment_equals_the_dense_mask_for_a_full_fine_tune() {
    assert_segments_equal_the_dense_mask(false);
}

#[test]
fn lora_gradients_with_checkpointing_equal_those_without() {
    assert_same_gradients_with_and_without_checkpointing(true);
}

#[test]
fn full_fine_tune_gradients_with_checkpointing_equal_those_without() {
    assert_same_gradients_with_and_without_checkpointing(false);
}

/// Offloading the saved layer inputs (to host memory and back, a layer ahead) changes where they
/// live, not what the backward computes: both LoRA and the full fine-tune (whose embedding
/// gradient needs layer 0's input back too).
#[test]
fn gradients_with_offloaded_checkpoints_equal_those_kept_on_the_device() {
    let batches = packed_batches_checked();
    for lora in [true, false] {
        let mut policy = policy(lora);
        let kept = gradients(&mut policy, &batches, true);
        policy.set_activation_offloading(true);
        let offloaded = gradients(&mut policy, &batches, true);
        assert_same_gradients("offloading", &kept, &offloaded);
    }
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
