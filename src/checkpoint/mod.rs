//! Checkpoints: PEFT/HF safetensors writers, manifest, upload and fetch through object_store.
