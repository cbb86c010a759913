//! `trainq bench train`: the real training step (policy loss over every token with random
//! advantages, AdamW) on random-weight Qwen3 shapes, reporting the same JSON fields as the
//! HF+PEFT peer baseline (tokens/s, step time, peak memory, model TFLOP/s, MFU).

use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use serde_json::json;
use tch::{Device, Kind, Tensor};
use trainq_engine::model::{packed_attention_kernel, HfConfig, MemorySettings, PackedAttention, Policy};
use trainq_engine::tokenize::MicroBatch;
use trainq_engine::train::Trainer;
use trainq_queue::config::{LoraConfig, TrainConfig};

/// Benchmarks.
#[derive(Subcommand, Debug)]
pub(crate) enum BenchCommand {
    /// Training throughput on a random-weight Qwen3 shape.
    Train(TrainBenchArgs),
    /// bf16 on CUDA against f32 on the CPU (log-probs, loss, gradients) and activation checkpointing on CUDA.
    Check(super::bench_check::CheckArgs),
    /// Stream agent-like groups (multi-turn, tool calls, sampler ids and log-probs) into a
    /// model's queue while a worker trains (end-to-end runs).
    Produce(super::bench_produce::ProduceArgs),
}

/// Settings of `trainq bench train`.
#[derive(Args, Debug)]
pub(crate) struct TrainBenchArgs {
    /// Model shape (same dims as the peer baseline).
    #[arg(long, default_value = "qwen3-0.6b", value_parser = ["qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-32b"])]
    shape: String,
    /// LoRA (rank 8, alpha 16, all linear layers) or full fine-tune.
    #[arg(long, default_value = "lora", value_parser = ["lora", "full"])]
    mode: String,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 4096)]
    seq: i64,
    /// Sequences per micro-batch.
    #[arg(long, default_value_t = 4)]
    micro: i64,
    /// Micro-batches per step (gradient accumulation), as the worker's steps hold many: plain
    /// rows train this many micro-batches, --packed documents fill `seq × micro × this` tokens.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(i64).range(1..))]
    accumulate: i64,
    /// Activation checkpointing (recompute each decoder layer in backward).
    #[arg(long)]
    ckpt: bool,
    /// Activation offloading: with --ckpt, the saved layer inputs go to pinned host memory on a
    /// side stream and come back a layer ahead of the backward walk.
    #[arg(long, requires = "ckpt")]
    offload: bool,
    /// LoRA: each MLP keeps its SwiGLU product for the backward instead of computing it again
    /// (the `keep_mlp_activations` train setting; faster, more activation memory).
    #[arg(long)]
    keep_mlp: bool,
    /// Timed steps (after the warm-up steps).
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Untimed steps first (allocator warm-up, cuBLAS heuristics); 0 for profiling one step.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Run the peer baseline's standard table.
    #[arg(long)]
    all: bool,
    /// Skip the bf16 matmul-peak measurement (no MFU; for profiling the step alone).
    #[arg(long)]
    skip_peak: bool,
    /// Device: cuda (default when available) or cpu.
    #[arg(long)]
    device: Option<String>,
    /// Packed rows of agent-like documents, as the worker trains them: lengths log-uniform in
    /// [--doc-min, --doc-max] (seeded) until a step holds `seq × micro` tokens, packed by the
    /// worker's packer; tokens/s counts real (non-pad) tokens.
    #[arg(long)]
    packed: bool,
    /// Shortest document of --packed, in tokens.
    #[arg(long, default_value_t = 300)]
    doc_min: i64,
    /// Longest document of --packed, in tokens (cut to --seq).
    #[arg(long, default_value_t = 6000)]
    doc_max: i64,
    /// Write the --packed document lengths here (JSON), for the peer's `--docs`.
    #[arg(long)]
    docs_out: Option<std::path::PathBuf>,
    /// Seed of the --packed document lengths.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// After the timed steps, record one more step with libtorch's profiler and write its
    /// Chrome trace into this directory (`{shape}-{mode}-{micro}x{seq}[-ckpt].json`), for
    /// `ops/bench/trace_summary.py`.
    #[arg(long)]
    trace: Option<std::path::PathBuf>,
    /// With --trace, also record the CPU operators, so the summary can say which operator
    /// launched each kernel (the host runs slower while recording, so idle gaps read longer).
    #[arg(long, requires = "trace")]
    trace_ops: bool,
    /// With --trace, how many consecutive steps the trace records (2 or more show the gap
    /// between steps, which one step's trace cannot).
    #[arg(long, default_value_t = 1, requires = "trace")]
    trace_steps: usize,
    /// Run the decoder layers' q/k norm + RoPE and SwiGLU as libtorch tensor ops instead of the
    /// fused kernels (for comparisons).
    #[arg(long)]
    no_fused: bool,
    /// With --packed, attend over the documents with variable-length flash attention instead
    /// of cuDNN's ragged kernel (for comparisons).
    #[arg(long, requires = "packed")]
    flash_varlen: bool,
}

/// What one benchmark row trains on.
#[derive(Debug, Clone)]
struct Workload {
    seq: i64,
    micro: i64,
    /// Micro-batches per step (plain rows); packed documents already fill that many.
    accumulate: i64,
    /// Document lengths of a packed step; `None`: `micro` full rows of one document each.
    docs: Option<Vec<i64>>,
}

/// Activation memory settings of a row, whether the fused layer ops run, and whether packed
/// rows take flash varlen instead of cuDNN.
#[derive(Debug, Clone, Copy)]
struct Memory {
    settings: MemorySettings,
    fused: bool,
    flash_varlen: bool,
}

/// How a row is timed: untimed warm-up steps, timed steps, and where to write the trace of
/// `trace_steps` more steps (if at all), with or without the CPU operators.
#[derive(Debug, Clone)]
struct Timing {
    warmup: usize,
    steps: usize,
    trace: Option<std::path::PathBuf>,
    trace_ops: bool,
    trace_steps: usize,
}

/// The peer's standard table: shape, mode, seq, micro, checkpointing.
const STANDARD: [(&str, &str, i64, i64, bool); 4] = [
    ("qwen3-0.6b", "lora", 4096, 4, false),
    ("qwen3-0.6b", "full", 4096, 4, false),
    ("qwen3-1.7b", "lora", 4096, 4, false),
    ("qwen3-8b", "lora", 4096, 2, true),
];

/// (hidden, intermediate, layers, heads, kv heads, tied embeddings) of each shape.
fn shape_dims(shape: &str) -> Result<(i64, i64, i64, i64, i64, bool)> {
    Ok(match shape {
        "qwen3-0.6b" => (1024, 3072, 28, 16, 8, true),
        "qwen3-1.7b" => (2048, 6144, 28, 16, 8, true),
        "qwen3-4b" => (2560, 9728, 36, 32, 8, true),
        "qwen3-8b" => (4096, 12288, 36, 32, 8, false),
        "qwen3-32b" => (5120, 25600, 64, 64, 8, false),
        other => bail!("unknown shape {other}"),
    })
}

pub(crate) fn shape_config(shape: &str) -> Result<HfConfig> {
    let (hidden, inter, layers, heads, kv, tied) = shape_dims(shape)?;
    let cfg = json!({
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936,
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": 128,
        "max_position_embeddings": 40960, "rope_theta": 1e6, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": tied, "hidden_act": "silu", "attention_bias": false,
    });
    Ok(serde_json::from_value(cfg)?)
}

pub(crate) fn run(command: BenchCommand) -> Result<()> {
    match command {
        BenchCommand::Train(args) => run_train(args),
        BenchCommand::Check(args) => super::bench_check::run_check(args),
        BenchCommand::Produce(args) => super::bench_produce::run(args),
    }
}

fn run_train(args: TrainBenchArgs) -> Result<()> {
    let device = super::worker::parse_device(args.device.as_deref())?;
    let peak = if device.is_cuda() && !args.skip_peak { Some(matmul_peak_tflops(device)) } else { None };
    println!("{}", json!({"bf16_matmul_tflops": peak.map(|p| (p * 10.0).round() / 10.0)}));
    let plan: Vec<(String, String, i64, i64, bool)> = if args.all {
        STANDARD.iter().map(|&(s, m, q, b, c)| (s.into(), m.into(), q, b, c)).collect()
    } else {
        vec![(args.shape.clone(), args.mode.clone(), args.seq, args.micro, args.ckpt)]
    };
    let bounds = (args.doc_min, args.doc_max);
    let mut dumped = Vec::new();
    for (shape, mode, seq, micro, ckpt) in plan {
        let budget = seq * micro * args.accumulate;
        let docs = args.packed.then(|| super::bench_docs::document_lengths(budget, bounds, seq, args.seed));
        if let Some(docs) = &docs {
            dumped.push(super::bench_docs::docs_json(docs, seq, micro, bounds));
        }
        let work = Workload { seq, micro, accumulate: args.accumulate, docs };
        let settings = MemorySettings {
            activation_checkpointing: ckpt,
            activation_offloading: ckpt && args.offload,
            keep_mlp_activations: args.keep_mlp,
        };
        let memory = Memory { settings, fused: !args.no_fused, flash_varlen: args.flash_varlen };
        let trace = args.trace.as_ref().map(|dir| {
            let ckpt = if ckpt { "-ckpt" } else { "" };
            let packed = if args.packed { "-packed" } else { "" };
            let accumulate = if args.accumulate > 1 { format!("-acc{}", args.accumulate) } else { String::new() };
            let keep = if args.keep_mlp { "-keep-mlp" } else { "" };
            dir.join(format!("{shape}-{mode}-{micro}x{seq}{ckpt}{packed}{accumulate}{keep}.json"))
        });
        let timing = Timing {
            warmup: args.warmup,
            steps: args.steps,
            trace,
            trace_ops: args.trace_ops,
            trace_steps: args.trace_steps,
        };
        let result = bench_one(&shape, &mode, &work, memory, &timing, device, peak);
        let line = result.unwrap_or_else(
            |e| json!({"shape": shape, "mode": mode, "seq": seq, "micro": micro, "ckpt": ckpt, "error": format!("{e:#}")}),
        );
        println!("{line}");
    }
    if let Some(path) = &args.docs_out {
        std::fs::write(path, serde_json::to_vec(&dumped)?).with_context(|| format!("write {}", path.display()))?;
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn bench_one(
    shape: &str,
    mode: &str,
    work: &Workload,
    Memory { settings, fused, flash_varlen }: Memory,
    timing: &Timing,
    device: Device,
    peak: Option<f64>,
) -> Result<serde_json::Value> {
    let (seq, micro) = (work.seq, work.micro);
    let hf = shape_config(shape)?;
    let lora = (mode == "lora").then(|| LoraConfig { rank: 8, alpha: 16.0, ..LoraConfig::default() });
    let mut cfg = TrainConfig { lora: lora.clone(), max_seq_len: seq as usize, ..TrainConfig::default() };
    cfg.max_tokens_per_micro_batch = (seq * micro) as usize;
    let mut policy = Policy::from_config(&hf, lora.as_ref(), device, 0).context("build the model")?;
    policy.set_memory_settings(settings);
    policy.set_fused_ops(fused);
    let packed_attention = if flash_varlen { PackedAttention::FlashVarlen } else { PackedAttention::Segments };
    policy.set_packed_attention(packed_attention);
    let n_params: i64 =
        policy.named_variables().iter().filter(|(n, _)| !n.contains("lora_")).map(|(_, t)| t.numel() as i64).sum();
    let mut trainer = Trainer::new(&cfg, device);
    let (batches, real_tokens) = match &work.docs {
        Some(docs) => {
            (super::bench_docs::packed_batches(docs, seq, micro, hf.vocab_size, 0)?, docs.iter().sum::<i64>())
        }
        None => {
            let batches = (0..work.accumulate).map(|_| random_batch(micro, seq, hf.vocab_size)).collect();
            (batches, micro * seq * work.accumulate)
        }
    };
    let padded_tokens: usize = batches.iter().map(|b| b.rows * b.cols).sum();
    let mut run_step = || -> Result<()> {
        trainer.step(&mut policy, &batches)?;
        Ok(())
    };
    let steps = timing.steps.max(1);
    for _ in 0..timing.warmup {
        run_step()?;
    }
    sync(device);
    let start = Instant::now();
    for _ in 0..steps {
        run_step()?;
    }
    sync(device);
    let dt = start.elapsed().as_secs_f64() / steps as f64;
    if let Some(path) = &timing.trace {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
        }
        trainq_engine::trace::start(device.is_cuda(), timing.trace_ops)?;
        let traced = (0..timing.trace_steps.max(1)).try_for_each(|_| run_step());
        sync(device);
        trainq_engine::trace::stop(path)?;
        traced?;
    }
    let tokens = real_tokens as f64 / dt;
    // Attention FLOPs grow with the context a token sees: the row for plain rows (the peer's
    // convention), the token-weighted mean document length for packed ones.
    let context = match &work.docs {
        Some(docs) => docs.iter().map(|&d| d * d).sum::<i64>() as f64 / real_tokens.max(1) as f64,
        None => seq as f64,
    };
    let fwd = 2.0 * n_params as f64 + 2.0 * (hf.num_hidden_layers * hf.num_attention_heads * 128) as f64 * context;
    let ckpt = settings.activation_checkpointing;
    let factor = if mode == "full" { 3.0 } else { 2.0 } + if ckpt { 1.0 } else { 0.0 };
    let tflops = fwd * factor * tokens / 1e12;
    let mut res = json!({
        "impl": "trainq", "shape": shape, "mode": mode, "seq": seq, "micro": micro,
        "accumulate": work.accumulate, "ckpt": ckpt,
        "offload": settings.activation_offloading, "keep_mlp": settings.keep_mlp_activations, "fused_ops": policy.fused_ops_active(), "params_b": (n_params as f64 / 1e7).round() / 100.0, "tokens_per_s": tokens.round(),
        "step_s": (dt * 1e4).round() / 1e4, "model_tflops": (tflops * 10.0).round() / 10.0,
        "peak_mem_gib": device_memory_used_gib(device),
    });
    if let Some(docs) = &work.docs {
        res["packed"] = json!({
            "docs": docs.len(), "real_tokens": real_tokens, "padded_tokens": padded_tokens,
            "micro_batches": batches.len(), "doc_tokens": [docs.iter().min(), docs.iter().max()],
            "attention": if flash_varlen { "flash_varlen" } else { packed_attention_kernel(device, policy.kind()) },
        });
    }
    if let Some(peak) = peak {
        res["mfu"] = json!((tflops / peak * 1000.0).round() / 1000.0);
    }
    Ok(res)
}

/// One micro-batch of `micro` rows of `seq` random tokens, every target trained, random ±1
/// advantages per row, no sampler log-probs (ratio 1).
pub(crate) fn random_batch(micro: i64, seq: i64, vocab: i64) -> MicroBatch {
    let ids: Vec<i64> =
        Tensor::randint(vocab, [micro * (seq + 1)], (Kind::Int64, Device::Cpu)).try_into().unwrap_or_default();
    let mut b = MicroBatch { rows: micro as usize, cols: seq as usize, ..MicroBatch::default() };
    for r in 0..micro as usize {
        let row = &ids[r * (seq as usize + 1)..(r + 1) * (seq as usize + 1)];
        let advantage = if r % 2 == 0 { 1.0 } else { -1.0 };
        b.input_ids.extend_from_slice(&row[..seq as usize]);
        b.targets.extend_from_slice(&row[1..]);
        b.position_ids.extend(0..seq);
        b.loss_mask.extend(std::iter::repeat_n(true, seq as usize));
        b.sampler_logprobs.extend(std::iter::repeat_n(f32::NAN, seq as usize));
        b.advantages.extend(std::iter::repeat_n(advantage, seq as usize));
        b.sequence_index.extend(std::iter::repeat_n(r as i64, seq as usize));
        b.trajectory_index.push(r);
    }
    b
}

fn sync(device: Device) {
    if let Device::Cuda(i) = device {
        tch::Cuda::synchronize(i as i64);
    }
}

/// bf16 8192³ matmul rate in TFLOP/s (the same measurement as the peer's).
fn matmul_peak_tflops(device: Device) -> f64 {
    let a = Tensor::randn([8192, 8192], (Kind::BFloat16, device));
    let b = Tensor::randn([8192, 8192], (Kind::BFloat16, device));
    for _ in 0..5 {
        let _ = a.matmul(&b);
    }
    sync(device);
    let start = Instant::now();
    for _ in 0..50 {
        let _ = a.matmul(&b);
    }
    sync(device);
    2.0 * 8192f64.powi(3) * 50.0 / start.elapsed().as_secs_f64() / 1e12
}

/// GPU memory in use on the device (driver view: the caching allocator's reserve, an upper
/// bound of the peer's `max_memory_allocated`).
fn device_memory_used_gib(device: Device) -> Option<f64> {
    let Device::Cuda(i) = device else { return None };
    let ctx = cudarc::driver::CudaContext::new(i).ok()?;
    ctx.bind_to_thread().ok()?;
    let (free, total) = cudarc::driver::result::mem_get_info().ok()?;
    Some(((total - free) as f64 / (1u64 << 30) as f64 * 10.0).round() / 10.0)
}
