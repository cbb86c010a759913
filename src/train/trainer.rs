//! The optimizer step: gradient accumulation over micro-batches, grad clipping, AdamW.

use tch::{Device, Tensor};

use super::adamw::{clip_grad_norm, AdamW};
use super::batch_tensors::to_tensors;
use super::PolicyModel;
use crate::config::{LossConfig, LossNormalization, TrainConfig};
use crate::error::{Error, Result};
use crate::model::loss::{policy_loss, LossInputs, LossOutput};
use crate::tokenize::MicroBatch;

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
}

impl Trainer {
    /// A trainer for `cfg`'s loss and optimizer settings, computing on `device`.
    pub fn new(cfg: &TrainConfig, device: Device) -> Self {
        Self {
            loss: cfg.loss.clone(),
            max_grad_norm: cfg.optimizer.max_grad_norm,
            optimizer: AdamW::new(cfg.optimizer.clone()),
            device,
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
        let grad_norm = self.apply_gradients(&model.trainable_variables())?;
        let tokens = totals.tokens.double_value(&[]);
        Ok(StepMetrics {
            loss: totals.loss.double_value(&[]),
            policy_loss: totals.policy_loss.double_value(&[]),
            kl: totals.kl.double_value(&[]),
            grad_norm,
            lr: self.optimizer.learning_rate(),
            tokens: tokens as usize,
            sequences: batches.iter().map(MicroBatch::num_sequences).sum(),
            micro_batches: batches.len(),
            clip_fraction: totals.clip_fraction(),
            mean_ratio: totals.mean_ratio(),
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

    /// Zeroes the gradients, then runs forward and backward over every micro-batch with the
    /// global `normalizer`, leaving the summed gradients on the trainable variables. Returns the
    /// loss parts summed over the micro-batches (detached, still on the device).
    pub fn accumulate_gradients(&self, model: &mut impl PolicyModel, batches: &[MicroBatch], normalizer: f64) -> Result<LossOutput> {
        if normalizer <= 0.0 {
            return Err(Error::Tokenize("the step has no trained tokens".into()));
        }
        for mut v in model.trainable_variables() {
            v.zero_grad();
        }
        let mut totals = LossOutput::zeros(self.device);
        for batch in batches {
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

    /// Clips the global gradient norm and applies AdamW; returns the norm before clipping.
    pub fn apply_gradients(&mut self, params: &[Tensor]) -> Result<f64> {
        let grad_norm = clip_grad_norm(params, self.max_grad_norm).double_value(&[]);
        if !grad_norm.is_finite() {
            return Err(Error::Torch {
                what: "optimizer step".into(),
                source: tch::TchError::Kind(format!("gradient norm is {grad_norm}; the update was not applied")),
            });
        }
        self.optimizer.step(params)?;
        Ok(grad_norm)
    }
}
