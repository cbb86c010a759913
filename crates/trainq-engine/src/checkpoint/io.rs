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
            let memory = policy.memory_settings();
            *policy = Policy::load(dir, None, policy.device())?;
            policy.set_memory_settings(memory);
        }
    }
    let optimizer = dir.join(OPTIMIZER_FILE);
    if optimizer.is_file() {
        let state = load_tensors(&optimizer, policy.device())?;
        trainer.optimizer_mut().load_named_state(&state, &policy.trainable_variables())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{tiny_qwen3_config, MemorySettings};
    use tch::Device;
    use trainq_queue::config::TrainConfig;

    /// A full fine-tune's checkpoint replaces the whole policy; the run's memory settings stay.
    #[test]
    fn loading_a_full_checkpoint_keeps_the_memory_settings() {
        let mut policy = Policy::from_config(&tiny_qwen3_config(64), None, Device::Cpu, 0).unwrap();
        let settings =
            MemorySettings { activation_checkpointing: true, activation_offloading: true, keep_mlp_activations: true };
        policy.set_memory_settings(settings);
        let mut trainer = Trainer::new(&TrainConfig::default(), Device::Cpu);
        let dir = tempfile::tempdir().unwrap();
        save(&policy, &trainer, dir.path(), "/nonexistent-base").unwrap();
        // No step was taken, so there are no moments to restore; the weights are what matter here.
        std::fs::remove_file(dir.path().join(OPTIMIZER_FILE)).unwrap();
        load(&mut policy, &mut trainer, dir.path()).unwrap();
        assert_eq!(policy.memory_settings(), settings);
        assert_ne!(Policy::load(dir.path(), None, Device::Cpu).unwrap().memory_settings(), settings);
    }
}
