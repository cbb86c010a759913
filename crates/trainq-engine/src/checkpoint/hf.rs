//! Full fine-tunes in Hugging Face layout: `model.safetensors` + `config.json` (+ the base
//! model's tokenizer files), loadable by transformers, vLLM and [`Policy::load`].

use std::path::Path;

use tch::Kind;

use super::tensor_file::save_tensors;
use crate::error::{Error, Result};
use crate::model::{is_lora_name, Policy};

/// The weights file of a single-file HF checkpoint.
pub const MODEL_WEIGHTS_FILE: &str = "model.safetensors";
/// Tokenizer and generation files copied from the base model next to the weights, when present.
pub const TOKENIZER_FILES: [&str; 7] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
];

/// Writes the policy's base weights (HF keys; a tied `lm_head` is not repeated) and its
/// `config.json`, with `dtype` set to the weights' dtype, to `dir` (created if needed).
pub fn save_full(policy: &Policy, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(Error::io(dir))?;
    let tensors: Vec<_> = policy.named_variables().into_iter().filter(|(name, _)| !is_lora_name(name)).collect();
    save_tensors(&dir.join(MODEL_WEIGHTS_FILE), &tensors)?;
    let mut config = serde_json::to_value(policy.hf_config()).map_err(Error::json("config.json"))?;
    let dtype = match policy.kind() {
        Kind::BFloat16 => "bfloat16",
        Kind::Half => "float16",
        _ => "float32",
    };
    config["dtype"] = dtype.into();
    if config.get("torch_dtype").is_some() {
        config["torch_dtype"] = dtype.into();
    }
    let path = dir.join("config.json");
    let text = serde_json::to_string_pretty(&config).map_err(Error::json("config.json"))?;
    std::fs::write(&path, text).map_err(Error::io(&path))
}

/// Copies the [`TOKENIZER_FILES`] that exist in `from` into `to`; returns the names copied.
pub fn copy_tokenizer_files(from: &Path, to: &Path) -> Result<Vec<String>> {
    let mut copied = Vec::new();
    for name in TOKENIZER_FILES {
        let src = from.join(name);
        if src.exists() {
            std::fs::copy(&src, to.join(name)).map_err(Error::io(&src))?;
            copied.push(name.to_string());
        }
    }
    Ok(copied)
}
