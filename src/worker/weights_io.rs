//! Saving and restoring what a step changes: the trainable weights (a PEFT adapter, or the whole
//! model in HF layout for a full fine-tune) and the optimizer state, in one checkpoint directory.

use std::path::Path;

use crate::checkpoint::{self, CheckpointFormat};
use crate::error::Result;
use crate::model::Policy;
use crate::train::Trainer;

/// File holding the AdamW moments and step count, next to the weights.
pub(crate) const OPTIMIZER_FILE: &str = "optimizer.safetensors";

/// Writes the policy's trainable weights and the optimizer state into `dir`.
pub(crate) fn save(policy: &Policy, trainer: &Trainer, dir: &Path) -> Result<CheckpointFormat> {
    let format = if policy.lora_config().is_some() {
        checkpoint::save_adapter(policy, dir)?;
        CheckpointFormat::PeftLora
    } else {
        checkpoint::save_hf_model(policy, dir)?;
        CheckpointFormat::HfFull
    };
    checkpoint::save_tensors(&dir.join(OPTIMIZER_FILE), &trainer.optimizer().named_state())?;
    Ok(format)
}

/// Loads weights and optimizer state written by [`save`] into a freshly loaded policy.
pub(crate) fn load(policy: &mut Policy, trainer: &mut Trainer, dir: &Path) -> Result<()> {
    if policy.lora_config().is_some() {
        checkpoint::load_adapter(policy, dir)?;
    } else {
        checkpoint::load_hf_weights(policy, dir)?;
    }
    let optimizer = dir.join(OPTIMIZER_FILE);
    if optimizer.is_file() {
        let state = checkpoint::load_tensors(&optimizer, policy.device())?;
        trainer.optimizer_mut().load_named_state(&state, &policy.trainable_variables())?;
    }
    Ok(())
}
