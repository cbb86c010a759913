//! One synchronized optimizer step over all ranks.
//!
//! [`Trainer::step`] runs the forward/backward of every packed micro-batch through a
//! [`PolicyModel`], accumulating gradients of one globally normalized policy loss
//! ([`crate::model::loss`]), clips the global gradient norm and applies [`AdamW`]. Data-parallel
//! callers use its parts: [`Trainer::normalizer`] summed over ranks,
//! [`Trainer::accumulate_gradients`], an all-reduce of the gradients, [`Trainer::prepare_update`]
//! (the global norm, on the device), one read of the norm with the summed metrics, then
//! [`Trainer::apply_update`].

pub mod adamw;
pub mod batch_tensors;
pub mod data_parallel;
mod flat_params;
pub mod gradients;
pub mod ranks;
pub mod trainer;

pub use adamw::{clip_grad_norm, AdamW, PreparedUpdate};
pub use batch_tensors::{to_tensors, MicroBatchTensors};
pub use data_parallel::{agree_on_success, copy_from_rank_zero, data_parallel_step};
pub use flat_params::BUCKET_ELEMENTS;
pub use ranks::{RankGroup, RankReplica};
pub use trainer::{StepMetrics, Trainer};

use tch::Tensor;

use crate::error::Result;

/// What the trainer needs from a model (the engine's policy implements it).
pub trait PolicyModel {
    /// Log-prob of each target under the model: inputs are i64 `[B, L]` (input ids, position
    /// ids restarting at 0 per packed document, next-token targets); output f32 `[B, L]`.
    fn token_logprobs(&self, input_ids: &Tensor, position_ids: &Tensor, targets: &Tensor) -> Result<Tensor>;

    /// [`PolicyModel::token_logprobs`] of a micro-batch already on the device; a model may use
    /// the batch's host-side summary to avoid device→host syncs.
    fn batch_logprobs(&self, batch: &MicroBatchTensors) -> Result<Tensor> {
        self.token_logprobs(&batch.input_ids, &batch.position_ids, &batch.targets)
    }

    /// Called right after each micro-batch's `loss.backward()`: a model with activation
    /// checkpointing completes its gradients here. The default does nothing.
    fn finish_backward(&mut self) -> Result<()> {
        Ok(())
    }

    /// The tensors the optimizer updates (LoRA A/B, or every weight), in a stable order.
    fn trainable_variables(&self) -> Vec<Tensor>;

    /// Turns the LoRA adapters off (the base model, the KL reference) or back on.
    fn set_lora_enabled(&mut self, enabled: bool);

    /// Sets the temperature log-probs are taken at (logits divided by it before the softmax),
    /// so they compare with a sampler that drew at that temperature.
    fn set_logit_temperature(&mut self, temperature: f64);
}

impl PolicyModel for crate::model::Policy {
    fn token_logprobs(&self, input_ids: &Tensor, position_ids: &Tensor, targets: &Tensor) -> Result<Tensor> {
        crate::model::Policy::token_logprobs(self, input_ids, position_ids, targets)
    }

    fn batch_logprobs(&self, b: &MicroBatchTensors) -> Result<Tensor> {
        self.token_logprobs_summarized(&b.input_ids, &b.position_ids, &b.targets, &b.summary)
    }

    fn finish_backward(&mut self) -> Result<()> {
        crate::model::Policy::finish_backward(self)
    }

    fn trainable_variables(&self) -> Vec<Tensor> {
        crate::model::Policy::trainable_variables(self)
    }

    fn set_lora_enabled(&mut self, enabled: bool) {
        crate::model::Policy::set_lora_enabled(self, enabled)
    }

    fn set_logit_temperature(&mut self, temperature: f64) {
        crate::model::Policy::set_logit_temperature(self, temperature)
    }
}
