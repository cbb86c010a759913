//! Weight checkpoints on local disk: a PEFT adapter (`adapter_model.safetensors` +
//! `adapter_config.json`) or a whole model in Hugging Face layout, plus the optimizer state for
//! resume. (Activation checkpointing — recomputing layers in backward — is
//! `model::activation_checkpointing`, a different thing.) Uploading is the queue side's
//! `trainq_queue::storage`.

pub mod hf;
pub mod io;
pub mod peft;
pub mod tensor_file;
