//! Our transformer against transformers on tiny random Qwen3, Qwen2 and Llama (llama3 rope)
//! checkpoints: logits and per-token log-probs within 1e-4 in f32, unpacked and packed.

mod reference;

use tch::Device;
use trainq_engine::model::Policy;

use reference::{max_abs_diff, tensor, TOLERANCE};

fn check_parity(model: &str, weights_dir: &str) {
    let dir = reference::dir();
    let policy = Policy::load(&dir.join(weights_dir), None, Device::Cpu).unwrap();
    let file = dir.join(format!("{model}_reference.safetensors"));
    for prefix in ["", "packed_"] {
        let ids = tensor(&file, &format!("{prefix}input_ids"));
        let pos = tensor(&file, &format!("{prefix}position_ids"));
        let targets = tensor(&file, &format!("{prefix}targets"));
        let logits = policy.logits(&ids, &pos).unwrap();
        let diff = max_abs_diff(&logits, &tensor(&file, &format!("{prefix}logits")));
        assert!(diff < TOLERANCE, "{model} {prefix}logits differ by {diff}");
        let lp = policy.token_logprobs(&ids, &pos, &targets).unwrap();
        let diff = max_abs_diff(&lp, &tensor(&file, &format!("{prefix}logprobs")));
        assert!(diff < TOLERANCE, "{model} {prefix}logprobs differ by {diff}");
    }
}

#[test]
fn qwen3_matches_transformers_unpacked_and_packed() {
    check_parity("qwen3", "qwen3");
}

#[test]
fn qwen2_with_qkv_bias_and_tied_embeddings_matches_transformers() {
    check_parity("qwen2", "qwen2");
}

#[test]
fn llama_with_llama3_rope_scaling_matches_transformers() {
    check_parity("llama3", "llama3");
}

#[test]
fn a_sharded_checkpoint_loads_and_gives_the_same_logits() {
    check_parity("qwen3", "qwen3_sharded");
}

#[test]
fn unsupported_configs_are_refused_at_load_with_the_reason() {
    let dir = reference::dir();
    for (name, needle) in [
        ("unsupported_activation", "hidden_act"),
        ("unsupported_rope", "yarn"),
        ("unsupported_architecture", "mixtral"),
    ] {
        let err = Policy::load(&dir.join(name), None, Device::Cpu).unwrap_err().to_string();
        assert!(err.contains(needle) && err.contains("config.json"), "{name}: {err}");
    }
}

#[test]
fn a_packed_row_never_attends_across_documents() {
    // Changing the first document must leave the second document's log-probs unchanged.
    let dir = reference::dir();
    let policy = Policy::load(&dir.join("qwen3"), None, Device::Cpu).unwrap();
    let file = dir.join("qwen3_reference.safetensors");
    let ids = tensor(&file, "packed_input_ids");
    let pos = tensor(&file, "packed_position_ids");
    let targets = tensor(&file, "packed_targets");
    let before = policy.token_logprobs(&ids, &pos, &targets).unwrap();
    let changed = ids.copy();
    let _ = changed.get(0).narrow(0, 0, 5).fill_(7);
    let after = policy.token_logprobs(&changed, &pos, &targets).unwrap();
    let tail = |t: &tch::Tensor| t.get(0).narrow(0, 5, 7);
    assert!(max_abs_diff(&tail(&before), &tail(&after)) < 1e-6);
    assert!(max_abs_diff(&before.get(0).narrow(0, 0, 4), &after.get(0).narrow(0, 0, 4)) > 1e-3);
}
