//! LoRA and checkpoints against PEFT and transformers: our adapters load in peft with our
//! logits, peft's adapters load here with peft's logits, full fine-tunes save in HF layout.

mod reference;

use std::path::Path;

use tch::{Device, Kind, Tensor};
use trainq_engine::checkpoint::{hf, peft};
use trainq_engine::model::{tiny_qwen3_config, Policy};
use trainq_queue::config::LoraConfig;

use reference::{max_abs_diff, tensor, TOLERANCE};

fn lora(rank: i64, alpha: f64) -> LoraConfig {
    LoraConfig { rank, alpha, ..LoraConfig::default() }
}

/// Logits computed by transformers (+ peft when `adapter` is given) for the qwen3 inputs.
fn python_logits(model_dir: &Path, adapter: Option<&Path>, out_dir: &Path) -> Tensor {
    let inputs = reference::dir().join("qwen3_reference.safetensors");
    let out = out_dir.join("python_logits.safetensors");
    let mut args = vec!["logits", inputs.to_str().unwrap(), out.to_str().unwrap(), model_dir.to_str().unwrap()];
    if let Some(adapter) = adapter {
        args.push(adapter.to_str().unwrap());
    }
    reference::run(&args);
    tensor(&out, "logits")
}

fn qwen3_inputs() -> (Tensor, Tensor) {
    let file = reference::dir().join("qwen3_reference.safetensors");
    (tensor(&file, "input_ids"), tensor(&file, "position_ids"))
}

#[test]
fn an_adapter_saved_by_us_loads_in_peft_and_gives_our_logits() {
    let base = reference::dir().join("qwen3");
    let policy = Policy::load(&base, Some(&lora(4, 8.0)), Device::Cpu).unwrap();
    tch::manual_seed(11);
    tch::no_grad(|| {
        for (name, mut t) in policy.lora_variables() {
            if name.contains("lora_B") {
                t.copy_(&(Tensor::randn(t.size(), (Kind::Float, Device::Cpu)) * 0.3));
            }
        }
    });
    let (ids, pos) = qwen3_inputs();
    let ours = policy.logits(&ids, &pos).unwrap();
    let out = tempfile::tempdir().unwrap();
    let adapter = out.path().join("adapter");
    peft::save_adapter(&policy, &adapter, base.to_str().unwrap()).unwrap();
    let theirs = python_logits(&base, Some(&adapter), out.path());
    let base_logits = tensor(&reference::dir().join("qwen3_reference.safetensors"), "logits");
    assert!(max_abs_diff(&ours, &base_logits) > 1e-2, "the adapter must change the logits");
    let diff = max_abs_diff(&ours, &theirs);
    assert!(diff < TOLERANCE, "peft's logits differ from ours by {diff}");
}

#[test]
fn an_adapter_saved_by_peft_loads_here_and_gives_peft_logits() {
    let dir = reference::dir();
    let policy =
        peft::load_policy_with_adapter(&dir.join("qwen3"), &dir.join("qwen3_peft_adapter"), Device::Cpu).unwrap();
    let file = dir.join("qwen3_peft_reference.safetensors");
    let logits = policy.logits(&tensor(&file, "input_ids"), &tensor(&file, "position_ids")).unwrap();
    let diff = max_abs_diff(&logits, &tensor(&file, "logits"));
    assert!(diff < TOLERANCE, "our logits differ from peft's by {diff}");
}

#[test]
fn disabling_lora_gives_the_base_model_and_only_adapters_get_gradients() {
    let dir = reference::dir();
    let policy =
        peft::load_policy_with_adapter(&dir.join("qwen3"), &dir.join("qwen3_peft_adapter"), Device::Cpu).unwrap();
    let file = dir.join("qwen3_reference.safetensors");
    let (ids, pos, targets) = (tensor(&file, "input_ids"), tensor(&file, "position_ids"), tensor(&file, "targets"));
    let base = policy.with_lora_disabled(|p| p.token_logprobs(&ids, &pos, &targets).unwrap());
    assert!(policy.lora_enabled());
    assert!(max_abs_diff(&base, &tensor(&file, "logprobs")) < TOLERANCE);

    let trainable = policy.named_trainable_variables();
    assert_eq!(trainable.len(), 2 * 7 * 2, "A and B for 7 projections in 2 layers");
    assert!(trainable.iter().all(|(name, _)| name.contains(".lora_")));
    policy.token_logprobs(&ids, &pos, &targets).unwrap().sum(Kind::Float).backward();
    for (name, t) in &trainable {
        assert!(
            t.grad().defined() && t.grad().abs().sum(Kind::Float).double_value(&[]) > 0.0,
            "{name} got no gradient"
        );
    }
}

#[test]
fn a_full_fine_tune_saved_in_hf_layout_loads_in_transformers_and_here() {
    let policy = Policy::from_config(&tiny_qwen3_config(96), None, Device::Cpu, 5).unwrap();
    assert!(policy.lora_config().is_none());
    assert_eq!(policy.trainable_variables().len(), policy.named_variables().len());
    let out = tempfile::tempdir().unwrap();
    let model_dir = out.path().join("model");
    hf::save_full(&policy, &model_dir).unwrap();
    let (ids, pos) = qwen3_inputs();
    let ours = policy.logits(&ids, &pos).unwrap();
    let theirs = python_logits(&model_dir, None, out.path());
    assert!(max_abs_diff(&ours, &theirs) < TOLERANCE);
    let reloaded = Policy::load(&model_dir, None, Device::Cpu).unwrap();
    assert_eq!(max_abs_diff(&ours, &reloaded.logits(&ids, &pos).unwrap()), 0.0);
}

#[test]
fn unknown_lora_targets_and_mismatched_adapters_are_refused() {
    let dir = reference::dir();
    let bad = LoraConfig { target_modules: vec!["c_attn".into()], ..LoraConfig::default() };
    let err = Policy::load(&dir.join("qwen3"), Some(&bad), Device::Cpu).unwrap_err().to_string();
    assert!(err.contains("c_attn"), "{err}");
    let policy = Policy::load(&dir.join("qwen3"), Some(&lora(8, 16.0)), Device::Cpu).unwrap();
    let err = peft::load_adapter(&policy, &dir.join("qwen3_peft_adapter")).unwrap_err().to_string();
    assert!(err.contains("differs"), "{err}");
}

#[test]
fn lora_gradients_through_chunked_log_probs_match_pytorch_on_a_packed_batch() {
    let dir = reference::dir();
    let policy =
        peft::load_policy_with_adapter(&dir.join("qwen3"), &dir.join("qwen3_peft_adapter"), Device::Cpu).unwrap();
    let batch = dir.join("qwen3_reference.safetensors");
    let reference = dir.join("qwen3_peft_reference.safetensors");
    let get = |name: &str| tensor(&batch, name);
    let lp =
        policy.token_logprobs(&get("packed_input_ids"), &get("packed_position_ids"), &get("packed_targets")).unwrap();
    (lp * tensor(&reference, "coef")).sum(Kind::Float).backward();
    let trainable = policy.named_trainable_variables();
    assert_eq!(trainable.len(), 28);
    for (name, var) in trainable {
        let want = tensor(&reference, &format!("grad.{}{name}", peft::PEFT_KEY_PREFIX));
        let diff = max_abs_diff(&var.grad(), &want);
        assert!(diff < TOLERANCE, "gradient of {name} differs by {diff}");
    }
}

/// Per-variable gradients of `Σ lp · coef` over a packed batch, through `token_logprobs` (the
/// chunked path, with `lm_head`'s gradient deferred to `finish_backward`) or through the full
/// logits and autograd.
fn full_fine_tune_grads(policy: &Policy, chunked: bool) -> Vec<(String, Tensor)> {
    let (ids, pos) = (
        Tensor::from_slice(&[5i64, 17, 3, 40, 8, 2, 61, 9]).view([2, 4]),
        Tensor::from_slice(&[0i64, 1, 2, 3, 0, 1, 0, 1]).view([2, 4]),
    );
    let targets = Tensor::from_slice(&[17i64, 3, 40, -100, 2, -100, 9, 70]).view([2, 4]);
    let coef = Tensor::from_slice(&[0.5f32, -1.0, 2.0, 1.0, 0.25, 3.0, -0.75, 1.5]).view([2, 4]);
    for (_, v) in policy.named_trainable_variables() {
        v.shallow_clone().zero_grad();
    }
    let lp = if chunked {
        policy.token_logprobs(&ids, &pos, &targets).unwrap()
    } else {
        let valid = targets.ge(0).to_kind(Kind::Float);
        let logp = policy.logits(&ids, &pos).unwrap().log_softmax(-1, Kind::Float);
        logp.gather(-1, &targets.clamp_min(0).unsqueeze(-1), false).squeeze_dim(-1) * valid
    };
    (lp * &coef).sum(Kind::Float).backward();
    policy.finish_backward().unwrap();
    policy.named_trainable_variables().into_iter().map(|(n, v)| (n, v.grad().copy())).collect()
}

#[test]
fn a_full_fine_tune_with_tied_embeddings_gets_the_autograd_gradients_through_the_chunked_path() {
    let cfg = tiny_qwen3_config(96);
    assert!(cfg.tie_word_embeddings, "the tied case: embed_tokens gets both contributions");
    let policy = Policy::from_config(&cfg, None, Device::Cpu, 21).unwrap();
    let chunked = full_fine_tune_grads(&policy, true);
    let plain = full_fine_tune_grads(&policy, false);
    assert_eq!(chunked.len(), plain.len());
    for ((name, ours), (_, reference)) in chunked.iter().zip(&plain) {
        assert!(ours.defined() && reference.defined(), "{name} has a gradient");
        let diff = max_abs_diff(ours, reference);
        assert!(diff <= TOLERANCE, "{name}: max |diff| {diff}");
    }
    let embed = chunked.iter().find(|(n, _)| n == "model.embed_tokens.weight").expect("embedding trains");
    assert!(embed.1.abs().max().double_value(&[]) > 0.0);
}
