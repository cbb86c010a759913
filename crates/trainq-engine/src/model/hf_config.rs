//! A Hugging Face `config.json` (Qwen3, Qwen2, Llama) parsed with HF's field names, checked once
//! for what this crate can run, plus the tiny configs used by tests and the demo.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The architectures trainq runs, by HF `model_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// Qwen3: per-head RMSNorm on q and k (`q_norm`, `k_norm`), explicit `head_dim`.
    Qwen3,
    /// Qwen2 / Qwen2.5: bias on q, k and v projections.
    Qwen2,
    /// Llama 2/3: optional `attention_bias`/`mlp_bias`, optional llama3 rope scaling.
    Llama,
}

/// The fields of an HF `config.json` that shape the transformer (HF names); every other field is
/// kept in `extra`, so a config read and written back round-trips.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HfConfig {
    /// `qwen3`, `qwen2` or `llama`.
    pub model_type: String,
    /// Rows of `embed_tokens` and `lm_head`.
    pub vocab_size: i64,
    /// Width of the residual stream.
    pub hidden_size: i64,
    /// Width of the SwiGLU MLP.
    pub intermediate_size: i64,
    /// Decoder layers.
    pub num_hidden_layers: i64,
    /// Query heads.
    pub num_attention_heads: i64,
    /// Key/value heads (GQA); absent means `num_attention_heads`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_key_value_heads: Option<i64>,
    /// Per-head width; absent means `hidden_size / num_attention_heads`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<i64>,
    /// RMSNorm epsilon.
    #[serde(default = "default_rms_norm_eps")]
    pub rms_norm_eps: f64,
    /// Activation of the MLP gate; only `silu` is supported.
    #[serde(default = "default_hidden_act")]
    pub hidden_act: String,
    /// RoPE base (transformers ≤ 4 layout); `rope_parameters.rope_theta` wins when present.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_theta: Option<f64>,
    /// RoPE scaling (transformers ≤ 4 layout).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<RopeParameters>,
    /// RoPE base and scaling (transformers 5 layout).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_parameters: Option<RopeParameters>,
    /// `lm_head` shares `embed_tokens`' weight.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Bias on q/k/v/o projections (Qwen3, Llama; Qwen2 always has q/k/v bias).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_bias: Option<bool>,
    /// Bias on the MLP projections (Llama).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mlp_bias: Option<bool>,
    /// Sliding-window attention (Qwen2/Qwen3); must be off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub use_sliding_window: Option<bool>,
    /// Every other field of config.json, kept verbatim.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// RoPE settings: HF's `rope_parameters` (or the older `rope_scaling`) object.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RopeParameters {
    /// `default` or `llama3` (older configs say `type`).
    #[serde(default, alias = "type")]
    pub rope_type: Option<String>,
    /// RoPE base.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_theta: Option<f64>,
    /// llama3: frequency division factor.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub factor: Option<f64>,
    /// llama3: wavelengths above `original / low_freq_factor` are divided by `factor`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub low_freq_factor: Option<f64>,
    /// llama3: wavelengths below `original / high_freq_factor` are kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub high_freq_factor: Option<f64>,
    /// llama3: the context length the model was pretrained with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub original_max_position_embeddings: Option<f64>,
    /// Any other field, kept verbatim.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// How rotary frequencies are computed, resolved from either config layout.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeKind {
    /// Plain RoPE: `1 / theta^(2i/d)`.
    Default,
    /// Llama 3.1 frequency scaling.
    Llama3 {
        /// Division factor for low frequencies.
        factor: f64,
        /// Low-frequency boundary factor.
        low_freq_factor: f64,
        /// High-frequency boundary factor.
        high_freq_factor: f64,
        /// Pretraining context length.
        original_max_position_embeddings: f64,
    },
}

fn default_rms_norm_eps() -> f64 {
    1e-6
}

fn default_hidden_act() -> String {
    "silu".into()
}

impl HfConfig {
    /// Reads and checks `dir/config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(Error::io(&path))?;
        let cfg: HfConfig = serde_json::from_str(&text)
            .map_err(|e| Error::model(&path, format!("not a supported config.json: {e}")))?;
        cfg.check().map_err(|message| Error::model(&path, message))?;
        Ok(cfg)
    }

    /// The architecture, or why this config cannot run here.
    pub fn check(&self) -> std::result::Result<Architecture, String> {
        let arch = match self.model_type.as_str() {
            "qwen3" => Architecture::Qwen3,
            "qwen2" => Architecture::Qwen2,
            "llama" => Architecture::Llama,
            other => return Err(format!("model_type {other:?} is not supported (qwen3, qwen2, llama are)")),
        };
        if self.hidden_act != "silu" {
            return Err(format!("hidden_act {:?} is not supported (only silu)", self.hidden_act));
        }
        if self.use_sliding_window == Some(true) {
            return Err("use_sliding_window=true is not supported".into());
        }
        let positive = [self.vocab_size, self.hidden_size, self.intermediate_size, self.num_hidden_layers];
        if positive.iter().any(|&n| n <= 0) || self.num_attention_heads <= 0 || self.num_kv_heads() <= 0 {
            return Err("sizes and head counts must be positive".into());
        }
        if self.num_attention_heads % self.num_kv_heads() != 0 {
            return Err("num_attention_heads must be a multiple of num_key_value_heads".into());
        }
        if self.head_dim() <= 0 || self.head_dim() % 2 != 0 {
            return Err(format!("head_dim {} must be positive and even", self.head_dim()));
        }
        self.rope_kind()?;
        Ok(arch)
    }

    /// The architecture; call after [`HfConfig::check`] succeeded.
    pub fn architecture(&self) -> Architecture {
        match self.model_type.as_str() {
            "qwen2" => Architecture::Qwen2,
            "llama" => Architecture::Llama,
            _ => Architecture::Qwen3,
        }
    }

    /// Key/value heads.
    pub fn num_kv_heads(&self) -> i64 {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// Per-head width.
    pub fn head_dim(&self) -> i64 {
        self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// Whether q/k/v projections carry a bias.
    pub fn qkv_bias(&self) -> bool {
        self.architecture() == Architecture::Qwen2 || self.attention_bias == Some(true)
    }

    /// Whether the output projection carries a bias.
    pub fn o_bias(&self) -> bool {
        self.architecture() != Architecture::Qwen2 && self.attention_bias == Some(true)
    }

    /// Whether the MLP projections carry a bias.
    pub fn mlp_bias(&self) -> bool {
        self.architecture() == Architecture::Llama && self.mlp_bias == Some(true)
    }

    fn rope(&self) -> Option<&RopeParameters> {
        self.rope_parameters.as_ref().or(self.rope_scaling.as_ref())
    }

    /// RoPE base: `rope_parameters.rope_theta`, else `rope_theta`, else 10000.
    pub fn rope_theta(&self) -> f64 {
        self.rope().and_then(|r| r.rope_theta).or(self.rope_theta).unwrap_or(10_000.0)
    }

    /// The rotary-frequency rule, or why it is not supported.
    pub fn rope_kind(&self) -> std::result::Result<RopeKind, String> {
        let Some(rope) = self.rope() else { return Ok(RopeKind::Default) };
        match rope.rope_type.as_deref().unwrap_or("default") {
            "default" => Ok(RopeKind::Default),
            "llama3" => {
                let need = |v: Option<f64>, name: &str| v.ok_or_else(|| format!("llama3 rope scaling needs {name}"));
                Ok(RopeKind::Llama3 {
                    factor: need(rope.factor, "factor")?,
                    low_freq_factor: need(rope.low_freq_factor, "low_freq_factor")?,
                    high_freq_factor: need(rope.high_freq_factor, "high_freq_factor")?,
                    original_max_position_embeddings: need(
                        rope.original_max_position_embeddings,
                        "original_max_position_embeddings",
                    )?,
                })
            }
            other => Err(format!("rope_type {other:?} is not supported (default, llama3 are)")),
        }
    }
}

/// A small random-initializable Qwen3 for tests and the demo: 2 layers, hidden 64, 4 query heads
/// of 16 over 2 key/value heads, tied embeddings.
pub fn tiny_qwen3_config(vocab_size: i64) -> HfConfig {
    HfConfig {
        model_type: "qwen3".into(),
        vocab_size,
        hidden_size: 64,
        intermediate_size: 128,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: Some(2),
        head_dim: Some(16),
        rms_norm_eps: 1e-6,
        hidden_act: "silu".into(),
        rope_theta: None,
        rope_scaling: None,
        rope_parameters: Some(RopeParameters {
            rope_type: Some("default".into()),
            rope_theta: Some(10_000.0),
            factor: None,
            low_freq_factor: None,
            high_freq_factor: None,
            original_max_position_embeddings: None,
            extra: Default::default(),
        }),
        tie_word_embeddings: true,
        attention_bias: Some(false),
        mlp_bias: None,
        use_sliding_window: Some(false),
        extra: serde_json::json!({"architectures": ["Qwen3ForCausalLM"], "max_position_embeddings": 4096})
            .as_object()
            .cloned()
            .unwrap_or_default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: serde_json::Value) -> HfConfig {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn the_tiny_config_passes_its_own_checks() {
        assert_eq!(tiny_qwen3_config(100).check(), Ok(Architecture::Qwen3));
    }

    #[test]
    fn old_and_new_rope_layouts_give_the_same_settings() {
        let base = serde_json::json!({"model_type": "llama", "vocab_size": 8, "hidden_size": 8,
            "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2});
        let llama3 = serde_json::json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
        let mut old = base.clone();
        old["rope_theta"] = 500000.0.into();
        old["rope_scaling"] = llama3.clone();
        let mut new = base;
        let mut params = llama3;
        params["rope_theta"] = 500000.0.into();
        new["rope_parameters"] = params;
        let (old, new) = (parse(old), parse(new));
        assert_eq!(old.rope_theta(), 500000.0);
        assert_eq!(new.rope_theta(), 500000.0);
        assert_eq!(old.rope_kind(), new.rope_kind());
        assert!(matches!(new.rope_kind(), Ok(RopeKind::Llama3 { factor, .. }) if factor == 8.0));
    }

    #[test]
    fn unsupported_configs_say_what_is_wrong() {
        let mut cfg = tiny_qwen3_config(10);
        cfg.model_type = "mixtral".into();
        assert!(cfg.check().unwrap_err().contains("mixtral"));
        let mut cfg = tiny_qwen3_config(10);
        cfg.num_key_value_heads = Some(3);
        assert!(cfg.check().unwrap_err().contains("multiple"));
    }

    #[test]
    fn a_config_round_trips_through_json_with_unknown_fields_kept() {
        let cfg = tiny_qwen3_config(10);
        let back: HfConfig = serde_json::from_value(serde_json::to_value(&cfg).unwrap()).unwrap();
        assert_eq!(back, cfg);
        assert_eq!(back.extra["max_position_embeddings"], 4096);
    }
}
