//! The tch transformer (Qwen3, Qwen2, Llama), LoRA adapters, chunked log-probs and the policy loss.
//!
//! [`Policy`] is the entry point: [`Policy::load`] an HF directory (or [`Policy::from_config`]
//! for a random model), then [`Policy::token_logprobs`] for training and scoring. See
//! docs/model.md.

mod activation_checkpointing;
mod cudnn_varlen;
mod flash_varlen;
mod fused_linear;
mod fused_ops;
pub mod hf_config;
mod layers;
pub mod logprobs;
pub mod loss;
pub(crate) mod offload;
pub mod policy;
mod transformer;
pub mod weights;

pub use hf_config::{tiny_qwen3_config, Architecture, HfConfig};
pub use policy::{default_kind, is_lora_name, BatchSummary, MemorySettings, Policy};
pub use transformer::{packed_attention_kernel, segment_lengths, PackedAttention};
