//! Saving and restoring what a step changes: the trainable weights (a PEFT adapter, or the whole
//! model in HF layout for a full fine-tune) and the optimizer state, in one checkpoint directory.

use std::path::Path;

use crate::checkpoint::hf::{copy_tokenizer_files, save_full};
use crate::checkpoint::peft::{load_adapter, save_adapter};
use crate::checkpoint::tensor_file::{load_tensors, save_tensors};
use crate::error::Result;
use crate::model::Policy;
use crate::train::Trainer;
use trainq_queue::storage::CheckpointFormat;

/// File holding the AdamW moments and step count, next to the weights.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";

/// Writes the policy's trainable weights and the optimizer state into `dir`; `base` is the base
/// model's directory, recorded in the adapter config; a full fine-tune's checkpoint also gets the
/// base model's tokenizer files, so that an inference server loads the directory as it is.
pub fn save(policy: &Policy, trainer: &Trainer, dir: &Path, base: &str) -> Result<CheckpointFormat> {
    let format = if policy.lora_config().is_some() {
        save_adapter(policy, dir, base)?;
        CheckpointFormat::PeftLora
    } else {
        save_full(policy, dir)?;
        copy_tokenizer_files(Path::new(base), dir)?;
        CheckpointFormat::HfFull
    };
    save_tensors(&dir.join(OPTIMIZER_FILE), &trainer.optimizer().named_state())?;
    Ok(format)
}

/// Loads weights and optimizer state written by [`save`] into a freshly loaded policy (a full
/// fine-tune's checkpoint is a whole model: the policy is reloaded from it).
pub fn load(policy: &mut Policy, trainer: &mut Trainer, dir: &Path) -> Result<()> {
    match policy.lora_config() {
        Some(_) => load_adapter(policy, dir)?,
        None => {
            let (checkpointing, offloading) = (policy.activation_checkpointing(), policy.activation_offloading());
            let keep_mlp = policy.keep_mlp_activations();
            *policy = Policy::load(dir, None, policy.device())?;
            policy.set_activation_checkpointing(checkpointing);
            policy.set_activation_offloading(offloading);
            policy.set_keep_mlp_activations(keep_mlp);
        }
    }
    let optimizer = dir.join(OPTIMIZER_FILE);
    if optimizer.is_file() {
        let state = load_tensors(&optimizer, policy.device())?;
        trainer.optimizer_mut().load_named_state(&state, &policy.trainable_variables())?;
    }
    Ok(())
}
