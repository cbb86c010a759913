//! LoRA adapters in PEFT's layout: `adapter_model.safetensors` (keys
//! `base_model.model.<HF module>.lora_A.weight`) and `adapter_config.json`, as
//! `peft.PeftModel.from_pretrained` and vLLM load them; written from and read into a [`Policy`].

use std::collections::HashMap;
use std::path::Path;

use serde_json::{json, Value};
use tch::Device;

use super::tensor_file::save_tensors;
use crate::error::{Error, Result};
use crate::model::weights::fill_variables;
use crate::model::Policy;
use trainq_queue::config::LoraConfig;

/// The adapter weights file.
pub const ADAPTER_WEIGHTS_FILE: &str = "adapter_model.safetensors";
/// The adapter config file.
pub const ADAPTER_CONFIG_FILE: &str = "adapter_config.json";
/// PEFT's prefix in front of the HF module path.
pub const PEFT_KEY_PREFIX: &str = "base_model.model.";

/// Writes the policy's LoRA weights and config to `dir` (created if needed).
/// `base_model_name_or_path` goes into `adapter_config.json` for tools that resolve the base.
pub fn save_adapter(policy: &Policy, dir: &Path, base_model_name_or_path: &str) -> Result<()> {
    let lora = policy.lora_config().ok_or_else(|| {
        Error::config("lora", "this policy has no LoRA adapters (full fine-tune); save it in HF layout")
    })?;
    std::fs::create_dir_all(dir).map_err(Error::io(dir))?;
    let tensors: Vec<(String, tch::Tensor)> =
        policy.lora_variables().into_iter().map(|(name, t)| (format!("{PEFT_KEY_PREFIX}{name}"), t)).collect();
    save_tensors(&dir.join(ADAPTER_WEIGHTS_FILE), &tensors)?;
    let config = adapter_config_json(lora, base_model_name_or_path);
    let path = dir.join(ADAPTER_CONFIG_FILE);
    let text = serde_json::to_string_pretty(&config).map_err(Error::json("adapter_config.json"))?;
    std::fs::write(&path, text).map_err(Error::io(&path))
}

/// The `adapter_config.json` PEFT expects for `lora`.
pub fn adapter_config_json(lora: &LoraConfig, base_model_name_or_path: &str) -> Value {
    json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": 0.0,
        "target_modules": lora.target_modules,
        "bias": "none",
        "fan_in_fan_out": false,
        "inference_mode": true,
        "init_lora_weights": true,
        "use_rslora": false,
        "use_dora": false,
        "modules_to_save": null,
        "layers_to_transform": null,
        "layers_pattern": null,
        "rank_pattern": {},
        "alpha_pattern": {},
    })
}

/// Reads `dir/adapter_config.json` as a [`LoraConfig`], refusing PEFT features trainq does not
/// implement (DoRA, rsLoRA, per-module ranks, bias training, modules_to_save, regex targets).
pub fn read_adapter_config(dir: &Path) -> Result<LoraConfig> {
    let path = dir.join(ADAPTER_CONFIG_FILE);
    let text = std::fs::read_to_string(&path).map_err(Error::io(&path))?;
    let cfg: Value = serde_json::from_str(&text).map_err(Error::json(path.display().to_string()))?;
    let refuse = |m: &str| Err(Error::model(&path, m.to_string()));
    if cfg["peft_type"] != "LORA" {
        return refuse("peft_type must be LORA");
    }
    let unset =
        |k: &str| matches!(&cfg[k], Value::Null | Value::Bool(false)) || cfg[k] == json!({}) || cfg[k] == json!([]);
    for key in [
        "use_dora",
        "use_rslora",
        "modules_to_save",
        "rank_pattern",
        "alpha_pattern",
        "layers_to_transform",
        "fan_in_fan_out",
    ] {
        if !unset(key) {
            return refuse(&format!("{key} is not supported"));
        }
    }
    if !(cfg["bias"].is_null() || cfg["bias"] == "none") {
        return refuse("bias must be none");
    }
    let Some(rank) = cfg["r"].as_i64() else { return refuse("r must be an integer") };
    let Some(alpha) = cfg["lora_alpha"].as_f64() else { return refuse("lora_alpha must be a number") };
    let Some(targets) = cfg["target_modules"].as_array() else {
        return refuse("target_modules must be a list of module names");
    };
    let target_modules = targets.iter().filter_map(|t| t.as_str().map(String::from)).collect();
    Ok(LoraConfig { rank, alpha, target_modules })
}

/// Copies the adapter weights in `dir` into `policy`, whose LoRA config must match the adapter's.
pub fn load_adapter(policy: &Policy, dir: &Path) -> Result<()> {
    let adapter = read_adapter_config(dir)?;
    let ours = policy.lora_config().ok_or_else(|| Error::model(dir, "the policy has no LoRA adapters"))?;
    let same_targets = {
        let (mut a, mut b) = (adapter.target_modules.clone(), ours.target_modules.clone());
        a.sort();
        b.sort();
        a == b
    };
    if adapter.rank != ours.rank || adapter.alpha != ours.alpha || !same_targets {
        return Err(Error::model(dir, format!("adapter config {adapter:?} differs from the policy's {ours:?}")));
    }
    let vars: HashMap<String, tch::Tensor> = policy.lora_variables().into_iter().collect();
    fill_variables(&vars, &[dir.join(ADAPTER_WEIGHTS_FILE)], |key| {
        let name = key.strip_prefix(PEFT_KEY_PREFIX).unwrap_or(key);
        Some(name.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B."))
    })
}

/// Loads the base model in `model_dir` with the adapter in `adapter_dir` on top.
pub fn load_policy_with_adapter(model_dir: &Path, adapter_dir: &Path, device: Device) -> Result<Policy> {
    let lora = read_adapter_config(adapter_dir)?;
    let policy = Policy::load(model_dir, Some(&lora), device)?;
    load_adapter(&policy, adapter_dir)?;
    Ok(policy)
}
