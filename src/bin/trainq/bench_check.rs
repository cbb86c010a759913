//! `trainq bench check`: the bf16 CUDA path against the f32 CPU path on the same random Qwen3
//! weights and packed batch (log-probs, loss, gradients), plus activation checkpointing (and offloading) on CUDA
//! against the plain backward, packed attention per document segment against the dense document
//! mask on CUDA, the fused q/k/v and SwiGLU ops against libtorch's tensor ops on CUDA, and the
//! fused CUDA AdamW kernel against the tensor-op AdamW, printed as one JSON line with pass/fail
//! per check.

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::json;
use tch::{Device, Kind, Tensor};
use trainq_engine::model::{PackedAttention, Policy};
use trainq_engine::tokenize::MicroBatch;
use trainq_engine::train::{to_tensors, AdamW, PolicyModel, Trainer};
use trainq_queue::config::OptimizerConfig;
use trainq_queue::config::{LoraConfig, TrainConfig};

use super::bench::{random_batch, shape_config};

/// Mean |Δ log-prob| allowed between bf16 CUDA and f32 CPU.
const LOGPROB_MEAN_TOLERANCE: f64 = 2e-2;
/// Loss difference allowed between bf16 CUDA and f32 CPU (the loss is a mean of O(1) terms).
const LOSS_ABS_TOLERANCE: f64 = 2e-2;
/// Smallest cosine similarity of the flattened gradients (bf16 vs f32; activation checkpointing vs not).
const GRAD_COSINE_MIN: f64 = 0.99;
/// Largest |Δ parameter| between the fused AdamW kernel and the tensor-op path after three
/// steps, relative to the largest parameter: f32 (float rounding) and bf16 (one rounding step).
const ADAMW_F32_TOLERANCE: f64 = 1e-5;
const ADAMW_BF16_TOLERANCE: f64 = 1e-2;

/// Settings of `trainq bench check`.
#[derive(Args, Debug)]
pub(crate) struct CheckArgs {
    /// Model dims (vocab, hidden, heads…) of this shape.
    #[arg(long, default_value = "qwen3-0.6b", value_parser = ["qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-32b"])]
    shape: String,
    /// Decoder layers (fewer than the shape's, so the f32 CPU side stays quick).
    #[arg(long, default_value_t = 4)]
    layers: i64,
    /// LoRA (rank 8, alpha 16, all linear layers; B randomized) or full fine-tune.
    #[arg(long, default_value = "lora", value_parser = ["lora", "full"])]
    mode: String,
    /// Tokens per row (each row packs two documents).
    #[arg(long, default_value_t = 512)]
    seq: i64,
    /// Rows.
    #[arg(long, default_value_t = 2)]
    micro: i64,
    /// Device of the compared side (cuda by default; cpu compares f32 with itself, a smoke test).
    #[arg(long, default_value = "cuda")]
    device: String,
}

pub(crate) fn run_check(args: CheckArgs) -> Result<()> {
    let device = super::worker::parse_device(Some(&args.device))?;
    if device.is_cuda() && !tch::Cuda::is_available() {
        bail!("bench check compares CUDA bf16 with CPU f32: no CUDA device");
    }
    let mut hf = shape_config(&args.shape)?;
    hf.num_hidden_layers = args.layers;
    let lora = (args.mode == "lora").then(|| LoraConfig { rank: 8, alpha: 16.0, ..LoraConfig::default() });
    let mut cpu = Policy::from_config(&hf, lora.as_ref(), Device::Cpu, 0).context("build the f32 CPU model")?;
    tch::no_grad(|| {
        for (name, mut var) in cpu.lora_variables() {
            if name.contains("lora_B") {
                var.copy_(&(Tensor::randn(var.size(), (Kind::Float, Device::Cpu)) * 0.02));
            }
        }
    });
    let mut gpu = Policy::from_config(&hf, lora.as_ref(), device, 0).context("build the compared model")?;
    copy_weights(&cpu, &gpu)?;
    let mut batch = packed_batch(args.micro, args.seq, hf.vocab_size);
    // Off-policy sampler log-probs (f32 ones shifted by ±0.1), so that ratios differ from 1.
    let lp_ref: Vec<f32> =
        tch::no_grad(|| cpu.batch_logprobs(&to_tensors(&batch, Device::Cpu)?))?.reshape([-1]).try_into()?;
    batch.sampler_logprobs = lp_ref.iter().enumerate().map(|(i, lp)| lp + 0.1 * (i as f32).sin()).collect();
    let (lp_cpu, loss_cpu, grad_cpu) = measure(&mut cpu, &batch, false)?;
    let (lp_gpu, loss_gpu, grad_gpu) = measure(&mut gpu, &batch, false)?;
    let (_, loss_ckpt, grad_ckpt) = measure(&mut gpu, &batch, true)?;
    // The same checkpointed step with the saved layer inputs offloaded to pinned host memory.
    gpu.set_activation_offloading(true);
    let (_, loss_offload, grad_offload) = measure(&mut gpu, &batch, true)?;
    gpu.set_activation_offloading(false);
    let cos_offload = cosine(&grad_offload, &grad_ckpt);
    // The same plain step with each MLP's SwiGLU product kept instead of computed again (only the
    // training forward keeps anything, so the loss and the gradients tell the two apart; the
    // no-grad log-probs would be the same op either way).
    gpu.set_keep_mlp_activations(true);
    let (_, loss_keep, grad_keep) = measure(&mut gpu, &batch, false)?;
    gpu.set_keep_mlp_activations(false);
    // The packed rows through the dense document mask (K/V repeated) instead of per segment.
    gpu.set_packed_attention(PackedAttention::DenseMask);
    let (lp_mask, loss_mask, grad_mask) = measure(&mut gpu, &batch, false)?;
    gpu.set_packed_attention(PackedAttention::SegmentLoop);
    let (lp_loop, _, grad_loop) = measure(&mut gpu, &batch, false)?;
    gpu.set_packed_attention(PackedAttention::FlashVarlen);
    let (lp_flash, _, grad_flash) = measure(&mut gpu, &batch, false)?;
    gpu.set_packed_attention(PackedAttention::Segments);
    let flash_vs_mask = (&lp_flash - &lp_mask).abs().sum(Kind::Double).double_value(&[]) / trained_tokens(&batch);
    let cos_flash_mask = cosine(&grad_flash, &grad_mask);
    let loop_vs_mask = (&lp_loop - &lp_mask).abs().sum(Kind::Double).double_value(&[]) / trained_tokens(&batch);
    let cos_loop_mask = cosine(&grad_loop, &grad_mask);
    let seg_vs_mask = (&lp_gpu - &lp_mask).abs().sum(Kind::Double).double_value(&[]) / trained_tokens(&batch);
    let cos_seg_mask = cosine(&grad_gpu, &grad_mask);
    let diff = (&lp_gpu - &lp_cpu).abs();
    let lp_mean = diff.sum(Kind::Double).double_value(&[]) / trained_tokens(&batch);
    let lp_max = diff.max().double_value(&[]);
    let loss_diff = (loss_gpu - loss_cpu).abs();
    let cos_bf16 = cosine(&grad_gpu, &grad_cpu);
    let cos_ckpt = cosine(&grad_ckpt, &grad_gpu);
    let cos_keep = cosine(&grad_keep, &grad_gpu);
    let keep_grad_max = (&grad_keep - &grad_gpu).abs().max().double_value(&[]);
    // The same step with the fused q/k/v and SwiGLU ops off (libtorch's tensor ops).
    let fused_ran = gpu.fused_ops_active();
    gpu.set_fused_ops(false);
    let (lp_ops, loss_ops, grad_ops) = measure(&mut gpu, &batch, false)?;
    gpu.set_fused_ops(true);
    let fused_vs_ops = (&lp_gpu - &lp_ops).abs().sum(Kind::Double).double_value(&[]) / trained_tokens(&batch);
    let cos_fused_ops = cosine(&grad_gpu, &grad_ops);
    let cos_ops_f32 = cosine(&grad_ops, &grad_cpu);
    let (adamw_f32, fused_f32) = fused_adamw_difference(device, Kind::Float)?;
    let (adamw_bf16, fused_bf16) = fused_adamw_difference(device, Kind::BFloat16)?;
    let checks = json!({
        "logprobs": lp_mean <= LOGPROB_MEAN_TOLERANCE, "loss": loss_diff <= LOSS_ABS_TOLERANCE,
        "grads_bf16_vs_f32": cos_bf16 >= GRAD_COSINE_MIN, "grads_ckpt_vs_plain": cos_ckpt >= GRAD_COSINE_MIN,
        "offload_vs_ckpt": cos_offload >= GRAD_COSINE_MIN && (loss_offload - loss_ckpt).abs() <= LOSS_ABS_TOLERANCE,
        "keep_mlp_vs_recompute": cos_keep >= GRAD_COSINE_MIN && (loss_keep - loss_gpu).abs() <= LOSS_ABS_TOLERANCE,
        "adamw_fused_vs_ops": adamw_f32 <= ADAMW_F32_TOLERANCE && adamw_bf16 <= ADAMW_BF16_TOLERANCE,
        "adamw_fused_ran_on_cuda": !device.is_cuda() || (fused_f32 && fused_bf16),
        "packed_segments_vs_mask": seg_vs_mask <= LOGPROB_MEAN_TOLERANCE && cos_seg_mask >= GRAD_COSINE_MIN
            && (loss_mask - loss_gpu).abs() <= LOSS_ABS_TOLERANCE,
        "packed_segment_loop_vs_mask": loop_vs_mask <= LOGPROB_MEAN_TOLERANCE && cos_loop_mask >= GRAD_COSINE_MIN,
        "packed_flash_varlen_vs_mask": flash_vs_mask <= LOGPROB_MEAN_TOLERANCE && cos_flash_mask >= GRAD_COSINE_MIN,
        "fused_ops_vs_tensor_ops": fused_vs_ops <= LOGPROB_MEAN_TOLERANCE && cos_fused_ops >= GRAD_COSINE_MIN
            && (loss_ops - loss_gpu).abs() <= LOSS_ABS_TOLERANCE,
        "fused_ops_ran_on_cuda": !device.is_cuda() || fused_ran,
    });
    let ok = checks.as_object().is_some_and(|m| m.values().all(|v| v == &json!(true)));
    println!(
        "{}",
        json!({
            "check": "bf16_cuda_vs_f32_cpu", "device": args.device, "ok": ok, "checks": checks, "shape": args.shape, "layers": args.layers,
            "mode": args.mode, "seq": args.seq, "micro": args.micro,
            "logprob_mean_abs_diff": lp_mean, "logprob_max_abs_diff": lp_max,
            "loss_f32_cpu": loss_cpu, "loss_bf16_cuda": loss_gpu, "loss_bf16_cuda_ckpt": loss_ckpt, "loss_abs_diff": loss_diff,
            "grad_cosine_bf16_vs_f32": cos_bf16, "grad_cosine_ckpt_vs_plain": cos_ckpt,
            "offload_vs_ckpt": {"grad_cosine": cos_offload, "loss_abs_diff": (loss_offload - loss_ckpt).abs()},
            "keep_mlp_vs_recompute": {"grad_cosine": cos_keep, "grad_max_abs_diff": keep_grad_max,
                "loss_abs_diff": (loss_keep - loss_gpu).abs()},
            "grad_norm_f32_cpu": norm(&grad_cpu), "grad_norm_bf16_cuda": norm(&grad_gpu),
            "adamw_fused_ran": fused_f32 && fused_bf16, "adamw_fused_vs_ops_f32": adamw_f32, "adamw_fused_vs_ops_bf16": adamw_bf16,
            "packed_segments_vs_mask": {"logprob_mean_abs_diff": seg_vs_mask, "grad_cosine": cos_seg_mask, "loss_mask": loss_mask},
            "packed_segment_loop_vs_mask": {"logprob_mean_abs_diff": loop_vs_mask, "grad_cosine": cos_loop_mask},
            "packed_flash_varlen_vs_mask": {"logprob_mean_abs_diff": flash_vs_mask, "grad_cosine": cos_flash_mask},
            "packed_segments_kernel": trainq_engine::model::packed_attention_kernel(device, Kind::BFloat16),
            "fused_ops_vs_tensor_ops": {"ran": fused_ran, "logprob_mean_abs_diff": fused_vs_ops, "grad_cosine": cos_fused_ops,
                "loss_abs_diff": (loss_ops - loss_gpu).abs(), "grad_cosine_tensor_ops_vs_f32": cos_ops_f32},
            "tolerances": {"logprob_mean": LOGPROB_MEAN_TOLERANCE, "loss_abs": LOSS_ABS_TOLERANCE, "grad_cosine_min": GRAD_COSINE_MIN},
        })
    );
    if !ok {
        bail!("bf16 CUDA and f32 CPU disagree beyond tolerance (see the JSON line)");
    }
    Ok(())
}

/// Three clipped AdamW steps on the same random parameters and gradients (several tensors, so
/// bucket offsets matter) with the fused kernel and with tensor ops: the largest |Δ parameter|
/// relative to the largest parameter, and whether the fused kernel ran (on CUDA).
fn fused_adamw_difference(device: Device, kind: Kind) -> Result<(f64, bool)> {
    let shapes: [&[i64]; 3] = [&[1000], &[37, 50], &[4096, 3]];
    let start: Vec<Tensor> = shapes.iter().map(|s| Tensor::randn(*s, (Kind::Float, device)).to_kind(kind)).collect();
    let cfg = OptimizerConfig { learning_rate: 1e-2, ..OptimizerConfig::default() };
    let mut results = Vec::new();
    for fused in [true, false] {
        let params: Vec<Tensor> = start.iter().map(|t| t.copy().set_requires_grad(true)).collect();
        let mut adamw = AdamW::new(cfg.clone());
        adamw.set_fused(fused);
        for step in 0..3 {
            tch::manual_seed(100 + step);
            for p in &params {
                p.shallow_clone().zero_grad();
                let r = Tensor::randn(p.size(), (Kind::Float, device)).to_kind(kind);
                (p * r).sum(Kind::Float).backward();
            }
            adamw.clip_and_step(&params, 1.0)?;
        }
        let flat: Vec<Tensor> = params.iter().map(|p| p.detach().to_kind(Kind::Float).reshape([-1])).collect();
        results.push((Tensor::cat(&flat, 0), adamw.fused()));
    }
    let scale = results[1].0.abs().max().double_value(&[]).max(1e-30);
    let diff = (&results[0].0 - &results[1].0).abs().max().double_value(&[]);
    Ok((diff / scale, results[0].1 && device.is_cuda()))
}

/// Every variable of `from` copied into `to` (dtype and device converted).
fn copy_weights(from: &Policy, to: &Policy) -> Result<()> {
    let source: std::collections::HashMap<String, Tensor> = from.named_variables().into_iter().collect();
    tch::no_grad(|| {
        for (name, mut var) in to.named_variables() {
            let src = source.get(&name).with_context(|| format!("{name} missing on the CPU model"))?;
            var.f_copy_(src).with_context(|| format!("copy {name}"))?;
        }
        Ok(())
    })
}

/// `micro` rows of `seq` random tokens, each row two documents (position ids restart halfway),
/// advantages 1 and 0.5 by row (so that the loss does not average to zero).
fn packed_batch(micro: i64, seq: i64, vocab: i64) -> MicroBatch {
    let mut batch = random_batch(micro, seq, vocab);
    for (i, a) in batch.advantages.iter_mut().enumerate() {
        *a = if (i as i64 / seq) % 2 == 0 { 1.0 } else { 0.5 };
    }
    let half = seq / 2;
    for (i, p) in batch.position_ids.iter_mut().enumerate() {
        let col = (i as i64) % seq;
        *p = if col < half { col } else { col - half };
    }
    batch
}

/// Log-probs (on the CPU, f32), loss and the flattened f32 gradient of one accumulation.
fn measure(policy: &mut Policy, batch: &MicroBatch, activation_checkpointing: bool) -> Result<(Tensor, f64, Tensor)> {
    policy.set_activation_checkpointing(activation_checkpointing);
    let device = policy.device();
    let trainer = Trainer::new(&TrainConfig::default(), device);
    let t = to_tensors(batch, device)?;
    let lp = tch::no_grad(|| policy.batch_logprobs(&t))?.to_device(Device::Cpu).to_kind(Kind::Float);
    let totals = trainer.accumulate_gradients(
        policy,
        std::slice::from_ref(batch),
        trainer.normalizer(std::slice::from_ref(batch)),
    )?;
    let grads: Vec<Tensor> = policy
        .trainable_variables()
        .iter()
        .map(|v| v.grad().to_device(Device::Cpu).to_kind(Kind::Float).reshape([-1]))
        .collect();
    Ok((lp, totals.loss.double_value(&[]), Tensor::cat(&grads, 0)))
}

/// Trained positions of `batch` (at least 1), the denominator of the mean log-prob differences.
fn trained_tokens(batch: &MicroBatch) -> f64 {
    batch.loss_mask.iter().filter(|&&m| m).count().max(1) as f64
}

fn norm(t: &Tensor) -> f64 {
    t.square().sum(Kind::Double).sqrt().double_value(&[])
}

fn cosine(a: &Tensor, b: &Tensor) -> f64 {
    (a * b).sum(Kind::Double).double_value(&[]) / (norm(a) * norm(b)).max(1e-30)
}
