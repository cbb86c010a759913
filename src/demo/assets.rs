//! The demo's tiny tokenizer, built in-process: one token per character plus ChatML specials.
//!
//! Written as an ordinary `tokenizer.json` + `tokenizer_config.json` (with a ChatML chat
//! template), so the demo model directory goes through the same loading code as a real model.

use std::path::Path;

use serde_json::{json, Value};

use crate::error::Result;
use trainq_engine::Error as EngineError;

/// Special tokens, in id order from 0.
pub const SPECIAL_TOKENS: [&str; 4] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"];
/// Ordinary characters, in id order after the specials.
pub const CHARACTERS: &str = "abcdefghijklmnopqrstuvwxyz0123456789 \n.,?!:-";
/// The model's vocabulary size: the tokens above, rounded up to a multiple of 16.
pub const VOCAB_SIZE: i64 = 64;

/// ChatML, as Qwen models use it (without the thinking blocks).
pub const CHAT_TEMPLATE: &str = "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

/// The `tokenizer.json` document: WordLevel over single characters, specials as added tokens.
pub fn tokenizer_json() -> Value {
    let mut vocab = serde_json::Map::new();
    for (id, token) in SPECIAL_TOKENS.iter().enumerate() {
        vocab.insert(token.to_string(), json!(id));
    }
    for (i, c) in CHARACTERS.chars().enumerate() {
        vocab.insert(c.to_string(), json!(SPECIAL_TOKENS.len() + i));
    }
    let added: Vec<Value> = SPECIAL_TOKENS
        .iter()
        .enumerate()
        .map(|(id, t)| {
            json!({"id": id, "content": t, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "[\\s\\S]"},
                          "behavior": "Isolated", "invert": false},
        "post_processor": null,
        "decoder": {"type": "Fuse"},
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    })
}

/// The `tokenizer_config.json` document: chat template and special tokens.
pub fn tokenizer_config_json() -> Value {
    json!({
        "chat_template": CHAT_TEMPLATE,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": null,
        "add_bos_token": false,
        "model_max_length": 512
    })
}

/// Writes both tokenizer files into `dir`.
pub fn write_tokenizer(dir: &Path) -> Result<()> {
    for (name, doc) in [("tokenizer.json", tokenizer_json()), ("tokenizer_config.json", tokenizer_config_json())] {
        let path = dir.join(name);
        let text = serde_json::to_string_pretty(&doc).map_err(EngineError::json(name))?;
        std::fs::write(&path, text).map_err(EngineError::io(&path))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tokenizer_splits_characters_and_keeps_specials_whole() {
        let dir = tempfile::tempdir().unwrap();
        write_tokenizer(dir.path()).unwrap();
        let tok = tokenizers::Tokenizer::from_file(dir.path().join("tokenizer.json")).unwrap();
        let enc = tok.encode("<|im_start|>user\nhi 42<|im_end|>", false).unwrap();
        let ids = enc.get_ids();
        assert_eq!(ids[0], 1, "{ids:?}");
        assert_eq!(*ids.last().unwrap(), 2, "{ids:?}");
        assert_eq!(ids.len(), 1 + 5 + 5 + 1, "{ids:?}");
        assert_eq!(tok.decode(&ids[1..ids.len() - 1], false).unwrap(), "user\nhi 42");
        assert!((SPECIAL_TOKENS.len() + CHARACTERS.chars().count()) as i64 <= VOCAB_SIZE);
    }
}
