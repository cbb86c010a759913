//! Checkpoints: PEFT/HF safetensors writers, manifest, upload and fetch through object_store.

pub mod tensor_file;
