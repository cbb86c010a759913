//! Checkpoints: PEFT/HF safetensors writers, manifest, upload and fetch through object_store.

pub mod hf;
pub mod peft;
pub mod tensor_file;
