//! AdamW with decoupled weight decay over plain tensors, and global gradient-norm clipping.
//!
//! tch 0.24 does not generate bindings for libtorch's `_fused_adamw_` (its generator skips
//! `_fused_adam*` and `_foreach*`), so the update is written with in-place tensor ops under
//! `no_grad`, exactly as `torch.optim.AdamW` (single-tensor path) computes it:
//! `p ← p·(1 − lr·wd)`, `m ← β1·m + (1−β1)·g`, `v ← β2·v + (1−β2)·g²`,
//! `p ← p − lr/(1−β1^t) · m / (√v/√(1−β2^t) + eps)`. Moments are kept in f32 whatever the
//! parameter's dtype, and are exposed by name for checkpoints.

use tch::{Kind, Tensor};

use crate::config::OptimizerConfig;
use crate::error::{Error, Result};

/// Name of the step-count entry in [`AdamW::named_state`].
pub const STEP_STATE_NAME: &str = "step";

/// AdamW state for an ordered list of parameters.
#[derive(Debug)]
pub struct AdamW {
    cfg: OptimizerConfig,
    steps: i64,
    exp_avg: Vec<Tensor>,
    exp_avg_sq: Vec<Tensor>,
}

impl AdamW {
    /// A fresh optimizer; moments are created on the first step.
    pub fn new(cfg: OptimizerConfig) -> Self {
        Self { cfg, steps: 0, exp_avg: Vec::new(), exp_avg_sq: Vec::new() }
    }

    /// Number of steps taken.
    pub fn steps(&self) -> i64 {
        self.steps
    }

    /// Current learning rate.
    pub fn learning_rate(&self) -> f64 {
        self.cfg.learning_rate
    }

    /// Changes the learning rate (for schedules).
    pub fn set_learning_rate(&mut self, learning_rate: f64) {
        self.cfg.learning_rate = learning_rate;
    }

    /// Applies one update to `params` from their `.grad()`. A parameter without a gradient is
    /// updated as if its gradient were zero (PyTorch would skip it); the list must keep its order.
    pub fn step(&mut self, params: &[Tensor]) -> Result<()> {
        if self.exp_avg.is_empty() {
            self.exp_avg = params.iter().map(|p| Tensor::zeros_like(&p.to_kind(Kind::Float)).detach()).collect();
            self.exp_avg_sq = self.exp_avg.iter().map(|m| m.zeros_like()).collect();
        }
        if self.exp_avg.len() != params.len() {
            return Err(Error::config("optimizer", format!("state holds {} tensors, got {} parameters", self.exp_avg.len(), params.len())));
        }
        self.steps += 1;
        let (b1, b2) = self.cfg.betas;
        let lr = self.cfg.learning_rate;
        let bias1 = 1.0 - b1.powi(self.steps as i32);
        let bias2_sqrt = (1.0 - b2.powi(self.steps as i32)).sqrt();
        tch::no_grad(|| {
            for ((param, m), v) in params.iter().zip(&mut self.exp_avg).zip(&mut self.exp_avg_sq) {
                let grad = param.grad();
                let grad = if grad.defined() { grad.to_kind(Kind::Float) } else { m.zeros_like() };
                let mut p32 = param.detach().to_kind(Kind::Float);
                let _ = p32.g_mul_scalar_(1.0 - lr * self.cfg.weight_decay);
                let _ = m.g_mul_scalar_(b1);
                let _ = m.g_add_(&(&grad * (1.0 - b1)));
                let _ = v.g_mul_scalar_(b2);
                let _ = v.addcmul_(&(&grad * (1.0 - b2)), &grad);
                let denom = v.sqrt() / bias2_sqrt + self.cfg.eps;
                let _ = p32.g_add_(&(&*m / denom * (-lr / bias1)));
                if param.kind() != Kind::Float {
                    let mut target = param.detach();
                    target.copy_(&p32);
                }
            }
        });
        Ok(())
    }

    /// The state as named tensors: `step` (a scalar), `exp_avg.{i}` and `exp_avg_sq.{i}` for
    /// parameter `i` of the list given to [`AdamW::step`].
    pub fn named_state(&self) -> Vec<(String, Tensor)> {
        let mut state = vec![(STEP_STATE_NAME.to_string(), Tensor::from(self.steps))];
        for (i, (m, v)) in self.exp_avg.iter().zip(&self.exp_avg_sq).enumerate() {
            state.push((format!("exp_avg.{i}"), m.shallow_clone()));
            state.push((format!("exp_avg_sq.{i}"), v.shallow_clone()));
        }
        state
    }

    /// Restores state saved by [`AdamW::named_state`] for `params` (moments move to each
    /// parameter's device; shapes must match).
    pub fn load_named_state(&mut self, state: &[(String, Tensor)], params: &[Tensor]) -> Result<()> {
        let find = |name: &str| {
            state
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, t)| t)
                .ok_or_else(|| Error::Checkpoint { path: "optimizer state".into(), message: format!("missing {name}") })
        };
        let steps = find(STEP_STATE_NAME)?.int64_value(&[]);
        let moment = |name: String, param: &Tensor| -> Result<Tensor> {
            let t = find(&name)?;
            if t.size() != param.size() {
                let message = format!("{name} has shape {:?}, parameter has {:?}", t.size(), param.size());
                return Err(Error::Checkpoint { path: "optimizer state".into(), message });
            }
            Ok(t.to_device(param.device()).to_kind(Kind::Float).detach().copy())
        };
        let exp_avg = params.iter().enumerate().map(|(i, p)| moment(format!("exp_avg.{i}"), p)).collect::<Result<Vec<_>>>()?;
        let exp_avg_sq = params.iter().enumerate().map(|(i, p)| moment(format!("exp_avg_sq.{i}"), p)).collect::<Result<Vec<_>>>()?;
        *self = Self { cfg: self.cfg.clone(), steps, exp_avg, exp_avg_sq };
        Ok(())
    }
}

/// Scales all gradients so their global L2 norm is at most `max_norm` (0 disables), as
/// `torch.nn.utils.clip_grad_norm_` does (coefficient `max_norm / (norm + 1e-6)`, capped at 1).
/// Returns the norm before clipping as a scalar tensor (no host sync).
pub fn clip_grad_norm(params: &[Tensor], max_norm: f64) -> Tensor {
    tch::no_grad(|| {
        let grads: Vec<Tensor> = params.iter().map(|p| p.grad()).filter(|g| g.defined()).collect();
        let Some(first) = grads.first() else { return Tensor::from(0.0f32) };
        let squares: Vec<Tensor> = grads.iter().map(|g| g.to_kind(Kind::Float).square().sum(Kind::Float)).collect();
        let total = Tensor::stack(&squares, 0).to_device(first.device()).sum(Kind::Float).sqrt();
        if max_norm > 0.0 {
            let coef = (max_norm / (&total + 1e-6)).clamp_max(1.0);
            for g in &grads {
                let _ = g.shallow_clone().g_mul_(&coef.to_kind(g.kind()));
            }
        }
        total
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_step_moves_each_weight_by_about_the_learning_rate() {
        let p = Tensor::from_slice(&[1.0f32, -1.0]).set_requires_grad(true);
        (&p * Tensor::from_slice(&[2.0f32, -3.0])).sum(Kind::Float).backward();
        let cfg = OptimizerConfig { learning_rate: 0.1, weight_decay: 0.0, ..OptimizerConfig::default() };
        let mut opt = AdamW::new(cfg);
        opt.step(std::slice::from_ref(&p)).unwrap();
        let after: Vec<f32> = Vec::try_from(p.detach()).unwrap();
        assert!((after[0] - 0.9).abs() < 1e-5 && (after[1] + 0.9).abs() < 1e-5, "{after:?}");
        assert_eq!(opt.steps(), 1);
    }

    #[test]
    fn named_state_round_trips() {
        let p = Tensor::from_slice(&[1.0f32, 2.0]).set_requires_grad(true);
        p.sum(Kind::Float).backward();
        let mut opt = AdamW::new(OptimizerConfig::default());
        opt.step(std::slice::from_ref(&p)).unwrap();
        let mut restored = AdamW::new(OptimizerConfig::default());
        restored.load_named_state(&opt.named_state(), std::slice::from_ref(&p)).unwrap();
        assert_eq!(restored.steps(), 1);
        let names: Vec<String> = restored.named_state().into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, vec!["step", "exp_avg.0", "exp_avg_sq.0"]);
        assert!(restored.exp_avg[0].equal(&opt.exp_avg[0]) && restored.exp_avg_sq[0].equal(&opt.exp_avg_sq[0]));
    }

    #[test]
    fn gradients_are_clipped_to_the_global_norm() {
        let a = Tensor::from_slice(&[0.0f32]).set_requires_grad(true);
        let b = Tensor::from_slice(&[0.0f32]).set_requires_grad(true);
        (&a * 3.0 + &b * 4.0).sum(Kind::Float).backward();
        let norm = clip_grad_norm(&[a.shallow_clone(), b.shallow_clone()], 1.0);
        assert!((norm.double_value(&[]) - 5.0).abs() < 1e-6);
        assert!((a.grad().double_value(&[0]) - 0.6).abs() < 1e-5);
        assert!((b.grad().double_value(&[0]) - 0.8).abs() < 1e-5);
    }
}
