//! The tch transformer (Qwen3, Qwen2, Llama), LoRA adapters, chunked log-probs and the policy loss.

pub mod loss;
