//! On a CUDA device (run with `--ignored` there): parity in f32 and bf16, and the speed of a
//! LoRA forward + backward through chunked log-probs on a Qwen3-0.6B-shaped random model.

mod reference;

use std::time::Instant;

use tch::{Device, Kind, Tensor};
use trainq_engine::model::{tiny_qwen3_config, HfConfig, Policy};
use trainq_queue::config::LoraConfig;

use reference::{max_abs_diff, tensor, TOLERANCE};

fn check_on_cuda(kind: Kind, tolerance: f64) {
    let dir = reference::dir();
    let policy = Policy::load_as(&dir.join("qwen3"), None, Device::Cuda(0), kind).unwrap();
    let file = dir.join("qwen3_reference.safetensors");
    for prefix in ["", "packed_"] {
        let get = |name: &str| tensor(&file, &format!("{prefix}{name}")).to(Device::Cuda(0));
        let lp = policy.token_logprobs(&get("input_ids"), &get("position_ids"), &get("targets")).unwrap();
        let diff = max_abs_diff(&lp.to(Device::Cpu), &tensor(&file, &format!("{prefix}logprobs")));
        println!("cuda {kind:?} {prefix}logprobs max |diff| = {diff:e}");
        assert!(diff < tolerance, "{kind:?} {prefix}logprobs differ by {diff}");
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn qwen3_on_cuda_in_f32_matches_transformers() {
    check_on_cuda(Kind::Float, TOLERANCE);
}

#[test]
#[ignore = "needs a CUDA device"]
fn qwen3_on_cuda_in_bf16_stays_close_to_transformers() {
    check_on_cuda(Kind::BFloat16, 0.1);
}

fn qwen3_0_6b_shape() -> HfConfig {
    let mut cfg = tiny_qwen3_config(151_936);
    cfg.hidden_size = 1024;
    cfg.intermediate_size = 3072;
    cfg.num_hidden_layers = 28;
    cfg.num_attention_heads = 16;
    cfg.num_key_value_heads = Some(8);
    cfg.head_dim = Some(128);
    cfg
}

/// Tokens per second of forward + backward over `rows` × `len` tokens in documents of `doc_len`.
fn train_throughput(policy: &Policy, rows: i64, len: i64, doc_len: i64) -> f64 {
    let dev = policy.device();
    let ids = Tensor::randint(151_936, [rows, len], (Kind::Int64, dev));
    let pos = Tensor::arange(len, (Kind::Int64, dev)).remainder(doc_len).repeat([rows, 1]);
    let targets = ids.roll([-1], [1]);
    let step = || {
        let lp = policy.token_logprobs(&ids, &pos, &targets).unwrap();
        lp.mean(Kind::Float).backward();
        assert!(lp.isfinite().all().int64_value(&[]) == 1);
    };
    step();
    tch::Cuda::synchronize(0);
    let start = Instant::now();
    let steps = 5;
    for _ in 0..steps {
        step();
    }
    tch::Cuda::synchronize(0);
    (steps * rows * len) as f64 / start.elapsed().as_secs_f64()
}

#[test]
#[ignore = "needs a CUDA device"]
fn lora_training_throughput_on_a_qwen3_0_6b_shape() {
    let policy = Policy::from_config(&qwen3_0_6b_shape(), Some(&LoraConfig::default()), Device::Cuda(0), 1).unwrap();
    assert_eq!(policy.kind(), Kind::BFloat16);
    let unpacked = train_throughput(&policy, 4, 4096, 4096);
    let packed = train_throughput(&policy, 4, 4096, 1024);
    println!("qwen3-0.6b shape, LoRA r=8, 4x4096, fwd+bwd: {unpacked:.0} tok/s unpacked, {packed:.0} tok/s packed (4 docs/row)");
    let grads = policy.trainable_variables().iter().filter(|t| t.grad().defined()).count();
    assert_eq!(grads, policy.trainable_variables().len());
}
