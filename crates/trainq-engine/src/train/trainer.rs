//! The optimizer step: gradient accumulation over micro-batches, grad clipping, AdamW.

use tch::{Device, Tensor};
use tokio_util::sync::CancellationToken;

use super::adamw::{AdamW, PreparedUpdate};
use super::batch_tensors::to_tensors;
use super::PolicyModel;
use crate::error::{Error, Result};
use crate::model::loss::{policy_loss, LossInputs, LossOutput};
use crate::tokenize::MicroBatch;
use trainq_queue::config::{LossConfig, LossNormalization, TrainConfig};

/// What one step did, for the step record and logs.
#[derive(Debug, Clone, PartialEq)]
pub struct StepMetrics {
    /// Total loss (policy + kl_coef·kl).
    pub loss: f64,
    /// Policy part of the loss.
    pub policy_loss: f64,
    /// k3 KL estimate to the base model (before kl_coef); 0 when off.
    pub kl: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Learning rate used.
    pub lr: f64,
    /// Trained tokens.
    pub tokens: usize,
    /// Packed trajectories.
    pub sequences: usize,
    /// Micro-batches (forward/backward passes).
    pub micro_batches: usize,
    /// Share of trained tokens whose ratio was clipped.
    pub clip_fraction: f64,
    /// Mean importance ratio over trained tokens.
    pub mean_ratio: f64,
}

/// Runs optimizer steps of one policy.
#[derive(Debug)]
pub struct Trainer {
    loss: LossConfig,
    max_grad_norm: f64,
    optimizer: AdamW,
    device: Device,
    /// Checked between micro-batches: a cancelled step stops before the next one.
    cancel: Option<CancellationToken>,
}

impl Trainer {
    /// A trainer for `cfg`'s loss and optimizer settings, computing on `device`.
    pub fn new(cfg: &TrainConfig, device: Device) -> Self {
        Self {
            loss: cfg.loss.clone(),
            max_grad_norm: cfg.optimizer.max_grad_norm,
            optimizer: AdamW::new(cfg.optimizer.clone()),
            device,
            cancel: None,
        }
    }

    /// The optimizer (its state is saved with checkpoints).
    pub fn optimizer(&self) -> &AdamW {
        &self.optimizer
    }

    /// Mutable optimizer, to restore state or change the learning rate.
    pub fn optimizer_mut(&mut self) -> &mut AdamW {
        &mut self.optimizer
    }

    /// One full step on this rank's micro-batches: accumulate, clip, update.
    pub fn step(&mut self, model: &mut impl PolicyModel, batches: &[MicroBatch]) -> Result<StepMetrics> {
        let normalizer = self.normalizer(batches);
        let totals = self.accumulate_gradients(model, batches, normalizer)?;
        let update = self.prepare_update(&model.trainable_variables())?;
        // The step's one device→host read, the norm and the loss totals together, comes before
        // the AdamW launch: nothing waits for the update, and the next step's host work (and
        // launches) overlap it.
        let parts = [
            &update.norm,
            &totals.loss,
            &totals.policy_loss,
            &totals.kl,
            &totals.tokens,
            &totals.clipped_tokens,
            &totals.ratio_sum,
        ];
        let [grad_norm, loss, policy_loss, kl, tokens, clipped, ratio_sum] = read_scalars(parts)?;
        self.apply_update(update, grad_norm)?;
        Ok(StepMetrics {
            loss,
            policy_loss,
            kl,
            grad_norm,
            lr: self.optimizer.learning_rate(),
            tokens: tokens as usize,
            sequences: batches.iter().map(MicroBatch::num_sequences).sum(),
            micro_batches: batches.len(),
            clip_fraction: clipped / tokens.max(1.0),
            mean_ratio: ratio_sum / tokens.max(1.0),
        })
    }

    /// This rank's share of the loss normalizer: trained tokens (token mean) or trained
    /// sequences (sequence mean). Data-parallel callers sum it over ranks.
    pub fn normalizer(&self, batches: &[MicroBatch]) -> f64 {
        let count: usize = match self.loss.normalization {
            LossNormalization::TokenMean => batches.iter().map(MicroBatch::trained_tokens).sum(),
            LossNormalization::SequenceMean => batches.iter().map(MicroBatch::trained_sequences).sum(),
        };
        count as f64
    }

    /// Drops the gradients, then runs forward and backward over every micro-batch with the
    /// global `normalizer`, leaving the summed gradients on the trainable variables. Returns the
    /// loss parts summed over the micro-batches (detached, still on the device).
    pub fn accumulate_gradients(
        &self,
        model: &mut impl PolicyModel,
        batches: &[MicroBatch],
        normalizer: f64,
    ) -> Result<LossOutput> {
        if normalizer <= 0.0 {
            return Err(Error::Tokenize("the step has no trained tokens".into()));
        }
        super::gradients::clear(&model.trainable_variables())?;
        model.set_logit_temperature(self.loss.sampler_temperature);
        let mut totals = LossOutput::zeros(self.device);
        for batch in batches {
            if self.cancel.as_ref().is_some_and(CancellationToken::is_cancelled) {
                return Err(Error::Cancelled);
            }
            let t = to_tensors(batch, self.device)?;
            let reference = if self.loss.kl_coef > 0.0 {
                model.set_lora_enabled(false);
                let reference = tch::no_grad(|| model.batch_logprobs(&t));
                model.set_lora_enabled(true);
                Some(reference?.detach())
            } else {
                None
            };
            let logprobs = model.batch_logprobs(&t)?;
            let inputs = LossInputs {
                logprobs: &logprobs,
                sampler_logprobs: &t.sampler_logprobs,
                advantages: &t.advantages,
                mask: &t.loss_mask,
                sequence_index: &t.sequence_index,
                num_sequences: t.num_sequences,
                reference_logprobs: reference.as_ref(),
            };
            let out = policy_loss(&inputs, &self.loss, normalizer)?;
            out.loss.f_backward().map_err(Error::torch("backward of the policy loss"))?;
            model.finish_backward()?;
            totals.add_detached(&out);
        }
        Ok(totals)
    }

    /// The token checked between micro-batches of [`Trainer::accumulate_gradients`] (None: never
    /// cancelled). The engine sets it for the duration of one step.
    pub fn set_cancel(&mut self, cancel: Option<CancellationToken>) {
        self.cancel = cancel;
    }

    /// Gathers the gradients of `params` and launches their global norm (no device read): the
    /// first half of the update, see [`AdamW::prepare_update`].
    pub fn prepare_update(&mut self, params: &[Tensor]) -> Result<PreparedUpdate> {
        self.optimizer.prepare_update(params)
    }

    /// Clips to the configured global norm (`norm` is the value of `update.norm`, read by the
    /// caller) and applies AdamW. The `.grad()` tensors are left as they were (clipping scales
    /// the optimizer's flat copy).
    pub fn apply_update(&mut self, update: PreparedUpdate, norm: f64) -> Result<()> {
        self.optimizer.apply_update(update, norm, self.max_grad_norm)
    }
}

/// Scalar tensors (any float kind, on one device) read as f64 in one device→host copy.
fn read_scalars<const N: usize>(parts: [&Tensor; N]) -> Result<[f64; N]> {
    let read = || -> tch::Result<Vec<f64>> {
        let device = parts.last().map_or(Device::Cpu, |t| t.device());
        let parts = parts
            .iter()
            .map(|t| t.f_to_device(device)?.f_to_kind(tch::Kind::Double)?.f_reshape([1]))
            .collect::<tch::Result<Vec<_>>>()?;
        Vec::<f64>::try_from(Tensor::f_cat(&parts, 0)?.f_to_device(Device::Cpu)?)
    };
    let values = read().map_err(Error::torch("read the step's loss totals and gradient norm"))?;
    values.try_into().map_err(|v: Vec<f64>| Error::model("step totals", format!("read {} values", v.len())))
}
