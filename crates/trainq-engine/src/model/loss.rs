//! Policy losses in tch: PPO clip, CISPO, token- or sequence-level (GSPO) ratio, k3 KL.
//!
//! Per trained token `t` of sequence `s` with advantage `A`, new log-prob `logp`, sampler
//! log-prob `old` (the detached new log-prob where the sampler sent none, so the ratio is 1):
//!
//! - ratio: token level `r_t = exp(logp_t − old_t)`; sequence level (GSPO)
//!   `r_t = exp(mean_{u∈s}(logp_u − old_u))`, one geometric-mean ratio per sequence, with
//!   gradient through every token of the sequence.
//! - PPO clip: `l_t = −min(r_t·A, clip(r_t, 1−ε, 1+ε_high)·A)`.
//! - CISPO: `l_t = −sg(clip(r_t, 1−ε, 1+ε_high))·A·logp_t` (stop-gradient weight).
//! - k3 KL to reference log-probs: `k_t = exp(ref_t − logp_t) − (ref_t − logp_t) − 1`.
//!
//! The loss is `Σ_t w_t·(l_t + kl_coef·k_t) / normalizer` with `w_t = 1` (token mean; the
//! normalizer is the global number of trained tokens) or `w_t = 1/|s|` (sequence mean; the
//! normalizer is the global number of trained sequences). The normalizer is an argument so that
//! micro-batches and data-parallel ranks each add their share of one global mean.

use tch::{Kind, Tensor};

use crate::error::{Error, Result};
use trainq_queue::config::{LossConfig, LossKind, LossNormalization, RatioLevel};

/// The per-token inputs of the loss; all tensors hold the same number of elements (any shape,
/// flattened), on one device.
#[derive(Debug)]
pub struct LossInputs<'a> {
    /// New log-probs of the targets under the policy being trained (differentiable).
    pub logprobs: &'a Tensor,
    /// Sampler log-probs of the targets; NaN where absent.
    pub sampler_logprobs: &'a Tensor,
    /// Per-token advantage.
    pub advantages: &'a Tensor,
    /// True (or 1.0) where the token is trained.
    pub mask: &'a Tensor,
    /// Sequence number `0..num_sequences` of each token; −1 on padding (must be masked).
    pub sequence_index: &'a Tensor,
    /// Number of sequences indexed by `sequence_index`.
    pub num_sequences: i64,
    /// Reference-model log-probs for the KL term; required when `kl_coef > 0`.
    pub reference_logprobs: Option<&'a Tensor>,
}

/// The loss and its parts. `loss` carries the gradient; the rest are detached scalars (no host
/// sync happens here; read them with `double_value` once per step).
#[derive(Debug)]
pub struct LossOutput {
    /// `(Σ w·l + kl_coef·Σ w·k) / normalizer`, differentiable.
    pub loss: Tensor,
    /// `Σ w·l / normalizer`.
    pub policy_loss: Tensor,
    /// `Σ w·k / normalizer` (before `kl_coef`); 0 without reference log-probs.
    pub kl: Tensor,
    /// Number of trained tokens whose ratio was clipped.
    pub clipped_tokens: Tensor,
    /// Sum of the ratio over trained tokens.
    pub ratio_sum: Tensor,
    /// Number of trained tokens.
    pub tokens: Tensor,
}

impl LossOutput {
    /// All parts zero, for summing micro-batches with [`LossOutput::add_detached`].
    pub fn zeros(device: tch::Device) -> Self {
        let z = || Tensor::zeros([], (Kind::Float, device));
        Self { loss: z(), policy_loss: z(), kl: z(), clipped_tokens: z(), ratio_sum: z(), tokens: z() }
    }

    /// Share of trained tokens whose ratio was clipped (reads the device: one host sync).
    pub fn clip_fraction(&self) -> f64 {
        self.clipped_tokens.double_value(&[]) / self.tokens.double_value(&[]).max(1.0)
    }

    /// Mean importance ratio over trained tokens (reads the device: one host sync).
    pub fn mean_ratio(&self) -> f64 {
        self.ratio_sum.double_value(&[]) / self.tokens.double_value(&[]).max(1.0)
    }

    /// Adds another micro-batch's parts (its loss detached).
    pub fn add_detached(&mut self, other: &LossOutput) {
        self.loss += other.loss.detach();
        self.policy_loss += &other.policy_loss;
        self.kl += &other.kl;
        self.clipped_tokens += &other.clipped_tokens;
        self.ratio_sum += &other.ratio_sum;
        self.tokens += &other.tokens;
    }
}

/// Computes the policy loss of one micro-batch (see the module docs for the formulas).
pub fn policy_loss(inputs: &LossInputs<'_>, cfg: &LossConfig, normalizer: f64) -> Result<LossOutput> {
    check_inputs(inputs, cfg, normalizer)?;
    let new = inputs.logprobs.flatten(0, -1);
    let mask = inputs.mask.flatten(0, -1).to_kind(Kind::Bool);
    let maskf = mask.to_kind(new.kind());
    let advantages = inputs.advantages.flatten(0, -1).to_kind(new.kind());
    let sampler = inputs.sampler_logprobs.flatten(0, -1).to_kind(new.kind());
    let old = sampler.where_self(&sampler.isnan().logical_not(), &new.detach());
    let zeros = new.zeros_like();
    let token_log_ratio = (&new - &old).where_self(&mask, &zeros);

    let seq = inputs.sequence_index.flatten(0, -1).clamp_min(0);
    let per_seq =
        |values: &Tensor| Tensor::zeros([inputs.num_sequences], (new.kind(), new.device())).index_add(0, &seq, values);
    let seq_tokens = per_seq(&maskf).clamp_min(1.0);
    let log_ratio = match cfg.ratio_level {
        RatioLevel::Token => token_log_ratio,
        RatioLevel::Sequence => (per_seq(&token_log_ratio) / &seq_tokens).index_select(0, &seq),
    };
    let ratio = log_ratio.exp();
    let (low, high) = (1.0 - cfg.epsilon, 1.0 + cfg.epsilon_high.unwrap_or(cfg.epsilon));
    let clipped_ratio = ratio.clamp(low, high);
    let (per_token, clipped) = match cfg.kind {
        LossKind::PpoClip => {
            let surrogate = (&ratio * &advantages).minimum(&(&clipped_ratio * &advantages));
            let clipped = ratio
                .lt(low)
                .logical_and(&advantages.lt(0.0))
                .logical_or(&ratio.gt(high).logical_and(&advantages.gt(0.0)));
            (-surrogate, clipped)
        }
        LossKind::Cispo => {
            let clipped = ratio.lt(low).logical_or(&ratio.gt(high));
            (-(clipped_ratio.detach() * &advantages * &new), clipped)
        }
    };
    let weights = match cfg.normalization {
        LossNormalization::TokenMean => maskf.shallow_clone(),
        LossNormalization::SequenceMean => &maskf / seq_tokens.index_select(0, &seq),
    };
    let policy_sum = (per_token.where_self(&mask, &zeros) * &weights).sum(Kind::Float);
    let kl_sum = match inputs.reference_logprobs {
        Some(reference) => {
            let d = (reference.flatten(0, -1).to_kind(new.kind()) - &new).where_self(&mask, &zeros);
            ((d.exp() - &d - 1.0) * &weights).sum(Kind::Float)
        }
        None => Tensor::zeros([], (Kind::Float, new.device())),
    };
    let loss = (&policy_sum + &kl_sum * cfg.kl_coef) / normalizer;
    Ok(LossOutput {
        loss,
        policy_loss: policy_sum.detach() / normalizer,
        kl: kl_sum.detach() / normalizer,
        clipped_tokens: clipped.logical_and(&mask).sum(Kind::Float),
        ratio_sum: (ratio.detach() * &maskf).sum(Kind::Float),
        tokens: maskf.sum(Kind::Float),
    })
}

fn check_inputs(inputs: &LossInputs<'_>, cfg: &LossConfig, normalizer: f64) -> Result<()> {
    let n = inputs.logprobs.numel();
    let mut named = vec![
        ("sampler_logprobs", inputs.sampler_logprobs),
        ("advantages", inputs.advantages),
        ("mask", inputs.mask),
        ("sequence_index", inputs.sequence_index),
    ];
    named.extend(inputs.reference_logprobs.map(|r| ("reference_logprobs", r)));
    if let Some((name, t)) = named.iter().find(|(_, t)| t.numel() != n) {
        let message = format!("loss input {name} has {} elements, logprobs has {n}", t.numel());
        return Err(Error::Torch { what: "policy loss inputs".into(), source: tch::TchError::Shape(message) });
    }
    if !(normalizer > 0.0 && normalizer.is_finite()) {
        return Err(Error::config("loss normalizer", format!("must be positive, got {normalizer}")));
    }
    if cfg.kl_coef > 0.0 && inputs.reference_logprobs.is_none() {
        return Err(Error::config("loss.kl_coef", "is positive but no reference log-probs were given"));
    }
    if inputs.num_sequences < 1 {
        return Err(Error::config("num_sequences", "must be at least 1"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs_for<'a>(
        new: &'a Tensor,
        old: &'a Tensor,
        adv: &'a Tensor,
        mask: &'a Tensor,
        seq: &'a Tensor,
    ) -> LossInputs<'a> {
        LossInputs {
            logprobs: new,
            sampler_logprobs: old,
            advantages: adv,
            mask,
            sequence_index: seq,
            num_sequences: 2,
            reference_logprobs: None,
        }
    }

    #[test]
    fn on_policy_ppo_loss_is_minus_the_mean_advantage() {
        let new = Tensor::from_slice(&[-1.0f32, -2.0, -0.5, -3.0]).set_requires_grad(true);
        let old = Tensor::from_slice(&[f32::NAN; 4]);
        let adv = Tensor::from_slice(&[1.0f32, 1.0, -2.0, 5.0]);
        let mask = Tensor::from_slice(&[true, true, true, false]);
        let seq = Tensor::from_slice(&[0i64, 0, 1, -1]);
        let out = policy_loss(&inputs_for(&new, &old, &adv, &mask, &seq), &LossConfig::default(), 3.0).unwrap();
        assert!((out.loss.double_value(&[]) - 0.0).abs() < 1e-6, "ratio 1 everywhere: −(1+1−2)/3");
        assert_eq!((out.ratio_sum.double_value(&[]), out.mean_ratio()), (3.0, 1.0));
        assert_eq!(out.clipped_tokens.double_value(&[]), 0.0);
        out.loss.backward();
        let grad: Vec<f32> = Vec::try_from(new.grad()).unwrap();
        assert_eq!(grad, vec![-1.0 / 3.0, -1.0 / 3.0, 2.0 / 3.0, 0.0]);
    }

    #[test]
    fn clipped_tokens_are_counted_and_carry_no_gradient() {
        let new = Tensor::from_slice(&[0.0f32, 0.0]).set_requires_grad(true);
        let old = Tensor::from_slice(&[-1.0f32, -1.0]);
        let adv = Tensor::from_slice(&[1.0f32, -1.0]);
        let mask = Tensor::from_slice(&[true, true]);
        let seq = Tensor::from_slice(&[0i64, 1]);
        let out = policy_loss(&inputs_for(&new, &old, &adv, &mask, &seq), &LossConfig::default(), 2.0).unwrap();
        assert_eq!(out.clipped_tokens.double_value(&[]), 1.0);
        assert_eq!(out.clip_fraction(), 0.5);
        out.loss.backward();
        let grad: Vec<f32> = Vec::try_from(new.grad()).unwrap();
        assert_eq!(grad[0], 0.0, "ratio e > 1.2 with A > 0 is clipped");
        assert!((grad[1] - std::f32::consts::E / 2.0).abs() < 1e-5);
    }

    #[test]
    fn a_positive_kl_coef_needs_reference_logprobs() {
        let t = Tensor::from_slice(&[0.0f32]);
        let seq = Tensor::from_slice(&[0i64]);
        let cfg = LossConfig { kl_coef: 0.1, ..LossConfig::default() };
        assert!(policy_loss(&inputs_for(&t, &t, &t, &t, &seq), &cfg, 1.0).is_err());
    }
}
